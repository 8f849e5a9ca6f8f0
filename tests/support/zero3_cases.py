"""Jobs of ``tests/cluster/test_zero3_cluster.py``: ``python zero3_cases.py CASE``.

Run on every rank of a job across the nodes of the namespace cluster; each case
computes its serial reference in the same process (``tests/support/cluster_cases.py``'s
helpers), compares, and prints ``CASE ok on HOST rank R: DETAIL;;``.
"""

from __future__ import annotations

import mpishard  # noqa: F401  (first: each rank limits its BLAS threads before NumPy loads)

# isort: split
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_cases import (  # noqa: E402
    BATCH,
    BLOCKS,
    EPOCHS,
    HEADS,
    SEQ,
    VOCAB,
    WORLD,
    D,
    close,
    hosts_of,
    make_mlp,
    make_opt,
    mlp_data,
    report,
    serial,
    token_data,
)

from mpishard import ShardingConfiguration  # noqa: E402
from mpishard.nn import GPT  # noqa: E402
from mpishard.strategies import (  # noqa: E402
    HybridShardedModel,
    HybridShardedOptimizer,
    ZeRO3Optimizer,
)


def gathered(strategy) -> np.ndarray:
    with strategy.gathered_parameters() as params:
        return np.array(params)


def case_zero3(prefetch: str) -> None:
    """ZeRO-3 with its data group over both nodes: the parameter gathers cross them."""
    data = mlp_data()
    ref, ref_losses = serial(make_mlp(), data, BATCH, EPOCHS)
    config = ShardingConfiguration(WORLD)
    model = make_mlp()
    dist = ZeRO3Optimizer(make_opt(), config, bucket_mb=1e-4, prefetch=prefetch == "prefetch")
    result = dist.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    assert model.params is None
    params = gathered(dist)
    close(params, ref.params, "parameters")
    close(np.array(result.losses), ref_losses, "losses")
    dist.verify_in_sync()
    nodes = len(set(hosts_of(config.groups.dp)))
    report(f"zero3-{prefetch}", f"{result.steps} steps, {dist.core.gather.gathers} gathers, "
                                f"data group over {nodes} nodes")


def case_tp2_zero3() -> None:
    """Tensor parallel inside each node, ZeRO-3 over the data group across them."""
    data = token_data()
    factory = functools.partial(GPT, VOCAB, SEQ, D, HEADS, BLOCKS, dtype=np.float64, seed=3)
    ref, ref_losses = serial(factory(), data, 8, 1)
    config = ShardingConfiguration(WORLD, tensor_parallel_size=2)
    model = HybridShardedModel(factory, config, micro_batches=2)
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel="zero3", model=model,
                                 bucket_mb=1e-4)
    result = opt.optimize(model, data, epochs=1, batch_size=8)
    close(np.array(result.losses), ref_losses, "losses")
    with opt.gathered_parameters() as params:
        for name, shard in model.tensor_shards().items():
            close(model.layout.view(params, name),
                  ref.layout.view(ref.params, shard.logical_name)[shard.index], name)
    nodes = len(set(hosts_of(config.groups.dp)))
    report("tp2-zero3", f"{result.steps} steps, tp inside a node, data group over {nodes} nodes")


CASES = {"zero3-prefetch": lambda: case_zero3("prefetch"),
         "zero3-no-prefetch": lambda: case_zero3("no-prefetch"),
         "tp2-zero3": case_tp2_zero3}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
