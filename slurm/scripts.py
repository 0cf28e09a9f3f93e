"""The sbatch scripts `layertap submit` writes: an extraction array, a regeneration array and a
multi-node training job.

Both are plain bash that a user can read, keep and resubmit by hand. Both start their workers
with `srun --kill-on-bad-exit=1` (a job step: Slurm accounts for it, places it, and signals it)
and share one body (`templates/body.sh`): the step runs in the background while the batch shell
waits for it, so a signal never ends the job before the workers have cleaned up, and the
time-limit warning (USR1, which Slurm sends to the batch shell only) is passed on to them.

The scripts run on the compute nodes with the submit host's paths (the working directory, the
interpreter, the logs folder, the virtual environment): a filesystem shared between them is
assumed, as on most clusters. `--python` and `--env-activate` name what to use where it is not.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from importlib import resources

from layertap.storage.errors import ConfigError
from layertap.storage.redact import public_url, redacted
from layertap.storage.units import id_runs

# each package's own command: `python -m layertap.extract ARGS` is `layertap extract ARGS`
EXTRACT_MODULE, TRAIN_MODULE = "layertap.extract", "layertap.train"
CLI_MODULE = "layertap"  # `python -m layertap regenerate ARGS`


@dataclass(kw_only=True)
class JobOptions:
    """What a job asks of Slurm and how its shell is set up, common to extraction and training."""

    job_name: str
    logs: str  # Slurm's output files and the per-task log folders go here
    chdir: str = field(default_factory=os.getcwd)  # relative paths in the arguments resolve here
    python: str = sys.executable  # the interpreter on the nodes (default: this one, by its absolute path)
    env_activate: str | None = field(default_factory=lambda: default_activation())  # a shell line; None: none
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    mem: str | None = None
    gpus_per_node: int = 0
    procs_per_node: int | None = None  # worker processes per node; default one per GPU, else 1
    cpus_per_task: int | None = None
    setup: list[str] = field(default_factory=list)  # shell lines run before the activation, e.g. module load
    sbatch: list[str] = field(default_factory=list)  # further sbatch options, e.g. --exclusive
    grace_s: int = 120  # USR1 this many seconds before the time limit

    def __post_init__(self) -> None:
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise ConfigError(f"--procs-per-node must be at least 1, got {self.procs_per_node}")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError(f"--cpus-per-task must be at least 1, got {self.cpus_per_task}")
        if self.grace_s < 0:
            raise ConfigError(f"--grace must be 0 or more seconds, got {self.grace_s}")
        limit = slurm_seconds(self.time) if self.time else None
        if self.time and not is_slurm_time(self.time):
            raise ConfigError(f"--time {self.time!r} is not a Slurm time limit: give minutes, MM:SS, HH:MM:SS, D-HH, "
                              "D-HH:MM or D-HH:MM:SS (e.g. 12:00:00 for 12 hours), or UNLIMITED")
        if limit is not None and limit < 2 * self.grace_s:
            raise ConfigError(f"--time {self.time} ({limit} s) is under twice --grace ({self.grace_s} s): each job "
                              f"would be told to stop {self.grace_s} s before its limit, about {max(0, limit - self.grace_s)} s "
                              "after it starts, and requeue itself over and over; give a longer --time (or a shorter --grace)")
        for opt in self.sbatch:
            if not opt.startswith("-") or "\n" in opt:
                raise ConfigError(f"--sbatch {opt!r} is not an sbatch option: give it as --sbatch=--exclusive "
                                 "or --sbatch=--constraint=a100")
            if any(c.isspace() for c in opt.partition("=")[0]):  # "-C a100" became `#SBATCH -C a100=""`
                raise ConfigError(f"--sbatch {opt!r} holds a space before its value: give the option and its "
                                 "value joined by '=', e.g. --sbatch=--constraint=a100")
        for line in self.setup:
            if "\n" in line:
                raise ConfigError(f"--setup {line!r} holds a newline: give each line as its own --setup")
        if self.env_activate is not None and "\n" in self.env_activate:
            raise ConfigError(f"--env-activate {self.env_activate!r} holds a newline: give one shell line")
        if not self.python.strip():
            raise ConfigError("--python must name an interpreter")
        self.logs = os.path.abspath(self.logs)  # the default, relative, lies in the folder submit runs from
        if "\\" in self.logs:  # Slurm would not expand %j and %a in the output file's name
            raise ConfigError(f"--logs {self.logs!r} holds a backslash, which turns Slurm's replacement symbols in "
                              "its output files' names off (every task would write one file): name a folder without one")
        self.chdir = os.path.abspath(self.chdir)

    @property
    def procs(self) -> int:
        return self.procs_per_node or max(self.gpus_per_node, 1)


def default_activation() -> str | None:
    """Activate the virtual environment layertap runs in, so the job finds the same packages."""
    if sys.prefix != sys.base_prefix and os.path.exists(os.path.join(sys.prefix, "bin", "activate")):
        return f"source {shlex.quote(os.path.join(sys.prefix, 'bin', 'activate'))}"
    return None


@dataclass(frozen=True, kw_only=True)
class ArrayPlan:
    """Which array tasks to start. Dynamic: tasks 0..n-1 take free shards through leases until none
    is left. Static: task i works shards [i*k, (i+1)*k) of the run, and only tasks with
    unfinished shards are started."""

    indices: list[int]
    max_parallel: int | None = None  # the `%N` cap on tasks running at once
    shards_per_task: int | None = None  # None: dynamic leases
    num_shards: int | None = None  # the run's shard count (static only: clips the last range)

    @property
    def spec(self) -> str:
        """`--array` value, e.g. `1-3,7%2`."""
        return compress(self.indices) + (f"%{self.max_parallel}" if self.max_parallel else "")


def compress(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7' (`extract.config.parse_ids` reads it back)."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in id_runs(set(ids)))


def extract_script(opts: JobOptions, plan: ArrayPlan, extract_args: list[str], tag: str | None = None) -> str:
    """One array task per node; its workers (one per GPU, through accelerate) share the task's
    shards, or any free shard, through leases. Each task logs into its own folder. `tag`: the
    Slurm comment that names the run to a later resubmission (`slurm.queued`); an --sbatch
    --comment, written after it, wins."""
    header = _array_header(opts, plan.spec, tag)
    lines = ['TASK="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
             f'LOG_DIR={shlex.quote(opts.logs)}/"${{SLURM_JOB_NAME}}-${{TASK}}"']
    args = [*map(shlex.quote, extract_args), '--log-dir "$LOG_DIR"']
    if plan.shards_per_task == 1:
        args.append('--shards "$SLURM_ARRAY_TASK_ID"')
    elif plan.shards_per_task:
        k, last = plan.shards_per_task, plan.num_shards - 1
        lines += [f"FIRST=$((SLURM_ARRAY_TASK_ID * {k})); LAST=$((FIRST + {k - 1}))",
                  f"if [ \"$LAST\" -gt {last} ]; then LAST={last}; fi"]
        args.append('--shards "$FIRST-$LAST"')
    step = [*_srun(opts, "--nodes=1", "--ntasks=1"), *_STEP_SHELL]
    if opts.procs > 1:
        lines.append(f"PORT={JOB_PORT}  # array tasks may share a node")
        launch = [*step, shlex.quote(opts.python), "-m", "accelerate.commands.launch", "--multi_gpu",
                  "--num_processes", str(opts.procs), "--num_machines", "1", "--main_process_port", '"$PORT"',
                  "--mixed_precision", "no", "--dynamo_backend", "no", "-m", EXTRACT_MODULE]
    else:
        launch = [*step, shlex.quote(opts.python), "-m", EXTRACT_MODULE]
    mode = (f"{plan.shards_per_task} shard(s) per task" if plan.shards_per_task else "any free shard, through leases")
    about = [f"# layertap extraction: one array task per node, {opts.procs} worker process(es) each ({mode}).",
             "# Resubmit with the same `layertap submit extract` command: it starts tasks only for unfinished shards."]
    return _script(about, header, opts, lines, launch + args, extract_args, requeue_on_timeout=True)


def regenerate_script(opts: JobOptions, spec: str, tasks: int, regenerate_args: list[str],
                      tag: str | None = None) -> str:
    """One array task per server: task i of `tasks` regenerates the parts p with p % tasks == i,
    through its own server (`--serve` in the arguments) or a shared endpoint. Tasks whose parts
    are all done are left out of `spec`; a task stopped at the time limit is requeued and resumes.
    `tag`: the Slurm comment that names the output to a later resubmission (`slurm.queued`)."""
    header = _array_header(opts, spec, tag)
    launch = [*_srun(opts, "--nodes=1", "--ntasks=1"), *_STEP_SHELL, shlex.quote(opts.python), "-m", CLI_MODULE, "regenerate",
              *map(shlex.quote, regenerate_args), "--task", f'"$SLURM_ARRAY_TASK_ID/{tasks}"']
    # Array tasks may share a node: a port of the task's own for --serve and --endpoint to name.
    lines = [f"export LAYERTAP_TASK_PORT={JOB_PORT}"]
    about = [f"# layertap regeneration: {tasks} array task(s), each its share of the output's parts.",
             "# Resubmit with the same `layertap submit regenerate` command: it starts tasks only for unfinished parts."]
    return _script(about, header, opts, lines, launch, regenerate_args, requeue_on_timeout=True)


# The loader's buffers (GET bodies, decoded samples) come from one glibc heap that keeps what is
# freed, instead of a fresh mapping, page-faulted in, per buffer: 14-47% less loader CPU
# (docs/LOADER.md, "Memory allocator"; bench/page_faults.py measures these same values). One
# arena, because a thread's own arena maps anything over 64 MiB; buffers under 1 GiB from the
# heap; up to 1 GiB of freed memory kept. Values set before submitting win (sbatch exports them).
MALLOC_SETTINGS = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                   "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


# A port of the job's own (tasks and jobs may share a node), below Linux's ephemeral ports (32768-60999),
# which the node's outgoing connections take: one of them could hold it
JOB_PORT = "$((20000 + SLURM_JOB_ID % 12000))"


def slurm_seconds(text: str) -> int | None:
    """A Slurm --time in seconds: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes or days-hours:minutes:seconds; None for no limit (UNLIMITED, infinite, -1,
    or a time of zero) or a form Slurm does not take (`JobOptions` refuses it: sbatch would, after
    the dry run). ASCII digits only, as Slurm parses them (Python's int() takes "+5", "1_000")."""
    text = text.strip()
    if not _SLURM_TIME.match(text):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        h, m, sec = (parts + [0, 0])[:3]
    else:  # minutes, minutes:seconds, hours:minutes:seconds
        h, m, sec = ([0] + parts if len(parts) == 2 else [0, parts[0], 0] if len(parts) == 1 else parts)
    seconds = (((int(days) if days else 0) * 24 + h) * 60 + m) * 60 + sec
    return seconds or None  # zero: no limit, to Slurm


_SLURM_TIME = re.compile(r"^[0-9]+(-[0-9]+(:[0-9]+){0,2}|(:[0-9]+){0,2})$")


def is_slurm_time(text: str) -> bool:
    """Whether sbatch takes `text` as a --time (a limit, or none: UNLIMITED, infinite, -1, zero)."""
    return text.strip().lower() in ("unlimited", "infinite", "-1") or bool(_SLURM_TIME.match(text.strip()))


def train_script(opts: JobOptions, nodes: int, train_args: list[str], resume_flag: str | None,
                 tag: str | None = None) -> str:
    """`layertap train` on `nodes` nodes: srun starts one accelerate launcher per node, with the
    rendezvous (first node's address, a port from the job id) taken from the Slurm environment.
    With `resume_flag`, a requeued job continues from its latest checkpoint. `tag`: the Slurm
    comment that names the output to a later resubmission (`slurm.queued.training_tag`)."""
    if nodes < 1:  # `layertap submit` names the flag first (--nodes, or --train-nodes)
        raise ConfigError(f"a training job needs at least 1 node, got {nodes}")
    header = _header(opts, [f"--nodes={nodes}", "--ntasks-per-node=1", _output(opts, "%x-%j.out"),
                            *([f"--comment={tag}"] if tag else [])])
    total = '"$((SLURM_NNODES * ' + str(opts.procs) + '))"'
    lines = ['FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             "# the first node's address: a NodeName need not be a host name (NodeAddr), and an unresolved one",
             "# held every node in the rendezvous until its timeout",
             "MASTER_ADDR=$(scontrol show node \"$FIRST_NODE\" 2>/dev/null | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' "
             "| head -n 1)",
             'MASTER_ADDR="${MASTER_ADDR:-$FIRST_NODE}"',
             f"PORT={JOB_PORT}",
             "RESUME=()", *(f'export {k}="${{{k}:-{v}}}"' for k, v in MALLOC_SETTINGS.items())]
    if resume_flag:  # a requeued job, and one resubmitted after a failure: a fresh --out starts from scratch
        lines.append(f"RESUME=({resume_flag})  # continues from --out's latest checkpoint when it holds one")
    trainer = ["-m", TRAIN_MODULE, *map(shlex.quote, train_args), '${RESUME[@]+"${RESUME[@]}"}']  # bash 4.2-safe
    if nodes * opts.procs == 1:  # no launcher: its error came back as a traceback repeating the trainer's stderr
        launch = [*_srun(opts, "--nodes=1", "--ntasks-per-node=1"), *_STEP_SHELL, shlex.quote(opts.python), *trainer]
        about = ["# layertap training: one process, on 1 node."]
        return _script(about, header, opts, lines, launch, train_args, requeue_on_timeout=bool(resume_flag))
    node = shlex.quote(_IGNORING_USR2 + 'exec "$0" -m accelerate.commands.launch --machine_rank "$SLURM_NODEID" "$@"')
    launch = [*_srun(opts, f"--nodes={nodes}", "--ntasks-per-node=1"), "bash", "-c", node,
              shlex.quote(opts.python), "--num_machines", '"$SLURM_NNODES"', "--num_processes", total,
              "--main_process_ip", '"$MASTER_ADDR"', "--main_process_port", '"$PORT"', "--multi_gpu"]
    # --mixed_precision no quiets accelerate's warning of a default; the trainer passes its own choice
    # (--mixed-precision, bf16 on GPUs) to Accelerator, which wins over the launcher's
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", *trainer]
    about = [f"# layertap training: {nodes} node(s) x {opts.procs} process(es), one accelerate launcher per node."]
    return _script(about, header, opts, lines, launch, train_args, requeue_on_timeout=bool(resume_flag))


def _srun(opts: JobOptions, *placement: str) -> list[str]:
    """The job step that runs the workers. Its CPUs are stated: srun does not take the job's
    --cpus-per-task from the environment on every Slurm version (22.05 does not)."""
    cpus = [f"--cpus-per-task={opts.cpus_per_task}"] if opts.cpus_per_task else []
    return ["srun", *placement, *cpus, "--kill-on-bad-exit=1"]


# `scancel --signal=USR2 JOB` (a stack dump of every layertap process: layertap.cli) reaches each
# process of the job's steps. The accelerate launcher has no handler for it and died (exit 140),
# and its step and the job with it: ignored, it stays so through exec, and layertap's processes
# install their own handler over it. A step's command runs behind `_STEP_SHELL`.
_IGNORING_USR2 = 'trap "" USR2; '
_STEP_SHELL = ["bash", "-c", shlex.quote(_IGNORING_USR2 + 'exec "$0" "$@"')]


def _header(opts: JobOptions, job_lines: list[str]) -> list[str]:
    opt = [f"--job-name={opts.job_name}", *job_lines]
    if opts.gpus_per_node:
        opt.append(f"--gpus-per-node={opts.gpus_per_node}")
    for name in ("cpus_per_task", "mem", "time", "partition", "account", "qos"):
        value = getattr(opts, name)
        if value is not None:
            opt.append(f"--{name.replace('_', '-')}={value}")
    # append: a requeued task continues its log; requeue: Slurm may restart it after preemption
    opt += ["--open-mode=append", "--requeue", f"--signal=B:USR1@{opts.grace_s}", f"--chdir={opts.chdir}"]
    return [f"#SBATCH {o}" for o in map(_sbatch_word, [*opt, *opts.sbatch])]


def _array_header(opts: JobOptions, spec: str, tag: str | None) -> list[str]:
    """An array's header: a task per node, each logging to its own file; `tag` as its comment."""
    job = [f"--array={spec}", "--nodes=1", "--ntasks-per-node=1", _output(opts, "%x-%A_%a.out")]
    return _header(opts, job + ([f"--comment={tag}"] if tag else []))


def _output(opts: JobOptions, pattern: str) -> str:
    """`--output` in the logs folder, its `%` doubled: only `pattern`'s are replacement symbols."""
    return f"--output={opts.logs.replace('%', '%%')}/{pattern}"


_PLAIN = re.compile(r"[\w@%+=:,./-]+")


def _sbatch_word(option: str) -> str:
    """`--name=value` as one word of a `#SBATCH` line. sbatch splits those lines at whitespace,
    ends them at a `#`, and reads quotes and backslashes as a shell does (`_get_argument` in
    src/sbatch/opt.c), so a value with any of these (a run folder named `my runs`) goes in double
    quotes, its `"` and `\\` escaped. Nothing can carry a newline there."""
    if "\n" in option:
        raise ConfigError(f"the sbatch option {option!r} holds a line break, which a #SBATCH line cannot: "
                          "choose a name or folder without one")
    if _PLAIN.fullmatch(option):
        return option
    name, _, value = option.partition("=")
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'{name}="{escaped}"'


def _command(words: list[str], name: str = "cmd", width: int = 100) -> str:
    """`cmd=( ... )`, an option and its value kept on one line, lines of about `width` characters."""
    groups: list[str] = []
    for w in words:
        if groups and groups[-1].startswith("-") and not any(c in groups[-1] for c in " =") and not w.startswith("-"):
            groups[-1] += f" {w}"
        else:
            groups.append(w)
    lines: list[str] = []
    for g in groups:
        if lines and len(lines[-1]) + 1 + len(g) <= width:
            lines[-1] += f" {g}"
        else:
            lines.append(g)
    return f"{name}=(\n  " + "\n  ".join(lines) + "\n)"


_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
# The line before a script's masked copy of its command: the script itself holds secrets.
MASKED = "# what the log shows: the command with its secrets masked"


def _shown(command: list[str], tool_args: list[str]) -> str:
    """`shown`, the command as each task's log shows it (templates/body.sh echoes it): `cmd`
    itself, or where the tool's arguments hold secrets a copy with them masked, as layertap's own
    logs mask them (an --api-key or --hf-token in a --serve line, a user:password or query in a
    URL). `cmd` keeps them: the job needs them (docs/SLURM.md: pass them in the environment)."""
    masked = {}
    for arg in tool_args:
        safe = _public_url(arg) if _URL.match(arg) else redacted(arg)
        if safe != arg:
            masked[shlex.quote(arg)] = shlex.quote(safe)
    if not masked:
        return 'shown=("${cmd[@]}")'
    return MASKED + "\n" + \
        _command([masked.get(w, w) for w in command], "shown")


def _public_url(url: str) -> str:
    """`url` as the task's log shows it. A store location (`open_store`'s `s3://bucket/prefix` and
    `file://path`) is a key prefix or a path after its bucket, where `#` and `?` are plain
    characters (`s3://b/run#1`): it is kept whole, less a user:password before the bucket. Any
    other URL (an --endpoint) loses its user:password and query, which may carry tokens."""
    if not url.startswith(("s3://", "file://")):
        return public_url(url)
    scheme, _, rest = url.partition("://")
    where, slash, path = rest.partition("/")
    return f"{scheme}://{where.rpartition('@')[2]}{slash}{path}"


# Work that resumes (extraction; training with --resume) goes back in the queue when the time
# limit stopped it; Slurm's MaxBatchRequeue bounds the loop for a job that never progresses.
_REQUEUE = """if [ "$warned" = 1 ] && [ "$rc" != 0 ]; then
  echo "layertap: stopped before the time limit; requeueing ${me} to resume"
  scontrol requeue "$me"
fi
"""


def _script(about: list[str], header: list[str], opts: JobOptions, lines: list[str], command: list[str],
            tool_args: list[str], *, requeue_on_timeout: bool) -> str:
    """The whole script: `lines`, then `command` (shell words) as `cmd`, run by the body; the
    tool's own arguments (`tool_args`, within `command`) are what `_shown` masks for the log."""
    body = resources.files(__package__).joinpath("templates/body.sh").read_text()
    on_timeout = _REQUEUE if requeue_on_timeout else ""
    body = body.replace("{{grace}}", str(opts.grace_s)).replace("{{on_timeout}}", on_timeout)
    python = shlex.quote(opts.python)
    env = ["# The environment: --setup lines, then --env-activate (before `set -u`: module systems and",
           "# activation scripts may read unset variables). This runs on the compute node with the submit",
           "# host's paths: a filesystem shared with it is assumed.",
           *opts.setup, opts.env_activate or "# (no --env-activate: the interpreter below is run by its path)"]
    check = (f'command -v {python} >/dev/null || {{ echo "layertap: {_squote(opts.python)} is not on $(hostname): '
             'the job uses the submit host\'s paths (a shared filesystem); see --python and --env-activate" >&2; '
             "exit 2; }")
    # OpenMP threads per worker process: the task's CPUs shared among the node's workers.
    share = "$SLURM_CPUS_PER_TASK" if opts.procs == 1 else \
        f"$(( SLURM_CPUS_PER_TASK > {opts.procs} ? SLURM_CPUS_PER_TASK / {opts.procs} : 1 ))"
    omp = f'if [ -n "${{SLURM_CPUS_PER_TASK:-}}" ]; then export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{share}}}"; fi'
    parts = ["#!/bin/bash", *about, *header, "", *env, "set -uo pipefail", check, omp, "", *lines,
             _command(command), _shown(command, tool_args), "", body]
    return "\n".join(parts)


def _squote(text: str) -> str:
    """`text` inside a double-quoted shell string, printed as it is."""
    return "".join("\\" + c if c in '"$`\\' else c for c in text)
