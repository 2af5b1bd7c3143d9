"""Your own traffic: an acceptance profile from a serving engine's metrics, and the settings it implies.

A serving engine that speculates counts, per draft, how many draft tokens it proposed and how many the
target kept, and (vLLM, llama.cpp) how often each draft position was kept. This module turns those
counters into the analytic model's numbers (:mod:`engine.explain.analytic`): the measured acceptance per
position, the tokens per target pass it gives for any γ, the best γ for a draft cost c, and the flags to
run each engine with.

Sources, each checked against the engine's own code:

- **vLLM v1**, ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats.observe_draft``, ``SpecDecodingProm``):
  prometheus_client Counters ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
  ``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos`` (label
  ``position``), exposed with the ``_total`` suffix (plus ``_created`` samples), labels ``model_name`` and
  ``engine`` (``vllm/v1/metrics/loggers.py``: ``labelnames = ["model_name", "engine"]``, one engine index
  per data-parallel engine core). ``observe_draft(num_draft_tokens, num_accepted_tokens)`` adds 1 to
  drafts, adds both counts, and adds 1 to ``per_pos[i]`` for every i < num_accepted: so ``per_pos[i]`` is
  the number of drafts with at least i + 1 accepted tokens, and Σ_i per_pos[i] = accepted.
  vLLM's own definitions (its docstring's PromQL): acceptance rate = accepted ÷ draft tokens; mean
  acceptance length = 1 + accepted ÷ drafts ("conventionally including the bonus token"); per-position
  acceptance rate = per_pos[i] ÷ drafts.
- **llama.cpp server** (``llama-server --metrics``), ``tools/server/server-task.cpp``
  ``server_task_result_metrics::to_metrics()``: counters ``llamacpp:spec_decode_num_draft_tokens_total``,
  ``llamacpp:spec_decode_num_accepted_tokens_total``, ``llamacpp:spec_decode_num_drafts_total`` ("total
  speculative decoding verification steps") and the labelled
  ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` (same meaning as vLLM's). The
  text is written by hand (HELP/TYPE lines, no labels, no ``_created`` samples); the unlabelled counters are
  printed through a C++ stream as doubles with 6 significant digits, so a count above 999 999 arrives
  rounded (``3.05406e+06``), while the per-position counts are exact integers.
- **SGLang**, ``python/sglang/srt/metrics/collector.py`` (``SchedulerMetricsCollector``) and
  ``python/sglang/srt/managers/scheduler_metrics_mixin.py``: Gauges ``sglang:spec_accept_length`` =
  (accepted draft tokens + one per request step) ÷ request steps, i.e. the mean acceptance length with the
  bonus token, and ``sglang:spec_accept_rate`` = that same numerator ÷ (steps × ``--speculative-num-draft-tokens``).
  Both are means over the last logging interval (``--decode-log-interval`` decode batches), not counters:
  there is no per-position data and no count of drafts, so two scrapes are not differenced.

- **SGLang, counters** (same ``collector.py``, ``TokenizerMetricsCollector``): the Counter
  ``sglang:spec_verify_calls_total`` ("Number of speculative decoding verification calls") beside
  ``sglang:generation_tokens_total``; ``observe_one_finished_request`` adds a request's ``spec_verify_ct`` and its
  generation tokens when the request *finishes* (requests still running at a scrape are in neither). Tokens per
  target pass = Δ generation tokens ÷ Δ verify calls over a window, the bonus token included, as a counter
  (unlike the gauges); each request's first token (from its prefill) is counted too, so short answers read a
  little high. γ still comes from the gauges (``--speculative-num-draft-tokens`` = length ÷ rate).
- **TensorRT-LLM**, ``tensorrt_llm/metrics/collector.py`` (``MetricsCollector``, prefix ``trtllm_``,
  ``log_iteration_stats``): Counters ``trtllm_spec_decode_num_draft_tokens_total`` and
  ``trtllm_spec_decode_num_accepted_tokens_total`` (each iteration's ``specDecodingStats.numDraftTokens`` /
  ``numAcceptedTokens`` added), Gauges ``trtllm_spec_decode_acceptance_length`` and
  ``trtllm_spec_decode_draft_overhead`` (the last iteration's ``acceptanceLength``, "average number of tokens
  produced per step for all requests with at least one draft token", and draft time ÷ iteration time:
  ``cpp/include/tensorrt_llm/executor/types.h``, ``SpecDecodingStats``); labels from the server
  (``model_name``, ``engine_type``). No count of drafts and no per-position counter is exported
  (``numRequestsWithDraftTokens`` exists in the C++ stats but not in Prometheus), so: acceptance rate =
  Δaccepted ÷ Δdraft tokens (window), γ = round((gauge − 1) ÷ rate) assuming every draft had γ tokens, mean
  acceptance length = 1 + rate × γ.
- **vLLM per request**, ``--per-request-spec-decode-metrics summary|detailed``: each single-sequence response
  carries ``metrics.speculative_decoding`` (vLLM ``docs/features/speculative_decoding/acceptance_metrics.md``;
  marked experimental there): ``num_spec_steps``, ``num_draft_tokens``, ``num_accepted_draft_tokens``,
  ``num_spec_tokens`` (k), ``acceptance_histogram`` ([k + 1], index j = steps that accepted exactly j draft
  tokens), ``acceptance_histogram_by_draft_length`` ({"k": [k + 1]} per proposed length) and, with ``detailed``,
  ``per_step_accepted`` / ``per_step_drafted``. Summed over requests they reconcile with the /metrics counters
  (that page's table: steps ↔ drafts). per_pos[i] = Σ_{j > i} histogram[j]; judged positions come exactly from
  the per-length histogram or the per-step arrays. (The field's Python source was not in the searched vLLM
  snapshot; the repository's own documentation page is the source used.)

Terms: a *draft* is one proposal of up to γ tokens judged by one target pass (a round);
``survival[i]`` = P(A ≥ i + 1) = per_pos[i] ÷ drafts, the chance a draft's token i is kept (all before it
kept too); ``conditional_alpha[i]`` = α_i = per_pos[i] ÷ per_pos[i − 1] (per_pos[−1] = drafts), the chance
token i is kept given the tokens before it were: the analytic model's α, position by position
(Leviathan et al. 2023, Section 3.1, with a different α per position). The analytic model's single
α̂ = accepted ÷ judged (judged: draft tokens the target actually evaluated, accepted or rejected) is a
third number, neither vLLM's acceptance rate (accepted ÷ all draft tokens, which also counts the tokens
after a rejection) nor any one α_i.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from engine.errors import InputError
from engine.explain.analytic import (
    GAMMA_MAX,
    expected_tokens_per_pass,
    speedup_from_tokens,
    verify_cost_ratio,
)

ENGINES = ("vllm", "llama.cpp", "sglang", "tensorrt-llm", "speedup-lab")
ENGINE_TITLES = {"vllm": "vLLM", "llama.cpp": "llama.cpp server", "sglang": "SGLang",
                 "tensorrt-llm": "TensorRT-LLM", "speedup-lab": "this app's engine"}
ALLOWED_HOSTS_ENV = "SPEEDUP_LAB_ALLOWED_HOSTS"
"""Environment variable: comma-separated host names (or host:port) the app may fetch besides loopback."""
FETCH_TIMEOUT_S = 5.0
FETCH_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_DRAFT_COST = 0.05
UNCERTAINTY_DRAWS = 2000

# counter names as they appear in the exposition (sample names, with the _total suffix)
_VLLM = {"drafts": "vllm:spec_decode_num_drafts_total",
         "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
         "accepted": "vllm:spec_decode_num_accepted_tokens_total",
         "per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
_LLAMA = {"drafts": "llamacpp:spec_decode_num_drafts_total",
          "draft_tokens": "llamacpp:spec_decode_num_draft_tokens_total",
          "accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
          "per_pos": "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"}
_SGLANG = {"length": "sglang:spec_accept_length", "rate": "sglang:spec_accept_rate",
           "verify": "sglang:spec_verify_calls_total"}
_SGLANG_GENERATED = "sglang:generation_tokens_total"
_TRTLLM = {"draft_tokens": "trtllm_spec_decode_num_draft_tokens_total",
           "accepted": "trtllm_spec_decode_num_accepted_tokens_total",
           "length": "trtllm_spec_decode_acceptance_length", "overhead": "trtllm_spec_decode_draft_overhead"}


# ---------------------------------------------------------------------------------------------
# The profile


@dataclass(frozen=True)
class AcceptanceProfile:
    """Speculative-decoding counts of one model on one server (or one run of this app's engine).

    Attributes:
        engine: one of ``ENGINES``.
        model: the ``model_name`` label (vLLM, SGLang), the run's target (ours), None for llama.cpp.
        drafts: number of drafts (verification steps that judged ≥ 1 draft token); None for SGLang.
        draft_tokens: draft tokens proposed; None for SGLang.
        accepted_tokens: draft tokens the target kept; None for SGLang.
        accepted_per_pos: [γ] per_pos[i] = drafts with at least i + 1 tokens kept; empty for SGLang
            and for a llama.cpp build without the per-position counter.
        judged_per_pos: [γ] times position i was judged, when known (this app's runs); else None.
        mean_length_gauge, accept_rate_gauge: SGLang's two gauges; TensorRT-LLM's acceptance-length gauge.
        window: what the counts cover ("since the server started", "between the two scrapes", ...).
        source: where the numbers came from, in words.
        notes: caveats found while reading (summed engines, rounded counters, ...).
        verify_calls, generation_tokens: SGLang's ``spec_verify_calls_total`` and ``generation_tokens_total``
            over the window (None when the scrape has no verify counter or it did not move).
        draft_overhead_gauge: TensorRT-LLM's ``spec_decode_draft_overhead`` (draft time ÷ iteration time).
    """

    engine: str
    model: str | None
    drafts: float | None
    draft_tokens: float | None
    accepted_tokens: float | None
    accepted_per_pos: tuple[float, ...] = ()
    judged_per_pos: tuple[float, ...] | None = None
    mean_length_gauge: float | None = None
    accept_rate_gauge: float | None = None
    window: str = "since the server started"
    source: str = ""
    notes: tuple[str, ...] = ()
    verify_calls: float | None = None
    generation_tokens: float | None = None
    draft_overhead_gauge: float | None = None

    # ------------------------------------------------------------------ vLLM's definitions
    @property
    def has_counts(self) -> bool:
        """Whether the profile has counts (vLLM, llama.cpp, ours) rather than SGLang's gauges only."""
        return self.drafts is not None

    @property
    def per_position(self) -> bool:
        """Whether per-position counts exist (no for SGLang and older llama.cpp builds)."""
        return bool(self.accepted_per_pos)

    @property
    def tokens_per_pass_counter(self) -> float | None:
        """SGLang: Δ generation tokens ÷ Δ verify calls (bonus token included; see the module docstring)."""
        if self.verify_calls and self.generation_tokens is not None:
            return self.generation_tokens / self.verify_calls
        return None

    @property
    def gamma(self) -> int | None:
        """γ the server ran: the number of draft positions counted (vLLM creates one counter per position of
        ``num_speculative_tokens``); for SGLang the chain length implied by its gauges; for TensorRT-LLM
        round((acceptance-length gauge − 1) ÷ acceptance rate); None if unknown."""
        if self.accepted_per_pos:
            return len(self.accepted_per_pos)
        if self.engine == "tensorrt-llm":
            if not self.draft_tokens or self.mean_length_gauge is None or not self.accepted_tokens:
                return None
            return max(int(round((self.mean_length_gauge - 1.0) / (self.accepted_tokens / self.draft_tokens))), 1)
        if self.engine == "sglang":
            n = self.sglang_draft_tokens
            return None if n is None else max(int(round(n)) - 1, 1)
        if self.has_counts and self.drafts:
            return max(int(math.ceil(self.draft_tokens / self.drafts - 1e-9)), 1)
        return None

    @property
    def acceptance_rate(self) -> float | None:
        """vLLM's acceptance rate: accepted ÷ draft tokens (``SpecDecodingProm`` docstring). For SGLang,
        (length − 1) ÷ γ with γ = ``sglang_draft_tokens`` − 1, the same definition for a chain draft
        (``--speculative-eagle-topk 1``)."""
        if self.has_counts or self.engine == "tensorrt-llm":
            return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        g = self.gamma
        if self.mean_length_gauge is None or not g:
            return None
        return (self.mean_length_gauge - 1.0) / g

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted ÷ drafts, bonus token included (vLLM ``SpecDecodingLogging.log``). SGLang: Δ generation
        tokens ÷ Δ verify calls when its counter is there, else its gauge. TensorRT-LLM: 1 + rate × γ (γ as in
        :attr:`gamma`), else its gauge."""
        if self.has_counts:
            return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None
        if self.engine == "sglang" and self.tokens_per_pass_counter is not None:
            return self.tokens_per_pass_counter
        if self.engine == "tensorrt-llm":
            g, r = self.gamma, self.acceptance_rate
            if g and r is not None:
                return 1.0 + r * g
        return self.mean_length_gauge

    @property
    def sglang_draft_tokens(self) -> float | None:
        """SGLang: ``--speculative-num-draft-tokens`` implied by its gauges, length ÷ rate (both share the
        numerator in ``scheduler_metrics_mixin.py``); None when the rate is 0 or missing."""
        if self.mean_length_gauge is None or not self.accept_rate_gauge:
            return None
        return self.mean_length_gauge / self.accept_rate_gauge

    # ------------------------------------------------------------------ per position
    @property
    def survival(self) -> list[float]:
        """[γ] P(A ≥ i + 1) = per_pos[i] ÷ drafts: vLLM's "per-position acceptance rate"."""
        if not self.per_position or not self.drafts:
            return []
        return [x / self.drafts for x in self.accepted_per_pos]

    @property
    def conditional_alpha(self) -> list[float | None]:
        """[γ] α_i = per_pos[i] ÷ per_pos[i − 1] (per_pos[−1] = drafts): P(token i kept | tokens before it kept).
        None after a position nobody reached (0 ÷ 0)."""
        if not self.per_position or not self.drafts:
            return []
        prev, out = [self.drafts, *self.accepted_per_pos[:-1]], []
        for a, b in zip(self.accepted_per_pos, prev):
            out.append(a / b if b else None)
        return out

    @property
    def full_length_drafts(self) -> bool:
        """Whether every draft had γ tokens (draft tokens = drafts × γ). Otherwise some drafts were shorter
        (n-gram lookup, ``--draft-min`` < ``--draft-max``, a confidence gate, the end of a request), so
        per_pos[i − 1] over-counts the drafts that reached position i and α_i reads low."""
        if not self.has_counts or not self.per_position:
            return False
        return abs(self.draft_tokens - self.drafts * len(self.accepted_per_pos)) <= 0.5

    @property
    def judged(self) -> float | None:
        """Draft tokens the target judged: this app's runs count them; from counters, drafts + Σ_{i<γ−1}
        per_pos[i] (position 0 of every draft, position i + 1 after each kept token i), exact only when every
        draft had γ tokens (``full_length_drafts``); None otherwise."""
        if self.judged_per_pos is not None:
            return float(sum(self.judged_per_pos))
        if not self.full_length_drafts:
            return None
        return self.drafts + float(sum(self.accepted_per_pos[:-1]))

    @property
    def alpha_hat(self) -> float | None:
        """α̂ = accepted ÷ judged, the analytic model's single α (engine.decoding.trace.RunStats.acceptance_rate;
        the maximum-likelihood α when every judged token is kept independently with probability α). For
        SGLang, and for counters whose drafts were not all γ long (judged unknown), the α whose E(α, γ) equals
        the mean acceptance length (:func:`alpha_for_length`), γ = :attr:`gamma`."""
        j = self.judged
        if self.has_counts and j:
            return self.accepted_tokens / j
        g, length = self.gamma, self.mean_acceptance_length
        if not g or length is None:
            return None
        return alpha_for_length(min(length, g + 1.0), g)

    def counts_dict(self) -> dict[str, Any]:
        """The counts as plain numbers (for JSON and comparisons)."""
        return {"engine": self.engine, "model": self.model, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}


def alpha_for_length(length: float, gamma: int) -> float:
    """The constant α with E(α, γ) = ``length`` (Leviathan et al. 2023, Eq. 1, solved for α by scipy's brentq).

    Raises:
        InputError: length outside [1, γ + 1].
    """
    from scipy.optimize import brentq

    g = int(gamma)
    if not (1.0 - 1e-9 <= length <= g + 1 + 1e-9):
        raise InputError(f"A mean acceptance length of {length:g} is impossible with γ = {g}: it must be between "
                         f"1 and γ + 1 = {g + 1}.")
    if length <= 1.0:
        return 0.0
    if length >= g + 1:
        return 1.0
    return float(brentq(lambda a: expected_tokens_per_pass(a, g) - length, 0.0, 1.0, xtol=1e-12))


# ---------------------------------------------------------------------------------------------
# Reading Prometheus text


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample, parsed by prometheus_client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    if not isinstance(text, str) or not text.strip():
        raise InputError("The scrape is empty: paste the text a server's /metrics address returns.")
    try:
        return [(s.name, dict(s.labels), float(s.value))
                for fam in text_string_to_metric_families(text) for s in fam.samples]
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError, IndexError, KeyError, ...
        first = next((ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")), "")
        raise InputError(f"This is not Prometheus text exposition format ({e}). A scrape has lines like "
                         f"'vllm:spec_decode_num_drafts_total{{model_name=\"m\",engine=\"0\"}} 120'; "
                         f"the first data line here reads: {first[:80]!r}.") from None


def detect_engine(text: str) -> str | None:
    """"vllm", "llama.cpp", "sglang", "tensorrt-llm" or None: which engine's speculative metrics the text has
    (vLLM first)."""
    names = {n for n, _, _ in _samples(text)}
    for eng, table in (("vllm", _VLLM), ("llama.cpp", _LLAMA), ("sglang", _SGLANG), ("tensorrt-llm", _TRTLLM)):
        if names & set(table.values()):
            return eng
    return None


def _no_metrics_error() -> InputError:
    return InputError(
        "The scrape has no speculative-decoding metrics (looked for vllm:spec_decode_*, "
        "llamacpp:spec_decode_*, sglang:spec_accept_* / sglang:spec_verify_calls_total and "
        "trtllm_spec_decode_*). Is speculation on (vLLM --speculative-config, SGLang --speculative-algorithm with "
        "--enable-metrics, llama-server -md/--spec-type with --metrics, TensorRT-LLM with iteration stats)?")


@dataclass
class _Raw:
    """Counters of one scrape, for one model: totals and per-position counts keyed by position."""

    engine: str
    model: str | None
    totals: dict[str, float]
    per_pos: dict[int, float]
    gauges: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _models_in(samples, names: set[str]) -> list[str]:
    return sorted({lab.get("model_name", "") for n, lab, _ in samples if n in names})


def _read(text: str, model: str | None = None) -> _Raw:
    samples = _samples(text)
    names = {n for n, _, _ in samples}
    if names & set(_VLLM.values()):
        engine, table = "vllm", _VLLM
    elif names & set(_LLAMA.values()):
        engine, table = "llama.cpp", _LLAMA
    elif names & set(_SGLANG.values()):
        engine, table = "sglang", _SGLANG
    elif names & set(_TRTLLM.values()):
        engine, table = "tensorrt-llm", _TRTLLM
    else:
        raise _no_metrics_error()
    notes: list[str] = []
    wanted = set(table.values())
    picked = model
    if engine in ("vllm", "sglang", "tensorrt-llm"):
        models = _models_in(samples, wanted)
        if model is not None and model not in models:
            raise InputError(f"No speculative metrics for model {model!r} in this scrape; it has: "
                             + ", ".join(repr(m) for m in models) + ".")
        if model is None:
            if len(models) > 1:
                raise InputError(f"This scrape has speculative metrics for {len(models)} models ("
                                 + ", ".join(repr(m) for m in models) + "): choose one (--model NAME, or the "
                                 "page's Model box).")
            picked = models[0] or None
        samples = [s for s in samples if s[1].get("model_name", "") == (picked or "")]
    if engine in ("sglang", "tensorrt-llm"):
        gauge_keys = ("length", "rate", "overhead")
        gauges: dict[str, list[float]] = {}
        totals_sg: dict[str, float] = {}
        for n, lab, v in samples:
            if engine == "sglang" and n == _SGLANG_GENERATED and math.isfinite(v):
                totals_sg["generated"] = totals_sg.get("generated", 0.0) + v
            for key, name in table.items():
                if n == name and math.isfinite(v):
                    if key in gauge_keys:
                        gauges.setdefault(key, []).append(v)
                    else:
                        totals_sg[key] = totals_sg.get(key, 0.0) + v
        if engine == "sglang" and "length" not in gauges and "verify" not in totals_sg:
            raise InputError("The SGLang scrape has sglang:spec_accept_rate but no sglang:spec_accept_length.")
        if engine == "tensorrt-llm" and ("draft_tokens" not in totals_sg or "accepted" not in totals_sg):
            raise InputError("The TensorRT-LLM scrape lacks trtllm_spec_decode_num_draft_tokens_total or "
                             "trtllm_spec_decode_num_accepted_tokens_total.")
        if len(gauges.get("length", [])) > 1:
            notes.append(f"{len(gauges['length'])} {ENGINE_TITLES[engine]} ranks report; their gauges are averaged "
                         "without weights (no counts to weight them by).")
        return _Raw(engine, picked, totals_sg, {}, {k: float(np.mean(v)) for k, v in gauges.items()}, notes)
    totals = {k: 0.0 for k in ("drafts", "draft_tokens", "accepted")}
    per_pos: dict[int, float] = {}
    engines_seen = set()
    for n, lab, v in samples:
        if n == table["per_pos"]:
            try:
                pos = int(lab.get("position", ""))
            except ValueError:
                raise InputError(f"{n} has a position label that is not a whole number: "
                                 f"{lab.get('position')!r}.") from None
            per_pos[pos] = per_pos.get(pos, 0.0) + v
        else:
            for key in totals:
                if n == table[key]:
                    totals[key] += v
                    engines_seen.add(lab.get("engine"))
    if len(engines_seen) > 1:
        notes.append(f"Summed over {len(engines_seen)} vLLM engines (label engine = "
                     + ", ".join(sorted(str(e) for e in engines_seen)) + ") of this model.")
    if engine == "llama.cpp":
        big = [k for k, v in totals.items() if v >= 1e6]
        if big:
            notes.append("llama.cpp prints these counters with 6 significant digits, so counts of a million or "
                         "more are rounded: " + ", ".join(table[k] for k in big) + ".")
    return _Raw(engine, picked, totals, per_pos, {}, notes)


def _check_and_build(raw: _Raw, window: str, source: str) -> AcceptanceProfile:
    if raw.engine == "tensorrt-llm":
        t = raw.totals
        if t["draft_tokens"] <= 0:
            raise InputError(f"Zero draft tokens ({_TRTLLM['draft_tokens']} = 0 {window}): the server has not "
                             "speculated. Send some requests, then scrape again.")
        if t["accepted"] > t["draft_tokens"] + 1e-9 or t["accepted"] < 0:
            raise InputError(f"More accepted tokens ({t['accepted']:g}) than draft tokens ({t['draft_tokens']:g}).")
        length = raw.gauges.get("length")
        notes = list(raw.notes) + [
            "TensorRT-LLM exports draft and accepted tokens but no count of drafts and no per-position counts: "
            "the acceptance rate is exact over the window; γ is inferred from the acceptance-length gauge (its "
            "last iteration), assuming every draft had γ tokens; the geometric model with one α is fitted."]
        if length is None or length <= 1.0:
            notes.append("trtllm_spec_decode_acceptance_length is missing or ≤ 1, so γ cannot be inferred.")
        return AcceptanceProfile("tensorrt-llm", raw.model, None, t["draft_tokens"], t["accepted"],
                                 mean_length_gauge=length, draft_overhead_gauge=raw.gauges.get("overhead"),
                                 window=window, source=source, notes=tuple(notes))
    if raw.engine == "sglang":
        length = raw.gauges.get("length")
        rate = raw.gauges.get("rate")
        verify, generated = raw.totals.get("verify"), raw.totals.get("generated")
        if verify is not None and verify > 0 and generated is not None:
            notes = list(raw.notes) + [
                f"Tokens per target pass = Δ{_SGLANG_GENERATED} ÷ Δ{_SGLANG['verify']} = {generated:g} ÷ "
                f"{verify:g} (counters, {window}); SGLang adds both when a request finishes, and each request's "
                "first token (from its prefill) is in the numerator, so short answers read a little high. No "
                "per-position acceptance: the geometric model with one α is fitted, γ from the gauges."]
            if rate is None or rate <= 0 or length is None:
                notes.append("sglang:spec_accept_rate/length missing or 0, so γ cannot be inferred: enter γ by hand.")
            return AcceptanceProfile("sglang", raw.model, None, None, None, mean_length_gauge=length,
                                     accept_rate_gauge=rate, window=window, source=source, notes=tuple(notes),
                                     verify_calls=verify, generation_tokens=generated)
        if length is None:
            raise InputError(f"No SGLang verify calls {window} and no sglang:spec_accept_length gauge: nothing "
                             "to measure. Send traffic, then scrape again.")
        if length <= 0:
            raise InputError("sglang:spec_accept_length is 0: SGLang has not speculated in its last logging "
                             "interval (zero drafts). Send traffic, then scrape again.")
        notes = list(raw.notes) + [
            "SGLang exposes only means (gauges over its last logging interval): no per-position acceptance and "
            "no count of drafts, so the geometric model with one α is all that can be fitted, with no "
            "uncertainty."]
        if rate is None or rate <= 0:
            notes.append("sglang:spec_accept_rate is missing or 0, so γ cannot be inferred: enter γ by hand.")
        return AcceptanceProfile("sglang", raw.model, None, None, None, mean_length_gauge=length,
                                 accept_rate_gauge=rate, window="SGLang's last logging interval, gauges",
                                 source=source, notes=tuple(notes))
    t = raw.totals
    table = _VLLM if raw.engine == "vllm" else _LLAMA
    if t["drafts"] <= 0:
        raise InputError(f"Zero drafts ({table['drafts']} = 0 {window}): the server has not speculated, so there "
                         "is nothing to measure. Send some requests, then scrape again.")
    if any(v < 0 for v in t.values()):
        raise InputError("A speculative counter is negative, which counters never are.")
    positions = sorted(raw.per_pos)
    if positions and positions != list(range(len(positions))):
        missing = sorted(set(range(positions[-1] + 1)) - set(positions))
        raise InputError(f"{table['per_pos']} lacks position(s) {missing}: positions must run 0, 1, 2, …")
    per = [raw.per_pos[i] for i in positions]
    for i in range(1, len(per)):
        if per[i] > per[i - 1] + 1e-9:
            raise InputError(
                f"The per-position counters are not monotone: position {i} has {per[i]:g} accepted tokens but "
                f"position {i - 1} only {per[i - 1]:g}. A draft token counts at position i only if every token "
                "before it was kept, so the counts cannot rise with position: this is not one server's scrape.")
    if per and per[0] > t["drafts"] + 1e-9:
        raise InputError(f"Position 0 has {per[0]:g} accepted tokens but there were only {t['drafts']:g} drafts.")
    if t["accepted"] > t["draft_tokens"] + 1e-9:
        raise InputError(f"More accepted tokens ({t['accepted']:g}) than draft tokens ({t['draft_tokens']:g}).")
    notes = list(raw.notes)
    if per and abs(sum(per) - t["accepted"]) > max(0.5, 1e-5 * t["accepted"]):
        notes.append(f"The per-position counts add up to {sum(per):g}, not the {t['accepted']:g} accepted tokens; "
                     "the charts use the per-position counts, the rates the totals.")
    if not per:
        notes.append("No per-position counter in this scrape (an older build?): only the means and the "
                     "geometric model are available.")
    return AcceptanceProfile(raw.engine, raw.model, t["drafts"], t["draft_tokens"], t["accepted"], tuple(per),
                             window=window, source=source, notes=tuple(notes))


def profile_from_text(text: str, model: str | None = None, source: str = "pasted scrape") -> AcceptanceProfile:
    """The profile of one scrape (counts since the server started).

    Args:
        text: Prometheus text exposition (what ``GET /metrics`` returns).
        model: the ``model_name`` label to read when the scrape has several (vLLM, SGLang).

    Raises:
        InputError: not Prometheus text, no speculative metrics, several models and none chosen, zero
            drafts, per-position counters not monotone in position, or otherwise inconsistent counts.
    """
    return _check_and_build(_read(text, model), "since the server started", source)


def profile_from_scrapes(before: str, after: str, model: str | None = None,
                         source: str = "two pasted scrapes") -> AcceptanceProfile:
    """The profile of the traffic between two scrapes: after − before for every counter.

    SGLang's gauges are means over the last interval, not counters: the ``after`` scrape is used as is.

    Raises:
        InputError: as :func:`profile_from_text`, plus the two scrapes from different engines or models, and
            a counter that went down between them (a server restart), named with both values.
    """
    a, b = _read(before, model), _read(after, model)
    if a.engine != b.engine:
        raise InputError(f"The first scrape is from {ENGINE_TITLES[a.engine]}, the second from "
                         f"{ENGINE_TITLES[b.engine]}: both must come from the same server.")
    if a.model != b.model:
        raise InputError(f"The scrapes are of different models ({a.model!r}, {b.model!r}): choose one.")
    if b.engine in ("sglang", "tensorrt-llm"):
        table = _SGLANG if b.engine == "sglang" else _TRTLLM
        names = {**table, "generated": _SGLANG_GENERATED}
        down = [f"{names[k]} {a.totals[k]:g} → {b.totals.get(k, 0.0):g}" for k in a.totals
                if b.totals.get(k, 0.0) < a.totals[k]]
        if down:
            raise InputError("A counter went down between the two scrapes (" + "; ".join(down) + "): the server "
                             "restarted in between, so the difference means nothing. Take both scrapes after the "
                             "restart, or use the second scrape alone.")
        diff = _Raw(b.engine, b.model, {k: v - a.totals.get(k, 0.0) for k, v in b.totals.items()}, {}, b.gauges,
                    b.notes)
        if b.engine == "sglang" and not diff.totals.get("verify"):
            diff.totals.pop("verify", None)
            p = _check_and_build(diff, "between the two scrapes", source)
            return dataclasses.replace(p, notes=p.notes + (
                "SGLang's gauges are means, not counters, so the two scrapes are not differenced: the second one "
                "is used (no sglang:spec_verify_calls_total moved between them).",))
        p = _check_and_build(diff, "between the two scrapes", source)
        return dataclasses.replace(p, notes=p.notes + (
            f"The gauges ({table['length']}) are the second scrape's; the counters are differenced.",))
    table = _VLLM if b.engine == "vllm" else _LLAMA
    down = [f"{table[k]} {a.totals[k]:g} → {b.totals[k]:g}" for k in a.totals if b.totals[k] < a.totals[k]]
    down += [f"{table['per_pos']}{{position=\"{i}\"}} {a.per_pos[i]:g} → {b.per_pos.get(i, 0.0):g}"
             for i in sorted(a.per_pos) if b.per_pos.get(i, 0.0) < a.per_pos[i]]
    if down:
        shown = "; ".join(down[:3]) + (f"; and {len(down) - 3} more" if len(down) > 3 else "")
        raise InputError("A counter went down between the two scrapes (" + shown + "): the server "
                         "restarted in between, so the difference means nothing. Take both scrapes after the "
                         "restart, or use the second scrape alone.")
    diff = _Raw(b.engine, b.model, {k: b.totals[k] - a.totals[k] for k in b.totals},
                {i: v - a.per_pos.get(i, 0.0) for i, v in b.per_pos.items()}, {}, b.notes)
    return _check_and_build(diff, "between the two scrapes", source)


def list_models(text: str) -> list[str]:
    """The ``model_name`` values that carry speculative metrics in a scrape (empty for llama.cpp, which has
    no labels). Raises InputError for text that is not Prometheus format."""
    names = set(_VLLM.values()) | set(_SGLANG.values()) | set(_TRTLLM.values())
    return [m for m in _models_in(_samples(text), names) if m]


_SPEC_NAMES = (*_VLLM.values(), *_LLAMA.values(), *_SGLANG.values(), _SGLANG_GENERATED, *_TRTLLM.values())


def compact_scrape(text: str) -> str:
    """Only the speculative-decoding sample lines of a scrape, as written (no HELP/TYPE, no ``_created``, no
    other metrics): what the page puts in its link. Reads back to the same profile."""
    keep = []
    for line in text.splitlines():
        s = line.strip()
        if s and not s.startswith("#") and s.split("{", 1)[0].split(" ", 1)[0] in _SPEC_NAMES:
            keep.append(s)
    return "\n".join(keep) + ("\n" if keep else "")


EXAMPLE_MODEL = "example/llama-8b-eagle"
_EXAMPLE_COUNTS = ((1000, 3000, 1700, (700, 550, 450)), (3000, 9000, 5000, (2100, 1620, 1280)))


def example_scrapes() -> tuple[str, str]:
    """Two vLLM scrapes of one server, some traffic apart (γ = 3), written by :func:`run_to_prometheus` and
    compacted: the page's example. Between them: 2000 drafts, 6000 draft tokens, 3300 accepted."""
    out = []
    for d, t, a, per in _EXAMPLE_COUNTS:
        prof = AcceptanceProfile("vllm", EXAMPLE_MODEL, float(d), float(t), float(a), tuple(float(x) for x in per))
        out.append(compact_scrape(run_to_prometheus(prof, model_name=EXAMPLE_MODEL)))
    return out[0], out[1]


@dataclass
class PositionView:
    """Chart data by draft position (index i = vLLM's ``position`` label).

    Attributes:
        positions: [P] 0..P−1. kept: [P] per_pos[i]. reached: [P] per_pos[i − 1] (drafts for i = 0).
        survival: [P] measured P(A ≥ i + 1). survival_geometric: [P] α̂^(i+1).
        conditional: [P] measured α_i (None where nobody reached i). alpha_hat: the constant α̂.
        ci_low, ci_high: [P] Wilson 95 % interval of α_i (None where not computable).
    """

    positions: list[int]
    kept: list[float]
    reached: list[float]
    survival: list[float]
    survival_geometric: list[float]
    conditional: list[float | None]
    alpha_hat: float
    ci_low: list[float | None]
    ci_high: list[float | None]


def position_view(profile: AcceptanceProfile) -> PositionView | None:
    """Per-position chart data (measured vs the geometric model at α̂); None without per-position counts."""
    if not profile.per_position or not profile.drafts or profile.alpha_hat is None:
        return None
    a = float(profile.alpha_hat)
    n = len(profile.accepted_per_pos)
    cis = wilson_intervals(profile)
    return PositionView(positions=list(range(n)), kept=list(profile.accepted_per_pos),
                        reached=[profile.drafts, *profile.accepted_per_pos[:-1]], survival=profile.survival,
                        survival_geometric=[a ** (i + 1) for i in range(n)],
                        conditional=profile.conditional_alpha, alpha_hat=a,
                        ci_low=[None if c is None else c[0] for c in cis],
                        ci_high=[None if c is None else c[1] for c in cis])


# ---------------------------------------------------------------------------------------------
# Fetching a scrape


def allowed_hosts(env: Mapping[str, str] | None = None) -> set[str]:
    """Host names (lower case, optionally host:port) the operator allowed in ``SPEEDUP_LAB_ALLOWED_HOSTS``."""
    raw = (os.environ if env is None else env).get(ALLOWED_HOSTS_ENV, "")
    return {h.strip().lower() for h in raw.split(",") if h.strip()}


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_url(url: str, env: Mapping[str, str] | None = None) -> str:
    """Return ``url`` if the app may fetch it: http(s), and a loopback host (127.0.0.0/8, ::1, localhost) or a
    host listed in ``SPEEDUP_LAB_ALLOWED_HOSTS`` (the app may be served to a room of readers, and must not
    fetch arbitrary addresses for them). Names are not resolved: "myhost" is not loopback even if it
    resolves to 127.0.0.1, unless listed.

    Raises:
        InputError: not http(s), no host, or a host that is not allowed (the message names the variable).
    """
    try:
        u = urllib.parse.urlsplit(str(url).strip())
        port = u.port
    except ValueError as e:
        raise InputError(f"That address cannot be read: {e}.") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise InputError(f"Enter an http:// or https:// address such as http://127.0.0.1:8000/metrics, not "
                         f"{str(url)[:80]!r}.")
    host = u.hostname.lower()
    allowed = allowed_hosts(env)
    if not (_is_loopback(host) or host in allowed or (port is not None and f"{host}:{port}" in allowed)):
        raise InputError(f"This app fetches only loopback addresses (127.0.0.1, ::1, localhost) unless whoever "
                         f"runs it lists other hosts in the environment variable {ALLOWED_HOSTS_ENV} "
                         f"(comma-separated): {host!r} is not listed. Paste the scrape's text instead.")
    return u.geturl()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401 - urllib's hook
        raise InputError(f"{req.full_url} redirects to {newurl}: enter that address itself (redirects are not "
                         "followed, so an allowed address cannot lead elsewhere).")


def fetch_scrape(url: str, timeout: float = FETCH_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """GET ``url`` (checked by :func:`check_url`) and return its text, without proxies or redirects.

    Raises:
        InputError: not allowed, nothing answers (refused, time-out after ``timeout`` s), an HTTP error
            status, more than 8 MiB, or a body that is not text.
    """
    url = check_url(url, env)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with opener.open(req, timeout=timeout) as resp:
            body = resp.read(FETCH_MAX_BYTES + 1)
    except InputError:
        raise
    except urllib.error.HTTPError as e:
        raise InputError(f"{url} answered HTTP {e.code} ({e.reason}). Is this the server's /metrics address "
                         "(llama-server needs --metrics)?") from None
    except (socket.timeout, TimeoutError):
        raise InputError(f"Nothing answered at {url} within {timeout:g} s.") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise InputError(f"Nothing answered at {url} within {timeout:g} s.") from None
        raise InputError(f"Nothing answers at {url} ({reason}). Is the server running on that port?") from None
    except (OSError, ValueError) as e:
        raise InputError(f"Could not read {url}: {e}.") from None
    if len(body) > FETCH_MAX_BYTES:
        raise InputError(f"{url} returned more than {FETCH_MAX_BYTES // 2**20} MiB: that is not a metrics page.")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{url} returned bytes that are not UTF-8 text.") from None


# ---------------------------------------------------------------------------------------------
# This app's own runs


def profile_from_run(run: Any, model: str | None = None, gamma: int | None = None,
                     allow_empty: bool = False) -> AcceptanceProfile:
    """The profile of a run of this app's engine, in vLLM's terms.

    ``run`` is an ``engine.decoding.trace.RunStats``, a ``SpeculativeDecoder`` (its ``stats()``), or the
    object ``python -m engine generate --json`` prints (a dict with "stats" and "rounds"; counted from the
    rounds when its stats predate the per-position fields). drafts = rounds that drafted; draft tokens =
    tokens drafted; accepted = tokens kept; per_pos[i] = rounds with more than i kept, padded with zeros to
    ``gamma`` positions (as vLLM counts every position up to ``num_speculative_tokens``).

    Raises:
        InputError: not a run, or a run whose draft proposed nothing (zero drafts; allowed with
            ``allow_empty``, for writing a plain run's zero counters).
    """
    judged: list[float] | None = None
    if hasattr(run, "stats") and callable(getattr(run, "stats")):
        gamma = gamma if gamma is not None else getattr(run, "gamma", None)
        run = run.stats()
    if isinstance(run, Mapping):
        stats = run.get("stats")
        if not isinstance(stats, Mapping):
            raise InputError("This JSON is not a run of `python -m engine generate --json` (no \"stats\").")
        settings = run.get("settings") or {}
        gamma = gamma if gamma is not None else settings.get("gamma")
        model = model if model is not None else settings.get("target")
        rounds = run.get("rounds")
        if "accepted_at_position" in stats:
            drafts, drafted, accepted = stats.get("drafts", 0), stats["drafted"], stats["accepted"]
            per, judged = list(stats["accepted_at_position"]), list(stats["judged_at_position"])
        elif isinstance(rounds, list):
            drafts = sum(1 for r in rounds if r.get("drafted"))
            drafted = sum(len(r.get("drafted") or []) for r in rounds)
            accepted = sum(int(r.get("n_accepted", 0)) for r in rounds)
            n = max((len(r.get("drafted") or []) for r in rounds), default=0)
            per = [sum(1 for r in rounds if int(r.get("n_accepted", 0)) > i) for i in range(n)]
            judged = [sum(1 for r in rounds for j, d in enumerate(r.get("drafted") or [])
                          if j == i and d.get("verdict") in ("accepted", "rejected")) for i in range(n)]
            while per and judged and judged[-1] == 0:
                per.pop(), judged.pop()
        else:
            raise InputError("This JSON has no per-round data to count from.")
    elif hasattr(run, "accepted_at_position"):
        drafts, drafted, accepted = run.drafts, run.drafted, run.accepted
        per, judged = list(run.accepted_at_position), list(run.judged_at_position)
    else:
        raise InputError("Not a run of this app's engine (expected RunStats, a decoder or generate --json output).")
    if not drafts and not allow_empty:
        raise InputError("Zero drafts: the run proposed no draft tokens (plain decoding, or a lookup that never "
                         "matched), so there is no acceptance to measure.")
    if gamma is not None and int(gamma) > len(per):
        pad = int(gamma) - len(per)
        per, judged = per + [0] * pad, (judged + [0] * pad if judged is not None else None)
    notes = () if gamma is None or not drafts or drafted == drafts * len(per) else (
        "Some rounds drafted fewer than γ tokens (lookup without a match, a confidence gate, the end of the "
        "run): α̂ uses the judged counts, the per-position α_i the vLLM-style counts.",)
    return AcceptanceProfile("speedup-lab", model, float(drafts), float(drafted), float(accepted),
                             tuple(float(x) for x in per),
                             judged_per_pos=None if judged is None else tuple(float(x) for x in judged),
                             window="one run", source="this app's engine", notes=notes)


def profile_from_json(text: str, gamma: int | None = None) -> AcceptanceProfile:
    """:func:`profile_from_run` on the text of ``python -m engine generate --json`` output.

    Raises:
        InputError: not JSON, or not a generate run.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"Not JSON ({e.msg} at line {e.lineno}).") from None
    return profile_from_run(data, gamma=gamma)


def _response_objects(text: str) -> list[Any]:
    """JSON values in ``text``: one value, or one per line (JSON Lines, or server-sent events' ``data:`` lines)."""
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        pass
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line.startswith("data:"):
            line = line[5:].strip()
        if not line or line == "[DONE]" or line.startswith(("event:", "id:", ":")):
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise InputError(f"Line {i} is not JSON ({e.msg}). Paste one response body, a JSON list of them, or "
                             "one per line.") from None
    return out


def _spec_blocks(value: Any) -> list[Mapping]:
    """Every non-null ``metrics.speculative_decoding`` in a response, a list of responses or stream chunks."""
    if isinstance(value, list):
        return [b for v in value for b in _spec_blocks(v)]
    if isinstance(value, Mapping):
        m = value.get("metrics")
        if isinstance(m, Mapping) and isinstance(m.get("speculative_decoding"), Mapping):
            return [m["speculative_decoding"]]
        if "num_spec_steps" in value and "acceptance_histogram" in value:  # the block itself
            return [value]
    return []


def is_vllm_response_json(text: str) -> bool:
    """Whether ``text`` holds OpenAI-style response bodies (``choices`` or ``metrics``), i.e. not a generate run."""
    def looks(v: Any) -> bool:
        if isinstance(v, list):
            return any(looks(x) for x in v)
        return isinstance(v, Mapping) and ("choices" in v or "metrics" in v or "num_spec_steps" in v)

    try:
        return any(looks(v) for v in _response_objects(text))
    except InputError:
        return False


def profile_from_vllm_responses(text: str, source: str = "pasted vLLM responses") -> AcceptanceProfile:
    """The profile of vLLM responses carrying ``metrics.speculative_decoding``
    (``--per-request-spec-decode-metrics summary|detailed``; vLLM's
    ``docs/features/speculative_decoding/acceptance_metrics.md``), summed over the requests.

    From each block: drafts = ``num_spec_steps``, draft tokens = ``num_draft_tokens``, accepted =
    ``num_accepted_draft_tokens``, γ = ``num_spec_tokens``; per_pos[i] = Σ_{j>i} ``acceptance_histogram[j]`` (steps
    that kept at least i + 1 tokens, vLLM's per-position counter). Judged per position, exactly: from
    ``per_step_drafted``/``per_step_accepted`` (detailed) a step with d drafted and a kept judged positions
    0..min(a, d − 1); else from ``acceptance_histogram_by_draft_length`` the same with d = the row's length.

    Args:
        text: one response body (JSON), a JSON list of them, or one per line (also ``data:`` stream lines).

    Raises:
        InputError: no ``metrics.speculative_decoding`` (the server needs the flag, and ``n`` = 1), blocks with
            different ``num_spec_tokens``, or a block whose histogram disagrees with its own totals.
    """
    blocks = [b for v in _response_objects(text) for b in _spec_blocks(v)]
    if not blocks:
        raise InputError("No metrics.speculative_decoding in this JSON. vLLM adds it to each response when it runs "
                         "with --per-request-spec-decode-metrics summary (or detailed), speculation is on and "
                         "n = 1.")
    ks = {int(b.get("num_spec_tokens", len(b.get("acceptance_histogram") or [0]) - 1)) for b in blocks}
    if len(ks) != 1:
        raise InputError(f"The responses come from servers with different num_spec_tokens ({sorted(ks)}).")
    k = ks.pop()
    if k < 1:
        raise InputError("num_spec_tokens is 0: no speculation.")
    drafts = draft_tokens = accepted = 0.0
    per = [0.0] * k
    judged = [0.0] * k
    judged_known = True
    for n, b in enumerate(blocks, 1):
        try:
            hist = [float(x) for x in b["acceptance_histogram"]]
            steps, dt, acc = float(b["num_spec_steps"]), float(b["num_draft_tokens"]), float(b["num_accepted_draft_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"Response {n}: metrics.speculative_decoding lacks or mangles {e}.") from None
        if len(hist) != k + 1 or any(x < 0 for x in hist):
            raise InputError(f"Response {n}: acceptance_histogram must have num_spec_tokens + 1 = {k + 1} counts ≥ 0.")
        if abs(sum(hist) - steps) > 1e-9 or abs(sum(j * x for j, x in enumerate(hist)) - acc) > 1e-9:
            raise InputError(f"Response {n}: its acceptance_histogram {hist} does not add up to num_spec_steps = "
                             f"{steps:g} and num_accepted_draft_tokens = {acc:g}.")
        drafts, draft_tokens, accepted = drafts + steps, draft_tokens + dt, accepted + acc
        for i in range(k):
            per[i] += sum(hist[i + 1:])
        pairs: list[tuple[int, int, float]] = []  # (drafted, kept, how many steps)
        if isinstance(b.get("per_step_drafted"), list) and isinstance(b.get("per_step_accepted"), list):
            pairs = [(int(d), int(a), 1.0) for d, a in zip(b["per_step_drafted"], b["per_step_accepted"])]
        elif isinstance(b.get("acceptance_histogram_by_draft_length"), Mapping):
            pairs = [(int(d), j, float(c)) for d, row in b["acceptance_histogram_by_draft_length"].items()
                     for j, c in enumerate(row) if c]
        else:
            judged_known = False
        for d, a, c in pairs:
            for i in range(min(a + 1, d, k)):
                judged[i] += c
    notes = [f"{len(blocks)} response(s) with vLLM's per-request metrics, summed (vLLM marks the field "
             "experimental)."]
    if not drafts:
        raise InputError("Zero speculative steps in these responses: nothing to measure.")
    return AcceptanceProfile("vllm", None, drafts, draft_tokens, accepted, tuple(per),
                             judged_per_pos=tuple(judged) if judged_known else None,
                             window=f"{len(blocks)} request(s)", source=source, notes=tuple(notes))


def profile_from_input(first: str, second: str | None = None, model: str | None = None,
                       source: str = "pasted text") -> AcceptanceProfile:
    """One entry for every pasted format: vLLM response JSON (per-request metrics), this app's ``generate
    --json`` run, or one or two Prometheus scrapes (vLLM, llama.cpp, SGLang, TensorRT-LLM).

    Raises:
        InputError: as the format's own reader; a second text given with JSON.
    """
    head = first.lstrip()[:1]
    if head in ("{", "[") or first.lstrip().startswith("data:"):
        if second is not None and second.strip():
            raise InputError("JSON is read alone: leave the second box empty (put several responses in one list).")
        if is_vllm_response_json(first):
            return profile_from_vllm_responses(first, source=source)
        return profile_from_json(first)
    if second is None or not second.strip():
        return profile_from_text(first, model, source=source)
    return profile_from_scrapes(first, second, model, source=source)


def run_to_prometheus(profile: AcceptanceProfile, model_name: str = "speedup-lab", engine: str = "0") -> str:
    """A run's counts as vLLM would expose them: prometheus_client Counters named and labelled as in
    ``vllm/v1/spec_decode/metrics.py`` (``vllm:spec_decode_num_drafts`` etc., labels model_name and engine, one
    ``position`` series per draft position), written by ``prometheus_client.generate_latest`` (with ``_total``
    and ``_created`` samples). Reading it back with :func:`profile_from_text` gives the same counts.

    Raises:
        InputError: a profile without counts (SGLang's).
    """
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    if not profile.has_counts:
        raise InputError("Only a profile with counts can be written as vLLM counters.")
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    lv = [model_name, str(engine)]
    for name, doc, value in (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", profile.drafts),
                             ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", profile.draft_tokens),
                             ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                              profile.accepted_tokens)):
        Counter(name, doc, labelnames=labels, registry=reg).labels(*lv).inc(value)
    pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                  labelnames=[*labels, "position"], registry=reg)
    for i, v in enumerate(profile.accepted_per_pos):
        pos.labels(*lv, str(i)).inc(v)
    return generate_latest(reg).decode("utf-8")


def run_metrics_text(stats: Any, gamma: int | None, model_name: str) -> str:
    """``python -m engine generate --metrics-out``: a RunStats as vLLM-named Prometheus text (see
    :func:`run_to_prometheus`)."""
    return run_to_prometheus(profile_from_run(stats, model=model_name, gamma=gamma, allow_empty=True),
                             model_name=model_name)


# ---------------------------------------------------------------------------------------------
# Predictions


def _alphas_for_prediction(profile: AcceptanceProfile) -> list[float]:
    """α_i per position (None → 0: a position nobody reached adds nothing)."""
    return [0.0 if a is None else float(a) for a in profile.conditional_alpha]


def tokens_per_pass_measured(alphas: Sequence[float], gamma: int) -> float:
    """E(γ) = 1 + Σ_{k=1..γ} Π_{i<k} α_i: expected tokens per target pass when draft token i is kept with
    probability α_i given all before it were (Leviathan et al. 2023, Eq. 1, with a different α per position;
    equal to :func:`engine.explain.analytic.expected_tokens_per_pass` when every α_i = α). Positions past the
    measured ones repeat the last α (an extrapolation).

    Args:
        alphas: [≥ 1] α_i in [0, 1]. gamma: γ ≥ 1.

    Raises:
        InputError: no α, an α outside [0, 1], or γ < 1.
    """
    a = [float(x) for x in alphas]
    if not a or any(not (0.0 <= x <= 1.0) for x in a):
        raise InputError("Per-position acceptance must be a non-empty list of numbers in [0, 1].")
    if isinstance(gamma, bool) or int(gamma) < 1:
        raise InputError(f"γ must be a whole number ≥ 1, got {gamma!r}.")
    e, surv = 1.0, 1.0
    for k in range(int(gamma)):
        surv *= a[min(k, len(a) - 1)]
        e += surv
    return e


@dataclass
class GammaPrediction:
    """Predictions for γ = 1..gamma_max from a profile.

    Attributes:
        gammas: [G] γ values.
        tokens_measured: [G] E(γ) from the measured α_i (:func:`tokens_per_pass_measured`; past the measured
            positions, extrapolated with the last α_i); equals ``tokens_geometric`` for SGLang.
        tokens_geometric: [G] E(α̂, γ) = (1 − α̂^(γ+1))/(1 − α̂) (analytic.expected_tokens_per_pass).
        extrapolated: [G] whether γ is past the measured positions.
        speedup_measured, speedup_geometric: [G] E / (γc + t(γ+1)/t(1)) (analytic.speedup_from_tokens).
        best_gamma, best_speedup: argmax of speedup_measured (ties to the shorter draft).
        best_gamma_geometric, best_speedup_geometric: the same under the constant-α model.
        speedup_interval: 95 % interval of the speedup at ``best_gamma`` from the uncertainty of the counts
            (None without counts).
        best_gamma_share: {γ: share of the resampled profiles whose best γ it is} (empty without counts).
        c, slope: the draft cost and verify-cost slope used.
        measured_positions: the draft positions the server ran: counted ones, or for a profile of means only
            (SGLang) the γ its numbers imply (0 if unknown). Past them every prediction is an extrapolation.
        best_gamma_measured, best_speedup_measured: the best γ among the measured positions only (None
            without per-position counts): when ``best_gamma`` is longer, it rests on the extrapolation.
    """

    gammas: list[int]
    tokens_measured: list[float]
    tokens_geometric: list[float]
    extrapolated: list[bool]
    speedup_measured: list[float]
    speedup_geometric: list[float]
    best_gamma: int
    best_speedup: float
    best_gamma_geometric: int
    best_speedup_geometric: float
    speedup_interval: tuple[float, float] | None
    best_gamma_share: dict[int, float]
    c: float
    slope: float
    measured_positions: int = 0
    best_gamma_measured: int | None = None
    best_speedup_measured: float | None = None

    @property
    def best_is_extrapolated(self) -> bool:
        """Whether the best γ is longer than the measured positions."""
        return bool(self.measured_positions) and self.best_gamma > self.measured_positions


def costs_from_run(stats: Any, gamma: int, t1_ms: float | None = None) -> tuple[float, float, str]:
    """The traffic model's draft cost c and verify-cost slope s as a run of this engine measured them, so a
    Live run is predicted at its own costs rather than at a server's default guesses.

    c = draft ms per token ÷ t(1), one draft step over one plain decode step (:func:`predict`'s c; the run's own
    ``draft_cost_ratio`` divides by its verify pass instead). s = (t(γ + 1)/t(1) − 1) ÷ γ, the slope of
    :func:`engine.explain.analytic.verify_cost_ratio` through the run's median pass over γ + 1 tokens. t(1): the
    run's own one-token passes where it had some (``RunStats.verify_ms_by_tokens``), else ``t1_ms`` (this
    machine's pass-cost curve, ``engine.decoding.pass_cost``). Both are clipped to [0, 1], the sliders' range.

    Args:
        stats: an ``engine.decoding.trace.RunStats`` (its ``draft_ms_per_token`` and ``verify_ms_by_tokens``, ms).
        gamma: the run's draft length (≥ 1).
        t1_ms: a one-token pass (ms) to use when the run had none.

    Returns:
        (c, s, where the numbers came from, in words).

    Raises:
        InputError: γ < 1, a run without draft time, or no one-token pass time at all.
    """
    g = int(gamma)
    if g < 1:
        raise InputError(f"γ must be at least 1, got {gamma!r}.")
    draft = getattr(stats, "draft_ms_per_token", None)
    by_n = {int(k): float(v) for k, v in (getattr(stats, "verify_ms_by_tokens", None) or {}).items()}
    if draft is None:
        raise InputError("This run has no draft time to price its draft with.")
    t1, own = (by_n[1], True) if by_n.get(1) else (t1_ms, False)
    if not t1 or t1 <= 0:
        raise InputError("No one-token pass time to compare the draft and the verify pass with.")
    c = min(max(float(draft) / t1, 0.0), 1.0)
    full = by_n.get(g + 1)
    s = min(max((full / t1 - 1.0) / g, 0.0), 1.0) if full else 0.0
    where = (f"c = {float(draft):.2f} ms a draft token ÷ t(1) = {t1:.2f} ms "
             + ("(the run's own one-token passes)" if own else "(this machine's pass-cost curve)")
             + (f"; s from its median pass over {g + 1} tokens, {full:.2f} ms" if full else
                f"; s = 0: the run has no pass over {g + 1} tokens"))
    return c, s, where


def predict(profile: AcceptanceProfile, c: float = DEFAULT_DRAFT_COST, slope: float = 0.0,
            gamma_max: int = GAMMA_MAX, seed: int = 0) -> GammaPrediction:
    """Tokens per pass and speedup for γ = 1..gamma_max, measured α_i vs the geometric model, the best γ, and
    the uncertainty the number of drafts implies.

    Speedup: :func:`engine.explain.analytic.speedup_from_tokens` with t(γ+1)/t(1) =
    :func:`engine.explain.analytic.verify_cost_ratio` (1 + s·γ). Uncertainty: each α_i is drawn
    ``UNCERTAINTY_DRAWS`` times from its Jeffreys posterior Beta(k + ½, n − k + ½) (k = per_pos[i],
    n = per_pos[i − 1]; NumPy PCG64 seeded with ``seed``), and the speedup at the best γ and the best γ itself
    are recomputed for each draw; the interval is the 2.5–97.5 % quantiles.

    Raises:
        InputError: bad c, slope or gamma_max, or a profile with no α to predict from.
    """
    gm = int(gamma_max)
    if not 1 <= gm <= 64:
        raise InputError(f"The largest γ must be 1..64, got {gamma_max!r}.")
    ahat = profile.alpha_hat
    alphas = _alphas_for_prediction(profile) or ([ahat] if ahat is not None else [])
    if not alphas:
        raise InputError("This profile has neither per-position counts nor a mean to predict from.")
    geo = ahat if ahat is not None else alphas[0]
    gammas = list(range(1, gm + 1))
    # the positions the server ran: counted ones, or (means only) the γ implied by the counters or gauges
    n_meas = len(profile.accepted_per_pos) if profile.per_position else int(profile.gamma or 0)
    ratios = [verify_cost_ratio(g + 1, slope) for g in gammas]
    t_meas = [tokens_per_pass_measured(alphas, g) for g in gammas]
    t_geo = [expected_tokens_per_pass(geo, g) for g in gammas]
    s_meas = [speedup_from_tokens(t, g, c, r) for t, g, r in zip(t_meas, gammas, ratios)]
    s_geo = [speedup_from_tokens(t, g, c, r) for t, g, r in zip(t_geo, gammas, ratios)]
    bi, bg = int(np.argmax(s_meas)), int(np.argmax(s_geo))
    interval, share = None, {}
    if profile.per_position and profile.drafts:
        rng = np.random.Generator(np.random.PCG64(seed))
        k = np.array(profile.accepted_per_pos, float)
        n = np.array([profile.drafts, *profile.accepted_per_pos[:-1]], float)
        draws = rng.beta(k + 0.5, np.maximum(n - k, 0.0) + 0.5, size=(UNCERTAINTY_DRAWS, len(k)))  # [D, P]
        idx = np.minimum(np.arange(gm), len(k) - 1)
        cum = np.cumprod(draws[:, idx], axis=1)                     # [D, G] survival to each position
        e = 1.0 + np.cumsum(cum, axis=1)                            # [D, G] E(γ)
        g_arr = np.array(gammas, float)
        sp = e / (g_arr[None, :] * float(c) + np.array(ratios)[None, :])
        at_best = sp[:, bi]
        interval = (float(np.quantile(at_best, 0.025)), float(np.quantile(at_best, 0.975)))
        best = np.argmax(sp, axis=1) + 1
        share = {int(g): float(np.mean(best == g)) for g in np.unique(best)}
    in_range = None
    if n_meas:
        in_range = int(np.argmax(s_meas[:min(n_meas, gm)]))
    return GammaPrediction(gammas=gammas, tokens_measured=t_meas, tokens_geometric=t_geo,
                           extrapolated=[g > n_meas for g in gammas] if n_meas else [False] * gm,
                           speedup_measured=s_meas, speedup_geometric=s_geo, best_gamma=bi + 1,
                           best_speedup=s_meas[bi], best_gamma_geometric=bg + 1, best_speedup_geometric=s_geo[bg],
                           speedup_interval=interval, best_gamma_share=share, c=float(c), slope=float(slope),
                           measured_positions=n_meas,
                           best_gamma_measured=None if in_range is None else in_range + 1,
                           best_speedup_measured=None if in_range is None else s_meas[in_range])


def wilson_intervals(profile: AcceptanceProfile, level: float = 0.95) -> list[tuple[float, float] | None]:
    """[γ] Wilson score interval of each α_i (k = per_pos[i] of n = per_pos[i − 1]), scipy.stats.binomtest;
    None where n = 0 or counts are not whole numbers."""
    from scipy.stats import binomtest

    out: list[tuple[float, float] | None] = []
    if not profile.per_position or not profile.drafts:
        return out
    prev = [profile.drafts, *profile.accepted_per_pos[:-1]]
    for k, n in zip(profile.accepted_per_pos, prev):
        if n <= 0 or k != int(k) or n != int(n):
            out.append(None)
            continue
        ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="wilson")
        out.append((float(ci.low), float(ci.high)))
    return out


# ---------------------------------------------------------------------------------------------
# The settings to run


@dataclass(frozen=True)
class EngineSetting:
    """How to run one engine at draft length γ: the flags, and where they are documented."""

    engine: str
    flags: str
    doc: str
    note: str


def settings_for(gamma: int) -> list[EngineSetting]:
    """Serving flags for draft length γ for vLLM, SGLang and llama.cpp.

    - vLLM: ``--speculative-config '{"num_speculative_tokens": γ, ...}'`` (docs.vllm.ai, Features →
      Speculative Decoding, ``docs/features/speculative_decoding/``; ``vllm/config/speculative.py``); keep your
      method and draft model in the JSON.
    - SGLang: ``--speculative-num-steps γ --speculative-eagle-topk 1 --speculative-num-draft-tokens γ+1``
      (docs.sglang.io, Advanced features → Speculative decoding: num-steps is the drafting depth; with top-k 1
      the draft is a chain of γ tokens and the verify pass checks γ + 1).
    - llama.cpp: ``--spec-draft-n-max γ --spec-draft-n-min γ`` (``common/arg.cpp`` of the llama.cpp vendored in
      llama-cpp-python 0.3.36, where ``--draft-max``/``--draft-min`` are "removed"; a min below the max lets drafts
      be shorter, which the counters then show as ``full_length_drafts`` False).

    Raises:
        InputError: γ outside 1..64.
    """
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or not 1 <= gamma <= 64:
        raise InputError(f"γ must be a whole number from 1 to 64, got {gamma!r}.")
    g = int(gamma)
    return [
        EngineSetting("vLLM", f"--speculative-config '{{\"num_speculative_tokens\": {g}}}'",
                      "https://docs.vllm.ai/en/latest/features/speculative_decoding/",
                      "Add your \"method\" and \"model\" (draft) to the same JSON."),
        EngineSetting("SGLang", f"--speculative-num-steps {g} --speculative-eagle-topk 1 "
                                f"--speculative-num-draft-tokens {g + 1}",
                      "https://docs.sglang.io/docs/advanced_features/speculative_decoding",
                      "With --speculative-algorithm and --speculative-draft-model-path as you run it now; top-k 1 "
                      "makes the draft a chain, as the model here assumes."),
        EngineSetting("llama.cpp", f"--spec-draft-n-max {g} --spec-draft-n-min {g}",
                      "https://github.com/ggml-org/llama.cpp/blob/master/docs/speculative.md",
                      "With -md DRAFT.gguf --spec-type draft-simple (n-gram kinds have their own sizes, e.g. "
                      "--spec-ngram-mod-n-max). Older builds spelled them --draft-max / --draft-min, "
                      "which the vendored common/arg.cpp of llama-cpp-python 0.3.36 rejects as removed."),
    ]


def profile_json(profile: AcceptanceProfile, c: float = DEFAULT_DRAFT_COST, slope: float = 0.0) -> dict:
    """The JSON that ``python -m engine traffic --json`` prints (its field names are part of the command's interface)."""
    pred = predict(profile, c, slope)
    return {"engine": profile.engine, "model": profile.model, "window": profile.window,
            "drafts": profile.drafts, "draft_tokens": profile.draft_tokens,
            "accepted_tokens": profile.accepted_tokens, "accepted_per_pos": list(profile.accepted_per_pos),
            "acceptance_rate": profile.acceptance_rate, "mean_acceptance_length": profile.mean_acceptance_length,
            "alpha_hat": profile.alpha_hat, "gamma": profile.gamma,
            "verify_calls": profile.verify_calls, "generation_tokens": profile.generation_tokens,
            "tokens_per_pass_counter": profile.tokens_per_pass_counter,
            "survival": profile.survival, "conditional_alpha": profile.conditional_alpha,
            "draft_cost": pred.c, "verify_slope": pred.slope,
            "best_gamma": pred.best_gamma, "best_speedup": pred.best_speedup,
            "best_speedup_interval": None if pred.speedup_interval is None else list(pred.speedup_interval),
            "best_gamma_geometric": pred.best_gamma_geometric,
            "best_gamma_extrapolated": pred.best_is_extrapolated,
            "best_gamma_measured_positions": pred.best_gamma_measured,
            "settings": {s.engine: s.flags for s in settings_for(pred.best_gamma)},
            "notes": list(profile.notes)}
