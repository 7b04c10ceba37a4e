"""common.cluster.node_count under each launcher: the real DeepSpeed launcher and torchrun; Slurm and AWS
Batch environments as their documentation lists them."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.cluster import node_count
from common.errors import UserError
from common.net import free_port
from tests.conftest import REPO, run_env, run_python

# Every rank records what node_count() reads from the environment its launcher gave it.
PROBE = f"""
import json, os, sys
sys.path.insert(0, {str(REPO)!r})
from common.cluster import node_count
keys = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "CROSS_SIZE", "LOCAL_SIZE", "GROUP_WORLD_SIZE")
record = {{"nodes": node_count(), **{{k: os.environ.get(k) for k in keys}}}}
with open(os.path.join(sys.argv[-1], "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(record, f)
"""


def _probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def _records(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def test_deepspeed_launcher_sets_cross_size_not_local_world_size(tmp_path: Path) -> None:
    # What the runner hands to launch.py on the second of two nodes with two slots each (pdsh / --no_ssh).
    world_info = base64.urlsafe_b64encode(json.dumps({"node-a": [0, 1], "node-b": [0, 1]}).encode()).decode()
    out = tmp_path / "out"
    out.mkdir()
    r = run_python(
        [
            "-m",
            "deepspeed.launcher.launch",
            f"--world_info={world_info}",
            "--node_rank=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(_probe(tmp_path)),
            str(out),
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    recs = _records(out)
    assert sorted(recs) == ["rank2", "rank3"]  # node 1 holds global ranks 2 and 3
    for rec in recs.values():
        assert rec["CROSS_SIZE"] == "2" and rec["LOCAL_SIZE"] == "2" and rec["WORLD_SIZE"] == "4"
        assert rec["LOCAL_WORLD_SIZE"] is None  # why WORLD_SIZE // LOCAL_WORLD_SIZE said 1 node
        assert rec["nodes"] == 2


def test_torchrun_two_nodes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    probe = str(_probe(tmp_path))
    agents = []
    for n in (0, 1):
        rdzv = [f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            *rdzv,
            probe,
            str(out),
        ]
        log = subprocess.PIPE
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=log, stderr=subprocess.STDOUT, text=True))
    for a in agents:
        output, _ = a.communicate(timeout=180)
        assert a.returncode == 0, output
    recs = _records(out)
    assert sorted(recs) == ["rank0", "rank1"]
    for rec in recs.values():
        assert rec["GROUP_WORLD_SIZE"] == "2" and rec["LOCAL_WORLD_SIZE"] == "1" and rec["CROSS_SIZE"] is None
        assert rec["nodes"] == 2


def test_torchrun_env_without_group_world_size() -> None:
    assert node_count({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "9", "LOCAL_RANK": "1"}) == 2


# sbatch --nodes=4 allocation, then a step on 3 of them (srun --nodes=3); variables from man sbatch / srun.
SLURM_ALLOCATION = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NODELIST": "gpu-[001-004]",
    "SLURM_NODEID": "0",
    "SLURM_GPUS_ON_NODE": "8",
}
SLURM_STEP = {**SLURM_ALLOCATION, "SLURM_STEP_NUM_NODES": "3", "SLURM_NNODES": "3", "SLURM_PROCID": "5"}


def test_slurm_allocation_and_step() -> None:
    assert node_count(SLURM_ALLOCATION) == 4
    assert node_count(SLURM_STEP) == 3  # DeepSpeed's Slurm runner: ranks started by srun directly
    assert node_count({"SLURM_NNODES": "2"}) == 2  # older Slurm: only SLURM_NNODES


def test_launcher_count_wins_over_the_allocation() -> None:
    # deepspeed --num_nodes 2 inside the 4-node allocation: launch.py's CROSS_SIZE is what the job uses
    env = {**SLURM_ALLOCATION, "CROSS_SIZE": "2", "CROSS_RANK": "1", "LOCAL_SIZE": "8", "WORLD_SIZE": "16"}
    assert node_count(env) == 2


def test_aws_batch_multi_node() -> None:
    env = {
        "AWS_BATCH_JOB_ID": "abc#1",
        "AWS_BATCH_JOB_NUM_NODES": "3",
        "AWS_BATCH_JOB_NODE_INDEX": "1",
        "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
        "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.0.0.5",
    }
    assert node_count(env) == 3


def test_single_process_and_bad_values() -> None:
    assert node_count({}) == 1
    assert node_count({"CROSS_SIZE": ""}) == 1  # set but empty: ignored
    with pytest.raises(UserError, match="CROSS_SIZE='two' is not an integer"):
        node_count({"CROSS_SIZE": "two"})
    with pytest.raises(UserError, match="AWS_BATCH_JOB_NUM_NODES='0'"):
        node_count({"AWS_BATCH_JOB_NUM_NODES": "0"})
    with pytest.raises(UserError, match="not a multiple"):
        node_count({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
