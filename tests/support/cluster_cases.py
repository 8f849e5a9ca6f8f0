"""Jobs of ``tests/cluster/test_cluster.py``: ``python tests/support/cluster_cases.py CASE [ARGS]``
(or ``CASE+CASE+...``: several cases in one job).

Each case runs on every rank of a job that spans the nodes of the namespace
cluster (``scripts/cluster-local.sh``), computes its serial reference in the
same process, compares, and prints ``CASE ok on HOST rank R: DETAIL;;``. A
mismatch is an exception: the rank exits non-zero and the test fails with the
output. Small models and few steps: the point is the nodes, not the model.
"""

from __future__ import annotations

import mpishard  # noqa: F401  (first: each rank limits its BLAS threads before NumPy loads)

# isort: split
import functools
import json
import socket
import sys
import warnings

import numpy as np
from mpi4py import MPI
from reference import sampler_batches, train_serial
from strategies import NAMES, build, whole

from mpishard import ShardingConfiguration, TopologyError
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.cli import main
from mpishard.nn import GPT, MLP
from mpishard.optim import AdamW
from mpishard.strategies import (
    DDPOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
    ZeRO2Optimizer,
)

WORLD = MPI.COMM_WORLD
SIZES = [5, 7, 7, 3]          # 122 parameters: no shard boundary meets a tensor's
BATCH, EPOCHS = 16, 2         # 96 samples: 6 steps an epoch
VOCAB, SEQ, D, HEADS, BLOCKS = 13, 6, 8, 2, 2


def mlp_data(n=96, features=5, classes=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features))
    y = np.argmax(x @ rng.standard_normal((features, classes)), axis=1)
    return x, y


def token_data(n=48):
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, (n, SEQ))
    return x, np.roll(x, -1, axis=1)


def make_mlp():
    return MLP(SIZES, activation="tanh", dtype=np.float64, seed=7)


def make_opt():
    return AdamW(lr=1e-2, weight_decay=0.01)


def serial(model, data, batch, epochs, steps=None):
    """One process, the whole global batch, the optimizer called directly (``reference``)."""
    x, y = data
    batches = (sampler_batches(x, y, batch, epochs) if steps is None
               else sampler_batches(x, y, batch, steps=steps))
    run = train_serial(model, make_opt(), batches)
    return run.model, run.losses


def close(actual, expected, what, rtol=1e-10):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * 1e-2, err_msg=what)


def hosts_of(group) -> list[str]:
    """The host of every rank of ``group`` (a FlatComm), in its rank order."""
    return group.allgather(socket.gethostname())


#: The name of the case running (the name the job was given it by).
_RUNNING: list[str] = []


def report(case: str, detail: str) -> None:
    """``CASE ok on HOST rank R: DETAIL`` (CASE: the name the job was given it by)."""
    case = _RUNNING[0] if _RUNNING else case
    # Open MPI forwards each rank's output in pieces that can meet another rank's on
    # one line: the ";;" ends a report wherever its newline lands.
    print(f"\n{case} ok on {socket.gethostname()} rank {WORLD.rank}: {detail};;", flush=True)


# --------------------------------------------------------------------------- cases

def case_nodemap() -> None:
    """The node map of the world (printed as JSON for the test to compare), a
    tensor group across nodes refused and, when allowed, warned about, and
    ``mpishard info``."""
    config = ShardingConfiguration(WORLD)
    nodes = config.groups.nodes
    expected = sorted(set(hosts_of(config.world)))
    assert sorted(nodes.hosts) == expected, (nodes.hosts, expected)
    try:
        ShardingConfiguration(WORLD, tensor_parallel_size=4)
    except TopologyError as exc:
        refused = str(exc)
    else:
        raise AssertionError("tp=4 over nodes of 2 ranks was not refused")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        allowed = ShardingConfiguration(WORLD, tensor_parallel_size=4,
                                        allow_tensor_across_nodes=True)
    assert allowed.groups.tp.size == 4
    warned = [str(w.message) for w in caught if "cross nodes" in str(w.message)]
    assert len(warned) == 1, [str(w.message) for w in caught]
    main(["info"])
    report("nodemap", json.dumps({**nodes.as_dict(), "refused": refused, "warned": warned[0]}))


def case_data_parallel(strategy: str, *options: str) -> None:
    """A strategy of the registry with its data group over both nodes (ZeRO-3: every
    parameter gather crosses the link; ``no-prefetch``: without prefetch)."""
    data = mlp_data()
    ref, ref_losses = serial(make_mlp(), data, BATCH, EPOCHS)
    config = ShardingConfiguration(WORLD)
    model = make_mlp()
    extra = {"prefetch": False} if "no-prefetch" in options else {}
    dist = build(strategy, make_opt(), config, bucket_mb=1e-4, **extra)
    result = dist.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    params = whole(dist)
    close(params, ref.params, "parameters")
    close(np.array(result.losses), ref_losses, "losses")
    dist.verify_in_sync()
    nodes = len(set(hosts_of(config.groups.dp)))
    gathers = getattr(dist.core, "gather", None)
    assert gathers is None or model.params is None     # sharded parameters: no whole vector
    report("-".join((strategy, *options)),
           f"{result.steps} steps, data group over {nodes} nodes, "
           f"max |diff| {np.max(np.abs(params - ref.params)):.2e}"
           + (f", {gathers.gathers} gathers" if gathers is not None else ""))


def case_hybrid(tp: int, pp: int, data_parallel: str = "ddp") -> None:
    """Tensor or pipeline parallel, ``data_parallel`` (a registry name) over the rest."""
    factory = functools.partial(GPT, VOCAB, SEQ, D, HEADS, BLOCKS, dtype=np.float64, seed=11)
    data = token_data()
    ref, ref_losses = serial(factory(), data, 16, 2)
    config = ShardingConfiguration(WORLD, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    model = HybridShardedModel(factory, config, micro_batches=2)
    opt = HybridShardedOptimizer(make_opt(), config, model=model, data_parallel=data_parallel,
                                 bucket_mb=1e-4)
    result = opt.optimize(model, data, epochs=2, batch_size=16)
    close(np.array(result.losses), ref_losses, "losses")
    checked = 0
    with opt.gathered_parameters() as params:      # the stage's whole vector
        for name, shard in model.tensor_shards().items():
            full = ref.layout.view(ref.params, shard.logical_name)
            close(model.layout.view(params, name), full[shard.index], name)
            checked += model.layout.view(params, name).size
        assert checked == params.size
    opt.verify_in_sync()
    groups = config.groups
    where = {name: len(set(hosts_of(getattr(groups, name)))) for name in ("tp", "dp", "pp")}
    report(f"hybrid-tp{tp}-pp{pp}-{data_parallel}", f"{result.steps} steps; nodes spanned by "
                                                  f"group {where}")


def case_checkpoint_write(path: str) -> None:
    """Train 4 of 6 steps with ZeRO-2 across the nodes, save with parallel HDF5."""
    data = mlp_data()
    config = ShardingConfiguration(WORLD)
    model = make_mlp()
    dist = ZeRO2Optimizer(make_opt(), config, bucket_mb=1e-4)
    dist.optimize(model, data, epochs=EPOCHS, batch_size=BATCH, max_steps=4)
    assert dist.step_count == 4, dist.step_count
    save_checkpoint(path, model, dist, driver="mpio")
    report("checkpoint-write", f"step {dist.step_count} to {path}, "
                               f"{len(set(hosts_of(config.world)))} nodes")


def case_checkpoint_read(path: str) -> None:
    """Load at one node with DDP, train on to 2 epochs: equals the serial run."""
    data = mlp_data()
    ref, ref_losses = serial(make_mlp(), data, BATCH, EPOCHS)
    config = ShardingConfiguration(WORLD)
    model = make_mlp()
    dist = DDPOptimizer(make_opt(), config, bucket_mb=1e-4)
    info = load_checkpoint(path, model, dist)
    assert info.step == 4 and dist.step_count == 4, (info.step, dist.step_count)
    assert info.layout["world_size"] != WORLD.size or WORLD.size == 4
    result = dist.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    close(model.params, ref.params, "parameters after the resumed run")
    close(np.array(result.losses), ref_losses[4:], "losses after the resume")
    report("checkpoint-read", f"resumed at step {info.step} on "
                              f"{len(set(hosts_of(config.world)))} node(s), "
                              f"{result.steps} more steps")


def case_transport(megabytes: str) -> None:
    """Rank 1 sends ``megabytes`` MiB to rank 0 (through the library's FlatComm)."""
    config = ShardingConfiguration(WORLD)
    world = config.world
    buf = np.arange(int(megabytes) * (1 << 20) // 8, dtype=np.float64)
    if world.rank == 1:
        world.Isend(buf, 0, tag=7).wait()
    elif world.rank == 0:
        got = np.zeros_like(buf)
        world.Recv(got, 1, tag=7)
        assert np.array_equal(got, buf)
    world.barrier()
    report("transport", f"{buf.nbytes} bytes from rank 1 to rank 0")


def case_hierarchical() -> None:
    """Hierarchical reductions against the flat ones (rtol 1e-12)."""
    from mpishard.comm.hierarchical import HierarchicalComm, choose

    config = ShardingConfiguration(WORLD)
    dp = config.groups.dp
    hier = HierarchicalComm(dp)
    rng = np.random.default_rng(100 + dp.rank)
    for n in (1, 7, 1000, 12345):
        x = rng.standard_normal(n)
        flat = x.copy()
        dp.Allreduce(flat)
        mine = x.copy()
        hier.Allreduce(mine)
        close(mine, flat, f"Allreduce of {n}", rtol=1e-12)
        mine = x.copy()
        hier.Iallreduce(mine, slot=1).wait()
        close(mine, flat, f"Iallreduce of {n}", rtol=1e-12)
        counts = [len(r) for r in np.array_split(np.arange(n), dp.size)]
        start = sum(counts[:dp.rank])
        recv = np.zeros(counts[dp.rank])
        hier.Reduce_scatter(x.copy(), recv, counts)
        close(recv, flat[start:start + counts[dp.rank]], f"Reduce_scatter of {n}", rtol=1e-12)
        recv[...] = 0
        send = x.copy()    # named: a non-blocking call's buffer must outlive it
        hier.Ireduce_scatter(send, recv, counts, slot=2).wait()
        close(recv, flat[start:start + counts[dp.rank]], f"Ireduce_scatter of {n}", rtol=1e-12)
    # Several calls in flight, polled at rank-dependent moments and waited out of
    # order: the stages must still start in the same order on every rank.
    xs = [rng.standard_normal(n) for n in (3000, 5, 2000, 777, 4096, 1)]
    flats = [x.copy() for x in xs]
    for f in flats:
        dp.Allreduce(f)
    outs = [x.copy() for x in xs]
    shard = [np.zeros(len(np.array_split(np.arange(x.size), dp.size)[dp.rank])) for x in xs]
    handles = []
    for i, (x, out) in enumerate(zip(xs, outs)):
        if i % 2:
            counts = [len(r) for r in np.array_split(np.arange(x.size), dp.size)]
            handles.append(hier.Ireduce_scatter(out, shard[i], counts, slot=("rs", i)))
        else:
            handles.append(hier.Iallreduce(out, slot=("ar", i)))
        if (i + dp.rank) % 3 == 0:
            handles[0].test()
    for h in reversed(handles):
        h.wait()
    for i, (out, f) in enumerate(zip(outs, flats)):
        if i % 2:
            counts = [len(r) for r in np.array_split(np.arange(f.size), dp.size)]
            start = sum(counts[:dp.rank])
            close(shard[i], f[start:start + counts[dp.rank]], f"in flight {i}", rtol=1e-12)
        else:
            close(out, f, f"in flight {i}", rtol=1e-12)
    hier.free()
    record = {}
    chosen = choose(dp, 1 << 16, np.float64, np, record=record, nodes=config.groups.nodes)
    assert (chosen is dp) == (record["choice"] == "flat"), record
    if record["levels"] == "2 nodes x 2 ranks":
        assert record["flat"] > 0 and record["hierarchical"] > 0, record
    if chosen is not dp:
        x = rng.standard_normal(1000)
        flat = x.copy()
        dp.Allreduce(flat)
        chosen.Allreduce(x)
        close(x, flat, "the chosen reduction", rtol=1e-12)
        chosen.free()
    report("hierarchical", f"levels {hier.describe()}, chose {record['choice']}")


CASES = {"nodemap": case_nodemap,
         **{name: functools.partial(case_data_parallel, name) for name in NAMES},
         "zero3-no-prefetch": functools.partial(case_data_parallel, "zero3", "no-prefetch"),
         **{f"tp2-dp2-{name}": functools.partial(case_hybrid, 2, 1, name) for name in NAMES},
         "pp2-dp2": lambda: case_hybrid(1, 2),
         "checkpoint-write": case_checkpoint_write, "checkpoint-read": case_checkpoint_read,
         "transport": case_transport, "hierarchical": case_hierarchical}

if __name__ == "__main__":
    # CASE [ARGS], or CASE+CASE+... : cases one after another in one job (one start-up
    # of the ranks); a case that fails ends the job, and the cases after it do not run.
    for name in sys.argv[1].split("+"):
        _RUNNING[:] = [name]
        CASES[name](*sys.argv[2:])
