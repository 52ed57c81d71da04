// CUDA implementation of the shard kernels (see shard_ops.h).
//
// One launch per call, whatever the number of tensors: the segments are cut into tiles of
// kTile elements, numbered consecutively across segments, and a device-side table records each
// segment's first tile. Every block takes an equal, contiguous run of tiles (so work is balanced
// by element count, not by tensor count), finds its first segment by binary search once, then
// walks forward. A tile of a segment whose pointers are aligned uses 16-byte vector accesses;
// a whole such tile issues all its loads before its first store, so each thread keeps
// kTile / kThreads elements in flight. A table of up to kInlineSegments rows travels in the
// kernel's parameters, so the common call (one layer chunk: tens of tensors) needs neither a
// device workspace nor a host-to-device copy before the kernel.
#include "shard_ops.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <new>
#include <vector>

#include "shard_dtypes.h"

namespace {

using tawpipe::kernels::add_scaled;
using tawpipe::kernels::dispatch_dtype_pair;
using tawpipe::kernels::dtype_bytes;
using tawpipe::kernels::Elem;
using tawpipe::kernels::valid_dtype;

constexpr int kThreads = 256;
constexpr int64_t kTile = 4096;  // elements per work item; a multiple of kThreads * 8
// Rows that fit in a launch's parameters: 64 x 48 bytes, within the 4 KiB every GPU accepts.
constexpr int64_t kInlineSegments = TAWPIPE_SHARD_CUDA_INLINE_SEGMENTS;

// One row of the device table. Only segments with numel > 0 are stored, so first_tile is
// strictly increasing.
struct DeviceSegment {
  const void* src;
  void* dst;
  int64_t numel;
  int64_t first_tile;
  int32_t src_dtype;
  int32_t dst_dtype;
  int32_t vectorized;  // both pointers aligned to a full vector of their element type
  int32_t unused;
};

thread_local const char* g_last_cuda_error = "no error";

// Elements per vector access for a dtype pair: the wider side moves 16 bytes.
__host__ __device__ constexpr int vector_width(int src_dtype, int dst_dtype) {
  return 16 / (dtype_bytes(src_dtype) > dtype_bytes(dst_dtype) ? dtype_bytes(src_dtype)
                                                               : dtype_bytes(dst_dtype));
}

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// The table's rows when they fit in the launch's parameters.
struct InlineTable {
  DeviceSegment rows[kInlineSegments];
};
static_assert(sizeof(InlineTable) + 3 * sizeof(int64_t) <= 4096, "launch parameters are limited to 4 KiB");

// The integer vector an access of Size bytes moves.
template <int Size>
struct Bits;
template <>
struct Bits<16> {
  using T = int4;
};
template <>
struct Bits<8> {
  using T = int2;
};

// Vector accesses with cache hints: the source is read once (evict-first), a plain copy's
// destination is written once (streaming store); an accumulated destination is read and
// written back, so it keeps the default policy.
template <class V>
__device__ __forceinline__ V load_once(const V* p) {
  using B = typename Bits<sizeof(V)>::T;
  const B bits = __ldcs(reinterpret_cast<const B*>(p));
  V v;
  memcpy(&v, &bits, sizeof v);
  return v;
}

template <class V>
__device__ __forceinline__ void store_once(V* p, const V& v) {
  using B = typename Bits<sizeof(V)>::T;
  B bits;
  memcpy(&bits, &v, sizeof bits);
  __stcs(reinterpret_cast<B*>(p), bits);
}

template <class SV, class DV, int S, int D, bool Accumulate>
__device__ __forceinline__ DV convert(const SV& in, const DV& acc, float alpha) {
  DV out;
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(in.v) / sizeof(in.v[0])); ++k) {
    float x = Elem<S>::load(in.v[k]);
    if constexpr (Accumulate) x = add_scaled(Elem<D>::load(acc.v[k]), alpha, x);
    out.v[k] = Elem<D>::store(x);
  }
  return out;
}

// Elements [begin, end) of one segment, end - begin <= kTile; begin is a multiple of kTile.
template <int S, int D, bool Accumulate>
__device__ __forceinline__ void run_tile(const DeviceSegment& seg, int64_t begin, int64_t end,
                                         float alpha) {
  using ST = typename Elem<S>::T;
  using DT = typename Elem<D>::T;
  constexpr int V = vector_width(S, D);
  constexpr int kIters = static_cast<int>(kTile / (kThreads * V));
  // 32-bit indices within the tile keep register use low.
  const ST* src = static_cast<const ST*>(seg.src) + begin;
  DT* dst = static_cast<DT*>(seg.dst) + begin;
  const int n = static_cast<int>(end - begin);

  int scalar_begin = 0;
  if (seg.vectorized) {
    using SV = Vec<ST, V>;
    using DV = Vec<DT, V>;
    const int full = n / V;  // whole vectors in this tile
    const int lane = static_cast<int>(threadIdx.x);
    // Per-thread base pointers: every access below is base + a compile-time offset.
    const SV* __restrict__ src_v = reinterpret_cast<const SV*>(src) + lane;
    DV* __restrict__ dst_v = reinterpret_cast<DV*>(dst) + lane;
    if (n == kTile) {
      // A whole tile: every load first (kIters vector loads in flight per thread), then every
      // store. Segments never overlap, so the loads need not wait for any store.
      SV in[kIters];
      DV acc[kIters] = {};
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        in[it] = load_once(src_v + it * kThreads);
        if constexpr (Accumulate) acc[it] = dst_v[it * kThreads];
      }
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const DV out = convert<SV, DV, S, D, Accumulate>(in[it], acc[it], alpha);
        if constexpr (Accumulate) {
          dst_v[it * kThreads] = out;
        } else {
          store_once(dst_v + it * kThreads, out);
        }
      }
      return;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      if (it * kThreads + lane < full) {
        DV acc{};
        if constexpr (Accumulate) acc = dst_v[it * kThreads];
        dst_v[it * kThreads] = convert<SV, DV, S, D, Accumulate>(src_v[it * kThreads], acc, alpha);
      }
    }
    scalar_begin = full * V;
  }
  for (int i = scalar_begin + static_cast<int>(threadIdx.x); i < n; i += kThreads) {
    float x = Elem<S>::load(src[i]);
    if constexpr (Accumulate) x = add_scaled(Elem<D>::load(dst[i]), alpha, x);
    dst[i] = Elem<D>::store(x);
  }
}

// Tiles [tile, tile_end) of one segment, for dispatch_dtype_pair.
template <bool Accumulate>
struct TilesOp {
  const DeviceSegment& seg;
  int64_t tile;
  int64_t tile_end;
  float alpha;

  template <int S, int D>
  __device__ __forceinline__ void run() const {
    for (int64_t t = tile; t < tile_end; ++t) {
      const int64_t begin = (t - seg.first_tile) * kTile;
      const int64_t end = begin + kTile < seg.numel ? begin + kTile : seg.numel;
      run_tile<S, D, Accumulate>(seg, begin, end, alpha);
    }
  }
};

// The block's equal share of the tiles, segment after segment.
template <bool Accumulate>
__device__ __forceinline__ void run_blocks_share(const DeviceSegment* table, int64_t num_segments,
                                                 int64_t total_tiles, float alpha) {
  const int64_t block = blockIdx.x;
  const int64_t per_block = total_tiles / gridDim.x;
  const int64_t extra = total_tiles % gridDim.x;
  int64_t tile = block * per_block + (block < extra ? block : extra);
  const int64_t tile_end = tile + per_block + (block < extra ? 1 : 0);

  // Last segment whose first tile is <= tile.
  int64_t lo = 0;
  int64_t hi = num_segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid].first_tile <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  for (int64_t s = lo; tile < tile_end; ++s) {
    const DeviceSegment seg = table[s];
    const int64_t seg_tiles_end = seg.first_tile + (seg.numel + kTile - 1) / kTile;
    const int64_t stop = seg_tiles_end < tile_end ? seg_tiles_end : tile_end;
    // The dtype pair is uniform across the block, so this dispatch never diverges.
    dispatch_dtype_pair(seg.src_dtype, seg.dst_dtype, TilesOp<Accumulate>{seg, tile, stop, alpha});
    tile = stop;
  }
}

// The table in device memory (more rows than a launch's parameters hold).
template <bool Accumulate>
__global__ void __launch_bounds__(kThreads)
    shard_kernel(const DeviceSegment* __restrict__ table, int64_t num_segments, int64_t total_tiles,
                 float alpha) {
  run_blocks_share<Accumulate>(table, num_segments, total_tiles, alpha);
}

// The table in the launch's parameters, read in place (__grid_constant__: no per-thread copy).
template <bool Accumulate>
__global__ void __launch_bounds__(kThreads)
    shard_kernel_inline(const __grid_constant__ InlineTable table, int64_t num_segments,
                        int64_t total_tiles, float alpha) {
  run_blocks_share<Accumulate>(table.rows, num_segments, total_tiles, alpha);
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int cuda_failed(cudaError_t err) {
  g_last_cuda_error = cudaGetErrorString(err);
  return TAWPIPE_ERR_CUDA;
}

}  // namespace

extern "C" int tawpipe_shard_cuda_check_stream(struct CUstream_st* stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return cuda_failed(err);
  return capture == cudaStreamCaptureStatusNone ? TAWPIPE_OK : TAWPIPE_ERR_STREAM_CAPTURING;
}

extern "C" size_t tawpipe_shard_cuda_workspace_bytes(int64_t num_segments) {
  return num_segments > kInlineSegments ? static_cast<size_t>(num_segments) * sizeof(DeviceSegment) : 0;
}

extern "C" const char* tawpipe_cuda_last_error(void) { return g_last_cuda_error; }

namespace {

// Blocks resident at once on the current device for each of the four kernels, asked once per
// thread and device: the queries cost microseconds, a launch of a layer chunk tens.
struct Residency {
  int device = -1;
  int64_t blocks[4] = {0, 0, 0, 0};  // [inline * 2 + accumulate]
};

template <class Kernel>
cudaError_t resident_blocks(Kernel kernel, int slot, int64_t* out) {
  thread_local Residency cache;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (cache.device != device) cache = Residency{device, {0, 0, 0, 0}};
  if (cache.blocks[slot] == 0) {
    int sms = 0;
    int per_sm = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
    if (err != cudaSuccess) return err;
    cache.blocks[slot] = static_cast<int64_t>(sms) * std::max(per_sm, 1);
  }
  *out = cache.blocks[slot];
  return cudaSuccess;
}

// One wave: as many blocks as can be resident at once, each with an equal share of tiles.
template <class Kernel, class Table>
int launch(Kernel kernel, int slot, const Table& table, int64_t rows, int64_t tiles, float alpha,
           cudaStream_t stream) {
  int64_t resident = 0;
  cudaError_t err = resident_blocks(kernel, slot, &resident);
  if (err != cudaSuccess) return cuda_failed(err);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>({tiles, resident, INT_MAX}));
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(table, rows, tiles, alpha);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_failed(err);
  return TAWPIPE_OK;
}

}  // namespace

extern "C" int tawpipe_shard_segments_cuda(const tawpipe_segment* segments, int64_t num_segments,
                                           int accumulate, float alpha, void* device_workspace,
                                           void* host_staging, size_t workspace_bytes,
                                           struct CUstream_st* stream) {
  if (num_segments < 0 || (num_segments > 0 && segments == nullptr)) return TAWPIPE_ERR_INVALID_ARGUMENT;
  int64_t active = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    const tawpipe_segment& seg = segments[i];
    if (!valid_dtype(seg.src_dtype) || !valid_dtype(seg.dst_dtype) || seg.numel < 0 ||
        (seg.numel > 0 && (seg.src == nullptr || seg.dst == nullptr))) {
      return TAWPIPE_ERR_INVALID_ARGUMENT;
    }
    active += seg.numel > 0 ? 1 : 0;
  }
  if (active == 0) return TAWPIPE_OK;
  const size_t needed = tawpipe_shard_cuda_workspace_bytes(active);
  const bool in_parameters = needed == 0;
  if (!in_parameters &&
      (device_workspace == nullptr || workspace_bytes < needed ||
       !aligned(device_workspace, alignof(DeviceSegment)) ||
       (host_staging != nullptr && !aligned(host_staging, alignof(DeviceSegment))))) {
    return TAWPIPE_ERR_INVALID_ARGUMENT;
  }

  const int stream_status = tawpipe_shard_cuda_check_stream(stream);
  if (stream_status != TAWPIPE_OK) return stream_status;

  thread_local std::vector<DeviceSegment> pageable;
  thread_local InlineTable inline_table;
  DeviceSegment* table = in_parameters ? inline_table.rows : static_cast<DeviceSegment*>(host_staging);
  if (table == nullptr) {
    try {
      pageable.resize(static_cast<size_t>(active));
    } catch (const std::bad_alloc&) {
      return TAWPIPE_ERR_OUT_OF_MEMORY;
    }
    table = pageable.data();
  }
  int64_t tiles = 0;
  int64_t row = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    const tawpipe_segment& seg = segments[i];
    if (seg.numel == 0) continue;
    const int v = vector_width(seg.src_dtype, seg.dst_dtype);
    DeviceSegment d;
    d.src = seg.src;
    d.dst = seg.dst;
    d.numel = seg.numel;
    d.first_tile = tiles;
    d.src_dtype = seg.src_dtype;
    d.dst_dtype = seg.dst_dtype;
    d.vectorized = aligned(seg.src, static_cast<size_t>(v) * dtype_bytes(seg.src_dtype)) &&
                   aligned(seg.dst, static_cast<size_t>(v) * dtype_bytes(seg.dst_dtype));
    d.unused = 0;
    table[row++] = d;
    tiles += (seg.numel + kTile - 1) / kTile;
  }

  if (in_parameters) {
    return accumulate != 0 ? launch(shard_kernel_inline<true>, 3, inline_table, active, tiles, alpha, stream)
                           : launch(shard_kernel_inline<false>, 2, inline_table, active, tiles, alpha, stream);
  }
  const cudaError_t err = cudaMemcpyAsync(device_workspace, table, needed, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return cuda_failed(err);
  const auto* device_table = static_cast<const DeviceSegment*>(device_workspace);
  return accumulate != 0 ? launch(shard_kernel<true>, 1, device_table, active, tiles, alpha, stream)
                         : launch(shard_kernel<false>, 0, device_table, active, tiles, alpha, stream);
}
