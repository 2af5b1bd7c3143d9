"""The two sampling rules' acceptance of one draft token: the standard rule's Σ min(p, q) against the drafter-invariant
(Gumbel-max) coupling's agreement probability, on given distributions and as ``benchmarks/bench_gumbel.py`` measured
them on the embedded model.

Source: Daliri, Musco & Suresh, "Coupling without Communication and Drafter-Invariant Speculative Decoding" (arXiv
2408.07978, 2024), Theorem 3: the Gumbel coupling's agreement is ≥ (1 − TV) ÷ (1 + TV), TV = ½ Σ |p − q|; the
standard rule's min(1, p/q) acceptance is Σ min(p, q) = 1 − TV, the most any coupling reaches (Leviathan et al. 2023).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.decoding.sampling import gumbel_agreement
from engine.errors import InputError
from engine.explain.measured import result_path


@dataclass(frozen=True)
class RuleAcceptance:
    """One draft token's acceptance under each rule.

    Attributes:
        standard: Σ min(p, q) = 1 − TV (the standard rule).
        gumbel: the Gumbel coupling's agreement P(argmax(log p + g) = argmax(log q + g)), estimated over ``rows`` noise
            rows.
        bound: (1 − TV) ÷ (1 + TV), the paper's lower bound on ``gumbel``.
        rows: noise rows of the estimate.
    """

    standard: float
    gumbel: float
    bound: float
    rows: int


def rule_acceptance(p, q, rows: int = 4000, seed: int = 0) -> RuleAcceptance:
    """Both rules' acceptance of one draft token for target p and draft q.

    Args:
        p, q: [V] probabilities (sequences or tensors; each normalized here).
        rows: noise rows of the Gumbel estimate (≥ 1; its standard error ≤ 0.5 ÷ √rows).
        seed: the noise's seed.

    Raises:
        InputError: p and q of different lengths, a negative entry, no mass, or rows < 1.
    """
    p = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    q = torch.as_tensor(q, dtype=torch.float64).reshape(-1)
    if p.shape != q.shape or rows < 1:
        raise InputError(f"p and q need the same length and rows ≥ 1: {p.numel()}, {q.numel()}, rows {rows}.")
    if bool((p < 0).any() or (q < 0).any()) or not (float(p.sum()) > 0 and float(q.sum()) > 0):
        raise InputError("p and q must be probabilities: no negative entry, some mass.")
    p, q = p / p.sum(), q / q.sum()
    tv = float(0.5 * (p - q).abs().sum())
    return RuleAcceptance(1 - tv, gumbel_agreement(p, q, samples=rows, seed=seed), (1 - tv) / (1 + tv), rows)


def measured_rule_acceptance(path: str | Path | None = None) -> dict | None:
    """What ``benchmarks/bench_gumbel.py`` measured on the embedded model (this machine's result, else the reference
    machine's), or None when there is no readable result.

    Returns:
        {"alpha_standard", "alpha_gumbel": measured α̂ of the draft head under each rule, "sum_min", "agreement",
        "bound": the one-token acceptances on the real p and q rows (means), "positions", "identical": prompts whose
        speculative text equalled plain decoding's, "prompts", "gamma", "temperature", "cpu", "date", "file"}.
    """
    path = result_path("gumbel") if path is None else Path(path)
    try:
        d = json.loads(path.read_text())
        a, args, meta = d["acceptance"], d["args"], d["meta"]
        out = {"alpha_standard": float(a["rules"]["standard"]["alpha"]),
               "alpha_gumbel": float(a["rules"]["gumbel"]["alpha"]),
               "sum_min": float(a["sum_min_pq_mean"]), "agreement": float(a["gumbel_agreement_mean"]),
               "bound": float(a["paper_bound_mean"]), "positions": int(a["positions"]),
               "identical": int(sum(bool(x) for x in a["identical_to_plain"])), "prompts": int(args["prompts"]),
               "gamma": int(args["gamma"]), "temperature": float(args["temperature"]), "cpu": str(meta["cpu"]),
               "date": str(meta.get("date", "")), "file": path.name}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out
