// Tests of the framework-agnostic shard kernels against a scalar reference (run by ctest).
//
// The reference rounds by search: it finds the nearest representable value in a sorted table of
// every finite bfloat16 / float16 value (ties to the even bit pattern), so it shares no code or
// bit tricks with the kernels. Every dtype pair, copy and accumulate, gather into and scatter
// out of a flat buffer, with gaps between segments that must stay untouched.
#include "shard_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#ifdef TAWPIPE_KERNELS_CUDA
#include <cuda_runtime.h>
#endif

namespace {

int g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    if (g_failures <= 20) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

const char* kNames[3] = {"f32", "bf16", "f16"};
size_t elem_bytes(int dtype) { return dtype == TAWPIPE_DTYPE_F32 ? 4 : 2; }

double decode(int dtype, uint32_t bits) {
  if (dtype == TAWPIPE_DTYPE_F32) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (dtype == TAWPIPE_DTYPE_BF16) {
    const uint32_t u = bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int e = (bits >> 10) & 0x1F;
  const int m = bits & 0x3FF;
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1F) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

// Non-negative finite values of a 16-bit type in increasing order, then infinity placed one
// unit in the last place above the maximum (so overflow rounds exactly as IEEE says).
struct Table {
  std::vector<double> value;
  std::vector<uint32_t> bits;
};

Table make_table(int dtype) {
  Table t;
  const uint32_t max_bits = dtype == TAWPIPE_DTYPE_BF16 ? 0x7F7F : 0x7BFF;
  for (uint32_t b = 0; b <= max_bits; ++b) {
    t.value.push_back(decode(dtype, b));
    t.bits.push_back(b);
  }
  t.value.push_back(dtype == TAWPIPE_DTYPE_BF16 ? std::ldexp(1.0, 128) : 65536.0);
  t.bits.push_back(dtype == TAWPIPE_DTYPE_BF16 ? 0x7F80 : 0x7C00);
  return t;
}

const Table& table(int dtype) {
  static const Table bf16 = make_table(TAWPIPE_DTYPE_BF16);
  static const Table f16 = make_table(TAWPIPE_DTYPE_F16);
  return dtype == TAWPIPE_DTYPE_BF16 ? bf16 : f16;
}

uint32_t encode(int dtype, float x) {
  if (dtype == TAWPIPE_DTYPE_F32) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
  }
  const uint32_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0xFFFFFFFF;  // callers only ask for isnan(decode(result))
  const double a = std::fabs(static_cast<double>(x));
  const Table& t = table(dtype);
  if (a >= t.value.back()) return sign | t.bits.back();
  const size_t hi =
      static_cast<size_t>(std::upper_bound(t.value.begin(), t.value.end(), a) - t.value.begin());
  const size_t lo = hi - 1;  // t.value[0] == 0 <= a
  const double dlo = a - t.value[lo];
  const double dhi = t.value[hi] - a;
  const size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((t.bits[lo] & 1) == 0 ? lo : hi);
  return sign | t.bits[pick];
}

uint32_t load_bits(const std::vector<uint8_t>& buf, int dtype, size_t i) {
  uint32_t v = 0;
  std::memcpy(&v, buf.data() + i * elem_bytes(dtype), elem_bytes(dtype));
  return v;
}

void store_bits(std::vector<uint8_t>& buf, int dtype, size_t i, uint32_t v) {
  std::memcpy(buf.data() + i * elem_bytes(dtype), &v, elem_bytes(dtype));
}

// Random finite float32 of widely varying magnitude, including exact rounding ties.
float random_value(std::mt19937_64& rng, int dst_dtype) {
  std::uniform_int_distribution<int> kind(0, 5);
  std::normal_distribution<float> normal(0.f, 1.f);
  uint32_t u;
  float f = 0.f;
  switch (kind(rng)) {
    case 0:  // any finite float32 bit pattern (subnormals, huge values, zeros)
      do {
        u = static_cast<uint32_t>(rng());
        std::memcpy(&f, &u, 4);
      } while (!std::isfinite(f));
      return f;
    case 1:  // exactly halfway between two neighbours of the destination type
      f = normal(rng);
      std::memcpy(&u, &f, 4);
      u = dst_dtype == TAWPIPE_DTYPE_F16 ? (u & ~0x1FFFu) | 0x1000u : (u & ~0xFFFFu) | 0x8000u;
      std::memcpy(&f, &u, 4);
      return f;
    case 2:  // float16 subnormal range and beyond
      return normal(rng) * 1e-6f;
    case 3:  // around the float16 maximum (overflow to inf)
      return normal(rng) * 6e4f;
    default: return normal(rng) * 3.f;
  }
}

uint32_t random_element(std::mt19937_64& rng, int dtype, int dst_dtype) {
  return encode(dtype, random_value(rng, dst_dtype));
}

// Distance between two values of one dtype, in units in the last place (bit patterns ordered).
int64_t ulp_distance(int dtype, uint32_t a, uint32_t b) {
  const int bits = dtype == TAWPIPE_DTYPE_F32 ? 32 : 16;
  auto ordered = [bits](uint32_t v) -> int64_t {
    const uint64_t sign_bit = uint64_t{1} << (bits - 1);
    const int64_t mag = static_cast<int64_t>(v & (sign_bit - 1));
    return (v & sign_bit) ? -mag : mag;
  };
  return std::llabs(ordered(a) - ordered(b));
}

enum class Where { kCpu, kCuda };

// Runs a table of segments on CPU or GPU (host vectors in, host vectors out).
int run(Where where, std::vector<tawpipe_segment> segs, std::vector<std::vector<uint8_t>*> buffers,
        int accumulate, float alpha) {
  if (where == Where::kCpu) {
    return tawpipe_shard_segments_cpu(segs.data(), static_cast<int64_t>(segs.size()), accumulate, alpha,
                                      0);
  }
#ifdef TAWPIPE_KERNELS_CUDA
  // Mirror every host buffer on the device and translate the segment pointers.
  std::vector<void*> device(buffers.size(), nullptr);
  for (size_t b = 0; b < buffers.size(); ++b) {
    cudaMalloc(&device[b], std::max<size_t>(buffers[b]->size(), 1));
    cudaMemcpy(device[b], buffers[b]->data(), buffers[b]->size(), cudaMemcpyHostToDevice);
  }
  auto translate = [&](const void* p) -> void* {
    for (size_t b = 0; b < buffers.size(); ++b) {
      const uint8_t* base = buffers[b]->data();
      if (p >= base && p < base + buffers[b]->size()) {
        return static_cast<uint8_t*>(device[b]) + (static_cast<const uint8_t*>(p) - base);
      }
    }
    return nullptr;
  };
  for (auto& s : segs) {
    if (s.numel == 0) continue;
    s.src = translate(s.src);
    s.dst = translate(s.dst);
  }
  const size_t bytes = tawpipe_shard_cuda_workspace_bytes(static_cast<int64_t>(segs.size()));
  void* workspace = nullptr;
  cudaMalloc(&workspace, std::max<size_t>(bytes, 1));
  const int status = tawpipe_shard_segments_cuda(segs.data(), static_cast<int64_t>(segs.size()),
                                                 accumulate, alpha, workspace, nullptr, bytes, nullptr);
  expect(cudaDeviceSynchronize() == cudaSuccess, "cuda kernel ran");
  for (size_t b = 0; b < buffers.size(); ++b) {
    cudaMemcpy(buffers[b]->data(), device[b], buffers[b]->size(), cudaMemcpyDeviceToHost);
    cudaFree(device[b]);
  }
  cudaFree(workspace);
  return status;
#else
  (void)buffers;
  return -1;
#endif
}

// One call: n_segments random segments between separate tensors and one flat buffer.
// pack == true: tensors -> flat; else flat -> tensors. mixed: every tensor gets its own dtype.
void check_case(Where where, std::mt19937_64& rng, int tensor_dtype, int flat_dtype, bool pack,
                int accumulate, bool mixed, int n_segments) {
  const std::string label = std::string(where == Where::kCpu ? "cpu " : "cuda ") +
                            (pack ? "pack " : "unpack ") + (mixed ? "mixed" : kNames[tensor_dtype]) +
                            "<->" + kNames[flat_dtype] + (accumulate ? " accumulate" : " copy");
  std::uniform_int_distribution<int> size_kind(0, 9);
  std::uniform_int_distribution<int> small(0, 37);
  std::uniform_int_distribution<int> medium(38, 9000);
  std::uniform_int_distribution<int> gap(0, 3);
  std::uniform_int_distribution<int> any_dtype(0, 2);
  std::uniform_real_distribution<float> alpha_dist(-2.f, 2.f);
  const float alpha = accumulate ? alpha_dist(rng) : 1.f;

  std::vector<int64_t> numel(n_segments), offset(n_segments);
  std::vector<int> dtype(n_segments);
  for (int i = 0; i < n_segments; ++i) {
    const int k = size_kind(rng);
    numel[i] = i == 0   ? 70000
               : k == 0 ? 0
               : k == 9 ? medium(rng)
                        : small(rng);  // 70000: split across threads
    dtype[i] = mixed ? any_dtype(rng) : tensor_dtype;
  }
  // Segments sit in the flat buffer in an order shuffled relative to the list, with gaps;
  // offsets are mostly multiples of 8 (vector path) and sometimes odd (scalar path).
  std::vector<int> placement(n_segments);
  for (int i = 0; i < n_segments; ++i) placement[i] = i;
  std::shuffle(placement.begin(), placement.end(), rng);
  int64_t cursor = 0;
  for (int i : placement) {
    cursor += gap(rng) == 0 ? 1 : (8 - cursor % 8) % 8;
    offset[i] = cursor;
    cursor += numel[i];
  }
  const int64_t flat_numel = cursor + 5;

  const uint32_t poison = 0xFFFFFFFF;  // a NaN in every dtype, never a result of finite inputs
  std::vector<uint8_t> flat(static_cast<size_t>(flat_numel) * elem_bytes(flat_dtype));
  std::vector<std::vector<uint8_t>> tensors(n_segments);
  for (int64_t j = 0; j < flat_numel; ++j) store_bits(flat, flat_dtype, j, poison);
  for (int i = 0; i < n_segments; ++i) {
    tensors[i].resize(static_cast<size_t>(numel[i]) * elem_bytes(dtype[i]));
    for (int64_t j = 0; j < numel[i]; ++j) {
      if (pack) {
        store_bits(tensors[i], dtype[i], j, random_element(rng, dtype[i], flat_dtype));
        if (accumulate)
          store_bits(flat, flat_dtype, offset[i] + j, random_element(rng, flat_dtype, flat_dtype));
      } else {
        store_bits(flat, flat_dtype, offset[i] + j, random_element(rng, flat_dtype, dtype[i]));
        store_bits(tensors[i], dtype[i], j,
                   accumulate ? random_element(rng, dtype[i], dtype[i]) : poison);
      }
    }
  }
  const std::vector<uint8_t> flat_before = flat;
  const std::vector<std::vector<uint8_t>> tensors_before = tensors;

  std::vector<tawpipe_segment> segs(n_segments);
  std::vector<std::vector<uint8_t>*> buffers{&flat};
  for (int i = 0; i < n_segments; ++i) {
    buffers.push_back(&tensors[i]);
    void* in_flat = flat.data() + offset[i] * elem_bytes(flat_dtype);
    segs[i].numel = numel[i];
    segs[i].src = pack ? static_cast<const void*>(tensors[i].data()) : in_flat;
    segs[i].dst = pack ? in_flat : static_cast<void*>(tensors[i].data());
    segs[i].src_dtype = pack ? dtype[i] : flat_dtype;
    segs[i].dst_dtype = pack ? flat_dtype : dtype[i];
  }
  expect(run(where, segs, buffers, accumulate, alpha) == TAWPIPE_OK, label + ": status");

  // Every element of every segment against the reference; no other element changed.
  std::vector<char> covered(static_cast<size_t>(flat_numel), 0);
  int64_t bad = 0;
  for (int i = 0; i < n_segments; ++i) {
    for (int64_t j = 0; j < numel[i]; ++j) {
      const int64_t f = offset[i] + j;
      covered[static_cast<size_t>(f)] = 1;
      const int sd = pack ? dtype[i] : flat_dtype;
      const int dd = pack ? flat_dtype : dtype[i];
      const uint32_t s = pack ? load_bits(tensors_before[i], sd, j) : load_bits(flat_before, sd, f);
      const uint32_t d_before =
          pack ? load_bits(flat_before, dd, f) : load_bits(tensors_before[i], dd, j);
      const uint32_t got = pack ? load_bits(flat, dd, f) : load_bits(tensors[i], dd, j);
      uint32_t want;
      if (accumulate) {
        volatile float scaled = alpha * static_cast<float>(decode(sd, s));  // no fused multiply-add
        want = encode(dd, static_cast<float>(decode(dd, d_before)) + scaled);
      } else {
        want = encode(dd, static_cast<float>(decode(sd, s)));
      }
      const bool both_nan = std::isnan(decode(dd, got)) && std::isnan(decode(dd, want));
      // Accumulation may be contracted to a fused multiply-add: allow one unit in the last place.
      const bool ok = both_nan || (accumulate ? ulp_distance(dd, got, want) <= 1 : got == want);
      if (!ok && bad++ < 3) {
        char msg[256];
        std::snprintf(msg, sizeof msg, "%s: segment %d element %lld: got 0x%x want 0x%x", label.c_str(),
                      i, static_cast<long long>(j), got, want);
        expect(false, msg);
      }
    }
  }
  expect(bad == 0, label + ": " + std::to_string(bad) + " wrong elements");
  if (pack) {
    for (int64_t f = 0; f < flat_numel; ++f) {
      if (!covered[static_cast<size_t>(f)]) {
        expect(load_bits(flat, flat_dtype, f) == (poison >> (32 - 8 * elem_bytes(flat_dtype))),
               label + ": gap element " + std::to_string(f) + " written");
      }
    }
    for (int i = 0; i < n_segments; ++i)
      expect(tensors[i] == tensors_before[i], label + ": a source changed");
  } else {
    expect(flat == flat_before, label + ": the source flat buffer changed");
  }
}

void check_conversions() {
  // Reference sanity: known encodings, so the reference itself cannot drift.
  expect(encode(TAWPIPE_DTYPE_BF16, 1.0f) == 0x3F80, "ref bf16(1)");
  expect(encode(TAWPIPE_DTYPE_F16, 1.0f) == 0x3C00, "ref f16(1)");
  expect(encode(TAWPIPE_DTYPE_F16, 65520.f) == 0x7C00, "ref f16(65520) = inf");
  expect(encode(TAWPIPE_DTYPE_F16, 65519.f) == 0x7BFF, "ref f16(65519) = max");
  expect(encode(TAWPIPE_DTYPE_F16, std::ldexp(1.f, -25)) == 0x0000, "ref f16 tie to zero");
  expect(encode(TAWPIPE_DTYPE_F16, std::ldexp(3.f, -25)) == 0x0002, "ref f16 subnormal tie to even");
  // NaN stays NaN through every cast.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int dd = 0; dd < 3; ++dd) {
    std::vector<uint8_t> out(4, 0);
    tawpipe_segment seg{&nan, out.data(), 1, TAWPIPE_DTYPE_F32, dd};
    expect(tawpipe_shard_segments_cpu(&seg, 1, 0, 1.f, 0) == TAWPIPE_OK, "nan status");
    expect(std::isnan(decode(dd, load_bits(out, dd, 0))), std::string("nan -> ") + kNames[dd]);
  }
}

void check_invalid_arguments() {
  float src[4] = {1, 2, 3, 4};
  float dst[4] = {0, 0, 0, 0};
  float dst2[4] = {0, 0, 0, 0};
  const tawpipe_segment good{src, dst, 4, TAWPIPE_DTYPE_F32, TAWPIPE_DTYPE_F32};
  auto rejected = [&](tawpipe_segment bad, const char* what) {
    const tawpipe_segment segs[2] = {good, bad};
    expect(tawpipe_shard_segments_cpu(segs, 2, 0, 1.f, 0) == TAWPIPE_ERR_INVALID_ARGUMENT, what);
    expect(dst[0] == 0.f, std::string(what) + ": nothing written before the error");
  };
  rejected({src, dst2, 4, 7, TAWPIPE_DTYPE_F32}, "bad src dtype");
  rejected({src, dst2, 4, TAWPIPE_DTYPE_F32, -1}, "bad dst dtype");
  rejected({src, dst2, -1, TAWPIPE_DTYPE_F32, TAWPIPE_DTYPE_F32}, "negative numel");
  rejected({nullptr, dst2, 4, TAWPIPE_DTYPE_F32, TAWPIPE_DTYPE_F32}, "null src");
  rejected({src, nullptr, 4, TAWPIPE_DTYPE_F32, TAWPIPE_DTYPE_F32}, "null dst");
  expect(tawpipe_shard_segments_cpu(nullptr, 0, 0, 1.f, 0) == TAWPIPE_OK, "empty table is a no-op");
  expect(tawpipe_shard_segments_cpu(nullptr, 3, 0, 1.f, 0) == TAWPIPE_ERR_INVALID_ARGUMENT,
         "null table");
  const tawpipe_segment empty{nullptr, nullptr, 0, TAWPIPE_DTYPE_F16, TAWPIPE_DTYPE_BF16};
  expect(tawpipe_shard_segments_cpu(&empty, 1, 1, 2.f, 0) == TAWPIPE_OK,
         "zero-element segment is a no-op");
#ifdef TAWPIPE_KERNELS_CUDA
  // One row more than the launch parameters hold: the table must go through a workspace.
  const std::vector<tawpipe_segment> many(TAWPIPE_SHARD_CUDA_INLINE_SEGMENTS + 1,
                                          tawpipe_segment{src, dst, 4, TAWPIPE_DTYPE_F32, TAWPIPE_DTYPE_F32});
  expect(tawpipe_shard_cuda_workspace_bytes(TAWPIPE_SHARD_CUDA_INLINE_SEGMENTS) == 0 &&
             tawpipe_shard_cuda_workspace_bytes(static_cast<int64_t>(many.size())) > 0,
         "cuda: workspace only beyond the inline rows");
  expect(tawpipe_shard_segments_cuda(many.data(), static_cast<int64_t>(many.size()), 0, 1.f, nullptr,
                                     nullptr, 0, nullptr) == TAWPIPE_ERR_INVALID_ARGUMENT,
         "cuda: missing workspace");
#endif
}

// tawpipe_accumulate_squares_cpu: the same accumulator as the shard kernels' accumulation, bit
// for bit, and the sum of its squares against a long-double reference (to 1e-6: float32 within a
// block); bad arguments refused.
void check_accumulate_squares(std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int64_t numel : {int64_t{1}, int64_t{13}, int64_t{200003}}) {  // 200003: several threads, a tail
    for (int sd = 0; sd < 3; ++sd) {
      std::vector<float> values(static_cast<size_t>(numel)), acc(values.size()), want(values.size());
      std::vector<uint8_t> src(values.size() * elem_bytes(sd));
      for (size_t i = 0; i < values.size(); ++i) {
        store_bits(src, sd, i, encode(sd, normal(rng)));
        acc[i] = want[i] = normal(rng);
      }
      const tawpipe_segment seg{src.data(), want.data(), numel, sd, TAWPIPE_DTYPE_F32};
      expect(tawpipe_shard_segments_cpu(&seg, 1, 1, -0.75f, 0) == TAWPIPE_OK, "squares: reference status");
      double squares = -1.0;
      expect(tawpipe_accumulate_squares_cpu(acc.data(), src.data(), sd, numel, -0.75f, 0, &squares) == TAWPIPE_OK,
             "squares: status");
      expect(std::memcmp(acc.data(), want.data(), acc.size() * 4) == 0,
             std::string("squares: the accumulation of ") + kNames[sd]);
      long double ref = 0;
      for (float v : want) ref += static_cast<long double>(v) * v;
      expect(std::fabs(static_cast<long double>(squares) - ref) <= 1e-6L * ref,
             std::string("squares: the sum, ") + kNames[sd] + " n=" + std::to_string(numel));
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  float acc[3] = {1, 2, 3};
  const float src[3] = {0, inf, 0};
  double squares = 0;
  expect(tawpipe_accumulate_squares_cpu(acc, src, TAWPIPE_DTYPE_F32, 3, 1.f, 0, &squares) == TAWPIPE_OK &&
             std::isinf(squares), "squares: an infinite element makes the sum infinite");
  expect(tawpipe_accumulate_squares_cpu(acc, src, 9, 3, 1.f, 0, &squares) == TAWPIPE_ERR_INVALID_ARGUMENT,
         "squares: bad dtype");
  expect(tawpipe_accumulate_squares_cpu(acc, src, TAWPIPE_DTYPE_F32, 3, 1.f, 0, nullptr) ==
             TAWPIPE_ERR_INVALID_ARGUMENT, "squares: no output");
  expect(tawpipe_accumulate_squares_cpu(nullptr, src, TAWPIPE_DTYPE_F32, 3, 1.f, 0, &squares) ==
             TAWPIPE_ERR_INVALID_ARGUMENT, "squares: null accumulator");
}

bool cuda_device_present() {
#ifdef TAWPIPE_KERNELS_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

}  // namespace

int main() {
  std::mt19937_64 rng(0x7a3f91);
  check_conversions();
  check_invalid_arguments();
  check_accumulate_squares(rng);
  std::vector<Where> targets{Where::kCpu};
  if (cuda_device_present()) {
    targets.push_back(Where::kCuda);
  } else {
    std::printf("no CUDA kernels or no CUDA device: testing the CPU kernels only\n");
  }
  for (Where where : targets) {
    for (int accumulate = 0; accumulate < 2; ++accumulate) {
      for (int td = 0; td < 3; ++td) {
        for (int fd = 0; fd < 3; ++fd) {
          check_case(where, rng, td, fd, true, accumulate, false, 60);
          check_case(where, rng, td, fd, false, accumulate, false, 60);
        }
      }
      check_case(where, rng, 0, 1, true, accumulate, true, 300);
      check_case(where, rng, 0, 2, false, accumulate, true, 300);
    }
  }
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all shard kernel checks passed\n");
  return 0;
}
