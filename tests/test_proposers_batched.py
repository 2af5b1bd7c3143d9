"""FeatureHeadProposer.propose_many: several sequences' head drafts in batched calls give each sequence the draft
``propose`` gives it alone (same tokens, q to rounding, same generator draws, same head cache), and the room's
readers sharing one head get their alone outputs."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.decoding.draft_head import FeatureHead
from engine.decoding.models import load_model
from engine.decoding.proposers import FeatureHeadProposer
from engine.decoding.sampling import SamplingConfig
from engine.decoding.scheduler import Room
from engine.decoding.speculative import SpeculativeDecoder
from tests.tiny_models import save_tiny_llama

PROMPTS = [[3, 4, 5, 6, 3, 4], [7, 8], [9, 10, 11, 9, 10, 11, 9], [12], [5, 6, 5, 6, 5, 6, 5, 6, 5],
           [20, 21, 22], [2, 3], [4, 4, 4, 4, 13, 14, 4, 4]]
# (temperature, seed, γ, confidence gate): greedy and sampled rows, different γ, one gated row
SETTINGS = [(0.0, 0, 3, 0.0), (0.8, 1, 2, 0.0), (0.8, 2, 3, 0.0), (0.0, 3, 1, 0.0), (1.0, 4, 4, 0.0),
            (0.0, 5, 3, 0.3), (0.8, 6, 3, 0.0), (0.0, 7, 2, 0.0)]
N_NEW = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("heads") / "m", layers=2, seed=5, init=0.5)
    return load_model(str(path), device="cpu")


@pytest.fixture(scope="module")
def head(tiny):
    torch.manual_seed(0)
    v = tiny.model.get_output_embeddings().weight.shape[0]
    h = FeatureHead(tiny.config, 2, torch.arange(0, v, 2)).eval()  # a draft vocabulary of every other id
    h.init_from_target(tiny.model)
    return h.bind(tiny.model)


def _decoder(tiny, head, i, n_new=N_NEW):
    temp, seed, gamma, gate = SETTINGS[i % len(SETTINGS)]
    return SpeculativeDecoder(tiny, FeatureHeadProposer(head, tiny, confidence_threshold=gate),
                              PROMPTS[i % len(PROMPTS)], gamma=gamma, sampling=SamplingConfig(temperature=temp),
                              seed=seed, max_new_tokens=n_new, stop_on_eos=False)


@torch.inference_mode()  # as the scheduler's worker runs it: no autograd on the target's logits
def _advance(dec, prop):
    """One round of ``dec`` with the given proposal, its target pass alone (the scheduler's ``_alone``)."""
    p = dec.begin_pass(proposal=prop)
    lm = dec.target_lm
    logits = lm._feed(lm.ids + p.feed, len(lm.ids), p.n_fed_logits).cpu() if p.feed else None
    return dec.finish_pass(p, logits, 0.0)


def test_propose_many_equals_propose_row_by_row(tiny, head):
    """Round after round, the batched drafts of 8 rows (mixed settings, ragged catch-up widths) equal each row's
    own ``propose``: tokens, q (to rounding), the generator's state and the head's cache."""
    alone = [_decoder(tiny, head, i) for i in range(8)]
    batched = [_decoder(tiny, head, i) for i in range(8)]
    for d in alone + batched:
        d.prefill()
    checked = 0
    for _ in range(20):
        live = [j for j in range(8) if not alone[j].finished]
        if not live:
            break
        ks = [alone[j].draft_size() for j in live]
        assert ks == [batched[j].draft_size() for j in live]
        jobs = [(batched[j].proposer, batched[j].seq, k, batched[j].sampling, batched[j].generator)
                for j, k in zip(live, ks)]
        got = FeatureHeadProposer.propose_many(jobs)
        for j, k, prop in zip(live, ks, got):
            a = alone[j]
            want = a.proposer.propose(a.seq, k, a.sampling, a.generator) if k > 0 else None
            if want is None:
                assert prop.tokens == []
            else:
                assert prop.tokens == want.tokens, (j, prop.tokens, want.tokens)
                torch.testing.assert_close(prop.q, want.q, atol=1e-4, rtol=1e-3)  # rounding only
                checked += len(want.tokens)
            assert torch.equal(batched[j].generator.get_state(), a.generator.get_state())
            pa, pb = a.proposer, batched[j].proposer
            assert (pa.n_true, pa.cache.get_seq_length()) == (pb.n_true, pb.cache.get_seq_length())
            # the same entries, to rounding (of the scale): where this machine's compute path for the tiny target is
            # PyTorch's default (MKL sgemm, measured fastest for it on an Intel Xeon), a product's rounding depends
            # on how many rows share it, and the head's own features feed back round after round: there the
            # entries drifted by 1.6e-4 of the scale after 20 rounds (a padding or mask error would be O(1))
            for la, lb in zip(pa.cache.layers, pb.cache.layers):
                for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
                    assert x.shape == y.shape
                    assert float((x - y).abs().max()) <= 1e-3 * float(x.abs().max()), float(x.abs().max())
            _advance(a, want)
            _advance(batched[j], prop)
            assert a.seq == batched[j].seq
    assert checked > 50  # many draft tokens compared, over many rounds


def test_propose_many_of_one_row_is_propose(tiny, head):
    """A single job runs ``propose`` itself: bit-identical q."""
    a, b = _decoder(tiny, head, 1), _decoder(tiny, head, 1)
    a.prefill()
    b.prefill()
    want = a.proposer.propose(a.seq, 3, a.sampling, a.generator)
    (got,) = FeatureHeadProposer.propose_many([(b.proposer, b.seq, 3, b.sampling, b.generator)])
    assert got.tokens == want.tokens and torch.equal(got.q, want.q)


def test_propose_many_refuses_different_heads(tiny, head):
    other = FeatureHead(tiny.config, 1, torch.arange(8)).eval().bind(tiny.model)
    a, b = _decoder(tiny, head, 0), _decoder(tiny, head, 1)
    b.proposer.head = other
    with pytest.raises(ValueError, match="share one head"):
        FeatureHeadProposer.propose_many([(a.proposer, a.seq, 2, a.sampling, a.generator),
                                          (b.proposer, b.seq, 2, b.sampling, b.generator)])


def _room_outputs(tiny, head, room, n):
    decs = [_decoder(tiny, head, i) for i in range(n)]
    ths = [threading.Thread(target=lambda d=d: (room.prefill(d), room.run(d))) for d in decs]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=300)
    return [d.new_ids for d in decs]


def test_room_readers_sharing_a_head_get_their_alone_outputs(tiny, head):
    """8 readers with one shared head in one room: their drafts are batched, and each output (greedy and
    sampled with a seed) is the output alone."""
    want = []
    for i in range(8):
        d = _decoder(tiny, head, i)
        d.prefill()
        d.run()
        want.append(d.new_ids)
    room = Room(tiny, no_draft_above=None)
    try:
        got = _room_outputs(tiny, head, room, 8)
        batched_passes = [p for p in room.passes if p.draft_ms > 0]
    finally:
        room.close()
    assert got == want
    assert batched_passes  # the drafts really were made together


def test_failed_batched_draft_falls_back_row_by_row(tiny, head, monkeypatch):
    """propose_many failing after it consumed draws: every generator is restored and each row drafts alone, so
    the outputs are still the outputs alone."""
    want = []
    for i in range(4):
        d = _decoder(tiny, head, i)
        d.prefill()
        d.run()
        want.append(d.new_ids)
    calls = []

    def broken(jobs):
        calls.append(len(jobs))
        for _, _, _, _, g in jobs:
            torch.rand((), generator=g)  # a draw made before the failure
        raise RuntimeError("batched draft failed")

    monkeypatch.setattr(FeatureHeadProposer, "propose_many", staticmethod(broken))
    room = Room(tiny, no_draft_above=None)
    try:
        got = _room_outputs(tiny, head, room, 4)
    finally:
        room.close()
    assert calls and got == want
