"""The Race page's player (app/race_view.py) and join card (app/join.py): escaped data, the numbers it shows, the lines
said about a race, the address and the QR code."""

from __future__ import annotations

import io
import json
import re

import pytest

from app.join import PUBLIC_URL_ENV, join_address, qr_png
from app.race_view import (honesty_line, json_for_script, player_data, player_html, room_line, round_hover,
                           verdict_line)
from engine.decoding.race import DraftMark, Lane, LaneRound, Race, Span, TokenMark
from engine.errors import InputError

EVIL = '</script><img src=x onerror="alert(1)">\u2028&amp;'


def _lane(kind: str, texts: list[str], step_ms: float, ids=None) -> Lane:
    ids = ids or list(range(len(texts)))
    spans, tokens, rounds = [Span("prefill", 0.0, 20.0, None, 12)], [], []
    t = 20.0
    for i, (tok, text) in enumerate(zip(ids, texts)):
        draft = [DraftMark(text, "accepted", 0.9, 0.8), DraftMark("x", "rejected", 0.1, 0.6)] if kind != "plain" else []
        if kind != "plain":
            spans.append(Span("draft", t, t + 2.0, i, 2))
        spans.append(Span("verify" if kind != "plain" else "step", t + 2.0, t + step_ms, i, 3))
        t += step_ms + 0.5
        rounds.append(LaneRound(i, t - step_ms - 0.5, t, draft, 2 if draft else 0, len(draft) and 1, "y",
                                "correction" if draft else "plain", 1))
        tokens.append(TokenMark(t, tok, text, "accepted" if draft else "plain", i))
    return Lane(kind=kind, label="draft head, γ = 2" if kind != "plain" else "plain decoding", wall_ms=t,
                total_ms=t - 0.3, tokens=tokens, spans=spans, rounds=rounds, text="".join(texts),
                target_passes=len(texts) + 1, tokens_per_pass=len(texts) / (len(texts) + 1))


def _race(spec_ids=None, greedy=True, others=0) -> Race:
    texts = ["Hello", EVIL, " world", "\n"]
    return Race(settings={}, plain=_lane("plain", texts, 30.0), spec=_lane("speculative", texts, 18.0, spec_ids),
                order=["spec", "base", "base", "spec"], spec_ms_per_token=[20.0, 21.0],
                base_ms_per_token=[31.0, 30.0], greedy=greedy, machine="AMD EPYC (2 cores, 2 threads)",
                measured_at="2026-12-04T03:50:00", others_max=others)


def _data_of(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="race-data">(.*?)</script>', html, re.S)
    assert m, "no data element"
    return json.loads(m.group(1))


def test_model_text_reaches_the_player_only_as_escaped_json():
    race = _race()
    html = player_html(race)
    assert EVIL not in html and "<img" not in html and "\u2028" not in html
    # exactly one data element and the fixed script: no token closed the element early
    assert html.count("</script>") == 2
    data = _data_of(html)
    assert [t[1] for t in data["lanes"][1]["tokens"]] == ["Hello", EVIL, " world", "\n"]
    # the script writes model text with textContent and title only
    script = html.split('id="race-data">', 1)[1].split("</script>", 2)[1]
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "document.write" not in script
    assert json.loads(json_for_script({"a": "</script>"})) == {"a": "</script>"}


def test_player_data_carries_the_engine_numbers():
    race = _race()
    d = player_data(race, speed=0.25, present=True)
    assert d["speed"] == 0.25 and d["present"] and d["duration"] == race.duration_ms
    plain, spec = d["lanes"]
    assert plain["final"]["tokens_per_s"] == pytest.approx(race.plain.tokens_per_s)
    assert spec["final"]["passes"] == race.spec.target_passes
    assert spec["final"]["tokens_per_pass"] == pytest.approx(race.spec.tokens_per_pass)
    assert spec["ttft"] == race.spec.ttft_ms and plain["wall"] == race.plain.wall_ms
    assert [s[0] for s in spec["spans"]] == [s.kind for s in race.spec.spans]
    assert spec["steps"]["0"] == 2 and d["first_difference"] is None
    assert d["verdict"] == verdict_line(race) and "slow motion" in d["pace"]


def test_verdicts():
    race = _race()
    assert verdict_line(race).startswith(f"TEXT IDENTICAL (4 tokens) · {race.speedup:.2f}× wall-clock")
    assert verdict_line(race).endswith(f"{race.spec.tokens_per_pass:.2f} vs {race.plain.tokens_per_pass:.2f} tokens "
                                       "per target pass")
    greedy_diff = _race(spec_ids=[0, 1, 7, 3])
    assert greedy_diff.first_difference == 2
    assert verdict_line(greedy_diff).startswith("TEXT DIFFERS from token 3")
    assert "UNSURE" not in verdict_line(race)
    race.spec_ms_per_token = [20.0, 41.0]  # one run twice as slow as the other: a busy machine
    assert verdict_line(race).endswith("UNSURE: the machine was busy (runs of one kind differed up to 2.0×)")
    sampled = _race(spec_ids=[0, 9, 7, 3], greedy=False)
    assert verdict_line(sampled).startswith("Sampled: texts differ from token 2")
    assert player_data(sampled)["words"]["differ"].startswith("texts differ")


def test_what_the_page_says_about_the_race():
    race = _race()
    line = honesty_line(race, 1.0)
    assert "one after the other" in line and "A B B A" in line and "measured pace" in line
    assert "AMD EPYC (2 cores, 2 threads)" in line
    rec = honesty_line(race, 0.5, recorded=True)
    assert rec.startswith("A recorded race, measured on AMD EPYC (2 cores, 2 threads), 2026-12-04")
    assert room_line(race) is None
    assert "up to 3 other readers" in room_line(_race(others=3))
    assert "shared the server's cores" in room_line(_race(others=3))
    shared = _race(others=2)
    shared.rows_max = 5  # the lanes stepped through the room: some passes had 5 rows
    line = room_line(shared)
    assert "up to 2 other readers" in line and "shared the room's passes with their rows (up to 5 rows a pass)" in line
    alone = _race()
    alone.rows_max = 1  # through the room, every pass its own row: nothing to say
    assert room_line(alone) is None
    hover = round_hover(race.spec, race.spec.rounds[0])
    assert "drafted 2 (2 draft calls" in hover and "accepted" in hover and "p 0.900, q 0.800" in hover
    assert "Round 1: one target pass" in round_hover(race.plain, race.plain.rounds[0])
    race.spec.rounds[0].prefill_tokens = 12
    assert "which also prefilled the prompt's 12 tokens" in round_hover(race.spec, race.spec.rounds[0])


def test_join_address():
    assert join_address("http://192.168.1.20:8501/race?present=1&rc_gamma=2", env={}).url == "http://192.168.1.20:8501/"
    local = join_address("http://localhost:8501/race", env={})
    assert local.local_only and local.source == "request"
    assert join_address("http://127.0.0.1:8501/", env={}).local_only
    assert join_address("http://[::1]:8501/", env={}).local_only
    assert not join_address("https://lab.example.org/", env={}).local_only
    op = join_address("http://localhost:8501/", env={PUBLIC_URL_ENV: " https://talk.example.org/lab "})
    assert (op.url, op.source, op.local_only) == ("https://talk.example.org/lab", "setting", False)
    for bad in ("ftp://x/", "javascript:alert(1)", "http://", "http://a b/"):
        with pytest.raises(InputError, match=PUBLIC_URL_ENV):
            join_address(None, env={PUBLIC_URL_ENV: bad})
    with pytest.raises(InputError, match=PUBLIC_URL_ENV):
        join_address(None, env={})


def test_qr_png_is_a_png_of_the_address():
    import segno
    from PIL import Image

    url = "http://192.168.1.20:8501/"
    png = qr_png(url, scale=4, border=2)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(png)).convert("L")
    qr = segno.make(url, error="m", micro=False)
    n = len(qr.matrix)
    assert img.size == ((n + 4) * 4, (n + 4) * 4)
    # every module's pixel is the matrix's bit (dark = 1), so the image is the code of this address
    for y, row in enumerate(qr.matrix):
        for x, bit in enumerate(row):
            assert (img.getpixel(((x + 2) * 4 + 1, (y + 2) * 4 + 1)) < 128) == bool(bit)
    with pytest.raises(InputError):
        qr_png("")
    with pytest.raises(InputError):
        qr_png(url, scale=0)


@pytest.mark.parametrize("present", [False, True])
def test_a_lane_text_box_holds_whole_lines(present):
    """The lane's text box is a whole number of its lines tall, so no line is cut through its letters."""
    html = player_html(_race(), present=present)
    css = re.search(r"\.text \{([^}]*)\}", html).group(1)
    height = float(re.search(r"height: ([0-9.]+)em;", css).group(1))
    line = float(re.search(r"line-height: ([0-9.]+);", css).group(1))
    assert height / line == pytest.approx(round(height / line)) and round(height / line) >= 4
