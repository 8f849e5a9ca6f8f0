"""The fused causal attention on a GPU: its time beside the unfused path and PyTorch's,
and its error against the NumPy twin.

    python benchmarks/bench_gpu_attention.py                 # one process, no MPI

Shapes ``(batch, tokens, heads, head_dim)``: the GPT of ``bench_gpu.py`` (16, 256,
8, 64) and a longer context (4, 1024, 8, 64), float32, and the first in float64.
Implementations, each timed forward alone and forward plus backward (CUDA
events; the median over ``--rounds`` of the mean of ``--steps`` calls):

* ``fused``: ``causal_attention`` and its backward (mpishard.kernels.attention);
* ``unfused``: what the layer runs with ``MPISHARD_GPU_ATTENTION=0``: head-major
  copies, batched cuBLAS products around the causal softmax kernel and its
  backward (mpishard.kernels.nn), the ``(t, t)`` probabilities stored;
* ``torch-sdpa``: ``torch.nn.functional.scaled_dot_product_attention(...,
  is_causal=True)`` and its backward, on head-major tensors (with ``--torch``
  only, and only where PyTorch imports).

One JSON line per shape, dtype and implementation; ``fused``'s carries
``max_rel_error`` (out, dq, dk, dv against the twin run on the same device
arrays, relative to each array's largest value) and its time over the others'.
No GPU: one JSON line saying so, exit code 3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

SHAPES = [((16, 256, 8, 64), "float32"), ((16, 256, 8, 64), "float64"),
          ((4, 1024, 8, 64), "float32")]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch", action="store_true", help="PyTorch's SDPA too")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if min(args.steps, args.rounds) < 1:
        p.error("--steps and --rounds must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("CuPy sees no CUDA device")
    except Exception as exc:   # ImportError, CUDARuntimeError
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(json.dumps({"bench": "gpu_attention", "ok": False, "reason": f"no GPU: {reason}"}))
        return 3
    os.environ["MPISHARD_GPU_KERNELS"] = "1"
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    device = name.decode() if isinstance(name, bytes) else name
    for shape, dtype in SHAPES:
        records = measure(cp, shape, dtype, args)
        base = {r["impl"]: r for r in records}
        for r in records:
            if r["impl"] == "fused":
                for other in ("unfused", "torch-sdpa"):
                    if other in base:
                        r[f"vs_{other}"] = round(r["fwd_bwd_ms"] / base[other]["fwd_bwd_ms"], 3)
            print(json.dumps({"bench": "gpu_attention", "device": device, **r}), flush=True)
    return 0


def measure(cp, shape, dtype, args) -> list[dict]:
    import numpy as np

    from mpishard.kernels import attention as att

    rng = np.random.default_rng(0)
    q, k, v, dout = (cp.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(4))
    scale = 1.0 / math.sqrt(shape[3])
    fused = Fused(cp, att, q, k, v, dout, scale)
    records = [{"impl": "fused", "shape": list(shape), "dtype": dtype,
                "fused_kernels": att.attention_fused_on(cp, dtype, shape[3])}]
    impls = [fused, Unfused(cp, q, k, v, dout, scale)]
    records.append({"impl": "unfused", "shape": list(shape), "dtype": dtype})
    if args.torch and torch_here():
        impls.append(TorchSDPA(shape, dtype))
        records.append({"impl": "torch-sdpa", "shape": list(shape), "dtype": dtype})
    times: list[dict[str, list[float]]] = [{"fwd": [], "fwd_bwd": []} for _ in impls]
    for _ in range(args.rounds):       # alternate the implementations, round by round
        for impl, t in zip(impls, times):
            t["fwd"].append(impl.time(impl.forward, args.steps))
            t["fwd_bwd"].append(impl.time(impl.forward_backward, args.steps))
    for record, t in zip(records, times):
        record["fwd_ms"] = round(statistics.median(t["fwd"]), 4)
        record["fwd_bwd_ms"] = round(statistics.median(t["fwd_bwd"]), 4)
    records[0]["max_rel_error"] = fused.error_against_twin()
    return records


def torch_here() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class Timed:
    def time(self, fn, steps: int) -> float:
        """Mean ms of ``fn`` over ``steps`` calls after one, by CUDA events."""
        import cupy as cp

        fn()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / steps


class Fused(Timed):
    def __init__(self, cp, att, q, k, v, dout, scale):
        self.cp, self.att, self.args, self.scale = cp, att, (q, k, v, dout), scale
        b, t, h, _ = q.shape
        self.out, self.dq, self.dk, self.dv = (cp.empty_like(q) for _ in range(4))
        self.lse, self.delta = (cp.empty((b, h, t), q.dtype) for _ in range(2))

    def forward(self):
        q, k, v, _ = self.args
        self.att.causal_attention(q, k, v, self.scale, self.out, self.lse)

    def forward_backward(self):
        q, k, v, dout = self.args
        self.forward()
        self.att.causal_attention_backward(dout, q, k, v, self.out, self.lse, self.scale,
                                           self.dq, self.dk, self.dv, self.delta)

    def error_against_twin(self) -> float:
        """Largest error of out, dq, dk, dv against the twin, relative to the array's
        largest value."""
        self.forward_backward()
        got = [a.copy() for a in (self.out, self.dq, self.dk, self.dv)]
        os.environ["MPISHARD_GPU_ATTENTION"] = "0"
        try:
            self.forward_backward()
        finally:
            os.environ["MPISHARD_GPU_ATTENTION"] = "1"
        want = (self.out, self.dq, self.dk, self.dv)
        return float(max(float(self.cp.abs(g - w).max() / self.cp.abs(w).max())
                         for g, w in zip(got, want)))


class Unfused(Timed):
    """The layer's path without the fused attention (mpishard/nn/attention.py)."""

    def __init__(self, cp, q, k, v, dout, scale):
        from mpishard.kernels import nn as kn

        self.cp, self.kn, self.args, self.scale = cp, kn, (q, k, v, dout), scale
        b, t, h, hd = q.shape
        heads, scores = (b, h, t, hd), (b, h, t, t)
        self.qh, self.kh, self.vh, self.oh, self.dh = (cp.empty(heads, q.dtype) for _ in range(5))
        self.p, self.dp = cp.empty(scores, q.dtype), cp.empty(scores, q.dtype)
        self.rows = cp.empty((b, h, t, 1), q.dtype)
        self.mask = cp.triu(cp.ones((t, t), dtype=bool), 1)
        self.out, self.dq, self.dk, self.dv = (cp.empty_like(q) for _ in range(4))

    def forward(self):
        cp, (q, k, v, _) = self.cp, self.args
        for dst, src in ((self.qh, q), (self.kh, k), (self.vh, v)):
            dst[...] = src.transpose(0, 2, 1, 3)
        cp.matmul(self.qh, self.kh.transpose(0, 1, 3, 2), out=self.p)
        self.kn.causal_softmax(self.p, self.scale, self.mask, self.rows)
        cp.matmul(self.p, self.vh, out=self.oh)
        self.out[...] = self.oh.transpose(0, 2, 1, 3)

    def forward_backward(self):
        cp, dout = self.cp, self.args[3]
        self.forward()
        self.dh[...] = dout.transpose(0, 2, 1, 3)
        cp.matmul(self.p.transpose(0, 1, 3, 2), self.dh, out=self.oh)
        self.dv[...] = self.oh.transpose(0, 2, 1, 3)
        cp.matmul(self.dh, self.vh.transpose(0, 1, 3, 2), out=self.dp)
        self.kn.causal_softmax_backward(self.dp, self.p, self.scale, self.rows)
        cp.matmul(self.dp, self.kh, out=self.oh)
        self.dq[...] = self.oh.transpose(0, 2, 1, 3)
        cp.matmul(self.dp.transpose(0, 1, 3, 2), self.qh, out=self.oh)
        self.dk[...] = self.oh.transpose(0, 2, 1, 3)


class TorchSDPA:
    def __init__(self, shape, dtype):
        import torch

        b, t, h, hd = shape
        self.torch = torch
        kw = dict(device="cuda", dtype=getattr(torch, dtype))
        self.q, self.k, self.v = (torch.randn(b, h, t, hd, requires_grad=True, **kw)
                                  for _ in range(3))
        self.dout = torch.randn(b, h, t, hd, **kw)

    def forward(self):
        with self.torch.no_grad():
            self.torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v,
                                                                  is_causal=True)

    def forward_backward(self):
        out = self.torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v,
                                                                    is_causal=True)
        out.backward(self.dout)

    def time(self, fn, steps: int) -> float:
        torch = self.torch
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps


if __name__ == "__main__":
    sys.exit(main())
