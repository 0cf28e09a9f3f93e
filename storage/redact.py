"""Secrets kept out of what layertap prints, logs and records: a URL's user:password and query
(`?X-Amz-Security-Token=`, `?token=`), a command line's --api-key / HF_TOKEN= values and its
Authorization credentials. One place, so an endpoint in an S3 error, a --serve line in a log and
a URL in an sbatch script's echo are scrubbed alike."""

from __future__ import annotations

import logging
import re
import urllib.parse

# A URL's user:password, to the last "@" before its path (a password may hold one), and its query
# and fragment (the delimiter kept in group 2, so a masked copy shows where it was)
_USERINFO = re.compile(r"(?<=://)[^/\s\"'`]*@")
# (not a store location's: `#` and `?` are plain characters in an s3:// or file:// prefix, `s3://b/run#1`)
_URL_HEAD = r"((?<![\w+.-])(?!s3://|file://)[A-Za-z][\w+.-]*://[^\s\"'`?#]*)"  # a URL to its query, not a store's
_QUERY = re.compile(_URL_HEAD + r"([?#])[^\s\"'`]*")
# A secret's name ends with one of these words (--api-key, --hf-token, AWS_SECRET_ACCESS_KEY, db_password):
# not --tokenizer, --max-num-batched-tokens or TOKENIZERS_PARALLELISM, whose values a log must show.
_SECRET_WORD = r"(?:api[-_]?key|keys?|token|secret|password|passwd|auth|credentials?|access[-_]key[-_]id)"
# the value: a quoted string as a whole (a key with a space showed its rest), else up to a space, a quote
# that ends it left (`--serve 'vllm serve m --api-key sk-1'` lost its closing quote, and a dry run printed
# a script bash refused) and one inside it taken (shlex writes a key's ' as '"'"'); after a space, every
# word up to the next option or shell operator too (vLLM's --api-key takes several keys)
_BARE = r"""(?:[^\s"']|["'](?=\S))+"""
_VALUE = rf"""(?:"[^"]*"|'[^']*'|{_BARE})"""
_MORE_VALUES = r"""(?:\s+(?![-;&|<>()])(?:"[^"]*"|'[^']*'|(?:[^\s;&|<>()"']|["'](?=[^\s;&|<>()]))+))*"""
# (?!-): a flag without a value (--no-auth) keeps the next option shown
_SECRET_OPTION = re.compile(rf"""(--?(?:[\w-]*[-_])?{_SECRET_WORD})(?![\w-])"""
                            rf"""(?:(=){_VALUE}|(\s+)(?!-){_VALUE}{_MORE_VALUES})""", re.IGNORECASE)
# one in JSON, as in `--hf-overrides '{"hf_token": "hf_..."}'`
_SECRET_PAIR = re.compile(rf"""(["'](?:[\w-]*[-_])?{_SECRET_WORD}["']\s*:\s*)(?:"[^"]*"|'[^']*'|[^\s,}}]+)""",
                          re.IGNORECASE)
# an Authorization header's credentials (`--header "Authorization: Bearer sk-..."`)
_CREDENTIALS = re.compile(r"\b((?:Bearer|Basic|Token)\s+)(?:\"[^\"]*\"|'[^']*'|[^\s\"']+)", re.IGNORECASE)
# a shell assignment of one, as in `HF_TOKEN=hf_... vllm serve ...` (not an option's `--hf-token=`)
_SECRET_ASSIGNMENT = re.compile(rf"""(?<![\w$-])((?:[A-Za-z_]\w*_)?{_SECRET_WORD})=("[^"]*"|'[^']*'|{_BARE}|)""",
                                re.IGNORECASE)
MASK = "***"
# credentials as a server echoes a request's Authorization header: scheme-cased, holding a digit or a capital
# after a small letter ("Basic authentication." and "Bearer token-based" are prose)
_SENT_CREDENTIALS = re.compile(r"\b((?:Bearer|Basic)\s+)(?=[A-Za-z._~+/=-]*(?:[0-9]|[a-z][A-Za-z._~+/=-]*[A-Z]))"
                               r"[A-Za-z0-9._~+/=-]{8,}")
_SENT_QUERY = re.compile(_URL_HEAD + r"\?[^\s\"'`#]*")
# ... and a request's secret headers as a server or proxy quotes them back (Authorization: to the line's end)
_KEY_HEADERS = re.compile(r"""\b((?:X-Amz-Security-Token|X-Api-Key|Api-Key)\s*[:=]\s*)[^\s,;'"]+""", re.IGNORECASE)
_AUTH_HEADER = re.compile(r"""\b(Authorization\s*:\s*)[^\n'"]+""", re.IGNORECASE)


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
    """`command` with the values of its --api-key, --hf-token, --auth, ... options, of its HF_TOKEN=,
    AWS_ACCESS_KEY_ID=, ... assignments and of JSON "hf_token": pairs masked, and its URLs'
    user:password and query, its Authorization credentials and X-Api-Key-style headers: a --serve
    line may carry a key, and keys are never logged. A secret passed as a plain option of no such
    name (a server's `-p PASSWORD`) cannot be told from any other value: pass it in a variable."""
    masked = _SECRET_OPTION.sub(lambda m: f"{m[1]}{m[2] or m[3]}{MASK}", command)
    masked = _SECRET_ASSIGNMENT.sub(lambda m: f"{m[1]}={MASK}", masked)
    masked = _SECRET_PAIR.sub(rf"\1{MASK}", masked)
    masked = _KEY_HEADERS.sub(rf"\1{MASK}", masked)  # an Authorization header's: `_CREDENTIALS`
    return _CREDENTIALS.sub(rf"\1{MASK}", urls_scrubbed(masked, MASK))


def scrubbed(text: str) -> str:
    """`text` with its URLs' user:password and query and its sent credentials masked:
    for what other code wrote (a library's log record, a server's error message, an exception's
    text), where only a URL or a header can carry a secret, and command-line masking would also
    hide ordinary words."""
    text = _USERINFO.sub(f"{MASK}@", text)
    text = _SENT_QUERY.sub(rf"\1?{MASK}", text)  # a fragment is never sent: a doc link's #section stays
    text = _AUTH_HEADER.sub(rf"\1{MASK}", _KEY_HEADERS.sub(rf"\1{MASK}", text))
    return _SENT_CREDENTIALS.sub(rf"\1{MASK}", text)


_record_factory = None


def scrub_log_records() -> None:
    """Every log record from here on, whoever logs it, with `scrubbed` text: huggingface_hub's
    warnings quote HF_ENDPOINT whole, user:password and all, into consoles and --log-dir files.
    Scrubbed as the record is made, so each handler (the console's, each log file's, a progress
    bar's stand-in) gets it so; once per process."""
    global _record_factory
    if _record_factory is not None:
        return
    _record_factory = make = logging.getLogRecordFactory()

    def record(*args, **kwargs) -> logging.LogRecord:
        r = make(*args, **kwargs)
        try:
            text = r.getMessage()
        except Exception:  # a bad call's record, as logging reports it when it is emitted: not raised here
            return r
        if (clean := scrubbed(text)) != text:
            r.msg, r.args = clean, ()
        if r.exc_info and r.exc_info[1] is not None:  # its traceback, which a handler's formatter would cache
            r.exc_text = scrubbed(logging.Formatter().formatException(r.exc_info))
        return r

    logging.setLogRecordFactory(record)
