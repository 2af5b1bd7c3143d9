"""AppTest for the Live page's token trees: the tree settings in the URL, a real tree round verified by the
engine on a tiny random Llama (a test draft that branches: prompt lookup's chain plus a sibling at each
depth), the tree drawn in the round box and the inspector, the animation's frames, and drafts that cannot
branch (a clear error, no traceback). Chain drafts keep their view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

import engine.decoding.drafts as drafts
from engine.decoding.proposers import PromptLookupProposer
from engine.decoding.tree import TokenTree
from tests.tiny_models import WORDS, save_tiny_llama

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "live.py")
PROMPT = " ".join(WORDS[:10] * 3)


class ForkedLookup(PromptLookupProposer):
    """Prompt lookup's chain of up to ``max_depth`` tokens, plus at each depth a sibling (the chain token's
    id + 1), up to ``n_nodes`` nodes; deterministic picks (one-hot q)."""

    branching = 2

    def set_branching(self, k: int) -> None:
        self.branching = k

    def propose_tree(self, seq, n_nodes, max_depth, cfg, generator) -> TokenTree:
        chain = self.lookup(seq, max_depth) or [seq[-1]]
        tokens, parents = [], []
        prev = -1
        for t in chain:
            for j, tok in enumerate([t, (t + 1) % self.target_vocab][:self.branching]):
                if len(tokens) < n_nodes:
                    tokens.append(tok)
                    parents.append(prev)
            prev = len(tokens) - (2 if self.branching > 1 and len(tokens) >= 2 else 1)
            if len(tokens) >= n_nodes:
                break
        q = torch.zeros(len(tokens), self.target_vocab)
        q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return TokenTree(tokens, parents, q, "deterministic")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("live_tree") / "tiny", layers=2))


@pytest.fixture
def forked(monkeypatch):
    real = drafts.make_proposer

    def make(kind, target, draft=None):
        if kind == "ngram":
            return ForkedLookup(target.model.config.vocab_size)
        return real(kind, target, draft)

    monkeypatch.setattr(drafts, "make_proposer", make)


def _app(target: str, **params) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.query_params.update({"lv_target": target, "lv_draft": "ngram", "lv_max_new": "12",
                            **{k: str(v) for k, v in params.items()}})
    at.session_state["lv_prompt"] = PROMPT
    at.run()
    assert not at.exception, at.exception
    return at


def _specs(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_tree_settings_travel_in_the_url(tiny, forked):
    at = _app(tiny)
    assert at.slider(key="lv_tree").value == 0
    assert not [s for s in at.slider if s.key == "lv_branch"]  # a chain: no branching slider
    at = _app(tiny, lv_tree=6, lv_branch=2, lv_gamma=3)
    dec = at.session_state["lv_dec"]
    assert dec.tree == 6 and dec.proposer.branching == 2
    assert at.query_params["lv_tree"] == "6" and at.query_params["lv_branch"] == "2"
    at.slider(key="lv_branch").set_value(1).run()
    assert at.session_state["lv_dec"].proposer.branching == 1 and at.query_params["lv_branch"] == "1"
    # out of range in a link: clamped, and named
    at = _app(tiny, lv_tree=999, lv_branch=0)
    assert at.slider(key="lv_tree").value == 64 and at.slider(key="lv_branch").value == 1
    assert "lv_tree=999 → 64" in " ".join(t.value for t in at.toast)


def test_a_tree_round_is_drawn(tiny, forked):
    at = _app(tiny, lv_tree=6, lv_branch=2, lv_gamma=3, lv_speed="instant")
    at.button(key="lv_step").click().run()
    assert not at.exception, at.exception
    dec = at.session_state["lv_dec"]
    rnd = dec.rounds[0]
    assert rnd.tree is not None and len(rnd.tree.nodes) == 6
    specs = _specs(at)
    trees = [f for f in specs if f["layout"]["title"]["text"] == "Round 1: token tree of 6 nodes"]
    assert len(trees) == 2  # the round box and the inspector
    names = {t.get("name") for t in trees[0]["data"]} - {None}
    verdicts = {n.verdict for n in rnd.tree.nodes}
    assert {"accepted": "accepted", "rejected": "rejected", "unvisited": "never judged"}.keys() >= verdicts
    assert {"rejected" if v == "rejected" else "never judged" if v == "unvisited" else v for v in verdicts} <= names
    assert ("target's correction" in names) == (rnd.next_kind == "correction")
    mask = next(f for f in specs if f["layout"]["title"]["text"].startswith("Tree attention mask"))
    assert len(mask["data"][0]["z"]) == 6 and len(mask["data"][0]["z"][0]) == 7  # the context + 6 nodes
    md = "\n".join(m.value for m in at.markdown)
    assert "**Token tree:** 6 nodes, depth 3" in md and "judged by greedy (argmax match)" in md
    assert "**Verify:**" in md and "Kept: the accepted path of" in md
    df = next(d.value for d in [*at.table, *at.dataframe] if "depth" in d.value.columns)  # the node table
    assert len(df) == 6 and (df["token"].map(len) > 0).all()
    assert list(df["verdict"].str.split().str[0]) == [n.verdict for n in rnd.tree.nodes]
    assert any("Token tree run" in c.value for c in at.caption)
    # the statistics still read the path (α̂ over the path and its first rejected node)
    assert dec.stats().judged == len(rnd.drafted)


def test_tree_round_animates_frame_by_frame(tiny, forked, monkeypatch):
    """Stepping at presenter speed runs every frame (depth 1..3, the verify pass, the verdict), each a chart of
    its own key in one placeholder, without an error; the box ends on the verdict."""
    import time as _time

    monkeypatch.setattr(_time, "sleep", lambda s: None)
    at = _app(tiny, lv_tree=6, lv_branch=2, lv_gamma=3, lv_speed="presenter")
    at.button(key="lv_step").click().run()
    assert not at.exception, at.exception
    # the round box's placeholder ends on the verdict; every frame was a separately keyed chart (no
    # duplicate-element error), and the inspector draws the verdict again
    trees = [f for f in _specs(at) if f["layout"]["title"]["text"].startswith("Round 1: token tree")]
    assert len(trees) == 2
    assert "Kept: the accepted path" in "\n".join(m.value for m in at.markdown)


def test_run_to_the_end_with_a_tree_matches_plain_greedy(tiny, forked):
    at = _app(tiny, lv_tree=5, lv_branch=2, lv_gamma=3, lv_speed="instant")
    at.button(key="lv_baseline").click().run()
    assert not at.exception, at.exception
    assert any(m.label == "Greedy outputs identical?" and m.value == "yes" for m in at.metric)
    assert all(r.tree is not None or not r.drafted for r in at.session_state["lv_dec"].rounds)


def test_a_draft_that_cannot_branch_is_a_clear_error(tiny):
    at = _app(tiny, lv_draft="early-exit", lv_tree=4)
    assert at.error and "cannot make token trees" in at.error[0].value
    assert not at.exception
    # back to a chain: the error goes
    at.slider(key="lv_tree").set_value(0).run()
    assert not at.error and not at.exception


def test_chain_rounds_keep_their_view(tiny):
    at = _app(tiny, lv_speed="instant")
    at.button(key="lv_step").click().run()
    assert at.session_state["lv_dec"].rounds[0].tree is None
    assert not [f for f in _specs(at) if "token tree" in f["layout"]["title"]["text"]]
    assert not any("Token tree" in m.value for m in at.markdown)


def test_a_sampled_tree_round_shows_the_test_and_uniforms(tiny, forked):
    at = _app(tiny, lv_tree=6, lv_branch=2, lv_gamma=3, lv_temp=1.0, lv_seed=3, lv_speed="instant")
    at.button(key="lv_step").click().run()
    assert not at.exception, at.exception
    rnd = at.session_state["lv_dec"].rounds[0]
    assert rnd.tree is not None and rnd.tree.rule == "exact"
    df = next(d.value for d in [*at.table, *at.dataframe] if "depth" in d.value.columns)
    assert "min(1, p/q)" in df.columns and "u" in df.columns and "argmax of p?" not in df.columns
    judged = [n for n in rnd.tree.nodes if n.verdict != "unvisited"]
    assert judged and all(n.u is not None for n in judged)
    assert "judged by lossless tree sampling" in "\n".join(m.value for m in at.markdown)


def test_typical_acceptance_is_offered_under_sampling_and_labelled_lossy(tiny, forked):
    at = _app(tiny, lv_tree=6, lv_gamma=3)  # greedy: no rule to choose
    assert not [r for r in at.radio if r.key == "lv_accept"]
    at = _app(tiny, lv_tree=6, lv_gamma=3, lv_temp=1.0, lv_accept="typical")
    assert at.radio(key="lv_accept").value == "typical" and at.session_state["lv_dec"].accept == "typical"
    assert any("lossy" in w.value for w in at.warning)
    at.button(key="lv_step").click().run()
    assert not at.exception
    assert at.session_state["lv_dec"].rounds[0].tree.rule == "typical (lossy)"
    assert "judged by typical acceptance (lossy)" in "\n".join(m.value for m in at.markdown)
    at.radio(key="lv_accept").set_value("exact").run()
    assert at.session_state["lv_dec"].accept == "exact" and not any("lossy" in w.value for w in at.warning)
    assert at.query_params["lv_accept"] == "exact"
