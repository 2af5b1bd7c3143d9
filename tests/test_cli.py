"""The command line on a tiny model: JSON output, marked text, clear errors."""

import json
import re
import statistics

import pytest

from engine.__main__ import main
from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("cli") / "m", vocab_size=32, layers=2))


def test_generate_json(tiny_dir, capsys):
    rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", "ngram",
               "--gamma", "3", "--max-new-tokens", "12", "--json", "--baseline", "--no-chat"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"text", "token_ids", "rounds", "stats"}
    assert 1 <= len(out["token_ids"]) <= 12
    assert out["stats"]["identical_to_baseline"] is True  # greedy: same tokens as plain decoding
    for key in ("acceptance_rate", "tokens_per_target_pass", "tokens_per_s", "draft_cost_ratio",
                "baseline_tokens_per_s"):
        assert key in out["stats"]
    r0 = out["rounds"][0]
    assert {"drafted", "n_accepted", "next_kind", "draft_ms", "verify_ms"} <= set(r0)
    assert sum(len(r["emitted_ids"]) for r in out["rounds"]) == len(out["token_ids"])


def test_generate_text_marks_origins(tiny_dir, capsys):
    rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", "early-exit:2",
               "--gamma", "2", "--max-new-tokens", "6", "--no-chat", "--color", "never"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "acceptance rate α̂ = 1.000" in out  # early exit at all layers is the target itself
    assert "«" in out  # a bonus token is marked
    # α̂ = 1, two rounds of 2 draft tokens: Eq. 1 gives 1 + 1 + 1 = 3 per round, as measured (6 tokens)
    assert ("tokens per target pass = 3.00  (formula at α̂ and each round's draft length: 3.00; with γ = 2 "
            "drafted every round: 3.00; 2.00 drafted per round)") in out


@pytest.mark.parametrize("args,msg", [
    (["--prompt", "  "], "empty"),
    (["--prompt", "hi", "--gamma", "0"], "γ"),
    (["--prompt", "hi", "--top-p", "0"], "top-p"),
    (["--prompt", "hi", "--temperature", "-1"], "Temperature"),
    (["--prompt", "hi", "--draft", "early-exit:abc"], "early-exit"),
])
def test_bad_arguments_exit_2_with_message(tiny_dir, capsys, args, msg):
    draft = [] if "--draft" in args else ["--draft", "ngram"]
    rc = main(["generate", "--target", tiny_dir, "--no-chat", *draft, *args])
    assert rc == 2
    assert msg in capsys.readouterr().err


def test_unknown_target_offline(capsys):
    assert main(["generate", "--prompt", "hi", "--target", "no-such-org/no-such-model"]) == 2
    assert "Could not load" in capsys.readouterr().err


def test_malformed_model_id_is_named_as_such(capsys):
    # a user's report: "not a valid id!!" was said to be missing offline, not malformed
    assert main(["generate", "--prompt", "hi", "--target", "not a valid id!!"]) == 2
    err = capsys.readouterr().err
    assert "is neither a local folder nor a valid Hugging Face id" in err and "offline" not in err


def test_default_draft_for_another_target_is_prompt_lookup(tiny_dir, capsys):
    """The shipped head belongs to the embedded target; other targets default to prompt lookup."""
    rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--max-new-tokens", "6",
               "--no-chat", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["token_ids"]


def test_generate_with_a_head_folder(tiny_dir, tmp_path, capsys):
    import torch

    from engine.decoding.draft_head import FeatureHead, save_head
    from engine.decoding.models import load_model

    target = load_model(tiny_dir, device="cpu")
    head = FeatureHead(target.model.config, 1, torch.arange(32))
    head.init_from_target(target.model)
    save_head(head, tmp_path / "head")
    rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", str(tmp_path / "head"),
               "--gamma", "2", "--max-new-tokens", "8", "--no-chat", "--json", "--baseline"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["identical_to_baseline"] is True
    # the head's confidence threshold: 0.999 stops every draft (plain steps), output unchanged
    rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", str(tmp_path / "head"),
               "--gamma", "2", "--max-new-tokens", "8", "--no-chat", "--json", "--baseline",
               "--draft-confidence", "0.999"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["stats"]["drafted"] == 0 and out["stats"]["identical_to_baseline"] is True


def test_draft_confidence_is_checked(tiny_dir, capsys):
    rc = main(["generate", "--prompt", "w1 w2", "--target", tiny_dir, "--draft", "ngram", "--no-chat",
               "--draft-confidence", "0.3"])
    assert rc != 0 and "a draft head or a block drafter only" in capsys.readouterr().err
    rc = main(["generate", "--prompt", "w1 w2", "--target", tiny_dir, "--draft-confidence", "1.5"])
    assert rc != 0 and "[0, 1)" in capsys.readouterr().err


def test_plain_target_steps_are_marked_without_colour(tiny_dir, capsys):
    """Without colour, plain target steps (no draft that round) are wrapped ‹…›, one pair per run, so they
    never read as accepted draft tokens; with no draft, γ is not shown."""
    from engine.cli import marked_text

    class Tok:
        def decode(self, ids, **kw):
            return f"t{ids[0]} "

    origins = [(1, "plain"), (2, "plain"), (3, "accepted"), (4, "correction"), (5, "plain"), (6, "bonus")]
    assert marked_text(Tok(), origins, color=False) == "‹t1 t2 ›t3 ⟨t4 ⟩‹t5 ›«t6 »"
    assert marked_text(Tok(), origins[:2], color=True) == "t1 t2 "  # uncoloured in colour mode
    rc = main(["generate", "--prompt", "w1 w2 w3", "--target", tiny_dir, "--draft", "none",
               "--max-new-tokens", "5", "--no-chat", "--color", "never"])
    assert rc == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("‹") and first.endswith("›") and first.count("‹") == 1
    assert "‹target steps without a draft›" in out and "γ =" not in out


def test_help_names_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "engine.decoding.models" not in out
    assert "default: embedded-head for the embedded target" in out
    assert "for embedded-head the best γ on this machine's measured pass cost (else 2)" in out


def test_unknown_draft_lists_the_valid_drafts(tiny_dir, capsys):
    assert main(["generate", "--prompt", "hi", "--target", tiny_dir, "--draft", "bogus", "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert "Could not load 'bogus'" in err and "ngram, early-exit:K" in err


def test_no_subcommand_names_the_commands(capsys):
    with pytest.raises(SystemExit):
        main([])
    assert "{prepare,generate,traffic,batch-sweep,draft-card,serve-llamacpp}" in capsys.readouterr().err


def test_baseline_speedup_is_per_token_when_lengths_differ(tiny_dir, capsys):
    """Under sampling the two runs may stop at EOS after different numbers of tokens: the speedup is the
    ratio of tokens/s (time per token), not of total times; the settings are recorded."""
    for seed in range(40):
        rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", "ngram",
                   "--gamma", "3", "--max-new-tokens", "12", "--json", "--baseline", "--no-chat",
                   "--temperature", "1.5", "--seed", str(seed)])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        st = out["stats"]
        if st["baseline_new_tokens"] != len(out["token_ids"]):
            break
    else:
        pytest.fail("no seed gave runs of different lengths")
    # the speedup: median baseline ms per token ÷ median speculative ms per token over 3 alternating runs
    t = st["speedup_timing"]
    assert t["order"] == ["spec", "base", "base", "spec", "spec", "base"]
    assert st["speedup"] == pytest.approx(statistics.median(t["base_ms_per_token"])
                                          / statistics.median(t["spec_ms_per_token"]), rel=1e-9)
    assert st["baseline_tokens_per_s"] == pytest.approx(1000 / statistics.median(t["base_ms_per_token"]))
    compute = out["settings"].pop("compute")  # the compute path the run used (engine/decoding/compute/)
    assert compute["path"] in ("default", "onednn", "stream") and compute["reason"] and compute["cpu"]
    inv = out["settings"].pop("batch_invariance")  # the room's self-check on this machine (engine/decoding/invariance.py)
    assert inv["label"] and inv["readers"] > 0 and inv["holds"] == (inv["by_construction"] and not inv["mismatched"])
    assert inv["holds"] == (compute["path"] == "stream")  # the tiny Llama takes the lean layers: invariant on "stream"
    assert out["settings"] == {"target": tiny_dir, "draft": "ngram", "gamma": 3, "temperature": 1.5, "top_k": 0,
                               "top_p": 1.0, "sampling_rule": "standard", "seed": seed, "max_new_tokens": 12,
                               "chat": False, "draft_confidence": None, "length": "fixed"}


def test_baseline_difference_is_explained_by_mode(tiny_dir, capsys, monkeypatch):
    """A greedy run that differs from its baseline is blamed on arithmetic (bf16 passes over several
    tokens), never on "sampling"; a sampled run that differs is blamed on the random draws."""
    import dataclasses

    import engine.decoding.measure as live_view

    real = live_view.compare_baseline
    monkeypatch.setattr(live_view, "compare_baseline", lambda *a: dataclasses.replace(
        real(*a), identical=False, first_difference=3))
    base = ["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", "ngram", "--gamma", "2",
            "--max-new-tokens", "8", "--baseline", "--no-chat", "--color", "never"]
    assert main(base) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "different from token 3 on (greedy, so arithmetic" in line and "sampling" not in line
    assert main(base + ["--temperature", "1.0"]) == 0
    assert "different (sampling" in capsys.readouterr().out.splitlines()[-1]


def test_baseline_line_names_each_rate_and_flags_noise(tiny_dir, capsys, monkeypatch):
    """A user's report: "baseline: 6.6 tokens/s against 2.9; speedup 0.43×" did not say which rate was
    which, and gave a speedup for a run that drafted nothing, with runs 8× apart."""
    import dataclasses

    import engine.decoding.measure as live_view

    base = ["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--gamma", "2",
            "--max-new-tokens", "8", "--baseline", "--no-chat", "--color", "never"]
    assert main(base + ["--draft", "ngram"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"speculative [\d.]+ tokens/s, plain decoding \(baseline\) [\d.]+ tokens/s: speedup", out)
    real = live_view.measure_speedup_ab

    def patched(**changes):
        def fake(*a, **k):
            ab = real(*a, **k)
            return dataclasses.replace(ab, **{key: f(ab) for key, f in changes.items()})
        return fake

    # runs of one kind 8× apart: the machine was busy
    monkeypatch.setattr(live_view, "measure_speedup_ab", patched(
        spec_ms_per_token=lambda ab: [100.0, 800.0, 110.0],
        spec_stats=lambda ab: dataclasses.replace(ab.spec_stats, drafted=3)))
    assert main(base + ["--draft", "ngram"]) == 0
    assert "differed by up to 8.0× (the machine was busy)" in capsys.readouterr().out
    # a draft that proposed nothing: both runs were plain decoding
    monkeypatch.setattr(live_view, "measure_speedup_ab", patched(
        spec_stats=lambda ab: dataclasses.replace(ab.spec_stats, drafted=0)))
    assert main(base + ["--draft", "ngram"]) == 0
    assert "the draft proposed nothing, so both runs decoded plainly" in capsys.readouterr().out


def test_generate_tree_json(tiny_dir, capsys):
    """--tree: each round carries its tree (node token ids, parent indices, accepted path), stats keep their
    names, and greedy output is plain decoding's."""
    rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2 w4 w1 w2 w3", "--target", tiny_dir, "--draft", "ngram",
               "--tree", "6", "--tree-branching", "2", "--max-new-tokens", "12", "--json", "--baseline",
               "--no-chat"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["identical_to_baseline"] is True
    assert {"acceptance_rate", "tokens_per_target_pass", "tokens_per_s"} <= set(out["stats"])
    assert out["settings"]["tree"] == 6 and out["settings"]["tree_branching"] == 2
    trees = [r["tree"] for r in out["rounds"] if r["tree"] is not None]
    assert trees, "prompt lookup found no match: the check would be vacuous"
    for t in trees:
        assert len(t["token_ids"]) == len(t["parents"]) <= 6
        assert all(-1 <= par < i for i, par in enumerate(t["parents"]))
        assert set(t["accepted_path"]) <= set(range(len(t["token_ids"])))


@pytest.mark.parametrize("args,msg", [
    (["--tree", "-1"], "--tree must be"),
    (["--tree", "100000"], "--tree must be"),
    (["--tree", "4", "--tree-branching", "0"], "--tree-branching must be"),
    (["--tree", "4", "--tree-branching", "99"], "--tree-branching must be"),
    (["--tree-branching", "2"], "add --tree"),
    (["--accept", "typical"], "lossy"),
    (["--tree", "4", "--draft", "early-exit:1"], "cannot make token trees"),
    (["--tree", "4", "--draft", "none"], "needs a draft"),
])
def test_bad_tree_arguments_exit_2_with_message(tiny_dir, capsys, args, msg):
    draft = [] if "--draft" in args else ["--draft", "ngram"]
    rc = main(["generate", "--prompt", "w1 w2", "--target", tiny_dir, "--no-chat", *draft, *args])
    assert rc == 2
    assert msg in capsys.readouterr().err


def test_generate_tree_text_names_the_rule(tiny_dir, capsys):
    rc = main(["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", "ngram", "--tree", "4",
               "--temperature", "1", "--accept", "typical", "--max-new-tokens", "8", "--no-chat", "--color", "never"])
    assert rc == 0
    assert "LOSSY" in capsys.readouterr().out


def test_generate_with_medusa_heads_tree_by_default_chain_with_tree_0(tiny_dir, tmp_path, capsys):
    import torch

    from engine.decoding.medusa import MedusaHeads, save_medusa

    heads = MedusaHeads(32, 3, torch.arange(2, 30))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    save_medusa(heads, tmp_path / "m", meta={"medusa_choices": [[0], [1], [0, 0], [0, 0, 0]]})
    base = ["generate", "--prompt", "w1 w2 w3 w1 w2", "--target", tiny_dir, "--draft", str(tmp_path / "m"),
            "--max-new-tokens", "10", "--no-chat", "--json"]
    assert main(base + ["--baseline"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["tree"] == 4 and out["settings"]["gamma"] == 3  # the saved tree, γ = K heads
    assert out["stats"]["identical_to_baseline"] is True and out["rounds"][0]["tree"] is not None
    assert main(base + ["--tree", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "tree" not in out["settings"] and out["rounds"][0]["tree"] is None  # a chain: settings as before
    assert main(base + ["--temperature", "0.8", "--accept", "typical"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["accept"] == "typical (lossy)"
    assert main(base + ["--tree", "0", "--temperature", "0.8", "--accept", "typical"]) == 2
    assert "lossy" in capsys.readouterr().err.lower()
