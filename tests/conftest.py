"""Fixtures that start real services: a moto S3 server in its own process, spoken to over HTTP.

Set LAYERTAP_TEST_S3_ENDPOINT (plus AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) to run the same
tests against another S3 server, e.g. Ceph radosgw started by ../shared/recipes/start_rgw.sh.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
import urllib.request

import boto3
import pytest

from storage.store import open_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """The URL of a running S3 server; starts `moto_server` in a child process unless one is given."""
    given = os.environ.get("LAYERTAP_TEST_S3_ENDPOINT")
    if given:
        yield given
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start; is moto[server] installed?")
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session", autouse=True)
def _aws_env(s3_endpoint):
    """Fake credentials and the server's endpoint for every boto3 client the code creates."""
    old = dict(os.environ)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing-key-id")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret")
    os.environ["AWS_ENDPOINT_URL"] = s3_endpoint
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ.pop("AWS_PROFILE", None)
    yield
    os.environ.clear()
    os.environ.update(old)


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket per test."""
    name = f"t-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store_uri(request, tmp_path):
    """A run prefix on each backend: a local folder and an S3 prefix on the moto server."""
    if request.param == "local":
        return str(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/runs/test"


@pytest.fixture
def store(store_uri):
    s = open_store(store_uri)
    yield s
    s.close()
