"""Presentation helpers of the live speculative decoding page: turn ``Round`` traces into safe Markdown,
table rows and chart data (pure functions, unit-tested without a browser). The measurements the page
shows (A/B timing, the baseline comparison) are in ``engine.decoding.measure``.

Model text is untrusted: everything here that goes into Markdown passes through ``escape_markdown``,
so a token such as ``<script>``, ``**``, ``[x](javascript:…)``, ``$x$`` or ``:+1:`` is shown as the
literal characters, never as HTML, formatting, a link, LaTeX or an emoji. Chart labels are
HTML-escaped (plotly interprets a few tags in its text).
"""

from __future__ import annotations

import html
import string

from engine.decoding.models import EMBEDDED_DRAFT, EMBEDDED_HEAD, default_draft_spec
from engine.decoding.scheduler import WINDOW_S as ROOM_WINDOW_S
from engine.decoding.trace import ORIGINS, Round, TopToken, token_origins
from engine.explain.why import SPREAD_WARN, unsure_reasons

PROMPT_URL_MAX = 2000
"""A custom prompt of up to this many characters travels in a page's link (Live's ``lv_prompt``, Race's
``rc_prompt``); a longer one does not fit in a URL."""
ZWSP = "\u200b"
NBSP = "\u00a0"
_PUNCT = set(string.punctuation)
# characters after which a zero-width space is inserted, so Streamlit's text-level replacements
# (emoji shortcodes ":+1:", arrows "<-" "->", dashes "--", "~=") cannot match across them
_BREAK_AFTER = set(":<>-=~")

STYLE = {
    "accepted": "green-background",
    "correction": "orange-background",
    "bonus": "blue-background",
    "plain": "gray-background",
    "draft": "gray-background",
    "rejected": "red-background",
    "discarded": "gray",
}
"""Streamlit colour directive of each token role (generated-text origins and round verdicts)."""

ORIGIN_LABEL = {
    "accepted": "accepted draft token",
    "correction": "target correction",
    "bonus": "bonus token",
    "plain": "plain target step (no draft)",
}


def escape_markdown(text: str) -> str:
    """Escape ``text`` so Streamlit Markdown shows it literally (one line; newlines are not handled).

    Every ASCII punctuation character gets a backslash (CommonMark §2.4 allows it for all of them),
    which disables emphasis, links, code, HTML, LaTeX (``\\$``) and directive brackets; a zero-width
    space after ``: < > - = ~`` stops emoji shortcodes and typographic replacements.
    """
    out = []
    for ch in text:
        if ch in _PUNCT:
            out.append("\\" + ch)
            if ch in _BREAK_AFTER:
                out.append(ZWSP)
        else:
            out.append(ch)
    return "".join(out)


def visible(text: str) -> str:
    """A token's text made visible: newline → ↵, tab → ⇥, whitespace-only runs → ␣, empty → ∅."""
    if text == "":
        return "∅"
    t = text.replace("\r", "␍").replace("\n", "↵").replace("\t", "⇥")
    if t.strip(" ") == "":
        t = "␣" * len(t)
    return t


def chip(text: str, style: str, strike: bool = False) -> str:
    """One token as a coloured Markdown span: ``:style[escaped]`` (shown with visible whitespace)."""
    shown = visible(text)
    if not strike:
        return f":{style}[{escape_markdown(shown)}]"
    # GFM strikethrough must not open before or close after a space: keep edge spaces outside the ~~
    core = shown.strip(" ")
    lead, trail = shown[:len(shown) - len(shown.lstrip(" "))], shown[len(shown.rstrip(" ")):]
    return f":{style}[{lead}~~{escape_markdown(core)}~~{trail}]"


def _keep_spaces(piece: str) -> str:
    """Runs of spaces survive Markdown: n ≥ 2 spaces → (n − 1) NBSP + one breakable space."""
    out, run = [], 0
    for ch in piece + "\0":
        if ch == " ":
            run += 1
            continue
        if run:
            out.append(NBSP * (run - 1) + " " if run > 1 else " ")
            run = 0
        out.append(ch)
    return "".join(out[:-1])


def text_span(text: str, style: str) -> str:
    """Generated text of one token as Markdown, keeping its line breaks (hard breaks) and spaces."""
    parts = text.split("\n")
    out = []
    for i, piece in enumerate(parts):
        if i > 0:
            out.append(f":{style}[↵]  \n")
        if piece:
            if piece.strip(" ") == "":
                body = NBSP * len(piece)
            else:
                body = escape_markdown(_keep_spaces(piece.replace("\t", "    ")))
            out.append(f":{style}[{body}]")
    return "".join(out)


ONE_PER_ROUND = ("correction", "bonus")
"""Origins of which a round emits at most one token: each keeps its own span, so two rounds' corrections in a row
read as two tokens, not one word."""


def generated_markdown(pieces: list[tuple[str, str]]) -> str:
    """The generated text with each token coloured by origin; consecutive tokens of the same origin
    share one span (separate spans would pad every token boundary and read as extra spaces), except corrections
    and bonus tokens (``ONE_PER_ROUND``): each is its own round's last token and keeps its own span.

    Args:
        pieces: (token text, origin) in order; origin is one of ``engine.decoding.trace.ORIGINS``.
    """
    runs: list[list[str]] = []
    for t, o in pieces:
        if runs and runs[-1][1] == o and o not in ONE_PER_ROUND:
            runs[-1][0] += t
        else:
            runs.append([t, o])
    return "".join(text_span(t, STYLE[o]) for t, o in runs)


def legend_markdown() -> str:
    """One line: a sample span per origin with its meaning."""
    return "  ".join(f":{STYLE[o]}[{ORIGIN_LABEL[o]}]" for o in ORIGINS)


def generated_pieces(rounds: list[Round], token_text) -> list[tuple[str, str]]:
    """(text, origin) of every generated token; ``token_text(id) -> str`` decodes one token."""
    return [(token_text(t), o) for t, o in token_origins(rounds)]


def draft_frame(rnd: Round, upto: int) -> str:
    """Markdown of the draft phase after the first ``upto`` draft tokens have appeared (grey)."""
    chips = [chip(d.text, STYLE["draft"]) for d in rnd.drafted[:upto]]
    if not rnd.drafted:
        return "**Draft:** *no draft tokens this round* (the target takes a plain step)"
    return "**Draft:** " + " ".join(chips) + (" …" if upto < len(rnd.drafted) else "")


def verdict_frame(rnd: Round) -> str:
    """Markdown of the judged round: accepted green, the first rejected struck through with the
    target's correction beside it, later draft tokens greyed (discarded), a bonus token marked."""
    parts = []
    for d in rnd.drafted:
        if d.verdict == "accepted":
            parts.append(chip(d.text, STYLE["accepted"]))
        elif d.verdict == "rejected":
            parts.append(chip(d.text, STYLE["rejected"], strike=True) + " → "
                         + chip(rnd.next_text, STYLE["correction"]) + " :orange[(correction)]")
        else:
            parts.append(chip(d.text, STYLE["discarded"], strike=True))
    if rnd.ended_in_draft:
        parts.append(":gray[(the accepted end-of-sequence token ended the output)]")
    elif rnd.next_kind == "bonus":
        parts.append("+ " + chip(rnd.next_text, STYLE["bonus"]) + " :blue[(bonus)]")
    elif rnd.next_kind == "plain":
        parts.append(chip(rnd.next_text, STYLE["plain"]) + " :gray[(plain step)]")
    return "**Verify:** " + " ".join(parts)


MASK_CHIP = ":gray-background[MASK]"


def block_frames(rnd: Round, bonus_text: str) -> list[str]:
    """Animation frames of a block drafter's round (``engine.decoding.block_drafter``): the block as the drafter
    receives it (the newest token, then one MASK per slot), every slot filled at once by ONE drafter pass, then
    the verdict. ``bonus_text`` is the newest token's text (the block's first position)."""
    head = "**Block pass:** " + chip(bonus_text, STYLE["plain"]) + " "
    n = len(rnd.drafted)
    if not n:
        return [draft_frame(rnd, 0) + "  \n" + verdict_frame(rnd)]
    masks = head + " ".join([MASK_CHIP] * n) + f" :gray[({n} slot{'s' if n != 1 else ''}, one drafter pass)]"
    filled = head + " ".join(chip(d.text, STYLE["draft"]) for d in rnd.drafted) + " :gray[(all filled at once)]"
    return [masks, filled, filled + "  \n" + verdict_frame(rnd)]


def round_frames(rnd: Round) -> list[str]:
    """Animation frames of a round: one per draft token appearing, then the verdict (draft + verify)."""
    frames = [draft_frame(rnd, i) for i in range(1, len(rnd.drafted) + 1)] or [draft_frame(rnd, 0)]
    frames.append(draft_frame(rnd, len(rnd.drafted)) + "  \n" + verdict_frame(rnd))
    return frames


def round_to_show(rounds: list[Round], finished: bool) -> tuple[Round, str | None]:
    """The round the Live page opens when it draws a run's state, and a line to say why when it is not the last.

    The last round, except at the end of a run whose last round drafted nothing while an earlier one did (the
    draft is capped by the tokens left, so a run that stops at its token limit often ends on a plain target step):
    then the last round that drafted, the one that shows speculation at work.

    Args:
        rounds: the run's rounds, at least one. finished: the run has ended.

    Returns:
        (round, None) for the last round; (round, line) otherwise, the line plain Markdown (no model text).
    """
    last = rounds[-1]
    if not finished or last.n_drafted or last.tree is not None:
        return last, None
    shown = next((r for r in reversed(rounds) if r.n_drafted), None)
    if shown is None:
        return last, None
    return shown, (f"Round {shown.index + 1} is shown, the last that drafted: the run's final round, "
                   f"{last.index + 1}, drafted nothing and was a plain target step.")


def round_summary(rnd: Round) -> str:
    """One plain sentence about a round (no model text): counts, outcome, timings."""
    n = rnd.n_drafted
    what = {"correction": "the target corrected the first rejected token",
            "bonus": "all accepted, the target added a bonus token",
            "plain": "no draft: a plain target step"}[rnd.next_kind]
    if rnd.ended_in_draft:
        what = "an accepted end-of-sequence draft token ended the output"
    if rnd.tokens_verified == 0:
        return (f"Round {rnd.index + 1}: {n} drafted, {len(rnd.emitted_ids)} emitted — no target pass: the "
                f"prompt's prefill pass already gave p for this token.")
    fed = f"{rnd.tokens_verified} token{'' if rnd.tokens_verified == 1 else 's'} in the target pass"
    if rnd.prefill_tokens:
        fed += f", {rnd.prefill_tokens} of them the prompt: this pass was also the prefill"
    elif n and rnd.tokens_verified == n:
        fed += ": only the draft tokens, since the prefill pass already gave p for the first one"
    return (f"Round {rnd.index + 1}: {n} drafted, {rnd.n_accepted} accepted, {len(rnd.emitted_ids)} "
            f"emitted — {what}. Draft {rnd.draft_ms:.1f} ms, verify {rnd.verify_ms:.1f} ms ({fed}).")


def round_rows(rnd: Round, greedy: bool = False, gumbel: bool = False) -> list[dict]:
    """Table rows, one per draft position: token, q(x), p(x), the acceptance test, verdict.

    Sampling: ``min(1, p/q)`` (the trace's ``accept_prob``) and the uniform draw u, as 4-decimal text,
    "—" where the position was not evaluated (after the first rejection). Greedy: no u (nothing is
    drawn); "argmax of p?" says whether the draft token is the target's top token ("—" after the first
    rejection). The drafter-invariant rule (``gumbel``): no u either; "target's Gumbel pick?" says whether the draft
    token is argmax(log p + g) at its position.
    """
    def num(x: float | None) -> str:
        return "—" if x is None else f"{x:.4f}"

    rows = []
    for i, d in enumerate(rnd.drafted):
        row = {"position": i + 1, "token": visible(d.text), "id": d.token_id, "q(x)": d.q, "p(x)": d.p}
        if greedy or gumbel:
            row["argmax of p?" if greedy else "target's Gumbel pick?"] = (
                "—" if d.accept_prob is None else ("yes" if d.accept_prob >= 1 else "no"))
        else:
            row["min(1, p/q)"] = num(d.accept_prob)
            row["u"] = num(d.u)
        row["verdict"] = d.verdict
        rows.append(row)
    return rows


def history_rows(rounds: list[Round]) -> list[dict]:
    """One row per round: drafted, accepted, emitted, the target token's kind, draft / verify ms."""
    rows = [{"round": r.index + 1, "drafted": r.n_drafted, "accepted": r.n_accepted,
             "emitted": len(r.emitted_ids), "target token": r.next_kind,
             "tokens in target pass": r.tokens_verified,
             "draft ms": r.draft_ms, "verify ms": r.verify_ms} for r in rounds]
    if any(getattr(r, "choice", None) is not None for r in rounds):  # an adaptive length: its choice and gain
        for row, r in zip(rows, rounds):
            c = r.choice
            row["drafted by"] = (c.source if c.k else "— (plain step)") if c is not None else "—"
            row["expected ×"] = round(c.expected_speedup, 3) if c is not None else None
    return rows


def chart_labels(tops: list[TopToken]) -> list[str]:
    """Category labels for a top-token bar chart: visible text (leading and trailing spaces as ␣, which an
    axis would trim), HTML-escaped for plotly, made unique by appending the id where two tokens look the
    same."""
    def label(text: str) -> str:
        t = visible(text)
        # a chart axis trims spaces: "↵", " ↵" and "↵ " (or "the" and " the") would look alike
        core = t.strip(" ")
        lead, trail = len(t) - len(t.lstrip(" ")), len(t) - len(t.rstrip(" "))
        return "␣" * lead + core + "␣" * trail if core else t

    labels = [label(t.text) for t in tops]
    seen: dict[str, int] = {}
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
    return [html.escape(lab if seen[lab] == 1 else f"{lab} #{t.id}") for lab, t in zip(labels, tops)]


def focus_position(rnd: Round) -> int:
    """The draft position (0-based) to open first: the rejected one, else the last one (0 if none)."""
    for i, d in enumerate(rnd.drafted):
        if d.verdict == "rejected":
            return i
    return max(len(rnd.drafted) - 1, 0)


def default_preset(draft_kind: str) -> str:
    """The live page's default prompt preset for its default draft kind: the code edit for prompt lookup
    (its answer copies the quoted code), the chat question for a trained draft, which predicts free text
    (measured on the embedded target with the shipped head: about 1.0× plain on the code edit, 1.3–1.4× on
    chat prompts; assets/smollm2-head/README.md)."""
    return "code" if draft_kind == "ngram" else "chat"


def default_draft_kind(spec: str | None = None) -> str:
    """The live page's draft kind for a draft spec (default: ``engine.decoding.models.default_draft_spec()``):
    "head" (the trained draft head), "draft" (the trained draft model) or "ngram" (prompt lookup)."""
    spec = default_draft_spec() if spec is None else spec
    return {EMBEDDED_HEAD: "head", EMBEDDED_DRAFT: "draft"}.get(spec, "ngram")


def room_lines(stats, as_of: str | None = None, invariance=None) -> dict:
    """The Live page's room panel from ``engine.decoding.scheduler.RoomStats``: ``metrics`` as (label, value,
    help) and a ``caption`` (how many readers the last target pass served; the operator's drafting limit; with
    ``as_of``, a clock time such as "21:52:03", when the numbers were read: the panel is drawn when the page runs,
    so a page that finished while others decoded keeps that moment's numbers until its next click; the time says so;
    whether the room drafts at the last pass's number of readers and what it measured, ``draft_policy.BandRates``;
    what the room promises each reader's text, from ``invariance``: the machine's self-check
    (``engine.decoding.invariance.InvarianceCheck``), ``CHECKING`` while it runs, None to say nothing)."""
    n = _or_dash
    metrics = [
        ("Readers decoding", f"{stats.readers_now}",
         "Readers whose round is waiting or running in this model's room now, one per reader who pressed Step or "
         "Run and has not got the round yet (this server, all browser sessions): 0 once every round is done, "
         "however many pages are open."),
        ("Rows per pass", n(stats.rows_per_pass, ".1f"),
         f"Mean readers served by one target pass over the last {int(ROOM_WINDOW_S)} s: every reader's round "
         f"is verified in one shared pass (at most {stats.max_rows} rows a pass; more readers take turns)."),
        ("Room tokens/s", n(stats.tokens_per_s, ".1f"),
         f"Tokens emitted for all readers ÷ the room's busy time over the last {int(ROOM_WINDOW_S)} s."),
    ]
    last = stats.last_pass_rows
    caption = ("No target pass has run in this room yet." if not stats.passes else
               f"The last target pass served {last} reader{'s' if last != 1 else ''}.")
    if stats.no_draft_above is not None:
        caption += (f" Operator setting: drafting is off in passes of more than {stats.no_draft_above} "
                    f"reader{'s' if stats.no_draft_above != 1 else ''} (SPEEDUP_LAB_NO_DRAFT_ABOVE), as serving "
                    "engines do under load; sampled texts then differ from a run alone (same distribution), except "
                    "under the drafter-invariant sampling rule.")
    if invariance is not None:
        caption += " " + invariance_line(None if invariance == CHECKING else invariance)
    drafting = getattr(stats, "drafting", None)
    if drafting is not None and drafting.band > 1:
        caption += " " + drafting.line()
        if not drafting.drafts:
            caption += (" Greedy texts are the same either way; a sampled text from a pass without drafting is another "
                        "sample of the same distribution, not the text alone (under the drafter-invariant sampling "
                        "rule it is the text alone).")
    if as_of:
        caption += f" As of {as_of} (server clock); any click updates these numbers."
    return {"metrics": metrics, "caption": caption}


CHECKING = "checking"
"""``room_lines``' invariance while the self-check runs (``engine.decoding.invariance.check_in_background``)."""


def invariance_line(check) -> str:
    """One sentence: what a reader's text in the room is, compared with the same settings alone on this machine
    (``engine.decoding.invariance``)."""
    if check is None:
        return ("Checking on this machine that a shared pass gives each reader the bits of its lone pass "
                "(a few seconds, once per server)…")
    if check.holds:
        return f"Each reader's text in the room: {check.label()}."
    return f"Each reader's text in the room: {check.label()}; a token can then differ from alone only at a near tie."


def _or_dash(x: float | None, fmt: str) -> str:
    """A room number as the panel and the progress line show it: formatted, or "—" when there is none yet."""
    return "—" if x is None else format(x, fmt)


def room_progress_line(stats) -> str:
    """The room panel's three numbers in one line, for the progress bar's text while other readers decode: one
    element redrawn instead of the panel's ten (each element a page redraws is a message the reader's
    browser renders; 16 pages rendering the panel's elements every few seconds took a core of a 2-core server
    that also ran the browsers)."""
    n = _or_dash
    return (f"room: {stats.readers_now} reader{'s' if stats.readers_now != 1 else ''} now, "
            f"{n(stats.rows_per_pass, '.1f')} rows per pass, {n(stats.tokens_per_s, '.1f')} tokens/s")


def round_link_value(raw: str | None, hi: int) -> int | None:
    """The round a link's ``lv_round`` asks the Live page to open.

    Args:
        raw: the query parameter's text (None: not in the link). hi: the most rounds a run can have (each round adds
            at least one token, so the page's largest max new tokens); a larger N is read as ``hi``.

    Returns:
        N ≥ 1: open round N; 0: nothing to open (absent, or 0); None: unreadable (not a whole number, negative).
    """
    if raw is None:
        return 0
    try:
        n = int(str(raw).strip())
    except ValueError:
        return None
    if n < 0:
        return None
    return min(n, hi)


def opened_round_message(asked: int, reached: int, finished: bool, stop_reason: str = "") -> str:
    """What the Live page says over a round opened by a link (plain Markdown, no model text).

    Args:
        asked: the round the link asked for (≥ 1). reached: the rounds the run has now. finished: the run has ended.
        stop_reason: why it ended (``SpeculativeDecoder.stop_reason``), when it did.
    """
    if reached >= asked:
        return (f"Round {asked}, opened by the link: the run stepped {'once' if asked == 1 else f'{asked} times'} "
                "from the prompt, as pressing **Step one round** would.")
    why = f" ({stop_reason})" if stop_reason else ""
    if not reached:
        return f"The link asked for round {asked}; the run was stopped before its first round."
    if finished:
        return (f"The link asked for round {asked}, but this run ended{why} after round {reached}: round {reached}, "
                "its last, is shown.")
    return f"The link asked for round {asked}; the run was stopped after round {reached}, shown here."


def finished_line(n_tokens: int, rounds_text: str, stop_reason: str, stats, comparison=None,
                  plain: bool = False, spread: float | None = None, noisy: bool = False) -> str:
    """The Live page's line when a run ends, under the round so it stays on a projector's first screen: the tokens,
    the rounds, tokens per round and α̂ (``engine.decoding.trace.RunStats``), and once **Run baseline** has timed the
    run against plain decoding (``engine.decoding.measure.BaselineComparison``) the measured speedup and whether the
    texts are identical (plain Markdown, no model text).

    A measured speedup is called unsure when the timed runs of one kind differed by more than the A/B's warning
    (``noisy``, with their slowest ÷ fastest ``spread``: ``SpeedupAB.noisy``), or when it exceeds the run's tokens per
    round: a round costs at least one target pass, at least a plain step, so only noise puts the speedup above it.

    Args:
        n_tokens: tokens generated. rounds_text: "40 rounds". stop_reason: why it ended. stats: this run's
        ``RunStats``. comparison: the baseline comparison, or None before Run baseline. plain: a run without a draft.
        spread, noisy: the A/B's ``spread`` and ``noisy``.
    """
    line = f"Finished ({stop_reason}): {n_tokens} tokens in {rounds_text}"
    if not plain and stats.rounds and stats.tokens_per_round is not None:
        line += f", **{stats.tokens_per_round:.2f}** tokens per round"
        if stats.acceptance_rate is not None:
            line += f" (α̂ {stats.acceptance_rate:.2f})"
    line += "."
    if plain:
        return line
    if comparison is None or comparison.speedup is None:
        return line + " **Run baseline** times it against plain decoding."
    same = "identical texts" if comparison.identical else "different texts (sampling draws differ)"
    line += f" Measured speedup **{comparison.speedup:.2f}×** against plain decoding, {same}."
    why = unsure_reasons(comparison.speedup, stats.tokens_per_round, spread)  # one rule with the run's record
    if noisy and not (spread is not None and spread > SPREAD_WARN):
        why.insert(0, "the timed runs of one kind differed by more than usual")
    if why:
        line += (" **Unsure**: " + "; ".join(why) + ". The machine was busy: run the baseline again with nothing "
                 "else running.")
    return line


def finished_unsure(line: str) -> bool:
    """Whether ``finished_line`` called the measured speedup unsure (the page then draws it as a warning)."""
    return "**Unsure**" in line


def choice_line(rnd: Round) -> str | None:
    """The round's draft-length choice and the expected gain it came from, as one markdown line (None for a fixed γ
    or a tree): ``engine.decoding.draft_length.LengthChoice.line``, plus the drafters a combined draft compared."""
    c = getattr(rnd, "choice", None)
    if c is None:
        return None
    line = c.line()
    if c.alternatives:
        line += " Expected at their running acceptance: " + ", ".join(
            f"{name} {s:.2f}×" for name, s in c.alternatives.items()) + f" → {c.source} drafted."
    return "**Draft length:** " + line  # engine text only (no model tokens): nothing to escape


def choice_rows(rnd: Round) -> list[dict]:
    """Per draft position of an adaptive round: which draft drafted it, its confidence (max q before the draw) and
    the acceptance chance the rule estimated from it (empty for a fixed γ)."""
    c = getattr(rnd, "choice", None)
    if c is None:
        return []
    return [{"position": i + 1, "drafted by": c.source,
             "confidence (max q)": c.confidence[i] if i < len(c.confidence) else None,
             "â (rule's estimate)": c.acceptance[i] if i < len(c.acceptance) else None,
             "drafted?": "yes" if i < c.k else "no: did not pay"} for i in range(max(c.k, len(c.acceptance)))]
