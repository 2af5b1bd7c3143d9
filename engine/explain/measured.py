"""Which measurement a page reads on this machine: the result named for this kind of CPU when the repository holds
one, else the reference measurement (each page labels the numbers with the machine they came from).

Benchmarks write ``benchmarks/results/<what>_<machine>.json`` (``benchmarks/machine.py``), where ``<machine>`` is
``machine_slug()``: "amd-epyc", "xeon", or the CPU model spelt in lower case with dashes.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.decoding.compute import cpu_model

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
"""Where the benchmarks' JSON and markdown results are kept."""
REFERENCE_MACHINE = "amd-epyc"
"""The machine whose results every page can fall back on (each kind of result is shipped for it)."""


def machine_slug(cpu: str | None = None) -> str:
    """The machine's part of a result file's name: "amd-epyc" (an AMD EPYC), "xeon" (an Intel Xeon), else the CPU
    model in lower case with dashes ("cpu" when it has no letters or digits).

    Args:
        cpu: a CPU model name (default: this machine's, ``compute.cpu_model``).
    """
    model = cpu_model() if cpu is None else cpu
    if "EPYC" in model:
        return "amd-epyc"
    if "Xeon" in model:
        return "xeon"
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "cpu"


def result_path(what: str, cpu: str | None = None, folder: Path = RESULTS) -> Path:
    """``<folder>/<what>_<this machine>.json`` when it exists, else the reference machine's
    (``<what>_amd-epyc.json``; it may be missing too: the reader says so).

    Args:
        what: the result's kind, as its file names start ("formats", "peer").
        cpu: a CPU model name (default: this machine's).
    """
    own = folder / f"{what}_{machine_slug(cpu)}.json"
    return own if own.exists() else folder / f"{what}_{REFERENCE_MACHINE}.json"


def tree_pass_costs(path: str | Path | None = None) -> dict | None:
    """A token tree's verify pass against a chain's over the same tokens, as ``benchmarks/bench_tree.py`` measured
    them (its "verify" table: each pass over the context's 100 cached tokens, medians), or None when the result is
    missing or has no such table.

    Returns:
        {"rows": [(tokens fed, chain ms, tree ms)], "cpu", "compute": the machine and compute path it ran on,
        "file": the result's file name}.
    """
    import json

    path = result_path("tree") if path is None else Path(path)
    try:
        d = json.loads(path.read_text())
        rows = [(int(r["tokens_fed"]), float(r["chain_ms"]), float(r["tree_ms"])) for r in d["verify"]["rows"]]
        mm = (d.get("meta") or {}).get("machine_meta") or {}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not rows or any(c <= 0 or t <= 0 for _, c, t in rows):
        return None
    return {"rows": rows, "cpu": str(mm.get("cpu", "another machine")), "compute": str(mm.get("compute", "?")),
            "file": path.name}
