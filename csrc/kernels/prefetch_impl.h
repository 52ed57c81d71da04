// Internals shared by the host (prefetch.cpp) and CUDA (prefetch_cuda.cu) prefetchers.
#pragma once

#include <string>

#include "prefetch.h"

// The C handle is the base of both implementations; the C functions dispatch through it.
struct tawpipe_prefetcher {
  tawpipe_prefetcher(int64_t piece, int threads) : piece_numel(piece), num_threads(threads) {}
  virtual ~tawpipe_prefetcher() = default;
  virtual int load(const float* src, void* dst, int dst_dtype, int64_t numel, CUstream_st* stream) = 0;
  // sum_of_squares: nullptr, or where the sum of acc's squares after the addition goes
  virtual int accumulate(const void* src, int src_dtype, float* acc, int64_t numel, float alpha,
                         CUstream_st* stream, double timeout_s, double* sum_of_squares) = 0;
  virtual int synchronize(double timeout_s) = 0;

  const int64_t piece_numel;
  const int num_threads;
  size_t device_bytes = 0;
  size_t host_bytes = 0;
};

namespace tawpipe::prefetch {

// Records message as this thread's last error and returns status.
int fail(int status, const std::string& message);

// acc[i] += alpha * float(src[i]) on the host, with the shard kernels' CPU loop; with
// sum_of_squares, the sum of acc's squares after it, taken in the same pass.
int host_accumulate(const char* op, float* acc, const void* src, int src_dtype, int64_t numel, float alpha,
                    int num_threads, double* sum_of_squares);

// Bytes of one element of a TAWPIPE_DTYPE_*, or 0 for an unknown type.
size_t dtype_size(int dtype);

}  // namespace tawpipe::prefetch
