"""Train the DFlash-style block drafter (``engine.decoding.block_drafter``) for the embedded target.

Run ``python -m engine.training.train_block --help``. The pipeline (CPU, progress printed) shares its data and
feature caches with ``engine.training.train_head`` and ``train_medusa`` (same ``--work-dir`` layout):

1. data: the target's own answers to generated prompts (``engine.training.draft_data``; held-out prompts come
   from topics never used in training), cached under ``--work-dir``; every ``train*.pt`` there is used;
2. features: the target's last hidden state h_t (post final norm) at every position
   (``train_head.compute_features``), cached next to each data file;
3. training (DFlash, arXiv 2602.06036, §4.2): per answer, up to ``--anchors`` random anchor positions a (from the
   last prompt position on); block a holds x_a then B − 1 mask slots at positions a .. a + B − 1; in one forward
   pass per batch every block sees the context entries fc(h_i) with i < a and its own slots in both directions,
   never another block (``block_visibility``). Slot j is scored on the answer's own token at a + j (hard CE)
   plus ``--soft-weight`` × the soft CE against the target's stored top-32 distribution there (restricted to the
   draft vocabulary), weighted exp(−(j − 1)/``--decay``) and normalised by the weights' sum (DFlash's
   position-decayed loss). B is drawn per batch from ``--blocks`` so shorter blocks are trained too. AdamW,
   warm-up then cosine over the time budget; the epoch with the best validation slot-1 top-1 is kept;
4. held-out accuracy by slot: on the held-out answers generated greedily, for every anchor, the rank of the
   target's greedy token among each slot's candidates (``slot_accuracy``), and the chain acceptance length
   (leading slots right in a row);
5. the block size: B maximising the estimated tokens per unit of time E(B) / (c_block(B) + t(B)/t(1)) with this
   machine's measured target pass cost t (``engine.decoding.pass_cost``) and the drafter's own measured pass
   cost c_block(B) (``block_pass_ms``), saved as ``default_block``;
6. saved (fp16) to ``--out`` (default ``assets/smollm2-block``); ``make_proposer("embedded-block", target)``
   loads it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.decoding.attention import model_mask
from engine.decoding.block_drafter import BlockDrafter, choose_block, save_block_drafter
from engine.errors import InputError
from engine.training.draft_data import Sample
from engine.training.train_head import cached_training_data, compute_features, draft_vocabulary

ROOT = Path(__file__).resolve().parents[2]
RANKS = 10  # candidates per slot whose accuracy is measured


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def block_visibility(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block: int) -> torch.Tensor:
    """Who sees whom in one training pass over [context entries 0..ctx_len − 1, block 1, block 2, ...].

    DFlash §4.2: context entries are causal among themselves; block b (anchor a_b) sees context entries i < a_b
    and every slot of its own block (both directions), never another block; a block that is not kept (padding)
    sees only itself.

    Args:
        anchors: [S, A] anchor positions a (the bonus token's position).
        keep: [S, A] bool, which blocks are real.
        ctx_len: context entries per row (padded length).
        block: B, slots per block (bonus included).

    Returns:
        [S, Q, Q] bool with Q = ctx_len + A·B.
    """
    s, a = anchors.shape
    q = ctx_len + a * block
    vis = torch.zeros(s, q, q, dtype=torch.bool)
    vis[:, :ctx_len, :ctx_len] = torch.ones(ctx_len, ctx_len, dtype=torch.bool).tril()
    cols = torch.arange(ctx_len)
    ctx_vis = (cols[None, None] < anchors[..., None]) & keep[..., None]  # [S, A, ctx]
    vis[:, ctx_len:, :ctx_len] = ctx_vis.repeat_interleave(block, dim=1)
    vis[:, ctx_len:, ctx_len:] = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool)] * a)
    return vis


def sequences(samples: list[Sample], feats: list[torch.Tensor]) -> list[dict]:
    """Per answer: ids x [L], features h [L, H], prompt length P, answer length R, the stored top-k of every
    answer token (``top_ids`` [R, k], ``top_logp`` [R, k]) and whether it was greedy."""
    out = []
    for s, h in zip(samples, feats):
        x = torch.cat([s.prompt_ids, s.response_ids]).long()
        if len(s.response_ids) < 2:
            continue
        out.append({"x": x, "h": h, "P": len(s.prompt_ids), "R": len(s.response_ids), "top_ids": s.top_ids,
                    "top_logp": s.top_logp, "greedy": s.temperature == 0})
    return out


def collate(seqs: list[dict], idx: list[int], block: int, n_anchors: int, rng: random.Random | None,
            hidden: int) -> dict:
    """A training batch: padded features and, per answer, up to ``n_anchors`` anchors a in [P − 1, P + R − 2]
    (random without replacement, or all of them in order when ``rng`` is None), with slot j's labels at a + j.

    Returns:
        {"h": [S, Lmax, H] float32, "anchors": [S, A], "keep": [S, A] bool, "bonus": [S, A] ids x_a,
        "label": [S, A, B − 1] the answer's token at a + j (−1 past the answer), "top_ids": [S, A, B − 1, k]
        (−1 where none), "top_logp": [S, A, B − 1, k]}.
    """
    S = len(idx)
    lmax = max(len(seqs[i]["x"]) for i in idx)
    k = seqs[idx[0]]["top_ids"].shape[1]
    h = torch.zeros(S, lmax, hidden)
    anchors = torch.zeros(S, n_anchors, dtype=torch.long)
    keep = torch.zeros(S, n_anchors, dtype=torch.bool)
    bonus = torch.zeros(S, n_anchors, dtype=torch.long)
    label = torch.full((S, n_anchors, block - 1), -1, dtype=torch.long)
    tid = torch.full((S, n_anchors, block - 1, k), -1, dtype=torch.long)
    tlp = torch.zeros(S, n_anchors, block - 1, k)
    for r, i in enumerate(idx):
        sq = seqs[i]
        x, P, R = sq["x"], sq["P"], sq["R"]
        L = len(x)
        h[r, :L] = sq["h"].float()
        cand = list(range(P - 1, P + R - 1))
        chosen = sorted(rng.sample(cand, min(n_anchors, len(cand)))) if rng is not None else cand[:n_anchors]
        for b, a in enumerate(chosen):
            anchors[r, b], keep[r, b], bonus[r, b] = a, True, x[a]
            for j in range(1, block):
                t = a + j
                if t >= L:
                    break
                label[r, b, j - 1] = x[t]
                tid[r, b, j - 1] = sq["top_ids"][t - P].long()
                tlp[r, b, j - 1] = sq["top_logp"][t - P].float()
    return {"h": h, "anchors": anchors, "keep": keep, "bonus": bonus, "label": label, "top_ids": tid, "top_logp": tlp}


def block_forward(drafter: BlockDrafter, batch: dict, block: int) -> torch.Tensor:
    """One training pass: [S, A, B − 1, Vd] logits of every block's slots 1..B − 1."""
    h, anchors, keep = batch["h"], batch["anchors"], batch["keep"]
    S, lmax, H = h.shape
    A = anchors.shape[1]
    ctx = drafter.fc(h)
    last = h.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, H))  # h_{a−1}: [S, A, H]
    blk = drafter.block_inputs(batch["bonus"].reshape(-1), block, last.reshape(-1, H)).reshape(S, A * block, H)
    vis = block_visibility(anchors, keep, lmax, block)
    pos = torch.cat([torch.arange(lmax).expand(S, -1),
                     (anchors[..., None] + torch.arange(block)).reshape(S, A * block)], dim=1)
    out = drafter(torch.cat([ctx, blk], dim=1), model_mask(vis, drafter.body), pos)
    slots = out[:, lmax:].reshape(S, A, block, H)[:, :, 1:]
    return drafter.logits(slots)


class _Loss:
    """Σ_j w_j [CE(slot j, the answer's token at a + j) + soft_weight · soft CE(slot j, the target's top-k there)]
    / Σ_j w_j with w_j = exp(−(j − 1)/decay) (DFlash's position-decayed loss), over the draft vocabulary (labels
    outside it are skipped)."""

    def __init__(self, drafter: BlockDrafter, vocab_size: int, soft_weight: float, decay: float):
        self.full2red = torch.full((vocab_size,), -1, dtype=torch.long)
        self.full2red[drafter.vocab_ids.cpu()] = torch.arange(drafter.vocab_ids.numel())
        self.soft_weight, self.decay = soft_weight, decay

    def __call__(self, logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, int, int]:
        logq = F.log_softmax(logits.float(), -1)  # [S, A, B-1, Vd]
        lab = batch["label"]
        red = self.full2red[lab.clamp(min=0)]
        ok = (lab >= 0) & (red >= 0)
        j = torch.arange(lab.shape[-1], dtype=torch.float32)
        w = torch.exp(-j / self.decay).expand_as(lab) * ok
        hard = -logq.gather(-1, red.clamp(min=0)[..., None])[..., 0]
        loss = hard
        if self.soft_weight > 0:
            ids = batch["top_ids"]
            r = self.full2red[ids.clamp(min=0)]
            good = (ids >= 0) & (r >= 0)
            p = torch.where(good, batch["top_logp"].exp(), torch.zeros_like(batch["top_logp"]))
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
            soft = -(p * logq.gather(-1, r.clamp(min=0))).sum(-1)
            loss = loss + self.soft_weight * soft
        total = (loss * w).sum() / w.sum().clamp(min=1e-9)
        hit = ((logq.argmax(-1) == red) & ok)[..., 0]
        return total, int(hit.sum()), int(ok[..., 0].sum())


@torch.no_grad()
def slot_accuracy(drafter: BlockDrafter, seqs: list[dict], block: int, ranks: int = RANKS,
                  greedy_only: bool = True, per_batch: int = 8) -> dict:
    """Held-out accuracy of each slot by candidate rank, and the chain acceptance length.

    At every anchor a of the (greedy) answers, slot j's candidates are ranked by its logits; the target's choice at
    a + j is the answer's token there (a greedy answer's token is the target's greedy choice after the answer's
    own tokens before it: the situation of greedy decoding with every earlier slot accepted).

    Returns:
        {"acc": [B − 1][ranks] fraction of scored anchors whose rank-r candidate of slot j is right (not cumulative;
        Medusa §2.3.3's a_k(i), used by ``tree.best_paths``), "top1": [B − 1], "topk": [B − 1] (cumulative),
        "positions": [B − 1] scored anchors per slot, "accepted_mean": mean leading right slots (the chain's
        accepted draft tokens per round, before the bonus token), "accepted_by_gamma": {γ: mean of min(leading
        right slots, γ)} for γ = 1..B − 1}.
    """
    drafter.eval()
    sel = [i for i, s in enumerate(seqs) if s["greedy"] or not greedy_only]
    ranks_all, scored_all = [], []
    hidden = drafter.hidden_size
    for i in range(0, len(sel), per_batch):
        idx = sel[i:i + per_batch]
        n_anch = max(seqs[j]["R"] for j in idx)
        batch = collate(seqs, idx, block, n_anch, None, hidden)
        logits = block_forward(drafter, batch, block).float()  # [S, A, B-1, Vd]
        top = drafter.vocab_ids.cpu()[logits.topk(min(ranks, logits.shape[-1]), dim=-1).indices]
        hit = top == batch["label"][..., None]
        found = hit.any(-1)
        r = torch.where(found, hit.float().argmax(-1), torch.full_like(found, -1, dtype=torch.long))
        keep = batch["keep"]
        ranks_all.append(r[keep])
        scored_all.append((batch["label"] >= 0)[keep])
    rk = torch.cat(ranks_all)  # [N, B-1]
    sc = torch.cat(scored_all)
    n = sc.sum(0).clamp(min=1)
    acc = [[round(float(((rk[:, j] == r) & sc[:, j]).sum() / n[j]), 4) for r in range(ranks)] for j in range(block - 1)]
    right = (rk == 0) & sc
    lead = torch.zeros(rk.shape[0], dtype=torch.long)
    alive = torch.ones(rk.shape[0], dtype=torch.bool)
    for j in range(block - 1):
        alive &= right[:, j]
        lead += alive.long()
    by_gamma = {g: round(float(lead.clamp(max=g).float().mean()), 4) for g in range(1, block)}
    return {"acc": acc, "top1": [a[0] for a in acc], "topk": [round(sum(a), 4) for a in acc],
            "positions": [int(x) for x in sc.sum(0)], "accepted_mean": round(float(lead.float().mean()), 4),
            "accepted_by_gamma": by_gamma, "anchors": int(rk.shape[0])}


def train_block(drafter: BlockDrafter, seqs: list[dict], vocab_size: int, *, minutes: float, blocks: list[int],
                lr: float = 1e-3, batch: int = 8, n_anchors: int = 24, soft_weight: float = 1.0,
                decay: float = 7.0, weight_decay: float = 0.01, max_steps: int | None = None, seed: int = 0,
                val: list[dict] | None = None, log_every: int = 10) -> list[dict]:
    """Train ``drafter`` in place (AdamW; 20 warm-up steps, cosine to 5 % over the time budget or ``max_steps``).
    Each step draws its block size from ``blocks``. With ``val`` (a validation split of the training answers),
    slot-1 top-1 is measured after each epoch and the drafter ends with the best epoch's weights.

    Returns:
        log rows {step, minutes, loss, train_top1_slot1, block[, val_top1]}.
    """
    import copy

    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    loss_fn = _Loss(drafter, vocab_size, soft_weight, decay)
    t0, step, log, total = time.perf_counter(), 0, [], minutes * 60
    best, best_state = -1.0, None
    done = False
    order = list(range(len(seqs)))
    while not done:
        drafter.train()
        rng.shuffle(order)
        for i in range(0, len(order), batch):
            el = time.perf_counter() - t0
            if (max_steps is None and el > total) or (max_steps is not None and step >= max_steps):
                done = True
                break
            frac = el / total if max_steps is None else step / max_steps
            cur = lr * min(1.0, (step + 1) / 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
            for g in opt.param_groups:
                g["lr"] = cur
            b = rng.choice(blocks)
            data = collate(seqs, order[i:i + batch], b, n_anchors, rng, drafter.hidden_size)
            loss, hit, n = loss_fn(block_forward(drafter, data, b), data)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % log_every == 0:
                row = {"step": step, "minutes": round(el / 60, 2), "loss": round(float(loss.detach()), 4),
                       "train_top1_slot1": round(hit / max(n, 1), 4), "block": b}
                log.append(row)
                _log(f"[train] step {step} block {b} loss {row['loss']:.3f} slot-1 top-1 {row['train_top1_slot1']:.3f} "
                     f"lr {cur:.2e} {el / 60:.1f} min")
        if val:
            ev = slot_accuracy(drafter, val, max(blocks), ranks=1, greedy_only=False)
            score = statistics.fmean(ev["top1"][:4])
            log.append({"step": step, "minutes": round((time.perf_counter() - t0) / 60, 2), "val_top1": ev["top1"]})
            _log(f"[val] after {step} steps: top-1 by slot {ev['top1'][:8]}")
            if score > best:
                best, best_state = score, copy.deepcopy(drafter.state_dict())
    if best_state is not None:
        drafter.load_state_dict(best_state)
    drafter.eval()
    return log


@torch.inference_mode()
def block_pass_ms(target, drafter: BlockDrafter, blocks: list[int], context: int = 128, reps: int = 7) -> dict:
    """This machine's cost of one drafter round (ONE pass: one new context entry plus a block of B positions, as a
    chain round after a full acceptance feeds) by B, and of the target's 1-token step after ``context`` cached
    tokens; medians of ``reps`` after a warm-up, in ms. c_block(B) = block_ms[B] / target_step_ms.

    Returns:
        {"target_step_ms": float, "block_ms": {B: ms}}.
    """
    from engine.decoding.block_drafter import BlockProposer
    from engine.decoding.proposers import CachedLM

    dev = next(target.model.parameters()).device
    seq = list(range(100, 100 + context)) + [7, 9]
    lm = CachedLM(target.model, dev, keep_hidden=True)
    lm.logits_for(seq[:-1], 1)  # hidden states of every position but the newest

    def median_ms(fn) -> float:
        fn()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)

    def step():
        lm.crop(context)
        lm.logits_for(seq[:context + 1], 1)

    prop = BlockProposer(drafter, target.model.get_output_embeddings().weight.shape[0])
    prop.attach(lm)
    prop.block_logits(seq[:-1], 2)  # the context entries of the last round
    n0 = prop.n_ctx

    def round_of(b):
        def one():
            extra = prop.cache.get_seq_length() - n0
            if extra > 0:
                prop.cache.crop(-extra)  # transformers 5: crop takes the count to drop, negative
            prop.n_ctx = n0
            prop.block_logits(seq, b)
        return one

    res = {b: round(median_ms(round_of(b)), 3) for b in blocks}
    return {"target_step_ms": round(median_ms(step), 3), "block_ms": res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.training.train_block", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "assets" / "smollm2-block"), help="output folder")
    ap.add_argument("--work-dir", default=str(ROOT / ".cache" / "draft-train"),
                    help="data cache folder (shared with train_head and train_medusa)")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers in the drafter")
    ap.add_argument("--max-block", type=int, default=16, help="largest block B (bonus + B − 1 slots)")
    ap.add_argument("--blocks", default="4,8,16", help="block sizes drawn per training batch (comma-separated)")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="ids the drafter may propose (most frequent)")
    ap.add_argument("--prompts", type=int, default=4000, help="new training prompts to generate from")
    ap.add_argument("--heldout", type=int, default=32, help="held-out prompts (unseen topics)")
    ap.add_argument("--prompt-set", type=int, default=1, choices=[1, 2])
    ap.add_argument("--data-minutes", type=float, default=12.0,
                    help="time budget for new training data (0: only reuse cached train*.pt files)")
    ap.add_argument("--gen-dtype", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--gen-batch", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--feature-dtype", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--train-minutes", type=float, default=20.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8, help="answers per step")
    ap.add_argument("--anchors", type=int, default=24, help="blocks per answer per step")
    ap.add_argument("--soft-weight", type=float, default=1.0)
    ap.add_argument("--decay", type=float, default=7.0, help="slot j's loss weight exp(−(j − 1)/decay) (DFlash)")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    try:
        blocks = sorted({int(b) for b in args.blocks.split(",")})
    except ValueError:
        ap.error(f"--blocks must be comma-separated whole numbers, got {args.blocks!r}")
    if args.layers < 1 or args.max_block < 2 or not blocks or min(blocks) < 2 or max(blocks) > args.max_block:
        ap.error("--layers ≥ 1, --max-block ≥ 2 and every --blocks size in 2..--max-block")
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.decoding.models import load_model
    from engine.decoding.pass_cost import machine_pass_cost

    t_start = time.perf_counter()
    target = load_model("embedded", device="cpu")
    model = target.model
    vocab_size = model.get_output_embeddings().weight.shape[0]
    data = cached_training_data(target, Path(args.work_dir), heldout=args.heldout, prompts=args.prompts,
                                prompt_set=args.prompt_set, data_minutes=args.data_minutes, gen_dtype=args.gen_dtype,
                                gen_batch=args.gen_batch, max_new_tokens=args.max_new_tokens,
                                feature_dtype=args.feature_dtype, seed=args.seed, progress=_log)
    samples, feats, held = data["samples"], data["features"], data["heldout"]
    rng = random.Random(args.seed)
    val_idx = set(rng.sample(range(len(samples)), max(1, int(len(samples) * args.val_fraction)))) \
        if args.val_fraction > 0 and len(samples) > 1 else set()
    train_seqs = sequences([s for i, s in enumerate(samples) if i not in val_idx],
                           [f for i, f in enumerate(feats) if i not in val_idx])
    val_seqs = sequences([samples[i] for i in sorted(val_idx)], [feats[i] for i in sorted(val_idx)])
    held_seqs = sequences(held, compute_features(model, held, torch.float32))
    n_tok = sum(s["R"] for s in train_seqs)
    _log(f"[data] {len(train_seqs)} training answers ({n_tok} answer tokens), {len(val_seqs)} validation, "
         f"{len(held_seqs)} held-out")

    vocab = draft_vocabulary(samples, args.draft_vocab, vocab_size)
    drafter = BlockDrafter(model.config, args.layers, args.max_block, vocab)
    drafter.init_from_target(model)
    drafter.bind(model)
    n_params = sum(p.numel() for p in drafter.parameters())
    before = slot_accuracy(drafter, held_seqs, args.max_block, ranks=1)
    _log(f"[train] {args.layers} layer(s), blocks {blocks}, draft vocabulary {len(vocab)}, {n_params / 1e6:.2f}M "
         f"parameters; held-out top-1 by slot before training {before['top1'][:8]}")
    t0 = time.perf_counter()
    log = train_block(drafter, train_seqs, vocab_size, minutes=args.train_minutes, blocks=blocks, lr=args.lr,
                      batch=args.batch, n_anchors=args.anchors, soft_weight=args.soft_weight, decay=args.decay,
                      seed=args.seed, val=val_seqs)
    train_min = (time.perf_counter() - t0) / 60

    ev = slot_accuracy(drafter, held_seqs, args.max_block)
    ev_all = slot_accuracy(drafter, held_seqs, args.max_block, greedy_only=False)
    drafter.config = {"slot_accuracy": ev["acc"]}
    cost = block_pass_ms(target, drafter, list(range(2, args.max_block + 1)))
    curve = machine_pass_cost(target)
    ratios = curve.ratios(args.max_block)
    chosen = choose_block(ev["accepted_by_gamma"], cost["block_ms"], cost["target_step_ms"], ratios)
    from engine.decoding.compute import cpu_model

    meta = {"target": "embedded", "slot_accuracy": ev["acc"], "heldout_top1": ev["top1"],
            f"heldout_top{RANKS}": ev["topk"], "accepted_by_gamma": ev["accepted_by_gamma"],
            "default_block": chosen["block"],
            "block_choice": {**chosen, "machine": cpu_model(), "compute": target.compute.path if target.compute else
                             "default", "target_step_ms": cost["target_step_ms"], "block_ms": cost["block_ms"]}}
    save_block_drafter(drafter, args.out, meta=meta)
    full = {"target": "embedded", "parameters": n_params, "train_answers": len(train_seqs),
            "validation_answers": len(val_seqs), "train_answer_tokens": n_tok, "heldout_answers": len(held_seqs),
            "heldout_greedy_answers": sum(s["greedy"] for s in held_seqs),
            "data_minutes": data["data_minutes"], "feature_minutes": data["feature_minutes"],
            "train_minutes": round(train_min, 1), "steps": max([r["step"] for r in log if "step" in r], default=0),
            "before_training_top1": before["top1"],
            "heldout_greedy": {k: ev[k] for k in ("acc", "top1", "topk", "positions", "accepted_mean",
                                                  "accepted_by_gamma")},
            "heldout_all": {k: ev_all[k] for k in ("top1", "topk", "positions", "accepted_mean", "accepted_by_gamma")},
            "block_choice": meta["block_choice"], "pass_cost": ratios, "args": vars(args)}
    full["total_minutes"] = round((time.perf_counter() - t_start) / 60, 1)
    full["log"] = log
    (Path(args.out) / "train_meta.json").write_text(json.dumps(full, indent=1) + "\n")
    _log(f"[eval] held-out top-1 by slot {ev['top1']}; accepted per round by γ {ev['accepted_by_gamma']}")
    _log(f"[block] B = {chosen['block']} ({chosen['by_block']})")
    _log(f"[done] block drafter written to {args.out} in {full['total_minutes']} min")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:  # bad arguments or files: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
