"""Where each record of a run lives under its prefix, and how to read facts back out of key names.

    manifest.json                          the immutable plan
    shards/{shard:06d}-{attempt}.lts       data objects, one per attempt (worker token + a nonce);
                                           only the one a commit names counts
    commits/{shard:06d}.json               commit records, created if absent: the truth of "done"
    tally/{shard:06d}.r{records}.t{tokens}.b{bytes}.x{raw}.s{skipped}.c{cut}
                                           empty markers carrying a commit's numbers in the name,
                                           so `status` needs listings only, never a GET per shard
    leases/{shard:06d}/{gen:06d}.ttl{s}    a worker's claim, created once (if absent), naming its attempt;
                                           alive while the newest LastModified of it and its beats + ttl > now
    leases/{shard:06d}/{gen:06d}.ttl{s}.beat-{attempt}
                                           empty: the heartbeat of the attempt that claimed it (`beat_key`)
    failures/{shard:06d}/{ms:013d}-{token}-{attempt}.json
                                           one record per failed attempt; `.stop.json` for an
                                           attempt stopped from outside (a signal, a takeover),
                                           which no retry limit counts; `.store.stop.json` for one
                                           the store failed past its retries: a stop to every reader,
                                           which only a bound of its own counts (`work.STORE_FAILURES`)
    failures/{shard:06d}/{ms:013d}-{token}.withdrawn.json
                                           `layertap verify` withdrew the shard's commit (why, in
                                           the record): no attempt's, so no retry limit counts it
    redo/{shard:06d}                       empty: `verify` withdrew the shard, whose redo no --window holds
                                           back; what wakes workers waiting behind a full window (deleted
                                           by the redo's commit)
    waiting/{token}                        an extraction worker waiting behind a full --window (it holds
                                           no lease): who, and the shard it waits to claim; renewed while
                                           it waits, deleted when it goes on (`consumption.waiting_workers`)
    given_up/{shard:06d}/{ms:013d}-{token} a worker gave the shard up (its --retries used up): the
                                           verdict a follow-mode trainer waits for before it ends
                                           its epoch without the shard
    sweeps/{digest}/{gen:06d}[.done]       the end-of-run sweep of what killed attempts left, claimed by one
                                           worker per state of the commits (`work.WorkQueue._sweep`)
    consumed/ranks/{rank:05d}.json         a training rank's watermark: shards it read for the last time
    consumed/shards/{shard:06d}            empty marker: the shard was consumed, its data deleted
    consumed/window.json                   the --window extraction runs with (the trainer's stall check)
    consumed/stalled.json                  a follow trainer's STALLED report (window full, training waits for
                                           data), renewed each look, deleted once it goes on (`status` shows it)
    index/commits.json.zst                 a snapshot of the commit records, derived: a reader uses an
                                           entry only while `commits/` lists it unchanged

Every record type sits under its own prefix, so one paginated listing per type tells the state
of the whole run.
"""

from __future__ import annotations

import re

from layertap.storage.store import is_write_probe

MANIFEST = "manifest.json"
EXPORT_NOTE = "layertap-export.json"  # beside `layertap export`'s foreign files (extract.interop), not a run's
SHARDS, COMMITS, TALLY, LEASES, FAILURES = "shards/", "commits/", "tally/", "leases/", "failures/"
GIVEN_UP = "given_up/"
REDO = "redo/"  # shards `verify` withdrew, awaiting their redo (`redo_key`)
WAITING = "waiting/"  # extraction workers waiting behind a full --window (`waiting_key`)
SWEEPS = "sweeps/"  # claims of the end-of-run sweep (`work.WorkQueue._sweep`), not the run's data
FEED = "feed/"  # one empty key per commit, named by its time and counts: what follow mode lists for new commits
COMMIT_INDEX = "index/commits.json.zst"
CONSUMED, CONSUMED_RANKS, CONSUMED_SHARDS = "consumed/", "consumed/ranks/", "consumed/shards/"
CONSUMED_WINDOW = "consumed/window.json"  # the --window extraction runs with, for the trainer's stall check
CONSUMED_STALL = "consumed/stalled.json"  # a follow trainer's STALLED report while it lasts (`record_stall`)
CONSUMER = "consumed/trainer.json"  # the one --delete-consumed trainer of the run: its output

_FEED = re.compile(r"^(\d{13})\.(\d{6,})(?:\.r(\d+)\.s(\d+))?$")
_TALLY = re.compile(r"^(\d+)\.r(\d+)\.t(\d+)\.b(\d+)\.x(\d+)\.s(\d+)(?:\.c(\d+))?$")
_LEASE = re.compile(r"^(\d+)/(\d+)\.ttl(\d+(?:\.\d+)?)$")
_SHARD_ID = re.compile(r"^(\d+)")
_EXTRACT_LOG = re.compile(r"(^|/)extract-rank\d+\.log$")  # extract.run's log file, one per rank
_DATA_KEY = re.compile(r"^shards/(\d{6,})-([A-Za-z0-9]+)\.lts$")


def data_key(shard: int, attempt: str) -> str:
    return f"{SHARDS}{shard:06d}-{attempt}.lts"


def is_data_key(key: str, shard: int) -> bool:
    """Whether `key` names a data object of `shard`: what a commit record may point at."""
    m = _DATA_KEY.match(key) if isinstance(key, str) else None
    return bool(m) and int(m.group(1)) == shard


def commit_key(shard: int) -> str:
    return f"{COMMITS}{shard:06d}.json"


def tally_key(shard: int, records: int, tokens: int, nbytes: int, raw: int, skipped: int, truncated: int) -> str:
    """`truncated`: samples cut at the run's max_length (`.c`; absent in markers written before it was counted)."""
    return f"{TALLY}{shard:06d}.r{records}.t{tokens}.b{nbytes}.x{raw}.s{skipped}.c{truncated}"


FEED_MARGIN_S = 10.0  # a reader lists feed keys from its previous look's time less this: clock error, slow PUTs


def feed_key(millis: int, shard: int, records: int, skipped: int) -> str:
    """The commit of `shard` at `millis` (the store's clock), with its record and skipped-sample
    counts: keys sort by time, so a reader lists only the recent ones (`feed_after`), however many
    commits the run holds, and learns from the counts alone whether it has a share of the shard."""
    return f"{FEED}{millis:013d}.{shard:06d}.r{records}.s{skipped}"


def feed_after(millis: int) -> str:
    """The `start_after` of a listing of the feed keys written at or after `millis`."""
    return f"{FEED}{millis:013d}"


def parse_feed(key: str) -> tuple[int, int, tuple[int, int] | None] | None:
    """(millis, shard, (records, skipped)) of a feed key; the counts are None in a key written
    before they were part of it."""
    m = _FEED.match(key[len(FEED) :])
    if not m:
        return None
    counts = (int(m.group(3)), int(m.group(4))) if m.group(3) is not None else None
    return int(m.group(1)), int(m.group(2)), counts


def consumed_rank_key(rank: int) -> str:
    return f"{CONSUMED_RANKS}{rank:05d}.json"


def consumed_marker_key(shard: int) -> str:
    return f"{CONSUMED_SHARDS}{shard:06d}"


def lease_prefix(shard: int) -> str:
    return f"{LEASES}{shard:06d}/"


def lease_key(shard: int, generation: int, ttl_s: float) -> str:
    return f"{lease_prefix(shard)}{generation:06d}.ttl{ttl_text(ttl_s)}"


BEAT = ".beat-"


def beat_key(lease: str, holder: str) -> str:
    """The key a lease's holder renews it by (a work lease's attempt, an output lease's token).
    The lease key itself is written once, by the claim: a renewal that lands late (a holder
    paused between its check and its PUT) rewrites only a key of its own, never a lease that
    a new holder created meanwhile under the same name (generations restart once a shard's
    leases are all gone). Readers count any beat of a lease key (`beat_of`) as its renewal."""
    return f"{lease}{BEAT}{holder}"


def beat_of(key: str) -> str | None:
    """The lease key that a beat key renews; None if `key` is no beat."""
    lease, sep, holder = key.rpartition(BEAT)
    return lease if sep and lease and holder else None


def ttl_text(ttl_s: float) -> str:
    """A TTL as lease keys name it: plain decimal digits that `parse_lease` reads back (`:g`
    wrote 1e+06 and 12345.7 for 12345.67)."""
    if not 0 < ttl_s < 1e9:
        raise ValueError(f"a lease TTL must be positive and finite, got {ttl_s}")
    return f"{ttl_s:.3f}".rstrip("0").rstrip(".")


def failure_prefix(shard: int) -> str:
    return f"{FAILURES}{shard:06d}/"


STOPPED = ".stop.json"
WITHDRAWN = ".withdrawn.json"
STORE_STOPPED = ".store" + STOPPED  # a stop by the store failing past its retries (`work.Claim.fail`)


def given_up_key(shard: int, millis: int, token: str) -> str:
    return f"{GIVEN_UP}{shard:06d}/{millis:013d}-{token}"


def record_millis(key: str) -> int:
    """The time in ms a failure or given-up key starts its name with (0 if it does not)."""
    try:
        return int(key.rsplit("/", 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return 0


def failure_key(shard: int, millis: int, token: str, attempt: int = 0, stopped: bool = False,
                by_store: bool = False) -> str:
    """The attempt (its lease generation) keeps two failures of one worker in one millisecond apart.
    `by_store`: a stop by the store failing (`STORE_STOPPED`), which every reader takes for a stop."""
    suffix = STORE_STOPPED if by_store else STOPPED if stopped else ".json"
    return f"{failure_prefix(shard)}{millis:013d}-{token}-{attempt}{suffix}"


def withdrawal_key(shard: int, millis: int, token: str) -> str:
    """`verify` withdrew the shard's commit: shown as the shard's failure, but no attempt failed
    (a live extraction counting it gave the shard up under `--retries 0`)."""
    return f"{failure_prefix(shard)}{millis:013d}-{token}{WITHDRAWN}"


def redo_key(shard: int) -> str:
    """A withdrawn shard awaits its redo: listed by extraction workers waiting behind a full
    --window (`consumption.WindowGate`), which no window holds back, since the data it restores was
    at rest, counted by the window, until `verify` withdrew it."""
    return f"{REDO}{shard:06d}"


def waiting_key(token: str) -> str:
    return f"{WAITING}{token}"


def counts_as_attempt(key: str) -> bool:
    """Whether a failure record counts against the shard's retries: not an attempt stopped from
    outside, nor a withdrawal by `verify`, which say nothing of the shard's own attempts."""
    return not key.endswith((STOPPED, WITHDRAWN))


def shard_of(key: str, prefix: str) -> int | None:
    """The shard id a record key under `prefix` belongs to (None for foreign keys)."""
    m = _SHARD_ID.match(key[len(prefix) :])
    return int(m.group(1)) if m else None


def parse_tally(key: str) -> tuple[int, dict[str, int]] | None:
    m = _TALLY.match(key[len(TALLY) :])
    if not m:
        return None
    shard, r, t, b, x, s = map(int, m.groups()[:6])
    return shard, {"records": r, "tokens": t, "bytes": b, "raw_bytes": x, "skipped": s,
                   "truncated": int(m.group(7) or 0)}


def parse_lease(key: str) -> tuple[int, int, float] | None:
    """(shard, generation, ttl seconds) of a lease key."""
    m = _LEASE.match(key[len(LEASES) :])
    return (int(m.group(1)), int(m.group(2)), float(m.group(3))) if m else None


# Every key a run writes, each family by its own name (`data_key`, `commit_key`, `tally_key`, ...): a file
# of one's own put in one of its folders (shards/README.txt) is no key of the run's, and `delete` refuses it
_RUN_KEY = re.compile(
    r"(manifest\.json"
    r"|shards/\d{6,}-[A-Za-z0-9]+\.lts"
    r"|commits/\d{6,}\.json"
    r"|tally/\d+\.r\d+\.t\d+\.b\d+\.x\d+\.s\d+(\.c\d+)?"
    r"|leases/\d{6,}/\d+\.ttl\d+(\.\d+)?(\.beat-[^/]+)?"
    r"|(failures|given_up)/\d{6,}/\d{13}-[^/]+"
    r"|redo/\d{6,}"
    r"|waiting/[^/]+"
    r"|sweeps/[0-9a-f]{16}/\d{6,}(\.done)?"
    r"|feed/\d{13}\.\d{6,}(\.r\d+\.s\d+)?"
    r"|index/commits\.json\.zst"
    r"|consumed/(ranks/\d{5,}\.json|shards/\d{6,}|window\.json|trainer\.json|stalled\.json))")


def is_run_key(key: str) -> bool:
    """Whether `key` (relative to a run's prefix) is one of the run's own objects, the write probe
    layertap may leave at any prefix, or an extraction's log (`--log-dir` may be inside the run)."""
    return _RUN_KEY.fullmatch(key) is not None or is_write_probe(key) or _EXTRACT_LOG.search(key) is not None
