"""Hugging Face GPT-2, BERT and LLaMA (built from configs, random weights, no downloads)."""

import pytest
import torch

from graphpar.capture import capture_inference, capture_training
from graphpar.ir.graph import OutputRole
from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.ir.verify import verify

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, max_position_embeddings=64)


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                     vocab_size=256, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)  # lm_head is tied to wte


def bert():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, **SMALL)
    return transformers.BertModel(config, add_pooling_layer=False)


def llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      bos_token_id=0, eos_token_id=0, **SMALL)
    return transformers.LlamaForCausalLM(config)


class Logits(torch.nn.Module):
    """The HF model called on token ids, returning one tensor (logits or hidden states)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=False, return_dict=True)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def build(factory):
    torch.manual_seed(0)
    model = factory()
    model.config._attn_implementation = "sdpa"  # the path graphpar keeps as one attention op
    module = Logits(model).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return module, ids


def loss_fn(out):
    return out.float().pow(2).mean()


@pytest.mark.parametrize("factory", [gpt2, bert, llama])
def test_hf_inference_matches_eager(factory):
    module, ids = build(factory)
    captured = capture_inference(module, (ids,), name=factory.__name__)
    verify(captured.graph)
    assert parse(print_graph(captured.graph)) == captured.graph
    (out,) = captured.run(ids)
    with torch.no_grad():
        torch.testing.assert_close(out, module(ids), atol=1e-5, rtol=1e-5)
    assert captured.graph.find("attention"), "SDPA should stay one attention op"


def assert_training_gradients_match_eager(module, ids) -> dict[str, str]:
    """The captured training step's loss and every gradient equal eager autograd's, and every
    parameter with a gradient has one output (tied ones once); returns the tied names."""
    captured = capture_training(module, (ids,), loss_fn)
    verify(captured.graph)
    outputs = captured.run(ids)
    module.zero_grad()
    loss = loss_fn(module(ids))
    loss.backward()
    params = dict(module.named_parameters(remove_duplicate=False))
    seen = set()
    for out, tensor in zip(captured.graph.outputs, outputs):
        if out.role is OutputRole.LOSS:
            torch.testing.assert_close(tensor, loss.detach(), atol=1e-5, rtol=1e-5)
        elif out.role is OutputRole.GRAD:
            torch.testing.assert_close(tensor, params[out.target].grad, atol=1e-5, rtol=1e-5)
            seen.add(out.target)
    tied = dict(captured.graph.attrs.get("tied", ()))
    assert {tied.get(n, n) for n, p in params.items() if p.grad is not None} == seen
    return tied


@pytest.mark.parametrize("factory", [gpt2, bert, llama])
def test_hf_training_gradients_match_eager(factory):
    module, ids = build(factory)
    tied = assert_training_gradients_match_eager(module, ids)
    if factory is gpt2:
        assert tied == {"model.transformer.wte.weight": "model.lm_head.weight"}
