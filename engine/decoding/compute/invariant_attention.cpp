// Causal attention of a decode pass in a summation order this project fixes (engine/decoding/compute/invariant.py's
// invariant_attention calls it; built into the streaming kernel's extension, small_linear.cpp registers it).
//
// out[b, h, j, :] = sum_c softmax_c(scale · q[b, h, j] · k[b, g, cols[b, c]]) · v[b, g, cols[b, c]]
// over the first n_cols[b] − n_fed[b] + j + 1 of row b's key columns (its cached keys, then its fed tokens' keys,
// query j seeing its own and the earlier ones), g = h / (H / G) (grouped heads). Queries j ≥ n_fed[b] get zeros.
//
// Why: a row of the room's shared pass must get exactly the bits of its lone pass whichever rows share it, on any
// CPU. A library's attention gives no such promise (its blocking, vector tails and thread split depend on the
// call's shapes: PyTorch's CPU SDPA gave other last bits for a row beside other rows on an AMD EPYC where it gave
// the same on an Intel Xeon). Here every output is computed by the same instructions from the row's own keys only:
//   - a score: the 16-lane partial products over the head dimension in order, the lanes added as a fixed pairwise
//     tree, then the dimension's tail (D % 16), then × scale;
//   - the softmax over the row's visible keys in blocks of 16 (the block's tail padded with −inf): the maximum,
//     exp by one polynomial (exp_v16, the same for every lane), the 16 lane sums in key order, then the pairwise tree;
//   - the values: e_c · v_c added in key order, 16 lanes of the head dimension at a time, then ÷ the sum.
// Nothing depends on B, on the other rows' lengths, on where a row's keys sit in the batch cache, or on how
// at::parallel_for splits the (row, head) pairs across threads. So a row's result is a function of its own q, keys
// and values: bit for bit the same alone and in any batch (tests/test_scheduler.py checks it).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "lanes.h"  // v16, lanes_sum, exp_v16

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float lanes_max(v16 v) {  // exact whatever the order
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float dot(const float* a, const float* b, int64_t D) {
  const int64_t D16 = D / 16 * 16;
  v16 acc = splat(0.0f);
  for (int64_t d = 0; d < D16; d += 16) acc += load16(a + d) * load16(b + d);
  float s = lanes_sum(acc);
  for (int64_t d = D16; d < D; ++d) s += a[d] * b[d];
  return s;
}

struct Rows {  // one call's tensors and shapes (see invariant_attention and invariant_attention_rows below)
  const float *q, *k, *v;
  float* out;
  const int64_t *cols, *n_cols, *n_fed;
  int64_t C, H, Q, D, ksb, ksg, ksl, vsb, vsg, vsl, group;
  float scale;
  // Rows in their own caches (invariant_attention_rows): row b's keys and values start at kbase[b] and vbase[b], a kv
  // head every hstride[b] floats, a key every D floats, its columns 0, 1, … in order (cols unused). nullptr: one
  // batch tensor, as above.
  const float* const* kbase = nullptr;
  const float* const* vbase = nullptr;
  const int64_t* hstride = nullptr;
};

// Score of one key: NV > 0 vectors of 16 lanes held in registers (D == 16 · NV), NV == 0 any D (a scalar tail).
template <int NV>
inline float score(const float* q, const float* key, int64_t D) {
  if constexpr (NV == 0) {
    return dot(q, key, D);
  } else {
    v16 acc = load16(q) * load16(key);
    for (int i = 1; i < NV; ++i) acc += load16(q + 16 * i) * load16(key + 16 * i);
    return lanes_sum(acc);
  }
}

// The (row, head) pairs [first, last): every query a row feeds, over the row's own visible keys.
template <int NV>
void attend(const Rows& a, int64_t first, int64_t last) {
  const int64_t D = a.D, D16 = D / 16 * 16;
  std::vector<float> e;
  std::vector<float> tail(D);
  for (int64_t task = first; task < last; ++task) {
    const int64_t b = task / a.H, h = task % a.H, g = h / a.group;
    const int64_t fed = a.n_fed[b], ncols = a.n_cols[b];
    // key column c of this row: rc[c], or c itself for a row in its own cache (the same keys, read by the same code)
    const int64_t* rc = a.kbase ? nullptr : a.cols + b * a.C;
    const float* kb = a.kbase ? a.kbase[b] + g * a.hstride[b] : a.k + b * a.ksb + g * a.ksg;
    const float* vb = a.kbase ? a.vbase[b] + g * a.hstride[b] : a.v + b * a.vsb + g * a.vsg;
    const int64_t ksl = a.kbase ? D : a.ksl, vsl = a.kbase ? D : a.vsl;
    for (int64_t j = 0; j < fed; ++j) {
      const float* qj = a.q + ((b * a.H + h) * a.Q + j) * D;
      const int64_t n = ncols - fed + j + 1;  // the keys query j sees
      const int64_t padded = (n + 15) / 16 * 16;
      e.assign(padded, -std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < n; ++c) e[c] = score<NV>(qj, kb + (rc ? rc[c] : c) * ksl, D) * a.scale;
      v16 mv = splat(-std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < padded; c += 16) {
        v16 x = load16(e.data() + c);
        mv = x > mv ? x : mv;
      }
      const v16 m = splat(lanes_max(mv));
      v16 sv = splat(0.0f);
      for (int64_t c = 0; c < padded; c += 16) {
        v16 x = exp_v16(load16(e.data() + c) - m);
        store16(e.data() + c, x);
        sv += x;
      }
      const float inv = 1.0f / lanes_sum(sv);
      float* oj = a.out + ((b * a.H + h) * a.Q + j) * D;
      if constexpr (NV > 0) {
        v16 acc[NV];
        for (int i = 0; i < NV; ++i) acc[i] = splat(0.0f);
        for (int64_t c = 0; c < n; ++c) {
          const float* vc = vb + (rc ? rc[c] : c) * vsl;
          const v16 w = splat(e[c]);
          for (int i = 0; i < NV; ++i) acc[i] += w * load16(vc + 16 * i);
        }
        for (int i = 0; i < NV; ++i) store16(oj + 16 * i, acc[i] * splat(inv));
      } else {
        for (int64_t d = 0; d < D; ++d) tail[d] = 0.0f;
        for (int64_t c = 0; c < n; ++c) {
          const float* vc = vb + (rc ? rc[c] : c) * vsl;
          const v16 w = splat(e[c]);
          for (int64_t d = 0; d < D16; d += 16) store16(tail.data() + d, load16(tail.data() + d) + w * load16(vc + d));
          for (int64_t d = D16; d < D; ++d) tail[d] += e[c] * vc[d];
        }
        for (int64_t d = 0; d < D; ++d) oj[d] = tail[d] * inv;
      }
    }
  }
}

// Every (row, head) pair of a call, split across threads: the head dimension in registers where it is a small multiple
// of 16 (the same code for every row).
void attend_all(const Rows& rows, int64_t pairs) {
  at::parallel_for(0, pairs, 1, [&](int64_t first, int64_t last) {
    switch (rows.D) {
      case 16: attend<1>(rows, first, last); break;
      case 32: attend<2>(rows, first, last); break;
      case 64: attend<4>(rows, first, last); break;
      case 128: attend<8>(rows, first, last); break;
      default: attend<0>(rows, first, last); break;
    }
  });
}

}  // namespace

// q [B, H, Q, D], k and v [B, G, L, D] fp32 on the CPU (the last dimension contiguous; any other strides), cols
// [B, C] int64 (row b's key columns in order, the first n_cols[b] used), n_cols and n_fed [B] int64, H % G == 0.
// Returns [B, H, Q, D] contiguous.
torch::Tensor invariant_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cols,
                                  torch::Tensor n_cols, torch::Tensor n_fed, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "invariant_attention: q, k, v must be 4-d");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "invariant_attention: fp32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "invariant_attention: CPU only");
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t G = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == G && v.size(2) == L && k.size(3) == D &&
                  v.size(3) == D && G > 0 && H % G == 0,
              "invariant_attention: q [B, H, Q, D], k and v [B, G, L, D] with H a multiple of G expected");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "invariant_attention: k and v need a contiguous last dimension");
  TORCH_CHECK(cols.dim() == 2 && cols.size(0) == B && cols.scalar_type() == torch::kLong && n_cols.numel() == B &&
                  n_fed.numel() == B && n_cols.scalar_type() == torch::kLong && n_fed.scalar_type() == torch::kLong,
              "invariant_attention: cols [B, C], n_cols [B] and n_fed [B] int64 expected");
  q = q.contiguous();
  cols = cols.contiguous();
  n_cols = n_cols.contiguous();
  n_fed = n_fed.contiguous();
  const int64_t C = cols.size(1);
  const int64_t* cp = cols.data_ptr<int64_t>();
  const int64_t* nc = n_cols.data_ptr<int64_t>();
  const int64_t* nf = n_fed.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(nf[b] >= 0 && nf[b] <= Q && nc[b] >= nf[b] && nc[b] <= C,
                "invariant_attention: row ", b, " needs 0 <= n_fed <= Q and n_fed <= n_cols <= C");
    for (int64_t c = 0; c < nc[b]; ++c)
      TORCH_CHECK(cp[b * C + c] >= 0 && cp[b * C + c] < L, "invariant_attention: row ", b, " has a column outside k");
  }
  auto out = torch::zeros({B, H, Q, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ksb = k.stride(0), ksg = k.stride(1), ksl = k.stride(2);
  const int64_t vsb = v.stride(0), vsg = v.stride(1), vsl = v.stride(2);
  const Rows rows{qp, kp, vp, op, cp, nc, nf, C, H, Q, D, ksb, ksg, ksl, vsb, vsg, vsl, H / G, static_cast<float>(scale)};
  attend_all(rows, B * H);
  return out;
}

// Attention of rows that each keep their keys and values in their own cache (the room's pass without a batch cache):
// q [B, H, Q, D] fp32 contiguous; row b's keys and values at kbase[b] and vbase[b] ([G, capacity, D] with a kv head
// every hstride[b] floats), its first n_cached[b] + n_fed[b] columns used: its cached entries, then its fed tokens'.
// The same outputs, by the same code, as invariant_attention with cols 0, 1, …, n_cols = n_cached + n_fed. The
// caller (fused_layer.cpp's RaggedPass) checks every row's shapes and room.
torch::Tensor invariant_attention_rows(const torch::Tensor& q, const float* const* kbase, const float* const* vbase,
                                       const int64_t* hstride, const int64_t* n_cached, const int64_t* n_fed, int64_t G,
                                       double scale) {
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  std::vector<int64_t> n_cols(B);
  for (int64_t b = 0; b < B; ++b) n_cols[b] = n_cached[b] + n_fed[b];
  auto out = torch::zeros({B, H, Q, D}, q.options());
  Rows rows{q.data_ptr<float>(), nullptr, nullptr, out.data_ptr<float>(), nullptr, n_cols.data(), n_fed, 0, H, Q, D,
            0, 0, D, 0, 0, D, H / G, static_cast<float>(scale)};
  rows.kbase = kbase;
  rows.vbase = vbase;
  rows.hstride = hstride;
  attend_all(rows, B * H);
  return out;
}
