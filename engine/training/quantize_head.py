"""Store a saved draft head's matrices as GGUF Q8_0 blocks (``engine.decoding.draft_head.q8_0_blocks``).

The head's fc and layer matrices become int8 codes with one fp16 scale per 32 values; norms, biases and the draft
vocabulary stay as they are. At decode time the streaming kernel reads each matrix as its exact "q8" compact form
(1.125 bytes a value, against 2 for fp16: ``engine.decoding.compute.compact_weight``), so a draft step reads about
half the bytes. The quantized head drafts a little differently; what the target accepts is still judged on the
target's p and the q the head drew from, so output stays exact (greedy identical to plain greedy, the sampling law
unchanged).

    .venv/bin/python -m engine.training.quantize_head assets/smollm2-head --out /tmp/head-q8

Measured on an AMD EPYC (2 threads; ``benchmarks/results/head_q8_0_amd-epyc.md``, 12 held-out prompts × 96 tokens,
greedy, γ = 2, the head made by the command above): α̂ 0.5768 against 0.5772 for the fp16 head, 104.7 against
103.6 tokens/s (1.30× against 1.28× plain): the draft step reads 8.7 instead of 15.5 MB, but the gain is within this
machine's noise (a draft step of the 2-layer head is not bound by its weights' bytes alone: its attention, norms
and per-call work weigh as much), so the shipped head stays fp16.

The head's config keeps its other entries (target, held-out agreement of the weights it was trained as) and gains
``"weights": "q8_0"`` and ``"quantized_from"`` (the source's weight format). The result is what ``save_head(head,
folder, weights="q8_0")`` writes for the same head. Other files in the source folder (its
card, training logs) are copied along when ``--out`` is another folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from engine.errors import SpeedupLabError


def quantize_head(src: str | Path, out: str | Path) -> Path:
    """Write the head in ``src`` to ``out`` with its matrices as Q8_0 (``out`` may be ``src``). Works on the saved
    tensors alone (no target model is loaded).

    Returns:
        the output folder.

    Raises:
        ModelLoadError: ``src`` holds no readable head, or one already stored as Q8_0.
    """
    import torch
    from safetensors.torch import save_file

    from engine.decoding.draft_head import HEAD_CONFIG, _quantizable, q8_0_blocks, read_head_files
    from engine.errors import ModelLoadError

    src, out = Path(src), Path(out)
    cfg, state = read_head_files(src)
    if cfg.get("weights", "f16") == "q8_0" or any(k.endswith(".q8") for k in state):
        raise ModelLoadError(f"The draft head in {str(src)!r} is stored as Q8_0 already.")
    new = {}
    for k, v in state.items():
        if v.is_floating_point() and _quantizable(k, v):
            new[k + ".q8"], new[k + ".d"] = (t.contiguous() for t in q8_0_blocks(v))
        else:
            new[k] = v.to(torch.float16).contiguous() if v.is_floating_point() else v
    if src.resolve() != out.resolve():
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.name not in (HEAD_CONFIG, "model.safetensors"):
                shutil.copy2(f, out / f.name)
    save_file(new, str(out / "model.safetensors"))
    cfg = {**cfg, "weights": "q8_0", "quantized_from": cfg.get("weights", "f16")}
    (out / HEAD_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.training.quantize_head", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a saved draft head folder (head_config.json + model.safetensors)")
    ap.add_argument("--out", required=True, help="output folder (may be src)")
    args = ap.parse_args(argv)
    try:
        print(quantize_head(args.src, args.out))
    except SpeedupLabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
