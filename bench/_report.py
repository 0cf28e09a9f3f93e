"""Shared helpers for benches: machine description, CPU time of a process, the
docs/benchmarks.md section writer, and JSON results written whole."""

from __future__ import annotations

import json
import os
import platform
import re
import resource
from pathlib import Path


def machine() -> str:
    """'nproc N, CPU model, OS release'; the model from /proc/cpuinfo where there is one."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"nproc {cores()}, {model}, {platform.system()} {platform.release()}"


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def allocator() -> str:
    """The glibc malloc settings this process started with (MALLOC_* variables), or its defaults."""
    set_ = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    return " ".join(set_) if set_ else "glibc defaults"


def write_section(name: str, markdown: str, path: str | os.PathLike = "docs/benchmarks.md") -> None:
    """Replace the text between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``.

    Creates the file (with a "# Benchmarks" heading) or appends the section if absent; the rest
    of the file is left alone, so several benches can share it.
    """
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    p = Path(path)
    text = p.read_text() if p.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def publish(name: str, markdown: str, write: bool, path: str | os.PathLike = "docs/benchmarks.md") -> None:
    """Print a bench's section and, if `write`, put it in its place in `path` (see `write_section`)."""
    print()
    print(markdown)
    if write:
        write_section(name, markdown, path)
        print(f"\nwrote section {name!r} of {path}")


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process, or of process `pid` of this machine (Linux
    /proc); NaN where that process cannot be read."""
    if pid is None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def save_json(path: str | os.PathLike, obj: object, indent: int = 1) -> None:
    """`obj` as JSON at `path`, by a rename: a reader (the device script's archive loop, every
    30 s) never sees half a file, and a run cut while writing leaves the previous whole one."""
    tmp = Path(f"{path}.part")
    tmp.write_text(json.dumps(obj, indent=indent) + "\n")
    tmp.replace(path)
