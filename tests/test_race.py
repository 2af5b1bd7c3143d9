"""The race (engine/decoding/race.py): the recorded timeline, the playback model, the A B B A runs and the JSON record;
exact checks on a stub decoder with a fake clock, real runs on a tiny random Llama, and the timing checks on the
embedded model (slow)."""

from __future__ import annotations

import json
import time

import pytest

from engine.decoding.drafts import make_proposer
from engine.decoding.models import load_model
from engine.decoding.race import (PASS_KINDS, PLAIN, SPEC, Race, RaceStopped, finish_time, lane_at, lane_summary,
                                  load_race, measured_speedup, playback_times, race_at, record_lane,
                                  replayed_speedup, run_race, save_race, survival)
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
from engine.decoding.trace import DraftPosition, Round, run_stats
from engine.errors import InputError
from tests.tiny_models import save_tiny_llama

PROMPT_IDS = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats itself: prompt lookup finds matches


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("race") / "t", layers=3)), device="cpu")


def _decoder(target, kind: str | None, max_new: int = 24, temperature: float = 0.0, seed: int = 0, gamma: int = 3):
    proposer = None if kind is None else make_proposer(kind, target)
    return SpeculativeDecoder(target, proposer, PROMPT_IDS, gamma=gamma, seed=seed, max_new_tokens=max_new,
                              sampling=SamplingConfig(temperature=temperature), stop_on_eos=False)


# ------------------------------------------------------------------------------------------ exact: a stub decoder
class FakeClock:
    """Seconds, advanced by hand: the stub decoder's step moves it by the round's scripted duration."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StubDecoder:
    """Scripted rounds: (prefill ms of its own pass or 0, draft ms, verify ms, tokens fed, draft verdicts, emitted
    ids, next kind, bookkeeping ms); each step moves the clock by prefill + draft + verify + bookkeeping."""

    def __init__(self, clock: FakeClock, script, proposer=object()):
        self.clock, self.script, self.proposer = clock, list(script), proposer
        self.rounds: list[Round] = []
        self.prefill_ms = 0.0
        self.prompt_ids = [1, 2, 3]
        self.finished = False
        self.new_ids: list[int] = []

    def token_text(self, t: int) -> str:
        return f"<{t}>"

    def step(self) -> Round:
        pre, d, v, fed, verdicts, emitted, kind, book = self.script[len(self.rounds)]
        if pre:
            self.prefill_ms = pre
        drafted = [DraftPosition(token_id=9, text="x", q=0.5, p=0.4, accept_prob=0.8, u=0.1, verdict=vd)
                   for vd in verdicts]
        rnd = Round(index=len(self.rounds), context_len=3 + len(self.new_ids), drafted=drafted,
                    n_accepted=sum(vd == "accepted" for vd in verdicts), next_token_id=emitted[-1], next_text="y",
                    next_kind=kind, next_top_p=[], residual_top=None, emitted_ids=list(emitted), draft_ms=d,
                    verify_ms=v, tokens_verified=fed)
        self.clock.now += (pre + d + v + book) / 1000
        self.rounds.append(rnd)
        self.new_ids += emitted
        self.finished = len(self.rounds) == len(self.script)
        return rnd

    def stats(self):
        total = sum(s[0] + s[1] + s[2] + s[7] for s in self.script[:len(self.rounds)])
        return run_stats(self.rounds, self.prefill_ms, total)

    def result(self):
        class R:
            text = "".join(self.token_text(t) for t in self.new_ids)
        return R()


SCRIPT = [  # a draft head's run: prefill of its own, then rounds of 3 drafts
    (40.0, 6.0, 30.0, 4, ["accepted", "accepted", "rejected"], [11, 12, 13], "correction", 2.0),
    (0.0, 5.0, 31.0, 4, ["accepted", "accepted", "accepted"], [14, 15, 16, 17], "bonus", 1.0),
    (0.0, 7.0, 29.0, 4, ["rejected", "discarded", "discarded"], [18], "correction", 3.0),
]


def test_spans_and_tokens_are_placed_exactly_from_the_step_and_its_measured_parts():
    clock = FakeClock()
    lane = record_lane(StubDecoder(clock, SCRIPT), SPEC, "stub draft", clock=clock)
    kinds = [(s.kind, s.round) for s in lane.spans]
    assert kinds == [("prefill", None), ("draft", 0), ("verify", 0), ("draft", 1), ("verify", 1), ("draft", 2),
                     ("verify", 2)]
    got = [x for s in lane.spans for x in (s.start_ms, s.end_ms)]
    # step 0 runs 0 → 78 ms (40 + 6 + 30 + 2), step 1 78 → 115, step 2 115 → 154
    want = [0, 40, 40, 46, 46, 76, 78, 83, 83, 114, 115, 122, 122, 151]
    assert got == pytest.approx(want)
    assert lane.wall_ms == pytest.approx(154.0)
    assert [m.t_ms for m in lane.tokens] == pytest.approx([78] * 3 + [115] * 4 + [154])
    assert [m.origin for m in lane.tokens] == ["accepted", "accepted", "correction", "accepted", "accepted",
                                               "accepted", "bonus", "correction"]
    assert lane.ttft_ms == pytest.approx(78.0)
    assert lane.tokens_per_s == pytest.approx(8 / 0.154)
    assert lane.pass_ms == pytest.approx(40 + 6 + 30 + 5 + 31 + 7 + 29)
    assert lane.target_passes == 4  # the prefill + 3 verify passes
    assert lane.tokens_per_pass == pytest.approx(8 / 4)
    assert lane.tokens_per_pass_counts() == {0: 1, 1: 1, 3: 1, 4: 1}  # the head's prefill pass yields no token
    assert [r.draft_steps for r in lane.rounds] == [3, 3, 3]  # one call per draft token (not a lookup or a block)
    assert survival(lane) == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert lane_summary(lane)["wall_s"] == pytest.approx(0.154)
    assert [m.text for m in lane.tokens] == [f"<{t}>" for t in range(11, 19)]


def test_the_end_of_sequence_token_is_no_text_in_a_lane():
    """A lane's token marks carry the text the player draws; the target's end-of-sequence token is none (it showed as
    a raw "<|im_end|>" at the end of the lanes), as the lane's text leaves it out."""
    from types import SimpleNamespace

    clock = FakeClock()
    dec = StubDecoder(clock, SCRIPT)
    dec.target = SimpleNamespace(eos_token_ids={17})
    lane = record_lane(dec, SPEC, "stub draft", clock=clock)
    assert [m.text for m in lane.tokens] == [f"<{t}>" if t != 17 else "" for t in range(11, 19)]
    assert [m.token_id for m in lane.tokens][6] == 17


def test_a_span_never_runs_past_its_step():
    clock = FakeClock()
    script = [(0.0, 5.0, 30.0, 4, ["accepted"], [1, 2], "bonus", 0.0)]
    dec = StubDecoder(clock, script)
    orig = dec.step

    def short_step():  # the measured parts add up to more than the step's outer time (a coarse clock)
        rnd = orig()
        clock.now -= 0.010
        return rnd
    dec.step = short_step
    lane = record_lane(dec, SPEC, "stub", clock=clock)
    assert lane.spans[-1].end_ms == pytest.approx(lane.wall_ms) and lane.wall_ms == pytest.approx(25.0)
    assert all(s.start_ms <= s.end_ms <= lane.wall_ms for s in lane.spans)


def test_playback_model_on_the_stub():
    clock = FakeClock()
    spec = record_lane(StubDecoder(clock, SCRIPT), SPEC, "stub", clock=clock)
    plain_script = [(40.0, 0.0, 0.0, 0, [], [11], "plain", 1.0)] + [
        (0.0, 0.0, 25.0, 1, [], [t], "plain", 1.0) for t in (12, 13, 14, 15, 16, 17, 18)]
    plain = record_lane(StubDecoder(clock, plain_script, proposer=None), PLAIN, "plain decoding", clock=clock)
    assert [s.kind for s in plain.spans] == ["prefill"] + ["step"] * 7
    race = _race(plain, spec)
    f = lane_at(spec, 100.0)
    assert (f.tokens, f.passes, f.finished) == (3, 2, False) and f.active.kind == "verify"
    assert f.tokens_per_s == pytest.approx(3 / 0.1)
    assert lane_at(spec, -5).tokens == 0 and lane_at(spec, -5).tokens_per_s is None
    end = lane_at(spec, 10_000)
    assert end.finished and end.tokens == 8 and end.passes == 4 and end.t_ms == spec.wall_ms
    rf = race_at(race, 100.0)
    assert rf.compared == min(rf.plain.tokens, rf.spec.tokens) and rf.identical_so_far
    assert race.identical and race_at(race, race.duration_ms).finished
    # the playback's speedup is the lanes' tokens/s ratio
    assert replayed_speedup(race) == pytest.approx(race.speedup)
    assert replayed_speedup(race) == pytest.approx((plain.wall_ms / 8) / (spec.wall_ms / 8))


def _race(plain, spec, greedy: bool = True) -> Race:
    return Race(settings={"draft": "stub"}, plain=plain, spec=spec, order=["spec", "base", "base", "spec"],
                spec_ms_per_token=[spec.total_ms / 8] * 2, base_ms_per_token=[plain.total_ms / 8] * 2,
                greedy=greedy, machine="test CPU", measured_at="2026-12-04T00:00:00")


def test_playback_times_pace_and_frame_rate():
    clock = FakeClock()
    lane = record_lane(StubDecoder(clock, SCRIPT), SPEC, "stub", clock=clock)
    race = _race(lane, lane)
    for speed in (1.0, 0.25):
        times = playback_times(race, fps=30, speed=speed)
        assert times[0] == 0 and times[-1] == pytest.approx(race.duration_ms)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) <= 1000 * speed / 30 + 1e-9  # ≥ 30 frames a second of real time
        # each token shows at the first frame at or after its measured time: at most a frame late
        for i, m in enumerate(lane.tokens):
            shown = next(t for t in times if lane_at(lane, t).tokens > i)
            assert m.t_ms <= shown <= m.t_ms + 1000 * speed / 30 + 1e-9
    with pytest.raises(InputError):
        playback_times(race, fps=0)
    assert finish_time(lane) == pytest.approx(lane.wall_ms)


def test_differing_texts_are_reported_where_they_differ():
    clock = FakeClock()
    spec = record_lane(StubDecoder(clock, SCRIPT), SPEC, "stub", clock=clock)
    other = [(40.0, 0.0, 0.0, 0, [], [11], "plain", 1.0)] + [
        (0.0, 0.0, 25.0, 1, [], [t], "plain", 1.0) for t in (12, 99, 14, 15, 16, 17, 18)]
    plain = record_lane(StubDecoder(clock, other, proposer=None), PLAIN, "plain decoding", clock=clock)
    race = _race(plain, spec, greedy=False)
    assert not race.identical and race.first_difference == 2
    late = race_at(race, race.duration_ms)
    assert late.compared == 8 and not late.identical_so_far
    early = race_at(race, 70.0)  # plain shows 2 tokens (its prefill's and one step), speculative none yet
    assert early.compared == 0 and early.identical_so_far


# ------------------------------------------------------------------------------------------ real runs, tiny model
@pytest.mark.parametrize("kind", [None, "ngram", "early-exit:1"])
def test_every_token_and_pass_is_timestamped_and_monotone(tiny, kind):
    dec = _decoder(tiny, kind)
    lane = record_lane(dec, PLAIN if kind is None else SPEC, kind or "plain decoding")
    assert lane.token_ids == dec.new_ids and len(lane.tokens) == 24
    assert lane.text == dec.result().text
    times = [m.t_ms for m in lane.tokens]
    assert times == sorted(times) and times[0] > 0 and times[-1] == pytest.approx(lane.wall_ms)
    prev_end = 0.0
    for s in lane.spans:
        assert prev_end - 1e-9 <= s.start_ms <= s.end_ms <= lane.wall_ms + 1e-9
        prev_end = s.end_ms
    assert sum(1 for s in lane.spans if s.kind in PASS_KINDS) == lane.target_passes == dec.stats().target_passes
    # a token appears when its round's step ended, after its round's target pass (or the prefill's)
    ends = {r.index: r.end_ms for r in lane.rounds}
    for m in lane.tokens:
        assert m.t_ms == ends[m.round]
    for s in lane.spans:
        if s.round is not None:
            assert s.end_ms <= ends[s.round] + 1e-9
    assert sum(lane.tokens_per_pass_counts().values()) == lane.target_passes
    assert sum(k * n for k, n in lane.tokens_per_pass_counts().items()) == lane.new_tokens
    if kind is None:
        assert [m.origin for m in lane.tokens] == ["plain"] * 24
        assert lane.tokens_per_pass == pytest.approx(1.0)
        assert lane.tokens_per_pass_counts() == {1: 24}  # the prefill's pass gives the first token
    else:
        assert {m.origin for m in lane.tokens} <= {"accepted", "correction", "bonus", "plain"}
        # prompt lookup and early exit fuse the prefill into the first verify pass: no prefill span of its own
        assert lane.rounds[0].prefill_tokens == len(PROMPT_IDS) and "prefill" not in {s.kind for s in lane.spans}


def test_record_lane_refuses_a_used_decoder_and_stops(tiny):
    dec = _decoder(tiny, "ngram")
    dec.step()
    with pytest.raises(InputError):
        record_lane(dec, SPEC, "x")
    with pytest.raises(InputError):
        record_lane(_decoder(tiny, None), "fast", "x")
    calls = iter([False, False, True])
    with pytest.raises(RaceStopped):
        record_lane(_decoder(tiny, None), PLAIN, "plain", should_stop=lambda: next(calls))


def test_run_race_alternates_keeps_the_median_runs_and_greedy_texts_are_identical(tiny):
    progress = []
    race = run_race(lambda: _decoder(tiny, "early-exit:1"), lambda: _decoder(tiny, None), "early exit",
                    settings={"draft": "early-exit"}, machine="tiny CPU", greedy=True,
                    on_progress=lambda done, total, what: progress.append((done, total, what)), busy=lambda: 2)
    assert race.order == ["spec", "base", "base", "spec", "spec", "base"]
    assert progress == [(0, 7, "warm-up"), (1, 7, "spec"), (2, 7, "base"), (3, 7, "base"), (4, 7, "spec"),
                        (5, 7, "spec"), (6, 7, "base")]
    assert race.identical and race.first_difference is None
    assert race.plain.text == race.spec.text
    # the replayed lane of each kind is its median run (three runs each)
    assert race.spec.total_ms / race.spec.new_tokens == pytest.approx(sorted(race.spec_ms_per_token)[1])
    assert race.plain.total_ms / race.plain.new_tokens == pytest.approx(sorted(race.base_ms_per_token)[1])
    assert race.others_max == 2 and race.warm_ms > 0 and race.measure_ms > 0
    assert race.machine == "tiny CPU" and race.settings == {"draft": "early-exit"}


def test_sampled_race_same_seed_same_lanes(tiny):
    make_s = lambda: _decoder(tiny, "ngram", temperature=0.8, seed=7)  # noqa: E731
    make_b = lambda: _decoder(tiny, None, temperature=0.8, seed=7)  # noqa: E731
    a = run_race(make_s, make_b, "prompt lookup", greedy=False, warm_rounds=0, reps=1)
    b = run_race(make_s, make_b, "prompt lookup", greedy=False, warm_rounds=0, reps=1)
    assert a.order == ["spec", "base"]
    assert a.spec.token_ids == b.spec.token_ids and a.plain.token_ids == b.plain.token_ids
    with pytest.raises(ValueError):
        run_race(make_s, make_b, "x", reps=0)
    with pytest.raises(RaceStopped):
        run_race(make_s, make_b, "x", should_stop=lambda: True)


def test_json_round_trip(tiny, tmp_path):
    race = run_race(lambda: _decoder(tiny, "ngram", max_new=8), lambda: _decoder(tiny, None, max_new=8), "lookup",
                    warm_rounds=1, reps=1)
    path = tmp_path / "race.json"
    save_race(race, path)
    back = load_race(path)
    assert back.to_dict().keys() == race.to_dict().keys()
    assert back.spec.token_ids == race.spec.token_ids and back.plain.text == race.plain.text
    assert [s.start_ms for s in back.spec.spans] == pytest.approx([s.start_ms for s in race.spec.spans], abs=1e-4)
    assert back.spec.wall_ms == pytest.approx(race.spec.wall_ms, abs=1e-4)
    # each wall time is rounded to 4 decimals of a ms (an error of at most 5e-5 ms), so the speedup's relative
    # error is at most the sum of the two walls' relative errors
    bound = 5e-5 / race.spec.wall_ms + 5e-5 / race.plain.wall_ms
    assert back.speedup == pytest.approx(race.speedup, rel=bound * 1.001)
    d = json.loads(path.read_text())
    d["version"] = 99
    with pytest.raises(InputError, match="version"):
        Race.from_dict(d)
    del d["plain"]
    d["version"] = race.to_dict()["version"]
    with pytest.raises(InputError, match="lacks"):
        Race.from_dict(d)
    path.write_text("{not json")
    with pytest.raises(InputError):
        load_race(path)


# ------------------------------------------------------------------------------------------ the embedded model
@pytest.mark.slow
@pytest.mark.parametrize("draft", ["embedded-head", "ngram"])
def test_embedded_bars_add_up_and_the_replay_keeps_the_measured_ratio(embedded, draft):
    """On the real model: each lane's bars (target passes and draft phases) cover its wall time within 5 %, and the
    playback's speedup is the decoders' own measured tokens/s ratio within 2 %; greedy texts are identical."""
    from engine.explain.presets import preset_text

    ids = encode_prompt(embedded.tokenizer, preset_text("code" if draft == "ngram" else "chat"))

    def make(proposer_kind):
        def build():
            proposer = None if proposer_kind is None else make_proposer(proposer_kind, embedded)
            return SpeculativeDecoder(embedded, proposer, ids, gamma=3, max_new_tokens=32)
        return build

    # the heap frozen as the app's room freezes it (once per process), so no full collection over the loaded model's
    # objects pauses a lane: the lanes' own bookkeeping leaves 3.0-3.8 % of the wall time without a bar, and one pause
    # in a CI run made it 5.2 %
    from engine.decoding.scheduler import _freeze_heap_once

    _freeze_heap_once()
    race = run_race(make(draft), make(None), draft, greedy=True)
    for lane in (race.plain, race.spec):
        assert lane.pass_ms == pytest.approx(lane.wall_ms, rel=0.05), (lane.kind, lane.pass_ms, lane.wall_ms)
    assert replayed_speedup(race) == pytest.approx(measured_speedup(race), rel=0.02)
    assert race.identical


def test_a_race_through_the_room_shares_its_passes_and_records_their_rows(tiny):
    """Lanes built with ``Room.bind`` step through the room's passes: alone each pass has the lane's row only; with
    another reader decoding in the room, some of the lanes' rounds share a pass with its row, and the race records
    the rows (``rows_max``) beside the readers (``others_max``); greedy texts stay identical to the lone race's."""
    import threading

    from engine.decoding.scheduler import Room

    room = Room(tiny, no_draft_above=None)
    try:
        rows = lambda: room.stats().last_pass_rows  # noqa: E731
        alone = run_race(lambda: room.bind(_decoder(tiny, "ngram")), lambda: room.bind(_decoder(tiny, None)), "lookup",
                         reps=1, warm_rounds=0, busy=room.readers, pass_rows=rows)
        assert alone.identical and alone.rows_max == 1 and alone.others_max == 0
        assert {r.rows for r in alone.spec.rounds} == {1}
        stop = threading.Event()

        def other_reader():  # a reader that keeps decoding while the race runs
            while not stop.is_set():
                room.run(_decoder(tiny, None, max_new=64))

        t = threading.Thread(target=other_reader, daemon=True)
        t.start()
        try:
            time.sleep(0.05)
            shared = run_race(lambda: room.bind(_decoder(tiny, "ngram")), lambda: room.bind(_decoder(tiny, None)),
                              "lookup", reps=1, warm_rounds=0, busy=room.readers, pass_rows=rows)
        finally:
            stop.set()
            t.join(timeout=30)
        assert shared.rows_max >= 2 and shared.others_max >= 1
        assert shared.spec.token_ids == alone.spec.token_ids and shared.identical
        again = Race.from_dict(json.loads(json.dumps(shared.to_dict())))
        assert again.rows_max == shared.rows_max and [r.rows for r in again.spec.rounds] == [r.rows for r in shared.spec.rounds]
    finally:
        room.close()
