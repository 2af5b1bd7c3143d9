"""Whether the room's next pass drafts: chosen from the room's own measured passes, per band of readers.

Speculation trades arithmetic for passes: a pass verifying γ drafted tokens per reader does (γ + 1)× the products of a
plain step, for 1 + (accepted tokens) tokens per reader. While a pass waits on the weights (few readers) the extra
arithmetic is nearly free and drafting pays; once many readers fill the pass the machine is busy computing and the
rejected drafts' arithmetic is lost (the explainer's "When it does not help"). Measured on the AMD EPYC (2 cores, the
embedded target and head, 16 chat readers, 2026-12-07): a pass drafting γ = 2 for everyone took 117 ms and emitted
28 tokens, a plain pass 40 ms for 16 tokens: drafting gave 0.61× the tokens per second.

Where the break-even lies depends on the machine, the prompts' acceptance and the draft, so ``DraftPolicy`` measures
it for passes of many readers: for each band of readers per pass (6–11, 12–22, 23–45, …: the nearest power of two)
it keeps the recent passes of both kinds and chooses the one that emitted more tokens per reader per second. Such a
band starts plain and tries drafting as late as it tries a clear loser again (the cheaper mistake first); then it
tries the kind it did not choose again every ``EXPLORE_EVERY`` passes of the band (less and less often while it keeps
losing clearly),
so a change in acceptance (other prompts, other readers) moves the choice. Passes in a band below ``MEASURED_FROM``
(fewer than 6 readers) always draft, as each reader would alone.

Within a pass that drafts, each reader's draft is as long as its own length rule says (``engine.decoding.draft_length``,
the shipped head's default): the rule reads the lone pass-cost curve and the reader's own draft, so a reader drafts in
the room exactly what it drafts alone (``FeatureHeadProposer.propose_many`` runs each row's rule on the bits ``propose``
gives it) and its text stays its text alone; this policy only decides whether the pass drafts at all. (A rule priced
on the shared pass's marginal cost would draft less at many readers, but a reader's sampled text would then depend on
who else is in the room.)

What it changes for a reader: greedy texts are the same either way (speculative decoding is exact); a sampled
reader's text from a plain pass stays a sample of the same distribution but is no longer the same text as alone,
since a plain pass makes fewer random draws (as with the operator's fixed limit, ``scheduler.parse_no_draft_above``).
A reader sampling under the drafter-invariant rule (``SamplingConfig(rule="gumbel")``: noise keyed by seed, position
and token) gets its text alone either way.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass

EXPLORE_EVERY = 16
"""Passes of a band between tries of the kind not chosen (its measurement kept fresh); ``CLEAR_FACTOR`` times as
many when the kind not chosen measured under ``CLEAR_MARGIN`` of the chosen one's rate (a try of it costs more
than it can find: on the AMD EPYC a drafted pass of 15 readers took 156-182 ms against 46-53 for a plain one), and
twice as many again after each further try it lost clearly, up to ``MAX_BACKOFF`` times ``CLEAR_FACTOR``: a room of 16
readers on the AMD EPYC whose drafted try cost 270 ms (its draft head catching up on 60 plain passes' tokens, 197 ms)
lost ~6 % of its time to a try every 64 passes."""
CLEAR_MARGIN = 0.75
CLEAR_FACTOR = 4
MAX_BACKOFF = 16
KEEP = 6
"""Recent passes of each kind kept per band."""
MIN_PASSES = 1
"""Passes of a kind a band needs before its rate is trusted."""
MEASURED_FROM = 8
"""Bands below this (passes of fewer than 6 readers) always draft, as each reader would alone: a pass of few readers waits on the weights, so
drafting's extra arithmetic is nearly free, and every text stays the text alone (a plain pass would make a sampled
reader's draws differ). Bands from this one up (6 readers or more) are measured: they start with plain passes and first try
drafting as late as they try a clear loser again. Why in that order: a try of the wrong kind costs little one way and
much the other. A plain pass where drafting pays loses at most the accepted tokens of one pass; a drafted pass where
the machine is busy computing costs (γ + 1)× the arithmetic of a plain one (on the AMD EPYC at 15-16 readers, 156-256
ms against 43, and the readers it served fell out of step, so the room's last passes ran with a few readers each)."""


def band(rows: int) -> int:
    """The band of a pass of ``rows`` readers: the power of two nearest to it on a log scale (1; 2; 3-5 → 4; 6-11 → 8;
    12-22 → 16; 23-45 → 32; …), so a room of 16 readers with one of them between rounds stays in its band."""
    if rows < 1:
        raise ValueError(f"a pass serves at least one reader, got {rows}")
    return 1 << round(math.log2(rows))


@dataclass(frozen=True)
class BandRates:
    """What a band measured: tokens per reader per second of its recent drafted and plain passes (None: fewer than
    ``MIN_PASSES``), and whether its next pass drafts."""

    band: int
    drafted: float | None
    plain: float | None
    drafts: bool

    def line(self) -> str:
        """One sentence for the Live page's room panel."""
        readers = f"about {self.band} readers" if self.band > 1 else "1 reader"
        if self.drafted is None or self.plain is None:
            return (f"At {readers} per pass the room is still measuring whether drafting pays "
                    f"({'drafting' if self.drafts else 'trying a plain pass'} now).")
        ratio = self.drafted / self.plain
        verdict = "drafts" if self.drafts else "does not draft"
        return (f"At {readers} per pass drafting gave {ratio:.2f}× the tokens per second of plain passes "
                f"(measured on this room's recent passes), so the room {verdict}.")


class DraftPolicy:
    """The room's choice of drafting per pass (see the module's docstring). Thread-safe.

    ``drafts(rows)`` says whether a pass of ``rows`` readers drafts; ``record(rows, drafted, emitted, ms)`` adds a
    finished pass (tokens emitted for all its readers, its wall time in ms)."""

    def __init__(self, explore_every: int = EXPLORE_EVERY, keep: int = KEEP, min_passes: int = MIN_PASSES,
                 measured_from: int = MEASURED_FROM):
        if explore_every < 2 or keep < 1 or min_passes < 1 or min_passes > keep or measured_from < 2:
            raise ValueError("explore_every ≥ 2, keep ≥ 1, 1 ≤ min_passes ≤ keep and measured_from ≥ 2 expected")
        self.explore_every, self.keep, self.min_passes = explore_every, keep, min_passes
        self.measured_from = measured_from
        self._passes: dict[tuple[int, bool], collections.deque] = {}
        self._decided: collections.Counter = collections.Counter()
        self._next_try: dict[int, int] = {}  # band → the decision that tries the kind not chosen next
        self._clear_losses: collections.Counter = collections.Counter()  # band → its tries in a row lost clearly
        self._lock = threading.Lock()

    def _rate(self, b: int, drafted: bool) -> float | None:
        """Tokens per reader per second over the band's kept passes of that kind (None: too few)."""
        kept = self._passes.get((b, drafted))
        if not kept or len(kept) < self.min_passes:
            return None
        per_reader = sum(emitted / rows for rows, emitted, _ in kept)
        seconds = sum(ms for _, _, ms in kept) / 1000
        return per_reader / seconds if seconds > 0 else None

    def _choice(self, b: int, count: int) -> bool:
        if b < self.measured_from:
            return True
        d, p = self._rate(b, True), self._rate(b, False)
        if d is None or p is None:
            # plain until measured; drafting first tried as late as a clear loser is tried again
            return p is not None and count % (self.explore_every * CLEAR_FACTOR) == 0
        best = d >= p
        clear = min(d, p) < CLEAR_MARGIN * max(d, p)
        nxt = self._next_try.get(b)
        if not (count >= nxt if nxt is not None
                else count % (self.explore_every * (CLEAR_FACTOR if clear else 1)) == 0):
            return best
        # a try of the kind not chosen; the wait before the next one doubles with each clear loss in a row
        self._clear_losses[b] = self._clear_losses[b] + 1 if clear else 0
        factor = CLEAR_FACTOR * min(2 ** (self._clear_losses[b] - 1), MAX_BACKOFF) if clear else 1
        self._next_try[b] = count + self.explore_every * factor
        return not best

    def drafts(self, rows: int) -> bool:
        """Whether the next pass of ``rows`` readers drafts (and count it as one of its band's decisions)."""
        b = band(rows)
        with self._lock:
            self._decided[b] += 1
            return self._choice(b, self._decided[b])

    def record(self, rows: int, drafted: bool, emitted: int, ms: float) -> None:
        """Add a finished pass: ``rows`` readers fed (≥ 1; a pass that fed nobody is not a measurement), whether it
        drafted, the tokens it emitted for all of them and its wall time (ms)."""
        if rows < 1 or ms <= 0:
            return
        with self._lock:
            self._passes.setdefault((band(rows), drafted), collections.deque(maxlen=self.keep)).append(
                (rows, emitted, ms))

    def rates(self, rows: int) -> BandRates:
        """The band of ``rows`` readers: its measured rates and its current choice (without counting a decision)."""
        b = band(rows)
        with self._lock:
            d, p = self._rate(b, True), self._rate(b, False)
            best = True if b < self.measured_from else (False if d is None or p is None else d >= p)
        return BandRates(b, d, p, best)
