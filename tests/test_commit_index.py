"""The commit index: a reader's start costs a listing and one GET, and never trusts a stale entry."""

from __future__ import annotations

import json

import pytest
import zstandard

import fake_worker
from layertap.manifests import layout
from layertap.manifests.commit_index import read_commits, write_index
from layertap.manifests.records import decode_commit
from layertap.storage.store import ObjectNotFound, StoreError, open_store
from layertap.train import ShardStream


class CountingStore:
    """The store, with the keys of its GETs and PUTs recorded."""

    def __init__(self, store, deny_put: bool = False):
        self.store, self.deny_put = store, deny_put
        self.gets: list[str] = []
        self.puts: list[str] = []

    def get(self, key):
        self.gets.append(key)
        return self.store.get(key)

    def put(self, key, data):
        self.puts.append(key)
        if self.deny_put:
            raise StoreError(f"access denied writing {key!r}")
        return self.store.put(key, data)

    def __getattr__(self, name):
        return getattr(self.store, name)


def one_by_one(store) -> list:
    return [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]


def refresh(store) -> list:
    """What rank 0 does: read the commits, then store the index if it lacked any."""
    commits = read_commits(store)
    if commits.new_index is not None:
        write_index(store, commits.new_index)
    return commits.records


def test_one_get_replaces_a_get_per_commit_and_follows_withdrawals_and_redos(store_uri):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    truth = one_by_one(store)
    keys = [layout.commit_key(c.shard) for c in truth]
    assert len(truth) >= 5

    first = CountingStore(store)
    commits = read_commits(first)
    assert commits.records == truth and first.puts == []  # reading writes nothing
    assert first.gets == [layout.COMMIT_INDEX, *keys]
    assert write_index(first, commits.new_index) and first.puts == [layout.COMMIT_INDEX]

    again = CountingStore(store)
    commits = read_commits(again)
    assert commits.records == truth and commits.new_index is None  # nothing new to write
    assert again.gets == [layout.COMMIT_INDEX]

    # `verify` withdraws shard 2 (its commit goes), the extractor redoes it (a new commit record).
    old = decode_commit(store.get(layout.commit_key(2)), "c")
    store.delete(layout.commit_key(2))
    after_withdrawal = CountingStore(store)
    assert [c.shard for c in read_commits(after_withdrawal).records] == [c.shard for c in truth if c.shard != 2]
    assert after_withdrawal.gets == [layout.COMMIT_INDEX]
    assert fake_worker.work(store_uri) == [2]
    redone = CountingStore(store)
    records = refresh(redone)
    assert records == one_by_one(store)
    assert records[2].data_key != old.data_key  # the new record, not the snapshot's
    assert redone.gets == [layout.COMMIT_INDEX, layout.commit_key(2)]
    assert read_commits(CountingStore(store)).records == records


def test_a_rewritten_commit_of_the_same_size_is_read_again(store_uri):
    """Even within the second of its listing time (S3's LastModified resolution), a commit written
    again is not taken from the snapshot: entries are matched on the object's version (S3's ETag)."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    refresh(store)
    raw = store.get(layout.commit_key(1))
    obj = json.loads(raw)
    obj["data_key"] = obj["data_key"][:-5] + ("b" if obj["data_key"][-5] != "b" else "c") + ".lts"
    changed = json.dumps(obj, separators=(",", ":")).encode()
    assert len(changed) == len(raw)
    store.put(layout.commit_key(1), changed)
    counting = CountingStore(store)
    assert read_commits(counting).records[1].data_key == obj["data_key"]
    assert counting.gets == [layout.COMMIT_INDEX, layout.commit_key(1)]


@pytest.mark.moto_only  # index logic: no S3 call the first two tests do not make
def test_a_bad_or_foreign_index_is_ignored_and_rewritten(store_uri, caplog):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    truth = one_by_one(store)
    foreign = {"format": "layertap-commit-index", "version": 99, "commits": {}}
    for junk in (b"not zstd", zstandard.ZstdCompressor().compress(b"{not json"),
                 zstandard.ZstdCompressor().compress(json.dumps(foreign).encode())):
        store.put(layout.COMMIT_INDEX, junk)
        caplog.clear()
        counting = CountingStore(store)
        assert refresh(counting) == truth
        assert len(counting.gets) == 1 + len(truth) and counting.puts == [layout.COMMIT_INDEX]
        assert f"ignoring {store.uri.rstrip('/')}/{layout.COMMIT_INDEX}" in caplog.text
        assert read_commits(CountingStore(store)).records == truth


@pytest.mark.moto_only  # index logic: no S3 call the first two tests do not make
def test_an_index_entry_that_does_not_decode_falls_back_to_the_commit(store_uri):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    truth = one_by_one(store)
    refresh(store)
    obj = json.loads(zstandard.ZstdDecompressor().decompress(store.get(layout.COMMIT_INDEX)))
    obj["commits"][layout.commit_key(3)][2] = {"kind": "commit", "version": 1, "data_key": "../../etc/passwd"}
    store.put(layout.COMMIT_INDEX, zstandard.ZstdCompressor().compress(json.dumps(obj).encode()))
    counting = CountingStore(store)
    assert read_commits(counting).records == truth
    assert counting.gets == [layout.COMMIT_INDEX, layout.commit_key(3)]


@pytest.mark.moto_only  # index logic: no S3 call the first two tests do not make
def test_read_only_credentials_still_read_the_run(store_uri, caplog):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    denied = CountingStore(store, deny_put=True)
    commits = read_commits(denied)
    assert commits.records == one_by_one(store)
    assert not write_index(denied, commits.new_index)
    assert denied.puts == [layout.COMMIT_INDEX] and "could not write index/commits.json.zst" in caplog.text
    with pytest.raises(ObjectNotFound):
        store.get(layout.COMMIT_INDEX)


@pytest.mark.moto_only  # index logic: no S3 call the first two tests do not make
def test_opening_a_stream_writes_nothing_and_rank_0_refreshes_the_index_explicitly(store_uri):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    ShardStream(store_uri, rank=1, world_size=2)
    a = ShardStream(store_uri, rank=0, world_size=2)
    with pytest.raises(ObjectNotFound):  # opening reads, whatever the rank
        store.get(layout.COMMIT_INDEX)
    assert a.refresh_index() and store.get(layout.COMMIT_INDEX)  # what the trainer's rank 0 calls
    assert not a.refresh_index()  # written once
    gets, get = [], store.get
    store.get = lambda key: (gets.append(key), get(key))[1]
    b = ShardStream(store, rank=1, world_size=2)
    assert [g for g in gets if g.startswith(layout.COMMITS)] == [] and layout.COMMIT_INDEX in gets
    assert b.shards == a.shards and not b.refresh_index()  # the index lacked nothing: nothing to write


def test_records_come_in_shard_order_past_a_million_shards(store_uri):
    """Commit keys pad ids to 6 digits: from shard 1,000,000 on, key order is not shard order."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    record = json.loads(store.get(layout.commit_key(1)))
    for shard in (999_999, 1_000_000, 1_000_001):
        data_key = layout.data_key(shard, record["data_key"].split("-", 1)[1].removesuffix(".lts"))
        store.put(layout.commit_key(shard), json.dumps({**record, "shard": shard, "data_key": data_key}).encode())
    shards = [c.shard for c in read_commits(store).records]
    assert shards == sorted(shards) and shards[-3:] == [999_999, 1_000_000, 1_000_001]
