"""Your traffic: a serving engine's speculative-decoding metrics (vLLM, SGLang, llama.cpp server, TensorRT-LLM;
vLLM's per-request JSON) or the Live page's last run, turned into measured acceptance by draft position, tokens per pass by γ, the best γ and the
flags to run it.

UI only: every number comes from ``engine.explain.traffic``. Widget keys start with ``yt_`` and are mirrored in
the URL; the scrapes travel in the link (only their speculative lines) when short enough.
"""

from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st

from app.charts import REFERENCE_LINE, show_chart, show_table
from app.live_view import escape_markdown
from app.state import stage_text, stop_page, sync_url, url_leads, url_param
from app.tour import intro
from engine.errors import SpeedupLabError
from engine.explain.analytic import GAMMA_MAX
from engine.explain.traffic import (
    ALLOWED_HOSTS_ENV,
    ENGINE_TITLES,
    compact_scrape,
    example_scrapes,
    fetch_scrape,
    list_models,
    position_view,
    costs_from_run,
    predict,
    profile_from_input,
    profile_from_run,
    run_to_prometheus,
    settings_for,
)

SOURCES = ("Scrapes (paste or fetch)", "The Live page's last run")
SCRAPE_URL_MAX = 3000  # a scrape's speculative lines up to this many characters travel in the link
CHART_H = 360
MEASURED, GEOMETRIC, EXTRAP = "#1f77b4", "#ff7f0e", "#9ecae1"

url_param("yt_source", SOURCES[0], str, choices=list(SOURCES))
url_param("yt_url", "http://127.0.0.1:8000/metrics", str)
url_param("yt_model", "", str)
url_param("yt_cost", 0.05, float, lo=0.0, hi=1.0, step=0.01)
url_param("yt_slope", 0.0, float, lo=0.0, hi=1.0, step=0.01)
URL_KEYS = ["yt_source", "yt_url", "yt_model", "yt_cost", "yt_slope"]
S = st.session_state
EXAMPLE = example_scrapes()

# the scrapes: the link's (compacted) text, or the example the first time
for _k, _ex in (("yt_scrape", EXAMPLE[0]), ("yt_scrape2", EXAMPLE[1])):
    if _k not in S or (url_leads() and _k in st.query_params):
        _text = str(st.query_params.get(_k) or "")[:SCRAPE_URL_MAX] or (
            _ex if "yt_scrape" not in st.query_params else "")
        if S.get(_k) != _text:
            S[_k] = _text


def _fetch(into: str) -> None:
    """Button callback: GET the URL (loopback or allowed hosts only) into a scrape box."""
    try:
        S[into] = fetch_scrape(S["yt_url"])
        S["yt_fetch_note"] = ("ok", f"Fetched {len(S[into]):,} characters from {S['yt_url']} into the "
                                    + ("first" if into == "yt_scrape" else "second") + " box.")
    except SpeedupLabError as e:
        S["yt_fetch_note"] = ("error", str(e))


@st.cache_resource(show_spinner=False)
def _llama_servers() -> dict:
    """The local llama.cpp server this app started (one per app process, shared by every reader)."""
    return {}


def _llama_panel() -> None:
    """Start a local llama.cpp server (operator-enabled only), send it requests, point the address box at it."""
    from engine.serving import llamacpp as lc

    box = _llama_servers()
    srv = box.get("server")
    if srv is not None and not srv.running():
        box.pop("server", None)
        st.error(f"The llama.cpp server stopped (exit {srv.process.returncode}); log: {srv.log_path}")
        srv = None
    with st.expander("🦙 A real server on this machine: llama.cpp", expanded=srv is not None):
        if not lc.live_enabled():
            st.info(f"Whoever runs this app can let this page start llama.cpp's `llama-server` on the embedded "
                    f"model (127.0.0.1 only): start the app with `{lc.ENABLE_ENV}=1` in the environment, or "
                    f"`streamlit run app/main.py -- {lc.LIVE_FLAG}`. It is off by default because the app may be "
                    f"served to a room. Or run it yourself: `make serve-llamacpp`, then fetch "
                    f"http://127.0.0.1:{lc.DEFAULT_PORT}/metrics below.")
            return
        if srv is None:
            spec = st.selectbox("Speculation", ["ngram-simple", "none"], key="yt_lc_spec",
                                help="ngram-simple: prompt lookup (--spec-ngram-simple-size-n 3, -m 8). "
                                     "draft-simple needs a draft GGUF, and none ships with this app.")
            if st.button("Start a local llama.cpp server", key="yt_btn_lc_start"):
                port = lc.DEFAULT_PORT if not lc.port_in_use(lc.DEFAULT_PORT) else lc.free_port()
                line = st.empty()
                with st.spinner("Starting llama-server (the first start builds it: several minutes) …"):
                    try:
                        srv = lc.start_for_app(lc.ServerConfig(port=port, spec_type=spec),
                                               progress=lambda m: line.caption(escape_markdown(m)))
                    except SpeedupLabError as e:
                        st.error(escape_markdown(str(e)))
                        return
                box["server"] = srv
                S["yt_url"] = srv.metrics_url
                st.rerun()
            return
        st.success(f"llama-server ({srv.cfg.spec_type}) is running at {srv.url}; its metrics address is in the box "
                   f"below. Fetch → first, send some requests, Fetch → second.")
        n1, n2, n3 = st.columns([1, 1, 2], vertical_alignment="bottom")
        n = n1.number_input("Requests", 1, lc.MAX_REQUESTS, 4, key="yt_lc_n")
        toks = n2.number_input("Tokens each", 8, 128, 48, step=8, key="yt_lc_tokens")
        if n3.button(f"Send {int(n)} requests", key="yt_btn_lc_send"):
            bar = st.progress(0.0, text="sending …")
            try:
                out = lc.send_requests(srv.url, int(n), max_tokens=int(toks),
                                       progress=lambda i, k: bar.progress(i / k, text=f"{i} of {k} requests"))
            except SpeedupLabError as e:
                st.error(escape_markdown(str(e)))
            else:
                S["yt_lc_sent"] = out
        sent = S.get("yt_lc_sent")
        if sent:
            show_table({"request": list(range(1, len(sent) + 1)), "tokens": [r["tokens"] for r in sent],
                        "seconds": [r["seconds"] for r in sent],
                        "drafted": [r["draft_n"] for r in sent], "accepted": [r["draft_n_accepted"] for r in sent]},
                       formats={"seconds": "%.2f"})
            st.caption("Greedy /completion requests, one at a time; drafted/accepted are the server's own per-request "
                       "timings. The counters of /metrics moved by their sum.")
        if st.button("Stop the server", key="yt_btn_lc_stop"):
            box.pop("server", None)
            srv.stop()
            st.rerun()


def _clear() -> None:
    S["yt_scrape"], S["yt_scrape2"], S["yt_model"] = "", "", ""


def _example() -> None:
    S["yt_scrape"], S["yt_scrape2"], S["yt_model"] = EXAMPLE[0], EXAMPLE[1], ""


st.title("📡 Your traffic: from measured acceptance to settings")
intro(
    "Acceptance depends on your prompts, your draft and your sampling settings, so measure it on your own "
    "traffic rather than assuming a number. vLLM, SGLang, llama.cpp server and TensorRT-LLM count their drafts "
    "and the draft tokens the target kept; paste what their `/metrics` address returns (two scrapes, some traffic apart, "
    "measure just that traffic), or fetch it, and read off α per draft position, the draft length γ that pays "
    "best, and the flags to run it. A vLLM response body with `metrics.speculative_decoding` "
    "(`--per-request-spec-decode-metrics`) can be pasted too.")

st.radio("Numbers from", SOURCES, key="yt_source", horizontal=True)
prof = None
if S["yt_source"] == SOURCES[0]:
    _llama_panel()
    u1, u2, u3, u4 = st.columns([3, 1, 1, 1], vertical_alignment="bottom")
    u1.text_input("Server's metrics address", key="yt_url",
                  help=f"Loopback only (127.0.0.1, ::1, localhost), unless whoever runs this app lists more hosts "
                       f"in the environment variable {ALLOWED_HOSTS_ENV}. vLLM: port 8000; SGLang: 30000 (with "
                       "--enable-metrics); llama-server: 8080 (with --metrics).")
    u2.button("Fetch → first", key="yt_btn_fetch1", on_click=_fetch, args=("yt_scrape",),
              help="Time-out 5 s.")
    u3.button("Fetch → second", key="yt_btn_fetch2", on_click=_fetch, args=("yt_scrape2",),
              help="Fetch again after some traffic: the page then measures what happened in between.")
    u4.button("Example", key="yt_btn_example", on_click=_example, help="Two vLLM scrapes of an example server.")
    note = S.pop("yt_fetch_note", None)
    if note is not None:
        (st.success if note[0] == "ok" else st.error)(escape_markdown(note[1]))  # quotes the typed address
    b1, b2 = st.columns(2)
    b1.text_area("Scrape (Prometheus text), or the first of two", key="yt_scrape", height=140,
                 placeholder="vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"…\"} 1200\n…")
    b2.text_area("Second scrape of the same server, taken later (optional)", key="yt_scrape2", height=140)
    st.button("Clear both", key="yt_btn_clear", on_click=_clear)
    for _k in ("yt_scrape", "yt_scrape2"):  # the link carries the scrapes' speculative lines (not the example's)
        if S[_k] == EXAMPLE[0 if _k == "yt_scrape" else 1]:
            stage_text(_k, None, SCRAPE_URL_MAX)
        # an emptied box travels as one space, so the link does not reopen the example
        elif not stage_text(_k, (compact_scrape(S[_k]) if S[_k].strip() else "") or " ", SCRAPE_URL_MAX):
            st.caption(f"The {'first' if _k == 'yt_scrape' else 'second'} scrape's speculative lines are longer "
                       f"than {SCRAPE_URL_MAX:,} characters, so the page's link does not carry them.")
    first, second = S["yt_scrape"], S["yt_scrape2"]
    if not first.strip() and not second.strip():
        st.info("Paste a scrape (what `curl http://127.0.0.1:8000/metrics` prints), fetch one, or press Example.")
        sync_url(URL_KEYS)
        stop_page()
    if not first.strip():
        first, second = second, ""
    try:
        models = [] if first.lstrip()[:1] in ("{", "[") else list_models(first)
        if len(models) > 1:
            if S["yt_model"] not in models:
                S["yt_model"] = ""
            st.selectbox("Model (this scrape has several)", ["", *models], key="yt_model",
                         format_func=lambda m: "— choose one —" if m == "" else m)
        model = S["yt_model"] or None
        prof = profile_from_input(first, second, model, source="pasted or fetched text")
    except SpeedupLabError as e:
        st.error(escape_markdown(str(e)))
        sync_url(URL_KEYS)
        stop_page()
else:
    dec = S.get("lv_dec")
    if dec is None or getattr(dec, "proposer", None) is None or not getattr(dec, "rounds", None):
        st.info("No speculative run in this session yet: run the Live page (🔴 Live speculative decoding) with a "
                "draft, then come back.")
        sync_url(URL_KEYS)
        stop_page()
    try:
        prof = profile_from_run(dec, model=getattr(getattr(dec, "target", None), "name", None))
    except SpeedupLabError as e:
        st.error(escape_markdown(str(e)))
        sync_url(URL_KEYS)
        stop_page()
    # the model's c and s from what this run measured (once per run: the sliders stay the reader's afterwards)
    run_key = f"{id(dec)}:{len(dec.rounds)}"
    if S.get("yt_run_costs") != run_key:
        t1 = None
        try:
            from engine.decoding.pass_cost import machine_pass_cost

            t1 = dict(machine_pass_cost(dec.target, measure=False).ms).get(1)
        except (SpeedupLabError, AttributeError):
            pass
        try:
            c_run, s_run, S["yt_run_where"] = costs_from_run(dec.stats(), dec.gamma, t1)
            S["yt_cost"], S["yt_slope"] = round(c_run, 2), round(s_run, 2)
        except SpeedupLabError as e:
            S["yt_run_where"] = f"not from the run ({e}): the sliders' values"
        S["yt_run_costs"] = run_key
    st.caption(f"Draft cost and verify slope below are this run's, as measured: {S['yt_run_where']}. Move the "
               "sliders to try other costs.")
    with st.expander("This run's counters in vLLM's names (paste them into the box above, or feed them to "
                     "`python -m engine traffic`)"):
        st.code(run_to_prometheus(prof, model_name=prof.model or "speedup-lab"), language="text", wrap_lines=True)

c1, c2 = st.columns(2)
c1.slider("Draft cost c (one draft step ÷ one target decode step)", 0.0, 1.0, step=0.01, key="yt_cost",
          help="Your draft's cost. A small draft model is often 0.05–0.2, an EAGLE head ~0.02–0.1, n-gram lookup ~0.")
c2.slider("Verify-cost slope s: t(n) = t(1)·(1 + s·(n − 1))", 0.0, 1.0, step=0.01, key="yt_slope",
          help="0: checking γ + 1 tokens costs one decode step (memory-bound); 1: each token costs a full step.")
try:
    pred = predict(prof, S["yt_cost"], S["yt_slope"], GAMMA_MAX)
except SpeedupLabError as e:
    st.error(escape_markdown(str(e)))
    sync_url(URL_KEYS)
    stop_page()

# ------------------------------------------------------------------ what was measured
who = ENGINE_TITLES[prof.engine] + (f" · model {escape_markdown(prof.model)}" if prof.model else "")
live_run = S["yt_source"] == SOURCES[1]
st.subheader("What the Live run measured" if live_run else "What your server measured")
st.caption(f"{who} · {prof.window}" + (f" · {prof.drafts:,.0f} drafts, {prof.draft_tokens:,.0f} draft tokens, "
                                        f"{prof.accepted_tokens:,.0f} accepted" if prof.has_counts else "")
           + (f" · {prof.draft_tokens:,.0f} draft tokens, {prof.accepted_tokens:,.0f} accepted (no count of drafts)"
              if not prof.has_counts and prof.draft_tokens is not None else "")
           + (f" · {prof.generation_tokens:,.0f} generated tokens over {prof.verify_calls:,.0f} verify calls"
              if prof.tokens_per_pass_counter is not None else ""))
m1, m2, m3, m4 = st.columns(4)
ar, ml, ah = prof.acceptance_rate, prof.mean_acceptance_length, prof.alpha_hat
m1.metric("Acceptance rate", "—" if ar is None else f"{ar:.3f}",
          help="vLLM's definition: accepted ÷ draft tokens. Counts the tokens after a rejection too, so it is lower "
               "than the analytic model's α̂." + (" For SGLang: (length − 1) ÷ γ, γ from its two gauges."
                                                  if prof.engine == "sglang" else ""))
m2.metric("Mean acceptance length", "—" if ml is None else f"{ml:.2f}",
          help="1 + accepted ÷ drafts: tokens per target pass, the bonus token included (vLLM, SGLang).")
m3.metric("α̂ (the analytic model's α)", "—" if ah is None else f"{ah:.3f}",
          help="Accepted ÷ judged draft tokens (judged: the target evaluated them). The What-if page's α. "
               "Without the judged count (drafts of varying length, SGLang), the α whose E(α, γ) is the mean "
               "acceptance length.")
m4.metric("γ the run drafted" if live_run else "γ the server ran", "—" if prof.gamma is None else str(prof.gamma),
          help="The number of draft positions counted (vLLM: num_speculative_tokens).")
for n in prof.notes:
    st.caption("ℹ️ " + escape_markdown(n))  # notes quote label values of the scrape

# ------------------------------------------------------------------ per position
pv = position_view(prof)
st.subheader("Acceptance by draft position")
if pv is None:
    st.info("No per-position counts (SGLang exposes only means; older llama.cpp builds lack the per-position "
            "counter): the predictions below use one α for every position, the geometric model.")
else:
    st.markdown("**Survival** P(A ≥ i + 1) = kept at i ÷ drafts: the share of drafts whose token i was kept "
                "(vLLM's \"per-position acceptance rate\"). **Conditional α_i** = kept at i ÷ kept at i − 1: "
                "the chance token i is kept once every token before it was, the analytic model's α position by "
                "position. The geometric model assumes α_i = α̂ everywhere, so survival = α̂^(i+1). (The acceptance "
                "rate above, vLLM's, is in no chart: it also counts the tokens after a rejection.)")
    left, right = st.columns(2)
    xs = pv.positions
    fa = go.Figure()
    err = {"type": "data", "symmetric": False,
           "array": [None if h is None or a is None else h - a for h, a in zip(pv.ci_high, pv.conditional)],
           "arrayminus": [None if lo is None or a is None else a - lo for lo, a in zip(pv.ci_low, pv.conditional)]}
    fa.add_scatter(x=xs, y=pv.conditional, mode="lines+markers", name="measured α_i (95 % interval)",
                   error_y=err, line={"color": MEASURED, "width": 3})
    fa.add_scatter(x=xs, y=[pv.alpha_hat] * len(xs), mode="lines", name=f"geometric: α̂ = {pv.alpha_hat:.3f}",
                   line={"color": GEOMETRIC, "dash": "dash"})
    fa.update_layout(title="Conditional α_i (kept | all before kept)", xaxis={"title": "draft position i", "range": [-0.5, max(xs) + 0.5]},
                     yaxis={"title": "α_i", "range": [0, 1.02]}, xaxis_dtick=1, height=CHART_H,
                     margin={"t": 40, "b": 10}, legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
    show_chart(fa, key="yt_fig_alpha", where=left)
    fs = go.Figure()
    fs.add_scatter(x=xs, y=pv.survival, mode="lines+markers", name="measured survival",
                   line={"color": MEASURED, "width": 3})
    fs.add_scatter(x=xs, y=pv.survival_geometric, mode="lines+markers", name="geometric: α̂^(i+1)",
                   line={"color": GEOMETRIC, "dash": "dash"})
    fs.update_layout(title="Survival P(A ≥ i + 1)", xaxis={"title": "draft position i", "range": [-0.5, max(xs) + 0.5]},
                     yaxis={"title": "share of drafts", "range": [0, 1.02]}, xaxis_dtick=1, height=CHART_H,
                     margin={"t": 40, "b": 10}, legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
    show_chart(fs, key="yt_fig_survival", where=right)
    show_table({"position i": xs, "kept at i": pv.kept, "reached i": pv.reached, "survival": pv.survival,
                "conditional α_i": pv.conditional,
                "α_i 95 % (Wilson)": ["—" if lo is None else f"{lo:.3f}–{hi:.3f}"
                                      for lo, hi in zip(pv.ci_low, pv.ci_high)]},
               formats={"kept at i": "%.0f", "reached i": "%.0f", "survival": "%.3f", "conditional α_i": "%.3f"})
    if not prof.full_length_drafts and prof.engine != "speedup-lab":
        st.caption("Some drafts were shorter than γ (draft tokens < drafts × γ), so \"reached i\" over-counts the "
                   "drafts that had a token i and α_i past position 0 reads low.")

# ------------------------------------------------------------------ by γ
st.subheader("Tokens per target pass and speedup by γ")
n_meas = pred.measured_positions
left, right = st.columns(2)
ft = go.Figure()
meas_x = [g for g, e in zip(pred.gammas, pred.extrapolated) if not e]
ext_x = [g for g, e in zip(pred.gammas, pred.extrapolated) if e]
if pv is not None:
    ft.add_scatter(x=meas_x, y=pred.tokens_measured[:len(meas_x)], mode="lines+markers",
                   name="from measured α_i", line={"color": MEASURED, "width": 3})
    if ext_x:
        ft.add_scatter(x=[meas_x[-1], *ext_x], y=pred.tokens_measured[len(meas_x) - 1:], mode="lines",
                       name="extrapolated (last α_i repeated)", line={"color": EXTRAP, "dash": "dot", "width": 3})
ft.add_scatter(x=pred.gammas, y=pred.tokens_geometric, mode="lines", name="geometric, constant α̂",
               line={"color": GEOMETRIC, "dash": "dash"})
ft.update_layout(title="Expected tokens per target pass E(γ)", xaxis_title="draft length γ", yaxis_title="tokens",
                 height=CHART_H, showlegend=True, margin={"t": 40, "b": 10},
                 legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
show_chart(ft, key="yt_fig_tokens", where=left)
fsp = go.Figure()
if pv is not None:
    fsp.add_scatter(x=meas_x, y=pred.speedup_measured[:len(meas_x)], mode="lines+markers",
                    name="from measured α_i", line={"color": MEASURED, "width": 3})
    if ext_x:
        fsp.add_scatter(x=[meas_x[-1], *ext_x], y=pred.speedup_measured[len(meas_x) - 1:], mode="lines",
                        name="extrapolated", line={"color": EXTRAP, "dash": "dot", "width": 3})
fsp.add_scatter(x=pred.gammas, y=pred.speedup_geometric, mode="lines", name="geometric, constant α̂",
                line={"color": GEOMETRIC, "dash": "dash"})
iv = pred.speedup_interval
fsp.add_scatter(x=[pred.best_gamma], y=[pred.best_speedup], mode="markers", name="best γ",
                marker={"symbol": "star", "size": 15, "color": "#ffbf00", "line": {"width": 1, "color": "#555555"}},
                error_y=None if iv is None else {"type": "data", "symmetric": False,
                                                 "array": [iv[1] - pred.best_speedup],
                                                 "arrayminus": [pred.best_speedup - iv[0]]})
fsp.add_hline(y=1.0, line_dash="dot", line_color=REFERENCE_LINE, annotation_text="no gain",
              annotation_position="bottom left")
if n_meas:
    fsp.add_vline(x=n_meas + 0.5, line_dash="dot", line_color=REFERENCE_LINE)
    fsp.add_annotation(x=n_meas + 0.5, y=0, yref="paper", xanchor="left", yanchor="bottom", showarrow=False,
                       text=" measured | extrapolated →")
fsp.update_layout(title=f"Speedup E / (γc + 1 + sγ), c = {pred.c:.2f}, s = {pred.slope:.2f}",
                  xaxis_title="draft length γ", yaxis_title="speedup ×", height=CHART_H, margin={"t": 40, "b": 10},
                  legend={"orientation": "h", "y": -0.25, "x": 0, "yanchor": "top"})
show_chart(fsp, key="yt_fig_speedup", where=right)
if pv is not None and n_meas:
    g = min(n_meas, GAMMA_MAX)
    d = pred.tokens_measured[g - 1] - pred.tokens_geometric[g - 1]
    st.caption(f"At the measured γ = {g}: {pred.tokens_measured[g - 1]:.3f} tokens per pass from the measured α_i "
               f"against {pred.tokens_geometric[g - 1]:.3f} from the constant-α formula (Leviathan et al. 2023, Eq. 1): "
               f"{d:+.3f} ({d / pred.tokens_geometric[g - 1]:+.1%}). Formula: E(γ) = 1 + Σ_(k≤γ) Π_(i<k) α_i.")

# ------------------------------------------------------------------ settings
st.subheader("The settings to run")
best, sp = pred.best_gamma, pred.best_speedup
if sp < 1.0:
    st.warning(f"Even the best draft length (γ = {best}) gives {sp:.2f}×: at this draft cost speculation is slower "
               "than plain decoding. Run without a draft, or find a cheaper or better one.")
else:
    unc = "" if iv is None else f" (95 % from the counts: {iv[0]:.2f}–{iv[1]:.2f}×)"
    share = pred.best_gamma_share.get(best)
    st.markdown(f"Best draft length **γ = {best}**: predicted **{sp:.2f}×** plain decoding{unc}"
                + ("" if share is None else f"; γ = {best} is the best in {share:.0%} of the profiles the counts allow")
                + ".")
    if pred.best_is_extrapolated:
        ran = (f"the {n_meas} draft position{'s' if n_meas != 1 else ''} "
               + ("this run drafted" if live_run else "your server ran"))
        st.warning(f"γ = {best} is longer than {ran}: positions past {n_meas} "
                   + ("are assumed as good as the last one." if pv is not None else
                      "follow the geometric model fitted to the mean, which nothing measured there.")
                   + f" The best γ within what was measured is {pred.best_gamma_measured} "
                     f"({pred.best_speedup_measured:.2f}×). "
                   + (f"Run the Live page at γ = {best} to measure it." if live_run else
                      f"Try γ = {best}, then scrape again."))
    for s in settings_for(best):
        st.markdown(f"**{s.engine}** · [flags documented here]({s.doc}) · {s.note}")
        st.code(s.flags, language="bash", wrap_lines=True)
st.caption("Model: speedup = E / (γc + t(γ+1)/t(1)) (Leviathan et al. 2023, Theorem 3.8, with the verify-cost "
           "slope); E from the measured α_i. Code: engine/explain/traffic.py (predict, settings_for).")

sync_url(URL_KEYS)
