"""Train the embedded draft: a small Llama-style causal LM distilled from the target.

Run ``python -m engine.training.train_draft --help``. The pipeline (all on CPU, progress printed):

1. prompts: ``engine.training.draft_data.build_prompts`` (train and held-out topics are disjoint);
2. data: the target's own answers (a share greedy, the rest sampled at T=0.8) with its top-k
   log-probabilities at every answer position, cached under ``--work-dir``;
3. student: ``LlamaConfig`` with few layers, a small hidden size and tied embeddings, sharing the target's
   vocabulary (49152) so the engine's draft-model proposer uses it unchanged; its embeddings start from a
   PCA projection of the target's embeddings;
4. training: loss at each answer position = KL(p_topk ‖ q) + λ · CE(argmax p) (the soft part is the
   distillation loss of Hinton et al. 2015, §2; the hard part weights the target's greedy choice, which is
   what greedy speculative decoding accepts);
5. held-out evaluation (``evaluate_draft``): greedy α and α at T=0.7; see that function for definitions;
6. the weights are written as safetensors (fp16) with config.json into ``--out``, which
   ``engine.decoding.models.load_model(path)`` (or ``"embedded-draft"`` for ``assets/smollm2-draft``) loads.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import InputError
from engine.training.draft_data import Sample, build_prompts, generate_samples, load_samples, save_samples

ROOT = Path(__file__).resolve().parents[2]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- student


@dataclass
class StudentShape:
    """Size of the draft: layers, hidden size, MLP width, attention heads (head_dim = hidden // heads)."""

    layers: int = 2
    hidden: int = 256
    intermediate: int = 768
    heads: int = 4
    kv_heads: int = 2


def make_student_config(target_config, shape: StudentShape):
    """A LlamaConfig for the draft: the target's vocabulary, special ids, RoPE and context length.

    Raises:
        InputError: if hidden is not divisible by heads, or heads by kv_heads.
    """
    from transformers import LlamaConfig

    if shape.layers < 1 or shape.hidden < 8 or shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise InputError("Draft shape: need layers ≥ 1, hidden divisible by heads, heads by kv_heads.")
    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default",
                                                                "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads, max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=dict(rope), rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
        tie_word_embeddings=True, bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id, pad_token_id=getattr(target_config, "pad_token_id", None),
        hidden_act="silu", architectures=["LlamaForCausalLM"],
    )


def pca_embeddings(target_emb: torch.Tensor, dim: int) -> torch.Tensor:
    """Project the target's embedding matrix (V, H) onto its top ``dim`` principal directions → (V, dim).

    The projection is E · U[:, :dim] with U the eigenvectors of Eᵀ E (uncentered, so logits E·h keep
    their common component), rescaled so rows have the target's mean norm times sqrt(dim / H).
    """
    E = target_emb.detach().float()
    if dim >= E.shape[1]:
        return E[:, :dim].clone()
    evals, evecs = torch.linalg.eigh(E.T @ E)  # ascending
    U = evecs[:, -dim:].flip(-1)
    return (E @ U).contiguous()


def build_student(target_model, shape: StudentShape, seed: int = 0):
    """A fresh draft (LlamaForCausalLM, fp32) with embeddings from a PCA projection of the target's."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = make_student_config(target_model.config, shape)
    student = LlamaForCausalLM(cfg)
    with torch.no_grad():
        student.model.embed_tokens.weight.copy_(
            pca_embeddings(target_model.get_input_embeddings().weight, shape.hidden))
    student.tie_weights()
    return student


# ---------------------------------------------------------------------------------------------- batches


def length_batches(lengths: list[int], tokens_per_batch: int, rng: random.Random | None) -> list[list[int]]:
    """Group indices into batches of similar length with at most ``tokens_per_batch`` padded tokens
    (a longer single item gets a batch of its own); batches shuffled with ``rng`` unless it is None."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and max(cur_max, n) * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def make_batches(samples: list[Sample], tokens_per_batch: int, seed: int) -> list[list[int]]:
    """Group sample indices into batches of similar length with about ``tokens_per_batch`` padded tokens."""
    return length_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], tokens_per_batch,
                          random.Random(seed))


def collate(samples: list[Sample], pad_id: int):
    """Right-padded inputs and the answer positions to score.

    Returns:
        ids (B, T) long; pos (N, 2) long: (row, t) positions whose output predicts an answer token;
        top_ids (N, k) long; top_logp (N, k) float32.
    """
    T = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    pos, tids, tlps = [], [], []
    for b, s in enumerate(samples):
        seq = torch.cat([s.prompt_ids.long(), s.response_ids.long()])
        ids[b, :len(seq)] = seq
        P, R = len(s.prompt_ids), len(s.response_ids)
        t = torch.arange(P - 1, P - 1 + R)
        pos.append(torch.stack([torch.full_like(t, b), t], dim=1))
        tids.append(s.top_ids.long())
        tlps.append(s.top_logp.float())
    return ids, torch.cat(pos), torch.cat(tids), torch.cat(tlps)


def distill_loss(hidden: torch.Tensor, lm_head: torch.nn.Module, top_ids: torch.Tensor,
                 top_logp: torch.Tensor, hard_weight: float, chunk: int = 1024):
    """Mean over positions of KL(p̃ ‖ q) + hard_weight · (−log q(argmax p)).

    Args:
        hidden: the draft's final hidden states at the scored positions, shape (N, H).
        lm_head: the draft's output layer (H → V).
        top_ids, top_logp: the target's top-k ids and log-probabilities, shape (N, k); p̃ is p restricted
            to its top-k and renormalized. KL(p̃ ‖ q) = Σ_k p̃_k (log p̃_k − log q_k) (Hinton et al. 2015).
        hard_weight: λ ≥ 0.

    Returns:
        (loss scalar, number of positions whose draft argmax equals the target's argmax).
    """
    total, agree = hidden.new_zeros(()), 0
    N = hidden.shape[0]
    for s in range(0, N, chunk):
        logq = torch.log_softmax(lm_head(hidden[s:s + chunk]).float(), dim=-1)
        tl = top_logp[s:s + chunk]
        ptil = torch.softmax(tl, dim=-1)  # renormalized top-k of p
        lq_top = logq.gather(1, top_ids[s:s + chunk])
        kl = (ptil * (torch.log(ptil.clamp_min(1e-12)) - lq_top)).sum(-1)
        hard = -lq_top[:, 0]  # top-1 of p is column 0 (topk is sorted)
        total = total + (kl + hard_weight * hard).sum()
        agree += int((logq.argmax(-1) == top_ids[s:s + chunk, 0]).sum())
    return total / max(N, 1), agree


def train(student, samples: list[Sample], *, pad_id: int, epochs: float = 3.0, lr: float = 2e-3,
          tokens_per_batch: int = 4096, hard_weight: float = 0.5, weight_decay: float = 0.01,
          warmup_steps: int = 20, seed: int = 0, max_minutes: float | None = None,
          log_every: int = 10) -> list[dict]:
    """Distill the target into ``student`` in place (AdamW, linear warm-up then cosine decay).

    Args:
        samples: training samples (prompt + the target's answer with its top-k).
        epochs: passes over the data (fractional allowed).
        max_minutes: stop early (keeping the weights) after this much wall time.

    Returns:
        the training log: one dict per logged step {step, loss, agree, tokens, minutes}.

    Raises:
        InputError: with no samples.
    """
    if not samples:
        raise InputError("No training samples.")
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    batches = make_batches(samples, tokens_per_batch, seed)
    total_steps = max(1, int(round(epochs * len(batches))))

    def lr_at(step: int, minutes: float) -> float:
        # linear warm-up, then cosine decay to 5 % over the run; the run's progress is the larger of the
        # step fraction and the time fraction, so a time-capped run still ends at a low learning rate
        prog = step / total_steps
        if max_minutes:
            prog = max(prog, minutes / max_minutes)
        prog = min(1.0, prog)
        return lr * min(1.0, (step + 1) / max(1, warmup_steps)) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * prog)))

    log, t0 = [], time.perf_counter()
    run_loss, run_agree, run_n = 0.0, 0, 0
    step = 0
    ep = 0
    while step < total_steps:
        order = batches if ep == 0 else make_batches(samples, tokens_per_batch, seed + ep)
        for b in order:
            if step >= total_steps:
                break
            cur_lr = lr_at(step, (time.perf_counter() - t0) / 60)
            for g in opt.param_groups:
                g["lr"] = cur_lr
            ids, pos, tids, tlps = collate([samples[i] for i in b], pad_id)
            h = student.model(input_ids=ids).last_hidden_state  # (B, T, H)
            hs = h[pos[:, 0], pos[:, 1]]
            loss, agree = distill_loss(hs, student.lm_head, tids, tlps, hard_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            step += 1
            run_loss += loss.item() * len(pos)
            run_agree += agree
            run_n += len(pos)
            minutes = (time.perf_counter() - t0) / 60
            if step % log_every == 0 or step == total_steps:
                rec = {"step": step, "loss": run_loss / run_n, "agree": run_agree / run_n, "tokens": run_n,
                       "minutes": round(minutes, 2), "lr": cur_lr}
                log.append(rec)
                _log(f"[train] step {step}/{total_steps} loss {rec['loss']:.3f} train-agree "
                     f"{rec['agree']:.3f} lr {rec['lr']:.2e} {minutes:.1f} min")
                run_loss, run_agree, run_n = 0.0, 0, 0
            if max_minutes and minutes > max_minutes:
                _log(f"[train] time budget of {max_minutes} min reached at step {step}/{total_steps}")
                student.eval()
                return log
        ep += 1
    student.eval()
    return log


# ---------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_draft(target_model, draft_model, samples: list[Sample], temperature: float = 0.7) -> dict:
    """Held-out acceptance of a draft against the target, teacher-forced along the target's answers.

    For every answer position t of every sample (context = prompt + answer[:t]), with p and q the target's
    and the draft's next-token distributions over the full vocabulary:

    - greedy α = mean over positions of [argmax q == argmax p]. Measured on the target's *greedy* answers,
      this is exactly the per-token acceptance of greedy speculative decoding (which reproduces the
      target's greedy text), (Leviathan et al. 2023, §3 with temperature 0);
    - α at temperature T = mean over positions of Σ_x min(p_T(x), q_T(x)), the acceptance probability of
      speculative sampling (Leviathan et al. 2023, §3.3, "β"; Chen et al. 2023, Thm 1), where p_T, q_T
      are the softmax of logits / T. Measured on the target's *sampled* answers.

    Args:
        samples: held-out samples; greedy ones (temperature 0) feed greedy α, the others α at T.

    Returns:
        {"greedy_alpha", "greedy_positions", "alpha_T", "T", "sampled_positions",
         "greedy_alpha_on_sampled"} (None where there were no samples of that kind).
    """
    g_agree = g_n = s_agree = s_n = 0
    s_overlap = 0.0
    dv = min(target_model.config.vocab_size, draft_model.config.vocab_size)
    for s in samples:
        seq = torch.cat([s.prompt_ids.long(), s.response_ids.long()])[None]
        P, R = len(s.prompt_ids), len(s.response_ids)
        lp = target_model(input_ids=seq).logits[0, P - 1:P - 1 + R, :dv].float()
        lq = draft_model(input_ids=seq).logits[0, P - 1:P - 1 + R, :dv].float()
        agree = int((lp.argmax(-1) == lq.argmax(-1)).sum())
        if s.temperature == 0:
            g_agree += agree
            g_n += R
        else:
            s_agree += agree
            s_n += R
            p = torch.softmax(lp / temperature, -1)
            q = torch.softmax(lq / temperature, -1)
            s_overlap += float(torch.minimum(p, q).sum())
    return {
        "greedy_alpha": g_agree / g_n if g_n else None, "greedy_positions": g_n,
        "alpha_T": s_overlap / s_n if s_n else None, "T": temperature, "sampled_positions": s_n,
        "greedy_alpha_on_sampled": s_agree / s_n if s_n else None,
    }


# ---------------------------------------------------------------------------------------------- saving


def save_draft(student, out: Path, dtype: str = "fp16", meta: dict | None = None, tokenizer=None) -> Path:
    """Write config.json + model.safetensors (+ the tokenizer, train_meta.json) into ``out``.

    With the tokenizer saved too, ``engine.decoding.models.load_model(str(out))`` loads the folder on its own.
    """
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if dt is None:
        raise InputError(f"Unknown dtype {dtype!r}; use fp16, bf16 or fp32.")
    out.mkdir(parents=True, exist_ok=True)
    import copy

    m = copy.deepcopy(student).to(dt)
    m.config.dtype = dtype if dtype != "fp16" else "float16"
    m.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if meta is not None:
        (out / "train_meta.json").write_text(json.dumps(meta, indent=1))
    return out


# ---------------------------------------------------------------------------------------------- command line


def get_samples(target, tok, eos, split: str, n: int, path: Path, args, budget_min: float | None,
                greedy_fraction: float) -> list[Sample]:
    """Load cached samples from ``path`` or generate them (and cache them)."""
    if path.is_file() and not args.regenerate:
        _log(f"[data] reusing {path}")
        return load_samples(path)
    prompts = build_prompts(n, split, seed=args.seed)
    _log(f"[data] {split}: generating answers to {len(prompts)} prompts (max {args.max_new_tokens} tokens)")
    samples = generate_samples(target, tok, prompts, eos, greedy_fraction=greedy_fraction,
                               temperature=args.data_temperature, max_new_tokens=args.max_new_tokens,
                               batch_size=args.gen_batch, top_k=args.top_k, seed=args.seed + (split == "heldout"),
                               progress=_log, time_budget_s=None if budget_min is None else budget_min * 60)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_samples(samples, path)
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.training.train_draft", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded", help="target spec for engine.decoding.models.load_model")
    ap.add_argument("--out", default=str(ROOT / "assets" / "smollm2-draft"), help="output folder")
    ap.add_argument("--work-dir", default=str(ROOT / ".cache" / "draft-train"), help="data cache folder")
    ap.add_argument("--prompts", type=int, default=6000, help="training prompts to generate from")
    ap.add_argument("--heldout", type=int, default=96, help="held-out prompts (unseen topics)")
    ap.add_argument("--data-minutes", type=float, default=40.0, help="time budget for training data")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position")
    ap.add_argument("--greedy-fraction", type=float, default=0.4)
    ap.add_argument("--data-temperature", type=float, default=0.8)
    ap.add_argument("--regenerate", action="store_true", help="ignore cached data")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--train-minutes", type=float, default=35.0, help="stop training after this long")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--hard-weight", type=float, default=0.5)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10, help="training steps between progress lines")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.decoding.models import load_model

    t_start = time.perf_counter()
    target_lm = load_model(args.target, device="cpu")
    target, tok = target_lm.model, target_lm.tokenizer
    eos = target_lm.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    work = Path(args.work_dir)
    t0 = time.perf_counter()
    train_s = get_samples(target, tok, eos, "train", args.prompts, work / "train.pt", args, args.data_minutes,
                          args.greedy_fraction)
    held = get_samples(target, tok, eos, "heldout", args.heldout, work / "heldout.pt", args, None, 0.5)
    data_min = (time.perf_counter() - t0) / 60
    n_tok = sum(len(s.response_ids) for s in train_s)
    _log(f"[data] {len(train_s)} training answers ({n_tok} tokens), {len(held)} held-out, {data_min:.1f} min")

    shape = StudentShape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)
    student = build_student(target, shape, seed=args.seed)
    n_params = sum(p.numel() for p in student.parameters())
    _log(f"[train] draft: {shape}, {n_params / 1e6:.1f}M parameters")
    t1 = time.perf_counter()
    log = train(student, train_s, pad_id=pad, epochs=args.epochs, lr=args.lr,
                tokens_per_batch=args.tokens_per_batch, hard_weight=args.hard_weight, seed=args.seed,
                max_minutes=args.train_minutes, log_every=args.log_every)
    train_min = (time.perf_counter() - t1) / 60
    out = Path(args.out)
    meta = {"args": vars(args), "shape": vars(shape), "parameters": n_params, "train_answers": len(train_s),
            "train_tokens": n_tok, "heldout_answers": len(held), "data_minutes": round(data_min, 1),
            "train_minutes": round(train_min, 1), "log": log}
    save_draft(student, out, args.dtype, meta, tokenizer=tok)
    # Evaluate what was saved: reload (fp16 → fp32 cast) exactly as the engine does.
    draft_lm = load_model(str(out), device="cpu")
    ev = evaluate_draft(target, draft_lm.model, held)
    meta["heldout_eval"] = ev
    meta["total_minutes"] = round((time.perf_counter() - t_start) / 60, 1)
    (out / "train_meta.json").write_text(json.dumps(meta, indent=1))
    _log(f"[eval] held-out: {json.dumps(ev)}")
    _log(f"[done] draft written to {out} in {meta['total_minutes']} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
