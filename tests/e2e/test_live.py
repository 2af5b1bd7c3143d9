"""Browser test of the live speculative decoding page on the embedded model with prompt lookup."""

import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.conftest import ROOT, _free_port, screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e


def test_live_step_round(page, app_url):
    page.goto(app_url + "/live?lv_draft=ngram&lv_preset=code&lv_gamma=4&lv_temp=0&lv_max_new=32&lv_seed=0")
    wait_idle(page, timeout_ms=180_000)  # the first load of the embedded model takes a while
    page.get_by_text("Live speculative decoding").first.wait_for()
    page.get_by_text("No round yet.").wait_for()
    t0 = time.perf_counter()
    page.get_by_role("button", name=re.compile(r"^Step one round")).click()
    page.get_by_text("Round 1:").first.wait_for(timeout=60_000)
    page.get_by_text("Verify:").first.wait_for(timeout=60_000)
    print(f"click → round 1 drawn: {time.perf_counter() - t0:.2f} s")
    wait_idle(page)
    # a second round from the keyboard (N), then the round's detail table and statistics are on the page
    page.get_by_text("Live speculative decoding").first.click()  # focus the page, not a text field
    page.keyboard.press("n")
    page.get_by_text("Round 2:").first.wait_for(timeout=60_000)
    wait_idle(page)
    page.set_viewport_size({"width": 1400, "height": 2600})  # the app scrolls inside: show the inspector
    wait_idle(page)
    body = page.inner_text("body")
    assert "Round 2 in detail" in body
    assert "Measured α̂" in body and "Tokens per round" in body
    assert "accepted draft token" in body and "target correction" in body  # the legend
    wait_url(page, "lv_draft=ngram", "lv_gamma=4")        # settings in the URL
    # the sidebar names the compute path; on the stream path with AVX-512 the weights' formats (the embedded
    # model's GGUF blocks, in the process's arithmetic) and the bytes a token reads, and the arithmetic's note
    path = re.search(r"the compute path\): ([^(]+)", body)
    assert path, "the compute path is not shown beside the model"
    if path.group(1).startswith("streaming kernel") and "avx512f" in open("/proc/cpuinfo").read():
        assert re.search(r"weights read as GGUF Q4_1 blocks \(\d+ matrices\).*: \d+ MB a token", body)
        assert re.search(r"Arithmetic: (int8|fp32)", body)
    assert not page.locator('[data-testid="stException"]').count()
    assert screenshot(page, "live").stat().st_size > 20_000


def test_live_run_can_be_stopped(page, app_url):
    """Stop during Run to the end ends the run between rounds and says so. The run must still be going when the click
    lands: the draft head's token trees of 32 nodes at temperature 2 accept about nothing, so 64 tokens take ~64
    rounds of ~80 ms on the AMD EPYC (prompt lookup at γ 2, greedy, ended its 64 tokens within half a second, and a
    Stop that lands after the end meets a finished run)."""
    page.goto(app_url + "/live?lv_draft=head&lv_tree=32&lv_branch=4&lv_preset=chat&lv_gamma=4&lv_temp=2"
              "&lv_max_new=64&lv_speed=fast")
    wait_idle(page, timeout_ms=180_000)
    page.get_by_role("button", name=re.compile(r"^Run to the end")).click()
    page.get_by_text("press Stop to stop").first.wait_for(timeout=60_000)
    # Streamlit's own Stop (in the running indicator) halted the script mid-draw and left a stale page;
    # the page hides the whole indicator, so "Stop" is the page's button, which ends the run between rounds
    status = page.locator('[data-testid="stStatusWidget"]')
    status.wait_for(state="attached", timeout=20_000)
    assert status.is_hidden() and status.locator("button").count() == 1
    page.locator(".st-key-lv_stop button").first.click()
    wait_idle(page)
    body = page.inner_text("body")
    # the stop is confirmed (a user's report: only a neutral count was shown)
    assert re.search(r"Stopped after \d+ rounds?: \d+ of at most 64 tokens", body) and "Finished" not in body
    assert not page.locator('[data-testid="stException"]').count()
    # the page shows every round the decoder holds: the round in flight at the click finished before
    # the redraw (it showed one round fewer, and the next Step then seemed to add two)
    rounds = int(re.search(r"Stopped after (\d+) round", body).group(1))
    page.locator(".st-key-lv_step button").first.click()
    page.get_by_text(f"after {rounds + 1} rounds").first.wait_for(timeout=60_000)
    wait_idle(page)
    assert f"after {rounds + 1} rounds" in page.inner_text("body")


def test_live_baseline_is_timed_ab_without_drawing(page, app_url):
    """Run baseline on the default draft (the trained head): it finishes the run, times speculative and
    plain decoding alternately with only a progress bar on the page, then shows the comparison."""
    page.goto(app_url + "/live?lv_draft=head&lv_preset=chat&lv_temp=0&lv_max_new=24&lv_speed=instant")
    wait_idle(page, timeout_ms=180_000)
    page.get_by_role("button", name=re.compile(r"^Run baseline")).click()
    page.get_by_text("Greedy outputs identical?").wait_for(timeout=180_000)
    wait_idle(page)
    page.set_viewport_size({"width": 1400, "height": 2000})
    wait_idle(page)
    body = page.inner_text("body")
    assert re.search(r"Greedy outputs identical\?\s*yes", body), body[:3000]
    speedup = re.search(r"Measured speedup\s*([\d.]+)×", body)
    assert speedup and float(speedup.group(1)) > 0
    print(f"page: measured speedup {speedup.group(1)}× (head draft, chat, 24 tokens)")
    assert "Finished" in body
    assert not page.locator('[data-testid="stException"]').count()
    screenshot(page, "live_baseline")


@pytest.fixture(scope="module")
def escape_app_url():
    """A second Streamlit server running tests/e2e/live_escape_app.py (hostile token texts)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "tests" / "e2e" / "live_escape_app.py"),
         "--server.headless", "true", "--server.port", str(port), "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(180):
        try:
            if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


def test_token_text_renders_literally(page, escape_app_url):
    from tests.e2e.live_escape_app import NASTY

    page.goto(escape_app_url)
    page.get_by_text("endround").wait_for(timeout=120_000)
    wait_idle(page)
    md = page.locator('[data-testid="stMarkdownContainer"]')
    texts = [t.replace("\u200b", "") for t in md.all_inner_texts()]
    for i, s in enumerate(NASTY):
        row = next(t for t in texts if t.startswith(f"row{i}:"))
        # chip, struck-through chip, generated span: each shows the token's characters exactly
        assert row == f"row{i}: {s} {s} {s}Z end{i}", row
    assert not md.locator("a, img, script, em, code, h1, ol, table, .katex").count()
    assert any("<b>x</b>" in t and "[a](b)" in t and "*c*" in t for t in texts)
    assert md.locator("del, s").count() >= 21  # every struck-through chip is a real strikethrough
    screenshot(page, "live_escape")


def test_live_medusa_heads_round(page, app_url):
    """The Medusa kind runs a tree round on the embedded model (the tree itself is drawn by the page's tree
    view for any round with Round.tree)."""
    page.goto(app_url + "/live?lv_draft=medusa&lv_preset=chat&lv_gamma=4&lv_temp=0&lv_max_new=16&lv_seed=0")
    wait_idle(page, timeout_ms=180_000)
    page.get_by_text("No round yet.").wait_for()
    page.get_by_role("button", name=re.compile(r"^Step one round")).click()
    page.get_by_text("Round 1:").first.wait_for(timeout=60_000)
    wait_idle(page)
    body = page.inner_text("body")
    assert "Medusa heads (Cai et al. 2024)" in body
    wait_url(page, "lv_draft=medusa")
    assert not page.locator('[data-testid="stException"]').count()
    assert screenshot(page, "live-medusa").stat().st_size > 20_000


def test_live_block_drafter_round(page, app_url):
    """The block drafter kind on the embedded model: a stepped round shows the block (the newest token, then the
    slots filled by one pass) and the verdict; the kind and γ travel in the link."""
    page.goto(app_url + "/live?lv_draft=block&lv_preset=chat&lv_gamma=7&lv_temp=0&lv_max_new=16&lv_seed=0"
              "&lv_speed=presenter")
    wait_idle(page, timeout_ms=180_000)
    page.get_by_text("No round yet.").wait_for()
    page.get_by_role("button", name=re.compile(r"^Step one round")).click()
    page.get_by_text("Round 1:").first.wait_for(timeout=60_000)
    page.get_by_text("Verify:").first.wait_for(timeout=60_000)
    wait_idle(page)
    body = page.inner_text("body")
    assert "Block pass:" in body and "all filled at once" in body
    assert "Block drafter (DFlash-style" in body
    wait_url(page, "lv_draft=block", "lv_gamma=7")
    assert not page.locator('[data-testid="stException"]').count()
    assert screenshot(page, "live-block").stat().st_size > 20_000


def test_live_adaptive_length_says_each_rounds_choice(page, app_url):
    """The default head drafts an adaptive length: each round says what it drafted and the expected gain; the
    combined draft says which draft drafted; a fixed γ shows no choice. Screenshots at 1280×720, normal and
    presenter mode."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(app_url + "/live?lv_draft=head&lv_preset=chat&lv_temp=0&lv_max_new=32&lv_seed=0")
    wait_idle(page, timeout_ms=180_000)
    page.get_by_text("No round yet.").wait_for()
    for n in (1, 2):
        page.get_by_role("button", name=re.compile(r"^Step one round")).click()
        page.get_by_text(f"Round {n}:").first.wait_for(timeout=60_000)
        wait_idle(page)
    body = page.inner_text("body")
    assert "Draft length:" in body and "draft head: drafted" in body and "×" in body
    assert "Adaptive: each round drafts what pays" in body  # the sidebar's radio, on by default
    assert not page.locator('[data-testid="stException"]').count()
    assert screenshot(page, "live_adaptive").stat().st_size > 20_000
    page.goto(app_url + "/live?lv_draft=head&lv_preset=chat&lv_temp=0&lv_max_new=32&lv_seed=0&present=1")
    wait_idle(page, timeout_ms=60_000)
    page.get_by_role("button", name=re.compile(r"^Step one round")).click()
    page.get_by_text("Round 1:").first.wait_for(timeout=60_000)
    wait_idle(page)
    assert "Draft length:" in page.inner_text("body")
    assert screenshot(page, "live_adaptive_present").stat().st_size > 20_000
    # the combined draft on the code edit: prompt lookup drafts where the answer copies the prompt
    page.goto(app_url + "/live?lv_draft=auto&lv_preset=code&lv_temp=0&lv_max_new=40&lv_seed=0")
    wait_idle(page, timeout_ms=60_000)
    seen = []
    for n in range(1, 9):
        page.get_by_role("button", name=re.compile(r"^Step one round")).click()
        page.get_by_text(f"Round {n}:").first.wait_for(timeout=60_000)
        wait_idle(page)
        seen.append(page.inner_text("body"))
        if "prompt lookup: drafted" in seen[-1]:
            break
    assert any("prompt lookup: drafted" in b for b in seen), "prompt lookup never drafted on the code edit"
    assert not page.locator('[data-testid="stException"]').count()
    # a fixed γ: no choice to show
    page.goto(app_url + "/live?lv_draft=head&lv_length=fixed&lv_preset=chat&lv_temp=0&lv_max_new=32&lv_seed=0")
    wait_idle(page, timeout_ms=60_000)
    page.get_by_role("button", name=re.compile(r"^Step one round")).click()
    page.get_by_text("Round 1:").first.wait_for(timeout=60_000)
    wait_idle(page)
    assert "Draft length:" not in page.inner_text("body")
