"""Presentation of the Race page: the player that replays a recorded race (``engine.decoding.race``) in the browser,
and the lines said about it (pure functions, unit-tested without a browser).

The player is one HTML document with a small script, drawn once by the page (``st.iframe``): it
animates the recorded timeline on the browser's clock (requestAnimationFrame), so playback costs the server nothing
and no rerun per token. Every number it shows at the end comes from the engine's record; while playing it shows
what the playback model (``engine.decoding.race.lane_at``) gives at that moment: tokens with t ≤ now, passes ended
by now, tokens ÷ elapsed.

Model text is untrusted: it reaches the script only as JSON inside a ``<script type="application/json">`` element
with ``<``, ``>``, ``&`` and the JavaScript line separators escaped (so no token can close the element), and the
script puts it into the page with ``textContent`` and ``title``, never as HTML.
"""

from __future__ import annotations

import json

from app.decoders import DRAFT_KINDS, TREE_BRANCH_DEFAULT
from app.live_view import PROMPT_URL_MAX, visible
from engine.decoding.measure import SpeedupAB
from engine.decoding.models import EMBEDDED
from engine.decoding.race import PASS_KINDS, Lane, LaneRound, Race, Span
from engine.errors import InputError
from engine.explain.presets import CUSTOM, PROMPT_PRESETS, preset_text
from engine.explain.teaching import PageLink

SPEEDS = {1.0: "the measured pace", 0.5: "½ of the measured pace (slow motion)",
          0.25: "¼ of the measured pace (slow motion)"}
"""Playback speeds offered: 1 = the measured pace."""

ORIGIN_WORDS = {"accepted": "accepted draft", "correction": "correction", "bonus": "bonus", "plain": "plain step"}
VERDICT_MARK = {"accepted": "✓", "rejected": "✗", "discarded": "–", "after the end": "–"}


def _ms(x: float) -> str:
    return f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def round_hover(lane: Lane, rnd: LaneRound) -> str:
    """The hover text of a round's bars: its draft with verdicts, p and q, the target's own token and its times
    (plain text; the player sets it as a ``title``, never as HTML)."""
    spans = [s for s in lane.spans if s.round == rnd.index]
    draft_ms = sum(s.ms for s in spans if s.kind == "draft")
    pass_ms = sum(s.ms for s in spans if s.kind in PASS_KINDS)
    head = f"Round {rnd.index + 1}"
    if not rnd.draft:
        what = f"{head}: one target pass ({_ms(pass_ms)})" if pass_ms else f"{head}: p from the prefill's pass"
        if rnd.next_text:
            what += f" → {visible(rnd.next_text)!r} ({ORIGIN_WORDS.get(rnd.next_kind, rnd.next_kind)})"
        if lane.kind != "plain" and rnd.next_kind == "plain":
            what += "; no draft this round"
        return what
    steps = {0: "a lookup, no model call", 1: "1 draft call"}.get(rnd.draft_steps, f"{rnd.draft_steps} draft calls")
    fused = f", which also prefilled the prompt's {rnd.prefill_tokens} tokens" if rnd.prefill_tokens else ""
    lines = [f"{head}: drafted {len(rnd.draft)} ({steps}, {_ms(draft_ms)}), verified in one target pass "
             f"({_ms(pass_ms)}{fused}), kept {rnd.n_accepted} + 1"]
    for i, m in enumerate(rnd.draft):
        lines.append(f"  {i + 1}. {visible(m.text)!r} {VERDICT_MARK.get(m.verdict, '?')} {m.verdict}"
                     f"  (p {m.p:.3f}, q {m.q:.3f})")
    if rnd.next_text:
        lines.append(f"  then {visible(rnd.next_text)!r}: the target's {rnd.next_kind}")
    return "\n".join(lines)


def span_hover(lane: Lane, span: Span) -> str:
    """The hover text of a span that belongs to no round (the prompt's prefill pass)."""
    return f"Prefill: the prompt's {span.tokens} tokens in one target pass ({_ms(span.ms)})"


def lane_title(lane: Lane) -> str:
    return "Plain decoding" if lane.kind == "plain" else f"Speculative: {lane.label}"


def verdict_line(race: Race) -> str:
    """The race's final verdict (plain text, one line on a projector): whether the texts are identical, the measured
    wall-clock ratio and the tokens per target pass of each lane."""
    sp = race.speedup
    ratio = "—" if sp is None else f"{sp:.2f}×"
    tpp = (f"{race.spec.tokens_per_pass:.2f} vs {race.plain.tokens_per_pass:.2f} tokens per target pass"
           if race.spec.tokens_per_pass and race.plain.tokens_per_pass else "")
    if race.identical and not race.greedy and race_rule(race) == "gumbel":
        head = (f"TEXT IDENTICAL ({race.spec.new_tokens} tokens, sampled with the same seed's Gumbel noise) · {ratio} "
                "wall-clock")
    elif race.identical:
        head = f"TEXT IDENTICAL ({race.spec.new_tokens} tokens) · {ratio} wall-clock"
    elif lane_arithmetic(race)[0] != lane_arithmetic(race)[1]:
        plain, spec = lane_arithmetic(race)
        head = (f"TEXT DIFFERS from token {race.first_difference + 1} (the lanes' arithmetic differs: plain {plain}, "
                f"speculative {spec}; not speculation) · {ratio} wall-clock")
    elif race.greedy:
        head = f"TEXT DIFFERS from token {race.first_difference + 1} (a near tie, rounded differently) · {ratio} wall-clock"
    else:
        head = f"Sampled: texts differ from token {race.first_difference + 1} (each lane's own draws) · {ratio} wall-clock"
    unsure = (f" · UNSURE: the machine was busy (runs of one kind differed up to {race.spread:.1f}×)"
              if race.spread > SpeedupAB.SPREAD_WARN else "")
    return head + (f" · {tpp}" if tpp else "") + unsure


def lane_arithmetic(race: Race) -> tuple[str, str]:
    """(the plain lane's, the speculative lane's) arithmetic ("fp32" for a record made before races recorded it)."""
    s = {**RACE_DEFAULTS, **(race.settings or {})}
    return str(s["plain_arithmetic"]), str(s["arithmetic"])


def race_rule(race: Race) -> str:
    """The sampling rule a race ran under ("standard" for a record made before races recorded it)."""
    return str((race.settings or {}).get("rule") or "standard")


def why_identical(race: Race) -> str | None:
    """Why a sampled race under the drafter-invariant rule ends with identical texts (plain text; None for a greedy
    race or one under the standard rule)."""
    if race.greedy or race_rule(race) != "gumbel":
        return None
    return ("Why identical though sampled: under the drafter-invariant rule (Daliri, Musco & Suresh 2024) the token at "
            "each position is argmax(log p + g), with Gumbel noise g fixed by the seed, the position and the token. "
            "The plain lane takes that pick at every step; the speculative lane's draft proposes argmax(log q + g) "
            "with the same noise and keeps a draft token only where the target's own pick is that token, so both "
            "lanes emit the target's pick at every position. Gumbel-max sampling follows p exactly, so it is still a "
            "sample of the target; another seed gives another text.")


def identical_words(race: Race) -> dict:
    """The live line's words: what the player says while the texts agree and once they differ."""
    same = "texts identical so far ({n} tokens)"
    differ = ("texts differ from token {k} (sampling)" if not race.greedy and race_rule(race) != "gumbel"
              else "TEXT DIVERGED at token {k}")
    return {"same": same, "differ": differ}


def honesty_line(race: Race, speed: float, recorded: bool = False) -> str:
    """What the page says about how the lanes were measured and are played (plain text)."""
    pace = SPEEDS.get(speed, f"{speed:g}× the measured pace")
    where = f"measured on {race.machine}" + (f", {race.measured_at[:10]}" if race.measured_at else "")
    runs = len(race.order)
    what = ("A recorded race, " + where if recorded else "Measured on this server (" + race.machine + ")")
    return (f"{what}: the lanes ran one after the other, alone, warm, in alternating order "
            f"({' '.join('A' if k == 'spec' else 'B' for k in race.order)}: {runs} timed runs, A speculative, B "
            f"plain), and each kind's run at the median is replayed here at {pace} on one shared clock. Racing them "
            "at the same time on one CPU would slow both.")


def room_line(race: Race) -> str | None:
    """A line when other readers decoded on the server while the race ran (None when nobody did): how many, and, when
    the lanes stepped through the room (``run_race``'s ``pass_rows``), the most rows a pass of theirs shared."""
    n, rows = race.others_max, getattr(race, "rows_max", 0)
    if not n and rows <= 1:
        return None
    who = f"up to {n} other reader{'s' if n != 1 else ''}" if n else "other readers"
    shared = (f": the lanes' rounds shared the room's passes with their rows (up to {rows} rows a pass), so both "
              "lanes ran slower than alone" if rows > 1 else
              ": their passes shared the server's cores with the lanes, so both lanes ran slower than alone")
    return (f"While this race ran, {who} decoded on this server{shared} and the ratio is unsure. Race again when "
            "the room is quiet, or play the recorded race.")


# ---------------------------------------------------------------------------------------------- a round in Live
RACE_DEFAULTS = {"target": EMBEDDED, "early_exit_k": 8, "draft_model": "", "tree": 0, "rule": "standard",
                 "arithmetic": "fp32", "plain_arithmetic": "fp32", "length": "fixed"}
"""What a race record made before these settings were recorded raced with (the page's defaults then)."""

LIVE_KEYS = {"prompt": "lv_prompt", "kind": "lv_draft", "gamma": "lv_gamma", "temperature": "lv_temp",
             "top_k": "lv_topk", "top_p": "lv_topp", "seed": "lv_seed", "max_new_tokens": "lv_max_new",
             "tree": "lv_tree", "branching": "lv_branch", "accept": "lv_accept", "early_exit_k": "lv_k",
             "draft_model": "lv_draft_model", "confidence_gate": "lv_conf", "rule": "lv_rule",
             "length": "lv_length"}
"""The Live page's URL key of each ``app.decoders.make_decoder`` argument (the target travels as ``lv_target``; a
preset's prompt as ``lv_preset``, a custom one as ``lv_preset=custom`` with ``lv_prompt``)."""

LIVE_PATH = "live"
"""The Live page's ``url_path`` (app/registry.py)."""


def race_settings(*, target: str, prompt: str, preset: str, draft: str, early_exit_k: int, draft_model: str,
                  gamma: int, tree: int, temperature: float, seed: int, max_new_tokens: int,
                  rule: str = "standard", arithmetic: str = "int8", plain_arithmetic: str | None = None,
                  length: str = "adaptive") -> dict:
    """The settings a race records and builds both lanes from (``decoder_kwargs``): every one that shapes a lane's
    run, so its rounds can be rebuilt (the Live page's view of a round: ``live_link``). ``draft_label`` rides along
    for people reading the record. ``rule``: the sampling rule ("standard" or "gumbel"). ``arithmetic``: the
    speculative lane's target arithmetic ("int8" or "fp32", ``engine.decoding.compute.arithmetic``), ``plain_arithmetic``
    the plain lane's (default the same). ``length``: the head's draft length ("adaptive", the default since the
    engine's draft-length rule, or "fixed"; a record without it raced a fixed γ)."""
    return {"target": target, "prompt": prompt, "preset": preset, "draft": draft,
            "draft_label": DRAFT_KINDS.get(draft, draft), "early_exit_k": int(early_exit_k),
            "draft_model": draft_model, "gamma": int(gamma), "tree": int(tree), "temperature": float(temperature),
            "seed": int(seed), "max_new_tokens": int(max_new_tokens), "rule": str(rule), "arithmetic": str(arithmetic),
            "plain_arithmetic": str(plain_arithmetic or arithmetic), "length": str(length)}


def race_target(settings: dict) -> str:
    """The target model a race ran (its record's ``target``; the embedded model for a record without one)."""
    return str(settings.get("target") or RACE_DEFAULTS["target"])


def decoder_kwargs(settings: dict) -> dict:
    """``app.decoders.make_decoder``'s arguments after the target (``prompt``, ``kind`` and the rest, by keyword) for
    a race's ``settings`` (``race_settings``'s dict, or an older record's, read with ``RACE_DEFAULTS``). The arguments
    a race does not set are make_decoder's defaults, written out, so every one of them has a value to carry.

    Raises:
        InputError: settings without a prompt or a draft.
    """
    s = {**RACE_DEFAULTS, **settings}
    if "prompt" not in s or "draft" not in s:
        raise InputError("This race's record names no prompt or no draft.")
    return {"prompt": str(s["prompt"]), "kind": str(s["draft"]), "gamma": int(s["gamma"]),
            "temperature": float(s["temperature"]), "top_k": 0, "top_p": 1.0, "seed": int(s["seed"]),
            "max_new_tokens": int(s["max_new_tokens"]), "tree": int(s["tree"]), "branching": TREE_BRANCH_DEFAULT,
            "accept": "exact", "early_exit_k": int(s["early_exit_k"]), "draft_model": str(s["draft_model"]),
            "confidence_gate": 0.0, "rule": str(s["rule"]),
            # the head's draft length (its default adaptive), as the Live page's settings read it; other drafts: fixed
            "length": (str(s["length"]) or "adaptive") if str(s["draft"]) == "head" and not int(s["tree"]) else "fixed"}


def live_link(settings: dict, round_no: int) -> PageLink:
    """The Live page opened at round ``round_no`` of a race's speculative lane: every setting the lane was built from
    (``decoder_kwargs``) under its Live key (``LIVE_KEYS``), the target, and ``lv_round``. The prompt travels as its
    preset's name when it is that preset's text, else as a custom prompt.

    Raises:
        InputError: round_no < 1; a custom prompt over ``PROMPT_URL_MAX`` characters (too long for a link); the
        errors of ``decoder_kwargs``.
    """
    if int(round_no) < 1:
        raise InputError(f"Rounds count from 1, got {round_no}.")
    kw = decoder_kwargs(settings)
    prompt = kw.pop("prompt")
    params = {"lv_target": race_target(settings),
              "lv_arith": str({**RACE_DEFAULTS, **settings}["arithmetic"])}  # the speculative lane's
    preset = settings.get("preset")
    if preset in PROMPT_PRESETS and preset_text(preset) == prompt:
        params["lv_preset"] = preset
    elif len(prompt) <= PROMPT_URL_MAX:
        params["lv_preset"], params[LIVE_KEYS["prompt"]] = CUSTOM, prompt
    else:
        raise InputError(f"This race's prompt is over {PROMPT_URL_MAX} characters, too long for a link: open the "
                         "Live page and paste it there.")
    params.update({LIVE_KEYS[k]: v for k, v in kw.items() if v is not None})
    params["lv_round"] = int(round_no)
    return PageLink(LIVE_PATH, params)


def live_round_base(settings: dict, present: bool = False) -> str | None:
    """The relative URL of the Live page at a round of this race without the round's number: the player appends it
    to ``…&lv_round=`` for each bar (None when the race cannot travel in a link: ``live_link``'s errors)."""
    try:
        link = live_link(settings, 1)
    except InputError:
        return None
    rest = PageLink(link.url_path, {k: v for k, v in link.params.items() if k != "lv_round"})
    return rest.url(**({"present": 1} if present else {})) + "&lv_round="


def _lane_data(lane: Lane) -> dict:
    hovers = {r.index: round_hover(lane, r) for r in lane.rounds}
    return {
        "kind": lane.kind,
        "title": lane_title(lane),
        "wall": lane.wall_ms,
        "ttft": lane.ttft_ms,
        "tokens": [[m.t_ms, m.text, m.origin, m.round] for m in lane.tokens],
        "spans": [[s.kind, s.start_ms, s.end_ms, s.round, s.tokens] for s in lane.spans],
        "steps": {str(r.index): r.draft_steps for r in lane.rounds},
        "hover": {str(k): v for k, v in hovers.items()},
        "prefill_hover": [span_hover(lane, s) for s in lane.spans if s.kind == "prefill"],
        "final": {"tokens_per_s": lane.tokens_per_s, "passes": lane.target_passes,
                  "tokens_per_pass": lane.tokens_per_pass, "tokens": lane.new_tokens, "wall": lane.wall_ms},
    }


def player_data(race: Race, speed: float = 1.0, present: bool = False) -> dict:
    """Everything the player's script reads (JSON-ready): both lanes' timelines, their final numbers, the shared
    clock's length, the speed, the verdict, the live line's words, and the Live page's URL of a speculative round
    without its number (``live_round_base``; None: the bars are not links)."""
    fd = race.first_difference
    return {"speed": float(speed), "duration": race.duration_ms, "present": bool(present),
            "lanes": [_lane_data(race.plain), _lane_data(race.spec)],
            "first_difference": fd, "verdict": verdict_line(race), "words": identical_words(race),
            "pace": SPEEDS.get(speed, f"{speed:g}× the measured pace"),
            "live": live_round_base(race.settings, present)}


def json_for_script(data) -> str:
    """``data`` as JSON that can sit inside an HTML ``<script>`` element: ``<``, ``>``, ``&``, U+2028 and U+2029
    escaped, so no string in it can end the element or break the script."""
    s = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (s.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def player_html(race: Race, speed: float = 1.0, present: bool = False, nonce: int = 0) -> str:
    """The player: a self-contained HTML document (fixed style and script; the race only as escaped JSON).
    ``nonce`` changes the document so a new race (or a Replay from the page) starts a fresh player."""
    data = json_for_script(player_data(race, speed, present))
    return (_PLAYER.replace("__FONT__", "17px" if present else "14px")
            .replace("__TEXT_H__", _text_height(4 if present else 7))
            .replace("__NONCE__", str(int(nonce)))
            .replace("__DATA__", data))


def _text_height(lines: int) -> str:
    """A lane's text box as a whole number of its lines (CSS height in the box's own em; ``.text`` sets
    line-height 1.35 and no vertical padding, which would show the next line's top), so the box never ends through
    the middle of a line: a box of 84 px at the presenter's font held 4.3 lines and cut the fifth in half."""
    return f"{lines * 1.35:.2f}em"


# A fixed document: the only variable parts are the font size, a box height, an integer and the escaped JSON.
_PLAYER = """<!doctype html><html><head><meta charset="utf-8"><style>
:root { --font: __FONT__; }
body { margin: 0; font-family: "Source Sans Pro", "Source Sans 3", system-ui, sans-serif; font-size: var(--font);
  color: #31333f; background: transparent; }
.bar { display: flex; align-items: center; gap: 0.8em; margin-bottom: 6px; flex-wrap: wrap; }
.clock { min-width: 7.5em; }
button { font: inherit; padding: 3px 12px; border: 1px solid #d0d3da; border-radius: 6px; background: #fff;
  cursor: pointer; }
button:hover { border-color: #ff4b4b; color: #ff4b4b; }
.clock { font-variant-numeric: tabular-nums; color: #555; }
.same { font-weight: 600; color: #1a7f37; }
.note { margin-left: auto; color: #666; font-size: 0.8em; }
.same.diff { color: #b42318; }
.lane { border: 1px solid #e6e8ec; border-radius: 8px; padding: 5px 8px 4px; margin-bottom: 6px; }
/* the title whole (a long draft's name was cut to "EAGLE-style head,…" at 1280 px): where it and the stats do not
   fit on one line, the stats go to the next */
.head { display: flex; justify-content: space-between; column-gap: 1em; flex-wrap: wrap; }
.title { font-weight: 700; flex: 0 1 auto; min-width: 0; overflow-wrap: anywhere; }
.stats { font-variant-numeric: tabular-nums; color: #444; flex: 0 0 auto; white-space: nowrap; }
/* a phone: the stats line on a row of its own, as wide as the lane, wrapped (as wide as its text, it ran past
   the lane's edge and the frame cut it) */
@media (max-width: 700px) { .head { flex-wrap: wrap; } .stats { white-space: normal; flex: 1 1 100%; min-width: 0; } }
.prog { height: 5px; background: #eef0f3; border-radius: 3px; margin: 3px 0; overflow: hidden; }
.prog > div { height: 100%; width: 0; background: #8a8f98; }
.lane.spec .prog > div { background: #2e9b5b; }
.text { height: __TEXT_H__; overflow-y: auto; white-space: pre-wrap; word-break: break-word; line-height: 1.35;
  font-family: "Source Code Pro", ui-monospace, monospace; font-size: 0.86em; background: #fafbfc; padding: 0 4px;
  border-radius: 4px; }
.tok { border-radius: 2px; }
.tok.accepted { background: #c9f0d3; } .tok.correction { background: #ffd8a8; } .tok.bonus { background: #cfe3ff; }
.tok.plain { background: #eceef1; }
.timeline { position: relative; height: 20px; margin-top: 4px; background: #f6f7f9; border-radius: 3px; }
.tokrow { position: relative; height: 14px; }
.span { position: absolute; top: 2px; bottom: 2px; border-radius: 2px; min-width: 1px; }
.span.prefill { background: #6b7280; } .span.step { background: #9aa3ae; } .span.verify { background: #2e9b5b; }
.span.draft { background: #f2b84b; }
a.span { cursor: pointer; } a.span:hover { outline: 2px solid #ff4b4b; outline-offset: 1px; z-index: 1; }
.span.draft i { position: absolute; top: 0; bottom: 0; border-left: 1px solid rgba(255,255,255,0.9); }
.dot { position: absolute; width: 4px; border-radius: 1px; }
.dot.accepted { background: #2e9b5b; } .dot.correction { background: #f08c00; } .dot.bonus { background: #3b82f6; }
.dot.plain { background: #9aa3ae; }
.cursor { position: absolute; top: 0; bottom: 0; width: 2px; background: #ff4b4b; left: 0; }
.axis { position: relative; height: 14px; font-size: 0.72em; color: #777; }
.axis span { position: absolute; white-space: nowrap; }
.legend { font-size: 0.8em; color: #555; display: flex; gap: 1em; flex-wrap: wrap; margin-top: 2px; }
.legend b { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 4px;
  vertical-align: -1px; }
.verdict { font-weight: 700; margin-top: 4px; min-height: 1.4em; }
</style></head><body data-state="loading" data-nonce="__NONCE__">
<script type="application/json" id="race-data">__DATA__</script>
<div class="bar"><button id="replay" type="button">↻ Replay</button>
<span class="clock" id="clock"></span><span class="same" id="same"></span>
<span class="note" id="note"></span></div>
<div id="lanes"></div>
<div class="legend">
<span><b style="background:#c9f0d3"></b>accepted draft token</span><span><b style="background:#ffd8a8"></b>target
 correction</span><span><b style="background:#cfe3ff"></b>bonus token</span><span><b style="background:#eceef1"></b>plain
 step</span><span><b style="background:#6b7280"></b>prefill pass</span><span><b style="background:#9aa3ae"></b>plain
 pass</span><span><b style="background:#f2b84b"></b>draft steps</span><span><b style="background:#2e9b5b"></b>verify
 pass</span><span id="click-note"></span></div>
<div class="verdict" id="verdict"></div>
<script>
(() => {
  const D = JSON.parse(document.getElementById("race-data").textContent);
  const dur = Math.max(D.duration, 1e-6);
  const pct = (ms) => (100 * ms / dur) + "%";
  const el = (tag, cls, parent) => { const e = document.createElement(tag); if (cls) e.className = cls;
    if (parent) parent.appendChild(e); return e; };
  const fmt = (x, d) => (x === null || x === undefined) ? "—" : x.toFixed(d);
  const lanesBox = document.getElementById("lanes");
  let lanes = [];
  function build() {
    lanesBox.textContent = "";
    lanes = D.lanes.map((L) => {
      const box = el("div", "lane " + (L.kind === "plain" ? "plain" : "spec"), lanesBox);
      const head = el("div", "head", box);
      const title = el("span", "title", head); title.textContent = L.title; title.title = L.title;
      const stats = el("span", "stats", head);
      const prog = el("div", "prog", box); const progIn = el("div", "", prog);
      const text = el("div", "text", box);
      const tl = el("div", "timeline", box);
      const rows = el("div", "tokrow", box);
      const cursor = el("div", "cursor", tl);
      const perRound = {};
      L.tokens.forEach((t) => { perRound[t[3]] = (perRound[t[3]] || 0) + 1; });
      const most = Math.max(1, ...Object.values(perRound));
      return {L, box, stats, progIn, text, tl, rows, cursor, ti: 0, si: 0, open: null, passes: 0, most,
              stack: {}, prefillSeen: 0};
    });
    const axis = el("div", "axis", lanesBox);
    const step = [0.05, 0.1, 0.2, 0.25, 0.5, 1, 2, 5, 10, 20].find((s) => dur / 1000 / s <= 8) || 50;
    for (let s = 0; s * 1000 <= dur + 1e-6; s += step) {
      const a = el("span", "", axis); a.style.left = pct(s * 1000); a.textContent = (+s.toFixed(2)) + " s";
      // the first and last labels stay inside the box
      a.style.transform = s === 0 ? "none" : (s * 1000 > dur * 0.94 ? "translateX(-100%)" : "translateX(-50%)");
    }
  }
  function addSpan(lane, s) {
    const [kind, start, end, round] = s;
    // a speculative round's bars open that round in the Live page, in a new tab (the frame may open popups only)
    const link = D.live && lane.L.kind !== "plain" && round !== null;
    const d = el(link ? "a" : "div", "span " + kind, lane.tl);
    d.style.left = pct(start);
    d.title = round === null ? (lane.L.prefill_hover[lane.prefillSeen++] || "prefill")
                             : (lane.L.hover[String(round)] || "");
    if (link) {
      d.href = D.live + (round + 1); d.target = "_blank"; d.rel = "noopener"; d.dataset.round = round + 1;
      d.title += "\\nClick: open round " + (round + 1) + " in the Live page (a new tab)";
    }
    const steps = kind === "draft" ? (lane.L.steps[String(round)] || 0) : 0;
    for (let i = 1; i < steps; i++) { const tick = el("i", "", d); tick.style.left = (100 * i / steps) + "%"; }
    return d;
  }
  function closeSpan(lane) {
    const [kind, start, end] = lane.open.s;
    lane.open.d.style.width = pct(end - start);
    if (kind !== "draft") lane.passes++;
    lane.open = null;
  }
  function addToken(lane, t) {
    const [tms, text, origin, round] = t;
    const s = el("span", "tok " + origin, lane.text);
    s.textContent = text;
    s.title = origin === "plain" ? "plain target step" : origin === "accepted" ? "accepted draft token"
            : origin === "bonus" ? "bonus token" : "target correction";
    const h = 14 / lane.most;
    const k = lane.stack[round] || 0; lane.stack[round] = k + 1;
    const dot = el("div", "dot " + origin, lane.rows);
    dot.style.left = "calc(" + pct(tms) + " - 4px)";
    dot.style.height = Math.max(h - 0.5, 1) + "px";
    dot.style.top = (14 - (k + 1) * h) + "px";
    dot.title = lane.L.hover[String(round)] || "";
  }
  const words = D.words, fd = D.first_difference;
  const same = document.getElementById("same"), clock = document.getElementById("clock");
  const verdict = document.getElementById("verdict");
  let t0 = null, frames = 0, raf = 0, done = false;
  function draw(now) {
    if (t0 === null) t0 = now;
    frames++;
    const t = Math.min((now - t0) * D.speed, dur);
    const shown = [];
    lanes.forEach((lane) => {
      const L = lane.L;
      while (lane.ti < L.tokens.length && L.tokens[lane.ti][0] <= t) addToken(lane, L.tokens[lane.ti++]);
      while (lane.si < L.spans.length && L.spans[lane.si][1] <= t) {
        if (lane.open) closeSpan(lane);  // spans run one after the other: the one before has ended
        const s = L.spans[lane.si++];
        lane.open = {d: addSpan(lane, s), s};
      }
      if (lane.open) {
        const [, start, end] = lane.open.s;
        if (t >= end) closeSpan(lane); else lane.open.d.style.width = pct(Math.max(t - start, 0));
      }
      const lt = Math.min(t, L.wall);
      const n = lane.ti;
      lane.cursor.style.left = pct(lt);
      lane.progIn.style.width = (100 * n / Math.max(L.tokens.length, 1)) + "%";
      const fin = t >= L.wall;
      // while tokens arrive, the newest line in view; once the lane has ended, its beginning (both lanes' texts
      // then read side by side from their first line)
      if (!fin) lane.text.scrollTop = lane.text.scrollHeight;
      else if (!lane.topped) { lane.text.scrollTop = 0; lane.topped = true; }
      const F = L.final;
      const tps = fin ? F.tokens_per_s : (n && lt > 0 ? n / (lt / 1000) : null);
      const passes = fin ? F.passes : lane.passes;
      const tpp = fin ? F.tokens_per_pass : (passes ? n / passes : null);
      lane.stats.textContent = (lt / 1000).toFixed(2) + " s · " + n + " tokens · " + fmt(tps, 1) + " tok/s · TTFT "
        + (n ? fmt(L.ttft, 0) + " ms" : "—") + " · " + passes + " passes · " + fmt(tpp, 2) + " tokens/pass";
      lane.box.classList.toggle("fin", fin);
      shown.push(n);
    });
    const n = Math.min(...shown);
    const ok = fd === null || n <= fd;
    same.textContent = ok ? words.same.replace("{n}", n) : words.differ.replace("{k}", fd + 1);
    same.className = ok ? "same" : "same diff";
    clock.textContent = (t / 1000).toFixed(2) + " s of " + (dur / 1000).toFixed(2) + " s";
    document.body.dataset.frames = frames;
    if (t >= dur) {
      done = true;
      verdict.textContent = D.verdict;
      const secs = (now - t0) / 1000;
      document.body.dataset.fps = secs > 0 ? (frames / secs).toFixed(1) : "";
      document.body.dataset.state = "done";
      return;
    }
    document.body.dataset.state = "playing";
    raf = requestAnimationFrame(draw);
  }
  function start() {
    cancelAnimationFrame(raf);
    build(); t0 = null; frames = 0; done = false; verdict.textContent = "";
    raf = requestAnimationFrame(draw);
  }
  if (D.live && !D.present) document.getElementById("click-note").textContent = "click a speculative round's bar: that round in Live";
  document.getElementById("note").textContent = "lanes measured one after the other · played at " + D.pace;
  document.getElementById("replay").addEventListener("click", start);
  start();
})();
</script></body></html>"""
