"""Browser test of the Race page on the embedded model: a small race with prompt lookup plays back in the browser and
ends on its verdict; presenter mode at 1280×720 holds the whole race without scrolling; the join card at a phone's
size."""

import re
import time

import pytest

from tests.e2e.conftest import screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e

SMALL = "rc_draft=ngram&rc_preset=code&rc_gamma=3&rc_temp=0&rc_max_new=24&rc_seed=0"
PLAYER = 'iframe[title="st.iframe"]'


def _player(page):
    return page.frame_locator(PLAYER).first


def _race(page, timeout_ms: int = 120_000) -> float:
    """Click Race; return the seconds from the click until the player starts playing (the new race's player)."""
    page.get_by_role("button", name=re.compile("Race$")).first.click()
    t0 = time.perf_counter()
    page.get_by_text("Part 1 of 5").first.wait_for(timeout=timeout_ms)
    page.wait_for_function(
        "(sel) => { const f = document.querySelector(sel); const b = f && f.contentDocument && f.contentDocument.body;"
        " return b && ['playing', 'done'].includes(b.dataset.state) && b.querySelector('.tok'); }",
        arg=PLAYER, timeout=timeout_ms)
    return time.perf_counter() - t0


def _wait_done(page, timeout_ms: int = 60_000) -> None:
    page.wait_for_function(
        "(sel) => { const f = document.querySelector(sel); const b = f && f.contentDocument && f.contentDocument.body;"
        " return b && b.dataset.state === 'done'; }", arg=PLAYER, timeout=timeout_ms)


def test_race_plays_back_and_ends_on_its_verdict(page, app_url):
    page.goto(app_url + "/race?" + SMALL)
    wait_idle(page, timeout_ms=180_000)  # the first load of the embedded model takes a while
    page.get_by_text("The race: plain vs speculative").first.wait_for()
    secs = _race(page)
    print(f"click → playback: {secs:.2f} s")
    _wait_done(page)
    player = _player(page)
    verdict = player.locator("#verdict").inner_text()
    assert verdict.startswith("TEXT IDENTICAL (24 tokens)") and "wall-clock" in verdict, verdict
    assert "measured one after the other" in player.locator("#note").inner_text()
    assert "texts identical so far (24 tokens)" in player.locator("#same").inner_text()
    body = player.locator("body")
    fps = float(body.get_attribute("data-fps") or 0)
    print(f"frames drawn a second: {fps:.0f}")
    assert fps >= 10, fps
    # two lanes, every token drawn, one bar per target pass under the plain lane
    assert player.locator(".lane").count() == 2
    assert player.locator(".lane.plain .tok").count() == 24 == player.locator(".lane.spec .tok").count()
    assert player.locator(".lane.plain .span.step, .lane.plain .span.prefill").count() == 24
    assert player.locator(".lane.spec .span.verify").count() >= 1
    stats = player.locator(".lane.spec .stats").inner_text()
    assert "tok/s" in stats and "TTFT" in stats and "tokens/pass" in stats
    assert player.locator(".lane.fin").count() == 2  # both lanes ended
    # the page says how the lanes were measured; the settings are in the link
    text = page.inner_text("body")
    assert "one after the other" in text and "Measured on this server" in text
    wait_url(page, "rc_draft=ngram", "rc_gamma=3", "rc_max_new=24")
    assert not page.locator('[data-testid="stException"]').count()
    # Replay, in the player: plays again from the start without a rerun of the page
    player.locator("#replay").click()
    _wait_done(page)
    assert player.locator("#verdict").inner_text() == verdict
    page.set_viewport_size({"width": 1400, "height": 1400})
    wait_idle(page)
    assert screenshot(page, "race").stat().st_size > 20_000


def test_presenter_race_fits_a_projector_and_the_join_card_a_phone(page, app_url):
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(app_url + "/race?present=1&" + SMALL)
    wait_idle(page, timeout_ms=180_000)
    _race(page)
    _wait_done(page)
    wait_idle(page)
    frame = page.locator(PLAYER).first.bounding_box()
    assert frame["y"] >= 0 and frame["y"] + frame["height"] <= 720, frame  # the whole race on the first screen
    assert "TEXT IDENTICAL" in _player(page).locator("#verdict").inner_text()
    page.mouse.move(1270, 715)  # no button's tooltip over the screenshot
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshot(page, "race_presenter_1280x720")), full_page=False)
    # the join card: the app's address and its QR code, at a phone's size
    page.set_viewport_size({"width": 390, "height": 844})
    page.get_by_role("button", name=re.compile("Join card")).click()
    dialog = page.locator('[role="dialog"]')
    dialog.wait_for(timeout=30_000)
    dialog.locator("img").first.wait_for(timeout=30_000)
    box = dialog.locator("img").first.bounding_box()
    assert box["width"] >= 200 and box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    assert re.search(r"http://127\.0\.0\.1:\d+/", dialog.inner_text())
    assert "opens only on this machine" in dialog.inner_text()  # the test server is on loopback
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshot(page, "race_join_card_phone")), full_page=False)
