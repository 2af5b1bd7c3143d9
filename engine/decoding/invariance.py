"""The room's batch-invariance self-check: on this machine, does a row of the room's shared pass get exactly the
bits of its lone pass?

Why: the room (``engine.decoding.scheduler.Room``) promises each reader the text it gets alone, even at a near tie
(a sampled draw whose u falls within rounding of a boundary, a greedy argmax between two equal logits). That holds
by construction where every product of a decode pass runs on the streaming kernel (``small_linear.cpp``: a row's
sums never depend on the rows beside it) and the attention on ``invariant_attention.cpp`` (a row's softmax from its
own keys only, in an order this project fixes): ``compute.batch_invariant``. Elsewhere (no C++ compiler here, a
model whose layers keep transformers' forward, CUDA) a shared pass can differ from alone by rounding. A promise
about bits should be checked where it is made, as the compute path's kernels are at load (``compute.self_check``):
``invariance_check`` decodes a few readers of the real target alone and then together in a private ``Room``,
greedy and sampled, and compares every round's p (the target's probability of each draft token), q, the top-5
lists and the bonus distribution's top-5 exactly. The Live page's room panel and the CLI's ``--json`` settings show
the result; the README's promise is worded from it.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch

from engine.decoding import compute
from engine.decoding.models import EMBEDDED, EMBEDDED_HEAD, LoadedModel

READERS = 3
NEW_TOKENS = 8
PROMPTS = ("What is a KV cache?", "Explain speculative decoding to a student in two sentences.",
           "def add(a, b):\n    return a + b\n\n# Add type hints and a docstring to add.")


@dataclass
class InvarianceCheck:
    """The self-check's result.

    Attributes:
        holds: every compared round's p, q and top-5 lists were bit for bit equal alone and in the room, and the
            room's passes run in the batch-invariant layout by construction (``by_construction``).
        by_construction: this machine runs decode passes on the streaming kernel's products and attention
            (``compute.batch_invariant``), so equality is designed, not observed.
        attention: which decode attention the shared pass runs: "kernel" (``invariant_attention.cpp``), "sdpa per
            row" (PyTorch's SDPA, one call per row laid out as alone: relies on SDPA giving equal inputs equal
            outputs) or "not invariant" (CUDA, or layers that keep transformers' forward).
        readers: readers compared. rounds: rounds compared. shared_passes: the room's passes with ≥ 2 rows.
        mismatched: readers whose bits differed (their index).
        reason: one sentence for the panel.
        cpu: the CPU model; device: the target's device. seconds: the check's wall time.
    """

    holds: bool
    by_construction: bool
    attention: str
    readers: int
    rounds: int
    shared_passes: int
    mismatched: list[int] = field(default_factory=list)
    reason: str = ""
    cpu: str = ""
    device: str = ""
    seconds: float = 0.0

    def label(self) -> str:
        """One line: what holds on this machine."""
        if self.holds:
            return (f"bit for bit equal to alone, checked here ({self.readers} readers greedy and sampled, "
                    f"{self.rounds} rounds, {self.shared_passes} shared passes on {self.cpu or self.device})")
        return f"equal to alone up to rounding here: {self.reason}"

    def to_dict(self) -> dict:
        return asdict(self)


def _attention_kind(target: LoadedModel) -> tuple[str, str]:
    """(attention kind, why) for the target's decode passes on this machine."""
    if target.device.type != "cpu":
        return "not invariant", f"the target runs on {target.device.type.upper()}, where the batch-invariant layout is CPU-only"
    if compute.path_of(target.model) != "stream":
        why = compute.stream_problem() or f"its compute path is {compute.path_of(target.model)}"
        return "not invariant", f"the streaming kernel does not run its products ({why})"
    if compute.lean_layer_count(target.model) == 0:
        return "not invariant", "the target's layers keep transformers' forward (not a Llama architecture)"
    if compute.extension._STREAM.get("attention") is None:
        return "sdpa per row", "the attention runs as one PyTorch SDPA call per row (the kernel's attention is missing)"
    return "kernel", ""


def _bits(rounds) -> list:
    out = []
    for r in rounds:
        out.append([(x.token_id, x.p, x.q, [(e.id, e.prob) for e in x.top_p]) for x in r.drafted])
        out.append([(e.id, e.prob) for e in (r.next_top_p or [])])
    return out


def _decoders(target: LoadedModel) -> list:
    from engine.decoding.drafts import make_proposer
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt

    kinds = ([EMBEDDED_HEAD, EMBEDDED_HEAD, "ngram"] if target.spec == EMBEDDED else ["ngram", "none", "ngram"])
    temps = [0.0, 0.8, 0.8]
    out = []
    for i in range(READERS):
        ids = encode_prompt(target.tokenizer, PROMPTS[i % len(PROMPTS)])
        out.append(SpeculativeDecoder(target, make_proposer(kinds[i], target), ids, gamma=3,
                                      sampling=SamplingConfig(temperature=temps[i]), seed=i,
                                      max_new_tokens=NEW_TOKENS, stop_on_eos=False))
    return out


def run_check(target: LoadedModel) -> InvarianceCheck:
    """Decode ``READERS`` readers of ``target`` alone, then together in a private room, and compare their bits.

    Returns:
        the result (never raises for a mismatch: a mismatch is a result).
    """
    from engine.decoding.scheduler import Room

    t0 = time.perf_counter()
    kind, why = _attention_kind(target)
    alone = []
    for d in _decoders(target):
        d.prefill()
        alone.append(d.run(should_stop=_STOP.is_set))
    room = Room(target, no_draft_above=None)
    got: dict[int, object] = {}
    errors: list[BaseException] = []
    try:
        decs = _decoders(target)
        for d in decs:
            room.prefill(d)

        def go(i, d):
            try:
                got[i] = room.run(d, should_stop=_STOP.is_set)
            except BaseException as e:  # noqa: BLE001 - reported as the check's result
                errors.append(e)

        ths = [threading.Thread(target=go, args=(i, d)) for i, d in enumerate(decs)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=300)
        shared = sum(p.fed_rows >= 2 for p in room.passes)
    finally:
        room.close()
    if _STOP.is_set():
        raise _Stopped("the process is exiting")
    mismatched = [i for i in range(READERS)
                  if i not in got or got[i].token_ids != alone[i].token_ids
                  or _bits(got[i].rounds) != _bits(alone[i].rounds)]
    rounds = sum(len(a.rounds) for a in alone)
    by_construction = kind == "kernel"
    equal = not mismatched and not errors and shared > 0
    if errors:
        reason = f"the room failed during the check ({type(errors[0]).__name__}: {errors[0]})"
    elif mismatched:
        reason = (f"reader{'s' if len(mismatched) > 1 else ''} {', '.join(map(str, mismatched))} got other bits in "
                  f"the shared pass than alone" + (f" ({why})" if why else ""))
    elif shared == 0:
        reason = "no pass of the check was shared, so nothing was compared"
    elif not by_construction:
        reason = f"the {READERS} readers agreed bit for bit this time, but not by construction: {why}"
    else:
        reason = ""
    return InvarianceCheck(holds=equal and by_construction, by_construction=by_construction, attention=kind,
                           readers=READERS, rounds=rounds, shared_passes=shared, mismatched=mismatched,
                           reason=reason, cpu=compute.cpu_model(), device=str(target.device),
                           seconds=time.perf_counter() - t0)


_MEMO: dict[int, tuple[weakref.ref, InvarianceCheck]] = {}  # id(target) → (a weak reference to it, its result)
_MEMO_LOCK = threading.Lock()  # held only to read or write _MEMO
_RUN_LOCK = threading.Lock()  # held while a check runs (one at a time)


def _memo(target: LoadedModel) -> InvarianceCheck | None:
    with _MEMO_LOCK:
        for key in [k for k, (ref, _) in _MEMO.items() if ref() is None]:
            del _MEMO[key]
        got = _MEMO.get(id(target))
        return got[1] if got is not None and got[0]() is target else None


def invariance_check(target: LoadedModel) -> InvarianceCheck:
    """``run_check`` once per loaded target and process (the room's start: the Live page, the CLI's ``--json``),
    then its result. A few seconds on the embedded model on a 2-core CPU (``InvarianceCheck.seconds``)."""
    with _RUN_LOCK:
        got = _memo(target)
        if got is None:
            with torch.inference_mode():
                got = run_check(target)
            with _MEMO_LOCK:
                _MEMO[id(target)] = (weakref.ref(target), got)
        return got


class _Stopped(Exception):
    """The check stopped because the process is exiting (``_stop_at_exit``); nothing is memoized."""


_STOP = threading.Event()
_THREADS: list[threading.Thread] = []


def _in_background(target: LoadedModel) -> None:
    try:
        invariance_check(target)
    except _Stopped:
        pass


@atexit.register
def _stop_at_exit() -> None:
    """Stop a background check between rounds and wait for it, before the interpreter finalizes. Why: a daemon thread
    still inside a torch op when Python finalizes aborts the process ("terminate called without an active
    exception", exit status 134), so a server stopped, or a test file ended, while the check ran looked crashed."""
    _STOP.set()
    for th in list(_THREADS):
        th.join(timeout=30)


def check_in_background(target: LoadedModel) -> InvarianceCheck | None:
    """The check's result if it has run for ``target`` in this process, else None after starting it in a daemon
    thread (once per target): a page shows "checking" meanwhile instead of waiting for it."""
    got = _memo(target)
    if got is not None:
        return got
    with _MEMO_LOCK:
        ref = _STARTED.get(id(target))
        if ref is None or ref() is not target:
            _STARTED[id(target)] = weakref.ref(target)
            th = threading.Thread(target=_in_background, args=(target,), daemon=True,
                                  name="speedup-lab-invariance-check")
            _THREADS.append(th)
            th.start()
    return None


_STARTED: dict[int, weakref.ref] = {}
