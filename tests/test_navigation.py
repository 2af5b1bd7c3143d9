"""All pages in one browser session (one shared session state): visiting them in order and back must not
raise. Two pages once shared the widget key "preset" (a GPU name on FlashAttention, a model name on
KV-cache): FlashAttention raised KeyError after KV-cache, and KV-cache drew another model's numbers after
FlashAttention."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.registry import PAGES_DIR, available_pages

MAIN = str(Path(__file__).resolve().parent.parent / "app" / "main.py")


@pytest.mark.slow
def test_every_page_after_every_other_in_one_session():
    files = [str(PAGES_DIR / p.file) for p in available_pages()]
    at = AppTest.from_file(MAIN, default_timeout=300)
    at.run()
    assert not at.exception, at.exception
    for page in files + files[::-1]:
        at.switch_page(page)
        at.run()
        assert not at.exception, (page, [e.value for e in at.exception])
        if page.endswith("kv_cache.py"):
            assert at.selectbox(key="preset").value == "SmolLM2-135M-Instruct (embedded)"
        if page.endswith("flash_attention.py"):
            assert at.selectbox(key="fa_gpu").value == "NVIDIA A100 (SXM4 40GB)"
