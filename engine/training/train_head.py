"""Train the EAGLE-style draft head (``engine.decoding.draft_head``) for the embedded target.

Run ``python -m engine.training.train_head --help``. The pipeline (CPU, progress printed):

1. data: the target's own answers to generated prompts (``engine.training.draft_data``; held-out prompts come from
   topics never used in training), cached under ``--work-dir``. Every ``train*.pt`` file there is used,
   so earlier runs' data add up. ``--gen-dtype bf16`` generates with a bf16 copy of the target (about 3×
   faster on CPUs with AMX; ~97% of its greedy choices equal fp32's);
2. features: one teacher-forced pass of the target over prompt + answer gives h_i, its last hidden state
   (post final norm) at every position, stored as fp16 (``--feature-dtype``);
3. training pairs (h_i, x_{i+1}) → ĥ_{i+1} for every position of a sample; the loss is scored at answer
   positions: soft cross-entropy against the target's top-32 distribution restricted to the draft
   vocabulary + ``--hard-weight`` × CE(target's argmax) + ``--reg-weight`` × SmoothL1(ĥ_{i+1}, h_{i+1})
   (EAGLE, Li et al. 2024, §4: feature regression + classification). With ``--unroll-weight`` > 0 a
   second pass feeds the head its own predictions as features (training-time test, EAGLE-3, Li et al.
   2025, §3.2; simplified: every position uses the predicted feature), as drafting beyond the first
   token does;
4. held-out accuracy: top-1 agreement of the head with the target's greedy choice, first draft token
   (true features) and second (own features);
5. the head is saved (fp16) to ``--out`` (default ``assets/smollm2-head``); ``make_proposer
   ("embedded-head", target)`` loads it. Measure it in the engine with ``benchmarks/bench_head.py``.
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

from engine.decoding.draft_head import FeatureHead, save_head
from engine.errors import InputError
from engine.training.draft_data import Sample, build_prompts, generate_samples, load_samples, save_samples
from engine.training.train_draft import length_batches

ROOT = Path(__file__).resolve().parents[2]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@torch.inference_mode()
def compute_features(target_model, samples: list[Sample], dtype: torch.dtype = torch.float32,
                     progress=None) -> list[torch.Tensor]:
    """The target's last hidden state (post final norm) at every position of prompt + answer.

    Returns:
        one [P + R, H] float16 tensor per sample.
    """
    model = target_model if dtype == next(target_model.parameters()).dtype else \
        __import__("copy").deepcopy(target_model).to(dtype)
    dec = model.get_decoder()
    out, t0 = [], time.perf_counter()
    for i, s in enumerate(samples):
        ids = torch.cat([s.prompt_ids, s.response_ids]).long()[None]
        out.append(dec(input_ids=ids).last_hidden_state[0].to(torch.float16))
        if progress and (i + 1) % 200 == 0:
            progress(f"[features] {i + 1}/{len(samples)} samples, {time.perf_counter() - t0:.0f} s")
    return out


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` ids the head may propose: the target's greedy choices in the training answers, most
    frequent first, then the lowest remaining ids (BPE merge order: frequent tokens first).

    Returns:
        [size] sorted int64 ids.
    """
    if not 1 <= size <= vocab_size:
        raise InputError(f"The draft vocabulary must have 1..{vocab_size} ids, got {size}.")
    counts = torch.zeros(vocab_size)
    for s in samples:
        counts += torch.bincount(s.top_ids[:, 0].long(), minlength=vocab_size)[:vocab_size]
    seen = (counts > 0).nonzero().squeeze(-1)
    seen = seen[counts[seen].argsort(descending=True, stable=True)]
    rest = (counts == 0).nonzero().squeeze(-1)
    return torch.cat([seen, rest])[:size].sort().values


def make_items(samples: list[Sample], feats: list[torch.Tensor]):
    """Per sample: (tokens x_{i+1} [L-1], features h_i [L-1, H], next features h_{i+1} [L-1, H],
    label ids [L-1, k] (−1 where unscored), label log-probs [L-1, k]).

    Pair i predicts the target's distribution at position i+1; answer token j sits at position P + j and
    is drawn from the distribution at P + j − 1, so pair i is scored with the stored top-k of answer token
    j = i + 2 − P.
    """
    items = []
    for s, h in zip(samples, feats):
        x = torch.cat([s.prompt_ids, s.response_ids]).long()
        L, P, R = len(x), len(s.prompt_ids), len(s.response_ids)
        k = s.top_ids.shape[1]
        lab_ids = torch.full((L - 1, k), -1, dtype=torch.long)
        lab_lp = torch.zeros(L - 1, k)
        lo, hi = max(P - 2, 0), min(L - 1, P + R - 2)  # pairs i with 0 <= i + 2 - P < R
        if hi > lo:
            lab_ids[lo:hi] = s.top_ids[lo + 2 - P:hi + 2 - P].long()
            lab_lp[lo:hi] = s.top_logp[lo + 2 - P:hi + 2 - P].float()
        items.append((x[1:], h[:-1], h[1:], lab_ids, lab_lp))
    return items


def _batches(items, tokens: int, shuffle: bool, rng: random.Random) -> list[list[int]]:
    return length_batches([len(it[0]) for it in items], tokens, rng if shuffle else None)


def _collate(items, b: list[int], hidden: int):
    L, B = max(len(items[i][0]) for i in b), len(b)
    k = items[b[0]][3].shape[1]
    tok = torch.zeros(B, L, dtype=torch.long)
    f, fn = torch.zeros(B, L, hidden), torch.zeros(B, L, hidden)
    li, lp = torch.full((B, L, k), -1, dtype=torch.long), torch.zeros(B, L, k)
    m = torch.zeros(B, L, dtype=torch.long)
    for r, i in enumerate(b):
        t, a, c, d, e = items[i]
        n = len(t)
        tok[r, :n], f[r, :n], fn[r, :n], li[r, :n], lp[r, :n], m[r, :n] = t, a.float(), c.float(), d, e, 1
    return tok, f, fn, li, lp, m


class _Loss:
    """Soft CE on the draft vocabulary + hard CE + feature regression (see the module docstring)."""

    def __init__(self, head: FeatureHead, vocab_size: int, hard_weight: float, reg_weight: float):
        self.head = head
        self.full2red = torch.full((vocab_size,), -1, dtype=torch.long)
        self.full2red[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
        self.hard_weight, self.reg_weight = hard_weight, reg_weight

    def __call__(self, out, fn, li, lp, m):
        sel = li[..., 0] >= 0
        logits = self.head.logits(out[sel].float())
        logq = F.log_softmax(logits, -1)
        ids = li[sel]
        red = self.full2red[ids.clamp(min=0)]
        ok = (red >= 0) & (ids >= 0)
        pw = torch.where(ok, lp[sel].exp(), torch.zeros_like(lp[sel]))
        pw = pw / pw.sum(-1, keepdim=True).clamp(min=1e-9)
        soft = -(pw * logq.gather(-1, red.clamp(min=0))).sum(-1).mean()
        hard_ok = ok[:, 0]
        hard = F.cross_entropy(logits[hard_ok], red[hard_ok, 0]) if hard_ok.any() else logits.sum() * 0
        correct = ((logits.argmax(-1) == red[:, 0]) & hard_ok).sum()
        reg = F.smooth_l1_loss(out[m.bool()].float(), fn[m.bool()])
        loss = soft + self.hard_weight * hard + self.reg_weight * reg
        return loss, int(correct), int(sel.sum())


def _forward(head, loss_fn, batch, unroll: bool, noise: float = 0.0):
    tok, f, fn, li, lp, m = batch
    pos = (m.cumsum(-1) - 1).clamp(min=0)
    fin = f + (torch.rand_like(f) - 0.5) * 2 * noise if noise else f
    out = head(tok, fin, attention_mask=m, position_ids=pos)
    loss1, c1, n = loss_fn(out, fn, li, lp, m)
    if not unroll:
        return loss1, None, c1, 0, n
    f2 = f.clone()
    f2[:, 1:] = out[:, :-1].float()
    out2 = head(tok, f2, attention_mask=m, position_ids=pos)
    loss2, c2, _ = loss_fn(out2, fn, li, lp, m)
    return loss1, loss2, c1, c2, n


def evaluate_head(head: FeatureHead, items, vocab_size: int, tokens: int = 4096) -> dict:
    """Held-out top-1 agreement with the target's greedy choice (over scored answer positions).

    Returns:
        {"first": agreement of the first draft token (true features), "second": with the head's own
        features as input (the situation of later draft tokens), "positions": count}.
    """
    loss_fn = _Loss(head, vocab_size, 0.0, 0.0)
    was = head.training
    head.eval()
    c1 = c2 = n = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for b in _batches(items, tokens, False, random.Random(0)):
            _, _, a, a2, k = _forward(head, loss_fn, _collate(items, b, head.hidden_size), unroll=True)
            c1, c2, n = c1 + a, c2 + a2, n + k
    head.train(was)
    return {"first": round(c1 / max(n, 1), 4), "second": round(c2 / max(n, 1), 4), "positions": n}


def train_head(head: FeatureHead, items, vocab_size: int, *, minutes: float, lr: float = 2e-3,
               tokens: int = 4096, hard_weight: float = 0.5, reg_weight: float = 0.2,
               unroll_weight: float = 0.5, noise: float = 0.0, max_steps: int | None = None,
               seed: int = 0, heldout=None, log_every: int = 20, bf16: bool = True) -> list[dict]:
    """Train ``head`` in place (AdamW, warm-up then cosine decay over the time budget).

    Returns:
        log rows {step, minutes, loss, train_agree[, heldout]}.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    loss_fn = _Loss(head, vocab_size, hard_weight, reg_weight)
    head.train()
    t0, step, log, total = time.perf_counter(), 0, [], minutes * 60
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else torch.enable_grad
    done = False
    while not done:
        for b in _batches(items, tokens, True, rng):
            el = time.perf_counter() - t0
            if el > total or (max_steps is not None and step >= max_steps):
                done = True
                break
            frac = el / total if max_steps is None else step / max_steps
            cur = lr * min(1.0, (step + 1) / 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = cur
            with ctx():
                l1, l2, c1, _, n = _forward(head, loss_fn, _collate(items, b, head.hidden_size),
                                            unroll=unroll_weight > 0, noise=noise)
                loss = l1 + (unroll_weight * l2 if l2 is not None else 0.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % log_every == 0:
                row = {"step": step, "minutes": round(el / 60, 2), "loss": round(float(loss.detach()), 4),
                       "train_agree": round(c1 / max(n, 1), 4)}
                log.append(row)
                _log(f"[train] step {step} loss {row['loss']:.3f} agree {row['train_agree']:.3f} "
                     f"lr {cur:.2e} {el / 60:.1f} min")
        if heldout is not None and not done:
            ev = evaluate_head(head, heldout, vocab_size)
            log.append({"step": step, "minutes": round((time.perf_counter() - t0) / 60, 2), "heldout": ev})
            _log(f"[eval] after {step} steps: held-out agreement {ev}")
    head.eval()
    return log


def _train_files(work: Path) -> list[Path]:
    """Cached training data files (``train*.pt``, not their ``.features-*`` companions)."""
    return sorted(f for f in work.glob("train*.pt") if ".features-" not in f.name)


def cached_training_data(target, work: Path, *, heldout: int, prompts: int, prompt_set: int, data_minutes: float,
                         gen_dtype: str, gen_batch: int, max_new_tokens: int, feature_dtype: str, seed: int,
                         progress=_log) -> dict:
    """Steps 1–2 shared by the draft trainers (head, Medusa heads, block drafter): the target's own answers and
    their features, cached under ``work``.

    1. held-out answers (``heldout.pt``: ``heldout`` prompts on topics never used in training, half greedy), made
       once; new training answers (``train-{gen_dtype}-s{seed}.pt``) for ``data_minutes`` when that file is absent
       and ``data_minutes`` > 0 (prompts already answered in an earlier file are skipped); every ``train*.pt`` is used;
    2. the features h (``compute_features``, ``feature_dtype``) of each training file, cached next to it.

    Returns:
        {"samples": [Sample], "features": [[P + R, H] tensors], "heldout": [Sample], "files": int,
        "data_minutes": float, "feature_minutes": float}.

    Raises:
        InputError: no training data in ``work`` and ``data_minutes`` is 0.
    """
    import copy

    model, tok, eos = target.model, target.tokenizer, target.eos_token_ids
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    gdt = torch.bfloat16 if gen_dtype == "bf16" else torch.float32
    gen_model = model if gdt == torch.float32 else copy.deepcopy(model).to(gdt)
    held_path = work / "heldout.pt"
    if held_path.is_file():
        held = load_samples(held_path)
    else:
        held = generate_samples(model, tok, build_prompts(heldout, "heldout", seed=0), eos, greedy_fraction=0.5,
                                max_new_tokens=max_new_tokens, batch_size=32, seed=seed + 1000, progress=progress)
        save_samples(held, held_path)
    new_path = work / f"train-{gen_dtype}-s{seed}.pt"
    t0 = time.perf_counter()
    if data_minutes > 0 and not new_path.is_file():
        old = {s.prompt for f in _train_files(work) for s in load_samples(f)}
        todo = [p for p in build_prompts(prompts, "train", seed=seed, prompt_set=prompt_set) if p["prompt"] not in old]
        new = generate_samples(gen_model, tok, todo, eos, greedy_fraction=0.4, temperature=0.8,
                               max_new_tokens=max_new_tokens, batch_size=gen_batch, seed=seed, progress=progress,
                               time_budget_s=data_minutes * 60)
        save_samples(new, new_path)
    data_min = (time.perf_counter() - t0) / 60
    t0 = time.perf_counter()
    fdt = torch.bfloat16 if feature_dtype == "bf16" else torch.float32
    samples, feats = [], []
    files = _train_files(work)
    if not files:
        raise InputError(f"No training data in {work}: run with --data-minutes > 0.")
    for f in files:
        ss = load_samples(f)
        fpath = f.with_name(f"{f.stem}.features-{feature_dtype}.pt")
        if fpath.is_file():
            ff = torch.load(fpath, weights_only=True)
        else:
            progress(f"[features] {f.name}: {len(ss)} samples ({feature_dtype})")
            ff = compute_features(gen_model if fdt == gdt else model, ss, fdt, progress=progress)
            torch.save(ff, fpath)
        samples += ss
        feats += ff
    return {"samples": samples, "features": feats, "heldout": held, "files": len(files),
            "data_minutes": round(data_min, 1), "feature_minutes": round((time.perf_counter() - t0) / 60, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.training.train_head", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "assets" / "smollm2-head"), help="output folder")
    ap.add_argument("--work-dir", default=str(ROOT / ".cache" / "draft-train"), help="data cache folder")
    ap.add_argument("--prompts", type=int, default=8000, help="new training prompts to generate from")
    ap.add_argument("--heldout", type=int, default=64, help="held-out prompts (unseen topics)")
    ap.add_argument("--prompt-set", type=int, default=1, choices=[1, 2],
                    help="generator for new training prompts (engine.training.draft_data.build_prompts); the held-out "
                         "prompts always come from set 1")
    ap.add_argument("--data-minutes", type=float, default=25.0, help="time budget for new training data "
                    "(0: only reuse cached train*.pt files)")
    ap.add_argument("--gen-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--gen-batch", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--feature-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers in the head (default 1, or the --init head's); more than the --init "
                         "head's adds layers that start as the identity (FeatureHead.grow)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="ids the head may propose (default 8192, or the --init head's; with --init another "
                         "size re-selects the most frequent ids, FeatureHead.with_vocab)")
    ap.add_argument("--init", default="", help="continue from a saved head folder (its layers and draft vocabulary are kept "
                    "unless --layers or --draft-vocab say otherwise)")
    ap.add_argument("--train-minutes", type=float, default=25.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--hard-weight", type=float, default=0.5)
    ap.add_argument("--reg-weight", type=float, default=0.2)
    ap.add_argument("--unroll-weight", type=float, default=0.5)
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--weights", default="f16", choices=["f16", "q8_0"],
                    help="how the saved head stores its matrices (engine.decoding.draft_head.save_head)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be at least 1, got {args.layers}")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        ap.error(f"--draft-vocab must be at least 1, got {args.draft_vocab}")
    if args.init and not Path(args.init).is_dir():
        ap.error(f"--init {args.init!r} is not a folder holding a saved draft head")
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.decoding.models import load_model

    t_start = time.perf_counter()
    target = load_model("embedded", device="cpu")
    model = target.model
    vocab_size = model.get_output_embeddings().weight.shape[0]
    data = cached_training_data(target, Path(args.work_dir), heldout=args.heldout, prompts=args.prompts,
                                prompt_set=args.prompt_set, data_minutes=args.data_minutes, gen_dtype=args.gen_dtype,
                                gen_batch=args.gen_batch, max_new_tokens=args.max_new_tokens,
                                feature_dtype=args.feature_dtype, seed=args.seed, progress=_log)
    samples, held, files = data["samples"], data["heldout"], data["files"]
    data_min, feat_min = data["data_minutes"], data["feature_minutes"]
    train_items = make_items(samples, data["features"])
    held_items = make_items(held, compute_features(model, held, torch.float32))
    n_tok = sum(len(s.response_ids) for s in samples)
    _log(f"[data] {len(samples)} training answers ({n_tok} answer tokens) from {files} files, "
         f"{len(held)} held-out; {data_min:.1f} min generating, {feat_min:.1f} min features")

    if args.init:
        from engine.decoding.draft_head import load_head

        head = load_head(args.init, model).float()
        head.bind(model)
        if args.layers is not None and args.layers < head.n_layers:
            raise InputError(f"--layers {args.layers} is fewer than the {head.n_layers} layer(s) of {args.init}.")
        if args.layers is not None and args.layers > head.n_layers:
            head = head.grow(args.layers, model)
        if args.draft_vocab is not None and args.draft_vocab != head.vocab_ids.numel():
            head = head.with_vocab(draft_vocabulary(samples, args.draft_vocab, vocab_size), model)
        vocab = head.vocab_ids
        _log(f"[train] continuing from {args.init}")
    else:
        vocab = draft_vocabulary(samples, args.draft_vocab or 8192, vocab_size)
        head = FeatureHead(model.config, args.layers or 1, vocab)
        head.init_from_target(model)
        head.bind(model)
    n_params = sum(p.numel() for p in head.parameters())
    _log(f"[train] head: {head.n_layers} layer(s), draft vocabulary {len(vocab)}, {n_params / 1e6:.2f}M parameters")
    t0 = time.perf_counter()
    log = train_head(head, train_items, vocab_size, minutes=args.train_minutes, lr=args.lr,
                     tokens=args.tokens_per_batch, hard_weight=args.hard_weight, reg_weight=args.reg_weight,
                     unroll_weight=args.unroll_weight, noise=args.noise, seed=args.seed, heldout=held_items)
    train_min = (time.perf_counter() - t0) / 60
    ev = evaluate_head(head, held_items, vocab_size)
    meta = {"target": "embedded", "parameters": n_params, "train_answers": len(samples),
            "train_answer_tokens": n_tok, "heldout_answers": len(held), "data_minutes": round(data_min, 1),
            "feature_minutes": round(feat_min, 1), "train_minutes": round(train_min, 1),
            "heldout_agreement": ev, "args": vars(args)}
    save_head(head, args.out, meta={"target": "embedded", "heldout_agreement": ev}, weights=args.weights)
    meta["total_minutes"] = round((time.perf_counter() - t_start) / 60, 1)
    meta["log"] = log
    (Path(args.out) / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    _log(f"[eval] held-out agreement: {ev}")
    _log(f"[done] head written to {args.out} in {meta['total_minutes']} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
