"""A rebuild that turns bucketed overlap off takes the model's backward hooks off the
old buckets (issue 31): before the fix the model kept calling the old reduction's
buckets from its backward, over the released reducer and the old data group (seen
under ULFM as a spurious second recovery, with a wrapper hiding ``loss_scale``).

Run under ``mpirun -n N python -m pytest --with-mpi`` (N = 1, 2, 4).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from reference import classification_data, train_serial
from strategies import NAMES, build, whole

from mpishard import ShardingConfiguration
from mpishard.nn import MLP
from mpishard.optim import Adam

pytestmark = pytest.mark.mpi

SIZES = [5, 16, 16, 3]


@pytest.mark.parametrize("name", NAMES)
def test_rebuild_without_overlap_unhooks_the_old_buckets(name):
    comm = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    x, y = classification_data(n=8 * n * 4)
    rows = 8 * n
    batches = [(x[s * rows:(s + 1) * rows], y[s * rows:(s + 1) * rows]) for s in range(4)]
    model = MLP(SIZES, dtype=np.float64, seed=1)
    opt = build(name, Adam(lr=1e-2), ShardingConfiguration(comm), model=model,
                overlap=True, bucket_mb=0.0005)
    assert opt.core.bucketed, "overlap=True on a model with hooks: buckets during the backward"
    old = opt.core.buckets
    for bx, by in batches[:2]:
        opt.train_step(bx[8 * r:8 * (r + 1)], by[8 * r:8 * (r + 1)])
    real = model.forward_backward

    def hiding_loss_scale(x, y):     # no loss_scale=: the rebuild cannot overlap
        return real(x, y)

    model.forward_backward = hiding_loss_scale
    state = {k: v.copy() for k, v in opt.core.state.items()}
    opt.core.rebuild(ShardingConfiguration(comm))    # the same layout: the same shards
    for k, v in state.items():                        # a rebuild starts it from zero
        opt.core.state[k][...] = v
    assert not opt.core.bucketed
    assert getattr(model, "_hooks", None) is not old, "the model still calls the old buckets"
    for bx, by in batches[2:]:
        opt.train_step(bx[8 * r:8 * (r + 1)], by[8 * r:8 * (r + 1)])
    serial = train_serial(MLP(SIZES, dtype=np.float64, seed=1), Adam(lr=1e-2), batches)
    np.testing.assert_allclose(whole(opt), serial.params, rtol=1e-10, atol=1e-12)
