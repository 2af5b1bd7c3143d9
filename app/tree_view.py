"""Plotly figures and table rows of a round's token tree for the Live page (pure, tested without a browser).

Positions, frames and the mask come from ``engine.explain.tree_view``; this module only turns them into
figures. Token text is untrusted: every label and hover text passes through ``html.escape`` (plotly reads a
few HTML tags in its text), after ``app.live_view.visible`` made whitespace visible.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from app.live_view import verdict_frame, visible
from engine.decoding.trace import Round, TreeNode, TreeTrace
from engine.explain.tree_view import (
    CONTEXT,
    TreeFrame,
    TreeLayout,
    attention_matrix,
    parents_layout,
    round_tree_layout,
    tree_frames,
)

COLORS = {"drafted": "#8c8c8c", "verifying": "#9467bd", "accepted": "#2ca02c", "rejected": "#d62728",
          "unvisited": "#b0b0b0", "correction": "#ff7f0e", "bonus": "#1f77b4"}
"""Node colour by state: the Live page's chip colours (green accepted, red rejected, orange correction, blue
bonus), grey while drafted, purple while in the verify pass."""
OPACITY = {"rejected": 0.45, "unvisited": 0.3}
"""Dimmed states' marker opacity after the verdict (1.0 for the rest). Only the markers: a whole trace's opacity
also fades its labels, to 1.8:1 against the page for never-judged nodes (WCAG AA asks 4.5:1, ``app.contrast``)."""
STATE_LABEL = {"drafted": "drafted", "verifying": "in the verify pass", "accepted": "accepted",
               "rejected": "rejected", "unvisited": "never judged", "correction": "target's correction",
               "bonus": "target's bonus token"}
CONTEXT_COLOR = "#555555"
LABEL_COLOR = {"light": "#2f2d2b", "dark": "#edebe8"}
"""Node labels' colour by Streamlit theme type: its body text colour (Streamlit 1.67's defaults; 13.7:1 and 15.2:1
on its backgrounds). Streamlit's chart theme draws plotly text in its faded grey, #808495 on white: 3.7:1, under
WCAG AA's 4.5:1 (``app.contrast``)."""
LABEL_CHARS = 8  # a node's label is cut after this many characters (the hover has the whole token)


def node_label(text: str, limit: int = LABEL_CHARS) -> str:
    """A token as a node label: visible whitespace (edge spaces as ␣, which plotly would trim), cut to
    ``limit`` characters with "…", HTML-escaped."""
    t = visible(text)
    core = t.strip(" ")
    if core:
        t = "␣" * (len(t) - len(t.lstrip(" "))) + core + "␣" * (len(t) - len(t.rstrip(" ")))
    if len(t) > limit:
        t = t[:limit - 1] + "…"
    return html.escape(t)


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def node_hover(i: int, nd: TreeNode, state: str, greedy: bool) -> str:
    """Hover text of tree node ``i``: the whole token (escaped), depth and parent, p, q, the test, state."""
    parent = "the context" if nd.parent == CONTEXT else f"node {nd.parent}"
    test = (("argmax of p? " + ("—" if nd.accept_prob is None else "yes" if nd.accept_prob >= 1 else "no"))
            if greedy else f"min(1, p/q) = {_num(nd.accept_prob)}, u = {_num(nd.u)}")
    draft = "" if getattr(nd, "draft_prob", None) is None else f" (the draft's own probability {nd.draft_prob:.4f})"
    return (f"node {i}: {html.escape(visible(nd.text))} (id {nd.token_id})<br>depth {nd.depth}, child of {parent}"
            f"<br>p = {nd.p:.4f}, q = {nd.q:.4f}{draft}<br>{test}<br>{STATE_LABEL.get(state, state)}")


def tree_figure(rnd: Round, frame: int = -1, greedy: bool = False,
                layout: TreeLayout | None = None, frames: list[TreeFrame] | None = None,
                theme: str | None = None) -> go.Figure:
    """The token tree of a tree round at animation frame ``frame`` (−1: the verdict).

    Nodes by depth (x) and lane (y, top down); edges from each parent; one trace per state, so the legend
    names the colours. The axes' ranges are fixed by the whole tree, so the frames do not jump. ``theme``
    (``st.context.theme.type``: "light", "dark" or None when not known yet) picks the labels' colour,
    ``LABEL_COLOR``; None leaves the chart theme's.

    Raises:
        InputError: for a chain round or an inconsistent tree (``engine.explain.tree_view``).
    """
    tree = rnd.tree
    lay = layout or round_tree_layout(rnd)
    fr = (frames or tree_frames(tree, lay))[frame]
    n = lay.n_nodes
    fig = go.Figure()

    def pos(i: int) -> tuple[float, float]:
        return (0.0, lay.context_y) if i == CONTEXT else (float(lay.x[i]), lay.y[i])

    # edges, drawn under the nodes: kept edges thick green after the verdict, the rest thin grey
    groups: dict[str, tuple[list, list]] = {}
    for par, child in lay.edges():
        st = fr.states[child]
        if st == "hidden":
            continue
        style = "kept" if fr.stage == "verdict" and lay.on_path[child] else (
            "dim" if fr.stage == "verdict" else "live")
        xs, ys = groups.setdefault(style, ([], []))
        (x0, y0), (x1, y1) = pos(par), pos(child)
        xs += [x0, x1, None]
        ys += [y0, y1, None]
    edge_style = {"kept": {"color": COLORS["accepted"], "width": 4}, "live": {"color": "#9a9a9a", "width": 1.5},
                  "dim": {"color": "#c8c8c8", "width": 1}}
    for style, (xs, ys) in groups.items():
        fig.add_scatter(x=xs, y=ys, mode="lines", line=edge_style[style], hoverinfo="skip", showlegend=False)

    label_font = {"color": LABEL_COLOR[theme]} if theme in LABEL_COLOR else {}
    fig.add_scatter(x=[0.0], y=[lay.context_y], mode="markers+text", text=["context"], textposition="middle left",
                    textfont=label_font,
                    marker={"size": 14, "color": CONTEXT_COLOR, "symbol": "square"}, showlegend=False,
                    hovertext=[f"the context: {rnd.context_len} tokens (prompt and text so far), in the KV cache"],
                    hoverinfo="text", cliponaxis=False)
    by_state: dict[str, list[int]] = {}
    for i, st in enumerate(fr.states):
        if st != "hidden":
            by_state.setdefault(st, []).append(i)
    for st in (s for s in COLORS if s in by_state):  # a fixed order: the legend reads the same every round
        idx = by_state[st]
        labels, hovers = [], []
        for i in idx:
            if i < n:
                labels.append(node_label(tree.nodes[i].text))
                hovers.append(node_hover(i, tree.nodes[i], st, greedy))
            else:  # the target's own token
                labels.append(node_label(rnd.next_text))
                hovers.append(f"{STATE_LABEL[st]}: {html.escape(visible(rnd.next_text))} (id {rnd.next_token_id}), "
                              "drawn from the target's p in the same pass")
        fig.add_scatter(x=[lay.x[i] for i in idx], y=[lay.y[i] for i in idx], mode="markers+text",
                        name=STATE_LABEL[st], text=labels, textposition="top center", hovertext=hovers,
                        textfont={"size": 14, **label_font},
                        hoverinfo="text",
                        marker={"size": 16 if st in ("correction", "bonus") else 13, "color": COLORS[st],
                                "opacity": OPACITY.get(st, 1.0) if fr.stage == "verdict" else 1.0,
                                "symbol": "diamond" if st in ("correction", "bonus") else "circle",
                                "line": {"width": 1, "color": "#ffffff"}},
                        cliponaxis=False)
    depth = max(lay.depth, 1)
    fig.update_layout(
        height=min(max(170 + 56 * lay.n_lanes, 320), 720), margin={"t": 75, "b": 10, "l": 10, "r": 10},
        # the legend above the plot, under the title: below it, it covered the depth axis
        showlegend=True, legend={"orientation": "h", "y": 1.01, "x": 0, "yanchor": "bottom"},
        title={"text": f"Round {rnd.index + 1}: token tree of {n} node{'' if n == 1 else 's'}", "y": 0.98,
               "yanchor": "top"})
    fig.update_xaxes(range=[-0.9, depth + 0.5], tickvals=list(range(depth + 1)),
                     ticktext=["context"] + [str(d) for d in range(1, depth + 1)], title_text="depth",
                     showgrid=False, zeroline=False, fixedrange=True)
    fig.update_yaxes(range=[lay.n_lanes - 0.5, -0.8], visible=False, fixedrange=True)
    return fig


def mask_labels(tree: TreeTrace) -> list[str]:
    """Axis labels of the mask: "i·token" per node (unique, escaped)."""
    return [f"{i}·{node_label(nd.text, 6)}" for i, nd in enumerate(tree.nodes)]


def mask_figure(tree: TreeTrace) -> go.Figure:
    """The verify pass's tree attention mask as a heatmap: row = a node's query, column = a key it may see
    (the cached context first, then the nodes); filled = attends (``engine.explain.tree_view.attention_matrix``)."""
    z = attention_matrix(tree, context=True)
    ys = mask_labels(tree)
    xs = ["context"] + ys
    hover = [[f"{ys[i]} {'sees' if v else 'does not see'} {xs[j]}" for j, v in enumerate(row)]  # escaped labels
             for i, row in enumerate(z)]
    fig = go.Figure(go.Heatmap(z=z, x=xs, y=ys, zmin=0, zmax=1, showscale=False, xgap=1, ygap=1,
                               colorscale=[[0.0, "rgba(0,0,0,0)"], [1.0, "#4c78a8"]],
                               hovertext=hover, hoverinfo="text"))
    n = len(ys)
    fig.update_layout(title="Tree attention mask (row sees column)", height=min(max(200 + 22 * n, 300), 620),
                      margin={"t": 40, "b": 10, "l": 10, "r": 10})
    fig.update_xaxes(type="category", tickangle=-60, title_text="key (what is seen)")
    fig.update_yaxes(type="category", autorange="reversed", title_text="query (node)")
    return fig


def tree_rows(tree: TreeTrace, greedy: bool = False) -> list[dict]:
    """One row per node: index, parent, depth, token, id, q, p, the draft's own probability (when the draft
    gave one: a deterministic pick has q = 1), the test (greedy: argmax of p?; sampling: min(1, p/q) and u,
    4 decimals, "—" when never judged), verdict, and whether it is on the accepted path."""
    path = set(tree.accepted_path)
    with_draft = any(getattr(nd, "draft_prob", None) is not None for nd in tree.nodes)
    rows = []
    for i, nd in enumerate(tree.nodes):
        row = {"node": i, "parent": "context" if nd.parent == CONTEXT else str(nd.parent), "depth": nd.depth,
               "token": visible(nd.text), "id": nd.token_id, "q(x)": nd.q, "p(x)": nd.p}
        if with_draft:
            row["draft prob"] = _num(nd.draft_prob)
        if greedy:
            row["argmax of p?"] = "—" if nd.accept_prob is None else ("yes" if nd.accept_prob >= 1 else "no")
        else:
            row["min(1, p/q)"] = _num(nd.accept_prob)
            row["u"] = _num(nd.u)
        row["verdict"] = nd.verdict + (" (path)" if i in path else "")
        rows.append(row)
    return rows


def tree_round_markdown(rnd: Round, frame: TreeFrame) -> str:
    """The round box's Markdown at a tree frame: the frame's sentence (no model text), and at the verdict the
    kept tokens as escaped chips (``app.live_view.verdict_frame`` of the accepted path and its first
    rejected node)."""
    if frame.stage != "verdict":
        return f"**{'Draft' if frame.stage == 'draft' else 'Verify'}:** {frame.caption}"
    return verdict_frame(rnd) + "  \n" + frame.caption


def shape_figure(parents: list[int], path_probs: list[float], title: str) -> go.Figure:
    """A tree shape that was not run (the what-if model's best tree): nodes by depth, each labelled with its
    P(path accepted) and coloured by it (darker = likelier)."""
    lay = parents_layout(parents)
    fig = go.Figure()
    xs, ys = [], []
    for par, child in lay.edges():
        x0, y0 = (0.0, lay.context_y) if par == CONTEXT else (lay.x[par], lay.y[par])
        xs += [x0, lay.x[child], None]
        ys += [y0, lay.y[child], None]
    fig.add_scatter(x=xs, y=ys, mode="lines", line={"color": "#9a9a9a", "width": 1.5}, hoverinfo="skip",
                    showlegend=False)
    fig.add_scatter(x=[0.0], y=[lay.context_y], mode="markers", marker={"size": 14, "color": CONTEXT_COLOR,
                    "symbol": "square"}, hovertext=["the context"], hoverinfo="text", showlegend=False)
    fig.add_scatter(x=lay.x, y=lay.y, mode="markers+text", text=[f"{p:.2f}" for p in path_probs],
                    textposition="top center", showlegend=False, cliponaxis=False,
                    hovertext=[f"node {i}, depth {lay.x[i]}: P(path accepted) = {p:.4f}" for i, p in enumerate(path_probs)],
                    hoverinfo="text",
                    marker={"size": 13, "color": path_probs, "cmin": 0, "cmax": 1, "colorscale": "Greens",
                            "line": {"width": 1, "color": "#555555"}})
    depth = max(lay.depth, 1)
    fig.update_layout(title=title, height=min(max(90 + 40 * lay.n_lanes, 240), 640),
                      margin={"t": 40, "b": 10, "l": 10, "r": 10})
    fig.update_xaxes(range=[-0.4, depth + 0.5], tickvals=list(range(depth + 1)),
                     ticktext=["context"] + [str(d) for d in range(1, depth + 1)], title_text="depth",
                     showgrid=False, zeroline=False, fixedrange=True)
    fig.update_yaxes(range=[lay.n_lanes - 0.5, -0.8], visible=False, fixedrange=True)
    return fig
