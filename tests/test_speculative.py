"""The speculative decoding loop: greedy exactness, distribution preservation, KV rollback, stopping."""

from __future__ import annotations

import itertools

import pytest
import torch

from app.live_view import round_summary, verdict_frame
from engine.decoding.models import load_model
from engine.decoding.proposers import DraftModelProposer, EarlyExitProposer, PromptLookupProposer
from engine.decoding.drafts import make_proposer
from engine.decoding.sampling import SamplingConfig, warp_probs
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt, generate
from engine.decoding.trace import AFTER_END, token_origins
from engine.errors import InputError, ModelLoadError, TokenizerMismatchError
from tests.test_sampling import g_test_pvalue
from tests.tiny_models import WORDS, bigram_loaded, save_tiny_llama, toy_cycle_table


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random target, a smaller draft with a padded vocab, and a same-tokenizer draft."""
    root = tmp_path_factory.mktemp("tiny")
    target = load_model(str(save_tiny_llama(root / "target", vocab_size=32, layers=3, seed=0)), device="cpu")
    draft = load_model(str(save_tiny_llama(root / "draft", vocab_size=40, layers=1, seed=1)), device="cpu")
    draft_small = load_model(str(save_tiny_llama(root / "draft_small", vocab_size=32, layers=1, seed=2,
                                                 init=0.1)), device="cpu")
    other = load_model(str(save_tiny_llama(root / "other", vocab_size=32, layers=1, seed=3,
                                           words=list(reversed(WORDS)))), device="cpu")
    return dict(target=target, draft=draft, draft_small=draft_small, other=other)


def hf_greedy(lm, ids, n):
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                            eos_token_id=list(lm.eos_token_ids) or None, pad_token_id=0)
    return out[0, len(ids):].tolist()


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 12, 20, 4, 9, 3, 12, 2]]


@pytest.mark.parametrize("kind", ["none", "ngram", "early-exit:1", "early-exit:2", "draft", "draft_small"])
def test_greedy_identical_to_transformers_generate(tiny, kind):
    target = tiny["target"]
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for gamma in range(1, 9):
            draft = tiny.get(kind)
            prop = make_proposer("draft" if draft else kind, target, draft)
            got = generate(target, prop, ids, gamma=gamma, max_new_tokens=24).token_ids
            assert got == ref, (kind, gamma)


def test_greedy_accepts_something_so_the_check_is_not_vacuous(tiny):
    """Early exit at all layers is the target itself: every draft token must be accepted."""
    target = tiny["target"]
    res = generate(target, EarlyExitProposer(target, 3), PROMPTS[0], gamma=4, max_new_tokens=20,
                   stop_on_eos=False)
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.rounds == 4  # 20 tokens at γ + 1 = 5 per target pass


def test_trace_top_q_of_a_point_mass_is_its_one_token(tiny):
    """Prompt lookup's q is one-hot: the trace's top_q is that token at q = 1 (no zero-mass filler),
    while a draft model's top_q lists 5 tokens in falling order and contains its draft token."""
    target = tiny["target"]
    res = generate(target, make_proposer("ngram", target), PROMPTS[1], gamma=4, max_new_tokens=16,
                   stop_on_eos=False)
    drafted = [d for r in res.rounds for d in r.drafted]
    assert drafted, "prompt lookup proposed nothing: the check would be vacuous"
    for d in drafted:
        assert [(t.id, t.prob) for t in d.top_q] == [(d.token_id, 1.0)] and d.q == 1.0
    res = generate(target, make_proposer("draft", target, tiny["draft_small"]), PROMPTS[1], gamma=3,
                   max_new_tokens=8, stop_on_eos=False)
    for d in (d for r in res.rounds for d in r.drafted):
        probs = [t.prob for t in d.top_q]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True)
        assert d.token_id == d.top_q[0].id  # greedy: the draft's argmax


def test_kv_rollback_matches_fresh_prefill(tiny):
    target = tiny["target"]
    dec = SpeculativeDecoder(target, make_proposer("draft", target, tiny["draft"]), PROMPTS[1], gamma=5,
                             sampling=SamplingConfig(temperature=1.0), seed=3, max_new_tokens=30,
                             stop_on_eos=False)
    rejected = 0
    while not dec.finished:
        r = dec.step()
        rejected += r.next_kind == "correction"
        # the target cache holds exactly the sequence minus tokens not yet fed
        cached = dec.target_lm.ids
        assert cached == dec.seq[:len(cached)]
    assert rejected > 0, "the test needs rejections to exercise the rollback"
    # KV after rollbacks equals a fresh forward over the same tokens
    n = dec.target_lm.cached_len
    fresh = target.model(torch.tensor([dec.seq[:n]]), use_cache=True).past_key_values
    for a, b in zip(dec.target_lm.cache.layers, fresh.layers):
        assert a.keys.shape == b.keys.shape
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("gamma", range(1, 9))
def test_max_new_tokens_never_exceeded(tiny, gamma):
    target = tiny["target"]
    for n in (1, 2, 3, 7):
        for kind in ("ngram", "early-exit:3"):
            res = generate(target, make_proposer(kind, target), PROMPTS[0], gamma=gamma, max_new_tokens=n,
                           stop_on_eos=False, sampling=SamplingConfig(temperature=0.8), seed=gamma)
            assert len(res.token_ids) == n


def test_eos_inside_accepted_block_stops():
    # token 2 → token 0 (EOS) with certainty; the draft is the same table, so all is accepted
    v = 6
    t = toy_cycle_table(v, 6.0)
    t[2] = torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=torch.float64)
    lm = bigram_loaded(t)
    prop = DraftModelProposer(bigram_loaded(t), lm)
    res = generate(lm, prop, [3, 4, 5, 1, 2], gamma=6, max_new_tokens=50,
                   sampling=SamplingConfig(temperature=1.0), seed=0)
    assert res.token_ids[-1] == 0 and 0 not in res.token_ids[:-1]
    assert res.rounds[-1].stop_reason == "eos"
    greedy = generate(lm, prop, [1, 2], gamma=4, max_new_tokens=50)
    assert greedy.token_ids == [0] and greedy.stats.rounds == 1


def test_draft_tokens_after_an_accepted_eos_are_not_counted():
    # after token 2 the target is sure of EOS (0), and after EOS of 3 then 4: a draft of the same
    # table proposes [0, 3, 4], all the target's argmax. The output ends at EOS, so only that one draft
    # token counts: α̂ = 1 of 1 judged (it was 3 of 3, with 3 "accepted" tokens that were never emitted)
    v = 6
    t = toy_cycle_table(v, 50.0)
    t[2] = torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02], dtype=torch.float64)
    t[0] = torch.tensor([0.02, 0.02, 0.02, 0.9, 0.02, 0.02], dtype=torch.float64)
    lm = bigram_loaded(t)
    res = generate(lm, DraftModelProposer(bigram_loaded(t), lm), [1, 2], gamma=3, max_new_tokens=50)
    assert res.token_ids == [0]
    (rnd,) = res.rounds
    assert [d.token_id for d in rnd.drafted] == [0, 3, 4]
    assert [d.verdict for d in rnd.drafted] == ["accepted", AFTER_END, AFTER_END]
    assert rnd.n_accepted == 1 and rnd.emitted_ids == [0] and rnd.ended_in_draft
    assert rnd.to_dict()["ended_in_draft"] is True  # the JSON says the target's own token was not emitted
    assert token_origins(res.rounds) == [(0, "accepted")]
    st = res.stats
    assert (st.accepted, st.judged, st.acceptance_rate, st.acceptance_by_position) == (1, 1, 1.0, [1.0])
    assert "ended the output" in round_summary(rnd) and "bonus" not in verdict_frame(rnd)
    # the usual case is unchanged: the target's own token ends a round that did not hit EOS
    res = generate(lm, DraftModelProposer(bigram_loaded(t), lm), [3], gamma=2, max_new_tokens=3)
    assert not any(r.ended_in_draft for r in res.rounds)


def test_seeded_runs_reproducible(tiny):
    target = tiny["target"]
    runs = [generate(target, make_proposer("draft", target, tiny["draft"]), PROMPTS[0], gamma=3,
                     sampling=SamplingConfig(temperature=1.0, top_k=10), seed=s, max_new_tokens=20,
                     stop_on_eos=False).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_trace_top_lists_leave_out_zero_probability_tokens(tiny):
    """A user's report: with top-k the trace's top-5 lists (and the residual's) were padded with tokens of
    probability 0."""
    target = tiny["target"]
    res = generate(target, make_proposer("draft", target, tiny["draft"]), PROMPTS[0], gamma=3,
                   sampling=SamplingConfig(temperature=1.0, top_k=2), seed=1, max_new_tokens=20, stop_on_eos=False)
    lists = [r.next_top_p for r in res.rounds] + [r.residual_top for r in res.rounds if r.residual_top]
    lists += [d.top_p for r in res.rounds for d in r.drafted] + [d.top_q for r in res.rounds for d in r.drafted]
    assert any(r.residual_top for r in res.rounds)  # the case the report was about ran
    assert all(1 <= len(tops) <= 2 and all(t.prob > 0 for t in tops) for tops in lists)


# ---------------------------------------------------------------- distribution preservation

def exact_joint(table: torch.Tensor, cfg: SamplingConfig, first: int, n: int) -> dict[tuple, float]:
    """Exact distribution of the next n tokens of a bigram target after token ``first``."""
    probs = warp_probs(torch.log(table), cfg)
    out = {}
    for seq in itertools.product(range(table.shape[0]), repeat=n):
        pr, prev = 1.0, first
        for t in seq:
            pr *= float(probs[prev, t])
            prev = t
        if pr > 0:
            out[seq] = pr
    return out


def joint_test(target, proposer_fn, prompt, cfg, n_tokens, gamma, runs, exact):
    counts: dict[tuple, int] = {}
    drafted = accepted = passes = emitted = 0
    for s in range(runs):
        res = generate(target, proposer_fn(), prompt, gamma=gamma, sampling=cfg, seed=s,
                       max_new_tokens=n_tokens, stop_on_eos=False)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted += res.stats.judged
        accepted += res.stats.accepted
    keys = sorted(set(exact) | set(counts))
    assert all(k in exact for k in counts), "emitted a sequence the target gives probability 0"
    obs = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    exp = torch.tensor([exact.get(k, 0.0) for k in keys], dtype=torch.float64)
    return g_test_pvalue(obs, exp / exp.sum()), accepted / max(drafted, 1)


V = 7  # 5 words + eos + unk, as in the explainer's toy (context-dependent: a bigram table)


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4),
                                 SamplingConfig(temperature=1.3, top_p=0.8)],
                         ids=["T1", "T0.7-topk4", "T1.3-topp0.8"])
def test_distribution_preserved_draft_model(cfg):
    target_t = toy_cycle_table(V, 8.0)                 # the explainer's target: peak 8
    draft_t = toy_cycle_table(V, 4.0)                  # its draft: peak 4, less sure
    draft_t[:, 3] += 0.3                               # and context-independent bias
    draft_t = draft_t / draft_t.sum(-1, keepdim=True)
    target, draft = bigram_loaded(target_t), bigram_loaded(draft_t)
    exact = exact_joint(target_t, cfg, first=4, n=3)
    pval, _ = joint_test(target, lambda: DraftModelProposer(draft, target), [2, 3, 4], cfg, 3, 2, 3000, exact)
    assert pval > 0.001


def test_distribution_preserved_prompt_lookup():
    cfg = SamplingConfig(temperature=1.0)
    target_t = toy_cycle_table(V, 3.0)
    target = bigram_loaded(target_t)
    exact = exact_joint(target_t, cfg, first=4, n=3)
    # the prompt repeats "4 5" so lookup proposes point masses the target often rejects
    pval, acc = joint_test(target, lambda: PromptLookupProposer(V, 3, 1), [4, 5, 4, 6, 2, 4], cfg, 3, 3, 3000, exact)
    assert pval > 0.001
    assert 0 < acc < 1


def test_wrong_draft_distribution_detected():
    """Sanity check of the harness: sampling from the draft alone does not pass as the target."""
    cfg = SamplingConfig(temperature=1.0)
    target_t, draft_t = toy_cycle_table(V, 8.0), toy_cycle_table(V, 1.5)
    exact = exact_joint(target_t, cfg, first=4, n=3)
    pval, _ = joint_test(bigram_loaded(draft_t), lambda: None, [4], cfg, 3, 2, 1500, exact)
    assert pval < 1e-6


def test_acceptance_and_tokens_per_pass_match_formula():
    """Explainer's toy: α = Σ min(p, q) is the same in every context, so E = (1 − α^(γ+1)) / (1 − α)."""
    cfg = SamplingConfig(temperature=1.0)
    target_t, draft_t = toy_cycle_table(5, 8.0), toy_cycle_table(5, 4.0)
    target, draft = bigram_loaded(target_t), bigram_loaded(draft_t)
    alpha = float(torch.minimum(target_t[0], draft_t[0]).sum())
    # p = [1,8,1,1,1]/12, q = [1,4,1,1,1]/8: Σmin = 4·(1/12) + 4/8 = 0.8333
    assert alpha == pytest.approx(0.8333, abs=1e-4)
    res = generate(target, DraftModelProposer(draft, target), [2], gamma=4, sampling=cfg, seed=0,
                   max_new_tokens=4000, stop_on_eos=False)
    full = [r for r in res.rounds if r.n_drafted == 4]
    assert res.stats.acceptance_rate == pytest.approx(alpha, abs=0.02)
    # accepted ÷ drafted is lower: E[accepted] / γ = (α + α² + α³ + α⁴) / 4 = 0.6472 at α = 0.8333
    assert res.stats.accepted_fraction == pytest.approx(sum(alpha ** i for i in range(1, 5)) / 4, abs=0.02)
    # P(accept at position i | reached i) = α at every position
    assert res.stats.acceptance_by_position == pytest.approx([alpha] * 4, abs=0.04)
    # E at α = 0.8333, γ = 4: (1 − 0.8333^5) / (1 − 0.8333) = 3.590
    e = (1 - alpha ** 5) / (1 - alpha)
    per_pass = sum(len(r.emitted_ids) for r in full) / len(full)
    assert per_pass == pytest.approx(e, abs=0.08)


# ---------------------------------------------------------------- errors

def test_tokenizer_mismatch_raises(tiny):
    with pytest.raises(TokenizerMismatchError, match="tokenizer"):
        DraftModelProposer(tiny["other"], tiny["target"])


def test_bad_arguments(tiny):
    target = tiny["target"]
    with pytest.raises(InputError, match="empty"):
        encode_prompt(target.tokenizer, "   ")
    with pytest.raises(InputError, match="empty"):
        SpeculativeDecoder(target, None, [], max_new_tokens=3)
    for g in (0, -1, 1000):
        with pytest.raises(InputError, match="γ"):
            SpeculativeDecoder(target, make_proposer("ngram", target), [1, 2], gamma=g)
    with pytest.raises(InputError, match="context"):
        SpeculativeDecoder(target, None, list(range(2, 30)) * 20, max_new_tokens=10)
    with pytest.raises(InputError, match="max new tokens"):
        SpeculativeDecoder(target, None, [2, 3], max_new_tokens=0)
    with pytest.raises(InputError):
        make_proposer("early-exit:99", target)
    with pytest.raises(InputError):
        make_proposer("early-exit:x", target)


def test_unknown_model_offline_is_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="Could not load"):
        load_model("no-such-org/no-such-model-xyz")
    with pytest.raises(ModelLoadError, match="No such model folder"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "empty"))


# ---------------------------------------------------------------- the embedded model

EMBEDDED_PROMPTS = ["What is the capital of France?",
                    "Fix the bug in this code:\n\ndef add(a, b):\n    return a - b\n"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "early-exit:10"])
def test_embedded_greedy_identical(embedded, kind):
    for prompt in EMBEDDED_PROMPTS:
        ids = encode_prompt(embedded.tokenizer, prompt)
        ref = generate(embedded, None, ids, max_new_tokens=24).token_ids  # plain greedy on the same compute path
        for gamma in (1, 3, 6):
            got = generate(embedded, make_proposer(kind, embedded), ids, gamma=gamma, max_new_tokens=24)
            assert got.token_ids == ref, (kind, gamma, prompt)


def test_concurrent_steps_are_serialized(tiny):
    """Two threads stepping one decoder (a web page rerun racing the previous run) give the same
    tokens as stepping it alone, and never corrupt the KV cache."""
    import threading

    target = tiny["target"]

    def make():
        return SpeculativeDecoder(target, make_proposer("early-exit:1", target), PROMPTS[1], gamma=3,
                                  sampling=SamplingConfig(temperature=1.0), seed=11, max_new_tokens=40,
                                  stop_on_eos=False)

    alone = make()
    while not alone.finished:
        alone.step()
    shared = make()
    errors = []

    def worker():
        try:
            while not shared.finished:
                try:
                    shared.step()
                except InputError:  # the other thread finished the run first
                    break
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert shared.new_ids == alone.new_ids
    with pytest.raises(InputError, match="finished"):
        shared.step()


def test_cuda_requested_without_cuda_is_clear(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ModelLoadError, match="CUDA"):
        load_model(str(tmp_path), device="cuda")


def test_adaptive_prompt_lookup_schedule_and_exactness(tiny):
    """Adaptive lookup: +2 after a fully accepted proposal, −1 (≥ 1) after a rejection; output unchanged."""
    lookup = PromptLookupProposer(32, 3, 1, adaptive=True)
    cfg = SamplingConfig()
    seq = [1, 2, 3, 4, 5, 1, 2, 3]
    prop = lookup.propose(seq, 5, cfg, torch.Generator())
    assert prop.tokens == [4, 5, 1, 2, 3]  # the continuation of the earlier "1 2 3"
    lookup.rollback(seq + [4, 5, 1, 2, 3, 9])  # all 5 accepted (+ bonus 9): the cap 5 grows by 2
    assert lookup.k_next == 7
    seq = seq + [4, 5, 1, 2, 3, 9]
    # cap min(8, 7): 4 5 1 2 3, then the copy runs on over the text it repeats (period 5): 4 5
    assert lookup.propose(seq[:8], 8, cfg, torch.Generator()).tokens == [4, 5, 1, 2, 3, 4, 5]
    lookup.rollback(seq[:8] + [4, 7])  # first accepted, second rejected: the cap 7 shrinks by 1
    assert lookup.k_next == 6
    lookup.propose(seq[:8], 8, cfg, torch.Generator())
    lookup.rollback(seq[:8] + [6])  # rejected at once
    assert lookup.k_next == 5
    # capped proposals: only k_next tokens are proposed
    assert len(lookup.propose([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], 8, cfg, torch.Generator()).tokens) == 5
    target = tiny["target"]
    for ids in PROMPTS:
        ref = hf_greedy(target, ids, 24)
        for gamma in (2, 6):
            got = generate(target, PromptLookupProposer(32, 3, 1, adaptive=True), ids, gamma=gamma,
                           max_new_tokens=24).token_ids
            assert got == ref


def test_prompt_lookup_continues_a_repeating_text_as_an_overlapping_copy():
    """The latest match of the suffix may run into the end of the text: the text then repeats with period
    d, and the copy goes on (LZ77-style) up to k tokens. It proposed only d tokens a round before, so on
    repeating output the adaptive length never grew to γ. transformers' rule ("first") is unchanged."""
    latest = PromptLookupProposer(100)
    assert latest.lookup([1, 2, 3, 4, 3, 4, 3, 4], 6) == [3, 4, 3, 4, 3, 4]  # period 2
    assert latest.lookup([5, 5, 5, 5], 4) == [5, 5, 5, 5]  # period 1
    assert latest.lookup([9, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # period 3
    assert latest.lookup([1, 2, 3, 9, 1, 2], 4) == [3, 9, 1, 2]  # room enough: a plain copy
    assert PromptLookupProposer(100, stop_ids=[4]).lookup([1, 2, 3, 4, 3, 4, 3, 4], 6) == [3]  # stops still cut
    assert PromptLookupProposer(100, match="first").lookup([1, 2, 3, 4, 3, 4, 3, 4], 6) == [3, 4]


def test_prompt_lookup_first_match_equals_transformers_candidates():
    """With match="first", max n-gram 2, min 1, our lookup proposes exactly what transformers'
    PromptLookupCandidateGenerator does (the like-for-like row of the benchmark); "latest" differs."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = torch.Generator().manual_seed(3)
    differs = cut = 0
    for stop in ([], [7], [0, 5]):  # with stop ids, candidates are cut before the first one
        ours = PromptLookupProposer(8, max_ngram=2, min_ngram=1, match="first", stop_ids=stop)
        latest = PromptLookupProposer(8, max_ngram=2, min_ngram=1, stop_ids=stop)
        no_stop = PromptLookupProposer(8, max_ngram=2, min_ngram=1, match="first")
        for trial in range(300):
            seq = torch.randint(0, 8, (int(torch.randint(2, 40, (1,), generator=rng)),), generator=rng).tolist()
            k = int(torch.randint(1, 7, (1,), generator=rng))
            hf = PromptLookupCandidateGenerator(eos_token_id=torch.tensor(stop) if stop else None,
                                                num_output_tokens=k, max_matching_ngram_size=2,
                                                max_length=10_000, logits_processor=None, vocab_size=8)
            out, _ = hf.get_candidates(torch.tensor([seq]))
            want = out[0, len(seq):].tolist()
            got = ours.lookup(seq, k)
            assert got == want, (seq, k, stop)
            assert not set(got) & set(stop)
            differs += latest.lookup(seq, k) != want
            cut += no_stop.lookup(seq, k) != got
    assert differs > 90  # the two rules really are different
    assert cut > 90  # and the stop ids really cut
    with pytest.raises(InputError, match="match"):
        PromptLookupProposer(8, match="longest")


def _count_passes(model):
    calls = []
    handle = model.register_forward_hook(lambda m, a, kw_out=None: calls.append(1))
    return calls, handle


def test_prefill_logits_are_reused_so_passes_match_plain_generate(tiny):
    """The prompt's prefill pass gives p for the first new token: plain decoding of N tokens makes N
    target passes (as transformers' generate), and a first round with no draft makes no pass."""
    target = tiny["target"]
    ids = PROMPTS[1]
    calls, handle = _count_passes(target.model)
    try:
        res = generate(target, None, ids, max_new_tokens=10, stop_on_eos=False)
        assert len(calls) == 10 and res.token_ids == hf_greedy(target, ids, 10)
        assert res.rounds[0].tokens_verified == 0 and res.rounds[1].tokens_verified == 1
        st = res.stats
        assert set(st.verify_ms_by_tokens) == {1}  # the pass-less first round is not a pass of 0 tokens
        assert st.verify_ms_mean == pytest.approx(sum(r.verify_ms for r in res.rounds[1:]) / 9)
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", ["ngram", "early-exit:2", "draft"])
def test_first_verify_pass_also_prefills_the_prompt(tiny, kind):
    """A draft that proposes from the prompt alone gets its first round verified in the prefill pass
    (prompt + draft tokens, as transformers' assisted generation does): one target pass per round, the
    same greedy output, and that pass is kept out of the verify-time statistics. An explicit
    ``prefill()`` (the live page) still gives the prompt a pass of its own."""
    target = tiny["target"]
    ids = PROMPTS[0]  # repeats itself, so prompt lookup has something to propose in round 1
    calls, handle = _count_passes(target.model)
    try:
        prop = make_proposer("draft" if kind == "draft" else kind, target, tiny["draft"])
        if kind == "ngram":
            assert prop.stop_ids == frozenset(target.eos_token_ids)  # copies are cut at end of turn
        res = generate(target, prop, ids, gamma=3, max_new_tokens=16, stop_on_eos=False)
        n_target = len(calls) if kind != "early-exit:2" else None  # early exit's layers run the same module
        first = res.rounds[0]
        assert first.prefill_tokens == len(ids) and first.n_drafted > 0
        assert first.tokens_verified == len(ids) + first.n_drafted
        assert all(r.prefill_tokens == 0 for r in res.rounds[1:])
        if n_target is not None:
            assert n_target == res.stats.rounds
        # plain decoding equals transformers' generate (tested above); here EOS must not stop the run
        assert res.token_ids == generate(target, None, ids, max_new_tokens=16, stop_on_eos=False).token_ids
        st = res.stats
        assert st.prefill_ms == first.verify_ms
        assert max(st.verify_ms_by_tokens) <= 4  # the prompt's pass is not a verify pass of 10 tokens
        calls.clear()
        dec = SpeculativeDecoder(target, make_proposer("draft" if kind == "draft" else kind, target, tiny["draft"]),
                                 ids, gamma=3, max_new_tokens=16, stop_on_eos=False)
        dec.prefill()
        assert dec.step().prefill_tokens == 0 and dec.rounds[0].tokens_verified == dec.rounds[0].n_drafted
        assert dec.run().token_ids == res.token_ids
    finally:
        handle.remove()


def test_cached_lm_reuses_the_last_logits_only_while_valid(tiny):
    from engine.decoding.proposers import CachedLM

    model = tiny["target"].model
    seq = [5, 6, 7, 8, 9]
    with torch.no_grad():
        full = model(torch.tensor([seq + [10, 11]])).logits[0].float()
    lm = CachedLM(model, torch.device("cpu"))
    calls, handle = _count_passes(model)
    try:
        a = lm.logits_for(seq, 1)
        b = lm.logits_for(seq, 1)  # fully cached: the stored logits, no pass
        assert len(calls) == 1 and torch.equal(a, b)
        c = lm.logits_for(seq + [10, 11], 3)  # first asked-for position cached: feed only the 2 new tokens
        assert len(calls) == 2 and lm.cached_len == 7
        assert torch.allclose(c, full[4:7], atol=1e-4)
        lm.crop(6)  # cropped below the kept position: the stored logits are gone, token 6 is fed again
        d = lm.logits_for(seq + [10], 1)
        assert len(calls) == 3 and torch.allclose(d[0], full[5], atol=1e-4)
    finally:
        handle.remove()


def test_absorbing_every_layer_in_one_block_gives_the_per_layer_cache(tiny):
    """``CachedLM.absorb`` with one [layers, 1, heads, w, d] block (the room's unstacking) leaves exactly the cache
    that layer-by-layer ``DynamicCache.update`` leaves, after a crop too, and later passes see the same entries."""
    from engine.decoding.proposers import CachedLM

    model = tiny["target"].model
    with torch.inference_mode():
        lms = [CachedLM(model, torch.device("cpu")) for _ in range(2)]
        for lm in lms:
            lm.logits_for([5, 6, 7, 8, 9], 1)
            lm.crop(4)  # a rolled-back cache: the layers are views shorter than their tensors
        for step, feed in enumerate(([10, 11, 12], [13], [14, 15])):
            out = model(input_ids=torch.tensor([feed]), use_cache=True,
                        cache=_copy_cache(lms[0].cache)).past_key_values
            n = lms[0].cached_len
            per_layer = [(la.keys[:, :, n:], la.values[:, :, n:]) for la in out.layers]
            logits = torch.zeros(32)
            lms[0].absorb(feed, [k for k, _ in per_layer], [v for _, v in per_layer], None, logits)
            lms[1].absorb(feed, torch.stack([k for k, _ in per_layer]), torch.stack([v for _, v in per_layer]), None,
                          logits)
            for a, b in zip(lms[0].cache.layers, lms[1].cache.layers):
                assert a.keys.shape == b.keys.shape and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert lms[0].ids == lms[1].ids
            if step == 1:
                for lm in lms:
                    lm.crop(lm.cached_len - 1)
        got = [lm.logits_for(lm.ids + [20, 21], 2) for lm in lms]
    assert torch.equal(got[0], got[1])
    # logits_for wrote its entries into lms[1]'s block in place (BlockLayer): still every layer a view of it
    assert lms[1].kv_block() is not None
    empty = CachedLM(model, torch.device("cpu"))  # nothing cached yet: the block goes in layer by layer
    blk = torch.zeros(len(lms[0].cache.layers), 1, *lms[0].cache.layers[0].keys.shape[1:2], 2,
                      lms[0].cache.layers[0].keys.shape[-1])
    empty.absorb([1, 2], blk, blk, None, torch.zeros(32))
    assert empty.cache.get_seq_length() == 2


def test_a_block_takes_new_entries_in_place_until_full_then_grows(tiny, monkeypatch):
    """``CachedLM._append_block`` writes a pass's entries after the cached ones in the same block while they fit (the
    layers stay views of it: ``kv_block`` gives them all at once), overwrites entries cropped away, and makes a bigger
    block, with the cache copied in, when they do not; every step leaves the cache layer-by-layer ``update`` leaves."""
    import engine.decoding.proposers as proposers
    from engine.decoding.proposers import CachedLM

    monkeypatch.setattr(proposers, "BLOCK_SPARE", 3)
    model = tiny["target"].model
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        lm, ref = CachedLM(model, torch.device("cpu")), CachedLM(model, torch.device("cpu"))
        for x in (lm, ref):
            x.logits_for([5, 6, 7, 8], 1)
        shape = lm.cache.layers[0].keys.shape
        n_layers = len(lm.cache.layers)
        ptrs = []
        for step, (w, crop) in enumerate(((2, 0), (1, 1), (2, 0), (3, 2), (1, 0))):
            k = torch.randn(n_layers, 1, shape[1], w, shape[3], generator=gen)
            v = torch.randn(n_layers, 1, shape[1], w, shape[3], generator=gen)
            feed = list(range(30 + 3 * step, 30 + 3 * step + w))
            lm.absorb(feed, k, v, None, torch.zeros(32))
            ref.absorb(feed, [k[i] for i in range(n_layers)], [v[i] for i in range(n_layers)], None, torch.zeros(32))
            blk = lm.kv_block()
            assert blk is not None and blk[0].shape[-2] == lm.cached_len
            for i, (a, b) in enumerate(zip(lm.cache.layers, ref.cache.layers)):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                assert torch.equal(blk[0][i], b.keys) and torch.equal(blk[1][i], b.values)
            ptrs.append(blk[0].data_ptr())
            for x in (lm, ref):
                x.crop(x.cached_len - crop)
    # 4 cached + 2 makes a block of 4 + 2 + 3; + 1 (after a crop of 1) and + 2 fit in it; 8 + 3 does not: a new
    # block of 11 + 3, which then takes the last entry in place
    assert ptrs[0] == ptrs[1] == ptrs[2] != ptrs[3] == ptrs[4]


def test_decode_passes_write_into_the_block_in_place_with_the_entries_and_logits_of_concatenation(tiny, monkeypatch):
    """A lone ``CachedLM``'s decode passes put the cache into a block (``_ensure_block``) and its layers
    (``BlockLayer``) write each pass's entries there in place, growing the block when full, and the kept hidden states
    grow in a buffer the same way (``append_hidden``): after every step, crops (a rejected draft's rollback) included,
    the cached entries, hidden states and logits are exactly those of concatenating (transformers'
    ``DynamicLayer.update``, ``torch.cat``), and the layers stay views of one block."""
    import engine.decoding.proposers as proposers
    from engine.decoding.proposers import CachedLM, block_layer_class

    monkeypatch.setattr(proposers, "BLOCK_SPARE", 3)
    layer_cls = block_layer_class()
    model = tiny["target"].model
    seqs = [5, 6, 7, 8]
    with torch.inference_mode():
        lm, ref = CachedLM(model, torch.device("cpu"), keep_hidden=True), CachedLM(model, torch.device("cpu"),
                                                                                    keep_hidden=True)
        ref.append_hidden = lambda h: setattr(ref, "hidden", h if ref.hidden is None else torch.cat([ref.hidden, h]))
        ptrs = []
        for step, (feed, crop) in enumerate((([9], 0), ([10, 11, 12], 2), ([13, 14], 0), ([15], 1), ([16, 17, 18, 19], 0),
                                             ([20], 0))):
            seqs = seqs + feed
            got = lm.logits_for(seqs, len(feed))
            monkeypatch.setattr(layer_cls, "IN_PLACE", False)
            want = ref.logits_for(seqs, len(feed))
            monkeypatch.setattr(layer_cls, "IN_PLACE", True)
            assert torch.equal(got, want), step
            assert torch.equal(lm.hidden, ref.hidden), step
            for a, b in zip(lm.cache.layers, ref.cache.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            if step:  # the first decode pass made the block; every pass since wrote into a block
                blk = lm.kv_block()
                assert blk is not None and blk[0].shape[-2] == lm.cached_len
                ptrs.append(blk[0].data_ptr())
            if crop:
                seqs = seqs[:-crop]
                for x in (lm, ref):
                    x.crop(len(seqs))
    assert type(lm.cache.layers[0]) is layer_cls and len(set(ptrs)) >= 2  # in place, and grown when full
    assert ptrs.count(ptrs[0]) >= 2
    assert lm.hidden.data_ptr() == lm._hidden_buf.data_ptr()  # the hidden states are a view of their buffer


def test_token_text_memo_is_shared_by_the_decoders_of_one_tokenizer(tiny):
    """``_TokenText``: one memo per tokenizer (a room's readers share what any of them decoded), each text exactly the
    tokenizer's own decode of that one id; another tokenizer has its own memo."""
    import copy

    from engine.decoding.speculative import _TokenText

    tok = tiny["target"].tokenizer
    a, b = _TokenText(tok), _TokenText(tok)
    assert a.memo is b.memo
    for i in (3, 7, 11, 3):
        assert a(i) == tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert 7 in b.memo and b(7) == a(7)
    other = _TokenText(copy.copy(tok))
    assert other.memo is not a.memo


def test_reserve_block_puts_the_cache_into_a_block_that_the_next_pass_fills_in_place(tiny):
    """``CachedLM.reserve_block`` (the room calls it after a prefill): the same entries, now views of one block with
    ``BLOCK_SPARE`` to spare, so the next absorbed pass writes into that block (same data pointer); an empty cache
    is left alone."""
    from engine.decoding.proposers import BLOCK_SPARE, CachedLM

    model = tiny["target"].model
    with torch.inference_mode():
        empty = CachedLM(model, torch.device("cpu"))
        assert empty.reserve_block() is False and empty.kv_block() is None
        lm, ref = CachedLM(model, torch.device("cpu")), CachedLM(model, torch.device("cpu"))
        for x in (lm, ref):
            x.logits_for([5, 6, 7, 8, 9], 1)
        assert lm.kv_block() is None  # a prefill leaves transformers' own layers
        assert lm.reserve_block() is True
        blk = lm.kv_block()
        assert blk is not None and blk[0].shape[-2] == 5 and lm._block[0].shape[-2] == 5 + BLOCK_SPARE
        for i, (a, b) in enumerate(zip(lm.cache.layers, ref.cache.layers)):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert torch.equal(blk[0][i], b.keys) and torch.equal(blk[1][i], b.values)
        ptr = lm._block[0].data_ptr()
        assert lm.reserve_block() is True and lm._block[0].data_ptr() == ptr  # already a block: nothing made
        shape, n_layers = lm.cache.layers[0].keys.shape, len(lm.cache.layers)
        gen = torch.Generator().manual_seed(2)
        k = torch.randn(n_layers, 1, shape[1], 3, shape[3], generator=gen)
        v = torch.randn(n_layers, 1, shape[1], 3, shape[3], generator=gen)
        lm.absorb([10, 11, 12], k, v, None, torch.zeros(32))
        ref.absorb([10, 11, 12], [k[i] for i in range(n_layers)], [v[i] for i in range(n_layers)], None,
                   torch.zeros(32))
        assert lm._block[0].data_ptr() == ptr and lm.kv_block()[0].shape[-2] == 8
        for a, b in zip(lm.cache.layers, ref.cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(lm.logits_for([5, 6, 7, 8, 9, 10, 11, 12, 13], 1),
                           ref.logits_for([5, 6, 7, 8, 9, 10, 11, 12, 13], 1))


def test_kv_block_sees_a_layer_that_no_longer_holds_the_blocks_view(tiny):
    """``kv_block`` answers from the views it made itself only while every layer still holds them: a layer given other
    tensors (a copy, a crop) makes it check the layers again and answer None."""
    from engine.decoding.proposers import CachedLM

    model = tiny["target"].model
    with torch.inference_mode():
        lm = CachedLM(model, torch.device("cpu"))
        lm.logits_for([5, 6, 7, 8, 9], 1)
        assert lm.reserve_block() is True and lm.kv_block() is not None
        layer = lm.cache.layers[1]
        layer.keys = layer.keys.clone()  # the same values, no longer the block's
        assert lm.kv_block() is None
        lm2 = CachedLM(model, torch.device("cpu"))
        lm2.logits_for([5, 6, 7, 8, 9], 1)
        lm2.reserve_block()
        lm2.crop(3)
        blk = lm2.kv_block()
        assert blk is not None and blk[0].shape[-2] == 3  # a crop's slices are still views of the block


def test_warp_together_gives_each_round_the_bits_of_its_own_warp():
    """``warp_together`` (the room warps a pass's rounds together): each round's p and top-5 are ``warp_probs`` and
    ``top_k_rows`` of that round alone, bit for bit, for greedy and sampled rounds of different lengths and settings
    mixed in one call."""
    from engine.decoding.sampling import argmax_rows, cumsum_rows, sample, top_k_rows
    from engine.decoding.speculative import warp_together

    gen = torch.Generator().manual_seed(5)
    cfgs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.8),
            SamplingConfig(temperature=1.0, top_k=50), SamplingConfig(temperature=0.7, top_p=0.9),
            SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.7, top_p=0.9)]
    rounds = [(c, torch.randn(1 + i % 3, 49152, generator=gen) * 4) for i, c in enumerate(cfgs)]
    together = warp_together(rounds)
    assert len(together) == len(rounds)
    for (cfg, logits), (p, (vals, idx), best, cdf) in zip(rounds, together):
        alone = warp_probs(logits.double() if not cfg.greedy else logits, cfg)
        assert p.dtype == alone.dtype and torch.equal(p, alone)
        v, i = top_k_rows(alone, 5)
        assert vals == v.tolist() and idx == i.tolist()
        if cfg.greedy:
            assert cdf is None and best == argmax_rows(logits)
        else:  # the bonus draw from the cdf made with the others is the draw sample makes alone
            assert best is None and torch.equal(cdf, torch.cumsum(alone[-1], 0))
            draws = [sample(alone[-1], torch.Generator().manual_seed(s), c) for s in range(20) for c in (None, cdf)]
            assert draws[0::2] == draws[1::2]
    negative = torch.tensor([[0.5, -0.1, 0.6], [0.2, 0.3, 0.5]])
    assert cumsum_rows(negative)[0] is None and cumsum_rows(negative)[1] is not None


def _copy_cache(cache):
    from transformers import DynamicCache

    c = DynamicCache()
    for i, la in enumerate(cache.layers):
        c.update(la.keys.clone(), la.values.clone(), i)
    return c


def test_a_separate_prefill_is_counted_once_in_the_total_time(tiny):
    """The first step of a decoder that was not prefilled early prefills in a pass of its own: its time is
    prefill_ms and must be in total_ms once (it was added twice, inflating plain decoding's ms per token
    and so the measured speedup). A 1.5 s sleep in the prompt's pass makes the prefill dominate: counted
    twice, total − prefill ≥ prefill whatever the machine's load."""
    import time

    target = tiny["target"]

    def slow_prompt(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 1:
            time.sleep(1.5)

    handle = target.model.register_forward_pre_hook(slow_prompt, with_kwargs=True)
    try:
        st = generate(target, None, PROMPTS[1], max_new_tokens=6, stop_on_eos=False).stats
    finally:
        handle.remove()
    assert st.prefill_ms >= 1500
    rounds_ms = st.total_ms - st.prefill_ms  # 6 one-token steps of a tiny model: well under the prefill
    assert 0 < rounds_ms < st.prefill_ms, (st.total_ms, st.prefill_ms)
