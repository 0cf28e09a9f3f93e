"""moto's S3 server as the tests and benches start it: S3's atomic conditional writes, and
optionally each connection's send rate capped by the kernel.

Atomic conditional writes. moto 5.2's PutObject checks `If-None-Match: *` (or `If-Match`) and then
stores, two steps with no lock between them (moto/s3/responses.py, `S3Response.put_object`), while
its server answers each request on its own thread: two racing creates of one key can both get 200.
S3 and radosgw give exactly one 200 and 412 to the rest, and layertap's commits and leases rest on
that, so a race test against plain moto fails by chance under load (CI: two winners of eight). Here
each conditional PutObject holds one lock from its check to its store; every other request runs as
moto has it. tests/test_rgw.py runs the same races against radosgw, which needs no help.

Pacing (`--pace MB_PER_S`). S3 serves one connection at a limited rate (AWS's guidance: one
request per ~85-90 MB/s of throughput wanted), so a reader keeps several GETs in flight. The
kernel's TCP pacing (SO_MAX_PACING_RATE) models that on loopback at no CPU cost to either side:
packets are held back; no proxy copies the bytes.

    python tests/moto_s3.py [--pace MB_PER_S] -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import functools
import socket
import sys
import threading

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's value; Python may not name it
CONDITIONS = ("If-None-Match", "If-Match")


def make_conditional_puts_atomic() -> None:
    """Serialize moto's conditional PutObjects: check and store then happen as one step."""
    from moto.s3.responses import S3Response

    put_object = S3Response.put_object
    lock = threading.Lock()

    @functools.wraps(put_object)
    def atomic_put_object(self):
        if any(h in self.headers for h in CONDITIONS):
            with lock:
                return put_object(self)
        return put_object(self)

    S3Response.put_object = atomic_put_object


def pace_accepted_connections(bytes_per_s: int) -> None:
    """Every socket accepted from now on in this process sends at most `bytes_per_s`."""
    accept = socket.socket.accept

    def paced_accept(self):
        conn, addr = accept(self)
        conn.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, bytes_per_s)
        return conn, addr

    socket.socket.accept = paced_accept


def main(argv: list[str]) -> None:
    if argv[:1] == ["--pace"]:
        rate = int(float(argv[1]) * 1e6)
        if not 0 < rate < 1 << 32:
            raise SystemExit(f"moto_s3: --pace MB_PER_S must be in (0, 4294], got {argv[1]!r}")
        pace_accepted_connections(rate)
        argv = argv[2:]
    make_conditional_puts_atomic()
    from moto.server import main as moto_main

    moto_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
