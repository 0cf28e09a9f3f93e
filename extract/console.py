"""What the console shows while a long command runs: a progress bar on a terminal, plain lines in a log.

On a terminal, log records are written above the bar (through `tqdm.write`) instead of into its
line. When stderr is a file or a pipe (a Slurm log), a bar's `\\r` redraws would pile up in it:
progress is then a log line every `PLAIN_EVERY_S` seconds, and the bars libraries draw (the GGUF
conversion, weight loading) are turned off.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from tqdm import tqdm

from layertap.storage.units import duration

log = logging.getLogger("layertap.progress")

PLAIN_EVERY_S = 30.0


def interactive() -> bool:
    """Whether stderr, where progress goes, is a terminal."""
    return bool(getattr(sys.stderr, "isatty", None) and sys.stderr.isatty())


def progress(total: int, *, desc: str, unit: str, initial: int = 0, enabled: bool = True,
             every_s: float = PLAIN_EVERY_S):
    """A tqdm bar on a terminal (logging redirected above it until `close`), else `PlainProgress`.

    Either answers what layertap's commands use of tqdm: `update`, `n`, `set_postfix(_str)`,
    `refresh`, `close`, and `with`.
    """
    if not enabled:
        return tqdm(total=total, disable=True)
    if interactive():
        return _TerminalBar(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                            dynamic_ncols=True, mininterval=1.0)
    return PlainProgress(total, desc=desc, unit=unit, initial=initial, every_s=every_s)


def quiet_library_bars() -> None:
    """Off a terminal, turn off the progress bars libraries draw with tqdm (transformers' GGUF
    conversion and weight loading, datasets' splits): tqdm switches itself off when its output is
    not a terminal only when asked (`disable=None`), and they do not ask. So the default changes
    here, once per process; a bar that passes `disable` itself keeps its choice."""
    if interactive():
        return
    from tqdm import std

    if getattr(std.tqdm, "_layertap_quiet", False):
        return
    init = std.tqdm.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("disable", None)
        init(self, *args, **kwargs)

    std.tqdm.__init__ = __init__
    std.tqdm._layertap_quiet = True


PAUSED_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # tqdm's, no ETA


def pause(bar: Any, paused: bool) -> None:
    """Show no ETA on `bar` (a tqdm or `PlainProgress`) while its work waits on something else (a full
    --window): its rate falls as it waits, and the ETA grew a minute every 30 s of it."""
    if isinstance(bar, PlainProgress):
        bar.paused = paused
    else:
        bar.bar_format = PAUSED_FORMAT if paused else None


class PlainProgress:
    """Progress as a log line every `every_s` seconds and one at the end, for logs that are files.

    'extract: 1,200/5,000 rows (24%), 41.3 rows/s, ETA 92 s; 3,100 tok/s, 12.0 MiB/s'
    """

    def __init__(self, total: int, *, desc: str, unit: str, initial: int = 0, every_s: float = PLAIN_EVERY_S):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n = self.start = initial
        self.t0 = self.logged = time.monotonic()
        self.postfix = ""
        self.closed = False
        self.paused = False  # waiting on something else than its own work (a full --window): no ETA
        self.logged_n: int | None = None  # the count the last line logged showed

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe_log()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_postfix(self, refresh: bool = True, **kwargs: Any) -> None:  # as tqdm's, which redraws unless told not to
        self.postfix = ", ".join(f"{k}={v}" for k, v in kwargs.items())

    def refresh(self) -> None:
        self._maybe_log()

    def line(self, final: bool = False) -> str:
        """The progress so far; `final`: the last line, without an ETA (a run that ends short of
        its total, stopped or failed, is not going on)."""
        elapsed = time.monotonic() - self.t0
        rate = (self.n - self.start) / elapsed if elapsed > 0 else 0.0
        text = f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}s"
        if self.total:
            text += f" ({100 * self.n / self.total:.0f}%)"
        # below one a second, seconds per unit (as tqdm does): "0.0 steps/s" said nothing
        pace = f"{rate:,.1f} {self.unit}s/s" if rate >= 1 or rate == 0 else f"{1 / rate:,.1f} s/{self.unit}"
        text += f", {pace}, {duration(elapsed)} elapsed"
        if rate > 0 and self.n < self.total and not final and not self.paused:
            text += f", ETA {duration((self.total - self.n) / rate)}"
        return text + (f"; {self.postfix}" if self.postfix else "")

    def _maybe_log(self) -> None:
        if time.monotonic() - self.logged >= self.every_s:
            self.logged, self.logged_n = time.monotonic(), self.n
            log.info("%s", self.line())

    def close(self) -> None:
        """The last line, unless the last one logged already said it was all done (a step of 30 s or
        more logs at each: the final line came twice, a checkpoint's line between them)."""
        if not self.closed:
            self.closed = True
            if not (self.logged_n == self.n == self.total):
                log.info("%s", self.line(final=True))

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stdout, sys.stderr)


class _TqdmHandler(logging.Handler):
    """Writes records with `tqdm.write`, which clears the bar, prints the line and redraws the bar."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _TerminalBar(tqdm):
    """A tqdm bar that, while open, sends the root logger's console records above itself.

    The console handlers (the one `logging.basicConfig` made) are swapped for equivalents that
    write through the bar, with the same level, format and filters; file handlers stay as they are.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        root = logging.getLogger()
        self._handlers: list[logging.Handler] | None = list(root.handlers)
        root.handlers = [_through_bar(h) if _is_console(h) else h for h in self._handlers]

    def close(self) -> None:
        try:
            super().close()
        finally:
            handlers, self._handlers = getattr(self, "_handlers", None), None
            if handlers is not None:
                logging.getLogger().handlers = handlers


def _through_bar(console: logging.StreamHandler) -> logging.Handler:
    h = _TqdmHandler(console.stream)
    h.setLevel(console.level)
    h.setFormatter(console.formatter)
    for f in console.filters:
        h.addFilter(f)
    return h
