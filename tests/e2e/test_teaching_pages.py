"""Browser tests for the teaching pages: Common mistakes opens a page in the mistake's state, and Back
comes straight back; Trade-offs and Recap render with their links."""

import pytest

from tests.e2e.conftest import screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e


def test_a_reproduce_button_opens_the_page_and_one_back_returns(page, app_url):
    """A user's report: after "Reproduce on the Prefix caching page", Back showed the Common mistakes
    page under the prefix link (/mistakes?pc_preset=timestamp…), a second Back was needed, and Forward
    then went to that entry instead of the prefix page."""
    page.set_viewport_size({"width": 1400, "height": 2400})
    page.goto(app_url + "/mistakes")
    wait_idle(page, timeout_ms=120_000)
    page.get_by_role("button", name="Reproduce on the Prefix caching page").click()
    page.get_by_role("heading", name="🧱 Prefix caching").wait_for(timeout=60_000)
    wait_url(page, "/prefix-cache?", "pc_preset=timestamp", "pc_ts=start")
    wait_idle(page)
    page.go_back()
    page.get_by_role("heading", name="🚧 Common mistakes, live").wait_for(timeout=60_000)
    wait_url(page, "/mistakes", absent=("pc_preset",))
    wait_idle(page)
    page.go_forward()
    page.get_by_role("heading", name="🧱 Prefix caching").wait_for(timeout=60_000)
    wait_url(page, "/prefix-cache?", "pc_preset=timestamp")
    wait_idle(page)
    assert not page.locator('[data-testid="stException"]').count()


@pytest.mark.parametrize("path, heading", [("/trade-offs", "⚖️ Trade-offs"), ("/recap", "✅ Recap")])
def test_teaching_page_renders_with_its_links(page, app_url, path, heading):
    page.set_viewport_size({"width": 1400, "height": 2400})
    page.goto(app_url + path)
    wait_idle(page)
    page.get_by_role("heading", name=heading).wait_for(timeout=60_000)
    # the links draw after the heading: wait for the third (a busy machine drew none yet when counted at once)
    page.locator('[data-testid="stPageLink-NavLink"]').nth(2).wait_for(timeout=60_000)
    assert not page.locator('[data-testid="stException"]').count()
    assert screenshot(page, path.strip("/")).stat().st_size > 20_000
