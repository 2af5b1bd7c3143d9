"""Why a measured speedup is what it is, here: the three conditions speculative decoding needs, as one run measured
them on this machine, which one held the speedup back, and what the analytic model predicts from them.

The three conditions (Leviathan et al. 2023, Section 3.4 and Theorem 3.8: speedup = E / (γ·c + t(γ+1)/t(1))):

1. **acceptance**: the target keeps most draft tokens. Measured: α̂ (accepted ÷ judged draft tokens) and the tokens a
   target pass yielded (at most γ + 1).
2. **verify pass**: a target pass over γ + 1 tokens costs about what a pass over one token does. Measured:
   r = t(γ+1) / t(1), the verify pass's time over a plain decode step's, on this machine.
3. **draft step**: a draft step is cheap against a target step. Measured: c = draft time per draft token ÷ t(1).

Predicted speedup: ``analytic.speedup(α̂, γ, c, r)``, the What-if page's analytic model at the run's numbers (its
"with verify cost" curve at slope s = (r − 1)/γ gives the same r). **Which one held it back**: for each condition, the
speedup the model predicts if that condition alone held perfectly (every draft token accepted, E = γ + 1; a verify
pass as cheap as one token, r = 1; a free draft, c = 0), the others as measured; the condition whose perfect value
gains the most is the one that held the speedup back most.

A run is **unsure** (:func:`unsure_reasons`) when its timed runs of one kind differed by more than
``SPREAD_WARN`` (the machine was busy), or when its speedup exceeds its tokens per round (a round costs at least a
plain step, so only noise puts it above): every page that reads the run says so beside its numbers.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from engine.decoding.measure import ABOVE_ROUNDS, SPREAD_WARN, unsure_reasons  # noqa: F401 - the pages read them here
from engine.explain.analytic import GAMMA_MAX, expected_tokens_per_pass, speedup, verify_cost_ratio
from engine.explain.teaching import PageLink

PAYS = 1.15
"""Below this measured speedup the pages offer a case that pays on this machine (:func:`paying_case`)."""
CONDITIONS = ("acceptance", "verify", "draft")


@dataclass
class Condition:
    """One of the three conditions as a run measured it.

    Attributes:
        key: "acceptance", "verify" or "draft". name: a short title.
        measured: what the run measured, in words. ideal: what the condition asks for.
        value: α̂, r or c. if_ideal: the predicted speedup with this condition perfect, the others as measured
            (None when there is no prediction).
        ok: whether the run met the condition well enough not to matter much (the gain if perfect under 10 %).
    """

    key: str
    name: str
    measured: str
    ideal: str
    value: float
    if_ideal: float | None
    ok: bool


@dataclass
class WhyHere:
    """A measured speedup with its three conditions (see the module's docstring).

    Attributes:
        measured: the measured speedup (×). alpha, gamma, tokens_per_pass, verify_ratio (r), c, t1_ms: the run's
            numbers (tokens_per_pass: what the run yielded; ``expected`` what α̂ gives at γ). fed: tokens in the verify
            pass r was read at.
        predicted: the analytic model's speedup at α̂, γ, c, r (None when c is outside [0, 1] or r is unusable:
            ``note`` says why). conditions: the three, in order. limiting: the key of the one that held the speedup
            back most (None without a prediction). unsure: reasons the measurement is unsure (empty: it is not).
        where: the machine and run the numbers come from ("this server", "the recorded race on AMD EPYC, 2026-12-06").
        note: why there is no prediction (None when there is one).
    """

    measured: float | None
    alpha: float
    gamma: int
    tokens_per_pass: float | None
    expected: float
    verify_ratio: float | None
    c: float | None
    t1_ms: float | None
    fed: int
    predicted: float | None
    conditions: list[Condition]
    limiting: str | None
    unsure: list[str] = field(default_factory=list)
    where: str = "this machine"
    note: str | None = None

    def condition(self, key: str) -> Condition:
        return next(c for c in self.conditions if c.key == key)

    def headline(self) -> str:
        """One sentence: the measured speedup, what held it back, the prediction (plain Markdown, no model text)."""
        m = "—" if self.measured is None else f"{self.measured:.2f}×"
        head = f"Measured **{m}** on {self.where}"
        if self.unsure:
            head += " (**unsure**: " + "; ".join(self.unsure) + ")"
        if self.predicted is None:
            return head + ". " + (self.note or "")
        lim = self.condition(self.limiting) if self.limiting else None
        out = head + f"; the analytic model predicts **{self.predicted:.2f}×** from the three conditions below."
        if lim is not None and not lim.ok:
            out += f" What held it back most: **{lim.name.lower()}** ({HELD_BACK[lim.key]}: {lim.if_ideal:.2f}× " \
                   "if it were perfect)."
        elif lim is not None:
            out += " All three conditions hold here."
        return out

    def whatif_link(self) -> PageLink:
        """What-if's analytic model at this run's numbers: α̂, γ, c and the verify slope s = (r − 1)/γ (each in the
        page's range, rounded to its sliders' 0.01 steps)."""
        params: dict = {"wi_tab": "Analytic model", "wi_alpha": round(min(max(self.alpha, 0.0), 1.0), 2),
                        "wi_gamma": min(max(int(self.gamma), 1), GAMMA_MAX)}
        if self.c is not None:
            params["wi_cost"] = round(min(max(self.c, 0.0), 1.0), 2)
        if self.verify_ratio is not None:
            params["wi_slope"] = round(min(max((self.verify_ratio - 1.0) / self.gamma, 0.0), 1.0), 2)
        return PageLink("whatif", params)


HELD_BACK = {"acceptance": "the draft's guesses were often rejected",
             "verify": "a pass over γ + 1 tokens costs more than one here",
             "draft": "a draft step is not cheap against a target step"}
"""What each condition's failure means, in the headline."""


def why_here(*, alpha: float, gamma: int, measured: float | None, t1_ms: float | None, verify_ms: float | None,
             draft_ms_per_token: float | None, tokens_per_pass: float | None = None, fed: int | None = None,
             spread: float | None = None, tokens_per_round: float | None = None, where: str = "this machine",
             unsure: Sequence[str] | None = None, drafted: int | None = None) -> WhyHere:
    """The three conditions of a run and what they predict (see the module's docstring).

    Args:
        alpha: α̂ in [0, 1]. gamma: γ ≥ 1. measured: the measured speedup (None: not measured).
        t1_ms: a plain decode step, the median one-token pass (ms; None: not timed).
        verify_ms: the run's verify pass over ``fed`` tokens (ms; None: not timed).
        draft_ms_per_token: draft time per draft token (ms; None: not timed).
        tokens_per_pass: the tokens a target pass yielded (None: read E(α̂, γ)). fed: tokens of the verify pass timed
            (default γ + 1). spread, tokens_per_round: for :func:`unsure_reasons` (``unsure`` overrides them).
        where: where the run ran, for the headline.
        drafted: the draft length the run's rounds used most (an adaptive draft length or a confidence gate drafts
            fewer than the cap γ): the model is read at it, and so is What-if's link (default γ).
    """
    a = min(max(float(alpha), 0.0), 1.0)
    cap = max(int(gamma), 1)
    g = cap if not drafted or drafted < 1 else min(int(drafted), cap)
    fed = g + 1 if fed is None else int(fed)
    e = expected_tokens_per_pass(a, min(g, 64))
    tpp = e if tokens_per_pass is None else float(tokens_per_pass)
    reasons = list(unsure) if unsure is not None else unsure_reasons(measured, tokens_per_round or tpp, spread)
    ok_t1 = t1_ms is not None and math.isfinite(t1_ms) and t1_ms > 0
    r = verify_ms / t1_ms if ok_t1 and verify_ms is not None and verify_ms > 0 else None
    c = draft_ms_per_token / t1_ms if ok_t1 and draft_ms_per_token is not None and draft_ms_per_token >= 0 else None
    note = None
    if r is None or c is None:
        note = "The run timed no plain decode step to measure the verify pass and the draft step against."
    elif c > 1.0:
        note = (f"A draft step measured {c:.2f}× a target step: the analytic model needs c ≤ 1 (such a draft cannot "
                "pay)" + (", and this run was unsure, so the figure is likely the busy machine's" if reasons else "")
                + ".")
    elif r < 1.0:
        note = (f"The verify pass over {fed} tokens measured faster than a one-token pass (r = {r:.2f}): timing "
                "noise, so no prediction.")
    predicted = None
    gains: dict[str, float | None] = {k: None for k in CONDITIONS}
    if note is None:
        predicted = speedup(a, min(g, 64), c, r)
        gains = {"acceptance": speedup(1.0, min(g, 64), c, r), "verify": speedup(a, min(g, 64), c, 1.0),
                 "draft": speedup(a, min(g, 64), 0.0, r)}

    def ok(key: str) -> bool:
        return predicted is not None and gains[key] is not None and gains[key] < predicted * 1.10

    conds = [
        Condition("acceptance", "Acceptance",
                  f"α̂ {a:.2f}: {tpp:.2f} tokens per target pass (at most {g + 1}"
                  + (f": the rounds drafted {g} most often, under the cap γ = {cap}" if g != cap else "") + ")",
                  "most draft tokens accepted: close to γ + 1 tokens a pass", a, gains["acceptance"], ok("acceptance")),
        Condition("verify", "Verify pass",
                  "—" if r is None else f"a pass over {fed} tokens took {r:.2f}× a one-token pass"
                  + (f" ({verify_ms:.1f} against {t1_ms:.1f} ms)" if ok_t1 and verify_ms else ""),
                  f"a pass over {g + 1} tokens costs what one token's does (1.00×)",
                  float("nan") if r is None else r, gains["verify"], ok("verify")),
        Condition("draft", "Draft step",
                  "—" if c is None else f"a draft step took {c:.3f} of a target step"
                  + (f" ({draft_ms_per_token:.2f} ms a draft token)" if draft_ms_per_token is not None else ""),
                  "a draft step costs a small fraction of a target step (c near 0)",
                  float("nan") if c is None else c, gains["draft"], ok("draft")),
    ]
    limiting = None
    if predicted is not None:
        limiting = max(CONDITIONS, key=lambda k: gains[k])
    return WhyHere(measured=measured, alpha=a, gamma=g, tokens_per_pass=tpp, expected=e, verify_ratio=r, c=c,
                   t1_ms=t1_ms if ok_t1 else None, fed=fed, predicted=predicted, conditions=conds, limiting=limiting,
                   unsure=reasons, where=where, note=note)


def why_from_run(run: object, where: str = "this machine") -> WhyHere | None:
    """The three conditions of a Live run (the ``measured_run`` record, ``engine.decoding.measure.measured_run``),
    read at the draft length its rounds used most (``draft_length_counts``; γ without them), or None before Run
    baseline (no measured speedup, or no timed one-token pass t(1))."""
    measured = getattr(run, "measured_speedup", None)
    curve = getattr(run, "verify_ms_by_tokens", None) or {}
    try:
        gamma, alpha, t1 = int(getattr(run, "gamma")), float(getattr(run, "acceptance_rate")), float(curve[1])
        measured = float(measured)
    except (AttributeError, KeyError, TypeError, ValueError):  # before Run baseline, or a record lacking a field
        return None
    if not (math.isfinite(measured) and 0.0 <= alpha <= 1.0 and gamma >= 1):
        return None
    n_new, n_rounds = getattr(run, "new_tokens", None), getattr(run, "n_rounds", None)
    tpr = n_new / n_rounds if n_new and n_rounds else None
    unsure = getattr(run, "unsure", None)
    lengths = {int(k): int(v) for k, v in (getattr(run, "draft_length_counts", None) or {}).items() if int(k) > 0}
    drafted = max(lengths, key=lambda n: (lengths[n], n)) if lengths else None
    try:
        verify = verify_cost_ratio(min(drafted or gamma, gamma) + 1, measured_ms=curve) * t1
    except Exception:  # noqa: BLE001 - an unusable curve: no verify figure
        verify = None
    return why_here(drafted=drafted, alpha=alpha, gamma=gamma, measured=measured, t1_ms=t1,
                    verify_ms=verify, draft_ms_per_token=getattr(run, "draft_ms_per_token", None),
                    tokens_per_pass=tpr, tokens_per_round=tpr, spread=getattr(run, "spread", None),
                    unsure=unsure, where=where)


def why_from_race(race, where: str = "this server") -> WhyHere | None:
    """The three conditions of a race (``engine.decoding.race.Race``) from its lanes: α̂ from the speculative lane's
    judged draft tokens, t(1) the plain lane's median step, the verify pass the speculative lane's median pass after
    the draft length its rounds used most (else over the size it ran most), c its median draft time per draft token ÷ t(1). None for a race
    whose speculative lane judged no draft token or whose plain lane timed no step."""
    spec, plain = race.spec, race.plain
    judged = [m for r in spec.rounds for m in r.draft if m.verdict in ("accepted", "rejected")]
    steps = [s.ms for s in plain.spans if s.kind == "step" and s.ms > 0]
    if not judged or not steps:
        return None
    gamma = int(race.settings.get("gamma", 1))
    alpha = sum(m.verdict == "accepted" for m in judged) / len(judged)
    verifies = [s for s in spec.spans if s.kind == "verify" and 0 < s.tokens <= gamma + 1 and s.ms > 0]
    # the draft length the rounds used most (an adaptive length drafts under the cap γ), and its verify pass
    sizes = [s.tokens for s in spec.spans if s.kind == "draft" and 0 < s.tokens <= gamma]
    drafted = max(set(sizes), key=lambda n: (sizes.count(n), n)) if sizes else gamma
    fed = drafted + 1
    if verifies and not any(s.tokens == fed for s in verifies):
        fed = max(set(x.tokens for x in verifies), key=lambda n: ([x.tokens for x in verifies].count(n), n))
    v = [s.ms for s in verifies if s.tokens == fed]
    drafts = [s.ms / s.tokens for s in spec.spans if s.kind == "draft" and s.tokens > 0]
    tpp = spec.tokens_per_pass
    reasons = unsure_reasons(race.speedup, tpp, race.spread)
    if getattr(race, "others_max", 0) or getattr(race, "rows_max", 0) > 1:
        reasons.append("other readers decoded on this server meanwhile")
    return why_here(alpha=alpha, gamma=gamma, measured=race.speedup, t1_ms=statistics.median(steps),
                    verify_ms=statistics.median(v) if v else None,
                    draft_ms_per_token=statistics.median(drafts) if drafts else 0.0, tokens_per_pass=tpp, fed=fed,
                    unsure=reasons, where=where, drafted=max(min(fed - 1, gamma), 1))


# ---------------------------------------------------------------------------------------------- a case that pays


@dataclass
class PayingCase:
    """A configuration a benchmark measured paying on a machine (the pages' one-click "a case that pays").

    Attributes:
        label: what it is, in words. low, high: the measured speedups (×) over its runs. machine, date: where and
        when. file: the result's file name. race: the Race page's settings that open it (``rc_*`` keys).
        here: whether the result is this machine's (its file is named for this kind of CPU)."""

    label: str
    low: float
    high: float
    machine: str
    date: str
    file: str
    race: dict
    here: bool = False

    def speedup_text(self) -> str:
        return f"{self.low:.2f}×" if abs(self.high - self.low) < 0.005 else f"{self.low:.2f}–{self.high:.2f}×"

    def sentence(self) -> str:
        """Its measured speedup, with the machine named in the sentence when it is not this one."""
        here = self.here
        on = f"on this machine ({self.machine}, {self.date})" if here else f"on another machine, an {self.machine} " \
            f"({self.date}; this machine has not measured it)"
        return f"{self.label}: **{self.speedup_text()}** measured {on}, texts identical."

    def link(self) -> PageLink:
        return PageLink("race", dict(self.race))


PAYING_DRAFT, PAYING_PRESET = "ngram", "code"
"""The case the pages offer: prompt lookup on a code edit (the text repeats its prompt)."""


def paying_case(path: str | Path | None = None) -> PayingCase | None:
    """The best-paying measured race of prompt lookup on the code edit (``benchmarks/bench_race.py``'s result for this
    machine, else the reference machine's: ``engine.explain.measured.result_path``), or None when no result has one.
    """
    from engine.explain.measured import machine_slug, result_path

    path = result_path("race") if path is None else Path(path)
    try:
        d = json.loads(Path(path).read_text())
        rows = [r for r in d["races"] if r.get("draft") == PAYING_DRAFT and r.get("preset") == PAYING_PRESET
                and r.get("identical", True) and float(r.get("temperature", 0)) == 0]
        speeds = [float(r["speedup"]) for r in rows if r.get("speedup")]
        meta = d.get("meta", {})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not speeds:
        return None
    gamma = int(rows[0].get("gamma", 4))
    date = str(meta.get("date") or meta.get("measured_at") or "")[:10] or _date_from_md(Path(path))
    return PayingCase(label=f"Prompt lookup on a code edit (γ = {gamma})", low=min(speeds), high=max(speeds),
                      machine=str(meta.get("cpu", "another machine")), date=date, file=Path(path).name,
                      race={"rc_preset": PAYING_PRESET, "rc_draft": PAYING_DRAFT, "rc_gamma": gamma, "rc_tree": 0,
                            "rc_temp": 0.0},
                      here=Path(path).name == f"race_{machine_slug()}.json")


def _date_from_md(path: Path) -> str:
    """The first ISO date in the result's Markdown twin (its header says when it ran), or "date not recorded"."""
    import re

    try:
        m = re.search(r"20\d\d-\d\d-\d\d", path.with_suffix(".md").read_text())
    except OSError:
        m = None
    return m.group(0) if m else "date not recorded"
