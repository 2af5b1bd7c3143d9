// A Llama decoder layer of a batch-invariant decode pass in two calls (engine/decoding/compute/lean.py calls them for
// the passes inside compute.batch_invariant on the "stream" path; small_linear.cpp registers them).
//
//   qkv(x)                 RMSNorm → the fused q/k/v product → the rotary embedding on q and k
//   (Python)               the cache's update: the new keys and values after the cached ones
//   rest(x, q, k, v, …)    attention (invariant_attention.cpp) → o_proj → + x → RMSNorm → the fused gate/up
//                          product → SiLU(gate) · up → down_proj → + residual
//
// Why: after the weights are read as their GGUF blocks, the products of a 1-token pass of the embedded model take
// about 4 ms of a 14 ms pass on the AMD EPYC (2 threads); the rest is ~40 PyTorch operations and their Python per
// layer (norms, rotary, views, residuals: 2,000 small operations a pass at 2-4 µs each). Here a layer is two calls.
//
// Every number is computed per row (a token of a sequence) by the same instructions whatever the other rows: the
// norm's sum of squares in 16 lanes in dimension order, added as the fixed pairwise tree of small_linear.cpp, then
// the tail; the products by the streaming kernel (its order does not depend on the row count); SiLU with the exp
// polynomial of lanes.h (the attention's). So a row's result depends only on its own input, its own keys and values
// and the weights: the same bits alone, in a verify pass over several tokens, and in the room's shared pass
// (engine.decoding.invariance checks it on the machine). The values are within fp32 rounding of transformers'
// layer, not bit for bit its values (PyTorch's reductions and exp are not written to be reproduced);
// tests/test_fused_layer.py checks both.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "lanes.h"  // v16, lanes_sum, exp_v16, StreamWeight, stream_product

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

// invariant_attention.cpp.
torch::Tensor invariant_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cols,
                                  torch::Tensor n_cols, torch::Tensor n_fed, double scale);
torch::Tensor invariant_attention_rows(const torch::Tensor& q, const float* const* kbase, const float* const* vbase,
                                       const int64_t* hstride, const int64_t* n_cached, const int64_t* n_fed, int64_t G,
                                       double scale);

namespace {

// y = w · (x · 1/√(mean(x²) + eps)) for one row of H values (transformers' LlamaRMSNorm, its operations in its order,
// the mean's sum in this file's order).
void rms_norm(const float* x, const float* w, float eps, float* y, int64_t H) {
  const int64_t H16 = H / 16 * 16;
  v16 acc = splat(0.0f);
  for (int64_t k = 0; k < H16; k += 16) {
    const v16 v = load16(x + k);
    acc += v * v;
  }
  float ss = lanes_sum(acc);
  for (int64_t k = H16; k < H; ++k) ss += x[k] * x[k];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) y[k] = w[k] * (x[k] * r);
}

// out[i] = SiLU(g[i]) · u[i] = g / (1 + e^−g) · u, 16 lanes at a time; a tail of n % 16 goes through the same
// vector code, zero-padded, so every element is computed by the same instructions.
void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const v16 one = splat(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 gv = load16(g + i);
    store16(out + i, gv / (one + exp_v16(-gv)) * load16(u + i));
  }
  if (i < n) {
    float gt[16] = {0}, ut[16] = {0}, ot[16];
    std::memcpy(gt, g + i, (n - i) * sizeof(float));
    std::memcpy(ut, u + i, (n - i) * sizeof(float));
    const v16 gv = load16(gt);
    store16(ot, gv / (one + exp_v16(-gv)) * load16(ut));
    std::memcpy(out + i, ot, (n - i) * sizeof(float));
  }
}

// A call's intermediate floats: slot `slot` of this thread's scratch, at least n floats, not zeroed (every float a call
// uses is written before it is read). Why: value-initialized vectors cleared ~15 MB a 16-row pass of the embedded
// model (the gate/up output alone is 16 × 3,072 floats a layer) on one thread while the kernel's other thread waited.
// A slot over kScratchKeep floats (a long prefill's) is freed when the call ends (ScratchCall).
constexpr int64_t kScratchKeep = int64_t{1} << 20;

class Scratch {
 public:
  float* get(int slot, int64_t n) {
    if (n > kScratchKeep) {
      big_[slot].reset(new float[n]);
      return big_[slot].get();
    }
    auto& s = slots_[slot];
    if (s.cap < n) {
      s.data.reset(new float[n]);
      s.cap = n;
    }
    return s.data.get();
  }
  void release_big() {
    for (auto& b : big_) b.reset();
  }

 private:
  struct Slot {
    std::unique_ptr<float[]> data;
    int64_t cap = 0;
  };
  std::array<Slot, 5> slots_{};
  std::array<std::unique_ptr<float[]>, 5> big_{};
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Frees the call's oversized slots when it ends.
struct ScratchCall {
  ~ScratchCall() { scratch().release_big(); }
};

// f(r) for r in [0, n), the items split across the kernel's threads once there are more than kRowGrain item rows
// (an item of `rows_each` rows: a sequence of a pass); each item is computed by the same code on any thread, so the
// same bits. Why: the norms, rotary embedding, SiLU and residuals between a layer's products ran on one thread while
// the other waited. With the scratch above, a 16-row pass of the embedded model's 30 layers (the room's; the LM head
// apart) went from 24.9 to 24.0 ms on the AMD EPYC (medians of 50 alternating passes, in three processes). A pass of
// up to kRowGrain rows (one reader's step) stays on the calling thread.
constexpr int64_t kRowGrain = 4;

template <class F>
void each_row(int64_t n, const F& f, int64_t rows_each = 1) {
  at::parallel_for(0, n, std::max<int64_t>(1, kRowGrain / std::max<int64_t>(1, rows_each)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) f(r);
  });
}

// A weight's form as the Python side hands it: kind "fp32" [w], "f16" [w16], "q8" [q, scales], "q41" [codes,
// scales, mins]; the tensors are kept alive by the layer object.
StreamWeight stream_weight(const std::string& kind, const std::vector<torch::Tensor>& t, int64_t N, int64_t K) {
  auto check = [&](size_t count) {
    TORCH_CHECK(t.size() == count, "fused_layer: weight form ", kind, " needs ", count, " tensors");
    for (const auto& x : t) TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "fused_layer: contiguous CPU tensors");
  };
  if (kind == "fp32") {
    check(1);
    TORCH_CHECK(t[0].scalar_type() == torch::kFloat && t[0].dim() == 2 && t[0].size(0) == N && t[0].size(1) == K,
                "fused_layer: fp32 weight [", N, ", ", K, "] expected");
    return {0, t[0].data_ptr<float>(), nullptr, nullptr, N, K};
  }
  if (kind == "f16") {
    check(1);
    TORCH_CHECK(t[0].scalar_type() == torch::kHalf && t[0].size(0) == N && t[0].size(1) == K && K % 16 == 0,
                "fused_layer: f16 weight [", N, ", ", K, "] expected");
    return {1, t[0].data_ptr<at::Half>(), nullptr, nullptr, N, K};
  }
  if (kind == "q8") {
    check(2);
    TORCH_CHECK(t[0].scalar_type() == torch::kChar && t[0].size(0) == N && t[0].size(1) == K && K % 32 == 0 &&
                    t[1].scalar_type() == torch::kFloat && t[1].numel() == N * (K / 32),
                "fused_layer: q8 weight [", N, ", ", K, "] expected");
    return {2, t[0].data_ptr<int8_t>(), t[1].data_ptr<float>(), nullptr, N, K};
  }
  if (kind == "q41") {
    check(3);
    TORCH_CHECK(t[0].scalar_type() == torch::kByte && t[0].size(0) == N && t[0].size(1) * 2 == K && K % 32 == 0 &&
                    t[1].scalar_type() == torch::kFloat && t[1].numel() == N * (K / 32) &&
                    t[2].scalar_type() == torch::kFloat && t[2].numel() == N * (K / 32),
                "fused_layer: q41 weight [", N, ", ", K, "] expected");
    return {3, t[0].data_ptr<uint8_t>(), t[1].data_ptr<float>(), t[2].data_ptr<float>(), N, K};
  }
  if (kind == "q41x8" || kind == "q8x8") {  // int8_product.cpp's forms: codes, scales (, mins), meta (N, K)
    const bool q41 = kind == "q41x8";
    check(q41 ? 4 : 3);
    const auto& meta = t.back();
    TORCH_CHECK(meta.scalar_type() == torch::kLong && meta.numel() == 2 && meta[0].item<int64_t>() == N &&
                    meta[1].item<int64_t>() == K,
                "fused_layer: ", kind, " weight [", N, ", ", K, "] expected");
    StreamWeight w{q41 ? 4 : 5, t[0].data_ptr<uint8_t>(), nullptr, nullptr, N, K};
    w.s16 = reinterpret_cast<const uint16_t*>(t[1].data_ptr<int16_t>());
    w.m16 = q41 ? reinterpret_cast<const uint16_t*>(t[2].data_ptr<int16_t>()) : nullptr;
    return w;
  }
  TORCH_CHECK(false, "fused_layer: unknown weight form ", kind);
}

const float* bias_ptr(const c10::optional<torch::Tensor>& b, int64_t N) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->scalar_type() == torch::kFloat && b->is_contiguous() && b->numel() == N && b->device().is_cpu(),
              "fused_layer: bias [", N, "] contiguous fp32 expected");
  return b->data_ptr<float>();
}

// The rows of a room's pass, each in its own KV cache (no batch cache): row b's keys and values are its CachedLM's
// blocks [layers, 1, G, capacity_b, D] (proposers.py's _append_block), its first n_cached[b] entries cached; the
// pass writes its fed tokens' entries at slots n_cached[b], … of every layer and reads them back from there. Made
// once per pass; checks every row's block (fp32 CPU, contiguous, the same layers, heads and head dim, room for Q more
// entries) so the layers' calls below can address them directly. Why: stacking 16 readers' caches into one batch cache
// and handing the new entries back copied every cached entry each pass (9 ms of a 55 ms 16-reader pass, AMD EPYC).
class RaggedPass {
 public:
  RaggedPass(std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, std::vector<int64_t> n_cached,
             std::vector<int64_t> n_fed, int64_t Q)
      : keys_(std::move(keys)), values_(std::move(values)), n_cached_(std::move(n_cached)), n_fed_(std::move(n_fed)),
        Q_(Q) {
    const size_t B = keys_.size();
    TORCH_CHECK(B > 0 && values_.size() == B && n_cached_.size() == B && n_fed_.size() == B && Q > 0,
                "RaggedPass: one keys block, values block, cached length and fed count per row, Q > 0");
    const auto& k0 = keys_[0];
    TORCH_CHECK(k0.dim() == 5 && k0.size(1) == 1, "RaggedPass: blocks [layers, 1, heads, capacity, head dim]");
    layers_ = k0.size(0);
    G_ = k0.size(2);
    D_ = k0.size(4);
    for (size_t b = 0; b < B; ++b) {
      for (const auto* t : {&keys_[b], &values_[b]})
        TORCH_CHECK(t->dim() == 5 && t->scalar_type() == torch::kFloat && t->device().is_cpu() && t->is_contiguous() &&
                        t->size(0) == layers_ && t->size(1) == 1 && t->size(2) == G_ && t->size(4) == D_ &&
                        t->size(3) == keys_[b].size(3) && !t->requires_grad(),
                    "RaggedPass: row ", b, "'s blocks must be contiguous fp32 CPU [", layers_, ", 1, ", G_,
                    ", capacity, ", D_, "]");
      TORCH_CHECK(n_cached_[b] > 0 && n_fed_[b] >= 1 && n_fed_[b] <= Q && n_cached_[b] + Q <= keys_[b].size(3),
                  "RaggedPass: row ", b, " needs 0 < cached, 1 <= fed <= Q and room for Q entries");
      hstride_.push_back(keys_[b].size(3) * D_);
    }
    kbase_.resize(B);
    vbase_.resize(B);
  }
  int64_t rows() const { return static_cast<int64_t>(keys_.size()); }

  // Row b's layer-l keys and values ([G, capacity, D], hstride floats a head), for the calls of layer l.
  void point(int64_t layer) {
    TORCH_CHECK(layer >= 0 && layer < layers_, "RaggedPass: layer ", layer, " outside the blocks' ", layers_);
    for (size_t b = 0; b < keys_.size(); ++b) {
      kbase_[b] = keys_[b].data_ptr<float>() + layer * keys_[b].stride(0);
      vbase_[b] = values_[b].data_ptr<float>() + layer * values_[b].stride(0);
    }
  }

  std::vector<torch::Tensor> keys_, values_;
  std::vector<int64_t> n_cached_, n_fed_, hstride_;
  std::vector<float*> kbase_, vbase_;
  int64_t Q_, layers_ = 0, G_ = 0, D_ = 0;
};

class FusedLayer {
 public:
  // in_norm, post_norm: [H] fp32; each product's weight form (see stream_weight) and bias or None: qkv [(hq + 2 hk)
  // · D, H], o [H, hq · D], gate_up [2 I, H], down [H, I]. The tensors are held (and must not change).
  FusedLayer(torch::Tensor in_norm, double in_eps, std::string qkv_kind, std::vector<torch::Tensor> qkv,
             c10::optional<torch::Tensor> qkv_bias, std::string o_kind, std::vector<torch::Tensor> o,
             c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm, double post_eps, std::string gu_kind,
             std::vector<torch::Tensor> gu, c10::optional<torch::Tensor> gu_bias, std::string down_kind,
             std::vector<torch::Tensor> down, c10::optional<torch::Tensor> down_bias, int64_t hq, int64_t hk,
             int64_t head_dim, int64_t inter)
      : in_norm_(in_norm.contiguous()), post_norm_(post_norm.contiguous()), in_eps_(in_eps), post_eps_(post_eps),
        hq_(hq), hk_(hk), D_(head_dim), I_(inter), H_(in_norm.numel()) {
    TORCH_CHECK(in_norm_.scalar_type() == torch::kFloat && post_norm_.scalar_type() == torch::kFloat &&
                    post_norm_.numel() == H_ && hq > 0 && hk > 0 && hq % hk == 0 && head_dim % 2 == 0 && inter > 0,
                "fused_layer: fp32 norms of one size, query heads a multiple of kv heads, an even head dim");
    held_ = {in_norm_, post_norm_};
    for (auto* list : {&qkv, &o, &gu, &down})
      for (auto& t : *list) held_.push_back(t);
    for (auto* b : {&qkv_bias, &o_bias, &gu_bias, &down_bias})
      if (b->has_value() && (*b)->defined()) held_.push_back(**b);
    qkv_ = stream_weight(qkv_kind, qkv, (hq + 2 * hk) * head_dim, H_);
    o_ = stream_weight(o_kind, o, H_, hq * head_dim);
    gu_ = stream_weight(gu_kind, gu, 2 * inter, H_);
    down_ = stream_weight(down_kind, down, H_, inter);
    qkv_b_ = bias_ptr(qkv_bias, qkv_.N);
    o_b_ = bias_ptr(o_bias, o_.N);
    gu_b_ = bias_ptr(gu_bias, gu_.N);
    down_b_ = bias_ptr(down_bias, down_.N);
  }

  // x [B, Q, H] fp32; cos, sin [1 or B, Q, D]. Returns q [B, hq, Q, D], k and v [B, hk, Q, D] (rotary on q and k).
  std::vector<torch::Tensor> qkv(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) const {
    return qkv_into(x, cos, sin, torch::Tensor(), torch::Tensor(), 0);
  }

  // qkv, writing k and v straight into a KV cache's preallocated block when the cache's entries are its first n
  // slots: kb and vb [B, hk, capacity, D] (the block), keys and values [B, hk, n, D] (the cache's views of it).
  // Returns (q, keys, values, true) with the views now n + Q long when it could (the caller makes them the cache's),
  // else (q, k, v, false) with the new entries for the cache's own update.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, bool> qkv_append(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kb,
                                        torch::Tensor vb, torch::Tensor keys, torch::Tensor values) const {
    const int64_t B = x.dim() == 3 ? x.size(0) : -1, Q = x.dim() == 3 ? x.size(1) : -1;
    bool fits = kb.defined() && vb.defined() && keys.defined() && values.defined();
    for (const auto* pair : {&kb, &vb}) fits = fits && pair->dim() == 4;
    if (fits) {
      const int64_t n = keys.dim() == 4 ? keys.size(2) : -1;
      for (int i = 0; i < 2 && fits; ++i) {
        const torch::Tensor& blk = i ? vb : kb;
        const torch::Tensor& view = i ? values : keys;
        fits = blk.scalar_type() == torch::kFloat && view.dim() == 4 && view.size(2) == n &&
               blk.size(0) == B && blk.size(1) == hk_ && blk.size(3) == D_ && n + Q <= blk.size(2) &&
               blk.stride(3) == 1 && view.data_ptr() == blk.data_ptr() && view.strides() == blk.strides() &&
               view.size(0) == B && view.size(1) == hk_ && view.size(3) == D_ && !blk.requires_grad();
      }
      if (fits) {
        auto out = qkv_into(x, cos, sin, kb, vb, n);
        return {out[0], kb.narrow(2, 0, n + Q), vb.narrow(2, 0, n + Q), true};
      }
    }
    auto out = qkv(x, cos, sin);
    return {out[0], out[1], out[2], false};
  }

  // qkv's work; with kb and vb defined, k and v go to slots [n, n + Q) of them and are not returned; with a RaggedPass
  // (pointed at this layer), row b's go to slots [n_cached[b], n_cached[b] + Q) of its own block, not returned either.
  std::vector<torch::Tensor> qkv_into(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kb,
                                      torch::Tensor vb, int64_t n, const RaggedPass* rows_pass = nullptr) const {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == H_ && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
                "fused_layer.qkv: x [B, Q, H] fp32 on the CPU expected");
    x = x.contiguous();
    const int64_t B = x.size(0), Q = x.size(1), M = B * Q, D = D_, half = D / 2;
    TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && (cos.size(0) == 1 || cos.size(0) == B) &&
                    cos.size(1) == Q && cos.size(2) == D && cos.scalar_type() == torch::kFloat,
                "fused_layer.qkv: cos and sin [1 or B, Q, D] fp32 expected");
    cos = cos.contiguous();
    sin = sin.contiguous();
    ScratchCall call;
    float* xn = scratch().get(0, M * H_);
    float* y = scratch().get(1, M * qkv_.N);
    const float* xp = x.data_ptr<float>();
    const float* wn = in_norm_.data_ptr<float>();
    each_row(M, [&](int64_t m) { rms_norm(xp + m * H_, wn, static_cast<float>(in_eps_), xn + m * H_, H_); });
    stream_product(xn, qkv_, qkv_b_, y, M);
    auto q = torch::empty({B, hq_, Q, D}, x.options());
    const bool into = kb.defined();
    const bool ragged = rows_pass != nullptr;
    auto k = into ? kb : (ragged ? torch::Tensor() : torch::empty({B, hk_, Q, D}, x.options()));
    auto v = into ? vb : (ragged ? torch::Tensor() : torch::empty({B, hk_, Q, D}, x.options()));
    // element (b, h, j, d) of the new entries: at slot n + j of a block, at slot n_cached[b] + j of row b's own block
    // (a RaggedPass), else at j of a [B, hk, Q, D] tensor
    const int64_t ksb = ragged ? 0 : k.stride(0), ksh = ragged ? 0 : k.stride(1), ksj = ragged ? D : k.stride(2);
    const int64_t kj0 = into ? n : 0;
    const int64_t vsb = ragged ? 0 : v.stride(0), vsh = ragged ? 0 : v.stride(1), vsj = ragged ? D : v.stride(2);
    float* qp = q.data_ptr<float>();
    float* const k0 = ragged ? nullptr : k.data_ptr<float>();
    float* const v0 = ragged ? nullptr : v.data_ptr<float>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t row = qkv_.N;
    each_row(B, [&](int64_t b) {
      // row b's own block under a RaggedPass: its layer's keys and values, a head every hstride floats, after its cache
      float* const kp = ragged ? rows_pass->kbase_[b] : k0;
      float* const vp = ragged ? rows_pass->vbase_[b] : v0;
      const int64_t kh = ragged ? rows_pass->hstride_[b] : ksh, vh = ragged ? rows_pass->hstride_[b] : vsh;
      const int64_t j0 = ragged ? rows_pass->n_cached_[b] : kj0;
      for (int64_t j = 0; j < Q; ++j) {
        const float* src = y + (b * Q + j) * row;
        const int64_t pe = ((cos.size(0) == 1 ? 0 : b) * Q + j) * D;
        const float *c = cp + pe, *s = sp + pe;
        for (int64_t h = 0; h < hq_ + hk_; ++h) {  // transformers' apply_rotary_pos_emb: x·cos + rotate_half(x)·sin
          const float* in = src + h * D;
          float* out = h < hq_ ? qp + ((b * hq_ + h) * Q + j) * D : kp + b * ksb + (h - hq_) * kh + (j0 + j) * ksj;
          for (int64_t d = 0; d < half; ++d) out[d] = in[d] * c[d] + (-in[d + half]) * s[d];
          for (int64_t d = half; d < D; ++d) out[d] = in[d] * c[d] + in[d - half] * s[d];
        }
        const float* vin = src + (hq_ + hk_) * D;
        for (int64_t h = 0; h < hk_; ++h)
          std::memcpy(vp + b * vsb + h * vh + (j0 + j) * vsj, vin + h * D, D * sizeof(float));
      }
    }, Q);
    if (into || ragged) return {q};
    return {q, k, v};
  }

  // qkv for the rows of a RaggedPass at layer `layer`: x [B, Q, H], cos and sin [B, Q, D] (each row's positions).
  // Writes every row's new keys and values into its own block after its cached entries; returns q [B, hq, Q, D].
  torch::Tensor qkv_rows(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, RaggedPass& pass, int64_t layer) {
    TORCH_CHECK(x.dim() == 3 && x.size(0) == pass.rows() && x.size(1) == pass.Q_ && pass.G_ == hk_ && pass.D_ == D_,
                "fused_layer.qkv_rows: x [rows, Q, H] and blocks with this layer's kv heads and head dim expected");
    pass.point(layer);
    return qkv_into(x, cos, sin, torch::Tensor(), torch::Tensor(), 0, &pass)[0];
  }

  // rest for the rows of a RaggedPass (after qkv_rows at the same layer): attention over each row's own block, then
  // the same o_proj, norm, MLP and residuals as rest. Returns the layer's output [B, Q, H].
  torch::Tensor rest_rows(torch::Tensor x, torch::Tensor q, RaggedPass& pass, int64_t layer, double scale) const {
    TORCH_CHECK(q.dim() == 4 && q.size(0) == pass.rows() && q.size(1) == hq_ && q.size(2) == pass.Q_ &&
                    q.size(3) == D_ && q.scalar_type() == torch::kFloat && pass.G_ == hk_,
                "fused_layer.rest_rows: q [rows, hq, Q, D] expected");
    pass.point(layer);
    q = q.contiguous();
    auto att = invariant_attention_rows(q, pass.kbase_.data(), pass.vbase_.data(), pass.hstride_.data(),
                                        pass.n_cached_.data(), pass.n_fed_.data(), hk_, scale);
    return after_attention(x, att);
  }

  // x [B, Q, H] (the layer's input: the residual), q [B, hq, Q, D], k and v [B, hk, L, D] (the cache after its
  // update), cols, n_cols, n_fed: invariant_attention's spans. Returns the layer's output [B, Q, H].
  torch::Tensor rest(torch::Tensor x, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cols,
                     torch::Tensor n_cols, torch::Tensor n_fed, double scale) const {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == H_ && x.scalar_type() == torch::kFloat,
                "fused_layer.rest: x [B, Q, H] fp32 expected");
    x = x.contiguous();
    const int64_t B = x.size(0), Q = x.size(1);
    TORCH_CHECK(q.dim() == 4 && q.size(0) == B && q.size(1) == hq_ && q.size(2) == Q && q.size(3) == D_,
                "fused_layer.rest: q [B, hq, Q, D] expected");
    return after_attention(x, invariant_attention(q, k, v, cols, n_cols, n_fed, scale));
  }

  // Everything after the attention ([B, hq, Q, D] contiguous): o_proj, + x, RMSNorm, gate/up, SiLU · up, down_proj,
  // + residual. Returns [B, Q, H].
  torch::Tensor after_attention(torch::Tensor x, const torch::Tensor& att) const {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == H_ && x.scalar_type() == torch::kFloat,
                "fused_layer: x [B, Q, H] fp32 expected");
    x = x.contiguous();
    const int64_t B = x.size(0), Q = x.size(1), M = B * Q, D = D_;
    const float* ap = att.data_ptr<float>();
    const int64_t A = hq_ * D;
    ScratchCall call;
    float *a = scratch().get(0, M * A), *h1 = scratch().get(1, M * H_), *hn = scratch().get(2, M * H_),
          *gu = scratch().get(3, M * gu_.N), *act = scratch().get(4, M * I_);
    for (int64_t b = 0; b < B; ++b)  // [B, hq, Q, D] → [B · Q, hq · D]
      for (int64_t h = 0; h < hq_; ++h)
        for (int64_t j = 0; j < Q; ++j)
          std::memcpy(a + (b * Q + j) * A + h * D, ap + ((b * hq_ + h) * Q + j) * D, D * sizeof(float));
    stream_product(a, o_, o_b_, h1, M);
    const float* xp = x.data_ptr<float>();
    const float* wn = post_norm_.data_ptr<float>();
    each_row(M, [&](int64_t m) {
      float* r = h1 + m * H_;
      const float* xr = xp + m * H_;
      for (int64_t i = 0; i < H_; ++i) r[i] = xr[i] + r[i];  // residual + o_proj(attention)
      rms_norm(r, wn, static_cast<float>(post_eps_), hn + m * H_, H_);
    });
    stream_product(hn, gu_, gu_b_, gu, M);
    each_row(M, [&](int64_t m) { silu_mul(gu + m * gu_.N, gu + m * gu_.N + I_, act + m * I_, I_); });
    auto out = torch::empty({B, Q, H_}, x.options());
    float* op = out.data_ptr<float>();
    stream_product(act, down_, down_b_, op, M);
    each_row(M, [&](int64_t m) {
      for (int64_t i = m * H_; i < (m + 1) * H_; ++i) op[i] = h1[i] + op[i];  // residual + down_proj(…)
    });
    return out;
  }

 private:
  torch::Tensor in_norm_, post_norm_;
  std::vector<torch::Tensor> held_;
  double in_eps_, post_eps_;
  int64_t hq_, hk_, D_, I_, H_;
  StreamWeight qkv_{}, o_{}, gu_{}, down_{};
  const float *qkv_b_ = nullptr, *o_b_ = nullptr, *gu_b_ = nullptr, *down_b_ = nullptr;
};

}  // namespace

void register_fused_layer(pybind11::module_& m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;  // as small_linear.cpp's entries
  pybind11::class_<RaggedPass>(m, "RaggedPass")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                          std::vector<int64_t>, int64_t>(),
           "a pass over rows each in its own KV cache block: (keys blocks, values blocks, cached lengths, fed counts, Q)");
  pybind11::class_<FusedLayer>(m, "FusedLayer")
      .def(pybind11::init<torch::Tensor, double, std::string, std::vector<torch::Tensor>, c10::optional<torch::Tensor>,
                          std::string, std::vector<torch::Tensor>, c10::optional<torch::Tensor>, torch::Tensor, double,
                          std::string, std::vector<torch::Tensor>, c10::optional<torch::Tensor>, std::string,
                          std::vector<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t,
                          int64_t>())
      .def("qkv", &FusedLayer::qkv, nogil(), "RMSNorm, the fused q/k/v product and the rotary embedding: [q, k, v]")
      .def("qkv_append", &FusedLayer::qkv_append, nogil(),
           "qkv writing k and v into a cache block in place: (q, keys, values, True), else (q, k, v, False)")
      .def("rest", &FusedLayer::rest, nogil(), "attention, o_proj, residual, RMSNorm, gate/up, SiLU · up, down_proj, residual")
      .def("qkv_rows", &FusedLayer::qkv_rows, nogil(),
           "qkv for a RaggedPass's rows at a layer: their new keys and values into their own blocks; returns q")
      .def("rest_rows", &FusedLayer::rest_rows, nogil(), "rest for a RaggedPass's rows at a layer");
}
