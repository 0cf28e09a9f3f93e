"""layertap: capture a target model's hidden states into checksummed shards on S3 or a folder, and train drafters on them.

The `layertap` command: a thin dispatcher over each package's own subcommands.

Subcommand modules are imported only when used, so `layertap status` starts without torch or
transformers, and lower layers never import upper ones.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys

from layertap.storage.errors import UserError

# name -> (module defining `add_<name>(parser)` and `run_<name>(args) -> exit code`, one-line help;
# a dash in the name is an underscore in the functions': export-drafter -> add_export_drafter).
# Those modules import heavy dependencies inside `run_<name>`, so building the parser stays cheap.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "regenerate": ("layertap.extract.regenerate_command", "replace a dataset's assistant turns with the target's own "
                   "answers, from an OpenAI-compatible server"),
    "extract": ("layertap.extract.command", "capture a target model's hidden states into shards on the store"),
    "estimate": ("layertap.extract.estimate_command", "bytes, upload bandwidth, GPU-hours and cost of a run, before it runs"),
    "plan": ("layertap.extract.estimate_command", "cut a run's shard plan and write its manifest only (--dry-run: just show it)"),
    "inspect": ("layertap.storage.cli", "print a shard's metadata and records and verify every hash"),
    "status": ("layertap.manifests.cli", "show what is done, running, failed and pending in a run (or a training output)"),
    "verify": ("layertap.manifests.cli", "re-read committed shards, check every hash, withdraw bad ones"),
    "delete": ("layertap.manifests.delete", "delete a run or training output: every object under its prefix (asks first)"),
    "submit": ("layertap.slurm.command", "submit extraction arrays and training jobs to Slurm, only what is unfinished"),
    "train": ("layertap.train.command", "train a DFlash drafter on a run's stored states, streamed from the store"),
    "eval": ("layertap.train.command", "speculative decoding with target and drafter: acceptance length tau"),
    "export-drafter": ("layertap.train.export_command", "write a trained drafter in speculators' DFlash format (vLLM serves it)"),
    "export": ("layertap.extract.interop_command", "write a run's samples in speculators', SpecForge's or ModelOpt's layout"),
    "import": ("layertap.extract.interop_command", "turn speculators', SpecForge's or ModelOpt's hidden-state files into a run"),
}

# Every command exits 5, not 2 (bad arguments, no run there, a bad prefix), when the store did not
# answer (unreachable, or failing past its retries): a script or a job's wrapper can tell an outage
# it may wait out from a mistake to fix (`layertap status`'s exit codes; extract and train exited 2).
EXIT_NO_ANSWER = 5


def version() -> str:
    """The installed distribution's version (pyproject.toml's, for an editable install)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("layertap")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand with its arguments; with `only`, that one's alone (the others listed, bare;
    "": none, for `--version`, `--help` and a mistyped command): adding a command's arguments
    imports its module, and `layertap status` need not import torch."""
    parser = argparse.ArgumentParser(prog="layertap", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"layertap {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if only is None or name == only:
            getattr(importlib.import_module(module), f"add_{name.replace('-', '_')}")(p)
    # `-v` after the command too (`layertap status RUN -v`), and so through `python -m layertap.extract`
    # and `accelerate launch -m layertap.train`, which put the command first; SUPPRESS keeps a
    # subcommand's absent flag from undoing a top-level one
    below = _below(parser)
    for sub in below:
        sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="debug logging (also before the command)")
    for p in (parser, *below):
        _hint_attached_values(p)
        # no prefixes of long options: `--api-key sk-...` was read as `--api-key-env sk-...` (a secret
        # written into a job script as the name of a variable), `--step` as `--steps`
        p.allow_abbrev = False
    return parser


def _below(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser under `p`, `submit extract`'s included."""
    found = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_below(sub)]
    return found


def _command_in(argv: list[str]) -> str | None:
    """The subcommand `argv` names: its first word past the top level's options, if a command."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in SUBCOMMANDS else None


_parsing: list[str] = []  # the words being parsed (`_parse`), for `_hint_attached_values`


def _hint_attached_values(p: argparse.ArgumentParser) -> None:
    """argparse reads `--layers -1,3` (or `--then-train "--data=x"`) as two options and says only
    "expected one argument": say how to give a value that starts with '-' (not where the value is
    missing: `--out` last on the line)."""
    error = p.error

    def error_with_hint(message: str) -> None:
        if message.endswith("expected one argument") and message.startswith("argument --"):
            option = message.split()[1].rstrip(":").split("/")[-1]
            last = _parsing[-1] if _parsing else ""
            # not the line's last word: its value reads as an option
            if last != option:
                message += f" (a value that starts with '-' must be attached with '=': {option}=VALUE)"
        error(message)

    p.error = error_with_hint


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse, with an unknown option reported by its subcommand's parser: its usage, not the top
    level's, and the option the user probably meant (argparse 3.11 reports extras at the top)."""
    import difflib

    _parsing[:] = argv
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = parser  # the innermost subcommand's parser (`submit extract`'s, not `submit`'s)
        while (action := next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None)) \
                and getattr(args, action.dest, None) in action.choices:
            sub = action.choices[getattr(args, action.dest)]
        known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        hints = [f"{x} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(x.split("=")[0], known, n=1))
                 else x for x in extra]
        sub.error(f"unrecognized arguments: {' '.join(hints)}")
    return args


def main(argv: list[str] | None = None) -> int:
    _stacks_on_sigusr2()
    # Parsing imports the subcommand's module (up to seconds: torch): a Ctrl-C then is an interruption
    # like any other, one line and exit 130, not a KeyboardInterrupt traceback.
    words = sys.argv[1:] if argv is None else argv
    command = _command_in(words)
    if not words:  # what a first try types: the commands, not "the following arguments are required"
        print(build_parser("").format_help(), file=sys.stderr)
        return 2
    try:
        args = _parse(build_parser(command or ""), words)
        _setup_logging(args.verbose)
        module = importlib.import_module(args._module)
        return int(getattr(module, f"run_{args.command.replace('-', '_')}")(args) or 0)
    except UserError as e:  # the one place user errors are reported (storage/errors.py); bugs keep a traceback
        from layertap.storage.redact import scrubbed

        print(f"error: {scrubbed(str(e))}", file=sys.stderr)  # it may quote a library's text: a URL, a header
        from layertap.storage.store import TransientStoreError  # loaded already by whatever raised it

        # a script must tell an outage it can wait out from a wrong prefix or flag
        return EXIT_NO_ANSWER if isinstance(e, TransientStoreError) else 2
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


_stacks_registered = False


def _stacks_on_sigusr2() -> None:
    """`kill -USR2 PID` (or `scancel --signal=USR2 JOB`) prints every thread's Python stack to
    stderr and the command goes on: where a rank that seems hung is waiting, without a debugger
    on the node. (SIGTERM and SIGUSR1 stop a command at a step boundary; USR2 was unused, and its
    default action would end the process.) Once per process, onto the process's own stderr (an
    in-process caller's capture may lack a descriptor, or close it and leave its number to another
    file), after a handler a host program set, if any."""
    global _stacks_registered
    if _stacks_registered or not hasattr(signal, "SIGUSR2") or sys.__stderr__ is None:
        return
    try:
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True,
                              chain=callable(signal.getsignal(signal.SIGUSR2)))
    except (AttributeError, OSError, RuntimeError, ValueError):  # io.UnsupportedOperation: no descriptor
        return
    _stacks_registered = True


def _setup_logging(verbose: bool) -> None:
    # one process of several (a launcher's: torchrun, accelerate, across nodes) names its rank: their
    # lines meet in one job log, where the same warning from each rank told nothing of which one said it
    world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
    who = f"rank {rank}/{world} " if world.isdigit() and int(world) > 1 and rank.isdigit() else ""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format=f"%(asctime)s {who}%(levelname)s %(name)s: %(message)s")
    from layertap.storage.redact import scrub_log_records

    scrub_log_records()
    # Never DEBUG for these, even with -v: botocore's and urllib3's debug records carry request
    # headers, the access key id and a session token among them, into consoles and log files.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "filelock", "datasets", "openai"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.WARNING)
    # An SSO token it cannot refresh is a warning with two tracebacks before the error that says what to
    # do (`aws sso login`), which the store reports: those only with -v.
    logging.getLogger("botocore.tokens").setLevel(logging.INFO if verbose else logging.ERROR)
    # Nor INFO for these: httpx logs each request's URL, which carries an endpoint's ?token= query.
    for quiet in ("httpx", "httpx2", "httpcore", "httpcore2"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    from layertap.extract.console import quiet_library_bars

    quiet_library_bars()  # off a terminal (a Slurm log), no library bars in any command


if __name__ == "__main__":
    sys.exit(main())
