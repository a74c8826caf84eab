"""Inference capture: prefill and decode graphs with an explicit KV cache equal eager PyTorch."""

import pytest
import torch
from serve_testutil import prompts

from graphpar.backends import reference
from graphpar.capture.decoder import (
    KVState,
    capture_prefill,
    decoder_adapter,
    kv_cache_attention,
)
from graphpar.errors import GenerationError
from graphpar.ir.graph import Role
from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.ir.verify import verify

ALL = ["gpt", "llama", "hf-gpt2", "hf-llama"]


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", ALL)
def test_prefill_graph_equals_eager(name, models, engines):
    module = models(name)
    captured = engines(name).engine.model.captured_prefill  # captured at 6 tokens, 2 logit rows
    graph = captured.graph
    verify(graph)
    assert parse(print_graph(graph)) == graph
    assert graph.find("attention") and graph.attrs["decoder"] == "prefill"
    (ids,) = prompts([6], seed=1)
    ids = torch.tensor([ids])
    outputs = captured.run(ids, torch.arange(6)[None], torch.tensor([2, 5]))
    with torch.no_grad():
        expected = logits_of(module(ids))
    torch.testing.assert_close(outputs[0][0], expected[0, [2, 5]], atol=1e-5, rtol=1e-5)
    info = decoder_adapter(module).info()
    assert len(outputs) == 1 + 2 * info.num_layers
    for key in outputs[1::2]:  # the cache the prompt fills: [B, kv_heads, S, D]
        assert key.shape == (1, info.num_kv_heads, 6, info.head_size)


@pytest.mark.parametrize("name", ALL)
def test_decode_graph_equals_eager(name, models, engines):
    """Decode one token for 2 sequences of different lengths over a left-padded past."""
    module = models(name)
    adapter = decoder_adapter(module)
    captured = engines(name).engine.model.captured_decode  # batch 2, past of 2
    graph = captured.graph
    verify(graph)
    assert parse(print_graph(graph)) == graph
    past_names = [v.name for v in graph.inputs if v.name.startswith("past_")]
    assert past_names == [f"past_{kv}.{i}" for i in range(adapter.info().num_layers)
                          for kv in ("key", "value")]
    assert len(graph.outputs) == 1 + len(past_names)
    seqs = prompts([3, 2], seed=2)
    # The past of each sequence from an eager prefill, left-padded to 2 positions.
    past = []
    for seq in seqs:
        state = KVState()
        with torch.no_grad(), kv_cache_attention(state, adapter):
            adapter(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1)[None])
        past.append(state.present)
    tensors = []
    for layer in range(len(past[0])):
        for kind in range(2):
            rows = []
            for p in past:
                t = p[layer][kind]
                rows.append(torch.nn.functional.pad(t, (0, 0, 2 - t.shape[2], 0)))
            tensors.append(torch.cat(rows))
    mask = torch.tensor([[True, True, True], [False, True, True]])
    ids = torch.tensor([[s[-1]] for s in seqs])
    positions = torch.tensor([[len(s) - 1] for s in seqs])
    names = [f"past_{kind}.{i}" for i in range(len(past[0])) for kind in ("key", "value")]
    outputs = reference.run(graph, {**captured.state, **dict(zip(names, tensors)),
                                    "input_ids": ids, "positions": positions, "attn_mask": mask})
    for row, seq in enumerate(seqs):
        with torch.no_grad():
            expected = logits_of(module(torch.tensor([seq])))[0, -1]
        torch.testing.assert_close(outputs[0][row, 0], expected, atol=1e-5, rtol=1e-5)
    assert outputs[1].shape[2] == 3  # past + the new token


def test_prefill_and_decode_share_parameters(engines):
    model = engines("gpt").engine.model
    prefill, decode = model.captured_prefill, model.captured_decode
    params = {v.name for v in prefill.graph.inputs if v.role is Role.PARAM}
    assert params == {v.name for v in decode.graph.inputs if v.role is Role.PARAM}
    assert "tok_emb.weight" in params  # the user's names, no wrapper prefix
    for name in params:
        assert prefill.state[name].data_ptr() == decode.state[name].data_ptr()


def test_reference_executor_runs_captured_prefill(models):
    module = models("gpt")
    captured = capture_prefill(module, num_tokens=4, num_logits=1)
    ids = torch.tensor([[5, 6, 7, 8]])
    (logits, *_) = reference.run(captured.graph, captured.bind(ids, torch.arange(4)[None],
                                                               torch.tensor([3])))
    with torch.no_grad():
        torch.testing.assert_close(logits[0, 0], module(ids)[0, -1], atol=1e-5, rtol=1e-5)


def test_unservable_models_are_clear_errors(models):
    with pytest.raises(GenerationError, match="cannot serve Linear"):
        decoder_adapter(torch.nn.Linear(4, 4))
    module = models("gpt").train()
    try:
        with pytest.raises(GenerationError, match="training mode"):
            decoder_adapter(module)
    finally:
        module.eval()


class NonCausal(torch.nn.Module):
    """forward(input_ids, position_ids) with a bidirectional attention: not servable."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.max_model_len = 16

    def forward(self, input_ids, position_ids=None):
        x = self.emb(input_ids)[:, None]
        y = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=False)
        return y[:, 0] @ self.emb.weight.T


def test_non_causal_attention_is_rejected():
    with pytest.raises(GenerationError, match="causal self-attention"):
        decoder_adapter(NonCausal().eval()).info()
