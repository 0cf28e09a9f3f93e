"""A training job on two nodes of a real Slurm cluster: two slurmds on this host (.ci/slurm.sh with
SLURM_NODES=2), each node a launcher of its own, the ranks meeting at the first node's address."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_slurm import job_done, running_cluster, scontrol_jobs, submit, wait_for
from tiny_models import tiny_model_dir

sys.path.insert(0, str(Path(__file__).parent))
import fake_worker  # noqa: E402

pytestmark = pytest.mark.slow  # starts a two-node Slurm cluster and runs a real job on it


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    yield from running_cluster(tmp_path_factory, nodes=2)


def test_a_training_job_runs_on_two_nodes_and_a_resubmission_keeps_its_process_count(two_nodes, tmp_path, capsys,
                                                                                     monkeypatch):
    """`submit train --nodes 2` had never run on more than one node: one launcher per node (srun),
    the machine rank from SLURM_NODEID, the rendezvous at the first node's NodeAddr (the second
    node's name resolves nowhere). The job trains, checkpoints by 2 ranks and exports; a
    resubmission on one node is refused at submission (the job refused it in the queue), and one
    asking more nodes than the partition has too."""
    monkeypatch.chdir(tmp_path)
    model = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    run, out = str(tmp_path / "run"), str(tmp_path / "drafter")
    fake_worker.work(run)
    args = ["--data", run, "--model", model, "--out", out, "--batch-size", "2", "--block-size", "4",
            "--max-anchors", "8", "--steps", "6", "--save-every", "3"]
    slurm = ["--gpus-per-node", "0", "--cpus-per-task", "1", "--mem", "none"]
    assert submit("train", "--parsable", "--nodes", "3", *slurm, *args) == 2
    assert "--nodes 3: partition debug has 2 node(s) in all (sinfo)" in capsys.readouterr().err
    assert submit("train", "--parsable", "--nodes", "2", *slurm, *args) == 0
    [job] = capsys.readouterr().out.split()
    log = tmp_path / "layertap-logs" / f"layertap-train-{job}.out"
    try:
        wait_for(lambda: job_done(job), "the two-node job to end", 300)
    finally:
        subprocess.run(["scancel", job], check=False)
    [info] = scontrol_jobs(job)
    assert info["JobState"] == "COMPLETED", log.read_text()[-4000:]
    assert info["NodeList"] == f"{os.uname().nodename.split('.')[0]},{os.uname().nodename.split('.')[0]}n2"
    text = log.read_text()
    assert "rank 0/2 INFO" in text, text[-4000:]  # a launcher per node: one group of 2 ranks
    steps = [json.loads(line)["step"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6] and (Path(out) / "drafter" / "config.json").exists()
    state = json.loads((Path(out) / "checkpoints" / "step-00000006" / "state.json").read_text())
    assert state["world_size"] == 2
    shutil.rmtree(Path(out) / "drafter")  # as if stopped after its last checkpoint: a resubmission resumes it
    assert submit("train", "--dry-run", "--nodes", "1", *slurm, *args) == 2
    assert "holds a checkpoint written by 2 process(es), which the job resumes, and it would run 1 " \
        "(--nodes 1 x 1 per node)" in capsys.readouterr().err
