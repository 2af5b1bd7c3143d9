"""Speculative decoding: draft γ tokens, verify them in one target pass, keep the agreed prefix.

One round (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2):

1. Draft: the proposer gives k ≤ γ tokens x_1..x_k and the distributions q_1..q_k they came from.
2. Verify: one target pass over the uncached context plus x_1..x_k gives p_1..p_{k+1}.
3. Judge left to right (``engine.decoding.sampling``): greedy accepts x_i iff it is argmax p_i; sampling accepts
   with probability min(1, p_i(x_i)/q_i(x_i)). The first rejection is replaced by the target's
   correction; after k acceptances the target adds a bonus token from p_{k+1}.
4. KV rollback: both caches are cropped back to the kept prefix at the start of the next pass.

``SpeculativeDecoder`` runs rounds one at a time (the live page steps it); ``generate`` loops them.
With no proposer (baseline), each round is a plain decode step through the same KV-cache code.

Token trees (``tree`` > 0): the proposer drafts a ``TokenTree`` of at most ``tree`` nodes and depth ≤ γ
(``propose_tree``); step 2 is one target pass over the uncached context plus all nodes with a tree attention
mask, step 3 judges the tree from the roots down (``sampling.verify_tree_greedy`` / ``verify_tree_sampling``,
lossless; ``verify_tree_typical``, lossy), and step 4 gathers the accepted path's KV entries into place and
drops the rest (``engine.decoding.tree``).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from engine.decoding.models import LoadedModel
from engine.decoding.proposers import CachedLM, Proposer
from engine.decoding.sampling import (
    ACCEPT_RULES,
    MAX_GAMMA,
    SamplingConfig,
    argmax_rows,
    cumsum_rows,
    noise_seed,
    sample,
    top_k_rows,
    verify_chain,
    verify_greedy,
    verify_tree_greedy,
    verify_tree_gumbel,
    verify_tree_sampling,
    verify_tree_typical,
    warp_probs,
)
from engine.decoding.trace import AFTER_END, DraftPosition, Round, RunStats, TopToken, TreeNode, TreeTrace, run_stats
from engine.decoding.tree import MAX_TREE, check_tree_args, keep_accepted_path, tree_verify_pass
from engine.errors import InputError

MAX_NEW_TOKENS = 4096


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of a prompt; instruct models get their chat template (one user turn) when ``chat``.

    Raises:
        InputError: for an empty prompt.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("The prompt is empty: type something for the model to continue.")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt, add_special_tokens=True)]


_MEMOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer → {token id: text}, shared
_MEMOS_LOCK = threading.Lock()


class _TokenText:
    """Memoized text of single token ids (decoding is the costliest part of building a trace).

    The memo is one per tokenizer, shared by every decoder of it: in a room of 16 readers each reader's own memo
    missed on what the others had decoded already (~170 ``decode`` calls a 16-row pass, ~2 ms of its judging;
    Intel Xeon). A token's text depends only on the tokenizer, and a dict's get/set is atomic, so sharing it
    across the worker and the pages' threads is safe."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        try:
            with _MEMOS_LOCK:
                self.memo: dict[int, str] = _MEMOS.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that cannot be weakly referenced: a memo of its own
            self.memo = {}

    def __call__(self, token_id: int) -> str:
        s = self.memo.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
            self.memo[token_id] = s
        return s

    def top(self, probs: torch.Tensor, n: int = 5) -> list[TopToken]:
        """The n most probable tokens of a [V] distribution."""
        return self.top_rows(probs[None], n)[0]

    def top_rows(self, probs: torch.Tensor, n: int = 5) -> list[list[TopToken]]:
        """``top`` of each row of [R, V] ``probs``, in one topk call. Tokens of probability 0 are left out (a
        top-k = 2 distribution or a residual with two tokens lists two, not three more at 0)."""
        if probs.shape[0] == 0:
            return []
        vals, idx = top_k_rows(probs, n)
        return self.tops(vals.tolist(), idx.tolist())

    def tops(self, vals: list[list[float]], idx: list[list[int]]) -> list[list[TopToken]]:
        """The top lists of ``top_k_rows``'s values and indices (as lists), tokens of probability 0 left out."""
        return [[TopToken(i, self(i), v) for v, i in zip(vr, ir) if v > 0] for vr, ir in zip(vals, idx)]


def chain_positions(text: "_TokenText", draft: list[int], q: torch.Tensor, point_mass: bool, p: torch.Tensor,
                    verdict, n_kept: int, top_p: list[list[TopToken]]) -> list[DraftPosition]:
    """The ``DraftPosition`` records of a judged chain draft (shared by the single-sequence and batched rounds).

    Args:
        text: the decoder's memoized token text.
        draft: k draft ids; q: [k, V] their draft distributions; point_mass: q rows are one-hot.
        p: [k + 1, V] the target's distributions; verdict: the ``engine.decoding.sampling.Verdict``.
        n_kept: draft tokens the output keeps (fewer than accepted when an accepted EOS ended it).
        top_p: ``text.top_rows(p)``, the top-5 of each p row.
    """
    # a one-hot q has one token with q > 0: no need to search V for it
    top_q = [[TopToken(x, text(x), 1.0)] for x in draft] if point_mass else text.top_rows(q[:len(draft)])
    positions = []
    for i, x in enumerate(draft):
        if n_kept < verdict.n_accepted and i >= n_kept:
            verdict_s = AFTER_END
        elif i < verdict.n_accepted:
            verdict_s = "accepted"
        elif i == verdict.n_accepted:
            verdict_s = "rejected"
        else:
            verdict_s = "discarded"
        positions.append(DraftPosition(
            token_id=x, text=text(x), q=float(q[i, x]), p=float(p[i, x]),
            accept_prob=verdict.accept_probs[i] if i < len(verdict.accept_probs) else None,
            u=verdict.uniforms[i] if i < len(verdict.uniforms) else None,
            verdict=verdict_s, top_p=top_p[i], top_q=top_q[i]))
    return positions


def warp_together(rounds: list[tuple[SamplingConfig, torch.Tensor]], n_top: int = 5) -> list[tuple]:
    """What ``_chain_round`` computes from a round's logits before judging it, for several chain rounds at once: p,
    its top ``n_top`` per row, and the decision's input (greedy: the logits' argmax per row; sampled: ``sample``'s
    cdf of p's last row, the bonus token's). The rounds with equal sampling settings are warped in one ``warp_probs``
    call (float64 when sampled, float32 when greedy), their top lists taken in one ``top_k_rows`` call and their
    argmaxes or cdfs in one more.

    Why: a room's pass judges 16 rows; warping each row alone (a division, a softmax and a top-5 over 49 152
    entries, ~12 operations a row at a few µs each) took ~4.7 ms of a 40 ms pass on the AMD EPYC, against 2.7 ms
    grouped; a sampled row's cumulative sums another 0.1 ms. Every operation here works row by row (element-wise
    arithmetic, and softmax, topk, sort, cumsum and argmax along the last dimension), so a row's results are the bits
    of its lone call (tests/test_speculative.py checks it; ``engine.decoding.invariance`` checks whole rounds on the
    machine).

    Args:
        rounds: (sampling settings, logits [k + 1, V] float32 CPU) per round.

    Returns:
        per round: (p [k + 1, V], (top values, top indices): a list per row of p, argmax list or None, bonus cdf
        [V] float64 or None).
    """
    groups: dict[tuple, list[int]] = {}
    for i, (cfg, _) in enumerate(rounds):
        groups.setdefault((cfg.greedy, cfg.temperature, cfg.top_k, cfg.top_p), []).append(i)
    out: list = [None] * len(rounds)
    for members in groups.values():
        cfg = rounds[members[0]][0]
        logits = [rounds[i][1] for i in members]
        x = torch.cat(logits) if len(logits) > 1 else logits[0]
        p_all = warp_probs(x.double() if not cfg.greedy else x, cfg)
        vals, idx = top_k_rows(p_all, n_top)
        vals, idx = vals.tolist(), idx.tolist()
        ends = list(itertools.accumulate(lg.shape[0] for lg in logits))
        best = argmax_rows(x) if cfg.greedy else None
        cdfs = None if cfg.greedy else cumsum_rows(p_all[[e - 1 for e in ends]])
        for j, (i, end) in enumerate(zip(members, ends)):
            start = end - logits[j].shape[0]
            out[i] = (p_all[start:end], (vals[start:end], idx[start:end]),
                      best[start:end] if best is not None else None, cdfs[j] if cdfs is not None else None)
    return out


@dataclass
class GenerationResult:
    """A finished run: prompt and generated ids, text, rounds and statistics."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    rounds: list[Round]
    stats: RunStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "rounds": [r.to_dict() for r in self.rounds], "stats": self.stats.to_dict()}


@dataclass
class PendingPass:
    """A round (or a prefill) of one ``SpeculativeDecoder`` waiting for its target pass: what a scheduler
    (``engine.decoding.scheduler``) feeds for this sequence in a pass it shares with other sequences.

    Attributes:
        feed: the token ids to feed after the sequence's cache (``CachedLM.plan``); may be empty (the first
            round after a prefill without draft tokens: the prefill's logits decide it, no pass needed).
        n_fed_logits: logits wanted for the last positions of ``feed``.
        reused: [V] cached logits put before them (None when not reused).
        prefill: True for the prompt's own pass (no round is emitted).
        draft, q, point_mass, draft_ms, remaining, t_round, fuse_prefill, tokens_verified: the round's state
            between drafting and judging (as in ``SpeculativeDecoder._step_locked``).
    """

    feed: list[int]
    n_fed_logits: int
    reused: torch.Tensor | None
    prefill: bool = False
    draft: list[int] | None = None
    q: torch.Tensor | None = None
    point_mass: bool = False
    draft_ms: float = 0.0
    remaining: int = 0
    t_round: float = 0.0
    fuse_prefill: bool = False
    tokens_verified: int = 0
    choice: object | None = None


class SpeculativeDecoder:
    """Stateful speculative decoding of one sequence; ``step()`` runs one round.

    Args:
        target: the target model.
        proposer: where draft tokens come from; None for the baseline (plain decoding).
        prompt_ids: the prompt's token ids (see ``encode_prompt``).
        gamma: γ, draft tokens per round (1..64; ignored for the baseline).
        sampling: temperature / top-k / top-p, applied identically to p and q, and the sampling rule
            (``SamplingConfig.rule``): under "gumbel" every token is the target's Gumbel-max pick with noise keyed
            by (seed, position, token), so plain and speculative runs of one seed give the same tokens.
        seed: seeds the run's generator (draft sampling, uniforms, corrections) and, under the "gumbel" rule, the
            noise: same seed, same run.
        max_new_tokens: never exceeded, for any γ.
        stop_on_eos: stop after the target's EOS token (it is kept in the output).
        tree: 0 = chain drafts (γ tokens a round); N in 1..``MAX_TREE``: the proposer drafts a token tree of
            at most N nodes and depth ≤ γ each round (it must have ``propose_tree``: the draft head, prompt
            lookup), verified in one target pass.
        accept: the tree acceptance rule under sampling: "exact" (lossless, ``verify_tree_sampling``) or
            "typical" (Medusa's typical acceptance, LOSSY: the output no longer follows the target; tree runs
            only). Under greedy (T = 0) every run is judged greedily, exactly.

    Raises:
        InputError: empty prompt, γ out of range, max_new_tokens < 1, prompt + max_new_tokens
            longer than the target's context, a tree size out of range, a tree with a draft that cannot
            branch (or with no draft), an unknown acceptance rule, or typical acceptance with the "gumbel" rule.
    """

    def __init__(self, target: LoadedModel, proposer: Proposer | None, prompt_ids: list[int],
                 gamma: int = 4, sampling: SamplingConfig | None = None, seed: int = 0,
                 max_new_tokens: int = 64, stop_on_eos: bool = True, tree: int = 0, accept: str = "exact"):
        if not prompt_ids:
            raise InputError("The prompt is empty: type something for the model to continue.")
        if proposer is not None and not (isinstance(gamma, int) and 1 <= gamma <= MAX_GAMMA):
            raise InputError(f"γ (draft tokens per round) must be a whole number from 1 to {MAX_GAMMA}, got {gamma}.")
        if not (isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= MAX_NEW_TOKENS):
            raise InputError(f"max new tokens must be from 1 to {MAX_NEW_TOKENS}, got {max_new_tokens}.")
        if len(prompt_ids) + max_new_tokens > target.max_context:
            raise InputError(
                f"The prompt is {len(prompt_ids)} tokens; with {max_new_tokens} new tokens that exceeds "
                f"the model's context of {target.max_context} tokens. Shorten the prompt or the output.")
        check_tree_args(tree, proposer, accept)
        self.tree = tree
        self.accept = accept
        self.target = target
        self.proposer = proposer
        self.gamma = gamma if proposer is not None else 0
        self.sampling = sampling or SamplingConfig()
        if self.sampling.rule == "gumbel" and accept == "typical":
            raise InputError("Typical acceptance (lossy) and the drafter-invariant (gumbel) sampling rule exclude "
                             "each other: pick one.")
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self.stop_on_eos = stop_on_eos
        self.prompt_ids = list(prompt_ids)
        self.seq = list(prompt_ids)
        self.rounds: list[Round] = []
        self.generator = torch.Generator().manual_seed(seed)
        needs_hidden = bool(getattr(proposer, "needs_target_hidden", False))
        self.target_lm = CachedLM(target.model, target.device, keep_hidden=needs_hidden)
        if needs_hidden:
            proposer.attach(self.target_lm)
        self.text = _TokenText(target.tokenizer)
        self.eos = target.eos_token_ids if stop_on_eos else set()
        self.finished = False
        self.stop_reason: str | None = None
        self.prefill_ms = 0.0
        self.elapsed_ms = 0.0
        self._prefilled = False
        # one round at a time: a web page may start a new script run while the last one is still
        # inside step(); both must not touch the KV caches at once
        self.lock = threading.RLock()

    @property
    def new_ids(self) -> list[int]:
        return self.seq[len(self.prompt_ids):]

    def token_text(self, token_id: int) -> str:
        """The text of one token id (memoized decode, special tokens kept)."""
        return self.text(token_id)

    def prefill(self) -> None:
        """Process the prompt in the target now, in a pass of its own (timed as ``prefill_ms``). The
        pass's logits at the last prompt position give p for the first new token, so the first round
        feeds only its draft tokens (none: no target pass at all, as in plain ``generate``, whose
        prefill yields token 1).

        Optional: without it, the first ``step()`` fuses the prefill into its verify pass (prompt + draft
        tokens in one target pass, as transformers' assisted generation does) when the draft can
        propose from the prompt alone (prompt lookup, a draft model, early exit), and prefills
        separately first otherwise (plain decoding; a draft head, which reads the prompt's target
        features). Calling it early (e.g. when a page builds the decoder) keeps the prompt's cost out of
        the first round, at the price of one more target pass. Idempotent.
        """
        with self.lock:
            if not self._prefilled:
                self._prefill_locked()

    def _prefill_locked(self) -> None:
        t0 = time.perf_counter()
        if self.proposer is not None:
            self.proposer.reset()
        self.target_lm.logits_for(self.prompt_ids, 1)
        self.prefill_ms = (time.perf_counter() - t0) * 1000
        self.elapsed_ms += self.prefill_ms
        self._prefilled = True

    def step(self) -> Round:
        """Run one round (draft, one target pass, judge, emit) and return its trace record.

        Thread-safe: concurrent calls run one after the other.

        Raises:
            InputError: if the run has already finished.
        """
        with self.lock:
            return self._step_locked()

    def _step_locked(self) -> Round:
        if self.finished:
            raise InputError("This run is finished; press Reset (or start a new run) to generate again.")
        fuse_prefill = not self._prefilled and self.proposer is not None and not self.target_lm.keep_hidden
        if fuse_prefill:  # the verify pass below processes the prompt too
            self.proposer.reset()
            self._prefilled = True
        else:
            self.prefill()  # adds its own time to elapsed_ms
        # the round's clock starts after a separate prefill: started before it, the prefill counted twice in
        # total_ms (plain decoding and the draft head, when the first step prefilled), which lowered
        # their tokens/s and moved the measured speedup (benchmarks/bench_predict.py found it)
        t_round = time.perf_counter()
        cfg = self.sampling
        remaining = self.max_new_tokens - len(self.new_ids)
        k_max = min(self.gamma, remaining - 1)  # the target always adds one token of its own

        if self.tree and k_max > 0:
            return self._tree_round(t_round, fuse_prefill, k_max, remaining)

        # 1. draft
        t0 = time.perf_counter()
        prop = None
        if self.proposer is not None and k_max > 0:
            prop = self.proposer.propose(self.seq, k_max, cfg, self.generator)
            draft, q, point_mass = prop.tokens[:k_max], prop.q[:k_max], prop.point_mass
        else:
            draft, q, point_mass = [], torch.zeros(0), False
        draft_ms = (time.perf_counter() - t0) * 1000
        return self._chain_round(t_round, fuse_prefill, draft, q, point_mass, draft_ms, remaining,
                                 choice=prop.choice if prop is not None else None)

    # ---------------------------------------------------------------- a round in two halves (a scheduler's)
    @property
    def batchable(self) -> bool:
        """Chain rounds can share a target pass with other sequences; token-tree rounds run their own pass."""
        return not self.tree

    def draft_size(self, allow_draft: bool = True, prefill: bool = False) -> int:
        """How many tokens ``begin_pass`` with the same arguments would ask the proposer for now (0: it calls no
        ``propose``: a prefill, a token-tree round, no proposer, nothing left to draft, a finished run, or a
        prefill fused into the round). A scheduler drafts such rounds of several decoders together and hands
        each its proposal (``begin_pass(proposal=...)``)."""
        if self.finished or self.proposer is None or not allow_draft:
            return 0
        fuse_prefill = not self._prefilled and not self.target_lm.keep_hidden
        if not self._prefilled or fuse_prefill or prefill:
            return 0
        k_max = min(self.gamma, self.max_new_tokens - len(self.new_ids) - 1)
        return 0 if self.tree or k_max <= 0 else k_max

    def begin_pass(self, allow_draft: bool = True, prefill: bool = False, proposal=None,
                   draft_ms: float = 0.0) -> PendingPass | None:
        """First half of ``step()``: the prefill (when ``step()`` would prefill first) or the round's draft,
        and what its target pass must feed. The caller holds ``self.lock`` and then calls ``finish_pass``
        with the logits of that feed. Consumes the random generator exactly as ``step()`` does, so a round
        run in halves is the round ``step()`` runs (same draws in the same order).

        Args:
            allow_draft: False drafts nothing this round (a plain decoding step: an operator's load limit).
            prefill: the prompt's own pass, as ``prefill()`` runs it (never fused with a round).
            proposal: this round's draft, already made (a ``Proposal`` of the proposer for ``self.seq`` and
                ``draft_size(allow_draft)`` tokens, drawn from this decoder's generator: the proposer's
                ``propose_many``); None: ``begin_pass`` drafts itself.
            draft_ms: the time that draft took (with ``proposal``).

        Returns:
            None for a round that needs its own pass (a token tree: call ``step()``).

        Raises:
            InputError: if the run has already finished.
        """
        if self.finished:
            raise InputError("This run is finished; press Reset (or start a new run) to generate again.")
        fuse_prefill = not self._prefilled and self.proposer is not None and not self.target_lm.keep_hidden
        if not self._prefilled and (prefill or not fuse_prefill):
            if self.proposer is not None:
                self.proposer.reset()
            feed, n, reused = self.target_lm.plan(self.prompt_ids, 1)
            return PendingPass(feed, n, reused, prefill=True, t_round=time.perf_counter())
        remaining = self.max_new_tokens - len(self.new_ids)
        k_max = min(self.gamma, remaining - 1) if allow_draft else 0
        if self.tree and k_max > 0:
            return None
        if fuse_prefill:
            self.proposer.reset()
            self._prefilled = True
        t_round = time.perf_counter()
        t0 = time.perf_counter()
        if proposal is not None and k_max > 0:
            prop = proposal
        elif self.proposer is not None and k_max > 0:
            prop = self.proposer.propose(self.seq, k_max, self.sampling, self.generator)
        else:
            prop = None
        if prop is not None:
            draft, q, point_mass = prop.tokens[:k_max], prop.q[:k_max], prop.point_mass
        else:
            draft, q, point_mass = [], torch.zeros(0), False
        draft_ms = draft_ms if proposal is not None else (time.perf_counter() - t0) * 1000
        before = self.target_lm.cached_len
        feed, n, reused = self.target_lm.plan(self.seq + draft, len(draft) + 1)
        return PendingPass(feed, n, reused, draft=draft, q=q, point_mass=point_mass, draft_ms=draft_ms,
                           remaining=remaining, t_round=t_round, fuse_prefill=fuse_prefill,
                           tokens_verified=len(self.seq) + len(draft) - before,
                           choice=prop.choice if prop is not None else None)

    def pass_logits(self, pending: PendingPass, fed_logits: torch.Tensor | None) -> torch.Tensor:
        """The round's logits [k + 1, V] (float32 CPU): a reused row from the last pass, then the fed ones."""
        parts = ([pending.reused[None].cpu()] if pending.reused is not None else []) + (
            [fed_logits] if fed_logits is not None and pending.n_fed_logits else [])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def finish_pass(self, pending: PendingPass, fed_logits: torch.Tensor | None, pass_ms: float,
                    warped: tuple | None = None) -> Round | None:
        """Second half: judge and emit with the target's logits of the feed (the caller has already given the
        fed tokens' KV entries to ``self.target_lm``, ``CachedLM.absorb``). Returns the round, or None after a
        prefill.

        Args:
            fed_logits: [n_fed_logits, V] float32 CPU logits of the feed's last positions (None if nothing fed).
            pass_ms: the (shared) target pass's wall time, counted as this round's verify time.
            warped: this round's entry of ``warp_together`` over ``pass_logits`` (computed with other rows'), or
                None to warp here.
        """
        if pending.prefill:
            self.prefill_ms = pass_ms
            self.elapsed_ms += pass_ms
            self._prefilled = True
            return None
        logits = self.pass_logits(pending, fed_logits)
        return self._chain_round(pending.t_round, pending.fuse_prefill, pending.draft, pending.q,
                                 pending.point_mass, pending.draft_ms, pending.remaining,
                                 verified=(logits, pending.tokens_verified, pass_ms), warped=warped,
                                 choice=pending.choice)

    def _truncate(self, emitted: list[int], remaining: int) -> tuple[list[int], str | None]:
        """Cut the round's tokens after the first EOS and at ``remaining``; (tokens, stop reason)."""
        stop_reason = None
        for i, t in enumerate(emitted):
            if t in self.eos:
                emitted, stop_reason = emitted[:i + 1], "eos"
                break
        if len(emitted) >= remaining:
            emitted = emitted[:remaining]
            stop_reason = stop_reason or "max_new_tokens"
        return emitted, stop_reason

    def _finish_round(self, rnd: Round, t_round: float) -> Round:
        self.rounds.append(rnd)
        self.elapsed_ms += (time.perf_counter() - t_round) * 1000
        if rnd.stop_reason:
            self.finished, self.stop_reason = True, rnd.stop_reason
        return rnd

    def _chain_round(self, t_round: float, fuse_prefill: bool, draft: list[int], q: torch.Tensor,
                     point_mass: bool, draft_ms: float, remaining: int, verified=None, warped=None,
                     choice=None) -> Round:
        """Steps 2–4 of a chain round (see the module docstring) for the drafted tokens. ``verified``:
        (logits [k + 1, V], tokens fed, pass ms) of a target pass a scheduler ran for several sequences; ``warped``:
        their p and top lists from ``warp_together`` (the same bits as warping here)."""
        text = self.text
        cfg = self.sampling
        # 2. verify: one target pass over the uncached context + the k draft tokens
        t0 = time.perf_counter()
        k = len(draft)
        if verified is None:
            before = self.target_lm.cached_len
            logits = self.target_lm.logits_for(self.seq + draft, k + 1).cpu()
            tokens_verified = len(self.seq) + k - before
            shared_ms = 0.0
        else:
            logits, tokens_verified, shared_ms = verified
        if warped is None:
            p = warp_probs(logits.double() if not cfg.greedy else logits, cfg)
        else:
            p = warped[0]
        if cfg.greedy:
            verdict = verify_greedy(draft, argmax_rows(logits) if warped is None else warped[2])
        else:
            verdict = verify_chain(draft, q, p, cfg, self.generator, len(self.seq),
                                   None if warped is None else warped[3])
        verify_ms = (time.perf_counter() - t0) * 1000 + shared_ms
        if fuse_prefill:
            self.prefill_ms = verify_ms

        # 3. emit: accepted prefix + the target's own token, stopping at EOS / max_new_tokens
        emitted, stop_reason = self._truncate(draft[:verdict.n_accepted] + [verdict.next_token], remaining)
        context_len = len(self.seq)
        self.seq.extend(emitted)
        # 4. KV rollback: the target keeps the context and the accepted draft tokens (the correction or
        # bonus token is fed at the next pass); the draft drops what it drafted past the kept prefix
        self.target_lm.crop(context_len + min(verdict.n_accepted, len(emitted)))
        if self.proposer is not None:
            self.proposer.rollback(self.seq)

        # draft tokens the output keeps: an accepted end-of-sequence token inside the draft ends the output
        # there, and the draft tokens after it (accepted or not) are past the end, not part of α̂
        n_kept = min(verdict.n_accepted, len(emitted))
        top_p = text.top_rows(p) if warped is None else text.tops(*warped[1])
        positions = chain_positions(text, draft, q, point_mass, p, verdict, n_kept, top_p)
        kind = verdict.next_kind if k > 0 else "plain"
        rnd = Round(
            index=len(self.rounds), context_len=context_len, drafted=positions,
            n_accepted=n_kept, next_token_id=verdict.next_token,
            next_text=text(verdict.next_token), next_kind=kind,
            next_top_p=top_p[verdict.n_accepted],
            residual_top=text.top(verdict.residual) if verdict.residual is not None else None,
            emitted_ids=emitted, draft_ms=draft_ms, verify_ms=verify_ms,
            tokens_verified=tokens_verified, prefill_tokens=len(self.prompt_ids) if fuse_prefill else 0,
            stop_reason=stop_reason, choice=choice)
        return self._finish_round(rnd, t_round)

    def _tree_round(self, t_round: float, fuse_prefill: bool, max_depth: int, remaining: int) -> Round:
        """One tree round (the steps of ``_step_locked``, for a token tree): draft a tree, one target pass over
        the uncached context + all nodes, judge from the roots down, keep the accepted path's KV entries."""
        text = self.text
        cfg = self.sampling
        # 1. draft
        t0 = time.perf_counter()
        tree = self.proposer.propose_tree(self.seq, self.tree, max_depth, cfg, self.generator).pruned(max_depth)
        draft_ms = (time.perf_counter() - t0) * 1000
        if tree.size == 0:  # nothing to verify: a plain decoding step through the chain code
            return self._chain_round(t_round, fuse_prefill, [], torch.zeros(0), False, draft_ms, remaining)
        # 2. verify: one target pass over the uncached context + every node, with the tree mask
        t0 = time.perf_counter()
        context_len = len(self.seq)
        logits, tokens_verified = tree_verify_pass(self.target_lm, self.seq, tree)
        p = warp_probs(logits.double() if not cfg.greedy else logits, cfg)
        if cfg.greedy:
            verdict = verify_tree_greedy(tree.tokens, tree.parents, argmax_rows(logits))
        elif cfg.gumbel:
            verdict = verify_tree_gumbel(tree.tokens, tree.parents, p, noise_seed(self.generator), context_len)
        elif self.accept == "typical":
            verdict = verify_tree_typical(tree.tokens, tree.parents, p, self.generator)
        else:
            verdict = verify_tree_sampling(tree.tokens, tree.parents, tree.q, tree.draw, p, self.generator)
        path = verdict.path
        # 4. (before emitting: the cache must hold context + path whatever is emitted) keep the accepted path
        end = path[-1] if path else -1
        keep_accepted_path(self.target_lm, context_len, path, logits[end + 1])
        verify_ms = (time.perf_counter() - t0) * 1000
        if fuse_prefill:
            self.prefill_ms = verify_ms
        # 3. emit: the accepted path + the target's own token, stopping at EOS / max_new_tokens
        path_tokens = [tree.tokens[i] for i in path]
        emitted, stop_reason = self._truncate(path_tokens + [verdict.next_token], remaining)
        n_kept = min(len(path), len(emitted))
        self.seq.extend(emitted)
        self.target_lm.crop(context_len + n_kept)
        self.proposer.rollback(self.seq)

        # trace: every node (TreeTrace), and the path + its first rejected node as the chain's DraftPositions
        depths = tree.depths
        top_p_rows = text.top_rows(p[[par + 1 for par in tree.parents]])
        on_path = set(path)
        nodes = []
        for i, x in enumerate(tree.tokens):
            par = tree.parents[i]
            judged = verdict.accept_probs[i] is not None
            v = "accepted" if i in on_path else ("rejected" if judged else "unvisited")
            nodes.append(TreeNode(token_id=x, text=text(x), parent=par, depth=depths[i], q=float(tree.q[i, x]),
                                  p=float(p[par + 1, x]), accept_prob=verdict.accept_probs[i], u=verdict.uniforms[i],
                                  verdict=v, draft_prob=None if tree.draft_probs is None else tree.draft_probs[i]))
        rejected = [c for c in tree.children(end) if verdict.accept_probs[c] is not None]
        shown = path + rejected[:1]
        positions = []
        for j, i in enumerate(shown):
            x = tree.tokens[i]
            if j < len(path):
                verdict_s = AFTER_END if j >= n_kept else "accepted"
            else:
                verdict_s = "rejected"
            positions.append(DraftPosition(
                token_id=x, text=text(x), q=nodes[i].q, p=nodes[i].p, accept_prob=nodes[i].accept_prob,
                u=nodes[i].u, verdict=verdict_s, top_p=top_p_rows[i],
                top_q=[TopToken(x, text(x), 1.0)] if tree.draw == "deterministic" else text.top(tree.q[i])))
        rnd = Round(
            index=len(self.rounds), context_len=context_len, drafted=positions,
            n_accepted=n_kept, next_token_id=verdict.next_token, next_text=text(verdict.next_token),
            next_kind=verdict.next_kind, next_top_p=text.top(p[end + 1]),
            residual_top=text.top(verdict.residual) if verdict.residual is not None else None,
            emitted_ids=emitted, draft_ms=draft_ms, verify_ms=verify_ms, tokens_verified=tokens_verified,
            prefill_tokens=len(self.prompt_ids) if fuse_prefill else 0, stop_reason=stop_reason,
            tree=TreeTrace(nodes=nodes, accepted_path=path[:n_kept], rule=self._rule_name()))
        return self._finish_round(rnd, t_round)

    def _rule_name(self) -> str:
        if self.sampling.greedy:
            return "greedy"
        if self.sampling.gumbel:
            return "gumbel"
        return "typical (lossy)" if self.accept == "typical" else "exact"

    def run(self, on_round=None, should_stop=None) -> GenerationResult:
        """Step until finished. ``on_round(round, decoder)`` is called after each round;
        ``should_stop()`` returning True stops early (the result covers the rounds run so far)."""
        while not self.finished:
            if should_stop is not None and should_stop():
                break
            rnd = self.step()
            if on_round is not None:
                on_round(rnd, self)
        return self.result()

    def stats(self) -> RunStats:
        return run_stats(self.rounds, self.prefill_ms, self.elapsed_ms)

    def result(self) -> GenerationResult:
        tok = self.target.tokenizer
        return GenerationResult(
            prompt_ids=self.prompt_ids, token_ids=self.new_ids,
            text=tok.decode(self.new_ids, skip_special_tokens=True), rounds=self.rounds, stats=self.stats())


def generate(target: LoadedModel, proposer: Proposer | None, prompt_ids: list[int], gamma: int = 4,
             sampling: SamplingConfig | None = None, seed: int = 0, max_new_tokens: int = 64,
             stop_on_eos: bool = True, on_round=None, should_stop=None, tree: int = 0,
             accept: str = "exact") -> GenerationResult:
    """Run speculative decoding (or, with ``proposer=None``, plain decoding) to the end.

    See ``SpeculativeDecoder`` for arguments and errors.
    """
    dec = SpeculativeDecoder(target, proposer, prompt_ids, gamma=gamma, sampling=sampling, seed=seed,
                             max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos, tree=tree, accept=accept)
    return dec.run(on_round=on_round, should_stop=should_stop)
