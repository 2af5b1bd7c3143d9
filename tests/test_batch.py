"""engine.decoding.batch: batched plain and speculative decoding, exact against each prompt decoded alone."""

from __future__ import annotations

import math

import pytest
import torch

from engine.decoding.batch import (
    MAX_BATCH,
    BatchDecoder,
    BatchSweep,
    batch_sweep,
    check_batch_memory,
    estimate_batch_memory,
    first_difference_gap,
    generate_batch,
    measure_machine,
    parse_batches,
    _groups,
)
from engine.decoding.draft_head import FeatureHead
from engine.decoding.models import load_model
from engine.decoding.proposers import DraftModelProposer, FeatureHeadProposer
from engine.decoding.drafts import make_proposer
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import SpeculativeDecoder, generate
from engine.errors import InputError
from tests.tiny_models import bigram_loaded, save_tiny_llama, toy_cycle_table

PROMPTS = [[3, 4, 5, 6, 3, 4], [7, 8], [9, 10, 11, 9, 10, 11, 9], [12], [5, 6, 5, 6, 5, 6, 5, 6, 5],
           [20, 21, 22], [2, 3], [4, 4, 4, 4, 13, 14, 4, 4]]
NEAR_TIE = 1e-4  # a top-2 logit gap this small is a floating-point tie, not a logic error


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def tiny(request, tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("batch") / "m", layers=2, seed=5, init=0.5)
    t = load_model(str(path), device="cpu")
    if request.param == "eager":
        t.model.config._attn_implementation = "eager"
    return t


def _head_proposer(t):
    torch.manual_seed(0)
    v = t.model.get_output_embeddings().weight.shape[0]
    head = FeatureHead(t.config, 1, torch.arange(v)).eval()
    head.init_from_target(t.model)
    return FeatureHeadProposer(head.bind(t.model), t)


def _proposers(spec, t, n):
    if spec == "none":
        return None
    if spec == "head":
        return [_head_proposer(t) for _ in range(n)]
    return [make_proposer(spec, t) for _ in range(n)]


def _assert_same_or_near_tie(t, prompt, dec, b, single):
    got = dec.result().results[b].token_ids
    if got == single:
        return
    tie = first_difference_gap(t, prompt, got, dec.rows[b].decisive, single)
    assert tie is not None and tie.single_gap < NEAR_TIE and tie.batched_gap < NEAR_TIE, (
        f"row {b} differs from decoding alone at token {tie.index}: batched {tie.batched_top}, "
        f"alone {tie.single_top} — not a near tie")


@pytest.mark.parametrize("spec", ["none", "ngram", "early-exit:1", "head"])
@pytest.mark.parametrize("B", [1, 2, 3, 5, 8])
def test_each_row_equals_its_prompt_decoded_alone(tiny, spec, B):
    n = 24
    singles = [generate(tiny, None, p, max_new_tokens=n, stop_on_eos=False).token_ids for p in PROMPTS[:B]]
    dec = BatchDecoder(tiny, _proposers(spec, tiny, B), PROMPTS[:B], gamma=3, max_new_tokens=n, stop_on_eos=False)
    res = dec.run()
    assert len(res.results) == B
    for b in range(B):
        assert len(res.results[b].token_ids) == n
        _assert_same_or_near_tie(tiny, PROMPTS[b], dec, b, singles[b])
    # one target pass per round for the whole batch (+ the prefill); a speculative batch needs fewer
    rounds_with_pass = {x.index for r in res.results for x in r.rounds if x.tokens_verified > 0}
    assert res.target_passes == 1 + len(rounds_with_pass)
    assert res.target_passes <= n + 1


def test_a_perfect_draft_takes_gamma_plus_one_tokens_per_pass(tiny):
    """Early exit at every layer is the target itself (α = 1): each pass verifies γ + 1 tokens of every row."""
    n, gamma = 24, 3
    singles = [generate(tiny, None, p, max_new_tokens=n, stop_on_eos=False).token_ids for p in PROMPTS[:4]]
    res = generate_batch(tiny, _proposers("early-exit:2", tiny, 4), PROMPTS[:4], gamma=gamma, max_new_tokens=n,
                         stop_on_eos=False)
    assert [r.token_ids for r in res.results] == singles
    assert res.target_passes == 1 + math.ceil(n / (gamma + 1))
    assert all(r.stats.acceptance_rate == 1.0 for r in res.results)
    assert max(p.tokens for p in res.passes[1:]) == 4 * (gamma + 1)  # B·(γ + 1) tokens in a pass


@pytest.mark.parametrize("spec", ["none", "ngram", "early-exit:1", "head"])
def test_batch_of_one_is_the_single_sequence_engine(tiny, spec):
    """B = 1 runs the single-sequence engine's operations (no mask, no padding): same rounds, same logits."""
    n = 20
    for prompt in PROMPTS[:4]:
        single = SpeculativeDecoder(tiny, (_proposers(spec, tiny, 1) or [None])[0], prompt, gamma=3,
                                    max_new_tokens=n, stop_on_eos=False)
        single.prefill()
        a = single.run()
        b = generate_batch(tiny, _proposers(spec, tiny, 1), [prompt], gamma=3, max_new_tokens=n,
                           stop_on_eos=False).results[0]
        assert b.token_ids == a.token_ids
        assert b.token_ids == generate(tiny, None, prompt, max_new_tokens=n, stop_on_eos=False).token_ids
        assert len(a.rounds) == len(b.rounds)
        for ra, rb in zip(a.rounds, b.rounds):
            assert [d.token_id for d in ra.drafted] == [d.token_id for d in rb.drafted]
            assert [d.verdict for d in ra.drafted] == [d.verdict for d in rb.drafted]
            assert [d.p for d in ra.drafted] == [d.p for d in rb.drafted]  # bit-identical target p
            assert (ra.n_accepted, ra.next_token_id, ra.next_kind, ra.emitted_ids, ra.tokens_verified) == \
                   (rb.n_accepted, rb.next_token_id, rb.next_kind, rb.emitted_ids, rb.tokens_verified)
        assert (a.stats.accepted, a.stats.judged, a.stats.target_passes) == \
               (b.stats.accepted, b.stats.judged, b.stats.target_passes)


def test_ragged_rows_leave_holes_and_finished_rows_leave_the_batch(tiny):
    dec = BatchDecoder(tiny, _proposers("early-exit:1", tiny, 4), PROMPTS[:4], gamma=3, max_new_tokens=12,
                       stop_on_eos=False)
    dec.prefill()
    assert not bool(dec.valid.all())  # left padding of the shorter prompts
    saw_hole_after_prefill = False
    while not dec.finished:
        dec.step()
        if dec.active and not bool(dec.valid[:, max(len(p) for p in PROMPTS[:4]):].all()):
            saw_hole_after_prefill = True
    assert saw_hole_after_prefill  # some row rejected or was padded while another was not
    assert dec.active == []
    # rows of different max lengths: finishing rows stop emitting while the others go on
    dec2 = BatchDecoder(tiny, None, PROMPTS[:3], max_new_tokens=5, stop_on_eos=False)
    dec2.prefill()
    dec2.rows[1].finished = True  # as if it had emitted EOS
    dec2.rows[1].stop_reason = "eos"
    dec2._compact()
    assert dec2.active == [0, 2] and dec2.cache.layers[0].keys.shape[0] == 2
    res = dec2.run()
    assert res.results[1].token_ids == [] and len(res.results[0].token_ids) == 5


def test_run_time_counts_the_prefill_once(tiny, monkeypatch):
    """total_ms is the prefill plus the rounds, each timed once: never more than the wall time of the run,
    also when the first round runs the prefill itself (it did once, counting the prefill twice and understating
    every batch's tokens/s)."""
    import time as _time

    from engine.decoding import batch as batch_mod

    real = batch_mod.BatchDecoder._forward

    def slow(self, *args, **kwargs):  # a prefill that takes a visible time
        if not self._prefilled:
            _time.sleep(0.2)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(batch_mod.BatchDecoder, "_forward", slow)
    t0 = _time.perf_counter()
    res = generate_batch(tiny, None, [PROMPTS[0], PROMPTS[0]], max_new_tokens=4, stop_on_eos=False)  # one pass
    wall = (_time.perf_counter() - t0) * 1000
    assert res.prefill_ms >= 200
    assert res.total_ms <= wall
    assert res.total_ms >= res.prefill_ms + sum(p.ms for p in res.passes if not p.prefill)


def test_eos_ends_a_row(tiny):
    singles = [generate(tiny, None, p, max_new_tokens=30).token_ids for p in PROMPTS]
    res = generate_batch(tiny, _proposers("ngram", tiny, 8), PROMPTS, gamma=3, max_new_tokens=30)
    for b, r in enumerate(res.results):
        assert r.token_ids == singles[b] or r.token_ids[:1] == singles[b][:1]
        if r.token_ids and r.token_ids[-1] == 0:
            assert r.rounds[-1].stop_reason == "eos"
        assert sum(len(x.emitted_ids) for x in r.rounds) == len(r.token_ids) <= 30
    assert any(len(r.token_ids) < 30 for r in res.results)  # a row stopped at EOS (seed 5 model)


def test_near_tie_report_reads_both_logits(tiny):
    prompt = PROMPTS[0]
    single = generate(tiny, None, prompt, max_new_tokens=6, stop_on_eos=False).token_ids
    dec = BatchDecoder(tiny, None, [prompt, PROMPTS[1]], max_new_tokens=6, stop_on_eos=False)
    dec.run()
    assert first_difference_gap(tiny, prompt, dec.rows[0].new_ids, dec.rows[0].decisive, single) is None
    fake = list(single)
    fake[3] = (fake[3] + 1) % 30
    tie = first_difference_gap(tiny, prompt, dec.rows[0].new_ids, dec.rows[0].decisive, fake)
    assert tie.index == 3 and tie.single_top[0][0] != fake[3] or tie.index == 3
    assert tie.batched_top[0][0] == single[3]  # the batched run's argmax is the token it emitted
    assert tie.batched_gap >= 0 and tie.single_gap >= 0 and set(tie.to_dict()) >= {"single_gap", "batched_top"}


def test_sampling_keeps_each_rows_distribution():
    """Bigram toys: every emitted token, given the one before it, must follow the target's row of the table
    (χ² per context token, pooled); the draft's table differs, so accepting draft tokens blindly fails."""
    from scipy.stats import chi2

    v = 6
    target = bigram_loaded(toy_cycle_table(v, 6.0))
    draft = bigram_loaded(toy_cycle_table(v, 1.5, skip=2))
    table = toy_cycle_table(v, 6.0)

    def counts(verify_patch=None):
        c = torch.zeros(v, v)
        for seed in range(12):
            props = [DraftModelProposer(draft, target) for _ in range(3)]
            res = generate_batch(target, props, [[2], [3, 4], [5, 2, 3]], gamma=3, max_new_tokens=120,
                                 sampling=SamplingConfig(temperature=1.0), seed=seed * 10, stop_on_eos=False)
            for r, prompt in zip(res.results, ([2], [3, 4], [5, 2, 3])):
                seq = prompt[-1:] + r.token_ids
                for a, b in zip(seq, seq[1:]):
                    c[a, b] += 1
        return c

    def pvalue(c):
        stat, dof = 0.0, 0
        for a in range(v):
            n = c[a].sum()
            if n < 30:
                continue
            exp = n * table[a]
            stat += float(((c[a] - exp) ** 2 / exp).sum())
            dof += v - 1
        return chi2.sf(stat, dof), dof

    p, dof = pvalue(counts())
    assert dof >= 20 and p > 1e-3, p
    # the control: a run that keeps every draft token follows the draft's table, which the test rejects
    import engine.decoding.batch as batch_mod
    from engine.decoding.sampling import Verdict

    orig = batch_mod.verify_chain
    batch_mod.verify_chain = lambda d, q, p_, cfg, g, pos: Verdict(len(d), int(torch.multinomial(p_[-1], 1, generator=g)),
                                                                   "bonus", [1.0] * len(d))
    try:
        p_bad, _ = pvalue(counts())
    finally:
        batch_mod.verify_chain = orig
    assert p_bad < 1e-6


def test_sampling_batch_of_one_matches_the_single_run(tiny):
    cfg = SamplingConfig(temperature=0.8)
    prompt = PROMPTS[2]
    single = SpeculativeDecoder(tiny, make_proposer("ngram", tiny), prompt, gamma=3, sampling=cfg, seed=7,
                                max_new_tokens=16, stop_on_eos=False)
    single.prefill()
    a = single.run()
    b = generate_batch(tiny, [make_proposer("ngram", tiny)], [prompt], gamma=3, sampling=cfg, seed=7,
                       max_new_tokens=16, stop_on_eos=False).results[0]
    assert a.token_ids == b.token_ids


def test_bad_input(tiny):
    with pytest.raises(InputError, match="at least one prompt"):
        BatchDecoder(tiny, None, [])
    with pytest.raises(InputError, match="empty"):
        BatchDecoder(tiny, None, [[1, 2], []])
    p = make_proposer("ngram", tiny)
    with pytest.raises(InputError, match="of its own"):
        BatchDecoder(tiny, [p, p], PROMPTS[:2])
    with pytest.raises(InputError, match="one proposer per row"):
        BatchDecoder(tiny, [p], PROMPTS[:2])
    with pytest.raises(InputError, match="does not fit in memory"):
        BatchDecoder(tiny, None, PROMPTS[:2], available_memory=1000)
    with pytest.raises(InputError, match="largest this engine runs"):
        BatchDecoder(tiny, None, [[3]] * (MAX_BATCH + 1))
    dec = BatchDecoder(tiny, None, PROMPTS[:1], max_new_tokens=1)
    dec.run()
    with pytest.raises(InputError, match="finished"):
        dec.step()


def test_memory_estimate_by_hand(tiny):
    # tiny: 2 layers, 2 KV heads, head dim 8, fp32: K+V per token = 2·2·2·8·4 = 256 bytes
    est = estimate_batch_memory(tiny, batch=3, prompt_len=10, max_new_tokens=5, gamma=4, available=10**9)
    assert est.kv_cache == 256 * 3 * (10 + 5 * 5)
    assert est.fits
    with pytest.raises(InputError, match="largest batch that fits"):
        check_batch_memory(tiny, 4000, 10, 5, 4, available=10**6)


def test_sweep_on_a_tiny_model(tiny):
    seen = []
    sw = batch_sweep(tiny, PROMPTS, batches=[1, 2, 4], methods=["plain", "ngram", "early-exit:1"], gamma=3,
                     max_new_tokens=6, reps=2, on_progress=lambda d, t, label, s: seen.append((d, t, label)))
    assert seen[0][:2] == (0, 18) and seen[-1][2] == "done"
    # the methods alternate: run 2 of a batch goes in the reverse order
    assert [x[2] for x in seen[:6]] == ["batch 1: plain (run 1 of 2)", "batch 1: ngram (run 1 of 2)",
                                        "batch 1: early-exit:1 (run 1 of 2)", "batch 1: early-exit:1 (run 2 of 2)",
                                        "batch 1: ngram (run 2 of 2)", "batch 1: plain (run 2 of 2)"]
    assert len(sw.cells) == 9 and not sw.stopped
    for c in sw.cells:
        assert c.tokens_per_s > 0 and len(c.runs_tokens_per_s) == 2
        assert (c.speedup is None) == (c.method == "plain")
        if c.method == "plain":
            assert c.pass_tokens == c.batch  # B tokens per plain pass
        else:
            assert c.speedup == pytest.approx(c.tokens_per_s / sw.cell("plain", c.batch).tokens_per_s)
    for m, b in sw.crossover.items():
        assert b is None or sw.cell(m, b).speedup < 1
    assert sw.table()[0]["batch"] == 1 and "ngram ×plain" in sw.table()[0]
    assert "| batch |" in sw.markdown()
    back = BatchSweep.from_dict(sw.to_dict())
    assert back.crossover == sw.crossover and back.pass_curve() == sw.pass_curve()


def test_sweep_cells_cover_at_least_min_prompts_in_groups_of_b(tiny):
    """min_prompts 4: batch 1 decodes prompts 1-4 one at a time, batch 2 prompts 1-4 in two pairs, batch 4 one
    batch; each cell's run holds every row's tokens, and the rows are the same text whatever the grouping."""
    sw = batch_sweep(tiny, PROMPTS, batches=[1, 2, 4], methods=["plain"], max_new_tokens=5, reps=1, min_prompts=4)
    assert sw.min_prompts == 4 and BatchSweep.from_dict(sw.to_dict()).min_prompts == 4
    one_batch = generate_batch(tiny, None, PROMPTS[:4], max_new_tokens=5, record_logits=False)
    for b in (1, 2, 4):
        groups = [generate_batch(tiny, None, PROMPTS[g:g + b], max_new_tokens=5, record_logits=False)
                  for g in range(0, 4, b)]
        c = sw.cell("plain", b)
        assert c.new_tokens == one_batch.new_tokens  # 4 rows' tokens, not b rows'
        assert c.target_passes == sum(g.target_passes for g in groups)  # the groups' passes, prefills included
    assert _groups(1, 8, 32) == 8 and _groups(2, 8, 32) == 4 and _groups(8, 8, 32) == 1 and _groups(16, 8, 32) == 1
    assert _groups(1, 8, 3) == 3 and _groups(4, 1, 32) == 1  # never more groups than the prompts fill
    with pytest.raises(InputError, match="prompts each cell covers"):
        batch_sweep(tiny, PROMPTS, batches=[1], methods=["plain"], min_prompts=0)


def test_sweep_stops_and_bad_input(tiny):
    calls = []
    sw = batch_sweep(tiny, PROMPTS, batches=[1, 2], methods=["plain", "ngram"], max_new_tokens=4,
                     should_stop=lambda: len(calls) > 0, on_progress=lambda *a: calls.append(a))
    assert sw.stopped and len(sw.cells) <= 1
    with pytest.raises(InputError, match="at least one sequence"):
        batch_sweep(tiny, PROMPTS, batches=[0, 1])
    with pytest.raises(InputError, match="needs 9 different prompts"):
        batch_sweep(tiny, PROMPTS, batches=[9], methods=["plain"])
    with pytest.raises(InputError, match="does not fit"):
        batch_sweep(tiny, PROMPTS, batches=[4], methods=["plain"], available_memory=1000)
    with pytest.raises(InputError, match="Unknown method"):
        batch_sweep(tiny, PROMPTS, batches=[1], methods=["magic"])
    with pytest.raises(InputError, match="not a batch sweep|Not a batch sweep"):
        BatchSweep.from_dict({"cells": []})


def test_parse_batches():
    assert parse_batches("4, 1,2,2") == [1, 2, 4]
    for bad in ("", "a", "1.5"):
        with pytest.raises(InputError):
            parse_batches(bad)


def test_measure_machine_small():
    m = measure_machine(matmul_n=128, copy_mb=4, reps=1)
    assert math.isfinite(m.bandwidth_gbs) and m.bandwidth_gbs > 0
    assert math.isfinite(m.peak_tflops) and m.peak_tflops > 0 and m.threads >= 1
    # ridge by hand: 4 bytes · FLOP/s ÷ (2 · bandwidth)
    assert m.ridge_tokens(4.0) == pytest.approx(4 * m.peak_tflops * 1e12 / (2 * m.bandwidth_gbs * 1e9))
    with pytest.raises(InputError):
        measure_machine(matmul_n=8)


@pytest.mark.slow
def test_embedded_rows_equal_alone_up_to_batch_8(embedded):
    from engine.decoding.batch import SWEEP_PROMPTS
    from engine.decoding.speculative import encode_prompt

    ids = [encode_prompt(embedded.tokenizer, p) for p in SWEEP_PROMPTS[:8]]
    n = 12
    singles = [generate(embedded, None, p, max_new_tokens=n).token_ids for p in ids]
    for spec, gamma, batches in (("none", 4, (8,)), ("ngram", 4, (1, 3, 8)), ("embedded-head", 2, (1, 2, 8))):
        for B in batches:
            dec = BatchDecoder(embedded, None if spec == "none" else [make_proposer(spec, embedded) for _ in range(B)],
                               ids[:B], gamma=gamma, max_new_tokens=n)
            dec.run()
            for b in range(B):
                _assert_same_or_near_tie(embedded, ids[b], dec, b, singles[b])


def test_a_draft_model_per_row(tiny, tmp_path):
    """A separate draft model (one proposer, its own KV cache, per row): rows still equal their prompts alone."""
    draft = load_model(str(save_tiny_llama(tmp_path / "d", layers=1, seed=9, init=0.5)), device="cpu")
    n, B = 16, 5
    singles = [generate(tiny, None, p, max_new_tokens=n, stop_on_eos=False).token_ids for p in PROMPTS[:B]]
    dec = BatchDecoder(tiny, [DraftModelProposer(draft, tiny) for _ in range(B)], PROMPTS[:B], gamma=2,
                       max_new_tokens=n, stop_on_eos=False)
    res = dec.run()
    for b in range(B):
        _assert_same_or_near_tie(tiny, PROMPTS[b], dec, b, singles[b])
    assert all(r.stats.drafted > 0 for r in res.results)


def test_prefill_of_ragged_prompts_is_packed_and_stacked_left_padded(tiny, monkeypatch):
    """Prompts of different lengths are prefilled packed end to end (no padding computed): each row's logits,
    hidden states and KV entries equal the single-sequence engine's (fp32 rounding aside), padded on the left in
    the batch cache, and the prefill's pass record counts only real tokens. A small PACK_TOKENS splits the
    prompts into several packed passes with the same result."""
    from transformers import DynamicCache

    import engine.decoding.batch as batch_mod

    prompts = PROMPTS[:5]
    width = max(len(p) for p in prompts)
    for pack in (batch_mod.PACK_TOKENS, 9):
        monkeypatch.setattr(batch_mod, "PACK_TOKENS", pack)
        dec = BatchDecoder(tiny, _proposers("head", tiny, 5), prompts, gamma=2, max_new_tokens=4, stop_on_eos=False)
        dec.prefill()
        assert dec.passes[0].prefill and dec.passes[0].tokens == dec.passes[0].real_tokens == sum(map(len, prompts))
        for b, (row, p) in enumerate(zip(dec.rows, prompts)):
            cache = DynamicCache()
            with torch.inference_mode():
                h = tiny.model.get_decoder()(input_ids=torch.tensor([p]), cache=cache,
                                             use_cache=True).last_hidden_state
                logits = tiny.model.get_output_embeddings()(h[:, -1:]).float()[0, -1]
            close = dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(row.last_logits, logits, **close)
            torch.testing.assert_close(row.hidden, h[0], **close)
            for li, layer in enumerate(cache.layers):
                torch.testing.assert_close(dec.cache.layers[li].keys[b, :, width - len(p):], layer.keys[0], **close)
                torch.testing.assert_close(dec.cache.layers[li].values[b, :, width - len(p):], layer.values[0],
                                           **close)
                assert not dec.cache.layers[li].keys[b, :, :width - len(p)].any()  # the padding, masked out
            assert dec.valid[b].tolist() == [False] * (width - len(p)) + [True] * len(p)
        # and decoding from there gives each prompt's own greedy continuation
        res = dec.run()
        for r, p in zip(res.results, prompts):
            assert r.token_ids == generate(tiny, None, p, max_new_tokens=4, stop_on_eos=False).token_ids


def test_head_rows_draft_together_and_keep_each_prompts_greedy_output(tiny, monkeypatch):
    """Rows whose draft heads share one head draft in one batched call per step (``propose_many``); each row's
    greedy output is still the prompt's plain greedy output alone."""
    calls = []
    real = FeatureHeadProposer.propose_many
    monkeypatch.setattr(FeatureHeadProposer, "propose_many",
                        staticmethod(lambda jobs: calls.append(len(jobs)) or real(jobs)))
    head = _head_proposer(tiny)
    props = [FeatureHeadProposer(head.head, tiny) for _ in range(3)]
    res = generate_batch(tiny, props, PROMPTS[:3], gamma=2, max_new_tokens=10, stop_on_eos=False)
    assert calls and max(calls) == 3
    for r, p in zip(res.results, PROMPTS[:3]):
        assert r.token_ids == generate(tiny, None, p, max_new_tokens=10, stop_on_eos=False).token_ids
