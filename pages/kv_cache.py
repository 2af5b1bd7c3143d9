"""KV-cache size page: bytes per token/sequence/batch for MHA, GQA, MQA, MLA and sliding windows, what
fits in a GPU, the decode roofline, and a check against the embedded model's real cache.

UI only: every number comes from ``engine.explain.kv_size``.
"""

from __future__ import annotations

import dataclasses

import html
import math

import plotly.graph_objects as go
import streamlit as st
from streamlit.errors import StreamlitPageNotFoundError

from app.charts import REFERENCE_LINE, log_ticks, show_chart, show_table
from app.registry import PAGES_DIR, available_pages
from app.state import stop_page, sync_url, url_param
from app.teaching import check_yourself, safe_questions
from app.tour import intro
from engine.errors import SpeedupLabError
from engine.explain.kv_size import (
    HARDWARE_PRESETS,
    KV_DTYPES,
    MODEL_PRESETS,
    WEIGHT_DTYPES,
    ModelSpec,
    embedded_model_spec,
    format_bytes,
    kv_report,
    load_hub_config,
    measure_this_machine,
    model_from_config_json,
    real_kv_check,
)
from engine.explain.teaching import kv_questions

EMBEDDED = "SmolLM2-135M-Instruct (embedded)"
CUSTOM = "Your own config.json or Hugging Face id"
PRESETS = [EMBEDDED, *MODEL_PRESETS, CUSTOM]
MEASURED = "This machine (measured)"

# widget key -> (ModelSpec field, lo, hi)
FIELDS = {
    "layers": ("num_layers", 1, 256),
    "heads": ("num_heads", 1, 512),
    "kv_heads": ("num_kv_heads", 1, 512),
    "head_dim": ("head_dim", 1, 1024),
    "window": ("sliding_window", 0, 131072),
    "slide_layers": ("sliding_layers", 0, 256),
    "mla_rank": ("kv_lora_rank", 0, 4096),
    "mla_rope": ("qk_rope_head_dim", 0, 1024),
}


@st.cache_resource(show_spinner="Reading the embedded model's config.json…")
def _embedded_spec() -> ModelSpec:
    return embedded_model_spec()


def _preset_spec(name: str) -> ModelSpec | None:
    if name == EMBEDDED:
        return _embedded_spec()
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    return st.session_state.get("custom_spec")


def _apply(spec: ModelSpec) -> None:
    """Write a model's values into the widgets' session state (clamped to the sliders' ranges)."""
    clamped = []
    for key, (attr, lo, hi) in FIELDS.items():
        v = int(getattr(spec, attr))
        if not lo <= v <= hi:
            clamped.append(f"{attr}={v}")
        st.session_state[key] = min(max(v, lo), hi)
    st.session_state["params_b"] = round(spec.params / 1e9, 6)
    st.session_state["active_b"] = round((spec.active_params or 0) / 1e9, 6)
    st.session_state["clamped"] = clamped


def _on_preset() -> None:
    spec = _preset_spec(st.session_state["preset"])
    if spec is not None:
        _apply(spec)


def _measure(again: bool = False) -> None:
    # a callback runs before the script, so the device list already has the result: no st.rerun(), whose
    # interrupted run could leave the sliders' state at their minimums (seen in full e2e runs)
    from app.resources import dated_machine_peaks, remeasure_machine_peaks
    from engine.decoding.models import resolve_device

    dev = resolve_device(None).type
    if dev != "cpu":  # a GPU measures its own
        st.session_state["measured_hw"] = measure_this_machine()
        return
    if again:
        remeasure_machine_peaks(dev)
    # the CPU's numbers are the ones What-if's roofline shows: one stored, dated measurement (engine.explain.machine)
    dated = dated_machine_peaks(dev)
    hw = measure_this_machine(peaks=dated.peaks)
    st.session_state["measured_hw"] = dataclasses.replace(
        hw, source=dated.words() + " (one measurement, the same on What-if's roofline)")


def _on_hub() -> None:
    try:
        spec = load_hub_config(st.session_state.get("hub_id", ""))
    except SpeedupLabError as e:
        st.session_state["custom_error"] = str(e)
        return
    st.session_state["custom_error"] = None
    st.session_state["custom_spec"] = spec
    _apply(spec)


st.title("🧮 KV-cache size: MHA, GQA and MQA")
intro(
    "During decode every layer keeps a **key** and a **value** vector for every earlier token, per "
    "KV head: the **KV cache**. Its size is `2 · layers · KV heads · head dim · tokens · bytes`, and "
    "each decode step reads all of it again, together with every weight. Grouped-query attention (GQA) "
    "lets a group of query heads share one KV head, multi-query attention (MQA) shares a single one, "
    "and latent attention (MLA) caches one small compressed vector per layer instead. These are choices "
    "made when the model is trained, not serving switches. Pick a real model or move the sliders."
)

# ---------------------------------------------------------------------------------------------- model
preset = url_param("preset", EMBEDDED, str, choices=PRESETS)
try:
    base = _preset_spec(preset)
except SpeedupLabError as e:
    st.error(str(e))
    base = MODEL_PRESETS["Llama-3.1-8B"]
if base is None:
    base = MODEL_PRESETS["Llama-3.1-8B"]
def _slider_value(key: str) -> int:
    """The preset's value of a shape slider, clamped into the slider's range."""
    attr, lo, hi = FIELDS[key]
    return min(max(int(getattr(base, attr)), lo), hi)


for key, (attr, lo, hi) in FIELDS.items():
    url_param(key, _slider_value(key), int, lo=lo, hi=hi)
url_param("params_b", round(base.params / 1e9, 6), float, lo=0.0, hi=1e5)
url_param("active_b", round((base.active_params or 0) / 1e9, 6), float, lo=0.0, hi=1e5)
url_param("context", 8192, int, lo=0, hi=1_048_576)
url_param("batch", 1, int, lo=1, hi=1024)
url_param("kv_dtype", "bf16", str, choices=KV_DTYPES)
url_param("w_dtype", "bf16", str, choices=WEIGHT_DTYPES)
url_param("usable", 0.9, float, lo=0.5, hi=1.0, step=0.01)

st.selectbox("Model preset (values from its config.json)", PRESETS, key="preset", on_change=_on_preset)
if st.session_state["preset"] == CUSTOM:
    c1, c2 = st.columns(2)
    up = c1.file_uploader("Upload a config.json", type=["json"], key="upload")
    if up is not None and st.session_state.get("upload_seen") != up.file_id:
        st.session_state["upload_seen"] = up.file_id
        try:
            spec = model_from_config_json(up.getvalue(), name=up.name)
        except SpeedupLabError as e:
            st.session_state["custom_error"] = str(e)
        else:
            st.session_state["custom_error"] = None
            st.session_state["custom_spec"] = spec
            _apply(spec)
    c2.text_input("…or a Hugging Face model id", key="hub_id", placeholder="Qwen/Qwen2.5-0.5B")
    c2.button("Load its config", on_click=_on_hub, key="hub_load")
    if st.session_state.get("custom_error"):
        st.error(st.session_state["custom_error"])
    elif st.session_state.get("custom_spec") is not None:
        st.caption(f"Loaded **{st.session_state['custom_spec'].name}** "
                   f"({st.session_state['custom_spec'].source}).")
    else:
        st.info("Nothing loaded yet: until a config is uploaded or loaded, the sliders hold Llama-3.1-8B's "
                "values (the numbers below are for those).")
if st.session_state.get("clamped"):
    st.warning("Some values were outside the sliders' ranges and were clamped: "
               + ", ".join(st.session_state["clamped"]))

col_a, col_b, col_c = st.columns(3)
with col_a:
    st.slider("Layers", 1, 256, key="layers")
    st.slider("Query heads", 1, 512, key="heads")
    st.slider("KV heads (= query heads: MHA, 1: MQA)", 1, 512, key="kv_heads")
    st.slider("Head dimension", 1, 1024, key="head_dim")
with col_b:
    st.slider("Sequence length (tokens)", 0, 1_048_576, key="context")
    st.slider("Batch (sequences)", 1, 1024, key="batch")
    st.select_slider("KV dtype", KV_DTYPES, key="kv_dtype")
    st.select_slider("Weight dtype", WEIGHT_DTYPES, key="w_dtype")
with col_c:
    st.slider("Sliding window (tokens, 0 = none)", 0, 131072, key="window")
    st.slider("Layers that use the window", 0, 256, key="slide_layers")
    st.number_input("Parameters (billions; weights = params × weight bytes)", 0.0, 1e5, key="params_b",
                    format="%.3f")
    st.number_input("Active parameters per token (billions, mixture-of-experts; 0 = all)", 0.0, 1e5,
                    key="active_b", format="%.3f")
with st.expander("Latent attention (MLA, DeepSeek-V2/V3)", expanded=bool(st.session_state["mla_rank"])):
    st.slider("Cached latent width kv_lora_rank (0 = ordinary attention)", 0, 4096, key="mla_rank")
    st.slider("Cached RoPE key width qk_rope_head_dim", 0, 1024, key="mla_rope")

hardware_names = list(HARDWARE_PRESETS)
measured = st.session_state.get("measured_hw")
if measured is not None:
    hardware_names.append(measured.name)
if st.session_state.get("gpu") not in hardware_names:
    st.session_state.pop("gpu", None)
url_param("gpu", "H100 SXM", str, choices=hardware_names)
g1, g2 = st.columns(2)
g1.selectbox("Device for the memory fit and the roofline chart", hardware_names, key="gpu")
g2.slider("Usable share of its memory", 0.5, 1.0, step=0.01, key="usable")

sync_url(["preset", *FIELDS, "params_b", "active_b", "context", "batch", "kv_dtype", "w_dtype", "gpu",
          "usable"])

ss = st.session_state
name = preset if preset != CUSTOM else (ss["custom_spec"].name if ss.get("custom_spec") else "custom")
# sliders moved away from the preset's config (or a link that says so): the figures are for that shape,
# so the name must not claim the preset's
changed = [attr for key, (attr, lo, hi) in FIELDS.items() if ss[key] != _slider_value(key)]
changed += [k for k, v in (("params_b", round(base.params / 1e9, 6)),
                           ("active_b", round((base.active_params or 0) / 1e9, 6))) if abs(ss[k] - v) > 1e-9]
if changed and (preset != CUSTOM or ss.get("custom_spec") is not None):  # else no config to differ from
    t1, t2 = st.columns([4, 1])
    t1.caption(f"Changed from {name}'s config: {', '.join(changed)}. The figures below are for this modified "
               "shape.")
    t2.button("Restore the preset's values", key="kv_restore", on_click=_apply, args=(base,))
    name = f"{name}, modified"
model = ModelSpec(
    name=name, num_layers=ss["layers"], num_heads=ss["heads"], num_kv_heads=ss["kv_heads"],
    head_dim=ss["head_dim"], hidden_size=base.hidden_size, params=int(round(ss["params_b"] * 1e9)),
    active_params=int(round(ss["active_b"] * 1e9)) or None, sliding_window=ss["window"],
    sliding_layers=ss["slide_layers"], kv_lora_rank=ss["mla_rank"],
    qk_rope_head_dim=ss["mla_rope"] if ss["mla_rank"] else 0, source=base.source)

try:
    rep = kv_report(model, ss["context"], ss["batch"], ss["kv_dtype"], ss["w_dtype"], ss["gpu"],
                    ss["usable"], [measured] if measured is not None else None)
except SpeedupLabError as e:
    st.error(str(e))
    stop_page()

# ---------------------------------------------------------------------------------------------- size
m = rep.model
if m.is_mla:
    st.info(f"**Latent attention**: each layer caches {m.kv_lora_rank} + {m.qk_rope_head_dim} = "
            f"{m.kv_lora_rank + m.qk_rope_head_dim} numbers per token, whatever the number of heads.")
else:
    st.info(f"**{m.attention_kind}**: {m.num_heads} query heads share {m.num_kv_heads} "
            f"KV head{'' if m.num_kv_heads == 1 else 's'} "
            f"({m.num_heads // m.num_kv_heads} query head{'' if m.num_heads // m.num_kv_heads == 1 else 's'} per KV "
            "head); each layer caches "
            f"2 × {m.num_kv_heads} × {m.head_dim} = {2 * m.num_kv_heads * m.head_dim} numbers per token.")
if m.sliding_window and m.sliding_layers:
    st.caption(f"{m.sliding_layers} of {m.num_layers} layers keep only the last {m.sliding_window} tokens; "
               "their share of the cache stops growing once the window is full.")
k1, k2, k3, k4 = st.columns(4)
k1.metric(f"KV per token ({rep.kv_dtype})", format_bytes(rep.per_token))
# the length in a pill under the value: a label with it was cut off in 4 columns at 1280 px (presenter)
k2.metric("KV per sequence", format_bytes(rep.per_sequence), delta=f"{rep.context:,} tokens",
          delta_color="off", delta_arrow="off")
k3.metric(f"KV for the batch of {rep.batch}", format_bytes(rep.batch_bytes))
k4.metric(f"Weights ({rep.weight_dtype})", format_bytes(rep.weights))

st.subheader("The same model with MHA and with MQA")
show_table(
    [{"attention": f"{label}: {kind}" if label == "this configuration" else label, "KV heads": str(heads) if heads else "latent",
      "KV per token": format_bytes(pt), "KV for the batch": format_bytes(bb),
      "vs this configuration": f"{bb / rep.batch_bytes:.2f}×" if rep.batch_bytes else "–"}
     for label, kind, heads, pt, bb in rep.compare])

# ---------------------------------------------------------------------------------------------- fit
st.subheader(f"What fits on {rep.gpu}")
fit, hw = rep.fit, rep.hardware[rep.gpu]
if not fit.weights_fit:
    st.warning(f"The weights ({format_bytes(rep.weights)}) do not fit in {ss['usable']:.0%} of "
               f"{hw.name}'s {format_bytes(hw.memory_bytes)}: split the model over several devices or "
               "quantize it.")
else:
    f1, f2, f3 = st.columns(3)
    f1.metric("Memory left for the KV cache", format_bytes(fit.free_bytes))
    f2.metric(f"Longest context at batch {rep.batch}",
              "unbounded (every layer slides)" if fit.max_context is None else f"{fit.max_context:,} tokens")
    f3.metric(f"Largest batch at {rep.context:,} tokens",
              "any (empty cache)" if fit.max_batch is None else f"{fit.max_batch:,}")
    st.caption("Memory is the only limit counted here: the model's trained context window may be "
               "shorter, and activations need some of the memory left.")

# ---------------------------------------------------------------------------------------------- roofline
st.subheader("A decode step on the roofline")
st.markdown(
    "A decode step reads every weight once for the whole batch, plus every sequence's KV cache, and "
    "does about 2 FLOPs per parameter per token plus the attention. Its time is at least "
    "`max(bytes ÷ bandwidth, FLOPs ÷ peak)`. At small batch the bytes win: the step is memory-bound, and "
    "extra tokens per step (like the γ + 1 tokens a speculative verification checks) are almost free.")
rows = []
for n, st_ in rep.steps.items():
    cb, cb0 = rep.compute_bound[n], rep.compute_bound_no_kv[n]
    rows.append({
        "device": n,
        # short headers: eleven columns must fit a 1280-px screen with the sidebar open
        "read / step": format_bytes(st_.bytes_read),
        "of it KV": format_bytes(st_.kv_bytes),
        "GFLOP": f"{st_.flops / 1e9:,.1f}",
        "memory ms": f"{st_.memory_ms:.3f}",
        "compute ms": f"{st_.compute_ms:.3f}",
        "step ms": f"{st_.step_ms:.3f}",
        "bound": st_.bound,
        "tokens/s": f"{st_.tokens / st_.step_ms * 1e3:,.0f}",
        "compute-bound from batch": "never" if cb is None else f"{cb:,}",
        "… with no KV": "never" if cb0 is None else f"{cb0:,}",
    })
show_table(rows)

fig = go.Figure()
fig.add_scatter(x=rep.curve["batch"], y=rep.curve["memory_ms"], name="bytes ÷ bandwidth", mode="lines")
fig.add_scatter(x=rep.curve["batch"], y=rep.curve["compute_ms"], name="FLOPs ÷ peak", mode="lines")
fig.add_scatter(x=rep.curve["batch"], y=rep.curve["step_ms"], name="step time (max)", mode="lines",
                line=dict(width=4, dash="dot"))
# on a log axis plotly.js places a shape at the data value but an annotation at log10 of it: add_vline's
# own annotation at x = 8 stretched the axis to 10^8
fig.add_vline(x=rep.batch, line_dash="dash", line_color=REFERENCE_LINE)
fig.add_annotation(x=math.log10(rep.batch), y=1, yref="paper", showarrow=False, xanchor="left", yanchor="top",
                   text=f" batch {rep.batch}")
# two title lines: one line of model, GPU and context was cut off on a phone (plotly titles do not wrap);
# the model name is user text (an uploaded config's), escaped for plotly's HTML-like labels
fig.update_layout(title=f"{html.escape(m.name)}<br>on {rep.gpu}, {rep.context:,}-token context",
                  xaxis_title="batch (sequences)", yaxis_title="ms per decode step", xaxis_type="log",
                  yaxis_type="log", height=440, margin=dict(t=70, b=40))
ys = rep.curve["memory_ms"] + rep.curve["compute_ms"]
fig.update_xaxes(**log_ticks(1, max(rep.curve["batch"])))
fig.update_yaxes(**log_ticks(min(ys), max(ys)))
show_chart(fig)

cb = rep.compute_bound[rep.gpu]
one = rep.steps[rep.gpu]
st.markdown(
    f"On **{rep.gpu}** at batch {rep.batch} a plain decode step takes **{one.step_ms:.3f} ms**; verifying "
    f"γ = {rep.verify_gamma} draft tokens per sequence (γ + 1 = {rep.verify_gamma + 1} tokens) takes "
    f"**{rep.verify_ms:.3f} ms** ({rep.verify_ms / one.step_ms:.2f}× as long). "
    + ("The step never turns compute-bound at this context: each sequence's KV reads grow as fast as "
       "its FLOPs, so long contexts keep decode memory-bound and speculation keeps paying."
       if cb is None else
       f"From batch **{cb:,}** on the step is compute-bound: extra verified tokens then cost real time, "
       "which is when speculation stops paying."))
whatif = [p for p in available_pages() if p.url_path == "whatif"]
if whatif:
    try:
        st.page_link(str(PAGES_DIR / whatif[0].file), label="What-if: when does speculation stop paying?",
                     icon=whatif[0].icon)
    except StreamlitPageNotFoundError:  # page run alone (AppTest) or added after navigation was built
        st.markdown("See the **What-if** page: when does speculation stop paying?")

# ---------------------------------------------------------------------------------------------- this machine
st.subheader("This machine")
_row = st.container(horizontal=True)
_row.button("This machine's figures" if measured is None else "Measure again", key="kv_measure", on_click=_measure,
            kwargs={"again": measured is not None},
            help="This machine's bandwidth and FLOP/s are measured once (a tensor copy and a matmul, about 2 s) and "
                 "stored, so What-if's roofline shows the same figures; Measure again takes new ones for every page.")
if measured is not None:
    st.caption(f"**{measured.name}**: memory {format_bytes(measured.memory_bytes)}; {measured.source}. It is now in "
               "the table and the device list.")

# ---------------------------------------------------------------------------------------------- reality
st.subheader("Check against a real KV cache")
st.markdown(
    "Run the embedded SmolLM2-135M (fp32 on this CPU) on N tokens, the last 4 one at a time as in "
    "decode, into a `DynamicCache`, and add up the bytes of every layer's key and value tensors. The "
    "calculator's figure for the model's own config.json must be exactly the same.")
url_param("real_n", 64, int, lo=5, hi=1024)
st.slider("Tokens N", 5, 1024, key="real_n")
sync_url(["real_n"])  # also shows the toast for a link's replaced real_n now, not after the next change
if st.button("Run the embedded model", key="real_run"):
    from app.resources import get_model

    try:
        with st.spinner("Running the embedded model…"):
            st.session_state["real_check"] = real_kv_check(get_model("embedded"), ss["real_n"], 4)
    except SpeedupLabError as e:
        st.error(str(e))
chk = st.session_state.get("real_check")
if chk is not None:
    r1, r2, r3 = st.columns(3)
    r1.metric(f"Bytes in the real cache ({chk.tokens} tokens)", f"{chk.measured_bytes:,} B")
    r2.metric("Calculator", f"{int(chk.predicted_bytes):,} B")
    r3.metric("Agree exactly?", "yes ✓" if chk.agrees else "NO ✗")
    st.caption(f"{chk.num_layers} layers × keys and values of shape {list(chk.layer_shape)} in {chk.kv_dtype}.")

# ---------------------------------------------------------------------------------------------- sources
with st.expander("Sources of the presets and the formulas"):
    st.dataframe(
        [{"model": p.name, "attention": p.attention_kind, "layers": p.num_layers, "query heads": p.num_heads,
          "KV heads": p.num_kv_heads, "head dim": p.head_dim, "hidden": p.hidden_size,
          "window": str(p.sliding_window or "–"), "sliding layers": str(p.sliding_layers or "–"),
          "latent (rank + rope)": f"{p.kv_lora_rank} + {p.qk_rope_head_dim}" if p.is_mla else "–",
          "params (B)": f"{p.params / 1e9:.2f}", "source": p.source}
         for p in MODEL_PRESETS.values()], hide_index=True, width="stretch")
    st.dataframe(
        [{"device": h.name, "memory (GB)": f"{h.memory_bytes / 1e9:.0f}",
          "bandwidth (GB/s)": f"{h.bandwidth / 1e9:,.0f}", "peak bf16 dense (TFLOP/s)": f"{h.peak_flops / 1e12:,.1f}",
          "source": h.source} for h in HARDWARE_PRESETS.values()], hide_index=True, width="stretch")
    st.markdown(
        "- KV cache per layer and token: 2 × KV heads × head dim (Vaswani et al. 2017, §3.2.2); "
        "MQA: Shazeer 2019; GQA: Ainslie et al. 2023.\n"
        "- Latent attention: kv_lora_rank + qk_rope_head_dim per layer and token (DeepSeek-V2, §2.1, Table 1).\n"
        "- Sliding window: min(context, window) tokens per sliding layer (Mistral 7B, §2; Gemma 2, §2.2).\n"
        "- FLOPs ≈ 2 × parameters per token (Kaplan et al. 2020, §2.1) + 4 × heads × head dim × context "
        "per layer for attention.\n"
        "- Roofline: time ≥ max(bytes ÷ bandwidth, FLOPs ÷ peak) (Williams, Waterman & Patterson 2009).")

check_yourself("kv", safe_questions(kv_questions, model, ss["context"], ss["batch"], ss["kv_dtype"],
                                    rep.hardware[rep.gpu]))
