"""Shared by the live llama.cpp tests: the built llama-server (or a skip where this machine cannot build it), and
the speculative counters of a real scrape read independently of engine/explain/traffic.py."""

from __future__ import annotations

import re

import pytest

from engine.serving import llamacpp as lc


def binary_or_skip():
    """The cached llama-server; built here when missing (``make test`` builds it first). Skips only when this
    machine has no cmake or C++ compiler."""
    found = lc.find_llama_server()
    if found is not None:
        return found
    try:
        lc.check_toolchain()
    except lc.LlamaCppError as e:
        pytest.skip(f"llama.cpp cannot be built on this machine: {e}")
    return lc.build_llama_server(progress=lambda m: print(m, flush=True))


_LINE = re.compile(r'^llamacpp:(spec_decode_\w+?)(?:\{position="(\d+)"\})? (\S+)$')


def counters(text: str) -> dict:
    """{"drafts", "draft_tokens", "accepted": float, "per_pos": {i: float}} read line by line with a regex."""
    out = {"per_pos": {}}
    names = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
             "spec_decode_num_accepted_tokens_total": "accepted"}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        name, pos, value = m.group(1), m.group(2), float(m.group(3))
        if name == "spec_decode_num_accepted_tokens_per_pos_total" and pos is not None:
            out["per_pos"][int(pos)] = value
        elif name in names:
            out[names[name]] = value
    return out


def difference(before: dict, after: dict) -> dict:
    """after − before for every counter (positions missing before count as 0)."""
    d = {k: after[k] - before.get(k, 0.0) for k in ("drafts", "draft_tokens", "accepted")}
    d["per_pos"] = [after["per_pos"][i] - before["per_pos"].get(i, 0.0) for i in sorted(after["per_pos"])]
    return d
