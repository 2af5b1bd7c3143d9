import pytest

from tests.e2e.conftest import screenshot, wait_idle, wait_url

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
    # the chart toolbar is trimmed (app/charts.CHART_CONFIG): a few Tab stops per chart, not eight
    chart = page.locator(".js-plotly-plot").first
    chart.hover()
    titles = [b.get_attribute("data-title") for b in chart.locator(".modebar-btn").all()]
    assert "Download plot as a PNG" in titles and "Lasso Select" not in titles and len(titles) <= 5, titles


def test_whatif_step_and_toy_tab(page, app_url):
    page.goto(app_url + "/whatif?wi_toy_n=2000")
    wait_idle(page)
    page.get_by_role("tab", name="Step simulator · Try it").click()
    page.get_by_role("button", name="Step ×100").click()
    wait_idle(page)
    page.get_by_text("Round 100:").first.wait_for()
    wait_url(page, "wi_steps=100")
    screenshot(page, "whatif_simulator")
    page.get_by_role("tab", name="Distribution check").click()
    wait_idle(page)
    page.get_by_text("χ² p-value (first token vs p)").first.wait_for()
    screenshot(page, "whatif_toy")


def test_closed_tabs_keep_their_settings_and_back_undoes_a_change(page, app_url):
    """A closed tab's controls are not drawn; their values must survive (they reset to the defaults,
    and the link lost them). Back must undo a change and then leave the page: it took ~21 presses when
    every URL key was written as a history entry of its own."""
    page.goto(app_url + "/")
    wait_idle(page)
    start = page.evaluate("history.length")
    page.get_by_role("link", name="What-if: how much faster?").first.click()
    wait_idle(page)
    page.get_by_role("slider", name="Acceptance rate α").wait_for()
    assert page.evaluate("history.length") <= start + 2
    page.get_by_role("tab", name="Step simulator · Try it").click()
    seed = page.get_by_label("Random seed").first
    seed.fill("42")
    seed.press("Enter")
    wait_idle(page)
    page.get_by_role("tab", name="When it does not help").click()
    wait_idle(page)
    wait_url(page, "wi_seed=42")
    page.get_by_role("tab", name="Step simulator · Try it").click()
    wait_idle(page)
    assert page.get_by_label("Random seed").first.input_value() == "42"
    page.get_by_role("slider", name="Acceptance rate α").focus()
    page.keyboard.press("ArrowRight")
    wait_idle(page)
    wait_url(page, "wi_alpha=0.81")
    page.go_back()
    wait_idle(page)
    wait_url(page, "wi_alpha=0.8&")
    # the α slider's thumb shows 0.80 again (it is the page's first slider)
    page.get_by_test_id("stSliderThumbValue").first.filter(has_text="0.80").wait_for(timeout=10_000)
    # a tab switch is a step of its own (Streamlit's URL binding replaced the entry: Back skipped it)
    page.go_back()
    wait_url(page, "wi_tab=When+it+does+not+help")
    page.locator('[role="tab"][aria-selected="true"]').filter(has_text="When it does not help").wait_for(
        timeout=30_000)
    for _ in range(6):  # the seed change, the first tab switch, the page's first entry; then Home
        if page.url.rstrip("/") == app_url:
            break
        page.go_back()
        wait_idle(page)
    assert page.url.rstrip("/") == app_url


def test_whatif_shows_where_a_live_runs_gap_comes_from(page, app_url):
    """Live → What-if in one browser session: Run baseline on the Live page (the trained head, chat, 24 tokens),
    then What-if's "My measured numbers" shows the prediction one assumption at a time, the measured value,
    the chart and the sentence (engine.explain.analytic.predict_from_run)."""
    import re

    page.goto(app_url + "/live?lv_draft=head&lv_preset=chat&lv_temp=0&lv_max_new=24&lv_speed=instant")
    wait_idle(page, timeout_ms=180_000)
    page.get_by_role("button", name=re.compile(r"^Run baseline")).click()
    page.get_by_text("Greedy outputs identical?").wait_for(timeout=300_000)
    wait_idle(page)
    # in-app navigation keeps the session (and its measured_run); a new page load would not
    page.get_by_role("link", name="What-if: how much faster?").first.click()
    wait_idle(page)
    page.get_by_role("tab", name="My measured numbers").click()
    wait_idle(page)
    page.get_by_text("Where the gap comes from").first.wait_for(timeout=60_000)
    page.get_by_text("The prediction from the run is").first.wait_for(timeout=60_000)
    wait_url(page, "wi_tab=My+measured+numbers")
    body = page.inner_text("body")
    assert "included on both sides" in body
    m = re.search(r"The prediction from the run is ([\d.]+)× against ([\d.]+)× measured \(([-+][\d.]+)%\)", body)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, body[-2000:]
    print(f"page: from the run {m.group(1)}×, measured {m.group(2)}× ({m.group(3)} %)")
    grid = page.locator('[data-testid="stDataFrame"]').first
    grid.wait_for()
    page.locator(".js-plotly-plot").nth(1).wait_for(timeout=30_000)  # the pass-time curve and the gap chart
    assert not page.locator('[data-testid="stException"]').count()
    page.set_viewport_size({"width": 1400, "height": 2200})
    wait_idle(page)
    assert screenshot(page, "whatif_measured_gap").stat().st_size > 20_000


def test_whatif_sequential_vs_parallel_tab(page, app_url):
    """The Sequential vs parallel drafting tab (engine/explain/drafting.py): opened by a click, its metrics and
    three charts, a radio written into the link; without benchmarks/results/block_amd-epyc.json a caption says how to get
    measured points, with it the points are drawn (both are fine here: the app reads the repo's file)."""
    import re

    page.goto(app_url + "/whatif?wi_gamma=8")
    wait_idle(page)
    page.get_by_role("tab", name="Sequential vs parallel drafting").click()
    wait_idle(page)
    page.get_by_text("Block + confidence cut (oracle)").first.wait_for(timeout=60_000)
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=60_000)
    body = page.inner_text("body")
    assert re.search(r"Block B = 9, γ = 8\s*[\d.]+×", body), body[:3000]
    assert "run benchmarks/bench_block.py" in body or "Grey points: the shipped drafters measured on" in body
    page.get_by_text("Grows with the block: c0 + c1·B").click()
    wait_idle(page)
    wait_url(page, "wi_tab=Sequential+vs+parallel+drafting", "wi_block_cmodel=linear", "wi_gamma=8")
    assert not page.locator('[data-testid="stException"]').count()
    page.set_viewport_size({"width": 1400, "height": 2400})
    wait_idle(page)
    assert screenshot(page, "whatif_block").stat().st_size > 20_000


@pytest.fixture(scope="module")
def app_with_block_fixture():
    """The app reading tests/fixtures/block/block.json as its measured block results."""
    from tests.e2e.conftest import ROOT, run_app

    fixture = ROOT / "tests" / "fixtures" / "block" / "block.json"
    yield from run_app(env={"SPEEDUP_LAB_BLOCK_RESULTS": str(fixture)}, log_name="streamlit_block.log")


def test_whatif_block_tab_draws_measured_points(page, app_with_block_fixture):
    page.goto(app_with_block_fixture + "/whatif?wi_tab=Sequential+vs+parallel+drafting&wi_block_cmodel=measured")
    wait_idle(page)
    page.get_by_text("Grey points: the shipped drafters measured on Test CPU 9000, onednn kernels").first.wait_for(
        timeout=60_000)
    # the three measured drafts are drawn on the speedup chart, named in its legend
    for name in ("block chain B=8", "EAGLE-style head γ=3", "Medusa heads"):
        page.locator(".js-plotly-plot .legendtext", has_text=f"measured: {name}").first.wait_for(timeout=30_000)
    assert page.locator(".js-plotly-plot .scatterlayer .point").count() >= 3
    assert "measured c_block(B): B=4: 0.06" in page.inner_text("body")
    assert not page.locator('[data-testid="stException"]').count()
    page.set_viewport_size({"width": 1400, "height": 2400})
    wait_idle(page)
    assert screenshot(page, "whatif_block_measured").stat().st_size > 20_000
