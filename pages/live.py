"""Live speculative decoding: real rounds on a real model, every probability behind every decision.

The decoder lives in this browser session's state (its KV caches and traces are never shared); models
come from the process-wide resource cache. Rounds run in the target's room (``engine.decoding.scheduler``):
one worker thread batches every reader's rounds into one target pass; the page submits and waits. All numbers come from ``engine.decoding.speculative`` /
``engine.decoding.trace``; ``app.live_view`` turns traces into escaped Markdown, rows and chart data; ``engine.decoding.measure`` times
the A/B baseline comparison.
"""

import itertools
import time
from typing import NamedTuple

import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from app.charts import REFERENCE_LINE, show_chart, show_table
from app.live_view import (
    CHECKING,
    finished_line,
    finished_unsure,
    PROMPT_URL_MAX,
    room_lines,
    room_progress_line,
    round_to_show,
    chart_labels,
    default_draft_kind,
    default_preset,
    focus_position,
    generated_markdown,
    generated_pieces,
    history_rows,
    legend_markdown,
    opened_round_message,
    round_link_value,
    block_frames,
    choice_line,
    choice_rows,
    round_frames,
    round_rows,
    round_summary,
    verdict_frame,
    visible,
)
from app.decoders import DRAFT_KINDS, make_decoder
from app.resources import get_model
from app.why_view import why_card
from app.state import note_replaced, stage_text, stage_url, stop_page, sync_url, url_leads, url_param
from app.teaching import check_yourself, safe_questions
from app.tour import intro, presenting
from app.tree_view import mask_figure, tree_figure, tree_round_markdown, tree_rows
from engine.decoding.compute import ARITHMETICS
from engine.decoding.compute import arithmetic as process_arithmetic
from engine.decoding.measure import measure_speedup_ab, measured_run
from engine.explain.measured import arithmetic_note
from engine.decoding.draft_length import ADAPTIVE_GAMMA_MAX
from engine.decoding.drafts import EMBEDDED_AUTO
from engine.decoding.models import (EMBEDDED, EMBEDDED_BLOCK, EMBEDDED_DRAFT, EMBEDDED_HEAD, EMBEDDED_MEDUSA,
                                    default_draft_spec)
from engine.decoding.invariance import check_in_background
from engine.decoding.scheduler import room_for
from engine.decoding.sampling import ACCEPT_RULES
from engine.decoding.speculative import SpeculativeDecoder
from engine.errors import SpeedupLabError
from engine.explain.why import why_from_run
from engine.explain.analytic import (TREE_MAX_BRANCHING, TREE_MAX_NODES, default_gamma_here, expected_tokens_per_pass,
                                     expected_tokens_per_round)
from engine.explain.presets import CUSTOM, PROMPT_PRESETS, preset_text
from engine.explain.teaching import live_questions
from engine.explain.tree_view import round_tree_layout, tree_counts, tree_frames

GAMMA_MAX = 16
CONF_MAX = 0.95  # the draft head's confidence gate slider (the engine accepts [0, 1))
MAX_NEW_UI = 256
PROMPT_MAX_CHARS = 8000
# autoplay speed → (seconds between animation frames, extra pause after each round)
SPEEDS = {"instant": (0.0, 0.0), "fast": (0.04, 0.0), "presenter": (0.25, 0.8)}
ANIM_BUDGET_S = 0.4  # a stepped round's whole animation stays under this
INSTANT_REDRAW_S = 0.5  # "instant" autoplay redraws at most this often
ROOM_REDRAW_S = 0.5  # with other readers in the room, Run to the end updates its progress bar (the room's numbers in
# its text) at most every 0.5 s per other reader and draws the round, the text and the room panel only when the run
# ends (bench_room.py, 16 readers in headless Chromium: 16 pages redrawing every 3 s kept a 16-row pass at 3.9 s median, 1.3 s with no redraws; the
# target's forward was 0.8 s. Each element drawn is a message every page's browser renders: the panel is ten)
ROOM_WAKE_S = 0.1  # at instant speed a running page takes its rounds from the room at most this often (it draws at
# most every INSTANT_REDRAW_S): woken for every pass, 16 readers' pages took the GIL from the room's worker 16 times a pass
AB_REPS = 3  # Run baseline times this many speculative and plain runs each, A B B A A B (engine.decoding.measure):
# an odd count, so each median is one real run, and one slow run (a busy machine) cannot decide it
URL_KEYS = ["lv_preset", "lv_gamma", "lv_temp", "lv_topk", "lv_topp", "lv_draft", "lv_k", "lv_seed",
            "lv_max_new", "lv_target", "lv_draft_model", "lv_speed", "lv_conf", "lv_tree", "lv_branch",
            "lv_accept", "lv_rule", "lv_length", "lv_arith"]
LENGTH_LABELS = {"adaptive": "Adaptive: each round drafts what pays (0 to γ)", "fixed": "Fixed: γ every round"}
ADAPTIVE_KINDS = ("head", "auto")  # drafts whose rounds can choose their length (engine.decoding.draft_length)
RULE_LABELS = {"standard": "Standard (min(1, p/q), residual draws)",
               "gumbel": "Drafter-invariant (Gumbel-max: plain's text)"}
ARITHMETIC_LABELS = {"int8": "int8 (as llama.cpp)", "fp32": "fp32 (exact reference)"}
ACCEPT_LABELS = {"exact": "Exact (lossless)", "typical": "Typical acceptance (Medusa; lossy)"}
TREE_BRANCH_DEFAULT = 4  # the engine's own default (the tree drafts' branching, as the CLI uses)

st.title("🔴 Live speculative decoding")
# A fixed style rule: hide Streamlit's running indicator (top right) on this page. Its Stop halts the script
# wherever it is, mid-draw, and left the page stale (the progress bar, no statistics, a round count one behind);
# the page's Stop button ends a run between rounds and redraws everything. And the indicator redraws while a script
# runs (its running man 5 times a second, its label), and a page waiting on the room's worker runs for the whole
# room: 16 such pages in headless Chromium used 7.9 CPU s in 15.5 s with the indicator's icon hidden, 5.8 s with
# the whole indicator hidden and 4.5 s with Streamlit's top bar off (a bare Streamlit app; bench_room.py
# runs the readers' browsers on the server's 2 cores). The page's own progress bar says it is running; other pages
# keep the indicator and its Stop (their long work has no Stop of its own).
st.html("<style>[data-testid='stStatusWidget'] { display: none; }</style>")
intro(
    "A small **draft** proposes γ tokens; the **target** checks all of them in **one** forward pass and "
    "keeps the longest agreed prefix, plus one token of its own (a **correction** at the first rejected "
    "position, or a **bonus** token when every draft token was accepted). Under sampling a draft token x "
    "is accepted when a uniform draw u < min(1, p(x)/q(x)), with p the target's and q the draft's "
    "probability; a rejection resamples from the residual norm(max(0, p − q)), so the output follows p "
    "exactly (Leviathan et al. 2023, Algorithm 1). Step a round and open it to see every number."
)

# ------------------------------------------------------------------------------------------ settings
url_param("lv_target", EMBEDDED, str)
url_param("lv_arith", process_arithmetic(), str, choices=list(ARITHMETICS))  # how the target multiplies its blocks
_default_spec = default_draft_spec(st.session_state["lv_target"].strip() or EMBEDDED)
url_param("lv_preset", default_preset(default_draft_kind(_default_spec)), str,
          choices=list(PROMPT_PRESETS) + [CUSTOM])
url_param("lv_draft", default_draft_kind(_default_spec), str, choices=list(DRAFT_KINDS))
url_param("lv_k", 8, int, lo=1, hi=256)
url_param("lv_draft_model", "", str)
url_param("lv_length", "adaptive", str, choices=list(LENGTH_LABELS))  # the head's draft length (the combined draft's
# is always adaptive)
# each draft kind's own default γ on this machine (the head's from the measured pass cost, Medusa's its K heads, the
# block drafter's its block − 1): a kind's γ means another thing, and a γ fit for one undersold another
_KIND_SPEC = {"head": EMBEDDED_HEAD, "auto": EMBEDDED_AUTO, "medusa": EMBEDDED_MEDUSA, "block": EMBEDDED_BLOCK, "draft": EMBEDDED_DRAFT,
              "ngram": "ngram"}


def _kind_gamma(kind: str) -> tuple[int, str]:
    """(default γ, why) of a draft kind for the current target (``engine.explain.analytic.default_gamma_here``); with
    an adaptive length γ is the cap (``engine.decoding.draft_length.ADAPTIVE_GAMMA_MAX``)."""
    if kind == "auto" or (kind in ADAPTIVE_KINDS and st.session_state.get("lv_length", "adaptive") == "adaptive"):
        return ADAPTIVE_GAMMA_MAX, ("the cap of an adaptive length: each round drafts 0 to γ tokens, as many as the "
                                    "expected gain on this machine's measured costs pays for")
    return default_gamma_here(_KIND_SPEC.get(kind, kind), st.session_state["lv_target"].strip() or EMBEDDED)


_gamma_default, _gamma_why = _kind_gamma(st.session_state["lv_draft"])
if "lv_gamma_set" not in st.session_state:  # a link's γ other than its draft's default counts as the reader's own
    _raw_gamma = st.query_params.get("lv_gamma")
    st.session_state["lv_gamma_set"] = _raw_gamma is not None and _raw_gamma != str(_gamma_default)
url_param("lv_gamma", _gamma_default, int, lo=1, hi=GAMMA_MAX)
url_param("lv_conf", 0.0, float, lo=0.0, hi=CONF_MAX, step=0.05)  # off: α̂ and γ keep the analytic model's meaning
url_param("lv_temp", 0.0, float, lo=0.0, hi=2.0, step=0.05)
url_param("lv_topk", 0, int, lo=0, hi=1000)
url_param("lv_topp", 1.0, float, lo=0.01, hi=1.0, step=0.01)
url_param("lv_seed", 0, int, lo=0, hi=999_999)
url_param("lv_max_new", 64, int, lo=1, hi=MAX_NEW_UI)
url_param("lv_speed", "fast", str, choices=list(SPEEDS))
url_param("lv_tree", 0, int, lo=0, hi=TREE_MAX_NODES)  # token tree of at most this many nodes; 0 = a chain
url_param("lv_branch", TREE_BRANCH_DEFAULT, int, lo=1, hi=TREE_MAX_BRANCHING)
url_param("lv_accept", "exact", str, choices=list(ACCEPT_RULES))  # a tree's rule under sampling
url_param("lv_rule", "standard", str, choices=list(RULE_LABELS))  # the sampling rule (the lesson's is the default)
if "lv_prompt" not in st.session_state:  # a preset's text, or a shared link's custom prompt
    st.session_state["lv_prompt"] = (preset_text(st.session_state["lv_preset"])
                                     if st.session_state["lv_preset"] != CUSTOM
                                     else str(st.query_params.get("lv_prompt", ""))[:PROMPT_URL_MAX])
    # a link made with a prompt too long to travel in it names the custom preset but carries no prompt
    st.session_state["lv_link_without_prompt"] = (st.session_state["lv_preset"] == CUSTOM
                                                  and not st.query_params.get("lv_prompt"))
elif url_leads() and "lv_preset" in st.query_params:
    # Back/Forward or a link to the page: its prompt is its preset's, or its own custom one (kept as it is
    # when the link could not carry it); Back past a preset change kept the later preset's prompt
    _prompt = (preset_text(st.session_state["lv_preset"]) if st.session_state["lv_preset"] != CUSTOM
               else str(st.query_params.get("lv_prompt", ""))[:PROMPT_URL_MAX] or st.session_state["lv_prompt"])
    if st.session_state["lv_prompt"] != _prompt:
        st.session_state["lv_prompt"] = _prompt


def _on_preset() -> None:
    if st.session_state["lv_preset"] != CUSTOM:
        st.session_state["lv_prompt"] = preset_text(st.session_state["lv_preset"])


def _on_target_change() -> None:
    """A new target keeps the user's draft unless it is the shipped draft head, which reads the embedded
    target's features only: then the draft follows the target's default (prompt lookup), as the CLI's
    default does, and the page says so."""
    spec = st.session_state["lv_target"].strip() or EMBEDDED
    kind = default_draft_kind(default_draft_spec(spec))
    if st.session_state["lv_draft"] in ("head", "medusa", "block") and kind != "head":
        st.session_state["lv_draft"] = kind
        st.session_state["lv_gamma"] = default_gamma_here(default_draft_spec(spec), spec)[0]
        st.session_state["lv_gamma_set"] = False
        st.session_state["lv_draft_note"] = (f"Draft switched to {DRAFT_KINDS[kind]}, γ = "
                                             f"{st.session_state['lv_gamma']}: the shipped draft head was trained "
                                             "on the embedded target's features only.")


def _on_draft_change() -> None:
    """γ becomes the new draft's default on this machine unless the reader set γ; into or out of the block drafter
    always (a block's γ is its length − 1; the other drafts' γ means a number of sequential guesses)."""
    kind = st.session_state["lv_draft"]
    if not st.session_state.get("lv_gamma_set") or kind == "block" or st.session_state.get("lv_prev_draft") == "block":
        st.session_state["lv_gamma"] = _kind_gamma(kind)[0]
        st.session_state["lv_gamma_set"] = False
    st.session_state["lv_prev_draft"] = kind


def _on_length() -> None:
    """γ becomes the draft's default for the new length policy (the adaptive cap, or the fixed γ) unless the
    reader set γ."""
    if not st.session_state.get("lv_gamma_set"):
        st.session_state["lv_gamma"] = _kind_gamma(st.session_state["lv_draft"])[0]


def _on_gamma() -> None:
    st.session_state["lv_gamma_set"] = True  # the reader's own γ: a change of draft keeps it


def _on_prompt_edit() -> None:
    p = st.session_state["lv_preset"]
    if p != CUSTOM and st.session_state["lv_prompt"] != preset_text(p):
        st.session_state["lv_preset"] = CUSTOM


with st.sidebar:
    st.header("Settings")
    _prompt_box = st.container()  # the prompt first: what a reader changes most (filled below)
    st.text_input("Target model", key="lv_target", on_change=_on_target_change,
                  help="`embedded` (SmolLM2-135M-Instruct), a Hugging Face id in the local cache, or a folder.")
    st.radio("Arithmetic", list(ARITHMETICS), key="lv_arith", horizontal=True, format_func=ARITHMETIC_LABELS.get,
             help="How the target multiplies its 4-bit (GGUF) weights. int8, as llama.cpp: each product's "
                  "activations are rounded to 8 bits per block of 32 and multiplied in int8, several times the "
                  "multiply-adds per instruction, so a pass over a few tokens costs little more than one; it changes "
                  "the model's numbers slightly. fp32: every weight rebuilt exactly to fp32, the fp32 model's own "
                  "numbers (the reference). Speculation is lossless on both.")
    if note := st.session_state.pop("lv_draft_note", None):
        st.info(note)

target = None
try:
    target = get_model(st.session_state["lv_target"].strip() or EMBEDDED, arithmetic=st.session_state["lv_arith"])
except SpeedupLabError as e:
    st.error(str(e))

n_layers = len(getattr(getattr(target.model, "model", None), "layers", [])) if target is not None else 0
# the target's room: every session's rounds run in one worker thread, batched into shared target passes
room = room_for(target) if target is not None else None
if target is not None and target.compute is not None:
    with st.sidebar:  # which kernels every pass below runs (engine/decoding/compute/)
        st.caption(f"How this CPU runs each pass (the compute path): {target.compute.label()}. "
                   f"CPU: {target.compute.cpu}, {target.compute.threads} threads.",
                   help="At load the engine timed, on this CPU, the ways it can multiply the model's weights by a "
                        "few tokens and uses the fastest for every pass (engine/decoding/compute/). "
                        + target.compute.reason)
        if target.compute.formats.get("count"):  # the arithmetic applies to GGUF block weights (the embedded model's)
            st.caption(arithmetic_note(target.compute.arithmetic))

with _prompt_box:
    st.selectbox("Prompt preset", list(PROMPT_PRESETS) + [CUSTOM], key="lv_preset", on_change=_on_preset,
                 format_func=lambda k: PROMPT_PRESETS[k].label if k in PROMPT_PRESETS else "Custom (edited)")
    st.text_area("Prompt (one user turn; the chat template is applied)", key="lv_prompt", height=160,
                 max_chars=PROMPT_MAX_CHARS, on_change=_on_prompt_edit)
with st.sidebar:
    st.session_state.setdefault("lv_prev_draft", st.session_state["lv_draft"])
    st.selectbox("Draft", list(DRAFT_KINDS), key="lv_draft", format_func=DRAFT_KINDS.get, on_change=_on_draft_change)
    if st.session_state["lv_draft"] == "early-exit":
        if n_layers >= 2:
            st.session_state["lv_k"] = min(max(st.session_state["lv_k"], 1), n_layers - 1)
        if n_layers >= 3:
            st.slider("Early exit after k layers", 1, n_layers - 1, key="lv_k")
        elif n_layers == 2:
            st.caption("Early exit after 1 layer (the target has 2).")
    elif st.session_state["lv_draft"] == "model":
        st.text_input("Draft model (HF id or local folder)", key="lv_draft_model",
                      help="Must share the target's tokenizer.")
    _gamma_default, _gamma_why = _kind_gamma(st.session_state["lv_draft"])  # the kind picked now
    if st.session_state["lv_draft"] == "block":
        st.slider("γ (slots per block: the block is the newest token + γ masks; a tree's depth)", 1, GAMMA_MAX,
                  key="lv_gamma", on_change=_on_gamma,
                  help=f"Default {_gamma_default}: {_gamma_why}. The drafter was trained for blocks up to its "
                       "maximum (see its card); a longer block is refused with a message.")
    else:
        st.slider("γ (draft tokens per round; a tree's depth)", 1, GAMMA_MAX, key="lv_gamma", on_change=_on_gamma,
                  help=f"Default {_gamma_default}: {_gamma_why}. Changing the draft picks its own default unless "
                       "you set γ here.")
    st.caption(f"γ = {_gamma_default}, this draft's default on this machine: {_gamma_why}."
               if st.session_state["lv_gamma"] == _gamma_default else
               f"γ = {st.session_state['lv_gamma']} (yours); this draft's default here is {_gamma_default}.")
    st.slider("Tree size (nodes; 0 = chain)", 0, TREE_MAX_NODES, key="lv_tree",
              help="0: the draft proposes one chain of γ tokens. N ≥ 1: a token tree of at most N nodes and "
                   "depth ≤ γ, several continuations verified in one target pass with a tree attention mask "
                   "(EAGLE-2's dynamic tree for the draft head, several matches for prompt lookup, a static tree "
                   "of each slot's top candidates for Medusa heads and the block drafter).")
    if st.session_state["lv_tree"] and st.session_state["lv_draft"] not in ("medusa", "block"):
        st.slider("Branching (children per node)", 1, TREE_MAX_BRANCHING, key="lv_branch",
                  help="At most this many candidates for the next token below each node: the draft head's "
                       "top-k, or prompt lookup's distinct continuations.")
    if st.session_state["lv_draft"] == "head" and not st.session_state["lv_tree"]:
        st.radio("Draft length", list(LENGTH_LABELS), key="lv_length", format_func=LENGTH_LABELS.get,
                 on_change=_on_length,
                 help="Adaptive: before each draft token the rule weighs what it is expected to add (the head's "
                      "confidence, calibrated by its running acceptance) against what it costs here (this machine's "
                      "measured pass-cost curve and draft step), and drafts it only if the round's expected speedup "
                      "grows; 0 tokens is a plain target step. Lossless: the length never changes the output law. "
                      "Fixed: γ tokens every round, as the formulas assume (What-if explains the rule).")
    elif st.session_state["lv_draft"] == "auto":
        st.caption("Prompt lookup or the draft head, chosen each round by expected speedup; each round's length is "
                   "adaptive (0 to γ).")
    if st.session_state["lv_draft"] in ("head", "block"):
        st.slider("Confidence gate (0 = off)", 0.0, CONF_MAX, step=0.05, key="lv_conf",
                  help="The head stops a round's draft at the first token whose top probability under "
                       "the head is below this, so a round can propose fewer than γ tokens (or none: a "
                       "plain decoding step). Guesses the target would likely reject then cost neither a "
                       "draft step nor a longer target pass (EAGLE-2). The output law is unchanged. Off by "
                       "default, so that γ and α̂ mean what they mean in the formulas.")
    st.slider("Temperature (0 = greedy)", 0.0, 2.0, step=0.05, key="lv_temp")
    st.number_input("top-k (0 = off)", 0, 1000, key="lv_topk")
    st.slider("top-p", 0.01, 1.0, step=0.01, key="lv_topp")
    if st.session_state["lv_temp"] > 0:
        st.radio("Sampling rule", list(RULE_LABELS), key="lv_rule", format_func=RULE_LABELS.get,
                 help="Standard (the rule this page teaches): keep a draft token with probability min(1, p/q), "
                      "replace a rejection by a draw from the residual. Drafter-invariant (Daliri, Musco & Suresh "
                      "2024): every token is argmax(log p + g), Gumbel noise g fixed by the seed, the position and "
                      "the token; the draft proposes argmax(log q + g) with the same noise and a draft token is kept "
                      "when it is the target's pick. Plain decoding gives the same text for the seed, whatever drafts; "
                      "both rules follow p exactly.")
    if st.session_state["lv_tree"] and st.session_state["lv_temp"] > 0 and st.session_state["lv_rule"] != "gumbel":
        st.radio("Tree acceptance rule", list(ACCEPT_RULES), key="lv_accept", format_func=ACCEPT_LABELS.get,
                 help="Exact: SpecInfer's multi-step speculative sampling / recursive rejection sampling, so the "
                      "output follows the target's p exactly. Typical acceptance (Medusa, Cai et al. 2024): keeps "
                      "a node whose target probability is high enough, without a residual draw; it accepts more "
                      "and is LOSSY: the output no longer follows p. Greedy runs are always judged exactly.")
    st.number_input("Seed", 0, 999_999, key="lv_seed")
    st.slider("Max new tokens", 1, MAX_NEW_UI, key="lv_max_new")
    st.radio("Autoplay speed", list(SPEEDS), key="lv_speed", horizontal=True,
             help="How the rounds of a whole run are shown. instant: no animation; presenter: slow animation and a "
                  "pause after each round.")

_round_raw = st.query_params.get("lv_round")  # a link's round to open (below, once the run's settings are read)
_round_asked = round_link_value(_round_raw, MAX_NEW_UI)
if _round_asked is None:
    note_replaced("lv_round", str(_round_raw), 0, "not a round number")
elif _round_asked == MAX_NEW_UI and str(_round_raw).strip() != str(MAX_NEW_UI):
    note_replaced("lv_round", str(_round_raw), MAX_NEW_UI, "the most rounds a run can have")
sync_url(URL_KEYS)
# a custom prompt goes in the link too (a preset's is named by lv_preset), unless too long for a URL
_custom = st.session_state["lv_preset"] == CUSTOM
if not stage_text("lv_prompt", st.session_state["lv_prompt"] if _custom else None, PROMPT_URL_MAX):
    st.sidebar.warning(f"This prompt is over {PROMPT_URL_MAX} characters, too long for the page's link: "
                       "a shared link opens without it.")

S = st.session_state


class LiveConfig(NamedTuple):
    """Everything a run on this page is built from: a change of any field starts the run again."""
    target: str
    prompt: str
    draft: str             # "draft" (embedded), "model" (any), "ngram", "early-exit", "head"
    early_exit_k: int
    draft_model: str
    gamma: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    confidence_gate: float
    tree: int              # token tree of at most this many nodes; 0 = a chain
    branching: int         # children per tree node (only with tree > 0)
    accept: str            # a tree's rule under sampling: "exact" or "typical" (lossy); "exact" otherwise
    rule: str              # the sampling rule of a sampled run: "standard" or "gumbel"; "standard" when greedy
    length: str            # the head's draft length: "adaptive" or "fixed" (other drafts: their own)
    arithmetic: str = "int8"  # how the target multiplies its GGUF blocks (engine.decoding.compute.arithmetic)


CONFIG_LABELS = {"early_exit_k": "early-exit k", "draft_model": "draft model", "gamma": "γ", "top_k": "top-k",
                 "top_p": "top-p", "max_new_tokens": "max new tokens", "confidence_gate": "confidence gate",
                 "tree": "tree size", "accept": "acceptance rule", "rule": "sampling rule", "length": "draft length",
                 "arithmetic": "arithmetic"}
config = LiveConfig(S["lv_target"].strip() or EMBEDDED, S["lv_prompt"], S["lv_draft"], S["lv_k"],
                    S["lv_draft_model"].strip(), S["lv_gamma"], float(S["lv_temp"]), int(S["lv_topk"]),
                    float(S["lv_topp"]), int(S["lv_seed"]), int(S["lv_max_new"]), float(S["lv_conf"]),
                    int(S["lv_tree"]), int(S["lv_branch"]) if S["lv_tree"] else TREE_BRANCH_DEFAULT,
                    S["lv_accept"] if S["lv_tree"] and S["lv_temp"] > 0 and S["lv_rule"] != "gumbel" else "exact",
                    S["lv_rule"] if S["lv_temp"] > 0 else "standard",
                    S["lv_length"] if S["lv_draft"] == "head" and not S["lv_tree"] else "fixed", S["lv_arith"])


def _decoder(cfg: LiveConfig, baseline: bool = False, max_new: int | None = None) -> SpeculativeDecoder:
    """Build a decoder for ``cfg`` (``app.decoders.make_decoder``, as the Race page builds its lanes; raises
    SpeedupLabError subclasses with user-facing messages)."""
    return make_decoder(target, cfg.prompt, cfg.draft, baseline=baseline, gamma=cfg.gamma,
                        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed,
                        max_new_tokens=max_new or cfg.max_new_tokens, tree=cfg.tree, branching=cfg.branching,
                        accept=cfg.accept, early_exit_k=cfg.early_exit_k, draft_model=cfg.draft_model,
                        confidence_gate=cfg.confidence_gate, load=get_model, rule=cfg.rule,
                        length=cfg.length if cfg.draft == "head" else None)


def _n_rounds(n: int) -> str:
    return f"{n} round" + ("" if n == 1 else "s")


def _rebuild() -> None:
    S["lv_dec"], S["lv_base"], S["lv_error"] = None, None, None
    S["lv_cfg"] = config
    try:
        S["lv_dec"] = _decoder(config)
        # the room's first request waits for its warm-up (once per server: engine.decoding.scheduler.Room._warm_up)
        with st.spinner("Prefilling the prompt…" if room.warm_done else
                        "Warming up this server's room (once per server start), then prefilling the prompt…"):
            room.prefill(S["lv_dec"])
    except SpeedupLabError as e:
        S["lv_error"] = str(e)


def _request_rebuild() -> None:
    """Reset button callback (runs before the script): the next run rebuilds the decoder."""
    S["lv_cfg"] = None


# ------------------------------------------------------------------------------------------ a link to a round
# lv_round=N (the Race page's links to a round): the run starts again from the prompt and is stepped N rounds through
# the room, drawn once at the end, as N presses of Step one round would leave it. A link is followed when its value is
# new to this session or the run opens an address (another page, Back/Forward, a first visit); the page takes lv_round
# out of its link once the view is no longer that round (a step, Reset, a setting, Stop).
if target is not None and _round_asked and (_round_raw != S.get("lv_round_link") or url_leads()):
    S["lv_round_link"] = _round_raw
    S["lv_open_pending"] = _round_asked
    S.pop("lv_opened", None)
    S["lv_cfg"] = None  # rebuilt below: a fresh run of these settings, whatever the session's run held

if target is not None and S.get("lv_cfg") != config:
    old_cfg, old_dec = S.get("lv_cfg"), S.get("lv_dec")
    if old_cfg is not None and old_dec is not None and old_dec.rounds:  # not Reset: a setting moved mid-run
        changed = ", ".join(CONFIG_LABELS.get(f, f) for f, a, b in zip(LiveConfig._fields, old_cfg, config) if a != b)
        changed = changed[:1].upper() + changed[1:] if changed[:1].isascii() else changed  # "γ" stays γ
        st.toast(f"{changed} changed: the run starts again from the prompt (its "
                 f"{_n_rounds(len(old_dec.rounds))} so far are discarded).", icon="🔄")
    _rebuild()
if target is None:
    stop_page()

# ------------------------------------------------------------------------------------------ buttons
# Stop and Reset sit outside the run area below: a click on them reruns the whole page, which interrupts a run in
# flight (Streamlit lets a click outside a fragment interrupt a fragment's run, never a click inside it).
with st.container(horizontal=True):  # a row of buttons, packed to the left
    st.button("Stop", key="lv_stop", help="Stops a running Run to the end after the current round. Keyboard: Esc",
              shortcut="Esc")
    st.button("Reset", key="lv_reset", on_click=_request_rebuild,
              help="Start the run again from the prompt (same settings and seed).")


@st.fragment
def _run_area() -> None:
    """The buttons that decode, the round, the text, the statistics and charts: a fragment, so Step, Run to the end
    and Run baseline rerun only this part of the page, not the sidebar's settings (measured with a room of 16 readers
    in headless Chromium on the server's 2 cores; re-rendering the sidebar's widgets on every click was about a
    quarter of the browsers' CPU time)."""
    dec: SpeculativeDecoder | None = S.get("lv_dec")
    # A click during Run to the end (Stop, or any widget) starts this run at once while the old one is still
    # inside a round (Streamlit's fast reruns): the generation counter tells the old loop to stop before its
    # next round, and waiting for the decoder's lock lets the round in flight finish before anything is
    # drawn. Without the wait the page showed one round fewer than the decoder held.
    S["lv_gen"] = S.get("lv_gen", 0) + 1
    GEN = S["lv_gen"]
    if dec is not None:
        room.cancel(dec)  # the last run's request, if any, ends after the pass in flight
        with dec.lock:
            pass
    ready = dec is not None
    buttons = st.container(horizontal=True)
    step_slot, run_slot = buttons.empty(), buttons.empty()  # redrawn disabled when a run ends among others (below)
    # no tooltips on these two: the key shows on the button, and a tooltip stayed over Stop and Reset after a click
    step = step_slot.button("Step one round", key="lv_step", type="primary", disabled=not ready or dec.finished,
                            shortcut="N")
    run_all = run_slot.button("Run to the end", key="lv_run", disabled=not ready or dec.finished, shortcut="G")
    stopped = bool(S.get("lv_stop"))  # the Stop button above the run area (a click there reruns the whole page)
    # no tooltip either: it stayed over the page's intro while the mouse rested on the button; what it times is in
    # the Measured speedup's help
    run_base = buttons.button("Run baseline", key="lv_baseline", disabled=not ready)

    if S.get("lv_error"):
        S.pop("lv_open_pending", None)  # a link's round waits for no later fix of the settings
        st.error(S["lv_error"])
        if S.get("lv_link_without_prompt") and not S["lv_prompt"].strip():
            st.info(f"This link chose a custom prompt but carries none: a prompt over {PROMPT_URL_MAX} characters "
                    "does not fit in a link. Paste the prompt into the sidebar, or pick a preset.")
        stop_page()

    # Run to the end at an unpaced speed goes into the room now, before the rest of the run area is drawn: the worker
    # decodes while this page draws. Submitted after drawing, a reader of a 16-reader room clicking at once joined the
    # passes only after its page had drawn its round, text and captions (each page's Python sharing the cores)
    early = None
    if run_all and not dec.finished and not SPEEDS[S["lv_speed"]][1] and not S.get("lv_open_pending"):
        try:
            early = room.submit(dec, None)
        except SpeedupLabError as e:
            st.error(str(e))
            stop_page()

    progress = st.empty()
    # the room: readers decoding, rows per pass, the room's tokens/s (engine.decoding.scheduler); under the text, so the
    # round's verdict, the result and the text are on the first screen (1280×800, a 720-pixel projector, a phone)
    room_box = None


    def _draw_room() -> None:
        with room_box.container(border=True):
            lines = room_lines(room.stats(), as_of=time.strftime("%H:%M:%S"),
                               invariance=check_in_background(target) or CHECKING)
            c = st.columns(len(lines["metrics"]))
            for col, (label, value, why) in zip(c, lines["metrics"]):
                col.metric(label, value, help=why)
            st.caption(lines["caption"])


    round_box = st.container(border=True)
    with round_box:
        round_title = st.empty()
        round_md = st.empty()
        tree_box = st.empty()  # a tree round's figure (chains draw nothing here)
    status = st.empty()  # under the round, so the round box stays on a projector's first screen
    why_box = st.empty()  # after Run baseline: why the speedup is what it is, here (app.why_view)
    text_box = st.container()
    with text_box:
        st.subheader("Generated text")
        with st.container(key="lv_generated"):  # a stable hook for browser tests (the room's texts)
            text_md = st.empty()
        st.markdown(legend_markdown())
    if room_box is None:
        room_box = st.empty()
    _draw_room()
    # the rule's fine print sits under the round and its text, so a round is on the first screen
    greedy = S["lv_temp"] == 0
    if greedy:
        st.caption("Greedy (temperature 0): a draft token is accepted exactly when it is the target's most "
                   "likely token (the table's \"argmax of p?\" column), and there is no uniform draw u. p and q "
                   "in the tables and charts are the softmax at temperature 1, for display only.")
    if dec.proposer is not None and S["lv_draft"] == "medusa":
        st.caption(f"Medusa heads (Cai et al. 2024): {dec.proposer.heads.n_heads} small heads read the target's last "
                   "hidden state; head k guesses the token k + 1 positions ahead (the target's own LM head gives the "
                   f"next one). Their top candidates form a static tree of {dec.proposer.tree_size} nodes, depth capped "
                   "at γ, checked in one target pass (assets/smollm2-medusa/README.md).")
    if dec.proposer is not None and S["lv_draft"] == "block":
        st.caption("Block drafter (DFlash-style, arXiv 2602.06036): each round the drafter gets the newest token and γ "
                   "MASK slots after it, reads the target's hidden states of the context, and fills every slot in ONE "
                   "pass, so a long block costs about what a short one does. The slots see each other but not each "
                   "other's picks, which is why later slots are right less often (assets/smollm2-block/README.md). "
                   "With a tree size, each slot's top candidates form a static tree.")
    if dec.proposer is not None and S["lv_draft"] == "ngram":
        st.caption("Prompt lookup adapts its length: up to γ tokens, 2 more after a fully accepted proposal and "
                   "1 fewer after a rejection, so a broken copy stops paying for long target passes.")
    if dec.proposer is not None and S["lv_draft"] == "head" and S["lv_conf"] > 0:
        st.caption(f"Confidence gate {S['lv_conf']:g}: the head stops a round's draft at the first token it gives "
                   f"a top probability below {S['lv_conf']:g}, so rounds can propose fewer than γ tokens; α̂ then "
                   "counts only the tokens it was confident enough to propose. Set the gate to 0 for a fixed γ.")
    if not greedy and dec.sampling.gumbel:
        st.caption("Drafter-invariant sampling (Daliri, Musco & Suresh 2024): the token at each position is "
                   "argmax(log p + g), with Gumbel noise g fixed by the seed, the position and the token; the draft "
                   "proposed argmax(log q + g) with the same noise, and a draft token is kept when it is the "
                   "target's pick (the table's \"target's Gumbel pick?\" column; no u is drawn). Plain decoding with "
                   "this seed gives the same text, and each token still follows p exactly.")
    if not greedy and dec.proposer is not None and getattr(dec, "accept", "exact") == "typical":
        st.warning("Typical acceptance is lossy: it keeps tree nodes the exact rule could reject, so this run's output "
                   "no longer follows the target's distribution p (the speedup is not free). Pick Exact to compare.")
    if not greedy and dec.proposer is not None and S["lv_draft"] == "ngram":
        st.caption("Prompt lookup has no model: q is a point mass (q(x) = 1), so a token is accepted with "
                   "probability p(x) and a rejection resamples from p with x removed.")


    def _draw_text(d: SpeculativeDecoder) -> None:
        md = generated_markdown(generated_pieces(d.rounds, d.token_text))
        text_md.markdown(md or ":gray[(nothing generated yet)]")


    _tree_draws = itertools.count()  # each drawn tree figure needs its own key within a run


    def _draw_tree_round(rnd, frame_s: float, budget_s: float | None = None) -> None:
        """A tree round: the tree grows depth by depth, one verify pass, then the kept path (frames
        ``frame_s`` apart, within ``budget_s`` if given; ``frame_s = 0``: the verdict at once)."""
        lay = round_tree_layout(rnd)
        frames = tree_frames(rnd.tree, lay)
        shown = range(len(frames)) if frame_s > 0 else [len(frames) - 1]
        delay = frame_s if budget_s is None else min(frame_s, budget_s / max(len(frames), 1))
        for i in shown:
            round_md.markdown(tree_round_markdown(rnd, frames[i]))
            show_chart(tree_figure(rnd, i, greedy=S["lv_temp"] == 0, layout=lay, frames=frames,
                                   theme=st.context.theme.type),
                       key=f"lv_fig_tree_{next(_tree_draws)}", where=tree_box)
            if i < len(frames) - 1:
                time.sleep(delay)


    def _draw_round(rnd, frame_s: float, budget_s: float | None = None, note: str | None = None) -> None:
        """Draw a round: its draft tokens one by one (``frame_s`` apart; the whole animation within
        ``budget_s`` if given), then the verdict. ``frame_s = 0`` draws the verdict at once. ``note``: a line under
        the round's title (why this round is the one shown)."""
        chosen = choice_line(rnd)  # an adaptive length: the round's choice and its expected gain
        if note or chosen:
            with round_title.container():
                st.markdown(f"**{round_summary(rnd)}**")
                if chosen:
                    st.caption(chosen)
                if note:
                    st.caption(note)
        else:
            round_title.markdown(f"**{round_summary(rnd)}**")
        if rnd.tree is not None:
            _draw_tree_round(rnd, frame_s, budget_s)
            return
        tree_box.empty()
        if S["lv_draft"] == "block" and rnd.drafted:  # the block, masks first, filled by one pass
            all_frames = block_frames(rnd, dec.token_text(dec.seq[rnd.context_len - 1]))
        else:
            all_frames = round_frames(rnd)
        if frame_s > 0:
            frames = all_frames
            delay = frame_s if budget_s is None else min(frame_s, budget_s / max(len(frames), 1))
            for f in frames[:-1]:
                round_md.markdown(f)
                time.sleep(delay)
            round_md.markdown(frames[-1])
        else:
            round_md.markdown(all_frames[-1])


    def _safe_step(d: SpeculativeDecoder):
        """One round through the room (None: stopped by a newer run of this page)."""
        try:
            return room.step(d, should_stop=lambda: S.get("lv_gen") != GEN)
        except SpeedupLabError as e:
            st.error(str(e))
            stop_page()


    def _room_rounds(d: SpeculativeDecoder, rounds: int | None = None, ticket=None, wake_every: float | None = None):
        """Run to the end (or ``rounds`` rounds) through the room: yields the rounds as the worker runs them (all that
        arrived since the last yield), until the run ends or a newer run of this page (Stop, any click) cancels it.
        ``ticket``: the run's request when it was submitted already (``early``); ``wake_every``: ``Ticket.rounds``'."""
        try:
            if ticket is None:
                ticket = room.submit(d, rounds)
            yield from ticket.rounds(should_stop=lambda: S.get("lv_gen") != GEN, wake_every=wake_every)
        except SpeedupLabError as e:
            st.error(str(e))
            stop_page()


    frame_s, round_pause = SPEEDS[S["lv_speed"]]
    was_finished = dec.finished
    asked = S.pop("lv_open_pending", 0)  # a link's round (lv_round): step there, drawing only the progress bar
    if asked and not dec.rounds:
        bar = progress.progress(0.0, text=f"Opening round {asked}: stepping the run from the prompt…")
        last_draw = time.perf_counter()
        for _ in _room_rounds(dec, asked, wake_every=ROOM_WAKE_S):  # a newer run (Stop, any click) ends this loop
            others = room.readers() - 1
            if time.perf_counter() - last_draw >= max(INSTANT_REDRAW_S, ROOM_REDRAW_S * others):
                bar.progress(min(len(dec.rounds) / asked, 1.0),
                             text=f"Opening round {asked}: {len(dec.rounds)} of {asked} rounds stepped, drawn when "
                                  "they are done — press Stop to stop")
                last_draw = time.perf_counter()
            if S.get("lv_gen") != GEN:
                break
        progress.empty()
        if S.get("lv_gen") == GEN:
            S["lv_opened"] = {"dec": dec, "rounds": len(dec.rounds),
                              "msg": opened_round_message(asked, len(dec.rounds), dec.finished, dec.stop_reason)}
    if step and not dec.finished:
        t0 = time.perf_counter()
        rnd = _safe_step(dec)
        if rnd is None:
            stop_page()
        _draw_room()
        if S["lv_speed"] == "presenter":
            _draw_round(rnd, frame_s)
        else:  # keep click → drawn round fast: the whole animation within ANIM_BUDGET_S
            _draw_round(rnd, max(frame_s, 0.04), budget_s=ANIM_BUDGET_S)
        S["lv_last_step_ms"] = (time.perf_counter() - t0) * 1000

    if (run_all or run_base) and not dec.finished:
        bar = progress.progress(0.0, text="Running…")
        last_draw = 0.0
        panel_cleared = False
        # presenter speed paces the run: one round at a time, each animated and paused; otherwise the run stays in
        # the room until it ends (no pass missed while the page draws) and the page draws the latest round
        rounds_in = (iter(lambda: _safe_step(dec) if not dec.finished else None, None) if round_pause
                     else (batch[-1] for batch in _room_rounds(dec, ticket=early,
                                                               wake_every=ROOM_WAKE_S if frame_s == 0 else None)))
        for rnd in rounds_in:  # a newer run (a click) ends this loop
            # "instant" redraws at most every INSTANT_REDRAW_S: each redraw costs the server and the browser CPU
            # time while the next round computes, which slowed the measured run (Chromium shares the cores); in a
            # room of readers every page redraws less often (ROOM_REDRAW_S per other reader)
            others = room.readers() - 1
            every = max(INSTANT_REDRAW_S if frame_s == 0 else 0.0, ROOM_REDRAW_S * others)
            if time.perf_counter() - last_draw >= every:
                shared = ""
                if not others or round_pause:  # alone or paced: the round, the text and the room panel as they come
                    _draw_round(rnd, frame_s)
                    _draw_text(dec)
                    _draw_room()
                else:  # among others: the progress bar alone, with the room's numbers in its text (one element)
                    if not panel_cleared:  # the panel as drawn before the run would show stale numbers
                        room_box.empty()
                        panel_cleared = True
                    shared = (f"; {room_progress_line(room.stats())}: the round, the text and the room panel are "
                              "drawn when the run ends")
                done = len(dec.new_ids) / dec.max_new_tokens
                bar.progress(min(done, 1.0), text=f"{len(dec.new_ids)} / {dec.max_new_tokens} tokens, "
                                                  f"{_n_rounds(len(dec.rounds))}{shared} — press Stop to stop")
                last_draw = time.perf_counter()
            if round_pause:
                time.sleep(round_pause)
            if S.get("lv_gen") != GEN:
                break
        progress.empty()

    if run_base and dec.finished:
        bar = progress.progress(0.0, text="Timing…")
        n_new = max(len(dec.new_ids), 1)

        def _ab_progress(done: int, total: int, kind: str) -> None:
            what = "speculative decoding" if kind == "spec" else "the baseline (plain decoding)"
            bar.progress(done / total, text=f"Timing run {done + 1} of {total}: {what}. Nothing is drawn until "
                                            "the runs end, so the page does not slow what it measures.")

        try:
            # both kinds run through the room too: with other readers in it, the timings are the room's
            S["lv_base"] = measure_speedup_ab(lambda: room.bind(_decoder(S["lv_cfg"])),
                                              lambda: room.bind(_decoder(S["lv_cfg"], baseline=True, max_new=n_new)),
                                              reps=AB_REPS, on_progress=_ab_progress)
        except SpeedupLabError as e:
            st.error(str(e))
        progress.empty()

    opened = S.get("lv_opened")
    if opened is not None and (opened["dec"] is not dec or opened["rounds"] != len(dec.rounds)):
        opened = S["lv_opened"] = None  # the reader moved on: the view is no longer the link's round
    if opened is None and "lv_round" in st.query_params:
        stage_url("lv_round", None)  # the link no longer describes the view (Stop, a step, Reset, a setting)
        S["lv_round_link"] = None
    if opened is not None:
        progress.info(opened["msg"])
    _draw_room()
    if dec.finished and not was_finished:
        # the run just ended: only the two buttons change (now disabled), drawn in place. Not a rerun of the whole run
        # area: that drew the page a second time, ~50 ms of the server's Python alone and 0.2 s for the last readers
        # of a 16-reader room finishing together (measured on the AMD EPYC: their pages' reruns shared the cores)
        step_slot.button("Step one round", key="lv_step_done", type="primary", disabled=True)
        run_slot.button("Run to the end", key="lv_run_done", disabled=True)

    # ------------------------------------------------------------------------------------------ current state
    if dec.rounds:
        if not step:  # a stepped round was just animated into the box
            _shown, _why = round_to_show(dec.rounds, dec.finished and opened is None)
            _draw_round(_shown, 0, note=_why)
    else:
        round_title.markdown("**No round yet.**")
        _g_def, _g_why = _kind_gamma(S["lv_draft"])
        _first = round_md.container()
        _first.markdown(f"Press **Step one round** to draft γ = {S['lv_gamma']} tokens and verify them with one "
                        "target pass.")
        _first.caption(f"γ = {_g_def} is this draft's default on this machine: {_g_why}." if S["lv_gamma"] == _g_def
                   else f"γ = {S['lv_gamma']} is your setting (this draft's default here: {_g_def}).")
    _draw_text(dec)

    stats = dec.stats()
    ab = S.get("lv_base")  # SpeedupAB after Run baseline
    cmp = ab.comparison(dec.new_ids) if ab is not None else None
    if dec.finished:
        line = finished_line(len(dec.new_ids), _n_rounds(len(dec.rounds)), dec.stop_reason, stats, cmp,
                             plain=dec.proposer is None, spread=ab.spread if ab is not None else None,
                             noisy=ab is not None and ab.noisy)
        (status.warning if finished_unsure(line) else status.success)(line)
    elif dec.rounds and stopped:
        status.warning(f"Stopped after {_n_rounds(len(dec.rounds))}: {len(dec.new_ids)} of at most "
                       f"{dec.max_new_tokens} tokens. **Step one round** or **Run to the end** goes on from here.")
    elif dec.rounds:
        status.info(f"{len(dec.new_ids)} of at most {dec.max_new_tokens} tokens after {_n_rounds(len(dec.rounds))}.")

    # timings (c, verify costs) from the A/B's undrawn speculative run once there is one; counts from this run
    timing = ab.spec_stats if ab is not None else stats
    rec = measured_run(timing, dec.gamma, cmp.speedup if cmp else None, ab.base_stats if ab is not None else None,
                       rounds=ab.spec_rounds if ab is not None else dec.rounds,
                       spread=ab.spread if ab is not None else None) if dec.proposer is not None else None
    if rec is not None:
        S["measured_run"] = rec
        if dec.finished and cmp is not None:
            with why_box.container():
                why_card(why_from_run(rec, where="this server"), key="lv")

    # ------------------------------------------------------------------------------------------ statistics
    st.subheader("Live statistics")
    if not dec.rounds:
        st.caption("Statistics appear after the first round.")
    else:
        alpha = stats.acceptance_rate
        e_alpha = expected_tokens_per_pass(alpha, dec.gamma) if alpha is not None else None
        m = st.columns(4)
        # short labels: a 4-column row at 1280 px (a projector) cut the longer ones mid-word
        m[0].metric("Measured α̂", "—" if alpha is None else f"{alpha:.3f}",
                    help=f"Accepted ÷ judged: {stats.accepted} accepted of {stats.judged} judged draft tokens "
                         f"({stats.drafted} drafted; accepted ÷ drafted = "
                         f"{'—' if stats.accepted_fraction is None else f'{stats.accepted_fraction:.3f}'}).")
        e_rounds = expected_tokens_per_round(alpha, [r.n_drafted for r in dec.rounds]) if alpha is not None else None
        m[1].metric("Tokens per round", f"{stats.tokens_per_round:.2f}",
                    delta=None if e_rounds is None else f"formula at α̂: {e_rounds:.2f}",
                    delta_color="off", delta_arrow="off",
                    help=f"New tokens ÷ rounds ({stats.new_tokens} ÷ {stats.rounds}): each round is one draft and "
                         "one target verify pass, and yields its accepted draft tokens plus one of the target's "
                         "own (plain decoding: exactly 1.00). Counting the prompt's own prefill pass too, "
                         f"{stats.new_tokens} tokens took {stats.target_passes} target passes "
                         f"({stats.tokens_per_target_pass:.2f} a pass). "
                         "Formula: E = (1 − α^(γ+1)) / (1 − α) (Leviathan et al. 2023, Eq. 1), taken at each "
                         "round's own "
                         "draft length and averaged: rounds that drafted fewer than γ tokens (prompt lookup "
                         "without a match, the draft head's confidence gate, the end of the run) yield fewer. "
                         + ("" if e_alpha is None else f"With γ = {dec.gamma} drafted every round it would be "
                                                       f"{e_alpha:.2f}."))
        # one drafting round so far: its draft time includes the draft's pass over the prompt (trace.run_stats
        # leaves that round out only once a later one drafted), so c reads high: say so under the number
        first_only = ab is None and sum(1 for r in dec.rounds if r.n_drafted) == 1
        # two figures that mean different things: c while stepping (the page draws on the same CPU while the draft's
        # many small steps run: measured 1.6 after three Steps of the head, 0.11 in the timed run) and the timed c
        timed_c = S.setdefault("lv_timed_c", {})
        if ab is not None and ab.spec_stats.draft_cost_ratio is not None:
            timed_c[S["lv_draft"]] = ab.spec_stats.draft_cost_ratio
        if ab is not None:
            c_label, c_beside = "c, timed run", (None if stats.draft_cost_ratio is None
                                                  else f"while stepping: {stats.draft_cost_ratio:.3f}")
        else:
            c_label = "c while stepping"
            c_beside = ("includes the draft's prompt pass" if first_only else
                        f"timed: {timed_c[S['lv_draft']]:.3f}" if S["lv_draft"] in timed_c else
                        "timed: press Run baseline")
        m[2].metric(c_label,
                    "—" if timing.draft_cost_ratio is None else f"{timing.draft_cost_ratio:.3f}",
                    delta=c_beside if timing.draft_cost_ratio is not None else None,
                    delta_color="off", delta_arrow="off",
                    help="Draft step ÷ target pass: draft time per draft token ÷ median target verify pass. The "
                         "first round that drafts is left out once a later round has drafted: it also runs the draft "
                         "over the prompt, so after one round c reads high. Before Run baseline: from this run, "
                         "drawn round by round; many small draft operations slow down more than one big target "
                         "pass while the browser redraws on the same CPU, so c can read high. After Run "
                         "baseline: from the timed speculative run at the median, with nothing drawn. The What-if "
                         "page's c is per one-token target step, which is shorter than a verify pass of γ + 1 tokens, "
                         "so that c is larger: its 'My measured numbers' tab converts this run's timings.")
        def _rate(x: float | None) -> str:
            # 3 significant digits: "1.0 vs 0.7 tokens/s" beside a 1.55× speedup looked inconsistent
            return "—" if x is None else f"{x:.2f}" if x < 10 else f"{x:.1f}"

        spec_tps = cmp.spec_tokens_per_s if cmp is not None else stats.tokens_per_s
        m[3].metric("Speculative tokens/s", _rate(spec_tps),
                    delta="timed run" if cmp is not None else "while stepping", delta_color="off", delta_arrow="off",
                    help="After Run baseline: the median of the timed speculative runs. Before: this run, "
                         "drawn round by round.")
        m2 = st.columns(4)
        m2[0].metric("Baseline tokens/s",
                     _rate(None if cmp is None else cmp.base_tokens_per_s),
                     help="Press Run baseline: plain decoding of the same prompt, settings and seed; the median "
                          f"of {AB_REPS} timed runs.")
        m2[1].metric("Measured speedup", "—" if cmp is None or cmp.speedup is None else f"{cmp.speedup:.2f}×",
                     help="Median baseline time per token ÷ median speculative time per token, prefill "
                          f"included, over {AB_REPS} runs of each, alternating (A B B A A B) with nothing drawn "
                          "meanwhile. Measured in the app's process: it can still read a little lower than "
                          "`python -m engine generate --baseline` when the browser shares a small machine's cores. "
                          + ("" if ab is None else "Each run, ms per token: speculative "
                             + ", ".join(f"{x:.1f}" for x in ab.spec_ms_per_token) + "; baseline "
                             + ", ".join(f"{x:.1f}" for x in ab.base_ms_per_token) + "."))
        if cmp is not None:
            if greedy:
                m2[2].metric("Greedy outputs identical?", "yes" if cmp.identical else "no",
                             delta=None if cmp.identical else f"first difference at token {cmp.first_difference}",
                             delta_color="off", delta_arrow="off",
                             help="Under greedy decoding the verification rule reproduces plain decoding token for "
                                  "token. A difference can only come from arithmetic: a target pass over several "
                                  "tokens rounding differently from one-token steps, which happens in bf16/fp16 "
                                  "and, at an exact tie, in fp32 (the models run in fp32 here).")
            else:
                m2[2].metric("Outputs identical?", "yes" if cmp.identical else "no",
                             help="Under the drafter-invariant rule both runs take the target's Gumbel-max pick "
                                  "under the seed's noise: the outputs are the same. Under the standard rule the "
                                  "two runs draw different random numbers: the outputs differ, but both follow the "
                                  "target's distribution p." if dec.sampling.gumbel else
                                  "Under sampling the two runs draw different random numbers: the outputs "
                                  "differ, but both follow the target's distribution p.")
        m2[3].metric("Prefill / total (s)", f"{timing.prefill_ms / 1000:.2f} / {timing.total_ms / 1000:.2f}",
                     help="Prompt prefill and whole-run time of the speculative run, in seconds: this run, or "
                          "after Run baseline the timed run at the median (its tokens/s is the one shown).")
        if ab is not None and ab.noisy:
            st.warning(f"The timed runs of one kind differed by up to {ab.spread:.1f}× (ms per token, in the "
                       "speedup's help): the machine was busy, so the speedup is unsure. Run the baseline again "
                       "with nothing else running.")

    # with other readers decoding on this server, the charts and the round inspector wait for a click: building them
    # costs the server's Python (the worker's pass waits on it) and drawing them costs the browser more than a whole
    # run's decoding (bench_room.py: 16 pages drawing them at the end of their runs took most of a 2-core server)
    others_busy = room.readers() if dec.rounds else 0  # other readers' runs in flight (this page's run has ended)
    if others_busy:
        st.caption(f"{others_busy} other reader{'s are' if others_busy > 1 else ' is'} decoding on this server: the "
                   "charts and the round inspector wait until the room is quiet (any click then draws them), so the "
                   "server's cores decode for everyone. Or draw them now:")
    draw_charts = bool(dec.rounds) and (not others_busy or st.toggle(
        "Draw the charts now", key="lv_charts_busy",
        help="Building the charts costs the server's Python while the room's worker decodes, and drawing them "
             "costs the browser (16 pages drawing them at once took most of a 2-core server that also ran the "
             "browsers: benchmarks/bench_room.py)."))
    if draw_charts:
        if any(r.tree is not None for r in dec.rounds):
            st.caption("Token tree run: α̂, tokens per pass and the per-position chart read each round's accepted "
                       "path and its first rejected node; the chain formula E does not model a tree (a tree can keep a "
                       "branch a chain would not have drafted). The What-if page's Token trees tab models trees.")
        c1, c2 = st.columns(2)
        if stats.acceptance_by_position:
            pos = list(range(1, len(stats.acceptance_by_position) + 1))
            fa = go.Figure(go.Bar(x=pos, y=stats.acceptance_by_position, name="measured"))
            if alpha is not None:
                fa.add_hline(y=alpha, line_dash="dot", line_color=REFERENCE_LINE, annotation_text=f"α̂ = {alpha:.2f}")
            fa.update_layout(title="Acceptance per draft position (given all before accepted)",
                             xaxis_title="draft position", yaxis_title="accepted ÷ evaluated",
                             yaxis_range=[0, 1.05], height=300, margin={"t": 40, "b": 10})
            fa.update_xaxes(tickmode="linear", dtick=1)
            show_chart(fa, key="lv_fig_pos", where=c1)
        else:
            c1.caption("No draft token judged yet.")
        timed_rounds = ab.spec_rounds if ab is not None else dec.rounds
        rounds_x = [r.index + 1 for r in timed_rounds]
        ft = go.Figure()
        ft.add_bar(x=rounds_x, y=[r.draft_ms for r in timed_rounds], name="draft ms")
        ft.add_bar(x=rounds_x, y=[r.verify_ms for r in timed_rounds], name="verify ms (target pass)")
        ft.update_layout(title="Time per round" + (" (median timed run, nothing drawn)" if ab is not None else
                                                   " (stepping: the page draws on the same CPU)"), barmode="stack",
                         xaxis_title="round", yaxis_title="ms", height=300, margin={"t": 40, "b": 10})
        show_chart(ft, key="lv_fig_time", where=c2)

    # ------------------------------------------------------------------------------------------ round inspector
    if draw_charts:
        st.subheader("Open a round")
        n = len(dec.rounds)
        if n > 1:
            r_i = st.slider("Round", 1, n, n, key=f"lv_open_{n}") - 1
        else:
            r_i = 0
        rnd = dec.rounds[r_i]
        with st.expander(f"Round {r_i + 1} in detail", expanded=True):
            st.markdown(verdict_frame(rnd))
            st.caption(round_summary(rnd))
            if rnd.tree is not None:
                tc = tree_counts(rnd.tree)
                rule = {"greedy": "greedy (argmax match)", "exact": "lossless tree sampling",
                        "gumbel": "the drafter-invariant rule (the target's Gumbel-max pick)",
                        "typical (lossy)": "typical acceptance (lossy)"}.get(getattr(rnd.tree, "rule", ""), "")
                st.markdown(f"**Token tree:** {tc['nodes']} nodes, depth {tc['depth']}: {tc['accepted']} accepted "
                            f"(the path), {tc['rejected']} rejected, {tc['unvisited']} never judged"
                            + (f"; judged by {rule}" if rule else "") + ". All of them went "
                            "through the one target pass; only the path's KV entries stay in the cache.")
                t1, t2 = st.columns([3, 2])
                show_chart(tree_figure(rnd, greedy=dec.sampling.greedy, theme=st.context.theme.type),
                           key=f"lv_fig_tree_open_{r_i}", where=t1)
                show_chart(mask_figure(rnd.tree), key=f"lv_fig_mask_{r_i}", where=t2)
                st.caption("The mask: row = a node's query, column = a key it may attend to. Each node sees the "
                           "cached context, its ancestors and itself, so every branch is scored as if it were the "
                           "only continuation; position ids are context length + depth (engine.decoding.attention)."
                           " The p/q charts below follow the accepted path and its first rejected node.")
                show_table(tree_rows(rnd.tree, greedy=dec.sampling.greedy), formats={"q(x)": "%.4f", "p(x)": "%.4f"})
            elif rnd.drafted:
                show_table(round_rows(rnd, greedy=dec.sampling.greedy, gumbel=dec.sampling.gumbel),
                           formats={"q(x)": "%.4f", "p(x)": "%.4f"})
            if choice_rows(rnd):
                st.caption(choice_line(rnd) + " Each row: the token's drafter, its confidence and the acceptance "
                           "chance the rule estimated from it; the last row, if not drafted, is where more stopped "
                           "paying.")
                show_table(choice_rows(rnd), formats={"confidence (max q)": "%.3f", "â (rule's estimate)": "%.3f"})
            if rnd.drafted:
                labels = [f"{i + 1}: {visible(d.text)}" for i, d in enumerate(rnd.drafted)]
                j = st.selectbox("Draft position for the charts", range(len(labels)), index=focus_position(rnd),
                                 format_func=lambda i: labels[i], key=f"lv_pos_{r_i}")
                d = rnd.drafted[j]
                top_p = [t for t in d.top_p if t.prob > 0]  # top-k/top-p and point masses leave zeros
                top_q = [t for t in d.top_q if t.prob > 0]
                fig = make_subplots(rows=1, cols=2, subplot_titles=(
                    f"target p (top 5); p(x) = {d.p:.4f}", f"draft q (top 5); q(x) = {d.q:.4f}"))
                fig.add_bar(x=chart_labels(top_p), y=[t.prob for t in top_p], row=1, col=1, name="p")
                fig.add_bar(x=chart_labels(top_q), y=[t.prob for t in top_q], row=1, col=2, name="q")
                fig.update_layout(height=320, showlegend=False, margin={"t": 70, "b": 10},
                                  title=f"Position {j + 1}: verdict {d.verdict}")
                fig.update_yaxes(range=[0, 1.05])
                fig.update_xaxes(type="category")  # a token such as "2" is a label, not a number
                show_chart(fig, key="lv_fig_pq")
            if rnd.residual_top:
                res = [t for t in rnd.residual_top if t.prob > 0]
                fr = go.Figure(go.Bar(x=chart_labels(res), y=[t.prob for t in res]))
                fr.update_layout(title="Residual norm(max(0, p − q)) the correction was drawn from (top 5)",
                                 height=280, margin={"t": 40, "b": 10}, yaxis_range=[0, 1.05], xaxis_type="category")
                show_chart(fr, key="lv_fig_res")
            elif rnd.next_kind == "correction" and greedy:
                st.caption("Greedy: the correction is the target's argmax at the rejected position "
                           "(no residual distribution).")
            else:
                nxt = [t for t in rnd.next_top_p if t.prob > 0]
                fn = go.Figure(go.Bar(x=chart_labels(nxt), y=[t.prob for t in nxt]))
                fn.update_layout(title=f"Target p where its own ({rnd.next_kind}) token was drawn (top 5)",
                                 height=280, margin={"t": 40, "b": 10}, yaxis_range=[0, 1.05], xaxis_type="category")
                show_chart(fn, key="lv_fig_next")
        with st.expander("All rounds"):
            st.dataframe(history_rows(dec.rounds), hide_index=True, width="stretch",
                         column_config={"draft ms": st.column_config.NumberColumn(format="%.1f"),
                                        "verify ms": st.column_config.NumberColumn(format="%.1f")})

    check_yourself("live", safe_questions(live_questions, int(S["lv_gamma"]),
                                          dec.stats().acceptance_rate if dec.rounds else None,
                                          [r.n_drafted for r in dec.rounds]))


_run_area()
