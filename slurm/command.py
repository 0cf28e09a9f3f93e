"""`layertap submit extract|regenerate|train [Slurm options] <the arguments of that command>`.

The tool's own options are added to the submit parser as they are, so a command line that runs
locally becomes a Slurm submission by putting `submit` in front of it, and its mistakes are
caught here rather than in the queue an hour later.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shlex
import sys
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from layertap.slurm.queued import store_location
from layertap.storage.errors import ConfigError

if TYPE_CHECKING:
    from layertap.slurm.resources import NodeShape

ToolParser = Callable[[Any], None]


class _Forwarded:
    """Stands in for a parser while a tool's `add_<tool>` adds its options, and keeps them, so the
    job's command line can be rebuilt from the parsed values."""

    def __init__(self, group: Any, skip: frozenset[str] = frozenset()):
        self.group, self.skip, self.actions = group, skip, []

    def add_argument(self, *names: str, **kw: Any) -> argparse.Action | None:
        longest = max(names, key=len)
        if kw.get("dest", longest.lstrip("-").replace("-", "_")) in self.skip:
            return None
        action = self.group.add_argument(*names, **kw)
        self.actions.append(action)
        return action


def tool_argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The tool's command line for the values the user gave (options left at None are omitted)."""
    out: list[str] = []
    for a in actions:
        value = getattr(args, a.dest, None)
        if value is None or value is False or value == a.default:
            continue
        flag = max(a.option_strings, key=len) if a.option_strings else None
        values = [str(v) for v in value] if isinstance(value, list) else [] if a.nargs == 0 else [str(value)]
        if flag and len(values) == 1 and values[0].startswith("-") and not isinstance(value, list):
            out.append(f"{flag}={values[0]}")  # `--flag -x` would read -x as an option on the compute node
        else:
            out += ([flag] if flag else []) + values
    return out


def _train_parser() -> ToolParser | None:
    """`layertap train`'s option builder, or None where this installation has no trainer."""
    try:
        return importlib.import_module("layertap.train.command").add_train
    except (ImportError, AttributeError):
        return None


def add_submit(p: argparse.ArgumentParser) -> None:
    from layertap.extract.command import add_extract

    sub = p.add_subparsers(dest="submit_kind", required=True, metavar="JOB")
    e = sub.add_parser("extract", help="an extraction array sized to the run's unfinished shards",
                       description="Submit `layertap extract` as a Slurm job array: one task per node, its GPUs "
                                   "through accelerate, only as many tasks as the unfinished shards need. Rerun "
                                   "the same command after failures or preemptions: it submits only what is left.")
    _add_slurm_options(e, "layertap-extract")
    g = e.add_argument_group("the array")
    g.add_argument("--nodes", type=int, help="at most N nodes (array tasks) at once. Dynamic: N tasks, or fewer if "
                                             "the remaining shards cannot keep them busy; with --shards-per-task: "
                                             "the array's %%N cap (default: ceil(remaining shards / worker processes "
                                             "per node); required when the run has no manifest yet)")
    g.add_argument("--shards-per-task", type=int, metavar="K",
                   help="static ranges: task i does shards [i*K, (i+1)*K) of the run, and only tasks with unfinished "
                        "shards are started (default: dynamic, every task takes any free shard through leases)")
    g.add_argument("--then-train", metavar="ARGS",
                   help="then submit `layertap train ARGS` (one quoted string; its --data is this --out), started "
                        "only if every array task succeeds (afterok); it takes this command's Slurm options, and "
                        "--train-nodes")
    g.add_argument("--train-while-extracting", metavar="ARGS",
                   help="also submit `layertap train --follow ARGS` (one quoted string; its --data is this --out), "
                        "with no dependency: it trains on shards as they are committed, starting before or during "
                        "the extraction. With --window, ARGS must hold --delete-consumed. It takes this command's "
                        "Slurm options, and --train-nodes (docs/SLURM.md)")
    g.add_argument("--train-nodes", type=int, default=1,
                   help="nodes for --then-train or --train-while-extracting (default 1)")
    fwd = _Forwarded(e.add_argument_group("layertap extract arguments (--log-dir is set per task under --logs)"),
                     frozenset({"log_dir"}))
    add_extract(fwd)
    e.set_defaults(_tool_actions=fwd.actions)

    r = sub.add_parser("regenerate", help="a regeneration array: each task its share of the output's parts",
                       description="Submit `layertap regenerate` as a Slurm job array: task i of --tasks N takes the "
                                   "parts p with p % N == i, through its own server (--serve, started in the task "
                                   "on the task's GPUs) or a shared --endpoint. Rerun the same command after failures "
                                   "or preemptions: it submits only the tasks with unfinished parts.")
    _add_slurm_options(r, "layertap-regenerate")
    g = r.add_argument_group("the array")
    g.add_argument("--tasks", type=int, default=1, help="array tasks sharing the parts (default 1); keep it the same "
                                                        "on resubmission")
    g.add_argument("--max-parallel", type=int, metavar="N", help="at most N tasks at once (the array's %%N)")
    fwd = _Forwarded(r.add_argument_group("layertap regenerate arguments"), frozenset({"task"}))
    importlib.import_module("layertap.extract.regenerate_command").add_regenerate(fwd)
    r.set_defaults(_tool_actions=fwd.actions)

    t = sub.add_parser("train", help="a multi-node training job",
                       description="Submit `layertap train` on N nodes: srun starts one accelerate launcher per "
                                   "node, rendezvous from the Slurm environment; a requeued job resumes.")
    _add_slurm_options(t, "layertap-train")
    g = t.add_argument_group("the job")
    g.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    g.add_argument("--after", action="append", metavar="JOBID", default=[],
                   help="start only once this job (every task of an array) succeeded; repeatable")
    add_train = _train_parser()
    fwd = _Forwarded(t.add_argument_group("layertap train arguments"))
    if add_train is not None:
        add_train(fwd)
    t.set_defaults(_tool_actions=fwd.actions)


def _add_slurm_options(p: argparse.ArgumentParser, job_name: str) -> None:
    g = p.add_argument_group("Slurm")
    g.add_argument("--partition", help="sbatch --partition")
    g.add_argument("--account", help="sbatch --account")
    g.add_argument("--qos", help="sbatch --qos")
    g.add_argument("--time", help="time limit per job or array task, e.g. 4:00:00 (a task stopped by it is "
                                  "requeued and resumes)")
    g.add_argument("--gpus-per-node", type=int,
                   help="GPUs per node; 0 runs on CPU. Required when the partition has GPUs (sinfo tells); "
                        "elsewhere the default is 0")
    g.add_argument("--procs-per-node", type=int, help="worker processes per node (default: one per GPU, else 1)")
    g.add_argument("--cpus-per-task", type=int,
                   help="CPUs of each node's task (default: sized from the job: extract, per worker, its encode "
                        "threads (--encode-threads, default 8) + 2; train, per rank, 4 + 4 per DataLoader process: "
                        "--num-workers, at least 1, as with 0 the rank loads itself; at most a node's)")
    g.add_argument("--mem", help="memory per node, Slurm's units (G = GiB), e.g. 200G; 0 = all of the node's; "
                                 "none = ask for none (the site's default). Default: sized from the job (docs/SLURM.md)")
    g.add_argument("--job-name", default=job_name, help=f"(default {job_name})")
    g.add_argument("--logs", default="layertap-logs",
                   help="folder for Slurm's output files, per-task logs and the submitted scripts "
                        "(default ./layertap-logs)")
    g.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run before the environment is activated, e.g. 'module load cuda/12.4'; "
                        "repeatable")
    g.add_argument("--env-activate", metavar="LINE",
                   help="the shell line that activates layertap's environment on the nodes (default: `source "
                        "<the virtual environment layertap runs in>/bin/activate`, if it runs in one; none: no line). "
                        "The job uses this host's paths: a filesystem shared with the nodes is assumed")
    g.add_argument("--python", metavar="PATH",
                   help=f"the interpreter on the nodes (default: this one, {sys.executable})")
    g.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="any other sbatch option, e.g. --sbatch=--exclusive; repeatable")
    g.add_argument("--grace", type=int, default=120, metavar="SECONDS",
                   help="warn the workers (USR1, passed on as SIGTERM) this long before the time limit (default 120)")
    g.add_argument("--dry-run", action="store_true", help="print the scripts and what would be submitted; submit nothing")
    g.add_argument("--parsable", action="store_true", help="print only the job ids, one a line (for scripts)")


def run_submit(args: argparse.Namespace) -> int:
    if not args.dry_run:
        from layertap.slurm.submit import require

        require("sbatch")
    if args.submit_kind == "extract":
        return _submit_extract(args)
    if args.submit_kind == "regenerate":
        return _submit_regenerate(args)
    return _submit_train(args)


_MEM = re.compile(r"^\d+([KMGT]B?)?$", re.IGNORECASE)  # sbatch takes 200G, 200g and 200GB alike


def _job_options(args: argparse.Namespace, gpus: int, sized, nodes: list[NodeShape], **changes: Any):
    """The job's options: the user's, and CPUs and memory `sized` from the job where not given
    (clipped to a node of each partition that sinfo describes)."""
    from layertap.slurm.resources import fit
    from layertap.slurm.scripts import JobOptions, default_activation

    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task must be at least 1, got {args.cpus_per_task}")
    if not 1 <= args.grace <= 65535:  # sbatch's --signal takes 0-65535 s; 0 is no warning, and a stop needs one
        raise ConfigError(f"--grace {args.grace}: give the seconds before the time limit to warn the workers, 1 to "
                          "65535 (default 120)")
    if "/" in args.job_name or args.job_name.strip() in ("", ".", ".."):  # it names files in the logs folder too
        raise ConfigError(f"--job-name {args.job_name!r}: give a name (without '/'), e.g. layertap-train")
    mem = args.mem
    if mem is not None and mem.lower() != "none" and not _MEM.match(mem):
        raise ConfigError(f"--mem {mem!r}: give Slurm's form, a number with an optional K, M, G or T (or KB ... TB; "
                         "binary units: 200G is 200 GiB), 0 for all of a node's memory, or none")
    procs = args.procs_per_node or max(gpus, 1)
    need = sized(procs)  # only what is sized is clipped and noted: given values go to sbatch as they are
    given_cpus = args.cpus_per_task is not None
    fitted, notes = fit(dataclasses.replace(need, cpus_per_task=0 if given_cpus else need.cpus_per_task,
                                            mem_gib=0 if mem is not None else need.mem_gib), nodes)
    for note in notes:
        _note(note)
    env = args.env_activate if args.env_activate is not None else default_activation()
    opts = JobOptions(job_name=args.job_name, logs=args.logs, partition=args.partition, account=args.account,
                      qos=args.qos, time=args.time, gpus_per_node=gpus, procs_per_node=args.procs_per_node,
                      cpus_per_task=args.cpus_per_task if given_cpus else fitted.cpus_per_task,
                      mem=fitted.mem if mem is None else None if mem.lower() == "none" else mem,
                      python=args.python or sys.executable, env_activate=None if env in (None, "none") else env,
                      setup=args.setup, sbatch=args.sbatch, grace_s=args.grace)
    return dataclasses.replace(opts, **changes) if changes else opts


def _job_partition(args: argparse.Namespace) -> str | None:
    """The partition the job goes to as sbatch reads it: SBATCH_PARTITION (sbatch's environment
    overrides a script's #SBATCH lines), else an --sbatch=--partition (written after --partition),
    else --partition; None: the cluster's default. The default partition's nodes say nothing of a
    job sent elsewhere."""
    if os.environ.get("SBATCH_PARTITION"):
        return os.environ["SBATCH_PARTITION"]
    for option in reversed(args.sbatch):
        for flag in ("--partition=", "-p="):
            if option.startswith(flag):
                return option[len(flag):]
    return args.partition


def _gpus_per_node(args: argparse.Namespace, nodes: list[NodeShape]) -> int:
    """--gpus-per-node, or 0 with a note; refused when a partition of `nodes` has GPUs (sinfo says
    so): a GPU partition's nodes running on CPU by omission would waste the allocation."""
    if args.gpus_per_node is not None:
        if args.gpus_per_node > 0 and nodes and all(n.gpus < args.gpus_per_node for n in nodes):
            # sbatch refuses it, or leaves it pending for good: the job's processes are sized by it
            most = max(nodes, key=lambda n: n.gpus)
            has = f"nodes with at most {most.gpus} GPU(s) ({most.gres})" if most.gpus else "no GPUs"
            raise ConfigError(f"--gpus-per-node {args.gpus_per_node}: partition {most.partition} has {has} (sinfo); "
                              + (f"give --gpus-per-node {most.gpus} or fewer" if most.gpus else
                                 "give --gpus-per-node 0 to run on CPU, or --partition a GPU partition"))
        return args.gpus_per_node
    if (node := next((n for n in nodes if n.gpus), None)) is not None:
        raise ConfigError(f"partition {node.partition} has GPUs ({node.gres}) but --gpus-per-node is not given, so "
                         f"the job would run on CPU: give --gpus-per-node {node.gpus} to use them, or "
                         "--gpus-per-node 0 to run on CPU")
    _note("no --gpus-per-node: the job runs on CPU" +
          ("" if nodes else " (sinfo did not describe the partition: sbatch judges it)"))
    return 0


def _extract_config(args: argparse.Namespace):
    """The extraction's settings exactly as each task will read them (config file, then flags)."""
    from layertap.extract.config import load_config

    return load_config(args)


def _encode_threads(args: argparse.Namespace) -> int | None:
    """The workers' --encode-threads as they will read it: the flag, else the --config file's; None
    where neither gives it. Not the loaded settings' value: left out, each worker takes its share of
    its node's CPUs, which this host cannot know (`extract_resources` reckons it at most)."""
    from layertap.extract.config import ExtractConfig
    from layertap.storage.flags import settings

    return settings(ExtractConfig, args).get("encode_threads")


def _submit_extract(args: argparse.Namespace) -> int:
    from layertap.extract.regenerated import pinned_template, template_kwargs
    from layertap.manifests.manifest import NoRun, refuse_new_run_here
    from layertap.slurm import submit
    from layertap.slurm.queued import (leave_to_queued, lease_jobs, listed_jobs, queued_tasks, squeue_listing,
                                       started, without_dead_holders)
    from layertap.slurm.queued import tag as queue_tag
    from layertap.slurm.scripts import extract_script
    from layertap.slurm.work import dynamic_plan, remaining_work, static_plan
    from layertap.storage.store import open_configured_store

    from layertap.slurm.resources import extract_resources
    from layertap.slurm.submit import partition_shapes

    _at_least_one(args, "nodes", "shards_per_task", "train_nodes")
    nodes = partition_shapes(_job_partition(args))
    gpus = _gpus_per_node(args, nodes)
    cfg = _extract_config(args)
    _check_inputs_here(cfg)
    threads = _encode_threads(args)
    opts = _job_options(args, gpus, lambda procs: extract_resources(procs, threads, cfg.model, cfg.gguf_file), nodes)
    if args.shards_per_task is not None and cfg.shards is not None:
        raise ConfigError("give either --shards (the shards dynamic tasks may take) or --shards-per-task "
                         "(static ranges over the unfinished shards), not both")
    if args.then_train is not None and args.train_while_extracting is not None:
        raise ConfigError("give either --then-train (training after the array succeeded) or --train-while-extracting "
                          "(training alongside it), not both")
    if args.then_train is not None and cfg.window is not None:
        raise ConfigError("--window with --then-train: the array would wait, its window full, for a trainer that starts "
                          "only once the array has finished; train alongside it instead (--train-while-extracting "
                          "'... --delete-consumed'), or leave out --window")
    listing = squeue_listing()
    train, trainers, no_trainer = _then_train(args, gpus, nodes, cfg, listing) if args.then_train is not None else \
        _then_train(args, gpus, nodes, cfg, listing, follow=True) if args.train_while_extracting is not None else \
        (None, [], None)
    # the chat-template settings its tasks render with: one a task would refuse is refused here
    cfg.chat_template_kwargs = template_kwargs(cfg.dataset, cfg.chat_template_kwargs, cfg.s3)
    _check_template_settings(cfg)
    store = open_configured_store(cfg.out, cfg.s3)
    location = store_location(cfg.out)
    queued = queued_tasks(location, listing or "")
    try:
        remaining = remaining_work(store, cfg.shards, _pinned_settings(cfg), lambda run: pinned_template(cfg, run),
                                   lambda: _dataset_fingerprint(cfg, cfg.s3),
                                   slurm_jobs=listed_jobs(listing) if listing is not None else None)
        jobs = lease_jobs(store, remaining) if listing is not None else {}  # no squeue: no task queued either
        if listing is not None:
            remaining = without_dead_holders(remaining, jobs, listing)
        remaining = leave_to_queued(remaining, started(store, remaining, queued, jobs))
        _say(args, f"run {remaining.run_id} at {store.uri}: {remaining.summary()}")
    except NoRun:
        remaining = None
        refuse_new_run_here(store)  # what every task would refuse at its start
        if args.shards_per_task is not None:  # before the line that says the tasks will plan it
            raise ConfigError(f"static ranges need the run's plan, and there is no run at {store.uri} yet: write it "
                              "with `layertap plan <these extract arguments>`, or submit without --shards-per-task "
                              "(the tasks plan it and share shards through leases)")
        # no plan to weigh them against: each queued task that may take some of these shards counts
        queued = [t for t in queued if t.shards is None or cfg.shards is None or t.shards & set(cfg.shards)]
        _say(args, f"no run at {store.uri} yet: the first task to start plans it"
                   + (f"; {len(queued)} task(s) of {_jobs_of(queued)} are {_queued_or_running(queued)} for it "
                      "(squeue)" if queued else ""))
    if args.shards_per_task is not None:
        plan = static_plan(remaining, args.shards_per_task, args.nodes, submit.max_array_size())
        if args.shards_per_task < opts.procs:
            _say(args, f"note: {args.shards_per_task} shard(s) per task keep at most that many of a node's "
                       f"{opts.procs} workers busy")
    else:
        plan = dynamic_plan(remaining, args.nodes, opts.procs, submit.max_array_size(), cfg.shards,
                            queued=remaining.queued_dynamic if remaining is not None else len(queued))
    if args.then_train is not None and train is not None:  # none needed (complete, at work, queued): no chain
        chained = _chained(args, cfg)
        if cfg.shards is not None:
            _training_needs_the_rest(store, cfg, planned=remaining is not None, train_args=chained)
        if remaining is not None:
            _training_waits_for_the_run(store, remaining, plan, chained)
        elif queued:
            after = " ".join(f"--after {t}" for t in sorted({t.array for t in queued}))
            raise ConfigError(f"{len(queued)} task(s) of {_jobs_of(queued)} are {_queued_or_running(queued)} for this "
                              "run (squeue): training chained to this submission (--then-train) would start without "
                              f"waiting for them. Submit this without --then-train, then `layertap submit train {after} "
                              f"--after <the new array's job id, if any> {chained}`")
    if plan.indices:
        _check_queued_trainers(trainers, cfg, len(plan.indices), alongside=args.train_while_extracting is not None)
    if no_trainer:
        _say(args, no_trainer)
    if not plan.indices:
        return _nothing_left(args, remaining, train, queued)
    if remaining is not None and remaining.waited_for:
        _say(args, f"{_waiting_text(remaining)}: left to them; this array is for the other "
                   f"{len(remaining.free)} shard(s)")
    if remaining is not None and remaining.queued:
        if args.shards_per_task is not None and remaining.queued_dynamic:
            # static ranges cannot leave dynamic tasks a share: both take the free shards, the leases keep each once
            _say(args, f"{_queued_text(remaining)}: the static ranges of this array cover the free shards beside "
                       f"those dynamic tasks, which take some of them first (each is done once; `scancel "
                       f"{' '.join(remaining.queued_jobs)}` not to hold nodes for both)")
        else:
            _say(args, f"{_queued_text(remaining)}: left to them; this array is for the rest")
    tag = queue_tag(location, args.shards_per_task, cfg.shards)
    script = extract_script(opts, plan, tool_argv(args, args._tool_actions), tag)
    what = f"extraction array of {len(plan.indices)} task(s), --array={plan.spec}"
    if train and args.train_while_extracting is not None and cfg.window is not None:
        # The array fills the window, then waits for training to free it: had its tasks taken the
        # nodes the trainer needs (a busy or small partition), neither would move again. So the
        # trainer is queued first, and the array starts once it has started (Slurm's `after`).
        if args.dry_run:
            trainer = None
            _show(f"{train[0].job_name}.sbatch", [], train[1])
        else:
            trainer = _sbatch_train(args, *train, after=[])
        try:
            _submit_array(args, opts, script, what, after_start=[trainer or "<the training job's id>"])
        except submit.SlurmError as e:  # a follow trainer of no extraction would hold its nodes until its --time
            if trainer is None:
                raise
            why = submit.cancel(trainer)
            raise submit.SlurmError(f"{e}; the training job {trainer} submitted before it was "
                                    + ("cancelled" if why is None else f"NOT cancelled ({why}): scancel it")) from None
        return 0
    # a follow trainer of the output already queued: the window's array starts once it has (as below)
    waits = [t.job for t in trainers] if args.train_while_extracting is not None and cfg.window is not None else []
    job = _submit_array(args, opts, script, what, after_start=waits or None)
    if train:
        alongside = args.train_while_extracting is not None
        if job is None:  # a dry run
            after = [] if alongside else ["<the array's job id>"]
            _show(f"{train[0].job_name}.sbatch", submit.dependency_options(after), train[1])
        else:
            _sbatch_train(args, *train, after=[] if alongside else [job])
    return 0


def _submit_array(args: argparse.Namespace, opts, script: str, what: str,
                  after_start: list[str] | None = None) -> str | None:
    """Submit an array's script (its job id), or with --dry-run show it (None); with
    `after_start`, to start once those jobs have started."""
    from layertap.slurm import submit

    if args.dry_run:
        _show(f"{opts.job_name}.sbatch: {what}", submit.dependency_options([], after_start), script)
        return None
    job = submit.submit_script(os.path.join(opts.logs, "scripts"), opts.job_name, script, after_start=after_start)
    when = f", to start once job(s) {', '.join(after_start)} have started" if after_start else ""
    _say(args, f"submitted {what}{when}: job {job}; logs {opts.logs}/{opts.job_name}-{job}_<task>.out", job)
    return job


def _submit_regenerate(args: argparse.Namespace) -> int:
    """The array's tasks that still have parts to do (all of them for a new output)."""
    from layertap.extract.regenerate import load_regenerate_config
    from layertap.manifests.regeneration import Recipe, done_parts, read_recipe
    from layertap.slurm import submit
    from layertap.slurm.resources import regenerate_resources
    from layertap.slurm.queued import regeneration_tag
    from layertap.slurm.scripts import ArrayPlan, regenerate_script
    from layertap.storage.store import open_store

    _at_least_one(args, "tasks", "max_parallel")
    cfg = load_regenerate_config(args)  # checked here, not in the queue
    nodes = submit.partition_shapes(_job_partition(args))
    gpus = _gpus_per_node(args, nodes) if cfg.serve else (args.gpus_per_node or 0)
    opts = _job_options(args, gpus, lambda procs: regenerate_resources(gpus, bool(cfg.serve)), nodes,
                        procs_per_node=1)
    if args.tasks > (cap := submit.max_array_size()):
        raise ConfigError(f"--tasks {args.tasks:,} is above this cluster's MaxArraySize of {cap:,} array tasks: give "
                          f"at most {cap:,}")
    store = open_store(cfg.out)
    recipe = read_recipe(store)
    if recipe is None:  # its tasks may be starting (the recipe waits for the server's answer)
        _say(args, f"no regeneration at {store.uri} yet: the first task to start records its recipe")
        indices = _not_running(args, store, list(range(args.tasks)))
        if not indices:
            return 0
    else:
        # What every task would refuse at its start (`regenerate`), refused here: the dataset too, where
        # this host reads it (its file hashed, as each task would)
        fingerprint = _dataset_fingerprint(cfg)
        asked = Recipe(dataset={**recipe.dataset, "limit": cfg.limit, **({"fingerprint": fingerprint} if fingerprint
                                                                          else {})},
                       model=cfg.model, sampling=cfg.sampling(), rows_per_part=cfg.rows_per_part)
        if diffs := recipe.differences(asked):
            made = f" (of {recipe.dataset['path']})" if fingerprint and recipe.dataset.get("path") else ""
            raise ConfigError(f"{store.uri} already holds a regeneration{made} made differently: {'; '.join(diffs)}; "
                              "every task would refuse it. Submit with its settings to continue it, or choose another "
                              "--out")
        done = done_parts(store)
        left = [p for p in range(recipe.parts) if p not in done]
        indices = sorted({p % args.tasks for p in left})
        _say(args, f"regeneration at {store.uri}: {len(done):,} of {recipe.parts:,} parts done")
        if not indices:
            _say(args, "nothing to submit: every part is done")
            return 0
        indices = _not_running(args, store, indices)
        if not indices:
            return 0
    spec = ArrayPlan(indices=indices, max_parallel=args.max_parallel).spec
    script = regenerate_script(opts, spec, args.tasks, tool_argv(args, args._tool_actions),
                               regeneration_tag(store_location(cfg.out), args.tasks))
    _submit_array(args, opts, script, f"regeneration array of {len(indices)} task(s), --array={spec}")
    return 0


def _not_running(args: argparse.Namespace, store, indices: list[int]) -> list[int]:
    """The tasks of `indices` neither at work now (`regeneration.live_tasks`) nor still queued in
    Slurm (`queued.queued_regeneration`): a resubmission beside them would answer their parts
    twice. A split other than --tasks at work or queued is refused."""
    from layertap.manifests.regeneration import live_tasks
    from layertap.slurm.queued import queued_regeneration
    from layertap.slurm.scripts import compress

    live = live_tasks(store)
    # a running task holding its task's lease is at work, told below; one holding none yet is starting
    queued = [q for q in queued_regeneration(store_location(store.uri)) if q[:2] not in live]
    if other := sorted({n for _, n in live} - {args.tasks}):
        raise ConfigError(f"a regeneration split into {other[0]} tasks is at work on {store.uri} now: its parts and "
                          f"--tasks {args.tasks}'s overlap and would be answered twice. Submit with --tasks {other[0]} "
                          "(its running tasks are left out), or once it has ended")
    if other := sorted({n for _, n, _ in queued} - {args.tasks}):
        jobs = ", ".join(sorted({j for _, n, j in queued if n == other[0]}))
        raise ConfigError(f"a regeneration split into {other[0]} tasks is queued or starting for {store.uri} (Slurm "
                          f"job {jobs}): its parts and --tasks {args.tasks}'s overlap and would be answered twice. "
                          f"Submit with --tasks {other[0]} (its queued tasks are left out), or scancel it first")
    waiting = sorted(i for i, _, _ in queued if i in indices)
    if waiting:
        jobs = ", ".join(sorted({j for i, _, j in queued if i in waiting}))
        _say(args, f"task(s) {compress(waiting)} are still queued or starting (Slurm job {jobs}): left out"
                   + ("; nothing to submit" if len(waiting) == len(indices) else ""))
        indices = [i for i in indices if i not in waiting]
    running = sorted(i for i, _ in live if i in indices)
    if running:
        jobs = sorted({str(h.holder.get("slurm_job")) for (i, _), h in live.items() if i in running} - {"None"})
        by = f" (Slurm job {', '.join(jobs)})" if jobs else ""
        what = f"task {running[0]} is" if len(running) == 1 else f"tasks {compress(running)} are"
        _say(args, f"{what} at work now{by}: left out"
                   + ("; nothing to submit" if len(running) == len(indices) else "")
                   + " (a lease of a task killed elsewhere goes stale within a minute: submit again then)")
    return [i for i in indices if i not in running]


def _nothing_left(args: argparse.Namespace, remaining, train, queued) -> int:
    from layertap.slurm.scripts import compress

    # a trainer submitted after it (--then-train after a complete run, --train-while-extracting): "nothing to
    # submit" then read as false
    nothing = "no extraction task to submit" if train else "nothing to submit"
    if remaining is None and queued:
        _say(args, f"{nothing}: {len(queued)} task(s) of {_jobs_of(queued)} are {_queued_or_running(queued)} "
                   "for this run (squeue), as many as --nodes asks for")
    elif remaining is not None and remaining.queued:
        _say(args, f"{nothing}: {_queued_text(remaining)}")
    elif remaining is not None and remaining.waited_for:
        # A window run is paced by its training: more tasks would only hold GPUs to wait beside these.
        _say(args, f"{nothing}: {_waiting_text(remaining)} (`layertap status` says whether the "
                   "trainer runs). To change --window, stop them (scancel their jobs) and submit again")
    elif remaining is not None and remaining.running:
        run = remaining.running
        _say(args, f"{nothing}: " + (f"shard {run[0]} is" if len(run) == 1 else f"shards {compress(run)} are")
                   + " running under live leases, every other one is done")
    else:
        _say(args, f"{nothing}: every shard is done")
    if train:  # after a complete run, or alongside the running one (--train-while-extracting)
        if args.dry_run:
            _show(f"{train[0].job_name}.sbatch", [], train[1])
        else:
            _sbatch_train(args, *train, after=[])
    return 0


def _check_queued_trainers(trainers: list, cfg, tasks: int, alongside: bool) -> None:
    """Refuse a new array of `tasks` tasks beside training jobs already queued for the chained
    output (`QueuedTrainer`s) that would not train on it: one chained to earlier jobs (afterok, not
    --follow) could start before this array's shards are committed and train on part of the run;
    beside a --window, one that does not delete what it consumes would never open the window."""
    chained = [t.job for t in trainers if not t.follow]
    if chained:
        raise ConfigError(f"training job(s) {', '.join(chained)} for this output are chained to earlier extraction "
                          f"jobs (afterok), not to the array this would add ({tasks} task(s)): training could start "
                          f"before its shards are committed and train on part of the run. `scancel "
                          f"{' '.join(chained)}`, then run this command again (its trainer then waits for this array)")
    keeps = [t.job for t in trainers if not t.deletes]
    if alongside and cfg.window is not None and keeps:
        raise ConfigError(f"training job(s) {', '.join(keeps)} for this output do not delete what they consume (no "
                          f"--delete-consumed), so the --window this array holds to would never open again. `scancel "
                          f"{' '.join(keeps)}`, then run this command again")


def _chained(args: argparse.Namespace, cfg) -> str:
    """The arguments of the `layertap submit train` that a refused --then-train advises: its own,
    with --data (which --then-train sets to --out), after this command's Slurm options (which it
    takes too: left for the user to copy, not rebuilt here)."""
    given = args.then_train or ""
    data = "" if re.search(r"(^|\s)--data(\s|=|$)", given) else f"--data {shlex.quote(cfg.out)} "
    return f"<this command's Slurm options> {data}{given}".rstrip()


def _training_needs_the_rest(store, cfg, planned: bool, train_args: str) -> None:
    """Refuse --then-train with --shards while shards outside them are unfinished: training chained
    to this array would start once its own shards are committed, and train on part of the run
    (the checks of `_training_waits_for_the_run` see only the shards of --shards). Without a run
    yet (`planned` False), none is done."""
    from layertap.slurm.scripts import compress
    from layertap.slurm.work import remaining_work

    if not planned:
        raise ConfigError(f"--then-train with --shards: there is no run at {store.uri} yet, so the shards outside "
                          "--shards are not done, and training chained to this array would start once those of "
                          "--shards are committed, and train on part of the run. Submit without --shards (every "
                          "shard), or plan the run first (`layertap plan <these extract arguments>`) and submit "
                          f"each part, then `layertap submit train --after <their job ids> {train_args}`")

    whole = remaining_work(store, None, _pinned_settings(cfg))
    mine = set(cfg.shards)
    outside = sorted(s for s in [*whole.todo, *whole.running] if s not in mine)
    if outside:
        raise ConfigError(f"shards {compress(outside)} of the run, outside --shards, are not committed: training "
                          "chained to this array (--then-train) would start once the shards of --shards are, and "
                          "train on part of the run. Submit without --shards (every unfinished shard), or submit "
                          "each part, then `layertap submit train --after <their job ids> <the --then-train "
                          "arguments>`")


def _waiting_text(remaining) -> str:
    """'3 extraction worker(s) of 1234 wait behind the full storage window to take shards 4-9 as training consumes'."""
    from layertap.slurm.scripts import compress

    return (f"{remaining.waiting} extraction worker(s) of {', '.join(remaining.waiting_jobs)} wait behind the full "
            f"storage window to take shards {compress(remaining.waited_for)} as training consumes")


def _jobs_of(queued) -> str:
    """'jobs 41, 42' (or 'job 41'): the array jobs of `queued` tasks."""
    return _jobs_text(sorted({t.array for t in queued}))


def _jobs_text(arrays: list[str]) -> str:
    return ("job " if len(arrays) == 1 else "jobs ") + ", ".join(arrays)


def _queued_or_running(queued) -> str:
    """'queued', or where some of `queued` tasks have started, 'queued or running'."""
    return "queued or running" if any(t.running for t in queued) else "queued"


def _queued_text(remaining) -> str:
    """'3 task(s) of 1234 are still queued for this run (squeue): shards 4-9 are theirs, and 2 take free shards'
    ('queued or running (squeue; 1 running)' where some have started: `queued.started`)."""
    from layertap.slurm.scripts import compress

    theirs = ([f"shard {remaining.queued_for[0]} is theirs"] if len(remaining.queued_for) == 1 else
              [f"shards {compress(remaining.queued_for)} are theirs"]) if remaining.queued_for else []
    n = remaining.queued_dynamic
    dynamic = [f"{n} take{'s' if n == 1 else ''} free shards"] if n else []
    where = f"queued or running for this run (squeue; {remaining.queued_running} running)" \
        if remaining.queued_running else "queued for this run (squeue)"
    return f"{remaining.queued} task(s) of {_jobs_text(remaining.queued_jobs)} are still {where}: " \
           f"{' and '.join(theirs + dynamic)}"


def _training_waits_for_the_run(store, remaining, plan, train_args: str) -> None:
    """Refuse --then-train while shards are running that no task of `plan` waits for (another
    array's, outside this one's static ranges; or all of them, with nothing to submit), or that
    workers waiting behind a storage window will take: training chained to this submission
    (afterok) would start while they are still being extracted, and train on what was committed
    by then."""
    from layertap.slurm.scripts import compress
    from layertap.slurm.work import lease_holders, not_waited_for

    if remaining.queued:
        after = " ".join(f"--after {j}" for j in remaining.queued_jobs)
        raise ConfigError(f"{_queued_text(remaining)}: training chained to this submission (--then-train) would start "
                          "without waiting for them. Submit this without --then-train, then `layertap submit train "
                          f"{after} --after <the new array's job id, if any> {train_args}`")
    if remaining.waited_for:
        raise ConfigError(f"{_waiting_text(remaining)}: training chained to this submission (--then-train) would "
                          "start before they are done, and they are done only as training consumes. Train alongside "
                          f"them: `layertap submit train --follow --delete-consumed {train_args}` "
                          "(no --after)")

    running = not_waited_for(remaining, plan)
    if not running:
        return
    holders = lease_holders(store, remaining, running)
    jobs = [h for h in holders if h.isdigit()]
    after = " ".join(f"--after {j}" for j in jobs) or "--after <the running extraction's job id>"
    what = (f"shards {compress(running)} are still being extracted"
            + (f" by {', '.join(holders)}" if holders else "") + " (live leases)")
    if not plan.indices:
        raise ConfigError(f"{what} and nothing else is left to submit, so there is no array to chain training to "
                          f"(--then-train): submit it with `layertap submit train {after} {train_args}`, or wait for "
                          "them to finish and run this command again")
    raise ConfigError(f"{what}, outside the ranges of the tasks this command would submit: training chained to "
                      "them (--then-train) would start before those shards are committed. Wait for them to finish "
                      "and run this command again, or submit it without --then-train and then `layertap submit "
                      f"train {after} --after <the new array's job id> {train_args}`")


def _then_train(args: argparse.Namespace, gpus: int, nodes: list[NodeShape], extraction, listing: str | None,
                follow: bool = False) -> tuple[tuple[Any, str] | None, list, str | None]:
    """The training job to chain to the extraction (its settings, `extraction`): `--then-train`
    parsed (and so checked) by `layertap train`'s parser, its --data the extraction's --out; with
    `follow`, `--train-while-extracting`'s, made a follow trainer of it. None where no trainer is
    needed, with why (`_no_trainer_needed`: said once the submission's checks passed); and the
    training jobs squeue's `listing` shows for its output (`QueuedTrainer`s)."""
    from layertap.slurm.queued import queued_training, training_tag
    from layertap.slurm.scripts import train_script

    flag = "--then-train" if not follow else "--train-while-extracting"
    given = args.then_train if not follow else args.train_while_extracting
    add_train = _train_parser()
    if add_train is None:
        raise ConfigError(f"{flag}: `layertap train` is not available in this installation (no train.command)")
    # no -h: its help would print and exit 0 with nothing submitted, which a --parsable caller reads as success
    parser = argparse.ArgumentParser(prog="layertap train", exit_on_error=False, add_help=False, allow_abbrev=False)
    fwd = _Forwarded(parser)
    add_train(fwd)
    try:
        targs, extra = parser.parse_known_args(shlex.split(given))
    except (argparse.ArgumentError, ValueError) as e:  # ValueError: shlex's, e.g. an unbalanced quote
        raise ConfigError(f"{flag} {given!r}: {e}") from None
    if extra:
        raise ConfigError(f"{flag} {given!r}: `layertap train` does not take {' '.join(extra)}")
    _read_the_extraction(targs, extraction, f"{flag} {given!r}")
    _fits_the_partition("--train-nodes", args.train_nodes, nodes)
    ranks = _Ranks("--train-nodes", args.train_nodes, args.procs_per_node or max(gpus, 1))
    train_cfg = _follow_the_extraction(targs, extraction, given, ranks) if follow else \
        _train_config(targs, f"{flag} {given!r}: ", ranks)
    _check_s3_reaches_the_trainer(extraction, train_cfg, flag)
    where = store_location(train_cfg.out)
    queued = queued_training(where, listing or "")
    if (why := _no_trainer_needed(train_cfg, queued)) is not None:
        return None, queued, f"{why}: no training job"
    topts = _train_options(args, gpus, train_cfg, nodes, job_name="layertap-train")
    if follow and extraction.window is not None:
        _check_window(extraction, train_cfg, args.train_nodes * topts.procs)
    tag = training_tag(where, train_cfg.follow, train_cfg.delete_consumed, store_location(train_cfg.data))
    return (topts, train_script(topts, args.train_nodes, tool_argv(targs, fwd.actions), _resume_flag(fwd.actions),
                                tag)), queued, None


def _check_s3_reaches_the_trainer(extraction, train_cfg, flag: str) -> None:
    """Refuse a chained trainer that would not reach the run's S3 server as the extraction does: the
    extraction's --config "s3" settings are its own (the trainer takes only what --then-train gives;
    an extraction's config file holds settings `layertap train` refuses), and a trainer without them
    failed in the queue, unable to read the run. Both sides resolved as their stores will (`server_of`:
    the LAYERTAP_S3_* and AWS_* variables the job inherits too)."""
    from layertap.storage.s3 import server_of
    from layertap.storage.store import s3_options

    if not str(train_cfg.data).startswith("s3://"):
        return
    ours, theirs = server_of(s3_options(extraction.s3)), server_of(s3_options(train_cfg.s3))
    differ = sorted(k for k in ours if ours[k] != theirs[k])
    if differ:  # values not shown: an endpoint may hold a password
        raise ConfigError(f"{flag}: this command's --config sets the S3 {', '.join(differ)} otherwise than the "
                          f"training job would have it (it reads {train_cfg.data} with its own --config and the "
                          f"environment): give it a --config of its own with the same \"s3\" settings in {flag} "
                          "(e.g. --config train.json)")


def _train_options(args: argparse.Namespace, gpus: int, cfg, nodes: list[NodeShape], **job: Any):
    """A training job's options: its CPUs and memory per process from the loader's workers and
    byte budget (`train_resources`), whether it trains alone or after an extraction."""
    from layertap.slurm.resources import train_resources

    return _job_options(args, gpus, lambda procs: train_resources(procs, cfg.num_workers, cfg.memory_budget), nodes,
                        **job)


def _no_trainer_needed(cfg, queued: list) -> str | None:
    """Why a resubmission of the same command queues no trainer for the output `cfg.out`: training
    jobs for it are queued or running (`queued`, from squeue: each names its output in its comment),
    it is complete (every step trained, the drafter exported), or a trainer writes to it now (a
    second would be refused at its start). One that holds checkpoints is resumed by the job (the
    script passes --resume)."""
    from layertap.manifests.train_output import training_status
    from layertap.storage.store import StoreError, open_configured_store

    if queued:  # asked first: an output unreadable from here (other credentials) is still known to squeue
        return (f"training job(s) {', '.join(t.job for t in queued)} for {cfg.out} are queued or running "
                "(squeue); `scancel` them first to submit another")
    try:
        status = training_status(open_configured_store(cfg.out, cfg.s3))
    except StoreError:  # unreadable from here (no bucket yet, other credentials): the job will tell
        return None
    if status and status["complete"]:
        return f"the training at {cfg.out} is complete (its drafter is exported)"
    if status and (h := status["trainer"]):
        job = f"Slurm job {h['slurm_job']}, " if h["slurm_job"] else ""
        return (f"a trainer is writing to {cfg.out} now ({job}pid {h['pid']} on {h['host']}); a second would be "
                "refused while it runs")
    return None


def _data_is_a_run(cfg) -> None:
    """Refuse a --data that holds no run (a typo, or an extraction not started yet): the job would
    fail only once it leaves the queue. Not asked with --follow (it waits for the run) or --after
    (the run may come from the job it waits for). What the nodes may see otherwise is only noted: a
    folder not here (mounted on the nodes alone), a store unreadable from here, a manifest of a
    newer layertap than this one."""
    from layertap.manifests.manifest import NoRun, UnsupportedVersion, load_manifest
    from layertap.storage.local import LocalStore
    from layertap.storage.store import StoreError, open_configured_store

    store = open_configured_store(cfg.data, cfg.s3)
    if isinstance(store, LocalStore) and not os.path.isdir(store.root):
        _note(f"--data {store.root} is no folder on this machine: the job looks for the run on its nodes")
        return
    try:
        load_manifest(store)
    except NoRun as e:
        raise ConfigError(f"--data: {e}; to queue training behind the extraction that makes it, pass --after "
                          "<its job id>, or train while it runs with --follow") from None
    except (StoreError, UnsupportedVersion) as e:
        _note(f"--data could not be checked from here ({e}): the job will")


def _check_window(cfg, train_cfg, ranks: int) -> None:
    """Warn (on stderr, at submission) of a --window below `window_floor`: the run may stall for
    good once the consumers' shuffle buffers and batches pin the shards that fill the window."""
    from layertap.manifests.consumption import window_shortfall

    largest = _largest_planned_shard(cfg)
    why = window_shortfall(cfg.window, ranks, train_cfg.num_workers, train_cfg.shuffle_buffer, train_cfg.batch_size,
                           largest or cfg.shard_bytes, train_cfg.grad_accum, planned=largest is not None)
    if why is not None:
        print(f"warning: {why}", file=sys.stderr)


def _read_the_extraction(targs: argparse.Namespace, cfg, where: str) -> None:
    """A chained trainer's --data is the extraction's --out (given, or set to it): one naming
    another run was chained to an extraction it does not read, and trained on that other run
    (or, a typo, failed once the whole extraction was done)."""
    if targs.data is not None and store_location(targs.data) != store_location(cfg.out):
        raise ConfigError(f"{where}: its --data {targs.data} is not the extraction's --out {cfg.out}: leave --data "
                          "out (it is set to --out)")
    targs.data = cfg.out


def _check_template_settings(cfg) -> None:
    """Refuse chat-template settings the target's template never reads (a misspelt name), as each
    task would at its start, where the target's folder is readable from here (its tokenizer alone)."""
    if not cfg.chat_template_kwargs or not cfg.model or not os.path.isfile(os.path.join(cfg.model, "config.json")):
        return
    from transformers import AutoTokenizer

    from layertap.extract.inputs import check_template_kwargs

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    except Exception:  # noqa: BLE001 - a best effort: the tasks say what is wrong with it, as they load the model
        return
    check_template_kwargs(tokenizer, cfg.chat_template_kwargs)


def _largest_planned_shard(cfg) -> int | None:
    """The largest shard of the run at --out where it is planned already (its plan is fixed: a
    resubmission's --shard-bytes, the default when left out, does not cut it again), else None."""
    from layertap.manifests.manifest import NoRun, UnsupportedVersion, load_manifest
    from layertap.storage.store import StoreError, open_configured_store

    try:
        return load_manifest(open_configured_store(cfg.out, cfg.s3)).largest_shard_bytes
    except (NoRun, UnsupportedVersion, StoreError):
        return None


def _follow_the_extraction(targs: argparse.Namespace, cfg, given: str, ranks: _Ranks):
    """`--train-while-extracting`'s trainer: --follow, and, when the extraction holds to a
    --window, --delete-consumed (else the window never opens again and the extraction waits
    forever). Checked as `layertap train` will check it; its settings."""
    targs.follow = True
    train_cfg = _train_config(targs, f"--train-while-extracting {given!r}: ", ranks)
    if cfg.window is not None and not train_cfg.delete_consumed:
        raise ConfigError(f"--window with --train-while-extracting {given!r}: the trainer must delete what it has "
                          "consumed, or the window never opens again and the extraction waits forever; add "
                          "--delete-consumed to --train-while-extracting (or leave out --window)")
    return train_cfg


class _Ranks(NamedTuple):
    """A training job's processes: `nodes` (given as `flag`) x `procs` per node."""
    flag: str
    nodes: int
    procs: int


def _fits_the_partition(flag: str, nodes: int, shapes: list[NodeShape]) -> None:
    """A training job runs on all of its nodes at once: one asking more than its partition has (sinfo)
    waited in the queue for good (PartitionConfig), and a resubmission was told it was queued."""
    counts = [s.nodes for s in shapes]
    if shapes and None not in counts and nodes > max(counts):
        have = ", ".join(f"partition {s.partition} has {s.nodes} node(s)" for s in shapes)
        raise ConfigError(f"{flag} {nodes}: {have} in all (sinfo), and a training job runs on all of its "
                          f"nodes at once: it would wait in the queue for good; give {flag} {max(counts)} or fewer")


def _train_config(targs: argparse.Namespace, context: str = "", ranks: _Ranks | None = None):
    """The trainer's settings, checked now as `layertap train` will check them in the job: a bad
    one fails here, not in the queue after the extraction it waits for. `context` prefixes the
    error (which of this command's flags holds the arguments); `ranks`: the job's processes, which
    a resumed checkpoint must have been written by."""
    from layertap.manifests.train_output import check_apart
    from layertap.storage.store import StoreError, open_configured_store
    from layertap.train.config import load_train_config

    try:
        cfg = load_train_config(targs)
        out = open_configured_store(cfg.out, cfg.s3)
        if cfg.data is not None:  # an --out that holds a run, or overlaps it: refused by the job, in the queue
            check_apart(out, open_configured_store(cfg.data, cfg.s3))
        _check_resumable_here(out, cfg, ranks)
    except ConfigError as e:
        raise ConfigError(f"{context}{e}") from None
    except StoreError as e:
        _note(f"the training output could not be checked from here ({e}): the job will")
    return cfg


def _check_resumable_here(out, cfg, ranks: _Ranks | None) -> None:
    """A job resumes --out's latest checkpoint (its script passes --resume): settings that differ from
    it, or another number of processes (`ranks`), are refused here, as the job would refuse them in the
    queue (its extraction array, started beside it, then filled its window and waited for good)."""
    from layertap.manifests.train_output import EXPORT_CONFIG

    # a fresh output (the usual case: torch not imported), or a complete one (nothing is submitted:
    # `_no_trainer_needed` says so); checkpoints/ holds latest.json too
    if next(iter(out.list("checkpoints/")), None) is None or out.exists(EXPORT_CONFIG):
        return
    from layertap.train.checkpoint import load_latest
    from layertap.train.trainer import check_resume_settings

    ckpt = load_latest(out, tensors=False)
    if ckpt is None:
        return
    check_resume_settings(ckpt.state, cfg)
    world = ckpt.state.get("world_size")
    if ranks is not None and ranks.nodes > 0 and ranks.procs > 0 and world != ranks.nodes * ranks.procs:
        raise ConfigError(f"--out {cfg.out} holds a checkpoint written by {world} process(es), which the job "
                          f"resumes, and it would run {ranks.nodes * ranks.procs} ({ranks.flag} {ranks.nodes} x "
                          f"{ranks.procs} per node): the data order depends on it; give a node and process count "
                          "(--procs-per-node) that make the checkpoint's, or train anew into another --out")


def _at_least_one(args: argparse.Namespace, *names: str) -> None:
    """Node, task and shard counts: 0 or fewer would size an empty array or a %-2 cap, not fail."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


_JOB_ID = re.compile(r"\d+(_\d+)?")


def _submit_train(args: argparse.Namespace) -> int:
    from layertap.slurm import submit
    from layertap.slurm.queued import queued_training, training_tag
    from layertap.slurm.scripts import train_script
    from layertap.slurm.submit import dependency_options, partition_shapes

    if _train_parser() is None:
        raise ConfigError("`layertap train` is not available in this installation (no train.command)")
    _at_least_one(args, "nodes")
    if bad := [job for job in args.after if not _JOB_ID.fullmatch(job)]:  # sbatch said only "Job dependency problem"
        raise ConfigError(f"--after {bad[0]!r}: give a Slurm job id (123, or 123_4 for one task of an array), one per "
                          "--after")
    if unknown := submit.unknown_jobs(args.after):
        raise ConfigError(f"--after {', '.join(unknown)}: Slurm knows no such job (a typo, or a job that ended longer "
                          "ago than the cluster's MinJobAge, which Slurm then forgets): sbatch would drop the "
                          "dependency and start the training at once; check the id with squeue or sacct, and leave "
                          "--after out for a job that has finished")
    nodes = partition_shapes(_job_partition(args))
    _fits_the_partition("--nodes", args.nodes, nodes)
    # the processes a checkpoint is checked against, where known before `_gpus_per_node`, whose refusal of a
    # GPU partition without --gpus-per-node comes after "nothing to submit" (a finished training's)
    gpus = args.gpus_per_node if args.gpus_per_node is not None else None if any(n.gpus for n in nodes) else 0
    ranks = _Ranks("--nodes", args.nodes, args.procs_per_node or max(gpus, 1)) if gpus is not None else None
    cfg = _train_config(args, ranks=ranks)
    where = store_location(cfg.out)
    if (why := _no_trainer_needed(cfg, queued_training(where))) is not None:
        _say(args, f"nothing to submit: {why}")
        return 0
    opts = _train_options(args, _gpus_per_node(args, nodes), cfg, nodes)
    if not cfg.follow and not args.after:
        _data_is_a_run(cfg)
    script = train_script(opts, args.nodes, tool_argv(args, args._tool_actions), _resume_flag(args._tool_actions),
                          training_tag(where, cfg.follow, cfg.delete_consumed, store_location(cfg.data)))
    if args.dry_run:
        _show(f"{opts.job_name}.sbatch", dependency_options(args.after), script)
        return 0
    _sbatch_train(args, opts, script, after=args.after)
    return 0


def _sbatch_train(args: argparse.Namespace, opts, script: str, after: list[str]) -> str:
    from layertap.slurm import submit

    job = submit.submit_script(os.path.join(opts.logs, "scripts"), opts.job_name, script, after)
    when = f" after job(s) {', '.join(after)} succeed" if after else ""
    _say(args, f"submitted training job {job}{when}; log {opts.logs}/{opts.job_name}-{job}.out", job)
    return job


def _resume_flag(actions: list[argparse.Action]) -> str | None:
    """The trainer's flag to continue from its latest checkpoint, which a requeued job passes."""
    for a in actions:
        if a.dest == "resume" and a.nargs == 0:
            return max(a.option_strings, key=len)
    return None


def _say(args: argparse.Namespace, text: str, job: str | None = None) -> None:
    """Human lines normally; with --parsable only the job ids."""
    if args.parsable:
        if job:
            print(job)
    else:
        print(text)


def _note(text: str) -> None:
    """A remark on how the job was sized, on stderr: stdout stays the scripts or job ids."""
    print(f"note: {text}", file=sys.stderr)


def _show(title: str, options: list[str], script: str) -> None:
    """A dry run's script, with keys typed on the command line masked (a dry run's output is pasted into
    tickets and chats); a real submission saves it whole, readable by its owner alone (`save_script`)."""
    from layertap.storage.redact import redacted

    shown = redacted(script)
    masked = " (keys given on the command line shown as ***; the job gets them as typed)" if shown != script else ""
    print(f"\n----- {title} (dry run: not submitted; {' '.join(['sbatch --parsable', *options])} <script>){masked}")
    print(shown)


def _local_path(path: str) -> bool:
    """Whether `path` names a local file or folder, not a hub id ("org/name") or a store URI."""
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(path)


def _check_inputs_here(cfg) -> None:
    """What every task would refuse at its start, checked where this host can: a --model or
    --dataset path missing here is noted (it may exist on the nodes alone, as for `submit train`'s
    --data); capture layers past the model's decoder layers (its config.json, read here) are
    refused. A missing dataset was submitted, and every task failed on it in the queue."""
    from layertap.extract.config import check_layers, text_config
    from layertap.extract.dataset_download import is_s3_data, listed_s3_data
    from layertap.extract.dataset_files import is_pattern, pattern_files
    from layertap.storage.store import StoreError

    # a --dataset is a file, a folder, a glob of files or a store URI, never a hub id: any other path missing here
    # is noted
    if cfg.dataset and is_s3_data(cfg.dataset):  # objects on S3: a glob that names none refused, as every task would
        try:
            listed_s3_data(cfg.dataset, cfg.s3)
        except StoreError as e:
            _note(f"--dataset {cfg.dataset} cannot be listed here ({e}): each task reads it at its start")
    for flag, path, local in (("--model", cfg.model, _local_path(cfg.model or "")),
                              ("--dataset", cfg.dataset, not (cfg.dataset or "").startswith("s3://"))):
        if not path or not local:
            continue
        if flag == "--dataset" and is_pattern(path) and not pattern_files(path):
            _note(f"{flag} {path} matches no file on this host: every task fails at its start unless it matches "
                  "files on the nodes")
        elif not is_pattern(path) and not os.path.exists(os.path.expanduser(path)):
            _note(f"{flag} {path} does not exist on this host: every task fails at its start unless it exists on "
                  "the nodes")
    config = os.path.join(os.path.expanduser(cfg.model or ""), "config.json")
    if cfg.model and cfg.layers and cfg.gguf_file is None and os.path.isfile(config):
        try:
            with open(config) as f:
                doc = json.load(f)
            text = text_config(doc)
            layers = int(text.get("num_hidden_layers", doc.get("num_hidden_layers")))
        except (OSError, ValueError, TypeError, AttributeError):
            return  # the tasks say what is wrong with it, as they load the model
        check_layers(cfg.layers, layers)


def _dataset_fingerprint(cfg, s3: dict[str, Any] | None = None) -> str | None:
    """The fingerprint a task would compare with a planned run's (`dataset_fingerprint`: the file
    hashed, at disk speed), where this host has the dataset; None where it cannot tell (the
    embedded data, a path that is on the nodes alone). `s3`: the "s3" settings of extract's
    --config (a regeneration's command takes none)."""
    from layertap.extract.dataset_download import is_s3_data
    from layertap.extract.fingerprint import dataset_fingerprint
    from layertap.storage.errors import MissingInput
    from layertap.storage.store import StoreError

    if not cfg.dataset:
        return None
    if is_s3_data(cfg.dataset):  # objects each task fetches whole: not fetched onto this host (listed by
        return None              # `_check_inputs_here`)
    try:
        return dataset_fingerprint(cfg.dataset, cfg.limit, s3)
    except MissingInput:  # noted already (`_check_inputs_here`)
        return None
    except (StoreError, OSError) as e:  # a store or file this host cannot read: the tasks compare it
        _note(f"--dataset {cfg.dataset} cannot be read here ({e}): each task compares it with the run's at its start")
        return None


def _pinned_settings(cfg) -> dict[str, Any]:
    """The settings the run's manifest pins that are known without loading the model."""
    pinned = {k: getattr(cfg, k) for k in ("codec", "dtype", "max_length", "final_state")}
    pinned.update({k: getattr(cfg, k) for k in ("model", "gguf_file", "layers") if getattr(cfg, k) is not None})
    return pinned
