"""A draft head on the target's own hidden states, in the style of EAGLE (Li et al. 2024).

EAGLE ("EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML 2024, §3) drafts at
the feature level: the target's last hidden state h_i (the vector its LM head reads to predict token
i+1) and the token actually chosen at i+1 go into a small decoder, which predicts the *next* feature
ĥ_{i+1}; the target's own LM head turns ĥ_{i+1} into the draft distribution q for token i+2. Later
draft tokens feed ĥ back in place of the unknown true feature.

Our head (all sizes for the embedded SmolLM2-135M, H = 576):

- input of pair i: fc([e(x_{i+1}); h_i]) with e the target's (frozen) token embedding; fc: 2H → H;
- ``n_layers`` Llama decoder layers (transformers' ``LlamaModel`` with its final RMSNorm, so its output
  is, like h, a post-norm feature) over the pairs, with its own KV cache;
- LM head: the target's output embedding restricted to ``vocab_ids`` (K most frequent answer tokens;
  q is 0 on every other id, so acceptance is still judged on the full vocabulary). Frozen, taken from
  the target at load time: the saved head holds only fc, the layers, the norm and ``vocab_ids``.

Saved as a folder: ``head_config.json`` (format, sizes, target name, weight format) + ``model.safetensors``: fp16
values, or (``weights: "q8_0"``) each matrix of fc and the layers as GGUF Q8_0 blocks (``q8_0_blocks``), which the
streaming kernel reads as its exact "q8" compact form (``engine.decoding.compute.compact_weight``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn

from engine.decoding.compute import apply_path, linear, path_of, prepare_weight
from engine.decoding.compute.lean import fused_decode
from engine.errors import ModelLoadError

HEAD_FORMAT = "speedup-lab-feature-head/1"
HEAD_CONFIG = "head_config.json"
WEIGHT_FORMATS = ("f16", "q8_0")
"""How ``save_head`` stores the head's matrices: fp16 values, or GGUF Q8_0 blocks (int8 codes, one fp16 scale per
32 values along the input dimension)."""
Q8_0 = 32
"""Values per scale in a Q8_0 block (GGUF's ``QK8_0``)."""


def is_head_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a saved draft head (``head_config.json``)."""
    try:
        return (Path(path) / HEAD_CONFIG).is_file()
    except (OSError, TypeError, ValueError):
        return False


def head_layer_config(target_config, n_layers: int):
    """The LlamaConfig of the head's decoder: the target's attention/MLP/RoPE shapes, ``n_layers`` layers,
    a dummy 8-token vocabulary (the head reads ``inputs_embeds``, never ids)."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = n_layers
    cfg.vocab_size = 8
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:1] * n_layers
    cfg.tie_word_embeddings = False
    return cfg


class FeatureHead(nn.Module):
    """EAGLE-style draft head. Call ``bind(target_model)`` before use (shares the target's embedding and
    LM head rows; they are not parameters of the head).

    Args:
        target_config: the target's config (Llama-style: hidden_size, heads, RoPE).
        n_layers: decoder layers in the head (≥ 1).
        vocab_ids: [K] int64, sorted target ids the head can propose.
    """

    def __init__(self, target_config, n_layers: int, vocab_ids: torch.Tensor):
        super().__init__()
        from transformers import LlamaModel

        self.hidden_size = int(target_config.hidden_size)
        self.n_layers = int(n_layers)
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size)
        self.body = LlamaModel(head_layer_config(target_config, n_layers))
        self.body.embed_tokens = None  # the head reads inputs_embeds; token embeddings are the target's
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).sort().values)
        self._target_embed: list[nn.Module] = []  # a list, so the target's module is not registered
        self.head_weight: torch.Tensor | None = None

    def bind(self, target_model: nn.Module) -> "FeatureHead":
        """Share the target's input embedding and the rows ``vocab_ids`` of its LM head (frozen)."""
        self._target_embed[:] = [target_model.get_input_embeddings()]
        w = target_model.get_output_embeddings().weight.detach()
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor: it can hold its compact form
            self.head_weight = w[self.vocab_ids.to(w.device)].to(self.fc.weight.dtype)
        prepare_weight(self.head_weight)  # read from its exact compact form on the "stream" path (compute/formats.py)
        return self

    def init_from_target(self, target_model: nn.Module) -> None:
        """Start the layers from the target's last ``n_layers`` layers and the norm from its final norm
        (a better start than random; fc starts as [½·I, I], the sum of token embedding and feature)."""
        layers = target_model.model.layers
        for i, layer in enumerate(self.body.layers):
            layer.load_state_dict(layers[len(layers) - self.n_layers + i].state_dict())
        self.body.norm.load_state_dict(target_model.model.norm.state_dict())
        H = self.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :H] = 0.5 * torch.eye(H)
            self.fc.weight[:, H:] = torch.eye(H)
            self.fc.bias.zero_()

    def grow(self, n_layers: int, target_model: nn.Module) -> "FeatureHead":
        """A deeper head that computes exactly what this one computes, to continue training with more layers.

        The new layers go after the trained ones. Each starts from the target's last layer with its output
        projections (attention ``o_proj`` and MLP ``down_proj``) set to zero, so it adds nothing to the
        residual stream until training moves them (the zero-initialised residual branch of ReZero, Bachlechner
        et al. 2020). fc, the trained layers, the final norm and ``vocab_ids`` are copied.

        Returns:
            a new bound head with ``n_layers`` layers.

        Raises:
            ValueError: ``n_layers`` is not larger than this head's.
        """
        if n_layers <= self.n_layers:
            raise ValueError(f"grow needs more than the head's {self.n_layers} layer(s), got {n_layers}.")
        big = FeatureHead(target_model.config, n_layers, self.vocab_ids)
        big.init_from_target(target_model)
        big.fc.load_state_dict(self.fc.state_dict())
        big.body.norm.load_state_dict(self.body.norm.state_dict())
        with torch.no_grad():
            for i, layer in enumerate(big.body.layers):
                if i < self.n_layers:
                    layer.load_state_dict(self.body.layers[i].state_dict())
                else:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
        p = self.fc.weight
        big = big.to(device=p.device, dtype=p.dtype)
        apply_path(big, path_of(self))  # this head's compute path (engine/decoding/compute/), as with_vocab
        return big.bind(target_model)

    def with_vocab(self, vocab_ids: torch.Tensor, target_model: nn.Module) -> "FeatureHead":
        """The same head proposing from another draft vocabulary (its LM head rows are the target's, so
        only ``vocab_ids`` changes; a smaller vocabulary makes each draft step cheaper).

        Returns:
            a new bound head.
        """
        head = FeatureHead(target_model.config, self.n_layers, vocab_ids)
        head.load_state_dict({k: v for k, v in self.state_dict().items() if k != "vocab_ids"}, strict=False)
        p = self.fc.weight
        head = head.to(device=p.device, dtype=p.dtype).train(self.training)
        apply_path(head, path_of(self))  # this head's compute path (engine/decoding/compute/), as load_head
        return head.bind(target_model)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Predicted next features.

        Args:
            tokens: [B, n] ids x_{i+1} of the pairs.
            features: [B, n, H] target features h_i (or the head's own ĥ_i while drafting).
            attention_mask: [B, n (+ cached)] 1 for real pairs, 0 for padding (training batches).
            position_ids: [B, n] pair positions i (default: continue after the cache).
            cache: a transformers ``DynamicCache`` of earlier pairs, updated in place.

        Returns:
            [B, n, H] ĥ_{i+1}, post-norm features for the LM head.
        """
        if not self._target_embed:
            raise RuntimeError("FeatureHead.bind(target_model) must be called first")
        with torch.no_grad():
            e = self._target_embed[0](tokens).to(features.dtype)
        z = self.fc(torch.cat([e, features], dim=-1))
        mask = self._direct_mask(z, attention_mask, position_ids, cache)
        if mask is not False:
            return self._step(z, mask, position_ids, cache)
        out = self.body(inputs_embeds=z, attention_mask=attention_mask, position_ids=position_ids,
                        cache=cache, use_cache=cache is not None)
        return out.last_hidden_state

    DIRECT_STEP = True
    """Run draft steps through ``_step`` where it applies (False: always through ``LlamaModel.forward``; for tests)."""

    def _direct_mask(self, z: torch.Tensor, attention_mask, position_ids, cache):
        """The mask ``LlamaModel.forward`` would hand its layers for this call, when ``_step`` can run it with the
        same operations; False when it cannot (training or autograd, no cache, no explicit positions, another
        attention than SDPA, an empty cache, a 2D padding mask). Under SDPA: one pair after a cache gets no mask
        (it sees every cached pair); several pairs after a cache get the causal boolean mask [1, 1, n, cached + n]
        (True = attend) that ``transformers.masking_utils.sdpa_mask`` builds; a prepared 4D mask (a token tree's,
        ``attention.model_mask``) is passed on as it is (``_preprocess_mask_arguments``: "returned as-is").
        ``tests/test_draft_head.py`` compares each case with ``create_causal_mask`` and the body's forward."""
        if not (self.DIRECT_STEP and cache is not None and position_ids is not None and not self.training
                and not torch.is_grad_enabled() and self.body.config._attn_implementation == "sdpa"):
            return False
        if attention_mask is not None:
            return attention_mask if attention_mask.dim() == 4 else False
        n, cached = z.shape[1], cache.get_seq_length()
        if n == 1:
            return None
        if cached == 0 or z.shape[0] != 1:
            return False
        rows = torch.arange(cached, cached + n, device=z.device)[:, None]
        return (torch.arange(cached + n, device=z.device)[None, :] <= rows)[None, None]

    def _step(self, z: torch.Tensor, mask, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """``self.body(inputs_embeds=z, …)`` without ``LlamaModel.forward``'s per-call work (its output wrappers,
        argument checks and ``create_causal_mask``; ``_direct_mask`` gives the mask it would build): the same
        rotary embedding, decoder layers and final norm in the same order, so the same bits
        (``tests/test_draft_head.py`` checks ``torch.equal`` against the body's forward). Why: a draft step of one
        pair of the shipped 2-layer head took
        1.77 ms through ``LlamaModel.forward`` and 1.45 ms this way (AMD EPYC, 2 threads, medians of 15 × 50 calls
        after 100 cached pairs); in whole decoding (γ 2, 4 held-out prompts × 96 tokens, 4 alternating
        reps) drafting took 3.80 against 4.01 ms a round and the head decoded 66.3 against 65.2 tokens/s; with the
        catch-up of several pairs and the token tree's masked steps taking it too, 4.67 against 5.21 ms a round
        (55.5 against 53.5 tokens/s, a busier hour), and a 4-node tree's drafting 7.96 → 7.48 ms a round.

        Args: z [B, n, H] the fc output; mask from ``_direct_mask``; position_ids [B, n]; cache the head's
        ``DynamicCache`` (updated in place).
        Returns: [B, n, H] ĥ, post-norm."""
        body = self.body
        h = fused_decode(body, None, z, position_ids, cache)  # a batch-invariant draft step on the fused layers
        if h is not None:
            return h
        position_embeddings = body.rotary_emb(z, position_ids=position_ids)
        h = z
        for layer in body.layers[:body.config.num_hidden_layers]:
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids,
                      cache=cache, use_cache=True)
        return body.norm(h)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] features → [..., K] logits over ``vocab_ids`` (the target's LM head rows)."""
        return linear(features, self.head_weight)


def q8_0_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 quantization of a matrix, laid out so its values are an exact "q8" compact form of the streaming
    kernel (``engine.decoding.compute.formats._exact_q8``).

    Each block of 32 values along the last dimension becomes int8 codes q and one fp16 scale d, the value being
    d · q (ggml's ``quantize_row_q8_0``: d = max |w| ÷ 127, q = round(w ÷ d)). One change: d is rounded *down* to
    fp16 (ggml rounds to nearest), so the block's largest magnitude has |q| = 127 exactly, and the kernel's check,
    which recomputes d as max |d · q| ÷ 127 in fp32, gets d back bit for bit (127 · d is exact in fp32 for an fp16
    d). A block whose scale underflows fp16 (max |w| < ~7.6e-6) becomes zeros. Values move by at most d / 2 (plus
    the fp16 rounding of d, under 2⁻¹¹ · |w|): the head drafts a little differently, which never changes what the
    target accepts (acceptance is judged on the target's p and the q the draft actually drew from).

    Args:
        w: [N, K] floating matrix, K a multiple of 32.

    Returns:
        (q [N, K] int8, d [N, K / 32] fp16).

    Raises:
        ValueError: K is not a multiple of 32, or w is not 2-D or holds a non-finite value.
    """
    if w.dim() != 2 or w.shape[1] % Q8_0:
        raise ValueError(f"Q8_0 needs a 2-D matrix with a multiple of {Q8_0} columns, got {tuple(w.shape)}.")
    w = w.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("Q8_0 cannot store a non-finite value.")
    blocks = w.reshape(w.shape[0], -1, Q8_0)
    d32 = blocks.abs().amax(-1) / 127.0
    d = d32.to(torch.float16)
    up = d.float() > d32  # rounded up: step down to the fp16 number below (positive fp16 bits are ordered)
    d = torch.where(up, (d.view(torch.int16) - 1).view(torch.float16), d)
    df = d.float()
    q = torch.where(df[..., None] > 0, (blocks / df.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round(),
                    torch.zeros_like(blocks)).clamp_(-127, 127)
    return q.to(torch.int8).reshape(w.shape), d


def q8_0_values(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """fp32 values of Q8_0 blocks: [N, K] int8 codes × [N, K / 32] fp16 scales → [N, K] (each product is exact in
    fp32: an 8-bit code times an 11-bit significand)."""
    n, k = q.shape
    return (q.float().reshape(n, k // Q8_0, Q8_0) * d.float()[..., None]).reshape(n, k)


def _quantizable(key: str, v: torch.Tensor) -> bool:
    """The head's matrices that ``save_head`` stores as Q8_0: fc's and the layers' 2-D weights."""
    return key.endswith(".weight") and v.dim() == 2 and v.shape[1] % Q8_0 == 0


def save_head(head: FeatureHead, folder: str | Path, meta: dict | None = None, weights: str = "f16") -> Path:
    """Write ``head_config.json`` and ``model.safetensors`` (fc, layers, norm, vocab_ids).

    Args:
        weights: "f16" (every float tensor as fp16) or "q8_0" (the matrices as Q8_0 blocks ``<key>.q8`` int8 and
            ``<key>.d`` fp16, ``q8_0_blocks``; norms and biases as fp16): about 1.06 bytes a matrix value instead
            of 2, and the streaming kernel reads the matrices as Q8_0 at decode time.

    Returns:
        the folder.

    Raises:
        ValueError: an unknown ``weights``.
    """
    from safetensors.torch import save_file

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"Unknown head weight format {weights!r}; use one of {', '.join(WEIGHT_FORMATS)}.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in head.state_dict().items():
        if weights == "q8_0" and _quantizable(k, v):
            state[k + ".q8"], state[k + ".d"] = (t.contiguous() for t in q8_0_blocks(v))
        else:
            state[k] = v.detach().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    cfg = {"format": HEAD_FORMAT, "n_layers": head.n_layers, "hidden_size": head.hidden_size,
           "draft_vocab": int(head.vocab_ids.numel()), "weights": weights, **(meta or {})}
    (folder / HEAD_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def _dequantized(state: dict) -> dict:
    """The state dict with each Q8_0 pair (``<key>.q8``, ``<key>.d``) replaced by ``<key>``'s fp32 values.

    Raises:
        ValueError: a code tensor without its scales (or the reverse), or shapes that do not match."""
    out = {k: v for k, v in state.items() if not (k.endswith(".q8") or k.endswith(".d"))}
    for k in state:
        if k.endswith(".q8"):
            key = k[:-3]
            q, d = state[k], state.get(key + ".d")
            if d is None or q.dtype != torch.int8 or q.dim() != 2 or tuple(d.shape) != (q.shape[0], q.shape[1] // Q8_0) \
                    or q.shape[1] % Q8_0:
                raise ValueError(f"{key}: int8 codes [N, K] need fp16 scales [N, K / {Q8_0}]")
            out[key] = q8_0_values(q, d)
        elif k.endswith(".d") and k[:-2] + ".q8" not in state:
            raise ValueError(f"{k[:-2]}: scales without codes")
    return out


def read_head_files(folder: str | Path) -> tuple[dict, dict]:
    """(``head_config.json`` as a dict, ``model.safetensors``'s tensors as stored) of a saved head folder.

    Raises:
        ModelLoadError: a file is missing or unreadable, or the config names another format.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / HEAD_CONFIG).read_text())
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - OSError, JSON and safetensors errors all mean "unreadable"
        raise ModelLoadError(f"Cannot read the draft head in {str(folder)!r}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != HEAD_FORMAT:
        got = cfg.get("format") if isinstance(cfg, dict) else None
        raise ModelLoadError(f"{str(folder)!r} holds a draft head of format {got!r}, expected {HEAD_FORMAT!r}.")
    return cfg, state


def load_head(folder: str | Path, target_model: nn.Module) -> FeatureHead:
    """Load a saved head for ``target_model`` (cast to the target's dtype and device) and bind it.

    Raises:
        ModelLoadError: missing files, another format, or a hidden size that differs from the target's.
    """
    folder = Path(folder)
    cfg, state = read_head_files(folder)
    try:
        state = _dequantized(state)
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"The draft head in {str(folder)!r} has unreadable Q8_0 blocks: {e}") from None
    if "vocab_ids" not in state or not all(k in cfg for k in ("hidden_size", "n_layers")):
        raise ModelLoadError(f"The draft head in {str(folder)!r} lacks vocab_ids, hidden_size or n_layers.")
    tcfg = target_model.config
    if int(cfg["hidden_size"]) != int(tcfg.hidden_size):
        raise ModelLoadError(f"The draft head was trained for hidden size {cfg['hidden_size']} but the "
                             f"target's is {tcfg.hidden_size}: it belongs to another target.")
    vocab = target_model.get_output_embeddings().weight.shape[0]
    ids = state["vocab_ids"]
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise ModelLoadError("The draft head's vocab_ids must be distinct ids of the target's vocabulary.")
    head = FeatureHead(tcfg, int(cfg["n_layers"]), state["vocab_ids"])
    param = next(target_model.parameters())
    missing, unexpected = head.load_state_dict(
        {k: (v.to(param.dtype) if v.is_floating_point() else v) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"The draft head in {str(folder)!r} does not match its config "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]}).")
    head.to(device=param.device, dtype=param.dtype).eval()
    apply_path(head, path_of(target_model))  # the target's compute path (engine/decoding/compute/)
    head.config = cfg
    return head.bind(target_model)
