"""Streams of global batches (:class:`mpishard.data.BatchStream`) against one NumPy process.

A stream is a sequence of global batches of varying sizes; training on it must
equal one process stepping through the same batches (float64, rtol 1e-10),
whether every rank yields the whole batch (``local=False``) or its own rows of
it (``local=True``, sizes differing by rank, zero included). A stop, a
checkpoint and a resume (the live stream continued, or a replayed one skipped
to the position) give the same bits as the run that never stopped; an iterator
is never read ahead. Run under ``mpirun -n N`` for N = 1, 2, 4 (the arguments, without
MPI: ``tests/unit/test_batch_stream_arguments.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI
from reference import train_serial
from strategies import STRATEGIES
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.data import BatchStream, ShardedSampler
from mpishard.nn import MLP
from mpishard.optim import Adam

WORLD = MPI.COMM_WORLD
SIZES = [5, 7, 3]
ROWS = [8, 12, 5, 16, 9, 8, 3, 12]     # the global batch of each step


def snapshots(rows=ROWS, seed=1):
    """What a simulation hands over: one global batch per time step."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((5, 3))
    out = []
    for n in rows:
        x = rng.standard_normal((n, 5))
        out.append((x, np.argmax(x @ w, axis=1)))
    return out


def cuts(n, ranks, step):
    """Unequal parts of a batch of ``n`` rows by rank, zero included (the same on every rank)."""
    inner = np.sort(np.random.default_rng([7, step]).integers(0, n + 1, ranks - 1))
    if step == 2:
        inner[:] = 0            # the last rank yields the whole batch, the others nothing
    edges = np.concatenate(([0], inner, [n]))
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


class Source:
    """A live simulation: yields each rank's view of each batch and counts what it gave."""

    def __init__(self, batches, local, start=0):
        self.batches, self.local, self.given = batches, local, start

    def __iter__(self):
        while self.given < len(self.batches):
            x, y = self.batches[self.given]
            if self.local:
                lo, hi = cuts(len(x), WORLD.size, self.given)[WORLD.rank]
                x, y = x[lo:hi], y[lo:hi]
            self.given += 1
            yield x, y


def make_model():
    return MLP(SIZES, activation="tanh", dtype=np.float64, seed=3)


def reference(batches):
    """One process, one optimizer step per global batch (``reference``)."""
    run = train_serial(make_model(), Adam(lr=1e-2), batches)
    return run.params, run.losses


def strategy(name="ddp"):
    return STRATEGIES[name](Adam(lr=1e-2), ShardingConfiguration(WORLD))


@pytest.mark.mpi
@pytest.mark.parametrize("local", [False, True], ids=["whole-batch", "own-rows"])
@pytest.mark.parametrize("name", ["ddp", "zero2-reduce_scatter"])
def test_a_stream_trains_like_one_process_on_the_same_batches(name, local):
    batches = snapshots()
    model, opt = make_model(), strategy(name)
    source = Source(batches, local)
    result = opt.optimize(model, BatchStream(source, local=local))
    ref_params, ref_losses = reference(batches)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    np.testing.assert_allclose(model.params, ref_params, rtol=1e-10, atol=1e-13)
    assert (result.stopped, result.steps, result.samples) == ("exhausted", len(ROWS), sum(ROWS))
    assert opt.data_position == {"epoch": 0, "samples_consumed": sum(ROWS), "seed": 0,
                                 "batch_size": ROWS[-1], "num_samples": sum(ROWS),
                                 "shuffle": 0, "batches": len(ROWS)}
    opt.verify_in_sync()


@pytest.mark.mpi
@pytest.mark.parametrize("resume", ["live", "replayed"])
def test_stop_checkpoint_and_resume_continue_the_stream_exactly(mpi_tmp_path, resume):
    """Stopped by max_steps after 3 batches and by the callback after 5: nothing
    read ahead; restored into a new strategy, the live stream goes on (first=None)
    or a replayed one skips what was trained (first=0): the bits of one run."""
    batches = snapshots()
    path = os.path.join(str(mpi_tmp_path), f"stream-{resume}.h5")
    whole_model, whole = make_model(), strategy()
    whole.optimize(whole_model, BatchStream(Source(batches, True), local=True))

    model, opt = make_model(), strategy()
    source = Source(batches, True)
    stream = BatchStream(source, local=True)
    first = opt.optimize(model, stream, max_steps=3)
    assert (first.stopped, first.steps, source.given, stream.index) == ("max_steps", 3, 3, 3)
    second = opt.optimize(model, stream, callback=lambda step, loss: step == 5)
    assert (second.stopped, second.steps, source.given) == ("callback", 2, 5)
    save_checkpoint(path, model, opt)

    model2, opt2 = make_model(), strategy()
    load_checkpoint(path, model2, opt2)
    assert (opt2.data_position["batches"], opt2.data_position["samples_consumed"]) == (
        5, sum(ROWS[:5]))
    if resume == "live":        # the simulation goes on from where it is
        rest_stream = BatchStream(source, local=True)
    else:                       # read again from the beginning, the first 5 skipped
        source = Source(batches, True)
        rest_stream = BatchStream(source, local=True, first=0)
    rest = opt2.optimize(model2, rest_stream)
    assert (rest.stopped, rest.steps, source.given) == ("exhausted", len(ROWS) - 5, len(ROWS))
    np.testing.assert_array_equal(model2.params, whole_model.params)
    assert opt2.step_count == whole.step_count == len(ROWS)
    # An exhausted stream trains nothing more; a new pass counts from the new stream.
    assert opt2.optimize(model2, rest_stream).steps == 0
    opt2.new_pass()
    again = opt2.optimize(model2, BatchStream(Source(batches[:2], False)), batch_size=None)
    assert (again.steps, opt2.data_position["batches"]) == (2, 2)


@pytest.mark.mpi
@batch_splits(8)
def test_a_stream_that_starts_after_the_position_or_mixes_with_a_dataset_is_refused():
    batches = snapshots()
    model, opt = make_model(), strategy()
    opt.optimize(model, BatchStream(Source(batches, False)), max_steps=2)
    with pytest.raises(ValueError, match="batches 2 to 3 would be missed"):
        opt.optimize(model, BatchStream(Source(batches, False, start=4), first=4))
    x, y = batches[3]
    with pytest.raises(ValueError, match="the data position is a stream's"):
        opt.optimize(model, (x, y), epochs=1, batch_size=4)
    with pytest.raises(ValueError, match="has no epochs"):
        opt.optimize(model, BatchStream(Source(batches, False)), epochs=1)
    live = iter(Source(batches, False))
    with pytest.raises(ValueError, match="wrap an iterator .* in mpishard.data.BatchStream"):
        opt.optimize(model, live, epochs=1, batch_size=8)
    assert next(live)[0] is batches[0][0]        # not consumed by the refusal
    with pytest.raises(ValueError, match="seed and shuffle do not apply"):
        opt.optimize(model, BatchStream(Source(batches, False)), seed=3)
    opt.new_pass()
    opt.optimize(model, (x, y), epochs=1, batch_size=8)
    with pytest.raises(ValueError, match="the data position is a dataset's"):
        opt.optimize(model, BatchStream(Source(batches, False)))
    opt.new_pass()
    with pytest.raises(ValueError, match="expecting batch_size=8"):
        opt.optimize(model, BatchStream(Source(batches, False)), batch_size=8)
    # The first batch (8 rows) trained; the second was read and refused: it counts.
    assert opt.data_position["batches"] == 2


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_a_batch_fail_together():
    rank = WORLD.rank
    batches = snapshots()

    def uneven():     # rank 1 yields one row more at the second batch
        for k, (x, y) in enumerate(batches):
            extra = int(k == 1 and rank == 1)
            yield x[:len(x) - 1 + extra], y[:len(y) - 1 + extra]

    def short():      # rank 1's stream ends after 3 batches
        yield from batches[:3 if rank == 1 else 5]

    def failing():
        for k, item in enumerate(batches):
            if k == 2 and rank == 1:
                raise RuntimeError("the solver diverged")
            yield item

    def shapes():
        for x, y in batches:
            yield (x[:, :4] if rank == 1 else x), y

    cases = [(uneven, "every rank yields the same global batch, but the ranks yield"),
             (short, r"stream batch 3: the stream ended on world rank 1 but yielded a "
                     r"batch on world rank 0"),
             (failing, "stream batch 2: the stream raised RuntimeError: the solver diverged"),
             (shapes, "different shapes or dtypes.*world rank 1: 8 rows \\(4,\\)"),
             (lambda: iter([(1, 2, 3)]), "expecting an \\(inputs, targets\\) pair")]
    for make, match in cases:
        model, opt = make_model(), strategy()
        with pytest.raises(ValueError, match=match):
            opt.optimize(model, BatchStream(make()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_model_parallel_replicas_read_the_stream_like_one_process(tp, pp):
    """tp=2 or pp=2: the tensor or pipeline peers of each data-parallel rank yield
    that rank's rows (local=True) of the sampler's batches; the same as one process."""
    from reference import assert_shards_match
    from test_hybrid import make_opt, mlp_data, mlp_factory
    from test_hybrid import serial_reference as hybrid_reference

    from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

    if WORLD.size % 2:
        pytest.skip("a model-parallel size of 2 needs an even world")
    dp_size = WORLD.size // (tp * pp)
    if pp > 1 and 16 % (dp_size * pp):
        pytest.skip(f"a pipeline's rows must split equally: 16 rows do not split into "
                    f"{dp_size} data-parallel ranks x {pp} micro-batches")
    x, y = mlp_data()
    config = ShardingConfiguration(WORLD, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    dp = config.groups.dp

    def own_rows():     # the global batches of 2 shuffled epochs, this replica's share
        sampler = ShardedSampler(len(x), 16, seed=0)
        while sampler.state.epoch < 2:
            idx = sampler.batch_indices(dp.rank * 16 // dp.size, (dp.rank + 1) * 16 // dp.size)
            yield x[idx], y[idx]
            sampler.advance()

    model = HybridShardedModel(mlp_factory(), config, micro_batches=pp)
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel="ddp", model=model)
    result = opt.optimize(model, BatchStream(own_rows(), local=True), batch_size=16)
    serial, ref_losses = hybrid_reference(mlp_factory, (x, y), 16, 2, make_opt)
    assert result.stopped == "exhausted"
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    assert_shards_match(model, serial)


@pytest.mark.mpi
def test_an_elastic_worker_resumes_its_stream_from_the_checkpoint(mpi_tmp_path):
    """ElasticOptimizer: the stream's end is a normal return (exit code 0); a
    relaunched worker (a new optimizer on the same folder) places a replayed
    stream at the checkpoint's batch count."""
    from mpishard.strategies import ElasticOptimizer

    batches = snapshots()
    folder = os.path.join(str(mpi_tmp_path), "elastic-stream")
    model = make_model()
    opt = ElasticOptimizer(Adam(lr=1e-2), ShardingConfiguration(WORLD), checkpoint_dir=folder)
    result = opt.optimize(model, BatchStream(Source(batches[:5], False)))
    assert (result.stopped, result.steps, opt.stop_reason, opt.exit_code) == (
        "exhausted", 5, None, 0)
    model2 = make_model()
    opt2 = ElasticOptimizer(Adam(lr=1e-2), ShardingConfiguration(WORLD), checkpoint_dir=folder)
    source = Source(batches, False)
    rest = opt2.optimize(model2, BatchStream(source, first=0))
    assert (rest.steps, source.given, opt2.data_position["batches"]) == (3, 8, 8)
    np.testing.assert_allclose(model2.params, reference(batches)[0], rtol=1e-10, atol=1e-13)
