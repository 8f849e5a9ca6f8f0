"""Layers and models whose parameters are views of one flat NumPy or CuPy vector."""

from .activations import GELU, ReLU, Tanh
from .base import BatchContext, Layer
from .dropout import Dropout
from .function_model import FunctionModel
from .layers import LayerNorm, Linear
from .losses import Loss, MSELoss, SoftmaxCrossEntropy
from .mlp import MLP
from .sequential import Sequential

__all__ = [
    "BatchContext",
    "Dropout",
    "FunctionModel",
    "GELU",
    "Layer",
    "LayerNorm",
    "Linear",
    "Loss",
    "MLP",
    "MSELoss",
    "ReLU",
    "Sequential",
    "SoftmaxCrossEntropy",
    "Tanh",
]
