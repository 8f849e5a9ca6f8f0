"""A GPT-style decoder on the flat vector, tensor-parallel and cut into pipeline stages."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..flat import ParameterShard
from .activations import GELU, pair_bias_activations
from .attention import CausalSelfAttention
from .base import BatchContext, Layer
from .embedding import Embedding, LMHead, sequence_shape
from .handover import HandOver, handover_groups
from .layers import LayerNorm
from .losses import SoftmaxCrossEntropy
from .model_methods import Described
from .shards import TensorShard, split_range
from .stack import LayerStack
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    check_tensor_parallel,
    tensor_parallel_comm,
)

__all__ = [
    "GPT",
    "TransformerBlock",
]


class TransformerBlock(Layer):
    """Pre-LN decoder block: ``h = x + attn(ln1(x))``, ``y = h + mlp(ln2(h))``.

    The MLP is ``fc1`` ``(d, 4d)``, GELU (tanh approximation), ``fc2`` ``(4d, d)``.
    Input and output ``(batch, tokens, d)``. Tensors, by local name:
    ``ln1.weight``, ``ln1.bias``, ``attn.wq``, ``attn.bq``, ``attn.wk``, ``attn.bk``,
    ``attn.wv``, ``attn.bv``, ``attn.wo``, ``attn.bo``, ``ln2.weight``, ``ln2.bias``,
    ``mlp.fc1.weight``, ``mlp.fc1.bias``, ``mlp.fc2.weight``, ``mlp.fc2.bias``.

    Tensor-parallel over ``tp_comm``: the attention split by heads
    ([`CausalSelfAttention`][mpishard.nn.CausalSelfAttention]), ``fc1`` column-parallel and ``fc2``
    row-parallel; the LayerNorms and the biases added after a reduction are held
    in full. Two Allreduces in forward and two in backward, of ``(batch *
    tokens, d)`` elements each.

    As a top-level layer it writes all its gradients in ``backward_params`` (the
    sub-layers' order needs the input gradient of the MLP branch for the
    attention branch) and leaves the input gradient for ``backward_input``.
    """

    def __init__(self, d_model: int, n_heads: int, tp_comm: Any = None,
                 init_std: float = 0.02, out_std: float | None = None,
                 eps: float = 1e-5) -> None:
        tp_comm = tensor_parallel_comm(tp_comm)
        p = 1 if tp_comm is None else tp_comm.size
        self.d_model = int(d_model)
        self.tp_size = p
        self.ln1 = LayerNorm(d_model, eps=eps)
        self.attn = CausalSelfAttention(d_model, n_heads, tp_comm, init_std, out_std)
        self.ln2 = LayerNorm(d_model, eps=eps)
        self.fc1 = ColumnParallelLinear(d_model, 4 * d_model, tp_comm, init_std=init_std)
        self.gelu = GELU()
        self.fc2 = RowParallelLinear(4 * d_model, d_model, tp_comm,
                                     init_std=init_std if out_std is None else out_std)
        pair_bias_activations([self.fc1, self.gelu])   # gelu(x @ W + b): one pass
        self._subs: list[tuple[str, Layer]] = [
            ("ln1", self.ln1), ("attn", self.attn), ("ln2", self.ln2),
            ("mlp.fc1", self.fc1), ("mlp.gelu", self.gelu), ("mlp.fc2", self.fc2)]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{prefix}.{name}", shape) for prefix, sub in self._subs
                for name, shape in sub.param_shapes()]

    def local_shards(self) -> dict[str, TensorShard]:
        return {f"{prefix}.{name}": shard.renamed(f"{prefix}.{name}")
                for prefix, sub in self._subs for name, shard in sub.local_shards().items()}

    def build(self, index: int, xp: Any, dtype: Any, params: dict[str, Any]) -> None:
        super().build(index, xp, dtype, params)
        for prefix, sub in self._subs:
            sub.build(index, xp, dtype, _sub(params, prefix, sub))

    def init_params(self, rng: np.random.Generator) -> None:
        # One stream for the block, drawn in a fixed order at the logical shapes.
        for _, sub in self._subs:
            sub.init_params(rng)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        sequence_shape(self, in_shape, self.d_model)
        return tuple(in_shape)

    def allocate_shape(self, in_shape: tuple[int, ...], train: bool,
                       need_dx: bool) -> dict[str, Any]:
        b, t = sequence_shape(self, in_shape, self.d_model)
        n, d, xp = b * t, self.d_model, self.xp
        hidden = self.fc1.local_out
        buf = {
            "ln1": self.ln1.allocate(n, d, train, True),
            "attn": self.attn.allocate_shape((b, t, d), train, True),
            "ln2": self.ln2.allocate(n, d, train, True),
            "fc1": self.fc1.allocate(n, d, train, True),
            "gelu": self.gelu.allocate(n, hidden, train, True),
            "fc2": self.fc2.allocate(n, hidden, train, True),
            "h": xp.empty((n, d), dtype=self.dtype),
            "y": xp.empty((b, t, d), dtype=self.dtype),
        }
        if train:
            buf["branch"] = xp.empty((n, d), dtype=self.dtype)
        buf["need_dx"] = need_dx
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        xp = self.xp
        b, t, d = x.shape
        x2 = x.reshape(b * t, d)
        a = self.ln1.forward(x2, buf["ln1"], ctx)
        att = self.attn.forward(a.reshape(b, t, d), buf["attn"], ctx)
        h = buf["h"]
        xp.add(x2, att.reshape(b * t, d), out=h)
        m = self.ln2.forward(h, buf["ln2"], ctx)
        m = self.fc1.forward(m, buf["fc1"], ctx)
        m = self.gelu.forward(m, buf["gelu"], ctx)
        m = self.fc2.forward(m, buf["fc2"], ctx)
        y = buf["y"]
        xp.add(h, m, out=y.reshape(b * t, d))
        return y

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: dict[str, Any],
                        scratch: dict[str, Any] | None) -> None:
        b, t, d = dy.shape
        g = dy.reshape(b * t, d)          # d loss / d y: the residual stream
        branch = buf["branch"]
        # MLP branch, from a copy (the sub-layers overwrite their dy).
        branch[...] = g
        m = branch
        for key, prefix, layer in (("fc2", "mlp.fc2", self.fc2), ("gelu", "mlp.gelu", self.gelu),
                                   ("fc1", "mlp.fc1", self.fc1), ("ln2", "ln2", self.ln2)):
            m = self._backward_sub(layer, prefix, m, buf[key], grads, scratch)
        g += m                            # d loss / d h
        # Attention branch.
        branch[...] = g
        a = self._backward_sub(self.attn, "attn", branch.reshape(b, t, d), buf["attn"],
                               grads, scratch)
        a = a.reshape(b * t, d)
        self._params_sub(self.ln1, "ln1", a, buf["ln1"], grads, scratch)
        if buf["need_dx"]:
            g += self.ln1.backward_input(a, buf["ln1"])
        buf["dx"] = dy                    # g is a view of dy: the gradient is in place

    def handover_groups(self) -> list[tuple[tuple[str, ...], bool]]:
        """Handed over sub-layer by sub-layer, as the backward goes (``fc2``,
        ``fc1``, ``ln2``, ``attn``, ``ln1``), each as it hands over
        ([`mpishard.nn.handover`][mpishard.nn.handover])."""
        groups = []
        for prefix, sub in reversed(self._subs):
            names = [name for name, _ in sub.param_shapes()]
            if names:
                groups += [(tuple(f"{prefix}.{n}" for n in group), rows)
                           for group, rows in handover_groups(sub, names)]
        return groups

    def _backward_sub(self, layer: Layer, prefix: str, dy: Any, buf: dict[str, Any],
                      grads: Any, scratch: dict[str, Any] | None) -> Any:
        self._params_sub(layer, prefix, dy, buf, grads, scratch)
        return layer.backward_input(dy, buf)

    @staticmethod
    def _params_sub(layer: Layer, prefix: str, dy: Any, buf: dict[str, Any], grads: Any,
                    scratch: dict[str, Any] | None) -> None:
        """Sub-layer ``prefix``'s parameter gradients: into its views, or through
        its part of the hand-over."""
        if isinstance(grads, HandOver):
            if layer.param_shapes():
                grads.sub(prefix).backward(layer, dy, buf)
            return
        layer.backward_params(dy, buf, _sub(grads, prefix, layer),
                              None if scratch is None else _sub(scratch, prefix, layer))

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        return buf.pop("dx")

    def config(self) -> dict[str, Any]:
        """The logical block: ``tp_comm`` is not recorded (a communicator is not
        data), so the block rebuilt from it is the whole, unsplit one."""
        return {"class": "TransformerBlock", "args": {
            "d_model": self.d_model, "n_heads": self.attn.n_heads,
            "init_std": self.attn.init_std, "out_std": self.attn.out_std,
            "eps": self.ln1.eps}}

    def __repr__(self) -> str:
        return f"TransformerBlock({self.d_model}, {self.attn!r})"


def _sub(d: dict[str, Any], prefix: str, layer: Layer) -> dict[str, Any]:
    """Layer ``layer``'s entries ``"<prefix>.<name>"`` of ``d``, by ``name``."""
    return {name: d[f"{prefix}.{name}"] for name, _ in layer.param_shapes()}


class GPT(Described, LayerStack):
    """A GPT-style decoder-only language model on one flat parameter vector.

    Top-level layers (and tensor names):

    * ``0``: [`Embedding`][mpishard.nn.Embedding], ``0.wte`` ``(V, d)`` and
      ``0.wpe`` ``(seq_len, d)``;
    * ``1 .. n_layers``: [`TransformerBlock`][mpishard.nn.TransformerBlock], ``3.ln1.weight``,
      ``3.attn.wq``, ``3.mlp.fc1.weight``, ...;
    * ``n_layers + 1``: [`LMHead`][mpishard.nn.LMHead],
      ``ln_f.weight``, ``ln_f.bias`` and the untied ``head.weight`` ``(d, V)``, no bias.

    Input: integer token ids ``(batch, tokens)``, ``tokens <= seq_len``; targets:
    integer ids of the same shape. The loss is the cross-entropy averaged over
    all ``batch * tokens`` positions; ``forward(x)`` returns the logits
    ``(batch, tokens, V)``.

    Initialisation (GPT-2): normal weights of deviation 0.02, the residual
    projections ``attn.wo`` and ``mlp.fc2.weight`` ``0.02 / sqrt(2 n_layers)``,
    biases zero, LayerNorms one and zero. Layer ``i`` draws from
    ``numpy.random.default_rng([seed, i])`` at the full logical shapes, so a
    tensor-parallel rank holds exactly its slice of the serial model's tensor
    and a pipeline stage exactly the serial model's layers.

    ``tp_comm`` (a [`FlatComm`][mpishard.comm.FlatComm] or mpi4py communicator of the
    tensor-parallel group, e.g. ``ShardingConfiguration(...).groups.tp``): Megatron
    tensor parallelism. Attention split by heads, MLP column- then
    row-parallel, the head and the loss vocabulary-parallel
    ([`VocabParallelCrossEntropy`][mpishard.nn.VocabParallelCrossEntropy]; ``V`` need not be
    divisible). Per step: two Allreduces of ``(batch * tokens, d)`` per block
    forward and two backward, one for the head's backward, one Allgatherv of
    ``p * (batch * tokens + 1)`` numbers in the loss. ``forward(x)`` gathers the
    full logits (an Allgatherv). Building is collective over the group.

    ``stage_layers=(start, stop)``: only those top-level layers, for a pipeline
    stage (see [`LayerStack`][mpishard.nn.LayerStack] for the stage
    API); the model has ``GPT.num_layers_of(n_layers) = n_layers + 2`` top-level
    layers. ``shard``: build only that ZeRO-3 shard of the parameters (see
    [`LayerStack`][mpishard.nn.LayerStack]).

    Raises:
        ValueError: a size that is not positive; ``d_model`` not divisible by
            ``n_heads``; ``n_heads`` not divisible by the tensor-parallel size;
            ``vocab_size`` smaller than it; a bad ``stage_layers``.
        TypeError: ``dtype`` is not float32 or float64.
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_heads: int,
                 n_layers: int, dtype: Any = np.float64, xp: Any = np, seed: int = 0, *,
                 tp_comm: Any = None, stage_layers: tuple[int, int] | None = None,
                 shard: ParameterShard | None = None) -> None:
        self.tp_comm = tensor_parallel_comm(tp_comm)
        p = 1 if self.tp_comm is None else self.tp_comm.size
        problem = None
        sizes = dict(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model,
                     n_heads=n_heads)
        bad = [f"{k}={v}" for k, v in sizes.items() if v < 1]
        if bad or n_layers < 0:
            problem = f"expecting positive sizes, got {', '.join(bad or [f'n_layers={n_layers}'])}"
        elif d_model % n_heads:
            problem = f"d_model={d_model} is not divisible by n_heads={n_heads}"
        elif n_heads % p:
            problem = (f"n_heads={n_heads} is not divisible by the tensor-parallel size {p} "
                       f"(attention is split by heads; d_model={d_model} and "
                       f"4*d_model={4 * d_model} must be too)")
        elif vocab_size < p:
            problem = f"vocab_size={vocab_size} is smaller than the tensor-parallel size {p}"
        check_tensor_parallel(self.tp_comm, problem)

        self.vocab_size, self.seq_len = int(vocab_size), int(seq_len)
        self.d_model, self.n_heads, self.n_layers = int(d_model), int(n_heads), int(n_layers)
        out_std = 0.02 / math.sqrt(2 * n_layers) if n_layers else 0.02
        layers: list[Layer] = [Embedding(vocab_size, seq_len, d_model)]
        layers += [TransformerBlock(d_model, n_heads, self.tp_comm, 0.02, out_std)
                   for _ in range(n_layers)]
        layers.append(LMHead(d_model, vocab_size, self.tp_comm))
        loss = (SoftmaxCrossEntropy() if p == 1
                else VocabParallelCrossEntropy(vocab_size, self.tp_comm))
        super().__init__(layers, loss, dtype=dtype, xp=xp, seed=seed, stage_layers=stage_layers,
                         shard=shard)

    def config(self) -> dict[str, Any]:
        """The whole model as JSON ([`model_from_config`][mpishard.nn.model_from_config] builds it).

        ``tp_comm`` and ``stage_layers`` are not recorded: a checkpoint holds the
        logical tensors of every stage, and the record describes that model, which
        one process rebuilds whole.
        """
        return {"class": "GPT", "args": {
            "vocab_size": self.vocab_size, "seq_len": self.seq_len, "d_model": self.d_model,
            "n_heads": self.n_heads, "n_layers": self.n_layers, "dtype": self.dtype.name,
            "seed": self.seed}}

    @staticmethod
    def num_layers_of(n_layers: int) -> int:
        """Top-level layers of a GPT with ``n_layers`` blocks: embedding, blocks, head."""
        return n_layers + 2

    def forward(self, x: Any) -> Any:
        """The stage's output for ``x``; on the last stage the full logits ``(batch, tokens, V)``.

        With tensor parallelism the logits are gathered over the group:
        collective over ``tp_comm`` then.
        """
        out = super().forward(x)
        if not self.is_last_stage or self.tp_comm is None or self.tp_comm.size == 1:
            return out
        p, b, t = self.tp_comm.size, out.shape[0], out.shape[1]
        pieces = [split_range(self.vocab_size, p, r) for r in range(p)]
        counts = [b * t * len(piece) for piece in pieces]
        flat = self.xp.empty(sum(counts), dtype=self.dtype)
        start = sum(counts[:self.tp_comm.rank])
        flat[start:start + out.size] = out.reshape(-1)
        self.tp_comm.Allgatherv(flat, counts, slot="gather-logits")
        full = self.xp.empty((b, t, self.vocab_size), dtype=self.dtype)
        start = 0
        for piece, count in zip(pieces, counts):
            part = flat[start:start + count].reshape(b, t, len(piece))
            full[:, :, piece.start:piece.stop] = part
            start += count
        return full
