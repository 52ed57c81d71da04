// Runs CUDA kernels on the host, for machines without a GPU (tests/test_kernels_build.py).
//
// Force-included (-include) before a kernel source compiled as plain C++ with the CUDA headers
// on the include path. Every thread of every block runs sequentially, which is faithful for
// kernels whose threads never communicate (no shared memory, no __syncthreads), like the shard
// kernels. The test rewrites `kernel<<<grid, block, smem, stream>>>(args)` into
// `emulated_launch(kernel, grid, block, args)`; runtime calls are replaced by host memory ops.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

inline thread_local uint3 emulated_thread_idx;
inline thread_local uint3 emulated_block_idx;
inline thread_local dim3 emulated_grid_dim;
#define threadIdx emulated_thread_idx
#define blockIdx emulated_block_idx
#define gridDim emulated_grid_dim
#define __launch_bounds__(...)
#define __grid_constant__

// Cache-hinted accesses are plain accesses on the host.
template <class T>
T __ldcs(const T* p) {
  return *p;
}
template <class T>
void __stcs(T* p, T v) {
  *p = v;
}

// Few "SMs" and resident blocks, so grids are small and each block walks many tiles and segments.
constexpr int kEmulatedMultiprocessors = 3;
constexpr int kEmulatedBlocksPerMultiprocessor = 2;

inline cudaError_t emulated_copy(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

inline cudaError_t emulated_not_capturing(cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

#define cudaMemcpyAsync(dst, src, bytes, kind, stream) emulated_copy(dst, src, bytes)
#define cudaMemcpy(dst, src, bytes, kind) emulated_copy(dst, src, bytes)
#define cudaStreamIsCapturing(stream, status) emulated_not_capturing(status)
#define cudaGetDevice(device) (*(device) = 0, cudaSuccess)
#define cudaDeviceGetAttribute(value, attr, device) (*(value) = kEmulatedMultiprocessors, cudaSuccess)
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, smem) \
  (*(blocks) = kEmulatedBlocksPerMultiprocessor, cudaSuccess)
#define cudaGetLastError() cudaSuccess
#define cudaMalloc(ptr, bytes) (*(ptr) = std::malloc(bytes), cudaSuccess)
#define cudaFree(ptr) (std::free(ptr), cudaSuccess)
#define cudaGetDeviceCount(count) (*(count) = 1, cudaSuccess)
#define cudaDeviceSynchronize() cudaSuccess

template <class Kernel, class... Args>
void emulated_launch(Kernel kernel, unsigned grid, int block, Args... args) {
  emulated_grid_dim = dim3(grid);
  for (unsigned b = 0; b < grid; ++b) {
    for (int t = 0; t < block; ++t) {
      emulated_block_idx = make_uint3(b, 0, 0);
      emulated_thread_idx = make_uint3(static_cast<unsigned>(t), 0, 0);
      kernel(args...);
    }
  }
}
