"""engine.explain.analytic's token-tree model against hand-computed values (arithmetic in the comments)
and a brute-force search over small trees."""

from __future__ import annotations

import itertools

import pytest

from engine.errors import InputError
from engine.explain.analytic import (
    best_tree,
    expected_tokens_per_pass,
    expected_tokens_per_tree_pass,
    speedup,
    tree_child_acceptance,
    tree_path_probabilities,
    tree_size_curve,
    verify_cost_ratio,
)


def test_child_acceptance_by_hand():
    assert tree_child_acceptance(0.8, 0.5, 1) == 0.8
    assert tree_child_acceptance(0.8, 0.5, 2) == pytest.approx(0.1)     # 0.2 · 0.5
    assert tree_child_acceptance(0.8, 0.5, 3) == pytest.approx(0.05)    # 0.2 · 0.5 · 0.5
    # σ = α: the geometric form α(1 − α)^(r − 1)
    assert tree_child_acceptance(0.6, 0.6, 3) == pytest.approx(0.6 * 0.4 ** 2)
    # the ranks' events are disjoint: Σ_r a(r) = α + (1 − α)(1 − (1 − σ)^(b − 1)) ≤ 1
    total = sum(tree_child_acceptance(0.7, 0.4, r) for r in range(1, 9))
    assert total == pytest.approx(0.7 + 0.3 * (1 - 0.6 ** 7)) and total <= 1


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.8, 1.0])
@pytest.mark.parametrize("gamma", [1, 2, 5, 16])
def test_a_chain_reduces_to_leviathan_eq_1(alpha, gamma):
    chain = [-1] + list(range(gamma - 1))
    assert expected_tokens_per_tree_pass(chain, alpha, 0.5) == pytest.approx(expected_tokens_per_pass(alpha, gamma))
    if alpha < 1:
        assert expected_tokens_per_tree_pass(chain, alpha, 0.9) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))


def test_small_trees_by_hand():
    # a root with two children, α = 0.8, σ = 0.5: 1 + 0.8 + 0.8·0.8 + 0.8·0.1 = 2.52
    assert tree_path_probabilities([-1, 0, 0], 0.8, 0.5) == pytest.approx([0.8, 0.64, 0.08])
    assert expected_tokens_per_tree_pass([-1, 0, 0], 0.8, 0.5) == pytest.approx(2.52)
    # two roots: 1 + 0.8 + 0.1 = 1.9
    assert expected_tokens_per_tree_pass([-1, -1], 0.8, 0.5) == pytest.approx(1.9)
    # per-depth α = [0.9, 0.5]: a 3-chain gives 1 + 0.9 + 0.45 + 0.225 (depth 3 keeps the last α)
    assert expected_tokens_per_tree_pass([-1, 0, 1], [0.9, 0.5], 0.5) == pytest.approx(2.575)
    # the second root (rank 2) at depth 1 with α_1 = 0.9, σ = 0.3: 0.1 · 0.3 = 0.03; its child 0.03 · 0.5
    assert tree_path_probabilities([-1, -1, 1], [0.9, 0.5], 0.3) == pytest.approx([0.9, 0.03, 0.015])
    # explicit ranks: a lone rank-2 root at α = 0.3, σ = 0.9 is accepted with 0.7 · 0.9 = 0.63
    assert expected_tokens_per_tree_pass([-1], 0.3, 0.9, ranks=[2]) == pytest.approx(1.63)


def test_best_tree_by_hand():
    # α = 0.8, σ = 0.5, branching 2: the rank-1 chain 0.8, 0.64, 0.512, 0.4096, 0.32768 beats every
    # rank-2 node (0.1 at the root, 0.08 under the first node) until depth 5
    t = best_tree(5, 0.8, 0.5, 2, 5)
    assert t.parents == [-1, 0, 1, 2, 3] and t.ranks == [1] * 5
    assert t.expected_tokens == pytest.approx(expected_tokens_per_pass(0.8, 5))
    # with depth ≤ 3 the 4th node is the root's rank-2 sibling (0.1), the 5th the first node's (0.08)
    t = best_tree(5, 0.8, 0.5, 2, 3)
    assert t.parents == [-1, 0, 1, -1, 0] and t.ranks == [1, 1, 1, 2, 2]
    assert t.path_probs == pytest.approx([0.8, 0.64, 0.512, 0.1, 0.08])
    assert t.depths == [1, 2, 2 + 1, 1, 2]
    # nested: the best 4-node tree is the best 5-node tree without its last node
    assert best_tree(4, 0.8, 0.5, 2, 3).parents == t.parents[:4]


def _closed_subsets(depth: int, branching: int, size: int):
    """Every ancestor-closed set of ``size`` nodes of the full tree, as (parents, ranks) lists."""
    full = []  # (path of ranks)
    for d in range(1, depth + 1):
        full += list(itertools.product(range(1, branching + 1), repeat=d))
    for combo in itertools.combinations(full, size):
        s = set(combo)
        if all(p[:-1] in s or len(p) == 1 for p in combo):
            order = sorted(combo, key=lambda p: (len(p), p))
            idx = {p: i for i, p in enumerate(order)}
            yield [idx[p[:-1]] if len(p) > 1 else -1 for p in order], [p[-1] for p in order]


@pytest.mark.parametrize("alphas,sigma", [(0.8, 0.5), ([0.5, 0.9], 0.6), (0.3, 0.9), ([0.9, 0.2, 0.7], 0.1)])
def test_best_tree_is_optimal_by_brute_force(alphas, sigma):
    for size in (1, 3, 5):
        best = max(expected_tokens_per_tree_pass(par, alphas, sigma, ranks)
                   for par, ranks in _closed_subsets(3, 2, size))
        assert best_tree(size, alphas, sigma, 2, 3).expected_tokens == pytest.approx(best)


def test_tree_size_curve_by_hand():
    # α = 0.8, σ = 0.5, branching 2, depth ≤ 4, c = 0, t(n) = 1 + 0.1(n − 1): N = 4 (the chain) is best:
    # E = 3.3616 over t(5) = 1.4 → 2.401; N = 5 adds the root's sibling: 3.4616 / 1.5 = 2.308
    cur = tree_size_curve(0.8, 0.5, 2, 4, 0.0, n_max=8, slope=0.1)
    assert cur.tokens[:5] == pytest.approx([1.8, 2.44, 2.952, 3.3616, 3.4616])
    assert cur.speedups[3] == pytest.approx(3.3616 / 1.4) and cur.speedups[4] == pytest.approx(3.4616 / 1.5)
    assert (cur.best_n, cur.best_speedup) == (4, pytest.approx(3.3616 / 1.4))
    assert cur.depths[:6] == [1, 2, 3, 4, 4, 4]
    # c = 0.1 charges one draft pass per depth: N = 4 → 3.3616 / (0.4 + 1.4)
    assert tree_size_curve(0.8, 0.5, 2, 4, 0.1, n_max=8, slope=0.1).speedups[3] == pytest.approx(3.3616 / 1.8)


@pytest.mark.parametrize("alpha,c,slope", [(0.8, 0.05, 0.05), (0.6, 0.0, 0.2), (0.9, 0.3, 0.0)])
def test_branching_1_is_the_chain_model(alpha, c, slope):
    cur = tree_size_curve(alpha, 0.5, 1, 64, c, n_max=16, slope=slope)
    want = [speedup(alpha, g, c, verify_cost_ratio(g + 1, slope)) for g in range(1, 17)]
    assert cur.speedups == pytest.approx(want) and cur.chain_speedups == pytest.approx(want)
    assert cur.best_chain_n == cur.best_n


# a measured pass-cost curve (ms by tokens fed: benchmarks/results/verify_cost_amd-epyc.json of late November)
CPU_MS = {1: 63.47, 2: 68.04, 3: 71.83, 4: 89.72, 5: 90.16, 6: 97.28, 7: 104.5, 8: 107.72}


def test_trees_pay_where_the_verify_pass_is_flat():
    # s = 0 (a GPU's memory-bound pass): a wide tree beats the chain at the same α; on this CPU's measured
    # curve, a big tree's pass costs too much
    flat = tree_size_curve(0.6, 0.4, 4, 6, 0.0, n_max=32, slope=0.0)
    assert flat.best_n == 32 and flat.best_speedup > flat.best_chain_speedup
    cpu = tree_size_curve(0.6, 0.4, 4, 6, 0.0, n_max=32, measured_ms=CPU_MS)
    assert cpu.best_n < 32 and cpu.verify_ratios[6] == pytest.approx(107.72 / 63.47)  # N = 7: 8 tokens


def test_bad_input():
    for bad in (dict(n_nodes=0), dict(n_nodes=65), dict(branching=0), dict(branching=9), dict(max_depth=0)):
        kw = dict(n_nodes=4, depth_alphas=0.8, sigma=0.5, branching=2, max_depth=4) | bad
        with pytest.raises(InputError):
            best_tree(**kw)
    with pytest.raises(InputError, match="σ"):
        tree_child_acceptance(0.5, 1.5, 2)
    with pytest.raises(InputError, match="rank"):
        tree_child_acceptance(0.5, 0.5, 0)
    with pytest.raises(InputError):
        expected_tokens_per_tree_pass([-1, 5], 0.5, 0.5)
    with pytest.raises(InputError):
        expected_tokens_per_tree_pass([-1], [], 0.5)
    with pytest.raises(InputError, match="rank"):
        expected_tokens_per_tree_pass([-1, 0], 0.5, 0.5, ranks=[1])
    with pytest.raises(InputError):
        tree_size_curve(0.8, 0.5, 2, 4, 1.5)


def test_fit_tree_acceptance_by_hand():
    from engine.explain.analytic import fit_tree_acceptance

    # depth 1: 100 trials, rank hits 60, 12, 7 → α̂ = 0.6; rank 2 tried 40 times (12 hits), rank 3 tried 28
    # times (7 hits); depth 2: 50 trials, 25, 5, 0 → α̂ = 0.5, rank 2: 25 tries (5), rank 3: 20 tries (0)
    fit = fit_tree_acceptance([[60, 12, 7], [25, 5, 0]], [100, 50])
    assert fit.alphas == [0.6, 0.5]
    assert fit.sigma == pytest.approx((12 + 7 + 5 + 0) / (40 + 28 + 25 + 20))
    assert fit.decay == pytest.approx(0.5 / 0.6)  # one step: δ = α̂_2 / α̂_1
    assert fit.trials == [100, 50]
    # one depth: rank 2 tried 50 times (12 hits), rank 3 tried 38 times (9 hits); no decay to fit
    fit = fit_tree_acceptance([[50, 12, 9]], [100])
    assert fit.decay is None and fit.sigma == pytest.approx((12 + 9) / (50 + 38))
    with pytest.raises(InputError):
        fit_tree_acceptance([[5, 6]], [10])
    with pytest.raises(InputError):
        fit_tree_acceptance([[1]], [1, 2])


def test_fit_on_ranks_up_to_the_branching_and_the_shipped_counts():
    from engine.explain.analytic import HEAD_RANK_COUNTS, fit_tree_acceptance

    # max_rank 2: rank 2 only: (12 + 5) / (40 + 25)
    assert fit_tree_acceptance([[60, 12, 7], [25, 5, 0]], [100, 50], max_rank=2).sigma == pytest.approx(17 / 65)
    fit = fit_tree_acceptance(HEAD_RANK_COUNTS["hits"], HEAD_RANK_COUNTS["trials"])
    assert fit.alphas[0] == pytest.approx(469 / 732)            # 0.641
    assert fit.sigma == pytest.approx(0.141, abs=5e-4)          # as benchmarks/results/tree_ranks.md says
    # rank 2 alone: (80 + 96 + 88 + 85) / (263 + 313 + 339 + 367)
    two = fit_tree_acceptance(HEAD_RANK_COUNTS["hits"], HEAD_RANK_COUNTS["trials"], max_rank=2)
    assert two.sigma == pytest.approx(349 / 1282)


def test_tree_capacity_by_hand():
    """b + b² + … + b^D, capped at the largest size searched (64)."""
    from engine.explain.analytic import tree_capacity

    assert tree_capacity(3, 1) == 3
    assert tree_capacity(1, 2) == 2
    assert tree_capacity(2, 2) == 6  # 2 + 4
    assert tree_capacity(3, 2) == 12  # 3 + 9
    assert tree_capacity(2, 5) == 62  # 2 + 4 + 8 + 16 + 32
    assert tree_capacity(2, 6) == 64  # 126, capped
    assert tree_capacity(8, 16, n_max=10) == 10
    with pytest.raises(InputError):
        tree_capacity(0, 3)


@pytest.mark.parametrize("branching,depth", [(3, 1), (1, 2), (2, 2)])
def test_tree_curve_stops_at_the_capacity(branching, depth):
    """A tree of small branching and depth holds fewer than 64 nodes: the curve has exactly that many sizes, and the
    best tree of a larger size is the full tree (the What-if tab raised an IndexError asking for size 8 at depth 1)."""
    from engine.explain.analytic import tree_capacity

    most = tree_capacity(branching, depth)
    cur = tree_size_curve(0.7, 0.3, branching, depth, 0.1)
    assert cur.ns == list(range(1, most + 1)) and len(cur.speedups) == most
    assert len(best_tree(64, 0.7, 0.3, branching, depth).parents) == most
