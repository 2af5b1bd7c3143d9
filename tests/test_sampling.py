"""The verification rules on exact toy distributions: the output follows p, exactly."""

import math

import pytest
import torch
from scipy.stats import power_divergence

from engine.decoding.sampling import (
    SamplingConfig,
    residual_distribution,
    sample,
    verify_greedy,
    verify_sampling,
    warp_probs,
)
from engine.errors import InputError


def g_test_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """G-test of observed counts against expected probabilities (cells with p = 0 must be empty)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with p = 0 was emitted"
    return float(power_divergence(counts[keep].numpy(), (probs[keep] * n).numpy(),
                                  lambda_="log-likelihood").pvalue)


def first_token_counts(p_row, q_row, n, seed=0, rule=verify_sampling):
    """Draft one token from q, verify against p; count the first emitted token over n trials."""
    g = torch.Generator().manual_seed(seed)
    v = p_row.shape[0]
    counts = torch.zeros(v, dtype=torch.float64)
    accepted = 0
    for _ in range(n):
        x = sample(q_row, g)
        verdict = rule([x], q_row[None], torch.stack([p_row, p_row]), g)
        tok = x if verdict.n_accepted == 1 else verdict.next_token
        accepted += verdict.n_accepted
        counts[tok] += 1
    return counts, accepted / n


P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
CASES = {
    "p=q": P.clone(),
    "q flatter": torch.full((5,), 0.2, dtype=torch.float64),
    "q one-hot": torch.tensor([0, 0, 1.0, 0, 0], dtype=torch.float64),
    "q mass where p is 0": torch.tensor([0.1, 0.1, 0.1, 0.1, 0.6], dtype=torch.float64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_first_token_follows_p(name):
    q = CASES[name]
    p = P.clone()
    if name == "q mass where p is 0":
        p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)
    counts, acc = first_token_counts(p, q, 6000, seed=1)
    assert g_test_pvalue(counts, p) > 0.001
    alpha = float(torch.minimum(p, q).sum())  # acceptance = Σ min(p, q) (Leviathan et al., Def. 3.1)
    assert acc == pytest.approx(alpha, abs=0.03)


def test_p_mass_where_q_is_zero():
    p = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    counts, acc = first_token_counts(p, q, 6000, seed=2)
    assert g_test_pvalue(counts, p) > 0.001
    assert acc == pytest.approx(0.4, abs=0.03)  # Σ min(p, q) = 0.2 + 0.2


def test_wrong_rule_is_detected():
    """The test above can fail: always accepting the draft gives q, not p."""

    def always_accept(draft, q, p, g):
        return verify_sampling(draft, q, torch.cat([q, q]), g)  # judges against q, not p

    q = CASES["q flatter"]
    counts, _ = first_token_counts(P, q, 6000, seed=3, rule=always_accept)
    assert g_test_pvalue(counts, P) < 1e-6


def test_token_with_zero_target_prob_never_accepted():
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        v = verify_sampling([0], q, p, g)
        assert v.n_accepted == 0 and v.next_token == 1 and v.accept_probs == [0.0]


def test_sample_draws_each_id_with_its_share_of_the_mass(monkeypatch):
    """Inverse-CDF sampling: unnormalized mass is normalized, an id of zero mass is never drawn (also at the edges
    of the CDF), and the counts follow the distribution (G-test on 20 000 draws, fixed seed)."""
    from engine.decoding import sampling as sampling_mod

    w = torch.tensor([0.0, 2.0, 0.0, 1.0, 5.0, 0.0, 2.0, 0.0], dtype=torch.float64)  # total 10
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(8, dtype=torch.float64)
    for _ in range(20000):
        counts[sample(w, g)] += 1
    assert counts[w == 0].sum() == 0
    assert g_test_pvalue(counts, w / w.sum()) > 1e-3
    # the uniform draw at its ends: u = 0 gives the first id with mass; u just below 1 the last one with mass,
    # also when u · total rounds up to the total
    monkeypatch.setattr(sampling_mod, "uniform", lambda gen: 0.0)
    assert sample(w, g) == 1
    monkeypatch.setattr(sampling_mod, "uniform", lambda gen: 1.0 - 2 ** -53)
    assert sample(w, g) == 6
    monkeypatch.setattr(sampling_mod, "uniform", lambda gen: 1.0)  # cannot happen; still never an id of no mass
    assert sample(w, g) == 6
    # float32, a [1, V] row, and a one-hot vector
    assert sample(torch.tensor([[0.0, 0.0, 3.0]]), g) == 2
    for bad in ([0.5, -0.1, 0.6], [0.5, float("nan")], [0.5, float("inf")]):
        with pytest.raises(ValueError):
            sample(torch.tensor(bad), g)


def test_residual_zero_mass_falls_back_to_p_without_nan():
    p = torch.tensor([0.3, 0.7], dtype=torch.float64)
    r = residual_distribution(p, p + torch.tensor([1e-15, -1e-15], dtype=torch.float64))
    assert torch.isfinite(r).all() and torch.allclose(r, p)
    with pytest.raises(ValueError):
        sample(torch.zeros(3), torch.Generator().manual_seed(0))


def test_residual_hand_computed():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    # max(0, p − q) = [0.3, 0, 0] → normalized [1, 0, 0]
    assert residual_distribution(p, q).tolist() == [1.0, 0.0, 0.0]


def test_greedy_rule():
    v = verify_greedy([3, 4, 5], [3, 4, 6, 7])
    assert (v.n_accepted, v.next_token, v.next_kind, v.accept_probs) == (2, 6, "correction", [1.0, 1.0, 0.0])
    v = verify_greedy([3, 4], [3, 4, 9])
    assert (v.n_accepted, v.next_token, v.next_kind) == (2, 9, "bonus")


def test_bonus_token_distribution():
    """With p = q every draft token is accepted and the bonus follows p_{k+1}."""
    g = torch.Generator().manual_seed(5)
    p_next = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    p = torch.stack([q[0], p_next])
    counts = torch.zeros(3, dtype=torch.float64)
    for _ in range(3000):
        v = verify_sampling([1], q, p, g)
        assert v.n_accepted == 1 and v.next_kind == "bonus"
        counts[v.next_token] += 1
    assert g_test_pvalue(counts, p_next) > 0.001


def test_warp_temperature_topk_topp_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64))
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    assert torch.allclose(warp_probs(logits, cfg), torch.tensor([0.5, 0.25, 0.15, 0.0], dtype=torch.float64) / 0.9)
    # top-p 0.7: mass before each sorted token = [0, .5, .75, .9] → keep the first two
    cfg = SamplingConfig(temperature=1.0, top_p=0.7)
    assert torch.allclose(warp_probs(logits, cfg), torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    # temperature 2: p ∝ sqrt(p)
    s = torch.sqrt(torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64))
    assert torch.allclose(warp_probs(logits, SamplingConfig(temperature=2.0)), s / s.sum())
    assert math.isclose(float(warp_probs(logits, SamplingConfig(top_p=0.01, temperature=1)).max()), 1.0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5)])
def test_bad_sampling_args(kwargs):
    with pytest.raises(InputError):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_rows_is_torch_argmax_ties_and_nan_included(dtype):
    """``argmax_rows`` (NumPy on the CPU) picks what ``torch.argmax`` picks: the first of tied maxima, a NaN as the
    largest; rows of [R, V], one [V], a non-contiguous view, and the embedded model's vocabulary size."""
    from engine.decoding.sampling import argmax_rows

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 49152, generator=g, dtype=dtype)
    x[1, 100] = x[1, 40] = x[1].max() + 1  # a tie: the first wins
    x[2, 7] = x[2, 9] = float("nan")  # NaN is the largest, the first one
    x[3] = 0.0  # all equal
    assert argmax_rows(x) == torch.argmax(x, dim=-1).tolist() and argmax_rows(x)[1:4] == [40, 7, 0]
    assert argmax_rows(x[1]) == [40] and argmax_rows(x[:, ::2]) == torch.argmax(x[:, ::2], dim=-1).tolist()
    assert argmax_rows(x.to(torch.bfloat16)) == torch.argmax(x.to(torch.bfloat16), dim=-1).tolist()  # torch's own


def test_top_k_rows_gives_torch_topks_values():
    """``top_k_rows``'s two steps give ``torch.topk``'s values exactly, largest first, with indices that hold them,
    for random rows, rows whose top entries tie across chunks, a top entry in the last chunk, k of 1 and 8, float32
    and float64; a small vocabulary goes to ``torch.topk`` itself."""
    from engine.decoding.sampling import TOPK_CHUNK, top_k_rows

    g = torch.Generator().manual_seed(4)
    for trial in range(30):
        x = torch.softmax(torch.randn(5, 49152, generator=g, dtype=torch.float64) * 3, dim=-1)
        if trial % 3 == 0:
            x[:, 100:110] = x.max()
            x[:, 40000] = x.max()
        x[4, -1] = 1.0
        x = x.float() if trial % 2 else x
        for k in (1, 5, 8):
            want = torch.topk(x, k, dim=-1)
            vals, idx = top_k_rows(x, k)
            assert torch.equal(vals, want.values) and torch.equal(x.gather(1, idx), vals)
            assert int(idx[4, 0]) == 49151
    small = torch.randn(2, 16 * TOPK_CHUNK - 1, generator=g)
    vals, idx = top_k_rows(small, 5)
    want = torch.topk(small, 5, dim=-1)
    assert torch.equal(vals, want.values) and torch.equal(idx, want.indices)
    assert top_k_rows(torch.randn(2, 3, generator=g), 5)[0].shape == (2, 3)
