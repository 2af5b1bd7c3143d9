"""A room of readers on the Live page, driven in Chromium (shared by tests/e2e/test_live_room.py and
benchmarks/bench_room.py): K browser sessions open /live with their own settings, all press "Run to the end"
at once, and each one's generated text is read back and compared with the same settings decoded alone."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from tests.e2e.conftest import wait_idle

# the status alert's text, or NUL + "exception" when the page shows an exception
POLL_JS = ("() => { const ok = document.querySelector('[data-testid=\"stAlertContentSuccess\"]');"
           " if (ok) return ok.innerText;"
           " return document.querySelector('[data-testid=\"stException\"]') ? '\\0exception' : ''; }")
FINISHED = re.compile(r"Finished \((\w+)\): (\d+) tokens in (\d+) rounds?")


@dataclass
class Reader:
    """One reader's settings (the page's defaults otherwise: the trained head, the chat preset) and results."""

    index: int
    temperature: float
    seed: int
    max_new: int
    page: object = None
    t_click: float = 0.0
    t_done: float | None = None
    tokens: int = 0
    text: str = ""
    error: str | None = None
    extra: str = ""
    """More of the page's link parameters ("&lv_tree=32…"), appended to ``query``."""
    rule: str = "standard"
    """The sampling rule ("standard" or the drafter-invariant "gumbel"; the page's ``lv_rule``)."""

    @property
    def query(self) -> str:
        return (f"lv_temp={self.temperature:g}&lv_seed={self.seed}&lv_max_new={self.max_new}&lv_speed=instant"
                + (f"&lv_rule={self.rule}" if self.rule != "standard" else "") + self.extra)

    @property
    def wall_s(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_click


def normalized(text: str) -> str:
    """Text compared between the page and the engine: every whitespace (spaces, NBSP, line breaks and the page's
    ↵ marks) removed, so only the characters of the tokens remain (the page renders spaces and breaks)."""
    for ch in "\u00a0\u200b\u200c\u200d\ufeff↵":  # NBSP, zero-width spaces the spans add, the ↵ marks
        text = text.replace(ch, " ")
    return "".join(text.split())


def readers_for(k: int, max_new: int = 32, temperatures=(0.0, 0.8), rule: str = "standard") -> list[Reader]:
    """K readers, temperatures alternating, reader i seeded i, sampled readers on ``rule``."""
    return [Reader(i, temperatures[i % len(temperatures)], i, max_new, rule=rule) for i in range(k)]


def open_readers(browser, base_url: str, readers: list[Reader], timeout_ms: int = 300_000) -> None:
    """A browser context (a Streamlit session) per reader, each on /live with its settings, prefilled."""
    for r in readers:
        ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        r.page = ctx.new_page()
        r.page.goto(f"{base_url}/live?{r.query}")
    for r in readers:
        wait_idle(r.page, timeout_ms=timeout_ms)
        r.page.get_by_role("button", name=re.compile(r"^Run to the end")).wait_for(timeout=timeout_ms)


def run_all(readers: list[Reader], timeout_s: float = 600.0, poll_s: float = 1.0) -> float:
    """Press "Run to the end" on every reader's page, as fast as one driver can, then wait for each to say
    Finished (bounded by ``timeout_s``). Returns the time of the first click (time.perf_counter())."""
    t_first = time.perf_counter()
    for r in readers:
        r.t_click = time.perf_counter()
        # a script click: all readers press within a fraction of a second (Playwright's own click waits for the
        # button to be stable, two frames of a page, which took 8 s for 16 pages on a busy 2-core machine)
        r.page.evaluate("document.querySelector('.st-key-lv_run button').click()")
    deadline = time.perf_counter() + timeout_s
    pending = list(readers)
    while pending and time.perf_counter() < deadline:
        for r in list(pending):
            try:  # one small script a page: the status alert's text, or a mark for an exception (reading the whole
                # page, or two locator queries, each poll of 16 tabs cost their CPU: the tabs share the server's)
                body = r.page.evaluate(POLL_JS)
            except Exception:  # noqa: BLE001 - a page mid-redraw: look again next time
                continue
            m = FINISHED.search(body)
            if m:
                r.t_done = time.perf_counter()
                r.tokens = int(m.group(2))
                pending.remove(r)
            elif body == "\0exception":
                r.t_done, r.error = time.perf_counter(), "exception on the page"
                pending.remove(r)
        if pending:
            time.sleep(poll_s)
    for r in pending:
        r.error = f"not finished within {timeout_s:.0f} s"
    for r in readers:
        if r.error is None:
            wait_idle(r.page)
            r.text = r.page.locator(".st-key-lv_generated").inner_text()
            if r.page.locator('[data-testid="stException"]').count() or r.page.locator(
                    '[data-testid="stAlertContentError"]').count():
                r.error = "error on the page"
    return t_first


def alone_texts(readers: list[Reader]) -> list[str]:
    """Each reader's settings decoded alone by the engine, as the Live page builds them (the default draft: the
    trained head with its adaptive draft length, γ its cap ``ADAPTIVE_GAMMA_MAX``, as the page picks it; the chat
    preset, top-k 0, top-p 1): the tokens' texts, as the page shows them. (A sampled reader's text depends on the
    cap: the rounds' lengths decide which draws are made.)"""
    from engine.decoding.models import EMBEDDED, EMBEDDED_HEAD, load_model
    from engine.decoding.drafts import make_proposer
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
    from engine.decoding.draft_length import ADAPTIVE_GAMMA_MAX
    from engine.explain.presets import preset_text

    target = load_model(EMBEDDED)
    ids = encode_prompt(target.tokenizer, preset_text("chat"))
    out = []
    for r in readers:
        dec = SpeculativeDecoder(target, make_proposer(EMBEDDED_HEAD, target), ids, gamma=ADAPTIVE_GAMMA_MAX,
                                 sampling=SamplingConfig(temperature=r.temperature, top_k=0, top_p=1.0,
                                                         rule=r.rule), seed=r.seed,
                                 max_new_tokens=r.max_new)
        dec.prefill()
        dec.run()
        out.append("".join(dec.token_text(t) for t in dec.new_ids))
    return out
