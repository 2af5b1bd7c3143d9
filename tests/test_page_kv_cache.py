"""AppTest drives pages/kv_cache.py: presets, sliders, uploads, bad configurations, buttons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.tables import find_table

TIMEOUT = 120
PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "kv_cache.py")  # "pages/kv_cache.py"


def _app() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def test_default_is_embedded_smollm2():
    at = _app()
    assert at.selectbox(key="preset").value.startswith("SmolLM2")
    # read from its config.json: 30 layers, 9 query heads, 3 KV heads, head dim 64
    assert (at.slider(key="layers").value, at.slider(key="heads").value,
            at.slider(key="kv_heads").value, at.slider(key="head_dim").value) == (30, 9, 3, 64)
    m = _metrics(at)
    # 2 · 30 · 3 · 64 · 2 bytes = 23040 B = 22.5 KiB; × 8192 tokens = 188743680 B = 180 MiB
    assert m["KV per token (bf16)"] == "22.5 KiB"
    assert m["KV per sequence"] == "180 MiB"
    assert {x.label: x.delta for x in at.metric}["KV per sequence"] == "8,192 tokens"
    assert not _errors(at)


def test_presets_llama_falcon_deepseek():
    at = _app()
    at.selectbox(key="preset").set_value("Llama-3.1-8B").run()
    assert not at.exception
    assert at.slider(key="kv_heads").value == 8
    assert _metrics(at)["KV per token (bf16)"] == "128 KiB"
    at.selectbox(key="preset").set_value("Falcon-7B (MQA)").run()
    assert _metrics(at)["KV per token (bf16)"] == "8 KiB"  # 2·32·1·64·2
    at.selectbox(key="preset").set_value("Llama-2-7B (MHA)").run()
    assert _metrics(at)["KV per token (bf16)"] == "512 KiB"  # 2·32·32·128·2
    at.selectbox(key="preset").set_value("DeepSeek-V3 (MLA, MoE)").run()
    assert at.slider(key="mla_rank").value == 512
    assert _metrics(at)["KV per token (bf16)"] == "68.6 KiB"  # 61·576·2 = 70272 B
    assert any("Latent attention" in i.value for i in at.info)


def test_sliders_and_dtype_change_numbers():
    at = _app()
    at.selectbox(key="preset").set_value("Llama-3.1-8B").run()
    at.slider(key="kv_heads").set_value(1).run()          # MQA: 2·32·1·128·2 = 16 KiB
    assert _metrics(at)["KV per token (bf16)"] == "16 KiB"
    at.select_slider(key="kv_dtype").set_value("fp32").run()  # ×2
    assert _metrics(at)["KV per token (fp32)"] == "32 KiB"
    at.slider(key="context").set_value(1000)
    at.slider(key="batch").set_value(4).run()
    # 4 · 1000 · 32768 B = 131072000 B = 125 MiB
    assert _metrics(at)["KV for the batch of 4"] == "125 MiB"
    assert at.query_params["batch"] in (["4"], "4")  # shared in the URL


def test_sliding_window_caps_the_sequence():
    at = _app()
    at.selectbox(key="preset").set_value("Gemma-2-9B (alternating sliding window)").run()
    assert (at.slider(key="window").value, at.slider(key="slide_layers").value) == (4096, 21)
    at.slider(key="context").set_value(8192).run()
    # 8192·(21·8192 + 21·4096) = 2113929216 B = 1.97 GiB
    assert _metrics(at)["KV per sequence"] == "1.97 GiB"


@pytest.mark.parametrize("key, value, words", [
    ("kv_heads", 4, "do not divide"),   # 4 KV heads vs 9 query heads
    ("kv_heads", 12, "more KV heads"),
    ("slide_layers", 40, "impossible"),  # 40 sliding layers of 30
])
def test_nonsense_configuration_shows_error(key, value, words):
    at = _app()
    if key == "slide_layers":
        at.slider(key="window").set_value(128)
    at.slider(key=key).set_value(value).run()
    assert not at.exception
    errs = _errors(at)
    assert errs and words in errs[0]
    assert not at.metric  # nothing computed from a nonsense model


def test_a_link_with_too_few_layers_opens_with_one_layer_and_says_so():
    """A link's layers=-5 became 0 (the slider's old minimum), and the page then refused 0 layers: a link's value is
    clamped to a model the page can draw."""
    at = AppTest.from_file(PAGE, default_timeout=TIMEOUT)  # a new browser opening the link
    at.query_params["layers"] = "-5"
    at.run()
    assert not at.exception and not _errors(at)
    assert at.slider(key="layers").value == 1
    assert any("layers=-5 → 1" in t.value for t in at.toast)
    assert at.metric  # the numbers are shown for the clamped model


def test_upload_config_json_and_bad_upload():
    at = _app()
    at.selectbox(key="preset").set_value("Your own config.json or Hugging Face id").run()
    # before anything is loaded the page says whose numbers it shows (a user read them as the own model's)
    assert any("Nothing loaded yet" in i.value and "Llama-3.1-8B" in i.value for i in at.info)
    cfg = {"model_type": "qwen2", "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "hidden_size": 896, "intermediate_size": 4864, "vocab_size": 151936}
    at.file_uploader(key="upload").upload("config.json", json.dumps(cfg).encode(), "application/json").run()
    assert not at.exception and not _errors(at)
    assert (at.slider(key="layers").value, at.slider(key="kv_heads").value,
            at.slider(key="head_dim").value) == (24, 2, 64)
    # 2 · 24 · 2 · 64 · 2 = 12288 B = 12 KiB
    assert _metrics(at)["KV per token (bf16)"] == "12 KiB"
    assert not any("Nothing loaded yet" in i.value for i in at.info)

    at2 = _app()
    at2.selectbox(key="preset").set_value("Your own config.json or Hugging Face id").run()
    bad = {"num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 60}
    at2.file_uploader(key="upload").upload("bad.json", json.dumps(bad).encode(), "application/json").run()
    assert not at2.exception
    assert any("do not divide" in e for e in _errors(at2))
    at3 = _app()
    at3.selectbox(key="preset").set_value("Your own config.json or Hugging Face id").run()
    at3.file_uploader(key="upload").upload("x.json", b"{oops", "application/json").run()
    assert any("not valid JSON" in e for e in _errors(at3))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from engine.decoding import models

    models.hub_reachable.cache_clear()
    try:
        at = _app()
        at.selectbox(key="preset").set_value("Your own config.json or Hugging Face id").run()
        at.text_input(key="hub_id").set_value("no-such-org/no-such-model-kv").run()
        at.button(key="hub_load").click().run()
        assert not at.exception
        assert any("Could not load" in e for e in _errors(at))
    finally:
        models.hub_reachable.cache_clear()


def test_roofline_table_and_device_choice():
    at = _app()
    at.selectbox(key="preset").set_value("Llama-3.1-8B").run()
    at.slider(key="context").set_value(0).run()
    at.selectbox(key="gpu").set_value("H100 SXM").run()
    assert not at.exception
    df = find_table(at, "bound")  # the roofline table
    row = df[df["device"] == "H100 SXM"].iloc[0]
    # empty cache, compute-bound from batch 296 (989e12 / 3.35e12 = 295.2)
    assert row["compute-bound from batch"] == "296"
    # step: 16060522496 B / 3.35e12 B/s = 4.794 ms
    assert row["step ms"] == "4.794"
    assert "296" in " ".join(md.value for md in at.markdown)
    # the batch marker on the log-log roofline chart: the line at the data value, its label at log10 of it
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    fig = next(f for f in specs if f["layout"]["xaxis"].get("type") == "log")
    (line,), (label,) = fig["layout"]["shapes"], fig["layout"]["annotations"]
    assert line["x0"] == at.session_state["batch"] and 10 ** label["x"] == pytest.approx(line["x0"])


def test_measure_button_adds_this_machine():
    at = _app()
    at.button(key="kv_measure").click().run()
    assert not at.exception
    names = at.selectbox(key="gpu").options
    assert any(n.startswith("This machine") for n in names)
    # one stored, dated measurement: the words What-if's roofline shows too (engine.explain.machine)
    from engine.explain.machine import stored_peaks

    words = stored_peaks("cpu").words()
    assert any(words in c.value for c in at.caption)
    assert at.button(key="kv_measure").label == "Measure again"


@pytest.mark.slow
def test_real_check_button_agrees():
    at = _app()
    at.slider(key="real_n").set_value(20).run()
    at.button(key="real_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    m = _metrics(at)
    # 20 tokens · 46080 B (2·30·3·64·4 bytes in fp32) = 921600 B
    assert m["Bytes in the real cache (20 tokens)"] == "921,600 B"
    assert m["Calculator"] == "921,600 B"
    assert m["Agree exactly?"] == "yes ✓"


def test_moved_sliders_rename_the_model_and_restore_brings_the_preset_back():
    """A user's report: with Llama-3.1-70B picked and the shape changed (here by a link), the title and the
    quiz still said Llama-3.1-70B while the numbers were for 30 layers, 9/3 heads."""
    at = _app()
    for k, v in {"preset": "Llama-3.1-70B", "layers": "30", "kv_heads": "3", "heads": "9", "head_dim": "64"}.items():
        at.query_params[k] = v
    at.run()
    assert any("Changed from Llama-3.1-70B's config" in c.value for c in at.caption)
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert any(t.startswith("Llama-3.1-70B, modified<br>on") for t in titles)
    at.button(key="kv_restore").click().run()
    # Llama-3.1-70B's config: 80 layers, 64 query heads, 8 KV heads, head dim 128
    assert [at.slider(key=k).value for k in ("layers", "heads", "kv_heads", "head_dim")] == [80, 64, 8, 128]
    assert not any("Changed from" in c.value for c in at.caption)


def test_a_link_to_an_unchanged_preset_is_not_called_modified():
    """The URL kept params_b = 70.5537 ("{:g}") for Llama-3.1-70B's 70.553706 B: a shared link to the plain
    preset opened as "Llama-3.1-70B, modified". Values now travel with 15 significant digits."""
    at = _app()
    at.selectbox(key="preset").set_value("Llama-3.1-70B").run()
    link = {k: at.query_params[k] for k in at.query_params}
    assert link["params_b"] == "70.553706"
    fresh = AppTest.from_file(PAGE, default_timeout=TIMEOUT)  # a new browser opening the link
    for k, v in link.items():
        fresh.query_params[k] = v
    fresh.run()
    assert not [c.value for c in fresh.caption if "Changed from" in c.value], link


def test_an_uploaded_name_is_escaped_in_the_chart_title():
    # the model name of an upload is user text: plotly titles read tags, so it is escaped
    at = _app()
    at.selectbox(key="preset").set_value("Your own config.json or Hugging Face id").run()
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "intermediate_size": 128, "vocab_size": 1000}
    at.file_uploader(key="upload").upload("<i>x</i>.json", json.dumps(cfg).encode(), "application/json").run()
    titles = [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in at.get("plotly_chart")]
    assert any("&lt;i&gt;x&lt;/i&gt;" in t for t in titles) and not any("<i>" in t for t in titles)
