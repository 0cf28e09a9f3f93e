"""The one retry policy of layertap's store requests.

Retries live in one layer, the store, so their cost adds up in one place: a backend turns each
failure into a `StoreError` whose type says whether another try is worth it, and `RetryPolicy.call`
retries the whole request (a body read included) with full-jitter exponential backoff. Nothing
above the store retries: a caller that gets a `TransientStoreError` has seen it persist.

- Transient (`TransientStoreError`): 5xx, throttling, timeouts, connections reset, bodies cut
  short. A busy or briefly failing server: up to `attempts` tries.
- Unreachable (`EndpointUnreachable`): no connection could be made at all (refused, unknown host).
  Before the endpoint ever answered, a wrong URL or a server that is down: `unreachable_attempts`
  quick tries, so the user hears about it within a few seconds instead of after half a minute of
  backoff. Once it has answered (`reached`), a refusal is a gateway restarting under a running
  job: as many tries as a transient failure, so a long extraction or training rides it out.
- Anything else (missing object, access denied, a bad request): raised at once.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from layertap.storage.errors import ConfigError
from layertap.storage.store import EndpointUnreachable, StoreError, TransientStoreError

# Jitter from the system's randomness, not `random`'s global generator: training ranks seed it alike
# (torch.manual_seed, DataLoader workers' random.seed(base + id)), and 1,000 ranks pausing alike after
# a 503 SlowDown would all retry at the same moments.
SPREAD = random.SystemRandom()

log = logging.getLogger(__name__)

SLOW_RETRY_S = 10.0  # a request retried this long after its first try is logged as a warning


class Backoff:
    """Waits for what another process makes (a commit to appear, room in a storage window):
    `first` seconds, doubling up to `limit`; `reset()` after progress. Polling, not retrying:
    no limit on the tries. `jitter` (a fraction, e.g. 0.25: each pause 0.75-1.25x) keeps many
    processes that start together from polling in step."""

    def __init__(self, first: float, limit: float, sleep: Callable[[float], None] | None = None,
                 jitter: float = 0.0):
        self.first, self.limit, self.jitter, self._sleep = first, limit, jitter, sleep
        self.delay = first

    def sleep(self) -> None:
        (self._sleep or time.sleep)(self.next_pause())

    def next_pause(self) -> float:
        """The next pause (jittered), without sleeping it: the delay doubles for the one after."""
        pause = self.delay * SPREAD.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else self.delay
        self.delay = min(self.limit, 2 * self.delay)
        return pause

    def reset(self) -> None:
        self.delay = self.first
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    attempts: int = 8  # tries of a request that fails transiently, the first included
    unreachable_attempts: int = 3  # tries while no connection can be made at all
    base_s: float = 0.1  # the n-th wait is uniform in [0, min(cap_s, base_s * 2**n)]
    cap_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.unreachable_attempts < 1:
            raise ConfigError(f"attempts and unreachable_attempts must be >= 1, got {self.attempts} and "
                             f"{self.unreachable_attempts}")

    def limit(self, error: StoreError, reached: bool = False) -> int:
        """How many tries `error` is worth in all; `reached`: the endpoint has answered before."""
        if isinstance(error, EndpointUnreachable) and not reached:
            return self.unreachable_attempts
        return self.attempts if isinstance(error, TransientStoreError) else 1

    def call(self, fn: Callable[[], T], translate: Callable[[Exception], StoreError | None],
             on_retry: Callable[[], None] | None = None, reached: bool = False) -> T:
        """`fn()`, tried again while the `StoreError` it raises (or `translate` makes of what it
        raises) is worth it. `translate` returns None for exceptions that are not store failures
        (bugs): they propagate unchanged. The error raised at the end says how many tries it took."""
        attempt, started = 0, time.monotonic()
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - sorted by translate; the rest re-raised as is
                error = e if isinstance(e, StoreError) else translate(e)
                if error is None:
                    raise
                if attempt >= self.limit(error, reached):
                    if attempt > 1:
                        error = type(error)(f"{error} (tried {attempt} times)")
                    raise error from None
            # Told where a request has failed for a while (a server that stopped answering: 60 s to each
            # read timeout), which a log would otherwise show as a hang; a quick 503 retried is routine.
            waited = time.monotonic() - started
            log.log(logging.WARNING if waited >= SLOW_RETRY_S else logging.DEBUG, "retrying after %s (try %d of %d, "
                    "%.0f s since the first)", error, attempt + 1, self.limit(error, reached), waited)
            if on_retry is not None:
                on_retry()
            time.sleep(SPREAD.uniform(0, min(self.cap_s, self.base_s * 2**attempt)))
