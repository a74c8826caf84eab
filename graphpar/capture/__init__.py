"""Capture: PyTorch modules into graphpar IR through torch.export."""

from graphpar.capture.capture import Captured, capture_inference, capture_training
from graphpar.capture.optim import SGD, Adam

__all__ = ["Adam", "Captured", "SGD", "capture_inference", "capture_training"]
