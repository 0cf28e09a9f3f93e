"""Fixtures that start real services: a moto S3 server in its own process, spoken to over HTTP.

Set LAYERTAP_TEST_S3_ENDPOINT (plus AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) to run the same
tests against another S3 server, e.g. Ceph radosgw started by ../shared/recipes/start_rgw.sh.
"""

from __future__ import annotations

import os
import uuid

import boto3
import pytest

from s3server import start_moto_server, stop
from layertap.storage.store import open_store


@pytest.fixture(scope="session")
def s3_endpoint():
    """The URL of a running S3 server; starts `moto_server` in a child process unless one is given."""
    given = os.environ.get("LAYERTAP_TEST_S3_ENDPOINT")
    if given:
        yield given
        return
    proc, url = start_moto_server()
    yield url
    stop(proc)


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
