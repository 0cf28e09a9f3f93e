"""Follow mode's look ahead (docs/LOADER.md, "Follow mode", "Discovery"): a consumer with plenty
of work in hand lists `commits/` ever more rarely even while commits land all the time (thousands
of consumers each listing every 0.5 s would ask S3 for far more than a prefix serves), and still
gets every shard and ends when extraction is over."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_follow import env  # noqa: E402
from layertap.manifests import layout  # noqa: E402
from layertap.storage.local import LocalStore  # noqa: E402
from layertap.train import ShardStream, StreamConfig, follow  # noqa: E402

FLOOR_S, POLL_S = 0.05, 0.4  # the 0.5 s floor and follow_poll_s, scaled down so the test takes seconds


def test_a_consumer_with_work_in_hand_looks_ahead_rarely_while_commits_land(tmp_path, monkeypatch):
    monkeypatch.setattr(follow, "FIRST_DELAY_S", FLOOR_S)
    looks: list[float] = []
    plain_list = LocalStore.list

    def counted(self, prefix: str = "", start_after: str = ""):  # a look lists the feed, or all commits
        if prefix in (layout.COMMITS, layout.FEED) and threading.current_thread() is threading.main_thread():
            looks.append(time.monotonic())
        return plain_list(self, prefix, start_after)

    monkeypatch.setattr(LocalStore, "list", counted)
    uri, samples = str(tmp_path / "run"), 300
    worker = subprocess.Popen([sys.executable, str(HERE / "fake_worker.py"), uri, "--samples", str(samples),
                               "--slow", "0.005"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    commits = tmp_path / "run" / layout.COMMITS
    while not commits.is_dir() or len(list(commits.iterdir())) < 8:  # work in hand from the start
        assert worker.poll() is None
        time.sleep(0.05)
    stream = ShardStream(uri, config=StreamConfig(follow=True, follow_poll_s=POLL_S, shuffle_buffer=4, seed=3),
                         rank=0, world_size=1)
    start, ids, extracted = time.monotonic(), [], None
    for x in stream:  # consumes slower than the worker commits: the known work only grows
        ids.append(x["sample_id"])
        time.sleep(0.02)
        if extracted is None and worker.poll() is not None:
            extracted = time.monotonic()
    assert worker.wait(timeout=60) == 0
    assert extracted is not None, "extraction outlasted the consumer: it never had plenty in hand"
    assert Counter(ids) == Counter(f"s{i:05d}" for i in range(samples)) and stream.epoch == 1
    while_landing = [t for t in looks if start <= t <= extracted]
    floor_looks = (extracted - start) / FLOOR_S  # what a look per 0.5 s (scaled) comes to
    assert len(while_landing) < floor_looks / 3, (len(while_landing), floor_looks)
