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
