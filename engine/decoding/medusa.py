"""Medusa-style multi-token heads on the target's own last hidden state (Cai et al. 2024).

Medusa ("MEDUSA: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", ICML 2024)
adds K extra heads to the target's last hidden state h_t. The target's own LM head gives token t+1; head
k (k = 1..K) predicts token t+k+1 from the *same* h_t, so one target pass yields guesses for K further
positions at once (no draft model runs autoregressively). The heads' top candidates per position are
combined into a static sparse tree and verified in one target pass with tree attention.

What we follow (the paper's section in brackets):

- the head (§2.1.1, eq. 1): p_t^(k) = softmax(W2^(k) · (SiLU(W1^(k) · h_t) + h_t)), a single residual
  block per head (``layers_per_head`` blocks stacked, as the reference code's ``medusa_num_layers``),
  with W1 initialised to zero so that every head starts out as the target's own LM head;
- Medusa-1 training (§2.2.1): the target is frozen; head k is trained with cross-entropy against the
  token at t+k+1 of the target's own answers (self-distillation, §2.3.2: the data are the target's own
  generations; optionally the soft top-k of the target's distribution there);
- the static sparse tree (§2.3.3): a set of paths ``medusa_choices`` (path [i1, ..., ik] = the i1-th
  candidate of head 1, then the i2-th of head 2, ...), chosen from held-out per-head top-i accuracies as
  the paths of highest estimated acceptance Π_j a_j(i_j) (``choose_tree``).

What we change, for a 135 M-parameter target on a 2-core CPU:

- W2 is not a trained copy of the LM head per head (49152 × 576 = 28 M parameters each): every head
  reuses the target's own LM head rows, frozen, restricted to a draft vocabulary of the most frequent
  answer ids (as the EAGLE-style head, ``engine.decoding.draft_head``). q is 0 on every other id, so
  acceptance is still judged on the full vocabulary; the saved heads hold only W1, its bias and
  ``vocab_ids``;
- the tree's size is picked with this CPU's measured verify cost per fed token (``choose_tree``:
  maximise estimated tokens per unit of pass time), not by the GPU-oriented rule of the paper.

Saved as a folder: ``medusa_config.json`` (format, sizes, target, the tree) + ``model.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.decoding.compute import apply_path, linear, path_of, prepare_weight
from engine.decoding.proposers import Proposal, Proposer
from engine.decoding.sampling import argmax_rows, draw_token, warp_probs
from engine.decoding.tree import (TokenTree, best_paths, choose_tree, expected_accepted,  # noqa: F401 - re-exported
                                  path_acceptance, tree_from_candidates, validate_choices)
from engine.errors import InputError, ModelLoadError

MEDUSA_FORMAT = "speedup-lab-medusa-heads/1"
MEDUSA_CONFIG = "medusa_config.json"


def is_medusa_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding saved Medusa heads (``medusa_config.json``)."""
    try:
        return (Path(path) / MEDUSA_CONFIG).is_file()
    except (OSError, TypeError, ValueError):
        return False


class ResBlock(nn.Module):
    """h + SiLU(W h + b) (Medusa §2.1.1, eq. 1; the reference code's ``ResBlock``). W starts at zero, so the
    block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """K Medusa heads. Call ``bind(target_model)`` before use (shares the target's LM head rows
    ``vocab_ids``; they are not parameters of the heads).

    Args:
        hidden_size: the target's hidden size H.
        n_heads: K ≥ 1; head k (1-based) predicts token t+k+1 from h_t.
        vocab_ids: [Vd] int64 target ids the heads can propose (sorted on construction).
        layers_per_head: residual blocks per head (≥ 1).

    Raises:
        InputError: for n_heads or layers_per_head < 1, or an empty vocabulary.
    """

    def __init__(self, hidden_size: int, n_heads: int, vocab_ids: torch.Tensor, layers_per_head: int = 1):
        super().__init__()
        if int(n_heads) < 1 or int(layers_per_head) < 1:
            raise InputError(f"Medusa needs at least one head of at least one block, got {n_heads} heads of "
                             f"{layers_per_head} block(s).")
        if vocab_ids.numel() == 0:
            raise InputError("The Medusa heads' draft vocabulary is empty.")
        self.hidden_size = int(hidden_size)
        self.n_heads = int(n_heads)
        self.layers_per_head = int(layers_per_head)
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(self.hidden_size) for _ in range(self.layers_per_head)])
            for _ in range(self.n_heads))
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).sort().values)
        self.head_weight: torch.Tensor | None = None
        self.config: dict = {}

    def bind(self, target_model: nn.Module) -> "MedusaHeads":
        """Share the rows ``vocab_ids`` of the target's LM head (frozen, in the heads' dtype)."""
        w = target_model.get_output_embeddings().weight.detach()
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor: it can hold its compact form
            self.head_weight = w[self.vocab_ids.to(w.device)].to(self.heads[0][0].linear.weight.dtype)
        prepare_weight(self.head_weight)  # read from its exact compact form on the "stream" path (compute/formats.py)
        return self

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] target features h_t → [K, ..., H] features for tokens t+2 .. t+K+1."""
        return torch.stack([head(h) for head in self.heads])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] h_t → [K, ..., Vd] logits over ``vocab_ids`` (the target's LM head rows).

        Raises:
            RuntimeError: ``bind`` was not called.
        """
        if self.head_weight is None:
            raise RuntimeError("MedusaHeads.bind(target_model) must be called first")
        return linear(self(h), self.head_weight)


# ----------------------------------------------------------------------------------------------- tree

def tree_of_size(heads: "MedusaHeads", n: int) -> list[list[int]]:
    """The best ``n``-node tree for saved heads: ``best_paths`` of their held-out accuracies
    (``config["head_accuracy"]``, written by ``engine.training.train_medusa``); [] for n = 0.

    Raises:
        InputError: n < 0, or heads without measured accuracies (n > 0).
    """
    if n < 0:
        raise InputError(f"A Medusa tree needs 0 or more nodes, got {n}.")
    if n == 0:
        return []
    acc = heads.config.get("head_accuracy")
    if not acc:
        raise InputError("These Medusa heads have no measured accuracies to build a tree of a chosen size from.")
    return best_paths(acc, n)


# ----------------------------------------------------------------------------------------- save / load

def save_medusa(heads: MedusaHeads, folder: str | Path, meta: dict | None = None) -> Path:
    """Write ``medusa_config.json`` and ``model.safetensors`` (fp16 W1 and biases, ``vocab_ids``).

    ``meta`` goes into the config (the tree as ``medusa_choices``, the target name, accuracies).

    Returns:
        the folder.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in heads.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    cfg = {"format": MEDUSA_FORMAT, "n_heads": heads.n_heads, "layers_per_head": heads.layers_per_head,
           "hidden_size": heads.hidden_size, "draft_vocab": int(heads.vocab_ids.numel()), **(meta or {})}
    (folder / MEDUSA_CONFIG).write_text(json.dumps(cfg, indent=1) + "\n")
    return folder


def load_medusa(folder: str | Path, target_model: nn.Module) -> MedusaHeads:
    """Load saved heads for ``target_model`` (cast to its dtype and device) and bind them. The tree is
    ``heads.config["medusa_choices"]`` (validated; [] when the folder has none).

    Raises:
        ModelLoadError: missing or unreadable files, another format, a hidden size or vocabulary that does
            not match the target, or an invalid tree.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"No Medusa heads at {str(folder)!r}: the folder does not exist.")
    try:
        cfg = json.loads((folder / MEDUSA_CONFIG).read_text())
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - OSError, JSON and safetensors errors all mean "unreadable"
        raise ModelLoadError(f"Cannot read the Medusa heads in {str(folder)!r}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != MEDUSA_FORMAT:
        fmt = cfg.get("format") if isinstance(cfg, dict) else None
        raise ModelLoadError(f"{str(folder)!r} holds heads of format {fmt!r}, expected {MEDUSA_FORMAT!r}.")
    if "vocab_ids" not in state or not all(k in cfg for k in ("hidden_size", "n_heads", "layers_per_head")):
        raise ModelLoadError(f"The Medusa heads in {str(folder)!r} lack vocab_ids, hidden_size, n_heads or "
                             f"layers_per_head.")
    hidden = int(target_model.config.hidden_size)
    if int(cfg["hidden_size"]) != hidden:
        raise ModelLoadError(f"The Medusa heads were trained for hidden size {cfg['hidden_size']} but the "
                             f"target's is {hidden}: they belong to another target.")
    vocab = target_model.get_output_embeddings().weight.shape[0]
    ids = state["vocab_ids"]
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise ModelLoadError("The Medusa heads' vocab_ids must be distinct ids of the target's vocabulary "
                             f"(0..{vocab - 1}): they belong to another target.")
    try:
        heads = MedusaHeads(hidden, int(cfg["n_heads"]), ids, int(cfg["layers_per_head"]))
        cfg["medusa_choices"] = validate_choices(cfg.get("medusa_choices", []), heads.n_heads)
    except InputError as e:
        raise ModelLoadError(f"The Medusa heads in {str(folder)!r} have an invalid config: {e}") from None
    param = next(target_model.parameters())
    missing, unexpected = heads.load_state_dict(
        {k: (v.to(param.dtype) if v.is_floating_point() else v) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"The Medusa heads in {str(folder)!r} do not match their config "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]}).")
    heads.to(device=param.device, dtype=param.dtype).eval()
    apply_path(heads, path_of(target_model))  # the target's compute path (engine/decoding/compute/)
    heads.config = cfg
    return heads.bind(target_model)


# ------------------------------------------------------------------------------------------- drafting

class MedusaProposer(Proposer):
    """Drafting with Medusa heads from the target's hidden state at the newest committed position.

    At the start of a round after the first the sequence is ``seq`` (length L) and the decoder's target
    ``CachedLM`` holds the last hidden state of positions 0..L−2 (the newest token, the last round's
    correction or bonus, is fed in the next pass). h_{L−2} is what the target's LM head read to produce
    token L−1, so head k (1-based) on h_{L−2} predicts token L−2+k+1 = the k-th draft position (Medusa
    §2.1.1: the LM head gives t+1, head k gives t+k+1). No model runs while drafting beyond the K small
    heads: one call per round.

    The first round (``round_zero``) is different: the prefill fed the whole prompt, so the target holds
    h_{L−1} and its logits at L−1 (``CachedLM.last_logits``) and the next token is not known yet. The heads
    were trained on t ≥ P − 1 only (``engine.training.train_medusa.make_examples``: from the last prompt
    position on), so h_{L−2}, the second-to-last prompt position, is outside what they learnt (there the
    shipped head 1 repeated the prompt's last token, '\n', which the target gives probability ~0). Round 0
    therefore drafts from h_{L−1}, the way Medusa's reference code starts its tree: draft position 1 is the
    target's own LM head on h_{L−1} (those logits came with the prefill; no extra pass), draft position
    k + 1 is head k on h_{L−1}. Position 1's q is the target's own warped distribution (chain) or a one-hot
    on its argmax (tree), so under greedy it is always accepted: a token the prefill computed anyway, shown
    in the trace with q = p.

    Two modes:

    - chain (``propose``; tree of size 0): draft position k is head k's argmax under greedy, or a draw
      from head k's warped distribution (the same temperature / top-k / top-p as p) under sampling; q is that
      distribution over ``vocab_ids``, zero elsewhere. Verified by the chain rule of
      ``engine.decoding.speculative`` (lossless);
    - tree (``propose_tree``): the static tree ``choices`` (``medusa_choices``; node [i1..id] is head d's
      rank-i_d candidate, children of the node [i1..i_{d−1}]); candidates ranked by the heads' logits, picked
      deterministically, so the ``TokenTree`` has draw "deterministic" and one-hot q rows: the tree rules'
      lossless sampling (``engine.decoding.sampling.verify_tree_sampling``) then accepts a child with the
      probability the residual target distribution gives it, whatever the heads believe.

    Args:
        heads: bound ``MedusaHeads``.
        target_vocab: the target's vocabulary V (q rows are [V]).
        choices: the static tree (default: the heads' saved ``medusa_choices``); [] = chain only.
        name: label for the UI.

    Raises:
        InputError: invalid ``choices`` (``validate_choices``), or ranks beyond the draft vocabulary.
    """

    needs_target_hidden = True

    def __init__(self, heads: MedusaHeads, target_vocab: int, choices=None, name: str = "Medusa heads"):
        self.heads = heads
        self.target_vocab = int(target_vocab)
        self.vocab_ids = heads.vocab_ids.cpu()
        self.target_lm = None
        self.choices = heads.config.get("medusa_choices", []) if choices is None else choices
        self.name = name

    @property
    def choices(self) -> list[list[int]]:
        return self._choices

    @choices.setter
    def choices(self, value) -> None:
        paths = validate_choices(value, self.heads.n_heads)
        if paths and max(max(p) for p in paths) >= self.vocab_ids.numel():
            raise InputError(f"The tree asks for ranks beyond the heads' {self.vocab_ids.numel()} candidates.")
        self._choices = paths

    @property
    def is_tree(self) -> bool:
        """Whether rounds draft a tree (``choices`` non-empty) rather than a chain."""
        return bool(self._choices)

    @property
    def tree_size(self) -> int:
        return len(self._choices)

    def attach(self, target_lm) -> None:
        if not target_lm.keep_hidden:
            raise ValueError("the target CachedLM must keep hidden states for Medusa heads")
        self.target_lm = target_lm

    def reset(self) -> None:
        """No state of its own: everything comes from the target's hidden states."""

    def rollback(self, seq: list[int]) -> None:
        """Nothing to roll back (the target's cache holds the hidden states)."""

    def round_zero(self, seq: list[int]) -> bool:
        """Whether the target has fed all of ``seq`` (its cache holds exactly ``seq`` and the logits of its last
        position): the first round after a prefill. Drafts then start from h_{len(seq)−1} (see the class)."""
        if self.target_lm is None:
            raise ValueError("MedusaProposer.attach(target_lm) was not called")
        lm = self.target_lm
        return (lm.last_logits is not None and lm.hidden is not None and lm.cached_len == len(seq) > 0
                and lm.hidden.shape[0] == len(seq) and lm.ids == list(seq))

    def _feature(self, seq: list[int]) -> torch.Tensor | None:
        if self.target_lm is None:
            raise ValueError("MedusaProposer.attach(target_lm) was not called")
        hidden = self.target_lm.hidden
        t = len(seq) - 1 if self.round_zero(seq) else len(seq) - 2
        if t < 0 or hidden is None or hidden.shape[0] <= t:
            return None
        return hidden[t]

    @torch.inference_mode()
    def head_logits(self, seq: list[int]) -> torch.Tensor | None:
        """[K, Vd] float32 CPU logits of every head at the position drafts start from: the newest committed
        position, or in the first round the prompt's last position (``round_zero``; None when the target holds
        no hidden state for it yet)."""
        h = self._feature(seq)
        return None if h is None else self.heads.logits(h).float().cpu()

    def root_logits(self, seq: list[int]) -> torch.Tensor | None:
        """[V] float32 CPU: the target's own logits for draft position 1 in the first round (``round_zero``,
        from the prefill), else None."""
        return self.target_lm.last_logits.float().cpu() if self.round_zero(seq) else None

    def _full_q(self, q_red: torch.Tensor) -> torch.Tensor:
        q = torch.zeros(q_red.shape[0], self.target_vocab)
        q[:, self.vocab_ids] = q_red
        return q

    def propose(self, seq: list[int], k: int, cfg, generator: torch.Generator):
        """A chain of up to min(k, K) draft tokens: head j's pick for draft position j (see the class); in the
        first round (``round_zero``) the target's own pick for position 1, then head j's for position j + 1.

        Returns:
            a ``Proposal`` (q: [n, V], each head's warped distribution over ``vocab_ids``; in the first round
            row 0 is the target's own warped distribution over all ids).
        """
        logits = self.head_logits(seq) if k > 0 else None
        if logits is None:
            return Proposal([], torch.zeros(0, self.target_vocab))
        tokens, rows = [], []
        root = self.root_logits(seq)
        if root is not None:
            # float64 as the verifier's p (speculative._chain_round warps the same logits in float64 under
            # sampling), so p = q on this row and min(1, p/q) = 1
            q0 = warp_probs(root.double(), cfg)
            tokens.append(argmax_rows(root)[0] if cfg.greedy else draw_token(q0, cfg, generator, len(seq)))
            rows.append(q0)
        n = min(k - len(tokens), self.heads.n_heads)
        for j in range(n):
            q_red = warp_probs(logits[j], cfg)
            i = argmax_rows(logits[j])[0] if cfg.greedy else draw_token(q_red, cfg, generator, len(seq) + len(tokens),
                                                                        self.vocab_ids)
            tokens.append(int(self.vocab_ids[i]))
            rows.append(self._full_q(q_red[None])[0].to(rows[0].dtype if rows else q_red.dtype))
        return Proposal(tokens, torch.stack(rows))

    def candidates(self, logits: torch.Tensor, ranks: int) -> torch.Tensor:
        """[K, ranks] target ids: each head's ``ranks`` highest-logit candidates, best first."""
        return self.vocab_ids[logits.topk(ranks, dim=-1).indices]

    def tree_paths(self, max_nodes: int, max_depth: int) -> list[list[int]]:
        """The static tree for a decoder asking for at most ``max_nodes`` nodes of depth ≤ ``max_depth``:
        the best such tree by the heads' held-out accuracies (``best_paths`` over the first ``max_depth``
        heads; for the saved size it is the saved ``medusa_choices``, which ``train_medusa`` chose the same
        way), or, for heads saved without accuracies, the saved tree's first ``max_nodes`` nodes of depth ≤
        ``max_depth`` in breadth-first order. Memoized per (max_nodes, max_depth)."""
        key = (int(max_nodes), int(max_depth))
        memo = self.__dict__.setdefault("_paths_memo", {})
        if key not in memo:
            acc = self.heads.config.get("head_accuracy")
            depth = max(0, min(key[1], self.heads.n_heads))
            if acc and depth and key[0] > 0:
                acc = [list(a)[:self.vocab_ids.numel()] for a in acc[:depth]]
                total = 0
                width = 1
                for a in acc:
                    width *= len(a)
                    total += width
                memo[key] = best_paths(acc, min(key[0], total))
            else:
                memo[key] = [p for p in self._choices if len(p) <= depth][:max(0, key[0])]
        return memo[key]

    def propose_tree(self, seq: list[int], max_nodes: int, max_depth: int, cfg=None,
                     generator: torch.Generator | None = None) -> TokenTree:
        """This round's static tree of at most ``max_nodes`` nodes and depth ≤ ``max_depth`` (the signature
        ``SpeculativeDecoder``'s tree rounds call; ``tree_paths`` picks the shape). ``cfg`` and
        ``generator`` are unused: the picks are deterministic under every sampling setting (see the class);
        ``draft_probs`` holds each head's softmax probability (T = 1) of its candidate, for display.

        Returns:
            a deterministic ``TokenTree`` (no nodes when the target holds no hidden state for the newest
            committed position yet: the round is a plain decoding step).
        """
        root = self.root_logits(seq)
        if root is not None:  # the first round: the target's own top-1 at depth 1, the heads' tree below it
            if max_nodes < 1 or max_depth < 1:
                return TokenTree([], [], torch.zeros(0, self.target_vocab))
            paths = self.tree_paths(max_nodes - 1, max_depth - 1)
        else:
            paths = self.tree_paths(max_nodes, max_depth)
        logits = self.head_logits(seq) if paths or root is not None else None
        if logits is None:
            return TokenTree([], [], torch.zeros(0, self.target_vocab))
        if paths:
            ranks = max(max(p) for p in paths) + 1
            top = logits.topk(ranks, dim=-1)
            tree = tree_from_candidates(self.vocab_ids[top.indices], paths, self.target_vocab)
            probs = torch.softmax(logits, -1).gather(-1, top.indices)
            draft_probs = [float(probs[len(p) - 1, p[-1]]) for p in paths]
        else:
            tree, draft_probs = TokenTree([], [], torch.zeros(0, self.target_vocab)), []
        if root is not None:
            x = argmax_rows(root)[0]
            q = torch.zeros(tree.size + 1, self.target_vocab)
            q[0, x] = 1.0
            if tree.size:
                q[1:] = tree.q
            tree = TokenTree([x] + tree.tokens, [-1] + [par + 1 if par >= 0 else 0 for par in tree.parents], q,
                             draw="deterministic")
            draft_probs = [float(torch.softmax(root, -1)[x])] + draft_probs
        tree.draft_probs = draft_probs
        return tree
