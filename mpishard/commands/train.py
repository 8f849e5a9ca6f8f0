"""``mpishard train``: build each run's data, model and strategy, train it, summarise.

Started on every rank (``mpirun -n N mpishard train ...`` or ``srun``). The
settings (`mpishard.commands.config`) are parsed identically on every
rank, so bad input is found everywhere at once; a check whose outcome can
differ between ranks (a file that one node does not see) is agreed on first.
Either way every rank returns exit code 2 and only rank 0 prints one line.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..exitcodes import EXIT_STOPPED, EXIT_USAGE
from ..protocols import Dataset
from .config import Settings, UsageError, build_parser, plan_runs

# What needs MPI is imported inside the functions that run on the ranks: the
# ``mpishard`` command builds its parser from this module, and ``mpishard run``
# (the agent that starts mpirun) must never import mpi4py itself.
if TYPE_CHECKING:
    from ..comm import FlatComm
    from ..train import StopRequest, TrainResult

__all__ = ["EXIT_STOPPED", "EXIT_USAGE", "add_train_parser", "main"]

#: What a signal stop leaves in ``TrainResult.stopped``: exit with EXIT_STOPPED
#: (a checkpoint was written; requeue with --resume).
_SIGNALS = ("SIGUSR1", "SIGTERM")

_VALIDATION_GPT = 256      # held-out text windows
_VALIDATION_BURGERS = 1024  # held-out solutions


@dataclass
class Run:
    """One run, set up: what `_train` needs and what the summary says."""

    settings: Settings
    config: Any
    model: Any
    strategy: Any
    data: Any
    validation: tuple[Any, Any] | None
    description: list[str]
    manager: Any = None
    resumed_from: str | None = None
    resume_notes: list[str] = field(default_factory=list)   # said once, under the header
    closers: list[Callable[[], None]] = field(default_factory=list)


def add_train_parser(sub: Any) -> None:
    """Add ``train`` to the subcommands ``sub`` of ``mpishard``.

    ``mpishard.cli.main`` hands ``train ARGV`` to `main` before its own
    parser sees it, so that a bad flag is one line on rank 0 (argparse would
    print the usage on every rank); this entry serves ``mpishard --help``.
    """
    import argparse

    from .config import _DESCRIPTION, _EPILOG

    parser = sub.add_parser("train", help="train a model on N ranks (mpirun -n N mpishard train)",
                            description=_DESCRIPTION, epilog=_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    build_parser(parser)
    parser.set_defaults(func=lambda args: run_given(
        {k: v for k, v in vars(args).items() if k not in ("command", "func")}))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mpishard train ARGV`` on every rank of ``MPI.COMM_WORLD``; the exit code."""
    from ..comm import from_comm

    try:
        given = vars(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv)))
    except UsageError as exc:
        return _usage(from_comm(None, "world"), exc)
    except SystemExit as exc:   # --help
        return int(exc.code or 0)
    return run_given(given)


def run_given(given: dict[str, Any]) -> int:
    """Run the options in ``given`` (flag keys, and ``"config"``); the exit code.
    Collective over ``MPI.COMM_WORLD``."""
    from ..comm import from_comm
    from ..train import StopRequest

    # The command's one communicator over the world (each run's configuration
    # duplicates it for its groups).
    comm = from_comm(None, "world")
    try:
        runs = plan_runs(given, comm.size)
    except UsageError as exc:
        return _usage(comm, exc)
    lost = False   # a rank was lost, and the survivors went on (fault tolerance)
    with StopRequest() as stop:
        for settings in runs:
            try:
                run = _setup(settings, comm)
            except UsageError as exc:
                return _ended(comm, _usage(comm, exc), lost)
            try:
                report = _train(run, stop)
            finally:
                for close in run.closers:
                    close()
            if report.recoveries:   # the next run starts over the survivors
                lost = True
                comm = from_comm(run.strategy.config.comm, "world")
            if report.stopped in _SIGNALS:
                return _ended(comm, EXIT_STOPPED, lost)
    return _ended(comm, 0, lost)


def _ended(comm: FlatComm, code: int, lost: bool) -> int:
    """``code``, or after a lost rank the end of the process with it (no
    ``MPI_Finalize``, which may wait for the dead rank:
    [`mpishard.comm.ulfm.exit_now`][mpishard.comm.ulfm.exit_now])."""
    if lost:
        from ..comm import ulfm

        comm.barrier()   # every survivor has printed its part
        ulfm.exit_now(code)
    return code


def _usage(comm: FlatComm, exc: UsageError) -> int:
    if comm.rank == 0:
        print(f"mpishard train: error: {exc}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _agreed(comm: FlatComm, what: str, fn: Callable[[], Any],
            errors: tuple[type[BaseException], ...], fix: str = "",
            fix_for: tuple[type[BaseException], ...] | None = None) -> Any:
    """``fn()`` on every rank; if it raised ``errors`` on any rank, a
    [`UsageError`][mpishard.errors.UsageError] with the lowest such rank's message on every rank.
    ``fix`` is appended to the message (only for ``fix_for`` errors, if given).
    Collective over ``comm``."""
    value, message = None, None
    try:
        value = fn()
    except errors as exc:
        if fix_for is not None and not isinstance(exc, fix_for):
            fix = ""
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        text = re.sub(r"^rank \d+: ", "", text)   # agree()'s prefix: every rank found it
        message = f"{what}: {text}{fix}"
    message = next((m for m in comm.allgather(message) if m is not None), None)
    if message is not None:
        raise UsageError(message)
    return value


# --- setting a run up -----------------------------------------------------------------

def _setup(s: Settings, comm: FlatComm) -> Run:
    """Data, model, strategy and checkpoint folder of one run. Collective over ``comm``.

    Raises:
        UsageError: on every rank, for a problem with the input (whatever was
            opened is closed again).
    """
    closers: list[Callable[[], None]] = []
    try:
        return _build(s, comm, closers)
    except UsageError:
        for close in closers:
            close()
        raise


def _build(s: Settings, comm: FlatComm, closers: list[Callable[[], None]]) -> Run:
    from ..config import ShardingConfiguration
    from ..errors import MpiShardError
    from ..parallel.overlap import describe_attach
    from ..parallel.repro import unit_rows_for

    dtype = np.dtype(s.dtype)
    xp, gpu = np, None
    if s.device == "cuda":   # before the data: a rank without a GPU stops the job here
        xp, gpu = _agreed(comm, "--device cuda", lambda: _gpu(comm, s.gpu_index),
                          (RuntimeError,))
    data, validation, what = _data(s, comm, dtype, closers)
    n_in, n_out = _widths(s, data)
    n_samples = len(data) if isinstance(data, Dataset) else len(data[0])
    steps = s.epochs * (n_samples // s.batch_size)
    warmup = s.warmup if s.warmup is not None else min(100, steps // 10)
    if warmup >= steps:
        raise UsageError(f"--warmup {warmup} must be below the {steps} planned steps")

    def build() -> tuple[Any, Any, Any]:
        config = ShardingConfiguration(comm, tensor_parallel_size=s.tp,
                                       pipeline_parallel_size=s.pp, data_parallel_size=s.dp,
                                       reproducible=s.reproducible,
                                       reproducible_sizes=s.reproducible_sizes,
                                       fault_tolerance=s.fault_tolerance, spares=s.spares)
        model = _model(s, config, dtype, n_in, n_out, xp)
        return config, model, _strategy(s, config, model, steps, warmup)

    # The library's own checks (heads or widths per tensor rank, layers per
    # stage, ...) raise on every rank alike: report them as bad input.
    config, model, strategy = _agreed(comm, "impossible layout", build,
                                      (MpiShardError, ValueError))
    closers.append(config.free)
    topo = config.topology
    name = "GPT" if s.example == "gpt" else "MLP"
    params = config.world.allreduce(_logical_parameters(config, model))
    shape = (f"d_model {s.d_model}, {s.layers} blocks, {s.heads} heads, context {s.seq_len}"
             if s.example == "gpt" else f"{n_in} -> {' -> '.join(map(str, s.hidden))} -> "
                                        f"{n_out}, {s.activation}")
    ranks = f"{topo.world} rank(s)" + (f" + {s.spares} spare(s)" if s.spares else "")
    layout = (f"{s.strategy} on {ranks}" if s.strategy != "hybrid" else
              f"hybrid on {ranks}: tp {topo.tp} x pp {topo.pp} x dp "
              f"{topo.dp}, {s.micro_batches} micro-batches, {s.schedule}, "
              f"{s.data_parallel} across replicas"
              + (f" (stage gradient {s.stage_gradient})" if s.data_parallel == "zero3"
                 else ""))
    where = ("" if gpu is None else
             f", on {gpu.name} GPUs (rank 0: GPU {gpu.device}, {gpu.why})")
    repro = ""
    if s.reproducible:
        units = s.batch_size // unit_rows_for(s.batch_size, None, config.reproducible_sizes)
        repro = f", reproducible ({units} units a batch)"
    description = [
        f"{name} of {params:,} parameters ({shape}) on {what}",
        f"{layout}{where}{repro}; global batch "
        f"{s.batch_size}, {s.epochs} epochs = {steps} steps, "
        f"{s.optimizer} lr {s.lr:g}, cosine schedule",
        describe_attach(strategy.core),   # rank 0's attach: its time, the overlap decision
    ]
    run = Run(s, config, model, strategy, data, validation, description, closers=closers)
    _checkpoints(run, comm)
    return run


def _data(s: Settings, comm: FlatComm, dtype: np.dtype,
          closers: list[Callable[[], None]]) -> tuple[Any, Any, str]:
    """(training data, validation pair or None, a phrase saying what it is)."""
    if s.example == "gpt":
        from ..examples.text import text_dataset

        (x, y), validation = _agreed(
            comm, "the gpt example", lambda: text_dataset(s.samples, s.seq_len, _VALIDATION_GPT,
                                                           seed=s.seed),
            (OSError,), "; this Python has no standard-library sources: use --example burgers")
        import platform

        return (x, y), validation, (f"{s.samples:,} windows of the Python "
                                    f"{platform.python_version()} standard library's source")
    if s.example == "burgers":
        from ..examples import burgers_dataset

        x, y = burgers_dataset(s.samples + _VALIDATION_BURGERS, seed=s.seed, dtype=dtype)
        cut = -_VALIDATION_BURGERS
        return ((x[:cut], y[:cut]), (x[cut:], y[cut:]),
                f"{s.samples:,} solutions of the 1-D Burgers equation (u(x,0) -> u(x,0.2))")
    from ..data import HDF5Dataset, parse_data_spec

    try:
        path, inputs = parse_data_spec(s.data)
    except ValueError as exc:
        raise UsageError(f"--data: {exc}") from None
    dataset = _agreed(comm, "--data", lambda: HDF5Dataset(path, inputs, s.targets, comm=comm),
                      (OSError, ValueError),
                      "; give an existing HDF5 file and dataset as FILE.h5:/group/dataset",
                      fix_for=(FileNotFoundError,))
    closers.append(dataset.close)
    if dataset.target_dtype.kind != "f":
        raise UsageError(f"--data: targets of dtype {dataset.target_dtype} (classification) "
                         f"are not supported; store floating-point targets")
    if s.batch_size > len(dataset):
        raise UsageError(f"--batch-size {s.batch_size} is larger than the {len(dataset)} "
                         f"samples in {s.data}")
    rule = f"targets {s.targets}" if s.targets else "each row's target is the next row"
    stored = {np.dtype(d) for d in (dataset.input_dtype, dataset.target_dtype)
              if np.dtype(d).kind == "f"}
    # The model's dtype is --dtype's (float32 by default), whatever the file holds:
    # the header says so where the two differ, and how to train in the file's.
    cast = "" if stored <= {dtype} else (
        f"; stored as {'/'.join(sorted(d.name for d in stored))}, trained as {dtype.name}"
        + (f": --dtype {max(stored, key=lambda d: d.itemsize).name} trains in the file's "
           f"precision" if max(d.itemsize for d in stored) > dtype.itemsize else ""))
    return dataset, None, (f"{len(dataset):,} samples of {s.data} ({rule}, read in "
                           f"parallel{cast})")


def _gpu(comm: FlatComm, index: int | None) -> tuple[Any, Any]:
    """CuPy with this rank's GPU current, and the choice. Collective over ``comm``."""
    from ..comm import choose_gpu

    return choose_gpu(comm, index)


def _widths(s: Settings, data: Any) -> tuple[int, int]:
    if s.example == "gpt":
        return 0, 0
    if isinstance(data, Dataset):
        return (int(np.prod(data.input_shape)), int(np.prod(data.target_shape)))
    return data[0].shape[1], data[1].shape[1]


def _model(s: Settings, config: Any, dtype: np.dtype, n_in: int, n_out: int,
           xp: Any = np) -> Any:
    from ..examples.text import VOCAB_SIZE
    from ..nn import GPT, MLP, ParallelMLP

    if s.example == "gpt":
        factory = functools.partial(GPT, VOCAB_SIZE, s.seq_len, s.d_model, s.heads, s.layers,
                                    dtype=dtype, seed=s.seed, xp=xp)
    else:
        sizes = [n_in, *s.hidden, n_out]
        cls = ParallelMLP if s.strategy == "hybrid" else MLP
        factory = functools.partial(cls, sizes, activation=s.activation, loss="mse",
                                    dtype=dtype, seed=s.seed, xp=xp)
    if s.strategy == "zero3":   # built in shards: nothing whole on any rank
        from ..flat import ParameterShard

        dp = config.groups.dp
        return factory(shard=ParameterShard(dp.rank, dp.size))
    if s.strategy != "hybrid":
        return factory()
    from ..nn import HybridShardedModel

    shard = None
    if s.data_parallel == "zero3":   # each stage built in shards over its data group
        from ..flat import ParameterShard

        shard = ParameterShard(config.groups.dp.rank, config.groups.dp.size)
    return HybridShardedModel(factory, config, micro_batches=s.micro_batches,
                              schedule=s.schedule, shard=shard)


def _strategy(s: Settings, config: Any, model: Any, steps: int, warmup: int) -> Any:
    from ..optim import get_optimizer
    from ..optim.schedules import CosineSchedule
    from ..strategies import STRATEGIES, HybridShardedOptimizer

    extra = {} if s.weight_decay is None else {"weight_decay": s.weight_decay}
    optimizer = get_optimizer(s.optimizer, lr=s.lr, **extra)
    kwargs = dict(model=model, accumulation_steps=s.accumulation_steps,
                  max_grad_norm=s.max_grad_norm,
                  schedule=CosineSchedule(total_steps=max(steps, 1), warmup_steps=warmup))
    if s.strategy == "hybrid":
        if s.data_parallel == "zero3":
            kwargs["stage_gradient"] = s.stage_gradient
        return HybridShardedOptimizer(optimizer, config, data_parallel=s.data_parallel, **kwargs)
    return STRATEGIES[s.strategy].public_class(optimizer, config, **kwargs)


def _logical_parameters(config: Any, model: Any) -> int:
    """This rank's part of the model's parameter count: data replica 0 counts
    its slices of split tensors, and tensor rank 0 the replicated ones too."""
    from ..nn.shards import owned_ranges, tensor_shards

    where = config.groups.coordinates
    if where.dp != 0:
        return 0
    return sum(len(r) for r in owned_ranges(model.layout, tensor_shards(model), where.tp))


def _async_checkpoints(s: Settings) -> bool:
    """``--async-checkpoints``, or its default: on, for every strategy (measured
    faster for DDP, and for ZeRO-3 in the run of 2026-11-28, whose windows
    contradict the single slower sample before it: docs/guide/checkpoints.md). Pure."""
    if s.async_checkpoints is not None:
        return bool(s.async_checkpoints)
    return True


def _checkpoints(run: Run, comm: FlatComm) -> None:
    """The run's checkpoint folder, and the resume from it. Collective over ``comm``."""
    from ..checkpoint import CheckpointManager, list_checkpoints, load_checkpoint
    from ..errors import CheckpointError, CheckpointWarning

    s = run.settings
    explicit = s.checkpoint_dir is not None
    folder = s.checkpoint_dir if explicit else os.path.join(s.run_dir, "checkpoints")
    run.manager = manager = CheckpointManager(folder, keep=s.keep,
                                              async_=_async_checkpoints(s))
    path = None
    if s.resume is True:
        path = comm.bcast(manager.latest() if comm.rank == 0 else None, root=0)
        if path is None and comm.rank == 0:
            print(f"[{s.run}] no checkpoint in {manager.folder}: starting from step 0",
                  flush=True)
    elif s.resume:
        path = s.resume
    else:
        found = comm.bcast(list_checkpoints(folder) if comm.rank == 0 else None, root=0)
        if found and explicit:
            raise UsageError(f"--checkpoint-dir {folder} already holds checkpoints (the latest "
                             f"at step {found[-1][0]}): pass --resume to continue that run, "
                             f"or choose another folder")
        if found and comm.rank == 0:
            # Our own output folder, from an earlier run: a fresh run replaces it,
            # as it replaces metrics.jsonl (an older step would outlive the new ones).
            for _, old in found:
                os.remove(old)
        comm.barrier()
    if path is None:
        return
    fix = ("; resume with the settings of the run that wrote it (model sizes, --dtype, "
           "--optimizer, --samples), or start afresh with another --checkpoint-dir")

    def load() -> Any:
        # What differs from the file is said under the run's header (_resume_notes),
        # one line each, not as a warning with its source line.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            return load_checkpoint(path, run.model, run.strategy)

    info = _agreed(comm, "--resume", load, (CheckpointError, FileNotFoundError, OSError), fix)
    data = info.data or {}
    n = len(run.data) if isinstance(run.data, Dataset) else len(run.data[0])
    if data.get("batch_size", s.batch_size) != s.batch_size:
        raise UsageError(f"--resume: {path} was written with --batch-size {data['batch_size']}, "
                         f"this run has {s.batch_size}; resume with --batch-size "
                         f"{data['batch_size']}")
    if data.get("num_samples", n) != n:
        raise UsageError(f"--resume: {path} was written for {data['num_samples']} samples, "
                         f"this run has {n}{fix}")
    run.resumed_from = path
    run.resume_notes = _resume_notes(run, info)


def _resume_notes(run: Run, info: Any) -> list[str]:
    """What this run takes from its own settings rather than from the checkpoint
    it resumes, one line each. The learning-rate schedule is the one --epochs
    plans (a longer run decays over its new length; keeping the file's would
    train the added steps at its final rate, 0): its line says the jump."""
    from ..checkpoint.compare import schedule_text

    s, strategy = run.settings, run.strategy
    mine = strategy.schedule.to_dict()
    notes = [f"kept from this run, not the checkpoint: "
             f"{note.replace(' in the strategy', ' in this run')}" for note in info.notes
             if not note.startswith("schedule")]
    if info.schedule is not None and info.schedule != mine:
        before = "?" if info.lr is None else f"{info.lr:.3g}"
        notes.append(f"learning-rate schedule: this run's --epochs {s.epochs} plans "
                     f"{schedule_text(mine)}; the checkpoint's was "
                     f"{schedule_text(info.schedule)}: the learning rate goes from "
                     f"{before} to {strategy.current_lr():.3g} at step {strategy.step_count}")
    return notes


# --- training and the summary -------------------------------------------------------------

def _train(run: Run, stop: StopRequest) -> TrainResult:
    """Train one run and print its summary on rank 0. Collective over the run's world."""
    from ..train import (
        Checkpointing,
        Reporting,
        Sampling,
        evaluate,
        evaluation_group,
        interactive_output,
        peak_rss_bytes,
        run_training,
    )

    s, world = run.settings, run.config.world
    rank0 = world.rank == 0 and not run.config.is_spare   # a spare's world is itself
    if rank0:
        print(f"== {s.run}: {run.description[0]}", flush=True)
        for line in run.description[1:]:
            print(f"   {line}", flush=True)
        if run.resumed_from:
            print(f"   resumed from {run.resumed_from} at step {run.strategy.step_count}",
                  flush=True)
        for note in run.resume_notes:
            print(f"   {note}", flush=True)
    # Not on a spare: its model is a placeholder (a 3D stage's pipeline has no peers).
    start_val = (evaluate(run.model, *run.validation,
                          group=evaluation_group(run.strategy.core))
                 if run.validation is not None and not run.config.is_spare else None)
    progress = s.progress if s.progress is not None else (rank0 and interactive_output())
    topo = run.config.topology
    report = run_training(
        run.strategy.core, run.model, run.data, s.epochs, s.batch_size,
        sampling=Sampling(seed=s.seed), max_steps=s.max_steps, stop=stop,
        reporting=Reporting(
            progress=bool(progress), print_every=max(1, s.epochs // 10), label=s.run,
            log_every=s.log_every, metrics_path=s.metrics_path,
            append_metrics=run.resumed_from is not None, validation=run.validation,
            start_record={"run": s.run, "model": run.description[0], "strategy": s.strategy,
                          "world_size": world.size, "dp": topo.dp, "tp": topo.tp,
                          "pp": topo.pp, "resumed_from": run.resumed_from,
                          "start_val_loss": start_val}),
        checkpointing=Checkpointing(run.manager, s.checkpoint_every))
    if report.spare == "unused":   # a spare rank (--spares), released: nothing to report
        return report
    world = run.strategy.config.world   # the survivors' after a lost rank
    rank0 = world.rank == 0
    run.strategy.verify_in_sync()
    memory = world.gather((peak_rss_bytes(), run.strategy.memory_report()), root=0)
    if rank0:
        _summary(run, report, start_val, memory)
    return report


def _shown(path: str) -> str:
    """``path`` relative to the working folder when it is below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _summary(run: Run, report: TrainResult, start_val: float | None,
             memory: list[tuple[int, dict[str, int]]]) -> None:
    from ..parallel.memory import PHASES

    s = run.settings
    mib = 2.0 ** 20
    losses = report.losses
    if report.stopped in _SIGNALS:
        head = f"{s.run} stopped by {report.stopped} at step {report.last_step}"
    elif report.stopped == "max_steps":
        head = f"{s.run} stopped at --max-steps {s.max_steps}"
    else:
        head = f"{s.run} done"
    parts = []
    if losses:
        parts.append(f"loss {losses[0]:.4f} -> {report.final_loss:.4f}")
    if start_val is not None:
        ratio = start_val / report.val_loss if report.val_loss > 0 else float("inf")
        parts.append(f"validation {start_val:.4f} -> {report.val_loss:.4f} ({ratio:.1f}x lower)")
    parts.append(f"{report.steps} steps in {report.seconds:.1f} s, "
                 f"{report.samples_per_second:,.0f} samples/s")
    print(f"{head}: {', '.join(parts)}")
    for rec in report.recoveries:
        print(f"   recovered in place at step {rec['step']}: lost world rank(s) "
              f"{', '.join(map(str, rec['lost_ranks']))}, went on with {rec['world_size']} "
              f"({rec['seconds']:.2f} s)")
    rss = ", ".join(f"{r / mib:.0f}" for r, _ in memory)
    state = ", ".join(f"{t['peak'] / mib:.2f}" for _, t in memory)
    print(f"   memory per rank, MiB: peak RSS {rss}; training state {state}")
    phases = [(p, max(t.get(f"rss_peak_{p}", 0) for _, t in memory)) for p in PHASES]
    print("   peak RSS by phase, MiB (the most over ranks): "
          + ", ".join(f"{p} {b / mib:.0f}" for p, b in phases if b))
    if report.checkpoint:
        print(f"   checkpoint: {_shown(report.checkpoint)}")
    print(f"   metrics:    {s.metrics_path}  (mpishard plot {s.metrics_path} -o "
          f"{os.path.join(s.run_dir, 'loss.png')})")
    if report.stopped in _SIGNALS:
        print(f"   exit code {EXIT_STOPPED}: " + ("resume with the same command and --resume"
                                              if report.checkpoint else
                                              "no checkpoint, a restart begins at step 0"))
    sys.stdout.flush()
