"""AppTest for pages/race.py on a tiny random Llama: the recorded race before any race, a race with prompt lookup,
settings in the URL, bad input as a message, presenter mode's join card."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.join import PUBLIC_URL_ENV
from tests.tiny_models import WORDS, save_tiny_llama

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "race.py")
PROMPT = " ".join(WORDS[:10] * 3)  # repeats itself: prompt lookup finds matches
RECORDED = Path(__file__).resolve().parent.parent / "assets" / "race_recorded.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("race_page") / "tiny", layers=2))


def _app(target: str, prompt: str | None = PROMPT, present: bool = False, **params) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.query_params.update({"rc_target": target, "rc_draft": "ngram", "rc_max_new": "12",
                            **{k: str(v) for k, v in params.items()}})
    if prompt is not None:
        at.session_state["rc_prompt"] = prompt
    if present:
        at.session_state["present"] = True
    at.run()
    assert not at.exception, at.exception
    return at


def _captions(at: AppTest) -> str:
    return "\n".join(c.value for c in at.caption)


def test_before_any_race_the_recorded_race_is_shown(tiny):
    at = _app(tiny)
    assert not at.error
    labels = [b.label for b in at.button]
    assert labels[:3] == ["🏁 Race", "Stop", "Play the recorded race"]
    assert "📱 Join card" not in labels  # presenter mode only
    if RECORDED.is_file():
        assert "A recorded race, measured on" in _captions(at)
        why = next(m.value for m in at.markdown if m.value.startswith("**Why, here**"))
        from engine.decoding.race import load_race

        machine = load_race(RECORDED).machine.split(" (")[0]
        assert f"on the recorded race's machine, {machine}" in why  # the machine named in the sentence
        # its speedup is small: a case that pays is one click away, with its machine in the sentence
        assert any(b.label.startswith("🏁 Race prompt lookup on a code edit") for b in at.button)
        assert "A case that pays: Prompt lookup on a code edit" in _captions(at)
        assert at.session_state["rc_show"] if "rc_show" in at.session_state else True


def test_a_race_replaces_it_and_keeps_the_settings_in_the_url(tiny):
    at = _app(tiny, rc_gamma=3, rc_seed=5)
    at.button(key="rc_race_btn").click().run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    race = at.session_state["rc_race"]
    assert race.order == ["spec", "base", "base", "spec", "spec", "base"]
    assert race.identical and race.spec.new_tokens == 12 == race.plain.new_tokens
    assert race.settings["draft"] == "ngram" and race.settings["gamma"] == 3 and race.settings["seed"] == 5
    caps = _captions(at)
    assert "Measured on this server" in caps and "one after the other" in caps
    assert "A recorded race" not in caps
    assert f"the median of each kind): {race.ab_speedup:.2f}×, against {race.speedup:.2f}× on the lanes" in caps
    assert at.query_params["rc_draft"] == "ngram" and at.query_params["rc_gamma"] == "3"
    assert at.query_params["rc_seed"] == "5"
    assert "rc_prompt" not in at.query_params or at.session_state["rc_preset"] == "custom"
    # why, here: the race's speedup beside the three conditions its lanes measured
    why = next(m.value for m in at.markdown if m.value.startswith("**Why, here**"))
    assert f"Measured **{race.speedup:.2f}×** on this server" in why
    assert sum(any(k in m.label for k in ("Acceptance", "Verify pass", "Draft step")) for m in at.metric) == 3
    # the recorded race on request, then back to a new race of this server
    if RECORDED.is_file():
        at.button(key="rc_recorded_btn").click().run()
        assert "A recorded race, measured on" in _captions(at)


def test_sampled_race(tiny):
    at = _app(tiny, rc_temp=0.8, rc_seed=1)
    at.button(key="rc_race_btn").click().run()
    assert not at.exception and not at.error
    race = at.session_state["rc_race"]
    assert not race.greedy and race.settings["temperature"] == 0.8


def test_sampled_race_under_the_drafter_invariant_rule_ends_text_identical(tiny):
    """Sampled at T 0.8 on the drafter-invariant rule: the lanes' texts are identical, the verdict says so and a
    caption says why; the rule is in the URL and the race's settings."""
    from app.race_view import verdict_line

    at = _app(tiny, rc_temp=0.8, rc_seed=3, rc_rule="gumbel")
    assert at.radio(key="rc_rule").value == "gumbel"
    at.button(key="rc_race_btn").click().run()
    assert not at.exception and not at.error
    race = at.session_state["rc_race"]
    assert race.settings["rule"] == "gumbel" and not race.greedy
    assert race.identical and race.spec.new_tokens == 12
    assert verdict_line(race).startswith("TEXT IDENTICAL (12 tokens, sampled")
    assert "Why identical though sampled" in _captions(at)
    assert at.query_params["rc_rule"] == "gumbel"


def test_bad_input_is_a_message_not_a_traceback(tiny):
    at = _app(tiny, prompt="   ")
    at.button(key="rc_race_btn").click().run()
    assert not at.exception
    assert any("prompt is empty" in e.value for e in at.error)
    assert "rc_race" not in at.session_state or at.session_state["rc_race"] is None
    at = _app(tiny, rc_draft="model")  # no draft model typed
    at.button(key="rc_race_btn").click().run()
    assert not at.exception
    assert any("Type a draft model" in e.value for e in at.error)


def test_presenter_join_card(tiny, monkeypatch):
    monkeypatch.setenv(PUBLIC_URL_ENV, "http://192.168.1.20:8501/")
    at = _app(tiny, present=True)
    at.button(key="rc_join_btn").click().run()
    assert not at.exception, at.exception
    shown = "\n".join(h.proto.body for h in at.get("html"))
    assert "http://192.168.1.20:8501/" in shown  # the address in large type
    assert len(at.get("image")) == 1  # the QR code
    monkeypatch.setenv(PUBLIC_URL_ENV, "ftp://nowhere")
    at.button(key="rc_join_btn").click().run()
    assert not at.exception
    assert any(PUBLIC_URL_ENV in e.value for e in at.error)


def test_under_the_lanes_a_round_opens_in_live(tiny):
    """The opener offers the speculative lane's rounds and links to the Live page at the chosen one, with the race's
    settings (the race records every setting its lanes were built from)."""
    from app.race_view import live_link

    at = _app(tiny, rc_gamma=3, rc_seed=2)
    if RECORDED.is_file():  # the recorded race's rounds first: its last round is past the tiny race's end
        recorded = at.number_input(key="rc_open_round")
        recorded.set_value(recorded.max).run()
    at.button(key="rc_race_btn").click().run()
    assert not at.exception, at.exception
    race = at.session_state["rc_race"]
    assert {"target", "early_exit_k", "draft_model"} <= set(race.settings) and race.settings["target"] == tiny
    box = at.number_input(key="rc_open_round")
    assert box.max == len(race.spec.rounds) and box.value == (len(race.spec.rounds) if RECORDED.is_file() else 1)
    box.set_value(2).run()
    links = [m.value for m in at.markdown if m.value.startswith("Open round 2 in the Live page")]
    assert links == [f"Open round 2 in the Live page → `{live_link(race.settings, 2).url()}`"]
    assert any(c.value.startswith("Round 2") for c in at.caption)
