"""engine.explain.drafting: sequential vs block drafting against hand-computed values (arithmetic in the
comments), the oracle confidence cut, the block pass cost forms, and block.json's loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.errors import InputError
from engine.explain import drafting
from engine.explain.analytic import speedup, verify_cost_ratio
from engine.explain.drafting import (
    BlockCost,
    block_speedup,
    cut_oracle_speedup,
    cut_oracle_verify_ratio,
    drafting_curves,
    load_block_results,
    parse_block_results,
    position_alphas,
    sequential_speedup,
    tokens_distribution,
    tokens_per_pass,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "block" / "block.json"


def test_the_briefs_example_by_hand():
    a = position_alphas(0.8, 3)
    assert a == pytest.approx([0.8, 0.8, 0.8])
    assert tokens_per_pass(a) == pytest.approx(2.952)                          # 1 + 0.8 + 0.64 + 0.512
    assert sequential_speedup(a, 0.1, 1.0) == pytest.approx(2.952 / 1.3)       # 3·0.1 + 1 = 1.3 → 2.2708
    assert sequential_speedup(a, 0.1, 1.0) == pytest.approx(2.2708, abs=1e-4)
    assert block_speedup(a, BlockCost.constant(0.1), 1.0) == pytest.approx(2.6836, abs=1e-4)  # 2.952 / 1.1
    # with constant α the sequential model is analytic.speedup (Leviathan et al. Theorem 3.8)
    assert sequential_speedup(a, 0.1, 1.3) == pytest.approx(speedup(0.8, 3, 0.1, 1.3))


def test_block_decay_by_hand():
    a = position_alphas(0.8, 3, decay=0.5)
    assert a == pytest.approx([0.8, 0.4, 0.2])
    # E = 1 + 0.8 + 0.8·0.4 + 0.8·0.4·0.2 = 1 + 0.8 + 0.32 + 0.064 = 2.184
    assert tokens_per_pass(a) == pytest.approx(2.184)
    assert block_speedup(a, BlockCost.constant(0.1), 1.0) == pytest.approx(2.184 / 1.1)
    # the distribution of tokens per round: 0.2, 0.8·0.6, 0.32·0.8, 0.064
    assert tokens_distribution(a) == pytest.approx([0.2, 0.48, 0.256, 0.064])
    assert tokens_distribution(a).sum() == pytest.approx(1.0)
    assert float(np.dot(np.arange(1, 5), tokens_distribution(a))) == pytest.approx(2.184)


def test_block_cost_forms():
    assert BlockCost.constant(0.1)(2) == BlockCost.constant(0.1)(17) == 0.1
    lin = BlockCost.linear(0.05, 0.01)
    assert lin(8) == pytest.approx(0.13)                                      # 0.05 + 0.01·8
    m = BlockCost.measured({4: 0.06, 8: 0.08, 16: 0.12})
    assert m(4) == pytest.approx(0.06) and m(16) == pytest.approx(0.12)
    assert m(6) == pytest.approx(0.07)                                        # halfway 4 → 8
    assert m(12) == pytest.approx(0.10)
    assert m(17) == pytest.approx(0.125)                                      # 0.12 + (0.04/8)·1
    assert m(2) == pytest.approx(0.05)                                        # 0.06 − (0.02/4)·2
    assert BlockCost.measured({8: 0.2})(3) == 0.2                             # one point: flat
    assert BlockCost.measured({2: 0.05, 3: 0.01})(17) == 0.0                  # extended, never below 0
    assert "0.05 + 0.01·B" in lin.describe() and "B=8: 0.08" in m.describe()


def test_oracle_cut_by_hand():
    a = position_alphas(0.8, 3, decay=0.5)
    # slope 0.5: t(k)/t(1) = 1 + 0.5(k − 1) → 1, 1.5, 2, 2.5 for k = 1..4
    # E[t(T)] = 0.2·1 + 0.48·1.5 + 0.256·2 + 0.064·2.5 = 0.2 + 0.72 + 0.512 + 0.16 = 1.592
    assert cut_oracle_verify_ratio(a, slope=0.5) == pytest.approx(1.592)
    assert cut_oracle_speedup(a, BlockCost.constant(0.1), slope=0.5) == pytest.approx(2.184 / 1.692)
    # the full verify pays t(4) = 2.5: 2.184 / 2.6
    assert block_speedup(a, BlockCost.constant(0.1), verify_cost_ratio(4, 0.5)) == pytest.approx(2.184 / 2.6)
    # a flat verify cost: the cut saves nothing
    flat = BlockCost.constant(0.1)
    assert cut_oracle_speedup(a, flat) == pytest.approx(block_speedup(a, flat, 1.0))


def test_curves_by_hand_and_best_gamma():
    cur = drafting_curves(0.8, 0.1, BlockCost.constant(0.1), block_decay=1.0, gamma_max=3)
    assert cur.gammas == [1, 2, 3] and cur.blocks == [2, 3, 4]
    # γ = 1: 1.8/1.1; γ = 2: 2.44/1.2; γ = 3: 2.952/1.3 (sequential); block: ÷ 1.1 throughout
    assert cur.seq_speedup == pytest.approx([1.8 / 1.1, 2.44 / 1.2, 2.952 / 1.3])
    assert cur.block_speedup == pytest.approx([1.8 / 1.1, 2.44 / 1.1, 2.952 / 1.1])
    assert cur.seq_draft_cost == pytest.approx([0.1, 0.2, 0.3]) and cur.block_draft_cost == [0.1] * 3
    assert cur.best_seq == (3, pytest.approx(2.952 / 1.3)) and cur.best_block == (3, pytest.approx(2.952 / 1.1))
    # with a flat verify the cut equals the full block
    assert cur.cut_speedup == pytest.approx(cur.block_speedup)


def test_long_blocks_pay_only_while_positions_stay_accepted():
    cost = BlockCost.constant(0.1)
    # no decay: the one-pass block keeps gaining to γ = 16, sequential peaks early at the same α and c
    flat = drafting_curves(0.8, 0.1, cost, block_decay=1.0, slope=0.0)
    assert flat.best_block[0] == 16 and flat.best_seq[0] < 16
    assert all(b >= s for b, s in zip(flat.block_speedup, flat.seq_speedup))
    # a verify pass that grows a little with tokens (s = 0.05): the block still pays for longer drafts
    same = drafting_curves(0.8, 0.1, cost, block_decay=1.0, slope=0.05)
    assert same.best_seq[0] == 5 and same.best_block[0] == 8
    # a strong block decay: later positions are rarely accepted, the best block is short and loses to sequential
    decayed = drafting_curves(0.8, 0.1, cost, block_decay=0.6, slope=0.05)
    assert decayed.best_block[0] == 3 and decayed.best_block[1] < decayed.best_seq[1]
    assert decayed.block_alphas[2] == pytest.approx(0.8 * 0.36)
    # γ = 3: E = 1 + 0.8 + 0.8·0.48 + 0.384·0.288 = 2.294592; cost 0.1 + 1.15 → 1.8357
    assert decayed.block_speedup[2] == pytest.approx(2.294592 / 1.25)
    # on a verify cost that grows with tokens the oracle cut is above the full block at every γ > 0
    s = drafting_curves(0.8, 0.1, cost, block_decay=0.8, slope=0.3)
    assert all(c >= b - 1e-12 for c, b in zip(s.cut_speedup, s.block_speedup))
    assert s.cut_speedup[-1] > s.block_speedup[-1]


def test_measured_verify_curve_is_used():
    ms = {1: 20.0, 3: 24.0, 5: 30.0}
    cur = drafting_curves(0.7, 0.05, BlockCost.constant(0.1), measured_ms=ms, gamma_max=4)
    # γ = 2 verifies 3 tokens: t(3)/t(1) = 1.2; E = 1 + 0.7 + 0.49 = 2.19
    assert cur.verify[1] == pytest.approx(1.2)
    assert cur.seq_speedup[1] == pytest.approx(2.19 / (0.1 + 1.2))
    assert cur.block_speedup[1] == pytest.approx(2.19 / (0.1 + 1.2))


@pytest.mark.parametrize("call,msg", [
    (lambda: position_alphas(1.2, 3), "α must be in [0, 1]"),
    (lambda: position_alphas(0.8, 0), "γ must be a whole number"),
    (lambda: position_alphas(0.8, 3, decay=-0.1), "Decay δ must be in [0, 1]"),
    (lambda: tokens_per_pass([]), "At least one draft position"),
    (lambda: sequential_speedup([0.8], 1.5, 1.0), "Draft cost c must be in [0, 1]"),
    (lambda: sequential_speedup([0.8], 0.1, 0.0), "Verify cost ratio"),
    (lambda: BlockCost.constant(float("nan")), "Block pass cost c_block must be in"),
    (lambda: BlockCost.linear(0.1, "x"), "per position c1 must be a number"),
    (lambda: BlockCost.measured({}), "empty"),
    (lambda: BlockCost.measured({4: -1.0}), "B = 4 must be a ratio"),
    (lambda: BlockCost.constant(0.1)(1), "Block size B must be a whole number from 2"),
    (lambda: drafting_curves(0.8, 0.1, BlockCost.constant(0.1), slope=-1), "slope"),
    (lambda: drafting_curves(0.8, 0.1, BlockCost.constant(0.1), gamma_max=0), "γ must be a whole number"),
])
def test_bad_input_raises_a_clear_message(call, msg):
    with pytest.raises(InputError, match=None) as e:
        call()
    assert msg in str(e.value), str(e.value)


def test_the_loader_reads_the_fixture():
    res = load_block_results(FIXTURE)
    assert res.cpu == "Test CPU 9000" and res.compute == "onednn" and res.target_step_ms == 50.0
    assert res.block_pass == {4: 0.06, 8: 0.08, 16: 0.12}
    assert res.block_cost()(6) == pytest.approx(0.07)
    assert [r.kind for r in res.drafted()] == ["block", "head", "medusa"]
    assert res.drafted()[0].gamma == 7 and res.drafted()[0].speedup == 1.5
    assert res.label() == "measured on Test CPU 9000, onednn kernels"


def test_the_loader_without_a_file(tmp_path, monkeypatch):
    assert load_block_results(tmp_path / "block.json") is None
    monkeypatch.delenv("SPEEDUP_LAB_BLOCK_RESULTS", raising=False)
    monkeypatch.setattr(drafting, "BLOCK_RESULTS", tmp_path / "none.json")
    assert load_block_results() is None
    monkeypatch.setenv("SPEEDUP_LAB_BLOCK_RESULTS", str(FIXTURE))   # the browser tests' fixture
    assert load_block_results().cpu == "Test CPU 9000"


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d.pop("machine"), "lacks its \"machine\""),
    (lambda d: d["machine"].pop("cpu"), "machine lacks \"cpu\""),
    (lambda d: d.update(target_step_ms=0), "target_step_ms must be > 0"),
    (lambda d: d.update(block_pass={"4": 0.1}), "\"block_pass\" must be a list"),
    (lambda d: d["block_pass"][1].update(ratio=-2), "block_pass[1]: needs block ≥ 1"),
    (lambda d: d["rows"][2].update(gamma="3"), "rows[2]: \"gamma\" must be a number"),
    (lambda d: d["rows"][1].update(speedup=0), "rows[1] (block chain B=8)"),
    (lambda d: d.pop("rows"), "\"rows\" must be a list"),
])
def test_a_malformed_file_names_what_is_wrong(edit, msg):
    d = _fixture()
    edit(d)
    with pytest.raises(InputError) as e:
        parse_block_results(d, "block.json")
    assert msg in str(e.value) and "block.json" in str(e.value), str(e.value)


def test_a_file_that_is_not_json(tmp_path):
    p = tmp_path / "block.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="block.json could not be read as JSON"):
        load_block_results(p)
    p.write_text("[1, 2]")
    with pytest.raises(InputError, match="expected a JSON object"):
        load_block_results(p)


def test_any_sequence_of_alphas_works_once():
    # a generator is read once: the γ and E must come from the same positions
    assert sequential_speedup((a for a in [0.8, 0.8, 0.8]), 0.1, 1.0) == pytest.approx(2.952 / 1.3)
    assert block_speedup((a for a in [0.8] * 3), BlockCost.constant(0.1), 1.0) == pytest.approx(2.952 / 1.1)
    assert cut_oracle_speedup((a for a in [0.8] * 3), BlockCost.constant(0.1)) == pytest.approx(2.952 / 1.1)
