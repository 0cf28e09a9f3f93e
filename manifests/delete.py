"""`layertap delete PREFIX`: delete a run, a training, regeneration or export output, with every object under
its prefix.

It asks first (or takes `--yes`), refuses a prefix that is none of these unless `--force` (a typo
must not empty a bucket), and refuses a run something still writes to,
or a training output a trainer holds: what a writer puts there after the delete listed the prefix
outlives it, and a new run there would take it for its own. It refuses, too, a prefix that holds
other runs or outputs below its top level (a run made at a bucket's root, another at a folder of
it), or a run's prefix holding objects that are not the run's (files of one's own put there):
they are under the prefix, and deleting it would take them. The manifest goes last,
so an interrupted delete is still a run and the same command finishes it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from layertap.manifests import layout
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.units import id_ranges, listing

log = logging.getLogger(__name__)

class Refused(UserError):
    """The prefix must not be deleted as asked: the message says why and how to proceed."""


TRAINING_KEYS = ("checkpoints/latest.json", "metrics.jsonl")  # what `layertap train` writes (train_output.py)
# the keys that make a prefix a run or an output (as `layertap status` tells them, manifests/cli.py `outputs_under`)
MARKERS = (("manifest.json", "run"), (TRAINING_KEYS[0], "training output"), (TRAINING_KEYS[1], "training output"),
           ("regenerate.json", "regeneration output"))
LIST_NESTED = 10  # nested runs and outputs named in a refusal


def add_delete(p: argparse.ArgumentParser) -> None:
    p.add_argument("prefix", help="the run (or training output) prefix: s3://bucket/prefix or a local folder")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation (for scripts)")
    p.add_argument("--force", action="store_true",
                   help="delete even a prefix that is not a run or a training output, one being written "
                        "(Slurm jobs of `layertap submit` queued or running for it, a run with live leases, "
                        "workers waiting behind --window or a running --delete-consumed trainer; an output a "
                        "trainer holds), or one holding other runs or outputs below it "
                        "(deleted with it)")
    p.add_argument("--threads", type=int, default=16, help="delete requests in flight on S3, 1,000 keys each (default 16)")


def run_delete(args: argparse.Namespace) -> int:
    from layertap.storage.store import is_write_probe, open_store
    from layertap.storage.units import size

    if args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {args.threads}")
    store = open_store(args.prefix)
    objects = list(store.list())
    pending = store.list_pending_uploads()
    if not pending and all(is_write_probe(o.key) for o in objects):  # a probe's leftover is no run to delete
        print(f"nothing to delete: no object under {store.uri}")
        return 0
    # an upload still in progress is judged as the object it will be: aborting it destroys it alike
    keys = [o.key for o in objects] + [u.key for u in pending]
    nested = nested_outputs(keys)
    if nested and not args.force:
        raise Refused(nested_message(store.uri, nested))
    foreign = foreign_objects(keys, nested)
    if foreign and not args.force:
        root = store.uri.rstrip("/")
        raise Refused(f"{store.uri} is a run, and holds {len(foreign):,} object(s) that are not the run's: "
                      + listing((f"{root}/{k}" for k in foreign), LIST_NESTED)
                      + ". Deleting the run would delete them too, so it is not deleted: move them out of its prefix "
                        "and run this again, or pass --force to delete them with it")
    what = describe(store, args.force)
    total = sum(o.size for o in objects)
    print(f"{what}: {len(objects):,} object(s), {size(total)}"
          + (f", and {len(pending)} unfinished upload(s)" if pending else ""))
    if nested:
        print(f"  with the {len(nested)} run(s) or output(s) below it (--force): {_named(store.uri, nested)}")
    if not args.yes:
        if not _confirmed(store.uri):
            print("not deleted", file=sys.stderr)
            return 1
        describe(store, args.force)  # again: a worker or trainer may have started while the question waited
    deleted = delete_all(store, [o.key for o in objects], args.threads)
    aborted = store.abort_pending_uploads() if pending else 0
    store.remove_empty_folders()
    print(f"deleted {deleted:,} object(s)" + (f" and aborted {aborted} upload(s)" if aborted else "")
          + f" under {store.uri}")
    return 0


def nested_outputs(keys: Iterable[str]) -> list[tuple[str, str]]:
    """(folder, kind) of each run or output below the prefix's top level, found by its marker key
    in the prefix's listing (`MARKERS`), deepest first: the order to delete them in one by one."""
    found: dict[str, str] = {}
    for key in keys:
        for marker, kind in MARKERS:
            if key.endswith("/" + marker):
                found.setdefault(key[: -len(marker) - 1], kind)
    return sorted(found.items(), key=lambda f: (-f[0].count("/"), f[0]))


def foreign_objects(keys: list[str], nested: list[tuple[str, str]]) -> list[str]:
    """In a run's prefix (its manifest among `keys`), the keys that are neither the run's objects
    nor under a run or output below it (`nested`): files of one's own put there. [] for a prefix
    that is no run: a training or regeneration output's layout is not checked."""
    from layertap.manifests import layout

    if layout.MANIFEST not in keys:
        return []
    below = tuple(f"{folder}/" for folder, _ in nested)
    return [k for k in keys if not layout.is_run_key(k) and not k.startswith(below)]


def nested_message(uri: str, nested: list[tuple[str, str]]) -> str:
    """Why a prefix holding other runs or outputs is not deleted, and how to delete each."""
    root = uri.rstrip("/")
    how = "; ".join(f"`layertap delete {root}/{name}`" for name, _ in nested[:LIST_NESTED])
    more = " ..." if len(nested) > LIST_NESTED else ""
    return (f"{uri} holds {len(nested)} other run(s) or output(s) below it: {_named(uri, nested)}. Deleting it would "
            f"delete them too, so it is not deleted. Delete first each of them that is to go ({how}{more}) and move "
            "each to keep to a prefix of its own (copy it, then delete it there), then run this again; or pass "
            "--force to delete them all with it")


def _named(uri: str, nested: list[tuple[str, str]]) -> str:
    root = uri.rstrip("/")
    return listing((f"{root}/{name} ({kind})" for name, kind in nested), LIST_NESTED)


def describe(store, force: bool) -> str:
    """What the prefix holds, in words; raises `Refused` for what must not be deleted unforced."""
    from layertap.manifests import layout
    from layertap.manifests.manifest import ManifestError, NoRun, enclosing, load_manifest
    from layertap.manifests.liveness import gone_from_here
    from layertap.manifests.output_lease import held_by, latest
    from layertap.manifests.regeneration import RECIPE, live_tasks

    if not force:
        _refuse_queued_jobs(store)
    try:
        manifest = load_manifest(store)
    except NoRun:
        manifest = None
    except ManifestError as e:  # corrupt, or a newer layertap's: still a run to delete, once forced
        if not force:  # which shards are leased, and whether a window's workers wait, take the manifest to tell
            raise Refused(f"the manifest of the run at {store.uri} is not readable here ({e}): this layertap cannot "
                          "tell whether workers or a trainer still write to the run. Make sure none do, then pass "
                          "--force") from None
        return f"run at {store.uri} (its manifest.json is not readable here: {e})"
    if manifest is not None:
        if not force:
            _refuse_live_writers(store, manifest)
        return f"run {manifest.run_id} at {store.uri} ({len(manifest.shards)} shards, {layout.MANIFEST} last)"
    lease = latest(store)  # a stale one alone: a trainer killed before its first checkpoint (`status` says so too)
    held = held_by(store, lease)
    if lease is not None or any(store.exists(k) for k in TRAINING_KEYS):
        if held is not None and gone_from_here(held.holder):  # killed here: its lease outlives it, not its writes
            log.info("its trainer (%s) has exited", held.describe(store.now()))
        elif held is not None and not force:
            raise Refused(f"a trainer is writing to {store.uri} ({held.describe(store.now())}): stop it first "
                          "(or pass --force)")
        return f"training output at {store.uri}"
    tasks = live_tasks(store)
    if tasks and not force:
        (index, count), held = next(iter(tasks.items()))
        raise Refused(f"{len(tasks)} `layertap regenerate` task(s) are writing to {store.uri} (task {index}/{count}: "
                      f"{held.describe(store.now())}): stop them first (or pass --force)")
    if store.exists(RECIPE) or tasks:
        return f"regeneration output at {store.uri}"
    if store.exists(layout.EXPORT_NOTE):  # `layertap export` writes it last, and refuses a DEST not empty
        return f"`layertap export` output at {store.uri}"
    inside = enclosing(store)
    within = (f" It is inside the {inside[1]} at {inside[0]}: deleting part of it leaves that {inside[1]} "
              "incomplete" + (" (its `status` still counts data that is gone until `layertap verify` withdraws it)"
                              if inside[1] == "run" else "") + ".") if inside else ""
    if not force:
        raise Refused(f"{store.uri} holds no run (no manifest.json) and no training output (no metrics.jsonl or "
                      f"checkpoints/latest.json): not deleting it.{within} Check the prefix, or pass --force to delete "
                      "every object under it")
    return f"every object under {store.uri} (--force: not a run" + (f"; inside the {inside[1]} at {inside[0]})"
                                                                      if inside else ")")


def _refuse_queued_jobs(store) -> None:
    """Raise `Refused` while Slurm jobs of `layertap submit` naming the prefix are queued or running:
    they hold no lease until they start, and a queued extraction task planned the run anew at the
    prefix once it did. Asked of squeue where this machine has it (the Slurm layer reads the jobs'
    comments: the one place that knows them, imported here alone)."""
    from layertap.slurm.queued import jobs_naming

    tagged = jobs_naming(store.uri)  # held ones too: released, they would write there
    if tagged:
        jobs = [t.job for t in tagged]
        arrays = sorted({job.split("_", 1)[0] for job in jobs})
        kinds = sorted({t.kind for t in tagged})
        what = {"extract": "an extraction task would plan the run anew", "train": "a trainer would start its output "
                "anew", "regenerate": "a regeneration task would start the output anew"}
        raise Refused(f"Slurm job(s) {listing(jobs, LIST_NESTED)} of `layertap submit {'|'.join(kinds)}` are queued "
                      f"or running for {store.uri}: they would write to it after the delete "
                      f"({'; '.join(what[k] for k in kinds)}). Cancel them first (`scancel {' '.join(arrays)}`), or "
                      "pass --force")


def _refuse_live_writers(store, manifest) -> None:
    """Raise `Refused` while a process may still write to the run: workers under live leases,
    workers of a --window extraction (they wait for training holding no lease), and the run's
    --delete-consumed trainer (it records what it consumed after each checkpoint)."""
    from layertap.manifests.consumption import recorded_window
    from layertap.manifests.state import scan
    from layertap.storage.units import size

    from layertap.manifests.status import exited_here

    st = scan(store, manifest, with_tallies=False)  # leases and commits are what it reads
    running = sorted(s for s in range(len(manifest.shards)) if st.live_lease(s))
    gone = set(exited_here(store, st, running, limit=len(running)))  # killed here: leases outlive them, not writes
    if gone:
        log.info("shard(s) %s: held by processes on this machine that have exited", id_ranges(sorted(gone), 10))
    running = [s for s in running if s not in gone]
    if running:
        raise Refused(f"shard(s) {id_ranges(running, 10)} of run {manifest.run_id} at {store.uri} are being written "
                      "under live leases: stop the workers first (or pass --force)")
    _refuse_live_consumer(store, manifest)
    if (window := recorded_window(store)) is not None and len(st.committed) < len(manifest.shards):
        raise Refused(f"run {manifest.run_id} at {store.uri} is extracted under a --window of {size(window)} and is "
                      f"not complete ({len(st.committed):,} of {len(manifest.shards):,} shards committed): its "
                      "workers may be waiting for training to free the window, holding no lease. Stop them "
                      "first (Ctrl-C, or `scancel` their Slurm job), then pass --force")


def _refuse_live_consumer(store, manifest) -> None:
    """Raise `Refused` while the run's --delete-consumed trainer (`consumed/trainer.json` names
    its output) runs: its output's lease says so."""
    from layertap.manifests.consumption import consumer_of
    from layertap.manifests.manifest import ManifestError
    from layertap.manifests.output_lease import live_holder
    from layertap.storage.store import StoreError, open_store

    try:
        output = consumer_of(store)
    except ManifestError as e:  # unreadable: cannot ask its trainer
        raise Refused(f"cannot tell whether the --delete-consumed trainer of run {manifest.run_id} still runs ({e}): "
                      "make sure it is stopped, then pass --force") from None
    if output is None:
        return
    trainer = f"the --delete-consumed trainer of run {manifest.run_id} at {store.uri} (writing to {output})"
    try:
        out = open_store(output)
        held = live_holder(out)
    except StoreError as e:
        raise Refused(f"cannot tell whether {trainer} still runs ({e}): make sure it is stopped, then pass "
                      "--force") from None
    if held is not None:
        raise Refused(f"{trainer} is running ({held.describe(out.now())}): it records what it consumed in the run "
                      "after each checkpoint. Stop it first (Ctrl-C, or `scancel` its Slurm job), or pass --force")


def delete_all(store, keys: list[str], threads: int = 16) -> int:
    """Delete `keys`, the manifest and the training pointer last (see the module's docstring), in
    batches of `DELETE_BATCH` keys (one DeleteObjects request each on S3), `threads` at a time."""
    from tqdm import tqdm

    from layertap.storage.s3 import DELETE_BATCH

    last = {marker for marker, _ in MARKERS}  # what makes the prefix a run or an output: the rerun finishes it
    # the commit records before what they vouch for: a delete cut short never leaves a commit whose
    # data is gone (status would count the shard done, a trainer fail on its missing object); with
    # them the consumption markers, which a run redone in place after a cut-short delete would take
    # for its fresh shards' (their data deleted as consumed)
    vouching = (layout.COMMITS, layout.TALLY, layout.FEED, layout.COMMIT_INDEX, layout.CONSUMED)
    waves = [[k for k in keys if k.startswith(vouching)],
             [k for k in keys if k not in last and not k.startswith(vouching)]]
    with ThreadPoolExecutor(threads) as pool, \
            tqdm(total=sum(map(len, waves)), desc="delete", unit="object", unit_scale=True, disable=None) as bar:
        for wave in waves:
            batches = [wave[i:i + DELETE_BATCH] for i in range(0, len(wave), DELETE_BATCH)]
            for done in pool.map(lambda batch: store.delete_many(batch) or len(batch), batches):
                bar.update(done)
    store.delete_many([k for k in keys if k in last])
    return len(keys)


def _confirmed(uri: str) -> bool:
    if not sys.stdin.isatty():
        raise Refused("not deleting without confirmation: standard input is not a terminal; pass --yes")
    answer = input(f"delete everything under {uri}? type yes to confirm: ")
    return answer.strip().lower() == "yes"
