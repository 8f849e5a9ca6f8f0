"""What DDP and ZeRO-2 share: checks at attach, micro-batches, stepping, the loop."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..backend import array_namespace, to_numpy
from ..comm import Handle
from ..config import ShardingConfiguration
from ..data import ArrayDataset, ShardedSampler, split_batch
from ..errors import CommunicationError, MpiShardError, TopologyError
from ..flat import Range, bucket_ranges
from ..protocols import BucketedModel, Model, Optimizer

__all__ = ["DataParallelOptimizer", "TrainResult"]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass
class TrainResult:
    """What :meth:`DataParallelOptimizer.optimize` returns."""

    losses: list[float] = field(default_factory=list)   # global mean loss per step
    steps: int = 0
    epochs: int = 0
    seconds: float = 0.0
    samples: int = 0
    stopped: bool = False      # a callback stopped training before the last epoch

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")


class DataParallelOptimizer:
    """Base of the data-parallel strategies; not used directly.

    Subclasses decide where gradients live and how they are reduced
    (:class:`~mpishard.strategies.DDPOptimizer`,
    :class:`~mpishard.strategies.ZeRO2Optimizer`); this class owns the checks, the
    micro-batch bookkeeping, learning-rate schedule, clipping and the training loop.
    """

    #: Human-readable name, written into checkpoints and reports.
    strategy = "data-parallel"
    #: Subclasses that hold a tensor/pipeline shard of the model set this.
    _model_parallel = False
    #: Extra factor on the summed gradient (a pipeline's 1 / micro-batches).
    _gradient_factor = 1.0

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 model: Model | None = None, bucket_mb: float = 25.0,
                 accumulation_steps: int = 1, max_grad_norm: float | None = None,
                 schedule: Callable[[int], float] | None = None, overlap: bool = True) -> None:
        self.config = config if config is not None else ShardingConfiguration()
        world = self.config.world
        world.agree(None if isinstance(optimizer, Optimizer) else
              f"expecting a gradient optimizer with init_state() and update() "
              f"(mpishard.optim.SGD, Adam, AdamW), got {type(optimizer).__name__}", TypeError)
        problem = None
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            problem = f"accumulation_steps must be a positive integer, got {accumulation_steps!r}"
        elif not (bucket_mb > 0):
            problem = f"bucket_mb must be positive, got {bucket_mb!r}"
        elif max_grad_norm is not None and not (max_grad_norm > 0):
            problem = f"max_grad_norm must be positive or None, got {max_grad_norm!r}"
        world.agree(problem, ValueError)
        topo = self.config.topology
        if topo.tp * topo.pp != 1 and not self._model_parallel:
            world.agree(f"{type(self).__name__} replicates the whole model, but the layout has "
                        f"tensor_parallel_size={topo.tp} and pipeline_parallel_size={topo.pp}; "
                        f"use HybridShardedOptimizer for tensor or pipeline parallelism",
                  TopologyError)
        self.optimizer = optimizer
        self.bucket_mb = float(bucket_mb)
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.schedule = schedule
        self.overlap = overlap
        groups = self.config.groups
        self.dp = groups.dp
        self.model: Model | None = None
        self.step_count = 0
        self.last_grad_norm = float("nan")
        self.sampler: ShardedSampler | None = None
        self.timings = {"forward_backward": 0.0, "communication": 0.0,
                        "optimizer": 0.0, "gather": 0.0}
        self._pending_micro = 0
        self._loss_sum = 0.0
        self._no_sync = False
        self._handles: list[Handle] = []
        self._peak_bytes = 0
        if model is not None:
            self.attach(model)

    # --- setting up --------------------------------------------------------
    def attach(self, model: Model) -> None:
        """Check ``model``, make every replica start from rank 0's parameters and
        set up gradient buckets and optimizer state. Collective over ``groups.dp``.

        Raises:
            TypeError: not a model, or parameters that are not float32/float64
                1-D arrays (on every rank).
            MpiShardError: the parameter count or dtype differs between ranks.
        """
        self.dp.agree(_model_problem(model), TypeError)
        n, dtype = model.params.size, model.params.dtype.str
        every = self.dp.allgather((n, dtype))
        if len(set(every)) > 1:
            detail = ", ".join(f"rank {r} has {c} {np.dtype(d).name}" for r, (c, d) in enumerate(every))
            raise MpiShardError(f"parameters differ between data-parallel ranks: {detail}")
        self.model = model
        self.xp = array_namespace(model.params)
        self.layout = model.layout
        self.bucketed = isinstance(model, BucketedModel) and self.overlap
        self._accumulates = _accepts_keyword(model.forward_backward, "accumulate")
        self._batch_context = hasattr(model, "set_batch_context")
        bucket_elements = max(1, int(self.bucket_mb * 2**20) // model.params.itemsize)
        self.buckets: list[Range] = bucket_ranges(model.layout, bucket_elements)
        self.dp.Bcast(model.params, root=0)
        self._setup()
        self._peak_bytes = max(self._peak_bytes, self._current_bytes())

    def _require_model(self) -> Model:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} has no model: call attach(model) "
                               f"or optimize(model, ...) first")
        return self.model

    # --- one step ----------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients of the ``backward`` calls inside without communicating."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def backward(self, x: Any, y: Any) -> float:
        """Forward and backward on this rank's micro-batch; returns its local mean loss.

        Gradients of successive calls accumulate until :meth:`step`. Reductions
        start during the backward pass where the strategy can. Collective over
        ``groups.dp`` (every rank calls it the same number of times).
        """
        model = self._require_model()
        micro = self._pending_micro
        # Tell random layers where these rows sit in the global batch. Only known
        # for the accumulation_steps split; extra no_sync() micro-batches of a
        # hand-written loop leave the model to its own counter.
        if self._batch_context and micro < self.accumulation_steps:
            rows = len(x)
            per_rank = rows * self.accumulation_steps
            model.set_batch_context(self.step_count, self.dp.rank * per_rank + micro * rows,
                                    per_rank * self.dp.size)
        t0 = time.perf_counter()
        loss = self._backward(model, x, y, micro)
        self.timings["forward_backward"] += time.perf_counter() - t0 - self._comm_in_backward
        self.timings["communication"] += self._comm_in_backward
        self._pending_micro += 1
        self._loss_sum += loss
        return loss

    def step(self) -> float:
        """Reduce what is left, clip, update, and return the global mean loss of the
        micro-batches since the last step. Collective over ``groups.dp``.
        """
        if self._pending_micro == 0:
            raise RuntimeError("step() called before backward(): there are no gradients")
        t0 = time.perf_counter()
        self._finish_gradients()
        t1 = time.perf_counter()
        self.timings["communication"] += t1 - t0
        loss_scale = 1.0 / (self.dp.size * self._pending_micro)
        scale = loss_scale * self._gradient_factor
        coefficient = 1.0
        if self.max_grad_norm is not None:
            norm = math.sqrt(self._global_sum_of_squares()) * scale
            self.last_grad_norm = norm
            coefficient = min(1.0, self.max_grad_norm / (norm + 1e-6))
        self.step_count += 1
        lr = self.current_lr()
        self._update(lr, scale * coefficient)
        t2 = time.perf_counter()
        self.timings["optimizer"] += t2 - t1
        self._gather_parameters()
        self.timings["gather"] += time.perf_counter() - t2
        loss = self.dp.allreduce_scalar(self._loss_sum) * loss_scale
        self._pending_micro = 0
        self._loss_sum = 0.0
        return loss

    def train_step(self, x: Any, y: Any) -> float:
        """One optimizer step on this rank's local batch, split into
        ``accumulation_steps`` micro-batches. Returns the global mean loss.
        Collective over ``groups.dp``.
        """
        m = self.accumulation_steps
        if len(x) % m:
            raise ValueError(f"local batch of {len(x)} rows does not split into "
                             f"{m} micro-batches")
        rows = len(x) // m
        for k in range(m):
            self.backward(x[k * rows:(k + 1) * rows], y[k * rows:(k + 1) * rows])
        return self.step()

    def current_lr(self) -> float:
        """The learning rate of the current step, schedule applied."""
        factor = self.schedule(max(self.step_count, 1)) if self.schedule is not None else 1.0
        return self.optimizer.lr * factor

    # --- the loop ----------------------------------------------------------
    def optimize(self, model: Model, data: Any, epochs: int, batch_size: int, *,
                 shuffle: bool = True, seed: int = 0,
                 callback: Callable[[int, float], None] | None = None) -> TrainResult:
        """Train ``model`` for ``epochs`` epochs on ``data`` with global batch
        ``batch_size``. Collective over ``groups.dp``.

        ``data`` is an ``(inputs, targets)`` pair of arrays (every rank passes the
        same data; each reads only its rows of each batch) or an object with
        ``__len__``, ``buffers(rows, xp)`` and ``gather(indices, x_out, y_out)``
        such as :class:`~mpishard.data.ArrayDataset`. Each global batch is split
        evenly across the data-parallel ranks and then into micro-batches; the
        shuffle of an epoch depends on ``(seed, epoch)`` only, so any world size
        sees the same batches. ``callback(step, loss)`` runs after every step; if
        it returns True, training stops there (``result.stopped``); it must
        return the same on every rank.

        Raises:
            ValueError: ``batch_size`` does not split across the ranks and
                micro-batches, or exceeds the dataset (on every rank).
        """
        if self.model is not model:
            self.attach(model)
        dataset = data if hasattr(data, "gather") else ArrayDataset(*data)
        problem = None
        try:
            # A pipelined model cuts each micro-batch again into its own micro-batches.
            pipeline = getattr(model, "micro_batches", 1)
            split = split_batch(batch_size, self.dp.size, self.accumulation_steps * pipeline)
            if self.sampler is None:
                self.sampler = ShardedSampler(len(dataset), batch_size, seed=seed, shuffle=shuffle)
            elif self.sampler.num_samples != len(dataset):
                raise ValueError(f"the data has {len(dataset)} samples but the sampler (restored "
                                 f"from a checkpoint?) counts {self.sampler.num_samples}")
            elif self.sampler.batch_size != batch_size:
                # A new global batch (an elastic resize under scale-lr): keep the data
                # position, counted in samples, so no sample is repeated or skipped.
                old = self.sampler
                self.sampler = ShardedSampler(len(dataset), batch_size, seed=old.state.seed,
                                              shuffle=old.shuffle)
                self.sampler.load_state(old.state)
        except ValueError as exc:
            problem = str(exc)
        self.dp.agree(problem, ValueError)
        sampler = self.sampler
        assert sampler is not None
        x, y = dataset.buffers(split.local_size, self.xp, model.params.dtype)
        lo, hi = split.local_range(self.dp.rank)
        result = TrainResult()
        stop_epoch = sampler.state.epoch + epochs
        t0 = time.perf_counter()
        while sampler.state.epoch < stop_epoch:
            dataset.gather(sampler.batch_indices(lo, hi), x, y)
            loss = self.train_step(x, y)
            sampler.advance()
            result.losses.append(loss)
            result.steps += 1
            result.samples += batch_size
            if callback is not None and callback(self.step_count, loss):
                result.stopped = True   # the callback asked to stop at this step boundary
                break
        result.seconds = time.perf_counter() - t0
        result.epochs = epochs
        return result

    # --- checks and reports -----------------------------------------------
    def verify_in_sync(self) -> None:
        """Check that every data-parallel replica holds identical parameters.

        Compares a BLAKE2 hash of the parameter bytes and the step count across
        ``groups.dp``. Collective over ``groups.dp``.

        Raises:
            CommunicationError: on every rank, naming the ranks that differ.
        """
        model = self._require_model()
        digest = hashlib.blake2b(to_numpy(model.params).tobytes(), digest_size=16).hexdigest()
        every = self.dp.allgather((digest, self.step_count))
        if len(set(every)) > 1:
            odd = [r for r, d in enumerate(every) if d != every[0]]
            raise CommunicationError(
                f"replicas out of sync: data-parallel rank(s) {odd} differ from rank 0 "
                f"(parameter hash, step) = {every[0]}")

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients, optimizer state and
        communication buffers, with the total now and the peak since attach."""
        report = self._memory()
        report["total"] = sum(report.values())
        self._peak_bytes = max(self._peak_bytes, report["total"])
        report["peak"] = self._peak_bytes
        return report

    def reset_timings(self) -> None:
        for key in self.timings:
            self.timings[key] = 0.0

    def _current_bytes(self) -> int:
        return sum(self._memory().values())

    # --- what subclasses provide -----------------------------------------
    _comm_in_backward = 0.0

    def _setup(self) -> None:
        raise NotImplementedError

    def _backward(self, model: Model, x: Any, y: Any, micro: int) -> float:
        raise NotImplementedError

    def _finish_gradients(self) -> None:
        raise NotImplementedError

    def _global_sum_of_squares(self) -> float:
        raise NotImplementedError

    def _update(self, lr: float, grad_scale: float) -> None:
        raise NotImplementedError

    def _gather_parameters(self) -> None:
        pass

    def _memory(self) -> dict[str, int]:
        raise NotImplementedError

    def _wait_all(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._handles.clear()


def _model_problem(model: Any) -> str | None:
    """Why ``model`` cannot be trained, or None."""
    if not isinstance(model, Model):
        return (f"expecting a model with params, grads, layout, forward() and "
                f"forward_backward(), got {type(model).__name__}")
    params = model.params
    if getattr(params, "ndim", None) != 1:
        return f"model.params must be a 1-D array, got shape {getattr(params, 'shape', None)}"
    if params.dtype not in _FLOAT_DTYPES:
        return f"model.params must be float32 or float64, got {params.dtype}"
    if params.size != model.layout.size:
        return f"model.params has {params.size} elements but its layout has {model.layout.size}"
    grads = model.grads
    if grads is not None and (grads.shape != params.shape or grads.dtype != params.dtype):
        return (f"model.grads must match params ({params.shape}, {params.dtype}), "
                f"got ({grads.shape}, {grads.dtype})")
    return None


def _accepts_keyword(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _nbytes(arrays: Any) -> int:
    return int(sum(a.nbytes for a in arrays))
