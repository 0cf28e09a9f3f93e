"""`layertap submit`: the generated scripts, the sizing of arrays from a run, and a real
single-node Slurm cluster (.ci/slurm.sh) running extraction arrays and a chained training job."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.manifest import create_or_resume
from layertap.manifests.records import decode_commit, decode_failure
from layertap.manifests.status import run_status, verify_run
from layertap.slurm.resources import NodeShape, Resources, extract_resources, fit, weight_bytes
from layertap.slurm.scripts import ArrayPlan, JobOptions, compress, extract_script, train_script
from layertap.slurm.submit import parse_sinfo, save_script, sbatch
from layertap.slurm.work import Remaining, dynamic_plan, remaining_work, static_plan, within
from layertap.slurm.queued import QueuedTask, leave_to_queued
from layertap.storage.store import ObjectStore, open_store
from test_extract import write_chats
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow  # starts a single-node Slurm cluster and submits real jobs

REPO = Path(__file__).resolve().parents[1]
SLURM_SH = REPO / ".ci" / "slurm.sh"


# -- sizing ------------------------------------------------------------------------------------

def planned_run(prefix: str, shards: int, committed: int = 0, failed: int | None = None) -> ObjectStore:
    """A manifest of `shards` shards of 10 samples (what `extract` writes after tokenizing), its
    first `committed` shards done and shard `failed` failed once; the run's store."""
    config = {"model": "m", "codec": "bf16-zstd", "dtype": "bfloat16", "max_length": 64, "final_state": "none"}
    store = open_store(prefix)
    create_or_resume(store, config=config, dataset={"fingerprint": "f"},
                     token_counts=[10] * (10 * shards), bytes_per_token=10.0, shard_bytes=1000)
    for s in range(committed):
        store.put(layout.commit_key(s), b"{}")
    if failed is not None:
        store.put(layout.failure_key(failed, 1, "t"), b"{}")
    return store


def test_remaining_work_is_every_shard_without_a_commit_that_no_live_lease_holds(store_uri):
    store = planned_run(store_uri, 6)
    store.put(layout.commit_key(0), b"{}")
    store.put(layout.lease_key(1, 1, 600), b"{}")  # a live worker
    store.put(layout.lease_key(2, 1, 0.001), b"{}")  # a dead one: stale at once
    store.put(layout.failure_key(3, 1, "tok"), b"{}")
    time.sleep(2.6)  # leases age by the store's clock: whole seconds on S3 (its Date header, and LastModified counted at its end), and request latency
    rem = remaining_work(store)
    assert (rem.total, rem.done, rem.running, rem.failed, rem.todo) == (6, 1, [1], [3], [2, 3, 4, 5])
    assert rem.summary() == "6 shards: 1 done, 1 running, 1 failed, 3 pending"
    # a shard whose last attempt was stopped from outside (preempted) is interrupted, as `status` says
    store.put(layout.failure_key(4, 1, "tok"), b"{}")
    store.put(layout.failure_key(4, 2, "tok", stopped=True), b"{}")
    rem = remaining_work(store)
    assert (rem.failed, rem.interrupted, rem.todo) == ([3, 4], [4], [2, 3, 4, 5])
    assert rem.summary() == "6 shards: 1 done, 1 running, 1 failed, 2 pending, 1 interrupted"
    assert remaining_work(store, only=[0, 3, 4]).todo == [3, 4]
    # with --shards the counts are of its shards, and the summary says so (it read "6 shards: 1 done, ...")
    assert remaining_work(store, only=[0, 3, 4]).summary() == \
        "3 of the run's 6 shards (--shards): 1 done, 0 running, 1 failed, 0 pending, 1 interrupted"
    with pytest.raises(ValueError, match=r"does not have \(it has shards 0-5\)"):
        remaining_work(store, only=[2, 9])


def test_tasks_still_queued_for_the_run_are_left_their_shards():
    """A task holds a lease only once it runs: a resubmission while an array still waited in the
    queue submitted its work again. squeue's pending tasks carrying the run's tag are left theirs:
    a static task's range, and a dynamic task one task's share of the free shards."""
    from layertap.slurm.queued import leave_to_queued, parse_squeue, tag

    run = "s3://b/run 1"
    listed = "\n".join([f"41_0|PENDING|Priority|{tag(run, 2, None)}",  # static
                        f"41_2|PENDING|JobArrayTaskLimit|{tag(run, 2, None)}",
                        f"42_0|PENDING|Resources|{tag(run, None, None)}",  # dynamic
                        f"42_1|PENDING|JobHeldUser|{tag(run, None, None)}",  # the user's own hold: released at will
                        f"43_0|PENDING|Priority|{tag(run, None, [9])}",  # of shard 9 only (done): counts for nothing
                        f"44_0|PENDING|Priority|{tag('s3://b/run 12', None, None)}",
                        "45_0|PENDING|Priority|another | comment",
                        "46|PENDING|Priority|" + tag(run, None, None),  # not an array task
                        f"47_0|PENDING|DependencyNeverSatisfied|{tag(run, None, None)}"])  # will never start
    queued = parse_squeue(listed, run)
    assert [t.job for t in queued] == ["41_0", "41_2", "42_0", "42_1", "43_0"]
    rem = Remaining(run_id="r", total=10, done=1, running=[3], failed=[], todo=[0, 1, 2, 4, 5, 6, 7, 8])
    left = leave_to_queued(rem, queued)
    assert (left.queued, left.queued_jobs, left.queued_for, left.queued_dynamic) == (4, ["41", "42"], [0, 1, 4, 5], 2)
    assert left.free == [2, 6, 7, 8]
    assert dynamic_plan(left, None, 1, queued=left.queued_dynamic).indices == [0, 1]  # 4 free, 2 taken by 42's
    assert dynamic_plan(left, 3, 1, queued=left.queued_dynamic).indices == [0]  # --nodes 3 in all
    assert static_plan(left, 2, None).indices == [1, 3, 4]  # shard 2, shards 6-7, shard 8
    assert leave_to_queued(rem, []).free == rem.todo


def test_status_and_delete_know_the_slurm_jobs_queued_for_a_prefix(tmp_path, capsys, monkeypatch):
    """`delete` checked live leases only: an extraction array still queued (its tasks hold no lease
    until they start) started after the delete and planned the run anew at the prefix. squeue's
    jobs whose comment names the prefix refuse it, naming them; --force deletes."""
    from layertap.slurm.queued import tag, training_tag

    import fake_worker

    prefix, other = str(tmp_path / "run"), str(tmp_path / "run2")
    fake_worker.plan(open_store(prefix))  # a run status reads: nothing committed, nothing running
    fake_worker.plan(open_store(other))
    out = str(tmp_path / "drafter")
    Path(out).mkdir()
    Path(out, "metrics.jsonl").write_text("{}\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text(f"#!/bin/sh\necho '91_0|PENDING|BeginTime|{tag(prefix, None, None)}'\n"
                                 f"echo '91_1|PENDING|BeginTime|{tag(prefix, None, None)}'\n"
                                 f"echo '92|RUNNING|None|{training_tag(out, True, False)}'\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    # status names them where no shard runs: "nothing is running: the same command finishes..." started a
    # second extractor beside them; and, with no run yet, it is their first task that plans it
    assert cli(["status", prefix]) == 3
    said = capsys.readouterr().out
    assert "no shard is running, but Slurm job(s) 91_0, 91_1 of `layertap submit` are queued or running" in said
    assert "nothing is running" not in said
    assert json.loads((cli(["status", "--json", other]), capsys.readouterr().out)[1])["slurm_jobs"] == []
    # a failed shard while extraction tasks are queued for the run: 3 (work to come), not 4 (failed, none running)
    open_store(prefix).put(layout.failure_key(0, 1, "t"), b"{}")
    assert cli(["status", prefix]) == 3 and "FAILED shard 0" in capsys.readouterr().out
    new, later = tmp_path / "new", tmp_path / "later"
    (bin_ / "squeue").write_text((bin_ / "squeue").read_text()
                                 + f"echo '93_0|PENDING|Priority|{tag(str(new), 0, None)}'\n"
                                 f"echo '94|PENDING|Dependency|{training_tag(str(later), False, False)}'\n"
                                 f"echo '95_0|PENDING|JobHeldAdmin|{tag(other, 0, None)}'\n")
    assert cli(["status", str(new)]) == 3  # work to come (a script waits on 3), not an error (2: a bad prefix)
    assert f"nothing at {new} yet: Slurm job(s) 93_0 of `layertap submit extract` are queued or running for " \
        "it (squeue); the first extraction task to start plans the run" in capsys.readouterr().out
    assert cli(["status", "--json", str(new)]) == 3 and json.loads(capsys.readouterr().out)["slurm_jobs"] == ["93_0"]
    assert cli(["status", str(later)]) == 3  # a training job after its extraction: no run is planned by it
    assert f"nothing at {later} yet: Slurm job(s) 94 of `layertap submit train` are queued or running for it " \
        "(squeue); the trainer writes it as it starts" in capsys.readouterr().out
    # a job held by an admin starts only if released: not named as coming (submit resubmits its work) ...
    assert cli(["status", other]) == 3 and "nothing is running" in capsys.readouterr().out

    assert cli(["delete", "--yes", prefix]) == 2
    err = capsys.readouterr().err
    assert f"Slurm job(s) 91_0, 91_1 of `layertap submit extract` are queued or running for {prefix}" in err
    assert "(an extraction task would plan the run anew)" in err
    assert "`scancel 91`" in err and (Path(prefix) / "manifest.json").exists()
    assert cli(["delete", "--yes", out]) == 2 and "Slurm job(s) 92 of " in capsys.readouterr().err
    # ... but delete names it: released, it would write there
    assert cli(["delete", "--yes", other]) == 2 and "Slurm job(s) 95_0 of " in capsys.readouterr().err
    assert cli(["delete", "--yes", "--force", prefix]) == 0 and not (Path(prefix) / "manifest.json").exists()


def test_status_of_a_regeneration_names_its_tasks_at_work_and_its_queued_jobs(tmp_path, capsys, monkeypatch):
    """An unfinished regeneration's status advised `layertap regenerate` again while its array's
    tasks were at work (a rerun beside them is refused by their leases), and, before its recipe
    existed, said it "is written once they start" of tasks already running."""
    from layertap.manifests.output_lease import OutputLease
    from layertap.manifests.regeneration import RECIPE, Recipe, task_role
    from layertap.slurm.queued import regeneration_tag

    out, early = str(tmp_path / "regen"), str(tmp_path / "early")
    store = open_store(out)
    recipe = Recipe(dataset={"rows": 40, "fingerprint": "f"}, model="m", sampling={"max_tokens": 8}, rows_per_part=10)
    store.put(RECIPE, json.dumps(recipe.to_json()).encode())
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text(f"#!/bin/sh\necho '96_1|RUNNING|None|{regeneration_tag(out, 2)}'\n"
                                 f"echo '97_0|RUNNING|None|{regeneration_tag(early, 2)}'\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "98")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "96")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    with OutputLease(store, role=task_role(1, 2)):
        assert cli(["status", out]) == 3
        said = capsys.readouterr().out
        assert "RUNNING  task 1/2 (pid" in said and "Slurm job 96_1): they finish their parts" in said, said
        assert "`layertap regenerate` with the same settings" not in said
        assert cli(["status", "--json", out]) == 3
        assert [t["task"] for t in json.loads(capsys.readouterr().out)["tasks_running"]] == ["1/2"]
    # its lease released (the task between two requeues): the queued job is named, not a rerun
    assert cli(["status", out]) == 3
    said = capsys.readouterr().out
    assert "no task is at work, but Slurm job(s) 96_1 of `layertap submit regenerate` are queued or starting" in said
    assert cli(["status", early]) == 3
    assert f"nothing at {early} yet: Slurm job(s) 97_0 of `layertap submit regenerate` are queued or running for " \
        "it (squeue); a regeneration task writes regenerate.json once its server has answered" in \
        capsys.readouterr().out
    assert cli(["delete", "--yes", out]) == 2  # said of an extraction task, which these are not
    err = capsys.readouterr().err
    assert "Slurm job(s) 96_1 of `layertap submit regenerate` are queued or running" in err
    assert "(a regeneration task would start the output anew)" in err and "extraction" not in err


def test_delete_says_nothing_of_squeue_where_no_cluster_is_configured(tmp_path, capsys, monkeypatch, caplog):
    """A Slurm client with no cluster (no slurm.conf): every `delete` warned "squeue failed (squeue:
    fatal: Could not establish a configuration source)", twice where it asked. Another failure of
    squeue is still warned of: queued jobs would go unseen."""
    import fake_worker

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text("#!/bin/sh\necho 'squeue: fatal: Could not establish a configuration source' >&2\n"
                                 "exit 1\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    if os.path.exists("/etc/slurm/slurm.conf"):
        pytest.skip("this host has a Slurm cluster configured (/etc/slurm/slurm.conf)")
    for name in ("a", "b"):
        fake_worker.plan(open_store(str(tmp_path / name)))
    with caplog.at_level("WARNING"):
        assert cli(["delete", "--yes", str(tmp_path / "a")]) == 0
    assert "squeue failed" not in caplog.text + capsys.readouterr().err
    (bin_ / "squeue").write_text("#!/bin/sh\necho 'squeue: error: slurm_load_jobs error: Unable to contact slurm "
                                 "controller' >&2\nexit 1\n")
    with caplog.at_level("WARNING"):
        assert cli(["delete", "--yes", str(tmp_path / "b")]) == 0
    assert "squeue failed (squeue: error: slurm_load_jobs error: Unable to contact slurm controller)" in caplog.text


def test_a_resubmission_leaves_the_tasks_still_queued_their_work(tmp_path, capsys, monkeypatch):
    """`submit extract` asks squeue for the run's pending tasks (their comment names the run): it
    starts only what they leave, refuses --then-train beside them, and tags its own array."""
    from layertap.slurm.queued import tag

    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / "run")
    planned_run(prefix, 6)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text(f"#!/bin/sh\necho '77_1|PENDING|Priority|{tag(prefix, 2, None)}'\n"
                                 f"echo '78_0|PENDING|Resources|{tag(prefix, None, None)}'\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_))
    base = ("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0")
    assert submit(*base, "--nodes", "3") == 0
    out = capsys.readouterr().out
    assert "2 task(s) of jobs 77, 78 are still queued for this run (squeue): shards 2-3 are theirs and 1 takes free " \
           "shards: left to them; this array is for the rest" in out
    assert "#SBATCH --array=0-1\n" in out  # 4 free shards, --nodes 3 in all: 2 more
    assert f'#SBATCH --comment="{tag(prefix, None, None)}"' in out
    assert submit(*base, "--shards-per-task", "2") == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0,2\n" in out and f'#SBATCH --comment="{tag(prefix, 2, None)}"' in out
    assert submit(*base, "--nodes", "1") == 0
    assert "nothing to submit: 2 task(s) of jobs 77, 78 are still queued for this run" in capsys.readouterr().out
    assert submit(*base, "--then-train", "--out d") == 2
    # --data added: --then-train sets it to --out, `submit train` needs it ("error: missing --data")
    assert "`layertap submit train --after 77 --after 78 --after <the new array's job id, if any> <this command's " \
        f"Slurm options> --data {prefix} --out d`" in capsys.readouterr().err

    # No run yet: the queued tasks that may take these shards count against --nodes, and training is
    # not chained beside them (it was submitted with no dependency, the array being empty)
    fresh = str(tmp_path / "fresh")
    (bin_ / "squeue").write_text(f"#!/bin/sh\necho '80_0|PENDING|Priority|{tag(fresh, None, range(4))}'\n"
                                 f"echo '80_1|PENDING|Priority|{tag(fresh, None, range(4))}'\n")
    new = ("extract", "--dry-run", "--out", fresh, "--gpus-per-node", "0", "--nodes", "2")
    assert submit(*new, "--shards", "0-3") == 0
    assert "nothing to submit: 2 task(s) of job 80 are queued for this run" in capsys.readouterr().out
    assert submit(*new, "--shards", "4-7") == 0  # theirs are others: not left to them
    assert "#SBATCH --array=0-1\n" in capsys.readouterr().out
    assert submit(*new, "--then-train", "--out d") == 2
    assert "2 task(s) of job 80 are queued for this run (squeue): training chained" in capsys.readouterr().err
    # a tag Slurm would refuse (over 1,024 characters) is left out; a long --shards list is "some"
    assert tag(fresh, None, range(0, 800, 2)) == f"layertap-extract k=0 shards=some out={fresh}"
    assert tag("/" + "x" * 1000, None, None) is None


def fake_squeue(bin_: Path, rows: list[tuple[str, str, str, str]]) -> None:
    """A stand-in `squeue` in `bin_` that prints `rows` (job, state, reason, comment) as the real
    one does: only the states `-t` asks for, in the fields `-o` names (%i, %T, %r, %k)."""
    (bin_ / "squeue").write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
states = args[args.index("-t") + 1].split(",") if "-t" in args else None
for job, state, reason, comment in {rows!r}:
    if states is None or state in states:
        print(args[args.index("-o") + 1].replace("%i", job).replace("%T", state).replace("%r", reason)
              .replace("%k", comment))
""")
    (bin_ / "squeue").chmod(0o755)


def test_tasks_held_for_good_are_not_left_their_work(tmp_path, capsys, caplog, monkeypatch):
    """A task held after its launch failed (or by an admin) runs only if someone releases it, yet
    it kept its work: a resubmission left it to a task that would never start. Its work is
    submitted again, and the log names it (released later, it would do the work twice); a hold
    of the user's own (`--hold`, `scontrol uhold`) is theirs to release and keeps its work."""
    from layertap.slurm.queued import tag

    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / "run")
    planned_run(prefix, 6)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    dynamic = tag(prefix, None, None)
    fake_squeue(bin_, [("60_0", "PENDING", "launch failed requeued held", dynamic),
                       ("60_1", "PENDING", "JobHeldAdmin", dynamic),
                       ("60_2", "PENDING", "JobHeldUser", dynamic)])
    monkeypatch.setenv("PATH", str(bin_))
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0",
                  "--nodes", "3") == 0
    out = capsys.readouterr().out
    assert "1 task(s) of job 60 are still queued for this run (squeue): 1 takes free shards" in out
    assert "#SBATCH --array=0-1\n" in out  # --nodes 3 in all: 60_2 and two new ones
    held = [r.getMessage() for r in caplog.records if "held" in r.getMessage()]
    assert len(held) == 1 and "Slurm task(s) 60_0 60_1 queued for the run at" in held[0], held
    assert "(JobHeldAdmin, launch failed requeued held)" in held[0] and "`scancel 60_0 60_1`" in held[0]


def test_started_tasks_keep_their_work_until_their_leases_show(tmp_path, capsys, monkeypatch):
    """A task that has started but holds no lease yet (its environment, imports, tokenizing, the
    model's load) was neither pending in squeue nor a lease holder: a resubmission then submitted
    its work again, and two allocations raced for the same shards. A running dynamic task keeps
    its share until a lease of its own shows (then its shards are the leases', counted once), a
    running static task its whole range, and neither a shard it gave up."""
    from layertap.slurm.queued import tag

    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))

    def leased(store, shard: int, job: str) -> None:
        store.put(layout.lease_key(shard, 1, 600), json.dumps({"holder": {"job_id": job, "token": job}}).encode())

    def dry_run(prefix: str, *args: str) -> str:
        assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0",
                      *args) == 0
        return capsys.readouterr().out

    # Dynamic: 70_0 holds shard 0 (not counted again), 70_1 is starting (one task's share)
    prefix = str(tmp_path / "dynamic")
    planned_run(prefix, 6)
    leased(open_store(prefix), 0, "70_0")
    fake_squeue(bin_, [("70_0", "RUNNING", "None", tag(prefix, None, None)),
                       ("70_1", "RUNNING", "None", tag(prefix, None, None))])
    out = dry_run(prefix, "--nodes", "3")
    assert "1 task(s) of job 70 are still queued or running for this run (squeue; 1 running): 1 takes free shards" in out
    assert "#SBATCH --array=0-1\n" in out  # 3 in all: 70_1 and two new ones (70_0 takes shards as they do)

    # Static, 2 shards a task: 71_1 holds shard 2 and will take shard 3 next; 71_2 (shards 4-5) is starting
    prefix = str(tmp_path / "static")
    planned_run(prefix, 6)
    leased(open_store(prefix), 2, "71_1")
    fake_squeue(bin_, [("71_1", "RUNNING", "None", tag(prefix, 2, None)),
                       ("71_2", "RUNNING", "None", tag(prefix, 2, None))])
    out = dry_run(prefix, "--shards-per-task", "2")
    assert "2 task(s) of job 71 are still queued or running for this run (squeue; 2 running): shards 3-5 are theirs" in out
    assert "#SBATCH --array=0\n" in out  # shards 0-1 only

    # 72_0 gave shard 5 up (its --retries used up) and waits for the others: it will not take it again
    prefix = str(tmp_path / "given-up")
    store = planned_run(prefix, 6, committed=5, failed=5)
    store.put(layout.given_up_key(5, 2, "t"), json.dumps({"producer": {"job_id": "72_0"}, "retries": 1}).encode())
    fake_squeue(bin_, [("72_0", "RUNNING", "None", tag(prefix, None, None))])
    out = dry_run(prefix, "--nodes", "2")
    assert "still queued" not in out and "#SBATCH --array=0\n" in out
    # ... while another running task that gave up nothing would take it
    fake_squeue(bin_, [("72_0", "RUNNING", "None", tag(prefix, None, None)),
                       ("73_0", "RUNNING", "None", tag(prefix, None, None))])
    assert "nothing to submit: 1 task(s) of job 73 are still queued or running" in dry_run(prefix, "--nodes", "2")

    # 74_0, started with --shards 0-1, waits behind a full --window (no lease): counted once, as a waiting
    # worker, not also as a starting task
    prefix = str(tmp_path / "window")
    planned_run(prefix, 6)
    open_store(prefix).put(layout.waiting_key("t74"), json.dumps({"producer": {"job_id": "74_0", "token": "t74"},
                                                                  "shard": 0, "shards": [[0, 1]]}).encode())
    fake_squeue(bin_, [("74_0", "RUNNING", "None", tag(prefix, None, None))])
    out = dry_run(prefix, "--nodes", "3")  # its shards 0-1 left to it; 2-5 to the new tasks, --nodes of them
    assert "wait behind the full storage window to take shards 0-1" in out and "still queued or running" not in out
    assert "#SBATCH --array=0-2\n" in out  # it was counted as a starting task too: one task fewer


def test_a_shard_given_up_by_the_worker_waiting_behind_the_window_is_submitted(tmp_path, capsys, monkeypatch):
    """74_0 gave shard 5 up (its --retries used up) and now waits behind a full --window for any
    shard: "nothing to submit: ... wait ... to take shards 5-9", though it never takes 5 again."""
    from layertap.slurm.queued import tag

    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))
    prefix = str(tmp_path / "run")
    store = planned_run(prefix, 10, committed=5, failed=5)
    store.put(layout.given_up_key(5, 2, "t"), json.dumps({"producer": {"job_id": "74_0"}, "retries": 1}).encode())
    store.put(layout.waiting_key("t74"), json.dumps({"producer": {"job_id": "74_0", "token": "t74"}, "shard": 6,
                                                     "shards": None}).encode())
    fake_squeue(bin_, [("74_0", "RUNNING", "None", tag(prefix, None, None))])
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0",
                  "--nodes", "2") == 0
    out = capsys.readouterr().out
    assert "wait behind the full storage window to take shards 6-9" in out and "#SBATCH --array=0\n" in out


def test_workers_killed_while_they_waited_behind_the_window_are_replaced_at_once(tmp_path, capsys, monkeypatch):
    """A waiting worker's record outlives it by up to WAITING_STALE_S (5 min): killed while it waited
    (an OOM, a node lost, scancel), its array gone from squeue, `status` still said extraction waited,
    and `submit extract` left the shards to it ("nothing to submit"). A record whose Slurm task squeue
    no longer shows, or whose process is gone from this host, counts for nothing, as a lease's holder."""
    import subprocess

    from layertap.manifests.liveness import pid_namespace
    from layertap.slurm.queued import tag

    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))
    import fake_worker

    prefix = str(tmp_path / "window")
    fake_worker.work(prefix, shards=[0, 1])
    store = open_store(prefix)
    store.put(layout.CONSUMED_WINDOW, json.dumps({"window": 1000, "time": time.time()}).encode())  # at rest: full
    store.put(layout.waiting_key("t80"), json.dumps({"producer": {"job_id": "80_0", "token": "t80"}, "shard": 2,
                                                     "shards": None}).encode())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid of this host that has exited
    store.put(layout.waiting_key("tpid"), json.dumps({"producer": {"host": socket.gethostname(), "pid": dead.pid,
                                                                   "pid_ns": pid_namespace(), "token": "tpid"},
                                                      "shard": 2, "shards": None}).encode())
    def dry_run(prefix: str, *args: str) -> str:
        assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0",
                      *args) == 0
        return capsys.readouterr().out

    fake_squeue(bin_, [("80_0", "RUNNING", "None", tag(prefix, None, None))])  # 80_0 waits; the other is gone
    assert cli(["status", prefix]) == 3
    assert "1 extraction worker(s) wait for the window to open" in capsys.readouterr().out
    assert "nothing to submit: 1 extraction worker(s) of 80 wait behind the full storage window" \
        in dry_run(prefix, "--nodes", "2")
    fake_squeue(bin_, [])  # 80_0 killed too
    assert cli(["status", prefix, "--json"]) == 3
    s = json.loads(capsys.readouterr().out)
    assert s["workers_waiting"] == 0 and s["waiting_tasks"] == []
    out = dry_run(prefix, "--nodes", "2")
    assert "wait behind the full storage window" not in out and "#SBATCH --array=0-1\n" in out


def test_a_queued_trainer_is_named_not_started_again_by_hand(tmp_path, capsys, monkeypatch):
    """The run's --delete-consumed trainer requeued (preempted, its time limit) or resubmitted, its job
    pending: `status` of the run said THE TRAINER IS NOT RUNNING, start it again, and of its output
    "training stopped (the same command with --resume continues)": a second trainer started by hand
    beside the queued one. Both name the queued job."""
    import fake_worker
    from layertap.manifests.consumption import claim_consumer
    from layertap.slurm.queued import store_location, training_tag

    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))
    run, out = str(tmp_path / "run"), str(tmp_path / "drafter")
    fake_worker.work(run, shards=[0, 1])
    store = open_store(run)
    store.put(layout.CONSUMED_WINDOW, json.dumps({"window": 1000, "time": time.time()}).encode())
    claim_consumer(store, open_store(out).uri)
    from layertap.train.checkpoint import step_prefix

    output = open_store(out)  # it trained, checkpointed at step 4, then stopped
    output.put("checkpoints/latest.json", json.dumps({"step": 4, "prefix": step_prefix(4)}).encode())
    output.put(f"{step_prefix(4)}/state.json", json.dumps({"config": {"data": run}, "total_steps": 20}).encode())
    fake_squeue(bin_, [])
    assert cli(["status", run]) == 3
    assert "THE TRAINER IS NOT RUNNING" in capsys.readouterr().out
    # another --delete-consumed trainer of the run, for another output: the run refuses it at its start
    other = training_tag(store_location(str(tmp_path / "other")), True, True, store_location(run))
    fake_squeue(bin_, [("90", "PENDING", "Resources", other)])
    assert cli(["status", run]) == 3
    assert "THE TRAINER IS NOT RUNNING" in capsys.readouterr().out
    fake_squeue(bin_, [("91", "PENDING", "BeginTime", training_tag(store_location(out), True, True))])
    assert cli(["status", run]) == 3
    said = capsys.readouterr().out
    assert "THE TRAINER IS QUEUED: this run's --delete-consumed trainer is not running now, and Slurm job(s) 91 for " \
        "its output are queued or running (squeue)" in said and "NOT RUNNING" not in said, said
    assert cli(["status", run, "--json"]) == 3 and json.loads(capsys.readouterr().out)["trainer_jobs"] == ["91"]
    assert cli(["status", out]) == 3
    assert "training stopped, and Slurm job(s) 91 for this output are queued or running (squeue)" \
        in capsys.readouterr().out
    fake_squeue(bin_, [])  # none queued: a trainer by hand resumes with --resume, a job by the same submit command
    assert cli(["status", out]) == 3
    assert "training stopped (the same `layertap train` command with --resume continues from the checkpoint; as a " \
        "Slurm job of `layertap submit`: the same submit command, which passes --resume)" \
        in capsys.readouterr().out


def test_a_trainer_queued_before_its_claim_is_named_by_the_run(tmp_path, capsys, monkeypatch):
    """`submit extract --train-while-extracting --window` queues the trainer, whose job may wait for
    nodes while the array fills the window: the run names no consumer until the trainer starts, and
    `status` said NO TRAINER DELETES, restart the trainer (a second one beside the queued job). The
    trainer's Slurm comment names the run it consumes (data=, a path with a space kept whole), and
    `status` of the run names the job."""
    import fake_worker

    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))
    fake_squeue(bin_, [])
    run = str(tmp_path / "the run")
    assert submit("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "0", "--out", run, "--window", "1GB",
                  "--train-while-extracting", "--model m --out d --delete-consumed") == 0
    script = dry_run_scripts(capsys.readouterr().out)["layertap-train"]
    comment = next(line.split("--comment=", 1)[1] for line in script.splitlines() if "--comment=" in line)
    comment = shlex.split(comment)[0] if comment.startswith(("'", '"')) else comment
    fake_worker.work(run, shards=[0, 1])
    open_store(run).put(layout.CONSUMED_WINDOW, json.dumps({"window": 1000, "time": time.time()}).encode())
    assert cli(["status", run]) == 3
    assert "NO TRAINER DELETES" in capsys.readouterr().out  # no job queued: start one
    fake_squeue(bin_, [("93", "PENDING", "Resources", comment)])
    assert cli(["status", run]) == 3
    said = capsys.readouterr().out
    assert "THE TRAINER IS QUEUED: no --delete-consumed trainer has claimed this run yet, and Slurm job(s) 93 " \
        "that consume it are queued or running (squeue)" in said and "NO TRAINER DELETES" not in said, said
    assert cli(["status", run, "--json"]) == 3 and json.loads(capsys.readouterr().out)["trainer_jobs"] == ["93"]
    # a data= that does not fit Slurm's comment leaves the tag without it, not the job without a tag
    from layertap.slurm.queued import training_tag

    assert training_tag("/o", True, True, "/" + "\u30c7" * 400) == "layertap-train follow=1 delete=1 out=/o"
    # a trainer of another run, or one that does not delete, opens no window of this one
    others = [("94", "PENDING", "Resources", comment.replace("the%20run", "other")),
              ("95", "RUNNING", "None", comment.replace("delete=1", "delete=0"))]
    fake_squeue(bin_, others)
    assert cli(["status", run]) == 3
    assert "NO TRAINER DELETES" in capsys.readouterr().out


def test_a_shard_under_the_live_lease_of_a_job_gone_from_squeue_is_submitted(tmp_path, capsys, monkeypatch):
    """Job 70 was cancelled (or killed) with its lease on shard 2 not yet stale: `submit` took the
    shard for running and left it to no one ("nothing to submit: shards 2 are running under live
    leases"). squeue says whether the holder's job lives; a worker outside Slurm still runs."""
    from layertap.slurm.queued import tag

    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))
    prefix = str(tmp_path / "run")
    store = planned_run(prefix, 6, committed=2)
    for shard, holder in ((2, {"job_id": "70_3", "token": "a"}), (3, {"job_id": "71_0", "token": "b"}),
                          (4, {"pid": 123, "host": "login1", "token": "c"})):
        store.put(layout.lease_key(shard, 1, 600), json.dumps({"holder": holder}).encode())
    fake_squeue(bin_, [("71_0", "RUNNING", "None", tag(prefix, None, None))])

    def dry_run() -> str:
        assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0",
                      "--nodes", "4") == 0
        return capsys.readouterr().out

    out = dry_run()
    assert "6 shards: 2 done, 2 running, 0 failed, 2 pending (1 under the lease of a job gone from squeue)" in out
    assert "#SBATCH --array=0-1\n" in out  # shards 2 and 5
    fake_squeue(bin_, [("70_3", "RUNNING", "None", tag(prefix, None, None)),
                       ("71_0", "RUNNING", "None", tag(prefix, None, None))])
    out = dry_run()
    assert "6 shards: 2 done, 3 running, 0 failed, 1 pending" in out and "gone from squeue" not in out


def test_a_static_resubmission_beside_queued_dynamic_tasks_says_what_it_covers(tmp_path, capsys, monkeypatch):
    """Static ranges cannot leave a dynamic task its share: the array covers every free shard, and
    it said "left to them; this array is for the rest"."""
    from layertap.slurm.queued import tag

    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))
    prefix = str(tmp_path / "run")
    planned_run(prefix, 6)
    fake_squeue(bin_, [(f"80_{i}", "PENDING", "Priority", tag(prefix, None, None)) for i in range(2)])
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0",
                  "--shards-per-task", "1") == 0
    out = capsys.readouterr().out
    assert "the static ranges of this array cover the free shards beside those dynamic tasks" in out
    assert "`scancel 80`" in out and "this array is for the rest" not in out and "#SBATCH --array=0-5\n" in out


def test_tasks_that_cannot_take_the_shards_or_never_start_keep_no_work(caplog):
    """A --shards list too long for the tag ("some") was read as any shard, and a task pending past
    a partition's limit (a --time over its maximum: PartitionTimeLimit) kept its work for good."""
    from layertap.slurm.queued import leave_to_queued, parse_squeue, tag

    run = "s3://b/run"
    scattered = tag(run, None, list(range(0, 500, 2)))
    assert "shards=some " in scattered
    listed = "\n".join([f"90_0|PENDING|Priority|{scattered}",
                        f"50_0|PENDING|PartitionTimeLimit|{tag(run, 2, None)}"])
    queued = parse_squeue(listed, run)
    assert [t.job for t in queued] == ["90_0"] and "50_0 queued for the run at" in caplog.text
    assert "`scancel 50_0`" in caplog.text and "PartitionTimeLimit" in caplog.text
    rem = Remaining(run_id="r", total=10, done=0, running=[], failed=[], todo=[1, 3])
    assert leave_to_queued(rem, queued).free == [1, 3] and leave_to_queued(rem, queued).queued == 0


def test_a_regeneration_resubmission_leaves_its_queued_tasks_out(tmp_path, capsys, monkeypatch):
    """Regeneration tasks hold a lease only once they run: one still queued was submitted again
    beside itself, and both answered its parts. squeue's pending tasks tagged with the output are
    left out, and a queued split other than --tasks is refused (their parts overlap)."""
    from layertap.slurm.queued import store_location
    from layertap.slurm.queued import regeneration_tag

    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "regen")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    squeue = bin_ / "squeue"
    squeue.write_text(f"#!/bin/sh\necho '90_1|PENDING|Priority|{regeneration_tag(store_location(out), 2)}'\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_))
    base = ("regenerate", "--dry-run", "--gpus-per-node", "0", "--dataset", "d.jsonl", "--out", out, "--endpoint",
            "http://h:1", "--model", "m")
    assert submit(*base, "--tasks", "2") == 0
    said = capsys.readouterr().out
    assert "task(s) 1 are still queued or starting (Slurm job 90): left out" in said and "#SBATCH --array=0\n" in said
    assert f'#SBATCH --comment="{regeneration_tag(store_location(out), 2)}"' in said
    assert submit(*base, "--tasks", "3") == 2
    assert "a regeneration split into 2 tasks is queued or starting for" in capsys.readouterr().err
    # started, its server starting before it takes its task's lease: left out too; held for good: not
    tagged = regeneration_tag(store_location(out), 2)
    fake_squeue(bin_, [("90_1", "RUNNING", "None", tagged), ("91_0", "PENDING", "JobHeldAdmin", tagged)])
    assert submit(*base, "--tasks", "2") == 0
    said = capsys.readouterr().out
    assert "task(s) 1 are still queued or starting (Slurm job 90): left out" in said and "#SBATCH --array=0\n" in said


def test_array_plans():
    rem = Remaining(run_id="r", total=30, done=20, running=[0], failed=[5], todo=[5, 6, 7, 12, 29])
    assert dynamic_plan(rem, None, 1).indices == [0, 1, 2, 3, 4]  # one task per remaining shard
    assert dynamic_plan(rem, 2, 1).spec == "0-1"  # --nodes caps it
    assert dynamic_plan(rem, 8, 4).spec == "0-1"  # 5 shards keep two 4-GPU nodes busy
    assert dynamic_plan(None, 3, 8).spec == "0-2"  # no run yet: --nodes decides
    with pytest.raises(ValueError, match="give --nodes N"):
        dynamic_plan(None, None, 1)
    one = static_plan(rem, 1, 2)
    assert (one.spec, one.shards_per_task) == ("5-7,12,29%2", 1)  # array index = shard id
    assert static_plan(rem, 4, None).spec == "1,3,7"  # tasks owning 4-7, 12-15, 28-29
    with pytest.raises(ValueError, match="above this cluster's MaxArraySize of 10: use --shards-per-task 3 or more"):
        static_plan(rem, 1, None, max_array_size=10)
    assert static_plan(rem, 3, None, max_array_size=10).indices == [1, 2, 4, 9]
    assert compress([]) == "" and compress([4, 1, 2, 2]) == "1-2,4"


# -- the scripts -------------------------------------------------------------------------------

def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def sbatch_options(script: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_extract_script_dynamic_on_gpu_nodes(tmp_path):
    opts = JobOptions(job_name="x", logs=str(tmp_path / "logs"), chdir=str(tmp_path), gpus_per_node=8,
                      time="4:00:00", partition="gpu", setup=["module load cuda/12.4"], sbatch=["--exclusive"],
                      grace_s=300, cpus_per_task=80, mem="129G", env_activate="source /shared/venv/bin/activate")
    script = extract_script(opts, ArrayPlan(indices=[0, 1, 2]), ["--out", "s3://b/run 1", "--model", "/m"])
    bash_syntax_ok(script, tmp_path)
    assert sbatch_options(script) == [
        "--job-name=x", "--array=0-2", "--nodes=1", "--ntasks-per-node=1", f"--output={tmp_path}/logs/%x-%A_%a.out",
        "--gpus-per-node=8", "--cpus-per-task=80", "--mem=129G", "--time=4:00:00", "--partition=gpu",
        "--open-mode=append", "--requeue", "--signal=B:USR1@300", f"--chdir={tmp_path}", "--exclusive"]
    flat = " ".join(script.split())
    # A job step, as training's: Slurm accounts for it, places it and signals it.
    # Its command ignores USR2, which `scancel --signal=USR2` (a stack dump) sends the launcher too.
    assert ("srun --nodes=1 --ntasks=1 --cpus-per-task=80 --kill-on-bad-exit=1 bash -c 'trap \"\" USR2; exec \"$0\" "
            f"\"$@\"' {sys.executable} -m accelerate.commands.launch --multi_gpu --num_processes 8 --num_machines 1") in flat
    # --setup adds to the environment's activation (before it), and the interpreter is checked on the node.
    assert script.index("module load cuda/12.4") < script.index("source /shared/venv/bin/activate") \
        < script.index("set -uo pipefail") < script.index(f"command -v {sys.executable} ")
    assert 'OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( SLURM_CPUS_PER_TASK > 8 ? SLURM_CPUS_PER_TASK / 8 : 1 ))}"' in script
    assert '--main_process_port "$PORT"' in flat and "PORT=$((20000 + SLURM_JOB_ID % 12000))" in script
    assert "-m layertap.extract --out 's3://b/run 1' --model /m --log-dir \"$LOG_DIR\"" in flat
    assert f'LOG_DIR={tmp_path}/logs/"${{SLURM_JOB_NAME}}-${{TASK}}"' in script  # one log folder per task
    assert "--shards" not in flat  # dynamic: any free shard
    assert script.index("module load cuda/12.4") < script.index('"${cmd[@]}" &')
    assert "trap 'warned=1; scancel --signal=TERM \"$me\"" in script  # to the steps, not srun
    assert 'scontrol requeue "$me"' in script  # stopped by the time limit: back in the queue


def test_extract_script_static_ranges_on_cpu(tmp_path):
    opts = JobOptions(job_name="x", logs=str(tmp_path), cpus_per_task=4)
    one = extract_script(opts, ArrayPlan(indices=[3, 9], max_parallel=2, shards_per_task=1, num_shards=10), ["--out", "r"])
    bash_syntax_ok(one, tmp_path)
    assert "--array=3,9%2" in sbatch_options(one) and "--cpus-per-task=4" in sbatch_options(one)
    flat = " ".join(one.split())
    assert f"{sys.executable} -m layertap.extract --out r --log-dir \"$LOG_DIR\" --shards \"$SLURM_ARRAY_TASK_ID\"" in flat
    assert "accelerate" not in flat  # one process: no launcher between the shell and the worker
    four = extract_script(opts, ArrayPlan(indices=[0, 2], shards_per_task=4, num_shards=10), ["--out", "r"])
    bash_syntax_ok(four, tmp_path)
    ranges = []
    for task in (0, 2):  # the script's own arithmetic, run by bash: task 2's range is clipped at shard 9
        lines = [l for l in four.splitlines() if l.startswith(("FIRST=", "if [ \"$LAST\""))]
        p = subprocess.run(["bash", "-c", "\n".join(lines) + '\necho "$FIRST-$LAST"'], capture_output=True,
                           text=True, env={"SLURM_ARRAY_TASK_ID": str(task)})
        ranges.append(p.stdout.strip())
    assert ranges == ["0-3", "8-9"]


def test_train_script_rendezvous_from_the_slurm_environment(tmp_path):
    opts = JobOptions(job_name="t", logs=str(tmp_path), gpus_per_node=4)
    script = train_script(opts, 3, ["--data", "s3://b/r", "--out", "d"], "--resume")
    bash_syntax_ok(script, tmp_path)
    assert "--nodes=3" in sbatch_options(script) and "--gpus-per-node=4" in sbatch_options(script)
    flat = " ".join(script.split())
    # the first node's NodeAddr (its NodeName need not resolve: every node waited out the rendezvous's
    # timeout), else its name; run here with a stand-in scontrol
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text('#!/bin/sh\ncase "$2" in hostnames) printf "gpu-a\\ngpu-b\\n";; '
                                   'node) [ -n "$ADDR" ] || exit 1; echo "NodeName=$3 Arch=x86_64"; '
                                   'echo "   NodeAddr=$ADDR NodeHostName=$3";; esac\n')
    (bin_ / "scontrol").chmod(0o755)
    lines = "\n".join(line for line in script.splitlines() if line.startswith(("FIRST_NODE=", "MASTER_ADDR=", "PORT=")))
    for addr, want in (("10.1.2.3", "10.1.2.3 20077"), ("", "gpu-a 20077")):
        p = subprocess.run(["bash", "-c", lines + '\necho "$MASTER_ADDR $PORT"'], capture_output=True, text=True,
                           env={"PATH": f"{bin_}:/usr/bin:/bin", "ADDR": addr, "SLURM_JOB_NODELIST": "gpu-[a-b]",
                                "SLURM_JOB_ID": str(12000 * 3 + 77)})
        assert p.stdout.strip() == want, (p.stdout, p.stderr)
    assert "srun --nodes=3 --ntasks-per-node=1 --kill-on-bad-exit=1 bash" in flat  # no --cpus-per-task given
    assert '--machine_rank "$SLURM_NODEID"' in flat and '--num_machines "$SLURM_NNODES"' in flat
    assert '--num_processes "$((SLURM_NNODES * 4))" --main_process_ip "$MASTER_ADDR"' in flat
    assert "--multi_gpu" in flat and "-m layertap.train --data s3://b/r --out d" in flat
    # requeued or resubmitted after a failure, it continues from --out's checkpoint (a fresh --out starts anew)
    assert "RESUME=(--resume)  # continues from --out's latest checkpoint when it holds one" in script
    assert 'scontrol requeue' in script  # it resumes, so the time limit requeues it
    single = train_script(JobOptions(job_name="t", logs=str(tmp_path)), 1, ["--data", "r"], None)
    assert "--multi_gpu" not in single and "RESUME=(--resume)" not in single and "scontrol requeue" not in single
    # The node command line bash builds, with the rank from each node's environment:
    lines = [l for l in single.splitlines() if not l.startswith("#")]
    cmd_block = "\n".join(lines[lines.index("cmd=("):lines.index(")") + 1])
    p = subprocess.run(["bash", "-c", f'RESUME=(); MASTER_ADDR=h0; PORT=1; {cmd_block}\nprintf "%s\\n" "${{cmd[@]}}"'],
                       capture_output=True, text=True, env={"SLURM_NNODES": "1", "PATH": os.environ["PATH"]})
    words = p.stdout.splitlines()
    assert words[:6] == ["srun", "--nodes=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    # one process: the trainer itself, no launcher (whose failure repeated its error in a traceback)
    assert words[7:] == [sys.executable, "-m", "layertap.train", "--data", "r"]
    assert "accelerate" not in single


def test_the_environment_is_activated_on_the_node_and_checked(tmp_path):
    """By default a job activates the virtual environment `layertap submit` runs in (a real venv
    here); --setup lines come first; a missing interpreter stops the job with the reason."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    code = "from layertap.slurm.scripts import default_activation; print(default_activation())"
    p = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stdout.strip() == f"source {venv}/bin/activate"
    opts = JobOptions(job_name="x", logs=str(tmp_path), python=str(tmp_path / "elsewhere" / "python"),
                      env_activate=p.stdout.strip(), setup=["export MARK=from-setup"])
    script = extract_script(opts, ArrayPlan(indices=[0]), ["--out", "r"])
    # The script's preamble (environment, check), run by bash as the job would run it.
    preamble = script[script.index("export MARK"):script.index("if [ -n \"${SLURM_CPUS_PER_TASK")]
    run = subprocess.run(["bash", "-c", preamble + '\necho "$MARK $VIRTUAL_ENV"'], capture_output=True, text=True)
    assert run.returncode == 2 and f"{tmp_path}/elsewhere/python is not on" in run.stderr
    assert "a shared filesystem" in run.stderr and "--python" in run.stderr
    ok = extract_script(dataclasses.replace(opts, python=sys.executable), ArrayPlan(indices=[0]), ["--out", "r"])
    preamble = ok[ok.index("export MARK"):ok.index("if [ -n \"${SLURM_CPUS_PER_TASK")]
    run = subprocess.run(["bash", "-c", preamble + '\necho "$MARK $VIRTUAL_ENV"'], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == ["from-setup", str(venv)]


def test_folders_and_names_with_spaces_and_quotes_reach_sbatch_whole(tmp_path):
    """sbatch splits a `#SBATCH` line at whitespace, ends it at `#` and reads quotes and backslashes
    as a shell does: each value is one word that reads back as it was given. A `%` of the logs
    folder is no replacement symbol; a backslash there would turn them all off, a line break
    cannot be written: both are refused."""
    where = tmp_path / 'my "runs" #1 100%'
    opts = JobOptions(job_name="my job", logs=str(where / "logs"), chdir=str(where))
    for script in (extract_script(opts, ArrayPlan(indices=[0]), ["--out", "r"]), train_script(opts, 1, [], None)):
        bash_syntax_ok(script, tmp_path)
        words = [shlex.split(o) for o in sbatch_options(script)]
        assert all(len(w) == 1 for w in words), words
        read = dict(w[0].split("=", 1) for w in words if "=" in w[0])
        assert read["--job-name"] == "my job" and read["--chdir"] == str(where)
        assert read["--output"].startswith(f"{str(where).replace('%', '%%')}/logs/%x-")
    with pytest.raises(ValueError, match=r"--logs '/[^']*/a\\\\b' holds a backslash"):
        JobOptions(job_name="x", logs="a\\b")
    odd = tmp_path / "we\\ird"  # the default logs folder is relative: a backslash in the folder it runs from
    odd.mkdir()
    cwd = os.getcwd()
    try:
        os.chdir(odd)
        with pytest.raises(ValueError, match="holds a backslash"):
            JobOptions(job_name="x", logs="layertap-logs")  # the --logs default
    finally:
        os.chdir(cwd)
    with pytest.raises(ValueError, match="holds a space before its value: give the option and its value joined"):
        JobOptions(job_name="x", logs="l", sbatch=["-C a100"])  # was written `#SBATCH -C a100=""`
    with pytest.raises(ValueError, match="holds a line break, which a #SBATCH line cannot"):
        extract_script(JobOptions(job_name="x", logs="l", chdir="/a\nb"), ArrayPlan(indices=[0]), [])


def test_job_options_are_checked():
    with pytest.raises(ValueError, match="--sbatch 'exclusive' is not an sbatch option"):
        JobOptions(job_name="x", logs="l", sbatch=["exclusive"])
    with pytest.raises(ValueError, match="--procs-per-node must be at least 1"):
        JobOptions(job_name="x", logs="l", procs_per_node=0)
    # a limit under twice --grace: told to stop moments after it starts, the job requeued itself over and over
    for time_limit in ("00:01:00", "3", "3:59"):
        with pytest.raises(ValueError, match=rf"--time {time_limit} \(\d+ s\) is under twice --grace \(120 s\)"):
            JobOptions(job_name="x", logs="l", time=time_limit)
    for time_limit in ("4", "00:10:00", "1-00", "UNLIMITED"):
        JobOptions(job_name="x", logs="l", time=time_limit)


def test_slurm_time_limits_in_seconds():
    from layertap.slurm.scripts import slurm_seconds

    cases = {"90": 5400, "10:30": 630, "2:30:00": 9000, "1-12": 129600, "1-00:30": 88200, "2-01:02:03": 176523,
             "UNLIMITED": None, "infinite": None, "": None}
    assert {text: slurm_seconds(text) for text in cases} == cases


# -- the command line, without a cluster ---------------------------------------------------------

def submit(*args: str) -> int:
    return cli(["submit", *args])


def test_dry_run_prints_the_scripts_sized_to_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # a dry run needs no Slurm command
    prefix = str(tmp_path / "run")
    store = planned_run(prefix, 12, committed=10, failed=10)
    assert submit("extract", "--dry-run", "--shards-per-task", "1", "--nodes", "4", "--out", prefix,
                  "--max-length", "64", "--then-train", "--data run --model m --out d --steps 3") == 0
    out = capsys.readouterr().out
    assert "12 shards: 10 done, 0 running, 1 failed, 1 pending" in out
    assert "#SBATCH --array=10-11%4" in out and "--shards \"$SLURM_ARRAY_TASK_ID\"" in out
    assert "--max-length 64" in out and "--log-dir \"$LOG_DIR\"" in out
    assert "sbatch --parsable --dependency=afterok:<the array's job id> --kill-on-invalid-dep=yes" in out
    assert f"-m layertap.train --data {prefix} --out d --model m --steps 3" in " ".join(out.split())
    assert not (tmp_path / "layertap-logs").exists()  # nothing written

    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64") == 0  # dynamic: a task a shard
    assert "#SBATCH --array=0-1\n" in capsys.readouterr().out
    # Settings the run pins are checked now, not by every task in the queue.
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--codec", "fp8") == 2
    assert "codec: run has 'bf16-zstd', now 'fp8'" in capsys.readouterr().err
    # ... and so are the chat-template settings its chats were rendered with (none here)
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--chat-template-kwargs",
                  '{"enable_thinking": false}') == 2
    assert 'chat template settings (--chat-template-kwargs): run has {}, now {"enable_thinking": false}' in \
        capsys.readouterr().err
    # a setting the target's template never reads, for a run not planned yet: refused here, not by every task
    from tiny_models import tiny_model_dir

    assert submit("extract", "--dry-run", "--out", str(tmp_path / "new"), "--model", tiny_model_dir(tmp_path, "llama"),
                  "--chat-template-kwargs", '{"enable_thinkng": false}') == 2
    assert "sets 'enable_thinkng', which the chat template of" in capsys.readouterr().err
    # capture layers past the model's decoder layers (its config.json, read here): refused as each task would
    assert submit("extract", "--dry-run", "--out", str(tmp_path / "new"), "--model", tiny_model_dir(tmp_path, "llama"),
                  "--layers", "1,7") == 2
    assert "capture layer 7 is out of range: the model has 6 decoder layers" in capsys.readouterr().err
    # a dataset or model path missing here: noted (it may be on the nodes alone), the array submitted
    assert submit("extract", "--dry-run", "--out", str(tmp_path / "new"), "--dataset", "chatz.jsonl",
                  "--model", str(tmp_path / "no-model"), "--nodes", "1") == 0
    err = capsys.readouterr().err
    assert "note: --dataset chatz.jsonl does not exist on this host" in err  # relative (the cwd): a typo
    assert f"note: --model {tmp_path / 'no-model'} does not exist on this host" in err
    # a glob of data files: noted where it matches none here, not where it matches (it does not "exist" as a path)
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.jsonl").write_text("{}\n")
    for pattern, noted in (("parts/*.jsonl", False), ("parts/*.parquet", True)):
        assert submit("extract", "--dry-run", "--out", str(tmp_path / "new"), "--dataset", str(tmp_path / pattern),
                      "--model", str(tmp_path / "no-model"), "--nodes", "1") == 0
        err = capsys.readouterr().err
        assert ("note: --dataset" in err) == noted and ("matches no file on this host" in err) == noted, err
    # another dataset than the planned run's: its fingerprint differs, which every task would refuse
    other = tmp_path / "other.jsonl"
    other.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--dataset", str(other)) == 2
    assert "dataset fingerprint: run has 'f', now " in capsys.readouterr().err
    from layertap.extract.fingerprint import dataset_fingerprint

    manifest = json.loads(store.get(layout.MANIFEST))  # the run's own dataset: submitted
    manifest["dataset"]["fingerprint"] = dataset_fingerprint(str(other), None)
    store.put(layout.MANIFEST, json.dumps(manifest).encode())
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--dataset", str(other)) == 0
    capsys.readouterr()
    for s in (10, 11):
        store.put(layout.commit_key(s), b"{}")
    assert submit("extract", "--dry-run", "--out", prefix, "--max-length", "64") == 0
    assert "nothing to submit: every shard is done" in capsys.readouterr().out


def test_submit_train_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert submit("train", "--dry-run", "--after", "41", "--after", "42", "--nodes", "2", "--gpus-per-node", "4",
                  "--time", "1-00:00:00", "--data", "s3://b/run", "--model", "/m", "--out", "s3://b/drafter") == 0
    out = capsys.readouterr().out
    assert "sbatch --parsable --dependency=afterok:41:42 --kill-on-invalid-dep=yes <script>" in out
    assert "#SBATCH --nodes=2" in out and "#SBATCH --time=1-00:00:00" in out
    assert "-m layertap.train --data s3://b/run --out s3://b/drafter --model /m" in " ".join(out.split())
    assert "RESUME=(--resume)" in out  # a requeued job continues from its checkpoint


def test_a_complete_training_is_not_submitted_again(tmp_path, capsys, monkeypatch):
    """Resubmitting the same command, as docs/SLURM.md says, after training finished queued a
    trainer that failed on "already holds checkpoints"; one that holds checkpoints now resumes
    (the script passes --resume), and one whose drafter is exported is not submitted."""
    monkeypatch.chdir(tmp_path)
    done = open_store(str(tmp_path / "drafter"))
    done.put("metrics.jsonl", b'{"step": 5, "loss": 1.0}\n')
    done.put("drafter/config.json", b"{}")
    assert submit("train", "--dry-run", "--data", str(tmp_path / "run"), "--model", "/m", "--out", done.uri) == 0
    out = capsys.readouterr().out
    assert f"nothing to submit: the training at {done.uri} is complete" in out and "#SBATCH" not in out


def test_a_trainer_resubmitted_with_settings_its_checkpoint_refuses_is_refused_before_the_queue(tmp_path, capsys,
                                                                                                 monkeypatch):
    """The job resumes --out's checkpoint (its script passes --resume): another --batch-size was
    submitted without a word and refused in the queue, and an extraction array submitted beside it
    (--train-while-extracting) filled its window and waited for good. Refused at submission, as the
    job refuses it; the checkpoint's own settings are submitted."""
    import fake_worker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    model = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    run, out = str(tmp_path / "run"), str(tmp_path / "drafter")
    fake_worker.work(run)
    args = ["--data", run, "--model", model, "--out", out, "--batch-size", "2", "--block-size", "4",
            "--max-anchors", "8", "--save-every", "2"]
    assert cli(["train", *args, "--steps", "2"]) == 0
    shutil.rmtree(Path(out) / "drafter")  # as if stopped after its checkpoint: a resubmission resumes it
    capsys.readouterr()
    assert submit("train", "--dry-run", *args, "--steps", "4") == 0
    assert "#SBATCH" in capsys.readouterr().out
    # --data spelled otherwise than the store names it (the checkpoint holds the store's name): the same run
    for data in ("run", "./run/", f"{run}/"):
        assert submit("train", "--dry-run", *args, "--steps", "4", "--data", data) == 0, capsys.readouterr().err
        assert "#SBATCH" in capsys.readouterr().out
    assert submit("train", "--dry-run", *args, "--steps", "4", "--batch-size", "4") == 2
    err = capsys.readouterr().err
    assert "cannot resume: settings differ from the checkpoint's: batch_size: checkpoint 2, now 4" in err, err
    assert cli(["train", *args, "--steps", "4", "--batch-size", "4", "--resume"]) == 2
    assert "batch_size: checkpoint 2, now 4" in capsys.readouterr().err  # what the job would have said
    # another number of processes: the job's ranks refused it in the queue, the job then FAILED
    assert submit("train", "--dry-run", *args, "--steps", "4", "--nodes", "2") == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds a checkpoint written by 1 process(es), which the job resumes, and it would run 2 " \
        "(--nodes 2 x 1 per node)" in err, err
    assert submit("train", "--dry-run", *args, "--steps", "4", "--procs-per-node", "2") == 2
    assert "it would run 2 (--nodes 1 x 2 per node)" in capsys.readouterr().err
    assert submit("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "0", "--out", run,
                  "--then-train", " ".join(args[2:]) + " --steps 4", "--train-nodes", "2") == 2
    assert "it would run 2 (--train-nodes 2 x 1 per node)" in capsys.readouterr().err


def test_a_training_job_on_more_nodes_than_its_partition_has_is_refused(tmp_path, capsys, monkeypatch):
    """`submit train --nodes 3` on a 2-node partition was queued, waited for good (PartitionConfig), and
    `status` of its output and a resubmission both took it for queued. sinfo counts the nodes."""
    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))
    (bin_ / "sinfo").write_text("#!/bin/sh\nprintf 'cpu*|4|8000|(null)|1\\ncpu*|8|16000|(null)|1\\n'\n")
    (bin_ / "sinfo").chmod(0o755)
    planned_run(str(tmp_path / "run"), 2)
    argv = ("train", "--dry-run", "--gpus-per-node", "0", "--data", str(tmp_path / "run"), "--model", "/m", "--out",
            str(tmp_path / "d"))
    assert submit(*argv, "--nodes", "3") == 2
    assert "--nodes 3: partition cpu has 2 node(s) in all (sinfo), and a training job runs on all of its nodes at " \
        "once: it would wait in the queue for good; give --nodes 2 or fewer" in capsys.readouterr().err
    assert submit(*argv, "--nodes", "2") == 0 and "#SBATCH --nodes=2" in capsys.readouterr().out
    assert submit("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "0", "--out", str(tmp_path / "run"),
                  "--then-train", "--model /m --out d2", "--train-nodes", "3") == 2
    assert "--train-nodes 3: partition cpu has 2 node(s)" in capsys.readouterr().err


def test_no_trainer_is_submitted_for_an_output_a_trainer_holds(tmp_path, capsys, monkeypatch):
    """Resubmitting while the last trainer still runs queued a second trainer on the same --out,
    which would overwrite the first's checkpoints (now refused at its start): not queued."""
    from layertap.manifests.output_lease import OutputLease

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    held = open_store(str(tmp_path / "drafter"))
    planned_run(str(tmp_path / "run"), 2)
    argv = ("train", "--dry-run", "--data", str(tmp_path / "run"), "--model", "/m", "--out", held.uri)
    with OutputLease(held):
        assert submit(*argv) == 0
        out = capsys.readouterr().out
        assert f"nothing to submit: a trainer is writing to {held.uri} now (Slurm job 4242, pid {os.getpid()}" in out
        assert "#SBATCH" not in out
    assert submit(*argv) == 0 and "#SBATCH" in capsys.readouterr().out  # released: a trainer is queued


def test_submit_errors_are_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fresh = str(tmp_path / "fresh")
    assert submit("extract", "--dry-run", "--out", fresh) == 2
    assert "no run at --out yet, so its work cannot be sized: give --nodes N" in capsys.readouterr().err
    assert submit("extract", "--dry-run", "--shards-per-task", "2", "--nodes", "2", "--out", fresh) == 2
    out, err = capsys.readouterr()
    assert "static ranges need the run's plan" in err
    assert "the first task to start plans it" not in out  # said, then refused, before
    assert submit("extract", "--dry-run", "--shards", "0-3", "--shards-per-task", "2", "--out", fresh) == 2
    assert "not both" in capsys.readouterr().err
    assert submit("extract", "--dry-run", "--nodes", "1", "--out", fresh, "--codec", "bf16",
                  "--then-train", "--steps many") == 2
    assert "--then-train '--steps many': argument --steps: invalid int value: 'many'" in capsys.readouterr().err
    # a traceback (shlex's ValueError); and -h printed train's help and exited 0, nothing submitted
    assert submit("extract", "--dry-run", "--nodes", "1", "--out", fresh, "--then-train", "--out 'd") == 2
    assert "--then-train \"--out 'd\": No closing quotation" in capsys.readouterr().err
    assert submit("extract", "--dry-run", "--nodes", "1", "--out", fresh, "--then-train", "--out d -h") == 2
    assert "`layertap train` does not take -h" in capsys.readouterr().err
    assert submit("extract", "--dry-run", "--nodes", "1", "--out", fresh, "--max-length", "1") == 2
    assert "--max-length must be at least 2" in capsys.readouterr().err  # the extractor's own checks
    monkeypatch.setenv("PATH", str(tmp_path))
    assert submit("extract", "--nodes", "1", "--out", fresh) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "layertap-logs").exists()  # refused before anything was written
    (tmp_path / "sbatch").write_text("#!/bin/sh\necho 77\n")
    (tmp_path / "sbatch").chmod(0o755)
    (tmp_path / "a-file").write_text("")
    assert submit("extract", "--nodes", "1", "--out", fresh, "--logs", str(tmp_path / "a-file")) == 2  # a traceback
    assert f"cannot save the job script under '{tmp_path}/a-file/scripts' (--logs '{tmp_path}/a-file')" \
        in capsys.readouterr().err
    # sbatch refuses it (an unknown partition): no script is kept for a job that never existed
    (tmp_path / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nosuch' >&2\n"
                                     "exit 1\n")
    assert submit("extract", "--nodes", "1", "--out", fresh, "--partition", "nosuch") == 2
    assert "invalid partition specified: nosuch" in capsys.readouterr().err
    assert not list((tmp_path / "layertap-logs" / "scripts").iterdir())


def test_train_while_extracting_submits_a_follow_trainer_the_window_array_waits_for(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    fresh = str(tmp_path / "fresh")
    base = ("extract", "--dry-run", "--nodes", "2", "--gpus-per-node", "4", "--out", fresh, "--train-nodes", "3")
    assert submit(*base, "--window", "200GB",
                  "--train-while-extracting", "--model m --out d --delete-consumed --save-every 50") == 0
    out, err = capsys.readouterr()
    # 3 nodes x 4 ranks, each sample of a 64-sample shuffle buffer and 3 batches of 4 pinning a 1 GB shard
    assert "--window 186 GiB is below 849 GiB = 12 training ranks x (--shuffle-buffer 64 + 3 x --batch-size 4)" in err
    assert "x --shard-bytes 954 MiB (the run is not planned yet: smaller if it is smaller than a shard)" in err
    assert "may stall for good" in err
    # a run planned already keeps its shard size: the floor is of its shards (1 kB here), not --shard-bytes'
    # default (1 GiB), which the warning took on a resubmission that left the flag out
    planned_run(str(tmp_path / "planned"), 3)
    assert submit(*base[:-4], "--out", str(tmp_path / "planned"), "--max-length", "64", "--train-nodes", "3",
                  "--window", "200GB", "--train-while-extracting",
                  "--model m --out d --delete-consumed --save-every 50") == 0
    assert "is below" not in capsys.readouterr().err
    scripts = dry_run_scripts(out)
    assert set(scripts) == {"layertap-extract", "layertap-train"}
    assert "--window 200GB" in " ".join(scripts["layertap-extract"].split())
    train = " ".join(scripts["layertap-train"].split())
    assert f"-m layertap.train --data {fresh} --out d --model m --save-every 50 --follow --delete-consumed" in train
    assert "#SBATCH --nodes=3" in train and "#SBATCH --gpus-per-node=4" in train
    # The array waits behind its window for the trainer: queued first, the trainer may start before the
    # array, which starts once it has (`after`), so that array tasks cannot hold the trainer's nodes.
    assert "----- layertap-train.sbatch (dry run: not submitted; sbatch --parsable <script>)" in out
    assert ("(dry run: not submitted; sbatch --parsable --dependency=after:<the training job's id> <script>)"
            in out.split("----- layertap-extract.sbatch")[1])
    assert out.index("----- layertap-train.sbatch") < out.index("----- layertap-extract.sbatch")
    assert "RESUME=(--resume)" in train  # a requeued trainer continues its follow epoch
    assert submit(*base, "--window", "200GB", "--shard-bytes", "128MB", "--train-while-extracting",
                  "--model m --out d --delete-consumed --shuffle-buffer 16") == 0
    assert "may stall" not in capsys.readouterr().err  # 12 x (16 + 12) x 128 MB = 43 GB
    # --grad-accum 4: a follow trainer prefetches a step's 4 batches (2 otherwise), two more in flight
    assert submit(*base, "--window", "200GB", "--train-while-extracting",
                  "--model m --out d --delete-consumed --save-every 50 --grad-accum 4") == 0
    err = capsys.readouterr().err
    assert "is below 939 GiB = 12 training ranks x (--shuffle-buffer 64 + 5 x --batch-size 4)" in err
    assert "a step's 4 with --grad-accum 4" in err
    # 2 DataLoader workers: a shuffle buffer each, and 2 batches each under way
    assert submit(*base, "--window", "200GB", "--train-while-extracting",
                  "--model m --out d --delete-consumed --save-every 50 --num-workers 2") == 0
    err = capsys.readouterr().err
    assert "is below 1.70 TiB = 12 training ranks x (2 DataLoader workers x --shuffle-buffer 64 + 7 x --batch-size 4)" \
        in err and "2 per DataLoader worker" in err

    # With --window the trainer must delete what it consumed, or the extraction would wait forever.
    assert submit(*base, "--window", "200GB", "--train-while-extracting", "--model m --out d") == 2
    assert "add --delete-consumed to --train-while-extracting (or leave out --window)" in capsys.readouterr().err
    assert submit(*base, "--train-while-extracting", "--data elsewhere --out d") == 2
    assert f"its --data elsewhere is not the extraction's --out {fresh}" in capsys.readouterr().err
    assert submit(*base, "--train-while-extracting", "--out d --delete-consumed --epochs 2") == 2
    assert "--delete-consumed needs --epochs 1 (got 2)" in capsys.readouterr().err  # the trainer's own checks
    assert submit(*base, "--train-while-extracting", "--out d", "--then-train", "--out d") == 2
    assert "not both" in capsys.readouterr().err
    # Without --window, consumed data may stay; and the trainer joins an extraction that is already running.
    assert submit(*base, "--train-while-extracting", "--out d") == 0
    out = capsys.readouterr().out
    assert "--follow" in dry_run_scripts(out)["layertap-train"] and "--dependency" not in out  # no window to wait on
    planned_run(fresh, 1)
    open_store(fresh).put(layout.lease_key(0, 1, 600), b"{}")  # a live worker holds the only shard
    assert submit(*base, "--max-length", "64", "--train-while-extracting", "--out d") == 0
    out = capsys.readouterr().out
    assert "no extraction task to submit: shard 0 is running" in out and "--follow" in dry_run_scripts(out)["layertap-train"]
    assert not (tmp_path / "layertap-logs").exists()


def test_encode_threads_from_a_config_file_size_the_cpus(tmp_path, capsys, monkeypatch):
    """`--encode-threads` in the extraction's --config file is what each worker runs with, so the job's
    CPUs are sized from it (the flag still wins over the file, as the extraction itself reads them)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    config = tmp_path / "extract.json"
    config.write_text(json.dumps({"encode_threads": 3}))
    base = ("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "2", "--out", str(tmp_path / "fresh"))
    for given, cpus in [(("--config", str(config)), 10), (("--config", str(config), "--encode-threads", "1"), 6),
                        ((), 20)]:
        assert submit(*base, *given) == 0, given
        assert f"--cpus-per-task={cpus}" in sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-extract"])


def test_num_workers_from_a_trainers_config_file_size_the_cpus(tmp_path, capsys, monkeypatch):
    """As --encode-threads for extraction: a training job whose --config file sets num_workers was
    sized as if it had one DataLoader worker, for `submit train` and for --then-train alike."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"num_workers": 3}))
    planned_run(str(tmp_path / "x"), 2)
    assert submit("train", "--dry-run", "--gpus-per-node", "2", "--data", "x", "--out", "d", "--config",
                  str(config)) == 0
    train = sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-train"])
    assert "--cpus-per-task=32" in train and "--mem=68G" in train  # 2 ranks x (4 + 4 x 3), 2 x (24 + 4 + 2 x 3) GiB
    # the loader's budget is what the job holds: a larger one was asked for with 4 GiB (Slurm's limit killed it)
    assert submit("train", "--dry-run", "--gpus-per-node", "2", "--data", "x", "--out", "d", "--memory-budget",
                  "64GiB") == 0
    assert "--mem=176G" in sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-train"])  # 2 x (24 + 64)
    assert submit("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "2", "--out", str(tmp_path / "fresh"),
                  "--then-train", f"--out d --config {config}") == 0
    assert "--cpus-per-task=32" in sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-train"])


@pytest.mark.parametrize("flag", ["--train-while-extracting", "--then-train"])
def test_the_chained_trainers_data_may_name_the_extractions_out_another_way(flag, tmp_path, capsys, monkeypatch):
    """A chained trainer's --data is compared with --out as a store location, not as text: a
    relative path, a trailing slash, file:// and a symlink name the same folder; another one is
    refused. (--then-train took any: its training was chained to an extraction it did not read.)"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    (tmp_path / "runs").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    out = str(tmp_path / "runs" / "a")
    base = ("extract", "--dry-run", "--nodes", "1", "--out", out)
    follow = " --follow" if flag == "--train-while-extracting" else ""
    for data in ("./runs/a", "runs/a/", f"file://{out}", f"{tmp_path}/link/a", f"{tmp_path}/runs/./b/../a", None):
        assert submit(*base, flag, f"--data {data} --out d" if data else "--out d") == 0, data
        train = " ".join(dry_run_scripts(capsys.readouterr().out)["layertap-train"].split())
        assert f"-m layertap.train --data {out} --out d{follow}" in train, data
    assert submit(*base, flag, "--data runs/ab --out d") == 2
    assert f"{flag} '--data runs/ab --out d': its --data runs/ab is not the extraction's --out {out}" \
        in capsys.readouterr().err
    from layertap.slurm.queued import store_location

    assert store_location("s3://b/runs/a/") == store_location("s3://b/runs/a") == store_location("s3://b//runs/a")
    assert store_location("s3://b/") == store_location("s3://b")
    assert len({store_location(u) for u in ("s3://b/runs/a", "s3://b/runs/ab", "s3://c/runs/a", "s3://b")}) == 4
    assert store_location("s3://b/runs/a") != store_location(str(tmp_path / "s3:" / "b" / "runs" / "a"))


def test_the_tasks_log_keeps_a_hash_in_a_store_prefix(tmp_path):
    """`#` (and `?`) are legal in an S3 key prefix and a folder name: the command echoed into the
    task's log keeps such a prefix whole, masking only secrets (a URL's user:password and query,
    keys); a command with nothing secret is shown as it is, and its saved script is not locked."""
    from layertap.slurm.scripts import regenerate_script

    def logged(script: str) -> str:
        lines = script.splitlines()
        run = "\n".join(lines[lines.index("cmd=("):next(i for i, l in enumerate(lines) if l.startswith("echo ")) + 1])
        p = subprocess.run(["bash", "-c", run], capture_output=True, text=True,
                           env={"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "0", "PATH": os.environ["PATH"]})
        return p.stdout

    opts = JobOptions(job_name="r", logs=str(tmp_path))
    plain = extract_script(opts, ArrayPlan(indices=[0]), ["--out", "s3://b/run#1", "--dataset", "file:///d/x?y#z"])
    assert 'shown=("${cmd[@]}")' in plain and "masked" not in plain
    assert "--out s3://b/run#1 --dataset file:///d/x?y#z" in logged(plain)
    secret = regenerate_script(opts, "0", 1, ["--out", "s3://b/run#1?v", "--endpoint", "http://u:pw@h:1/v1?key=k",
                                              "--serve", "vllm serve m --api-key sk-SECRET"])
    log = logged(secret)
    assert "--out s3://b/run#1?v --endpoint http://h:1/v1 " in log and "--api-key ***" in log
    assert not any(s in log for s in ("SECRET", "pw", "key=k"))


def test_then_train_is_refused_while_shards_run_that_no_task_of_the_array_waits_for(tmp_path, capsys, monkeypatch):
    """A static task waits for the running shards of its own range only: shards another array is
    still extracting outside the new array's ranges would be committed after training chained to
    it (afterok) had started, so --then-train is refused, naming the job and the two ways out.
    Dynamic tasks wait for every running shard of the run, so there training is chained."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    prefix = str(tmp_path / "run")
    store = planned_run(prefix, 8)
    holder = {"holder": {"host": "n1", "pid": 7, "rank": 0, "job_id": "4242_0", "token": "t"}}
    for s in range(4):  # task 0 of array 4242, --shards-per-task 4, is extracting shards 0-3
        store.put(layout.lease_key(s, 1, 600), json.dumps(holder).encode())
    store.put(layout.failure_key(6, 1, "t"), b"{}")
    for s in (4, 5, 7):
        store.put(layout.commit_key(s), b"{}")
    base = ("extract", "--dry-run", "--out", prefix, "--max-length", "64")
    then_train = ("--then-train", "--data run --out d")
    assert submit(*base, "--shards-per-task", "4", *then_train) == 2  # task 1 (shards 4-7) only
    err = capsys.readouterr().err
    assert "shards 0-3 are still being extracted by 4242 (live leases), outside the ranges" in err
    assert "Wait for them to finish and run this command again" in err
    # the advice runs as printed (with the Slurm options): --then-train's own arguments, here with their --data
    assert "`layertap submit train --after 4242 --after <the new array's job id> <this command's Slurm options> " \
        "--data run --out d`" in err
    assert not (tmp_path / "layertap-logs").exists()
    # Without training, or with its task's range holding them (task 0: shards 0-7), nothing to refuse.
    assert submit(*base, "--shards-per-task", "4") == 0
    assert "#SBATCH --array=1\n" in capsys.readouterr().out
    assert submit(*base, "--shards-per-task", "8", *then_train) == 0
    assert "--dependency=afterok:<the array's job id>" in capsys.readouterr().out
    assert submit(*base, "--nodes", "1", *then_train) == 0  # dynamic
    assert "--dependency=afterok:<the array's job id>" in capsys.readouterr().out
    # Nothing left but the running shards: no array to chain training to, in either mode.
    store.put(layout.commit_key(6), b"{}")
    for mode in (("--shards-per-task", "4"), ("--nodes", "1")):
        assert submit(*base, *mode, *then_train) == 2
        err = capsys.readouterr().err
        assert "shards 0-3 are still being extracted by 4242 (live leases) and nothing else is left to submit" in err
        assert "`layertap submit train --after 4242 <this command's Slurm options> --data run --out d`" in err


def test_a_trainer_still_queued_for_the_output_is_not_submitted_again(tmp_path, capsys, monkeypatch):
    """The same --then-train command run again while its array and trainer wait in the queue was
    refused (its advice queued a second trainer), and --train-while-extracting queued a second one:
    each training job names its output and kind in its comment, and one squeue shows is left to be.
    A new array beside it is refused where that trainer would not train on it: chained (afterok) to
    earlier jobs, or, beside a --window, one that deletes nothing."""
    from layertap.slurm.queued import tag, training_tag

    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / "run")
    planned_run(prefix, 4)
    out = str(tmp_path / "d")
    bin_ = tmp_path / "bin"
    bin_.mkdir()

    def queued_trainer(follow: bool, deletes: bool) -> None:
        listing = f"77_0|PENDING|Priority|{tag(prefix, None, None)}\n" \
                  f"78|PENDING|Dependency|{training_tag(out, follow, deletes)}\n"
        (bin_ / "squeue").write_text(f"#!/bin/sh\nprintf '{listing}'\n")
        (bin_ / "squeue").chmod(0o755)

    queued_trainer(follow=False, deletes=False)  # a --then-train trainer, afterok on array 77
    monkeypatch.setenv("PATH", str(bin_))
    base = ("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--gpus-per-node", "0", "--nodes", "1")
    for flag in ("--then-train", "--train-while-extracting"):
        assert submit(*base, flag, "--out d") == 0  # the queued task takes the free shards: nothing new
        shown = capsys.readouterr().out
        assert "training job(s) 78 for d are queued or running (squeue)" in shown and "layertap-train.sbatch" not in shown
    assert submit("train", "--dry-run", "--data", "run", "--out", "d") == 0
    assert "nothing to submit: training job(s) 78 for d are queued or running" in capsys.readouterr().out
    # a new array beside it: 78 waits only for array 77, and would train on part of the run
    more = (*base[:-2], "--nodes", "3")
    for flag in ("--then-train", "--train-while-extracting"):
        assert submit(*more, flag, "--out d") == 2
        out_, err = capsys.readouterr()
        assert "training job(s) 78 for this output are chained to earlier extraction jobs (afterok), not to the " \
               "array this would add" in err and "`scancel 78`, then run this command again" in err
        assert "no training job" not in out_  # not said before the refusal
    # a follow trainer takes whatever any array commits: the new array goes ahead, no second trainer
    queued_trainer(follow=True, deletes=True)
    assert submit(*more, "--then-train", "--out d") == 0
    shown = capsys.readouterr().out
    assert "layertap-extract.sbatch" in shown and "layertap-train.sbatch" not in shown and "--dependency" not in shown
    assert submit(*more, "--window", "1GB", "--train-while-extracting", "--out d --delete-consumed") == 0
    assert "sbatch --parsable --dependency=after:78 <script>" in capsys.readouterr().out  # the window's order kept
    queued_trainer(follow=True, deletes=False)  # it would never open the window
    assert submit(*more, "--window", "1GB", "--train-while-extracting", "--out d --delete-consumed") == 2
    assert "training job(s) 78 for this output do not delete what they consume" in capsys.readouterr().err
    # another output: submitted, and its job names it and its kind for the next resubmission
    assert submit("train", "--dry-run", "--data", "run", "--out", "e") == 0
    assert f'#SBATCH --comment="{training_tag(str(tmp_path / "e"), False, False)}"' in capsys.readouterr().out


def test_then_train_with_shards_is_refused_while_the_rest_of_the_run_is_unfinished(tmp_path, capsys, monkeypatch):
    """--shards narrowed every check to its shards: dynamic tasks of --shards 0 ended with shard 0
    committed, training chained to them started and trained on part of the run (the summary even
    read '6 shards: ... 1 pending'). With the rest committed, training is chained as before."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    prefix = str(tmp_path / "run")
    store = planned_run(prefix, 6)
    store.put(layout.lease_key(3, 1, 600), json.dumps({"holder": {"host": "n1", "pid": 7, "rank": 0,
                                                                  "job_id": "4242_0", "token": "t"}}).encode())
    base = ("extract", "--dry-run", "--out", prefix, "--max-length", "64", "--nodes", "1", "--shards", "0")
    then_train = ("--then-train", "--out d")
    assert submit(*base, *then_train) == 2
    err = capsys.readouterr().err
    assert "shards 1-5 of the run, outside --shards, are not committed" in err and "Submit without --shards" in err
    assert submit(*base) == 0  # without training: nothing to refuse
    capsys.readouterr()
    store.delete(layout.lease_key(3, 1, 600))
    for s in range(1, 6):
        store.put(layout.commit_key(s), b"{}")
    assert submit(*base, *then_train) == 0
    assert "--dependency=afterok:<the array's job id>" in capsys.readouterr().out
    # no run yet: the shards outside --shards are not done either (the check above had nothing to read);
    # and --nodes 4 for the one shard of --shards 0 started 3 tasks with nothing to take
    fresh = ("extract", "--dry-run", "--out", str(tmp_path / "fresh"), "--max-length", "64", "--nodes", "4",
             "--shards", "0")
    assert submit(*fresh, *then_train) == 2
    assert "--then-train with --shards: there is no run at" in capsys.readouterr().err
    assert submit(*fresh) == 0
    assert "--array=0\n" in capsys.readouterr().out


def test_submit_refuses_a_fresh_out_that_every_task_would_refuse(tmp_path, capsys, monkeypatch):
    """With no run at --out yet, submit only said the first task would plan it: a prefix holding
    files of one's own or a training output was queued, and every task failed on its first check."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    base = ("extract", "--dry-run", "--max-length", "64", "--nodes", "2")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert submit(*base, "--out", str(tmp_path / "mine")) == 2
    assert "is not empty: it holds objects that are not a layertap run" in capsys.readouterr().err
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "metrics.jsonl").write_text("")
    assert submit(*base, "--out", str(tmp_path / "drafter")) == 2
    assert "holds a training output (`layertap train --out`), not a run" in capsys.readouterr().err
    assert submit(*base, "--out", str(tmp_path / "empty")) == 0
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def dry_run_scripts(out: str) -> dict[str, str]:
    """The scripts a --dry-run printed, by job name."""
    scripts = {}
    for block in out.split("\n----- ")[1:]:
        title, _, body = block.partition("\n")
        scripts[title.split(".sbatch")[0]] = body
    return scripts


def test_cpus_and_memory_are_sized_from_the_job(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # no sinfo: nothing to clip to
    model = tiny_model_dir(tmp_path / "models", "llama", num_layers=2)
    weights, gguf = weight_bytes(model, None)
    assert weights > 0 and not gguf
    fresh = str(tmp_path / "fresh")
    assert submit("extract", "--dry-run", "--nodes", "2", "--gpus-per-node", "8", "--model", model, "--out", fresh,
                  "--then-train", "--out d --num-workers 2") == 0
    scripts = dry_run_scripts(capsys.readouterr().out)
    extract, train = sbatch_options(scripts["layertap-extract"]), sbatch_options(scripts["layertap-train"])
    # Extraction: 8 workers x (8 encode threads + 2); 8 x 16 GiB + the safetensors once (page cache).
    assert "--cpus-per-task=80" in extract and f"--mem={math.ceil((8 * 16 * 2**30 + weights) / 2**30)}G" in extract
    # Training: 8 ranks x (4 + 4 per DataLoader worker); 8 x (24 GiB + the 4 GiB budget + 2 GiB per DataLoader worker).
    assert "--cpus-per-task=96" in train and "--mem=256G" in train
    assert submit("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "2", "--encode-threads", "3",
                  "--out", fresh) == 0
    assert "--cpus-per-task=10" in sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-extract"])
    # Given values win; --mem none asks for none, 0 for all of a node's memory; a wrong unit is refused.
    assert submit("extract", "--dry-run", "--nodes", "1", "--cpus-per-task", "6", "--mem", "0", "--out", fresh) == 0
    opts = sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-extract"])
    assert "--cpus-per-task=6" in opts and "--mem=0" in opts
    assert submit("extract", "--dry-run", "--nodes", "1", "--mem", "none", "--out", fresh) == 0
    assert not any(o.startswith("--mem") for o in sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-extract"]))
    assert submit("extract", "--dry-run", "--nodes", "1", "--mem", "200 GiB", "--out", fresh) == 2
    assert "--mem '200 GiB': give Slurm's form" in capsys.readouterr().err


def test_a_folder_with_both_weight_formats_counts_the_safetensors_transformers_loads(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 5000)  # the same weights, pickled: not loaded
    assert weight_bytes(str(tmp_path), None) == (3000, False)
    (tmp_path / "model.safetensors").unlink()
    assert weight_bytes(str(tmp_path), None) == (5000, False)


def test_gguf_targets_are_dequantized_in_each_workers_memory(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"\0" * (1 << 20))
    assert weight_bytes(str(tmp_path), "m.gguf") == (1 << 20, True)
    res = extract_resources(2, None, str(tmp_path), "m.gguf")
    assert (res.cpus_per_task, res.mem) == (20, f"{math.ceil(2 * (16 * 2**30 + 8 * 2**20) / 2**30)}G")
    assert extract_resources(1, None, "HuggingFaceTB/SmolLM2-135M", None).mem == "16G"  # a hub id: not sized


def test_sinfo_is_read_for_gpus_and_node_sizes():
    out = "cpu|64|256000|(null)\ngpu*|96+|1000000|gpu:h100:8(S:0-1)\ngpu*|128|2000000|gpu:h100:4,mps:400\n"
    assert parse_sinfo(out, None) == NodeShape("gpu", cpus=96, mem_mb=1000000, gpus=8, gres="gpu:h100:8(S:0-1)")
    assert parse_sinfo(out, "cpu") == NodeShape("cpu", cpus=64, mem_mb=256000, gpus=0, gres="")
    assert parse_sinfo(out, "nope") is None
    assert parse_sinfo(out, "cpu").nodes is None  # no node count: none compared
    counted = "gpu*|96|1000000|gpu:h100:8(S:0-1)|12\ngpu*|64|500000|gpu:h100:4|4\n"
    assert parse_sinfo(counted, None).nodes == 16 and parse_sinfo(counted, None).gpus == 8
    fitted, notes = fit(Resources(200, 2000), [parse_sinfo(out, "cpu")])
    assert fitted == Resources(64, 250) and len(notes) == 2 and "asking 64" in notes[0]


def test_a_gpu_partition_needs_gpus_per_node(tmp_path, capsys, monkeypatch):
    """A stand-in `sinfo` reports a GPU partition (the CI cluster has no GPUs): leaving
    --gpus-per-node out would run the job on CPU there, so it is refused with the fix."""
    monkeypatch.chdir(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text("#!/bin/sh\necho 'gpu*|96|1000000|gpu:h100:8(S:0-1)'\n")
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    fresh = str(tmp_path / "fresh")
    assert submit("extract", "--dry-run", "--nodes", "1", "--out", fresh) == 2
    err = capsys.readouterr().err
    assert "partition gpu has GPUs (gpu:h100:8(S:0-1)) but --gpus-per-node is not given" in err
    assert "give --gpus-per-node 8 to use them, or --gpus-per-node 0 to run on CPU" in err
    assert submit("train", "--dry-run", "--data", "x", "--out", "d") == 2
    assert "--gpus-per-node is not given" in capsys.readouterr().err
    assert submit("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "0", "--out", fresh) == 0
    assert "runs on CPU" not in capsys.readouterr().err  # chosen, not defaulted
    assert submit("extract", "--dry-run", "--nodes", "1", "--gpus-per-node", "8", "--out", fresh) == 0
    assert "--gpus-per-node=8" in sbatch_options(dry_run_scripts(capsys.readouterr().out)["layertap-extract"])


def test_a_list_of_partitions_is_checked_and_clipped_against_each(tmp_path, capsys, monkeypatch):
    """`--partition a,b` (sbatch takes a list; the job runs on whichever starts it first): leaving
    --gpus-per-node out is refused when any of them has GPUs, and the sizes are clipped to the
    smallest node of them all, each note naming the partition that sets it. A list with a name
    sinfo does not know is left to sbatch, as one unknown partition is."""
    rows = "cpu*|64|256000|(null)\ngpu|96|1000000|gpu:h100:8(S:0-1)\nsmall|8|65536|(null)\nbig|256|100000|(null)\n"
    monkeypatch.chdir(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    base = ("extract", "--dry-run", "--nodes", "1", "--out", str(tmp_path / "fresh"))
    assert submit(*base, "--partition", "cpu,gpu") == 2
    err = capsys.readouterr().err
    assert "partition gpu has GPUs (gpu:h100:8(S:0-1)) but --gpus-per-node is not given" in err
    assert submit(*base, "--partition", "cpu,small,big") == 0
    out, err = capsys.readouterr()
    assert "--cpus-per-task 10 is more than a node of partition small has: asking 8" in err
    assert "#SBATCH --cpus-per-task=8" in out and "#SBATCH --partition=cpu,small,big" in out
    assert submit(*base, "--partition", "cpu,nope") == 0
    assert "sinfo did not describe the partition: sbatch judges it" in capsys.readouterr().err
    # more GPUs than a node has: 16 processes started for a request sbatch refuses or never schedules
    assert submit(*base, "--partition", "gpu", "--gpus-per-node", "16") == 2
    assert "--gpus-per-node 16: partition gpu has nodes with at most 8 GPU(s) (gpu:h100:8(S:0-1)) (sinfo); give " \
           "--gpus-per-node 8 or fewer" in capsys.readouterr().err
    assert submit(*base, "--partition", "cpu", "--gpus-per-node", "1") == 2
    assert "partition cpu has no GPUs (sinfo); give --gpus-per-node 0" in capsys.readouterr().err
    assert submit(*base, "--partition", "cpu,gpu", "--gpus-per-node", "8") == 0  # gpu has them
    assert submit(*base, "--gpus-per-node", "8") == 2  # no --partition: the default one, cpu
    assert "--gpus-per-node 8: partition cpu has no GPUs" in capsys.readouterr().err
    # ... unless the job goes elsewhere: an --sbatch=--partition, or SBATCH_PARTITION (which sbatch takes first)
    assert submit(*base, "--gpus-per-node", "8", "--sbatch=--partition=gpu") == 0
    monkeypatch.setenv("SBATCH_PARTITION", "gpu")
    assert submit(*base, "--gpus-per-node", "8", "--partition", "cpu") == 0
    monkeypatch.delenv("SBATCH_PARTITION")

    from layertap.slurm.submit import parse_partitions

    assert parse_partitions(rows, "cpu,gpu") == [parse_sinfo(rows, "cpu"), parse_sinfo(rows, "gpu")]
    assert parse_partitions(rows, None) == [parse_sinfo(rows, "cpu")]
    assert parse_partitions(rows, "cpu,nope") == [] and parse_partitions(rows, "nope") == []
    fitted, notes = fit(Resources(200, 2000), parse_partitions(rows, "small,big"))
    assert fitted == Resources(8, 64) and len(notes) == 2
    assert "--cpus-per-task 200 is more than a node of partition small has: asking 8" in notes[0]
    assert "--mem 2000G is more than a node of partition small has: asking 64G" in notes[1]
    assert fit(Resources(200, 2000), parse_partitions(rows, "big,cpu"))[0] == Resources(64, 97)


def test_the_trainers_arguments_are_checked_at_submission(tmp_path, capsys, monkeypatch):
    """--then-train and `submit train` are checked as `layertap train` checks them, before
    anything is submitted: not by a job that fails in the queue after the whole extraction."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    prefix = str(tmp_path / "run")
    planned_run(prefix, 2)
    base = ("extract", "--dry-run", "--nodes", "1", "--out", prefix, "--max-length", "64")
    assert submit("train", "--dry-run", "--out", "d") == 2
    assert "error: missing --data" in capsys.readouterr().err  # --then-train's is the extraction's --out
    for given, message in [("--data run --out d --epochs 0", "--epochs must be >= 1, got 0"),
                           ("--data run --out d --lr -1", "--lr must be positive"),
                           ("--data run --out d --delete-consumed", "--delete-consumed needs --follow")]:
        assert submit(*base, "--then-train", given) == 2, given
        err = capsys.readouterr().err
        assert f"error: --then-train {given!r}: {message}" in err, err
        assert submit("train", "--dry-run", *shlex.split(given)) == 2, given
        assert f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "layertap-logs").exists()
    assert submit(*base, "--then-train", "--data run --out d --epochs 2") == 0
    assert "--epochs 2" in dry_run_scripts(capsys.readouterr().out)["layertap-train"]


def test_submit_train_refuses_data_that_holds_no_run(tmp_path, capsys, monkeypatch):
    """A --data with no run (a typo, an extraction not started) was queued, and the job failed only
    once it left the queue: refused at submission, naming --after and --follow, which wait for a
    run that does not exist yet and are not refused; a folder missing here is only noted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    base = ("train", "--dry-run", "--out", "d")
    (tmp_path / "typo").mkdir()
    assert submit(*base, "--data", "typo") == 2
    err = capsys.readouterr().err
    assert f"error: --data: no run at {tmp_path / 'typo'}" in err and "pass --after <its job id>" in err, err
    assert "with --follow" in err
    # a folder this machine does not have may be mounted on the nodes alone: noted, not refused
    assert submit(*base, "--data", "/nodes-only/run") == 0
    assert "--data /nodes-only/run is no folder on this machine" in capsys.readouterr().err
    assert submit(*base, "--data", "typo", "--after", "41") == 0
    assert submit(*base, "--data", "typo", "--follow") == 0
    planned_run(str(tmp_path / "run"), 2)
    assert submit(*base, "--data", "run") == 0
    assert "#SBATCH" in capsys.readouterr().out
    open_store(str(tmp_path / "bad")).put("manifest.json", b"{not json")
    assert submit(*base, "--data", "bad") == 2
    assert "manifest.json is corrupt" in capsys.readouterr().err
    assert not (tmp_path / "layertap-logs").exists()


def test_train_after_a_job_slurm_does_not_know_is_refused(tmp_path, capsys, monkeypatch, caplog):
    """sbatch drops an afterok on a job it does not know: `--after 99998` (a typo) queued training
    that started at once, and --after also skips the check that --data holds a run."""
    monkeypatch.chdir(tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text('#!/bin/sh\n[ "$4" = 41 ] && { echo "JobId=41 JobState=PENDING"; exit 0; }\n'
                                   'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n')
    (bin_ / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_))
    base = ("train", "--dry-run", "--data", "run", "--out", "d")
    assert submit(*base, "--after", "99998") == 2
    assert "--after 99998: Slurm knows no such job" in capsys.readouterr().err
    assert submit(*base, "--after", "41") == 0
    # where other users' jobs are hidden (PrivateData=jobs), a colleague's job reads as unknown: warned of only
    (bin_ / "scontrol").write_text('#!/bin/sh\n[ "$2" = config ] && { echo "PrivateData = jobs,usage"; exit 0; }\n'
                                   'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n')
    assert submit(*base, "--after", "99998") == 0
    assert "job(s) 99998 are not shown to you, and this cluster hides other users' jobs" in caplog.text


def test_a_training_output_that_holds_a_run_is_refused_at_submission(tmp_path, capsys, monkeypatch):
    """`layertap train --out RUN` refuses an output holding an extraction run, or inside one: at
    submission the job was queued (with --then-train, behind the whole extraction) and failed once
    it started."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    planned_run(str(tmp_path / "run"), 2)
    planned_run(str(tmp_path / "other"), 2)
    assert submit("train", "--dry-run", "--data", "run", "--out", "other") == 2
    assert f"--out {tmp_path / 'other'} holds an extraction run" in capsys.readouterr().err
    assert submit("train", "--dry-run", "--data", "run", "--out", "run/drafter") == 2
    assert "overlap" in capsys.readouterr().err
    assert submit("extract", "--dry-run", "--max-length", "64", "--out", "run", "--then-train",
                  "--out other") == 2
    assert f"--then-train '--out other': --out {tmp_path / 'other'} holds an extraction run" in capsys.readouterr().err
    assert submit("train", "--dry-run", "--data", "run", "--out", "drafter") == 0
    assert not (tmp_path / "layertap-logs").exists()


def test_counts_of_nodes_tasks_and_shards_must_be_at_least_one(tmp_path, capsys, monkeypatch):
    """--nodes -1 printed "every shard is done" (and chained training to nothing), crashed on a
    fresh prefix, or wrote --array=0-4%-2: each count is refused, naming its own flag."""
    from layertap.slurm.command import _nothing_left

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    prefix, fresh = str(tmp_path / "run"), str(tmp_path / "fresh")
    planned_run(prefix, 4)
    base = ("extract", "--dry-run", "--max-length", "64")
    for args, flag, value in [(("--nodes", "-1", "--out", fresh), "--nodes", -1),
                              (("--nodes", "-1", "--out", prefix, "--then-train", "--data run --out d"), "--nodes", -1),
                              (("--nodes", "-2", "--shards-per-task", "2", "--out", prefix), "--nodes", -2),
                              (("--shards-per-task", "0", "--out", prefix), "--shards-per-task", 0),
                              (("--nodes", "1", "--train-nodes", "0", "--out", prefix, "--then-train",
                                "--data run --out d"), "--train-nodes", 0)]:
        assert submit(*base, *args) == 2, args
        assert capsys.readouterr().err.endswith(f"error: {flag} must be at least 1, got {value}\n"), args
    assert submit("train", "--dry-run", "--nodes", "0", "--data", "run", "--out", "d") == 2
    assert "error: --nodes must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "layertap-logs").exists()
    args = argparse.Namespace(parsable=False, dry_run=True)
    assert _nothing_left(args, None, None, []) == 0  # no run: no running shards to name


def test_a_chained_trainer_must_be_given_the_s3_server_the_extractions_config_names(tmp_path, capsys, monkeypatch,
                                                                                    s3_bucket, s3_endpoint):
    """`submit extract --config cfg.json --then-train ...`, the S3 endpoint in cfg.json alone: the
    training job got none of it, and failed in the queue unable to read the run (a secrets walk)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    server = {"s3": {"endpoint_url": s3_endpoint, "addressing_style": "path"}}
    (tmp_path / "cfg.json").write_text(json.dumps({**server, "max_length": 64}))
    (tmp_path / "train.json").write_text(json.dumps(server))
    base = ("extract", "--dry-run", "--nodes", "1", "--config", "cfg.json", "--out", f"s3://{s3_bucket}/chained")
    assert submit(*base, "--then-train", f"--out s3://{s3_bucket}/drafter") == 2
    assert ("--then-train: this command's --config sets the S3 addressing_style, endpoint_url otherwise than the "
            "training job would have it") in capsys.readouterr().err
    assert submit(*base, "--then-train", f"--config train.json --out s3://{s3_bucket}/drafter") == 0
    assert "--config train.json" in capsys.readouterr().out
    # the dataset's objects are listed on that server too (--config's): a glob naming none is refused here
    assert submit(*base, "--dataset", f"s3://{s3_bucket}/data/train-*.parquet") == 2
    assert "names no object on S3 (a glob that matches none)" in capsys.readouterr().err
    # what the job inherits counts as the trainer's store resolves it: the same endpoint and addressing style
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("LAYERTAP_S3_ADDRESSING_STYLE", "path")
    assert submit(*base, "--then-train", f"--out s3://{s3_bucket}/drafter") == 0
    # ... and a region: botocore reads AWS_DEFAULT_REGION (not AWS_REGION), as the trainer's store would
    (tmp_path / "cfg.json").write_text(json.dumps({"s3": {**server["s3"], "region": "eu-west-3"}, "max_length": 64}))
    # a dataset of S3 objects that names none: refused here, as every task would refuse it (none is fetched here)
    assert submit(*base, "--dataset", f"s3://{s3_bucket}/data/train-*.parquet") == 2
    assert "names no object on S3 (a glob that matches none)" in capsys.readouterr().err
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert submit(*base, "--then-train", f"--out s3://{s3_bucket}/drafter") == 2
    assert "sets the S3 region otherwise" in capsys.readouterr().err
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    assert submit(*base, "--then-train", f"--out s3://{s3_bucket}/drafter") == 0


def test_a_dry_run_shows_keys_typed_on_the_command_line_masked(tmp_path, capsys, monkeypatch):
    """A dry run's scripts (pasted into tickets and chats) showed a --serve line's key and an
    --sbatch=--export's secret as typed; the job itself still gets them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    assert submit("regenerate", "--dry-run", "--gpus-per-node", "0", "--dataset", "d.jsonl", "--out",
                  str(tmp_path / "regen"), "--endpoint", "http://127.0.0.1:$LAYERTAP_TASK_PORT/v1", "--model", "m",
                  "--serve", "vllm serve m --port $LAYERTAP_TASK_PORT --api-key sk-LEAK1",
                  "--sbatch=--export=ALL,HF_TOKEN=hf_LEAK2") == 0
    out = capsys.readouterr().out
    assert "keys given on the command line shown as ***" in out and "--api-key ***" in out and "HF_TOKEN=***" in out
    assert "LEAK" not in out


def test_secrets_in_the_command_are_masked_in_the_tasks_log(tmp_path, caplog):
    """The script must run the real command (the server needs its key), but the line each task
    echoes into its Slurm log masks what layertap's own logs mask. The saved script that holds
    them is readable by its owner alone, and the submitter is told to export them instead."""
    from layertap.storage.redact import redacted
    from layertap.slurm.scripts import regenerate_script

    opts = JobOptions(job_name="r", logs=str(tmp_path), gpus_per_node=1)
    serve = "vllm serve /m --port $LAYERTAP_TASK_PORT --api-key sk-SECRET1 --hf-token=hf_SECRET2"
    script = regenerate_script(opts, "0-1", 2, ["--out", "o", "--endpoint", "http://u:pa55w0rd@h:8000/v1?key=k",
                                                "--serve", serve])
    bash_syntax_ok(script, tmp_path)
    lines = script.splitlines()
    run = "\n".join(lines[lines.index("cmd=("):next(i for i, l in enumerate(lines) if l.startswith("echo ")) + 1])
    p = subprocess.run(["bash", "-c", f'{run}\nprintf "%s\\n" "${{cmd[@]}}"'], capture_output=True, text=True,
                       env={"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1", "PATH": os.environ["PATH"]})
    log, *cmd = p.stdout.splitlines()
    assert log.startswith("layertap: Slurm job 7 on ") and "--task 1/2" in log
    assert "--endpoint http://h:8000/v1 " in log and "--api-key *** --hf-token=***" in log
    assert not any(secret in log for secret in ("SECRET", "pa55w0rd", "key=k"))
    assert serve in cmd and "http://u:pa55w0rd@h:8000/v1?key=k" in cmd  # what runs keeps them
    plain = train_script(opts, 1, ["--data", "r", "--out", "d"], None)
    assert 'shown=("${cmd[@]}")' in plain  # nothing to mask: the log shows the command itself

    with caplog.at_level("WARNING"):
        saved = save_script(str(tmp_path / "scripts"), "r", script)
    assert os.stat(saved).st_mode & 0o777 == 0o600 and Path(saved).read_text() == script
    warned = [r.getMessage() for r in caplog.records if saved in r.getMessage()]
    assert len(warned) == 1 and "Export them" in warned[0] and "SECRET" not in warned[0]
    caplog.clear()
    umask = os.umask(0o022)
    try:
        with caplog.at_level("WARNING"):
            kept = save_script(str(tmp_path / "scripts"), "t", plain)
    finally:
        os.umask(umask)
    assert os.stat(kept).st_mode & 0o777 == 0o644 and not caplog.records
    # a key typed into a --setup line or an --sbatch=--export was saved world-readable, unwarned
    for opts_with_key in (JobOptions(job_name="t", logs=str(tmp_path), setup=["export HF_TOKEN=hf_SECRET3"]),
                          JobOptions(job_name="t", logs=str(tmp_path),
                                     sbatch=["--export=ALL,AWS_SECRET_ACCESS_KEY=SECRET4"])):
        with caplog.at_level("WARNING"):
            held = save_script(str(tmp_path / "scripts"), "t", train_script(opts_with_key, 1, ["--data", "r"], None))
        assert os.stat(held).st_mode & 0o777 == 0o600 and "Export them" in caplog.text
        caplog.clear()
    # and options that merely name tokens or keys are not taken for secrets, in the log or here
    vllm = "vllm serve /m --tokenizer /tok --max-num-batched-tokens 8192 --tokenizer-mode auto"
    assert redacted(f"TOKENIZERS_PARALLELISM=false {vllm} --api-key sk-1") == \
        f"TOKENIZERS_PARALLELISM=false {vllm} --api-key ***"


# -- a real cluster ------------------------------------------------------------------------------

def _have_slurm() -> bool:
    return all(shutil.which(b) or os.path.exists(f"/usr/sbin/{b}") for b in ("sbatch", "slurmctld", "slurmd", "munged"))


def running_cluster(tmp_path_factory, nodes: int = 1):
    """A cluster of `nodes` slurmds on localhost (`.ci/slurm.sh`), SLURM_CONF pointing at it while
    the caller's tests run, then stopped: the body of a module's cluster fixture."""
    if not _have_slurm() and os.geteuid() == 0:
        subprocess.run(["bash", str(SLURM_SH), "install"], check=False)
    if not _have_slurm():
        pytest.skip("Slurm is not installed and cannot be here (needs root and apt: `.ci/slurm.sh install`)")
    folder = tmp_path_factory.mktemp(f"slurm{nodes}")
    p = subprocess.run(["bash", str(SLURM_SH), "start", str(folder)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SLURM_NODES": str(nodes)})
    assert p.returncode == 0, p.stdout + p.stderr
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(folder / "slurm.conf")
    yield folder
    subprocess.run(["bash", str(SLURM_SH), "stop", str(folder)], check=False)
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A single-node cluster on localhost, started for these tests and stopped after them."""
    yield from running_cluster(tmp_path_factory)


def scontrol_jobs(job: str) -> list[dict[str, str]]:
    """Every job (array task) of `job`, as scontrol's key=value fields."""
    p = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, check=True)
    return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in p.stdout.splitlines()]


def wait_for(cond, what: str, timeout: float = 240.0, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def job_done(job: str) -> bool:
    p = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
    return p.returncode == 0 and not p.stdout.strip()


def submitted(out: str) -> list[str]:
    return re.findall(r"job (\d+)", out)


def holds_lease(store, shard: int) -> bool:
    return any(store.list(layout.lease_prefix(shard)))


def shard_open(store, shard: int) -> bool:
    """A worker is writing the shard's data: well inside its claim (local stores only)."""
    return bool(store.list_pending_uploads(f"{layout.SHARDS}{shard:06d}"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "llama", num_layers=4)


def test_array_fails_a_task_resubmits_only_it_and_chains_training(slurm_cluster, tiny_llama, tmp_path, capsys,
                                                                  monkeypatch):
    """The issue's whole story on a real cluster: a fresh run planned by its first task; a static
    array in which one task gets the time-limit warning (it requeues itself and resumes) and one
    is scancel'd (its shard fails, the reason shows in `status`); a resubmission of only that
    shard; then training, started by Slurm once the resubmission succeeded (afterok)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # exported to the jobs: two of them share two cores
    data = write_chats(tmp_path / "chats.jsonl", 2280)
    run = str(tmp_path / "run")
    # One forward per sample keeps a shard busy for ~6 s on an idle machine: the signals below land
    # mid-shard even when Slurm takes seconds to pass them on (the warning goes through the batch
    # shell's trap and a second scancel; at ~2 s per shard a loaded CI host saw a shard commit first).
    extract_args = ["--model", tiny_llama, "--dataset", data, "--out", run, "--layers", "1,3", "--max-length", "48",
                    "--batch-tokens", "48", "--shard-bytes", "6MB"]
    store = open_store(run)
    logs = tmp_path / "layertap-logs"

    # 1. A fresh prefix: one dynamic task plans the run and does shard 0.
    # Two tasks share the cluster's one 2-core node: each asks for one CPU and 4 GiB.
    slurm_opts = ["--gpus-per-node", "0", "--cpus-per-task", "1", "--mem", "4G"]
    assert submit("extract", "--nodes", "1", *slurm_opts, *extract_args, "--shards", "0") == 0
    out = capsys.readouterr().out
    assert "no run at" in out and "array of 1 task(s), --array=0:" in out
    first = submitted(out)[0]
    wait_for(lambda: job_done(first), "the planning task")
    assert [j["JobState"] for j in scontrol_jobs(first)] == ["COMPLETED"]
    assert (run_status(store)["shards_total"], run_status(store)["shards_done"]) == (3, 1)

    # 2. Static ranges, one shard per task, at most two at a time: only shards 1 and 2 are left.
    assert submit("extract", "--shards-per-task", "1", "--nodes", "2", *slurm_opts, *extract_args) == 0
    out = capsys.readouterr().out
    assert "3 shards: 1 done, 0 running, 0 failed, 2 pending" in out and "--array=1-2%2" in out
    array = submitted(out)[0]
    # Task 1 gets the time-limit warning: USR1 to the batch shell, as --signal=B:USR1@grace sends it.
    # Task 2 is cancelled: SIGTERM to every process of the job. The two run at once and a shard
    # takes ~6 s when the machine is idle, so both are watched together and each is signalled the
    # moment its shard is open (one after the other, task 2 could finish while task 1 is handled).
    signals = {1: ["scancel", "--batch", "--signal=USR1", f"{array}_1"], 2: ["scancel", f"{array}_2"]}
    sent: dict[int, float] = {}

    def signal_open_shards() -> bool:
        for shard, command in signals.items():
            if shard not in sent and shard_open(store, shard):
                sent[shard] = time.time()
                subprocess.run(command, check=True)
        return len(sent) == len(signals)

    wait_for(signal_open_shards, "tasks 1 and 2 to start writing their shards", every=0.05)
    wait_for(lambda: job_done(f"{array}_2"), "the cancelled task to end", timeout=60)
    stopped_in = time.time() - sent[2]
    # It left the store consistent: of its attempt, only a failure record.
    assert not holds_lease(store, 2) and not shard_open(store, 2)
    assert not any(store.list(f"{layout.SHARDS}000002")) and not store.exists(layout.commit_key(2))
    [f2] = [decode_failure(store.get(o.key), o.key) for o in store.list(f"{layout.FAILURES}000002/")]
    assert f2.preempted and f2.error == "received SIGTERM" and f2.producer["job_id"] == f"{array}_2"

    # The warned task requeued itself; Slurm holds a requeued job back two minutes: release it now.
    warned = wait_for(lambda: [j for j in scontrol_jobs(f"{array}_1") if j.get("Restarts") == "1"
                               and j["JobState"] == "PENDING"], "task 1 to requeue itself")
    # slurmd revokes the first run's credential at one-second resolution: a relaunch within the same
    # second is killed ("Job credential revoked"), so the release waits past it.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={warned[0]['JobId']}", "StartTime=now"], check=True)
    wait_for(lambda: job_done(array), "the array")
    assert {j["ArrayTaskId"]: j["JobState"] for j in scontrol_jobs(array)} == {"1": "COMPLETED", "2": "CANCELLED"}
    [f1] = [decode_failure(store.get(o.key), o.key) for o in store.list(f"{layout.FAILURES}000001/")]
    assert f1.preempted and f1.error == "received SIGTERM"  # the warning, passed on as SIGTERM
    commit1 = decode_commit(store.get(layout.commit_key(1)), layout.commit_key(1))
    assert commit1.producer["job_id"] == f"{array}_1"  # done by the same task, after its requeue
    log1 = (logs / f"layertap-extract-{array}_1.out").read_text()
    assert "requeueing" in log1 and "restart 1" in log1 and log1.count("layertap: exit 143") == 1

    # 3. `layertap status` says which shard was stopped, where and why: not a failure (exit 3, not 4)
    assert cli(["status", run]) == 3  # incomplete, nothing failed
    status_out = capsys.readouterr().out
    assert "2/3 done, 0 running, 0 failed, 0 pending, 1 interrupted" in status_out
    assert "INTERRUPTED shard 2 (stopped on host" in status_out
    assert f"job {array}_2): Preempted: received SIGTERM; a rerun finishes it" in status_out

    # 4. Resubmitting submits only shard 2, and training follows it (afterok).
    drafter = str(tmp_path / "drafter")
    train_args = f"--data {run} --model {tiny_llama} --out {drafter} --steps 3 --batch-size 4 --block-size 4 --max-anchors 8"
    assert submit("extract", "--shards-per-task", "1", *slurm_opts, *extract_args, "--then-train", train_args) == 0
    out = capsys.readouterr().out
    assert "array of 1 task(s), --array=2:" in out
    again, trainer = submitted(out)
    assert [j["ArrayTaskId"] for j in scontrol_jobs(again)] == ["2"]
    wait_for(lambda: job_done(again) and job_done(trainer), "the resubmission and the training", timeout=300)
    assert run_status(store)["complete"] and verify_run(store).bad == []
    train_log = (logs / f"layertap-train-{trainer}.out").read_text()
    assert [j["JobState"] for j in scontrol_jobs(trainer)] == ["COMPLETED"], train_log[-3000:]
    assert scontrol_jobs(trainer)[0]["StartTime"] >= scontrol_jobs(again)[0]["EndTime"]
    assert len(open_store(drafter).get("metrics.jsonl").decode().splitlines()) == 3
    print(f"\n[slurm] a cancelled task ended {stopped_in:.1f} s after scancel")


def test_sbatch_accepts_the_scripts_and_their_resources(slurm_cluster, tmp_path, capsys, monkeypatch):
    """The real Slurm takes both scripts with every option they carry (sbatch --test-only): the
    CPUs and memory sized from the job, clipped to the cluster's node as sinfo describes it."""
    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / "run")
    planned_run(prefix, 2)
    assert submit("extract", "--dry-run", "--nodes", "1", "--partition", "debug", "--time", "1:00:00",
                  "--out", prefix, "--max-length", "64", "--then-train", "--data run --out d --num-workers 1") == 0
    out, err = capsys.readouterr()
    assert "note: no --gpus-per-node: the job runs on CPU\n" in err  # sinfo answered: no GPUs there
    node = parse_sinfo(subprocess.run(["sinfo", "-h", "-o", "%P|%c|%m|%G"], capture_output=True, text=True,
                                      check=True).stdout, "debug")
    assert f"--cpus-per-task 10 is more than a node of partition debug has: asking {node.cpus}" in err
    scripts = dry_run_scripts(out)
    assert f"--cpus-per-task={node.cpus}" in sbatch_options(scripts["layertap-extract"])
    assert f"--mem={min(16, node.mem_mb // 1024)}G" in sbatch_options(scripts["layertap-extract"])
    assert f"--mem={min(28, node.mem_mb // 1024)}G" in sbatch_options(scripts["layertap-train"])
    for name, script in scripts.items():
        path = tmp_path / f"{name}.sbatch"
        path.write_text(script)
        p = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True)
        assert p.returncode == 0 and "to start at" in p.stderr, (name, p.stderr)
    # given values are not sized: no note of clipping what the user did not ask for
    assert submit("extract", "--dry-run", "--nodes", "1", "--partition", "debug", "--cpus-per-task", "1",
                  "--mem", "1G", "--out", prefix, "--max-length", "64") == 0
    out, err = capsys.readouterr()
    assert "is more than a node" not in err
    assert {"--cpus-per-task=1", "--mem=1G"} <= set(sbatch_options(dry_run_scripts(out)["layertap-extract"]))


def test_a_job_runs_in_and_logs_to_a_folder_with_a_space_and_a_quote(slurm_cluster, tmp_path):
    """The real sbatch reads the quoted `#SBATCH` values whole: the job starts in the run folder
    (`my "runs" #1`), its log lands in `logs 100%/` under its name with a space."""
    where = tmp_path / 'my "runs" #1'
    where.mkdir()
    opts = JobOptions(job_name="my job", logs=str(where / "logs 100%"), chdir=str(where), cpus_per_task=1, mem="1G",
                      setup=["pwd > here.txt"])
    script = extract_script(opts, ArrayPlan(indices=[0]), ["--help"])  # the extractor itself, in seconds
    job = sbatch(save_script(os.path.join(opts.logs, "scripts"), opts.job_name, script))
    wait_for(lambda: job_done(job), "the job", timeout=120)
    log = (where / "logs 100%" / f"my job-{job}_0.out").read_text()
    assert "usage: layertap extract" in log and "layertap: exit 0" in log, log[-3000:]
    assert (where / "here.txt").read_text().strip() == str(where)


def test_the_follow_trainer_is_queued_first_and_the_window_array_after_it_starts(slurm_cluster, tmp_path, capsys,
                                                                                   monkeypatch):
    """--train-while-extracting --window on the real Slurm: two jobs, the trainer depending on nothing,
    the array on the trainer's start (`after`): array tasks that filled the window and wait for
    training cannot hold the nodes the trainer waits for. Both are held, the trainer released: the
    array's dependency is met once it runs (both are cancelled then: the run is not the point)."""
    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / "run")
    planned_run(prefix, 2)
    assert submit("extract", "--parsable", "--nodes", "1", "--partition", "debug", "--cpus-per-task", "1",
                  "--mem", "none", "--out", prefix, "--max-length", "64", "--window", "1MB", "--sbatch=--hold",
                  "--train-while-extracting", "--out d --delete-consumed") == 0
    jobs = capsys.readouterr().out.split()
    try:
        assert len(jobs) == 2
        train, array = scontrol_jobs(jobs[0]), scontrol_jobs(jobs[1])
        assert train[0]["JobName"] == "layertap-train" and train[0].get("Dependency") == "(null)"
        assert "--follow" in (tmp_path / "layertap-logs" / "scripts").joinpath(
            next(n for n in os.listdir(tmp_path / "layertap-logs" / "scripts") if n.startswith("layertap-train"))
        ).read_text()
        assert array[0]["JobName"] == "layertap-extract"
        assert array[0]["Dependency"] == f"after:{jobs[0]}(unfulfilled)", array[0]
        subprocess.run(["scontrol", "release", jobs[1]], check=True)  # the array alone: it waits for the trainer
        wait_for(lambda: scontrol_jobs(jobs[1])[0]["Reason"] == "Dependency", "the array to wait on its dependency", 30)
        time.sleep(3)  # a few scheduling passes
        assert [j["JobState"] for j in scontrol_jobs(jobs[1])] == ["PENDING"]
        subprocess.run(["scontrol", "release", jobs[0]], check=True)
        wait_for(lambda: all(j["JobState"] != "PENDING" for j in scontrol_jobs(jobs[1])), "the array to start", 90)
        assert scontrol_jobs(jobs[0])[0]["JobState"] != "PENDING"
    finally:
        subprocess.run(["scancel", *jobs], check=False)

    # The array's sbatch refused (a QOS's MaxSubmitJobs, say): the trainer queued before it would
    # start and wait for an extraction that never comes, holding its nodes until its --time.
    from layertap.slurm import command, submit as slurm_submit

    def refused(*args, **kwargs):
        raise slurm_submit.SlurmError("`sbatch --parsable ...` failed: QOSMaxSubmitJobPerUserLimit")

    monkeypatch.setattr(command, "_submit_array", refused)
    assert submit("extract", "--parsable", "--nodes", "1", "--partition", "debug", "--cpus-per-task", "1",
                  "--mem", "none", "--out", prefix, "--max-length", "64", "--window", "1MB", "--sbatch=--hold",
                  "--train-while-extracting", "--out d --delete-consumed") == 2
    out, err = capsys.readouterr()
    [trainer] = out.split()
    assert f"QOSMaxSubmitJobPerUserLimit; the training job {trainer} submitted before it was cancelled" in err
    wait_for(lambda: scontrol_jobs(trainer)[0]["JobState"] == "CANCELLED", "the trainer to be cancelled", 30)


def test_a_stack_dump_asked_of_a_job_leaves_it_running(slurm_cluster, tiny_llama, tmp_path):
    """`scancel --signal=USR2 JOB`, the documented way to see where a job's processes wait, reached
    the accelerate launcher too, which has no handler for it: it died (exit 140), srun ended the
    step, and the job failed. The step's command ignores USR2 now (layertap's own processes print
    their stacks), and so does the batch shell (`--full`). A follow trainer waiting for its run to
    appear is the job here."""
    prefix = str(tmp_path / "run")  # no run there (yet)
    opts = JobOptions(job_name="dump", logs=str(tmp_path / "logs"), chdir=str(tmp_path), cpus_per_task=1, mem="2G")
    script = train_script(opts, 1, ["--data", prefix, "--model", tiny_llama, "--out", str(tmp_path / "out"),
                                    "--follow"], None)
    job = sbatch(save_script(os.path.join(opts.logs, "scripts"), opts.job_name, script))
    log = tmp_path / "logs" / f"dump-{job}.out"
    try:
        wait_for(lambda: log.exists() and "waiting for extraction" in log.read_text() or job_done(job),
                 "the trainer to wait for data", 180)
        assert not job_done(job), log.read_text()[-3000:]
        for full in ([], ["--full"]):
            before = log.read_text().count("most recent call first")
            subprocess.run(["scancel", "--signal=USR2", *full, job], check=True)
            wait_for(lambda: log.read_text().count("most recent call first") > before, "a stack dump", 30)
        time.sleep(3)
        assert [j["JobState"] for j in scontrol_jobs(job)] == ["RUNNING"], log.read_text()[-3000:]
        assert "layertap: exit" not in log.read_text()
    finally:
        subprocess.run(["scancel", job], check=False)


def test_a_resubmission_while_the_array_waits_in_the_queue_submits_nothing_again(slurm_cluster, tmp_path, capsys,
                                                                               monkeypatch):
    """The array's comment names its run, and squeue lists its pending tasks: submitting the same
    command again while they wait (held here) adds nothing, and a larger --nodes only the rest."""
    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / "run")
    planned_run(prefix, 6)
    base = ("extract", "--gpus-per-node", "0", "--cpus-per-task", "1", "--mem", "1G", "--out", prefix,
            "--max-length", "64")
    assert submit(*base, "--nodes", "2", "--sbatch=--hold") == 0
    [job] = submitted(capsys.readouterr().out)
    try:
        wait_for(lambda: len(scontrol_jobs(job)) >= 1, "the array to be queued", 30)
        assert submit(*base, "--nodes", "2", "--dry-run") == 0
        out = capsys.readouterr().out
        assert f"nothing to submit: 2 task(s) of job {job} are still queued for this run (squeue)" in out
        assert submit(*base, "--nodes", "3", "--dry-run") == 0
        out = capsys.readouterr().out
        assert f"2 task(s) of job {job} are still queued for this run (squeue): 2 take free shards" in out
        assert "#SBATCH --array=0\n" in out
    finally:
        subprocess.run(["scancel", job], check=False)


def test_started_tasks_keep_their_work_and_held_ones_do_not(slurm_cluster, tmp_path, capsys, caplog, monkeypatch):
    """Tasks that run but hold no lease yet (here still in their --setup, as while Python imports
    and the model loads) were not in squeue's pending list nor among the leases: the same command
    submitted their work again. Now they keep it. A task an admin holds (`scontrol hold`) starts
    only if released: its work is submitted again, and the log names it."""
    monkeypatch.chdir(tmp_path)
    prefix, other = str(tmp_path / "run"), str(tmp_path / "other")
    planned_run(prefix, 6)
    planned_run(other, 6)
    base = ("extract", "--gpus-per-node", "0", "--cpus-per-task", "1", "--mem", "1G", "--max-length", "64")
    assert submit(*base, "--out", prefix, "--nodes", "2", "--setup", "sleep 300") == 0
    [job] = submitted(capsys.readouterr().out)
    assert submit(*base, "--out", other, "--nodes", "2", "--sbatch=--hold") == 0
    [held] = submitted(capsys.readouterr().out)
    try:
        wait_for(lambda: [j["JobState"] for j in scontrol_jobs(job)] == ["RUNNING"] * 2, "both tasks to start", 60)
        assert submit(*base, "--out", prefix, "--nodes", "2", "--dry-run") == 0
        assert f"nothing to submit: 2 task(s) of job {job} are still queued or running for this run (squeue; 2 running)" \
            in capsys.readouterr().out

        subprocess.run(["scontrol", "hold", f"{held}_1"], check=True)  # the user's hold on 0, an admin's on 1
        wait_for(lambda: sorted(j["Reason"] for j in scontrol_jobs(held)) == ["JobHeldAdmin", "JobHeldUser"],
                 "task 1 to be held by an admin", 30)
        assert submit(*base, "--out", other, "--nodes", "2", "--dry-run") == 0
        out = capsys.readouterr().out
        assert f"1 task(s) of job {held} are still queued for this run (squeue): 1 takes free shards" in out
        assert "#SBATCH --array=0\n" in out
        assert f"Slurm task(s) {held}_1 queued for the run at {other} are held (JobHeldAdmin)" in caplog.text
    finally:
        subprocess.run(["scancel", job, held], check=False)


def test_a_warned_array_task_stops_and_requeues_itself_alone(slurm_cluster, tmp_path):
    """The time-limit warning's trap signalled and requeued $SLURM_JOB_ID, which for the array task
    that started last is the array's own id, and that id is every task of the array: the others
    were stopped mid-shard, and they and the finished ones went back in the queue. The trap names
    its own task (ARRAY_TASK) now. The warning goes to the task holding the array's id."""
    from layertap.slurm.scripts import _header, _output, _script, _srun

    opts = JobOptions(job_name="warn", logs=str(tmp_path / "logs"), chdir=str(tmp_path), cpus_per_task=1, mem="1G")
    header = _header(opts, ["--array=0-1", "--nodes=1", "--ntasks-per-node=1", _output(opts, "%x-%A_%a.out")])
    script = _script([], header, opts, [], [*_srun(opts, "--nodes=1", "--ntasks=1"), "sleep", "600"], [],
                     requeue_on_timeout=True)
    array = sbatch(save_script(os.path.join(opts.logs, "scripts"), opts.job_name, script))
    running = lambda: (len(jobs := scontrol_jobs(array)) == 2 and all(j["JobState"] == "RUNNING" for j in jobs)  # noqa: E731
                       and jobs)
    try:
        tasks = wait_for(running, "both tasks to run", 120)
        [holder] = [j for j in tasks if j["JobId"] == j["ArrayJobId"] == array]
        [other] = [j for j in tasks if j is not holder]
        time.sleep(1)  # the step started (`sleep` in srun), so the warning has a step to stop
        subprocess.run(["scancel", "--batch", "--signal=USR1", f"{array}_{holder['ArrayTaskId']}"], check=True)
        wait_for(lambda: [j for j in scontrol_jobs(f"{array}_{holder['ArrayTaskId']}") if j.get("Restarts") == "1"],
                 "the warned task to requeue itself", 60)
        time.sleep(2)
        [now] = scontrol_jobs(f"{array}_{other['ArrayTaskId']}")
        assert (now["JobState"], now["Restarts"]) == ("RUNNING", "0"), now
        log = (tmp_path / "logs" / f"warn-{array}_{holder['ArrayTaskId']}.out").read_text()
        assert f"requeueing {array}_{holder['ArrayTaskId']} to resume" in log, log
    finally:
        subprocess.run(["scancel", array], check=False)


def test_two_signals_at_once_leave_the_store_consistent(tiny_llama, tmp_path):
    """Slurm signals every process of a job and a launcher passes signals on too: a worker may get
    SIGTERM twice or more. The first stops it; the others must not break off its cleanup."""
    data = write_chats(tmp_path / "chats.jsonl", 300)
    run = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "layertap", "extract", "--model", tiny_llama, "--dataset", data,
                             "--out", run, "--layers", "1,3", "--max-length", "48", "--batch-tokens", "48",
                             "--shard-bytes", "1500KB", "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    store = open_store(run)
    wait_for(lambda: shard_open(store, 0) or proc.poll() is not None, "the first shard", every=0.02)
    while proc.poll() is None:  # a stream of signals until it has exited
        proc.send_signal(signal.SIGTERM if time.monotonic_ns() % 2 else signal.SIGUSR1)
        time.sleep(0.002)
    err = proc.stderr.read()
    # 143 from the extractor; or, once it has cleaned up and restored the default handlers, a
    # later signal of the stream ended the exiting interpreter.
    assert proc.returncode in (143, -signal.SIGTERM, -signal.SIGUSR1), err[-3000:]
    assert "preempted: shard 0 aborted" in (tmp_path / "logs" / "extract-rank0.log").read_text()
    assert not any(store.list(layout.LEASES)) and store.list_pending_uploads() == []
    [f] = [decode_failure(store.get(o.key), o.key) for o in store.list(layout.FAILURES)]
    assert f.preempted and f.shard == 0


def test_train_jobs_keep_freed_memory_unless_the_submitter_chose_otherwise(tmp_path):
    """The trainer's processes get glibc settings that keep freed buffers mapped (docs/LOADER.md);
    a value exported before submitting (sbatch passes the environment on) is left as it is."""
    script = train_script(JobOptions(job_name="t", logs=str(tmp_path)), 1, ["--data", "r"], None)
    exports = [l for l in script.splitlines() if l.startswith("export MALLOC_")]
    assert len(exports) == 3
    show = '\nprintf "%s\\n" "$MALLOC_ARENA_MAX" "$MALLOC_MMAP_THRESHOLD_" "$MALLOC_TRIM_THRESHOLD_"'
    run = lambda env: subprocess.run(["bash", "-c", "\n".join(exports) + show], capture_output=True, text=True,
                                     env=env).stdout.split()
    assert run({}) == ["1", "1073741824", "1073741824"]
    assert run({"MALLOC_ARENA_MAX": "4"}) == ["4", "1073741824", "1073741824"]


def test_regeneration_array_serves_per_task_and_resubmits_only_unfinished_parts(slurm_cluster, tmp_path, capsys,
                                                                                 monkeypatch):
    """`submit regenerate --tasks 2 --serve ...`: each array task starts its own `transformers serve`
    on its own port, regenerates its share of the parts, and stops the server; a resubmission after
    a part was lost starts only the task that owns it, and one after completion starts nothing."""
    from layertap.manifests.regeneration import done_parts, part_key
    from test_regenerate import STRICT_TEMPLATE, assert_every_row_once, write_sharegpt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tiny_model_dir(tmp_path / "served", "llama", num_layers=2)
    (Path(model) / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    data = write_sharegpt(tmp_path / "chats.jsonl", 16)
    out = str(tmp_path / "regen")
    serve = (f"{sys.executable} -m transformers.cli.transformers serve {model} --device cpu --dtype float32 "
             "--host 127.0.0.1 --port $LAYERTAP_TASK_PORT")
    args = ["regenerate", "--tasks", "2", "--gpus-per-node", "0", "--cpus-per-task", "1", "--mem", "3G",
            "--dataset", data, "--out", out, "--endpoint", "http://127.0.0.1:$LAYERTAP_TASK_PORT/v1", "--model", model,
            "--max-tokens", "8", "--rows-per-part", "4", "--concurrency", "2", "--serve", serve]
    assert submit(*args) == 0
    output = capsys.readouterr().out
    assert "no regeneration at" in output and "array of 2 task(s), --array=0-1" in output
    array = submitted(output)[0]
    wait_for(lambda: job_done(array), "the regeneration array", timeout=300)
    logs = {t: (tmp_path / "layertap-logs" / f"layertap-regenerate-{array}_{t}.out").read_text() for t in (0, 1)}
    assert {j["ArrayTaskId"]: j["JobState"] for j in scontrol_jobs(array)} == {"0": "COMPLETED", "1": "COMPLETED"}, logs
    for t in (0, 1):
        assert f"--task {t}/2" in logs[t] and f"task {t}/2 has 2 parts, 0 done, 2 to do" in logs[t]
        assert "the server answers at http://127.0.0.1:" in logs[t] and "the server stopped" in logs[t]
    assert len(assert_every_row_once(out, 16)) == 16

    # Part 3 (task 1's) lost: only task 1 is submitted again; then nothing is left to submit.
    store = open_store(out)
    store.delete(part_key(3))
    assert submit(*args) == 0
    output = capsys.readouterr().out
    assert "3 of 4 parts done" in output and "array of 1 task(s), --array=1:" in output
    again = submitted(output)[0]
    wait_for(lambda: job_done(again), "the resubmitted task", timeout=300)
    assert [j["ArrayTaskId"] for j in scontrol_jobs(again)] == ["1"]
    assert sorted(done_parts(store)) == [0, 1, 2, 3]
    assert submit(*args) == 0
    assert "nothing to submit: every part is done" in capsys.readouterr().out


def test_submit_meets_what_sbatch_would_refuse_or_misread(tmp_path, capsys, monkeypatch):
    """From a review of the submit paths (each seen with --dry-run, a stand-in sbatch, or sbatch
    --test-only): arrays past MaxArraySize, --window under --then-train (a deadlock), a quoted key
    half masked in the task's log, --sbatch values unquoted, Slurm forms refused (--time 0, --mem
    200g), --cpus-per-task 0 ignored, a '/' in --job-name a traceback; an empty --job-name, --after
    values no job id, values starting with '-' (a second review)."""
    from layertap.storage.redact import redacted
    from layertap.slurm import submit as slurm_submit

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    monkeypatch.setattr(slurm_submit, "max_array_size", lambda: 8)
    prefix = str(tmp_path / "run")
    planned_run(prefix, 20)
    base = ("extract", "--dry-run", "--out", prefix, "--model", "m", "--max-length", "64", "--gpus-per-node", "0")

    assert submit(*base) == 0  # 20 shards, one a task: capped at the cluster's 8, each takes shards until none is left
    assert "#SBATCH --array=0-7" in capsys.readouterr().out
    assert submit(*base, "--nodes", "9") == 2
    assert "--nodes 9 is above this cluster's MaxArraySize of 8" in capsys.readouterr().err
    assert submit("regenerate", "--dry-run", "--dataset", "d.jsonl", "--out", str(tmp_path / "regen"), "--endpoint",
                  "http://h:1", "--model", "m", "--tasks", "9") == 2
    assert "--tasks 9 is above this cluster's MaxArraySize of 8" in capsys.readouterr().err
    assert submit(*base, "--window", "1GB", "--then-train", f"--data {prefix} --out {tmp_path / 'dr'}") == 2
    assert "--window with --then-train" in capsys.readouterr().err

    assert submit(*base, "--time", "0", "--mem", "200g", "--cpus-per-task", "2", "--sbatch=--comment=my run") == 0
    out = capsys.readouterr().out
    assert "#SBATCH --mem=200g" in out and '#SBATCH --comment="my run"' in out and "#SBATCH --cpus-per-task=2" in out
    assert submit(*base, "--cpus-per-task", "0") == 2
    assert "--cpus-per-task must be at least 1, got 0" in capsys.readouterr().err
    assert submit(*base, "--job-name", "a/b") == 2
    assert "give a name (without '/')" in capsys.readouterr().err
    assert submit(*base, "--job-name=") == 2  # logs named "-12.out" before
    assert "--job-name '': give a name" in capsys.readouterr().err
    for grace in ("0", "70000"):  # sbatch's --signal takes 0-65535, and 0 warns no one
        assert submit(*base, "--grace", grace) == 2
        assert f"--grace {grace}: give the seconds before the time limit" in capsys.readouterr().err
    # sbatch said only "Job dependency problem", after the script was saved
    assert submit("train", "--dry-run", "--after", "5", "--after", "5 6", "--data", prefix, "--out", "d") == 2
    assert "--after '5 6': give a Slurm job id (123, or 123_4" in capsys.readouterr().err
    # a value starting with '-' in a submit's options: argparse said only "expected one argument"
    with pytest.raises(SystemExit):
        submit(*base, "--layers", "-1,3")
    assert "(a value that starts with '-' must be attached with '=': --layers=VALUE)" in capsys.readouterr().err
    # ... but not a value with a space that no option's prefix matches: without abbreviations argparse
    # takes it for the value (it read `--data=...` as an abbreviation of --dataset, and said so)
    assert submit(*base, "--then-train", f"--data={prefix} --out d") == 0
    assert f"-m layertap.train --data {prefix} --out d" in " ".join(capsys.readouterr().out.split())

    assert redacted("vllm serve m --api-key 'sk live 123' --port 8") == "vllm serve m --api-key *** --port 8"
    assert redacted('x --hf-token="a b" y') == "x --hf-token=*** y"


def test_forwarded_values_that_start_with_a_dash_stay_values():
    """The job script's command line is parsed again on the compute node, hours later: a value
    such as `--model=-ckpt` forwarded as `--model -ckpt` would be read there as an option."""
    from layertap.slurm.command import tool_argv

    p = argparse.ArgumentParser()
    actions = [p.add_argument("--model"), p.add_argument("--temperature", type=float),
               p.add_argument("--tags", nargs="+")]
    given = ["--model=-ckpt", "--temperature=-0.5", "--tags", "a", "b"]
    args = p.parse_args(given)
    argv = tool_argv(args, actions)
    assert argv == ["--model=-ckpt", "--temperature=-0.5", "--tags", "a", "b"]
    assert p.parse_args(argv) == args


def test_a_regeneration_resubmitted_with_other_settings_is_refused_at_submission(tmp_path, capsys, monkeypatch):
    """The array was sized from the recorded recipe and queued; every task then refused the other
    model or sampling at its start. Refused at submission now, naming each difference."""
    from layertap.manifests.regeneration import RECIPE, Recipe

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    out = str(tmp_path / "regen")
    recorded = Recipe(dataset={"path": "/d.jsonl", "fingerprint": "f", "rows": 40, "limit": None}, model="m",
                      sampling={"temperature": 0.0, "top_p": 1.0, "max_tokens": 8, "seed": None,
                                "chat_template_kwargs": None}, rows_per_part=10)
    open_store(out).put(RECIPE, json.dumps(recorded.to_json()).encode())
    base = ("regenerate", "--dry-run", "--tasks", "4", "--gpus-per-node", "0", "--dataset", "d.jsonl", "--out", out,
            "--endpoint", "http://h:1", "--rows-per-part", "10", "--temperature", "0")
    assert submit(*base, "--model", "m", "--max-tokens", "8") == 0
    assert "regeneration at" in capsys.readouterr().out
    assert submit(*base, "--model", "other", "--max-tokens", "9") == 2
    err = capsys.readouterr().err
    assert "already holds a regeneration made differently: model: output has 'm', now 'other'; max_tokens: output " \
           "has 8, now 9; every task would refuse it" in err
    # another dataset, where this host reads it: every task refused it in the queue (its fingerprint)
    from layertap.extract.fingerprint import dataset_fingerprint

    other = write_chats(tmp_path / "other.jsonl", 3)
    assert submit(*base[:7], other, *base[8:], "--model", "m", "--max-tokens", "8") == 2
    assert "already holds a regeneration (of /d.jsonl) made differently: dataset fingerprint: output has 'f', now " \
           f"{dataset_fingerprint(other, None)!r}; every task would refuse it" in capsys.readouterr().err


def test_queued_static_tasks_and_waiting_workers_cost_their_shares_not_shards_times_tasks(monkeypatch):
    """Each remaining shard was tested against each queued static task's range (and each waiting
    worker's): 31 s and 55 s at 100,000 shards and 1,000 tasks. Now each task walks its own share:
    the answers are the same as shard by shard, at ~one test per shard."""
    todo = [s for s in range(10_000) if s % 7]  # some done already
    queued = [QueuedTask(f"9_{i}", 50, None, given_up=frozenset({i * 50 + 1})) for i in range(0, 200, 2)]
    queued += [QueuedTask("8_0", 0, frozenset(range(3, 30, 3))), QueuedTask("8_1", 0, None)]
    remaining = Remaining(run_id="r", total=10_000, selected=None, done=0, running=[], failed=[], interrupted=[],
                          todo=todo, leases={})
    calls = []
    owns = QueuedTask.owns
    monkeypatch.setattr(QueuedTask, "owns", lambda self, s: calls.append(s) or owns(self, s))
    out = leave_to_queued(remaining, queued)
    assert len(calls) <= len(todo) + len(queued)
    monkeypatch.undo()
    expected = [s for s in todo if any(t.owns(s) for t in queued if t.shards_per_task)]
    assert out.queued_for == expected and out.queued == len(queued) and out.queued_dynamic == 2
    assert within(todo, [[5, 9], [8, 15], [9_990, 20_000]]) == \
        [s for s in todo if 5 <= s <= 15 or s >= 9_990]


def test_only_an_arrays_first_task_prints_the_runs_report(tiny_llama, tmp_path, capsys, monkeypatch):
    """Every array task printed the whole `status` report at its end: each lists every commit and
    tally marker (~190 LIST pages at 100,000 shards), and 1,000 tasks end together. The others now
    say in one line what their last scan found; the first task's log has the report."""
    import layertap.extract.run as extract_run

    data = write_chats(tmp_path / "chats.jsonl", 12)
    out = str(tmp_path / "run")
    argv = ["extract", "--model", tiny_llama, "--dataset", data, "--out", out, "--log-dir", str(tmp_path / "logs"),
            "--max-length", "64", "--shard-bytes", "8KB"]
    reports = []
    real = extract_run.run_status
    monkeypatch.setattr(extract_run, "run_status", lambda store: reports.append(1) or real(store))
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert cli(argv) == 0
    text = capsys.readouterr().out
    assert not reports and re.search(r"\n(\d+) of the run's \1 shards committed when this array task ended "
                                     r"\(every shard is done\): task 0's log ends with a report of the run", text), text
    assert cli(argv) == 0 and not reports  # a task of a later array, the run done before it started
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    assert cli(argv) == 0 and reports == [1] and "COMPLETE" in capsys.readouterr().out
