"""Browser test: walk the whole guided tour from the home page in Chromium, a screenshot per stop;
presenter mode from a URL; the export toolbars (Plotly PNG, dataframe CSV); a check-yourself answer."""

import re

import pytest

from engine.explain.teaching import tour_stops
from tests.e2e.conftest import screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e

PAGE_HEADINGS = {"live": "Live speculative decoding", "whatif": "What-if: how much faster?",
                 "prefix-cache": "Prefix caching", "flash-attention": "FlashAttention",
                 "kv-cache": "KV-cache size"}


def _banner(page):
    return page.locator(".st-key-tour_banner")


def test_walk_the_whole_tour(page, app_url):
    stops = tour_stops()
    page.goto(app_url)
    wait_idle(page)
    page.get_by_role("button", name="▶ Start the guided tour").click()
    for i, stop in enumerate(stops):
        _banner(page).get_by_text(f"stop {i + 1} of {len(stops)}").wait_for(timeout=180_000)
        wait_idle(page, timeout_ms=180_000)
        wait_url(page, f"/{stop.link.url_path}", f"tour={i}", *(f"{k}=" for k in stop.link.query()))
        if stop.link.url_path == "live":  # the model loads, then do what the stop says: Step a few times
            step = page.get_by_role("button", name=re.compile(r"^Step one round"))
            step.wait_for(timeout=180_000)
            for _ in range(3):
                page.wait_for_function("() => { const b = [...document.querySelectorAll('button')].find("
                                       "b => b.innerText.trim().startsWith('Step one round')); return b && !b.disabled; }",
                                       timeout=180_000)
                step.click()
                wait_idle(page, timeout_ms=120_000)
            page.get_by_text("Round 3").first.wait_for(timeout=60_000)
        page.wait_for_timeout(1500)  # charts finish drawing
        # the stop's in-page links ("the roofline table") name headers that exist on its page
        for anchor in re.findall(r"\]\(#([\w-]+)\)", stop.text):
            assert page.locator(f'[id="{anchor}"]').count() == 1, (stop.title, anchor)
        screenshot(page, f"tour_{i + 1}_{stop.link.url_path}")
        if i < len(stops) - 1:
            _banner(page).get_by_role("button", name="Next ▶").click()
    _banner(page).get_by_role("button", name="Finish").click()
    page.get_by_role("heading", name="✅ Recap").wait_for(timeout=60_000)
    wait_idle(page)
    assert _banner(page).count() == 0
    wait_url(page, absent=("tour=",))
    screenshot(page, "tour_recap")


def test_presenter_url_opens_page_state_and_stop(page, app_url):
    stop = tour_stops()[1]
    page.goto(app_url + "/" + stop.link.url(present=1, tour=1))
    wait_idle(page)
    _banner(page).get_by_text("stop 2 of 6").wait_for()
    # sidebar collapsed, large body type
    assert page.locator('[data-testid="stSidebar"][aria-expanded="true"]').count() == 0
    # the presenter style sheet is part of the script run: wait until it applies (≥ 20 px body text)
    page.wait_for_function("() => parseFloat(getComputedStyle(document.querySelector("
                           "'[data-testid=\"stMainBlockContainer\"] p')).fontSize) >= 20", timeout=30_000)
    page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
    screenshot(page, "tour_presenter_whatif")
    _banner(page).get_by_role("button", name="Next ▶").click()
    _banner(page).get_by_text("stop 3 of 6").wait_for(timeout=60_000)
    wait_idle(page)
    wait_url(page, "present=1")


def test_tour_keys_with_a_focused_widget_and_a_new_stop_at_the_top(page, app_url):
    """Shift+→ steps the tour even while the radio the stop asked you to switch has the focus (Streamlit
    skips button shortcuts then, and the radio took the key and undid the demo); a stop on the same
    page as the last one opens at the top, with the banner in view."""
    stops = tour_stops()
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(app_url + "/" + stops[3].link.url(present=1, tour=3))  # prefix caching, timestamp first
    wait_idle(page)
    _banner(page).get_by_text("stop 4 of 6").wait_for()
    page.get_by_text("at the end (the fix)").click()
    wait_idle(page)
    page.wait_for_function("() => location.search.includes('pc_ts=end')", timeout=30_000)
    page.get_by_role("radio", name="at the end (the fix)").focus()
    page.keyboard.press("Shift+ArrowRight")
    _banner(page).get_by_text("stop 5 of 6").wait_for(timeout=60_000)
    wait_url(page, "/flash-attention")
    # stop 2 → 3 are both on the what-if page: scroll down at stop 2, then Next
    page.goto(app_url + "/" + stops[1].link.url(present=1, tour=1))
    wait_idle(page)
    _banner(page).get_by_text("stop 2 of 6").wait_for()
    page.get_by_role("slider", name="Acceptance rate α").wait_for()
    page.evaluate("document.querySelector('[data-testid=\"stMain\"]').scrollTo(0, 600)")
    page.wait_for_timeout(300)
    assert page.evaluate("document.querySelector('[data-testid=\"stMain\"]').scrollTop") > 0
    page.get_by_role("slider", name="Acceptance rate α").focus()
    page.keyboard.press("Shift+ArrowRight")  # the slider has the focus: the tour moves, α stays
    _banner(page).get_by_text("stop 3 of 6").wait_for(timeout=60_000)
    wait_idle(page)
    page.wait_for_function("() => document.querySelector('[data-testid=\"stMain\"]').scrollTop === 0",
                           timeout=10_000)
    wait_url(page, "wi_alpha=0.8")  # stop 3's α, not stop 2's 0.6 moved by the key
    screenshot(page, "tour_stop3_after_keys")


def test_export_toolbars_and_a_question(page, app_url):
    page.goto(app_url + "/whatif?wi_alpha=0.6&wi_gamma=4&wi_cost=0.3")
    wait_idle(page)
    chart = page.locator(".js-plotly-plot").first
    chart.wait_for(timeout=30_000)
    chart.hover()
    page.locator(".modebar-btn[data-title='Download plot as a PNG']").first.wait_for(timeout=10_000)
    screenshot(page, "export_plotly_modebar")
    # check yourself: answer the first question right
    page.get_by_text("Yes, it is faster").first.click()
    page.get_by_role("button", name="Check").first.click()
    wait_idle(page)
    page.get_by_text("Right. A round yields").first.wait_for()
    page.get_by_text("Right. A round yields").first.scroll_into_view_if_needed()
    page.screenshot(path=str(screenshot(page, "check_yourself_whatif").parent / "check_yourself_whatif_view.png"))

    page.goto(app_url + "/trade-offs")
    wait_idle(page)
    page.get_by_text("Stops helping when:").first.wait_for()  # the cards: every field visible, no scrolling
    screenshot(page, "trade_offs_cards")
    page.get_by_text("The same comparison as one table").click()
    grid = page.locator('[data-testid="stDataFrame"]').first
    grid.wait_for()
    grid.hover()
    page.locator('[data-testid="stElementToolbar"] button[aria-label*="Download"]').first.wait_for(timeout=10_000)
    screenshot(page, "export_dataframe_toolbar")


def test_in_the_wild_renders_flags_as_code(app_url, page):
    page.goto(app_url + "/in-the-wild")
    wait_idle(page)
    page.get_by_role("heading", name="vLLM").wait_for()
    code = page.locator("code", has_text="enable_prefix_caching=True").first
    code.wait_for()  # rendered as code, not as raw backticks
    assert "`" not in code.inner_text()
    screenshot(page, "in_the_wild")


def test_browser_back_and_forward_step_one_stop_at_a_time(page, app_url):
    """A user's report: each stop added three history entries; Back took three presses per stop and in
    between showed one stop's banner over another stop's page (What-if under "stop 4: Prefix caching")."""
    stops = tour_stops()
    page.goto(app_url)
    wait_idle(page)
    page.get_by_role("button", name="▶ Start the guided tour").click()
    _banner(page).get_by_text("stop 1 of 6").wait_for(timeout=180_000)
    wait_idle(page, timeout_ms=180_000)
    for i in (1, 2, 3):
        _banner(page).get_by_role("button", name="Next ▶").click()
        _banner(page).get_by_text(f"stop {i + 1} of 6").wait_for(timeout=120_000)
        wait_idle(page, timeout_ms=120_000)
    for i in (2, 1, 0):  # each Back: the stop before, on its own page
        page.go_back()
        _banner(page).get_by_text(f"stop {i + 1} of 6").wait_for(timeout=60_000)
        wait_url(page, f"/{stops[i].link.url_path}?", f"tour={i}")
        wait_idle(page, timeout_ms=120_000)
    page.go_forward()
    _banner(page).get_by_text("stop 2 of 6").wait_for(timeout=60_000)
    wait_url(page, "/whatif?", "tour=1")
    for _ in range(2):  # back past the tour's start: Home as it was, without the tour
        page.go_back()
        wait_idle(page)
    page.get_by_role("button", name="▶ Start the guided tour").wait_for(timeout=60_000)
    wait_url(page, absent=("tour=",))
    wait_idle(page)
    assert _banner(page).count() == 0
