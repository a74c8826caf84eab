"""Inference capture for causal LMs: prefill and decode graphs with the KV cache as explicit values.

A causal LM is driven through a :class:`DecoderAdapter`: ``forward(input_ids, positions,
logits_indices=None) -> logits``, with token positions given explicitly (so tokens of many
sequences, at any offset, can share one forward) and every self-attention routed through
:func:`kv_attention`. Adapters exist for the bundled GPT and LLaMA, for Hugging Face causal LMs
that dispatch attention through ``ALL_ATTENTION_FUNCTIONS`` (GPT-2, LLaMA, ...) and, generically,
for a module whose ``forward(input_ids, position_ids=...)`` returns logits and whose attention
calls ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.

:func:`kv_attention` reads and writes an explicit cache held by the active :class:`KVState`:

* no past: causal attention over the new keys/values, which become this layer's cache;
* a past ``[B, kv_heads, L, D]``: the new keys/values are appended (``cat`` on the sequence
  dim) and attention runs over past + new under an explicit mask.

Capturing an adapter inside a step module gives two graphs over the same parameters
(:func:`capture_decoder`)::

    graph @prefill(%input_ids: i64[B,S], %positions: i64[B,S], %logits_indices: i64[N], params)
        -> logits [B,N,V], then per layer i: key [B,Hkv,S,D], value [B,Hkv,S,D]  (outputs)
    graph @decode(%input_ids: i64[B,1], %positions: i64[B,1], %attn_mask: bool[B,L+1],
                  %past_key.i / %past_value.i: [B,Hkv,L,D], params)
        -> logits [B,1,V], then per layer i: key, value [B,Hkv,L+1,D] (past + new)

Both run on the CPU reference executor and are what the ``paged-attention`` pass rewrites. The
same adapters run eagerly for HF-style contiguous-cache generation (graphpar.serving.naive).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphpar.capture.capture import Captured, capture_inference
from graphpar.errors import GenerationError
from graphpar.ir.graph import Role

__all__ = [
    "DecoderAdapter",
    "DecoderGraphs",
    "DecoderInfo",
    "KVState",
    "capture_decode",
    "capture_decoder",
    "capture_prefill",
    "decoder_adapter",
    "kv_attention",
    "kv_cache_attention",
]

_ORIGINAL_SDPA = F.scaled_dot_product_attention
HF_ATTENTION = "graphpar_kv"  # the name our attention function is registered under in HF


@dataclass(frozen=True)
class DecoderInfo:
    """Sizes of a causal LM that the KV cache and the engine need."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_model_len: int  # positions the model has (learned table, rotary table, HF config)
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bytes."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * itemsize


# --- the attention hook -----------------------------------------------------------------------

@dataclass
class KVState:
    """The cache one forward reads (``past``, ``mask``) and writes (``present``), per layer.

    ``past[i]``: layer i's (key, value) ``[B, kv_heads, L, D]`` or None for a prefill.
    ``mask``: bool, broadcastable to ``[B, heads, S, L + S]`` (True = attend); None means causal
    (prefill) or, with a past and one new token, attend to everything.
    """

    past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    mask: torch.Tensor | None = None
    present: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    query_heads: list[int] = field(default_factory=list)


_local = threading.local()


def _active() -> KVState | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal self-attention of one layer over the active :class:`KVState`'s cache.

    ``query`` ``[B, H, S, D]``; ``key``/``value`` ``[B, Hkv, S, D]`` (the new tokens' only,
    before any head repetition). ``window``: a sliding window, as Hugging Face's (a query at
    position p reads the keys after p - window up to p; the queries are the last S of the
    keys). Returns ``[B, H, S, D]``.
    """
    state = _active()
    if state is None:
        raise GenerationError("kv_attention called outside kv_cache_attention()")
    layer = len(state.present)
    if state.past is not None:
        if layer >= len(state.past):
            raise GenerationError(f"the model ran attention {layer + 1} times, but the cache "
                                  f"has {len(state.past)} layers")
        past_key, past_value = state.past[layer]
        key = torch.cat([past_key, key], dim=2)
        value = torch.cat([past_value, value], dim=2)
    gqa = query.shape[1] != key.shape[1]
    mask = state.mask
    if window is not None and window < key.shape[2]:
        mask = _window_mask(query.shape[2], key.shape[2], window, query.device,
                            causal=state.past is None or query.shape[2] > 1) & (
            True if mask is None else mask)
    if mask is not None:
        out = _ORIGINAL_SDPA(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)
    elif state.past is not None:
        if query.shape[2] != 1:
            raise GenerationError("attention over a past cache with several new tokens needs "
                                  "an explicit mask")
        out = _ORIGINAL_SDPA(query, key, value, scale=scale, enable_gqa=gqa)
    else:
        out = _ORIGINAL_SDPA(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    state.present.append((key, value))
    state.query_heads.append(query.shape[1])
    return out


def _window_mask(queries: int, keys: int, window: int, device: torch.device,
                 causal: bool) -> torch.Tensor:
    """[queries, keys] bool: query i (at key position keys - queries + i) reads the keys after
    its position - window and, when `causal`, none after its own."""
    at = torch.arange(keys - queries, keys, device=device)[:, None]
    key = torch.arange(keys, device=device)[None, :]
    inside = key > at - window
    return inside & (key <= at) if causal else inside


def _sdpa_hook(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """F.scaled_dot_product_attention while a KVState is active: causal self-attention only."""
    if _active() is None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None or not is_causal or dropout_p:
        raise GenerationError(
            "graphpar serves causal self-attention: the model called "
            "scaled_dot_product_attention with "
            + ("an explicit mask" if attn_mask is not None else
               "dropout" if dropout_p else "is_causal=False")
            + "; use is_causal=True without a mask (eval mode)")
    return kv_attention(query, key, value, scale)


# What Hugging Face may hand an attention function besides a window, which kv_attention does
# not compute: refused by name rather than silently dropped.
_HF_UNSUPPORTED = ("softcap", "s_aux", "sinks", "attention_chunk_size")


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  sliding_window=None, **kwargs):
    """Hugging Face attention interface (registered as ``graphpar_kv``): [B, S, H, D] out.
    The mask Hugging Face built is not read: kv_attention masks causally over the cache, with
    the layer's sliding window."""
    if dropout:
        raise GenerationError("attention dropout is active: call model.eval() before serving")
    for name in _HF_UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise GenerationError(
                f"{type(module).__name__} passes {name}= to its attention, which graphpar's "
                "explicit-cache attention does not compute (it takes causal attention with "
                "an optional sliding window)")
    out = kv_attention(query, key, value, scaling, sliding_window)
    return out.transpose(1, 2).contiguous(), None


_hf_registered = False


def _register_hf() -> None:
    global _hf_registered
    if not _hf_registered:
        from transformers import AttentionInterface

        AttentionInterface.register(HF_ATTENTION, _hf_attention)
        _hf_registered = True


@contextlib.contextmanager
def kv_cache_attention(state: KVState, adapter: DecoderAdapter | None = None
                       ) -> Iterator[KVState]:
    """Route the attention of a forward through ``state``'s explicit cache."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(state)
    patched = F.scaled_dot_product_attention is not _sdpa_hook
    if patched:
        F.scaled_dot_product_attention = _sdpa_hook
    restore = adapter.enter_attention() if adapter is not None else None
    try:
        yield state
    finally:
        if restore is not None:
            restore()
        if patched:
            F.scaled_dot_product_attention = _ORIGINAL_SDPA
        stack.pop()


# --- adapters ---------------------------------------------------------------------------------

class DecoderAdapter(nn.Module):
    """A causal LM with explicit positions: ``forward(input_ids, positions, logits_indices)``.

    ``input_ids``/``positions``: ``[B, S]`` int64. ``logits_indices``: ``[N]`` positions along S
    whose logits are wanted (None: all). Returns ``[B, N or S, vocab]``. The wrapped module is
    ``self.model``; its parameter names are kept in the captured graphs.
    """

    family = "custom"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def enter_attention(self):
        """Prepare the model to call :func:`kv_attention`; returns an undo function or None."""
        return None

    def max_model_len(self) -> int:
        n = getattr(self.model, "max_model_len", None)
        if n is None:
            raise GenerationError(
                f"{type(self.model).__name__} does not say how many positions it has: give it a "
                "max_model_len attribute")
        return int(n)

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.model, "eos_token_id", None)
        return _ids(eos)

    def info(self) -> DecoderInfo:
        """Layer, head and vocabulary sizes, found by one small eager forward."""
        cached = getattr(self, "_info", None)
        if cached is not None:
            return cached
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        pos = torch.arange(2, device=device)[None]
        state = KVState()
        with torch.no_grad(), kv_cache_attention(state, self):
            logits = self(ids, pos)
        if not state.present:
            raise GenerationError(
                f"{type(self.model).__name__} ran no attention graphpar could intercept: its "
                "attention must call F.scaled_dot_product_attention(is_causal=True) or, for "
                "Hugging Face models, go through ALL_ATTENTION_FUNCTIONS")
        key = state.present[0][0]
        info = DecoderInfo(
            family=self.family, num_layers=len(state.present),
            num_heads=state.query_heads[0], num_kv_heads=key.shape[1], head_size=key.shape[3],
            vocab_size=logits.shape[-1], max_model_len=self.max_model_len(),
            eos_token_ids=self.eos_token_ids(), dtype=key.dtype)
        object.__setattr__(self, "_info", info)  # plain attribute, not a submodule
        return info


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _select(x: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
    return x if logits_indices is None else x[:, logits_indices]


class PositionsAdapter(DecoderAdapter):
    """A model that serves itself: ``forward_positions(input_ids, positions, logits_indices)``,
    ``decoder_family`` and ``max_model_len`` (the bundled GPT and LLaMA in graphpar.models)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.family = getattr(model, "decoder_family", "custom")

    def forward(self, input_ids, positions, logits_indices=None):
        return self.model.forward_positions(input_ids, positions, logits_indices)


class HFAdapter(DecoderAdapter):
    """A Hugging Face causal LM whose attention goes through ALL_ATTENTION_FUNCTIONS; `path`:
    where it sits inside `model` when `model` wraps it (parameter names stay the wrapper's)."""

    family = "hf"

    def __init__(self, model: nn.Module, path: str = "") -> None:
        super().__init__(model)
        self.path = path
        self.family = f"hf-{getattr(self.hf.config, 'model_type', 'model')}"

    @property
    def hf(self) -> nn.Module:
        """The Hugging Face model itself."""
        return self.model.get_submodule(self.path)

    def enter_attention(self):
        _register_hf()
        config = self.hf.config
        old = config._attn_implementation
        config._attn_implementation = HF_ATTENTION

        def restore():
            config._attn_implementation = old
        return restore

    def forward(self, input_ids, positions, logits_indices=None):
        keep = 0 if logits_indices is None else logits_indices
        out = self.hf(input_ids=input_ids, position_ids=positions, use_cache=False,
                         logits_to_keep=keep)
        return out.logits

    def max_model_len(self) -> int:
        config = self.hf.config
        n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions",
                                                                         None)
        if n is None:
            raise GenerationError(f"{type(self.hf).__name__}'s config has no "
                                  "max_position_embeddings")
        return int(n)

    def eos_token_ids(self) -> tuple[int, ...]:
        generation = getattr(self.hf, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf.config, "eos_token_id", None)
        return _ids(eos)


class GenericAdapter(DecoderAdapter):
    """Any module with ``forward(input_ids, position_ids=...) -> logits`` using causal SDPA."""

    def forward(self, input_ids, positions, logits_indices=None):
        out = self.model(input_ids, position_ids=positions)
        logits = out.logits if hasattr(out, "logits") else out
        return _select(logits, logits_indices)


def decoder_adapter(model: nn.Module, unwrap: bool = False) -> DecoderAdapter:
    """The adapter that drives ``model`` with explicit positions and an explicit KV cache.
    ``unwrap``: a module that is none of these but holds one Hugging Face causal LM is driven
    through that LM (a wrapper that returns its logits, as model files write; the wrapper's own
    forward is not run, so only a caller that checks the result against the wrapper, as token
    slicing's certificate does, should ask for it).

    Raises GenerationError for a module graphpar cannot serve.
    """
    if isinstance(model, DecoderAdapter):
        return model
    inner = [name for name, m in model.named_modules() if name and _is_hf_causal_lm(m)]
    if callable(getattr(model, "forward_positions", None)):
        adapter: DecoderAdapter = PositionsAdapter(model)
    elif _is_hf_causal_lm(model):
        adapter = HFAdapter(model)
    elif _takes_position_ids(model):
        adapter = GenericAdapter(model)
    elif unwrap and len(inner) == 1:
        adapter = HFAdapter(model, inner[0])
    else:
        raise GenerationError(
            f"cannot serve {type(model).__name__}: graphpar generates with the bundled GPT and "
            "LLaMA, Hugging Face causal LMs (GPT-2, LLaMA), a module with "
            "forward_positions(input_ids, positions, logits_indices), or a module whose "
            "forward(input_ids, position_ids=...) returns logits and whose attention calls "
            "F.scaled_dot_product_attention(q, k, v, is_causal=True)")
    if model.training:
        raise GenerationError(f"{type(model).__name__} is in training mode: call .eval() "
                              "before serving (dropout would make generation random)")
    return adapter


def _is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    if not isinstance(model, PreTrainedModel):
        return False
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    return model.get_output_embeddings() is not None


def _takes_position_ids(model: nn.Module) -> bool:
    import inspect

    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# --- capture ----------------------------------------------------------------------------------

class _PrefillStep(nn.Module):
    def __init__(self, adapter: DecoderAdapter) -> None:
        super().__init__()
        self.adapter = adapter

    def forward(self, input_ids, positions, logits_indices):
        state = KVState()
        with kv_cache_attention(state, self.adapter):
            logits = self.adapter(input_ids, positions, logits_indices)
        return (logits, *[t for kv in state.present for t in kv])


class _DecodeStep(nn.Module):
    def __init__(self, adapter: DecoderAdapter) -> None:
        super().__init__()
        self.adapter = adapter

    def forward(self, input_ids, positions, attn_mask, *past):
        pairs = [(past[i], past[i + 1]) for i in range(0, len(past), 2)]
        state = KVState(past=pairs, mask=attn_mask[:, None, None, :])
        with kv_cache_attention(state, self.adapter):
            logits = self.adapter(input_ids, positions)
        return (logits, *[t for kv in state.present for t in kv])


@dataclass
class DecoderGraphs:
    """The prefill and decode graphs of one model, over the same parameter tensors."""

    info: DecoderInfo
    prefill: Captured
    decode: Captured


def _example_inputs(info: DecoderInfo, batch: int, num_tokens: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch, num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device).repeat(batch, 1)
    return ids, positions


def _device(adapter: DecoderAdapter) -> torch.device:
    return next((p.device for p in adapter.parameters()), torch.device("cpu"))


def _rename_state(captured: Captured) -> None:
    """Parameter names as the user's model has them: the step and adapter prefixes go."""
    prefix = "adapter.model."
    graph = captured.graph
    renamed: dict[str, str] = {}
    for v in graph.inputs:
        if v.role is not Role.INPUT and v.name.startswith(prefix):
            renamed[v.name] = v.name[len(prefix):]
            v.name = renamed[v.name]
    captured.state = {renamed.get(k, k): t for k, t in captured.state.items()}
    if "tied" in graph.attrs:
        graph.attrs["tied"] = tuple(tuple(renamed.get(n, n.removeprefix(prefix)) for n in pair)
                                    for pair in graph.attrs["tied"])
    for out in graph.outputs:
        if out.target is not None:
            out.target = renamed.get(out.target, out.target)


def capture_prefill(model: nn.Module, num_tokens: int, num_logits: int | None = None,
                    batch: int = 1) -> Captured:
    """The prefill graph at ``[batch, num_tokens]`` tokens, logits at ``num_logits`` positions.

    Outputs: logits ``[batch, num_logits, vocab]``, then each layer's key and value
    ``[batch, kv_heads, num_tokens, head_size]`` (the cache the prompt fills).
    """
    adapter = decoder_adapter(model)
    info = adapter.info()
    device = _device(adapter)
    num_logits = num_tokens if num_logits is None else num_logits
    ids, positions = _example_inputs(info, batch, num_tokens, device)
    logits_indices = torch.arange(num_logits, device=device) % num_tokens
    captured = capture_inference(_PrefillStep(adapter), (ids, positions, logits_indices),
                                 name="prefill")
    _rename_state(captured)
    captured.graph.attrs["decoder"] = "prefill"
    captured.graph.attrs["max_model_len"] = info.max_model_len
    _check_kv_outputs(captured, info)
    return captured


def capture_decode(model: nn.Module, batch: int, past_len: int) -> Captured:
    """The decode graph: one new token per sequence over a contiguous past of ``past_len``.

    Inputs ``input_ids``/``positions`` ``[batch, 1]``, ``attn_mask`` bool ``[batch, past_len+1]``
    (False for padding), ``past_key.i``/``past_value.i`` ``[batch, kv_heads, past_len, D]``.
    Outputs: logits ``[batch, 1, vocab]``, then per layer the key and value caches with the new
    token appended, ``[batch, kv_heads, past_len + 1, D]`` (a grown cache, so plain outputs
    rather than ``update`` outputs, which keep their input's type).
    """
    adapter = decoder_adapter(model)
    info = adapter.info()
    device = _device(adapter)
    ids, positions = _example_inputs(info, batch, 1, device)
    positions = positions + past_len
    mask = torch.ones(batch, past_len + 1, dtype=torch.bool, device=device)
    shape = (batch, info.num_kv_heads, past_len, info.head_size)
    past = [torch.zeros(shape, dtype=info.dtype, device=device)
            for _ in range(2 * info.num_layers)]
    captured = capture_inference(_DecodeStep(adapter), (ids, positions, mask, *past),
                                 name="decode")
    _rename_state(captured)
    graph = captured.graph
    user = graph.inputs_with_role(Role.INPUT)
    names = ["input_ids", "positions", "attn_mask"] + [
        f"past_{kind}.{i}" for i in range(info.num_layers) for kind in ("key", "value")]
    for v, name in zip(user, names):
        v.name = name
    graph.attrs["decoder"] = "decode"
    graph.attrs["max_model_len"] = info.max_model_len
    _check_kv_outputs(captured, info)
    return captured


def _check_kv_outputs(captured: Captured, info: DecoderInfo) -> None:
    outputs = captured.graph.outputs
    if len(outputs) != 1 + 2 * info.num_layers:
        raise GenerationError(f"the captured {captured.graph.name} graph has {len(outputs)} "
                              f"outputs, expected logits and K/V of {info.num_layers} layers")


def capture_decoder(model: nn.Module, prefill_tokens: int = 8, decode_batch: int = 2,
                    past_len: int = 4) -> DecoderGraphs:
    """Prefill and decode graphs of ``model`` at example sizes (see the module docstring)."""
    adapter = decoder_adapter(model)
    info = adapter.info()
    past_len = min(past_len, info.max_model_len - 1)
    prefill_tokens = min(prefill_tokens, info.max_model_len)
    return DecoderGraphs(info, capture_prefill(adapter, prefill_tokens),
                         capture_decode(adapter, decode_batch, past_len))
