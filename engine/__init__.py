"""Speedup Lab's engine: every number the app shows is computed here.

Subpackages, by concern (imports go one way: ``explain`` and ``training`` may use ``decoding``):

- ``engine.decoding``: the real speculative decoding engine (models, sampling rules, proposers, rounds,
  trace statistics, A/B measurement).
- ``engine.training``: pipelines that train the shipped drafts on the target's own answers.
- ``engine.explain``: the explainers' analytic models and simulators (What-if, prefix caching,
  FlashAttention, KV-cache size, teaching content).

``cli`` and ``__main__`` are the command line (``python -m engine ...``); ``errors`` holds the exceptions
whose messages are shown to users as they are. Pages (``pages/``) and presentation helpers (``app/``)
import from here and only draw.
"""
