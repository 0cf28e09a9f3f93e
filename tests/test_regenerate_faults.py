"""`layertap regenerate` against server failures that the real `transformers serve` in
test_regenerate.py cannot produce on demand: an engine that dies behind a live HTTP server, one
slow row, answers cut by "abort". A small OpenAI-compatible HTTP server plays them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from layertap.extract.chat_client import ServerGone
from layertap.extract.regenerate import RegenerateConfig, _Part, _write_part, Totals, regenerate
from layertap.extract.regenerated import iter_rows
from layertap.extract.served import ServerFailed, serving
from layertap.manifests.regeneration import done_parts, read_stats, stats_key
from layertap.storage.store import open_store

# (request number, last user turn) -> (HTTP status, content, finish_reason, seconds to wait first)
Answer = Callable[[int, str], tuple[int, str, str | None, float]]


def ok(n: int, prompt: str) -> tuple[int, str, str | None, float]:
    return 200, f"answer to {prompt}", "stop", 0.0


class FakeServer:
    """An OpenAI-compatible server whose every chat answer `answer` chooses; `answer` may be swapped mid-run."""

    def __init__(self, answer: Answer = ok):
        self.answer, self.requests = answer, 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.send(200, {"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                            "owned_by": "x"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.requests += 1
                status, content, finish, wait = fake.answer(fake.requests, body["messages"][-1]["content"])
                time.sleep(wait)
                if status != 200:
                    return self.send(status, {"error": {"message": content}})
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


def config(tmp_path: Path, fake: FakeServer, rows: int = 8, **kw) -> RegenerateConfig:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                                     {"role": "assistant", "content": "old"}]}) + "\n"
                            for i in range(rows)))
    return RegenerateConfig(**{"dataset": str(data), "out": str(tmp_path / "out"), "endpoint": fake.url, "model": "m",
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


def test_a_process_that_loses_the_race_for_a_part_leaves_the_winners_stats(tmp_path):
    """Two processes finish the same part (a task run twice): the first part written is kept, and
    the stats are that part's, not the loser's."""
    store = open_store(str(tmp_path / "out"))
    winner, loser = _Part(0, range(2)), _Part(0, range(2))
    for part, row in ((winner, 0), (loser, 1)):
        part.rows[row] = {"id": str(row), "messages": [], "regenerated": {"row": row, "completion_tokens": 5,
                                                                         "finish_reasons": ["stop"]}}
        part.refused.append({"row": 1 - row, "id": str(1 - row), "reason": "x", "kind": "http_500"})
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
