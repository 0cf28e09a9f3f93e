"""S3 and S3-compatible stores (Ceph radosgw, MinIO, moto) through boto3.

Endpoints, credentials and region come from boto3's standard chain (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `~/.aws/config`, instance roles...); `S3Options` adds the knobs that
S3-compatible servers need: path-style addressing and the request-checksum mode (boto3 >= 1.36
sends checksums some servers reject). Every request, its body included, is retried here and only
here (`storage.retry`): botocore is told to make one try, so an endpoint that refuses connections
is reported in about a second, not after botocore's, then our, rounds of backoff.

Response checksums: botocore's default validates a GET's CRC32 when the server sends one (moto
does for a whole object) at ~2 GB/s of client CPU. `get` keeps that for the small objects it
reads (manifests, commits, JSON state); ranged reads skip it: they bring shard bytes, every frame of
which carries its own xxh3 that readers check (docs/FORMAT.md), and checkpoint tensors, whose
xxh3 state.json records (train/checkpoint.py).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import http.client
import logging
import math
import os
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO, Literal, TypeVar

import boto3
import botocore
import botocore.exceptions as bexc
import urllib3
from botocore.config import Config
from botocore.response import StreamingBody
from botocore.utils import parse_timestamp

from layertap.storage.errors import ConfigError
from layertap.storage.redact import public_url, scrubbed, stray_at, urls_scrubbed
from layertap.storage.retry import RetryPolicy
from layertap.storage.store import (
    WRITE_PROBE,
    EndpointUnreachable,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectWriter,
    PendingUpload,
    RangeNotSatisfiable,
    StoreError,
    TransientStoreError,
    check_key,
    join_key,
)
from layertap.storage.units import parse_size

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB  # and its ceiling for any part
MAX_PARTS = 10_000
DELETE_BATCH = 1000  # S3's most keys per DeleteObjects

T = TypeVar("T")
READ_SLICE = 1 << 20  # per read through botocore's stream: a slice's bytes, copied out, then stay in cache
# Failures of a request or of its body on the way in: another try may well succeed.
# urllib3's own errors too: a connection cut while botocore reads an error answer's body (a 404's, a
# 503 SlowDown's) comes out of botocore unwrapped, as urllib3's ProtocolError.
_TRANSIENT = (bexc.ConnectionError, bexc.HTTPClientError, bexc.IncompleteReadError, bexc.FlexibleChecksumError,
              OSError, http.client.HTTPException, urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError)
# No connection at all: a server that is down, an endpoint URL that is wrong, a proxy or TLS setup that fails.
_BUCKET = re.compile(r"^[a-zA-Z0-9.\-_]{1,255}$")  # what botocore sends (S3's own rules are stricter)
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")  # S3's (other stores allow more: named, not refused)
_S3_BUCKET_RULE = "S3 bucket names are 3-63 lowercase letters, digits, '.' and '-'"
_UNREACHABLE = (bexc.EndpointConnectionError, bexc.ProxyConnectionError, bexc.SSLError)
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException",
                    "PriorRequestNotComplete", "Throttling", "ThrottlingException", "ThrottledException",
                    "RequestThrottled", "RequestThrottledException", "TooManyRequestsException",
                    "RequestLimitExceeded", "BandwidthLimitExceeded", "SlowDownRead", "SlowDownWrite",
                    # a 400 for a body damaged on the way (its digest or length not what arrived): sent again
                    "BadDigest", "IncompleteBody"}


class ConditionalWritesUnsupported(ConfigError):
    """The S3 server accepted a create over an existing object: it ignores `If-None-Match: *`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class S3Options:
    """Connection and upload settings; None means "boto3's standard resolution"."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    checksum_mode: Literal["when_supported", "when_required"] | None = None
    threads: int = 8
    part_size: int = field(default=16 * MiB, metadata={"parse": parse_size})  # "16MiB" in a --config file
    # Buffers per writer, the one being filled included: up to K-1 parts upload at once.
    max_parts_in_memory: int = 9
    max_attempts: int = 8  # tries of a request that fails transiently (5xx, throttling, timeouts, resets)
    unreachable_attempts: int = 3  # tries while the endpoint refuses connections or does not resolve, until it first answers
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.part_size < MIN_PART_SIZE:
            raise ConfigError(f"part_size {self.part_size} is below S3's minimum of {MIN_PART_SIZE} bytes (5 MiB)")
        if self.part_size > MAX_PART_SIZE:  # refused at the first part, after max_parts_in_memory buffers of it
            raise ConfigError(f"part_size {self.part_size} is above S3's maximum of {MAX_PART_SIZE} bytes (5 GiB)")
        if self.max_parts_in_memory < 1:
            raise ConfigError("max_parts_in_memory must be >= 1")
        if self.threads < 1:
            raise ConfigError("threads must be >= 1")
        if self.max_attempts < 1 or self.unreachable_attempts < 1:
            raise ConfigError("max_attempts and unreachable_attempts must be >= 1")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"addressing_style must be auto, path or virtual, not {self.addressing_style!r}")
        if self.checksum_mode not in (None, "when_supported", "when_required"):
            raise ConfigError(f"checksum_mode must be when_supported or when_required, not {self.checksum_mode!r}")
        for name in ("connect_timeout_s", "read_timeout_s"):  # botocore's own refusal read as a bad endpoint URL
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be a number of seconds above 0, got {getattr(self, name)!r}")


def _folder_marker(obj: dict) -> bool:
    """An empty object whose key ends in "/": a folder as S3 consoles and file-system layers make one."""
    return obj["Key"].endswith("/") and int(obj.get("Size", 0)) == 0


def _written_by(stamped: float) -> float:
    """When an object was written at the latest, from its LastModified: S3 (and moto) list whole
    seconds, rounded down, so an object listed at S was written up to a second later. Counted
    at S, a lease renewed 0.1 s ago looked a second old, and one of a 1 s TTL stale while its
    holder renewed it 4 times a second (a live shard taken over); as S + 1, no object looks older
    than it is. A store that lists milliseconds (radosgw) keeps its stamp."""
    return stamped + 1.0 if stamped == int(stamped) else stamped


class S3Store(ObjectStore):
    def __init__(self, uri: str, options: S3Options | None = None):
        if not uri.startswith("s3://"):
            raise StoreError(f"not an S3 URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise StoreError(f"S3 URI {uri!r} has no bucket; use s3://bucket/prefix")
        if "@" in bucket:  # not repeated: it may hold a password
            raise StoreError(f"S3 URI 's3://{bucket.rpartition('@')[2]}/{prefix}' holds a user:password before its "
                             "bucket: credentials go in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, the endpoint in "
                             "AWS_ENDPOINT_URL; use s3://bucket/prefix")
        if not _BUCKET.match(bucket):  # botocore refuses it at the first request, in a traceback
            where = " (the endpoint goes in AWS_ENDPOINT_URL, not the URI)" if ":" in bucket else ""
            raise StoreError(f"S3 URI {uri!r}: {bucket!r} is not a bucket name{where}; use s3://bucket/prefix "
                             "(letters, digits, '.', '-' and '_')")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.options = options or S3Options()
        o = self.options
        self._retry = RetryPolicy(attempts=o.max_attempts, unreachable_attempts=o.unreachable_attempts)
        self._reached = False  # has the endpoint answered yet (see storage.retry)
        self._etags_are_md5 = True  # False once NOT_MD5_KEYS objects read twice alike differed from their ETags
        self._not_md5: set[str] = set()  # ... those objects (`get`)
        self.retries = 0
        self._retries_lock = threading.Lock()
        config = Config(
            retries={"mode": "standard", "total_max_attempts": 1},  # retried in `_call`, once for all
            # urllib3 discards a connection beyond its pool with a warning users take for an S3 fault: status,
            # verify and the window's sweeps GET records 16 at a time, whatever --s3 threads says
            max_pool_connections=max(o.threads, 16) + 4,
            s3={"addressing_style": o.addressing_style},
            connect_timeout=o.connect_timeout_s,
            read_timeout=o.read_timeout_s,
            response_checksum_validation="when_required",  # `get` asks for it per request
            **({"request_checksum_calculation": o.checksum_mode} if o.checksum_mode else {}),
        )
        given = _endpoint(o) or ""
        not_a_url = (f"the S3 endpoint URL {public_url(given)!r} is not a URL: give one like "
                     "https://s3.example.com or http://host:9000 (AWS_ENDPOINT_URL, or endpoint_url in --config)")
        try:
            session = boto3.session.Session()
            # botocore parses every LastModified of a listing with dateutil: a third of the client's
            # time on a 1,000-key page. S3 sends ISO 8601 there, which fromisoformat reads ~50x faster.
            session._session.get_component("response_parser_factory").set_parser_defaults(
                timestamp_parser=_parse_timestamp)
            region = _region(o, session)
            # an endpoint's user:password is never sent: S3 signs with the keys, and botocore put it in the request
            # line and Host header, which an HTTP(S)_PROXY in between logs
            endpoint = public_url(given) if _plain_userinfo(given) else o.endpoint_url
            self.client = session.client("s3", endpoint_url=endpoint, region_name=region, config=config)
        except bexc.InvalidRegionError:
            raise ConfigError(f"the S3 region {region!r} is not a region name: give one like us-east-1 "
                              "(AWS_REGION or AWS_DEFAULT_REGION, or region in --config)") from None
        except (bexc.ProfileNotFound, bexc.PartialCredentialsError, bexc.ConfigParseError, bexc.InvalidConfigError,
                bexc.CredentialRetrievalError) as e:
            raise ConfigError(f"the AWS settings cannot be used for {uri}: {e} (AWS_PROFILE, AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY, ~/.aws/config)") from None
        except ValueError:  # botocore's "Invalid endpoint: <the URL>", a password in it included
            raise ConfigError(not_a_url) from None
        encode = "a password holding '/', '?' or '#' must be percent-encoded: %2F, %3F, %23"
        try:  # botocore takes any text and fails at the first request, quoting it whole (EndpointResolutionError)
            urllib.parse.urlsplit(self.client.meta.endpoint_url).port
        except ValueError:
            raise ConfigError(f"{not_a_url}; its port is not a number ({encode})") from None
        if stray_at(self.client.meta.endpoint_url):  # "http://minio:1234/pass@host": port 1234, and the rest a path
            raise ConfigError(f"{not_a_url}; it holds an '@' after its host, which reads as a password's end as well "
                              f"as a path's ({encode}; a path's '@' as %40)")
        if urllib.parse.urlsplit(self.client.meta.endpoint_url).query or "#" in self.client.meta.endpoint_url:
            raise ConfigError(f"the S3 endpoint URL {public_url(given)!r} has a query or fragment (not shown: it "
                              "may hold a token), which no S3 endpoint has: give the endpoint alone, e.g. "
                              "http://host:9000 (a session token goes in AWS_SESSION_TOKEN)")
        self.endpoint = public_url(self.client.meta.endpoint_url)  # for messages
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._creates_checked = False  # `_check_conditional_writes` passed
        self._creates_lock = threading.Lock()

    # -- helpers ---------------------------------------------------------------------------------

    def parent(self) -> S3Store | None:
        """The prefix one level up, on this store's client (a client is ~50 ms to make)."""
        if not self.prefix:
            return None
        up = copy.copy(self)
        up.prefix = self.prefix.rpartition("/")[0]
        up.uri = f"s3://{self.bucket}/{up.prefix}" if up.prefix else f"s3://{self.bucket}"
        return up

    def _key(self, key: str) -> str:
        return join_key(self.prefix, check_key(key))

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _list_prefix(self, prefix: str) -> str:
        """The bucket-wide prefix of a listing of `prefix`; the store's own ends in "/", so that
        s3://b/runs/a never lists (or aborts) runs/a-2/... of a sibling run."""
        full = join_key(self.prefix, prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        return full + "/" if prefix.endswith("/") and not full.endswith("/") else full

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.threads, thread_name_prefix="layertap-s3")
            return self._pool

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """`fn()` (requests, and reading their bodies) under the store's retry policy; botocore's
        exceptions come out as `StoreError`s that name the key and the fix."""
        result = self._retry.call(fn, lambda e: self._error(e, what, key), self._count_retry, self._reached)
        self._reached = True  # from now on a refused connection is a restart to ride out, not a wrong URL
        return result

    def _count_retry(self) -> None:
        with self._retries_lock:
            self.retries += 1

    def _error(self, e: Exception, what: str, key: str) -> StoreError | None:
        """The store's error for `e`; its type says whether another try is worth it. None: not a
        store failure (a bug, a bad argument), raised as it is."""
        if isinstance(e, bexc.ClientError):
            return self._translate(e, what, key)
        if isinstance(e, bexc.NoCredentialsError):
            return StoreError(f"no S3 credentials found for {self.uri}: set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role)")
        if isinstance(e, (bexc.PartialCredentialsError, bexc.ProfileNotFound, bexc.TokenRetrievalError,
                          bexc.SSOTokenLoadError, bexc.UnauthorizedSSOTokenError, bexc.ConfigParseError,
                          bexc.InvalidConfigError, bexc.CredentialRetrievalError)):
            return StoreError(f"the AWS credentials for {self.uri} cannot be used: {e} (AWS_PROFILE, "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or `aws sso login`)")
        if isinstance(e, bexc.EndpointResolutionError):  # its text quotes the URL, a password in it included
            return StoreError(f"the S3 endpoint {self.endpoint} cannot be used for {what} of {self._where(key)}: "
                              + urls_scrubbed(str(e)))
        if isinstance(e, (*_UNREACHABLE, bexc.ConnectTimeoutError)):
            cause = getattr(e, "kwargs", {}).get("error") or e
            while cause.__cause__ is not None or cause.__context__ is not None:  # down to the socket's error
                cause = cause.__cause__ or cause.__context__
            reason = urls_scrubbed(f"{type(e).__name__}: {cause}")
            kind = TransientStoreError if isinstance(e, bexc.ConnectTimeoutError) else EndpointUnreachable
            return kind(f"cannot reach the S3 endpoint {self.endpoint} for {what} of {self._where(key)} ({reason}); "
                        f"check {self._endpoint_setting()} and that the server is up")
        if isinstance(e, _TRANSIENT):
            # botocore's text names the endpoint URL, with any user:password in it
            return TransientStoreError(f"{what} of {self._where(key)} failed: "
                                       + urls_scrubbed(f"{type(e).__name__}: {e}"))
        return None

    def _endpoint_setting(self) -> str:
        """Where the endpoint in use was set, for messages that ask to check it."""
        return ("endpoint_url in the --config file's \"s3\" settings" if self.options.endpoint_url
                else "AWS_ENDPOINT_URL")

    def _where(self, key: str) -> str:
        """The URI of a key or listing prefix, for messages (not checked: a prefix may end in "/")."""
        return f"s3://{self.bucket}/{join_key(self.prefix, key)}"

    def _translate(self, e: bexc.ClientError, what: str, key: str) -> StoreError:
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        where = self._where(key)
        if code == "InvalidRange" or status == 416:
            return RangeNotSatisfiable(f"{what} of {where}: the range starts at or past the object's end")
        if code == "NoSuchBucket":
            named = "" if _S3_BUCKET.match(self.bucket) else \
                f" (nor can it be: {_S3_BUCKET_RULE}, and {self.bucket!r} is not one)"
            return StoreError(f"bucket {self.bucket!r} does not exist at {self.endpoint}{named}: create it or fix "
                              "the URI")
        if code == "InvalidBucketName":  # radosgw: a name under 3 characters, or one its rules refuse
            return StoreError(f"{self.endpoint} refuses {self.bucket!r} as a bucket name ({code}): {_S3_BUCKET_RULE}; "
                              "fix the URI")
        if code == "NoSuchUpload":  # not a missing object: the upload under way is gone
            return StoreError(f"{what} of {where}: its multipart upload was aborted meanwhile (a bucket lifecycle "
                              "rule, or another process cleaning up pending uploads): the object was not written")
        if what == "list" and status == 404 and code in ("", "404", "NotFound"):
            # S3 lists an empty prefix; a missing bucket is NoSuchBucket (above): a bare 404 is not S3's answer
            return StoreError(f"the endpoint {self.endpoint} answered a listing of {where} with 404 and no S3 error: "
                              f"it does not answer as S3 does; check {self._endpoint_setting()} (its host and port)")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return ObjectNotFound(f"no object at {where}")
        if code == "RequestTimeTooSkewed":  # a 403, but not the credentials' fault
            return StoreError(f"{what} of {where}: the server refused the request's time ({code}): this machine's "
                              "clock is off by more than S3 allows (15 minutes); set it right (NTP)")
        if code in ("ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "InvalidToken"):
            # temporary credentials (a session token) past their life: a run of days outlives them
            return StoreError(f"{what} of {where}: the S3 credentials' session token is expired or invalid ({code}): "
                              "renew it (a new AWS_SESSION_TOKEN, `aws sso login`, or an instance or pod role, "
                              "whose credentials renew themselves); the same command goes on from where it stopped")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403") or status == 403:
            return StoreError(
                f"access denied for {what} of {where} ({code}): check the credentials and their permissions"
            )
        said = scrubbed(str(e.response.get("Error", {}).get("Message", "")))  # a proxy may quote headers back
        message = f"{what} of {where} failed: {code or status} {said}"
        if _not_implemented(e):  # a 5xx, but the server will never do it: retrying only delays the error
            return StoreError(message)
        if (status or 0) >= 500 or status == 429 or code in _TRANSIENT_CODES:
            return TransientStoreError(message)
        return StoreError(message)

    # -- interface -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        self._call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """`If-None-Match: *`. A 412 whose existing body equals `data` counts as ours: a retried PUT
        whose first attempt landed sees its own object (`ObjectStore.put_if_absent`). The server's
        support for the condition is checked first, once per store object."""
        self._check_conditional_writes()
        return self._call("create", key, lambda: self._try_create(key, data))

    def _try_create(self, key: str, data: bytes) -> bool:
        """True if created, False if another writer's object is there."""
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            return True
        except bexc.ClientError as e:
            if _create_conflict(e):
                raise TransientStoreError(f"create of {self._where(key)} met a concurrent create") from None
            if _not_implemented(e):  # AWS S3 before August 2024, some gateways: no If-None-Match at all
                raise self._no_conditional_writes(f"answered a PUT with `If-None-Match: *` with "
                                                  f"{e.response.get('Error', {}).get('Code') or 501}") from None
            if not _create_refused(e):
                raise
        try:  # the client itself, not `get`: retries stay in one loop, `_call`'s
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
            return resp["Body"].read() == data
        except bexc.ClientError as e:
            if isinstance(self._translate(e, "create", key), ObjectNotFound):  # deleted in between: try again
                raise TransientStoreError(f"create of {self._where(key)} met an object deleted since") from None
            raise

    def _check_conditional_writes(self) -> None:
        """Refuse a server that ignores `If-None-Match` (older MinIO, some other servers and
        gateways; AWS S3 before August 2024): it answers 200 to every create, so two workers would
        both win a shard's lease and both commit it, silently. Run before the store's first create,
        so readers pay nothing: a fresh key under the prefix (`WRITE_PROBE`, which the checks that
        judge a prefix by its listing ignore) is created, created again, which must be refused, and
        deleted: 3 requests."""
        with self._creates_lock:
            if self._creates_checked:
                return
            key = f"{WRITE_PROBE}{uuid.uuid4().hex}"
            self._call("create", key, lambda: self._try_create(key, b"probe"))
            try:
                # Asked twice: had a `layertap delete` of the prefix removed the key in between, the
                # first recreates it and the second is refused by any server that honours the header.
                honoured = self._refuses_create(key) or self._refuses_create(key)
            finally:
                self._delete_probe(key)
            if not honoured:
                raise self._no_conditional_writes("accepted a PUT with `If-None-Match: *` over an object that exists")
            self._creates_checked = True

    def _no_conditional_writes(self, what_it_did: str) -> ConditionalWritesUnsupported:
        return ConditionalWritesUnsupported(
            f"the S3 server at {self.endpoint} (bucket {self.bucket!r}) does not support conditional writes: it "
            f"{what_it_did}. layertap creates its commit records and leases that way, to keep every shard exactly "
            "once; on this server two workers could both take a shard and both commit it, or two trainers share one "
            "output, with no error. Upgrade the server to a version that supports conditional writes (If-None-Match "
            "on PutObject; Amazon S3 does since August 2024), or write to a folder on a shared filesystem instead")

    def _refuses_create(self, key: str) -> bool:
        """Whether a conditional create over `key`, which exists, is refused (412, or 409: another
        create of it in flight) rather than accepted."""
        def create() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=b"again", IfNoneMatch="*")
                return False
            except bexc.ClientError as e:
                if _create_refused(e) or _create_conflict(e):
                    return True
                raise

        return self._call("create", key, create)

    def _delete_probe(self, key: str) -> None:
        """Best effort: a probe key left behind costs a few bytes, and layertap ignores it."""
        try:
            self.delete(key)
        except StoreError as e:
            log.warning("could not delete %s, left by the check of conditional writes (harmless): %s",
                        self._where(key), e)

    def get(self, key: str) -> bytes:
        """The whole object, checked against its ETag where that is its MD5 (`_md5_etag`,
        `_read_checked`): botocore checks a body only where the server sends a checksum header, which
        radosgw 16 and moto do not for a plain PUT, and a file of another tool's with no hash of its
        own (a safetensors file) was imported with a byte flipped on its way."""
        def once() -> tuple[bytes, str | None, str]:
            body, etag = self._get_whole(key)
            return body, etag, _md5(body) if etag is not None and self._etags_are_md5 else ""

        return self._call("get", key, lambda: self._read_checked(key, once))

    def get_to_file(self, key: str, f: BinaryIO) -> int:
        """The whole object written to `f` (a file open for writing, from its start) a slice at a
        time: a dataset object of several GB held whole in memory as `get` holds it. Checked as
        `get` checks (`_read_checked`); each read starts `f` over. Returns the bytes written."""
        def once() -> tuple[int, str | None, str]:
            f.seek(0)
            f.truncate()
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
            body, md5 = resp["Body"], hashlib.md5(usedforsecurity=False)
            try:
                for chunk in iter(lambda: body.read(READ_SLICE), b""):
                    f.write(chunk)
                    md5.update(chunk)
            except BaseException:
                body.close()
                raise
            return f.tell(), _md5_etag(resp), md5.hexdigest()

        return self._call("get", key, lambda: self._read_checked(key, once))

    def _read_checked(self, key: str, once: Callable[[], tuple[T, str | None, str]]) -> T:
        """What `once()` read (it returns that, the object's ETag where it is an MD5, and the MD5
        of the bytes read), checked against that ETag. A body that differs is read again at once:
        the same bytes under the same ETag twice are what the store holds (a store whose ETag is no
        MD5: not compared again), else the try failed (retried)."""
        got, etag, md5 = once()
        if etag is None or not self._etags_are_md5 or md5 == etag:
            return got
        again, etag_again, md5_again = once()
        if etag_again == etag and md5_again == md5:  # what the store holds, its ETag no MD5
            self._not_md5.add(key)
            if len(self._not_md5) >= NOT_MD5_KEYS:
                log.info("%s: the ETags of %d objects are not the MD5 of their bytes (each read twice alike): "
                         "ETags are not compared with bodies on this store", self.endpoint, len(self._not_md5))
                self._etags_are_md5 = False
            return again
        if etag_again is not None and md5_again == etag_again:  # the first read was damaged on its way
            return again
        raise TransientStoreError(f"get of {self._where(key)}: the body read differs from the object's ETag "
                                  "(its MD5), twice: damaged on its way")

    def _get_whole(self, key: str) -> tuple[bytes, str | None]:
        """One GET: the body, and the ETag where it is the body's MD5 (`_md5_etag`)."""
        resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        return resp["Body"].read(), _md5_etag(resp)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) for {key!r}")
        if end == start:
            return b""

        def read() -> bytes:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}")
            self._check_range(key, resp, start, end - start)
            return resp["Body"].read()

        try:
            return self._call("ranged get", key, read)
        except RangeNotSatisfiable:  # start at or past the end
            return b""

    @staticmethod
    def _check_range(key: str, resp: dict, start: int, n: int) -> None:
        """Refuse an answer that is not the asked-for range (a server or proxy that ignores Range
        sends the whole object): read as the range, a good shard would look corrupt."""
        length = int(resp["ContentLength"])
        if _range_start(resp.get("ContentRange")) != start or length > n:
            resp["Body"].close()  # its bytes are not the ones asked for: the connection must not be reused
            raise StoreError(f"ranged get of {key!r}: asked for bytes {start}-{start + n - 1}, the server answered "
                             f"{resp.get('ContentRange') or 'without a Content-Range'} ({length} bytes); it does "
                             "not serve HTTP Range requests as S3 does")

    def read_range_into(self, key: str, start: int, out: memoryview) -> int:
        """One ranged GET read into `out` with no body-sized buffer on the way (straight from the
        socket where the stream allows, else a slice at a time); a try that fails while the body
        streams in is resumed, by the next, from its last good byte."""
        out = out.cast("B") if out.format != "B" else out  # `n` counts bytes, whatever the view's items
        n, got = len(out), 0

        def read() -> None:
            nonlocal got
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                          Range=f"bytes={start + got}-{start + n - 1}")
            self._check_range(key, resp, start + got, n - got)
            body, length = resp["Body"], int(resp["ContentLength"])
            end = got + length
            try:
                direct = _plain_http_response(body)
                if direct is not None:
                    while got < end:
                        k = direct.readinto(out[got:end])
                        if not k:
                            raise bexc.IncompleteReadError(actual_bytes=got, expected_bytes=end)
                        got += k
                    body._raw_stream.release_conn()  # what urllib3 does once it has read a body to its end
                while got < end:  # `read`, not `readinto`: botocore < 1.39 has no readinto (urllib3's copies anyway)
                    chunk = body.read(min(end - got, READ_SLICE))
                    if not chunk:  # botocore raises IncompleteReadError first if the body was cut short
                        break
                    out[got : got + len(chunk)] = chunk
                    got += len(chunk)
            except BaseException:
                body.close()
                raise

        if n:
            try:
                self._call("ranged get", key, read)  # fewer than n bytes: the object ends before `out` does
            except RangeNotSatisfiable:  # start at or past the end
                pass
        return got

    def size(self, key: str) -> int:
        resp = self._call("head", key, lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)))
        return int(resp["ContentLength"])

    def list(self, prefix: str = "", start_after: str = "") -> Iterator[ObjectInfo]:
        for obj in self._listed(prefix, start_after):
            if not _folder_marker(obj):  # not an object of anyone's: `remove_empty_folders` deletes them
                yield ObjectInfo(self._rel(obj["Key"]), int(obj["Size"]), _written_by(obj["LastModified"].timestamp()),
                                 obj.get("ETag", ""))

    def _listed(self, prefix: str, start_after: str = "") -> Iterator[dict]:
        """ListObjectsV2's entries under `prefix`, page by page: by hand, not botocore's paginator,
        so that each page is retried on its own."""
        full = self._list_prefix(prefix)
        token: dict[str, str] = {"StartAfter": self._key(start_after)} if start_after else {}
        while True:
            page = self._call("list", prefix, lambda: self.client.list_objects_v2(
                Bucket=self.bucket, Prefix=full, **token))
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def remove_empty_folders(self, prefix: str = "") -> None:
        """Delete the markers of empty folders under `prefix` (its own included): the empty `run/`
        or `run/stats/` objects an S3 console's "Create folder", s3fs or Hadoop's S3A leave. No key
        of ours ends in "/", and `list` leaves them out, so deleting a run left them behind. A
        marker with objects below it stays, as a local folder would."""
        markers, held = [], set()
        for obj in self._listed(prefix):
            if _folder_marker(obj):
                markers.append(obj["Key"])
            else:  # every folder above an object holds something
                parts = obj["Key"].split("/")[:-1]
                held.update("/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
        self._delete_full([m for m in markers if m not in held])

    def folders(self, limit: int = 1000) -> list[str]:
        """One listing with a delimiter: the common prefixes, not every key under them."""
        page = self._call("list", "", lambda: self.client.list_objects_v2(
            Bucket=self.bucket, Prefix=self._list_prefix(""), Delimiter="/", MaxKeys=limit))
        return sorted(self._rel(p["Prefix"]).rstrip("/") for p in page.get("CommonPrefixes", []))[:limit]

    def _measure_clock_offset(self) -> float:
        """From the Date header of a one-key listing (read-only, so `status` measures it too), against
        our clock once the answer is in. The header has whole seconds, at or before the store's
        time: the offset errs towards a store behind us, as `now` wants."""
        resp = self._call("list", "", lambda: self.client.list_objects_v2(
            Bucket=self.bucket, Prefix=self._list_prefix(""), MaxKeys=1))
        received = time.time()
        date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            return parsedate_to_datetime(date).timestamp() - received
        except (TypeError, ValueError):  # no Date header: a proxy dropped it; our clock it is
            log.warning("%s sent no readable Date header (%r): leases age by this machine's clock", self.uri, date)
            return 0.0

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)))

    def delete_many(self, keys: Sequence[str]) -> None:
        """DeleteObjects, 1,000 keys a request (a 35 TB run holds ~100k objects: ~100 requests,
        not ~100k). A key the batch reports as failed is deleted again on its own, under the
        retry policy, so its error (if lasting) is raised with its name. A store without
        DeleteObjects (it answers with a permanent error, 501 NotImplemented among them) gets one
        request a key."""
        self._delete_full([self._key(k) for k in keys])

    def _delete_full(self, full_keys: Sequence[str]) -> None:
        """`delete_many` of bucket keys as they are (a folder marker's, which `_key` refuses)."""
        def one(full: str) -> None:
            self._call("delete", self._rel(full), lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

        for i in range(0, len(full_keys), DELETE_BATCH):
            batch = list(full_keys[i:i + DELETE_BATCH])
            request = {"Objects": [{"Key": k} for k in batch], "Quiet": True}
            try:
                answer = self._call("delete", self._rel(batch[0]), lambda: self.client.delete_objects(
                    Bucket=self.bucket, Delete=request))
            except TransientStoreError:
                raise
            except StoreError as e:
                log.debug("batch delete refused (%s): deleting one key a request", e)
                for full in batch:
                    one(full)
                continue
            for failed in answer.get("Errors", []):
                one(failed["Key"])

    def open_writer(self, key: str) -> ObjectWriter:
        return S3Writer(self, key, self.options.part_size, self.options.max_parts_in_memory)

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        full = self._list_prefix(prefix)
        out: list[PendingUpload] = []
        marker: dict[str, str] = {}
        while True:
            page = self._call("list uploads", prefix, lambda: self.client.list_multipart_uploads(
                Bucket=self.bucket, Prefix=full, **marker))
            for up in page.get("Uploads", []):
                out.append(PendingUpload(self._rel(up["Key"]), up["UploadId"], up["Initiated"].timestamp()))
            if not page.get("IsTruncated"):
                return out
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_pending_uploads(self, prefix: str = "", older_than_s: float = 0.0) -> int:
        now, aborted = self.now(), 0  # uploads start by the store's clock
        for up in self.list_pending_uploads(prefix):
            if older_than_s <= 0 or now - up.initiated >= older_than_s:  # 0: every one, whatever the clocks
                self._abort_upload(up.key, up.upload_id)
                aborted += 1
        return aborted

    def _abort_upload(self, key: str, upload_id: str) -> None:
        def abort() -> None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
            except bexc.ClientError as e:
                if e.response.get("Error", {}).get("Code") != "NoSuchUpload":  # gone already (a retried abort)
                    raise

        self._call("abort upload", key, abort)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def reopen(self) -> S3Store:
        return S3Store(self.uri, self.options)

    def __copy__(self) -> S3Store:
        """A copy on this store's client and pool (`parent`): not `__reduce__`'s new client."""
        new = object.__new__(S3Store)
        new.__dict__.update(self.__dict__)
        return new

    def __reduce__(self):
        """A copy for a spawned process (a DataLoader's workers under `multiprocessing_context="spawn"`
        take the stream that holds this store): its own client and threads, as `reopen` makes."""
        return S3Store, (self.uri, self.options)


class S3Writer(ObjectWriter):
    """Multipart upload that runs while the caller writes.

    At most `max_parts` buffers of `part_size` bytes live at once (the one being filled included):
    when all are in flight, `write` blocks until a part finishes uploading, which is the
    backpressure that keeps memory bounded. Parts upload concurrently on the store's pool. An
    object smaller than one part goes up in a single PUT. Any failure aborts the upload, so no
    orphaned parts are left behind.
    """

    def __init__(self, store: S3Store, key: str, part_size: int, max_parts: int):
        self.key = key
        self._store = store
        self._full_key = store._key(key)
        self._part_size = part_size
        self._slots = threading.BoundedSemaphore(max_parts)
        self._buf: bytearray | None = None
        self._upload_id: str | None = None
        self._create_retried = False
        self._parts: list[Future] = []
        self._queued: dict[int, bytearray] = {}  # shipped parts' buffers, until their upload takes them
        self._written = 0
        self._buffered = 0
        self._peak = 0
        self._lock = threading.Lock()
        self._done = False
        # Declare the checksum botocore already computes for every part (CRC32 under the default
        # `when_supported`), as boto3's transfer manager does: the parts' checksums then go into
        # CompleteMultipartUpload and the server derives a composite checksum from them instead of
        # re-reading the whole object (moto and S3 otherwise default to a full-object CRC64NVME).
        config = store.client.meta.config
        self._checksum_algo = "CRC32" if config.request_checksum_calculation == "when_supported" else None

    def _account(self, delta: int) -> None:
        with self._lock:
            self._buffered += delta
            self._peak = max(self._peak, self._buffered)

    def write(self, data: bytes | memoryview) -> int:
        if self._done:
            raise StoreError(f"writer for {self.key!r} is already closed")
        view = memoryview(data).cast("B")
        size = view.nbytes
        try:
            while view.nbytes:
                if self._buf is None:
                    self._slots.acquire()
                    self._buf = bytearray()
                take = view[: self._part_size - len(self._buf)]
                self._buf += take
                self._account(take.nbytes)
                view = view[take.nbytes :]
                if len(self._buf) == self._part_size:
                    self._ship()
        except BaseException:
            self.abort()
            raise
        self._written += size
        return size

    def _ship(self) -> None:
        self._raise_failed_part()
        if self._upload_id is None:
            tries = 0

            def create() -> dict:
                nonlocal tries
                tries += 1
                return self._store.client.create_multipart_upload(
                    Bucket=self._store.bucket, Key=self._full_key,
                    **({"ChecksumAlgorithm": self._checksum_algo} if self._checksum_algo else {}))

            try:
                self._upload_id = self._store._call("create multipart upload", self.key, create)["UploadId"]
            finally:  # a retry that failed after a first try landed unheard left an upload to sweep too
                self._create_retried = tries > 1
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise StoreError(f"{self.key!r} needs more than {MAX_PARTS} parts: raise part_size")
        self._queued[number], self._buf = self._buf, None
        self._parts.append(self._store.pool.submit(self._upload_part, number))

    def _upload_part(self, number: int) -> dict:
        # The buffer is taken from `_queued`, not passed to `submit`: the pool's work item would
        # hold it until after this returns, past the slot's release below.
        body = self._queued.pop(number)
        size = len(body)
        try:
            resp = self._store._call(
                "upload part", self.key,
                lambda: self._store.client.upload_part(
                    Bucket=self._store.bucket, Key=self._full_key, UploadId=self._upload_id,
                    PartNumber=number, Body=body,
                    **({"ChecksumAlgorithm": self._checksum_algo} if self._checksum_algo else {}),
                ),
            )
            part = {"PartNumber": number, "ETag": resp["ETag"]}
            member = f"Checksum{self._checksum_algo}" if self._checksum_algo else None
            if member and member in resp:
                part[member] = resp[member]
            return part
        finally:
            # Freed before its slot goes back: the writer fills a new buffer as soon as it may, and
            # the two would otherwise be alive together (K + 1 parts held, under a busy CPU).
            del body
            self._account(-size)
            self._slots.release()

    def _raise_failed_part(self) -> None:
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def close(self) -> None:
        if self._done:
            return
        try:
            if self._upload_id is None:  # the buffer itself, not a copy of it: a part's size held twice
                self._store.put(self.key, self._buf if self._buf is not None else b"")
                self._release_buffer()
            else:
                if self._buf:
                    self._ship()
                self._complete([f.result() for f in self._parts])
        except BaseException:
            self.abort()
            raise
        self._done = True
        if self._create_retried:  # the object is written: a failed sweep must not fail the close
            self._sweep_lost_uploads()

    def _complete(self, parts: list[dict]) -> None:
        """CompleteMultipartUpload. MinIO answers a retry whose first try landed unheard with
        NoSuchUpload (minio/minio#13318); that counts as done if the key holds an object of our
        size whose ETag is a multipart one of our part count."""
        tries = 0

        def complete() -> None:
            nonlocal tries
            tries += 1
            try:
                self._store.client.complete_multipart_upload(
                    Bucket=self._store.bucket, Key=self._full_key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts})
            except bexc.ClientError as e:
                if tries == 1 or e.response.get("Error", {}).get("Code") != "NoSuchUpload" \
                        or not self._landed(len(parts)):
                    raise

        self._store._call("complete multipart upload", self.key, complete)

    def _landed(self, parts: int) -> bool:
        try:
            head = self._store.client.head_object(Bucket=self._store.bucket, Key=self._full_key)
        except bexc.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise
        return head["ContentLength"] == self._written and head.get("ETag", "").strip('"').endswith(f"-{parts}")

    def _sweep_lost_uploads(self) -> None:
        """A CreateMultipartUpload whose answer was lost (a reset, a timeout) and was retried
        started an upload nobody knows the id of: it would stay pending, and billed, forever.
        Best effort (it runs after the write, or on the way out of another error): a failure is
        logged (without s3:ListBucketMultipartUploads it always fails)."""
        try:
            for up in self._store.list_pending_uploads(self.key):
                if up.key == self.key and up.upload_id != self._upload_id:
                    self._store._abort_upload(up.key, up.upload_id)
        except StoreError as e:
            log.warning("could not abort the unheard upload of %s (it stays pending until the run's next sweep "
                        "of stale uploads or `layertap delete`): %s", self._store._where(self.key), e)

    def _release_buffer(self) -> None:
        if self._buf is not None:
            self._account(-len(self._buf))
            self._buf = None
            self._slots.release()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for f in self._parts:
            f.cancel()
        self._queued.clear()  # the cancelled parts' buffers
        stop: BaseException | None = None
        for f in self._parts:  # a part still uploading would survive an abort issued before it ends
            while not f.done():
                try:
                    wait([f])
                except BaseException as e:  # a signal handler's stop: raised once the upload is aborted
                    stop = stop or e
        self._release_buffer()
        try:
            # best effort: an abort runs on the way out of another error (or a stop), which its own
            # failure replaced (the user saw the abort's error; a stop became a shard failure)
            if self._upload_id is not None:
                try:
                    self._store._abort_upload(self.key, self._upload_id)
                except StoreError as e:
                    log.warning("could not abort the upload of %s (it stays pending until the run's next sweep of "
                                "stale uploads or `layertap delete`): %s", self._store._where(self.key), e)
            if self._create_retried:  # as `close` does: else the unheard upload stays pending, billed
                self._sweep_lost_uploads()
        finally:
            if stop is not None:
                raise stop

    @property
    def bytes_written(self) -> int:
        return self._written

    @property
    def peak_buffered_bytes(self) -> int:
        return self._peak


def _create_refused(e: bexc.ClientError) -> bool:
    """A conditional create answered "the key exists" (412 PreconditionFailed)."""
    code = e.response.get("Error", {}).get("Code", "")
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412 or code == "PreconditionFailed"


def _not_implemented(e: bexc.ClientError) -> bool:
    """501 NotImplemented: the server does not support the request (a header, an API) at all."""
    code = e.response.get("Error", {}).get("Code", "")
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 501 or code == "NotImplemented"


def _create_conflict(e: bexc.ClientError) -> bool:
    """A conditional create answered "another create of the key is in flight" (409)."""
    code = e.response.get("Error", {}).get("Code", "")
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 409 or code == "ConditionalRequestConflict"


def server_of(o: S3Options) -> dict[str, Any]:
    """Which S3 server a store with options `o` talks to, and how, as `S3Store` resolves them here
    (the endpoint and region from AWS_* variables or ~/.aws/config where `o` names none): for
    comparing two commands' settings (a chained trainer's with its extraction's)."""
    return {"endpoint_url": _endpoint(o), "region": _region(o, boto3.session.Session()),
            "addressing_style": o.addressing_style, "checksum_mode": o.checksum_mode}


def _endpoint(o: S3Options) -> str | None:
    """The endpoint a store with options `o` talks to: its own, else AWS_ENDPOINT_URL(_S3); None: AWS's."""
    return o.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _region(o: S3Options, session: boto3.session.Session) -> str:
    return o.region or session.region_name or "us-east-1"


def _plain_userinfo(url: str) -> bool:
    """Whether `url` is a well-formed endpoint with a user:password before its host (a malformed one
    goes to botocore as given, which refuses it)."""
    try:
        parts = urllib.parse.urlsplit(url)
        return "@" in parts.netloc and not stray_at(url) and not parts.query and not parts.fragment
    except ValueError:
        return False


def _parse_timestamp(value: str) -> datetime:
    try:
        return datetime.fromisoformat(value)  # 2026-11-29T14:46:15.000Z (listings)
    except ValueError:
        return parse_timestamp(value)  # RFC 1123 (HEAD), epoch seconds...


def _range_start(content_range: str | None) -> int | None:
    """The first byte of a `Content-Range: bytes A-B/N` answer; None if there is none."""
    try:
        return int(content_range.split()[1].split("-")[0])
    except (AttributeError, IndexError, ValueError):
        return None


# The versions `_plain_http_response` was tested with (tests/test_store.py; CI installs the newest
# boto3 that pyproject.toml allows, whose bound moves with this one after a test run).
DIRECT_READ_VERSIONS = {"botocore": ((1, 36), (1, 44)), "urllib3": ((2, 0), (3, 0))}


@functools.cache
def direct_reads() -> bool:
    """Whether ranged bodies may be read from the socket straight into the caller's buffer. That
    reaches under botocore's and urllib3's wrappers (their private `_raw_stream` and `_fp`), so
    it is done only on the versions it was tested with; others read through botocore's public
    `read`, a slice at a time (one copy more, the same bytes)."""
    untested = untested_versions({"botocore": botocore.__version__, "urllib3": urllib3.__version__})
    if untested:
        log.info("%s: not among the versions layertap's direct body reads were tested with; reading ranged "
                 "bodies through botocore's read instead", ", ".join(untested))
    return not untested


def untested_versions(found: dict[str, str]) -> list[str]:
    """"name version" of each package in `found` outside `DIRECT_READ_VERSIONS`."""
    return [f"{name} {v}" for name, v in found.items()
            if not DIRECT_READ_VERSIONS[name][0] <= _major_minor(v) < DIRECT_READ_VERSIONS[name][1]]


def _major_minor(version: str) -> tuple[int, int]:
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


NOT_MD5_KEYS = 3  # objects whose ETag is no MD5 before a store's ETags are no longer compared (`S3Store.get`)


def _md5(body: bytes) -> str:
    return hashlib.md5(body, usedforsecurity=False).hexdigest()


def _md5_etag(resp: dict) -> str | None:
    """The object's ETag where S3 makes it the MD5 of its bytes: one PUT's (a multipart upload's has a
    `-N` part count), not encrypted with KMS or a customer's key (whose ETags are not the MD5)."""
    etag = str(resp.get("ETag", "")).strip('"').lower()
    if resp.get("SSECustomerAlgorithm") or str(resp.get("ServerSideEncryption", "")).startswith("aws:kms"):
        return None
    return etag if re.fullmatch(r"[0-9a-f]{32}", etag) else None


def _plain_http_response(body) -> http.client.HTTPResponse | None:
    """The http.client response under botocore's and urllib3's wrappers: its readinto reads from
    the socket straight into the caller's buffer (theirs read into a new bytes object, then copy).
    None unless the versions are known (`direct_reads`) and the body is the plain, undecoded
    stream botocore returns for a ranged GET."""
    if not direct_reads():
        return None
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if type(body) is StreamingBody and isinstance(fp, http.client.HTTPResponse) \
            and not raw.headers.get("content-encoding") and hasattr(raw, "release_conn"):
        return fp
    return None


