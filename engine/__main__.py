"""Command line: ``python -m engine prepare``, ``generate``, ``traffic``, ``batch-sweep``, ``serve-llamacpp``."""

from __future__ import annotations

import argparse
import sys


def _cmd_prepare(args: argparse.Namespace) -> int:
    from engine.decoding.models import prepare_embedded

    def progress(msg: str, frac: float) -> None:
        print(f"[{frac:4.0%}] {msg}", file=sys.stderr, flush=True)

    path = prepare_embedded(progress)
    print(f"Embedded model cached at {path}")
    # this machine's compute path and target pass-cost curve, measured once (later loads read them)
    from transformers.utils import logging as hf_logging

    from engine.decoding.models import load_model
    from engine.decoding.pass_cost import machine_pass_cost

    hf_logging.disable_progress_bar()
    target = load_model("embedded", device="cpu", progress=progress)
    print(f"Compute path: {target.compute.label()} [{target.compute.cpu}, {target.compute.threads} threads]")
    from engine.explain.machine import arithmetic_ceilings

    progress("Measuring this CPU's int8 and fp32 multiply-add ceilings…", 0.96)
    ceil = arithmetic_ceilings()
    if ceil:
        print(f"This CPU's arithmetic ceilings ({ceil['threads']} threads): int8 {ceil['int8']:.0f} G multiply-adds/s, "
              f"fp32 {ceil['fp32']:.0f} G/s ({ceil['int8'] / ceil['fp32']:.1f}×)")
    curve = machine_pass_cost(target, progress=progress)
    print("Target pass cost on this machine, × one token: "
          + ", ".join(f"{n}: {curve.ratio(n):.2f}" for n in sorted(curve.ms)) + f" ({curve.source})")
    rounds = curve.extra.get("head_rounds")
    if rounds:
        from engine.explain.analytic import default_gamma_here

        plain = float(rounds["plain_ms"])
        print(f"Draft head rounds on this machine, × a plain step ({plain:.1f} ms): "
              + ", ".join(f"γ {g}: {float(v) / plain:.2f}" for g, v in sorted(rounds["round_ms"].items(),
                                                                            key=lambda kv: int(kv[0]))))
        g, why = default_gamma_here("embedded-head")
        print(f"The draft head's default γ here: {g} ({why})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Speedup Lab engine")
    sub = parser.add_subparsers(dest="cmd", required=True,
                                metavar="{prepare,generate,traffic,batch-sweep,draft-card,serve-llamacpp}",
                                title="commands (python -m engine COMMAND --help for each)")
    p = sub.add_parser("prepare", help="dequantize the embedded model once into the user cache, choose this "
                                        "machine's compute path and measure its target pass-cost curve")
    p.set_defaults(func=_cmd_prepare)
    from engine.cli import add_generate  # the generate command (speculative decoding)

    add_generate(sub)
    from engine.cli_traffic import add_traffic  # the traffic command (acceptance profile of /metrics text)

    add_traffic(sub)
    from engine.cli import add_batch_sweep  # the batch sweep (batched decoding against batch size)

    add_batch_sweep(sub)
    from engine.cli import add_draft_card  # a shipped draft's model card, measured

    add_draft_card(sub)
    from engine.serving.llamacpp import add_serve  # llama.cpp's llama-server, built once, on the embedded model

    add_serve(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:  # noqa: BLE001
        from engine.errors import SpeedupLabError

        if isinstance(e, SpeedupLabError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
