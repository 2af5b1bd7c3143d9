"""The command line's batches: several --prompt / --prompts-file decoded as one batch, and batch-sweep."""

import json

import pytest

from engine.__main__ import main
from tests.tiny_models import save_tiny_llama

PROMPTS = ["w1 w2 w3 w1 w2", "w4 w5", "w6 w7 w8 w6 w7 w8 w6"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("clib") / "m", vocab_size=32, layers=2, seed=4))


def _gen(tiny_dir, capsys, *extra):
    rc = main(["generate", "--target", tiny_dir, "--no-chat", "--draft", "ngram", "--gamma", "3",
               "--max-new-tokens", "10", *extra])
    return rc, capsys.readouterr()


def test_several_prompts_are_one_batch_in_json(tiny_dir, capsys):
    args = [x for p in PROMPTS for x in ("--prompt", p)]
    rc, out = _gen(tiny_dir, capsys, *args, "--json")
    assert rc == 0
    data = json.loads(out.out)
    assert set(data) == {"results", "batch"} and len(data["results"]) == 3
    for p, r in zip(PROMPTS, data["results"]):
        assert set(r) >= {"text", "token_ids", "rounds", "stats"}
        rc, single = _gen(tiny_dir, capsys, "--prompt", p, "--json")
        assert json.loads(single.out)["token_ids"] == r["token_ids"]  # greedy: the prompt alone gives the same
    b = data["batch"]
    assert b["batch"] == 3 and b["tokens_per_s"] > 0
    assert b["new_tokens"] == sum(len(r["token_ids"]) for r in data["results"])
    # one target pass per round for the whole batch, the prefill included
    rounds_with_pass = {x["index"] for r in data["results"] for x in r["rounds"] if x["tokens_verified"] > 0}
    assert b["target_passes"] == 1 + len(rounds_with_pass)
    assert b["settings"]["seeds"] == [0, 1, 2]
    assert b["settings"]["batch_invariance"]["label"]  # the room's self-check on this machine


def test_prompts_file_and_text_output(tiny_dir, capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("\n".join(PROMPTS[:2]) + "\n\n")
    rc, out = _gen(tiny_dir, capsys, "--prompts-file", str(f), "--color", "never")
    assert rc == 0
    assert "=== prompt 1 of 2: w1 w2 w3 w1 w2" in out.out and "=== prompt 2 of 2: w4 w5" in out.out
    assert "batch of 2:" in out.out and "target passes" in out.out


def test_one_prompt_keeps_todays_output(tiny_dir, capsys):
    rc, out = _gen(tiny_dir, capsys, "--prompt", PROMPTS[0], "--json")
    assert rc == 0
    assert set(json.loads(out.out)) == {"text", "token_ids", "rounds", "stats", "draft", "settings"}


@pytest.mark.parametrize("args,msg", [
    ([], "Give a prompt"),
    (["--prompt", "w1", "--prompt", "w2", "--baseline"], "batch-sweep"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "Cannot read --prompts-file"),
    (["--prompt", "w1", "--prompt", "  "], "empty"),
])
def test_bad_batch_arguments(tiny_dir, capsys, args, msg):
    rc, out = _gen(tiny_dir, capsys, *args)
    assert rc == 2 and msg in out.err


def test_batch_sweep_table_and_json(tiny_dir, capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("\n".join(PROMPTS) + "\n")
    base = ["batch-sweep", "--target", tiny_dir, "--no-chat", "--methods", "plain,ngram", "--max-new-tokens", "4",
            "--prompts-file", str(f)]
    assert main([*base, "--batches", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "| batch | plain tok/s |" in out and "ngram ×plain" in out and "target pass time by tokens" in out
    assert main([*base, "--batches", "1,2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batches"] == [1, 2] and {c["method"] for c in data["cells"]} == {"plain", "ngram"}
    assert set(data["crossover"]) == {"ngram"}
    assert main([*base, "--batches", "0"]) == 2
    assert "at least one sequence" in capsys.readouterr().err
    assert main([*base, "--batches", "4"]) == 2
    assert "needs 4 different prompts" in capsys.readouterr().err


def test_no_draft_above_decodes_a_large_batch_plainly(tiny_dir, capsys, monkeypatch):
    args = [x for p in PROMPTS for x in ("--prompt", p)]
    rc, spec = _gen(tiny_dir, capsys, *args, "--json")
    rc2, off = _gen(tiny_dir, capsys, *args, "--json", "--no-draft-above", "2")
    assert rc == rc2 == 0
    a, b = json.loads(spec.out), json.loads(off.out)
    assert "3 prompts > --no-draft-above 2" in off.err
    assert b["batch"]["settings"]["drafting_off_by_limit"] and b["batch"]["settings"]["no_draft_above"] == 2
    assert all(not x["drafted"] for r in b["results"] for x in r["rounds"])
    assert [r["token_ids"] for r in a["results"]] == [r["token_ids"] for r in b["results"]]  # greedy: same text
    monkeypatch.setenv("SPEEDUP_LAB_NO_DRAFT_ABOVE", "3")  # the environment's limit; 3 prompts are not above it
    rc, env = _gen(tiny_dir, capsys, *args, "--json")
    assert not json.loads(env.out)["batch"]["settings"]["drafting_off_by_limit"]
    rc, bad = _gen(tiny_dir, capsys, *args, "--no-draft-above", "lots")
    assert rc != 0 and "must be a whole number" in bad.err
