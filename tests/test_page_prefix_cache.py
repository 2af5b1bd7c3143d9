"""AppTest for pages/prefix_cache.py: drive the widgets and buttons, check the numbers against the engine,
and check that bad input shows st.error instead of raising."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.decoding.models import load_tokenizer
from engine.explain.prefix_cache import join_requests, preset_requests, simulate_texts
from tests.tables import find_table

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "prefix_cache.py")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


def _run(at: AppTest | None = None) -> AppTest:
    if at is None:
        at = AppTest.from_file(PAGE, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def _metric(at, label):
    return next(m.value for m in at.metric if m.label == label)


def test_default_view_matches_engine(tok):
    at = _run()
    assert not at.error
    # defaults: preset "system", block 16, capacity 64, 2 at once, 0.5 ms/token
    sim, _ = simulate_texts(join_requests(preset_requests("system")), tok, 16, 64, 2, 0.5)
    assert _metric(at, "Hit rate (requests shown)") == f"{sim.hit_rate:.1%}"
    assert _metric(at, "Prefill tokens skipped") == f"{sim.hit_tokens:,} of {sim.prompt_tokens:,}"
    assert _metric(at, "Estimated TTFT saved (sum)") == f"{sim.saved_ms:,.1f} ms"
    # saved = skipped tokens × 0.5 ms
    assert sim.saved_ms == pytest.approx(sim.hit_tokens * 0.5)
    df = find_table(at, "Hit tokens")
    assert list(df["Hit tokens"]) == [r.hit_tokens for r in sim.requests]
    assert df["Hit tokens"].iloc[0] == 0 and (df["Hit tokens"].iloc[1:] > 0).all()
    assert (df["Hit tokens"] < df["Prompt tokens"]).all()


def test_step_buttons(tok):
    at = _run()
    n = len(preset_requests("system"))
    assert at.slider(key="pc_step_slider").value == n
    at.button[0].click()            # ◀ Previous request
    at = _run(at)
    assert at.slider(key="pc_step_slider").value == n - 1
    assert len(find_table(at, "Hit tokens")) == n - 1
    at.slider(key="pc_step_slider").set_value(1)
    at = _run(at)
    assert _metric(at, "Hit rate (requests shown)") == "0.0%"   # the first request can only miss
    at.button[1].click()            # Next request ▶
    at = _run(at)
    assert at.slider(key="pc_step_slider").value == 2
    at.button[2].click()            # All
    at = _run(at)
    assert at.slider(key="pc_step_slider").value == n


def test_timestamp_start_vs_end(tok):
    at = _run()
    at.selectbox(key="pc_preset").set_value("timestamp")
    at = _run(at)
    assert _metric(at, "Hit rate (requests shown)") == "0.0%"     # 16-token blocks: nothing shared
    at.radio(key="pc_ts").set_value("end")
    at = _run(at)
    sim, _ = simulate_texts(join_requests(preset_requests("timestamp", timestamp_first=False)), tok,
                            16, 64, 2, 0.5)
    assert _metric(at, "Hit rate (requests shown)") == f"{sim.hit_rate:.1%}"
    assert sim.hit_rate > 0.5


def test_small_capacity_evicts_and_block_size_changes(tok):
    at = _run()
    at.slider(key="pc_capacity").set_value(14)
    at.slider(key="pc_conc").set_value(1)
    at.slider(key="pc_block").set_value(16)
    at.selectbox(key="pc_preset").set_value("timestamp")
    at = _run(at)
    sim, _ = simulate_texts(join_requests(preset_requests("timestamp")), tok, 16, 14, 1, 0.5)
    assert sim.evictions > 0
    assert _metric(at, "Blocks evicted") == str(sim.evictions)
    at.slider(key="pc_block").set_value(4)
    at.slider(key="pc_capacity").set_value(512)
    at = _run(at)
    sim4, _ = simulate_texts(join_requests(preset_requests("timestamp")), tok, 4, 512, 1, 0.5)
    assert _metric(at, "Prefill tokens skipped") == f"{sim4.hit_tokens:,} of {sim4.prompt_tokens:,}"


@pytest.mark.parametrize("text, capacity, msg", [
    ("hello there\n---\n\n---\nworld", 64, "Request 2 is empty"),
    ("   ", 64, "empty"),
    ("a fairly long request " * 20, 1, "needs"),
])
def test_bad_input_shows_error(text, capacity, msg):
    at = _run()
    at.text_area(key="pc_text").set_value(text)
    at.slider(key="pc_capacity").set_value(capacity)
    at = _run(at)
    assert at.error and msg in at.error[0].value
    assert not at.metric     # stopped before drawing results


def test_url_state_seeds_widgets():
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.query_params["pc_block"] = "999"       # clamped to 64
    at.query_params["pc_preset"] = "fewshot"
    at.query_params["pc_conc"] = "abc"        # unparsable → default 2
    at = _run(at)
    assert at.slider(key="pc_block").value == 64
    assert at.selectbox(key="pc_preset").value == "fewshot"
    assert at.slider(key="pc_conc").value == 2


@pytest.mark.slow
def test_measure_button_runs_real_model():
    at = AppTest.from_file(PAGE, default_timeout=300)
    at = _run(at)
    at.button(key="pc_measure_btn").click()
    at = _run(at)
    assert not at.error
    diff = float(_metric(at, "First-token logits, max |difference|"))
    assert diff < 1e-4
    assert _metric(at, "TTFT, full prefill (measured)").endswith(" ms")
    assert _metric(at, "TTFT, prefix reused (measured)").endswith(" ms")
    assert _metric(at, "Decode after prefix reuse").endswith(" ms/token")
    assert at.success and "same first token (yes)" in at.success[0].value
    # the measured cost can now drive the simulator
    at.checkbox(key="pc_use_measured").check()
    at = _run(at)
    assert at.number_input(key="pc_ms").disabled


def test_pair_out_of_order_is_flagged_and_not_measured():
    """A link with the 'earlier' request after the 'later' one (pc_a=5, pc_b=1) was described as a pair."""
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.query_params["pc_a"] = "5"
    at.query_params["pc_b"] = "1"
    _run(at)
    assert any("must come before the later one" in w.value for w in at.warning)
    assert at.button(key="pc_measure_btn").disabled
    assert not any("leading tokens" in m.value for m in at.markdown)  # no reuse claim for a wrong pair
    at.selectbox(key="pc_a").set_value(1).run()
    at.selectbox(key="pc_b").set_value(2).run()
    assert not any("must come before" in w.value for w in at.warning)
    assert not at.button(key="pc_measure_btn").disabled


def test_back_past_a_preset_change_shows_that_presets_requests(monkeypatch):
    """A user's report: Preset → few-shot, then Back. The box said "system prompt" but the requests stayed
    the few-shot ones, captioned "Edited requests", and the link then carried them as pc_text; a toast
    also named pc_step=5 → 4. On Back/Forward the link names the requests: its pc_text, or its preset's."""
    import app.state

    main = str(Path(PAGE).parent.parent / "app" / "main.py")
    at = AppTest.from_file(main, default_timeout=120)
    at.run()
    at.switch_page("../pages/prefix_cache.py").run()
    system_link = {k: at.query_params[k] for k in at.query_params}
    assert "pc_preset" in system_link and "pc_text" not in system_link
    at.selectbox(key="pc_preset").set_value("fewshot").run()
    assert at.session_state["pc_text"] == join_requests(preset_requests("fewshot"))
    monkeypatch.setattr(app.state, "_is_history_navigation", lambda: True)  # Back
    for k in list(at.query_params):
        del at.query_params[k]
    for k, v in system_link.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, at.exception
    assert at.session_state["pc_text"] == join_requests(preset_requests("system"))
    assert "pc_text" not in at.query_params and not at.toast
    assert not any("Edited requests" in c.value for c in at.caption)
    # a click on the page after that is no history step: an edit stays
    monkeypatch.setattr(app.state, "_is_history_navigation", lambda: False)
    at.text_area(key="pc_text").set_value("hello world one\n---\nhello world two").run()
    at.slider(key="pc_block").set_value(8).run()
    assert at.session_state["pc_text"] == "hello world one\n---\nhello world two"


def test_a_request_added_while_the_last_was_shown_is_shown_too():
    """A user's report: at "Show requests 1 to 5 (of 5)", a sixth request typed into the box was not
    drawn (the slider stayed at 5 of 6), as if the page ignored it. Stepped back, the view stays put."""
    main = str(Path(PAGE).parent.parent / "app" / "main.py")
    at = AppTest.from_file(main, default_timeout=120)
    at.run()
    at.switch_page("../pages/prefix_cache.py").run()
    n = at.session_state["pc_step"]
    at.text_area(key="pc_text").set_value(at.session_state["pc_text"] + "\n---\nA brand new request.").run()
    assert not at.exception, at.exception
    assert at.session_state["pc_step"] == n + 1
    at.button[0].click().run()  # ◀ Previous request: now at n of n + 1
    assert at.session_state["pc_step"] == n
    at.text_area(key="pc_text").set_value(at.session_state["pc_text"] + "\n---\nAnother one.").run()
    assert at.session_state["pc_step"] == n
