"""AppTest: the Live page opened at a round by a link (``lv_round``), and the Race page's link to a round of its
speculative lane: Live rebuilds the lane's decoder from the race's settings and shows the same rounds (tiny random
Llama; one slow test on the embedded model with the shipped recorded race)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from streamlit.testing.v1 import AppTest

from app.race_view import decoder_kwargs, live_link
from engine.decoding.race import load_race
from tests.tiny_models import WORDS, save_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
LIVE = str(ROOT / "pages" / "live.py")
RACE = str(ROOT / "pages" / "race.py")
RECORDED = ROOT / "assets" / "race_recorded.json"
PROMPT = " ".join(WORDS[:10] * 3)  # repeats itself: prompt lookup finds matches


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("live_round") / "tiny", layers=3))


def _live(query: dict, prompt: str | None = None) -> AppTest:
    at = AppTest.from_file(LIVE, default_timeout=300)
    at.query_params.update({k: str(v) for k, v in query.items()})
    if prompt is not None:
        at.session_state["lv_prompt"] = prompt
    at.run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    return at


def _infos(at: AppTest) -> str:
    return "\n".join(i.value for i in at.info)


def _round_title(at: AppTest) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**Round ") or m.value == "**No round yet.**")


def test_live_opens_round_3_as_three_steps_would(tiny):
    q = {"lv_target": tiny, "lv_draft": "ngram", "lv_max_new": 24, "lv_gamma": 3}
    at = _live({**q, "lv_round": 3}, PROMPT)
    dec = at.session_state["lv_dec"]
    assert len(dec.rounds) == 3
    assert _round_title(at).startswith("**Round 3:")
    assert "Round 3, opened by the link" in _infos(at)
    assert [e.label for e in at.expander if e.label.endswith("in detail")] == ["Round 3 in detail"]
    assert at.query_params["lv_round"] == "3"  # the link still describes the view
    # the same rounds as three presses of Step one round
    steps = _live(q, PROMPT)
    for _ in range(3):
        steps.button(key="lv_step").click().run()
    assert [r.emitted_ids for r in steps.session_state["lv_dec"].rounds] == [r.emitted_ids for r in dec.rounds]
    # a step goes on from round 3; the link's round leaves the URL with its note
    at.button(key="lv_step").click().run()
    assert not at.exception
    assert len(at.session_state["lv_dec"].rounds) == 4 and _round_title(at).startswith("**Round 4:")
    assert "lv_round" not in at.query_params and "opened by the link" not in _infos(at)


def test_a_rerun_does_not_step_again_and_reset_leaves_the_round(tiny):
    at = _live({"lv_target": tiny, "lv_draft": "ngram", "lv_max_new": 24, "lv_round": 2}, PROMPT)
    at.run()  # the same address again (a click on the page): no second opening
    assert len(at.session_state["lv_dec"].rounds) == 2 and "opened by the link" in _infos(at)
    at.button(key="lv_reset").click().run()
    assert not at.exception
    assert not at.session_state["lv_dec"].rounds and "lv_round" not in at.query_params


def test_a_run_that_ends_before_the_round_says_so(tiny):
    at = _live({"lv_target": tiny, "lv_draft": "ngram", "lv_max_new": 5, "lv_round": 40}, PROMPT)
    dec = at.session_state["lv_dec"]
    assert dec.finished and len(dec.rounds) < 40
    assert f"asked for round 40, but this run ended ({dec.stop_reason}) after round {len(dec.rounds)}" in _infos(at)
    assert _round_title(at).startswith(f"**Round {len(dec.rounds)}:")


def test_a_round_past_any_run_is_read_as_the_last_with_a_note(tiny):
    """lv_round=100000 opened at the page's most rounds while the message named that number: the link's value is
    named in a note as it is replaced."""
    at = _live({"lv_target": tiny, "lv_draft": "ngram", "lv_max_new": 5, "lv_round": 100000}, PROMPT)
    assert any("lv_round=100000 → 256" in t.value for t in at.toast)
    assert "asked for round 256, but this run ended" in _infos(at)


def test_an_unreadable_round_is_ignored_with_a_note(tiny):
    at = _live({"lv_target": tiny, "lv_draft": "ngram", "lv_max_new": 12, "lv_round": "three"}, PROMPT)
    assert not at.session_state["lv_dec"].rounds
    assert any("lv_round=three" in t.value for t in at.toast)
    assert "lv_round" not in at.query_params


def _query(url: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlsplit(url).query, keep_blank_values=True).items()}


def _race(tiny: str, **params):
    at = AppTest.from_file(RACE, default_timeout=300)
    at.query_params.update({"rc_target": tiny, "rc_max_new": "16", **{k: str(v) for k, v in params.items()}})
    at.session_state["rc_prompt"] = PROMPT
    at.run()
    at.button(key="rc_race_btn").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    return at


def _lane_rounds(lane):
    """Each round of a race lane: (draft texts, draft tokens kept, emitted token ids)."""
    ids = {}
    for t in lane.tokens:
        ids.setdefault(t.round, []).append(t.token_id)
    return [([m.text for m in r.draft], r.n_accepted, ids.get(r.index, [])) for r in lane.rounds]


def _live_rounds(dec):
    return [([d.text for d in r.drafted], r.n_accepted, list(r.emitted_ids)) for r in dec.rounds]


@pytest.mark.parametrize("params", [
    {"rc_draft": "ngram", "rc_gamma": 3},
    {"rc_draft": "early-exit", "rc_k": 1, "rc_gamma": 2, "rc_seed": 3},
    {"rc_draft": "ngram", "rc_gamma": 4, "rc_tree": 6},
    {"rc_draft": "early-exit", "rc_k": 2, "rc_gamma": 3, "rc_temp": 0.5, "rc_seed": 0},
], ids=["lookup", "early-exit", "lookup-tree", "sampled"])
def test_the_race_pages_link_opens_the_lanes_round_in_live(tiny, params):
    """Race, take the page's link to round N, open Live with it alone (a new tab: no session): Live's decoder is
    built from the race's settings (its config equals the lane's make_decoder arguments) and its N rounds are the
    speculative lane's first N rounds, token for token."""
    at = _race(tiny, **params)
    race = at.session_state["rc_race"]
    assert len(race.spec.rounds) > 3  # round 3 is not the last: Live must stop there
    n = 3
    at.number_input(key="rc_open_round").set_value(n).run()
    link_md = next(m.value for m in at.markdown if m.value.startswith(f"Open round {n} in the Live page"))
    url = link_md.split("`")[1]
    assert url == live_link(race.settings, n).url()
    live = _live(_query(url))
    dec = live.session_state["lv_dec"]
    cfg = live.session_state["lv_cfg"]._asdict()
    want = {("draft" if k == "kind" else k): v for k, v in decoder_kwargs(race.settings).items()}
    assert {k: cfg[k] for k in want} == want
    assert cfg["target"] == race.settings["target"] == tiny
    assert len(dec.rounds) == n
    assert _live_rounds(dec) == _lane_rounds(race.spec)[:n]
    # to the end: Live's text is the lane's
    if not dec.finished:
        live.button(key="lv_run").click().run()
    assert live.session_state["lv_dec"].result().text == race.spec.text


@pytest.mark.slow
def test_the_recorded_races_link_rebuilds_its_rounds_on_the_embedded_model():
    """The shipped race (the draft head, greedy): Live opened at its last round shows the lane's rounds and text."""
    race = load_race(RECORDED)
    n = len(race.spec.rounds)
    # the process's product path is the last one applied (another test's model may have set its own): give the
    # embedded target its own back, so its products run the arithmetic the race recorded (int8 rounds differently)
    from app.race_view import RACE_DEFAULTS
    from app.resources import get_model
    from engine.decoding import compute

    target = get_model("embedded", arithmetic={**RACE_DEFAULTS, **race.settings}["arithmetic"])
    compute.use_path(target.model, target.compute, release=True)
    live = _live(_query(live_link(race.settings, n).url()))
    dec = live.session_state["lv_dec"]
    assert len(dec.rounds) == n and dec.finished
    assert _live_rounds(dec) == _lane_rounds(race.spec)
    assert dec.result().text == race.spec.text
