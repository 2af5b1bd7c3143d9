"""The Race page's races on the embedded model, measured as the page measures them (``engine.decoding.race.run_race``:
a warm-up of both kinds, then A B B A A B, each run to its end with nothing drawn, the lanes stepping through the
embedded target's room as the page's do), with how long each part took.

Races (default): the page's default (the trained draft head, its default γ on this machine, the chat question,
greedy), prompt lookup on the code edit (greedy), and the draft head sampled (T = 0.8, seed 1). Each is raced
``--repeat`` times in one process (the first pays the process's one-time costs, as a server's first race does).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_race.py [--max-new-tokens 64] [--repeat 2]
        [--out race_amd-epyc] [--ship]

Writes benchmarks/results/<out>.json and <out>.md; ``--ship`` also writes the default race's last run to
assets/race_recorded.json, the recorded race the page plays when the server is busy or still loading.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.decoders import DRAFT_KINDS, DRAFT_SHORT, draft_spec, make_decoder  # noqa: E402
from app.race_view import decoder_kwargs, race_settings  # noqa: E402
from benchmarks.machine import machine_line, machine_meta  # noqa: E402
from engine.decoding.compute import cpu_model  # noqa: E402
from engine.decoding.models import load_model  # noqa: E402
from engine.decoding.race import measured_speedup, replayed_speedup, run_race, save_race  # noqa: E402
from engine.decoding.scheduler import room_for  # noqa: E402
from engine.explain.analytic import default_gamma_here  # noqa: E402
from engine.explain.presets import preset_text  # noqa: E402

RACES = [("head", "chat", 0.0, 0, "adaptive"), ("ngram", "code", 0.0, 0, "adaptive"), ("head", "chat", 0.8, 1, "adaptive")]
SHIP = ("head", "chat", 0.0, 0, "fixed")
"""The shipped recorded race: the default race at a fixed γ, so a reader's Live page rebuilds its rounds on any machine
(the adaptive length chooses by this machine's measured costs, which another machine measures differently)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default="race_amd-epyc")
    ap.add_argument("--ship", action="store_true")
    ap.add_argument("--ship-only", action="store_true", help="race only the shipped race and write it (no results)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    # loaded in a thread that then ends, as the app's script threads do: a main thread that had computed would keep
    # its OpenMP team for good, and two teams on 2 cores slow every pass of the room's worker
    # (``engine.decoding.scheduler.IDLE_EXIT_S``)
    box: dict = {}

    def load() -> None:
        box["target"] = load_model("embedded", device="cpu")
        for kind in {kind for kind, *_ in RACES}:  # each race's draft loaded (and cached) here too
            make_decoder(box["target"], "warm", kind, max_new_tokens=1)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    target = box["target"]
    load_s = time.perf_counter() - t0
    meta = machine_meta(target)
    machine = (f"{cpu_model()} ({os.cpu_count()} cores, {target.compute.threads if target.compute else '?'} threads, "
               f"compute path {meta['compute']})")
    rows = []
    races = [SHIP] if args.ship_only else RACES + ([SHIP] if args.ship else [])
    shipped = None
    for kind, preset, temp, seed, length in races:
        gamma = default_gamma_here(draft_spec(kind))[0]
        prompt = preset_text(preset)
        # every setting the page records (its arithmetic and the head's draft length included), and the lanes built
        # from them as the page builds its own (app.race_view.decoder_kwargs)
        settings = race_settings(target="embedded", prompt=prompt, preset=preset, draft=kind, early_exit_k=8,
                                 draft_model="", gamma=gamma, tree=0, temperature=temp, seed=seed,
                                 max_new_tokens=args.max_new_tokens, arithmetic=target.compute.arithmetic,
                                 length=length)
        kw = decoder_kwargs(settings)

        room = room_for(target)

        def make(baseline: bool):
            return lambda: room.bind(make_decoder(target, **kw, baseline=baseline))

        for rep in range(args.repeat):
            marks = []
            t = time.perf_counter()
            race = run_race(make(False), make(True), DRAFT_SHORT[kind] + f", γ = {gamma}",
                            settings=settings, machine=machine, greedy=temp == 0,
                            on_progress=lambda d, n, what: marks.append((what, time.perf_counter())),
                            busy=room.readers, pass_rows=lambda: room.stats().last_pass_rows)
            total = time.perf_counter() - t
            marks.append(("end", time.perf_counter()))
            parts = [f"{w} {(b - a):.2f}" for (w, a), (_, b) in zip(marks, marks[1:])]
            rows.append({"draft": kind, "preset": preset, "temperature": temp, "seed": seed, "gamma": gamma,
                         "repeat": rep, "race_s": total, "parts_s": parts, "speedup": race.speedup,
                         "ab_speedup": race.ab_speedup, "replayed_speedup": replayed_speedup(race),
                         "decoders_speedup": measured_speedup(race), "identical": race.identical,
                         "first_difference": race.first_difference, "spread": race.spread,
                         "spec": {"tokens": race.spec.new_tokens, "wall_ms": race.spec.wall_ms,
                                  "bars_ms": race.spec.pass_ms, "ttft_ms": race.spec.ttft_ms,
                                  "passes": race.spec.target_passes, "tokens_per_pass": race.spec.tokens_per_pass},
                         "plain": {"tokens": race.plain.new_tokens, "wall_ms": race.plain.wall_ms,
                                   "bars_ms": race.plain.pass_ms, "ttft_ms": race.plain.ttft_ms,
                                   "passes": race.plain.target_passes}})
            print(json.dumps(rows[-1]), flush=True)
            if (kind, preset, temp, seed, length) == SHIP:
                shipped = race
    if args.ship_only:
        save_race(shipped, ROOT / "assets" / "race_recorded.json")
        print("wrote assets/race_recorded.json")
        return
    meta["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.out}.json").write_text(json.dumps({"meta": {**meta, "model_load_s": load_s,
                                                               "max_new_tokens": args.max_new_tokens},
                                                      "races": rows}, indent=1) + "\n")
    lines = [f"# The race: plain vs speculative (`benchmarks/bench_race.py`, {time.strftime('%Y-%m-%d')})", "",
             machine_line(meta), "",
             f"{args.max_new_tokens} new tokens; each race: a warm-up of {3} rounds of each kind, then A B B A A B "
             "(A speculative, B plain), through the embedded target's room, each kind's median run replayed. Race s: from the call to "
             "the record (what the page waits for after a click, the model already loaded).", "",
             "| draft | prompt | T | γ | race s | parts (s) | speedup (replayed lanes) | A/B medians | identical | "
             "tokens/pass | bars ÷ wall (spec, plain) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['draft']} | {r['preset']} | {r['temperature']:g} | {r['gamma']} | {r['race_s']:.2f} | "
                     f"{'; '.join(r['parts_s'])} | {r['speedup']:.2f}× | {r['ab_speedup']:.2f}× | "
                     f"{'yes' if r['identical'] else 'no, from token ' + str(r['first_difference'] + 1)} | "
                     f"{r['spec']['tokens_per_pass']:.2f} | {r['spec']['bars_ms'] / r['spec']['wall_ms']:.3f}, "
                     f"{r['plain']['bars_ms'] / r['plain']['wall_ms']:.3f} |")
    (out / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    if args.ship and shipped is not None:
        save_race(shipped, ROOT / "assets" / "race_recorded.json")
        print("wrote assets/race_recorded.json")


if __name__ == "__main__":
    main()
