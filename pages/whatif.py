"""What-if page: the analytic speedup model of speculative decoding, a Step simulator with the
explainer's three "Try it" exercises, when it stops paying (batch roofline), and the toy distribution
check run through the engine's own sampling code.

UI only: every number comes from ``engine.explain.analytic`` or ``engine.explain.toy``. Widget keys start with ``wi_``
(session state is shared between pages) and are mirrored in the URL.
"""

from __future__ import annotations

import dataclasses
import math
import time

import plotly.graph_objects as go
import streamlit as st

from app.charts import REFERENCE_LINE, log_ticks, show_chart, show_table
from app.state import note_replaced, stop_page, sync_url, url_param, url_text
from app.teaching import check_yourself, safe_questions
from app.tour import intro, presenting
from app.tree_view import shape_figure
from app.why_view import why_card
from engine.decoding.compute import cpu_model
from engine.decoding.draft_length import rule_examples, slope_costs
from engine.decoding.models import EMBEDDED
from engine.decoding.pass_cost import current_pass_cost, machine_pass_cost
from engine.errors import SpeedupLabError
from engine.explain.analytic import (
    GAMMA_MAX,
    HARDWARE_PRESETS,
    HEAD_RANK_COUNTS,
    SIM_MAX_ROUNDS,
    TREE_MAX_BRANCHING,
    TREE_MAX_NODES,
    analytic_view,
    batch_speedup_curve,
    best_tree,
    compare_with_measured,
    fit_tree_acceptance,
    gap_rows,
    predict_from_run,
    simulate_rounds,
    tree_capacity,
    tree_size_curve,
    try_it_exercises,
)
from engine.explain.coupling import measured_rule_acceptance, rule_acceptance
from engine.explain.drafting import BlockCost, drafting_curves, load_block_results
from engine.explain.teaching import whatif_questions
from engine.explain.why import why_from_run
from engine.explain.toy import PEAK_RANGE, TOY_MAX_GAMMA, TOY_MAX_ROUNDS, VOCAB, run_toy_rounds, verify_always_accept

CUSTOM_HW = "Custom"
RULES = ("Speculative sampling (engine)", "Naive: accept every draft token")
BYTES = {"bf16 / fp16 (2 bytes)": 2.0, "fp8 (1 byte)": 1.0, "int4 (0.5 byte)": 0.5, "fp32 (4 bytes)": 4.0}
CHART_H = 340
TABS = ("Analytic model", "Step simulator · Try it", "When it does not help", "Distribution check",
        "My measured numbers", "Token trees", "Sequential vs parallel drafting")
MAX_BATCHES = [8, 64, 256, 1024, 4096, 16384, 65536]
TOY_NS = [1000, 2000, 5000, 10000]  # 20 000 (the engine's cap) can take > 2 s on a busy 2-core CPU

# ------------------------------------------------------------------ state (URL ↔ session)
url_param("wi_tab", TABS[0], str, choices=list(TABS))  # the open tab: a link opens it
url_param("wi_alpha", 0.80, float, lo=0.0, hi=1.0, step=0.01)
url_param("wi_gamma", 4, int, lo=1, hi=GAMMA_MAX)
url_param("wi_cost", 0.05, float, lo=0.0, hi=1.0, step=0.01)
url_param("wi_slope", 0.05, float, lo=0.0, hi=1.0, step=0.01)
url_param("wi_steps", 0, int, lo=0, hi=SIM_MAX_ROUNDS)
url_param("wi_seed", 0, int, lo=0, hi=10**6)
url_param("wi_hw", "H100 SXM", str, choices=[*HARDWARE_PRESETS, CUSTOM_HW])
url_param("wi_params_b", 7.0, float, lo=0.1, hi=1000.0)
url_param("wi_bytes", next(iter(BYTES)), str, choices=list(BYTES))
url_param("wi_bw", 3350.0, float, lo=1.0, hi=100000.0)
url_param("wi_peak", 989.0, float, lo=0.1, hi=100000.0)
url_param("wi_max_batch", 1024, int, choices=MAX_BATCHES)
url_param("wi_toy_target", 8.0, float, lo=PEAK_RANGE[0], hi=30.0)
url_param("wi_toy_draft", 4.0, float, lo=PEAK_RANGE[0], hi=30.0)
url_param("wi_toy_ctx", "cat", str, choices=VOCAB)
url_param("wi_toy_gamma", 4, int, lo=1, hi=TOY_MAX_GAMMA)
url_param("wi_toy_n", 10000, int, choices=TOY_NS)
url_param("wi_toy_seed", 0, int, lo=0, hi=10**6)
url_param("wi_toy_rule", RULES[0], str, choices=RULES)
URL_KEYS = ["wi_tab", "wi_alpha", "wi_gamma", "wi_cost", "wi_slope", "wi_steps", "wi_seed", "wi_hw",
            "wi_params_b", "wi_bytes", "wi_bw", "wi_peak", "wi_max_batch", "wi_toy_target", "wi_toy_draft", "wi_toy_ctx",
            "wi_toy_gamma", "wi_toy_n", "wi_toy_seed", "wi_toy_rule"]

# the Token trees tab's settings (its section is _section_tree)
TREE_CURVES = {"cpu": "This CPU, measured (embedded target)", "slope": "Linear: slope s (Analytic model tab)",
               "live": "My Live run's timed passes"}
url_param("wi_tree_sib", 0.27, float, lo=0.0, hi=1.0, step=0.01)  # the shipped head's rank 2 (HEAD_RANK_COUNTS)
url_param("wi_tree_decay", 1.0, float, lo=0.5, hi=1.0, step=0.01)
url_param("wi_tree_branch", 3, int, lo=1, hi=TREE_MAX_BRANCHING)
url_param("wi_tree_n", 8, int, lo=1, hi=TREE_MAX_NODES)
url_param("wi_tree_depth", 6, int, lo=1, hi=GAMMA_MAX)
url_param("wi_tree_curve", "cpu", str, choices=list(TREE_CURVES))
URL_KEYS += ["wi_tree_sib", "wi_tree_decay", "wi_tree_branch", "wi_tree_n", "wi_tree_depth", "wi_tree_curve"]

# the Sequential vs parallel drafting tab's settings (its section is _section_block)
BLOCK_COSTS = {"flat": "One pass, same cost at any B: c_block = c0", "linear": "Grows with the block: c0 + c1·B",
               "measured": "Measured block passes (benchmarks/results/block_amd-epyc.json)"}
BLOCK_CURVES = {k: TREE_CURVES[k] for k in ("cpu", "slope")}
url_param("wi_block_decay", 0.90, float, lo=0.0, hi=1.0, step=0.01)
url_param("wi_block_seq_decay", 1.0, float, lo=0.0, hi=1.0, step=0.01)
url_param("wi_block_cmodel", "flat", str, choices=list(BLOCK_COSTS))
url_param("wi_block_c0", 0.10, float, lo=0.0, hi=1.0, step=0.01)
url_param("wi_block_c1", 0.005, float, lo=0.0, hi=0.1, step=0.001)
url_param("wi_block_curve", "cpu", str, choices=list(BLOCK_CURVES))
URL_KEYS += ["wi_block_decay", "wi_block_seq_decay", "wi_block_cmodel", "wi_block_c0", "wi_block_c1",
             "wi_block_curve"]


def _set(**values) -> None:
    """Button callback: write widget values (before the widgets are drawn on the next run)."""
    for k, v in values.items():
        st.session_state[f"wi_{k}"] = v


def _step(n: int) -> None:
    st.session_state["wi_steps"] = min(st.session_state["wi_steps"] + n, SIM_MAX_ROUNDS)


def _on_hw() -> None:
    """A preset fixes bandwidth and peak (their inputs are disabled); Custom keeps the last values."""
    hw = HARDWARE_PRESETS.get(st.session_state["wi_hw"])
    if hw is not None:
        st.session_state["wi_bw"] = round(hw.bandwidth / 1e9, 1)
        st.session_state["wi_peak"] = round(hw.peak_flops / 1e12, 1)


_on_hw()
if st.session_state["wi_hw"] in HARDWARE_PRESETS:  # a link's bandwidth or peak is the preset's, whatever it said
    for _k in ("wi_bw", "wi_peak"):
        _raw = st.query_params.get(_k)
        if _raw is not None and _raw != url_text(st.session_state[_k]):
            note_replaced(_k, _raw, st.session_state[_k], why=f"set by the {st.session_state['wi_hw']} preset")


@st.cache_data(show_spinner="Running speculative sampling on the toy models…", max_entries=32)
def _toy(n: int, gamma: int, target_peak: float, draft_peak: float, context: str, seed: int, rule: str):
    verify = verify_always_accept if rule == RULES[1] else None
    kw = {} if verify is None else {"verify": verify}
    return run_toy_rounds(n, gamma, target_peak, draft_peak, context, seed, **kw)


def _fmt_alpha(a: float | None) -> str:
    return "never pays" if a is None else f"{a:.3f}"  # a fraction, as the α slider shows it


# the γ chart's reference curves (engine.explain.analytic.CHART_ALPHAS), light to dark, and the user's α
# light to mid blues: the darkest (0.9) must still show on the dark theme's background
ALPHA_COLORS = {0.5: "#c6dbef", 0.6: "#9ecae1", 0.7: "#6baed6", 0.8: "#4292c6", 0.9: "#2171b5"}
YOURS_COLOR = "#2ca02c"  # green: apart from the blues, the gold stars and the orange dashed line
BEST_MARKER = {"symbol": "star", "size": 13, "color": "#ffbf00", "line": {"width": 1, "color": "#555555"}}

# ------------------------------------------------------------------ page
st.title("📈 What-if: how much faster?")
intro(
    "Speculative decoding's speedup follows from three numbers: the **acceptance rate α** (chance the "
    "target keeps a draft token), the **draft length γ**, and the **draft cost c** (one draft step as a "
    "fraction of a target pass). Move them and watch the expected gain; then check that the output "
    "distribution does not change.")

c1, c2, c3 = st.columns(3)
c1.slider("Acceptance rate α", 0.0, 1.0, step=0.01, key="wi_alpha",
          help="Probability that one draft token is accepted; equals Σ min(p, q).")
c2.slider("Draft length γ", 1, GAMMA_MAX, step=1, key="wi_gamma", help="Draft tokens per round.")
c3.slider("Draft cost c (fraction of a target pass)", 0.0, 1.0, step=0.01, key="wi_cost",
          help="Time of one draft step as a fraction of one target decode step (a 1-token pass). A small "
               "draft model is often 0.05–0.2; prompt lookup costs almost nothing.")
alpha, gamma, cost = st.session_state["wi_alpha"], st.session_state["wi_gamma"], st.session_state["wi_cost"]

# Only the open tab's content runs (on_change="rerun"), so a rerun builds at most three charts. The open
# tab is in the link as ?wi_tab=… through url_param like every other setting, not Streamlit's binding:
# that one replaced the history entry (a tab switch was no Back step) and wrote the URL on its own,
# adding a history entry of its own after a tour stop opened.
tab_model, tab_sim, tab_batch, tab_toy, tab_meas, tab_tree, tab_block = st.tabs(list(TABS), key="wi_tab",
                                                                                 on_change="rerun")

# ------------------------------------------------------------------ analytic model
def _set_slope() -> None:
    st.session_state["wi_slope"] = st.session_state["wi_slope_w"]


def _section_model() -> None:
    # the slope's slider is drawn under the charts (its value is in the session already), so the metrics
    # and the γ chart are on the first screen
    try:
        v = analytic_view(alpha, gamma, cost, st.session_state["wi_slope"])
    except SpeedupLabError as e:
        st.error(str(e))
        stop_page()
    m1, m2, m3, m4 = st.columns(4)
    m1.metric("Tokens per target pass E", f"{v.tokens_per_pass:.2f}", help="(1 − α^(γ+1)) / (1 − α)")
    m2.metric("Speedup E / (γc + 1)", f"{v.speedup:.2f}×",
              delta=f"{v.speedup_realistic:.2f}× with verify cost", delta_color="off", delta_arrow="off")
    ge, ge_r = ("≥ " if v.beyond_gamma_max else ""), ("≥ " if v.beyond_gamma_max_realistic else "")
    far = [f"{what} γ = {b[0]} ({b[1]:.2f}×)" for what, b in (("simple model", v.beyond_gamma_max),
                                                              ("with verify cost", v.beyond_gamma_max_realistic))
           if b]
    # below 1× even the best draft length loses: the advice is not to speculate
    m3.metric("Best γ at this α, c", f"{ge}{v.best_gamma}  ({v.best_speedup:.2f}×)" if v.best_speedup >= 1
              else "none: decode plainly",
              delta=(f"γ {'≥' if ge_r else '='} {v.best_gamma_realistic} ({v.best_speedup_realistic:.2f}×) "
                     "with verify cost" if v.best_speedup_realistic >= 1 else
                     f"none with verify cost (best γ = {v.best_gamma_realistic}: {v.best_speedup_realistic:.2f}×)"),
              delta_color="off", delta_arrow="off",
              help=(f"Even the best draft length, γ = {v.best_gamma}, gives {v.best_speedup:.2f}×: slower than "
                    "plain decoding at this α and c." if v.best_speedup < 1 else
                    None if not far else f"≥ {GAMMA_MAX}: the sliders stop at γ = {GAMMA_MAX}; the best up to "
                                         f"64 is longer: {'; '.join(far)}."))
    m4.metric("Break-even α", _fmt_alpha(v.break_even),
              delta=f"{_fmt_alpha(v.break_even_realistic)} with verify cost", delta_color="off", delta_arrow="off",
              help="Below this acceptance rate even the best γ is slower than plain decoding.")
    left, right = st.columns(2)
    fig = go.Figure()
    for a, ys in v.curves.items():
        is_cur = abs(a - alpha) < 1e-9
        # fixed colours: the reference α's keep theirs and yours is always the thick green line (with the
        # default colour cycle every curve changed colour as α moved past one of them)
        fig.add_scatter(x=v.gammas, y=ys, mode="lines", name=f"α = {a:.2f}" + (" (yours)" if is_cur else ""),
                        line={"width": 4 if is_cur else 1.5,
                              "color": YOURS_COLOR if is_cur else ALPHA_COLORS.get(round(a, 2), "#999999")})
    # a star marks the best γ of each curve that gains at all (below 1× the best choice is no draft, as the
    # metric says; those stars piled onto the "no gain" label)
    best = [(v.gammas[i], ys[i]) for ys in v.curves.values()
            for i in [max(range(len(ys)), key=lambda j: ys[j])] if ys[i] >= 1]
    fig.add_scatter(x=[g for g, _ in best], y=[y for _, y in best], mode="markers", name="best γ",
                    marker=BEST_MARKER)
    fig.add_scatter(x=v.gammas, y=v.curves_realistic[round(alpha, 4)], mode="lines",
                    name="yours, with verify cost", line={"dash": "dash", "width": 3, "color": "#e6550d"})
    # the label sits bottom left: at γ = 1 the curves are above 1× unless α is low (at the right they cross)
    fig.add_hline(y=1.0, line_dash="dot", line_color=REFERENCE_LINE, annotation_text="no gain",
                  annotation_position="bottom left")
    fig.update_layout(title="Speedup against γ (★ best γ)", xaxis_title="draft length γ",
                      yaxis_title="speedup ×", height=CHART_H + 60, margin={"t": 40, "b": 10},
                      # below the plot, not beside it: a side legend took a quarter of the half-width chart
                      legend={"orientation": "h", "y": -0.3, "x": 0, "yanchor": "top"})
    show_chart(fig, key="wi_fig_gamma", where=left)

    zmax = max(max(row) for row in v.heat)
    split = 1.0 / zmax  # colour 1× (break-even) pale yellow: red below, green above
    scale = [[0.0, "#d73027"], [split, "#ffffbf"], [1.0, "#1a9850"]] if split < 1 else \
        [[0.0, "#d73027"], [1.0, "#ffffbf"]]
    heat = go.Figure(go.Heatmap(z=v.heat, x=v.heat_gammas, y=v.heat_alphas, colorscale=scale,
                                zmin=0.0, zmax=zmax, colorbar={"title": "×"},
                                hovertemplate="γ=%{x}, α=%{y}: %{z:.2f}×<extra></extra>"))
    heat.add_scatter(x=[gamma], y=[alpha], mode="markers", marker={"symbol": "x", "size": 12, "color": "black"},
                     name="you", showlegend=False)
    heat.update_layout(title=f"Speedup over (α, γ) at c = {cost:.2f}", xaxis_title="γ", yaxis_title="α",
                       height=CHART_H + 60, margin={"t": 40, "b": 10})
    show_chart(heat, key="wi_fig_heat", where=right)

    # the slider has a key of its own, written from the page's value wi_slope before it is drawn: set from
    # the measured-numbers tab while this tab was not drawn, the slider itself showed 0.00 in the browser
    # and the next click wrote 0 back (its widget state had been dropped with the unrendered tab)
    st.session_state["wi_slope_w"] = st.session_state["wi_slope"]
    st.slider("Verify-cost slope s: t(n) = t(1)·(1 + s·(n − 1))", 0.0, 1.0, step=0.01, key="wi_slope_w",
              on_change=_set_slope,
              help="How much each extra token in the target's verify pass costs, as a fraction of a "
                   "decode step. 0 = the simple model (free while memory-bound); 1 = fully compute-bound.")
    st.caption(
        f"Formulas: Leviathan et al. 2023, Eq. 1 and Theorem 3.8. With the verify-cost model a pass over "
        f"γ + 1 = {gamma + 1} tokens costs {v.verify_ratio:.2f} decode steps, so the speedup is "
        f"E / (γc + {v.verify_ratio:.2f}) = {v.speedup_realistic:.2f}× instead of {v.speedup:.2f}×: the "
        f"simple formula assumes checking γ tokens is free, which is why it overestimates.")

    with st.expander("A draft length per round: what the shipped head does by default"):
        st.markdown(
            "The formulas above fix γ. The engine's default draft instead chooses each round's length **from 0 up**: "
            "before each draft token it estimates the token's acceptance chance â from the draft's confidence "
            "(its top probability q, calibrated by the run's acceptance so far), and drafts it only if the round's "
            "expected speedup E(k) / (k·c + t(k+1)/t(1)) grows, with E(k) = 1 + â₁ + â₁â₂ + …. A round where "
            "even one token would not pay is a plain target step. The length depends only on the draft, so the "
            "output still follows the target exactly. On Live each round says what it drafted and why. "
            "(Ideas: SpecDec++, EAGLE-2's confidence, llama.cpp's --draft-p-min, vLLM's dynamic speculation; "
            "engine/decoding/draft_length.py.)")
        try:
            rows = rule_examples(slope_costs(st.session_state["wi_slope"], cost))
        except SpeedupLabError as e:
            st.error(str(e))
        else:
            st.caption(f"At c = {cost:.2f} and slope s = {st.session_state['wi_slope']:.2f}: what the rule drafts "
                       "when every token's estimate is â (up to γ = 6).")
            show_table(rows, formats={"â": "%.2f", "expected ×": "%.2f", "one more ×": "%.2f"})

    fe = go.Figure()
    fe.add_scatter(x=v.alpha_grid, y=v.tokens_vs_alpha, mode="lines", name=f"γ = {gamma}")
    fe.add_scatter(x=[alpha], y=[v.tokens_per_pass], mode="markers", marker={"size": 12}, name="you")
    fe.update_layout(title=f"Tokens per target pass against α (γ = {gamma})", xaxis_title="α",
                     yaxis_title="tokens per pass", height=CHART_H - 40, margin={"t": 40, "b": 10})
    show_chart(fe, key="wi_fig_tokens")

# ------------------------------------------------------------------ step simulator
def _section_simulator() -> None:
    intro("Each **Step** runs one round: the γ draft tokens are accepted independently with "
          "probability α until the first rejection; the target then adds its own token (the "
          "correction, or a bonus token when all γ were accepted).", label="About this tab")
    b1, b2, b3, b4, b5 = st.columns([1, 1, 1, 1, 2])
    b1.button("Step", on_click=_step, args=(1,), key="wi_btn_step", type="primary")
    b2.button("Step ×10", on_click=_step, args=(10,), key="wi_btn_step10")
    b3.button("Step ×100", on_click=_step, args=(100,), key="wi_btn_step100")
    b4.button("Reset", on_click=_set, kwargs={"steps": 0}, key="wi_btn_reset")
    b5.number_input("Random seed", 0, 10**6, step=1, key="wi_seed")
    try:
        sim = simulate_rounds(alpha, gamma, st.session_state["wi_steps"], st.session_state["wi_seed"])
    except SpeedupLabError as e:
        st.error(str(e))
        stop_page()
    if sim.n == 0:
        st.info(f"No rounds yet. Press **Step**. Expected: {sim.expected:.2f} tokens per target pass.")
    else:
        icons = {"accepted": "✅ accepted", "rejected": "❌ rejected", "correction": "🎯 target's correction",
                 "bonus": "🎁 bonus token"}
        st.markdown(f"**Round {sim.n}:** " + " → ".join(icons[x] for x in sim.last_round)
                    + f" = **{sim.tokens[-1]} token{'s' if sim.tokens[-1] != 1 else ''}** from one target pass")
        s1, s2, s3 = st.columns(3)
        s1.metric("Rounds (target passes)", sim.n)
        s2.metric("Average tokens per pass", f"{sim.mean:.3f}", delta=f"{sim.mean - sim.expected:+.3f} vs E",
                  delta_color="off", delta_arrow="off")
        s3.metric("Expected E", f"{sim.expected:.3f}")
        left, right = st.columns(2)
        fr = go.Figure()
        fr.add_scatter(x=list(range(1, sim.n + 1)), y=sim.running_mean, mode="lines", name="running average")
        fr.add_hline(y=sim.expected, line_dash="dash", line_color=REFERENCE_LINE,
                     annotation_text=f"E = {sim.expected:.2f}")
        fr.update_layout(title="Running average of tokens per pass", xaxis_title="round",
                         yaxis_title="tokens per pass", height=CHART_H, margin={"t": 40, "b": 10})
        show_chart(fr, key="wi_fig_running", where=left)
        ks = list(range(1, gamma + 2))
        fh = go.Figure()
        fh.add_bar(x=ks, y=[c / sim.n for c in sim.counts], name="simulated")
        fh.add_bar(x=ks, y=sim.exact, name="exact (truncated geometric)")
        fh.update_layout(title="Tokens per pass: simulated vs exact", xaxis_title="tokens in the round",
                         yaxis_title="fraction of rounds", barmode="group", height=CHART_H,
                         margin={"t": 40, "b": 10})
        show_chart(fh, key="wi_fig_hist", where=right)

    st.subheader("Try it")
    e1, e2, e3 = st.columns(3)
    e1.button("Exercise 1: defaults (α 0.80, γ 4, c 0.05)", key="wi_btn_ex1", on_click=_set,
              kwargs={"alpha": 0.8, "gamma": 4, "cost": 0.05, "steps": 0})
    e2.button("Exercise 2: α = 0.60", key="wi_btn_ex2", on_click=_set,
              kwargs={"alpha": 0.6, "cost": 0.05, "steps": 0})
    # α back to 0.80: the exercise lowers α from there to the break-even (Exercise 2's 0.60 was kept, and read as
    # the answer)
    e3.button("Exercise 3: c = 0.30, α = 0.80", key="wi_btn_ex3", on_click=_set,
              kwargs={"alpha": 0.8, "cost": 0.3, "steps": 0})
    at_defaults = abs(alpha - 0.8) < 1e-9 and gamma == 4
    for ex in try_it_exercises(sim.mean if at_defaults else None, sim.n if at_defaults else 0):
        st.markdown(f"**{ex.question}**")
        # the reader tries first: the answer is one click away, closed
        with st.expander(f"Show the answer ({ex.question.split('.')[0]})", expanded=False):
            st.markdown(ex.answer)

# ------------------------------------------------------------------ batch roofline
def _section_batch() -> None:
    intro(
        "Speculation trades spare compute for fewer memory-bound passes. With a batch of B sequences a "
        "verify pass processes B·(γ + 1) tokens; once that work exceeds what the memory time hides "
        "(roofline), every extra draft token costs real time and the gain shrinks into a loss.",
        label="About this tab")
    h1, h2, h3 = st.columns(3)
    h1.selectbox("Hardware", [*HARDWARE_PRESETS, CUSTOM_HW], key="wi_hw", on_change=_on_hw)
    h1.number_input("Target parameters (billions)", 0.1, 1000.0, step=1.0, key="wi_params_b")
    h2.number_input("Memory bandwidth (GB/s)", 1.0, 100000.0, step=100.0, key="wi_bw",
                    disabled=st.session_state["wi_hw"] != CUSTOM_HW)
    h2.number_input("Peak compute (TFLOP/s)", 0.1, 100000.0, step=10.0, key="wi_peak",
                    disabled=st.session_state["wi_hw"] != CUSTOM_HW)
    h3.selectbox("Weight format", list(BYTES), key="wi_bytes")
    h3.select_slider("Largest batch", MAX_BATCHES, key="wi_max_batch")
    try:
        bc = batch_speedup_curve(alpha, gamma, cost, st.session_state["wi_params_b"],
                                 BYTES[st.session_state["wi_bytes"]], st.session_state["wi_bw"],
                                 st.session_state["wi_peak"], st.session_state["wi_max_batch"])
    except SpeedupLabError as e:
        st.error(str(e))
    else:
        st.subheader("Where speculation stops paying")  # the tour's stop 3 links here
        k1, k2, k3 = st.columns(3)
        k1.metric("Speedup at batch 1", f"{bc.speedup_at_1:.2f}×")
        k2.metric("Verify pass compute-bound from batch", f"{bc.first_compute_bound_verify:,}",
                  delta=f"plain decode from {bc.first_compute_bound_decode:,}", delta_color="off", delta_arrow="off")
        if bc.crossover_batch == 0.0:
            k3.metric("Slower than plain decoding from batch", "1 (always)")
        elif bc.crossover_batch is None:
            k3.metric("Slower than plain decoding from batch", f"> {st.session_state['wi_max_batch']:,}")
        else:
            k3.metric("Slower than plain decoding from batch", f"≈ {bc.crossover_batch:,.0f}")
        fb = go.Figure()
        fb.add_scatter(x=bc.batches, y=bc.speedups, mode="lines", name="speculative speedup")
        fb.add_hline(y=1.0, line_dash="dot", line_color=REFERENCE_LINE, annotation_text="break-even")
        if bc.crossover_batch:
            # on a log axis plotly.js places a shape at the data value but an annotation at log10 of it:
            # add_vline's own annotation at x = 187 stretched the axis to 10^187
            fb.add_vline(x=bc.crossover_batch, line_dash="dash", line_color="red")
            fb.add_annotation(x=math.log10(bc.crossover_batch), y=1, yref="paper", showarrow=False,
                              xanchor="left", yanchor="top", text=f" slowdown past B ≈ {bc.crossover_batch:,.0f}")
        fb.update_layout(title=f"Speedup against batch size (α = {alpha:.2f}, γ = {gamma}, c = {cost:.2f})",
                         xaxis={"title": "batch size B", "type": "log",
                                **log_ticks(1, st.session_state["wi_max_batch"])}, yaxis_title="speedup ×",
                         height=CHART_H, margin={"t": 40, "b": 10})
        show_chart(fb, key="wi_fig_batch")
        st.caption("Roofline per pass: max(weight bytes / bandwidth, 2·params·B·tokens / peak FLOP/s); "
                   "ignores KV-cache reads and attention, so real systems cross over earlier. The draft "
                   "step is charged c × a plain decode step at the same batch.")
    _section_batch_measured()
    # after the sweep's text, controls and results (drawn between them it split the sweep in two)
    from engine.decoding.models import resolve_device

    _section_weight_bytes(_machine(resolve_device(None).type).bandwidth_gbs)
    _section_arithmetic(_machine(resolve_device(None).type).bandwidth_gbs)

def _section_arithmetic(bandwidth_gbs: float) -> None:
    """What arithmetic costs: each arithmetic's measured t(k)/t(1) against the pass roofline with this CPU's int8 and
    fp32 ceilings (``engine.explain.arithmetic_roofline``; the measurements: ``benchmarks/bench_int8.py``)."""
    from engine.explain.arithmetic_roofline import floor_ratios, ridge_tokens
    from engine.explain.measured import arithmetic_agreement

    from engine.explain.machine import arithmetic_ceilings

    data = arithmetic_agreement()
    if data is None or not data.get("peaks"):
        return
    here = arithmetic_ceilings() if data["own"] else None  # this CPU's own ceilings, measured once (prepare)
    if here:
        data = {**data, "peaks": {"int8": here["int8"], "fp32": here["fp32"]}}
    st.subheader("What arithmetic costs")
    weight_mb, params = 96.0, 134.5e6  # the embedded model's GGUF blocks as the int8 kernel reads them; its weights
    fig = go.Figure()
    colors = {"int8": "#2ca02c", "fp32": "#d62728"}
    ks = sorted(next(iter(data["ratio"].values())))
    ridges = {}
    for a in ("int8", "fp32"):
        peak = data["peaks"].get(a)
        if not peak or a not in data["ratio"]:
            continue
        ridges[a] = ridge_tokens(weight_mb * 1e6, params, bandwidth_gbs, peak)
        fig.add_scatter(x=ks, y=[data["ratio"][a][k] for k in ks], mode="lines+markers", name=f"{a}, measured",
                        line={"color": colors[a]})
        floor = floor_ratios(ks, weight_mb * 1e6, params, bandwidth_gbs, peak)
        fig.add_scatter(x=ks, y=[floor[k] for k in ks], mode="lines", name=f"{a}, roofline floor ({peak:.0f} G/s)",
                        line={"color": colors[a], "dash": "dash"})
    fig.update_layout(title="A pass over k tokens ÷ a one-token pass, per arithmetic", xaxis_title="tokens in the pass k",
                      yaxis_title="t(k) / t(1)", height=CHART_H, margin={"t": 40, "b": 10},
                      legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
    left, right = st.columns(2)
    show_chart(fig, key="wi_fig_arith", where=left)
    where = "this machine" if data["own"] else f"another machine ({data['cpu']})"
    r = data["ratio"]
    right.markdown(
        f"Reading the weights sets a pass's floor ({weight_mb:.0f} MB at {bandwidth_gbs:.1f} GB/s); each token in "
        f"the pass adds {params / 1e6:.0f} M multiply-adds. This CPU does {data['peaks'].get('int8', 0):.0f} G int8 "
        f"and {data['peaks'].get('fp32', 0):.0f} G fp32 multiply-adds a second, so the multiply-adds take over from "
        f"about **{ridges.get('fp32', float('nan')):.0f} tokens** in fp32 but **{ridges.get('int8', float('nan')):.0f}** "
        f"in int8: a verify pass of γ + 1 = 3 tokens is near the floor on both, one of 8 or 16 only in int8. "
        f"Measured on {where} ({data['date'][:10]}): 3 tokens cost {r['int8'].get(3, float('nan')):.2f}× one in "
        f"int8 and {r['fp32'].get(3, float('nan')):.2f}× in fp32; 8 tokens {r['int8'].get(8, float('nan')):.2f}× "
        f"and {r['fp32'].get(8, float('nan')):.2f}×; 16 tokens {r['int8'].get(16, float('nan')):.2f}× and "
        f"{r['fp32'].get(16, float('nan')):.2f}×. The measured curves sit above the floor: attention, norms and the "
        "kernels' own efficiency.")
    ceil_src = (f"this machine's, measured {here['measured_at']}" if here else "the benchmark's")
    st.caption(f"Measured by `benchmarks/bench_int8.py` (`benchmarks/results/{data['file']}`); the ceilings "
               f"({ceil_src}) by register-only int8 and fp32 loops on every thread; the floor uses this machine's "
               "bandwidth (`engine.explain.arithmetic_roofline`).")


# tick values of the bytes chart's log axes (plotly's own ticks label every digit on a short log range)
LOG_TICKS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]


def _section_weight_bytes(bandwidth_gbs: float) -> None:
    """What bytes cost: the weight formats' measured points, and llama.cpp's on the same GGUF, under this machine's
    bandwidth ceiling (``engine.explain.weight_bytes``)."""
    from engine.explain.weight_bytes import above_ceiling, ceiling_tokens_per_s, format_points, peer_point

    try:
        points, meta = format_points()
    except SpeedupLabError as e:
        st.info(str(e))
        return
    peer = peer_point()
    st.subheader("What bytes cost")
    fw = go.Figure()
    sizes = [p.mb_per_token for p in points] + ([peer.mb_per_token] if peer else [])
    lo, hi = 0.5 * min(sizes), 2 * max(sizes)
    xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    fw.add_scatter(x=xs, y=[ceiling_tokens_per_s(bandwidth_gbs, x) for x in xs], mode="lines",
                   name=f"this machine's copy bandwidth ({bandwidth_gbs:.1f} GB/s) ÷ bytes a token",
                   line={"dash": "dash"})
    fw.add_scatter(x=[p.mb_per_token for p in points], y=[p.tokens_per_s for p in points], mode="markers+text",
                   text=[p.label.split(" (")[0] for p in points], textposition="bottom center",
                   name="plain decoding, measured",  # labels below: the draft head's marker may sit just above
                   marker={"size": 12})
    fw.add_scatter(x=[p.mb_per_token for p in points], y=[p.head_tokens_per_s for p in points], mode="markers",
                   name=f"draft head, measured (γ {', '.join(str(g) for g in sorted({p.gamma for p in points}))})",
                   marker={"size": 10, "symbol": "diamond"})
    if peer:
        fw.add_scatter(x=[peer.mb_per_token], y=[peer.tokens_per_s], mode="markers+text", text=["llama.cpp"],
                       textposition="middle left", name="llama.cpp plain, the same GGUF (C++)",
                       marker={"size": 12, "symbol": "square"})
    fw.update_layout(title="Tokens/s against the weight MB a token reads",
                     xaxis={"title": "MB of weights read a token", "type": "log", "tickvals": LOG_TICKS},
                     yaxis={"title": "tokens/s", "type": "log", "tickvals": LOG_TICKS}, height=CHART_H,
                     margin={"t": 40, "b": 10},
                     legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
    left, right = st.columns(2)
    show_chart(fw, key="wi_fig_bytes", where=left)
    fk = go.Figure()
    for p in points:
        fk.add_scatter(x=list(p.pass_ratio), y=list(p.pass_ratio.values()), mode="lines+markers", name=p.label)
    fk.update_layout(title="A pass over k tokens ÷ a one-token pass",
                     xaxis_title="tokens in the pass k", yaxis_title="t(k) / t(1)", height=CHART_H,
                     margin={"t": 40, "b": 10}, legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
    show_chart(fk, key="wi_fig_bytes_curve", where=right)
    few, many = points[0], points[-1]
    lead = (f"the draft head's lead (γ {few.gamma}) shrinks from {many.head_speedup:.2f}× to {few.head_speedup:.2f}×"
            if few.head_speedup < many.head_speedup else
            f"the draft head (γ {few.gamma}) measured {many.head_speedup:.2f}× plain with {many.label} and "
            f"{few.head_speedup:.2f}× "
            f"with {few.label}")
    over = above_ceiling(points, bandwidth_gbs)
    if not over:
        roof = ("neither reaches the line: the rest of each step is arithmetic (the multiply-adds, and with the "
                "blocks each weight rebuilt from its block first) and the pass's small operations")
    else:
        roof = (" and ".join(p.label for p in over) + " above the line, which is this machine's measured copy (a read "
                "and a write of each byte); a decode step mostly reads, and the processor's last-level cache can hold "
                "part of the weights between steps")
    st.markdown(
        f"A decode step reads every weight once, so fewer bytes a token make plain decoding faster: "
        f"{few.label} read {few.mb_per_token:.0f} MB a token and decoded {few.tokens_per_s:.1f} tokens/s, "
        f"{many.label} {many.mb_per_token:.0f} MB and {many.tokens_per_s:.1f} tokens/s "
        f"({few.tokens_per_s / many.tokens_per_s:.2f}× for {many.mb_per_token / few.mb_per_token:.1f}× fewer "
        f"bytes). They read {few.read_gbs:.1f} and {many.read_gbs:.1f} GB/s of weights: {roof}. "
        f"Cheaper weights make the one-token pass cheaper but not the work each extra token adds, so a pass over "
        f"3 tokens costs {few.pass_ratio.get(3, float('nan')):.2f}× one token with {few.label} against "
        f"{many.pass_ratio.get(3, float('nan')):.2f}× with {many.label}, and {lead}: speculation pays most where "
        "the weights cost most.")
    if peer:
        ours = (f" (this engine's plain decoding in the same run: {peer.ours_tokens_per_s:.1f} tokens/s, "
                f"{peer.ours_tokens_per_s / peer.tokens_per_s:.2f}× llama.cpp's)" if peer.ours_tokens_per_s else "")
        st.markdown(
            f"llama.cpp reads the same GGUF as it is stored, {peer.mb_per_token:.0f} MB a token, and decoded "
            f"{peer.tokens_per_s:.1f} tokens/s{ours}: {peer.read_gbs:.1f} GB/s of weights. It multiplies the 4-bit "
            "blocks by activations rounded to 8 bits with integer instructions, so its text can part from the exact "
            "model's after a few tokens; this engine keeps every product bit for bit the fp32 model's.")
    src = (f"Points measured by `benchmarks/bench_formats.py` on {meta.get('cpu', 'another machine')} "
           f"({meta.get('threads', '?')} threads, {meta.get('date', '?')}; `benchmarks/results/{meta['file']}`), "
           "the same greedy tokens in both formats")
    if peer:
        src += (f"; llama.cpp's by `benchmarks/bench_peer.py` on {peer.meta.get('cpu', 'another machine')} "
                f"({peer.meta.get('date', '?')}; `benchmarks/results/{peer.meta['file']}`, decode alone)")
    st.caption(src + ". The line uses this machine's measured bandwidth (`engine.explain.weight_bytes`).")


# ------------------------------------------------------------------ batch: measured on this machine
# A real sweep on the embedded model (engine.decoding.batch.batch_sweep) drawn over the roofline of THIS
# machine, whose bandwidth and FLOP/s are measured (engine.decoding.batch.measure_machine); the numbers
# are combined in engine.explain.batch_view. The sweep is kept in st.session_state["batch_sweep"] (Common
# mistakes #1 reads it).
BS_METHODS = {"prompt lookup + draft head": ["ngram", "embedded-head"], "prompt lookup": ["ngram"],
              "draft head": ["embedded-head"]}
BS_COLORS = {"ngram": "#1f77b4", "embedded-head": "#d62728"}
url_param("wi_bs_batches", "1, 2, 4, 8", str)
url_param("wi_bs_tokens", 16, int, lo=1, hi=64)
url_param("wi_bs_methods", next(iter(BS_METHODS)), str, choices=list(BS_METHODS))
URL_KEYS += ["wi_bs_batches", "wi_bs_tokens", "wi_bs_methods"]


def _machine(device: str):
    """This machine's measured peaks, shared with the KV-cache page (``app.resources.machine_peaks``)."""
    from app.resources import machine_peaks

    return machine_peaks(device)


def _peaks_note(device: str) -> None:
    """When and where the peaks were measured (the KV-cache page says the same), and a button to measure again."""
    from app.resources import dated_machine_peaks, remeasure_machine_peaks

    row = st.container(horizontal=True, vertical_alignment="center")
    row.caption(dated_machine_peaks(device).words() + " (one measurement, the same on the KV-cache page).")
    if row.button("Measure again", key="wi_peaks_again",
                  help="A new copy and matmul (about 2 s); every page then shows the new figures."):
        remeasure_machine_peaks(device)
        st.rerun()


def _section_batch_measured() -> None:
    from app.resources import get_model
    from engine.decoding.batch import (SWEEP_MIN_PROMPTS, SWEEP_PROMPTS, batch_sweep, check_sweep_inputs,
                                       parse_batches)
    from engine.decoding.models import resolve_device
    from engine.decoding.speculative import encode_prompt
    from engine.explain.batch_view import (machine_sweep, measured_batch_view, method_label, model_speedup_at,
                                           readable_table, room_batch, room_marker, save_machine_sweep)

    S = st.session_state
    st.subheader("Measured on this machine")
    st.markdown(
        "The same question on the embedded SmolLM2-135M, for real: the first B of 32 different prompts are decoded "
        "together (greedy, one target pass per round for the whole batch; below B = 4 the first 4 prompts in groups "
        "of B, so one prompt's luck does not decide B = 1), plainly and with speculation, and the "
        "total tokens/s are compared at each batch size. The dashed curves are the roofline model above, for this "
        "machine: its bandwidth and FLOP/s measured, the method's α̂ and draft cost c measured at the smallest batch.")
    peaks = _machine(resolve_device(None).type)
    from engine.decoding.batch import weight_bytes_per_param

    bpp = weight_bytes_per_param(get_model("embedded"))  # the bytes a pass reads per weight (GGUF blocks here)
    m1, m2, m3 = st.columns(3)
    m1.metric("Memory bandwidth (measured)", f"{peaks.bandwidth_gbs:.1f} GB/s",
              help=f"Best of 3 copies of a {peaks.copy_mb} MB tensor (read + write), torch threads {peaks.threads}.")
    m2.metric("Matmul throughput (measured)", f"{peaks.peak_tflops * 1000:.1f} GFLOP/s",
              help=f"Best of 3 fp32 {peaks.matmul_n} × {peaks.matmul_n} matrix products (2n³ FLOPs each).")
    m3.metric("A pass turns compute-bound from", f"≈ {peaks.ridge_tokens(bpp):,.0f} tokens",
              help=f"The ridge of the roofline for the weights as the engine reads them ({bpp:.2f} bytes a weight): "
                   "bytes a weight · FLOP/s ÷ (2 · bandwidth) (engine/decoding/batch.py: weight_bytes_per_param, "
                   "MachinePeaks.ridge_tokens).")
    _peaks_note(resolve_device(None).type)
    c1, c2, c3 = st.columns(3)
    c1.text_input("Batch sizes B", key="wi_bs_batches", help="Comma-separated, e.g. 1, 2, 4, 8 (the prompt set has 32).")
    c2.number_input("New tokens per sequence", 1, 64, step=1, key="wi_bs_tokens")
    c3.selectbox("Speculative methods", list(BS_METHODS), key="wi_bs_methods",
                 help="Each is compared with plain decoding of the same batch (γ = 4 for prompt lookup, 2 for the head).")
    b1, b2 = st.columns([1, 3])
    run = b1.button("Run the measured sweep", key="wi_bs_run", type="primary",
                    help="About a minute at the defaults on an idle 2-core CPU; longer when the machine is busy.")
    stopped = b2.button("Stop", key="wi_bs_stop",
                        help="Stops the sweep before its next round; the batch sizes measured so far stay.")
    S["wi_bs_gen"] = S.get("wi_bs_gen", 0) + 1
    gen = S["wi_bs_gen"]
    if stopped and S.get("wi_bs_partial") is not None:
        part = S.pop("wi_bs_partial")
        part.stopped = True
        if part.cells:
            S["batch_sweep"] = part
        else:
            st.warning("Stopped before the first batch size finished: nothing was measured.")
    if run:
        methods = ["plain", *BS_METHODS[S["wi_bs_methods"]]]
        try:
            batches = parse_batches(S["wi_bs_batches"])
            target = get_model("embedded")
            ids = [encode_prompt(target.tokenizer, p) for p in SWEEP_PROMPTS]
            check_sweep_inputs(target, ids, batches, methods, None, int(S["wi_bs_tokens"]), 1)
        except SpeedupLabError as e:
            st.error(str(e))
            return
        bar = st.progress(0.0, text="Starting the sweep…")

        state = {"frac": 0.0, "text": "", "t": 0.0, "rounds": 0}

        def _progress(done: int, total: int, label: str, sweep) -> None:
            S["wi_bs_partial"] = sweep
            state.update(frac=min(done / max(total, 1), 1.0), rounds=0,
                         text=f"Run {min(done + 1, total)} of {total}: {label}")
            bar.progress(state["frac"], text=state["text"] + ". Press Stop to stop.")

        def _should_stop() -> bool:
            # redrawn between rounds (at most twice a second): a Stop click ends the sweep at this call, not
            # only when the next run starts
            state["rounds"] += 1
            if time.perf_counter() - state["t"] > 0.5:
                state["t"] = time.perf_counter()
                bar.progress(state["frac"], text=f"{state['text']}, round {state['rounds']}. Press Stop to stop.")
            return S.get("wi_bs_gen") != gen

        try:
            sweep = batch_sweep(target, ids, batches=batches, methods=methods, max_new_tokens=int(S["wi_bs_tokens"]),
                                on_progress=_progress, should_stop=_should_stop, min_prompts=SWEEP_MIN_PROMPTS)
        except SpeedupLabError as e:
            bar.empty()
            st.error(str(e))
            return
        bar.empty()
        S.pop("wi_bs_partial", None)
        if sweep.cells:
            S["batch_sweep"] = sweep
            # this machine's sweep for later sessions and Common mistakes #1 (engine.explain.batch_view)
            save_machine_sweep(sweep, "embedded", target.compute.name if target.compute else "default")
    sweep = S.get("batch_sweep")
    if sweep is None:
        earlier = machine_sweep("embedded")
        if earlier is None:
            st.info("No measured sweep on this machine yet: press **Run the measured sweep**.")
            return
        sweep, meta = earlier
        # the same kernel build (the store's key), so the same weight formats: a sweep stored before the roofline
        # counted the bytes as read carries fp32's 4 bytes a weight
        sweep = dataclasses.replace(sweep, bytes_per_param=bpp)
        st.caption(f"Measured on this machine earlier ({meta['date']}, {meta['cpu']}, {meta['compute']} kernels; "
                   f"batch sizes {', '.join(map(str, sweep.batches))}, {sweep.max_new_tokens} new tokens per sequence: "
                   "the last complete sweep, kept in the user cache). **Run the measured sweep** measures it again "
                   "with the settings above.")
    if sweep.stopped:
        st.warning(f"Stopped: showing the {len({c.batch for c in sweep.cells})} batch size(s) measured before Stop.")
    try:
        view = measured_batch_view(sweep, peaks)
    except SpeedupLabError as e:
        st.error(str(e))
        return
    cols = st.columns(max(len(view.methods), 1))
    for col, mv in zip(cols, view.methods):
        measured = (f"B = {mv.measured_crossover}" if mv.measured_crossover is not None
                    else f"none up to B = {max(mv.batches)}")
        model = ("B = 1 (always)" if mv.model_crossover == 0.0 else "beyond the range" if mv.model_crossover is None
                 else f"B ≈ {mv.model_crossover:,.1f}")
        col.metric(f"{mv.label}: slower than plain from (measured)", measured,
                   delta=f"roofline model: {model}", delta_color="off", delta_arrow="off",
                   help=f"Model inputs: α̂ = {mv.alpha:.2f}, γ = {mv.gamma}, c = {mv.c:.3f} "
                        f"(measured at B = {mv.batches[0]}).")
    hi = max(max(sweep.batches), 2)
    fig = go.Figure()
    for mv in view.methods:
        color = BS_COLORS.get(mv.method)
        xs = [(b, y) for b, y in zip(mv.model_batches, mv.model_speedups) if b <= hi]
        fig.add_scatter(x=[b for b, _ in xs], y=[y for _, y in xs], mode="lines", name=f"{mv.label}: roofline model",
                        line={"dash": "dash", "color": color})
        fig.add_scatter(x=mv.batches, y=mv.measured, mode="lines+markers", name=f"{mv.label}: measured",
                        line={"color": color, "width": 3}, marker={"size": 10})
    fig.add_hline(y=1.0, line_dash="dot", line_color=REFERENCE_LINE, annotation_text="plain decoding",
                  annotation_position="bottom left")
    marker = None
    if presenting():  # the room's live batch (the Live page's readers, engine.decoding.scheduler) on the curve
        from engine.decoding.scheduler import room_for

        b_room = room_batch(room_for(get_model("embedded")).stats())
        if b_room is not None:
            marker = room_marker(view, b_room)
            fig.add_vline(x=b_room, line_color="#2ca02c", line_width=3)
            fig.add_annotation(x=math.log10(b_room), y=1, yref="paper", showarrow=False, xanchor="right",
                               yanchor="top", text=f"the room now: B = {b_room} ")
            for mv in view.methods:
                y, _ = marker.speedups[mv.label]
                if y is not None:
                    fig.add_scatter(x=[b_room], y=[y], mode="markers", showlegend=False, hoverinfo="x+y",
                                    marker={"size": 16, "symbol": "diamond", "color": BS_COLORS.get(mv.method),
                                            "line": {"color": "#2ca02c", "width": 2}})
            hi = max(hi, b_room)
    fig.update_layout(title="Speculative ÷ plain tokens/s against batch size: measured and modelled (this machine)",
                      xaxis={"title": "batch size B", "type": "log", **log_ticks(1, hi)}, yaxis_title="speedup ×",
                      height=CHART_H + 40, margin={"t": 40, "b": 10},
                      legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
    show_chart(fig, key="wi_fig_batch_measured")
    if presenting():
        st.markdown(f"**{marker.text}**" if marker is not None else
                    "The room (readers on the Live page) is idle: its live batch appears here while readers run.")
    fp = go.Figure()
    fp.add_scatter(x=view.pass_tokens, y=view.pass_ms, mode="markers", name="measured (median)", marker={"size": 9})
    fp.add_scatter(x=view.pass_tokens, y=view.model_pass_ms, mode="lines", name=f"roofline: max({view.params * view.bytes_per_param / 1e6:.0f} MB of weights ÷ bandwidth, FLOPs ÷ peak)",
                   line={"dash": "dash"})
    fp.update_layout(title="Target pass time against tokens in the pass (B·(γ + 1) while every row drafts γ)",
                     xaxis={"title": "tokens in the pass", "type": "log",
                            **log_ticks(1, max(view.pass_tokens + [2]))}, yaxis_title="ms",
                     height=CHART_H, margin={"t": 40, "b": 10},
                     legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
    show_chart(fp, key="wi_fig_batch_pass")
    b_small = min(sweep.batches)
    gaps = [(mv.label, model_speedup_at(mv, mv.batches[0]), mv.measured[0], mv.batches[0]) for mv in view.methods]
    st.markdown(
        "**Why the model and the measurement disagree.** The roofline model prices a round as the draft's "
        "c × a decode step per token plus one target pass at its roofline time, and nothing else. The measured "
        "rounds also pay for drafting as it really runs (the draft head's own pass per row, the prompt lookup's "
        "search), for judging (each row's draft tokens tested against the target's p, row by row) and for per-row "
        "work (rows padded to one width, rejected tails cropped from the KV cache), and the target's "
        "pass over γ + 1 tokens costs more than one token's on this CPU (the pass-time chart above). "
        + "; ".join(f"{label}: model {model:.2f}×, measured {meas:.2f}× at B = {b}" for label, model, meas, b in gaps
                    if model is not None)
        + (f" (the smallest batch measured, B = {b_small})." if gaps else "")
        + " Where the model is below the measurement, its inputs decide it: α̂ and c come from the smallest batch "
          "(each metric's help), and a small error in c moves a model that sits near 1× across it.")
    show_table(readable_table(sweep.table()))
    st.caption(f"{sweep.max_new_tokens} new tokens per row, torch threads {sweep.threads}, {sweep.elapsed_s:.0f} s. "
               "One run per cell here (benchmarks/bench_batch.py alternates repeated runs and takes medians). The draft "
               "head runs its own small pass per row (only the target's pass is batched), so its draft time grows "
               "with B, which the model (draft charged c × a decode step) does not. On a shared or busy machine the "
               "measured points move by tens of percent; the trend is what to read.")


# ------------------------------------------------------------------ toy distribution check
def _section_toy() -> None:
    st.markdown(
        "The explainer's toy: five words (the, cat, sat, on, mat); after each word both models favour "
        "the next one in that cycle, the target more confidently than the draft. Each round drafts γ "
        "tokens from q and verifies them with the engine's own `verify_sampling`. If the rule is right, "
        "the first token of every round follows the target's p exactly.")
    st.caption("The α, γ and c sliders at the top do not apply here: this tab has its own γ, and the toy's α "
               "follows from its two distributions (α = Σ min(p, q)).")
    t1, t2, t3 = st.columns(3)
    t1.slider("Target confidence (weight of its favourite word)", PEAK_RANGE[0], 30.0, step=0.5,
              key="wi_toy_target")
    t1.slider("Draft confidence", PEAK_RANGE[0], 30.0, step=0.5, key="wi_toy_draft")
    t2.selectbox("Context word", VOCAB, key="wi_toy_ctx")
    t2.slider("Draft length γ (toy)", 1, TOY_MAX_GAMMA, key="wi_toy_gamma")
    t3.select_slider("Rounds N", TOY_NS, key="wi_toy_n")
    t3.number_input("Seed", 0, 10**6, step=1, key="wi_toy_seed")
    st.radio("Verification rule", RULES, key="wi_toy_rule", horizontal=True)
    try:
        tr = _toy(st.session_state["wi_toy_n"], st.session_state["wi_toy_gamma"],
                  st.session_state["wi_toy_target"], st.session_state["wi_toy_draft"],
                  st.session_state["wi_toy_ctx"], st.session_state["wi_toy_seed"],
                  st.session_state["wi_toy_rule"])
    except SpeedupLabError as e:
        st.error(str(e))
    else:
        q1, q2, q3, q4 = st.columns(4)
        q1.metric("Acceptance rate (measured)", f"{tr.alpha_measured:.3f}",
                  delta=f"Σ min(p, q) = {tr.alpha_formula:.3f}", delta_color="off", delta_arrow="off")
        q2.metric("Tokens per target pass", f"{tr.tokens_per_pass:.2f}",
                  delta=f"formula {tr.tokens_formula:.2f}", delta_color="off", delta_arrow="off")
        q3.metric("χ² p-value (first token vs p)", f"{tr.chi2_p:.3g}",
                  delta="consistent with p" if tr.chi2_p >= 0.01 else "differs from p",
                  delta_color="green" if tr.chi2_p >= 0.01 else "red", delta_arrow="off")
        q4.metric("Total variation distance", f"{tr.tvd:.4f}")
        ft = go.Figure()
        ft.add_bar(x=tr.vocab, y=tr.p, name="target p")
        ft.add_bar(x=tr.vocab, y=tr.first_freq, name=f"speculative output ({tr.n_rounds:,} rounds)")
        ft.add_bar(x=tr.vocab, y=tr.q, name="draft q", opacity=0.45)
        ft.update_layout(title=f"First token after “{tr.context}”", barmode="group", yaxis_title="probability",
                         height=CHART_H, margin={"t": 40, "b": 10})
        show_chart(ft, key="wi_fig_toy")
        show_table({"word": tr.vocab, "target p": tr.p, "speculative output": tr.first_freq, "draft q": tr.q},
                   formats={"target p": "%.3f", "speculative output": "%.3f", "draft q": "%.3f"})
        if st.session_state["wi_toy_rule"] == RULES[1]:
            st.warning("The naive rule keeps every draft token, so the output follows the draft's q, not "
                       "the target's p: the χ² test rejects it.")
        _section_rules(tr)


@st.cache_data(show_spinner=False, max_entries=64)
def _rule_acceptance(p: tuple, q: tuple):
    return rule_acceptance(list(p), list(q))


def _section_rules(tr) -> None:
    """The standard rule's acceptance against the drafter-invariant (Gumbel-max) rule's, on the toy's p and q and
    as measured on the embedded model (``engine.explain.coupling``)."""
    st.markdown("**Another lossless rule: drafter-invariant sampling.** Each token is argmax(log p + g), with Gumbel "
                "noise g fixed by the seed, the position and the token; the draft proposes argmax(log q + g) with the "
                "same noise and a draft token is kept when the two agree (Daliri, Musco & Suresh 2024). Plain and "
                "speculative decoding then give the same text for a seed, at some cost in acceptance:")
    ra = _rule_acceptance(tuple(tr.p), tuple(tr.q))
    c1, c2, c3 = st.columns(3)
    c1.metric("Standard rule: Σ min(p, q)", f"{ra.standard:.3f}", help="The most any rule keeps (1 − TV).")
    se = (ra.gumbel * (1 - ra.gumbel) / ra.rows) ** 0.5
    c2.metric("Gumbel coupling: P(picks agree)", f"{ra.gumbel:.3f}",
              delta=f"± {2 * se:.3f} (estimate)", delta_color="off", delta_arrow="off",
              help=f"Estimated over {ra.rows:,} noise rows: ± two standard errors. It is at most Σ min(p, q); an "
                   "estimate can land a little above it.")
    c3.metric("Paper's bound (1 − TV)/(1 + TV)", f"{ra.bound:.3f}")
    m = measured_rule_acceptance()
    if m is None:
        st.caption("No measurement of the two rules on the embedded model here (benchmarks/bench_gumbel.py).")
    else:
        st.caption(f"On the embedded model (SmolLM2-135M and its draft head, γ {m['gamma']}, T {m['temperature']:g}, "
                   f"{m['prompts']} held-out prompts; measured on {m['cpu']}, {m['date']}, {m['file']}): α̂ "
                   f"{m['alpha_standard']:.3f} under the standard rule, {m['alpha_gumbel']:.3f} under the "
                   f"drafter-invariant one; on {m['positions']} real p and q rows of a run, Σ min(p, q) "
                   f"{m['sum_min']:.3f} against the coupling's {m['agreement']:.3f} (bound {m['bound']:.3f}); "
                   f"speculative text equal to plain decoding's on {m['identical']} of {m['prompts']} prompts.")

# ------------------------------------------------------------------ measured numbers from the live page
def _section_measured() -> None:
    run = st.session_state.get("measured_run")
    if run is None:
        st.info("No measured run in this session yet: run the live page first (🔴 Live speculative "
                "decoding), then come back to compare its measured speedup with the model's prediction.")
    else:
        unsure = list(getattr(run, "unsure", None) or [])
        if unsure:  # the Live page called the run unsure: every number below is that busy run's
            st.warning("The Live run these numbers come from was **unsure**: " + "; ".join(unsure) + ". The Live page "
                       "said so beside its speedup; the machine was busy, so the figures below are the busy "
                       "machine's. Run the baseline again there with nothing else running.")
        why_card(why_from_run(run, where="this server"), key="wi", offer_case=False,
                 link_label="The analytic model at this run's numbers")
        try:
            mc = compare_with_measured(run)
        except SpeedupLabError as e:
            (st.warning if unsure else st.error)(str(e))
        else:
            st.markdown(f"Measured on the live page: α = **{mc.alpha:.3f}**, γ = **{mc.gamma}**, "
                        f"c = **{mc.c:.3f}** (draft step ÷ {mc.c_basis}).")
            r1, r2, r3 = st.columns(3)
            r1.metric("Predicted (simple formula)", f"{mc.predicted_simple:.2f}×")
            r2.metric("Predicted (measured verify cost)",
                      "—" if mc.predicted_curve is None else f"{mc.predicted_curve:.2f}×",
                      delta=None if mc.verify_ratio is None else
                      f"verify pass = {mc.verify_ratio:.2f} decode steps", delta_color="off", delta_arrow="off")
            r3.metric("Measured", "not measured" if mc.measured is None else f"{mc.measured:.2f}×")
            if mc.curve_ns:
                fm = go.Figure()
                fm.add_scatter(x=mc.curve_ns, y=mc.curve_ms, mode="lines+markers", name="measured")
                fm.update_layout(title="Measured target pass time by tokens in the pass",
                                 xaxis_title="tokens fed to the target", yaxis_title="ms", xaxis_dtick=1,
                                 height=CHART_H - 60, margin={"t": 40, "b": 10})
                show_chart(fm, key="wi_fig_measured")
            else:
                st.caption("The run has no verify-time curve; only the simple prediction is shown.")
            if mc.curve_note:
                st.caption(mc.curve_note)
            _gap_parts(run)
            use = {"alpha": round(mc.alpha, 2), "gamma": min(max(mc.gamma, 1), GAMMA_MAX),
                   "cost": round(mc.c, 2), "steps": 0}
            if mc.verify_slope is not None:  # so the analytic model's "with verify cost" agrees
                use["slope"] = round(mc.verify_slope, 2)
            st.button("Use these α, γ, c (and the measured verify slope) in the sliders", key="wi_btn_use_measured",
                      on_click=_set, kwargs=use,
                      help=("The sliders move in steps of 0.01, so α and c are rounded to them and the "
                            "analytic tab can differ from the prediction above in the last digit."
                            + ("" if mc.verify_slope is None else
                               f" Also sets the analytic model's verify-cost slope to s = {mc.verify_slope:.2f}: "
                               f"t(γ+1)/t(1) = {mc.verify_ratio:.2f} = 1 + s·γ.")))

# ------------------------------------------------------------------ token trees
def _tree_curve(key: str = "wi_tree_curve") -> tuple[dict[int, float] | None, str]:
    """The verify-cost curve a tab uses (its radio ``key``): (measured ms by tokens or None for the slope, what
    it is)."""
    choice = st.session_state[key]
    if choice == "live":
        run = st.session_state.get("measured_run")
        curve = getattr(run, "verify_ms_by_tokens", None) or {}
        if 1 in curve and len(curve) >= 2:
            return dict(curve), "your Live run's timed passes (extended linearly past its longest pass)"
        st.info("No usable Live run yet: it needs timed passes of several lengths and a 1-token pass (press Run "
                "baseline on the Live page). Using this CPU's measured curve instead.")
        choice = "cpu"
    if choice == "cpu":  # engine/decoding/pass_cost.py: measured here once (make run's prepare), else shipped
        pc = current_pass_cost(EMBEDDED)
        if not pc.measured_here and st.button("Measure this machine's curve (loads the embedded model, ~5 s)",
                                              key="wi_measure_curve"):
            from app.resources import get_model

            bar = st.progress(0.0, text="Loading the embedded model…")
            machine_pass_cost(get_model(EMBEDDED), progress=lambda msg, f: bar.progress(min(f, 1.0), text=msg))
            st.rerun()
        n_max = max(pc.ms)
        return dict(pc.ms), (f"{pc.source}: passes of 1–{n_max} tokens, extended linearly beyond: trees over "
                             f"{n_max - 1} nodes (drafts over γ = {n_max - 1}) are an extrapolation")
    return None, f"t(n) = t(1)·(1 + s·(n − 1)) with s = {st.session_state['wi_slope']:.2f}"


def _section_tree() -> None:
    intro("A **token tree** drafts several candidates per position and verifies all of them in **one** target "
          "pass (tree attention). Each extra node can only add tokens, but it makes the verify pass longer. "
          "Model (greedy): at depth d the draft's top candidate is the target's choice with probability "
          "α_d = α·δ^(d−1); when it is not, each next-ranked candidate is right with probability σ. A node's "
          "path is accepted with the product of these along it, and tokens per pass = 1 + Σ over nodes of "
          "P(path to the node accepted). α and c come from the sliders at the top (c per draft pass: one "
          "per depth); the tree's depth has its own slider, so γ does not apply here.", label="About this tab")
    t1, t2, t3 = st.columns(3)
    t1.slider("Sibling acceptance σ", 0.0, 1.0, step=0.01, key="wi_tree_sib",
              help="When the draft's top candidate is wrong, the chance that its next-ranked one is right (and "
                   "so on down the ranks). The default 0.27 is the shipped draft head's measured rank-2 value "
                   "(benchmarks/results/tree_ranks.md); its ranks 3–8 are rarer (0.14 pooled over ranks 2–8). "
                   "σ = α is the geometric form α(1 − α)^(r−1).")
    t1.slider("Depth decay δ: α_d = α·δ^(d−1)", 0.5, 1.0, step=0.01, key="wi_tree_decay",
              help="1 = the same α at every depth; below 1 the draft's guesses get worse deeper in the tree.")
    t2.slider("Branching (children per node)", 1, TREE_MAX_BRANCHING, key="wi_tree_branch")
    t3.slider("Maximum depth D", 1, GAMMA_MAX, key="wi_tree_depth",
              help="The tree's deepest level (the Live page's γ for a tree). EAGLE-2 drafts one depth per pass.")
    t2.slider("Tree size N to inspect (nodes)", 1, TREE_MAX_NODES, key="wi_tree_n")
    t3.radio("Verify-cost curve t(n)", list(TREE_CURVES), key="wi_tree_curve", format_func=TREE_CURVES.get)
    head = fit_tree_acceptance(HEAD_RANK_COUNTS["hits"], HEAD_RANK_COUNTS["trials"],
                               max_rank=max(st.session_state["wi_tree_branch"], 2))
    t3.button("The head's measured α, δ, σ", key="wi_btn_tree_head", on_click=_set,
              kwargs={"alpha": round(head.alphas[0], 2), "tree_decay": round(head.decay, 2),
                      "tree_sib": round(head.sigma, 2)},
              help=f"The trained draft head on the embedded target, teacher-forced along the target's greedy path "
                   f"(benchmarks/bench_tree_ranks.py): α̂_1 = {head.alphas[0]:.2f}, α̂_d by depth "
                   f"{', '.join(f'{a:.2f}' for a in head.alphas)} (δ̂ = {head.decay:.2f}), σ̂ = {head.sigma:.2f} "
                   f"over ranks 2–{max(st.session_state['wi_tree_branch'], 2)}.")
    measured, what = _tree_curve()
    depth = st.session_state["wi_tree_depth"]
    alphas = [alpha * st.session_state["wi_tree_decay"] ** d for d in range(depth)]
    n = st.session_state["wi_tree_n"]
    most = tree_capacity(st.session_state["wi_tree_branch"], depth)
    if n > most:  # a tree of this branching and depth holds fewer nodes than the size asked
        st.info(f"A tree with at most {st.session_state['wi_tree_branch']} children a node and depth "
                f"{depth} holds at most {most} nodes: shown at N = {most}. Raise the branching or the maximum "
                f"depth to inspect a tree of {n}.")
        n = most
    try:
        cur = tree_size_curve(alphas, st.session_state["wi_tree_sib"], st.session_state["wi_tree_branch"], depth,
                              cost, TREE_MAX_NODES, st.session_state["wi_slope"], measured)
        flat = tree_size_curve(alphas, st.session_state["wi_tree_sib"], st.session_state["wi_tree_branch"], depth,
                               cost, TREE_MAX_NODES, 0.0)
        shape = best_tree(n, alphas, st.session_state["wi_tree_sib"], st.session_state["wi_tree_branch"], depth)
    except SpeedupLabError as e:
        st.error(str(e))
        stop_page()
    i = n - 1
    k1, k2, k3, k4 = st.columns(4)
    k1.metric(f"Tokens per pass, best tree of {n}", f"{cur.tokens[i]:.2f}",
              delta=f"chain of {n} (depth {n}): {cur.chain_tokens[i]:.2f}", delta_color="off", delta_arrow="off",
              help="1 + Σ over the tree's nodes of P(path to the node accepted).")
    k2.metric(f"Speedup at N = {n}", f"{cur.speedups[i]:.2f}×",
              delta=f"pass over {n + 1} tokens = {cur.verify_ratios[i]:.2f} decode steps", delta_color="off",
              delta_arrow="off", help="Tokens per pass ÷ (c·depth + t(N+1)/t(1)).")
    k3.metric("Best tree size", f"N = {cur.best_n} ({cur.best_speedup:.2f}×)",
              delta=f"best chain: γ = {cur.best_chain_n} ({cur.best_chain_speedup:.2f}×)", delta_color="off",
              delta_arrow="off", help=f"Over N = 1..{TREE_MAX_NODES} at this verify-cost curve.")
    k4.metric("Best with a flat pass (s = 0)", f"N = {flat.best_n} ({flat.best_speedup:.2f}×)",
              help="A verify pass that costs one decode step at any size, as on a GPU while decoding is "
                   "memory-bound: there trees pay for many more nodes.")
    if cur.tokens[i] < cur.chain_tokens[i]:
        st.caption(f"The best tree of {n} gives fewer tokens per pass than the chain of {n} because it may go no "
                   f"deeper than D = {depth} (the Maximum depth slider) while the chain reaches depth {n}; a chain "
                   "is itself a tree, so with D ≥ N the best tree never gives fewer.")
    left, right = st.columns(2)
    fs = go.Figure()
    fs.add_scatter(x=cur.ns, y=cur.speedups, mode="lines", name="best tree", line={"width": 3, "color": YOURS_COLOR})
    fs.add_scatter(x=cur.ns, y=cur.chain_speedups, mode="lines", name="chain of N (depth N)", line={"color": "#4292c6"})
    fs.add_scatter(x=flat.ns, y=flat.speedups, mode="lines", name="best tree, flat pass (s = 0)",
                   line={"dash": "dash", "color": "#e6550d"})
    fs.add_scatter(x=[cur.best_n], y=[cur.best_speedup], mode="markers", name="best size", marker=BEST_MARKER)
    fs.add_hline(y=1.0, line_dash="dot", line_color=REFERENCE_LINE, annotation_text="no gain",
                 annotation_position="bottom left")
    fs.update_layout(title="Speedup against tree size N (★ best)", xaxis_title="tree size N (nodes)",
                     yaxis_title="speedup ×", height=CHART_H + 60, margin={"t": 40, "b": 10},
                     legend={"orientation": "h", "y": -0.3, "x": 0, "yanchor": "top"})
    show_chart(fs, key="wi_fig_tree_speedup", where=left)
    fk = go.Figure()
    fk.add_scatter(x=cur.ns, y=cur.tokens, mode="lines", name="tokens per pass, best tree",
                   line={"width": 3, "color": YOURS_COLOR})
    fk.add_scatter(x=cur.ns, y=cur.chain_tokens, mode="lines", name="tokens per pass, chain",
                   line={"color": "#4292c6"})
    fk.add_scatter(x=cur.ns, y=cur.verify_ratios, mode="lines", name="pass time t(N+1)/t(1)",
                   line={"dash": "dot", "color": "#888888"})
    fk.update_layout(title="What a tree gains and what its pass costs", xaxis_title="tree size N (nodes)",
                     yaxis_title="tokens · decode steps", height=CHART_H + 60, margin={"t": 40, "b": 10},
                     legend={"orientation": "h", "y": -0.3, "x": 0, "yanchor": "top"})
    show_chart(fk, key="wi_fig_tree_tokens", where=right)
    show_chart(shape_figure(shape.parents, shape.path_probs,
                            f"The best tree of {n} nodes (label: P(path accepted))"), key="wi_fig_tree_shape")
    st.caption(f"Verify cost: {what}. The best N-node tree keeps the N nodes with the largest P(path) (EAGLE-2's "
               "rule, Li et al. 2024; Sequoia, Chen et al. 2024, searches the same objective); with branching 1 "
               "it is a chain and the numbers are the Analytic model tab's. Formulas: "
               "engine/explain/analytic.py (tree_size_curve). On the Live page, the tree size and branching "
               "settings run real trees.")
    from engine.explain.measured import tree_pass_costs

    tp = tree_pass_costs()
    if tp is not None:
        first, last = tp["rows"][0], tp["rows"][-1]
        worst = max(t / c for _, c, t in tp["rows"])
        lead = ("**A real tree's verify pass costs about a chain's here**, so the curve above (a chain's passes) "
                "prices trees too" if worst <= 1.15 else
                "**Real trees cost more than this curve here**: the curve above is a chain's passes")
        st.caption(f"{lead}. Measured: over {first[0]} tokens a tree's pass took {first[2]:.1f} ms against the "
                   f"chain's {first[1]:.1f} ({first[2] / first[1]:.2f}×), over {last[0]} tokens {last[2]:.1f} against "
                   f"{last[1]:.1f} ms ({tp['cpu']}, {tp['compute']} path; benchmarks/bench_tree.py, "
                   f"benchmarks/results/{tp['file']}). A tree's drafting is not in the curve: the draft head drafts "
                   "a tree one depth a call, the c slider's cost per depth.")


def _gap_parts(run) -> None:
    """Where the gap between today's formula and the measured speedup comes from (engine.explain.analytic.
    predict_from_run): one assumption at a time, in a table and a chart."""
    st.subheader("Where the gap comes from")
    try:
        pred = predict_from_run(run)
    except SpeedupLabError as e:
        st.error(str(e))
        return
    if pred is None:
        st.caption("Press **Run baseline** on the live page: the prediction from the run needs its rounds and a "
                   "timed plain decode step t(1).")
        return
    st.caption(f"Costs in plain decode steps t(1) = {pred.t1_ms:.1f} ms; c = {pred.c:.3f} per draft token. Prefill "
               "is **included on both sides** in the last step, as in the measured speedup (whole-run ms per "
               "token); the steps before it are steady-state rounds without prefill.")
    show_table(gap_rows(pred), formats={"tokens per round": "%.2f", "round cost (decode steps)": "%.2f",
                                        "speedup ×": "%.2f", "off from measured %": "%+.1f"})
    fg = go.Figure()
    fg.add_bar(x=[s.label for s in pred.steps], y=[s.speedup for s in pred.steps], name="predicted",
               text=[f"{s.speedup:.2f}×" for s in pred.steps], textposition="inside")
    if pred.measured is not None:
        fg.add_bar(x=["Measured"], y=[pred.measured], name="measured", marker_color="#2ca02c",
                   text=[f"{pred.measured:.2f}×"], textposition="inside")
        fg.add_hline(y=pred.measured, line_dash="dot", line_color=REFERENCE_LINE)
    fg.update_layout(title="Predicted speedup, one assumption at a time, and the measured one", yaxis_title="speedup ×",
                     height=CHART_H, margin={"t": 40, "b": 10}, showlegend=False)
    show_chart(fg, key="wi_fig_gap")
    st.markdown(pred.summary)
    with st.expander("What each step assumes"):
        st.markdown("\n".join(f"- **{s.label}**: {s.assumption}." for s in pred.steps))


# ------------------------------------------------------------------ sequential vs parallel (block) drafting
SEQ_COLOR, BLOCK_COLOR, CUT_COLOR = "#4292c6", YOURS_COLOR, "#e6550d"
# the measured rows of one kind (block chains of B = 4, 8, 16, a cut, a tree) each get their own symbol of the kind's
# family, so the legend tells them apart (they drew as identical grey markers); all are plotly symbol names
MEASURED_SYMBOLS = {"block": ("diamond", "diamond-open", "diamond-x", "diamond-cross", "diamond-tall", "diamond-wide"),
                    "head": ("square", "square-open", "square-x", "square-cross"),
                    "medusa": ("triangle-up", "triangle-up-open", "triangle-down", "triangle-down-open")}
OTHER_SYMBOLS = ("circle", "circle-open", "circle-x", "circle-cross")


def _measured_marker(kind: str, nth: int) -> dict:
    """The grey marker of the ``nth`` measured row of draft ``kind`` (0-based): a symbol of the kind's family each."""
    family = MEASURED_SYMBOLS.get(kind, OTHER_SYMBOLS)
    symbol = family[nth % len(family)]
    hollow = symbol.endswith("-open")
    return {"symbol": symbol, "size": 12, "color": "#8c8c8c",
            "line": {"width": 2 if hollow else 1, "color": "#8c8c8c" if hollow else "#ffffff"}}


# below the x-axis title (at -0.25 on a shorter chart presenter mode's larger title ran into the legend)
BLOCK_LEGEND = {"orientation": "h", "y": -0.32, "x": 0, "yanchor": "top"}


def _block_results():
    """block.json read by the engine: (results or None, an error message or None)."""
    try:
        return load_block_results(), None
    except SpeedupLabError as e:
        return None, str(e)


def _block_cost(results) -> tuple[BlockCost, str]:
    """c_block(B) from the tab's choice, and where it comes from (one line)."""
    choice = st.session_state["wi_block_cmodel"]
    c0, c1 = st.session_state["wi_block_c0"], st.session_state["wi_block_c1"]
    if choice == "measured":
        if results is not None and results.block_pass:
            here = "this machine" if results.cpu == cpu_model() else "another machine than this one"
            cost = results.block_cost()
            return cost, f"{cost.describe()} ({results.label()}: {here})"
        st.info("No measured block passes yet: `benchmarks/bench_block.py --out benchmarks/results/block_amd-epyc` writes "
                "the file this tab reads (benchmarks/results/block_amd-epyc.json). "
                "Using one pass at the same cost for any B (c0) instead.")
        choice = "flat"
    cost = BlockCost.linear(c0, c1) if choice == "linear" else BlockCost.constant(c0)
    return cost, cost.describe() + " (set by the sliders)"


def _section_block() -> None:
    intro("Two ways to draft γ tokens for one verify pass. **Sequential** (a small draft model, an EAGLE-style "
          "head): γ draft steps, each conditioned on the tokens drafted before it; a round costs γ·c + t(γ+1)/t(1) "
          "target steps. **Parallel, block** (DFlash): a non-causal drafter fills a block [bonus token, MASK × "
          "(B − 1)] in **one** forward pass, conditioned on the target's hidden states; γ = B − 1 drafts cost "
          "c_block(B) + t(B)/t(1). Acceptance model: draft position j is kept with α_j = α·δ^(j−1) if all before "
          "it were. A block's position j > 1 sees only MASKs, not the tokens drafted before it, so its δ is "
          "usually lower. **+ confidence cut** (DSpark) is an *oracle*: it verifies exactly the tokens the round "
          "keeps — the ceiling of what a cut can save, not a measurement. α and c come from the sliders at the "
          "top; γ there is the draft length the metrics inspect.", label="About this tab")
    results, load_error = _block_results()
    b1, b2, b3 = st.columns(3)
    b1.slider("Block decay δ_block: α_j = α·δ^(j−1)", 0.0, 1.0, step=0.01, key="wi_block_decay",
              help="How much less a block position is accepted than the one before it. A block drafter guesses "
                   "position j from MASKs, not from its own earlier guesses, so its later positions fall off "
                   "faster than a sequential drafter's. 1 = no fall-off. The default 0.90 is an assumption, not a "
                   "measurement.")
    b1.slider("Sequential decay δ_seq", 0.0, 1.0, step=0.01, key="wi_block_seq_decay",
              help="The same for the sequential drafter; 1 = the constant α of the Analytic model tab.")
    b2.radio("Block pass cost c_block(B)", list(BLOCK_COSTS), key="wi_block_cmodel", format_func=BLOCK_COSTS.get,
             help="One drafter pass over B positions, as a fraction of one target decode step.")
    b2.slider("c0: one block pass (fraction of a target step)", 0.0, 1.0, step=0.01, key="wi_block_c0",
              disabled=st.session_state["wi_block_cmodel"] == "measured" and bool(results and results.block_pass))
    b2.slider("c1: what each block position adds", 0.0, 0.1, step=0.001, format="%.3f", key="wi_block_c1",
              disabled=st.session_state["wi_block_cmodel"] != "linear")
    b3.radio("Verify-cost curve t(n)", list(BLOCK_CURVES), key="wi_block_curve", format_func=BLOCK_CURVES.get)
    b3.button("A flat verify pass (s = 0), as on a GPU while decoding is memory-bound", key="wi_btn_block_flat",
              on_click=_set, kwargs={"block_curve": "slope", "slope": 0.0},
              help="Sets the verify-cost curve to the slope and the slope to 0: verifying B tokens costs one decode "
                   "step. There long blocks pay most; on this CPU each extra verified token costs time.")
    measured, what = _tree_curve("wi_block_curve")
    bcost, bcost_what = _block_cost(results)
    try:
        cur = drafting_curves(alpha, cost, bcost, st.session_state["wi_block_decay"],
                              st.session_state["wi_block_seq_decay"], st.session_state["wi_slope"], measured)
    except SpeedupLabError as e:
        st.error(str(e))
        stop_page()
    i = gamma - 1
    k1, k2, k3, k4 = st.columns(4)
    k1.metric(f"Sequential, γ = {gamma}", f"{cur.seq_speedup[i]:.2f}×",
              delta=f"E {cur.seq_tokens[i]:.2f} ÷ ({gamma}·c + {cur.verify[i]:.2f})", delta_color="off",
              delta_arrow="off", help="E ÷ (γ·c + t(γ+1)/t(1)): γ draft steps and one verify pass.")
    k2.metric(f"Block B = {gamma + 1}, γ = {gamma}", f"{cur.block_speedup[i]:.2f}×",
              delta=f"E {cur.block_tokens[i]:.2f} ÷ ({cur.block_draft_cost[i]:.2f} + {cur.verify[i]:.2f})",
              delta_color="off", delta_arrow="off", help="E ÷ (c_block(B) + t(B)/t(1)): one drafter pass and one "
                                                         "verify pass over the B = γ + 1 tokens.")
    k3.metric("Block + confidence cut (oracle)", f"{cur.cut_speedup[i]:.2f}×",
              delta=f"mean verify {cur.cut_verify[i]:.2f} instead of {cur.verify[i]:.2f}", delta_color="off",
              delta_arrow="off", help="Verifies only the tokens the round keeps: E ÷ (c_block(B) + E[t(T)/t(1)]). "
                                      "A ceiling, not a measurement: a real confidence head cuts some good tokens "
                                      "and verifies some bad ones.")
    k4.metric("Best γ: sequential", f"γ = {cur.best_seq[0]} ({cur.best_seq[1]:.2f}×)",
              delta=f"block: γ = {cur.best_block[0]}, B = {cur.best_block[0] + 1} ({cur.best_block[1]:.2f}×)",
              delta_color="off", delta_arrow="off", help=f"Over γ = 1..{GAMMA_MAX}; ties go to the shorter draft.")

    left, right = st.columns(2)
    fs = go.Figure()
    fs.add_scatter(x=cur.gammas, y=cur.seq_speedup, mode="lines", name="sequential (γ steps)",
                   line={"width": 2.5, "color": SEQ_COLOR})
    fs.add_scatter(x=cur.gammas, y=cur.block_speedup, mode="lines", name="block (one pass, B = γ + 1)",
                   line={"width": 3.5, "color": BLOCK_COLOR})
    fs.add_scatter(x=cur.gammas, y=cur.cut_speedup, mode="lines", name="block + confidence cut (oracle ceiling)",
                   line={"dash": "dash", "width": 2.5, "color": CUT_COLOR})
    fs.add_scatter(x=[b[0] for b in (cur.best_seq, cur.best_block, cur.best_cut)],
                   y=[b[1] for b in (cur.best_seq, cur.best_block, cur.best_cut)], mode="markers", name="best γ",
                   marker=BEST_MARKER)
    if results is not None:
        seen: dict[str, int] = {}
        for row in results.drafted():  # named by symbol in the legend: text labels of neighbours overlapped
            family = row.kind if row.kind in MEASURED_SYMBOLS else ""  # every other kind shares the circles
            nth = seen[family] = seen.get(family, -1) + 1
            fs.add_scatter(x=[row.gamma], y=[row.speedup], mode="markers", name=f"measured: {row.draft}",
                           marker=_measured_marker(row.kind, nth),
                           hovertemplate=(f"{row.draft}: %{{y:.2f}}× at γ = %{{x}}"
                                          + (f" (a tree of {row.tree} nodes)" if row.tree else "")
                                          + f", {row.tokens_per_pass:.2f} tokens per pass ({results.label()})"
                                          "<extra></extra>"))
    fs.add_hline(y=1.0, line_dash="dot", line_color=REFERENCE_LINE, annotation_text="no gain",
                 annotation_position="bottom left")
    fs.update_layout(title="Speedup against γ (★ best)", xaxis_title="draft tokens γ (block B = γ + 1)",
                     yaxis_title="speedup ×", height=CHART_H + 130, margin={"t": 40, "b": 10},
                     legend=BLOCK_LEGEND)
    show_chart(fs, key="wi_fig_block_speedup", where=left)
    fc = go.Figure()
    fc.add_scatter(x=cur.gammas, y=cur.seq_draft_cost, mode="lines", name="sequential drafting γ·c",
                   line={"width": 2.5, "color": SEQ_COLOR})
    fc.add_scatter(x=cur.gammas, y=cur.block_draft_cost, mode="lines", name="block drafting c_block(γ + 1)",
                   line={"width": 3.5, "color": BLOCK_COLOR})
    fc.add_scatter(x=cur.gammas, y=cur.verify, mode="lines", name="verify pass t(γ+1)/t(1)",
                   line={"dash": "dot", "color": "#888888"})
    fc.add_scatter(x=cur.gammas, y=cur.cut_verify, mode="lines", name="verify with the oracle cut E[t(T)/t(1)]",
                   line={"dash": "dash", "color": CUT_COLOR})
    fc.update_layout(title="What a round costs (target decode steps)", xaxis_title="draft tokens γ",
                     yaxis_title="target decode steps", height=CHART_H + 130, margin={"t": 40, "b": 10},
                     legend=BLOCK_LEGEND)
    show_chart(fc, key="wi_fig_block_cost", where=right)

    left, right = st.columns(2)
    fa = go.Figure()
    fa.add_scatter(x=cur.gammas, y=cur.seq_alphas, mode="lines+markers", name="sequential α_j",
                   line={"color": SEQ_COLOR})
    fa.add_scatter(x=cur.gammas, y=cur.block_alphas, mode="lines+markers", name="block α_j",
                   line={"color": BLOCK_COLOR})
    fa.update_layout(title="Acceptance by draft position j", xaxis_title="draft position j", yaxis_title="α_j",
                     yaxis_range=[0, 1.02], height=CHART_H, margin={"t": 40, "b": 10},
                     legend=BLOCK_LEGEND)
    show_chart(fa, key="wi_fig_block_alpha", where=left)
    bs, bb = cur.best_seq, cur.best_block
    verdict = ("block drafting pays more" if bb[1] > bs[1] * 1.005 else
               "sequential drafting pays more" if bs[1] > bb[1] * 1.005 else "the two are about even")
    right.markdown(
        f"**At these settings {verdict}**: sequential at best γ = {bs[0]} ({bs[1]:.2f}×), block at best "
        f"B = {bb[0] + 1} ({bb[1]:.2f}×).\n\n"
        "- **Why long blocks become affordable.** Sequential drafting pays c for every token it drafts, so its draft "
        "cost γ·c climbs with γ and stops its best γ early. A block costs one drafter pass whatever its length: "
        "going from B = 4 to B = 16 adds little to c_block(B), so drafting is no longer what limits γ.\n"
        "- **What limits it instead.** The verify pass over B tokens (flat on a GPU while decoding is memory-bound, "
        "growing on this CPU) and, mostly, how well the later positions are accepted. A block position sees MASKs, "
        "not the drafts before it, so its α_j falls faster (δ_block); a token deep in the block only counts if every "
        "one before it was accepted.\n"
        "- **The confidence cut** helps only where verifying more tokens costs more: with a flat verify cost "
        "(slope 0) it equals the full block. A cut at a fixed position is never better than a shorter block; "
        "only a per-round decision can pay.")
    st.caption(f"Block pass: {bcost_what}. Verify cost: {what}. Formulas: engine/explain/drafting.py "
               "(Leviathan et al. 2023, Eq. 1 and Theorem 3.8 with per-position α; block drafting after DFlash, "
               "arXiv 2602.06036; the confidence cut after DSpark, arXiv 2607.05147, as an oracle model).")
    if load_error:
        st.error(f"The measured points could not be read: {load_error}")
    elif results is None:
        st.caption("No measured points yet: run benchmarks/bench_block.py to put measured points here.")
    else:
        st.caption(f"Grey points: the shipped drafters {results.label()}, plain decoding = 1× on the same machine "
                   f"(target step {results.target_step_ms:.1f} ms; {results.command}). The lines are the model above, "
                   "not a fit to them.")
        show_table([{"draft": r.draft, "kind": r.kind, "γ": r.gamma, "tree nodes": r.tree,
                     "tokens per pass": r.tokens_per_pass, "tokens/s": r.tokens_per_s, "speedup ×": r.speedup}
                    for r in results.rows],
                   formats={"tokens per pass": "%.2f", "tokens/s": "%.1f", "speedup ×": "%.2f"})


for _tab, _section in ((tab_model, _section_model), (tab_sim, _section_simulator),
                       (tab_batch, _section_batch), (tab_toy, _section_toy),
                       (tab_meas, _section_measured), (tab_tree, _section_tree), (tab_block, _section_block)):
    if _tab.open:
        with _tab:
            _section()

check_yourself("whatif", safe_questions(whatif_questions, alpha, gamma, cost))

sync_url(URL_KEYS)
