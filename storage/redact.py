"""Secrets kept out of what layertap prints, logs and records: a URL's user:password and query
(`?X-Amz-Security-Token=`, `?token=`), a command line's --api-key / HF_TOKEN= values and its
Authorization credentials. One place, so an endpoint in an S3 error, a --serve line in a log and
a URL in an sbatch script's echo are scrubbed alike."""

from __future__ import annotations

import re
import urllib.parse

# A URL's user:password, to the last "@" before its path (a password may hold one), and its query
# and fragment (the delimiter kept in group 2, so a masked copy shows where it was)
_USERINFO = re.compile(r"(?<=://)[^/\s\"'`]*@")
_QUERY = re.compile(r"(://[^\s\"'`?#]*)([?#])[^\s\"'`]*")
# A secret's name ends with one of these words (--api-key, --hf-token, AWS_SECRET_ACCESS_KEY, db_password):
# not --tokenizer, --max-num-batched-tokens or TOKENIZERS_PARALLELISM, whose values a log must show.
_SECRET_WORD = r"(?:api[-_]?key|keys?|token|secret|password|passwd)"
# the value: a quoted string as a whole (a key with a space showed its rest), else up to a space; after
# a space, every word up to the next option or shell operator too (vLLM's --api-key takes several keys)
_VALUE = r"""(?:"[^"]*"|'[^']*'|\S+)"""
_MORE_VALUES = r"""(?:\s+(?![-;&|<>()])(?:"[^"]*"|'[^']*'|[^\s;&|<>()]+))*"""
_SECRET_OPTION = re.compile(rf"""(--?(?:[\w-]*[-_])?{_SECRET_WORD})(?![\w-])(?:(=){_VALUE}|(\s+){_VALUE}{_MORE_VALUES})""",
                            re.IGNORECASE)
# an Authorization header's credentials (`--header "Authorization: Bearer sk-..."`)
_CREDENTIALS = re.compile(r"\b((?:Bearer|Basic|Token)\s+)(?:\"[^\"]*\"|'[^']*'|[^\s\"']+)", re.IGNORECASE)
# a shell assignment of one, as in `HF_TOKEN=hf_... vllm serve ...` (not an option's `--hf-token=`)
_SECRET_ASSIGNMENT = re.compile(rf"""(?<![\w$-])((?:[A-Za-z_]\w*_)?{_SECRET_WORD})=("[^"]*"|'[^']*'|\S*)""",
                                re.IGNORECASE)
MASK = "***"


def urls_scrubbed(text: str, mask: str = "") -> str:
    """`text` with every URL's user:password, query and fragment removed, or replaced by `mask`
    (botocore's messages quote the endpoint; a --serve line may hold `https://user:pw@mirror`)."""
    text = _USERINFO.sub(f"{mask}@" if mask else "", text)
    return _QUERY.sub(rf"\1\2{mask}" if mask else r"\1", text)


def public_url(url: str) -> str:
    """An endpoint URL as messages show it: a user:password in it is never printed, nor a query or
    fragment (a token in `?X-Amz-Security-Token=`)."""
    if "://" not in url:  # not a URL ("user:secret@host:9000"): whatever comes before an "@" goes
        return re.split(r"[?#]", url.rpartition("@")[2])[0]
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # not a URL ("http://[::1:9000"): scrubbed as text
        return urls_scrubbed(url)
    try:
        parts.port
        stray = stray_at(url)
    except ValueError:  # a password holding "/" ("http://u:ab/cd@host:9000"): the host is after the last "@"
        stray = "@" in url
    if stray:  # ... also where what comes before the "/" reads as host and port ("http://minio:1234/pass@host")
        return urls_scrubbed(f"{parts.scheme}://{url.rpartition('@')[2]}")
    return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="").geturl()


def stray_at(url: str) -> bool:
    """Whether `url` holds an "@" after its host: a password holding "/", "?" or "#" unencoded, or
    a path holding "@" (no telling which: "http://minio:1234/pass@host" is a host, port and path)."""
    parts = urllib.parse.urlsplit(url)
    return "@" in url.partition("://")[2] and "@" not in parts.netloc


def redacted(command: str) -> str:
    """`command` with the values of its --api-key, --hf-token, ... options and of its HF_TOKEN=,
    API_KEY=, ... assignments masked, and its URLs' user:password and query and its Authorization
    credentials: a --serve line may carry a key, and keys are never logged."""
    masked = _SECRET_OPTION.sub(lambda m: f"{m[1]}{m[2] or m[3]}{MASK}", command)
    masked = _SECRET_ASSIGNMENT.sub(lambda m: f"{m[1]}={MASK}", masked)
    return _CREDENTIALS.sub(rf"\1{MASK}", urls_scrubbed(masked, MASK))
