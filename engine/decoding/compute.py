"""The compute path: which matrix-product kernels a model's linear layers run on this machine.

Why this module exists. Decoding a 135M-parameter model on a CPU is a chain of matrix products with a few
rows (1 token, or the γ + 1 tokens of a verify pass) against large weights: the pass should cost what
reading the weights costs, and a pass over 3 tokens about what a pass over 1 costs (the lesson of the
explainer: verifying is memory-bound). PyTorch's default CPU ``nn.Linear`` calls MKL's sgemm, which on AMD
CPUs takes a slow path for products with few rows: measured on an AMD EPYC, the 49152 × 576 LM head took
11.4 ms for 1 row and 40.7 ms for 3 (``benchmarks/bench_compute.py``). oneDNN, also inside the PyTorch
wheel, picks its kernels by CPU features; ``torch.ops.mkldnn._linear_pointwise`` runs the same product in
6.6 and 7.3 ms there.

Paths:

- ``"default"``: PyTorch's own ``torch.nn.functional.linear`` (MKL sgemm on x86 CPUs, cuBLAS on CUDA).
- ``"onednn"``: ``torch.ops.mkldnn._linear_pointwise(x, W, b, "none", [], "")`` on the layer's own dense
  weight (no copy: measured on the AMD EPYC, a weight packed with ``_reorder_linear_weight`` was no faster
  for 1–3 rows, and a packed copy of every weight would double the model's memory). fp32 math is pinned:
  ``torch.backends.mkldnn.matmul.fp32_precision`` is set to ``"ieee"`` (never bf16/tf32 rounding).

The choice: ``choose_path`` runs the model's own forward (a 1-token and a 4-token pass after a short
cached context, each path five times, alternating, best of five) and keeps the faster path; the result is remembered
per machine (CPU model, torch version, threads, model shape) in the user cache, so the measurement costs
~1 s once. Before a path is used, ``self_check`` compares it with ``F.linear`` on every distinct weight
shape for 1, 3 and 16 rows; a disagreement beyond fp32 tolerance, or oneDNN's ops missing from this
PyTorch build (they are private and may move), falls back to ``"default"`` and says why.

Override: the environment variable ``SPEEDUP_LAB_COMPUTE`` (``auto``, ``default`` or ``onednn``) or the
CLI's ``--compute``. Nothing outside this module knows about oneDNN: the rest of the engine loads models
through ``engine.decoding.models.load_model`` (which calls ``use_path``) and calls ``linear`` for a bare
weight tensor (a draft head's LM-head rows).
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import InputError

ENV_VAR = "SPEEDUP_LAB_COMPUTE"
PATHS = ("default", "onednn")
CHOICES = ("auto",) + PATHS
TOLERANCE = 1e-4
"""Self-check tolerance: max |oneDNN − F.linear| ÷ max(1, max |F.linear|), fp32 (observed ≤ 2e-6 relative)."""

_LOCK = threading.Lock()
_MEMO: dict[str, "ComputePath"] = {}
_ACTIVE = {"path": "default"}


@dataclass
class ComputePath:
    """Which kernels a model's linear layers run, and why.

    Attributes:
        path: "default" (PyTorch's ``F.linear``) or "onednn" (``torch.ops.mkldnn._linear_pointwise``).
        reason: one sentence: measured (with the times), forced by an override, or a fallback and its cause.
        cpu: the CPU model this was chosen on (``cpu_model()``).
        threads: torch intra-op threads during the choice.
        pass_ms: {path: {tokens in the pass: median ms}} when measured; empty otherwise.
        extra_bytes: memory the path costs beyond the model's weights (0: oneDNN reads the dense weights).
    """

    path: str
    reason: str
    cpu: str = ""
    threads: int = 0
    pass_ms: dict = field(default_factory=dict)
    extra_bytes: int = 0

    @property
    def name(self) -> str:
        """The path's display name."""
        return {"default": "PyTorch default (MKL/cuBLAS)", "onednn": "oneDNN"}.get(self.path, self.path)

    def label(self) -> str:
        """Short label for pages and result headers, e.g. ``"oneDNN (measured: 1.82× faster than default)"``:
        the name and the reason without its timing details."""
        return f"{self.name} ({self.reason.split(' (')[0]})"

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s "model name", else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def parse_override(value: str | None) -> str:
    """Validate a compute-path override ("auto", "default" or "onednn"; case-insensitive; empty = "auto").

    Raises:
        InputError: for any other value, naming the allowed ones.
    """
    v = (value or "auto").strip().lower()
    if v not in CHOICES:
        raise InputError(f"Unknown compute path {value!r} (from --compute or ${ENV_VAR}); use one of "
                         f"{', '.join(CHOICES)}.")
    return v


def _onednn_op() -> Callable | None:
    """``torch.ops.mkldnn._linear_pointwise`` if this PyTorch build has it and oneDNN is usable, else None.

    The op is private (PyTorch's inductor uses it); it is looked up by name so a build that moved or
    dropped it falls back instead of failing.
    """
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        return getattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return None


def _pin_fp32() -> None:
    """Keep oneDNN's fp32 products in full fp32 (no implicit bf16/tf32 down-conversion)."""
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    except (AttributeError, RuntimeError, ValueError):  # older builds: fp32 is the only mode
        pass


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the process's active path (set by the last ``use_path``).

    Args:
        x: [..., in] activations. weight: [out, in]. bias: [out] or None.

    Returns:
        [..., out]. Falls back to ``F.linear`` off the CPU, for non-fp32 tensors, and whenever autograd
        needs a gradient (training).
    """
    if _ACTIVE["path"] == "onednn" and _onednn_ok(x, weight):
        return _ONEDNN_OP(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


_ONEDNN_OP = _onednn_op()


def _onednn_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_ONEDNN_OP is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.dim() >= 2 and x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward runs oneDNN (same parameters, same state dict).

    ``use_path`` switches a module's class to this one and back; training (autograd on) and non-CPU or
    non-fp32 inputs take ``F.linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - nn.Linear's
        if _onednn_ok(x, self.weight):
            return _ONEDNN_OP(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _linears(modules) -> list[nn.Linear]:
    if isinstance(modules, nn.Module):
        modules = [modules]
    out, seen = [], set()
    for root in modules:
        for m in root.modules():
            if isinstance(m, nn.Linear) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def self_check(modules, rows: tuple[int, ...] = (1, 3, 16)) -> str | None:
    """Compare oneDNN with ``F.linear`` on each distinct fp32 weight shape of ``modules``.

    Args:
        modules: an ``nn.Module`` or a list of them; every ``nn.Linear`` inside is checked (one per shape).
        rows: row counts to try (inputs [1, rows, in], fixed seed).

    Returns:
        None when every product agrees within ``TOLERANCE`` (relative to the largest output), else a
        sentence saying what failed (used as the fallback reason).
    """
    if _ONEDNN_OP is None:
        return "oneDNN's linear op is not in this PyTorch build"
    _pin_fp32()
    gen = torch.Generator().manual_seed(0)
    shapes = {}
    for m in _linears(modules):
        if m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            shapes.setdefault(tuple(m.weight.shape), m)
    with torch.inference_mode():
        for shape, m in shapes.items():
            for r in rows:
                x = torch.randn(1, r, shape[1], generator=gen)
                try:
                    got = _ONEDNN_OP(x, m.weight, m.bias, "none", [], "")
                except RuntimeError as e:
                    return f"oneDNN failed on a {shape[0]}×{shape[1]} product: {str(e).splitlines()[0]}"
                ref = F.linear(x, m.weight, m.bias)
                err = float((got - ref).abs().max()) / max(1.0, float(ref.abs().max()))
                if not err <= TOLERANCE:
                    return (f"oneDNN disagreed with F.linear by {err:.1e} (relative) on a {shape[0]}×{shape[1]} "
                            f"product with {r} rows")
    return None


def apply_path(modules, path: str) -> None:
    """Route every ``nn.Linear`` inside ``modules`` through ``path`` ("default" or "onednn"), in place,
    and make ``path`` the process's active path for ``linear``.

    Raises:
        InputError: for an unknown path.
    """
    if path not in PATHS:
        raise InputError(f"Unknown compute path {path!r}; use one of {', '.join(PATHS)}.")
    cls = OneDNNLinear if path == "onednn" else nn.Linear
    if path == "onednn":
        _pin_fp32()
    for m in _linears(modules):
        if type(m) in (nn.Linear, OneDNNLinear):  # leave subclasses with their own forward alone
            m.__class__ = cls
    _ACTIVE["path"] = path


def path_of(module: nn.Module) -> str:
    """The path ``module``'s linear layers run ("onednn" if any was switched, else "default")."""
    return "onednn" if any(isinstance(m, OneDNNLinear) for m in _linears(module)) else "default"


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
                  context: int = 16) -> dict[str, dict[int, float]]:
    """Fastest time (ms, best of ``reps``) of the model's forward over ``tokens`` new tokens after
    ``context`` cached ones, for each path, alternating paths rep by rep (the model is left on "default").
    The best of several reps, not the median: another process's load only ever adds time, so the
    minimum is the steadiest estimate of what the kernels cost.

    Returns:
        {path: {tokens: best ms}} for the paths usable here.
    """
    from transformers import DynamicCache

    paths = [p for p in PATHS if p == "default" or _ONEDNN_OP is not None]
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


def choose_path(model: nn.Module, override: str | None = None, store: Path | None = None) -> ComputePath:
    """Pick the compute path for ``model`` on this machine (see the module docstring).

    Args:
        model: a transformers causal LM (or any module with ``nn.Linear`` layers; then only an override
            or a remembered choice applies, no measurement).
        override: "auto" (measure), "default" or "onednn"; None reads ``$SPEEDUP_LAB_COMPUTE``.
        store: a JSON file remembering measured choices across processes (``load_model`` passes
            ``<user cache>/compute_paths.json``); measured choices are always remembered in memory.

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
    if problem:
        return ComputePath("default", f"fallback: {problem}", cpu, threads)
    if want == "onednn":
        return ComputePath("onednn", f"forced by override ({ENV_VAR} or --compute)", cpu, threads)
    key = _memo_key(model)
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
        ms = measure_paths(model)
        total = {path: sum(d.values()) for path, d in ms.items()}
        best = min(total, key=total.get)
        other = max(total, key=total.get)
        ratio = total[other] / total[best] if total[best] > 0 else 1.0
        detail = ", ".join(f"{path} {d[1]:.1f}/{d[4]:.1f} ms" for path, d in ms.items())
        choice = ComputePath(best, f"measured: {ratio:.2f}× faster than {other} (1-/4-token pass: {detail})",
                             cpu, threads, {k: {str(n): round(v, 2) for n, v in d.items()} for k, d in ms.items()})
        _MEMO[key] = choice
        _write_store(store, key, choice)
        return choice


def use_path(modules, choice: ComputePath) -> ComputePath:
    """Apply ``choice`` to ``modules`` (a model, a draft head, Medusa heads) and return it."""
    apply_path(modules, choice.path)
    return choice
