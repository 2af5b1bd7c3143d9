"""What every speed benchmark records about the machine it ran on: CPU model, compute path, threads, load.

``machine_meta(target)`` goes into each result's JSON ``meta``; ``machine_line(meta)`` into its markdown
header, so a number is never read without the machine and the kernels that produced it
(``engine/decoding/compute/``).
"""

from __future__ import annotations

import os
import platform

import torch

from engine.decoding.compute import cpu_model


def machine_meta(target=None) -> dict:
    """{"cpu", "cpus", "threads", "torch", "platform", "compute", "compute_reason", "weights", "load_avg_1min_start"};
    "weights" says how the streaming kernel reads the target's weights (``ComputePath.formats_label``: GGUF blocks or
    fp32, MB a token; "" off that path)."""
    c = getattr(target, "compute", None)
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "platform": platform.platform(), "compute": c.path if c else "default",
            "compute_reason": c.reason if c else "", "weights": c.formats_label() if c else "",
            "load_avg_1min_start": round(os.getloadavg()[0], 2)}


def machine_line(meta: dict) -> str:
    """One markdown line: CPU, compute path, threads, load at start (and at the end when recorded)."""
    end = meta.get("load_avg_1min_end")
    load = f"load average (1 min) {meta.get('load_avg_1min_start', '?')}" + ("" if end is None else f" → {end}")
    weights = f", {meta['weights']}" if meta.get("weights") else ""
    return (f"Machine: {meta['cpu']} ({meta['cpus']} CPUs), {meta['threads']} torch threads, torch {meta['torch']}, "
            f"compute path **{meta['compute']}** ({meta.get('compute_reason') or 'n/a'}){weights}, {load}.")


def machine_slug() -> str:
    """The machine's part of a result file's name, as the shipped results spell it ("amd-epyc", "xeon", …;
    ``engine.explain.measured.machine_slug``, which the pages use to find this machine's results)."""
    from engine.explain.measured import machine_slug as slug

    return slug()
