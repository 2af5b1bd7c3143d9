"""AppTest drives pages/flash_attention.py: sliders, step buttons, causal mask, presets, bad combinations."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.tables import find_table

TIMEOUT = 120
PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "flash_attention.py")  # "pages/flash_attention.py"


def _app(**query) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=TIMEOUT)
    for k, v in query.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _text(at: AppTest) -> str:
    return "\n".join(m.value for m in at.markdown)


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def test_default_renders_exact_result():
    at = _app()
    assert not _errors(at)
    # N = 10, Br = 4, Bc = 3: T_r = ⌈10/4⌉ = 3, T_c = ⌈10/3⌉ = 4, 12 tiles.
    assert "**3** query blocks" in _text(at) and "**4** key/value blocks" in _text(at)
    assert "**12** tiles" in _text(at)
    diff = float(at.metric[0].value)
    assert at.metric[0].label == "max |tiled − standard|" and diff < 1e-5
    assert at.success and "Exact up to fp32 rounding" in at.success[0].value


def test_step_buttons_and_slider():
    at = _app()
    assert at.slider(key="step").value == 1
    assert "Q block **i = 0**" in _text(at) and "K, V block **j = 0**" in _text(at)
    at.button(key="next").click().run()
    at.button(key="next").click().run()
    assert at.slider(key="step").value == 3
    # Default order is Algorithm 1 (K/V outside): step 3 is Q block 2 against K/V block 0.
    assert "Q block **i = 2**: query rows 8–9" in _text(at)
    at.slider(key="step").set_value(12).run()
    at.button(key="next").click().run()   # past the end: stays at 12
    assert at.slider(key="step").value == 12
    assert "Step 12 of 12" in _text(at)
    at.slider(key="step").set_value(1).run()
    at.button(key="prev").click().run()   # before the start: stays at 1
    assert at.slider(key="step").value == 1


def test_step_buttons_by_the_running_statistics_table():
    # a presenter scrolled to the m/ℓ table steps from there (the tile buttons are off screen)
    at = _app()
    assert at.button(key="prev_table").disabled and not at.button(key="next_table").disabled
    assert "Tile **1 of 12**: Q block i = 0, K/V block j = 0" in _text(at)
    at.button(key="next_table").click().run()
    at.button(key="next_table").click().run()
    assert at.slider(key="step").value == 3
    assert "Tile **3 of 12**: Q block i = 2, K/V block j = 0" in _text(at)
    at.button(key="prev_table").click().run()
    assert at.slider(key="step").value == 2
    at.slider(key="step").set_value(12).run()
    assert at.button(key="next_table").disabled


def test_q_outer_order():
    at = _app()
    at.radio(key="order").set_value("q_outer").run()
    at.button(key="next").click().run()
    # FlashAttention-2 order: step 2 keeps Q block 0 and brings K/V block 1 (rows 3–5).
    assert "Q block **i = 0**" in _text(at) and "K, V block **j = 1**: key/value rows 3–5" in _text(at)


def test_causal_skips_masked_tiles():
    at = _app()
    at.toggle(key="causal").set_value(True).run()
    assert not at.exception and not _errors(at)
    # Q rows {0–3}, {4–7}, {8–9}; K/V cols {0–2}, {3–5}, {6–8}, {9}. A tile is skipped when the Q block's
    # last row < first column: block 0 (last 3) skips cols 6, 9; block 1 (last 7) skips col 9 → 9 visited, 3 skipped.
    assert "**9** tiles to visit (3 skipped" in _text(at)
    assert float(at.metric[0].value) < 1e-5


def test_n_not_multiple_and_single_block():
    at = _app()
    at.slider(key="n").set_value(37).run()
    at.slider(key="br").set_value(5).run()
    at.slider(key="bc").set_value(7).run()
    assert not _errors(at) and float(at.metric[0].value) < 1e-5
    at.slider(key="n").set_value(8).run()
    at.slider(key="br").set_value(8).run()
    at.slider(key="bc").set_value(8).run()
    assert "**1** tiles" in _text(at) and float(at.metric[0].value) < 1e-5


def test_block_larger_than_n_is_a_clear_message():
    at = _app()
    at.slider(key="n").set_value(6).run()
    at.slider(key="bc").set_value(9).run()
    assert not at.exception
    assert _errors(at) == ["Bc (key/value block) = 9 is larger than the sequence length N = 6: a tile cannot hold "
                           "more rows than the sequence has. Choose a block ≤ 6 or a longer sequence."]


def test_too_many_tiles_is_a_clear_message():
    at = _app()
    at.slider(key="n").set_value(64).run()
    at.slider(key="br").set_value(1).run()
    at.slider(key="bc").set_value(1).run()
    assert not at.exception
    # 64 × 64 = 4096 tiles > 1024.
    assert len(_errors(at)) == 1 and "64 × 64 = 4096 tiles, too many" in _errors(at)[0]


@pytest.mark.parametrize("n,d,br,bc", list(itertools.product([1, 32, 64], [1, 16], [1, 32], [2, 32])))
def test_slider_extremes_never_crash(n, d, br, bc):
    at = _app(n=str(n), d=str(d), br=str(br), bc=str(bc))
    assert not at.exception
    errs = _errors(at)
    if br > n or bc > n or (-(-n // br)) * (-(-n // bc)) > 1024:
        assert len(errs) == 1
    else:
        assert not errs and float(at.metric[0].value) < 1e-5


def test_traffic_section_a100_then_h100():
    at = _app()
    txt = _text(at)
    # A100: 192 KiB / 2 B = 98,304 elements; d = 64: Bc = ⌈98304/256⌉ = 384, Br = min(384, 64) = 64.
    assert "98,304 elements" in txt and "Bc = ⌈M/4d⌉ = **384**" in txt and "= **64** (d = 64)" in txt
    paper = find_table(at, "FlashAttention")
    # Model: 4,456,448 · 2 B · 1024 heads = 9.13 GB; 800,768 · 2 · 1024 = 1.64 GB.
    assert list(paper["standard"]) == ["40.3 GB", "9.13 GB"]
    assert list(paper["FlashAttention"]) == ["4.4 GB", "1.64 GB"]
    at.selectbox(key="fa_gpu").set_value("NVIDIA H100 (SXM5)").run()
    assert at.number_input(key="sram").value == 256
    # 256 KiB / 2 = 131,072 elements: Bc = ⌈131072/256⌉ = 512.
    assert "131,072 elements" in _text(at) and "Bc = ⌈M/4d⌉ = **512**" in _text(at)


def test_traffic_per_tensor_table_at_largest_n():
    at = _app(nmax="1024")
    table = find_table(at, "standard reads")
    s_row = table[table["tensor"] == "S"].iloc[0]
    # Standard at N = 1024: S written once and read once, N² = 1,048,576 each.
    assert s_row["standard reads"] == "1,048,576" and s_row["standard writes"] == "1,048,576"
    assert s_row["flash reads"] == "0"
    k_row = table[table["tensor"] == "K"].iloc[0]
    assert k_row["flash reads"] == "65,536"  # K read once: N·d = 1024·64


def test_sram_too_small_is_a_clear_message():
    at = _app()
    at.selectbox(key="td").set_value(256).run()
    at.number_input(key="sram").set_value(1).run()
    assert not at.exception
    assert len(_errors(at)) == 1 and "does not fit" in _errors(at)[0]


def test_url_values_are_clamped():
    at = _app(n="999", br="abc", causal="1")
    assert at.slider(key="n").value == 64
    assert at.slider(key="br").value == 4   # unparsable → default
    assert at.toggle(key="causal").value is True


def test_measure_button_small():
    at = _app(mnmax="512", mheads="1")
    at.button(key="fa_measure").click().run()
    assert not at.exception and not _errors(at)
    table = at.dataframe[-1].value
    # N = 128, 256, 512, two methods each.
    assert list(table["N"]) == [128, 128, 256, 256, 512, 512]
    assert all(float(x) < 1e-5 for x in table["max |naive − fused|"])


def test_running_statistics_table_is_consistent():
    at = _app()
    table = find_table(at, "m before")
    # Step 1: rows 0–3 meet their first tile: nothing to rescale yet.
    assert list(table["row"]) == [0, 1, 2, 3]
    assert set(table["m before"]) == {"−∞"} and set(table["rescale e^(m before − m after)"]) == {"— (first tile)"}
    at.slider(key="step").set_value(4).run()   # Algorithm 1 order: step 4 = Q block 0 against K/V block 1
    table = find_table(at, "m before")
    assert list(table["row"]) == [0, 1, 2, 3]
    for _, r in table.iterrows():
        mb, mt, ma = float(r["m before"]), float(r["tile max m̃"]), float(r["m after"])
        lb, lt, la = float(r["ℓ before"]), float(r["tile sum ℓ̃"]), float(r["ℓ after"])
        assert ma == pytest.approx(max(mb, mt), abs=1e-4)                      # m_new = max(m, m̃)
        assert float(r["rescale e^(m before − m after)"]) == pytest.approx(math.exp(mb - ma), abs=1e-4)
        # ℓ_new = e^(m − m_new) ℓ + e^(m̃ − m_new) ℓ̃ (values shown to 4 decimals)
        assert la == pytest.approx(math.exp(mb - ma) * lb + math.exp(mt - ma) * lt, abs=2e-3)
