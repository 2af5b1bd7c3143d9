"""Browser test of why, here: Live after Run baseline and the Race page each show the measured speedup with the three
conditions the run measured and a link into What-if at the run's numbers, which opens it there."""

import re

import pytest

from tests.e2e.conftest import screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e


def test_live_after_run_baseline_says_why_and_links_into_whatif(page, app_url):
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(app_url + "/live?lv_draft=ngram&lv_preset=code&lv_gamma=3&lv_max_new=24")
    wait_idle(page, 180_000)
    page.get_by_role("button", name=re.compile("^Run to the end")).first.click()
    wait_idle(page, 180_000)
    page.get_by_role("button", name="Run baseline").first.click()
    page.mouse.move(2, 600)
    wait_idle(page, 180_000)
    card = page.locator(".st-key-lv_why")
    card.wait_for(timeout=60_000)
    text = card.inner_text()
    assert "Why, here" in text and "on this server" in text
    for name in ("Acceptance", "Verify pass", "Draft step"):
        assert name in text
    card.evaluate("e => e.scrollIntoView({block: 'start'})")
    screenshot(page, "live_why_here")
    page.get_by_role("link", name="Open What-if at this run's numbers").first.click()
    wait_idle(page, 120_000)
    wait_url(page, "wi_tab=Analytic", "wi_gamma=3")


def test_race_says_why_beside_its_verdict(page, app_url):
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(app_url + "/race")
    wait_idle(page, 180_000)
    card = page.locator("[class*='st-key-rc_'][class*='_why']").first
    card.wait_for(timeout=60_000)
    text = card.inner_text()
    assert "Why, here" in text and "recorded race's machine" in text
    card.evaluate("e => e.scrollIntoView({block: 'start'})")
    screenshot(page, "race_why_here")
