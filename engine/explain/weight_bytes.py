"""What bytes cost: the embedded model's weight formats as points on a decode roofline (What-if, "When it does not help").

A decode step reads every weight once, so at memory bandwidth B (bytes/s) a step over W bytes of weights takes at
least W / B and plain decoding makes at most B / W tokens a second: the memory-bound ceiling of the roofline
(Williams, Waterman and Patterson, "Roofline", CACM 2009). The points are what ``benchmarks/bench_formats.py``
measured for each format the streaming kernel can read exactly (the GGUF blocks, fp32): MB read a token (the
kernel's bytes, ``engine.decoding.compute.weight_formats``), plain and draft-head tokens/s, and the pass-cost curve
t(k)/t(1). Fewer bytes make the one-token pass cheaper while the work per extra token stays, so t(k)/t(1) grows and
speculation's share of the gain shrinks. Beside them, llama.cpp's ``llama-server`` on the same GGUF
(``benchmarks/bench_peer.py``): the same model read as the file stores it, in C++.

Each page reads this machine's results when the repository has them (``engine.explain.measured``), else the
reference machine's, and says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InputError
from engine.explain.measured import result_path

SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "formats_amd-epyc.json"
"""The reference measurement (``bench_formats.py --reps 2 --max-new 64`` on an AMD EPYC), labelled with its machine."""
PEER = "llama.cpp: plain"
"""bench_peer's name for llama.cpp's plain decoding."""
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


def above_ceiling(points, bandwidth_gbs: float) -> list:
    """The points (``FormatPoint`` or ``PeerPoint``) faster than the ceiling at their bytes a token. The ceiling's
    bandwidth is a measured copy (``engine.decoding.batch.measure_machine``: read and write); a decode step mostly
    reads, and a last-level cache can hold part of the weights, so a real step can beat it.

    Raises:
        InputError: a bandwidth that is not positive (``ceiling_tokens_per_s``).
    """
    return [p for p in points if p.tokens_per_s > ceiling_tokens_per_s(bandwidth_gbs, p.mb_per_token)]


def format_points(path: str | Path | None = None) -> tuple[list[FormatPoint], dict]:
    """The formats a ``bench_formats.py`` result measured, fewest bytes first, and its ``meta`` (machine, date, and
    "file": the result's file name).

    Args:
        path: the result (default: this machine's ``formats_<machine>.json``, else the reference machine's).

    Raises:
        InputError: the file is missing, unreadable or holds no format.
    """
    path = result_path("formats") if path is None else Path(path)
    try:
        d = json.loads(path.read_text())
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
    return sorted(points, key=lambda p: p.mb_per_token), {**dict(d.get("meta") or {}), "file": path.name}


@dataclass
class PeerPoint:
    """llama.cpp's plain decoding of the same GGUF, as ``bench_peer.py`` measured it.

    Attributes:
        mb_per_token: MB of weights a decode step reads: the GGUF's tensors as stored (``gguf_weight_bytes``).
        tokens_per_s: decode tokens/s (the server's own ``predicted_per_second``, prefill excluded, as
            ``bench_formats`` times this engine), the median over the prompts' medians.
        ours_tokens_per_s: this engine's plain decode tokens/s in the same run and the same way, when recorded.
        meta: the result's ``meta`` (machine, date, threads) and "file": its file name.
    """

    mb_per_token: float
    tokens_per_s: float
    ours_tokens_per_s: float | None
    meta: dict

    @property
    def read_gbs(self) -> float:
        """Weight bytes read a second: MB a token × tokens/s ÷ 1000 (GB/s)."""
        return self.mb_per_token * self.tokens_per_s / 1000


def gguf_weight_bytes(path: str | Path) -> int:
    """Bytes of every tensor a GGUF file stores (as stored: 4-bit blocks count their codes, scales and minimums), read
    from its header with the ``gguf`` package: what a decode step of an engine that reads the file's blocks reads
    (each weight once; a tied embedding once, as the LM head).

    Raises:
        InputError: the file is missing or not a GGUF file.
    """
    try:
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"Cannot read the GGUF file {str(path)!r}: {e}") from None


def peer_point(path: str | Path | None = None) -> PeerPoint | None:
    """llama.cpp's plain decoding from a ``bench_peer.py`` result, or None when the result is missing or predates the
    figures this needs (``meta["llama_read_mb"]``, the server's decode rate).

    Args:
        path: the result (default: this machine's ``peer_<machine>.json``, else the reference machine's).
    """
    import statistics

    path = result_path("peer") if path is None else Path(path)
    try:
        d = json.loads(path.read_text())
        mb = float(d["meta"]["llama_read_mb"])
        rows = [r[PEER] for r in d["results"].values()]
        rate = statistics.median(float(r["server_decode_tokens_per_s"]) for r in rows)
        ours = [float(r["ours: plain"]["decode_tokens_per_s"]) for r in d["results"].values()
                if "decode_tokens_per_s" in r.get("ours: plain", {})]
    except (OSError, ValueError, KeyError, TypeError, statistics.StatisticsError):
        return None
    return PeerPoint(mb, rate, statistics.median(ours) if ours else None, {**d["meta"], "file": path.name})
