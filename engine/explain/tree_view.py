"""How a round's token tree is drawn: node positions, the accepted path, the animation's frames, the mask.

Pure functions of a ``engine.decoding.trace.TreeTrace`` (and of the ``Round`` that holds it); the Live page's
plotly figures are built from them in ``app/tree_view.py``. Nothing here reads model text: labels (escaped)
are the app's job.

Layout (a "tidy" layered drawing): x = depth (0 is the context, the cached prompt and text so far; a root
of the tree has depth 1), y = a lane from the top (0, 1, 2, …). Leaves take consecutive lanes in
depth-first order, children in node order; an inner node sits midway between its first and last child.
Positions depend only on the parents (and where the target's own token hangs), so the same tree is drawn
the same way in every frame and every run.

The target's own token (the correction after a rejected child, or the bonus token after a leaf, as in
``engine.decoding.speculative``) is drawn as one more node: the last child of the accepted path's last node
(of the context when no node was accepted), at depth len(accepted path) + 1. When an accepted
end-of-sequence token ended the output (``Round.ended_in_draft``) there is none.

Animation (``tree_frames``): the tree grows depth by depth (the draft phase: EAGLE-2 expands one depth per
draft pass), then one frame for the target's single verify pass over every node (tree attention: each node
sees the context, its ancestors and itself), then the verdict: the accepted path and the target's token
kept, rejected nodes dimmed, unvisited ones (never judged) faint.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.decoding.attention import tree_depths, tree_visibility
from engine.decoding.trace import TREE_VERDICTS, Round, TreeTrace
from engine.errors import InputError

CONTEXT = -1
"""Parent index of a root: the context (the last token already in the sequence)."""

TARGET_KINDS = ("correction", "bonus")
"""Kinds of the target's own token in a tree round (a tree round always drafts, so never "plain")."""

STATES = ("hidden", "drafted", "verifying", *TREE_VERDICTS, *TARGET_KINDS)
"""Node states of a frame: not drawn yet; drafted (before the verify pass); fed to the verify pass; the three
verdicts (``engine.decoding.trace.TREE_VERDICTS``); the target's own token."""


@dataclass(frozen=True)
class TreeLayout:
    """Positions of a tree's nodes, plus the target's own token when there is one.

    Attributes:
        x: depth of each drawn node (tree nodes 0..N−1 in the trace's order, then the target's token if any).
        y: its lane from the top (0 = top; fractional for an inner node between lanes).
        parents: parent of each drawn node in the same indexing, ``CONTEXT`` (−1) for a root.
        on_path: whether the node is kept: on the accepted path, or the target's token.
        n_nodes: N, the tree's nodes (the target's token not counted).
        target_kind: "correction" or "bonus" for the last drawn node, None when there is none.
        context_y: the context's lane (the midpoint of the roots).
        n_lanes: number of leaf lanes (≥ 1).
        depth: the largest x.
    """

    x: list[int]
    y: list[float]
    parents: list[int]
    on_path: list[bool]
    n_nodes: int
    target_kind: str | None
    context_y: float
    n_lanes: int
    depth: int

    @property
    def target_index(self) -> int | None:
        """Index of the target's own token in the drawn nodes (N), or None."""
        return self.n_nodes if self.target_kind else None

    def edges(self) -> list[tuple[int, int]]:
        """(parent, child) per drawn node, parent ``CONTEXT`` for a root."""
        return [(p, i) for i, p in enumerate(self.parents)]


def _check_tree(tree: TreeTrace) -> list[int]:
    parents = tree.parents
    depths = tree_depths(parents)  # InputError for a parent that is not an earlier node
    for i, (n, d) in enumerate(zip(tree.nodes, depths)):
        if n.depth != d:
            raise InputError(f"Tree node {i} says depth {n.depth}, but its parents put it at depth {d}.")
        if n.verdict not in TREE_VERDICTS:
            raise InputError(f"Tree node {i} has verdict {n.verdict!r}; expected one of {', '.join(TREE_VERDICTS)}.")
    path = list(tree.accepted_path)
    prev = CONTEXT
    for j in path:
        if not 0 <= j < len(parents) or parents[j] != prev:
            raise InputError(f"The accepted path {path} is not a path from the context down the tree.")
        prev = j
    return parents


def tree_layout(tree: TreeTrace, target_kind: str | None = None) -> TreeLayout:
    """Lay out ``tree`` (see the module docstring), with the target's own token of kind ``target_kind``
    ("correction", "bonus", or None for none) hung after the accepted path.

    Raises:
        InputError: parents out of order, depths or a path that disagree with the parents, an unknown
            verdict or target kind.
    """
    if target_kind is not None and target_kind not in TARGET_KINDS:
        raise InputError(f"The target's token in a tree round is a correction or a bonus token, got {target_kind!r}.")
    return _layout(_check_tree(tree), list(tree.accepted_path), target_kind)


def parents_layout(parents: list[int], path: list[int] | None = None) -> TreeLayout:
    """``tree_layout`` of a bare tree shape (parents only; ``path`` marks nodes as kept), for a tree that
    was not run, such as the what-if model's best tree (``engine.explain.analytic.best_tree``).

    Raises:
        InputError: a parent that is not an earlier node.
    """
    tree_depths(parents)
    return _layout(list(parents), list(path or []), None)


def _layout(parents: list[int], path: list[int], target_kind: str | None) -> TreeLayout:
    n = len(parents)
    all_parents = parents + ([path[-1] if path else CONTEXT] if target_kind else [])
    m = len(all_parents)
    children: dict[int, list[int]] = {CONTEXT: []}
    for i in range(m):
        children[i] = []
    for i, p in enumerate(all_parents):
        children[p].append(i)  # node order; the target's token is appended last
    x = [0] * m
    y = [0.0] * m
    lane = 0
    depth_of = tree_depths(all_parents)

    def place(node: int) -> float:  # recursion depth = the tree's depth (a few dozen at most)
        nonlocal lane
        kids = children[node]
        if not kids:
            pos = float(lane)
            lane += 1
        else:
            ys = [place(k) for k in kids]
            pos = (ys[0] + ys[-1]) / 2
        if node != CONTEXT:
            y[node] = pos
            x[node] = depth_of[node]
        return pos

    context_y = place(CONTEXT) if m else 0.0
    on_path = [i in set(path) for i in range(n)] + ([True] if target_kind else [])
    return TreeLayout(x=x, y=y, parents=all_parents, on_path=on_path, n_nodes=n, target_kind=target_kind,
                      context_y=context_y, n_lanes=max(lane, 1), depth=max(x, default=0))


def round_tree_layout(rnd: Round) -> TreeLayout:
    """``tree_layout`` of a tree round, with its target token when the round emitted it (not after an accepted
    end-of-sequence token, nor when the run's last tokens stopped at max new tokens before it).

    Raises:
        InputError: for a chain round (``rnd.tree`` is None) or an inconsistent tree.
    """
    if rnd.tree is None:
        raise InputError(f"Round {rnd.index + 1} drafted a chain, not a tree.")
    emitted_own = len(rnd.emitted_ids) > rnd.n_accepted and not rnd.ended_in_draft
    kind = rnd.next_kind if emitted_own and rnd.next_kind in TARGET_KINDS else None
    return tree_layout(rnd.tree, kind)


@dataclass(frozen=True)
class TreeFrame:
    """One animation frame: a state per drawn node (``STATES``) and what the frame shows, in words.

    Attributes:
        stage: "draft", "verify" or "verdict".
        depth: the deepest drafted depth shown.
        states: per drawn node (``TreeLayout`` indexing).
        caption: one sentence without model text.
    """

    stage: str
    depth: int
    states: list[str]
    caption: str


def tree_counts(tree: TreeTrace) -> dict[str, int]:
    """Nodes by verdict ("accepted", "rejected", "unvisited"), plus "nodes" (N) and "depth" (the deepest)."""
    out = {v: sum(1 for nd in tree.nodes if nd.verdict == v) for v in TREE_VERDICTS}
    out["nodes"] = len(tree.nodes)
    out["depth"] = max((nd.depth for nd in tree.nodes), default=0)
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def tree_frames(tree: TreeTrace, layout: TreeLayout) -> list[TreeFrame]:
    """The animation of a tree round: one frame per drafted depth, one for the verify pass, one verdict.

    A tree of N nodes and depth D gives D + 2 frames (an empty tree: the verify and verdict frames only).
    """
    n, m = layout.n_nodes, len(layout.x)
    counts = tree_counts(tree)
    frames = []
    for d in range(1, counts["depth"] + 1):
        states = ["drafted" if i < n and layout.x[i] <= d else "hidden" for i in range(m)]
        k = sum(1 for s in states if s == "drafted")
        new = sum(1 for i in range(n) if layout.x[i] == d)
        frames.append(TreeFrame("draft", d, states, f"Draft, depth {d} of {counts['depth']}: "
                                f"{_plural(new, 'new node')}, {k} of {n} so far."))
    frames.append(TreeFrame("verify", counts["depth"], ["verifying"] * n + ["hidden"] * (m - n),
                            f"One target pass over all {_plural(n, 'node')} at once: the tree attention mask lets "
                            "each node see the context, its ancestors and itself, never another branch."))
    states = [nd.verdict for nd in tree.nodes] + ([layout.target_kind] if layout.target_kind else [])
    kept = len(tree.accepted_path)
    tail = {"correction": " plus the target's correction",
            "bonus": " plus the target's bonus token"}.get(layout.target_kind or "", "")
    frames.append(TreeFrame("verdict", counts["depth"], states,
                            f"Kept: the accepted path of {_plural(kept, 'node')}{tail} "
                            f"({kept + (1 if layout.target_kind else 0)} new tokens from one pass); "
                            f"{counts['rejected']} rejected, {counts['unvisited']} never judged."))
    return frames


def attention_matrix(tree: TreeTrace, context: bool = True) -> list[list[int]]:
    """The verify pass's tree attention mask as 0/1 rows: row i = node i's query, column j = key.

    With ``context`` the first column is the cached context (every node sees it), then the N nodes; the
    node part is ``engine.decoding.attention.tree_visibility`` (node j is node i or one of its ancestors).

    Returns:
        N rows of N (+ 1) ints.
    """
    vis = tree_visibility(tree.parents).int().tolist()
    return [([1] if context else []) + row for row in vis]
