"""One chat completion from an OpenAI-compatible server (vLLM, SGLang, `transformers serve`),
with the retry policy a days-long regeneration needs.

The `openai` client makes one try per call (its own retries are off); this module decides:

- the server is away (connection refused or reset, 502/503/504, 429 throttling): wait with
  backoff and try again, for up to `retry_for_s` of continuous failure, so a server that is
  restarted or briefly overloaded under a running job is ridden out (`ServerGone` after that);
  until the server has answered once, a refused connection is a wrong --endpoint: 3 quick tries;
- a 500 (or other 5xx) or a timeout is the row's own failure only while it is the one request
  failing: another request's success clears the slate. Once two or more requests have failed
  since the last success, the server is failing, not the row (an engine dead behind a live HTTP
  server answers 500 to all; a hung one times out on all), and every request waits as for a
  server away, so the rest of the dataset is never refused for an outage. A row failing alone is
  refused (`Refused`) after `SERVER_ERROR_TRIES` 5xx or `TIMEOUT_TRIES` timeouts. (At
  --concurrency 1 the first row of an outage fails alone, so it alone may be refused.);
- an answer that did not end in "stop" or "length" (vLLM's and SGLang's "abort" or "error", none
  at all) is empty or cut short: asked again, then the row is refused, never stored;
- the server refuses the request (400, 413, 422: a prompt too long for its context, a message it
  cannot template): the row is refused with the server's own reason;
- the server refuses us (401, 403, 404: a key, a model, a URL that is wrong): `EndpointError`,
  which stops the run, as every row would fail the same way.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import random
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from layertap.storage.errors import ConfigError, UserError

log = logging.getLogger(__name__)

AWAY_STATUSES = {408, 409, 425, 429, 502, 503, 504}
REFUSED_STATUSES = {400, 413, 422}
SERVER_ERROR_TRIES = 4  # a 500 failing one row alone is retried this many times in all before the row is refused
TIMEOUT_TRIES = 2  # a timeout of one row alone (the others answer): tries in all before the row is refused
FINISH_TRIES = 3  # answers that ended neither in "stop" nor "length": tries in all before the row is refused
FINISHED = ("stop", "length")
UNREACHABLE_TRIES = 3  # connection failures before the server ever answered: a wrong --endpoint, said at once


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
    """`http://host:8000` or `http://host:8000/v1` -> the `/v1` base the client needs."""
    parts = urlsplit(endpoint)
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"--endpoint {public_url(endpoint)!r} has a port that is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--endpoint {public_url(endpoint)!r} is not an http(s) URL, e.g. http://localhost:8000/v1")
    path = parts.path.rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, path if path.endswith("/v1") else path + "/v1", "", ""))


def public_url(endpoint: str) -> str:
    """The endpoint without user:password or query (which may carry tokens): safe to log and record."""
    parts = urlsplit(endpoint)
    host = parts.netloc.rsplit("@", 1)[-1]  # no user:password
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


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
                 timeout_s: float, retry_for_s: float, concurrency: int):
        import openai

        self.model, self.sampling, self.retry_for_s = model, sampling, retry_for_s
        self.where = public_url(endpoint)
        self._warned_at = -1e9
        self.answered = False  # until the server first answers, a refused connection is a wrong --endpoint
        self._failing: set[int] = set()  # requests that got a 5xx or timed out since the last success
        self._calls = itertools.count()
        self.timeout_s = timeout_s
        http = _http_library(openai.DefaultAsyncHttpxClient)
        limits = http.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = openai.AsyncOpenAI(base_url=api_base(endpoint), api_key=api_key or "none", max_retries=0,
                                         timeout=timeout_s,
                                         http_client=openai.DefaultAsyncHttpxClient(limits=limits))

    async def close(self) -> None:
        await self.client.close()

    async def served_models(self) -> list[str]:
        """The model names the server lists (empty where it serves on demand, as `transformers serve` can)."""
        page = await self._call(lambda: self.client.models.list(), what="GET /models")
        return [m.id for m in page.data]

    async def check(self) -> None:
        """Before any row: the endpoint answers, serves the model, and accepts a one-token request."""
        served = await self.served_models()
        if served and self.model not in served:
            raise EndpointError(f"model {self.model!r} is not served at {self.where}; it serves {served}: "
                                f"pass one of these as --model")
        try:
            await self.complete([{"role": "user", "content": "Hi"}], max_tokens=1)
        except Refused as e:
            raise EndpointError(f"{self.where} refused a one-token request for model {self.model!r}: {e}; "
                                f"check --model and the server's log") from None

    async def complete(self, messages: list[dict[str, Any]], *, max_tokens: int | None = None,
                       seed: int | None = None) -> Reply:
        """The assistant's next turn after `messages`."""
        body = {k: v for k, v in self.sampling.items() if k not in ("seed", "chat_template_kwargs")}
        template_kwargs = self.sampling.get("chat_template_kwargs")
        extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else None
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if seed is not None:
            body["seed"] = seed
        for tries in range(1, FINISH_TRIES + 1):
            r = await self._call(lambda: self.client.chat.completions.create(
                model=self.model, messages=messages, extra_body=extra, **body), what="chat completion")
            choice = r.choices[0]
            if choice.finish_reason in FINISHED:
                break
            log.warning("%s: an answer ended with finish_reason %r (try %d of %d)", self.where, choice.finish_reason,
                        tries, FINISH_TRIES)
        else:
            raise Refused(f"finish_reason {choice.finish_reason!r} after {FINISH_TRIES} tries: the answer is cut or "
                          f"empty", cause=f"finish_{choice.finish_reason or 'missing'}")
        usage = r.usage.completion_tokens if r.usage is not None else 0
        reasoning = getattr(choice.message, "reasoning_content", None) or None
        return Reply(choice.message.content or "", reasoning, choice.finish_reason, int(usage or 0))

    async def _call(self, request, *, what: str):
        """`request()` under the retry policy in the module docstring."""
        import openai

        away_since: float | None = None
        server_errors = unreachable = timeouts = 0
        delay = 0.5
        me = next(self._calls)
        while True:
            try:
                reply = await request()
                self.answered = True
                self._failing.clear()
                return reply
            except openai.APIStatusError as e:
                self.answered = True
                status, reason = e.status_code, _reason(e)
                if status in REFUSED_STATUSES:
                    raise Refused(f"{status}: {reason}", status) from None
                if status in (401, 403, 404):
                    raise EndpointError(f"{self.where} answered {status} to a {what} for model {self.model!r}: "
                                        f"{reason}; check --endpoint, --model and the API key") from None
                problem = f"{status}: {reason}"
                if status not in AWAY_STATUSES:  # 500 and other errors: this row's, or an outage
                    server_errors += 1
                    if self._alone_failing(me) and server_errors >= SERVER_ERROR_TRIES:
                        raise Refused(f"{status} after {server_errors} tries: {reason}", status) from None
            except openai.APITimeoutError:
                problem = f"no answer within the {self.timeout_s:g} s --request-timeout"
                timeouts += 1
                if self._alone_failing(me) and timeouts >= TIMEOUT_TRIES:
                    raise Refused(f"{problem}, {timeouts} times, while no other request failed",
                                  cause="timeout") from None
            except openai.APIConnectionError as e:
                problem = f"{type(e).__name__}: {e.__cause__ or e}"
                unreachable += 1
                if not self.answered and unreachable >= UNREACHABLE_TRIES:
                    raise EndpointError(f"cannot reach {self.where} ({problem}); is the server up, and is --endpoint "
                                        f"its address (e.g. http://localhost:8000/v1)?") from None
            now = time.monotonic()
            away_since = away_since if away_since is not None else now
            if now - away_since > self.retry_for_s:
                raise ServerGone(f"{self.where} has failed every {what} for {now - away_since:.0f} s (last: "
                                 f"{problem}); the rows answered so far are kept: rerun the same command once the "
                                 f"server is back") from None
            if time.monotonic() - self._warned_at > 30:  # one line per outage, not one per request in flight
                self._warned_at = time.monotonic()
                if unreachable and not self.answered:  # not an outage yet: a wrong --endpoint, until it answers
                    log.warning("%s: %s failed (%s); trying %d times in all before taking --endpoint for wrong",
                                self.where, what, problem, UNREACHABLE_TRIES)
                else:
                    log.warning("%s: %s failed (%s); retrying for up to %.0f s", self.where, what, problem,
                                self.retry_for_s - (now - away_since))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(30.0, delay * 2)

    def _alone_failing(self, request: int) -> bool:
        """Record that `request` failed; whether it is the only one failing since the last success
        (then the failure is its row's; a refused row stays counted, so the next failing one is not)."""
        self._failing.add(request)
        return len(self._failing) == 1


def _reason(e: Any) -> str:
    """The server's message in an error body (vLLM and OpenAI: {"error": {"message"}}, FastAPI: {"detail"})."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            for key in ("message", "detail"):
                if inner.get(key):
                    return str(inner[key])[:500]
        elif isinstance(inner, str):
            return inner[:500]
    return str(getattr(e, "message", e))[:500]
