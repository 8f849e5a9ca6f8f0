"""Jobs across the nodes of a real (namespace) cluster on this machine.

``scripts/cluster-local.sh`` makes 2 nodes of 2 slots: network namespaces on a
bridge, each with its own host name, reached by Open MPI through an rsh agent.
The module's fixture starts it and stops it at the end, also after a failure;
where namespaces cannot be made (not root, no ``ip``, no bridge) every test is
skipped with the reason. Each test is one ``mpirun -n 4`` job over both nodes
running a case of ``tests/support/cluster_cases.py``, which computes its serial
reference in the same process (float64, rtol 1e-10; the hierarchical
reductions against the flat ones, rtol 1e-12). Then a Slurm runs on the nodes
(``scripts/slurm-local.sh start --cluster``: slurmctld on node 0, a slurmd in
each node) and ``sbatch -N 2 slurm/ddp.sbatch`` trains across both, against the
same training in one process, and ``hybrid.sbatch`` (tp 2 inside each node, pp 2
across) too. The last test loses a whole node under the
elastic agent (``mpishard run``) and compares with the reference runs of
the elastic worker (``tests/support/elastic.py``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from elastic import WORKER, run_reference
from mpijobs import REPO, SUPPORT, mpi_env, mpirun
from nscluster import HOSTS, STATE, cluster_local
from slurmjobs import checkpoint, log, submit, wait
from strategies import NAMES
from stuckjob import HOW
from stuckjob import JOB as STUCK

pytestmark = pytest.mark.launch

SLURM = REPO / "scripts" / "slurm-local.sh"
CASES = SUPPORT / "cluster_cases.py"


def _job(cluster: dict[str, str], case: str, *args: str, n: int = 4,
         flags: tuple[str, ...] = (), timeout: float = 180) -> tuple[int, str]:
    """``mpirun -n N python tests/support/cluster_cases.py CASE ARGS`` on node 0 of the
    cluster: its exit status and output."""
    command = [*shlex.split(cluster["MPISHARD_CLUSTER_EXEC"]), "mpirun",
               *shlex.split(cluster["MPISHARD_CLUSTER_MPIRUN_FLAGS"]), *flags, "-n", str(n),
               sys.executable, str(CASES), case, *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=mpi_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{case} did not finish within {timeout:g} s:\n{out}")
    return proc.returncode, out


def _reports(code: int, out: str, job: str, case: str, n: int):
    """The ``CASE ok`` reports of ``case`` in the output of ``job``, one per rank."""
    assert code == 0, f"{job} failed (exit {code}):\n{out}"
    oks = re.findall(rf"(?<!-){re.escape(case)} ok on (\S+) rank (\d+): (.*?);;", out)
    assert len(oks) == n, f"expecting {n} ranks to report {case}, got {len(oks)}:\n{out}"
    return oks


def run_case(cluster: dict[str, str], case: str, *args: str, n: int = 4,
             flags: tuple[str, ...] = (), timeout: float = 180):
    """One case, one job: its reports (checked: one per rank), output and seconds."""
    t0 = time.monotonic()
    code, out = _job(cluster, case, *args, n=n, flags=flags, timeout=timeout)
    return _reports(code, out, case, case, n), out, time.monotonic() - t0


# The cases that take no argument and no flag of mpirun run one after another in one
# job (one start-up of 4 ranks over the nodes instead of 9); each test reads its own
# case's reports. A case that fails ends the job: its test, and those of the cases
# after it, fail with the job's output, which names the case and its traceback.
ONE_JOB = ["nodemap", *NAMES, "zero3-no-prefetch", *(f"tp2-dp2-{name}" for name in NAMES),
           "pp2-dp2"]


@pytest.fixture(scope="module")
def one_job(cluster) -> tuple[int, str]:
    return _job(cluster, "+".join(ONE_JOB), timeout=180 * len(ONE_JOB) / 3)


def case_of_one_job(one_job: tuple[int, str], case: str):
    """``case``'s reports in the job of ``ONE_JOB``, and that job's output."""
    code, out = one_job
    return _reports(code, out, "+".join(ONE_JOB), case, 4), out


def hosts_by_rank(oks) -> list[str]:
    return [host for host, _ in sorted(((h, int(r)) for h, r, _ in oks), key=lambda t: t[1])]


# --------------------------------------------------------------- on the cluster

def test_ranks_span_both_nodes_and_the_node_map_says_so(one_job):
    oks, out = case_of_one_job(one_job, "nodemap")
    assert hosts_by_rank(oks) == [HOSTS[0], HOSTS[0], HOSTS[1], HOSTS[1]]
    nodes = json.loads(oks[0][2])
    assert nodes.pop("refused").endswith(
        "tensor_parallel_size 4 does not divide the ranks of every node (ranks per node "
        "[2, 2]: 2 nodes: mpishard-node0 ranks 0-1; mpishard-node1 ranks 2-3), so a "
        "tensor-parallel group would cross nodes; choose a tensor_parallel_size that "
        "divides 2, or pass allow_tensor_across_nodes=True to accept it")
    assert nodes.pop("warned").startswith("tensor-parallel groups [[0, 1, 2, 3]] cross nodes")
    assert nodes == {"nodes": 2, "ranks_per_node": [2, 2], "hosts": HOSTS,
                     "node_of_rank": [0, 0, 1, 1]}
    # `mpishard info` (rank 0 prints it)
    assert re.search(r"^nodes\s+2 nodes: mpishard-node0 ranks 0-1; mpishard-node1 ranks 2-3$",
                     out, re.M), out


def test_round_robin_ranks_are_renumbered_node_by_node(cluster):
    """--map-by node puts ranks 0, 2 on node 0: the library's world is reordered
    so the tensor groups {0,1} {2,3} stay inside a node."""
    oks, _, _ = run_case(cluster, "tp2-dp2-ddp", flags=("--map-by", "node"))
    assert hosts_by_rank(oks) == [HOSTS[0], HOSTS[1], HOSTS[0], HOSTS[1]]
    assert all("'tp': 1, 'dp': 2, 'pp': 1" in detail for _, _, detail in oks), oks


@pytest.mark.parametrize("strategy", [*NAMES, "zero3-no-prefetch"])
def test_data_parallel_across_nodes_matches_serial(one_job, strategy):
    """Each strategy of the registry with its data group over both nodes (ZeRO-3:
    every parameter gather crosses the link, with and without prefetch)."""
    oks, _ = case_of_one_job(one_job, strategy)
    assert hosts_by_rank(oks) == [HOSTS[0], HOSTS[0], HOSTS[1], HOSTS[1]]
    assert all("12 steps, data group over 2 nodes" in detail for _, _, detail in oks), oks


@pytest.mark.parametrize("data_parallel", NAMES)
def test_tensor_inside_nodes_data_across_matches_serial(one_job, data_parallel):
    oks, _ = case_of_one_job(one_job, f"tp2-dp2-{data_parallel}")
    assert all("'tp': 1, 'dp': 2, 'pp': 1" in detail for _, _, detail in oks), oks


def test_pipeline_across_nodes_matches_serial(one_job):
    oks, _ = case_of_one_job(one_job, "pp2-dp2")
    assert all("'tp': 1, 'dp': 1, 'pp': 2" in detail for _, _, detail in oks), oks


def test_checkpoint_written_across_nodes_read_at_one_node(cluster, tmp_path):
    path = str(tmp_path / "across.h5")
    run_case(cluster, "checkpoint-write", path)
    # One node: a plain job on this machine (the nodes share its filesystem).
    job = mpirun(2, [str(CASES), "checkpoint-read", path], timeout=120)
    assert job.returncode == 0, job.output
    assert job.output.count("checkpoint-read ok on") == 2, job.output
    assert "resumed at step 4 on 1 node(s), 8 more steps" in job.output


def _link_bytes(node: int) -> int:
    """Bytes node ``node`` has sent on its link (eth0 in its namespace)."""
    text = subprocess.run(["ip", "-n", f"mpishard-n{node}", "-j", "-s", "link", "show", "eth0"],
                          capture_output=True, text=True, check=True).stdout
    return int(json.loads(text)[0]["stats64"]["tx"]["bytes"])


@pytest.mark.parametrize("placement", ["across", "inside"])
def test_tcp_carries_the_traffic_between_nodes(cluster, placement):
    """16 MiB from rank 1 to rank 0: across nodes the sender's link carries them,
    over Open MPI's TCP transport (its verbose log shows the connection); inside
    one node shared memory does and the link stays quiet."""
    megabytes = 16
    flags = ("--map-by", "node") if placement == "across" else ("--host", f"{HOSTS[1]}:2")
    flags += ("--mca", "btl_base_verbose", "30")
    before = _link_bytes(1)
    _, out, _ = run_case(cluster, "transport", str(megabytes), n=2, flags=flags)
    sent = _link_bytes(1) - before
    tcp = re.search(r"btl:tcp: now connected to 10\.213\.0\.\d+, process \[\[\d+,\d+\],1\]", out)
    if placement == "across":
        assert sent > megabytes << 20, f"node 1 sent only {sent} bytes:\n{out}"
        assert tcp, out
    else:
        assert sent < 1 << 20, f"node 1 sent {sent} bytes for a message inside it"


@pytest.mark.parametrize("mapping", ["slot", "node"])
def test_hierarchical_reductions_equal_flat_ones(cluster, mapping):
    """Ranks placed by slot (0 1 | 2 3) or round robin (0 2 | 1 3)."""
    oks, _, _ = run_case(cluster, "hierarchical", flags=("--map-by", mapping))
    details = {detail for _, _, detail in oks}
    assert len(details) == 1, details   # every rank chose the same
    assert re.fullmatch(r"levels 2 nodes x 2 ranks, chose (flat|hierarchical)", details.pop())


# --------------------------------------------------------------- Slurm on the nodes

@pytest.fixture(scope="module")
def cluster_slurm(cluster) -> tuple[str, ...]:
    """slurmctld on node 0 and a slurmd in every node (``scripts/slurm-local.sh start
    --cluster``), stopped at the end (the cluster's own stop also ends them); the
    command prefix that reaches this Slurm (Slurm's commands run inside node 0)."""
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged")) \
            and not shutil.which("apt-get"):
        pytest.skip("Slurm (slurmctld, slurmd, munged) is not installed, and this is no "
                    "Debian machine (no apt-get) to install slurm-wlm and munge from")
    try:
        start = subprocess.run(["bash", str(SLURM), "start", "--cluster"], capture_output=True,
                               text=True, timeout=900)
        if start.returncode != 0:
            tail = " | ".join((start.stderr or start.stdout).strip().splitlines()[-3:])
            pytest.skip(f"Slurm's daemons could not run in the cluster's nodes: {tail}")
        yield tuple(shlex.split(cluster["MPISHARD_CLUSTER_EXEC"]))
    finally:
        subprocess.run(["bash", str(SLURM), "stop", "--cluster"], capture_output=True, timeout=120)


# Each job (script[-variant]): 8 steps in float64, sbatch's options, the script's
# settings, what its log says, the checkpoint's (strategy, tp, pp).
_HYBRID = (["--example", "burgers", "--samples", "1024", "--epochs", "2"],
           {"MPISHARD_SCHEDULE": "gpipe"}, "hybrid on 4 rank(s): tp 2 x pp 2 x dp 1",
           ("hybrid-zero2", 2, 2))
SBATCH_JOBS = {
    "ddp": (["--example", "gpt", "--samples", "256", "--epochs", "1", "--log-every", "4"], (),
            {}, "ddp on 4 rank(s)", ("ddp", 1, 1)),
    "hybrid": (_HYBRID[0], (), *_HYBRID[1:]),
    # Tasks dealt round robin (checked: `srun -l hostname` puts ranks 0, 2 on node 0):
    # the library renumbers its world so that the tensor groups stay inside the nodes
    # (node 1 sent 11.7 MB either way).
    "hybrid-cyclic": (_HYBRID[0], ("--distribution=cyclic",), *_HYBRID[1:]),
}


_SERIAL: dict[tuple[str, ...], dict[str, np.ndarray]] = {}


def serial_run(args: list[str], out: Path) -> dict[str, np.ndarray]:
    """The serial reference: ``mpishard train --strategy ddp ARGS`` in one process on this
    machine, outside the cluster; the parameters of its step-8 checkpoint. Run once per
    ``ARGS`` (the hybrid jobs, by node or round robin, train the same)."""
    key = tuple(args)
    if key not in _SERIAL:
        ref = subprocess.run([sys.executable, "-m", "mpishard", "train", "--strategy", "ddp",
                              *args, "--out", str(out)], capture_output=True, text=True,
                             timeout=180, env=mpi_env({"OMP_NUM_THREADS": "1"}))
        assert ref.returncode == 0, ref.stdout + ref.stderr
        _SERIAL[key], _ = checkpoint(out / f"{args[1]}/checkpoints/ckpt-0000000008.h5")
    return _SERIAL[key]


@pytest.mark.parametrize("job_kind", sorted(SBATCH_JOBS))
def test_sbatch_runs_across_two_nodes_of_the_local_slurm(cluster_slurm, tmp_path, job_kind):
    """``sbatch -N 2 slurm/ddp.sbatch`` (and ``hybrid.sbatch``: tp 2 inside each node,
    pp 2 across; also with the tasks dealt round robin): 2 tasks in each node's
    namespace, started by srun --mpi=pmix; what goes between the nodes crosses node
    1's link over Open MPI's TCP transport (its verbose log and the link's byte
    counter show it), and the parameters equal those of the same training in one
    process (float64, rtol 1e-10)."""
    args, options, env, says, (strategy, tp, pp) = SBATCH_JOBS[job_kind]
    script = job_kind.split("-")[0]
    args = [*args, "--dtype", "float64"]
    example = args[1]
    via = cluster_slurm
    before = _link_bytes(1)
    job = submit(f"{script}.sbatch", tmp_path, *args, sbatch=("-N", "2", *options), via=via,
                 MPISHARD_OUT=str(tmp_path / "run"), OMPI_MCA_btl_base_verbose="30",
                 OMPI_MCA_mpi_yield_when_idle="1", **env)
    try:
        info = wait(job, timeout=300, via=via)
    except pytest.fail.Exception as failure:   # say what the job and the daemons did
        logs = [tmp_path / f"mpishard-{script}-{job}.out", *sorted(STATE.glob("slurm/*.log"))]
        tails = "\n".join(f"--- {f}:\n" + "\n".join(f.read_text().splitlines()[-15:])
                          for f in logs if f.exists())
        pytest.fail(f"{failure}\n{tails}")
    text = log(tmp_path, f"mpishard-{script}", job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert (info["NumNodes"], info["NodeList"]) == ("2", "mpishard-node[0-1]"), info
    assert f"job {job}: 4 tasks on mpishard-node[0-1]" in text and says in text, text
    assert re.search(r"btl:tcp: now connected to 10\.213\.0\.\d+", text), text
    sent = _link_bytes(1) - before
    assert sent > 4 << 20, f"node 1 sent only {sent} bytes: nothing crossed the nodes"
    got, attrs = checkpoint(tmp_path / f"run/{example}/checkpoints/ckpt-0000000008.h5")
    assert (attrs["step"], attrs["world_size"], attrs["strategy"], attrs["tp"],
            attrs["pp"]) == (8, 4, strategy, tp, pp)
    want = serial_run(args, tmp_path / "serial")
    assert sorted(got) == sorted(want)
    for name in want:   # atol: the GPT's key biases, whose gradient is 0 (softmax ignores them)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_elastic_training_goes_on_when_a_whole_node_is_lost(cluster, tmp_path):
    """``mpishard run`` over both nodes (hostfile of 2 x 2); once the checkpoint of
    step 4 is written, node 1 fails (every process in it killed, unreachable) and
    the hostfile loses it: the agent relaunches on node 0's 2 slots, which resume
    from the checkpoint and finish. The parameters equal those of a one-node
    reference that stops at the same step on 4 ranks and resumes on 2."""
    hosts = tmp_path / "hosts"
    hosts.write_text(Path(cluster["MPISHARD_CLUSTER_HOSTFILE"]).read_text())
    flags = re.sub(r"--hostfile \S+", "", cluster["MPISHARD_CLUSTER_MPIRUN_FLAGS"]).strip()
    ckpt, log, events = tmp_path / "ckpt", tmp_path / "agent.log", tmp_path / "events"
    worker_args = ["--every", "4"]
    command = [*shlex.split(cluster["MPISHARD_CLUSTER_EXEC"]), sys.executable, "-m",
               "mpishard", "run", "--min-workers=2", "--max-workers=4", f"--hostfile={hosts}",
               "--launcher=mpirun", f"--launcher-args={flags}", f"--checkpoint-dir={ckpt}",
               f"--log={log}", "--", *WORKER,
               "--ckpt", str(ckpt), "--events", str(events), "--out", str(tmp_path / "out.npy"),
               "--step-seconds", "0.2", *worker_args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=mpi_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (ckpt / "ckpt-0000000004.h5").exists():
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"no checkpoint of step 4:\n{proc.communicate()[0]}"
            time.sleep(0.1)
        down = cluster_local("down", "1")
        assert down.returncode == 0, down.stderr
        hosts.write_text(f"{HOSTS[0]} slots=2\n")   # what the resource manager says now
        out, _ = proc.communicate(timeout=120)
    except BaseException:
        os.killpg(proc.pid, 9)
        raise
    finally:
        cluster_local("up", "1")
    assert proc.returncode == 0, out
    launches = [(e["workers"], e["reason"]) for e in map(json.loads, log.read_text().splitlines())
                if e["event"] == "launch"]
    assert launches == [(4, "start"), (2, "failure")], (launches, out)
    resumed = [json.loads(line) for line in events.read_text().splitlines()]
    assert len(resumed) == 1 and resumed[0]["workers"] == 2, resumed
    step = resumed[0]["resumed_step"]
    assert step >= 4 and resumed[0]["final_step"] == 24, resumed
    reference = run_reference(tmp_path, [(4, step), (2, None)], worker_args)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), reference, rtol=1e-12, atol=0)


@pytest.mark.parametrize("how", ["loop", "sigstop"])
def test_a_stuck_rank_on_another_node_is_named_with_its_stack(cluster, tmp_path, how):
    """One rank per node; the rank on node 1 stops making progress after a step
    (an endless loop in user code, or SIGSTOP). Rank 0 on node 0 cannot signal
    it, but reads its records in the job directory (the nodes share the file
    system): its timeout (3 s) ends the job with a message that names the rank
    and its host and, for the loop, the stack its own watchdog wrote (with the
    looping function); a stopped process writes none, and the message says so."""
    script = tmp_path / "stuck.py"   # test_stall_stuck's job, its rank 1 on node 1
    script.write_text(STUCK.format(timeout=3, stuck=1, how=HOW[how]))
    command = [*shlex.split(cluster["MPISHARD_CLUSTER_EXEC"]), "mpirun",
               *shlex.split(cluster["MPISHARD_CLUSTER_MPIRUN_FLAGS"]), "--map-by", "node",
               "-n", "2", sys.executable, str(script)]
    t0 = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, env=mpi_env(), timeout=90)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    # Not anchored: Open MPI may forward rank 0's "PID 0 ..." and its newline apart, so
    # that rank 1's line follows it on the same line ("PID 0 2491PID 1 2490").
    pid = re.search(r"PID 1 (\d+)(?!\d)", out).group(1)
    assert proc.returncode != 0 and "unreachable" not in out, out
    assert re.search(rf"did not finish within 3 s \(timeout=3: a wait for the other ranks of "
                     rf"the group\); did not arrive: world rank 1 \(pid {pid} "
                     rf"on {HOSTS[1]}\): on another host", out), out
    if how == "loop":
        assert "in no call of the library: its watchdog wrote its stack" in out, out
        stack = out[out.index(f"Python stack of world rank 1 on {HOSTS[1]}"):]
        assert re.search(r'File ".*stuck\.py", line \d+ in spin', stack), out
    else:
        assert "no stack from its watchdog yet (a stopped or very slow process)" in out, out
    assert took < 60, (took, out)
