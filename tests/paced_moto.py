"""moto's S3 server with each connection's send rate capped by the kernel (SO_MAX_PACING_RATE).

S3 serves one connection at a limited rate (AWS's guidance: one request per ~85-90 MB/s of
throughput wanted), so a reader keeps several GETs in flight. Pacing models that on loopback at no
CPU cost to either side: the kernel's TCP pacing holds packets back; no proxy copies the bytes.

    python tests/paced_moto.py MB_PER_S -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import socket
import sys

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's value; Python may not name it


def pace_accepted_connections(bytes_per_s: int) -> None:
    """Every socket accepted from now on in this process sends at most `bytes_per_s`."""
    accept = socket.socket.accept

    def paced_accept(self):
        conn, addr = accept(self)
        conn.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, bytes_per_s)
        return conn, addr

    socket.socket.accept = paced_accept


def main(argv: list[str]) -> None:
    rate = int(float(argv[0]) * 1e6)
    if not 0 < rate < 1 << 32:
        raise SystemExit(f"paced_moto: MB_PER_S must be in (0, 4294], got {argv[0]!r}")
    pace_accepted_connections(rate)
    from moto.server import main as moto_main

    moto_main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
