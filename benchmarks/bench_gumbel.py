"""Drafter-invariant (Gumbel-max) sampling against the standard rule on the embedded model: acceptance on held-out
prompts, whether speculative texts equal plain decoding's, and sampled races at T 0.8 under both rules.

1. Acceptance: for each of ``--prompts`` held-out prompts (``engine.training.draft_data.build_prompts(n, "heldout")``)
   and each rule, the draft head at γ ``--gamma`` and T ``--temperature`` (seed = prompt index): α̂ = accepted ÷
   judged over all prompts, tokens per round, and, under the "gumbel" rule, whether the speculative text equals plain
   decoding's with the same seed (it must, every prompt). The p and q rows of every judged draft position of the
   standard runs are kept (``--positions`` of them, spread over the prompts), and for each the two rules' one-token
   acceptance is computed on those real rows: Σ min(p, q) (standard) and the Gumbel coupling's agreement
   P(argmax(log p + g) = argmax(log q + g)), estimated over ``--noise-rows`` noise rows (``sampling.gumbel_agreement``).
2. Races: ``engine.decoding.race.run_race`` (a warm-up, then A B B A A B) of the head on the chat preset and prompt
   lookup on the code preset at T ``--temperature``, each under both rules at the same γ, ``--repeat`` times.

    .venv/bin/python benchmarks/bench_gumbel.py [--prompts 12] [--max-new-tokens 96] [--gamma 2] [--repeat 2]

Writes benchmarks/results/gumbel_<machine>.json and .md (``--out NAME`` for another name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from app.decoders import DRAFT_SHORT, make_decoder  # noqa: E402
from benchmarks.machine import machine_line, machine_meta, machine_slug  # noqa: E402
from engine.decoding import speculative  # noqa: E402
from engine.decoding.compute import cpu_model  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.models import load_model  # noqa: E402
from engine.decoding.race import run_race  # noqa: E402
from engine.decoding.sampling import SamplingConfig, gumbel_agreement  # noqa: E402
from engine.decoding.scheduler import room_for  # noqa: E402
from engine.decoding.speculative import encode_prompt, generate  # noqa: E402
from engine.explain.presets import preset_text  # noqa: E402
from engine.training.draft_data import build_prompts  # noqa: E402

RULES = ("standard", "gumbel")


def acceptance(target, prompts: list[str], gamma: int, temp: float, max_new: int, positions: int,
               noise_rows: int) -> dict:
    rows: dict = {r: {"accepted": 0, "judged": 0, "drafted": 0, "rounds": 0, "tokens": 0, "ms": 0.0} for r in RULES}
    rows["plain_ms"] = 0.0
    identical, captured = [], []
    orig = speculative.verify_chain

    def capture(draft, q, p, cfg, generator, position, bonus_cdf=None):
        v = orig(draft, q, p, cfg, generator, position, bonus_cdf)
        if not cfg.gumbel:
            for i in range(min(len(draft), v.n_accepted + 1)):
                captured.append((p[i].double().clone(), q[i].double().clone()))
        return v

    for n, prompt in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, prompt)
        for rule in RULES:
            cfg = SamplingConfig(temperature=temp, rule=rule)
            speculative.verify_chain = capture
            try:
                res = generate(target, make_proposer("embedded-head", target), ids, gamma=gamma, sampling=cfg, seed=n,
                               max_new_tokens=max_new)
            finally:
                speculative.verify_chain = orig
            s, r = res.stats, rows[rule]
            r["accepted"] += s.accepted
            r["judged"] += s.judged
            r["drafted"] += s.drafted
            r["rounds"] += s.rounds
            r["tokens"] += s.new_tokens
            r["ms"] += s.total_ms
            if rule == "gumbel":
                plain = generate(target, None, ids, sampling=cfg, seed=n, max_new_tokens=max_new)
                rows["plain_ms"] += plain.stats.total_ms
                identical.append(plain.token_ids == res.token_ids)
        print(f"prompt {n + 1}/{len(prompts)}: standard α̂ {rows['standard']['accepted'] / max(rows['standard']['judged'], 1):.3f}, "
              f"gumbel α̂ {rows['gumbel']['accepted'] / max(rows['gumbel']['judged'], 1):.3f}", flush=True)
    for rule in RULES:
        r = rows[rule]
        r["alpha"] = r["accepted"] / r["judged"] if r["judged"] else None
        r["tokens_per_round"] = r["tokens"] / r["rounds"] if r["rounds"] else None
    step = max(1, len(captured) // positions) if captured else 1
    chosen = captured[::step][:positions]
    mins, agrees = [], []
    for j, (p, q) in enumerate(chosen):
        mins.append(float(torch.minimum(p, q).sum()))
        agrees.append(gumbel_agreement(p, q, samples=noise_rows, seed=1000 + j))
    tvs = [1 - m for m in mins]
    return {"rules": {r: rows[r] for r in RULES}, "identical_to_plain": identical,
            "positions": len(chosen), "noise_rows": noise_rows,
            "sum_min_pq_mean": statistics.fmean(mins) if mins else None,
            "gumbel_agreement_mean": statistics.fmean(agrees) if agrees else None,
            "paper_bound_mean": statistics.fmean((1 - t) / (1 + t) for t in tvs) if tvs else None}


def races(target, temp: float, gamma: int, max_new: int, repeat: int, machine: str) -> list[dict]:
    out = []
    for kind, preset, g in (("head", "chat", gamma), ("ngram", "code", 3)):
        prompt = preset_text(preset)
        for rep in range(repeat):
            for rule in RULES:
                room = room_for(target)
                settings = {"prompt": prompt, "preset": preset, "draft": kind, "gamma": g, "tree": 0,
                            "temperature": temp, "seed": 1, "max_new_tokens": max_new, "rule": rule}

                def make(baseline: bool, rule=rule, kind=kind, g=g, prompt=prompt, room=room):
                    return lambda: room.bind(make_decoder(target, prompt, kind, baseline=baseline, gamma=g,
                                                          temperature=temp, seed=1, max_new_tokens=max_new, rule=rule))

                t = time.perf_counter()
                race = run_race(make(False), make(True), DRAFT_SHORT[kind] + f", γ = {g}", settings=settings,
                                machine=machine, greedy=False, busy=room.readers,
                                pass_rows=lambda room=room: room.stats().last_pass_rows)
                row = {"draft": kind, "preset": preset, "gamma": g, "rule": rule, "repeat": rep,
                       "speedup": race.speedup, "ab_speedup": race.ab_speedup, "identical": race.identical,
                       "first_difference": race.first_difference, "spread": race.spread,
                       "spec_tokens": race.spec.new_tokens, "plain_tokens": race.plain.new_tokens,
                       "tokens_per_pass": race.spec.tokens_per_pass, "race_s": time.perf_counter() - t}
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def markdown(res: dict, args) -> str:
    a = res["acceptance"]
    st, gu = a["rules"]["standard"], a["rules"]["gumbel"]
    lines = [f"# Drafter-invariant (Gumbel-max) sampling against the standard rule", "",
             machine_line(res["meta"]), "",
             f"Command: `.venv/bin/python benchmarks/bench_gumbel.py --prompts {args.prompts} --max-new-tokens "
             f"{args.max_new_tokens} --gamma {args.gamma} --temperature {args.temperature} --repeat {args.repeat}` "
             f"({res['meta']['date']}).", "",
             f"## Acceptance: the draft head at γ {args.gamma}, T {args.temperature}, {args.prompts} held-out prompts "
             f"× ≤ {args.max_new_tokens} new tokens (seed = prompt index)", "",
             "| rule | α̂ (accepted ÷ judged) | judged | tokens per round | speculative ms (sum) |",
             "|---|---|---|---|---|",
             f"| standard (min(1, p/q), residual draws) | {st['alpha']:.3f} | {st['judged']} | "
             f"{st['tokens_per_round']:.2f} | {st['ms']:.0f} |",
             f"| drafter-invariant (Gumbel-max, same noise) | {gu['alpha']:.3f} | {gu['judged']} | "
             f"{gu['tokens_per_round']:.2f} | {gu['ms']:.0f} |", "",
             f"Speculative text equal to plain decoding's (same seed, drafter-invariant rule): "
             f"**{sum(a['identical_to_plain'])} of {len(a['identical_to_plain'])}** prompts.", "",
             f"On {a['positions']} judged draft positions of the standard runs (the real p and q rows), one token's "
             f"acceptance: Σ min(p, q) = **{a['sum_min_pq_mean']:.3f}** (the standard rule, optimal), the Gumbel "
             f"coupling's agreement = **{a['gumbel_agreement_mean']:.3f}** ({a['noise_rows']} noise rows a position), "
             f"the paper's bound (1 − TV)/(1 + TV) = {a['paper_bound_mean']:.3f} (means over the positions).", "",
             f"## Sampled races at T {args.temperature} (`engine.decoding.race.run_race`: warm-up, then A B B A A B)",
             "", "| draft | preset | γ | rule | speedup (lanes) | speedup (decoders) | texts | tokens per pass | spread |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["races"]:
        same = "IDENTICAL" if r["identical"] else f"differ from token {(r['first_difference'] or 0) + 1}"
        lines.append(f"| {r['draft']} | {r['preset']} | {r['gamma']} | {r['rule']} | {r['speedup']:.2f}× | "
                     f"{(r['ab_speedup'] or 0):.2f}× | {same} | {r['tokens_per_pass']:.2f} | {r['spread']:.2f} |")
    lines += ["", "Medians by draft and rule (speedup on the lanes' clocks):", ""]
    for kind in ("head", "ngram"):
        for rule in RULES:
            xs = [r["speedup"] for r in res["races"] if r["draft"] == kind and r["rule"] == rule and r["speedup"]]
            if xs:
                lines.append(f"- {kind}, {rule}: {statistics.median(xs):.2f}× ({', '.join(f'{x:.2f}' for x in xs)})")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--positions", type=int, default=120)
    ap.add_argument("--noise-rows", type=int, default=300)
    ap.add_argument("--race-max-new", type=int, default=64)
    ap.add_argument("--skip-races", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    box: dict = {}

    def load() -> None:  # in a thread that ends, as bench_race.py does (no second OpenMP team kept)
        box["target"] = load_model("embedded", device="cpu")
        make_proposer("embedded-head", box["target"])

    th = threading.Thread(target=load)
    th.start()
    th.join()
    target = box["target"]
    meta = machine_meta(target)
    meta["date"] = time.strftime("%Y-%m-%d")
    machine = (f"{cpu_model()} ({os.cpu_count()} cores, {target.compute.threads if target.compute else '?'} threads, "
               f"compute path {meta['compute']})")
    prompts = [p["prompt"] for p in build_prompts(args.prompts, "heldout", seed=0)]
    res = {"meta": meta, "args": vars(args)}
    res["acceptance"] = acceptance(target, prompts, args.gamma, args.temperature, args.max_new_tokens,
                                   args.positions, args.noise_rows)
    res["races"] = [] if args.skip_races else races(target, args.temperature, args.gamma, args.race_max_new,
                                                    args.repeat, machine)
    meta["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    name = args.out or f"gumbel_{machine_slug()}"
    out = ROOT / "benchmarks" / "results"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(res, args))
    print(markdown(res, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
