"""engine.decoding.scheduler: many readers' rounds in one worker, each output exactly the output alone."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from engine.decoding.draft_head import FeatureHead
from engine.decoding.models import load_model
from engine.decoding.proposers import FeatureHeadProposer, Proposal, Proposer
from engine.decoding.drafts import make_proposer
from engine.decoding.sampling import SamplingConfig
from engine.decoding import scheduler
from engine.decoding.scheduler import Room, parse_no_draft_above, room_for
from engine.decoding.speculative import SpeculativeDecoder
from engine.errors import InputError
from tests.tiny_models import save_tiny_llama

PROMPTS = [[3, 4, 5, 6, 3, 4], [7, 8], [9, 10, 11, 9, 10, 11, 9], [12], [5, 6, 5, 6, 5, 6, 5, 6, 5],
           [20, 21, 22], [2, 3], [4, 4, 4, 4, 13, 14, 4, 4]]
N_NEW = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("room") / "m", layers=2, seed=5, init=0.5)
    return load_model(str(path), device="cpu")


def _head(t):
    torch.manual_seed(0)
    v = t.model.get_output_embeddings().weight.shape[0]
    head = FeatureHead(t.config, 1, torch.arange(v)).eval()
    head.init_from_target(t.model)
    return FeatureHeadProposer(head.bind(t.model), t)


def _proposer(kind, t):
    if kind == "none":
        return None
    if kind == "head":
        return _head(t)
    return make_proposer(kind, t)


# reader settings: (draft kind, temperature, seed); mixed greedy and sampled, as a room is
READERS = [("head", 0.0, 0), ("ngram", 0.8, 1), ("none", 0.0, 2), ("early-exit:1", 0.8, 3),
           ("head", 0.8, 4), ("ngram", 0.0, 5), ("none", 0.8, 6), ("head", 0.0, 7)]


def _decoder(t, i, kind=None, temp=None, seed=None, n_new=N_NEW):
    k, tp, sd = READERS[i % len(READERS)]
    kind, temp, seed = kind or k, tp if temp is None else temp, sd if seed is None else seed
    return SpeculativeDecoder(t, _proposer(kind, t), PROMPTS[i % len(PROMPTS)], gamma=3,
                              sampling=SamplingConfig(temperature=temp), seed=seed, max_new_tokens=n_new,
                              stop_on_eos=False)


def _alone(t, i, **kw):
    d = _decoder(t, i, **kw)
    d.prefill()
    return d.run()


def _in_threads(fns):
    errors, out = [], [None] * len(fns)

    def go(j):
        try:
            out[j] = fns[j]()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    ths = [threading.Thread(target=go, args=(j,)) for j in range(len(fns))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=120)
    assert not errors, errors
    return out


def _same_rounds(a, b):
    """Two runs' rounds agree token for token and verdict for verdict (the uniforms u too)."""
    assert [r.emitted_ids for r in a] == [r.emitted_ids for r in b]
    for ra, rb in zip(a, b):
        assert [d.verdict for d in ra.drafted] == [d.verdict for d in rb.drafted]
        for da, db in zip(ra.drafted, rb.drafted):
            assert (da.u is None) == (db.u is None)
            if da.u is not None:
                assert da.u == db.u


def test_one_reader_alone_in_the_room_is_bit_identical(tiny):
    room = Room(tiny, no_draft_above=None)
    try:
        for i in (0, 1, 3):
            want = _alone(tiny, i)
            d = _decoder(tiny, i)
            room.prefill(d)
            got = room.run(d)
            assert got.token_ids == want.token_ids
            _same_rounds(got.rounds, want.rounds)
            for ra, rb in zip(got.rounds, want.rounds):  # a row alone runs the single-sequence pass: same p
                assert [x.p for x in ra.drafted] == [x.p for x in rb.drafted]
    finally:
        room.close()


def test_an_idle_worker_ends_and_the_next_request_starts_another(tiny, monkeypatch):
    """A room's worker with nothing to do for ``IDLE_EXIT_S`` ends (its thread's OpenMP team with it: two live
    computing threads on 2 cores slowed each other's passes about 2×); the next request starts a new worker and is
    served exactly as before."""
    from engine.decoding import scheduler

    monkeypatch.setattr(scheduler, "IDLE_EXIT_S", 0.2)
    room = Room(tiny, no_draft_above=None)
    try:
        want = _alone(tiny, 0)
        d = _decoder(tiny, 0)
        room.prefill(d)
        first = room._worker
        deadline = time.monotonic() + 10
        while room._worker is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert room._worker is None and not first.is_alive()
        got = room.run(d)
        assert got.token_ids == want.token_ids
        assert room._worker is not first
    finally:
        room.close()


def test_a_warmed_up_room_records_no_pass_freezes_the_heap_and_serves_exactly(tiny):
    """``warm_up``: at the first request the worker runs its batched passes once (``Room._warm_up``: 16 rows), records
    none of them, freezes the collector's heap (once per process), then serves; readers get exactly their alone
    output, and each prefilled reader's cache is a block ready for shared passes (``CachedLM.reserve_block``)."""
    import gc

    want = [_alone(tiny, i) for i in range(4)]
    room = Room(tiny, no_draft_above=None, warm_up=True)
    try:
        time.sleep(0.2)
        assert room.warm_ms is None and not room.warm_done  # nothing asked yet: nothing computed
        decs = [_decoder(tiny, i) for i in range(4)]
        for d in decs:
            room.prefill(d)
            assert d.target_lm.kv_block() is not None  # the prefill left a block with room to spare
        assert room.warm_ms is not None and room.warm_ms > 0 and room.warm_done
        assert gc.get_freeze_count() > 0
        got = _in_threads([(lambda d=d: room.run(d)) for d in decs])
        for i in range(4):
            assert got[i].token_ids == want[i].token_ids, f"reader {i} ({READERS[i]})"
            _same_rounds(got[i].rounds, want[i].rounds)
        assert room.pass_count == len(room.passes) > 0
        assert all(p.rows <= 4 for p in room.passes)  # the warm-up's 16-row passes are not recorded
        assert max(p.fed_rows for p in room.passes) >= 2
    finally:
        room.close()


def test_a_failed_warm_up_leaves_a_room_that_serves(tiny, monkeypatch):
    """A warm-up that raises only means no warm-up: warm_ms stays None and readers are served exactly."""
    import engine.decoding.scheduler as scheduler

    def broken(*a, **k):
        raise RuntimeError("no warm-up here")

    monkeypatch.setattr(scheduler, "SpeculativeDecoder", broken)
    want = _alone(tiny, 0)
    room = Room(tiny, no_draft_above=None, warm_up=True)
    try:
        d = _decoder(tiny, 0)
        got = room.run(d)
        assert room.warm_ms is None and room.warm_done
        assert got.token_ids == want.token_ids
        plain = Room(tiny, warm_up=False)
        assert plain.warm_done  # no warm-up: nothing to wait for
        plain.close()
    finally:
        room.close()


def test_concurrent_readers_get_exactly_their_alone_output(tiny):
    """8 readers at once (greedy and sampled, four draft kinds): each gets the tokens, verdicts and uniforms
    of the same settings decoded alone, and the passes really were shared."""
    want = [_alone(tiny, i) for i in range(8)]
    room = Room(tiny, no_draft_above=None)
    try:
        decs = [_decoder(tiny, i) for i in range(8)]
        got = _in_threads([(lambda d=d: room.run(d)) for d in decs])
        for i in range(8):
            assert got[i].token_ids == want[i].token_ids, f"reader {i} ({READERS[i]})"
            assert got[i].text == want[i].text
            _same_rounds(got[i].rounds, want[i].rounds)
        assert max(p.fed_rows for p in room.passes) >= 2
    finally:
        room.close()


def _bits(rounds):
    """Every number of a run's rounds that comes from the target's passes: each drafted token's p and the top-5 of p,
    the next token's top-5, and the draft's q (exact floats)."""
    out = []
    for r in rounds:
        out.append([(x.token_id, x.p, x.q, [(e.id, e.prob) for e in x.top_p]) for x in r.drafted])
        out.append([(e.id, e.prob) for e in (r.next_top_p or [])])
    return out


@pytest.mark.parametrize("own_caches", [True, False])
def test_room_rows_get_the_bits_of_their_lone_passes(tmp_path_factory, monkeypatch, own_caches):
    """``compute.batch_invariant``: a reader's rows in the room's shared passes get exactly the bits of its lone passes
    (not only its tokens), so the room's texts are the texts alone even at a near tie. 8 readers of four draft kinds,
    greedy and sampled, make passes of mixed widths (a call per row), their draft heads' rows drafting together
    (``propose_many``: q bit-identical too); 4 early-exit readers make passes whose rows all feed γ + 1 tokens (one
    call). Both ways the room runs a pass: over the rows in their own caches (``Room._in_own_caches``) and over a
    stacked batch cache (``Room._stacked``); each is checked to have served the shared passes."""
    path = save_tiny_llama(tmp_path_factory.mktemp("inv") / "m", layers=2, seed=5, init=0.5)
    t = load_model(str(path), device="cpu", compute="stream")
    assert t.compute.path == "stream", (
        f"the streaming kernel must build where the suite runs (make installs a compiler): {t.compute.reason}")
    mixed = [dict(), dict(), dict(), dict(), dict(), dict(), dict(), dict()]
    same = [dict(kind="early-exit:1", temp=0.0), dict(kind="early-exit:1", temp=0.8, seed=1),
            dict(kind="early-exit:1", temp=0.0, seed=2), dict(kind="early-exit:1", temp=0.8, seed=3)]
    import tests.test_scheduler as this

    from engine.decoding.compute import apply_path

    shared = _head(t).head  # every head reader's proposer on one head object: their rows draft together
    apply_path(shared, "stream")  # the target's compute path, as ``load_head`` gives a head (fused, lean layers)
    monkeypatch.setattr(this, "_head", lambda t_: FeatureHeadProposer(shared, t_))
    together = []  # the jobs of each batched head draft
    many = FeatureHeadProposer.propose_many
    monkeypatch.setattr(scheduler, "IN_OWN_CACHES", own_caches)
    served = {"own": 0, "stacked": 0}
    own, stacked = Room._in_own_caches, Room._stacked

    def count(name, f):
        def run(self, fed, rec):
            out = f(self, fed, rec)
            served[name] += out is not None
            return out
        return run
    monkeypatch.setattr(Room, "_in_own_caches", count("own", own))
    monkeypatch.setattr(Room, "_stacked", count("stacked", stacked))
    monkeypatch.setattr(FeatureHeadProposer, "propose_many",
                        staticmethod(lambda jobs: together.append(len(jobs)) or many(jobs)))
    for settings in (mixed, same):
        want = [_alone(t, i, **kw) for i, kw in enumerate(settings)]
        room = Room(t, no_draft_above=None)
        try:
            decs = [_decoder(t, i, **kw) for i, kw in enumerate(settings)]
            for d in decs:  # prefilled first, as the page does (and ``_alone``)
                room.prefill(d)
            got = _in_threads([(lambda d=d: room.run(d)) for d in decs])
            for i in range(len(settings)):
                assert got[i].token_ids == want[i].token_ids, f"reader {i}"
                assert _bits(got[i].rounds) == _bits(want[i].rounds), f"reader {i}"
            assert max(p.fed_rows for p in room.passes) >= 2
            if settings is mixed:
                assert max(together) >= 2  # the heads' rows did draft together
        finally:
            room.close()
    assert served["own" if own_caches else "stacked"] > 0 and served["stacked" if own_caches else "own"] == 0


@pytest.mark.parametrize("kernel", ["stream", "sdpa"])
@pytest.mark.parametrize("dim", [8, 64])
def test_invariant_attention_gives_each_row_its_lone_bits(kernel, dim, monkeypatch):
    """``compute.invariant_attention``: rows of a left-padded batch (rows feeding as many tokens as the pass, rows
    feeding fewer, a row whose cached keys are a list of columns with holes) get exactly the bits of each row's lone
    sequence, on the project's kernel and on the per-row SDPA fallback; and it is causal attention (close to a plain
    softmax reference). On every CPU: nothing here depends on which one runs it."""
    from engine.decoding import compute
    from engine.decoding.compute import invariant_attention

    if kernel == "stream":
        if compute.stream_kernel() is None or compute.extension._STREAM.get("attention") is None:
            pytest.fail(f"the streaming kernel's extension did not build here: {compute.stream_problem()}")
    else:
        monkeypatch.setitem(compute.extension._STREAM, "attention", None)
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, scale = 6, 2, dim ** -0.5
    for widths in ([3, 3, 3], [3, 1, 2], [1, 1, 1], [4, 0, 2]):
        q_len = max(widths)
        caches = [5, 17, 30]
        new_at = max(caches) + 3  # a hole of 3 columns before the fed tokens (another row's rejected drafts)
        length = new_at + q_len + 7  # spare columns past the pass (the room's block)
        q = torch.randn(3, heads, q_len, dim, generator=gen)
        k = torch.randn(3, kv_heads, length, dim, generator=gen)  # what no row sees is noise, not zeros
        v = torch.randn(3, kv_heads, length, dim, generator=gen)
        lone_k, lone_v, spans = [], [], []
        for r, (n, w) in enumerate(zip(caches, widths)):
            kr = torch.randn(1, kv_heads, n + w, dim, generator=gen)
            vr = torch.randn(1, kv_heads, n + w, dim, generator=gen)
            if r == 2:  # cached keys scattered among other columns (the head's batched drafting)
                cols = torch.tensor(sorted(torch.randperm(new_at, generator=gen)[:n].tolist()))
            else:  # contiguous, then a hole before the fed tokens
                cols = torch.arange(new_at - 3 - n, new_at - 3)
            spans.append((cols, w))
            k[r, :, cols], v[r, :, cols] = kr[0, :, :n], vr[0, :, :n]
            k[r, :, new_at:new_at + w], v[r, :, new_at:new_at + w] = kr[0, :, n:], vr[0, :, n:]
            lone_k.append(kr)
            lone_v.append(vr)
        out = invariant_attention(q, k, v, scale, spans, new_at)
        # the same rows with int starts where their cached keys are contiguous
        k2, v2 = torch.randn_like(k), torch.randn_like(v)
        ints = []
        for r, (n, w) in enumerate(zip(caches, widths)):
            k2[r, :, new_at - n:new_at], v2[r, :, new_at - n:new_at] = lone_k[r][0, :, :n], lone_v[r][0, :, :n]
            k2[r, :, new_at:new_at + w], v2[r, :, new_at:new_at + w] = lone_k[r][0, :, n:], lone_v[r][0, :, n:]
            ints.append((new_at - n, w))
        out2 = invariant_attention(q, k2, v2, scale, ints, new_at)
        for r, (n, w) in enumerate(zip(caches, widths)):
            assert not out[r, :, w:].any() and not out2[r, :, w:].any()  # past what the row feeds: zeros
            if w == 0:
                continue
            alone = invariant_attention(q[r:r + 1, :, :w].contiguous(), lone_k[r], lone_v[r], scale)
            assert torch.equal(out[r:r + 1, :, :w], alone), (kernel, widths, r)
            assert torch.equal(out2[r:r + 1, :, :w], alone), (kernel, widths, r, "int start")
            # causal attention over the row's own keys, by hand
            kk = lone_k[r].repeat_interleave(heads // kv_heads, 1)
            vv = lone_v[r].repeat_interleave(heads // kv_heads, 1)
            s = (q[r:r + 1, :, :w] @ kk.transpose(-1, -2)) * scale
            j, c = torch.arange(w)[:, None], torch.arange(n + w)[None, :]
            s = s.masked_fill(c > n + j, float("-inf"))
            assert torch.allclose(alone, torch.softmax(s, -1) @ vv, atol=1e-5)
    with pytest.raises(ValueError, match="span"):
        invariant_attention(q, k, v, scale)


def test_invariant_attention_kernel_rejects_bad_shapes():
    """The kernel's own checks: a clear error, not a crash, for shapes it cannot serve."""
    from engine.decoding import compute

    if compute.stream_kernel() is None or compute.extension._STREAM.get("attention") is None:
        pytest.fail(f"the streaming kernel's extension did not build here: {compute.stream_problem()}")
    op = compute.extension._STREAM["attention"]
    q, k = torch.zeros(1, 3, 1, 16), torch.zeros(1, 2, 4, 16)
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="multiple of G"):
        op(q, k, k, torch.zeros(1, 4, dtype=torch.long), one * 4, one, 1.0)
    with pytest.raises(RuntimeError, match="outside k"):
        op(torch.zeros(1, 2, 1, 16), k, k, torch.tensor([[0, 1, 2, 9]]), one * 4, one, 1.0)


def test_readers_join_and_leave_between_passes(tiny):
    want = {i: _alone(tiny, i) for i in range(5)}
    room = Room(tiny, no_draft_above=None)
    try:
        decs = {i: _decoder(tiny, i) for i in range(5)}
        for i in (0, 1):
            room.prefill(decs[i])

        def stepper(i, n):  # a reader stepping round by round, with pauses: joins and leaves passes
            for _ in range(n):
                room.step(decs[i])
                time.sleep(0.01)
            return room.run(decs[i])

        def late(i, delay):
            time.sleep(delay)
            return room.run(decs[i])

        got = _in_threads([lambda: room.run(decs[0]), lambda: stepper(1, 4), lambda: late(2, 0.05),
                           lambda: stepper(3, 2), lambda: late(4, 0.2)])
        for j, i in enumerate(range(5)):
            assert got[j].token_ids == want[i].token_ids, f"reader {i}"
            _same_rounds(got[j].rounds, want[i].rounds)
        assert room.stats().readers_now == 0
    finally:
        room.close()


def test_stop_mid_run_then_go_on(tiny):
    want = _alone(tiny, 1, n_new=40)
    other = _alone(tiny, 0, n_new=40)
    room = Room(tiny, no_draft_above=None)
    try:
        d, o = _decoder(tiny, 1, n_new=40), _decoder(tiny, 0, n_new=40)
        seen = []

        def stopping():
            t = room.submit(d, None)
            for batch in t.rounds(should_stop=lambda: len(seen) >= 3):
                seen.extend(batch)
            return t

        got = _in_threads([stopping, lambda: room.run(o)])
        assert got[0].cancelled.is_set() and got[0].done.is_set()
        assert 3 <= len(d.rounds) < len(want.rounds) and not d.finished  # stopped after the pass in flight
        assert len(d.rounds) == len(seen)
        assert room.run(d).token_ids == want.token_ids  # going on from there: the same run
        assert got[1].token_ids == other.token_ids
    finally:
        room.close()


def test_a_reader_that_wakes_at_intervals_gets_every_round_and_the_end_at_once(tiny):
    """``Ticket.rounds(wake_every=…)`` (a page that draws at most every so often): every round arrives, in order, in
    fewer batches than rounds, and the run's end is seen when it comes, not after the interval."""
    want = _alone(tiny, 1, n_new=40)
    room = Room(tiny, no_draft_above=None)
    try:
        d = _decoder(tiny, 1, n_new=40)
        room.prefill(d)
        t = room.submit(d, None)
        batches = list(t.rounds(wake_every=0.05))
        got = [r for b in batches for r in b]
        assert d.finished and [r.emitted_ids for r in got] == [r.emitted_ids for r in want.rounds]
        assert len(batches) < len(got)  # rounds waited in the queue between wakes
        d2 = _decoder(tiny, 1, n_new=40)
        room.prefill(d2)
        t0 = time.monotonic()
        got2 = [r for b in room.submit(d2, None).rounds(wake_every=30.0) for r in b]
        assert time.monotonic() - t0 < 10 and len(got2) == len(want.rounds)  # the end, not the 30 s interval
        stopped = room.submit(_decoder(tiny, 0, n_new=40), None)
        for _ in stopped.rounds(should_stop=lambda: True, wake_every=30.0):
            pass
        assert stopped.cancelled.is_set() and stopped.done.is_set()  # a stop is not held up by the interval
    finally:
        room.close()


class _Broken(Proposer):
    name = "broken"

    def propose(self, seq, k, cfg, generator):
        raise RuntimeError("this reader's draft failed")


class _OutOfVocab(Proposer):
    """Proposes a token id the target has no embedding for: the shared target pass itself fails."""
    name = "out-of-vocab"

    def propose(self, seq, k, cfg, generator):
        return Proposal([10_000], torch.zeros(1, 32), point_mass=True)


def test_one_readers_exception_never_reaches_another(tiny):
    want = [_alone(tiny, i) for i in range(3)]
    room = Room(tiny, no_draft_above=None)
    try:
        decs = [_decoder(tiny, i) for i in range(3)]
        bad1 = SpeculativeDecoder(tiny, _Broken(), PROMPTS[0], gamma=2, max_new_tokens=8)
        bad2 = SpeculativeDecoder(tiny, _OutOfVocab(), PROMPTS[1], gamma=2, max_new_tokens=8)
        for d in decs + [bad1, bad2]:
            room.prefill(d)
        errs = {}

        def bad(d, name):
            try:
                room.run(d)
            except Exception as e:  # noqa: BLE001
                errs[name] = e

        got = _in_threads([lambda: room.run(decs[0]), lambda: bad(bad1, "draft"), lambda: room.run(decs[1]),
                           lambda: bad(bad2, "pass"), lambda: room.run(decs[2])])
        assert isinstance(errs["draft"], RuntimeError) and "draft failed" in str(errs["draft"])
        assert isinstance(errs["pass"], IndexError)
        for j, i in ((0, 0), (2, 1), (4, 2)):
            assert got[j].token_ids == want[i].token_ids
        assert room._worker.is_alive()
    finally:
        room.close()


def test_fairness_bound_with_capped_rows(tiny):
    """6 readers, at most 2 rows a pass: a running reader is served at least every ceil(6 / 2) = 3 passes."""
    want = [_alone(tiny, i, n_new=12) for i in range(6)]
    room = Room(tiny, max_rows=2, no_draft_above=None)
    try:
        decs = [_decoder(tiny, i, n_new=12) for i in range(6)]
        with room._cond:  # the worker cannot collect a pass until all six are queued: FIFO from one queue
            tickets = [room.submit(d, None) for d in decs]
        got = _in_threads([(lambda t=t: t.wait()) for t in tickets])
        for i in range(6):
            assert [x for r in got[i] for x in r.emitted_ids] == want[i].token_ids
        log = [p.served for p in room.passes]
        assert max(len(s) for s in log) == 2
        assert log[0] == [tickets[0].id, tickets[1].id]  # FIFO: the first two submitted go first
        for t in tickets:
            idx = [j for j, s in enumerate(log) if t.id in s]
            active = [len({x for s in log[a:b + 1] for x in s}) for a, b in zip(idx, idx[1:])]
            for (a, b), n_active in zip(zip(idx, idx[1:]), active):
                assert b - a <= math.ceil(max(n_active, 1) / 2), (t.id, a, b)
    finally:
        room.close()


def test_abandoned_and_garbage_collected_requests_free_their_rows(tiny):
    room = Room(tiny, abandon_s=0.1, no_draft_above=None)
    try:
        # plain decoding, one token a pass, so the run outlasts abandon_s on a fast machine (a 200-token head run
        # finished in under 0.3 s on an Intel Xeon and the ticket ended done, not dropped)
        d = _decoder(tiny, 0, kind="none", n_new=400)
        t = room.submit(d, None)  # never polled: a tab that went away
        assert t.done.wait(10) and t.cancelled.is_set()
        assert not d.finished
        gone = _decoder(tiny, 1, n_new=200)
        t2 = room.submit(gone, None)
        t2.last_poll = time.monotonic() + 3600
        del gone  # the session (and its decoder and KV cache) went away
        import gc

        gc.collect()
        assert t2.done.wait(10)
        time.sleep(0.2)
        assert room.stats().readers_now == 0
    finally:
        room.close()


def test_no_draft_above_turns_drafting_off_in_large_passes(tiny):
    want = [_alone(tiny, i, temp=0.0) for i in range(3)]
    room = Room(tiny, no_draft_above=1)
    try:
        decs = [_decoder(tiny, i, temp=0.0) for i in range(3)]
        with room._cond:  # queued together: the first pass holds all three
            tickets = [room.submit(d, None) for d in decs]
        got = _in_threads([(lambda t=t: t.wait()) for t in tickets])
        for i in range(3):  # greedy: the same tokens with or without drafting
            assert [x for r in got[i] for x in r.emitted_ids] == want[i].token_ids
        big = [p for p in room.passes if p.rows > 1]
        assert big and all(not p.drafted for p in big)
        assert all(p.drafted for p in room.passes if p.rows == 1)
        assert room.stats().no_draft_above == 1
    finally:
        room.close()


def test_operator_option_parsing(monkeypatch, tiny):
    assert parse_no_draft_above(None) is None
    assert parse_no_draft_above("0") is None and parse_no_draft_above("off") is None
    assert parse_no_draft_above(" 8 ") == 8
    for bad in ("-1", "lots", "2.5"):
        with pytest.raises(InputError):
            parse_no_draft_above(bad)
    monkeypatch.setenv("SPEEDUP_LAB_NO_DRAFT_ABOVE", "4")
    room = Room(tiny)
    try:
        assert room.no_draft_above == 4
    finally:
        room.close()
    monkeypatch.setenv("SPEEDUP_LAB_NO_DRAFT_ABOVE", "nope")
    with pytest.raises(InputError, match="SPEEDUP_LAB_NO_DRAFT_ABOVE"):
        Room(tiny)


def test_room_for_is_one_room_per_target_and_bad_requests(tiny):
    r1, r2 = room_for(tiny), room_for(tiny)
    assert r1 is r2
    d = _decoder(tiny, 0)
    with pytest.raises(InputError):
        r1.submit(d, 0)
    d.finished = True
    with pytest.raises(InputError, match="finished"):
        r1.step(d)


def test_room_stats_after_a_shared_run(tiny):
    room = Room(tiny, no_draft_above=None)
    try:
        decs = [_decoder(tiny, i) for i in range(4)]
        _in_threads([(lambda d=d: room.run(d)) for d in decs])
        s = room.stats()
        assert s.passes == len(room.passes) and s.readers_now == 0
        assert s.tokens_per_s is not None and s.tokens_per_s > 0
        emitted = sum(p.emitted for p in room.passes)
        assert emitted == sum(len(d.new_ids) for d in decs)
        assert 1 <= s.rows_per_pass <= 4 and s.stack_share is not None and 0 <= s.stack_share < 1
        # where each pass went: its parts are measured one after another inside it, so they never add up to more
        for p in room.passes:
            parts = p.prep_ms + p.draft_ms + p.begin_ms + p.target_ms + p.stack_ms + p.unstack_ms + p.judge_ms
            assert min(p.prep_ms, p.begin_ms, p.judge_ms) >= 0 and parts <= p.ms + 1e-6
        assert any(p.judge_ms > 0 for p in room.passes)
    finally:
        room.close()
