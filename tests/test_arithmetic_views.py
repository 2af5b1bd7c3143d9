"""Where readers meet the arithmetic (int8 or fp32): a race's lanes and their verdict, the Live link a race opens, and
the note pages show from bench_int8's result (engine/explain/measured.py)."""

from __future__ import annotations

import json

from app.race_view import RACE_DEFAULTS, decoder_kwargs, lane_arithmetic, live_link, race_settings, verdict_line
from engine.explain.measured import arithmetic_agreement, arithmetic_note
from tests.test_race_view import _race


def _settings(**kw):
    return race_settings(target="embedded", prompt="Hi", preset="custom", draft="ngram", early_exit_k=8,
                         draft_model="", gamma=2, tree=0, temperature=0.0, seed=0, max_new_tokens=16, **kw)


def test_a_race_records_each_lanes_arithmetic_and_an_old_record_reads_fp32():
    s = _settings(arithmetic="int8", plain_arithmetic="fp32")
    assert (s["plain_arithmetic"], s["arithmetic"]) == ("fp32", "int8")
    assert _settings(arithmetic="int8")["plain_arithmetic"] == "int8"
    assert RACE_DEFAULTS["arithmetic"] == "fp32"  # a record made before races recorded it ran the fp32 arithmetic
    race = _race()
    assert lane_arithmetic(race) == ("fp32", "fp32")
    race.settings = s
    assert lane_arithmetic(race) == ("fp32", "int8")
    assert "arithmetic" not in decoder_kwargs(s)  # the lane's model carries it, not the decoder's arguments


def test_a_mixed_race_says_the_text_differs_because_of_the_arithmetic():
    race = _race(spec_ids=[0, 1, 7, 3])
    race.settings = _settings(arithmetic="int8", plain_arithmetic="fp32")
    line = verdict_line(race)
    assert line.startswith("TEXT DIFFERS from token 3 (the lanes' arithmetic differs: plain fp32, speculative int8")
    assert "not speculation" in line
    race.settings = _settings(arithmetic="int8")
    assert "near tie" in verdict_line(race)


def test_the_live_link_opens_the_speculative_lanes_arithmetic():
    assert "lv_arith=int8" in live_link(_settings(arithmetic="int8", plain_arithmetic="fp32"), 2).url()
    old = {k: v for k, v in _settings().items() if k not in ("arithmetic", "plain_arithmetic")}
    assert "lv_arith=fp32" in live_link(old, 2).url()


def test_the_note_reads_bench_int8s_result_and_names_the_machine(tmp_path):
    result = {"meta": {"cpu": "AMD EPYC 9R14"}, "date": "2026-12-07 20:00",
              "passes": {"int8": {"ratio": {"1": 1.0, "3": 1.2}}, "fp32": {"ratio": {"1": 1.0, "3": 1.4}}},
              "peaks_gmac_s": {"int8": 450.0, "fp32": 110.0},
              "agreement": {"identical_texts": 5, "prompts": 12, "first_divergence": [None] * 5 + [9, 30, 12, 40, 22, 17, 51],
                            "top1": 0.9876, "mean_kl": 0.0031, "max_new_tokens": 64}}
    path = tmp_path / "int8_amd-epyc.json"
    path.write_text(json.dumps(result))
    data = arithmetic_agreement(path)
    assert data["identical"] == 5 and data["first_divergence"] == (9, 51) and data["ratio"]["int8"][3] == 1.2
    note = arithmetic_note("int8", {**data, "own": False})
    assert "**int8**" in note and "another machine (AMD EPYC 9R14), 2026-12-07" in note
    assert "**5 of 12** greedy texts of 64 tokens identical" in note and "part at token 9–51" in note
    assert "98.8 %" in note and "not speculation" in note
    assert "**fp32**" in arithmetic_note("fp32", None) or "fp32" in arithmetic_note("fp32", data)
    assert arithmetic_agreement(tmp_path / "missing.json") is None


def test_the_arithmetic_ceilings_are_measured_once_and_stored(tmp_path):
    from engine.explain.machine import arithmetic_ceilings

    path = tmp_path / "peaks.json"
    got = arithmetic_ceilings(path=path, seconds=0.05)
    if got is None:
        import pytest

        pytest.skip("no kernel here")
    assert got["int8"] > 0 and got["fp32"] > 0 and got["threads"] >= 1
    again = arithmetic_ceilings(path=path, seconds=0.05)
    assert again == got  # read back, not measured again
    assert json.loads(path.read_text())  # stored beside the bandwidth
