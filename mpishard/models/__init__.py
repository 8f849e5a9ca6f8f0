"""Model files: save, load and serialize a model with its architecture record.

The model-files layer, above [`mpishard.nn`][mpishard.nn] (which it rebuilds models of)
and [`mpishard.checkpoint`][mpishard.checkpoint] (whose sealed HDF5 format it writes). The models
themselves keep what needs no file (``train``, ``predict``, ``clone``,
``with_parameters``, ``get_model_metadata``, ``config``/``architecture``).
"""

from .architecture import build_architecture
from .files import (
    deserialize,
    load_model,
    load_model_into,
    model_from_bytes,
    save_model,
    serialize,
)

__all__ = [
    "build_architecture",
    "deserialize",
    "load_model",
    "load_model_into",
    "model_from_bytes",
    "save_model",
    "serialize",
]
