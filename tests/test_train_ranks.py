"""Ranks of one `layertap train` stream the same data: two real processes over gloo.

Also run as a script, by torch.distributed.run (see `__main__` below): the trainer then meets an
extraction that commits one more shard right after rank 0 has read the run's commits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from layertap.cli import main as cli

REPO = Path(__file__).resolve().parents[1]


def two_ranks(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`argv` (a script, or `-m` and a module, with its arguments) as two ranks of torchrun over gloo."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *argv], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


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


@pytest.mark.slow
def test_a_resume_reads_the_checkpoint_on_rank_0_alone_and_goes_on_as_before(extracted, target, tmp_path):
    """Every rank read the weights and moments from the store (~22 GB at a 27B target's shapes:
    ~22 TB at 1,000 ranks); rank 0 reads them and broadcasts them now. Resumed from step 4, two
    ranks train steps 5-8 as the run that never stopped did."""
    from test_train import FAST

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = ["--data", str(extracted), "--model", target, "--steps", "8", "--save-every", "4", *FAST]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    p = subprocess.run([*launch, "-m", "layertap", "train", *args, "--out", str(whole)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"^\S+ \S+ rank 0/2 INFO layertap\.", p.stderr, re.M), p.stderr[-3000:]  # which rank said it
    shutil.copytree(whole, resumed)  # as a run stopped after its checkpoint at step 4 left it
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")
    shutil.rmtree(resumed / "drafter")
    (resumed / "checkpoints" / "latest.json").write_text(json.dumps({"step": 4, "prefix": "checkpoints/step-00000004"}))
    reads = tmp_path / "reads"
    reads.mkdir()
    p = subprocess.run([*launch, __file__, "--count-reads", str(reads), *args, "--out", str(resumed), "--resume"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-8000:]
    a, b = ([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] for out in (whole, resumed))
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in b[4:]] == pytest.approx([r["loss"] for r in a[4:]], rel=1e-5)
    files = {"checkpoints/step-00000004/drafter.safetensors", "checkpoints/step-00000004/optimizer.safetensors"}
    read = {rank: json.loads((reads / f"{rank}.json").read_text()) for rank in (0, 1)}
    assert {k for k, data in read[0] if data} == files  # rank 0 read the tensors
    assert {k for k, data in read[1] if not data} == files and not any(data for _, data in read[1])  # headers alone

    # One rank refusing the resume (its position is missing): every rank stops with an error that says
    # so, none in a broadcast that the other left (a gloo "Connection closed by peer" traceback).
    step8 = resumed / "checkpoints" / "step-00000008"
    (step8 / json.loads((step8 / "state.json").read_text())["loader_states"] / "rank-00001.json").unlink()
    p = subprocess.run([*launch, "-m", "layertap", "train", *args, "--steps", "12", "--out", str(resumed),
                        "--resume"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode != 0
    assert "lacks rank 1's loader position" in p.stderr and "rank(s) 1 refused the resume" in p.stderr, p.stderr[-6000:]
    assert "Connection closed by peer" not in p.stderr

    # Ranks that found different checkpoints (an --out local to each node): every rank stops, saying so.
    p = subprocess.run([*launch, __file__, "--no-checkpoint-on-rank-1", "-", *args, "--steps", "12", "--out",
                        str(resumed), "--resume"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode != 0
    assert p.stderr.count("the ranks found different checkpoints") >= 2, p.stderr[-6000:]
    assert "Connection closed by peer" not in p.stderr


@pytest.mark.slow
def test_a_rank_that_dies_leaves_the_others_an_error_that_says_so_and_how_to_go_on(extracted, target, tmp_path):
    """Rank 1 dies in step 4 (killed, out of memory): rank 0, left in the step's collective, said
    so with gloo's "Connection closed by peer" traceback and no word of what next. It says which
    checkpoint is kept and to resume, and the advised resume goes on to the end."""
    from test_train import FAST

    out = tmp_path / "out"
    args = ["--data", str(extracted), "--model", target, "--steps", "6", "--save-every", "2", "--out", str(out), *FAST]
    p = two_ranks(tmp_path, __file__, "--die-on-rank-1-in-step", "4", *args)
    assert p.returncode != 0
    said = [line for line in p.stderr.splitlines() if line.startswith("error: rank 0 of 2: ")]
    assert len(said) == 1 and "a collective between the ranks failed" in said[0], p.stderr[-6000:]
    assert "most likely another rank stopped, and its own error, above, says why" in said[0]
    assert f"the latest checkpoint in {out} is step 2: once the cause is fixed, the same command with --resume " \
        "continues from there" in said[0]
    before = p.stderr.split(said[0])[0]  # after it, only the launcher's report of its ranks' ends
    assert "Traceback" not in before and "by peer" not in before, p.stderr[-6000:]
    p = two_ranks(tmp_path, "-m", "layertap", "train", *args, "--resume")
    assert p.returncode == 0, p.stderr[-6000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert p.stderr.count("resumed from") == 1  # rank 0's INFO lines alone: rank 1's said the same again


@pytest.mark.slow
def test_a_signal_to_rank_0_stops_every_rank_at_the_step_boundary_with_a_checkpoint(extracted, target, tmp_path):
    """SIGTERM to rank 0 (a launcher's forwarded Ctrl-C, Slurm's preemption): the step's reduce
    tells every rank, each checkpoints and exits 143. A rank that did not return there waited in
    the next step's collective for rank 0, which had exited (a review found it)."""
    from test_train import FAST

    out = tmp_path / "out"
    args = ["--data", str(extracted), "--model", target, "--steps", "8", "--save-every", "100", "--out", str(out),
            *FAST]
    p = two_ranks(tmp_path, __file__, "--sigterm-rank-0-in-step", "3", *args)
    assert p.returncode != 0
    assert "a collective between the ranks failed" not in p.stderr, p.stderr[-6000:]
    assert p.stderr.count("stopped at step 3 by a signal") == 1, p.stderr[-6000:]
    # each rank stopped itself at the boundary (143), unless the launcher, seeing the other end first, sent it
    # SIGTERM as it exited (-15 on a busy machine); none ended in an error (1, 2) out of the next step's collective
    ends = re.findall(r"rank\s*: \d \(local_rank: \d\)\s*\n\s*exitcode\s*: (-?\d+)", p.stderr)
    assert ends and set(ends) <= {"143", "-15"}, p.stderr[-3000:]
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == 3


def _count_reads(folder: str) -> None:
    """Record which safetensors files this rank reads, and whether with their data."""
    from layertap.train import checkpoint

    load, seen = checkpoint.load_safetensors, []

    def counted(store, key, *data):
        seen.append((key, data[0] if data else True))
        Path(folder, f"{os.environ['RANK']}.json").write_text(json.dumps(seen))
        return load(store, key, *data)

    checkpoint.load_safetensors = counted


def _no_checkpoint_on_rank_1() -> None:
    """Rank 1 finds no checkpoint where rank 0 finds one, as on an --out local to each node."""
    from layertap.train import trainer

    if os.environ["RANK"] == "1":
        trainer.load_latest = lambda store, tensors=True: None


def _on_rank_at_step(rank: str, step: int, act: Callable[[], None]) -> None:
    """`act()` on rank `rank` as step `step` (1-based) starts."""
    from layertap.train import trainer

    train_step = trainer.train_step

    def acting(run, at, *rest):
        if os.environ["RANK"] == rank and at + 1 == step:
            act()
        return train_step(run, at, *rest)

    trainer.train_step = acting


if __name__ == "__main__":  # a rank of the tests above: HELD COMMIT TRAIN-ARGS..., --count-reads FOLDER TRAIN-ARGS...
    if sys.argv[1] == "--count-reads":  # or --no-checkpoint-on-rank-1 - TRAIN-ARGS..., --die-on-rank-1-in-step N ...
        _count_reads(sys.argv[2])
    elif sys.argv[1] == "--die-on-rank-1-in-step":  # exits at once, as a process killed or out of memory does
        _on_rank_at_step("1", int(sys.argv[2]), lambda: os._exit(9))
    elif sys.argv[1] == "--sigterm-rank-0-in-step":
        _on_rank_at_step("0", int(sys.argv[2]), lambda: os.kill(os.getpid(), signal.SIGTERM))
    elif sys.argv[1] == "--no-checkpoint-on-rank-1":
        _no_checkpoint_on_rank_1()
    else:
        _commit_after_rank_0_reads(sys.argv[1], sys.argv[2])
    sys.exit(cli(["train", *sys.argv[3:]]))


@pytest.mark.slow
def test_a_follow_run_with_nothing_left_is_refused_on_every_rank(extracted, target, tmp_path):
    """Every committed shard consumed and deleted: rank 0 said "nothing is left to train on", and
    the other ranks, left in the next collective, "a collective between the ranks failed ... the
    same command starts again". Every rank says the refusal."""
    import shutil

    from test_train import FAST

    from layertap.manifests import layout
    from layertap.manifests.state import listed_shards
    from layertap.storage.store import open_store

    run = tmp_path / "run"
    shutil.copytree(extracted, run)
    store = open_store(str(run))
    for shard in listed_shards(store, layout.COMMITS):
        store.put(layout.consumed_marker_key(shard), b"")
    p = two_ranks(tmp_path, "-m", "layertap", "train", "--data", str(run), "--model", target, "--follow", "--out",
                  str(tmp_path / "out"), *FAST)
    assert p.returncode != 0
    assert "nothing is left to train on" in p.stderr, p.stderr[-6000:]
    assert "rank(s) 0 refused to train on" in p.stderr and "a collective between the ranks failed" not in p.stderr
