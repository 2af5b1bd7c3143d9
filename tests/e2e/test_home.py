import pytest

from tests.e2e.conftest import screenshot, wait_idle

pytestmark = pytest.mark.e2e


def test_home_lists_pages(page, app_url):
    page.goto(app_url)
    wait_idle(page)
    page.get_by_text("Speedup Lab").first.wait_for()
    assert page.get_by_role("heading", name="⚡ Speedup Lab").count() >= 1 or page.get_by_text("Speedup Lab").count()
    assert screenshot(page, "home").stat().st_size > 10_000
