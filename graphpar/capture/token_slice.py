"""The training step of one token slice of a causal LM (TeraPipe), keys and values explicit.

Slice j of a sequence holds `length` tokens at positions [offset, offset + length). Its step is
captured with the same joint forward + backward capture as a whole training step
(`capture_training`), the model driven through its decoder adapter
(`graphpar.capture.decoder`) so that every attention layer reads the keys and values of the
earlier slices from explicit inputs and returns its cache grown by the slice's own:

    graph @slice<j>(%input_ids: i64[B,l], %target: i64[B,l],
                    %past_key.i / %past_value.i: [B,Hkv,c,D]        (c > 0: earlier slices)
                    %grad_key.i / %grad_value.i: [B,Hkv,c+l,D]      (not the last slice)
                    params)
        -> loss                      the slice's share of the sequence's mean loss (x l / L)
           key.i / value.i           [B,Hkv,c+l,D]: the cache the next slice reads (not last)
           grad of every parameter   this slice's contribution
           grad of past_key.i / ...  what flows into the earlier slices' keys and values

`grad_key.i` is the gradient of the whole step's loss with respect to the cache `key.i` this
slice returns, i.e. what the later slices' backward sends back. It enters the joint graph
through a surrogate loss, loss + sum(key.i * grad_key.i): the surrogate's gradient is the
slice's own gradient plus the later slices' contribution carried by the cache (autograd's
`backward(tensors, grad_tensors)`). The LOSS output is then pointed back at the slice's loss;
the surrogate's forward is dead (the caller removes it with `dce`) and only its backward, which
reads `grad_key.i`, stays.

Shapes are static, so each distinct (length, offset) pair is captured once.

A Hugging Face model whose attention the adapter cannot take over (BLOOM, MPT, GPT-Neo and
Falcon compute theirs in their own modules; Gemma-2's soft-capping and GPT-OSS's sinks are
arguments the adapter's attention does not compute) is driven with its own cache instead: the
earlier slices' keys and values go in as a `DynamicCache`, the model masks and biases (ALiBi,
soft-capping, sinks, windows) as it does when it generates, and the cache it returns is the
slice's `key.i` / `value.i`. The keys are what the model caches (before any head repetition).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from graphpar.capture.capture import Captured, capture_training
from graphpar.capture.decoder import (
    DecoderAdapter,
    HFAdapter,
    KVState,
    decoder_adapter,
    kv_cache_attention,
)
from graphpar.errors import CaptureError, GenerationError
from graphpar.ir.graph import OutputRole, Role

__all__ = ["capture_slice_step", "slice_input_names"]

_PREFIX = "adapter.model."  # the step's own path to the user's module, dropped from names


class _SliceForward(nn.Module):
    """forward(input_ids, *past) -> (logits, *caches) of one slice at a fixed offset."""

    def __init__(self, adapter: nn.Module, offset: int, length: int) -> None:
        super().__init__()
        self.adapter = adapter
        self.offset, self.length = offset, length

    def forward(self, input_ids, *past):
        c, n = self.offset, self.length
        positions = torch.arange(c, c + n, device=input_ids.device).expand(input_ids.shape[0], n)
        pairs = [(past[i], past[i + 1]) for i in range(0, len(past), 2)] or None
        # token i of the slice sees the c earlier tokens and its own slice up to itself
        mask = (torch.ones(n, c + n, dtype=torch.bool, device=input_ids.device).tril(c)[None, None]
                if pairs else None)
        state = KVState(past=pairs, mask=mask)
        with kv_cache_attention(state, self.adapter):
            logits = self.adapter(input_ids, positions)
        return (logits, *[t for kv in state.present for t in kv])


class _OwnCacheSliceForward(nn.Module):
    """forward(input_ids, *past) -> (logits, *caches): a Hugging Face model driven with its own
    `DynamicCache` holding the earlier slices' keys and values."""

    def __init__(self, adapter: HFAdapter, offset: int, length: int) -> None:
        super().__init__()
        self.adapter = adapter
        self.offset, self.length = offset, length

    def forward(self, input_ids, *past):
        return own_cache_forward(self.adapter.hf, input_ids, past, self.offset)


def own_cache_forward(hf: nn.Module, input_ids: torch.Tensor, past, offset: int):
    """`hf`'s logits for `input_ids` at positions [offset, ...) after the keys and values
    `past` (key, value per layer, flat), and its cache after them, flat."""
    from transformers import DynamicCache

    cache = DynamicCache()  # full layers: a sliding window is the model's mask, not a crop
    for i in range(0, len(past), 2):
        cache.update(past[i], past[i + 1], i // 2)
    takes = inspect.signature(hf.forward).parameters
    # transformers 5.x names the argument `cache` (`past_key_values` before, now deprecated)
    kwargs = {"cache" if "cache" in takes else "past_key_values": cache}
    if "position_ids" in takes:  # ALiBi models (BLOOM, MPT) take positions from the cache
        n = input_ids.shape[1]
        kwargs["position_ids"] = torch.arange(offset, offset + n, device=input_ids.device
                                              ).expand(input_ids.shape[0], n)
    logits = hf(input_ids=input_ids, use_cache=True, **kwargs).logits
    return (logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])


def _own_cache_sizes(adapter: HFAdapter) -> tuple[int, int, int, torch.dtype]:
    """(layers, key-value heads, head size, dtype) of the cache the model fills itself."""
    hf = adapter.hf
    device = next((p.device for p in hf.parameters()), torch.device("cpu"))
    with torch.no_grad():
        _, *caches = own_cache_forward(hf, torch.zeros(1, 2, dtype=torch.long, device=device),
                                       (), 0)
    if not caches:
        raise CaptureError(f"{type(hf).__name__} filled no cache: token slicing needs a causal "
                           "LM that caches keys and values")
    key = caches[0]
    return len(caches) // 2, key.shape[1], key.shape[3], key.dtype


def _slice_driver(model: nn.Module) -> tuple[DecoderAdapter, tuple, type]:
    """The adapter, cache sizes (layers, key-value heads, head size, dtype) and forward module
    that drive `model` slice by slice: the adapter's attention, or for a Hugging Face model
    whose attention it cannot take over, the model's own cache."""
    was_training = model.training
    model.eval()  # the adapter refuses a model in training mode (dropout); a step has none
    try:
        adapter = decoder_adapter(model, unwrap=True)  # checked against the model
    finally:
        model.train(was_training)
    own = (_OwnCacheSliceForward if isinstance(adapter, HFAdapter) else None)
    if own and not getattr(adapter.hf, "_supports_attention_backend", False):
        # attention in the model's own modules: an attention function registered with
        # transformers is never called (and MPT builds no mask for one)
        return adapter, _own_cache_sizes(adapter), own
    try:
        info = adapter.info()
    except GenerationError:  # arguments the adapter's attention does not compute (softcap)
        if own is None:
            raise
        return adapter, _own_cache_sizes(adapter), own
    return adapter, (info.num_layers, info.num_kv_heads, info.head_size, info.dtype), \
        _SliceForward


def slice_input_names(layers: int, prefix: str) -> list[str]:
    """`prefix` key.i / value.i for every attention layer, layer by layer."""
    return [f"{prefix}{kind}.{i}" for i in range(layers) for kind in ("key", "value")]


def capture_slice_step(model: nn.Module, loss_fn: Callable, input_ids: torch.Tensor,
                       target: torch.Tensor, seq_len: int, offset: int, length: int,
                       last: bool, name: str = "slice") -> Captured:
    """The training step of the slice [offset, offset + length) of sequences `input_ids`
    [B, seq_len] with next-token `target` [B, seq_len] (see the module docstring).

    `loss_fn(logits, target)` must be a mean over the tokens, so that the sequence's loss is
    the sum of the slices' losses weighted by length / seq_len (the bundled LMs' `lm_loss`, a
    cross entropy over every position, is)."""
    adapter, (layers, kv_heads, head_size, dtype), forward = _slice_driver(model)
    batch = input_ids.shape[0]
    past_shape = (batch, kv_heads, offset, head_size)
    grad_shape = (batch, kv_heads, offset + length, head_size)
    past = [torch.zeros(past_shape, dtype=dtype, requires_grad=True)
            for _ in range(2 * layers)] if offset else []
    grads = [] if last else [torch.zeros(grad_shape, dtype=dtype) for _ in range(2 * layers)]
    weight = length / seq_len

    def slice_loss(out, labels, *grad_caches):
        logits, *caches = out
        loss = loss_fn(logits, labels) * weight
        surrogate = loss + sum(((c * g).sum() for c, g in zip(caches, grad_caches)),
                               torch.zeros(()))
        # extra outputs of the joint capture must not require gradients
        return (surrogate, loss.detach(), *([] if last else [c.detach() for c in caches]))

    span = slice(offset, offset + length)
    captured = capture_training(forward(adapter, offset, length),
                                (input_ids[:, span], *past), slice_loss,
                                (target[:, span], *grads), name=f"{name}")
    _name_slice_graph(captured, layers, bool(offset), last)
    return captured


def _name_slice_graph(captured: Captured, layers: int, has_past: bool, last: bool) -> None:
    """Inputs and outputs named as the module docstring says; the LOSS output is the slice's
    loss rather than the surrogate."""
    graph = captured.graph
    user = graph.inputs_with_role(Role.INPUT)
    names = (["input_ids"] + (slice_input_names(layers, "past_") if has_past else [])
             + ["target"] + ([] if last else slice_input_names(layers, "grad_")))
    if len(user) != len(names):
        raise CaptureError(f"the slice step has {len(user)} user inputs, expected {len(names)} "
                           f"(token ids, targets and the keys and values of {layers} layers)")
    renamed = {v.name: new for v, new in zip(user, names)}
    for v in graph.inputs:
        if v.role is Role.INPUT:
            v.name = renamed[v.name]
        elif v.name.startswith(_PREFIX):
            v.name = v.name[len(_PREFIX):]
    captured.state = {k.removeprefix(_PREFIX): t for k, t in captured.state.items()}
    for node in graph.nodes:  # module paths as in the model's own capture, for stage maps
        if node.module is not None:
            node.module = node.module.removeprefix(_PREFIX)
    if "tied" in graph.attrs:
        graph.attrs["tied"] = tuple(tuple(n.removeprefix(_PREFIX) for n in pair)
                                    for pair in graph.attrs["tied"])
    outputs = graph.outputs
    plain = [o for o in outputs if o.role is OutputRole.OUTPUT]  # slice loss, then the caches
    cache_names = [] if last else slice_input_names(layers, "")
    if len(plain) != 1 + len(cache_names):
        raise CaptureError(f"the slice step returns {len(plain)} plain outputs, expected the "
                           f"loss and {len(cache_names)} keys and values")
    loss = next(o for o in outputs if o.role is OutputRole.LOSS)
    loss.value = plain[0].value
    for out, cache in zip(plain[1:], cache_names):
        out.target = cache
    for out in outputs:
        if out.role is OutputRole.GRAD:
            out.target = renamed.get(out.target, out.target.removeprefix(_PREFIX))
    graph.outputs = [o for o in outputs if o is not plain[0]]
