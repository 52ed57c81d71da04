// Element types, conversions and dtype-pair dispatch shared by the CPU (shard_ops_cpu.cpp) and
// CUDA (shard_ops_cuda.cu) kernels. Internal to csrc/kernels: plain C++17 that g++ and nvcc
// both compile (no framework headers; the CUDA headers only under nvcc).
#ifndef TAWPIPE_SHARD_DTYPES_H_
#define TAWPIPE_SHARD_DTYPES_H_

#include <stdint.h>

#include <cstring>

#include "shard_ops.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define TAWPIPE_HOST_DEVICE __host__ __device__
#define TAWPIPE_FORCE_INLINE __forceinline__
#elif defined(__GNUC__)
#define TAWPIPE_HOST_DEVICE
// The CPU kernels are compiled once per ISA clone (target_clones): each clone must inline the
// element loops, or they would run at the baseline ISA.
#define TAWPIPE_FORCE_INLINE __attribute__((always_inline)) inline
#else
#define TAWPIPE_HOST_DEVICE
#define TAWPIPE_FORCE_INLINE inline
#endif

namespace tawpipe {
namespace kernels {

constexpr int kNumDtypes = 3;  // TAWPIPE_DTYPE_F32, _BF16, _F16

TAWPIPE_HOST_DEVICE constexpr bool valid_dtype(int32_t d) {
  return d == TAWPIPE_DTYPE_F32 || d == TAWPIPE_DTYPE_BF16 || d == TAWPIPE_DTYPE_F16;
}

TAWPIPE_HOST_DEVICE constexpr int dtype_bytes(int32_t d) { return d == TAWPIPE_DTYPE_F32 ? 4 : 2; }

// acc + alpha * x, rounded twice (no fused multiply-add), so every device gives the same bits:
// the CPU kernels are built with -ffp-contract=off; nvcc contracts to FMA by default, so device
// code spells the two roundings out.
TAWPIPE_HOST_DEVICE TAWPIPE_FORCE_INLINE float add_scaled(float acc, float alpha, float x) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(acc, __fmul_rn(alpha, x));
#else
  return acc + alpha * x;
#endif
}

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

// Host conversions, branch-free (every case computed, then selected) so that the compiler
// vectorises the loops that use them. Narrowing rounds to nearest even; NaN stays NaN.

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

// Elem<D>: the storage type of dtype D (bfloat16 and float16 as their bits) and its exact
// widening to / rounding narrowing from float32. Device code uses the hardware conversions,
// which round the same way.
template <int Dtype>
struct Elem;

template <>
struct Elem<TAWPIPE_DTYPE_F32> {
  using T = float;
  TAWPIPE_HOST_DEVICE static float load(T v) { return v; }
  TAWPIPE_HOST_DEVICE static T store(float f) { return f; }
};

template <>
struct Elem<TAWPIPE_DTYPE_BF16> {
  using T = uint16_t;
  TAWPIPE_HOST_DEVICE static float load(T v) {
#if defined(__CUDA_ARCH__)
    return __bfloat162float(__ushort_as_bfloat16(v));
#else
    return bf16_to_float(v);
#endif
  }
  TAWPIPE_HOST_DEVICE static T store(float f) {
#if defined(__CUDA_ARCH__)
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
    return float_to_bf16(f);
#endif
  }
};

template <>
struct Elem<TAWPIPE_DTYPE_F16> {
  using T = uint16_t;
  TAWPIPE_HOST_DEVICE static float load(T v) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(v));
#else
    return f16_to_float(v);
#endif
  }
  TAWPIPE_HOST_DEVICE static T store(float f) {
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(f));
#else
    return float_to_f16(f);
#endif
  }
};

// Calls op.template run<S, D>() with a segment's dtype pair (validated by the caller) as
// compile-time constants, so every pair gets its own specialised loop.
template <class Op>
TAWPIPE_HOST_DEVICE TAWPIPE_FORCE_INLINE void dispatch_dtype_pair(int32_t src, int32_t dst,
                                                                  const Op& op) {
  static_assert(kNumDtypes == 3, "one case per dtype pair below");
  switch (src * kNumDtypes + dst) {
    case 0: return op.template run<0, 0>();
    case 1: return op.template run<0, 1>();
    case 2: return op.template run<0, 2>();
    case 3: return op.template run<1, 0>();
    case 4: return op.template run<1, 1>();
    case 5: return op.template run<1, 2>();
    case 6: return op.template run<2, 0>();
    case 7: return op.template run<2, 1>();
    default: return op.template run<2, 2>();
  }
}

}  // namespace kernels
}  // namespace tawpipe

#endif  // TAWPIPE_SHARD_DTYPES_H_
