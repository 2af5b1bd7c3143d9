"""Small models for tests: random-initialized Llamas saved to disk, and exact bigram toy models.

The bigram models have known next-token distributions, so the exact joint distribution of the next
few tokens is a product of table entries; they plug into the engine like any transformers model.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from engine.decoding.models import LoadedModel


def make_tokenizer(words: list[str], eos: str = "<eos>"):
    """A word-level tokenizer over ``words`` (+ eos and unk), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {eos: 0, "<unk>": 1}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token="<unk>", pad_token=eos)


WORDS = [f"w{i}" for i in range(30)]


def save_tiny_llama(path: Path, vocab_size: int = 32, layers: int = 2, seed: int = 0, words=None,
                    init: float = 0.3, hidden: int = 32) -> Path:
    """Save a random Llama (hidden 32) with a word-level tokenizer into ``path``; return it.

    ``vocab_size`` may exceed the tokenizer's length (padded embedding rows, as sibling models do).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(words if words is not None else WORDS)
    assert vocab_size >= len(tok)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, initializer_range=init, eos_token_id=0,
                      pad_token_id=0, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class BigramLM(torch.nn.Module):
    """An exact toy LM: the next-token distribution depends only on the current token.

    ``table[a]`` is the probability vector of the token after ``a``. forward() returns log-probs as
    logits (so temperature 1 reproduces the table exactly) and ignores the KV cache argument.
    """

    def __init__(self, table: torch.Tensor, max_context: int = 8192):
        super().__init__()
        self.register_buffer("logtable", torch.log(table.double()).float())
        self.lm_head = torch.nn.Linear(1, table.shape[0], bias=False)
        self.config = SimpleNamespace(max_position_embeddings=max_context)
        self.generation_config = SimpleNamespace(eos_token_id=None)
        self.calls = 0

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, **kw):
        self.calls += 1
        logits = self.logtable[input_ids]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def save_q41_exact_llama(path, seed=0, **config):
    """A tiny Llama (hidden 64, so every input size is a multiple of 32; ``config``: LlamaConfig fields to set, e.g.
    biases) whose linear weights in the layers are exactly GGUF Q4_1 blocks (fp16 d and m, codes 0-15, d · q + m in
    fp32), saved to ``path`` with the tiny models' tokenizer."""
    from transformers import AutoConfig, LlamaForCausalLM

    save_tiny_llama(path, layers=2, seed=seed, hidden=64, init=0.2)
    cfg = AutoConfig.from_pretrained(str(path))
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "layers" in name:
                n, k = p.shape
                q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
                q[..., 3], q[..., 7] = 0, 15  # each block holds its minimum and maximum, as a quantizer's do
                d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
                m = (-7.5 * d).half().float()
                p.copy_((q * d[..., None] + m[..., None]).view(n, k))
            elif name.endswith("bias"):
                p.normal_(0, 0.1, generator=gen)
    model.save_pretrained(path)
    return path


def bigram_loaded(table: torch.Tensor, words: list[str] | None = None) -> LoadedModel:
    """Wrap a [V, V] bigram table as a LoadedModel with a matching word tokenizer.

    Token 0 is the tokenizer's EOS (generation stops on it unless ``stop_on_eos=False``).
    """
    v = table.shape[0]
    names = words or [f"t{i}" for i in range(v - 2)]
    tok = make_tokenizer(names)
    assert len(tok) == v, (len(tok), v)
    lm = LoadedModel(model=BigramLM(table), tokenizer=tok, name="bigram", spec="bigram",
                     device=torch.device("cpu"))
    return lm


def toy_cycle_table(v: int, peak: float, skip: int = 2) -> torch.Tensor:
    """The explainer's toy: after token a, token (a+1) gets weight ``peak``, all others weight 1.

    Ids 0 and 1 are reserved (eos, unk) and get weight 1 like the others; the cycle runs over all ids.
    """
    t = torch.ones(v, v, dtype=torch.float64)
    for a in range(v):
        t[a, (a + 1) % v] = peak
    return t / t.sum(-1, keepdim=True)
