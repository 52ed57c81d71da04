// The host prefetcher and the C API's dispatch (see prefetch.h). The host prefetcher is what
// CPU-only builds use: the same calls as on CUDA, done with plain copies in the calling thread.
#include <new>
#include <string>

#include "prefetch_impl.h"

namespace tawpipe::prefetch {
namespace {

thread_local std::string last_error;

int check_args(const char* op, const void* a, const void* b, int dtype, int64_t numel) {
  if (numel < 0) return fail(TAWPIPE_ERR_INVALID_ARGUMENT, std::string(op) + ": negative numel");
  if (dtype_size(dtype) == 0) {
    return fail(TAWPIPE_ERR_INVALID_ARGUMENT, std::string(op) + ": unsupported dtype code " + std::to_string(dtype));
  }
  if (numel > 0 && (a == nullptr || b == nullptr)) {
    return fail(TAWPIPE_ERR_INVALID_ARGUMENT, std::string(op) + ": null buffer");
  }
  return TAWPIPE_OK;
}

struct HostPrefetcher final : tawpipe_prefetcher {
  using tawpipe_prefetcher::tawpipe_prefetcher;

  int load(const float* src, void* dst, int dst_dtype, int64_t numel, CUstream_st*) override {
    const tawpipe_segment seg{src, dst, numel, TAWPIPE_DTYPE_F32, dst_dtype};
    const int status = tawpipe_shard_segments_cpu(&seg, 1, 0, 1.0f, num_threads);
    return status == TAWPIPE_OK ? status : fail(status, std::string("prefetch load: ") + tawpipe_status_string(status));
  }

  int accumulate(const void* src, int src_dtype, float* acc, int64_t numel, float alpha, CUstream_st*,
                 double, double* sum_of_squares) override {
    return host_accumulate("prefetch accumulate", acc, src, src_dtype, numel, alpha, num_threads, sum_of_squares);
  }

  int synchronize(double) override { return TAWPIPE_OK; }
};

}  // namespace

int fail(int status, const std::string& message) {
  last_error = message;
  return status;
}

size_t dtype_size(int dtype) {
  switch (dtype) {
    case TAWPIPE_DTYPE_F32: return 4;
    case TAWPIPE_DTYPE_BF16:
    case TAWPIPE_DTYPE_F16: return 2;
    default: return 0;
  }
}

int host_accumulate(const char* op, float* acc, const void* src, int src_dtype, int64_t numel, float alpha,
                    int num_threads, double* sum_of_squares) {
  const tawpipe_segment seg{src, acc, numel, src_dtype, TAWPIPE_DTYPE_F32};
  const int status =
      sum_of_squares == nullptr
          ? tawpipe_shard_segments_cpu(&seg, 1, 1, alpha, num_threads)
          : tawpipe_accumulate_squares_cpu(acc, src, src_dtype, numel, alpha, num_threads, sum_of_squares);
  return status == TAWPIPE_OK ? status : fail(status, std::string(op) + ": " + tawpipe_status_string(status));
}

}  // namespace tawpipe::prefetch

using tawpipe::prefetch::check_args;
using tawpipe::prefetch::fail;

extern "C" {

int tawpipe_prefetch_create_host(int64_t piece_numel, int num_threads, tawpipe_prefetcher** out) {
  if (out == nullptr || piece_numel < 1) {
    return fail(TAWPIPE_ERR_INVALID_ARGUMENT, "prefetch create: need piece_numel >= 1 and an output pointer");
  }
  *out = new (std::nothrow) tawpipe::prefetch::HostPrefetcher(piece_numel, num_threads);
  return *out != nullptr ? TAWPIPE_OK : fail(TAWPIPE_ERR_OUT_OF_MEMORY, "prefetch create: out of memory");
}

void tawpipe_prefetch_destroy(tawpipe_prefetcher* p) { delete p; }

int tawpipe_prefetch_load(tawpipe_prefetcher* p, const float* src, void* dst, int dst_dtype, int64_t numel,
                          CUstream_st* stream) {
  if (p == nullptr) return fail(TAWPIPE_ERR_INVALID_ARGUMENT, "prefetch load: null prefetcher");
  const int status = check_args("prefetch load", src, dst, dst_dtype, numel);
  return status != TAWPIPE_OK || numel == 0 ? status : p->load(src, dst, dst_dtype, numel, stream);
}

int tawpipe_prefetch_accumulate(tawpipe_prefetcher* p, const void* src, int src_dtype, float* acc, int64_t numel,
                                float alpha, CUstream_st* stream, double timeout_s) {
  if (p == nullptr) return fail(TAWPIPE_ERR_INVALID_ARGUMENT, "prefetch accumulate: null prefetcher");
  const int status = check_args("prefetch accumulate", src, acc, src_dtype, numel);
  return status != TAWPIPE_OK || numel == 0
             ? status
             : p->accumulate(src, src_dtype, acc, numel, alpha, stream, timeout_s, nullptr);
}

int tawpipe_prefetch_accumulate_norm(tawpipe_prefetcher* p, const void* src, int src_dtype, float* acc,
                                     int64_t numel, float alpha, CUstream_st* stream, double timeout_s,
                                     double* sum_of_squares) {
  if (p == nullptr || sum_of_squares == nullptr) {
    return fail(TAWPIPE_ERR_INVALID_ARGUMENT, "prefetch accumulate norm: null prefetcher or sum_of_squares");
  }
  *sum_of_squares = 0.0;
  const int status = check_args("prefetch accumulate norm", src, acc, src_dtype, numel);
  return status != TAWPIPE_OK || numel == 0
             ? status
             : p->accumulate(src, src_dtype, acc, numel, alpha, stream, timeout_s, sum_of_squares);
}

int tawpipe_prefetch_synchronize(tawpipe_prefetcher* p, double timeout_s) {
  if (p == nullptr) return fail(TAWPIPE_ERR_INVALID_ARGUMENT, "prefetch synchronize: null prefetcher");
  return p->synchronize(timeout_s);
}

int64_t tawpipe_prefetch_piece_numel(const tawpipe_prefetcher* p) { return p->piece_numel; }
size_t tawpipe_prefetch_device_bytes(const tawpipe_prefetcher* p) { return p->device_bytes; }
size_t tawpipe_prefetch_host_bytes(const tawpipe_prefetcher* p) { return p->host_bytes; }

const char* tawpipe_prefetch_last_error(void) { return tawpipe::prefetch::last_error.c_str(); }

}  // extern "C"
