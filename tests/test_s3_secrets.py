"""An S3 endpoint's user:password never reaches a message, and a malformed endpoint or region is a
clear configuration error, not a traceback. botocore's own texts quote the endpoint URL whole
(ConnectionClosedError, ReadTimeoutError, "Invalid endpoint: ..."), so every message built from
one is scrubbed. Faults come from tests/faultproxy.py between boto3 and the real moto server."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from faultproxy import FaultProxy
from layertap.storage.errors import ConfigError
from layertap.storage.store import ObjectNotFound, TransientStoreError, open_store

SECRET = "S3CRETpw"


def with_password(url: str, password: str = SECRET) -> str:
    return url.replace("http://", f"http://someone:{password}@", 1)


@pytest.mark.parametrize("fault,password", [("reset", SECRET), ("stall", SECRET), ("reset", "S3@CRET@pw")])
def test_a_transient_failure_names_the_endpoint_without_its_password(s3_bucket, s3_endpoint, fault, password):
    with FaultProxy(s3_endpoint, rate=1.0, faults=(fault,), stall_s=3.0) as proxy:
        store = open_store(f"s3://{s3_bucket}/run", endpoint_url=with_password(proxy.url, password), max_attempts=2,
                           read_timeout_s=0.5)
        with pytest.raises(TransientStoreError) as err:
            store.get("some/key")
    assert SECRET not in str(err.value) and "CRET" not in str(err.value)
    assert proxy.url.split("//")[1] in str(err.value)  # still names where it went


def test_a_cli_command_against_a_failing_endpoint_prints_no_password(s3_bucket, s3_endpoint):
    with FaultProxy(s3_endpoint, rate=1.0, faults=("reset",)) as proxy:
        env = dict(os.environ, AWS_ENDPOINT_URL=with_password(proxy.url), LAYERTAP_LOG_LEVEL="DEBUG")
        r = subprocess.run([sys.executable, "-m", "layertap", "status", f"s3://{s3_bucket}/run"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "ConnectionClosedError" in r.stderr, r.stderr[-2000:]
    assert SECRET not in r.stdout + r.stderr


@pytest.mark.parametrize("endpoint", [f"http://someone:{SECRET}@bad host:9000", "http://[::1:9000",
                                      f"someone:{SECRET}@minio:9000",
                                      # a secret key holding "/", not percent-encoded: botocore took it and
                                      # quoted the whole URL in a traceback at the first request
                                      f"http://minio:{SECRET}/K7MDENG@host:9000",
                                      # ... or a password whose part before the "/" or "?" reads as a port:
                                      # no ValueError, and the rest went into messages as a path
                                      f"http://minio:1234/{SECRET}@host:9000", f"http://minio:99?{SECRET}@host:9000",
                                      f"http://someone:{SECRET}@[::1:9000"])  # a ValueError traceback for a while
def test_a_malformed_endpoint_is_a_configuration_error_without_its_password(s3_bucket, endpoint, monkeypatch):
    with pytest.raises(ConfigError, match="is not a URL") as err:
        open_store(f"s3://{s3_bucket}/run", endpoint_url=endpoint)
    assert SECRET not in str(err.value) and "K7MDENG" not in str(err.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # from the environment: it was named ''
    with pytest.raises(ConfigError, match="the S3 endpoint URL '.+' is not a URL") as err:
        open_store(f"s3://{s3_bucket}/run")
    assert SECRET not in str(err.value) and "K7MDENG" not in str(err.value)


@pytest.mark.parametrize("endpoint", [f"http://127.0.0.1:9000?X-Amz-Security-Token={SECRET}",
                                      f"http://someone:pw@127.0.0.1:9000/?token={SECRET}", f"http://127.0.0.1:9000#{SECRET}"])
def test_an_endpoint_with_a_query_is_refused_without_showing_it(s3_bucket, endpoint, monkeypatch):
    """botocore takes such an endpoint and fails at the first request with a message quoting it whole:
    a token in the query was printed (only a user:password was removed)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(ConfigError, match=r"the S3 endpoint URL 'http://127.0.0.1:9000/?' has a query or fragment "
                                          r"\(not shown") as err:
        open_store(f"s3://{s3_bucket}/run")
    assert SECRET not in str(err.value) and "pw" not in str(err.value)


@pytest.mark.parametrize("env, message", [({"AWS_PROFILE": "no-such-profile"}, "(no-such-profile) could not be found"),
                                          ({"AWS_ACCESS_KEY_ID": "AKIAFAKE", "AWS_SECRET_ACCESS_KEY": None},
                                           "missing: AWS_SECRET_ACCESS_KEY")])
def test_unusable_aws_settings_are_a_configuration_error_not_a_traceback(s3_bucket, env, message, monkeypatch):
    for k, v in env.items():
        monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_store(f"s3://{s3_bucket}/run")


def test_the_cli_refuses_a_malformed_endpoint_with_exit_2_and_no_traceback(s3_bucket):
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://someone:{SECRET}@bad host:9000")
    r = subprocess.run([sys.executable, "-m", "layertap", "status", f"s3://{s3_bucket}/run"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "is not a URL" in r.stderr and "Traceback" not in r.stderr
    assert SECRET not in r.stdout + r.stderr


def test_a_malformed_region_is_a_configuration_error(s3_bucket, s3_endpoint):
    with pytest.raises(ConfigError, match="'not a region!' is not a region name"):
        open_store(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint, region="not a region!")


def test_a_connection_cut_while_an_error_answer_is_read_is_retried(s3_bucket, s3_endpoint):
    """A 404's body cut off mid-read: botocore lets urllib3's ProtocolError out unwrapped, which
    was raised as a bug (never retried; a worker failed its shard with it). It is a failed try."""
    with FaultProxy(s3_endpoint, rate=1.0, faults=("cut",), limit=1) as proxy:
        store = open_store(f"s3://{s3_bucket}/run", endpoint_url=proxy.url)
        with pytest.raises(ObjectNotFound):
            store.get("missing/key")
    assert proxy.counts["cut"] == 1
    assert store.retries == 1


def test_an_at_sign_in_an_endpoints_path_keeps_its_host_in_messages(s3_bucket):
    """Only a user:password goes: a path holding "@" once lost the host in what messages showed.
    An "@" after the host, with no userinfo before it, reads as a password's end as well
    ("http://minio:1234/pass@host"): refused, asking for percent-encoding, and shown from the "@" on."""
    from layertap.storage.redact import public_url, urls_scrubbed

    assert public_url("https://s3.example.com/team@x") == "https://x"
    with pytest.raises(ConfigError, match="a path's '@' as %40"):
        open_store(f"s3://{s3_bucket}/run", endpoint_url="https://s3.example.com/team@x")
    assert public_url(f"http://u:{SECRET}@h:9000/team@x") == "http://h:9000/team@x"
    assert urls_scrubbed("GET http://host:9000/bucket/a@b/x failed") == "GET http://host:9000/bucket/a@b/x failed"


def test_an_endpoints_password_is_not_sent_and_the_store_still_works(s3_bucket, s3_endpoint):
    """botocore put the endpoint's user:password in each request line and Host header, which an
    HTTP(S)_PROXY in between sees and logs; S3 signs with the keys, and never needs them."""
    store = open_store(f"s3://{s3_bucket}/run", endpoint_url=with_password(s3_endpoint))
    assert SECRET not in store.client.meta.endpoint_url and "someone" not in store.client.meta.endpoint_url
    store.put("x", b"y")
    assert store.get("x") == b"y"


def test_what_a_server_quotes_back_of_a_request_is_scrubbed_from_s3_errors():
    """A proxy's error body quoting the request's headers (its session token, a key) went into the
    error as S3 sent it."""
    from botocore.exceptions import ClientError

    answer = {"Error": {"Code": "InvalidHeader", "Message": "bad header X-Amz-Security-Token: T0KENsecret, "
                                                            "Authorization: AWS4-HMAC-SHA256 Credential=AKIA1/x"},
              "ResponseMetadata": {"HTTPStatusCode": 400}}
    err = str(open_store("s3://b/p")._translate(ClientError(answer, "GetObject"), "get", "k"))
    assert "InvalidHeader" in err and "X-Amz-Security-Token: ***" in err
    assert "T0KENsecret" not in err and "AKIA1" not in err


def test_a_librarys_log_record_and_the_cli_error_show_no_urls_password(tmp_path):
    """HF_ENDPOINT=http://user:pw@mirror: huggingface_hub's warnings ("... thrown while requesting
    HEAD http://user:pw@...") reached the console and --log-dir files whole, and the error that
    ended the run quoted it too (25 lines in a walk). Every record is scrubbed as it is made."""
    code = ("import logging, sys\n"
            "from layertap.cli import _setup_logging\n"
            "_setup_logging(False)\n"
            "logging.getLogger('huggingface_hub.utils._http').warning("
            "'%r thrown while requesting HEAD %s', 'refused', 'http://hfu:PASSWDleak789@127.0.0.1:9/m/config.json')\n"
            "from layertap.cli import main\n"
            "sys.exit(main(['extract', '--model', 'https://u:PASSWDleak789@h.example/m', '--out', sys.argv[1], "
            "'--log-dir', sys.argv[2], '--limit', '2']))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out"), str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "thrown while requesting HEAD http://***@127.0.0.1:9/m/config.json" in r.stderr
    assert "error: target model 'https://***@h.example/m' does not exist" in r.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*"))
    assert "PASSWDleak789" not in r.stderr + r.stdout + logs


def test_scrubbing_log_records_breaks_no_logging_call_and_reaches_tracebacks():
    """A review of the record factory: a bad call's formatting error was raised at the call (logging
    itself reports it when the record is emitted, and goes on); a traceback's text went unscrubbed;
    "Basic authentication required" lost its last word; and headers were scrubbed only in records
    holding "://"."""
    code = ("import logging, sys\n"
            "from layertap.storage.redact import scrub_log_records\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stdout)\n"
            "scrub_log_records()\n"
            "log = logging.getLogger('x')\n"
            "log.info('count %d', 'not a number')\n"
            "log.info('X-Api-Key: sk-s3cret-1 sent; Basic authentication required')\n"
            "try:\n"
            "    raise ValueError('http://user:PASSWD9@host:9000/x')\n"
            "except ValueError:\n"
            "    log.exception('failed')\n"
            "print('went on')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "went on" in r.stdout, r.stderr[-2000:]
    assert "--- Logging error ---" in r.stderr  # reported as logging reports it, not raised
    assert "X-Api-Key: *** sent; Basic authentication required" in r.stdout
    assert "ValueError: http://***@host:9000/x" in r.stdout and "PASSWD9" not in r.stdout + r.stderr


def test_a_dry_run_shows_a_store_location_whole():
    """`#` and `?` are plain characters of an s3:// prefix: the dry run's masking showed
    `--out 's3://bkt/run#***'` and said keys had been masked."""
    from layertap.storage.redact import redacted, scrubbed

    text = "--out 's3://bkt/run#1?x' --data file:///r/a?b --endpoint http://h:1/v1?token=T0K"
    assert redacted(text) == "--out 's3://bkt/run#1?x' --data file:///r/a?b --endpoint http://h:1/v1?***"
    assert scrubbed(text) == "--out 's3://bkt/run#1?x' --data file:///r/a?b --endpoint http://h:1/v1?***"
