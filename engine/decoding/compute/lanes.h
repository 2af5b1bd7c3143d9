// What the extension's sources share (small_linear.cpp, invariant_attention.cpp, fused_layer.cpp include it): the
// 16-float vector they compute with, its fixed-order lane sum and exp polynomial, and a weight as the streaming
// kernel reads it. One copy, so every source adds and exponentiates in the same order (the batch-invariant promise
// rests on it: compute/invariant.py).

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// 16 floats (GCC vector extensions): one AVX-512 register, two AVX2 registers.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v16));
  return v;
}

static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v16)); }

// The 16 lanes added as a fixed pairwise tree (short dependency chains; the same order for every output):
// a_i = v_i + v_(i+8), b_i = a_i + a_(i+4), then (b_0 + b_2) + (b_1 + b_3). With AVX-512 or AVX2 the tree's levels
// are whole-register adds (each lane the same one rounding as the scalar form), 7 instructions instead of ~30.
static inline float lanes_sum(v16 v) {
#if defined(__AVX512F__) || defined(__AVX2__)
  __m256 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const __m256 a = _mm256_add_ps(lo, hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
#else
  float a0 = v[0] + v[8], a1 = v[1] + v[9], a2 = v[2] + v[10], a3 = v[3] + v[11];
  float a4 = v[4] + v[12], a5 = v[5] + v[13], a6 = v[6] + v[14], a7 = v[7] + v[15];
  float b0 = a0 + a4, b1 = a1 + a5, b2 = a2 + a6, b3 = a3 + a7;
  return (b0 + b2) + (b1 + b3);
#endif
}

#if defined(__AVX512F__)
// lanes_sum of four vectors at once, [lanes_sum(a), lanes_sum(b), lanes_sum(c), lanes_sum(d)]: the same adds of the
// same operands in the same tree (each level's adds for the four vectors in one or two registers), so the same four
// floats, in 14 instructions instead of 28. A tile's block (small_linear.cpp) ends with 24 sums over K = 576, about a
// sixth of its instructions one at a time.
static inline __m128 lanes_sum4(v16 a, v16 b, v16 c, v16 d) {
  __m512 A, B, C, D;
  std::memcpy(&A, &a, sizeof(A));
  std::memcpy(&B, &b, sizeof(B));
  std::memcpy(&C, &c, sizeof(C));
  std::memcpy(&D, &d, sizeof(D));
  // a_i = v_i + v_(i+8): quarters [0, 1] + [2, 3] of A and B side by side, then of C and D
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(A, B, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(C, D, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(C, D, _MM_SHUFFLE(3, 2, 3, 2)));
  // b_i = a_i + a_(i+4): one 128-bit lane per vector
  const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  // b_0 + b_2 and b_1 + b_3, then their sum, in element 0 of each lane
  const __m512 w = _mm512_add_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 t = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), t));
}
#endif

// e^x for 16 lanes (Cephes' expf: x = n·ln 2 + r, a degree-5 polynomial in r, × 2^n; about 1 ulp). Lanes below
// −87.3 (e^x below fp32's normal range, −inf included) give 0, above 88.4 e^88.4. The same operations for every lane
// and every call.
static inline v16 exp_v16(v16 x) {
  const v16 lo = splat(-87.33654f), hi = splat(88.37626f);
  v16 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  v16 t = xc * splat(1.44269504088896341f);
  t = t + (t < splat(0.0f) ? splat(-0.5f) : splat(0.5f));
  i16 n = __builtin_convertvector(t, i16);  // round half away from zero
  v16 fn = __builtin_convertvector(n, v16);
  v16 r = xc - fn * splat(0.693359375f);
  r = r - fn * splat(-2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  v16 y = p * (r * r) + r + splat(1.0f);
  i16 bits = (n + 127) << 23;
  v16 two_n;
  std::memcpy(&two_n, &bits, sizeof(v16));
  v16 e = y * two_n;
  return x < lo ? splat(0.0f) : e;
}

// A weight as the streaming kernel reads it: kind 0 fp32 [N, K] (w), 1 fp16 [N, K] (w), 2 Q8 (w int8 [N, K], s [N,
// K / 32]), 3 Q41 (w uint8 [N, K / 2], s and mn [N, K / 32]); the int8 arithmetic's forms (int8_product.cpp): 4 Q4_1 ×
// int8 (w the interleaved codes, s16 and m16 fp16 scales and mins), 5 Q8_0 × int8 (w, s16).
struct StreamWeight {
  int kind;
  const void* w;
  const float* s;
  const float* mn;
  int64_t N, K;
  const uint16_t* s16 = nullptr;
  const uint16_t* m16 = nullptr;
};

// y [M, N] = x [M, K] · Wᵀ (+ b) (small_linear.cpp): the streaming kernel's products, in its order.
void stream_product(const float* X, const StreamWeight& W, const float* B, float* Y, int64_t M);
// The same for the int8 forms (kinds 4 and 5; int8_product.cpp): activations quantized per row, int8 products.
void int8_product(const float* X, const StreamWeight& W, const float* B, float* Y, int64_t M);
