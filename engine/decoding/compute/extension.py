"""The streaming kernel's C++ extension: built once per machine and loaded (``stream_kernel``), and what its build and
this machine's measurements are keyed by (``kernel_name``, ``cpu_model``).

The extension holds the "stream" path's products (``small_linear.cpp``), the batch-invariant decode attention
(``invariant_attention.cpp``) and the fused decoder layer of batch-invariant passes (``fused_layer.cpp``), all next to
this file. ``_STREAM`` keeps what loading it found (its ops, why it is not
available, the row limit the "stream" path runs with); the other modules of the compute path read it here
(``extension._STREAM``), so it is one state wherever it is read or replaced.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable

import torch

STREAM_MAX_ROWS = 16
"""Products of at most this many rows take the streaming kernel on the "stream" path, larger ones oneDNN, unless
``choose_path`` measured this machine's own limit (``ComputePath.stream_rows``; ``measure_stream_rows``)."""
KERNEL_SOURCE = Path(__file__).with_name("small_linear.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("invariant_attention.cpp")
FUSED_SOURCE = Path(__file__).with_name("fused_layer.cpp")
INT8_SOURCE = Path(__file__).with_name("int8_product.cpp")
KERNEL_SOURCES = (KERNEL_SOURCE, ATTENTION_SOURCE, FUSED_SOURCE, INT8_SOURCE)
KERNEL_HEADERS = (Path(__file__).with_name("lanes.h"),)
"""What the sources share (``lanes.h``): part of the build's name too, so a change to it builds the kernel again."""
"""The streaming kernel's extension: the products (``small_linear.cpp``), the batch-invariant decode attention
(``invariant_attention.cpp``) and the decoder layer of a batch-invariant pass in two calls (``fused_layer.cpp``), built
together once per machine."""
STREAM_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]

_KERNEL_LOCK = threading.Lock()
_STREAM: dict = {"tried": False, "op": None, "problem": None, "name": "", "max_rows": STREAM_MAX_ROWS}


def _cpuinfo(field_name: str) -> str | None:
    """The first ``/proc/cpuinfo`` line's value for ``field_name`` ("model name", "flags"), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(field_name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s "model name", else ``platform.processor()``)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def _cpu_flags() -> str:
    return _cpuinfo("flags") or platform.machine()


@functools.lru_cache(maxsize=1)
def kernel_name() -> str:
    """The streaming kernel's build name on this machine: ``speedup_lab_small_linear_<hash>`` of its source, its
    compiler flags, this CPU's flags and the torch version (cheap: nothing is built). Measurements that depend
    on the kernel (the path choice, ``engine.decoding.pass_cost``) are keyed by it, so a changed kernel is
    measured again."""
    import hashlib

    src = "".join(f.read_text() if f.exists() else "" for f in (*KERNEL_SOURCES, *KERNEL_HEADERS))
    key = hashlib.sha1("|".join([src, " ".join(STREAM_CFLAGS), _cpu_flags(), torch.__version__])
                       .encode()).hexdigest()[:12]
    return f"speedup_lab_small_linear_{key}"


def stream_kernel(progress: Callable[[str], None] | None = None) -> Callable | None:
    """The streaming kernel's op (``small_linear(x [M, K], w [N, K], b [N] | None) → [M, N]``), built on first
    use (~40 s; ``progress`` is told before a build), or None where it cannot be built (``stream_problem``
    says why). Built once per machine: the library is kept in ``<PyTorch's extension root>/<name>/``
    (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; the name carries the CPU's flags, the
    torch version and the source's hash) and later processes import it directly. A build lock left by a killed
    build is removed after ``STALE_LOCK_S``."""
    with _KERNEL_LOCK:
        if _STREAM["tried"]:
            return _STREAM["op"]
        _STREAM["tried"] = True
        if platform.system() != "Linux":
            _STREAM["problem"] = "the streaming kernel is built on Linux only"
            return None
        name = kernel_name()
        _STREAM["name"] = name
        try:
            from torch.utils import cpp_extension

            folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
            lib = folder / f"{name}.so"
            mod = None
            if lib.exists():  # built before: import it directly (no ninja run, no build lock to wait on)
                try:
                    mod = _import_library(name, lib)
                except Exception:  # noqa: BLE001 - a half-written library: build it again
                    for f in folder.glob("*.o"):
                        f.unlink(missing_ok=True)
                    lib.unlink(missing_ok=True)
            if mod is None:
                folder.mkdir(parents=True, exist_ok=True)
                lock = folder / "lock"  # PyTorch's build lock; a build killed midway leaves it behind forever
                if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                    lock.unlink(missing_ok=True)
                if progress is not None:
                    progress("Building this CPU's streaming kernel (once per machine, about 40 s)…")
                mod = cpp_extension.load(name=name, sources=[str(f) for f in KERNEL_SOURCES], extra_cflags=STREAM_CFLAGS,
                                         extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
            _STREAM["op"] = mod.small_linear
            _STREAM["attention"] = getattr(mod, "invariant_attention", None)
            _STREAM["fused_layer"] = getattr(mod, "FusedLayer", None)
            _STREAM["ragged_pass"] = getattr(mod, "RaggedPass", None)
            if getattr(mod, "compact_supported", lambda: False)():
                _STREAM["compact"] = {"f16": mod.small_linear_f16, "q8": mod.small_linear_q8}
                if hasattr(mod, "small_linear_q41"):
                    _STREAM["compact"]["q41"] = mod.small_linear_q41
            if hasattr(mod, "q41_pack"):  # the Q4_1 form's check: every build (the int8 arithmetic reads it too)
                _STREAM["q41_pack"] = mod.q41_pack
            if hasattr(mod, "small_linear_q41x8"):  # the int8 arithmetic (int8_product.cpp): every build has it
                _STREAM["int8"] = {"q41x8": mod.small_linear_q41x8, "q8x8": mod.small_linear_q8x8,
                                   "pack_q41": mod.int8_pack_q41, "pack_q8": mod.int8_pack_q8,
                                   "quantize_rows": mod.int8_quantize_rows, "reference_q41": mod.int8_reference_q41,
                                   "reference_q8": mod.int8_reference_q8, "impl": mod.int8_impl,
                                   "force_portable": mod.int8_force_portable, "peak": mod.arithmetic_peak}
        except Exception as e:  # noqa: BLE001 - no compiler, no headers, a failed build: the path is not offered
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _STREAM["problem"] = f"the streaming kernel could not be built here ({first[:200]})"
        return _STREAM["op"]


STALE_LOCK_S = 600
"""A build lock older than this (s) is left over from a killed build (a build takes about a minute) and removed."""


def _import_library(name: str, path: Path):
    """Import a compiled extension module from its file (what ``cpp_extension.load`` does once built)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stream_problem() -> str | None:
    """Why the streaming kernel is not available (None when it is, or was not tried yet)."""
    return _STREAM["problem"]
