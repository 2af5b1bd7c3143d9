"""This machine's pass-cost curve (engine/decoding/pass_cost.py): measurement, cache, fallback, ratios."""

from __future__ import annotations

import pytest

from engine.decoding import pass_cost
from engine.decoding.pass_cost import PassCost, cached_pass_cost, machine_pass_cost, measure_pass_cost
from tests.tiny_models import save_tiny_llama


def _curve(ms):
    return PassCost(ms=ms, cpu="x", compute="onednn", threads=2, date="d")


def test_ratio_interpolates_and_extends_linearly_by_hand():
    c = _curve({1: 10.0, 2: 12.0, 4: 16.0, 8: 20.0})
    assert c.ratio(1) == 1.0 and c.ratio(2) == pytest.approx(1.2)
    assert c.ratio(3) == pytest.approx(1.4)          # halfway 12 → 16
    assert c.ratio(6) == pytest.approx(1.8)          # 16 + 4·2/4 = 18
    assert c.ratio(10) == pytest.approx(2.2)         # past 8: slope of 4 → 8 (1 ms a token): 22
    assert c.ratios(3) == pytest.approx([1.0, 1.2, 1.4])
    with pytest.raises(ValueError):
        c.ratio(0)
    assert PassCost.from_dict(c.to_dict()) == c


def test_shipped_fallback_is_labelled_with_its_machine():
    s = pass_cost.shipped_pass_cost()
    assert not s.measured_here and 1 in s.ms and "another machine" in s.source and "verify_cost_amd-epyc.json" in s.source


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDUP_LAB_CACHE", str(tmp_path / "cache"))
    from engine.decoding.models import load_model

    return load_model(str(save_tiny_llama(tmp_path / "tiny")), device="cpu")


def test_measure_times_every_size_and_cache_restores_it(tiny):
    c = measure_pass_cost(tiny, sizes=(1, 2, 4), reps=2, context=8)
    assert set(c.ms) == {1, 2, 4} and all(v > 0 for v in c.ms.values()) and c.reps == 2 and c.measured_here
    assert c.compute == tiny.compute.path and "measured on this machine" in c.source
    # the reps' spread is kept (the γ choice's tolerance reads it): two fastest reps per size, ≥ 0
    assert set(c.extra["spread"]) == {"1", "2", "4"} and all(v >= 0 for v in c.extra["spread"].values())
    sp = c.extra["spread"]
    assert c.ratio_noise() == pytest.approx((sp["2"] + sp["1"] + sp["4"] + sp["1"]) / 2)  # median of two: their mean
    assert PassCost.from_dict(c.to_dict()).ratio_noise() == c.ratio_noise()
    assert cached_pass_cost(tiny.spec) is None
    calls = []
    real = pass_cost.measure_pass_cost
    pass_cost.measure_pass_cost = lambda t, progress=None: calls.append(1) or real(t, sizes=(1, 3), reps=1, context=4)
    try:
        first = machine_pass_cost(tiny)
        again = machine_pass_cost(tiny)
    finally:
        pass_cost.measure_pass_cost = real
    assert calls == [1] and again == first and set(first.ms) == {1, 3}
    assert cached_pass_cost(tiny.spec) == first
    # another compute path than the one measured: not this curve
    other = "default" if first.compute == "onednn" else "onednn"
    assert cached_pass_cost(tiny.spec, compute=other) is None
    assert pass_cost.current_pass_cost(tiny.spec) == first
    assert not pass_cost.current_pass_cost("never-measured").measured_here


def test_a_changed_kernel_is_measured_again(tiny, monkeypatch):
    """The curve is keyed by the streaming kernel's build: after the kernel's source changes, the curve measured
    with the old kernel is not this machine's curve any more."""
    got = measure_pass_cost(tiny, sizes=(1, 2), reps=1, context=4)
    monkeypatch.setattr(pass_cost, "measure_pass_cost", lambda t, progress=None: got)
    assert machine_pass_cost(tiny) == got and cached_pass_cost(tiny.spec) == got
    monkeypatch.setattr(pass_cost, "measure_key", lambda: "speedup_lab_small_linear_changed|packed>=17")
    assert cached_pass_cost(tiny.spec) is None


def test_the_curve_is_keyed_by_how_big_products_run(tiny, monkeypatch):
    """oneDNN's products of ≥ ``PACK_MIN_ROWS`` rows read packed weights: a curve measured under another limit (or
    before the packing) is not this machine's curve."""
    from engine.decoding import compute

    got = measure_pass_cost(tiny, sizes=(1, 2), reps=1, context=4)
    monkeypatch.setattr(pass_cost, "measure_pass_cost", lambda t, progress=None: got)
    assert machine_pass_cost(tiny) == got and cached_pass_cost(tiny.spec) == got
    monkeypatch.setattr(compute.onednn, "PACK_MIN_ROWS", compute.onednn.PACK_MIN_ROWS + 1)
    assert cached_pass_cost(tiny.spec) is None


def test_a_curve_measured_under_another_stream_row_limit_is_measured_again(tiny, monkeypatch):
    """On the "stream" path the curve remembers the kernel's row limit it ran under: after the machine's limit is
    measured anew (``compute.measure_stream_rows``), passes of more rows than the old limit cost something else."""
    import dataclasses

    target = dataclasses.replace(tiny, compute=dataclasses.replace(tiny.compute, path="stream", stream_rows=16))
    calls = []
    monkeypatch.setattr(pass_cost, "measure_pass_cost", lambda t, progress=None: calls.append(1) or PassCost(
        ms={1: 10.0, 2: 11.0}, cpu="x", compute="stream", threads=2, date="d",
        extra={"stream_rows": t.compute.stream_rows, "read_bytes": pass_cost._read_bytes(t)}))
    first = machine_pass_cost(target)
    assert first.extra["stream_rows"] == 16 and machine_pass_cost(target) == first and calls == [1]
    target12 = dataclasses.replace(target, compute=dataclasses.replace(target.compute, stream_rows=12))
    assert machine_pass_cost(target12).extra["stream_rows"] == 12 and calls == [1, 1]


def test_a_curve_timed_on_other_weight_bytes_is_measured_again(tiny, monkeypatch):
    """The curve remembers the weight bytes a pass read (``compute.weight_formats``): one timed while some matrices
    were still read as fp32 (311 MB a token instead of 111 as GGUF blocks) is not the curve of this process's passes,
    and a stored one without the figure is measured again too."""
    import dataclasses

    def with_bytes(n):
        return dataclasses.replace(tiny, compute=dataclasses.replace(
            tiny.compute, path="stream", stream_rows=16, formats={"count": {"q41": 1}, "read_bytes": n,
                                                                   "fp32_bytes": 4 * n}))

    calls = []
    monkeypatch.setattr(pass_cost, "measure_pass_cost", lambda t, progress=None: calls.append(1) or PassCost(
        ms={1: 10.0, 2: 11.0}, cpu="x", compute="stream", threads=2, date="d",
        extra={"stream_rows": 16, "read_bytes": pass_cost._read_bytes(t)}))
    fast = with_bytes(111_000_000)
    assert machine_pass_cost(fast).extra["read_bytes"] == 111_000_000 and calls == [1]
    assert machine_pass_cost(fast).extra["read_bytes"] == 111_000_000 and calls == [1]  # stored, current
    assert machine_pass_cost(with_bytes(311_000_000)).extra["read_bytes"] == 311_000_000 and calls == [1, 1]
    assert pass_cost.refresh_stale_pass_cost(fast).extra["read_bytes"] == 111_000_000 and calls == [1, 1, 1]


def test_a_stored_curve_under_another_row_limit_is_not_this_process_curve(tiny, monkeypatch):
    """Without a model at hand (the head's default γ, the Medusa tree, What-if), a "stream" curve stored under
    another row limit than the one this process's passes run with is not returned; under the same limit, or before
    any "stream" choice is applied in the process, it is; curves of other paths are not affected."""
    from engine.decoding import compute

    stored = PassCost(ms={1: 10.0, 9: 22.5}, cpu="x", compute="stream", threads=2, date="d", extra={"stream_rows": 8})
    monkeypatch.setattr(pass_cost, "_read", lambda: {pass_cost._key("embedded"): stored.to_dict()})
    monkeypatch.setitem(compute.products._ACTIVE, "path", "stream")
    monkeypatch.setitem(compute.extension._STREAM, "applied_rows", 24)
    assert compute.active_stream_rows() == 24
    assert cached_pass_cost("embedded") is None and cached_pass_cost("embedded", compute="stream") is None
    assert not pass_cost.current_pass_cost("embedded").measured_here  # the shipped fallback, labelled
    monkeypatch.setitem(compute.extension._STREAM, "applied_rows", 8)
    assert cached_pass_cost("embedded") == stored
    # no "stream" choice applied yet in this process
    monkeypatch.setitem(compute.extension._STREAM, "applied_rows", None)
    assert cached_pass_cost("embedded") == stored
    monkeypatch.setitem(compute.extension._STREAM, "applied_rows", 24)
    monkeypatch.setitem(compute.products._ACTIVE, "path", "onednn")  # another path active: no row limit applies
    assert compute.active_stream_rows() is None and cached_pass_cost("embedded") == stored
    other = PassCost(ms={1: 10.0, 2: 11.0}, cpu="x", compute="onednn", threads=2, date="d")
    monkeypatch.setattr(pass_cost, "_read", lambda: {pass_cost._key("embedded"): other.to_dict()})
    monkeypatch.setitem(compute.products._ACTIVE, "path", "stream")
    assert cached_pass_cost("embedded") == other


def test_a_stale_curve_is_measured_again_when_the_model_loads(tiny, monkeypatch):
    """``refresh_stale_pass_cost`` (run by the app when it loads a model) measures again only a stored curve of the
    same path under another row limit; no stored curve, or a current one, measures nothing."""
    import dataclasses

    target = dataclasses.replace(tiny, compute=dataclasses.replace(tiny.compute, path="stream", stream_rows=24))
    calls = []
    monkeypatch.setattr(pass_cost, "measure_pass_cost", lambda t, progress=None: calls.append(1) or PassCost(
        ms={1: 10.0, 2: 11.0}, cpu="x", compute="stream", threads=2, date="d",
        extra={"stream_rows": t.compute.stream_rows, "read_bytes": pass_cost._read_bytes(t)}))
    assert pass_cost.refresh_stale_pass_cost(target) is None and calls == []      # none stored: prepare's job
    target8 = dataclasses.replace(target, compute=dataclasses.replace(target.compute, stream_rows=8))
    machine_pass_cost(target8)
    assert calls == [1]
    assert pass_cost.refresh_stale_pass_cost(target8) is None and calls == [1]    # current
    got = pass_cost.refresh_stale_pass_cost(target)                               # stored under 8 rows, runs 24
    assert calls == [1, 1] and got.extra["stream_rows"] == 24
    assert pass_cost.refresh_stale_pass_cost(target) is None and calls == [1, 1]
    onednn = dataclasses.replace(target, compute=dataclasses.replace(target.compute, path="onednn"))
    assert pass_cost.refresh_stale_pass_cost(onednn) is None and calls == [1, 1]  # another path: not its curve


def test_measure_needs_one_token_and_a_rep(tiny):
    with pytest.raises(ValueError):
        measure_pass_cost(tiny, sizes=(2, 3))
    with pytest.raises(ValueError):
        measure_pass_cost(tiny, reps=0)


def test_stop_keeps_the_reps_done(tiny):
    c = measure_pass_cost(tiny, sizes=(1, 2), reps=5, context=4, should_stop=lambda: True)
    assert c.reps == 1


def test_default_gamma_here_uses_this_machines_curve_by_hand(monkeypatch):
    from engine.explain import analytic

    # the head's α by depth (HEAD_RANK_COUNTS): 469/732, 419/732, 393/732, 365/732, the last beyond; c = 0.1.
    # E(1) = 1.6407, E(2) = 2.0074, E(3) = 2.2043, E(4) = 2.3025, E(5) = 2.3515
    flat_then_steep = _curve({1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 5: 20.0, 6: 30.0, 9: 60.0})
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda spec="embedded", *a, **k: flat_then_steep)
    # γ=1 1.6407/1.1 = 1.492; γ=2 2.0074/1.2 = 1.673; γ=3 2.2043/1.3 = 1.696 (best); γ=4 2.3025/2.4 = 0.959
    # within the 3 % floor (0.97 · 1.696 = 1.645) the SHORTER draft: γ=2 1.673
    g, why = analytic.default_gamma_here("embedded-head")
    assert g == 2 and "this machine's" in why and "γ = 2 expects 1.67×" in why
    assert "γ = 3 expects 1.70×, within 3%" in why and "the shorter draft" in why
    # the best alone within its floor: t(3) = 1.5 t(1) puts γ=2 at 2.0074/1.6 = 1.255, γ=1 at 1.492 (best), γ=3 at
    # 2.2043/1.6 = 1.378
    steep = _curve({1: 10.0, 2: 10.0, 3: 15.0, 4: 15.0, 5: 20.0, 6: 30.0, 9: 60.0})
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda spec="embedded", *a, **k: steep)
    g, why = analytic.default_gamma_here("embedded-head")
    assert g == 1 and "γ = 1 expects 1.49×" in why and "within" not in why
    # one noisy point no longer decides alone: t(2) = 0.89 t(1) (a curve measured at setup): γ=1 1.657, γ=2 1.659
    # (best), γ=3 2.2043/1.33 = 1.657: γ=1 is within 3 %
    noisy_point = _curve({1: 10.0, 2: 8.9, 3: 10.1, 4: 10.3, 5: 10.6, 6: 11.0, 9: 13.0})
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda spec="embedded", *a, **k: noisy_point)
    assert analytic.default_gamma_here("embedded-head")[0] == 1
    # a curve whose reps spread 7 % at every size: tolerance 5 % (the cap, not 7 %); flat curve: γ=1 1.6407/1.1 =
    # 1.492 < 0.95 · 1.696 = 1.611, γ=2 2.0074/1.2 = 1.673 is within
    flat_noisy = _curve({1: 10.0, 9: 10.0})
    flat_noisy.extra = {"spread": {"1": 0.07, "9": 0.07}}
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda spec="embedded", *a, **k: flat_noisy)
    g, why = analytic.default_gamma_here("embedded-head")
    assert g == 2 and "within 5%" in why
    assert analytic.default_gamma_here("ngram") == (4, "the draft's static default")
    assert analytic.default_gamma_here("embedded-head", "some/other-model")[0] == 2
    assert analytic.default_gamma_here("embedded-medusa")[0] == 4  # the shipped heads' K: the tree's whole depth
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda *a, **k: None)
    assert analytic.default_gamma_here("embedded-head") == (2, "the shipped default (this machine's pass cost is "
                                                               "not measured yet)")


def test_choose_within_noise_takes_the_shortest_close_to_the_best_by_hand():
    from engine.errors import InputError
    from engine.explain.analytic import choose_within_noise

    assert choose_within_noise([1.0, 1.49, 1.5, 1.2], 0.02) == (1, 2)   # 1.49 ≥ 0.98 · 1.5 = 1.47
    assert choose_within_noise([1.0, 1.46, 1.5, 1.2], 0.02) == (2, 2)   # 1.46 < 1.47
    assert choose_within_noise([1.0, 1.49, 1.5, 1.2], 0.0) == (2, 2)
    assert choose_within_noise([1.48, 1.2, 1.5, 1.0], 0.02) == (0, 2)   # before a dip, still within
    assert choose_within_noise([1.0, 1.5, 1.49, 1.2], 0.02) == (1, 1)   # the best is the shortest within
    assert choose_within_noise([1.5, 1.5], 0.0) == (0, 0)               # a tie: the shorter, the first
    assert choose_within_noise([2.0], 0.5) == (0, 0)
    for bad, tol in (([], 0.1), ([1.0, float("nan")], 0.1), ([1.0], 1.0), ([1.0], -0.1)):
        with pytest.raises(InputError):
            choose_within_noise(bad, tol)


def test_ratio_noise_and_gamma_tolerance_by_hand():
    from engine.explain.analytic import GAMMA_NOISE_MAX, GAMMA_NOISE_TOL, gamma_tolerance

    c = _curve({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0})
    assert c.ratio_noise() is None and gamma_tolerance(c) == GAMMA_NOISE_TOL == 0.03
    c.extra = {"spread": {"1": 0.01, "2": 0.02, "3": 0.05, "4": 0.03}}
    assert c.ratio_noise() == pytest.approx(0.04)  # median of 0.03, 0.06, 0.04
    assert gamma_tolerance(c) == pytest.approx(0.04)
    c.extra = {"spread": {"1": 0.01, "2": 0.02, "3": 0.05}}
    assert c.ratio_noise() == pytest.approx(0.045)  # an even count: the mean of the middle two
    c.extra = {"spread": {"1": 0.3, "2": 0.4}}
    assert gamma_tolerance(c) == GAMMA_NOISE_MAX == 0.05
    c.extra = {"spread": {"2": 0.4}}  # no n = 1: nothing to read
    assert c.ratio_noise() is None


@pytest.mark.slow
def test_shipped_medusa_tree_follows_this_machines_curve(embedded, monkeypatch):
    from engine.decoding.drafts import make_proposer

    flat = _curve({n: 10.0 for n in pass_cost.SIZES})
    steep = _curve({n: 10.0 * n for n in pass_cost.SIZES})
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda *a, **k: flat)
    assert make_proposer("embedded-medusa", embedded).tree_size == 15  # a flat pass: the largest tree
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda *a, **k: steep)
    assert make_proposer("embedded-medusa", embedded).tree_size == 0  # each token costs a step: no tree
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda *a, **k: None)
    shipped = make_proposer("embedded-medusa", embedded)
    assert shipped.choices == shipped.heads.config["medusa_choices"]


def test_non_decreasing_bounds_each_size_by_the_larger_ones_by_hand():
    # a curve measured on a busy AMD EPYC: t(4) above t(5), t(1) above t(2)
    got = pass_cost.non_decreasing({1: 10.9, 2: 10.5, 3: 11.8, 4: 16.8, 5: 13.6})
    assert got == {1: 10.5, 2: 10.5, 3: 11.8, 4: 13.6, 5: 13.6}
    assert pass_cost.non_decreasing({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0}


def test_measured_curve_never_falls_and_keeps_its_fastest_reps(tiny):
    c = measure_pass_cost(tiny, sizes=(1, 2, 3, 4), reps=2, context=8)
    ms = [c.ms[n] for n in sorted(c.ms)]
    assert all(a <= b for a, b in zip(ms, ms[1:]))
    assert {int(k): v for k, v in c.extra["fastest"].items()}.keys() == c.ms.keys()
    assert all(c.ms[n] <= c.extra["fastest"][str(n)] for n in c.ms)


def test_measure_draft_rounds_times_each_gamma_and_plain_steps(tiny):
    from engine.decoding.proposers import PromptLookupProposer

    got = pass_cost.measure_draft_rounds(tiny, PromptLookupProposer(32), gammas=(2, 1), rounds=3, reps=2,
                                         prompt_ids=[5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    assert got["draft"] and got["rounds"] == 3 and got["reps"] == 2
    assert got["plain_ms"] > 0 and set(got["round_ms"]) == {"1", "2"} and all(v > 0 for v in got["round_ms"].values())
    with pytest.raises(ValueError):
        pass_cost.measure_draft_rounds(tiny, PromptLookupProposer(32), gammas=(0,))


def test_default_gamma_here_reads_the_heads_timed_rounds_by_hand(monkeypatch):
    from engine.explain import analytic

    # rounds timed on the AMD EPYC (weights as GGUF blocks): a plain step 8.67 ms; γ = 1..4 rounds 10.60, 13.07,
    # 14.96, 17.34 ms. E(1..4) = 1.6407, 2.0074, 2.2043, 2.3025 (HEAD_RANK_COUNTS), so γ=1 1.6407 / (10.60 / 8.67) =
    # 1.342 (best: chosen), γ=2 2.0074 / 1.5075 = 1.332 (within 3 %), γ=3 2.2043 / 1.7255 = 1.278, γ=4 1.151; γ ≥ 5
    # untimed: γ·c + t(γ+1)/t(1) on the curve (t(6) = 1.5, t(7..9) = 1.8 t(1)): γ=5 2.3515 / 2.0 = 1.18
    curve = _curve({1: 10.0, 2: 10.0, 3: 11.0, 4: 12.0, 5: 13.0, 6: 15.0, 9: 18.0})
    curve.extra = {"head_rounds": {"plain_ms": 8.67, "round_ms": {"1": 10.60, "2": 13.07, "3": 14.96, "4": 17.34}}}
    monkeypatch.setattr(pass_cost, "cached_pass_cost", lambda spec="embedded", *a, **k: curve)
    s = analytic.head_speedups(curve.ms, rounds=curve.extra["head_rounds"])
    assert s[:4] == pytest.approx([1.3420, 1.3316, 1.2775, 1.1512], abs=2e-4)
    g, why = analytic.default_gamma_here("embedded-head")
    assert g == 1 and "timed on this machine" in why and "a round 10.6 ms, a plain step 8.7 ms" in why
    assert "γ = 1 expects 1.34×" in why and "within" not in why
    # a slower γ = 1 round (11.0 ms: 1.6407 / 1.2687 = 1.293) puts γ = 2 first and γ = 1 within 3 % of it: γ = 1
    curve.extra["head_rounds"]["round_ms"]["1"] = 11.0
    g, why = analytic.default_gamma_here("embedded-head")
    assert g == 1 and "γ = 2 expects 1.33×, within 3%" in why
    # without timed rounds: the card's c on the pass curve, as before
    curve.extra = {}
    assert "c = 0.1" in analytic.default_gamma_here("embedded-head")[1]
