"""The real speculative decoding engine (PyTorch + transformers, CPU or CUDA).

- ``models``: loading the target and draft models (embedded GGUF, Hugging Face ids, folders), tokenizer check.
- ``sampling``: logits → p, the accept/reject rules (greedy; speculative sampling with its residual).
- ``proposers``: where draft tokens come from (draft model, prompt lookup, early exit, the EAGLE-style head).
- ``draft_head``: the EAGLE-style feature head itself (an ``nn.Module`` and its folder format).
- ``speculative``: the round (draft → one target pass → judge → KV rollback) and ``generate``.
- ``trace``: per-round trace records and run statistics (α̂, tokens per pass, c, verify-cost curve).
- ``measure``: speculative vs plain decoding timed A B B A, and the baseline comparison.

Nothing here imports ``engine.explain`` or ``engine.training``.
"""
