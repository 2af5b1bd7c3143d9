"""Your traffic against a real llama.cpp server in Chromium: the page (app started with --llamacpp) starts
llama-server with ngram-simple speculation, sends requests, fetches two scrapes, and shows exactly the
differences of the server's counters (read here from /metrics, independently of the engine)."""

from __future__ import annotations

import re
import urllib.request

import pytest

from tests.e2e.conftest import run_app, screenshot, wait_idle
from tests.llamacpp_live import binary_or_skip, counters, difference

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def live_app_url():
    binary_or_skip()  # build (or reuse) before the page asks for it; skip where this machine cannot build
    yield from run_app(log_name="streamlit_llamacpp.log", args=("--llamacpp",))


def _scrape(metrics_url: str) -> str:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        return r.read().decode()


def test_page_starts_llamacpp_and_reads_its_counters(page, live_app_url):
    page.goto(live_app_url + "/your-traffic")
    wait_idle(page)
    page.get_by_text("🦙 A real server on this machine: llama.cpp").first.click()
    page.get_by_role("button", name="Start a local llama.cpp server").click()
    page.get_by_text("is running at http://127.0.0.1:").first.wait_for(timeout=180_000)
    wait_idle(page)
    metrics_url = page.get_by_role("textbox", name="Server's metrics address").input_value()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", metrics_url)
    try:
        page.get_by_role("button", name="Clear both").click()
        wait_idle(page)
        page.get_by_role("button", name="Fetch → first").click()
        wait_idle(page)
        first = counters(_scrape(metrics_url))  # nothing ran since the page's fetch
        page.get_by_role("button", name=re.compile(r"Send \d+ requests")).click()
        wait_idle(page, timeout_ms=300_000)
        page.get_by_role("button", name="Fetch → second").click()
        wait_idle(page)
        second = counters(_scrape(metrics_url))
        d = difference(first, second)
        assert d["drafts"] > 0
        caption = page.get_by_text(re.compile(r"between the two scrapes · [\d,]+ drafts")).first
        caption.wait_for(timeout=60_000)
        shown = [float(x.replace(",", "")) for x in
                 re.search(r"([\d,]+) drafts, ([\d,]+) draft tokens, ([\d,]+) accepted", caption.inner_text()).groups()]
        assert shown == [d["drafts"], d["draft_tokens"], d["accepted"]]
        rate = page.locator('[data-testid="stMetric"]', has_text="Acceptance rate").locator(
            '[data-testid="stMetricValue"]').first.inner_text()
        assert rate == f"{d['accepted'] / d['draft_tokens']:.3f}"
        length = page.locator('[data-testid="stMetric"]', has_text="Mean acceptance length").locator(
            '[data-testid="stMetricValue"]').first.inner_text()
        assert length == f"{1 + d['accepted'] / d['drafts']:.2f}"
        screenshot(page, "traffic_llamacpp")
    finally:
        page.get_by_role("button", name="Stop the server").click()
        wait_idle(page)
    page.get_by_role("button", name="Stop the server").wait_for(state="detached", timeout=60_000)  # the rerun is drawn
    start = page.get_by_role("button", name="Start a local llama.cpp server")
    # the panel folds once no server runs, or keeps the reader's open state: open it if it is folded. A click toggles
    # the fold, so click only a folded panel (clicking whenever the button was not drawn yet closed an open panel
    # on a slow rerun)
    panel = page.locator('[data-testid="stExpander"]', has_text="A real server on this machine: llama.cpp").first
    for _ in range(3):
        try:
            start.wait_for(timeout=5_000)
            break
        except Exception:  # noqa: BLE001 - Playwright's TimeoutError: not visible yet
            if panel.locator("details").first.get_attribute("open") is None:
                page.get_by_text("🦙 A real server on this machine: llama.cpp").first.click()
    start.wait_for(timeout=60_000)
    assert not page.get_by_text("is running at http://127.0.0.1:").count()
