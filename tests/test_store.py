"""The object store on both backends: a local folder and a moto S3 server over HTTP."""

from __future__ import annotations

import array
import builtins
import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
import botocore
import botocore.exceptions as bexc
import urllib3
import pytest
from faultproxy import FaultProxy

import fake_worker

import layertap.storage.s3
from layertap import storage
from layertap.cli import main as cli
from layertap.storage.s3 import MiB, _plain_http_response, direct_reads, untested_versions
from layertap.storage.store import (
    WRITE_PROBE,
    EndpointUnreachable,
    InvalidKey,
    ObjectNotFound,
    RangeNotSatisfiable,
    StoreError,
    TransientStoreError,
    open_store,
    split_object_uri,
)


def test_put_get_range_size_delete(store):
    store.put("a/b.bin", b"0123456789")
    assert store.get("a/b.bin") == b"0123456789"
    assert store.get_range("a/b.bin", 2, 5) == b"234"
    assert store.get_range("a/b.bin", 8, 100) == b"89"
    assert store.get_range("a/b.bin", 10, 20) == b""  # at the end: nothing, not an error
    assert store.size("a/b.bin") == 10
    store.put("a/b.bin", b"new")  # overwrite
    assert store.get("a/b.bin") == b"new"
    store.delete("a/b.bin")
    assert not store.exists("a/b.bin")
    store.delete("a/b.bin")  # deleting twice is fine
    with pytest.raises(ObjectNotFound):
        store.get("a/b.bin")
    with pytest.raises(ObjectNotFound):
        store.size("missing")


def test_delete_many_removes_every_key_missing_ones_included(store):
    keys = [f"d/{i:05d}" for i in range(1203)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, b"x"), keys))
    store.put("kept", b"y")
    store.delete_many([*keys, "d/never-written"])
    assert [o.key for o in store.list()] == ["kept"]
    store.delete_many([])


@pytest.mark.parametrize("faults", [("500",), ("reset-after",)])
def test_s3_deletes_in_batches_of_a_thousand_keys_and_retries_a_failed_batch(s3_bucket, s3_endpoint, faults):
    """2,500 keys: 3 DeleteObjects requests, not 2,500 DELETEs; a batch that failed (or landed
    unheard: its retry deletes keys already gone) is sent again."""
    batch = lambda method, path: method == "POST" and path.endswith("?delete")  # noqa: E731
    keys = [f"d/{i:05d}" for i in range(2500)]
    seed = open_store(f"s3://{s3_bucket}/p")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: seed.put(k, b"x"), keys))
    with FaultProxy(s3_endpoint, rate=1.0, faults=faults, match=batch, limit=1) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url)
        store.delete_many(keys)
        assert proxy.counts[faults[0]] == 1 and proxy.counts["requests"] == 4  # 3 batches, one sent twice
    assert list(seed.list()) == []


def test_a_range_far_past_the_end_costs_what_the_object_holds(store):
    """A corrupt length asking for terabytes must not make the read allocate them: a local
    read(n) allocates n bytes however few the file holds."""
    store.put("a.bin", b"0123456789")
    assert store.get_range("a.bin", 2, 1 << 50) == b"23456789"


def test_a_range_is_read_into_a_callers_buffer(store):
    data = os.urandom(3 * MiB + 12345)
    store.put("big.bin", data)
    out = bytearray(len(data) - 100)
    assert store.read_range_into("big.bin", 100, memoryview(out)) == len(out)
    assert out == data[100:]
    short = bytearray(50)
    assert store.read_range_into("big.bin", len(data) - 20, memoryview(short)) == 20  # the object ends first
    assert short[:20] == data[-20:]
    assert store.read_range_into("big.bin", len(data) + 5, memoryview(short)) == 0
    with pytest.raises(ObjectNotFound):
        store.read_range_into("missing.bin", 0, memoryview(short))
    floats = array.array("f", [0.0] * 4)  # a view of 4-byte items: 16 bytes read, on each backend
    assert store.read_range_into("big.bin", 0, memoryview(floats)) == 16 and floats.tobytes() == data[:16]


def test_a_ranged_body_is_read_from_the_socket_straight_into_the_buffer(s3_bucket):
    """The fast path of S3Store.read_range_into still finds http.client's response under
    botocore's and urllib3's wrappers on the versions installed, which pyproject.toml's boto3
    bound keeps among those it was tested with (a change in either would fall back to a copy)."""
    assert direct_reads(), f"untested: {untested_versions({'botocore': botocore.__version__, 'urllib3': urllib3.__version__})}"
    store = open_store(f"s3://{s3_bucket}/r")
    store.put("x.bin", b"0123456789")
    resp = store.client.get_object(Bucket=s3_bucket, Key="r/x.bin", Range="bytes=2-5")
    fp = _plain_http_response(resp["Body"])
    assert fp is not None
    out = bytearray(4)
    assert fp.readinto(memoryview(out)) == 4 and out == b"2345"


def test_direct_reads_are_used_only_on_tested_versions():
    assert untested_versions({"botocore": botocore.__version__, "urllib3": urllib3.__version__}) == []
    assert untested_versions({"botocore": "1.44.0", "urllib3": "2.7.0"}) == ["botocore 1.44.0"]
    assert untested_versions({"botocore": "1.43.11", "urllib3": "1.26.20"}) == ["urllib3 1.26.20"]


def test_a_ranged_get_past_the_end_is_typed_not_matched_by_text(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/r")
    store.put("x.bin", b"0123456789")
    with pytest.raises(RangeNotSatisfiable):
        store._call("ranged get", "x.bin", lambda: store.client.get_object(Bucket=store.bucket, Key=store._key("x.bin"),
                                                                         Range="bytes=10-19"))
    assert store.get_range("x.bin", 10, 20) == b"" and store.read_range_into("x.bin", 12, memoryview(bytearray(4))) == 0


def test_a_server_that_ignores_range_requests_is_a_clear_error(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/r")
    store.put("x.bin", b"0123456789")

    def as_whole_object(parsed, **_):  # what a server that ignores Range sends: 200, no Content-Range
        parsed.pop("ContentRange", None)

    store.client.meta.events.register("after-call.s3.GetObject", as_whole_object)
    with pytest.raises(StoreError, match="does not serve HTTP Range requests"):
        store.read_range_into("x.bin", 2, memoryview(bytearray(4)))
    # get_range too: it took the whole object for the range, and a shard's reader then called a
    # good shard corrupt ("does not match the footer index")
    with pytest.raises(StoreError, match="asked for bytes 2-5, the server answered without a Content-Range"):
        store.get_range("x.bin", 2, 6)


def test_a_get_whose_etag_is_no_md5_is_taken_once_two_reads_agree(s3_bucket):
    """A store whose ETags are not the MD5 of the bytes (KMS-encrypted objects name themselves and are
    not compared; another server's scheme may not): the body read twice alike, at once (no retry
    spent: with max_attempts 1 every get failed), is what it holds; after three such objects the
    store compares no more.
    A KMS object is read once."""
    store = open_store(f"s3://{s3_bucket}/e")
    store.put("x.bin", b"0123456789")
    answers = []

    def other_etag(parsed, **_):
        answers.append(parsed.get("ETag"))
        parsed["ETag"] = '"' + "0" * 32 + '"'

    store.client.meta.events.register("after-call.s3.GetObject", other_etag)
    assert store.get("x.bin") == b"0123456789" and len(answers) == 2 and store.retries == 0  # no try spent
    for key in ("y.bin", "z.bin"):
        store.put(key, b"abc")
        assert store.get(key) == b"abc"
    assert len(answers) == 6  # three objects of ETags that are no MD5: not compared from here on
    assert store.get("x.bin") == b"0123456789" and len(answers) == 7
    kms = open_store(f"s3://{s3_bucket}/e")
    kms.client.meta.events.register("after-call.s3.GetObject", lambda parsed, **_: parsed.update(
        ETag='"' + "1" * 32 + '"', ServerSideEncryption="aws:kms"))
    assert kms.get("x.bin") == b"0123456789" and kms.retries == 0


def test_an_object_is_read_to_a_file_a_slice_at_a_time_and_checked_as_get_checks(s3_bucket, s3_endpoint, tmp_path,
                                                                                 monkeypatch):
    """An S3 --dataset's objects (several GB) were held whole in memory by `get` before they were
    written to the local cache: `get_to_file` writes them a slice at a time, its MD5 checked
    against the ETag as `get` checks it: a body damaged on its way is read again, a store whose
    ETags are no MD5 reads alike twice at once, and bodies that never match are refused."""
    from layertap.storage.s3 import READ_SLICE
    from layertap.storage.store import open_configured_store

    monkeypatch.setenv("LAYERTAP_S3_CHECKSUM_MODE", "when_required")  # a PUT with no checksum: none sent back
    data = os.urandom(3 * READ_SLICE + 5)
    open_store(f"s3://{s3_bucket}/f").put("big.bin", data)
    dest = tmp_path / "big.bin"
    dest.write_bytes(b"x" * (5 * READ_SLICE))  # a file holding more, from an earlier try: written over whole
    with FaultProxy(s3_endpoint, rate=1.0, faults=("flip",), match=lambda method, path: method == "GET",
                    limit=1) as proxy:
        store = open_configured_store(f"s3://{s3_bucket}/f", {"endpoint_url": proxy.url})
        with open(dest, "r+b") as f:
            assert store.get_to_file("big.bin", f) == len(data)
        assert proxy.counts["flip"] == 1 and dest.read_bytes() == data and store.retries == 0  # read again at once
    answers = []

    def other_etag(parsed, **_):
        answers.append(parsed.get("ETag"))
        parsed["ETag"] = '"' + str(len(answers) % 10) * 32 + '"'

    for same in (True, False):
        store = open_configured_store(f"s3://{s3_bucket}/f", {"max_attempts": 2})
        store.client.meta.events.register("after-call.s3.GetObject", (lambda parsed, **_: parsed.update(
            ETag='"' + "0" * 32 + '"')) if same else other_etag)
        with open(dest, "wb") as f:
            if same:  # what the store holds: taken, no try spent
                assert store.get_to_file("big.bin", f) == len(data) and store.retries == 0
            else:
                with pytest.raises(StoreError, match="the body read differs from the object's ETag"):
                    store.get_to_file("big.bin", f)
        assert dest.read_bytes() == data  # each read started the file over
    assert len(answers) == 4  # 2 tries of 2 reads each


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "fallback"])
def test_a_ranged_read_survives_a_connection_reset_mid_body(s3_bucket, s3_endpoint, monkeypatch, direct):
    """On both read paths: from the socket into the buffer, and botocore's readinto (versions
    the direct path was not tested with)."""
    used = []

    def watched(body):
        fp = _plain_http_response(body) if direct else None
        used.append(fp is not None)
        return fp

    monkeypatch.setattr(storage.s3, "_plain_http_response", watched)
    data = os.urandom(4 * MiB)
    with FaultProxy(s3_endpoint, rate=1.0, faults=("cut",), limit=1,
                    match=lambda method, path: method == "GET" and path.endswith("/big.bin")) as proxy:
        store = open_store(f"s3://{s3_bucket}/r", endpoint_url=proxy.url)
        store.put("big.bin", data)
        out = bytearray(len(data) - 10)
        assert store.read_range_into("big.bin", 10, memoryview(out)) == len(out)
        assert proxy.counts["cut"] == 1 and store.retries == 1
    assert out == data[10:]
    assert used == [direct, direct]  # the cut body and its resumption


def test_a_ranged_read_cut_mid_body_resumes_from_its_last_good_byte(s3_bucket):
    data = os.urandom(3 * MiB)
    store = open_store(f"s3://{s3_bucket}/r")
    store.put("big.bin", data)
    ranges: list[str] = []

    class CutAfter:  # the first body fails once `left` bytes have come, as a reset stream does
        left = MiB + 5

        def __init__(self, body):
            self.body = body

        def read(self, amt):
            if CutAfter.left <= 0:
                raise bexc.ResponseStreamingError(error="connection reset")
            chunk = self.body.read(min(amt, CutAfter.left))
            CutAfter.left -= len(chunk)
            return chunk

        def close(self):
            self.body.close()

    def on_response(parsed, **_):
        ranges.append(parsed["ContentRange"])
        if len(ranges) == 1:
            parsed["Body"] = CutAfter(parsed["Body"])

    store.client.meta.events.register("after-call.s3.GetObject", on_response)
    out = bytearray(len(data) - 10)
    assert store.read_range_into("big.bin", 10, memoryview(out)) == len(out)
    assert out == data[10:]
    end = len(data) - 1
    assert ranges == [f"bytes 10-{end}/{len(data)}", f"bytes {10 + MiB + 5}-{end}/{len(data)}"]


def test_put_if_absent(store):
    assert store.put_if_absent("commit/1.json", b"first") is True
    assert store.put_if_absent("commit/1.json", b"second") is False
    assert store.get("commit/1.json") == b"first"


def test_put_if_absent_counts_its_own_link_answered_exists_as_created(tmp_path, monkeypatch):
    """On NFS a LINK retransmitted after its reply was lost makes the name, then answers EEXIST
    (link(2)): the object is ours, as on S3 a retried conditional PUT's is. NFS is not at hand,
    so the syscall is made to answer that way."""
    real_link = os.link

    def nfs_link(src, dst):
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists", dst)

    store = open_store(str(tmp_path / "store"))
    monkeypatch.setattr(storage.local.os, "link", nfs_link)
    assert store.put_if_absent("commits/7.json", b"attempt A") is True
    assert store.put_if_absent("commits/7.json", b"attempt B") is False
    monkeypatch.undo()
    assert store.get("commits/7.json") == b"attempt A"
    assert [o.key for o in store.list()] == ["commits/7.json"] and store.list_pending_uploads() == []


@pytest.mark.parametrize("code", [errno.EPERM, errno.EOPNOTSUPP])
def test_a_folder_without_hard_links_names_that_not_permissions(tmp_path, monkeypatch, code):
    """link(2) answers EPERM (or EOPNOTSUPP) where the filesystem has no hard links, e.g. a FUSE
    mount of an object store: the error said "permission denied; choose a writable output folder"
    of a folder the temp file beside it had just been written to. No such filesystem is at hand, so
    the syscall is made to answer that way."""
    def no_links(src, dst):
        raise OSError(code, os.strerror(code), dst)

    store = open_store(str(tmp_path / "store"))
    monkeypatch.setattr(storage.local.os, "link", no_links)
    with pytest.raises(StoreError, match="has no hard links") as e:
        store.put_if_absent("commits/7.json", b"x")
    assert "permission denied" not in str(e.value) and "S3 endpoint" in str(e.value)
    monkeypatch.undo()
    assert [o.key for o in store.list()] == []  # no temp file left behind


def test_a_read_only_local_folder_is_the_stores_error_on_every_write_and_delete(tmp_path, monkeypatch):
    """On a read-only mount every call answers EROFS, the removal of a temp file that was never
    made included: that OSError replaced the store's error (a traceback from put, put_if_absent,
    a commit's create), and delete raised OSError past the callers that catch StoreError (a
    sweep, a lease's release). The syscalls are made to answer so: no read-only mount is at hand."""
    store = open_store(str(tmp_path / "store"))
    store.put("shards/a.lts", b"data")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), args[0] if args else None)

    for name in ("open", "remove", "link", "replace"):
        monkeypatch.setattr(storage.local.os if name != "open" else builtins, name, read_only)
    for call in (lambda: store.put("shards/x.json", b"{}"), lambda: store.put_if_absent("manifest.json", b"{}"),
                 lambda: store.delete("shards/a.lts")):
        with pytest.raises(StoreError, match="the filesystem is read-only; choose a writable output folder"):
            call()
    monkeypatch.undo()
    assert store.get("shards/a.lts") == b"data"
    store.delete("shards/gone.lts")  # an object already gone is no error


def test_a_local_folder_that_fails_to_list_or_read_is_an_error_not_an_empty_run(tmp_path, monkeypatch, capsys):
    """A folder whose listing fails (EIO or ESTALE on an NFS mount) read as empty: os.walk skips
    what it cannot read, so `verify` of a finished run checked nothing and exited 0 and `status`
    said no shard was done. A failed read of another user's file said "cannot write". The
    syscalls are made to fail: no flaky mount is at hand, and root reads every folder."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    assert cli(["verify", uri]) == 0
    capsys.readouterr()
    real_scandir = os.scandir

    def flaky(path="."):
        if os.path.basename(os.fspath(path).rstrip("/")) == "commits":
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return real_scandir(path)

    with monkeypatch.context() as m:
        m.setattr(storage.local.os, "scandir", flaky)
        for command in (["verify", uri], ["status", uri]):
            assert cli(command) != 0, command
            err = capsys.readouterr().err
            assert f"cannot read {os.path.join(uri, 'commits')}: Input/output error" in err, err
        with pytest.raises(StoreError, match="cannot read"):
            open_store(uri).list_pending_uploads("commits/")
    assert [o.key for o in open_store(uri).list("nothing/here/")] == []  # a folder not there holds nothing

    denied = OSError(errno.EACCES, os.strerror(errno.EACCES))
    with monkeypatch.context() as m:
        m.setattr(storage.local, "open", lambda *a, **k: (_ for _ in ()).throw(denied), raising=False)
        store = open_store(uri)
        for read in (lambda: store.get("manifest.json"), lambda: store.get_range("manifest.json", 0, 4)):
            with pytest.raises(StoreError, match="cannot read .*manifest.json: permission denied; check the folder"):
                read()


def test_list_by_prefix_is_sorted_and_scoped(store):
    keys = [f"shards/{i:05d}.lts" for i in range(30)] + ["commits/00001.json", "shardsx"]
    for k in keys:
        store.put(k, k.encode())
    listed = list(store.list("shards/"))
    assert [o.key for o in listed] == sorted(k for k in keys if k.startswith("shards/"))
    assert all(o.size == len(o.key) for o in listed)
    assert {o.key for o in store.list("shards")} == {k for k in keys if k.startswith("shards")}
    assert {o.key for o in store.list()} == set(keys)


def test_a_listing_starts_after_a_key(store):
    """What follow mode's look at the feed relies on: only the keys after `start_after` come back,
    whether or not that key exists, and the prefix still scopes them."""
    keys = ["feed/0000000000100.000001", "feed/0000000000200.000000", "feed/0000000000200.000002",
            "feed/0000000000300.000003", "feedx/0000000000250.000009"]
    for k in keys:
        store.put(k, b"")
    assert [o.key for o in store.list("feed/", start_after="feed/0000000000200")] == keys[1:4]
    assert [o.key for o in store.list("feed/", start_after="feed/0000000000200.000000")] == keys[2:4]
    assert [o.key for o in store.list("feed/", start_after="feed/0000000000301")] == []
    assert [o.key for o in store.list("feed/", start_after="")] == keys[:4]


def test_s3_list_paginates_past_one_page(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/p")
    keys = [f"k/{i:05d}" for i in range(1105)]  # S3 pages hold 1,000 keys
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, b"x"), keys))
    assert [o.key for o in store.list("k/")] == keys
    assert [o.key for o in store.list("k/", start_after="k/00002")] == keys[3:]  # on every page after


def test_a_listing_retries_each_failed_page_on_its_own(s3_bucket, s3_endpoint):
    store = open_store(f"s3://{s3_bucket}/p")
    keys = [f"k/{i:05d}" for i in range(1003)]  # two pages
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, b"x"), keys))
    is_list = lambda method, path: method == "GET" and "list-type=2" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=0.5, seed=3, faults=("503", "reset"), match=is_list) as proxy:
        flaky = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url)
        assert [o.key for o in flaky.list("k/")] == keys
        assert flaky.retries == proxy.injected >= 2  # one request in two failed, and was tried again alone


@pytest.mark.parametrize("bad", ["", "/abs", "../escape", "a/../../b", "a//b", "a\\b", "./a"])
def test_keys_cannot_escape_the_root(store, bad):
    with pytest.raises(InvalidKey):
        store.put(bad, b"x")


def test_put_if_absent_race_between_processes_has_one_winner(store_uri):
    """Eight real processes race to create one key; exactly one wins, and its payload is stored."""
    code = textwrap.dedent(f"""
        import sys
        from layertap.storage.store import open_store
        s = open_store({store_uri!r})
        print(s.put_if_absent("race/marker", ("worker-" + sys.argv[1]).encode()))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(8)]
    results = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(results) == ["False"] * 7 + ["True"]
    winner = results.index("True")
    assert open_store(store_uri).get("race/marker") == f"worker-{winner}".encode()


def test_s3_checks_conditional_writes_once_per_store_before_its_first_create(s3_endpoint, s3_bucket):
    """A server that ignored `If-None-Match` would let two workers both win one lease: the store
    checks it before its first create, once however many threads create at once, in 3 requests
    (create, create again refused, delete); reads and plain writes pay nothing."""
    seen: list[tuple[str, str]] = []

    def record(method: str, path: str) -> bool:
        seen.append((method, path))
        return False  # no faults: the proxy only watches

    with FaultProxy(s3_endpoint, match=record) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url)
        store.put("a", b"1")
        assert store.get("a") == b"1" and [o.key for o in store.list()] == ["a"]
        assert len(seen) == 3  # PUT, GET, list: no check yet
        seen.clear()
        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(lambda i: store.put_if_absent(f"c/{i}", b"x"), range(8)))
        probe = [method for method, path in seen if WRITE_PROBE in path]
        assert probe == ["PUT", "PUT", "DELETE"] and len(seen) == 3 + 8
        seen.clear()
        assert not store.put_if_absent("c/0", b"y")  # refused, and its body read: no check again
        assert [method for method, _ in seen] == ["PUT", "GET"]
    assert [o.key for o in store.list()] == ["a"] + [f"c/{i}" for i in range(8)]  # the probe is gone


def test_small_object_goes_up_in_one_put(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/p")
    with store.open_writer("small") as w:
        w.write(b"abc")
        w.write(b"def")
    assert store.get("small") == b"abcdef"
    assert store.list_pending_uploads() == []


@pytest.mark.parametrize("k", [1, 2, 3])
def test_multipart_writer_bounds_memory_and_round_trips(s3_bucket, k):
    p = 5 * MiB
    store = open_store(f"s3://{s3_bucket}/p", part_size=p, max_parts_in_memory=k, threads=4)
    data = os.urandom(3 * MiB) * 8  # 24 MiB -> 5 parts
    w = store.open_writer("big.bin")
    for i in range(0, len(data), 777_777):  # odd chunk sizes straddle part boundaries
        w.write(data[i : i + 777_777])
    assert not store.exists("big.bin"), "object must not be visible before close"
    w.close()
    assert store.get("big.bin") == data
    assert 0 < w.peak_buffered_bytes <= k * p
    assert w.bytes_written == len(data)
    assert store.list_pending_uploads() == []


def test_failure_inside_writer_leaves_nothing(store_uri):
    options = {"part_size": 5 * MiB, "max_parts_in_memory": 2} if store_uri.startswith("s3://") else {}
    store = open_store(store_uri, **options)
    with pytest.raises(RuntimeError, match="boom"):
        with store.open_writer("shards/x.lts") as w:
            w.write(os.urandom(12 * MiB))  # at least two parts uploaded on S3
            raise RuntimeError("boom")
    assert not store.exists("shards/x.lts")
    assert list(store.list()) == []
    assert store.list_pending_uploads() == []


def test_a_shard_whose_header_fails_leaves_no_pending_upload(store_uri):
    """`write_shard` opened the object, then the ShardWriter's header raised (metadata JSON cannot
    encode) before its `with` began: the upload (a temp file and its handle, locally) was left open."""
    from layertap.storage.format import ShardMeta
    from layertap.storage.writer import write_shard

    store = open_store(store_uri)
    meta = ShardMeta(model="m", layers=[1], hidden_size=4, codec="bf16", final_state="none", run_id="r",
                     shard_id=0, extra={"not json": {1, 2}})
    with pytest.raises(TypeError, match="set"):
        write_shard(store, "shards/000000-a.lts", meta, [])
    assert list(store.list()) == []
    assert store.list_pending_uploads() == []


def test_a_local_store_syncs_the_folders_that_name_data_and_created_records(tmp_path, monkeypatch):
    """A commit record created after its data object was named could survive a power loss that
    the data's rename did not (the folder not synced): `verify` then withdrew a shard that was whole."""
    import layertap.storage.local  # noqa: F401 (storage.local below)

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    store = open_store(str(tmp_path / "store"))
    monkeypatch.setattr(storage.local.os, "fsync", fsync)
    with store.open_writer("shards/000000-a.lts") as w:
        w.write(b"data")
    assert synced[-1] == str(tmp_path / "store" / "shards")
    assert store.put_if_absent("commits/000000.json", b"{}")
    assert synced[-1] == str(tmp_path / "store" / "commits")


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_a_signal_during_a_local_put_leaves_no_pending_upload(tmp_path, monkeypatch, where):
    """A SIGTERM handler raises wherever the worker is; a put it cuts short (e.g. a tally marker
    after the commit) must not leave a temp file that reads as an upload left open."""
    import layertap.storage.local  # noqa: F401 (storage.local below)

    class Stop(BaseException):
        pass

    def interrupted(*args, **kwargs):
        raise Stop()

    store = open_store(str(tmp_path / "store"))
    store.put("tally/keep", b"")
    monkeypatch.setattr(storage.local.os, where, interrupted)
    with pytest.raises(Stop):
        store.put("tally/cut", b"x")
    with pytest.raises(Stop):
        with store.open_writer("shards/cut.lts") as w:
            w.write(b"y" * 100)
    monkeypatch.undo()
    assert [o.key for o in store.list()] == ["tally/keep"]
    assert store.list_pending_uploads() == []


def test_killed_writer_leaves_no_visible_object_and_pending_upload_is_aborted(store_uri):
    """SIGKILL mid-upload: the key never appears; the leftover upload is listed, then aborted."""
    options = {"part_size": 5 * MiB, "max_parts_in_memory": 2} if store_uri.startswith("s3://") else {}
    code = textwrap.dedent(f"""
        import os, sys, time
        from layertap.storage.store import open_store
        s = open_store({store_uri!r}, **{options!r})
        w = s.open_writer("shards/killed.lts")
        w.write(os.urandom(16 << 20))
        print("written", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    time.sleep(1.0)  # let in-flight parts land
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = open_store(store_uri)
    assert not store.exists("shards/killed.lts")
    assert [o.key for o in store.list()] == []
    pending = store.list_pending_uploads("shards/")
    assert [p.key for p in pending] == ["shards/killed.lts"]
    assert store.abort_pending_uploads("shards/") == 1
    assert store.list_pending_uploads() == []


def test_pending_uploads_of_a_sibling_run_are_neither_listed_nor_aborted(s3_endpoint, s3_bucket):
    """s3://b/runs/a holds what lies under runs/a/, as `list` says, not the uploads of the runs
    runs/a-2 and runs/ab that may still be writing."""
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for key in ("runs/a/shards/1.lts", "runs/a-2/shards/2.lts", "runs/ab/shards/3.lts"):
        client.create_multipart_upload(Bucket=s3_bucket, Key=key)
    store = open_store(f"s3://{s3_bucket}/runs/a")
    assert [u.key for u in store.list_pending_uploads()] == ["shards/1.lts"]
    assert store.abort_pending_uploads() == 1
    left = client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
    assert sorted(u["Key"] for u in left) == ["runs/a-2/shards/2.lts", "runs/ab/shards/3.lts"]


def test_a_stop_signal_while_abort_waits_for_a_part_is_raised_once_the_upload_is_aborted(s3_endpoint, s3_bucket):
    """A signal handler raises (a preempted worker's stop, a BaseException) while `abort` waits
    for a part still uploading: the upload is aborted all the same, then the stop goes on up."""

    class Stop(BaseException):
        pass

    def stop(*_):
        raise Stop()

    is_part = lambda method, path: method == "PUT" and "partNumber=" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("stall",), stall_s=1.5, match=is_part) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, part_size=5 * MiB)
        w = store.open_writer("x.bin")
        w.write(os.urandom(5 * MiB))  # part 1 ships, and takes 1.5 s
        old = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            with pytest.raises(Stop):
                w.abort()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert proxy.counts["stall"] == 1
        assert store.list_pending_uploads() == [] and not store.exists("x.bin")


def test_missing_bucket_is_a_clear_error(s3_endpoint):
    store = open_store("s3://no-such-bucket-layertap/p")
    with pytest.raises(StoreError, match="bucket 'no-such-bucket-layertap' does not exist") as e:
        store.put("x", b"y")
    assert "nor can it be" not in str(e.value)
    # a name S3 cannot have (radosgw refuses it as InvalidBucketName, moto says NoSuchBucket): said, so no one goes
    # to create it
    with pytest.raises(StoreError, match=r"'ab'.*S3 bucket names are 3-63 lowercase letters, digits, '\.' and '-'"):
        open_store("s3://ab/p").put("x", b"y")


def test_a_uri_that_names_no_bucket_is_a_clear_error(capsys):
    """botocore refused such names at the first request: a ParamValidationError traceback, exit 1,
    from `status`, `verify`, `inspect` and `delete` (host:port in the URI is an easy mistake)."""
    for uri, says in [("s3://localhost:9000/bucket/run", "'localhost:9000' is not a bucket name (the endpoint goes "
                                                         "in AWS_ENDPOINT_URL, not the URI)"),
                      ("s3://my bucket/run", "'my bucket' is not a bucket name; use s3://bucket/prefix"),
                      ("s3://user:S3cret@host/run", "holds a user:password before its bucket: credentials go in")]:
        with pytest.raises(StoreError, match=re.escape(says)):
            open_store(uri)
        for command in (["status", uri], ["verify", uri], ["inspect", uri + "/shards/000000-x.lts"],
                        ["delete", uri, "--yes"]):
            assert cli(command) == 2, command
            err = capsys.readouterr().err
            assert says in err and "Traceback" not in err and "S3cret" not in err, (command, err)


def test_wrong_endpoint_is_a_clear_error_after_a_few_quick_tries(monkeypatch):
    """A refused connection is not worth the 8 tries a throttled request gets: the user hears
    about it within a second or so (3 tries), from one retry layer (botocore makes one try each)."""
    # discard port: nothing listens; a user:password in the URL is never printed
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://hunter:S3cret@127.0.0.1:9")
    store = open_store("s3://b/p", connect_timeout_s=1)
    with pytest.raises(EndpointUnreachable, match="cannot reach the S3 endpoint http://127.0.0.1:9 ") as e:
        store.get("x")
    assert "AWS_ENDPOINT_URL" in str(e.value) and "Connection refused" in str(e.value) and "S3cret" not in str(e.value)
    assert "tried 3 times" in str(e.value) and store.retries == 2
    assert store.options.max_attempts == 8
    assert "for get of s3://b/p/x" in str(e.value)  # the object, with its bucket and prefix
    # an endpoint from a --config file's "s3" settings: the message sends the user there, not to the variable
    configured = open_store("s3://b/p", endpoint_url="http://127.0.0.1:9", connect_timeout_s=1)
    with pytest.raises(EndpointUnreachable, match="check endpoint_url in the --config file's \"s3\" settings"):
        configured.get("x")


def test_an_endpoint_that_answered_before_is_given_the_full_retries_when_it_refuses():
    """A gateway restarting under a running job refuses connections for a while: once the store
    has reached the endpoint, refusals get the transient budget, not the 3 quick tries that tell a
    user their URL is wrong."""
    import boto3

    from s3server import start_moto_server

    proc, endpoint = start_moto_server()
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="layertap-restart")
        store = open_store("s3://layertap-restart/p", endpoint_url=endpoint, max_attempts=5, connect_timeout_s=1)
        store.put("k", b"v")
        assert store.get("k") == b"v"
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(EndpointUnreachable, match="tried 5 times"):  # the server is gone: refused
        store.get("k")
    assert store.retries == 4
    fresh = open_store("s3://layertap-restart/p", endpoint_url=endpoint, max_attempts=5, connect_timeout_s=1)
    with pytest.raises(EndpointUnreachable, match="tried 3 times"):  # never answered: a wrong URL
        fresh.get("k")


@pytest.mark.parametrize("faults", [("503",), ("500",), ("reset",)])
def test_transient_failures_are_retried_in_the_store_alone(s3_bucket, s3_endpoint, faults):
    """Throttling, server errors and resets: the store's retry loop tries `max_attempts` times in
    all, and botocore adds none (the proxy sees exactly that many requests)."""
    failing = lambda method, path: method == "GET" and path.endswith("/k")  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=faults, match=failing, limit=2) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, max_attempts=3)
        store.put("k", b"v")
        assert store.get("k") == b"v" and store.retries == 2
    with FaultProxy(s3_endpoint, rate=1.0, faults=faults, match=failing) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, max_attempts=3)
        with pytest.raises(TransientStoreError, match="tried 3 times"):
            store.get("k")
        assert proxy.counts[faults[0]] == 3


def test_no_credentials_is_a_clear_error(monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = open_store("s3://b/p")
    with pytest.raises(StoreError, match="no S3 credentials found"):
        store.get("x")


def test_store_errors_do_not_leak_the_secret_key(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SUPERSECRET-DO-NOT-PRINT")
    store = open_store("s3://no-such-bucket-layertap/p")
    with pytest.raises(StoreError) as e:
        store.get("x")
    assert "SUPERSECRET" not in str(e.value)


def test_s3_options_validation():
    with pytest.raises(ValueError, match="below S3's minimum"):
        open_store("s3://b/p", part_size=1 << 20)
    with pytest.raises(ValueError, match="above S3's maximum"):  # else refused at the first part, 9 parts in
        open_store("s3://b/p", part_size=6 << 30)
    with pytest.raises(ValueError, match="addressing_style"):
        open_store("s3://b/p", addressing_style="sideways")


def test_a_skewed_clock_is_named_as_such_not_as_the_credentials():
    """S3 answers a request dated over 15 minutes off with 403 RequestTimeTooSkewed, which read
    "check the credentials and their permissions"."""
    from botocore.exceptions import ClientError

    answer = {"Error": {"Code": "RequestTimeTooSkewed", "Message": "The difference ... is too large."},
              "ResponseMetadata": {"HTTPStatusCode": 403}}
    err = open_store("s3://b/p")._translate(ClientError(answer, "GetObject"), "get", "k")
    assert "this machine's clock is off" in str(err) and "credentials" not in str(err)


def test_an_expired_session_token_is_named_with_how_to_renew_it():
    """Temporary credentials expire within hours, a run lasts days: S3's 400 ExpiredToken read
    "failed: ExpiredToken ...", with no word of what to do."""
    from botocore.exceptions import ClientError

    answer = {"Error": {"Code": "ExpiredToken", "Message": "The provided token has expired."},
              "ResponseMetadata": {"HTTPStatusCode": 400}}
    err = open_store("s3://b/p")._translate(ClientError(answer, "PutObject"), "put", "commits/000001.json")
    assert type(err) is StoreError  # not transient: retrying with the same token cannot succeed
    assert "put of s3://b/p/commits/000001.json: the S3 credentials' session token is expired" in str(err)
    assert "aws sso login" in str(err) and "the same command goes on" in str(err)


def test_path_style_and_checksum_mode_reach_the_server(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/p", addressing_style="path", checksum_mode="when_required")
    store.put("k", b"v")
    assert store.get("k") == b"v"
    assert boto3.client("s3").get_object(Bucket=s3_bucket, Key="p/k")["Body"].read() == b"v"


def test_unwritable_local_output_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = open_store(str(tmp_path / "file" / "sub"))
    with pytest.raises(StoreError, match="cannot"):
        store.put("x", b"y")


def test_a_local_writer_that_runs_out_of_room_says_so_and_leaves_no_temp_file(tmp_path):
    """A full disk (here a file-size limit, EFBIG, in a child process) failed the write; the abort's
    close flushed the buffer again and raised a raw OSError, so the hidden temp file stayed (an
    upload left open) and the store's message was never given."""
    code = textwrap.dedent(f"""
        import resource, signal
        from layertap.storage.store import StoreError, open_store
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = open_store({str(tmp_path / "store")!r})
        store.put("tally/keep", b"")
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        for chunk in (3_000, 300_000):  # buffered, then written through
            w = store.open_writer("shards/big.lts")
            try:
                for _ in range(300_000 // chunk):
                    w.write(b"x" * chunk)
                w.close()
            except StoreError as e:
                print("StoreError:", e)
        print(sorted(o.key for o in store.list()), store.list_pending_uploads())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("StoreError: cannot access ") and "File too large" in line
                                   for line in lines[:2]), out.stdout
    assert lines[2] == "['tally/keep'] []"
    assert os.listdir(tmp_path / "store" / "shards") == []


def test_unsupported_scheme():
    with pytest.raises(StoreError, match="unsupported store URI"):
        open_store("gs://bucket/prefix")


def test_split_object_uri():
    assert split_object_uri("s3://b/run/shards/00001.lts") == ("s3://b/run/shards", "00001.lts")
    assert split_object_uri("s3://b/x.lts") == ("s3://b", "x.lts")
    assert split_object_uri("/tmp/run/x.lts") == ("/tmp/run", "x.lts")
    assert split_object_uri("file:///tmp/run/x.lts") == ("/tmp/run", "x.lts")


def test_open_stream_reads_front_to_back(store):
    data = os.urandom(100_000)
    store.put("obj", data)
    with store.open_stream("obj", chunk_size=7_000) as f:
        got = b"".join(iter(lambda: f.read(3_333), b""))
    assert got == data


def test_transient_failures_are_typed(monkeypatch):
    """What the store gave up retrying says so by its type, not its text."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: retry later
    store = open_store("s3://b/p", unreachable_attempts=1, connect_timeout_s=1)
    with pytest.raises(TransientStoreError):
        store.get("x")
    assert store.retries == 0


def test_permanent_failures_are_not_transient(s3_endpoint):
    with pytest.raises(StoreError) as e:
        open_store("s3://no-such-bucket-layertap/p").get("x")
    assert not isinstance(e.value, TransientStoreError)


def test_a_folder_removed_as_empty_between_its_making_and_a_write_is_made_again(tmp_path, monkeypatch):
    """A refused trainer removes its empty output as it releases its lease; a trainer starting there
    had just made lease/ for its own lease, and its write failed "No such file or directory"."""
    from layertap.storage import local

    store = local.LocalStore(str(tmp_path / "out"))
    real = os.makedirs

    def made_then_removed(path, *args, **kwargs):  # the other process's rmdir lands right after
        real(path, *args, **kwargs)
        if path.endswith(("lease", "shards")):
            os.rmdir(path)

    monkeypatch.setattr(local.os, "makedirs", made_then_removed)
    with pytest.raises(StoreError):  # removed every time: said, as before
        store.put_if_absent("lease/000001.ttl60", b"x")
    removals = iter([True])
    monkeypatch.setattr(local.os, "makedirs",
                        lambda path, *a, **k: made_then_removed(path, *a, **k) if next(removals, False)
                        else real(path, *a, **k))
    assert store.put_if_absent("lease/000001.ttl60", b"x") and store.get("lease/000001.ttl60") == b"x"
    removals = iter([True])
    with store.open_writer("shards/000000-ab.lts") as w:
        w.write(b"data")
    assert store.get("shards/000000-ab.lts") == b"data"


def test_retry_pauses_differ_between_processes_that_seed_random_alike():
    """Retry jitter came from `random`'s global generator, which every training rank seeds alike
    (torch.manual_seed, then each DataLoader worker's random.seed(base + id)): worker k of 1,000
    ranks retried a 503 SlowDown at the same moments. Two processes seeded alike pause apart."""
    code = textwrap.dedent("""
        import json, random, time
        from layertap.storage.retry import RetryPolicy
        from layertap.storage.store import TransientStoreError
        pauses = []
        time.sleep = pauses.append
        random.seed(1234)
        def slow_down():
            raise TransientStoreError("503 SlowDown")
        try:
            RetryPolicy(attempts=5).call(slow_down, lambda e: None)
        except TransientStoreError:
            pass
        print(json.dumps(pauses))
        """)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert len(json.loads(runs[0])) == 4 and runs[0] != runs[1]


@pytest.mark.parametrize("kind", ["put", "part"])
def test_a_body_damaged_on_the_way_is_sent_again(s3_bucket, s3_endpoint, kind):
    """S3 answers 400 BadDigest to a body whose checksum does not match what arrived (damaged in
    transit): a 400 was taken for a request that cannot succeed, and the shard's upload failed."""
    is_body = lambda method, path: method == "PUT"  # noqa: E731 - a PutObject or an UploadPart
    with FaultProxy(s3_endpoint, rate=1.0, faults=("400",), match=is_body, limit=1) as proxy:
        store = open_store(f"s3://{s3_bucket}/damaged", endpoint_url=proxy.url, part_size="5MiB")
        data = os.urandom(6 * MiB if kind == "part" else 1000)
        with store.open_writer("obj") as w:
            w.write(data)
        assert proxy.counts["400"] == 1
    assert open_store(f"s3://{s3_bucket}/damaged").get("obj") == data


def test_a_parent_prefix_shares_its_stores_client_and_a_spawned_copy_does_not(s3_bucket):
    """A store pickles as its URI and options for spawned DataLoader workers (`__reduce__`), and
    `copy.copy` went that way too: each level `parent()` walked up (the checks of a new run's
    prefix, 8 levels) built a client of its own, ~60 ms and new connections each."""
    import pickle

    store = open_store(f"s3://{s3_bucket}/a/b/c")
    up = store.parent()
    assert up.uri == f"s3://{s3_bucket}/a/b" and up.client is store.client and store.uri.endswith("/a/b/c")
    spawned = pickle.loads(pickle.dumps(store))
    assert spawned.uri == store.uri and spawned.options == store.options and spawned.client is not store.client


@pytest.mark.parametrize("profile", ["[profile p]\ncredential_process = /bin/false\n",
                                     "[profile p]\nrole_arn = arn:aws:iam::123456789012:role/r\nsource_profile = nope\n"])
def test_credentials_that_cannot_be_got_are_a_clear_error_not_a_traceback(monkeypatch, tmp_path, capsys, profile):
    """A profile whose credential_process fails (CredentialRetrievalError) or whose source_profile is not there
    (InvalidConfigError): a botocore traceback, exit 1."""
    from layertap.cli import main as cli

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "config").write_text(profile)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "p")
    assert cli(["status", "s3://b/run"]) == 2
    err = capsys.readouterr().err
    assert "the AWS " in err and "cannot be used" in err and "AWS_PROFILE" in err and "Traceback" not in err


def test_an_endpoint_that_answers_a_listing_404_without_an_s3_error_is_named(monkeypatch, capsys):
    """A wrong port that a web server answers: every command said "no object at .../manifest.json" (a new
    run needs none) or ".../checkpoints/latest.json", sending the user after a missing file."""
    import http.server
    import threading

    from layertap.cli import main as cli

    class NotFound(http.server.BaseHTTPRequestHandler):  # a web server's 404 page, whatever is asked
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>Not Found</body></html>")

        do_HEAD = do_PUT = do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
        with pytest.raises(StoreError, match=f"the endpoint {url} answered a listing of s3://nobucket/p with 404 "
                                             r"and no S3 error: it does not answer as S3 does; check "
                                             "AWS_ENDPOINT_URL"):
            list(open_store("s3://nobucket/p").list())
        assert cli(["status", "s3://nobucket/p"]) == 2
        err = capsys.readouterr().err
        assert "does not answer as S3 does" in err and "no object at" not in err
    finally:
        server.shutdown()


@pytest.mark.parametrize("uri", ["s3//bucket/run", "S3//bucket/run", "s3a//bucket/run"])
def test_an_s3_uri_without_its_colon_is_refused_not_taken_for_a_folder(uri, tmp_path, monkeypatch):
    """`--out s3//bucket/run` wrote a whole run into ./s3/bucket/run on local disk."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match=f"{uri!r} is not an S3 URI: write s3://bucket/prefix"):
        open_store(uri)


def test_sixteen_requests_at_once_stay_within_the_s3_client_pool(s3_bucket, caplog):
    """status, verify and the window's sweeps GET records 16 at a time: the client's pool of 12
    (threads 8 + 4) made urllib3 warn "Connection pool is full, discarding connection", which users
    read as a fault of their S3 server."""
    from concurrent.futures import ThreadPoolExecutor

    store = open_store(f"s3://{s3_bucket}/p")
    for i in range(64):
        store.put(f"k{i}", b"x" * 100)
    with caplog.at_level("WARNING", logger="urllib3.connectionpool"), ThreadPoolExecutor(16) as pool:
        for _ in range(4):
            assert list(pool.map(lambda i: store.get(f"k{i}"), range(64))) == [b"x" * 100] * 64
    assert "Connection pool is full" not in caplog.text
    store.close()
