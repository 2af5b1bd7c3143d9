"""The race: plain and speculative decoding of one prompt on the embedded model, measured one after the other on this
server and replayed side by side at their measured pace.

The engine races (``engine.decoding.race.run_race``: a warm-up, then A B B A A B with nothing drawn in between) and
records every token's and pass's time; ``app.race_view`` turns the record into a player that animates in the
browser (no rerun per token). Decoders are built as the Live page builds them (``app.decoders``).
"""

import itertools
import os
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

from app.charts import show_chart
from app.decoders import DRAFT_KINDS, DRAFT_SHORT, draft_spec, make_decoder, target_layers
from app.join import join_card
from app.live_view import PROMPT_URL_MAX, default_draft_kind, default_preset, escape_markdown
from app.navigation import page_link
from app.race_view import (SPEEDS, decoder_kwargs, honesty_line, live_link, player_html, race_settings, room_line,
                           round_hover, why_identical)
from app.resources import get_model
from app.state import stage_text, stop_page, sync_url, url_param
from app.tour import intro, presenting
from app.why_view import why_card
from engine.decoding.compute import arithmetic as process_arithmetic
from engine.decoding.measure import SpeedupAB
from engine.decoding.models import EMBEDDED, default_draft_spec
from engine.decoding.race import RaceStopped, load_race, run_race, survival
from engine.decoding.scheduler import room_for
from engine.errors import InputError, SpeedupLabError
from engine.explain.analytic import TREE_MAX_NODES, default_gamma_here
from engine.explain.why import why_from_race
from engine.explain.presets import CUSTOM, PROMPT_PRESETS, preset_text

RECORDED = Path(__file__).resolve().parent.parent / "assets" / "race_recorded.json"
GAMMA_MAX = 16
MAX_NEW_UI = 256
PROMPT_MAX_CHARS = 8000
URL_KEYS = ["rc_target", "rc_preset", "rc_draft", "rc_k", "rc_draft_model", "rc_gamma", "rc_tree", "rc_temp", "rc_seed",
            "rc_max_new", "rc_speed", "rc_rule", "rc_arith"]
# the Race's arithmetic choice: (the plain lane's, the speculative lane's, its label)
LANE_ARITHMETIC = {"int8": ("int8", "int8", "int8, both lanes (as llama.cpp)"),
                   "fp32": ("fp32", "fp32", "fp32, both lanes (the exact reference)"),
                   "each": ("fp32", "int8", "One each: plain on fp32, speculative on int8")}
RULE_LABELS = {"standard": "Standard (min(1, p/q), residual draws)",
               "gumbel": "Drafter-invariant (Gumbel-max, same text)"}
S = st.session_state
present = presenting()

st.title("🏁 The race: plain vs speculative")
# A fixed style rule: hide Streamlit's running indicator on this page, as the Live page does: it redraws several times
# a second while a script runs, and the browser drawing it shares the server's cores with the lanes being timed (the
# page's own progress bar says the race is running, and its Stop button ends it).
st.html("<style>[data-testid='stStatusWidget'] { display: none; }</style>")
intro("The same prompt decoded twice on the embedded model: **plain decoding** (one target pass per token) and "
      "**speculative decoding** (a draft guesses γ tokens, the target checks them in one pass and keeps the agreed "
      "prefix plus one token of its own). Press **Race**: both run on this server, then play back side by side at "
      "the pace they were measured, with every target pass drawn to scale. Under greedy decoding the two texts are "
      "identical token for token: speculation changes how fast, not what.")

# ------------------------------------------------------------------------------------------ settings (the URL)
url_param("rc_target", EMBEDDED, str)
TARGET = S["rc_target"].strip() or EMBEDDED
_default_kind = default_draft_kind(default_draft_spec(TARGET))
url_param("rc_preset", default_preset(_default_kind), str, choices=list(PROMPT_PRESETS) + [CUSTOM])
url_param("rc_draft", _default_kind, str, choices=list(DRAFT_KINDS))
url_param("rc_k", 8, int, lo=1, hi=256)
url_param("rc_draft_model", "", str)
url_param("rc_gamma", default_gamma_here(draft_spec(S["rc_draft"]), TARGET)[0], int, lo=1, hi=GAMMA_MAX)
url_param("rc_tree", 0, int, lo=0, hi=TREE_MAX_NODES)
url_param("rc_temp", 0.0, float, lo=0.0, hi=2.0, step=0.05)
url_param("rc_seed", 0, int, lo=0, hi=999_999)
url_param("rc_rule", "standard", str, choices=list(RULE_LABELS))
url_param("rc_arith", process_arithmetic(), str, choices=list(LANE_ARITHMETIC))
url_param("rc_max_new", 64, int, lo=8, hi=MAX_NEW_UI)
url_param("rc_speed", 1.0, float, choices=list(SPEEDS))
if "rc_prompt" not in S:
    S["rc_prompt"] = (preset_text(S["rc_preset"]) if S["rc_preset"] != CUSTOM
                      else str(st.query_params.get("rc_prompt", ""))[:PROMPT_URL_MAX])


def _on_preset() -> None:
    if S["rc_preset"] != CUSTOM:
        S["rc_prompt"] = preset_text(S["rc_preset"])


def _on_prompt_edit() -> None:
    if S["rc_preset"] != CUSTOM and S["rc_prompt"] != preset_text(S["rc_preset"]):
        S["rc_preset"] = CUSTOM


def _on_draft() -> None:  # γ follows the draft's default on this machine (a block's γ is its length − 1)
    S["rc_gamma"] = min(default_gamma_here(draft_spec(S["rc_draft"], S["rc_k"]), TARGET)[0], GAMMA_MAX)


with st.sidebar:
    st.header("Race settings")
    st.text_input("Target model", key="rc_target",
                  help="`embedded` (SmolLM2-135M-Instruct), a Hugging Face id in the local cache, or a folder.")
    st.selectbox("Prompt preset", list(PROMPT_PRESETS) + [CUSTOM], key="rc_preset", on_change=_on_preset,
                 format_func=lambda k: PROMPT_PRESETS[k].label if k in PROMPT_PRESETS else "Custom (edited)")
    st.text_area("Prompt (one user turn)", key="rc_prompt", height=120, max_chars=PROMPT_MAX_CHARS,
                 on_change=_on_prompt_edit)
    st.selectbox("Draft", list(DRAFT_KINDS), key="rc_draft", format_func=DRAFT_KINDS.get, on_change=_on_draft)
    if S["rc_draft"] == "early-exit":
        st.slider("Early exit after k layers", 1, 29, key="rc_k")
    elif S["rc_draft"] == "model":
        st.text_input("Draft model (HF id or local folder)", key="rc_draft_model",
                      help="Must share the target's tokenizer.")
    _g, _why = default_gamma_here(draft_spec(S["rc_draft"], S["rc_k"]), TARGET)
    st.slider("γ (draft tokens per round; a tree's depth)", 1, GAMMA_MAX, key="rc_gamma",
              help=f"Default for this draft {_g}: {_why}.")
    st.slider("Tree size (nodes; 0 = chain)", 0, TREE_MAX_NODES, key="rc_tree",
              help="0: one chain of γ draft tokens a round (Medusa heads: their shipped tree). N ≥ 1: a token tree "
                   "of at most N nodes, verified in one target pass (the draft head, prompt lookup, Medusa, block).")
    st.slider("Temperature (0 = greedy)", 0.0, 2.0, step=0.05, key="rc_temp",
              help="Greedy: the texts are identical token for token. Sampling: under the standard rule each lane "
                   "draws its own random numbers from the seed, so the texts differ; under the drafter-invariant "
                   "rule they are identical. Both follow the target's distribution.")
    if S["rc_temp"] > 0:
        st.radio("Sampling rule", list(RULE_LABELS), key="rc_rule", format_func=RULE_LABELS.get,
                 help="Standard: a draft token is kept with probability min(1, p/q), a rejection is replaced by a "
                      "draw from the residual; each lane draws its own random numbers, so the texts part. "
                      "Drafter-invariant (Daliri, Musco & Suresh 2024): every token is argmax(log p + g) with "
                      "Gumbel noise fixed by the seed, the position and the token, and the draft proposes with the "
                      "same noise, so both lanes give the same text for a seed. Both follow the target's p exactly.")
    st.number_input("Seed", 0, 999_999, key="rc_seed")
    st.radio("Arithmetic", list(LANE_ARITHMETIC), key="rc_arith", format_func=lambda k: LANE_ARITHMETIC[k][2],
             help="How each lane's target multiplies its 4-bit weights. int8 (as llama.cpp): activations rounded to 8 "
                  "bits, int8 multiply-adds, so a verify pass over a few tokens costs little more than one. fp32: "
                  "the exact reference, where each extra token of a pass costs its own fp32 multiply-adds. One lane "
                  "each: plain decoding on fp32 against speculation on int8, both regimes side by side (then the "
                  "speedup is the arithmetic's and speculation's together, and the texts may part: that is the "
                  "arithmetic, not speculation).")
    st.slider("Max new tokens", 8, MAX_NEW_UI, key="rc_max_new")
    st.select_slider("Playback speed", list(SPEEDS), key="rc_speed",
                     format_func=lambda v: "1× (measured)" if v == 1 else f"{v:g}×",
                     help="1×: the lanes play at the pace they were measured. Slower speeds stretch both lanes "
                          "alike, so the ratio between them stays the measured one.")

sync_url(URL_KEYS)
if not stage_text("rc_prompt", S["rc_prompt"] if S["rc_preset"] == CUSTOM else None, PROMPT_URL_MAX):
    st.sidebar.warning(f"This prompt is over {PROMPT_URL_MAX} characters, too long for the page's link.")

# ------------------------------------------------------------------------------------------ layout
controls = st.container()
status = st.empty()
player = st.empty()
opener = st.empty()  # under the lanes: a round of the speculative lane opened in the Live page
notes = st.empty()
shown: dict = {}  # the race the player shows at the end of this run (its rounds are what the opener offers)


@st.cache_data(show_spinner=False)
def _recorded():
    return load_race(RECORDED) if RECORDED.is_file() else None


_draws = itertools.count()  # a race drawn twice in one run (after a click) needs new chart keys


def _draw(race, recorded: bool) -> None:
    """The player and what is said under it, with the charts after the race (each replaces what was there)."""
    nonce = S.get("rc_nonce", 0)
    shown["race"] = race
    with player.container():
        # our own document; model text rides in it only as escaped JSON, put in with textContent (app/race_view.py)
        st.iframe(player_html(race, S["rc_speed"], present=present, nonce=nonce), height="content")
    with notes.container():
        st.caption(honesty_line(race, S["rc_speed"], recorded=recorded))
        if why := why_identical(race):
            st.caption(why)
        if recorded and not S.get("rc_race"):
            st.caption("Press **Race** to race on this server now.")
        if line := room_line(race):
            st.warning(line)
        if race.spread > SpeedupAB.SPREAD_WARN:
            st.warning(f"The timed runs of one kind differed by up to {race.spread:.1f}× (the machine was busy): the "
                       "ratio is unsure. Race again with nothing else running.")
        n = next(_draws)
        # why the verdict's speedup is what it is, from the lanes' own passes (engine.explain.why)
        why_card(why_from_race(race, where=f"the recorded race's machine, {race.machine} ({race.measured_at[:10]})"
                               if recorded else "this server"), key=f"rc_{n}")
        _after_race(race, n)


def _draw_current(recorded_race) -> None:
    race = S.get("rc_race") if S.get("rc_show", "session") == "session" else None
    if race is not None:
        _draw(race, recorded=False)
    elif recorded_race is not None:
        _draw(recorded_race, recorded=True)
    else:
        player.info("Press **Race** to race plain against speculative decoding on this server.")


def _after_race(race, n: int) -> None:
    with st.expander("After the race: acceptance by position and tokens per pass", expanded=not present):
        a, b = st.columns(2)
        surv = survival(race.spec)
        if surv:
            fig = go.Figure(go.Bar(x=list(range(1, len(surv) + 1)), y=surv))
            fig.update_layout(title="Rounds with draft tokens 1…i all accepted",
                              xaxis_title="draft position i", yaxis_title="share of drafting rounds",
                              yaxis_range=[0, 1.05], height=280, margin={"t": 40, "b": 10})
            fig.update_xaxes(tickmode="linear", dtick=1)
            show_chart(fig, key=f"rc_fig_surv_{n}", where=a)
        else:
            a.caption("No round drafted anything (prompt lookup found nothing to copy).")
        fig = go.Figure()
        for lane, name in ((race.plain, "plain"), (race.spec, "speculative")):
            counts = lane.tokens_per_pass_counts()
            fig.add_bar(x=list(counts), y=list(counts.values()), name=name)
        fig.update_layout(title="Tokens per target pass (passes)", xaxis_title="tokens a pass yielded",
                          yaxis_title="passes", barmode="group", height=280, margin={"t": 40, "b": 10})
        fig.update_xaxes(tickmode="linear", dtick=1)
        show_chart(fig, key=f"rc_fig_tpp_{n}", where=b)
        st.caption(f"Timed runs, ms per token, in the order they ran ({', '.join(race.order)}): speculative "
                   + ", ".join(f"{x:.1f}" for x in race.spec_ms_per_token) + "; plain "
                   + ", ".join(f"{x:.1f}" for x in race.base_ms_per_token)
                   + (f". The same runs by the decoders' own clocks (prefill included, without the lane recording "
                      f"between rounds; the median of each kind): {race.ab_speedup:.2f}×, against "
                      f"{race.speedup:.2f}× on the lanes' clocks above" if race.ab_speedup and race.speedup else "")
                   + f". Warm-up {race.warm_ms / 1000:.1f} s, timed runs {race.measure_ms / 1000:.1f} s.")


# an interrupted race (Stop, or any other click while it ran) leaves this flag behind
if S.pop("rc_running", False):
    status.info("The race was stopped before it ended; the last race (or the recorded one) is shown.")

recorded = _recorded()
# drawn before the model loads: on a server's first visit the recorded race plays while the model is loading
_draw_current(recorded)

target = plain_target = None
try:
    target = get_model(TARGET, arithmetic=LANE_ARITHMETIC[S["rc_arith"]][1])  # the speculative lane's
    plain_target = get_model(TARGET, arithmetic=LANE_ARITHMETIC[S["rc_arith"]][0])
except SpeedupLabError as e:
    st.error(str(e))

with controls:
    row = st.container(horizontal=True)
    # no tooltip: it stayed over the intro while the mouse rested on the button (the progress bar says what runs)
    race_clicked = row.button("🏁 Race", type="primary", key="rc_race_btn", disabled=target is None)
    row.button("Stop", key="rc_stop", help="Ends a race in progress after the run it is timing.")
    recorded_clicked = row.button(
        "Play the recorded race", key="rc_recorded_btn", disabled=recorded is None,
        help="A race measured earlier and shipped with the app"
             + (f" (on {recorded.machine}, {recorded.measured_at[:10]})" if recorded is not None else "")
             + ": for when this server is busy or still loading the model.")
    join_clicked = present and row.button("📱 Join card", key="rc_join_btn",
                                          help="The app's address in large type and as a QR code, for the room.")


def _settings() -> dict:
    """Every setting the lanes are built from (``app.race_view.decoder_kwargs`` reads them back)."""
    return race_settings(target=TARGET, prompt=S["rc_prompt"], preset=S["rc_preset"], draft=S["rc_draft"],
                         early_exit_k=int(S["rc_k"]), draft_model=S["rc_draft_model"].strip(),
                         gamma=int(S["rc_gamma"]), tree=int(S["rc_tree"]), temperature=float(S["rc_temp"]),
                         seed=int(S["rc_seed"]), max_new_tokens=int(S["rc_max_new"]),
                         rule=S["rc_rule"] if float(S["rc_temp"]) > 0 else "standard",
                         arithmetic=LANE_ARITHMETIC[S["rc_arith"]][1],
                         plain_arithmetic=LANE_ARITHMETIC[S["rc_arith"]][0])


def _make(settings: dict, baseline: bool, room, lane_target=None):
    """A builder of one lane's fresh decoder from the race's recorded settings (as the Live page builds its own),
    stepping through the room: alone its passes are its own; beside other readers they share the room's passes,
    and the race records how many rows they had. ``lane_target``: the lane's model (its arithmetic), default the
    speculative lane's."""
    kw = decoder_kwargs(settings)
    model = target if lane_target is None else lane_target
    return lambda: room.bind(make_decoder(model, **kw, baseline=baseline, load=get_model))


if recorded_clicked and recorded is not None:
    S["rc_show"] = "recorded"
    S["rc_nonce"] = S.get("rc_nonce", 0) + 1
    _draw(recorded, recorded=True)

if race_clicked and target is not None:
    room = room_for(target)
    if S["rc_draft"] == "early-exit" and S["rc_k"] >= target_layers(target):
        S["rc_k"] = max(target_layers(target) - 1, 1)
    player.empty()  # nothing animates in the browser while the lanes are timed (the browser may share the CPU)
    opener.empty()
    notes.empty()
    shown.clear()
    bar = status.progress(0.0, text="Building the decoders…")
    what = {"warm-up": "warming both up (thrown away)", "spec": "speculative decoding", "base": "plain decoding"}

    def _progress(done: int, total: int, part: str) -> None:
        bar.progress(done / total, text=f"Part {done + 1} of {total}: {what[part]}. Nothing is drawn until the runs "
                                        "end, so the page does not slow what it measures. Stop ends the race.")

    S["rc_running"] = True  # left set when a click interrupts the race (the next run says so)
    machine = (f"{target.compute.cpu} ({os.cpu_count()} cores, {target.compute.threads} threads, compute path "
               f"{target.compute.path})" if target.compute is not None else "this server's CPU")
    label = DRAFT_SHORT[S["rc_draft"]] + (f" ({S['rc_k']} layers)" if S["rc_draft"] == "early-exit" else "") + (
        f", tree of {S['rc_tree']}" if S["rc_tree"] else "") + f", γ = {S['rc_gamma']}"
    settings = _settings()
    try:
        plain_room = room if plain_target is target else room_for(plain_target)
        race = run_race(_make(settings, False, room), _make(settings, True, plain_room, plain_target), label,
                        settings=settings,
                        machine=machine, greedy=float(S["rc_temp"]) == 0, on_progress=_progress, busy=room.readers,
                        pass_rows=lambda: room.stats().last_pass_rows)
    except RaceStopped as e:
        race = None
        status.info(str(e))
    except SpeedupLabError as e:  # bad settings (InputError), a draft that cannot load: a message, no traceback
        race = None
        status.error(str(e))
    S["rc_running"] = False
    if race is not None:
        S["rc_race"], S["rc_show"] = race, "session"
        S["rc_nonce"] = S.get("rc_nonce", 0) + 1
        status.empty()
    _draw_current(recorded)



def _open_in_live(race) -> None:
    """Under the lanes: pick a round of the speculative lane and open it in the Live page, rebuilt from the race's
    settings (``app.race_view.live_link``) and stepped to that round."""
    rounds = race.spec.rounds
    if not rounds:
        return
    with opener.container():
        S["rc_open_round"] = min(max(int(S.get("rc_open_round", 1)), 1), len(rounds))  # a shorter race's last
        row = st.container(horizontal=True, vertical_alignment="bottom")
        n = row.number_input(f"Round of the speculative lane (1–{len(rounds)})", 1, len(rounds), key="rc_open_round",
                             width=230, help="The Live page rebuilds this lane's decoder from the race's settings and "
                                             "steps it to this round, as pressing Step one round that many times "
                                             "would; there every number behind the round is shown.")
        try:
            link = live_link(race.settings, n)
        except InputError as e:
            row.caption(str(e))
            return
        with row:
            page_link(link, f"Open round {n} in the Live page", icon="🔎")
        what = escape_markdown(round_hover(race.spec, rounds[n - 1]).split("\n")[0])  # carries model text
        st.caption(what + ("." if race.greedy else ". Sampled: the Live page draws the same random numbers from the "
                           "seed, so it shows this round too.") + " Or click a round's bar in the speculative lane.")


if shown.get("race") is not None:
    _open_in_live(shown["race"])

if join_clicked:
    join_card()  # app.join: the same card Home and every page's sidebar open

if target is None:
    stop_page()
