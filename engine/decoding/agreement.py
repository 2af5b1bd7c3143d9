"""What the int8 arithmetic changes: the same model loaded with the "int8" and the "fp32" arithmetic
(``engine.decoding.compute.arithmetic``), compared on prompts.

Quantizing each product's activations to 8 bits per block of 32 (as llama.cpp does) changes the model's numbers: a
property of the compute path, never of speculative decoding, which stays lossless against whichever path runs the
target (each row of a pass is computed alone, so a verify pass gives every token the bits of a plain step). How much it
changes them is measured here, three ways:

- greedy texts: each prompt decoded greedily (plain decoding) on both arithmetics; identical texts, and the first
  generated position where they part;
- next-token agreement, teacher-forced: the fp32 arithmetic's own greedy continuation fed to both models in one pass,
  and at every position whether the two most likely next tokens agree (top-1 agreement), overall and by position;
- KL(p_fp32 ‖ p_int8) of the next-token distributions at those positions, in nats (mean and largest).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from engine.decoding.models import LoadedModel
from engine.decoding.speculative import generate

BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 256))
"""Generated positions (1-based) grouped for top-1 agreement by position."""


@dataclass
class ArithmeticAgreement:
    """The int8 arithmetic against the fp32 arithmetic on the same prompts (``compare_arithmetic``).

    Attributes:
        prompts: prompts compared. max_new_tokens: greedy tokens decoded per prompt.
        identical_texts: prompts whose greedy texts are token for token the same.
        first_divergence: per prompt, the first generated position (0-based) where the greedy tokens differ; None
            where they never do.
        positions: next-token distributions compared (teacher-forced on the fp32 text).
        top1: share of those positions where both arithmetics' most likely token is the same.
        top1_by_position: {"1-8": share, …}: the same by generated position (``BUCKETS``), where there were any.
        mean_kl, max_kl: KL(p_fp32 ‖ p_int8) in nats over those positions.
        texts: per prompt, {"fp32": text, "int8": text}.
    """

    prompts: int
    max_new_tokens: int
    identical_texts: int
    first_divergence: list
    positions: int
    top1: float
    top1_by_position: dict
    mean_kl: float
    max_kl: float
    texts: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One sentence for pages and notes."""
        parted = [d for d in self.first_divergence if d is not None]
        where = f", the others part at token {min(parted)}–{max(parted)}" if parted else ""
        return (f"{self.identical_texts} of {self.prompts} greedy texts identical to the fp32 arithmetic's{where}; the "
                f"most likely next token agrees at {100 * self.top1:.1f} % of {self.positions} positions, mean KL "
                f"{self.mean_kl:.4f} nats")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _next_token_logits(target: LoadedModel, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), vocab] fp32: the logits predicting each continuation token, in one pass."""
    ids = torch.tensor([prompt + continuation[:-1]], device=target.device) if continuation else None
    with torch.inference_mode():
        out = target.model(input_ids=ids, use_cache=False, logits_to_keep=len(continuation))
    return out.logits[0].float()


def compare_arithmetic(int8: LoadedModel, fp32: LoadedModel, prompts: list[list[int]], max_new_tokens: int = 64,
                       progress: Callable[[str, float], None] | None = None,
                       detokenize: Callable[[list[int]], str] | None = None) -> ArithmeticAgreement:
    """Compare two loads of one model, with the int8 and the fp32 arithmetic (see the module docstring).

    Args:
        int8, fp32: the same model loaded with each arithmetic (``load_model(..., arithmetic=...)``).
        prompts: token ids of each prompt (at least one, each non-empty).
        max_new_tokens: greedy tokens per prompt (≥ 1). progress: (message, fraction) per prompt.
        detokenize: ids → text for ``texts`` (default: the fp32 model's tokenizer).

    Raises:
        ValueError: no prompts, an empty prompt, or max_new_tokens < 1.
    """
    if not prompts or any(not p for p in prompts) or max_new_tokens < 1:
        raise ValueError("compare_arithmetic needs at least one non-empty prompt and max_new_tokens ≥ 1")
    decode = detokenize or (lambda ids: fp32.tokenizer.decode(ids, skip_special_tokens=True))
    identical, firsts, texts = 0, [], []
    agree, kls = [], []
    by_pos: dict[str, list[bool]] = {}
    for i, prompt in enumerate(prompts):
        if progress:
            progress(f"Comparing the int8 and fp32 arithmetic on prompt {i + 1} of {len(prompts)}…", i / len(prompts))
        a = generate(fp32, None, prompt, max_new_tokens=max_new_tokens).token_ids
        b = generate(int8, None, prompt, max_new_tokens=max_new_tokens).token_ids
        first = _first_difference(a, b)
        identical += first is None
        firsts.append(first)
        texts.append({"fp32": decode(a), "int8": decode(b)})
        if not a:
            continue
        la, lb = _next_token_logits(fp32, prompt, a), _next_token_logits(int8, prompt, a)
        lp, lq = torch.log_softmax(la.double(), -1), torch.log_softmax(lb.double(), -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        same = (la.argmax(-1) == lb.argmax(-1)).tolist()
        agree += same
        kls += [float(v) for v in kl]
        for pos, s in enumerate(same, start=1):
            for lo, hi in BUCKETS:
                if lo <= pos <= hi:
                    by_pos.setdefault(f"{lo}-{hi}", []).append(s)
    n = len(agree)
    return ArithmeticAgreement(
        prompts=len(prompts), max_new_tokens=max_new_tokens, identical_texts=identical, first_divergence=firsts,
        positions=n, top1=sum(agree) / n if n else math.nan,
        top1_by_position={k: round(sum(v) / len(v), 4) for k, v in by_pos.items()},
        mean_kl=sum(kls) / n if n else math.nan, max_kl=max(kls) if kls else math.nan, texts=texts)
