"""Prefix caching page: paged KV blocks shared between requests (simulated on real tokens), and the real
prefill time saved on the embedded model. All numbers come from ``engine.explain.prefix_cache``."""

import html

import plotly.graph_objects as go
import streamlit as st
from plotly.colors import qualitative

from app.charts import show_chart, show_table
from app.live_view import escape_markdown, visible
from app.resources import get_model, get_tokenizer
from app.state import stage_text, stop_page, sync_url, url_leads, url_param
from app.teaching import check_yourself, safe_questions
from app.tour import intro
from engine.errors import SpeedupLabError
from engine.explain.prefix_cache import (
    MAX_BLOCK_SIZE,
    MAX_CONCURRENCY,
    PRESETS,
    common_prefix_len,
    estimate_ttft_ms,
    join_requests,
    measure_prefix_reuse,
    preset_requests,
    reusable_tokens,
    simulate_texts,
)
from engine.explain.teaching import prefix_questions

MAX_CAPACITY_UI = 512
PALETTE = qualitative.Light24
PARTIAL = len(PALETTE)          # colour index of partial blocks (grey)
FREE = PARTIAL + 1              # colour index of free pool slots (near white)
UNIQUE = PARTIAL + 2            # colour index of full blocks only one request uses (pale blue-grey)
TS_CHOICES = ["start", "end"]
TEXT_URL_MAX = 4000  # edited requests up to this many characters travel in the link (pc_text)

st.title("🧱 Prefix caching")
intro(
    "Requests often begin with the same tokens: a system prompt, a few-shot block, the earlier turns of a "
    "conversation. Their keys and values come out identical every time, so a serving engine can keep the "
    "KV cache of those tokens after a request ends and hand it to the next request that starts the same "
    "way. Paged engines do this per **block**: a block is named by a hash of its parent block and its own "
    "tokens, so equal prefixes give equal block names. Below, requests tokenized by the embedded model's "
    "tokenizer run through a simulated block pool; further down, the embedded model itself measures the "
    "time to first token (TTFT) with and without reusing a prefix."
)

# ------------------------------------------------------------------------------------------ controls
url_param("pc_preset", "system", str, choices=list(PRESETS))
url_param("pc_ts", "start", str, choices=TS_CHOICES)
url_param("pc_block", 16, int, lo=1, hi=MAX_BLOCK_SIZE)
url_param("pc_capacity", 64, int, lo=1, hi=MAX_CAPACITY_UI)
url_param("pc_conc", 2, int, lo=1, hi=MAX_CONCURRENCY)
url_param("pc_ms", 0.5, float, lo=0.01, hi=100.0)
url_param("pc_use_measured", False, bool)


def _preset_text() -> str:
    return join_requests(preset_requests(st.session_state["pc_preset"],
                                         timestamp_first=st.session_state["pc_ts"] == "start"))


def _reset_text() -> None:
    st.session_state["pc_text"] = _preset_text()
    st.session_state["pc_step"] = None  # all requests of the new text (None, not absent: see pc_step below)


if "pc_text" not in st.session_state or (url_leads() and "pc_preset" in st.query_params):
    # the link's edited requests, or its preset's text: also after Back/Forward, which kept the text of a
    # later preset under an earlier preset's name (and the link then carried that text as "edited")
    _text = str(st.query_params.get("pc_text") or "")[:TEXT_URL_MAX] or _preset_text()
    if st.session_state.get("pc_text") != _text:
        st.session_state["pc_text"] = _text

left, right = st.columns([1, 2])
with left:
    st.selectbox("Preset", list(PRESETS), format_func=PRESETS.get, key="pc_preset", on_change=_reset_text)
    if st.session_state["pc_preset"] == "timestamp":
        st.radio("Where is the varying timestamp line?", TS_CHOICES, key="pc_ts", horizontal=True,
                 format_func=lambda v: "at the start (the mistake)" if v == "start" else "at the end (the fix)",
                 on_change=_reset_text)
    st.slider("Block size (tokens per KV block)", 1, MAX_BLOCK_SIZE, key="pc_block")
    st.slider("Pool capacity (KV blocks)", 1, MAX_CAPACITY_UI, key="pc_capacity",
              help="How many blocks fit in the (simulated) GPU memory. Lower it to see evictions.")
    st.slider("Requests running at once", 1, MAX_CONCURRENCY, key="pc_conc",
              help="Admitting a request beyond this finishes the oldest running one first. Blocks held by "
                   "running requests are shared (reference count > 1) and can't be evicted.")
    measured = st.session_state.get("pc_measure")
    if measured is not None:
        st.checkbox(f"Use the measured prefill cost ({measured['result'].ms_per_prefill_token:.3f} ms/token)",
                    key="pc_use_measured")
    use_measured = measured is not None and st.session_state["pc_use_measured"]
    st.number_input("Prefill cost (ms per token, for the TTFT estimate)", min_value=0.01, max_value=100.0,
                    step=0.05, key="pc_ms", disabled=use_measured,
                    help="Measure it on the embedded model at the bottom of the page.")
# Re-assert the page's text before its box is drawn, so every run sends the box its value. In full browser-test
# runs on a loaded machine the box came back empty after a run that stopped on an error (pool too small): the
# browser then sent "" on the next slider change and the page lost the requests (fresh-clone CI, 3 runs in a row;
# app.state.keep_page_state does the same for the pages' other keys).
st.session_state["pc_text"] = st.session_state["pc_text"]
with right:
    st.text_area("Requests, in arrival order (separate them with a line containing only ---)",
                 key="pc_text", height=300)
sync_url(["pc_preset", "pc_ts", "pc_block", "pc_capacity", "pc_conc", "pc_ms", "pc_use_measured"])
_edited = st.session_state["pc_text"] != _preset_text()
_in_link = stage_text("pc_text", st.session_state["pc_text"] if _edited else None, TEXT_URL_MAX)
if _edited:
    with right:
        st.caption("Edited requests (not the preset's): " + (
            "the page's link carries them." if _in_link else
            f"longer than {TEXT_URL_MAX:,} characters, so the page's link gives the preset's text instead."))

ms_per_token = measured["result"].ms_per_prefill_token if use_measured else float(st.session_state["pc_ms"])

try:
    tokenizer = get_tokenizer("embedded")
    sim, tokens = simulate_texts(st.session_state["pc_text"], tokenizer,
                                 block_size=int(st.session_state["pc_block"]),
                                 capacity=int(st.session_state["pc_capacity"]),
                                 concurrency=int(st.session_state["pc_conc"]), ms_per_token=ms_per_token)
except SpeedupLabError as e:
    st.error(str(e))
    stop_page()

# ------------------------------------------------------------------------------------------ stepping
n_req = len(sim.requests)
url_param("pc_step", n_req, int, lo=1, hi=n_req)  # "Show requests 1 to": a link shows the same ones
if st.session_state.get("pc_step") is None or not 1 <= st.session_state["pc_step"] <= n_req:
    st.session_state["pc_step"] = n_req
elif (not url_leads() and st.session_state["pc_step"] == st.session_state.get("pc_n_before", n_req)
      and n_req > st.session_state["pc_step"]):
    st.session_state["pc_step"] = n_req  # the view was at the last request: an added one is shown too
st.session_state["pc_n_before"] = n_req


def _step(delta: int) -> None:
    st.session_state["pc_step"] = min(max(st.session_state["pc_step"] + delta, 1), n_req)


st.subheader("Requests through the block pool")
c1, c2, c3, c4 = st.columns([1.5, 1.4, 0.9, 4.2])
c1.button("◀ Previous request", on_click=_step, args=(-1,), disabled=st.session_state["pc_step"] <= 1)
c2.button("Next request ▶", on_click=_step, args=(1,), disabled=st.session_state["pc_step"] >= n_req)
c3.button("All", on_click=_step, args=(n_req,), disabled=st.session_state["pc_step"] >= n_req)
if n_req > 1:
    # pc_step is the page's value; the slider gets it written in before it is drawn. A slider keyed on
    # pc_step itself kept showing its old value after a run that stopped on an error (pool too small)
    # while the page used the restored one.
    st.session_state["pc_step_slider"] = st.session_state["pc_step"]
    c4.slider("Show requests 1 to", 1, n_req, key="pc_step_slider",
              on_change=lambda: st.session_state.update(pc_step=st.session_state["pc_step_slider"]))
step = int(st.session_state["pc_step"])
sync_url(["pc_step"])
tot = sim.totals(step)
cur = sim.requests[step - 1]

m1, m2, m3, m4 = st.columns(4)
m1.metric("Hit rate (requests shown)", f"{tot.hit_rate:.1%}",
          help="Prompt tokens served from cached blocks ÷ all prompt tokens.")
m2.metric("Prefill tokens skipped", f"{tot.hit_tokens:,} of {tot.prompt_tokens:,}")
m3.metric("Estimated TTFT saved (sum)", f"{tot.saved_ms:,.1f} ms",
          help=f"Skipped tokens × {ms_per_token:.3f} ms per prefill token.")
m4.metric("Blocks evicted", f"{tot.evictions}")

# colour per block content: blocks that several requests use get palette colours (in order of first
# appearance; they repeat after len(PALETTE)); blocks only one request uses are pale blue-grey.
counts: dict[str, int] = {}
for r in sim.requests:
    for h in {b.hash for b in r.blocks if b.hash is not None}:
        counts[h] = counts.get(h, 0) + 1
colour_of: dict[str, int] = {}
n_shared = 0
for r in sim.requests:
    for b in r.blocks:
        if b.hash is not None and b.hash not in colour_of:
            if counts[b.hash] > 1:
                colour_of[b.hash] = n_shared % len(PALETTE)
                n_shared += 1
            else:
                colour_of[b.hash] = UNIQUE
scale = []
ncol = len(PALETTE) + 3
for i, c in enumerate(list(PALETTE) + ["#9e9e9e", "#f4f4f4", "#aebfd6"]):
    scale += [(i / ncol, c), ((i + 1) / ncol, c)]


def _heat(z, text, hover, opacity, name):
    return go.Heatmap(z=z, text=text, hovertext=hover, hoverinfo="text", texttemplate="%{text}",
                      textfont={"size": 11}, colorscale=scale, zmin=-0.5, zmax=ncol - 0.5, showscale=False,
                      xgap=2, ygap=2, opacity=opacity, name=name)


shown = sim.requests[:step]
width = max(len(r.blocks) for r in shown)
show_text = width <= 40
z_hit = [[None] * width for _ in shown]
z_new = [[None] * width for _ in shown]
txt = [[""] * width for _ in shown]
hov = [[""] * width for _ in shown]
label = {"hit": "hit", "new": "new", "dup": "new", "partial": "part"}
for i, r in enumerate(shown):
    for b in r.blocks:
        ci = PARTIAL if b.hash is None else colour_of[b.hash]
        (z_hit if b.status == "hit" else z_new)[i][b.position] = ci
        if show_text:
            # two short lines, so a cell stays readable on a phone-wide chart
            txt[i][b.position] = label[b.status] + (f"<br>×{b.ref_count}" if b.ref_count > 1 else "")
        hov[i][b.position] = (
            f"Request {r.index + 1}, block {b.position} → pool slot {b.slot}<br>{b.status}, "
            f"{b.n_tokens} tokens, held by {b.ref_count} running request(s)<br>"
            f"hash {b.hash[:12] if b.hash else '— (partial block, not cached)'}<br>"
            f"{html.escape(b.text[:80]).replace(chr(10), '⏎')}")
fig = go.Figure([_heat(z_new, txt, hov, 0.45, "computed"), _heat(z_hit, txt, hov, 1.0, "cache hit")])
fig.update_yaxes(tickvals=list(range(len(shown))), ticktext=[f"Request {r.index + 1}" for r in shown],
                 autorange="reversed")
fig.update_xaxes(title="block position in the prompt")
fig.update_layout(height=114 + 42 * len(shown), margin=dict(l=10, r=10, t=34, b=40))
show_chart(fig, key="pc_table")
st.caption(f"Each row is a request's block table, in blocks of {sim.block_size} tokens (the last one may be "
           "partial). A bright colour marks a block (one hash) that several "
           "requests use: the same colour in two rows is the same cached block"
           + (" (colours repeat after 24 shared blocks)" if n_shared > len(PALETTE) else "") + "; pale "
           "blue-grey = a block only this request has. Solid = **cache hit** (reused, not computed); faded = **new** (computed by "
           "this request); grey = partial last block (computed, never cached). ×n = how many running "
           "requests share the block right after this one was admitted.")

# events of the current step
evs = []
if cur.finished:
    evs.append("Finished first (blocks released, still cached): request "
               + ", ".join(str(i + 1) for i in cur.finished) + ".")
evs.append(f"Request {cur.index + 1}: {cur.prompt_tokens} prompt tokens in {len(cur.blocks)} blocks; reused "
           f"{cur.hit_blocks} cached blocks ({cur.hit_tokens} tokens), computed {cur.computed_tokens} tokens "
           f"(hit rate {cur.hit_rate:.1%}).")
if cur.evictions:
    evs.append(f"Evicted {len(cur.evictions)} cached block(s) to make room: " + "; ".join(
        # the block's user text: newlines shown as ↵ (one made a paragraph break inside the quote),
        # Markdown escaped
        f"slot {e.slot} (depth {e.depth}, “{escape_markdown(visible(e.text[:30]))}”)" for e in cur.evictions[:8])
        + (" …" if len(cur.evictions) > 8 else ""))
else:
    evs.append("No eviction in this step.")
st.info("  \n".join(evs))

# pool after the step
per_row = 32
rows = -(-sim.capacity // per_row)
pz_used = [[None] * per_row for _ in range(rows)]
pz_cached = [[None] * per_row for _ in range(rows)]
ptxt = [[""] * per_row for _ in range(rows)]
phov = [[""] * per_row for _ in range(rows)]
for p in cur.pool:
    rr, cc = divmod(p.slot, per_row)
    if p.state == "free":
        pz_cached[rr][cc] = FREE
    elif p.state == "cached":
        pz_cached[rr][cc] = colour_of[p.hash]
    else:
        pz_used[rr][cc] = PARTIAL if p.hash is None else colour_of[p.hash]
        ptxt[rr][cc] = f"×{p.ref_count}"
    phov[rr][cc] = f"slot {p.slot}: {p.state}" + (f", depth {p.depth}" if p.depth is not None else "") + (
        f", held by {p.ref_count}" if p.ref_count else "")
pfig = go.Figure([_heat(pz_cached, ptxt, phov, 0.45, "free/cached"), _heat(pz_used, ptxt, phov, 1.0, "in use")])
pfig.update_yaxes(visible=False, autorange="reversed")
pfig.update_xaxes(visible=False)
pfig.update_layout(height=64 + 30 * rows, margin=dict(l=10, r=10, t=34, b=10))
n_state = {s: sum(p.state == s for p in cur.pool) for s in ("in use", "cached", "free")}
st.markdown(f"**The pool after request {step}** — {sim.capacity} blocks: {n_state['in use']} in use (solid, "
            f"×n = reference count), {n_state['cached']} cached and evictable (faded), "
            f"{n_state['free']} free (blank).")
show_chart(pfig, key="pc_pool")

show_table([
    # short headers: eleven columns must fit a 1280-px screen with the sidebar open
    {"Request": r.index + 1, "Prompt tokens": r.prompt_tokens, "Blocks": len(r.blocks),
     "Hit blocks": r.hit_blocks, "Hit tokens": r.hit_tokens, "Computed tokens": r.computed_tokens,
     "Hit rate": f"{r.hit_rate:.1%}", "TTFT ms, no cache": round(r.ttft_no_cache_ms, 2),
     "TTFT ms, cached": round(r.ttft_cached_ms, 2), "Saved ms": round(r.saved_ms, 2),
     "Evictions": len(r.evictions)}
    for r in shown])
st.caption(f"Hits are whole cached blocks from the start of the prompt, never the last prompt token (its "
           f"logits give the first output token). TTFT (estimated) = computed tokens × {ms_per_token:.3f} ms; "
           "prefix caching does nothing for decode, so it pays most for long prompts and short answers. "
           "Keep stable text first and varying text (dates, names, the question) last.")

# ------------------------------------------------------------------------------------- real model
check_yourself("prefix", safe_questions(prefix_questions, tokenizer, st.session_state["pc_preset"],
                                        int(st.session_state["pc_block"]), st.session_state["pc_ts"] == "start"))

st.subheader("Measured on the embedded model")
st.markdown(
    "Pick an earlier request whose KV cache is kept and a later one. The later one is prefilled twice on "
    "SmolLM2-135M: from scratch, and on top of a copy of the earlier request's KV cache cut back to their "
    "shared whole blocks. Then both decode a few tokens, to show decode time per token is unchanged.")
if n_req < 2:
    st.info("Add a second request to measure reuse between two requests.")
    stop_page()
url_param("pc_a", 1, int, lo=1, hi=n_req)
url_param("pc_b", 2, int, lo=1, hi=n_req)
for k in ("pc_a", "pc_b"):
    if not 1 <= st.session_state[k] <= n_req:
        st.session_state[k] = min(max(st.session_state[k], 1), n_req)
ca, cb = st.columns(2)
ca.selectbox("Earlier request (its KV cache is reused)", list(range(1, n_req + 1)), key="pc_a")
cb.selectbox("Later request (prefilled with and without reuse)", list(range(1, n_req + 1)), key="pc_b")
sync_url(["pc_a", "pc_b"])
pair_ok = st.session_state["pc_a"] < st.session_state["pc_b"]
if not pair_ok:
    st.warning("The earlier request must come before the later one (a request reuses the cache of one that "
               "arrived before it): pick another pair.")
ta, tb = tokens[st.session_state["pc_a"] - 1], tokens[st.session_state["pc_b"] - 1]
shared = common_prefix_len(ta, tb)
reuse = reusable_tokens(len(tb), shared, sim.block_size)
est_full, est_reuse = estimate_ttft_ms(len(tb), reuse, ms_per_token)
if pair_ok:
    st.write(f"They share {shared} leading tokens; {reuse} of the later request's {len(tb)} tokens "
             f"({reuse // sim.block_size} whole blocks of {sim.block_size}) can be reused.")

pair_key = (tuple(ta), tuple(tb), sim.block_size)
if st.button("Measure on the embedded model", type="primary", key="pc_measure_btn", disabled=not pair_ok):
    try:
        with st.spinner("Loading the model and timing prefill and decode (about 10 s on an idle 2-core CPU)…"):
            lm = get_model("embedded")
            res = measure_prefix_reuse(lm, ta, tb, block_size=sim.block_size, repeats=5, decode_tokens=8)
        st.session_state["pc_measure"] = {"key": pair_key, "result": res}
        st.rerun()
    except SpeedupLabError as e:
        st.error(str(e))

measured = st.session_state.get("pc_measure")
if measured is not None and measured["key"] == pair_key:
    m = measured["result"]
    k1, k2, k3 = st.columns(3)
    k1.metric("TTFT, full prefill (measured)", f"{m.ttft_full_ms:.1f} ms",
              help=f"Median of {m.repeats} runs, alternating with the reuse runs; {m.prompt_tokens} tokens.")
    k2.metric("TTFT, prefix reused (measured)", f"{m.ttft_reuse_ms:.1f} ms",
              delta=f"{m.ttft_reuse_ms - m.ttft_full_ms:+.1f} ms", delta_color="inverse",
              help=f"Computes only the last {m.prompt_tokens - m.reused_tokens} tokens on top of "
                   f"{m.reused_tokens} reused ones.")
    k3.metric("First-token logits, max |difference|", f"{m.max_abs_logit_diff:.2e}",
              help=f"{m.dtype} on {m.device}; same first token: {m.same_first_token}; same "
                   f"{m.decode_tokens} decoded tokens: {m.same_decoded_tokens}.")
    d1, d2, d3 = st.columns(3)
    d1.metric("Decode after full prefill", f"{m.decode_full_ms_per_token:.1f} ms/token",
              help=f"Median over {m.repeats} runs of {m.decode_tokens} greedy tokens each.")
    d2.metric("Decode after prefix reuse", f"{m.decode_reuse_ms_per_token:.1f} ms/token",
              help="The cache holds the same tokens either way, so each decode step does the same work.")
    d3.metric("Measured prefill cost", f"{m.ms_per_prefill_token:.3f} ms/token",
              help="Full-prefill TTFT ÷ prompt tokens; tick the box at the top to use it in the simulator.")
    cfig = go.Figure([
        go.Bar(name="measured", x=["full prefill", "with prefix reuse"], y=[m.ttft_full_ms, m.ttft_reuse_ms],
               text=[f"{m.ttft_full_ms:.1f}", f"{m.ttft_reuse_ms:.1f}"], textposition="outside"),
        go.Bar(name=f"simulator estimate ({ms_per_token:.3f} ms/token)", x=["full prefill", "with prefix reuse"],
               y=[est_full, est_reuse], text=[f"{est_full:.1f}", f"{est_reuse:.1f}"], textposition="outside"),
    ])
    cfig.update_layout(barmode="group", yaxis_title="time to first token (ms)", height=330,
                       margin=dict(l=10, r=10, t=30, b=10))
    show_chart(cfig, key="pc_measure_chart")
    ok = m.max_abs_logit_diff < 1e-4 and m.same_first_token
    (st.success if ok else st.warning)(
        f"Reusing the cache gives the same first token ({'yes' if m.same_first_token else 'NO'}) with logits "
        f"within {m.max_abs_logit_diff:.1e} of full prefill ({m.dtype}). Prefill: {m.speedup:.2f}× faster. "
        f"Decode per token: {m.decode_full_ms_per_token:.1f} vs {m.decode_reuse_ms_per_token:.1f} ms — "
        + ("the same within noise: prefix caching only skips prefill. "
           if m.decode_spread <= m.DECODE_NOISE else
           f"these should be equal (both decode over the same cached keys and values; prefix caching only "
           f"skips prefill) but differ {m.decode_spread:.2f}×: the machine was busy while measuring, so "
           "measure again. ")
        + "Measured prefill cost: "
        f"{m.ms_per_prefill_token:.3f} ms/token. Copying and cropping the earlier cache took "
        f"{m.copy_ms:.1f} ms, not counted: a paged engine shares the blocks instead of copying them.")
    st.caption("On a CPU, times vary with load; the simulator's linear estimate ignores the fixed cost of a "
               "forward pass, so it undershoots for the short remainder that reuse computes.")
elif measured is not None:
    st.caption("The last measurement was for another pair or block size; press the button to measure this one.")
