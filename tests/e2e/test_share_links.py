"""What a reader changes travels in the page's link and comes back in a fresh browser (a user's report:
the prefix-cache step and edited requests, KV's real-cache N and the In-the-wild filter did not)."""

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import wait_idle, wait_url

pytestmark = pytest.mark.e2e

REQUESTS_LABEL = "Requests, in arrival order (separate them with a line containing only ---)"


def _fresh(browser, url):
    page = browser.new_context(viewport={"width": 1400, "height": 3000}).new_page()
    page.goto(url)
    wait_idle(page)
    return page


def test_prefix_cache_step_and_edited_requests_travel(page, browser, app_url):
    page.set_viewport_size({"width": 1400, "height": 3000})
    page.goto(app_url + "/prefix-cache")
    wait_idle(page)
    # one click at a time, each waited for until the link shows it: on a loaded CI machine a click made
    # before the previous run had redrawn the page was checked too early (the link still said pc_step=4)
    for expected in (4, 3):
        page.get_by_role("button", name="◀ Previous request").click()
        wait_url(page, f"pc_step={expected}")
        wait_idle(page)
    other = _fresh(browser, page.url)
    other.get_by_test_id("stSliderThumbValue").filter(has_text="3").first.wait_for()  # "Show requests 1 to" 3
    text = "hello world one\n---\nhello world two\n---\nhello world three"
    box = page.get_by_label(REQUESTS_LABEL)
    box.fill(text)
    box.press("Control+Enter")
    wait_idle(page)
    page.get_by_text("Edited requests (not the preset's)").first.wait_for()
    page.wait_for_function("() => location.search.includes('pc_text=')")
    other = _fresh(browser, page.url)
    expect(other.get_by_label(REQUESTS_LABEL)).to_have_value(text, timeout=30_000)


def test_kv_real_n_and_wild_filter_travel(page, browser, app_url):
    page.goto(app_url + "/kv-cache?real_n=1")
    wait_idle(page)
    # the replaced value is named at once (it was named only after the next change of another control)
    page.get_by_text("real_n=1 → 5").first.wait_for()
    wait_url(page, "real_n=5")
    page.goto(app_url + "/in-the-wild")
    wait_idle(page)
    page.get_by_role("button", name="Remove SGLang").first.click()
    wait_idle(page)
    wait_url(page, "wild_engines=", absent=("SGLang",))
    other = _fresh(browser, page.url)
    assert other.get_by_role("heading", name="vLLM").count() == 1
    assert other.get_by_role("heading", name="SGLang").count() == 0


def test_a_sidebar_round_trip_keeps_a_pages_settings(page, app_url):
    """A user's report: leaving a page through the sidebar and coming back reset every slider (Streamlit
    drops the value of a widget a run does not draw; app/main.py now keeps them)."""
    page.goto(app_url + "/flash-attention")
    wait_idle(page)
    slider = page.get_by_role("slider", name="Sequence length N")
    slider.focus()
    page.keyboard.press("ArrowRight")  # N 10 → 11
    wait_idle(page)
    page.get_by_role("link", name="Trade-offs").first.click()
    wait_idle(page)
    page.get_by_role("link", name="FlashAttention").first.click()
    wait_idle(page)
    page.get_by_test_id("stSliderThumbValue").filter(has_text="11").first.wait_for(timeout=15_000)
    wait_url(page, "n=11")


@pytest.mark.parametrize("path, note", [
    ("/in-the-wild?wild_engines=vLLM&wild_engines=Foo", "wild_engines=Foo → (not offered: left out)"),
    ("/?tour=99", "tour=99 → 5"),  # the last stop (0-based in the link), on its own page
    ("/whatif?present=maybe", "present=maybe → 0"),
])
def test_link_values_the_app_cannot_use_are_named(browser, app_url, path, note):
    """Values no url_param reads (a Streamlit-bound filter, the tour stop, presenter mode) were replaced
    silently; now the same toast names them."""
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.goto(app_url + path)
    page.get_by_test_id("stToast").filter(has_text=note).first.wait_for(timeout=30_000)
