"""The race: plain and speculative decoding of one prompt on the loaded target, timed one after the other on this
machine and replayed side by side at their measured pace.

One CPU cannot run two lanes at once without each slowing the other, so the lanes are measured alone, in
alternating order (A B B A A B: ``engine.decoding.measure.measure_speedup_ab``, after a short warm-up of both kinds),
and the run of each kind at the median is replayed on one shared clock. While a lane runs, each round is timed from
the outside (when ``SpeculativeDecoder.step`` began and returned, on ``time.perf_counter``) and from the inside
(the round's own ``draft_ms`` and ``verify_ms``, and the prefill's ``prefill_ms``), which gives the lane's
timeline:

- every token appears when the step that emitted it returned (plain decoding: one target pass a token; speculative:
  the accepted draft tokens and the target's correction or bonus token of a round at once);
- every target pass (the prompt's prefill, each plain step, each verify pass) and each round's draft phase is a
  span [start, end) in ms from the lane's start: inside a step, the prefill (when it ran as a pass of its own), then
  the draft phase, then the target pass, laid end to end from the step's start with their measured durations; the
  rest of the step, up to its measured end, is the decoder's bookkeeping (judging's trace records, KV crops), left
  as a gap. A draft phase of several steps (a draft model, the head, early exit: one call per draft token) is
  measured as a whole; ``LaneRound.draft_steps`` says how many steps it had.

The playback model (``lane_at``, ``race_at``, ``replayed_speedup``) is what the page's animation draws: at time t
on the shared clock, a lane shows the tokens and spans recorded at or before t, so it plays at its measured pace.

Sources: speculative decoding's round (Leviathan et al. 2023, Algorithm 1); the speed rule (both kinds run to the
end with nothing drawn in between, alternating, medians) is the project's own (``engine.decoding.measure``).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from engine.decoding.measure import measure_speedup_ab
from engine.decoding.trace import AFTER_END, RunStats, token_origins
from engine.errors import InputError, SpeedupLabError

PLAIN, SPEC = "plain", "speculative"
SPAN_KINDS = ("prefill", "draft", "verify", "step")
"""Kinds of timeline spans: the prompt's own target pass; a round's draft phase; a speculative round's target pass
(which judges its draft); a plain decoding step's target pass."""
PASS_KINDS = ("prefill", "verify", "step")
"""The span kinds that are target passes."""
WARM_ROUNDS = 3
"""Rounds of each kind run, and thrown away, before the timed runs: the first calls of a draft and of the target's
kernels pay one-time costs (lazy loading, allocations) the audience's race should not."""
REPS = 3
"""Timed runs of each kind: A B B A A B (A speculative, B plain). Three, so the run replayed for each kind is its
median one: with two, the replay was each kind's faster run and its ratio stood up to 0.14× from the median ratio
over all timed runs that the page states beside it (1.17× against 1.31×, a sampled race on the AMD EPYC)."""
RACE_VERSION = 1


class RaceStopped(SpeedupLabError):
    """The reader stopped the race before it ended (nothing is replayed)."""


@dataclass
class Span:
    """One stretch of a lane's timeline.

    Attributes:
        kind: one of ``SPAN_KINDS``.
        start_ms, end_ms: from the lane's start, ms (start ≤ end).
        round: index of the round it belongs to (None for a prefill pass of its own).
        tokens: tokens the target processed in the pass (prompt tokens for a prefill; for a draft phase, the draft
            tokens it proposed).
    """

    kind: str
    start_ms: float
    end_ms: float
    round: int | None
    tokens: int

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class DraftMark:
    """One draft token of a speculative round, as the verify pass judged it (the hover of the round's bars).

    Attributes:
        text: the token's text. verdict: "accepted", "rejected", "discarded" or ``AFTER_END``.
        p, q: the target's and the draft's probability of the token.
    """

    text: str
    verdict: str
    p: float
    q: float


@dataclass
class LaneRound:
    """One round of a lane: when its step ran, what it drafted and kept.

    Attributes:
        index: 0-based round number. start_ms, end_ms: its step, from the lane's start.
        draft: the judged draft tokens (empty for plain decoding). draft_steps: the draft phase's steps (calls of
            the draft: one per draft token for a draft model, the head and early exit; one for Medusa heads and the
            block drafter; none for prompt lookup, which looks tokens up).
        n_accepted: draft tokens kept. next_text, next_kind: the target's own token ("correction", "bonus" or
            "plain"); next_text is "" when an accepted end-of-sequence draft token ended the output.
        emitted: tokens the round added. others: other readers decoding on this server when the round began
            (``run_race``'s ``busy``; 0 when nobody was asked). rows: rows of the room's last pass when the round
            returned (``run_race``'s ``pass_rows``: the shared pass that served it, other readers' rows included; 0
            when not asked).
        prefill_tokens: prompt tokens its target pass also processed (the prefill fused into the first verify pass,
            as prompt lookup, a draft model and early exit do); 0 otherwise.
    """

    index: int
    start_ms: float
    end_ms: float
    draft: list[DraftMark]
    draft_steps: int
    n_accepted: int
    next_text: str
    next_kind: str
    emitted: int
    others: int = 0
    prefill_tokens: int = 0
    rows: int = 0


@dataclass
class TokenMark:
    """One generated token: when it appeared (ms from the lane's start), what it is, where it came from.

    ``origin`` is one of ``engine.decoding.trace.ORIGINS`` ("accepted", "correction", "bonus", "plain")."""

    t_ms: float
    token_id: int
    text: str
    origin: str
    round: int


@dataclass
class Lane:
    """One lane of the race: a decoder's run with its timeline.

    Attributes:
        kind: ``PLAIN`` or ``SPEC``. label: what drafted ("plain decoding" for the plain lane).
        wall_ms: the lane's clock at its end: from the first step's start to the last step's end (ms).
        total_ms: the decoder's own total time (``RunStats.total_ms``: prefill + every round's step).
        tokens: every generated token, in order. spans: the timeline, in order. rounds: every round.
        text: the decoded text. target_passes, tokens_per_pass: ``RunStats``'s. acceptance_by_position:
            α̂ by draft position (P(accept at i | all before accepted)), empty for plain decoding.
    """

    kind: str
    label: str
    wall_ms: float
    total_ms: float
    tokens: list[TokenMark]
    spans: list[Span]
    rounds: list[LaneRound]
    text: str
    target_passes: int
    tokens_per_pass: float | None
    acceptance_by_position: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def ttft_ms(self) -> float | None:
        """Time to the first token (ms from the lane's start: the prompt's prefill included); None without one."""
        return self.tokens[0].t_ms if self.tokens else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens ÷ the lane's wall time (the pace it plays at)."""
        return self.new_tokens / (self.wall_ms / 1000) if self.wall_ms > 0 and self.tokens else None

    @property
    def pass_ms(self) -> float:
        """Σ of the spans' durations (target passes and draft phases): the bars drawn under the lane."""
        return sum(s.ms for s in self.spans)

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def others_max(self) -> int:
        """The most other readers decoding on this server while a round of the lane began."""
        return max((r.others for r in self.rounds), default=0)

    @property
    def rows_max(self) -> int:
        """The most rows a pass that served a round of the lane had (0: not recorded; 1: every pass its own)."""
        return max((r.rows for r in self.rounds), default=0)

    def tokens_per_pass_counts(self) -> dict[int, int]:
        """{tokens a target pass yielded: passes}, over every target pass of the lane (Σ passes = the lane's target
        passes, Σ tokens · passes = its tokens). A round with a pass yields its emitted tokens (a plain step 1; a
        speculative round its accepted tokens + 1); a prefill pass of its own yields the tokens of the rounds that
        ran no pass after it (their p came with its logits: plain decoding's first token), possibly 0 (a draft
        head's prefill: its first round's verify pass gives the first tokens)."""
        passes = {s.round for s in self.spans if s.kind in ("verify", "step")}
        counts: dict[int, int] = {}
        from_prefill = 0
        for r in self.rounds:
            if r.index in passes:
                counts[r.emitted] = counts.get(r.emitted, 0) + 1
            else:
                from_prefill += r.emitted
        n_prefill = sum(1 for s in self.spans if s.kind == "prefill")
        if n_prefill:
            counts[from_prefill] = counts.get(from_prefill, 0) + n_prefill
        return dict(sorted(counts.items()))


def _draft_steps(proposer, rnd) -> int:
    """How many calls of the draft its round's draft phase made (see ``LaneRound.draft_steps``)."""
    if proposer is None or not rnd.drafted:
        return 0
    name = type(proposer).__name__
    if name == "PromptLookupProposer":
        return 0
    if name in ("MedusaProposer", "BlockProposer"):
        return 1
    if rnd.tree is not None:  # a tree grown depth by depth: one call per depth
        return max((n.depth for n in rnd.tree.nodes), default=0)
    return rnd.n_drafted


def record_lane(decoder, kind: str, label: str, clock: Callable[[], float] = time.perf_counter,
                should_stop: Callable[[], bool] | None = None, busy: Callable[[], int] | None = None,
                pass_rows: Callable[[], int] | None = None) -> Lane:
    """Run ``decoder`` (a fresh ``SpeculativeDecoder``) to its end, one ``step`` at a time, and record its timeline
    (see the module docstring for how each span is placed).

    Args:
        decoder: a fresh decoder (no round run yet).
        kind: ``PLAIN`` or ``SPEC``; label: what the lane shows as its draft.
        clock: seconds (``time.perf_counter``; tests pass a fake one).
        should_stop: returning True between rounds stops the race.
        busy: other readers decoding on this server now (asked when each round begins; None: not asked).
        pass_rows: rows of the last pass of the room the decoder steps through (asked when each round returns;
            None: not asked).

    Returns:
        the ``Lane``; its tokens are those of ``decoder.new_ids``.

    Raises:
        InputError: a decoder that has run already, or an unknown kind. RaceStopped: ``should_stop``. The
        decoder's own errors propagate.
    """
    if kind not in (PLAIN, SPEC):
        raise InputError(f"A lane is {PLAIN!r} or {SPEC!r}, got {kind!r}.")
    if decoder.rounds:
        raise InputError("record_lane needs a fresh decoder (this one has run rounds already).")
    spans: list[Span] = []
    rounds: list[LaneRound] = []
    marks: list[TokenMark] = []
    t0 = clock()
    end = 0.0
    while not decoder.finished:
        if should_stop is not None and should_stop():
            raise RaceStopped("The race was stopped before it ended.")
        others = int(busy()) if busy is not None else 0
        start = (clock() - t0) * 1000
        prefill_before = decoder.prefill_ms
        rnd = decoder.step()
        end = (clock() - t0) * 1000
        if rnd is None:  # a room's step that was cancelled (``ScheduledDecoder.step``)
            raise RaceStopped("The race was stopped before it ended.")
        rows = int(pass_rows()) if pass_rows is not None else 0
        cursor = start
        if not rnd.prefill_tokens and decoder.prefill_ms != prefill_before:  # the prompt's pass of its own
            spans.append(Span("prefill", cursor, min(cursor + decoder.prefill_ms, end), None,
                              len(decoder.prompt_ids)))
            cursor = spans[-1].end_ms
        if decoder.proposer is not None and (rnd.n_drafted or rnd.draft_ms > 0):
            spans.append(Span("draft", cursor, min(cursor + rnd.draft_ms, end), rnd.index, rnd.n_drafted))
            cursor = spans[-1].end_ms
        if rnd.tokens_verified > 0:  # a round whose p came with the prefill's logits ran no pass
            spans.append(Span("verify" if kind == SPEC else "step", cursor, min(cursor + rnd.verify_ms, end),
                              rnd.index, rnd.tokens_verified))
        draft = [DraftMark(d.text, d.verdict, float(d.p), float(d.q)) for d in rnd.drafted]
        rounds.append(LaneRound(index=rnd.index, start_ms=start, end_ms=end, draft=draft,
                                draft_steps=_draft_steps(decoder.proposer, rnd), n_accepted=rnd.n_accepted,
                                next_text="" if rnd.ended_in_draft else rnd.next_text, next_kind=rnd.next_kind,
                                emitted=len(rnd.emitted_ids), others=others, prefill_tokens=rnd.prefill_tokens,
                                rows=rows))
        eos = getattr(getattr(decoder, "target", None), "eos_token_ids", ())
        for tok, origin in token_origins([rnd]):
            # the end of the sequence is no text (the lane's text leaves special tokens out, as the result does)
            text = "" if tok in eos else decoder.token_text(tok)
            marks.append(TokenMark(end, tok, text, origin, rnd.index))
    stats = decoder.stats()
    return Lane(kind=kind, label=label, wall_ms=end, total_ms=stats.total_ms, tokens=marks, spans=spans,
                rounds=rounds, text=decoder.result().text, target_passes=stats.target_passes,
                tokens_per_pass=stats.tokens_per_target_pass,
                acceptance_by_position=list(stats.acceptance_by_position) if kind == SPEC else [])


class _Recorder:
    """A decoder whose ``run`` records its lane (for ``measure_speedup_ab``, which calls ``run``, ``stats``,
    ``new_ids`` and ``rounds``); ``stats`` returns one object, so the run a measurement kept can be found."""

    def __init__(self, decoder, kind: str, label: str, should_stop, busy, pass_rows=None):
        self.decoder, self.kind, self.label = decoder, kind, label
        self.should_stop, self.busy, self.pass_rows = should_stop, busy, pass_rows
        self.lane: Lane | None = None
        self._stats: RunStats | None = None

    def run(self):
        self.lane = record_lane(self.decoder, self.kind, self.label, should_stop=self.should_stop, busy=self.busy,
                                pass_rows=self.pass_rows)
        self._stats = self.decoder.stats()
        return self.decoder.result()

    def stats(self) -> RunStats:
        return self._stats if self._stats is not None else self.decoder.stats()

    @property
    def new_ids(self) -> list[int]:
        return self.decoder.new_ids

    @property
    def rounds(self):
        return self.decoder.rounds


@dataclass
class Race:
    """A recorded race (JSON: ``to_dict`` / ``from_dict``).

    Attributes:
        settings: what was raced (prompt, draft, γ, tree, temperature, seed, max new tokens; free-form strings and
            numbers, shown as they are).
        plain, spec: the lanes replayed (each kind's run at the median of its timed runs:
            ``engine.decoding.measure.SpeedupAB``'s rule, the faster of the two middle runs for an even count).
        order: the timed runs' kinds in the order they ran ("spec" / "base"). spec_ms_per_token,
            base_ms_per_token: every timed run's total time ÷ its tokens (ms), in run order.
        greedy: temperature 0 (the texts must then be identical token for token).
        machine: the CPU (and threads, compute path) it was measured on. measured_at: ISO date and time.
        warm_ms: the warm-up. measure_ms: the timed runs, with the decoders' construction.
        others_max: the most other readers decoding on the server while a timed round began. rows_max: the most
            rows a pass serving a timed round had (the room's shared passes; 0: not recorded).
    """

    settings: dict
    plain: Lane
    spec: Lane
    order: list[str]
    spec_ms_per_token: list[float]
    base_ms_per_token: list[float]
    greedy: bool
    machine: str
    measured_at: str
    warm_ms: float = 0.0
    measure_ms: float = 0.0
    others_max: int = 0
    rows_max: int = 0

    @property
    def speedup(self) -> float | None:
        """The replayed lanes' wall-clock speedup: speculative tokens/s ÷ plain tokens/s (the lanes' own clocks)."""
        a, b = self.spec.tokens_per_s, self.plain.tokens_per_s
        return a / b if a and b else None

    @property
    def ab_speedup(self) -> float | None:
        """Median plain ms per token ÷ median speculative ms per token over every timed run (the Live page's
        measured speedup, ``SpeedupAB.speedup``)."""
        import statistics

        if not self.spec_ms_per_token or not self.base_ms_per_token:
            return None
        return statistics.median(self.base_ms_per_token) / statistics.median(self.spec_ms_per_token)

    @property
    def spread(self) -> float:
        """Slowest ÷ fastest timed run of one kind, the larger of the two kinds (1 on a quiet machine)."""
        return max((max(v) / min(v) for v in (self.spec_ms_per_token, self.base_ms_per_token) if v), default=1.0)

    @property
    def identical(self) -> bool:
        return self.spec.token_ids == self.plain.token_ids

    @property
    def first_difference(self) -> int | None:
        """Index of the first token where the lanes differ (the shorter length when one is a prefix), or None."""
        a, b = self.spec.token_ids, self.plain.token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        return first

    @property
    def duration_ms(self) -> float:
        """The shared clock's length: the slower lane's wall time."""
        return max(self.plain.wall_ms, self.spec.wall_ms)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["version"] = RACE_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Race":
        """A race from ``to_dict``'s JSON.

        Raises:
            InputError: a record of another version or with missing fields.
        """
        if d.get("version") != RACE_VERSION:
            raise InputError(f"This race record is version {d.get('version')!r}; this app reads version "
                             f"{RACE_VERSION}.")
        try:
            lanes = {k: _lane_from_dict(d[k]) for k in ("plain", "spec")}
            fields = {k: d[k] for k in ("settings", "order", "spec_ms_per_token", "base_ms_per_token", "greedy",
                                        "machine", "measured_at")}
            extra = {k: d[k] for k in ("warm_ms", "measure_ms", "others_max", "rows_max") if k in d}
        except (KeyError, TypeError) as e:
            raise InputError(f"This race record lacks a field: {e}.") from None
        return cls(**fields, **lanes, **extra)


def _lane_from_dict(d: dict) -> Lane:
    d = dict(d)
    d["tokens"] = [TokenMark(**t) for t in d["tokens"]]
    d["spans"] = [Span(**s) for s in d["spans"]]
    d["rounds"] = [LaneRound(**{**r, "draft": [DraftMark(**m) for m in r["draft"]]}) for r in d["rounds"]]
    return Lane(**d)


def _rounded(x, digits: int = 4):
    if isinstance(x, float):
        return round(x, digits)
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v, digits) for v in x]
    return x


def save_race(race: Race, path: str | Path) -> None:
    """Write ``race`` as JSON (UTF-8; times in ms and probabilities rounded to 4 decimals, far below the clock's
    resolution that matters here)."""
    Path(path).write_text(json.dumps(_rounded(race.to_dict()), ensure_ascii=False, separators=(",", ":")) + "\n",
                          encoding="utf-8")


def load_race(path: str | Path) -> Race:
    """Read a race written by ``save_race``.

    Raises:
        InputError: an unreadable file or record.
    """
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"Cannot read the race record {path}: {e}") from None
    return Race.from_dict(d)


def run_race(make_spec, make_base, spec_label: str, settings: dict | None = None, reps: int = REPS,
             warm_rounds: int = WARM_ROUNDS, machine: str = "", greedy: bool = True,
             on_progress: Callable[[int, int, str], None] | None = None,
             should_stop: Callable[[], bool] | None = None, busy: Callable[[], int] | None = None,
             pass_rows: Callable[[], int] | None = None) -> Race:
    """Race speculative against plain decoding on this machine: warm both up, then time ``reps`` runs of each,
    alternating (A B B A …, ``engine.decoding.measure.measure_speedup_ab``), each recorded with its timeline
    (``record_lane``); keep each kind's run at the median.

    Args:
        make_spec, make_base: build a fresh, seeded ``SpeculativeDecoder`` (speculative; plain, ``proposer=None``),
            called once per run (and once more each for the warm-up).
        spec_label: the speculative lane's draft, as the page names it. settings: recorded as they are.
        reps: timed runs of each kind (≥ 1). warm_rounds: rounds of each kind run first and thrown away (0: none).
        machine: where it ran (the CPU), recorded with the race. greedy: temperature 0.
        on_progress: ``on_progress(done, total, what)`` before each part ("warm-up", "spec", "base").
        should_stop: returning True (checked between rounds) stops the race. busy: other readers decoding now.
        pass_rows: rows of the last pass of the room the decoders step through (``Room.bind``: the lanes' rounds
            then share the room's passes with other readers, and each round records the rows of its pass).

    Raises:
        ValueError: reps < 1. RaceStopped: stopped. The builders' and decoders' errors (InputError, …) propagate.
    """
    if reps < 1:
        raise ValueError(f"reps must be ≥ 1, got {reps}")
    total = 2 * reps + (1 if warm_rounds else 0)
    t0 = time.perf_counter()
    if warm_rounds:
        if on_progress is not None:
            on_progress(0, total, "warm-up")
        for make in (make_spec, make_base):
            dec = make()
            for _ in range(warm_rounds):
                if dec.finished:
                    break
                if should_stop is not None and should_stop():
                    raise RaceStopped("The race was stopped before it ended.")
                dec.step()
    t1 = time.perf_counter()
    recorders: list[_Recorder] = []
    offset = 1 if warm_rounds else 0

    def _make(kind: str):
        def make():
            rec = (_Recorder(make_spec(), SPEC, spec_label, should_stop, busy, pass_rows) if kind == "spec"
                   else _Recorder(make_base(), PLAIN, "plain decoding", should_stop, busy, pass_rows))
            recorders.append(rec)
            return rec
        return make

    def _progress(done: int, n: int, kind: str) -> None:
        if on_progress is not None:
            on_progress(done + offset, total, kind)

    ab = measure_speedup_ab(_make("spec"), _make("base"), reps=reps, on_progress=_progress)
    spec = next(r.lane for r in recorders if r._stats is ab.spec_stats)
    plain = next(r.lane for r in recorders if r._stats is ab.base_stats)
    return Race(settings=dict(settings or {}), plain=plain, spec=spec, order=ab.order,
                spec_ms_per_token=ab.spec_ms_per_token, base_ms_per_token=ab.base_ms_per_token, greedy=greedy,
                machine=machine, measured_at=_dt.datetime.now().isoformat(timespec="seconds"),
                warm_ms=(t1 - t0) * 1000, measure_ms=(time.perf_counter() - t1) * 1000,
                others_max=max(r.lane.others_max for r in recorders if r.lane is not None),
                rows_max=max(r.lane.rows_max for r in recorders if r.lane is not None))


# ---------------------------------------------------------------------------------------------- playback model
@dataclass
class LaneFrame:
    """What a lane shows at one moment of the playback.

    Attributes:
        t_ms: the moment on the lane's own clock (ms; past its end it stays at its end).
        tokens: tokens visible (appeared at or before t). passes: target passes ended by t. spans_done: spans ended
            by t; active: the span running at t (None between spans or after the end).
        tokens_per_s: tokens visible ÷ t (None before the first token). finished: t ≥ the lane's wall time.
    """

    t_ms: float
    tokens: int
    passes: int
    spans_done: int
    active: Span | None
    tokens_per_s: float | None
    finished: bool


def lane_at(lane: Lane, t_ms: float) -> LaneFrame:
    """The lane at time ``t_ms`` of the shared clock (ms from both lanes' start; negative counts as 0)."""
    t = min(max(t_ms, 0.0), lane.wall_ms)
    n = sum(1 for m in lane.tokens if m.t_ms <= t)
    done = [s for s in lane.spans if s.end_ms <= t]
    active = next((s for s in lane.spans if s.start_ms <= t < s.end_ms), None)
    return LaneFrame(t_ms=t, tokens=n, passes=sum(1 for s in done if s.kind in PASS_KINDS), spans_done=len(done),
                     active=active, tokens_per_s=n / (t / 1000) if n and t > 0 else None,
                     finished=t_ms >= lane.wall_ms)


@dataclass
class RaceFrame:
    """Both lanes at one moment, and whether their texts agree so far.

    Attributes:
        plain, spec: each lane's ``LaneFrame``. compared: tokens both lanes show (the shorter's count).
        identical_so_far: the first ``compared`` tokens are the same in both lanes.
        finished: both lanes have ended.
    """

    plain: LaneFrame
    spec: LaneFrame
    compared: int
    identical_so_far: bool
    finished: bool


def race_at(race: Race, t_ms: float) -> RaceFrame:
    """Both lanes at ``t_ms`` on the shared clock (see ``RaceFrame``)."""
    p, s = lane_at(race.plain, t_ms), lane_at(race.spec, t_ms)
    n = min(p.tokens, s.tokens)
    same = race.plain.token_ids[:n] == race.spec.token_ids[:n]
    return RaceFrame(plain=p, spec=s, compared=n, identical_so_far=same, finished=p.finished and s.finished)


def playback_times(race: Race, fps: float = 30.0, speed: float = 1.0) -> list[float]:
    """The shared-clock moments (ms) a playback at ``fps`` frames per second of real time and ``speed`` (1 = the
    measured pace, 0.25 = four times slower) draws: 0, 1000·speed/fps, …, up to and including the end.

    Raises:
        InputError: fps or speed not > 0.
    """
    if not (fps > 0 and speed > 0):
        raise InputError(f"Frames per second and speed must be > 0, got {fps} and {speed}.")
    step = 1000.0 * speed / fps
    n = int(race.duration_ms // step)
    times = [i * step for i in range(n + 1)]
    if times[-1] < race.duration_ms:
        times.append(race.duration_ms)
    return times


def finish_time(lane: Lane) -> float | None:
    """When ``lane`` shows its last token on the shared clock (ms): the earliest t with
    ``lane_at(lane, t).tokens == lane.new_tokens``; None for a lane without tokens."""
    if not lane.tokens:
        return None
    return max(m.t_ms for m in lane.tokens)


def replayed_speedup(race: Race) -> float | None:
    """The speedup a viewer of the playback sees: plain's time per token to its last token ÷ speculative's, on the
    shared clock (``finish_time``; the playback's speed scales both alike); None without tokens in both lanes."""
    tp, ts = finish_time(race.plain), finish_time(race.spec)
    if not tp or not ts:
        return None
    return (tp / race.plain.new_tokens) / (ts / race.spec.new_tokens)


def measured_speedup(race: Race) -> float | None:
    """The replayed runs' speedup as the decoders measured them: speculative tokens/s ÷ plain tokens/s, each the
    decoder's own ``RunStats`` (new tokens ÷ ``total_ms``, its clock inside the steps)."""
    a = race.spec.new_tokens / race.spec.total_ms if race.spec.total_ms > 0 else None
    b = race.plain.new_tokens / race.plain.total_ms if race.plain.total_ms > 0 else None
    return a / b if a and b else None


def survival(lane: Lane) -> list[float]:
    """Acceptance by position as survival: the share of drafting rounds whose first i + 1 draft tokens were all
    accepted (i = 0, 1, …), from the lane's rounds (vLLM's acceptance by position reads the same counts)."""
    drafting = [r for r in lane.rounds if r.draft]
    if not drafting:
        return []
    longest = max(len(r.draft) for r in drafting)
    out = []
    for i in range(longest):
        kept = sum(1 for r in drafting
                   if len(r.draft) > i and all(m.verdict == "accepted" for m in r.draft[:i + 1]))
        out.append(kept / len(drafting))
    return out


def lane_summary(lane: Lane) -> dict:
    """A lane's final numbers as the page shows them: tokens, wall time (s), tokens/s, TTFT (ms), target passes,
    tokens per pass (values may be None)."""
    return {"tokens": lane.new_tokens, "wall_s": lane.wall_ms / 1000, "tokens_per_s": lane.tokens_per_s,
            "ttft_ms": lane.ttft_ms, "passes": lane.target_passes, "tokens_per_pass": lane.tokens_per_pass}


__all__ = ["AFTER_END", "DraftMark", "Lane", "LaneFrame", "LaneRound", "PASS_KINDS", "PLAIN", "Race", "RaceFrame",
           "RaceStopped", "REPS", "SPAN_KINDS", "SPEC", "Span", "TokenMark", "WARM_ROUNDS", "finish_time", "lane_at",
           "lane_summary", "load_race", "measured_speedup", "playback_times", "race_at", "record_lane", "replayed_speedup", "run_race",
           "save_race", "survival"]
