"""Order-independent sums: binned fixed-point words whose bits ignore order and grouping.

The idea is ReproBLAS's (Demmel and Nguyen), done with integers. Every value is
cut into *slices* at absolutely aligned bins of ``W`` bits: the slice of ``x``
at bin ``j`` is ``trunc(x / 2**(j*W)) - 2**W * trunc(x / 2**((j+1)*W))``, an
integer of magnitude below ``2**W`` (times ``2**(j*W)``). It depends only on
``x`` and ``j``. A vector is accumulated in chunks of `CHUNK` elements;
each chunk keeps ``K`` words per element, the sums of its values' slices at bins
``b, b-1, ..., b-K+1``, where ``b`` is the bin of the largest magnitude
deposited so far in that chunk. The words are float64 holding integers: while
their magnitude stays below ``2**53`` every addition is exact, so they are
*integer* sums, associative and commutative, and any order, any grouping and any
MPI reduction tree give the same bits. When a chunk's top bin rises by ``d``,
its words move down by ``d`` and the lowest ``d`` are dropped; since bins are
absolute, the words kept always hold the exact sum of every deposited value's
slices in the kept bins, whatever the order of the deposits. Across ranks:
``Allreduce(MAX)`` of the (small) per-chunk bins,
[`BinnedAccumulator.realign`][mpishard.reprosum.BinnedAccumulator.realign] to them, then a ``SUM``
reduction (or reduce-scatter) of the words.

Error bound against the exact sum ``S`` of ``N`` deposits of one element (chunk
top bin ``b``, ``e`` the frexp exponent of the chunk's largest deposited
magnitude ``M``, so ``2**(e-1) <= M < 2**e <= 2**((b+1)W)``): each deposit drops
its part below bin ``b-K+1`` (truncation, less than ``2**((b-K+1)W) <
2**(e-(K-1)W) <= 2 M 2**(-(K-1)W)``), and the conversion back to floating point
rounds twice in float64 and once to the output type, so::

    |result - S| <= ulp_out(S) + 2**-51 * sum|x_i| + N * 2 * M * 2**(-(K-1)*W)

With ``W = 38`` the last term is ``N * M * 2**-37`` for float32 (``K = 2``) and
``N * M * 2**-75`` for float64 (``K = 3``): per deposit, below float32 rounding
for an element as small as ``2**-12`` of its chunk's largest. Headroom:
``2**(53-W) = 2**15`` deposits per element over all ranks (32768 units of work
in one step; [`BinnedAccumulator`][mpishard.reprosum.BinnedAccumulator] refuses more).
``tests/unit/test_reprosum.py`` checks the bound against ``math.fsum``. Chunks restart at every
segment (a model's tensor), so a tensor's bits do not depend on where it sits in the vector.

Pure: no MPI here; the callers reduce `BinnedAccumulator.bins` (MAX) and
`BinnedAccumulator.words` (SUM) over their group. NumPy or CuPy via ``xp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .backend import array_namespace

__all__ = [
    "BLOCK_ELEMENTS",
    "CHUNK",
    "EMPTY_BIN",
    "NORM_WORDS",
    "NORM_WORD_BITS",
    "WORD_BITS",
    "BinnedAccumulator",
    "ChunkGrid",
    "ScalarSum",
    "bin_of",
    "fixed_bin_sum",
    "shift_words",
    "words_for",
    "words_to_float",
]

#: Bits per slice of the vector accumulator (headroom 2**(53 - WORD_BITS) deposits).
WORD_BITS = 38
#: Elements that share one bin.
CHUNK = 128
#: The bin of a chunk that holds nothing yet (below any finite value's bin).
EMPTY_BIN = -(1 << 20)
#: Elements of the working block of a deposit on the host: two float64 scratch
#: blocks of 256 KiB instead of two of the vector's size (1.6x faster than whole
#: vectors measured here, the passes staying in the cache, and 16 bytes per
#: element less memory).
BLOCK_ELEMENTS = 32768
#: Bits and words of `fixed_bin_sum` (a sum of up to 2**33 values, such as
#: a gradient's squares: 40 bits kept below the largest).
NORM_WORD_BITS = 20
NORM_WORDS = 3


# The host deposit's fast paths (integer maximum of magnitudes, one scalar scale
# per block of one bin); False runs the general ones (the tests compare the bits).
_FAST = True
# Integer type and mask clearing the sign bit, per float item size (see _block_amax).
_BITS = {4: (np.dtype(np.int32), 0x7FFFFFFF), 8: (np.dtype(np.int64), 0x7FFFFFFFFFFFFFFF)}


def words_for(dtype: Any) -> int:
    """Words per element: 2 for float32 (at least 37 bits kept below the chunk's
    largest value), 3 for float64 (at least 75)."""
    return 3 if np.dtype(dtype).itemsize >= 8 else 2


def bin_of(magnitude: float, word_bits: int = WORD_BITS) -> int:
    """The smallest bin ``b`` with ``magnitude < 2**((b+1)*word_bits)``; ``EMPTY_BIN`` for 0."""
    if magnitude == 0.0:
        return EMPTY_BIN
    if not math.isfinite(magnitude):
        raise ValueError(f"expecting a finite magnitude, got {magnitude}")
    return (math.frexp(magnitude)[1] - 1) // word_bits


def shift_words(words: Any, rise: int) -> None:
    """Move words (first axis: top bin first) down ``rise`` bins in place, dropping the lowest."""
    k = words.shape[0]
    if rise <= 0:
        return
    if rise >= k:
        words[...] = 0
        return
    words[rise:] = words[:k - rise].copy()
    words[:rise] = 0


def words_to_float(words: Sequence[float], top_bin: int, word_bits: int = WORD_BITS) -> float:
    """The value ``sum(words[k] * 2**((top_bin - k) * word_bits))``, rounded (Horner in float64)."""
    if top_bin == EMPTY_BIN:
        return 0.0
    acc = 0.0
    for w in words:
        acc = acc * 2.0 ** word_bits + float(w)
    return math.ldexp(acc, (top_bin - len(words) + 1) * word_bits)


def fixed_bin_sum(x: Any, top_bin: int, scratch: Any, slices: Any, *, square: bool = False,
                  words: int = NORM_WORDS, word_bits: int = NORM_WORD_BITS) -> list[float]:
    """The words of ``sum(x)`` (``square``: of ``sum(x**2)``, each square rounded to
    float64) at a bin given by the caller: ``words`` exact integer
    sums (as floats) of the elements' slices at bins ``top_bin, top_bin - 1, ...``.

    Every ``|x|`` must be below ``2**((top_bin + 1) * word_bits)`` (the caller takes
    ``top_bin`` from the maximum over all the ranks that sum). ``scratch`` and
    ``slices`` are 1-D float64 arrays of one length (the chunk), made once. Exact
    while the count times ``2**word_bits`` stays below ``2**53``; with the defaults,
    2**33 values. Local; the words of several ranks add exactly (as floats) in any order.
    """
    xp = array_namespace(x)
    total = [0.0] * words
    if top_bin == EMPTY_BIN:
        return total
    flat = x.reshape(-1)
    chunk = scratch.shape[0]
    step = 2.0 ** word_bits
    for start in range(0, flat.shape[0], chunk):
        piece = flat[start:start + chunk]
        m = piece.shape[0]
        t, s = scratch[:m], slices[:m]
        xp.copyto(t, piece)
        if square:
            t *= t
        xp.ldexp(t, -top_bin * word_bits, out=t)
        for k in range(words):
            xp.trunc(t, out=s)
            total[k] += float(s.sum())      # integers below 2**53: exact in any order
            if k + 1 < words:
                t -= s
                t *= step
    return total


def _scale(t: Any, bins: Any, per_bin: int, offset: int) -> None:
    """Multiply row ``i`` of ``t`` by ``2**(bins[i] * per_bin + offset)`` in place
    (rows of ``EMPTY_BIN`` hold zeros and are left alone).

    A multiplication by a power of two is exact (ldexp's result) unless the
    product is subnormal, where both round correctly; one multiply by a row
    factor is 5x faster than ``ldexp`` here, which is kept for the exponents no
    float64 holds.
    """
    xp = array_namespace(t)
    exponent = xp.where(bins == EMPTY_BIN, 0, bins * per_bin + offset)
    if exponent.size == 0 or int(abs(exponent).max()) <= 1022:
        factor = xp.ldexp(xp.ones(exponent.shape, dtype=np.float64), exponent)
        t *= factor[:, None]
    else:
        xp.ldexp(t, exponent[:, None], out=t)


class ChunkGrid:
    """Where the chunks of a vector cut into segments lie: chunk ``c`` of a segment
    is its elements ``[c * chunk, (c + 1) * chunk)``, the last one shorter, in the
    order of the segments. Pure arithmetic, made once.

    Attributes:
        starts: int64 array, the first element of every chunk (vector index).
        lengths: int64 array, the elements of every chunk (``chunk`` but a
            segment's last).
        size: the elements of the vector.
    """

    def __init__(self, segments: Sequence[int], chunk: int = CHUNK) -> None:
        #: The segments' lengths, as given.
        self.segments = [int(v) for v in segments]
        starts, lengths, pos = [], [], 0
        for length in (int(v) for v in segments):
            if length:
                a = np.arange(0, length, chunk, dtype=np.int64)
                starts.append(pos + a)
                lengths.append(np.minimum(chunk, length - a))
            pos += length
        empty = np.zeros(0, dtype=np.int64)
        self.starts = np.concatenate(starts) if starts else empty
        self.lengths = np.concatenate(lengths) if lengths else empty
        self.chunk = chunk
        self.size = pos
        #: Working space a kernel keeps with the grid (mpishard.kernels.deposit).
        self.kernel_scratch: dict[Any, Any] = {}

    def floor(self, index: int) -> int:
        """The first element of the chunk holding element ``index`` (``size`` past the end)."""
        if index >= self.size:
            return self.size
        return int(self.starts[np.searchsorted(self.starts, index, side="right") - 1])

    def ceil(self, index: int) -> int:
        """The smallest chunk boundary at or after ``index``."""
        start = self.floor(index)
        if start == index or index >= self.size:
            return min(index, self.size)
        c = int(np.searchsorted(self.starts, start))
        return start + int(self.lengths[c])

    def span(self, lo: int, hi: int) -> tuple[Any, Any]:
        """The chunks of ``[lo, hi)`` (chunk boundaries both): their starts, counted
        from ``lo``, and their lengths."""
        a, b = np.searchsorted(self.starts, [lo, hi])
        return self.starts[a:b] - lo, self.lengths[a:b]


class ScalarSum:
    """The binned sum of float64 scalars (a loss): the arithmetic of a
    [`BinnedAccumulator`][mpishard.reprosum.BinnedAccumulator] of one element, in Python floats (no
    array passes: a deposit costs microseconds). ``bin`` and ``words`` are its chunk's.
    """

    def __init__(self, word_bits: int = WORD_BITS) -> None:
        self.word_bits = word_bits
        self.k = words_for(np.float64)
        self.bin = EMPTY_BIN
        self.words = [0.0] * self.k

    def clear(self) -> None:
        self.bin = EMPTY_BIN
        self.words = [0.0] * self.k

    def deposit(self, v: float) -> bool:
        """Add ``v``; False, adding nothing, when it is not finite."""
        if not math.isfinite(v):
            return False
        if v == 0.0:
            return True
        self.realign(max(self.bin, bin_of(abs(v), self.word_bits)))
        t = math.ldexp(v, -self.bin * self.word_bits)
        step = 2.0 ** self.word_bits
        for k in range(self.k - 1):
            s = float(math.trunc(t))
            self.words[k] += s
            t = (t - s) * step
        self.words[self.k - 1] += float(math.trunc(t))
        return True

    def realign(self, top: int) -> None:
        """Raise the bin to ``top`` (the group's MAX), dropping the lowest words."""
        if top <= self.bin:
            return
        if self.bin != EMPTY_BIN:
            d = min(top - self.bin, self.k)
            self.words = [0.0] * d + self.words[:self.k - d]
        self.bin = top

    def value(self) -> float:
        return words_to_float(self.words, self.bin, self.word_bits)


class BinnedAccumulator:
    """The order-independent sum of vectors of ``size`` elements, and of ``extras``
    scalars that each get a chunk of their own (a loss beside a gradient).

    ``segments`` (lengths adding up to ``size``; by default one) restart the chunk
    grid: chunk ``c`` of a segment is its elements ``[c * chunk, (c + 1) * chunk)``,
    the last one shorter. Give a model's tensors as segments and a tensor's result
    does not depend on where it sits in the vector (a pipeline stage's vector
    holds the same tensors at other offsets than the whole model's). Internally
    each segment is padded with zeros to whole chunks.

    Attributes:
        words: float64 array ``(K, chunks, chunk)``: the integer slice sums,
            top bin first; reduce with SUM over the group.
        bins: int64 array ``(chunks,)``: each chunk's top bin; reduce with MAX
            over the group and [`realign`][mpishard.reprosum.BinnedAccumulator.realign] before
            reducing the words.
        padded_size: elements of the padded vector part (``main_chunks * chunk``).
        deposits: vectors deposited since [`clear`][mpishard.reprosum.BinnedAccumulator.clear].
    """

    def __init__(self, size: int, dtype: Any, xp: Any = np, *, extras: int = 0,
                 segments: Sequence[int] | None = None, chunk: int = CHUNK,
                 word_bits: int = WORD_BITS) -> None:
        if size < 0 or extras < 0 or chunk < 1:
            raise ValueError(f"expecting size >= 0, extras >= 0, chunk >= 1, got "
                             f"{size}, {extras}, {chunk}")
        lengths = [size] if segments is None else [int(v) for v in segments]
        if sum(lengths) != size or min(lengths, default=0) < 0:
            raise ValueError(f"expecting segment lengths >= 0 adding up to {size}, got "
                             f"{len(lengths)} adding up to {sum(lengths)}")
        self.size = size
        self.extras = extras
        self.chunk = chunk
        self.word_bits = word_bits
        self.k = words_for(dtype)
        # (start, stop, padded start) of each non-empty segment.
        self._segments: list[tuple[int, int, int]] = []
        start = padded = 0
        for length in lengths:
            if length:
                self._segments.append((start, start + length, padded))
                padded += -(-length // chunk) * chunk
            start += length
        self.padded_size = padded
        #: ``(start, stop, padded start)`` of each non-empty segment.
        self.segments = self._segments
        self.main_chunks = padded // chunk
        #: Chunk ``c`` of the words is chunk ``c`` of this grid (kernels read it).
        self.grid = ChunkGrid(lengths, chunk)
        chunks = self.main_chunks + extras
        self.xp = xp
        self.words = xp.zeros((self.k, chunks, chunk), dtype=np.float64)
        self.bins = xp.full(chunks, EMPTY_BIN, dtype=np.int64)
        # Working space: the deposit being sliced, and one slice.
        # Working space of one block of chunks: the deposit being sliced, one slice
        # (see BLOCK_ELEMENTS); on a GPU one block is the whole vector.
        block = chunks if xp is not np else max(1, min(chunks, BLOCK_ELEMENTS // chunk))
        self._t = xp.zeros((block, chunk), dtype=np.float64)
        self._s = xp.zeros((block, chunk), dtype=np.float64)
        self._amax = xp.zeros(chunks, dtype=np.float64)
        # Per segment: (start, stop, padded start, whole chunks).
        self._pieces = [(a, b, p, (b - a) // chunk) for a, b, p in self._segments]
        # Per block of chunks [c0, c1): the copies (source start, stop, offset in the
        # block) that fill it, and whether it holds padding (to be zeroed).
        self._blocks: list[tuple[int, int, list[tuple[int, int, int]], bool]] = []
        for c0 in range(0, self.main_chunks, block):
            c1 = min(c0 + block, self.main_chunks)
            lo, hi = c0 * chunk, c1 * chunk
            copies = []
            for a, b, p in self._segments:
                pb = p + b - a
                if p < hi and pb > lo:
                    q0, q1 = max(p, lo), min(pb, hi)
                    copies.append((a + q0 - p, a + q1 - p, q0 - lo))
            filled = sum(q1 - q0 for q0, q1, _ in copies)
            self._blocks.append((c0, c1, copies, filled < hi - lo))
        self._bits_scratch: Any = None     # integer scratch of _block_amax, on first need
        #: Working space a fused kernel (mpishard.kernels.deposit) keeps here.
        self.kernel_scratch: dict[str, Any] = {}
        self.deposits = 0
        #: Deposits the words hold exactly (over all ranks that reduce them).
        self.capacity = 1 << (53 - word_bits)

    def clear(self) -> None:
        """Start a new sum."""
        self.words.fill(0.0)
        self.bins.fill(EMPTY_BIN)
        self.deposits = 0

    def padded_offset(self, index: int) -> int:
        """Where element ``index`` (or ``size``: the end) sits in the padded vector."""
        if index >= self.size:
            return self.padded_size
        for start, stop, padded in self._segments:
            if index < stop:
                return padded + max(index - start, 0)
        return self.padded_size

    def deposit(self, x: Any, extras: Sequence[float] = ()) -> bool:
        """Add vector ``x`` (``size`` elements, any float dtype) and the extras.

        Returns False, depositing nothing, when any value is not finite. Local.
        """
        xp, t = self.xp, self._t
        if len(extras) != self.extras:
            raise ValueError(f"expecting {self.extras} extra values, got {len(extras)}")
        if self.deposits >= self.capacity:
            raise ValueError(f"a binned sum holds at most {self.capacity} deposits "
                             f"(2**(53 - {self.word_bits})), got one more")
        source, c, amax = x.reshape(-1), self.chunk, self._amax
        fast = _FAST and xp is np
        bits = _BITS.get(source.dtype.itemsize) if fast else None
        if bits is not None and not source.flags.c_contiguous:
            bits = None
        # The largest magnitude per chunk, read from x itself.
        for start, stop, padded, full in self._pieces:
            c0 = padded // c
            if full and bits is not None:
                self._block_amax(source[start:start + full * c], amax[c0:c0 + full], bits)
            elif full:
                v = source[start:start + full * c].reshape(full, c)
                xp.maximum(v.max(axis=1), -v.min(axis=1), out=amax[c0:c0 + full])
            if start + full * c < stop:
                tail = source[start + full * c:stop]
                amax[c0 + full] = xp.maximum(tail.max(), -tail.min())
        for i, v in enumerate(extras):
            amax[self.main_chunks + i] = abs(v)
        if not bool(xp.isfinite(amax).all()):
            return False
        _, e = xp.frexp(amax)
        new = xp.where(amax > 0, (e.astype(np.int64) - 1) // self.word_bits, EMPTY_BIN)
        self.realign(new)
        for c0, c1, copies, padding in self._blocks:
            tb = t[:c1 - c0]
            if fast and not padding and len(copies) == 1:
                # One bin for the whole block (the usual case: 38-bit bins are wide):
                # copy and scale in one pass, by a scalar. x * 2**(-bin * W) rounds
                # as the row-wise scaling does (exact but for subnormal products);
                # a float64 scalar: a Python float would multiply float32 in float32.
                bins = self.bins[c0:c1]
                top = int(bins[0])
                uniform = bool((bins == top).all())
                if uniform and top == EMPTY_BIN:
                    continue        # all zeros so far, these included: nothing to add
                if uniform and abs(top * self.word_bits) <= 1022:
                    a, b, _ = copies[0]
                    np.multiply(source[a:b].reshape(tb.shape),
                                np.float64(2.0 ** (-top * self.word_bits)), out=tb)
                    self._slice(tb, c0, c1, scaled=True)
                    continue
            if padding:
                tb.fill(0.0)
            flat = tb.reshape(-1)
            for a, b, offset in copies:
                flat[offset:offset + b - a] = source[a:b]
            self._slice(tb, c0, c1)
        if self.extras:
            tb = t[:self.extras]
            tb.fill(0.0)
            for i, v in enumerate(extras):
                tb[i, 0] = v
            self._slice(tb, self.main_chunks, self.main_chunks + self.extras)
        self.deposits += 1
        return True

    def _block_amax(self, v: Any, out: Any, bits: tuple[Any, int]) -> None:
        """``out[i] = max |v[i * chunk:(i + 1) * chunk]|`` for whole chunks (NumPy).

        The sign bit cleared, IEEE floats order as their bits do, so the largest
        magnitude is the largest integer: one masking pass and one integer
        maximum (0.6 ns an element for float32 here, against 0.94 for a float
        maximum and minimum). NaN and infinity come out as themselves.
        """
        itype, mask = bits
        c = self.chunk
        scratch = self._bits_scratch
        if scratch is None or scratch.dtype != itype:
            scratch = self._bits_scratch = np.empty(self._t.size, dtype=itype)
        ints = v.view(itype)
        step = scratch.size - scratch.size % c
        for a in range(0, ints.size, step):
            piece = ints[a:a + step]
            sc = scratch[:piece.size]
            np.bitwise_and(piece, mask, out=sc)
            out[a // c:(a + piece.size) // c] = sc.reshape(-1, c).max(axis=1).view(v.dtype)

    def _slice(self, t: Any, c0: int, c1: int, scaled: bool = False) -> None:
        """Add the slices of chunks ``[c0, c1)``, held in ``t`` (unscaled, or already
        ``scaled`` by ``2**(-bin * W)``), to the words."""
        xp, s, words = self.xp, self._s[:c1 - c0], self.words[:, c0:c1]
        if not scaled:
            _scale(t, self.bins[c0:c1], -self.word_bits, 0)     # t = x * 2**(-bin * W)
        step = 2.0 ** self.word_bits
        for k in range(self.k - 1):
            # Not modf: one call, but 15x slower than trunc and subtract here.
            xp.trunc(t, out=s)      # the slice
            words[k] += s
            t -= s                  # exact: the fraction below it
            t *= step               # exact: a power of two
        xp.trunc(t, out=s)
        words[self.k - 1] += s

    def realign(self, bins: Any) -> None:
        """Raise each chunk's top bin to ``bins`` (at least the current ones: the
        group's MAX), moving its words down and dropping the lowest. Local."""
        xp = self.xp
        rise = bins > self.bins
        if not bool(rise.any()):
            return
        held = xp.nonzero(rise & (self.bins != EMPTY_BIN))[0]
        if held.size:
            d = (bins[held] - self.bins[held]).clip(max=self.k)
            for step in sorted({int(v) for v in (d.get() if xp is not np else d)}):
                rows = held[d == step]
                block = self.words[:, rows]
                shift_words(block, step)
                self.words[:, rows] = block
        self.bins[rise] = bins[rise]

    def to_float(self, out: Any, start: int = 0, stop: int | None = None) -> None:
        """Write elements ``[start, stop)`` of the sum into ``out`` (rounded to its
        dtype). Local; after the words were reduced, every rank gets the same bits."""
        stop = self.size if stop is None else stop
        for a, b, padded in self._segments:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                self._convert(out[lo - start:hi - start], padded + lo - a, padded + hi - a)

    def _convert(self, out: Any, pa: int, pb: int) -> None:
        """Padded elements ``[pa, pb)`` into ``out``, a block of chunks at a time."""
        c, block = self.chunk, self._s.shape[0] * self.chunk
        while pa < pb:
            end = min(pb, (pa // c) * c + block)
            self._convert_block(out[:end - pa], pa, end)
            out = out[end - pa:]
            pa = end

    def _convert_block(self, out: Any, pa: int, pb: int) -> None:
        c, kw = self.chunk, self.word_bits
        c0, c1 = pa // c, -(-pb // c)
        acc = self._s[:c1 - c0]
        words = self.words[:, c0:c1]
        acc[...] = words[0]
        for k in range(1, self.k):
            acc *= 2.0 ** kw
            acc += words[k]
        _scale(acc, self.bins[c0:c1], kw, (1 - self.k) * kw)
        out[...] = acc.reshape(-1)[pa - c0 * c:pb - c0 * c]

    # --- the extras (scalars in chunks of their own) -------------------------
    def extra_bin(self, i: int) -> int:
        return int(self.bins[self.main_chunks + i])

    def extra_words(self, i: int) -> Any:
        """The ``K`` words of extra ``i`` (a view)."""
        return self.words[:, self.main_chunks + i, 0]

    def extra_value(self, i: int) -> float:
        return words_to_float([float(w) for w in self.extra_words(i)], self.extra_bin(i),
                              self.word_bits)

    def nbytes(self) -> int:
        scratch = self._bits_scratch.nbytes if self._bits_scratch is not None else 0
        return int(self.words.nbytes + self.bins.nbytes + self._t.nbytes + self._s.nbytes
                   + self._amax.nbytes + scratch)
