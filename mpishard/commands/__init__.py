"""The ``mpishard`` subcommands that run jobs: ``train`` (on N ranks) and ``plot`` (one process)."""

from .config import UsageError
from .plot import add_plot_parser
from .plot import main as plot_main
from .train import add_train_parser
from .train import main as train_main

__all__ = ["UsageError", "add_plot_parser", "add_train_parser", "plot_main", "train_main"]
