"""A server that ignores conditional writes (`If-None-Match: *`) is refused before layertap creates
anything on it (storage/s3.py, `S3Store._check_conditional_writes`), and the probe key that a
process killed mid-check leaves behind changes no command's verdict on its prefix."""

from __future__ import annotations

import pytest

import fake_worker
from faultproxy import FaultProxy
from layertap.cli import main as cli
from layertap.extract.interop import check_empty
from layertap.manifests import layout
from layertap.manifests.output_lease import OutputLease
from layertap.storage.errors import ConfigError
from layertap.storage.s3 import ConditionalWritesUnsupported
from layertap.storage.store import WRITE_PROBE, open_store

# moto behind a proxy that drops the header: the signature no longer covers what arrives, which
# moto does not check and radosgw would refuse
pytestmark = pytest.mark.moto_only


@pytest.fixture
def ignoring(s3_endpoint, monkeypatch) -> str:
    """The endpoint, for every store opened in the test, of a server that ignores If-None-Match."""
    with FaultProxy(s3_endpoint, strip=("If-None-Match",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy.url


def keys(uri: str) -> list[str]:
    return [o.key for o in open_store(uri).list()]


def test_a_new_run_on_a_server_that_ignores_conditional_writes_is_refused_with_nothing_created(s3_bucket, ignoring):
    uri = f"s3://{s3_bucket}/runs/r"
    with pytest.raises(ConditionalWritesUnsupported) as e:
        fake_worker.work(uri)  # plans the run: its first create is manifest.json
    assert isinstance(e.value, ConfigError)  # `layertap` prints it, exit code 2, no traceback
    message = str(e.value)
    assert f"the S3 server at {ignoring} (bucket {s3_bucket!r}) does not support conditional writes: it accepted" \
        in message
    assert "If-None-Match" in message and "exactly once" in message and "Upgrade the server" in message
    assert keys(uri) == []  # no manifest, and the probe deleted


def test_workers_of_a_run_on_such_a_server_take_no_lease(s3_endpoint, s3_bucket, monkeypatch):
    """The run was planned elsewhere (the server downgraded, or a gateway put in front): a worker's
    first create is then a lease, which two workers would both win."""
    uri = f"s3://{s3_bucket}/runs/r"
    fake_worker.plan(open_store(uri))
    with FaultProxy(s3_endpoint, strip=("If-None-Match",)) as proxy, monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(uri)
        for _ in range(2):  # refused every time, never "checked" by a first refusal
            with pytest.raises(ConditionalWritesUnsupported):
                store.put_if_absent(layout.commit_key(0), b"{}")
        with pytest.raises(ConditionalWritesUnsupported):
            fake_worker.work(uri)
    assert keys(uri) == [layout.MANIFEST]


def test_a_probe_left_by_a_killed_process_changes_no_verdict_on_its_prefix(s3_bucket, capsys):
    """A process killed between the probe's PUT and its DELETE leaves the key: `delete` and
    `export` judge a prefix by its listing, so they ignore it; extraction, status and a
    trainer's output lease never look at it; a run's delete removes it with the run."""
    uri = f"s3://{s3_bucket}/runs/r"
    store = open_store(uri)
    store.put(f"{WRITE_PROBE}0123456789abcdef", b"probe")
    assert cli(["delete", uri, "--yes"]) == 0  # not "holds no run: pass --force"
    assert "nothing to delete" in capsys.readouterr().out
    check_empty(store)  # `layertap export`'s destination is empty
    fake_worker.work(uri)  # a run planned over it, extracted
    assert cli(["status", uri]) == 0  # complete
    with OutputLease(open_store(f"s3://{s3_bucket}/runs")):  # a trainer's output above it
        pass
    assert cli(["delete", uri, "--yes"]) == 0 and keys(uri) == []


def test_a_server_that_answers_conditional_creates_with_501_is_refused_at_once(s3_endpoint, s3_bucket, monkeypatch):
    """AWS S3 before August 2024 and some gateways answer `If-None-Match` with 501 NotImplemented:
    a refusal for good, not an outage. It was retried as a 5xx (8 tries, ~14 s) and reported as a
    failed create quoting the server, without the fix."""
    uri = f"s3://{s3_bucket}/runs/r"
    probe = lambda method, path: method == "PUT" and WRITE_PROBE in path  # noqa: E731 - every create it sees
    with FaultProxy(s3_endpoint, rate=1.0, faults=("501",), match=probe) as proxy, monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", proxy.url)
        with pytest.raises(ConditionalWritesUnsupported) as e:
            fake_worker.work(uri)
        assert proxy.counts["501"] == 1  # asked once: no retries
    assert "does not support conditional writes: it answered a PUT with `If-None-Match: *` with NotImplemented" \
        in str(e.value) and "Upgrade the server" in str(e.value)
    assert keys(uri) == []


def test_a_batch_delete_answered_with_501_falls_back_to_one_request_a_key(s3_endpoint, s3_bucket, monkeypatch):
    """A server without DeleteObjects: its 501 was retried as an outage and then raised, so
    `layertap delete` (and the storage window's deletes) failed instead of deleting key by key."""
    uri = f"s3://{s3_bucket}/runs/r"
    store = open_store(uri)
    for i in range(3):
        store.put(f"k{i}", b"x")
    batch = lambda method, path: method == "POST" and "delete" in path.split("?", 1)[-1]  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("501",), match=batch) as proxy, monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", proxy.url)
        open_store(uri).delete_many(["k0", "k1", "k2"])
        assert proxy.counts["501"] == 1
    assert keys(uri) == []
