"""A fault-injecting HTTP proxy for S3 tests: put it between boto3 and a real S3 server (moto).

    proxy = FaultProxy("http://127.0.0.1:5000", rate=0.1, seed=1).start()
    open_store("s3://bucket/run", endpoint_url=proxy.url)     # or AWS_ENDPOINT_URL=proxy.url
    ...
    proxy.counts      # Counter of the faults injected, by kind, and of the requests seen

A `rate` share of requests is answered by one of the faults below. The share is exact, not a
coin toss per request, so a test can count on it however many requests the client's threads
happen to send: requests are taken in windows of 1/rate, and in each window one request, at a
position drawn from a seeded RNG, gets a fault (of a kind drawn from the same RNG):

- ``500``: an InternalError XML body, the request never reaches the server;
- ``503``: a SlowDown XML body (S3's throttling answer), never reaches the server;
- ``reset``: the connection is reset (RST) before the request is forwarded;
- ``reset-after``: the request is forwarded and APPLIED by the server, then the connection is
  reset instead of the answer: the client cannot know its write landed (a retried create, a
  retried CompleteMultipartUpload, a retried If-None-Match PUT all see their own earlier effect);
- ``cut``: the answer's headers and half its body are sent, then the connection is reset;
- ``stall``: the answer waits `stall_s` seconds (shorter than the client's read timeout: just
  slow; longer: the client times out and retries);
- ``404``, only when asked for (it means something only to requests naming an upload): a
  NoSuchUpload XML body, never reaches the server; what MinIO answers a retried
  CompleteMultipartUpload whose first try landed (minio/minio#13318);
- ``400``, only when asked for: a BadDigest XML body, never reaches the server; what S3 answers
  a body damaged on the way (its Content-MD5 or checksum does not match what arrived);
- ``501``, only when asked for: a NotImplemented XML body, never reaches the server; what a server
  answers a request it does not support at all (AWS S3 before August 2024 a PUT with
  `If-None-Match`, some gateways DeleteObjects).
- ``flip``, only when asked for: a successful answer's body with one byte in its middle flipped (a
  bad NIC, a proxy's bug): the object is sound, this read of it is not.

Requests travel byte for byte (headers in order, chunked bodies unchanged), so SigV4 signatures
and content checksums still verify upstream. Hop-by-hop headers are not forwarded, nor those named
in `strip`: ``strip=("If-None-Match",)`` makes moto a server that ignores conditional writes (its
signature no longer verifies, which moto does not check; radosgw would refuse it).
"""

from __future__ import annotations

import http.client
import math
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("500", "503", "reset", "reset-after", "cut", "stall")  # the default: any request may get one
KINDS = (*FAULTS, "400", "404", "501", "flip")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer",
               "upgrade", "expect"}
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "400": (400, "BadDigest", "The Content-MD5 you specified did not match what we received."),
    "404": (404, "NoSuchUpload", "The specified multipart upload does not exist."),
    "501": (501, "NotImplemented", "A header you provided implies functionality that is not implemented."),
}


class FaultProxy:
    """A threaded proxy to `upstream` that injects `faults` into a `rate` share of requests.

    `match(method, path)` narrows the requests that may fail (e.g. only CompleteMultipartUpload:
    ``lambda m, p: m == "POST" and "uploadId=" in p``); `limit` caps the faults injected;
    `in_turn` takes the faults in the order given instead of drawing them (a script: the first
    try lands unheard, its retry is answered 404).
    """

    def __init__(self, upstream: str, *, rate: float = 0.0, seed: int = 0, faults: tuple[str, ...] = FAULTS,
                 stall_s: float = 0.3, match=None, limit: int | None = None, in_turn: bool = False,
                 strip: tuple[str, ...] = ()):
        unknown = set(faults) - set(KINDS)
        if unknown or not faults:
            raise ValueError(f"unknown faults {sorted(unknown)}; choose from {KINDS}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must lie in [0, 1], got {rate}")
        u = urllib.parse.urlsplit(upstream)
        self.upstream = (u.hostname, u.port or 80)
        self.rate, self.faults, self.stall_s = rate, tuple(faults), stall_s
        self.match, self.limit, self.in_turn = match, limit, in_turn
        self.strip = {h.lower() for h in strip}
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._seen = 0  # requests that `match`
        self._window = 0
        self._next_fault = self._fault_position(0)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.url = ""

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def injected(self) -> int:
        with self._lock:
            return self._injected()

    def _injected(self) -> int:
        return sum(n for k, n in self.counts.items() if k in KINDS)

    def _fault_position(self, window: int) -> int | None:
        """The index, among matching requests, of the one that fails in `window`."""
        if self.rate == 0.0:
            return None
        start, end = math.ceil(window / self.rate), math.ceil((window + 1) / self.rate)
        return self._rng.randrange(start, max(end, start + 1))

    def _draw(self, method: str, path: str) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            if self.match is not None and not self.match(method, path):
                return None
            index, self._seen = self._seen, self._seen + 1
            if index != self._next_fault:
                return None
            self._window += 1
            self._next_fault = self._fault_position(self._window)
            if self.limit is not None and self._injected() >= self.limit:
                return None
            fault = self.faults[self._injected() % len(self.faults)] if self.in_turn else self._rng.choice(self.faults)
            self.counts[fault] += 1
            return fault


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as boto3's connection pool expects
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: tests read results, not access logs
        pass

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        """The request body exactly as sent: Content-Length bytes, or the raw chunked framing."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = bytearray()
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        line = self.rfile.readline()
                        raw += line
                        if line in (b"\r\n", b"\n", b""):
                            return bytes(raw)
                raw += self.rfile.read(size + 2)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _proxy(self) -> None:
        body = self._read_body()
        fault = self.owner._draw(self.command, self.path)
        if fault in _ERRORS:
            return self._error(*_ERRORS[fault])
        if fault == "reset":
            return self._reset()
        try:
            status, reason, headers, payload = self._forward(body)
        except OSError as e:
            return self._error(502, "BadGateway", f"upstream failed: {e}")
        if fault == "reset-after":
            return self._reset()
        if fault == "stall":
            time.sleep(self.owner.stall_s)
        if fault == "flip" and status in (200, 206) and payload:
            payload = bytearray(payload)
            payload[len(payload) // 2] ^= 0x01
            payload = bytes(payload)
        self.send_response_only(status, reason)
        for k, v in headers:
            self.send_header(k, v)
        if self.command != "HEAD" and status not in (204, 304):
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "cut" and len(payload) > 1:
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            return self._reset()
        self.wfile.write(payload)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        for attempt in (0, 1):  # the server may have closed our kept-alive connection
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=120)
            try:
                c = self._upstream
                c.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP_BY_HOP | self.owner.strip:
                        c.putheader(k, v)
                c.endheaders()
                if body:
                    c.send(body)
                resp = c.getresponse()
                payload = resp.read()
                headers = [(k, v) for k, v in resp.getheaders()
                           if k.lower() not in _HOP_BY_HOP | {"transfer-encoding"}
                           and (self.command == "HEAD" or k.lower() != "content-length")]
                return resp.status, resp.reason, headers, payload
            except (http.client.HTTPException, OSError):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _error(self, status: int, code: str, message: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                f"<RequestId>faultproxy</RequestId></Error>").encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        """Close with RST (SO_LINGER 0): the client sees 'connection reset by peer'."""
        try:
            self.wfile.flush()
        except OSError:
            pass
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        if self._upstream is not None:
            self._upstream.close()
