"""The app's pages, in tour order. One entry per file in ``pages/``; the home page and the tour read this."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES_DIR = ROOT / "pages"


@dataclass(frozen=True)
class PageInfo:
    file: str        # file name in pages/
    title: str
    icon: str
    url_path: str    # the page's URL segment, stable for shared links
    summary: str     # one line for the home page


PAGES: list[PageInfo] = [
    PageInfo("home.py", "Home", ":material/home:", "home", "What each page shows."),
    PageInfo("live.py", "Live speculative decoding", ":material/play_circle:", "live",
             "Real speculative decoding on the embedded model, round by round, every probability visible."),
    PageInfo("race.py", "The race: plain vs speculative", ":material/sports_score:", "race",
             "Plain and speculative decoding of one prompt, measured on this server and replayed side by side."),
    PageInfo("whatif.py", "What-if: how much faster?", ":material/query_stats:", "whatif",
             "The analytic speedup model, a step simulator and the distribution check."),
    PageInfo("traffic.py", "Your traffic", ":material/monitoring:", "your-traffic",
             "Your server's speculative metrics (vLLM, SGLang, llama.cpp, TensorRT-LLM), or a local llama.cpp: α by position, best γ, the flags."),
    PageInfo("prefix_cache.py", "Prefix caching", ":material/view_module:", "prefix-cache",
             "Paged KV blocks shared between requests, and the real prefill time saved."),
    PageInfo("flash_attention.py", "FlashAttention", ":material/bolt:", "flash-attention",
             "Attention in tiles with a running softmax: exact, with less memory traffic."),
    PageInfo("kv_cache.py", "KV-cache size (MHA/GQA/MQA)", ":material/calculate:", "kv-cache",
             "How big the KV cache is, what each decode step reads, and why GQA/MQA shrink both."),
    PageInfo("trade_offs.py", "Trade-offs", ":material/balance:", "trade-offs",
             "What each speedup saves, what it costs, when it stops helping, and whether outputs change."),
    PageInfo("mistakes.py", "Common mistakes, live", ":material/report:", "mistakes",
             "Five common mistakes, each reproduced in one click with the engine's numbers."),
    PageInfo("in_the_wild.py", "In the wild", ":material/public:", "in-the-wild",
             "Which widely used engines offer these speedups, with the documentation they come from."),
    PageInfo("recap.py", "Recap", ":material/checklist:", "recap",
             "The few ideas to remember, each linked to where the app shows it."),
]


def available_pages() -> list[PageInfo]:
    """Registered pages whose file exists (pages land one by one)."""
    return [p for p in PAGES if (PAGES_DIR / p.file).is_file()]
