"""The FlashAttention page in a real browser: step-through, traffic model, paper example, a measurement."""

import pytest

from tests.e2e.conftest import screenshot, wait_idle

pytestmark = pytest.mark.e2e


def _open(page, url):
    page.set_viewport_size({"width": 1400, "height": 4600})  # Streamlit scrolls inside the app: show it all
    page.goto(url)
    wait_idle(page)
    page.get_by_text("FlashAttention: exact attention in tiles").first.wait_for()
    page.get_by_text("The paper's example: GPT-2 medium on an A100").first.wait_for(timeout=60_000)
    wait_idle(page)


def test_flash_page_renders_and_steps(page, app_url):
    _open(page, app_url + "/flash-attention")
    page.get_by_text("Exact up to fp32 rounding").first.wait_for(timeout=60_000)  # the page's end (busy CPU)
    # each expected text is waited for, not read from one snapshot of the body: on a busy CI machine the
    # first page of the run was caught mid-redraw twice (a section missing from the body, then back)
    # N = 10, Br = 4, Bc = 3 → 3 × 4 = 12 tiles; A100 fp16 d = 64 → Bc = 384; model 9.13 GB vs 1.64 GB.
    for text in ("tiles to visit", "Step 1 of 12", "98,304 elements", "9.13 GB", "1.64 GB", "40.3 GB",
                 "Exact up to fp32 rounding"):
        page.get_by_text(text).first.wait_for(timeout=60_000)
    page.get_by_role("button", name="Next ▶").first.click()  # the one by the tiles (another by the m/ℓ table)
    wait_idle(page)
    page.get_by_text("Step 2 of 12").first.wait_for()
    assert not page.locator('[data-testid="stException"]').count()
    assert screenshot(page, "flash_attention").stat().st_size > 20_000


def test_flash_causal_link_and_measurement(page, app_url):
    _open(page, app_url + "/flash-attention?causal=1&n=16&br=4&bc=4&step=7&mnmax=1024&mheads=2")
    body = page.inner_text("body")
    # Causal, 4 × 4 blocks of 4: only the 10 tiles on or below the diagonal (1+2+3+4).
    assert "Step 7 of 10" in body and "6 skipped" in body
    page.get_by_role("button", name="Measure naive vs fused attention (a few seconds)").click()
    page.get_by_text("Last measurement: 2 head(s)").first.wait_for(timeout=120_000)
    wait_idle(page)
    assert not page.locator('[data-testid="stException"]').count()
    screenshot(page, "flash_attention_causal_measured")


def test_flash_bad_combination_message(page, app_url):
    page.goto(app_url + "/flash-attention?n=6&bc=9")
    wait_idle(page)
    page.get_by_text("is larger than the sequence length N = 6").first.wait_for()
    assert not page.locator('[data-testid="stException"]').count()
