"""engine.explain.batch_view and the measured mistake #1: hand-built sweeps, hand-computed numbers."""

import json
from pathlib import Path

import pytest

from engine.decoding.batch import BatchSweep, SweepCell
from engine.errors import InputError
from engine.explain.analytic import batch_speedup_curve
from engine.explain.batch_view import measured_batch_view, model_speedup_at, readable_table, shipped_sweep
from engine.explain.teaching import measured_batch_mistake


def _cell(method, batch, tps, speedup=None, alpha=None, draft=None, pass_ms=40.0, gamma=4):
    return SweepCell(method=method, batch=batch, gamma=gamma if method != "plain" else 0, tokens_per_s=tps,
                     runs_tokens_per_s=[tps], new_tokens=16 * batch, target_passes=17, pass_tokens=batch,
                     pass_ms=pass_ms, acceptance_rate=alpha, draft_ms_per_round=draft, speedup=speedup)


def _sweep():
    cells = [_cell("plain", 1, 20.0), _cell("ngram", 1, 30.0, 1.5, alpha=0.6, draft=0.8),
             _cell("embedded-head", 1, 26.0, 1.3, alpha=0.5, draft=8.0, gamma=2),
             _cell("plain", 4, 60.0), _cell("ngram", 4, 48.0, 0.8, alpha=0.6, draft=3.0),
             _cell("embedded-head", 4, 66.0, 1.1, alpha=0.5, draft=30.0, gamma=2)]
    return BatchSweep(batches=[1, 4], methods=["plain", "ngram", "embedded-head"], max_new_tokens=16, reps=1,
                      cells=cells, passes=[("plain", 1, 1, 40.0), ("ngram", 1, 5, 50.0), ("ngram", 1, 5, 60.0)],
                      params=135_000_000, bytes_per_param=4.0)


def test_view_by_hand():
    v = measured_batch_view(_sweep(), {"bandwidth_gbs": 10.0, "peak_tflops": 0.05})
    ng, head = v.methods
    assert ng.label == "prompt lookup" and ng.batches == [1, 4] and ng.measured == [1.5, 0.8]
    assert ng.measured_crossover == 4 and head.measured_crossover is None
    # c = (0.8 ms per round ÷ 1 row ÷ γ 4) ÷ 40 ms plain pass = 0.005; α̂ at the smallest batch
    assert ng.c == pytest.approx(0.005) and ng.alpha == 0.6 and ng.gamma == 4
    # head: 8 ms ÷ 2 ÷ 40 = 0.1
    assert head.c == pytest.approx(0.1)
    ref = batch_speedup_curve(0.6, 4, 0.005, 0.135, 4.0, 10.0, 0.05, max_batch=64)
    assert ng.model_speedups == ref.speedups and ng.model_crossover == ref.crossover_batch
    # pass curve: medians by tokens; roofline: 135e6·4 B / 10 GB/s = 54 ms (memory-bound); 5 tokens:
    # 2·135e6·5 / 5e10 = 27 ms < 54 → 54
    assert v.pass_tokens == [1, 5] and v.pass_ms == [40.0, 55.0]
    assert v.model_pass_ms == pytest.approx([54.0, 54.0])
    assert v.weight_ms == pytest.approx(54.0)
    # ridge: 4 · 5e10 / (2 · 1e10) = 10 tokens
    assert v.ridge_tokens == pytest.approx(10.0)
    assert v.plain_tokens_per_s == {1: 20.0, 4: 60.0}


def test_readable_table_names_the_methods():
    rows = readable_table(_sweep().table())
    assert list(rows[0]) == ["batch", "plain decoding tok/s", "prompt lookup tok/s", "prompt lookup ×plain",
                             "prompt lookup pass tokens", "draft head (EAGLE-style) tok/s",
                             "draft head (EAGLE-style) ×plain", "draft head (EAGLE-style) pass tokens"]
    assert rows[0]["prompt lookup ×plain"] == 1.5 and rows[1]["batch"] == 4
    assert not any("ngram" in k or "embedded-head" in k for r in rows for k in r)
    assert readable_table([{"batch": 1, "other-method tok/s": 2.0}]) == [{"batch": 1, "other-method tok/s": 2.0}]


def test_model_speedup_at_a_measured_batch():
    ng = measured_batch_view(_sweep(), {"bandwidth_gbs": 10.0, "peak_tflops": 0.05}).methods[0]
    ref = batch_speedup_curve(0.6, 4, 0.005, 0.135, 4.0, 10.0, 0.05, max_batch=64)
    assert model_speedup_at(ng, 1) == ref.speedups[ref.batches.index(1)]
    assert model_speedup_at(ng, 4) == ref.speedups[ref.batches.index(4)]
    assert model_speedup_at(ng, 10_000) is None  # past the curve's batches


def test_view_needs_plain_decoding():
    sw = _sweep()
    sw.cells = [c for c in sw.cells if c.method != "plain"]
    with pytest.raises(InputError, match="plain"):
        measured_batch_view(sw, {"bandwidth_gbs": 10.0, "peak_tflops": 0.05})


def test_measured_mistake_prefers_the_head_and_names_its_source():
    mb = measured_batch_mistake(_sweep(), "this session's sweep")
    assert (mb.method, mb.small_batch, mb.speedup_small, mb.large_batch, mb.speedup_large, mb.crossover_batch) == \
           ("embedded-head", 1, 1.3, 4, 1.1, None)
    # how the sweep was run comes from the sweep itself (the page said "once, 12 tokens, 32 prompts" for any file)
    assert (mb.reps, mb.max_new_tokens, mb.prompts) == (1, 16, 4)
    assert mb.run_note == "each cell timed once (no spread measured), up to 16 new tokens per row, 4 prompts at " \
                          "the largest batch"
    sw = _sweep()
    sw.reps = 3
    assert measured_batch_mistake(sw, "x").run_note.startswith("each cell timed 3 times (the median run)")
    sw.methods = ["plain", "ngram"]
    mb = measured_batch_mistake(sw, "x")
    assert mb.method == "ngram" and mb.crossover_batch == 4 and mb.source == "x"
    sw.methods = ["plain"]
    assert measured_batch_mistake(sw, "x") is None


def test_shipped_sweep_file(tmp_path):
    assert shipped_sweep(tmp_path / "missing.json") is None
    f = tmp_path / "b.json"
    f.write_text(json.dumps({"sweep": _sweep().to_dict(), "machine": {"bandwidth_gbs": 1.0, "peak_tflops": 1.0}}))
    sw, machine = shipped_sweep(f)
    assert sw.crossover == {"ngram": 4, "embedded-head": None} and machine["bandwidth_gbs"] == 1.0
    f.write_text("{}")
    with pytest.raises(InputError, match="not a batch sweep"):
        shipped_sweep(f)


def test_machine_sweep_is_remembered_per_machine_and_target(tmp_path, monkeypatch):
    """A complete sweep is kept in the user cache under this machine's key and read back as it was; a stopped or
    empty one is not kept; another CPU model or another target finds nothing; a broken file reads as nothing."""
    import engine.decoding.compute as compute
    from engine.explain import batch_view as bv

    store = tmp_path / "cache" / bv.MACHINE_SWEEPS
    assert bv.machine_sweep("embedded", store) is None
    sw = _sweep()
    assert bv.save_machine_sweep(sw, "embedded", "stream kernels", store)
    got, meta = bv.machine_sweep("embedded", store)
    assert got.to_dict() == sw.to_dict() and meta["compute"] == "stream kernels" and meta["cpu"] == compute.cpu_model()
    assert bv.machine_sweep("another/model", store) is None
    stopped = BatchSweep.from_dict(sw.to_dict())
    stopped.stopped = True
    assert not bv.save_machine_sweep(stopped, "other", "x", store) and bv.machine_sweep("other", store) is None
    monkeypatch.setattr(compute, "cpu_model", lambda: "Another CPU")
    assert bv.machine_sweep("embedded", store) is None
    store.write_text("not json")
    assert bv.machine_sweep("embedded", store) is None
    # a file that is not a store of sweeps is never overwritten; a path that names no file is refused, not raised
    assert not bv.save_machine_sweep(sw, "embedded", "x", store) and store.read_text() == "not json"
    store.write_text('{"other": 1}')
    assert not bv.save_machine_sweep(sw, "embedded", "x", store) and store.read_text() == '{"other": 1}'
    assert not bv.save_machine_sweep(sw, "embedded", "x", Path("/"))
    store.unlink()
    other = tmp_path / "elsewhere.json"  # $SPEEDUP_LAB_SWEEPS moves the default file (the browser tests' server)
    monkeypatch.setenv(bv.SWEEPS_ENV, str(other))
    assert bv.save_machine_sweep(sw, "embedded", "x") and other.is_file() and bv.machine_sweep("embedded") is not None


def test_room_marker_by_hand():
    from types import SimpleNamespace

    from engine.explain.batch_view import room_batch, room_marker

    v = measured_batch_view(_sweep(), {"bandwidth_gbs": 10.0, "peak_tflops": 0.05})
    m = room_marker(v, 2)
    # B = 2 is halfway between 1 and 4 in log B: prompt lookup (1.5 + 0.8) / 2, the head (1.3 + 1.1) / 2
    assert m.speedups["prompt lookup"] == (pytest.approx(1.15), "measured")
    assert m.speedups["draft head (EAGLE-style)"] == (pytest.approx(1.2), "measured")
    assert m.text.startswith("The room's live batch: 2 readers per target pass. At that batch: prompt lookup 1.15×")
    far = room_marker(v, 8)  # past the measured batches: the roofline model's curve at B = 8
    ng = v.methods[0]
    assert far.speedups["prompt lookup"] == (pytest.approx(ng.model_speedups[ng.model_batches.index(8)]),
                                             "roofline model")
    assert room_marker(v, 1).speedups["prompt lookup"] == (1.5, "measured")
    assert room_batch(SimpleNamespace(rows_per_pass=11.54, readers_now=14)) == 12
    assert room_batch(SimpleNamespace(rows_per_pass=None, readers_now=3)) == 3
    assert room_batch(SimpleNamespace(rows_per_pass=None, readers_now=0)) is None


def test_weight_bytes_per_param_counts_the_bytes_as_read_by_hand():
    """On the "stream" path the roofline's bytes are the linear layers' as read (their compact forms) over their
    weights: 111 MB for 538 MB of fp32 is 111e6 / (538e6 / 4) = 0.825 bytes a weight; off it (or with no formats)
    the parameters' element size."""
    from types import SimpleNamespace

    import torch

    from engine.decoding.batch import weight_bytes_per_param

    model = torch.nn.Linear(4, 4)
    stream = SimpleNamespace(model=model, compute=SimpleNamespace(
        path="stream", formats={"read_bytes": 111_000_000, "fp32_bytes": 538_000_000}))
    assert weight_bytes_per_param(stream) == pytest.approx(111e6 / (538e6 / 4))
    assert weight_bytes_per_param(SimpleNamespace(model=model, compute=SimpleNamespace(path="onednn", formats={
        "read_bytes": 1, "fp32_bytes": 4}))) == 4.0
    assert weight_bytes_per_param(SimpleNamespace(model=model, compute=None)) == 4.0
    assert weight_bytes_per_param(SimpleNamespace(model=model.half(), compute=None)) == 2.0
