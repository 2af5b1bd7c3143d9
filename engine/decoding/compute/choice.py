"""Choosing the compute path for a model on this machine (``choose_path``): an override (``SPEEDUP_LAB_COMPUTE``,
``--compute``), else the model's own passes timed on each path on offer (``measure_paths``, ``measure_stream_rows``),
remembered per machine in memory and in the user cache; and what every measurement of this machine's passes is keyed
by beside the CPU (``measure_key``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engine.decoding.compute import extension, onednn
from engine.decoding.compute.apply import PATHS, ComputePath, apply_path, self_check
from engine.decoding.compute.extension import STREAM_MAX_ROWS, cpu_model, kernel_name, stream_kernel
from engine.decoding.compute.formats import arithmetic, weight_format
from engine.errors import InputError

ENV_VAR = "SPEEDUP_LAB_COMPUTE"
CHOICES = ("auto",) + PATHS
STREAM_ROW_CANDIDATES = (8, 12, 16, 24)
"""Row counts ``measure_stream_rows`` times: the limit is the largest of them up to which the streaming kernel's
passes are not slower than oneDNN's (4 when even 8 rows are: the 4-token pass of the path choice already
showed the kernel ahead there)."""

_LOCK = threading.Lock()
_MEMO: dict[str, "ComputePath"] = {}


def parse_override(value: str | None) -> str:
    """Validate a compute-path override ("auto", "default", "onednn" or "stream"; case-insensitive; empty = "auto").

    Raises:
        InputError: for any other value, naming the allowed ones.
    """
    v = (value or "auto").strip().lower()
    if v not in CHOICES:
        raise InputError(f"Unknown compute path {value!r} (from --compute or ${ENV_VAR}); use one of "
                         f"{', '.join(CHOICES)}.")
    return v


def measure_key() -> str:
    """What measurements of this machine's passes depend on, beside the CPU: the streaming kernel's build
    (``kernel_name``) and the row count from which oneDNN products read packed weights (``PACK_MIN_ROWS``). The path
    choice, the verify-cost curve (``engine.decoding.pass_cost``) and the batch curve are keyed by it, so they are
    measured again when either changes."""
    return f"{kernel_name()}|packed>={onednn.PACK_MIN_ROWS}|weights={weight_format()}|arithmetic={arithmetic()}"


def _fingerprint(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    parts = [type(model).__name__]
    for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_key_value_heads"):
        parts.append(str(getattr(cfg, k, "")))
    p = next(model.parameters(), None)
    parts.append(str(p.dtype) if p is not None else "")
    return "/".join(parts)


def _memo_key(model: nn.Module) -> str:
    return "|".join([cpu_model(), torch.__version__, f"threads={torch.get_num_threads()}", _fingerprint(model)])


def _read_store(f: Path | None) -> dict:
    try:
        return json.loads(f.read_text()) if f is not None else {}
    except (OSError, ValueError):
        return {}


def _write_store(f: Path | None, key: str, choice: ComputePath) -> None:
    if f is None:
        return
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        data = _read_store(f)
        data[key] = choice.to_dict()
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, f)
    except OSError:  # a read-only cache only costs a re-measurement next time
        pass


def measure_paths(model: nn.Module, tokens: tuple[int, ...] = (1, 4), reps: int = 5,
                  context: int = 16, paths: tuple[str, ...] | None = None) -> dict[str, dict[int, float]]:
    """Fastest time (ms, best of ``reps``) of the model's forward over ``tokens`` new tokens after
    ``context`` cached ones, for each path, alternating paths rep by rep (the model is left on "default").
    The best of several reps, not the median: another process's load only ever adds time, so the
    minimum is the steadiest estimate of what the kernels cost.

    Args:
        paths: the paths to time (default: "default", and "onednn" where this build has it).

    Returns:
        {path: {tokens: best ms}} for the paths timed.
    """
    from transformers import DynamicCache

    if paths is None:
        paths = tuple(p for p in ("default", "onednn") if p == "default" or onednn._ONEDNN_OP is not None)
    paths = list(paths)
    dev = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 100) or 100)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max(tokens)), generator=gen).to(dev)
    out: dict[str, dict[int, list[float]]] = {p: {n: [] for n in tokens} for p in paths}
    with torch.inference_mode():
        for rep in range(reps + 1):  # rep 0 warms up
            for p in (paths if rep % 2 else paths[::-1]):
                apply_path(model, p)
                cache = DynamicCache()
                model(ids[:, :context], cache=cache, use_cache=True)
                for n in tokens:
                    t0 = time.perf_counter()
                    model(ids[:, context:context + n], cache=cache, use_cache=True, logits_to_keep=1)
                    if rep:
                        out[p][n].append((time.perf_counter() - t0) * 1e3)
                    cache.crop(-n)
    apply_path(model, "default")
    return {p: {n: min(v) for n, v in d.items()} for p, d in out.items()}


def measure_stream_rows(model: nn.Module, candidates: tuple[int, ...] = STREAM_ROW_CANDIDATES,
                        reps: int = 5) -> tuple[int, dict[str, dict[int, float]]]:
    """This machine's row limit for the streaming kernel: the model's forward over each candidate number of
    tokens, on oneDNN and on the kernel without a limit (alternating, best of ``reps``, as ``measure_paths``).
    The kernel streams each weight row once against every input row, so it wins while a product is bound by
    reading the weights and loses once it is bound by arithmetic, where oneDNN's blocked kernels are better; that
    crossover depends on the CPU (measured: at 32 rows on the AMD EPYC, about 12 on the Intel Xeon of
    ``benchmarks/results/compute_xeon.md``).

    Returns:
        (the largest candidate whose stream pass was no slower than oneDNN's, or 4 when none was; {path: {tokens:
        best ms}}). The largest such candidate, not the end of the first run of them: the choice is remembered for
        the machine, and one noisy candidate must not cut the limit for good (measured on the Intel Xeon, session
        23: 8 tokens 74.8 against oneDNN's 126.0 ms, 12 tokens 143.8 against 132.4, 16 tokens 131.2 against 138.5,
        24 tokens 146.6 against 183.0; the 12-token pass was slower than the 16-token one, so noise, and the
        first-run rule stopped at 8 rows, sending every 9-node tree pass to oneDNN: 2.16× one token against 1.25×
        the day before).
    """
    old = extension._STREAM["max_rows"]
    extension._STREAM["max_rows"] = max(candidates)
    try:
        ms = measure_paths(model, tokens=tuple(candidates), reps=reps, paths=("onednn", "stream"))
    finally:
        extension._STREAM["max_rows"] = old
    wins = [n for n in candidates if ms["stream"][n] <= ms["onednn"][n]]
    return max(wins, default=4), ms


def choose_path(model: nn.Module, override: str | None = None, store: Path | None = None,
                progress: Callable[[str], None] | None = None) -> ComputePath:
    """Pick the compute path for ``model`` on this machine (see ``engine.decoding.compute``'s docstring).

    Args:
        model: a transformers causal LM (or any module with ``nn.Linear`` layers; then only an override
            or a remembered choice applies, no measurement).
        override: "auto" (measure), "default", "onednn" or "stream"; None reads ``$SPEEDUP_LAB_COMPUTE``.
        store: a JSON file remembering measured choices across processes (``load_model`` passes
            ``<user cache>/compute_paths.json``); measured choices are always remembered in memory.
        progress: told (one message) before the streaming kernel is built, the first time on a machine.

    Returns:
        the choice, not yet applied (``use_path`` applies it).

    Raises:
        InputError: an override that is not one of ``CHOICES``.
    """
    want = parse_override(os.environ.get(ENV_VAR) if override is None else override)
    cpu, threads = cpu_model(), torch.get_num_threads()
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return ComputePath("default", "not on a CPU: PyTorch's own kernels" if p is not None else "no weights",
                           cpu, threads)
    if p.dtype != torch.float32:
        return ComputePath("default", f"{str(p.dtype).removeprefix('torch.')} weights: the oneDNN path is "
                           "for fp32 only", cpu, threads)
    if want == "default":
        return ComputePath("default", f"forced by override ({ENV_VAR} or --compute)", cpu, threads)
    problem = self_check(model)
    if want == "onednn" or (problem and want == "auto"):
        if problem:
            return ComputePath("default", f"fallback: {problem}", cpu, threads)
        return ComputePath("onednn", f"forced by override ({ENV_VAR} or --compute)", cpu, threads)
    stream_kernel(progress)
    stream_bad = self_check(model, kernel="stream")
    if want == "stream":
        if not stream_bad:
            return ComputePath("stream", f"forced by override ({ENV_VAR} or --compute)", cpu, threads)
        return ComputePath("default" if problem else "onednn", f"fallback: {stream_bad}", cpu, threads)
    offered = ("default", "onednn") + (() if stream_bad else ("stream",))
    key = (_memo_key(model) + "|paths=" + ",".join(offered)
           + ("" if stream_bad else f"|kernel={extension._STREAM.get('name', '')}|rows=largest-win")
           + f"|packed>={onednn.PACK_MIN_ROWS}|weights={weight_format()}|arithmetic={arithmetic()}")
    with _LOCK:
        if key in _MEMO:
            return _MEMO[key]
        stored = _read_store(store).get(key)
        if stored:
            try:
                choice = ComputePath(**stored)
                choice.reason = choice.reason.replace("measured:", "measured on this machine earlier:", 1)
                _MEMO[key] = choice
                return choice
            except TypeError:
                pass
        if not hasattr(model, "config"):
            return ComputePath("onednn", "self-check passed (no model to time)", cpu, threads)
        ms = measure_paths(model, paths=offered)
        total = {path: sum(d.values()) for path, d in ms.items()}
        best = min(total, key=total.get)
        runner_up = min((p for p in total if p != best), key=total.get)
        ratio = total[runner_up] / total[best] if total[best] > 0 else 1.0
        detail = ", ".join(f"{path} {d[1]:.1f}/{d[4]:.1f} ms" for path, d in ms.items())
        pass_ms = {k: {str(n): round(v, 2) for n, v in d.items()} for k, d in ms.items()}
        rows, rows_note, rows_ms = STREAM_MAX_ROWS, "", {}
        if best == "stream" and "onednn" in offered:
            rows, wide = measure_stream_rows(model)
            rows_ms = {k: {str(n): round(v, 2) for n, v in d.items()} for k, d in wide.items()}
            rows_note = ("; kernel up to " + str(rows) + " rows: "
                         + ", ".join(f"{n} tokens {wide['stream'][n]:.1f} vs oneDNN {wide['onednn'][n]:.1f} ms"
                                     for n in sorted(wide["stream"])))
        choice = ComputePath(best, f"measured: {ratio:.2f}× faster than {runner_up} (1-/4-token pass: {detail}"
                             f"{rows_note})", cpu, threads, pass_ms, stream_rows=rows, rows_ms=rows_ms)
        _MEMO[key] = choice
        _write_store(store, key, choice)
        return choice
