"""Hand-built token trees (``TreeTrace``) and the rounds that hold them, for the tree drawing's tests.

GREEDY: six nodes, depth 3, the accepted path 0 → 2, then the target's correction after node 2::

    context ─┬─ 0 "The" (accepted) ─┬─ 2 " cat" (accepted) ─┬─ 5 " sat" (rejected)
             │                      │                       └─ [correction " is"]
             │                      └─ 3 " dog" (rejected)
             └─ 1 "A" (rejected) ──── 4 " big" (unvisited)
"""

from __future__ import annotations

from engine.decoding.trace import DraftPosition, Round, TopToken, TreeNode, TreeTrace


def node(token_id, text, parent, depth, q, p, accept_prob, u, verdict) -> TreeNode:
    return TreeNode(token_id=token_id, text=text, parent=parent, depth=depth, q=q, p=p,
                    accept_prob=accept_prob, u=u, verdict=verdict)


def greedy_tree() -> TreeTrace:
    return TreeTrace(nodes=[
        node(10, "The", -1, 1, 0.6, 0.7, 1.0, None, "accepted"),
        node(11, "A", -1, 1, 0.3, 0.1, 0.0, None, "rejected"),
        node(12, " cat", 0, 2, 0.5, 0.8, 1.0, None, "accepted"),
        node(13, " dog", 0, 2, 0.4, 0.1, 0.0, None, "rejected"),
        node(14, " big", 1, 2, 0.9, 0.2, None, None, "unvisited"),
        node(15, " sat", 2, 3, 0.7, 0.2, 0.0, None, "rejected"),
    ], accepted_path=[0, 2])


def chain_tree() -> TreeTrace:
    """A chain of three nodes, all accepted (then the target's bonus token)."""
    return TreeTrace(nodes=[node(20 + i, f"t{i}", i - 1, i + 1, 0.5, 0.5, 1.0, None, "accepted")
                            for i in range(3)], accepted_path=[0, 1, 2])


def nasty_tree() -> TreeTrace:
    """Two roots whose text is HTML / Markdown; the first is accepted."""
    return TreeTrace(nodes=[node(30, "<b>x</b>", -1, 1, 0.5, 0.6, 0.9, 0.3, "accepted"),
                            node(31, "**y** & <script>", -1, 1, 0.2, 0.1, 0.5, 0.8, "rejected")],
                     accepted_path=[0])


def tree_round(tree: TreeTrace, next_kind: str = "correction", index: int = 0, next_text: str = " is",
               next_id: int = 99) -> Round:
    """A Round holding ``tree``: ``drafted`` lists the accepted path and the first rejected node on it (as
    the engine's tree rounds do), then the target's token."""
    path = list(tree.accepted_path)
    drafted = [tree.nodes[i] for i in path]
    end = path[-1] if path else -1
    rejected = [nd for nd in tree.nodes if nd.parent == end and nd.verdict == "rejected"]
    if next_kind == "correction" and rejected:
        drafted.append(rejected[0])
    positions = [DraftPosition(token_id=nd.token_id, text=nd.text, q=nd.q, p=nd.p, accept_prob=nd.accept_prob,
                               u=nd.u, verdict=nd.verdict, top_p=[TopToken(nd.token_id, nd.text, nd.p)],
                               top_q=[TopToken(nd.token_id, nd.text, nd.q)]) for nd in drafted]
    return Round(index=index, context_len=20, drafted=positions, n_accepted=len(path), next_token_id=next_id,
                 next_text=next_text, next_kind=next_kind, next_top_p=[TopToken(next_id, next_text, 0.9)],
                 residual_top=None, emitted_ids=[tree.nodes[i].token_id for i in path] + [next_id],
                 draft_ms=3.0, verify_ms=40.0, tokens_verified=len(tree.nodes) + 1, tree=tree)
