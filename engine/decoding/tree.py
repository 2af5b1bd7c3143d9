"""Token trees: several draft continuations verified in one target pass.

This module holds the tree type that tree drafts produce (EAGLE-2's dynamic tree from the draft head,
prompt lookup with several matches, Medusa heads' static tree) and the tree round verifies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decoding.attention import tree_depths, tree_visibility
from engine.errors import InputError

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
        draw: how siblings were chosen (one of ``DRAWS``).

    Raises:
        InputError: for lengths that disagree, a parent that is not an earlier node, or an unknown draw.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor
    draw: str = "deterministic"

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or self.q.shape[0] != len(self.tokens):
            raise InputError(f"A token tree needs one parent and one q row per node: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents, {self.q.shape[0]} q rows.")
        if self.draw not in DRAWS:
            raise InputError(f"Unknown draw {self.draw!r}; expected one of {', '.join(DRAWS)}.")
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
