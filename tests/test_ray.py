"""--ray: the output's shards written by Ray tasks on a 3-node local Ray cluster (ray.cluster_utils.Cluster: a head
and two worker nodes, each its own raylet and workers), byte-identical to a one-node run, receipt included; a node
killed mid-run (its tasks retried on the others, nothing written twice or lost)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ffn_tools.child import python_env
from ffn_tools.cluster import PART
from ffn_tools.verification.report import without_times

from helpers import plant, run_cli, tree_digest

ray = pytest.importorskip("ray")  # the [ray] extra (in dev)
SHARD = "30KB"


def _digest(out: Path) -> dict[str, str]:
    return {str(Path(k).relative_to(out)): v for k, v in tree_digest(out).items()}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from tiny_models import build

    return build("llama", tmp_path_factory.mktemp("ray") / "llama", torch.bfloat16, max_shard_size="100KB")


@pytest.mark.parametrize("args", [["fuse-gateup", "--max-shard-size", SHARD],
                                  ["convert", "--to", "mlx", "-q", "--q-bits", "4", "--max-shard-size", "12KB"]],
                         ids=["fuse", "mlx-4bit"])
def test_a_three_node_run_is_byte_identical_to_one_node(cluster, sharded, tmp_path, args, monkeypatch):
    cmd = [args[0], sharded, *args[1:]]
    one, many = tmp_path / "one" / "out", tmp_path / "ray" / "out"
    run_cli(*cmd, "-o", one)
    monkeypatch.chdir(tmp_path)  # -o relative: each task writes where the driver means, whatever its own directory
    run_cli(*cmd, "-o", "ray/out", f"--ray={cluster.address}")
    assert len(list(one.glob("*.safetensors"))) >= 4
    assert _digest(many) == _digest(one)  # every file, every byte: shards, index, config, receipt
    assert not ray.is_initialized()  # connected for the command only
    assert not list(many.parent.glob(".out.*"))  # no temporary left


def test_a_node_killed_mid_run_loses_nothing(cluster, sharded, tmp_path):
    node = cluster.add_node(num_cpus=1)  # the node to kill
    cluster.wait_for_nodes()
    cmd = ["fuse-gateup", str(sharded), "--max-shard-size", "12KB"]
    one, many = tmp_path / "one" / "out", tmp_path / "ray" / "out"
    run_cli(*cmd, "-o", one)
    shards = len(list(one.glob("*.safetensors")))
    assert shards >= 10
    proc = subprocess.Popen([sys.executable, "-m", "ffn_tools", "-q", *cmd, "-o", str(many),
                             f"--ray={cluster.address}"], env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(many.parent.glob(".out.tmp-*/model-*.safetensors")):  # the tasks have begun writing
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    written = len(list(many.parent.glob(".out.tmp-*/model-*.safetensors")))
    cluster.remove_node(node)  # its raylet and workers killed, with whatever task they ran
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert written < shards  # killed before the run was done
    assert _digest(many) == _digest(one)
    assert not list(many.glob(f"{PART}*")) and not list(many.parent.glob(".out.*"))


def test_ray_is_refused_where_the_output_is_written_whole(sharded, tmp_path):
    r = run_cli("fuse-gateup", sharded, "-o", tmp_path / "one.safetensors", "--ray=127.0.0.1:1", ok=False)
    assert "--ray writes the shards of a directory" in r.output
    assert not list(tmp_path.iterdir())


def _flip_expert(sd: dict) -> None:
    name = "model.layers.1.block_sparse_moe.experts.2.w13.weight"
    if name in sd:
        sd[name] = sd[name].clone()
        sd[name][0, 0] += 1.0


def test_verify_on_three_nodes_reports_what_one_node_does(cluster, tmp_path, monkeypatch):
    """Mixtral: 8 FFN pairs in 3 steps; the driver keeps the first FFN of its kind, the tasks run the experts (in
    ranges of one step each: a tiny pair is far less work than a task costs, so it would be one range)."""
    from tiny_models import build

    from ffn_tools.verification import distributed

    monkeypatch.setattr(distributed, "TASK_BYTES", 1)  # the driver's plan: the tasks take the ranges they are given

    src = build("mixtral", tmp_path / "mixtral", torch.bfloat16, max_shard_size="100KB")
    fused = tmp_path / "fused"
    run_cli("fuse-gateup", src, "-o", fused)
    args = ["-q", "verify", src, fused, "--no-load-check", "--json"]  # per-expert fused: not what transformers loads
    one = json.loads(run_cli(*args).output)
    many = json.loads(run_cli(*args, f"--ray={cluster.address}").output)
    assert one["passed"] and len(one["ffns"]) == 8
    assert without_times(many) == without_times(one)
    # a planted difference in an expert the tasks verify is found there, and said as one node says it
    bad = tmp_path / "bad"
    plant(fused, bad, edit=_flip_expert)
    one = json.loads(run_cli("-q", "verify", src, bad, "--no-load-check", "--json", ok=None).output)
    many = json.loads(run_cli("-q", "verify", src, bad, "--no-load-check", "--json", f"--ray={cluster.address}",
                              ok=None).output)
    assert not one["passed"] and without_times(many) == without_times(one)


def test_verify_on_a_ray_started_here_reports_what_one_process_does(sharded, tmp_path):
    """--ray alone: the command starts a local Ray (from its start, on a thread that lives until it ends: the
    processes of a Ray die with the thread that started them) and stops it after; the report is one process's."""
    fused = tmp_path / "fused"
    run_cli("fuse-gateup", sharded, "-o", fused)
    args = ["-q", "verify", str(sharded), str(fused), "--no-load-check", "--json"]
    one = json.loads(run_cli(*args).output)
    local = subprocess.run([sys.executable, "-m", "ffn_tools", *args, "--ray"], env=python_env(),
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    assert one["passed"] and without_times(json.loads(local.stdout)) == without_times(one)


def test_tasks_are_as_many_as_keep_the_cores_busy_and_none_is_less_work_than_it_costs():
    from ffn_tools.verification.distributed import TASK_BYTES, ranges

    steps = list(range(1, 31))
    assert ranges(steps, 3, TASK_BYTES // 2) == [steps]  # less than one task's worth: one range
    assert [len(r) for r in ranges(steps, 8, 2 * TASK_BYTES + 1)] == [10, 10, 10]  # three tasks' worth
    assert [len(r) for r in ranges(steps, 2, 10 * TASK_BYTES)] == [15, 15]  # the cores cap it
    assert sum(ranges(steps, 64, 100 * TASK_BYTES), []) == steps  # contiguous, in order, each step once


def test_nodes_on_this_machine_are_not_probed_and_the_others_are(cluster, tmp_path, monkeypatch):
    """A task goes (softly) to a node that sees its input files: nodes at this machine's address see its files; a
    node elsewhere is asked by a probe task run there (here: every node, made to look elsewhere)."""
    from ffn_tools.cluster import _placement

    files = [tmp_path / f"shard-{k}" for k in range(2)]
    for f in files:
        f.write_bytes(b"x" * 100)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        for elsewhere in (False, True):
            if elsewhere:
                monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "203.0.113.7")
            places = _placement(ray, [{str(files[0])}, {str(f) for f in files}, {str(files[1])}])
            assert len({p.node_id for p in places}) == 3 and all(p.soft for p in places)  # in turn among holders
    finally:
        ray.shutdown()


def test_the_library_runs_on_ray_as_the_command_line_does(cluster, sharded, tmp_path):
    """ffn_tools.fuse_gateup(..., ray=ADDRESS): the tasks are given the plan's slices, as for the command line."""
    import ffn_tools

    from ffn_tools.layouts import CONCAT

    one, many = tmp_path / "one" / "out", tmp_path / "ray" / "out"
    ffn_tools.fuse_gateup(str(sharded), str(one), max_shard_size=30_000, layout=CONCAT)
    # an option that is not plain data (a layout object): nothing runs the call again, so nothing needs it to be
    ffn_tools.fuse_gateup(str(sharded), str(many), max_shard_size=30_000, layout=CONCAT, ray=cluster.address)
    assert _digest(many) == _digest(one)


def test_an_address_nothing_answers_at_is_refused_at_once(sharded, tmp_path):
    """Ray would wait a minute or more for it: refused within seconds, nothing left behind."""
    r = run_cli("fuse-gateup", sharded, "-o", tmp_path / "out", "--ray=127.0.0.1:1", ok=False)
    assert "--ray 127.0.0.1:1: nothing answers there" in r.output
    assert not list(tmp_path.iterdir())
