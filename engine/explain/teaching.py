"""The teaching layer's numbers: check-yourself questions, the guided tour, the trade-offs table, the
common mistakes and the "in the wild" facts.

Every answer is computed by an existing engine function (``engine.explain.analytic``, ``engine.explain.prefix_cache``,
``engine.explain.kv_size``, ``engine.explain.flash``, ``engine.explain.toy``, ``engine.decoding.models``); this module only chooses the
settings, asks the question and words the explanation. No formula is repeated here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.errors import InputError, TokenizerMismatchError
from engine.explain.analytic import (
    GAMMA_MAX,
    batch_speedup_curve,
    best_gamma,
    break_even_alpha,
    expected_tokens_per_pass,
    expected_tokens_per_round,
    speedup,
    tokens_per_pass_distribution,
)
from engine.explain.flash import HARDWARE_PRESETS as FLASH_HW
from engine.explain.flash import (
    block_sizes,
    flash_traffic,
    sram_elements,
    standard_attention,
    standard_traffic,
    tiled_attention,
)
from engine.explain.flash import format_bytes as flash_bytes  # decimal GB/MB, as the FlashAttention page and paper
from engine.explain.kv_size import (
    HardwareSpec,
    ModelSpec,
    decode_step,
    format_bytes,
    kv_bytes,
    kv_bytes_per_sequence,
    kv_report,
    model_preset,
)
from engine.explain.prefix_cache import (
    estimate_ttft_ms,
    join_requests,
    preset_requests,
    reusable_tokens,
    simulate_texts,
)

# ---------------------------------------------------------------------------------------------------
# Check-yourself questions


@dataclass(frozen=True)
class Question:
    """One multiple-choice question whose right answer the engine computed from the page's settings.

    Attributes:
        key: stable id within its page (widget keys are built from it).
        prompt: the question (Markdown, the project's own text and numbers only).
        options: the answers offered, at least two.
        correct: index into ``options`` of the right one.
        explanation: shown after an answer; carries the engine's numbers.
        source: where the formula behind the answer comes from.
    """

    key: str
    prompt: str
    options: tuple[str, ...]
    correct: int
    explanation: str
    source: str

    def is_correct(self, choice: str | None) -> bool:
        """Whether ``choice`` (one of ``options``) is the right answer."""
        return choice is not None and choice == self.options[self.correct]


def _pct(x: float) -> str:
    return f"{x:.0%}"


def whatif_questions(alpha: float, gamma: int, c: float) -> list[Question]:
    """Questions for the what-if page at its current (α, γ, c), answered with ``engine.explain.analytic``.

    1. Does this γ pay at this α and c? (speedup > 1, Leviathan et al. 2023, Theorem 3.8)
    2. Which of three draft lengths is best? (``best_gamma``; skipped when the best is tied)
    3. If α fell by 0.2, would the best γ get longer, stay or get shorter? (``best_gamma`` twice; skipped
       at α = 0, which cannot fall)

    Raises:
        InputError: α, γ or c out of range (as ``engine.explain.analytic.speedup``).
    """
    src = "Leviathan et al. 2023, Eq. 1 and Theorem 3.8 (engine.explain.analytic)"
    qs: list[Question] = []
    s = speedup(alpha, gamma, c)
    e = expected_tokens_per_pass(alpha, gamma)
    qs.append(Question(
        "pays", f"At α = {alpha:.2f} and c = {c:.2f}, does γ = {gamma} make decoding faster than plain "
                f"decoding (simple cost model)?",
        ("Yes, it is faster", "No, it is slower or equal"), 0 if s > 1.0 else 1,
        f"A round yields E = {e:.2f} tokens on average and costs γc + 1 = {gamma * c + 1:.2f} decode "
        f"steps, so the speedup is {e:.2f} / {gamma * c + 1:.2f} = **{s:.2f}×**.", src))

    g_best, s_best = best_gamma(alpha, c)
    others = [g for g in (1, 2, 4, 8, GAMMA_MAX) if g != g_best
              and speedup(alpha, g, c) < s_best - 1e-9]
    if others:
        picks = sorted({g_best, others[0], others[-1]})
        opts = tuple(f"γ = {g}" for g in picks)
        detail = ", ".join(f"γ = {g}: {speedup(alpha, g, c):.2f}×" for g in picks)
        qs.append(Question(
            "best_gamma", f"At α = {alpha:.2f} and c = {c:.2f}, which draft length gives the largest speedup?",
            opts, picks.index(g_best),
            f"{detail}. The best over γ = 1…{GAMMA_MAX} is **γ = {g_best}** ({s_best:.2f}×): every extra draft "
            f"token costs c each round but only counts if all tokens before it were accepted (α^k).",
            "Leviathan et al. 2023, Section 3.5 (engine.explain.analytic.best_gamma)"))

    lower = round(max(alpha - 0.2, 0.0), 4)
    if lower == alpha:  # α = 0 cannot fall ("from 0.00 to 0.00")
        return qs
    g_low, s_low = best_gamma(lower, c)
    answer = 0 if g_low > g_best else (1 if g_low == g_best else 2)
    qs.append(Question(
        "alpha_drop", f"If the acceptance rate fell from {alpha:.2f} to {lower:.2f} (c = {c:.2f} unchanged), "
                      "what would happen to the best draft length?",
        ("It gets longer", "It stays the same", "It gets shorter"), answer,
        f"Best γ at α = {alpha:.2f}: {g_best} ({s_best:.2f}×); at α = {lower:.2f}: {g_low} ({s_low:.2f}×). "
        "Lower agreement makes late draft tokens unlikely to count, so shorter drafts win (or γ is "
        "already at its floor of 1).", "Leviathan et al. 2023, Section 3.5 (engine.explain.analytic.best_gamma)"))
    return qs


def live_questions(gamma: int, alpha: float | None = None,
                   draft_lengths: Sequence[int] | None = None) -> list[Question]:
    """Questions for the live page at its draft length γ (and a measured α, when a run exists).

    Answers come from ``engine.explain.analytic.tokens_per_pass_distribution`` (the number of tokens one round
    can emit) and ``expected_tokens_per_pass``; with the run's ``draft_lengths`` (tokens drafted in each
    round) from ``expected_tokens_per_round``, since prompt lookup and the end of a run draft fewer than γ
    and E at γ would then promise more than the run can give.
    """
    src = "Leviathan et al. 2023, Section 3.3 and Eq. 1 (engine.explain.analytic)"
    dist = tokens_per_pass_distribution(0.5, gamma)
    most = len(dist)                       # P(T = k) for k = 1..γ + 1
    opts = sorted({gamma, most, 2 * gamma if 2 * gamma != most else 2 * gamma + 1})
    qs = [Question(
        "max_tokens", f"With γ = {gamma}, what is the largest number of tokens one round can add?",
        tuple(str(o) for o in opts), opts.index(most),
        f"All {gamma} draft tokens accepted, plus the target's bonus token from the same pass: "
        f"**{most}** tokens.", src)]
    zero = tokens_per_pass_distribution(0.0, gamma)
    floor = 1 + int(max(range(len(zero)), key=lambda i: zero[i]))  # the only k with P(T = k) = 1
    qs.append(Question(
        "all_rejected", f"If the draft's first token is rejected (γ = {gamma}), how many tokens does the "
                        "round still add?", ("0", "1", str(gamma + 1)),  # γ + 1 ≥ 2: no repeated choice at γ = 1
        ("0", "1", str(gamma + 1)).index(str(floor)),
        "The target's pass gives its own token at the rejected position (the correction): a round never "
        f"adds fewer than **{floor}** token, so speculation never stalls decoding.", src))
    if alpha is not None:
        bands = ("fewer than 1.5", "1.5 to 2.5", "more than 2.5")
        short = bool(draft_lengths) and any(n < gamma for n in draft_lengths)
        if short:
            e = expected_tokens_per_round(alpha, draft_lengths)
            mean_n = sum(draft_lengths) / len(draft_lengths)
            prompt = (f"This run measured α = {alpha:.2f}; its rounds drafted {mean_n:.1f} tokens on average "
                      f"(up to γ = {gamma}). About how many tokens should one target pass yield on average?")
            why = (f"Each round yields Σ α^k for k = 0…n, with n the tokens it drafted (Eq. 1 at each round's "
                   f"own length; a round that drafted nothing yields 1): **{e:.2f}** tokens per target pass. "
                   f"E at γ = {gamma}, {expected_tokens_per_pass(alpha, gamma):.2f}, assumes every round drafts "
                   f"{gamma}.")
        else:
            e = expected_tokens_per_pass(alpha, gamma)
            prompt = (f"This run measured α = {alpha:.2f} at γ = {gamma}. About how many tokens should one "
                      "target pass yield on average?")
            why = f"E = (1 − α^(γ+1)) / (1 − α) = **{e:.2f}** tokens per target pass."
        qs.append(Question("measured_e", prompt, bands, 0 if e < 1.5 else (1 if e <= 2.5 else 2), why, src))
    return qs


def flash_questions(d: int, sram_kib: int, bytes_per_element: int, n_max: int,
                    n_small: int = 10, d_small: int = 4, block_q: int = 4, block_k: int = 3,
                    seed: int = 0) -> list[Question]:
    """Questions for the FlashAttention page at its traffic-model settings, answered with ``engine.explain.flash``.

    1. How much less main-memory traffic at N = ``n_max``? (Algorithms 0 and 1 traffic counts)
    2. Standard attention's extra memory when N doubles (S and P, 2N² elements).
    3. Is the tiled result the same as standard attention? (runs both on a small random example)

    Raises:
        InputError: as ``engine.explain.flash`` (e.g. on-chip memory too small for d).
    """
    src = "Dao et al. 2022, Algorithms 0 and 1, Theorem 2 (engine.explain.flash)"
    br, bc = block_sizes(sram_elements(sram_kib * 1024, bytes_per_element), d)
    sn, fn = standard_traffic(n_max, d, bytes_per_element), flash_traffic(n_max, d, br, bc,
                                                                           bytes_per_element=bytes_per_element)
    ratio = sn.bytes / fn.bytes
    bands = ("Less than 2×", "2× to 8×", "More than 8×")
    qs = [Question(
        "traffic", f"At N = {n_max:,}, d = {d} and {sram_kib} KiB of on-chip memory, how many times fewer bytes "
                   "does FlashAttention move to and from main memory than standard attention (forward pass)?",
        bands, 0 if ratio < 2 else (1 if ratio <= 8 else 2),
        f"Standard: {flash_bytes(sn.bytes)}; FlashAttention (Br = {br}, Bc = {bc}): {flash_bytes(fn.bytes)} — "
        f"**{ratio:.1f}×** less.", src)]
    half = max(n_max // 2, 1)
    grow = standard_traffic(2 * half, d, bytes_per_element).extra_bytes / standard_traffic(
        half, d, bytes_per_element).extra_bytes
    opts = ("2×", "4×", "8×")
    pick = min(range(3), key=lambda i: abs(float(opts[i][:-1]) - grow))
    qs.append(Question(
        "extra_memory", f"Going from N = {half:,} to N = {2 * half:,}, standard attention's extra memory "
                        "(the score and probability matrices) grows by…", opts, pick,
        f"It holds S and P, 2·N² elements: {flash_bytes(standard_traffic(half, d, bytes_per_element).extra_bytes)}"
        f" → {flash_bytes(standard_traffic(2 * half, d, bytes_per_element).extra_bytes)}, **{grow:.0f}×**. "
        f"FlashAttention keeps only m and ℓ (2·N elements): 2×.", src))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n_small, d_small, generator=g) for _ in range(3))
    diff = float((tiled_attention(q, k, v, block_q, block_k) - standard_attention(q, k, v)).abs().max())
    qs.append(Question(
        "exact", f"Tiled attention on a random example of the page's size (N = {n_small}, d = {d_small}, Br = {block_q}, "
                 f"Bc = {block_k}) against standard attention: is the output the same?",
        ("Yes, up to floating-point rounding", "No, it is an approximation"), 0 if diff < 1e-5 else 1,
        f"Largest difference: **{diff:.1e}** (fp32). The running maximum and sum rescale earlier tiles, so "
        "nothing is approximated.", src))
    return qs


def kv_questions(model: ModelSpec, context: int, batch: int, kv_dtype: str = "bf16",
                 gpu: "str | HardwareSpec" = "H100 SXM") -> list[Question]:
    """Questions for the KV-cache page at its current model and sizes, answered with ``engine.explain.kv_size``.

    1. Doubling the context: how does the batch's KV cache grow? (sliding-window layers stop growing)
    2. With one KV head (MQA), how many times smaller would the cache be? (GQA/MHA models only)
    3. Doubling the batch: how much longer is a decode step on ``gpu``? (roofline)

    Raises:
        InputError: invalid model or sizes (as ``engine.explain.kv_size``).
    """
    src = "Vaswani et al. 2017 §3.2.2; Shazeer 2019; Ainslie et al. 2023; roofline (engine.explain.kv_size)"
    qs: list[Question] = []
    if context > 0:
        a, b = kv_bytes(model, context, batch, kv_dtype), kv_bytes(model, 2 * context, batch, kv_dtype)
        r = b / a if a else 1.0
        opts = ("It stays the same", "It grows, but less than 2×", "It doubles")
        pick = 0 if r < 1.0001 else (2 if r > 1.9999 else 1)
        qs.append(Question(
            "double_context", f"Double the sequence length from {context:,} to {2 * context:,} tokens. The KV "
                              f"cache of the batch ({batch} sequence{'s' if batch != 1 else ''})…", opts, pick,
            f"{format_bytes(a)} → {format_bytes(b)} (**{r:.2f}×**). Each token adds its keys and values to "
            "every layer, except layers with a sliding window, which keep at most the window.", src))
    if not model.is_mla and model.num_kv_heads > 1:
        mqa = dataclasses.replace(model, num_kv_heads=1)
        ctx = max(context, 1)
        ratio = kv_bytes(model, ctx, batch, kv_dtype) / kv_bytes(mqa, ctx, batch, kv_dtype)
        cands = sorted({round(ratio, 2), round(model.num_heads, 2), 2.0} - {1.0})
        if len(cands) >= 2:
            opts = tuple(f"{c:g}×" for c in cands)
            qs.append(Question(
                "mqa", f"{model.name} caches {model.num_kv_heads} KV heads per layer for {model.num_heads} query "
                       "heads. With a single KV head (MQA), how many times smaller would its KV cache be?",
                opts, cands.index(round(ratio, 2)),
                f"The cache is proportional to the number of KV heads, not query heads: "
                f"{model.num_kv_heads} → 1 gives **{ratio:g}×** smaller.", src))
    gpu_name = gpu if isinstance(gpu, str) else gpu.name
    s1 = decode_step(model, gpu, batch, context, kv_dtype)
    s2 = decode_step(model, gpu, 2 * batch, context, kv_dtype)
    r = s2.step_ms / s1.step_ms
    bands = ("Less than 1.3× as long", "1.3× to 1.8×", "About 2× or more")
    qs.append(Question(
        "double_batch", f"On {gpu_name}, a decode step at batch {batch} takes {s1.step_ms:.3f} ms. How long does a step "
                        f"take at batch {2 * batch}?", bands, 0 if r < 1.3 else (1 if r < 1.8 else 2),
        f"**{s2.step_ms:.3f} ms ({r:.2f}×)**: the step reads the weights once for the whole batch plus every "
        f"sequence's KV cache ({s1.bound}-bound at batch {batch}, {s2.bound}-bound at {2 * batch}). Only the "
        "KV reads and the FLOPs grow with the batch.", src))
    return qs


def prefix_questions(tokenizer, preset: str = "system", block_size: int = 16,
                     timestamp_first: bool = True) -> list[Question]:
    """Questions for the prefix-caching page at its preset and block size, answered with
    ``engine.explain.prefix_cache`` (simulated on the page's tokenizer) and ``engine.explain.kv_size``.

    1. What share of request 2's prompt comes from the cache?
    2. With a varying timestamp at the start vs at the end, which hit rate is higher?
    3. The long-answer mistake: what share of a request's total time does caching save?

    Raises:
        InputError: unknown preset or block size out of range.
    """
    src = "engine.explain.prefix_cache (chained block hashes as in vLLM's automatic prefix caching)"
    qs: list[Question] = []
    sim, _ = simulate_texts(join_requests(preset_requests(preset, timestamp_first)), tokenizer,
                            block_size=block_size, capacity=1024, concurrency=1)
    if len(sim.requests) >= 2:
        r2 = sim.requests[1]
        bands = ("None of it", "Some, but less than half", "Half or more")
        pick = 0 if r2.hit_tokens == 0 else (1 if r2.hit_rate < 0.5 else 2)
        qs.append(Question(
            "hit_share", f"With block size {block_size}, how much of request 2's prompt is served from the cache "
                         "(skipped in prefill)?", bands, pick,
            f"{r2.hit_tokens} of {r2.prompt_tokens} tokens (**{r2.hit_rate:.0%}**) in {r2.hit_blocks} whole "
            "blocks; the rest, including the last prompt token, is computed.", src))
    m = timestamp_mistake(tokenizer, block_size)
    opts = ("At the start", "At the end", "It makes no difference")
    pick = 0 if m.hit_rate_start > m.hit_rate_end else (1 if m.hit_rate_end > m.hit_rate_start else 2)
    qs.append(Question(
        "timestamp", "Every prompt carries a different timestamp line. Where should it go for the best cache "
                     "hit rate?", opts, pick,
        f"Hit rate over the 5 requests: start **{m.hit_rate_start:.0%}**, end **{m.hit_rate_end:.0%}**. A block's "
        "name hashes every token before it, so one differing token near the start changes every later block.",
        src))
    la = long_answer_mistake()
    bands = ("Most of it (over 50 %)", "Between 10 % and 50 %", "Less than 10 %")
    pick = 0 if la.saved_share > 0.5 else (1 if la.saved_share >= 0.1 else 2)
    qs.append(Question(
        "long_answer", f"{la.model} on {la.gpu}: a {la.prompt_tokens:,}-token prompt of which {la.cached_tokens:,} "
                       f"tokens are cached, and a {la.answer_tokens:,}-token answer. What share of the request's "
                       "total time does prefix caching save?", bands, pick,
        f"Prefill {la.prefill_ms_full:.1f} → {la.prefill_ms_cached:.1f} ms, decode {la.decode_ms:.0f} ms either way: "
        f"**{la.saved_share:.1%}** of {la.total_ms_full:.0f} ms. Caching skips prefill only.",
        "roofline of engine.explain.kv_size.decode_step (Williams et al. 2009; Kaplan et al. 2020)"))
    return qs


# ---------------------------------------------------------------------------------------------------
# Common mistakes, with the engine's numbers


@dataclass(frozen=True)
class LargeBatchMistake:
    """Speculation at a large batch (``engine.explain.analytic.batch_speedup_curve``)."""

    alpha: float
    gamma: int
    c: float
    hardware: str
    params_b: float
    speedup_at_1: float
    speedup_at_large: float
    large_batch: int
    crossover_batch: float | None


def large_batch_mistake(alpha: float = 0.8, gamma: int = 4, c: float = 0.05, params_b: float = 7.0,
                        large_batch: int = 256, hardware: str = "H100 SXM") -> LargeBatchMistake:
    """Speedup at batch 1 vs at ``large_batch`` for a ``params_b``-billion bf16 target on ``hardware``
    (roofline of ``engine.explain.analytic``; bandwidth and peak from ``engine.explain.analytic.HARDWARE_PRESETS``)."""
    from engine.explain.analytic import HARDWARE_PRESETS

    hw = HARDWARE_PRESETS[hardware]
    bc = batch_speedup_curve(alpha, gamma, c, params_b, 2.0, hw.bandwidth / 1e9, hw.peak_flops / 1e12,
                             max_batch=large_batch)
    return LargeBatchMistake(alpha, gamma, c, hardware, params_b, bc.speedup_at_1, bc.speedups[-1],
                             bc.batches[-1], bc.crossover_batch)


@dataclass(frozen=True)
class MeasuredBatchMistake:
    """Mistake #1 measured on this machine: a speculative method's tokens/s ÷ plain decoding's, batched
    (``engine.decoding.batch.batch_sweep``).

    Attributes:
        method, label: the speculative method shown (the draft head when measured, else the first one).
        small_batch, speedup_small: the smallest batch measured and the speedup there.
        large_batch, speedup_large: the largest batch measured and the speedup there.
        crossover_batch: the smallest measured batch slower than plain decoding (None: none measured).
        source: where the numbers come from ("this session's sweep" or the shipped result file's path).
        threads: torch threads of the run.
        reps: timed runs per cell (the cell's tokens/s is the median run's). max_new_tokens: new tokens per row
            (rows may stop earlier at EOS). prompts: prompts of the largest batch (one per row).
    """

    method: str
    label: str
    small_batch: int
    speedup_small: float
    large_batch: int
    speedup_large: float
    crossover_batch: int | None
    source: str
    threads: int
    reps: int = 1
    max_new_tokens: int = 0
    prompts: int = 0

    @property
    def run_note(self) -> str:
        """How the sweep was run, in words: runs per cell, tokens per row, prompts."""
        runs = ("each cell timed once (no spread measured)" if self.reps <= 1
                else f"each cell timed {self.reps} times (the median run)")
        return f"{runs}, up to {self.max_new_tokens} new tokens per row, {self.prompts} prompts at the largest batch"


def measured_batch_mistake(sweep, source: str) -> MeasuredBatchMistake | None:
    """Mistake #1 with measured numbers from a ``BatchSweep`` (None when it has no speculative cell)."""
    from engine.explain.batch_view import method_label

    spec = [m for m in sweep.methods if m != "plain" and any(c.method == m and c.speedup is not None
                                                            for c in sweep.cells)]
    if not spec:
        return None
    m = "embedded-head" if "embedded-head" in spec else spec[0]
    cells = sorted((c for c in sweep.cells if c.method == m and c.speedup is not None), key=lambda c: c.batch)
    return MeasuredBatchMistake(method=m, label=method_label(m), small_batch=cells[0].batch,
                                speedup_small=cells[0].speedup, large_batch=cells[-1].batch,
                                speedup_large=cells[-1].speedup, crossover_batch=sweep.crossover.get(m),
                                source=source, threads=sweep.threads, reps=sweep.reps,
                                max_new_tokens=sweep.max_new_tokens, prompts=max(sweep.batches))


@dataclass(frozen=True)
class TimestampMistake:
    """The timestamp preset with the varying line at the start vs at the end (``engine.explain.prefix_cache``)."""

    block_size: int
    hit_rate_start: float
    hit_rate_end: float
    hit_tokens_start: int
    hit_tokens_end: int
    prompt_tokens: int


def timestamp_mistake(tokenizer, block_size: int = 16) -> TimestampMistake:
    """Simulate the "timestamp" preset both ways on ``tokenizer`` (a pool large enough to never evict)."""
    res = {}
    for first in (True, False):
        sim, _ = simulate_texts(join_requests(preset_requests("timestamp", timestamp_first=first)), tokenizer,
                                block_size=block_size, capacity=1024, concurrency=1)
        res[first] = sim
    return TimestampMistake(block_size, res[True].hit_rate, res[False].hit_rate, res[True].hit_tokens,
                            res[False].hit_tokens, res[True].prompt_tokens)


@dataclass(frozen=True)
class LongAnswerMistake:
    """End-to-end time of one request with and without a cached prefix (roofline, ``engine.explain.kv_size``)."""

    model: str
    gpu: str
    prompt_tokens: int
    cached_tokens: int
    answer_tokens: int
    prefill_ms_full: float
    prefill_ms_cached: float
    decode_ms: float

    @property
    def total_ms_full(self) -> float:
        return self.prefill_ms_full + self.decode_ms

    @property
    def total_ms_cached(self) -> float:
        return self.prefill_ms_cached + self.decode_ms

    @property
    def saved_share(self) -> float:
        """(total without cache − total with cache) / total without cache."""
        return (self.total_ms_full - self.total_ms_cached) / self.total_ms_full


def long_answer_mistake(model: str = "Llama-3.1-8B", gpu: str = "H100 SXM", prompt_tokens: int = 2000,
                        shared_tokens: int = 1500, answer_tokens: int = 500, block_size: int = 16) -> LongAnswerMistake:
    """Prefill as one roofline pass over the computed tokens (``decode_step`` with ``tokens_per_seq`` = the
    computed tokens, at the full prompt as context), decode as ``answer_tokens`` roofline steps at the
    prompt's length; the cached tokens are ``reusable_tokens`` (whole blocks, never the last token).

    Raises:
        InputError: sizes out of range.
    """
    if not (1 <= shared_tokens <= prompt_tokens) or answer_tokens < 1:
        raise InputError("Need 1 ≤ shared tokens ≤ prompt tokens and at least one answer token.")
    cached = reusable_tokens(prompt_tokens, shared_tokens, block_size)
    full = decode_step(model, gpu, 1, prompt_tokens, tokens_per_seq=prompt_tokens).step_ms
    part = decode_step(model, gpu, 1, prompt_tokens, tokens_per_seq=prompt_tokens - cached).step_ms
    dec = answer_tokens * decode_step(model, gpu, 1, prompt_tokens).step_ms
    return LongAnswerMistake(model, gpu, prompt_tokens, cached, answer_tokens, full, part, dec)


@dataclass(frozen=True)
class TokenizerMistake:
    """What happens when the draft's ids mean other strings (``engine.decoding.models.check_tokenizers_compatible``)."""

    text: str
    target_ids: list[int]
    draft_ids: list[int]
    draft_ids_read_by_target: str      # the draft's ids decoded with the target's tokenizer
    engine_error: str | None           # the engine's refusal message (None: accepted)


def stand_in_tokenizer(text: str):
    """A word-level tokenizer over the words of ``text`` (ids 2, 3, … in order of first appearance): a
    stand-in for a draft from another model family. Built with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1}
    for w in text.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def tokenizer_mistake(target_tokenizer, text: str = "The cat sat on the mat.", draft_tokenizer=None) -> TokenizerMistake:
    """Tokenize ``text`` with the target's and a different draft tokenizer, show what the target would read
    if it took the draft's ids as its own, and run the engine's compatibility check."""
    draft = draft_tokenizer if draft_tokenizer is not None else stand_in_tokenizer(text)
    from engine.decoding.models import check_tokenizers_compatible

    t_ids = list(target_tokenizer.encode(text, add_special_tokens=False))
    d_ids = list(draft.encode(text, add_special_tokens=False))
    try:
        check_tokenizers_compatible(target_tokenizer, draft)
        err = None
    except TokenizerMismatchError as e:
        err = str(e)
    return TokenizerMistake(text, t_ids, d_ids, target_tokenizer.decode(d_ids), err)


@dataclass(frozen=True)
class QualityMistake:
    """The toy check: engine rule vs naive "accept everything" (``engine.explain.toy.run_toy_rounds``)."""

    n_rounds: int
    tvd_engine: float
    tvd_naive: float
    chi2_p_engine: float
    chi2_p_naive: float


QUALITY_TOY = {"n": 2000, "gamma": 4, "target_peak": 8.0, "draft_peak": 4.0, "context": "cat", "seed": 0}
"""The toy run of the quality mistake; its "Reproduce" link opens the what-if page's check with the same
settings, so both show the same numbers."""


def quality_mistake(n_rounds: int = QUALITY_TOY["n"], seed: int = QUALITY_TOY["seed"]) -> QualityMistake:
    """Run the toy distribution check with the engine's verification and with the naive rule."""
    from engine.explain.toy import run_toy_rounds, verify_always_accept

    q = QUALITY_TOY
    args = (n_rounds, q["gamma"], q["target_peak"], q["draft_peak"], q["context"], seed)
    ok = run_toy_rounds(*args)
    bad = run_toy_rounds(*args, verify=verify_always_accept)
    return QualityMistake(n_rounds, ok.tvd, bad.tvd, ok.chi2_p, bad.chi2_p)


# ---------------------------------------------------------------------------------------------------
# Page links (a tour stop or a mistake is a page URL with query parameters)


@dataclass(frozen=True)
class PageLink:
    """A page (its ``url_path`` in app/registry.py) with the query parameters that set its widgets."""

    url_path: str
    params: dict[str, Any] = field(default_factory=dict)

    def query(self) -> dict[str, str]:
        """The parameters as URL strings (booleans as 1/0, floats without trailing zeros)."""
        out = {}
        for k, v in self.params.items():
            out[k] = ("1" if v else "0") if isinstance(v, bool) else (f"{v:g}" if isinstance(v, float) else str(v))
        return out

    def url(self, **extra: Any) -> str:
        """Relative URL, e.g. ``whatif?wi_alpha=0.6&present=1``."""
        from urllib.parse import urlencode

        q = {**self.query(), **{k: str(v) for k, v in extra.items()}}
        return self.url_path + ("?" + urlencode(q) if q else "")


@dataclass(frozen=True)
class TourStop:
    title: str
    link: PageLink
    text: str          # two or three sentences: what to look at (the project's own words, engine numbers)
    clear: tuple[str, ...] = ()   # extra session keys the page derives from its widgets (reset them too)


def tour_stops() -> list[TourStop]:
    """The guided tour, in the app's order: live round → what-if → prefix caching → FlashAttention → KV size.
    Numbers in the texts come from the engine."""
    s_bad = speedup(0.6, 8, 0.3)
    g_best, s_best = best_gamma(0.6, 0.3)
    lb = large_batch_mistake()
    br, bc = block_sizes(sram_elements(FLASH_HW["NVIDIA A100 (SXM4 40GB)"].sram_kib * 1024, 2), 64)
    st_, fl = standard_traffic(16384, 64, 2), flash_traffic(16384, 64, br, bc, bytes_per_element=2)
    llama = model_preset("Llama-3.1-8B")
    kv_seq = kv_bytes_per_sequence(llama, 32768)
    kv_mha_batch = kv_bytes(dataclasses.replace(llama, num_kv_heads=llama.num_heads), 32768, batch=8)
    kv_step = kv_report(llama, 32768, batch=8).steps["H100 SXM"]  # the page's roofline table, H100 row
    cross = "beyond the chart" if lb.crossover_batch is None else f"from a batch of about {lb.crossover_batch:,.0f}"
    return [
        TourStop("A live round", PageLink("live", {"lv_preset": "code", "lv_draft": "ngram", "lv_gamma": 4,
                                                   "lv_temp": 0.0}),
                 "Press **Step one round** (or N) a few times. The prompt asks to edit quoted code. The first "
                 "rounds draft nothing; once the answer starts copying the code, prompt lookup (no draft model "
                 "at all) finds the next tokens in the prompt: watch several green, accepted tokens arrive from "
                 "a single target pass, and the target's own token close each round.",
                 clear=("lv_prompt",)),
        TourStop("When does it pay?", PageLink("whatif", {"wi_alpha": 0.6, "wi_gamma": 8, "wi_cost": 0.3,
                                                          "wi_tab": "Analytic model"}),
                 f"At α = 0.6 and a draft costing c = 0.3 of a target pass, γ = 8 gives only {s_bad:.2f}×. The "
                 f"curve peaks at γ = {g_best} ({s_best:.2f}×): find the star, then move α up and watch the best "
                 "γ grow."),
        TourStop("When it stops paying", PageLink("whatif", {"wi_alpha": 0.8, "wi_gamma": 4, "wi_cost": 0.05,
                                                             "wi_tab": "When it does not help",
                                                             "wi_hw": "H100 SXM", "wi_params_b": 7.0,
                                                             "wi_max_batch": 1024}),
                 f"Now α = 0.8, γ = 4, c = 0.05, for a {lb.params_b:g} B model on an {lb.hardware}: "
                 f"{lb.speedup_at_1:.2f}× at batch 1, "
                 f"but [a slowdown {cross}](#where-speculation-stops-paying). A large batch already fills "
                 "the GPU's compute, so checking γ + 1 "
                 "tokens per sequence is no longer free."),
        TourStop("Prefix caching", PageLink("prefix-cache", {"pc_preset": "timestamp", "pc_ts": "start",
                                                             "pc_block": 16}),
                 "A timestamp line opens every prompt, so no two requests share their first block and nothing "
                 "is reused. Switch the radio to **at the end** and watch the shared system prompt turn into "
                 "solid cache hits in [the block table](#requests-through-the-block-pool).",
                 clear=("pc_text", "pc_step")),
        TourStop("FlashAttention", PageLink("flash-attention", {"n": 10, "d": 4, "br": 4, "bc": 3, "step": 5,
                                                                "nmax": 16384, "td": 64, "bpe": 2}),
                 f"Step through the tiles and watch [the running maximum m and sum ℓ](#running-max-and-sum) rescale. "
                 f"[Below](#2-memory-traffic-and-memory-use), at N = 16,384 "
                 f"standard attention moves {flash_bytes(st_.bytes)} per head, FlashAttention "
                 f"{flash_bytes(fl.bytes)} ({st_.bytes / fl.bytes:.1f}× less), for the same output."),
        TourStop("KV-cache size", PageLink("kv-cache", {"preset": "Llama-3.1-8B", "context": 32768, "batch": 8}),
                 f"Llama-3.1-8B shares each KV head among {llama.num_heads // llama.num_kv_heads} query heads "
                 f"(GQA): {format_bytes(kv_seq)} per 32k-token sequence, {format_bytes(kv_bytes(llama, 32768, batch=8))} "
                 f"for the batch of 8, against {format_bytes(kv_mha_batch)} with one KV head per query head (MHA; "
                 f"the MHA/MQA table). Further down, [the roofline table](#a-decode-step-on-the-roofline): "
                 f"{format_bytes(kv_step.kv_bytes)} of the "
                 f"{format_bytes(kv_step.bytes_read)} an H100 decode step reads is KV cache."),
    ]


# ---------------------------------------------------------------------------------------------------
# Trade-offs table


@dataclass(frozen=True)
class TradeOff:
    technique: str
    saves: str
    costs: str
    stops_helping: str
    changes_outputs: str
    example: str          # a number the engine computes for a stated setting
    link: PageLink        # the page that shows the example, in the example's setting
    source: str

    @property
    def page(self) -> str:
        """url_path of the page that shows the example."""
        return self.link.url_path


def _analytic_link(alpha: float, gamma: int, cost: float) -> PageLink:
    return PageLink("whatif", {"wi_alpha": alpha, "wi_gamma": gamma, "wi_cost": cost, "wi_tab": "Analytic model"})


def trade_offs() -> list[TradeOff]:
    """One row per speedup, with an engine-computed example number for a stated setting."""
    lb = large_batch_mistake()
    s_pl = speedup(0.5, 4, 0.0)
    s_heads = speedup(0.7, 3, 0.02)
    la = long_answer_mistake()
    a100 = "NVIDIA A100 (SXM4 40GB)"
    br, bc = block_sizes(sram_elements(FLASH_HW[a100].sram_kib * 1024, 2), 64)
    ratio = standard_traffic(4096, 64, 2).bytes / flash_traffic(4096, 64, br, bc, bytes_per_element=2).bytes
    llama = model_preset("Llama-3.1-8B")
    mha = dataclasses.replace(llama, num_kv_heads=llama.num_heads)
    kv_ratio = kv_bytes(mha, 8192, 1) / kv_bytes(llama, 8192, 1)
    cross = "no slowdown up to 1,024" if lb.crossover_batch is None else f"slower than plain from batch ≈ {lb.crossover_batch:,.0f}"
    return [
        TradeOff("Speculative decoding, draft model", "decode steps (target passes per token)",
                 "draft compute each round; GPU memory for the draft's weights and KV cache",
                 "large batches (the verify pass becomes compute-bound); low acceptance α; an expensive draft",
                 "No: the acceptance rule keeps the target's distribution",
                 f"α 0.8, γ 4, c 0.05, 7 B on H100: {lb.speedup_at_1:.2f}× at batch 1; {cross}",
                 MISTAKE_LINKS["large_batch"], "Leviathan et al. 2023, Theorem 3.8; roofline (engine.explain.analytic)"),
        TradeOff("Prompt lookup (n-gram)", "decode steps, when the answer copies the prompt",
                 "almost nothing (a string match, c ≈ 0)",
                 "answers that do not copy the context (α near 0); large batches",
                 "No (same verification)",
                 f"α 0.5, γ 4, c 0: {s_pl:.2f}×", _analytic_link(0.5, 4, 0.0),
                 "Saxena 2023 (prompt lookup); engine.explain.analytic"),
        TradeOff("Self-drafting heads (Medusa, EAGLE, multi-token heads)", "decode steps",
                 "training extra heads on the target; a model change to serve",
                 "large batches; heads trained on other data accept less",
                 "No with a distribution-preserving acceptance rule (Medusa's typical acceptance can differ)",
                 f"assumed α 0.7, γ 3, c 0.02: {s_heads:.2f}×", _analytic_link(0.7, 3, 0.02),
                 "Cai et al. 2024 (Medusa); Li et al. 2024 (EAGLE); engine.explain.analytic"),
        TradeOff("Prefix caching", "prefill of the shared prefix (time to first token)",
                 "GPU memory holding cached blocks (evicted when needed)",
                 "prompts that differ near the start; long answers (decode is untouched)",
                 "No: the same keys and values, up to floating-point rounding",
                 f"8 B on H100, 2,000-token prompt, {la.cached_tokens:,} cached, 500-token answer: "
                 f"{la.saved_share:.1%} of the total saved", PageLink("mistakes"),  # its mistake 5
                 "engine.explain.prefix_cache, engine.explain.kv_size"),
        TradeOff("FlashAttention", "main-memory traffic and the N × N memory of attention",
                 "a fused kernel per GPU; recomputation in the backward pass",
                 "short sequences (Q, K, V, O dominate the traffic); decode with one query per step gains less",
                 "No: exact, up to floating-point rounding",
                 f"N 4,096, d 64, fp16, A100: {ratio:.1f}× less traffic",
                 PageLink("flash-attention", {"fa_gpu": a100, "sram": FLASH_HW[a100].sram_kib, "td": 64, "bpe": 2,
                                              "nmax": 4096}),
                 "Dao et al. 2022, Algorithms 0 and 1 (engine.explain.flash)"),
        TradeOff("GQA / MQA", "KV-cache memory and the KV bytes every decode step reads",
                 "a model change, made in training (or uptraining); possibly some quality",
                 "short contexts and small batches, where the weights dominate each step's reads",
                 "Yes: it is a different model",
                 f"Llama-3.1-8B (8 KV heads) vs the same model with 32: {kv_ratio:g}× smaller KV cache",
                 PageLink("kv-cache", {"preset": "Llama-3.1-8B"}), "Shazeer 2019; Ainslie et al. 2023 (engine.explain.kv_size)"),
    ]


# ---------------------------------------------------------------------------------------------------
# In the wild: documented support in widely used engines


@dataclass(frozen=True)
class WildFact:
    engine: str
    technique: str
    how: str
    source: str       # documentation page (and version where the page is versioned)


IN_THE_WILD: list[WildFact] = [
    WildFact("vLLM", "Speculative decoding: draft model, n-gram prompt lookup, EAGLE, MLP speculators",
             "`speculative_config={...}` (for example `\"method\": \"ngram\"` or `\"eagle\"`)",
             "docs.vllm.ai/en/v0.9.1/features/spec_decode.html; the v0.14.0 page notes that v0.10.0 did not "
             "support a separate draft model"),
    WildFact("vLLM", "Automatic prefix caching", "`enable_prefix_caching=True`",
             "docs.vllm.ai, \"Automatic Prefix Caching\" (design section: block hash of parent hash and tokens)"),
    WildFact("SGLang", "Prefix caching with RadixAttention (a radix tree of cached KV)", "on by default",
             "Zheng et al. 2023, SGLang paper (arXiv 2312.07104); docs.sglang.io"),
    WildFact("SGLang", "Speculative decoding: EAGLE-2/EAGLE-3, MTP, standalone draft model, n-gram",
             "`--speculative-algorithm EAGLE | EAGLE3 | STANDALONE | NGRAM`",
             "docs.sglang.io/docs/advanced_features/speculative_decoding"),
    WildFact("TensorRT-LLM", "Speculative decoding: draft/target, Medusa, EAGLE, lookahead, n-gram",
             "speculative decoding configs of the LLM API", "nvidia.github.io/TensorRT-LLM/advanced/speculative-decoding.html"),
    WildFact("TensorRT-LLM", "KV cache reuse across requests with the same prefix",
             "`KvCacheConfig(enable_block_reuse=True)` (the default)",
             "nvidia.github.io/TensorRT-LLM/advanced/kv-cache-reuse.html; llm-api/reference/KvCacheConfig.html"),
    WildFact("llama.cpp", "Speculative decoding with a draft model (same tokenizer)",
             "`llama-server -m main.gguf -md draft.gguf --spec-type draft-simple --spec-draft-n-max N` "
             "(older builds: `--draft-max N`)",
             "github.com/ggml-org/llama.cpp docs/speculative.md; PR #10455 (server support, Nov 2024); flags from "
             "common/arg.cpp as vendored in llama-cpp-python 0.3.36"),
    WildFact("transformers", "Assisted generation with a draft model", "`generate(..., assistant_model=draft)`",
             "huggingface.co/docs/transformers/v5.15.0/assisted_decoding; checked in the installed 5.24 source"),
    WildFact("transformers", "Prompt lookup decoding", "`generate(..., prompt_lookup_num_tokens=k)`",
             "same page, \"Prompt lookup decoding\"; GenerationConfig in the installed 5.24"),
    WildFact("transformers", "Self-speculative decoding (early exit)", "`generate(..., assistant_early_exit=k)`",
             "same page, \"Self-speculative decoding\"; GenerationConfig in the installed 5.24"),
    WildFact("transformers", "Fused attention kernels: PyTorch SDPA, FlashAttention-2",
             "`from_pretrained(..., attn_implementation=\"sdpa\" | \"flash_attention_2\")`",
             "modeling_utils.py of the installed transformers 5.24 (SDPA is the default when available)"),
]


# ---------------------------------------------------------------------------------------------------
# In the wild, late 2026: speculative methods per engine, each checked against the engine's own repository


WILD_CHECKED = "2026-12-01"
"""The day every line of ``SPEC_METHODS_2026`` was checked against the cited file."""

# the page of this app that shows each mechanism
_LIVE_HEAD = PageLink("live", {"lv_draft": "head"})
_LIVE_DRAFT = PageLink("live", {"lv_draft": "draft"})
_LIVE_NGRAM = PageLink("live", {"lv_preset": "code", "lv_draft": "ngram", "lv_gamma": 4})
_LIVE_MEDUSA = PageLink("live", {"lv_draft": "medusa"})
_LIVE_EARLY = PageLink("live", {"lv_draft": "early-exit"})
_WHATIF = PageLink("whatif", {})
_LIVE_BLOCK = PageLink("live", {"lv_draft": "block"})
_WHATIF_BLOCK = PageLink("whatif", {"wi_tab": "Sequential vs parallel drafting"})


@dataclass(frozen=True)
class SpecMethod:
    """One speculative method as one engine ships it.

    Attributes:
        engine: "vLLM", "SGLang", "llama.cpp" or "TensorRT-LLM".
        method: the method's name. drafts: how it drafts, in one line.
        flag: how to switch it on, as the cited source spells it.
        source: the repository file (or page) it was checked against, with the repository.
        link: this app's page that shows the mechanism (the closest one: the Live page's block drafter for
            DFlash, What-if's sequential-vs-parallel tab for DSpark's cut).
        verified: "yes" when the flag and the method were both read in the cited file; otherwise what was not.
    """

    engine: str
    method: str
    drafts: str
    flag: str
    source: str
    link: PageLink
    verified: str = "yes"


SPEC_METHODS_2026: list[SpecMethod] = [
    # vLLM: method names from vllm/config/speculative.py (SpeculativeMethod, MTPModelTypes, DFlash/DSpark types)
    SpecMethod("vLLM", "EAGLE / EAGLE-3", "a one-layer head reads the target's hidden states, drafts a chain",
               "`--speculative-config '{\"method\": \"eagle3\", \"model\": HEAD, ...}'` (or \"eagle\")",
               "vllm-project/vllm vllm/config/speculative.py (SpeculativeMethod); docs/features/speculative_decoding/eagle.md",
               _LIVE_HEAD),
    SpecMethod("vLLM", "MTP", "the model's own multi-token-prediction layers draft",
               "`\"method\": \"mtp\"` (per-model names such as deepseek_mtp are accepted too)",
               "vllm-project/vllm vllm/config/speculative.py (MTPModelTypes); docs/features/speculative_decoding/mtp.md",
               _LIVE_MEDUSA),
    SpecMethod("vLLM", "Draft model", "a small model with the same tokenizer drafts token by token",
               "`\"method\": \"draft_model\", \"model\": DRAFT`",
               "vllm-project/vllm vllm/config/speculative.py; docs/features/speculative_decoding/draft_model.md",
               _LIVE_DRAFT),
    SpecMethod("vLLM", "PARD (parallel draft)", "a draft model trained with mask tokens drafts all k positions in one pass",
               "`\"method\": \"draft_model\", \"parallel_drafting\": true`",
               "vllm-project/vllm docs/features/speculative_decoding/parallel_draft_model.md", _LIVE_DRAFT),
    SpecMethod("vLLM", "n-gram (prompt lookup)", "copies what followed the last n tokens' earlier occurrence",
               "`\"method\": \"ngram\"` with prompt_lookup_min/max (`ngram_gpu`: on the GPU)",
               "vllm-project/vllm vllm/config/speculative.py; docs/features/speculative_decoding/n_gram.md", _LIVE_NGRAM),
    SpecMethod("vLLM", "Suffix decoding", "a suffix tree over the prompt and earlier outputs proposes continuations",
               "`\"method\": \"suffix\"`",
               "vllm-project/vllm vllm/config/speculative.py; docs/features/speculative_decoding/suffix.md", _LIVE_NGRAM),
    SpecMethod("vLLM", "DFlash", "a small block-diffusion draft emits a whole block per pass from the target's hidden states",
               "`\"method\": \"dflash\"`",
               "vllm-project/vllm vllm/config/speculative.py (DFlashModelTypes); docs/features/speculative_decoding/dflash.md",
               _LIVE_BLOCK),
    SpecMethod("vLLM", "DSpark", "DFlash's block draft with a Markov head on the previous token",
               "`\"method\": \"dspark\"`",
               "vllm-project/vllm vllm/config/speculative.py (DSparkModelTypes); vllm/v1/spec_decode/dspark.py", _WHATIF_BLOCK),
    # SGLang: documented algorithms; DFlash from its source tree
    SpecMethod("SGLang", "EAGLE-2 / EAGLE-3", "a head on the target's features drafts a token tree (top-k per step)",
               "`--speculative-algorithm EAGLE | EAGLE3` with --speculative-num-steps, -eagle-topk, -num-draft-tokens",
               "docs.sglang.io/docs/advanced_features/speculative_decoding", _LIVE_HEAD),
    SpecMethod("SGLang", "MTP", "the model's built-in MTP layers serve as the EAGLE draft",
               "`--speculative-algorithm EAGLE` on an MTP model (the page's MTP section)",
               "docs.sglang.io/docs/advanced_features/speculative_decoding", _LIVE_MEDUSA),
    SpecMethod("SGLang", "Standalone draft model", "a separate small model drafts",
               "`--speculative-algorithm STANDALONE --speculative-draft-model-path DRAFT`",
               "docs.sglang.io/docs/advanced_features/speculative_decoding", _LIVE_DRAFT),
    SpecMethod("SGLang", "n-gram", "matches the recent tokens in a cache of earlier text (CUDA only)",
               "`--speculative-algorithm NGRAM`", "docs.sglang.io/docs/advanced_features/speculative_decoding",
               _LIVE_NGRAM),
    SpecMethod("SGLang", "DFlash", "block-diffusion draft, as in vLLM",
               "`--speculative-algorithm DFLASH`",
               "sgl-project/sglang python/sglang/srt/speculative/dflash_worker.py", _LIVE_BLOCK,
               verified="the worker file is in SGLang's tree; the flag is the enum name seen in a spec_info.py snapshot "
                        "that could not be tied to the newest main"),
    # llama.cpp: the vendored copy in the PyPI sdist llama-cpp-python 0.3.36 (read here in full)
    SpecMethod("llama.cpp", "Draft model", "a small GGUF with the same vocabulary drafts",
               "`llama-server -md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max N`",
               "llama.cpp common/arg.cpp, common/speculative.cpp, docs/speculative.md (as vendored in llama-cpp-python 0.3.36)",
               _LIVE_DRAFT),
    SpecMethod("llama.cpp", "EAGLE-3", "a one-layer draft on the target's hidden states",
               "`-md EAGLE3.gguf --spec-type draft-eagle3`", "llama.cpp docs/speculative.md (vendored, 0.3.36)",
               _LIVE_HEAD),
    SpecMethod("llama.cpp", "MTP", "the main model's MTP heads", "`--spec-type draft-mtp`",
               "llama.cpp docs/speculative.md, common/speculative.cpp (vendored, 0.3.36)", _LIVE_MEDUSA),
    SpecMethod("llama.cpp", "DFlash / DSpark", "block-diffusion drafts (DSpark adds a Markov head)",
               "`-md DRAFT.gguf --spec-type draft-dflash` (or `draft-dspark`)",
               "llama.cpp docs/speculative.md (vendored, 0.3.36)", _LIVE_BLOCK),
    SpecMethod("llama.cpp", "n-gram kinds", "ngram-simple / ngram-map-k / ngram-map-k4v look up the last n tokens in "
               "the history; ngram-mod a hash pool shared by all slots; ngram-cache n-gram statistics",
               "`--spec-type ngram-simple` (or ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache); "
               "`--spec-default` = ngram-mod",
               "llama.cpp docs/speculative.md, common/arg.cpp (vendored, 0.3.36)", _LIVE_NGRAM),
    SpecMethod("llama.cpp", "Several kinds at once", "a comma-separated --spec-type list; the n-gram kinds are tried "
               "first, then the draft models, and the FIRST that returns a draft is verified (not the best of all)",
               "`--spec-type ngram-mod,draft-simple -md DRAFT.gguf`",
               "llama.cpp common/speculative.cpp (common_speculative_init's priority list, common_speculative_draft)",
               _LIVE_NGRAM),
    # TensorRT-LLM
    SpecMethod("TensorRT-LLM", "Draft/target", "a separate draft model", "`DraftTargetDecodingConfig` (YAML decoding_type: DraftTarget)",
               "NVIDIA/TensorRT-LLM docs/source/features/speculative-decoding.md; tensorrt_llm/_torch/speculative/draft_target.py",
               _LIVE_DRAFT),
    SpecMethod("TensorRT-LLM", "EAGLE-3", "a head on captured hidden states (chain by default; dynamic-tree files exist)",
               "`EagleDecodingConfig` (decoding_type: Eagle)",
               "NVIDIA/TensorRT-LLM docs/source/features/speculative-decoding.md; tensorrt_llm/_torch/speculative/eagle3.py",
               _LIVE_HEAD),
    SpecMethod("TensorRT-LLM", "MTP", "DeepSeek-style next-n prediction layers", "`MTPDecodingConfig` (decoding_type: MTP)",
               "NVIDIA/TensorRT-LLM docs/source/features/speculative-decoding.md; tensorrt_llm/_torch/speculative/mtp.py",
               _LIVE_MEDUSA),
    SpecMethod("TensorRT-LLM", "n-gram", "prompt lookup from a pool of token prefixes", "`NGramDecodingConfig` (decoding_type: NGram)",
               "NVIDIA/TensorRT-LLM docs/source/features/speculative-decoding.md; tensorrt_llm/_torch/speculative/ngram.py",
               _LIVE_NGRAM),
    SpecMethod("TensorRT-LLM", "PARD", "mask tokens let a target-independent draft predict k tokens in one pass",
               "`PARDDecodingConfig`", "NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py; tensorrt_llm/_torch/speculative/pard.py",
               _LIVE_DRAFT, verified="the class was read in an llm_args.py snapshot; its YAML decoding_type was not"),
    SpecMethod("TensorRT-LLM", "Suffix automaton", "a suffix automaton over the context finds the longest match",
               "unverified (a `SADecodingConfig` is named only in third-party notes)",
               "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative/suffix_automaton.py, sa_worker.py", _LIVE_NGRAM,
               verified="files present; the flag was not read in TensorRT-LLM's own code"),
    SpecMethod("TensorRT-LLM", "DFlash", "block-diffusion draft", "unverified",
               "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative/dflash.py", _LIVE_BLOCK,
               verified="the file is present; its config class was not found"),
]


# ---------------------------------------------------------------------------------------------------
# Recap


@dataclass(frozen=True)
class RecapItem:
    idea: str
    link: PageLink
    where: str


def recap() -> list[RecapItem]:
    """The few ideas to remember, each with the page (and state) where the app shows it; the numbers
    quoted come from the engine."""
    e = expected_tokens_per_pass(0.8, 4)
    be = break_even_alpha(0.3)
    lb = large_batch_mistake()
    return [
        RecapItem("Decoding one token at a time is limited by memory traffic, not arithmetic: every step "
                  "reads all the weights and the whole KV cache.",
                  PageLink("kv-cache", {"preset": "Llama-3.1-8B", "context": 8192, "batch": 1}),
                  "KV-cache size: the roofline table"),
        RecapItem(f"Speculative decoding turns spare compute into fewer target passes: at α = 0.8 and γ = 4 one "
                  f"pass yields {e:.2f} tokens on average, and the output distribution does not change.",
                  PageLink("whatif", {"wi_alpha": 0.8, "wi_gamma": 4, "wi_tab": "Step simulator · Try it"}),
                  "What-if: step simulator"),
        RecapItem("It pays only when the draft agrees often and costs little"
                  + (f": with c = 0.3 it needs α above {be:.2f}." if be is not None else "."),
                  PageLink("whatif", {"wi_alpha": 0.6, "wi_cost": 0.3, "wi_tab": "Analytic model"}),
                  "What-if: analytic model"),
        RecapItem(f"It stops paying at large batches ({lb.speedup_at_1:.2f}× at batch 1 on a 7 B model, "
                  f"{lb.speedup_at_large:.2f}× at batch {lb.large_batch}).",
                  MISTAKE_LINKS["large_batch"], "What-if: when it does not help"),
        RecapItem("Prefix caching skips the prefill of a shared beginning; keep stable text first.",
                  PageLink("prefix-cache", {"pc_preset": "timestamp", "pc_ts": "end"}), "Prefix caching"),
        RecapItem("FlashAttention computes exact attention in tiles and never writes the N × N matrix to main "
                  "memory.", PageLink("flash-attention", {}), "FlashAttention"),
        RecapItem("GQA, MQA and latent attention shrink the KV cache by caching fewer (or smaller) vectors per "
                  "token: a model choice, not a serving switch.",
                  PageLink("kv-cache", {"preset": "Falcon-7B (MQA)"}), "KV-cache size: MHA vs MQA table"),
    ]


MISTAKE_LINKS: dict[str, PageLink] = {
    "large_batch": PageLink("whatif", {"wi_alpha": 0.8, "wi_gamma": 4, "wi_cost": 0.05,
                                       "wi_tab": "When it does not help", "wi_hw": "H100 SXM",
                                       "wi_params_b": 7.0, "wi_max_batch": 1024}),
    "timestamp": PageLink("prefix-cache", {"pc_preset": "timestamp", "pc_ts": "start"}),
    "long_answer": PageLink("prefix-cache", {"pc_preset": "system"}),
    "quality": PageLink("whatif", {"wi_tab": "Distribution check", "wi_toy_rule": "Naive: accept every draft token",
                                   "wi_toy_n": QUALITY_TOY["n"], "wi_toy_seed": QUALITY_TOY["seed"],
                                   "wi_toy_gamma": QUALITY_TOY["gamma"], "wi_toy_target": QUALITY_TOY["target_peak"],
                                   "wi_toy_draft": QUALITY_TOY["draft_peak"], "wi_toy_ctx": QUALITY_TOY["context"]}),
}
"""Pages that reproduce each mistake (the tokenizer mistake is reproduced on the mistakes page itself)."""


def check_link_keys(link: PageLink, page_keys: Sequence[str]) -> list[str]:
    """The parameters of ``link`` that are not among the page's URL keys (empty when all are known)."""
    return [k for k in link.params if k not in set(page_keys)]
