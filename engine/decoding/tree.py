"""Token trees: several draft continuations verified in one target pass.

This module holds the tree type that tree drafts produce (EAGLE-2's dynamic tree from the draft head,
prompt lookup with several matches, Medusa heads' static tree) and the tree round verifies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.decoding.attention import fed_visibility, model_mask, tree_depths, tree_visibility
from engine.errors import InputError

MAX_TREE = 64
"""Most nodes a token tree may have (``--tree``; a pass over more tokens than this costs far more than it
can gain on the CPUs and small models this project runs on)."""
TREE_DEFAULT_DEPTH = 4
"""γ (the tree's depth) when a tree run names none (the command line's default with --tree)."""
MAX_BRANCHING = 16
"""Most children a tree draft may expand a node into (``--tree-branching``)."""

DRAWS = ("deterministic", "sampled", "without_replacement")
"""How a node's children were chosen from their parent's draft distribution q:
- "deterministic": picked by rank (top-k, a lookup match); each node's ``q`` row is one-hot on its token;
- "sampled": each child drawn independently from q (repeats possible);
- "without_replacement": children drawn from q one after another without replacement."""


@dataclass
class TokenTree:
    """A token tree of N draft nodes after the current context.

    Attributes:
        tokens: [N] node token ids.
        parents: [N] parent node index, −1 for a root (a child of the last context token); parents come
            before their children.
        q: [N, V] float, the distribution each node was drawn from, over the target's vocabulary: the draft's
            distribution at the node's parent (one-hot rows for deterministic picks).
        draw: how siblings were chosen (one of ``DRAWS``). For "without_replacement" each child's ``q`` row
            is its parent's draft distribution before any sibling was removed (the verification rule removes
            the earlier siblings itself, ``sampling.verify_tree_sampling``).
        draft_probs: optional [N] the draft's own probability of each node's token at its parent (for display
            and ranking; a deterministic pick's ``q`` row is one-hot, this is what the draft thought of it).

    Raises:
        InputError: for lengths that disagree, a parent that is not an earlier node, or an unknown draw.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor
    draw: str = "deterministic"
    draft_probs: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or self.q.shape[0] != len(self.tokens):
            raise InputError(f"A token tree needs one parent and one q row per node: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents, {self.q.shape[0]} q rows.")
        if self.draw not in DRAWS:
            raise InputError(f"Unknown draw {self.draw!r}; expected one of {', '.join(DRAWS)}.")
        if self.draft_probs is not None and len(self.draft_probs) != len(self.tokens):
            raise InputError(f"draft_probs needs one entry per node: {len(self.draft_probs)} for {len(self.tokens)}.")
        tree_depths(self.parents)  # validates parent order

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of each node (roots have depth 1)."""
        return tree_depths(self.parents)

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (−1: the roots), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def visibility(self) -> torch.Tensor:
        """[N, N] bool ancestor-or-self matrix (``engine.decoding.attention.tree_visibility``)."""
        return tree_visibility(self.parents)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive); [] for −1 (the context)."""
        path: list[int] = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def pruned(self, max_depth: int) -> "TokenTree":
        """The tree without nodes deeper than ``max_depth`` (parents renumbered; order kept)."""
        depths = self.depths
        keep = [i for i in range(self.size) if depths[i] <= max_depth]
        if len(keep) == self.size:
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        return TokenTree([self.tokens[i] for i in keep], [new_index.get(self.parents[i], -1) for i in keep],
                         self.q[keep], self.draw,
                         None if self.draft_probs is None else [self.draft_probs[i] for i in keep])


def check_tree_args(tree: int, proposer, accept: str = "exact") -> None:
    """Validate a decoder's tree settings.

    Raises:
        InputError: a tree size outside 0..``MAX_TREE`` (0 = chain), a tree with no draft or with a draft that
            cannot branch (no ``propose_tree``: a draft model, early exit), an unknown acceptance rule, or the
            lossy "typical" rule on a chain.
    """
    from engine.decoding.sampling import ACCEPT_RULES

    if isinstance(tree, bool) or not isinstance(tree, int) or not 0 <= tree <= MAX_TREE:
        raise InputError(f"The tree size must be a whole number of nodes from 0 (a chain) to {MAX_TREE}, got {tree!r}.")
    if accept not in ACCEPT_RULES:
        raise InputError(f"Unknown acceptance rule {accept!r}; expected one of {', '.join(ACCEPT_RULES)} "
                         "(typical is lossy).")
    if tree and proposer is None:
        raise InputError("A token tree needs a draft: plain decoding has nothing to branch.")
    if tree and not callable(getattr(proposer, "propose_tree", None)):
        raise InputError(f"The draft '{getattr(proposer, 'name', proposer)}' cannot make token trees (it drafts one "
                         "chain); use the draft head (embedded-head) or prompt lookup (ngram), or tree size 0.")
    if accept == "typical" and not tree:
        raise InputError("Typical acceptance (lossy) judges token trees: set a tree size of 1 or more.")


def empty_tree(vocab: int) -> TokenTree:
    """A tree without nodes (the round is a plain decoding step)."""
    return TokenTree([], [], torch.zeros(0, vocab))


# ---------------------------------------------------------------- the tree round's target pass


@torch.inference_mode()
def tree_verify_pass(lm, seq: list[int], tree: TokenTree) -> tuple[torch.Tensor, int]:
    """Step 1 of a tree round: one target pass over the uncached context plus every tree node.

    The fed tokens are the part of ``seq`` the cache lacks (a chain: each sees the cache and the fed context
    before it) followed by the N nodes; node i sees the whole context, its ancestors and itself
    (``engine.decoding.attention.tree_visibility``, Medusa §2.1.2 / SpecInfer §4.2) and has position id
    len(seq) + depth(i) − 1 (0-based positions: a root sits where the next token would). Where the target runs
    the fused layers (a cached CPU pass on the "stream" path), each fed token is a row over exactly its visible keys
    (``compute.fused_visible_pass``), so a node gets the bits a chain pass over its path gives; elsewhere the model
    runs with the 4D mask transformers 5.24 takes as is (``attention.model_mask``: bool for SDPA, additive for
    eager).

    Args:
        lm: the target's ``engine.decoding.proposers.CachedLM`` (its cache is made to hold ``seq``'s common
            prefix first, as ``CachedLM.logits_for`` does).
        seq: the context (prompt + generated tokens).
        tree: the draft tree.

    Returns:
        (logits, tokens fed). logits: [N + 1, V] float32 on CPU: row 0 predicts the token after ``seq`` (p at the roots' parent),
        row 1 + i the token after node i. Afterwards the cache (and ``lm.hidden``) holds ``seq`` followed by
        all N nodes in tree order, and ``lm.ids`` is not yet valid: call ``keep_accepted_path`` next.
    """
    n = tree.size
    common = 0
    limit = min(len(lm.ids), len(seq))
    while common < limit and lm.ids[common] == seq[common]:
        common += 1
    reuse = common == len(seq) == len(lm.ids) and lm.last_logits is not None
    if not reuse:
        common = min(common, len(seq) - 1)  # feed at least the last context token: its logits are row 0
    row0 = lm.last_logits.cpu()[None] if reuse else None
    lm.crop(common)
    ctx = seq[common:]
    m = len(ctx)
    q_len = m + n
    # who sees whom among the fed tokens: causal over the fed context, the tree's ancestor matrix below it
    new_vis = torch.zeros(q_len, q_len, dtype=torch.bool)
    new_vis[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
    new_vis[m:, :m] = True
    new_vis[m:, m:] = tree.visibility()
    pos = list(range(common, len(seq))) + [len(seq) + d - 1 for d in tree.depths]
    inp = torch.tensor([ctx + tree.tokens], dtype=torch.long, device=lm.device)
    pos_t = torch.tensor([pos], dtype=torch.long, device=lm.device)
    n_logits = n + (0 if reuse else 1)
    h = _fused_tree_pass(lm, inp, pos_t, new_vis, common)
    if h is not None:  # the fused layers, each node as a row over its own keys: a chain's bits for its path
        if lm.keep_hidden:
            lm.append_hidden(h[0])
        from engine.decoding.compute import batch_invariant

        with batch_invariant():  # the LM head on the streaming kernel at any row count, as a chain's pass
            logits = lm.model.get_output_embeddings()(h[:, -n_logits:])[0].float()
    elif lm.keep_hidden:
        mask = _tree_mask(lm, new_vis, common)
        h = lm.model.get_decoder()(input_ids=inp, cache=lm.cache, use_cache=True, attention_mask=mask,
                                   position_ids=pos_t).last_hidden_state
        lm.append_hidden(h[0])
        logits = lm.model.get_output_embeddings()(h[:, -n_logits:])[0].float()
    else:
        mask = _tree_mask(lm, new_vis, common)
        out = lm.model(input_ids=inp, cache=lm.cache, use_cache=True, attention_mask=mask, position_ids=pos_t,
                       logits_to_keep=n_logits)
        logits = out.logits[0, -n_logits:].float()
    lm.ids = list(seq) + list(tree.tokens)  # what the cache holds, in tree order (not a sequence yet)
    lm.last_logits = None
    logits = logits.cpu()
    return (logits if row0 is None else torch.cat([row0, logits])), q_len


def _tree_mask(lm, new_vis: torch.Tensor, common: int) -> torch.Tensor:
    """The masked model's 4D mask: the ``common`` cached entries visible to every fed token, ``new_vis`` among them."""
    return model_mask(fed_visibility(new_vis, torch.ones(1, common, dtype=torch.bool)), lm.model).to(lm.device)


def _fused_tree_pass(lm, inp: torch.Tensor, pos: torch.Tensor, new_vis: torch.Tensor, common: int):
    """The tree pass through the fused layers (``compute.fused_visible_pass``) where the target runs them: a cache
    after ``common`` > 0 entries on the CPU, no autograd; the cache's block gets room for the fed tokens first, as a
    chain's decode pass does (``CachedLM._feed``). None where it does not apply: the caller runs the masked model."""
    decoder = getattr(lm.model, "get_decoder", None)
    if (common <= 0 or lm.device.type != "cpu" or torch.is_grad_enabled() or not hasattr(lm, "_filled")
            or not callable(decoder)):
        return None
    from engine.decoding.compute import fused_visible_pass

    if lm._filled():
        lm._ensure_block(int(inp.shape[1]))
    return fused_visible_pass(decoder(), inp, pos, lm.cache, new_vis)


@torch.inference_mode()
def keep_accepted_path(lm, context_len: int, path: list[int], path_logits: torch.Tensor | None = None) -> None:
    """Step 2 of a tree round: keep only the accepted path's KV entries, in sequence order, and drop the rest.

    After ``tree_verify_pass`` the cache holds the context (``context_len`` entries) followed by the N nodes
    in tree order. Each layer's key and value tensors ([batch, kv_heads, positions, head_dim] in
    transformers 5.24's ``DynamicLayer``) become context + the path's nodes gathered into place, so the cache
    is exactly what a chain pass over context + path would have left (``lm.hidden`` likewise, for a draft
    head reading the target's features).

    Args:
        lm: the target's ``CachedLM``.
        context_len: len(seq) at the tree pass.
        path: accepted node indices, root first.
        path_logits: [V] the logits after the path's last node, kept as ``lm.last_logits``; None forgets them.

    Raises:
        InputError: for a cache whose layers are not plain ``DynamicLayer`` s (a sliding-window cache keeps
            fewer positions than the sequence, so positions cannot be gathered this way).
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    tree_tokens = lm.ids[context_len:]
    end = context_len + len(path)
    if end < len(lm.ids) or path != list(range(len(path))):
        # Only the tree's part moves: the path's entries are copied into the slots right after the context and
        # the rest is cut off (a view, as DynamicLayer.crop leaves). Gathering every position instead
        # (index_select over context + tree) copied the whole cache each round: 2.1 ms a round of a 3-node
        # tree (Intel Xeon, cProfile of 3 held-out prompts × 48 tokens).
        moved = path != list(range(len(path)))
        for layer in lm.cache.layers:
            if not isinstance(layer, DynamicLayer) or isinstance(layer, DynamicSlidingWindowLayer):
                raise InputError(f"Token trees need a full KV cache; this model's cache has {type(layer).__name__} "
                                 "layers.")
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            if moved:
                idx = torch.tensor([context_len + i for i in path], dtype=torch.long, device=layer.keys.device)
                layer.keys[..., context_len:end, :] = layer.keys.index_select(-2, idx)
                layer.values[..., context_len:end, :] = layer.values.index_select(-2, idx)
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]
        if lm.hidden is not None:
            if moved:
                idx = torch.tensor([context_len + i for i in path], dtype=torch.long, device=lm.hidden.device)
                lm.hidden[context_len:end] = lm.hidden.index_select(0, idx)
            lm.hidden = lm.hidden[:end]
    lm.ids = lm.ids[:context_len] + [tree_tokens[i] for i in path]
    lm.last_logits = path_logits


# ------------------------------------------------------------------- static trees from ranked candidates
# Medusa §2.3.3 (Cai et al. 2024): a static tree of paths [r1, ..., rd] (the r1-th candidate of draft position 1,
# then the r2-th of position 2, ...) when every position's candidates are ranked independently of the path
# before them (Medusa heads; the block drafter, engine/decoding/block_drafter.py).

def path_acceptance(path: Sequence[int], acc: Sequence[Sequence[float]]) -> float:
    """Estimated probability that a tree path is accepted: Π_j acc[j][path[j]] (Medusa §2.3.3).

    Args:
        path: ranks, path[j] = which candidate (0 = top-1) of head j+1.
        acc: acc[j][r] = held-out probability that head j+1's rank-r candidate is the target's token.

    Raises:
        InputError: a path longer than the number of heads or a rank beyond the measured ones.
    """
    if len(path) > len(acc) or any(not 0 <= r < len(acc[j]) for j, r in enumerate(path)):
        raise InputError(f"Path {list(path)} does not fit {len(acc)} heads with "
                         f"{[len(a) for a in acc]} measured ranks.")
    out = 1.0
    for j, r in enumerate(path):
        out *= float(acc[j][r])
    return out


def best_paths(acc: Sequence[Sequence[float]], n: int) -> list[list[int]]:
    """The ``n`` paths of highest ``path_acceptance`` (Medusa §2.3.3's greedy construction), in
    breadth-first order (shorter first, then by rank).

    The set is closed under prefixes (every node's parent is in it): a path never scores above its
    prefix (each factor ≤ 1), and ties go to the shorter, lower-ranked path. Adding nodes in this order
    maximises the estimated expected acceptance length Σ_paths path_acceptance (each node adds its own
    estimate) for every size n.

    Raises:
        InputError: n < 0 or more than the possible paths.
    """
    total = sum(int(torch.tensor([len(a) for a in acc[:d]]).prod()) for d in range(1, len(acc) + 1))
    if not 0 <= n <= total:
        raise InputError(f"A tree of {n} nodes does not fit {total} possible paths.")
    chosen: list[list[int]] = []
    frontier = [[r] for r in range(len(acc[0]))] if acc else []
    while len(chosen) < n:
        frontier.sort(key=lambda p: (-path_acceptance(p, acc), len(p), p))
        best = frontier.pop(0)
        chosen.append(best)
        if len(best) < len(acc):
            frontier += [best + [r] for r in range(len(acc[len(best)]))]
    return sorted(chosen, key=lambda p: (len(p), p))


def expected_accepted(paths: Sequence[Sequence[int]], acc: Sequence[Sequence[float]]) -> float:
    """Estimated mean accepted draft tokens per round of a tree: Σ_paths path_acceptance (a node is on
    the accepted path iff its whole path is right; the events of one depth are disjoint)."""
    return sum(path_acceptance(p, acc) for p in paths)


def choose_tree(acc: Sequence[Sequence[float]], pass_cost: Sequence[float], max_nodes: int | None = None) -> dict:
    """Pick the tree size that maximises estimated tokens per unit of target-pass time.

    For each size n: the best n paths (``best_paths``); estimated tokens per round E_n = 1 + Σ path
    acceptances (the target adds one token of its own); a round's pass feeds n + 1 tokens (the nodes and
    the last round's correction or bonus token), costing ``pass_cost[n]`` (× one single-token step,
    measured). The chosen n maximises E_n / pass_cost[n].

    Args:
        acc: per-head top-r accuracies (see ``path_acceptance``).
        pass_cost: pass_cost[m − 1] = cost of a pass over m tokens relative to one token (m ≥ 1).
        max_nodes: largest tree considered (default: len(pass_cost) − 1).

    Returns:
        {"medusa_choices": paths, "nodes": n, "expected_tokens": E_n, "pass_cost": pass_cost[n],
        "score": E_n / pass_cost[n], "by_size": [{"nodes", "expected_tokens", "pass_cost", "score"}...]}.

    Raises:
        InputError: an empty cost curve.
    """
    if not pass_cost:
        raise InputError("choose_tree needs a measured pass cost for at least one token.")
    limit = len(pass_cost) - 1 if max_nodes is None else min(max_nodes, len(pass_cost) - 1)
    rows = []
    for n in range(0, limit + 1):
        paths = best_paths(acc, n)
        e = 1.0 + expected_accepted(paths, acc)
        rows.append({"nodes": n, "expected_tokens": round(e, 4), "pass_cost": float(pass_cost[n]),
                     "score": round(e / float(pass_cost[n]), 4), "paths": paths})
    best = max(rows, key=lambda r: (r["score"], -r["nodes"]))
    return {"medusa_choices": best["paths"], "nodes": best["nodes"], "expected_tokens": best["expected_tokens"],
            "pass_cost": best["pass_cost"], "score": best["score"],
            "by_size": [{k: v for k, v in r.items() if k != "paths"} for r in rows]}


def validate_choices(choices, n_heads: int) -> list[list[int]]:
    """Check a ``medusa_choices`` list: non-empty paths of ranks ≥ 0, at most ``n_heads`` long, distinct,
    each path's prefix present. Returns them in breadth-first order.

    Raises:
        InputError: for any violation.
    """
    try:
        paths = [[int(r) for r in p] for p in choices]
    except (TypeError, ValueError):
        raise InputError(f"medusa_choices must be a list of lists of ranks, got {choices!r}.") from None
    seen = {tuple(p) for p in paths}
    if len(seen) != len(paths):
        raise InputError("medusa_choices lists a path twice.")
    for p in paths:
        if not p or len(p) > n_heads or min(p) < 0:
            raise InputError(f"Path {p} must hold 1..{n_heads} ranks ≥ 0 (one per head).")
        if len(p) > 1 and tuple(p[:-1]) not in seen:
            raise InputError(f"Path {p} needs its prefix {p[:-1]} in the tree too.")
    return sorted(paths, key=lambda p: (len(p), p))


def tree_from_candidates(cand: torch.Tensor, choices: Sequence[Sequence[int]], vocab_size: int) -> TokenTree:
    """The static tree over one round's candidates (Medusa §2.3.1: the candidates of head k are the same
    for every parent, all heads read the same h_t).

    Args:
        cand: [K, r] target token ids, cand[k][i] = head k+1's rank-i candidate.
        choices: breadth-first paths (``validate_choices``), ranks < r.
        vocab_size: the target's vocabulary V (for the one-hot q rows).

    Returns:
        a deterministic ``TokenTree``: node i is path choices[i]; q rows one-hot on each token.
    """
    index = {tuple(p): i for i, p in enumerate(choices)}
    tokens, parents = [], []
    for p in choices:
        tokens.append(int(cand[len(p) - 1, p[-1]]))
        parents.append(index[tuple(p[:-1])] if len(p) > 1 else -1)
    q = torch.zeros(len(tokens), vocab_size)
    if tokens:
        q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return TokenTree(tokens, parents, q, draw="deterministic")
