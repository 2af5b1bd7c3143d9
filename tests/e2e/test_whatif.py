import pytest

from tests.e2e.conftest import screenshot, wait_idle

pytestmark = pytest.mark.e2e


def test_whatif_renders_seed_values(page, app_url):
    page.goto(app_url + "/whatif?wi_toy_n=2000")
    wait_idle(page)
    page.get_by_role("heading", name="📈 What-if: how much faster?").first.wait_for()
    # E = (1 − 0.8^5)/0.2 = 3.36 and 3.36/1.2 = 2.80× at the defaults; the metrics appear one by one, so
    # wait for each value (a wrong value times out) before reading them all
    for value in ("3.36", "2.80×"):
        page.locator('[data-testid="stMetricValue"]', has_text=value).first.wait_for(timeout=30_000)
    metrics = page.locator('[data-testid="stMetricValue"]').all_inner_texts()
    assert "3.36" in metrics and "2.80×" in metrics
    page.locator(".js-plotly-plot").nth(2).wait_for(timeout=30_000)   # γ chart, heat map, E vs α
    assert page.locator(".js-plotly-plot").count() >= 3
    shot = screenshot(page, "whatif")
    assert shot.stat().st_size > 20_000


def test_whatif_step_and_toy_tab(page, app_url):
    page.goto(app_url + "/whatif?wi_toy_n=2000")
    wait_idle(page)
    page.get_by_role("tab", name="Step simulator · Try it").click()
    page.get_by_role("button", name="Step ×100").click()
    wait_idle(page)
    page.get_by_text("Round 100:").first.wait_for()
    assert "wi_steps=100" in page.url
    screenshot(page, "whatif_simulator")
    page.get_by_role("tab", name="Distribution check").click()
    wait_idle(page)
    page.get_by_text("χ² p-value (first token vs p)").first.wait_for()
    screenshot(page, "whatif_toy")
