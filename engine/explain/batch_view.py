"""The measured batch sweep next to the roofline model of THIS machine (What-if's "When it does not help").

``measured_batch_view(sweep, peaks)`` turns a ``engine.decoding.batch.BatchSweep`` and the machine's measured
bandwidth and FLOP/s (``engine.decoding.batch.measure_machine``) into what the page draws:

- per speculative method, the measured speedup at each batch (its tokens/s ÷ plain decoding's) and the
  roofline model's speedup curve for this machine (``engine.explain.analytic.batch_speedup_curve``) with the
  method's measured α̂ and draft cost c at the smallest batch, the target's parameter count and bytes per
  parameter, and the measured bandwidth and FLOP/s;
- the measured target-pass time against tokens in the pass, with the roofline's prediction
  max(weight bytes / bandwidth, 2 · params · tokens / FLOP/s) (``analytic.roofline_step_s``).

``shipped_sweep()`` reads the benchmark's result file (``SHIPPED_SWEEP``), for pages that show a
measured sweep before the reader has run one. ``save_machine_sweep`` / ``machine_sweep`` remember the last complete
sweep measured on this machine in the user cache (``<cache>/batch_sweeps.json``, keyed by the CPU model, torch
threads and version, the streaming kernel's build and the target), so a later run of the app shows this machine's
measurement, not the shipped one from another machine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from engine.decoding.batch import PLAIN, BatchSweep, MachinePeaks
from engine.errors import InputError
from engine.explain.analytic import batch_speedup_curve, roofline_step_s

SHIPPED_SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "batch_xeon.json"
"""The shipped sweep: the newest one measured with the current cell definition (a batch below ``min_prompts``
decodes 8 prompts in groups of B; Intel Xeon, labelled so on the pages). ``batch_amd-epyc.json`` (2026-12-02)
predates that definition: its B = 1 cell is one code-edit prompt alone, on which the head accepts little (0.88×)."""
METHOD_LABELS = {PLAIN: "plain decoding", "ngram": "prompt lookup", "embedded-head": "draft head (EAGLE-style)",
                 "embedded-draft": "draft model"}


def method_label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


def readable_table(rows: list[dict]) -> list[dict]:
    """``BatchSweep.table()``'s rows with each column's method named as the pages name it ("ngram ×plain" →
    "prompt lookup ×plain", ``METHOD_LABELS``); values and column order unchanged."""
    def name(key: str) -> str:
        method, _, rest = key.partition(" ")
        return f"{method_label(method)} {rest}" if rest and method in METHOD_LABELS else key

    return [{name(k): v for k, v in row.items()} for row in rows]


def model_speedup_at(mv: "MethodView", batch: int) -> float | None:
    """The roofline model's speedup of ``mv`` at ``batch`` (None where its curve has no such batch)."""
    for b, y in zip(mv.model_batches, mv.model_speedups):
        if b == batch:
            return y
    return None


@dataclass
class MethodView:
    """One speculative method: measured against modelled speedup by batch size.

    Attributes:
        batches, measured: the batches measured and the speedup at each (tokens/s ÷ plain's).
        measured_crossover: smallest measured batch slower than plain decoding (None: none).
        alpha, c, gamma: the model's inputs: α̂ at the smallest batch; c = one draft step (the round's draft
            time per row ÷ γ) ÷ the plain decode pass at that batch, clamped to [0, 1]; γ of the sweep.
        model_batches, model_speedups: the roofline curve for this machine. model_crossover: where it falls
            to 1 (0.0: below 1 from the start; None: not within the range).
    """

    method: str
    label: str
    batches: list[int]
    measured: list[float]
    measured_crossover: int | None
    alpha: float
    c: float
    gamma: int
    model_batches: list[int]
    model_speedups: list[float]
    model_crossover: float | None


@dataclass
class BatchMeasuredView:
    """Everything the measured part of the tab draws (see the module docstring)."""

    methods: list[MethodView]
    pass_tokens: list[int]
    pass_ms: list[float]
    model_pass_ms: list[float]
    bandwidth_gbs: float
    peak_tflops: float
    params: int
    bytes_per_param: float
    plain_tokens_per_s: dict[int, float]
    ridge_tokens: float

    @property
    def weight_ms(self) -> float:
        """Reading the weights once at the measured bandwidth (ms): the roofline's floor for any pass."""
        return self.params * self.bytes_per_param / (self.bandwidth_gbs * 1e9) * 1e3


def measured_batch_view(sweep: BatchSweep, peaks: MachinePeaks | dict) -> BatchMeasuredView:
    """Combine a measured sweep with this machine's measured peaks (see ``BatchMeasuredView``).

    Raises:
        InputError: a sweep without plain decoding at its smallest batch (nothing to compare with), or no
            parameter count.
    """
    bw = float(peaks["bandwidth_gbs"] if isinstance(peaks, dict) else peaks.bandwidth_gbs)
    peak = float(peaks["peak_tflops"] if isinstance(peaks, dict) else peaks.peak_tflops)
    bw = min(max(bw, 1.0), 1e5)
    peak = min(max(peak, 0.001), 1e5)
    if sweep.params <= 0:
        raise InputError("The sweep does not name the target's parameter count.")
    measured_batches = sorted({c.batch for c in sweep.cells})
    if not measured_batches or sweep.cell(PLAIN, measured_batches[0]) is None:
        raise InputError("The sweep has no plain-decoding run at its smallest batch, so there is nothing to compare "
                         "speculation with: include plain decoding.")
    b0 = measured_batches[0]
    plain0 = sweep.cell(PLAIN, b0)
    params_b = min(max(sweep.params / 1e9, 0.01), 2000.0)
    bpp = min(max(sweep.bytes_per_param, 0.25), 4.0)
    max_batch = max(64, 2 * max(measured_batches))
    views = []
    for m in sweep.methods:
        if m == PLAIN:
            continue
        cells = sorted((c for c in sweep.cells if c.method == m and c.speedup is not None), key=lambda c: c.batch)
        if not cells:
            continue
        first = cells[0]
        alpha = float(first.acceptance_rate or 0.0)
        gamma = max(int(first.gamma), 1)
        step_ms = (first.draft_ms_per_round or 0.0) / max(first.batch, 1) / gamma
        c = min(max(step_ms / plain0.pass_ms, 0.0), 1.0) if plain0.pass_ms else 0.0
        curve = batch_speedup_curve(alpha, gamma, c, params_b, bpp, bw, peak, max_batch=max_batch)
        views.append(MethodView(
            method=m, label=method_label(m), batches=[c_.batch for c_ in cells], measured=[c_.speedup for c_ in cells],
            measured_crossover=sweep.crossover.get(m), alpha=alpha, c=c, gamma=gamma,
            model_batches=curve.batches, model_speedups=curve.speedups, model_crossover=curve.crossover_batch))
    curve_pts = sweep.pass_curve()
    ns = [n for n, _, _ in curve_pts]
    model_ms = [roofline_step_s(sweep.params, sweep.bytes_per_param, bw * 1e9, peak * 1e12, 1, n) * 1e3 for n in ns]
    ridge = sweep.bytes_per_param * peak * 1e12 / (2.0 * bw * 1e9)
    return BatchMeasuredView(methods=views, pass_tokens=ns, pass_ms=[ms for _, ms, _ in curve_pts],
                             model_pass_ms=model_ms, bandwidth_gbs=bw, peak_tflops=peak, params=sweep.params,
                             bytes_per_param=sweep.bytes_per_param,
                             plain_tokens_per_s={c.batch: c.tokens_per_s for c in sweep.cells if c.method == PLAIN},
                             ridge_tokens=ridge)


def shipped_sweep(path: Path | None = None) -> tuple[BatchSweep, dict] | None:
    """The benchmark's shipped sweep and the machine it measured (peaks; CPU model and compute path when the
    file records them), or None when there is no file.

    Args:
        path: default ``SHIPPED_SWEEP`` (benchmarks/results/batch_xeon.json, written by benchmarks/bench_batch.py).

    Raises:
        InputError: a file that is not a batch sweep result.
    """
    path = Path(path if path is not None else SHIPPED_SWEEP)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"Cannot read the shipped batch sweep {path}: {e}") from None
    if not isinstance(data, dict) or "sweep" not in data or "machine" not in data:
        raise InputError(f"{path} is not a batch sweep result (no 'sweep' or 'machine').")
    # the machine the file was measured on (CPU model, compute path: benchmarks/machine.py), when recorded
    return BatchSweep.from_dict(data["sweep"]), {**data["machine"], **data.get("machine_meta", {})}


MACHINE_SWEEPS = "batch_sweeps.json"
"""The user-cache file (``engine.decoding.models.cache_root``) of sweeps measured on this machine."""
SWEEPS_ENV = "SPEEDUP_LAB_SWEEPS"
"""Environment variable: another file for the remembered sweeps (the browser tests' server uses a temporary one,
so their tiny sweeps never stand for this machine's in the reader's app)."""


def machine_sweep_key(spec: str = "embedded") -> str:
    """This machine's key for a sweep of target ``spec``: CPU model, torch threads and version, the streaming
    kernel's build name (``engine.decoding.compute``), the spec (what ``engine.decoding.pass_cost`` keys by)."""
    import torch

    from engine.decoding.compute import cpu_model, measure_key

    return "|".join([cpu_model(), f"threads={torch.get_num_threads()}", torch.__version__, measure_key(), spec])


def _machine_store(store: Path | None) -> Path:
    from engine.decoding.models import cache_root

    if store is not None:
        return Path(store)
    return Path(os.environ.get(SWEEPS_ENV) or cache_root() / MACHINE_SWEEPS)


def save_machine_sweep(sweep: BatchSweep, spec: str, compute: str, store: Path | None = None) -> bool:
    """Remember ``sweep`` as this machine's for target ``spec`` (``compute``: the compute path's name it ran on).
    A stopped or empty sweep is not remembered, and a file that exists but is not a store of sweeps (a mistyped
    ``$SPEEDUP_LAB_SWEEPS``) is never overwritten. Returns whether it was written (a read-only cache, or a
    refused file, only costs the memory of it)."""
    if sweep.stopped or not sweep.cells:
        return False
    f = _machine_store(store)
    try:
        try:
            data = json.loads(f.read_text())
        except FileNotFoundError:
            data = {}
        if not isinstance(data, dict) or any(not isinstance(v, dict) or "sweep" not in v for v in data.values()):
            return False
        from engine.decoding.compute import cpu_model

        data[machine_sweep_key(spec)] = {"sweep": sweep.to_dict(), "compute": compute, "cpu": cpu_model(),
                                         "date": time.strftime("%Y-%m-%d %H:%M")}
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data) + "\n")
        os.replace(tmp, f)
        return True
    except (OSError, ValueError):  # unreadable, not JSON, or not a file path at all ("/")
        return False


def machine_sweep(spec: str = "embedded", store: Path | None = None) -> tuple[BatchSweep, dict] | None:
    """The last complete sweep of target ``spec`` measured on this machine (``save_machine_sweep``) and its
    {"compute", "cpu", "date"}, or None (none measured here, or an unreadable entry)."""
    try:
        entry = json.loads(_machine_store(store).read_text()).get(machine_sweep_key(spec))
        if not entry:
            return None
        return BatchSweep.from_dict(entry["sweep"]), {k: entry.get(k, "") for k in ("compute", "cpu", "date")}
    except (OSError, ValueError, KeyError, TypeError, InputError):
        return None


@dataclass
class RoomMarker:
    """The room's live batch on the measured curve (presenter mode of What-if's "When it does not help").

    Attributes:
        batch: the room's batch size: readers per target pass (``RoomStats.rows_per_pass`` over the last seconds,
            rounded; the readers waiting now when no pass ran lately).
        speedups: per method label, (speedup at ``batch``, source): the measured points interpolated linearly
            in log B between the two measured batches around it ("measured"), else the roofline model's curve
            at that batch ("roofline model"; None past its range).
        text: one sentence for the presenter.
    """

    batch: int
    speedups: dict[str, tuple[float | None, str]]
    text: str


def room_batch(stats) -> int | None:
    """The room's batch size from ``engine.decoding.scheduler.RoomStats`` (None: an idle room)."""
    if stats.rows_per_pass is not None:
        return max(1, int(round(stats.rows_per_pass)))
    return stats.readers_now or None


def _log_interp(xs: list[int], ys: list[float], x: float) -> float | None:
    import math

    pts = sorted(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            if x1 == x0:
                return y0
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    if len(pts) == 1 and pts[0][0] == x:
        return pts[0][1]
    return None


def room_marker(view: BatchMeasuredView, batch: int) -> RoomMarker:
    """Where the room's batch sits on each method's measured (else modelled) speedup curve (``RoomMarker``)."""
    out: dict[str, tuple[float | None, str]] = {}
    for mv in view.methods:
        y = _log_interp(mv.batches, mv.measured, batch)
        if y is not None:
            out[mv.label] = (y, "measured")
        else:
            out[mv.label] = (_log_interp(mv.model_batches, mv.model_speedups, batch), "roofline model")
    parts = [f"{label} {'—' if y is None else f'{y:.2f}×'} plain decoding ({src})" for label, (y, src) in out.items()]
    who = f"{batch} reader{'s' if batch != 1 else ''}"
    text = (f"The room's live batch: {who} per target pass. At that batch: " + "; ".join(parts) + "."
            if parts else f"The room's live batch: {who} per target pass.")
    return RoomMarker(batch=batch, speedups=out, text=text)
