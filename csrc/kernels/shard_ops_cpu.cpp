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

namespace {

// Below this many elements per thread, starting another thread costs more than it saves.
constexpr int64_t kGrainElements = 1 << 15;
// Thread boundaries fall on multiples of this, keeping each thread's inner loops vector-aligned.
constexpr int64_t kSplitQuantum = 64;

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The conversions below are branch-free (every case computed, then selected) so that the
// compiler vectorises the loops that use them.

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  // Adding 0x7FFF plus the lowest kept bit rounds the dropped 16 bits to nearest, ties to even.
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;  // keeps the sign
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
  const uint32_t inf_nan = 0x7F800000u | (mantissa << 13);
  // Zero and subnormals are mantissa * 2^-24: exact, and never a float32 subnormal, so this
  // stays right when denormals are flushed (torch.set_flush_denormal).
  const uint32_t small = float_bits(static_cast<float>(mantissa) * 5.9604644775390625e-8f);
  return bits_float(sign | (exponent == 0 ? small : exponent == 0x1Fu ? inf_nan : normal));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal half (|f| >= 2^-14): rebias the exponent (127 -> 15) and round 23 mantissa bits to
  // 10, ties to even; a carry out of the mantissa correctly bumps the exponent.
  const uint32_t rebased = a - 0x38000000u;
  const uint32_t normal = (rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13;
  // Subnormal half (|f| < 2^-14): in |f| + 0.5 the last mantissa bit is worth 2^-24, the
  // half-precision subnormal step, so the float addition itself rounds to nearest even.
  const uint32_t subnormal = float_bits(bits_float(a) + 0.5f) - 0x3F000000u;
  const uint32_t nan = 0x7E00u | ((a >> 13) & 0x3FFu);
  uint32_t r = a >= 0x38800000u ? normal : subnormal;
  r = a >= 0x477FF000u ? 0x7C00u : r;  // >= 65520 rounds to inf (and inf stays inf)
  r = a > 0x7F800000u ? nan : r;
  return static_cast<uint16_t>(sign | r);
}

template <int Dtype>
struct Elem;

template <>
struct Elem<TAWPIPE_DTYPE_F32> {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
};

template <>
struct Elem<TAWPIPE_DTYPE_BF16> {
  using T = uint16_t;
  static float load(T v) { return bf16_to_float(v); }
  static T store(float f) { return float_to_bf16(f); }
};

template <>
struct Elem<TAWPIPE_DTYPE_F16> {
  using T = uint16_t;
  static float load(T v) { return f16_to_float(v); }
  static T store(float f) { return float_to_f16(f); }
};

// Each dtype loop is compiled once per clone of run_span (below), so it is always inlined there.
#if defined(__GNUC__)
#define TAWPIPE_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define TAWPIPE_ALWAYS_INLINE inline
#endif

template <int S, int D, bool Accumulate>
TAWPIPE_ALWAYS_INLINE void run_range(const void* src_v, void* dst_v, int64_t begin, int64_t end,
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
      if constexpr (Accumulate) v = Elem<D>::load(dst[k]) + alpha * v;
      dst[k] = Elem<D>::store(v);
    }
  }
}

// Elements [begin, end) of one segment, by its dtype pair (validated by the caller).
template <bool Accumulate>
TAWPIPE_ALWAYS_INLINE void run_segment(const tawpipe_segment& seg, int64_t begin, int64_t end,
                                       float alpha) {
  const void* s = seg.src;
  void* d = seg.dst;
  switch (seg.src_dtype * 3 + seg.dst_dtype) {
    case 0: return run_range<0, 0, Accumulate>(s, d, begin, end, alpha);
    case 1: return run_range<0, 1, Accumulate>(s, d, begin, end, alpha);
    case 2: return run_range<0, 2, Accumulate>(s, d, begin, end, alpha);
    case 3: return run_range<1, 0, Accumulate>(s, d, begin, end, alpha);
    case 4: return run_range<1, 1, Accumulate>(s, d, begin, end, alpha);
    case 5: return run_range<1, 2, Accumulate>(s, d, begin, end, alpha);
    case 6: return run_range<2, 0, Accumulate>(s, d, begin, end, alpha);
    case 7: return run_range<2, 1, Accumulate>(s, d, begin, end, alpha);
    default: return run_range<2, 2, Accumulate>(s, d, begin, end, alpha);
  }
}

bool valid_dtype(int32_t d) {
  return d == TAWPIPE_DTYPE_F32 || d == TAWPIPE_DTYPE_BF16 || d == TAWPIPE_DTYPE_F16;
}

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
        run_segment<true>(seg, lo - seg_begin, stop - seg_begin, alpha);
      } else {
        run_segment<false>(seg, lo - seg_begin, stop - seg_begin, alpha);
      }
      lo = stop;
    }
    ++s;
  }
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
#ifdef _OPENMP
  const int64_t wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t threads = std::min(wanted, total / kGrainElements);
  if (threads > 1) {
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      const int64_t parts = omp_get_num_threads();
      const int64_t chunk =
          ((total + parts - 1) / parts + kSplitQuantum - 1) / kSplitQuantum * kSplitQuantum;
      const int64_t lo = std::min(total, chunk * omp_get_thread_num());
      run_span(segments, ends.data(), num_segments, lo, std::min(total, lo + chunk), acc, alpha);
    }
    return TAWPIPE_OK;
  }
#else
  (void)num_threads;  // built without OpenMP: always one thread
#endif
  run_span(segments, ends.data(), num_segments, 0, total, acc, alpha);
  return TAWPIPE_OK;
}
