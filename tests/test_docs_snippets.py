"""Every code block in README.md and docs/*.md is checked, by kind; what each check proves:

- ```python: executed whole, in a fresh folder by a new interpreter, against a small real run
  (tests/fake_worker.py's: real leases, shards and commits) on the moto S3 server at the prefix
  the docs name (`s3://acts/...` is rewritten to this test's bucket). Proves the code runs as
  written, imports included, and reads a real run.
- ```bash preceded by `<!-- snippet: run ... -->`: executed the same way with `bash -e`: every
  command exits 0.
- every other ```bash: `bash -n` (shell syntax), then each command by what it runs.
  `layertap ...` (also through `accelerate launch ... -m layertap.extract` or `-m layertap.train`, or
  `python -m layertap`) is parsed by layertap's own argument parser: a complete command line must parse;
  one that elides arguments with `...` must name only options its subcommand has; a
  `--then-train "..."` value is parsed as `layertap train`'s arguments; accelerate's own flags
  by accelerate's parser. `python script.py --flag`: the script exists and defines each flag.
  `pip install`: each requirement parses, a path exists, a layertap extra is in pyproject.toml.
  `bash FILE`: the file exists. `export`: syntax only. This proves the commands are what the
  tools accept, not that a cluster, a 27B model or S3 credentials make them succeed.
- unlabeled blocks are output, diagrams and hexdumps, not code. Any other language fails here,
  so a new kind of snippet needs a decision in this file.
- `<!-- snippet: skip REASON -->` before a block skips it, for that reason.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

import fake_worker
from layertap.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOC_BUCKET = "acts"  # the docs' example bucket, rewritten to the test's own
LANGS = {"python", "bash", ""}


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str  # "" or what follows `<!-- snippet:`

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def find_snippets() -> list[Snippet]:
    out = []
    for path in DOCS:
        lines = path.read_text().split("\n")
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\S*)\s*$", lines[i])
            if m:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                mark = re.match(r"^<!-- snippet: (.*?)\s*-->$", lines[i - 1]) if i else None
                out.append(Snippet(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                                   mark.group(1) if mark else ""))
                i = end
            i += 1
    return out


SNIPPETS = find_snippets()


def of(lang: str, run: bool | None = None) -> list:
    chosen = [s for s in SNIPPETS if s.lang == lang and not s.mark.startswith("skip")
              and (run is None or s.mark.startswith("run") == run)]
    return [pytest.param(s, id=s.id) for s in chosen]


def test_every_block_has_a_known_kind_and_marks_are_understood():
    assert len(SNIPPETS) > 20  # the parser found the docs' blocks
    for s in SNIPPETS:
        assert s.lang in LANGS, f"{s.id}: a ```{s.lang} block: teach tests/test_docs_snippets.py its kind"
        assert s.mark == "" or re.match(r"^(run\b|skip \S)", s.mark), f"{s.id}: unknown mark {s.mark!r}"
        assert not s.mark.startswith("run") or s.lang == "bash", f"{s.id}: only bash blocks are marked run"
    assert of("python") and of("bash", run=True) and of("bash", run=False)


# -- what runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doc_env(s3_endpoint, tmp_path_factory) -> dict:
    """A bucket holding a small complete run at the docs' prefix, and the environment to reach it."""
    bucket = f"docs-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    fake_worker.work(f"s3://{bucket}/qwen27b/run1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {"bucket": bucket, "env": env}


def for_test(text: str, bucket: str) -> str:
    return text.replace(f"s3://{DOC_BUCKET}/", f"s3://{bucket}/")


@pytest.mark.parametrize("snippet", of("python"))
def test_python_snippet_runs(snippet: Snippet, doc_env, tmp_path):
    p = subprocess.run([sys.executable, "-c", for_test(snippet.text, doc_env["bucket"])], cwd=tmp_path,
                       env=doc_env["env"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{snippet.id} failed:\n{p.stderr[-3000:]}"


@pytest.mark.parametrize("snippet", of("bash", run=True))
def test_bash_snippet_runs(snippet: Snippet, doc_env, tmp_path):
    p = subprocess.run(["bash", "-e", "-c", for_test(snippet.text, doc_env["bucket"])], cwd=tmp_path,
                       env=doc_env["env"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{snippet.id} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"


# -- what is parsed ----------------------------------------------------------------------------


def commands(text: str) -> list[list[str]]:
    """The block's simple commands as words: continuation lines joined, comments dropped, split
    at `&&`, `||`, `;` and `|`."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.split("\n"):
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        words: list[str] = []
        for w in lex:
            if w in ("&&", "||", ";", "|"):
                out.append(words)
                words = []
            else:
                words.append(w)
        out.append(words)
    return [w for w in out if w]


def subparser(parser, name: str):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction" and name in action.choices:
            return action.choices[name]
    return None


def check_layertap(args: list[str], where: str) -> None:
    parser = build_parser()
    if "..." in args:  # elided: the subcommand exists and has every option named
        p, rest = parser, list(args)
        while rest and (sub := subparser(p, rest[0])) is not None:
            p, rest = sub, rest[1:]
        assert p is not parser, f"{where}: `layertap {' '.join(args)}` names no subcommand"
        flags = [w.split("=", 1)[0] for w in rest if w.startswith("-") and w != "..."]
        unknown = [f for f in flags if f not in p._option_string_actions]
        assert not unknown, f"{where}: `layertap {' '.join(args)}`: {unknown} are not options of it"
        return
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            parser.parse_args(args)
        except SystemExit as e:  # --help and --version exit 0; a bad command line exits 2
            assert e.code == 0, f"{where}: `layertap {' '.join(args)}` is refused: {err.getvalue().strip()}"
    if "--then-train" in args:
        check_layertap(["train", *shlex.split(args[args.index("--then-train") + 1])], where + " (--then-train)")


def check_accelerate(words: list[str], where: str) -> None:
    from accelerate.commands.launch import launch_command_parser

    assert words[1] == "launch" and "-m" in words, f"{where}: {' '.join(words)}"
    module_at = words.index("-m") + 1
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            launch_command_parser().parse_args(words[2:module_at + 1])
        except SystemExit:
            pytest.fail(f"{where}: accelerate refuses {' '.join(words[2:module_at])}: {err.getvalue().strip()}")
    module, rest = words[module_at], words[module_at + 1:]
    assert module in ("layertap", "layertap.extract", "layertap.train"), f"{where}: accelerate launches {module}"
    check_layertap(rest if module == "layertap" else [module.split(".")[1], *rest], where)


def check_script(words: list[str], where: str) -> None:
    script = REPO / words[1]
    assert script.is_file(), f"{where}: {words[1]} does not exist"
    source = script.read_text()
    for flag in (w.split("=", 1)[0] for w in words[2:] if w.startswith("--")):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{where}: {words[1]} has no option {flag}"


def check_pip(words: list[str], where: str) -> None:
    from packaging.requirements import Requirement

    assert words[1] == "install", f"{where}: pip {words[1]}"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    rest = iter(words[2:])
    for w in rest:
        if w == "-e":
            assert (REPO / next(rest)).exists(), f"{where}: pip install -e of a missing path"
        elif not w.startswith("-"):
            req = Requirement(w)
            if req.name == "layertap":
                assert req.extras <= set(extras), f"{where}: layertap has no extra {req.extras - set(extras)}"


@pytest.mark.parametrize("snippet", of("bash", run=False))
def test_bash_snippet_is_accepted(snippet: Snippet):
    p = subprocess.run(["bash", "-n"], input=snippet.text, capture_output=True, text=True)
    assert p.returncode == 0, f"{snippet.id}: bash syntax: {p.stderr}"
    for words in commands(snippet.text):
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value cmd
            words = words[1:]
        if not words or words[0] == "export":
            continue
        name = words[0]
        if name == "layertap":
            check_layertap(words[1:], snippet.id)
        elif name == "accelerate":
            check_accelerate(words, snippet.id)
        elif name in ("python", "python3") and words[1:3] == ["-m", "layertap"]:
            check_layertap(words[3:], snippet.id)
        elif name in ("python", "python3"):
            check_script(words, snippet.id)
        elif name == "pip":
            check_pip(words, snippet.id)
        elif name == "bash":
            assert (REPO / words[1]).is_file(), f"{snippet.id}: {words[1]} does not exist"
        else:
            pytest.fail(f"{snippet.id}: `{' '.join(words)}`: teach tests/test_docs_snippets.py this command, "
                        "or mark the block <!-- snippet: skip REASON -->")


def test_a_wrong_option_in_a_snippet_is_caught(doc_env):
    """The checks above can fail: the docs' old mistakes are refused."""
    with pytest.raises(AssertionError, match="is refused"):
        check_layertap(["status", "s3://b/r", "--no-such-flag"], "here")
    with pytest.raises(AssertionError, match="are not options of it"):
        check_layertap(["train", "...", "--no-such-flag"], "here")
    with pytest.raises(AssertionError, match="is refused"):
        check_layertap(["submit", "extract", "--nodes", "1", "--then-train", "--steps many"], "here")
    code = ("from layertap.train import ShardStream, StreamLoader, packer\n"
            f"next(iter(StreamLoader(ShardStream('s3://{doc_env['bucket']}/qwen27b/run1'), batch_size=8, "
            "collate=packer(4096))))")  # LOADER.md's former `collate=packer(4096)`
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=doc_env["env"])
    assert p.returncode != 0 and "unexpected keyword argument 'collate'" in p.stderr, p.stderr[-2000:]
