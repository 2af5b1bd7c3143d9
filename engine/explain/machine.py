"""This machine's memory bandwidth and matmul FLOP/s, measured once and dated: every page that shows them (What-if's
roofline, the KV-cache page's "this machine") reads the same stored measurement, across restarts, until a reader asks
for a new one.

The measurement is ``engine.decoding.batch.measure_machine`` (a 128 MB tensor copy and a 1024² fp32 matmul, best of 3).
It is stored in the user cache (``<cache>/machine_peaks.json``, ``engine.decoding.models.cache_root``) under the CPU
model, device and torch threads it ran with; another CPU or thread count measures again.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from engine.decoding import batch as _batch
from engine.decoding.batch import MachinePeaks


@dataclass
class DatedPeaks:
    """One measurement of this machine's peaks, with when and where it ran.

    Attributes:
        peaks: the measurement. measured_at: local date and time, "2026-12-07 14:02". cpu: the CPU model.
    """

    peaks: MachinePeaks
    measured_at: str
    cpu: str

    def words(self) -> str:
        """The figures in one sentence, as every page writes them (the same digits everywhere)."""
        p = self.peaks
        return (f"{p.bandwidth_gbs:.1f} GB/s memory bandwidth and {p.peak_tflops * 1000:.1f} GFLOP/s fp32 matmul, "
                f"measured on this machine ({self.cpu}, {p.threads} threads) on {self.measured_at}")


def peaks_file() -> Path:
    from engine.decoding.models import cache_root

    return cache_root() / "machine_peaks.json"


def _key(device: str, cpu: str, threads: int) -> str:
    return f"{device}|{cpu}|{threads}"


def stored_peaks(device: str = "cpu", remeasure: bool = False, path: Path | None = None,
                 measure: Callable[[str], MachinePeaks] | None = None, cpu: str | None = None,
                 threads: int | None = None, now: Callable[[], _dt.datetime] = _dt.datetime.now) -> DatedPeaks:
    """This machine's stored measurement, or a new one (measured, stored and returned) when there is none for this
    CPU, device and thread count, or when ``remeasure``.

    Args:
        device: "cpu" or "cuda". path: the store (default ``peaks_file()``). measure: the measurement (default
            ``engine.decoding.batch.measure_machine``, read when called). cpu, threads: this machine's (default: ``compute.cpu_model()``, torch's threads).
    """
    import torch

    from engine.decoding.compute import cpu_model

    path = peaks_file() if path is None else Path(path)
    cpu = cpu_model() if cpu is None else cpu
    threads = torch.get_num_threads() if threads is None else int(threads)
    key = _key(device, cpu, threads)
    try:
        store = json.loads(path.read_text())
        if not isinstance(store, dict):
            store = {}
    except (OSError, ValueError):
        store = {}
    rec = store.get(key)
    if rec is not None and not remeasure:
        try:
            return DatedPeaks(MachinePeaks(**rec["peaks"]), str(rec["measured_at"]), cpu)
        except (KeyError, TypeError):
            pass  # an older or damaged record: measure again
    peaks = (_batch.measure_machine if measure is None else measure)(device)
    dated = DatedPeaks(peaks, now().strftime("%Y-%m-%d %H:%M"), cpu)
    store[key] = {"peaks": asdict(peaks), "measured_at": dated.measured_at}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(store, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: the pages still share the process's copy (app.resources.machine_peaks)
    return dated


def arithmetic_ceilings(remeasure: bool = False, path: Path | None = None, seconds: float = 0.5) -> dict | None:
    """This CPU's int8 and fp32 multiply-add ceilings, G/s on torch's threads (the kernel's ``arithmetic_peak``:
    register-only loops of int8 ``vpdpbusd`` and fp32 fused multiply-adds), measured once per CPU and thread count and
    stored beside the bandwidth (``peaks_file``); ``python -m engine prepare`` measures them as it measures the
    bandwidth. None where the kernel is not built here.

    Returns:
        {"int8": G/s, "fp32": G/s, "measured_at": "2026-12-07 20:30", "cpu": the CPU model, "threads": n}."""
    import torch

    from engine.decoding.compute import cpu_model, extension, stream_kernel

    stream_kernel()
    ops = extension._STREAM.get("int8")
    if ops is None:
        return None
    path = peaks_file() if path is None else path
    key = f"arithmetic|{cpu_model()}|{torch.get_num_threads()}"
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    if not remeasure and isinstance(data.get(key), dict):
        return data[key]
    got = {"int8": round(ops["peak"]("int8", seconds) / 1e9, 1), "fp32": round(ops["peak"]("fp32", seconds) / 1e9, 1),
           "measured_at": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(),
           "threads": torch.get_num_threads()}
    data[key] = got
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    except OSError:
        pass
    return got
