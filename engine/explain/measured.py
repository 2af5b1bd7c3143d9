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


def arithmetic_agreement(path: str | Path | None = None) -> dict | None:
    """What the int8 arithmetic changes against the fp32 arithmetic and what it buys, as ``benchmarks/bench_int8.py``
    measured them on this machine (else the reference machine; None when neither result exists or it lacks them).

    Returns:
        {"identical", "prompts", "first_divergence" (the earliest and latest parting token, or None), "top1" (share of
        positions whose most likely next token agrees), "mean_kl" (nats), "ratio": {"int8": {k: t(k)/t(1)}, "fp32":
        …}, "cpu", "date", "file", "own" (measured on this kind of CPU)}.
    """
    import json

    path = result_path("int8") if path is None else Path(path)
    try:
        data = json.loads(Path(path).read_text())
        g = data["agreement"]
        parted = [d for d in g["first_divergence"] if d is not None]
        return {"identical": g["identical_texts"], "prompts": g["prompts"],
                "first_divergence": (min(parted), max(parted)) if parted else None, "top1": g["top1"],
                "mean_kl": g["mean_kl"], "max_new_tokens": g["max_new_tokens"],
                "ratio": {a: {int(k): v for k, v in p["ratio"].items()} for a, p in data["passes"].items()},
                "peaks": data.get("peaks_gmac_s", {}), "cpu": data["meta"]["cpu"], "date": data.get("date", ""),
                "file": Path(path).name, "own": machine_slug(data["meta"]["cpu"]) == machine_slug()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def arithmetic_note(arithmetic: str, data: dict | None = None) -> str:
    """One or two sentences for a page: which arithmetic runs the target, and (from ``arithmetic_agreement``) what the
    int8 arithmetic changes against the fp32 one, labelled with the machine and date it was measured on. The same
    words wherever the arithmetic is shown (Live, Race, Common mistakes)."""
    data = arithmetic_agreement() if data is None else data
    if arithmetic == "fp32":
        head = ("Arithmetic: **fp32** (every 4-bit weight rebuilt exactly to fp32 and multiplied in fp32: the fp32 "
                "model's own numbers, the reference).")
    else:
        head = ("Arithmetic: **int8** (as llama.cpp: each product's activations rounded to 8 bits per block of 32, "
                "int8 multiply-adds; much cheaper per token in a pass, and it changes the model's numbers slightly).")
    if data is None:
        return head
    where = "this machine" if data["own"] else f"another machine ({data['cpu']})"
    parted = data["first_divergence"]
    part = f"; the others part at token {parted[0]}–{parted[1]}" if parted else ""
    return (f"{head} Measured on {where}, {data['date'][:10]}: **{data['identical']} of {data['prompts']}** greedy "
            f"texts of {data['max_new_tokens']} tokens identical to the fp32 arithmetic's{part}; the most likely next "
            f"token agrees at {100 * data['top1']:.1f} % of positions (mean KL {data['mean_kl']:.4f} nats). That is "
            "the arithmetic, not speculation: speculative decoding gives exactly plain decoding's text on either.")
