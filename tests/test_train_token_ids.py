"""A run whose token ids lie outside the target's vocabulary is refused, naming a sample."""

from __future__ import annotations

import sys
from pathlib import Path

from layertap.cli import main as cli
from layertap.storage.store import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_extract import TINY  # noqa: E402
from bench.gpu_train_cli import make_run, make_target, sample_lengths  # noqa: E402


def test_token_ids_beyond_the_targets_vocabulary_are_a_clear_error(tmp_path, capsys):
    """A run written without the target's hashes (by hand, or a tool of one's own: the target
    check has nothing to compare) over a larger vocabulary than --model's. The drafter's embedding
    failed with an IndexError traceback (a device-side assert on CUDA)."""
    target = tmp_path / "target"
    make_target(target, dict(TINY, vocab_size=256))
    run = str(tmp_path / "run")
    make_run(run, str(target), dict(TINY, vocab_size=100_000), [1, 3], sample_lengths(6, 16, 40, 1), seed=1,
             shard_bytes=1 << 20, writers=1)
    out = str(tmp_path / "out")
    assert cli(["train", "--data", run, "--model", str(target), "--out", out, "--steps", "2", "--batch-size", "2",
                "--max-anchors", "4", "--block-size", "4", "--drafter-layers", "1"]) == 2
    err = capsys.readouterr().err
    assert "outside the vocabulary of the target" in err and "(256 ids)" in err and "sample 's0000" in err, err
    assert not list(open_store(out).list("checkpoints"))  # nothing trained, nothing saved
