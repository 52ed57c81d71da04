// CPU implementation of the shard kernels (see shard_ops.h).
//
// All segments are treated as one concatenated element range that is cut into equal parts, one
// per thread. Each thread walks the segments its part covers, so thousands of tiny tensors cost
// one parallel region, and a single huge tensor is still split across all threads.
#include "shard_ops.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "shard_dtypes.h"

namespace {

using tawpipe::kernels::add_scaled;
using tawpipe::kernels::dispatch_dtype_pair;
using tawpipe::kernels::Elem;
using tawpipe::kernels::valid_dtype;

// Below this many elements per thread, starting another thread costs more than it saves.
constexpr int64_t kGrainElements = 1 << 15;
// Thread boundaries fall on multiples of this, keeping each thread's inner loops vector-aligned.
constexpr int64_t kSplitQuantum = 64;

template <int S, int D, bool Accumulate>
TAWPIPE_FORCE_INLINE void run_range(const void* src_v, void* dst_v, int64_t begin, int64_t end,
                                    float alpha) {
  using ST = typename Elem<S>::T;
  using DT = typename Elem<D>::T;
  const ST* __restrict src = static_cast<const ST*>(src_v) + begin;
  DT* __restrict dst = static_cast<DT*>(dst_v) + begin;
  const int64_t n = end - begin;
  if constexpr (!Accumulate && S == D) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(ST));
  } else {
    for (int64_t k = 0; k < n; ++k) {
      float v = Elem<S>::load(src[k]);
      if constexpr (Accumulate) v = add_scaled(Elem<D>::load(dst[k]), alpha, v);
      dst[k] = Elem<D>::store(v);
    }
  }
}

// Elements [begin, end) of one segment, for dispatch_dtype_pair.
template <bool Accumulate>
struct RangeOp {
  const tawpipe_segment& seg;
  int64_t begin;
  int64_t end;
  float alpha;

  template <int S, int D>
  TAWPIPE_FORCE_INLINE void run() const {
    run_range<S, D, Accumulate>(seg.src, seg.dst, begin, end, alpha);
  }
};

// The library is built for the baseline ISA; with GCC on x86-64 Linux the hot loops are also
// compiled for AVX2 and for x86-64-v4 (AVX-512), and the loader picks the widest the CPU has: the
// casts run several times faster than with SSE2. v4 includes FMA, so the build passes
// -ffp-contract=off (setup.py, CMakeLists.txt): every clone then rounds exactly alike.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TAWPIPE_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
#ifndef TAWPIPE_CPU_CLONES
#define TAWPIPE_CPU_CLONES
#endif

// Runs the concatenated elements [lo, hi) given each segment's exclusive end in that range.
TAWPIPE_CPU_CLONES
void run_span(const tawpipe_segment* segs, const int64_t* ends, int64_t num_segments, int64_t lo,
              int64_t hi, bool accumulate, float alpha) {
  int64_t s = std::upper_bound(ends, ends + num_segments, lo) - ends;
  while (lo < hi) {
    const tawpipe_segment& seg = segs[s];
    const int64_t seg_begin = ends[s] - seg.numel;
    const int64_t stop = std::min(hi, ends[s]);
    if (stop > lo) {
      if (accumulate) {
        dispatch_dtype_pair(seg.src_dtype, seg.dst_dtype,
                            RangeOp<true>{seg, lo - seg_begin, stop - seg_begin, alpha});
      } else {
        dispatch_dtype_pair(seg.src_dtype, seg.dst_dtype,
                            RangeOp<false>{seg, lo - seg_begin, stop - seg_begin, alpha});
      }
      lo = stop;
    }
    ++s;
  }
}

// acc[begin:end] += alpha * src[begin:end] with the accumulation above, a block of kSquaresBlock
// elements at a time (64 KiB: in cache when it is read again); returns the sum of the results'
// squares: kLanes partial sums (the loop vectorises), in float32 over a group of kGroup elements
// (16 terms each) and then in float64, always in the same order: within about 1e-6 of the exact
// sum, as squared_norm's pieces are.
constexpr int kLanes = 16;
constexpr int64_t kGroup = 256;
constexpr int64_t kSquaresBlock = 16384;

template <int S>
TAWPIPE_FORCE_INLINE double add_squares(const void* src, float* acc, int64_t begin, int64_t end, float alpha) {
  double sum = 0.0;
  for (int64_t block = begin; block < end; block += kSquaresBlock) {
    const int64_t stop = std::min(end, block + kSquaresBlock);
    run_range<S, TAWPIPE_DTYPE_F32, true>(src, acc, block, stop, alpha);
    // pointers, not indices: the build's -fwrapv (Python's flags) lets a signed index wrap, which
    // keeps the compiler from vectorising an indexed loop well (1.5x slower, measured); a pointer's
    // arithmetic may not wrap
    double wide[kLanes] = {};
    const float* v = acc + block;
    const float* const whole = v + (stop - block) / kLanes * kLanes;
    while (v < whole) {
      float lanes[kLanes] = {};
      const float* const group = std::min(whole, v + kGroup);
      for (; v < group; v += kLanes) {
        for (int j = 0; j < kLanes; ++j) lanes[j] += v[j] * v[j];
      }
      for (int j = 0; j < kLanes; ++j) wide[j] += lanes[j];
    }
    for (int j = 0; v < acc + stop; ++v, ++j) wide[j] += static_cast<double>(*v) * *v;
    for (int j = 0; j < kLanes; ++j) sum += wide[j];
  }
  return sum;
}

TAWPIPE_CPU_CLONES
double add_squares_span(const void* src, int src_dtype, float* acc, int64_t begin, int64_t end, float alpha) {
  switch (src_dtype) {
    case TAWPIPE_DTYPE_BF16: return add_squares<TAWPIPE_DTYPE_BF16>(src, acc, begin, end, alpha);
    case TAWPIPE_DTYPE_F16: return add_squares<TAWPIPE_DTYPE_F16>(src, acc, begin, end, alpha);
    default: return add_squares<TAWPIPE_DTYPE_F32>(src, acc, begin, end, alpha);
  }
}

// Threads for `total` elements, and the elements each takes (vector-aligned).
int64_t thread_count(int64_t total, int num_threads) {
#ifdef _OPENMP
  const int64_t wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  return std::max<int64_t>(1, std::min(wanted, total / kGrainElements));
#else
  (void)total;
  (void)num_threads;
  return 1;
#endif
}

int64_t part_size(int64_t total, int64_t parts) {
  return ((total + parts - 1) / parts + kSplitQuantum - 1) / kSplitQuantum * kSplitQuantum;
}

}  // namespace

extern "C" const char* tawpipe_status_string(int status) {
  switch (status) {
    case TAWPIPE_OK: return "success";
    case TAWPIPE_ERR_INVALID_ARGUMENT:
      return "invalid argument (dtype, numel, null pointer or workspace size)";
    case TAWPIPE_ERR_CUDA: return "CUDA runtime error";
    case TAWPIPE_ERR_OUT_OF_MEMORY: return "out of host memory";
    case TAWPIPE_ERR_STREAM_CAPTURING:
      return "the stream is capturing a CUDA graph, which tawpipe shard kernels do not support; "
             "run them outside graph capture";
    default: return "unknown status";
  }
}

extern "C" int tawpipe_shard_segments_cpu(const tawpipe_segment* segments, int64_t num_segments,
                                          int accumulate, float alpha, int num_threads) {
  if (num_segments < 0 || (num_segments > 0 && segments == nullptr)) return TAWPIPE_ERR_INVALID_ARGUMENT;
  for (int64_t i = 0; i < num_segments; ++i) {
    const tawpipe_segment& seg = segments[i];
    if (!valid_dtype(seg.src_dtype) || !valid_dtype(seg.dst_dtype) || seg.numel < 0 ||
        (seg.numel > 0 && (seg.src == nullptr || seg.dst == nullptr))) {
      return TAWPIPE_ERR_INVALID_ARGUMENT;
    }
  }
  std::vector<int64_t> ends;
  try {
    ends.resize(static_cast<size_t>(num_segments));
  } catch (const std::bad_alloc&) {
    return TAWPIPE_ERR_OUT_OF_MEMORY;
  }
  int64_t total = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    total += segments[i].numel;
    ends[static_cast<size_t>(i)] = total;
  }
  if (total == 0) return TAWPIPE_OK;

  const bool acc = accumulate != 0;
  const int64_t threads = thread_count(total, num_threads);
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      const int64_t chunk = part_size(total, omp_get_num_threads());
      const int64_t lo = std::min(total, chunk * omp_get_thread_num());
      run_span(segments, ends.data(), num_segments, lo, std::min(total, lo + chunk), acc, alpha);
    }
    return TAWPIPE_OK;
  }
#else
  (void)threads;  // built without OpenMP: always one thread
#endif
  run_span(segments, ends.data(), num_segments, 0, total, acc, alpha);
  return TAWPIPE_OK;
}

extern "C" int tawpipe_accumulate_squares_cpu(float* acc, const void* src, int src_dtype, int64_t numel,
                                              float alpha, int num_threads, double* sum_of_squares) {
  if (!valid_dtype(src_dtype) || numel < 0 || sum_of_squares == nullptr ||
      (numel > 0 && (acc == nullptr || src == nullptr))) {
    return TAWPIPE_ERR_INVALID_ARGUMENT;
  }
  const int64_t threads = thread_count(numel, num_threads);
  std::vector<double> partial;
  try {
    partial.assign(static_cast<size_t>(threads), 0.0);
  } catch (const std::bad_alloc&) {
    return TAWPIPE_ERR_OUT_OF_MEMORY;
  }
  // each thread's part as if `threads` ran it, whatever OpenMP gives: the sum's order stays fixed
  const int64_t chunk = part_size(numel, threads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1) if (threads > 1)
#endif
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t lo = std::min(numel, chunk * t);
    partial[static_cast<size_t>(t)] = add_squares_span(src, src_dtype, acc, lo, std::min(numel, lo + chunk), alpha);
  }
  double sum = 0.0;
  for (const double p : partial) sum += p;
  *sum_of_squares = sum;
  return TAWPIPE_OK;
}
