"""The draft card (engine.training.draft_card, python -m engine draft-card): statistics against hand-computed
values, the teacher-forced contexts, a whole card on a tiny target, the command line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine.__main__ import main
from engine.decoding import compute
from engine.decoding.models import load_model
from engine.decoding.proposers import Proposal, Proposer
from engine.errors import InputError
from engine.training.draft_card import (DRAFTS, acceptance_by_position, card_markdown, draft_card, heldout_prompts,
                                        median_ratio, read_prompts, resolve_draft, round_summary, teacher_forced,
                                        teacher_forced_counts)
from engine.training.draft_data import build_prompts
from tests.tiny_models import save_tiny_llama


def test_teacher_forced_counts_by_hand():
    proposals = [[5, 6, 7], [5, 9], [1, 6, 7]]
    answers = [[5, 6, 8], [5, 6, 7], [2]]
    rows = teacher_forced_counts(proposals, answers, 3)
    # position 1: 5=5, 5=5, 1≠2 → 2 of 3; position 2: 6=6, 9≠6 (third has no answer) → 1 of 2;
    # position 3: 7≠8, missing ≠ 7 → 0 of 2
    assert rows == [{"position": 1, "agree": 2, "total": 3, "rate": 0.6667},
                    {"position": 2, "agree": 1, "total": 2, "rate": 0.5},
                    {"position": 3, "agree": 0, "total": 2, "rate": 0.0}]


def _round(n_drafted, n_accepted, tree_depth=None):
    tree = None if tree_depth is None else SimpleNamespace(nodes=[SimpleNamespace(depth=d)
                                                                 for d in range(1, tree_depth + 1)])
    return SimpleNamespace(drafted=[None] * n_drafted, n_drafted=n_drafted, n_accepted=n_accepted, tree=tree)


def test_acceptance_by_position_by_hand():
    # chains: (3 drafted, 2 accepted), (3, 0), (2, 2), (0, 0: nothing drafted); a tree of depth 3 with 1 accepted
    rounds = [_round(3, 2), _round(3, 0), _round(2, 2), _round(0, 0), _round(2, 1, tree_depth=3)]
    rows = acceptance_by_position(rounds, 3)
    # position 1: judged in rounds 1, 2, 3, 5 (depth ≥ 1); accepted in 1, 3, 5 → 3/4
    # position 2: judged where depth ≥ 2 and n_accepted ≥ 1: rounds 1, 3, 5; accepted (≥ 2) 1, 3 → 2/3
    # position 3: depth ≥ 3 and n_accepted ≥ 2: round 1 (round 3 has depth 2) → 0/1
    assert [(r["accepted"], r["judged"]) for r in rows] == [(3, 4), (2, 3), (0, 1)]
    assert [r["rate"] for r in rows] == [0.75, 0.6667, 0.0]
    s = round_summary(rounds, 3)
    assert s["rounds"] == 5 and s["accepted"] == 5 and s["accepted_per_round"] == 1.0
    assert s["judged"] == 8 and s["alpha"] == 0.625  # 5 accepted of 8 judged
    assert round_summary([], 2)["alpha"] is None


def test_median_ratio_by_hand():
    # per-prompt ratios 100/50 = 2, 90/100 = 0.9, 60/40 = 1.5 → median 1.5
    assert median_ratio([100, 90, 60], [50, 100, 40]) == 1.5
    assert median_ratio([], []) is None


class _Stub(Proposer):
    """Proposes seq[-1] + 1, + 2, … (a known draft for counting by hand)."""

    def propose(self, seq, k, cfg, generator):
        return Proposal([seq[-1] + i for i in range(1, k + 1)], torch.zeros(k, 40))


def test_teacher_forced_contexts_are_the_rounds_after_the_first(tiny):
    prompt, answer = [3, 4], [5, 6, 8, 9]
    props, ans = teacher_forced(tiny, _Stub(), prompt, answer, 2)
    # contexts prompt + answer[:j], j = 1..3: last tokens 5, 6, 8 → drafts [6, 7], [7, 8], [9, 10]
    assert props == [[6, 7], [7, 8], [9, 10]]
    assert ans == [[6, 8], [8, 9], [9]]
    assert teacher_forced_counts(props, ans, 2) == [{"position": 1, "agree": 2, "total": 3, "rate": 0.6667},
                                                    {"position": 2, "agree": 0, "total": 2, "rate": 0.0}]


def test_teacher_forced_feature_drafts_read_all_but_the_newest_position(tiny, tmp_path):
    """Medusa heads under teacher forcing read h_{L-2} for context length L (a later round's state)."""
    from engine.decoding.medusa import MedusaProposer, save_medusa
    from tests.test_medusa import random_heads, reference_logits

    heads = random_heads(32, 2, torch.arange(2, 22), seed=1)
    save_medusa(heads, tmp_path / "m", meta={"target": "tiny", "medusa_choices": []})
    from engine.decoding.drafts import make_proposer

    prop = make_proposer(str(tmp_path / "m"), tiny)
    assert isinstance(prop, MedusaProposer)
    prompt, answer = [5, 6, 7], [8, 9, 10, 11]
    props, _ = teacher_forced(tiny, prop, prompt, answer, 2)
    for j, got in enumerate(props, start=1):
        ref = reference_logits(prop.heads, tiny, prompt + answer[:j])
        assert got == [int(prop.vocab_ids[int(ref[d].argmax())]) for d in range(2)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("card") / "t", vocab_size=32, layers=3, seed=0))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def test_card_on_a_tiny_target(tiny):
    card = draft_card(tiny, "early-exit:1", prompts=["w1 w2 w3 w1 w2", "w4 w5"], max_new_tokens=6, chat=False)
    e = card["engine"]
    assert card["prompts"]["count"] == 2 and card["settings"]["gamma"] == 4 and card["settings"]["tree"] == 0
    assert e["identical_to_plain"] is True
    assert e["round0"]["rounds"] == 2  # one first round per prompt
    assert e["tokens_per_pass"] == round(e["new_tokens"] / e["target_passes"], 4)
    assert card["teacher_forced"]["contexts"] == 2 * 5  # j = 1..5 on each 6-token answer
    assert len(card["speed"]["per_prompt"]) == 2 and card["speed"]["per_prompt"][1]["order"] == "draft/plain"
    assert card["machine"]["cpu"] and card["machine"]["compute_path"]["path"] in compute.PATHS
    md = card_markdown(card, "python -m engine draft-card early-exit:1")
    assert "| teacher-forced top-1 agreement" in md and "python -m engine draft-card early-exit:1" in md


def test_default_prompts_are_the_cards_heldout_set():
    kind, spec = resolve_draft("embedded-medusa")
    assert spec == "embedded-medusa" and kind.heldout_prompts == 48
    assert heldout_prompts(kind, 3) == [p["prompt"] for p in build_prompts(48, "heldout", seed=0)][:3]
    assert resolve_draft("early-exit:3")[1] == "early-exit:3"
    for bad in ("nope", "early-exit", "early-exit:0", "embedded-head:2", ""):
        with pytest.raises(InputError):
            resolve_draft(bad)
    assert {"embedded-head", "embedded-medusa", "embedded-draft", "early-exit"} <= set(DRAFTS)


def test_read_prompts(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("one\n\n  two  \n")
    assert read_prompts(str(f)) == ["one", "two"]
    f.write_text("\n \n")
    with pytest.raises(InputError, match="holds no prompts"):
        read_prompts(str(f))
    with pytest.raises(InputError, match="Cannot read"):
        read_prompts(str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("args,msg", [
    (["bogus"], "Unknown draft 'bogus'"),
    (["early-exit:x"], "early-exit:K"),
    (["embedded-head", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["embedded-head", "--max-new-tokens", "-3"], "--max-new-tokens must be at least 1"),
    (["embedded-head", "--max-prompts", "0"], "--max-prompts must be at least 1"),
    (["embedded-head", "--prompts", "EMPTY"], "holds no prompts"),
    (["embedded-head", "--prompts", "MISSING"], "Cannot read the prompt file"),
    (["embedded-head", "--compute", "gpu-magic"], "gpu-magic"),
    (["embedded-head", "--gamma", "0"], "--gamma must be from 1 to 64"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, msg, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY" else str(tmp_path / "none.txt") if a == "MISSING" else a for a in args]
    assert main(["draft-card", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0]


def test_cli_writes_json_and_markdown(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3\n")
    out = tmp_path / "res" / "card"
    rc = main(["draft-card", "early-exit:1", "--target", tiny_dir, "--prompts", str(prompts), "--max-new-tokens", "4",
               "--no-chat", "--json", "--out", str(out)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "res" / "card.json").read_text())
    assert printed == saved and saved["draft"] == "early-exit:1" and saved["prompts"]["texts"] == ["w1 w2 w3"]
    assert "draft-card" in saved["command"]
    assert (tmp_path / "res" / "card.md").read_text().startswith("### Draft card")
