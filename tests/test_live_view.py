"""app.live_view and engine.decoding.measure: Markdown escaping of untrusted token text, round rows/frames, baseline comparison,
the measured-run record; engine.explain.presets."""

from __future__ import annotations

import html
import re
import statistics

import pytest
from markdown_it import MarkdownIt

from app.live_view import (
    NBSP,
    STYLE,
    ZWSP,
    chart_labels,
    chip,
    default_draft_kind,
    escape_markdown,
    focus_position,
    generated_markdown,
    generated_pieces,
    history_rows,
    round_frames,
    round_rows,
    text_span,
    verdict_frame,
    visible,
)
from engine.decoding.measure import compare_baseline, measure_speedup_ab, measured_run
from engine.decoding.trace import DraftPosition, Round, TopToken, run_stats
from engine.errors import InputError
from engine.explain.presets import CUSTOM, PROMPT_PRESETS, preset_text

MD = MarkdownIt("commonmark").enable("strikethrough")

NASTY = ["*bold*", "_em_", "[x](javascript:alert(1))", "<script>alert(1)</script>", "`code`", "$x^2$",
         "# head", "1. item", "a\\b", "~~s~~", ":+1:", "<- -> --", "{foreground=red}", "| a | b |",
         "![img](http://x/y.png)", "&amp; &lt;", "**", "]", "[", "<img src=x onerror=alert(1)>"]


def _rendered_text(md: str) -> str:
    """CommonMark → HTML → the single paragraph's text (zero-width spaces removed, entities decoded)."""
    out = MD.render(md)
    m = re.fullmatch(r"<p>(.*)</p>\n", out, flags=re.S)
    assert m, out  # exactly one paragraph: no heading, list, code block, table
    inner = m.group(1)
    assert "<" not in inner.replace("&lt;", ""), out  # no HTML tag of any kind (no <em>, <a>, <code>, <script>)
    return html.unescape(inner).replace(ZWSP, "")


@pytest.mark.parametrize("s", NASTY)
def test_escape_markdown_renders_literally(s):
    assert _rendered_text(escape_markdown(s)) == s


def test_escape_markdown_details():
    # every ASCII punctuation gets one backslash; letters, digits, spaces, non-ASCII are untouched
    assert escape_markdown("a*b") == "a\\*b"
    assert escape_markdown("é 1 ß") == "é 1 ß"
    assert escape_markdown("$") == "\\$"          # Streamlit's LaTeX switch is escaped as documented
    assert escape_markdown(":") == "\\:" + ZWSP    # shortcodes / arrows cannot form across a ZWSP
    assert escape_markdown("]") == "\\]"          # cannot close a :color[...] directive early


def test_visible_whitespace():
    assert visible("\n") == "↵"
    assert visible("  ") == "␣␣"
    assert visible("\t") == "⇥"
    assert visible("") == "∅"
    assert visible(" the") == " the"


def test_chip_and_strike():
    assert chip("*", "green-background") == ":green-background[\\*]"
    assert chip("x", "red-background", strike=True) == ":red-background[~~x~~]"
    # a leading space stays outside the ~~ (GFM does not open a strikethrough before a space)
    assert chip(" area", "gray", strike=True) == ":gray[ ~~area~~]"
    for tok in (" area", "x ", "*", " _a_ ", "~"):
        inner = chip(tok, "gray", strike=True)[len(":gray["):-1]
        out = MD.render(inner)
        assert "<s>" in out and "~~" not in out.replace("\\~", ""), (tok, out)
    # a newline token is shown as ↵ inside one span (the span never breaks the line)
    assert chip("\n", "gray") == ":gray[↵]"


def test_text_span_keeps_lines_and_indentation():
    # "a\nb" → span(a), visible ↵ with a hard break (two spaces + newline), span(b)
    assert text_span("a\nb", "green-background") == \
        ":green-background[a]:green-background[↵]  \n:green-background[b]"
    # 4 spaces → 3 NBSP + 1 space (a run of spaces would otherwise collapse to one)
    assert text_span("x    y", "gray") == f":gray[x{NBSP * 3} y]"
    # a whitespace-only token keeps its width
    assert text_span("   ", "gray") == f":gray[{NBSP * 3}]"


def _pos(tok, text, verdict, q=0.5, p=0.25, acc=0.5, u=0.7):
    return DraftPosition(token_id=tok, text=text, q=q, p=p, accept_prob=acc, u=u, verdict=verdict,
                         top_p=[TopToken(tok, text, p)], top_q=[TopToken(tok, text, q)])


def _round(index=0):
    # draft "<b>", "x", "y": first accepted, second rejected (correction "Z"), third discarded
    drafted = [_pos(5, "<b>", "accepted", q=0.4, p=0.6, acc=1.0, u=0.3),
               _pos(6, "x", "rejected", q=0.5, p=0.1, acc=0.2, u=0.9),
               _pos(7, "y", "discarded", acc=None, u=None)]
    return Round(index=index, context_len=10, drafted=drafted, n_accepted=1, next_token_id=9, next_text="Z",
                 next_kind="correction", next_top_p=[TopToken(9, "Z", 0.5)],
                 residual_top=[TopToken(9, "Z", 0.8)], emitted_ids=[5, 9], draft_ms=3.0, verify_ms=20.0,
                 tokens_verified=4)


def test_round_frames_animate_then_judge():
    rnd = _round()
    frames = round_frames(rnd)
    assert len(frames) == 4  # 3 draft tokens appear one by one, then the verdict
    assert frames[0].count(f":{STYLE['draft']}[") == 1 and frames[0].endswith("…")
    assert frames[2].count(f":{STYLE['draft']}[") == 3
    v = verdict_frame(rnd)
    assert ":green-background[\\<" in v                      # accepted, escaped
    assert ":red-background[~~x~~] → :orange-background[Z]" in v  # struck through, correction beside it
    assert ":gray[~~y~~]" in v                                 # discarded
    assert "<b>" not in v


def test_verdict_frame_bonus_and_plain():
    bonus = Round(index=0, context_len=3, drafted=[_pos(5, "a", "accepted", acc=1.0)], n_accepted=1,
                  next_token_id=8, next_text="b", next_kind="bonus", next_top_p=[], residual_top=None,
                  emitted_ids=[5, 8], draft_ms=1, verify_ms=2, tokens_verified=2)
    assert ":blue-background[b] :blue[(bonus)]" in verdict_frame(bonus)
    plain = Round(index=0, context_len=3, drafted=[], n_accepted=0, next_token_id=8, next_text="b",
                  next_kind="plain", next_top_p=[], residual_top=None, emitted_ids=[8], draft_ms=0,
                  verify_ms=2, tokens_verified=1)
    assert ":gray-background[b]" in verdict_frame(plain)
    assert len(round_frames(plain)) == 2


def test_round_rows_and_history():
    rows = round_rows(_round())
    assert [r["verdict"] for r in rows] == ["accepted", "rejected", "discarded"]
    assert rows[1] == {"position": 2, "token": "x", "id": 6, "q(x)": 0.5, "p(x)": 0.1, "min(1, p/q)": "0.2000",
                       "u": "0.9000", "verdict": "rejected"}
    assert rows[2]["min(1, p/q)"] == "—" and rows[2]["u"] == "—"  # not evaluated: no "None" in the table
    g = round_rows(_round(), greedy=True)
    assert "u" not in g[0] and [r["argmax of p?"] for r in g] == ["yes", "no", "—"]
    h = history_rows([_round(0), _round(1)])
    assert [r["round"] for r in h] == [1, 2]
    assert h[0]["emitted"] == 2 and h[0]["accepted"] == 1 and h[0]["target token"] == "correction"
    assert focus_position(_round()) == 1  # the rejected position


def test_generated_pieces_and_markdown():
    names = {5: "<b>", 9: "Z"}
    pieces = generated_pieces([_round()], names.get)
    assert pieces == [("<b>", "accepted"), ("Z", "correction")]
    md = generated_markdown(pieces)
    assert md == ":green-background[\\<\u200bb\\>\u200b]:orange-background[Z]"
    # consecutive tokens of one origin share a span: "a" + " b" accepted, then "c" correction
    assert generated_markdown([("a", "accepted"), (" b", "accepted"), ("c", "correction")]) == \
        ":green-background[a b]:orange-background[c]"


def test_chart_labels_escape_and_dedupe():
    labs = chart_labels([TopToken(1, "<a>", 0.5), TopToken(2, " ", 0.3), TopToken(3, " ", 0.2)])
    assert labs == ["&lt;a&gt;", "␣ #2", "␣ #3"]
    # a user's report: newline tokens with and without a space all read "↵" on the axis
    labs = chart_labels([TopToken(1, "\n", 0.4), TopToken(2, " \n", 0.3), TopToken(3, "\n ", 0.2),
                         TopToken(4, "\n\n", 0.05), TopToken(5, " the", 0.03), TopToken(6, "the", 0.02)])
    assert labs == ["↵", "␣↵", "↵␣", "↵↵", "␣the", "the"]


def _stats(new_tokens, total_ms, judged_acc=(3, 4)):
    # one round per token: emitted ids of length 1; judged/accepted from two draft positions
    acc, judged = judged_acc
    rounds = []
    for i in range(new_tokens):
        drafted = []
        if i == 0:
            drafted = [_pos(1, "a", "accepted")] * acc + [_pos(1, "a", "rejected")] * (judged - acc)
        rounds.append(Round(index=i, context_len=1, drafted=drafted, n_accepted=acc if i == 0 else 0,
                            next_token_id=1, next_text="a", next_kind="plain", next_top_p=[], residual_top=None,
                            emitted_ids=[1], draft_ms=1.0, verify_ms=10.0, tokens_verified=1))
    return run_stats(rounds, prefill_ms=0.0, total_ms=total_ms)


def test_compare_baseline_speedup():
    # same 10 tokens: baseline 1000 ms, speculative 400 ms → 1000 / 400 = 2.5×
    c = compare_baseline([1] * 10, _stats(10, 400.0), [1] * 10, _stats(10, 1000.0))
    assert c.speedup == pytest.approx(2.5)
    assert c.identical and c.same_length and c.first_difference is None
    # per-token when lengths differ: baseline 1000 ms / 10 = 100 ms/token; spec 400 ms / 8 = 50 → 2×
    c = compare_baseline([1] * 7 + [2], _stats(8, 400.0), [1] * 10, _stats(10, 1000.0))
    assert c.speedup == pytest.approx(2.0)
    assert not c.identical and c.first_difference == 7


class _FakeDecoder:
    """Stands in for a SpeculativeDecoder: fixed tokens and a fixed total time per run."""

    def __init__(self, kind, ids, total_ms, log):
        self.kind, self.new_ids, self.total_ms, self.log = kind, list(ids), total_ms, log

    def run(self):
        self.log.append(self.kind)

    def stats(self):
        return _stats(len(self.new_ids), self.total_ms)


def test_measure_speedup_ab_alternates_and_takes_medians():
    """A B B A A B …; ms per token per run; speedup = median baseline ÷ median speculative (hand-computed)."""
    log, progress = [], []
    spec_ms = iter([400.0, 500.0, 900.0])  # 10 tokens: 40, 50, 90 ms/token → median 50
    base_ms = iter([1000.0, 1200.0, 800.0])  # 10 tokens: 100, 120, 80 ms/token → median 100
    ab = measure_speedup_ab(lambda: _FakeDecoder("spec", [1] * 10, next(spec_ms), log),
                            lambda: _FakeDecoder("base", [1] * 10, next(base_ms), log), reps=3,
                            on_progress=lambda done, total, kind: progress.append((done, total, kind)))
    assert ab.order == log == ["spec", "base", "base", "spec", "spec", "base"]
    assert progress == [(i, 6, k) for i, k in enumerate(ab.order)]
    assert ab.spec_ms_per_token == [40.0, 50.0, 90.0] and ab.base_ms_per_token == [100.0, 120.0, 80.0]
    assert ab.reps == 3 and ab.speedup == pytest.approx(2.0)
    # the stats kept are the median runs': spec 500 ms (of 400, 500, 900), base 1000 ms (of 1000, 1200, 800)
    assert (ab.spec_stats.total_ms, ab.base_stats.total_ms) == (500.0, 1000.0)
    assert ab.spread == pytest.approx(90 / 40)  # slowest ÷ fastest, the larger of the two kinds
    c = ab.comparison()
    assert c.speedup == pytest.approx(2.0) and c.identical and c.first_difference is None
    assert c.spec_tokens_per_s == pytest.approx(20.0) and c.base_tokens_per_s == pytest.approx(10.0)
    # the drawn run's tokens are what is compared with the baseline
    c = ab.comparison([1] * 4 + [2] * 6)
    assert not c.identical and c.first_difference == 4 and c.same_length
    with pytest.raises(ValueError, match="reps"):
        measure_speedup_ab(lambda: None, lambda: None, reps=0)


def test_measure_speedup_ab_on_a_real_model(tmp_path):
    """On a tiny model: the timed speculative runs repeat the same tokens, the baseline matches them
    (greedy), and the speedup is the ratio of the median ms per token."""
    from engine.decoding.models import load_model
    from engine.decoding.drafts import make_proposer
    from engine.decoding.speculative import SpeculativeDecoder
    from tests.tiny_models import save_tiny_llama

    target = load_model(str(save_tiny_llama(tmp_path / "t", vocab_size=32, layers=2)), device="cpu")
    ids = [5, 6, 7, 8, 5, 6, 7]
    ab = measure_speedup_ab(
        lambda: SpeculativeDecoder(target, make_proposer("ngram", target), ids, gamma=3, max_new_tokens=10),
        lambda: SpeculativeDecoder(target, None, ids, max_new_tokens=10), reps=2)
    assert ab.spec_ids == ab.base_ids and 1 <= len(ab.spec_ids) <= 10
    assert ab.spec_stats.drafted > 0 and ab.base_stats.drafted == 0
    assert ab.speedup == pytest.approx(statistics.median(ab.base_ms_per_token) /
                                       statistics.median(ab.spec_ms_per_token))


def test_draft_cost_leaves_out_the_drafts_prefill_round():
    """c leaves out the first drafting round (the draft also ran over the prompt then), keeps rounds that
    proposed nothing, and falls back to the only drafting round when there is no other."""
    def rnd(i, n_drafted, draft_ms):
        return Round(index=i, context_len=5, drafted=[_pos(1, "a", "accepted")] * n_drafted, n_accepted=n_drafted,
                     next_token_id=1, next_text="a", next_kind="bonus", next_top_p=[], residual_top=None,
                     emitted_ids=[1] * (n_drafted + 1), draft_ms=draft_ms, verify_ms=10.0,
                     tokens_verified=n_drafted + 1)
    s = run_stats([rnd(0, 2, 50.0), rnd(1, 2, 2.0), rnd(2, 0, 0.5)], prefill_ms=0.0, total_ms=100.0)
    # (2 ms + 0.5 ms) / 2 draft tokens = 1.25 ms per token; ÷ median verify 10 ms = 0.125
    assert s.draft_ms_per_token == pytest.approx(1.25)
    assert s.draft_cost_ratio == pytest.approx(0.125)
    only = run_stats([rnd(0, 2, 50.0), rnd(1, 0, 1.0)], prefill_ms=0.0, total_ms=100.0)
    assert only.draft_ms_per_token == pytest.approx(25.5)  # (50 + 1) / 2: nothing else to go by


def test_draft_cost_uses_the_median_pass_and_passes_count_a_separate_prefill():
    """A user's report: a busy machine's few slow passes (900-3,200 ms among ~40 ms ones) moved c with the
    mean pass time; and the draft head's run, whose prompt prefill is a pass of its own, reported
    tokens per pass over its rounds only."""
    def rnd(i, verify_ms, prefill_tokens=0, tokens_verified=2):
        return Round(index=i, context_len=5, drafted=[_pos(1, "a", "accepted")], n_accepted=1,
                     next_token_id=1, next_text="a", next_kind="bonus", next_top_p=[], residual_top=None,
                     emitted_ids=[1, 1], draft_ms=4.0, verify_ms=verify_ms, tokens_verified=tokens_verified,
                     prefill_tokens=prefill_tokens)
    rounds = [rnd(0, 40.0), rnd(1, 40.0), rnd(2, 3200.0), rnd(3, 40.0), rnd(4, 41.0)]
    s = run_stats(rounds, prefill_ms=50.0, total_ms=1000.0)
    assert s.verify_ms_median == 40.0 and s.verify_ms_mean == pytest.approx(672.2)
    assert s.draft_cost_ratio == pytest.approx(4.0 / 40.0)  # 4 ms per draft token ÷ the median pass
    # prefill as a pass of its own (no round fused it): 5 rounds + 1 prefill = 6 passes for 10 tokens
    assert s.target_passes == 6 and s.tokens_per_target_pass == pytest.approx(10 / 6)
    # per round (one verify pass each, what Eq. 1's E counts): 10 tokens in 5 rounds, whatever the prefill did
    assert s.tokens_per_round == 2.0 and run_stats(rounds[:1], prefill_ms=50.0, total_ms=50.0).tokens_per_round == 2.0
    # fused into round 0's verify pass: 5 passes
    fused = run_stats([rnd(0, 90.0, prefill_tokens=30)] + rounds[1:], prefill_ms=90.0, total_ms=1000.0)
    assert fused.target_passes == 5 and fused.tokens_per_target_pass == 2.0
    # plain decoding: the first round had no pass (the prefill gave its token): still one pass per token
    plain = [Round(index=i, context_len=5, drafted=[], n_accepted=0, next_token_id=1, next_text="a",
                   next_kind="plain", next_top_p=[], residual_top=None, emitted_ids=[1], draft_ms=0.0,
                   verify_ms=10.0, tokens_verified=int(i > 0)) for i in range(4)]
    ps = run_stats(plain, prefill_ms=10.0, total_ms=100.0)
    assert ps.target_passes == 4 and ps.tokens_per_target_pass == 1.0 and ps.tokens_per_round == 1.0
    assert run_stats([], prefill_ms=0.0, total_ms=0.0).tokens_per_round is None


def test_measured_run_record():
    s = _stats(4, 100.0)
    rec = measured_run(s, gamma=4, measured_speedup=1.5)
    # α̂ = 3 accepted ÷ 4 judged = 0.75; c = (4 × 1 ms / 4 drafted) ÷ median verify 10 ms = 0.1
    assert rec.acceptance_rate == pytest.approx(0.75)
    assert rec.draft_cost_ratio == pytest.approx(0.1)
    assert rec.verify_ms_by_tokens == {1: 10.0}
    assert rec.measured_speedup == 1.5 and rec.gamma == 4
    assert measured_run(s, 4, float("nan")).measured_speedup is None
    assert measured_run(_stats(2, 10.0, (0, 0)), 4, None) is None  # nothing judged yet
    assert rec.draft_ms_per_token == pytest.approx(1.0)


def test_measured_run_takes_t1_from_the_baseline():
    from engine.decoding.trace import run_stats

    spec = _stats(4, 100.0)
    base = run_stats([Round(index=i, context_len=5 + i, drafted=[], n_accepted=0, next_token_id=1, next_text="x",
                            next_kind="plain", next_top_p=[], residual_top=None, emitted_ids=[1], draft_ms=0.0,
                            verify_ms=ms, tokens_verified=1) for i, ms in enumerate([7.0, 8.0, 30.0])],
                     prefill_ms=0.0, total_ms=45.0)
    rec = measured_run(spec, gamma=4, measured_speedup=1.2, base_stats=base)
    assert rec.verify_ms_by_tokens[1] == 8.0  # the baseline's median decode step


def test_default_draft_kind_follows_assets_and_flag(tmp_path, monkeypatch):
    import engine.decoding.models as models

    monkeypatch.setattr(models, "EMBEDDED_HEAD_IS_DEFAULT", False)
    monkeypatch.setattr(models, "EMBEDDED_DRAFT_DIR", tmp_path)
    monkeypatch.setattr(models, "EMBEDDED_DRAFT_IS_DEFAULT", True)
    assert default_draft_kind() == "ngram"  # not shipped
    (tmp_path / "config.json").write_text("{}")
    assert default_draft_kind() == "draft"
    monkeypatch.setattr(models, "EMBEDDED_DRAFT_IS_DEFAULT", False)  # shipped but not yet faster
    assert default_draft_kind() == "ngram"
    head_dir = tmp_path / "head"
    monkeypatch.setattr(models, "EMBEDDED_HEAD_DIR", head_dir)
    monkeypatch.setattr(models, "EMBEDDED_HEAD_IS_DEFAULT", True)
    assert default_draft_kind() == "ngram"  # head not shipped
    head_dir.mkdir()
    (head_dir / "head_config.json").write_text("{}")
    assert default_draft_kind() == "head"
    monkeypatch.setattr(models, "EMBEDDED_HEAD_IS_DEFAULT", False)
    assert default_draft_kind() == "ngram"
    monkeypatch.setattr(models, "EMBEDDED_HEAD_IS_DEFAULT", True)
    assert models.default_draft_spec("some/other-model") == "ngram"  # the head is the embedded target's
    assert models.default_gamma("embedded-head") == models.EMBEDDED_HEAD_GAMMA and models.default_gamma("ngram") == 4


def test_presets():
    assert set(PROMPT_PRESETS) == {"chat", "code", "summary"}
    code = preset_text("code")
    assert "def area(w, h):" in code and "`area`" in code  # quotes the code it asks to edit
    assert "Gutenberg" in preset_text("summary")
    with pytest.raises(InputError):
        preset_text(CUSTOM)


def test_round_summary_counts():
    from app.live_view import round_summary

    s = round_summary(_round())
    # 3 drafted, 1 accepted, 2 emitted (accepted + correction), 4 tokens fed to the target
    assert s.startswith("Round 1: 3 drafted, 1 accepted, 2 emitted — the target corrected")
    assert "Draft 3.0 ms, verify 20.0 ms (4 tokens in the target pass)." in s


def test_measured_run_feeds_the_whatif_comparison():
    from engine.explain.analytic import compare_with_measured, expected_tokens_per_pass

    rec = measured_run(_stats(4, 100.0), gamma=4, measured_speedup=1.5)
    mc = compare_with_measured(rec)
    # α = 0.75, γ = 4: E = 1 + 0.75 + 0.5625 + 0.421875 + 0.31640625 = 3.05078125
    assert mc.tokens_per_pass == pytest.approx(3.05078125)
    assert mc.tokens_per_pass == pytest.approx(expected_tokens_per_pass(0.75, 4))
    assert (mc.alpha, mc.gamma, mc.c, mc.measured) == (0.75, 4, pytest.approx(0.1), 1.5)


def test_round_summary_of_a_round_without_a_target_pass():
    from app.live_view import round_summary

    rnd = Round(index=0, context_len=5, drafted=[], n_accepted=0, next_token_id=9, next_text="Z",
                next_kind="plain", next_top_p=[TopToken(9, "Z", 0.5)], residual_top=None, emitted_ids=[9],
                draft_ms=0.0, verify_ms=0.0, tokens_verified=0)
    assert round_summary(rnd) == ("Round 1: 0 drafted, 1 emitted — no target pass: the prompt's prefill pass "
                                  "already gave p for this token.")


def test_round_summary_of_a_pass_that_also_prefilled_the_prompt():
    from app.live_view import round_summary

    rnd = Round(index=0, context_len=5, drafted=[_pos(5, "a", "accepted", acc=1.0)], n_accepted=1,
                next_token_id=8, next_text="b", next_kind="bonus", next_top_p=[], residual_top=None,
                emitted_ids=[5, 8], draft_ms=1.0, verify_ms=20.0, tokens_verified=6, prefill_tokens=5)
    assert round_summary(rnd) == ("Round 1: 1 drafted, 1 accepted, 2 emitted — all accepted, the target added a "
                                  "bonus token. Draft 1.0 ms, verify 20.0 ms (6 tokens in the target pass, 5 of "
                                  "them the prompt: this pass was also the prefill).")


def test_round_summary_of_a_first_pass_after_the_prefill():
    """After a separate prefill pass, the first verify pass feeds only the draft tokens (the prefill gave p
    for the first one); later passes also feed the last emitted token."""
    from app.live_view import round_summary

    def rnd(fed):
        return Round(index=0, context_len=5, drafted=[_pos(5, "a", "accepted", acc=1.0)] * 2, n_accepted=2,
                     next_token_id=8, next_text="b", next_kind="bonus", next_top_p=[], residual_top=None,
                     emitted_ids=[5, 5, 8], draft_ms=1.0, verify_ms=20.0, tokens_verified=fed)
    assert round_summary(rnd(2)).endswith("(2 tokens in the target pass: only the draft tokens, since the "
                                          "prefill pass already gave p for the first one).")
    assert round_summary(rnd(3)).endswith("(3 tokens in the target pass).")


def _profile_rounds():
    """Four rounds of a prompt-lookup-like run: a fused prefill pass, a round without a draft, a full
    acceptance, a rejection at position 2."""
    def rnd(i, verdicts, tv, draft_ms, verify_ms, prefill_tokens=0):
        drafted = [_pos(1, "a", v) for v in verdicts]
        n_acc = sum(v == "accepted" for v in verdicts)
        kind = "plain" if not verdicts else "bonus" if n_acc == len(verdicts) else "correction"
        return Round(index=i, context_len=10, drafted=drafted, n_accepted=n_acc, next_token_id=1, next_text="a",
                     next_kind=kind, next_top_p=[], residual_top=None, emitted_ids=[1] * (n_acc + 1),
                     draft_ms=draft_ms, verify_ms=verify_ms, tokens_verified=tv, prefill_tokens=prefill_tokens)
    return [rnd(0, ["accepted", "accepted", "rejected"], 13, 5.0, 80.0, prefill_tokens=10),
            rnd(1, [], 1, 0.5, 20.0),
            rnd(2, ["accepted", "accepted"], 3, 1.5, 25.0),
            rnd(3, ["accepted", "rejected", "discarded", "discarded"], 5, 2.0, 30.0)]


def test_run_profile_by_hand():
    from engine.decoding.measure import run_profile

    rounds = _profile_rounds()
    spec = run_stats(rounds, prefill_ms=80.0, total_ms=200.0)
    # c leaves out the first drafting round: (0.5 + 1.5 + 2.0) ms / (0 + 2 + 4) tokens = 2/3 ms
    assert spec.draft_ms_per_token == pytest.approx(2 / 3)
    base = run_stats([Round(index=i, context_len=10 + i, drafted=[], n_accepted=0, next_token_id=1, next_text="a",
                            next_kind="plain", next_top_p=[], residual_top=None, emitted_ids=[1], draft_ms=0.0,
                            verify_ms=ms, tokens_verified=int(i > 0)) for i, ms in enumerate([0.0, 8.0, 10.0])],
                     prefill_ms=30.0, total_ms=60.0)
    p = run_profile(rounds, spec, base)
    assert p["new_tokens"] == 9 and p["n_rounds"] == 4  # 3 + 1 + 3 + 2 emitted
    assert p["draft_length_counts"] == {0: 1, 2: 1, 3: 1, 4: 1}
    # the fused pass (13 tokens: 10 of them the prompt) stands for a pass over its 3 drafts + 1
    assert p["verify_tokens_counts"] == {1: 1, 3: 1, 4: 1, 5: 1} and p["prefill_round_tokens"] == 4
    # position 1: judged in rounds 0, 2, 3, all accepted; position 2: accepted in 0 and 2, rejected in 3;
    # position 3: rejected in round 0 (round 3's positions 3-4 were discarded, not judged)
    assert p["judged_by_position"] == [3, 3, 1]
    assert p["acceptance_by_position"] == pytest.approx([1.0, 2 / 3, 0.0])
    # the first drafting round's draft time beyond c: 5.0 − 3 × 2/3 = 3.0 ms
    assert p["draft_prefill_ms"] == pytest.approx(3.0)
    # 200 − 80 (prefill = round 0's pass) − 9 (Σ draft) − 75 (Σ other passes) = 36 ms over 4 rounds
    assert p["overhead_ms_per_round"] == pytest.approx(9.0)
    # baseline: 60 − 30 prefill − 2 passes × 9 ms mean = 12 ms over 3 rounds
    assert (p["base_new_tokens"], p["base_prefill_ms"]) == (3, 30.0)
    assert p["base_overhead_ms_per_round"] == pytest.approx(4.0)
    assert run_profile(rounds, spec)["base_prefill_ms"] is None
    rec = measured_run(spec, 4, 1.3, base, rounds=rounds)
    assert rec.draft_length_counts == p["draft_length_counts"] and rec.verify_ms_by_tokens[1] == 9.0
    assert not hasattr(measured_run(spec, 4, 1.3, base), "draft_length_counts")  # no rounds, no profile


def test_room_lines_from_room_stats():
    from app.live_view import room_lines
    from engine.decoding.scheduler import RoomStats

    s = RoomStats(readers_now=14, last_pass_rows=12, rows_per_pass=11.54, tokens_per_s=23.456, passes=40,
                  no_draft_above=None, max_rows=32, threads=2, stack_share=0.05)
    out = room_lines(s)
    assert [(m[0], m[1]) for m in out["metrics"]] == [("Readers decoding", "14"), ("Rows per pass", "11.5"),
                                                      ("Room tokens/s", "23.5")]
    assert out["caption"] == "The last target pass served 12 readers."
    one = room_lines(RoomStats(1, 1, 1.0, 5.0, 1, 8, 32, 2, None))
    assert one["caption"].startswith("The last target pass served 1 reader. Operator setting: drafting is off "
                                     "in passes of more than 8 readers (SPEEDUP_LAB_NO_DRAFT_ABOVE)")
    empty = room_lines(RoomStats(0, 0, None, None, 0, None, 32, 2, None))
    assert [m[1] for m in empty["metrics"]] == ["0", "—", "—"]
    assert empty["caption"] == "No target pass has run in this room yet."
    from engine.decoding.draft_policy import BandRates

    plain = room_lines(RoomStats(16, 16, 16.0, 390.0, 30, None, 32, 2, 0.03,
                                 drafting=BandRates(16, 14.96, 25.0, False)))
    assert plain["caption"] == (
        "The last target pass served 16 readers. At about 16 readers per pass drafting gave 0.60× the tokens per second of "
        "plain passes (measured on this room's recent passes), so the room does not draft. Greedy texts are the same "
        "either way; a sampled text from a pass without drafting is another sample of the same distribution, not the "
        "text alone (under the drafter-invariant sampling rule it is the text alone).")
    assert room_lines(RoomStats(2, 2, 2.0, 50.0, 3, None, 32, 2, None, drafting=BandRates(2, None, None, True)))[
        "caption"].endswith("At about 2 readers per pass the room is still measuring whether drafting pays (drafting now).")
    dated = room_lines(s, as_of="21:52:03")
    assert dated["caption"] == ("The last target pass served 12 readers. As of 21:52:03 (server clock); any click "
                                "updates these numbers.")


def test_room_panel_says_what_the_self_check_found():
    """The panel's promise about each reader's text follows the machine's self-check: "checking" while it runs,
    bit for bit where it held, up to rounding (with the reason) where it did not; nothing without a check."""
    from app.live_view import CHECKING, room_lines
    from engine.decoding.invariance import InvarianceCheck
    from engine.decoding.scheduler import RoomStats

    s = RoomStats(2, 2, 2.0, 5.0, 3, None, 32, 2, None)
    assert "Checking on this machine" in room_lines(s, invariance=CHECKING)["caption"]
    ok = InvarianceCheck(holds=True, by_construction=True, attention="kernel", readers=3, rounds=21,
                         shared_passes=7, cpu="AMD EPYC")
    assert room_lines(s, invariance=ok)["caption"] == (
        "The last target pass served 2 readers. Each reader's text in the room: bit for bit equal to alone, checked "
        "here (3 readers greedy and sampled, 21 rounds, 7 shared passes on AMD EPYC).")
    bad = InvarianceCheck(holds=False, by_construction=False, attention="not invariant", readers=3, rounds=21,
                          shared_passes=7, reason="the target runs on CUDA")
    assert ("equal to alone up to rounding here: the target runs on CUDA; a token can then differ from alone only "
            "at a near tie.") in room_lines(s, invariance=bad)["caption"]
    assert "alone" not in room_lines(s)["caption"]


def test_room_progress_line_carries_the_panels_numbers():
    from app.live_view import room_progress_line
    from engine.decoding.scheduler import RoomStats

    s = RoomStats(readers_now=14, last_pass_rows=12, rows_per_pass=11.54, tokens_per_s=23.456, passes=40,
                  no_draft_above=None, max_rows=32, threads=2, stack_share=0.05)
    assert room_progress_line(s) == "room: 14 readers now, 11.5 rows per pass, 23.5 tokens/s"
    one = RoomStats(1, 1, None, None, 0, None, 32, 2, None)
    assert room_progress_line(one) == "room: 1 reader now, — rows per pass, — tokens/s"


def test_finished_line_says_what_the_run_bought_on_the_first_screen():
    from types import SimpleNamespace

    from app.live_view import finished_line

    stats = SimpleNamespace(rounds=40, tokens_per_round=1.6, acceptance_rate=0.5833)
    before = finished_line(64, "40 rounds", "max tokens", stats)
    assert before == ("Finished (max tokens): 64 tokens in 40 rounds, **1.60** tokens per round (α̂ 0.58). "
                      "**Run baseline** times it against plain decoding.")
    cmp = SimpleNamespace(speedup=1.1749, identical=True)
    assert finished_line(64, "40 rounds", "max tokens", stats, cmp).endswith(
        "Measured speedup **1.17×** against plain decoding, identical texts.")
    sampled = SimpleNamespace(speedup=0.96, identical=False)
    assert "**0.96×** against plain decoding, different texts (sampling draws differ)" in finished_line(
        64, "40 rounds", "max tokens", stats, sampled)
    assert finished_line(12, "12 rounds", "end of text", SimpleNamespace(rounds=12, tokens_per_round=1.0,
                                                                         acceptance_rate=None), plain=True) == \
        "Finished (end of text): 12 tokens in 12 rounds."


def test_finished_line_calls_a_noisy_or_impossible_speedup_unsure():
    from types import SimpleNamespace

    from app.live_view import finished_line, finished_unsure

    stats = SimpleNamespace(rounds=41, tokens_per_round=1.56, acceptance_rate=0.575)
    over = finished_line(64, "41 rounds", "max tokens", stats, SimpleNamespace(speedup=1.64, identical=True))
    assert finished_unsure(over) and "above the 1.56 tokens a round gave" in over
    busy = finished_line(64, "41 rounds", "max tokens", stats, SimpleNamespace(speedup=1.2, identical=True),
                         spread=2.14, noisy=True)
    assert finished_unsure(busy) and "differed by up to 2.1×" in busy and "above the" not in busy
    calm = finished_line(64, "41 rounds", "max tokens", stats, SimpleNamespace(speedup=1.2, identical=True),
                         spread=1.05)
    assert not finished_unsure(calm)


def test_back_to_back_corrections_keep_their_own_spans():
    """Two rounds ending in a correction each (a reader saw "Limit screen" as one orange token)."""
    md = generated_markdown([("1", "accepted"), (".", "accepted"), (" Limit", "correction"),
                             (" screen", "correction"), (" time", "accepted"), (" before", "bonus"),
                             (" bed", "bonus")])
    assert md == (":green-background[1\\.]:orange-background[ Limit]:orange-background[ screen]"
                  ":green-background[ time]:blue-background[ before]:blue-background[ bed]")


def test_a_finished_run_opens_its_last_round_that_drafted():
    from app.live_view import round_to_show

    def plain(i):
        return Round(index=i, context_len=3, drafted=[], n_accepted=0, next_token_id=8, next_text="b",
                     next_kind="plain", next_top_p=[], residual_top=None, emitted_ids=[8], draft_ms=0,
                     verify_ms=2, tokens_verified=1)

    rounds = [_round(0), _round(1), plain(2)]
    assert round_to_show(rounds, finished=False) == (rounds[2], None)  # a run still going shows its latest round
    shown, why = round_to_show(rounds, finished=True)
    assert shown is rounds[1] and why.startswith("Round 2 is shown, the last that drafted") and "final round, 3," in why
    assert round_to_show(rounds[:2], finished=True) == (rounds[1], None)  # the last drafted: itself
    only_plain = [plain(0), plain(1)]
    assert round_to_show(only_plain, finished=True) == (only_plain[1], None)  # plain decoding: nothing else to show


def test_choice_line_rows_and_history_of_an_adaptive_round():
    from dataclasses import replace

    from app.live_view import choice_line, choice_rows
    from engine.decoding.draft_length import LengthChoice

    fixed = _round()
    assert choice_line(fixed) is None and choice_rows(fixed) == []
    assert "drafted by" not in history_rows([fixed])[0]
    c = LengthChoice(source="draft head", k=3, gamma_max=6, confidence=[0.9, 0.7, 0.6, 0.2],
                     acceptance=[0.85, 0.66, 0.57, 0.19], expected_tokens=2.7, cost=1.6, expected_speedup=1.69,
                     next_speedup=1.55, stopped="gain", alternatives={"draft head": 1.4, "prompt lookup": 1.2})
    rnd = replace(fixed, choice=c)
    line = choice_line(rnd)
    assert line.startswith("**Draft length:**") and "drafted 3" in line and "1.69×" in line
    assert "one more (â = 0.19) would give 1.55×" in line and "prompt lookup 1.20×" in line
    rows = choice_rows(rnd)
    assert [r["drafted?"] for r in rows] == ["yes", "yes", "yes", "no: did not pay"]
    assert rows[0]["drafted by"] == "draft head" and rows[3]["â (rule's estimate)"] == 0.19
    plain = replace(fixed, choice=replace(c, k=0, stopped="plain", acceptance=[0.1], confidence=[0.1],
                                          next_speedup=0.9, alternatives={}))
    h = history_rows([fixed, rnd, plain])
    assert [r["drafted by"] for r in h] == ["—", "draft head", "— (plain step)"]
    assert h[1]["expected ×"] == 1.69 and "plain step" in choice_line(plain)
