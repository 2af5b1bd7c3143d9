"""What bytes cost: the embedded model's weight formats as points on a decode roofline (What-if, "When it does not help").

A decode step reads every weight once, so at memory bandwidth B (bytes/s) a step over W bytes of weights takes at
least W / B and plain decoding makes at most B / W tokens a second: the memory-bound ceiling of the roofline
(Williams, Waterman and Patterson, "Roofline", CACM 2009). The points are what ``benchmarks/bench_formats.py``
measured for each format the streaming kernel can read exactly (the GGUF blocks, fp32): MB read a token (the
kernel's bytes, ``engine.decoding.compute.weight_formats``), plain and draft-head tokens/s, and the pass-cost curve
t(k)/t(1). Fewer bytes make the one-token pass cheaper while the work per extra token stays, so t(k)/t(1) grows and
speculation's share of the gain shrinks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InputError

SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "formats_amd-epyc.json"
"""The shipped measurement (``bench_formats.py --reps 2 --max-new 64`` on an AMD EPYC), labelled with its machine."""
NAMES = {"blocks": "GGUF blocks (Q4_1 layers, Q8_0 head)", "fp32": "fp32"}


@dataclass
class FormatPoint:
    """One weight format as measured.

    Attributes:
        name: the format's key ("blocks", "fp32": ``SPEEDUP_LAB_WEIGHTS``). label: its readable name.
        mb_per_token: MB of weights a decode step reads (10⁶ bytes). tokens_per_s: plain decoding, median.
        head_tokens_per_s: the draft head at ``gamma``, median. pass_ratio: {k: t(k)/t(1)} of a pass over k tokens.
    """

    name: str
    label: str
    mb_per_token: float
    tokens_per_s: float
    head_tokens_per_s: float
    gamma: int
    pass_ratio: dict[int, float]

    @property
    def read_gbs(self) -> float:
        """Weight bytes read a second by plain decoding: MB a token × tokens/s ÷ 1000 (GB/s, 10⁹ bytes)."""
        return self.mb_per_token * self.tokens_per_s / 1000

    @property
    def head_speedup(self) -> float:
        """The draft head's tokens/s ÷ plain decoding's, in the same measurement."""
        return self.head_tokens_per_s / self.tokens_per_s


def ceiling_tokens_per_s(bandwidth_gbs: float, mb_per_token: float) -> float:
    """The memory-bound ceiling of plain decoding: bandwidth ÷ bytes a token (tokens/s, from GB/s and MB).

    Raises:
        InputError: a bandwidth or a size that is not positive.
    """
    if not bandwidth_gbs > 0 or not mb_per_token > 0:
        raise InputError(f"The roofline needs a positive bandwidth and size, got {bandwidth_gbs} GB/s and "
                         f"{mb_per_token} MB.")
    return bandwidth_gbs * 1000 / mb_per_token


def format_points(path: str | Path = SHIPPED) -> tuple[list[FormatPoint], dict]:
    """The formats a ``bench_formats.py`` result measured, fewest bytes first, and its ``meta`` (machine, date).

    Raises:
        InputError: the file is missing, unreadable or holds no format.
    """
    try:
        d = json.loads(Path(path).read_text())
        summary = d["summary"]
        points = [FormatPoint(name=k, label=NAMES.get(k, k), mb_per_token=float(v["read_mb"]),
                              tokens_per_s=float(v["plain_tokens_per_s"]),
                              head_tokens_per_s=float(v["head_tokens_per_s"]), gamma=int(v["gamma"]),
                              pass_ratio={int(n): float(ms) / float(v["pass_ms"]["1"])
                                          for n, ms in sorted(v["pass_ms"].items(), key=lambda kv: int(kv[0]))})
                  for k, v in summary.items()]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise InputError(f"Cannot read the weight-format measurement {str(path)!r}: {e}") from None
    if not points:
        raise InputError(f"The weight-format measurement {str(path)!r} holds no format.")
    return sorted(points, key=lambda p: p.mb_per_token), dict(d.get("meta") or {})
