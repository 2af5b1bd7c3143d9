"""The draft kinds a page offers and the decoders it builds from them (the Live and Race pages share them).

A page names a draft by its kind ("head", "ngram", …: ``DRAFT_KINDS``); ``make_draft`` turns a kind and its
settings into the engine's proposer (``engine.decoding.drafts.make_proposer``) and ``make_decoder`` into a fresh,
seeded ``SpeculativeDecoder`` (plain decoding with ``baseline=True``).
"""

from __future__ import annotations

from typing import Callable

from app.threads import in_passing_thread
from engine.decoding.block_drafter import check_block_size
from engine.decoding import drafts  # looked up at each call: tests replace drafts.make_proposer
from engine.decoding.drafts import EMBEDDED_AUTO
from engine.decoding.models import EMBEDDED_BLOCK, EMBEDDED_DRAFT, EMBEDDED_HEAD, EMBEDDED_MEDUSA, LoadedModel
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
from engine.errors import InputError

DRAFT_KINDS = {
    "head": "Trained draft head on the target's features (EAGLE-style, embedded)",
    "auto": "Prompt lookup where the text repeats, the draft head elsewhere (chosen per round, embedded)",
    "medusa": "Medusa heads: guesses for the next positions at once, as a token tree (embedded)",
    "block": "Block drafter: a whole block of guesses in one pass (DFlash-style, embedded)",
    "draft": "Trained small draft model (embedded)",
    "ngram": "Prompt lookup (n-gram)",
    "early-exit": "Early exit (target's first k layers)",
    "model": "Any draft model (HF id or local folder)",
}
"""Every draft kind a page offers, with its label."""

DRAFT_SHORT = {"head": "EAGLE-style head", "auto": "lookup + head", "medusa": "Medusa heads",
               "block": "DFlash-style block drafter",
               "draft": "small draft model", "ngram": "prompt lookup", "early-exit": "early exit",
               "model": "draft model"}
"""A short name of each draft kind (a lane's title)."""

TREE_BRANCH_DEFAULT = 4  # the engine's own default (the tree drafts' branching, as the CLI uses)


def draft_spec(kind: str, early_exit_k: int = 8, draft_model: str = "") -> str:
    """The engine's draft spec of a page's draft kind (what ``default_gamma_here`` and the command line read)."""
    return {"head": EMBEDDED_HEAD, "auto": EMBEDDED_AUTO, "medusa": EMBEDDED_MEDUSA, "block": EMBEDDED_BLOCK,
            "draft": EMBEDDED_DRAFT, "ngram": "ngram", "early-exit": f"early-exit:{early_exit_k}"}.get(kind, draft_model)


def target_layers(target: LoadedModel) -> int:
    """The target's decoder layers (0 when the model does not say)."""
    return len(getattr(getattr(target.model, "model", None), "layers", []))


def make_draft(kind: str, target: LoadedModel, *, early_exit_k: int = 8, draft_model: str = "", gamma: int = 4,
               confidence_gate: float = 0.0, load: Callable[[str], LoadedModel] | None = None,
               length: str | None = None):
    """The proposer of draft ``kind`` (a key of ``DRAFT_KINDS``) for ``target``.

    Args:
        early_exit_k: layers of the early-exit draft. draft_model: the "model" kind's HF id or folder.
        gamma: γ (the block drafter's block is γ + 1 slots, checked against its trained maximum).
        confidence_gate: the draft head's and block drafter's gate (0 = off).
        length: the draft length of the head and the combined draft ("adaptive": each round drafts 0..γ tokens
            by expected gain, ``engine.decoding.draft_length``; "fixed"; None: the draft's default); other kinds
            draft γ a round whatever it says.
        load: loads a draft model by spec (the page's cached loader; the "draft" and "model" kinds need it).

    Raises:
        InputError: an unknown kind, early exit on a target of fewer than 2 layers, no draft model typed, a block
        longer than the drafter was trained for; the engine's errors (ModelLoadError, TokenizerMismatchError).
    """
    if kind not in DRAFT_KINDS:
        raise InputError(f"Unknown draft kind {kind!r}; choose one of {', '.join(DRAFT_KINDS)}.")
    if kind == "ngram":
        return drafts.make_proposer("ngram", target)
    if kind == "early-exit":
        if target_layers(target) < 2:
            raise InputError("Early exit needs a target with at least 2 layers.")
        return drafts.make_proposer(f"early-exit:{early_exit_k}", target)
    if kind == "medusa":  # its shipped static tree (assets/smollm2-medusa), depth capped at γ
        return drafts.make_proposer(EMBEDDED_MEDUSA, target)
    if kind == "auto":
        return drafts.make_proposer(EMBEDDED_AUTO, target, length="adaptive")
    if kind == "head":
        proposer = drafts.make_proposer(EMBEDDED_HEAD, target, **({"length": length} if length else {}))
        proposer.confidence_threshold = confidence_gate
        return proposer
    if kind == "block":  # one drafter pass per round fills γ slots (assets/smollm2-block)
        proposer = drafts.make_proposer(EMBEDDED_BLOCK, target)
        check_block_size(gamma + 1, proposer.max_block)  # a clear message past the trained block
        proposer.confidence_threshold = confidence_gate
        return proposer
    spec = EMBEDDED_DRAFT if kind == "draft" else draft_model
    if not spec:
        raise InputError("Type a draft model: a Hugging Face id in the local cache or a local folder.")
    if load is None:
        raise InputError(f"The {DRAFT_KINDS[kind]} needs a model loader.")
    return drafts.make_proposer(spec, target, load(spec))


def make_decoder(target: LoadedModel, prompt: str, kind: str, *, baseline: bool = False, gamma: int = 4,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 max_new_tokens: int = 64, tree: int = 0, branching: int = TREE_BRANCH_DEFAULT,
                 accept: str = "exact", early_exit_k: int = 8, draft_model: str = "", confidence_gate: float = 0.0,
                 load: Callable[[str], LoadedModel] | None = None, rule: str = "standard",
                 length: str | None = None) -> SpeculativeDecoder:
    """A fresh, seeded decoder of ``prompt`` (one user turn, chat template applied) with draft ``kind``, or plain
    decoding with ``baseline``. Medusa heads draft their shipped static tree unless ``tree`` sets a size; a tree
    size > 0 drafts a token tree of at most that many nodes (``branching`` children a node). ``rule``: the sampling
    rule of a sampled run (``engine.decoding.sampling.SAMPLING_RULES``: "standard" or the drafter-invariant "gumbel").

    Raises:
        InputError (and the engine's SpeedupLabError subclasses) with a message for the reader: an empty prompt,
        settings out of range, a draft that cannot branch, the errors of ``make_draft``.
    """
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, rule=rule)
    ids = encode_prompt(target.tokenizer, prompt)
    # a draft's first load computes (its weights' exact compact forms): in a thread that ends, not the page's
    # (app.threads.in_passing_thread)
    proposer = None if baseline else in_passing_thread(
        lambda: make_draft(kind, target, early_exit_k=early_exit_k, draft_model=draft_model, gamma=gamma,
                           confidence_gate=confidence_gate, load=load, length=length))
    extra = {}
    n_tree = tree
    if kind == "medusa" and not n_tree and not baseline:
        n_tree = getattr(proposer, "tree_size", 0)  # Medusa heads: their shipped static tree unless a size is set
    if n_tree and not baseline:  # the engine raises InputError for a draft that cannot branch
        extra = {"tree": n_tree, "accept": accept}
        if tree and callable(getattr(proposer, "set_branching", None)):  # the head's top-k / lookup's matches
            proposer.set_branching(branching)  # InputError when out of range
    return SpeculativeDecoder(target, proposer, ids, gamma=gamma, sampling=sampling, seed=seed,
                              max_new_tokens=max_new_tokens, **extra)
