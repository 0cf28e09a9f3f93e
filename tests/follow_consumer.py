"""A stand-in training rank for follow-mode crash trials: the real ShardStream(follow=True), the
real consumption watermarks and deletion, and a "model" that is the list of sample ids trained on.

    python tests/follow_consumer.py URI RANK WORLD CKPT_DIR [--every N] [--shuffle-buffer K] [--step-s S]
                                    [--no-delete]

Each yielded sample is "trained" (appended to the list, then a sleep of --step-s). Every --every
samples, and at the end of the follow epoch, a checkpoint is committed the way `layertap train`
commits one: the stream's state_dict and the trained list written to CKPT_DIR/rank{R}.json
(atomically, by rename), then, as `--delete-consumed` does, this rank's watermark is recorded
(`record_consumed`, the shards `stream.consumed_shards(state)` names) and rank 0 deletes the data
every rank has consumed (`delete_consumed`). A restarted rank resumes from its checkpoint: what it
trained after it is lost with the process, as a model's unsaved steps are.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from layertap.manifests.consumption import delete_consumed, record_consumed
from layertap.storage.store import open_store
from layertap.train import ShardStream, StreamConfig

CONFIG = dict(follow=True, follow_poll_s=0.3, seed=3)


def checkpoint_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.json"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("ckpt_dir")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--shuffle-buffer", type=int, default=4)
    p.add_argument("--step-s", type=float, default=0.04)
    p.add_argument("--no-delete", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    store = open_store(a.uri)
    path = checkpoint_path(a.ckpt_dir, a.rank)
    stream = ShardStream(a.uri, config=StreamConfig(**CONFIG, shuffle_buffer=a.shuffle_buffer), rank=a.rank,
                         world_size=a.world)

    def after_checkpoint(state: dict) -> None:
        if a.no_delete:
            return
        record_consumed(store, rank=a.rank, world_size=a.world, shards=stream.consumed_shards(state),
                        step=int(sum(state["consumed"])))
        if a.rank == 0:
            delete_consumed(store)

    trained: list[list] = []

    def commit(done: bool) -> None:
        state = stream.state_dict()
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"state": state, "trained": trained, "done": done}))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        after_checkpoint(state)

    if path.exists():
        saved = json.loads(path.read_text())
        if saved["done"]:  # killed after its last checkpoint, maybe before its watermark
            after_checkpoint(saved["state"])
            print("done (resumed after the end)", flush=True)
            return
        stream.load_state_dict(saved["state"])
        trained = saved["trained"]
        print(f"resumed at {len(trained)} samples", flush=True)
        if stream.epoch > 0:
            # Checkpointed at the follow epoch's last sample (the position rolls on to epoch 1 as it is
            # yielded) and killed before the final commit: the follow epoch is trained. Iterating would
            # run epoch 1, as `layertap train` does only when --epochs/--steps ask for more.
            commit(done=True)
            print(f"done (resumed at the follow epoch's end): {len(trained)} samples", flush=True)
            return

    since = 0
    for sample in stream:
        trained.append([sample["sample_id"], bool(sample["padding"])])
        time.sleep(a.step_s)
        since += 1
        if since >= a.every:
            commit(done=False)
            since = 0
    commit(done=True)
    print(f"done: {len(trained)} samples", flush=True)


if __name__ == "__main__":
    main()
