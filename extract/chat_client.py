"""One chat completion from an OpenAI-compatible server (vLLM, SGLang, `transformers serve`),
with the retry policy a days-long regeneration needs.

The `openai` client makes one try per call (its own retries are off); this module decides:

- the server is away (connection refused or reset, 503, 429 throttling): wait with backoff and
  try again, for up to `retry_for_s` in which no request succeeded, so a server that is restarted
  or briefly overloaded under a running job is ridden out (`ServerGone` after that: the server
  failed every request that long, not one row); until the server has answered once, a refused
  connection is a wrong --endpoint: 3 quick tries. A 429 or 503 that says the request is too
  large (a gateway's "Request too large ... tokens per min") is that row's after `AWAY_TRIES`,
  judged as below; a rate limit's is waited out;
- a 500 (or other 5xx: a proxy's 502 and 504, its timeout on a long answer, among them), a
  timeout, and an answer that is no answer (below) are the row's own failure only while few requests are failing
  (two, or a quarter of --concurrency; any number among the last rows, when no row is left to
  start) and the server answers others: another request's success
  clears the slate. Once more requests in flight have failed since the last success, the server is
  failing, not the row (an engine dead behind a live HTTP server answers 500 to all; a hung one
  times out on all), and every request waits as for a server away, so the rest of the dataset is
  never refused for an outage. A row failing after `SERVER_ERROR_TRIES` 5xx or `TIMEOUT_TRIES` timeouts is
  refused (`Refused`) once the server answers a known-good request (`check`'s), which tells a
  bad row from an outage where no other request can (--concurrency 1, the last rows); a refused
  request no longer counts as failing, so the next bad row is judged on its own; failures judged
  an outage's do not count against the row after it (counted afresh);
- an answer that did not end in "stop" or "length" (vLLM's and SGLang's "abort" or "error", none
  at all) is empty or cut short, and one that is malformed (a body that is not JSON, such as a
  proxy's page, no choices, no message, content that is not text): asked again, then the row is
  refused, never stored, where the check's known-good request gets a whole answer (an engine
  that aborts every request, paused or draining, is an outage);
- the server refuses the request (400, 413, 422: a prompt too long for its context, a message it
  cannot template): the row is refused with the server's own reason;
- no connection within CONNECT_TIMEOUT_S (a wrong address whose packets a firewall drops) counts as
  a refused connection, not as a request's timeout;
- the server refuses us (401, 403, 404: a key, a model, a URL that is wrong): `EndpointError`,
  which stops the run, as every row would fail the same way;
- the server that `--serve` started has exited (`watch` raises): the run stops at once.

The endpoint's user:password is sent as HTTP basic auth and its query (`?token=...`) with every
request, but neither is in the client's base URL, so no library's log line of a URL shows them.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import logging
import re
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from layertap.storage.errors import ConfigError, UserError
from layertap.storage.redact import public_url, scrubbed
from layertap.storage.retry import SPREAD

log = logging.getLogger(__name__)

AWAY_STATUSES = {409, 425, 429, 503}
REFUSED_STATUSES = {400, 413, 422}
SERVER_ERROR_TRIES = 4  # a 500 failing one row alone is retried this many times in all before the row is refused
AWAY_TRIES = 5  # a 429/503 saying the request is too large (`TOO_LARGE`): tries in all before the row is refused
TOO_LARGE = re.compile(r"too large|too long|exceeds", re.IGNORECASE)  # not "rate limit reached": waited out
TIMEOUT_TRIES = 2  # a timeout of one row alone (the others answer): tries in all before the row is refused
FINISH_TRIES = 3  # answers that ended neither in "stop" nor "length": tries in all before the row is refused
FINISHED = ("stop", "length")
UNREACHABLE_TRIES = 3  # connection failures before the server ever answered: a wrong --endpoint, said at once
CONNECT_TIMEOUT_S = 10.0  # a connection not made by then is no connection (a dropped SYN), not a slow answer
PROBE = [{"role": "user", "content": "Hi"}]  # a request every server answers: `check` sends it first


class EndpointError(UserError):
    """The endpoint refuses every request (wrong URL, model or key): the run stops."""


class ServerGone(UserError):
    """The server stayed unreachable or overloaded longer than the retry window."""


@dataclass(frozen=True)
class Refused(Exception):
    """The server refused one request for good; the row is recorded with this reason."""

    reason: str
    status: int | None = None
    cause: str | None = None  # "timeout", "finish_abort", ...: the kind, where no HTTP status says it

    def __str__(self) -> str:
        return self.reason

    @property
    def kind(self) -> str:
        """How the row is counted in the stats: `http_500`, `timeout`, `finish_abort`, ..."""
        return self.cause or (f"http_{self.status}" if self.status else "server")


@dataclass(frozen=True, slots=True)
class Reply:
    content: str
    reasoning_content: str | None
    finish_reason: str
    completion_tokens: int


def api_base(endpoint: str) -> str:
    """`http://host:8000` or `http://host:8000/v1` -> the `/v1` base the client needs, without the
    endpoint's user:password and query (`endpoint_auth` and `endpoint_query` carry those)."""
    parts = urlsplit(endpoint)
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"--endpoint {public_url(endpoint)!r} has a port that is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--endpoint {public_url(endpoint)!r} is not an http(s) URL, e.g. http://localhost:8000/v1")
    path = parts.path.rstrip("/")
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, path if path.endswith("/v1") else path + "/v1", "", ""))


def endpoint_auth(endpoint: str) -> tuple[str, str] | None:
    """The endpoint's user:password, sent as HTTP basic auth (which replaces the Bearer key, as
    httpx did with them in the URL); None without."""
    parts = urlsplit(endpoint)
    if parts.username is None and parts.password is None:
        return None
    return unquote(parts.username or ""), unquote(parts.password or "")


def endpoint_query(endpoint: str) -> dict[str, str]:
    """The endpoint's query (`?token=...`), sent with every request."""
    return dict(parse_qsl(urlsplit(endpoint).query, keep_blank_values=True))


def auth_header(endpoint: str, api_key: str | None) -> dict[str, str]:
    """The Authorization header the client sends: basic auth from the endpoint's user:password,
    else the Bearer key; for a request made without the client (`served`'s readiness poll)."""
    import base64

    if (auth := endpoint_auth(endpoint)) is not None:
        return {"Authorization": "Basic " + base64.b64encode(":".join(auth).encode()).decode()}
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _http_library(client_class: type) -> ModuleType:
    """The HTTP package an openai client class is built on: httpx up to openai 2, httpx2 from
    openai 3. Its connection limits must be of that package's own type."""
    for base in client_class.__mro__:
        if base.__name__ == "AsyncClient":
            return importlib.import_module(base.__module__.split(".")[0])
    raise TypeError(f"{client_class.__qualname__} is not built on an httpx AsyncClient")


class ChatClient:
    """Chat completions against one endpoint and model with one set of sampling settings."""

    def __init__(self, endpoint: str, model: str, *, api_key: str | None, sampling: dict[str, Any],
                 timeout_s: float, retry_for_s: float, concurrency: int, watch: Callable[[], None] | None = None):
        """`watch`: called after each failed request; raises where the server is known gone (the
        `--serve` process exited), so the run stops at once rather than after --retry-for."""
        import openai

        self.model, self.sampling, self.retry_for_s, self.watch = model, sampling, retry_for_s, watch
        self.where = public_url(endpoint)
        self._warned_at = -1e9
        self.answered = False  # until the server first answers, a refused connection is a wrong --endpoint
        self._failing: set[int] = set()  # requests that got a 5xx or timed out since the last success
        self._under_way: set[int] = set()  # requests started and not ended (each with its retries)
        self.last_rows = False  # set by the caller once no row is left to start: the requests under way are the last
        self._calls = itertools.count()
        self._last_success = time.monotonic()  # the last answer any request got: `ServerGone` counts from it
        self._other_models: set[str] = set()  # the other model names answers gave (`_check_model`)
        self.timeout_s, self.concurrency = timeout_s, concurrency
        http = _http_library(openai.DefaultAsyncHttpxClient)
        limits = http.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        # a wrong address whose packets are dropped (a firewall) waited the whole --request-timeout a try
        self.connect_timeout_s = min(CONNECT_TIMEOUT_S, timeout_s)
        timeout = http.Timeout(timeout_s, connect=self.connect_timeout_s)
        self.client = openai.AsyncOpenAI(base_url=api_base(endpoint), api_key=api_key or "none", max_retries=0,
                                         timeout=timeout, default_query=endpoint_query(endpoint) or None,
                                         http_client=openai.DefaultAsyncHttpxClient(limits=limits,
                                                                                    auth=endpoint_auth(endpoint)))

    async def close(self) -> None:
        await self.client.close()

    async def served_models(self) -> list[str]:
        """The model names the server lists (empty where it serves on demand, as `transformers serve` can)."""
        try:
            page = await self._call(lambda: self.client.models.list(), what="GET /models")
            return [m.id for m in page.data]
        except (ValueError, AttributeError, TypeError) as e:  # a body that is not JSON, or not a model list
            raise EndpointError(f"{self.where} answered GET /models with something that is not an OpenAI model "
                                f"list ({type(e).__name__}: {str(e)[:200]}); is --endpoint the server's address, "
                                f"not a proxy's page?") from None

    async def check(self) -> None:
        """Before any row: the endpoint answers, serves the model, and accepts a request with the
        run's own settings (its max_tokens and seed: a server refusing a prompt plus max_tokens
        past its context, or a seed, accepted a one-token probe and then refused every row, which
        made an output complete with nothing in it)."""
        served = await self.served_models()
        if served and self.model not in served:
            raise EndpointError(f"model {self.model!r} is not served at {self.where}; it serves {served}: "
                                f"pass one of these as --model")
        try:
            await self.complete(PROBE, seed=self.sampling.get("seed"))
        except Refused as e:
            raise EndpointError(f"{self.where} refused a request for model {self.model!r} with this run's settings "
                                f"({', '.join(f'{k} {v}' for k, v in self.sampling.items() if v is not None)}): {e}; "
                                "check --model, --max-tokens (a server refuses a prompt plus max_tokens past its "
                                "context), --seed and the server's log") from None

    def _request(self, messages: list[dict[str, Any]], *, max_tokens: int | None = None,
                 seed: int | None = None, tools: list | None = None) -> dict[str, Any]:
        """The keyword arguments of one chat completion."""
        body = {k: v for k, v in self.sampling.items() if k not in ("seed", "chat_template_kwargs")}
        if tools:  # the row's tool definitions: the template writes them into the prompt
            body["tools"] = tools
        template_kwargs = self.sampling.get("chat_template_kwargs")
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if seed is not None:
            body["seed"] = seed
        extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else None
        return {"model": self.model, "messages": messages, "extra_body": extra, **body}

    async def complete(self, messages: list[dict[str, Any]], *, max_tokens: int | None = None,
                       seed: int | None = None, tools: list | None = None) -> Reply:
        """The assistant's next turn after `messages` (given the row's `tools`). A call of a tool
        is refused at once: its answer would need the tool's result, which regeneration lacks."""
        request = self._request(messages, max_tokens=max_tokens, seed=seed, tools=tools)

        async def ask() -> Any:
            try:
                r = await self.client.chat.completions.create(**request)
            except json.JSONDecodeError as e:  # a 200 whose body is not JSON: a proxy's page
                raise _BadAnswer(f"an answer that is not JSON: {e.doc[:100]!r}", "malformed") from None
            # whatever the finish reason: vLLM ends a call forced by tool_choice in "stop", SGLang
            # keeps "length" beside the calls it parsed
            if _calls_tool(_answer(r)):
                raise Refused("the answer calls a tool, whose result regeneration cannot give", cause="tool_call")
            self._check_model(r)
            return r

        r = await self._call(ask, what="chat completion")
        choice = r.choices[0]
        usage = getattr(r.usage, "completion_tokens", 0) if r.usage is not None else 0
        return Reply(choice.message.content or "", _reasoning(choice.message), choice.finish_reason,
                     usage if isinstance(usage, int) else 0)

    def _check_model(self, r: Any) -> None:
        """Warn, once per name, where an answer names another model than --model: a router in front
        of the server falling back to another model would have its answers stored as the target's."""
        named = getattr(r, "model", None)
        if isinstance(named, str) and named and named != self.model and named not in self._other_models:
            self._other_models.add(named)
            log.warning("%s answered a request for model %r as model %r: if a router or proxy falls back to "
                        "another model, its answers are not the target's (they are stored all the same)",
                        self.where, self.model, named)

    async def _call(self, request, *, what: str):
        """`request()` under the retry policy in the module docstring."""
        me = next(self._calls)
        self._under_way.add(me)
        try:
            return await self._retried(request, what, me)
        finally:  # answered, refused or stopped: no longer a request failing
            self._failing.discard(me)
            self._under_way.discard(me)

    async def ended_under_way(self) -> None:
        """Wait until each request under way now has ended: answered, refused or given up."""
        now = set(self._under_way)
        while now & self._under_way:
            await asyncio.sleep(0.05)

    async def _retried(self, request, what: str, me: int):
        import openai

        away_since: float | None = None
        unreachable = 0
        tries: dict[str, int] = {}  # this request's failures of each kind that may be its row's own
        delay = 0.5
        while True:
            try:
                reply = await request()
                self._answered()
                return reply
            except _BadAnswer as e:
                self.answered = True
                problem = e.problem
                if await self._its_own(tries, "bad answer", FINISH_TRIES, me):
                    raise Refused(f"{problem} (after {tries['bad answer']} tries)", cause=e.cause) from None
            except openai.APIStatusError as e:
                self.answered = True
                status, reason = e.status_code, _reason(e)
                if status in REFUSED_STATUSES:
                    raise Refused(f"{status}: {reason}", status) from None
                if status in (401, 403, 404):
                    key = (" and the API key (the environment variable --api-key-env names, OPENAI_API_KEY by "
                           "default)") if status in (401, 403) else ""
                    raise EndpointError(f"{self.where} answered {status} to a {what} for model {self.model!r}: "
                                        f"{reason}; check --endpoint, --model{key}") from None
                problem = f"{status}: {reason}"
                if status not in AWAY_STATUSES:  # 500 and other errors, a proxy's 502/504: this row's, or an outage
                    if await self._its_own(tries, "server error", SERVER_ERROR_TRIES, me):
                        raise Refused(f"{status} after {tries['server error']} tries: {reason}", status) from None
                elif TOO_LARGE.search(reason) and await self._its_own(tries, "too large", AWAY_TRIES, me):
                    # a gateway's "request too large" 429 is this row's for good (a rate limit's is waited out)
                    raise Refused(f"{status} after {tries['too large']} tries while the server answered others: "
                                  f"{reason}", status) from None
            except openai.APIConnectionError as e:  # APITimeoutError among them
                if isinstance(e, openai.APITimeoutError) and not _connecting(e):
                    problem = f"no answer within the {self.timeout_s:g} s --request-timeout"
                    if await self._its_own(tries, "timeout", TIMEOUT_TRIES, me):
                        raise Refused(f"{problem}, {tries['timeout']} times, while the server answered others",
                                      cause="timeout") from None
                else:
                    problem = (f"no connection within {self.connect_timeout_s:g} s"
                               if isinstance(e, openai.APITimeoutError) else f"{type(e).__name__}: {e.__cause__ or e}")
                    unreachable += 1
                    if not self.answered and unreachable >= UNREACHABLE_TRIES:
                        raise EndpointError(f"cannot reach {self.where} ({problem}); is the server up, and is "
                                            "--endpoint its address (e.g. http://localhost:8000/v1)?") from None
            if self.watch is not None:
                self.watch()
            now = time.monotonic()
            away_since = away_since if away_since is not None else now
            # failing alone while others are answered is no outage: the window counts from the last answer
            failing_for = now - max(away_since, self._last_success)
            if failing_for > self.retry_for_s:
                raise ServerGone(f"{self.where} has failed every {what} for {failing_for:.0f} s (last: "
                                 f"{problem}); the rows answered so far are kept: rerun the same command once the "
                                 f"server is back") from None
            if time.monotonic() - self._warned_at > 30:  # one line per outage, not one per request in flight
                self._warned_at = time.monotonic()
                if unreachable and not self.answered:  # not an outage yet: a wrong --endpoint, until it answers
                    log.warning("%s: %s failed (%s); trying %d times in all before taking --endpoint for wrong",
                                self.where, what, problem, UNREACHABLE_TRIES)
                else:
                    log.warning("%s: %s failed (%s); retrying for up to %.0f s", self.where, what, problem,
                                self.retry_for_s - failing_for)
            await asyncio.sleep(delay * SPREAD.uniform(0.5, 1.0))
            delay = min(30.0, delay * 2)

    async def _its_own(self, tries: dict[str, int], kind: str, limit: int, me: int) -> bool:
        """One more failure of `kind` for request `me`, which counts as failing: whether, `limit` of
        them in all, they are its row's own (`_own_failure`). Failures judged an outage's are not the
        row's: they are counted afresh after it."""
        tries[kind] = tries.get(kind, 0) + 1
        self._failing.add(me)
        if tries[kind] < limit:
            return False
        if await self._own_failure():
            return True
        tries[kind] = 0
        return False

    async def _own_failure(self) -> bool:
        """Whether a failing request's failures are its row's own: few other requests have failed
        since the last success, and the server answers a known-good request now (else: an outage).
        Few: two at any --concurrency (at 2, two bad rows side by side were an outage on every
        rerun, and the output could never be finished), a quarter of it at a larger one. Any
        number among the last rows (`last_rows`), with no other request left to succeed in
        between (three bad rows among the last stopped every rerun with "failed every chat
        completion"): then the check alone decides."""
        import openai

        if len(self._failing) > max(2, self.concurrency // 4) and not self.last_rows:
            return False
        for _ in range(UNREACHABLE_TRIES):  # a keep-alive connection the server had closed is no answer: again
            try:
                _answer(await self.client.chat.completions.create(**self._request(PROBE, max_tokens=1)))
            except openai.APITimeoutError:
                return False
            except openai.APIConnectionError:
                continue
            except _BadAnswer as e:
                if e.shape:  # every answer so: not an outage to wait out, nor a row's own failure
                    raise EndpointError(f"{self.where} answers chat completions in another shape than OpenAI's "
                                        f"({e.problem}), the known-good request too; is --endpoint the server "
                                        "itself, not a proxy that rewrites its answers?") from None
                return False  # an engine aborting every request: an outage
            except (openai.APIError, ValueError):
                return False
            self._answered()
            return True
        return False

    def _answered(self) -> None:
        """A request got an answer: the server is up, and no request is failing an outage."""
        self.answered = True
        self._failing.clear()
        self._last_success = time.monotonic()


def _connecting(e: BaseException) -> bool:
    """Whether a timeout is the connection's (no answer to the SYN), not the request's."""
    return type(e.__cause__).__name__ == "ConnectTimeout"  # httpx's (or its fork's, `_http_library`)


class _BadAnswer(Exception):
    """A 200 that is no answer: malformed, or cut (a finish reason neither "stop" nor "length")."""

    def __init__(self, problem: str, cause: str, shape: bool = False):
        super().__init__(problem)
        self.problem, self.cause = problem, cause
        self.shape = shape  # a completion of another shape than OpenAI's (content not text): the server's way


def _answer(r: Any) -> Any:
    """The first choice of a chat completion that is a whole answer, else `_BadAnswer`: a server
    or a proxy in front of it may answer 200 with no choices, a choice without a message, content
    that is not text (a list of content parts), or an answer cut or empty."""
    choices = getattr(r, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise _BadAnswer(f"an answer with no choices: {str(r)[:100]!r}", "malformed")
    message = getattr(choices[0], "message", None)
    if message is None or not hasattr(message, "content"):
        raise _BadAnswer(f"an answer whose choice has no message: {str(choices[0])[:100]!r}", "malformed")
    for field in ("content", "reasoning_content", "reasoning"):
        value = getattr(message, field, None)
        if value is not None and not isinstance(value, str):
            raise _BadAnswer(f"an answer whose {field} is not text: {str(value)[:100]!r}", "malformed", shape=True)
    finish = getattr(choices[0], "finish_reason", None)
    if finish not in FINISHED and not _calls_tool(choices[0]):
        raise _BadAnswer(f"finish_reason {finish!r}: the answer is cut or empty", f"finish_{finish or 'missing'}")
    return choices[0]


def _calls_tool(choice: Any) -> bool:
    """Whether a choice calls a tool (its finish reason, or calls in its message: a server may end
    one in "stop" or "length")."""
    return getattr(choice, "finish_reason", None) == "tool_calls" or bool(getattr(choice.message, "tool_calls", None))


def _reasoning(message: Any) -> str | None:
    """vLLM named the field `reasoning_content`, then `reasoning` (vllm#27752; the old name was
    removed in vllm#33402); SGLang and others still write the old one."""
    return getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None) or None


def _reason(e: Any) -> str:
    """The server's message in an error body (vLLM and OpenAI: {"error": {"message"}}, FastAPI: {"detail"}),
    `scrubbed`: a proxy may quote the request's key or URL back, and the message reaches logs and stats."""
    return scrubbed(_said(e))[:500]


def _said(e: Any) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            for key in ("message", "detail"):
                if inner.get(key):
                    return str(inner[key])[:2000]
        elif isinstance(inner, str):
            return inner[:2000]
    return str(getattr(e, "message", e))[:2000]
