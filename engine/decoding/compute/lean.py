"""Lean decoder layers: on the fast paths transformers' Llama decoder layers switch to a subclass whose forward is one
Python function with the same operations in the same order (``_lean_forward``), so the same bits with less Python.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.decoding.compute import extension, invariant, products
from engine.decoding.compute.formats import COMPACT_ATTR
from engine.decoding.compute.fusion import FusedLeadLinear
from engine.decoding.compute.invariant import invariant_attention
from engine.decoding.compute.products import _product

_LEAN_CLASSES: dict[type, type] = {}
"""Original decoder-layer class → its lean subclass (``_lean_class``)."""
_LEAN_CLASSES_INV: dict[type, type] = {}
"""Lean subclass → its original decoder-layer class (``_lean_layers`` switches back with it)."""


_GQA_IN_SDPA = True
"""Masked multi-token passes give SDPA the grouped k/v heads (``enable_gqa``) instead of transformers' copies
(``_lean_forward``); False runs transformers' attention function there (for A/B measurements)."""


def _lean_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                  use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    """transformers' ``LlamaDecoderLayer.forward`` (5.x) with the same tensor operations in the same order, so
    its output is bit for bit the same, but called as one Python function: the fused q/k/v and gate/up products
    (``_fuse_siblings``) are computed here, the norms are computed inline (``_rms_norm``) and q and k get the
    rotary embedding together (one set of element-wise operations on [B, Hq + Hk, Q, D] instead of two),
    instead of through nine submodule calls per layer with their hooks, keyword plumbing and deprecation
    wrappers.

    Why: on the AMD EPYC (2 threads, the embedded target, a 1-token pass after ~50 cached tokens with every
    matrix product replaced by a stub returning zeros), the passes cost 16–17 ms of Python and small operators
    with transformers' layers and 7.7–8.8 ms with these; whole decoding is compared in
    ``benchmarks/bench_compute.py`` (rows "engine, transformers' layers"). The inline norms and the joint
    rotary embedding took another 1.2 ms off that stubbed pass (5.9 → 4.8 ms) and 1.2–1.5 ms off a real 1- or
    3-token pass (22.5 → 21.1 and 24.4 → 22.8 ms, best of 10, median of 12 alternating reps; AMD EPYC,
    2026-12-02). Masked passes over several tokens (a chain's verify pass, a token tree, a padded batch) give SDPA
    the grouped k/v heads (``enable_gqa``) where transformers copies them per query head (``repeat_kv``): same
    bits; A/B in one process (12 alternating reps, medians), a 3-token pass 25.6 → 23.3 ms after 100 cached tokens
    and 30.4 → 25.8 ms after 250, a 9-node tree pass 33.6 → 28.3 ms after 250 (unchanged after 100). Falls back to
    the original forward whenever autograd is on (training), in training mode, when
    attention weights are asked for, when a layer is not fused, or when its norms are not transformers'
    ``LlamaRMSNorm``.

    Args and returns: those of ``LlamaDecoderLayer.forward``: hidden_states [B, Q, H] → [B, Q, H].
    """
    original = _LEAN_CLASSES_INV[type(self)]
    attn, mlp = self.self_attn, self.mlp
    if (self.training or torch.is_grad_enabled() or position_embeddings is None or kwargs.get("output_attentions")
            or type(attn.q_proj) is not FusedLeadLinear or type(mlp.gate_proj) is not FusedLeadLinear
            or type(self.input_layernorm).forward is not _RMS_FORWARD()
            or type(self.post_attention_layernorm).forward is not _RMS_FORWARD()
            or any(size % attn.head_dim for size in attn.q_proj._fused_sizes)):
        return original.forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    if cache is not None and getattr(invariant._INVARIANT, "on", False) and hidden_states.device.type == "cpu":
        fused = _fused_layer(self)
        if fused is not None:  # a batch-invariant decode pass: the layer in two calls (fused_layer.cpp)
            cos, sin = position_embeddings
            q, k, v = fused.qkv(hidden_states, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx, kwargs={"position_ids": position_ids, "use_cache": use_cache,
                                                             **kwargs})
            spans = invariant.pass_spans(invariant._INVARIANT.rows, k.shape[2], q.shape[2],
                                         invariant._INVARIANT.new_at, q.device)
            return fused.rest(hidden_states, q, k, v, *spans, attn.scaling)
    from transformers.models.llama import modeling_llama as ml

    residual = hidden_states
    x = _rms_norm(self.input_layernorm, hidden_states)
    lead = attn.q_proj
    head_dim = attn.head_dim
    qkv = _product(x, lead._fused_weight, lead._fused_bias)
    input_shape = qkv.shape[:-1]
    heads = [size // head_dim for size in lead._fused_sizes]
    # q and k side by side ([B, Hq + Hk, Q, D]) get the rotary embedding in one set of operations: the same
    # element-wise operations as transformers' apply_rotary_pos_emb, so the same bits
    qkv = qkv.view(*input_shape, -1, head_dim).transpose(1, 2)
    qk, v = qkv[:, :heads[0] + heads[1]], qkv[:, heads[0] + heads[1]:]
    cos, sin = position_embeddings
    qk = (qk * cos.unsqueeze(1)) + (ml.rotate_half(qk) * sin.unsqueeze(1))
    q, k = qk[:, :heads[0]], qk[:, heads[0]:]
    kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what the attention module gets
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    if cache is not None and getattr(invariant._INVARIANT, "on", False) and q.device.type == "cpu":
        # a decode pass in the batch-invariant layout (``batch_invariant``): the mask is built from the rows' spans
        out = invariant_attention(q, k, v, attn.scaling, invariant._INVARIANT.rows,
                                  invariant._INVARIANT.new_at).transpose(1, 2)
    elif (_GQA_IN_SDPA and attention_mask is not None and q.shape[2] > 1 and attn.config._attn_implementation == "sdpa"
            and getattr(attn, "num_key_value_groups", 1) > 1 and q.device.type == "cpu"):
        # a masked pass over several tokens (a verify pass, a tree, a padded batch): SDPA reads the grouped k and v
        # heads itself (enable_gqa) instead of transformers' repeat_kv copying them per query head, 2 copies per
        # layer of the whole cache; the same kernel and arithmetic, so the same bits (tested against transformers'
        # layers)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, scale=attn.scaling,
                                             is_causal=False, enable_gqa=True).transpose(1, 2)
    else:
        attention = ml.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                             ml.eager_attention_forward)
        out, _ = attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    o = attn.o_proj
    hidden_states = residual + _product(out, o.weight, o.bias)
    residual = hidden_states
    x = _rms_norm(self.post_attention_layernorm, hidden_states)
    lead = mlp.gate_proj
    gate, up = _product(x, lead._fused_weight, lead._fused_bias).split(lead._fused_sizes, dim=-1)
    down = mlp.down_proj
    return residual + _product(mlp.act_fn(gate) * up, down.weight, down.bias)


FUSED_ATTR = "_fused_layer"
"""The attribute of a lean layer holding its ``FusedLayer`` (``_fused_layer``) and the weights' state it was made from."""


def _form(weight: torch.Tensor) -> tuple[str, list[torch.Tensor]]:
    """How the streaming kernel reads ``weight``: its exact compact form when it has a fresh one
    (``formats.compact_weight``), else its fp32 values."""
    c = weight.__dict__.get(COMPACT_ATTR)
    if c is not None and c.ptr == weight.data_ptr() and c.version == weight._version:
        return c.kind, list(c.tensors)
    return "fp32", [weight.detach()]


def _fused_layer(layer: nn.Module):
    """The layer's ``FusedLayer`` (``fused_layer.cpp``: a batch-invariant decode pass's layer in two calls), made once
    and again whenever a weight or its compact form changed; None where the layer cannot take it: no kernel here, a
    path other than "stream", weights that are not fp32 on the CPU, an activation other than
    SiLU, a rotary embedding on part of the head, or norms other than transformers' RMSNorm (checked by the caller).

    Why: a decode pass of the embedded model ran ~40 PyTorch operations per layer beside its products (norms,
    rotary, views, residuals), about 9 ms of a 14 ms pass on the AMD EPYC once the weights were read as their GGUF
    blocks. The fused layer computes each row by the same instructions whatever rows share the pass, so the
    batch-invariant promise holds by construction; its values are within fp32 rounding of ``_lean_forward``'s
    (tests/test_fused_layer.py)."""
    make = extension._STREAM.get("fused_layer")
    if make is None or products._ACTIVE["path"] != "stream":
        return None
    attn, mlp = layer.self_attn, layer.mlp
    lead, gate = attn.q_proj, mlp.gate_proj
    weights = _layer_weights(layer)
    key = tuple((w.data_ptr(), _version(w), id(w.__dict__.get(COMPACT_ATTR))) for w in weights)
    held = layer.__dict__.get(FUSED_ATTR)
    if held is not None and held[0] == key:
        return held[1]
    fused = None
    head_dim = attn.head_dim
    sizes = lead._fused_sizes
    if (len(sizes) == 3 and sizes[1] == sizes[2] and len(gate._fused_sizes) == 2
            and gate._fused_sizes[0] == gate._fused_sizes[1] and isinstance(mlp.act_fn, _SILU())
            and all(w.dtype == torch.float32 and w.device.type == "cpu"
                    and (w.is_contiguous() or _form(w)[0] != "fp32") for w in weights)
            and layer.input_layernorm.weight.shape == layer.post_attention_layernorm.weight.shape
            and getattr(attn.config, "partial_rotary_factor", 1.0) in (None, 1.0)):
        def bias(b):
            return None if b is None else b.detach().contiguous()
        args = []
        for w, b in ((lead._fused_weight, lead._fused_bias), (attn.o_proj.weight, attn.o_proj.bias)):
            args += [*_form(w), bias(b)]
        fused = make(layer.input_layernorm.weight.detach(), float(layer.input_layernorm.variance_epsilon),
                     *args, layer.post_attention_layernorm.weight.detach(),
                     float(layer.post_attention_layernorm.variance_epsilon),
                     *_form(gate._fused_weight), bias(gate._fused_bias),
                     *_form(mlp.down_proj.weight), bias(mlp.down_proj.bias),
                     sizes[0] // head_dim, sizes[1] // head_dim, head_dim, gate._fused_sizes[0])
    layer.__dict__[FUSED_ATTR] = (key, fused)
    return fused


@functools.lru_cache(maxsize=1)
def _SILU():  # noqa: N802 - a constant looked up once
    """The activation classes the fused layer computes as SiLU (transformers' ``SiLUActivation`` and torch's)."""
    from transformers.activations import SiLUActivation

    return (SiLUActivation, nn.SiLU)


@functools.lru_cache(maxsize=1)
def _RMS_FORWARD():  # noqa: N802 - a constant looked up once
    """transformers' ``LlamaRMSNorm.forward``: the norm ``_rms_norm`` computes inline."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` (5.x): the same operations in the same order, so the same bits,
    called without the module call (``norm`` is a ``LlamaRMSNorm``; x [..., H] → [..., H]). The casts are skipped
    where they are no-ops (fp32 in and out)."""
    dtype = x.dtype
    h = x if dtype == torch.float32 else x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * (h if dtype == torch.float32 else h.to(dtype))


def _lean_class(cls: type) -> type:
    if cls not in _LEAN_CLASSES:
        lean = type("Lean" + cls.__name__, (cls,), {"forward": _lean_forward, "__doc__": _lean_forward.__doc__})
        _LEAN_CLASSES[cls] = lean
        _LEAN_CLASSES_INV[lean] = cls
    return _LEAN_CLASSES[cls]


def _lean_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                        use_cache=None, **kwargs):
    """transformers' ``LlamaModel.forward`` (5.x), except for a batch-invariant decode pass whose every layer takes the
    fused layer: there ``fused_decode`` runs it (no output wrappers, no causal mask, no module calls).

    Args and returns: those of ``LlamaModel.forward``."""
    if (cache is not None and not kwargs and (input_ids is None) != (inputs_embeds is None)
            and not self.config.output_hidden_states and not self.config.output_attentions):
        x = fused_decode(self, input_ids if inputs_embeds is None else None, inputs_embeds, position_ids, cache)
        if x is not None:
            from transformers.modeling_outputs import BaseModelOutputWithPast

            return BaseModelOutputWithPast(last_hidden_state=x, cache=cache)
    return _LEAN_MODELS_INV[type(self)].forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                                position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                                use_cache=use_cache, **kwargs)


def fused_decode(model: nn.Module, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                 position_ids: torch.Tensor | None, cache) -> torch.Tensor | None:
    """A batch-invariant decode pass of a Llama ``model`` (a ``LlamaModel``: the target's decoder, or a draft head's
    body) run directly: the token embedding (unless ``inputs_embeds`` are given), the rotary embedding, each layer's
    two fused calls around the cache's update and the final norm. The same calls as the layers' own ``_lean_forward``
    makes, so the same bits (tests/test_fused_layer.py); the attention reads each row's keys from the pass's spans
    (``invariant.pass_spans``), so no causal mask is built.

    Why: with the layers fused, what was left of a 1-token pass of the embedded model beside its products was mostly
    the Python of ``LlamaModel.forward`` and thirty module calls: ~1.5 ms of a 9 ms pass on the AMD EPYC.

    Args:
        input_ids: [B, Q] or None; inputs_embeds: [B, Q, H] or None (one of them). position_ids: [B or 1, Q], or None
            (continue after the cache). cache: the pass's transformers cache, updated in place.

    Returns:
        [B, Q, H] the last hidden states after the final norm; None where this does not apply (not a batch-invariant
        pass, autograd or training, ``DIRECT_MODEL`` off, a layer without its fused form): the caller runs the
        model's own forward.
    """
    if not (DIRECT_MODEL and cache is not None and getattr(invariant._INVARIANT, "on", False) and not model.training
            and not torch.is_grad_enabled() and type(model) in _LEAN_MODELS_INV):
        return None
    fused = _model_stack(model)
    if fused is None:
        return None
    x = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        position_ids = (torch.arange(x.shape[1], device=x.device) + cache.get_seq_length()).unsqueeze(0)
    cos, sin = model.rotary_emb(x, position_ids=position_ids)
    state = invariant._INVARIANT
    cached = cache.layers if len(getattr(cache, "layers", ())) == len(fused) else None
    for f, idx, scaling in fused:
        la = cached[idx] if cached is not None else None
        blk = getattr(la, "block", None)
        if blk is not None and getattr(la, "IN_PLACE", False) and la.keys is not None:
            # the cache's layer keeps its entries in a preallocated block (``CachedLM``'s ``BlockLayer``): the new
            # keys and values are written into it, no copy
            q, k, v, appended = f.qkv_append(x, cos, sin, blk[0], blk[1], la.keys, la.values)
            if appended:
                la.keys, la.values = k, v
            else:
                k, v = cache.update(k, v, idx)
        else:
            q, k, v = f.qkv(x, cos, sin)
            k, v = cache.update(k, v, idx)
        x = f.rest(x, q, k, v, *invariant.pass_spans(state.rows, k.shape[2], q.shape[2], state.new_at, q.device),
                   scaling)
    return _rms_norm(model.norm, x)


def fused_decode_rows(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      blocks: list[tuple[torch.Tensor, torch.Tensor]], n_cached: list[int],
                      n_fed: list[int]) -> torch.Tensor | None:
    """A batch-invariant decode pass over rows that each keep their KV cache in their own block (a ``CachedLM``'s,
    ``CachedLM.block_with_room``): no batch cache is built. Each layer writes row b's new keys and values into its
    block after its ``n_cached[b]`` entries and attends over that block (``fused_layer.cpp``'s ``RaggedPass``); every
    row gets the bits of its lone pass, as in ``fused_decode`` (the same calls on the same values, the keys read in
    the same order; tests/test_fused_layer.py).

    Why: the room's shared pass stacked every reader's cache into one batch cache and handed the new entries back,
    copying each cached entry every pass: 9 ms of a 55 ms pass of 16 readers on the AMD EPYC.

    Args:
        input_ids: [B, Q] the fed tokens, right-padded (a padded position's entries land past the row's own, its
            output is garbage and not read). position_ids: [B, Q] each token's position (n_cached[b] + j).
        blocks: each row's (keys, values) blocks [layers, 1, kv heads, capacity, head dim], with capacity ≥
            n_cached[b] + Q. n_cached: each row's cached entries (> 0); n_fed: its fed tokens (1..Q).

    Returns:
        [B, Q, H] the last hidden states after the final norm; None where this does not apply (no kernel, not the
        "stream" path, a layer without its fused form, autograd or training).

    Raises:
        RuntimeError: from the kernel, for blocks of the wrong shape or without room (nothing read or written then).
    """
    make = extension._STREAM.get("ragged_pass")
    if (make is None or not DIRECT_MODEL or model.training or torch.is_grad_enabled()
            or type(model) not in _LEAN_MODELS_INV or input_ids.device.type != "cpu"):
        return None
    fused = _model_stack(model)
    if fused is None:
        return None
    pas = make([k for k, _ in blocks], [v for _, v in blocks], list(n_cached), list(n_fed), int(input_ids.shape[1]))
    x = model.embed_tokens(input_ids)
    cos, sin = model.rotary_emb(x, position_ids=position_ids)
    for f, idx, scaling in fused:
        q = f.qkv_rows(x, cos, sin, pas, idx)
        x = f.rest_rows(x, q, pas, idx, scaling)
    return _rms_norm(model.norm, x)


def fused_visible_pass(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
                       new_vis: torch.Tensor) -> torch.Tensor | None:
    """A pass of one sequence whose fed tokens see the whole cache and the fed tokens ``new_vis`` allows (a token
    tree: each node its context, its ancestors and itself), run through the fused layers: each fed token is computed
    as a row of its own whose attention reads exactly its visible keys in cache order (``fused_layer.cpp``'s ``rest``
    with one key list per row, ``invariant_attention``). A node therefore gets the bits a chain pass over the context
    and its path gives it: the same keys and values, read in the same order, by the same code.

    Why: a tree's verify pass ran the model with a 4D mask, through the unfused layers: over 2 tokens it cost 17.9 ms
    where a chain's fused pass cost 11.1 ms (AMD EPYC, ``benchmarks/bench_tree.py``), so trees lost to chains.

    Args:
        input_ids: [1, Q] the fed tokens. position_ids: [1, Q] their positions. cache: the sequence's transformers
            cache (its entries are visible to every fed token; the fed tokens' entries are appended in feed order).
        new_vis: [Q, Q] bool, new_vis[i, j]: fed token i sees fed token j (the diagonal set).

    Returns:
        [1, Q, H] the last hidden states after the final norm; None where this does not apply (no kernel, not the
        "stream" path, a layer without its fused form, autograd or training, more than one sequence, not the CPU).
    """
    if (not DIRECT_MODEL or model.training or torch.is_grad_enabled() or type(model) not in _LEAN_MODELS_INV
            or input_ids.device.type != "cpu" or input_ids.dim() != 2 or input_ids.shape[0] != 1):
        return None
    fused = _model_stack(model)
    if fused is None:
        return None
    q_len = int(input_ids.shape[1])
    vis = new_vis.to(torch.bool).cpu()
    if vis.shape != (q_len, q_len) or not bool(vis.diagonal().all()):
        return None
    cached = int(cache.get_seq_length())
    counts = vis.sum(1)
    cols = torch.zeros(q_len, cached + int(counts.max()), dtype=torch.long)
    cols[:, :cached] = torch.arange(cached)
    for i in range(q_len):  # row i's keys: the whole cache, then the fed tokens it sees, in cache order
        seen = torch.nonzero(vis[i]).flatten() + cached
        cols[i, cached:cached + len(seen)] = seen
    n_cols, n_fed = counts + cached, torch.ones(q_len, dtype=torch.long)
    x = model.embed_tokens(input_ids)
    cos, sin = model.rotary_emb(x, position_ids=position_ids)
    for f, idx, scaling in fused:
        q, k, v = f.qkv(x, cos, sin)
        k, v = cache.update(k, v, idx)
        # each fed token a row of one query over the same cache (a batch stride of 0)
        x = f.rest(x.reshape(q_len, 1, -1), q.transpose(0, 2), k.expand(q_len, -1, -1, -1),
                   v.expand(q_len, -1, -1, -1), cols, n_cols, n_fed, scaling).reshape(1, q_len, -1)
    return _rms_norm(model.norm, x)


def _model_stack(model: nn.Module) -> list | None:
    """``_fused_stack`` of the model's decoder layers (its first ``num_hidden_layers``: a slice is a new
    ModuleList)."""
    n = model.config.num_hidden_layers
    return _fused_stack(model, model.layers if len(model.layers) == n else model.layers[:n])


def _fused_stack(model: nn.Module, layers) -> list | None:
    """Every layer's (``FusedLayer``, cache index, attention scale) when all of them have one, the layers are lean and
    the model's norm is transformers' RMSNorm on the CPU in fp32; else None (the model's own forward runs). Kept on the model with the
    weights it was made from (each one's storage, version counter and compact form) and checked against them each
    pass: 180 cheap checks instead of looking every layer's modules up again (1.6 ms a pass of the embedded model)."""
    make, path = extension._STREAM.get("fused_layer"), products._ACTIVE["path"]
    held = model.__dict__.get(FUSED_ATTR)
    if held is not None and held[0] is make and held[1] == path and (held[3] is None or len(held[3]) == len(layers)) and all(
            w.data_ptr() == p and _version(w) == v and w.__dict__.get(COMPACT_ATTR) is c for w, p, v, c in held[2]):
        return held[3]
    out, checks = None, []
    if type(model.norm).forward is _RMS_FORWARD() and model.norm.weight.dtype == torch.float32:
        out = []
        for layer in layers:
            if type(layer) not in _LEAN_CLASSES_INV or type(layer.input_layernorm).forward is not _RMS_FORWARD() \
                    or type(layer.post_attention_layernorm).forward is not _RMS_FORWARD() \
                    or type(layer.self_attn.q_proj) is not FusedLeadLinear \
                    or type(layer.mlp.gate_proj) is not FusedLeadLinear:
                out = None
                break
            f = _fused_layer(layer)
            if f is None:
                out = None
                break
            out.append((f, layer.self_attn.layer_idx, layer.self_attn.scaling))
            checks += [(w, w.data_ptr(), _version(w), w.__dict__.get(COMPACT_ATTR)) for w in _layer_weights(layer)]
    model.__dict__[FUSED_ATTR] = (make, path, checks, out)
    return out


def _version(w: torch.Tensor) -> int:
    """A weight's version counter; 0 for an inference tensor (made under ``torch.inference_mode``: it has none, and
    raises when asked). Such a weight never has a compact form (``formats.compact_weight``), so the fused layer reads
    its fp32 storage itself and sees any change to it."""
    return 0 if w.is_inference() else w._version


def _layer_weights(layer: nn.Module) -> tuple:
    """The tensors a layer's ``FusedLayer`` is made from: the fused q/k/v weight, o_proj's, the fused gate/up weight,
    down_proj's and the two norms' weights."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj._fused_weight, attn.o_proj.weight, mlp.gate_proj._fused_weight, mlp.down_proj.weight,
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight)


DIRECT_MODEL = True
"""Run batch-invariant decode passes through ``_lean_model_forward``'s direct loop where it applies (False: always
through ``LlamaModel.forward`` and the layers' own ``_lean_forward``; for A/B measurements and tests)."""
_LEAN_MODELS: dict[type, type] = {}
_LEAN_MODELS_INV: dict[type, type] = {}


def _lean_layers(modules, on: bool) -> int:
    """Switch every transformers ``LlamaDecoderLayer`` inside ``modules`` to its lean subclass (``on``) or back, and
    every ``LlamaModel`` to its subclass running ``_lean_model_forward``. Other architectures keep transformers'
    forward. Returns the number of decoder layers switched."""
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel
    except ImportError:  # pragma: no cover - transformers without Llama
        return 0
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    n = 0
    for root in roots:
        for m in root.modules():
            if on and type(m) is LlamaDecoderLayer:
                m.__class__ = _lean_class(LlamaDecoderLayer)
                n += 1
            elif not on and type(m) in _LEAN_CLASSES_INV:
                m.__class__ = _LEAN_CLASSES_INV[type(m)]
                n += 1
            elif on and type(m) is LlamaModel:
                if LlamaModel not in _LEAN_MODELS:
                    lean = type("LeanLlamaModel", (LlamaModel,), {"forward": _lean_model_forward,
                                                                  "__doc__": _lean_model_forward.__doc__})
                    _LEAN_MODELS[LlamaModel], _LEAN_MODELS_INV[lean] = lean, LlamaModel
                m.__class__ = _LEAN_MODELS[LlamaModel]
            elif not on and type(m) in _LEAN_MODELS_INV:
                m.__class__ = _LEAN_MODELS_INV[type(m)]
    return n


def lean_layer_count(module: nn.Module) -> int:
    """How many of ``module``'s decoder layers run ``_lean_forward`` (the layers whose decode passes can run in the
    batch-invariant layout: ``batch_invariant``)."""
    return sum(type(m) in _LEAN_CLASSES_INV for m in module.modules())
