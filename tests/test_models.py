"""Model loading: embedded GGUF → cached safetensors, local folders, clear errors, tokenizer checks."""

import time

import pytest
import torch

from engine.decoding.models import (
    check_tokenizers_compatible,
    embedded_gguf_path,
    load_model,
    load_tokenizer,
    prepare_embedded,
    resolve_dtype,
)
from engine.errors import ModelLoadError, TokenizerMismatchError
from tests.tiny_models import WORDS, make_tokenizer, save_tiny_llama


def test_local_folder_loads(tmp_path):
    lm = load_model(str(save_tiny_llama(tmp_path / "m", vocab_size=40)), device="cpu")
    assert lm.model.dtype == torch.float32 and lm.device.type == "cpu"
    assert lm.eos_token_ids == {0}
    assert lm.model.get_output_embeddings().weight.shape[0] == 40  # padded beyond len(tokenizer)
    assert "run in" not in lm.name
    half = load_model(str(tmp_path / "m"), device="cpu", dtype="bf16")
    assert half.model.dtype == torch.bfloat16 and half.name.endswith(", run in bfloat16")


def test_tokenizer_check():
    a, b = make_tokenizer(WORDS), make_tokenizer(WORDS)
    check_tokenizers_compatible(a, b)  # identical: no error
    # a draft with extra tokens at the end (a longer vocabulary) still shares every target id
    check_tokenizers_compatible(a, make_tokenizer(WORDS + ["extra1", "extra2"]))
    with pytest.raises(TokenizerMismatchError, match="id 2"):
        check_tokenizers_compatible(a, make_tokenizer(list(reversed(WORDS))))
    with pytest.raises(TokenizerMismatchError):
        check_tokenizers_compatible(a, make_tokenizer(WORDS, eos="</s>"))


def test_tokenizer_check_is_remembered_per_pair(monkeypatch):
    """A pair that passed is not checked again (building a proposer per run must not re-read two
    49 k-token vocabularies); a mismatching pair still raises every time; a new pair is checked."""
    import engine.decoding.models as models

    a, b, bad = make_tokenizer(WORDS), make_tokenizer(WORDS), make_tokenizer(list(reversed(WORDS)))
    calls = []
    full = models._check_tokenizers
    monkeypatch.setattr(models, "_check_tokenizers", lambda t, d: (calls.append((t, d)), full(t, d)))
    check_tokenizers_compatible(a, b)
    check_tokenizers_compatible(a, b)
    assert calls == [(a, b)]
    check_tokenizers_compatible(a, a)  # the same object: nothing to compare
    assert len(calls) == 1
    for _ in range(2):
        with pytest.raises(TokenizerMismatchError):
            check_tokenizers_compatible(a, bad)
    assert len(calls) == 3
    check_tokenizers_compatible(b, a)  # the other direction is another pair
    assert len(calls) == 4


def test_dtype_names():
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.float32  # exactness first, also on a GPU
    assert resolve_dtype("bf16", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", torch.device("cuda")) == torch.float16
    with pytest.raises(ModelLoadError, match="dtype"):
        resolve_dtype("fp7", torch.device("cpu"))


def test_embedded_gguf_is_shipped():
    p = embedded_gguf_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.stat().st_size > 50_000_000


@pytest.mark.slow
def test_embedded_cached_load_is_fast_and_correct(embedded):
    folder = prepare_embedded()
    assert (folder / "model.safetensors").is_file()
    times = []
    for _ in range(2):  # the faster of two loads: the suite's other work on a 2-core machine slows one load at times
        t0 = time.perf_counter()
        again = load_model("embedded", device="cpu")
        times.append(time.perf_counter() - t0)
    assert min(times) < 3.0, times  # a cached load takes under 3 s
    cfg = again.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 3, 49152)
    ids = again.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = again.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in again.tokenizer.decode(out[0, ids.shape[1]:])
    assert load_tokenizer("embedded").get_vocab() == again.tokenizer.get_vocab()


def test_load_progress_only_goes_forward(tmp_path, monkeypatch):
    """The first-time conversion reports 0–1 of its own; load_model scales it to 0–0.9 so its compute-path step
    (0.95) comes after it, never back (a load bar must not jump back)."""
    import engine.decoding.models as models

    folder = str(save_tiny_llama(tmp_path / "tiny", layers=1))

    def fake_prepare(progress):
        for msg, frac in (("Reading", 0.05), ("Dequantizing", 0.2), ("Saving", 0.8), ("ready", 1.0)):
            progress(msg, frac)
        return folder

    monkeypatch.setattr(models, "prepare_embedded", fake_prepare)
    seen = []
    models.load_model("embedded", device="cpu", compute="default", progress=lambda m, f: seen.append(f))
    assert seen[:4] == pytest.approx([0.045, 0.18, 0.72, 0.9]) and seen[-1] == 0.95
    assert seen == sorted(seen) and max(seen) <= 1.0
