"""Which Hugging Face models chunk-recurrent training takes, and what it needs to know of each.

Note [One integration point]
  Rationale: chunk-recurrent training changes only how attention sees the sequence (a chunk of
  queries over paged history). Everything else in a decoder (embeddings, norms, MLPs, MoE routing,
  Qwen3's q/k norms, biases, tied embeddings) acts on each token alone and is ordinary autograd.
  transformers 5 routes every decoder's attention through one function chosen by name
  (AttentionInterface), called with post-RoPE queries and keys and the layer's options (scaling,
  sliding_window, softcap). One function registered there (hf_attention.py), with positions given
  to the model's own rotary embedding as position_ids, covers any decoder whose attention goes
  through the interface; no family's attention class is replaced.
  Approach: a probe forward of two tokens records, per layer, what the model hands the interface
  (query and key/value heads, head size, scaling, sliding window, logit soft-cap, causality, any
  other option); `check_layers` turns every record the trainer cannot train exactly into one
  sentence, the trainer plans each layer's page accesses from the records, and the attention
  function checks every later call against its layer's record. Rotary embeddings whose frequencies
  depend on the sequence length see the whole sequence's length in every chunk (Note [RoPE that
  depends on the sequence length]).
  Limitations: what cannot be trained exactly is refused with a sentence (`check_model`,
  `check_layers`): encoder-decoders and cross-attention, models without a rotary embedding
  (absolute, learned or ALiBi positions: their positions are not driven by position_ids alone),
  bidirectional attention, attention sinks and other options of the attention call that the paged
  attention does not implement, keys and values of different head sizes, layers with different
  K/V shapes, logit scalings other than Gemma's final soft-cap, and MoE router losses (a product
  of per-sequence means, which does not split into chunks). Families outside TESTED_FAMILIES that
  pass these checks train, with a log line saying that CI does not cover them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("membar.oomb")

# model_type of the families whose chunk-recurrent gradients CI compares with full-sequence
# training (tests/python/test_oomb_models.py).
TESTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "mixtral")

# Options of the attention call that change nothing about the attention itself.
_NEUTRAL_OPTIONS = frozenset({"position_ids", "use_cache", "cache_position", "past_key_values", "past_key_value",
                              "output_attentions"})
# Options the paged attention implements (checked against the layer's record on every call).
_HANDLED_OPTIONS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "is_causal"})


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer hands transformers' attention interface (recorded by `probe_layers`).

    scaling: the softmax scale (Gemma: query_pre_attn_scalar ** -0.5). sliding_window: a query at
    position p sees keys p - sliding_window + 1 .. p (HF's sliding_window_overlay), None for a
    global layer. softcap: scores become softcap * tanh(scores / softcap) before the softmax.
    """

    layer: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None

    @property
    def needs_torch_path(self) -> bool:
        """Whether the layer's attention may run in PyTorch (Note [Attention in PyTorch] in
        torch_attention.py): it has a sliding window, which the paged kernels take only over the
        whole visible history in one call with the chunk, on CUDA only where
        kernels.cuda_window_kernels() says so (ChunkContext.torch_path decides per chunk; Note
        [Sliding window] in membar/kernels/attention.h). A soft-cap alone runs on the kernels (Note
        [Soft-capped scores])."""
        return self.sliding_window is not None


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model) -> None:
    """Raises ValueError with one sentence when the model is of a kind chunk-recurrent training
    cannot train exactly; logs a line for a family CI does not test."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("chunk-recurrent training takes a Hugging Face causal LM (a model with a .config).")
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model_type {model_type!r} is an encoder-decoder: chunk-recurrent training runs "
                         f"decoder-only causal LMs (cross-attention to an encoder has no chunked form here).")
    if model.get_output_embeddings() is None:
        raise ValueError("the model has no output embeddings (lm_head): pass a *ForCausalLM model.")
    text = text_config(config)
    if getattr(text, "attention_dropout", 0.0) or getattr(config, "attention_dropout", 0.0):
        raise ValueError("attention_dropout must be 0 for chunk-recurrent training (stage 2 must recompute "
                         "stage 1 exactly).")
    if getattr(text, "output_router_logits", False):
        raise ValueError("output_router_logits is set: the MoE router's load-balancing loss is a product of "
                         "per-sequence means, which does not split into chunks; set output_router_logits=False "
                         "(chunk-recurrent training trains the language-model loss).")
    for name in ("logit_scale", "logits_scaling"):
        if getattr(text, name, None) not in (None, 1, 1.0):
            raise ValueError(f"model_type {model_type!r} scales its logits ({name}={getattr(text, name)}): "
                             f"chunk-recurrent training computes the loss from lm_head directly and applies "
                             f"only Gemma's final_logit_softcapping.")
    if not rotary_modules(model):
        raise ValueError(f"model_type {model_type!r} has no rotary position embedding: chunk-recurrent "
                         f"training gives each chunk its absolute positions through position_ids and the model's "
                         f"rotary embedding; absolute, learned or ALiBi position encodings are not supported.")
    if model_type not in TESTED_FAMILIES:
        log.warning("model_type %r is not among the families CI tests (%s): it trains through transformers' "
                    "attention interface; compare a step with membar.oomb.baseline.full_sequence_step once.",
                    model_type, ", ".join(TESTED_FAMILIES))


def final_logit_softcap(model) -> float | None:
    """Gemma's final_logit_softcapping (logits become cap * tanh(logits / cap)), or None."""
    return getattr(text_config(model.config), "final_logit_softcapping", None) or None


def attention_softcaps(model) -> bool:
    """Whether the model soft-caps its attention logits (SDPA in transformers ignores it)."""
    return bool(getattr(text_config(model.config), "attn_logit_softcapping", None))


def rotary_modules(model) -> list[torch.nn.Module]:
    """The model's rotary embedding modules (those with a rope_type: transformers' convention)."""
    return [module for module in model.modules()
            if hasattr(module, "rope_type") and type(module).__name__.endswith("RotaryEmbedding")]


# -- the probe -----------------------------------------------------------------------------------

class AttentionProbe:
    """Stands in for a chunk context while `probe_layers` runs: the attention function records
    each call here and returns zeros."""

    def __init__(self):
        self.records: dict[int, LayerAttention] = {}
        self.problems: list[str] = []

    def record(self, module, query, key, value, kwargs: dict) -> None:
        layer = getattr(module, "layer_idx", None)
        name = type(module).__name__
        if layer is None:
            self.problems.append(f"the attention module {name} has no layer_idx, so its pages cannot be named")
            return
        if layer in self.records:
            self.problems.append(f"layer {layer} called the attention function twice in one forward (shared or "
                                 f"cross-layer attention)")
            return
        is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
        if is_causal is False:
            self.problems.append(f"layer {layer} ({name}) is not causal (bidirectional or cross-attention)")
        if key.shape[-1] != value.shape[-1] or key.shape[-1] != query.shape[-1]:
            self.problems.append(f"layer {layer} ({name}) has queries, keys and values of head sizes "
                                 f"{query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}; the pages hold one size")
        if key.shape[2] != query.shape[2]:
            self.problems.append(f"layer {layer} ({name}) attends to {key.shape[2]} keys for {query.shape[2]} "
                                 f"queries (cross-attention or a cache)")
        for option, setting in kwargs.items():
            if option in _HANDLED_OPTIONS or option in _NEUTRAL_OPTIONS or setting is None or setting is False:
                continue
            self.problems.append(f"layer {layer} ({name}) calls attention with option {option}, which the paged "
                                 f"attention does not implement")
        if kwargs.get("dropout"):
            self.problems.append(f"layer {layer} uses attention dropout {kwargs['dropout']} (stage 2 must recompute "
                                 f"stage 1 exactly)")
        window = kwargs.get("sliding_window")
        if window is not None and (int(window) != window or window < 1):
            self.problems.append(f"layer {layer} has sliding_window {window!r}, not a positive whole number")
        scaling = kwargs.get("scaling")
        self.records[layer] = LayerAttention(
            layer=layer, num_q_heads=query.shape[1], num_kv_heads=key.shape[1], head_dim=query.shape[-1],
            scaling=float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
            sliding_window=int(window) if window is not None else None,
            softcap=float(kwargs["softcap"]) if kwargs.get("softcap") else None)


def probe_layers(decoder, num_layers: int, device: torch.device) -> list[LayerAttention]:
    """Runs the decoder on two tokens with the probe active; returns one record per layer, or
    raises ValueError naming what cannot be trained exactly. See Note [One integration point]."""
    from .hf_attention import NO_MASK, chunk_context

    probe = AttentionProbe()
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    positions = torch.arange(2, device=device).unsqueeze(0)
    with torch.no_grad(), chunk_context(probe):
        decoder(input_ids=ids, position_ids=positions, attention_mask=NO_MASK, use_cache=False)
    missing = [layer for layer in range(num_layers) if layer not in probe.records]
    if missing:
        probe.problems.append(f"layers {missing} never called the attention function (their attention does not go "
                              f"through transformers' attention interface)")
    if probe.problems:
        raise ValueError("chunk-recurrent training cannot train this model exactly: " + "; ".join(probe.problems) + ".")
    layers = [probe.records[layer] for layer in range(num_layers)]
    shapes = {(record.num_kv_heads, record.head_dim) for record in layers}
    if len(shapes) != 1:
        raise ValueError(f"the layers' keys have different shapes (kv heads, head size) {sorted(shapes)}: the page "
                         f"store holds one shape for every layer.")
    return layers


def check_layers(layers: list[LayerAttention], mode: str) -> None:
    """Raises ValueError for a configuration the records rule out."""
    from . import kernels  # here: kernels imports the ops, which this module does not need

    # Local layers read their whole window in sparse mode (Note [Local layers in sparse mode]).
    capped = [record.layer for record in layers if record.softcap is not None and record.sliding_window is None]
    if mode == "sparse" and capped and not kernels.cuda_softcap_kernels():
        raise ValueError(f"sparse mode needs the paged kernels for the soft-capped global layers {capped}, and "
                         f"MEMBAR_CUDA_SOFTCAP=0 sends them to the PyTorch path, which takes no selection: unset "
                         f"it or use mode='dense'.")


# -- RoPE ----------------------------------------------------------------------------------------

# Note [RoPE that depends on the sequence length]
#   Rationale: "dynamic" (NTK) and "longrope" rotary embeddings in transformers choose their
#   frequencies from max(position_ids) + 1 of the call: the whole sequence in full-sequence
#   training, but only up to the chunk's end when a chunk runs alone, so every chunk rotated its
#   queries and keys with other frequencies (gradients off by 52-182% past
#   max_position_embeddings, with a loss that still looked right). "dynamic" also caches the
#   largest length it has seen, so a shorter sequence after a longer one kept the longer one's
#   frequencies.
#   Approach: chunk-recurrent training knows the sequence's length up front. While a chunk runs,
#   a forward pre-hook on each such rotary module appends the position length - 1 to the
#   position_ids the model passes, and a forward hook drops that extra position from cos and sin:
#   the model's own code then computes the whole sequence's frequencies in every chunk. At the
#   start of each sequence the module is called once at position 0, which makes "dynamic" drop a
#   cached longer length (its own reset rule), so a sequence gets the frequencies a fresh model
#   gives it in full-sequence training.
#   Limitations: only rotary modules with transformers' rope_type convention are hooked; default,
#   linear, llama3 and yarn frequencies do not depend on the length and need nothing.
def _depends_on_length(rope_type) -> bool:
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(kind, str) and ("dynamic" in kind or kind == "longrope") for kind in types)


class SequenceLengthRotary:
    """Note [RoPE that depends on the sequence length]: hooks on the model's length-dependent rotary
    embeddings. `sequence_tokens` reads the length of the sequence being run (None outside a step)."""

    def __init__(self, model, sequence_tokens):
        self.modules = [module for module in rotary_modules(model) if _depends_on_length(module.rope_type)]
        self._sequence_tokens = sequence_tokens
        self._handles = []
        for module in self.modules:
            # A second trainer of the same model replaces the first one's hooks.
            for handle in getattr(module, "_membar_sequence_length_hooks", ()):
                handle.remove()
            handles = (module.register_forward_pre_hook(self._extend, with_kwargs=True),
                       module.register_forward_hook(self._trim, with_kwargs=True))
            module._membar_sequence_length_hooks = handles
            self._handles += handles

    def reset(self, device: torch.device) -> None:
        """Called at the start of a sequence, outside any chunk: lets "dynamic" drop a cached length."""
        for module in self.modules:
            anchor = torch.zeros((1,), device=device)
            origin = torch.zeros((1, 1), dtype=torch.long, device=device)
            if isinstance(module.rope_type, dict):
                for layer_type in module.rope_type:
                    module(anchor, origin, layer_type)
            else:
                module(anchor, origin)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _extend(self, module, args, kwargs):
        tokens = self._sequence_tokens()
        if tokens is None:
            return None
        args = list(args)
        in_args = len(args) > 1
        positions = args[1] if in_args else kwargs["position_ids"]
        last = torch.full((positions.shape[0], 1), tokens - 1, dtype=positions.dtype, device=positions.device)
        extended = torch.cat([positions, last], dim=-1)
        if in_args:
            args[1] = extended
        else:
            kwargs = dict(kwargs, position_ids=extended)
        return tuple(args), kwargs

    def _trim(self, module, args, kwargs, output):
        if self._sequence_tokens() is None:
            return None
        # cos, sin [batch, positions + 1, dim]: drop the appended position.
        return tuple(part[..., :-1, :] for part in output)
