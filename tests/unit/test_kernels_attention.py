"""The fused causal attention in the layer, TF32 and CUDA-graph replay
(mpishard/kernels/attention.py, mpishard/kernels/cuda_step.py).

Plain pytest (no MPI world). On the CPU: the layer's fused layout (token-major
projections, no ``(t, t)`` buffers, the kernels' functions) run with the NumPy
twins against the layer's own path, float64 to 1e-12; `StepGraph`'s warm-up,
capture, replay and fallback against a stand-in for CuPy's streams. The ``gpu``
cases (CuPy and a device; skipped elsewhere, saying why) run the CUDA kernels
against the twin on the same device arrays (float64 to 1e-11, float32 to 2e-5),
the GPT with the fused attention against the GPT without it, the kernels twice
for the same bits, an MLP's and a GPT's forward and backward replayed as a CUDA
graph against eager ones, and TF32 products against float32 ones. None of the ``gpu`` cases
has run on a GPU yet (scripts/gpu-check.sh runs them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import mpishard.nn.attention as layer_module
from mpishard.backend import cupy_available, to_numpy
from mpishard.kernels import attention as att
from mpishard.kernels.cuda_step import StepGraph, set_tf32, tf32_enabled
from mpishard.nn import GPT, MLP

V, T, D, H, L = 13, 21, 24, 3, 2          # head_dim 8, tokens past a block's 16 rows


def tokens(batch: int, length: int = T, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (batch, length)), rng.integers(0, V, (batch, length))


def loss_and_grads(xp, dtype, x, y, **kw):
    model = GPT(V, T, D, H, L, dtype=dtype, xp=xp, seed=3, **kw)
    model.params[...] += xp.asarray(
        0.3 * np.random.default_rng(1).standard_normal(model.params.size), dtype=dtype)
    loss = model.forward_backward(xp.asarray(x), xp.asarray(y))
    return model, loss, to_numpy(model.grads).copy()


def attention_buffers(model) -> list[dict]:
    """The attention layers' training buffers (nested in the blocks' own)."""
    return [bufs["attn"] for (train, _), ws in model._workspaces.items() if train
            for bufs in ws.layers if "attn" in bufs]


def nbytes(buffers: list[dict]) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for d in buffers for a in d.values())


def test_layer_fused_layout_with_the_twins_matches_the_layer_path(monkeypatch):
    """The layer's fused buffers and calls, run on NumPy with the kernels' twins."""
    x, y = tokens(3)
    plain, want_loss, want = loss_and_grads(np, np.float64, x, y)
    monkeypatch.setattr(layer_module, "attention_fused_on", lambda *args: True)
    fused, loss, got = loss_and_grads(np, np.float64, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)
    # The fused layout ran, and holds no (t, t) array: fewer bytes.
    assert all("lse" in d and "p" not in d for d in attention_buffers(fused))
    assert all("p" in d for d in attention_buffers(plain))
    assert nbytes(attention_buffers(fused)) < nbytes(attention_buffers(plain))
    np.testing.assert_allclose(fused.forward(x[:, :7]), plain.forward(x[:, :7]), rtol=1e-12)


# --- StepGraph against a stand-in for CuPy ---------------------------------------------

class FakeCuda:
    """CuPy's streams, pools and graphs as far as StepGraph uses them."""

    def __init__(self, fail: Exception | None = None):
        self.fail, self.capturing, self.launches = fail, False, 0
        outer = self

        class Stream:
            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                assert not outer.capturing

            def begin_capture(self):
                outer.capturing = True

            def end_capture(self):
                outer.capturing = False
                if outer.fail is not None:
                    raise outer.fail
                return types.SimpleNamespace(launch=lambda stream: outer.launch())

        class MemoryPool:
            malloc = None

        self.Stream, self.MemoryPool = Stream, MemoryPool
        self.using_allocator = lambda malloc: Stream()
        self.get_current_stream = lambda: Stream()

    def launch(self):
        self.launches += 1


@pytest.mark.parametrize("fail", [None, RuntimeError("cudaErrorStreamCaptureUnsupported")])
def test_step_graph_warms_up_captures_and_replays_or_falls_back(fail):
    cuda = FakeCuda(fail)
    calls = []
    graph = StepGraph(lambda: calls.append(cuda.capturing), types.SimpleNamespace(cuda=cuda),
                      warmup=2)
    for _ in range(5):
        graph()
    if fail is None:
        # Two eager calls, one captured (not run: launched), then launches only.
        assert calls == [False, False, True] and cuda.launches == 3
        assert graph.captured and graph.reason is None
    else:
        # The failed capture's call runs again eagerly, and every later one.
        assert calls == [False, False, True, False, False, False] and cuda.launches == 0
        assert not graph.captured and "cudaErrorStreamCaptureUnsupported" in graph.reason


def test_step_graph_on_numpy_runs_the_function_and_tf32_is_off():
    calls = []
    graph = StepGraph(lambda: calls.append(1), np)
    for _ in range(4):
        graph()
    assert calls == [1] * 4 and not graph.captured and "NumPy" in graph.reason
    assert set_tf32(np, True) is False and tf32_enabled(np) is False
    with pytest.raises(ValueError, match="warmup of at least 1 call, got 0"):
        StepGraph(lambda: None, np, warmup=0)


@pytest.mark.skipif(cupy_available(), reason="a GPU is here: the benchmark runs for real")
def test_attention_benchmark_without_a_gpu_says_so():
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu_attention.py"
    proc = subprocess.run([sys.executable, str(bench)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    record = json.loads(proc.stdout)
    assert record["ok"] is False and record["reason"].startswith("no GPU: ")


# --- on a GPU -----------------------------------------------------------------------------

@pytest.fixture
def cp(monkeypatch):
    from backends import cupy_or_skip

    cupy = cupy_or_skip()
    monkeypatch.setenv("MPISHARD_GPU_KERNELS", "1")
    monkeypatch.setenv("MPISHARD_GPU_ATTENTION", "1")
    return cupy


def run_pair(xp, q, k, v, dout, scale):
    b, t, h, _ = q.shape
    out, dq, dk, dv = (xp.empty_like(q) for _ in range(4))
    lse, delta = xp.empty((b, h, t), q.dtype), xp.empty((b, h, t), q.dtype)
    att.causal_attention(q, k, v, scale, out, lse)
    att.causal_attention_backward(dout, q, k, v, out, lse, scale, dq, dk, dv, delta)
    return [to_numpy(a) for a in (out, lse, dq, dk, dv, delta)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(2, 37, 3, 16), (1, 256, 2, 64), (2, 70, 1, 33),
                                   (1, 129, 2, 128)])
def test_cuda_kernels_against_the_twin(cp, monkeypatch, dtype, shape):
    if not att.attention_fused_on(cp, dtype, shape[3]):
        assert dtype == np.float64 and shape[3] == 128   # the one case too wide to fuse
        return
    rng = np.random.default_rng(sum(shape))
    q, k, v, dout = (cp.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
    fused = run_pair(cp, q, k, v, dout, shape[3] ** -0.5)
    again = run_pair(cp, q, k, v, dout, shape[3] ** -0.5)
    monkeypatch.setenv("MPISHARD_GPU_ATTENTION", "0")
    twin = run_pair(cp, q, k, v, dout, shape[3] ** -0.5)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)
    for name, got, want, repeat in zip(("out", "lse", "dq", "dk", "dv", "delta"), fused, twin,
                                       again):
        np.testing.assert_allclose(got, want, **tol, err_msg=name)
        assert got.tobytes() == repeat.tobytes(), f"{name}: other bits in a second run"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gpt_with_fused_attention_matches_without(cp, monkeypatch, dtype):
    x, y = tokens(4)
    fused, loss, got = loss_and_grads(cp, dtype, x, y)
    assert attention_buffers(fused) and all("lse" in d for d in attention_buffers(fused))
    monkeypatch.setenv("MPISHARD_GPU_ATTENTION", "0")
    _, want_loss, want = loss_and_grads(cp, dtype, x, y)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-13)
    assert loss == pytest.approx(want_loss, rel=tol["rtol"])
    np.testing.assert_allclose(got, want, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_forward_backward_replayed_as_a_cuda_graph(cp, name):
    """Gradients of a captured forward and backward against eager ones. The MLP's
    must capture; the GPT's may not (its embedding sorts token ids with Thrust,
    which may wait for the stream): then it runs eagerly, the reason reported."""
    if name == "mlp":
        model = MLP([16, 32, 5], activation="gelu", dtype=np.float32, xp=cp, seed=3)
        rng = np.random.default_rng(0)
        x = cp.asarray(rng.standard_normal((8, 16)).astype(np.float32))
        y = cp.asarray(rng.integers(0, 5, 8))
    else:
        model = GPT(V, T, D, H, L, dtype=np.float32, xp=cp, seed=3)
        x, y = (cp.asarray(a) for a in tokens(2))
    assert np.isfinite(model.forward_backward(x, y))
    want = to_numpy(model.grads).copy()
    graph = StepGraph(lambda: _fwd_bwd(model, x, y), cp, warmup=1)
    for _ in range(3):
        model.grads[...] = cp.nan
        graph()
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_allclose(to_numpy(model.grads), want, rtol=1e-6, atol=1e-7)
    if not graph.captured:
        assert name == "gpt", graph.reason
        pytest.xfail(f"the GPT's forward and backward did not capture: {graph.reason}")


def _fwd_bwd(model, x, y) -> None:
    """The model's forward, loss and backward without reading the loss on the host."""
    model.forward_stage(x, 0)
    model._loss(y, 0)
    model.backward_stage(None, 0)


@pytest.mark.gpu
def test_tf32_products_differ_from_float32_by_little(cp):
    if int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("TF32 needs compute capability 8.0 or later")
    rng = np.random.default_rng(0)
    a = cp.asarray(rng.standard_normal((256, 512)).astype(np.float32))
    b = cp.asarray(rng.standard_normal((512, 256)).astype(np.float32))
    exact = a.get().astype(np.float64) @ b.get().astype(np.float64)
    try:
        assert set_tf32(cp, False) is False and not tf32_enabled(cp)
        plain = to_numpy(a @ b)
        assert set_tf32(cp, True) is True and tf32_enabled(cp)
        tf32 = to_numpy(a @ b)
    finally:
        set_tf32(cp, False)
    scale = np.abs(exact).max()
    assert np.abs(plain - exact).max() / scale < 1e-5
    error = np.abs(tf32 - exact).max() / scale
    assert 1e-5 < error < 1e-2, f"TF32's error {error:.2e} (expected about 1e-3)"
