"""engine.explain.teaching: answers against hand-computed values, links against the pages' URL keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.errors import InputError
from engine.explain.kv_size import model_preset
from engine.explain.teaching import (
    IN_THE_WILD,
    MISTAKE_LINKS,
    PageLink,
    check_link_keys,
    flash_questions,
    kv_questions,
    large_batch_mistake,
    live_questions,
    long_answer_mistake,
    recap,
    tokenizer_mistake,
    tour_stops,
    trade_offs,
    whatif_questions,
)

ROOT = Path(__file__).resolve().parent.parent
REG = {"live": "live.py", "whatif": "whatif.py", "prefix-cache": "prefix_cache.py",
       "flash-attention": "flash_attention.py", "kv-cache": "kv_cache.py"}


def _keys(url_path: str) -> list[str]:
    src = (ROOT / "pages" / REG[url_path]).read_text()
    return re.findall(r"""url_param\(\s*["'](\w+)["']""", src)


def _q(qs, key):
    return next(q for q in qs if q.key == key)


def test_whatif_pays_matches_hand_computation():
    # α 0.6, γ 4, c 0.3: E = 1 + .6 + .36 + .216 + .1296 = 2.3056; cost 4·0.3 + 1 = 2.2 → 1.048× > 1
    q = _q(whatif_questions(0.6, 4, 0.3), "pays")
    assert q.options[q.correct].startswith("Yes")
    assert "2.31" in q.explanation and "1.05×" in q.explanation
    # α 0.3, γ 8, c 0.3: E = (1 − .3^9)/.7 ≈ 1.4285; cost 3.4 → 0.42× < 1
    q = _q(whatif_questions(0.3, 8, 0.3), "pays")
    assert q.options[q.correct].startswith("No")
    assert q.is_correct(q.options[1]) and not q.is_correct(q.options[0])


def test_whatif_best_gamma_and_alpha_drop():
    # α 0.6, c 0.3: γ=1 → 1.6/1.3 = 1.2308; γ=2 → 1.96/1.6 = 1.225: best is 1
    qs = whatif_questions(0.6, 4, 0.3)
    q = _q(qs, "best_gamma")
    assert q.options[q.correct] == "γ = 1"
    assert _q(qs, "alpha_drop").options[_q(qs, "alpha_drop").correct] == "It stays the same"  # already 1
    # α 0.9, c 0.05 → best γ well above that of α 0.7 (shorter drafts when agreement drops)
    q = _q(whatif_questions(0.9, 4, 0.05), "alpha_drop")
    assert q.options[q.correct] == "It gets shorter"
    # α = 0 cannot fall: no "from 0.00 to 0.00" question; α = 0.1 falls to 0
    assert all(q.key != "alpha_drop" for q in whatif_questions(0.0, 4, 0.05))
    assert "from 0.10 to 0.00" in _q(whatif_questions(0.1, 4, 0.05), "alpha_drop").prompt


def test_whatif_invalid_input_raises():
    with pytest.raises(InputError):
        whatif_questions(1.5, 4, 0.1)


def test_live_questions():
    qs = live_questions(4, alpha=0.7)
    assert _q(qs, "max_tokens").options[_q(qs, "max_tokens").correct] == "5"      # γ + 1
    assert _q(qs, "all_rejected").options[_q(qs, "all_rejected").correct] == "1"  # the correction
    for g in (1, 2, 4):  # three different choices at every γ (γ = 1 offered "0 / 1 / 1")
        opts = _q(live_questions(g), "all_rejected").options
        assert len(set(opts)) == 3 and opts == ("0", "1", str(g + 1))
    # E(0.7, 4) = 1 + .7 + .49 + .343 + .2401 = 2.7731 > 2.5
    q = _q(qs, "measured_e")
    assert q.options[q.correct] == "more than 2.5" and "2.77" in q.explanation
    assert len(live_questions(4)) == 2
    # every round drafted γ: the same as E at γ
    assert _q(live_questions(4, 0.7, [4, 4]), "measured_e").correct == q.correct
    # prompt lookup drafted 0, 4, 0, 0 tokens: (1 + 2.7731 + 1 + 1) / 4 = 1.4433 < 1.5, not E(0.7, 4) = 2.77
    q = _q(live_questions(4, 0.7, [0, 4, 0, 0]), "measured_e")
    assert q.options[q.correct] == "fewer than 1.5" and "1.44" in q.explanation and "1.0 tokens" in q.prompt


def test_flash_questions():
    qs = flash_questions(64, 192, 2, 16384)
    # S and P: 2·N² elements, so doubling N multiplies them by 4
    q = _q(qs, "extra_memory")
    assert q.options[q.correct] == "4×"
    q = _q(qs, "exact")
    assert q.options[q.correct].startswith("Yes")
    q = _q(qs, "traffic")
    assert q.options[q.correct] == "2× to 8×"  # 7.6× at N 16,384 (engine.explain.flash, Algorithms 0 and 1)


def test_kv_questions_llama():
    qs = kv_questions(model_preset("Llama-3.1-8B"), 8192, 1)
    q = _q(qs, "double_context")
    assert q.options[q.correct] == "It doubles"  # no sliding window: KV ∝ tokens
    q = _q(qs, "mqa")
    assert q.options[q.correct] == "8×"          # 8 KV heads → 1
    # batch 1 → 2: weights (16 GB) dominate the reads, 1 GiB KV per sequence: (16.06+2.15)/(16.06+1.07) ≈ 1.06
    q = _q(qs, "double_batch")
    assert q.options[q.correct].startswith("Less than 1.3")


def test_kv_questions_sliding_window_grows_less_than_double():
    # Mistral-7B: every layer slides with window 4096, so 8192 → 16384 tokens keeps the cache the same
    q = _q(kv_questions(model_preset("Mistral-7B-v0.1 (sliding window)"), 8192, 1), "double_context")
    assert q.options[q.correct] == "It stays the same"
    # Gemma-2: half the layers slide: (21·16384 + 21·4096)/(21·8192 + 21·4096) = 20480/12288 = 1.67×
    q = _q(kv_questions(model_preset("Gemma-2-9B (alternating sliding window)"), 8192, 1), "double_context")
    assert q.options[q.correct] == "It grows, but less than 2×" and "1.67×" in q.explanation


def test_mistakes():
    lb = large_batch_mistake()
    # batch 1: E(0.8, 4) = 3.3616 / (4·0.05 + 1) = 2.8013
    assert lb.speedup_at_1 == pytest.approx(3.3616 / 1.2, rel=1e-9)
    assert lb.crossover_batch is not None and 1 < lb.crossover_batch < 256
    assert lb.speedup_at_large < 1
    la = long_answer_mistake()
    assert la.cached_tokens == 1488  # floor(1500 / 16) · 16
    assert la.decode_ms == pytest.approx(la.total_ms_cached - la.prefill_ms_cached)
    assert 0 < la.saved_share < 0.1
    with pytest.raises(InputError):
        long_answer_mistake(prompt_tokens=10, shared_tokens=20)


def test_tokenizer_mistake_with_word_tokenizers():
    from tests.tiny_models import make_tokenizer

    target = make_tokenizer(["the", "cat", "sat"])
    # the stand-in numbers the words of the text in order: same ids as the target here → accepted
    same = tokenizer_mistake(target, "the cat sat")
    assert same.target_ids == same.draft_ids == [2, 3, 4]
    assert same.engine_error is None and same.draft_ids_read_by_target == "the cat sat"
    # words in another order: the stand-in gives "sat"=2, "cat"=3, "the"=4, so the target reads them reversed
    diff = tokenizer_mistake(target, "sat cat the")
    assert diff.target_ids == [4, 3, 2] and diff.draft_ids == [2, 3, 4]
    assert diff.draft_ids_read_by_target == "the cat sat"
    assert diff.engine_error is not None and "differs" in diff.engine_error


def test_tour_stops_use_real_page_keys():
    stops = tour_stops()
    assert [s.link.url_path for s in stops] == ["live", "whatif", "whatif", "prefix-cache", "flash-attention",
                                                 "kv-cache"]
    for s in stops:
        assert check_link_keys(s.link, _keys(s.link.url_path)) == [], s.title
        assert 1 <= s.text.count(". ") + 1 <= 4  # two or three sentences
    for link in [*MISTAKE_LINKS.values(), *(r.link for r in recap())]:
        assert check_link_keys(link, _keys(link.url_path)) == []


def test_flash_tour_stop_uses_the_pages_units():
    """The FlashAttention page writes traffic in decimal GB/MB (as the paper does); the tour banner over it
    said the same numbers in GiB/MiB ("2.01 GiB" above the page's "2.16 GB")."""
    from engine.explain.flash import format_bytes as flash_bytes
    from engine.explain.flash import standard_traffic

    (stop,) = [s for s in tour_stops() if s.link.url_path == "flash-attention"]
    assert flash_bytes(standard_traffic(16384, 64, 2).bytes) in stop.text
    assert "GiB" not in stop.text and "MiB" not in stop.text


def test_kv_tour_stop_quotes_numbers_the_page_shows():
    """Stop 6 quoted "16 GiB with one KV head per query head", a number its page never shows. Now every
    number is one the page shows at the stop's settings (Llama-3.1-8B, 32,768 tokens, batch 8):
    KV per token 2 · 32 layers · 8 KV heads · 128 · 2 bytes = 128 KiB; × 32,768 = 4 GiB per sequence;
    × 8 = 32 GiB for the batch; MHA (32 KV heads) 4× = 128 GiB; an H100 decode step reads the weights
    (8.03e9 · 2 B = 14.96 GiB) + 32 GiB of KV = 46.96 GiB → "47 GiB"."""
    (stop,) = [s for s in tour_stops() if s.link.url_path == "kv-cache"]
    for part in ("4 query heads", "4 GiB per 32k-token sequence", "32 GiB for the batch of 8", "against 128 GiB",
                 "32 GiB of the 47 GiB an H100 decode step reads"):
        assert part in stop.text, part


def test_trade_offs_and_wild():
    rows = trade_offs()
    assert len(rows) == 6 and {r.page for r in rows} <= {*REG, "mistakes"}
    assert all(r.source and r.example for r in rows)
    assert all(f.source for f in IN_THE_WILD)
    assert {f.engine for f in IN_THE_WILD} == {"vLLM", "SGLang", "TensorRT-LLM", "llama.cpp", "transformers"}


def test_page_link_url():
    assert PageLink("whatif", {"wi_alpha": 0.6, "x": True}).url(present=1) == "whatif?wi_alpha=0.6&x=1&present=1"


def test_spec_methods_2026_each_cited_linked_and_dated():
    from app.registry import PAGES
    from engine.explain.teaching import SPEC_METHODS_2026, WILD_CHECKED

    paths = {p.url_path for p in PAGES}
    assert WILD_CHECKED == "2026-12-01"
    assert {m.engine for m in SPEC_METHODS_2026} == {"vLLM", "SGLang", "llama.cpp", "TensorRT-LLM"}
    for m in SPEC_METHODS_2026:
        assert m.method and m.drafts and m.flag and m.source, m
        assert m.link.url_path in paths, m
        # a line is either verified or says what was not
        assert m.verified == "yes" or len(m.verified) > 20, m
    # llama.cpp's several-kinds line states what the vendored source does: the first draft wins
    several = next(m for m in SPEC_METHODS_2026 if m.engine == "llama.cpp" and m.method == "Several kinds at once")
    assert "FIRST" in several.drafts and "speculative.cpp" in several.source
    # every method name shown once per engine
    keys = [(m.engine, m.method) for m in SPEC_METHODS_2026]
    assert len(keys) == len(set(keys))
