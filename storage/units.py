"""How layertap shows sizes and durations to people: one rule for every command.

Sizes are binary (KiB, MiB, GiB, TiB = 2^10, 2^20, 2^30, 2^40 bytes); durations read as speech.
And how people write sizes to layertap (`parse_size`: --shard-bytes 64MB, --memory-budget 4GiB).
Here, in the lowest room, so that `status` (manifests/), the progress lines (extract/) and
anything above them say "12.3 MiB" and "3 h 05 min" the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from layertap.storage.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def size(n: float) -> str:
    """Binary units, as everywhere layertap shows a size: '0 B', '812 KiB', '12.3 MiB', '1.50 GiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    return f"{n:.0f} B"


def counted(n: int, noun: str) -> str:
    """'1 shard', '2 shards', '1,204 shards' (a regular plural)."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def possessive(name: str) -> str:
    """"specforge's", "speculators'" (a format's name in a message)."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def listing(items, limit: int = 10) -> str:
    """The first `limit` of `items` for a message: '3, 7, 9 and 12 more' (one rule, not one per message)."""
    items = list(items)
    return ", ".join(map(str, items[:limit])) + (f" and {len(items) - limit:,} more" if len(items) > limit else "")


def id_runs(ids: Iterable[int]) -> list[list[int]]:
    """Ids as sorted runs of consecutive ones, [[first, last], ...]: tens of thousands of shards in a few numbers."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def id_ranges(ids: Iterable[int], limit: int = 20) -> str:
    """Ids as runs of consecutive ones ("3-17, 40"): the first `limit` runs, then how many ids the
    rest hold, so that a report of tens of thousands of shards stays a line."""
    runs = id_runs(ids)
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return text + (f" and {rest:,} more" if rest else "")


def duration(seconds: float) -> str:
    """'45 s', '12 min', '3 h 05 min', '2 d 4 h'."""
    s = int(round(seconds))
    if s < 90:
        return f"{s} s"
    if s < 5400:
        return f"{round(s / 60)} min"
    if s < 2 * 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


BARE_FLOOR = 1 << 20  # a size written without a unit below this is taken for a forgotten unit


def parse_size(text: str | int) -> int:
    """'64MB' -> 64_000_000, '1GiB' -> 2**30, '32B' -> 32, 4096 -> 4096. A number comes as it is
    from a --config file, and must be positive too: a window of 0 bytes had every worker wait for
    good. Text without a unit is bytes only from 1 MiB up: '32' is refused, a unit forgotten."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = _SIZE.match(str(text)) if not isinstance(text, bool) else None
        unit = (m.group(2) or "").lower().removesuffix("b") if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"invalid size {text!r}: use a number with an optional unit, e.g. 64MB, 1GB, 512MiB")
        size = int(float(m.group(1)) * _UNITS[unit])
        if isinstance(text, str) and not m.group(2) and 0 < size < BARE_FLOOR:
            # `--shard-bytes 32` made one shard per sample, and the plan is kept for good
            n = text.strip()
            raise ConfigError(f"size {text!r} has no unit, so it is {size} bytes: write the unit, e.g. {n}MB, {n}MiB "
                              f"or {n}GB ({n}B if bytes are meant)")
    if size <= 0:
        raise ConfigError(f"invalid size {text!r}: must be positive")
    return size
