"""Measuring a speculative run against plain decoding: the A/B timing (alternating runs, medians) and
the baseline comparison that the Live page, the command line and What-if's "My measured numbers" use.

Speed claims follow one rule: both kinds run to the end with nothing drawn in between, in alternating
order (A B B A …), and the medians are compared (see ``measure_speedup_ab``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from types import SimpleNamespace

from engine.decoding.trace import AFTER_END, Round, RunStats


@dataclass
class BaselineComparison:
    """A speculative run against the plain (no-draft) run of the same prompt, settings and seed.

    Attributes:
        speedup: baseline ms per token ÷ speculative ms per token, prefill included in both; equal to
            baseline total_ms ÷ speculative total_ms when both generated the same number of tokens.
        identical: the two token sequences are equal (expected under greedy decoding, up to ties
            in floating point; under sampling they differ and only the distribution is the same).
        same_length: both generated the same number of tokens.
        spec_tokens_per_s, base_tokens_per_s: throughput of each run.
        first_difference: index of the first differing token (None if identical / prefix).
    """

    speedup: float | None
    identical: bool
    same_length: bool
    spec_tokens_per_s: float | None
    base_tokens_per_s: float | None
    first_difference: int | None


def compare_baseline(spec_ids: list[int], spec: RunStats, base_ids: list[int],
                     base: RunStats) -> BaselineComparison:
    """Measured speedup of a speculative run over its baseline (see ``BaselineComparison``)."""
    speedup = None
    if spec.new_tokens and base.new_tokens and spec.total_ms > 0 and base.total_ms > 0:
        speedup = (base.total_ms / base.new_tokens) / (spec.total_ms / spec.new_tokens)
    return BaselineComparison(speedup=speedup, identical=list(spec_ids) == list(base_ids),
                              same_length=len(spec_ids) == len(base_ids),
                              spec_tokens_per_s=spec.tokens_per_s, base_tokens_per_s=base.tokens_per_s,
                              first_difference=_first_difference(spec_ids, base_ids))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), or None."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return first


@dataclass
class SpeedupAB:
    """Speculative and plain decoding of the same prompt, settings and seed, timed back to back.

    Attributes:
        order: "spec" / "base" for each run, in the order they ran (A B B A …).
        spec_ms_per_token, base_ms_per_token: each run's total time (prefill included) ÷ its new tokens,
            in ms, in run order.
        spec_ids, base_ids: the tokens of each kind's median run (every run of a kind gives the same
            tokens: the decoders are seeded).
        spec_stats, base_stats: ``RunStats`` of each kind's median run, the run whose ms per token is
            the median (the middle one for an odd number of runs; the faster middle one for an even
            number), so that its tokens/s, prefill and total time agree with the medians shown.
        spec_rounds: the rounds of the median speculative run (their draft and verify times).
    """

    order: list[str]
    spec_ms_per_token: list[float]
    base_ms_per_token: list[float]
    spec_ids: list[int]
    base_ids: list[int]
    spec_stats: RunStats
    base_stats: RunStats
    spec_rounds: list[Round] = field(default_factory=list)

    @property
    def reps(self) -> int:
        return min(len(self.spec_ms_per_token), len(self.base_ms_per_token))

    SPREAD_WARN = 1.5  # runs of one kind further apart than this (slowest ÷ fastest): the machine was busy

    @property
    def noisy(self) -> bool:
        """Whether the runs of one kind differed by more than ``SPREAD_WARN`` (the speedup is unsure)."""
        return self.spread > self.SPREAD_WARN

    @property
    def spread(self) -> float:
        """The larger, over the two kinds, of slowest ÷ fastest run (ms per token): 1 on a quiet machine;
        well above 1 means the machine was busy and the medians are unsure."""
        return max(max(v) / min(v) for v in (self.spec_ms_per_token, self.base_ms_per_token))

    @property
    def speedup(self) -> float:
        """Median baseline ms per token ÷ median speculative ms per token."""
        return statistics.median(self.base_ms_per_token) / statistics.median(self.spec_ms_per_token)

    def comparison(self, spec_ids: list[int] | None = None) -> BaselineComparison:
        """A ``BaselineComparison`` from the medians; ``spec_ids`` (default: the timed run's) are the tokens
        compared with the baseline's."""
        spec_ids = self.spec_ids if spec_ids is None else list(spec_ids)
        return BaselineComparison(
            speedup=self.speedup, identical=spec_ids == self.base_ids, same_length=len(spec_ids) == len(self.base_ids),
            spec_tokens_per_s=1000.0 / statistics.median(self.spec_ms_per_token),
            base_tokens_per_s=1000.0 / statistics.median(self.base_ms_per_token),
            first_difference=_first_difference(spec_ids, self.base_ids))


SPREAD_WARN = SpeedupAB.SPREAD_WARN
"""Timed runs of one kind further apart than this (slowest ÷ fastest ms per token): the machine was busy."""
ABOVE_ROUNDS = 1.02
"""A measured speedup above the run's tokens per round × this is noise (a round costs at least a plain step)."""


def unsure_reasons(speedup_x: float | None, tokens_per_round: float | None, spread: float | None) -> list[str]:
    """Why a measured speedup is unsure (empty: it is not), in words a page puts after "Unsure: ".

    Args:
        speedup_x: the measured speedup (None: none measured, nothing to doubt).
        tokens_per_round: the run's new tokens ÷ rounds (None: unknown).
        spread: slowest ÷ fastest timed run of one kind, the larger of the two kinds (None: unknown).
    """
    if speedup_x is None:
        return []
    why = []
    if spread is not None and spread > SPREAD_WARN:
        why.append(f"the timed runs of one kind differed by up to {spread:.1f}×")
    if tokens_per_round and speedup_x > tokens_per_round * ABOVE_ROUNDS:
        why.append(f"it is above the {tokens_per_round:.2f} tokens a round gave, which bounds it (a round costs at "
                   "least a plain step)")
    return why


def measure_speedup_ab(make_spec, make_base, reps: int = 2, on_progress=None) -> SpeedupAB:
    """Time speculative against plain decoding: ``reps`` runs of each, alternating A B B A A B …, each run
    to its end with nothing drawn between rounds (a page that redraws while a run computes slows the run
    it measures; the draft's many small steps the most). The guide's rule for speed claims, in small.

    Args:
        make_spec, make_base: build a fresh, seeded ``SpeculativeDecoder`` (the speculative one and the
            baseline, ``proposer=None``); called once per run.
        reps: runs of each kind, ≥ 1.
        on_progress: ``on_progress(done, total, kind)`` before each run ("spec" or "base").

    Raises:
        ValueError: if reps < 1. Errors of the builders and decoders propagate (InputError, …).
    """
    if reps < 1:
        raise ValueError(f"reps must be ≥ 1, got {reps}")
    order = [k for i in range(reps) for k in (("spec", "base") if i % 2 == 0 else ("base", "spec"))]
    ms = {"spec": [], "base": []}
    runs = {"spec": [], "base": []}
    for i, kind in enumerate(order):
        if on_progress is not None:
            on_progress(i, len(order), kind)
        dec = (make_spec if kind == "spec" else make_base)()
        dec.run()
        st = dec.stats()
        ms[kind].append(st.total_ms / max(st.new_tokens, 1))
        runs[kind].append((list(dec.new_ids), st, list(getattr(dec, "rounds", []))))

    def median_run(kind: str):
        by_time = sorted(range(len(ms[kind])), key=ms[kind].__getitem__)
        return runs[kind][by_time[(len(by_time) - 1) // 2]]

    spec, base = median_run("spec"), median_run("base")
    return SpeedupAB(order=order, spec_ms_per_token=ms["spec"], base_ms_per_token=ms["base"],
                     spec_ids=spec[0], base_ids=base[0], spec_stats=spec[1], base_stats=base[1],
                     spec_rounds=spec[2])


def measured_run(stats: RunStats, gamma: int, measured_speedup: float | None,
                 base_stats: RunStats | None = None, rounds: list[Round] | None = None,
                 spread: float | None = None) -> SimpleNamespace | None:
    """The record the what-if page reads from ``st.session_state["measured_run"]``, or None while the
    run has no measured α or c yet (nothing judged, or no draft time).

    ``base_stats`` (the baseline's, after Run baseline) supplies t(1), the plain decode step's median
    time, as the curve's 1-token point: what-if needs it for the verify-cost prediction and to express
    c per decode step (``engine.explain.analytic.compare_with_measured``). ``rounds`` (the rounds of the run
    ``stats`` describes: ``SpeedupAB.spec_rounds`` after Run baseline) add what the prediction from the run
    needs (``engine.explain.analytic.predict_from_run``): see :func:`run_profile`. ``spread`` (the A/B's
    ``SpeedupAB.spread``) and the run's tokens per round decide whether the measured speedup is unsure
    (``engine.explain.why.unsure_reasons``): the record's ``unsure`` lists why (empty: it is not), so every page
    that reads the run says so beside its numbers."""

    if stats.acceptance_rate is None or stats.draft_cost_ratio is None:
        return None
    sp = measured_speedup if measured_speedup is not None and math.isfinite(measured_speedup) else None
    curve = {int(k): float(v) for k, v in stats.verify_ms_by_tokens.items()}
    if base_stats is not None and 1 in base_stats.verify_ms_by_tokens:
        curve[1] = float(base_stats.verify_ms_by_tokens[1])
    rec = SimpleNamespace(acceptance_rate=float(stats.acceptance_rate),
                          draft_cost_ratio=float(stats.draft_cost_ratio),
                          draft_ms_per_token=stats.draft_ms_per_token,
                          verify_ms_by_tokens=dict(sorted(curve.items())),
                          measured_speedup=sp, gamma=int(gamma), spread=spread,
                          unsure=unsure_reasons(sp, stats.tokens_per_round, spread))
    if rounds:
        vars(rec).update(run_profile(rounds, stats, base_stats))
    return rec


def run_profile(rounds: list[Round], stats: RunStats, base_stats: RunStats | None = None) -> dict:
    """What a speculative run did, round by round, for the prediction from the run
    (``engine.explain.analytic.predict_from_run``). ``stats`` are ``run_stats`` of ``rounds``; ``base_stats``
    those of the plain-decoding run it was timed against (None: no baseline yet).

    Returns a dict (the ``measured_run`` record's extra fields; times in ms, counts in rounds):
        new_tokens, n_rounds: tokens generated and rounds of the run.
        draft_length_counts: {draft tokens proposed in a round: rounds} (0 = a round with no draft, e.g.
            prompt lookup without a match: it still costs a target pass).
        verify_tokens_counts: {tokens fed to the target in the round's pass: rounds}, 0 for a round with no
            pass; the round whose pass also prefilled the prompt counts as its draft length + 1 (the pass it
            stands for in a steady state; its real time is ``prefill_ms``).
        prefill_round_tokens: that draft length + 1 (None when the prefill ran as a pass of its own).
        acceptance_by_position: α̂ at draft position i (P(accept at i | all before accepted), as
            ``RunStats.acceptance_by_position``); judged_by_position: how many times each was judged.
        prefill_ms: the target's prefill pass (the fused first verify pass when ``prefill_round_tokens``).
        draft_prefill_ms: the draft's own pass over the prompt: the first drafting round's draft time beyond
            c's per-token time (``RunStats.draft_ms_per_token`` leaves that round out); 0 when it was not
            left out.
        overhead_ms_per_round: wall time per round outside the draft and verify timers (the decoder's
            bookkeeping: top-5 lists, trace records, KV crops): (total − separate prefill − Σ draft
            − Σ verify) ÷ rounds.
        base_new_tokens, base_prefill_ms, base_overhead_ms_per_round: the same for the baseline run (None
            without one); its passes' sum is verify_ms_mean × its one-token passes.
    """
    fused = next((r for r in rounds if r.prefill_tokens), None)
    lengths: dict[int, int] = {}
    fed: dict[int, int] = {}
    judged: dict[int, int] = {}
    for r in rounds:
        lengths[r.n_drafted] = lengths.get(r.n_drafted, 0) + 1
        n = r.n_drafted + 1 if r is fused else r.tokens_verified
        fed[n] = fed.get(n, 0) + 1
        for i, d in enumerate(r.drafted):
            if d.verdict in ("discarded", AFTER_END):
                break
            judged[i] = judged.get(i, 0) + 1
    drafting = [r for r in rounds if r.n_drafted]
    draft_prefill = 0.0
    if len(drafting) > 1 and stats.draft_ms_per_token is not None:  # run_stats left the first one out of c
        draft_prefill = max(drafting[0].draft_ms - stats.draft_ms_per_token * drafting[0].n_drafted, 0.0)
    sum_draft = sum(r.draft_ms for r in rounds)
    sum_verify = sum(r.verify_ms for r in rounds if r is not fused)
    overhead = stats.total_ms - stats.prefill_ms - sum_draft - sum_verify
    out = dict(new_tokens=stats.new_tokens, n_rounds=len(rounds),
               draft_length_counts=dict(sorted(lengths.items())), verify_tokens_counts=dict(sorted(fed.items())),
               prefill_round_tokens=None if fused is None else fused.n_drafted + 1,
               acceptance_by_position=list(stats.acceptance_by_position),
               judged_by_position=[judged[i] for i in sorted(judged)],
               prefill_ms=float(stats.prefill_ms), draft_prefill_ms=float(draft_prefill),
               overhead_ms_per_round=max(overhead, 0.0) / len(rounds),
               base_new_tokens=None, base_prefill_ms=None, base_overhead_ms_per_round=None)
    if base_stats is not None and base_stats.rounds and base_stats.verify_ms_mean is not None:
        passes = base_stats.target_passes - 1  # its one-token passes (the prefill is a pass of its own)
        base_over = base_stats.total_ms - base_stats.prefill_ms - base_stats.verify_ms_mean * passes
        out.update(base_new_tokens=base_stats.new_tokens, base_prefill_ms=float(base_stats.prefill_ms),
                   base_overhead_ms_per_round=max(base_over, 0.0) / base_stats.rounds)
    return out
