"""A block drafter in the style of DFlash: a whole block of draft tokens from ONE drafter pass.

DFlash (arXiv 2602.06036, "DFlash: block diffusion for flash speculative decoding") drafts with a small
non-causal transformer: the block ``[bonus, MASK × (B − 1)]`` (the token the target just produced, then B − 1
mask slots) is filled in one forward pass; the block positions attend to each other in both directions and to
the target's context features; the drafter reuses the target's token embeddings and its frozen LM head. A
sequential draft pays γ drafter steps per round; a block drafter pays one pass whatever the block length, so
long blocks (8–16) become affordable, and what decides acceptance is how well each slot guesses its token
without seeing the drafted tokens before it (only the other slots' hidden states).

Our drafter (all sizes for the embedded SmolLM2-135M, H = 576):

- context entries: c_i = fc(h_i) for every committed position i, h_i the target's last hidden state (after
  its final norm: what its LM head reads, the same feature the EAGLE-style head and the Medusa heads read).
  **What we change:** DFlash fuses hidden states from several target layers; we read the last layer only,
  the feature the engine already keeps from every verify pass (``proposers.CachedLM.hidden``), so the
  target's passes are unchanged. Entry i sits at position i and is kept in the drafter's KV cache;
- the block: the target's (frozen) embedding of the bonus token x_n at position n, then a learned mask
  embedding at positions n + 1 .. n + B − 1 (n = the number of context entries, so x_n is the newest token); each
  block input is fused with the newest context feature h_{n−1} (the one the target's LM head read to produce x_n):
  fuse([e; h_{n−1}]), 2H → H, as EAGLE's head fuses token and feature (Li et al. 2024, §3). **What we add:** DFlash
  reaches the context only through attention; with one layer and a few hundred thousand training tokens on this CPU,
  a first run where the slots had to find h_{n−1} by attention learnt slowly (slot-1 top-1 0.08 after an epoch);
- ``n_layers`` Llama decoder layers (transformers' ``LlamaModel``, final RMSNorm): context entries are causal
  among themselves; every block slot sees every context entry and every slot of its own block (bidirectional,
  the custom 4D mask of ``attention.model_mask``); one call feeds the new context entries and the block;
  the block's KV entries are cropped afterwards;
- slot j (1 ≤ j < B) predicts the token at its own position n + j through the target's LM head rows
  ``vocab_ids`` (a draft vocabulary; q = 0 on every other id, so acceptance is judged on all ids).

Drafting (``BlockProposer``): as a chain (slot j's argmax, or under sampling an independent draw from slot j's
warped distribution, which is then exactly q_j: the slots do not condition on each other's draws), verified by
the chain rule of ``engine.decoding.speculative`` (lossless); or as a static token tree (top-r candidates per
slot, the paths of highest held-out acceptance, Medusa §2.3.3's construction, ``tree.best_paths``), picked
deterministically, so the tree rules' lossless sampling applies (draw "deterministic", one-hot q rows).

Confidence cut (``confidence_threshold``, off by default): the chain stops before the first slot whose top
probability (softmax at T = 1) is below the threshold. DSpark (arXiv 2607.05147) trains a separate
confidence head that predicts each slot's survival; we use the drafter's own top probability instead
(EAGLE-2's signal, Li et al. 2024 §4), which needs no extra training. It depends only on the drafter's
state, so the output law is unchanged.

Saved as a folder: ``block_config.json`` (format, sizes, the largest block trained, held-out accuracies by
slot) + ``model.safetensors`` (fc, mask embedding, layers, norm, ``vocab_ids``; fp16).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from engine.decoding.attention import model_mask
from engine.decoding.compute import apply_path, linear, path_of, prepare_weight
from engine.decoding.draft_head import head_layer_config
from engine.decoding.proposers import Proposal, Proposer
from engine.decoding.sampling import argmax_rows, draw_token, warp_probs
from engine.decoding.tree import TokenTree, best_paths, empty_tree, tree_from_candidates
from engine.errors import InputError, ModelLoadError

BLOCK_FORMAT = "speedup-lab-block-drafter/1"
BLOCK_CONFIG = "block_config.json"


def is_block_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a saved block drafter (``block_config.json``)."""
    try:
        return (Path(path) / BLOCK_CONFIG).is_file()
    except (OSError, TypeError, ValueError):
        return False


def check_block_size(block: int, max_block: int) -> int:
    """A block length B (bonus token + B − 1 slots), checked: a whole number in 2..``max_block``.

    Raises:
        InputError: otherwise (γ = B − 1 draft tokens: γ 0 drafts nothing; past the trained maximum the
            drafter has never seen that many slots).
    """
    if isinstance(block, bool) or not isinstance(block, int) or not 2 <= block <= max_block:
        raise InputError(f"The block drafter fills blocks of 2 to {max_block} positions (γ = 1 to {max_block - 1} "
                         f"draft tokens, the largest block it was trained for), got a block of {block!r}.")
    return block


class BlockDrafter(nn.Module):
    """The DFlash-style block drafter (see the module docstring). Call ``bind(target_model)`` before use.

    Args:
        target_config: the target's config (Llama-style: hidden size, heads, RoPE).
        n_layers: decoder layers (≥ 1).
        max_block: the largest block B (bonus + B − 1 slots) it is trained for (≥ 2).
        vocab_ids: [Vd] int64 target ids it can propose (sorted on construction).

    Raises:
        InputError: n_layers < 1, max_block < 2 or an empty vocabulary.
    """

    def __init__(self, target_config, n_layers: int, max_block: int, vocab_ids: torch.Tensor):
        super().__init__()
        from transformers import LlamaModel

        if int(n_layers) < 1 or int(max_block) < 2 or vocab_ids.numel() == 0:
            raise InputError(f"A block drafter needs ≥ 1 layer, blocks of ≥ 2 positions and a non-empty draft "
                             f"vocabulary, got {n_layers} layer(s), block {max_block}, {vocab_ids.numel()} ids.")
        self.hidden_size = int(target_config.hidden_size)
        self.n_layers = int(n_layers)
        self.max_block = int(max_block)
        self.fc = nn.Linear(self.hidden_size, self.hidden_size)
        self.fuse = nn.Linear(2 * self.hidden_size, self.hidden_size)
        self.mask_embed = nn.Parameter(torch.zeros(self.hidden_size))
        self.body = LlamaModel(head_layer_config(target_config, n_layers))
        self.body.embed_tokens = None  # reads inputs_embeds; token embeddings are the target's
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).sort().values)
        self._target_embed: list[nn.Module] = []  # a list, so the target's module is not registered
        self.head_weight: torch.Tensor | None = None
        self.config: dict = {}

    def bind(self, target_model: nn.Module) -> "BlockDrafter":
        """Share the target's input embedding and the rows ``vocab_ids`` of its LM head (frozen)."""
        self._target_embed[:] = [target_model.get_input_embeddings()]
        w = target_model.get_output_embeddings().weight.detach()
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor: it can hold its compact form
            self.head_weight = w[self.vocab_ids.to(w.device)].to(self.fc.weight.dtype)
        prepare_weight(self.head_weight)  # read from its exact compact form on the "stream" path (compute/formats.py)
        return self

    def init_from_target(self, target_model: nn.Module) -> None:
        """Start the layers from the target's last ``n_layers`` layers, the norm from its final norm, fc as the
        identity, fuse as [½·I, I] (half the embedding plus the feature, the EAGLE-style head's start) and the mask
        embedding as the mean token embedding."""
        layers = target_model.model.layers
        for i, layer in enumerate(self.body.layers):
            layer.load_state_dict(layers[len(layers) - self.n_layers + i].state_dict())
        self.body.norm.load_state_dict(target_model.model.norm.state_dict())
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(self.hidden_size))
            self.fc.bias.zero_()
            H = self.hidden_size
            self.fuse.weight.zero_()
            self.fuse.weight[:, :H] = 0.5 * torch.eye(H)
            self.fuse.weight[:, H:] = torch.eye(H)
            self.fuse.bias.zero_()
            self.mask_embed.copy_(target_model.get_input_embeddings().weight.detach().mean(0))

    def block_inputs(self, bonus: torch.Tensor, block: int, last: torch.Tensor) -> torch.Tensor:
        """[N] bonus ids and [N, H] newest context features h_{n−1} → [N, block, H]: fuse([e; h_{n−1}]) for the bonus
        token's embedding e, then for ``block − 1`` mask embeddings.

        Raises:
            RuntimeError: ``bind`` was not called.
        """
        if not self._target_embed:
            raise RuntimeError("BlockDrafter.bind(target_model) must be called first")
        with torch.no_grad():
            e = self._target_embed[0](bonus).to(self.mask_embed.dtype)  # [N, H]
        masks = self.mask_embed.expand(bonus.shape[0], block - 1, -1)
        emb = torch.cat([e[:, None], masks], dim=1)
        return self.fuse(torch.cat([emb, last.to(emb.dtype)[:, None].expand(-1, block, -1)], dim=-1))

    def forward(self, embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache=None) -> torch.Tensor:
        """The drafter's body over already-built inputs.

        Args:
            embeds: [N, Q, H] inputs (context entries fc(h) and block inputs, in any order).
            attention_mask: the 4D mask of ``attention.model_mask`` ([N, 1, Q, cached + Q]).
            position_ids: [N, Q].
            cache: a transformers ``DynamicCache`` (updated in place) or None.

        Returns:
            [N, Q, H] post-norm features for the LM head rows.
        """
        out = self.body(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                        cache=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] → [..., Vd] logits over ``vocab_ids`` (the target's LM head rows)."""
        if self.head_weight is None:
            raise RuntimeError("BlockDrafter.bind(target_model) must be called first")
        return linear(features, self.head_weight)


# ----------------------------------------------------------------------------------------- save / load

def save_block_drafter(drafter: BlockDrafter, folder: str | Path, meta: dict | None = None) -> Path:
    """Write ``block_config.json`` and ``model.safetensors`` (fp16 weights, ``vocab_ids``).

    Returns:
        the folder.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    cfg = {"format": BLOCK_FORMAT, "n_layers": drafter.n_layers, "max_block": drafter.max_block,
           "hidden_size": drafter.hidden_size, "draft_vocab": int(drafter.vocab_ids.numel()), **(meta or {})}
    (folder / BLOCK_CONFIG).write_text(json.dumps(cfg, indent=1) + "\n")
    return folder


def load_block_drafter(folder: str | Path, target_model: nn.Module) -> BlockDrafter:
    """Load a saved block drafter for ``target_model`` (cast to its dtype and device, its compute path) and bind it.

    Raises:
        ModelLoadError: missing or unreadable files, another format, a config without sizes, a hidden size that
            differs from the target's, vocab ids outside the target's vocabulary, or weights that do not match.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / BLOCK_CONFIG).read_text())
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - OSError, JSON and safetensors errors all mean "unreadable"
        raise ModelLoadError(f"Cannot read the block drafter in {str(folder)!r}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != BLOCK_FORMAT:
        raise ModelLoadError(f"{str(folder)!r} holds a block drafter of format "
                             f"{cfg.get('format') if isinstance(cfg, dict) else None!r}, expected {BLOCK_FORMAT!r}.")
    if "vocab_ids" not in state or not all(k in cfg for k in ("hidden_size", "n_layers", "max_block")):
        raise ModelLoadError(f"The block drafter in {str(folder)!r} lacks vocab_ids, hidden_size, n_layers or "
                             f"max_block.")
    tcfg = target_model.config
    if int(cfg["hidden_size"]) != int(tcfg.hidden_size):
        raise ModelLoadError(f"The block drafter was trained for hidden size {cfg['hidden_size']} but the target's "
                             f"is {tcfg.hidden_size}: it belongs to another target.")
    vocab = target_model.get_output_embeddings().weight.shape[0]
    ids = state["vocab_ids"]
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise ModelLoadError("The block drafter's vocab_ids must be distinct ids of the target's vocabulary.")
    try:
        drafter = BlockDrafter(tcfg, int(cfg["n_layers"]), int(cfg["max_block"]), ids)
    except InputError as e:
        raise ModelLoadError(f"The block drafter in {str(folder)!r} has a bad config: {e}") from None
    param = next(target_model.parameters())
    missing, unexpected = drafter.load_state_dict(
        {k: (v.to(param.dtype) if v.is_floating_point() else v) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"The block drafter in {str(folder)!r} does not match its config "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]}).")
    drafter.to(device=param.device, dtype=param.dtype).eval()
    apply_path(drafter, path_of(target_model))  # the target's compute path (engine/decoding/compute/)
    drafter.config = cfg
    return drafter.bind(target_model)


def choose_block(accepted_by_gamma: dict, block_ms: dict, target_step_ms: float, pass_cost: list[float]) -> dict:
    """The block size B maximising estimated tokens per unit of time: E(B) / (c_block(B) + t(B)/t(1)), with
    E(B) = 1 + the mean accepted draft tokens with γ = B − 1 (held-out, ``slot_accuracy``), c_block(B) =
    block_ms[B] / target_step_ms, and t(B)/t(1) = pass_cost[B − 1] (this machine's target pass over B tokens
    ÷ one token). Sizes without a measured cost are skipped.

    Returns:
        {"block": B, "score": ..., "by_block": [{"block", "expected_tokens", "c_block", "verify", "score"}]}.

    Raises:
        InputError: no block size has both an accuracy and a cost.
    """
    rows = []
    for b, ms in sorted((int(k), v) for k, v in block_ms.items()):
        g = b - 1
        if str(g) not in {str(k) for k in accepted_by_gamma} or b > len(pass_cost):
            continue
        acc = {int(k): v for k, v in accepted_by_gamma.items()}[g]
        e = 1.0 + acc
        c = ms / target_step_ms
        v = float(pass_cost[b - 1])
        rows.append({"block": b, "expected_tokens": round(e, 4), "c_block": round(c, 4), "verify": round(v, 4),
                     "score": round(e / (c + v), 4)})
    if not rows:
        raise InputError("No block size has both a held-out accuracy and a measured cost.")
    best = max(rows, key=lambda r: (r["score"], -r["block"]))
    return {"block": best["block"], "score": best["score"], "by_block": rows}


def default_block_here(config: dict, pass_cost: list[float] | None = None) -> tuple[int, str]:
    """The block size B a saved drafter should use on this machine, and why.

    With this machine's target pass cost (``pass_cost``: t(m)/t(1) for m = 1.., from ``engine.decoding.pass_cost``):
    ``choose_block`` on the drafter's held-out acceptance (``accepted_by_gamma``) and its block-pass cost ratios
    measured when it was trained (``block_choice``: block_ms ÷ target_step_ms, a ratio of two passes on one machine).
    Without a curve, or for a drafter saved without these numbers: its saved ``default_block``, else 4.

    Returns:
        (B, one sentence saying where it comes from).
    """
    saved = int(config.get("default_block") or 4)
    acc, bc = config.get("accepted_by_gamma"), config.get("block_choice") or {}
    if pass_cost and acc and bc.get("block_ms") and bc.get("target_step_ms"):
        try:
            got = choose_block(acc, bc["block_ms"], float(bc["target_step_ms"]), list(pass_cost))
        except InputError:
            return saved, "the block size saved with the drafter"
        return got["block"], (f"the block size with the most expected tokens per unit of time on this machine's "
                              f"measured pass cost (estimated {got['score']:.2f}× plain decoding)")
    return saved, "the block size saved with the drafter (this machine's pass cost is not measured yet)"


# ------------------------------------------------------------------------------------------- drafting

class BlockProposer(Proposer):
    """Drafting with a ``BlockDrafter`` from the target's hidden states (see the module docstring).

    State: the drafter's KV cache over context entries c_i = fc(h_i) of committed positions (valid for the whole
    run; the block's entries are cropped after every pass). A round costs ONE drafter call: the context entries
    the target has verified since the last round, plus the block.

    Rounds: with n context entries (the target's hidden states of positions 0..n − 1; n = len(seq) − 1, the newest
    token x_n being the last round's correction or bonus token, or after the prefill the prompt's last token),
    the block is x_n then B − 1 slots; slot j's logits give draft position j (the token at n + j). The decoder's
    γ asks for B = γ + 1 (capped at the trained ``max_block``).

    Args:
        drafter: a bound ``BlockDrafter``.
        target_vocab: the target's vocabulary V (q rows are [V]).
        name: label for the UI.
        confidence_threshold: the confidence cut (0 = off; in [0, 1)).

    Raises:
        InputError: a threshold outside [0, 1).
    """

    needs_target_hidden = True

    def __init__(self, drafter: BlockDrafter, target_vocab: int, name: str = "block drafter",
                 confidence_threshold: float = 0.0):
        self.drafter = drafter
        self.target_vocab = int(target_vocab)
        self.vocab_ids = drafter.vocab_ids.cpu()
        self.name = name
        self.confidence_threshold = confidence_threshold
        self.target_lm = None
        self.last_block: dict | None = None  # the last pass: {"bonus", "start", "block", "tokens", "top_probs"}
        self.reset()

    @property
    def confidence_threshold(self) -> float:
        return self._confidence_threshold

    @confidence_threshold.setter
    def confidence_threshold(self, value: float) -> None:
        if not 0.0 <= float(value) < 1.0:
            raise InputError(f"The block drafter's confidence cut must be in [0, 1), got {value}.")
        self._confidence_threshold = float(value)

    @property
    def max_block(self) -> int:
        return self.drafter.max_block

    def attach(self, target_lm) -> None:
        if not target_lm.keep_hidden:
            raise ValueError("the target CachedLM must keep hidden states for a block drafter")
        self.target_lm = target_lm

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.n_ctx = 0  # context entries in the drafter's cache

    def rollback(self, seq: list[int]) -> None:
        """Nothing to do: the block's entries were cropped after the pass; context entries are of committed
        positions (a target cache cropped below them is noticed at the next round)."""

    @torch.inference_mode()
    def block_logits(self, seq: list[int], block: int) -> torch.Tensor | None:
        """One drafter pass: the new context entries, then the block ``[seq[-1], MASK × (block − 1)]``.

        Args:
            seq: the committed sequence (length L); the target must hold hidden states of positions 0..L − 2.
            block: B in 2..``max_block``.

        Returns:
            [B − 1, Vd] float32 CPU logits of slots 1..B − 1 (draft positions L .. L + B − 2), or None when the
            target does not yet hold the features of positions 0..L − 2 (the round is then a plain step).

        Raises:
            InputError: a block size outside 2..``max_block`` (``check_block_size``).
        """
        check_block_size(block, self.max_block)
        if self.target_lm is None:
            raise ValueError("BlockProposer.attach(target_lm) was not called")
        hidden = self.target_lm.hidden
        n = len(seq) - 1
        if n < 1 or hidden is None or hidden.shape[0] < n:
            return None
        if self.n_ctx > n:  # the target's cache was reset or cropped below what we hold
            self.reset()
        d = self.drafter
        dev = hidden.device
        held = self.n_ctx
        new = n - held
        ctx = d.fc(hidden[held:n].to(d.fc.weight.dtype))[None]  # [1, new, H]
        blk = d.block_inputs(torch.tensor([seq[n]], dtype=torch.long, device=dev), block, hidden[n - 1][None])
        q_len = new + block
        vis = torch.zeros(q_len, held + q_len, dtype=torch.bool)
        vis[:, :held] = True
        vis[:new, held:held + new] = torch.ones(new, new, dtype=torch.bool).tril()
        vis[new:, held:] = True  # block slots: every context entry and the whole block, both directions
        mask = model_mask(vis[None], d.body).to(dev)
        pos = torch.cat([torch.arange(held, n), torch.arange(n, n + block)])[None].to(dev)
        out = d(torch.cat([ctx, blk], dim=1), mask, pos, cache=self.cache)
        self.cache.crop(-block)  # keep the context entries only
        self.n_ctx = n
        return d.logits(out[0, new + 1:]).float().cpu()

    def propose(self, seq: list[int], k: int, cfg, generator: torch.Generator) -> Proposal:
        """A chain of up to min(k, ``max_block`` − 1) draft tokens from one block pass (see the class).

        Returns:
            a ``Proposal``; q: [n, V], slot j's warped distribution over ``vocab_ids`` (zero elsewhere).
        """
        b = min(int(k), self.max_block - 1) + 1
        logits = self.block_logits(seq, b) if k > 0 else None
        if logits is None:
            return Proposal([], torch.zeros(0, self.target_vocab))
        tokens, rows, tops = [], [], []
        for j in range(logits.shape[0]):
            top = float(torch.softmax(logits[j], -1).max())
            if self.confidence_threshold > 0 and top < self.confidence_threshold:
                break  # the confidence cut: this slot and those after it are not proposed
            q_red = warp_probs(logits[j], cfg)
            i = argmax_rows(logits[j])[0] if cfg.greedy else draw_token(q_red, cfg, generator, len(seq) + j,
                                                                        self.vocab_ids)
            q = torch.zeros(self.target_vocab, dtype=q_red.dtype)
            q[self.vocab_ids] = q_red
            tokens.append(int(self.vocab_ids[i]))
            rows.append(q)
            tops.append(top)
        self.last_block = {"bonus": int(seq[-1]), "start": len(seq), "block": b, "tokens": list(tokens),
                           "top_probs": tops, "cut": len(tokens) < b - 1}
        return Proposal(tokens, torch.stack(rows) if rows else torch.zeros(0, self.target_vocab))

    # ---------------------------------------------------------------------------------------- token trees

    def tree_paths(self, max_nodes: int, max_depth: int) -> list[list[int]]:
        """The static tree of at most ``max_nodes`` nodes of depth ≤ ``max_depth`` (≤ ``max_block`` − 1): the best
        paths by the drafter's held-out rank accuracies per slot (``config["slot_accuracy"]``, ``tree.best_paths``,
        Medusa §2.3.3); without them, the chain of top-1 candidates. Memoized.

        Raises:
            InputError: max_depth past the trained block (via ``check_block_size``).
        """
        depth = min(int(max_depth), self.max_block - 1)
        key = (int(max_nodes), depth)
        memo = self.__dict__.setdefault("_paths_memo", {})
        if key not in memo:
            acc = self.drafter.config.get("slot_accuracy")
            if max_nodes <= 0 or depth <= 0:
                memo[key] = []
            elif acc:
                acc = [list(a)[:self.vocab_ids.numel()] for a in acc[:depth]]
                total, width = 0, 1
                for a in acc:
                    width *= len(a)
                    total += width
                memo[key] = best_paths(acc, min(key[0], total))
            else:
                memo[key] = [[0] * d for d in range(1, min(key[0], depth) + 1)]
        return memo[key]

    def propose_tree(self, seq: list[int], max_nodes: int, max_depth: int, cfg=None,
                     generator: torch.Generator | None = None) -> TokenTree:
        """This round's static tree from one block pass: node [r1..rd] is slot d's rank-r_d candidate (the
        candidates of a slot are the same for every parent: the slots never see the drafted tokens). Picks are
        deterministic under every sampling setting (``cfg`` and ``generator`` unused), so the tree rules'
        lossless sampling applies; ``draft_probs`` holds each candidate's probability under its slot (T = 1).

        Returns:
            a deterministic ``TokenTree`` (empty when the target holds no features yet).
        """
        paths = self.tree_paths(max_nodes, max_depth)
        if not paths:
            return empty_tree(self.target_vocab)
        depth = max(len(p) for p in paths)
        logits = self.block_logits(seq, depth + 1)
        if logits is None:
            return empty_tree(self.target_vocab)
        ranks = max(max(p) for p in paths) + 1
        top = logits.topk(min(ranks, logits.shape[-1]), dim=-1)
        tree = tree_from_candidates(self.vocab_ids[top.indices], paths, self.target_vocab)
        probs = torch.softmax(logits, -1).gather(-1, top.indices)
        tree.draft_probs = [float(probs[len(p) - 1, p[-1]]) for p in paths]
        self.last_block = {"bonus": int(seq[-1]), "start": len(seq), "block": depth + 1,
                           "tokens": [int(self.vocab_ids[top.indices[j, 0]]) for j in range(depth)],
                           "top_probs": [float(probs[j, 0]) for j in range(depth)], "cut": False}
        return tree
