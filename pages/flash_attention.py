"""FlashAttention page: attention in tiles with a running softmax, step by step; the main-memory traffic
it saves; and a measurement of naive vs fused attention on this machine.

UI only: every number comes from ``engine.explain.flash``.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from app.charts import log_ticks, show_chart, show_table
from app.state import stop_page, sync_url, url_param
from app.teaching import check_yourself, safe_questions
from app.tour import intro
from engine.errors import SpeedupLabError
from engine.explain.flash import (
    CURVE_N_MAX,
    DEFAULT_PRESET,
    HARDWARE_PRESETS,
    PAPER_EXAMPLE,
    STEP_BLOCK_MAX,
    STEP_D_MAX,
    STEP_N_MAX,
    flash_report,
    format_bytes,
    measure_attention,
)
from engine.explain.teaching import flash_questions

ORDERS = {"kv_outer": "K/V blocks outside (FlashAttention, Algorithm 1)",
          "q_outer": "Q blocks outside (FlashAttention-2)"}
DTYPES = {2: "fp16 / bf16 (2 bytes)", 4: "fp32 (4 bytes)"}
N_MAX_CHOICES = [2 ** p for p in range(10, 18)]        # 1,024 … 131,072
MEASURE_N_CHOICES = [512, 1024, 2048, 4096]
MEASURE_LIMIT = 1536 * 1024 ** 2                      # never let naive S and P exceed 1.5 GiB


@st.cache_data(show_spinner=False, max_entries=32)
def _report(**kwargs):
    return flash_report(**kwargs)


def _n_axis(fig: go.Figure, ns: list[int]) -> None:
    """Log x axis with a tick at every measured/modelled N (powers of two)."""
    fig.update_xaxes(type="log", title="sequence length N", tickvals=ns,
                     ticktext=[f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])


def _on_preset() -> None:
    st.session_state["sram"] = HARDWARE_PRESETS[st.session_state["fa_gpu"]].sram_kib


def _move(delta: int, n_steps: int) -> None:
    st.session_state["step"] = int(min(max(st.session_state.get("step", 1) + delta, 1), n_steps))


st.title("⚡ FlashAttention: exact attention in tiles")
intro(
    "Standard attention builds the whole N × N score matrix in the GPU's main memory (HBM), reads it "
    "back for the softmax, writes the probabilities, and reads those again to mix the values. "
    "**FlashAttention** never builds that matrix. It brings a block of queries and a block of keys and "
    "values into the small, fast on-chip memory (SRAM), scores them there, and folds the result into a "
    "**running softmax**: per query row a running maximum *m*, a running sum *ℓ* and an unnormalized "
    "output, rescaled whenever a new tile raises the maximum. The answer is the same; far fewer bytes "
    "travel to and from main memory, and the extra memory grows like N instead of N²."
)

# ---------------------------------------------------------------------------------------------- widgets
url_param("n", 10, int, lo=1, hi=STEP_N_MAX)
url_param("d", 4, int, lo=1, hi=STEP_D_MAX)
url_param("br", 4, int, lo=1, hi=STEP_BLOCK_MAX)
url_param("bc", 3, int, lo=1, hi=STEP_BLOCK_MAX)
url_param("causal", False, bool)
url_param("order", "kv_outer", str, choices=list(ORDERS))
url_param("seed", 0, int, lo=0, hi=9999)
url_param("fa_gpu", DEFAULT_PRESET, str, choices=list(HARDWARE_PRESETS))
url_param("sram", HARDWARE_PRESETS[st.session_state["fa_gpu"]].sram_kib, int, lo=1, hi=1024)
url_param("td", 64, int, choices=[32, 64, 128, 256])
url_param("bpe", 2, int, choices=list(DTYPES))
url_param("nmax", 16384, int, choices=N_MAX_CHOICES)
url_param("bh", 1, int, lo=1, hi=4096)

st.header("1 · Tiled attention, step by step")
st.caption("A small random example (fp32): Q, K and V are N × d. Br query rows meet Bc key/value rows per tile.")
c1, c2, c3, c4 = st.columns(4)
c1.slider("Sequence length N", 1, STEP_N_MAX, key="n")
c2.slider("Head dimension d", 1, STEP_D_MAX, key="d")
c3.slider("Query block Br", 1, STEP_BLOCK_MAX, key="br")
c4.slider("Key/value block Bc", 1, STEP_BLOCK_MAX, key="bc")
c1, c2, c3 = st.columns([1, 2, 1])
c1.toggle("Causal", key="causal", help="Causal mask: query row i sees only key columns 0 … i (as in a decoder).")
c2.radio("Loop order", list(ORDERS), format_func=ORDERS.get, key="order", horizontal=True)
c3.number_input("Random seed", 0, 9999, key="seed")

with st.sidebar:
    st.subheader("Traffic model")
    st.selectbox("GPU (on-chip memory per SM)", list(HARDWARE_PRESETS), key="fa_gpu", on_change=_on_preset)
    st.number_input("On-chip memory M per SM (KiB)", 1, 1024, key="sram",
                    help="Combined L1 + shared memory per streaming multiprocessor, from the preset; edit to try "
                         "other sizes.")
    st.selectbox("Head dimension d (traffic model)", [32, 64, 128, 256], key="td",
                 help="For the traffic and memory charts; the step-by-step example above has its own d.")
    st.selectbox("Element size", list(DTYPES), format_func=DTYPES.get, key="bpe")
    st.selectbox("Largest N in the charts", N_MAX_CHOICES, key="nmax", format_func=lambda v: f"{v:,}")
    st.number_input("Batch × heads", 1, 4096, key="bh", help="Traffic and memory are per head; this multiplies them.")

sync_url(["n", "d", "br", "bc", "causal", "order", "seed", "fa_gpu", "sram", "td", "bpe", "nmax", "bh"])

ss = st.session_state
try:
    rep = _report(n=ss["n"], d=ss["d"], block_q=ss["br"], block_k=ss["bc"], causal=ss["causal"],
                  order=ss["order"], seed=ss["seed"], preset=ss["fa_gpu"], sram_kib=ss["sram"],
                  curve_d=ss["td"], curve_n_max=ss["nmax"], bytes_per_element=ss["bpe"], batch_heads=ss["bh"])
except SpeedupLabError as e:
    st.error(str(e))
    stop_page()

tr = rep.trace
n_steps = len(tr.steps)

# ---------------------------------------------------------------------------------------------- stepping
st.markdown(
    f"N = {tr.n} with Br = {tr.block_q} and Bc = {tr.block_k} gives T_r = ⌈N/Br⌉ = **{tr.t_r}** query blocks and "
    f"T_c = ⌈N/Bc⌉ = **{tr.t_c}** key/value blocks: **{n_steps}** tiles to visit"
    + (f" ({tr.t_r * tr.t_c - n_steps} skipped: every entry is masked)." if tr.causal else ".")
)
url_param("step", 1, int, lo=1, hi=n_steps)  # a link past the last tile names the real last one
if ss["step"] > n_steps:
    ss["step"] = n_steps
if n_steps > 1:
    b1, b2, b3 = st.columns([2, 5, 2])
    b1.button("◀ Previous", on_click=_move, args=(-1, n_steps), key="prev", width="stretch")
    b2.slider("Tile step", 1, n_steps, key="step", label_visibility="collapsed")
    b3.button("Next ▶", on_click=_move, args=(1, n_steps), key="next", width="stretch")
    k = ss["step"] - 1
else:
    k = 0
sync_url(["step"])
step = tr.steps[k]
r0, r1 = step.rows
c0, c1_ = step.cols


def _rows(a: int, b: int) -> str:
    """Rows a … b − 1 as text: "4–7 (4 rows)", or "4 (1 row)"."""
    return f"{a}–{b - 1} ({b - a} rows)" if b - a != 1 else f"{a} (1 row)"


left, right = st.columns([2, 3])
with left:
    st.markdown(f"**Step {k + 1} of {n_steps}** — in fast memory now:")
    st.markdown(f"- Q block **i = {step.i}**: query rows {_rows(r0, r1)}\n"
                f"- K, V block **j = {step.j}**: key/value rows {_rows(c0, c1_)}")
    # Tile map: done / now / to do / skipped.
    status = np.where(tr.grid < 0, 0, np.where(tr.grid < k, 1, np.where(tr.grid == k, 3, 2)))
    labels = np.where(tr.grid < 0, "masked", (tr.grid + 1).astype(str))
    fig = go.Figure(go.Heatmap(
        z=status, zmin=0, zmax=3, showscale=False, xgap=2, ygap=2,
        colorscale=[[0, "#9ca3af"], [0.25, "#9ca3af"], [0.25, "#93c5fd"], [0.5, "#93c5fd"],
                    [0.5, "#f1f5f9"], [0.75, "#f1f5f9"], [0.75, "#f97316"], [1, "#f97316"]],
        text=labels, texttemplate="%{text}", hovertemplate="Q block %{y}, K/V block %{x}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", title="Q block i", dtick=1)
    fig.update_xaxes(title="K/V block j", dtick=1, side="top")
    fig.update_layout(height=300, margin=dict(l=10, r=10, t=40, b=10))
    st.markdown("**Tiles** — orange: now, blue: done, light: still to come, grey: skipped (all masked). "
                "Numbers give the visit order.")
    show_chart(fig, key="tilemap")
with right:
    sc = np.where(np.isinf(step.scores), np.nan, step.scores)
    fig = go.Figure(go.Heatmap(
        z=sc, x=list(range(c0, c1_)), y=list(range(r0, r1)), colorscale="RdBu", zmid=0,
        text=np.where(np.isnan(sc), "−∞", np.round(step.scores, 2).astype(str)), texttemplate="%{text}",
        hovertemplate="row %{y}, key %{x}: %{z:.3f}<extra></extra>", colorbar=dict(title="score")))
    fig.update_yaxes(autorange="reversed", title="query row", dtick=1)
    fig.update_xaxes(title="key column", dtick=1)
    fig.update_layout(height=320, margin=dict(l=10, r=10, t=50, b=10),
                      title=dict(text=f"Score tile S_ij = Q_i K_jᵀ / √d ({r1 - r0} × {c1_ - c0})", font_size=13))
    show_chart(fig, key="scoretile")


def _f(x: float) -> str:
    return "−∞" if np.isneginf(x) else f"{x:.4f}"


rows = []
for t in range(r1 - r0):
    rescale = (f"{np.exp(step.m_before[t] - step.m_after[t]):.4f}" if np.isfinite(step.m_before[t])
               else "— (first tile)")
    rows.append({
        "row": r0 + t,
        "m before": _f(step.m_before[t]), "tile max m̃": _f(step.m_tile[t]), "m after": _f(step.m_after[t]),
        "rescale e^(m before − m after)": rescale,
        "ℓ before": f"{step.l_before[t]:.4f}", "tile sum ℓ̃": f"{step.l_tile[t]:.4f}",
        "ℓ after": f"{step.l_after[t]:.4f}",
        "output row before": "[" + ", ".join(f"{x:.3f}" for x in step.out_before[t][:3])
                             + (", …]" if tr.d > 3 else "]"),
        "output row after": "[" + ", ".join(f"{x:.3f}" for x in step.out_after[t][:3])
                            + (", …]" if tr.d > 3 else "]"),
    })
st.subheader("Running maximum m and sum ℓ of this Q block", anchor="running-max-and-sum")
if n_steps > 1:  # step from here too: on a projector the tile buttons above are off screen with this table
    t1, t2, t3 = st.columns([2, 5, 2], vertical_alignment="center")
    t1.button("◀ Previous", on_click=_move, args=(-1, n_steps), key="prev_table", width="stretch",
              disabled=k == 0)
    t2.markdown(f"Tile **{k + 1} of {n_steps}**: Q block i = {step.i}, K/V block j = {step.j}")
    t3.button("Next ▶", on_click=_move, args=(1, n_steps), key="next_table", width="stretch",
              disabled=k == n_steps - 1)
st.caption("ℓ is measured against the current m; the output shown is the running Õ / ℓ.")
show_table(rows)
st.caption("When a tile brings a larger score, m rises and everything summed so far is multiplied by "
           "e^(m_old − m_new) < 1 before the tile's own terms are added; that rescaling is what makes the "
           "tile-by-tile result exact.")

st.subheader("After the last tile")
m1, m2, m3 = st.columns(3)
m1.metric("max |tiled − standard|", f"{tr.max_abs_diff:.2e}",
          help="Largest absolute difference between the tiled output and softmax(QKᵀ/√d)V computed at once (fp32).")
m2.metric("max |m − full-row max|", f"{float(np.max(np.abs(tr.m_final - tr.row_max))):.2e}")
m3.metric("max |ℓ − full-row sum| / sum",
          f"{float(np.max(np.abs(tr.l_final - tr.row_sum) / tr.row_sum)):.2e}")
if tr.max_abs_diff < 1e-5:
    st.success(f"Exact up to fp32 rounding: the difference {tr.max_abs_diff:.1e} is below 1e-5.")
else:  # pragma: no cover - the tests make sure this does not happen
    st.warning(f"Difference {tr.max_abs_diff:.1e} exceeds 1e-5.")

# ---------------------------------------------------------------------------------------------- traffic
cv = rep.curve
st.header("2 · Memory traffic and memory use")
st.markdown(
    f"**{rep.preset.name}**, M = {ss['sram']} KiB per SM = **{cv.m_elements:,} elements** of "
    f"{cv.bytes_per_element} bytes. The paper's block sizes: Bc = ⌈M/4d⌉ = **{cv.block_k}**, "
    f"Br = min(⌈M/4d⌉, d) = **{cv.block_q}** (d = {cv.d}). Counts are exact loads and stores of the paper's "
    "Algorithm 0 (standard) and Algorithm 1 (FlashAttention forward), for "
    f"{cv.batch_heads:,} head(s)."
)
ch1, ch2 = st.columns(2)
with ch1:
    fig = go.Figure()
    fig.add_scatter(x=cv.ns, y=cv.standard_bytes, name="standard (Algorithm 0)", mode="lines+markers")
    fig.add_scatter(x=cv.ns, y=cv.flash_bytes, name="FlashAttention (Algorithm 1)", mode="lines+markers")
    _n_axis(fig, cv.ns)
    fig.update_yaxes(type="log", title="bytes read + written (HBM)", tickformat="~s")
    fig.update_layout(title="Main-memory traffic, one forward pass", height=380,
                      legend=dict(orientation="h", y=-0.25), margin=dict(t=50))
    show_chart(fig, key="traffic")
with ch2:
    fig = go.Figure()
    fig.add_scatter(x=cv.ns, y=cv.standard_extra_bytes, name="standard: S and P (2N²)", mode="lines+markers")
    fig.add_scatter(x=cv.ns, y=cv.flash_extra_bytes, name="FlashAttention: m and ℓ (2N)", mode="lines+markers")
    _n_axis(fig, cv.ns)
    fig.update_yaxes(type="log", title="extra main memory (bytes)", tickformat="~s")
    fig.update_layout(title="Extra memory beyond Q, K, V, O", height=380,
                      legend=dict(orientation="h", y=-0.25), margin=dict(t=50))
    show_chart(fig, key="extra")

sn, fn = rep.standard_at_n, rep.flash_at_n
st.markdown(f"**At N = {sn.n:,}** (per head): standard moves {format_bytes(sn.bytes)}, FlashAttention "
            f"{format_bytes(fn.bytes)} — **{sn.bytes / fn.bytes:.1f}× less** "
            f"({fn.tiles:,} tiles of {fn.block_q} × {fn.block_k}).")
tensors = ["Q", "K", "V", "S", "P", "O", "m, ℓ"]
show_table(
    [{"tensor": t,
      "standard reads": f"{sn.reads.get(t, 0):,}", "standard writes": f"{sn.writes.get(t, 0):,}",
      "flash reads": f"{fn.reads.get(t, 0):,}", "flash writes": f"{fn.writes.get(t, 0):,}"} for t in tensors]
    + [{"tensor": "total (elements)", "standard reads": f"{sn.read_elements:,}",
        "standard writes": f"{sn.write_elements:,}", "flash reads": f"{fn.read_elements:,}",
        "flash writes": f"{fn.write_elements:,}"}])

pc = rep.paper
st.subheader("The paper's example: GPT-2 medium on an A100")
st.table([
    {"": "Dao et al. 2022, Figure 2 (measured)", "standard": f"{pc.paper_standard_gb} GB",
     "FlashAttention": f"{pc.paper_flash_gb} GB", "ratio": f"{pc.paper_ratio:.1f}×",
     "what": "forward + backward, profiled on the GPU"},
    {"": "this model (Algorithms 0 and 1)", "standard": f"{pc.model_standard_gb:.2f} GB",
     "FlashAttention": f"{pc.model_flash_gb:.2f} GB", "ratio": f"{pc.model_ratio:.1f}×",
     "what": f"forward only, Br = {pc.flash.block_q}, Bc = {pc.flash.block_k}"},
], border="horizontal", hide_index=True)
st.markdown(
    f"Same workload: N = {PAPER_EXAMPLE['n']:,}, d = {PAPER_EXAMPLE['d']}, {PAPER_EXAMPLE['heads']} heads × batch "
    f"{PAPER_EXAMPLE['batch']} = {pc.heads_total:,} heads, fp16, M = 192 KiB. The model's numbers are smaller "
    "than the paper's because they count **only the forward pass** and only the loads and stores written "
    "in the two algorithms. The paper profiled forward **and backward**: standard attention's backward pass "
    "writes and reads further N × N matrices (the gradients of P and S), and, as the paper notes in "
    "Section 2.2, real implementations add elementwise passes over N × N (a mask on S, dropout on P) that "
    "Algorithm 0 leaves out. FlashAttention's backward recomputes its tiles from Q, K, V, m and ℓ instead. "
    f"The measured ratio is {pc.paper_ratio:.1f}×, the forward-only model's {pc.model_ratio:.1f}×; both say "
    "the same thing: the N × N traffic, not the arithmetic, is what FlashAttention removes. No constant "
    "here was tuned to match the paper."
)
with st.expander("Hardware presets and sources"):
    st.dataframe([{"GPU": p.name, "L1 + shared per SM (KiB)": p.sram_kib,
                   "max shared per SM (KiB)": p.max_shared_kib, "SMs": p.sms, "HBM (TB/s)": p.hbm_tb_s,
                   "source": p.source} for p in HARDWARE_PRESETS.values()], hide_index=True, width="stretch")
    st.caption("The model uses the combined L1 + shared figure as M, as the paper does for the A100 (192 KB). "
               "Type the smaller 'max shared' value into M to see the stricter case.")

# ---------------------------------------------------------------------------------------------- measured
st.header("3 · Measured on this machine")
st.markdown(
    "Naive PyTorch attention (`softmax(q kᵀ/√d) v`, which materializes the N × N scores) against PyTorch's "
    "fused `scaled_dot_product_attention`, whose CPU kernel also works in tiles with a running softmax. "
    "fp32, one sequence, random inputs, d = 64, run in a separate worker process on one CPU thread; time "
    "is the best of 3 runs; memory is the rise of the worker's peak resident memory during one call. "
    "Sizes whose naive matrices would pass 1.5 GiB are not run."
)
url_param("mheads", 4, int, lo=1, hi=8)
url_param("mnmax", 2048, int, choices=MEASURE_N_CHOICES)
url_param("mcausal", False, bool)
d1, d2, d3 = st.columns(3)
d1.slider("Heads", 1, 8, key="mheads")
d2.selectbox("Largest N", MEASURE_N_CHOICES, key="mnmax", format_func=lambda v: f"{v:,}")
d3.toggle("Causal", key="mcausal")
sync_url(["mheads", "mnmax", "mcausal"])
if st.button("Measure naive vs fused attention (a few seconds)", key="fa_measure"):
    ns = [n for n in [128, 256, 512, 1024, 2048, 4096] if n <= ss["mnmax"]]
    with st.spinner("Measuring…"):
        try:
            ss["measured"] = (measure_attention(ns, d=64, heads=ss["mheads"], causal=ss["mcausal"], repeats=3,
                                                memory_limit_bytes=MEASURE_LIMIT),
                              ss["mheads"], ss["mcausal"])
        except SpeedupLabError as e:
            st.error(str(e))
meas = ss.get("measured")
if meas:
    ms, heads, causal = meas
    naive = [m for m in ms if m.method == "naive"]
    fused = [m for m in ms if m.method == "fused"]
    st.caption(f"Last measurement: {heads} head(s), d = 64, {'causal' if causal else 'no mask'}.")
    e1, e2 = st.columns(2)
    with e1:
        fig = go.Figure()
        fig.add_scatter(x=[m.n for m in naive], y=[m.ms for m in naive], name="naive", mode="lines+markers")
        fig.add_scatter(x=[m.n for m in fused], y=[m.ms for m in fused], name="fused SDPA", mode="lines+markers")
        _n_axis(fig, sorted({m.n for m in ms}))
        times = [m.ms for m in ms if m.ms > 0]
        # 1-2-5 labels (plotly's own log ticks printed "2, 100, 5, 2, 10, 5 …", the 5 under 1 meaning 0.5)
        fig.update_yaxes(type="log", title="time (ms)", **log_ticks(min(times) / 2, max(times) * 2))
        fig.update_layout(title="Time per call", height=360, legend=dict(orientation="h", y=-0.25),
                          margin=dict(t=50))
        show_chart(fig, key="mtime")
    with e2:
        fig = go.Figure()
        for series, name in ((naive, "naive"), (fused, "fused SDPA")):
            fig.add_scatter(x=[m.n for m in series], y=[m.peak_extra_bytes or 0 for m in series],
                            name=f"{name}: measured", mode="markers", marker_size=10)
            fig.add_scatter(x=[m.n for m in series], y=[m.predicted_extra_bytes for m in series],
                            name=f"{name}: model", mode="lines", line_dash="dash")
        _n_axis(fig, sorted({m.n for m in ms}))
        fig.update_yaxes(type="log", title="peak extra memory (bytes)", tickformat="~s")
        fig.update_layout(title="Peak extra memory: measured vs model", height=360,
                          legend=dict(orientation="h", y=-0.25), margin=dict(t=50))
        show_chart(fig, key="mmem")
    show_table([{"N": m.n, "method": m.method, "time (ms)": f"{m.ms:.2f}",
                   "peak extra memory": format_bytes(m.peak_extra_bytes) if m.peak_extra_bytes is not None else "n/a",
                   "model": format_bytes(m.predicted_extra_bytes),
                "max |naive − fused|": f"{m.max_abs_diff:.1e}"} for m in ms])
    st.caption("The model for naive is S and P (2·heads·N²·4 bytes) plus the output; for the fused kernel the "
               "output only. Below about 1 MB the reading is unreliable (the kernel updates its resident-size "
               "counters lazily, and the allocator may reuse memory it already holds), so small N reads low. On a CPU the time gap comes from cache traffic rather than HBM, so it is "
               "not the GPU model's ratio.")

check_yourself("flash", safe_questions(flash_questions, ss["td"], ss["sram"], ss["bpe"], ss["nmax"], n_small=ss["n"],
                                       d_small=ss["d"], block_q=ss["br"], block_k=ss["bc"], seed=ss["seed"]))
