"""Draft proposers: where the γ guesses of each round come from.

One small interface: ``propose(seq, k, cfg, generator) -> Proposal`` with the draft tokens and, for
each, the distribution q it was drawn from (over the target's vocabulary). A new kind of draft is one
class. Each model-based proposer keeps its own KV cache, synced to the sequence it is given (a cache
that ran ahead on rejected draft tokens is cropped back to the common prefix: the KV rollback).

Kinds:
- ``DraftModelProposer``: a separate causal LM sharing the target's tokenizer (Leviathan et al. 2023).
- ``PromptLookupProposer``: copy the continuation of the latest earlier match of the last n tokens
  (Saxena 2023, "prompt lookup decoding"; transformers' ``PromptLookupCandidateGenerator``). No model;
  q is a point mass on each proposed token.
- ``EarlyExitProposer``: the target's first k layers plus its final norm and LM head (self-speculative
  drafting, cf. Elhoushi et al. 2024, "LayerSkip"), with its own KV cache.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

import torch

from engine.decoding.compute import batch_invariant
from engine.decoding.models import LoadedModel, check_tokenizers_compatible
from engine.decoding.sampling import SamplingConfig, argmax_rows, draw_token, gumbel_noise, noise_seed, warp_probs
from engine.decoding.tree import MAX_BRANCHING, TokenTree, empty_tree
from engine.errors import InputError, ModelLoadError


def _check_branching(k) -> int:
    """A tree draft's branching factor, checked: a whole number in 1..``MAX_BRANCHING``.

    Raises:
        InputError: otherwise.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_BRANCHING:
        raise InputError(f"The tree branching (children per expanded node) must be a whole number from 1 to "
                         f"{MAX_BRANCHING}, got {k!r}.")
    return k


@dataclass
class Proposal:
    """Draft tokens of one round.

    Attributes:
        tokens: k ≤ γ draft token ids (k may be 0).
        q: [k, V] float32 on CPU: the distribution each token was drawn from, over the target's
            vocabulary V (zero on ids the draft cannot produce). Under greedy it is the draft's
            softmax at T = 1 (for display; the token is its argmax).
        point_mass: every row of q is one-hot on its token (prompt lookup); lets the decoder skip
            searching q for its top tokens.
    """

    tokens: list[int]
    q: torch.Tensor
    point_mass: bool = False
    choice: object | None = None
    """How the draft length was chosen (``engine.decoding.draft_length.LengthChoice``), where a length rule
    chose it; None for a fixed γ."""


BLOCK_SPARE = 32  # entries of room a new ``CachedLM`` block is made with (``_append_block``): several passes' worth


@functools.cache
def block_layer_class() -> type:
    """The cache layer of ``CachedLM`` caches, ``BlockLayer`` (made on first use: transformers is imported lazily here,
    as in ``CachedLM.reset``)."""
    from transformers.cache_utils import DynamicLayer

    class BlockLayer(DynamicLayer):
        """transformers' ``DynamicLayer`` whose keys and values may be views of a ``CachedLM`` block (``block``:
        this layer's [1, heads, capacity, head dim] slots of keys and values, set by ``CachedLM._ensure_block``).
        While they are, and the new entries fit, ``update`` writes them in place after the cached ones and
        returns longer views: the same entries ``DynamicLayer.update`` concatenates, without copying the whole
        layer's cache every pass (60 copies a pass of the embedded target, each as long as the context).
        Otherwise (no block, a layer that an ``update`` or a reset took off it, no room left, entries that
        autograd tracks) it is ``DynamicLayer.update``."""

        block: tuple[torch.Tensor, torch.Tensor] | None = None
        IN_PLACE = True
        """False: always concatenate (``DynamicLayer``), for A/B measurements and tests."""

        def update(self, key_states, value_states, *args, **kwargs):
            blk = self.block
            if blk is not None and self.IN_PLACE and self.is_initialized and self.keys is not None:
                kb, vb = blk
                k, v = self.keys, self.values
                n, w = k.shape[-2], key_states.shape[-2]
                if (k.dim() == 4 and n + w <= kb.shape[-2] and k.data_ptr() == kb.data_ptr()
                        and v.data_ptr() == vb.data_ptr() and k.stride() == kb.stride() and v.stride() == vb.stride()
                        and key_states.shape[:2] == kb.shape[:2] and key_states.shape[3] == kb.shape[3]
                        and value_states.shape == key_states.shape and key_states.dtype == kb.dtype
                        and not (key_states.requires_grad or value_states.requires_grad)):  # no autograd graph
                    kb[:, :, n:n + w].copy_(key_states)
                    vb[:, :, n:n + w].copy_(value_states)
                    self.keys, self.values = kb[:, :, :n + w], vb[:, :, :n + w]
                    return self.keys, self.values
            return super().update(key_states, value_states, *args, **kwargs)

    return BlockLayer


class CachedLM:
    """A causal LM with its own DynamicCache that remembers which token ids it holds.

    ``logits_for(seq, n)`` makes the cache cover ``seq`` exactly, feeding only what is missing (after
    cropping away tokens that are no longer in ``seq``), and returns the logits of the last n positions.
    The logits of the last cached position are kept (``last_logits``) until the cache is cropped below
    it, so when the first asked-for position is already cached (the prompt after a full prefill) they
    are reused and only the new tokens are fed, or nothing at all.

    With ``keep_hidden`` it also keeps ``hidden``: [cached_len, H], the last hidden state (after the final
    norm: what the LM head reads) at every cached position, for drafts that read the target's features
    (``FeatureHeadProposer``). The logits are then computed as ``lm_head(decoder(...))`` on the last n
    positions, the same operations as the model's own forward with ``logits_to_keep=n``.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, keep_hidden: bool = False):
        self.model = model
        self.device = device
        self.keep_hidden = keep_hidden
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = block_layer_class()  # decode passes write into the block in place
        self._block: tuple[torch.Tensor, torch.Tensor] | None = None  # ``_append_block``'s keys and values
        self._views: list | None = None  # the layers' (keys, values) views of the block this object last set (kv_block)
        self.ids: list[int] = []
        self.hidden: torch.Tensor | None = None
        self._hidden_buf: torch.Tensor | None = None  # ``append_hidden``'s buffer: ``hidden`` is a view of it
        self.last_logits: torch.Tensor | None = None  # [V] float32, of the last cached position

    @property
    def cached_len(self) -> int:
        return len(self.ids)

    def crop(self, n: int) -> None:
        """Keep only the first n cached tokens (KV rollback)."""
        drop = len(self.ids) - n
        if drop > 0:
            self.cache.crop(-drop)
            self.ids = self.ids[:n]
            self.last_logits = None
            if self.hidden is not None:
                self.hidden = self.hidden[:n]

    def rollback_to(self, seq: list[int]) -> None:
        """KV rollback: crop the cache to its longest common prefix with ``seq``."""
        common = 0
        limit = min(len(self.ids), len(seq))
        while common < limit and self.ids[common] == seq[common]:
            common += 1
        self.crop(common)

    @torch.inference_mode()
    def logits_for(self, seq: list[int], n_logits: int = 1) -> torch.Tensor:
        """Return [n_logits, V] float32 logits for the last n positions of ``seq`` (fed tokens only).

        Raises:
            ValueError: if fewer than n_logits tokens would be fed (a bug in the caller).
        """
        common = 0
        limit = min(len(self.ids), len(seq))
        while common < limit and self.ids[common] == seq[common]:
            common += 1
        if common == len(self.ids) and self.last_logits is not None and len(seq) - common == n_logits - 1:
            # the first position asked for is the last cached one: reuse its logits
            if common == len(seq):
                return self.last_logits[None]
            return torch.cat([self.last_logits[None], self._feed(seq, common, n_logits - 1)])
        common = min(common, len(seq) - 1)  # feed at least one token
        self.crop(common)
        if len(seq) - common < n_logits:
            raise ValueError(f"asked for {n_logits} logits but only {len(seq) - common} tokens are new")
        return self._feed(seq, common, n_logits)

    def plan(self, seq: list[int], n_logits: int) -> tuple[list[int], int, torch.Tensor | None]:
        """What ``logits_for(seq, n_logits)`` would feed, without feeding it (a scheduler batches the feed of
        several caches into one pass, ``engine.decoding.scheduler``). Crops the cache exactly as
        ``logits_for`` does.

        Returns:
            (feed, n_fed_logits, reused): the tokens to feed after the (cropped) cache, how many logits of
            the last fed positions are wanted, and the cached last logits [V] to put before them (None when
            not reused). ``logits_for`` = cat(reused, logits of the feed's last n_fed_logits positions).

        Raises:
            ValueError: as ``logits_for``.
        """
        common = 0
        limit = min(len(self.ids), len(seq))
        while common < limit and self.ids[common] == seq[common]:
            common += 1
        if common == len(self.ids) and self.last_logits is not None and len(seq) - common == n_logits - 1:
            return list(seq[common:]), n_logits - 1, self.last_logits
        common = min(common, len(seq) - 1)
        self.crop(common)
        if len(seq) - common < n_logits:
            raise ValueError(f"asked for {n_logits} logits but only {len(seq) - common} tokens are new")
        return list(seq[common:]), n_logits, None

    def absorb(self, feed: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
               hidden: torch.Tensor | None, last_logits: torch.Tensor) -> None:
        """Take in the result of a pass that fed ``feed`` (from ``plan``) outside this object.

        Args:
            keys, values: the fed tokens' KV entries: per layer [1, KV heads, len(feed), head dim], or every layer
                in one tensor [layers, 1, KV heads, len(feed), head dim] (``_append_block``: one copy for all layers).
            hidden: [len(feed), H] their last hidden states (needed when ``keep_hidden``).
            last_logits: [V] float32 logits of the last fed position.
        """
        if isinstance(keys, torch.Tensor):
            self._append_block(keys, values)
        else:
            for i, (k, v) in enumerate(zip(keys, values)):
                self.cache.update(k, v, i)
        if self.keep_hidden:
            self.append_hidden(hidden)
        self.ids = self.ids + list(feed)
        self.last_logits = last_logits

    def append_hidden(self, h: torch.Tensor) -> None:
        """Append [w, H] last hidden states to ``hidden`` ([cached_len, H]). ``hidden`` is a view of a buffer with room
        to spare (``BLOCK_SPARE`` rows when made): while it still is and the rows fit, they are copied in after it,
        else a new buffer is made and ``hidden`` copied in once. The same rows as ``torch.cat([hidden, h])`` without
        copying every cached row each pass (a verify pass at 400 cached tokens copied 0.9 MB for it). Rows past a
        crop are overwritten; a tensor autograd tracks is concatenated."""
        old, w = self.hidden, h.shape[0]
        if old is None:
            self.hidden = h
            return
        buf = self._hidden_buf
        n = old.shape[0]
        if h.requires_grad or old.requires_grad:
            self.hidden = torch.cat([old, h])
            return
        if (buf is None or old.data_ptr() != buf.data_ptr() or old.stride() != buf.stride() or n + w > buf.shape[0]
                or buf.dtype != h.dtype or buf.shape[1:] != h.shape[1:]):
            buf = h.new_empty((n + w + BLOCK_SPARE, *h.shape[1:]))
            buf[:n] = old
            self._hidden_buf = buf
        buf[n:n + w] = h
        self.hidden = buf[:n + w]

    def _append_block(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append [layers, 1, heads, w, head dim] new entries to every layer of the cache at once.

        The layers are views into one [layers, 1, heads, capacity, head dim] tensor for the keys and one for the
        values (``kv_block``), made with room to spare (``BLOCK_SPARE``): while the layers are still those views and
        the new entries fit, they are written in place after the cached ones, two small copies per pass; otherwise a
        new pair is made and the cache copied into it once. Why: the room (``engine.decoding.scheduler``) hands every
        reader its new entries after each shared pass; copying the whole cache each time took 18 ms of a 16-reader
        pass (Intel Xeon, 2026-12-03), and 960 per-layer ``torch.cat`` s before that 19 ms. The same entries as
        ``DynamicCache.update`` layer by layer; the layers stay transformers' ``DynamicLayer`` s (a later ``update``
        concatenates onto the views, which ends the sharing). Entries past a crop are overwritten: the block is this
        object's own, and nothing else keeps views of it. Falls back to ``update`` where the cache is not yet
        filled."""
        layers = self.cache.layers
        if len(layers) != keys.shape[0] or not self._filled():
            for i in range(keys.shape[0]):
                self.cache.update(keys[i], values[i], i)
            return
        n, w = layers[0].keys.shape[-2], keys.shape[-2]
        self._ensure_block(w)
        kb, vb = self._block
        kb[:, :, :, n:n + w].copy_(keys)
        vb[:, :, :, n:n + w].copy_(values)
        self._view_block(n + w)

    def _view_block(self, n: int) -> None:
        """Make every layer's keys and values the block's first n entries (views)."""
        kb, vb = self._block
        views = list(zip(kb[:, :, :, :n].unbind(0), vb[:, :, :, :n].unbind(0)))
        for la, (k, v) in zip(self.cache.layers, views):
            la.keys, la.values = k, v
        self._views = views

    def block_with_room(self, w: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole block (keys, values), each [layers, 1, heads, capacity, head dim], with room for w entries after
        the cached ones (grown as ``_append_block`` grows it: the cache copied once into a bigger pair), for a pass
        that writes its new entries there itself (the room's pass over rows in their own caches,
        ``compute.lean.fused_decode_rows``; then ``absorb_written``). None when the cache is not a block now
        (``kv_block``)."""
        held = self.kv_block()  # (its checks walk every layer: once a pass, not again in _ensure_block)
        if held is None:
            return None
        if held[0].shape[-2] + w > self._block[0].shape[-2]:
            self._ensure_block(w)
        return self._block

    def absorb_written(self, feed: list[int], hidden: torch.Tensor | None, last_logits: torch.Tensor) -> None:
        """``absorb`` for a pass that already wrote the fed tokens' KV entries into the block after the cached ones
        (``block_with_room``): the layers' views grow by ``len(feed)``; hidden and last_logits as ``absorb``."""
        self._view_block(self.cache.layers[0].keys.shape[-2] + len(feed))
        if self.keep_hidden:
            self.append_hidden(hidden)
        self.ids = self.ids + list(feed)
        self.last_logits = last_logits

    def _filled(self) -> bool:
        """Whether every layer of the cache holds [1, heads, n, head dim] entries (what a block can take)."""
        layers = self.cache.layers
        return bool(layers) and all(getattr(la, "is_initialized", False) and la.keys.dim() == 4 for la in layers)

    def _ensure_block(self, w: int) -> None:
        """Make the block (``_append_block``) hold the cache with room for ``w`` more entries: nothing when it
        already does, else a new pair with ``BLOCK_SPARE`` to spare beyond that, the cache copied in once."""
        layers = self.cache.layers
        n = layers[0].keys.shape[-2]
        held = self.kv_block()
        if held is not None and n + w <= self._block[0].shape[-2]:
            return
        k0, v0 = layers[0].keys, layers[0].values
        cap = n + w + BLOCK_SPARE
        new_k = k0.new_empty((len(layers), *k0.shape[:2], cap, k0.shape[3]))
        new_v = v0.new_empty((len(layers), *v0.shape[:2], cap, v0.shape[3]))
        if held is not None:
            new_k[:, :, :, :n].copy_(held[0])
            new_v[:, :, :, :n].copy_(held[1])
        else:
            torch.stack([la.keys for la in layers], out=new_k[:, :, :, :n])
            torch.stack([la.values for la in layers], out=new_v[:, :, :, :n])
        self._block = (new_k, new_v)
        views = list(zip(new_k[:, :, :, :n].unbind(0), new_v[:, :, :, :n].unbind(0)))
        for i, (la, (k, v)) in enumerate(zip(layers, views)):
            la.keys, la.values = k, v
            # BlockLayer.update writes the next entries here in place: single views (``unbind``'s may not be written
            # to in place where autograd is on)
            la.block = (new_k[i], new_v[i])
        self._views = views

    def reserve_block(self) -> bool:
        """Put the cache into a block now (``_append_block``), with ``BLOCK_SPARE`` entries to spare: the room does
        this right after a reader's prefill, so the reader's first shared pass stacks it with one copy and writes its
        new entries in place, instead of building the block then (16 new blocks took 52–82 ms of the room's first
        pass, memory touched for the first time: ``engine.decoding.scheduler``, Intel Xeon). The same entries, views
        of the block. Returns whether the cache is a block now (False: an empty or non-standard cache, left as is)."""
        if not self._filled():
            return False
        self._ensure_block(0)
        return True

    def kv_block(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache as two [layers, 1, heads, cached_len, head dim] views (keys, values) when every layer is still
        a view of the block ``_append_block`` made (one copy reads all layers: the room's stacking); None when not
        (an ``update`` or a reset since, or no block yet)."""
        blk = self._block
        layers = self.cache.layers
        if blk is None or len(layers) != blk[0].shape[0]:
            return None
        kb, vb = blk
        k0 = getattr(layers[0], "keys", None)
        if k0 is None or k0.dim() != 4:
            return None
        n = k0.shape[2]
        views = self._views
        if views is not None and len(views) == len(layers) and all(
                la.keys is k and la.values is v for la, (k, v) in zip(layers, views)):
            # every layer still holds the very views this object made of the block (``_view_block``): 7 µs, where
            # the checks below took 31 µs a reader (0.5 ms of a 16-reader pass, which asks once per reader; AMD EPYC)
            return kb[:, :, :, :n], vb[:, :, :, :n]
        k_step, v_step = kb.stride(0) * kb.element_size(), vb.stride(0) * vb.element_size()
        k_ptr, v_ptr = kb.data_ptr(), vb.data_ptr()
        k_strides, v_strides = kb.stride()[1:], vb.stride()[1:]
        # each layer's tensors start at its slot of the block, with the block's strides, n long: views of it (the
        # block is alive, so no other tensor starts there). Cheap checks: this runs twice per reader and pass.
        for i, la in enumerate(layers):
            k, v = la.keys, la.values
            if (k.data_ptr() != k_ptr + i * k_step or v.data_ptr() != v_ptr + i * v_step or k.shape[2] != n
                    or v.shape[2] != n or k.stride() != k_strides or v.stride() != v_strides):
                return None
        self._views = [(la.keys, la.values) for la in layers]
        return kb[:, :, :, :n], vb[:, :, :, :n]

    def _feed(self, seq: list[int], common: int, n_logits: int) -> torch.Tensor:
        """Feed seq[common:] after a cache holding exactly seq[:common]; [n_logits, V] float32 logits. Every pass, a
        prefill (empty cache) too, runs in the batch-invariant layout (``compute.batch_invariant``): each position's
        bits depend only on the tokens before it, so a decode pass gives the bits the same sequence gets as a row of
        the room's batched pass, and a prefill gives the bits the same tokens get fed one by one or after a reused
        prefix. Why the prefill too: on the int8 arithmetic a last-bit difference upstream (another attention order)
        can round an activation to the next int8 step, so two layouts of the same prefill part visibly."""
        if common > 0 and self._filled() and not torch.is_grad_enabled():  # the layers write the new entries into
            self._ensure_block(len(seq) - common)                           # the block in place (BlockLayer)
        with batch_invariant():
            return self._feed_tokens(seq, common, n_logits)

    def _feed_tokens(self, seq: list[int], common: int, n_logits: int) -> torch.Tensor:
        new = seq[common:]
        inp = torch.tensor([new], dtype=torch.long, device=self.device)
        if self.keep_hidden:
            h = self.model.get_decoder()(input_ids=inp, cache=self.cache, use_cache=True).last_hidden_state
            self.append_hidden(h[0])
            self.ids = list(seq)
            logits = self.model.get_output_embeddings()(h[:, -n_logits:])[0].float()
        else:
            out = self.model(input_ids=inp, cache=self.cache, use_cache=True, logits_to_keep=n_logits)
            self.ids = list(seq)
            logits = out.logits[0, -n_logits:].float()
        self.last_logits = logits[-1]
        return logits


class Proposer:
    """Interface: propose up to k draft tokens continuing ``seq``.

    A proposer that reads the target's hidden states sets ``needs_target_hidden``; the decoder then
    keeps them in its target ``CachedLM`` and hands that to ``attach`` before the first round.
    """

    name = "proposer"
    needs_target_hidden = False

    def attach(self, target_lm: "CachedLM") -> None:
        """Receive the decoder's target ``CachedLM`` (only called when ``needs_target_hidden``)."""

    def reset(self) -> None:
        """Forget all state (a new sequence starts)."""

    def rollback(self, seq: list[int]) -> None:
        """The round ended with ``seq`` as the sequence: drop any state past its common prefix."""

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator) -> Proposal:  # pragma: no cover - interface
        raise NotImplementedError

    def batch_key(self):
        """Proposers with the same non-None key can draft several sequences in one call of their class's
        ``propose_many(jobs)`` (a scheduler's pass, ``engine.decoding.scheduler``); None (the default): per
        sequence only."""
        return None


class _ModelProposer(Proposer):
    """Shared code of proposers that run a (partial) model autoregressively with a KV cache."""

    def __init__(self, lm: CachedLM, target_vocab: int):
        self.lm = lm
        self.target_vocab = target_vocab

    def reset(self) -> None:
        self.lm.reset()

    def rollback(self, seq: list[int]) -> None:
        self.lm.rollback_to(seq)

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator) -> Proposal:
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        cur = list(seq)
        for _ in range(k):
            # one device→host copy per step (then q and the argmax are read on the CPU: one sync, not two)
            logits = self.lm.logits_for(cur, 1)[0].cpu()
            shared = min(logits.shape[-1], self.target_vocab)
            logits = logits[:shared]  # the draft only proposes ids the target also has
            q = warp_probs(logits, cfg)
            x = argmax_rows(logits)[0] if cfg.greedy else draw_token(q, cfg, generator, len(cur))
            if shared < self.target_vocab:
                q = torch.cat([q, q.new_zeros(self.target_vocab - shared)])
            tokens.append(x)
            rows.append(q)
            cur.append(x)
        q = torch.stack(rows) if rows else torch.zeros(0, self.target_vocab)
        return Proposal(tokens, q)


class DraftModelProposer(_ModelProposer):
    """A separate draft model sharing the target's tokenizer (checked at construction).

    Raises:
        TokenizerMismatchError: if the tokenizers differ.
    """

    def __init__(self, draft: LoadedModel, target: LoadedModel):
        check_tokenizers_compatible(target.tokenizer, draft.tokenizer)
        super().__init__(CachedLM(draft.model, draft.device), target_vocab=output_vocab_size(target))
        self.draft = draft
        self.name = f"draft model: {draft.name}"


def output_vocab_size(lm: LoadedModel) -> int:
    """Number of logits the model outputs (embedding rows; may exceed len(tokenizer))."""
    return int(lm.model.get_output_embeddings().weight.shape[0])


def truncated_model(model: torch.nn.Module, n_layers: int) -> torch.nn.Module:
    """A view of a decoder-only model using only its first ``n_layers`` layers, sharing all weights.

    The final norm and LM head are kept, so it outputs next-token logits ("early exit").
    Works for Llama-style models (``model.model.layers``).

    Raises:
        InputError: if n_layers is outside 1..num_hidden_layers, or the model has no ``.model.layers``.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise InputError("Early exit needs a decoder model with `model.layers` (Llama-style).")
    total = len(layers)
    if not 1 <= n_layers <= total:
        raise InputError(f"Early exit needs 1 ≤ k ≤ {total} layers, got {n_layers}.")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n_layers]
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner.layers = torch.nn.ModuleList(list(layers)[:n_layers])
    new_inner.config = cfg
    outer = copy.copy(model)
    outer._modules = dict(model._modules)
    outer.model = new_inner
    outer.config = cfg
    return outer


class EarlyExitProposer(_ModelProposer):
    """Self-drafting with the target's first k layers + final norm + LM head, with its own KV cache."""

    def __init__(self, target: LoadedModel, n_layers: int):
        view = truncated_model(target.model, n_layers)
        super().__init__(CachedLM(view, target.device), target_vocab=output_vocab_size(target))
        self.n_layers = n_layers
        self.name = f"early exit at {n_layers} of {len(target.model.model.layers)} layers"


class FeatureHeadProposer(Proposer):
    """EAGLE-style drafting from the target's own hidden states (``engine.decoding.draft_head``).

    State: the head's KV cache over pairs (h_i, x_{i+1}). Pairs built from the target's true features
    of committed positions stay valid for the whole run; pairs built while drafting (from the head's own
    ĥ and draft tokens) are cropped at the next ``propose`` (the head's KV rollback). Each round costs
    one head call over the pairs the target has verified since the last round plus k − 1 single-pair
    calls.

    q is the head's warped distribution over its ``vocab_ids`` (the same temperature/top-k/top-p as p),
    zero elsewhere: exactly the distribution each draft token is drawn from.

    ``confidence_threshold`` (0 = off, the default; settable, checked to be in [0, 1)) stops a round's
    draft early: a draft token whose top probability under the head (softmax of its logits, temperature
    1, whatever the sampling settings) is below the threshold is not proposed, nor anything after it
    (possibly nothing: the round is then a plain decoding step). A guess the target will likely reject
    costs a draft step and a longer target pass for little gain (EAGLE-2, Li et al. 2024, §4: the head's
    confidence approximates its acceptance rate; transformers' ``assistant_confidence_threshold``).
    Stopping depends only on the head's own state, so the output law is unchanged.
    """

    needs_target_hidden = True

    length_rule = None
    """An ``engine.decoding.draft_length.LengthRule`` (None: a fixed γ, the class default): each round drafts 0..k
    tokens, as many as the expected gain on this machine's costs pays for, judged from the head's confidence (max
    q before each draw) and its running acceptance; the round's ``Proposal.choice`` says how. Lossless as the
    confidence gate: the rule reads only the head's own state and earlier rounds."""

    def __init__(self, head, target: LoadedModel, name: str = "draft head", confidence_threshold: float = 0.0):
        self.confidence_threshold = confidence_threshold
        self.head = head
        self.target_vocab = output_vocab_size(target)
        self.vocab_ids = head.vocab_ids.cpu()
        self.target_lm: CachedLM | None = None
        self.name = name
        self.reset()

    @property
    def confidence_threshold(self) -> float:
        return self._confidence_threshold

    @confidence_threshold.setter
    def confidence_threshold(self, value: float) -> None:
        """Raises InputError outside [0, 1)."""
        if not 0.0 <= float(value) < 1.0:
            raise InputError(f"The draft confidence threshold must be in [0, 1), got {value}.")
        self._confidence_threshold = float(value)

    def attach(self, target_lm: CachedLM) -> None:
        if not target_lm.keep_hidden:
            raise ValueError("the target CachedLM must keep hidden states for a feature-head draft")
        self.target_lm = target_lm

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.n_true = 0  # pairs in the head's cache built from the target's true features
        self.last_true: torch.Tensor | None = None
        if self.length_rule is not None:
            self.length_rule.reset()

    def rollback(self, seq: list[int]) -> None:
        """The head's own KV rollback happens at the next ``propose`` (``_sync``); here the length rule, if any,
        learns how many of the round's tokens ``seq`` kept."""
        if self.length_rule is not None:
            self.length_rule.observe(seq)

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator) -> Proposal:
        # the head's calls in the batch-invariant layout (``compute.batch_invariant``): the bits ``propose_many``
        # gives this row when it drafts together with others
        with batch_invariant():
            return self._propose(seq, k, cfg, generator)

    def _propose(self, seq: list[int], k: int, cfg: SamplingConfig, generator: torch.Generator) -> Proposal:
        rule = self.length_rule
        synced = self._sync(seq) if k > 0 else None
        if synced is None:
            return Proposal([], torch.zeros(0, self.target_vocab),
                            choice=None if rule is None or k <= 0 else self._no_draft(seq))
        last, n_pairs = synced
        dev = last.device
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        gated = False
        if rule is not None:
            rule.start(k)
        for t in range(k):
            logits = self.head.logits(last[0, 0]).float().cpu()
            if self.confidence_threshold > 0 and \
                    float(torch.softmax(logits, -1).max()) < self.confidence_threshold:
                gated = True
                break  # a likely rejection: propose no more this round
            q_red = warp_probs(logits, cfg)
            if rule is not None and not rule.offer(float(q_red.max())):
                break  # one more token would not pay (engine.decoding.draft_length)
            j = argmax_rows(logits)[0] if cfg.greedy else draw_token(q_red, cfg, generator, len(seq) + t,
                                                                     self.vocab_ids)
            x = int(self.vocab_ids[j])
            q = torch.zeros(self.target_vocab)
            q[self.vocab_ids] = q_red
            tokens.append(x)
            rows.append(q)
            if t < k - 1:
                last = self.head(torch.tensor([[x]], device=dev), last,
                                 position_ids=torch.tensor([[n_pairs + t]], device=dev), cache=self.cache)
        return Proposal(tokens, torch.stack(rows) if rows else torch.zeros(0, self.target_vocab),
                        choice=None if rule is None else rule.finish(len(seq), tokens, "draft" if gated else None))

    def _no_draft(self, seq: list[int]):
        """The length rule's record of a round the head could not draft (no target features yet)."""
        self.length_rule.start(0)
        return self.length_rule.finish(len(seq), [], "draft")

    def _rollback(self, seq: list[int]) -> int | None:
        """The head's KV rollback: crop what it drafted last round (keep only pairs built from true features).
        Returns the number of true pairs the sequence has now (n_pairs; the pairs n_true..n_pairs − 1 are still
        to feed), or None when there are no target features yet."""
        if self.target_lm is None:
            raise ValueError("FeatureHeadProposer.attach(target_lm) was not called")
        hidden = self.target_lm.hidden
        n_pairs = min(len(seq) - 1, 0 if hidden is None else hidden.shape[0])
        if n_pairs <= 0:
            return None
        held = self.cache.get_seq_length()
        if self.n_true > n_pairs:  # the target's cache was reset/cropped below what we hold
            self.reset()
            held = 0
        if held > self.n_true:
            self.cache.crop(self.n_true - held)
        return n_pairs

    def _sync(self, seq: list[int]):
        """The head's KV rollback and catch-up: crop what it drafted last round, feed the pairs the target has
        verified since; (ĥ of the newest position [1, 1, H], number of true pairs), or None when there are
        no target features yet."""
        n_pairs = self._rollback(seq)
        if n_pairs is None:
            return None
        hidden = self.target_lm.hidden
        dev = hidden.device
        start = self.n_true
        if start < n_pairs:
            toks = torch.tensor([seq[start + 1:n_pairs + 1]], dtype=torch.long, device=dev)
            feats = hidden[start:n_pairs].unsqueeze(0)
            pos = torch.arange(start, n_pairs, device=dev).unsqueeze(0)
            out = self.head(toks, feats, position_ids=pos, cache=self.cache)
            self.n_true = n_pairs
            self.last_true = out[:, -1:]
        return self.last_true, n_pairs  # ĥ of the newest position, from true features only

    def batch_key(self):
        """Rows drafting with the same head object share its calls (``propose_many``)."""
        return ("feature-head", id(self.head))

    @staticmethod
    @torch.inference_mode()
    def propose_many(jobs: list[tuple["FeatureHeadProposer", list[int], int, SamplingConfig, torch.Generator]]
                     ) -> list[Proposal]:
        """``propose(seq, k, cfg, generator)`` of several sequences whose proposers share one head, with the
        head's calls batched across them: per pass one head call for every row's catch-up pairs (ragged,
        right-padded) and one per draft step, and one LM-head product per step, instead of a call per row
        each (the room's rows, ``engine.decoding.scheduler``).

        Each row's head KV cache is stacked into one batch cache for these calls (left-padded, padding and the
        other rows' entries masked out, per-row position ids: ``engine.decoding.attention``, as the target's
        pass in ``scheduler.Room._stacked``); afterwards each row's new entries go back to its own cache, so
        its state is what ``propose`` alone leaves. Each row draws from its own generator in the same order as
        ``propose`` (one draw per draft token under sampling), with its own k, settings and confidence gate.
        The head's calls run in the batch-invariant layout (``compute.batch_invariant``, each row's own cached
        columns), as ``propose`` does alone, so where the streaming kernel and the lean layers run, each row's q and
        ĥ are ``propose``'s bits (tests/test_scheduler.py); elsewhere they agree to rounding and a token differs only
        at a near tie (tests/test_proposers_batched.py). One job runs ``propose`` itself (bit-identical).

        Args:
            jobs: (proposer, seq, k, cfg, generator) per row; every proposer's ``head`` is the same object.

        Returns:
            one Proposal per job, in order.

        Raises:
            ValueError: proposers with different heads, or one not attached to its target.
        """
        if len(jobs) <= 1:
            return [p.propose(seq, k, cfg, g) for p, seq, k, cfg, g in jobs]
        head = jobs[0][0].head
        if any(p.head is not head for p, *_ in jobs):
            raise ValueError("propose_many needs proposers that share one head")
        from engine.decoding.attention import fed_visibility, model_mask, stack_left_padded

        out: list[Proposal | None] = [None] * len(jobs)
        rows = []  # (job index, n_pairs) of the rows that draft
        for i, (p, seq, k, cfg, g) in enumerate(jobs):
            n_pairs = p._rollback(seq) if k > 0 else None
            if n_pairs is None:
                out[i] = Proposal([], torch.zeros(0, p.target_vocab),
                                  choice=None if p.length_rule is None or k <= 0 else p._no_draft(seq))
            else:
                rows.append((i, n_pairs))
        if len(rows) == 1:
            i, _ = rows[0]
            p, seq, k, cfg, g = jobs[i]
            out[i] = p.propose(seq, k, cfg, g)
        if len(rows) <= 1:
            return out
        props = [jobs[i][0] for i, _ in rows]
        dev = props[0].target_lm.hidden.device
        b = len(rows)
        # the rows' caches, stacked (left-padded to the longest)
        lens = [p.cache.get_seq_length() for p in props]
        c_max = max(lens)
        # valid [b, columns]: which entries each row sees
        stacked, valid = stack_left_padded([[(layer.keys, layer.values) for layer in p.cache.layers] for p in props],
                                           lens)

        def call(tokens: list[list[int]], feats: torch.Tensor, pos: list[list[int]], real: torch.Tensor):
            nonlocal valid
            w = real.shape[1]
            causal = torch.ones(w, w, dtype=torch.bool).tril()
            new_vis = (causal[None] & real[:, None, :]) | torch.eye(w, dtype=torch.bool)[None]
            mask = model_mask(fed_visibility(new_vis, valid), head.body).to(dev)
            # each row's own cached columns and fed pairs: the bits ``propose`` alone gives it
            spans = [(valid[r].nonzero().squeeze(1).to(dev), int(real[r].sum())) for r in range(b)]
            with batch_invariant(spans, valid.shape[1]):
                h = head(torch.tensor(tokens, dtype=torch.long, device=dev), feats, attention_mask=mask,
                         position_ids=torch.tensor(pos, dtype=torch.long, device=dev), cache=stacked)
            valid = torch.cat([valid, real], dim=1)
            return h

        # catch-up: the pairs each row's target verified since its last round, one call for all rows
        hidden_size = props[0].target_lm.hidden.shape[-1]
        starts = [p.n_true for p in props]
        widths = [n - s for (_, n), s in zip(rows, starts)]
        last = torch.empty(b, hidden_size, dtype=props[0].target_lm.hidden.dtype, device=dev)
        new_true: list[torch.Tensor | None] = [None] * b
        width = max(widths)
        if width > 0:
            toks, pos = [], []
            feats = torch.zeros(b, width, hidden_size, dtype=last.dtype, device=dev)
            for r, ((i, n), s, w) in enumerate(zip(rows, starts, widths)):
                seq = jobs[i][1]
                toks.append(seq[s + 1:n + 1] + [0] * (width - w))
                pos.append(list(range(s, s + width)))
                if w:
                    feats[r, :w] = props[r].target_lm.hidden[s:n]
            real = torch.stack([torch.arange(width) < w for w in widths])
            h = call(toks, feats, pos, real)
            for r, w in enumerate(widths):
                if w:
                    new_true[r] = h[r:r + 1, w - 1:w]
        for r, p in enumerate(props):
            last[r] = (new_true[r] if new_true[r] is not None else p.last_true)[0, 0]
        # the draft steps: one LM-head product and (while any row goes on) one head call per step; the products at
        # any row count on the streaming kernel, as ``propose`` alone (``compute.batch_invariant``)
        with batch_invariant():
            tokens: list[list[int]] = [[] for _ in range(b)]
            qrows: list[list[torch.Tensor]] = [[] for _ in range(b)]
            going = [True] * b
            gated = [False] * b
            for r, (i, _) in enumerate(rows):  # each row's length rule, as ``propose`` alone runs it
                if props[r].length_rule is not None:
                    props[r].length_rule.start(jobs[i][2])
            for t in range(max(jobs[i][2] for i, _ in rows)):
                logits_all = head.logits(last).float().cpu()
                nxt = []
                for r, (i, n) in enumerate(rows):
                    p, _, k, cfg, g = jobs[i]
                    if not going[r] or t >= k:
                        going[r] = False
                        continue
                    logits = logits_all[r]
                    if (p.confidence_threshold > 0
                            and float(torch.softmax(logits, -1).max()) < p.confidence_threshold):
                        going[r] = False
                        gated[r] = True
                        continue
                    q_red = warp_probs(logits, cfg)
                    if p.length_rule is not None and not p.length_rule.offer(float(q_red.max())):
                        going[r] = False
                        continue
                    j = argmax_rows(logits)[0] if cfg.greedy else draw_token(q_red, cfg, g, len(jobs[i][1]) + t,
                                                                             p.vocab_ids)
                    x = int(p.vocab_ids[j])
                    q = torch.zeros(p.target_vocab)
                    q[p.vocab_ids] = q_red
                    tokens[r].append(x)
                    qrows[r].append(q)
                    if t < k - 1:
                        nxt.append(r)
                    else:
                        going[r] = False
                if not nxt:
                    break
                real = torch.zeros(b, 1, dtype=torch.bool)
                real[nxt] = True
                h = call([[tokens[r][-1] if real[r, 0] else 0] for r in range(b)], last[:, None],
                         [[rows[r][1] + t] for r in range(b)], real)
                for r in nxt:
                    last[r] = h[r, 0]
        # each row's new entries (its catch-up pairs, then its drafted pairs) back to its own cache
        new_cols = valid[:, c_max:]
        for r, p in enumerate(props):
            idx = new_cols[r].nonzero().squeeze(1) + c_max
            if idx.numel():
                idx = idx.to(dev)
                for li, layer in enumerate(stacked.layers):
                    p.cache.update(layer.keys[r:r + 1, :, idx], layer.values[r:r + 1, :, idx], li)
            if new_true[r] is not None:
                p.n_true = rows[r][1]
                p.last_true = new_true[r].clone()
            i = rows[r][0]
            choice = (None if p.length_rule is None else
                      p.length_rule.finish(len(jobs[i][1]), tokens[r], "draft" if gated[r] else None))
            out[i] = Proposal(tokens[r], torch.stack(qrows[r]) if qrows[r] else torch.zeros(0, p.target_vocab),
                              choice=choice)
        return out

    branching = 4
    """Tree drafts: top-k children per expanded node, and nodes expanded per depth (``set_branching``)."""

    def set_branching(self, k: int) -> None:
        """Raises InputError outside 1..``engine.decoding.tree.MAX_BRANCHING``."""
        self.branching = _check_branching(k)

    @torch.inference_mode()
    def propose_tree(self, seq: list[int], max_nodes: int, max_depth: int, cfg: SamplingConfig,
                     generator: torch.Generator) -> TokenTree:
        """EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2", §4.1 expansion, §4.2 reranking).

        Expansion: depth 1 holds the head's top-k tokens after the context (k = ``branching``). At each further
        depth the k nodes of the previous depth with the highest value V = Π of the head's probabilities along
        the path (its confidence, softmax at T = 1: EAGLE-2 §4 uses it as the estimate of the path's acceptance
        probability) are expanded, all k in ONE head call whose attention mask lets each see the true pairs, its
        own ancestors and itself (``attention.model_mask``), each into its top-k children. Reranking: of all
        drafted nodes the ``max_nodes`` with the highest V are kept (V never grows along a path, so the kept
        set contains every kept node's parent; ties go to the earlier node), in drafting order.

        The children are deterministic picks (rank, not a draw), under sampling too (under the drafter-invariant rule
        the rank of log q + g, the run's noise: ``add_children``): each q row is one-hot,
        which the lossless rule (``sampling.verify_tree_sampling``, draw "deterministic") needs; the head's own
        probabilities are in ``draft_probs``. The head's cache entries of the drafted nodes are cropped at
        the next round (``_sync``), as after a chain. ``confidence_threshold`` does not apply to trees.

        Returns:
            a ``TokenTree`` of at most ``max_nodes`` nodes and depth ≤ ``max_depth`` (empty before the first
            target features exist).
        """
        synced = self._sync(seq) if max_nodes > 0 and max_depth > 0 else None
        if synced is None:
            return empty_tree(self.target_vocab)
        last, n_pairs = synced
        from engine.decoding.attention import model_mask

        dev = last.device
        k = self.branching
        vocab = self.vocab_ids
        tokens: list[int] = []
        parents: list[int] = []
        depth: list[int] = []
        logv: list[float] = []  # log V: the path's summed log-probabilities under the head
        probs: list[float] = []
        slot: dict[int, int] = {}  # node → its entry in the head's cache (expanded nodes only)
        h_out: dict[int, torch.Tensor] = {-1: last[0, 0]}  # ĥ after a node (its children's distribution)

        vocab_list = vocab.tolist()

        def add_children(pars: list[int], h: torch.Tensor) -> None:
            """Each parent's top-k children from its row of ĥ ([len(pars), H]): one LM-head product for all. Under
            the drafter-invariant rule (``cfg.gumbel``) the k largest log q + g, g the run's noise at the children's
            position (Gumbel-top-k: k draws from q without replacement, the first the chain's proposal)."""
            logits = self.head.logits(h).float()
            lp = torch.log_softmax(logits, -1)
            kk = min(k, lp.shape[-1])
            if cfg is not None and cfg.gumbel:
                seed = noise_seed(generator)
                score = torch.stack([
                    torch.log(warp_probs(logits[r].double(), cfg))
                    + gumbel_noise(seed, len(seq) + (depth[par] if par >= 0 else 0), self.target_vocab)[vocab]
                    for r, par in enumerate(pars)])
                idx_t = torch.topk(score, kk, dim=-1).indices
                top = torch.return_types.topk((torch.gather(lp, 1, idx_t), idx_t))
            else:
                top = torch.topk(lp, kk, dim=-1)
            for par, vals, idx in zip(pars, top.values.tolist(), top.indices.tolist()):
                base = logv[par] if par >= 0 else 0.0
                for v, j in zip(vals, idx):
                    tokens.append(int(vocab_list[j]))
                    parents.append(par)
                    depth.append(1 if par < 0 else depth[par] + 1)
                    logv.append(base + v)
                    probs.append(math.exp(v))

        add_children([-1], h_out[-1][None])
        n_true = self.cache.get_seq_length()
        for d in range(2, max_depth + 1):
            layer = [i for i in range(len(tokens)) if depth[i] == d - 1]
            expand = sorted(sorted(layer, key=lambda i: (-logv[i], i))[:k])
            m = len(expand)
            held = self.cache.get_seq_length()
            # who each fed node sees: every true pair, its expanded ancestors' entries, itself
            vis = torch.zeros(m, held + m, dtype=torch.bool)
            vis[:, :n_true] = True
            for r, i in enumerate(expand):
                a = parents[i]
                while a >= 0:
                    vis[r, slot[a]] = True
                    a = parents[a]
                vis[r, held + r] = True
            mask = model_mask(vis[None], self.head.body).to(dev)
            toks = torch.tensor([[tokens[i] for i in expand]], dtype=torch.long, device=dev)
            feats = torch.stack([h_out[parents[i]] for i in expand])[None]
            pos = torch.full((1, m), n_pairs + d - 2, dtype=torch.long, device=dev)
            out = self.head(toks, feats, attention_mask=mask, position_ids=pos, cache=self.cache)[0]
            for r, i in enumerate(expand):
                slot[i] = held + r
                h_out[i] = out[r]
            add_children(expand, out)
        keep_set: set[int] = set()
        for i in sorted(range(len(tokens)), key=lambda i: (-logv[i], i)):
            if len(keep_set) >= max_nodes:
                break
            if parents[i] < 0 or parents[i] in keep_set:
                keep_set.add(i)
        keep = sorted(keep_set)
        new = {old: j for j, old in enumerate(keep)}
        kept_tokens = [tokens[i] for i in keep]
        q = torch.zeros(len(keep), self.target_vocab)
        q[torch.arange(len(keep)), torch.tensor(kept_tokens, dtype=torch.long)] = 1.0
        return TokenTree(kept_tokens, [new[parents[i]] if parents[i] >= 0 else -1 for i in keep], q,
                         "deterministic", [probs[i] for i in keep])


class PromptLookupProposer(Proposer):
    """Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.

    q is a point mass (1.0) on each proposed token, so under sampling a token x is accepted with
    probability p(x), and a rejection resamples from p with x removed (the residual max(0, p − δ_x)).

    ``min_ngram`` defaults to 2: single-token matches are mostly chat-template or punctuation
    coincidences that the target rejects, and each wasted proposal makes the target pass longer
    (measured on the embedded model, greedy γ=4: chat 0.83× → 0.99× of plain decoding, code edit
    1.09× → 1.18×).

    ``match`` picks among several earlier occurrences: "latest" (default; the most recent text is the
    likeliest to be copied next; a match that runs into the end of the text continues as an overlapping
    copy, so text that repeats with a short period is proposed k tokens at a time) or "first" (the
    earliest one with a continuation: the rule of transformers' ``PromptLookupCandidateGenerator``;
    with ``max_ngram=2, min_ngram=1`` this proposer then proposes exactly what transformers' prompt
    lookup does, which the benchmark uses for a like-for-like comparison).

    ``stop_ids`` (the target's EOS ids; ``make_proposer`` passes them): a copied continuation is cut
    before its first stop token, as transformers does. Copying across an end of turn (chat prompts hold
    several) proposes text after the answer would have ended: the target rejects it or generation stops,
    and either way the longer verify pass is wasted (measured: transformers' lookup was ~8 % faster on a
    code edit until this rule was added).

    Raises:
        InputError: unless 1 ≤ min_ngram ≤ max_ngram, or for another ``match``.
    """

    def __init__(self, target_vocab: int, max_ngram: int = 3, min_ngram: int = 2, adaptive: bool = False,
                 match: str = "latest", stop_ids=()):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError(f"Prompt lookup needs 1 ≤ min n-gram ≤ max n-gram, got {min_ngram}, {max_ngram}.")
        if match not in ("latest", "first"):
            raise InputError(f"Prompt lookup match must be 'latest' or 'first', got {match!r}.")
        self.target_vocab = target_vocab
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.adaptive = adaptive
        self.match = match
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.name = (f"prompt lookup (n-gram {min_ngram}–{max_ngram}{', first match' if match == 'first' else ''}"
                     f"{', adaptive length' if adaptive else ''})")
        self.reset()

    def reset(self) -> None:
        self.k_next: int | None = None  # adaptive proposal length (None: start at γ)
        self._last: tuple[int, int, list[int]] | None = None  # (len(seq), cap k, proposal) of the last round

    def rollback(self, seq: list[int]) -> None:
        """With ``adaptive``: after a fully accepted proposal propose 2 more next time, else 1 fewer
        (at least 1) — the schedule of transformers' assisted generation ("heuristic"), so a broken
        copy stops paying for long verify passes."""
        if not self.adaptive or self._last is None:
            return
        n, k, prop = self._last
        branches = prop if prop and isinstance(prop[0], list) else [prop]  # a tree round keeps its branches
        if any(branches):
            full = any(b and seq[n:n + len(b)] == b for b in branches)
            self.k_next = k + 2 if full else max(1, k - 1)
        self._last = None

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest (or first, see ``match``) earlier match of the longest
        suffix n-gram that has a continuation, cut before the first stop id (possibly to nothing)."""
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            suffix = seq[n_seq - n:]
            starts = range(n_seq - n - 1, -1, -1) if self.match == "latest" else range(n_seq - n)
            for start in starts:  # excluding the suffix itself
                if seq[start:start + n] == suffix:
                    cont = self._continuation(seq, n, start, k)
                    if cont is not None:
                        return cont
        return []

    def _continuation(self, seq: list[int], n: int, start: int, k: int) -> list[int] | None:
        """Up to k tokens after the match of length n at ``start``, cut before the first stop id; None when
        the match has no continuation."""
        n_seq = len(seq)
        cont = seq[start + n:start + n + k]
        if cont and self.match == "latest" and len(cont) < k:
            # the match runs into the end of the text: the text repeats with period
            # d = n_seq − n − start, so keep copying (an overlapping copy, as in LZ77) up to k
            # tokens; without it "a b a b" proposed only d tokens a round, never growing to γ
            src = start + n
            while len(cont) < k:
                i = src + len(cont)
                cont.append(seq[i] if i < n_seq else cont[i - n_seq])
        if not cont:
            return None
        for i, t in enumerate(cont):
            if t in self.stop_ids:
                return cont[:i]
        return cont

    def lookup_all(self, seq: list[int], k: int, max_matches: int) -> list[list[int]]:
        """Up to ``max_matches`` distinct non-empty continuations (each ≤ k tokens) of earlier matches of the
        suffix n-grams: longest n first, and for each n the matches in ``match`` order (latest first by
        default), each found as ``lookup`` finds its one. The first is ``lookup``'s continuation when that is
        not empty. A continuation that is a prefix of one already found adds nothing to a tree and is skipped."""
        n_seq = len(seq)
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            suffix = seq[n_seq - n:]
            starts = range(n_seq - n - 1, -1, -1) if self.match == "latest" else range(n_seq - n)
            for start in starts:
                if seq[start:start + n] != suffix:
                    continue
                cont = self._continuation(seq, n, start, k)
                if not cont or any(f[:len(cont)] == cont for f in found):
                    continue
                found = [f for f in found if cont[:len(f)] != f]  # a longer copy replaces its prefix
                found.append(cont)
                if len(found) >= max_matches:
                    return found
        return found

    branching = 4
    """Tree drafts: most distinct matches (branches) per round (``set_branching``)."""

    def set_branching(self, k: int) -> None:
        """Raises InputError outside 1..``engine.decoding.tree.MAX_BRANCHING``."""
        self.branching = _check_branching(k)

    def propose_tree(self, seq: list[int], max_nodes: int, max_depth: int, cfg: SamplingConfig,
                     generator: torch.Generator) -> TokenTree:
        """Prompt lookup with several matches as branches: up to ``branching`` distinct continuations of
        earlier matches (``lookup_all``, each ≤ max_depth tokens; with ``adaptive``, ≤ the adaptive length),
        merged into a trie (shared prefixes share nodes) of at most ``max_nodes`` nodes. Each node is a
        deterministic pick: its q row is one-hot (draw "deterministic")."""
        k = max_depth
        if self.adaptive and self.k_next is not None:
            k = min(k, self.k_next)
        conts = self.lookup_all(seq, k, self.branching) if k > 0 and max_nodes > 0 else []
        tokens: list[int] = []
        parents: list[int] = []
        child_of: dict[tuple[int, int], int] = {}
        for cont in conts:
            node = -1
            for t in cont:
                nxt = child_of.get((node, t))
                if nxt is None:
                    if len(tokens) >= max_nodes:
                        break
                    nxt = len(tokens)
                    tokens.append(t)
                    parents.append(node)
                    child_of[(node, t)] = nxt
                node = nxt
        self._last = (len(seq), k, conts)
        q = torch.zeros(len(tokens), self.target_vocab)
        q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
        return TokenTree(tokens, parents, q, "deterministic")

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator) -> Proposal:
        if self.adaptive and self.k_next is not None:
            k = min(k, self.k_next)
        tokens = self.lookup(seq, k) if k > 0 else []
        self._last = (len(seq), k, list(tokens))
        q = torch.zeros(len(tokens), self.target_vocab)
        for i, t in enumerate(tokens):
            q[i, t] = 1.0
        return Proposal(tokens, q, point_mass=True)
