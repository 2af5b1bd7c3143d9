// The "stream" compute path's kernel (engine/decoding/compute/extension.py builds and loads it; nothing else does).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for x [M, K] with few rows (a decode step, a verify pass)
// and w [N, K] row-major fp32, the layout of nn.Linear's weight.
//
// Why: a pass over a few tokens should cost what reading the weights costs. Measured on an AMD EPYC
// (2 threads), PyTorch's MKL sgemm and oneDNN read the weights at roughly half of what a plain sum reads
// (benchmarks/bench_compute.py). This kernel streams each weight row from memory exactly once per call,
// whatever M is: kRows adjacent weight rows (one contiguous stretch of memory) are loaded into registers
// 16 floats at a time and multiplied with every input row (blocks of kInputBlock rows, kRows·kInputBlock
// accumulators), so the input rows stay in the core's caches and the weights are the only traffic to memory.
//
// Summation order is fixed and independent of M and of how the rows are split across threads: for each
// (m, n) the 16-lane partial sums run over k in order, the lanes are added as a fixed pairwise tree, then
// the K % 16 tail, then the bias. So a row's result does not depend on which other rows share the call (batch-invariant).
//
// Threads: at::parallel_for over blocks of kRows weight rows (PyTorch's intra-op pool, torch.set_num_threads).
// Vectors: GCC vector extensions (16 floats); compiled with -march=native for the machine it runs on, so
// AVX-512 CPUs get one register per vector and AVX2 CPUs two.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "lanes.h"  // v16, lanes_sum, StreamWeight

#include <algorithm>
#include <type_traits>
#include <vector>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The compact-weight loaders (F16, Q8, Q41 below) need AVX-512F, or AVX2 with F16C and FMA; a build without either
// reads fp32 weights only (compact_supported() says which).
#if defined(__AVX512F__)
#define SPEEDUP_LAB_COMPACT 512
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define SPEEDUP_LAB_COMPACT 256
#endif


// Weight rows are prefetched this many blocks ahead (measured on the AMD EPYC: 2 blocks beat 0 and 4 for
// 1-16 rows; a prefetch past the end of the weight is harmless, prefetches never fault), into the outer
// caches (locality 1: prefetcht2), not as non-temporal data (locality 0: prefetchnta). Measured on the AMD
// EPYC, 2 threads, 512 MiB of weights cycled so every read comes from memory: nta streamed 18-21 GB/s, t2
// 28-33 GB/s, a plain torch sum of the same weights 31-42 GB/s (scratch kernel variants).
constexpr int kPrefetchBlocks = 2;
constexpr int kPrefetchLocality = 1;

// Register blocking: a block multiplies RR weight rows with MM input rows, MM · RR accumulators in registers. The
// blocking does not change any output's summation order (bit-identical results). Three schedules use it: one pass,
// tiles, and blocks of kInputBlock input rows × kRows weight rows (AVX2 above 6 rows; the weight rows past a tile).
//
// One pass (AVX-512, M ≤ 9; `one_pass`): every input row in ONE block, so each weight row is read once and
// multiplied with all M rows while it is in registers. Splitting M into blocks (8 + 1 for 9 rows, 4 + 1 for 5)
// runs the weights through the core again for each block; measured on the Intel Xeon (Sapphire Rapids, 2
// threads, scratch kernel variants with 600 MB of weights cycled), the LM head product cost, × one row:
// 5 rows 2.02 split (4 + 1) against 1.14 in one pass of 2 weight rows, 9 rows 2.32 (8 + 1) against 1.19 in one pass
// of 1 weight row, 16 rows 3.12 (8 + 8) against 1.85. The weight rows per block fall as M grows so the
// accumulators (MM × RR) stay within 24 registers: 3 for 1-2 rows, 2 for 3-9 rows (fewer registers than 3 × 8
// and better there: 8 rows 1.23 against 1.53). From 10 rows, tiles (below).
//
// Without AVX-512 (AVX2: 16 registers of 8 floats) a 16-float vector takes two registers, so a block holds at
// most 6 accumulators (12 registers) beside one weight vector and one input vector: one weight row × 6 input
// rows, and one pass (every input row in one block) for up to 6 rows, with 3 weight rows for 1 row and 2 for
// 2 rows (`one_pass_for`).
//
// Tiles (AVX-512, M ≥ kTileMinRows; `tiles`): one pass holds at most 2 weight rows beside the M accumulators (from 13
// rows only one), so each input vector loaded serves 1 or 2 products, and the loads, not the multiply-adds, set the
// pace. A tile instead multiplies kTileWeights weight rows with kTileInputs input rows (24 accumulators, 10 loads per
// 24 multiply-adds) and runs over the input rows in blocks. The first block reads the weights in their stored form
// and keeps the fp32 vectors it made (`kKeep`: 4 rows × K floats, in L1); the other blocks read those, so a compact
// weight is decoded once per call whatever M is. Measured on the AMD EPYC (2 threads; the products of a pass of the
// embedded model's shapes, 30 layers of distinct Q4_1 weights and the Q8_0 LM head, against the kernel before, the
// two alternated, medians of 15): 16 rows 29.1 against 48.9 ms (1.68× one pass), 24 and 32 rows 1.27× blocks of 8
// (40.3 and 53.5 ms); up to 9 rows one pass is as fast (one thread, the 3072 × 576 gate/up product: 8 rows 0.376 ms one
// pass, 0.377 tiles; 10 rows 0.461 and 0.440; 12 rows 0.552 and 0.515). 6 × 4 tiles matched 4 × 6 and beat 8 × 3
// (1.59×); decoding each weight into a separate fp32 panel first cost ~7 ms of a 16-row pass's products.
#if defined(__AVX512F__)
constexpr int kRows = 3;
constexpr int kInputBlock = 8;
constexpr int kTileInputs = 6;
constexpr int kTileWeights = 4;
constexpr int kTileMinRows = 10;
#else
constexpr int kRows = 1;
constexpr int kInputBlock = 6;
#endif

// How a block reads its weights. Weights are read 16 values at a time as fp32 vectors; a loader turns what is
// stored into exactly the fp32 weights (compact storage: engine/decoding/compute/formats.py, "exact compact weights"):
//   F32: the fp32 weight itself (nn.Linear's layout [N, K]).
//   F16: fp16 values [N, K] whose fp32 values are the weights (fp16 → fp32 is exact), half the bytes: a draft
//        head saved in fp16 and cast to fp32 at load.
//   Q8:  int8 q [N, K] and one fp32 scale d per 32 values [N, K / 32], the weight being d · q exactly (the product
//        of an int8 and a scale with at most 16 significant bits is exact in fp32), about a quarter of the bytes:
//        the embedded GGUF's Q8_0 token embedding, the tied LM head. K % 32 == 0.
// Whatever the loader, the vector it returns holds the same floats, so every output adds the same products in the
// same order: the compact forms give bit-identical outputs (tests/test_compute.py checks torch.equal). They take K
// in whole vectors only (K % 16 == 0): the scalar tail for K % 16 values is compiled differently per loader (GCC
// fused the products into the sum for one and not the other: measured, K = 40 gave other last bits).
struct F32 {
  static constexpr bool kPair = false;  // read 16 values at a time (Q41 reads a block of 32)
  const float* W;
  int64_t K;
  inline v16 load(int64_t n, int64_t k) const {
    v16 v;
    __builtin_memcpy(&v, W + n * K + k, sizeof(v16));
    return v;
  }
  inline float at(int64_t n, int64_t k) const { return W[n * K + k]; }
  inline const void* line(int64_t n, int64_t k) const { return W + n * K + k; }
};

#if defined(SPEEDUP_LAB_COMPACT) && SPEEDUP_LAB_COMPACT == 256
// Two 8-float AVX2 registers as one 16-float vector (the same floats in the same lanes as an AVX-512 register).
static inline v16 join(__m256 lo, __m256 hi) {
  v16 v;
  __builtin_memcpy(&v, &lo, sizeof(lo));
  __builtin_memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
}
#endif

#if defined(SPEEDUP_LAB_COMPACT)
struct F16 {
  static constexpr bool kPair = false;
  const uint16_t* W;
  int64_t K;
  inline v16 load(int64_t n, int64_t k) const {
#if SPEEDUP_LAB_COMPACT == 512
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + n * K + k)));
    return reinterpret_cast<v16&>(v);
#else
    const __m128i* p = reinterpret_cast<const __m128i*>(W + n * K + k);
    return join(_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p + 1)));
#endif
  }
  inline float at(int64_t n, int64_t k) const { return _cvtsh_ss(W[n * K + k]); }
  inline const void* line(int64_t n, int64_t k) const { return W + n * K + k; }
};

struct Q8 {
  static constexpr bool kPair = false;
  const int8_t* W;
  const float* S;
  int64_t K;
  inline v16 load(int64_t n, int64_t k) const {
#if SPEEDUP_LAB_COMPACT == 512
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W + n * K + k))));
    __m512 v = _mm512_mul_ps(q, _mm512_set1_ps(S[n * (K / 32) + k / 32]));  // exact: no rounding to fuse away
    return reinterpret_cast<v16&>(v);
#else
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(W + n * K + k));
    const __m256 d = _mm256_set1_ps(S[n * (K / 32) + k / 32]);
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
    return join(_mm256_mul_ps(lo, d), _mm256_mul_ps(hi, d));  // exact, as above
#endif
  }
  inline float at(int64_t n, int64_t k) const { return float(W[n * K + k]) * S[n * (K / 32) + k / 32]; }
  inline const void* line(int64_t n, int64_t k) const { return W + n * K + k; }
};

//   Q41: 4-bit codes q in [0, 15], one fp32 scale d and one fp32 minimum m per 32 values, the weight being
//        d · q + m exactly (the GGUF format Q4_1, the embedded model's layers; d · q is exact in fp32, so the one
//        rounding of the sum, fused or not, gives the same float): 0.75 bytes a value instead of 4. Codes packed
//        two a byte, 16 bytes per block of 32: byte i holds value i (low nibble) and value i + 16 (high nibble).
//        Read a block at a time (kPair: both 16-lane vectors from one 16-byte load): the block's 16 possible
//        weights d · q + m are one register (a lookup table), and each vector is a permute of it by the codes, so
//        decoding costs a widening load, a mask, a shift and two permutes per 32 weights.
struct Q41 {
  static constexpr bool kPair = true;
  const uint8_t* W;
  const float* S;
  const float* Mn;
  int64_t K;
  inline void load2(int64_t n, int64_t k, v16& a, v16& b) const {
    const int64_t blk = n * (K / 32) + k / 32;
#if SPEEDUP_LAB_COMPACT == 512
    // each byte widened to a lane; a permute reads only an index's low 4 bits (its low nibble, value i), and the
    // shift leaves the high nibble (value i + 16)
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W + (n * K + k) / 2)));
    const __m512i hi = _mm512_srli_epi32(lo, 4);
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 lut = _mm512_fmadd_ps(iota, _mm512_set1_ps(S[blk]), _mm512_set1_ps(Mn[blk]));  // d · q exact
    __m512 va = _mm512_permutexvar_ps(lo, lut), vb = _mm512_permutexvar_ps(hi, lut);
    a = reinterpret_cast<v16&>(va);
    b = reinterpret_cast<v16&>(vb);
#else
    // AVX2 has no 16-entry float permute: each code is widened, converted and scaled, fma(q, d, m), the same one
    // rounding of the exact d · q as the table above, so the same floats.
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(W + (n * K + k) / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 d = _mm256_set1_ps(S[blk]), m = _mm256_set1_ps(Mn[blk]);
    auto half = [&](__m128i codes) {
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), d, m);
    };
    a = join(half(lo), half(_mm_unpackhi_epi64(lo, lo)));
    b = join(half(hi), half(_mm_unpackhi_epi64(hi, hi)));
#endif
  }
  inline v16 load(int64_t n, int64_t k) const {  // one half of a block (k % 16 == 0)
    v16 a, b;
    load2(n, k / 32 * 32, a, b);
    return (k % 32) ? b : a;
  }
  inline float at(int64_t n, int64_t k) const {
    const uint8_t byte = W[(n * K + k / 32 * 32) / 2 + (k % 16)];
    const int code = (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
    const int64_t blk = n * (K / 32) + k / 32;
    return std::fma(float(code), S[blk], Mn[blk]);
  }
  inline const void* line(int64_t n, int64_t k) const { return W + (n * K + k) / 2; }
};
#endif

// Keeps v in a register: without it GCC folds an input vector's load into each of its RR multiply-adds (a memory
// operand each), so a block of MM × RR products made MM · RR loads instead of MM + RR, and the loads set the pace
// (measured on the AMD EPYC: 8 × 3 and 6 × 4 blocks in L1, one thread, 54 and 48 against 84 and 85 GFLOP/s of a
// 115 GFLOP/s peak). An empty asm: no instruction, and no change to any value. Without AVX-512 a vector is two
// registers, which the constraint cannot name, and nothing is pinned.
static inline void in_register(v16& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// Tile weights read from an fp32 copy that a first block kept (see "Tiles" above): rows [n0, n0 + RR) of a weight,
// K floats a row.
struct Kept {
  static constexpr bool kPair = false;
  const float* W;
  int64_t K, n0;
  inline v16 load(int64_t n, int64_t k) const {
    v16 v;
    __builtin_memcpy(&v, W + (n - n0) * K + k, sizeof(v16));
    return v;
  }
  inline float at(int64_t n, int64_t k) const { return W[(n - n0) * K + k]; }
  inline const void* line(int64_t, int64_t) const { return W; }
};

// One block: RR adjacent weight rows (from n0) against MM input rows (from m0), both compile-time, so the
// RR·MM accumulators live in registers. Every instantiation adds in the same order (see the file's header). With
// kKeep, the fp32 weight vectors it reads are also written to keep (RR rows of K floats), for later blocks (`Kept`).
// Never inlined: inlined into `tiles`' schedule beside its other blocks, GCC kept the 4-row tail's accumulators on the
// stack and stored them every step (measured: the 4-row block of a 16-row tile cost more than a 6-row block).
template <int MM, int RR, class L, bool kKeep = false>
__attribute__((noinline)) static void block(const float* X, const L& W, const float* B, float* Y, int64_t K, int64_t N,
                         int64_t m0, int64_t n0, float* keep = nullptr) {
  const int64_t K16 = K / 16 * 16;
  v16 acc[MM][RR];
  for (int i = 0; i < MM; ++i)
    for (int r = 0; r < RR; ++r) acc[i][r] = (v16){0};
  if constexpr (L::kPair) {  // two vectors per weight row from one read of a block (K % 32 == 0): the same order
    for (int64_t k = 0; k < K16; k += 32) {
      v16 wa[RR], wb[RR];
      for (int r = 0; r < RR; ++r) W.load2(n0 + r, k, wa[r], wb[r]);
      if constexpr (kKeep)
        for (int r = 0; r < RR; ++r) {
          __builtin_memcpy(keep + r * K + k, &wa[r], sizeof(v16));
          __builtin_memcpy(keep + r * K + k + 16, &wb[r], sizeof(v16));
        }
      for (int r = 0; r < RR; ++r) __builtin_prefetch(W.line(n0 + r + kPrefetchBlocks * RR, k), 0, kPrefetchLocality);
      for (int i = 0; i < MM; ++i) {
        v16 xa, xb;
        __builtin_memcpy(&xa, X + (m0 + i) * K + k, sizeof(v16));
        __builtin_memcpy(&xb, X + (m0 + i) * K + k + 16, sizeof(v16));
        in_register(xa);
        in_register(xb);
        for (int r = 0; r < RR; ++r) acc[i][r] += xa * wa[r];
        for (int r = 0; r < RR; ++r) acc[i][r] += xb * wb[r];
      }
    }
  } else
  for (int64_t k = 0; k < K16; k += 16) {
    v16 wv[RR];
    for (int r = 0; r < RR; ++r) {
      wv[r] = W.load(n0 + r, k);
      in_register(wv[r]);
    }
    if constexpr (kKeep)
      for (int r = 0; r < RR; ++r) __builtin_memcpy(keep + r * K + k, &wv[r], sizeof(v16));
    for (int r = 0; r < RR; ++r) __builtin_prefetch(W.line(n0 + r + kPrefetchBlocks * RR, k), 0, kPrefetchLocality);
    for (int i = 0; i < MM; ++i) {
      v16 xv;
      __builtin_memcpy(&xv, X + (m0 + i) * K + k, sizeof(v16));
      in_register(xv);
      for (int r = 0; r < RR; ++r) acc[i][r] += xv * wv[r];
    }
  }
#if defined(__AVX512F__)
  if constexpr (RR == 4) {
    if (K16 == K) {  // a tile's four sums per input row at once (lanes_sum4: the same floats), then the bias
      for (int i = 0; i < MM; ++i) {
        __m128 s = lanes_sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        if (B) s = _mm_add_ps(s, _mm_loadu_ps(B + n0));
        _mm_storeu_ps(Y + (m0 + i) * N + n0, s);
      }
      return;
    }
  }
#endif
  for (int i = 0; i < MM; ++i) {
    for (int r = 0; r < RR; ++r) {
      float s = lanes_sum(acc[i][r]);
      for (int64_t k = K16; k < K; ++k) s += X[(m0 + i) * K + k] * W.at(n0 + r, k);
      if (B) s += B[n0 + r];
      Y[(m0 + i) * N + n0 + r] = s;
    }
  }
}

template <int RR, class L>
static inline void rows(const float* X, const L& W, const float* B, float* Y, int64_t K, int64_t M, int64_t N,
                        int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + kInputBlock <= M; m0 += kInputBlock) block<kInputBlock, RR>(X, W, B, Y, K, N, m0, n0);
  if constexpr (kInputBlock == 6) {  // the rest in one block of 4 or 5 (AVX2) …
    if (M - m0 == 5) { block<5, RR>(X, W, B, Y, K, N, m0, n0); m0 += 5; }
  }
  if (m0 + 4 <= M) { block<4, RR>(X, W, B, Y, K, N, m0, n0); m0 += 4; }  // … or of 4 (AVX-512), and one of 1-3
  switch (M - m0) {
    case 3: block<3, RR>(X, W, B, Y, K, N, m0, n0); break;
    case 2: block<2, RR>(X, W, B, Y, K, N, m0, n0); break;
    case 1: block<1, RR>(X, W, B, Y, K, N, m0, n0); break;
    default: break;
  }
}

// Every weight row read once for all M input rows (one block of MM rows; see "One pass" above).
template <int MM, int RR, class L>
static void one_pass(const float* X, const L& W, const float* B, float* Y, int64_t K, int64_t N) {
  const int64_t full = N / RR;
  at::parallel_for(0, full, 48 / RR, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) block<MM, RR>(X, W, B, Y, K, N, 0, blk * RR);
  });
  for (int64_t n0 = full * RR; n0 < N; ++n0) block<MM, 1>(X, W, B, Y, K, N, 0, n0);
}

// The one-pass schedule for M rows (1-9 with AVX-512, 1-6 without); false where M is outside it.
template <class L>
static bool one_pass_for(const float* X, const L& W, const float* B, float* Y, int64_t K, int64_t M,
                         int64_t N) {
#if defined(__AVX512F__)
  switch (M) {
    case 1: one_pass<1, 3>(X, W, B, Y, K, N); return true;
    case 2: one_pass<2, 3>(X, W, B, Y, K, N); return true;
    case 3: one_pass<3, 2>(X, W, B, Y, K, N); return true;
    case 4: one_pass<4, 2>(X, W, B, Y, K, N); return true;
    case 5: one_pass<5, 2>(X, W, B, Y, K, N); return true;
    case 6: one_pass<6, 2>(X, W, B, Y, K, N); return true;
    case 7: one_pass<7, 2>(X, W, B, Y, K, N); return true;
    case 8: one_pass<8, 2>(X, W, B, Y, K, N); return true;
    case 9: one_pass<9, 2>(X, W, B, Y, K, N); return true;
    default: return false;
  }
#else
  switch (M) {
    case 1: one_pass<1, 3>(X, W, B, Y, K, N); return true;
    case 2: one_pass<2, 2>(X, W, B, Y, K, N); return true;
    case 3: one_pass<3, 1>(X, W, B, Y, K, N); return true;
    case 4: one_pass<4, 1>(X, W, B, Y, K, N); return true;
    case 5: one_pass<5, 1>(X, W, B, Y, K, N); return true;
    case 6: one_pass<6, 1>(X, W, B, Y, K, N); return true;
    default: return false;
  }
#endif
}

#if defined(__AVX512F__)
// Tiles of kTileWeights weight rows × every input row (see "Tiles" above; M ≥ kTileInputs): per tile, a first block of
// kTileInputs input rows reads the stored weights and keeps their fp32 vectors, the other blocks read the kept ones
// (fp32 weights are read where they are). The weight rows past the last whole tile go one at a time.
template <class L>
static void tiles(const float* X, const L& W, const float* B, float* Y, int64_t K, int64_t M, int64_t N) {
  constexpr int RR = kTileWeights, MM = kTileInputs;
  constexpr bool kStored = std::is_same_v<L, F32>;
  const int64_t count = N / RR;
  at::parallel_for(0, count, 4, [&](int64_t first, int64_t last) {
    std::vector<float> kept(kStored ? 0 : RR * K);
    for (int64_t t = first; t < last; ++t) {
      const int64_t n0 = t * RR;
      auto rest = [&](const auto& w) {
        int64_t m0 = MM;
        for (; m0 + MM <= M; m0 += MM) block<MM, RR>(X, w, B, Y, K, N, m0, n0);
        switch (M - m0) {
          case 5: block<5, RR>(X, w, B, Y, K, N, m0, n0); break;
          case 4: block<4, RR>(X, w, B, Y, K, N, m0, n0); break;
          case 3: block<3, RR>(X, w, B, Y, K, N, m0, n0); break;
          case 2: block<2, RR>(X, w, B, Y, K, N, m0, n0); break;
          case 1: block<1, RR>(X, w, B, Y, K, N, m0, n0); break;
          default: break;
        }
      };
      if constexpr (kStored) {
        block<MM, RR>(X, W, B, Y, K, N, 0, n0);
        rest(W);
      } else {
        block<MM, RR, L, true>(X, W, B, Y, K, N, 0, n0, kept.data());
        rest(Kept{kept.data(), K, n0});
      }
    }
  });
  for (int64_t n0 = count * RR; n0 < N; ++n0) rows<1>(X, W, B, Y, K, M, N, n0);
}
#endif

// Every output of y = x · Wᵀ + b for the loader's weights: one pass for few rows, else tiles (AVX-512) or blocks of
// rows.
template <class L>
static void run(const float* X, const L& W, const float* B, float* Y, int64_t K, int64_t M, int64_t N) {
#if defined(__AVX512F__)
  if (M >= kTileMinRows) return tiles(X, W, B, Y, K, M, N);
#endif
  if (one_pass_for(X, W, B, Y, K, M, N)) return;
  const int64_t full = N / kRows;
  at::parallel_for(0, full, 16, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) rows<kRows>(X, W, B, Y, K, M, N, blk * kRows);
  });
  for (int64_t n0 = full * kRows; n0 < N; ++n0) rows<1>(X, W, B, Y, K, M, N, n0);
}

// y [M, N] = x [M, K] · Wᵀ (+ b): the same products, in the same order, as the Python entries below.
void stream_product(const float* X, const StreamWeight& W, const float* B, float* Y, int64_t M) {
  const int64_t N = W.N, K = W.K;
  switch (W.kind) {
    case 0: run(X, F32{static_cast<const float*>(W.w), K}, B, Y, K, M, N); return;
    case 4:
    case 5: int8_product(X, W, B, Y, M); return;
#if defined(SPEEDUP_LAB_COMPACT)
    case 1: run(X, F16{static_cast<const uint16_t*>(W.w), K}, B, Y, K, M, N); return;
    case 2: run(X, Q8{static_cast<const int8_t*>(W.w), W.s, K}, B, Y, K, M, N); return;
    case 3: run(X, Q41{static_cast<const uint8_t*>(W.w), W.s, W.mn, K}, B, Y, K, M, N); return;
#endif
    default: TORCH_CHECK(false, "stream_product: this build cannot read weight kind ", W.kind);
  }
}

// The checks every entry shares; returns contiguous x and the bias pointer (or nullptr).
static const float* inputs(torch::Tensor& x, int64_t N, int64_t K, const c10::optional<torch::Tensor>& b,
                           torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "small_linear: x [M, K] expected, K = ", K);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.device().is_cpu(), "small_linear: x must be fp32 on the CPU");
  x = x.contiguous();
  if (b.has_value() && b->defined()) {
    bias = b->contiguous();
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.numel() == N, "small_linear: bias [N] fp32");
    return bias.data_ptr<float>();
  }
  return nullptr;
}

// x: [M, K] fp32 CPU; w: [N, K] fp32 CPU contiguous; b: [N] or undefined. Returns [M, N].
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "small_linear: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK(w.is_contiguous(), "small_linear: w must be contiguous");
  const int64_t N = w.size(0), K = w.size(1);
  torch::Tensor bias;
  const float* B = inputs(x, N, K, b, bias);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  run(x.data_ptr<float>(), F32{w.data_ptr<float>(), K}, B, y.data_ptr<float>(), K, M, N);
  return y;
}

// Whether this build reads compact weights (AVX-512F, or AVX2 with F16C and FMA).
bool compact_supported() {
#if defined(SPEEDUP_LAB_COMPACT)
  return true;
#else
  return false;
#endif
}

// x: [M, K] fp32; w16: [N, K] fp16 contiguous (the weights exactly). Returns [M, N], the bits small_linear gives for
// w16.float().
torch::Tensor small_linear_f16(torch::Tensor x, torch::Tensor w16, c10::optional<torch::Tensor> b) {
#if defined(SPEEDUP_LAB_COMPACT)
  TORCH_CHECK(w16.dim() == 2 && w16.scalar_type() == torch::kHalf && w16.device().is_cpu() && w16.is_contiguous(),
              "small_linear_f16: w16 [N, K] contiguous fp16 on the CPU expected");
  const int64_t N = w16.size(0), K = w16.size(1);
  TORCH_CHECK(K % 16 == 0, "small_linear_f16: K must be a multiple of 16");
  torch::Tensor bias;
  const float* B = inputs(x, N, K, b, bias);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  run(x.data_ptr<float>(), F16{reinterpret_cast<const uint16_t*>(w16.data_ptr<at::Half>()), K}, B,
      y.data_ptr<float>(), K, M, N);
  return y;
#else
  TORCH_CHECK(false, "small_linear_f16: this build has neither AVX-512F nor AVX2 with F16C and FMA");
#endif
}

// x: [M, K] fp32; q: [N, K] int8 contiguous; scales: [N, K / 32] fp32 contiguous (weight = scale · q exactly);
// K % 32 == 0. Returns [M, N], the bits small_linear gives for the fp32 weights.
torch::Tensor small_linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scales, c10::optional<torch::Tensor> b) {
#if defined(SPEEDUP_LAB_COMPACT)
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.device().is_cpu() && q.is_contiguous(),
              "small_linear_q8: q [N, K] contiguous int8 on the CPU expected");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % 32 == 0, "small_linear_q8: K must be a multiple of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / 32 &&
                  scales.scalar_type() == torch::kFloat && scales.is_contiguous(),
              "small_linear_q8: scales [N, K / 32] contiguous fp32 expected");
  torch::Tensor bias;
  const float* B = inputs(x, N, K, b, bias);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  run(x.data_ptr<float>(), Q8{q.data_ptr<int8_t>(), scales.data_ptr<float>(), K}, B, y.data_ptr<float>(), K, M, N);
  return y;
#else
  TORCH_CHECK(false, "small_linear_q8: this build has neither AVX-512F nor AVX2 with F16C and FMA");
#endif
}

// invariant_attention.cpp (built into this extension): a decode pass's attention in a fixed summation order.
torch::Tensor invariant_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cols,
                                  torch::Tensor n_cols, torch::Tensor n_fed, double scale);

// x: [M, K] fp32; codes: [N, K / 2] uint8 contiguous (Q41's packing); scales, mins: [N, K / 32] fp32 contiguous
// (weight = scale · code + min exactly); K % 32 == 0. Returns [M, N], the bits small_linear gives for the fp32
// weights.
torch::Tensor small_linear_q41(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                               c10::optional<torch::Tensor> b) {
#if defined(SPEEDUP_LAB_COMPACT)
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kByte && codes.device().is_cpu() &&
                  codes.is_contiguous(),
              "small_linear_q41: codes [N, K / 2] contiguous uint8 on the CPU expected");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(K % 32 == 0, "small_linear_q41: K must be a multiple of 32");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == K / 32 && t->scalar_type() == torch::kFloat &&
                    t->is_contiguous(),
                "small_linear_q41: scales and mins [N, K / 32] contiguous fp32 expected");
  torch::Tensor bias;
  const float* B = inputs(x, N, K, b, bias);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  run(x.data_ptr<float>(), Q41{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), K}, B,
      y.data_ptr<float>(), K, M, N);
  return y;
#else
  TORCH_CHECK(false, "small_linear_q41: this build has neither AVX-512F nor AVX2 with F16C and FMA");
#endif
}

// The Q41 form of w [N, K] fp32 (K % 32 == 0) when every block of 32 values along K is exactly d · q + m with codes
// q in [0, 15] (GGUF's Q4_1 dequantized as gguf does it: d · q + m in fp32, d an fp16 value): (codes [N, K / 2] uint8
// packed as Q41 reads them, scales and mins [N, K / 32] fp32); an empty list where any block is not. m is the block's
// smallest value (its code is 0); d is tried among fp16(span / 15), fp16(span / 14) and their two fp16 neighbours
// each way (a quantizer's largest value has code 15, or 14 where it rounded down), and every value must come back
// with the same bits. Non-finite values are never exact.
std::vector<torch::Tensor> q41_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.device().is_cpu() && w.is_contiguous(),
              "q41_pack: w [N, K] contiguous fp32 on the CPU expected");
  const int64_t N = w.size(0), K = w.size(1);
  if (K % 32) return {};
  auto codes = torch::empty({N, K / 2}, torch::kByte);
  auto scales = torch::empty({N, K / 32}, torch::kFloat);
  auto mins = torch::empty({N, K / 32}, torch::kFloat);
  const float* W = w.data_ptr<float>();
  uint8_t* C = codes.data_ptr<uint8_t>();
  float* S = scales.data_ptr<float>();
  float* Mn = mins.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, N * (K / 32), 256, [&](int64_t first, int64_t last) {
    uint8_t q[32];
    for (int64_t blk = first; blk < last && exact.load(std::memory_order_relaxed); ++blk) {
      const float* v = W + blk * 32;
      float lo = v[0], hi = v[0];
      bool finite = true;
      for (int i = 0; i < 32; ++i) {
        finite = finite && std::isfinite(v[i]);
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
      }
      bool ok = false;
      float found = 0.0f;
      if (finite && hi == lo) {  // a constant block: every code 0, d 0 (checked below like any other)
        ok = true;
        for (int i = 0; i < 32; ++i) {
          q[i] = 0;
          const float back = 0.0f * 0.0f + lo;
          ok = ok && std::memcmp(&back, v + i, sizeof(float)) == 0;
        }
      }
      for (int c = 0; finite && !ok && c < 10; ++c) {
        const int16_t base = c10::Half((hi - lo) / (c < 5 ? 15.0f : 14.0f)).x;
        static constexpr int kSteps[5] = {0, 1, -1, 2, -2};
        const int step = base + kSteps[c % 5];
        if (step < 0 || step > 0x7BFF) continue;  // negative or not finite as fp16
        c10::Half h;
        h.x = static_cast<uint16_t>(step);
        const float d = static_cast<float>(h);
        if (d == 0.0f) continue;
        ok = true;
        for (int i = 0; i < 32 && ok; ++i) {
          float code = std::nearbyint((v[i] - lo) / d);
          code = code < 0.0f ? 0.0f : (code > 15.0f ? 15.0f : code);
          q[i] = static_cast<uint8_t>(code);
          const float back = d * code + lo;  // d · code is exact: fused or not, one rounding
          ok = std::memcmp(&back, v + i, sizeof(float)) == 0;
        }
        found = d;
      }
      if (!ok) {
        exact.store(false, std::memory_order_relaxed);
        break;
      }
      S[blk] = found;
      Mn[blk] = lo;
      for (int i = 0; i < 16; ++i) C[blk * 16 + i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
    }
  });
  if (!exact.load()) return {};
  return {codes, scales, mins};
}

// fused_layer.cpp (built into this extension): the decoder layer of a batch-invariant decode pass as two calls.
void register_fused_layer(pybind11::module_& m);
// int8_product.cpp (built into this extension): the int8 arithmetic's products.
void register_int8(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every entry lets go of Python's GIL while it computes (it touches no Python object): a Streamlit page's thread
  // drawing in Python beside the room's worker otherwise held the worker back between its calls.
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  register_fused_layer(m);
  register_int8(m);
  m.def("small_linear", &small_linear, nogil(), "y = x @ w.T + b for few rows (fp32, CPU)");
  m.def("small_linear_f16", &small_linear_f16, nogil(), "small_linear for weights stored exactly as fp16");
  m.def("small_linear_q8", &small_linear_q8, nogil(), "small_linear for weights stored exactly as int8 x fp32 scale per 32");
  m.def("small_linear_q41", &small_linear_q41, nogil(),
        "small_linear for weights stored exactly as 4-bit codes x fp32 scale + fp32 min per 32 (GGUF Q4_1)");
  m.def("q41_pack", &q41_pack, nogil(), "the exact Q4_1 form of an fp32 weight (codes, scales, mins), or [] where none");
  m.def("invariant_attention", &invariant_attention, nogil(),
        "causal decode attention whose every row is computed in a fixed order from its own keys (batch-invariant)");
  m.def("compact_supported", &compact_supported, nogil(), "whether the compact-weight entries work in this build");
}
