"""The compute path: which matrix-product kernels a model's linear layers run on this machine.

Why this package exists. Decoding a 135M-parameter model on a CPU is a chain of matrix products with a few
rows (1 token, or the γ + 1 tokens of a verify pass) against large weights: the pass should cost what
reading the weights costs, and a pass over 3 tokens about what a pass over 1 costs (the lesson of the
explainer: verifying is memory-bound). PyTorch's default CPU ``nn.Linear`` calls MKL's sgemm, which on AMD
CPUs takes a slow path for products with few rows: measured on an AMD EPYC, the 49152 × 576 LM head took
11.4 ms for 1 row and 40.7 ms for 3 (``benchmarks/bench_compute.py``). oneDNN, also inside the PyTorch
wheel, picks its kernels by CPU features; ``torch.ops.mkldnn._linear_pointwise`` runs the same product in
6.6 and 7.3 ms there.

Paths:

- ``"default"``: PyTorch's own ``torch.nn.functional.linear`` (MKL sgemm on x86 CPUs, cuBLAS on CUDA).
- ``"onednn"``: ``torch.ops.mkldnn._linear_pointwise(x, W, b, "none", [], "")`` on the layer's own dense
  weight for products of fewer than ``PACK_MIN_ROWS`` (17) rows (measured on the AMD EPYC, a weight packed with
  ``_reorder_linear_weight`` was no faster for 1–3 rows), and on a copy packed once into oneDNN's layout for larger
  ones (a prefill, the room's batched passes: ``_packed``; the same bits, and on an Intel Xeon (Sapphire Rapids) the
  room's 48-row target forward in 190 instead of 290 ms; the copies cost 4 bytes a parameter, made on first use:
  ``packed_bytes``). fp32 math is pinned: ``torch.backends.mkldnn.matmul.fp32_precision`` is set to ``"ieee"``
  (never bf16/tf32 rounding).
- ``"stream"``: products of at most this machine's row limit (``ComputePath.stream_rows``, measured by
  ``measure_stream_rows``; ``STREAM_MAX_ROWS`` = 16 when not measured) rows (a decode step, a verify pass, a draft
  step) run this project's weight-streaming kernel (``small_linear.cpp``, in this package), larger ones oneDNN. Why:
  on the AMD EPYC oneDNN's few-row kernels read the weights at about half of what a plain sum reads; the
  kernel reads each weight row once per call whatever the row count, 16 floats at a time against every
  input row, with a summation order that does not depend on the row count (a row's output is the same
  whichever rows share the call). It is compiled once per machine with the C++ compiler PyTorch's
  ``torch.utils.cpp_extension`` finds (``-O3 -march=native``, ~40 s, kept in PyTorch's extension cache under
  a name that carries the CPU's feature flags, the torch version and the source's hash); where no compiler
  or headers are present the path is simply not offered, and the reason is kept (``stream_problem``).

Exact compact weights (the "stream" path): a weight whose fp32 values are all fp16 numbers (a draft head, Medusa heads
or the block drafter saved in fp16) or, per block of 32 values, an int8 vector times one scale (the embedded GGUF's
Q8_0 token embedding, which is also the tied LM head) gets a compact copy the kernel reads instead: half, or about
a quarter, of the bytes, and the same fp32 values in the same order, so bit for bit the same outputs
(``compact_weight``; checked value by value when made, and dropped when the weight changes); the embedded target's
layers, Q4_1 in the GGUF, get a Q4_1 form the same way. A loaded model (``use_path(release=True)``, as ``load_model``
does) keeps no fp32 copy of a weight read from an exact compact form (``dense.release_linear``): its products run the
kernel at every row count, and its values are rebuilt exactly where something asks for them (the state dict, another
path).

The arithmetic (``formats.arithmetic``, ``SPEEDUP_LAB_ARITHMETIC``): on "int8", the default, the GGUF block forms
(Q4_1, Q8_0) are repacked for ``int8_product.cpp``, whose products quantize each row's activations to int8 per block of
32 as llama.cpp does (a lossy path, batch-invariant by construction); on "fp32" they are read exactly as above.

On both fast paths the siblings q/k/v and gate/up run as one product each (``_fuse_siblings``), every weight still
read from a memory-mapped checkpoint is copied into the process's own memory so the mapping can go (``_own_memory``),
and transformers' Llama decoder layers run one lean forward (``_lean_forward``: the same operations, bit-identical logits, without
the per-submodule Python of transformers' layers).

The choice: ``choose_path`` runs the model's own forward (a 1-token and a 4-token pass after a short
cached context, each path five times, alternating, best of five) and keeps the fastest path; when that is "stream",
it also times 8-, 12-, 16- and 24-token passes on the kernel and on oneDNN to find the row count where oneDNN's
blocked kernels take over (an Intel Xeon: 12; an AMD EPYC: 16). The result is remembered
per machine (CPU model, torch version, threads, model shape, the paths on offer) in the user cache, so the
measurement costs ~1 s once. Before a path is used, ``self_check`` compares it with ``F.linear`` on every distinct weight
shape for 1, 3 and 16 rows; a disagreement beyond fp32 tolerance, or oneDNN's ops missing from this
PyTorch build (they are private and may move), falls back to ``"default"`` and says why.

Override: the environment variable ``SPEEDUP_LAB_COMPUTE`` (``auto``, ``default``, ``onednn`` or ``stream``) or the
CLI's ``--compute``. Nothing outside this package knows about oneDNN: the rest of the engine loads models
through ``engine.decoding.models.load_model`` (which calls ``use_path``) and calls ``linear`` for a bare
weight tensor (a draft head's LM-head rows).

Modules, each importing only those above it:

- ``extension``: the C++ extension (``small_linear.cpp``, ``invariant_attention.cpp``, ``fused_layer.cpp``) built and
  loaded once per machine (``stream_kernel``), its build name (``kernel_name``), the CPU (``cpu_model``).
- ``onednn``: oneDNN's ops, fp32 pinned, weights packed for big products (``_packed``, ``PACK_MIN_ROWS``).
- ``memory``: weights still mapped from a checkpoint copied into own memory (``_own_memory``).
- ``invariant``: batch-invariant decode passes (``batch_invariant``, ``invariant_attention``).
- ``formats``: compact weights (``compact_weight``, ``CompactWeight``, ``weight_format``) and the arithmetic
  (``arithmetic``, ``arithmetic_scope``, ``INT8_KINDS``).
- ``products``: the active path's product (``linear``, ``OneDNNLinear``, ``prepare_weight``).
- ``fusion``: sibling linears as one product (``FusedLeadLinear``, ``FusedFollowerLinear``).
- ``lean``: the lean decoder layers (``_lean_forward``, ``lean_layer_count``); in a batch-invariant decode pass on the
  "stream" path a layer is two calls of the fused layer (``fused_layer.cpp``, ``_fused_layer``), and a room's pass
  over rows in their own KV caches runs without a batch cache (``fused_decode_rows``).
- ``dense``: the fp32 storage of weights read from exact compact forms let go and given back (``release_linear``,
  ``restore_dense``).
- ``apply``: a path applied to a model (``ComputePath``, ``self_check``, ``apply_path``, ``use_path``, ``path_of``) and
  what it costs (``compact_bytes``, ``packed_bytes``, ``weight_formats``).
- ``choice``: the path chosen per machine (``choose_path``, ``measure_paths``, ``measure_stream_rows``,
  ``parse_override``, ``measure_key``).

The public names are importable from the package (``from engine.decoding import compute; compute.linear``). The
process's state (``extension._STREAM``, ``products._ACTIVE``, ``invariant._INVARIANT``, ``choice._MEMO``) and the
values read at call time (``onednn._ONEDNN_OP``, ``onednn.PACK_MIN_ROWS``) live in one module each: the package's
names are copies, so code or a test that replaces one replaces it in its module.
"""

from __future__ import annotations

from engine.decoding.compute.apply import (PATHS, TOLERANCE, ComputePath, active_stream_rows, apply_path, compact_bytes,
                                           packed_bytes, path_of, self_check, use_path, weight_formats)
from engine.decoding.compute.choice import (CHOICES, ENV_VAR, STREAM_ROW_CANDIDATES, choose_path, measure_key,
                                            measure_paths, measure_stream_rows, parse_override)
from engine.decoding.compute.extension import (ATTENTION_SOURCE, KERNEL_SOURCE, KERNEL_SOURCES, STALE_LOCK_S,
                                               STREAM_CFLAGS, STREAM_MAX_ROWS, cpu_model, kernel_name, stream_kernel,
                                               stream_problem)
from engine.decoding.compute.formats import (ARITHMETIC_ENV, ARITHMETICS, COMPACT_ATTR, INT8_KINDS, Q8_BLOCK, Q41_BLOCK,
                                             WEIGHT_FORMAT_ENV, WEIGHT_FORMATS, CompactWeight, arithmetic,
                                             arithmetic_scope, compact_weight, weight_format)
from engine.decoding.compute.fusion import SIBLINGS, FusedFollowerLinear, FusedLeadLinear
from engine.decoding.compute.invariant import KEY_ALIGN, batch_invariant, invariant_attention
from engine.decoding.compute.lean import fused_decode_rows, fused_visible_pass, lean_layer_count
from engine.decoding.compute.onednn import PACK_MIN_ROWS, PACKED_ATTR
from engine.decoding.compute.products import OneDNNLinear, linear, prepare_weight

__all__ = ["ARITHMETIC_ENV", "ARITHMETICS", "arithmetic", "arithmetic_scope", "INT8_KINDS", "active_stream_rows", "apply_path", "ATTENTION_SOURCE", "batch_invariant", "CHOICES", "choose_path",
           "COMPACT_ATTR", "compact_bytes", "compact_weight", "CompactWeight", "ComputePath", "cpu_model",
           "ENV_VAR", "fused_decode_rows", "fused_visible_pass", "FusedFollowerLinear", "FusedLeadLinear", "invariant_attention", "kernel_name",
           "KERNEL_SOURCE", "KERNEL_SOURCES", "KEY_ALIGN", "lean_layer_count", "linear", "measure_key",
           "measure_paths", "measure_stream_rows", "OneDNNLinear", "PACK_MIN_ROWS", "PACKED_ATTR", "packed_bytes",
           "parse_override", "path_of", "PATHS", "prepare_weight", "Q41_BLOCK", "Q8_BLOCK", "self_check",
           "SIBLINGS", "STALE_LOCK_S", "STREAM_CFLAGS", "stream_kernel", "STREAM_MAX_ROWS", "stream_problem",
           "STREAM_ROW_CANDIDATES", "TOLERANCE", "use_path", "weight_format", "WEIGHT_FORMAT_ENV", "WEIGHT_FORMATS",
           "weight_formats"]
