"""app.tree_view: the Live page's tree figures, mask and rows built from hand-made trees
(tests/tree_fixtures.py): escaping, states per frame, fixed axes, the mask's cells."""

from __future__ import annotations

import html

import pytest

from app.tree_view import (
    COLORS,
    mask_figure,
    mask_labels,
    node_hover,
    node_label,
    shape_figure,
    tree_figure,
    tree_round_markdown,
    tree_rows,
)
from engine.errors import InputError
from engine.explain.tree_view import round_tree_layout, tree_frames
from tests.tree_fixtures import chain_tree, greedy_tree, nasty_tree, tree_round


def _nodes(fig):
    """{legend name: (x list, y list, text list)} of the node traces."""
    return {t.name: (list(t.x), list(t.y), list(t.text)) for t in fig.data if t.name}


def test_labels_are_visible_cut_and_escaped():
    assert node_label(" cat") == "␣cat"
    assert node_label("\n") == "↵"
    assert node_label("<b>x</b>") == html.escape("<b>x</b>")  # 8 characters: not cut
    assert node_label("<b>xy</b>") == html.escape("<b>xy</") + "…"
    assert node_label("abcdefghij", limit=5) == "abcd…"
    assert "<script>" not in node_hover(1, nasty_tree().nodes[1], "rejected", greedy=False)
    assert "&lt;script&gt;" in node_hover(1, nasty_tree().nodes[1], "rejected", greedy=False)


def test_verdict_frame_of_the_greedy_tree():
    rnd = tree_round(greedy_tree(), "correction")
    fig = tree_figure(rnd, greedy=True)
    nodes = _nodes(fig)
    # states from the trace's verdicts; the correction hangs after node 2 at depth 3, lane 1
    assert nodes["accepted"][0] == [1, 2] and nodes["accepted"][2] == ["The", "␣cat"]
    assert nodes["rejected"][0] == [1, 2, 3]
    assert nodes["never judged"][0] == [2]
    assert nodes["target's correction"][:2] == ([3], [1.0])
    assert nodes["target's correction"][2] == ["␣is"]
    # dimmed markers after the verdict, kept ones opaque; every label at full opacity (a trace's opacity would
    # fade its text too, below WCAG AA: tests/test_contrast.py)
    by_name = {t.name: t for t in fig.data if t.name}
    assert by_name["rejected"].marker.opacity == 0.45 and by_name["never judged"].marker.opacity == 0.3
    assert by_name["accepted"].marker.opacity == 1.0 and by_name["accepted"].marker.color == COLORS["accepted"]
    assert all(t.opacity in (None, 1.0) for t in fig.data)
    # the kept edges (context → 0 → 2 → correction) are one thick green trace
    kept = next(t for t in fig.data if t.mode == "lines" and t.line.width == 4)
    assert [v for v in kept.y if v is not None] == [2.125, 1.25, 1.25, 0.5, 0.5, 1.0]
    assert "argmax of p? yes" in by_name["accepted"].hovertext[0]
    assert fig.layout.xaxis.range == (-0.9, 3.5) and fig.layout.yaxis.range == (3.5, -0.8)


def test_frames_show_growing_tree_with_fixed_axes():
    rnd = tree_round(greedy_tree(), "correction")
    lay = round_tree_layout(rnd)
    frames = tree_frames(rnd.tree, lay)
    figs = [tree_figure(rnd, i, layout=lay, frames=frames) for i in range(len(frames))]
    assert _nodes(figs[0])["drafted"][0] == [1, 1]
    assert len(_nodes(figs[1])["drafted"][0]) == 5
    assert set(_nodes(figs[3])) == {"in the verify pass"} and len(_nodes(figs[3])["in the verify pass"][0]) == 6
    assert len({(f.layout.xaxis.range, f.layout.yaxis.range) for f in figs}) == 1
    # markdown: the frame's sentence, then at the verdict the kept chips and the correction
    assert tree_round_markdown(rnd, frames[0]).startswith("**Draft:** Draft, depth 1 of 3")
    assert tree_round_markdown(rnd, frames[3]).startswith("**Verify:** One target pass")
    last = tree_round_markdown(rnd, frames[-1])
    assert last.startswith("**Verify:** :green-background[The]") and "(correction)" in last


def test_bonus_round_and_nasty_text():
    fig = tree_figure(tree_round(chain_tree(), "bonus", next_text="<i>"))
    nodes = _nodes(fig)
    assert nodes["target's bonus token"][:3] == ([4], [0.0], ["&lt;i&gt;"])
    fig = tree_figure(tree_round(nasty_tree(), "correction", next_text="&"), greedy=False)
    texts = [x for t in fig.data for x in (t.text or ())] + [x for t in fig.data for x in (t.hovertext or ())]
    assert not any("<b>" in x or "<script>" in x or "<i>" in x for x in texts)
    assert any("min(1, p/q) = 0.9000, u = 0.3000" in x for x in texts)
    # a cut label ("**y**␣&…", a rejected node) has the whole token in its node's hover
    rejected = next(t for t in fig.data if t.name == "rejected")
    assert rejected.text[0].endswith("…") and html.escape("**y** & <script>") in rejected.hovertext[0]


def test_chain_round_has_no_tree_figure():
    rnd = tree_round(chain_tree(), "bonus")
    rnd.tree = None
    with pytest.raises(InputError):
        tree_figure(rnd)


def test_mask_figure_cells_and_labels():
    fig = mask_figure(greedy_tree())
    hm = fig.data[0]
    assert list(hm.x) == ["context"] + mask_labels(greedy_tree())
    assert mask_labels(greedy_tree())[1] == "1·A" and mask_labels(greedy_tree())[2] == "2·␣cat"
    assert [list(r) for r in hm.z][5] == [1, 1, 0, 1, 0, 0, 1]  # node 5 sees the context, 0, 2, itself
    assert "5·␣sat sees 2·␣cat" == hm.hovertext[5][3]
    labels = mask_labels(nasty_tree())
    assert labels[0] == "0·" + html.escape("<b>x<") + "…" and "<" not in "".join(labels)
    hover = mask_figure(nasty_tree()).data[0].hovertext
    assert hover[1][2] == "1·**y**…" + " sees " + "1·**y**…" and hover[0][1] == labels[0] + " sees " + labels[0]
    assert "&amp;" not in "".join(x for row in hover for x in row)  # escaped once, not twice


def test_rows():
    rows = tree_rows(greedy_tree(), greedy=True)
    assert rows[0] == {"node": 0, "parent": "context", "depth": 1, "token": "The", "id": 10, "q(x)": 0.6,
                       "p(x)": 0.7, "argmax of p?": "yes", "verdict": "accepted (path)"}
    assert rows[4]["argmax of p?"] == "—" and rows[4]["verdict"] == "unvisited"
    s = tree_rows(nasty_tree(), greedy=False)
    assert s[1]["min(1, p/q)"] == "0.5000" and s[1]["u"] == "0.8000" and s[1]["parent"] == "context"


def test_draft_prob_in_hover_and_rows():
    tree = greedy_tree()
    tree.nodes[0].draft_prob = 0.31
    assert "the draft's own probability 0.3100" in node_hover(0, tree.nodes[0], "accepted", greedy=True)
    rows = tree_rows(tree, greedy=True)
    assert rows[0]["draft prob"] == "0.3100" and rows[1]["draft prob"] == "—"
    assert "draft prob" not in tree_rows(greedy_tree())[0]


def test_shape_figure():
    fig = shape_figure([-1, 0, 0], [0.8, 0.64, 0.08], "best tree")
    nodes = fig.data[2]
    assert list(nodes.text) == ["0.80", "0.64", "0.08"] and list(nodes.x) == [1, 2, 2]
    assert list(nodes.y) == [0.5, 0.0, 1.0]
