"""engine.explain.kv_size against hand-computed values."""

from __future__ import annotations

import json

import pytest

from engine.errors import InputError, ModelLoadError
from engine.explain.kv_size import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    attention_flops_per_token,
    cache_check,
    compute_bound_batch,
    decode_step,
    decode_step_time,
    estimate_params,
    fit_in_memory,
    format_bytes,
    kv_bytes,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_report,
    load_hub_config,
    measure_this_machine,
    model_from_config,
    model_from_config_json,
    real_kv_check,
    weights_bytes,
)

KiB = 1024
L8 = MODEL_PRESETS["Llama-3.1-8B"]
L2 = MODEL_PRESETS["Llama-2-7B (MHA)"]
FALCON = MODEL_PRESETS["Falcon-7B (MQA)"]
GEMMA = MODEL_PRESETS["Gemma-2-9B (alternating sliding window)"]
MISTRAL = MODEL_PRESETS["Mistral-7B-v0.1 (sliding window)"]
DSV3 = MODEL_PRESETS["DeepSeek-V3 (MLA, MoE)"]
H100 = HARDWARE_PRESETS["H100 SXM"]


# ------------------------------------------------------------------------------------------ per token
def test_llama31_8b_is_128_kib_per_token_bf16():
    # 2 (K and V) · 32 layers · 8 KV heads · 128 dims · 2 bytes = 131072 B = 128 KiB
    assert kv_bytes_per_token(L8, "bf16") == 128 * KiB


def test_llama2_7b_mha_is_512_kib_per_token():
    # 2 · 32 · 32 · 128 · 2 = 524288 B = 512 KiB
    assert kv_bytes_per_token(L2, "bf16") == 512 * KiB
    assert L2.attention_kind == "MHA"


def test_falcon_7b_mqa_is_8_kib_per_token():
    # 2 · 32 layers · 1 KV head · 64 dims · 2 bytes = 8192 B
    assert kv_bytes_per_token(FALCON, "bf16") == 8 * KiB
    assert FALCON.attention_kind == "MQA"


def test_dtypes_scale_bytes():
    # Llama-3.1-8B: 65536 elements per token; fp32 ×4, fp8 ×1, int4 ×0.5
    assert kv_bytes_per_token(L8, "fp32") == 262144
    assert kv_bytes_per_token(L8, "fp8") == 65536
    assert kv_bytes_per_token(L8, "int4") == 32768


def test_other_presets_hand_computed():
    # Llama-3.1-70B: 2·80·8·128·2 = 327680 (320 KiB); 405B: 2·126·8·128·2 = 516096 (504 KiB)
    assert kv_bytes_per_token(MODEL_PRESETS["Llama-3.1-70B"]) == 327680
    assert kv_bytes_per_token(MODEL_PRESETS["Llama-3.1-405B"]) == 516096
    # Qwen2.5-7B: 2·28·4·128·2 = 57344 (56 KiB)
    assert kv_bytes_per_token(MODEL_PRESETS["Qwen2.5-7B"]) == 57344
    # Gemma-2-9B uses head_dim 256, not 3584/16 = 224: 2·42·8·256·2 = 344064 (336 KiB)
    assert GEMMA.head_dim == 256 and GEMMA.hidden_size // GEMMA.num_heads == 224
    assert kv_bytes_per_token(GEMMA) == 344064


def test_gqa_sits_between_mha_and_mqa():
    mha, mqa = L8.as_kv_heads(32), L8.as_kv_heads(1)
    # the cache is proportional to the KV heads: 32 : 8 : 1
    assert kv_bytes_per_token(mha) == 4 * kv_bytes_per_token(L8) == 32 * kv_bytes_per_token(mqa)
    assert (mha.attention_kind, L8.attention_kind, mqa.attention_kind) == ("MHA", "GQA", "MQA")


# ------------------------------------------------------------------------------------------ latent attention
def test_deepseek_v3_latent_attention():
    # MLA caches kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 numbers per layer per token:
    # 61 layers · 576 · 2 bytes = 70272 B
    assert DSV3.attention_kind == "MLA"
    assert kv_bytes_per_token(DSV3, "bf16") == 70272
    # as MHA with 128 heads of 128 dims it would be 2·61·128·128·2 = 3997696 B, 56.9× more
    mha = DSV3.as_kv_heads(128)
    assert kv_bytes_per_token(mha) == 3997696
    assert kv_bytes_per_token(mha) / kv_bytes_per_token(DSV3) == pytest.approx(56.888, rel=1e-4)


def test_mla_kv_independent_of_heads():
    from dataclasses import replace

    assert kv_bytes_per_token(replace(DSV3, num_kv_heads=1)) == kv_bytes_per_token(DSV3)


# ------------------------------------------------------------------------------------------ sliding window
def test_gemma2_alternating_window():
    # per layer and token 2·8·256·2 = 8192 B; at 8192 tokens 21 global layers hold 8192 tokens and
    # 21 sliding layers hold 4096: 8192·(21·8192 + 21·4096) = 2113929216 B
    assert kv_bytes_per_sequence(GEMMA, 8192) == 2_113_929_216
    # below the window every layer holds everything: 344064 · 1000
    assert kv_bytes_per_sequence(GEMMA, 1000) == 344064 * 1000


def test_mistral_window_caps_the_cache():
    # every layer slides with W = 4096: 131072 B/token · 4096 tokens = 536870912 B, at any longer context
    assert kv_bytes_per_sequence(MISTRAL, 4096) == 536_870_912
    assert kv_bytes_per_sequence(MISTRAL, 100_000) == 536_870_912
    assert kv_bytes_per_sequence(MISTRAL, 4095) == 131072 * 4095


def test_batch_multiplies():
    # 8 sequences · 1000 tokens · 131072 B
    assert kv_bytes(L8, 1000, 8) == 8 * 1000 * 131072
    assert kv_bytes(L8, 0, 3) == 0


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs, words", [
    (dict(num_kv_heads=5), "do not divide"),
    (dict(num_kv_heads=64), "more KV heads"),
    (dict(num_layers=0), "layers"),
    (dict(head_dim=0), "head dimension"),
    (dict(sliding_window=-1), "sliding window"),
    (dict(sliding_window=4096, sliding_layers=40), "impossible"),
])
def test_nonsense_models_rejected(kwargs, words):
    from dataclasses import replace

    with pytest.raises(InputError, match=words):
        kv_bytes_per_token(replace(L8, **kwargs))


def test_bad_lengths_and_dtypes():
    with pytest.raises(InputError, match="sequence length"):
        kv_bytes_per_sequence(L8, -5)
    with pytest.raises(InputError, match="batch"):
        kv_bytes(L8, 10, 0)
    with pytest.raises(InputError, match="Unknown data type"):
        kv_bytes_per_token(L8, "fp7")
    with pytest.raises(InputError, match="fraction"):
        fit_in_memory(L8, H100, 10, usable_fraction=0)
    with pytest.raises(InputError, match="Unknown device"):
        kv_report(L8, 10, gpu="TPU v9")
    assert issubclass(InputError, ValueError)


# ------------------------------------------------------------------------------------------ memory fit
def test_fit_llama31_8b_on_h100():
    # weights 8030261248 · 2 = 16060522496 B; free = 80e9 − that = 63939477504 B
    # longest context at batch 1: 63939477504 // 131072 = 487819 tokens
    # largest batch at 8192 tokens (1 GiB each): 63939477504 // 1073741824 = 59
    fit = fit_in_memory(L8, H100, 8192, 1, usable_fraction=1.0)
    assert fit.weights_fit and fit.free_bytes == 63_939_477_504
    assert fit.max_context == 487_819
    assert fit.max_batch == 59
    # at batch 4 the longest context is 63939477504 // (4·131072) = 121954
    assert fit_in_memory(L8, H100, 8192, 4, usable_fraction=1.0).max_context == 121_954


def test_fit_weights_too_big():
    # 405B in bf16 is 811.7 GB: it does not fit on one 80 GB H100
    fit = fit_in_memory(MODEL_PRESETS["Llama-3.1-405B"], H100, 1024)
    assert not fit.weights_fit and fit.max_batch == 0


def test_fit_sliding_windows():
    # Mistral: every layer slides, so once the window fits the context is unbounded
    assert fit_in_memory(MISTRAL, H100, 8192, 1).max_context is None
    # Gemma-2-9B on H100 (usable 1.0): free = 80e9 − 9241705984·2 = 61516588032 B.
    # The first 4096 tokens cost 344064 B each (1409286144 B), then only the 21 global layers grow:
    # 21·8192 = 172032 B per token: 4096 + (61516588032 − 1409286144) // 172032 = 4096 + 349396 = 353492
    assert fit_in_memory(GEMMA, H100, 8192, 1, usable_fraction=1.0).max_context == 353_492


# ------------------------------------------------------------------------------------------ roofline
def test_decode_step_llama31_8b_h100_batch1():
    # bytes = 16060522496 (weights) + 131072·1024 (KV) = 16194740224; / 3.35e12 B/s = 4.8342 ms
    # FLOPs = 2·8030261248 + 4·32·128·1024·32 layers = 16060522496 + 536870912 = 16597393408
    step = decode_step(L8, H100, batch=1, context=1024)
    assert step.bytes_read == 16_194_740_224
    assert step.flops == 16_597_393_408
    assert step.memory_ms == pytest.approx(16_194_740_224 / 3.35e12 * 1e3)
    assert step.compute_ms == pytest.approx(16_597_393_408 / 989e12 * 1e3)
    assert step.bound == "memory" and step.step_ms == step.memory_ms
    assert decode_step_time(L8, H100, 1, 1024) == pytest.approx(4.8342, abs=1e-4)


def test_attention_flops_sliding_span():
    # Gemma-2-9B at 8192: 4·16·256 = 16384 FLOPs per layer per attended token;
    # spans 21·8192 + 21·4096 = 258048 → 16384·258048 = 4227858432
    assert attention_flops_per_token(GEMMA, 8192) == 4_227_858_432


def test_compute_bound_batch_weights_only():
    # Empty cache: compute-bound when b·2·8030261248/989e12 > 16060522496/3.35e12,
    # i.e. b > 989e12 / 3.35e12 = 295.2 → 296 (the ridge point in tokens, since 2 FLOP per 2 bytes)
    assert compute_bound_batch(L8, H100, context=0) == 296
    assert decode_step(L8, H100, 296, 0).bound == "compute"
    assert decode_step(L8, H100, 295, 0).bound == "memory"


def test_compute_bound_batch_never_at_long_context():
    # Per sequence at 1024 tokens: KV read 134217728 B / 3.35e12 = 40.1 µs > FLOPs 16.6e9 / 989e12 = 16.8 µs,
    # so the KV traffic alone outgrows the compute: memory-bound at every batch.
    assert compute_bound_batch(L8, H100, context=1024) is None
    # At 128 tokens: W/B = 4.7942 ms; per sequence f/P − K/B = (16060522496 + 4·32·128·128·32)/989e12
    # − 128·131072/3.35e12 = 16.306 µs − 5.008 µs = 11.298 µs → b > 424.3 → 425
    b = compute_bound_batch(L8, H100, context=128)
    assert b == 425
    assert decode_step(L8, H100, b, 128).bound == "compute"
    assert decode_step(L8, H100, b - 1, 128).bound == "memory"


def test_verification_costs_little_when_memory_bound():
    # batch 1: 5 tokens per sequence add 4·2·8e9 FLOPs but read the same bytes → same step time
    one = decode_step_time(L8, H100, 1, 1024)
    five = decode_step_time(L8, H100, 1, 1024, tokens_per_seq=5)
    assert five == pytest.approx(one)
    # at an empty cache and batch 256 (memory-bound for 1 token: 256 < 296), 5 tokens each is
    # compute-bound: 5·256·2·8030261248 / 989e12 = 20.786 ms
    assert decode_step(L8, H100, 256, 0).bound == "memory"
    assert decode_step_time(L8, H100, 256, 0, tokens_per_seq=5) == pytest.approx(
        5 * 256 * 2 * 8030261248 / 989e12 * 1e3)


def test_moe_weight_reads_grow_with_batch():
    # DeepSeek-V3: one token reads its 37e9 active parameters; 100 tokens read at most all 671e9
    assert decode_step(DSV3, H100, 1, 0).weight_bytes == 37e9 * 2
    assert decode_step(DSV3, H100, 100, 0).weight_bytes == 671e9 * 2
    b = compute_bound_batch(DSV3, H100, context=0)
    assert b is not None
    assert decode_step(DSV3, H100, b, 0).bound == "compute"
    assert decode_step(DSV3, H100, b - 1, 0).bound == "memory"


def test_weights_bytes():
    assert weights_bytes(L8, "bf16") == 16_060_522_496
    assert weights_bytes(L8, "int4") == 4_015_130_624


# ------------------------------------------------------------------------------------------ configs
def test_model_from_config_llama_style():
    cfg = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152,
           "tie_word_embeddings": True}
    spec = model_from_config(cfg)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    # SmolLM2-135M parameters: 49152·576 + 30·(576·576 + 2·576·192 + 576·576 + 3·576·1536 + 2·576) + 576
    # = 28311552 + 30·3540096 + 576 = 134515008
    assert spec.params == estimate_params(cfg) == 134_515_008


def test_model_from_config_falcon_gemma_qwen_deepseek():
    falcon = model_from_config({"model_type": "falcon", "n_layer": 32, "n_head": 71, "hidden_size": 4544,
                                "multi_query": True}, params=1)
    assert (falcon.num_kv_heads, falcon.head_dim) == (1, 64)
    gemma = model_from_config({"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16,
                               "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584,
                               "sliding_window": 4096}, params=1)
    assert (gemma.head_dim, gemma.sliding_window, gemma.sliding_layers) == (256, 4096, 21)
    qwen = model_from_config({"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
                              "num_key_value_heads": 4, "hidden_size": 3584, "sliding_window": 131072,
                              "use_sliding_window": False}, params=1)
    assert qwen.sliding_window == 0 and qwen.sliding_layers == 0
    typed = model_from_config({"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "hidden_size": 64, "sliding_window": 16,
                               "layer_types": ["sliding_attention", "full_attention"] * 2}, params=1)
    assert typed.sliding_layers == 2
    ds = model_from_config({"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
                            "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
                            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}, params=1)
    assert kv_bytes_per_token(ds) == 70272


def test_config_json_errors():
    with pytest.raises(InputError, match="not valid JSON"):
        model_from_config_json(b"{not json")
    with pytest.raises(InputError, match="num_hidden_layers"):
        model_from_config_json(json.dumps({"vocab_size": 10}))
    with pytest.raises(InputError, match="do not divide"):
        model_from_config_json(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 6,
                                           "num_key_value_heads": 4, "hidden_size": 60}))
    with pytest.raises(InputError, match="layers"):
        model_from_config_json(json.dumps({"num_hidden_layers": 0, "num_attention_heads": 4,
                                           "hidden_size": 64}))


def test_hub_id_offline_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from engine.decoding import models

    models.hub_reachable.cache_clear()
    try:
        with pytest.raises(ModelLoadError, match="Could not load"):
            load_hub_config("no-such-org/no-such-model-kv-test")
        with pytest.raises(InputError):
            load_hub_config("  ")
    finally:
        models.hub_reachable.cache_clear()


def test_format_bytes():
    assert format_bytes(131072) == "128 KiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(2_113_929_216) == "1.97 GiB"  # 2113929216 / 2³⁰ = 1.96875


def test_report_compare_rows():
    rep = kv_report(L8, 1000, 2, gpu="L4")
    labels = [r[0] for r in rep.compare]
    assert labels == ["this configuration", "as MHA", "as MQA"]
    # batch bytes: 2·1000·131072, as MHA ×4, as MQA ÷8
    assert [r[4] for r in rep.compare] == [262_144_000, 1_048_576_000, 32_768_000]
    assert set(rep.steps) == set(HARDWARE_PRESETS)
    assert rep.curve["batch"][0] == 1 and rep.curve["batch"][-1] == 1024


def test_measure_this_machine_is_quick_and_plausible():
    import time

    t0 = time.perf_counter()
    hw = measure_this_machine(budget_s=0.5)
    assert time.perf_counter() - t0 < 5  # budget 0.5 s; generous for a loaded 2-core CPU
    assert isinstance(hw, HardwareSpec) and hw.measured
    # anything from 0.1 GB/s to 100 TB/s and 0.1 GFLOP/s upwards is a real machine
    assert 1e8 < hw.bandwidth < 1e14 and hw.peak_flops > 1e8 and hw.memory_bytes > 2**30


# ------------------------------------------------------------------------------------------ real model
@pytest.mark.slow
def test_real_cache_matches_calculator(embedded):
    from engine.explain.kv_size import embedded_model_spec

    spec = embedded_model_spec()
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.params == embedded.num_parameters  # 134515008, counted from the config
    for n in (7, 33):
        chk = real_kv_check(embedded, n, decode_steps=3)
        # 2 · 30 layers · 3 KV heads · 64 dims · 4 bytes (fp32) = 46080 B per token
        assert chk.measured_bytes == 46080 * n
        assert chk.predicted_bytes == chk.measured_bytes and chk.agrees
        assert chk.layer_shape == (1, 3, n, 64) and chk.num_layers == 30
    with pytest.raises(InputError):
        real_kv_check(embedded, 3, decode_steps=3)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_real_cache_tiny_models(family):
    """Tiny random Mistral (every layer slides) and Gemma-2 (every other layer) with W = 8."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    if family == "mistral":
        cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
        model = MistralForCausalLM(cfg).eval()
        # 2 layers · 7 (= W − 1) tokens · 2 (K, V) · 2 KV heads · 8 dims · 4 bytes = 1792
        expected = 1792
    else:
        cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
        model = Gemma2ForCausalLM(cfg).eval()
        # per layer and token 2·2·16·4 = 256 B; 2 global layers · 20 tokens + 2 sliding layers · 7
        # = 54 layer-tokens → 13824 B
        expected = 13824
    chk = cache_check(model, torch.randint(0, 64, (1, 17)), decode_steps=3)
    assert chk.tokens == 20
    assert chk.measured_bytes == expected == chk.predicted_bytes
    # during a step the sliding layers attend to W = 8 tokens: one more per sliding layer
    spec = model_from_config(cfg, params=0)
    per_layer_tok = 2 * spec.num_kv_heads * spec.head_dim * 4
    assert kv_bytes(spec, 20, 1, "fp32") == expected + spec.sliding_layers * per_layer_tok


def test_decode_step_time_by_preset_names():
    # the what-if page can ask by name: same value as with the objects
    assert decode_step_time("Llama-3.1-8B", "H100 SXM", 1, 1024, tokens_per_seq=5) == \
        decode_step_time(L8, H100, 1, 1024, tokens_per_seq=5)
    assert compute_bound_batch("Llama-3.1-8B", "H100 SXM", context=0) == 296
    with pytest.raises(InputError, match="Unknown model preset"):
        decode_step_time("GPT-9", "H100 SXM")
    with pytest.raises(InputError, match="Unknown device"):
        decode_step_time("Llama-3.1-8B", "TPU")


def test_measure_this_machine_takes_peaks_measured_already():
    """The KV-cache page shows the measurement What-if's roofline uses: given peaks, no new measurement, the same
    numbers in the spec's units (bytes/s, FLOP/s)."""
    from types import SimpleNamespace

    peaks = SimpleNamespace(bandwidth_gbs=26.9, peak_tflops=0.2, threads=2, copy_mb=128, matmul_n=1024)
    hw = measure_this_machine(device="cpu", peaks=peaks)
    assert hw.bandwidth == pytest.approx(26.9e9) and hw.peak_flops == pytest.approx(0.2e12) and hw.measured
    assert "128 MB tensor copy" in hw.source and "2 threads" in hw.name
