"""Training pipelines for the shipped drafts, on the target's own answers (run by hand, on CPU or CUDA).

- ``draft_data``: prompts → the target's greedy/sampled answers, cached as training samples.
- ``train_draft``: a small separate draft model distilled from the target (``python -m engine.training.train_draft``).
- ``train_head``: the EAGLE-style feature head (``python -m engine.training.train_head``).

Uses ``engine.decoding`` (models, the head's module); nothing in ``engine.decoding`` imports this package.
"""
