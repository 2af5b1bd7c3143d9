"""The weight formats on the decode roofline (engine/explain/weight_bytes.py), by hand and on the shipped file."""

import json

import pytest

from engine.errors import InputError
from engine.explain.weight_bytes import ceiling_tokens_per_s, format_points


def test_ceiling_by_hand():
    # 20 GB/s over 111 MB a token: 20 000 / 111 = 180.2 tokens a second at most
    assert ceiling_tokens_per_s(20.0, 111.0) == pytest.approx(180.18, abs=0.01)
    with pytest.raises(InputError):
        ceiling_tokens_per_s(0.0, 111.0)
    with pytest.raises(InputError):
        ceiling_tokens_per_s(20.0, -1.0)


def test_points_by_hand(tmp_path):
    f = tmp_path / "formats.json"
    f.write_text(json.dumps({"meta": {"cpu": "Test CPU"}, "summary": {
        "fp32": {"read_mb": 500.0, "plain_tokens_per_s": 30.0, "head_tokens_per_s": 45.0, "gamma": 2,
                 "pass_ms": {"1": 30.0, "3": 30.0, "8": 45.0}},
        "blocks": {"read_mb": 100.0, "plain_tokens_per_s": 60.0, "head_tokens_per_s": 66.0, "gamma": 2,
                   "pass_ms": {"1": 15.0, "3": 18.0, "8": 30.0}}}}))
    points, meta = format_points(f)
    assert [p.name for p in points] == ["blocks", "fp32"] and meta["cpu"] == "Test CPU"
    blocks, fp32 = points
    assert blocks.read_gbs == pytest.approx(6.0) and fp32.read_gbs == pytest.approx(15.0)  # MB × tok/s ÷ 1000
    assert blocks.head_speedup == pytest.approx(1.1) and fp32.head_speedup == pytest.approx(1.5)
    assert blocks.pass_ratio == {1: 1.0, 3: pytest.approx(1.2), 8: pytest.approx(2.0)}
    assert fp32.pass_ratio[3] == pytest.approx(1.0)
    f.write_text("{}")
    with pytest.raises(InputError, match="Cannot read"):
        format_points(f)


def test_shipped_measurement_reads_and_blocks_read_fewer_bytes():
    points, meta = format_points()
    assert {p.name for p in points} == {"blocks", "fp32"} and meta.get("cpu")
    blocks = next(p for p in points if p.name == "blocks")
    fp32 = next(p for p in points if p.name == "fp32")
    assert blocks.mb_per_token < fp32.mb_per_token / 4 and blocks.tokens_per_s > fp32.tokens_per_s


def test_peer_point_reads_llamacpps_decode_rate_against_the_ggufs_bytes_by_hand(tmp_path):
    from engine.explain.weight_bytes import peer_point

    f = tmp_path / "peer.json"
    rows = {"chat": (100.0, 60.0), "code": (80.0, 70.0), "edit": (90.0, 50.0)}
    f.write_text(json.dumps({"meta": {"cpu": "Test CPU", "llama_read_mb": 96.5}, "results": {
        k: {"llama.cpp: plain": {"server_decode_tokens_per_s": a}, "ours: plain": {"decode_tokens_per_s": b}}
        for k, (a, b) in rows.items()}}))
    p = peer_point(f)
    # medians over the prompts: llama.cpp 90, ours 60; 96.5 MB × 90 tok/s = 8.685 GB/s
    assert p.tokens_per_s == 90.0 and p.ours_tokens_per_s == 60.0 and p.mb_per_token == 96.5
    assert p.read_gbs == pytest.approx(8.685) and p.meta["file"] == "peer.json" and p.meta["cpu"] == "Test CPU"
    # a result without the GGUF's bytes (an older bench_peer) or no file at all draws no llama.cpp point
    f.write_text(json.dumps({"meta": {}, "results": {"chat": {"llama.cpp: plain": {"server_decode_tokens_per_s": 9}}}}))
    assert peer_point(f) is None and peer_point(tmp_path / "missing.json") is None


def test_gguf_weight_bytes_counts_the_tensors_as_stored(tmp_path):
    import gguf
    import numpy as np

    from engine.explain.weight_bytes import gguf_weight_bytes

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("a", np.zeros((4, 8), dtype=np.float32))  # 32 × 4 bytes
    w.add_tensor("b", np.zeros((2, 16), dtype=np.float16))  # 32 × 2 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_weight_bytes(path) == 128 + 64
    with pytest.raises(InputError, match="Cannot read the GGUF"):
        gguf_weight_bytes(tmp_path / "missing.gguf")


def test_this_machines_result_is_read_when_the_repository_has_one(tmp_path):
    from engine.explain.measured import machine_slug, result_path

    assert machine_slug("AMD EPYC 7B13") == "amd-epyc" and machine_slug("Intel(R) Xeon(R) Processor") == "xeon"
    assert machine_slug("Apple M2 Pro") == "apple-m2-pro" and machine_slug("???") == "cpu"
    (tmp_path / "formats_xeon.json").write_text("{}")
    assert result_path("formats", "Intel(R) Xeon(R) Processor", tmp_path).name == "formats_xeon.json"
    assert result_path("formats", "Apple M2 Pro", tmp_path).name == "formats_amd-epyc.json"  # the reference
    assert result_path("peer", "Intel(R) Xeon(R) Processor", tmp_path).name == "peer_amd-epyc.json"


def test_points_above_the_ceiling_by_hand():
    from engine.explain.weight_bytes import FormatPoint, above_ceiling

    a = FormatPoint("blocks", "blocks", 100.0, 50.0, 55.0, 2, {1: 1.0})   # ceiling at 8 GB/s: 80 tok/s
    b = FormatPoint("fp32", "fp32", 500.0, 26.0, 30.0, 2, {1: 1.0})      # ceiling at 8 GB/s: 16 tok/s
    assert above_ceiling([a, b], 8.0) == [b]
    assert above_ceiling([a, b], 20.0) == []                              # 200 and 40 tok/s


def test_tree_pass_costs_read_the_tree_benchmarks_verify_table(tmp_path):
    from engine.explain.measured import tree_pass_costs

    f = tmp_path / "tree_test.json"
    f.write_text(json.dumps({"meta": {"machine_meta": {"cpu": "Test CPU", "compute": "stream"}}, "verify": {"rows": [
        {"tokens_fed": 2, "nodes": 1, "chain_ms": 10.0, "tree_ms": 16.0},
        {"tokens_fed": 9, "nodes": 8, "chain_ms": 20.0, "tree_ms": 30.0}]}}))
    got = tree_pass_costs(f)
    assert got == {"rows": [(2, 10.0, 16.0), (9, 20.0, 30.0)], "cpu": "Test CPU", "compute": "stream",
                   "file": "tree_test.json"}
    f.write_text(json.dumps({"meta": {}, "rows": []}))  # an older result without the pass table
    assert tree_pass_costs(f) is None
    assert tree_pass_costs(tmp_path / "missing.json") is None
    # the shipped result has the table
    shipped = tree_pass_costs()
    assert shipped is not None and all(t > 0 and c > 0 for _, c, t in shipped["rows"])
