"""engine.explain.tree_view: the tree drawing's layout, frames and mask, on hand-built trees
(tests/tree_fixtures.py) with hand-computed positions."""

from __future__ import annotations

import pytest

from engine.decoding.trace import TreeTrace
from engine.errors import InputError
from engine.explain.tree_view import (
    CONTEXT,
    attention_matrix,
    round_tree_layout,
    tree_counts,
    tree_frames,
    tree_layout,
)
from tests.tree_fixtures import chain_tree, greedy_tree, node, tree_round


def test_layout_of_the_greedy_tree_by_hand():
    lay = tree_layout(greedy_tree(), "correction")
    # depth-first lanes: 5 → 0, the correction (last child of node 2) → 1, 3 → 2, 4 → 3;
    # node 2 = (0 + 1)/2, node 0 = (0.5 + 2)/2, node 1 = 3, the context = (1.25 + 3)/2
    assert lay.x == [1, 1, 2, 2, 2, 3, 3]
    assert lay.y == [1.25, 3.0, 0.5, 2.0, 3.0, 0.0, 1.0]
    assert lay.context_y == 2.125
    assert lay.parents == [CONTEXT, CONTEXT, 0, 0, 1, 2, 2]
    assert lay.on_path == [True, False, True, False, False, False, True]
    assert (lay.n_nodes, lay.target_index, lay.n_lanes, lay.depth) == (6, 6, 4, 3)
    assert lay.edges()[6] == (2, 6)


def test_layout_is_stable_and_lanes_never_collide():
    a, b = tree_layout(greedy_tree(), "correction"), tree_layout(greedy_tree(), "correction")
    assert a == b
    spots = list(zip(a.x, a.y))
    assert len(set(spots)) == len(spots)  # no two drawn nodes on one spot
    # without the target's token the tree's own lanes close up: 5 → 0, 3 → 1, 4 → 2
    c = tree_layout(greedy_tree())
    assert c.y == [0.5, 2.0, 0.0, 1.0, 2.0, 0.0] and c.target_index is None and len(c.x) == 6


def test_chain_layout_is_one_lane_with_a_bonus():
    lay = round_tree_layout(tree_round(chain_tree(), "bonus"))
    assert lay.x == [1, 2, 3, 4] and lay.y == [0.0] * 4 and lay.target_kind == "bonus"
    assert lay.on_path == [True] * 4


def test_empty_path_hangs_the_correction_on_the_context():
    t = TreeTrace(nodes=[node(1, "a", -1, 1, 0.5, 0.1, 0.0, None, "rejected"),
                         node(2, "b", -1, 1, 0.4, 0.1, 0.0, None, "rejected")], accepted_path=[])
    lay = tree_layout(t, "correction")
    assert lay.parents == [CONTEXT, CONTEXT, CONTEXT] and lay.x == [1, 1, 1] and lay.y == [0.0, 1.0, 2.0]
    assert lay.context_y == 1.0


def test_ended_in_draft_has_no_target_token():
    rnd = tree_round(chain_tree(), "bonus")
    rnd.stop_reason = "eos"
    rnd.emitted_ids = rnd.emitted_ids[:3]  # the accepted end-of-sequence node ended the output
    assert rnd.ended_in_draft
    assert round_tree_layout(rnd).target_kind is None


def test_a_target_token_cut_by_max_new_tokens_is_not_drawn():
    rnd = tree_round(greedy_tree(), "correction")
    rnd.emitted_ids = rnd.emitted_ids[:2]  # the run's budget ended with the path: the correction was not emitted
    rnd.stop_reason = "max_new_tokens"
    lay = round_tree_layout(rnd)
    assert lay.target_kind is None and len(lay.x) == 6


def test_bad_trees_raise_input_error():
    with pytest.raises(InputError):
        tree_layout(TreeTrace(nodes=[node(1, "a", 0, 1, 1, 1, 1, None, "accepted")], accepted_path=[0]))
    with pytest.raises(InputError, match="depth"):
        tree_layout(TreeTrace(nodes=[node(1, "a", -1, 2, 1, 1, 1, None, "accepted")], accepted_path=[0]))
    with pytest.raises(InputError, match="path"):
        tree_layout(TreeTrace(nodes=greedy_tree().nodes, accepted_path=[2]))
    with pytest.raises(InputError, match="verdict"):
        tree_layout(TreeTrace(nodes=[node(1, "a", -1, 1, 1, 1, 1, None, "discarded")], accepted_path=[]))
    with pytest.raises(InputError, match="correction or a bonus"):
        tree_layout(greedy_tree(), "plain")
    rnd = tree_round(greedy_tree())
    rnd.tree = None
    with pytest.raises(InputError, match="chain"):
        round_tree_layout(rnd)


def test_frames_grow_by_depth_then_verify_then_verdict():
    tree = greedy_tree()
    lay = tree_layout(tree, "correction")
    frames = tree_frames(tree, lay)
    assert [f.stage for f in frames] == ["draft", "draft", "draft", "verify", "verdict"]
    assert frames[0].states == ["drafted", "drafted"] + ["hidden"] * 5
    assert frames[1].states == ["drafted"] * 5 + ["hidden"] * 2
    assert frames[2].states == ["drafted"] * 6 + ["hidden"]
    assert frames[0].caption == "Draft, depth 1 of 3: 2 new nodes, 2 of 6 so far."
    assert frames[2].caption == "Draft, depth 3 of 3: 1 new node, 6 of 6 so far."
    assert frames[3].states == ["verifying"] * 6 + ["hidden"]
    assert frames[4].states == ["accepted", "rejected", "accepted", "rejected", "unvisited", "rejected",
                                "correction"]
    assert frames[4].caption == ("Kept: the accepted path of 2 nodes plus the target's correction (3 new tokens "
                                 "from one pass); 3 rejected, 1 never judged.")


def test_counts():
    assert tree_counts(greedy_tree()) == {"accepted": 2, "rejected": 3, "unvisited": 1, "nodes": 6, "depth": 3}


def test_attention_matrix_by_hand():
    # parents [-1, -1, 0, 0, 1, 2]: node 5 sees the context, 0, 2 and itself; node 4 sees 1 and itself
    m = attention_matrix(greedy_tree())
    assert m[5] == [1, 1, 0, 1, 0, 0, 1]
    assert m[4] == [1, 0, 1, 0, 0, 1, 0]
    assert m[0] == [1, 1, 0, 0, 0, 0, 0]
    assert attention_matrix(greedy_tree(), context=False)[3] == [1, 0, 0, 1, 0, 0]
    # a chain's mask is causal (lower triangular)
    assert attention_matrix(chain_tree(), context=False) == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_parents_layout_matches_tree_layout():
    from engine.explain.tree_view import parents_layout

    t = greedy_tree()
    assert parents_layout(t.parents, [0, 2]) == tree_layout(t)
    assert parents_layout([-1, 0, 0]).y == [0.5, 0.0, 1.0]
    with pytest.raises(InputError):
        parents_layout([1])
