"""Which cached positions a fed token may see: one mechanism for token trees and ragged batches.

A target pass feeds Q new tokens after a KV cache of C entries. Who sees whom is a boolean matrix
``visible[b, i, j]`` (row b of the batch, fed token i, key position j in 0..C+Q−1): True = attend.

- A chain (plain decoding, a draft chain): every fed token sees every valid cached entry and the fed tokens
  up to itself (causal).
- A token tree (Medusa, Cai et al. 2024, §2.1.2 "tree attention"; SpecInfer, Miao et al. 2024, §4.2): the
  tree's nodes are fed together; node i sees the cached context, its ancestors and itself, never a sibling
  branch (``tree_visibility``). Its position id is context length + depth, so RoPE places it where it
  would sit in its own branch.
- A ragged batch: rows hold different numbers of valid cache entries (tokens a row rejected are left in the
  cache as holes, or rows are padded); ``cached_valid[b, j]`` False hides entry j from row b.

transformers 5.24 passes an attention mask that is already 4D, [batch, 1, q_len, kv_len], to the attention
function as is (``masking_utils._preprocess_mask_arguments``: "If the mask is already 4D, simply return
as-is"). The SDPA path (``integrations/sdpa_attention.py``) hands it to
``torch.nn.functional.scaled_dot_product_attention``, where a boolean mask means True = attend; the eager
path (``eager_attention_forward``) *adds* it to the scores, so it needs an additive float mask (0 = attend,
the dtype's minimum = blocked). ``model_mask`` builds the right one for the model's attention implementation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.errors import InputError

_SUPPORTED = ("sdpa", "eager")


def tree_visibility(parents: Sequence[int]) -> torch.Tensor:
    """Ancestor-or-self matrix of a token tree.

    Args:
        parents: N entries; ``parents[i]`` is the index of node i's parent node, or −1 for a node whose
            parent is the last context token (a root of the tree). Parents must come before children
            (``parents[i] < i``).

    Returns:
        [N, N] bool: ``out[i, j]`` is True iff node j is node i or one of its ancestors.

    Raises:
        InputError: if a parent index is not an earlier node (or −1).
    """
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, par in enumerate(parents):
        par = int(par)
        if not -1 <= par < i:
            raise InputError(f"Node {i}'s parent must be an earlier node or −1 (the context), got {par}.")
        if par >= 0:
            out[i] = out[par]
        out[i, i] = True
    return out


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a root, whose parent is the context, has depth 1). See ``tree_visibility``."""
    depth: list[int] = []
    for i, par in enumerate(parents):
        if not -1 <= int(par) < i:
            raise InputError(f"Node {i}'s parent must be an earlier node or −1 (the context), got {par}.")
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


def fed_visibility(new_visible: torch.Tensor, cached_valid: torch.Tensor) -> torch.Tensor:
    """Full visibility of a pass: each fed token sees the valid cached entries plus ``new_visible``.

    Args:
        new_visible: [B, Q, Q] or [Q, Q] bool, which fed tokens each fed token sees (causal for a chain,
            ``tree_visibility`` for a tree). Each token should see itself.
        cached_valid: [B, C] bool, which cache entries each row may see (all True without holes).

    Returns:
        [B, Q, C + Q] bool.
    """
    b, c = cached_valid.shape
    if new_visible.dim() == 2:
        new_visible = new_visible.unsqueeze(0).expand(b, -1, -1)
    q = new_visible.shape[-1]
    cached = cached_valid[:, None, :].expand(b, q, c)
    return torch.cat([cached.to(torch.bool), new_visible.to(torch.bool)], dim=-1)


def attn_implementation(model: torch.nn.Module) -> str:
    """The attention implementation a transformers model runs ("sdpa", "eager", ...)."""
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "_attn_implementation", None) or "eager")


def model_mask(visible: torch.Tensor, model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The 4D attention mask a transformers 5.24 model takes for a visibility matrix.

    Args:
        visible: [B, Q, K] bool (True = attend); K = cached entries + fed tokens.
        model: the model the mask is for (its attention implementation decides the format).
        dtype: dtype of an additive mask (default: the model's parameter dtype).

    Returns:
        [B, 1, Q, K]: bool (True = attend) for SDPA; additive float (0 or the dtype's minimum) for eager.

    Raises:
        InputError: for an attention implementation that takes no custom mask this way
            (FlashAttention-2, flex attention): load the model with ``attn_implementation="sdpa"``.
    """
    impl = attn_implementation(model)
    if impl not in _SUPPORTED:
        raise InputError(f"Token trees and ragged batches need a custom attention mask, which the {impl!r} "
                         f"attention implementation does not take here; load the model with "
                         f"attn_implementation='sdpa' or 'eager'.")
    vis = visible.to(torch.bool)[:, None]
    if impl == "sdpa":
        return vis
    if dtype is None:
        dtype = next(model.parameters()).dtype
    out = torch.zeros(vis.shape, dtype=dtype)
    return out.masked_fill(~vis, torch.finfo(dtype).min)


def stack_left_padded(rows_kv: Sequence, lens: Sequence[int], room: int = 0, scratch: "KVScratch | None" = None):
    """Stack single-row KV caches into one batch cache, each row left-padded with zeros to the longest.

    Used wherever separately cached rows meet in one pass: the room's target pass (``scheduler``), the heads'
    batched drafts (``proposers.FeatureHeadProposer.propose_many``) and the batch decoder's packed prefill
    (``batch``). The padding must be masked out: ``valid`` says which entries each row may see (pass it to
    ``fed_visibility``).

    Args:
        rows_kv: per row, a list of (keys, values) per layer, each [1, heads, n, head_dim], or every layer at once
            as a tuple of two [layers, 1, heads, n, head_dim] tensors (``CachedLM.kv_block``: one copy per row instead
            of one per layer); anything for a row holding nothing, e.g. None.
        lens: n, the entries each row holds.
        room: entries the next pass will add to every row (its width). With ``room`` > 0 each layer is a
            transformers ``StaticLayer`` of max(lens) + room entries holding the rows up to max(lens): the pass then
            writes its new entries in place (``index_copy_``) instead of concatenating the whole batch cache again,
            and each row's entries are copied once instead of twice (padding, then stacking). The pass must add
            exactly ``room`` entries: the layer's keys and values are its full [B, heads, max(lens) + room,
            head_dim] tensors, as a ``DynamicLayer`` would return after that pass. 0: a ``DynamicCache``.
        scratch: with ``room``, a ``KVScratch`` whose memory the layers are made in (reused pass after pass: see
            ``KVScratch``); the cache is then valid until the next call with the same scratch. None: new memory.

    Returns:
        (a transformers cache whose layers hold [B, heads, max(lens), head_dim] (and room for ``room`` more),
        ``valid`` [B, max(lens)] bool: False on each row's left padding).
    """
    from transformers import DynamicCache

    c_max = max(lens, default=0)
    if room > 0 and c_max > 0:
        return _stack_in_place(rows_kv, lens, c_max, room, scratch), _left_valid(lens, c_max)
    rows_kv = [list(zip(kv[0], kv[1])) if n > 0 and _is_block(kv) else kv for kv, n in zip(rows_kv, lens)]
    cache = DynamicCache()
    if c_max > 0:
        ref = next(kv for kv, n in zip(rows_kv, lens) if n > 0)
        for li, (k0, _) in enumerate(ref):
            ks, vs = [], []
            for kv, n in zip(rows_kv, lens):
                k, v = kv[li] if n > 0 else (k0[:, :, :0], k0[:, :, :0])
                if n < c_max:
                    pad = k0.new_zeros((1, k0.shape[1], c_max - n, k0.shape[3]))
                    k, v = torch.cat([pad, k], dim=2), torch.cat([pad, v], dim=2)
                ks.append(k)
                vs.append(v)
            cache.update(torch.cat(ks), torch.cat(vs), li)
    return cache, _left_valid(lens, c_max)


def _is_block(kv) -> bool:
    """A row given as (keys, values) of [layers, 1, heads, n, head_dim] each (``CachedLM.kv_block``)."""
    return isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], torch.Tensor) and kv[0].dim() == 5


def _left_valid(lens: Sequence[int], c_max: int) -> torch.Tensor:
    """[B, c_max] bool: True on each row's last ``n`` entries (its own), False on its left padding."""
    col = torch.arange(c_max)
    return torch.stack([col >= c_max - n for n in lens]) if lens else torch.zeros(0, 0, dtype=torch.bool)


class KVScratch:
    """Memory for ``stack_left_padded(room=...)``'s batch cache, kept from one pass to the next.

    Why: a batch cache made in new memory every pass (transformers' ``StaticLayer`` allocates zeroed tensors)
    page-faults all of it in again each time: measured in the room's 16-reader target pass (Intel Xeon, 2 threads,
    torch profiler), zeroing the 60 new key/value tensors took 12 ms of a ~200 ms forward. Kept memory is
    already mapped; only each row's left padding is zeroed.

    One user at a time (the room's worker thread); a cache made in it is overwritten by the next ``take``.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous uninitialised tensor of ``shape`` with ``like``'s dtype and device, in this scratch's
        memory for ``name`` (grown when too small)."""
        n = 1
        for d in shape:
            n *= d
        key = (name, like.dtype, like.device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < n:
            flat = self._flat[key] = torch.empty(max(n, int(n * 1.25)), dtype=like.dtype, device=like.device)
        return flat[:n].view(shape)


def _stack_in_place(rows_kv: Sequence, lens: Sequence[int], c_max: int, room: int, scratch: KVScratch | None = None):
    """``stack_left_padded`` with ``room``: a transformers ``Cache`` of ``StaticLayer`` s of [B, heads, c_max + room,
    head_dim].

    The layers are views into one [layers, B, heads, c_max + room, head_dim] tensor for the keys and one for the
    values, in ``scratch``'s memory when given; the cache keeps both as ``kv_blocks`` = (keys, values), so a row's
    entries for every layer can be read at once. Each row's entries are copied right-aligned into its first c_max
    entries (one ``copy_`` of a ``CachedLM.kv_block`` row, or one ``torch.stack`` of its layers, into the row's slice
    for all layers) and its left padding is zeroed. The last ``room`` entries are left for the pass to write
    (``StaticLayer.update``'s ``index_copy_``)."""
    from transformers.cache_utils import Cache, StaticLayer

    b = len(lens)
    ref = next(kv for kv, n in zip(rows_kv, lens) if n > 0)
    n_layers = ref[0].shape[0] if _is_block(ref) else len(ref)
    k0, v0 = (ref[0][0], ref[1][0]) if _is_block(ref) else ref[0]
    width = c_max + room
    k_shape = (n_layers, b, k0.shape[1], width, k0.shape[3])
    v_shape = (n_layers, b, v0.shape[1], width, v0.shape[3])
    if scratch is not None:
        keys, values = scratch.take("keys", k_shape, k0), scratch.take("values", v_shape, v0)
    else:
        keys, values = k0.new_empty(k_shape), v0.new_empty(v_shape)
    for r, (kv, n) in enumerate(zip(rows_kv, lens)):
        if n < c_max:
            keys[:, r, :, :c_max - n].zero_()
            values[:, r, :, :c_max - n].zero_()
        if n > 0 and _is_block(kv):  # every layer in one copy (measured: 4 ms instead of 10 for 16 rows' keys)
            keys[:, r, :, c_max - n:c_max].copy_(kv[0][:, 0])
            values[:, r, :, c_max - n:c_max].copy_(kv[1][:, 0])
        elif n > 0:
            torch.stack([k[0] for k, _ in kv], out=keys[:, r, :, c_max - n:c_max])
            torch.stack([v[0] for _, v in kv], out=values[:, r, :, c_max - n:c_max])
    layers = []
    for li in range(n_layers):
        layer = StaticLayer(width)
        # transformers' own initialisation on an empty batch (no memory), then the layer's tensors are the views
        layer.lazy_initialization(k0.new_empty((0, k0.shape[1], 0, k0.shape[3])),
                                  v0.new_empty((0, v0.shape[1], 0, v0.shape[3])))
        layer.keys, layer.values, layer.batch_size = keys[li], values[li], b
        layer.cumulative_length.fill_(c_max)
        layers.append(layer)
    cache = Cache(layers=layers)
    cache.kv_blocks = (keys, values)  # every layer at once: [layers, B, heads, c_max + room, head_dim] each
    return cache
