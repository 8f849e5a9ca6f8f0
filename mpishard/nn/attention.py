"""Causal multi-head self-attention, split by heads over a tensor-parallel group."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..comm import FlatComm
from ..kernels.attention import attention_fused_on, causal_attention, causal_attention_backward
from ..kernels.nn import causal_softmax, causal_softmax_backward
from .base import BatchContext, Layer, finish_gradient, store_gradient
from .embedding import sequence_shape
from .shards import TensorShard
from .tensor_parallel import load_logical, tensor_parallel_comm

__all__ = [
    "CausalSelfAttention",
]

_PROJECTIONS = (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))


class CausalSelfAttention(Layer):
    """``softmax(mask(q k^T / sqrt(d_head))) v`` over ``n_heads`` heads, then ``@ wo + bo``.

    Input and output ``(batch, tokens, d)``. ``q = x @ wq + bq`` (likewise ``k``,
    ``v``) with ``wq`` of logical shape ``(d, d)``; head ``h`` is features
    ``[h * d_head, (h + 1) * d_head)``. Position ``i`` attends to positions
    ``j <= i``; the softmax is shifted by its row maximum (masked entries are
    ``-inf`` before it, exactly 0 after).

    Tensor-parallel over ``tp_comm`` of ``p`` ranks, by heads: rank ``r`` holds
    heads ``[r * n_heads / p, (r + 1) * n_heads / p)``, i.e. the matching columns of
    ``wq``, ``wk``, ``wv`` and their biases (column-parallel) and rows of ``wo``
    (row-parallel); ``bo`` is held in full. One Allreduce in forward (the
    partial output of ``wo``, before ``bo`` is added) and one in backward (the
    sum of the input gradients of the three projections; started before their
    weight gradients are computed, waited for after).

    On CuPy arrays with the fused kernels on, the scores, softmax and weighted sum
    are one kernel pair ([`causal_attention`][mpishard.kernels.attention.causal_attention]),
    reading the projections token-major and never storing the ``(t, t)``
    probabilities; elsewhere (NumPy always) they are cuBLAS/NumPy products around
    `mpishard.kernels.nn.causal_softmax`.

    Initialisation (GPT-2): weights normal with deviation ``init_std``, ``wo``
    with ``out_std``, biases zero; drawn at the full logical shapes in the order
    ``wq, wk, wv, wo`` and sliced, so the values do not depend on ``p``.

    Raises:
        ValueError: ``d_model`` not divisible by ``n_heads``, or ``n_heads`` not
            divisible by ``p``. Decided from the arguments alone, without
            communication: [`GPT`][mpishard.nn.GPT] agrees on it over the group first.
    """

    def __init__(self, d_model: int, n_heads: int, tp_comm: FlatComm | None = None,
                 init_std: float = 0.02, out_std: float | None = None) -> None:
        self.tp_comm = tensor_parallel_comm(tp_comm)
        p = 1 if self.tp_comm is None else self.tp_comm.size
        if d_model < 1 or n_heads < 1:
            raise ValueError(f"expecting positive sizes, got d_model={d_model}, "
                             f"n_heads={n_heads}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % p:
            raise ValueError(f"n_heads={n_heads} is not divisible by the tensor-parallel size "
                             f"{p}: attention is split by heads")
        self.tp_size, self.tp_rank = p, 0 if self.tp_comm is None else self.tp_comm.rank
        self.d_model = int(d_model)
        self.n_heads = int(n_heads)
        self.head_dim = self.d_model // self.n_heads
        self.local_heads = self.n_heads // p
        self.local_width = self.local_heads * self.head_dim
        self.init_std = float(init_std)
        self.out_std = float(init_std if out_std is None else out_std)

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        d, w = self.d_model, self.local_width
        shapes: list[tuple[str, tuple[int, ...]]] = []
        for wname, bname in _PROJECTIONS:
            shapes += [(wname, (d, w)), (bname, (w,))]
        return shapes + [("wo", (w, d)), ("bo", (d,))]

    def local_shards(self) -> dict[str, TensorShard]:
        d, p, r = self.d_model, self.tp_size, self.tp_rank
        shards = {}
        for wname, bname in _PROJECTIONS:
            shards[wname] = TensorShard.split(wname, (d, d), 1, p, r)
            shards[bname] = TensorShard.split(bname, (d,), 0, p, r)
        shards["wo"] = TensorShard.split("wo", (d, d), 0, p, r)
        return shards

    def init_params(self, rng: np.random.Generator) -> None:
        d = self.d_model
        for wname, bname in _PROJECTIONS:
            load_logical(self, wname, rng.normal(0.0, self.init_std, size=(d, d)))
            self.params[bname].fill(0)
        load_logical(self, "wo", rng.normal(0.0, self.out_std, size=(d, d)))
        self.params["bo"].fill(0)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        sequence_shape(self, in_shape, self.d_model)
        return tuple(in_shape)

    def allocate_shape(self, in_shape: tuple[int, ...], train: bool,
                       need_dx: bool) -> dict[str, Any]:
        b, t = sequence_shape(self, in_shape, self.d_model)
        xp, dt = self.xp, self.dtype
        n, d, w = b * t, self.d_model, self.local_width
        if attention_fused_on(xp, dt, self.head_dim):
            return self._allocate_fused(b, t, train, need_dx)
        heads = (b, self.local_heads, t, self.head_dim)
        buf = {
            "y": xp.empty((b, t, d), dtype=dt),
            "q": xp.empty(heads, dtype=dt),                 # head-major copies
            "k": xp.empty(heads, dtype=dt),
            "v": xp.empty(heads, dtype=dt),
            "proj": xp.empty((n, w), dtype=dt),             # scratch, token-major
            "p": xp.empty((b, self.local_heads, t, t), dtype=dt),
            "rows": xp.empty((b, self.local_heads, t, 1), dtype=dt),
            "ctx": xp.empty((n, w), dtype=dt),
            "mask": xp.triu(xp.ones((t, t), dtype=bool), k=1),
        }
        if train:
            buf["dp"] = xp.empty((b, self.local_heads, t, t), dtype=dt)
            buf["dheads"] = xp.empty(heads, dtype=dt)
            for name in ("dq", "dk", "dv"):
                buf[name] = xp.empty((n, w), dtype=dt)
            if need_dx:
                buf["dx"] = xp.empty((b, t, d), dtype=dt)
                buf["tmp"] = xp.empty((n, d), dtype=dt)
        return buf

    def _allocate_fused(self, b: int, t: int, train: bool, need_dx: bool) -> dict[str, Any]:
        """The fused kernels' buffers: token-major projections, no ``(t, t)`` arrays;
        ``lse`` marks the layout (the forward's log-sum-exp by row)."""
        xp, dt = self.xp, self.dtype
        n, d, w = b * t, self.d_model, self.local_width
        buf = {"y": xp.empty((b, t, d), dtype=dt),
               "lse": xp.empty((b, self.local_heads, t), dtype=dt)}
        for name in ("q", "k", "v", "ctx"):
            buf[name] = xp.empty((n, w), dtype=dt)
        if train:
            buf["delta"] = xp.empty((b, self.local_heads, t), dtype=dt)
            for name in ("proj", "dq", "dk", "dv"):
                buf[name] = xp.empty((n, w), dtype=dt)
            if need_dx:
                buf["dx"] = xp.empty((b, t, d), dtype=dt)
                buf["tmp"] = xp.empty((n, d), dtype=dt)
        return buf

    def _heads(self, a: Any, b: int, t: int) -> Any:
        """A token-major ``(n, width)`` array as a ``(b, heads, t, d_head)`` view."""
        return a.reshape(b, t, self.local_heads, self.head_dim).transpose(0, 2, 1, 3)

    def _tokens(self, a: Any, b: int, t: int) -> Any:
        """A ``(n, width)`` buffer viewed as ``(b, heads, t, d_head)`` *memory order*."""
        return a.reshape(b, self.local_heads, t, self.head_dim)

    def _split(self, a: Any, b: int, t: int) -> Any:
        """A token-major ``(n, width)`` array as ``(b, t, heads, d_head)`` (a view)."""
        return a.reshape(b, t, self.local_heads, self.head_dim)

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        xp, prm = self.xp, self.params
        b, t, d = x.shape
        x2 = x.reshape(b * t, d)
        if "lse" in buf:
            self._attend_fused(x2, buf, b, t)
        else:
            self._attend(x2, buf, b, t)
        y = buf["y"]
        y2 = y.reshape(b * t, d)
        xp.matmul(buf["ctx"], prm["wo"], out=y2)
        if self.tp_size > 1:
            self.tp_comm.Allreduce(y2, slot="tp")       # Megatron's g
        y2 += prm["bo"]
        buf["x"] = x2
        return y

    def _attend(self, x2: Any, buf: dict[str, Any], b: int, t: int) -> None:
        """The heads' outputs into ``buf["ctx"]`` (token-major), keeping the
        probabilities for the backward."""
        xp, prm = self.xp, self.params
        proj, p, rows = buf["proj"], buf["p"], buf["rows"]
        for (wname, bname), dst in zip(_PROJECTIONS, ("q", "k", "v")):
            xp.matmul(x2, prm[wname], out=proj)
            proj += prm[bname]
            buf[dst][...] = self._heads(proj, b, t)
        # Scores, causal mask, softmax shifted by the row maximum (the diagonal
        # is never masked, so the maximum is finite).
        xp.matmul(buf["q"], buf["k"].transpose(0, 1, 3, 2), out=p)
        causal_softmax(p, 1.0 / math.sqrt(self.head_dim), buf["mask"], rows)
        # Heads' outputs (into the free scratch), back to token-major.
        out_heads = self._tokens(proj, b, t)
        xp.matmul(p, buf["v"], out=out_heads)
        self._heads(buf["ctx"], b, t)[...] = out_heads

    def _attend_fused(self, x2: Any, buf: dict[str, Any], b: int, t: int) -> None:
        """As `_attend`, by the fused kernel on the token-major projections."""
        xp, prm = self.xp, self.params
        for (wname, bname), dst in zip(_PROJECTIONS, ("q", "k", "v")):
            xp.matmul(x2, prm[wname], out=buf[dst])
            buf[dst] += prm[bname]
        q, k, v, out = (self._split(buf[name], b, t) for name in ("q", "k", "v", "ctx"))
        causal_attention(q, k, v, 1.0 / math.sqrt(self.head_dim), out, buf["lse"])

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: dict[str, Any],
                        scratch: dict[str, Any] | None) -> None:
        # Everything, the input gradient included (kept in buf["dx"] for
        # backward_input): its Allreduce is started before the projections'
        # weight gradients are computed.
        xp, prm = self.xp, self.params
        b, t, d = dy.shape
        dy2 = dy.reshape(b * t, d)
        self._linear_grads(buf["ctx"], dy2, grads, scratch, "wo", "bo")
        xp.matmul(dy2, prm["wo"].T, out=buf["proj"])    # d ctx, token-major
        if "lse" in buf:
            self._attend_backward_fused(buf, b, t)
        else:
            self._attend_backward(buf, b, t)
        pending = None
        if "dx" in buf:
            dx, tmp = buf["dx"].reshape(b * t, d), buf["tmp"]
            xp.matmul(buf["dq"], prm["wq"].T, out=dx)
            for wname, gname in (("wk", "dk"), ("wv", "dv")):
                xp.matmul(buf[gname], prm[wname].T, out=tmp)
                dx += tmp
            if self.tp_size > 1:
                pending = self.tp_comm.Iallreduce(dx, slot="tp")     # Megatron's f
        for (wname, bname), gname in zip(_PROJECTIONS, ("dq", "dk", "dv")):
            self._linear_grads(buf["x"], buf[gname], grads, scratch, wname, bname)
        if pending is not None:
            pending.wait()

    def _attend_backward(self, buf: dict[str, Any], b: int, t: int) -> None:
        """``buf["dq"]``, ``["dk"]``, ``["dv"]`` (token-major) from d ctx in
        ``buf["proj"]``; the probabilities ``buf["p"]`` are consumed."""
        xp = self.xp
        proj, p, dp, rows = buf["proj"], buf["p"], buf["dp"], buf["rows"]
        dheads = buf["dheads"]
        dheads[...] = self._heads(proj, b, t)           # d out, head-major
        scratch_heads = self._tokens(proj, b, t)
        # dv = p^T @ dout
        xp.matmul(p.transpose(0, 1, 3, 2), dheads, out=scratch_heads)
        self._heads(buf["dv"], b, t)[...] = scratch_heads
        # dp = dout @ v^T; softmax backward: ds = p * (dp - sum(dp * p)), scaled.
        xp.matmul(dheads, buf["v"].transpose(0, 1, 3, 2), out=dp)
        causal_softmax_backward(dp, p, 1.0 / math.sqrt(self.head_dim), rows)
        # dq = ds @ k, dk = ds^T @ q
        xp.matmul(dp, buf["k"], out=scratch_heads)
        self._heads(buf["dq"], b, t)[...] = scratch_heads
        xp.matmul(dp.transpose(0, 1, 3, 2), buf["q"], out=scratch_heads)
        self._heads(buf["dk"], b, t)[...] = scratch_heads

    def _attend_backward_fused(self, buf: dict[str, Any], b: int, t: int) -> None:
        """As `_attend_backward`, by the fused kernels (probabilities recomputed)."""
        q, k, v, out, dout, dq, dk, dv = (
            self._split(buf[name], b, t)
            for name in ("q", "k", "v", "ctx", "proj", "dq", "dk", "dv"))
        causal_attention_backward(dout, q, k, v, out, buf["lse"], 1.0 / math.sqrt(self.head_dim),
                                  dq, dk, dv, buf["delta"])

    def _linear_grads(self, x: Any, dy: Any, grads: dict[str, Any],
                      scratch: dict[str, Any] | None, wname: str, bname: str) -> None:
        xp = self.xp
        out = store_gradient(grads[wname], scratch, wname)
        xp.matmul(x.T, dy, out=out)
        finish_gradient(xp, grads[wname], out)
        out = store_gradient(grads[bname], scratch, bname)
        xp.sum(dy, axis=0, out=out)
        finish_gradient(xp, grads[bname], out)

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        return buf["dx"]

    def config(self) -> dict[str, Any]:
        """The logical layer: ``tp_comm`` is not recorded (a communicator is not
        data), so the layer rebuilt from it is the whole, unsplit one."""
        return {"class": "CausalSelfAttention", "args": {
            "d_model": self.d_model, "n_heads": self.n_heads, "init_std": self.init_std,
            "out_std": self.out_std}}

    def __repr__(self) -> str:
        return (f"CausalSelfAttention({self.d_model}, heads={self.n_heads}, "
                f"tp={self.tp_rank}/{self.tp_size})")
