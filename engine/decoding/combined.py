"""A combined draft: prompt lookup where the context repeats, the EAGLE-style head elsewhere, chosen per round.

Each round (``CombinedProposer.propose``):

1. Prompt lookup (``proposers.PromptLookupProposer.lookup``, no model, no draft cost worth counting: a scan of the
   context in Python, tens of µs against a target step of milliseconds) finds the continuation of the latest
   earlier match of the context's last tokens, if any. Its tokens' acceptance chance â_L is its running acceptance
   in this sequence (``draft_length.LengthRule.rate``, starting at ``draft_length.LOOKUP_PRIOR``); its best length
   k_L and expected speedup S_L = max_k E(k)/T(k) come from this machine's costs with c = 0
   (``draft_length.LengthRule.plan_flat``).
2. The head's expected speedup without calling it: S_H = max_k E(k)/T(k) at its running acceptance â_H
   (``LengthRule.rate``) and its measured step cost c.
3. Where lookup found a continuation and S_L ≥ S_H, the round drafts lookup's first k_L tokens (q a point mass on
   each); else the head drafts, its length chosen token by token from its confidence (``draft_length``). The round's
   ``Proposal.choice`` names the drafter and both expected speedups.

The choice depends only on the context and earlier rounds, never on this round's target pass, so the output law is
the target's (lossless; greedy: plain greedy's text). Prompt lookup pays on text that copies its context (code
edits, quoting, lists) and the head on free text: the README's measurements, 1.2–1.3× and ~1.1× plain on the AMD
EPYC. Serving engines combine drafts the same way (e.g. SGLang and vLLM serve n-gram and EAGLE drafts; the choice by
expected gain per round is ours, after the goodput model of vLLM's dynamic speculative decoding).
"""

from __future__ import annotations

import torch

from engine.decoding.draft_length import LOOKUP_PRIOR, LengthRule
from engine.decoding.proposers import CachedLM, FeatureHeadProposer, PromptLookupProposer, Proposal, Proposer
from engine.decoding.sampling import SamplingConfig

LOOKUP = "prompt lookup"
HEAD = "draft head"


class CombinedProposer(Proposer):
    """Prompt lookup or the draft head, per round, by expected speedup (see the module docstring).

    Args:
        head: the draft head's proposer; it must have a ``length_rule`` (its costs are the round's costs).
        lookup: a prompt-lookup proposer (its own adaptive length is not used: the rule chooses).
        name: the label pages and the command line show.

    Raises:
        ValueError: a head without a length rule.
    """

    needs_target_hidden = True

    def __init__(self, head: FeatureHeadProposer, lookup: PromptLookupProposer,
                 name: str = "prompt lookup + draft head (per round)"):
        if head.length_rule is None:
            raise ValueError("the combined draft needs the head's length rule (its costs and running acceptance)")
        self.head, self.lookup, self.name = head, lookup, name
        head.length_rule.source = HEAD
        costs = head.length_rule.costs
        from engine.decoding.draft_length import Costs

        self.lookup_rule = LengthRule(Costs(costs.ratios, 0.0, costs.source + "; prompt lookup: c = 0", costs.tolerance),
                                      source=LOOKUP, prior=LOOKUP_PRIOR)
        self.last_source: str | None = None

    def attach(self, target_lm: CachedLM) -> None:
        self.head.attach(target_lm)

    def reset(self) -> None:
        self.head.reset()
        self.lookup.reset()
        self.lookup_rule.reset()
        self.last_source = None

    def rollback(self, seq: list[int]) -> None:
        """Each rule learns from the round its draft drafted (the other has nothing pending)."""
        self.head.rollback(seq)
        self.lookup_rule.observe(seq)

    def expected(self, k_max: int) -> dict[str, tuple[int, float, float]]:
        """{draft: (best k, its expected speedup S, â)} at the drafts' running acceptance, for a round of at most
        ``k_max`` tokens (the lookup entry before its continuation is known: its length may still shorten it)."""
        h_rule = self.head.length_rule
        a_h, a_l = h_rule.rate(), self.lookup_rule.rate()
        k_h, s_h = h_rule.plan_flat(a_h, k_max)
        k_l, s_l = self.lookup_rule.plan_flat(a_l, k_max)
        return {HEAD: (k_h, s_h, a_h), LOOKUP: (k_l, s_l, a_l)}

    def _lookup_round(self, seq: list[int], k: int) -> tuple[Proposal | None, dict[str, float]]:
        """Steps 1–3 of the module docstring up to the choice: prompt lookup's proposal when it wins the round
        (else None: the head drafts), and the expected speedups compared."""
        cont = self.lookup.lookup(seq, k) if k > 0 else []
        est = self.expected(k)
        alternatives = {HEAD: round(est[HEAD][1], 4)}
        if cont:
            k_l, s_l = self.lookup_rule.plan_flat(est[LOOKUP][2], len(cont))
            alternatives[LOOKUP] = round(s_l, 4)
            if k_l > 0 and s_l >= est[HEAD][1]:
                tokens = cont[:k_l]
                rule = self.lookup_rule
                rule.start(len(cont))
                for _ in range(k_l + (k_l < len(cont))):  # the tokens taken, then what one more would give
                    rule.offer(1.0)
                choice = rule.finish(len(seq), tokens, None if k_l < len(cont) else
                                     ("gamma" if len(cont) >= k else "draft"), alternatives)
                q = torch.zeros(len(tokens), self.lookup.target_vocab)
                q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
                self.last_source = LOOKUP
                return Proposal(tokens, q, point_mass=True, choice=choice), alternatives
        self.last_source = HEAD
        return None, alternatives

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig, generator: torch.Generator) -> Proposal:
        prop, alternatives = self._lookup_round(seq, k)
        if prop is not None:
            return prop
        prop = self.head.propose(seq, k, cfg, generator)
        if prop.choice is not None:
            prop.choice.alternatives = alternatives
        return prop

    def batch_key(self):
        """Rows of combined drafts sharing one head draft together (``propose_many``)."""
        return ("combined", id(self.head.head))

    @staticmethod
    def propose_many(jobs: list[tuple["CombinedProposer", list[int], int, SamplingConfig, torch.Generator]]
                     ) -> list[Proposal]:
        """``propose`` of several sequences (a room's pass, ``engine.decoding.scheduler``): each row chooses its
        drafter as alone; the rows the head drafts for draft together (``FeatureHeadProposer.propose_many``: each
        row's tokens, q and length choice are the ones it gets alone where the batch-invariant kernel runs).

        Raises:
            ValueError: rows whose heads differ (``FeatureHeadProposer.propose_many``).
        """
        out: list[Proposal | None] = [None] * len(jobs)
        head_rows: list[tuple[int, dict]] = []
        for i, (p, seq, k, cfg, g) in enumerate(jobs):
            prop, alternatives = p._lookup_round(seq, k)
            if prop is not None:
                out[i] = prop
            else:
                head_rows.append((i, alternatives))
        props = FeatureHeadProposer.propose_many([(jobs[i][0].head, *jobs[i][1:]) for i, _ in head_rows])
        for (i, alternatives), prop in zip(head_rows, props):
            if prop.choice is not None:
                prop.choice.alternatives = alternatives
            out[i] = prop
        return out
