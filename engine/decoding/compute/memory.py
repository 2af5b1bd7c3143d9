"""Own memory: every weight still read from a memory-mapped checkpoint is copied into the process's own memory when a
fast path is applied (``_own_memory``), so the mapping can go.
"""

from __future__ import annotations

import torch
from torch import nn


def _file_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's memory mapped from checkpoint files (``/proc/self/maps`` lines whose file
    is a ``.safetensors``); empty where that file does not exist (not Linux)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip().endswith(".safetensors"):
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return ranges


def _own_memory(modules) -> int:
    """Copy into the process's own memory every CPU parameter still read from a memory-mapped checkpoint
    (transformers maps ``.safetensors`` files), so the mapping is released once nothing points into it. Returns
    the bytes copied.

    Why: after ``_fuse_siblings`` the q/k/v and gate/up weights live in their stacked copies, but the mapping stays
    while the other weights (o, down, norms, the embedding) point into it, and every page read from it so far stays
    resident: measured with the embedded model (Intel Xeon, Sapphire Rapids), 381 MB of the checkpoint's mapping were
    resident beside the stacked copies (``/proc/self/smaps``); copying the 0.16 GB still mapped gave it back. Called
    before the compact and packed copies are made (they are keyed by the weight's address)."""
    ranges = _file_ranges()
    if not ranges:
        return 0
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    copied = 0
    # Copies made under ``torch.inference_mode`` (``measure_paths`` applies paths inside it) would be inference
    # tensors, which have no version counter, so ``compact_weight`` leaves them fp32: the copies are plain tensors.
    with torch.inference_mode(False), torch.no_grad():
        for root in roots:
            for prm in root.parameters():
                if prm.device.type != "cpu" or prm.numel() == 0:
                    continue
                ptr = prm.data_ptr()
                if any(lo <= ptr < hi for lo, hi in ranges):
                    prm.data = prm.data.clone()
                    copied += prm.numel() * prm.element_size()
    return copied


_PAGE = 4096
_MADV_DONTNEED = 4
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
            _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def drop_mapped_pages(tensors) -> int:
    """Drop from this process's memory the pages of a checkpoint's mapping that ``tensors`` (CPU tensors nothing
    reads any more: weights just copied into a stacked weight or released) occupy, whole pages only (``madvise``
    ``MADV_DONTNEED`` on a private file mapping: a page read again would come back from the file, unchanged).
    Memory outside a ``.safetensors`` mapping is never touched. Returns the bytes dropped (0 where not Linux/glibc).

    Why: the mapping stays until the last weight that points into it is copied, and every page read so far stays
    resident until then: measured on the AMD EPYC while loading the embedded model, 497 MB of the checkpoint's
    mapping were resident beside the compact forms made from it, most of the load's peak."""
    ranges = _file_ranges()
    libc = _libc() if ranges else None
    if not libc:
        return 0
    dropped = 0
    for t in tensors:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        if not any(a <= lo and hi <= b for a, b in ranges):
            continue
        start, end = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE
        if end > start and libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            dropped += end - start
    return dropped


def trim_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is no glibc.

    Why: released weights were the C heap's (PyTorch's CPU allocator is malloc), and glibc keeps freed chunks below
    its mmap threshold, which rises to 32 MB after large frees: measured on the AMD EPYC, releasing the embedded
    model's 425 MB of layers lowered the process's RSS by 200 MB until trimmed."""
    libc = _libc()
    if not libc:
        return False
    libc.malloc_trim(0)
    return True
