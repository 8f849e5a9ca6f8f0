"""DDP, ZeRO-2 and ZeRO-3 train the same bits with the fused optimizer kernels as
with their NumPy twins (run at 1, 2 and 4 ranks).

Clipping's coefficient and the 1/rows average reach the kernel as ``grad_scale``;
the ZeRO strategies update shards of odd lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
from strategies import STRATEGIES

from mpishard import ShardingConfiguration
from mpishard.backend import to_numpy
from mpishard.kernels import kernel_mode, numba_available
from mpishard.nn import MLP
from mpishard.optim import SGD, Adam, AdamW
from mpishard.strategies import ZeRO3Optimizer

pytestmark = pytest.mark.mpi

OPTIMIZERS = {
    "adam": lambda: Adam(lr=3e-3, weight_decay=1e-4),
    "adamw": lambda: AdamW(lr=3e-3),
    "sgd-nesterov": lambda: SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
}

MAKERS = {**STRATEGIES,
          "zero3": lambda opt, cfg, **kw: ZeRO3Optimizer(
              opt, cfg, reduce_method="reduce_scatter", **kw)}


def train(strategy, make_opt, steps=3):
    model = MLP([5, 9, 7, 3], activation="tanh", dtype=np.float32, seed=3)
    dist = MAKERS[strategy](make_opt(), ShardingConfiguration(), model=model,
                            bucket_mb=200 / 2**20, max_grad_norm=0.5)
    rng = np.random.default_rng(dist.dp.rank)
    losses = []
    for _ in range(steps):
        x = rng.standard_normal((6, 5)).astype(np.float32)
        losses.append(dist.train_step(x, rng.integers(0, 3, 6)))
    with dist.gathered_parameters() as params:
        return to_numpy(params).copy(), losses


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy", sorted(MAKERS))
def test_strategies_train_the_same_bits_fused(strategy, opt_name, monkeypatch):
    if not numba_available():
        pytest.skip("Numba does not import here: no fused CPU kernel to test")
    runs = {}
    for mode in ("reference", "fused"):
        monkeypatch.setenv("MPISHARD_KERNELS", mode)
        kernel_mode.cache_clear()
        try:
            runs[mode] = train(strategy, OPTIMIZERS[opt_name])
        finally:
            kernel_mode.cache_clear()
    (fused, fused_losses), (ref, ref_losses) = runs["fused"], runs["reference"]
    assert fused.tobytes() == ref.tobytes(), (
        f"{int(np.sum(fused != ref))} of {ref.size} parameters differ")
    assert fused_losses == ref_losses
    start = MLP([5, 9, 7, 3], activation="tanh", dtype=np.float32, seed=3).params
    assert not np.array_equal(ref, start)       # the run trained something
