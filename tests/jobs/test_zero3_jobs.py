"""ZeRO-3 in whole jobs: ``mpishard train --strategy zero3`` and the elastic agent.

Plain pytest (each test starts its own ``mpirun``). ``mpishard train`` with ZeRO-3
trains the examples as ZeRO-2 does (float64: equal losses, step by step, to rtol
1e-12; on 2 ranks each sum has two terms, so they are equal); its checkpoint
resumes under ZeRO-2 at another size with the steps of the uninterrupted run;
``--data-parallel zero3`` inside a pipelined layout matches DDP. Under
``mpishard run`` a ZeRO-3 worker killed at a seeded step shrinks the job (resumed
from the checkpoint, resharded over 3), the slot comes back and it grows to 4
again; the final parameters equal those of a reference making the same resizes
on purpose, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_elastic import KILL_POINTS, read_events, run_elastic, run_reference
from test_train_cli import events, mpishard

pytestmark = pytest.mark.launch


def losses(path):
    return [r["loss"] for r in events(path, "step")]


def test_train_strategy_zero3_matches_zero2_and_resumes_elsewhere(tmp_path):
    common = ["train", "--samples", "512", "--epochs", "2", "--dtype", "float64",
              "--log-every", "1", "--batch-size", "32"]
    for example in ("gpt", "burgers"):
        runs = {}
        for strategy in ("zero2", "zero3"):
            proc = mpishard(2, *common, "--example", example, "--strategy", strategy,
                            "--out", str(tmp_path / strategy))
            assert proc.returncode == 0, proc.stderr
            runs[strategy] = losses(tmp_path / strategy / example / "metrics.jsonl")
        assert len(runs["zero3"]) == 32 and runs["zero3"][-1] < runs["zero3"][0]
        np.testing.assert_allclose(runs["zero3"], runs["zero2"], rtol=1e-12, atol=0)
    # ZeRO-3 stopped at step 16 (its checkpoint), resumed by ZeRO-2 on 4 ranks: the
    # steps of the uninterrupted ZeRO-3 run (to rtol 1e-9: 4 ranks sum in another
    # order than 2).
    args = [*common, "--example", "burgers"]
    part = mpishard(2, *args, "--strategy", "zero3", "--max-steps", "16",
                    "--out", str(tmp_path / "part"))
    assert part.returncode == 0 and "stopped at --max-steps 16" in part.stdout, part.stderr
    ckpt = tmp_path / "part/burgers/checkpoints/ckpt-0000000016.h5"
    again = mpishard(4, *args, "--strategy", "zero2", "--resume", str(ckpt),
                     "--out", str(tmp_path / "four"))
    assert again.returncode == 0 and "at step 16" in again.stdout, again.stderr
    rest = losses(tmp_path / "four" / "burgers" / "metrics.jsonl")
    assert len(rest) == 16
    np.testing.assert_allclose(rest, runs["zero3"][16:], rtol=1e-9)


def test_train_hybrid_data_parallel_zero3_matches_ddp(tmp_path):
    """pp 2 x dp 2 with 2 micro-batches (1F1B), ZeRO-3 over each stage's data group."""
    common = ["train", "--samples", "256", "--epochs", "1", "--dtype", "float64",
              "--batch-size", "32", "--example", "gpt", "--log-every", "1"]
    ddp = mpishard(4, *common, "--out", str(tmp_path / "ddp"))
    hybrid = mpishard(4, *common, "--strategy", "hybrid", "--pp", "2", "--micro-batches", "2",
                      "--data-parallel", "zero3", "--out", str(tmp_path / "hybrid"))
    assert ddp.returncode == 0 and hybrid.returncode == 0, (ddp.stderr, hybrid.stderr)
    assert "tp 1 x pp 2 x dp 2" in hybrid.stdout
    a = losses(tmp_path / "ddp" / "gpt" / "metrics.jsonl")
    b = losses(tmp_path / "hybrid" / "gpt" / "metrics.jsonl")
    assert len(a) == len(b) == 8
    np.testing.assert_allclose(b, a, rtol=1e-12)


def test_elastic_zero3_killed_worker_shrinks_then_grows_back_exactly(tmp_path):
    kill_at = KILL_POINTS[0]
    args = ["--strategy", "zero3", "--every", "4"]
    proc, log = run_elastic(tmp_path, args + ["--kill-at", str(kill_at), "--kill-rank", "2"])
    assert proc.returncode == 0, proc.stdout
    launches = [(e["workers"], e["reason"]) for e in log if e["event"] == "launch"]
    assert launches == [(4, "start"), (3, "failure"), (4, "resize")], launches
    shrunk, grown = read_events(tmp_path / "events")[:2]
    assert shrunk["workers"] == 3 and shrunk["resumed_step"] == (kill_at // 4) * 4
    assert grown["resumed_step"] == shrunk["final_step"] and grown["final_step"] == 24
    reference = run_reference(
        tmp_path, [(4, shrunk["resumed_step"]), (3, shrunk["final_step"]), (4, None)], args)
    assert np.array_equal(np.load(tmp_path / "elastic.npy"), reference)
