"""Trace records of a speculative decoding run (JSON-serializable) and the run statistics.

A ``Round`` is one draft-then-verify cycle; ``RunStats`` aggregates rounds into the numbers the app
and the command line show (α̂, tokens per target pass, per-position acceptance, c, verify cost curve).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

AFTER_END = "after the end"
"""Verdict of draft positions after an accepted end-of-sequence draft token (the output ended there)."""


@dataclass
class TopToken:
    """One entry of a top-5 list: token id, its text, its probability."""

    id: int
    text: str
    prob: float


@dataclass
class DraftPosition:
    """One draft token as the verify pass judged it.

    Attributes:
        token_id, text: the draft token.
        q: the draft's probability of it (the distribution it was sampled from; 1.0 for prompt lookup).
        p: the target's probability of it at the same position.
        accept_prob: min(1, p/q) under sampling; 1 or 0 under greedy (argmax match); None if the
            position was never evaluated (after an earlier rejection).
        u: the uniform draw compared with accept_prob (sampling only).
        verdict: "accepted", "rejected", "discarded" (drafted after the first rejection) or
            ``AFTER_END`` (after an accepted end-of-sequence draft token, which ended the output: not
            part of the output, nor of α̂).
        top_p, top_q: the 5 most likely tokens under p and q at this position (for a one-hot q, as
            in prompt lookup, top_q is that one token).
    """

    token_id: int
    text: str
    q: float
    p: float
    accept_prob: float | None
    u: float | None
    verdict: str
    top_p: list[TopToken] = field(default_factory=list)
    top_q: list[TopToken] = field(default_factory=list)


TREE_VERDICTS = ("accepted", "rejected", "unvisited")
"""Verdicts of tree nodes: on the accepted path; judged and rejected (its parent was accepted); never judged
(its parent was not accepted, or a sibling was accepted first)."""


@dataclass
class TreeNode:
    """One node of a token tree as the verify pass judged it.

    Attributes:
        token_id, text: the node's token.
        parent: index of the parent node, −1 for a root (child of the last context token).
        depth: 1 for a root.
        q: the draft's probability of the token (the q row it was drawn from; 1.0 for a deterministic pick).
        p: the target's probability of the token at the parent's position.
        accept_prob: the acceptance probability the rule used when judging this node (1/0 under greedy),
            None if never judged.
        u: the uniform draw compared with it (sampling only).
        verdict: one of ``TREE_VERDICTS``.
        draft_prob: the draft's own probability of the token at its parent (``TokenTree.draft_probs``; a
            deterministic pick has q = 1 but the draft may have given it 0.3), None when the draft gives none.
    """

    token_id: int
    text: str
    parent: int
    depth: int
    q: float
    p: float
    accept_prob: float | None
    u: float | None
    verdict: str
    draft_prob: float | None = None


@dataclass
class TreeTrace:
    """A round's token tree: its nodes and the accepted path (node indices, root first).

    The verify pass's attention mask is ``engine.decoding.attention.tree_visibility`` of the parents.

    Attributes:
        nodes: every node, parents before children.
        accepted_path: the accepted path's nodes that the output kept (an accepted end-of-sequence token ends
            it; nodes after it stay "accepted" in ``nodes`` but are not kept).
        rule: how the tree was judged: "greedy", "exact" (lossless sampling, ``sampling.verify_tree_sampling``)
            or "typical (lossy)" (``sampling.verify_tree_typical``).
    """

    nodes: list[TreeNode]
    accepted_path: list[int]
    rule: str = "exact"

    @property
    def parents(self) -> list[int]:
        return [n.parent for n in self.nodes]


@dataclass
class Round:
    """One round: the draft phase, one target verify pass, and what was emitted.

    Attributes:
        index: 0-based round number.
        context_len: tokens in the sequence before the round (prompt + generated).
        drafted: the draft positions (may be empty: prompt lookup found nothing, or baseline mode).
        n_accepted: draft tokens kept in the output (when an accepted end-of-sequence draft token ended
            the output, the tokens after it are not counted: see ``ended_in_draft``).
        next_token_id, next_text: the target's own token (correction, bonus, or plain step); not
            emitted when ``ended_in_draft``.
        next_kind: "correction", "bonus" or "plain" (no draft tokens were proposed).
        next_top_p: top-5 of p at the position of the target's own token.
        residual_top: for a correction under sampling, the top-5 of norm(max(0, p − q)).
        emitted_ids: tokens appended this round (after EOS / max_new_tokens truncation).
        draft_ms, verify_ms: wall time of the draft phase and of the target pass, in ms.
        tokens_verified: tokens fed to the target in its pass (uncached context + draft tokens); 0 when
            the round needed no pass (the first round without draft tokens: p came with the prefill).
        prefill_tokens: prompt tokens among them: the first round's pass also prefilled the prompt
            (prefill fused into the verify pass); 0 otherwise. Such a pass is left out of the verify-time
            statistics (its time is mostly the prompt's).
        stop_reason: "eos", "max_new_tokens" or None.
        tree: for a tree draft, every node as the verify pass judged it (``TreeTrace``); ``drafted`` then
            lists the nodes of the accepted path and the first rejected node on it, so the chain statistics
            read the path. None for a chain draft.
        choice: how the round's draft length (and, for a combined draft, its drafter) was chosen
            (``engine.decoding.draft_length.LengthChoice``); None for a fixed γ.
    """

    index: int
    context_len: int
    drafted: list[DraftPosition]
    n_accepted: int
    next_token_id: int
    next_text: str
    next_kind: str
    next_top_p: list[TopToken]
    residual_top: list[TopToken] | None
    emitted_ids: list[int]
    draft_ms: float
    verify_ms: float
    tokens_verified: int
    prefill_tokens: int = 0
    stop_reason: str | None = None
    tree: "TreeTrace | None" = None
    choice: "object | None" = None

    @property
    def n_drafted(self) -> int:
        return len(self.drafted)

    @property
    def ended_in_draft(self) -> bool:
        """Whether an accepted end-of-sequence draft token ended the output, so that the target's own
        token (``next_token_id``) and the draft tokens after it were not emitted."""
        return self.stop_reason == "eos" and 0 < self.n_accepted == len(self.emitted_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["n_drafted"] = self.n_drafted
        d["ended_in_draft"] = self.ended_in_draft  # then next_token_id was drawn but not emitted
        if self.tree is not None:  # the tree at a glance: node token ids and parent indices
            d["tree"]["token_ids"] = [n.token_id for n in self.tree.nodes]
            d["tree"]["parents"] = self.tree.parents
        return d


@dataclass
class RunStats:
    """Aggregate statistics of a run.

    Attributes:
        rounds: number of target verify passes (one per round).
        new_tokens: tokens generated.
        drafted, accepted: draft tokens proposed / accepted over the run.
        judged: draft tokens the target judged (accepted + rejected; tokens drafted after a rejection
            are discarded unjudged).
        acceptance_rate: α̂ = accepted ÷ judged, the per-token acceptance probability α of the analytic
            model (Leviathan et al. 2023, §3.1; the maximum-likelihood estimate when each judged token
            is accepted independently with probability α). None if nothing was judged.
            For a token-tree run (``Round.tree``), each round's ``drafted`` is its accepted path plus the first
            rejected node on it, so α̂ is the per-depth acceptance: the chance that the accepted path grows by one
            more node, given it reached a node with children (any child accepted, not one particular token);
            ``drafted`` then counts path nodes, not all tree nodes (those are in ``Round.tree``).
        accepted_fraction: accepted ÷ drafted, the share of all draft tokens kept (what some engines
            call "draft acceptance rate"; lower than α because tokens after a rejection count too).
        target_passes: target forward passes of the run: one per round that fed tokens, plus the prompt's
            prefill when it ran as a pass of its own (plain decoding, the draft head, a decoder prefilled
            early) rather than fused into the first verify pass.
        tokens_per_target_pass: new tokens ÷ target_passes (bonus and corrections included). Plain
            decoding gives exactly 1 (its prefill pass yields the first token). Over a short run the prompt's own
            pass weighs much (one round of the draft head: 2 tokens ÷ 2 passes = 1.00), so the figure to set
            beside E is ``tokens_per_round``.
        tokens_per_round: new tokens ÷ rounds, each round one draft and one verify pass (the acceptance length
            plus the target's own token; plain decoding 1): what E = (1 − α^(γ+1)) / (1 − α) predicts
            (Leviathan et al. 2023, Eq. 1).
        acceptance_by_position: for draft position i (0-based), accepted ÷ times position i was
            evaluated, i.e. P(accept at i | all before accepted).
        draft_ms_per_token: draft time of all rounds ÷ draft tokens (ms per token; rounds that proposed
            nothing count with their time), leaving out the first round that drafted when later rounds
            drafted too: that round also runs the draft over the prompt (its prefill).
        verify_ms_mean: mean time of a target verify pass (ms), over rounds that ran one (a pass that
            also prefilled the prompt is not counted).
        verify_ms_median: median of the same passes (ms): one slow pass on a busy machine moves the mean
            far (500 ms against a 41 ms median was seen) and the median hardly.
        draft_cost_ratio: c = draft_ms_per_token ÷ verify_ms_median (the ``c`` of the analytic model:
            one draft step's time over one target pass's).
        verify_ms_by_tokens: median target-pass time (ms) by number of tokens fed in that pass.
        prefill_ms: time of the target pass that processed the prompt (ms); when the prefill was fused
            into the first verify pass, that pass's time (it includes the first round's draft tokens).
        total_ms: wall time of the whole generation, prefill included (ms).
        tokens_per_s: new_tokens ÷ total time.
        drafts: rounds that proposed at least one draft token (vLLM's ``num_drafts``).
        accepted_at_position: [γ_max] for draft position i (0-based), rounds whose draft token i was accepted,
            i.e. rounds with more than i accepted (vLLM's ``num_accepted_tokens_per_pos``); sums to ``accepted``.
        judged_at_position: [γ_max] times draft position i was judged (accepted or rejected); the denominators of
            ``acceptance_by_position``.
    """

    rounds: int
    new_tokens: int
    drafted: int
    accepted: int
    judged: int
    acceptance_rate: float | None
    accepted_fraction: float | None
    target_passes: int
    tokens_per_target_pass: float | None
    acceptance_by_position: list[float]
    draft_ms_per_token: float | None
    verify_ms_mean: float | None
    verify_ms_median: float | None
    draft_cost_ratio: float | None
    verify_ms_by_tokens: dict[int, float]
    prefill_ms: float
    total_ms: float
    tokens_per_s: float | None
    drafts: int = 0
    tokens_per_round: float | None = None
    accepted_at_position: list[int] = field(default_factory=list)
    judged_at_position: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verify_ms_by_tokens"] = {str(k): v for k, v in self.verify_ms_by_tokens.items()}
        return d


def run_stats(rounds: list[Round], prefill_ms: float, total_ms: float) -> RunStats:
    """Aggregate a list of rounds (see ``RunStats`` for each field's definition)."""
    new_tokens = sum(len(r.emitted_ids) for r in rounds)
    drafted = sum(r.n_drafted for r in rounds)
    accepted = sum(r.n_accepted for r in rounds)
    evaluated: dict[int, int] = {}
    kept: dict[int, int] = {}
    for r in rounds:
        for i, d in enumerate(r.drafted):
            if d.verdict in ("discarded", AFTER_END):
                break
            evaluated[i] = evaluated.get(i, 0) + 1
            kept[i] = kept.get(i, 0) + (d.verdict == "accepted")
    by_pos = [kept[i] / evaluated[i] for i in sorted(evaluated)]
    judged = sum(evaluated.values())
    # a round with no target pass (the first one, when the prefill pass already gave its p) is not a
    # pass; a pass that also prefilled the prompt is a prefill more than a verify pass
    passes = [r for r in rounds if r.tokens_verified > 0 and not r.prefill_tokens]
    verify = [r.verify_ms for r in passes]
    verify_mean = statistics.fmean(verify) if verify else None
    verify_median = statistics.median(verify) if verify else None
    # the prompt's prefill is a pass of its own unless a round fused it into its verify pass
    n_passes = sum(1 for r in rounds if r.tokens_verified > 0) + (
        0 if not rounds or any(r.prefill_tokens for r in rounds) else 1)
    # the first round that drafts also runs the draft over the whole prompt (the draft model's or early
    # exit's prefill, the head's pass over the prompt's features): like the target's prefill, it is not a
    # draft step, so c leaves that round out when later rounds drafted too
    drafting = [i for i, r in enumerate(rounds) if r.n_drafted]
    skip = drafting[0] if len(drafting) > 1 else None
    steady_ms = sum(r.draft_ms for i, r in enumerate(rounds) if i != skip)  # empty proposals cost time too
    steady_drafted = sum(r.n_drafted for i, r in enumerate(rounds) if i != skip)
    draft_per_tok = steady_ms / steady_drafted if steady_drafted else None
    by_tokens: dict[int, list[float]] = {}
    for r in passes:
        by_tokens.setdefault(r.tokens_verified, []).append(r.verify_ms)
    return RunStats(
        rounds=len(rounds),
        new_tokens=new_tokens,
        drafted=drafted,
        accepted=accepted,
        judged=judged,
        acceptance_rate=accepted / judged if judged else None,
        accepted_fraction=accepted / drafted if drafted else None,
        target_passes=n_passes,
        tokens_per_target_pass=new_tokens / n_passes if n_passes else None,
        tokens_per_round=new_tokens / len(rounds) if rounds else None,
        acceptance_by_position=by_pos,
        draft_ms_per_token=draft_per_tok,
        verify_ms_mean=verify_mean,
        verify_ms_median=verify_median,
        draft_cost_ratio=(draft_per_tok / verify_median) if (draft_per_tok is not None and verify_median) else None,
        verify_ms_by_tokens={n: statistics.median(v) for n, v in sorted(by_tokens.items())},
        prefill_ms=prefill_ms,
        total_ms=total_ms,
        tokens_per_s=new_tokens / (total_ms / 1000) if total_ms > 0 else None,
        drafts=sum(1 for r in rounds if r.n_drafted),
        accepted_at_position=[kept[i] for i in sorted(evaluated)],
        judged_at_position=[evaluated[i] for i in sorted(evaluated)],
    )


ORIGINS = ("accepted", "correction", "bonus", "plain")
"""Where a generated token came from: an accepted draft token, the target's correction at a rejected
position, the target's bonus token after a fully accepted draft, or a plain target step (no draft)."""


def token_origins(rounds: list[Round]) -> list[tuple[int, str]]:
    """Each generated token id with its origin (one of ``ORIGINS``), in order."""
    out: list[tuple[int, str]] = []
    for r in rounds:
        for i, t in enumerate(r.emitted_ids):
            out.append((t, "accepted" if i < r.n_accepted else r.next_kind))
    return out
