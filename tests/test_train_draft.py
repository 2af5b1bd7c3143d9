"""The draft-training pipeline (engine.training.draft_data, engine.training.train_draft) and the shipped draft.

Fast tests run the whole command on a tiny random target (a few steps, a handful of prompts); the
shipped draft's tests load the embedded model and are marked slow.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from engine.decoding.models import load_model
from engine.decoding.drafts import make_proposer
from engine.decoding.speculative import encode_prompt, generate
from engine.errors import InputError
from engine.training.draft_data import TOPICS, _is_heldout_topic, build_prompts, generate_batch
from engine.training.train_draft import Sample, distill_loss, evaluate_draft, main, make_batches, pca_embeddings
from tests.tiny_models import save_tiny_llama

# ---------------------------------------------------------------------------------------------- prompts


def test_prompts_deterministic_distinct_and_topics_disjoint():
    a, b = build_prompts(300, "train", seed=1), build_prompts(300, "train", seed=1)
    assert a == b
    assert len({p["prompt"] for p in a}) == 300
    cats = {p["category"] for p in a}
    assert {"chat", "explain", "code", "list", "summary"} <= cats
    held = build_prompts(100, "heldout")
    train_topics = [t for t in TOPICS if not _is_heldout_topic(t)]
    held_topics = [t for t in TOPICS if _is_heldout_topic(t)]
    assert held_topics and train_topics
    # a held-out topic never appears in a training prompt, and vice versa
    for p in a:
        assert not any(t in p["prompt"] for t in held_topics if len(t) > 6)
    assert any(t in p["prompt"] for p in held for t in held_topics)


def test_prompt_set_2_is_broader_and_keeps_held_out_topics_out():
    from engine.training.draft_data import TOPICS_2

    a = build_prompts(2000, "train", seed=3, prompt_set=2)
    assert a == build_prompts(2000, "train", seed=3, prompt_set=2)
    assert len({p["prompt"] for p in a}) == 2000
    cats = {p["category"] for p in a}
    assert {"howto", "advice", "rewrite", "code", "chat", "summary"} <= cats
    assert len(cats) == 11
    # no held-out topic of either set appears in a set-2 training prompt (the benchmarks' held-out
    # prompts come from set 1)
    held = re.compile(r"\b(" + "|".join(re.escape(t) for t in TOPICS_2 if _is_heldout_topic(t)) + r")\b", re.I)
    assert set(t for t in TOPICS if _is_heldout_topic(t)) <= set(TOPICS_2)
    for p in a:
        assert not held.search(p["prompt"]), p


def test_prompts_bad_arguments():
    with pytest.raises(InputError):
        build_prompts(0)
    with pytest.raises(InputError):
        build_prompts(5, split="test")
    with pytest.raises(InputError, match="prompt set"):
        build_prompts(5, prompt_set=3)


# ---------------------------------------------------------------------------------------------- pieces


def test_distill_loss_hand_computed():
    # logits = [ln 2, 0, 0] → q = [0.5, 0.25, 0.25]; target top-2 = ids [0, 1] with p = [0.6, 0.2]
    # → p̃ = [0.75, 0.25]; KL = 0.75 ln(0.75/0.5) + 0.25 ln(0.25/0.25) = 0.75 × 0.405465 = 0.304099;
    # hard = −ln q(0) = 0.693147; λ = 0.5 → 0.304099 + 0.346574 = 0.650673; argmax q = 0 = argmax p.
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[math.log(2), 0.0], [0.0, 0.0], [0.0, 0.0]]))
    hidden = torch.tensor([[1.0, 5.0]])
    loss, agree = distill_loss(hidden, head, torch.tensor([[0, 1]]), torch.log(torch.tensor([[0.6, 0.2]])), 0.5)
    assert float(loss.detach()) == pytest.approx(0.650673, abs=1e-5)
    assert agree == 1
    # the same position with target top-1 = id 1 instead: the draft's argmax (0) disagrees
    _, agree = distill_loss(hidden, head, torch.tensor([[1, 0]]), torch.log(torch.tensor([[0.6, 0.2]])), 0.5)
    assert agree == 0


def test_pca_embeddings_keep_inner_products_of_a_rank_d_matrix():
    # E = A·B has rank 3, so its top-3 principal directions span its rows: E_p E_pᵀ = E Eᵀ exactly.
    g = torch.Generator().manual_seed(0)
    E = torch.randn(50, 3, generator=g) @ torch.randn(3, 8, generator=g)
    P = pca_embeddings(E, 3)
    assert P.shape == (50, 3)
    assert torch.allclose(P @ P.T, E @ E.T, atol=1e-3)
    # with 2 directions the inner products are no longer exact
    P2 = pca_embeddings(E, 2)
    assert not torch.allclose(P2 @ P2.T, E @ E.T, atol=1e-2)


def _fake(n_prompt, n_resp):
    return Sample(torch.zeros(n_prompt, dtype=torch.long), torch.zeros(n_resp, dtype=torch.long),
                  torch.zeros(n_resp, 2, dtype=torch.int32), torch.zeros(n_resp, 2, dtype=torch.float16), 0.0)


def test_make_batches_cover_every_sample_once_within_budget():
    samples = [_fake(5 + i % 7, 3 + i % 11) for i in range(40)]
    batches = make_batches(samples, tokens_per_batch=64, seed=0)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(40))
    for b in batches:
        longest = max(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in b)
        assert len(b) == 1 or longest * len(b) <= 64


# ---------------------------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Run ``python -m engine.training.train_draft`` end to end on a tiny random target (a few seconds)."""
    root = tmp_path_factory.mktemp("train_draft")
    target_dir = save_tiny_llama(root / "target", vocab_size=32, layers=2, seed=0, init=0.5)
    out = root / "draft"
    rc = main(["--target", str(target_dir), "--out", str(out), "--work-dir", str(root / "work"),
               "--prompts", "12", "--heldout", "4", "--max-new-tokens", "16", "--gen-batch", "5",
               "--layers", "1", "--hidden", "16", "--intermediate", "32", "--heads", "2", "--kv-heads", "1",
               "--epochs", "40", "--lr", "1e-2", "--tokens-per-batch", "200", "--log-every", "1",
               "--dtype", "fp16", "--train-minutes", "2"])
    return dict(rc=rc, out=out, target_dir=target_dir, root=root)


def test_tiny_run_writes_a_loadable_fp16_draft(tiny_run):
    assert tiny_run["rc"] == 0
    out = tiny_run["out"]
    for name in ("config.json", "model.safetensors", "train_meta.json"):
        assert (out / name).is_file()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    draft = load_model(str(out), device="cpu")
    assert next(draft.model.parameters()).dtype == torch.float32  # cast on load, as the engine does
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == 16
    assert draft.config.vocab_size == 32


def test_tiny_run_loss_drops(tiny_run):
    meta = json.loads((tiny_run["out"] / "train_meta.json").read_text())
    log = meta["log"]
    assert len(log) >= 10
    first, last = log[0]["loss"], log[-1]["loss"]
    assert last < 0.7 * first, (first, last)
    ev = meta["heldout_eval"]
    assert ev["greedy_positions"] + ev["sampled_positions"] > 0


def test_tiny_run_output_serves_as_a_draft_with_identical_greedy_output(tiny_run):
    target = load_model(str(tiny_run["target_dir"]), device="cpu")
    draft = load_model(str(tiny_run["out"]), device="cpu")
    ids = [5, 6, 7, 8, 5, 6, 7]
    plain = generate(target, None, ids, max_new_tokens=20, stop_on_eos=False)
    spec = generate(target, make_proposer("draft", target, draft), ids, gamma=4, max_new_tokens=20,
                    stop_on_eos=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.judged > 0


def test_tiny_run_data_cache_is_reused(tiny_run, capsys):
    """A second run with the same work dir reuses the generated data instead of decoding again."""
    root = tiny_run["root"]
    rc = main(["--target", str(tiny_run["target_dir"]), "--out", str(root / "draft2"),
               "--work-dir", str(root / "work"), "--layers", "1", "--hidden", "16", "--intermediate", "32",
               "--heads", "2", "--kv-heads", "1", "--epochs", "1", "--tokens-per-batch", "200"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "reusing" in err and "generating" not in err


def test_evaluate_draft_is_one_for_the_target_itself(tiny_run):
    target = load_model(str(tiny_run["target_dir"]), device="cpu")
    prompt = [5, 6, 7]
    (resp, ti, tl), = generate_batch(target.model, [prompt], [0.0], 10, {0}, 0)
    (resp2, ti2, tl2), = generate_batch(target.model, [prompt], [0.7], 10, {0}, 0)
    samples = [Sample(torch.tensor(prompt), resp, ti, tl, 0.0), Sample(torch.tensor(prompt), resp2, ti2, tl2, 0.7)]
    ev = evaluate_draft(target.model, target.model, samples)
    assert ev["greedy_alpha"] == 1.0 and ev["alpha_T"] == pytest.approx(1.0, abs=1e-5)
    assert ev["greedy_positions"] == len(resp)


def test_generate_batch_matches_transformers_greedy(tiny_run):
    target = load_model(str(tiny_run["target_dir"]), device="cpu")
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]  # different lengths: left padding is exercised
    res = generate_batch(target.model, prompts, [0.0, 0.0, 0.0], 8, {0}, 0, top_k=4)
    for p, (resp, ti, tl) in zip(prompts, res):
        ref = target.model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=0,
                                    pad_token_id=0)[0, len(p):].tolist()
        assert resp.tolist() == ref[:len(resp)]
        assert ti.shape == (len(resp), 4) and tl.dtype == torch.float16
        assert (ti[:, 0].long() == resp).all()  # greedy: the token is p's top-1


# ---------------------------------------------------------------------------------------------- shipped draft


@pytest.mark.slow
def test_shipped_draft_loads_offline_and_is_exact_as_a_draft(embedded):
    draft = load_model("embedded-draft", device="cpu")
    assert draft.config.vocab_size == embedded.config.vocab_size
    assert draft.num_parameters < 20_000_000
    ids = encode_prompt(embedded.tokenizer, "Explain how a rainbow forms.")
    plain = generate(embedded, None, ids, max_new_tokens=32)
    spec = generate(embedded, make_proposer("draft", embedded, draft), ids, gamma=4, max_new_tokens=32)
    assert spec.token_ids == plain.token_ids
    # a trained draft: an untrained one would have almost nothing accepted (≈ 1/49152 per token); the
    # shipped one measured α̂ ≈ 0.19–0.26 on held-out prompts (assets/smollm2-draft/README.md) and
    # 2 of 31 judged tokens on this prompt; a random draft would have 31 / 49152 ≈ 0.0006 expected.
    assert spec.stats.accepted / spec.stats.judged > 0.03
