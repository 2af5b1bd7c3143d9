"""What bytes and arithmetic cost a pass over k tokens: the roofline of one target pass with two arithmetic ceilings.

A pass over k new tokens reads every weight once (W bytes, at the memory bandwidth B) and does k · P multiply-adds (P:
the model's weight count), at this CPU's peak for its arithmetic (int8: vpdpbusd; fp32: fused multiply-adds, measured
by ``arithmetic_peak``). Its floor is the larger of the two (Williams, Waterman & Patterson 2009, "Roofline"):

    t(k) = max(W / B, k · P / peak)

so t(k) / t(1) stays 1 while reading the weights dominates and grows with k past the ridge k* = W · peak / (B · P),
where the multiply-adds take over. A verify pass of γ + 1 tokens is cheap (the lesson's "about one step") only below
the ridge. Measured passes sit above this floor (the rest of a pass: attention, norms, the kernels' own efficiency).
"""

from __future__ import annotations

from engine.errors import InputError


def pass_floor_ms(k: int, weight_bytes: float, params: float, bandwidth_gbs: float, peak_gmacs: float) -> float:
    """The roofline floor of a pass over ``k`` tokens, in ms: max(W / B, k · P / peak).

    Args:
        k: tokens in the pass (≥ 1). weight_bytes: bytes of weights read a pass. params: multiply-adds a token (the
            weight count). bandwidth_gbs: GB/s. peak_gmacs: G multiply-adds/s.

    Raises:
        InputError: k < 1 or a non-positive size, bandwidth or peak.
    """
    if k < 1 or weight_bytes <= 0 or params <= 0 or bandwidth_gbs <= 0 or peak_gmacs <= 0:
        raise InputError("The roofline needs k ≥ 1 and positive bytes, weights, bandwidth and peak.")
    return max(weight_bytes / (bandwidth_gbs * 1e9), k * params / (peak_gmacs * 1e9)) * 1e3


def ridge_tokens(weight_bytes: float, params: float, bandwidth_gbs: float, peak_gmacs: float) -> float:
    """k* = W · peak / (B · P): the tokens in a pass from which the multiply-adds, not the bytes, set its time.

    Raises:
        InputError: a non-positive argument."""
    if weight_bytes <= 0 or params <= 0 or bandwidth_gbs <= 0 or peak_gmacs <= 0:
        raise InputError("The ridge needs positive bytes, weights, bandwidth and peak.")
    return weight_bytes * peak_gmacs / (bandwidth_gbs * params)


def floor_ratios(ks, weight_bytes: float, params: float, bandwidth_gbs: float, peak_gmacs: float) -> dict[int, float]:
    """{k: t_floor(k) / t_floor(1)} for the tokens ``ks`` (``pass_floor_ms``)."""
    one = pass_floor_ms(1, weight_bytes, params, bandwidth_gbs, peak_gmacs)
    return {int(k): pass_floor_ms(int(k), weight_bytes, params, bandwidth_gbs, peak_gmacs) / one for k in ks}


def regime(k: int, weight_bytes: float, params: float, bandwidth_gbs: float, peak_gmacs: float) -> str:
    """"memory-bound" when a pass over ``k`` tokens is below the ridge, else "compute-bound"."""
    return "memory-bound" if k < ridge_tokens(weight_bytes, params, bandwidth_gbs, peak_gmacs) else "compute-bound"
