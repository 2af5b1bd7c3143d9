"""Train Medusa heads (``engine.decoding.medusa``) for the embedded target and choose their static tree.

Run ``python -m engine.training.train_medusa --help``. The pipeline (CPU, progress printed) shares its
data and feature caches with ``engine.training.train_head`` (same ``--work-dir`` layout, same functions):

1. data: the target's own answers to generated prompts (``engine.training.draft_data``; held-out prompts
   come from topics never used in training), cached under ``--work-dir``; every ``train*.pt`` there is
   used. ``--gen-dtype bf16`` generates with a bf16 copy of the target, in batches;
2. features: the target's last hidden state h_t (post final norm) at every position
   (``train_head.compute_features``), cached next to each data file;
3. training (Medusa-1, Cai et al. 2024, §2.2.1: the target frozen): each answer position t (from the last
   prompt position on) is one example; head k (1..K) reads h_t and is scored on the token at t+k+1 with
   cross-entropy against the target's own token there (``--soft-weight`` adds the soft cross-entropy against
   the target's stored top-32 distribution at that position, restricted to the draft vocabulary); the
   heads' losses are weighted λ^k (the paper's λ_k = 0.8^k). AdamW, warm-up then cosine decay over the
   time budget, bf16 autocast; ``--val-fraction`` of the training answers are kept apart and the epoch with
   the best mean top-1 on them is kept (early stopping);
4. held-out accuracy: on the held-out answers generated greedily (where the target's choice at t+k+1 is
   the token its greedy decoding would produce after the k tokens before it), a_k(r) = the fraction of
   positions where head k's rank-r candidate is the target's choice (``rank_accuracy``), and the
   empirical acceptance of each tree path (all its candidates right at once);
5. the static tree (Medusa §2.3.3, ``engine.decoding.medusa.choose_tree``): the N paths of highest
   estimated acceptance Π_j a_j(i_j), N chosen to maximise estimated tokens per unit of pass time with the
   measured verify cost per fed token (``benchmarks/results/verify_cost_amd-epyc.json``);
6. saved (fp16) to ``--out`` (default ``assets/smollm2-medusa``); ``make_proposer("embedded-medusa",
   target)`` loads it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.decoding.medusa import MedusaHeads, best_paths, choose_tree, expected_accepted, save_medusa
from engine.errors import InputError
from engine.training.draft_data import Sample
from engine.training.train_head import cached_training_data, compute_features, draft_vocabulary

ROOT = Path(__file__).resolve().parents[2]
RANKS = 10  # candidates per head whose accuracy is measured (the tree may use ranks below this)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_examples(samples: list[Sample], feats: list[torch.Tensor], n_heads: int, soft: bool = True) -> dict:
    """Flatten answers into per-position examples for the heads.

    Position t of a sample (prompt length P, answer length R, ids x = prompt + answer) is an example when
    t ≥ P − 1 and head 1 has a label (t + 2 ≤ P + R − 1). Head k's label is x[t+k+1] (−1 past the end of the
    answer); its argmax label is the target's greedy choice at t+k+1 (stored top-1 of answer token
    t+k+1−P), its soft label the stored top-k there.

    Returns:
        {"h": [N, H] float16, "token": [N, K] int64, "argmax": [N, K] int64, "top_ids": [N, K, k] int32 and
        "top_logp": [N, K, k] float16 (only with ``soft``), "greedy": [N] bool (the answer was greedy)}.
    """
    hs, tok, arg, tid, tlp, greedy = [], [], [], [], [], []
    for s, h in zip(samples, feats):
        x = torch.cat([s.prompt_ids, s.response_ids]).long()
        P, R = len(s.prompt_ids), len(s.response_ids)
        t = torch.arange(P - 1, P + R - 2)  # t + 2 <= P + R - 1
        if t.numel() == 0:
            continue
        hs.append(h[t])
        lab = torch.full((t.numel(), n_heads), -1, dtype=torch.long)
        am = torch.full((t.numel(), n_heads), -1, dtype=torch.long)
        k_top = s.top_ids.shape[1]
        if soft:
            ti = torch.full((t.numel(), n_heads, k_top), -1, dtype=torch.int32)
            tl = torch.zeros(t.numel(), n_heads, k_top, dtype=torch.float16)
        for k in range(1, n_heads + 1):
            pos = t + k + 1
            ok = pos < P + R
            lab[ok, k - 1] = x[pos[ok]]
            j = pos[ok] - P  # answer index of the labelled token
            am[ok, k - 1] = s.top_ids[j, 0].long()
            if soft:
                ti[ok, k - 1] = s.top_ids[j].to(torch.int32)
                tl[ok, k - 1] = s.top_logp[j].to(torch.float16)
        tok.append(lab)
        arg.append(am)
        if soft:
            tid.append(ti)
            tlp.append(tl)
        greedy.append(torch.full((t.numel(),), s.temperature == 0, dtype=torch.bool))
    out = {"h": torch.cat(hs).to(torch.float16), "token": torch.cat(tok), "argmax": torch.cat(arg),
           "greedy": torch.cat(greedy)}
    if soft:
        out["top_ids"], out["top_logp"] = torch.cat(tid), torch.cat(tlp)
    return out


class _Loss:
    """Σ_k λ^k [CE(head k, token at t+k+1) + soft_weight · soft CE(head k, target's top-k at t+k+1)], each
    over the draft vocabulary (labels outside it are skipped; Medusa §2.2.1 for λ^k)."""

    def __init__(self, heads: MedusaHeads, vocab_size: int, soft_weight: float, decay: float):
        self.heads = heads
        self.full2red = torch.full((vocab_size,), -1, dtype=torch.long)
        self.full2red[heads.vocab_ids.cpu()] = torch.arange(heads.vocab_ids.numel())
        self.soft_weight, self.decay = soft_weight, decay

    def __call__(self, h, token, top_ids=None, top_logp=None):
        logits = self.heads.logits(h).float()  # [K, B, Vd]
        total = logits.sum() * 0
        for k in range(self.heads.n_heads):
            red = self.full2red[token[:, k].clamp(min=0)]
            ok = (token[:, k] >= 0) & (red >= 0)
            if not ok.any():
                continue
            lk = logits[k]
            loss = F.cross_entropy(lk[ok], red[ok])
            if self.soft_weight > 0 and top_ids is not None:
                ids = top_ids[:, k].long()
                r = self.full2red[ids.clamp(min=0)]
                good = (ids >= 0) & (r >= 0)
                w = torch.where(good, top_logp[:, k].float().exp(), torch.zeros_like(top_logp[:, k].float()))
                has = w.sum(-1) > 0
                w = w / w.sum(-1, keepdim=True).clamp(min=1e-9)
                logq = F.log_softmax(lk, -1)
                soft = -(w * logq.gather(-1, r.clamp(min=0))).sum(-1)
                loss = loss + self.soft_weight * soft[has].mean()
            total = total + self.decay ** (k + 1) * loss
        return total


@torch.no_grad()
def rank_accuracy(heads: MedusaHeads, ex: dict, ranks: int = RANKS, greedy_only: bool = True,
                  batch: int = 4096) -> dict:
    """Held-out accuracy of each head by candidate rank.

    Args:
        heads: bound heads.
        ex: ``make_examples`` output.
        ranks: candidates per head measured (its top ``ranks``).
        greedy_only: only positions of greedy answers (there the target's choice at t+k+1 follows its own
            greedy tokens t+1..t+k, the situation of greedy decoding).

    Returns:
        {"acc": [K][ranks] fraction of positions whose rank-r candidate of head k is the target's choice
        (not cumulative; Medusa §2.3.3's a_k^(i)), "top1": [K], "topk": [K] (cumulative over ``ranks``),
        "positions": [K] scored positions per head, "ranks_of_target": [N, K] int (rank of the target's
        choice among each head's top ``ranks``, −1 outside or unscored; for path statistics), "scored":
        [N, K] bool (head k has a label at that position)}.
    """
    sel = ex["greedy"] if greedy_only else torch.ones_like(ex["greedy"])
    h, lab = ex["h"][sel], ex["argmax"][sel]
    vocab = heads.vocab_ids.cpu()
    out_rank = torch.full(lab.shape, -1, dtype=torch.long)
    dev = heads.vocab_ids.device
    dtype = heads.heads[0][0].linear.weight.dtype
    for i in range(0, h.shape[0], batch):
        logits = heads.logits(h[i:i + batch].to(device=dev, dtype=dtype)).float().cpu()  # [K, b, Vd]
        top = vocab[logits.topk(min(ranks, vocab.numel()), dim=-1).indices]  # [K, b, r] target ids
        hit = top == lab[i:i + batch].T[..., None]  # [K, b, r]
        found = hit.any(-1)
        r = torch.where(found, hit.float().argmax(-1), torch.full_like(found, -1, dtype=torch.long))
        out_rank[i:i + batch] = r.T
    scored = lab >= 0
    n = scored.sum(0).clamp(min=1)
    acc = [[round(float(((out_rank[:, k] == r) & scored[:, k]).sum() / n[k]), 4) for r in range(ranks)]
           for k in range(heads.n_heads)]
    return {"acc": acc, "top1": [a[0] for a in acc], "topk": [round(sum(a), 4) for a in acc],
            "positions": [int(x) for x in scored.sum(0)], "ranks_of_target": out_rank, "scored": scored}


def empirical_path_acceptance(ranks_of_target: torch.Tensor, scored: torch.Tensor, paths) -> list[float]:
    """Fraction of held-out positions at which a path is accepted: for every j, head j+1's rank-path[j]
    candidate is the target's choice (``rank_accuracy``'s ranks_of_target [N, K]; positions where the
    deepest head is unscored, ``scored`` [N, K] False, are left out)."""
    out = []
    for p in paths:
        d = len(p)
        r = ranks_of_target[:, :d]
        scored_d = scored[:, d - 1]
        ok = (r == torch.tensor(p)).all(-1)
        out.append(round(float(ok[scored_d].float().mean()) if scored_d.any() else 0.0, 4))
    return out


def train_medusa(heads: MedusaHeads, ex: dict, vocab_size: int, *, minutes: float, lr: float = 1e-3,
                 batch: int = 2048, soft_weight: float = 1.0, decay: float = 0.8, max_steps: int | None = None,
                 seed: int = 0, heldout: dict | None = None, log_every: int = 25, bf16: bool = True,
                 weight_decay: float = 0.0) -> list[dict]:
    """Train ``heads`` in place on ``make_examples`` output (AdamW; 20 warm-up steps, cosine to 5 % over
    the time budget or ``max_steps``). With ``heldout`` (a validation split of the training answers, not the
    held-out prompts), its mean top-1 over the heads is measured after each epoch and the heads end with the
    weights of the best epoch (early stopping: a few thousand answers are soon overfitted).

    Returns:
        log rows {step, minutes, loss} and {step, minutes, val_top1}.
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    loss_fn = _Loss(heads, vocab_size, soft_weight, decay)
    soft = soft_weight > 0 and "top_ids" in ex
    best, best_state = -1.0, None
    heads.train()
    n = ex["h"].shape[0]
    t0, step, log, total = time.perf_counter(), 0, [], minutes * 60
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else torch.enable_grad
    done = False
    while not done:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, batch):
            el = time.perf_counter() - t0
            if el > total or (max_steps is not None and step >= max_steps):
                done = True
                break
            frac = el / total if max_steps is None else step / max_steps
            cur = lr * min(1.0, (step + 1) / 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
            for grp in opt.param_groups:
                grp["lr"] = cur
            b = perm[i:i + batch]
            with ctx():
                loss = loss_fn(ex["h"][b].float(), ex["token"][b],
                               ex["top_ids"][b] if soft else None, ex["top_logp"][b] if soft else None)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % log_every == 0:
                log.append({"step": step, "minutes": round(el / 60, 2), "loss": round(float(loss.detach()), 4)})
                _log(f"[train] step {step} loss {log[-1]['loss']:.3f} lr {cur:.2e} {el / 60:.1f} min")
        if heldout is not None:
            heads.eval()
            ev = rank_accuracy(heads, heldout, greedy_only=False)
            heads.train()
            score = sum(ev["top1"]) / len(ev["top1"])
            log.append({"step": step, "minutes": round((time.perf_counter() - t0) / 60, 2), "val_top1": ev["top1"]})
            _log(f"[eval] after {step} steps: validation top-1 per head {ev['top1']}")
            if score > best:
                best, best_state = score, {k: v.detach().clone() for k, v in heads.state_dict().items()}
                log[-1]["best"] = True
    if best_state is not None:
        heads.load_state_dict(best_state)
    heads.eval()
    return log


def load_pass_cost(path: Path) -> list[float]:
    """Pass cost by tokens fed (× one token) from ``benchmarks/bench_head.py --verify-only``'s JSON.

    Raises:
        InputError: unreadable file.
    """
    try:
        r = json.loads(Path(path).read_text())["ratio_to_one_token"]
        return [float(r[str(m)]) for m in range(1, len(r) + 1)]
    except (OSError, KeyError, ValueError) as e:
        raise InputError(f"Cannot read the verify cost curve {str(path)!r}: {e}") from None


def choose_tree_again(folder: str | Path, pass_cost: list[float], max_tree: int) -> dict:
    """Re-choose the static tree of saved heads for another measured pass-cost curve, without retraining.

    The choice (``engine.decoding.medusa.choose_tree``) needs only the heads' held-out accuracies
    (``head_accuracy`` in ``medusa_config.json``) and the cost of a pass over m tokens; the curve depends on
    the machine, so a tree chosen on one CPU is re-chosen here for another. Rewrites ``medusa_choices`` and
    ``tree`` in ``medusa_config.json`` and, when present, ``tree`` and ``pass_cost`` in ``train_meta.json``.

    Args:
        folder: saved Medusa heads (``save_medusa``).
        pass_cost: pass_cost[m − 1] = a pass over m tokens ÷ a pass over one token.
        max_tree: largest tree considered (nodes).

    Returns:
        ``choose_tree``'s result.

    Raises:
        InputError: no readable config, or heads saved without ``head_accuracy``.
    """
    folder = Path(folder)
    path = folder / "medusa_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"Cannot read the Medusa config {str(path)!r}: {e}") from None
    if not cfg.get("head_accuracy"):
        raise InputError(f"{str(path)!r} has no head_accuracy to choose a tree from.")
    tree = choose_tree(cfg["head_accuracy"], pass_cost, max_tree)
    cfg["medusa_choices"] = tree["medusa_choices"]
    cfg["tree"] = {k: tree[k] for k in ("nodes", "expected_tokens", "pass_cost", "score")}
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    meta_path = folder / "train_meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        meta["tree"], meta["pass_cost"] = tree, list(pass_cost)
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.training.train_medusa", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "assets" / "smollm2-medusa"), help="output folder")
    ap.add_argument("--work-dir", default=str(ROOT / ".cache" / "draft-train"),
                    help="data cache folder (shared with engine.training.train_head)")
    ap.add_argument("--heads", type=int, default=4, help="K, Medusa heads (head k predicts token t+k+1)")
    ap.add_argument("--layers-per-head", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="ids the heads may propose (most frequent)")
    ap.add_argument("--prompts", type=int, default=4000, help="new training prompts to generate from")
    ap.add_argument("--heldout", type=int, default=64, help="held-out prompts (unseen topics)")
    ap.add_argument("--prompt-set", type=int, default=1, choices=[1, 2])
    ap.add_argument("--data-minutes", type=float, default=16.0,
                    help="time budget for new training data (0: only reuse cached train*.pt files)")
    ap.add_argument("--gen-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--gen-batch", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--feature-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--train-minutes", type=float, default=15.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=2048, help="positions per step")
    ap.add_argument("--soft-weight", type=float, default=1.0,
                    help="weight of the soft CE against the target's top-32 (0: hard labels only)")
    ap.add_argument("--val-fraction", type=float, default=0.1,
                    help="training answers kept apart to pick the best epoch (0: no early stopping)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--decay", type=float, default=0.8, help="λ: head k's loss is weighted λ^k (Medusa §2.2.1)")
    ap.add_argument("--train-bf16", action="store_true",
                    help="bf16 autocast while training (fast only on CPUs with AMX / AVX512-BF16; default fp32)")
    ap.add_argument("--max-tree", type=int, default=7, help="largest static tree considered (nodes)")
    ap.add_argument("--verify-cost", default=str(ROOT / "benchmarks" / "results" / "verify_cost_amd-epyc.json"),
                    help="measured pass cost per fed token, for choosing the tree size")
    ap.add_argument("--choose-tree-only", action="store_true",
                    help="only re-choose the static tree of the heads in --out for --verify-cost (no training)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.heads < 1 or args.layers_per_head < 1 or args.draft_vocab < 1:
        ap.error("--heads, --layers-per-head and --draft-vocab must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.decoding.models import load_model

    pass_cost = load_pass_cost(Path(args.verify_cost))
    if args.choose_tree_only:
        tree = choose_tree_again(args.out, pass_cost, args.max_tree)
        _log(f"[tree] {tree['nodes']} nodes {tree['medusa_choices']}: estimated {tree['expected_tokens']} tokens "
             f"per pass at {tree['pass_cost']}× a single-token pass (written to {args.out})")
        return 0
    t_start = time.perf_counter()
    target = load_model("embedded", device="cpu")
    model = target.model
    vocab_size = model.get_output_embeddings().weight.shape[0]
    data = cached_training_data(target, Path(args.work_dir), heldout=args.heldout, prompts=args.prompts,
                                prompt_set=args.prompt_set, data_minutes=args.data_minutes, gen_dtype=args.gen_dtype,
                                gen_batch=args.gen_batch, max_new_tokens=args.max_new_tokens,
                                feature_dtype=args.feature_dtype, seed=args.seed, progress=_log)
    samples, feats, held, files = data["samples"], data["features"], data["heldout"], data["files"]
    data_min = data["data_minutes"]
    t0 = time.perf_counter()
    rng = random.Random(args.seed)
    val_idx = set(rng.sample(range(len(samples)), max(1, int(len(samples) * args.val_fraction)))) \
        if args.val_fraction > 0 and len(samples) > 1 else set()
    train_ex = make_examples([s for i, s in enumerate(samples) if i not in val_idx],
                             [f for i, f in enumerate(feats) if i not in val_idx], args.heads,
                             soft=args.soft_weight > 0)
    val_ex = make_examples([samples[i] for i in sorted(val_idx)], [feats[i] for i in sorted(val_idx)], args.heads,
                           soft=False) if val_idx else None
    held_ex = make_examples(held, compute_features(model, held, torch.float32), args.heads, soft=False)
    feat_min = data["feature_minutes"] + (time.perf_counter() - t0) / 60
    n_tok = sum(len(s.response_ids) for i, s in enumerate(samples) if i not in val_idx)
    _log(f"[data] {len(samples)} training answers ({n_tok} answer tokens, {train_ex['h'].shape[0]} positions) "
         f"from {files} files, {len(held)} held-out; {data_min:.1f} min generating, {feat_min:.1f} min features")

    # 3. train
    vocab = draft_vocabulary(samples, args.draft_vocab, vocab_size)
    heads = MedusaHeads(model.config.hidden_size, args.heads, vocab, args.layers_per_head).bind(model)
    n_params = sum(p.numel() for p in heads.parameters())
    before = rank_accuracy(heads, held_ex)
    _log(f"[train] {args.heads} heads × {args.layers_per_head} block(s), draft vocabulary {len(vocab)}, "
         f"{n_params / 1e6:.2f}M parameters; held-out top-1 before training {before['top1']}")
    t0 = time.perf_counter()
    log = train_medusa(heads, train_ex, vocab_size, minutes=args.train_minutes, lr=args.lr, batch=args.batch,
                       soft_weight=args.soft_weight, decay=args.decay, seed=args.seed, heldout=val_ex,
                       weight_decay=args.weight_decay, bf16=args.train_bf16)
    train_min = (time.perf_counter() - t0) / 60

    # 4. held-out accuracy; 5. the tree
    ev = rank_accuracy(heads, held_ex)
    ev_all = rank_accuracy(heads, held_ex, greedy_only=False)
    tree = choose_tree(ev["acc"], pass_cost, args.max_tree)
    paths16 = best_paths(ev["acc"], 16)
    emp16 = empirical_path_acceptance(ev["ranks_of_target"], ev["scored"], paths16)
    chosen_emp = empirical_path_acceptance(ev["ranks_of_target"], ev["scored"], tree["medusa_choices"])
    acc_meta = {"heldout_greedy": {k: ev[k] for k in ("acc", "top1", "topk", "positions")},
                "heldout_all": {k: ev_all[k] for k in ("top1", "topk", "positions")},
                "before_training_top1": before["top1"]}
    meta = {"target": "embedded", "medusa_choices": tree["medusa_choices"], "head_accuracy": ev["acc"],
            "tree": {k: tree[k] for k in ("nodes", "expected_tokens", "pass_cost", "score")},
            "heldout_top1": ev["top1"], f"heldout_top{RANKS}": ev["topk"]}
    save_medusa(heads, args.out, meta=meta)
    full = {"target": "embedded", "parameters": n_params, "train_answers": len(samples) - len(val_idx),
            "validation_answers": len(val_idx),
            "train_answer_tokens": n_tok, "train_positions": int(train_ex["h"].shape[0]),
            "heldout_answers": len(held), "heldout_greedy_answers": sum(s.temperature == 0 for s in held),
            "data_minutes": round(data_min, 1), "feature_minutes": round(feat_min, 1),
            "train_minutes": round(train_min, 1), "accuracy": acc_meta, "tree": tree,
            "tree_empirical_acceptance": {"paths": tree["medusa_choices"], "estimated":
                                          [round(x, 4) for x in [expected_accepted([p], ev["acc"]) for p in
                                                                 tree["medusa_choices"]]],
                                          "empirical": chosen_emp,
                                          "expected_accepted_estimated": round(expected_accepted(
                                              tree["medusa_choices"], ev["acc"]), 4),
                                          "expected_accepted_empirical": round(sum(chosen_emp), 4)},
            "best16_paths": {"paths": paths16, "empirical": emp16,
                             "expected_accepted_estimated": round(expected_accepted(paths16, ev["acc"]), 4),
                             "expected_accepted_empirical": round(sum(emp16), 4)},
            "pass_cost": pass_cost, "args": vars(args)}
    full["total_minutes"] = round((time.perf_counter() - t_start) / 60, 1)
    full["log"] = log
    (Path(args.out) / "train_meta.json").write_text(json.dumps(full, indent=1) + "\n")
    _log(f"[eval] held-out top-1 per head {ev['top1']}, top-{RANKS} {ev['topk']}")
    _log(f"[tree] {tree['nodes']} nodes {tree['medusa_choices']}: estimated {tree['expected_tokens']} tokens "
         f"per pass at {tree['pass_cost']}× a single-token pass")
    _log(f"[done] heads written to {args.out} in {full['total_minutes']} min")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:  # bad arguments or files: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
