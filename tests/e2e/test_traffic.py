"""Your traffic in Chromium: the example's numbers and charts, a fetched scrape from a loopback server, a
pasted bad scrape's message, and the link that carries a pasted scrape."""

from __future__ import annotations

import re
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.e2e.conftest import screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "traffic"


class _Metrics(BaseHTTPRequestHandler):
    def __init__(self, *a, body: bytes, **kw):
        self.body = body
        super().__init__(*a, **kw)

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


def _open(page, app_url) -> None:
    page.goto(app_url + "/your-traffic")
    wait_idle(page)
    page.get_by_role("heading", name="📡 Your traffic: from measured acceptance to settings").first.wait_for()
    _value(page, "0.550")  # the example has been computed


def _value(page, text: str) -> None:
    page.locator('[data-testid="stMetricValue"]', has_text=text).first.wait_for(timeout=30_000)


def test_traffic_example_and_charts(page, app_url):
    page.goto(app_url + "/your-traffic")
    wait_idle(page)
    page.get_by_role("heading", name="📡 Your traffic: from measured acceptance to settings").first.wait_for()
    for v in ("0.550", "2.65", "0.738"):  # the example: 3300 of 6000 draft tokens, 2000 drafts
        _value(page, v)
    page.locator(".js-plotly-plot").nth(3).wait_for(timeout=60_000)  # α_i, survival, tokens, speedup
    page.get_by_text('--speculative-config \'{"num_speculative_tokens": 7}\'').first.wait_for()
    assert screenshot(page, "traffic").stat().st_size > 20_000


def test_traffic_fetch_from_loopback_and_bad_paste(page, app_url):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Metrics, body=(FIX / "llamacpp_after.txt").read_bytes()))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        _open(page, app_url)
        page.get_by_role("button", name="Clear both").click()
        wait_idle(page)
        url = page.get_by_role("textbox", name="Server's metrics address")
        url.fill(f"http://127.0.0.1:{srv.server_address[1]}/metrics")
        url.press("Enter")
        wait_idle(page)
        page.get_by_role("button", name="Fetch → first").click()
        wait_idle(page)
        page.get_by_text("Fetched").first.wait_for()
        _value(page, "0.537")  # llama.cpp since start: 2790 / 5200
        wait_url(page, "yt_scrape=llamacpp")  # the fetched scrape's speculative lines travel in the link
        screenshot(page, "traffic_fetched")
        box = page.get_by_role("textbox", name="Scrape (Prometheus text), or the first of two")
        box.fill("<html><body>Not found</body></html>")
        box.press("Control+Enter")
        wait_idle(page)
        page.get_by_text("This is not Prometheus text exposition format").first.wait_for()
    finally:
        srv.shutdown()
        srv.server_close()


def test_traffic_refuses_a_remote_address(page, app_url):
    _open(page, app_url)
    url = page.get_by_role("textbox", name="Server's metrics address")
    url.fill("http://example.com/metrics")
    url.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name="Fetch → first").click()
    wait_idle(page)
    page.get_by_text("SPEEDUP_LAB_ALLOWED_HOSTS").first.wait_for()
    _value(page, "0.550")  # the example is still shown


def test_traffic_reads_the_live_run_at_its_own_costs(page, app_url):
    """A Live run, then Your traffic from "The Live page's last run" in the same session: the model's draft cost and
    verify slope are the run's (a caption says where from), the words name the run, and the α chart's axis holds
    the run's positions (γ 1: position 0 alone, where the axis ran from −1 to 0)."""
    page.goto(app_url + "/live?lv_draft=head&lv_preset=chat&lv_gamma=1&lv_temp=0&lv_max_new=24&lv_speed=instant")
    wait_idle(page, timeout_ms=180_000)
    page.get_by_role("button", name=re.compile(r"^Run to the end")).click()
    page.get_by_text(re.compile(r"^Finished")).first.wait_for(timeout=120_000)
    wait_idle(page)
    page.get_by_role("link", name="Your traffic").first.click()  # the sidebar: the same session
    wait_idle(page)
    page.get_by_text("The Live page's last run").first.click()
    wait_idle(page)
    page.get_by_text("this run's, as measured").first.wait_for(timeout=60_000)
    page.get_by_role("heading", name="What the Live run measured").first.wait_for()
    assert page.get_by_text("γ the run drafted").count() >= 1
    alpha = page.locator(".js-plotly-plot", has_text="Conditional α_i").first
    alpha.wait_for(timeout=60_000)
    ticks = [t.strip() for t in alpha.locator(".xtick text").all_text_contents()]
    assert "0" in ticks and "−1" not in ticks and "-1" not in ticks, ticks
    assert not page.locator('[data-testid="stException"]').count()
    alpha.scroll_into_view_if_needed()
    screenshot(page, "traffic_live_run")
