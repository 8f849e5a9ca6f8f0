"""The cost model of ``mpishard plan`` against closed forms worked by hand (no MPI)."""

from __future__ import annotations

import json

import pytest

from mpishard.cli import main
from mpishard.costmodel import GPT7B, Layout, Machine, ModelSpec, predict, reduction_time

# Round numbers: 1 GB/s across, 10 GB/s inside, no latency.
M = Machine(ranks_per_node=4, latency_inside=0.0, bandwidth_inside=10e9, latency_across=0.0,
            bandwidth_across=1e9, flops=1e12, memory=80e9)


def test_reduction_times_are_the_closed_forms():
    n = 1e9
    # One node of 4: 2 * 3/4 * n at 10 GB/s.
    assert reduction_time(n, 4, 4, M, "flat") == pytest.approx(0.15)
    # 2 nodes of 4, by slot, recursive halving/doubling: 2 * 1/2 * n through each
    # link at 1 GB/s, 2 * 3/4 * n inside at 10 GB/s.
    assert reduction_time(n, 8, 4, M, "flat") == pytest.approx(1.15)
    # Round robin: the 4 ranks of a node each send that through its link.
    assert reduction_time(n, 8, 4, M, "flat", "round-robin") == pytest.approx(4.0)
    # Hierarchical: 3/4 n inside twice (0.15 s), and 4 ranks each allreducing n/4
    # across 2 nodes through one link: 4 * 2 * 1/2 * n/4 = n at 1 GB/s.
    assert reduction_time(n, 8, 4, M, "hierarchical") == pytest.approx(1.15)
    # Reduce-scatter: half of each part.
    assert reduction_time(n, 8, 4, M, "hierarchical", half=True) == pytest.approx(0.575)


def test_predict_memory_compute_and_bubble_of_a_layout():
    model = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=8, seq=1024)
    ddp = predict(model, Layout(1, 2, 4, "ddp", global_batch=64, micro_batches=8), M)
    zero = predict(model, Layout(1, 2, 4, "zero2", global_batch=64, micro_batches=8), M)
    assert ddp["micro_batches"] == 8 and ddp["bubble"] == pytest.approx(1 / 9)
    # 6 * 1e9 * 64 * 1024 FLOP over 8 ranks at 1 TFLOP/s, stretched by the bubble.
    assert ddp["compute_s"] == pytest.approx(6e9 * 64 * 1024 / 8 / 1e12 / (8 / 9))
    # Half the model per rank, 4 bytes: parameters + gradient + 2 moments = 8 GB for
    # DDP; ZeRO-2 keeps the parameters (2 GB) and 1/4 of the other 6 GB.
    act = ddp["memory_gb"] - 8.0
    assert act > 0 and zero["memory_gb"] - act == pytest.approx(2.0 + 6.0 / 4)
    assert ddp["fits"] and zero["step_s"] > zero["compute_s"]


def test_plan_table_and_validate_commands(capsys, tmp_path):
    assert main(["plan", "--table", "--worlds", "256,4096", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["world"] for r in rows] == [256, 4096]
    for row in rows:
        assert row["best"]["fits"] and row["best"]["memory_gb"] <= 80
        assert row["best"]["world"] == row["world"]
        assert row["best"]["tp"] * row["best"]["pp"] * row["best"]["dp"] == row["world"]
    # A 7B model of 4-byte parameters, gradients and Adam moments (16 bytes a
    # parameter, 107 GB) does not fit a rank of 80 GB whole (DDP, no tp or pp).
    whole = predict(GPT7B, Layout(tp=1, pp=1, dp=64, strategy="ddp"), Machine())
    assert whole["memory_gb"] > 16 * 6.7 and not whole["fits"]
    lines = [{"layout": "1x2", "kind": "reduction", "op": "allreduce", "way": "flat",
              "mib": 1, "seconds": 0.01, "busbw_gbs": 0.1048576},
             {"layout": "2x1", "kind": "reduction", "op": "allreduce", "way": "flat",
              "mib": 1, "seconds": 0.02, "busbw_gbs": 0.0524288},
             {"layout": "2x1", "kind": "reduction", "op": "allreduce", "way": "flat",
              "mib": 4, "seconds": 0.1, "busbw_gbs": 0}]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plan", "--validate", str(path), "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # Calibrated on the 1 MiB runs, 4 MiB across is predicted 4x the 1 MiB time (+ latency).
    assert out[1]["what"] == "allreduce 4 MiB flat"
    assert out[1]["predicted_s"] == pytest.approx(0.08, rel=1e-3)
    assert out[1]["error"] == pytest.approx(-0.2, rel=1e-2)
