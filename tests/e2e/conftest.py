"""Browser tests: start the app once per session and drive it with Playwright in Debian's Chromium.

Playwright cannot download browsers here, so it launches /usr/bin/chromium (installed by
``make chromium``, which ``make test`` runs). Screenshots land in tests/e2e/screenshots/.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "tests" / "e2e" / "screenshots"
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_url():
    """Start ``streamlit run app/main.py`` headless on a free port; yield its base URL."""
    yield from run_app()


def run_app(env: dict | None = None, log_name: str = "streamlit.log", args: tuple[str, ...] = ()):
    """Generator: start the app (with ``env`` added to the environment, ``args`` after ``--``), yield its URL,
    stop it."""
    port = _free_port()
    log = open(ROOT / "tests" / "e2e" / log_name, "w")
    # the sweeps the pages measure are remembered in a file of this run's own, not in the user cache (where a
    # test's 3-token sweep would stand for this machine's in the reader's app: engine.explain.batch_view)
    sweeps = Path(tempfile.mkdtemp(prefix="speedup-lab-e2e-")) / "batch_sweeps.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app" / "main.py"),
         "--server.headless", "true", "--server.port", str(port),
         "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none", *(["--", *args] if args else [])],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "SPEEDUP_LAB_SWEEPS": str(sweeps), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError(f"Streamlit did not start; see tests/e2e/{log_name}")
    yield url
    proc.terminate()
    proc.wait(timeout=20)
    log.close()


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: run `make chromium` (apt-get install chromium).")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    yield pg
    ctx.close()


def wait_idle(page, timeout_ms: int = 60_000) -> None:
    """Wait until the app has rendered and no script run is in progress."""
    page.wait_for_selector('[data-testid="stApp"]', timeout=timeout_ms)
    page.wait_for_timeout(500)
    # the app root names the run state at once ("running", "rerunRequested", ...); the status widget says
    # "Running" only after a delay
    page.wait_for_function(
        "() => { const app = document.querySelector('[data-testid=\"stApp\"]');"
        " const s = document.querySelector('[data-testid=\"stStatusWidget\"]');"
        " return app && ['notRunning', 'compilationError'].includes(app.dataset.testScriptState)"
        " && !(s && s.innerText.includes('Running')); }",
        timeout=timeout_ms)
    page.wait_for_timeout(300)


def wait_url(page, *parts: str, absent: tuple[str, ...] = (), timeout_ms: int = 60_000) -> None:
    """Wait until the page's link (path and query) contains every one of `parts` and none of `absent`.

    The app writes the link at the end of a script run, after what the run draws; asserting on
    page.url straight after wait_idle failed on a loaded CI machine when the run had not yet started."""
    import json
    js = ("([parts, absent]) => { const u = location.pathname + location.search;"
          " return parts.every(p => u.includes(p)) && !absent.some(p => u.includes(p)); }")
    try:
        page.wait_for_function(js, arg=[list(parts), list(absent)], timeout=timeout_ms)
    except Exception as exc:
        raise AssertionError(f"link {page.url!r} lacks {json.dumps(parts)} or has {json.dumps(absent)}") from exc


def screenshot(page, name: str) -> Path:
    """Save a full-page PNG under tests/e2e/screenshots/ and return its path."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
