"""app.race_view's link from a race's round to the Live page (every setting the lanes were built from travels under
its Live key) and app.live_view's reading of ``lv_round``; no model."""

from __future__ import annotations

import inspect
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from app.decoders import make_decoder
from app.live_view import PROMPT_URL_MAX, opened_round_message, round_link_value
from app.race_view import (LIVE_KEYS, decoder_kwargs, live_link, live_round_base, player_data, player_html,
                           race_settings, race_target)
from engine.decoding.race import load_race
from engine.errors import InputError
from engine.explain.presets import CUSTOM, PROMPT_PRESETS, preset_text
from tests.test_race_view import _data_of, _race

RECORDED = Path(__file__).resolve().parent.parent / "assets" / "race_recorded.json"

BASE = dict(target="embedded", prompt=preset_text("code"), preset="code", draft="ngram", early_exit_k=8,
            draft_model="", gamma=4, tree=0, temperature=0.0, seed=0, max_new_tokens=64)
CHANGED = dict(target="/models/other", prompt="my own prompt", preset=CUSTOM, draft="early-exit", early_exit_k=3,
               draft_model="org/draft", gamma=7, tree=9, temperature=0.85, seed=4242, max_new_tokens=33)


def _query(link) -> dict[str, str]:
    q = parse_qs(urlsplit(link.url()).query, keep_blank_values=True)
    return {k: v[-1] for k, v in q.items()}


def test_every_make_decoder_setting_has_a_live_key():
    """A new make_decoder argument must get a Live key (or the link would rebuild another decoder)."""
    params = inspect.signature(make_decoder).parameters
    settable = {n for n in params if n not in ("target", "baseline", "load")}
    assert set(LIVE_KEYS) == settable
    assert set(decoder_kwargs(race_settings(**BASE))) == settable


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_race_setting_travels_to_its_live_key(field):
    """Changing one race setting changes the Live link's value of that setting, to the race's value."""
    settings = race_settings(**{**BASE, field: CHANGED[field]})
    if field == "prompt":
        settings["preset"] = CUSTOM
    q = _query(live_link(settings, 3))
    base_q = _query(live_link(race_settings(**BASE), 3))
    kw = decoder_kwargs(settings)
    for k, v in kw.items():
        if k == "prompt" and q["lv_preset"] != CUSTOM:
            assert preset_text(q["lv_preset"]) == v
            continue
        got = q[LIVE_KEYS[k]]
        assert (float(got) == v) if isinstance(v, float) else (got == str(v)), (k, got, v)
    assert q["lv_target"] == race_target(settings) and q["lv_round"] == "3"
    assert q != base_q  # the change shows in the link


def test_a_preset_prompt_travels_by_name_and_an_edited_one_as_text():
    q = _query(live_link(race_settings(**BASE), 1))
    assert q["lv_preset"] == "code" and "lv_prompt" not in q
    edited = race_settings(**{**BASE, "prompt": preset_text("code") + " Thanks."})  # preset named, text changed
    q = _query(live_link(edited, 1))
    assert q["lv_preset"] == CUSTOM and q["lv_prompt"] == preset_text("code") + " Thanks."
    assert set(PROMPT_PRESETS) >= {"code"}


def test_what_cannot_travel_is_refused_with_a_message():
    with pytest.raises(InputError, match="too long for a link"):
        live_link(race_settings(**{**BASE, "prompt": "x" * (PROMPT_URL_MAX + 1), "preset": CUSTOM}), 1)
    assert live_link(race_settings(**{**BASE, "prompt": "x" * PROMPT_URL_MAX, "preset": CUSTOM}), 1)
    with pytest.raises(InputError, match="count from 1"):
        live_link(race_settings(**BASE), 0)
    with pytest.raises(InputError, match="no prompt"):
        decoder_kwargs({"draft": "ngram"})
    assert live_round_base(race_settings(**{**BASE, "prompt": "x" * 3000, "preset": CUSTOM})) is None


def test_the_recorded_race_links_to_live_with_the_embedded_target():
    """The shipped record names no target (recorded before it was): the embedded model, its other settings as
    recorded."""
    race = load_race(RECORDED)
    q = _query(live_link(race.settings, 5))
    s = race.settings
    assert q["lv_target"] == "embedded" and q["lv_draft"] == s["draft"] and q["lv_gamma"] == str(s["gamma"])
    assert q["lv_seed"] == str(s["seed"]) and q["lv_max_new"] == str(s["max_new_tokens"])
    assert float(q["lv_temp"]) == s["temperature"] and q["lv_tree"] == str(s["tree"]) and q["lv_round"] == "5"
    assert preset_text(q["lv_preset"]) == s["prompt"]


def test_the_players_bars_link_each_speculative_round():
    settings = race_settings(**{**BASE, "prompt": 'a "<script>" & </script> prompt', "preset": CUSTOM})
    race = _race()
    race.settings = settings
    base = live_round_base(settings, present=True)
    assert base.startswith("live?") and base.endswith("&lv_round=") and "present=1" in base
    assert base + "4" == live_link(settings, 4).url(present=1).replace("&lv_round=4", "") + "&lv_round=4"
    data = player_data(race, present=True)
    assert data["live"] == base
    doc = player_html(race)
    assert "<script>\"" not in doc and "</script> prompt" not in doc  # the URL-encoded prompt, in escaped JSON
    assert _data_of(doc)["live"] == live_round_base(settings)
    race.settings = {}
    assert player_data(race)["live"] is None  # no prompt, no draft: no links


@pytest.mark.parametrize("raw, want", [(None, 0), ("0", 0), ("3", 3), (" 7 ", 7), ("999", 256), ("-1", None),
                                       ("abc", None), ("2.5", None), ("", None)])
def test_round_link_value(raw, want):
    assert round_link_value(raw, 256) == want


def test_opened_round_message():
    assert "Round 3, opened by the link" in opened_round_message(3, 3, False)
    assert "stepped 3 times" in opened_round_message(3, 3, True)
    assert "stepped once" in opened_round_message(1, 1, False)
    ended = opened_round_message(40, 12, True, "max_new_tokens")
    assert "asked for round 40" in ended and "ended (max_new_tokens) after round 12" in ended and "its last" in ended
    assert "stopped after round 2" in opened_round_message(5, 2, False)
    assert "before its first round" in opened_round_message(5, 0, False)


def test_the_players_script_parses(tmp_path):
    """The player's script (with the links' code) is valid JavaScript (node --check, where node is installed)."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    race = _race()
    race.settings = race_settings(**BASE)
    doc = player_html(race)
    script = doc.split("<script>", 1)[1].split("</script>", 1)[0]
    path = tmp_path / "player.js"
    path.write_text(script, encoding="utf-8")
    done = subprocess.run([node, "--check", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
