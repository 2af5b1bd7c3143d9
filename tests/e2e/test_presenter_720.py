"""Presenter mode on a 1280×720 projector: What-if's tab labels and Live's round verdict and text on the first screen."""

import re

import pytest

from tests.e2e.conftest import screenshot, wait_idle

pytestmark = pytest.mark.e2e

W, H = 1280, 720


@pytest.fixture
def projector(browser):
    ctx = browser.new_context(viewport={"width": W, "height": H})
    pg = ctx.new_page()
    yield pg
    ctx.close()


def _inside(box) -> bool:
    return box is not None and box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= W + 0.5 \
        and box["y"] + box["height"] <= H + 0.5


def test_whatif_tab_labels_fit_a_720p_projector(projector, app_url):
    pg = projector
    pg.goto(app_url + "/whatif?present=1")
    wait_idle(pg, timeout_ms=120_000)
    tabs = pg.get_by_role("tab")
    assert tabs.count() == 7
    for i in range(tabs.count()):
        t = tabs.nth(i)
        assert _inside(t.bounding_box()), f"tab {t.inner_text()!r} is outside the first screen: {t.bounding_box()}"
        # the whole label shows (no ellipsis, nothing scrolled away)
        assert t.evaluate("e => e.scrollWidth <= e.clientWidth + 1"), f"tab {t.inner_text()!r} is cut"
    assert "Sequential vs parallel drafting" in [tabs.nth(i).inner_text().strip() for i in range(tabs.count())]
    screenshot(pg, "presenter_720_whatif")


def test_live_verdict_and_text_on_a_720p_projector_first_screen(projector, app_url):
    pg = projector
    pg.goto(app_url + "/live?present=1&lv_draft=ngram&lv_preset=code&lv_gamma=4&lv_temp=0&lv_max_new=16&lv_seed=0")
    wait_idle(pg, timeout_ms=180_000)
    pg.get_by_role("button", name=re.compile(r"^Step one round")).click()
    verdict = pg.get_by_text("Verify:").first
    verdict.wait_for(timeout=60_000)
    wait_idle(pg)
    assert _inside(verdict.bounding_box()), f"the round's verdict is off the first screen: {verdict.bounding_box()}"
    text = pg.locator(".st-key-lv_generated").first
    box = text.bounding_box()
    assert box is not None and box["y"] + min(box["height"], 30) <= H, f"the generated text is off-screen: {box}"
    assert text.inner_text().strip() and "nothing generated yet" not in text.inner_text()
    assert not pg.locator('[data-testid="stException"]').count()
    screenshot(pg, "presenter_720_live")


def test_live_run_to_the_end_shows_what_it_bought_on_a_720p_projector_first_screen(projector, app_url):
    """After Run to the end the statistics sit far below; the finished line under the round says the tokens per round
    and α̂ on the first screen, and after Run baseline the measured speedup."""
    pg = projector
    pg.goto(app_url + "/live?present=1&lv_draft=ngram&lv_preset=code&lv_gamma=4&lv_temp=0&lv_max_new=16&lv_seed=0"
            "&lv_speed=instant")
    wait_idle(pg, timeout_ms=180_000)
    pg.get_by_role("button", name=re.compile(r"^Run to the end")).click()
    line = pg.get_by_text(re.compile(r"^Finished \(")).first
    line.wait_for(timeout=120_000)
    wait_idle(pg)
    assert re.search(r"tokens per round \(α̂ [\d.]+\)", line.inner_text()), line.inner_text()
    assert _inside(line.bounding_box()), f"the finished line is off the first screen: {line.bounding_box()}"
    pg.get_by_role("button", name=re.compile(r"^Run baseline")).click()
    pg.get_by_text(re.compile(r"Measured speedup [\d.]+× against plain decoding, identical texts")).first.wait_for(
        timeout=180_000)
    wait_idle(pg)
    line = pg.get_by_text(re.compile(r"^Finished \(")).first
    assert _inside(line.bounding_box()), f"the finished line is off the first screen: {line.bounding_box()}"
    assert not pg.locator('[data-testid="stException"]').count()
    screenshot(pg, "presenter_720_live_finished")
