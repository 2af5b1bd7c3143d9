// The "int8" arithmetic's products (engine/decoding/compute/formats.py, ``arithmetic``): GGUF block weights (Q4_1 and
// Q8_0) multiplied with activations quantized to int8 per row in blocks of 32, as llama.cpp computes them
// (ggml's vec_dot_q4_1_q8_1 and vec_dot_q8_0_q8_0), summed in int32 and scaled per block in a fixed order.
//
// Why: the "fp32" arithmetic rebuilds every 4-bit weight to fp32 and multiplies in fp32, so on a 2-core CPU each extra
// row of a verify pass costs its own ~1.4 ms of fp32 multiply-adds (a 16-row pass 4.6× a 1-row one, AMD EPYC). int8
// dot products (AVX512-VNNI's vpdpbusd: 64 multiply-adds an instruction, four times fp32's FMA) keep passes of a few
// rows near the cost of reading the weights, the regime the lesson describes.
//
// The arithmetic, for output (m, n) with B = K / 32 blocks:
//   activations (quantize_rows, per row m and block b, llama.cpp's quantize_row_q8_1): amax = max |x|, d = amax / 127,
//     q = round-half-even(x · (1 / d)) in [−127, 127] (0 where d is 0), dx = fp16(d), sx = fp16(d · Σ q), sq = Σ q;
//   Q4_1 weights (codes c in [0, 15], scale dw, min mw: w = dw · c + mw):
//     acc ← 0; for b in order: acc ← fma(float(Σ c · q), dw · dx, acc); acc ← fma(mw, sx, acc)
//   Q8_0 weights (int8 v, scale dw): acc ← 0; for b in order: acc ← fma(float(Σ v · q), dw · dx, acc)
//   y = acc (+ bias[n]).
// Integer sums are exact in any order; the float operations are the same, in the same order, for every (m, n), on every
// instruction set (AVX512-VNNI, AVX2, portable C++), whatever M and whichever rows share the call. So each row's result
// depends on that row alone (batch-invariant by construction) and is bit for bit the scalar reference's
// (``int8_reference_*``, written straight from the formulas above on the weights' original layout); tests check both.
//
// Weights are repacked once at load (``int8_pack_q41``, ``int8_pack_q8``) into groups of 16 output rows, interleaved so
// that one 64-byte vector holds 4 consecutive values of each of the 16 rows: one vpdpbusd against 4 broadcast activation
// bytes yields 16 rows' partial sums, one int32 lane each, and a block's scaling (convert, multiply, fused add) then
// serves 16 outputs at once. Layout per group g and block b: Q4_1 256 bytes, byte (L, r, i) = c[r][4L + i] |
// c[r][4(L + 4) + i] << 4 (L < 4, r < 16, i < 4: a vector's low nibbles are step L, its high nibbles step L + 4);
// Q8_0 512 bytes, byte (j, r, i) = v[r][4j + i] + 128 (u8: vpdpbusd multiplies unsigned by signed bytes, so Σ v · q =
// Σ (v + 128) · q − 128 · Σ q, exact). Scales and mins as fp16 [G, B, 16] (GGUF stores them as fp16; a weight whose
// scales are not fp16 values gets no int8 form). Rows past N are zero.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "lanes.h"  // StreamWeight

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define SPEEDUP_LAB_INT8 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPEEDUP_LAB_INT8 256
#else
#define SPEEDUP_LAB_INT8 0
#endif

namespace {

constexpr int kGroup = 16;  // weight rows per interleaved group (one int32 lane each of a 512-bit vector)
constexpr int kBlock = 32;  // values per block (GGUF's Q4_1, Q8_0 and Q8_1)
constexpr int kTile = 8;    // input rows per tile: each group's unpacked block serves up to 8 rows from registers

std::atomic<bool> g_force_portable{false};

inline float to_half(float x) { return static_cast<float>(c10::Half(x)); }

inline float half_bits(uint16_t h) {
  c10::Half v;
  v.x = h;
  return static_cast<float>(v);
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A pass's activations quantized per row in blocks of 32 (quantize_rows).
struct Act {
  const int8_t* q;    // [M, K]
  const float* d;     // [M, K / 32]: fp16(amax / 127)
  const float* s;     // [M, K / 32]: fp16((amax / 127) · Σ q)
  const int32_t* sq;  // [M, K / 32]: Σ q
  int64_t K;
};

// One row's K values (K % 32 == 0) as int8 blocks: q [K], d, s, sq [K / 32]. The same operations for every row.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* sq) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      float r = std::nearbyint(v[i] * id);  // round half to even (the default rounding mode)
      r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
      const int32_t qi = r == r ? static_cast<int32_t>(r) : 0;  // a NaN input quantizes to 0
      q[b * kBlock + i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    d[b] = to_half(dd);
    s[b] = to_half(static_cast<float>(sum) * dd);
    sq[b] = sum;
  }
}

// Scratch for a call's quantized activations (one set per calling thread; a call quantizes once, then its threads read).
struct ActBuffers {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sq;
};

Act quantize_rows(const float* X, int64_t M, int64_t K, ActBuffers& buf) {
  const int64_t nb = K / kBlock;
  if (static_cast<int64_t>(buf.q.size()) < M * K) buf.q.resize(M * K);
  if (static_cast<int64_t>(buf.d.size()) < M * nb) {
    buf.d.resize(M * nb);
    buf.s.resize(M * nb);
    buf.sq.resize(M * nb);
  }
  int8_t* q = buf.q.data();
  float *d = buf.d.data(), *s = buf.s.data();
  int32_t* sq = buf.sq.data();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t e) {
    for (int64_t m = a; m < e; ++m) quantize_row(X + m * K, K, q + m * K, d + m * nb, s + m * nb, sq + m * nb);
  });
  return {q, d, s, sq, K};
}

// The outputs of group g's 16 rows for input rows [m0, m0 + MM): acc [MM][16] as the formulas above define them.
// kQ41: Q4_1 weights (256 bytes a block, mins), else Q8_0 (512 bytes a block, offset 128). Every loop over rows and
// steps is unrolled (the pragmas): a loop GCC left rolled kept the MM accumulators on the stack, one store and load per
// block and row.
#if SPEEDUP_LAB_INT8 == 512
template <int MM, bool kQ41>
inline void tile(const uint8_t* C, const uint16_t* S, const uint16_t* Mn, const Act& a, int64_t m0, int64_t nb,
                 float* out) {
  __m512 acc[MM];
  #pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    if constexpr (kQ41) {
      const uint8_t* p = C + b * 256;
      #pragma GCC unroll 8
      for (int L = 0; L < 4; ++L) {
        const __m512i v = _mm512_loadu_si512(p + 64 * L);
        w[L] = _mm512_and_si512(v, low);
        w[L + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      const uint8_t* p = C + b * 512;
      #pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(p + 64 * j);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + b * kGroup)));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (kQ41) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Mn + b * kGroup)));
    #pragma GCC unroll 8
    for (int i = 0; i < MM; ++i) {
      const int64_t m = m0 + i;
      const int8_t* xq = a.q + m * a.K + b * kBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      #pragma GCC unroll 8
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(load_i32(xq + 4 * j + 4)));
      }
      __m512i s = _mm512_add_epi32(s0, s1);
      const int64_t mb = m * nb + b;
      if constexpr (!kQ41) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a.sq[mb]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[mb])), acc[i]);
      if constexpr (kQ41) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[mb]), acc[i]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) _mm512_storeu_ps(out + i * kGroup, acc[i]);
}
#elif SPEEDUP_LAB_INT8 == 256
// AVX2: the group as two halves of 8 rows (the first and last 32 bytes of each 64-byte vector of the layout).
static inline __m256i dot4(__m256i s, __m256i w, __m256i x, bool q41) {
#if defined(__AVXVNNI__)
  (void)q41;
  return _mm256_dpbusd_avx_epi32(s, w, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  (void)q41;
  return _mm256_dpbusd_epi32(s, w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if (q41)  // codes ≤ 15: a pair's 15 · 127 · 2 fits int16, no saturation
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  // Q8_0 stored + 128: back to signed v, then |v| · sign(x, v) (|v| ≤ 127: no saturation); the offset is not applied,
  // so the caller's "− 128 Σ q" is added back here to keep one integer sum for every instruction set
  const __m256i v = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v)), ones);
  // Σ (v + 128) · x over the lane's 4 bytes = Σ v · x + 128 · Σ x
  const __m256i sx = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), ones);
  return _mm256_add_epi32(s, _mm256_add_epi32(p, _mm256_slli_epi32(sx, 7)));
#endif
}

template <int MM, bool kQ41>
inline void tile(const uint8_t* C, const uint16_t* S, const uint16_t* Mn, const Act& a, int64_t m0, int64_t nb,
                 float* out) {
  #pragma GCC unroll 8
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MM];
    #pragma GCC unroll 8
    for (int i = 0; i < MM; ++i) acc[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
      __m256i w[8];
      if constexpr (kQ41) {
        const uint8_t* p = C + b * 256 + 32 * h;
        #pragma GCC unroll 8
        for (int L = 0; L < 4; ++L) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * L));
          w[L] = _mm256_and_si256(v, low);
          w[L + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      } else {
        const uint8_t* p = C + b * 512 + 32 * h;
        #pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + b * kGroup + 8 * h)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (kQ41) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Mn + b * kGroup + 8 * h)));
      #pragma GCC unroll 8
      for (int i = 0; i < MM; ++i) {
        const int64_t m = m0 + i;
        const int8_t* xq = a.q + m * a.K + b * kBlock;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j += 2) {
          s0 = dot4(s0, w[j], _mm256_set1_epi32(load_i32(xq + 4 * j)), kQ41);
          s1 = dot4(s1, w[j + 1], _mm256_set1_epi32(load_i32(xq + 4 * j + 4)), kQ41);
        }
        __m256i s = _mm256_add_epi32(s0, s1);
        const int64_t mb = m * nb + b;
        if constexpr (!kQ41) s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * a.sq[mb]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[mb])), acc[i]);
        if constexpr (kQ41) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[mb]), acc[i]);
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MM; ++i) _mm256_storeu_ps(out + i * kGroup + 8 * h, acc[i]);
  }
}
#endif

// Portable C++ (any CPU; the loops over the 16 rows vectorise): the same integer sums and float operations as tile.
template <bool kQ41>
void tile_portable(const uint8_t* C, const uint16_t* S, const uint16_t* Mn, const Act& a, int64_t m0, int64_t MM,
                   int64_t nb, float* out) {
  for (int64_t i = 0; i < MM * kGroup; ++i) out[i] = 0.0f;
  uint8_t w[8][64];
  float dw[kGroup], mw[kGroup];
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (kQ41) {
      const uint8_t* p = C + b * 256;
      for (int L = 0; L < 4; ++L)
        for (int t = 0; t < 64; ++t) {
          w[L][t] = p[64 * L + t] & 15;
          w[L + 4][t] = p[64 * L + t] >> 4;
        }
    } else {
      std::memcpy(w, C + b * 512, sizeof(w));
    }
    for (int r = 0; r < kGroup; ++r) {
      dw[r] = half_bits(S[b * kGroup + r]);
      mw[r] = kQ41 ? half_bits(Mn[b * kGroup + r]) : 0.0f;
    }
    for (int64_t i = 0; i < MM; ++i) {
      const int64_t m = m0 + i, mb = m * nb + b;
      const int8_t* xq = a.q + m * a.K + b * kBlock;
      int32_t s[kGroup] = {0};
      for (int j = 0; j < 8; ++j)
        for (int r = 0; r < kGroup; ++r)
          for (int t = 0; t < 4; ++t) s[r] += static_cast<int32_t>(w[j][4 * r + t]) * xq[4 * j + t];
      float* o = out + i * kGroup;
      for (int r = 0; r < kGroup; ++r) {
        const int32_t v = kQ41 ? s[r] : s[r] - 128 * a.sq[mb];
        o[r] = std::fma(static_cast<float>(v), dw[r] * a.d[mb], o[r]);
        if (kQ41) o[r] = std::fma(mw[r], a.s[mb], o[r]);
      }
    }
  }
}

template <bool kQ41>
void run_x8(const float* X, const StreamWeight& W, const float* B, float* Y, int64_t M) {
  const int64_t N = W.N, K = W.K, nb = K / kBlock, G = (N + kGroup - 1) / kGroup;
  const int64_t group_bytes = nb * (kQ41 ? 256 : 512);
  thread_local ActBuffers buf;
  const Act a = quantize_rows(X, M, K, buf);
  const uint8_t* codes = static_cast<const uint8_t*>(W.w);
  const bool portable = SPEEDUP_LAB_INT8 == 0 || g_force_portable.load(std::memory_order_relaxed);
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    float out[kTile * kGroup];
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* C = codes + g * group_bytes;
      const uint16_t* S = W.s16 + g * nb * kGroup;
      const uint16_t* Mn = kQ41 ? W.m16 + g * nb * kGroup : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t mm = std::min<int64_t>(kTile, M - m0);
        if (portable) {
          tile_portable<kQ41>(C, S, Mn, a, m0, mm, nb, out);
        } else {
#if SPEEDUP_LAB_INT8 != 0
          switch (mm) {
            case 1: tile<1, kQ41>(C, S, Mn, a, m0, nb, out); break;
            case 2: tile<2, kQ41>(C, S, Mn, a, m0, nb, out); break;
            case 3: tile<3, kQ41>(C, S, Mn, a, m0, nb, out); break;
            case 4: tile<4, kQ41>(C, S, Mn, a, m0, nb, out); break;
            case 5: tile<5, kQ41>(C, S, Mn, a, m0, nb, out); break;
            case 6: tile<6, kQ41>(C, S, Mn, a, m0, nb, out); break;
            case 7: tile<7, kQ41>(C, S, Mn, a, m0, nb, out); break;
            default: tile<8, kQ41>(C, S, Mn, a, m0, nb, out); break;
          }
#endif
        }
        const int64_t rows = std::min<int64_t>(kGroup, N - g * kGroup);
        for (int64_t i = 0; i < mm; ++i)
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = g * kGroup + r;
            const float v = out[i * kGroup + r];
            Y[(m0 + i) * N + n] = B ? v + B[n] : v;
          }
      }
    }
  });
}

}  // namespace

// y [M, N] = x [M, K] · Wᵀ (+ b) for the int8 forms (StreamWeight kinds 4: Q4_1 × int8, 5: Q8_0 × int8).
void int8_product(const float* X, const StreamWeight& W, const float* B, float* Y, int64_t M) {
  if (M == 0 || W.N == 0) return;
  if (W.kind == 4) return run_x8<true>(X, W, B, Y, M);
  if (W.kind == 5) return run_x8<false>(X, W, B, Y, M);
  TORCH_CHECK(false, "int8_product: weight kind ", W.kind, " is not an int8 form");
}

namespace {

torch::Tensor half_exact(const torch::Tensor& t) {  // t's fp16 bits [same shape] when every value is an fp16 number
  auto h = t.to(torch::kHalf);
  auto back = h.to(torch::kFloat);
  if (!torch::equal(back, t) || !torch::equal(back.signbit(), t.signbit())) return {};
  return h;
}

// [N, nb] fp32 per-row block values → [G, nb, 16] fp16 (rows past N zero), or undefined where not fp16 values.
torch::Tensor group_scales(const torch::Tensor& t, int64_t N, int64_t nb) {
  auto h = half_exact(t);
  if (!h.defined()) return {};
  const int64_t G = (N + kGroup - 1) / kGroup;
  auto padded = torch::zeros({G * kGroup, nb}, torch::kHalf);
  padded.narrow(0, 0, N).copy_(h);
  return padded.view({G, kGroup, nb}).permute({0, 2, 1}).contiguous();
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "int8 product: x [M, K] fp32 on the CPU expected, K = ", K);
}

const float* bias_of(const c10::optional<torch::Tensor>& b, int64_t N, torch::Tensor& keep) {
  if (!b.has_value() || !b->defined()) return nullptr;
  keep = b->contiguous();
  TORCH_CHECK(keep.scalar_type() == torch::kFloat && keep.numel() == N && keep.device().is_cpu(),
              "int8 product: bias [N] fp32 expected");
  return keep.data_ptr<float>();
}

void check_meta(const torch::Tensor& meta, int64_t& N, int64_t& K) {
  TORCH_CHECK(meta.scalar_type() == torch::kLong && meta.numel() == 2, "int8 product: meta [2] int64 (N, K) expected");
  N = meta[0].item<int64_t>();
  K = meta[1].item<int64_t>();
  TORCH_CHECK(N > 0 && K > 0 && K % kBlock == 0, "int8 product: N > 0 and K a multiple of 32 expected");
}

}  // namespace

// (codes [G, nb, 256] uint8, scales [G, nb, 16] fp16, mins [G, nb, 16] fp16, meta [2] int64 (N, K)): the int8 form of
// a Q4_1 weight given as small_linear_q41 reads it (codes [N, K / 2], byte i of a block of 32: value i low nibble,
// value i + 16 high; scales and mins [N, K / 32] fp32); [] where a scale or min is not an fp16 value.
std::vector<torch::Tensor> int8_pack_q41(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              "int8_pack_q41: codes [N, K / 2] contiguous uint8 expected");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && scales.sizes() == mins.sizes() && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == nb && scales.scalar_type() == torch::kFloat && mins.scalar_type() == torch::kFloat,
              "int8_pack_q41: scales and mins [N, K / 32] fp32 expected");
  auto s16 = group_scales(scales.contiguous(), N, nb), m16 = group_scales(mins.contiguous(), N, nb);
  if (!s16.defined() || !m16.defined()) return {};
  const int64_t G = (N + kGroup - 1) / kGroup;
  auto out = torch::zeros({G, nb, 256}, torch::kByte);
  const uint8_t* src = codes.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int r = 0; r < kGroup; ++r) {
          const int64_t n = g * kGroup + r;
          if (n >= N) continue;
          const uint8_t* blk = src + n * (K / 2) + b * 16;
          auto code = [&](int t) { return t < 16 ? blk[t] & 15 : blk[t - 16] >> 4; };
          for (int L = 0; L < 4; ++L)
            for (int i = 0; i < 4; ++i)
              dst[(g * nb + b) * 256 + 64 * L + 4 * r + i] =
                  static_cast<uint8_t>(code(4 * L + i) | (code(4 * (L + 4) + i) << 4));
        }
  });
  auto meta = torch::tensor({N, K}, torch::kLong);
  return {out, s16.view(torch::kShort), m16.view(torch::kShort), meta};
}

// (codes [G, nb, 512] uint8 (value + 128), scales [G, nb, 16] fp16, meta [2] int64 (N, K)): the int8 form of a Q8_0
// weight (values [N, K] int8 in [−127, 127], scales [N, K / 32] fp32); [] where a scale is not an fp16 value or a
// value is −128.
std::vector<torch::Tensor> int8_pack_q8(torch::Tensor values, torch::Tensor scales) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kChar && values.is_contiguous() &&
                  values.device().is_cpu(),
              "int8_pack_q8: values [N, K] contiguous int8 expected");
  const int64_t N = values.size(0), K = values.size(1), nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && scales.dim() == 2 && scales.size(0) == N && scales.size(1) == nb &&
                  scales.scalar_type() == torch::kFloat,
              "int8_pack_q8: scales [N, K / 32] fp32 expected");
  if (values.min().item<int>() < -127) return {};
  auto s16 = group_scales(scales.contiguous(), N, nb);
  if (!s16.defined()) return {};
  const int64_t G = (N + kGroup - 1) / kGroup;
  auto out = torch::full({G, nb, 512}, 128, torch::kByte);
  const int8_t* src = values.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int r = 0; r < kGroup; ++r) {
          const int64_t n = g * kGroup + r;
          if (n >= N) continue;
          for (int j = 0; j < 8; ++j)
            for (int i = 0; i < 4; ++i)
              dst[(g * nb + b) * 512 + 64 * j + 4 * r + i] =
                  static_cast<uint8_t>(src[n * K + b * kBlock + 4 * j + i] + 128);
        }
  });
  auto meta = torch::tensor({N, K}, torch::kLong);
  return {out, s16.view(torch::kShort), meta};
}

// The Python entries of the int8 forms (formats.py's CompactWeight.op: op(x, *tensors, bias)). Return [M, N].
torch::Tensor small_linear_q41x8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                                 torch::Tensor meta, c10::optional<torch::Tensor> b) {
  int64_t N, K;
  check_meta(meta, N, K);
  check_x(x, K);
  TORCH_CHECK(codes.numel() == (N + kGroup - 1) / kGroup * (K / kBlock) * 256 && codes.is_contiguous() &&
                  scales.numel() == mins.numel() && scales.numel() == (N + kGroup - 1) / kGroup * kGroup * (K / kBlock),
              "small_linear_q41x8: tensors of int8_pack_q41 expected");
  x = x.contiguous();
  torch::Tensor keep;
  const float* B = bias_of(b, N, keep);
  auto y = torch::empty({x.size(0), N}, x.options());
  StreamWeight w{4, codes.data_ptr<uint8_t>(), nullptr, nullptr, N, K,
                 reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
                 reinterpret_cast<const uint16_t*>(mins.data_ptr<int16_t>())};
  int8_product(x.data_ptr<float>(), w, B, y.data_ptr<float>(), x.size(0));
  return y;
}

torch::Tensor small_linear_q8x8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor meta,
                                c10::optional<torch::Tensor> b) {
  int64_t N, K;
  check_meta(meta, N, K);
  check_x(x, K);
  TORCH_CHECK(codes.numel() == (N + kGroup - 1) / kGroup * (K / kBlock) * 512 && codes.is_contiguous() &&
                  scales.numel() == (N + kGroup - 1) / kGroup * kGroup * (K / kBlock),
              "small_linear_q8x8: tensors of int8_pack_q8 expected");
  x = x.contiguous();
  torch::Tensor keep;
  const float* B = bias_of(b, N, keep);
  auto y = torch::empty({x.size(0), N}, x.options());
  StreamWeight w{5, codes.data_ptr<uint8_t>(), nullptr, nullptr, N, K,
                 reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()), nullptr};
  int8_product(x.data_ptr<float>(), w, B, y.data_ptr<float>(), x.size(0));
  return y;
}

// [q [M, K] int8, d [M, K / 32] fp32, s [M, K / 32] fp32, sq [M, K / 32] int32]: x's rows as the int8 products quantize
// them (quantize_row).
std::vector<torch::Tensor> int8_quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0 && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "int8_quantize_rows: x [M, K] fp32, K a multiple of 32, expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  auto q = torch::empty({M, K}, torch::kChar);
  auto d = torch::empty({M, nb}, torch::kFloat), s = torch::empty({M, nb}, torch::kFloat);
  auto sq = torch::empty({M, nb}, torch::kInt);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K, d.data_ptr<float>() + m * nb,
                 s.data_ptr<float>() + m * nb, sq.data_ptr<int32_t>() + m * nb);
  return {q, d, s, sq};
}

// The scalar reference: the formulas at the top of this file, one output at a time, on the weights' original layout
// (not the repacked one) and scalar code only. The kernel must give these bits.
torch::Tensor int8_reference_q41(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                                 c10::optional<torch::Tensor> b) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, nb = K / kBlock;
  check_x(x, K);
  auto qx = int8_quantize_rows(x);
  const int8_t* q = qx[0].data_ptr<int8_t>();
  const float *dx = qx[1].data_ptr<float>(), *sx = qx[2].data_ptr<float>();
  codes = codes.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float *dw = scales.data_ptr<float>(), *mw = mins.data_ptr<float>();
  torch::Tensor keep;
  const float* B = bias_of(b, N, keep);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, torch::kFloat);
  float* Y = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t bb = 0; bb < nb; ++bb) {
        const uint8_t* blk = c + n * (K / 2) + bb * 16;
        int32_t isum = 0;
        for (int t = 0; t < kBlock; ++t) {
          const int code = t < 16 ? blk[t] & 15 : blk[t - 16] >> 4;
          isum += code * q[m * K + bb * kBlock + t];
        }
        const float scale = dw[n * nb + bb] * dx[m * nb + bb];
        acc = std::fma(static_cast<float>(isum), scale, acc);
        acc = std::fma(mw[n * nb + bb], sx[m * nb + bb], acc);
      }
      Y[m * N + n] = B ? acc + B[n] : acc;
    }
  return y;
}

torch::Tensor int8_reference_q8(torch::Tensor x, torch::Tensor values, torch::Tensor scales,
                                c10::optional<torch::Tensor> b) {
  const int64_t N = values.size(0), K = values.size(1), nb = K / kBlock;
  check_x(x, K);
  auto qx = int8_quantize_rows(x);
  const int8_t* q = qx[0].data_ptr<int8_t>();
  const float* dx = qx[1].data_ptr<float>();
  values = values.contiguous();
  scales = scales.contiguous();
  const int8_t* v = values.data_ptr<int8_t>();
  const float* dw = scales.data_ptr<float>();
  torch::Tensor keep;
  const float* B = bias_of(b, N, keep);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, torch::kFloat);
  float* Y = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t bb = 0; bb < nb; ++bb) {
        int32_t isum = 0;
        for (int t = 0; t < kBlock; ++t) isum += v[n * K + bb * kBlock + t] * q[m * K + bb * kBlock + t];
        acc = std::fma(static_cast<float>(isum), dw[n * nb + bb] * dx[m * nb + bb], acc);
      }
      Y[m * N + n] = B ? acc + B[n] : acc;
    }
  return y;
}

// Which instruction set the int8 products run on in this build: "avx512-vnni", "avx2-vnni", "avx2" or "portable";
// int8_force_portable(true) makes every later call take the portable code (tests compare the two bit for bit).
std::string int8_impl() {
  if (SPEEDUP_LAB_INT8 == 0 || g_force_portable.load()) return "portable";
#if SPEEDUP_LAB_INT8 == 512
  return "avx512-vnni";
#elif SPEEDUP_LAB_INT8 == 256 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
  return "avx2-vnni";
#else
  return "avx2";
#endif
}

void int8_force_portable(bool on) { g_force_portable.store(on); }

// This CPU's arithmetic ceilings: multiply-adds per second of a register-only loop of independent vector instructions
// on every thread of PyTorch's pool (no memory traffic), over about `seconds`: kind "int8" (vpdpbusd, 4 byte products
// a lane; AVX512-VNNI, else AVX-VNNI, else AVX2's maddubs + madd) or "fp32" (fused multiply-adds). What a pass's
// products can reach at best, for the roofline (engine/explain: "what bytes and arithmetic cost").
double arithmetic_peak(const std::string& kind, double seconds) {
  TORCH_CHECK(kind == "int8" || kind == "fp32", "arithmetic_peak: kind int8 or fp32");
  const bool int8 = kind == "int8";
  constexpr int kChains = 12;
  constexpr int64_t kIters = 1 << 16;
  std::atomic<int64_t> macs{0};
  const auto t0 = std::chrono::steady_clock::now();
  const int threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t done = 0;
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
      if (int8) {
        __m512i acc[kChains];
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
        const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
        for (int64_t i = 0; i < kIters; ++i)
#pragma GCC unroll 12
          for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        int32_t sink = 0;
        for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_epi32(acc[c]);
        asm volatile("" : : "r"(sink));
        done += kIters * kChains * 64;
      } else {
        __m512 acc[kChains];
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
        const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
        for (int64_t i = 0; i < kIters; ++i)
#pragma GCC unroll 12
          for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
        float sink = 0;
        for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_ps(acc[c]);
        asm volatile("" : : "x"(sink));
        done += kIters * kChains * 16;
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if (int8) {
        __m256i acc[kChains];
        for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
        const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
#if !defined(__AVXVNNI__)
        const __m256i ones = _mm256_set1_epi16(1);
#endif
        for (int64_t i = 0; i < kIters; ++i)
#pragma GCC unroll 12
          for (int c = 0; c < kChains; ++c) {
#if defined(__AVXVNNI__)
            acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
#else
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
#endif
          }
        int32_t lanes[8], sink = 0;
        for (int c = 0; c < kChains; ++c) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), acc[c]);
          sink += lanes[0];
        }
        asm volatile("" : : "r"(sink));
        done += kIters * kChains * 32;
      } else {
        __m256 acc[kChains];
        for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
        const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
        for (int64_t i = 0; i < kIters; ++i)
#pragma GCC unroll 12
          for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
        float lanes[8], sink = 0;
        for (int c = 0; c < kChains; ++c) {
          _mm256_storeu_ps(lanes, acc[c]);
          sink += lanes[0];
        }
        asm volatile("" : : "x"(sink));
        done += kIters * kChains * 8;
      }
#else
      {  // portable: what the compiler makes of plain loops (no vector ceiling claimed)
        float f[64];
        int32_t n[64];
        for (int j = 0; j < 64; ++j) { f[j] = static_cast<float>(j); n[j] = j; }
        for (int64_t i = 0; i < kIters / 16; ++i)
          for (int j = 0; j < 64; ++j) {
            if (int8) n[j] = n[j] * 3 + 1;
            else f[j] = f[j] * 0.999f + 1e-3f;
          }
        asm volatile("" : : "r"(n[5]), "x"(f[7]));
        done += kIters / 16 * 64;
      }
#endif
    }
    macs += done;
  });
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(macs.load()) / dt;
}

void register_int8(pybind11::module_& m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("int8_pack_q41", &int8_pack_q41, nogil(), "a Q4_1 weight's int8-arithmetic form, or [] where none");
  m.def("int8_pack_q8", &int8_pack_q8, nogil(), "a Q8_0 weight's int8-arithmetic form, or [] where none");
  m.def("small_linear_q41x8", &small_linear_q41x8, nogil(), "y = x · Wᵀ (+ b): Q4_1 weights × int8 activations");
  m.def("small_linear_q8x8", &small_linear_q8x8, nogil(), "y = x · Wᵀ (+ b): Q8_0 weights × int8 activations");
  m.def("int8_quantize_rows", &int8_quantize_rows, nogil(), "x's rows as int8 blocks of 32: [q, d, s, sum q]");
  m.def("int8_reference_q41", &int8_reference_q41, nogil(), "the scalar reference of small_linear_q41x8");
  m.def("int8_reference_q8", &int8_reference_q8, nogil(), "the scalar reference of small_linear_q8x8");
  m.def("int8_impl", &int8_impl, "the int8 products' instruction set in this build");
  m.def("int8_force_portable", &int8_force_portable, "take the portable int8 code (tests)");
  m.def("arithmetic_peak", &arithmetic_peak, nogil(), "multiply-adds/s of a register-only int8 or fp32 loop on every thread");
}
