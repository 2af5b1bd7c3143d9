"""Common mistakes, live: each mistake from the explainer reproduced with the engine's numbers, with a
one-click button that opens the page showing it. Numbers come from ``engine.explain.teaching``."""

import streamlit as st

from app.charts import show_table
from app.navigation import go_button
from app.resources import get_tokenizer
from app.tour import intro
from engine.errors import SpeedupLabError
from engine.explain.measured import arithmetic_agreement
from engine.explain.teaching import (
    MISTAKE_LINKS,
    large_batch_mistake,
    long_answer_mistake,
    quality_mistake,
    timestamp_mistake,
    tokenizer_mistake,
)

st.title("🚧 Common mistakes, live")
intro("Five mistakes people make with these speedups. Each shows its effect with the engine's "
            "numbers; a button opens the page in the state that reproduces it (the tokenizer mistake is "
            "reproduced right here).")


@st.cache_data(show_spinner=False)
def _batch():
    return large_batch_mistake()


@st.cache_data(show_spinner="Running the toy check…")
def _quality():
    return quality_mistake()


@st.cache_data(show_spinner=False)
def _long():
    return long_answer_mistake()


# 1 ------------------------------------------------------------------------------------------------
st.header("1 · Speculating on a large batch")
lb = _batch()
st.markdown(f"A {lb.params_b:g} B bf16 target on an {lb.hardware}, α = {lb.alpha}, γ = {lb.gamma}, "
            f"c = {lb.c}. Speculation turns spare compute into fewer passes; a large batch has no spare "
            "compute left.")
c1, c2, c3 = st.columns(3)
c1.metric("Speedup at batch 1", f"{lb.speedup_at_1:.2f}×")
c2.metric(f"Speedup at batch {lb.large_batch}", f"{lb.speedup_at_large:.2f}×")
c3.metric("Slower than plain decoding from batch",
          "never (in range)" if lb.crossover_batch is None else f"≈ {lb.crossover_batch:,.0f}")
go_button(MISTAKE_LINKS["large_batch"], "Reproduce on the What-if page", key="mk_batch")


@st.cache_data(show_spinner=False)
def _shipped_sweep(path: str, mtime_ns: int):
    """The shipped sweep, read once per file version (the path and its mtime are the cache key)."""
    from engine.explain.batch_view import shipped_sweep

    return shipped_sweep(path)


def _measured_batch():
    """Mistake #1 measured: this session's sweep (What-if) if one was run, else the last one measured on this
    machine (``batch_view.machine_sweep``), else the benchmark's shipped file (labelled with its machine).
    Returns (the mistake's numbers or None, the other machine's CPU when they come from the shipped file)."""
    from engine.explain import batch_view
    from engine.explain.teaching import measured_batch_mistake

    sweep = st.session_state.get("batch_sweep")
    if sweep is not None:
        return measured_batch_mistake(sweep, "this session's sweep (What-if → When it does not help)"), None
    earlier = batch_view.machine_sweep("embedded")  # the last complete sweep measured on this machine, if any
    if earlier is not None:
        meta = earlier[1]
        return measured_batch_mistake(earlier[0], f"this machine's last sweep ({meta['date']}, {meta['cpu']}, "
                                                  f"{meta['compute']} kernels; What-if → When it does not help)"), None
    f = batch_view.SHIPPED_SWEEP
    if not f.is_file():
        return None, None
    shipped = _shipped_sweep(str(f), f.stat().st_mtime_ns)
    if shipped is None:
        return None, None
    machine = shipped[1]
    where = (f", measured on {machine['cpu']} with the {machine.get('compute', 'default')} compute path"
             if machine.get("cpu") else ", measured on an earlier machine (not recorded)")
    return measured_batch_mistake(shipped[0], f"the shipped benchmark result {f.parent.parent.name}/{f.parent.name}/"
                                              f"{f.name} (benchmarks/bench_batch.py{where})"), \
        machine.get("cpu") or "not recorded"


try:
    mb, other = _measured_batch()
except SpeedupLabError as e:
    st.error(str(e))
else:
    if mb is not None:
        here = "session" in mb.source or "this machine" in mb.source
        # a figure from another machine says so in the sentence, not only in the small print under it
        where = "on this machine" if here else f"on another machine ({other}), by the shipped benchmark"
        st.markdown(f"**Measured {where}** (the embedded SmolLM2-135M, {mb.label} against plain decoding of "
                    "the same batch, total tokens/s):")
        c1, c2, c3 = st.columns(3)
        c1.metric(f"Speedup at batch {mb.small_batch}", f"{mb.speedup_small:.2f}×")
        c2.metric(f"Speedup at batch {mb.large_batch}", f"{mb.speedup_large:.2f}×")
        c3.metric("Slower than plain decoding from batch (measured)",
                  f"{mb.crossover_batch}" if mb.crossover_batch is not None else f"none up to {mb.large_batch}")
        from engine.explain.batch_view import SHIPPED_SWEEP

        shipped_note = "" if here else f" See {SHIPPED_SWEEP.with_suffix('.md').name} in benchmarks/results/."
        st.caption(f"From {mb.source}; torch threads {mb.threads}; {mb.run_note}.{shipped_note} Run your own on the "
                   "What-if page's “When it does not help” tab (Measured on this machine).")

# 2 ------------------------------------------------------------------------------------------------
st.header("2 · A draft with a different tokenizer")
st.markdown("The target checks the draft's token **ids**. If the draft numbers its vocabulary differently, "
            "its ids name other strings for the target, and nearly every draft token is rejected. Here the "
            "draft is a stand-in: a word-level tokenizer built from the sentence itself.")
try:
    tm = tokenizer_mistake(get_tokenizer("embedded"))
except SpeedupLabError as e:
    st.error(str(e))
else:
    show_table([{"tokenizer": "target (SmolLM2)", "ids": str(tm.target_ids)},
                {"tokenizer": "draft (stand-in)", "ids": str(tm.draft_ids)},
                {"tokenizer": "draft's ids read by the target", "ids": tm.draft_ids_read_by_target}])
    if tm.engine_error:  # the expected outcome, shown as such (a red error box read as the app failing)
        st.info(f"✅ As it should, the engine refuses the pair: {tm.engine_error}")
    st.caption(f"Sentence: “{tm.text}” The live page runs the same check "
               "(engine.decoding.models.check_tokenizers_compatible) before it accepts any draft model.")

# 3 ------------------------------------------------------------------------------------------------
st.header("3 · “Speculative decoding trades quality for speed”")
qm = _quality()
st.markdown(f"The toy models of the what-if page, {qm.n_rounds:,} rounds each: the engine's acceptance rule "
            "against a naive rule that keeps every draft token.")
c1, c2 = st.columns(2)
c1.metric("Engine rule: distance to the target's p", f"{qm.tvd_engine:.3f}",
          delta=f"χ² p-value {qm.chi2_p_engine:.2g}", delta_color="off", delta_arrow="off")
c2.metric("Naive rule: distance to the target's p", f"{qm.tvd_naive:.3f}",
          delta=f"χ² p-value {qm.chi2_p_naive:.2g}", delta_color="off", delta_arrow="off")
st.caption("With the correct rule the output follows the target exactly (the small distance is sampling "
           "noise); only a wrong rule changes quality.")
_arith = arithmetic_agreement()
if _arith is not None:
    _where = "this machine" if _arith["own"] else f"another machine ({_arith['cpu']})"
    st.markdown(
        "What does trade quality is the **arithmetic**: quantized weights and activations. This engine's default "
        "arithmetic rounds each product's activations to 8 bits (as llama.cpp does); measured on "
        f"{_where} ({_arith['date'][:10]}), {_arith['identical']} of {_arith['prompts']} greedy texts stay identical "
        f"to the exact fp32 arithmetic's and the most likely next token agrees at {100 * _arith['top1']:.1f} % of "
        "positions. Speculation on top changes nothing more: on either arithmetic its greedy text is plain "
        "decoding's, token for token (the Live page's Arithmetic switch shows both).")
go_button(MISTAKE_LINKS["quality"], "Reproduce on the What-if page (distribution check)", key="mk_quality")

# 4 ------------------------------------------------------------------------------------------------
st.header("4 · A timestamp at the start of the prompt")
try:
    tsm = timestamp_mistake(get_tokenizer("embedded"))
except SpeedupLabError as e:
    st.error(str(e))
else:
    st.markdown(f"Five requests sharing a system prompt, each with its own timestamp line, blocks of "
                f"{tsm.block_size} tokens ({tsm.prompt_tokens:,} prompt tokens in all).")
    c1, c2 = st.columns(2)
    c1.metric("Hit rate, timestamp first", f"{tsm.hit_rate_start:.0%}",
              delta=f"{tsm.hit_tokens_start:,} tokens skipped", delta_color="off", delta_arrow="off")
    c2.metric("Hit rate, timestamp last", f"{tsm.hit_rate_end:.0%}",
              delta=f"{tsm.hit_tokens_end:,} tokens skipped", delta_color="off", delta_arrow="off")
go_button(MISTAKE_LINKS["timestamp"], "Reproduce on the Prefix caching page", key="mk_ts",
          extra_clear=("pc_text", "pc_step"))

# 5 ------------------------------------------------------------------------------------------------
st.header("5 · Expecting prefix caching to speed up a long answer")
la = _long()
st.markdown(f"{la.model} on {la.gpu} (roofline): a {la.prompt_tokens:,}-token prompt, {la.cached_tokens:,} "
            f"tokens of it cached, then a {la.answer_tokens:,}-token answer.")
c1, c2, c3 = st.columns(3)
# the uncached time is the value and the cached one the pill: "8.9 ms / −25.7 ms with the cache" read as if
# the cache made prefill negative
c1.metric("Prefill (TTFT), no cache", f"{la.prefill_ms_full:.1f} ms",
          delta=f"{la.prefill_ms_cached:.1f} ms with the cache", delta_color="off", delta_arrow="off")
c2.metric("Decode", f"{la.decode_ms:,.0f} ms", delta="unchanged", delta_color="off", delta_arrow="off")
c3.metric("Whole request saved", f"{la.saved_share:.1%}")
st.caption("Prefix caching skips prefill only; the answer is still produced one decode step at a time.")
st.caption("To measure it on a real model: the Prefix caching page's last section, “Measured on the embedded "
           "model”, times prefill with and without a cached prefix, and the decode steps after it, on this "
           "machine's SmolLM2 (the numbers above are the roofline model of Llama on a GPU).")
go_button(MISTAKE_LINKS["long_answer"], "Open the Prefix caching page (scroll to its last section)", key="mk_long",
          extra_clear=("pc_text", "pc_step"))
