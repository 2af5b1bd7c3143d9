"""Chromium: What-if's "When it does not help" runs a tiny measured sweep on the embedded model and draws the
measured curve over this machine's roofline model."""

import re

import pytest

from tests.e2e.conftest import screenshot, wait_idle

pytestmark = pytest.mark.e2e


def test_measured_sweep_draws_the_measured_curve(page, app_url):
    page.goto(app_url + "/whatif?wi_tab=When+it+does+not+help&wi_bs_batches=1,2&wi_bs_tokens=3"
                        "&wi_bs_methods=prompt+lookup")
    wait_idle(page, timeout_ms=120_000)
    page.get_by_role("heading", name="Measured on this machine").wait_for(timeout=60_000)
    page.get_by_text("GB/s").first.wait_for()
    page.get_by_role("button", name="Run the measured sweep").click()
    # the measured chart appears when the sweep has run (embedded model: load + 4 short batched runs)
    chart = page.locator(".js-plotly-plot", has_text="Speculative ÷ plain tokens/s")
    chart.wait_for(timeout=400_000)
    wait_idle(page, timeout_ms=120_000)
    legend = chart.inner_text()
    assert "prompt lookup: measured" in legend and "prompt lookup: roofline model" in legend
    # two measured points (B = 1, 2) drawn as markers
    assert chart.locator(".scatterlayer .trace").count() >= 2
    assert chart.locator(".scatterlayer .point").count() >= 2
    passes = page.locator(".js-plotly-plot", has_text="Target pass time against tokens")
    passes.wait_for()
    # the roofline's floor is the weights as the engine reads them (the GGUF's blocks, ~111 MB), not their fp32
    # values (538 MB), which put the line above every measured pass
    mb = re.search(r"roofline: max\((\d+) MB of weights", passes.inner_text())
    assert mb and int(mb.group(1)) < 300, passes.inner_text()
    page.get_by_text("prompt lookup: slower than plain from (measured)").first.wait_for()
    chart.scroll_into_view_if_needed()
    shot = screenshot(page, "whatif_batch_measured")
    passes.scroll_into_view_if_needed()
    screenshot(page, "whatif_batch_pass_roofline")
    assert shot.stat().st_size > 20_000


def test_stop_ends_a_running_sweep(page, app_url):
    page.goto(app_url + "/whatif?wi_tab=When+it+does+not+help&wi_bs_batches=1,2,4,8&wi_bs_tokens=32"
                        "&wi_bs_methods=prompt+lookup")
    wait_idle(page, timeout_ms=120_000)
    page.get_by_role("button", name="Run the measured sweep").click()
    page.get_by_text("Press Stop to stop").first.wait_for(timeout=120_000)
    page.locator(".st-key-wi_bs_stop button").first.click()  # not Streamlit's own Stop in the status widget
    wait_idle(page, timeout_ms=300_000)
    # stopped long before the 12 runs of this sweep ended: a warning names what was kept
    page.get_by_text("Stopped").first.wait_for(timeout=60_000)
