"""Megatron-style tensor parallelism: column- and row-parallel Linear, vocabulary-parallel
cross-entropy, and [`ParallelMLP`][mpishard.nn.ParallelMLP].

The group of ``p`` tensor-parallel ranks is given as a
[`FlatComm`][mpishard.comm.FlatComm] (``tp_comm``); every rank of it sees the same
input rows. Megatron's two conjugate operators place the communication:

* ``f``: identity in forward, Allreduce of the input gradient in backward. It
  sits before a [`ColumnParallelLinear`][mpishard.nn.ColumnParallelLinear] (or the three projections
  of an attention), whose input is the full activation held on every rank.
* ``g``: Allreduce in forward, identity in backward. It sits after a
  [`RowParallelLinear`][mpishard.nn.RowParallelLinear], which multiplies a split activation by its
  rows of the weight and so holds a partial sum of the output.

A column-parallel Linear followed by a row-parallel one (an MLP, an attention)
therefore costs one Allreduce in forward and one in backward, each of the size
of the full activation. Tensors that are not split (biases of row-parallel
layers, LayerNorms, embeddings) are held in full on every rank and stay
identical without communication: their inputs and their output gradients are
identical on every rank.

With ``tp_comm=None`` (or a group of one) the layers are plain layers and
communicate nothing; their parameters and results equal those of
[`Linear`][mpishard.nn.Linear] exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..comm import FlatComm, from_comm
from ..flat import ParameterShard
from .activations import GELU, ReLU, Tanh
from .base import BatchContext, Layer
from .dropout import Dropout
from .layers import LayerNorm, Linear
from .losses import Loss, MSELoss, SoftmaxCrossEntropy, check_labels
from .model_methods import Described
from .shards import TensorShard, split_range
from .stack import LayerStack

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "check_tensor_parallel",
    "tensor_parallel_comm",
]


def tensor_parallel_comm(comm: Any) -> FlatComm | None:
    """``comm`` as a [`FlatComm`][mpishard.comm.FlatComm]: a FlatComm, an mpi4py communicator
    (``config.groups.tp``, named "tensor-parallel"), or None (no tensor parallelism).

    Raises:
        TypeError: anything else.
    """
    if comm is None:
        return None
    try:
        return from_comm(comm, "tensor-parallel")
    except TypeError:
        raise TypeError(f"expecting a FlatComm, an MPI intra-communicator or None as tp_comm, "
                        f"got {type(comm).__name__}") from None


def check_tensor_parallel(tp_comm: FlatComm | None, problem: str | None) -> None:
    """Raise ``ValueError(problem)`` on every rank of ``tp_comm`` if any rank has one.

    Collective over ``tp_comm`` (a plain raise without one).
    """
    if tp_comm is not None:
        tp_comm.agree(problem, ValueError)
    elif problem is not None:
        raise ValueError(problem)


def _size_rank(tp_comm: FlatComm | None) -> tuple[int, int]:
    return (1, 0) if tp_comm is None else (tp_comm.size, tp_comm.rank)


def load_logical(layer: Layer, name: str, full: np.ndarray) -> None:
    """Set the layer's tensor ``name`` from the logical (unsplit) host array ``full``."""
    shard = layer.local_shards().get(name)
    part = full if shard is None else full[shard.index]
    layer.params[name][...] = layer.xp.asarray(part.astype(layer.dtype, copy=False))


def draw_linear(rng: np.random.Generator, layer: Layer, shapes: dict[str, tuple[int, ...]],
                init_std: float | None, fan_in: int) -> None:
    """Draw a Linear's full weight (then bias) from ``rng`` and keep the layer's slices.

    ``init_std=None``: PyTorch's ``nn.Linear`` default, uniform in
    ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` for both, as [`Linear`][mpishard.nn.Linear];
    otherwise weight normal with that deviation and bias zero (GPT-2).
    """
    for name, shape in shapes.items():
        if init_std is None:
            bound = 1.0 / math.sqrt(fan_in)
            full = rng.uniform(-bound, bound, size=shape)
        elif name == "weight":
            full = rng.normal(0.0, init_std, size=shape)
        else:
            full = np.zeros(shape)
        load_logical(layer, name, full)


def _divisible(what: str, n: int, p: int) -> str | None:
    if n % p:
        return f"{what}={n} is not divisible by the tensor-parallel size {p}"
    return None


class _SplitLinear(Linear):
    """A [`Linear`][mpishard.nn.Linear] whose weight is split over the
    tensor-parallel group along ``split_axis`` (1: output features, 0: input
    features).

    Shapes, buffers, initialisation and the parameter gradients are shared
    (the gradients are `Linear`'s on this rank's slice); the subclasses add
    where the communication goes.
    """

    #: The weight's axis split over the ranks.
    split_axis: int
    _CONFIG = ("in_features", "out_features", "bias", "init_std")

    def __init__(self, in_features: int, out_features: int, tp_comm: FlatComm | None = None,
                 bias: bool = True, *, init_std: float | None = None) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp_comm = tensor_parallel_comm(tp_comm)
        self.tp_size, self.tp_rank = _size_rank(self.tp_comm)
        columns = self.split_axis == 1
        problem = _divisible("out_features" if columns else "in_features",
                             out_features if columns else in_features, self.tp_size)
        if problem is not None:
            raise ValueError(f"{type(self).__name__}({in_features}, {out_features}): {problem}")
        if columns:
            self.local_out = self.out_features // self.tp_size
        else:
            self.local_in = self.in_features // self.tp_size
        self.init_std = init_std

    def init_params(self, rng: np.random.Generator) -> None:
        shapes = {"weight": (self.in_features, self.out_features)}
        if self.bias:
            shapes["bias"] = (self.out_features,)
        draw_linear(rng, self, shapes, self.init_std, self.in_features)

    def config(self) -> dict[str, Any]:
        """The logical layer: ``tp_comm`` is not recorded (a communicator is not
        data), so the layer rebuilt from it is the whole, unsplit one."""
        return super().config()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_features}, {self.out_features}, "
                f"tp={self.tp_rank}/{self.tp_size}, bias={self.bias})")


class ColumnParallelLinear(_SplitLinear):
    """``y = x @ W + b`` with the **output features split** over the tensor-parallel group.

    Rank ``r`` of ``p`` holds ``W[:, r*out/p:(r+1)*out/p]`` and that slice of
    ``b``, and outputs those features. Forward: the input is the full
    activation (Megatron's ``f``: identity). Backward: each rank's input
    gradient is a partial sum over its features, so it is all-reduced over
    ``tp_comm`` (``f``'s backward), started before the weight gradient is
    computed and waited for after (the Allreduce overlaps that matmul).
    ``reduce_input_grad=False`` leaves the reduction to the caller.

    Initialisation draws the full ``(in, out)`` weight as [`Linear`][mpishard.nn.Linear] does
    (or normal with ``init_std`` and zero bias) and keeps its slice, so the
    model does not depend on ``p``.

    Raises:
        ValueError: ``out_features`` not divisible by ``p``; not positive sizes.
    """

    split_axis = 1
    _CONFIG = ("in_features", "out_features", "bias", "reduce_input_grad", "init_std")

    def __init__(self, in_features: int, out_features: int, tp_comm: FlatComm | None = None,
                 bias: bool = True, *, reduce_input_grad: bool = True,
                 init_std: float | None = None) -> None:
        super().__init__(in_features, out_features, tp_comm, bias, init_std=init_std)
        self.reduce_input_grad = reduce_input_grad

    def local_shards(self) -> dict[str, TensorShard]:
        p, r = self.tp_size, self.tp_rank
        shards = {"weight": TensorShard.split("weight", (self.in_features, self.out_features),
                                              1, p, r)}
        if self.bias:
            shards["bias"] = TensorShard.split("bias", (self.out_features,), 0, p, r)
        return shards

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: dict[str, Any],
                        scratch: dict[str, Any] | None) -> None:
        if "dx" in buf:
            # The input gradient first, so its Allreduce runs during the weight matmul.
            self.xp.matmul(dy, self.params["weight"].T, out=buf["dx"])
            if self.reduce_input_grad and self.tp_size > 1:
                buf["pending"] = self.tp_comm.Iallreduce(buf["dx"], slot="tp")
        super().backward_params(dy, buf, grads, scratch)

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        pending = buf.pop("pending", None)
        if pending is not None:
            pending.wait()
        return buf["dx"]


class RowParallelLinear(_SplitLinear):
    """``y = x @ W + b`` with the **input features split** over the tensor-parallel group.

    Rank ``r`` of ``p`` holds ``W[r*in/p:(r+1)*in/p, :]`` and reads the matching
    features of a split input (the output of a
    [`ColumnParallelLinear`][mpishard.nn.ColumnParallelLinear]). Forward: the partial products are
    all-reduced over ``tp_comm`` (Megatron's ``g``) and the bias, held in full on every rank, is
    added after the reduction. Backward: identity (no communication); the input gradient is
    this rank's features only.

    Raises:
        ValueError: ``in_features`` not divisible by ``p``; not positive sizes.
    """

    split_axis = 0
    #: The bias is added after the reduction: it cannot be left to the activation.
    folds_bias = False

    def local_shards(self) -> dict[str, TensorShard]:
        return {"weight": TensorShard.split("weight", (self.in_features, self.out_features),
                                            0, self.tp_size, self.tp_rank)}

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        y = buf["y"]
        self.xp.matmul(x, self.params["weight"], out=y)
        if self.tp_size > 1:
            self.tp_comm.Allreduce(y, slot="tp")
        if self.bias:
            y += self.params["bias"]
        buf["x"] = x
        return y


class VocabParallelCrossEntropy(Loss):
    """Softmax cross-entropy of logits split by vocabulary over the tensor-parallel group.

    Rank ``r`` holds the logits of vocabulary entries ``split_range(V, p, r)``
    (the output of a vocabulary-parallel head) and every rank holds all labels.
    Each rank computes its rows' local ``logsumexp`` (shifted by its local
    maximum: no overflow) and the sum of the target logits it owns; one
    Allgatherv over ``tp_comm`` of these ``rows + 1`` numbers per rank gives every
    rank the global ``logsumexp`` per row (combined stably over ranks) and the
    loss. The gradient ``softmax - onehot`` of the local logits needs no further
    communication. Megatron uses three Allreduces (max, target logit, sum of
    exponentials); this is one collective of the same size.

    With ``tp_comm=None`` it equals [`SoftmaxCrossEntropy`][mpishard.nn.SoftmaxCrossEntropy] to
    rounding.
    """

    def __init__(self, vocab_size: int, tp_comm: FlatComm | None = None) -> None:
        self.tp_comm = tensor_parallel_comm(tp_comm)
        self.tp_size, self.tp_rank = _size_rank(self.tp_comm)
        self.vocab_size = int(vocab_size)
        self.vocab = split_range(self.vocab_size, self.tp_size, self.tp_rank)

    def allocate(self, rows: int, features: int) -> dict[str, Any]:
        if features != len(self.vocab):
            raise ValueError(f"VocabParallelCrossEntropy expects {len(self.vocab)} logits per "
                             f"row (vocabulary {list(self.vocab)}), got {features}")
        xp, dt, p = self.xp, self.dtype, self.tp_size
        return {
            "grad": xp.empty((rows, features), dtype=dt),     # exp, then the gradient
            "onehot": xp.empty((rows, features), dtype=dt),
            "ids": xp.arange(self.vocab.start, self.vocab.stop).reshape(1, features),
            "max": xp.empty((rows, 1), dtype=dt),
            "lse": xp.empty((rows, 1), dtype=dt),
            "gather": xp.empty((p, rows + 1), dtype=dt),      # per rank: lse rows, target sum
            "spread": xp.empty((p, rows), dtype=dt),
        }

    def check_target(self, target: Any, rows: int, features: int) -> Any:
        return check_labels(self, target, rows)

    def loss_and_grad(self, out: Any, target: Any, buf: dict[str, Any]) -> tuple[Any, Any]:
        xp = self.xp
        e, onehot, mx, lse = buf["grad"], buf["onehot"], buf["max"], buf["lse"]
        gather, spread = buf["gather"], buf["spread"]
        rows = out.shape[0]
        # Local logsumexp, shifted by the local maximum.
        xp.max(out, axis=1, keepdims=True, out=mx)
        xp.subtract(out, mx, out=e)
        xp.exp(e, out=e)
        xp.sum(e, axis=1, keepdims=True, out=lse)
        xp.log(lse, out=lse)
        lse += mx
        # The labels this rank owns, as a one-hot of its vocabulary slice (a
        # comparison into a buffer: no fancy-index result to allocate).
        xp.equal(buf["ids"], target.reshape(rows, 1), out=onehot)
        mine = gather[self.tp_rank]
        mine[:rows] = lse[:, 0]
        mine[rows] = xp.vdot(onehot.ravel(), out.ravel())
        if self.tp_size > 1:
            self.tp_comm.Allgatherv(gather.reshape(-1), [rows + 1] * self.tp_size, slot="tp")
        # Global logsumexp per row: a stable logsumexp over the ranks' values.
        part = gather[:, :rows]
        mrow = mx[:, 0]
        xp.max(part, axis=0, out=mrow)
        xp.subtract(part, mrow, out=spread)
        xp.exp(spread, out=spread)
        total = lse[:, 0]
        xp.sum(spread, axis=0, out=total)
        xp.log(total, out=total)
        total += mrow
        scale = 1.0 / rows if rows else 0.0
        loss = (xp.sum(total) - xp.sum(gather[:, rows])) * scale
        # d(loss)/d(logits) = (softmax - onehot) / rows, softmax = exp(z - lse).
        xp.subtract(out, lse, out=e)
        xp.exp(e, out=e)
        e -= onehot
        e *= scale
        return loss, e

    def config(self) -> dict[str, Any]:
        """The logical loss: ``tp_comm`` is not recorded (a communicator is not
        data), so the loss rebuilt from it works on the whole, unsplit vocabulary."""
        return {"class": "VocabParallelCrossEntropy", "args": {"vocab_size": self.vocab_size}}

    def __repr__(self) -> str:
        return (f"VocabParallelCrossEntropy({self.vocab_size}, "
                f"tp={self.tp_rank}/{self.tp_size}, vocab={list(self.vocab)})")


class _ColumnSliceDropout(Dropout):
    """Dropout after a column-parallel layer: this rank's columns of the full-width mask.

    The mask is drawn for the full width, exactly as the serial model's
    [`Dropout`][mpishard.nn.Dropout] draws it, and columns ``[lo, hi)`` are used, so the
    tensor-parallel model drops the same elements as the serial one.
    """

    def __init__(self, p: float, seed: int, full_features: int, columns: tuple[int, int]) -> None:
        super().__init__(p, seed=seed)
        self.full_features = int(full_features)
        self.columns = columns

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        if ctx is None or self.p == 0.0:
            return x
        xp, y, host_drop = self.xp, buf["y"], buf["host_drop"]
        rows = x.shape[0]
        lo, hi = self.columns
        u = self.global_uniform(ctx, self.full_features)
        np.less(u[ctx.start:ctx.start + rows, lo:hi], self.p, out=host_drop)
        drop = buf["drop"] = xp.asarray(host_drop)
        xp.multiply(x, 1.0 / (1.0 - self.p), out=y)
        xp.copyto(y, 0, where=drop)
        return y

    def __repr__(self) -> str:
        return f"Dropout(p={self.p}, seed={self.seed}, columns={list(self.columns)})"


_ACTIVATIONS: dict[str, type[Layer]] = {"gelu": GELU, "relu": ReLU, "tanh": Tanh}
_LOSSES: dict[str, type[Loss]] = {"cross_entropy": SoftmaxCrossEntropy, "mse": MSELoss}


class ParallelMLP(Described, LayerStack):
    """[`MLP`][mpishard.nn.MLP], tensor-parallel over ``tp_comm`` and/or one pipeline stage.

    Same arguments, layers, tensor names and initial values as ``MLP(sizes,
    ...)``; with ``tp_comm=None`` and ``stage_layers=None`` it *is* that MLP
    (equal parameters, equal results). The Linear layers are paired in order:
    Linears ``0, 2, 4, ...`` are column-parallel and the one after each is
    row-parallel, so a pair costs one Allreduce forward and one backward (none
    backward for the first pair: nothing needs the gradient of the data). An
    unpaired last Linear (an odd number of Linears) is held in full on every
    rank. The activation (and dropout) between a pair works on the rank's
    columns; dropout there uses this rank's columns of the serial model's mask.

    ``stage_layers=(start, stop)`` builds top-level layers ``[start, stop)`` only
    (see [`LayerStack`][mpishard.nn.LayerStack] for the stage API);
    the indices are those of the MLP's layers (Linear, [LayerNorm], activation,
    [Dropout], Linear, ...).

    Building is collective over ``tp_comm`` (a size error is raised on every rank).

    Raises:
        ValueError: fewer than two sizes; an unknown activation or loss; the
            output width of a column-parallel Linear not divisible by the
            tensor-parallel size; ``layer_norm=True`` with tensor parallelism
            (a LayerNorm would follow a column-parallel Linear, whose rows are split).
        TypeError: ``dtype`` is not float32 or float64.
    """

    def __init__(self, sizes: Sequence[int], activation: str = "relu",
                 loss: str = "cross_entropy", dtype: Any = np.float64, xp: Any = np,
                 seed: int = 0, layer_norm: bool = False, dropout: float = 0.0, *,
                 tp_comm: Any = None, stage_layers: tuple[int, int] | None = None,
                 shard: ParameterShard | None = None) -> None:
        self.tp_comm = tensor_parallel_comm(tp_comm)
        p, r = _size_rank(self.tp_comm)
        sizes = [int(s) for s in sizes]
        problem = None
        if len(sizes) < 2:
            problem = f"expecting at least 2 sizes (input and output), got {sizes}"
        elif activation not in _ACTIVATIONS:
            problem = f"expecting activation 'relu', 'gelu' or 'tanh', got {activation!r}"
        elif loss not in _LOSSES:
            problem = f"expecting loss 'cross_entropy' or 'mse', got {loss!r}"
        elif layer_norm and p > 1:
            problem = (f"layer_norm=True is not supported with tensor-parallel size {p}: a "
                       f"LayerNorm after a column-parallel Linear would see split rows")
        else:
            n_linear = len(sizes) - 1
            for k in range(0, n_linear - 1, 2):
                problem = problem or _divisible(f"sizes[{k + 1}]", sizes[k + 1], p)
        check_tensor_parallel(self.tp_comm, problem)

        n_linear = len(sizes) - 1
        layers: list[Layer] = []
        for k, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            column = k % 2 == 0 and k + 1 < n_linear
            if column:
                layers.append(ColumnParallelLinear(fan_in, fan_out, self.tp_comm))
            elif k % 2 == 1:
                layers.append(RowParallelLinear(fan_in, fan_out, self.tp_comm))
            else:
                layers.append(Linear(fan_in, fan_out))
            if k == n_linear - 1:
                break
            if layer_norm:
                layers.append(LayerNorm(fan_out))
            layers.append(_ACTIVATIONS[activation]())
            if dropout and column:
                cols = split_range(fan_out, p, r)
                layers.append(_ColumnSliceDropout(dropout, seed, fan_out, (cols.start, cols.stop)))
            elif dropout:
                layers.append(Dropout(dropout, seed=seed))
        self.sizes = sizes
        self._options = {"activation": activation, "loss": loss,
                         "layer_norm": bool(layer_norm), "dropout": float(dropout)}
        super().__init__(layers, _LOSSES[loss](), dtype=dtype, xp=xp, seed=seed,
                         stage_layers=stage_layers, shard=shard)

    def config(self) -> dict[str, Any]:
        """The whole model as JSON ([`model_from_config`][mpishard.nn.model_from_config] builds it).

        ``tp_comm`` and ``stage_layers`` are not recorded: a checkpoint holds the
        logical tensors of every stage, and the record describes that model, which
        one process rebuilds whole (it is then ``MLP(sizes, ...)``'s twin).
        """
        return {"class": "ParallelMLP", "args": {"sizes": list(self.sizes), **self._options,
                                                 "dtype": self.dtype.name, "seed": self.seed}}
