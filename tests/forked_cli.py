"""Real `layertap` processes that start in a fraction of a second, to be killed many times over.

Starting `python -m layertap` costs seconds of imports (torch, transformers, datasets) on a
small machine. A multiprocessing forkserver pays them once: it imports this module, and with it
everything the extractor imports, then forks one child per `start()`. Each child is a real
process with its own pid, store connections and threads, and dies of SIGKILL like any other.

    proc = forked_cli.start(["extract", "--out", ...], log_path)   # stdout + stderr go to log_path
    proc.kill(); proc.join()                                        # SIGKILL; proc.exitcode == -9
"""

from __future__ import annotations

import multiprocessing
import os
import sys

import accelerate  # noqa: F401 - imported once here, inherited by every child
import datasets  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401 - transformers imports it lazily

from layertap.extract import run  # noqa: F401
from layertap.cli import main as cli_main

_CTX = multiprocessing.get_context("forkserver")
# Names importable from anywhere: Python 3.11's forkserver ignores the parent's sys.path (this
# module's folder is not on it); each child imports this module again, cheaply, through spawn's
# preparation data.
_CTX.set_forkserver_preload(["accelerate", "datasets", "torch", "transformers",
                             "transformers.models.llama.modeling_llama", "layertap.extract.run", "layertap.cli"])


def _child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.set_num_threads(1)  # tests run several processes on few cores: oversubscribed threads crawl
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        code = cli_main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start(argv: list[str], log_path: str, env: dict[str, str | None] | None = None) -> multiprocessing.Process:
    """`layertap ARGV` in a forked child; `env` entries are set (or, with None, removed) first."""
    proc = _CTX.Process(target=_child, args=(list(argv), dict(env or {}), str(log_path)), daemon=True)
    proc.start()
    return proc


def _noop() -> None:
    pass


def warm() -> None:
    """Start the forkserver now (its imports take seconds), so later children start at once."""
    proc = _CTX.Process(target=_noop, daemon=True)
    proc.start()
    proc.join()
