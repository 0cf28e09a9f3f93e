"""The one error policy: an exception a user can fix derives from `UserError`.

`layertap` (layertap/cli.py) catches `UserError` once, at the top, and prints `error: <message>`
with exit code 2 and no traceback, so its message must name the thing and the fix. Anything else
is a bug (or a library's failure) and keeps its traceback. This module lives in `storage/`, the
lowest package, so that every package can raise these.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure the user can fix: a bad flag, a missing file, a store or run problem."""


class ConfigError(UserError, ValueError):
    """A setting (a flag or a --config file's key) is invalid; the message names the flag.

    Also a ValueError, for callers that build the settings in Python and catch that."""


class InputError(UserError, ValueError):
    """A user-given file, dataset or model cannot be used as it is; the message names it."""


class MissingInput(UserError, FileNotFoundError):
    """A user-given path (a model folder, a dataset, a prompts file) does not exist; the message
    names it. Also a FileNotFoundError, for callers that catch that."""
