"""Character-level training text that ships with Python: the standard library's source.

Nothing is downloaded. The text is the concatenation of the public top-level
modules of the running interpreter's standard library (``*.py`` files directly
in ``sysconfig.get_paths()["stdlib"]`` whose names do not start with ``_``, in
sorted order; the private ones include machine-generated files such as
``_sysconfigdata_*.py``), cut at a fixed number of characters. For a given
Python version the text, and so the dataset, is the same on every machine.

Characters map to a fixed vocabulary of `VOCAB_SIZE` ids, independent of
the text: ``0`` is newline, ``1 .. 95`` printable ASCII (space to ``~``), and
``96`` any other character (tabs, non-ASCII). A language model's samples are
windows of ``seq_len + 1`` characters: the input is the first ``seq_len``, the
target the same window shifted by one.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

__all__ = ["VOCAB_SIZE", "decode", "encode", "stdlib_files", "stdlib_text", "text_dataset"]

#: Newline, the 95 printable ASCII characters, and one id for everything else.
VOCAB_SIZE = 97
_OTHER = VOCAB_SIZE - 1


def stdlib_files(stdlib: str | None = None) -> list[str]:
    """The standard library's public top-level modules, sorted by name."""
    folder = stdlib or sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(folder)
                   if n.endswith(".py") and not n.startswith("_"))
    return [os.path.join(folder, n) for n in names]


def stdlib_text(chars: int = 1_000_000, stdlib: str | None = None) -> str:
    """The first ``chars`` characters of the concatenated public stdlib modules.

    Raises:
        FileNotFoundError: the standard library holds fewer characters (a
            stripped-down Python installation without its ``.py`` sources).
    """
    parts, have = [], 0
    for path in stdlib_files(stdlib):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(text)
        have += len(text)
        if have >= chars:
            return "".join(parts)[:chars]
    raise FileNotFoundError(
        f"the standard library at {stdlib or sysconfig.get_paths()['stdlib']} holds "
        f"{have} characters of Python source, fewer than the {chars} asked for")


def encode(text: str) -> np.ndarray:
    """Character ids (uint8) of ``text`` in the fixed vocabulary."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(codes.shape, _OTHER, dtype=np.uint8)
    printable = (codes >= 32) & (codes <= 126)
    ids[printable] = (codes[printable] - 31).astype(np.uint8)
    ids[codes == 10] = 0
    return ids


def decode(ids: np.ndarray) -> str:
    """The text of character ids; id 96 (any other character) reads as ``?``."""
    table = np.array(["\n"] + [chr(c) for c in range(32, 127)] + ["?"])
    return "".join(table[np.asarray(ids, dtype=np.int64)])


def text_dataset(samples: int = 4096, seq_len: int = 64, validation: int = 256,
                 seed: int = 0, stdlib: str | None = None
                 ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``((x, y), (x_val, y_val))``: windows of the stdlib text for a character model.

    The training windows start at ``samples`` positions drawn (with ``seed``)
    from the first 90 % of the text, the validation windows at ``validation``
    evenly spaced positions of the last 10 %, so no validation character is
    trained on. ``x`` and ``y`` are ``int32`` arrays ``(samples, seq_len)``;
    ``y`` is ``x`` shifted one character ahead. The text is
    ``max(400_000, 2 * samples * seq_len)`` characters long.
    """
    if samples < 1 or seq_len < 1 or validation < 1:
        raise ValueError(f"expecting positive sizes, got samples={samples}, "
                         f"seq_len={seq_len}, validation={validation}")
    ids = encode(stdlib_text(max(400_000, 2 * samples * seq_len), stdlib))
    split = int(len(ids) * 0.9)
    window = seq_len + 1
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, split - window, samples)
    val_starts = np.linspace(split, len(ids) - window, validation).astype(np.int64)

    def windows(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = ids[at[:, None] + np.arange(window)].astype(np.int32)
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])

    return windows(starts), windows(val_starts)
