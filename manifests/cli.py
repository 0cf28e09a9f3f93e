"""`layertap status PREFIX` and `layertap verify PREFIX`."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("prefix", help="the run prefix: s3://bucket/prefix or a local folder")
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")


def add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("prefix", help="the run prefix: s3://bucket/prefix or a local folder")
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    p.add_argument("--threads", type=int, default=4, help="shards verified in parallel (default 4)")


def _errors():
    from manifests.manifest import ManifestError
    from storage.shard import ShardError
    from storage.store import StoreError

    return (ManifestError, StoreError, ShardError)


def run_status(args: argparse.Namespace) -> int:
    from manifests.status import run_status as status
    from storage.store import open_store

    try:
        s = status(open_store(args.prefix))
    except _errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print(format_status(s))
    if s["problem"]:
        print(f"error: {s['problem']}", file=sys.stderr)
        return 1
    return 0


def format_status(s: dict) -> str:
    gb = 1e9
    lines = [
        f"run {s['run_id']} at {s['prefix']}  (model {s['model']}, codec {s['codec']}, created {s['created_at']})",
        f"  shards   {s['shards_done']}/{s['shards_total']} done, {s['shards_running']} running, "
        f"{s['shards_failed']} failed, {s['shards_pending']} pending",
        f"  samples  {s['samples_done']}/{s['samples_total']} stored"
        + (f", {s['samples_skipped']} skipped (nothing to train on, e.g. no assistant token within "
           "max length; each reason is in the commit records)" if s["samples_skipped"] else ""),
        f"  tokens   {s['tokens_done']:,} of ~{s['tokens_total_est']:,}",
        f"  bytes    {s['bytes_stored'] / gb:.3f} GB stored, {s['bytes_raw'] / gb:.3f} GB raw"
        + (f", ratio {s['compression_ratio']:.3f}x" if s["compression_ratio"] else ""),
    ]
    if s["tokens_per_s"]:
        eta = time.strftime("%H:%M:%S", time.gmtime(s["eta_s"])) if s["eta_s"] is not None else "?"
        lines.append(f"  rate     {s['tokens_per_s']:,.0f} tokens/s over the last 10 min, ETA {eta}")
    lines.append("  COMPLETE" if s["complete"] else "")
    for f in s["failed"]:
        where = f"host {f.get('host')} rank {f.get('rank')}" + (f" job {f['job_id']}" if f.get("job_id") else "")
        lines.append(f"  FAILED shard {f['shard']} ({f['attempts']} attempts, last on {where}): {f['error']}")
    return "\n".join(l for l in lines if l)


def run_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from manifests.status import verify_run
    from storage.store import open_store

    try:
        store = open_store(args.prefix)
        with tqdm(desc="verify", unit="shard", disable=args.json or None, file=sys.stderr) as bar:
            result = verify_run(store, threads=args.threads, progress=bar.update)
    except _errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"verified {result.checked} committed shards: {result.ok} ok, {len(result.bad)} bad")
        for b in result.bad:
            print(f"  WITHDRAWN shard {b['shard']}: {b['error']} (the next `layertap extract` redoes it)")
        if result.orphans_deleted:
            print(f"  deleted {result.orphans_deleted} data objects of crashed attempts that no commit names")
    return 1 if result.bad else 0
