// The CUDA prefetcher (see prefetch.h): pieces move through two alternating staging buffers, the
// copies on one stream and the casts on another, ordered by events, so copies run back to back
// while the casts (or, for gradients, the host-side accumulation) trail one piece behind. Loads
// (h2d and cast streams) and accumulations (d2h stream) share no state, so one thread may load
// while another accumulates, each direction on its own copy engine.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <new>
#include <string>
#include <thread>

#include "prefetch_impl.h"

namespace tawpipe::prefetch {
namespace {

using Clock = std::chrono::steady_clock;

std::string cuda_message(const char* op, const char* call, cudaError_t err) {
  return std::string(op) + ": " + call + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// Returns from the enclosing int function with TAWPIPE_ERR_CUDA, naming the call, on error.
#define TAWPIPE_PREFETCH_CUDA(op, call)                                        \
  do {                                                                         \
    const cudaError_t err_ = (call);                                           \
    if (err_ != cudaSuccess) return fail(TAWPIPE_ERR_CUDA, cuda_message(op, #call, err_)); \
  } while (0)

// Makes `device` current for a scope and restores the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  bool switched_ = false;
  cudaError_t status_ = cudaSuccess;
};

// cudaSuccess once `done` reports completion, cudaErrorNotReady past the deadline, else the
// error. Spins briefly (the common case is a short wait), then sleeps between queries.
template <typename Query>
cudaError_t wait_until(Query done, Clock::time_point deadline) {
  const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(200);
  for (;;) {
    const cudaError_t status = done();
    if (status != cudaErrorNotReady) return status;
    const Clock::time_point now = Clock::now();
    if (now > deadline) return cudaErrorNotReady;
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

__device__ inline uint16_t to_bits(float v, int dtype) {
  return dtype == TAWPIPE_DTYPE_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v))
                                     : __half_as_ushort(__float2half_rn(v));
}

// dst[i] = cast(src[i]) for a 16-bit dst dtype (rounded to nearest even).
__global__ void cast_to_16bit(const float* __restrict__ src, uint16_t* __restrict__ dst, int64_t n, int dtype) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = to_bits(src[i], dtype);
  }
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

class CudaPrefetcher final : public tawpipe_prefetcher {
 public:
  CudaPrefetcher(int device, int64_t piece, int threads) : tawpipe_prefetcher(piece, threads), device_(device) {}

  // Allocates streams, events and staging; returns a status (the object is unusable on error).
  int init() {
    constexpr const char* op = "prefetch create";
    DeviceScope scope(device_);
    TAWPIPE_PREFETCH_CUDA(op, scope.status());
    int least = 0, greatest = 0;
    TAWPIPE_PREFETCH_CUDA(op, cudaDeviceGetStreamPriorityRange(&least, &greatest));
    for (cudaStream_t* s : {&h2d_stream_, &cast_stream_, &d2h_stream_}) {
      TAWPIPE_PREFETCH_CUDA(op, cudaStreamCreateWithPriority(s, cudaStreamNonBlocking, greatest));
    }
    for (cudaEvent_t* e : {&start_, &done_, &ready_, &copied_[0], &copied_[1], &freed_[0], &freed_[1],
                           &fetched_[0], &fetched_[1]}) {
      TAWPIPE_PREFETCH_CUDA(op, cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
    const size_t bytes = static_cast<size_t>(piece_numel) * sizeof(float);
    for (int b = 0; b < 2; ++b) {
      TAWPIPE_PREFETCH_CUDA(op, cudaMalloc(&device_staging_[b], bytes));
      TAWPIPE_PREFETCH_CUDA(op, cudaHostAlloc(&host_staging_[b], bytes, cudaHostAllocDefault));
    }
    device_bytes = host_bytes = 2 * bytes;
    return TAWPIPE_OK;
  }

  ~CudaPrefetcher() override {
    if (h2d_stream_ == nullptr) return;  // init failed before allocating anything
    DeviceScope scope(device_);
    // Free nothing a queued copy may still touch: wait (bounded) for the streams, else leak.
    const Clock::time_point deadline = deadline_after(60.0);
    for (cudaStream_t s : {h2d_stream_, cast_stream_, d2h_stream_}) {
      if (s != nullptr && wait_until([&] { return cudaStreamQuery(s); }, deadline) != cudaSuccess) return;
    }
    for (int b = 0; b < 2; ++b) {
      if (device_staging_[b] != nullptr) cudaFree(device_staging_[b]);
      if (host_staging_[b] != nullptr) cudaFreeHost(host_staging_[b]);
    }
    for (cudaEvent_t e : {start_, done_, ready_, copied_[0], copied_[1], freed_[0], freed_[1], fetched_[0],
                          fetched_[1]}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaStream_t s : {h2d_stream_, cast_stream_, d2h_stream_}) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  int load(const float* src, void* dst, int dst_dtype, int64_t numel, CUstream_st* stream) override {
    constexpr const char* op = "prefetch load";
    if (const int status = usable(op)) return status;
    DeviceScope scope(device_);
    TAWPIPE_PREFETCH_CUDA(op, scope.status());
    TAWPIPE_PREFETCH_CUDA(op, cudaEventRecord(start_, stream));  // dst is free once stream gets here
    if (dst_dtype == TAWPIPE_DTYPE_F32) {  // no cast: straight into dst, one copy
      TAWPIPE_PREFETCH_CUDA(op, cudaStreamWaitEvent(h2d_stream_, start_, 0));
      TAWPIPE_PREFETCH_CUDA(op, cudaMemcpyAsync(dst, src, static_cast<size_t>(numel) * sizeof(float),
                                                cudaMemcpyHostToDevice, h2d_stream_));
      TAWPIPE_PREFETCH_CUDA(op, cudaEventRecord(done_, h2d_stream_));
    } else {
      TAWPIPE_PREFETCH_CUDA(op, cudaStreamWaitEvent(cast_stream_, start_, 0));
      auto* out = static_cast<uint16_t*>(dst);
      for (int64_t k = 0, offset = 0; offset < numel; ++k, offset += piece_numel) {
        const int b = static_cast<int>(k % 2);
        const int64_t n = numel - offset < piece_numel ? numel - offset : piece_numel;
        // The copy into staging b waits only for the cast that last read it.
        TAWPIPE_PREFETCH_CUDA(op, cudaStreamWaitEvent(h2d_stream_, freed_[b], 0));
        TAWPIPE_PREFETCH_CUDA(op, cudaMemcpyAsync(device_staging_[b], src + offset, static_cast<size_t>(n) * sizeof(float),
                                                  cudaMemcpyHostToDevice, h2d_stream_));
        TAWPIPE_PREFETCH_CUDA(op, cudaEventRecord(copied_[b], h2d_stream_));
        TAWPIPE_PREFETCH_CUDA(op, cudaStreamWaitEvent(cast_stream_, copied_[b], 0));
        const int64_t blocks = (n + kThreads - 1) / kThreads < kMaxBlocks ? (n + kThreads - 1) / kThreads : kMaxBlocks;
        cast_to_16bit<<<static_cast<unsigned>(blocks), kThreads, 0, cast_stream_>>>(
            static_cast<const float*>(device_staging_[b]), out + offset, n, dst_dtype);
        TAWPIPE_PREFETCH_CUDA(op, cudaGetLastError());
        TAWPIPE_PREFETCH_CUDA(op, cudaEventRecord(freed_[b], cast_stream_));
      }
      TAWPIPE_PREFETCH_CUDA(op, cudaEventRecord(done_, cast_stream_));
    }
    TAWPIPE_PREFETCH_CUDA(op, cudaStreamWaitEvent(stream, done_, 0));
    return TAWPIPE_OK;
  }

  int accumulate(const void* src, int src_dtype, float* acc, int64_t numel, float alpha, CUstream_st* stream,
                 double timeout_s, double* sum_of_squares) override {
    constexpr const char* op = "prefetch accumulate";
    if (const int status = usable(op)) return status;
    DeviceScope scope(device_);
    TAWPIPE_PREFETCH_CUDA(op, scope.status());
    const Clock::time_point deadline = deadline_after(timeout_s);
    const size_t esize = dtype_size(src_dtype);
    const int64_t pieces = (numel + piece_numel - 1) / piece_numel;
    TAWPIPE_PREFETCH_CUDA(op, cudaEventRecord(ready_, stream));  // src is complete once stream gets here
    TAWPIPE_PREFETCH_CUDA(op, cudaStreamWaitEvent(d2h_stream_, ready_, 0));
    auto piece_size = [&](int64_t k) { return numel - k * piece_numel < piece_numel ? numel - k * piece_numel : piece_numel; };
    auto fetch = [&](int64_t k) -> int {
      const int b = static_cast<int>(k % 2);
      TAWPIPE_PREFETCH_CUDA(op, cudaMemcpyAsync(host_staging_[b], static_cast<const char*>(src) + k * piece_numel * esize,
                                                static_cast<size_t>(piece_size(k)) * esize, cudaMemcpyDeviceToHost,
                                                d2h_stream_));
      TAWPIPE_PREFETCH_CUDA(op, cudaEventRecord(fetched_[b], d2h_stream_));
      return TAWPIPE_OK;
    };
    for (int64_t k = 0; k < pieces && k < 2; ++k) {
      if (const int status = fetch(k)) return status;
    }
    for (int64_t k = 0; k < pieces; ++k) {
      const int b = static_cast<int>(k % 2);
      const cudaError_t waited = wait_until([&] { return cudaEventQuery(fetched_[b]); }, deadline);
      if (waited == cudaErrorNotReady) {
        failed_ = true;  // a copy into host staging may still land: this prefetcher is done
        return fail(TAWPIPE_ERR_TIMEOUT,
                    std::string(op) + ": piece " + std::to_string(k) + " of " + std::to_string(pieces) +
                        " did not arrive within " + std::to_string(timeout_s) +
                        " s; the producer stream never reached this point (is it waiting for a transfer "
                        "that never comes?)");
      }
      TAWPIPE_PREFETCH_CUDA(op, waited);
      double piece_squares = 0.0;
      const int status = host_accumulate(op, acc + k * piece_numel, host_staging_[b], src_dtype, piece_size(k), alpha,
                                         num_threads, sum_of_squares != nullptr ? &piece_squares : nullptr);
      if (status != TAWPIPE_OK) return status;
      if (sum_of_squares != nullptr) *sum_of_squares += piece_squares;
      if (k + 2 < pieces) {
        if (const int fetched = fetch(k + 2)) return fetched;
      }
    }
    return TAWPIPE_OK;
  }

  int synchronize(double timeout_s) override {
    constexpr const char* op = "prefetch synchronize";
    DeviceScope scope(device_);
    TAWPIPE_PREFETCH_CUDA(op, scope.status());
    const Clock::time_point deadline = deadline_after(timeout_s);
    for (cudaStream_t s : {h2d_stream_, cast_stream_}) {
      const cudaError_t status = wait_until([&] { return cudaStreamQuery(s); }, deadline);
      if (status == cudaErrorNotReady) {
        return fail(TAWPIPE_ERR_TIMEOUT, std::string(op) + ": queued loads did not finish within " +
                                             std::to_string(timeout_s) + " s");
      }
      TAWPIPE_PREFETCH_CUDA(op, status);
    }
    return TAWPIPE_OK;
  }

 private:
  int usable(const char* op) const {
    return failed_ ? fail(TAWPIPE_ERR_TIMEOUT, std::string(op) + ": this prefetcher timed out earlier and may "
                                                                  "still have copies in flight; create a new one")
                   : TAWPIPE_OK;
  }

  const int device_;
  std::atomic<bool> failed_{false};
  cudaStream_t h2d_stream_ = nullptr;
  cudaStream_t cast_stream_ = nullptr;
  cudaStream_t d2h_stream_ = nullptr;
  cudaEvent_t start_ = nullptr, done_ = nullptr, ready_ = nullptr;
  cudaEvent_t copied_[2] = {nullptr, nullptr};   // staging b filled (load)
  cudaEvent_t freed_[2] = {nullptr, nullptr};    // staging b read by its cast (load)
  cudaEvent_t fetched_[2] = {nullptr, nullptr};  // host staging b filled (accumulate)
  void* device_staging_[2] = {nullptr, nullptr};
  void* host_staging_[2] = {nullptr, nullptr};
};

}  // namespace
}  // namespace tawpipe::prefetch

extern "C" int tawpipe_prefetch_create_cuda(int device, int64_t piece_numel, int num_threads,
                                            tawpipe_prefetcher** out) {
  using tawpipe::prefetch::fail;
  if (out == nullptr || piece_numel < 1 || device < 0) {
    return fail(TAWPIPE_ERR_INVALID_ARGUMENT, "prefetch create: need device >= 0, piece_numel >= 1, an output pointer");
  }
  auto* p = new (std::nothrow) tawpipe::prefetch::CudaPrefetcher(device, piece_numel, num_threads);
  if (p == nullptr) return fail(TAWPIPE_ERR_OUT_OF_MEMORY, "prefetch create: out of memory");
  const int status = p->init();
  if (status != TAWPIPE_OK) {
    delete p;
    return status;
  }
  *out = p;
  return TAWPIPE_OK;
}
