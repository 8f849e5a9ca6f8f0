"""Tensor-parallel GPT and MLP against the serial models, on every rank.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4. Each test
is parametrised by the tensor-parallel size (1, 2, 4; skipped when it does not
divide the world size): on 4 ranks, tp=2 gives two tensor groups (data-parallel
replicas), each checked against its own serial model on its own batch.

Every rank builds the serial model and its tensor-parallel model from the same
seed. The tensor-parallel parameters must *equal* the matching slices of the
serial ones (initialisation slices the same draws); losses, gradients and the
parameters after a few SGD steps agree to rtol 1e-10 in float64 (the sums over
ranks only reorder additions).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.comm import FlatComm
from mpishard.nn import GPT, MLP, ParallelMLP, owned_ranges
from mpishard.optim import SGD

pytestmark = [pytest.mark.mpi, pytest.mark.layout3d]   # also at 8 ranks: tp2-pp2-dp2

WORLD = MPI.COMM_WORLD
RTOL, ATOL = 1e-10, 1e-14
GPT_ARGS = dict(vocab_size=13, seq_len=6, d_model=16, n_heads=4, n_layers=2)   # V=13: uneven


class CountingComm(FlatComm):
    """A FlatComm that counts the collectives called on it."""

    def __init__(self, comm):
        super().__init__(comm, "tensor-parallel")
        self.calls = Counter()
        self._blocking = False

    def Allreduce(self, buf, slot="allreduce", op="sum"):
        # A blocking Allreduce whose waits test their request (a timeout, or
        # MPISHARD_WAIT=nap) starts an Iallreduce: counted once, as itself.
        self.calls["Allreduce"] += 1
        self._blocking = True
        try:
            super().Allreduce(buf, slot, op)
        finally:
            self._blocking = False

    def Iallreduce(self, buf, slot="allreduce", finish=None, op="sum"):
        if not self._blocking:
            self.calls["Iallreduce"] += 1
        return super().Iallreduce(buf, slot, finish, op)

    def Allgatherv(self, buf, counts, slot="allgather", sendbuf=None):
        self.calls["Allgatherv"] += 1
        super().Allgatherv(buf, counts, slot, sendbuf)


@pytest.fixture(params=[1, 2, 4], ids=lambda p: f"tp{p}")
def config(request):
    tp = request.param
    if WORLD.Get_size() % tp:
        pytest.skip(f"tensor-parallel size {tp} does not divide the world size "
                    f"{WORLD.Get_size()}")
    cfg = ShardingConfiguration(WORLD, tensor_parallel_size=tp, abort_on_exception=False)
    yield cfg
    cfg.free()


def tp_comm(cfg):
    return CountingComm(cfg.groups.tp.comm)


def batch_seed(cfg, step=0):
    # The ranks of a tensor group share a batch; data-parallel replicas differ.
    return 100 * cfg.groups.coordinates.dp + step


def assert_sliced(tp_model, serial, attr, rtol=0.0, atol=0.0):
    """Every local tensor equals its slice of the serial model's logical tensor."""
    shards = tp_model.tensor_shards()
    assert list(shards) == list(tp_model.layout.names)
    for name, shard in shards.items():
        assert shard.logical_name == name
        assert shard.logical_shape == serial.layout[name].shape
        local = tp_model.layout.view(getattr(tp_model, attr), name)
        full = serial.layout.view(getattr(serial, attr), name)
        assert local.shape == shard.shape
        np.testing.assert_allclose(local, full[shard.index], rtol=rtol, atol=atol,
                                   err_msg=f"{attr} of {name}")


def sgd_steps(models, data, steps=3):
    opt = SGD(lr=0.1, momentum=0.9)
    states = [opt.init_state(m.params.size, m.params.dtype, np) for m in models]
    losses = []
    for step in range(1, steps + 1):
        x, y = data(step)
        losses.append([m.forward_backward(x, y) for m in models])
        for m, state in zip(models, states):
            opt.update(m.params, m.grads, state, step, opt.lr)
    return losses


# -- GPT ---------------------------------------------------------------------------------


def gpt_batch(cfg, step=0, rows=3):
    rng = np.random.default_rng(batch_seed(cfg, step))
    shape = (rows, GPT_ARGS["seq_len"])
    return rng.integers(0, 13, size=shape), rng.integers(0, 13, size=shape)


def test_gpt_matches_serial(config):
    p = config.topology.tp
    comm = tp_comm(config)
    serial = GPT(**GPT_ARGS, seed=3)
    model = GPT(**GPT_ARGS, seed=3, tp_comm=comm)
    assert_sliced(model, serial, "params")
    shards = model.tensor_shards()
    split = {n for n, s in shards.items() if not s.replicated}
    if p > 1:
        assert split == {f"{i}.{t}" for i in (1, 2) for t in (
            "attn.wq", "attn.bq", "attn.wk", "attn.bk", "attn.wv", "attn.bv", "attn.wo",
            "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight")} | {"3.head.weight"}
        assert model.layout.size < serial.layout.size
    else:
        assert not split and model.layout == serial.layout
    # Owned ranges count every logical element exactly once over the group.
    owned = sum(len(r) for r in owned_ranges(model.layout, shards, comm.rank))
    assert comm.comm.allreduce(owned) == serial.layout.size

    x, y = gpt_batch(config)
    loss = model.forward_backward(x, y)
    assert loss == pytest.approx(serial.forward_backward(x, y), rel=RTOL)
    assert_sliced(model, serial, "grads", RTOL, ATOL)
    # Replicated gradients agree over the group without being communicated.
    for name, shard in shards.items():
        if shard.replicated:
            g = model.layout.view(model.grads, name)
            np.testing.assert_allclose(g, comm.comm.bcast(g, root=0), rtol=1e-13, atol=1e-16)
    # forward() gathers the full logits.
    np.testing.assert_allclose(model.forward(x), serial.forward(x), rtol=RTOL, atol=ATOL)


def test_gpt_sgd_steps_stay_equal(config):
    serial = GPT(**GPT_ARGS, seed=1)
    model = GPT(**GPT_ARGS, seed=1, tp_comm=tp_comm(config))
    batch = gpt_batch(config)
    losses = sgd_steps([serial, model], lambda step: batch)
    for ls, lt in losses:
        assert lt == pytest.approx(ls, rel=RTOL)
    assert losses[-1][0] < losses[0][0] - 0.01   # it trains
    assert_sliced(model, serial, "params", RTOL, ATOL)


def test_gpt_collectives_per_step(config):
    p = config.topology.tp
    comm = tp_comm(config)
    model = GPT(**GPT_ARGS, tp_comm=comm)
    x, y = gpt_batch(config)
    model.forward_backward(x, y)
    n = GPT_ARGS["n_layers"]
    if p == 1:
        assert not comm.calls
    else:
        # Forward: attention and MLP of each block (Megatron's g). Backward: the
        # same two (f) plus the vocabulary-parallel head. The loss: one gather.
        assert comm.calls == Counter(Allreduce=2 * n, Iallreduce=2 * n + 1, Allgatherv=1)


def test_gpt_stages_with_tensor_parallelism(config):
    comm = tp_comm(config)
    whole = GPT(**GPT_ARGS, seed=2, tp_comm=comm)
    first = GPT(**GPT_ARGS, seed=2, tp_comm=comm, stage_layers=(0, 2))
    last = GPT(**GPT_ARGS, seed=2, tp_comm=comm, stage_layers=(2, 4))
    x, y = gpt_batch(config)
    loss = whole.forward_backward(x, y)
    last.forward_stage(first.forward_stage(x))
    assert last.loss(y) == pytest.approx(loss, rel=1e-13)
    first.backward_stage(last.backward_stage())
    for stage in (first, last):
        for name in stage.layout.names:
            assert stage.tensor_shards()[name] == whole.tensor_shards()[name]
            np.testing.assert_allclose(stage.layout.view(stage.grads, name),
                                       whole.layout.view(whole.grads, name),
                                       rtol=1e-12, atol=1e-16, err_msg=name)


# -- MLP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[6, 8, 12, 5], [6, 8, 12, 4, 5]],
                         ids=["odd-linears", "even-linears"])
def test_parallel_mlp_matches_serial(config, sizes):
    kw = dict(activation="gelu", dropout=0.25, seed=4)
    serial = MLP(sizes, **kw)
    model = ParallelMLP(sizes, **kw, tp_comm=tp_comm(config))
    assert_sliced(model, serial, "params")
    rng = np.random.default_rng(batch_seed(config))

    def data(step):
        x, y = rng.normal(size=(7, sizes[0])), rng.integers(0, sizes[-1], size=7)
        for m in (serial, model):
            m.set_batch_context(step, 0, 7)   # the same dropout masks in both
        return x, y

    losses = sgd_steps([serial, model], data)
    for ls, lt in losses:
        assert lt == pytest.approx(ls, rel=RTOL)
    assert_sliced(model, serial, "grads", RTOL, ATOL)
    assert_sliced(model, serial, "params", RTOL, ATOL)


# -- bad sizes -------------------------------------------------------------------------------


def test_bad_sizes_raise_on_every_rank(config):
    p = config.topology.tp
    if p == 1:
        pytest.skip("every size divides a tensor-parallel size of 1")
    comm = tp_comm(config)
    with pytest.raises(ValueError, match=f"n_heads={p + 1} is not divisible by the "
                                         f"tensor-parallel size {p}"):
        GPT(13, 6, 4 * (p + 1), p + 1, 1, tp_comm=comm)
    with pytest.raises(ValueError, match=rf"sizes\[1\]={p + 1} is not divisible"):
        ParallelMLP([4, p + 1, 3], tp_comm=comm)
    with pytest.raises(ValueError, match="layer_norm=True is not supported"):
        ParallelMLP([4, 2 * p, 3], layer_norm=True, tp_comm=comm)
    # Arguments that differ between ranks: only ranks != 0 find the problem, and
    # every rank raises it (none is left waiting in a collective).
    heads = 2 * p if comm.rank == 0 else 2 * p + 1
    # The prefix names the first failing rank of the group, and its world rank
    # where that differs (the second tensor group at 4 ranks: world rank 3).
    world = WORLD.Get_rank() - comm.rank + 1
    where = "rank 1" if world == 1 else rf"rank 1 \(world rank {world}\)"
    with pytest.raises(ValueError, match=rf"{where}: n_heads={2 * p + 1}"):
        GPT(13, 6, 2 * heads, heads, 1, tp_comm=comm)
    # Still in step: a collective afterwards completes.
    assert comm.comm.allreduce(1) == p
