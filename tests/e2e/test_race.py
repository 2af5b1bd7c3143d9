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
    page.get_by_text(re.compile(r"Part 1 of \d+")).first.wait_for(timeout=timeout_ms)
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
    # the page's own button (every page's sidebar has one too)
    page.get_by_test_id("stMainBlockContainer").get_by_role("button", name=re.compile("Join card")).click()
    dialog = page.locator('[role="dialog"]')
    dialog.wait_for(timeout=30_000)
    dialog.locator("img").first.wait_for(timeout=30_000)
    box = dialog.locator("img").first.bounding_box()
    assert box["width"] >= 200 and box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    assert re.search(r"http://127\.0\.0\.1:\d+/", dialog.inner_text())
    # the test server is on loopback: the card says so, and offers this machine's network address where it finds one
    assert re.search(r"opens only on this machine|which only this machine can open", dialog.inner_text())
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshot(page, "race_join_card_phone")), full_page=False)


def _recorded_spec_text(upto_round: int) -> str:
    """The recorded race's speculative text through round ``upto_round`` (1-based), from the shipped record."""
    from engine.decoding.race import load_race
    from tests.test_page_live_round import RECORDED

    race = load_race(RECORDED)
    return "".join(t.text for t in race.spec.tokens if t.round < upto_round)


def test_a_round_of_the_recorded_race_opens_in_live(page, app_url):
    """Under the lanes: pick round 5, follow the link: the Live page (same tab) shows round 5 opened, with the text
    the race had by then. A bar of the speculative lane opens its round in a new tab."""
    page.goto(app_url + "/race")
    wait_idle(page, timeout_ms=180_000)
    box = page.locator(".st-key-rc_open_round input")
    box.fill("5")
    box.press("Enter")
    wait_idle(page)
    link = page.get_by_role("link", name=re.compile("Open round 5 in the Live page"))
    link.wait_for(timeout=30_000)
    page.wait_for_timeout(300)
    assert screenshot(page, "race_open_round").stat().st_size > 20_000
    link.click()
    page.get_by_text("Round 5, opened by the link").first.wait_for(timeout=180_000)
    wait_idle(page, timeout_ms=180_000)
    from engine.decoding.race import load_race
    from tests.test_page_live_round import RECORDED

    gamma = load_race(RECORDED).settings["gamma"]  # the recorded race's γ (this machine's default when recorded)
    wait_url(page, "/live?", "lv_round=5", "lv_draft=head", f"lv_gamma={gamma}", "lv_preset=chat")
    assert page.get_by_text(re.compile(r"^Round 5: ")).count() >= 1
    assert page.get_by_text("Round 5 in detail").count() == 1
    shown = page.locator(".st-key-lv_generated").inner_text()
    words = _recorded_spec_text(5).split()
    assert words and all(w in shown for w in words), (words, shown)
    assert not page.locator('[data-testid="stException"]').count()
    assert screenshot(page, "live_opened_round_5").stat().st_size > 20_000
    # a step goes on: round 6, and the link no longer says round 5
    page.get_by_role("button", name="Step one round").click()
    page.get_by_text(re.compile(r"^Round 6: ")).first.wait_for(timeout=60_000)
    wait_idle(page)
    wait_url(page, "/live?", absent=("lv_round=",))
    # the player's bars: a speculative round's bar opens that round in a new tab
    page.goto(app_url + "/race")
    wait_idle(page, timeout_ms=120_000)
    _wait_done(page)
    bar = _player(page).locator('.lane.spec a.span.verify[data-round="3"]')
    assert "lv_round=3" in bar.get_attribute("href") and bar.get_attribute("target") == "_blank"
    with page.context.expect_page(timeout=30_000) as new_tab:
        bar.click()
    tab = new_tab.value
    tab.get_by_text("Round 3, opened by the link").first.wait_for(timeout=180_000)
    assert "/live?" in tab.url and "lv_round=3" in tab.url
    assert tab.get_by_text(re.compile(r"^Round 3: ")).count() >= 1


def test_opening_a_far_round_shows_progress_and_stops_on_stop(page, app_url):
    """Live opened at a far round steps there with a progress bar; Stop ends it between rounds: the page shows the
    rounds run so far, says it stopped, and its link no longer names the round. The run must still be going when Stop
    lands: the draft head's token trees of 32 nodes at temperature 2 accept about nothing (256 tokens in 255 rounds
    of ~80 ms on the AMD EPYC, ~20 s). Prompt lookup at γ 1, greedy, took 256 tokens in 190 rounds and 2 s: a Stop
    that landed after 2 s met a finished run, which says so instead of "Stopped"."""
    page.goto(app_url + "/live?lv_preset=custom&lv_prompt=Write+a+long+story+about+a+dragon."
              "&lv_draft=head&lv_gamma=4&lv_tree=32&lv_branch=4&lv_temp=2&lv_max_new=256&lv_round=200")
    page.get_by_text(re.compile(r"Opening round 200: \d+ of 200 rounds stepped")).first.wait_for(timeout=180_000)
    page.locator(".st-key-lv_stop button").first.click()
    page.get_by_text(re.compile(r"^Stopped after \d+ rounds")).first.wait_for(timeout=60_000)
    wait_idle(page)
    wait_url(page, "/live?", "lv_draft=head", absent=("lv_round=",))
    stopped = re.search(r"Stopped after (\d+) rounds", page.inner_text("body"))
    assert stopped and 0 < int(stopped.group(1)) < 200
    assert page.get_by_text(re.compile(rf"^Round {stopped.group(1)}: ")).count() >= 1
    assert "opened by the link" not in page.inner_text("body")
    assert not page.locator('[data-testid="stException"]').count()


def test_the_lanes_stats_fit_a_phone(browser, app_url):
    """At a phone's width (390 px) each lane's statistics line wraps inside its lane: it was one line as wide as its
    text, so "tokens/pass" and the passes ran past the lane's right edge and were cut off by the player's frame."""
    ctx = browser.new_context(viewport={"width": 390, "height": 844})
    page = ctx.new_page()
    try:
        page.goto(app_url + "/race")  # the recorded race plays: nothing to race
        wait_idle(page, timeout_ms=180_000)
        _wait_done(page)
        player = _player(page)
        frame = page.locator(PLAYER).first.bounding_box()
        for lane in player.locator(".lane").all():
            stats, box = lane.locator(".stats"), lane.bounding_box()
            s = stats.bounding_box()
            assert "tokens/pass" in stats.inner_text()
            assert s["x"] + s["width"] <= box["x"] + box["width"] + 0.5, (stats.inner_text(), s, box)
            assert s["y"] + s["height"] <= frame["y"] + frame["height"] + 0.5, (s, frame)  # not below the frame
        page.wait_for_timeout(300)
        screenshot(page, "race_phone_lanes")
    finally:
        ctx.close()


SAMPLED = "rc_draft=ngram&rc_preset=code&rc_gamma=3&rc_temp=0.8&rc_max_new=24&rc_seed=1&rc_rule=gumbel"


@pytest.mark.parametrize("present", [False, True])
def test_a_sampled_race_on_the_drafter_invariant_rule_ends_text_identical(page, app_url, present):
    """Sampled at T 0.8 on the drafter-invariant rule: the verdict says TEXT IDENTICAL and why (the same seed's noise),
    the page's caption explains it, and the sampling-rule choice shows the rule; at 1280×720, normal and presenter."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(app_url + "/race?" + ("present=1&" if present else "") + SAMPLED)
    wait_idle(page, timeout_ms=180_000)
    _race(page)
    _wait_done(page)
    wait_idle(page)
    verdict = _player(page).locator("#verdict").inner_text()
    assert verdict.startswith("TEXT IDENTICAL (24 tokens, sampled") and "same seed's Gumbel noise" in verdict, verdict
    assert _player(page).locator(".lane.plain .tok").count() == 24 == _player(page).locator(".lane.spec .tok").count()
    if not present:
        assert page.get_by_text("Why identical though sampled").count() >= 1
        assert page.get_by_text("Drafter-invariant (Gumbel-max, same text)").count() >= 1
    assert not page.locator('[data-testid="stException"]').count()
    wait_url(page, "rc_rule=gumbel", "rc_temp=0.8")
    page.mouse.move(1270, 715)
    page.wait_for_timeout(500)
    name = "race_gumbel_presenter_1280x720" if present else "race_gumbel_1280x720"
    page.screenshot(path=str(screenshot(page, name)), full_page=False)
