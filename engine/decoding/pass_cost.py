"""This machine's target pass cost by tokens fed: t(n) for a pass over n new tokens after a cached context.

Speculative decoding pays off when verifying γ + 1 tokens costs little more than one decode step, so
every choice that trades tokens per pass against pass time (What-if's verify-cost curve, the shipped
head's default γ, the Medusa heads' static tree) needs t(n)/t(1) **of the machine the app runs on**:
measured, on the AMD EPYC of 2026-12-01, t(3)/t(1) was 1.94 with PyTorch's default kernels and ~1.1 with
oneDNN's (``engine.decoding.compute``), against 1.13 on the machine of late November.

``machine_pass_cost(target)`` returns the curve measured here, once per machine: keyed by CPU model,
compute path, torch threads and version and the model's shape, kept in ``<user cache>/pass_cost.json``.
The first call measures (~3–5 s for the embedded target, with progress; ``python -m engine prepare`` does
it at setup). Where nothing was measured and measuring is not wanted, ``shipped_pass_cost`` reads the
repo's ``benchmarks/results/verify_cost_amd-epyc.json``, labelled with the machine it came from.

Measurement: prefill ``context`` random tokens once; then, for each rep and each size n (sizes interleaved
so a noisy moment hits all sizes alike), one forward over n new tokens (``logits_to_keep=n``, as a verify
pass needs every position's logits) in the batch-invariant layout the engine's decode passes run in
(``compute.batch_invariant``, as ``CachedLM._feed``), timed, then ``cache.crop(-n)``. Reported: the fastest rep per
size (another process's load only ever adds time: measured during a test run on the same 2 cores, medians gave a
curve with t(4) < t(1) and t(6) = 6.3 t(1); the best of the reps is the steadiest estimate, as
``compute.measure_paths``), made non-decreasing from the right (``non_decreasing``): a pass over more tokens never
costs less, so a larger size's fastest rep bounds a smaller one's from above.

For the embedded target, ``machine_pass_cost`` also times whole rounds of the shipped draft head at γ = 1..6 and
plain decoding steps (``measure_draft_rounds``, kept in the curve's ``extra["head_rounds"]``): a round's cost is its
draft steps, its verify pass and the judging around them, which the pass curve alone leaves out (on the AMD EPYC
with the weights read as GGUF blocks, a γ = 2 round took 1.51 plain steps where the pass curve and the head card's
c = 0.1 said 1.33), and the head's default γ reads them (``engine.explain.analytic.head_speedups``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.decoding.compute import active_stream_rows, batch_invariant, cpu_model, measure_key
from engine.decoding.models import EMBEDDED, EMBEDDED_HEAD, LoadedModel, cache_root
from engine.errors import SpeedupLabError

SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)
"""Tokens per pass measured: chains up to γ = 15 and trees up to 15 nodes (+ the bonus/correction token)."""
SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "verify_cost_amd-epyc.json"


@dataclass
class PassCost:
    """A target's pass time by tokens fed.

    Attributes:
        ms: {n: ms of a pass over n new tokens, the fastest of ``reps``}; always has n = 1.
        cpu: CPU model measured on. compute: compute path ("default"/"onednn"). threads: torch threads.
        date: when measured ("YYYY-MM-DD HH:MM"). context: cached tokens before the pass. reps: reps per size.
        measured_here: True when measured on this machine (CPU model and compute path as now).
        source: one line saying where the curve comes from, for captions.
        extra: {"stream_rows": the streaming kernel's row limit during the measurement, None off that path;
            "read_bytes": the weight bytes a pass read (``compute.weight_formats``, None off the "stream" path)}
            (``machine_pass_cost`` measures again under another limit or other weight bytes); with two reps or more, "spread": {n: the
            relative gap between the two fastest reps} (``ratio_noise``); "fastest": {n: the fastest rep before
            ``non_decreasing``}; for the embedded target, "head_rounds" (``measure_draft_rounds``).
    """

    ms: dict[int, float]
    cpu: str
    compute: str
    threads: int
    date: str
    context: int = 100
    reps: int = 5
    measured_here: bool = True
    source: str = ""
    extra: dict = field(default_factory=dict)

    def ratio(self, n: int) -> float:
        """t(n)/t(1), linear between measured sizes and beyond the largest (from the last two points).

        Raises:
            ValueError: n < 1.
        """
        if n < 1:
            raise ValueError(f"a pass feeds at least one token, got {n}")
        pts = sorted(self.ms.items())
        t1 = self.ms[1]
        if n in self.ms:
            return self.ms[n] / t1
        lo = max((p for p in pts if p[0] < n), key=lambda p: p[0])
        hi = [p for p in pts if p[0] > n]
        if hi:
            (a, ta), (b, tb) = lo, hi[0]
        else:
            (a, ta), (b, tb) = pts[-2], pts[-1]
        return (ta + (tb - ta) * (n - a) / (b - a)) / t1

    def ratio_noise(self) -> float | None:
        """The curve's relative noise from its own reps: the median over sizes n > 1 of spread(n) + spread(1), where
        spread(n) = (second-fastest − fastest) ÷ fastest pass over n tokens (``extra["spread"]``, stored by
        ``measure_pass_cost``): how far t(n)/t(1) could move with one rep more or less. None for a curve stored
        without it (measured before it was kept, or of one rep)."""
        spread = {int(k): float(v) for k, v in (self.extra.get("spread") or {}).items()}
        if 1 not in spread or len(spread) < 2:
            return None
        vals = sorted(spread[n] + spread[1] for n in spread if n != 1)
        mid = len(vals) // 2
        return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2

    def ratios(self, n_max: int) -> list[float]:
        """[t(1)/t(1), t(2)/t(1), …, t(n_max)/t(1)] (``engine.decoding.medusa.choose_tree``'s ``pass_cost``)."""
        return [self.ratio(n) for n in range(1, n_max + 1)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ms"] = {str(k): v for k, v in self.ms.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PassCost":
        d = dict(d)
        d["ms"] = {int(k): float(v) for k, v in d["ms"].items()}
        return cls(**d)


def _key(spec: str, device: str = "cpu") -> str:
    """Cache key: this machine (CPU model, torch threads and version), the streaming kernel's build and oneDNN's
    packing (``compute.measure_key``: either changed is measured again), the target spec and device. The compute
    path is stored inside the entry and checked on lookup."""
    return "|".join([cpu_model(), f"threads={torch.get_num_threads()}", torch.__version__, measure_key(), spec,
                     device])


def _store() -> Path:
    return cache_root() / "pass_cost.json"


def _read() -> dict:
    try:
        return json.loads(_store().read_text())
    except (OSError, ValueError):
        return {}


def measure_pass_cost(target: LoadedModel, sizes=SIZES, reps: int = 5, context: int = 100,
                      progress: Callable[[str, float], None] | None = None,
                      should_stop: Callable[[], bool] | None = None) -> PassCost:
    """Measure t(n) for n in ``sizes`` (see the module docstring).

    Args:
        target: the loaded target. sizes: tokens per pass (must include 1). reps: timed passes per size.
        context: cached tokens before each pass. progress: (message, fraction) callback.
        should_stop: polled between reps; a stop keeps the reps done so far (at least one).

    Raises:
        ValueError: ``sizes`` without 1, or reps < 1.
    """
    from transformers import DynamicCache

    if 1 not in sizes or reps < 1:
        raise ValueError("the pass-cost curve needs n = 1 among its sizes and at least one rep")
    sizes = sorted(set(int(s) for s in sizes))
    vocab = int(getattr(target.model.config, "vocab_size", 100) or 100)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(min(100, vocab - 1), vocab, (1, context + max(sizes)), generator=gen).to(target.device)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        cache = DynamicCache()
        target.model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
        for rep in range(reps + 1):  # rep 0 warms up
            for n in (sizes if rep % 2 else sizes[::-1]):
                t0 = time.perf_counter()
                with batch_invariant():
                    target.model(input_ids=ids[:, context:context + n], cache=cache, use_cache=True,
                                 logits_to_keep=n)
                if target.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) * 1e3
                cache.crop(-n)
                if rep:
                    times[n].append(dt)
            if progress:
                progress(f"Timing target passes of 1–{max(sizes)} tokens on this machine (rep {rep} of {reps})…",
                         (rep + 1) / (reps + 1))
            if rep and should_stop is not None and should_stop():
                break
    done = min(len(v) for v in times.values())
    fastest = {n: round(min(v), 3) for n, v in times.items()}
    return PassCost(ms=non_decreasing(fastest), cpu=cpu_model(),
                    compute=target.compute.path if target.compute else "default", threads=torch.get_num_threads(),
                    date=time.strftime("%Y-%m-%d %H:%M"), context=context, reps=done, measured_here=True,
                    extra={"stream_rows": _stream_rows(target), "read_bytes": _read_bytes(target), "fastest": {str(n): v for n, v in fastest.items()},
                           **({"spread": _spread(times)} if done > 1 else {})},
                    source=f"measured on this machine ({cpu_model()}, {target.compute.name if target.compute else 'default'}"
                           f" kernels, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')})")


def non_decreasing(ms: dict[int, float]) -> dict[int, float]:
    """{n: min over m ≥ n of ms[m]}: each size's time bounded by every larger size's (a pass over more tokens reads
    the same weights and does more work, so where a larger pass was measured faster, the smaller one's fastest rep
    still held time another process took). E.g. {1: 10.9, 2: 10.5, 3: 11.8, 4: 16.8, 5: 13.6} (a curve measured
    on a busy AMD EPYC) → {1: 10.5, 2: 10.5, 3: 11.8, 4: 13.6, 5: 13.6}."""
    out, low = {}, float("inf")
    for n in sorted(ms, reverse=True):
        low = min(low, ms[n])
        out[n] = low
    return dict(sorted(out.items()))


HEAD_ROUND_GAMMAS = (1, 2, 3, 4, 5, 6)
"""The γ at which ``machine_pass_cost`` times rounds of the shipped draft head (``measure_draft_rounds``)."""
ROUND_PROMPT = "Explain in a few sentences why the sky looks blue during the day."
"""The prompt ``measure_draft_rounds`` decodes (any text: a round's time hardly depends on what it drafts)."""


def measure_draft_rounds(target: LoadedModel, proposer, gammas=HEAD_ROUND_GAMMAS, rounds: int = 6, reps: int = 3,
                         progress: Callable[[str, float], None] | None = None,
                         should_stop: Callable[[], bool] | None = None, prompt_ids: list[int] | None = None) -> dict:
    """Median wall time of a decoding round with ``proposer`` at each γ in ``gammas`` and of a plain decoding step,
    on this machine (``SpeculativeDecoder.step``: draft, verify pass, judging, KV rollback).

    Per rep and kind (kinds interleaved, the order reversed every other rep; rep 0 warms up and is not kept): a
    fresh decoder on ``ROUND_PROMPT`` (greedy, its prefill and first round untimed: the first round's draft reads the
    whole prompt), then ``rounds`` rounds timed one by one.

    Args:
        target: the loaded target. proposer: the draft (reset by each decoder's prefill). gammas: γ values (≥ 1).
        rounds: timed rounds per rep and kind. reps: kept reps. progress: (message, fraction) callback.
        should_stop: polled between reps; a stop keeps the reps done (at least one).
        prompt_ids: the prompt to decode (default: ``ROUND_PROMPT`` with the target's chat template).

    Returns:
        {"draft": the proposer's name, "plain_ms": median ms of a plain step, "round_ms": {γ: median ms of a round},
        "rounds": rounds, "reps": reps kept}.

    Raises:
        ValueError: no γ, a γ < 1, rounds < 1 or reps < 1.
    """
    import statistics

    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt

    gammas = sorted(set(int(g) for g in gammas))
    if not gammas or gammas[0] < 1 or rounds < 1 or reps < 1:
        raise ValueError("timing draft rounds needs γ ≥ 1, at least one round and one rep")
    ids = list(prompt_ids) if prompt_ids else encode_prompt(target.tokenizer, ROUND_PROMPT)
    times: dict[int, list[float]] = {g: [] for g in [0, *gammas]}
    kept = 0
    for rep in range(reps + 1):
        for g in ([0, *gammas] if rep % 2 else [*gammas, 0][::-1]):
            dec = SpeculativeDecoder(target, proposer if g else None, ids, gamma=max(g, 1), stop_on_eos=False,
                                     max_new_tokens=(rounds + 1) * (max(gammas) + 1))
            dec.prefill()
            dec.step()
            for _ in range(rounds):
                t0 = time.perf_counter()
                dec.step()
                if rep:
                    times[g].append((time.perf_counter() - t0) * 1e3)
        kept = rep
        if progress:
            progress(f"Timing draft rounds at γ = {gammas[0]}–{gammas[-1]} on this machine (rep {rep} of {reps})…",
                     (rep + 1) / (reps + 1))
        if rep and should_stop is not None and should_stop():
            break
    return {"draft": getattr(proposer, "name", "draft"), "plain_ms": round(statistics.median(times[0]), 3),
            "round_ms": {str(g): round(statistics.median(times[g]), 3) for g in gammas}, "rounds": rounds,
            "reps": kept}


def _spread(times: dict[int, list[float]]) -> dict[str, float]:
    """{n: (second-fastest − fastest) ÷ fastest} of each size's reps (``PassCost.ratio_noise``)."""
    out = {}
    for n, v in times.items():
        a, b = sorted(v)[:2]
        out[str(n)] = round((b - a) / a, 4)
    return out


def _stored(spec: str, device: str = "cpu") -> PassCost | None:
    """The curve stored for this machine and ``spec`` (any path, any row limit), or None."""
    d = _read().get(_key(spec, device))
    try:
        return PassCost.from_dict(d) if d else None
    except (TypeError, KeyError, ValueError):
        return None


def cached_pass_cost(spec: str = "embedded", compute: str | None = None, device: str = "cpu") -> PassCost | None:
    """The curve measured earlier on this machine for the target ``spec`` (and compute path ``compute``,
    when given), or None. Needs no loaded model. A "stream" curve measured under another row limit than the one
    this process's passes run with (``compute.active_stream_rows``, once a model is loaded) is None too: passes
    of more rows than the old limit cost something else now (``refresh_stale_pass_cost`` measures it again)."""
    got = _stored(spec, device)
    if got is None or (compute is not None and got.compute != compute):
        return None
    rows = active_stream_rows()
    if got.compute == "stream" and rows is not None and got.extra.get("stream_rows") != rows:
        return None
    return got


def current_pass_cost(spec: str = "embedded") -> PassCost:
    """This machine's curve for ``spec`` if measured (``prepare`` or an earlier page), else the shipped
    fallback (labelled). Never measures; no model is loaded."""
    got = cached_pass_cost(spec)
    return got if got is not None else shipped_pass_cost()


def shipped_pass_cost() -> PassCost:
    """The repo's shipped curve (``benchmarks/results/verify_cost_amd-epyc.json``), labelled with its machine.

    Raises:
        FileNotFoundError / ValueError: the file is missing or unreadable.
    """
    d = json.loads(SHIPPED.read_text())
    meta = d.get("meta", {})
    cpu = meta.get("cpu", "an earlier 2-core CPU")
    path = meta.get("compute", "default")
    return PassCost(ms={int(k): float(v) for k, v in d["ms"].items()}, cpu=cpu, compute=path,
                    threads=int(meta.get("threads", 0)), date=meta.get("date", "?"), context=int(d.get("context", 0)),
                    reps=int(d.get("reps", 0)), measured_here=False,
                    source=f"shipped fallback, measured on another machine ({cpu}, {path} kernels, "
                           f"{meta.get('date', '?')}; benchmarks/results/verify_cost_amd-epyc.json)")


def _stream_rows(target: LoadedModel) -> int | None:
    """The streaming kernel's row limit the target's passes run with (None off the "stream" path): a curve
    measured under another limit is measured again (``engine.decoding.compute.measure_stream_rows``)."""
    c = target.compute
    return int(c.stream_rows) if c is not None and c.path == "stream" else None


def _read_bytes(target: LoadedModel) -> int | None:
    """The weight bytes a pass of ``target`` reads on the "stream" path (its exact compact forms counted as stored,
    ``compute.weight_formats``), else None: a curve timed while some weights were read as fp32 is not the curve of
    passes that read them as blocks."""
    c = target.compute
    return int(c.formats["read_bytes"]) if c is not None and c.path == "stream" and c.formats else None


def _path(target: LoadedModel) -> str:
    return target.compute.path if target.compute else "default"


def _current_for(curve: PassCost, target: LoadedModel) -> bool:
    """``curve`` was measured on ``target``'s compute path under the kernel row limit it runs with, reading the
    weight bytes it reads."""
    return (curve.compute == _path(target) and curve.extra.get("stream_rows") == _stream_rows(target)
            and curve.extra.get("read_bytes") == _read_bytes(target))


def machine_pass_cost(target: LoadedModel, measure: bool = True,
                      progress: Callable[[str, float], None] | None = None) -> PassCost:
    """This machine's curve for ``target``: cached, else measured now and cached (``measure``), else the
    shipped fallback (labelled)."""
    got = _stored(target.spec, str(target.device.type))
    if got is not None and _current_for(got, target):
        return got
    if not measure:
        return shipped_pass_cost()
    got = measure_pass_cost(target, progress=progress)
    if target.spec == EMBEDDED:  # the shipped head's rounds, for its default γ (engine.explain.analytic)
        try:
            from engine.decoding.drafts import make_proposer

            # a fixed γ: each timed round drafts exactly γ tokens (the adaptive rule reads these times)
            head = make_proposer(EMBEDDED_HEAD, target, length="fixed")
            got.extra["head_rounds"] = measure_draft_rounds(target, head, progress=progress)
        except (SpeedupLabError, OSError) as e:  # the shipped head missing or unreadable: the card's c serves
            got.extra["head_rounds_problem"] = str(e)
    try:
        f = _store()
        f.parent.mkdir(parents=True, exist_ok=True)
        data = _read()
        data[_key(target.spec, str(target.device.type))] = got.to_dict()
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, f)
    except OSError:
        pass
    return got


def refresh_stale_pass_cost(target: LoadedModel, progress: Callable[[str, float], None] | None = None
                            ) -> PassCost | None:
    """Measure ``target``'s curve again (and store it) when one is stored for this machine and compute path but was
    measured under another streaming-kernel row limit than ``target`` runs with (the limit was measured anew
    since, ``compute.measure_stream_rows``); nothing when none is stored (``python -m engine prepare`` measures
    the first one) or when it is current. Returns the new curve, or None when nothing was measured.

    Why: the head's default γ, the Medusa tree and What-if's curve read the stored curve without a model
    (``cached_pass_cost``); a curve measured under an 8-row limit on an Intel Xeon gave
    a 9-token pass 2.25× one token while the passes ran under a 24-row one (1.30×, measured again)."""
    stored = _stored(target.spec, str(target.device.type))
    if stored is None or stored.compute != _path(target) or _current_for(stored, target):
        return None
    return machine_pass_cost(target, progress=progress)
