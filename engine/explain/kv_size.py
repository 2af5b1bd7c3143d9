"""KV-cache size for MHA, GQA, MQA, latent attention and sliding windows, and a decode-step roofline.

Everything the KV-cache page shows is computed here:

* how many bytes the KV cache holds per token, per sequence and for a batch;
* the same model with multi-head (MHA) and multi-query (MQA) attention, for comparison;
* how long a context or how large a batch fits in a GPU's memory after the weights;
* how many bytes a decode step reads (weights + KV cache), its FLOPs, and its time on a roofline;
* the batch size at which a decode step stops being memory-bound;
* a quick measurement of this machine's memory bandwidth and matmul throughput;
* a check against a real model: the bytes held by a ``DynamicCache`` after running it.

Sources of the formulas
-----------------------
* KV cache of multi-head attention: every layer stores one key and one value vector of ``head_dim``
  numbers per KV head per token (Vaswani et al. 2017, "Attention Is All You Need", §3.2.2).
* Multi-query attention, one shared KV head (Shazeer 2019, "Fast Transformer Decoding: One Write-Head
  is All You Need", §3); grouped-query attention, ``num_kv_heads`` groups of query heads (Ainslie et
  al. 2023, "GQA", §2.2). Both only change ``num_kv_heads`` in the formula.
* Multi-head latent attention caches a compressed vector of ``kv_lora_rank`` numbers plus a decoupled
  RoPE key of ``qk_rope_head_dim`` numbers per layer per token, shared by all heads (DeepSeek-AI 2024,
  "DeepSeek-V2", §2.1.2–2.1.3 and Table 1: ``(d_c + d_h^R) · l`` elements per token).
* Sliding-window attention: a layer attends to at most the last ``W`` tokens, so it needs only
  ``min(context, W)`` of them (Jiang et al. 2023, "Mistral 7B", §2 "Rolling buffer cache"); Gemma 2
  alternates local sliding-window layers and global layers (Gemma Team 2024, "Gemma 2", §2.2).
* Forward FLOPs per token ≈ 2 · parameters (Kaplan et al. 2020, "Scaling Laws for Neural Language
  Models", §2.1, Table 1), plus attention: ``q·kᵀ`` and ``p·v`` are each ``heads · head_dim · context``
  multiply-adds per layer, i.e. ``4 · layers · heads · head_dim · context`` FLOPs per token.
* Roofline: a kernel takes at least ``max(bytes / bandwidth, FLOPs / peak)`` (Williams, Waterman &
  Patterson 2009, "Roofline: an insightful visual performance model", Communications of the ACM).

Units: bytes are plain bytes (KiB = 1024 B, GB = 10⁹ B as in datasheets), times are milliseconds,
lengths are tokens, bandwidth is bytes/s and peak throughput FLOP/s.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from engine.errors import InputError

# --------------------------------------------------------------------------------------------------
# Data types

DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int4": 0.5}
"""Bytes per stored number. int4 packs two numbers per byte (scales/zero points are not counted)."""

KV_DTYPES = ("fp32", "bf16", "fp8", "int4")
WEIGHT_DTYPES = ("fp32", "bf16", "fp8", "int4")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` ("fp32", "bf16", "fp16", "fp8", "int4").

    Raises:
        InputError: for an unknown name.
    """
    if dtype not in DTYPE_BYTES:
        raise InputError(f"Unknown data type {dtype!r}; use one of {', '.join(DTYPE_BYTES)}.")
    return DTYPE_BYTES[dtype]


# --------------------------------------------------------------------------------------------------
# Model description


@dataclass(frozen=True)
class ModelSpec:
    """The attention shape of a decoder-only transformer, as far as the KV cache cares.

    Attributes:
        name: display name.
        num_layers: decoder layers (``num_hidden_layers``).
        num_heads: query heads per layer (``num_attention_heads``).
        num_kv_heads: key/value heads per layer (``num_key_value_heads``): = num_heads for MHA,
            1 for MQA, in between for GQA. Must divide ``num_heads``.
        head_dim: numbers per head (the config's ``head_dim`` when it has one).
        hidden_size: model width (only used to estimate parameters and for display).
        params: total parameters (their bytes are the weights).
        active_params: parameters used per token (mixture-of-experts); None = ``params``.
        sliding_window: tokens a sliding-window layer attends to; 0 = no sliding window.
        sliding_layers: how many of the layers use the sliding window (the others are global).
        kv_lora_rank: latent attention (MLA): width of the cached compressed KV vector; 0 = not MLA.
        qk_rope_head_dim: latent attention: width of the cached decoupled RoPE key.
        source: where the numbers come from.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int = 0
    params: int = 0
    active_params: int | None = None
    sliding_window: int = 0
    sliding_layers: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    source: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        """"MLA", "MHA", "MQA" or "GQA"."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    @property
    def params_per_token(self) -> int:
        """Parameters each token runs through (``active_params`` for mixture-of-experts)."""
        return int(self.active_params if self.active_params else self.params)

    def as_kv_heads(self, num_kv_heads: int, name: str | None = None) -> "ModelSpec":
        """The same model with ``num_kv_heads`` KV heads and ordinary (not latent) attention."""
        return replace(self, num_kv_heads=num_kv_heads, kv_lora_rank=0, qk_rope_head_dim=0,
                       name=name or f"{self.name} ({num_kv_heads} KV heads)")


def validate(model: ModelSpec) -> None:
    """Check that ``model`` describes a possible transformer.

    Raises:
        InputError: naming the first problem (zero layers, KV heads that do not divide the query
        heads, a negative window, more sliding layers than layers, ...).
    """
    for attr, label in (("num_layers", "number of layers"), ("num_heads", "number of query heads"),
                        ("num_kv_heads", "number of KV heads"), ("head_dim", "head dimension")):
        v = getattr(model, attr)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"The {label} must be a whole number ≥ 1 (got {v!r}).")
    if model.num_kv_heads > model.num_heads:
        raise InputError(f"There are more KV heads ({model.num_kv_heads}) than query heads "
                         f"({model.num_heads}); each KV head must serve at least one query head.")
    if model.num_heads % model.num_kv_heads:
        raise InputError(f"{model.num_kv_heads} KV heads do not divide {model.num_heads} query heads: "
                         "grouped-query attention needs every group to hold the same number of query "
                         "heads.")
    if model.sliding_window < 0:
        raise InputError(f"The sliding window must be ≥ 0 tokens (0 = none); got {model.sliding_window}.")
    if not 0 <= model.sliding_layers <= model.num_layers:
        raise InputError(f"{model.sliding_layers} sliding-window layers is impossible with "
                         f"{model.num_layers} layers.")
    if model.kv_lora_rank < 0 or model.qk_rope_head_dim < 0:
        raise InputError("Latent-attention widths must be ≥ 0.")
    if model.params < 0 or (model.active_params is not None and model.active_params < 0):
        raise InputError("The parameter count must be ≥ 0.")


def _check_len(value: Any, label: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise InputError(f"The {label} must be a whole number (got {value!r}).")
    if value < minimum:
        raise InputError(f"The {label} must be ≥ {minimum} (got {int(value)}).")
    return int(value)


# --------------------------------------------------------------------------------------------------
# KV bytes


def kv_elements_per_token_per_layer(model: ModelSpec) -> int:
    """Numbers one layer caches for one token.

    * MHA/GQA/MQA: ``2 · num_kv_heads · head_dim`` (a key and a value per KV head).
    * MLA: ``kv_lora_rank + qk_rope_head_dim`` (DeepSeek-V2 §2.1.2–2.1.3, Table 1).

    Raises:
        InputError: if the model is invalid.
    """
    validate(model)
    if model.is_mla:
        return model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * model.num_kv_heads * model.head_dim


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "bf16") -> float:
    """KV bytes one token adds to one sequence while every layer still keeps it.

    ``layers · kv_elements_per_token_per_layer · bytes(kv_dtype)``; for Llama-3.1-8B in bf16:
    ``32 · 2 · 8 · 128 · 2 = 131072`` B = 128 KiB. Sliding-window layers stop growing once the
    window is full: see :func:`kv_bytes_per_sequence`.

    Raises:
        InputError: invalid model or dtype.
    """
    return model.num_layers * kv_elements_per_token_per_layer(model) * dtype_bytes(kv_dtype)


def cached_tokens(model: ModelSpec, context: int, between_steps: bool = False) -> tuple[int, int]:
    """Tokens held per layer for a ``context``-token sequence: (global layer, sliding layer).

    A sliding-window layer attends to ``min(context, W)`` tokens, the newest one included, so that is
    what a decode step holds and reads. Between steps only ``W − 1`` are needed (the next token
    brings its own key and value): transformers' ``DynamicSlidingWindowLayer`` keeps
    ``min(context, W − 1)``, which ``between_steps=True`` counts. Without a window both numbers
    equal ``context``.

    Raises:
        InputError: negative context.
    """
    context = _check_len(context, "sequence length", 0)
    if model.sliding_window > 0 and model.sliding_layers > 0:
        return context, min(context, model.sliding_window - (1 if between_steps else 0))
    return context, context


def kv_bytes_per_sequence(model: ModelSpec, context: int, kv_dtype: str = "bf16",
                          between_steps: bool = False) -> float:
    """KV-cache bytes of one sequence of ``context`` tokens.

    ``per_layer_token_bytes · (global_layers · context + sliding_layers · min(context, W))``.
    Gemma-2-9B at 8192 tokens in bf16: per layer and token ``2·8·256·2 = 8192`` B, so
    ``8192 · (21·8192 + 21·4096) = 2 113 929 216`` B. With ``between_steps`` the sliding layers
    count ``W − 1`` (what a transformers ``DynamicCache`` holds between steps; see
    :func:`cached_tokens`).

    Raises:
        InputError: invalid model, dtype or negative context.
    """
    per = kv_elements_per_token_per_layer(model) * dtype_bytes(kv_dtype)
    full_tok, slide_tok = cached_tokens(model, context, between_steps)
    sliding = model.sliding_layers if model.sliding_window > 0 else 0
    return per * ((model.num_layers - sliding) * full_tok + sliding * slide_tok)


def kv_bytes(model: ModelSpec, context: int, batch: int = 1, kv_dtype: str = "bf16",
             between_steps: bool = False) -> float:
    """KV-cache bytes of ``batch`` sequences of ``context`` tokens each (see
    :func:`kv_bytes_per_sequence` for ``between_steps``).

    Raises:
        InputError: invalid model or dtype, negative context, batch < 1.
    """
    batch = _check_len(batch, "batch size", 1)
    return batch * kv_bytes_per_sequence(model, context, kv_dtype, between_steps)


def weights_bytes(model: ModelSpec, weight_dtype: str = "bf16") -> float:
    """Bytes of the weights: ``params · bytes(weight_dtype)``.

    Raises:
        InputError: unknown dtype.
    """
    return model.params * dtype_bytes(weight_dtype)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units with 3 significant digits: 131072 → "128 KiB", 1536 → "1.5 KiB"."""
    if n is None or not math.isfinite(n):
        return "∞"
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    v, i = float(n), 0
    while abs(v) >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    return f"{v:.3g} {units[i]}"


# --------------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True)
class HardwareSpec:
    """An accelerator for the roofline.

    Attributes:
        name: display name.
        memory_bytes: memory capacity in bytes (datasheet GB = 10⁹ B).
        bandwidth: memory bandwidth in bytes/s.
        peak_flops: peak dense throughput in FLOP/s (bf16 tensor cores without sparsity for GPUs).
        source: where the numbers come from.
        measured: True for this machine's quick measurement.
    """

    name: str
    memory_bytes: float
    bandwidth: float
    peak_flops: float
    source: str = ""
    measured: bool = False

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which the roofline turns compute-bound."""
        return self.peak_flops / self.bandwidth


GB = 1e9
TB = 1e12

HARDWARE_PRESETS: dict[str, HardwareSpec] = {h.name: h for h in (
    HardwareSpec("A100 80GB SXM", 80 * GB, 2.039 * TB, 312e12,
                 "NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS dense"),
    HardwareSpec("H100 SXM", 80 * GB, 3.35 * TB, 989e12,
                 "NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with "
                 "sparsity = 989 dense"),
    HardwareSpec("H200 SXM", 141 * GB, 4.8 * TB, 989e12,
                 "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with "
                 "sparsity = 989 dense"),
    HardwareSpec("L4", 24 * GB, 300 * GB, 121e12,
                 "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with "
                 "sparsity = 121 dense"),
    HardwareSpec("RTX 4090", 24 * GB, 1.008 * TB, 165.2e12,
                 "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): 24 GB GDDR6X, "
                 "1,008 GB/s, BF16 tensor 165.2 TFLOPS dense (FP32 accumulate)"),
    HardwareSpec("MI300X", 192 * GB, 5.3 * TB, 1307.4e12,
                 "AMD Instinct MI300X accelerator datasheet: 192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS "
                 "dense"),
)}


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def measure_this_machine(device: str | None = None, budget_s: float = 1.0, peaks=None) -> HardwareSpec:
    """Measure this machine's memory bandwidth and matmul throughput quickly (≈ ``budget_s`` seconds), or take
    ``peaks`` measured already (an ``engine.decoding.batch.MachinePeaks`` on the CPU: the app passes the one
    measurement What-if's roofline shows, so both pages give this machine the same numbers).

    * Bandwidth: ``dst.copy_(src)`` of a 64 MiB fp32 tensor (256 MiB on a GPU) moves ``2 · size``
      bytes (one read, one write); the best of several repeats is kept.
    * Matmul: ``a @ b`` of two n × n matrices is ``2 · n³`` FLOPs (n = 1024 in fp32 on CPU, 4096 in
      bf16 on a GPU); best of several repeats.
    * Memory: total RAM on CPU, the device's total memory on a GPU.

    These are achieved, not peak, figures: a datasheet's peak is higher.

    Returns:
        a :class:`HardwareSpec` with ``measured=True``.
    """
    import torch

    from engine.decoding.models import resolve_device

    dev = resolve_device(device)
    gpu = dev.type == "cuda"
    if peaks is not None and not gpu:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        return HardwareSpec(f"This machine (CPU, {peaks.threads} threads, measured)", memory,
                            peaks.bandwidth_gbs * 1e9, peaks.peak_tflops * 1e12,
                            f"measured: {peaks.copy_mb} MB tensor copy, fp32 {peaks.matmul_n}×{peaks.matmul_n} matmul, "
                            "best of 3 (the measurement What-if's roofline uses)", measured=True)
    deadline = time.perf_counter() + budget_s
    n_bytes = (256 if gpu else 64) * 2**20
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(dev)
    best_copy = math.inf
    for i in range(50):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        best_copy = min(best_copy, time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > deadline - budget_s / 2:
            break
    del src, dst
    bandwidth = 2 * n_bytes / best_copy

    n = 4096 if gpu else 1024
    mm_dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, device=dev, dtype=mm_dtype)
    b = torch.randn(n, n, device=dev, dtype=mm_dtype)
    a @ b
    _sync(dev)
    best_mm = math.inf
    for i in range(50):
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        best_mm = min(best_mm, time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > deadline:
            break
    flops = 2 * n**3 / best_mm

    if gpu:
        props = torch.cuda.get_device_properties(dev)
        memory = float(props.total_memory)
        label = f"This machine ({props.name}, measured)"
        how = f"bf16 {n}×{n} matmul"
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        label = f"This machine (CPU, {torch.get_num_threads()} threads, measured)"
        how = f"fp32 {n}×{n} matmul"
    return HardwareSpec(label, memory, bandwidth, flops,
                        f"measured now: {n_bytes // 2**20} MiB tensor copy, {how}", measured=True)


# --------------------------------------------------------------------------------------------------
# Memory fit


@dataclass(frozen=True)
class FitResult:
    """What fits in one device's memory after the weights.

    Attributes:
        free_bytes: usable memory left for the KV cache (may be negative: weights do not fit).
        max_context: longest context per sequence at the given batch; None = unbounded (every layer
            slides, so the cache stops growing); 0 when not even one token fits.
        max_batch: largest batch at the given context (0 when none fits); None when the KV cache is
            empty (context 0).
        weights_fit: whether the weights fit at all.
    """

    free_bytes: float
    max_context: int | None
    max_batch: int | None
    weights_fit: bool


def fit_in_memory(model: ModelSpec, hw: HardwareSpec, context: int, batch: int = 1,
                  kv_dtype: str = "bf16", weight_dtype: str = "bf16",
                  usable_fraction: float = 0.9) -> FitResult:
    """Longest context (at ``batch``) and largest batch (at ``context``) whose KV cache fits.

    ``free = usable_fraction · memory − weights``; the batch fits when
    ``batch · kv_bytes_per_sequence(context) ≤ free``. Activations and fragmentation are ignored
    (``usable_fraction`` stands in for them, like vLLM's ``gpu_memory_utilization``).

    Raises:
        InputError: invalid model/dtype, negative context, batch < 1, fraction outside (0, 1].
    """
    if not 0 < usable_fraction <= 1:
        raise InputError(f"The usable memory fraction must be in (0, 1]; got {usable_fraction}.")
    batch = _check_len(batch, "batch size", 1)
    seq = kv_bytes_per_sequence(model, context, kv_dtype)
    free = usable_fraction * hw.memory_bytes - weights_bytes(model, weight_dtype)
    if free < 0:
        return FitResult(free, 0, 0, False)
    max_batch = None if seq == 0 else int(free // seq)
    # Longest context at this batch: the cache grows by `per_full` per token for ever, plus
    # `per_slide` per token until the window is full.
    per_layer_tok = kv_elements_per_token_per_layer(model) * dtype_bytes(kv_dtype) * batch
    sliding = model.sliding_layers if model.sliding_window > 0 else 0
    per_full = per_layer_tok * (model.num_layers - sliding)
    per_all = per_layer_tok * model.num_layers
    W = model.sliding_window
    if sliding == 0:
        max_ctx: int | None = int(free // per_all)
    elif free < per_all * W:  # runs out before the window is full
        max_ctx = int(free // per_all)
    elif per_full == 0:
        max_ctx = None
    else:  # per_all·W + per_full·(c − W) ≤ free
        max_ctx = W + int((free - per_all * W) // per_full)
    return FitResult(free, max_ctx, max_batch, True)


# --------------------------------------------------------------------------------------------------
# Decode roofline


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of ``batch`` sequences on a roofline.

    Attributes:
        weight_bytes: weight bytes read (each weight once per step, shared by the batch).
        kv_bytes: KV-cache bytes read (every sequence's whole cache).
        flops: FLOPs of the step.
        memory_ms: (weight_bytes + kv_bytes) / bandwidth, in ms.
        compute_ms: flops / peak, in ms.
        step_ms: max(memory_ms, compute_ms).
        bound: "memory" or "compute".
        tokens: tokens processed (batch · tokens_per_seq).
    """

    weight_bytes: float
    kv_bytes: float
    flops: float
    memory_ms: float
    compute_ms: float
    step_ms: float
    bound: str
    tokens: int

    @property
    def bytes_read(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def ms_per_token(self) -> float:
        return self.step_ms / self.tokens


def attention_flops_per_token(model: ModelSpec, context: int) -> float:
    """Attention FLOPs of one new token attending to ``context`` cached tokens (all layers).

    Per layer: ``q·kᵀ`` and ``p·v`` are ``heads · head_dim · span`` multiply-adds each, so
    ``4 · heads · head_dim · span`` FLOPs, with ``span = min(context, W)`` on sliding layers. For MLA
    with absorbed projections, scores use ``kv_lora_rank + qk_rope_head_dim`` numbers and values
    ``kv_lora_rank`` per head: ``2 · heads · (2·rank + rope) · span`` (DeepSeek-V2 §2.1.2 and App. C).

    Raises:
        InputError: invalid model or negative context.
    """
    validate(model)
    full_tok, slide_tok = cached_tokens(model, context)
    sliding = model.sliding_layers if model.sliding_window > 0 else 0
    span = (model.num_layers - sliding) * full_tok + sliding * slide_tok
    if model.is_mla:
        per = 2 * model.num_heads * (2 * model.kv_lora_rank + model.qk_rope_head_dim)
    else:
        per = 4 * model.num_heads * model.head_dim
    return per * span


def weights_read_bytes(model: ModelSpec, tokens: int, weight_dtype: str = "bf16") -> float:
    """Weight bytes a step over ``tokens`` tokens reads from memory.

    Dense models read every weight once. A mixture-of-experts model reads at most the experts its
    tokens use: ``min(params, active_params · tokens)`` parameters, an upper bound (shared layers are
    counted once per token) that equals ``active_params`` for a single token and all weights for a
    large batch.

    Raises:
        InputError: unknown dtype.
    """
    if model.active_params and model.active_params < model.params:
        p = min(model.params, model.active_params * tokens)
    else:
        p = model.params
    return p * dtype_bytes(weight_dtype)


def model_preset(name: str | ModelSpec) -> ModelSpec:
    """A model from :data:`MODEL_PRESETS` by name (a :class:`ModelSpec` is returned as is).

    Raises:
        InputError: unknown name.
    """
    if isinstance(name, ModelSpec):
        return name
    if name not in MODEL_PRESETS:
        raise InputError(f"Unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}.")
    return MODEL_PRESETS[name]


def hardware_preset(name: str | HardwareSpec) -> HardwareSpec:
    """A device from :data:`HARDWARE_PRESETS` by name (a :class:`HardwareSpec` is returned as is).

    Raises:
        InputError: unknown name.
    """
    if isinstance(name, HardwareSpec):
        return name
    if name not in HARDWARE_PRESETS:
        raise InputError(f"Unknown device {name!r}; choose one of {', '.join(HARDWARE_PRESETS)}.")
    return HARDWARE_PRESETS[name]


def decode_step(model: ModelSpec | str, hw: HardwareSpec | str, batch: int = 1, context: int = 1024,
                kv_dtype: str = "bf16", tokens_per_seq: int = 1,
                weight_dtype: str = "bf16") -> DecodeStep:
    """A decode (or verification) step on the roofline (Williams et al. 2009).

    ``batch`` sequences, each with ``context`` cached tokens, each feeding ``tokens_per_seq`` new tokens
    (1 for plain decode; γ + 1 when the target verifies γ draft tokens plus the bonus token).

    * bytes read = weights (once per step) + ``batch · kv_bytes_per_sequence(context)``
    * FLOPs = ``2 · params_per_token · batch · tokens_per_seq`` (Kaplan et al. 2020)
      + ``batch · tokens_per_seq · attention_flops_per_token(context)``
    * time = ``max(bytes / bandwidth, FLOPs / peak)``

    ``model`` and ``hw`` may be preset names (keys of :data:`MODEL_PRESETS`, :data:`HARDWARE_PRESETS`).

    Raises:
        InputError: invalid model/dtype, unknown preset name, negative context, batch or
        tokens_per_seq < 1.
    """
    model, hw = model_preset(model), hardware_preset(hw)
    validate(model)
    batch = _check_len(batch, "batch size", 1)
    tokens_per_seq = _check_len(tokens_per_seq, "tokens per sequence", 1)
    tokens = batch * tokens_per_seq
    w = weights_read_bytes(model, tokens, weight_dtype)
    kv = kv_bytes(model, context, batch, kv_dtype)
    flops = 2.0 * model.params_per_token * tokens + tokens * attention_flops_per_token(model, context)
    mem_ms = 1e3 * (w + kv) / hw.bandwidth
    comp_ms = 1e3 * flops / hw.peak_flops
    return DecodeStep(w, kv, flops, mem_ms, comp_ms, max(mem_ms, comp_ms),
                      "compute" if comp_ms > mem_ms else "memory", tokens)


def decode_step_time(model: ModelSpec | str, hw: HardwareSpec | str, batch: int = 1, context: int = 1024,
                     kv_dtype: str = "bf16", tokens_per_seq: int = 1, weight_dtype: str = "bf16") -> float:
    """Roofline time of one decode step in ms (see :func:`decode_step`).

    For speculative decoding, the target's verification of γ draft tokens is
    ``decode_step_time(..., tokens_per_seq=γ + 1)``; while the step is memory-bound it costs about
    the same as a plain step, which is why speculation pays at small batch and stops paying once the
    batch makes the step compute-bound.

    Raises:
        InputError: as :func:`decode_step`.
    """
    return decode_step(model, hw, batch, context, kv_dtype, tokens_per_seq, weight_dtype).step_ms


def compute_bound_batch(model: ModelSpec | str, hw: HardwareSpec | str, context: int = 1024, kv_dtype: str = "bf16",
                        tokens_per_seq: int = 1, weight_dtype: str = "bf16",
                        max_batch: int = 1 << 20) -> int | None:
    """Smallest batch at which a decode step becomes compute-bound, or None if it never does.

    With ``W`` weight bytes, ``K`` KV bytes per sequence, ``f`` FLOPs per sequence and bandwidth
    ``B``, peak ``P``: compute-bound when ``b·f/P > W/B + b·K/B``, i.e. ``b > (W/B) / (f/P − K/B)``.
    If ``f/P ≤ K/B`` (long contexts: attention reads about one byte per few FLOPs) the KV traffic
    grows as fast as the compute and the step stays memory-bound at every batch. Mixture-of-experts
    weight reads grow with the batch, so those are found by search up to ``max_batch``.

    Raises:
        InputError: as :func:`decode_step`.
    """
    model, hw = model_preset(model), hardware_preset(hw)
    if model.active_params and model.active_params < model.params:
        lo, hi = 1, max_batch
        if decode_step(model, hw, hi, context, kv_dtype, tokens_per_seq, weight_dtype).bound != "compute":
            return None
        while lo < hi:  # the bound flips once: memory for small batches, compute for large ones
            mid = (lo + hi) // 2
            if decode_step(model, hw, mid, context, kv_dtype, tokens_per_seq, weight_dtype).bound == "compute":
                hi = mid
            else:
                lo = mid + 1
        return lo
    one = decode_step(model, hw, 1, context, kv_dtype, tokens_per_seq, weight_dtype)
    w_s = one.weight_bytes / hw.bandwidth
    k_s = one.kv_bytes / hw.bandwidth
    f_s = one.flops / hw.peak_flops
    if f_s <= k_s:
        return None
    b = math.floor(w_s / (f_s - k_s)) + 1
    # guard against rounding at the boundary
    while b > 1 and decode_step(model, hw, b - 1, context, kv_dtype, tokens_per_seq, weight_dtype).bound == "compute":
        b -= 1
    while decode_step(model, hw, b, context, kv_dtype, tokens_per_seq, weight_dtype).bound != "compute":
        b += 1
    return b


# --------------------------------------------------------------------------------------------------
# Presets from real configurations


def _hf(model_id: str) -> str:
    return f"config.json of {model_id} on the Hugging Face hub (huggingface.co/{model_id})"


MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("Llama-2-7B (MHA)", 32, 32, 32, 128, 4096, 6_738_415_616,
              source=_hf("meta-llama/Llama-2-7b-hf") + "; 6.74 B parameters (model card)"),
    ModelSpec("Llama-3.1-8B", 32, 32, 8, 128, 4096, 8_030_261_248,
              source=_hf("meta-llama/Llama-3.1-8B") + "; 8.03 B parameters (model card)"),
    ModelSpec("Llama-3.1-70B", 80, 64, 8, 128, 8192, 70_553_706_496,
              source=_hf("meta-llama/Llama-3.1-70B") + "; 70.6 B parameters (model card)"),
    ModelSpec("Llama-3.1-405B", 126, 128, 8, 128, 16384, 405_853_388_800,
              source=_hf("meta-llama/Llama-3.1-405B") + "; 405.9 B parameters (model card)"),
    ModelSpec("Mistral-7B-v0.1 (sliding window)", 32, 32, 8, 128, 4096, 7_241_732_096,
              sliding_window=4096, sliding_layers=32,
              source=_hf("mistralai/Mistral-7B-v0.1") + " (sliding_window 4096 on every layer); 7.24 B "
              "parameters (model card)"),
    ModelSpec("Qwen2.5-7B", 28, 28, 4, 128, 3584, 7_615_616_512,
              source=_hf("Qwen/Qwen2.5-7B") + " (use_sliding_window false); 7.62 B parameters (model card)"),
    ModelSpec("Qwen2.5-72B", 80, 64, 8, 128, 8192, 72_706_203_648,
              source=_hf("Qwen/Qwen2.5-72B") + " (use_sliding_window false); 72.7 B parameters (model card)"),
    ModelSpec("Gemma-2-9B (alternating sliding window)", 42, 16, 8, 256, 3584, 9_241_705_984,
              sliding_window=4096, sliding_layers=21,
              source=_hf("google/gemma-2-9b") + " (head_dim 256 ≠ 3584/16; sliding_window 4096 on every "
              "other layer, 21 of 42); 9.24 B parameters (model card)"),
    ModelSpec("Falcon-7B (MQA)", 32, 71, 1, 64, 4544, 6_921_720_704,
              source=_hf("tiiuae/falcon-7b") + " (multi_query true: one KV head); 6.92 B parameters with "
              "the output layer tied to the embedding"),
    ModelSpec("DeepSeek-V3 (MLA, MoE)", 61, 128, 128, 128, 7168, 671_000_000_000,
              active_params=37_000_000_000, kv_lora_rank=512, qk_rope_head_dim=64,
              source=_hf("deepseek-ai/DeepSeek-V3") + " (kv_lora_rank 512, qk_rope_head_dim 64, "
              "v_head_dim 128); 671 B parameters, 37 B active per token (DeepSeek-V3 technical report)"),
)}


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def estimate_params(cfg: Mapping[str, Any]) -> int:
    """Parameter count of a Llama-style decoder from its config (for configs without a known count).

    ``vocab·hidden·(1 if tied else 2) + layers·(hidden·heads·d + 2·hidden·kv·d + heads·d·hidden
    + 3·hidden·intermediate + 2·hidden) + hidden`` (attention q/k/v/o, gated MLP, two RMSNorms per
    layer, final norm). Mixture-of-experts configs (``num_local_experts`` / ``n_routed_experts``)
    multiply the MLP by the number of experts. Exact for SmolLM2 and Llama models; an estimate for
    other families (biases, fused layers and shared experts are not counted).
    """
    h = int(_get(cfg, "hidden_size", "n_embd", "d_model", default=0))
    L = int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers", default=0))
    nh = int(_get(cfg, "num_attention_heads", "n_head", default=1))
    d = int(_get(cfg, "head_dim", default=h // max(nh, 1)))
    kv = _kv_heads_from_config(cfg, nh)
    inter = int(_get(cfg, "intermediate_size", "ffn_hidden_size", default=4 * h))
    vocab = int(_get(cfg, "vocab_size", default=0))
    experts = int(_get(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=1))
    if experts > 1:
        inter = int(_get(cfg, "moe_intermediate_size", default=inter)) * experts
    tied = bool(_get(cfg, "tie_word_embeddings", default=True))
    per_layer = h * nh * d + 2 * h * kv * d + nh * d * h + 3 * h * inter + 2 * h
    return vocab * h * (1 if tied else 2) + L * per_layer + h


def _kv_heads_from_config(cfg: Mapping[str, Any], num_heads: int) -> int:
    kv = _get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv is not None:
        return int(kv)
    if cfg.get("multi_query"):
        return 1
    return num_heads


def model_from_config(cfg: Any, name: str = "custom", params: int | None = None,
                      source: str = "") -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face config (a dict or a ``PretrainedConfig``).

    Reads ``num_hidden_layers``/``n_layer``, ``num_attention_heads``/``n_head``, ``num_key_value_heads``
    (or Falcon's ``multi_query``/``num_kv_heads``), the config's own ``head_dim`` when it has one (else
    ``hidden_size / num_attention_heads``), ``sliding_window`` with the layers that use it
    (``layer_types`` when present; Gemma-2: every other layer; Gemma-3: ``sliding_window_pattern``;
    Qwen2: only with ``use_sliding_window``, layers ≥ ``max_window_layers``; otherwise every layer),
    and latent attention's ``kv_lora_rank`` and ``qk_rope_head_dim``. ``params`` defaults to
    :func:`estimate_params`.

    Raises:
        InputError: a field is missing or makes no sense (validated like any model).
    """
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, Mapping):
        raise InputError("A model configuration must be a JSON object (a config.json file).")
    if "text_config" in cfg and isinstance(cfg["text_config"], Mapping) and \
            "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    try:
        L = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
        nh = _get(cfg, "num_attention_heads", "n_head")
        h = _get(cfg, "hidden_size", "n_embd", "d_model", default=0)
        if L is None or nh is None:
            raise InputError("The configuration has no number of layers (num_hidden_layers) or no number "
                             "of attention heads (num_attention_heads): is it a decoder config.json?")
        L, nh, h = int(L), int(nh), int(h)
        kv = _kv_heads_from_config(cfg, nh)
        hd = _get(cfg, "head_dim")
        if hd is None:
            if nh <= 0 or h % nh:
                raise InputError(f"No head_dim in the configuration and hidden_size {h} is not a multiple "
                                 f"of {nh} heads.")
            hd = h // nh
        hd = int(hd)
        window = _get(cfg, "sliding_window", default=0) or 0
        if isinstance(window, bool):
            window = 0
        window = int(window)
        mtype = str(cfg.get("model_type", ""))
        layer_types = cfg.get("layer_types")
        if window and layer_types:
            sliding = sum(1 for t in layer_types[:L] if "sliding" in str(t))
        elif window and mtype in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
            if cfg.get("use_sliding_window"):
                sliding = max(0, L - int(_get(cfg, "max_window_layers", default=L)))
            else:
                sliding = 0
        elif window and mtype == "gemma2":
            sliding = (L + 1) // 2  # layers 0, 2, 4, … slide
        elif window and mtype.startswith("gemma3"):
            k = int(_get(cfg, "sliding_window_pattern", default=6))
            sliding = L - L // k
        elif window:
            sliding = L
        else:
            sliding = 0
        if sliding == 0:
            window = 0
        rank = int(_get(cfg, "kv_lora_rank", default=0) or 0)
        rope = int(_get(cfg, "qk_rope_head_dim", default=0) or 0) if rank else 0
    except (TypeError, ValueError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"The configuration has a field of the wrong type: {e}") from e
    if params is None:
        params = estimate_params(cfg)
    spec = ModelSpec(name, L, nh, kv, hd, h, int(params), sliding_window=window, sliding_layers=sliding,
                     kv_lora_rank=rank, qk_rope_head_dim=rope, source=source)
    validate(spec)
    return spec


def model_from_config_json(data: bytes | str, name: str = "uploaded config.json") -> ModelSpec:
    """Parse an uploaded ``config.json`` (see :func:`model_from_config`).

    Raises:
        InputError: not JSON, or not a usable decoder configuration.
    """
    try:
        cfg = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"This file is not valid JSON: {e}") from e
    return model_from_config(cfg, name=name, source=f"uploaded file {name}")


def load_hub_config(model_id: str) -> ModelSpec:
    """The configuration of a Hugging Face model id or local folder, via ``AutoConfig`` (never remote
    code); the local cache is tried first, then the hub.

    Raises:
        InputError: empty id or unusable configuration.
        ModelLoadError: it cannot be found or downloaded (offline).
    """
    from transformers import AutoConfig

    from engine.decoding.models import _from_pretrained

    model_id = (model_id or "").strip()
    if not model_id:
        raise InputError("Type a Hugging Face model id such as Qwen/Qwen2.5-0.5B.")
    cfg = _from_pretrained(AutoConfig, model_id)
    return model_from_config(cfg, name=model_id, source=_hf(model_id) + " (loaded now; parameters estimated)")


def embedded_model_spec() -> ModelSpec:
    """The embedded SmolLM2-135M-Instruct, read from its own config.json (cheap: no weights loaded).

    Raises:
        ModelLoadError: the embedded model is missing.
    """
    from transformers import AutoConfig

    from engine.decoding.models import prepare_embedded

    folder = prepare_embedded()
    cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    return model_from_config(cfg, name="SmolLM2-135M-Instruct (embedded)",
                             source=f"its own config.json ({folder}); parameters counted from the config")


# --------------------------------------------------------------------------------------------------
# The page's summary


@dataclass
class KVReport:
    """Everything the KV-cache page shows for one setting.

    Attributes:
        model: the validated model.
        per_token: KV bytes per token (before any sliding window fills).
        per_sequence: KV bytes of one sequence of ``context`` tokens.
        batch_bytes: KV bytes of the whole batch.
        weights: weight bytes.
        compare: rows (label, attention kind, KV heads, bytes per token, bytes for the batch) for this
            model, the same model as MHA, and as MQA.
        fit: memory fit on the chosen device.
        steps: decode step per hardware name.
        compute_bound: compute-bound batch per hardware name (None = never).
        hardware: the hardware used, by name.
        gpu: the chosen device's name.
    """

    model: ModelSpec
    context: int
    batch: int
    kv_dtype: str
    weight_dtype: str
    per_token: float
    per_sequence: float
    batch_bytes: float
    weights: float
    compare: list[tuple[str, str, int, float, float]]
    fit: FitResult
    steps: dict[str, DecodeStep]
    compute_bound: dict[str, int | None]
    hardware: dict[str, HardwareSpec]
    gpu: str
    curve: dict[str, list[float]] = field(default_factory=dict)
    compute_bound_no_kv: dict[str, int | None] = field(default_factory=dict)
    verify_gamma: int = 4
    verify_ms: float = 0.0


def kv_report(model: ModelSpec, context: int, batch: int = 1, kv_dtype: str = "bf16",
              weight_dtype: str = "bf16", gpu: str = "H100 SXM", usable_fraction: float = 0.9,
              extra_hardware: list[HardwareSpec] | None = None) -> KVReport:
    """All numbers of the KV-cache page for one setting (each from the functions above).

    ``curve`` holds the chosen device's roofline against batch size: keys "batch", "memory_ms",
    "compute_ms", "step_ms" (batch 1 … 1024, log-spaced). ``compute_bound_no_kv`` is the compute-bound
    batch for an empty cache (context 0: weights only); ``verify_ms`` is the chosen device's step time
    when each sequence verifies ``verify_gamma`` = 4 draft tokens (``tokens_per_seq`` = γ + 1).

    Raises:
        InputError: invalid model, lengths, dtypes, or an unknown device name.
    """
    validate(model)
    context = _check_len(context, "sequence length", 0)
    batch = _check_len(batch, "batch size", 1)
    hardware = dict(HARDWARE_PRESETS)
    for hw in extra_hardware or []:
        hardware[hw.name] = hw
    if gpu not in hardware:
        raise InputError(f"Unknown device {gpu!r}; choose one of {', '.join(hardware)}.")
    per_tok = kv_bytes_per_token(model, kv_dtype)
    per_seq = kv_bytes_per_sequence(model, context, kv_dtype)
    compare = []
    for label, m in (("this configuration", model),
                     ("as MHA", model.as_kv_heads(model.num_heads)),
                     ("as MQA", model.as_kv_heads(1))):
        compare.append((label, m.attention_kind, m.num_kv_heads if not m.is_mla else 0,
                        kv_bytes_per_token(m, kv_dtype), kv_bytes(m, context, batch, kv_dtype)))
    steps = {n: decode_step(model, hw, batch, context, kv_dtype, 1, weight_dtype) for n, hw in hardware.items()}
    cb = {n: compute_bound_batch(model, hw, context, kv_dtype, 1, weight_dtype) for n, hw in hardware.items()}
    cb0 = {n: compute_bound_batch(model, hw, 0, kv_dtype, 1, weight_dtype) for n, hw in hardware.items()}
    hw = hardware[gpu]
    bs = sorted({int(round(2 ** (i / 4))) for i in range(0, 41)})
    pts = [decode_step(model, hw, b, context, kv_dtype, 1, weight_dtype) for b in bs]
    curve = {"batch": [float(b) for b in bs], "memory_ms": [p.memory_ms for p in pts],
             "compute_ms": [p.compute_ms for p in pts], "step_ms": [p.step_ms for p in pts]}
    return KVReport(model, context, batch, kv_dtype, weight_dtype, per_tok, per_seq, batch * per_seq,
                    weights_bytes(model, weight_dtype), compare,
                    fit_in_memory(model, hw, context, batch, kv_dtype, weight_dtype, usable_fraction),
                    steps, cb, hardware, gpu, curve, cb0, 4,
                    decode_step_time(model, hw, batch, context, kv_dtype, 5, weight_dtype))


# --------------------------------------------------------------------------------------------------
# Check against a real model


@dataclass(frozen=True)
class RealKVCheck:
    """Bytes held by a real model's KV cache next to the calculator's figure.

    Attributes:
        tokens: tokens in the cache (prefill + decode steps).
        measured_bytes: sum over layers of ``keys.nbytes + values.nbytes`` of the ``DynamicCache``.
        predicted_bytes: :func:`kv_bytes` for the model's config, batch 1, the cache's dtype
            (``between_steps=True``).
        kv_dtype: dtype name of the cached tensors.
        layer_shape: shape of the last layer's key tensor ``[batch, kv_heads, tokens, head_dim]``.
        num_layers: layers in the cache.
    """

    tokens: int
    measured_bytes: int
    predicted_bytes: float
    kv_dtype: str
    layer_shape: tuple[int, ...]
    num_layers: int

    @property
    def agrees(self) -> bool:
        return self.measured_bytes == self.predicted_bytes


def real_kv_check(lm, n_tokens: int = 64, decode_steps: int = 4) -> RealKVCheck:
    """Run ``lm`` (a :class:`engine.decoding.models.LoadedModel`) on ``n_tokens`` tokens and measure its cache.

    Prefills ``n_tokens − decode_steps`` tokens of a fixed text (repeated as needed), then feeds
    ``decode_steps`` tokens one at a time (greedy); see :func:`cache_check`.

    Raises:
        InputError: ``n_tokens`` outside [1, 4096] or ``decode_steps`` outside [0, n_tokens − 1].
    """
    n_tokens = _check_len(n_tokens, "number of tokens", 1)
    if n_tokens > 4096:
        raise InputError("Use at most 4096 tokens for the real-model check.")
    decode_steps = _check_len(decode_steps, "number of decode steps", 0)
    if decode_steps >= n_tokens:
        raise InputError("The decode steps must be fewer than the tokens (at least one is prefilled).")
    text = "The KV cache stores a key and a value vector for every token, layer and KV head. "
    ids = lm.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    reps = math.ceil((n_tokens - decode_steps) / len(ids))
    prompt = ids.repeat(reps)[: n_tokens - decode_steps].unsqueeze(0).to(lm.device)
    return cache_check(lm.model, prompt, decode_steps)


def cache_check(model, prompt, decode_steps: int = 0) -> RealKVCheck:
    """Run a causal LM into a fresh ``DynamicCache`` and compare the bytes it holds with the calculator.

    Args:
        model: a transformers causal LM (eval mode).
        prompt: token ids, shape ``[1, n_prompt]``, prefilled in one forward pass; then
            ``decode_steps`` greedy tokens are fed one at a time.

    Sums ``keys.nbytes + values.nbytes`` over ``cache.layers`` and compares with
    :func:`kv_bytes` (``between_steps=True``: sliding-window layers hold ``W − 1`` tokens between
    steps) for ``model_from_config(model.config)``, batch 1, in the cache's dtype.
    """
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=prompt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(decode_steps):
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    measured = 0
    shape: tuple[int, ...] = ()
    for layer in cache.layers:
        measured += layer.keys.numel() * layer.keys.element_size()
        measured += layer.values.numel() * layer.values.element_size()
        shape = tuple(layer.keys.shape)
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    kv_dtype = names.get(cache.layers[0].keys.dtype, "fp32")
    n_tokens = int(prompt.shape[-1]) + decode_steps
    spec = model_from_config(model.config, params=0)
    predicted = kv_bytes(spec, n_tokens, 1, kv_dtype, between_steps=True)
    return RealKVCheck(n_tokens, int(measured), predicted, kv_dtype, shape, len(cache.layers))
