"""Layers and models whose parameters are views of one flat NumPy or CuPy vector."""

from ..flat import ParameterShard
from .activations import GELU, ReLU, Tanh
from .attention import CausalSelfAttention
from .base import BatchContext, Layer
from .dropout import Dropout
from .embedding import Embedding, LMHead
from .function_model import FunctionModel
from .gpt import GPT, TransformerBlock
from .hybrid import HybridShardedModel
from .layers import LayerNorm, Linear
from .losses import Loss, MSELoss, SoftmaxCrossEntropy
from .mlp import MLP
from .model_methods import ARCHITECTURE_VERSION, Described, ModelMethods, TrainingHistory
from .registry import layer_from_config, loss_from_config, model_from_config
from .sequential import Sequential
from .shards import TensorShard, owned_ranges, tensor_shards
from .stack import LayerStack
from .tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelCrossEntropy,
)

__all__ = [
    "ARCHITECTURE_VERSION",
    "BatchContext",
    "CausalSelfAttention",
    "ColumnParallelLinear",
    "Described",
    "Dropout",
    "Embedding",
    "FunctionModel",
    "GELU",
    "GPT",
    "HybridShardedModel",
    "LMHead",
    "Layer",
    "LayerNorm",
    "Linear",
    "Loss",
    "MLP",
    "MSELoss",
    "ModelMethods",
    "ParallelMLP",
    "ParameterShard",
    "ReLU",
    "RowParallelLinear",
    "Sequential",
    "LayerStack",
    "SoftmaxCrossEntropy",
    "Tanh",
    "TensorShard",
    "TrainingHistory",
    "TransformerBlock",
    "VocabParallelCrossEntropy",
    "layer_from_config",
    "loss_from_config",
    "model_from_config",
    "owned_ranges",
    "tensor_shards",
]
