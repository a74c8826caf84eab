"""Models beyond decoder-only LMs, as users write them: Hugging Face encoder-decoders (T5,
BART, Whisper with its 1-D convolutions), encoders (RoBERTa, ViT), ConvNeXt's depthwise
convolutions, wav2vec2's convolutional feature encoder and weight-normalized positional
convolution, a Stable-Diffusion-style UNet block (group norm, strided and transposed
convolutions, spatial attention) and a Mamba-style block (a depthwise causal 1-D convolution and
the selective scan in plain torch). Each, sharded on 2 gloo ranks, equals eager PyTorch within
the certificate's rounding; T5 and Whisper train pipelined in 2 stages spanning encoder and
decoder. The model runs take minutes on 2 loaded cores, so they are `slow`; the default suite
keeps one Mamba block trained on 2 ranks in lockstep (and tests/capture/test_conv_ops.py, every
convolution kind)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import graphpar
from graphpar.capture import Adam
from graphpar.compiler.model_file import load_model_file

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
VOCAB = 96


def example(name: str, mode: str = "infer"):
    """(module, inputs, loss, targets) from examples/<name>.py."""
    spec = load_model_file(EXAMPLES / f"{name}.py", mode)
    return spec.module, spec.inputs, spec.loss_fn, spec.targets


class Logits(torch.nn.Module):
    """A Hugging Face model called with its inputs by keyword, returning its logits."""

    def __init__(self, model, *keys):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *inputs):
        return self.model(**dict(zip(self.keys, inputs))).logits


def ids(seed: int, shape=(4, 8)) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def hf(config_class, model_class, keys, inputs, **config):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**config)
    cls = getattr(transformers, model_class)
    config._attn_implementation = "sdpa" if cls._supports_sdpa else "eager"  # ConvNeXt: none
    # eval(): no dropout, which a captured step cannot draw; gradients flow all the same
    return Logits(cls(config), *keys).eval(), inputs, None, ()


TINY = dict(num_attention_heads=4, intermediate_size=64, hidden_size=32, num_hidden_layers=2)


def bart():
    return hf("BartConfig", "BartForConditionalGeneration", ("input_ids", "decoder_input_ids"),
              (ids(1, (4, 12)), ids(2)), vocab_size=VOCAB, d_model=32, encoder_layers=2,
              decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
              encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)


def roberta():
    return hf("RobertaConfig", "RobertaForMaskedLM", ("input_ids",), (ids(1),),
              vocab_size=VOCAB, max_position_embeddings=32, **TINY)


def convnext():
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return hf("ConvNextConfig", "ConvNextForImageClassification", ("pixel_values",), (images,),
              num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5)


def wav2vec2():
    audio = torch.randn(4, 400, generator=torch.Generator().manual_seed(1))
    return hf("Wav2Vec2Config", "Wav2Vec2ForCTC", ("input_values",), (audio,),
              conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
              num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, vocab_size=20,
              do_stable_layer_norm=True, feat_extract_norm="layer", **TINY)


MODELS = {
    "t5": lambda: example("hf_t5"),
    "bart": bart,
    "whisper": lambda: example("hf_whisper"),
    "roberta": roberta,
    "vit": lambda: example("hf_vit"),
    "convnext": convnext,
    "wav2vec2": wav2vec2,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_on_two_gloo_ranks_equals_eager(name):
    module, inputs, _, _ = MODELS[name]()
    compiled = graphpar.compile(module, inputs, mesh="2", cluster="cpu", time_limit=10)
    check = compiled.check(processes=True)
    assert check.within_tolerance, check.verdict() + "\n" + "\n".join(check.lines())


def certify_training(module, inputs, loss, targets, processes=True, **options):
    compiled = graphpar.compile(module, inputs, mesh="2", mode="train", loss_fn=loss,
                                targets=targets, optimizer=Adam(), cluster="cpu", time_limit=10,
                                keep_grads=True, **options)
    return compiled, compiled.check(**({} if "pipeline" in options else
                                       {"processes": processes}))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_t5", "hf_whisper"])
def test_encoder_decoder_trains_pipelined_in_two_stages_equal_to_eager(name):
    """Stage 1 holds decoder layers, which read the encoder's output from stage 0."""
    compiled, check = certify_training(*example(name, "train"), pipeline=2, microbatches=2)
    assert compiled.stages == 2
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.within_tolerance, check.verdict() + "\n" + "\n".join(check.lines())


def mse(out, target):
    return F.mse_loss(out, target)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unet_block", "mamba_block"])
def test_block_trains_sharded_on_two_gloo_ranks_equal_to_eager(name):
    _, check = certify_training(*example(name, "train"))
    assert check.within_tolerance, check.verdict() + "\n" + "\n".join(check.lines())


def test_one_mamba_block_trains_sharded_on_two_ranks_equal_to_eager():
    """The fast one: one Mamba block over 4 positions (its depthwise causal convolution and
    scan), a training step with Adam on 2 ranks in lockstep (no processes to start)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mamba_block", EXAMPLES / "mamba_block.py")
    mamba = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mamba)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(4, 4, 16, generator=gen), torch.randn(4, 4, 16, generator=gen)
    compiled, check = certify_training(mamba.MambaBlock(), (x,), mse, (target,),
                                       processes=False)
    assert {"convolution", "convolution_backward"} <= {n.op for n in compiled.graph.nodes}
    assert check.within_tolerance, check.verdict() + "\n" + "\n".join(check.lines())
