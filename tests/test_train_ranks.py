"""Ranks of one `layertap train` stream the same data: two real processes over gloo.

Also run as a script, by torch.distributed.run (see `__main__` below): the trainer then meets an
extraction that commits one more shard right after rank 0 has read the run's commits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layertap.cli import main as cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    from tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


@pytest.fixture(scope="module")
def extracted(target, tmp_path_factory) -> Path:
    """A finished extraction of 24 chats in a local folder, in several shards."""
    from test_extract import write_chats

    tmp = tmp_path_factory.mktemp("run")
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp / "chats.jsonl", 24), "--out",
                str(tmp / "run"), "--layers", "1,3", "--max-length", "64", "--shard-bytes", "20KB",
                "--log-dir", str(tmp / "logs")]) == 0
    return tmp / "run"


@pytest.mark.slow
def test_ranks_train_on_the_shards_rank_0_found_while_extraction_commits_more(extracted, target, tmp_path):
    """Rank 0 reads the commits first; a shard committed before rank 1 reads them must not give
    rank 1 another epoch (another size, order and step count): it streams rank 0's list."""
    from test_train import FAST

    data = tmp_path / "run"
    shutil.copytree(extracted, data)
    commits = sorted((data / "commits").iterdir())
    late, held = commits[-1], tmp_path / commits[-1].name
    late.rename(held)  # extraction has not committed it yet
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           str(held), str(late), "--data", str(data), "--model", target, "--out", str(out), "--steps", "2", *FAST]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-8000:]  # with PYTHONFAULTHANDLER (tests/run.sh), a crash's stacks
    assert late.exists()  # committed while the ranks opened the run
    step = out / "checkpoints" / "step-00000002"
    folder = step / json.loads((step / "state.json").read_text())["loader_states"]
    loader = [json.loads((folder / f"rank-0000{r}.json").read_text()) for r in (0, 1)]
    assert [(s["rank"], s["num_shards"]) for s in loader] == [(0, len(commits) - 1), (1, len(commits) - 1)]
    assert loader[0]["shards"] == loader[1]["shards"] and loader[0]["num_samples"] == loader[1]["num_samples"]


def _commit_after_rank_0_reads(held: str, commit: str) -> None:
    """The extraction commits a shard just after rank 0 has read the commits (only rank 0 refreshes
    the commit index, at once after reading them)."""
    from layertap.train.stream import ShardStream

    refresh = ShardStream.refresh_index

    def refresh_then_commit(self) -> bool:
        written = refresh(self)
        os.replace(held, commit)
        return written

    ShardStream.refresh_index = refresh_then_commit


if __name__ == "__main__":  # a rank of the test above: HELD COMMIT TRAIN-ARGS...
    _commit_after_rank_0_reads(sys.argv[1], sys.argv[2])
    sys.exit(cli(["train", *sys.argv[3:]]))
