"""Training the EAGLE-style draft head (engine.training.train_head) on a tiny random target, and the shipped head."""

from __future__ import annotations

import pytest
import torch

from engine.decoding.draft_head import FeatureHead, load_head, save_head
from engine.decoding.models import EMBEDDED_HEAD_DIR, load_model
from engine.decoding.drafts import make_proposer
from engine.decoding.speculative import encode_prompt, generate
from engine.training.draft_data import Sample, generate_samples
from engine.training.train_head import compute_features, draft_vocabulary, evaluate_head, make_items, train_head
from tests.tiny_models import save_tiny_llama


def _sample(prompt, response, k=2):
    top = torch.tensor([[t, 0] for t in response], dtype=torch.int32)[:, :k]
    return Sample(torch.tensor(prompt), torch.tensor(response), top,
                  torch.log(torch.tensor([[0.7, 0.1]] * len(response), dtype=torch.float16)), 0.0)


def test_items_score_each_pair_with_the_distribution_it_predicts():
    # x = [10, 11, 12 | 20, 21, 22] (prompt P = 3, answer R = 3). Pair i = (h_i, x_{i+1}) predicts the
    # target's distribution at position i + 1, which drew x_{i+2}: pair 1 → x_3 = 20 (answer 0), pair 2
    # → 21, pair 3 → 22; pairs 0 (predicts a prompt token) and 4 (past the answer) are unscored.
    s = _sample([10, 11, 12], [20, 21, 22])
    feats = torch.arange(6, dtype=torch.float16)[:, None].repeat(1, 4)  # h_i = i
    (tok, h, h_next, lab, lp), = make_items([s], [feats])
    assert tok.tolist() == [11, 12, 20, 21, 22]
    assert h[:, 0].tolist() == [0, 1, 2, 3, 4] and h_next[:, 0].tolist() == [1, 2, 3, 4, 5]
    assert lab[:, 0].tolist() == [-1, 20, 21, 22, -1]
    assert lp[1].tolist() == pytest.approx([torch.log(torch.tensor(0.7)).item(), torch.log(torch.tensor(0.1)).item()],
                                           abs=1e-3)


def test_draft_vocabulary_most_frequent_first_then_lowest_ids():
    # greedy choices: 7 ×3, 5 ×2, 9 ×1 → keep {7, 5} for size 2; size 4 adds the lowest unseen id 0
    s = [_sample([1], [7, 7, 5]), _sample([1], [7, 5, 9])]
    assert draft_vocabulary(s, 2, 12).tolist() == [5, 7]
    assert draft_vocabulary(s, 4, 12).tolist() == [0, 5, 7, 9]


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainhead")
    target = load_model(str(save_tiny_llama(root / "t", vocab_size=32, layers=2, seed=0, init=0.5)),
                        device="cpu")
    prompts = [{"prompt": " ".join(f"w{(i * 7 + j) % 30}" for j in range(6)), "category": "chat"}
               for i in range(12)]
    samples = generate_samples(target.model, target.tokenizer, prompts, {0}, max_new_tokens=16, batch_size=6,
                               top_k=8, progress=None)
    items = make_items(samples, compute_features(target.model, samples))
    vocab = draft_vocabulary(samples, 24, 32)
    head = FeatureHead(target.model.config, 1, vocab)
    head.init_from_target(target.model)
    head.bind(target.model)
    before = evaluate_head(head, items, 32)
    log = train_head(head, items, 32, minutes=5, max_steps=60, lr=5e-3, tokens=256, log_every=10, bf16=False)
    after = evaluate_head(head, items, 32)
    save_head(head, root / "head")
    return dict(target=target, log=log, before=before, after=after, dir=root / "head")


def test_training_lowers_the_loss_and_raises_agreement(tiny_head):
    losses = [r["loss"] for r in tiny_head["log"] if "loss" in r]
    assert len(losses) >= 5
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses
    assert tiny_head["after"]["first"] > tiny_head["before"]["first"] + 0.1, (tiny_head["before"], tiny_head["after"])


def test_trained_head_loads_as_a_draft_and_stays_exact(tiny_head):
    target = tiny_head["target"]
    ids = [5, 6, 7, 8, 9]
    ref = generate(target, None, ids, max_new_tokens=20, stop_on_eos=False)
    for gamma in (1, 3, 5):
        res = generate(target, make_proposer(str(tiny_head["dir"]), target), ids, gamma=gamma, max_new_tokens=20,
                       stop_on_eos=False)
        assert res.token_ids == ref.token_ids


@pytest.mark.slow
@pytest.mark.skipif(not (EMBEDDED_HEAD_DIR / "head_config.json").is_file(), reason="no shipped head")
def test_shipped_head_is_exact_and_accepts_on_the_embedded_target():
    target = load_model("embedded", device="cpu")
    head = load_head(EMBEDDED_HEAD_DIR, target.model)
    assert head.config["target"] == "embedded"
    ids = encode_prompt(target.tokenizer, "Write two sentences about rivers.")
    ref = generate(target, None, ids, max_new_tokens=40)
    res = generate(target, make_proposer("embedded-head", target), ids, gamma=3, max_new_tokens=40)
    assert res.token_ids == ref.token_ids
    # a trained head agrees with the target far more often than chance (measured α̂ is in the model card;
    # an untrained head accepts ~0 of 49k-way guesses)
    assert res.stats.acceptance_rate > 0.25, res.stats.acceptance_rate


@pytest.mark.parametrize("args, msg", [(["--layers", "0"], "--layers must be at least 1"),
                                       (["--draft-vocab", "0"], "--draft-vocab must be at least 1"),
                                       (["--init", "/no/such/head"], "not a folder holding a saved draft head")])
def test_bad_arguments_stop_before_any_work(args, msg, capsys):
    from engine.training.train_head import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and msg in capsys.readouterr().err
