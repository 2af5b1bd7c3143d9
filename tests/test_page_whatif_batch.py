"""AppTest: What-if's "When it does not help" measured sweep (run, charts, bad input) and Common mistakes #1's
measured numbers. The page's model is swapped for a tiny random Llama (the draft head becomes early exit,
which a tiny target has) so the test runs in seconds; the Chromium test runs the real embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import app.resources
import engine.decoding.batch as batch_mod
from engine.decoding.models import load_model
from tests.tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
PAGE = str(ROOT / "pages" / "whatif.py")
MAIN = str(ROOT / "app" / "main.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("wb") / "m", layers=2, seed=2)), device="cpu")


@pytest.fixture
def patched(monkeypatch, tiny, tmp_path):
    monkeypatch.setenv("SPEEDUP_LAB_CACHE", str(tmp_path / "cache"))  # sweeps remembered per machine go here
    real = batch_mod.batch_sweep
    calls = []

    def sweep(target, prompts, methods=(), **kw):
        calls.append(list(methods))
        return real(target, prompts, methods=[("early-exit:1" if m == "embedded-head" else m) for m in methods], **kw)

    monkeypatch.setattr(app.resources, "get_model", lambda spec="embedded", **kw: tiny)
    monkeypatch.setattr(batch_mod, "batch_sweep", sweep)
    real_mm = batch_mod.measure_machine
    monkeypatch.setattr(batch_mod, "measure_machine", lambda device="cpu": real_mm(device, matmul_n=256, copy_mb=8))
    return calls


def _tab(**qp) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.query_params["wi_tab"] = "When it does not help"
    for k, v in qp.items():
        at.query_params[k] = str(v)
    return at.run()


def test_measured_sweep_runs_and_draws_model_and_measurement(patched):
    at = _tab(wi_bs_batches="1, 2", wi_bs_tokens=4)
    assert not at.exception
    m = {x.label: x.value for x in at.metric}
    assert m["Memory bandwidth (measured)"].endswith("GB/s") and m["Matmul throughput (measured)"].endswith("GFLOP/s")
    # dated, and in the same words as the KV-cache page (one stored measurement: engine.explain.machine)
    words = next(c.value for c in at.caption if "GB/s memory bandwidth and" in c.value)
    assert f"{m['Memory bandwidth (measured)'].split()[0]} GB/s memory bandwidth" in words and " on 20" in words
    assert any("No measured sweep" in i.value for i in at.info)
    at.button(key="wi_bs_run").click().run()
    assert not at.exception and not at.error
    assert patched == [["plain", "ngram", "embedded-head"]]
    sweep = at.session_state["batch_sweep"]
    assert sorted({c.batch for c in sweep.cells}) == [1, 2] and not sweep.stopped
    specs = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    fig = next(v for k, v in specs.items() if k.startswith("Speculative ÷ plain tokens/s"))
    names = [t["name"] for t in fig["data"]]
    assert "prompt lookup: measured" in names and "prompt lookup: roofline model" in names
    measured = next(t for t in fig["data"] if t["name"] == "prompt lookup: measured")
    assert measured["x"] == [1, 2]
    assert measured["y"] == pytest.approx([sweep.cell("ngram", b).speedup for b in (1, 2)])
    assert any(k.startswith("Target pass time against tokens") for k in specs)
    # a later session on this machine shows the remembered sweep (engine.explain.batch_view.machine_sweep)
    again = _tab()
    assert not again.exception and "batch_sweep" not in again.session_state
    assert any("Measured on this machine earlier" in c.value for c in again.caption)
    assert any(json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Speculative ÷ plain tokens/s")
               for c in again.get("plotly_chart"))
    labels = [x.label for x in at.metric]
    assert "prompt lookup: slower than plain from (measured)" in labels
    assert at.query_params["wi_bs_batches"] in (["1, 2"], "1, 2")
    # the table names the methods as the page does; the model-vs-measured paragraph gives both numbers at B = 1
    cols = next(list(t.value.columns) for t in [*at.dataframe, *at.table] if "batch" in t.value.columns)
    assert {"plain decoding tok/s", "prompt lookup ×plain"} <= set(cols) and not any("ngram" in c for c in cols)
    why = next(x.value for x in at.markdown if "Why the model and the measurement disagree" in x.value)
    assert "drafting" in why and "judging" in why and "per-row" in why
    assert f"prompt lookup: model " in why and f"measured {sweep.cell('ngram', 1).speedup:.2f}× at B = 1" in why


def test_stop_keeps_the_batches_measured_so_far(patched, tiny):
    at = _tab()
    part = batch_mod.batch_sweep(tiny, batch_mod.SWEEP_PROMPTS[:2], batches=[1, 2], methods=["plain", "ngram"],
                                 max_new_tokens=3, warmup=False)
    part.cells = [c for c in part.cells if c.batch == 1]  # as if Stop came during batch 2
    at.session_state["wi_bs_partial"] = part
    at.button(key="wi_bs_stop").click().run()
    assert not at.exception
    assert at.session_state["batch_sweep"].stopped
    assert any("Stopped: showing the 1 batch size(s) measured" in w.value for w in at.warning)
    empty = batch_mod.BatchSweep(batches=[1], methods=["plain"], max_new_tokens=3, reps=1)
    at.session_state["wi_bs_partial"] = empty
    at.button(key="wi_bs_stop").click().run()
    assert any("nothing was measured" in w.value for w in at.warning)


@pytest.mark.parametrize("batches,msg", [("0", "at least one sequence"), ("64", "needs 64 different prompts"),
                                         ("two", "whole numbers"), ("4096", "does not fit in memory")])
def test_bad_batch_input_gives_a_clear_message(patched, monkeypatch, batches, msg):
    if batches == "4096":
        monkeypatch.setattr(batch_mod, "available_memory_bytes", lambda device: 10**6)
    at = _tab(wi_bs_batches=batches, wi_bs_tokens=4)
    at.button(key="wi_bs_run").click().run()
    assert not at.exception
    assert any(msg in e.value for e in at.error), [e.value for e in at.error]
    assert patched == []  # refused before any run


def test_mistake_1_uses_the_session_sweep_else_the_shipped_file(patched, tmp_path, monkeypatch, tiny):
    import engine.explain.batch_view as bv

    sweep = bv.BatchSweep.from_dict(json.loads(json.dumps(
        batch_mod.batch_sweep(tiny, batch_mod.SWEEP_PROMPTS[:2], batches=[1, 2], methods=["plain", "ngram"],
                              max_new_tokens=3, warmup=False).to_dict())))
    f = tmp_path / "batch.json"
    f.write_text(json.dumps({"sweep": sweep.to_dict(), "machine": {"bandwidth_gbs": 10.0, "peak_tflops": 0.05}}))
    monkeypatch.setattr(bv, "SHIPPED_SWEEP", f)
    at = AppTest.from_file(MAIN, default_timeout=120).run()
    at.switch_page(str(ROOT / "pages" / "mistakes.py")).run()
    assert not at.exception
    cap = " ".join(c.value for c in at.caption)
    assert "the shipped benchmark result" in cap and "bench_batch.py" in cap
    assert "an earlier machine (not recorded)" in cap  # this file names no machine
    # another machine's figure says so in the sentence, not only in the caption
    assert any("Measured on another machine (not recorded), by the shipped benchmark" in md.value for md in at.markdown)
    m = {x.label: x.value for x in at.metric}
    assert m["Speedup at batch 2"] == f"{sweep.cell('ngram', 2).speedup:.2f}×"
    f.write_text(json.dumps({"sweep": sweep.to_dict(), "machine": {"bandwidth_gbs": 10.0, "peak_tflops": 0.05},
                             "machine_meta": {"cpu": "Test CPU 9000", "compute": "onednn"}}))
    at.run()
    assert "measured on Test CPU 9000 with the onednn compute path" in " ".join(c.value for c in at.caption)
    assert any("Measured on another machine (Test CPU 9000)" in md.value for md in at.markdown)
    bv.save_machine_sweep(sweep, "embedded", "test kernels")  # a sweep measured here earlier beats the shipped one
    at.run()
    cap = " ".join(c.value for c in at.caption)
    assert "this machine's last sweep" in cap and "test kernels" in cap and "shipped" not in cap
    assert any("Measured on this machine" in md.value for md in at.markdown)
    at.session_state["batch_sweep"] = sweep
    at.run()
    assert "this session's sweep" in " ".join(c.value for c in at.caption)
    assert any("Measured on this machine" in md.value for md in at.markdown)


def test_presenter_mode_marks_the_rooms_live_batch(patched, tiny, monkeypatch):
    import threading

    import engine.decoding.scheduler as sched

    monkeypatch.setattr(sched, "WINDOW_S", 600.0)  # a busy machine must not age the passes out mid-test

    from app.tour import PRESENT_KEY
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.scheduler import room_for
    from engine.decoding.speculative import SpeculativeDecoder

    sweep = batch_mod.batch_sweep(tiny, batch_mod.SWEEP_PROMPTS[:4], batches=[1, 2, 4], methods=["plain", "ngram"],
                                  max_new_tokens=3, warmup=False)
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.query_params["wi_tab"] = "When it does not help"
    at.session_state["batch_sweep"] = sweep
    at.session_state[PRESENT_KEY] = True
    at.run()
    assert not at.exception
    assert any("The room (readers on the Live page) is idle" in m.value for m in at.markdown)
    room = room_for(tiny)  # two readers run together in the target's room: passes of 2 rows
    decs = [SpeculativeDecoder(tiny, None, [3, 4, 5 + i], sampling=SamplingConfig(), max_new_tokens=30,
                               stop_on_eos=False) for i in range(2)]
    for d in decs:
        room.prefill(d)
    tickets = [room.submit(d, None) for d in decs]
    ths = [threading.Thread(target=t.wait) for t in tickets]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    stats = room.stats()
    b = round(stats.rows_per_pass)
    assert b >= 1
    at.run()
    assert not at.exception
    text = next(m.value for m in at.markdown if "The room's live batch" in m.value)
    assert f"The room's live batch: {b} reader" in text and "prompt lookup" in text
    spec = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Speculative ÷ plain tokens/s"))
    assert any(s.get("type") == "line" and s.get("x0") == b for s in spec["layout"].get("shapes", []))
    assert any(f"the room now: B = {b}" in a.get("text", "") for a in spec["layout"]["annotations"])


def test_what_bytes_cost_draws_the_formats_under_the_bandwidth_line(patched):
    """The weight formats' measured points (the shipped bench_formats result) under this machine's measured
    bandwidth ceiling, their pass-cost curves, and the lesson with the measured numbers (engine.explain.weight_bytes)."""
    from engine.explain.weight_bytes import ceiling_tokens_per_s, format_points, peer_point

    at = _tab()
    assert not at.exception
    assert any(h.value == "What bytes cost" for h in at.subheader)
    specs = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    fig = specs["Tokens/s against the weight MB a token reads"]
    points, meta = format_points()
    plain = next(t for t in fig["data"] if t["name"] == "plain decoding, measured")
    assert plain["x"] == pytest.approx([p.mb_per_token for p in points])
    assert plain["y"] == pytest.approx([p.tokens_per_s for p in points])
    line = next(t for t in fig["data"] if t["name"].startswith("this machine's copy bandwidth"))
    bw = float(line["name"].split("bandwidth (")[1].split(" GB/s")[0])
    assert line["y"][0] == pytest.approx(ceiling_tokens_per_s(bw, line["x"][0]), rel=0.01)
    curves = specs["A pass over k tokens ÷ a one-token pass"]
    assert {t["name"] for t in curves["data"]} == {p.label for p in points}
    lesson = next(m.value for m in at.markdown if "fewer bytes a token make plain decoding faster" in m.value)
    assert f"{points[0].tokens_per_s:.1f} tokens/s" in lesson and f"{points[-1].head_speedup:.2f}×" in lesson
    assert any("bench_formats.py" in c.value and meta["file"] in c.value for c in at.caption)
    peer = peer_point()
    assert peer is not None  # the reference machine's bench_peer result records the GGUF's bytes
    dot = next(t for t in fig["data"] if t["name"].startswith("llama.cpp plain"))
    assert dot["x"] == pytest.approx([peer.mb_per_token]) and dot["y"] == pytest.approx([peer.tokens_per_s])
    said = next(m.value for m in at.markdown if m.value.startswith("llama.cpp reads the same GGUF"))
    assert f"{peer.tokens_per_s:.1f} tokens/s" in said and f"{peer.mb_per_token:.0f} MB a token" in said
    assert any("bench_peer.py" in c.value and peer.meta["file"] in c.value for c in at.caption)
