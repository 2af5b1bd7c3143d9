"""AppTest: the guided tour (start, advance, back, leave), presenter mode, check-yourself questions
(a right and a wrong answer each), and the trade-offs / mistakes / in-the-wild / recap pages."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.explain.teaching import tour_stops

ROOT = Path(__file__).resolve().parent.parent
MAIN = str(ROOT / "app" / "main.py")


def _main(**qp) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    for k, v in qp.items():
        at.query_params[k] = v
    return at.run()


def _banner(at) -> str:
    return " ".join(m.value for m in at.markdown if m.value.startswith("**Guided tour"))


def test_tour_advance_back_and_leave():
    at = _main(tour="1")  # stop 2 (what-if) from the URL
    assert not at.exception
    assert "stop 2 of 6" in _banner(at)
    at.button(key="tour_next").click().run()
    assert not at.exception
    assert "stop 3 of 6" in _banner(at)
    assert at.title[0].value.startswith("📈 What-if")
    # the stop set the page's widgets
    assert at.session_state["wi_tab"] == "When it does not help"
    assert at.session_state["wi_alpha"] == 0.8 and at.session_state["wi_params_b"] == 7.0
    assert at.query_params["tour"] == ["2"] or at.query_params["tour"] == "2"
    at.button(key="tour_prev").click().run()
    assert "stop 2 of 6" in _banner(at)
    assert at.session_state["wi_gamma"] == 8 and at.session_state["wi_cost"] == 0.3
    at.button(key="tour_next").click().run()
    at.button(key="tour_next").click().run()  # → prefix caching with the timestamp first
    assert not at.exception
    assert at.title[0].value.startswith("🧱 Prefix caching")
    assert at.session_state["pc_preset"] == "timestamp" and at.session_state["pc_ts"] == "start"
    at.button(key="tour_leave").click().run()
    assert _banner(at) == ""
    assert "tour" not in at.query_params
    assert at.title[0].value.startswith("🧱 Prefix caching")  # leaving keeps you where you are


def test_tour_last_stop_and_finish():
    at = _main(tour=str(len(tour_stops()) - 1))
    assert "stop 6 of 6" in _banner(at)
    assert at.button(key="tour_next").label == "Finish"
    assert at.button(key="tour_prev").disabled is False
    at.button(key="tour_next").click().run()
    assert not at.exception
    assert _banner(at) == ""
    assert at.title[0].value.startswith("✅ Recap")


@pytest.mark.slow
def test_tour_starts_from_home_on_the_live_page():
    at = _main()
    assert _banner(at) == ""
    at.button(key="tour_start").click().run(timeout=300)
    assert not at.exception
    assert "stop 1 of 6" in _banner(at)
    assert at.session_state["lv_draft"] == "ngram" and at.session_state["lv_preset"] == "code"
    assert at.button(key="tour_prev").disabled


def test_presenter_mode_from_url_and_toggle():
    at = _main(present="1")
    assert not at.exception
    styles = [h.proto.body for h in at.get("html")]
    assert any("--sl-text: 1.3rem" in s for s in styles)
    assert at.session_state["present"] is True
    assert at.button(key="present_toggle").label == "Leave presenter mode"
    at.button(key="present_toggle").click().run()
    assert at.session_state["present"] is False
    assert not any("--sl-text: 1.3rem" in h.proto.body for h in at.get("html"))
    assert at.query_params.get("present") in (None, [])
    assert at.button(key="present_toggle").label == "Switch to presenter mode"


def test_presenter_mode_with_tour_on_a_page():
    # the documented presenter URL: a page, its state, a tour stop, large fonts
    at = _main(present="1", tour="4")
    assert "stop 5 of 6" in _banner(at)
    assert any("--sl-text: 1.3rem" in h.proto.body for h in at.get("html"))


def _answer(at, page_key: str, qkey: str, right: bool):
    radio = next(r for r in at.radio if r.key and r.key.startswith(f"cy_{page_key}_{qkey}_"))
    return radio


def _check(at, page_key, qkey, questions, right: bool):
    q = next(q for q in questions if q.key == qkey)
    radio = next(r for r in at.radio if r.key and r.key.startswith(f"cy_{page_key}_{qkey}_"))
    pick = q.options[q.correct] if right else q.options[(q.correct + 1) % len(q.options)]
    radio.set_value(pick).run()
    at.button(key=radio.key + "_check").click().run()
    assert not at.exception
    return q


@pytest.mark.parametrize("right", [True, False])
def test_whatif_questions_right_and_wrong(right):
    from engine.explain.teaching import whatif_questions

    at = AppTest.from_file(str(ROOT / "pages" / "whatif.py"), default_timeout=60)
    at.query_params.update({"wi_alpha": "0.6", "wi_gamma": "4", "wi_cost": "0.3"})
    at.run()
    qs = whatif_questions(0.6, 4, 0.3)
    for q in qs:
        _check(at, "whatif", q.key, qs, right)
    if right:
        assert len(at.success) >= len(qs) and all(s.value.startswith("Right.") for s in at.success[-len(qs):])
        assert any("1.05×" in s.value for s in at.success)  # the engine's speedup in the explanation
    else:
        errs = [e.value for e in at.error if e.value.startswith("Not quite")]
        assert len(errs) == len(qs)
        assert "Yes, it is faster" in errs[0]  # names the right answer


@pytest.mark.parametrize("right", [True, False])
def test_flash_and_kv_questions_right_and_wrong(right):
    from engine.explain.kv_size import model_preset
    from engine.explain.teaching import flash_questions, kv_questions

    at = AppTest.from_file(str(ROOT / "pages" / "flash_attention.py"), default_timeout=60).run()
    qs = flash_questions(64, at.session_state["sram"], 2, 16384, seed=0)
    q = _check(at, "flash", "extra_memory", qs, right)
    shown = [s.value for s in (at.success if right else at.error)]
    assert any("4×" in v for v in shown) and len(shown) >= 1

    at = AppTest.from_file(str(ROOT / "pages" / "kv_cache.py"), default_timeout=60)
    at.query_params.update({"preset": "Llama-3.1-8B", "context": "8192", "batch": "1"})
    at.run()
    qs = kv_questions(model_preset("Llama-3.1-8B"), 8192, 1)
    _check(at, "kv", "mqa", qs, right)
    box = at.success if right else at.error
    assert any("8×" in v.value for v in box)


def test_question_resets_when_settings_change():
    at = AppTest.from_file(str(ROOT / "pages" / "whatif.py"), default_timeout=60).run()
    before = {r.key for r in at.radio if r.key and r.key.startswith("cy_")}
    at.slider(key="wi_alpha").set_value(0.3).run()
    after = {r.key for r in at.radio if r.key and r.key.startswith("cy_")}
    assert before != after  # new question text → new, unanswered widgets


def test_teaching_pages_render():
    at = _main()
    for path, title, tables in (("pages/trade_offs.py", "⚖️ Trade-offs", 1), ("pages/in_the_wild.py", "🌍 In the wild", 1),
                                ("pages/mistakes.py", "🚧 Common mistakes, live", 1), ("pages/recap.py", "✅ Recap", 0)):
        at.switch_page(str(ROOT / path)).run()
        assert not at.exception, path
        assert at.title[0].value == title
        assert len(at.dataframe) == tables


def test_tokenizer_mistake_is_shown_as_the_expected_refusal():
    """The engine refusing a draft with another tokenizer is the point of mistake 2: an info box, not a red
    error that reads as the app failing on a projector."""
    at = _main()
    at.switch_page(str(ROOT / "pages" / "mistakes.py")).run()
    assert any("As it should, the engine refuses the pair" in i.value for i in at.info)
    assert not at.error


def test_mistake_button_reproduces_the_timestamp_mistake():
    at = _main()
    at.switch_page(str(ROOT / "pages" / "mistakes.py")).run()
    assert any(m.label == "Hit rate, timestamp first" and m.value == "0%" for m in at.metric)
    at.button(key="mk_ts").click().run()
    assert not at.exception
    assert at.title[0].value.startswith("🧱 Prefix caching")
    assert at.session_state["pc_preset"] == "timestamp" and at.session_state["pc_ts"] == "start"


def test_presenter_mode_folds_the_intro_and_enlarges_chart_text():
    # the page's opening paragraph folds into "About this page" and its charts get projector-sized
    # text (every element an explicit size: Streamlit's theme ignores layout.font.size)
    at = _main(present="1", tour="1")
    at.switch_page("../pages/whatif.py").run()  # the stop's page: what-if, analytic tab
    assert not at.exception
    about = [e for e in at.expander if e.label == "About this page"]
    assert len(about) == 1 and "acceptance rate α" in about[0].markdown[0].value
    at.button(key="tour_next").click().run()  # stop 3: the batch tab's paragraph folds too
    tab = [e for e in at.expander if e.label == "About this tab"]
    assert len(tab) == 1 and "spare compute" in tab[0].markdown[0].value
    at.button(key="tour_prev").click().run()
    import json

    from app.tour import PRESENTER_CHART_FONT
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert spec["layout"]["xaxis"]["tickfont"]["size"] == PRESENTER_CHART_FONT
    assert spec["layout"]["legend"]["font"]["size"] == PRESENTER_CHART_FONT
    # without presenter mode: the paragraph is on the page and the chart is drawn as built
    at = _main(tour="1")
    at.switch_page("../pages/whatif.py").run()
    assert not [e for e in at.expander if e.label == "About this page"]
    assert any("acceptance rate α" in m.value for m in at.markdown)
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert "tickfont" not in spec["layout"].get("xaxis", {})


def test_hand_made_tour_link_opens_the_stop_with_its_settings():
    # /?tour=2: stop 3's text must not sit over the home page; it opens the stop's page and settings
    at = _main(tour="2")
    assert not at.exception
    assert "stop 3 of 6" in _banner(at)
    assert at.title[0].value.startswith("📈 What-if")
    assert at.session_state["wi_alpha"] == 0.8 and at.session_state["wi_tab"] == "When it does not help"


def test_copied_tour_link_keeps_its_own_settings():
    # a link copied at stop 2 after moving α keeps α (the page and a stop setting are in it)
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.query_params["tour"] = "1"
    at.query_params["wi_alpha"] = "0.7"
    at.switch_page("../pages/whatif.py").run()
    assert not at.exception
    assert "stop 2 of 6" in _banner(at)
    assert at.session_state["wi_alpha"] == 0.7


def test_tour_script_is_fixed_text_with_the_stop_number():
    at = _main(tour="3")
    scripts = [h.proto.body for h in at.get("html") if "__speedupLabTourStop" in h.proto.body]
    assert len(scripts) == 1 and "__speedupLabTourStop !== 3" in scripts[0]


def _toasts(at) -> str:
    return " ".join(t.value for t in at.toast)


def test_out_of_range_tour_stop_in_a_link_is_named():
    # /?tour=99: the last stop opens (on its own page) and the toast says so, once
    last = len(tour_stops()) - 1
    at = _main(tour="99")
    assert not at.exception
    assert f"stop {last + 1} of {last + 1}" in _banner(at)
    assert f"tour=99 → {last} (stop {last + 1} of {last + 1})" in _toasts(at)  # the banner's numbering too
    at.run()
    assert "tour=99" not in _toasts(at)
    at = _main(tour="abc")
    assert _banner(at) == "" and "tour=abc → off" in _toasts(at)
    assert "tour" not in at.query_params
    at = _main(tour="2")  # a valid stop: nothing to say
    assert not at.toast


def test_unreadable_presenter_flag_in_a_link_is_named_and_dropped():
    at = _main(present="maybe")
    assert not at.exception
    assert "present=maybe → 0" in _toasts(at)
    assert "present" not in at.query_params
    at = _main(present="1")
    assert not at.toast and at.query_params["present"] in ("1", ["1"])


def _query(at) -> dict:
    return {k: at.query_params[k] for k in at.query_params}


def _set_query(at, query: dict) -> None:
    for k in list(at.query_params):
        del at.query_params[k]
    for k, v in query.items():
        at.query_params[k] = v


def test_a_stop_opens_with_one_history_entry_and_back_passes_the_switch_entry(monkeypatch):
    """A user's report: each tour stop added three browser-history entries, and Back in between showed
    "stop 4: Prefix caching" over the What-if page. The page a stop opens keeps the stop's link as its
    URL (no second entry), and a history entry left by the switch (the page left, under the next stop's
    link) is passed through in the reader's direction."""
    import app.state

    at = _main(tour="2")                       # stop 3, on the What-if page
    stop4 = tour_stops()[3].link
    at.button(key="tour_next").click().run()   # → stop 4, Prefix caching
    assert at.title[0].value.startswith("🧱 Prefix caching")
    assert _query(at) == {**stop4.query(), "tour": "3"}  # the link as it opened: the page wrote nothing
    monkeypatch.setattr(app.state, "_is_history_navigation", lambda: True)
    at.switch_page("../pages/whatif.py")
    _set_query(at, {**stop4.query(), "tour": "3"})  # Back: the What-if page under stop 4's link
    at.run()
    assert not at.exception, at.exception
    assert not at.title                        # the page is not drawn under the wrong banner...
    assert any("history.back()" in h.proto.body for h in at.get("html"))  # ...the browser steps on
    assert _query(at) == {**stop4.query(), "tour": "3"}  # and the entry is left as it was


def test_a_click_with_an_older_url_keeps_the_tour_stop():
    """A quick second click sends the browser's URL as it was before the first click's run updated it
    (tour=1 after Next went to tour=2): the tour stays at its stop."""
    at = _main(tour="1")
    at.button(key="tour_next").click().run()
    assert "stop 3 of 6" in _banner(at)
    at.query_params["tour"] = "1"              # the older URL, sent with a click on the page
    at.slider(key="wi_alpha").set_value(0.7).run()
    assert "stop 3 of 6" in _banner(at) and at.session_state["wi_alpha"] == 0.7


def test_a_switch_swallowed_by_a_quick_second_click_is_made_again():
    """A quick double "◀ Previous" from stop 2: the second click's run replaced the switch to stop 1's
    Live page, which left stop 1's banner over the What-if page. The switch is made again."""
    from app.navigation import _SWITCH

    at = _main(tour="1")                       # stop 2, What-if
    stop1 = tour_stops()[0].link
    at.session_state["tour_stop"] = 0          # what the first click's run did before its switch...
    at.session_state[_SWITCH] = (stop1, (), "whatif", {**stop1.query(), "tour": "0"})
    at.run()                                   # ...which the second click's run (on What-if) replaced
    assert not at.exception, at.exception
    assert "stop 1 of 6" in _banner(at) and "Live speculative decoding" in at.title[0].value


@pytest.mark.parametrize("row", [r for r in __import__("engine.explain.teaching", fromlist=["trade_offs"]).trade_offs()
                                 if r.page in ("whatif", "flash-attention", "kv-cache")],
                         ids=lambda r: r.technique[:24])
def test_a_trade_off_card_opens_its_example(row):
    """A user's report: the cards' "Open:" links carried no settings, so "2.39×" for self-drafting heads
    opened What-if at its defaults (2.80×), and GQA's Llama example opened on SmolLM2. Each link now
    opens its page in the example's setting, and the page shows the card's number."""
    import re

    at = _main(**row.link.query())
    files = {"whatif": "whatif.py", "flash-attention": "flash_attention.py", "kv-cache": "kv_cache.py"}
    at.switch_page(f"../pages/{files[row.page]}")
    at.run()
    assert not at.exception, at.exception
    shown = " ".join([m.value for m in at.metric] + [m.value for m in at.markdown] + [c.value for c in at.caption]
                     + [t.value.to_string() for t in [*at.table, *at.dataframe]])
    number = re.search(r"(\d+(?:\.\d+)?)×", row.example).group(1)
    assert f"{number}×" in shown or f"{float(number):.2f}×" in shown, (row.technique, number)  # KV's table: 4.00×


def test_recap_links_open_the_numbers_they_quote():
    """A user's report: the recap quoted α = 0.8, γ = 4 → 3.36 tokens per pass and linked to Live (code
    preset, γ 2), where that number is nowhere; its large-batch line linked to What-if at the defaults."""
    from engine.explain.teaching import recap

    items = recap()
    for item, number in ((items[1], "3.36"), (items[3], "2.80×")):
        assert number in item.idea and item.link.url_path == "whatif"
        at = _main(**item.link.query())
        at.switch_page("../pages/whatif.py").run()
        assert not at.exception, at.exception
        shown = " ".join([m.value for m in at.metric] + [m.value for m in at.markdown]
                         + [i.value for i in at.info])
        assert number in shown, (item.where, number)


def test_in_the_wild_links_its_sources_and_orders_its_table_as_its_sections():
    """A user's report: the documentation pages were plain text, the table showed raw backticks, and its
    rows came in another order than the sections."""
    at = AppTest.from_file(str(ROOT / "pages" / "in_the_wild.py"), default_timeout=60).run()
    assert not at.exception, at.exception
    text = " ".join(m.value for m in at.markdown)
    assert "](https://docs.vllm.ai/en/v0.9.1/features/spec_decode.html)" in text
    assert "](https://nvidia.github.io/TensorRT-LLM/advanced/speculative-decoding.html)" in text
    table = at.dataframe[0].value
    assert not table["how it is switched on"].str.contains("`").any()
    engines = list(dict.fromkeys(table["engine"]))
    assert engines == sorted(engines) == [h.value for h in at.subheader]


def test_in_the_wild_lists_late_2026_methods_with_links_to_this_apps_pages():
    at = AppTest.from_file(str(ROOT / "pages" / "in_the_wild.py"), default_timeout=60).run()
    assert not at.exception, at.exception
    assert any("Speculative methods, late 2026 (checked 2026-12-01)" in h.value for h in at.header)
    text = " ".join(m.value for m in at.markdown)
    assert "--spec-type draft-eagle3" in text and '"method": "dflash"' in text and "PARDDecodingConfig" in text
    assert "[Shown on: Live speculative decoding](/live?lv_draft=head)" in text
    assert "*unverified*" in text and "FIRST that returns a draft" in text
