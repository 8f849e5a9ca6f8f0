"""Deprecated: ``HDF5Dataset`` lives in [`mpishard.data`][mpishard.data]
(``mpishard.data.hdf5``)."""

from ._deprecated import forward_names
from .data import hdf5 as _hdf5

# Nothing is defined here: the names are read from their new homes, with a warning.
__all__: list[str] = []
_MOVED = ("HDF5Dataset", "parse_data_spec")

__getattr__ = forward_names(__name__, {name: (_hdf5, name) for name in _MOVED})
