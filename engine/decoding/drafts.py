"""The draft kinds' registry: a draft spec (what a reader picks, what ``--draft`` says) → a proposer.

One module knows every kind, so the proposer modules (``proposers`` for the draft model, early exit, the
EAGLE-style head and prompt lookup; ``medusa`` for Medusa heads; ``block_drafter`` for the DFlash-style
block drafter) never import each other. Specs:

- "none" / "baseline": plain decoding (no proposer);
- "ngram": prompt lookup; "early-exit:K": the target's first K layers;
- "embedded-head" or a folder with ``head_config.json``: the EAGLE-style head (``draft_head``);
- "embedded-auto": prompt lookup where the context repeats, the shipped head elsewhere, per round (``combined``);
- "embedded-medusa" or a folder with ``medusa_config.json``: Medusa heads (``medusa``);
- "embedded-block" or a folder with ``block_config.json``: the block drafter (``block_drafter``);
- anything else: a draft model (pass the loaded ``draft``).
"""

from __future__ import annotations

import weakref

import torch

from engine.decoding.block_drafter import BlockProposer, is_block_folder, load_block_drafter
from engine.decoding.draft_head import is_head_folder, load_head
from engine.decoding.medusa import MedusaProposer, choose_tree, is_medusa_folder, load_medusa
from engine.decoding.models import (EMBEDDED, EMBEDDED_BLOCK, EMBEDDED_BLOCK_DIR, EMBEDDED_HEAD, EMBEDDED_HEAD_DIR,
                                    EMBEDDED_MEDUSA, EMBEDDED_MEDUSA_DIR, LoadedModel)
from engine.decoding import pass_cost
from engine.decoding.proposers import (DraftModelProposer, EarlyExitProposer, FeatureHeadProposer,
                                       PromptLookupProposer, Proposer, output_vocab_size)
from engine.decoding.draft_length import check_policy, machine_rule
from engine.errors import InputError, ModelLoadError

EMBEDDED_AUTO = "embedded-auto"
"""The combined draft's spec: prompt lookup or the shipped head, per round (``engine.decoding.combined``)."""
ADAPTIVE_BY_DEFAULT = (EMBEDDED_HEAD, EMBEDDED_AUTO)
"""The draft specs whose rounds choose their length (``engine.decoding.draft_length``) unless told "fixed"."""


def default_length(kind: str) -> str:
    """The draft-length policy a spec gets by default: "adaptive" for the shipped head and the combined draft
    (``ADAPTIVE_BY_DEFAULT``), "fixed" (γ every round) for every other draft."""
    return "adaptive" if (kind or "").strip() in ADAPTIVE_BY_DEFAULT else "fixed"


def is_adaptive(proposer) -> bool:
    """Whether ``proposer``'s rounds choose their length (a length rule, or the combined draft)."""
    return getattr(proposer, "length_rule", None) is not None or getattr(proposer, "lookup_rule", None) is not None


def _head_prior(head) -> float | None:
    """The head's held-out first-token agreement from its config (``heldout_agreement.first``), or None."""
    try:
        v = float((getattr(head, "config", None) or {}).get("heldout_agreement", {}).get("first"))
    except (TypeError, ValueError, AttributeError):
        return None
    return v if 0 < v <= 1 else None

_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]]" = weakref.WeakKeyDictionary()


def _cached_head(folder: str, target_model: torch.nn.Module):
    """Load a draft head, Medusa heads or a block drafter once per (target model, folder) in this process
    (read-only while drafting)."""
    heads = _HEADS.setdefault(target_model, {})
    if folder not in heads:
        if is_medusa_folder(folder):
            heads[folder] = load_medusa(folder, target_model)
        elif is_block_folder(folder):
            heads[folder] = load_block_drafter(folder, target_model)
        else:
            heads[folder] = load_head(folder, target_model)
    return heads[folder]


def _block_proposer(kind: str, target: LoadedModel) -> BlockProposer:
    """The block drafter (``engine.decoding.block_drafter``): the shipped one ("embedded-block") or a folder."""
    shipped = kind == EMBEDDED_BLOCK
    folder = EMBEDDED_BLOCK_DIR if shipped else kind
    if shipped and target.spec != EMBEDDED:
        raise InputError("The shipped block drafter was trained for the embedded target only; pick another draft "
                         "for this target.")
    if not is_block_folder(folder):
        raise ModelLoadError(f"The shipped block drafter is missing from {folder}.")
    drafter = _cached_head(str(folder), target.model)
    label = "block drafter (DFlash-style)" if shipped else f"block drafter: {kind}"
    return BlockProposer(drafter, output_vocab_size(target), name=label)


def _medusa_proposer(kind: str, target: LoadedModel) -> Proposer:
    """Medusa heads (``engine.decoding.medusa``): the shipped ones ("embedded-medusa") or a folder; their
    saved static tree (set ``proposer.choices`` to another, [] for a chain)."""

    shipped = kind == EMBEDDED_MEDUSA
    folder = EMBEDDED_MEDUSA_DIR if shipped else kind
    if shipped and target.spec != EMBEDDED:
        raise InputError("The shipped Medusa heads were trained for the embedded target only; pick another "
                         "draft for this target.")
    if not is_medusa_folder(folder):
        raise ModelLoadError(f"The shipped Medusa heads are missing from {folder}.")
    heads = _cached_head(str(folder), target.model)
    label = f"Medusa heads ({heads.n_heads} heads)" if shipped else f"Medusa heads: {kind}"
    choices = _machine_medusa_tree(heads, target) if shipped else None
    return MedusaProposer(heads, output_vocab_size(target), choices=choices, name=label)


MEDUSA_MAX_TREE = 15
"""Largest static tree re-chosen for this machine (a pass over ≤ 16 tokens: ``pass_cost.SIZES``)."""


def _machine_medusa_tree(heads, target: LoadedModel):
    """The shipped heads' static tree re-chosen for this machine's measured pass cost (``medusa.choose_tree``
    from the heads' held-out accuracies, as ``train_medusa --choose-tree-only`` does), when this machine's
    curve was measured (``engine.decoding.pass_cost``); else None (the saved ``medusa_choices``)."""

    acc = heads.config.get("head_accuracy")
    curve = pass_cost.cached_pass_cost(target.spec, target.compute.path if target.compute else "default",
                             target.device.type)
    if not acc or curve is None:
        return None
    return choose_tree(acc, curve.ratios(MEDUSA_MAX_TREE + 1), MEDUSA_MAX_TREE)["medusa_choices"]


def make_proposer(kind: str, target: LoadedModel, draft: LoadedModel | None = None,
                  length: str | None = None) -> Proposer | None:
    """Build a proposer from a draft spec: "none", "ngram", "early-exit:K", "embedded-head" or a folder
    with a saved draft head (``engine.decoding.draft_head``), "embedded-auto" (prompt lookup or the shipped head
    per round, ``engine.decoding.combined``), "embedded-medusa" or a folder with saved
    Medusa heads (``engine.decoding.medusa``), "embedded-block" or a folder with a saved block drafter
    (``engine.decoding.block_drafter``), or a draft model (pass ``draft``).

    ``length``: "adaptive" (each round drafts 0..γ tokens, as many as the expected gain pays for:
    ``engine.decoding.draft_length``; a draft head or the combined draft), "fixed" (γ every round), or None for
    the spec's default (``default_length``: adaptive for "embedded-head" and "embedded-auto").

    Raises:
        InputError: for a malformed spec, an unknown length policy, "adaptive" for a draft other than a head or
        the combined one, "fixed" for the combined draft; TokenizerMismatchError for an incompatible draft model;
        ModelLoadError for a draft head that cannot be loaded for this target.
    """

    kind = (kind or "").strip()
    policy = check_policy(length) if length is not None else default_length(kind)
    if kind in ("none", "baseline"):
        return None
    if kind == EMBEDDED_AUTO:
        if policy != "adaptive":
            raise InputError("The combined draft (prompt lookup or the head, per round) chooses by expected gain: "
                             "its length is adaptive. For a fixed γ pick the head or prompt lookup.")
        from engine.decoding.combined import CombinedProposer

        head = make_proposer(EMBEDDED_HEAD, target, length="adaptive")
        return CombinedProposer(head, PromptLookupProposer(output_vocab_size(target), stop_ids=target.eos_token_ids))
    if policy == "adaptive" and not (kind == EMBEDDED_HEAD or is_head_folder(kind)):
        raise InputError(f"An adaptive draft length applies to a draft head ({EMBEDDED_HEAD} or a head folder) or "
                         f"{EMBEDDED_AUTO}, not {kind!r}; use a fixed γ.")
    if kind == EMBEDDED_MEDUSA or is_medusa_folder(kind):
        return _medusa_proposer(kind, target)
    if kind == EMBEDDED_BLOCK or is_block_folder(kind):
        return _block_proposer(kind, target)
    if kind == EMBEDDED_HEAD or is_head_folder(kind):
        folder = EMBEDDED_HEAD_DIR if kind == EMBEDDED_HEAD else kind
        if kind == EMBEDDED_HEAD and target.spec != EMBEDDED:
            raise InputError("The shipped draft head was trained for the embedded target only; pick "
                             "another draft for this target.")
        if not is_head_folder(folder):
            raise ModelLoadError(f"The shipped draft head is missing from {folder}.")
        head = _cached_head(str(folder), target.model)
        label = "trained draft head (EAGLE-style)" if kind == EMBEDDED_HEAD else f"draft head: {kind}"
        proposer = FeatureHeadProposer(head, target, name=label)
        if policy == "adaptive":
            proposer.length_rule = machine_rule(target, rate_prior=_head_prior(head))
            proposer.name = label + ", adaptive length"
        return proposer
    if kind == "ngram":
        # adaptive length: measured faster than a fixed γ on chat and code edits
        # (benchmarks/results/speculative_amd-epyc.md, "adaptive length" rows)
        return PromptLookupProposer(output_vocab_size(target), adaptive=True, stop_ids=target.eos_token_ids)
    if kind.startswith("early-exit"):
        try:
            k = int(kind.split(":", 1)[1])
        except (IndexError, ValueError):
            raise InputError(f"Write early exit as 'early-exit:K' with K layers, got {kind!r}.") from None
        return EarlyExitProposer(target, k)
    if draft is None:
        raise InputError(f"Draft {kind!r} needs a loaded draft model.")
    return DraftModelProposer(draft, target)
