"""`layertap regenerate`: the target writes the answers its drafter will learn to predict.

A drafter predicts the target's own continuations, so each conversation's assistant turns are
replaced by what the target answers, turn by turn, given the regenerated history (system and
user turns are kept). The answers come from an OpenAI-compatible server (`chat_client.py`), many
requests in flight. Source rows are grouped in parts of `rows_per_part`; a part is written to the
store once all of its rows are answered or refused (`regenerated.py` has the layout), so a
crashed, killed or preempted run loses only the parts it had open and a rerun of the same command
redoes exactly those. `--task I/N` splits the parts between N processes (a Slurm array).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from layertap.extract.chat_client import ChatClient, EndpointError, Refused, api_base
from layertap.extract.served import serving
from layertap.manifests.preemption import AsyncStop, StopSignals
from layertap.manifests.output_lease import OutputLease
from layertap.manifests.regeneration import (RECIPE, Recipe, done_parts, live_tasks, part_key, read_recipe,
                                             regeneration_status, stats_key, task_role)
from layertap.storage.errors import ConfigError, InputError
from layertap.storage.redact import public_url
from layertap.storage.flags import build, parse_json_object, setting, settings
from layertap.storage.store import ObjectStore, open_store

log = logging.getLogger(__name__)


def parse_task(text: str) -> tuple[int, int]:
    """'3/8' -> (3, 8): this process takes parts p with p % 8 == 3."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"{text!r} is not I/N, e.g. 0/4") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"{text!r}: need 0 <= I < N")
    return index, count


@dataclass(kw_only=True)
class RegenerateConfig:
    dataset: str = setting(help="input chats: a .jsonl/.json/.parquet file, a folder or quoted glob of them (also on "
                                "S3), or a saved dataset folder (ShareGPT 'conversations' or OpenAI 'messages' rows) "
                                "(required)")
    out: str = setting(help="output prefix: s3://bucket/prefix or a local folder; `layertap extract --dataset` "
                            "reads it (required)")
    endpoint: str = setting(help="OpenAI-compatible server, e.g. http://localhost:8000/v1 (vLLM, SGLang, "
                                 "transformers serve); $VARIABLES are expanded when it runs, e.g. "
                                 "'http://localhost:$LAYERTAP_TASK_PORT/v1' in a Slurm task (required)")
    model: str = setting(help="the model name the server serves: the target (required)")
    concurrency: int = setting(64, help="requests in flight")
    max_tokens: int = setting(2048, help="most new tokens per assistant turn (a longer answer is kept, cut, and "
                                         "counted as truncated)")
    temperature: float = setting(0.0, help="sampling temperature (default 0: greedy, what the target serves "
                                           "under greedy speculative decoding)")
    top_p: float = setting(1.0, help="nucleus sampling")
    seed: int | None = setting(None, help="sampling seed (row i's requests use seed+i); recorded")
    chat_template_kwargs: dict[str, Any] | None = setting(
        None, parse=parse_json_object, metavar="JSON",
        help="passed to the server's chat template, e.g. '{\"enable_thinking\": false}'")
    rows_per_part: int = setting(256, help="source rows per output part (the unit written and resumed)")
    limit: int | None = setting(None, help="take the first N rows of the dataset")
    task: tuple[int, int] = setting((0, 1), parse=parse_task, metavar="I/N",
                                    help="this process takes parts p with p % N == I (a Slurm array: "
                                         "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT) (default 0/1)")
    api_key_env: str = setting("OPENAI_API_KEY", help="environment variable holding the server's API key, if it "
                                                      "wants one (never logged or recorded)")
    request_timeout_s: float = setting(600.0, flag="--request-timeout", help="seconds one request may take")
    retry_for_s: float = setting(900.0, flag="--retry-for",
                                 help="seconds of a server failing every request (restarting, overloaded) before "
                                      "the run stops; the parts done are kept")
    serve: str | None = setting(None, metavar="COMMAND",
                                help="start the server with this shell command first (e.g. 'vllm serve /models/target "
                                     "--port 8000'), wait until it answers at --endpoint, stop it at the end: one "
                                     "Slurm task runs its own server")
    serve_timeout_s: float = setting(1800.0, flag="--serve-timeout", help="seconds --serve's server may take to "
                                                                          "answer (loading a large target takes minutes)")
    serve_log: str | None = setting(None, help="file for --serve's server output (default: this command's stderr)")
    progress: bool = setting(True, config_only=True, help="show progress")

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_tokens", "rows_per_part"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.temperature < math.inf or not 0 < self.top_p <= 1:  # NaN fails both
            raise ConfigError(f"--temperature must be a number >= 0 and --top-p in (0, 1], got {self.temperature} "
                              f"and {self.top_p}")
        if not 0 < self.request_timeout_s < math.inf:  # 0 blamed a server that was up: "no connection within 0 s"
            raise ConfigError(f"--request-timeout must be a number of seconds > 0, got {self.request_timeout_s}")
        if not 0 <= self.retry_for_s < math.inf:
            raise ConfigError(f"--retry-for must be a number of seconds >= 0, got {self.retry_for_s}")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):  # not shown: it may be the key itself
            raise ConfigError("--api-key-env takes the name of the environment variable that holds the server's API "
                              "key (OPENAI_API_KEY by default), not the key: the value given is no variable name (not "
                              "shown, as it may be the key); export the key in a variable and name that")

    def resolved_endpoint(self) -> str:
        """--endpoint with its $VARIABLES expanded (a Slurm task's own port), checked."""
        endpoint = os.path.expandvars(self.endpoint)
        if "$" in endpoint:
            raise ConfigError(f"--endpoint {public_url(self.endpoint)!r} names a variable that is not set here")
        api_base(endpoint)  # its form (scheme, port), before the output's lease is taken and --serve starts
        return endpoint

    def sampling(self) -> dict[str, Any]:
        """The request settings recorded with the output (a rerun must use the same)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "seed": self.seed, "chat_template_kwargs": self.chat_template_kwargs}


def load_regenerate_config(args: Any) -> RegenerateConfig:
    values = settings(RegenerateConfig, args)
    missing = [n for n in ("dataset", "out", "endpoint", "model") if not values.get(n)]
    if missing:
        raise ConfigError(f"{', '.join('--' + n for n in missing)} required")
    return build(RegenerateConfig, values, args)


@dataclass
class Totals:
    """What one `regenerate` process did (its parts only)."""

    parts: int = 0
    rows: int = 0
    regenerated: int = 0
    turns: int = 0
    truncated: int = 0
    completion_tokens: int = 0
    dropped_turns: int = 0  # assistant turns before a row's first user turn (`normalize_chat`): not regenerated
    refused_reasons: dict[str, int] = field(default_factory=dict)
    last_refusal: str = ""
    status: dict[str, Any] | None = None  # the output's `regeneration_status` as the run ended (None: no recipe)

    @property
    def refused(self) -> int:
        return sum(self.refused_reasons.values())


def regenerate(cfg: RegenerateConfig) -> Totals:
    """Regenerate the parts of `cfg.task` not yet done at `cfg.out`; returns what was done now."""
    from layertap.extract.dataset_files import recorded_path
    from layertap.extract.inputs import RowShape, detect_row_shape, load_pinned_rows

    cfg.endpoint = cfg.resolved_endpoint()
    rows, fingerprint = load_pinned_rows(cfg.dataset, cfg.limit)
    if detect_row_shape(rows.column_names) == RowShape.PRETOKENIZED:
        raise InputError(f"dataset {cfg.dataset!r} is pre-tokenized (input_ids): regeneration needs the chats' "
                         f"text; give the ShareGPT or messages version")
    store = open_store(cfg.out)
    recipe = Recipe(dataset={"path": recorded_path(cfg.dataset), "fingerprint": fingerprint,
                             "rows": len(rows), "limit": cfg.limit},
                    model=cfg.model, sampling=cfg.sampling(), rows_per_part=cfg.rows_per_part,
                    endpoint=public_url(cfg.endpoint))
    recorded = _recorded(store, recipe)
    recipe = recorded or recipe
    index, count = cfg.task
    done = done_parts(store)
    mine = [p for p in range(recipe.parts) if p % count == index]
    todo = [p for p in mine if p not in done]
    log.info("regenerate %s -> %s: %d rows in %d parts; task %d/%d has %d parts, %d done, %d to do",
             cfg.dataset, store.uri, len(rows), recipe.parts, index, count, len(mine), len(mine) - len(todo), len(todo))
    if not mine:  # more tasks than parts (`submit regenerate --tasks` above the part count): not an error
        log.info("nothing to do for task %d/%d: the output has %d parts, all of other tasks", index, count,
                 recipe.parts)
        return Totals()
    totals = Totals()
    if todo:
        api_key = os.environ.get(cfg.api_key_env) or None
        with contextlib.ExitStack() as stack:
            stack.enter_context(StopSignals(at_once=True))  # a stop unwinds: the --serve server is stopped too
            _refuse_another_split(store, count)
            lease = stack.enter_context(OutputLease(store, role=task_role(index, count)))  # one process per task
            _refuse_another_split(store, count)  # one that started beside this one
            # what a process of this task that held the lease meanwhile did is done
            todo = [p for p in todo if p not in done_parts(store)]
            if not todo:
                log.info("task %d/%d: another process of it did its parts meanwhile", index, count)
                return totals
            server = None
            if cfg.serve:
                server = stack.enter_context(serving(cfg.serve, cfg.endpoint, timeout_s=cfg.serve_timeout_s,
                                                     log_path=cfg.serve_log, api_key=api_key))

            looked = [-math.inf]

            def watch() -> None:  # after each failed request: the server gone, or the task taken over
                if server is not None:
                    server()
                # the lease's LIST and GET block the event loop: once in a while, not at every failure of 256
                # requests in flight through an outage (a takeover is seen within a ttl either way)
                if time.monotonic() - looked[0] >= LEASE_LOOK_S:
                    looked[0] = time.monotonic()
                    lease.check()

            totals = asyncio.run(_regenerate_parts(cfg, recipe, rows, store, todo, api_key, new=recorded is None,
                                                   watch=watch, proven=_answered_before(done, mine)))
    _log_summary(store, totals)
    return totals


def _answered_before(done: dict[int, Any], mine: list[int]) -> bool:
    """Whether a part of this task already holds answered rows (a part file holds the answered
    ones; the refused are in its stats): its server, under these settings, answered. Another task's
    parts prove nothing of this one's server (each may run its own --serve)."""
    return any(done[p].size > 0 for p in mine if p in done)


def _refuse_another_split(store: ObjectStore, count: int) -> None:
    """Refuse to start while a process of another `--task I/N` split is at work: its parts and this
    one's overlap, and would be answered twice."""
    others = live_tasks(store, lambda task: task[1] != count)
    if others:
        (index, n), held = next(iter(others.items()))
        running = sum(1 for _, m in others if m == n)
        raise ConfigError(f"{store.uri}: a regeneration split into {n} tasks is at work there now (task {index}/{n}, "
                          f"{held.describe(store.now())}; {running} of its tasks at work): its parts and this "
                          f"split's overlap and would be answered twice. Run with --task I/{n}, or once it has ended "
                          "(a lease of a process killed elsewhere goes stale within a minute)")


def _recorded(store: ObjectStore, recipe: Recipe) -> Recipe | None:
    """The output's recipe if it has one (refused unless it matches `recipe`), else None. Parts
    without a recipe are refused: the recipe is written before the first part, so they are what a
    delete cut short left, or another tool's, and were taken for this command's work (another
    model's answers, another --rows-per-part's rows, reported complete)."""
    if store.exists(RECIPE):
        return _matching(store, recipe)
    if stray := done_parts(store):
        raise InputError(f"{store.uri} holds {len(stray)} part(s) ({store.uri.rstrip('/')}/{stray[min(stray)].key} "
                         f"...) but no {RECIPE}: not this command's work (a `layertap delete` cut short leaves "
                         f"them). Delete them (`layertap delete {store.uri} --force`) or choose another --out")
    return None


def _create_or_check(store: ObjectStore, recipe: Recipe) -> Recipe:
    """The output's recipe: this one if the output is new, else the recorded one if it matches."""
    if store.put_if_absent(RECIPE, json.dumps(recipe.to_json(), indent=1).encode()):
        return recipe
    return _matching(store, recipe)


def _matching(store: ObjectStore, recipe: Recipe) -> Recipe:
    recorded = read_recipe(store)
    diffs = recorded.differences(recipe)
    if diffs:
        raise ConfigError(f"{store.uri} already holds a regeneration made differently: {'; '.join(diffs)}. "
                          f"Rerun with its settings to continue it, or choose another --out")
    return recorded


class _Part:
    """One part's rows as they finish, out of order."""

    def __init__(self, part: int, rows: range):
        self.part, self.source = part, rows
        self.rows: dict[int, dict[str, Any]] = {}
        self.refused: list[dict[str, Any]] = []

    @property
    def finished(self) -> bool:
        return len(self.rows) + len(self.refused) == len(self.source)


async def _regenerate_parts(cfg: RegenerateConfig, recipe: Recipe, rows, store: ObjectStore, todo: list[int],
                            api_key: str | None, new: bool, watch: Callable[[], None] | None = None,
                            proven: bool = False) -> Totals:
    """Answer the rows of the parts `todo`; `new`: the output has no recipe yet, and takes this one
    once the server has answered (a --model it does not serve, or an endpoint not up, must not
    lock the output to the mistake); `watch`: raises once the --serve server has exited; `proven`:
    this task's parts hold answered rows already (`_may_be_a_setting`)."""
    from layertap.extract.console import progress

    client = ChatClient(cfg.endpoint, recipe.model, api_key=api_key, sampling=recipe.sampling,
                        timeout_s=cfg.request_timeout_s, retry_for_s=cfg.retry_for_s, concurrency=cfg.concurrency,
                        watch=watch)
    totals = Totals()
    total_rows = sum(len(recipe.rows_of(p)) for p in todo)
    bar = progress(total_rows, desc="regenerate", unit="row", enabled=cfg.progress)
    t0 = time.monotonic()
    queue: asyncio.Queue[tuple[_Part, int] | None] = asyncio.Queue(maxsize=cfg.concurrency)
    writes: list[asyncio.Task] = []
    failed_writes: list[BaseException] = []  # a part's write that failed: the workers stop at their next row

    def on_written(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            failed_writes.append(task.exception())
    with AsyncStop():  # a stop cancels this task: the parts being written finish, the rest waits for a rerun
        try:
            await client.check()
            if new:  # the server answers with the model: only now does the output take this recipe
                _create_or_check(store, recipe)

            async def worker() -> None:
                while (item := await queue.get()) is not None:
                    # a part's write that failed stops the run now, not once every row was answered (a store
                    # refusing writes, expired credentials: hours of generation thrown away)
                    if failed_writes:
                        raise failed_writes[0]
                    part, i = item
                    await _answer_row(client, recipe, rows[i], i, part, totals)
                    bar.update(1)
                    rate = totals.completion_tokens / max(1e-9, time.monotonic() - t0)
                    bar.set_postfix_str(f"{rate:,.0f} gen tok/s, {totals.refused} refused")
                    if part.finished:
                        if _may_be_a_setting(totals, proven):  # the answers under way say it is not: wait for them
                            await client.ended_under_way()
                        _refuse_a_setting(totals, client.where, proven)  # before a part of its refusals is kept
                        write = asyncio.create_task(asyncio.to_thread(_write_part, store, part, totals))
                        write.add_done_callback(on_written)
                        writes.append(write)
                client.last_rows = True  # no row left to start: a row failing now cannot wait for another's answer

            workers = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
            feeding = asyncio.create_task(_feed(queue, todo, recipe, cfg.concurrency))
            await _first_failure(workers + [feeding])
            await asyncio.gather(*writes)
        finally:
            for t in writes:
                if not t.done():
                    await asyncio.shield(t)
            bar.close()
            await client.close()
    return totals


async def _first_failure(tasks: list[asyncio.Task]) -> None:
    """Wait for all `tasks`; the first to fail cancels the others and its error is raised, as a
    stop (this task cancelled) does."""
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    # every failed task's error retrieved (several workers meet one outage), else asyncio logs
    # each left at exit with a traceback; the first is raised
    errors = [e for t in done if not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        raise errors[0]


async def _feed(queue: asyncio.Queue, todo: list[int], recipe: Recipe, workers: int) -> None:
    """Rows in order, part after part: parts open and finish roughly in order, so few are held."""
    for p in todo:
        part = _Part(p, recipe.rows_of(p))
        for i in part.source:
            await queue.put((part, i))
    for _ in range(workers):
        await queue.put(None)


async def _answer_row(client: ChatClient, recipe: Recipe, row: Mapping[str, Any], index: int, part: _Part,
                      totals: Totals) -> None:
    """Regenerate one row's assistant turns in order, or record why the row was refused."""
    from layertap.extract.inputs import Skipped, TokenizeStats, normalize_chat, sample_id, tools_of

    raw_id = row.get("id")
    row_id = str(raw_id) if raw_id not in (None, "") else str(index)
    raw = row.get("messages") if row.get("messages") is not None else row.get("conversations")
    stats = TokenizeStats()
    chat = normalize_chat(raw, sample_id(row, index), stats, require_assistant=False)
    totals.dropped_turns += stats.dropped_turns  # counted, as extraction counts them: not dropped in silence
    if isinstance(chat, Skipped):
        return _refuse(part, totals, index, row_id, f"{chat.reason}: {chat.detail}", kind=chat.reason)
    tools = tools_of(row, sample_id(row, index))
    if isinstance(tools, Skipped):
        return _refuse(part, totals, index, row_id, f"{tools.reason}: {tools.detail}", kind=tools.reason)
    users = [i for i, m in enumerate(chat) if m["role"] == "user"]
    if users and not any(m["role"] == "assistant" for m in chat[users[-1]:]):
        # a prompt-only row, or a last prompt left unanswered (a system turn after it too): answered
        chat.append({"role": "assistant", "content": ""})
    if not any(m["role"] == "assistant" for m in chat):  # a system prompt alone (or nothing)
        return _refuse(part, totals, index, row_id, "no user turn to answer", kind="no_prompt")
    history: list[dict[str, Any]] = []
    finish_reasons: list[str] = []
    tokens = 0
    seed = None if recipe.sampling.get("seed") is None else recipe.sampling["seed"] + index
    for message in chat:
        if message["role"] != "assistant":
            history.append({k: message[k] for k in ("role", "content")})
            continue
        try:
            reply = await client.complete(_as_sent(history), seed=seed, tools=tools)
        except Refused as e:
            return _refuse(part, totals, index, row_id, f"turn {len(finish_reasons) + 1}: {e}", kind=e.kind)
        answer = {"role": "assistant", "content": reply.content}
        if reply.reasoning_content:
            answer["reasoning_content"] = reply.reasoning_content
        history.append(answer)
        finish_reasons.append(reply.finish_reason)
        tokens += reply.completion_tokens
    part.rows[index] = {"id": row_id, "messages": history, **({"tools": json.dumps(tools)} if tools else {}),
                        "regenerated": {"row": index, "completion_tokens": tokens, "finish_reasons": finish_reasons}}
    totals.regenerated += 1
    totals.turns += len(finish_reasons)
    totals.truncated += sum(r == "length" for r in finish_reasons)
    totals.completion_tokens += tokens


def _as_sent(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat so far as the server reads it: an earlier answer's reasoning under both names,
    `reasoning` (what vLLM reads since it renamed the field, vllm#38488) and `reasoning_content`
    (SGLang, older vLLM, `transformers serve`), so that a template replaying earlier reasoning
    (Qwen3.5/3.6 with preserve_thinking) generates against what extraction will render."""
    return [{**m, "reasoning": m["reasoning_content"]} if m.get("reasoning_content") else m for m in history]


FIRST_REFUSALS = 8  # rows refused alike, none answered yet: the run's settings, not its rows
LEASE_LOOK_S = 10.0  # the task's lease looked at, at most this often, as requests fail


def _may_be_a_setting(totals: Totals, proven: bool = False) -> bool:
    """Every row so far (FIRST_REFUSALS or more) refused alike by the server (one HTTP status, or
    each timed out, or each answer cut or malformed alike), none answered. `proven`: this task's
    parts hold answered rows already, so only a timeout (--request-timeout, which the recipe does
    not record) may still be a setting: a rerun left with the rows the server rightly refuses (a
    block of too-long prompts) took them for one, and could never finish."""
    if totals.regenerated or totals.refused < FIRST_REFUSALS or len(totals.refused_reasons) != 1:
        return False
    kind = next(iter(totals.refused_reasons))
    if proven:
        return kind == "timeout"
    return kind.startswith(("http_", "finish_")) or kind in ("timeout", "malformed")


def _refuse_a_setting(totals: Totals, where: str, proven: bool = False) -> None:
    """Stop the run where every row so far was refused alike by the server and none answered,
    once the requests under way then have ended (`ChatClient.ended_under_way`: a too-long prompt
    is refused in milliseconds while answers take seconds, and the first rows' few too-long ones
    were taken for a setting): a setting the server refuses whatever the row (its parts would
    record every row refused, and a complete output hold nothing). A part is kept for good, so
    this is said before one is."""
    if not _may_be_a_setting(totals, proven):
        return
    kind = next(iter(totals.refused_reasons))
    raise EndpointError(f"{where} refused each of the first {totals.refused} rows ({kind}) and answered none: "
                        f"a setting of this run, not its rows (last: {totals.last_refusal}); check --max-tokens, "
                        + ("--request-timeout (long enough for a whole answer?), " if kind == "timeout" else "")
                        + "--temperature, --top-p, --seed and --chat-template-kwargs against the server, and rerun"
                        + (f" (the {totals.parts} part(s) already written keep their refusals: `layertap delete` "
                           "the output to redo them)" if totals.parts else " (no part was written)"))


def _refuse(part: _Part, totals: Totals, index: int, row_id: str, reason: str, *, kind: str) -> None:
    """Record a row that cannot be regenerated, with its reason: counted, never dropped silently."""
    log.warning("row %d (%s) refused: %s", index, row_id, reason)
    part.refused.append({"row": index, "id": row_id, "reason": reason, "kind": kind})
    totals.refused_reasons[kind] = totals.refused_reasons.get(kind, 0) + 1
    totals.last_refusal = reason


def _write_part(store: ObjectStore, part: _Part, totals: Totals) -> None:
    """The part's stats, then the part, then the stats again: its refused rows are in no part, only
    in its stats, and a crash (or an error) between a part and its stats lost them for good (a
    committed part is never written again), while status still said complete. A crash before the
    part leaves stats the rerun writes again. A process that finds the part kept, or loses the
    race to write it, keeps that part and writes the stats from it (its own refusals of the rows
    missing there); the winner writes its stats once more after its part, over a loser's."""
    rows = [part.rows[i] for i in sorted(part.rows)]
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    stats = json.dumps(_stats(part, rows)).encode()
    # a part already kept is another process's: its stats are not overwritten with this one's refusals
    # (which a crash before they are written again from the kept part left disagreeing with it for good)
    won = False
    if not store.exists(part_key(part.part)):
        store.put(stats_key(part.part), stats)
        won = store.put_if_absent(part_key(part.part), body)
    if not won:
        log.warning("part %d was written by another process meanwhile; kept that one", part.part)
        # split at "\n" alone: str.splitlines also splits inside JSON strings (at U+2028 and the like)
        kept = [json.loads(line) for line in store.get(part_key(part.part)).decode().split("\n") if line.strip()]
        store.put(stats_key(part.part), json.dumps(_stats(part, kept)).encode())
        return
    store.put(stats_key(part.part), stats)  # again: a loser of the race may have written its own meanwhile
    totals.parts += 1
    totals.rows += len(part.source)


def _stats(part: _Part, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A part's stats, for `rows` (what its file holds): the refused are the part's rows not among
    them, with this process's reasons (another process's, whose part was kept, are not known here)."""
    there = {r["regenerated"]["row"] for r in rows}
    mine = {r["row"]: r for r in part.refused}
    refused = [mine.get(i) or {"row": i, "id": part.rows.get(i, {}).get("id", ""), "kind": "unknown",
                               "reason": "refused by the process whose part was kept (its reason is not known here)"}
               for i in part.source if i not in there]
    return {"part": part.part, "rows": [part.source.start, part.source.stop], "regenerated": len(rows),
            "refused": refused,
            "completion_tokens": sum(r["regenerated"]["completion_tokens"] for r in rows),
            "truncated_turns": sum(f == "length" for r in rows for f in r["regenerated"]["finish_reasons"])}


def _log_summary(store: ObjectStore, totals: Totals) -> None:
    if totals.parts:
        log.info("this run: %d parts, %d rows (%d regenerated, %d refused: %s), %d turns (%d cut at --max-tokens), "
                 "%d tokens generated%s", totals.parts, totals.rows, totals.regenerated, totals.refused,
                 totals.refused_reasons or "none", totals.turns, totals.truncated, totals.completion_tokens,
                 f"; {totals.dropped_turns} assistant turn(s) before a row's first user turn left out (they answer "
                 "no prompt the row holds)" if totals.dropped_turns else "")
    s = totals.status = regeneration_status(store)  # read once: `layertap regenerate` prints it too
    if s is None:  # nothing was regenerated: no recipe yet
        return
    if not s["complete"]:
        log.info("%s: %d of %d parts done; the rest belong to other tasks or a rerun", store.uri, s["parts_done"],
                 s["parts_total"])
        return
    log.info("%s is complete: %d rows, %d regenerated, %d refused (reasons in stats/); `layertap extract --dataset "
             "%s` reads it", store.uri, s["rows_total"], s["rows_regenerated"], sum(s["rows_refused"].values()),
             store.uri)
