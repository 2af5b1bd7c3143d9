"""A real llama-server (built from the llama-cpp-python 0.3.36 sdist) with ngram-simple speculation on the embedded
GGUF: requests move its counters, and ``python -m engine traffic`` on two scrapes agrees with their differences."""

from __future__ import annotations

import json

import pytest

from engine.serving import llamacpp as lc
from tests.llamacpp_live import binary_or_skip, counters, difference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    binary = binary_or_skip()
    srv = lc.start_server(lc.ServerConfig(port=lc.free_port(), spec_type="ngram-simple", threads=1), binary=binary,
                          progress=lambda m: None)
    yield srv
    srv.stop()
    assert not srv.running()


def test_engine_traffic_agrees_with_the_counters(server, tmp_path, capsys):
    from engine.__main__ import main

    before = lc.scrape(server.url)
    sent = lc.send_requests(server.url, 3, max_tokens=48)
    after = lc.scrape(server.url)
    d = difference(counters(before), counters(after))
    assert d["drafts"] > 0, "ngram-simple proposed nothing on the code-edit prompt"
    # the server's per-request timings add up to the same counts
    assert sum(r["draft_n"] for r in sent) == d["draft_tokens"]
    assert sum(r["draft_n_accepted"] for r in sent) == d["accepted"]
    (tmp_path / "before.txt").write_text(before)
    (tmp_path / "after.txt").write_text(after)
    assert main(["traffic", str(tmp_path / "before.txt"), str(tmp_path / "after.txt"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "llama.cpp" and out["window"] == "between the two scrapes"
    assert (out["drafts"], out["draft_tokens"], out["accepted_tokens"]) == (d["drafts"], d["draft_tokens"],
                                                                           d["accepted"])
    assert out["accepted_per_pos"] == d["per_pos"]
    assert out["acceptance_rate"] == pytest.approx(d["accepted"] / d["draft_tokens"])
    assert out["mean_acceptance_length"] == pytest.approx(1 + d["accepted"] / d["drafts"])


def test_port_in_use_by_the_running_server(server):
    with pytest.raises(lc.LlamaCppError, match="is in use"):
        lc.start_server(lc.ServerConfig(port=server.cfg.port), binary="/unused", model="/unused")


def test_no_speculation_counts_no_drafts(server):
    srv = lc.start_server(lc.ServerConfig(port=lc.free_port(), spec_type="none", threads=1),
                          binary=lc.find_llama_server(), progress=lambda m: None)
    try:
        before = counters(lc.scrape(srv.url))
        lc.send_requests(srv.url, 1, max_tokens=16)
        after = counters(lc.scrape(srv.url))
        assert difference(before, after)["drafts"] == 0
    finally:
        srv.stop()
