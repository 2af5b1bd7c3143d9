"""Batched decoding: B sequences (different prompts) decoded together, plain or speculative, with ONE target
pass per round for the whole batch; the batch sweep built on it; the machine's measured bandwidth and FLOP/s.

How a ragged batch is kept (in spirit, what serving engines do with per-row lengths and masks):

- One transformers ``DynamicCache`` of shape [B, heads, C, d] holds every row. ``valid[b, j]`` says whether
  physical cache column j is part of row b's sequence. Prompts of different lengths are **left-padded** in the
  prefill (the padding columns are invalid); a pass feeds each row its uncached token (the last round's
  correction or bonus token) plus its k_b draft tokens, right-padded to the longest row; padding and the draft
  tokens a row rejects stay in the cache as **holes** (invalid columns), so no row is ever re-run and no
  other row is disturbed. Columns at the end that no row uses are cropped; finished rows leave the batch
  (``DynamicCache.batch_select_indices``).
- Which cached positions a fed token sees is the one shared mechanism of ``engine.decoding.attention``:
  ``fed_visibility(causal-within-the-row, valid)`` turned into the model's 4D mask by ``model_mask``, with
  explicit per-row ``position_ids`` (a row's logical length, which skips its holes). When a pass has no hole,
  no padding and equal rows (always the case at B = 1: a single row's rejected tail is cropped, as the
  single-sequence engine does) no mask is passed at all, so B = 1 runs exactly the operations of
  ``engine.decoding.speculative.SpeculativeDecoder`` (prefilled first) and gives bit-identical logits.
- The acceptance rules are the single-sequence engine's (``sampling.verify_greedy`` / ``verify_chain``: the
  standard rule or the drafter-invariant "gumbel" one), applied per row with each row's own random generator (seed
  + row index; under "gumbel" that seed keys the row's noise), so each row keeps its distribution. Drafts are the
  existing proposers, one instance per row: prompt lookup (no model), the EAGLE-style draft head (its own small
  pass **per row** — not batched yet — reading the row's target features from the batched pass), a draft model or
  early exit (their own passes per row, also not batched).
  Only the target's pass is batched: that is the pass the sweep is about.

Each row gets ``Round`` records and ``RunStats`` like a single-sequence run: ``verify_ms`` of a round is the
time of the whole batch's shared pass, ``tokens_verified`` the row's own real tokens in it; the batch's own
totals (tokens/s, target passes, tokens per pass with padding) are in ``BatchResult``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from engine.decoding.attention import fed_visibility, model_mask, stack_left_padded
from engine.decoding.compute import batch_invariant
from engine.decoding.models import LoadedModel
from engine.decoding.proposers import FeatureHeadProposer, Proposal, Proposer
from engine.decoding.sampling import MAX_GAMMA, SamplingConfig, argmax_rows, verify_chain, verify_greedy, warp_probs
from engine.decoding.speculative import MAX_NEW_TOKENS, GenerationResult, _TokenText, chain_positions, encode_prompt
from engine.decoding.trace import Round, run_stats
from engine.errors import InputError

MAX_BATCH = 4096
PACK_TOKENS = 2048
"""Most prompt tokens packed into one prefill pass (its block-diagonal mask is PACK_TOKENS² entries)."""
"""The largest batch any function here accepts (memory is checked too: ``check_batch_memory``)."""

MEMORY_SHARE = 0.8
"""A batch is refused when its estimated KV cache + activations exceed this share of the free memory."""


# ------------------------------------------------------------------------------------------ memory


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak memory of a batched run (bytes).

    Attributes:
        kv_cache: 2 (K and V) · layers · KV heads · head dim · bytes per value · B · C, with C = longest
            prompt + max_new_tokens · (γ + 1) cache columns (the worst case: every round keeps one token and
            leaves γ holes).
        activations: one pass's transient tensors: logits B · Q · V · 4 bytes (fp32) plus one layer's
            hidden/MLP/attention-score tensors, Q = the widest pass (the prefill's longest prompt, or γ + 1).
        available: free memory of the device (CUDA: ``torch.cuda.mem_get_info``; CPU: MemAvailable of
            /proc/meminfo), in bytes.
    """

    kv_cache: int
    activations: int
    available: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= MEMORY_SHARE * self.available


def weight_bytes_per_param(target: LoadedModel) -> float:
    """The bytes a decode pass of ``target`` reads per weight: on the "stream" path the linear layers' bytes as
    read (their exact compact forms, GGUF blocks for the embedded model: ``compute.weight_formats``) over their
    parameters, else the parameters' element size (4 for fp32). The roofline's weight bytes (``analytic.
    roofline_step_s``): priced at fp32, the embedded model's floor was 538 MB ÷ bandwidth, above the passes
    measured while it reads 111 MB."""
    c = target.compute
    f = c.formats if c is not None and c.path == "stream" else None
    if f and f.get("read_bytes") and f.get("fp32_bytes"):
        return float(f["read_bytes"]) / (float(f["fp32_bytes"]) / 4.0)
    p = next(target.model.parameters(), None)
    return float(p.element_size()) if p is not None else 4.0


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` in bytes (CUDA: free device memory; CPU: MemAvailable, else free pages)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def estimate_batch_memory(target: LoadedModel, batch: int, prompt_len: int, max_new_tokens: int, gamma: int,
                          available: int | None = None) -> MemoryEstimate:
    """Estimate the KV cache and activation memory of decoding ``batch`` rows (see ``MemoryEstimate``).

    Args:
        batch: rows B. prompt_len: the longest prompt (tokens). max_new_tokens: per row. gamma: γ (0: plain).
        available: bytes free (default: measured with ``available_memory_bytes``).
    """
    cfg = target.config
    layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    hidden = int(getattr(cfg, "hidden_size", 1) or 1)
    kv_heads = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or max(hidden // heads, 1))
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden)
    try:
        p = next(target.model.parameters())
        elt = p.element_size()
    except StopIteration:
        elt = 4
    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    cols = prompt_len + max_new_tokens * (gamma + 1)
    kv = 2 * layers * kv_heads * head_dim * elt * batch * cols
    q = max(prompt_len, gamma + 1)
    act = batch * q * (vocab * 4 + (3 * inter + 4 * hidden) * elt) + batch * heads * q * cols * 4
    if available is None:
        available = available_memory_bytes(target.device)
    return MemoryEstimate(kv_cache=int(kv), activations=int(act), available=int(available))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_batch_size(batch) -> int:
    """A batch size as an int in 1..MAX_BATCH.

    Raises:
        InputError: for 0, a negative number, a non-integer or more than ``MAX_BATCH``.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"A batch needs at least one sequence: batch size must be a whole number ≥ 1, got {batch!r}.")
    if batch > MAX_BATCH:
        raise InputError(f"Batch size {batch:,} is above the largest this engine runs ({MAX_BATCH:,}).")
    return batch


def check_batch_memory(target: LoadedModel, batch: int, prompt_len: int, max_new_tokens: int, gamma: int,
                       available: int | None = None) -> MemoryEstimate:
    """Refuse a batch whose estimated memory (``estimate_batch_memory``) exceeds ``MEMORY_SHARE`` of the free
    memory.

    Raises:
        InputError: naming the estimate, the free memory and the largest batch that fits.
    """
    est = estimate_batch_memory(target, batch, prompt_len, max_new_tokens, gamma, available)
    if not est.fits:
        per_row = est.total / batch
        largest = int(MEMORY_SHARE * est.available // per_row) if per_row > 0 else 0
        raise InputError(
            f"Batch {batch:,} does not fit in memory: its KV cache ({_gib(est.kv_cache)}) and activations "
            f"({_gib(est.activations)}) come to about {_gib(est.total)}, more than {MEMORY_SHARE:.0%} of the "
            f"{_gib(est.available)} free on {target.device.type}. The largest batch that fits these settings "
            f"is about {largest:,}.")
    return est


# ------------------------------------------------------------------------------------------ the decoder


class _RowFeatures:
    """What a draft head reads from the target for one row: ``hidden`` [cached_len, H] (the row's own
    features, in its logical order, holes left out). Quacks like the ``CachedLM`` it gets alone."""

    keep_hidden = True

    def __init__(self, row: "_Row"):
        self.row = row

    @property
    def hidden(self) -> torch.Tensor | None:
        return self.row.hidden

    @property
    def cached_len(self) -> int:
        return self.row.cached_n

    @property
    def ids(self) -> list[int]:
        """The row's cached tokens, in logical order."""
        return self.row.seq[:self.row.cached_n]

    @property
    def last_logits(self) -> torch.Tensor | None:
        """[V] the target's logits at the row's last cached position while the row's whole sequence is cached
        (right after the prefill; Medusa heads draft their first round from it), else None."""
        return self.row.last_logits if self.row.cached_n == len(self.row.seq) else None


@dataclass
class DecisiveLogits:
    """The target's top-2 logits at the position that decided one emitted token (for near-tie checks)."""

    ids: list[int]
    logits: list[float]


class _Row:
    def __init__(self, index: int, prompt_ids: list[int], proposer: Proposer | None, seed: int):
        self.index = index
        self.prompt_ids = list(prompt_ids)
        self.seq = list(prompt_ids)
        self.proposer = proposer
        self.generator = torch.Generator().manual_seed(seed)
        self.rounds: list[Round] = []
        self.cached_n = 0                       # tokens of seq held in the batch cache (valid columns)
        self.last_logits: torch.Tensor | None = None  # [V] at the last cached position (used after prefill)
        self.hidden: torch.Tensor | None = None  # [cached_n, H] when a draft head reads the target's features
        self.finished = False
        self.stop_reason: str | None = None
        self.elapsed_ms = 0.0
        self.decisive: list[DecisiveLogits] = []

    @property
    def new_ids(self) -> list[int]:
        return self.seq[len(self.prompt_ids):]


@dataclass
class BatchPass:
    """One target pass over the batch.

    Attributes:
        rows: rows in the pass (finished rows have left). width: tokens per row, padded (Q).
        tokens: rows · width, the tokens the target processes (padding included): B·(γ + 1) for a full
            speculative round, B for plain decoding.
        real_tokens: tokens that are not padding. ms: wall time of the pass. prefill: the prompts' pass (one
            record for all prompts; computed one prompt at a time when their lengths differ, no padding).
    """

    rows: int
    width: int
    tokens: int
    real_tokens: int
    ms: float
    prefill: bool = False


@dataclass
class BatchResult:
    """A finished batch: one ``GenerationResult`` per row (in prompt order) and the batch's totals.

    Attributes:
        results: per row, as the single-sequence engine gives it (text, token_ids, rounds, stats; a row's
            total_ms is the batch's wall time until that row finished).
        passes: every target pass (``BatchPass``), the prefill first.
        total_ms: wall time of the whole batch (prefill included). prefill_ms: the prefill pass.
        new_tokens: tokens generated, all rows. tokens_per_s: new_tokens ÷ total time (the batch's
            throughput). target_passes: len(passes), the prefill included.
        stopped: ``should_stop`` ended the run before every row finished.
    """

    results: list[GenerationResult]
    passes: list[BatchPass]
    total_ms: float
    prefill_ms: float
    method: str
    gamma: int
    stopped: bool = False

    @property
    def new_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    @property
    def target_passes(self) -> int:
        return len(self.passes)

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / (self.total_ms / 1000) if self.total_ms > 0 else None

    def totals(self) -> dict:
        """The batch's totals as a JSON-ready dict."""
        decode = [p for p in self.passes if not p.prefill]
        return {"batch": len(self.results), "method": self.method, "gamma": self.gamma or None,
                "new_tokens": self.new_tokens, "total_ms": self.total_ms, "prefill_ms": self.prefill_ms,
                "tokens_per_s": self.tokens_per_s, "target_passes": self.target_passes,
                "tokens_per_target_pass": self.new_tokens / len(decode) if decode else None,
                "pass_tokens_median": statistics.median(p.tokens for p in decode) if decode else None,
                "pass_ms_median": statistics.median(p.ms for p in decode) if decode else None,
                "stopped": self.stopped}

    def to_dict(self) -> dict:
        return {"results": [r.to_dict() for r in self.results], "batch": self.totals()}


class BatchDecoder:
    """B sequences decoded together, plain (no proposers) or speculative, one target pass per round.

    Args:
        target: the target model (its attention must take a custom 4D mask: SDPA or eager).
        proposers: None (plain decoding) or one distinct proposer per row (the same kind for every row).
        prompts_ids: B prompts' token ids (``encode_prompt``); different lengths are fine.
        gamma: γ per round (1..64; ignored for plain decoding).
        sampling: as in ``SpeculativeDecoder``; every row uses it.
        seed: row b's generator is seeded ``seed + b`` (so row 0 of a batch of one is the single run).
        max_new_tokens: per row. stop_on_eos: a row stops after the target's EOS (kept in its output).
        record_logits: keep the target's top-2 logits for each emitted token (``DecisiveLogits``).
        available_memory: bytes free, to override the measured value in ``check_batch_memory``.

    Raises:
        InputError: no prompt, an empty prompt, a batch out of range or too large for memory, proposers of
            the wrong number or shared between rows, γ or max_new_tokens out of range, a prompt too long.
    """

    def __init__(self, target: LoadedModel, proposers: Sequence[Proposer | None] | None,
                 prompts_ids: Sequence[list[int]], gamma: int = 4, sampling: SamplingConfig | None = None,
                 seed: int = 0, max_new_tokens: int = 64, stop_on_eos: bool = True, record_logits: bool = True,
                 available_memory: int | None = None):
        prompts_ids = [list(p) for p in prompts_ids]
        if not prompts_ids:
            raise InputError("A batch needs at least one prompt (batch size 0 was asked for).")
        b = check_batch_size(len(prompts_ids))
        if any(not p for p in prompts_ids):
            raise InputError("One of the batch's prompts is empty: type something for the model to continue.")
        if proposers is not None:
            proposers = list(proposers)
            if all(p is None for p in proposers):
                proposers = None
        if proposers is not None:
            if len(proposers) != b:
                raise InputError(f"A speculative batch needs one proposer per row: {len(proposers)} for {b} prompts.")
            if any(p is None for p in proposers) or len({id(p) for p in proposers}) != b:
                raise InputError("Each row of a speculative batch needs a proposer of its own (they keep state).")
            if not (isinstance(gamma, int) and 1 <= gamma <= MAX_GAMMA):
                raise InputError(f"γ (draft tokens per round) must be a whole number from 1 to {MAX_GAMMA}, got {gamma}.")
        if not (isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= MAX_NEW_TOKENS):
            raise InputError(f"max new tokens must be from 1 to {MAX_NEW_TOKENS}, got {max_new_tokens}.")
        longest = max(len(p) for p in prompts_ids)
        if longest + max_new_tokens > target.max_context:
            raise InputError(
                f"The longest prompt is {longest} tokens; with {max_new_tokens} new tokens that exceeds the "
                f"model's context of {target.max_context} tokens. Shorten the prompt or the output.")
        self.gamma = gamma if proposers is not None else 0
        self.memory = check_batch_memory(target, b, longest, max_new_tokens, self.gamma, available_memory)
        self.target = target
        self.sampling = sampling or SamplingConfig()
        self.max_new_tokens = max_new_tokens
        self.eos = target.eos_token_ids if stop_on_eos else set()
        self.record_logits = record_logits
        self.rows = [_Row(i, p, None if proposers is None else proposers[i], seed + i)
                     for i, p in enumerate(prompts_ids)]
        self.keep_hidden = proposers is not None and any(
            getattr(p, "needs_target_hidden", False) for p in proposers)
        if self.keep_hidden:
            for row in self.rows:
                row.proposer.attach(_RowFeatures(row))
        self.method = "plain" if proposers is None else getattr(proposers[0], "name", "speculative")
        tok = target.tokenizer
        pad = getattr(tok, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (getattr(tok, "eos_token_id", None) or 0))
        self.text = _TokenText(tok)
        self.passes: list[BatchPass] = []
        self.prefill_ms = 0.0
        self.elapsed_ms = 0.0
        self.stopped = False
        self._prefilled = False
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [active rows, cache columns]
        self.active: list[int] = []                      # row index of each batch slot of the cache

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.rows)

    # ---------------------------------------------------------------- the target pass
    @torch.inference_mode()
    def _forward(self, inp: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None,
                 n_logits: int, cache=None, spans: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass (into ``cache``, default the batch's); returns ([rows, n_logits, V] float32 logits of
        the last n fed positions on the CPU, [rows, Q, H] hidden states when a draft head reads them). The
        operations are those of ``proposers.CachedLM._feed`` (which the single-sequence engine runs).

        ``spans``: each row's (its cached key columns: a LongTensor, or an int start of [start, cache length); its fed
        tokens) for a pass of several rows on the batch-invariant layout (``compute.batch_invariant``), where it is
        on offer (``_invariant_rows``): each row then gets the bits of its lone pass, whatever its neighbours."""
        cache = self.cache if cache is None else cache
        model = self.target.model
        dev = self.target.device
        inp = inp.to(dev)
        kw = {}
        if mask is not None:
            kw["attention_mask"] = mask.to(dev)
        if pos is not None:
            kw["position_ids"] = pos.to(dev)
        # one sequence: the batch-invariant layout, as ``CachedLM._feed`` runs it (a prefill too); several rows with
        # their spans: the same layout, each row from its own keys
        lone = inp.shape[0] == 1 and mask is None
        if spans is not None and self._invariant_rows():
            layout = batch_invariant(spans, cache.get_seq_length())
        else:
            layout = batch_invariant() if lone else contextlib.nullcontext()
        with layout:
            if self.keep_hidden:
                h = model.get_decoder()(input_ids=inp, cache=cache, use_cache=True, **kw).last_hidden_state
                logits = model.get_output_embeddings()(h[:, -n_logits:]).float()
                return logits.cpu(), h
            out = model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=n_logits, **kw)
            return out.logits[:, -n_logits:].float().cpu(), None

    def _invariant_rows(self) -> bool:
        """Whether a pass of several rows runs on the batch-invariant layout: on the CPU in fp32 with this project's
        attention kernel built (``compute.invariant_attention``), as the room's passes. Why: the int8 arithmetic rounds
        each activation to an 8-bit step, so a last-bit difference between a row batched and alone (another attention
        order) could part their texts at once; here every row gets its lone bits."""
        from engine.decoding.compute import extension

        return (self.target.device.type == "cpu" and extension._STREAM.get("attention") is not None
                and next(self.target.model.parameters()).dtype == torch.float32)

    def _mask(self, new_visible: torch.Tensor, cached_valid: torch.Tensor) -> torch.Tensor:
        return model_mask(fed_visibility(new_visible, cached_valid), self.target.model)

    def prefill(self) -> None:
        """The prompts' pass. Prompts of one length: all rows in one pass. Prompts of different lengths: packed
        without padding, as serving engines pack prefills (vLLM's variable-length batches): consecutive prompts
        go end to end into one sequence of at most ``PACK_TOKENS`` tokens, a block-diagonal causal mask keeps
        each prompt to itself and each prompt's positions start at 0; the KV entries are then cut per prompt and
        stacked left-padded into the batch cache (padding marked invalid). Why: a prefill is compute-bound, so
        padding to the longest prompt costs its share of FLOPs, and one pass per prompt runs small inefficient
        products (measured on the AMD EPYC, 16 sweep prompts of 34–81 tokens: 1296 padded positions for 752 real
        ones). Idempotent."""
        if self._prefilled:
            return
        t0 = time.perf_counter()
        rows = self.rows
        lens = [len(r.prompt_ids) for r in rows]
        width = max(lens)
        col = torch.arange(width)
        key_valid = torch.stack([col >= width - n for n in lens])  # [B, width]
        for r in rows:
            if r.proposer is not None:
                r.proposer.reset()
        if len(rows) > 1 and self._invariant_rows():  # each prompt alone: its lone bits (see _invariant_rows)
            self._lone_prefills(lens)
        elif all(n == width for n in lens):  # no padding: the model's own causal mask, as a single prompt gets
            logits, h = self._forward(torch.tensor([r.prompt_ids for r in rows], dtype=torch.long), None, None, 1)
            for b, r in enumerate(rows):
                r.last_logits = logits[b, -1]
                if h is not None:
                    r.hidden = h[b]
        else:
            self._packed_prefill(lens, width)
        for r, n in zip(rows, lens):
            r.cached_n = n
        self.valid = key_valid
        self.active = list(range(len(rows)))
        self.prefill_ms = (time.perf_counter() - t0) * 1000
        self.elapsed_ms += self.prefill_ms
        self.passes.append(BatchPass(len(rows), width, sum(lens), sum(lens), self.prefill_ms, True))
        self._prefilled = True

    def _lone_prefills(self, lens: list[int]) -> None:
        """Prefill each prompt in a pass of its own on the batch-invariant layout (``_forward``: its lone bits, as a
        single sequence's prefill) and stack their KV entries left-padded into the batch cache."""
        from transformers import DynamicCache

        per_row = []
        for r in self.rows:
            cache = DynamicCache()
            logits, h = self._forward(torch.tensor([r.prompt_ids], dtype=torch.long), None, None, 1, cache=cache)
            r.last_logits = logits[0, -1]
            if h is not None:
                r.hidden = h[0]
            per_row.append([(layer.keys, layer.values) for layer in cache.layers])
        self.cache, _ = stack_left_padded(per_row, lens)

    def _packed_prefill(self, lens: list[int], width: int) -> None:
        """Prefill prompts of different lengths packed end to end (see ``prefill``) and fill the batch cache."""
        from transformers import DynamicCache

        groups: list[list[int]] = [[]]
        for b, n in enumerate(lens):  # consecutive prompts, at most PACK_TOKENS per pass (a long one alone)
            if groups[-1] and sum(lens[i] for i in groups[-1]) + n > PACK_TOKENS:
                groups.append([])
            groups[-1].append(b)
        per_row: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in lens]
        for group in groups:
            ids = [t for b in group for t in self.rows[b].prompt_ids]
            total = len(ids)
            seg = torch.tensor([i for i, b in enumerate(group) for _ in range(lens[b])])
            pos = torch.tensor([[j for b in group for j in range(lens[b])]], dtype=torch.long)
            ends = list(itertools.accumulate(lens[b] for b in group))
            if len(group) == 1:
                mask = pos = None  # one prompt: exactly what a single sequence runs
            else:
                causal = torch.ones(total, total, dtype=torch.bool).tril()
                vis = causal & (seg[:, None] == seg[None, :])
                mask = self._mask(vis[None], torch.zeros(1, 0, dtype=torch.bool))
            cache = DynamicCache()
            model, dev = self.target.model, self.target.device
            kw = {} if mask is None else {"attention_mask": mask.to(dev), "position_ids": pos.to(dev)}
            inp = torch.tensor([ids], dtype=torch.long, device=dev)
            last = [e - 1 for e in ends]
            with torch.inference_mode():
                if hasattr(model, "get_decoder"):
                    h = model.get_decoder()(input_ids=inp, cache=cache, use_cache=True, **kw).last_hidden_state
                    # the LM head only where a prompt ends (the logits of its next token)
                    logits = model.get_output_embeddings()(h[0, last]).float().cpu()
                else:  # a model without a separate decoder (the tests' toy LMs): all logits, then those
                    h = None
                    logits = model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=total,
                                   **kw).logits[0, last].float().cpu()
            for i, b in enumerate(group):
                lo, hi = ends[i] - lens[b], ends[i]
                r = self.rows[b]
                r.last_logits = logits[i]
                if self.keep_hidden and h is not None:
                    r.hidden = h[0, lo:hi]
                per_row[b] = [(layer.keys[:, :, lo:hi], layer.values[:, :, lo:hi]) for layer in cache.layers]
        self.cache, _ = stack_left_padded(per_row, lens)

    # ---------------------------------------------------------------- one round
    def step(self) -> list[Round]:
        """One round for every unfinished row: each drafts (its own proposer), then ONE target pass verifies
        all rows' tokens, each row judges its own (the single-sequence rules) and emits. Returns the rounds
        recorded (one per row that took part, in row order).

        Raises:
            InputError: if every row has finished.
        """
        if self.finished:
            raise InputError("This batch is finished; start a new one to generate again.")
        self.prefill()  # timed on its own (``prefill_ms``, already in ``elapsed_ms``): not part of this round
        t_round = time.perf_counter()
        cfg = self.sampling
        slots = list(range(len(self.active)))
        rows = [self.rows[i] for i in self.active]
        drafts, qs, masses, draft_ms, fed = [], [], [], [], []
        # 1. draft: rows whose proposers share one EAGLE-style head in one batched call per draft step
        # (``FeatureHeadProposer.propose_many``, as the room does), any other row by itself
        ks = [min(self.gamma, self.max_new_tokens - len(r.new_ids) - 1) for r in rows]
        together = [s for s, r in enumerate(rows) if ks[s] > 0 and isinstance(r.proposer, FeatureHeadProposer)]
        shared: dict[int, Proposal] = {}
        if len(together) > 1 and len({id(rows[s].proposer.head) for s in together}) == 1:
            t0 = time.perf_counter()
            props = FeatureHeadProposer.propose_many([(rows[s].proposer, rows[s].seq, ks[s], cfg, rows[s].generator)
                                                      for s in together])
            each_ms = (time.perf_counter() - t0) * 1000 / len(together)
            shared = dict(zip(together, props))
        for s, r in enumerate(rows):
            k_max = ks[s]
            t0 = time.perf_counter()
            if r.proposer is not None and k_max > 0:
                prop = shared[s] if s in shared else r.proposer.propose(r.seq, k_max, cfg, r.generator)
                d, q, pm = prop.tokens[:k_max], prop.q[:k_max], prop.point_mass
            else:
                d, q, pm = [], torch.zeros(0), False
            draft_ms.append(each_ms if s in shared else (time.perf_counter() - t0) * 1000)
            drafts.append(d)
            qs.append(q)
            masses.append(pm)
            fed.append(r.seq[r.cached_n:] + d)  # the uncached token (none right after the prefill) + drafts
        # 2. one target pass over every row's fed tokens
        t0 = time.perf_counter()
        widths = [len(f) for f in fed]
        width = max(widths)
        logits = h = None
        if width > 0:
            inp = torch.tensor([f + [self.pad_id] * (width - len(f)) for f in fed], dtype=torch.long)
            if bool(self.valid.all()) and all(w == width for w in widths):
                mask = pos = None  # no hole, no padding: what a lone sequence runs (B = 1 always is)
            else:
                causal = torch.ones(width, width, dtype=torch.bool).tril()
                real = torch.stack([torch.arange(width) < w for w in widths])  # [rows, width]
                new_vis = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]
                mask = self._mask(new_vis, self.valid)
                pos = torch.tensor([[r.cached_n + i for i in range(width)] for r in rows], dtype=torch.long)
            # each row's cached keys and fed tokens, for the batch-invariant layout (``_forward``)
            spans = ([(self.valid[s].nonzero().flatten(), w) for s, w in enumerate(widths)]
                     if len(rows) > 1 else None)
            if spans is not None and pos is None:
                pos = torch.tensor([[r.cached_n + i for i in range(width)] for r in rows], dtype=torch.long)
            logits, h = self._forward(inp, mask, pos, width, spans=spans)
        pass_ms = (time.perf_counter() - t0) * 1000
        if width > 0:
            self.passes.append(BatchPass(len(rows), width, len(rows) * width, sum(widths), pass_ms))
        # 3. judge and emit, row by row
        new_cols = torch.zeros(len(rows), width, dtype=torch.bool)
        out: list[Round] = []
        for s, r in zip(slots, rows):
            d, k = drafts[s], len(drafts[s])
            n_pending = widths[s] - k
            if n_pending == 0:  # right after the prefill: p of the first position came with it
                p_logits = torch.cat([r.last_logits[None], logits[s, :k]]) if k else r.last_logits[None]
            else:
                p_logits = logits[s, :widths[s]]
            p = warp_probs(p_logits.double() if not cfg.greedy else p_logits, cfg)
            if cfg.greedy:
                verdict = verify_greedy(d, argmax_rows(p_logits))
            else:
                verdict = verify_chain(d, qs[s], p, cfg, r.generator, len(r.seq))
            remaining = self.max_new_tokens - len(r.new_ids)
            emitted = d[:verdict.n_accepted] + [verdict.next_token]
            stop_reason = None
            for i, t in enumerate(emitted):
                if t in self.eos:
                    emitted, stop_reason = emitted[:i + 1], "eos"
                    break
            if len(emitted) >= remaining:
                emitted = emitted[:remaining]
                stop_reason = stop_reason or "max_new_tokens"
            if self.record_logits:
                vals, ids = torch.topk(p_logits[:len(emitted)], min(2, p_logits.shape[-1]), dim=-1)
                r.decisive += [DecisiveLogits(i_.tolist(), v_.tolist()) for i_, v_ in zip(ids, vals)]
            context_len = len(r.seq)
            r.seq.extend(emitted)
            n_kept = min(verdict.n_accepted, len(emitted))
            kept = n_pending + n_kept  # fed tokens that stay in the row's cache (the KV rollback keeps them)
            new_cols[s, :kept] = True
            if h is not None and kept:
                r.hidden = torch.cat([r.hidden, h[s, :kept]])
            r.cached_n += kept
            if r.proposer is not None:
                r.proposer.rollback(r.seq)
            rnd = self._round_record(r, d, qs[s], masses[s], p, verdict, n_kept, emitted, context_len,
                                     draft_ms[s], pass_ms if widths[s] else 0.0, widths[s], stop_reason)
            r.rounds.append(rnd)
            out.append(rnd)
            if stop_reason:
                r.finished, r.stop_reason = True, stop_reason
        # 4. the cache: new columns (holes where a row rejected or was padded), drop what nobody uses
        if width > 0:
            self.valid = torch.cat([self.valid, new_cols], dim=1)
        self._compact()
        self.elapsed_ms += (time.perf_counter() - t_round) * 1000
        for r in rows:
            if r.finished and not r.elapsed_ms:
                r.elapsed_ms = self.elapsed_ms
        return out

    def _compact(self) -> None:
        """Crop trailing columns no row uses (at B = 1: exactly the single engine's KV rollback) and let
        finished rows leave the batch."""
        keep = [s for s, i in enumerate(self.active) if not self.rows[i].finished]
        if len(keep) < len(self.active):
            if keep and self.cache.get_seq_length() > 0:
                self.cache.batch_select_indices(torch.tensor(keep, device=self.target.device))
            self.valid = self.valid[keep]
            self.active = [self.active[s] for s in keep]
        if not self.active:
            return
        used = self.valid.any(dim=0)
        n_cols = self.valid.shape[1]
        trailing = n_cols - (int(used.nonzero().max()) + 1 if used.any() else 0)
        if trailing > 0:
            if self.cache.get_seq_length() > 0:
                self.cache.crop(-trailing)
            self.valid = self.valid[:, :n_cols - trailing]

    def _round_record(self, r: _Row, draft, q, point_mass, p, verdict, n_kept, emitted, context_len, draft_ms,
                      verify_ms, tokens_verified, stop_reason) -> Round:
        """The row's ``Round`` record, built exactly as ``SpeculativeDecoder`` builds it."""
        text = self.text
        k = len(draft)
        top_p = text.top_rows(p)
        positions = chain_positions(text, draft, q, point_mass, p, verdict, n_kept, top_p)
        return Round(
            index=len(r.rounds), context_len=context_len, drafted=positions, n_accepted=n_kept,
            next_token_id=verdict.next_token, next_text=text(verdict.next_token),
            next_kind=verdict.next_kind if k > 0 else "plain", next_top_p=top_p[verdict.n_accepted],
            residual_top=text.top(verdict.residual) if verdict.residual is not None else None,
            emitted_ids=emitted, draft_ms=draft_ms, verify_ms=verify_ms, tokens_verified=tokens_verified,
            prefill_tokens=0, stop_reason=stop_reason)

    # ---------------------------------------------------------------- the whole run
    def run(self, should_stop: Callable[[], bool] | None = None) -> BatchResult:
        """Step until every row finished (or ``should_stop()`` returns True, checked before each round)."""
        while not self.finished:
            if should_stop is not None and should_stop():
                self.stopped = True
                break
            self.step()
        return self.result()

    def result(self) -> BatchResult:
        tok = self.target.tokenizer
        results = []
        for r in self.rows:
            total = r.elapsed_ms or self.elapsed_ms
            results.append(GenerationResult(prompt_ids=r.prompt_ids, token_ids=r.new_ids,
                                            text=tok.decode(r.new_ids, skip_special_tokens=True),
                                            rounds=r.rounds, stats=run_stats(r.rounds, self.prefill_ms, total)))
        return BatchResult(results=results, passes=list(self.passes), total_ms=self.elapsed_ms,
                           prefill_ms=self.prefill_ms, method=self.method, gamma=self.gamma, stopped=self.stopped)


def generate_batch(target: LoadedModel, proposers: Sequence[Proposer | None] | None, prompts_ids: Sequence[list[int]],
                   gamma: int = 4, sampling: SamplingConfig | None = None, seed: int = 0, max_new_tokens: int = 64,
                   stop_on_eos: bool = True, should_stop=None, **kw) -> BatchResult:
    """Decode a batch to the end (see ``BatchDecoder`` for arguments and errors)."""
    dec = BatchDecoder(target, proposers, prompts_ids, gamma=gamma, sampling=sampling, seed=seed,
                       max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos, **kw)
    return dec.run(should_stop=should_stop)


# ------------------------------------------------------------------------------------------ near ties


@dataclass
class NearTie:
    """Where a batched row first differs from the prompt decoded alone, and how close the target was to a tie.

    Attributes:
        index: position (in the generated tokens) of the first difference.
        batched_token, single_token: the two choices there.
        batched_top, single_top: the target's top-2 (id, logit) at that position in the batched run and when
            the prompt + the common prefix is run alone (one plain forward pass).
        single_gap, batched_gap: top-1 minus top-2 logit in each (a near tie: both tiny).
    """

    index: int
    batched_token: int
    single_token: int
    batched_top: list[tuple[int, float]]
    single_top: list[tuple[int, float]]

    @property
    def single_gap(self) -> float:
        return self.single_top[0][1] - self.single_top[1][1]

    @property
    def batched_gap(self) -> float:
        return self.batched_top[0][1] - self.batched_top[1][1]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(single_gap=self.single_gap, batched_gap=self.batched_gap)
        return d


@torch.inference_mode()
def first_difference_gap(target: LoadedModel, prompt_ids: list[int], batched_ids: list[int],
                         batched_logits: Sequence[DecisiveLogits], single_ids: list[int]) -> NearTie | None:
    """The target's top-2 logits, batched and alone, at the first token where a batched row's greedy output
    differs from the prompt decoded alone (None when they agree on their common length).

    Args:
        batched_ids: the row's tokens (``BatchResult.results[b].token_ids``).
        batched_logits: the row's ``DecisiveLogits`` (``BatchDecoder.rows[b].decisive``; needs
            ``record_logits``).
        single_ids: the same prompt's tokens under plain greedy decoding alone.
    """
    i = next((j for j, (a, b) in enumerate(zip(batched_ids, single_ids)) if a != b), None)
    if i is None:
        return None
    inp = torch.tensor([list(prompt_ids) + list(single_ids[:i])], dtype=torch.long, device=target.device)
    lg = target.model(input_ids=inp, logits_to_keep=1).logits[0, -1].float().cpu()
    vals, ids = torch.topk(lg, 2)
    dl = batched_logits[i]
    return NearTie(index=i, batched_token=int(batched_ids[i]), single_token=int(single_ids[i]),
                   batched_top=list(zip(dl.ids, dl.logits)),
                   single_top=list(zip(ids.tolist(), vals.tolist())))


# ------------------------------------------------------------------------------------------ the machine


@dataclass(frozen=True)
class MachinePeaks:
    """This machine's measured memory bandwidth and matmul throughput (the roofline's two numbers).

    Attributes:
        bandwidth_gbs: best of ``reps`` copies of a ``copy_mb`` MB fp32 tensor: 2 · bytes (read + write) ÷ time,
            in GB/s (10⁹ bytes/s).
        peak_tflops: best of ``reps`` n × n fp32 matrix products: 2n³ ÷ time, in TFLOP/s.
        threads: torch's intra-op threads when measured. device: "cpu" or "cuda".
    """

    bandwidth_gbs: float
    peak_tflops: float
    threads: int
    device: str
    matmul_n: int
    copy_mb: int

    def ridge_tokens(self, bytes_per_param: float = 4.0) -> float:
        """Tokens in a pass where the roofline turns compute-bound: 2 · P · n / FLOP/s = P · bytes / bandwidth,
        so n = bytes_per_param · FLOP/s ÷ (2 · bandwidth) (Williams et al. 2009; ``analytic.roofline_step_s``)."""
        return bytes_per_param * self.peak_tflops * 1e12 / (2.0 * self.bandwidth_gbs * 1e9)


def measure_machine(device: str | torch.device = "cpu", matmul_n: int = 1024, copy_mb: int = 128,
                    reps: int = 3) -> MachinePeaks:
    """Time a large matmul and a large memory copy with torch (best of ``reps``, after one warm-up each).

    Raises:
        InputError: matmul_n outside 64..8192, copy_mb outside 1..4096, reps < 1.
    """
    if not (64 <= int(matmul_n) <= 8192) or not (1 <= int(copy_mb) <= 4096) or int(reps) < 1:
        raise InputError("measure_machine needs 64 ≤ matmul_n ≤ 8192, 1 ≤ copy_mb ≤ 4096 and reps ≥ 1.")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(matmul_n, matmul_n, device=dev)
    b = torch.randn(matmul_n, matmul_n, device=dev)
    n_el = copy_mb * 2**20 // 4
    src = torch.randn(n_el, device=dev)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_mm = best(lambda: torch.mm(a, b))
    t_cp = best(lambda: dst.copy_(src))
    return MachinePeaks(bandwidth_gbs=2 * n_el * 4 / t_cp / 1e9, peak_tflops=2 * matmul_n**3 / t_mm / 1e12,
                        threads=torch.get_num_threads(), device=dev.type, matmul_n=int(matmul_n),
                        copy_mb=int(copy_mb))


# ------------------------------------------------------------------------------------------ the sweep

SWEEP_MIN_PROMPTS = 4
"""The prompts each cell of What-if's live sweep covers at least (``batch_sweep``'s ``min_prompts``): B = 1 and
B = 2 decode the first 4 prompts in groups (half the time 8 would take at B = 1); the benchmark uses 8."""

SWEEP_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Rename the variable `total` to `acc` in this function and return the code:\n\ndef sum_list(values):\n"
    "    total = 0\n    for v in values:\n        total = total + v\n    return total\n",
    "What is a KV cache in a language model?",
    "Add a docstring to this function. Return the whole function.\n\ndef mean(values):\n    if not values:\n"
    "        raise ValueError('empty')\n    return sum(values) / len(values)\n",
    "Give three tips for writing clear emails.",
    "Write a Python function that reverses a string.",
    "Summarize the water cycle in two sentences.",
    "List four uses of a paperclip.",
    "Why do cats purr?",
    "Add type hints to this Python function and return the full code:\n\ndef scale(points, factor):\n"
    "    result = []\n    for x, y in points:\n        result.append((x * factor, y * factor))\n    return result\n",
    "What is the difference between a list and a tuple in Python?",
    "Describe a sunrise over the sea.",
    "How does a bicycle stay upright?",
    "Translate 'good morning, how are you?' into French.",
    "Write a haiku about autumn leaves.",
    "What causes the seasons on Earth?",
    "Explain recursion to a ten-year-old.",
    "Name three planets and one fact about each.",
    "Fix the bug in this code and return it:\n\ndef is_even(n):\n    return n % 2 == 1\n",
    "What is photosynthesis?",
    "Give a short recipe for pancakes.",
    "Why is exercise good for the brain?",
    "Write a SQL query that counts the rows of a table named users.",
    "What does HTTP stand for, and what is it used for?",
    "Suggest a name for a small bakery.",
    "Explain what a binary search does.",
    "How do vaccines train the immune system?",
    "Write a limerick about a programmer.",
    "What is the capital of Japan, and what is it known for?",
    "Convert this loop into a list comprehension:\n\nsquares = []\nfor i in range(10):\n    squares.append(i * i)\n",
    "Describe the rules of tic-tac-toe.",
    "What is the speed of light, roughly?",
]
"""32 different prompts for the batch sweep (chat questions and code edits, as in bench_speculative.py)."""

PLAIN = "plain"


def _method_gamma(method: str, gamma: int | None) -> int:
    from engine.decoding.models import default_gamma

    return 0 if method == PLAIN else (gamma if gamma is not None else default_gamma(method))


def _make_proposers(method: str, target: LoadedModel, n: int, draft: LoadedModel | None):
    from engine.decoding.drafts import make_proposer

    if method == PLAIN:
        return None
    return [make_proposer("model" if method == "embedded-draft" else method, target, draft) for _ in range(n)]


@dataclass
class SweepCell:
    """One method at one batch size, over ``reps`` timed runs.

    Attributes:
        tokens_per_s: median over the runs of the batch's total generated tokens ÷ wall time (prefill
            included). runs_tokens_per_s: each run's.
        new_tokens: tokens generated in the median run (every run of a cell gives the same tokens under
            greedy decoding). target_passes: the median run's passes (prefill included).
        pass_tokens: median tokens processed per decode pass (rows · width, padding included: B·(γ + 1)
            while every row drafts γ). pass_ms: median decode pass time (ms).
        acceptance_rate: α̂ over all rows of the median run (accepted ÷ judged), None for plain.
        draft_ms_per_round: median over rounds of the rows' summed draft time (ms), per round.
        speedup: tokens_per_s ÷ the plain cell's at the same batch (None for plain or without one).
        decode_tokens_per_s: the median run's tokens ÷ its time after the prefill (the prompts' pass, the same
            for every method, left out).
    """

    method: str
    batch: int
    gamma: int
    tokens_per_s: float
    runs_tokens_per_s: list[float]
    new_tokens: int
    target_passes: int
    pass_tokens: float | None
    pass_ms: float | None
    acceptance_rate: float | None
    draft_ms_per_round: float | None
    speedup: float | None = None
    decode_tokens_per_s: float | None = None


@dataclass
class BatchSweep:
    """The measured batch sweep (``batch_sweep``).

    Attributes:
        cells: one ``SweepCell`` per (method, batch) measured, in sweep order.
        passes: every decode pass timed, as (method, batch, tokens in the pass, ms).
        crossover: per speculative method, the smallest batch whose tokens/s fell below plain decoding's
            (None: not within the batches measured).
        stopped: ``should_stop`` ended the sweep early (the cells cover what was measured).
        threads, device, elapsed_s: where and how long it ran.
        min_prompts: the prompts each cell's run covered at least (``batch_sweep``; 1 in files from before).
    """

    batches: list[int]
    methods: list[str]
    max_new_tokens: int
    reps: int
    cells: list[SweepCell] = field(default_factory=list)
    passes: list[tuple[str, int, int, float]] = field(default_factory=list)
    stopped: bool = False
    threads: int = 1
    device: str = "cpu"
    elapsed_s: float = 0.0
    model: str = ""
    params: int = 0
    bytes_per_param: float = 4.0
    min_prompts: int = 1

    def cell(self, method: str, batch: int) -> SweepCell | None:
        return next((c for c in self.cells if c.method == method and c.batch == batch), None)

    @property
    def crossover(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for m in self.methods:
            if m == PLAIN:
                continue
            out[m] = next((c.batch for c in sorted(self.cells, key=lambda c: c.batch)
                           if c.method == m and c.speedup is not None and c.speedup < 1.0), None)
        return out

    def pass_curve(self) -> list[tuple[int, float, int]]:
        """Median decode-pass time by tokens in the pass, all methods together: (tokens, ms, passes)."""
        by: dict[int, list[float]] = {}
        for _, _, n, ms in self.passes:
            by.setdefault(n, []).append(ms)
        return [(n, statistics.median(v), len(v)) for n, v in sorted(by.items())]

    def table(self) -> list[dict]:
        """One row per batch size: tokens/s of each method and each speculative method's ratio to plain."""
        rows = []
        for b in self.batches:
            cells = [c for c in self.cells if c.batch == b]
            if not cells:
                continue
            row: dict = {"batch": b}
            for c in cells:
                row[f"{c.method} tok/s"] = round(c.tokens_per_s, 2)
                if c.decode_tokens_per_s is not None:
                    row[f"{c.method} decode tok/s"] = round(c.decode_tokens_per_s, 2)
                if c.method != PLAIN:
                    row[f"{c.method} ×plain"] = None if c.speedup is None else round(c.speedup, 3)
                    row[f"{c.method} pass tokens"] = c.pass_tokens
            rows.append(row)
        return rows

    def to_dict(self) -> dict:
        d = asdict(self)
        d["crossover"] = self.crossover
        d["pass_curve"] = [list(x) for x in self.pass_curve()]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BatchSweep":
        """Rebuild a sweep from ``to_dict`` output (a shipped result file).

        Raises:
            InputError: if the dict lacks the sweep's fields.
        """
        try:
            cells = [SweepCell(**c) for c in d["cells"]]
            return cls(batches=list(d["batches"]), methods=list(d["methods"]), max_new_tokens=int(d["max_new_tokens"]),
                       reps=int(d["reps"]), cells=cells, passes=[tuple(p) for p in d.get("passes", [])],
                       stopped=bool(d.get("stopped", False)), threads=int(d.get("threads", 1)),
                       device=str(d.get("device", "cpu")), elapsed_s=float(d.get("elapsed_s", 0.0)),
                       model=str(d.get("model", "")), params=int(d.get("params", 0)),
                       bytes_per_param=float(d.get("bytes_per_param", 4.0)),
                       min_prompts=int(d.get("min_prompts", 1)))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"Not a batch sweep result: {e}") from None

    def markdown(self) -> str:
        """The table as Markdown (the benchmark writes it), then the crossover batches."""
        rows = self.table()
        cols = list(dict.fromkeys(k for r in rows for k in r))
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join("—" if r.get(c) is None else f"{r[c]}" for c in cols) + " |")
        lines.append("")
        for m, b in self.crossover.items():
            lines.append(f"- {m}: " + (f"slower than plain decoding from batch {b}" if b is not None
                                       else f"not slower than plain decoding up to batch {max(self.batches)}"))
        return "\n".join(lines)


def check_sweep_inputs(target: LoadedModel, prompts: Sequence[list[int]], batches: Sequence[int],
                       methods: Sequence[str], gamma: int | None, max_new_tokens: int, reps: int,
                       available_memory: int | None = None) -> None:
    """The sweep's input checks, in the order a reader meets them (see ``batch_sweep``).

    Raises:
        InputError: no batch, B = 0 or out of range, a batch too large for memory, fewer prompts than the
            largest batch, unknown methods, reps < 1.
    """
    if not batches:
        raise InputError("Give at least one batch size (e.g. 1, 2, 4, 8).")
    for b in batches:
        check_batch_size(b)
    if not methods:
        raise InputError("Pick at least one decoding method.")
    known = (PLAIN, "ngram", "embedded-head", "embedded-draft")
    for m in methods:
        if m not in known and not str(m).startswith("early-exit:"):
            raise InputError(f"Unknown method {m!r}: use {', '.join(known)} or early-exit:K.")
    if not (isinstance(reps, int) and 1 <= reps <= 20):
        raise InputError(f"Repetitions must be from 1 to 20, got {reps!r}.")
    if not (isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= MAX_NEW_TOKENS):
        raise InputError(f"max new tokens must be from 1 to {MAX_NEW_TOKENS}, got {max_new_tokens}.")
    g = max(_method_gamma(m, gamma) for m in methods)
    plen = max((len(p) for p in prompts[:max(batches)]), default=1)
    check_batch_memory(target, max(batches), plen, max_new_tokens, g, available_memory)
    if len(prompts) < max(batches):
        raise InputError(f"The prompt set has {len(prompts)} prompt{'s' if len(prompts) != 1 else ''}, but batch "
                         f"{max(batches)} needs {max(batches)} different prompts: add prompts or lower the batch.")


def batch_sweep(target: LoadedModel, prompts: Sequence[str] | Sequence[list[int]] = SWEEP_PROMPTS,
                batches: Sequence[int] = (1, 2, 4, 8), methods: Sequence[str] = (PLAIN, "ngram", "embedded-head"),
                gamma: int | None = None, max_new_tokens: int = 16, reps: int = 1, chat: bool = True,
                on_progress: Callable[[int, int, str, "BatchSweep"], None] | None = None,
                should_stop: Callable[[], bool] | None = None, warmup: bool = True,
                available_memory: int | None = None, stop_on_eos: bool = True, min_prompts: int = 1) -> BatchSweep:
    """Measure total generated tokens/s of plain and speculative batched greedy decoding against batch size.

    For each batch B (in the order given) the first B prompts are decoded together by every method, ``reps``
    times, the methods alternating (A B C, then C B A, …, also from one batch to the next) so that a busy
    machine hurts them alike; each run
    goes to its end with nothing else done between rounds. The cell's tokens/s is the median run's; a
    speculative method's speedup is its tokens/s ÷ plain decoding's at the same B; every decode pass's time is
    kept against the tokens it processed (rows · width, padding included: B·(γ + 1)).

    Args:
        prompts: texts (chat template applied when ``chat``) or token id lists; at least max(batches).
        batches: batch sizes (each 1..MAX_BATCH, memory-checked). methods: "plain", "ngram",
            "embedded-head", "embedded-draft", "early-exit:K" (``drafts.make_proposer`` specs).
        gamma: γ of every speculative method (default: each method's, ``models.default_gamma``).
        max_new_tokens: per row (rows stop at EOS too). reps: timed runs per cell (1..20).
        on_progress: ``on_progress(done, total, label, sweep_so_far)`` before each run.
        should_stop: checked before each round; True ends the sweep (``stopped``), keeping what was measured.
        warmup: one short untimed plain run first (the first pass of a process is slow).
        stop_on_eos: False lets every row generate exactly ``max_new_tokens`` (EOS ignored, as vLLM's throughput
            benchmark's ``ignore_eos``), so the batch keeps its size to the end instead of thinning out as rows
            finish.
        min_prompts: each run of a cell decodes at least this many prompts (as many as there are, at most): ⌈min_prompts
            ÷ B⌉ groups of B consecutive prompts, one group after another, and the run's tokens/s is all their
            tokens ÷ all their time. So small batches are not judged on the first prompt or two alone (at 8: B = 1
            decodes prompts 1–8 one at a time, B = 2 prompts 1–8 in four pairs, B ≥ 8 one batch as before).

    Raises:
        InputError: see ``check_sweep_inputs``; ``min_prompts`` not a whole number from 1 to MAX_BATCH;
            ModelLoadError / InputError from a method's draft.
    """
    if not (isinstance(min_prompts, int) and 1 <= min_prompts <= MAX_BATCH):
        raise InputError(f"The prompts each cell covers must be a whole number from 1 to {MAX_BATCH}, got {min_prompts!r}.")
    batches = list(batches)
    methods = list(dict.fromkeys(methods))
    if not batches:
        raise InputError("Give at least one batch size (e.g. 1, 2, 4, 8).")
    for b in batches:
        check_batch_size(b)
    n_ids = max(max(batches) if batches else 1, min(min_prompts, len(list(prompts))))
    ids = [p if isinstance(p, list) else encode_prompt(target.tokenizer, p, chat=chat)
           for p in list(prompts)[:n_ids]]
    check_sweep_inputs(target, ids, batches, methods, gamma, max_new_tokens, reps, available_memory)
    draft = None
    if "embedded-draft" in methods:
        from engine.decoding.models import load_model

        draft = load_model("embedded-draft", device=target.device)
    sweep = BatchSweep(batches=list(batches), methods=methods, max_new_tokens=max_new_tokens, reps=reps,
                       threads=torch.get_num_threads(), device=target.device.type, model=target.name,
                       params=target.num_parameters, bytes_per_param=weight_bytes_per_param(target),
                       min_prompts=min_prompts)
    t_start = time.perf_counter()
    if warmup:
        generate_batch(target, None, ids[:1], max_new_tokens=min(4, max_new_tokens), record_logits=False,
                       available_memory=available_memory)
    total = len(batches) * len(methods) * reps
    done = 0
    stop = should_stop or (lambda: False)
    for bi, b in enumerate(batches):
        runs: dict[str, list[BatchResult]] = {m: [] for m in methods}
        for rep in range(reps):
            order = methods if (bi + rep) % 2 == 0 else methods[::-1]
            for m in order:
                if stop():
                    sweep.stopped = True
                    break
                if on_progress is not None:
                    on_progress(done, total, f"batch {b}: {m} (run {rep + 1} of {reps})", sweep)
                parts = []
                for g in range(_groups(b, min_prompts, len(ids))):
                    parts.append(generate_batch(target, _make_proposers(m, target, b, draft), ids[g * b:(g + 1) * b],
                                                gamma=_method_gamma(m, gamma) or 4, max_new_tokens=max_new_tokens,
                                                record_logits=False, should_stop=stop,
                                                available_memory=available_memory, stop_on_eos=stop_on_eos))
                    if parts[-1].stopped:
                        break
                res = _merge_runs(parts)
                done += 1
                if res.stopped:
                    sweep.stopped = True
                    break
                runs[m].append(res)
                sweep.passes += [(m, b, p_.tokens, p_.ms) for p_ in res.passes if not p_.prefill]
            if sweep.stopped:
                break
        for m in methods:
            if runs[m]:
                sweep.cells.append(_cell(m, b, _method_gamma(m, gamma), runs[m]))
        plain = sweep.cell(PLAIN, b)
        for c in sweep.cells:
            if c.batch == b and c.method != PLAIN and plain is not None:
                c.speedup = c.tokens_per_s / plain.tokens_per_s
        if sweep.stopped:
            break
    sweep.elapsed_s = time.perf_counter() - t_start
    if on_progress is not None and not sweep.stopped:
        on_progress(total, total, "done", sweep)
    return sweep


def _groups(batch: int, min_prompts: int, n_prompts: int) -> int:
    """How many groups of ``batch`` consecutive prompts one run of a sweep cell decodes (``batch_sweep``'s
    ``min_prompts``): ⌈min_prompts ÷ batch⌉, but no more groups than the prompts fill, and at least one."""
    return max(1, min(-(-min_prompts // batch), n_prompts // batch))


def _merge_runs(parts: list[BatchResult]) -> BatchResult:
    """Several batches decoded one after another as one run: their rows, passes and times added up."""
    if len(parts) == 1:
        return parts[0]
    return BatchResult(results=[r for p in parts for r in p.results], passes=[x for p in parts for x in p.passes],
                       total_ms=sum(p.total_ms for p in parts), prefill_ms=sum(p.prefill_ms for p in parts),
                       method=parts[0].method, gamma=parts[0].gamma, stopped=any(p.stopped for p in parts))


def _cell(method: str, batch: int, gamma: int, runs: list[BatchResult]) -> SweepCell:
    tps = [r.tokens_per_s or 0.0 for r in runs]
    order = sorted(range(len(runs)), key=tps.__getitem__)
    med = runs[order[(len(order) - 1) // 2]]
    decode = [p for p in med.passes if not p.prefill]
    accepted = sum(r.stats.accepted for r in med.results)
    judged = sum(r.stats.judged for r in med.results)
    per_round: dict[int, float] = {}
    for res in med.results:
        for rnd in res.rounds:
            per_round[rnd.index] = per_round.get(rnd.index, 0.0) + rnd.draft_ms
    return SweepCell(method=method, batch=batch, gamma=gamma, tokens_per_s=statistics.median(tps),
                     runs_tokens_per_s=tps, new_tokens=med.new_tokens, target_passes=med.target_passes,
                     pass_tokens=statistics.median(p.tokens for p in decode) if decode else None,
                     pass_ms=statistics.median(p.ms for p in decode) if decode else None,
                     acceptance_rate=accepted / judged if judged and method != PLAIN else None,
                     draft_ms_per_round=statistics.median(per_round.values()) if per_round and method != PLAIN
                     else None,
                     decode_tokens_per_s=med.new_tokens / ((med.total_ms - med.prefill_ms) / 1000)
                     if med.total_ms > med.prefill_ms else None)


def parse_batches(text: str) -> list[int]:
    """"1, 2, 4" → [1, 2, 4] (sorted, duplicates dropped).

    Raises:
        InputError: an entry that is not a whole number, or nothing at all. (Range checks: ``check_batch_size``.)
    """
    out: list[int] = []
    for part in str(text).replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise InputError(f"Batch sizes are whole numbers separated by commas; {part!r} is not one.") from None
        if not math.isfinite(v) or not v.is_integer():
            raise InputError(f"Batch sizes are whole numbers; {part!r} is not one.")
        out.append(int(v))
    if not out:
        raise InputError("Give at least one batch size (e.g. 1, 2, 4, 8).")
    return sorted(set(out))
