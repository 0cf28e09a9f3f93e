"""`layertap status` of a run with hundreds of failed and stopped shards (what a store outage leaves
across a 150,000-shard run, at a scale a test can write): it reads only the newest failure records,
in parallel, and groups them by error, while its counts stay exact. Real failure records on a
local folder and the moto S3 server; GETs counted by a thin wrapper around the real store."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest

import fake_worker
from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.cli import format_status
from layertap.manifests.records import FailureRecord, Producer, encode
from layertap.manifests.status import FAILURE_DETAILS, run_status
from layertap.storage.units import id_ranges
from layertap.storage.store import ObjectStore

SHARDS = 330  # 0-199 failed, 200-299 stopped from outside, 300-329 pending
OWN, STOPPED = range(200), range(200, 300)


class CountingStore:
    """A real store that counts the GETs made through it: what `status` costs, without timing it."""

    def __init__(self, store: ObjectStore):
        self._store = store
        self._lock = threading.Lock()
        self.gets: list[str] = []

    def get(self, key: str) -> bytes:
        with self._lock:
            self.gets.append(key)
        return self._store.get(key)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def error_of(shard: int) -> tuple[str, str]:
    if shard in STOPPED:
        return "TransientStoreError", "503 SlowDown after 10 retries"
    if shard % 4 == 0:
        return "ValueError", f"sample {shard} has no tokens\nmore detail"
    return "RuntimeError", "CUDA out of memory\nTraceback (most recent call last): ..."


def fail(store: ObjectStore, shard: int, preempted: bool = False) -> None:
    """The failure record a worker writes (`WorkQueue`'s claim), newer for a higher shard id."""
    error_type, error = error_of(shard)
    producer = asdict(Producer.current(shard % 8))
    record = FailureRecord(shard=shard, error_type=error_type, error=error, producer=producer, attempt=1,
                           time=1_700_000_000 + shard, preempted=preempted)
    key = layout.failure_key(shard, 1_700_000_000_000 + shard, producer["token"], 1, stopped=shard in STOPPED)
    store.put(key, encode(record))


@pytest.fixture
def outage(store):
    """A planned run whose first 300 shards failed: 200 of their own fault, 100 stopped."""
    fake_worker.plan(store, samples=SHARDS, shard_bytes=1)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: fail(store, s), range(300)))
    return store


def test_status_reads_only_the_newest_failure_records(outage):
    counted = CountingStore(outage)
    s = run_status(counted)
    failure_gets = [k for k in counted.gets if k.startswith(layout.FAILURES)]
    assert len(failure_gets) <= 2 * FAILURE_DETAILS  # one GET per failed shard read 300
    assert len(counted.gets) <= 2 * FAILURE_DETAILS + 5

    # The counts come from the listing: exact; the details are the newest of each kind.
    assert (s["shards_failed"], s["shards_interrupted"], s["shards_pending"]) == (200, 100, 30)
    assert [f["shard"] for f in s["failed"]] == list(range(200 - FAILURE_DETAILS, 200))
    assert [f["shard"] for f in s["interrupted"]] == list(range(300 - FAILURE_DETAILS, 300))
    assert all(f["stopped"] for f in s["interrupted"]) and not any(f["stopped"] for f in s["failed"])
    assert (s["failed_ranges"], s["interrupted_ranges"]) == ("0-199", "200-299")
    assert json.loads(json.dumps(s))["shards_failed"] == 200  # still plain JSON


def test_status_text_of_many_failures_is_grouped_and_bounded(outage, capsys):
    text = format_status(run_status(outage))
    lines = text.splitlines()
    assert len(lines) < 25, text  # 300 lines before
    assert f"  FAILED 200 shards: 0-199; the newest {FAILURE_DETAILS}, by error:" in lines
    newest = range(200 - FAILURE_DETAILS, 200)
    values = [s for s in newest if s % 4 == 0]
    runtime = [s for s in newest if s % 4]
    assert re.search(rf"^ +{len(runtime)}  RuntimeError: CUDA out of memory  \(shards {id_ranges(runtime)}; "
                     r"newest on host \S+ rank \d", text, re.M), text
    for shard in values:  # grouped by the error's whole first line: these differ
        assert re.search(rf"^ +1  ValueError: sample {shard} has no tokens  \(shards {shard};", text, re.M), text
    assert (f"  INTERRUPTED 100 shards: 200-299 (a rerun finishes them); the newest {FAILURE_DETAILS}, by error:"
            in lines)
    assert re.search(rf"^ +{FAILURE_DETAILS}  TransientStoreError: 503 SlowDown after 10 retries  "
                     rf"\(shards {300 - FAILURE_DETAILS}-299;", text, re.M), text
    assert "FAILED shard" not in text and "INTERRUPTED shard" not in text and "Traceback" not in text

    capsys.readouterr()
    assert cli(["status", outage.uri]) == 4  # failed shards: the exit code scripts wait on
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 25 and "  FAILED 200 shards: 0-199; " in out


def test_status_shards_still_lists_every_shard_with_its_error(outage):
    s = run_status(outage, shards=True)
    entries = {e["shard"]: e for e in s["shards"]}
    assert len(entries) == SHARDS and len(s["failed"]) == FAILURE_DETAILS  # the report stays bounded
    for shard in range(300):
        error_type, _ = error_of(shard)
        assert entries[shard]["state"] == ("interrupted" if shard in STOPPED else "failed")
        assert entries[shard]["error"].startswith(error_type)
    text = format_status(s)
    # each row names its shard's last error: the docs said it did, the text said "failed" alone
    assert re.search(rf"^  000250  interrupted\s+{error_of(250)[0]}: ", text, re.M)
    assert re.search(rf"^  000007  failed\s+{error_of(7)[0]}: ", text, re.M)


def test_a_few_failures_are_still_reported_one_line_each(store):
    """Up to `FAILURE_DETAILS` of each kind: every record is read and printed, as before."""
    fake_worker.plan(store, samples=SHARDS, shard_bytes=1)
    for shard in (3, 4, 250):
        fail(store, shard)
    fail(store, 5, preempted=True)  # a record of a layertap before stop keys: interrupted, read inside
    s = run_status(store)
    assert (s["shards_failed"], s["shards_interrupted"]) == (2, 2)
    assert [f["shard"] for f in s["failed"]] == [3, 4] and [f["shard"] for f in s["interrupted"]] == [5, 250]
    text = format_status(s)
    assert re.findall(r"^  (FAILED|INTERRUPTED) shard (\d+) ", text, re.M) == [
        ("FAILED", "3"), ("FAILED", "4"), ("INTERRUPTED", "5"), ("INTERRUPTED", "250")]
    assert re.search(r"^  FAILED shard 4 \(1 attempt, last on host \S+ rank 4\): ValueError: sample 4 has no "
                     r"tokens\nmore detail$", text, re.M), text
    assert "by error" not in text and "shards:" not in text


def test_id_ranges():
    assert id_ranges([40, 3, 4, 5, 17]) == "3-5, 17, 40"
    assert id_ranges([]) == ""
    assert id_ranges([7, 7, 8]) == "7-8"  # an id named twice is one id
    assert id_ranges(range(0, 100, 2), limit=3) == "0, 2, 4 and 47 more"
    # --shards 0-99 of a run of 3: every id it lacks named, as ranges (it read "[3, 4, 5, 6, 7]")
    from layertap.manifests.work import check_shard_ids

    with pytest.raises(ValueError, match=r"^--shards names 3-99 \(97 ids\), which the run does not have \(it has "
                                         r"shards 0-2\)$"):
        check_shard_ids(range(100), 3)
