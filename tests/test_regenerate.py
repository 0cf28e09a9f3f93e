"""`layertap regenerate` against a real OpenAI-compatible server: `transformers serve` running a
tiny random-init model on the CPU, fed real ShareGPT conversations.

The served model's chat template raises on a user turn that starts with REFUSED (as strict
templates raise on roles that do not alternate): the server answers 500 to such requests, which
is how a row the server cannot take is met for real.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from layertap.cli import main as cli
from layertap.extract.embedded import sharegpt_conversations
from layertap.extract.inputs import load_rows, normalize_chat, TokenizeStats
from layertap.extract.regenerated import iter_rows
from layertap.manifests.regeneration import RECIPE, done_parts, read_stats, regeneration_status
from layertap.storage.errors import InputError
from layertap.storage.store import open_store
from tiny_models import CHATML_TEMPLATE, tiny_model_dir

REFUSE = "REFUSED"
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' and m['content'].startswith('" + REFUSE + "') %}"
                   "{{ raise_exception('this template refuses the turn') }}{% endif %}{% endfor %}" + CHATML_TEMPLATE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`transformers serve MODEL` on the CPU, pinned to the model, on its own port."""

    def __init__(self, model: str, log: Path, port: int | None = None):
        self.model, self.log, self.port = model, log, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model, "--device", "cpu",
               "--dtype", "float32", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(self.log.read_text()[-3000:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def strict_model(root: Path) -> str:
    folder = Path(tiny_model_dir(root, "llama", num_layers=2))
    (folder / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return strict_model(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield s
    s.kill()


def write_sharegpt(path: Path, n: int, refuse: tuple[int, ...] = ()) -> str:
    """The first `n` real ShareGPT conversations, cut to two exchanges; rows in `refuse` get a user
    turn the server's template refuses."""
    with open(path, "w") as f:
        for i, row in enumerate(sharegpt_conversations(n)):
            turns = [t for t in row["conversations"] if t["from"] in ("human", "gpt")][:4]
            turns = [{**t, "value": t["value"][:240]} for t in turns]  # an answered last prompt fits 512 tokens
            if i in refuse:
                turns[0] = {"from": "human", "value": f"{REFUSE}: {turns[0]['value']}"}
            if i == 1:  # line and paragraph separators that real chats hold: not line ends in a part
                turns[0] = {**turns[0], "value": turns[0]["value"] + " \u2028 \u2029 \x85 \x1c end"}
            f.write(json.dumps({"id": row["id"], "conversations": turns}) + "\n")
    return str(path)


def regenerate_args(data: str, out: str, server: Server, *extra: str) -> list[str]:
    return ["regenerate", "--dataset", data, "--out", out, "--endpoint", server.url, "--model", server.model,
            "--max-tokens", "8", "--rows-per-part", "4", "--concurrency", "4", *extra]


def source_chats(data: str) -> list[list[dict]]:
    return [normalize_chat(r["conversations"], str(i), TokenizeStats(), require_assistant=False)
            for i, r in enumerate(load_rows(data))]


def chat(server: Server, messages: list[dict], max_tokens: int = 8) -> str:
    body = json.dumps({"model": server.model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{server.url}/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def assert_every_row_once(out: str, n: int) -> list[dict]:
    """Each source row is in exactly one part or refused exactly once, and the parts are complete."""
    store = open_store(out)
    rows = list(iter_rows(out))
    refused = [r["row"] for s in read_stats(store, sorted(done_parts(store))) for r in s["refused"]]
    regenerated = [r["regenerated"]["row"] for r in rows]
    assert len(regenerated) == len(set(regenerated))
    assert sorted(regenerated + refused) == list(range(n))
    return rows


@pytest.mark.parametrize("where", ["local", "s3"])
def test_regenerates_sharegpt_turn_by_turn_and_extract_reads_it(where, server, model, tmp_path, s3_bucket, capsys,
                                                                 monkeypatch):
    data = write_sharegpt(tmp_path / "chats.jsonl", 24, refuse=(5,))
    out = str(tmp_path / "regen") if where == "local" else f"s3://{s3_bucket}/regen"
    assert cli(regenerate_args(data, out, server)) == 0
    rows = assert_every_row_once(out, 24)
    assert len(rows) == 23

    # System and user turns are kept; every assistant turn is the server's answer to the
    # regenerated history before it (greedy: the same request gives the same answer).
    sources = source_chats(data)
    multi_turn = answered_last = 0
    for row in rows:
        source, messages = sources[row["regenerated"]["row"]], row["messages"]
        last_prompt = ["assistant"] if source[-1]["role"] == "user" else []  # answered too
        assert [m["role"] for m in messages] == [m["role"] for m in source] + last_prompt
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                assert m["content"] == chat(server, messages[:k])
            else:
                assert m["content"] == source[k]["content"]
        answered_last += bool(last_prompt)
        assert len(row["regenerated"]["finish_reasons"]) == sum(m["role"] == "assistant" for m in messages)
        multi_turn += sum(m["role"] == "assistant" for m in messages) > 1
    assert multi_turn >= 5 and answered_last >= 5

    # The refused row is recorded with the server's answer as its reason, and counted.
    store = open_store(out)
    [refused] = [r for s in read_stats(store, sorted(done_parts(store))) for r in s["refused"]]
    assert refused["row"] == 5 and refused["reason"].startswith("turn 1: 500 after 4 tries")
    recipe = json.loads(store.get(RECIPE))
    assert recipe["model"] == model and recipe["sampling"]["temperature"] == 0.0
    assert recipe["sampling"]["max_tokens"] == 8 and recipe["dataset"]["rows"] == 24

    # status tells what was done; a rerun has nothing to do; the output reads as an extraction's dataset.
    capsys.readouterr()
    assert cli(["status", out]) == 0
    text = capsys.readouterr().out
    assert "parts    6/6 done" in text and "24/24 done: 23 regenerated, 1 refused (http_500: 1" in text
    assert cli(regenerate_args(data, out, server)) == 0
    assert cli(["extract", "--model", model, "--dataset", out, "--out", str(tmp_path / "run"), "--layers", "0,1",
                "--dtype", "float32", "--max-length", "64"]) == 0
    manifest = json.loads(open_store(str(tmp_path / "run")).get("manifest.json"))
    assert manifest["dataset"]["num_samples"] == 23 and manifest["dataset"]["path"] == out
    if where == "s3":  # the "s3" settings of extract's --config reach the dataset's store, as they reach --out's
        settings = tmp_path / "layertap.json"
        settings.write_text(json.dumps({"s3": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}}))
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # answers nothing
        monkeypatch.setenv("LAYERTAP_S3_UNREACHABLE_ATTEMPTS", "1")
        assert cli(["extract", "--model", model, "--dataset", out, "--out", str(tmp_path / "run2"), "--layers", "0,1",
                    "--dtype", "float32", "--max-length", "64", "--config", str(settings)]) == 0
        again = json.loads(open_store(str(tmp_path / "run2")).get("manifest.json"))
        assert again["dataset"]["fingerprint"] == manifest["dataset"]["fingerprint"]
    capsys.readouterr()


def _wait_for_parts(out: str, at_least: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        n = len(done_parts(open_store(out))) if os.path.exists(os.path.join(out, RECIPE)) else 0
        if n >= at_least:
            return n
        assert proc.poll() is None, "the regeneration ended before it was interrupted"
        time.sleep(0.05)
    raise TimeoutError(f"fewer than {at_least} parts after {timeout} s")


def _layertap(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "layertap", *args], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_kill_9_mid_run_then_rerun_gives_every_row_exactly_once(server, tmp_path):
    data = write_sharegpt(tmp_path / "chats.jsonl", 40)
    out = str(tmp_path / "regen")
    args = regenerate_args(data, out, server, "--concurrency", "2", "--max-tokens", "16")
    proc = _layertap(args, tmp_path / "first.log")
    _wait_for_parts(out, 2, proc)
    from layertap.manifests.regeneration import live_tasks
    assert list(live_tasks(open_store(out))) == [(0, 1)]  # it holds its task's lease while it works
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    parts_before = len(done_parts(open_store(out)))
    assert 2 <= parts_before < 10
    assert cli(args) == 0  # takes over the lease of the process killed here at once
    assert len(done_parts(open_store(out))) == 10
    assert len(assert_every_row_once(out, 40)) == 40
    assert live_tasks(open_store(out)) == {}


@pytest.mark.slow
def test_a_server_killed_and_restarted_mid_run_is_ridden_out(model, tmp_path):
    server = Server(model, tmp_path / "serve.log").start()
    try:
        data = write_sharegpt(tmp_path / "chats.jsonl", 48)  # one request at a time: seconds of work left
        out = str(tmp_path / "regen")
        proc = _layertap(regenerate_args(data, out, server, "--concurrency", "1", "--max-tokens", "16",
                                         "--retry-for", "180"), tmp_path / "regen.log")
        _wait_for_parts(out, 1, proc)
        server.kill()
        time.sleep(1)
        assert proc.poll() is None  # still waiting for the server
        server.start()
        assert proc.wait(timeout=300) == 0, (tmp_path / "regen.log").read_text()[-3000:]
        assert len(assert_every_row_once(out, 48)) == 48
        assert "retrying for up to" in (tmp_path / "regen.log").read_text()
    finally:
        server.kill()


def test_unreachable_endpoint_and_wrong_model_are_clear_errors(server, tmp_path, capsys, caplog):
    data = write_sharegpt(tmp_path / "chats.jsonl", 4)
    closed = f"http://127.0.0.1:{free_port()}"
    t0 = time.time()
    assert cli(["regenerate", "--dataset", data, "--out", str(tmp_path / "a"), "--endpoint", closed,
                "--model", "m"]) == 2
    assert time.time() - t0 < 30  # not the 15-minute outage window: the server never answered
    err = capsys.readouterr().err
    assert f"cannot reach {closed}" in err and "--endpoint" in err
    # nor does its warning promise that window (it said "retrying for up to 900 s", then stopped)
    assert "retrying for up to" not in caplog.text and "before taking --endpoint for wrong" in caplog.text

    assert cli(["regenerate", "--dataset", data, "--out", str(tmp_path / "b"), "--endpoint", server.url,
                "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "model 'no-such-model' is not served" in err and server.model in err
    assert not any(done_parts(open_store(str(tmp_path / "b"))))
    # doing as told: the recipe written before the check does not lock the output to the typo
    assert cli(["regenerate", "--dataset", data, "--out", str(tmp_path / "b"), "--endpoint", server.url,
                "--model", server.model]) == 0, capsys.readouterr().err
    assert len(done_parts(open_store(str(tmp_path / "b")))) == 1


def test_a_rerun_with_other_settings_is_refused_and_bad_inputs_are_named(server, tmp_path, capsys):
    data = write_sharegpt(tmp_path / "chats.jsonl", 4)
    out = str(tmp_path / "regen")
    assert cli(regenerate_args(data, out, server)) == 0
    said = capsys.readouterr().out  # its end on stdout, as extract's, train's and import's
    assert f"regeneration at {open_store(out).uri}" in said and "COMPLETE" in said and "layertap extract --dataset" in said
    assert cli(regenerate_args(data, out, server, "--temperature", "0.7")) == 2
    assert "temperature: output has 0.0, now 0.7" in capsys.readouterr().err

    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    assert cli(regenerate_args(str(tokens), str(tmp_path / "t"), server)) == 2
    assert "pre-tokenized" in capsys.readouterr().err

    # An unfinished regeneration is not an extraction's dataset.
    unfinished = tmp_path / "unfinished"
    assert cli(regenerate_args(write_sharegpt(tmp_path / "more.jsonl", 12), str(unfinished), server,
                               "--task", "0/3")) == 0
    capsys.readouterr()
    with pytest.raises(Exception, match=r"unfinished regeneration: 1 of 3 parts done"):
        load_rows(str(unfinished))
    assert cli(["status", str(unfinished)]) == 3
    assert "parts    1/3 done" in capsys.readouterr().out
    (unfinished / "parts" / "000007.jsonl").write_text("{}\n")  # a stray past the recipe's parts counts for none
    assert cli(["status", str(unfinished), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["parts_done"] == 1
    (unfinished / "parts" / "000007.jsonl").unlink()
    assert cli(["delete", str(unfinished), "--yes"]) == 0  # recognized as a regeneration: no --force needed
    assert not unfinished.exists() or not any(unfinished.rglob("*.json*"))


def test_a_delete_keeps_the_recipe_last_and_parts_without_one_are_not_taken_for_done(server, tmp_path, capsys):
    """The recipe went in the delete's parallel wave with the parts: a delete cut short left parts
    without it, which the same `delete` refused (no longer a regeneration) and a `regenerate` at
    that --out took as done (another model's answers, reported complete). The recipe goes last; a
    prefix of parts without one is refused, naming it."""
    from layertap.manifests.delete import delete_all

    data = write_sharegpt(tmp_path / "chats.jsonl", 8)
    out = str(tmp_path / "regen")
    assert cli(regenerate_args(data, out, server)) == 0
    store = open_store(out)
    order: list[list[str]] = []
    deleting = store.delete_many
    store.delete_many = lambda keys: (order.append(list(keys)), deleting(keys))[1]
    assert delete_all(store, [o.key for o in store.list()], threads=1) > 2
    assert order[-1] == [RECIPE] and list(store.list()) == []

    assert cli(regenerate_args(data, out, server)) == 0
    store.delete(RECIPE)  # what a delete cut short left before
    capsys.readouterr()
    assert cli(regenerate_args(data, out, server, "--rows-per-part", "3")) == 2
    err = capsys.readouterr().err
    assert f"holds 2 part(s) ({store.uri}/parts/000000.jsonl ...) but no {RECIPE}" in err
    assert f"`layertap delete {store.uri} --force`" in err and not store.exists(RECIPE)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_serve_starts_the_server_for_the_run_and_a_stop_takes_it_down(model, tmp_path):
    """--serve: the server starts with the run, and goes with it, on success and on SIGTERM
    (a Slurm preemption); the rerun continues where the stopped one left off."""
    data = write_sharegpt(tmp_path / "chats.jsonl", 48)
    out, port = str(tmp_path / "regen"), free_port()
    serve = (f"{sys.executable} -m transformers.cli.transformers serve {model} --device cpu --dtype float32 "
             f"--host 127.0.0.1 --port {port}")
    args = ["regenerate", "--dataset", data, "--out", out, "--endpoint", f"http://127.0.0.1:{port}", "--model", model,
            "--max-tokens", "16", "--rows-per-part", "1", "--concurrency", "1", "--serve", serve,
            "--serve-log", str(tmp_path / "server.log")]
    proc = _layertap(args, tmp_path / "first.log")
    # A part a row: the stop lands with dozens of requests left, however fast this machine answers
    # (at 4 rows a part the whole run once ended between the first part and the signal).
    _wait_for_parts(out, 1, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert not _port_open(port)  # the server went with it
    log = (tmp_path / "first.log").read_text()
    assert "rerun the same command to continue" in log and "the server stopped" in log
    assert 1 <= len(done_parts(open_store(out))) < 48

    assert cli(args) == 0
    assert not _port_open(port)
    assert len(assert_every_row_once(out, 48)) == 48
    assert (tmp_path / "server.log").stat().st_size > 0  # the server wrote there, not into our log


def test_serve_that_exits_is_a_clear_error(tmp_path, capsys):
    data = write_sharegpt(tmp_path / "chats.jsonl", 4)
    assert cli(["regenerate", "--dataset", data, "--out", str(tmp_path / "o"), "--endpoint", "http://127.0.0.1:9",
                "--model", "m", "--serve", "exit 3"]) == 2
    assert "the server exited with code 3 before it answered" in capsys.readouterr().err


def test_the_served_servers_output_goes_to_stderr_not_the_status_on_stdout(tmp_path, capfd):
    """Without --serve-log the server inherited stdout (vLLM logs there), mixed into the status that
    `regenerate` prints on stdout for scripts."""
    data = write_sharegpt(tmp_path / "chats.jsonl", 4)
    assert cli(["regenerate", "--dataset", data, "--out", str(tmp_path / "o"), "--endpoint", "http://127.0.0.1:9",
                "--model", "m", "--serve", "echo SERVER-SAYS-HELLO; exit 3"]) == 2
    out, err = capfd.readouterr()
    assert "SERVER-SAYS-HELLO" in err and "SERVER-SAYS-HELLO" not in out


def test_the_recorded_endpoint_carries_no_credentials():
    from layertap.extract.chat_client import api_base
    from layertap.storage.redact import public_url

    assert public_url("http://user:s3cret@gpu7:8000/v1?token=abc") == "http://gpu7:8000/v1"
    assert api_base("http://gpu7:8000") == "http://gpu7:8000/v1" == api_base("http://gpu7:8000/v1/")
    with pytest.raises(Exception, match="not an http"):
        api_base("gpu7:8000")


def test_an_endpoint_naming_an_unset_variable_is_refused_without_its_password(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LAYERTAP_TEST_PORT", raising=False)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert cli(["regenerate", "--dataset", str(data), "--out", str(tmp_path / "regen"), "--model", "m",
                "--endpoint", "http://user:s3cret@gpu7:$LAYERTAP_TEST_PORT/v1"]) == 2
    err = capsys.readouterr().err
    assert "names a variable that is not set here" in err and "s3cret" not in err, err


def test_a_stray_jsonl_among_the_parts_is_named_not_a_traceback(tmp_path):
    """A file of one's own under parts/ (notes.jsonl) crashed status and resume with int()'s
    ValueError; parts layertap wrote are still read."""
    store = open_store(str(tmp_path / "regen"))
    store.put("parts/000001.jsonl", b"{}\n")
    assert sorted(done_parts(store)) == [1]
    store.put("parts/notes.jsonl", b"{}\n")
    with pytest.raises(InputError, match="parts/notes.jsonl is not a part layertap wrote"):
        done_parts(store)


def test_a_prompt_only_row_is_answered_and_a_row_without_a_prompt_is_refused(server, model, tmp_path, capsys):
    """`[system,] user` rows (a prompt set, the usual input of a regeneration) were written as
    "regenerated" with no request made and no answer, then skipped by extraction as having no
    assistant turn: N rows regenerated, 0 tokens generated."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Name a colour."}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "And then?"}]},
            {"messages": [{"role": "system", "content": "Nothing to answer."}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "regen")
    assert cli(regenerate_args(str(data), out, server)) == 0
    got = {r["regenerated"]["row"]: r for r in assert_every_row_once(out, 4)}
    assert sorted(got) == [0, 1, 2]
    for i, row in got.items():
        messages = row["messages"]
        assert [m["role"] for m in messages] == [m["role"] for m in rows[i]["messages"]] + ["assistant"]
        assert messages[-1]["content"] == chat(server, messages[:-1]) and messages[-1]["content"]
        assert row["regenerated"]["completion_tokens"] > 0
    [refused] = [r for s in read_stats(open_store(out), sorted(done_parts(open_store(out)))) for r in s["refused"]]
    assert refused["row"] == 3 and refused["kind"] == "no_prompt"


def test_a_task_at_work_is_not_run_twice_nor_submitted_again(server, tmp_path, capsys, monkeypatch):
    """Parts hold no leases: a `submit regenerate` while its array ran, or a command run twice,
    answered the same parts twice (each part is written once: the other's generation was wasted).
    Each `--task I/N` process now holds a lease on its task at the output (the real lease, held
    here by this test as a running task would): a second process of the same task is refused
    once the lease is renewed, one of another split is refused at once (their parts overlap),
    `submit regenerate` leaves the running task out, and the task runs once the lease is gone."""
    from layertap.manifests.output_lease import OutputLease
    from layertap.manifests.regeneration import live_tasks, task_role
    from test_slurm import submit

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # the lease would name the suite's own job
    data = write_sharegpt(tmp_path / "chats.jsonl", 16)
    out = str(tmp_path / "regen")
    store = open_store(out)
    assert cli(regenerate_args(data, out, server, "--task", "1/2")) == 0  # parts 1 and 3
    capsys.readouterr()
    running = OutputLease(store, ttl_s=4.0, role=task_role(0, 2))  # alive through a stall of a busy machine
    running.acquire()
    try:
        assert list(live_tasks(store)) == [(0, 2)]
        assert cli(regenerate_args(data, out, server, "--task", "0/2")) == 2
        assert f"another `layertap regenerate --task 0/2` is writing to {out}" in capsys.readouterr().err
        assert cli(regenerate_args(data, out, server, "--task", "0/3")) == 2  # parts 0 and 3: 0 is task 0/2's
        assert "a regeneration split into 2 tasks is at work there now (task 0/2" in capsys.readouterr().err
        assert sorted(done_parts(store)) == [1, 3]  # neither answered anything

        store.delete(f"parts/{3:06d}.jsonl")  # task 1's part lost: task 1 is submitted, task 0 is left out
        base = ["regenerate", "--dry-run", "--gpus-per-node", "0", "--dataset", data, "--out", out, "--endpoint",
                server.url, "--model", server.model, "--max-tokens", "8", "--rows-per-part", "4", "--temperature", "0"]
        assert submit(*base, "--tasks", "2") == 0
        said = capsys.readouterr().out
        assert "task 0 is at work now: left out" in said and "array of 1 task(s), --array=1" in said
        assert submit(*base, "--tasks", "4") == 2
        assert "a regeneration split into 2 tasks is at work on" in capsys.readouterr().err
        assert cli(["delete", out, "--yes"]) == 2
        assert "1 `layertap regenerate` task(s) are writing to" in capsys.readouterr().err
    finally:
        running.release()
    assert live_tasks(store) == {}
    assert cli(regenerate_args(data, out, server, "--task", "0/2")) == 0
    assert cli(regenerate_args(data, out, server, "--task", "1/2")) == 0
    assert sorted(done_parts(store)) == [0, 1, 2, 3] and len(assert_every_row_once(out, 16)) == 16
    assert live_tasks(store) == {}  # each released its lease


def test_serve_refuses_a_port_something_already_listens_on(server, tmp_path, capsys):
    """A server left running (a killed regenerate's) or another service on --endpoint's port: the
    server --serve started failed to bind, while the one there answered every request, and the run
    finished against it (another model, maybe), exit 0."""
    data = write_sharegpt(tmp_path / "chats.jsonl", 4)
    out = tmp_path / "regen"
    assert cli(regenerate_args(data, str(out), server, "--serve", "sleep 60")) == 2
    assert f"something already listens at {server.url}" in capsys.readouterr().err
    assert not out.exists() or not list(out.rglob("*.jsonl"))


def test_two_bad_rows_side_by_side_are_refused_not_an_outage(server, tmp_path):
    """At --concurrency 2 two rows the server always fails (a 500 each) made every failing request
    look like an outage: ServerGone after --retry-for, on every rerun, the output never finished."""
    data = write_sharegpt(tmp_path / "chats.jsonl", 8, refuse=(2, 3))
    out = str(tmp_path / "regen")
    assert cli(regenerate_args(data, out, server, "--concurrency", "2", "--retry-for", "20")) == 0
    store = open_store(out)
    refused = sorted(r["row"] for s in read_stats(store, sorted(done_parts(store))) for r in s["refused"])
    assert refused == [2, 3]


def test_a_part_that_cannot_be_written_stops_the_run_and_its_refusals_are_never_lost(server, tmp_path, monkeypatch):
    """A store refusing writes (expired credentials) was noticed once every row of the task had been
    answered: hours of generation thrown away. And a crash between a part and its stats lost the
    part's refused rows for good (they are in no part), while status said complete."""
    import layertap.extract.regenerate as regenerate

    data = write_sharegpt(tmp_path / "chats.jsonl", 24, refuse=(1,))
    out = str(tmp_path / "regen")
    answering = regenerate._answer_row
    answered = []

    async def counted(*args, **kwargs):
        answered.append(1)
        return await answering(*args, **kwargs)

    real_open = regenerate.open_store

    def failing(method: str, prefix: str, error: Exception, times: int):
        """`open_store` whose stores fail their first `times` calls of `method` on keys under `prefix`."""
        def opened(uri):
            store, failed = real_open(uri), []
            call = getattr(store, method)

            def fail(key, body):
                if key.startswith(prefix) and len(failed) < times:
                    failed.append(key)
                    raise error
                return call(key, body)
            setattr(store, method, fail)
            return store
        return opened

    with monkeypatch.context() as m:
        m.setattr(regenerate, "_answer_row", counted)
        m.setattr(regenerate, "open_store",
                  failing("put_if_absent", "parts/", PermissionError("the store refuses writes (expired credentials)"),
                          times=10**9))
        with pytest.raises(PermissionError):
            cli(regenerate_args(data, out, server, "--concurrency", "2", "--rows-per-part", "2"))
    assert len(answered) <= 8  # stopped within a few rows of the first failed write, not at row 24
    assert done_parts(open_store(out)) == {}
    assert cli(regenerate_args(data, out, server, "--concurrency", "2", "--rows-per-part", "2")) == 0
    s = regeneration_status(open_store(out))
    assert s["complete"] and sum(s["rows_refused"].values()) == 1 and s["rows_regenerated"] == 23

    out = str(tmp_path / "regen2")  # the stats' write fails once: before the part now, so the rerun writes both
    with monkeypatch.context() as m:
        m.setattr(regenerate, "open_store", failing("put", "stats/", OSError("the store failed the stats' write"), 1))
        with pytest.raises(OSError):
            cli(regenerate_args(data, out, server, "--concurrency", "1", "--rows-per-part", "2"))
    assert cli(regenerate_args(data, out, server, "--concurrency", "1", "--rows-per-part", "2")) == 0
    s = regeneration_status(open_store(out))
    assert s["complete"] and sum(s["rows_refused"].values()) == 1 and s["rows_regenerated"] == 23


def test_an_endpoint_whose_connections_hang_is_reported_unreachable_quickly(tmp_path, capsys):
    """A wrong address whose packets are dropped (here: a listener whose backlog is full) waited the
    whole --request-timeout a try and ended, half an hour later at the defaults, as "failed every
    request" (an outage). A connection not made within 10 s (or the request timeout, if shorter) is
    a refused one: three tries, then "cannot reach"."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fill = []
    for _ in range(4):  # fill its queue: later connections are never answered
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fill.append(c)
    try:
        t0 = time.monotonic()
        args = ["regenerate", "--dataset", write_sharegpt(tmp_path / "chats.jsonl", 2), "--out", str(tmp_path / "o"),
                "--endpoint", f"http://127.0.0.1:{port}/v1", "--model", "m", "--request-timeout", "2",
                "--retry-for", "120"]
        assert cli(args) == 2
        err = capsys.readouterr().err
        assert f"cannot reach http://127.0.0.1:{port}/v1 (no connection within 2 s)" in err
        assert time.monotonic() - t0 < 60  # not the --retry-for of an outage
    finally:
        for c in fill:
            c.close()
        listener.close()


def test_a_second_stop_while_the_served_server_stops_does_not_leave_it_running(tmp_path, monkeypatch):
    """Slurm may send the stop twice. The first stopped the run; the second broke into the wait for
    the server to exit (a server slow to stop: here one that ignores SIGTERM), and its SIGKILL
    never came: the server kept the GPUs and the port."""
    import threading

    import layertap.extract.served as served
    from layertap.manifests.preemption import Preempted, StopSignals

    monkeypatch.setattr(served, "STOP_WAIT_S", 3.0)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": []}')
    port = free_port()
    command = (f"trap '' TERM; exec {sys.executable} -m http.server {port} --bind 127.0.0.1 "
               f"--directory {tmp_path}")
    with StopSignals(at_once=True):
        with pytest.raises(Preempted):
            with served.serving(command, f"http://127.0.0.1:{port}/v1", timeout_s=30):
                assert _port_open(port)
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # while it stops
                raise Preempted("received SIGTERM")  # the first stop, as the run's AsyncStop raises it
    assert not _port_open(port)


def test_assistant_turns_before_the_first_user_turn_are_counted_not_dropped_in_silence(server, tmp_path, caplog):
    """ShareGPT splits long chats: a third of its rows open with an assistant turn, which answers a
    prompt the row lacks and is left out. Extraction counted them; regeneration dropped them without
    a word."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"id": "a", "conversations": [
        {"from": "gpt", "value": "an answer to an earlier part"}, {"from": "human", "value": "Hello there"},
        {"from": "gpt", "value": "Hi"}]}) + "\n" + json.dumps({"id": "b", "conversations": [
        {"from": "human", "value": "How are you?"}, {"from": "gpt", "value": "Fine"}]}) + "\n")
    caplog.set_level("INFO", logger="layertap.extract.regenerate")
    assert cli(regenerate_args(str(path), str(tmp_path / "regen"), server)) == 0
    assert "; 1 assistant turn(s) before a row's first user turn left out" in caplog.text
