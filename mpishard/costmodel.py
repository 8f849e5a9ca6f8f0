"""A cost model of a training step on a cluster of nodes. Pure: no MPI, no I/O.

From the latency and bandwidth inside a node and across nodes, the compute rate
and memory of a rank, and the model's size, it predicts for a layout (tp, pp, dp,
DDP, ZeRO-2 or ZeRO-3, flat or hierarchical gradient reduction): the step time, its
communication time, the memory per rank and the pipeline bubble. One process,
no MPI. ``mpishard plan`` (`mpishard.commands.plan`) prints it.

The model (alpha-beta, per node link):

* a collective over ``N`` nodes of ``L`` ranks moves its bytes through each node's
  link. The hierarchical allreduce of ``n`` bytes puts ``2 (N-1)/N n`` on it and
  ``2 (L-1)/L n`` through shared memory; MPI's flat large-message allreduce
  (recursive halving and doubling) puts the same on it when ranks are placed by
  slot, and ``L`` times that when they are placed round robin (its first pairs
  cross nodes). Latency: one ``alpha`` per step. Reduce-scatter: a factor of it
  (1/2 when the MPI's is bandwidth-optimal; calibrated in ``--validate``).
* tensor parallel: 4 allreduces of a micro-batch's activations per layer
  (2 forward, 2 backward), inside the node; pipeline: an activation and its
  gradient per micro-batch across each stage boundary; bubble ``(pp-1)/(m+pp-1)``.
* compute: ``6 * parameters * tokens`` FLOP per step (forward and backward),
  spread over the ranks, at ``--tflops`` per rank; communication does not overlap
  it (mpishard reduces after the backward where that measured faster).
* data parallel: DDP allreduces the gradient; ZeRO-2 reduce-scatters it and
  allgathers the updated parameters; ZeRO-3 reduce-scatters it and allgathers
  the parameters twice, before the forward and again before the backward (a
  layer at a time: the sum over the layers moves the vector). An allgather is
  flat (not hierarchical), a factor of the flat allreduce (1/2 when the MPI's is
  bandwidth-optimal; calibrated in ``--validate``). The gathers are counted as
  exposed, like the rest (prefetch hides some of them where the MPI progresses
  them during compute).
* memory per rank: parameters, gradients and Adam's two moments (ZeRO-2: the
  gradient and the moments of a 1/dp shard; ZeRO-3: all three of a 1/dp shard,
  plus the gathered parameters of two layers, prefetch's two slots) of the
  rank's 1/(tp pp) of the model, plus activations ``seq h (34 + 5 heads seq /
  h)`` bytes per layer and micro-batch at 2-byte precision (Korthikanti et al.
  2022), scaled to the dtype, /tp, with ``pp`` micro-batches in flight on the first stage (1F1B).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["GPT7B", "DataParallelCost", "Layout", "Machine", "ModelSpec", "best_layouts",
           "gather_time", "predict", "reduction_time", "table"]


@dataclass(frozen=True)
class DataParallelCost:
    """What a data-parallel strategy moves and keeps, as the model counts it.

    The strategies' own entries are in the registry of the layer above
    (``mpishard.strategies.STRATEGIES[name].cost``); this module knows no names.

    Attributes:
        name: the strategy's name (``"zero2"``), printed in the predictions.
        reduce_scatter: the gradient is reduced to shards (else allreduced whole).
        gathers: allgathers of the parameters per step (ZeRO-2: after the update;
            ZeRO-3: before the forward and again before the backward).
        sharded_params, sharded_grads, sharded_states: kept as a ``1/dp`` shard.
        gathered_layers: layers of gathered parameters held at once (ZeRO-3's
            prefetch: two).
    """

    name: str
    reduce_scatter: bool
    gathers: int
    sharded_params: bool = False
    sharded_grads: bool = False
    sharded_states: bool = False
    gathered_layers: int = 0


@dataclass(frozen=True)
class Machine:
    """A cluster: ranks per node, links (seconds, bytes/s), a rank's compute and memory."""

    ranks_per_node: int = 8
    latency_inside: float = 5e-6
    bandwidth_inside: float = 150e9
    latency_across: float = 10e-6
    bandwidth_across: float = 25e9       # one node's link (200 Gbit/s)
    flops: float = 150e12                # sustained per rank
    memory: float = 80e9                 # bytes per rank
    # Reduce-scatter time / allreduce time: 1/2 for a bandwidth-optimal MPI;
    # Open MPI 4.1 measured 1.1 here (benchmarks/bench_nodes.py, 4 ranks on one node).
    reduce_scatter_cost: float = 0.5
    # Allgather time / allreduce time (flat, the same bytes): 1/2 bandwidth-optimal.
    allgather_cost: float = 0.5


@dataclass(frozen=True)
class ModelSpec:
    """A GPT's shape: parameters, layers, hidden size, heads, sequence length."""

    parameters: float
    layers: int
    hidden: int
    heads: int
    seq: int
    dtype_bytes: int = 4


#: LLaMA-7B-like: 32 layers of hidden 4096, 32 heads, sequences of 2048 tokens.
GPT7B = ModelSpec(parameters=6.7e9, layers=32, hidden=4096, heads=32, seq=2048)


@dataclass(frozen=True)
class Layout:
    """How the ranks are used. ``global_batch`` in sequences; ``micro_batches``
    per step of each replica (default: micro-batches of one sequence, as many as
    the replica's share of the batch: the least activation memory, the smallest
    bubble)."""

    tp: int
    pp: int
    dp: int
    strategy: DataParallelCost
    reduction: str = "hierarchical"      # or "flat"
    placement: str = "slot"              # or "round-robin"
    global_batch: int = 1024
    micro_batches: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def m(self) -> int:
        return self.micro_batches or max(1, self.global_batch // self.dp)


def _ring(n: float, ranks: int, lat: float, bw: float, load: float = 1.0,
          half: bool = False) -> float:
    """Ring allreduce (or, ``half``, reduce-scatter) of ``n`` bytes over ``ranks``;
    ``load``: how many ring edges share the slowest link."""
    if ranks <= 1 or n <= 0:
        return 0.0
    steps = (ranks - 1) * (1 if half else 2)
    return steps * lat + load * steps / ranks * n / bw


def reduction_time(n: float, dp: int, per_node: int, machine: Machine, reduction: str,
                   placement: str = "slot", half: bool = False) -> float:
    """Seconds to allreduce (``half``: reduce-scatter) ``n`` bytes over a data group of
    ``dp`` ranks, ``per_node`` of them on each node. A reduce-scatter costs
    ``machine.reduce_scatter_cost`` times the allreduce."""
    if half:
        return machine.reduce_scatter_cost * reduction_time(n, dp, per_node, machine,
                                                            reduction, placement)
    per_node = max(1, min(per_node, dp))
    nodes = max(1, dp // per_node)
    if nodes == 1:
        return _ring(n, dp, machine.latency_inside, machine.bandwidth_inside, half=half)
    if reduction == "hierarchical" and per_node > 1:
        inside = _ring(n, per_node, machine.latency_inside, machine.bandwidth_inside, half=True)
        # The L ranks of a node each reduce n/L across: together n on the node's link.
        across = _ring(n / per_node, nodes, machine.latency_across, machine.bandwidth_across,
                       load=per_node, half=half)
        return inside + across + (0.0 if half else inside)
    # Flat over nodes: MPI's large-message allreduce (recursive halving, then
    # doubling: Rabenseifner) pairs near ranks first, so with ranks placed by slot
    # a node's link carries what the hierarchical one's does, 2 (N-1)/N n; placed
    # round robin, its first pairs cross nodes and each of the L ranks of a node
    # sends that much through the link.
    load = per_node if placement == "round-robin" else 1
    steps = (dp - 1) * (1 if half else 2)
    return (steps * machine.latency_across
            + load * (1 if half else 2) * (nodes - 1) / nodes * n / machine.bandwidth_across
            + (0.0 if per_node == 1 or placement == "round-robin" else
               (1 if half else 2) * (per_node - 1) / per_node * n / machine.bandwidth_inside))


def gather_time(n: float, dp: int, per_node: int, machine: Machine,
                placement: str = "slot") -> float:
    """Seconds to allgather ``n`` bytes (in all) over a data group of ``dp`` ranks,
    ``per_node`` on each node: ``machine.allgather_cost`` times the flat allreduce."""
    return machine.allgather_cost * reduction_time(n, dp, per_node, machine, "flat", placement)


def _model_bytes(cost: DataParallelCost, params: float, dp: int, layers: int) -> float:
    """Bytes per rank of parameters, gradient and Adam's two moments (``params``: the
    bytes of the rank's part of the model, ``layers``: its layers)."""
    shard = {True: 1 / dp, False: 1.0}
    return (params * shard[cost.sharded_params] + params * shard[cost.sharded_grads]
            + 2 * params * shard[cost.sharded_states]
            + cost.gathered_layers * params / layers)


def predict(model: ModelSpec, layout: Layout, machine: Machine) -> dict[str, Any]:
    """Step time, its parts, memory per rank and bubble of ``layout``. Pure."""
    tp, pp, dp, m = layout.tp, layout.pp, layout.dp, layout.m
    b = model.dtype_bytes
    local_params = model.parameters / (tp * pp)
    sequences = layout.global_batch / dp            # per data-parallel replica
    micro = sequences / m                           # sequences per micro-batch
    tokens = layout.global_batch * model.seq
    bubble = (pp - 1) / (m + pp - 1)
    compute = 6 * model.parameters * tokens / layout.world / machine.flops / (1 - bubble)
    # Tensor parallel: inside the node when the group fits in one (the library refuses
    # otherwise, unless told to accept it).
    act = micro * model.seq * model.hidden * b
    inside_tp = tp <= machine.ranks_per_node
    lat, bw = ((machine.latency_inside, machine.bandwidth_inside) if inside_tp
               else (machine.latency_across, machine.bandwidth_across))
    tp_comm = 4 * (model.layers / pp) * m * _ring(act, tp, lat, bw)
    # Pipeline: stage boundaries cross nodes once a stage fills a node.
    across_pp = tp * dp >= machine.ranks_per_node
    lat, bw = ((machine.latency_across, machine.bandwidth_across) if across_pp
               else (machine.latency_inside, machine.bandwidth_inside))
    pp_comm = 0.0 if pp == 1 else 2 * (m + pp - 2) * (lat + act / tp / bw)
    # Data parallel: the gradient of this rank's part of the model.
    per_node_dp = max(1, machine.ranks_per_node // tp) if inside_tp else 1
    grad = local_params * b
    cost = layout.strategy
    dp_comm = reduction_time(grad, dp, per_node_dp, machine, layout.reduction,
                             layout.placement, half=cost.reduce_scatter)
    dp_comm += cost.gathers * gather_time(grad, dp, per_node_dp, machine, layout.placement)
    model_bytes = _model_bytes(cost, local_params * b, dp, max(1, model.layers // pp))
    # One micro-batch's activations of one layer; 1F1B keeps min(m, pp) micro-batches
    # of its layers/pp in flight on the first stage (pp = 1: one, however many m).
    per_layer = model.seq * micro * model.hidden * (
        34 + 5 * model.heads * model.seq / model.hidden) * b / 2
    activations = per_layer * model.layers / pp * min(m, pp) / tp
    memory = model_bytes + activations
    comm = tp_comm + pp_comm + dp_comm
    step = compute + comm
    return {"world": layout.world, "tp": tp, "pp": pp, "dp": dp, "strategy": cost.name,
            "reduction": layout.reduction, "micro_batches": m, "step_s": step,
            "compute_s": compute, "comm_s": comm, "tp_comm_s": tp_comm, "pp_comm_s": pp_comm,
            "dp_comm_s": dp_comm, "bubble": bubble, "memory_gb": memory / 1e9,
            "fits": memory <= machine.memory and sequences >= m and sequences == int(sequences),
            "tokens_per_s": tokens / step}


def best_layouts(model: ModelSpec, world: int, machine: Machine, global_batch: int,
                 strategies: Iterable[DataParallelCost],
                 reduction: str = "hierarchical") -> list[dict[str, Any]]:
    """Every (tp, pp, dp, strategy of ``strategies``) of ``world`` ranks, fastest
    first, those that fit first."""
    strategies = tuple(strategies)
    out = []
    for tp in (1, 2, 4, 8, 16):
        if tp > machine.ranks_per_node or world % tp:
            continue
        for pp in (1, 2, 4, 8, 16, 32):
            if world % (tp * pp) or model.layers % pp:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            for strategy in strategies:
                layout = Layout(tp, pp, dp, strategy, reduction, global_batch=global_batch)
                out.append(predict(model, layout, machine))
    return sorted(out, key=lambda r: (not r["fits"], r["step_s"]))


def table(model: ModelSpec, machine: Machine, global_batch: int, worlds: list[int],
          strategies: Iterable[DataParallelCost]) -> list[dict[str, Any]]:
    """For each world size: the fastest layout of ``strategies`` that fits, and how many fit."""
    strategies = tuple(strategies)
    rows = []
    for world in worlds:
        ranked = best_layouts(model, world, machine, global_batch, strategies)
        fitting = [r for r in ranked if r["fits"]]
        best = fitting[0] if fitting else None
        rows.append({"world": world, "layouts": len(ranked), "fit": len(fitting),
                     "best": best, "smallest_memory_gb": min(r["memory_gb"] for r in ranked)})
    return rows
