"""Browser test: the prefix-caching page renders in Chromium with the simulator's numbers."""

import pytest

from engine.decoding.models import load_tokenizer
from engine.explain.prefix_cache import join_requests, preset_requests, simulate_texts
from tests.e2e.conftest import screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e


def _wait_text(page, text: str, timeout_ms: int = 30_000) -> None:
    try:
        page.get_by_text(text, exact=True).first.wait_for(timeout=timeout_ms)
    except Exception as e:  # say what the page showed instead (this test failed in fresh-clone CI only)
        import re

        body = page.inner_text("body")
        shown = sorted(set(re.findall(r"\d[\d,]* of \d[\d,]*", body)))[:12]
        main = page.locator('[data-testid="stMain"]')
        main_text = main.inner_text() if main.count() else body
        screenshot(page, "prefix_cache_timeout")
        raise AssertionError(f"{text!r} not shown within {timeout_ms} ms; page URL {page.url}; "
                             f"'N of M' texts on the page: {shown}; errors: "
                             f"{[ln for ln in body.splitlines() if 'pool holds only' in ln][:2]}; "
                             f"the page's main area: {main_text[:1500]!r}") from e


def test_prefix_cache_page_renders(page, app_url):
    page.set_viewport_size({"width": 1400, "height": 3200})   # the app scrolls inside; show it all
    page.goto(app_url + "/prefix-cache")
    wait_idle(page)
    _wait_text(page, "Requests through the block pool")
    # defaults: preset "system", block 16, capacity 64, 2 running at once, 0.5 ms/token
    sim, _ = simulate_texts(join_requests(preset_requests("system")), load_tokenizer("embedded"), 16, 64, 2, 0.5)
    _wait_text(page, f"{sim.hit_rate:.1%}")
    _wait_text(page, f"{sim.hit_tokens:,} of {sim.prompt_tokens:,}")
    _wait_text(page, f"{sim.saved_ms:,.1f} ms")
    page.locator(".js-plotly-plot").nth(1).wait_for(timeout=30_000)   # block tables and pool (drawn last)
    assert screenshot(page, "prefix_cache").stat().st_size > 20_000


def test_prefix_cache_timestamp_link(page, app_url):
    # a shared link: timestamp preset, timestamp first, 4-token blocks
    page.set_viewport_size({"width": 1400, "height": 3200})
    page.goto(app_url + "/prefix-cache?pc_preset=timestamp&pc_ts=start&pc_block=4")
    wait_idle(page)
    _wait_text(page, "Requests through the block pool")
    sim, _ = simulate_texts(join_requests(preset_requests("timestamp")), load_tokenizer("embedded"), 4, 64, 2, 0.5)
    assert max(r.hit_blocks for r in sim.requests) <= 1
    _wait_text(page, f"{sim.hit_tokens:,} of {sim.prompt_tokens:,}")
    _wait_text(page, str(sim.evictions))
    screenshot(page, "prefix_cache_timestamp")


@pytest.mark.slow
def test_prefix_cache_measure_button(page, app_url):
    page.set_viewport_size({"width": 1400, "height": 3200})
    page.goto(app_url + "/prefix-cache?pc_block=8&pc_capacity=40")   # non-default settings must survive
    wait_idle(page)
    page.get_by_role("button", name="Measure on the embedded model").click()
    _wait_text(page, "TTFT, prefix reused (measured)", timeout_ms=300_000)
    wait_idle(page, timeout_ms=120_000)
    body = page.locator('[data-testid="stMain"]').inner_text()
    assert "same first token (yes)" in body
    # the measured cost is offered at the top, and the sliders kept their values (the KV page once lost
    # them after a button's work)
    assert "Use the measured prefill cost" in body
    wait_url(page, "pc_block=8", "pc_capacity=40")
    assert "whole blocks of 8)" in body
    screenshot(page, "prefix_cache_measured")


def _slider_value(page) -> int:
    """The value the "Show requests 1 to" slider shows (its text: label, value, min, max)."""
    return int(page.locator(".st-key-pc_step_slider").inner_text().split()[4])  # "Show requests 1 to N 1 max"


def test_request_slider_follows_the_page_after_a_pool_error(page, app_url):
    """Lower the pool until the first request no longer fits (an error stops the page), raise it again:
    the "Show requests 1 to" slider must show the step the page shows (it stayed at 1 while the page
    showed all requests), and Previous must step back from there."""
    page.set_viewport_size({"width": 1400, "height": 1600})
    page.goto(app_url + "/prefix-cache?pc_capacity=16")
    wait_idle(page)
    _wait_text(page, "Requests through the block pool")
    capacity = page.get_by_role("slider", name="Pool capacity (KV blocks)")
    capacity.focus()
    page.keyboard.press("Home")   # Home / End jump the pool to 1 / 512 blocks
    page.get_by_text("the pool holds only").first.wait_for(timeout=60_000)
    wait_idle(page)
    for _ in range(3):  # on a loaded machine a key press can land before the redrawn slider has focus
        capacity.focus()
        page.keyboard.press("End")
        wait_idle(page)
        if "pc_capacity=512" in page.url:  # the page syncs the slider to its link
            break
    assert "pc_capacity=512" in page.url
    sim, _ = simulate_texts(join_requests(preset_requests("system")), load_tokenizer("embedded"), 16, 512, 2, 0.5)
    n = len(sim.requests)
    _wait_text(page, f"{sim.hit_tokens:,} of {sim.prompt_tokens:,}", timeout_ms=60_000)   # all n requests shown
    assert _slider_value(page) == n
    page.get_by_role("button", name="◀ Previous request").click()
    wait_idle(page)
    _wait_text(page, f"{sim.totals(n - 1).hit_tokens:,} of {sim.totals(n - 1).prompt_tokens:,}")
    assert _slider_value(page) == n - 1
