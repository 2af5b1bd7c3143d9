"""Prefix caching: a paged KV-block pool shared between requests, and the real prefill time it saves.

Two parts:

* A **simulator** in pure Python of automatic prefix caching the way paged-KV engines do it
  (vLLM's "Automatic Prefix Caching" design; PagedAttention: Kwon et al., SOSP 2023, §4; the same idea
  as SGLang's RadixAttention: Zheng et al., 2024, §3). The KV cache is split into blocks of
  ``block_size`` tokens in a pool of ``capacity`` blocks. A *full* block is identified by a hash of its
  parent block's hash and its own tokens, so two prompts with the same first k full blocks map to the
  same k hashes, and the (k+1)-th hash differs as soon as one token differs. A request reuses the
  longest run of cached blocks from its start, computes the rest (at least its last prompt token), and
  releases its blocks when it finishes; released full blocks stay cached until evicted
  (least recently used first among blocks no running request holds; among blocks released at the same
  moment, the deepest block of a prefix goes first, so shared roots outlive their tails).
* A **real-model measurement**: prefill request B on the embedded model from scratch, and again reusing
  a copy of request A's ``DynamicCache`` cropped to their shared full blocks; compare the first token's
  logits and the time to first token (TTFT), and show that decode time per token does not change.

Units: tokens, blocks (``block_size`` tokens each), milliseconds (ms).
"""

from __future__ import annotations

import copy
import hashlib
import heapq
import statistics
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from engine.errors import InputError

MAX_BLOCK_SIZE = 64
MAX_CAPACITY = 1024
MAX_REQUESTS = 16
MAX_CONCURRENCY = 8
MAX_TOKENS_PER_REQUEST = 2048
REQUEST_SEPARATOR = "---"
ROOT_HASH = b"\x00" * 32  # the "parent" of a prompt's first block


# --------------------------------------------------------------------------------------------------
# Block hashing
# --------------------------------------------------------------------------------------------------

def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one KV block: SHA-256 of the parent block's digest followed by the block's token ids.

    Deterministic across processes (unlike Python's ``hash``). Chaining the parent digest makes a block's
    identity depend on every token before it, as in vLLM's prefix-caching block hash
    ``hash((parent_hash, tokens_in_block))`` (vLLM docs, "Automatic Prefix Caching", design section).

    Args:
        parent: the 32-byte digest of the previous block (``ROOT_HASH`` for the first block).
        tokens: the block's token ids (each encoded as a signed 64-bit little-endian integer).

    Returns:
        a 32-byte digest.
    """
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[str]:
    """Hex digests of the **full** blocks of a prompt, in order (a trailing partial block gets none).

    Args:
        tokens: the prompt's token ids, length n.
        block_size: tokens per block, 1..``MAX_BLOCK_SIZE``.

    Returns:
        ``n // block_size`` hex strings; entry i covers tokens [i·block_size, (i+1)·block_size).

    Raises:
        InputError: if ``block_size`` is out of range.
    """
    _check_block_size(block_size)
    out: list[str] = []
    parent = ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent.hex())
    return out


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable_tokens(n_prompt: int, n_shared: int, block_size: int) -> int:
    """Prompt tokens a prefix cache can skip: whole shared blocks, never the last prompt token.

    ``floor(min(n_shared, n_prompt − 1) / block_size) · block_size`` — only full blocks are cached, and
    the last prompt token must be computed because its logits give the first output token.
    (Example: n_prompt 40, n_shared 40, block_size 16 → floor(39/16)·16 = 32.)
    """
    _check_block_size(block_size)
    if n_prompt <= 0:
        return 0
    return (min(n_shared, n_prompt - 1) // block_size) * block_size


def estimate_ttft_ms(prompt_tokens: int, hit_tokens: int, ms_per_token: float) -> tuple[float, float]:
    """Simulator estimate of the time to first token (TTFT) without and with the prefix cache, in ms.

    TTFT ≈ (prefill tokens computed) × (ms per prefill token). Prefill cost is taken as linear in the
    tokens computed: a forward pass costs about 2·N FLOPs per token for N parameters (Kaplan et al.,
    2020, "Scaling Laws for Neural Language Models", §2.1); attention's extra O(n²) term and the fixed
    per-call overhead are ignored, so the estimate is rough for very short prompts.

    Returns:
        (ttft_without_cache_ms, ttft_with_cache_ms) = (n·c, (n − hits)·c).

    Raises:
        InputError: if ``ms_per_token`` is not positive or hits exceed the prompt.
    """
    if not ms_per_token > 0:
        raise InputError(f"The prefill cost per token must be positive (got {ms_per_token} ms).")
    if hit_tokens < 0 or hit_tokens > prompt_tokens:
        raise InputError(f"Cache hits ({hit_tokens} tokens) cannot exceed the prompt ({prompt_tokens}).")
    return prompt_tokens * ms_per_token, (prompt_tokens - hit_tokens) * ms_per_token


# --------------------------------------------------------------------------------------------------
# Simulator
# --------------------------------------------------------------------------------------------------

@dataclass
class BlockRef:
    """One entry of a request's block table, as it was when the request was admitted.

    Attributes:
        position: index of the block in the request (0 = first ``block_size`` tokens).
        slot: physical block id in the pool, 0..capacity−1.
        hash: hex digest for a full block, None for the trailing partial block.
        n_tokens: tokens in the block (``block_size`` except for a partial block).
        status: "hit" (reused from the cache), "new" (computed, now cached), "dup" (full block computed
            again because the last prompt token must be recomputed; its hash was already cached, so this
            copy is not cached twice), or "partial" (last, not full: computed, never cached).
        ref_count: running requests holding this slot right after admission (this one included).
        text: the block's tokens decoded (filled by ``simulate_texts``), else "".
    """

    position: int
    slot: int
    hash: str | None
    n_tokens: int
    status: str
    ref_count: int
    text: str = ""


@dataclass
class Eviction:
    """A cached block evicted to make room. ``depth`` is its position in its prefix (0 = first block)."""

    slot: int
    hash: str
    depth: int
    last_used: int   # logical time of its last use (admission or release)
    text: str = ""


@dataclass
class PoolSlot:
    """State of one physical block after a step: "free" (holds nothing), "cached" (holds a cached block
    no running request uses; evictable), or "in use" (held by ``ref_count`` ≥ 1 running requests)."""

    slot: int
    state: str
    hash: str | None
    ref_count: int
    depth: int | None


@dataclass
class RequestResult:
    """What happened to one request (one simulator step).

    Token counts: ``hit_tokens + computed_tokens == prompt_tokens`` and ``hit_tokens ≤ prompt_tokens − 1``.
    Times in ms, from ``estimate_ttft_ms``.
    """

    index: int                   # 0-based request number
    prompt_tokens: int
    blocks: list[BlockRef]
    hit_blocks: int
    hit_tokens: int
    computed_tokens: int
    finished: list[int]          # requests that finished (released their blocks) just before this one ran
    evictions: list[Eviction]
    ttft_no_cache_ms: float
    ttft_cached_ms: float
    pool: list[PoolSlot] = field(default_factory=list)   # pool after this request was admitted

    @property
    def hit_rate(self) -> float:
        """hit_tokens / prompt_tokens, in [0, 1)."""
        return self.hit_tokens / self.prompt_tokens

    @property
    def saved_ms(self) -> float:
        return self.ttft_no_cache_ms - self.ttft_cached_ms


@dataclass
class Totals:
    """Totals over the first ``requests`` requests: tokens, hit rate (Σ hits / Σ prompt tokens), ms saved."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    hit_rate: float
    saved_ms: float
    evictions: int


@dataclass
class SimulationResult:
    """All steps of a simulation plus the totals the page shows."""

    block_size: int
    capacity: int
    concurrency: int
    ms_per_token: float
    requests: list[RequestResult]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def hit_tokens(self) -> int:
        """Prefill tokens skipped thanks to the cache."""
        return sum(r.hit_tokens for r in self.requests)

    @property
    def computed_tokens(self) -> int:
        return sum(r.computed_tokens for r in self.requests)

    @property
    def hit_rate(self) -> float:
        """Overall hit rate: Σ hit tokens / Σ prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def saved_ms(self) -> float:
        """Total estimated TTFT saved, summed over requests (ms)."""
        return sum(r.saved_ms for r in self.requests)

    @property
    def evictions(self) -> int:
        return sum(len(r.evictions) for r in self.requests)

    def totals(self, upto: int | None = None) -> Totals:
        """Totals over requests 1..``upto`` (all when None): what the page shows while stepping."""
        rs = self.requests if upto is None else self.requests[:max(0, upto)]
        prompt = sum(r.prompt_tokens for r in rs)
        hits = sum(r.hit_tokens for r in rs)
        return Totals(requests=len(rs), prompt_tokens=prompt, hit_tokens=hits,
                      computed_tokens=prompt - hits, hit_rate=hits / prompt if prompt else 0.0,
                      saved_ms=sum(r.saved_ms for r in rs), evictions=sum(len(r.evictions) for r in rs))


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise InputError(f"Block size must be a whole number of tokens from 1 to {MAX_BLOCK_SIZE} "
                         f"(got {block_size}).")


def _blocks_needed(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)  # ceil


class _Pool:
    """The block pool: slots, the hash → slot index, and an LRU heap of evictable cached slots."""

    def __init__(self, capacity: int):
        self.hash = [None] * capacity            # type: list[str | None]
        self.ref = [0] * capacity
        self.depth = [None] * capacity           # type: list[int | None]
        self.last_used = [0] * capacity
        self.version = [0] * capacity
        self.cached: dict[str, int] = {}
        self.free: deque[int] = deque(range(capacity))   # slots holding no cached block
        self.heap: list[tuple[int, int, int, int]] = []  # (last_used, -depth, slot, version)
        self.n_evictable = 0

    def available(self) -> int:
        return len(self.free) + self.n_evictable

    def hold(self, slot: int) -> None:
        if self.ref[slot] == 0 and self.hash[slot] is not None:
            self.n_evictable -= 1
            self.version[slot] += 1          # invalidates its heap entry
        self.ref[slot] += 1

    def release(self, slot: int, now: int) -> None:
        self.ref[slot] -= 1
        self.last_used[slot] = now
        if self.ref[slot] == 0:
            if self.hash[slot] is None:
                self.free.append(slot)
            else:
                self.version[slot] += 1
                self.n_evictable += 1
                heapq.heappush(self.heap, (now, -(self.depth[slot] or 0), slot, self.version[slot]))

    def allocate(self, evicted: list[Eviction]) -> int:
        """A slot for a new block: a free one first, else evict the LRU (deepest-first) cached one."""
        if self.free:
            return self.free.popleft()
        while self.heap:
            last, _negdepth, slot, ver = heapq.heappop(self.heap)
            if ver != self.version[slot] or self.ref[slot] != 0 or self.hash[slot] is None:
                continue  # stale entry
            h = self.hash[slot]
            evicted.append(Eviction(slot=slot, hash=h, depth=self.depth[slot], last_used=last))
            del self.cached[h]
            self.hash[slot] = None
            self.depth[slot] = None
            self.n_evictable -= 1
            self.version[slot] += 1
            return slot
        raise AssertionError("allocate() called with no free or evictable block")  # guarded by caller

    def snapshot(self) -> list[PoolSlot]:
        out = []
        for s in range(len(self.hash)):
            if self.ref[s] > 0:
                state = "in use"
            elif self.hash[s] is not None:
                state = "cached"
            else:
                state = "free"
            out.append(PoolSlot(slot=s, state=state, hash=self.hash[s], ref_count=self.ref[s],
                                depth=self.depth[s]))
        return out


def simulate(requests: Sequence[Sequence[int]], block_size: int = 16, capacity: int = 64,
             concurrency: int = 1, ms_per_token: float = 1.0) -> SimulationResult:
    """Run requests, in order, through a paged KV pool with automatic prefix caching.

    Model (vLLM-style automatic prefix caching over PagedAttention blocks; Kwon et al., SOSP 2023, §4.3
    "shared prefix"):

    * Request i (n tokens) needs ⌈n / block_size⌉ blocks; the first ⌊n / block_size⌋ are full and get a
      hash (``block_hashes``), the trailing partial block is never cached.
    * It reuses the longest run of cached full blocks from its start, but at most
      ⌊(n − 1) / block_size⌋ of them, so the last prompt token is always computed.
    * At most ``concurrency`` requests run at once: admitting a request first finishes the oldest running
      one(s). A request that does not fit (free + evictable blocks < blocks it must compute) also waits
      for the oldest running requests to finish.
    * A finishing request releases its blocks (reference count − 1). Cached full blocks with reference
      count 0 stay cached and are evicted least recently used first (ties: deepest block first).
    * TTFT estimates come from ``estimate_ttft_ms``.

    Args:
        requests: token-id lists, one per request, in arrival order (1..``MAX_REQUESTS`` of them).
        block_size: tokens per KV block (1..``MAX_BLOCK_SIZE``).
        capacity: blocks in the pool (1..``MAX_CAPACITY``); must hold the largest request on its own.
        concurrency: requests running at the same time (1..``MAX_CONCURRENCY``).
        ms_per_token: prefill cost per token computed (ms), > 0.

    Returns:
        a ``SimulationResult`` with one ``RequestResult`` (block table, hits, evictions, pool) per request.

    Raises:
        InputError: no requests, an empty request, a parameter out of range, or a request needing more
            blocks than the pool holds.
    """
    _check_block_size(block_size)
    if not isinstance(capacity, int) or not 1 <= capacity <= MAX_CAPACITY:
        raise InputError(f"Pool capacity must be 1 to {MAX_CAPACITY} blocks (got {capacity}).")
    if not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise InputError(f"Requests running at once must be 1 to {MAX_CONCURRENCY} (got {concurrency}).")
    if not ms_per_token > 0:
        raise InputError(f"The prefill cost per token must be positive (got {ms_per_token} ms).")
    if len(requests) == 0:
        raise InputError("There are no requests: enter at least one.")
    if len(requests) > MAX_REQUESTS:
        raise InputError(f"At most {MAX_REQUESTS} requests (got {len(requests)}).")
    for i, toks in enumerate(requests):
        if len(toks) == 0:
            raise InputError(f"Request {i + 1} is empty: every request needs at least one token.")
        if len(toks) > MAX_TOKENS_PER_REQUEST:
            raise InputError(f"Request {i + 1} has {len(toks)} tokens; the limit is "
                             f"{MAX_TOKENS_PER_REQUEST}.")
        need = _blocks_needed(len(toks), block_size)
        if need > capacity:
            raise InputError(
                f"Request {i + 1} needs {need} blocks ({len(toks)} tokens / {block_size} per block, rounded "
                f"up) but the pool holds only {capacity}: raise the capacity or the block size.")

    pool = _Pool(capacity)
    running: deque[tuple[int, list[int]]] = deque()
    clock = 0
    results: list[RequestResult] = []

    def finish_oldest(finished: list[int]) -> None:
        nonlocal clock
        clock += 1
        idx, slots = running.popleft()
        # release the tail first: with equal last-use times the deepest block is evicted first anyway
        for s in reversed(slots):
            pool.release(s, clock)
        finished.append(idx)

    for i, toks in enumerate(requests):
        toks = list(toks)
        n = len(toks)
        hashes = block_hashes(toks, block_size)
        n_full = len(hashes)
        n_blocks = _blocks_needed(n, block_size)
        finished: list[int] = []
        evicted: list[Eviction] = []
        while len(running) >= concurrency:
            finish_oldest(finished)

        max_hit = (n - 1) // block_size
        hits = 0
        while hits < max_hit and hashes[hits] in pool.cached:
            hits += 1
        slots = [pool.cached[h] for h in hashes[:hits]]
        for s in slots:
            pool.hold(s)
        while pool.available() < n_blocks - hits:
            finish_oldest(finished)   # wait for earlier requests to free room (cannot loop forever:
            # with nothing running, available = capacity − hits ≥ n_blocks − hits, checked above)
        statuses = ["hit"] * hits
        for j in range(hits, n_blocks):
            s = pool.allocate(evicted)
            pool.hold(s)
            if j < n_full and hashes[j] not in pool.cached:
                pool.cached[hashes[j]] = s
                pool.hash[s] = hashes[j]
                pool.depth[s] = j
                pool.version[s] += 1
                statuses.append("new")
            else:
                statuses.append("dup" if j < n_full else "partial")
            slots.append(s)
        clock += 1
        for s in slots:
            pool.last_used[s] = clock
        running.append((i, slots))

        table = [
            BlockRef(position=j, slot=slots[j], hash=hashes[j] if j < n_full else None,
                     n_tokens=min(block_size, n - j * block_size), status=statuses[j],
                     ref_count=pool.ref[slots[j]])
            for j in range(n_blocks)
        ]
        hit_tokens = hits * block_size
        full_ms, cached_ms = estimate_ttft_ms(n, hit_tokens, ms_per_token)
        results.append(RequestResult(
            index=i, prompt_tokens=n, blocks=table, hit_blocks=hits, hit_tokens=hit_tokens,
            computed_tokens=n - hit_tokens, finished=finished, evictions=evicted,
            ttft_no_cache_ms=full_ms, ttft_cached_ms=cached_ms, pool=pool.snapshot()))
    return SimulationResult(block_size=block_size, capacity=capacity, concurrency=concurrency,
                            ms_per_token=ms_per_token, requests=results)


# --------------------------------------------------------------------------------------------------
# Text: request lists, presets, tokenization
# --------------------------------------------------------------------------------------------------

def split_requests(text: str) -> list[str]:
    """Split the page's request list: requests are separated by lines containing only ``---``.

    Leading/trailing blank lines of each request are dropped; inner text is kept exactly.

    Raises:
        InputError: if the list or any request is empty.
    """
    if text is None or not text.strip():
        raise InputError("The request list is empty: enter at least one request.")
    parts: list[list[str]] = [[]]
    for line in text.split("\n"):
        if line.strip() == REQUEST_SEPARATOR:
            parts.append([])
        else:
            parts[-1].append(line)
    out = []
    for i, lines in enumerate(parts):
        body = "\n".join(lines).strip("\n")
        if not body.strip():
            raise InputError(f"Request {i + 1} is empty: remove the extra '{REQUEST_SEPARATOR}' line or "
                             "write something between the separators.")
        out.append(body)
    return out


def join_requests(requests: Sequence[str]) -> str:
    """Inverse of ``split_requests``."""
    return f"\n{REQUEST_SEPARATOR}\n".join(requests)


SYSTEM_PROMPT = (
    "You are Spoke, the support assistant of Chainring Cycles, a small bicycle shop. Answer in at most "
    "three sentences, in plain language, and never invent prices or stock levels. Opening hours: Monday "
    "to Friday 9:00 to 18:00, Saturday 10:00 to 16:00, closed on Sunday. Repairs: a basic service takes "
    "two working days; wheel truing is done while you wait if the workshop is not busy. Returns: unused "
    "items within 30 days with the receipt. If a question is about safety (brakes, a cracked frame, a "
    "loose headset), tell the customer to stop riding and bring the bike in. If you do not know, say so "
    "and give the shop's phone number, 555-0142."
)
QUESTIONS = [
    "Are you open on Sunday?",
    "My rear brake squeaks when it rains, is that dangerous?",
    "How long does a basic service take?",
    "Can I return a helmet I bought last week?",
    "Do you true wheels while I wait?",
]
FEW_SHOT = (
    "Classify the sentiment of each product review as positive, negative or mixed.\n\n"
    "Review: The saddle is comfortable even on long rides.\nSentiment: positive\n\n"
    "Review: The lights stopped working after two weeks.\nSentiment: negative\n\n"
    "Review: Great tyres, but they were hard to mount.\nSentiment: mixed\n\n"
    "Review: The lock feels solid and the key turns smoothly.\nSentiment: positive\n\n"
)
REVIEWS = [
    "The pump broke the first time I used it.",
    "Light frame, fast delivery, but the bell rattles.",
    "Best bottle cage I have owned.",
    "The gloves are warm but the stitching came loose.",
]
CONVERSATION = [
    ("I want to start commuting by bike, about 8 km each way.",
     "That distance suits most bikes; a hybrid with mudguards and lights is a comfortable choice."),
    ("What should I carry for a flat tyre?",
     "A spare tube, two tyre levers and a mini pump fit in a small saddle bag."),
    ("Do I need to service the bike often?",
     "For daily commuting, a basic service every six months keeps it reliable."),
    ("Can you book me in for one next week?",
     "I cannot book appointments, but you can call the shop on 555-0142."),
]
TIMESTAMPS = ["08:12:55", "09:41:07", "10:03:26", "11:27:48", "12:50:19"]

PRESETS = {
    "system": "Shared system prompt, different questions",
    "fewshot": "Few-shot block, different inputs",
    "multiturn": "Multi-turn conversation (each turn extends the last)",
    "timestamp": "Timestamp line in every prompt",
}


def preset_requests(name: str, timestamp_first: bool = True) -> list[str]:
    """The request texts of a preset.

    Args:
        name: a key of ``PRESETS``.
        timestamp_first: for "timestamp" only: put the varying timestamp line at the start of each
            prompt (the common mistake: it breaks sharing for everything after it) or at the end.

    Raises:
        InputError: unknown preset.
    """
    if name == "system":
        return [f"{SYSTEM_PROMPT}\n\nUser: {q}\nAssistant:" for q in QUESTIONS]
    if name == "fewshot":
        return [f"{FEW_SHOT}Review: {r}\nSentiment:" for r in REVIEWS]
    if name == "multiturn":
        out, convo = [], f"{SYSTEM_PROMPT}\n"
        for user, assistant in CONVERSATION:
            convo += f"\nUser: {user}\nAssistant:"
            out.append(convo)
            convo += f" {assistant}\n"
        return out
    if name == "timestamp":
        out = []
        for ts, q in zip(TIMESTAMPS, QUESTIONS):
            line = f"Request received at {ts} on 14 March 2025."
            if timestamp_first:
                out.append(f"{line}\n{SYSTEM_PROMPT}\n\nUser: {q}\nAssistant:")
            else:
                out.append(f"{SYSTEM_PROMPT}\n\nUser: {q}\n{line}\nAssistant:")
        return out
    raise InputError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")


def tokenize_requests(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """Token ids of each request text (no special tokens added).

    Raises:
        InputError: if a request is empty or tokenizes to no tokens.
    """
    out = []
    for i, t in enumerate(texts):
        ids = list(tokenizer.encode(t, add_special_tokens=False)) if t else []
        if not ids:
            raise InputError(f"Request {i + 1} is empty: every request needs at least one token.")
        out.append(ids)
    return out


def simulate_texts(text: str, tokenizer, block_size: int = 16, capacity: int = 64, concurrency: int = 1,
                   ms_per_token: float = 1.0) -> tuple[SimulationResult, list[list[int]]]:
    """The page's entry point: split ``text`` into requests, tokenize them, run ``simulate``, and label
    each block and eviction with its decoded text.

    Returns:
        (result, token lists).

    Raises:
        InputError: as ``split_requests``, ``tokenize_requests`` and ``simulate``.
    """
    texts = split_requests(text)
    if len(texts) > MAX_REQUESTS:
        raise InputError(f"At most {MAX_REQUESTS} requests (got {len(texts)}).")
    tokens = tokenize_requests(texts, tokenizer)
    res = simulate(tokens, block_size=block_size, capacity=capacity, concurrency=concurrency,
                   ms_per_token=ms_per_token)
    by_hash: dict[str, str] = {}
    for r, toks in zip(res.requests, tokens):
        for b in r.blocks:
            start = b.position * block_size
            b.text = tokenizer.decode(toks[start:start + b.n_tokens])
            if b.hash is not None:
                by_hash.setdefault(b.hash, b.text)
    for r in res.requests:
        for e in r.evictions:
            e.text = by_hash.get(e.hash, "")
    return res, tokens


# --------------------------------------------------------------------------------------------------
# Real-model measurement
# --------------------------------------------------------------------------------------------------

@dataclass
class ReuseMeasurement:
    """Prefill of request B with and without reusing request A's KV cache, on a real model.

    Times are medians over ``repeats`` alternating runs, in ms. TTFT here is the prefill forward pass
    plus the argmax of the last position's logits (no tokenization, no sampling overhead).
    """

    prompt_tokens: int          # n_B
    shared_tokens: int          # common prefix of A and B
    reused_tokens: int          # whole blocks reused (≤ n_B − 1)
    ttft_full_ms: float         # prefill all n_B tokens
    ttft_reuse_ms: float        # prefill the last n_B − reused tokens on top of the reused cache
    copy_ms: float              # deep-copying + cropping A's cache (a paged engine shares blocks instead)
    decode_full_ms_per_token: float
    decode_reuse_ms_per_token: float
    decode_tokens: int
    max_abs_logit_diff: float   # max |logits_full − logits_reuse| at B's last position, fp32
    same_first_token: bool
    same_decoded_tokens: bool
    first_token: int
    repeats: int
    dtype: str
    device: str
    ttft_full_samples_ms: list[float] = field(default_factory=list)
    ttft_reuse_samples_ms: list[float] = field(default_factory=list)

    @property
    def ms_per_prefill_token(self) -> float:
        """Measured prefill cost per token: ttft_full_ms / prompt_tokens (feeds the simulator's estimate)."""
        return self.ttft_full_ms / self.prompt_tokens

    @property
    def speedup(self) -> float:
        return self.ttft_full_ms / self.ttft_reuse_ms

    DECODE_NOISE = 1.25  # decode times further apart than this (ratio) are not machine noise on an idle CPU

    @property
    def decode_spread(self) -> float:
        """Slower ÷ faster of the two decode times per token (≥ 1). Both decode over the same cached
        tokens, so they should agree; above ``DECODE_NOISE`` the machine was busy while measuring."""
        a, b = self.decode_full_ms_per_token, self.decode_reuse_ms_per_token
        return max(a, b) / min(a, b)


def _cache_of(out):
    """The KV cache a forward pass returned (transformers 5 names it ``cache``; older ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def measure_prefix_reuse(lm, tokens_a: Sequence[int], tokens_b: Sequence[int], block_size: int = 16,
                         repeats: int = 5, decode_tokens: int = 8) -> ReuseMeasurement:
    """Measure what reusing request A's KV cache saves when prefilling request B on a real model.

    Procedure: prefill A once (its ``DynamicCache`` plays the prefix cache). Reuse length r =
    ``reusable_tokens(n_B, common_prefix_len(A, B), block_size)`` (whole blocks, never B's last token).
    Then, alternating the order each repetition (after one warm-up of each):
      * full: forward all n_B tokens of B from an empty cache;
      * reuse: deep-copy A's cache, ``crop`` it to r tokens, forward B's last n_B − r tokens on top.
    The last position's logits of both are compared (max abs difference, fp32). Finally both caches
    decode ``decode_tokens`` greedy tokens (again alternating, cropped back after each run) to show that
    decode time per token is the same: prefix caching only skips prefill.

    Args:
        lm: an ``engine.decoding.models.LoadedModel`` (model, device).
        tokens_a, tokens_b: token ids of the earlier and the later request; shapes [n_A], [n_B].
        block_size: the simulator's block size (reuse is whole blocks only).
        repeats: timed repetitions of each variant (1..20); medians are reported.
        decode_tokens: greedy decode steps timed per repetition (1..64).

    Returns:
        a ``ReuseMeasurement``.

    Raises:
        InputError: empty requests, bad parameters, or no whole block shared (nothing to reuse).
    """
    import torch

    _check_block_size(block_size)
    if not tokens_a or not tokens_b:
        raise InputError("Both requests need at least one token.")
    if not 1 <= repeats <= 20:
        raise InputError(f"Repetitions must be 1 to 20 (got {repeats}).")
    if not 1 <= decode_tokens <= 64:
        raise InputError(f"Decode tokens must be 1 to 64 (got {decode_tokens}).")
    limit = lm.max_context
    if len(tokens_a) > limit or len(tokens_b) + decode_tokens > limit:
        raise InputError(f"The requests are longer than the model's context ({limit} tokens).")
    shared = common_prefix_len(tokens_a, tokens_b)
    reuse = reusable_tokens(len(tokens_b), shared, block_size)
    if reuse == 0:
        raise InputError(
            f"These two requests share {shared} leading tokens, less than one whole block of {block_size} "
            "tokens (the last prompt token always has to be computed), so nothing can be reused. Pick a "
            "pair that shares a prefix, or a smaller block size.")

    from engine.decoding.compute import batch_invariant

    model, dev = lm.model, lm.device
    is_cuda = torch.device(dev).type == "cuda"

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize()

    ids_a = torch.tensor([list(tokens_a)], device=dev)
    ids_b = torch.tensor([list(tokens_b)], device=dev)
    ids_tail = ids_b[:, reuse:]
    n_a = ids_a.shape[1]

    # every pass in the batch-invariant layout (``compute.batch_invariant``), as the engine's own prefills: a
    # position's bits depend only on the tokens before it, so the reused prefix gives the full prefill's logits
    with torch.inference_mode(), batch_invariant():
        cache_a = _cache_of(model(input_ids=ids_a, use_cache=True))

        def run_full():
            sync()
            t0 = time.perf_counter()
            out = model(input_ids=ids_b, use_cache=True)
            logits = out.logits[0, -1]
            tok = int(logits.argmax())
            sync()
            return (time.perf_counter() - t0) * 1e3, logits.float(), tok, _cache_of(out)

        def run_reuse():
            sync()
            t0 = time.perf_counter()
            cache = copy.deepcopy(cache_a)
            if n_a > reuse:
                cache.crop(-(n_a - reuse))
            sync()
            t1 = time.perf_counter()
            out = model(input_ids=ids_tail, cache=cache, use_cache=True)
            logits = out.logits[0, -1]
            tok = int(logits.argmax())
            sync()
            return (time.perf_counter() - t1) * 1e3, (t1 - t0) * 1e3, logits.float(), tok, _cache_of(out)

        run_full()
        run_reuse()
        full_ms, reuse_ms, copy_ms = [], [], []
        for r in range(repeats):
            order = ("full", "reuse") if r % 2 == 0 else ("reuse", "full")
            for which in order:
                if which == "full":
                    ms, logits_full, tok_full, cache_full = run_full()
                    full_ms.append(ms)
                else:
                    ms, cms, logits_reuse, tok_reuse, cache_reuse = run_reuse()
                    reuse_ms.append(ms)
                    copy_ms.append(cms)
        diff = float((logits_full - logits_reuse).abs().max())

        def decode(cache, first: int):
            n0 = cache.get_seq_length()
            tok, toks = first, []
            sync()
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(input_ids=torch.tensor([[tok]], device=dev), cache=cache, use_cache=True)
                tok = int(out.logits[0, -1].argmax())
                toks.append(tok)
            sync()
            ms = (time.perf_counter() - t0) * 1e3 / decode_tokens
            cache.crop(-(cache.get_seq_length() - n0))
            return ms, toks

        dec_full, dec_reuse = [], []
        decode(cache_full, tok_full)  # warm-up
        toks_full = toks_reuse = None
        for r in range(repeats):
            order = ("full", "reuse") if r % 2 == 0 else ("reuse", "full")
            for which in order:
                if which == "full":
                    ms, toks_full = decode(cache_full, tok_full)
                    dec_full.append(ms)
                else:
                    ms, toks_reuse = decode(cache_reuse, tok_reuse)
                    dec_reuse.append(ms)

    return ReuseMeasurement(
        prompt_tokens=len(tokens_b), shared_tokens=shared, reused_tokens=reuse,
        ttft_full_ms=statistics.median(full_ms), ttft_reuse_ms=statistics.median(reuse_ms),
        copy_ms=statistics.median(copy_ms),
        decode_full_ms_per_token=statistics.median(dec_full),
        decode_reuse_ms_per_token=statistics.median(dec_reuse), decode_tokens=decode_tokens,
        max_abs_logit_diff=diff, same_first_token=tok_full == tok_reuse,
        same_decoded_tokens=toks_full == toks_reuse, first_token=tok_full, repeats=repeats,
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""), device=str(dev),
        ttft_full_samples_ms=full_ms, ttft_reuse_samples_ms=reuse_ms)
