"""A tiny Hugging Face ViT image classifier (attention biases, a class token), built from its
config with random weights: `graphpar compile examples/hf_vit.py --mode train --mesh 2x2
--run-cpu 4`. See examples/hf_opt.py for why attention biases matter to the certificate."""

import torch
import torch.nn.functional as F
import transformers


class Classifier(torch.nn.Module):
    """The model called on images, returning its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


def build():
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, image_size=16, patch_size=4,
                                    num_labels=5)
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    return Classifier(transformers.ViTForImageClassification(config)).eval(), (images,)


def loss(logits, labels):
    return F.cross_entropy(logits, labels)


def targets():
    return (torch.tensor([0, 3, 1, 4]),)
