"""The room scheduler: one worker thread per loaded target runs every session's rounds, batched (continuous
batching, in the spirit of vLLM v1's ``Scheduler.schedule``: collect what waits, form a batch, run one pass,
hand out the results).

Why: a workshop serves the Live page to a room. With one decoder thread per reader, 16 readers' PyTorch
thread pools fought over 2 cores (aggregate 0.95× one reader, the slowest reader 48.8 s). Here each
session keeps its own ``SpeculativeDecoder`` (its KV cache, proposer, random generator and settings) and
*submits* work to the target's ``Room``; a single worker thread does all the computing:

1. **collect**: requests that arrived join the running list in arrival order (FIFO); cancelled ones (Stop), ones
   whose decoder was garbage-collected (a closed session) and ones nobody has polled for ``abandon_s`` seconds
   (a tab that went away) leave it, freeing their rows.
2. **form the batch**: at most ``max_rows`` requests; when more run, the list rotates after each pass (the
   rows just served go to the back), so a request waits at most ``ceil(running / max_rows) − 1`` passes
   between two of its rounds (no starvation; ``pass_log`` records who was served).
3. **draft**, each row with its own proposer and generator (``SpeculativeDecoder.begin_pass``). Rows whose
   proposers share a ``batch_key`` (readers of the same EAGLE-style draft head) draft together: one head call
   for all their catch-up pairs and one per draft step, their head caches stacked for the pass as the target's
   are below (``FeatureHeadProposer.propose_many``; each row's tokens and q are its own draft's up to rounding,
   its generator drawn in the same order; 16 rows on the embedded model: the pass 0.79 → 0.52–0.65 s). Prompt
   lookup, Medusa heads, a draft model or early exit draft row by row. A failing batched draft is retried row by
   row (generators restored). Token-tree rounds (Medusa's static tree, ``tree`` > 0) run their own pass, one
   after the other, inside the worker.
4. **one target pass** for every chain row: each row's KV cache is stacked into one batch cache for this pass
   (left-padded, the padding masked out, per-row position ids, ``engine.decoding.attention``), the fed tokens
   right-padded; afterwards each row's new KV entries go back to that row's own cache (``CachedLM.absorb``).
   A row alone in a pass runs exactly the single-sequence code (bit-identical).
5. **judge** each row with its own rule, settings and generator (``SpeculativeDecoder.finish_pass``) and hand
   the round to whoever waits for it. The rows' distributions p, their top-5 lists and argmaxes or cumulative sums
   are computed for all rows of equal settings at once (``speculative.warp_together``: row by row operations, so each
   row's bits as alone).

Exactness: the generator of a row is consumed in the same order as in ``SpeculativeDecoder.step`` (draft draws,
then the verification's uniforms and residual draw), so a reader's output is what the same settings give
alone: greedy identical, sampled with the same seed the same text. The passes are batch-invariant
(``compute.batch_invariant``): each row of the target's shared pass, and of the EAGLE-style head's drafting together
(``propose_many``), gets the bits of its lone pass (logits, q, KV entries), so even a near tie goes the same way;
prefills run alone. By construction, on any CPU where the streaming kernel's extension runs the products
(``small_linear.cpp``) and the attention (``invariant_attention.cpp``) and the layers take the lean path
(``compute.lean._lean_forward``: the embedded model and its head): every sum a row's result depends on is computed from
that row alone in an order this project fixes. ``engine.decoding.invariance`` checks it on the machine when the
Live page first shows the room (and for the CLI's ``--json``) and the room panel says what it found; elsewhere (CUDA,
no compiler, other architectures) a batched pass can differ by rounding, which changes a token only at a near tie
(``batch.first_difference_gap`` shows such a case).

Isolation: a reader's exception (bad input, a failing draft) goes to that reader only; a failing shared pass is
retried row by row, so only the row that fails alone gets the error. A row's cache only grows after its pass
succeeded: the shared pass runs over the rows in their own caches (``Room._in_own_caches``: each layer writes a
row's new entries into its block past its cached ones and reads them back, and the cache's views take them in
afterwards), or, where that does not apply, over a batch cache stacked from them (``Room._stacked``). What preparing
the pass costs is measured per pass (``PassRecord.stack_ms``; ``benchmarks/bench_room.py``).

Warm-up: a room made by ``room_for`` (the app's) first warms up when its first request arrives (``Room._warm_up``:
the batched path's one-time costs, then ``gc.freeze`` once per process), so the first room of readers does not pay
them in its first pass.

Drafting: by default a pass of few readers drafts (as each would alone), and a pass of many (6 or more) drafts only
where the room's own measured passes say it pays (``engine.decoding.draft_policy``: per band of readers per pass,
drafted against plain passes' tokens per reader per second), as serving engines switch speculation off under load. Operator option: ``SPEEDUP_LAB_NO_DRAFT_ABOVE=B`` (or
``Room(no_draft_above=B)``) drafts nothing in a pass of more than B rows instead (vLLM's
``speculative_disable_by_batch_size``); ``off`` always drafts; ``auto`` (the default) measures. Greedy outputs stay the
same either way; a sampled output from a pass that did not draft follows the same distribution but is no longer the
same text as alone (fewer draws are made), so ``off`` is what keeps every text equal to alone under the standard
sampling rule; under the drafter-invariant rule (``SamplingConfig(rule="gumbel")``) a sampled text is the text alone
either way.
"""

from __future__ import annotations

import atexit
import collections
import gc
import itertools
import json
import math
import os
import queue
import statistics
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engine.decoding.attention import KVScratch, fed_visibility, model_mask, stack_left_padded
from engine.decoding.compute import batch_invariant, fused_decode_rows
from engine.decoding.draft_policy import BandRates, DraftPolicy, band
from engine.decoding.compute.invariant import _aligned
from engine.decoding.models import LoadedModel
from engine.decoding.speculative import GenerationResult, PendingPass, SpeculativeDecoder, warp_together
from engine.decoding.trace import Round
from engine.errors import InputError

NO_DRAFT_ENV = "SPEEDUP_LAB_NO_DRAFT_ABOVE"
AUTO = "auto"
"""``no_draft_above``'s value (and the environment variable's default) for drafting chosen from measured passes."""
MAX_ROWS_ENV = "SPEEDUP_LAB_ROOM_MAX_ROWS"
LOG_ENV = "SPEEDUP_LAB_ROOM_LOG"  # a file: one JSON line per pass (benchmarks/bench_room.py reads the server's)
DEFAULT_MAX_ROWS = 32
DEFAULT_ABANDON_S = 60.0
IDLE_EXIT_S = 2.0
"""A worker with nothing to do for this long ends; the next request starts another (``Room._loop``). Why: PyTorch's
CPU threads are OpenMP's, and each thread that has computed keeps its own team of them while it lives. With two such
teams (the worker's and a page's or a script's thread) there are more threads than the 2 cores, and libgomp then
stops spinning between parallel regions: every product of a decode pass waits for its helper thread to wake (a
futex). Measured on the AMD EPYC (2 threads, the embedded model): plain decoding in one thread took 9 ms a token alone
and 18–20 ms while another thread that had run one prefill was still alive (a What-if sweep after anyone used the
Live page, a benchmark's main thread beside the room); 9–10 ms again once it had ended."""
POLL_S = 0.1
STACK_IN_PLACE = True
"""The room's target pass stacks the rows' caches into transformers ``StaticLayer`` s with room for the pass's new
entries (``attention.stack_left_padded(room=...)``); False: a ``DynamicCache`` the forward concatenates onto (for
A/B measurements; the same bits either way, tested)."""
IN_OWN_CACHES = True
"""The room's target pass runs over the rows in their own KV caches where it can (``_in_own_caches``: the
"stream" path's fused layers, every row's cache a ``CachedLM`` block), so no batch cache is stacked; False: always
stack (for A/B measurements; the same bits either way, tested)."""
WINDOW_S = 10.0  # the room's recent tokens/s and rows per pass are over this many seconds of passes
WARM_ROWS = 16  # the warm-up's batched passes: rows (at most max_rows) ...
WARM_PROMPT = 48  # ... each a prompt of this many tokens, prefilled (one by one), then two plain-decoding rounds

_threads_set = False
_threads_lock = threading.Lock()
_heap_frozen = False


def _freeze_heap_once() -> bool:
    """``gc.collect()`` then ``gc.freeze()``, once per process (the first warmed-up room; ``Room._warm_up``): what
    is alive then stays out of later collections' walks. Once only: objects frozen are never freed by the cycle
    collector, so freezing again later would keep readers' sessions of that moment (their cycles) for good.
    Returns whether this call froze."""
    global _heap_frozen
    with _threads_lock:
        if _heap_frozen:
            return False
        gc.collect()
        gc.freeze()
        _heap_frozen = True
        return True


SWITCH_INTERVAL_S = 0.0005
"""The process's GIL switch interval once a room exists (Python's default is 5 ms; ``Room.__init__`` lowers it, never
raises it). Why: the worker computes in C++ with the GIL released but needs it back between its calls, dozens of times a
pass; while a page's thread runs Python (drawing a page) a waiting thread gets the GIL only after a whole interval.
Measured in the Streamlit server on the AMD EPYC (a reader stepping the Live page, its page redrawing meanwhile): draft
steps of 22–160 ms and verify passes of 13–66 ms where 2 and 11 ms run alone."""


def configure_threads(n: int | None = None) -> int:
    """Size torch's intra-op threads once for the process (the room's worker is the only thread that computes):
    ``n``, else ``OMP_NUM_THREADS``, else the CPU count. Later calls change nothing. Returns the count in use."""
    global _threads_set
    with _threads_lock:
        if not _threads_set:
            want = n or int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1
            torch.set_num_threads(max(1, int(want)))
            _threads_set = True
        return torch.get_num_threads()


def parse_no_draft_above(value) -> int | None:
    """The operator's batch limit for drafting: None (no fixed limit) for None/""/"0"/"off"/"auto" ("auto": the room
    measures where drafting pays, ``Room``; elsewhere, as the CLI's batch, there is no limit), else a whole number ≥ 1.

    Raises:
        InputError: for anything else.
    """
    if value is None:
        return None
    s = str(value).strip().lower()
    if s in ("", "0", "off", "none", AUTO):
        return None
    try:
        b = int(s)
    except ValueError:
        raise InputError(f"{NO_DRAFT_ENV} must be a whole number of rows (or auto, 0 / off), got {value!r}.") from None
    if b < 1:
        raise InputError(f"{NO_DRAFT_ENV} must be ≥ 1 (or auto, 0 / off), got {value!r}.")
    return b


@dataclass
class PassRecord:
    """One pass of the room's worker.

    Attributes:
        t_end: time.monotonic() at its end. ms: wall time of the whole pass (drafts, target pass, judging).
        rows: requests served. fed_rows: rows in the shared target pass (the rest had nothing to feed or ran a
            tree round of their own). tokens: tokens the target processed (rows · width, padding included).
        emitted: tokens the rows emitted. stack_ms / unstack_ms: building the batch cache from the rows' own
            caches and giving each row its new entries back. target_ms: the target's forward. drafted: whether
            drafting was allowed (the operator's limit). draft_ms: the batched drafts (rows sharing a draft
            head, ``propose_many``); rows drafting alone are not in it. prep_ms: taking each row's decoder lock and
            sizing its draft. begin_ms: each row's ``begin_pass`` (drafting alone, building what it feeds).
            judge_ms: each row's ``finish_pass`` (its rule on its logits) and handing the round to its page.
        served: ids of the requests served (fairness checks).
    """

    t_end: float
    ms: float
    rows: int
    fed_rows: int
    tokens: int
    emitted: int
    stack_ms: float
    unstack_ms: float
    target_ms: float
    drafted: bool
    served: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    prep_ms: float = 0.0
    begin_ms: float = 0.0
    judge_ms: float = 0.0


@dataclass
class RoomStats:
    """What the room panel shows (``Room.stats``).

    Attributes:
        readers_now: requests running or waiting. last_pass_rows: rows of the last pass (0 before any).
        rows_per_pass: mean rows per pass over the last ``WINDOW_S`` seconds (None: no pass in it).
        tokens_per_s: tokens emitted by all rows ÷ the worker's busy time in that window (None: none).
        passes: passes since the room started. no_draft_above: the operator's limit (None: none).
        max_rows: rows per pass at most. threads: torch's intra-op threads.
        stack_share: stacking + unstacking ÷ pass time in the window (None: no shared pass).
        drafting: with the measured drafting choice (``draft_policy``), the band of the last pass's readers: its
            measured rates and choice (None: a fixed choice, no pass yet, or a band of readers that always drafts).
    """

    readers_now: int
    last_pass_rows: int
    rows_per_pass: float | None
    tokens_per_s: float | None
    passes: int
    no_draft_above: int | None
    max_rows: int
    threads: int
    stack_share: float | None
    drafting: BandRates | None = None


class Ticket:
    """A request submitted to a ``Room``: rounds arrive on it as the worker runs them.

    Use ``rounds()`` (iterate) or ``wait()``; ``cancel()`` stops it after the pass in flight. A ticket nobody
    polls for ``abandon_s`` seconds is dropped by the worker (an abandoned tab).
    """

    _ids = itertools.count(1)

    def __init__(self, room: "Room", decoder: SpeculativeDecoder, rounds: int | None, prefill_only: bool):
        self.id = next(self._ids)
        self.room = room
        self._decoder = weakref.ref(decoder)
        self.rounds_wanted = rounds
        self.prefill_only = prefill_only
        self.rounds_done = 0
        self.out: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.last_poll = time.monotonic()
        self.submitted = time.monotonic()
        self.last_pass_rows = 0

    @property
    def decoder(self) -> SpeculativeDecoder | None:
        return self._decoder()

    def cancel(self, wait: bool = True, timeout: float | None = 30.0) -> None:
        """Stop after the pass in flight; with ``wait``, return once the worker has let go of the decoder."""
        self.cancelled.set()
        with self.room._cond:
            self.room._cond.notify_all()
        if wait:
            self.done.wait(timeout)

    def rounds(self, should_stop: Callable[[], bool] | None = None,
               wake_every: float | None = None) -> Iterator[list[Round]]:
        """Yield the rounds as they arrive, in batches (all that arrived since the last yield); ends when the
        request is done. ``should_stop()`` True cancels it (after the pass in flight). An exception of this
        request is raised here; leaving the loop early cancels the request.

        ``wake_every`` (seconds): wait for the request's end or that long, whichever comes first, then yield what
        arrived, instead of waking for every round. For a page that
        draws at most every half second: in a room of 16 readers each page's thread woke once per pass (~27 times a
        second) to take a round it did not draw, and took the GIL from the worker between its calls each time.

        Raises:
            the request's own exception (InputError, …).
        """
        try:
            while True:
                self.last_poll = time.monotonic()
                if should_stop is not None and should_stop():
                    self.cancel()
                if wake_every is not None:
                    self.done.wait(wake_every)  # the worker's rounds wait in the queue meanwhile
                    got = []
                else:
                    try:
                        got = [self.out.get(timeout=POLL_S)]
                    except queue.Empty:
                        continue
                while True:
                    try:
                        got.append(self.out.get_nowait())
                    except queue.Empty:
                        break
                if not got:
                    continue
                end = any(x is _DONE for x in got)
                batch = [x for x in got if isinstance(x, Round)]
                if batch:
                    yield batch
                if end:
                    if self.error is not None:
                        raise self.error
                    return
        finally:
            if not self.done.is_set():
                self.cancel()

    def wait(self, should_stop: Callable[[], bool] | None = None) -> list[Round]:
        """All rounds of the request (after it is done). Raises the request's exception."""
        out: list[Round] = []
        for batch in self.rounds(should_stop):
            out += batch
        return out


_DONE = object()


class Room:
    """The scheduler of one loaded target (see the module docstring). Get it with ``room_for(target)``.

    Args:
        target: the loaded target every submitted decoder uses.
        max_rows: requests served per pass at most (≥ 1; default ``SPEEDUP_LAB_ROOM_MAX_ROWS`` or 32).
        no_draft_above: draft nothing in a pass of more rows; None or "off": always draft; "auto": draft where the
            room's measured passes say it pays (``draft_policy``); default ``SPEEDUP_LAB_NO_DRAFT_ABOVE``, else "auto".
        abandon_s: a ticket not polled for this long is dropped.
        batch_drafts: rows whose drafts share a head draft in one batched call per step (``propose_many``);
            False: every row drafts alone (bit-identical drafts to alone; for A/B measurements).
        warm_up: when the first request arrives, the worker first warms the room up, once (``_warm_up``: the
            batched path's one-time costs, then the garbage collector's ``gc.freeze``); ``room_for`` (the app's rooms)
            turns it on. Not before a request: a room made only to read its stats computes nothing.
            ``warm_ms`` is how long it took (None: not run, or it failed; a failure never stops the room);
            ``warm_done`` says it is over (a page can tell its reader the first request waits for it).

    Raises:
        InputError: a bad max_rows or no_draft_above.
    """

    def __init__(self, target: LoadedModel, max_rows: int | None = None, no_draft_above: int | None | str = "env",
                 abandon_s: float = DEFAULT_ABANDON_S, batch_drafts: bool = True, warm_up: bool = False):
        self.target = target
        if max_rows is None:
            max_rows = int(os.environ.get(MAX_ROWS_ENV) or DEFAULT_MAX_ROWS)
        if not isinstance(max_rows, int) or max_rows < 1:
            raise InputError(f"Rows per pass must be a whole number ≥ 1, got {max_rows!r}.")
        self.max_rows = max_rows
        raw = (os.environ.get(NO_DRAFT_ENV) or AUTO) if no_draft_above == "env" else no_draft_above
        self.draft_policy = DraftPolicy() if str(raw).strip().lower() == AUTO else None
        self.no_draft_above = None if self.draft_policy else parse_no_draft_above(raw)
        self.abandon_s = abandon_s
        self.batch_drafts = batch_drafts
        self.threads = configure_threads()
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: list[Ticket] = []
        self.passes: collections.deque[PassRecord] = collections.deque(maxlen=4096)
        self.pass_count = 0
        self._closed = False
        self._scratch = KVScratch()  # the stacked passes' batch cache memory, reused (the worker's alone)
        self.warm_up = warm_up
        self.warm_ms: float | None = None
        self.warm_done = not warm_up  # True once the warm-up has run (or failed), or when there is none
        self._cold = warm_up  # the warm-up is still to run (at the first request)
        self._worker: threading.Thread | None = None
        with self._cond:
            self._start_worker()

    def _start_worker(self) -> None:
        """Start the worker thread unless one is running (call with ``_cond`` held)."""
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name=f"room-{self.target.name}", daemon=True)
            self._worker.start()

    # ---------------------------------------------------------------- submitting
    def submit(self, decoder: SpeculativeDecoder, rounds: int | None = 1, prefill_only: bool = False) -> Ticket:
        """Queue ``rounds`` rounds of ``decoder`` (None: until it finishes); ``prefill_only``: just its prefill.

        Raises:
            InputError: a decoder of another target, or rounds < 1.
        """
        if decoder.target is not self.target:
            raise InputError("This decoder runs another model than this room's target.")
        if rounds is not None and (not isinstance(rounds, int) or rounds < 1):
            raise InputError(f"Rounds must be a whole number ≥ 1 (or None: to the end), got {rounds!r}.")
        t = Ticket(self, decoder, rounds, prefill_only)
        with self._cond:
            if self._closed:
                raise InputError("This room is closed.")
            self._waiting.append(t)
            self._start_worker()  # the last one may have ended, idle (``IDLE_EXIT_S``)
            self._cond.notify_all()
        return t

    def step(self, decoder: SpeculativeDecoder, should_stop: Callable[[], bool] | None = None) -> Round | None:
        """One round of ``decoder`` through the room (what ``decoder.step()`` does alone). None if stopped."""
        got = self.submit(decoder, 1).wait(should_stop)
        return got[-1] if got else None

    def prefill(self, decoder: SpeculativeDecoder) -> None:
        """``decoder.prefill()`` through the room (in the worker, between shared passes; a prefill runs alone)."""
        self.submit(decoder, prefill_only=True).wait()

    def run(self, decoder: SpeculativeDecoder, on_round=None, should_stop=None) -> GenerationResult:
        """``decoder.run()`` through the room: to the end, ``on_round(round, decoder)`` after each round."""
        for batch in self.submit(decoder, None).rounds(should_stop):
            if on_round is not None:
                for r in batch:
                    on_round(r, decoder)
        return decoder.result()

    def cancel(self, decoder: SpeculativeDecoder) -> None:
        """Cancel every request of ``decoder`` and wait until the worker has let go of it."""
        with self._cond:
            mine = [t for t in list(self._waiting) + self._running if t.decoder is decoder]
        for t in mine:
            t.cancel(wait=True)

    def bind(self, decoder: SpeculativeDecoder) -> "ScheduledDecoder":
        """A view of ``decoder`` whose ``run``/``step``/``prefill`` go through this room (for code that calls
        them, e.g. ``measure.measure_speedup_ab``)."""
        return ScheduledDecoder(self, decoder)

    def close(self) -> None:
        """Stop the worker after the pass in flight; pending requests end with an InputError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=30)

    # ---------------------------------------------------------------- what the room shows
    def readers(self) -> int:
        """Requests running or waiting now (cheap: for a page deciding how often to redraw)."""
        with self._cond:
            return sum(not t.done.is_set() for t in list(self._waiting) + self._running)

    def stats(self) -> RoomStats:
        now = time.monotonic()
        with self._cond:
            readers = sum(not t.done.is_set() for t in list(self._waiting) + self._running)
            recent = [p for p in self.passes if now - p.t_end <= WINDOW_S]
            last = self.passes[-1].rows if self.passes else 0
        busy = sum(p.ms for p in recent)
        shared = [p for p in recent if p.fed_rows > 1]
        return RoomStats(
            readers_now=readers, last_pass_rows=last,
            rows_per_pass=statistics.fmean(p.rows for p in recent) if recent else None,
            tokens_per_s=sum(p.emitted for p in recent) / (busy / 1000) if busy > 0 else None,
            passes=self.pass_count, no_draft_above=self.no_draft_above, max_rows=self.max_rows,
            threads=self.threads, drafting=(self.draft_policy.rates(last) if self.draft_policy is not None and last
                                            and band(last) >= self.draft_policy.measured_from else None),
            stack_share=(sum(p.stack_ms + p.unstack_ms for p in shared) / sum(p.ms for p in shared))
            if shared and sum(p.ms for p in shared) > 0 else None)

    # ---------------------------------------------------------------- the worker
    def _collect(self) -> list[Ticket]:
        """Admit waiting requests (FIFO), drop finished/cancelled/abandoned ones, take at most max_rows."""
        now = time.monotonic()
        while self._waiting:
            self._running.append(self._waiting.popleft())
        keep = []
        for t in self._running:
            if t.cancelled.is_set() or t.decoder is None:
                self._finish(t)
            elif now - t.last_poll > self.abandon_s:
                t.cancelled.set()
                self._finish(t)
            else:
                keep.append(t)
        batch = keep[:self.max_rows]
        self._running = keep[self.max_rows:] + batch  # rotate: the rows served go to the back
        return batch

    @staticmethod
    def _finish(t: Ticket, error: BaseException | None = None) -> None:
        if t.done.is_set():
            return
        t.error = error
        t.done.set()
        t.out.put(_DONE)

    def _warm_up(self) -> None:
        """Pay the batched path's one-time costs before the first reader does, in the worker's own thread.

        Measured in the room benchmark's server (Intel Xeon, Sapphire Rapids, 16 readers): the room's first 16-row pass
        took 559–599 ms against ~130 ms for the next ones, ~17 % of the room's run. About 160 ms of it was the
        target's LM head being packed for oneDNN (``compute.onednn._packed``: a lone reader's passes never make a
        product that large); most of the rest was memory touched for the first time (the stacked batch cache, the
        activations: page faults in this thread's allocator) and each row's first KV block (now made at its prefill:
        ``reserve_block``). So, once per room:

        1. ``WARM_ROWS`` plain-decoding rows of a ``WARM_PROMPT``-token prompt through ``_pass`` itself: their
           prefills (the first packs the products a prefill makes), then two batched rounds (the stacking, the
           blocks, the judging). Since the room's passes are batch-invariant (``compute.batch_invariant``: every
           product on the streaming kernel), the LM head's packed copy is no longer made here: nothing uses it;
        2. ``gc.collect()`` then ``gc.freeze()``, the process's first warm-up only (``_freeze_heap_once``): what is
           alive now (the modules, the model, the server) moves to the collector's permanent generation, so later
           full collections walk only what came after. Why: in the Streamlit server a full collection walked
           ~500 000 objects for 100–170 ms holding the GIL, which stalled the worker mid-pass (a 6-row pass took
           261 ms, 197 of them judging). vLLM's engine freezes its heap after start-up for the same reason.

        With both, the first pass took 240 ms and the 16-reader room's ratio to one reader alone went 2.43× → 2.95×
        (two scratch runs of ``benchmarks/bench_room.py`` in a row); with the token-text memo too, 3.07–3.31× in four
        runs on an Intel Xeon (the room table in docs/performance.md; ``benchmarks/results/room_protocol_xeon.md``).

        None of it is recorded as a pass. About 1 s on the embedded model (Intel Xeon); a failure only means no
        warm-up (``warm_ms`` stays None)."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                rows = min(WARM_ROWS, self.max_rows)
                prompt = [self._pad_id()] * min(WARM_PROMPT, max(1, self.target.max_context - 3))
                decs = [SpeculativeDecoder(self.target, None, prompt, max_new_tokens=2, stop_on_eos=False)
                        for _ in range(rows)]
                self._pass([Ticket(self, d, None, True) for d in decs], record=False)
                for _ in range(2):
                    self._pass([Ticket(self, d, 1, False) for d in decs], record=False)
        except Exception:  # noqa: BLE001 - a warm-up is an optimisation: the room serves without one
            return
        finally:
            _freeze_heap_once()
        self.warm_ms = (time.perf_counter() - t0) * 1000

    def _loop(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running:
                    idle = time.monotonic() - idle_since
                    if idle >= IDLE_EXIT_S:  # end, and take this thread's OpenMP team with it (``IDLE_EXIT_S``)
                        self._worker = None
                        return
                    self._cond.wait(timeout=IDLE_EXIT_S - idle)
                if self._closed:
                    for t in list(self._waiting) + self._running:
                        self._finish(t, InputError("The room closed before this request ran."))
                    return
                # warmed up when the first request arrives: no computing before anyone asks for it
                cold = self._cold
                batch = [] if cold else self._collect()
            if cold:
                try:
                    self._warm_up()
                finally:
                    self.warm_done = True
                    self._cold = False
                continue
            if not batch:
                continue
            try:
                with torch.inference_mode():  # the worker's own thread: no autograd (as the decoders' calls)
                    self._pass(batch)
            except BaseException as e:  # a bug here must not kill the worker: fail this pass's requests only
                for t in batch:
                    self._finish(t, e if isinstance(e, Exception) else InputError(str(e)))
            with self._cond:
                self._running = [t for t in self._running if not t.done.is_set()]
            idle_since = time.monotonic()

    def _pass(self, batch: list[Ticket], record: bool = True) -> None:
        t_pass = time.perf_counter()
        allow_draft = (self.draft_policy.drafts(len(batch)) if self.draft_policy is not None
                       else self.no_draft_above is None or len(batch) <= self.no_draft_above)
        rec = PassRecord(t_end=0.0, ms=0.0, rows=len(batch), fed_rows=0, tokens=0, emitted=0, stack_ms=0.0,
                         unstack_ms=0.0, target_ms=0.0, drafted=allow_draft, served=[t.id for t in batch])
        locked: list[SpeculativeDecoder] = []
        rows: list[tuple[Ticket, SpeculativeDecoder, PendingPass]] = []
        try:
            # 1. draft: rows whose proposers can draft together (the same draft head) in one batched call per
            # draft step (``propose_many``), the others row by row; each row with its own generator
            ready: list[tuple[Ticket, SpeculativeDecoder]] = []
            groups: dict[object, list[tuple[Ticket, SpeculativeDecoder, int]]] = {}
            for t in batch:
                dec = t.decoder
                if dec is None:
                    self._finish(t)
                    continue
                dec.lock.acquire()
                locked.append(dec)
                if t.prefill_only and dec._prefilled:
                    self._finish(t)
                    continue
                if dec.finished:
                    self._finish(t, None if t.rounds_done else
                                 InputError("This run is finished; press Reset (or start a new run) to "
                                            "generate again."))
                    continue
                ready.append((t, dec))
                try:
                    k = dec.draft_size(allow_draft, prefill=t.prefill_only) if self.batch_drafts else 0
                    key = dec.proposer.batch_key() if k > 0 else None
                except Exception:  # noqa: BLE001 - begin_pass below meets it again and reports it to this reader
                    key = None
                if key is not None:
                    groups.setdefault(key, []).append((t, dec, k))
            drafted = {}  # id(decoder) → (proposal, draft ms) made for several rows at once
            t0 = time.perf_counter()
            rec.prep_ms = (t0 - t_pass) * 1000
            for group in groups.values():
                if len(group) > 1:
                    drafted.update(self._draft_together(group))
            rec.draft_ms = (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            for t, dec in ready:
                try:
                    prop, ms = drafted.get(id(dec), (None, 0.0))
                    pending = dec.begin_pass(allow_draft, prefill=t.prefill_only, proposal=prop, draft_ms=ms)
                    if pending is None:  # a token-tree round: its own pass
                        rnd = dec.step()
                        rec.emitted += len(rnd.emitted_ids)
                        self._deliver(t, dec, rnd, 1)
                    else:
                        rows.append((t, dec, pending))
                except Exception as e:  # this reader's error stays this reader's
                    self._finish(t, e)
            rec.begin_ms = (time.perf_counter() - t0) * 1000
            # 2. one target pass for every row that feeds something
            fed = [(t, dec, p) for t, dec, p in rows if p.feed]
            logits: dict[int, torch.Tensor | None] = {id(p): None for _, _, p in rows}
            pass_ms = 0.0
            if fed:
                t0 = time.perf_counter()
                logits.update(self._target_pass(fed, rec))
                pass_ms = (time.perf_counter() - t0) * 1000
            # 3. judge and emit, row by row
            t0 = time.perf_counter()
            self._judge(rows, logits, pass_ms, rec, len(batch))
            rec.judge_ms = (time.perf_counter() - t0) * 1000
        finally:
            for dec in locked:
                dec.lock.release()
        rec.ms = (time.perf_counter() - t_pass) * 1000
        rec.t_end = time.monotonic()
        if not record:
            return
        if self.draft_policy is not None:
            self.draft_policy.record(rec.fed_rows, rec.drafted, rec.emitted, rec.ms)
        with self._cond:
            self.passes.append(rec)
            self.pass_count += 1
        log = os.environ.get(LOG_ENV)
        if log:
            try:
                with open(log, "a") as f:
                    f.write(json.dumps({k: v for k, v in rec.__dict__.items() if k != "served"}) + "\n")
            except OSError:
                pass

    def _judge(self, rows, logits, pass_ms: float, rec: PassRecord, n_batch: int) -> None:
        """Judge each fed row with its reader's own rule, then hand every round to its page (a prefill emits nothing).
        The rounds go out after all rows are judged: a page woken by its round runs Python (it draws) and, in the
        Streamlit server, took the GIL from the worker still judging the other rows (on the AMD EPYC a 15-reader pass
        whose readers all finished spent 118 ms judging, against 6 for the passes before it)."""
        ready: list[tuple[Ticket, SpeculativeDecoder, Round]] = []
        warped = self._warped(rows, logits)
        for t, dec, p in rows:
            if t.done.is_set():
                continue
            try:
                rnd = dec.finish_pass(p, logits.get(id(p)), pass_ms if p.feed else 0.0, warped=warped.get(id(p)))
            except Exception as e:
                self._finish(t, e)
                continue
            if rnd is None:  # a prefill: its cache into a block now, ready for shared passes (``reserve_block``)
                dec.target_lm.reserve_block()
                if t.prefill_only:
                    self._finish(t)
                continue
            rec.emitted += len(rnd.emitted_ids)
            ready.append((t, dec, rnd))
        for t, dec, rnd in ready:
            self._deliver(t, dec, rnd, n_batch)

    @staticmethod
    def _warped(rows, logits) -> dict[int, tuple]:
        """id(pending) → its round's p and top lists, the pass's rounds warped together (``warp_together``: each
        row's bits as alone, in a few calls instead of ~12 a row). A row whose logits cannot be put together is left
        out (its ``finish_pass`` meets the problem and reports it to that reader); a failure here leaves every row
        to warp its own."""
        chain = []
        for t, dec, p in rows:
            if t.done.is_set() or p.prefill:
                continue
            try:
                chain.append((p, dec.sampling, dec.pass_logits(p, logits.get(id(p)))))
            except Exception:  # noqa: BLE001 - reported by this row's finish_pass
                continue
        try:
            return {id(p): w for (p, _, _), w in zip(chain, warp_together([(cfg, x) for _, cfg, x in chain]))}
        except Exception:  # noqa: BLE001 - each row warps its own in finish_pass
            return {}

    @staticmethod
    def _draft_together(group: list[tuple[Ticket, SpeculativeDecoder, int]]) -> dict[int, tuple[object, float]]:
        """One batched draft for rows whose proposers share a ``batch_key`` (``propose_many``). On failure every
        generator is put back as it was and nothing is returned, so each row then drafts alone and only a row
        that fails alone gets the error. Returns id(decoder) → (proposal, the batched draft's ms)."""
        decs = [dec for _, dec, _ in group]
        states = [dec.generator.get_state() for dec in decs]
        t0 = time.perf_counter()
        try:
            props = type(decs[0].proposer).propose_many(
                [(dec.proposer, dec.seq, k, dec.sampling, dec.generator) for _, dec, k in group])
        except Exception:  # noqa: BLE001 - isolation: retried row by row
            for dec, st in zip(decs, states):
                dec.generator.set_state(st)
            return {}
        ms = (time.perf_counter() - t0) * 1000
        return {id(dec): (prop, ms) for dec, prop in zip(decs, props)}

    def _deliver(self, t: Ticket, dec: SpeculativeDecoder, rnd: Round, rows: int) -> None:
        t.rounds_done += 1
        t.last_pass_rows = rows
        t.out.put(rnd)
        if dec.finished or (t.rounds_wanted is not None and t.rounds_done >= t.rounds_wanted):
            self._finish(t)

    def _target_pass(self, fed: list[tuple[Ticket, SpeculativeDecoder, PendingPass]],
                     rec: PassRecord) -> dict[int, torch.Tensor | None]:
        """The shared target pass; a failure retries each row alone, so only a row that fails alone errs. Prefills
        run alone, one after the other: a prefill is a lone sequence's pass wherever it runs, so its KV entries are
        the same bits as alone (``compute.batch_invariant`` covers the passes after it)."""
        prefills = [x for x in fed if x[1].target_lm.cached_len == 0]  # (split before any of them is fed)
        fed = [x for x in fed if x[1].target_lm.cached_len > 0]
        out = self._each_alone(prefills, rec)
        if len(fed) > 1 and IN_OWN_CACHES:
            try:
                own = self._in_own_caches(fed, rec)
            except Exception:  # noqa: BLE001 - retried stacked, then row by row, below
                own = None
            if own is not None:
                return {**out, **own}
        if len(fed) > 1:
            try:
                return {**out, **self._stacked(fed, rec)}
            except Exception:  # noqa: BLE001 - retried row by row below
                pass
        return {**out, **self._each_alone(fed, rec)}

    def _each_alone(self, fed, rec: PassRecord) -> dict[int, torch.Tensor | None]:
        """Each row's pass alone (``_alone``); a row that fails gets its own error."""
        out: dict[int, torch.Tensor | None] = {}
        for t, dec, p in fed:
            try:
                out[id(p)] = self._alone(dec, p, rec)
            except Exception as e:
                self._finish(t, e)
        return out

    def _alone(self, dec: SpeculativeDecoder, p: PendingPass, rec: PassRecord) -> torch.Tensor:
        """A row alone: exactly the single-sequence code (``CachedLM._feed``)."""
        lm = dec.target_lm
        t0 = time.perf_counter()
        out = lm._feed(lm.ids + p.feed, len(lm.ids), p.n_fed_logits).cpu()
        rec.target_ms += (time.perf_counter() - t0) * 1000
        rec.fed_rows += 1
        rec.tokens += len(p.feed)
        return out

    @torch.inference_mode()
    def _in_own_caches(self, fed: list[tuple[Ticket, SpeculativeDecoder, PendingPass]],
                       rec: PassRecord) -> dict[int, torch.Tensor | None] | None:
        """The shared pass over the rows in their own KV caches (``compute.fused_decode_rows``): each layer writes a
        row's new entries into its ``CachedLM`` block and attends over that block, so nothing is stacked or handed
        back. Each row gets the bits of its lone pass (tests/test_scheduler.py). None where it does not apply (not the
        fused "stream" path, a cache that is not a block): the caller stacks instead. ``rec.stack_ms`` gets the
        blocks' preparation (a block grown past its spare is copied once)."""
        dev = self.target.device
        if dev.type != "cpu":
            return None
        t0 = time.perf_counter()
        lms = [dec.target_lm for _, dec, _ in fed]
        widths = [len(p.feed) for _, _, p in fed]
        width = max(widths)
        blocks = [lm.block_with_room(width) for lm in lms]
        if any(b is None for b in blocks):
            return None
        lens = [lm.cached_len for lm in lms]
        pos = torch.tensor([[n + i for i in range(width)] for n in lens], dtype=torch.long)
        pad_id = self._pad_id()
        inp = torch.tensor([p.feed + [pad_id] * (width - len(p.feed)) for _, _, p in fed], dtype=torch.long)
        rec.stack_ms += (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        model = self.target.model
        with batch_invariant():  # the LM head's product too: the streaming kernel at any row count
            h = fused_decode_rows(model.get_decoder(), inp, pos, blocks, lens, widths)
            if h is None:
                return None
            logits_all = _asked_logits(model, h, fed, widths)
        rec.target_ms += (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        out: dict[int, torch.Tensor | None] = {}
        start = 0
        for r, ((_, _, p), lm) in enumerate(zip(fed, lms)):
            w = widths[r]
            lg = logits_all[start:start + p.n_fed_logits] if p.n_fed_logits else None
            start += p.n_fed_logits
            lm.absorb_written(p.feed, h[r, :w] if lm.keep_hidden else None, lg[-1])
            out[id(p)] = lg
        rec.unstack_ms += (time.perf_counter() - t0) * 1000
        rec.fed_rows += len(fed)
        rec.tokens += len(fed) * width
        return out

    @torch.inference_mode()
    def _stacked(self, fed: list[tuple[Ticket, SpeculativeDecoder, PendingPass]],
                 rec: PassRecord) -> dict[int, torch.Tensor | None]:
        """Stack the rows' caches (left-padded), feed every row's tokens (right-padded) in one pass, give each
        row its new KV entries, hidden states and logits back. The pass runs in the batch-invariant layout
        (``compute.batch_invariant``, each row's span), so each row gets the bits of its lone pass
        (``tests/test_scheduler.py``, ``engine.decoding.invariance``)."""
        model = self.target.model
        dev = self.target.device
        t0 = time.perf_counter()
        lms = [dec.target_lm for _, dec, _ in fed]
        lens = [lm.cached_len for lm in lms]
        widths = [len(p.feed) for _, _, p in fed]
        c_max, width, b = max(lens), max(widths), len(fed)
        # room for the pass's new entries (the forward writes them in place instead of concatenating the batch
        # cache), up to a key length that is a multiple of compute.KEY_ALIGN, the spare zeroed
        room = _aligned(c_max + width) - c_max
        cache, cached_valid = stack_left_padded(
            [(lm.kv_block() or [(layer.keys, layer.values) for layer in lm.cache.layers]) if n > 0 else None
             for lm, n in zip(lms, lens)],
            lens, room=room if STACK_IN_PLACE else 0, scratch=self._scratch)
        if STACK_IN_PLACE:  # the spare past the fed tokens: zeros (masked out; a stale NaN would still poison a sum)
            blocks = getattr(cache, "kv_blocks", None)
            for keys, values in ([blocks] if blocks is not None else
                                 [(layer.keys[None], layer.values[None]) for layer in cache.layers]):
                keys[:, :, :, c_max + width:].zero_()
                values[:, :, :, c_max + width:].zero_()
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        real = torch.stack([torch.arange(width) < w for w in widths])
        new_vis = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]
        mask = model_mask(fed_visibility(new_vis, cached_valid), model).to(dev)
        pos = torch.tensor([[n + i for i in range(width)] for n in lens], dtype=torch.long, device=dev)
        pad_id = self._pad_id()
        inp = torch.tensor([p.feed + [pad_id] * (width - len(p.feed)) for _, _, p in fed], dtype=torch.long,
                           device=dev)
        rec.stack_ms += (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        # each row gets the bits of its lone pass (``compute.batch_invariant``): what makes the room's texts the
        # readers' texts alone at a near tie too
        with batch_invariant([(c_max - n, w) for n, w in zip(lens, widths)], c_max):
            h = model.get_decoder()(input_ids=inp, attention_mask=mask, position_ids=pos, cache=cache,
                                    use_cache=True).last_hidden_state  # [b, width, H]
            # the logits each row asked for: its feed's last n positions, gathered, one LM-head call
            logits_all = _asked_logits(model, h, fed, widths)
        rec.target_ms += (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        out: dict[int, torch.Tensor | None] = {}
        start = 0
        for r, ((_, dec, p), lm) in enumerate(zip(fed, lms)):
            w = widths[r]
            blocks = getattr(cache, "kv_blocks", None)
            if blocks is not None:  # every layer's new entries in one view each (CachedLM._append_block)
                keys, values = blocks[0][:, r:r + 1, :, c_max:c_max + w], blocks[1][:, r:r + 1, :, c_max:c_max + w]
            else:
                keys = [layer.keys[r:r + 1, :, c_max:c_max + w] for layer in cache.layers]
                values = [layer.values[r:r + 1, :, c_max:c_max + w] for layer in cache.layers]
            lg = logits_all[start:start + p.n_fed_logits] if p.n_fed_logits else None
            start += p.n_fed_logits
            lm.absorb(p.feed, keys, values, h[r, :w] if lm.keep_hidden else None, lg[-1].to(dev))
            out[id(p)] = lg
        rec.unstack_ms += (time.perf_counter() - t0) * 1000
        rec.fed_rows += b
        rec.tokens += b * width
        return out

    def _pad_id(self) -> int:
        tok = self.target.tokenizer
        pad = getattr(tok, "pad_token_id", None)
        return int(pad if pad is not None else (getattr(tok, "eos_token_id", None) or 0))


def _asked_logits(model, h: torch.Tensor, fed, widths: list[int]) -> torch.Tensor | None:
    """The logits every fed row asked for (the last ``n_fed_logits`` positions of its feed), gathered from the pass's
    last hidden states h [rows, width, H] in row order and put through the LM head in one call: [Σ n_fed_logits, V]
    fp32 on the CPU, or None when no row asked for any."""
    idx = [(r, widths[r] - p.n_fed_logits + j) for r, (_, _, p) in enumerate(fed) for j in range(p.n_fed_logits)]
    if not idx:
        return None
    sel = h[torch.tensor([i for i, _ in idx], device=h.device), torch.tensor([j for _, j in idx], device=h.device)]
    return model.get_output_embeddings()(sel).float().cpu()


class ScheduledDecoder:
    """A ``SpeculativeDecoder`` whose ``run``, ``step`` and ``prefill`` go through a ``Room``; every other
    attribute is the decoder's."""

    def __init__(self, room: Room, decoder: SpeculativeDecoder):
        self._room = room
        self._decoder = decoder

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def run(self, on_round=None, should_stop=None) -> GenerationResult:
        return self._room.run(self._decoder, on_round=on_round, should_stop=should_stop)

    def step(self) -> Round | None:
        return self._room.step(self._decoder)

    def prefill(self) -> None:
        self._room.prefill(self._decoder)


_rooms: dict[int, tuple[weakref.ref, Room]] = {}
_rooms_lock = threading.Lock()


@atexit.register
def _close_rooms() -> None:
    """Close every room ``room_for`` made (each worker ends after its pass in flight) before the interpreter
    finalizes: a worker thread still inside a torch op then aborts the process (exit status 134)."""
    with _rooms_lock:
        rooms = [room for _, room in _rooms.values()]
    for room in rooms:
        room.close()


def room_for(target: LoadedModel, **kw) -> Room:
    """The process-wide room of ``target`` (created on first use, warmed up: ``Room._warm_up``; ``kw`` as ``Room``'s,
    first call only)."""
    with _rooms_lock:
        for key in [k for k, (ref, _) in _rooms.items() if ref() is None]:
            _rooms.pop(key)[1].close()
        got = _rooms.get(id(target))
        if got is not None and got[0]() is target:
            return got[1]
        room = Room(target, **{"warm_up": True, **kw})
        _rooms[id(target)] = (weakref.ref(target), room)
        return room
