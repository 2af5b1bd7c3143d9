"""The explainers' models and simulators: what the teaching pages compute, each tested against
hand-computed values.

- ``analytic``: expected tokens per pass E(α, γ), speedup, best γ, break-even α, batch roofline, predicted
  vs measured.
- ``drafting``: sequential vs parallel (block) drafting: round cost and speedup by γ, acceptance by position
  with a decay, an oracle confidence cut; the measured block-drafter results (``benchmarks/results/block_amd-epyc.json``).
- ``toy``: the reference text's two-word toy target and draft, for exact distribution checks.
- ``prefix_cache``: paged KV blocks with a hash chain and an LRU pool; measured TTFT with reuse.
- ``flash``: tiled attention with online softmax, HBM-traffic model, measured naive vs fused.
- ``kv_size``: KV-cache bytes for MHA/GQA/MQA/MLA/sliding windows, memory fit, decode roofline.
- ``teaching``: questions, tour stops, trade-offs, common mistakes, recap (content, not widgets).
- ``presets``: the prompt presets the pages share.

May use ``engine.decoding`` (to measure on the real model); never the reverse.
"""
