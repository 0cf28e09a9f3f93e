# Shared by .ci/slurm.sh and .ci/rgw.sh (sourced): free ports, stopping daemons by their pid
# files, and the `install | start DIR | stop DIR` command line.

# N free TCP ports on 127.0.0.1, on one line.
free_ports() {
  python3 -c 'import socket, sys
s = [socket.socket() for _ in range(int(sys.argv[1]))]
[x.bind(("127.0.0.1", 0)) for x in s]
print(*[x.getsockname()[1] for x in s])' "$1"
}

# Stop the process of each pid file given (missing files are skipped): TERM, up to 10 s, then KILL.
stop_pidfiles() {
  local f pid
  for f in "$@"; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

# Run the script's install / start / stop function named by the arguments.
dispatch() {
  case "${1:-}" in
    install) install ;;
    start) start "${2:?usage: $0 start DIR}" ;;
    stop) stop "${2:?usage: $0 stop DIR}" ;;
    *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
  esac
}
