"""What is done, running, failed and pending in a run; and re-verification of committed shards."""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from layertap.manifests import layout
from layertap.manifests.consumption import (at_rest, consumed_everywhere, consumed_shards, marker_times,
                                            recent_stall, recorded_window, waiting_records,
                                            waiting_workers)
from layertap.manifests.manifest import Manifest, ManifestError, UnsupportedVersion, header_mismatch, load_manifest
from layertap.manifests.records import (TO_WITHDRAW, CommitRecord, FailureRecord, Producer, decode_commit,
                                       decode_failure, encode)
from layertap.manifests.state import RunState, replaced_manifest_error, scan
from layertap.storage.store import ObjectNotFound, ObjectStore, StoreError, TransientStoreError
from layertap.storage.units import id_ranges

if TYPE_CHECKING:
    from layertap.storage.format import ShardMeta
    from layertap.storage.reader import VerifyReport  # it imports torch: not for status

log = logging.getLogger(__name__)

RATE_WINDOW_S = 600.0  # the recent rate is measured over the commits of the last ten minutes
SKIP_REASON_SHARDS = 200  # commit records `status` reads for the reasons samples were skipped
# A running shard with this many attempts stopped or failed before is reported with the last one's error
RETRIED_SHOWN = 3
# Failure records `status` reads and reports in detail, of the failed and of the interrupted shards
# each: the newest, which say what goes wrong now. A store outage leaves tens of thousands of stopped
# shards whose records repeat one or two errors; twenty show those (forty in all, read 8 at a time:
# five round trips) and fit a screen, where one GET and one line per shard took minutes.
FAILURE_DETAILS = 20
CONSUMED = "consumed"  # what `verify`'s check says of a shard consumed while it looked
GONE = "gone"  # ... and of a shard whose commit went since the scan (another verify withdrew it)
UNCHECKED = "unchecked"  # ... and of a shard not read: the store failed past its retries (on it, or before it)


def _imported_from(manifest: Manifest) -> dict[str, Any] | None:
    """The source and format of a run `layertap import` made (extract/interop.py records them as
    its dataset), None for an extraction: what the command that finishes the run is."""
    d = manifest.dataset
    if not str(d.get("fingerprint", "")).startswith("import:"):
        return None
    return {"path": d.get("path"), "format": d.get("format")}


EXITED_HOLDERS_READ = 16  # leases of running shards whose holders `status` looks at (a GET each)


def exited_here(store: ObjectStore, st: RunState, running: list[int], limit: int = EXITED_HOLDERS_READ) -> list[int]:
    """The running shards whose lease's holder ran on this machine and has exited (a worker killed
    with SIGKILL): they show as running until the lease's TTL, while the next `layertap extract`
    here takes them over at once (`liveness.gone_from_here`). Up to `limit` leases read; the
    others count as running."""
    from layertap.manifests.liveness import gone_from_here
    from layertap.manifests.work import read_lease
    from layertap.storage.store import StoreError

    exited = []
    for shard in running[:limit]:
        lease = st.live_lease(shard)
        try:
            payload = read_lease(store, lease.key) if lease is not None else None
        except StoreError:  # gone or unreadable meanwhile: counted as running, as the listing says
            continue
        if payload is not None and gone_from_here(payload.get("holder") or {}):
            exited.append(shard)
    return exited


def run_status(store: ObjectStore, manifest: Manifest | None = None, shards: bool = False) -> dict[str, Any]:
    """One JSON-ready summary: counts per state, totals of committed work, throughput, ETA, and
    why shards failed; with `shards`, every shard's state and data object (and a failed one's error).
    `failed` and `interrupted` hold the records of at most the `FAILURE_DETAILS` newest of each (in
    shard order); `shards_failed` and `shards_interrupted` count them all, and `failed_ranges` and
    `interrupted_ranges` name them (`id_ranges`: the first 20 runs of ids, then how many more).
    Read-only. Costs five listings (six with `shards`) plus a GET per failure record read: up to
    `FAILURE_DETAILS` twice, every failed shard's with `shards` (and a GET per commit whose tally
    marker is missing, or whose data object the listing leaves ambiguous, and per shard with
    skipped samples, up to `SKIP_REASON_SHARDS`); a run trained while extracted adds listings of `consumed/` and a GET
    per training rank; running shards, a GET each of up to `EXITED_HOLDERS_READ` leases
    (`shards_running_exited_here`)."""
    manifest = manifest or load_manifest(store)
    st = scan(store, manifest, with_data=shards)
    counts = {"done": 0, "running": 0, "failed": 0, "pending": 0}
    with_failures, running = [], []
    for plan in manifest.shards:
        state = st.state(plan.id)
        counts[state] += 1
        if state == "failed":
            with_failures.append(plan.id)
        elif state == "running":
            running.append(plan.id)
    tallies, unreadable = _tallies(store, st)
    samples = sum(t["records"] for t in tallies.values())
    tokens = sum(t["tokens"] for t in tallies.values())
    stored = sum(t["bytes"] for t in tallies.values())
    raw = sum(t["raw_bytes"] for t in tallies.values())
    skipped = sum(t["skipped"] for t in tallies.values())
    truncated = sum(t["truncated"] for t in tallies.values())
    remaining = sum(p.est_tokens for p in manifest.shards if p.id not in st.committed)
    last = max(st.commit_times.values(), default=None)
    exited = len(exited_here(store, st, running))
    live = counts["running"] - exited  # a shard whose holder has exited is not being worked on
    # While shards run, the rate is up to now (a stall shows as a falling rate); otherwise it is
    # the rate of the run's last ten minutes of commits, which stays true after the run stopped.
    end = st.now if live or last is None else last
    committed_tokens = {s: t["tokens"] for s, t in tallies.items()}
    recent = recent_commits(st.commit_times, committed_tokens, end)
    rate = _rate(recent, committed_tokens, end)
    complete = counts["done"] == len(manifest.shards) and not st.stale_commits
    # A shard whose last attempt was stopped (preemption, Ctrl-C, a takeover, a store outage) did not
    # fail: it waits for a rerun.
    failed_ids, stopped_ids, summaries = _failures(store, st, with_failures, read_all=shards)
    # running again after attempts that stopped or failed, again and again (a store failing every upload of
    # the shard): "1 running, 0 failed" hid it while every worker tried it, and tried
    retried = sorted(_newest(st, [s for s in running if _tries(st, s) >= RETRIED_SHOWN]))
    with ThreadPoolExecutor(max(1, min(8, len(retried)))) as pool:  # within an S3 store's connection pool (20)
        retrying = list(pool.map(lambda s: _failure_summary(store, st, s), retried))
    counts["failed"] = len(failed_ids)
    marks = marker_times(store)
    # a consumed shard's marker is written before its data is deleted: its bytes are no longer at rest
    deleted = sum(t["bytes"] for s, t in tallies.items() if s in marks)
    consumption = _consumption(store, st, tallies, marks)
    listed = {"shards": _shard_list(store, st, tallies, summaries, set(stopped_ids), set(marks))} if shards else {}
    return {
        "prefix": store.uri,
        "run_id": manifest.run_id,
        "created_at": manifest.created_at,
        "model": manifest.identity.model,
        "codec": manifest.identity.codec,
        "imported_from": _imported_from(manifest),
        "shards_total": len(manifest.shards),
        "shards_done": counts["done"],
        "shards_running": counts["running"],
        **({"shards_running_exited_here": exited} if exited else {}),
        "shards_failed": counts["failed"],
        "shards_interrupted": len(stopped_ids),
        "shards_pending": counts["pending"],
        "samples_total": manifest.num_samples,  # the plan's rows
        "samples_planned": manifest.planned_records,  # of them, those the planner found yield a sample
        "samples_done": samples,
        "samples_skipped": skipped,
        "skipped_by_reason": _skip_reasons(store, tallies) if skipped else None,
        "samples_truncated": truncated,  # cut at max_length (0 in shards committed before layertap counted them)
        "max_length": manifest.identity.max_length,
        "tokens_total_est": manifest.est_tokens,
        "tokens_done": tokens,
        "bytes_stored": stored,  # ever: every committed shard's data object, consumed ones included
        "bytes_at_rest": stored - deleted,  # now: less the data training consumed and deleted
        "bytes_raw": raw,
        "compression_ratio": round(raw / stored, 4) if stored else None,
        "tokens_per_s": round(rate, 1) if rate else None,
        "rate_until": None if rate is None else "now" if counts["running"] else "last commit",
        # the span the rate is over: RATE_WINDOW_S, or less in a run younger than that
        "rate_over_s": round(max(end - recent[0][0], 1.0)) if rate else None,  # as `_rate` divides
        "tokens_per_s_average": _average_rate(manifest.created_at, last, tokens),
        "last_commit_age_s": round(max(0.0, st.now - last), 1) if last is not None else None,  # clocks a second apart
        # Only while workers hold shards, at the rate they are going at now: a remaining time
        # from an old rate, or for work nobody is doing, would promise what will not happen.
        "eta_s": round(remaining / rate) if rate and remaining and live else None,
        "complete": complete,
        "failed": _newest_details(st, failed_ids, summaries),
        "interrupted": _newest_details(st, stopped_ids, summaries),
        "retrying": retrying,  # running shards with RETRIED_SHOWN or more attempts before (the newest few)
        # the failed shards as "3-17, 40": the first 20 runs of ids, then "and N more" (--shards: every one)
        "failed_ranges": id_ranges(failed_ids),
        "interrupted_ranges": id_ranges(stopped_ids),
        "stale_commits": st.stale_commits,
        "problem": (str(replaced_manifest_error(store.uri, st.stale_commits)) if st.stale_commits
                    else f"{len(unreadable)} commit record(s) cannot be read, their samples not counted: "
                         f"{unreadable[0]}" if unreadable else None),
        "consumption": consumption,
        "window": (window := recorded_window(store)),  # the --window extraction runs with (bytes), None without one
        # what the window bounds, measured as its gate measures it: every data object under shards/ (a crashed
        # attempt's leftover too, which `bytes_at_rest`, from the commits, leaves out)
        "window_at_rest": at_rest(store).bytes if window is not None else None,  # a listing of shards/, the window's size
        # extraction workers waiting behind it (they hold no lease: not `shards_running`), by their fresh records
        # of processes not gone from this host; the Slurm tasks among them, for the caller to ask squeue about
        "workers_waiting": len(waiting := waiting_workers(store, waiting_records(store))
                               if window is not None and not complete else []),
        "waiting_tasks": [w.task for w in waiting if w.task],
        # a follow trainer's STALLED report while it lasts (window full, training waiting for data): for good
        "stalled": recent_stall(store) if window is not None and not complete else None,
        **listed,
    }


def _consumption(store: ObjectStore, st: RunState, tallies: dict[int, dict[str, int]],
                 marks: dict[int, float]) -> dict[str, Any] | None:
    """For a run trained while extracted (`consumption.py`): what training consumed, what waits
    for it (the backlog, at rest), and both rates per hour (extraction from the commits' times,
    training from the consumed markers'). None for a run without such records."""
    if not marks and not any(store.list(layout.CONSUMED_RANKS)):
        return None
    consumed = consumed_everywhere(store, set(marks)) & st.committed
    waiting = st.committed - consumed

    def total(ids: set[int], what: str) -> int:
        return sum(tallies[s][what] for s in ids if s in tallies)

    def per_hour(times: dict[int, float]) -> dict[str, int | None]:
        return {f"{what}_per_h": round(r * 3600) if (r := burst_rate(times, {s: t[key] for s, t in tallies.items()}))
                is not None else None for what, key in (("samples", "records"), ("bytes", "bytes"))}

    return {
        "shards": len(consumed), "samples": total(consumed, "records"), "shards_deleted": len(marks),
        "backlog_shards": len(waiting), "backlog_samples": total(waiting, "records"),
        "backlog_bytes": total(waiting, "bytes"),
        "extraction": per_hour(st.commit_times), "training": per_hour(marks),
    }


def burst_rate(times: dict[int, float], values: dict[int, int], window_s: float = 3600.0,
               burst_s: float = 10.0) -> float | None:
    """Per second, over the events of the `window_s` before the newest: the values of those after
    the oldest, over the time since it. Events come in bursts (markers are written together after
    a training checkpoint), so the oldest's whole burst (within `burst_s` of it) is left out, as
    what it counts was done before it. None without two bursts in the window."""
    events = sorted((t, s) for s, t in times.items() if s in values)
    if not events:
        return None
    newest = events[-1][0]
    recent = [(t, s) for t, s in events if t >= newest - window_s]
    first = recent[0][0]
    later = [(t, s) for t, s in recent if t > first + burst_s]
    if not later:
        return None
    return sum(values[s] for _, s in later) / (newest - first)


def _shard_list(store: ObjectStore, st: RunState, tallies: dict[int, dict[str, int]],
                failures: dict[int, dict[str, Any]], stopped: set[int], consumed: set[int]) -> list[dict[str, Any]]:
    """Every shard: its state and, when committed, its data object and numbers. The object is the
    listing's only one for the shard, or (crashed attempts left others) the one its commit names;
    a consumed shard's data is deleted (state "consumed")."""
    errors = {s: f["error"] for s, f in failures.items()}
    out = []
    for plan in st.manifest.shards:
        state = "interrupted" if plan.id in stopped and st.state(plan.id) == "failed" else st.state(plan.id)
        entry: dict[str, Any] = {"shard": plan.id, "state": state, "object": None}
        if plan.id in consumed and plan.id in st.committed:
            entry["state"] = "consumed"
            entry.update(tallies.get(plan.id, {}))
        elif plan.id in st.committed:
            keys = st.data_objects.get(plan.id, [])
            key = keys[0] if len(keys) == 1 else _committed_key(store, plan.id)
            entry["object"] = f"{store.uri.rstrip('/')}/{key}" if key else None
            entry.update(tallies.get(plan.id, {}))
        if plan.id in errors:
            entry["error"] = errors[plan.id]
        out.append(entry)
    return out


def _committed_key(store: ObjectStore, shard: int) -> str | None:
    key = layout.commit_key(shard)
    try:
        return decode_commit(store.get(key), key).data_key
    except (ObjectNotFound, ManifestError):  # withdrawn while we looked, or unreadable (`_tallies` says it)
        return None


def _skip_reasons(store: ObjectStore, tallies: dict[int, dict[str, int]]) -> dict[str, Any]:
    """Why samples were skipped, counted by reason from the commit records of the shards whose
    tally says they skipped some (the first `SKIP_REASON_SHARDS` of them: a reason usually
    repeats, and a 25,000-shard run's status must not GET every commit)."""
    with_skips = sorted(s for s, t in tallies.items() if t["skipped"])
    read = with_skips[:SKIP_REASON_SHARDS]

    def reasons(shard: int) -> list[str]:
        key = layout.commit_key(shard)
        try:
            return [s.get("reason") or "unknown" for s in decode_commit(store.get(key), key).skipped]
        except (ObjectNotFound, ManifestError):  # withdrawn meanwhile, or corrupt: `verify` says so
            return []

    with ThreadPoolExecutor(16) as pool:
        counted = Counter(r for found in pool.map(reasons, read) for r in found)
    return {"counts": dict(counted.most_common()), "shards_read": len(read), "shards_with_skips": len(with_skips)}


def recent_commits(commit_times: dict[int, float], tokens: dict[int, int], end: float,
                   window_s: float = RATE_WINDOW_S) -> list[tuple[float, int]]:
    """(time, shard) of the commits with token counts in the `window_s` before `end`, oldest first.
    A commit stamped after `end` is counted as made at `end`: `modified` is rounded up to the
    store's whole second and `now` errs behind, so a run's newest commits can look a second or two
    in the future."""
    return sorted((min(t, end), s) for s, t in commit_times.items() if end - window_s <= t and s in tokens)


def recent_rate(commit_times: dict[int, float], tokens: dict[int, int], end: float,
                window_s: float = RATE_WINDOW_S) -> float | None:
    """Tokens/s over the `recent_commits`: see `_rate`."""
    return _rate(recent_commits(commit_times, tokens, end, window_s), tokens, end)


def _rate(recent: list[tuple[float, int]], tokens: dict[int, int], end: float) -> float | None:
    """The tokens committed after the oldest of `recent`, over the time from it to `end` (the
    oldest one's tokens were made before it, so they are left out). None below two commits."""
    if len(recent) < 2:
        return None
    return sum(tokens[s] for _, s in recent[1:]) / max(end - recent[0][0], 1.0)


def _average_rate(created_at: str, last_commit: float | None, tokens: int) -> float | None:
    """Tokens/s from the run's planning to its last commit (pauses included): the rate to quote
    when no recent one exists."""
    try:
        start = datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    if last_commit is None or last_commit <= start or not tokens:
        return None
    return round(tokens / max(last_commit - start, 1.0), 1)


def _tallies(store: ObjectStore, st: RunState) -> tuple[dict[int, dict[str, int]], list[str]]:
    """Numbers of each committed shard, from the tally markers' names, and why the commit records
    that could not be read were not counted. A commit whose marker is missing (its writer died
    between the two writes) is read directly, in memory only: `status` writes nothing (`layertap
    verify` is the command that repairs, and withdraws a corrupt one: one such record ended the
    whole report with exit 2)."""
    tallies = {s: t for s, t in st.tallies.items() if s in st.committed}
    missing = sorted(st.committed - set(tallies))
    unreadable: list[str] = []

    def read(shard: int) -> tuple[int, dict[str, int] | None]:
        key = layout.commit_key(shard)
        try:
            c = decode_commit(store.get(key), f"{store.uri.rstrip('/')}/{key}")
        except ObjectNotFound:  # withdrawn while we looked
            return shard, None
        except ManifestError as e:
            unreadable.append(str(e))
            return shard, None
        return shard, {"records": c.num_records, "tokens": c.num_tokens, "bytes": c.bytes,
                       "raw_bytes": c.raw_bytes, "skipped": len(c.skipped), "truncated": c.truncated}

    if missing:
        with ThreadPoolExecutor(min(16, len(missing))) as pool:
            tallies.update({s: t for s, t in pool.map(read, missing) if t is not None})
    return tallies, sorted(unreadable)


def _failures(store: ObjectStore, st: RunState, shards: list[int],
              read_all: bool) -> tuple[list[int], list[int], dict[int, dict[str, Any]]]:
    """The failed and the interrupted of `shards` (each with failure records and no commit), and
    the failure records read, by shard. The last record's key says which (`.stop.json`), so both
    counts are exact without a GET; only the `FAILURE_DETAILS` newest records of each kind are read
    (every one with `read_all`), 8 at a time. A record of a layertap before stop keys (e1fae43)
    says it was preempted only inside: such a shard counts interrupted where its record is read."""
    stopped = [s for s in shards if st.failures[s][-1].endswith(layout.STOPPED)]
    failed = [s for s in shards if not st.failures[s][-1].endswith(layout.STOPPED)]
    read = shards if read_all else _newest(st, failed) + _newest(st, stopped)
    summaries: dict[int, dict[str, Any]] = {}
    if read:
        with ThreadPoolExecutor(min(8, len(read))) as pool:  # within an S3 store's connection pool (20)
            summaries = {f["shard"]: f for f in pool.map(lambda s: _failure_summary(store, st, s), read)}
    preempted = {s for s in failed if s in summaries and summaries[s]["stopped"]}
    return [s for s in failed if s not in preempted], sorted([*stopped, *preempted]), summaries


def _newest(st: RunState, shards: list[int], n: int = FAILURE_DETAILS) -> list[int]:
    """The `n` of `shards` whose last failure record is newest (its key starts with its time)."""
    return sorted(shards, key=lambda s: (layout.record_millis(st.failures[s][-1]), s), reverse=True)[:n]


def _newest_details(st: RunState, shards: list[int], summaries: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The records read of the `FAILURE_DETAILS` newest of `shards`, in shard order."""
    chosen = set(_newest(st, [s for s in shards if s in summaries]))
    return [summaries[s] for s in shards if s in chosen]


def _tries(st: RunState, shard: int) -> int:
    """The shard's attempts that failed or were stopped: its failure records but `verify`'s withdrawals."""
    return sum(not k.endswith(layout.WITHDRAWN) for k in st.failures.get(shard, []))


def _failure_summary(store: ObjectStore, st: RunState, shard: int) -> dict[str, Any]:
    key = st.failures[shard][-1]
    # stopped from outside (a signal, a takeover, a store outage; a record saying preempted): not the
    # shard's fault, as `submit` counts it
    out: dict[str, Any] = {"shard": shard, "attempts": _tries(st, shard), "stopped": key.endswith(layout.STOPPED),
                           "withdrawn": key.endswith(layout.WITHDRAWN)}
    try:
        f = decode_failure(store.get(key), key)
        said = f"withdrawn by `layertap verify`: {f.error}" if out["withdrawn"] else f.error
        out.update(error=f"{f.error_type}: {said}", preempted=f.preempted, stopped=out["stopped"] or f.preempted,
                   host=f.producer.get("host"), rank=f.producer.get("rank"), job_id=f.producer.get("job_id"),
                   time=f.time)
    except Exception as e:  # a status report must not die on one bad record
        out.update(error=f"unreadable failure record {key}: {e}")
    return out


@dataclass
class VerifyResult:
    checked: int = 0
    ok: int = 0
    bad: list[dict[str, Any]] = field(default_factory=list)  # {"shard", "error"}
    orphans_deleted: int = 0
    consumed: int = 0  # committed shards whose data training consumed and deleted: not read, not missing
    gone: list[int] = field(default_factory=list)  # shards whose commit went or changed while verify looked
    unchecked: list[int] = field(default_factory=list)  # not read: the store failed past its retries (`failure`)
    not_withdrawn: list[int] = field(default_factory=list)  # bad, left: --dry-run, or its withdrawal failed
    failure: StoreError | None = None  # what stopped the reads (`unchecked`) or the withdrawals
    withdraw_failed: bool = False
    imported_from: dict[str, Any] | None = None  # a run `layertap import` made: its import redoes a withdrawn shard

    def to_json(self) -> dict[str, Any]:
        return {"checked": self.checked, "ok": self.ok, "bad": self.bad,
                "withdrawn": len(self.bad) - len(self.not_withdrawn), "orphans_deleted": self.orphans_deleted,
                "consumed": self.consumed,
                # only when there are some: the usual report is unchanged
                **({"gone": self.gone} if self.gone else {}),
                **({"unchecked": self.unchecked} if self.unchecked else {}),
                **({"not_withdrawn": self.not_withdrawn} if self.not_withdrawn else {}),
                **({"failure": str(self.failure)} if self.failure is not None else {})}


def verify_run(store: ObjectStore, threads: int = 4, progress=None, dry_run: bool = False) -> VerifyResult:
    """Re-read every committed shard and check every hash. A bad shard's commit is withdrawn
    (`_withdraw`) so the next extraction redoes it; a good one is left exactly its commit's tally
    marker (`_settle_tally`). Data objects that no commit names, left by crashed attempts of
    committed shards, are deleted. A commit that went or changed since it was read (another
    verify withdrew it; an extraction may have redone it since) is skipped, never withdrawn.
    A shard or record of a newer layertap (`UnsupportedShard`, `UnsupportedVersion`) stops the
    verification instead: it is intact, and withdrawing it would delete good data. A consumed
    shard (`consumption.py`: marker written, then data deleted) is counted as such, not read. A
    withdrawn shard still awaiting its redo gets back its redo marker if it lacks one.
    A store failing past its retries stops the reads (the shards not yet read: `unchecked`), and
    a withdrawal that fails (read-only credentials, an outage) the withdrawals, as `failure`: the
    shards checked before are reported all the same. `dry_run` writes and deletes nothing."""
    from layertap.storage.reader import verify_shard  # it imports the codecs, and they torch: not for status

    manifest = load_manifest(store)
    st = scan(store, manifest, with_data=True)
    st.raise_if_replaced(store.uri)  # commits of another plan: nothing here is to be withdrawn
    result = VerifyResult(imported_from=_imported_from(manifest))
    consumed = consumed_shards(store)
    feed = _FeedKeys(store)

    lock = threading.Lock()

    def check(shard: int) -> tuple[int, str | None, str | None]:
        if result.failure is not None:  # the store failed past its retries: the shards not yet read are unchecked
            return shard, UNCHECKED, None
        try:
            return checked_one(shard)
        except TransientStoreError as e:  # each shard after it would wait out the same retries
            fail(e)
            return shard, UNCHECKED, None

    def fail(e: StoreError) -> None:
        with lock:
            result.failure = result.failure or e

    def checked_one(shard: int) -> tuple[int, str | None, str | None]:
        ckey = layout.commit_key(shard)
        try:
            commit = decode_commit(store.get(ckey), ckey)
        except UnsupportedVersion:
            raise  # a newer layertap's record: intact, not to be withdrawn
        except ObjectNotFound:  # withdrawn since the scan, by another verify
            return shard, GONE, None
        except ManifestError as e:  # malformed; a failing store or memory is raised
            return shard, f"unreadable commit record: {str(e).removesuffix(TO_WITHDRAW)}", None  # verify withdraws it

        def its_run(head: ShardMeta) -> None:  # before its records are decoded: they take the HEAD's shapes
            if (head.run_id, head.shard_id) != (manifest.run_id, shard):
                raise ManifestError(
                    f"committed shard {shard} at {store.uri}/{commit.data_key} was written by run "
                    f"{head.run_id!r} as its shard {head.shard_id}, but the manifest is run "
                    f"{manifest.run_id!r}: the manifest was replaced, or two runs share this prefix. Nothing was "
                    "withdrawn; restore the run's own manifest.json, or write each run to a prefix of its own")
            if refused := header_mismatch(store.uri, shard, commit.data_key, head, manifest.config):
                raise refused

        try:
            report = verify_shard(store, commit.data_key, expected_xxh3_128=commit.xxh3_128, decode=True,
                                  check_head=its_run)
            if not report.ok:  # read again before the data is deleted for it: a read damaged on its way is not
                first, report = report.error, verify_shard(store, commit.data_key, expected_xxh3_128=commit.xxh3_128,
                                                           decode=True, check_head=its_run)
                if report.ok:
                    log.warning("shard %d: a first read did not verify (%s), a second one did: that read was damaged "
                                "on its way (network, proxy), not the object; kept", shard, first)
        except ObjectNotFound:  # absent, or deleted while we read it
            report = None
        if report is None:
            if store.exists(layout.consumed_marker_key(shard)):  # consumed while we looked
                return shard, CONSUMED, commit.data_key
            return shard, f"data object {commit.data_key} is missing", commit.data_key
        if report.ok and (disagree := _disagreement(report, commit)):  # what the loader checks, it refuses
            return shard, disagree, commit.data_key
        if report.ok and not dry_run:
            try:
                _settle_tally(store, st.tally_keys.get(shard, []), commit)
            except TransientStoreError as e:  # the shard is sound: checked, the store's failure said at the end
                fail(e)
        return shard, report.error, commit.data_key

    def counted(shard: int) -> tuple[int, str | None, str | None]:
        done = check(shard)
        if progress:
            progress(1)
        return done

    result.consumed = len(st.committed & consumed)
    with ThreadPoolExecutor(threads) as pool:  # every shard checked before any is withdrawn: a shard of another
        checked = list(pool.map(counted, sorted(st.committed - consumed)))  # run raises while nothing was
    stopped: list[StoreError] = []  # a write-phase call failed past its retries: nothing more is asked of the store

    def stop(e: StoreError) -> None:
        fail(e)
        stopped.append(e)

    for shard, error, data_key in checked:
        writes = not dry_run and not stopped  # a look or write each: the report stays whole if the store is down
        if error == UNCHECKED:
            result.unchecked.append(shard)
        elif error == CONSUMED:
            result.consumed += 1
        elif error == GONE or (error is not None and writes and not _still_committed_or_fail(store, shard, data_key,
                                                                                           stop)):
            if not stopped or error == GONE:
                log.warning("shard %d: its commit went or changed while verify looked (another `layertap verify` "
                            "withdrew it?): skipped, not withdrawn", shard)
                result.gone.append(shard)
            else:  # the store failed in the look: bad, not withdrawn
                result.checked += 1
                result.bad.append({"shard": shard, "error": error})
                result.not_withdrawn.append(shard)
        elif error is None:
            result.checked += 1
            result.ok += 1
            for key in st.data_objects.get(shard, []) if writes else []:
                if key != data_key:
                    try:
                        store.delete(key)
                    except TransientStoreError as e:
                        stop(e)
                        break
                    result.orphans_deleted += 1
        else:
            result.checked += 1
            result.bad.append({"shard": shard, "error": error})
            if not writes:
                log.error("shard %d is bad: %s", shard, error)
                result.not_withdrawn.append(shard)
                continue
            log.error("shard %d is bad: %s; withdrawing its commit", shard, error)
            try:
                _withdraw(store, shard, error, data_key, feed.of(shard))
            except StoreError as e:  # a run this user may read but not write, or a store failing: the rest are said
                if not isinstance(e, TransientStoreError):  # refused, not an outage: said as such
                    result.withdraw_failed, result.failure = True, e
                stop(e)
                result.not_withdrawn.append(shard)
    # A verify killed inside `_withdraw` (the commit gone, the marker not yet written) left a redo
    # that workers waiting behind a full --window never see: they list only the markers.
    for shard in sorted(s for s in range(len(manifest.shards)) if st.withdrawn(s) and s not in st.redo_marked):
        if dry_run or stopped:
            break
        log.info("shard %d: withdrawn, awaiting its redo, without a redo marker: writing it", shard)
        try:
            store.put(layout.redo_key(shard), b"")
        except TransientStoreError as e:
            stop(e)
    return result


def _still_committed_or_fail(store: ObjectStore, shard: int, data_key: str | None,
                             fail: Callable[[StoreError], None]) -> bool:
    """`still_committed`, with a store failing past its retries said (`fail`) and answered False."""
    try:
        return still_committed(store, shard, data_key)
    except TransientStoreError as e:
        fail(e)
        return False


def _commit_tally(commit: CommitRecord) -> str:
    return layout.tally_key(commit.shard, commit.num_records, commit.num_tokens, commit.bytes, commit.raw_bytes,
                            len(commit.skipped), commit.truncated)


def _disagreement(report: VerifyReport, commit: CommitRecord) -> str | None:
    """How a sound object differs from its commit record, in what the loader compares (its size,
    its samples in order, its counts); None where they agree. A commit that differs passed
    verify, and the loader refused the shard and said to run verify, for good."""
    if report.num_records != commit.num_records:
        return f"{report.num_records} records, commit says {commit.num_records}"
    if report.bytes != commit.bytes:
        return f"the object is {report.bytes} bytes, commit says {commit.bytes}"
    if report.num_tokens != commit.num_tokens:
        return f"the object holds {report.num_tokens} tokens, commit says {commit.num_tokens}"
    if list(report.sample_ids) != commit.sample_ids:
        if len(report.sample_ids) != len(commit.sample_ids):
            return f"the object lists {len(report.sample_ids)} sample ids, commit {len(commit.sample_ids)}"
        first = next(i for i, (a, b) in enumerate(zip(report.sample_ids, commit.sample_ids)) if a != b)
        return (f"the object's sample {first} is {report.sample_ids[first]!r}, commit says "
                f"{commit.sample_ids[first]!r}")
    return None


def _settle_tally(store: ObjectStore, keys: list[str], commit: CommitRecord) -> None:
    """Leave a good shard one tally marker, its commit's: restored if missing (its writer died
    between commit and tally), others deleted (a verify killed while it withdrew an earlier
    commit left that one's marker; `status` would count whichever sorts last)."""
    want = _commit_tally(commit)
    numbers = layout.parse_tally(want)
    kept = [k for k in keys if layout.parse_tally(k) == numbers][:1]  # an older marker without `.c` may match
    if not kept and still_committed(store, commit.shard, commit.data_key):  # not withdrawn and redone meanwhile
        store.put(want, b"")
    store.delete_many([k for k in keys if k not in kept])


def still_committed(store: ObjectStore, shard: int, data_key: str | None) -> bool:
    """Whether the shard's commit is still the one read before (`data_key`; None: unreadable). Another
    verify may have withdrawn it meanwhile, and an extraction committed the shard anew: that
    commit, its tally and its data must not be withdrawn in its place (nor, by `export`, its
    missing object taken for lost)."""
    key = layout.commit_key(shard)
    try:
        return decode_commit(store.get(key), key).data_key == data_key
    except ObjectNotFound:
        return False
    except ManifestError:
        return data_key is None


class _FeedKeys:
    """The feed keys of each shard, listed once, at the first withdrawal. That listing precedes the
    deletion of every commit this verify withdraws, so it holds no key of a redo (an extraction
    redoes a shard only once its commit is gone): deleting a withdrawn shard's listed keys cannot
    hide a redo from follow consumers until their next full listing."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self._keys: dict[int, list[str]] | None = None

    def of(self, shard: int) -> list[str]:
        if self._keys is None:
            self._keys = defaultdict(list)
            for o in self.store.list(layout.FEED):
                if (parsed := layout.parse_feed(o.key)) is not None:
                    self._keys[parsed[1]].append(o.key)
        return self._keys.pop(shard, [])


def _withdraw(store: ObjectStore, shard: int, error: str, data_key: str | None, feed_keys: list[str]) -> None:
    """Withdraw the shard's commit, so that the next extraction redoes it. First the withdrawal's
    record (what `status` shows; no attempt of a live extraction's), then what the commit made
    known: its tally marker and feed keys (a follow consumer with no share of a shard trusts its
    key's counts), then the commit itself, its data last. Markers before the commit: a verify
    killed in between leaves none for a redo to find beside its own, and no redo can have
    written any yet (a shard is redone only once its commit is gone). Last, the redo marker
    (`layout.redo_key`): once the commit is gone, so a marker found beside a commit is stale."""
    me, now = Producer.current(), store.now()
    record = FailureRecord(shard=shard, error_type="VerifyFailed", error=error, producer=asdict(me),
                           attempt=0, time=now)
    store.put(layout.withdrawal_key(shard, int(now * 1000), me.token), encode(record))
    store.delete_many([o.key for o in store.list(f"{layout.TALLY}{shard:06d}.")] + feed_keys)
    store.delete(layout.commit_key(shard))
    if data_key:
        store.delete(data_key)
    store.put(layout.redo_key(shard), b"")  # wakes workers waiting behind a full --window: they redo it
