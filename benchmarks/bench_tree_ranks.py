"""Where the target's next token sits among the shipped draft head's candidates, by tree depth: the numbers the
What-if page's token-tree model needs (α_d, σ; ``engine.explain.analytic.fit_tree_acceptance``).

For each held-out prompt the target decodes greedily (fp32). Then, at every position of that answer, the head
drafts along the target's own path (teacher forcing: the path to a depth-d node is accepted exactly when it is
the target's path), and at each depth d ≤ D the rank of the target's token among the head's candidates is
counted (rank 1 = the head's argmax). That is the acceptance of a node of rank r at depth d given its parent
was accepted, under greedy verification. Counts only, no timing.

    .venv/bin/python benchmarks/bench_tree_ranks.py --prompts 8 --max-new-tokens 64 --depth 4 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.decoding.models import EMBEDDED_HEAD, load_model  # noqa: E402
from engine.decoding.drafts import make_proposer  # noqa: E402
from engine.decoding.speculative import encode_prompt, generate  # noqa: E402
from engine.explain.analytic import fit_tree_acceptance  # noqa: E402
from engine.training.draft_data import build_prompts  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "tree_ranks"


@torch.inference_mode()
def rank_counts(target, head, seq: list[int], first: int, depth: int, ranks: int) -> tuple[list[list[int]], list[int]]:
    """hits[d][r] and trials[d] over contexts seq[:n], n = first..len(seq) − depth (see the module docstring)."""
    from transformers import DynamicCache

    ids = torch.tensor([seq])
    h = target.model.get_decoder()(input_ids=ids).last_hidden_state  # [1, L, H], what the head reads
    vocab = {int(t): j for j, t in enumerate(head.vocab_ids.tolist())}
    hits = [[0] * ranks for _ in range(depth)]
    trials = [0] * depth
    cache = DynamicCache()
    out = None
    for j in range(len(seq) - 1):  # pair j = (h_j, x_{j+1}) → ĥ_{j+1}, which predicts x_{j+2}
        n = j + 2  # the context seq[:n] after this pair; its next token is seq[n]
        out = head(ids[:, j + 1:j + 2], h[:, j:j + 1], position_ids=torch.tensor([[j]]), cache=cache)
        if n < first or n + depth > len(seq):
            continue
        c = copy.deepcopy(cache)
        last = out
        for d in range(depth):
            true = seq[n + d]
            logits = head.logits(last[0, 0]).float()
            trials[d] += 1
            k = vocab.get(true)
            if k is not None:
                r = int((logits > logits[k]).sum())  # 0-based rank
                if r < ranks:
                    hits[d][r] += 1
            if d < depth - 1:  # the path goes on with the target's token
                last = head(torch.tensor([[true]]), last, position_ids=torch.tensor([[n - 1 + d]]), cache=c)
    return hits, trials


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model("embedded", device="cpu")
    head = make_proposer(EMBEDDED_HEAD, target).head
    hits = [[0] * args.ranks for _ in range(args.depth)]
    trials = [0] * args.depth
    t0 = time.time()
    for p in build_prompts(args.prompts, "heldout", seed=0):
        ids = encode_prompt(target.tokenizer, p["prompt"])
        res = generate(target, None, ids, max_new_tokens=args.max_new_tokens)
        h, n = rank_counts(target, head, ids + res.token_ids, len(ids), args.depth, args.ranks)
        for d in range(args.depth):
            trials[d] += n[d]
            hits[d] = [a + b for a, b in zip(hits[d], h[d])]
    fit = fit_tree_acceptance(hits, trials)
    cmd = "benchmarks/bench_tree_ranks.py " + " ".join(sys.argv[1:])
    data = {"hits": hits, "trials": trials, "alphas": fit.alphas, "sigma": fit.sigma, "decay": fit.decay,
            "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "command": cmd, "prompts": args.prompts,
                     "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                     "seconds": round(time.time() - t0, 1)}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    lines = [f"# Draft head: rank of the target's token among the head's candidates, by depth ({data['meta']['date']})",
             "", f"{args.prompts} held-out prompts × ≤ {args.max_new_tokens} greedy tokens, embedded target, teacher "
             f"forcing along the target's path. `{cmd}`", "",
             "| depth | positions | " + " | ".join(f"rank {r + 1}" for r in range(args.ranks)) + " | α̂_d (rank 1) |",
             "|---|---|" + "---|" * args.ranks + "---|"]
    for d in range(args.depth):
        lines.append(f"| {d + 1} | {trials[d]} | " + " | ".join(f"{x / trials[d]:.3f}" for x in hits[d])
                     + f" | {fit.alphas[d]:.3f} |")
    lines += ["", f"Fitted (engine.explain.analytic.fit_tree_acceptance): σ̂ = {fit.sigma:.3f} (pooled over depths "
              f"and ranks 2–{args.ranks}), depth decay δ̂ = {fit.decay if fit.decay is None else round(fit.decay, 3)}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
