"""A tiny Hugging Face Whisper speech-to-text model (two 1-D convolutions over log-mel frames,
an encoder and a decoder with cross-attention), built from its config with random weights:
`graphpar compile examples/hf_whisper.py --mesh 2 --run-cpu 2`, or trained pipelined, its
stages spanning encoder and decoder: `--mode train --pipeline 2 --run-cpu 2`."""

import torch
import torch.nn.functional as F
import transformers

VOCAB = 96
MELS, FRAMES = 8, 32  # the encoder's two convolutions halve the frames: 16 positions


class SpeechToText(torch.nn.Module):
    """The model called on log-mel features and the decoder's tokens, returning its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_features, decoder_input_ids):
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids,
                          use_cache=False).logits


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))


def build():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=FRAMES // 2, max_target_positions=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    config._attn_implementation = "sdpa"
    features = torch.randn(4, MELS, FRAMES, generator=torch.Generator().manual_seed(2))
    # eval(): no dropout, which a captured step cannot draw; gradients flow all the same
    model = SpeechToText(transformers.WhisperForConditionalGeneration(config)).eval()
    return model, (features, tokens())


def loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def targets():
    return (torch.roll(tokens(), -1, 1),)
