"""The two ends of a language model: token and position embedding in, vocabulary logits out.

Both are top-level layers of [`GPT`][mpishard.nn.GPT] on sequences: inputs and
outputs are ``(batch, tokens, features)`` (the embedding reads ``(batch, tokens)``
integer ids).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm import FlatComm
from ..kernels.nn import scatter_add_rows
from .base import BatchContext, Layer, finish_gradient, store_gradient
from .layers import LayerNorm
from .shards import TensorShard, split_range
from .tensor_parallel import load_logical, tensor_parallel_comm

__all__ = [
    "Embedding",
    "LMHead",
]


def sequence_shape(layer: Layer, shape: tuple[int, ...], features: int) -> tuple[int, int]:
    """``(batch, tokens)`` of a ``(batch, tokens, features)`` input; raises on a misfit."""
    if len(shape) != 3 or shape[2] != features:
        raise ValueError(f"layer {layer.index} ({type(layer).__name__}) expects input of shape "
                         f"(batch, tokens, {features}), got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


class Embedding(Layer):
    """Token embedding ``wte`` ``(V, d)`` plus learned position embedding ``wpe`` ``(T, d)``.

    Input: integer token ids ``(batch, tokens)`` in ``[0, V)`` with ``tokens <= T``;
    output ``wte[ids] + wpe[:tokens]``, ``(batch, tokens, d)``. Both tables are
    held in full on every tensor-parallel rank (their gradients, from identical
    output gradients, stay identical). Initialised normal with deviation
    ``init_std`` (0.02, GPT-2's).

    The gradient of ``wte`` is a scatter-add of the output gradient over the
    ids, in the order of the rows on every backend
    (`mpishard.kernels.nn.scatter_add_rows`: the same bits in every run).
    """

    index_input = True

    def __init__(self, vocab_size: int, seq_len: int, d_model: int,
                 init_std: float = 0.02) -> None:
        if min(vocab_size, seq_len, d_model) < 1:
            raise ValueError(f"expecting positive sizes, got vocab_size={vocab_size}, "
                             f"seq_len={seq_len}, d_model={d_model}")
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.d_model = int(d_model)
        self.init_std = float(init_std)

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("wte", (self.vocab_size, self.d_model)), ("wpe", (self.seq_len, self.d_model))]

    def init_params(self, rng: np.random.Generator) -> None:
        for name, shape in self.param_shapes():
            load_logical(self, name, rng.normal(0.0, self.init_std, size=shape))

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 2:
            raise ValueError(f"layer {self.index} (Embedding) expects token ids of shape "
                             f"(batch, tokens), got shape {tuple(in_shape)}")
        if in_shape[1] > self.seq_len:
            raise ValueError(f"layer {self.index} (Embedding) holds positions for at most "
                             f"{self.seq_len} tokens, got {in_shape[1]}")
        return (int(in_shape[0]), int(in_shape[1]), self.d_model)

    def allocate_shape(self, in_shape: tuple[int, ...], train: bool,
                       need_dx: bool) -> dict[str, Any]:
        return {"y": self.xp.empty(self.output_shape(in_shape), dtype=self.dtype)}

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        xp, y = self.xp, buf["y"]
        tokens = x.shape[1]
        if x.size:
            lo, hi = int(x.min()), int(x.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"expecting token ids in [0, {self.vocab_size}), got ids "
                                 f"from {lo} to {hi}")
        _take_rows(xp, self.params["wte"], x, y)
        y += self.params["wpe"][:tokens]
        buf["ids"] = x   # the model's copy of the input: stays valid until backward
        return y

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: dict[str, Any],
                        scratch: dict[str, Any] | None) -> None:
        xp, ids = self.xp, buf["ids"]
        tokens, d = ids.shape[1], self.d_model
        # wte: scatter-add of the rows of dy at their token ids; accumulation adds
        # straight into the gradient, so no scratch is needed.
        gte = grads["wte"]
        if scratch is None:
            gte.fill(0)
        scatter_add_rows(gte, ids.reshape(-1), dy.reshape(-1, d))
        # wpe: the sum over the batch, for the positions present.
        gpe = grads["wpe"]
        out = store_gradient(gpe, scratch, "wpe")
        xp.sum(dy, axis=0, out=out[:tokens])
        if out is gpe:
            gpe[tokens:] = 0
        else:
            gpe[:tokens] += out[:tokens]

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        raise TypeError("token ids have no gradient: the embedding is the model's first layer")

    def config(self) -> dict[str, Any]:
        return {"class": "Embedding", "args": {"vocab_size": self.vocab_size,
                                               "seq_len": self.seq_len,
                                               "d_model": self.d_model,
                                               "init_std": self.init_std}}

    def __repr__(self) -> str:
        return f"Embedding({self.vocab_size}, {self.seq_len}, {self.d_model})"


def _take_rows(xp: Any, table: Any, ids: Any, out: Any) -> None:
    """``out[...] = table[ids]`` without a temporary."""
    if xp is np:
        # mode="clip": NumPy buffers the output with the default mode="raise";
        # the ids were checked by the caller.
        np.take(table, ids, axis=0, out=out, mode="clip")
    else:
        xp.take(table, ids, axis=0, out=out)


class LMHead(Layer):
    """Final LayerNorm ``ln_f`` then the vocabulary projection ``head.weight`` ``(d, V)``, no bias.

    Input ``(batch, tokens, d)``, output logits ``(batch, tokens, V)``; untied
    from the token embedding. With a tensor-parallel group of ``p`` ranks the
    head is **vocabulary-parallel**: rank ``r`` holds columns
    ``split_range(V, p, r)`` (pieces differ by at most one; ``V`` need not be
    divisible by ``p``) and outputs those logits, for
    [`VocabParallelCrossEntropy`][mpishard.nn.VocabParallelCrossEntropy]. Its input gradient is a
    partial sum, all-reduced over ``tp_comm`` (started before the weight
    gradient's matmul, waited for after it); ``ln_f`` is held in full.

    Raises:
        ValueError: ``vocab_size`` smaller than the tensor-parallel size.
    """

    def __init__(self, d_model: int, vocab_size: int, tp_comm: FlatComm | None = None,
                 init_std: float = 0.02, eps: float = 1e-5) -> None:
        self.tp_comm = tensor_parallel_comm(tp_comm)
        self.tp_size = 1 if self.tp_comm is None else self.tp_comm.size
        self.tp_rank = 0 if self.tp_comm is None else self.tp_comm.rank
        if vocab_size < self.tp_size:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tensor-parallel "
                             f"size {self.tp_size}")
        self.d_model = int(d_model)
        self.vocab_size = int(vocab_size)
        self.vocab = split_range(self.vocab_size, self.tp_size, self.tp_rank)
        self.init_std = float(init_std)
        self.ln_f = LayerNorm(d_model, eps=eps)

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("ln_f.weight", (self.d_model,)), ("ln_f.bias", (self.d_model,)),
                ("head.weight", (self.d_model, len(self.vocab)))]

    def local_shards(self) -> dict[str, TensorShard]:
        return {"head.weight": TensorShard.split("head.weight", (self.d_model, self.vocab_size),
                                                 1, self.tp_size, self.tp_rank)}

    def build(self, index: int, xp: Any, dtype: Any, params: dict[str, Any]) -> None:
        super().build(index, xp, dtype, params)
        self.ln_f.build(index, xp, dtype, _sub(params, "ln_f"))

    def init_params(self, rng: np.random.Generator) -> None:
        self.ln_f.init_params(rng)
        load_logical(self, "head.weight",
                     rng.normal(0.0, self.init_std, size=(self.d_model, self.vocab_size)))

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        b, t = sequence_shape(self, in_shape, self.d_model)
        return (b, t, len(self.vocab))

    def allocate_shape(self, in_shape: tuple[int, ...], train: bool,
                       need_dx: bool) -> dict[str, Any]:
        b, t = sequence_shape(self, in_shape, self.d_model)
        n, xp = b * t, self.xp
        buf = {"ln_f": self.ln_f.allocate(n, self.d_model, train, True),
               "y": xp.empty((b, t, len(self.vocab)), dtype=self.dtype)}
        if train:
            buf["dh"] = xp.empty((n, self.d_model), dtype=self.dtype)
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        y = buf["y"]
        h = self.ln_f.forward(x.reshape(-1, self.d_model), buf["ln_f"], ctx)
        self.xp.matmul(h, self.params["head.weight"], out=y.reshape(h.shape[0], y.shape[2]))
        buf["h"] = h
        return y

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: dict[str, Any],
                        scratch: dict[str, Any] | None) -> None:
        xp, dh, h = self.xp, buf["dh"], buf["h"]
        dl = dy.reshape(h.shape[0], dy.shape[2])
        # The input gradient first: its Allreduce runs during the weight matmul.
        xp.matmul(dl, self.params["head.weight"].T, out=dh)
        pending = self.tp_comm.Iallreduce(dh, slot="tp") if self.tp_size > 1 else None
        out = store_gradient(grads["head.weight"], scratch, "head.weight")
        xp.matmul(h.T, dl, out=out)
        finish_gradient(xp, grads["head.weight"], out)
        if pending is not None:
            pending.wait()
        self.ln_f.backward_params(dh, buf["ln_f"], _sub(grads, "ln_f"),
                                  None if scratch is None else _sub(scratch, "ln_f"))

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        dh = buf["dh"]
        return self.ln_f.backward_input(dh, buf["ln_f"]).reshape(buf["y"].shape[:2] +
                                                                 (self.d_model,))

    def config(self) -> dict[str, Any]:
        """The logical layer: ``tp_comm`` is not recorded (a communicator is not
        data), so the layer rebuilt from it is the whole, unsplit one."""
        return {"class": "LMHead", "args": {"d_model": self.d_model,
                                            "vocab_size": self.vocab_size,
                                            "init_std": self.init_std, "eps": self.ln_f.eps}}

    def __repr__(self) -> str:
        return (f"LMHead({self.d_model}, {self.vocab_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"vocab={list(self.vocab)})")


def _sub(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries ``"<prefix>.<name>"`` of ``d``, by ``name``."""
    head = prefix + "."
    return {k[len(head):]: v for k, v in d.items() if k.startswith(head)}
