"""AppTest for pages/live.py: step a round, run to the end, baseline, reset, URL state and bad inputs on a
tiny random Llama; one slow test on the embedded model with prompt lookup."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.live_view import default_preset
from engine.explain.presets import CUSTOM, PROMPT_PRESETS, preset_text
from tests.tiny_models import WORDS, save_tiny_llama

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "live.py")
PROMPT = " ".join(WORDS[:10] * 3)  # repeats itself: prompt lookup finds matches


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("live") / "tiny", layers=2))


def _app(target: str, prompt: str | None = PROMPT, **params) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.query_params["lv_target"] = target
    at.query_params.update({"lv_draft": "ngram", "lv_max_new": "12", **{k: str(v) for k, v in params.items()}})
    if prompt is not None:
        at.session_state["lv_prompt"] = prompt
    at.run()
    assert not at.exception, at.exception
    return at


def _click(at: AppTest, key: str) -> AppTest:
    at.button(key=key).click().run()
    assert not at.exception, at.exception
    return at


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def _markdown(at: AppTest) -> str:
    return "\n".join(m.value for m in at.markdown)


def test_step_one_round(tiny):
    at = _app(tiny)
    assert not at.error
    assert "No round yet." in _markdown(at)
    at = _click(at, "lv_step")
    dec = at.session_state["lv_dec"]
    assert len(dec.rounds) == 1
    rnd = dec.rounds[0]
    md = _markdown(at)
    assert f"Round 1: {rnd.n_drafted} drafted, {rnd.n_accepted} accepted" in md
    assert "**Verify:**" in md
    # the round table: one row per draft position with the trace's numbers
    if rnd.drafted:
        df = at.dataframe[0].value
        assert list(df["verdict"]) == [d.verdict for d in rnd.drafted]
        assert list(df["p(x)"]) == pytest.approx([d.p for d in rnd.drafted])
    # statistics come from the decoder
    stats = dec.stats()
    assert _metric(at, "Tokens per round") == f"{stats.tokens_per_round:.2f}"
    # the figure beside Eq. 1 is tokens per round (each round one verify pass); the passes with the prompt's own
    # are in its help
    assert stats.tokens_per_round == stats.new_tokens / stats.rounds
    tpr = next(m for m in at.metric if m.label == "Tokens per round")
    assert f"took {stats.target_passes} target passes" in tpr.help


def test_c_after_the_first_drafting_round_says_it_includes_the_prompt_pass(tiny):
    """After one round the draft's time includes its pass over the prompt (trace.run_stats leaves that round out only
    once a later one drafted): the page says so under c, then that the timed figure comes from Run baseline; after
    it the timed c is shown with the stepping one beside it."""
    at = _app(tiny, lv_draft="early-exit", lv_max_new=24)
    c_metric = (lambda a: next(m for m in a.metric if m.label in ("c while stepping", "c, timed run")))
    at = _click(at, "lv_step")
    assert at.session_state["lv_dec"].rounds[0].n_drafted
    assert c_metric(at).label == "c while stepping" and c_metric(at).proto.delta == "includes the draft's prompt pass"
    at = _click(at, "lv_step")
    assert sum(1 for r in at.session_state["lv_dec"].rounds if r.n_drafted) == 2
    assert c_metric(at).proto.delta == "timed: press Run baseline"
    at = _click(at, "lv_baseline")
    m = c_metric(at)
    timed = at.session_state["lv_base"].spec_stats.draft_cost_ratio
    assert m.label == "c, timed run" and m.value == f"{timed:.3f}" and m.proto.delta.startswith("while stepping: ")
    assert at.session_state["lv_timed_c"]["early-exit"] == timed  # shown beside the next stepping run's c


def test_run_to_end_baseline_and_measured_run(tiny):
    at = _app(tiny)
    at = _click(at, "lv_run")
    dec = at.session_state["lv_dec"]
    assert dec.finished and len(dec.new_ids) <= 12
    assert at.success and "Finished" in at.success[0].value
    at = _click(at, "lv_baseline")
    ab = at.session_state["lv_base"]
    # timed A B B A, each run to its end; greedy: plain decoding gives the same tokens, and the timed
    # speculative runs (seeded) repeat the drawn run's tokens
    assert ab.order == ["spec", "base", "base", "spec", "spec", "base"]
    assert ab.base_ids == dec.new_ids and ab.spec_ids == dec.new_ids
    assert _metric(at, "Greedy outputs identical?") == "yes"
    expected = statistics.median(ab.base_ms_per_token) / statistics.median(ab.spec_ms_per_token)
    assert _metric(at, "Measured speedup") == f"{expected:.2f}×"
    tps = 1000 / statistics.median(ab.spec_ms_per_token)
    assert _metric(at, "Speculative tokens/s") == (f"{tps:.2f}" if tps < 10 else f"{tps:.1f}")
    s, t = dec.stats(), ab.spec_stats
    assert (t.rounds, t.accepted, t.drafted) == (s.rounds, s.accepted, s.drafted)
    # tokens per pass is compared with Eq. 1 at each round's own draft length (not at γ every round)
    from engine.explain.analytic import expected_tokens_per_round
    tp = next(m for m in at.metric if m.label == "Tokens per round")
    e_rounds = expected_tokens_per_round(s.acceptance_rate, [r.n_drafted for r in dec.rounds])
    assert tp.delta == f"formula at α̂: {e_rounds:.2f}" and f"With γ = {dec.gamma} drafted every round" in tp.help
    run = at.session_state["measured_run"]
    assert run.acceptance_rate == pytest.approx(s.acceptance_rate)
    # timings from the undrawn run
    assert run.draft_cost_ratio == pytest.approx(t.draft_cost_ratio)
    # its verify curve, with the baseline's median decode step as the 1-token point t(1)
    assert run.verify_ms_by_tokens == pytest.approx({**t.verify_ms_by_tokens, 1: ab.base_stats.verify_ms_by_tokens[1]})
    # the per-round time chart now shows the timed run, and every token chart has a category axis (a
    # token "2" must not become the number 2 on a numeric axis)
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    timed = next(f for f in specs if f["layout"]["title"]["text"].startswith("Time per round"))
    assert timed["layout"]["title"]["text"] == "Time per round (median timed run, nothing drawn)"
    assert timed["data"][1]["y"] == pytest.approx([r.verify_ms for r in ab.spec_rounds])
    token_charts = [f for f in specs if not f["layout"]["title"]["text"].startswith(("Time", "Acceptance"))]
    assert token_charts and all(f["layout"]["xaxis"]["type"] == "category" for f in token_charts)
    # a target other than the embedded one defaults to prompt lookup at γ = 4 (the head is γ = 2)
    assert run.measured_speedup == pytest.approx(expected) and run.gamma == 4
    # why, here: the three conditions the run measured, beside the speedup, the run's unsure flag with it
    assert run.spread == pytest.approx(ab.spread)
    why = next(m.value for m in at.markdown if m.value.startswith("**Why, here**"))
    assert f"Measured **{expected:.2f}×** on this server" in why
    assert ("unsure" in why) == bool(run.unsure)
    labels = [m.label for m in at.metric]
    assert any("Acceptance" in lb for lb in labels) and any("Verify pass" in lb for lb in labels)
    assert any("Draft step" in lb for lb in labels)
    # the generated text is drawn, coloured by origin
    assert ":green-background[" in _markdown(at) or ":orange-background[" in _markdown(at)


def test_reset_and_settings_change_rebuild(tiny):
    at = _app(tiny)
    at = _click(at, "lv_step")
    first = at.session_state["lv_dec"]
    assert len(first.rounds) == 1
    at = _click(at, "lv_reset")
    assert at.session_state["lv_dec"] is not first and not at.session_state["lv_dec"].rounds
    at = _click(at, "lv_step")
    at.slider(key="lv_gamma").set_value(7).run()
    assert not at.exception
    assert not at.session_state["lv_dec"].rounds and at.session_state["lv_dec"].gamma == 7
    assert at.query_params["lv_gamma"] == "7"


def test_url_state_and_sampling_shows_uniforms(tiny):
    at = _app(tiny, lv_gamma=3, lv_temp=1.0, lv_topk=20, lv_topp=0.9, lv_seed=42, lv_speed="instant")
    dec = at.session_state["lv_dec"]
    assert (dec.gamma, dec.seed) == (3, 42)
    assert (dec.sampling.temperature, dec.sampling.top_k, dec.sampling.top_p) == (1.0, 20, 0.9)
    at = _click(at, "lv_run")
    rounds = at.session_state["lv_dec"].rounds
    judged = [d for r in rounds for d in r.drafted if d.verdict != "discarded"]
    assert judged and all(d.u is not None for d in judged)  # sampling: a uniform draw per judged token
    assert at.query_params["lv_seed"] == "42" and at.query_params["lv_draft"] == "ngram"


def test_sampling_rule_choice_defaults_to_the_standard_rule_and_gumbel_matches_plain(tiny):
    """The standard rule is the default; the drafter-invariant one comes from the URL, its rounds draw no u, and Run
    baseline's plain run gives the same text ("Outputs identical?" yes)."""
    at = _app(tiny, lv_temp=0.9, lv_seed=4, lv_speed="instant")
    assert at.radio(key="lv_rule").value == "standard" and at.session_state["lv_dec"].sampling.rule == "standard"
    at = _app(tiny, lv_gamma=3, lv_temp=0.9, lv_seed=4, lv_speed="instant", lv_rule="gumbel")
    assert at.session_state["lv_dec"].sampling.rule == "gumbel"
    at = _click(at, "lv_run")
    dec = at.session_state["lv_dec"]
    assert all(d.u is None for r in dec.rounds for d in r.drafted)
    assert "Drafter-invariant sampling" in "\n".join(c.value for c in at.caption)
    at = _click(at, "lv_baseline")
    ab = at.session_state["lv_base"]
    assert ab.base_ids == dec.new_ids
    assert _metric(at, "Outputs identical?") == "yes"
    assert at.query_params["lv_rule"] == "gumbel"


def test_custom_prompt_travels_in_the_link(tiny):
    """A custom prompt is in the URL (lv_prompt) and a link with one opens with it; a preset's link has no
    lv_prompt; a prompt over PROMPT_URL_MAX characters stays out of the URL, with a note."""
    at = _app(tiny, prompt=None, lv_preset="custom", lv_prompt="w1 w2 w3 w1 w2 <b>x</b>")
    assert at.text_area(key="lv_prompt").value == "w1 w2 w3 w1 w2 <b>x</b>"  # literal text, never HTML
    assert at.session_state["lv_dec"].prompt_ids  # the decoder was built from it
    at.text_area(key="lv_prompt").input("w3 w2 w1\nw3 w2").run()
    assert at.query_params["lv_prompt"] == "w3 w2 w1\nw3 w2" and at.query_params["lv_preset"] == "custom"
    at.selectbox(key="lv_preset").set_value("chat").run()
    assert "lv_prompt" not in at.query_params
    at.text_area(key="lv_prompt").input("w1 " * 700).run()  # 2100 characters
    assert at.session_state["lv_preset"] == "custom" and "lv_prompt" not in at.query_params
    assert any("too long for the page's link" in w.value for w in at.warning)
    # a preset link ignores a stray lv_prompt
    at = _app(tiny, prompt=None, lv_preset="chat", lv_prompt="w1 w2")
    assert at.text_area(key="lv_prompt").value == preset_text("chat")


def test_presets_fill_the_prompt(tiny):
    at = _app(tiny, prompt=None, lv_preset="summary")
    assert at.text_area(key="lv_prompt").value == preset_text("summary")
    at.selectbox(key="lv_preset").set_value("chat").run()
    assert at.text_area(key="lv_prompt").value == preset_text("chat")
    at.text_area(key="lv_prompt").input("w1 w2 w3").run()
    assert at.session_state["lv_preset"] == CUSTOM
    assert not at.exception


def test_early_exit_draft(tiny):
    at = _app(tiny, lv_draft="early-exit", lv_k=5)  # clamped to 1..layers−1 = 1 (no slider for 1..1)
    assert at.session_state["lv_k"] == 1
    at = _click(at, "lv_step")
    assert "early exit at 1 of 2 layers" in at.session_state["lv_dec"].proposer.name


def test_empty_prompt_is_an_error(tiny):
    at = _app(tiny, prompt="   ")
    assert at.error and "prompt is empty" in at.error[0].value
    assert at.button(key="lv_step").disabled


def test_unloadable_model_is_an_error(tiny):
    at = _app("no-such/model")
    assert at.error and "Could not load 'no-such/model'" in at.error[0].value
    at = _app(tiny, lv_draft="model", lv_draft_model="/no/such/folder")
    assert at.error and "No such model folder" in at.error[0].value


def test_draft_with_other_tokenizer_is_an_error(tiny, tmp_path):
    other = save_tiny_llama(tmp_path / "other", words=[f"v{i}" for i in range(30)])
    at = _app(tiny, lv_draft="model", lv_draft_model=str(other))
    assert at.error and "tokenizer differs" in at.error[0].value


def test_prompt_longer_than_context_is_an_error(tiny):
    # the tiny model's context is 512 tokens; 600 words + 12 new tokens do not fit
    at = _app(tiny, prompt=" ".join(WORDS[i % 30] for i in range(600)))
    assert at.error and "exceeds the model's context of 512 tokens" in at.error[0].value


@pytest.mark.slow
def test_embedded_model_step_and_baseline():
    at = _app("embedded", prompt=None, lv_preset="code", lv_max_new=6, lv_gamma=4)
    assert not at.error
    at = _click(at, "lv_step")
    dec = at.session_state["lv_dec"]
    assert len(dec.rounds) == 1 and dec.proposer.name.startswith("prompt lookup")
    assert "Round 1:" in _markdown(at)
    at = _click(at, "lv_baseline")  # finishes the run (6 tokens), then decodes plainly
    dec, ab = at.session_state["lv_dec"], at.session_state["lv_base"]
    assert dec.finished and ab.base_ids == dec.new_ids == ab.spec_ids
    assert _metric(at, "Greedy outputs identical?") == "yes"
    assert at.session_state["measured_run"].gamma == 4


def test_trained_draft_kind(tiny):
    from engine.decoding.models import EMBEDDED_DRAFT_DIR

    at = _app(tiny, lv_draft="draft")
    if (EMBEDDED_DRAFT_DIR / "config.json").is_file():
        # the shipped draft exists; it was trained for the embedded target, not the tiny model
        assert at.error and "tokenizer" in at.error[0].value
    else:
        assert at.error and "The shipped draft is missing" in at.error[0].value


def test_draft_head_kind_on_another_target_is_a_clear_error(tiny):
    at = _app(tiny, lv_draft="head")
    assert at.error and "embedded target" in at.error[0].value


def test_reset_after_finishing_enables_step(tiny):
    at = _app(tiny, lv_speed="instant")
    at = _click(at, "lv_run")
    # finished: the two buttons drawn again in place, disabled (the run area is not rerun for them)
    assert at.button(key="lv_step_done").disabled and at.button(key="lv_run_done").disabled
    at = _click(at, "lv_reset")
    assert not at.button(key="lv_step").disabled and not at.session_state["lv_dec"].rounds


def test_default_preset_follows_the_default_draft(tiny):
    """The embedded target's default draft is the trained head, which predicts free text: the page opens on
    the chat question. Another target's default draft is prompt lookup: it opens on the code edit."""
    assert default_preset("head") == "chat" and default_preset("draft") == "chat"
    assert default_preset("ngram") == "code"
    for target, preset in ((tiny, "code"), ("embedded", "chat")):
        at = AppTest.from_file(PAGE, default_timeout=120)
        at.query_params["lv_target"] = target
        at.run()
        assert not at.exception, at.exception
        assert at.session_state["lv_preset"] == preset
        assert at.session_state["lv_prompt"] == preset_text(preset)


def test_confidence_gate_slider_only_for_the_head(tiny):
    at = _app(tiny)  # prompt lookup: no gate
    assert not [s for s in at.slider if s.key == "lv_conf"]
    at = _app(tiny, lv_draft="head", lv_conf=5)  # out of range in the URL: clamped to the slider's top
    assert at.slider(key="lv_conf").value == 0.95
    at = _app(tiny, lv_draft="head")
    assert at.slider(key="lv_conf").value == 0.0  # off by default


@pytest.mark.slow
def test_embedded_head_confidence_gate_from_the_url():
    """A high gate (from a shared link) reaches the head, cuts rounds short and leaves greedy output unchanged."""
    at = _app("embedded", prompt=None, lv_draft="head", lv_preset="chat", lv_max_new=12, lv_conf=0.9)
    assert at.slider(key="lv_conf").value == 0.9
    at = _click(at, "lv_baseline")  # finishes the speculative run, then decodes plainly
    dec = at.session_state["lv_dec"]
    assert dec.proposer.confidence_threshold == 0.9
    # without a gate every round but the last drafts γ tokens
    assert sum(len(r.drafted) for r in dec.rounds) < dec.gamma * (len(dec.rounds) - 1)
    assert _metric(at, "Greedy outputs identical?") == "yes"
    assert "Confidence gate 0.9" in "\n".join(c.value for c in at.caption)


def test_typing_another_target_switches_the_head_draft(tiny):
    """The shipped head reads the embedded target's features only: typing another target switches the
    draft to the new target's default (prompt lookup, γ 4), as in the
    CLI, and the page says so."""
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.run()
    assert at.session_state["lv_draft"] == "head"
    at.text_input(key="lv_target").set_value(tiny).run()
    assert not at.exception, at.exception
    assert at.session_state["lv_draft"] == "ngram" and at.session_state["lv_gamma"] == 4
    assert any("Draft switched to" in i.value for i in at.info)
    assert not at.error


def test_a_setting_moved_mid_run_says_the_run_restarts(tiny):
    """A user's report: nudging γ after two rounds silently wiped the run (a presenter's demo)."""
    at = _click(_click(_app(tiny, lv_gamma=2), "lv_step"), "lv_step")
    assert len(at.session_state["lv_dec"].rounds) == 2
    at.slider(key="lv_gamma").set_value(3).run()
    assert not at.session_state["lv_dec"].rounds
    assert "γ changed: the run starts again from the prompt (its 2 rounds so far are discarded)." in \
        " ".join(t.value for t in at.toast)
    _click(at, "lv_reset")  # Reset restarts on purpose: nothing to say
    assert not at.toast


def test_custom_prompt_link_without_its_prompt_explains_why(tiny):
    # a prompt over PROMPT_URL_MAX characters stays out of the link; opening that link said only "empty"
    at = _app(tiny, prompt=None, lv_preset=CUSTOM)
    assert at.error and "The prompt is empty" in at.error[0].value
    assert any("does not fit in a link" in i.value for i in at.info)


def test_back_past_a_prompt_preset_change_brings_its_prompt_back(tiny, monkeypatch):
    """Back past a change of the prompt preset showed the earlier preset's name over the later preset's
    prompt (and decoded that). On Back/Forward the link names the prompt: its preset's, or its own."""
    import app.state

    at = AppTest.from_file(str(Path(PAGE).parent.parent / "app" / "main.py"), default_timeout=120)
    at.run()
    at.query_params.update({"lv_target": tiny, "lv_draft": "ngram", "lv_max_new": "4"})
    at.switch_page("../pages/live.py").run()
    assert not at.exception, at.exception
    first = at.session_state["lv_preset"]
    link = {k: at.query_params[k] for k in at.query_params}
    other = next(p for p in PROMPT_PRESETS if p != first)
    at.selectbox(key="lv_preset").set_value(other).run()
    assert at.session_state["lv_prompt"] == preset_text(other)
    monkeypatch.setattr(app.state, "_is_history_navigation", lambda: True)  # Back
    for k in list(at.query_params):
        del at.query_params[k]
    at.query_params.update(link)
    at.run()
    assert not at.exception, at.exception
    assert at.session_state["lv_preset"] == first
    assert at.session_state["lv_prompt"] == preset_text(first)


@pytest.mark.slow
def test_medusa_kind_runs_tree_rounds_on_the_embedded_model():
    from engine.decoding.medusa import MedusaProposer, is_medusa_folder
    from engine.decoding.models import EMBEDDED_MEDUSA_DIR

    if not is_medusa_folder(EMBEDDED_MEDUSA_DIR):
        pytest.skip("no shipped Medusa heads")
    at = _app("embedded", prompt=None, lv_preset="chat", lv_max_new=8, lv_gamma=4, lv_draft="medusa")
    assert not at.error
    at = _click(at, "lv_step")
    dec = at.session_state["lv_dec"]
    assert isinstance(dec.proposer, MedusaProposer) and dec.tree == dec.proposer.tree_size > 0
    assert dec.rounds[0].tree is not None and "Medusa heads" in "\n".join(c.value for c in at.caption)


def test_medusa_kind_needs_the_embedded_target(tiny):
    at = _app(tiny, lv_draft="medusa")
    assert at.error and "embedded target" in at.error[0].value


@pytest.mark.slow
def test_block_kind_drafts_a_block_in_one_pass_on_the_embedded_model():
    """The block drafter kind: a step drafts γ slots in one pass (the round shows the block, masks then filled), the
    γ slider's help says where its default comes from, and a block past the trained maximum is a clear error."""
    from engine.decoding.block_drafter import BlockProposer, is_block_folder
    from engine.decoding.models import EMBEDDED_BLOCK_DIR

    if not is_block_folder(EMBEDDED_BLOCK_DIR):
        pytest.skip("no shipped block drafter")
    at = _app("embedded", prompt=None, lv_preset="chat", lv_max_new=8, lv_gamma=7, lv_draft="block")
    assert not at.error
    at = _click(at, "lv_step")
    dec = at.session_state["lv_dec"]
    assert isinstance(dec.proposer, BlockProposer) and dec.rounds and dec.rounds[0].n_drafted <= 7
    assert "Block drafter (DFlash-style" in "\n".join(c.value for c in at.caption)
    assert any("Block pass:" in m.value for m in at.markdown)
    at = _app("embedded", prompt=None, lv_preset="chat", lv_max_new=8, lv_gamma=16, lv_draft="block")
    assert at.error and "blocks of 2 to" in at.error[0].value


def test_block_kind_needs_the_embedded_target(tiny):
    at = _app(tiny, lv_draft="block")
    assert at.error and "embedded target" in at.error[0].value


def test_compute_path_shown_beside_the_model(tiny):
    """The sidebar names the kernels every pass runs (engine/decoding/compute/), with the CPU."""
    from engine.decoding.compute import cpu_model

    at = _app(tiny)
    caps = [c.value for c in at.sidebar.caption
            if c.value.startswith("How this CPU runs each pass (the compute path):")]
    assert len(caps) == 1 and cpu_model() in caps[0]
    assert "oneDNN" in caps[0] or "PyTorch default" in caps[0]
    at.query_params["lv_target"] = tiny
    import os

    os.environ["SPEEDUP_LAB_COMPUTE"] = "bogus"
    try:  # a bad override: the page says so (the model cannot load), no traceback
        bad = AppTest.from_file(PAGE, default_timeout=120)
        bad.query_params.update({"lv_target": tiny + "/", "lv_draft": "ngram"})
        bad.run()
        assert not bad.exception and any("Unknown compute path 'bogus'" in e.value for e in bad.error)
    finally:
        del os.environ["SPEEDUP_LAB_COMPUTE"]


def test_room_panel_counts_the_pass_that_served_this_reader(tiny):
    at = _app(tiny)
    assert {"Readers decoding", "Rows per pass", "Room tokens/s"} <= {m.label for m in at.metric}
    at = _click(at, "lv_step")
    captions = [c.value for c in at.caption]
    assert any(c.startswith("The last target pass served 1 reader. ") and " As of " in c for c in captions)
    # the room's self-check on this machine: running, or what it found (engine/decoding/invariance.py)
    assert any("Checking on this machine" in c or "Each reader's text in the room: " in c for c in captions)
    assert _metric(at, "Readers decoding") == "0"  # the round is done: nobody waits
    assert float(_metric(at, "Room tokens/s")) > 0


def test_run_to_end_among_other_readers_ends_with_the_view_alone(tiny, monkeypatch):
    """With other readers in the room, Run to the end draws only its progress bar and room panel while it runs
    (every page's redraws take the CPU from the room's passes); what the reader sees at the end is what
    a run alone shows: the same text, round, status and statistics."""
    alone = _click(_app(tiny), "lv_run")
    from engine.decoding.scheduler import Room

    monkeypatch.setattr(Room, "readers", lambda self: 5)  # four others share the room
    shared = _click(_app(tiny), "lv_run")
    assert shared.session_state["lv_dec"].new_ids == alone.session_state["lv_dec"].new_ids
    assert shared.success[0].value == alone.success[0].value and "Finished" in alone.success[0].value
    # the generated text (coloured by origin) and the last round's verdict; the round's title carries its timings
    text = (lambda at: [m.value for m in at.markdown if "-background[" in m.value])
    assert set(text(shared)) <= set(text(alone)) and text(shared)  # the inspector's frames are not drawn yet
    rnd = alone.session_state["lv_dec"].rounds[-1]
    from app.live_view import verdict_frame

    n_frames = (lambda at: sum(m.value == verdict_frame(rnd) for m in at.markdown))
    assert [m.label for m in shared.metric] == [m.label for m in alone.metric]
    # the run ended, among other readers or alone: no rerun of the run area, the two buttons are redrawn disabled
    for at in (shared, alone):
        assert at.button(key="lv_run_done").disabled and at.button(key="lv_step_done").disabled
    # while the others decode, the charts and the round inspector wait (a caption and a toggle say so) ...
    assert not shared.get("plotly_chart") and alone.get("plotly_chart")
    assert any("5 other readers are decoding on this server" in c.value for c in shared.caption)
    assert n_frames(shared) < n_frames(alone)  # not the inspector's copy of the round
    # ... and the toggle draws them: then the page is the page alone
    shared.toggle(key="lv_charts_busy").set_value(True).run()
    assert n_frames(shared) == n_frames(alone) and text(shared) == text(alone)
    assert len(shared.get("plotly_chart")) == len(alone.get("plotly_chart"))
    alone_only = alone.toggle  # alone there is no toggle
    assert not [t for t in alone_only if t.key == "lv_charts_busy"]
