"""Tests for engine/explain/prefix_cache.py: block hashing, the paged prefix-cache simulator, presets, and the
real-model KV reuse (slow)."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest

from engine.errors import InputError
from engine.explain.prefix_cache import (
    ROOT_HASH,
    block_hashes,
    common_prefix_len,
    estimate_ttft_ms,
    hash_block,
    join_requests,
    preset_requests,
    reusable_tokens,
    simulate,
    simulate_texts,
    split_requests,
    tokenize_requests,
)

# ------------------------------------------------------------------------------------------ hashing


def test_hash_block_is_sha256_of_parent_and_tokens():
    want = hashlib.sha256(ROOT_HASH + struct.pack("<3q", 5, 6, 7)).digest()
    assert hash_block(ROOT_HASH, [5, 6, 7]) == want
    # chained: the second block's hash is sha256(first digest + its tokens)
    second = hashlib.sha256(want + struct.pack("<3q", 8, 9, 10)).hexdigest()
    assert block_hashes([5, 6, 7, 8, 9, 10], 3) == [want.hex(), second]


def test_same_prefix_same_hashes_and_partial_block_has_none():
    a = block_hashes(list(range(1, 9)), 4)           # 8 tokens → 2 full blocks
    b = block_hashes(list(range(1, 11)), 4)          # 10 tokens → 2 full blocks + 2 left over
    assert len(a) == 2 and len(b) == 2               # 8//4 = 2, 10//4 = 2
    assert a == b
    assert block_hashes([1, 2, 3], 4) == []          # 3 < 4: no full block


def test_one_changed_token_changes_every_later_hash():
    base = list(range(100, 124))                      # 24 tokens, block 4 → 6 blocks
    h0 = block_hashes(base, 4)
    changed = base.copy()
    changed[9] = 999                                  # token 9 lies in block 2 (tokens 8..11)
    h1 = block_hashes(changed, 4)
    assert h1[:2] == h0[:2]                           # blocks 0, 1 unchanged
    assert all(x != y for x, y in zip(h0[2:], h1[2:]))  # blocks 2..5 all differ
    # the later blocks differ although their own tokens are identical: the parent hash is chained
    assert changed[12:] == base[12:]


def test_hash_is_deterministic_across_calls_and_depends_on_position():
    assert block_hashes([1, 2, 1, 2], 2)[0] != block_hashes([1, 2, 1, 2], 2)[1]  # same tokens, other parent
    assert block_hashes([7] * 8, 4) == block_hashes([7] * 8, 4)


def test_reusable_tokens_whole_blocks_never_last_token():
    assert reusable_tokens(40, 40, 16) == 32     # floor(39/16)·16
    assert reusable_tokens(32, 32, 16) == 16     # floor(31/16)·16: last token forces recomputing block 2
    assert reusable_tokens(100, 15, 16) == 0     # less than one block shared
    assert reusable_tokens(100, 50, 16) == 48    # floor(50/16)·16
    assert reusable_tokens(1, 1, 1) == 0         # a 1-token prompt always computes its token
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9, 4]) == 2


def test_estimate_ttft():
    # 100 tokens, 64 hits, 0.5 ms/token → 100·0.5 = 50 ms vs (100−64)·0.5 = 18 ms
    assert estimate_ttft_ms(100, 64, 0.5) == pytest.approx((50.0, 18.0))
    with pytest.raises(InputError):
        estimate_ttft_ms(10, 11, 1.0)
    with pytest.raises(InputError):
        estimate_ttft_ms(10, 0, 0.0)


# ---------------------------------------------------------------------------------------- simulator


def test_partial_blocks_never_cached():
    # B = 4. Request 1 = 6 tokens: one full block [1..4] and a partial one [5, 6].
    # Request 2 extends it to 9 tokens: only the full block can hit; [5,6,7,8] was never cached.
    res = simulate([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9]], block_size=4, capacity=8)
    r1, r2 = res.requests
    assert [b.status for b in r1.blocks] == ["new", "partial"]
    assert r1.blocks[1].hash is None and r1.blocks[1].n_tokens == 2
    assert r2.hit_blocks == 1 and r2.hit_tokens == 4
    assert [b.status for b in r2.blocks] == ["hit", "new", "partial"]


def test_identical_prompt_recomputes_last_block():
    # 8 tokens, B = 4, twice: at most floor((8−1)/4) = 1 block may hit; block 2 holds the last token.
    res = simulate([list(range(8)), list(range(8))], block_size=4, capacity=8)
    r2 = res.requests[1]
    assert r2.hit_tokens == 4 and r2.computed_tokens == 4
    assert [b.status for b in r2.blocks] == ["hit", "dup"]


def test_hits_never_exceed_prompt_and_accounting():
    reqs = [list(range(1, 10))] * 3                  # 9 tokens each, B = 4 → 2 full + 1 partial
    res = simulate(reqs, block_size=4, capacity=16, ms_per_token=2.0)
    assert [r.hit_tokens for r in res.requests] == [0, 8, 8]      # floor(8/4)·4 = 8
    for r in res.requests:
        assert r.hit_tokens + r.computed_tokens == r.prompt_tokens
        assert r.hit_tokens <= r.prompt_tokens - 1
    assert res.hit_tokens == 16 and res.prompt_tokens == 27
    assert res.hit_rate == pytest.approx(16 / 27)
    assert res.requests[1].saved_ms == pytest.approx(8 * 2.0)      # 8 tokens skipped × 2 ms
    assert res.saved_ms == pytest.approx(32.0)
    t2 = res.totals(2)
    assert (t2.prompt_tokens, t2.hit_tokens, t2.computed_tokens) == (18, 8, 10)
    assert t2.hit_rate == pytest.approx(8 / 18)


def test_reference_counts_with_concurrent_requests():
    reqs = [list(range(1, 10))] * 3
    res = simulate(reqs, block_size=4, capacity=16, concurrency=3)
    # all three run at once: the two shared full blocks are held by 1, then 2, then 3 requests
    assert [r.blocks[0].ref_count for r in res.requests] == [1, 2, 3]
    assert res.requests[2].blocks[1].ref_count == 3
    assert res.requests[2].blocks[2].ref_count == 1           # partial blocks are private
    pool = {p.slot: p for p in res.requests[2].pool}
    assert pool[res.requests[0].blocks[0].slot].ref_count == 3
    # at most 2 at once: request 3's admission finishes request 1 first → count 2
    res2 = simulate(reqs, block_size=4, capacity=16, concurrency=2)
    assert res2.requests[2].finished == [0]
    assert res2.requests[2].blocks[0].ref_count == 2


def test_released_blocks_stay_cached_and_partial_slot_is_freed():
    res = simulate([list(range(1, 10)), [20, 21, 22, 23, 24]], block_size=4, capacity=10)
    r2 = res.requests[1]
    assert r2.finished == [0]
    pool = {p.slot: p for p in r2.pool}
    # request 1 held slots 0, 1 (full) and 2 (partial); request 2 took 3, 4 from the free list
    assert [b.slot for b in res.requests[0].blocks] == [0, 1, 2]
    assert [b.slot for b in r2.blocks] == [3, 4]
    assert (pool[0].state, pool[0].ref_count, pool[1].state) == ("cached", 0, "cached")
    assert pool[2].state == "free" and pool[2].hash is None
    assert pool[3].state == "in use" and pool[3].ref_count == 1


def test_eviction_lru_and_deepest_first():
    # B = 2, capacity 6, one request at a time. Each request of 5 tokens = 2 full + 1 partial block.
    a, b, c = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]
    res = simulate([a, b, c, a], block_size=2, capacity=6, concurrency=1)
    ra, rb, rc, rd = res.requests
    # A: slots 0 (depth 0), 1 (depth 1), 2 (partial). B: 3, 4, 5 from the free list, no eviction.
    assert [x.slot for x in ra.blocks] == [0, 1, 2] and rb.evictions == []
    # C: free list holds A's partial slot 2 and B's partial slot 5; the third block must evict.
    # A's blocks are least recently used (released before B's); of those the deepest (depth 1) goes.
    assert [(e.slot, e.depth) for e in rc.evictions] == [(1, 1)]
    assert [x.slot for x in rc.blocks] == [2, 5, 1]
    # D = A again: A's root block survived → 1 hit; its depth-1 block is gone → recomputed.
    assert rd.hit_blocks == 1 and [x.status for x in rd.blocks] == ["hit", "new", "partial"]
    # D needs 2 slots: C's partial slot 1 is free; then the LRU cached block is B's (released at
    # time 4, before C's at time 6), deepest first → slot 4 (B, depth 1).
    assert [(e.slot, e.depth) for e in rd.evictions] == [(4, 1)]
    assert res.evictions == 2


def test_blocks_held_by_running_requests_are_not_evicted():
    # capacity 4, B = 2, two at once. Request 1 (4 tokens → 2 full blocks) holds slots 0, 1.
    # Request 2 (4 new tokens) needs 2 blocks: free slots 2, 3. Request 3 needs 2 more: none free,
    # request 1's blocks are held only while it runs, so request 1 must finish first, then they evict.
    res = simulate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], block_size=2, capacity=4, concurrency=2)
    r3 = res.requests[2]
    assert r3.finished == [0]                       # concurrency 2 finishes request 1 anyway
    assert sorted(e.slot for e in r3.evictions) == [0, 1]
    # request 2's blocks (still running) were never touched
    assert {b.slot for b in res.requests[1].blocks}.isdisjoint(e.slot for e in r3.evictions)


def test_waits_for_room_when_pool_is_full():
    # capacity 4, B = 2, concurrency 3: requests 1 and 2 fill the pool; request 3 must wait for
    # request 1 to finish (although concurrency would allow 3 at once).
    res = simulate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]], block_size=2, capacity=4, concurrency=3)
    assert res.requests[2].finished == [0]


@pytest.mark.parametrize("kwargs, msg", [
    (dict(block_size=0), "Block size"),
    (dict(block_size=65), "Block size"),
    (dict(capacity=2), "needs 3 blocks"),            # 9 tokens / 4 → 3 blocks > 2
    (dict(capacity=0), "capacity"),
    (dict(concurrency=0), "at once"),
    (dict(ms_per_token=0.0), "positive"),
])
def test_bad_parameters(kwargs, msg):
    args = dict(block_size=4, capacity=8)
    args.update(kwargs)
    with pytest.raises(InputError, match=msg):
        simulate([list(range(9))], **args)


def test_empty_requests():
    with pytest.raises(InputError, match="no requests"):
        simulate([])
    with pytest.raises(InputError, match="Request 2 is empty"):
        simulate([[1, 2], []])
    with pytest.raises(InputError, match="Request 2 is empty"):
        split_requests("hello\n---\n   \n---\nworld")
    with pytest.raises(InputError, match="empty"):
        split_requests("  \n ")
    assert split_requests("a\nb\n---\nc") == ["a\nb", "c"]
    assert split_requests(join_requests(["x", "y z"])) == ["x", "y z"]


# ---------------------------------------------------------------------- presets on real tokens


@pytest.fixture(scope="module")
def tok():
    from engine.decoding.models import load_tokenizer

    return load_tokenizer("embedded")


def _expected_hits(tokens, block_size):
    """Oracle with a pool large enough that nothing is evicted: request j hits
    floor(min(max_i<j LCP(i, j), n_j − 1) / B) blocks (cached = every full block seen before)."""
    out = []
    for j, t in enumerate(tokens):
        best = max((common_prefix_len(tokens[i], t) for i in range(j)), default=0)
        out.append(reusable_tokens(len(t), best, block_size) // block_size)
    return out


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_timestamp_first_gives_no_hits_past_first_block(tok, block_size):
    tokens = tokenize_requests(preset_requests("timestamp", timestamp_first=True), tok)
    res = simulate(tokens, block_size=block_size, capacity=1024)
    hits = [r.hit_blocks for r in res.requests]
    assert hits == _expected_hits(tokens, block_size)
    assert max(hits) <= 1
    # the same requests with the timestamp moved to the end share the whole system prompt
    tokens_end = tokenize_requests(preset_requests("timestamp", timestamp_first=False), tok)
    res_end = simulate(tokens_end, block_size=block_size, capacity=1024)
    assert [r.hit_blocks for r in res_end.requests] == _expected_hits(tokens_end, block_size)
    sys_tokens = len(tok.encode(preset_requests("system")[0].split("\n\nUser:")[0], add_special_tokens=False))
    assert min(r.hit_tokens for r in res_end.requests[1:]) >= (sys_tokens - 1) // block_size * block_size
    assert res_end.hit_rate > 0.5 > res.hit_rate


@pytest.mark.parametrize("name", ["system", "fewshot", "multiturn"])
def test_presets_match_the_lcp_oracle(tok, name):
    tokens = tokenize_requests(preset_requests(name), tok)
    res = simulate(tokens, block_size=16, capacity=1024)
    assert [r.hit_blocks for r in res.requests] == _expected_hits(tokens, 16)
    assert all(r.hit_blocks > 0 for r in res.requests[1:])


def test_multiturn_each_turn_extends_the_last(tok):
    tokens = tokenize_requests(preset_requests("multiturn"), tok)
    for prev, cur in zip(tokens, tokens[1:]):
        assert cur[:len(prev)] == prev


def test_simulate_texts_labels_blocks(tok):
    res, tokens = simulate_texts("alpha beta gamma delta\n---\nalpha beta gamma epsilon", tok,
                                 block_size=2, capacity=16)
    assert res.requests[0].blocks[0].text == tok.decode(tokens[0][:2])
    assert "".join(b.text for b in res.requests[1].blocks) == tok.decode(tokens[1])


# -------------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_real_model_reuse_matches_full_prefill(embedded):
    from engine.explain.prefix_cache import measure_prefix_reuse

    tokens = tokenize_requests(preset_requests("system"), embedded.tokenizer)
    a, b = tokens[0], tokens[1]
    m = measure_prefix_reuse(embedded, a, b, block_size=16, repeats=2, decode_tokens=3)
    want = (min(common_prefix_len(a, b), len(b) - 1) // 16) * 16
    assert m.reused_tokens == want and want > 100
    assert m.prompt_tokens == len(b)
    assert m.max_abs_logit_diff < 1e-4
    assert m.same_first_token and m.same_decoded_tokens
    assert m.dtype == "float32"
    assert m.ttft_full_ms > 0 and m.ttft_reuse_ms > 0
    assert len(m.ttft_full_samples_ms) == 2 and len(m.ttft_reuse_samples_ms) == 2
    # slower ÷ faster decode time, whichever is which: 153.1 / 94.1 = 1.627 (a busy machine, > 1.25)
    busy = dataclasses.replace(m, decode_full_ms_per_token=94.1, decode_reuse_ms_per_token=153.1)
    assert busy.decode_spread == pytest.approx(1.627, abs=1e-3) and busy.decode_spread > busy.DECODE_NOISE
    assert dataclasses.replace(busy, decode_full_ms_per_token=153.1).decode_spread == 1.0


@pytest.mark.slow
def test_real_model_rejects_pair_without_shared_block(embedded):
    from engine.explain.prefix_cache import measure_prefix_reuse

    with pytest.raises(InputError, match="share"):
        measure_prefix_reuse(embedded, [1, 2, 3], [9, 8, 7, 6], block_size=16)
