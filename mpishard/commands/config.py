"""The settings of ``mpishard train``: one table of options for the flags and the TOML file.

Every option is a flag (``--batch-size``) and a key of the ``--config`` TOML
file (``batch_size``; ``batch-size`` is accepted too). Values come, lowest
first, from the built-in defaults, the example's defaults (the GPT and the
Burgers surrogate want different learning rates and batch sizes), the TOML
file, and the flags. Pure: no MPI here, so it is tested without ``mpirun``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..errors import UsageError
from ..strategies.registry import STRATEGIES

__all__ = ["EXAMPLES", "OPTIONS", "Option", "Settings", "UsageError", "build_parser", "check",
           "load_toml", "parse_args", "plan_runs"]


@dataclass(frozen=True)
class Option:
    """One setting: its key, value type, default and help."""

    key: str
    type: str            # "int", "float", "str", "bool", "ints", "resume"
    default: Any
    help: str
    group: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


_G_RUN, _G_PAR, _G_MODEL, _G_OPT, _G_CKPT = (
    "what to train", "parallel layout", "model", "optimizer and schedule",
    "checkpoints and output")

#: Every option of ``mpishard train`` (a default of None: the example's, or none).
OPTIONS: tuple[Option, ...] = (
    Option("example", "str", "all", "built-in job: gpt (a GPT on the Python standard "
           "library's source), burgers (an MLP surrogate of the 1-D Burgers equation) or "
           "all (both, in turn)", _G_RUN, ("gpt", "burgers", "all")),
    Option("data", "str", None, "train an MLP on an HDF5 file instead: FILE.h5:/group/inputs "
           "(without --targets, row i+1 is the target of row i: a time series)", _G_RUN,
           metavar="FILE.h5:/DATASET"),
    Option("targets", "str", None, "the targets dataset in the --data file", _G_RUN,
           metavar="/DATASET"),
    Option("samples", "int", None, "dataset size of the built-in examples "
           "(gpt: text windows, 4096; burgers: solutions, 8192)", _G_RUN),
    Option("epochs", "int", None, "epochs (gpt 3, burgers 30, data 10)", _G_RUN),
    Option("batch_size", "int", None, "global batch size, split across the data-parallel "
           "ranks (gpt 32, burgers 256, data 64)", _G_RUN),
    Option("max_steps", "int", None, "stop after this many optimizer steps in all "
           "(a checkpoint is written there)", _G_RUN),
    Option("seed", "int", 0, "seed of the initial weights, the data and the shuffle", _G_RUN),
    Option("device", "str", "cpu", "where the model, its optimizer state and the batches "
           "live: cpu (NumPy) or cuda (CuPy; each rank takes GPU local rank %% GPUs it "
           "sees, see mpishard info)", _G_RUN, ("cpu", "cuda")),
    Option("gpu_index", "int", None, "with --device cuda: the GPU of every rank, among "
           "those it sees (CUDA_VISIBLE_DEVICES), instead of local rank %% GPUs", _G_RUN,
           metavar="N"),
    Option("strategy", "str", "ddp", "; ".join(f"{e.name}: {e.summary}"
                                               for e in STRATEGIES.values())
           + "; or hybrid: tensor x pipeline x data parallel (give --tp and --pp)", _G_PAR,
           (*STRATEGIES, "hybrid")),
    Option("tp", "int", 1, "tensor-parallel size (hybrid)", _G_PAR),
    Option("pp", "int", 1, "pipeline stages (hybrid)", _G_PAR),
    Option("dp", "int", -1, "data-parallel size; -1: the ranks left, world / (tp * pp)", _G_PAR),
    Option("data_parallel", "str", "ddp", "how the hybrid's data-parallel group syncs: "
           + ", ".join(STRATEGIES), _G_PAR, tuple(STRATEGIES)),
    Option("micro_batches", "int", 1, "pipeline micro-batches per step (hybrid)", _G_PAR),
    Option("stage_gradient", "str", "sharded", "with --data-parallel zero3 (hybrid): "
           "sharded (each micro-batch's gradient reduced to the shards during its backward: "
           "no whole stage gradient, micro-batches x the gradient traffic) or whole (the "
           "micro-batches summed in the stage's whole gradient, reduced once a step)",
           _G_PAR, ("sharded", "whole")),
    Option("schedule", "str", "1f1b", "pipeline schedule: 1f1b or gpipe (hybrid)", _G_PAR,
           ("1f1b", "gpipe")),
    Option("accumulation_steps", "int", 1, "micro-batches accumulated per step on each "
           "data-parallel rank", _G_PAR),
    Option("reproducible", "bool", False, "bitwise-reproducible training: the same "
           "parameters and losses at any data-parallel size, strategy and pipeline split "
           "(slower; the global batch is cut into gcd(batch, 24) units)", _G_PAR),
    Option("reproducible_sizes", "ints", None, "with --reproducible: the data-parallel "
           "sizes (times accumulation steps) whose bits must agree, comma-separated, e.g. "
           "1,2,4; the batch is then cut into gcd(batch, lcm) units instead of "
           "gcd(batch, 24): fewer, larger units, faster", _G_PAR),
    Option("fault_tolerance", "str", "auto", "survive a lost rank in place: ulfm (an error "
           "where the job is not under Open MPI 5's mpirun --with-ft ulfm), off, or auto "
           "(ulfm where available). ddp, zero2 and zero3 go on over the survivors; hybrid "
           "with 2 or more data-parallel replicas drops each replica that lost a rank (its "
           "other ranks exit 0) and goes on with the whole ones; hybrid with no whole "
           "replica left exits 75 for mpishard run to relaunch", _G_PAR,
           ("auto", "ulfm", "off")),
    Option("spares", "int", None, "the last N ranks of the job are spare ranks (needs "
           "fault tolerance, mpirun --with-ft ulfm): they wait, sleeping, and take the "
           "place and state of lost ranks so the job goes on at full size (ddp, zero2, "
           "zero3, and hybrid layouts with 2 or more data-parallel replicas); released "
           "at the end (default: mpishard run --spares, else 0)", _G_PAR,
           metavar="N"),
    Option("d_model", "int", 64, "GPT width", _G_MODEL),
    Option("heads", "int", 4, "GPT attention heads", _G_MODEL),
    Option("layers", "int", 2, "GPT transformer blocks", _G_MODEL),
    Option("seq_len", "int", 64, "GPT context length, in characters", _G_MODEL),
    Option("hidden", "ints", None, "MLP hidden widths, comma-separated (burgers 256,256; "
           "data 128,128)", _G_MODEL, metavar="N,N,..."),
    Option("activation", "str", "gelu", "MLP activation: relu, gelu or tanh", _G_MODEL,
           ("relu", "gelu", "tanh")),
    Option("dtype", "str", "float32", "parameter dtype: float32 or float64 (also the dtype "
           "--data is trained in, whatever the file stores: the header says so)", _G_MODEL,
           ("float32", "float64")),
    Option("optimizer", "str", "adamw", "sgd, adam or adamw", _G_OPT, ("sgd", "adam", "adamw")),
    Option("lr", "float", None, "peak learning rate (gpt 3e-3, burgers 2e-3, data 1e-3)",
           _G_OPT),
    Option("weight_decay", "float", None, "weight decay (default: the optimizer's, AdamW 0.01, "
           "SGD and Adam 0)", _G_OPT),
    Option("warmup", "int", None, "warm-up steps before the cosine decay "
           "(default: a tenth of the steps, at most 100)", _G_OPT),
    Option("max_grad_norm", "float", None, "clip the global gradient norm (gpt 1.0)", _G_OPT),
    Option("out", "str", "out", "folder for each run's metrics.jsonl and checkpoints "
           "(OUT/<run>/)", _G_CKPT, metavar="DIR"),
    Option("checkpoint_dir", "str", None, "checkpoint folder (default OUT/<run>/checkpoints; "
           "with --example all, one subfolder per run)", _G_CKPT, metavar="DIR"),
    Option("checkpoint_every", "int", 0, "also write a checkpoint every N steps (0: only "
           "at the end and when stopped by a signal)", _G_CKPT, metavar="N"),
    Option("keep", "int", 3, "checkpoints kept in the folder", _G_CKPT),
    Option("async_checkpoints", "bool", None, "write checkpoints in the background: the "
           "step waits only for a copy of the state (default: on; "
           "--no-async-checkpoints: the synchronous save)", _G_CKPT),
    Option("resume", "resume", False, "continue from the latest checkpoint in the folder "
           "(or from FILE); with none there, start from scratch", _G_CKPT, metavar="FILE"),
    Option("progress", "bool", None, "a progress bar on rank 0 (default: when the output "
           "is a terminal)", _G_CKPT),
    Option("log_every", "int", 10, "steps per line of the metrics file", _G_CKPT),
)

_BY_KEY = {o.key: o for o in OPTIONS}

#: The built-in jobs' own defaults, applied beneath the TOML file and the flags.
EXAMPLES: dict[str, dict[str, Any]] = {
    "gpt": {"samples": 4096, "epochs": 3, "batch_size": 32, "lr": 3e-3, "max_grad_norm": 1.0},
    "burgers": {"samples": 8192, "epochs": 30, "batch_size": 256, "lr": 2e-3,
                "hidden": [256, 256]},
    "data": {"epochs": 10, "batch_size": 64, "lr": 1e-3, "hidden": [128, 128]},
}


@dataclass
class Settings:
    """Everything one run needs, resolved (see `OPTIONS` for each field)."""

    run: str
    example: str
    data: str | None
    targets: str | None
    samples: int | None
    epochs: int
    batch_size: int
    max_steps: int | None
    seed: int
    device: str
    gpu_index: int | None
    strategy: str
    tp: int
    pp: int
    dp: int
    data_parallel: str
    micro_batches: int
    stage_gradient: str
    schedule: str
    accumulation_steps: int
    reproducible: bool
    reproducible_sizes: list[int] | None
    fault_tolerance: str
    spares: int | None
    d_model: int
    heads: int
    layers: int
    seq_len: int
    hidden: list[int] | None
    activation: str
    dtype: str
    optimizer: str
    lr: float
    weight_decay: float | None
    warmup: int | None
    max_grad_norm: float | None
    out: str
    checkpoint_dir: str | None
    checkpoint_every: int
    keep: int
    async_checkpoints: bool
    resume: bool | str
    progress: bool | None
    log_every: int

    @property
    def run_dir(self) -> str:
        return os.path.join(self.out, self.run)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, "metrics.jsonl")


# --- the command line ------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """Errors become [`UsageError`][mpishard.errors.UsageError] (one line, rank 0 only); help prints
    on rank 0."""

    def error(self, message: str):   # noqa: D401 - argparse's API
        raise UsageError(f"{message} (see mpishard train --help)")

    def _print_message(self, message: str, file: Any = None) -> None:
        if _world_rank() == 0:
            super()._print_message(message, file)


def _world_rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


_DESCRIPTION = """\
Train a model on N MPI ranks with DDP, ZeRO-2 or 3D (tensor x pipeline x data)
parallelism:  mpirun -n N mpishard train [options]  (or srun --mpi=pmix).
With no options it trains a small GPT on the Python standard library's source,
then an MLP surrogate of the 1-D Burgers equation: nothing is downloaded.
Every option is also a key of the --config TOML file (batch_size = 64);
flags override the file."""

_EPILOG = """\
examples:
  mpirun -n 4 mpishard train --example gpt --strategy zero2
  mpirun -n 4 mpishard train --example gpt --strategy hybrid --tp 2 --pp 2 \\
      --micro-batches 4 --schedule 1f1b --data-parallel zero2
  mpirun -n 4 mpishard train --data flow.h5:/snapshots/u --epochs 20
  mpirun -n 2 mpishard train --example gpt --device cuda   # GPU local rank % GPUs
  mpirun -n 4 mpishard train --config run.toml --checkpoint-every 100 --resume
exit codes: 0 done; 2 bad input (one line on stderr); 75 stopped by SIGUSR1 or
SIGTERM after writing a checkpoint (requeue the job and pass --resume)."""


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``train`` arguments, added to ``parser`` (a subcommand's) or a new parser.

    Defaults are suppressed: the namespace holds only what was given, so that
    the TOML file and the examples' defaults can sit beneath the flags.
    """
    if parser is None:
        parser = _Parser(prog="mpishard train", description=_DESCRIPTION, epilog=_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE.toml", default=argparse.SUPPRESS,
                        help="read options from a TOML file (keys as the flags, with _ or -)")
    groups: dict[str, Any] = {}
    for o in OPTIONS:
        group = groups.get(o.group) or groups.setdefault(o.group,
                                                          parser.add_argument_group(o.group))
        kw: dict[str, Any] = {"dest": o.key, "default": argparse.SUPPRESS, "help": o.help}
        if o.type == "bool":
            group.add_argument(o.flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if o.type == "resume":
            group.add_argument(o.flag, nargs="?", const=True, metavar=o.metavar, **kw)
            continue
        kw["metavar"] = o.metavar or (o.key.upper() if o.choices is None
                                      else "{" + ",".join(o.choices) + "}")
        kw["type"] = {"int": int, "float": float, "str": str, "ints": _ints}[o.type]
        group.add_argument(o.flag, **kw)
    return parser


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expecting comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expecting comma-separated integers, got {text!r}")
    return values


# --- the TOML file ---------------------------------------------------------------

def load_toml(path: str) -> dict[str, Any]:
    """The options in the TOML file ``path``, checked against `OPTIONS`.

    Tables group keys for readability and are flattened: ``[model] d_model = 64``
    is ``d_model = 64``.

    Raises:
        UsageError: a missing or unreadable file, bad TOML, an unknown key (the
            message lists the valid ones), a value of the wrong type.
    """
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file; give the path of a TOML file") from None
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                flat[sub] = (f"{key}.{sub}", v)
        else:
            flat[key] = (key, value)
    out: dict[str, Any] = {}
    for key, (where, value) in flat.items():
        name = key.replace("-", "_")
        option = _BY_KEY.get(name)
        if option is None:
            valid = ", ".join(o.key for o in OPTIONS)
            raise UsageError(f"--config {path}: unknown key {where!r}; valid keys: {valid}")
        out[name] = _check_value(option, value, f"--config {path}: key {where!r}")
    return out


def _check_value(option: Option, value: Any, where: str) -> Any:
    t = option.type
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "resume": isinstance(value, (bool, str)),
        "ints": (isinstance(value, list) and value
                 and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
                or isinstance(value, str),
    }[t]
    names = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
             "resume": "true, false or a file name", "ints": "a list of integers"}
    if not ok:
        raise UsageError(f"{where} must be {names[t]}, got {value!r}")
    if t == "float":
        return float(value)
    if t == "ints" and isinstance(value, str):
        try:
            return _ints(value)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"{where}: {exc}") from None
    return value


# --- from what was given to the runs ------------------------------------------------

def parse_args(argv: Sequence[str] | None, world_size: int) -> list[Settings]:
    """The runs that ``mpishard train ARGV`` asks for on ``world_size`` ranks.

    Raises:
        UsageError: anything wrong with the flags, the TOML file or their
            combination, including a layout that does not fit ``world_size``.
    """
    given = vars(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv)))
    return plan_runs(given, world_size)


def plan_runs(given: dict[str, Any], world_size: int) -> list[Settings]:
    """Resolve flags (``given``, with an optional ``"config"`` path) into runs."""
    given = dict(given)
    from_file = load_toml(given.pop("config")) if "config" in given else {}
    for key, value in given.items():   # flags of a subparser are unchecked by argparse
        if key in _BY_KEY and _BY_KEY[key].choices and value not in _BY_KEY[key].choices:
            raise UsageError(_choice_message(_BY_KEY[key], value))
    user = {**from_file, **given}
    for key, value in from_file.items():
        option = _BY_KEY[key]
        if option.choices and value not in option.choices and key not in given:
            raise UsageError(_choice_message(option, value))
    if user.get("data") is not None:
        if user.get("example", "all") != "all":
            raise UsageError(f"--example {user['example']} and --data {user['data']} both "
                             f"given: train either a built-in example or your HDF5 data")
        names = ["data"]
    else:
        if user.get("targets") is not None:
            raise UsageError("--targets needs --data FILE.h5:/group/inputs")
        example = user.get("example", "all")
        names = ["gpt", "burgers"] if example == "all" else [example]
    if isinstance(user.get("resume"), str) and len(names) > 1:
        raise UsageError(f"--resume {user['resume']} names one checkpoint but --example all "
                         f"trains two models: add --example gpt or --example burgers")
    if names == ["data"] and user.get("samples") is not None:
        raise UsageError("--samples sizes the built-in examples; --data trains on every "
                         "sample of the file")
    runs = []
    for name in names:
        values = {o.key: o.default for o in OPTIONS}
        values.update(EXAMPLES[name])
        values.update(user)
        values["example"] = name
        if values["checkpoint_dir"] is not None and len(names) > 1:
            values["checkpoint_dir"] = os.path.join(values["checkpoint_dir"], name)
        known = {f.name for f in fields(Settings)}
        settings = Settings(run=name, **{k: v for k, v in values.items() if k in known})
        check(settings, world_size)
        runs.append(settings)
    return runs


def _choice_message(option: Option, value: Any) -> str:
    what = {"strategy": "strategy", "example": "example", "schedule": "pipeline schedule",
            "data_parallel": "data-parallel mode", "optimizer": "optimizer"}.get(option.key,
                                                                               option.key)
    return (f"unknown {what} {value!r}: choose one of {', '.join(option.choices)} "
            f"({option.flag})")


def check(s: Settings, world: int) -> None:
    """Check one run's settings against the world size (the same on every rank).

    Raises:
        UsageError: the first problem found, with the fix.
    """
    positive = ["epochs", "batch_size", "tp", "pp", "micro_batches", "accumulation_steps",
                "d_model", "heads", "layers", "seq_len", "keep", "log_every"]
    for key in positive + ["samples", "max_steps"]:
        value = getattr(s, key)
        if value is not None and value < (0 if key == "layers" else 1):
            raise UsageError(f"{_BY_KEY[key].flag} must be positive, got {value}")
    if s.gpu_index is not None:
        if s.device != "cuda":
            raise UsageError(f"--gpu-index {s.gpu_index} needs --device cuda (got --device "
                             f"{s.device})")
        if s.gpu_index < 0:
            raise UsageError(f"--gpu-index must be 0 or positive, got {s.gpu_index}")
    if s.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be 0 or positive, got {s.checkpoint_every}")
    if not s.lr > 0:
        raise UsageError(f"--lr must be positive, got {s.lr}")
    if s.hidden is not None and any(h < 1 for h in s.hidden):
        raise UsageError(f"--hidden widths must be positive, got {s.hidden}")
    if s.spares is None:   # mpishard.config.default_spares (not imported: MPI stays down)
        text = os.environ.get("MPISHARD_SPARES", "").strip()
        s.spares = int(text) if text.isdigit() else 0
    if not 0 <= s.spares < world:
        raise UsageError(f"--spares must be from 0 to {world - 1} (the ranks but one), "
                         f"got {s.spares}")
    world -= s.spares    # the layout is the training ranks'
    model_parallel = s.tp * s.pp > 1
    if s.strategy != "hybrid":
        if model_parallel:
            raise UsageError(f"--tp {s.tp} --pp {s.pp} need --strategy hybrid "
                             f"({_whole_model(s.strategy)})")
        if s.micro_batches != 1:
            raise UsageError(f"--micro-batches is the pipeline's (--strategy hybrid); with "
                             f"{s.strategy} use --accumulation-steps {s.micro_batches}")
    if world % (s.tp * s.pp) or (s.dp != -1 and s.dp * s.tp * s.pp != world):
        dp = f" x dp {s.dp}" if s.dp != -1 else ""
        raise UsageError(f"impossible layout: tp {s.tp} x pp {s.pp}{dp} does not fit {world} "
                         f"rank(s); choose sizes whose product divides {world} (--dp -1 "
                         f"takes the ranks left)")
    if s.dp < 1 and s.dp != -1:
        raise UsageError(f"--dp must be positive or -1, got {s.dp}")
    dp = world // (s.tp * s.pp)
    if s.example == "gpt":
        if s.d_model % s.heads:
            raise UsageError(f"--d-model {s.d_model} is not divisible by --heads {s.heads}")
        if s.heads % s.tp:
            raise UsageError(f"impossible layout: --heads {s.heads} cannot be split over --tp "
                             f"{s.tp} (attention is split by heads); use a tp that divides it")
        if s.pp > s.layers + 2:
            raise UsageError(f"impossible layout: --pp {s.pp} stages but the GPT has "
                             f"{s.layers + 2} layers (embedding, {s.layers} blocks, head); "
                             f"use --pp <= {s.layers + 2} or more --layers")
    elif s.hidden is not None and s.pp > 2 * len(s.hidden) + 1:
        raise UsageError(f"impossible layout: --pp {s.pp} stages but the MLP has "
                         f"{2 * len(s.hidden) + 1} layers; use --pp <= {2 * len(s.hidden) + 1}")
    parts = dp * s.accumulation_steps * s.micro_batches
    if s.batch_size % parts:
        raise UsageError(f"--batch-size {s.batch_size} does not split across {dp} data-parallel "
                         f"rank(s) x {s.accumulation_steps * s.micro_batches} micro-batch(es); "
                         f"use a multiple of {parts}")
    if s.samples is not None and s.batch_size > s.samples:
        raise UsageError(f"--batch-size {s.batch_size} is larger than --samples {s.samples}")


def _whole_model(strategy: str) -> str:
    """Why ``strategy`` (a name of the registry) splits no layer, as its entry says."""
    entry = STRATEGIES[strategy]
    if entry.cost.sharded_params:
        return (f"{strategy} shards the parameters over the data group but gathers every "
                f"layer whole, so each rank runs the whole model")
    return f"{strategy} holds the whole model on every rank"
