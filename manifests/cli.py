"""`layertap status PREFIX` and `layertap verify PREFIX`."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import sys

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from layertap.storage.errors import ConfigError
from layertap.storage.units import counted, duration, listing, size

if TYPE_CHECKING:
    from layertap.manifests.manifest import NoRun

log = logging.getLogger(__name__)

# `layertap status` exit codes, for scripts (documented in its help and in README.md).
EXIT_COMPLETE, EXIT_PROBLEM, EXIT_INCOMPLETE, EXIT_FAILED = 0, 1, 3, 4  # 2 a user error, 5 no answer: layertap/cli.py
LOOK_UNDER, LIST_UNDER = 50, 20  # folders looked into, and runs named, under a prefix that holds no run
STATUS_EXIT_CODES = (
    "exit codes: 0 complete (a training output: its drafter is exported; a regeneration: every part written); 3 "
    "not complete, no failed shard (pending or running; a training output still training or stopped; a "
    "regeneration with parts left); 4 failed shards; 1 the run is inconsistent (a replaced manifest); 2 no run, "
    "training or regeneration output there, or a bad prefix; 5 the store did not answer (unreachable, or failing "
    "after retries: an outage to wait out, or a wrong endpoint, which the message names)")


def add_status(p: argparse.ArgumentParser) -> None:
    p.description = (p.description or "") + (". Also a `layertap train` output (steps, last loss, latest "
                                               "checkpoint) or a `layertap regenerate` output (parts and rows done, "
                                               "refused rows). Reads only: it writes nothing to the store.")
    p.epilog = STATUS_EXIT_CODES
    p.add_argument("prefix", help="the run prefix (or a training output): s3://bucket/prefix or a local folder")
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    p.add_argument("--shards", action="store_true",
                   help="also list every shard: its state and, once committed, its object (the name "
                        "`layertap inspect` takes), records, tokens and bytes")


def add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("prefix", help="the run prefix: s3://bucket/prefix or a local folder")
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    p.add_argument("--threads", type=int, default=4, help="shards verified in parallel (default 4)")
    p.add_argument("--dry-run", action="store_true",
                   help="report the bad shards and withdraw nothing (read access to the run is enough)")
    p.epilog = ("exit codes: 0 every committed shard read back whole; 1 bad shards found (withdrawn: the next "
                "extraction redoes them; with --dry-run, left); 3 some shards not checked, their commit went or "
                "changed while verify looked (run it again); 2 no run there, a bad prefix, or a withdrawal refused "
                "(read-only credentials); 5 the store did not answer (unreachable, or failing after retries): the "
                "shards checked before are reported, the rest are not checked")


def run_status(args: argparse.Namespace) -> int:
    """`layertap status`; a store that does not answer exits 5 (`layertap.cli.EXIT_NO_ANSWER`)."""
    from layertap.manifests.manifest import NoRun
    from layertap.manifests.status import run_status as status
    from layertap.storage.store import open_store

    store = open_store(args.prefix)
    try:
        s = status(store, shards=args.shards)
    except NoRun as e:
        from layertap.manifests.regeneration import regeneration_status
        from layertap.manifests.train_output import training_status

        t = training_status(store)
        r = regeneration_status(store) if t is None else None
        if t is None and r is None:
            from layertap.manifests.manifest import refuse_leftovers

            refuse_leftovers(store)  # a run's records without its manifest: a delete while a worker still wrote
            if jobs := _slurm_jobs(store.uri):  # submitted, its first task not yet at work: work to come, not an error
                coming = {"prefix": store.uri, "complete": False, "slurm_jobs": [t.job for t in jobs]}
                print(json.dumps(coming, indent=2) if args.json else _coming(store.uri, jobs))
                return EXIT_INCOMPLETE
            raise NoRun(f"{e}; nor is it a `layertap train` output (no metrics.jsonl or "
                        "checkpoints/latest.json) or a `layertap regenerate` output (no regenerate.json)"
                        + (_what_it_is(store) or _what_is_under(store))) from None
        if args.shards:  # not in silence: the shards are a run's
            data = t.get("data") if t is not None else None
            print(f"note: --shards lists a run's shard objects, and {store.uri} is a "
                  + ("regeneration's output" if t is None else "training output")
                  + (f" (`layertap status {data} --shards`: the run it trained on)" if data else ""), file=sys.stderr)
        if r is not None:
            if not r["complete"] and not r["tasks_running"]:
                r["slurm_jobs"] = [t.job for t in _slurm_jobs(store.uri) if t.kind == "regenerate"]
            print(json.dumps(r, indent=2) if args.json else format_regeneration(r))
            return EXIT_COMPLETE if r["complete"] else EXIT_INCOMPLETE
        if not t["complete"] and t["trainer"] is None:  # stopped: a Slurm job of it queued again resumes it
            t["slurm_jobs"] = [j.job for j in _slurm_jobs(store.uri) if j.kind == "train"]
        print(json.dumps(t, indent=2) if args.json else format_training(t))
        return EXIT_COMPLETE if t["complete"] else EXIT_INCOMPLETE
    queue = functools.cache(_squeue)  # asked once, where one of the looks below needs it
    if s.get("waiting_tasks"):
        _without_dead_tasks(s, queue())
    if not s["complete"] and s["shards_running"] == s.get("shards_running_exited_here", 0):  # none at work
        s["slurm_jobs"] = [t.job for t in _slurm_jobs(store.uri, queue()) if t.kind == "extract"]
    # the --window run's --delete-consumed trainer: "running", "stopped", "finished" or "none" (null: no window)
    s["deleting_trainer"] = _deleting(store, s)
    if s["deleting_trainer"] in ("none", "stopped") and not s["complete"]:  # queued, or requeued or resubmitted
        s["trainer_jobs"] = _trainer_jobs(store, queue())
    if s["deleting_trainer"] == "stopped" and s.get("stalled") is None and not s["complete"]:
        # its STALLED report however old: a trainer that gave up on a stall renews it no more, and the advice
        # to start the same commands again stalls them again
        from layertap.manifests.consumption import recent_stall

        s["stalled"] = recent_stall(store, max_age_s=math.inf)
    print(json.dumps(s, indent=2) if args.json else format_status(s, deleting=s["deleting_trainer"]))
    if s["problem"]:
        print(f"error: {s['problem']}", file=sys.stderr)
        return EXIT_PROBLEM
    # failed shards say 4 once nothing runs: a running worker, or one waiting behind the window, may
    # retry them (a script waits on 3)
    return EXIT_COMPLETE if s["complete"] else EXIT_FAILED if s["shards_failed"] and not s["shards_running"] \
        and not s.get("workers_waiting") and not s.get("slurm_jobs") else EXIT_INCOMPLETE


def _trainer_jobs(store, listing: str | None) -> list[str]:
    """The Slurm training jobs queued or running (squeue's `listing`) that will consume the run: those
    for the output of the --delete-consumed trainer that claimed it (one queued again resumes it), or,
    before any claim, those whose tag names the run (`consuming_trainers`). The advice to start one by
    hand started a second."""
    from layertap.manifests.consumption import consumer_of
    from layertap.manifests.manifest import ManifestError
    from layertap.slurm.queued import consuming_trainers, store_location

    if listing is None:
        return []
    try:
        output = consumer_of(store)
    except ManifestError:
        output = None
    if output is not None:  # the trainer that claimed it resumes; another --delete-consumed one is refused the run
        return [j.job for j in _slurm_jobs(output, listing) if j.kind == "train"]
    return consuming_trainers(store_location(store.uri), listing)


def _without_dead_tasks(s: dict, listing: str | None) -> None:
    """Leave out of `workers_waiting` the Slurm tasks squeue's `listing` no longer shows (killed while
    they waited: their records outlive them by minutes), where squeue is here (`listing` not None);
    as `submit extract` counts them."""
    from layertap.slurm.queued import listed_jobs

    if listing is not None:
        alive = listed_jobs(listing)
        gone = [t for t in s["waiting_tasks"] if t not in alive]
        s["workers_waiting"] -= len(gone)
        s["waiting_tasks"] = [t for t in s["waiting_tasks"] if t in alive]


def _squeue() -> str | None:
    """squeue's listing for `status` (None where squeue is not here, or fails: said at debug level)."""
    from layertap.slurm.queued import squeue_listing

    return squeue_listing("Slurm jobs queued for it are not looked for", logging.DEBUG)


def _slurm_jobs(uri: str, listing: str | None = None) -> list:
    """The Slurm jobs of `layertap submit` queued or running for the prefix at `uri` that will start
    (of squeue's `listing`, asked now where not given; `slurm.queued.jobs_naming`, the one place that
    reads their comments): a run with none of its shards running may still have tasks coming, and a
    rerun by hand beside them started a second extractor."""
    from layertap.slurm.queued import jobs_naming

    listing = (_squeue() or "") if listing is None else listing
    return [t for t in jobs_naming(uri, listing) if t.starts]


def _coming(uri: str, jobs: list) -> str:
    """Why a prefix holds nothing yet while Slurm jobs of `layertap submit` for it are queued or running."""
    kinds = sorted({t.kind for t in jobs})
    what = "the first extraction task to start plans the run" if "extract" in kinds else \
        "a regeneration task writes regenerate.json once its server has answered" if "regenerate" in kinds else \
        "the trainer writes it as it starts"
    return (f"nothing at {uri} yet: Slurm job(s) {listing([t.job for t in jobs], 10)} of `layertap submit "
            f"{'|'.join(kinds)}` are queued or running for it (squeue); {what}")


def outputs_under(store, others: list[str] | None = None) -> list[tuple[str, str]]:
    """(folder, kind) of the runs and outputs one level under `store`, each named by what its
    marker object says it is: for a prefix that holds none itself (`status` of the parent of
    runs, a follow trainer waiting where no run is coming). The folders looked into that are
    none are added to `others`, if given: runs may lie deeper, where no one looked."""
    from layertap.manifests.layout import MANIFEST
    from layertap.manifests.regeneration import RECIPE
    from layertap.manifests.train_output import LATEST, METRICS

    kinds = ((MANIFEST, "run"), (LATEST, "training output"), (METRICS, "training output"),
             (RECIPE, "regeneration"))
    found = []
    for name in store.folders(limit=LOOK_UNDER):  # a few HEADs each: the first ones only
        kind = next((k for key, k in kinds if store.exists(f"{name}/{key}")), None)
        if kind is not None:
            found.append((name, kind))
        elif others is not None:
            others.append(name)
    return found


def deeper_text(others: list[str]) -> str:
    """'; and 2 other folders (qwen27b/, tmp/), not looked into': what `outputs_under` left unread."""
    if not others:
        return ""
    return f"; and {len(others)} other folder(s) ({listing([f'{o}/' for o in others], 5)}), not looked into"


def not_a_run(store, e: NoRun, needs: str, instead: Callable[[str], str]) -> NoRun:
    """`e` (no manifest.json at `store`), said as what the prefix is instead, as `status` tells:
    a training output (then `instead(the run it trained on)`), or a folder of runs (which). `needs`:
    what the command does with a run ("verify re-reads the shards of")."""
    from layertap.manifests.manifest import NoRun, refuse_leftovers
    from layertap.manifests.train_output import training_status

    t = training_status(store)
    if t is None:
        try:
            refuse_leftovers(store)  # a run's records without its manifest: not a prefix to extract into anew
        except ConfigError as left:
            return NoRun(str(left))
        return NoRun(f"{e}{_what_it_is(store) or _what_is_under(store)}")
    data = f": {instead(t['data'])}" if t.get("data") else ""
    return NoRun(f"{store.uri} is a `layertap train` output (checkpoints, metrics.jsonl), not a run: {needs} an "
                 "extraction run (`layertap extract` or `layertap import`; its prefix holds manifest.json)"
                 f"{data}; `layertap status {store.uri}` reports on the training")


def _what_it_is(store) -> str:
    """What a prefix without a run holds, where it is another of layertap's outputs: a `layertap
    export` of a run (import it to train on it), or an exported drafter. A few HEADs, on the error's path."""
    from layertap.manifests.layout import EXPORT_NOTE
    from layertap.manifests.train_output import EXPORT_CONFIG

    if store.exists(EXPORT_NOTE):
        try:
            fmt = json.loads(store.get(EXPORT_NOTE)).get("format") or "FORMAT"
        except (ValueError, AttributeError, RecursionError):
            fmt = "FORMAT"
        return (f". It holds a `layertap export` of a run ({EXPORT_NOTE}, format {fmt}): give the run itself, or "
                f"import the files into a run first (`layertap import {store.uri} --from {fmt} --out PREFIX`)")
    if store.exists(EXPORT_CONFIG) or (store.exists("config.json") and store.exists("model.safetensors")):
        return ". It holds an exported drafter (config.json, model.safetensors), not an extraction's run"
    return ""


def _what_is_under(store) -> str:
    """`outputs_under` as the end of `status`'s "no run" error."""
    others: list[str] = []
    found = [f"{name}/ ({kind})" for name, kind in outputs_under(store, others)]
    if not found:  # runs may lie deeper (a bucket's root): say where it did not look
        return (f". Its folders {listing([f'{o}/' for o in others], 5)} are no run nor output; runs may lie deeper "
                f"in them: `layertap status {store.uri.rstrip('/')}/FOLDER`") if others else ""
    return (f". Under it: {listing(found, LIST_UNDER)}{deeper_text(others)}: `layertap status "
            f"{store.uri.rstrip('/')}/{found[0].split('/')[0]}`")


def format_regeneration(r: dict) -> str:
    refused = sum(r["rows_refused"].values())
    lines = [
        f"regeneration at {r['prefix']}  (model {r['model']}, temperature {r['sampling'].get('temperature')}, "
        f"max tokens {r['sampling'].get('max_tokens')})",
        f"  parts    {r['parts_done']:,}/{r['parts_total']:,} done",
        f"  rows     {r['rows_done']:,}/{r['rows_total']:,} done: {r['rows_regenerated']:,} regenerated, {refused:,} "
        "refused" + (f" ({', '.join(f'{k}: {v:,}' for k, v in sorted(r['rows_refused'].items()))}; reasons in "
                     "stats/)" if refused else ""),
        f"  tokens   {r['completion_tokens']:,} generated, {r['truncated_turns']:,} answers cut at max tokens",
    ]
    if r["complete"]:
        lines += ["  COMPLETE", "", "extract over it:", f"  layertap extract --dataset {r['prefix']} --model ... --out ..."]
    elif running := r.get("tasks_running"):  # a rerun beside them is refused
        lines.append("  RUNNING  " + "; ".join(f"task {t['task']} ({t['holder']})" for t in running[:10])
                     + (f"; and {len(running) - 10} more" if len(running) > 10 else "")
                     + ": they finish their parts; `layertap submit regenerate` again submits only the tasks "
                       "not at work")
    elif jobs := r.get("slurm_jobs"):
        lines.append(f"  no task is at work, but Slurm job(s) {listing(jobs, 10)} of `layertap submit regenerate` "
                     "are queued or starting for it (squeue): they finish the rest as they start")
    else:
        # a `--task I/N` process does only its own parts: its command again finishes nothing of the others'
        lines.append("  `layertap regenerate` with the same settings finishes the rest (without --task, or each "
                     "--task I/N of the split), as does `layertap submit regenerate` again")
    return "\n".join(lines)


def _skipped_text(s: dict) -> str:
    """', 10 skipped: no_supervised_pair 7, too_long 3': the reasons the commit records give."""
    if not s["samples_skipped"]:
        return ""
    by = s.get("skipped_by_reason") or {}
    counts = ", ".join(f"{reason} {n:,}" for reason, n in (by.get("counts") or {}).items())
    sampled = (f" (reasons from {by['shards_read']:,} of the {by['shards_with_skips']:,} shards with skips)"
               if by and by["shards_read"] < by["shards_with_skips"] else "")
    return f", {s['samples_skipped']:,} skipped" + (f": {counts}{sampled}" if counts else "")


def _planned_text(s: dict) -> str:
    """' (of 300 rows: the plan found 41 yield no sample)': the rows the planner found yield no sample (no
    answer, nothing left once templated) are not counted as samples to store, so a finished run does not
    read as short of its total."""
    planned, rows = s["samples_planned"], s["samples_total"]
    return "" if planned == rows else f" (of {rows:,} rows: the plan found {rows - planned:,} yield no sample)"


def _truncated_text(s: dict) -> str:
    """', 12 cut at max_length 4,096': samples whose tokens past max_length were not extracted."""
    if not s.get("samples_truncated"):
        return ""
    return f", {s['samples_truncated']:,} cut at max_length" + (f" {s['max_length']:,}" if s.get("max_length") else "")


def _deleting(store, s: dict) -> str | None:
    """Who consumes a --window run (`consumption.trainer_state`); None for a run without a window."""
    from layertap.manifests.consumption import trainer_state
    from layertap.manifests.manifest import ManifestError

    try:
        return None if s.get("window") is None else trainer_state(store)
    except ManifestError as e:  # consumed/trainer.json unreadable: the report all the same, as --json gives it
        log.warning("%s", e)
        return None


def _rerun(s: dict) -> str:
    """The command that finishes the run: an import's names `layertap import` and its source."""
    source = s.get("imported_from")
    if source:
        return (f"the same `layertap import {source.get('path') or 'SRC'} --from {source.get('format') or 'FORMAT'} "
                f"--out {s['prefix']} ...` command")
    return "the same `layertap extract` (or `layertap submit extract`) command"


def format_status(s: dict, deleting: str | None = None, rerun: str | None = None) -> str:
    """`deleting`: whether a --delete-consumed trainer consumes the run (`_deleting`; None: not known).
    `rerun`: the command that finishes the run, where not the one `_rerun` names (an extract of some
    --shards is not)."""
    from layertap.manifests.consumption import WAITING_STALE_S

    again = rerun or _rerun(s)

    lines = [
        f"run {s['run_id']} at {s['prefix']}  (model {s['model']}, codec {s['codec']}, created {s['created_at']})",
        f"  shards   {s['shards_done']}/{s['shards_total']} done, {s['shards_running']} running"
        + (f" ({s['shards_running_exited_here']} of them held by processes on this machine that have exited: the "
           f"next {again} takes them over at once)" if s.get("shards_running_exited_here") else "")
        + f", {s['shards_failed']} failed, {s['shards_pending']} pending"
        + (f", {s['shards_interrupted']} interrupted" if s.get("shards_interrupted") else ""),
        f"  samples  {s['samples_done']:,}/{s['samples_planned']:,} stored" + _planned_text(s)
        + _skipped_text(s) + _truncated_text(s),
        f"  tokens   {s['tokens_done']:,} of ~{s['tokens_total_est']:,}",
        f"  bytes    {size(s['bytes_stored'])} stored, {size(s['bytes_raw'])} raw"
        + (f", ratio {s['compression_ratio']:.3f}x" if s["compression_ratio"] else "")
        + (f"; {size(s['bytes_at_rest'])} at rest now ({size(s['bytes_stored'] - s['bytes_at_rest'])} deleted "
           "with the shards training consumed)"
           if s.get("bytes_at_rest", s["bytes_stored"]) != s["bytes_stored"] else ""),
        "  rate     " + _rate_line(s),
        *_consumption_lines(s.get("consumption")),
    ]
    window, rest = s.get("window"), s.get("window_at_rest")
    rest = s.get("bytes_at_rest", s["bytes_stored"]) if rest is None else rest
    if window is not None:
        lines.append(f"  window   {size(rest)} at rest of a {size(window)} --window"
                     + (": full, extraction waits for training to consume" if rest >= window and not s["complete"]
                        else ""))
        if deleting == "none" and not s["complete"] and s.get("trainer_jobs"):
            lines.append(f"  THE TRAINER IS QUEUED: no --delete-consumed trainer has claimed this run yet, and Slurm "
                         f"job(s) {listing(s['trainer_jobs'], 10)} that consume it are queued or running (squeue): the "
                         "trainer claims the run as it starts, and the window opens as it consumes; start no other")
        elif deleting == "none" and not s["complete"]:
            lines.append("  NO TRAINER DELETES: no `layertap train --delete-consumed` has claimed this run, so nothing "
                         "trained on is deleted and a full window never opens: restart the trainer with "
                         "--delete-consumed (--resume continues it), or extract without --window")
        if deleting == "finished" and not s["complete"]:
            lines.append("  THE TRAINER HAS FINISHED: this run's --delete-consumed trainer exported its drafter, so "
                         "nothing consumes what the extraction adds and a full window does not open: train on the rest "
                         "with another --delete-consumed trainer (another --out), or extract it without --window")
        if deleting == "stopped" and not s["complete"] and s.get("trainer_jobs"):
            lines.append(f"  THE TRAINER IS QUEUED: this run's --delete-consumed trainer is not running now, and Slurm "
                         f"job(s) {listing(s['trainer_jobs'], 10)} for its output are queued or running (squeue): it "
                         "resumes from its checkpoint when it starts, and the window opens then; start no other")
        elif deleting == "stopped" and not s["complete"]:
            # after a stall, the same commands stall again: the window must grow first (the report says by how much)
            how = ("it stalled (its report below): restart the extraction with a larger --window (Slurm: scancel its "
                   "waiting tasks, submit again with it), then start the trainer again with its `layertap train` "
                   "command and --resume" if s.get("stalled") else
                   "start it again with its `layertap train` command and --resume (or the same `layertap submit "
                   "extract ... --train-while-extracting` command, which submits only the trainer)")
            lines.append("  THE TRAINER IS NOT RUNNING: this run's --delete-consumed trainer holds no live lease on its "
                         "output (stopped, queued again, or its lease went stale), so nothing is consumed and a full "
                         f"window does not open: {how}")
    if (stall := s.get("stalled")) is not None and not s["complete"]:
        lines.append(f"  STALLED (the trainer's report, {duration(stall['age_s'])} ago): {stall['message']}")
    live = s["shards_running"] - s.get("shards_running_exited_here", 0)  # held by processes that still run
    if s["complete"]:
        lines.append("  COMPLETE")
    elif not live and not s["problem"] and (waiting := s.get("workers_waiting")):
        # Workers waiting for the window hold no lease: "nothing is running" sent users to start a second extractor.
        lines.append(f"  no shard is running: {waiting} extraction worker(s) wait for the window to open"
                     + (", as training consumes and deletes what it trained on"
                        if deleting == "running" and not s.get("stalled") else ""))
    elif (not live and not s["problem"] and window is not None and rest >= window
          and deleting not in ("none", "stopped", "finished")):
        lines.append("  no shard is running, and no extraction worker waits for the window (none has a record under "
                     f"waiting/ renewed in the last {WAITING_STALE_S / 60:.0f} min: stopped, or killed): {again} goes "
                     "on as training consumes")
    elif not live and not s["problem"] and window is not None and rest >= window:
        # a full window no trainer deletes from (said above): a rerun would wait behind it too
        lines.append(f"  nothing is running, and the window is full: {again} goes on once a --delete-consumed "
                     "trainer consumes" + (" (with a larger --window: the trainer stalled, its report above)"
                                           if s.get("stalled") else ""))
    elif not live and not s["problem"] and (jobs := s.get("slurm_jobs")):
        lines.append(f"  no shard is running, but Slurm job(s) {listing(jobs, 10)} of `layertap submit` are queued or "
                     "running for this run (squeue): their tasks take the unfinished shards as they start (`layertap "
                     "submit extract` again submits only what they leave)")
    elif not live and not s["problem"]:
        kinds = [kind for kind in ("failed", "interrupted", "pending") if s.get(f"shards_{kind}")] or ["left"]
        left = ", ".join(kinds[:-1]) + (" and " if len(kinds) > 1 else "") + kinds[-1]
        lines.append(f"  nothing is running: {again} finishes the {left} shards"
                     + (" (and takes over at once those held by the processes that exited)" if s["shards_running"]
                        else ""))
    if len(s["failed"]) < s["shards_failed"]:
        lines += _failure_groups(f"FAILED {s['shards_failed']:,} shards: {s['failed_ranges']}", s["failed"])
    else:
        for f in s["failed"]:
            tries = f"{counted(f['attempts'], 'attempt')}, last" if f.get("attempts") else "withdrawn"  # verify's
            lines.append(f"  FAILED shard {f['shard']} ({tries} on {_where(f)}): {f['error']}")
    interrupted = s.get("interrupted", [])
    # workers at work take an interrupted shard they may (a dynamic task: any): "a rerun finishes it" beside
    # them started a second extractor
    def rerun(it: str) -> str:
        return (f"a worker at work takes {it} if it may, else " if live else "") + f"a rerun finishes {it}"

    if len(interrupted) < s.get("shards_interrupted", 0):
        lines += _failure_groups(f"INTERRUPTED {s['shards_interrupted']:,} shards: {s['interrupted_ranges']} "
                                 f"({rerun('them')})", interrupted)
    else:
        for f in interrupted:
            tries = f"{f['attempts']:,} attempts, the last " if f.get("attempts", 1) > 1 else ""
            lines.append(f"  INTERRUPTED shard {f['shard']} ({tries}stopped on {_where(f)}): {f['error']}; "
                         + rerun("it"))
    for f in s.get("retrying", []):
        lines.append(f"  RETRYING shard {f['shard']}: running again after {f['attempts']:,} attempts that stopped or "
                     f"failed, the last on {_where(f)}: {f['error']}")
    if "shards" in s:
        lines.append(f"  {'shard':<7} {'state':<8} {'records':>8} {'tokens':>11} {'stored':>10}  "
                     "object (or last error)")
        for e in s["shards"]:
            numbers = (f"{e['records']:>8,} {e['tokens']:>11,} {size(e['bytes']):>10}" if "records" in e
                       else f"{'':>8} {'':>11} {'':>10}")
            shown = e["object"] or e.get("error") or ""  # a shard without an object: its last error
            lines.append(f"  {e['shard']:06d}  {e['state']:<8} {numbers}  {shown}".rstrip())
    return "\n".join(lines)


def _where(f: dict) -> str:
    return f"host {f.get('host')} rank {f.get('rank')}" + (f" job {f['job_id']}" if f.get("job_id") else "")


def _failure_groups(head: str, details: list[dict]) -> list[str]:
    """More shards than `status` read records of (tens of thousands after a store outage): the
    count and ids, then the records read (the newest) grouped by their error's first line, so the
    report stays a screen; `--shards` still lists every shard."""
    from layertap.storage.units import id_ranges

    groups: dict[str, list[dict]] = {}
    for f in sorted(details, key=lambda f: f.get("time") or 0, reverse=True):
        groups.setdefault((f["error"].splitlines() or [""])[0][:200], []).append(f)
    lines = [f"  {head}" + (f"; the newest {len(details)}, by error:" if details else "")]
    for error, fs in sorted(groups.items(), key=lambda g: -len(g[1])):
        lines.append(f"    {len(fs):>4}  {error}  (shards {id_ranges(f['shard'] for f in fs)}; "
                     f"newest on {_where(fs[0])})")
    return lines


def _consumption_lines(c: dict | None) -> list[str]:
    """A run trained while extracted: consumed, backlog at rest, and both rates per hour."""
    if not c:
        return []

    def rate(r: dict, shards: int) -> str:
        if r["samples_per_h"] is None:  # `burst_rate`: markers come in bursts (a checkpoint's), commits one by one
            return "no rate yet" if not shards else f"no rate ({shards} shard(s) in one burst: a rate needs two)"
        return f"{r['samples_per_h']:,} samples/h ({size(r['bytes_per_h'])}/h)"

    return [
        f"  consumed {c['shards']} shards, {c['samples']:,} samples by training ({c['shards_deleted']} shards' "
        "data deleted)",
        f"  backlog  {c['backlog_shards']} shards, {c['backlog_samples']:,} samples, {size(c['backlog_bytes'])} "
        "at rest, not yet consumed",
        f"  flow     extraction {rate(c['extraction'], c['shards'] + c['backlog_shards'])}, training "
        f"{rate(c['training'], c['shards_deleted'])} (over the last hour of each)",
    ]


def _rate_line(s: dict) -> str:
    """The recent rate (and, while shards run, the ETA it gives); else the run's average."""
    if s["last_commit_age_s"] is None:
        return "no shard committed yet"
    from layertap.manifests.status import RATE_WINDOW_S

    ago = f"last commit {duration(s['last_commit_age_s'])} ago"
    over = s.get("rate_over_s")  # under 10 min in a young run: "over the last 10 min" of an 18 s one misled
    span = "10 min" if over is None or over >= RATE_WINDOW_S - 30 else duration(over)
    if s["tokens_per_s"] and s["rate_until"] == "now":
        text = f"{s['tokens_per_s']:,.0f} tokens/s over the last {span}"
        return text + (f", ETA {duration(s['eta_s'])}" if s["eta_s"] else "")
    if s["tokens_per_s"]:
        return f"{s['tokens_per_s']:,.0f} tokens/s over the {span} before the last commit ({ago})"
    text = f"no rate yet (it needs two commits within 10 min; {ago})"
    if s["tokens_per_s_average"]:
        text += f"; {s['tokens_per_s_average']:,.0f} tokens/s on average from the run's start to its last commit"
    return text


def train_hint(data: str, s3: Any = None) -> str:
    """What the end of an extraction or import suggests next: a trainer into DATA-drafter, or, where
    that output holds a training already (a rerun of a finished run), how to look at it. `s3`: the
    command's S3 settings (its --config's), with which DATA was opened."""
    from layertap.manifests.train_output import training_status
    from layertap.storage.store import StoreError, open_configured_store

    out = f"{data.rstrip('/')}-drafter"
    try:
        trained = training_status(open_configured_store(out, s3))
    except (StoreError, ValueError):
        trained = None
    if trained is None:
        return f"train a drafter on it (the target is the one this run's manifest records):\n  layertap train --data " \
               f"{data} --out {out}"
    return (f"{out} holds a training of a drafter already: `layertap status {out}` says how far it got (its "
            f"`layertap train ... --resume` goes on); a second one goes into another --out, e.g.\n  layertap train "
            f"--data {data} --out {out}-2")


SILENT_STEP_S = 600.0  # a trainer whose last step ended longer ago, neither waiting for data nor saving, is named hung


def _last_step_text(h: dict) -> str:
    """The running trainer's last step, from its lease's beat (`train_output._last_step`)."""
    if h.get("last_step") is None:
        return ""
    ago = duration(h["last_step_s_ago"])
    text = f"; step {h['last_step']:,} ended {ago} ago" if h["last_step"] else f"; no step yet ({ago} into the loop)"
    return text + ("; it waits for extraction" if h.get("waiting_for_data") else "") \
        + ("; it writes a checkpoint" if h.get("saving_checkpoint") else "")


def format_training(t: dict) -> str:
    from layertap.manifests.train_output import RESUBMIT

    of = f" of {t['steps_total']:,}" if t["steps_total"] else ""
    lines = [f"training output at {t['prefix']}" + (f"  (data {t['data']})" if t["data"] else "")]
    if t["step"] is not None:
        # counted from 1 here, beside counts of steps and epochs (metrics.jsonl's `epoch` counts from 0)
        epoch = f", in epoch {t['epoch'] + 1}" + (f" of {t['epochs']}" if t["epochs"] else "") \
            if isinstance(t["epoch"], int) else ""
        lines.append(f"  steps       {t['step']:,}{of}{epoch}")
        # the steps with no loss: zero-weighted padding, or a divergence (NaN, inf: no update), never mixed up
        without = t.get("steps_without_loss") or {}
        said = "; ".join(([f"{n} step(s) held only zero-weighted padding (samples the extraction skipped)"]
                          if (n := without.get("padding")) else [])
                         + ([f"{n} step(s) had a NaN or infinite loss and made no update (see the trainer's log)"]
                            if (n := without.get("not_finite")) else []))
        if t["loss"] is None:
            loss = f"none at step {t['step']:,} ({said})"
        elif t["loss_step"] != t["step"]:
            loss = f"{t['loss']:.4f} at step {t['loss_step']:,} (after it, {said})"
        else:
            loss = f"{t['loss']:.4f} at step {t['step']:,}"
        lines.append(f"  last loss   {loss}"
                     + (f", acc@1 {t['acc_first']:.3f}" if t["acc_first"] is not None else "")
                     + (f", {t['tokens_per_s']:,.0f} tokens/s" if t["tokens_per_s"] else "")
                     + " (metrics.jsonl is written with each checkpoint)")
    if t["checkpoint"]:
        age = f", written {duration(t['checkpoint_age_s'])} ago" if t["checkpoint_age_s"] is not None else ""
        lines.append(f"  checkpoint  step {t['checkpoint_step']:,}: {t['checkpoint']}{age}")
        if t.get("checkpoint_incomplete"):
            lines.append("  CHECKPOINT INCOMPLETE: its state.json is gone or unreadable (a `layertap delete` of this "
                         "output cut short leaves this: the same delete finishes it); to train on, remove "
                         "checkpoints/latest.json: `layertap train --resume` then takes the newest complete "
                         "checkpoint, if one is left")
    else:
        lines.append("  checkpoint  none yet")
    if (h := t["trainer"]) is not None:
        from layertap.manifests.output_lease import holder_text

        lines.append(f"  trainer     running: {holder_text(h)} (its lease on the output renewed "
                     f"{duration(h['lease_renewed_s_ago'])} ago)" + _last_step_text(h))
        if h.get("last_step_s_ago", 0) >= SILENT_STEP_S and not h.get("waiting_for_data") \
                and not h.get("saving_checkpoint"):
            signal = f"scancel --signal=USR2 {h['slurm_job']}" if h.get("slurm_job") else f"kill -USR2 {h.get('pid')}"
            lines.append(f"  NO STEP FOR {duration(h['last_step_s_ago'])}: its ranks may hang (in a collective, "
                         "waiting on a rank that stopped or hangs, until the backend's timeout); `" + signal
                         + "` prints each process's stacks to its log (docs/TRAINING.md)")
    if (gone := t["trainer_exited"]) is not None:
        from layertap.manifests.output_lease import holder_text

        lines.append(f"  trainer     exited: {holder_text(gone)} is gone from this machine, killed without releasing "
                     f"the output (its lease was renewed {duration(gone['lease_renewed_s_ago'])} ago)")
    if t["drafter_exported"]:
        lines.append(f"  drafter     exported: {t['prefix'].rstrip('/')}/drafter/ "
                     f"(`layertap eval --drafter {t['prefix']} ...` measures it)")
        lines.append("  COMPLETE")
    elif h is not None:
        lines.append("  drafter     not exported yet: training is running")
    elif t.get("checkpoint_incomplete"):
        lines.append("  drafter     not exported yet: training stopped, and its checkpoint is incomplete (above)")
    elif t.get("slurm_jobs"):
        lines.append("  drafter     not exported yet: training stopped, and Slurm job(s) "
                     f"{listing(t['slurm_jobs'], 10)} for this output are queued or running (squeue): training goes "
                     "on when it starts")
    elif not t["checkpoint"]:
        lines.append("  drafter     not exported yet: training stopped before its first checkpoint (killed, or it "
                     "failed: its log says why); the same `layertap train` command starts it again")
    else:
        lines.append("  drafter     not exported yet: training stopped (the same `layertap train` command with "
                     f"--resume continues from the checkpoint; {RESUBMIT})")
    return "\n".join(lines)


def run_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from layertap.manifests.manifest import NoRun
    from layertap.manifests.status import verify_run
    from layertap.storage.store import open_store

    if args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {args.threads}")
    store = open_store(args.prefix)
    try:
        with tqdm(desc="verify", unit="shard", disable=args.json or None, file=sys.stderr) as bar:
            result = verify_run(store, threads=args.threads, progress=bar.update, dry_run=args.dry_run)
    except NoRun as e:
        raise not_a_run(store, e, "verify re-reads the shards of", lambda run: f"`layertap verify {run}` checks the run "
                        "it trained on") from None
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"verified {counted(result.checked, 'committed shard')}: {result.ok} ok, {len(result.bad)} bad"
              + (f"; {result.consumed} more consumed by training (data deleted, as intended; not read)"
                 if result.consumed else ""))
        redo = "import" if result.imported_from else "extract"  # the command that redoes a withdrawn shard
        for b in result.bad:
            if b["shard"] in result.not_withdrawn:
                print(f"  BAD shard {b['shard']}: {b['error']} (not withdrawn"
                      + (f"; `layertap verify` without --dry-run withdraws it, then `layertap {redo}` redoes it)"
                         if args.dry_run else ")"))
            else:
                print(f"  WITHDRAWN shard {b['shard']}: {b['error']} (the next `layertap {redo}` redoes it)")
        if result.orphans_deleted:
            print(f"  deleted {result.orphans_deleted} data objects of crashed attempts that no commit names")
        if result.gone:
            print(f"  skipped {len(result.gone)} shard(s) whose commit went or changed while this verify looked "
                  f"(another `layertap verify` withdrew it?): {', '.join(map(str, result.gone))}; run verify again "
                  "to check them")
    if result.failure is not None:
        raise _verify_failed(store, result)
    return EXIT_PROBLEM if result.bad else EXIT_INCOMPLETE if result.gone else EXIT_COMPLETE


def _verify_failed(store, result) -> Exception:
    """The error a verify ends with when the store failed it (`VerifyResult.failure`), of the failure's
    own class (an outage exits 5, a refusal 2), saying what was left undone."""
    from layertap.storage.local import CHOOSE_WRITABLE
    from layertap.storage.units import id_ranges

    e = result.failure
    said = str(e).removesuffix(f"; {CHOOSE_WRITABLE}")
    if result.withdraw_failed:
        return type(e)(f"bad shard(s) {id_ranges(result.not_withdrawn)} of {store.uri} could not be withdrawn: {said}. "
                       f"Withdrawing writes to the run: run `layertap verify` where it is writable (`layertap verify "
                       "--dry-run` reports without writing)")
    left = ([f"{len(result.unchecked)} committed shard(s) were not checked ({id_ranges(result.unchecked)})"]
            if result.unchecked else []) + \
        ([f"bad shard(s) {id_ranges(result.not_withdrawn)} were not withdrawn"] if result.not_withdrawn else [])
    return type(e)(f"{said}; " + ", and ".join(left or ["the report above is whole"])
                   + f": run `layertap verify {store.uri}` again once the store answers")
