"""Step time of mpishard on a GPU beside PyTorch eager on the same GPU.

Run under mpirun; prints one JSON line per measurement on rank 0::

    mpirun -n 1 python benchmarks/bench_gpu.py --torch     # 1 rank, and PyTorch
    mpirun -n 2 python benchmarks/bench_gpu.py             # 2 ranks sharing the GPU

The two models of issue 23, float32, Adam (lr 1e-3): the MLP 1024-4096-4096-1024-10
(ReLU, 25M parameters) at global batch 256, and the GPT (vocabulary 256, context
256, d 512, 8 heads, 6 blocks, 19.3M parameters) at global batch 16. mpishard
trains them with DDP and ZeRO-2 (``--strategies``: ZeRO-3 too), each with the
layers' fused CUDA kernels off (``reference``: the NumPy twins' chain of CuPy
calls) and on (``fused``: ``MPISHARD_GPU_KERNELS=1``, the fused attention
included; ``fused-noattn``: the other kernels on, attention by cuBLAS products
around the softmax kernel, ``MPISHARD_GPU_ATTENTION=0``); PyTorch eager (only
with ``--torch``, on a world of one rank) trains the same model with the same
math (``torch.optim.Adam``, foreach; the GPT's attention written out, and with
``scaled_dot_product_attention`` as ``torch-sdpa``). ``--graphs`` (one rank)
adds ``mpishard-graph``: the model's forward and backward replayed as a CUDA
graph (``mpishard.kernels.cuda_step.StepGraph``, fused kernels on) and Adam's
update after it, without a strategy; its line says whether the capture held
(``graph_reason`` otherwise). ``--tf32`` runs every variant with TF32 products
(mpishard's ``set_tf32``, PyTorch's ``allow_tf32``). The variants alternate,
``--rounds`` times, each timing ``--steps`` steps after ``--warmup``; a step ends
when its loss is on the host. Reported: the minimum and median step time in ms
over the rounds' means, and ``vs_torch``, mpishard's median over PyTorch eager's.

No GPU: one JSON line saying so, exit code 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MODELS = ("mlp", "gpt")
STRATEGIES = ("ddp", "zero2", "zero3")
KERNELS = ("reference", "fused", "fused-noattn")
MLP_SIZES = [1024, 4096, 4096, 1024, 10]
MLP_BATCH = 256
GPT = dict(vocab=256, seq=256, d=512, heads=8, layers=6)
GPT_BATCH = 16


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt")
    p.add_argument("--strategies", default="ddp,zero2",
                   help="comma-separated: " + ", ".join(STRATEGIES))
    p.add_argument("--kernels", default="reference,fused",
                   help="comma-separated: " + ", ".join(KERNELS))
    p.add_argument("--torch", action="store_true", help="PyTorch eager too (1 rank only)")
    p.add_argument("--graphs", action="store_true",
                   help="the model's step replayed as a CUDA graph too (1 rank only)")
    p.add_argument("--tf32", action="store_true", help="TF32 products in every variant")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    for name, allowed in (("models", MODELS), ("strategies", STRATEGIES),
                          ("kernels", KERNELS)):
        chosen = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in chosen if v not in allowed]
        if bad or not chosen:
            p.error(f"--{name}: expecting some of {', '.join(allowed)}, got "
                    f"{getattr(args, name)!r}")
        setattr(args, name, chosen)
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be positive, --warmup at least 0")
    return args


def no_gpu(reason: str) -> int:
    print(json.dumps({"bench": "gpu", "ok": False, "reason": f"no GPU: {reason}"}), flush=True)
    return 3


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return no_gpu("CuPy sees no CUDA device")
    except Exception as exc:   # ImportError, CUDARuntimeError
        return no_gpu(f"{type(exc).__name__}: {exc}".splitlines()[0])
    import numpy as np

    from mpishard import ShardingConfiguration
    from mpishard.comm import choose_gpu, from_comm

    world = from_comm(None, "world")
    _, gpu = choose_gpu(world)
    if args.torch and world.size != 1:
        args.torch = False   # PyTorch eager is one process: measured in the 1-rank run
    if args.graphs and world.size != 1:
        args.graphs = False  # the graph step has no strategy: one process
    tf32 = False
    if args.tf32:
        from mpishard.kernels.cuda_step import set_tf32

        tf32 = set_tf32(cp, True)
    reasons: dict[str, str | None] = {}
    rng = np.random.default_rng(0)
    data = {
        "mlp": (cp.asarray(rng.standard_normal((MLP_BATCH, MLP_SIZES[0]), dtype=np.float32)),
                cp.asarray(rng.integers(0, MLP_SIZES[-1], MLP_BATCH))),
        "gpt": (cp.asarray(rng.integers(0, GPT["vocab"], (GPT_BATCH, GPT["seq"]))),
                cp.asarray(rng.integers(0, GPT["vocab"], (GPT_BATCH, GPT["seq"])))),
    }
    for model in args.models:
        variants = [("torch", None, None)] if args.torch else []
        if args.torch and model == "gpt":
            variants.append(("torch-sdpa", None, None))
        variants += [("mpishard", s, k) for s in args.strategies for k in args.kernels]
        if args.graphs:
            variants.append(("mpishard-graph", None, "fused"))
        times: dict[tuple, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):   # alternate the variants, round after round
            for v in variants:
                if v[0].startswith("torch"):
                    ms = torch_step_ms(model, data[model], args, sdpa=v[0] == "torch-sdpa")
                elif v[0] == "mpishard-graph":
                    ms, reasons[model] = graph_step_ms(model, data[model], args)
                else:
                    ms = mpishard_step_ms(model, data[model], args, v[1], v[2], world,
                                          ShardingConfiguration)
                times[v].append(ms)
                release_memory(v[0])
        torch_median = (statistics.median(times[("torch", None, None)])
                        if ("torch", None, None) in times else None)
        for v, ms in times.items():
            record = {"bench": "gpu", "model": model, "impl": v[0], "strategy": v[1],
                      "kernels": v[2], "ranks": world.size if v[0] == "mpishard" else 1,
                      "dtype": "float32", "tf32": tf32, "device": gpu.name,
                      "global_batch": MLP_BATCH if model == "mlp" else GPT_BATCH,
                      "steps": args.steps, "rounds": args.rounds,
                      "step_ms_min": round(min(ms), 3), "step_ms_median":
                      round(statistics.median(ms), 3)}
            if torch_median and v[0].startswith("mpishard"):
                record["vs_torch"] = round(statistics.median(ms) / torch_median, 3)
            if v[0] == "mpishard-graph":
                record["graph_captured"] = reasons[model] is None
                record["graph_reason"] = reasons[model]
            if world.rank == 0:
                print(json.dumps(record), flush=True)
    return 0


def release_memory(impl: str) -> None:
    """Give the last variant's device memory back before the next one builds."""
    import gc

    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    if impl.startswith("torch"):
        import torch

        torch.cuda.empty_cache()


def mpishard_step_ms(model_name, data, args, strategy, kernels, world, Config) -> float:
    """Mean ms of a step of mpishard (the slowest rank's)."""
    import cupy as cp
    import numpy as np

    from mpishard.optim import Adam
    from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer

    os.environ["MPISHARD_GPU_KERNELS"] = "0" if kernels == "reference" else "1"
    os.environ["MPISHARD_GPU_ATTENTION"] = "0" if kernels == "fused-noattn" else "1"
    config = Config(world.comm)
    model = build_model(model_name, cp, np)
    cls = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer, "zero3": ZeRO3Optimizer}[strategy]
    opt = cls(Adam(lr=1e-3), config, model=model)
    x, y = data
    rows = len(x)
    lo, hi = rows * config.groups.dp.rank // config.groups.dp.size, \
        rows * (config.groups.dp.rank + 1) // config.groups.dp.size
    xs, ys = x[lo:hi], y[lo:hi]

    def step() -> None:
        opt.backward(xs, ys, batch_start=lo, global_rows=rows)
        opt.step()   # the loss reaches the host: the step is done

    for _ in range(args.warmup):
        step()
    world.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - t0) / args.steps
    seconds = world.allreduce(seconds, op="max")
    config.free()
    return seconds * 1e3


def build_model(model_name, cp, np):
    """The benchmark's MLP or GPT on the GPU, float32, seed 1."""
    from mpishard.nn import GPT as GPTModel
    from mpishard.nn import MLP

    if model_name == "mlp":
        return MLP(MLP_SIZES, activation="relu", dtype=np.float32, xp=cp, seed=1)
    return GPTModel(GPT["vocab"], GPT["seq"], GPT["d"], GPT["heads"], GPT["layers"],
                    dtype=np.float32, xp=cp, seed=1)


def graph_step_ms(model_name, data, args) -> tuple[float, str | None]:
    """Mean ms of a step whose forward and backward replay as a CUDA graph (fused
    kernels on), then Adam's update; the step ends when its loss is on the host.
    Also the reason the capture failed (None when it held)."""
    import cupy as cp
    import numpy as np

    from mpishard.kernels.cuda_step import StepGraph
    from mpishard.optim import Adam

    os.environ["MPISHARD_GPU_KERNELS"] = os.environ["MPISHARD_GPU_ATTENTION"] = "1"
    model = build_model(model_name, cp, np)
    x, y = data
    adam = Adam(lr=1e-3)
    state = adam.init_state(model.params.size, np.float32, cp)
    loss = [None]

    def forward_backward() -> None:
        model.forward_stage(x, 0)
        loss[0] = model._loss(y, 0)     # a device value: no host read in the graph
        model.backward_stage(None, 0)

    graph = StepGraph(forward_backward, cp, warmup=2)
    count = [0]

    def step() -> None:
        count[0] += 1
        graph()
        adam.update(model.params, model.grads, state, count[0], 1e-3)
        float(loss[0])

    for _ in range(args.warmup + 1):    # at least one call past the capture
        step()
    cp.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    return (time.perf_counter() - t0) / args.steps * 1e3, graph.reason


def torch_step_ms(model_name, data, args, sdpa: bool = False) -> float:
    """Mean ms of a step of PyTorch eager on the same GPU, same model and math."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.as_tensor(data[0], device=dev)
    y = torch.as_tensor(data[1], device=dev)
    torch.manual_seed(0)
    if model_name == "mlp":
        layers = []
        for a, b in zip(MLP_SIZES[:-2], MLP_SIZES[1:-1]):
            layers += [tnn.Linear(a, b), tnn.ReLU()]
        net = tnn.Sequential(*layers, tnn.Linear(MLP_SIZES[-2], MLP_SIZES[-1])).to(dev)

        def loss_fn():
            return F.cross_entropy(net(x), y)
    else:
        net = _TorchGPT(sdpa).to(dev)

        def loss_fn():
            logits = net(x)
            return F.cross_entropy(logits.reshape(-1, GPT["vocab"]), y.reshape(-1))
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn()
        loss.backward()
        opt.step()
        loss.item()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / args.steps * 1e3


def _TorchGPT(sdpa: bool):
    """mpishard's GPT in PyTorch: pre-LN blocks, tanh GELU, untied head without bias."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    d, h, t = GPT["d"], GPT["heads"], GPT["seq"]

    class Block(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
            self.qkv, self.proj = tnn.Linear(d, 3 * d), tnn.Linear(d, d)
            self.fc1, self.fc2 = tnn.Linear(d, 4 * d), tnn.Linear(4 * d, d)
            self.register_buffer("mask", torch.triu(torch.ones(t, t, dtype=torch.bool), 1))

        def forward(self, x):
            b = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (a.view(b, t, h, d // h).transpose(1, 2) for a in (q, k, v))
            if sdpa:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-2, -1)) / (d // h) ** 0.5
                a = torch.softmax(s.masked_fill(self.mask, float("-inf")), dim=-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Model(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = tnn.Embedding(GPT["vocab"], d), tnn.Embedding(t, d)
            self.blocks = tnn.ModuleList(Block() for _ in range(GPT["layers"]))
            self.ln_f = tnn.LayerNorm(d)
            self.head = tnn.Linear(d, GPT["vocab"], bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return Model()


if __name__ == "__main__":
    sys.exit(main())
