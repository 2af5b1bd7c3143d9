"""Browser test: three readers on the Live page at once share the room's target passes, and each gets the text
the same settings give alone (greedy and sampled with a seed)."""

import re

import pytest

from tests.e2e.conftest import screenshot, wait_idle
from tests.e2e.room import alone_texts, normalized, open_readers, readers_for, run_all

pytestmark = pytest.mark.e2e


def test_three_readers_get_their_alone_texts(browser, app_url):
    readers = readers_for(3, max_new=16)
    try:
        open_readers(browser, app_url, readers)
        run_all(readers, timeout_s=300)
        assert [r.error for r in readers] == [None] * 3
        assert [r.tokens for r in readers] == [16] * 3
        want = alone_texts(readers)
        for r, w in zip(readers, want):
            assert normalized(r.text) == normalized(w), (r.index, r.temperature, r.text, w)
        body = readers[0].page.inner_text("body")
        rows = float(re.search(r"Rows per pass\s*([\d.]+)", body).group(1))
        assert rows > 1.0  # the readers' rounds really shared target passes
        assert re.search(r"The last target pass served \d+ readers?\.", body)
        readers[0].page.set_viewport_size({"width": 1400, "height": 1100})
        assert screenshot(readers[0].page, "live_room").stat().st_size > 20_000
    finally:
        for r in readers:
            if r.page is not None:
                r.page.context.close()


def test_charts_wait_while_others_decode(browser, app_url):
    """A reader who steps a round while another reader's run is in flight gets the statistics but not the charts
    (the deferral caption and a toggle instead); the toggle draws them at once. The long run must still be in the room
    when the other reader steps: the draft head's token trees of 32 nodes at temperature 2 accept about nothing, so
    its 160 tokens take ~15 s on the AMD EPYC (greedy with the default draft, they took ~1 s, and the step could land
    after the run's end)."""
    readers = readers_for(2, max_new=160)
    readers[0].temperature, readers[0].extra = 2.0, "&lv_draft=head&lv_gamma=4&lv_tree=32&lv_branch=4"
    readers[1].max_new = 16
    try:
        open_readers(browser, app_url, readers)
        long_run, stepper = readers
        long_run.page.evaluate("document.querySelector('.st-key-lv_run button').click()")
        # the long run is in the room once its page says so (its progress bar)
        long_run.page.get_by_text(re.compile(r"tokens, \d+ rounds?")).first.wait_for(timeout=60_000)
        stepper.page.locator(".st-key-lv_step button").first.click()
        caption = stepper.page.get_by_text(re.compile(r"1 other reader is decoding on this server"))
        caption.wait_for(timeout=60_000)
        assert stepper.page.get_by_role("heading", name="Live statistics").count() == 1
        assert stepper.page.get_by_role("heading", name="Open a round").count() == 0
        assert stepper.page.locator('[data-testid="stPlotlyChart"]').count() == 0
        caption.scroll_into_view_if_needed()
        screenshot(stepper.page, "live_room_charts_wait")
        stepper.page.get_by_text("Draw the charts now").click()
        stepper.page.get_by_role("heading", name="Open a round").wait_for(timeout=60_000)
        stepper.page.locator('[data-testid="stPlotlyChart"]').nth(1).wait_for(timeout=60_000)  # ≥ 2 charts
    finally:
        # stop the long run before its tab closes, so no reader of this test can still be in the room when the next
        # test's page decides whether to defer its charts (a closed tab's run stops at its page's next redraw,
        # within a second here; this makes it certain)
        if readers[0].page is not None:
            try:
                readers[0].page.locator(".st-key-lv_stop button").first.click(timeout=10_000)
                wait_idle(readers[0].page, timeout_ms=60_000)
            except Exception:  # noqa: BLE001 - cleanup: the contexts close below whatever happened
                pass
        for r in readers:
            if r.page is not None:
                r.page.context.close()


def test_protocol_readers_get_their_alone_texts(app_url):
    """The browserless readers of ``bench_room.py --client protocol`` (benchmarks/room_client.py) drive the page as
    Chromium does: two sessions over the websocket press Run to the end and read back the texts alone gives."""
    from benchmarks.room_client import open_protocol_readers, run_all_protocol

    readers = readers_for(2, max_new=12)
    clients = open_protocol_readers(app_url, readers)
    try:
        run_all_protocol(clients, timeout_s=300)
    finally:
        for c in clients:
            c.close()
    assert [r.error for r in readers] == [None, None]
    assert [r.tokens for r in readers] == [12, 12]
    assert all(c.messages > 10 for c in clients)
    for r, w in zip(readers, alone_texts(readers)):
        assert normalized(r.text) == normalized(w), (r.index, r.temperature, r.text, w)
