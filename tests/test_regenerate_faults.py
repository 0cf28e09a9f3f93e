"""`layertap regenerate` against server failures that the real `transformers serve` in
test_regenerate.py cannot produce on demand: an engine that dies behind a live HTTP server, one
slow row, answers cut by "abort". A small OpenAI-compatible HTTP server plays them.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import socket
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from layertap.cli import main as cli
from layertap.extract.chat_client import EndpointError, ServerGone
from layertap.extract.regenerate import RegenerateConfig, _Part, _write_part, Totals, regenerate
from layertap.extract.regenerated import iter_rows
from layertap.extract.served import ServerFailed, serving
from layertap.storage.errors import ConfigError
from layertap.storage.redact import redacted
from layertap.manifests.regeneration import done_parts, read_stats, stats_key
from layertap.storage.store import open_store

# (request number, last user turn) -> (HTTP status, content, finish_reason, seconds to wait first);
# content as bytes or a dict is the whole body as sent (a malformed answer)
Answer = Callable[[int, str], tuple[int, str | bytes | dict, str | None, float]]


def ok(n: int, prompt: str) -> tuple[int, str, str | None, float]:
    return 200, f"answer to {prompt}", "stop", 0.0


class FakeServer:
    """An OpenAI-compatible server whose every chat answer `answer` chooses; `answer` may be swapped mid-run."""

    def __init__(self, answer: Answer = ok):
        self.answer, self.requests = answer, 0
        self.seen: list[tuple[str, str | None]] = []  # each request's path and Authorization header
        self.bodies: list[dict] = []  # each chat request's body
        self.refuse: Callable[[dict], str | None] = lambda body: None  # a 400's message for a request's settings
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def send(self, status: int, body: dict | bytes) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake.seen.append((self.path, self.headers.get("Authorization")))
                self.send(200, {"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                            "owned_by": "x"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.requests += 1
                fake.seen.append((self.path, self.headers.get("Authorization")))
                fake.bodies.append(body)
                if (message := fake.refuse(body)) is not None:
                    return self.send(400, {"error": {"message": message}})
                status, content, finish, wait = fake.answer(fake.requests, body["messages"][-1]["content"])
                time.sleep(wait)
                if status != 200:
                    return self.send(status, {"error": {"message": content}})
                if not isinstance(content, str):
                    return self.send(200, content)
                self.send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                "choices": [{"index": 0, "finish_reason": finish,
                                             "message": {"role": "assistant", "content": content}}],
                                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.http.shutdown()
    s.http.server_close()


def config(tmp_path: Path, fake: FakeServer | None = None, rows: int = 8, **kw) -> RegenerateConfig:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                                     {"role": "assistant", "content": "old"}]}) + "\n"
                            for i in range(rows)))
    endpoint = fake.url if fake is not None else ""
    return RegenerateConfig(**{"dataset": str(data), "out": str(tmp_path / "out"), "endpoint": endpoint, "model": "m",
                               "concurrency": 2, "rows_per_part": 4, "progress": False, "request_timeout_s": 1.0,
                               "retry_for_s": 2.0, **kw})


def refused(out: str) -> list[tuple[int, str]]:
    store = open_store(out)
    return [(r["row"], r["kind"]) for s in read_stats(store, sorted(done_parts(store))) for r in s["refused"]]


def test_an_engine_that_dies_behind_a_live_server_stops_the_run_and_refuses_no_row(tmp_path, fake):
    """500 to every request mid-run is an outage (ServerGone, parts open kept for the rerun), not
    every remaining row refused; a rerun once the server is back regenerates them all."""
    fake.answer = lambda n, prompt: ok(n, prompt) if n <= 5 else (500, "EngineCore died", None, 0.0)
    cfg = config(tmp_path, fake, rows=12)
    with pytest.raises(ServerGone, match="500: EngineCore died"):
        regenerate(cfg)
    assert refused(cfg.out) == [] and len(done_parts(open_store(cfg.out))) <= 1

    fake.answer = ok
    totals = regenerate(config(tmp_path, fake, rows=12))
    assert totals.refused == 0 and len(list(iter_rows(cfg.out))) == 12


def test_one_slow_row_is_refused_as_a_timeout_and_a_hung_server_stops_the_run(tmp_path, fake):
    fake.answer = lambda n, prompt: (*ok(n, prompt)[:3], 3.0 if prompt == "q5" else 0.0)
    cfg = config(tmp_path, fake)
    totals = regenerate(cfg)
    assert refused(cfg.out) == [(5, "timeout")] and totals.regenerated == 7

    fake.answer, fake.requests = lambda n, prompt: (*ok(n, prompt)[:3], 3.0 if n > 3 else 0.0), 0
    (tmp_path / "hung").mkdir()
    with pytest.raises(ServerGone, match="--request-timeout"):
        regenerate(config(tmp_path / "hung", fake))
    assert refused(str(tmp_path / "hung" / "out")) == []


def test_answers_that_end_neither_in_stop_nor_length_are_asked_again_then_refused(tmp_path, fake):
    """vLLM's "abort", SGLang's "error" or no finish_reason at all: an empty or cut answer is never stored."""
    aborted_once: set[str] = set()

    def answer(n: int, prompt: str) -> tuple[int, str, str | None, float]:
        if prompt == "q1":
            return 200, "", "abort", 0.0
        if prompt == "q2":
            return 200, "cut", None, 0.0
        if prompt == "q3" and prompt not in aborted_once:  # aborted once, answered when asked again
            aborted_once.add(prompt)
            return 200, "", "error", 0.0
        return 200, f"answer to {prompt}", "length" if prompt == "q4" else "stop", 0.0

    fake.answer = answer
    cfg = config(tmp_path, fake)
    totals = regenerate(cfg)
    assert refused(cfg.out) == [(1, "finish_abort"), (2, "finish_missing")]
    rows = {r["id"]: r for r in iter_rows(cfg.out)}
    assert rows["r3"]["messages"][-1]["content"] == "answer to q3" and totals.truncated == 1
    assert all(m["content"] for r in rows.values() for m in r["messages"])


def test_the_serve_command_is_logged_with_its_keys_masked(tmp_path, caplog):
    command = "exit 3; vllm serve /m --api-key sk-live-1 --hf-token=hf_2 --port 8000 --db-password 3"
    with caplog.at_level(logging.INFO), pytest.raises(ServerFailed):
        with serving(command, "http://127.0.0.1:9", timeout_s=10):
            pass
    assert "--api-key *** --hf-token=*** --port 8000 --db-password ***" in caplog.text
    assert not any(secret in caplog.text for secret in ("sk-live-1", "hf_2", "password 3"))


def test_a_urls_password_and_query_and_an_authorization_header_are_masked():
    """A --serve line's mirror URL with a password, a token in a URL's query and a header's Bearer
    key were logged as typed (and echoed in each Slurm task's log)."""
    line = ("HF_ENDPOINT=https://mirror:SECRETPW@hf.example vllm serve https://h/m?token=T0KEN "
            "--header 'Authorization: Bearer SK-LIVE' --port 8")
    assert redacted(line) == ("HF_ENDPOINT=https://***@hf.example vllm serve https://h/m?*** "
                              "--header 'Authorization: Bearer ***' --port 8")
    # a password holding "@" is masked to its last "@" (its tail was shown), a fragment as a query
    assert redacted("HF_ENDPOINT=https://u:PW@RT@hf.example vllm serve https://h/m#T0KEN") == \
        "HF_ENDPOINT=https://***@hf.example vllm serve https://h/m#***"


def test_every_key_of_an_option_that_takes_several_is_masked():
    """vLLM's --api-key takes several keys (`--api-key k1 k2`): the second was logged as it was."""
    assert redacted("vllm serve /m --api-key sk-1 'sk 2' sk-3 --port 8000") == "vllm serve /m --api-key *** --port 8000"
    assert redacted("vllm serve /m --api-key sk-1 sk-2&& echo up") == "vllm serve /m --api-key ***&& echo up"
    assert redacted("vllm serve /m --api-key=sk-1 --port 8") == "vllm serve /m --api-key=*** --port 8"


def test_a_key_at_the_end_of_a_quoted_serve_command_keeps_the_closing_quote(tmp_path):
    """`submit regenerate --dry-run --serve '... --api-key sk-1'` printed `--api-key ***` without
    the closing quote: a script bash refuses (a user walk). The key is masked, the quote kept."""
    line = "--serve 'vllm serve m --port $LAYERTAP_TASK_PORT --api-key sk-SECRET' --tasks 2"
    assert redacted(line) == "--serve 'vllm serve m --port $LAYERTAP_TASK_PORT --api-key ***' --tasks 2"
    assert redacted('--serve "vllm serve m --api-key sk-1 sk-2"') == '--serve "vllm serve m --api-key ***"'
    assert redacted("--api-key ab'c --port 8") == "--api-key *** --port 8"  # a quote inside a value: masked with it
    # ... as shlex writes a key's quote inside a quoted --serve (a review: the key's rest was shown)
    serve = shlex.quote("vllm serve m --api-key sk'abcdef")
    assert redacted(f"--serve {serve}") == "--serve 'vllm serve m --api-key ***'"
    for value in ("ab''cd", 'abc""def', "a'\"b"):
        assert redacted(f"--token={value} --port 8") == "--token=*** --port 8"
    assert redacted("bash -c 'HF_TOKEN=hf_1'") == "bash -c 'HF_TOKEN=***'"  # an assignment's closing quote kept
    script = tmp_path / "shown.sh"
    script.write_text(f"cmd=(layertap regenerate {redacted(line)})\n")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_keys_a_server_command_passes_by_other_names_are_masked():
    """A secrets walk: --auth, a JSON override's "hf_token", an X-Api-Key header and an
    AWS_ACCESS_KEY_ID= assignment were logged (and echoed in each Slurm task's log) as typed. A
    flag without a value (--no-auth) keeps the option after it shown."""
    line = ("AWS_ACCESS_KEY_ID=AKIAEXAMPLE python srv.py --auth ruser:PW1 --hf-overrides '{\"hf_token\": \"hf_T0K\"}' "
            "--header 'X-Api-Key: sk-K3Y' --no-auth --port 8000 --max-tokens 512")
    assert redacted(line) == ("AWS_ACCESS_KEY_ID=*** python srv.py --auth *** --hf-overrides '{\"hf_token\": ***}' "
                              "--header 'X-Api-Key: ***' --no-auth --port 8000 --max-tokens 512")


def test_an_api_key_given_as_api_key_env_is_refused_without_showing_it(tmp_path, capsys):
    """`--api-key-env sk-...` (the key where its variable's name goes) ran with no key, and `submit
    regenerate` wrote the key into the job's script and each task's log."""
    args = ["--dataset", "d.jsonl", "--out", str(tmp_path / "o"), "--endpoint", "http://127.0.0.1:9/v1", "--model",
            "m", "--api-key-env", "sk-LEAK-k3y"]
    for command in (["regenerate"], ["submit", "regenerate", "--dry-run", "--gpus-per-node", "0"]):
        assert cli([*command, *args]) == 2
        said = capsys.readouterr()
        assert "--api-key-env takes the name of the environment variable" in said.err
        assert "LEAK" not in said.err + said.out
    with pytest.raises(ConfigError):
        config(tmp_path, api_key_env="MY KEY")
    assert config(tmp_path, api_key_env="VLLM_API_KEY").api_key_env == "VLLM_API_KEY"


def test_a_servers_error_that_quotes_the_request_back_is_recorded_scrubbed(tmp_path, fake):
    """A proxy that quotes the request in its 400s (the Authorization header, a URL with a
    password and a query) had them written into the output's stats/ and logged."""
    fake.refuse = lambda body: ("bad request from http://user:PASSWD99@proxy:8/v1?token=T0KEN99 (Authorization: "
                                "Bearer sk-LEAKED0000)") if body["messages"][-1]["content"] == "q1" else None
    cfg = config(tmp_path, fake, rows=2)
    regenerate(cfg)
    stats = "".join(p.read_text() for p in (tmp_path / "out").rglob("*.json"))
    assert "bad request" in stats and "proxy:8/v1" in stats
    assert not any(secret in stats for secret in ("LEAKED", "PASSWD99", "T0KEN99"))


def _racing_parts() -> tuple[_Part, _Part]:
    """Two processes' part 0 of rows 0 and 1: the winner answered row 0, the loser row 1."""
    winner, loser = _Part(0, range(2)), _Part(0, range(2))
    for part, row in ((winner, 0), (loser, 1)):
        part.rows[row] = {"id": str(row), "messages": [], "regenerated": {"row": row, "completion_tokens": 5,
                                                                         "finish_reasons": ["stop"]}}
        part.refused.append({"row": 1 - row, "id": str(1 - row), "reason": "x", "kind": "http_500"})
    return winner, loser


def test_a_process_that_loses_the_race_for_a_part_leaves_the_winners_stats(tmp_path):
    """Two processes finish the same part (a task run twice): the first part written is kept, and
    the stats are that part's, not the loser's: its refused rows are those the kept part lacks
    (the loser, which writes its stats before its part, writes them again from the kept one)."""
    store = open_store(str(tmp_path / "out"))
    winner, loser = _racing_parts()
    _write_part(store, winner, Totals())
    _write_part(store, loser, Totals())
    [kept] = [json.loads(line) for line in store.get("parts/000000.jsonl").splitlines()]
    stats = json.loads(store.get(stats_key(0)))
    assert kept["regenerated"]["row"] == 0 and [r["row"] for r in stats["refused"]] == [1]


def test_a_stop_signal_on_the_event_loop_cancels_the_run_and_is_raised_after_it():
    """A handler raising inside the loop landed in asyncio's socket write once ("fatal write
    error"), was retried as a connection error, and `regenerate` exited 0 after a SIGTERM.
    `AsyncStop` cancels the main task instead, lets its clean-up run, and raises the stop."""
    import asyncio
    import os
    import signal
    import threading

    from layertap.manifests.preemption import AsyncStop, Preempted

    cleaned: list[str] = []

    async def run() -> None:
        with AsyncStop():
            try:
                threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
                await asyncio.sleep(30)
            finally:
                cleaned.append("clean-up ran")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted, match="received SIGTERM"):
        asyncio.run(run())
    assert cleaned == ["clean-up ran"] and signal.getsignal(signal.SIGTERM) is before


# A server for --serve, in its own process: answers every chat ($SLOW seconds after it is asked); wants the
# Authorization header $AUTH when that is set (vLLM's --api-key); exits with code 9 at chat request $DIE_AT,
# and after $LIFETIME seconds (one a test could not stop does not outlive it for good).
SERVED = r"""
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
AUTH, DIE_AT, chats = os.environ.get("AUTH"), int(os.environ.get("DIE_AT", "0")), 0
SLOW = float(os.environ.get("SLOW", "0"))
threading.Timer(float(os.environ.get("LIFETIME", "600")), os._exit, (0,)).start()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def allowed(self):
        if AUTH and self.headers.get("Authorization") != AUTH:
            self.send(401, {"error": {"message": "Unauthorized"}})
            return False
        return True

    def do_GET(self):
        if self.allowed():
            self.send(200, {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "x"}]})

    def do_POST(self):
        global chats
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if not self.allowed():
            return
        chats += 1
        if chats == DIE_AT:
            os._exit(9)
        time.sleep(SLOW)
        message = {"role": "assistant", "content": "answer to " + body["messages"][-1]["content"]}
        self.send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_config(tmp_path: Path, env: str, endpoint: str = "http://127.0.0.1:{port}/v1", **kw) -> RegenerateConfig:
    """A run whose --serve starts SERVED with the shell assignments `env` on a free port."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script, port = tmp_path / "served.py", free_port()
    script.write_text(SERVED)
    return config(tmp_path, endpoint=endpoint.format(port=port), serve=f"{env} {sys.executable} {script} {port}",
                  **{"serve_timeout_s": 10.0, **kw})


def test_serve_is_ready_when_its_server_wants_a_key(tmp_path, monkeypatch):
    """The readiness poll sent no key: a server started with --api-key answered 401, taken for
    "not up yet" until --serve-timeout ran out. It sends the client's key now (a Bearer key, or an
    --endpoint's user:password, never in the URL), and a wrong key is said at once by the client."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    wait = 90.0  # --serve-timeout: one waited out would take longer than three servers' starts on a busy machine
    t0 = time.monotonic()
    assert regenerate(serve_config(tmp_path / "bearer", "AUTH='Bearer sk-test'", serve_timeout_s=wait)).regenerated == 8
    basic = "Basic " + base64.b64encode(b"u:pw").decode()
    assert regenerate(serve_config(tmp_path / "basic", f"AUTH='{basic}'", endpoint="http://u:pw@127.0.0.1:{port}/v1",
                                   serve_timeout_s=wait)).regenerated == 8
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong")
    with pytest.raises(EndpointError, match=r"answered 401 .*the environment variable --api-key-env names"):
        regenerate(serve_config(tmp_path / "wrong", "AUTH='Bearer sk-test'", serve_timeout_s=wait))
    assert time.monotonic() - t0 < wait  # never a --serve-timeout waited out


def test_a_regenerate_killed_outright_takes_its_served_server_with_it(tmp_path):
    """--serve's server runs in a session of its own (a stop must reach all it spawns), so a
    regenerate killed by SIGKILL or the OOM killer, outside a Slurm job, left it running: its port
    and GPUs held until someone found it. It gets SIGTERM when the regenerate dies now."""
    cfg = serve_config(tmp_path, "SLOW=30 LIFETIME=90", rows=4)
    port = int(cfg.endpoint.rsplit(":", 1)[1].split("/")[0])
    proc = subprocess.Popen([sys.executable, "-m", "layertap", "regenerate", "--dataset", cfg.dataset, "--out", cfg.out,
                             "--endpoint", cfg.endpoint, "--model", "m", "--serve", cfg.serve, "--serve-timeout", "30"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):  # the server is up; its first chats now wait 30 s for answers
            assert proc.poll() is None and time.monotonic() < deadline, "the regeneration ended before the kill"
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while _listening(port):
            assert time.monotonic() < deadline, "the served server outlived the regenerate that started it"
            time.sleep(0.1)
    finally:
        proc.kill()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_two_bad_rows_in_a_row_at_concurrency_1_are_refused_not_taken_for_an_outage(tmp_path, fake):
    """A refused row stayed counted as failing, so the next bad row's 500 was never alone: an
    outage, the run stopped (ServerGone) though the server answered every other row. A server
    that answers a known-good request now proves a failure the row's own; an outage still stops
    the run, and at --concurrency 1 too without refusing its first row."""
    fake.answer = lambda n, prompt: (500, f"template raised for {prompt}", None, 0.0) if prompt in ("q3", "q4") \
        else ok(n, prompt)
    cfg = config(tmp_path, fake, concurrency=1, retry_for_s=10.0)
    totals = regenerate(cfg)
    assert refused(cfg.out) == [(3, "http_500"), (4, "http_500")] and totals.regenerated == 6

    fake.answer, fake.requests = lambda n, prompt: ok(n, prompt) if n <= 3 else (500, "EngineCore died", None, 0.0), 0
    (tmp_path / "dead").mkdir()
    with pytest.raises(ServerGone, match="500: EngineCore died"):
        regenerate(config(tmp_path / "dead", fake, concurrency=1))
    assert refused(str(tmp_path / "dead" / "out")) == []


def test_a_task_without_parts_on_a_new_output_has_nothing_to_do(tmp_path, fake, caplog):
    """`submit regenerate --tasks` above the part count: the surplus tasks failed with a TypeError."""
    with caplog.at_level(logging.INFO):
        assert regenerate(config(tmp_path, fake, task=(3, 4))).parts == 0  # 8 rows, 2 parts: none for task 3
    assert "nothing to do for task 3/4" in caplog.text and fake.requests == 0


def test_malformed_answers_are_asked_again_then_the_row_is_refused_naming_what_was_wrong(tmp_path, fake):
    """A 200 whose body is not JSON (a proxy's page), has no choices or a choice without a message
    crashed the run with a traceback."""
    head = {"id": "x", "object": "chat.completion", "created": 0, "model": "m"}
    bodies = {"q1": b"<html>proxy error</html>", "q2": {**head, "choices": []},
              "q3": {**head, "choices": [{"index": 0, "finish_reason": "stop", "message": None}]}}
    fake.answer = lambda n, prompt: (200, bodies[prompt], "stop", 0.0) if prompt in bodies else ok(n, prompt)
    cfg = config(tmp_path, fake)
    assert regenerate(cfg).regenerated == 5
    store = open_store(cfg.out)
    reasons = {r["row"]: (r["kind"], r["reason"]) for s in read_stats(store, sorted(done_parts(store)))
               for r in s["refused"]}
    assert sorted(reasons) == [1, 2, 3] and {kind for kind, _ in reasons.values()} == {"malformed"}
    assert "not JSON" in reasons[1][1] and "<html>proxy error" in reasons[1][1]
    assert "no choices" in reasons[2][1] and "no message" in reasons[3][1]
    # the check, the good rows, 3 tries of each bad one and the known-good request that tells its failure from an outage
    assert fake.requests == 1 + 5 + 3 * (3 + 1)


def test_the_reasoning_of_a_server_that_names_it_reasoning_is_kept(tmp_path, fake):
    """vLLM returns a reasoning parser's thinking as `reasoning` (since 0.17: `reasoning_content`
    was removed); only `reasoning_content` was read, so every regenerated turn lost its thinking."""
    head = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}

    def answer(n: int, prompt: str):
        key = "reasoning" if prompt.endswith(("0", "2", "4", "6")) else "reasoning_content"
        return 200, {**head, "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": f"answer to {prompt}", key: f"thinking about {prompt}"}}]}, "stop", 0.0

    fake.answer = answer
    cfg = config(tmp_path, fake)
    assert regenerate(cfg).regenerated == 8
    rows = {r["id"]: r["messages"][-1] for r in iter_rows(cfg.out)}
    assert {i: m.get("reasoning_content") for i, m in rows.items()} == {f"r{i}": f"thinking about q{i}"
                                                                         for i in range(8)}


def test_an_endpoint_without_a_scheme_is_refused_without_its_password(tmp_path, capsys):
    """`user:password@host:8000/v1` parses with `user` as its scheme: the error printed the password."""
    cfg = config(tmp_path)
    assert cli(["regenerate", "--dataset", cfg.dataset, "--out", cfg.out, "--endpoint",
                "admin:s3cr3t@gpu-node:8000/v1", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert "is not an http(s) URL" in err and "gpu-node:8000/v1" in err and "s3cr3t" not in err


def test_verbose_logs_never_show_the_endpoints_password_and_its_query_is_sent(tmp_path, fake, caplog):
    """`-v` raised httpx to INFO, which logs each request's URL with the --endpoint's user:password;
    and the endpoint's query (?token=) was dropped, never sent."""
    cfg = config(tmp_path, fake)
    endpoint = fake.url.replace("http://", "http://u:topsecret@") + "?token=qtok123"
    with caplog.at_level(logging.DEBUG):
        assert cli(["-v", "regenerate", "--dataset", cfg.dataset, "--out", cfg.out, "--endpoint", endpoint,
                    "--model", "m", "--rows-per-part", "4"]) == 0
    assert "topsecret" not in caplog.text and "qtok123" not in caplog.text and "HTTP Request" not in caplog.text
    assert fake.seen and all("token=qtok123" in path for path, _ in fake.seen)
    assert {auth for _, auth in fake.seen} == {"Basic " + base64.b64encode(b"u:topsecret").decode()}


def test_a_serve_server_that_dies_mid_run_stops_the_run_at_once_naming_its_exit_code_and_log(tmp_path):
    """Nothing watched the --serve server: its death was retried for all of --retry-for, then
    ended in a generic "rerun once the server is back"."""
    log = tmp_path / "server.log"
    cfg = serve_config(tmp_path, "DIE_AT=4", serve_log=str(log), retry_for_s=30.0, concurrency=1)
    t0 = time.monotonic()
    with pytest.raises(ServerFailed, match=rf"exited with code 9 .*{re.escape(str(log))}"):
        regenerate(cfg)
    assert time.monotonic() - t0 < 20


def test_a_serve_line_shows_no_secret_assignment_and_bad_quoting_is_no_crash(caplog):
    """`--serve 'HF_TOKEN=hf_... vllm ...'` was logged whole and named as the program in the error;
    an unbalanced quote crashed the error message with a ValueError."""
    assert redacted("HF_TOKEN=hf_1 db_password='a b' export Api_Key=\"c d\" PORT=8 vllm serve m --port 8") == \
        "HF_TOKEN=*** db_password=*** export Api_Key=*** PORT=8 vllm serve m --port 8"
    with caplog.at_level(logging.INFO), pytest.raises(ServerFailed) as failed:
        with serving("HF_TOKEN=hf_SECRET exit 3", "http://127.0.0.1:9", timeout_s=10):
            pass
    assert "HF_TOKEN=***" in caplog.text and "hf_SECRET" not in caplog.text + str(failed.value)
    assert "code 3" in str(failed.value) and "exit ..." in str(failed.value)
    with pytest.raises(ServerFailed, match="exited with code 2"):  # bash's own answer to the quote
        with serving("exit 3 'unbalanced", "http://127.0.0.1:9", timeout_s=10):
            pass


def test_the_serve_servers_workers_are_stopped_also_when_the_server_itself_exited(tmp_path):
    """A server that died left its workers running (vLLM's engine processes, holding the GPUs a
    rerun needs): the stop returned at once when the server's own process was gone."""
    pidfile = tmp_path / "worker.pid"
    with pytest.raises(ServerFailed, match="exited with code 3"):
        with serving(f"sleep 300 & echo $! > {pidfile}; exit 3", "http://127.0.0.1:9", timeout_s=10):
            pass
    worker = int(pidfile.read_text())
    try:
        with open(f"/proc/{worker}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the server's worker {worker} still runs ({state})"


def test_a_recipe_missing_keys_is_an_error_naming_the_file_and_the_keys(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "regenerate.json").write_text(json.dumps({"format": "layertap-regenerated/1", "model": "m"}))
    assert cli(["status", str(out)]) == 2
    err = capsys.readouterr().err
    assert "regenerate.json" in err and "dataset, sampling, rows_per_part" in err


def test_a_setting_the_server_refuses_is_found_by_the_check_before_any_row(tmp_path, fake):
    """The check sent a one-token request: a server refusing a prompt plus the run's max_tokens
    past its context (or its seed) passed it, then refused every row, and the output was
    complete with nothing in it (a rerun did nothing)."""
    fake.refuse = lambda body: "exceeds the context of 1024 tokens" if body.get("max_tokens", 0) > 1000 else None
    cfg = config(tmp_path, fake, max_tokens=2048, seed=7)
    with pytest.raises(EndpointError, match=r"refused a request for model 'm' with this run's settings .*max_tokens "
                                            r"2048.*exceeds the context.*check --model, --max-tokens"):
        regenerate(cfg)
    assert fake.bodies[-1]["max_tokens"] == 2048 and fake.bodies[-1]["seed"] == 7
    assert not done_parts(open_store(cfg.out)) and not open_store(cfg.out).exists("regenerate.json")


def test_every_row_refused_alike_and_none_answered_stops_the_run_before_a_part_is_kept(tmp_path, fake):
    """What the check cannot see (the rows' own prompts refused for a setting): a run that went on
    recorded every row refused, for good."""
    fake.refuse = lambda body: "seed is not supported" if body["messages"][-1]["content"].startswith("q") else None
    cfg = config(tmp_path, fake, rows=20, rows_per_part=16)
    with pytest.raises(EndpointError, match=r"refused each of the first \d+ rows \(http_400\) and answered none.*"
                                            r"seed is not supported.*\(no part was written\)"):
        regenerate(cfg)
    assert not done_parts(open_store(cfg.out))
    fake.refuse = lambda body: None  # the setting fixed: the rerun answers every row
    assert regenerate(cfg).regenerated == 20


def test_a_last_question_before_a_system_turn_is_answered_and_a_rows_tools_are_sent_and_kept(tmp_path, fake):
    """`[user, system]` was refused as "no user turn to answer", and a last question followed by a
    system turn was left unanswered in silence; a row's `tools` were neither sent nor kept."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "u1"},
                                                        {"role": "system", "content": "one word"}]}) + "\n"
                    + json.dumps({"id": "b", "tools": tools, "messages": [{"role": "user", "content": "u2"},
                                                                          {"role": "assistant", "content": "old"}]})
                    + "\n")
    cfg = config(tmp_path, fake, dataset=str(data))
    assert regenerate(cfg).regenerated == 2
    a, b = iter_rows(cfg.out)
    assert [m["role"] for m in a["messages"]] == ["user", "system", "assistant"]
    assert json.loads(b["tools"]) == tools and "tools" not in a
    assert [body.get("tools") for body in fake.bodies if body["messages"][0]["content"] == "u2"] == [tools]


def test_an_answer_that_calls_a_tool_refuses_its_row_at_once(tmp_path, fake):
    fake.answer = lambda n, prompt: (200, "", "tool_calls", 0.0) if prompt == "q1" else ok(n, prompt)
    cfg = config(tmp_path, fake, rows=4)
    regenerate(cfg)
    assert refused(cfg.out) == [(1, "tool_call")]
    assert sum(body["messages"][-1]["content"] == "q1" for body in fake.bodies) == 1  # not asked again


def test_a_process_finding_the_part_kept_does_not_overwrite_its_stats(tmp_path):
    """The loser of a race wrote its stats before trying the part: a failure of that write (or a
    kill) left the kept part with the loser's refusals for good."""
    store = open_store(str(tmp_path / "out"))
    winner, loser = _racing_parts()
    _write_part(store, winner, Totals())

    class Failing:
        def __getattr__(self, name):
            return getattr(store, name)

        def put_if_absent(self, key, data):
            raise OSError("connection reset")  # the loser's try of the part fails (or it is killed there)

    _write_part(Failing(), loser, Totals())  # finds the part kept: never tries it
    assert [r["row"] for r in json.loads(store.get(stats_key(0)))["refused"]] == [1]


@pytest.mark.parametrize("flag, value, said", [("--temperature", "nan", "--temperature must be a number >= 0"),
                                               ("--request-timeout", "0", "--request-timeout must be a number"),
                                               ("--retry-for", "-1", "--retry-for must be a number"),
                                               ("--endpoint", "http://127.0.0.1:80a/v1", "has a port that is not a number")])
def test_settings_that_cannot_work_are_refused_before_anything_starts(tmp_path, capsys, flag, value, said):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    args = {"--dataset": str(data), "--out": str(tmp_path / "out"), "--endpoint": "http://127.0.0.1:9/v1",
            "--model": "m", "--serve": "sleep 100", flag: value}
    assert cli(["regenerate", *[x for kv in args.items() for x in kv]]) == 2
    assert said in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit", [{"rows_per_part": 0}, {"dataset": "x"}, {"dataset": {"path": "d"}}])
def test_a_recipe_edited_to_another_shape_is_an_error_naming_the_key(tmp_path, capsys, edit):
    out = tmp_path / "out"
    out.mkdir()
    recipe = {"format": "layertap-regenerated/1", "model": "m", "sampling": {}, "rows_per_part": 4,
              "dataset": {"path": "d", "rows": 8}, **edit}
    (out / "regenerate.json").write_text(json.dumps(recipe))
    assert cli(["status", str(out)]) == 2
    assert f"{next(iter(edit))} " in capsys.readouterr().err


def test_a_row_whose_chat_is_not_a_list_is_refused_alone(tmp_path, fake):
    """`{"messages": 5}` was a TypeError out of a worker that stopped the run, and every rerun."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": "x", "messages": 5}\n' + json.dumps({"messages": [{"role": "user", "content": "q"}]})
                    + "\n")
    cfg = config(tmp_path, fake, dataset=str(data))
    assert regenerate(cfg).regenerated == 1 and refused(cfg.out) == [(0, "bad_message")]


# -- found by review (2026-12-06) ----------------------------------------------------------------


def _body(content, finish, **message) -> dict:
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content, **message}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}


def test_bad_rows_that_are_all_that_is_left_are_refused_not_taken_for_an_outage(tmp_path, fake):
    """Rows 9-11 make the server's template raise (a 500, as `transformers serve` answers it); it
    answers every other row and the check. At --concurrency 4 they are the last under way, and more
    than two failing at once was an outage: "failed every chat completion", on every rerun."""
    fake.answer = lambda n, prompt: (500, "TemplateError: roles must alternate", None, 0.0) \
        if prompt in ("q9", "q10", "q11") else (200, f"answer to {prompt}", "stop", 0.2)
    cfg = config(tmp_path, fake, rows=12, concurrency=4, rows_per_part=4, retry_for_s=8.0)
    regenerate(cfg)
    assert refused(cfg.out) == [(9, "http_500"), (10, "http_500"), (11, "http_500")]


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_an_answer_calling_a_tool_is_refused_whatever_its_finish_reason(tmp_path, fake, finish):
    """vLLM ends a call forced by tool_choice in "stop", SGLang keeps "length": the answer was kept
    with its call dropped (an empty assistant turn)."""
    call = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    fake.answer = lambda n, prompt: (200, _body(None, finish, tool_calls=call), finish, 0.0) if prompt == "q1" \
        else ok(n, prompt)
    cfg = config(tmp_path, fake, rows=4)
    regenerate(cfg)
    assert refused(cfg.out) == [(1, "tool_call")]


def test_an_earlier_turns_reasoning_is_sent_under_the_name_vllm_reads_and_stored_under_ours(tmp_path, fake):
    """vLLM reads only `reasoning` from an incoming assistant message (vllm#38488): `reasoning_content`
    alone was dropped before the template, so a template replaying earlier reasoning generated the
    next turn without what extraction renders."""
    fake.answer = lambda n, prompt: (200, _body(f"A {prompt}", "stop", reasoning=f"R {prompt}"), "stop", 0.0)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"},
                                             {"role": "user", "content": "u2"},
                                             {"role": "assistant", "content": "b"}]}) + "\n")
    cfg = config(tmp_path, fake, dataset=str(data))
    regenerate(cfg)
    second = next(b for b in fake.bodies if b["messages"][-1]["content"] == "u2")
    assert second["messages"][1] == {"role": "assistant", "content": "A u1", "reasoning": "R u1",
                                     "reasoning_content": "R u1"}
    (row,) = iter_rows(cfg.out)
    assert row["messages"][1] == {"role": "assistant", "content": "A u1", "reasoning_content": "R u1"}


def test_rows_too_long_for_the_context_among_the_first_do_not_stop_the_run(tmp_path, fake):
    """A context check answers 400 in milliseconds, an answer takes seconds: with small parts, 8
    over-long rows among the first under way were taken for a setting of the run."""
    fake.answer = lambda n, prompt: ok(n, prompt)[:3] + (1.5,)
    fake.refuse = lambda b: "maximum context length is 4096 tokens" if b["messages"][-1]["content"].startswith("q") \
        and int(b["messages"][-1]["content"][1:]) % 2 == 0 else None
    cfg = config(tmp_path, fake, rows=24, concurrency=16, rows_per_part=1, request_timeout_s=30.0)
    regenerate(cfg)
    assert len(refused(cfg.out)) == 12


def test_a_part_kept_by_another_process_is_read_back_at_newlines_only(tmp_path):
    """str.splitlines split a kept part inside a JSON string at U+2028 (ensure_ascii=False leaves
    it raw): the process that lost the race to write the part stopped on a JSONDecodeError."""
    from layertap.manifests.regeneration import stats_key

    store = open_store(str(tmp_path / "out"))
    won, lost = _Part(0, range(2)), _Part(0, range(2))
    for part in (won, lost):
        part.rows[0] = {"id": "0", "messages": [{"role": "user", "content": "line one\u2028line two"}],
                        "regenerated": {"row": 0, "completion_tokens": 5, "finish_reasons": ["stop"]}}
    won.rows[1] = {"id": "1", "messages": [], "regenerated": {"row": 1, "completion_tokens": 5,
                                                              "finish_reasons": ["stop"]}}
    lost.refused.append({"row": 1, "id": "1", "reason": "turn 1: timeout", "kind": "timeout"})
    _write_part(store, won, Totals())
    _write_part(store, lost, Totals())  # keeps the other's part, and writes its stats from it
    assert json.loads(store.get(stats_key(0)))["refused"] == []


def test_a_setting_refused_for_every_row_of_a_task_smaller_than_concurrency_stops_it(tmp_path, fake):
    """Counting `--concurrency` refusals before judging (a first try at the case above) let a task of
    fewer rows complete with every row refused, for good."""
    fake.refuse = lambda body: "seed is not supported" if body["messages"][-1]["content"].startswith("q") else None
    cfg = config(tmp_path, fake, rows=12, concurrency=16, rows_per_part=12)
    with pytest.raises(EndpointError, match=r"refused each of the first \d+ rows \(http_400\) and answered none"):
        regenerate(cfg)
    assert not done_parts(open_store(cfg.out))


def test_an_engine_that_aborts_every_request_is_an_outage_not_every_row_refused(tmp_path, fake):
    """vLLM paused or draining, SGLang interrupting for a weight update: 200 with finish "abort" to
    every request. Each row was asked 3 times at once and refused, and the output was complete with
    nothing in it, for good. Now the known-good request aborts too: an outage, ridden out, then
    ServerGone with no row refused; the rerun once the engine is back regenerates them all."""
    fake.answer = lambda n, prompt: ok(n, prompt) if n == 1 else (200, "", "abort", 0.0)
    cfg = config(tmp_path, fake, rows=8, concurrency=4)
    with pytest.raises(ServerGone, match="finish_reason 'abort'"):
        regenerate(cfg)
    assert refused(cfg.out) == [] and not done_parts(open_store(cfg.out))
    fake.answer = ok
    assert regenerate(config(tmp_path, fake, rows=8, concurrency=4)).regenerated == 8


def test_a_request_timeout_shorter_than_every_answer_stops_the_run_naming_it(tmp_path, fake):
    """At --concurrency 2 every row timed out alone while the one-token check was answered at once:
    each row was refused as its own timeout and the output complete with none answered."""
    fake.answer = lambda n, prompt: ok(n, prompt) if prompt == "Hi" else (200, f"a long answer to {prompt}", "stop", 1.5)
    cfg = config(tmp_path, fake, rows=8, concurrency=2, rows_per_part=8, retry_for_s=30.0)
    with pytest.raises(EndpointError, match=r"refused each of the first 8 rows \(timeout\).*--request-timeout"):
        regenerate(cfg)
    assert not done_parts(open_store(cfg.out))


def test_one_row_a_proxy_times_out_every_time_is_refused_alone(tmp_path, fake):
    """A proxy's 504 on one long row while every other row is answered was a server away: after
    --retry-for the run stopped with "failed every chat completion", on every rerun."""
    fake.answer = lambda n, prompt: (504, "upstream timed out", None, 0.0) if prompt == "q5" else ok(n, prompt)
    cfg = config(tmp_path, fake, rows=8, concurrency=2, retry_for_s=2.0)
    assert regenerate(cfg).regenerated == 7
    assert refused(cfg.out) == [(5, "http_504")]


def test_answers_of_the_wrong_shape_are_refused_not_stored_nor_a_crash(tmp_path, fake, caplog):
    """Content as a list of parts (some proxies) was stored and made the output unreadable to
    extract; a null choice or a message that is a string stopped the run with an AttributeError.
    An answer naming another model (a router's fallback) is stored, with a warning."""
    head = {"id": "x", "object": "chat.completion", "created": 0, "model": "m"}
    bodies = {"q1": _body([{"type": "text", "text": "hi"}], "stop"), "q2": {**head, "choices": [None]},
              "q3": {**head, "choices": [{"index": 0, "finish_reason": "stop", "message": "hi"}]},
              "q4": {**_body("answer to q4", "stop"), "model": "fallback-model"}}
    fake.answer = lambda n, prompt: (200, bodies[prompt], "stop", 0.0) if prompt in bodies else ok(n, prompt)
    cfg = config(tmp_path, fake)
    with caplog.at_level(logging.WARNING):
        assert regenerate(cfg).regenerated == 5
    assert refused(cfg.out) == [(1, "malformed"), (2, "malformed"), (3, "malformed")]
    rows = {r["id"]: r for r in iter_rows(cfg.out)}
    assert all(isinstance(m["content"], str) for r in rows.values() for m in r["messages"])
    assert "as model 'fallback-model'" in caplog.text


def test_a_server_whose_every_answer_has_another_shape_is_refused_not_waited_out(tmp_path, fake):
    """Content as a list of parts on every answer, the known-good request's too, was taken for an
    outage: ServerGone after --retry-for ("rerun once the server is back"), which cannot help."""
    fake.answer = lambda n, prompt: (200, _body([{"type": "text", "text": "hi"}], "stop"), "stop", 0.0)
    cfg = config(tmp_path, fake, retry_for_s=60.0)
    began = time.monotonic()
    with pytest.raises(EndpointError, match="answers chat completions in another shape than OpenAI's"):
        regenerate(cfg)
    assert time.monotonic() - began < 30 and not done_parts(open_store(cfg.out))


def test_a_rerun_left_with_rows_the_server_rightly_refuses_finishes(tmp_path, fake):
    """A rerun whose parts left are a block of too-long prompts took their refusals for a setting of
    the run ("refused each of the first rows ... and answered none") and could never finish: the
    output's parts written under the same settings say it is none."""
    fake.refuse = lambda body: "prompt too long for the context" if body["messages"][-1]["content"] in \
        {f"q{i}" for i in range(8, 24)} else None
    cfg = config(tmp_path, fake, rows=24, rows_per_part=4, concurrency=4)
    assert regenerate(cfg).regenerated == 8
    store = open_store(cfg.out)
    for part in (2, 3, 4, 5):  # as a preemption leaves it: only the parts of refused rows to do
        store.delete(done_parts(store)[part].key)
    totals = regenerate(cfg)
    assert totals.regenerated == 0 and totals.refused == 16 and len(done_parts(store)) == 6


def test_a_row_a_gateway_answers_429_for_good_is_refused_while_the_others_are_answered(tmp_path, fake):
    """A 429 was only ever "server away": a gateway's per-request "request too large" 429 was retried
    for the whole run, held its part open, and ended the run with "failed every chat completion"."""
    fake.answer = lambda n, prompt: (429, "Request too large: tokens per min", None, 0.0) if prompt == "q3" \
        else ok(n, prompt)
    cfg = config(tmp_path, fake, rows=8, retry_for_s=60.0)
    totals = regenerate(cfg)
    assert refused(cfg.out) == [(3, "http_429")] and totals.regenerated == 7


def test_failures_during_an_outage_do_not_count_against_a_row_after_it(tmp_path, fake):
    """A row's 500s counted on through an outage, so one more after it (a proxy warming up) refused a
    healthy row for good ("502 after 6 tries")."""
    outage, after = [0.0], [0]

    def answer(n, prompt):
        if prompt == "q1" and outage[0] == 0.0:
            # every request 502s for 6 s from the second row on, the probe too: longer than the row's first four
            # tries take (at most 3.5 s of backoff), so its judgement is made inside the outage, never at its end
            outage[0] = time.monotonic()
        if outage[0] and time.monotonic() - outage[0] < 6.0:
            return 502, "Bad Gateway", None, 0.0
        if prompt == "q1" and after[0] == 0:
            after[0] = 1
            return 502, "Bad Gateway", None, 0.0  # one more after it, to this row alone
        return ok(n, prompt)

    fake.answer = answer
    cfg = config(tmp_path, fake, rows=4, concurrency=1, retry_for_s=30.0)
    totals = regenerate(cfg)
    assert refused(cfg.out) == [] and totals.regenerated == 4


def test_a_rate_limit_is_waited_out_not_taken_for_a_rows_own_refusal(tmp_path, fake):
    """A 429 under a tokens-per-minute limit lets the one-token check through while the row's own request
    is limited: it must be waited out (the rows answered after it), never refused as the row's for good;
    and only this task's parts with answered rows prove its server answers under these settings."""
    from types import SimpleNamespace

    from layertap.extract.regenerate import _answered_before

    limited_until = [0.0]

    def answer(n, prompt):
        if prompt == "q1" and not limited_until[0]:
            limited_until[0] = time.monotonic() + 12.0
        if prompt == "q1" and time.monotonic() < limited_until[0]:
            return 429, "Rate limit reached for requests: tokens per min. Please try again in 12s.", None, 0.0
        return ok(n, prompt)

    fake.answer = answer
    cfg = config(tmp_path, fake, rows=3, concurrency=1, retry_for_s=60.0)
    totals = regenerate(cfg)
    assert refused(cfg.out) == [] and totals.regenerated == 3

    part = lambda size: SimpleNamespace(size=size)  # noqa: E731 - a listing entry
    assert _answered_before({0: part(10), 1: part(0)}, [0, 2])
    assert not _answered_before({0: part(0), 1: part(10)}, [0, 2])  # another task's answers are not this one's
