"""Speedup Lab's engine: every number the app shows is computed here.

Modules: ``models`` (loading target/draft), ``sampling``, ``proposers``, ``speculative``, ``trace``,
``analytic``, ``prefix_cache``, ``flash``, ``kv_size``. Pages import from here and only draw.
"""
