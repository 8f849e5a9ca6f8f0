"""Deprecated: ``ShardedSequential`` is [`mpishard.nn.LayerStack`][mpishard.nn.LayerStack]
(``mpishard.nn.stack``); the tensor-shard records live in `mpishard.nn.shards`."""

from .._deprecated import forward_names
from . import shards as _shards
from . import stack as _stack

# Nothing is defined here: the names are read from their new homes, with a warning.
__all__: list[str] = []
_MOVED = ("ShardedSequential", "TensorShard", "owned_ranges", "split_range", "tensor_shards")

__getattr__ = forward_names(__name__, {
    "ShardedSequential": (_stack, "LayerStack"),
    **{name: (_shards, name) for name in _MOVED[1:]},
})
