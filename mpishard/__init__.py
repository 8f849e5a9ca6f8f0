"""mpishard: MPI-native DDP, ZeRO-2, ZeRO-3, tensor, pipeline and elastic training.

For models whose parameters live in one flat NumPy or CuPy vector.

Importing the package is cheap and does not initialise MPI: the names below are
loaded on first use (so the ``mpishard run`` agent, which starts ``mpirun``,
never becomes an MPI process itself).
"""

from ._threads import limit_threads as _limit_threads

_limit_threads()   # before anything imports NumPy: see mpishard/_threads.py

from ._version import __version__  # noqa: E402

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "CommunicationError",
    "DataPositionWarning",
    "HandOver",
    "InexactRecoveryWarning",
    "MpiShardError",
    "NonFiniteError",
    "ParamLayout",
    "ParameterShard",
    "ProcessGroups",
    "Range",
    "ShardingConfiguration",
    "Topology",
    "TopologyError",
    "__version__",
]

_WHERE = {
    "CheckpointError": "errors", "CommunicationError": "errors", "MpiShardError": "errors",
    "NonFiniteError": "errors", "CheckpointWarning": "errors", "HandOver": "errors",
    "DataPositionWarning": "errors", "InexactRecoveryWarning": "errors",
    "TopologyError": "errors", "ParamLayout": "flat", "Range": "flat",
    "ParameterShard": "flat",
    "ProcessGroups": "comm.groups", "ShardingConfiguration": "config", "Topology": "topology",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpishard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
