"""In the wild: which widely used engines document which of these speedups (facts from
``engine.explain.teaching.IN_THE_WILD``, each with its documentation page), and the speculative methods each
engine ships in late 2026 (``SPEC_METHODS_2026``, each checked against a cited repository file, dated)."""

import re

import streamlit as st

from app.state import note_replaced
from app.tour import intro
from app.registry import PAGES
from engine.explain.teaching import IN_THE_WILD, SPEC_METHODS_2026, WILD_CHECKED

st.title("🌍 In the wild")
intro(
    "The speedups on these pages are not research curiosities: the widely used inference engines ship "
    "them. Each line below is stated only as far as the named documentation page (or the installed "
    "library's source) says; versions move fast, so check the current page before relying on a flag.")
engines = sorted({f.engine for f in IN_THE_WILD})
# the filter travels in the link (Streamlit keeps it in the URL: ?wild_engines=vLLM&wild_engines=SGLang)
# and drops a name it does not offer; say so rather than silently show something else than the link said
for raw in st.query_params.get_all("wild_engines"):
    if raw not in engines:
        note_replaced("wild_engines", raw, "(not offered: left out)")
pick = st.multiselect("Engines", engines, default=engines, key="wild_engines", bind="query-params")
# a documentation address in a source ("docs.vllm.ai/en/v0.9.1/…") becomes a link; the text is our own
# curated text (engine.explain.teaching), never user or model text
_ADDRESS = re.compile(r"\b((?:docs\.[\w.-]+|[\w-]+\.github\.io|github\.com|huggingface\.co)/[^\s;,()]*[^\s;,().])")


def _linked(source: str) -> str:
    return _ADDRESS.sub(r"[\1](https://\1)", source)


shown = [f for e in engines if e in pick for f in IN_THE_WILD if f.engine == e]  # the sections' order
for engine in [e for e in engines if e in pick]:
    st.subheader(engine)
    # written as Markdown so flags show as code
    st.markdown("\n".join(f"- **{f.technique}**: {f.how}. *Documented at* "
                           f"{_linked(f.source)}."
                           for f in shown if f.engine == engine))
_TITLES = {p.url_path: p.title for p in PAGES}
st.header(f"Speculative methods, late 2026 (checked {WILD_CHECKED})", divider="gray")
st.markdown("One line per method per engine: how it drafts, how it is switched on, the file it was checked "
            "against, and the page of this app that shows the mechanism (the closest one). A line marked "
            "*unverified* says what could not be read in the engine's own code.")
for engine in [e for e in ("vLLM", "SGLang", "llama.cpp", "TensorRT-LLM") if e in pick]:
    rows = [m for m in SPEC_METHODS_2026 if m.engine == engine]
    st.markdown(f"**{engine}**\n\n" + "\n".join(
        f"- **{m.method}**: {m.drafts}. {m.flag}. *Checked in* {_linked(m.source)}. "
        f"[Shown on: {_TITLES.get(m.link.url_path, m.link.url_path)}](/{m.link.url()})"
        + ("" if m.verified == "yes" else f" · *unverified*: {m.verified}")
        for m in rows))
with st.expander("The same facts as a table (download as CSV from its toolbar)"):
    st.dataframe(
        [{"engine": f.engine, "what": f.technique, "how it is switched on": f.how.replace("`", ""),
          "as documented at": f.source} for f in shown],
        hide_index=True, width="stretch")
st.caption("FlashAttention-style fused attention kernels are the default attention path in these engines' "
           "GPU builds; only the transformers line is stated here because it was checked against the "
           "installed source.")
st.markdown(
    "This app's own engine offers five drafts on the **Live** page: a trained EAGLE-style head on the "
    "target's own hidden states, a trained small draft model, prompt lookup, early exit, and any draft "
    "model that shares the target's tokenizer; "
    "`benchmarks/bench_speculative.py` compares it with transformers' `assistant_model`, "
    "`prompt_lookup_num_tokens` and `assistant_early_exit` on this machine.")
