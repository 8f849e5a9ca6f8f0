"""The cost model of ``mpishard plan`` against closed forms worked by hand (no MPI)."""

from __future__ import annotations

import json

import pytest

from mpishard.cli import main
from mpishard.costmodel import (
    GPT7B,
    Layout,
    Machine,
    ModelSpec,
    best_layouts,
    predict,
    reduction_time,
)
from mpishard.strategies import STRATEGIES

#: The registry's cost-model entries, by name.
COST = {name: entry.cost for name, entry in STRATEGIES.items()}

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
    ddp = predict(model, Layout(1, 2, 4, COST["ddp"], global_batch=64, micro_batches=8), M)
    zero = predict(model, Layout(1, 2, 4, COST["zero2"], global_batch=64, micro_batches=8), M)
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
    whole = predict(GPT7B, Layout(tp=1, pp=1, dp=64, strategy=COST["ddp"]), Machine())
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


def test_zero3_communication_and_memory_are_the_closed_forms():
    """ZeRO-3 moves the gradient's bytes three times (a reduce-scatter and two
    allgathers of the parameters, forward and backward), ZeRO-2 twice; it holds
    1/dp of parameters, gradients and moments, plus two layers' parameters."""
    model = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=8, seq=1024)
    flat = dict(reduction="flat", global_batch=64, micro_batches=8)
    ddp = predict(model, Layout(1, 1, 8, COST["ddp"], **flat), M)
    zero2 = predict(model, Layout(1, 1, 8, COST["zero2"], **flat), M)
    zero3 = predict(model, Layout(1, 1, 8, COST["zero3"], **flat), M)
    allreduce = reduction_time(4e9, 8, 4, M, "flat")
    assert ddp["dp_comm_s"] == pytest.approx(allreduce)
    assert zero2["dp_comm_s"] == pytest.approx(0.5 * allreduce + 0.5 * allreduce)
    assert zero3["dp_comm_s"] == pytest.approx(0.5 * allreduce + 2 * 0.5 * allreduce)
    slow = Machine(**{**M.__dict__, "allgather_cost": 1.0})
    assert predict(model, Layout(1, 1, 8, COST["zero3"], **flat), slow)["dp_comm_s"] == \
        pytest.approx(0.5 * allreduce + 2 * allreduce)
    act = ddp["memory_gb"] - 16.0
    assert zero2["memory_gb"] - act == pytest.approx(4.0 + 12.0 / 8)
    assert zero3["memory_gb"] - act == pytest.approx(16.0 / 8 + 2 * 4.0 / 8)
    # The plan lists ZeRO-3 layouts, and the fastest fitting one of a 7B model.
    ranked = best_layouts(GPT7B, 64, Machine(), 1024, COST.values())
    assert {r["strategy"] for r in ranked} == set(STRATEGIES) == {"ddp", "zero2", "zero3"}


def test_validate_predicts_zero_steps_from_the_one_node_run(capsys, tmp_path):
    lines = [{"layout": "1x2", "kind": "reduction", "op": "allreduce", "way": "flat",
              "mib": 1, "seconds": 0.01, "busbw_gbs": 0.1048576},
             {"layout": "1x2", "kind": "reduction", "op": "allgather", "way": "flat",
              "mib": 1, "seconds": 0.004, "busbw_gbs": 0},
             {"layout": "2x1", "kind": "reduction", "op": "allreduce", "way": "flat",
              "mib": 1, "seconds": 0.02, "busbw_gbs": 0.0524288},
             {"layout": "1x2", "kind": "zero_step", "strategy": "zero3", "prefetch": True,
              "gradient_mib": 1, "seconds_per_step": 0.1},
             {"layout": "2x1", "kind": "zero_step", "strategy": "zero3", "prefetch": True,
              "gradient_mib": 1, "seconds_per_step": 0.2}]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plan", "--validate", str(path), "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    calib = out[0]["calibration"]
    assert calib["allgather_cost"] == pytest.approx(0.4)
    [step] = [r for r in out[1:] if r["what"] == "zero3 step"]
    # One node: compute = 0.1 - (rs + 2 ag) there; 2x1: compute + (rs + 2 ag) across.
    inside = Machine(ranks_per_node=2, latency_inside=calib["latency_inside"],
                     bandwidth_inside=calib["bandwidth_inside"],
                     latency_across=calib["latency_across"],
                     bandwidth_across=calib["bandwidth_across"],
                     reduce_scatter_cost=calib["reduce_scatter_cost"], allgather_cost=0.4)
    across = Machine(**{**inside.__dict__, "ranks_per_node": 1})
    n = float(1 << 20)

    def comm(machine, per):
        return (reduction_time(n, 2, per, machine, "flat", half=True)
                + 2 * 0.4 * reduction_time(n, 2, per, machine, "flat"))

    assert step["predicted_s"] == pytest.approx(0.1 - comm(inside, 2) + comm(across, 1))
    assert step["measured_s"] == 0.2


def test_validate_skips_only_the_calibration_lines(capsys, tmp_path):
    """Every line but the calibration's is predicted: the first line of each layout
    too (0.5 skipped it), and not the reduce-scatter calibrated from (0.5 printed it,
    error 0)."""
    line = {"kind": "reduction", "op": "allreduce", "way": "flat", "mib": 1}
    lines = [{**line, "layout": "1x2", "seconds": 0.01, "busbw_gbs": 0.1048576},
             {**line, "layout": "1x2", "op": "reduce_scatter", "seconds": 0.006,
              "busbw_gbs": 0},
             {**line, "layout": "2x1", "seconds": 0.02, "busbw_gbs": 0.0524288},
             {**line, "layout": "2x2", "way": "hierarchical", "seconds": 0.03, "busbw_gbs": 0},
             {**line, "layout": "2x2", "seconds": 0.03, "busbw_gbs": 0}]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plan", "--validate", str(path), "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out[0]["calibration"]["reduce_scatter_cost"] == pytest.approx(0.6)
    assert [(r["layout"], r["what"]) for r in out[1:]] == [
        ("2x2", "allreduce 1 MiB hierarchical"), ("2x2", "allreduce 1 MiB flat")]


def test_plan_strategies_are_the_registry_s(capsys):
    """``--strategy`` takes every name of the registry, and the prediction names it."""
    for name in STRATEGIES:
        assert main(["plan", "--dp", "8", "--strategy", name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["strategy"] == name
    with pytest.raises(SystemExit):
        main(["plan", "--strategy", "zero9"])
    assert "invalid choice: 'zero9'" in capsys.readouterr().err
