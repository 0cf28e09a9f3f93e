"""Dataset rows -> tokenized training samples: ``input_ids`` plus the loss mask a drafter trains on.

Three row shapes are accepted, detected once per dataset from its columns (a chat row may be in
either chat form, so a file can mix them):

- pre-tokenized: ``input_ids`` with ``loss_mask`` (0/1) or ``labels`` (-100 = unsupervised);
- ShareGPT: ``conversations`` = ``[{"from", "value"}, ...]``;
- OpenAI chat: ``messages`` = ``[{"role", "content"}, ...]``, with tool calls: a ``tools`` column
  (a list, or that list as a JSON string), assistant messages with ``tool_calls`` and ``tool``
  messages with the results.

An assistant turn with ``weight`` 0 (either chat form) is context only: rendered, not trained on.

Chats are rendered with the target tokenizer's own chat template, so the drafter sees exactly
the text the target serves. The loss mask covers what the target would generate in each
assistant turn: the content and the end-of-turn token that closes it, never the role header
nor the whitespace a template writes after the end-of-turn token. See :func:`_assistant_spans`
for how the spans are found without per-template configuration.

Every row ends as exactly one record, a :class:`TokenizedSample` or a :class:`Skipped` with a
reason, so a run can account for all of its input.
"""

from __future__ import annotations

import enum
import functools
import glob
import json
import logging
import os
import re
import reprlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import torch

from layertap.extract.dataset_files import DataFiles, data_files, quiet
from layertap.extract.fingerprint import load_saved
from layertap.storage.errors import ConfigError, InputError

log = logging.getLogger(__name__)

USER_ROLES = {"human": "user", "user": "user"}
ASSISTANT_ROLES = {"gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                   "bard": "assistant", "bing": "assistant"}
SYSTEM_ROLES = {"system": "system", "developer": "system"}  # OpenAI renamed system to developer
_ROLES = {**USER_ROLES, **ASSISTANT_ROLES, **SYSTEM_ROLES}
TOOL_ROLES = {"tool": "tool"}  # tool results; accepted where `normalize_chat` is asked to

_MAX_ID_CHARS = 40
# A string no chat template or dataset produces, standing in for assistant content in the probe.
_SENTINEL = "\uE000layertap-probe\uE001"


class RowShape(str, enum.Enum):
    PRETOKENIZED = "pretokenized"
    SHAREGPT = "sharegpt"
    MESSAGES = "messages"


ACCEPTED_SHAPES = (
    "pre-tokenized: 'input_ids' with 'loss_mask' or 'labels'; "
    "ShareGPT: 'conversations' of {from, value}; "
    "OpenAI chat: 'messages' of {role, content}"
)


# Skip reasons: short stable codes, counted in TokenizeStats.skipped.
EMPTY = "empty"
NO_CHAT = "no_chat"  # a chat dataset's row without the chat column (null: another shape's row in the file)
NO_SUPERVISED_PAIR = "no_supervised_pair"
ANSWER_PAST_MAX_LENGTH = "answer_past_max_length"  # a pair only past the cut at max_length: the prompt is longer
BAD_MESSAGE = "bad_message"
TEMPLATE_ERROR = "template_error"


@dataclass(frozen=True, slots=True)
class TokenizedSample:
    """One training sample. ``loss_mask[i]`` says whether token ``i`` is supervised."""

    sample_id: str
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]
    truncated: bool = False

    def __len__(self) -> int:
        return int(self.input_ids.numel())


@dataclass(frozen=True, slots=True)
class Skipped:
    """A row that produced no sample. ``reason`` is one of the codes above; ``detail`` is for humans."""

    sample_id: str
    reason: str
    detail: str = ""


@dataclass(slots=True)
class TokenizeStats:
    """Counters updated while :func:`tokenize_rows` runs; ``rows == samples + sum(skipped)``."""

    rows: int = 0
    samples: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    answer_tokens: int = 0  # the supervised tokens before truncation: the answers' own length
    truncated: int = 0
    dropped_turns: int = 0  # assistant turns before the first user turn, see normalize_chat
    prompted: int = 0  # chats with a user turn, answered or not: the rows `layertap regenerate` answers
    skipped: Counter[str] = field(default_factory=Counter)


# ---------------------------------------------------------------------------------------------
# Loading


def load_rows(path: str, limit: int | None = None, s3: Mapping[str, Any] | None = None):
    """Open ``path`` as a ``datasets.Dataset``: a .jsonl/.json/.parquet file, a folder or glob of
    such files (`dataset_files`), a ``save_to_disk`` folder, or the output of `layertap regenerate`
    (a local folder or an S3 prefix).

    ``limit`` keeps the first ``limit`` rows, so a small run sees the same rows as the start of
    a big one. ``s3``: the "s3" settings of the command's --config, for data on S3.
    """
    from layertap.extract.regenerated import is_regenerated, load_regenerated

    _check_limit(limit)
    if is_regenerated(path):
        return load_regenerated(path, limit, s3)[0]
    return _rows(path, data_files(path, s3), limit)


def load_pinned_rows(path: str, limit: int | None = None, s3: Mapping[str, Any] | None = None):
    """(`load_rows`, `dataset_fingerprint`) of one resolution of `path`'s files: resolved once for
    each, a folder a download was still filling gave the rows of N files and pinned N+1."""
    from layertap.extract.fingerprint import fingerprint_of
    from layertap.extract.regenerated import is_regenerated, load_regenerated

    _check_limit(limit)
    if is_regenerated(path):
        return load_regenerated(path, limit, s3)
    source = data_files(path, s3)
    return _rows(path, source, limit), fingerprint_of(path, source, limit)


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit <= 0:
        raise ConfigError(f"limit must be a positive number of rows, got {limit}")


def _rows(path: str, source: DataFiles | None, limit: int | None):
    """The rows of `source` (None: `path` is a save_to_disk folder), the first `limit` of them."""
    import datasets

    if source is None:
        ds = load_saved(os.path.expanduser(path))
    else:
        files = [f for f in source.files if not _file_has_no_rows(f)]
        if not files:
            raise InputError(f"dataset {path!r} has no rows; give a dataset with at least one row")
        try:
            with quiet("datasets.packaged_modules"):  # it logs the error it raises, twice over
                # escaped: `datasets` takes each path for a pattern ('only[1]/a.jsonl' read only1/a.jsonl)
                ds = datasets.load_dataset(source.builder, data_files=[glob.escape(f) for f in files], split="train")
        except Exception as e:  # datasets wraps parse errors in its own, path-less, exceptions
            raise InputError(_unreadable(source, files, e)) from e
        if not source.single:
            log.info("dataset %s: %d %s files, %d rows", path, len(files), source.builder, len(ds))
    if len(ds) == 0:
        raise InputError(f"dataset {path!r} has no rows; give a dataset with at least one row")
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    return ds


def _unreadable(source: DataFiles, files: list[str], e: Exception) -> str:
    """Why `datasets` could not read `files`, naming the file and line where a JSON Lines file has
    a bad one."""
    cause = e.__cause__ or e
    kind = os.path.splitext(files[0])[1].lower() if source.single else f"{source.builder} files"
    said = f"dataset {source.given!r} could not be read as {kind}: "
    for f in files:
        if f.lower().endswith(".jsonl") and (bad := _first_bad_line(f)):
            return said + (bad if source.single else f"{f}: {bad}")
    return said + f"{type(cause).__name__}: {cause}" + (_cut_short(files[0]) if kind == ".json" else "")


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _first_bad_line(path: str) -> str | None:
    """'line 2 is not a JSON object: ...', for the first line of a JSON Lines file that is not one
    (1-based, as editors count; pyarrow's "row 1" counts from 0); None if every line parses."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            text = line.rstrip()  # the newline parsed with it, a line cut short failed "at column 1" (of the next)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                where = "where the line ends: it is cut short" if e.pos >= len(text) else f"at column {e.colno}"
                return f"line {n} is not JSON ({e.msg} {where}): {reprlib.repr(text.strip())}"
            if not isinstance(obj, dict):
                kind = _JSON_KINDS.get(type(obj), type(obj).__name__)
                return f"line {n} is a JSON {kind}, not an object (a row): {reprlib.repr(line.strip())}"
    return None


def _cut_short(path: str) -> str:
    """What to say of a JSON file whose text stops inside a value (a download cut short): the
    parser's own message names a position, not that the file is incomplete. The embedded
    ShareGPT file is such a file: the default dataset reads its whole records one at a time."""
    from layertap.extract.embedded import is_embedded_sharegpt

    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 4096))
        tail = f.read().rstrip()
    if tail.endswith((b"]", b"}")):
        return ""
    if is_embedded_sharegpt(path):
        return ("; this is the embedded ShareGPT file, which ends mid-record: leave --dataset out to take its whole "
                "conversations (with --limit N for the first N)")
    return (f"; the file ends inside a value ({os.path.getsize(path):,} bytes, its last text "
            f"{reprlib.repr(tail[-40:].decode('utf-8', 'replace'))}): it looks cut short; fetch it again whole")


def _file_has_no_rows(path: str) -> bool:
    """Empty inputs make ``datasets`` fail with misleading errors, so spot them first."""
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows == 0
        except Exception:  # not parquet after all: let datasets report it
            return False
    with open(path, "rb") as f:
        head = f.read(64)
    return len(head) < 64 and head.strip() in (b"", b"[]")


# ---------------------------------------------------------------------------------------------
# Row shapes


def detect_row_shape(columns: Iterable[str]) -> RowShape:
    """The row shape a dataset's columns match; pre-tokenized wins, as its tokens are explicit."""
    cols = set(columns)
    if "input_ids" in cols:
        if "loss_mask" in cols or "labels" in cols:
            return RowShape.PRETOKENIZED
        raise InputError(f"rows have 'input_ids' but neither 'loss_mask' nor 'labels' (columns: "
                         f"{sorted(cols)}); add one so the drafter knows which tokens to learn")
    if "messages" in cols:
        return RowShape.MESSAGES
    if "conversations" in cols:
        return RowShape.SHAREGPT
    raise InputError(f"rows match no accepted shape; columns found: {sorted(cols)}. "
                     f"Accepted: {ACCEPTED_SHAPES}")


def sample_id(row: Mapping[str, Any], index: int) -> str:
    """A short id that is unique within the dataset and safe as a key or file name.

    It always starts with the row index: ids in real data repeat (ShareGPT V3 has 123 ids
    used by two different conversations), and a repeated key would overwrite or falsely
    "resume" a sample. The row's own id follows, cleaned to ``[A-Za-z0-9._-]``, for tracing.
    """
    raw = row.get("id")
    if raw is None or str(raw) == "":
        return str(index)
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", str(raw))[:_MAX_ID_CHARS]
    return f"{index}-{clean}"


# ---------------------------------------------------------------------------------------------
# Tokenizing


def tokenize_rows(rows: Iterable[Mapping[str, Any]], tokenizer, max_length: int, *,
                  start: int = 0, vocab_size: int | None = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None,
                  stats: TokenizeStats | None = None) -> Iterator[TokenizedSample | Skipped]:
    """Lazily, one :class:`TokenizedSample` or :class:`Skipped` per row, in order.

    ``start`` is the index of the first row in the whole dataset, so a worker that tokenizes a
    slice produces the same sample ids as a single pass. ``vocab_size`` bounds pre-tokenized ids
    (default ``len(tokenizer)``). Samples longer than ``max_length`` are cut and flagged.
    A sample with no two consecutive supervised tokens has nothing to train a drafter on
    (every training block starts at such a pair), so it is skipped with a reason.
    """
    if max_length < 2:
        raise ConfigError(f"max_length must be at least 2, got {max_length}")
    vocab = int(vocab_size if vocab_size is not None else len(tokenizer))
    columns = getattr(rows, "column_names", None)
    shape = detect_row_shape(columns) if columns is not None else None
    # A Dataset's columns are known now: fail on a bad shape or template before the first row.
    chat = None
    if shape in (RowShape.SHAREGPT, RowShape.MESSAGES):
        chat = _ChatRenderer(tokenizer, chat_template_kwargs)
    return _tokenize(rows, tokenizer, max_length, shape, chat, start, vocab, chat_template_kwargs,
                     stats if stats is not None else TokenizeStats())


def _utf8_rows(rows: Iterable[Mapping[str, Any]], start: int) -> Iterator[Mapping[str, Any]]:
    """`rows`, with text that is not UTF-8 refused by row: Arrow's JSON reader takes such bytes and
    the row fails only when read (a UnicodeDecodeError traceback, mid-plan)."""
    it, index = iter(rows), start
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            raise InputError(f"row {index} of the dataset holds text that is not UTF-8 ({e.reason}: byte "
                             f"{e.object[e.start:e.start + 1]!r}): a dataset's text must be UTF-8; convert the file "
                             "(e.g. `iconv -f latin1 -t utf-8`)") from None
        yield row
        index += 1


def _tokenize(rows, tokenizer, max_length, shape, chat, start, vocab, template_kwargs,
              stats: TokenizeStats) -> Iterator[TokenizedSample | Skipped]:
    for index, row in enumerate(_utf8_rows(rows, start), start):
        if shape is None:  # a plain iterable: the first row's keys decide
            shape = detect_row_shape(row.keys())
        sid = sample_id(row, index)
        stats.rows += 1
        if shape is RowShape.PRETOKENIZED:
            out = _pretokenized(row, sid, index, vocab)
        else:
            chat = chat or _ChatRenderer(tokenizer, template_kwargs)
            out = chat.tokenize(row, sid, shape, stats)
            if isinstance(out, TokenizedSample) and out.input_ids.numel() and int(out.input_ids.max()) >= vocab:
                # A token the tokenizer has and the model cannot embed (added without resizing):
                # a device-side assert on CUDA that takes the worker down. The pair is wrong, not the row.
                raise ConfigError(f"row {index} ({sid}) tokenizes to id {int(out.input_ids.max())}, beyond the "
                                  f"model's vocabulary of {vocab} (the tokenizer has {len(tokenizer)} tokens): "
                                  f"use the tokenizer the model was trained with, or resize its embeddings")
        answer = 0  # the supervised tokens before truncation
        if isinstance(out, TokenizedSample):
            answer = int(out.loss_mask.sum())
            out = _finish(out, max_length)
        if isinstance(out, Skipped):
            stats.skipped[out.reason] += 1
        else:
            stats.samples += 1
            stats.tokens += len(out)
            stats.supervised_tokens += int(out.loss_mask.sum())
            stats.answer_tokens += answer
            stats.truncated += out.truncated
        yield out


def _finish(sample: TokenizedSample, max_length: int) -> TokenizedSample | Skipped:
    """Truncate, then drop what a drafter cannot learn from."""
    ids, mask = sample.input_ids, sample.loss_mask
    if ids.numel() == 0:
        return Skipped(sample.sample_id, EMPTY, "no tokens")
    truncated = ids.numel() > max_length
    if truncated:
        ids, mask = ids[:max_length].clone(), mask[:max_length].clone()  # clone: free the rest
    if not bool((mask[:-1] & mask[1:]).any()):
        whole = sample.loss_mask
        if truncated and bool((pairs := whole[:-1] & whole[1:]).any()):
            first = int(pairs.nonzero()[0])  # not the first supervised token: an empty answer's lone end token
            return Skipped(sample.sample_id, ANSWER_PAST_MAX_LENGTH,
                           f"no two consecutive supervised tokens within max_length={max_length}: the first pair "
                           f"is tokens {first} and {first + 1} (--max-length {first + 2} or more keeps it)")
        return Skipped(sample.sample_id, NO_SUPERVISED_PAIR, "no two consecutive supervised tokens")
    return TokenizedSample(sample.sample_id, ids, mask, truncated)


def _pretokenized(row: Mapping[str, Any], sid: str, index: int, vocab: int) -> TokenizedSample | Skipped:
    ids_raw = row.get("input_ids")
    if ids_raw is None:  # a row of another shape, in a file whose other rows are pre-tokenized
        keys = sorted(k for k, v in row.items() if v is not None)
        raise InputError(f"row {index} ({sid}) has no input_ids (its fields: {keys}), so it matches no accepted "
                         f"row shape ({ACCEPTED_SHAPES}); fix the row or remove it")
    where = f"row {index} ({sid})"
    ids = _column_tensor(ids_raw, "input_ids", "a list of integers", where)
    if ids.numel() == 0:
        return Skipped(sid, EMPTY, "input_ids is empty")
    if ids.dtype == torch.bool:
        raise InputError(f"{where}: input_ids must be integers, got booleans")
    if ids.dtype.is_floating_point:
        # A JSON reader makes the whole column float when one row holds a float, so whole numbers
        # are token ids as written; a fraction is refused in the row that holds it.
        bad = ~torch.isfinite(ids) | (ids != ids.trunc())
        if bool(bad.any()):
            pos = int(bad.nonzero()[0])
            raise InputError(f"{where}: input_ids must be integers, got {ids[pos].item()} at "
                             f"position {pos}")
    ids = ids.to(torch.int64)
    labels = None
    if row.get("loss_mask") is not None:
        mask = _column_tensor(row["loss_mask"], "loss_mask", "a list of 0s and 1s", where)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise InputError(f"{where}: loss_mask must hold only 0 and 1")
        mask, name = mask.bool(), "loss_mask"
    elif row.get("labels") is not None:
        labels = _column_tensor(row["labels"], "labels", "a list of integers (-100: not supervised)", where)
        mask, name = labels >= 0, "labels"  # -100 by convention; any negative (-1) is an ignore index too
    else:
        raise InputError(f"{where}: both loss_mask and labels are null")
    if mask.numel() != ids.numel():
        raise InputError(f"{where}: {name} has {mask.numel()} entries for "
                         f"{ids.numel()} input_ids")
    if row.get("attention_mask") is not None:  # before the vocabulary check: a pad id may lie outside it
        keep = _kept(row["attention_mask"], ids.numel(), where)
        ids, mask, labels = ids[keep], mask[keep], labels[keep] if labels is not None else None
        if ids.numel() == 0:
            return Skipped(sid, EMPTY, "attention_mask is 0 everywhere")
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        raise InputError(f"{where}: token id {int(ids[pos])} at position {pos} is outside "
                         f"the vocabulary [0, {vocab}); were these rows tokenized for another model? Tokenize "
                         f"them with this model's tokenizer, or give the --model they were made for")
    if labels is not None:
        _check_labels(labels.to(torch.int64), ids, where)
    return TokenizedSample(sid, ids, mask)


def _check_labels(labels: torch.Tensor, ids: torch.Tensor, where: str) -> None:
    """Labels are read as a loss mask: where supervised they must be the input ids themselves, as
    HF's causal LMs take them (the model shifts them). Labels shifted already (labels[t] =
    input_ids[t+1]) would put every supervised token one place off."""
    on = labels >= 0
    if bool((labels[on] == ids[on]).all()):
        return
    if bool(on[:-1].any()) and bool((labels[:-1][on[:-1]] == ids[1:][on[:-1]]).all()):
        raise InputError(f"{where}: labels are shifted by one (labels[t] = input_ids[t+1]): give labels aligned "
                         "with input_ids, a copy of them with -100 where not supervised (the model shifts them), "
                         "or a loss_mask column")
    pos = int((on & (labels != ids)).nonzero()[0])
    raise InputError(f"{where}: labels[{pos}] is {int(labels[pos])}, input_ids[{pos}] is {int(ids[pos])}: labels "
                     "are read as a loss mask, a copy of input_ids with -100 where not supervised; give that, or a "
                     "loss_mask column")


def _kept(value: Any, n: int, where: str) -> torch.Tensor:
    """The tokens an `attention_mask` column keeps (a bool mask): a padded row (padding="max_length")
    would run its pads through the target as text, and left padding would put them before every
    prompt, so every stored state would come from a context the target never serves."""
    keep = _column_tensor(value, "attention_mask", "a list of 0s and 1s", where)
    if keep.numel() != n:
        raise InputError(f"{where}: attention_mask has {keep.numel()} entries for {n} input_ids")
    if bool(((keep != 0) & (keep != 1)).any()):
        raise InputError(f"{where}: attention_mask must hold only 0 and 1 (not the segment ids of packed "
                         "sequences: one row holds one sequence)")
    keep = keep.bool()
    on = keep.nonzero()
    if on.numel() and not bool(keep[int(on[0]) : int(on[-1]) + 1].all()):
        raise InputError(f"{where}: attention_mask has 0s between its 1s (packed sequences?): one row holds one "
                         "sequence, padded at either end at most")
    return keep


def _column_tensor(value: Any, column: str, expected: str, where: str) -> torch.Tensor:
    """A pre-tokenized column's value as a flat tensor. A value torch cannot read (strings, nulls,
    ragged or dict values) is refused naming the row and the column: torch's own error ("too many
    dimensions 'str'") names neither, and one row's would end a whole run with a traceback."""
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if tensor is None or tensor.dim() == 0:  # a scalar is no list either
        raise InputError(f"{where}: {column} must be {expected}, got {reprlib.repr(value)}")
    if tensor.dim() > 2 or (tensor.dim() == 2 and tensor.shape[0] != 1):  # [1, T] as a tokenizer returns it
        raise InputError(f"{where}: {column} must be {expected}, got an array of shape {list(tensor.shape)} (a "
                         "batch of sequences? a row holds one sample)")
    return tensor.reshape(-1)


# apply_chat_template's own arguments, and `tools`, which the renderers set (a row's tools): a setting
# of one clashes with them, or is silently replaced
_RENDER_ARGUMENTS = frozenset({"conversation", "messages", "add_generation_prompt", "continue_final_message",
                               "chat_template", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
                               "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools"})


def check_template_kwargs(tokenizer, kwargs: Mapping[str, Any] | None) -> None:
    """Refuse a chat-template setting the template never reads: a misspelt `enable_thinkng`
    renders every chat as if it were not given, and the run's states (or eval's prompts) would be
    of text the user did not ask for; and one layertap passes the template itself."""
    if reserved := sorted(set(kwargs or {}) & _RENDER_ARGUMENTS):
        raise ConfigError(f"--chat-template-kwargs sets {', '.join(map(repr, reserved))}, which layertap passes the "
                          "chat template itself (the chat, a row's tools, a generation prompt only where it asks a "
                          "question): leave it out")
    read = template_variables(tokenizer) if kwargs else None
    if read is not None and (unread := sorted(set(kwargs) - read)):
        special = set(getattr(tokenizer, "special_tokens_map", None) or {})  # bos_token, ...: the tokenizer's
        names = ", ".join(sorted(read - special - {"messages", "add_generation_prompt"})) or "none"
        of = repr(getattr(tokenizer, "name_or_path", "")) if getattr(tokenizer, "name_or_path", "") else "the tokenizer"
        raise ConfigError(f"--chat-template-kwargs sets {', '.join(map(repr, unread))}, which the chat template of "
                          f"{of} never reads (the settings it reads: {names}): check the spelling, or leave "
                          f"{'it' if len(unread) == 1 else 'them'} out")


def unread_template_kwargs(tokenizer, kwargs: Mapping[str, Any] | None) -> list[str]:
    """The names in `kwargs` the tokenizer's chat template never reads ([] where it cannot tell)."""
    read = template_variables(tokenizer) if kwargs else None
    return [] if read is None else sorted(set(kwargs or {}) - read)


def template_variables(tokenizer) -> set[str] | None:
    """The names the tokenizer's chat template reads from its context (those jinja2 finds
    undeclared in it); None without a template, or for one transformers cannot compile here (the
    render names its error)."""
    template = getattr(tokenizer, "chat_template", None)
    return set(read) if isinstance(template, str) and (read := _read_names(template)) is not None else None


@functools.lru_cache(maxsize=8)
def _read_names(template: str) -> frozenset[str] | None:
    """`template_variables` of one template's text, parsed once: extraction builds a renderer for each shard."""
    try:
        import jinja2.meta
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return frozenset(jinja2.meta.find_undeclared_variables(
            _compile_jinja_template(template).environment.parse(template)))
    except Exception:  # another transformers, a template it cannot compile
        return None


class _ChatRenderer:
    """Renders chats with the tokenizer's template and finds the assistant spans in the text."""

    def __init__(self, tokenizer, template_kwargs: Mapping[str, Any] | None):
        if not getattr(tokenizer, "is_fast", True):
            raise InputError("chat rows need a fast tokenizer: the loss mask is built from the "
                             "tokenizer's character offsets")
        if not tokenizer.chat_template:
            raise InputError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; give "
                             f"pre-tokenized rows or a tokenizer with a chat template")
        check_template_kwargs(tokenizer, template_kwargs)
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.trailer = self._probe_trailer()
        written = self._probe_end_of_turn()
        self.end_of_turn = written or (tokenizer.eos_token or "")  # a template that writes none: EOS stands in
        # what closes an earlier turn, where it is not what closes the last (GPT-OSS: <|end|>, <|return|>)
        self.end_of_earlier_turn = self._probe_end_of_earlier_turn(written)
        self.writes_tool_calls = self._probe_tool_calls()

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               tools: list[dict] | None = None) -> str:
        kwargs = {**self.kwargs, "tools": tools} if tools is not None else self.kwargs
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)

    def _probe_trailer(self) -> str:
        """The EOS a template writes after a whole chat rather than after a turn, else "".

        Phi-3's ends a chat with ``{% else %}{{ eos_token }}`` where a generation prompt would
        go, so a rendered prefix of a chat is no prefix of the whole: it is set apart here.
        """
        eos = self.tokenizer.eos_token or ""
        try:
            chat = [{"role": "user", "content": "ping"}]
            closed, prompt = self.render(chat), self.render(chat, add_generation_prompt=True)
        except Exception:  # a template that refuses the probe writes no trailer we can see
            return ""
        return eos if eos and closed.endswith(eos) and not prompt.startswith(closed) else ""

    def _probe_end_of_turn(self) -> str:
        """What the template writes right after an assistant's content, minus trailing whitespace
        ("" for nothing, or a template that refuses the probe).

        For ChatML (SmolLM2, Qwen) that is ``<|im_end|>``, for Llama 3 ``<|eot_id|>``; the
        newline ChatML adds after it is not something the model generates, nor is the
        chat's trailer (`_probe_trailer`).
        """
        try:
            text = self.render([{"role": "user", "content": "ping"},
                                {"role": "assistant", "content": _SENTINEL}])
            return text[text.rindex(_SENTINEL) + len(_SENTINEL):].removesuffix(self.trailer).rstrip()
        except Exception:  # a template that refuses the probe
            return ""

    def _probe_end_of_earlier_turn(self, last: str) -> str | None:
        """What the template writes after the content of an assistant turn that a user turn
        follows, where that is not `last` (what it writes after the last turn's), else None.

        GPT-OSS's (harmony) ends the chat's last turn with ``<|return|>`` and every earlier one
        with ``<|end|>``: looking for the last turn's marker from an earlier turn found the chat's
        end, and every multi-turn row was refused as a template mismatch. The marker is the
        special token the template writes right after the content (whitespace aside); a template
        that writes none there has none (an earlier turn then ends with its content).
        """
        try:
            text = self.render([{"role": "user", "content": "ping"}, {"role": "assistant", "content": _SENTINEL},
                                {"role": "user", "content": "pong"}])
            tail = text[text.rindex(_SENTINEL) + len(_SENTINEL):].lstrip()
        except Exception:  # a template that refuses the probe: the last turn's marker it is
            return None
        if not last or tail.startswith(last):
            # nothing written after the last turn (GLM's: the next header ends a turn): the special
            # token after an earlier turn is the next turn's header, not its end
            return None
        specials = sorted({str(t) for t in self.tokenizer.all_special_tokens}
                          | {str(t) for t in self.tokenizer.get_added_vocab()}, key=len, reverse=True)
        return next((t for t in specials if t and tail.startswith(t)), None)

    def _probe_tool_calls(self) -> bool:
        """Whether the template writes an assistant's ``tool_calls``. One that does not (ChatML
        without tools) would leave a tool-calling turn empty, its call untrained and unseen."""
        call = {"id": "call00001", "type": "function",  # 9 characters, as Mistral's requires
                "function": {"name": _SENTINEL, "arguments": "{}"}}
        try:
            text = self.render([{"role": "user", "content": "ping"},
                                {"role": "assistant", "content": "", "tool_calls": [call]}])
        except Exception:  # a template that refuses tool calls does not write them
            return False
        return _SENTINEL in text

    def tokenize(self, row: Mapping[str, Any], sid: str, shape: RowShape,
                 stats: TokenizeStats) -> TokenizedSample | Skipped:
        messages = normalize_chat(_chat_of(row, shape), sid, stats, extracting=True)
        if isinstance(messages, Skipped):
            return messages
        if not self.writes_tool_calls and any(m.get("tool_calls") for m in messages):
            return Skipped(sid, TEMPLATE_ERROR, "the chat template does not write an assistant's tool_calls, "
                                                "so a tool-calling turn would be empty")
        tools = tools_of(row, sid)
        if isinstance(tools, Skipped):
            return tools
        trained = _trained_turns(messages)
        try:
            text = self.render(messages, tools=tools)
            spans = _assistant_spans(self, messages, text, cut=_cut_turns(row), tools=tools)
        except _TemplateMismatch as e:
            return Skipped(sid, TEMPLATE_ERROR, str(e))
        except Exception as e:  # jinja's raise_exception, e.g. "roles must alternate"
            return Skipped(sid, TEMPLATE_ERROR, f"{type(e).__name__}: {e}")
        spans = [span for span, keep in zip(spans, trained) if keep]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
        starts = torch.tensor([s for s, _ in enc["offset_mapping"]], dtype=torch.int64)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        return TokenizedSample(sid, ids, mask)


def _trained_turns(messages: list[dict]) -> list[bool]:
    """Per assistant turn, whether it is trained on: all but those with ``weight`` 0 (or false),
    the ShareGPT datasets' mark for a turn kept as context only (a refusal, a weak answer)."""
    return [bool(m.get("weight", 1)) for m in messages if m["role"] == "assistant"]


def _chat_of(row: Mapping[str, Any], shape: RowShape) -> Any:
    """The row's chat: the column the dataset's shape names, else the other chat column. A file
    that mixes OpenAI and ShareGPT rows has both columns, each null in the other's rows; the
    messages of either form normalize alike (`normalize_chat`)."""
    first, other = ("messages", "conversations") if shape is RowShape.MESSAGES else ("conversations", "messages")
    return row.get(first) if row.get(first) is not None else row.get(other)


def tools_of(row: Mapping[str, Any], sid: str) -> list | None | Skipped:
    """The row's ``tools`` for the template, if any: a list, or that list as a JSON string (which
    keeps each schema exactly: ``datasets`` gives every row's schemas the keys of all of them)."""
    tools = row.get("tools")
    if isinstance(tools, str) and not tools.strip():  # a string column's plain chat rows
        tools = None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            return Skipped(sid, BAD_MESSAGE, f"tools is not JSON: {e}")
    if tools is not None and not isinstance(tools, list):
        return Skipped(sid, BAD_MESSAGE, f"tools is a {type(tools).__name__}, not a list")
    return _without_nulls(tools) or None


def _without_nulls(value: Any) -> Any:
    """``value`` less the null fields, at any depth, that ``datasets`` adds when it unifies the
    structs of different rows (message fields, tool schemas, tool-call arguments)."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class _TemplateMismatch(ValueError):
    pass


def normalize_chat(raw: Any, sid: str, stats: TokenizeStats, require_assistant: bool = True,
                   extracting: bool = False) -> list[dict] | Skipped:
    """ShareGPT or OpenAI messages -> ``[{"role", "content", ...}]`` with canonical roles.

    Assistant turns before the first user turn are dropped and counted: they answer a prompt
    the row does not contain (ShareGPT splits long chats into parts, and 36% of ShareGPT V3
    rows open with a ``gpt`` turn), and strict templates refuse a chat that opens with one.
    ``extracting`` (rows made into training samples) accepts ``tool`` messages and assistant
    messages of ``tool_calls`` alone (content null, rendered as ""), which the template renders,
    and checks each turn's ``weight`` (`_trained_turns`). A row that is regenerated or prompted
    refuses tool messages (a new answer would call other tools than the recorded results answer)
    and has no use for weights.
    """
    if raw is None:
        return Skipped(sid, NO_CHAT, "the row has no 'conversations' or 'messages'")
    if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__iter__"):  # a TypeError stopped the run
        return Skipped(sid, BAD_MESSAGE, f"the chat is a {type(raw).__name__}, not a list of messages")
    if not raw:
        return Skipped(sid, EMPTY, "no messages")
    roles = {**_ROLES, **TOOL_ROLES} if extracting else _ROLES
    messages: list[dict] = []
    seen_user = False
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            return Skipped(sid, BAD_MESSAGE, f"message {i} is a {type(m).__name__}, not a mapping")
        role = m.get("from") if m.get("from") is not None else m.get("role")
        content = m.get("value") if m.get("value") is not None else m.get("content")
        canonical = roles.get(str(role).lower()) if role is not None else None
        if canonical is None:
            return Skipped(sid, BAD_MESSAGE, f"message {i} has unknown role {role!r}; accepted: "
                                             f"{sorted(roles)}")
        if content is None and extracting and canonical == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            return Skipped(sid, BAD_MESSAGE, f"message {i} content is {type(content).__name__}, not text")
        weight = m.get("weight") if extracting else None
        if weight is not None and not (isinstance(weight, bool) or weight in (0, 1)):
            # a trainer's per-turn scaling has no form in a 0/1 loss mask: refused, not rounded
            return Skipped(sid, BAD_MESSAGE, f"message {i} has weight {weight!r}: 0 (not trained on) or 1 only")
        if canonical == "assistant" and not seen_user:
            stats.dropped_turns += 1
            continue
        seen_user = seen_user or canonical == "user"
        # Keep extra fields a template may use (reasoning_content, tool_calls, ...), minus nulls
        # that datasets adds when it unifies message structs.
        extra = {k: _without_nulls(v) for k, v in m.items()
                 if v is not None and k not in ("from", "value", "role", "content")}
        messages.append({**extra, "role": canonical, "content": content})
    stats.prompted += seen_user
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        return Skipped(sid, NO_SUPERVISED_PAIR, "no assistant turn")
    return messages


def _cut_turns(row: Mapping[str, Any]) -> set[int]:
    """The assistant turns (counted from 0) of a regenerated row whose answer was cut at the
    server's max tokens (finish reason "length"): the target had not ended them."""
    reasons = (row.get("regenerated") or {}).get("finish_reasons") or []
    return {k for k, reason in enumerate(reasons) if reason == "length"}


def _assistant_spans(chat: _ChatRenderer, messages: list[dict], text: str, cut: set[int] = frozenset(),
                     tools: list[dict] | None = None) -> list[tuple[int, int]]:
    """Character spans ``[a, b)`` of ``text`` (the whole chat, rendered once) that the model generates.

    A span starts where the template's generation prompt for that turn stops agreeing with
    ``text``: ``render(messages[:i])`` (less the chat's trailer, see `_probe_trailer`) must be a
    prefix of ``text`` (a row where it is not is skipped with ``template_error``, never
    mis-masked), and the span starts after the longest common prefix of ``text`` and
    ``render(messages[:i], add_generation_prompt=True)``. Not the whole generation prompt:
    Qwen3.5/3.6's ends in ``<think>\n`` (thinking on; with it off, an empty think block) and
    DeepSeek-R1's in ``<think>\n``, while the chat renders earlier turns without one, so
    requiring it as a prefix skipped every multi-turn row of those targets (73% of ShareGPT
    under Qwen3.5's template). Nor past the turn's content: there that common prefix runs on
    into content that starts like the prompt's ``<think>``, or into the ``<|im_end|>`` of an
    empty turn. The content is located exactly by `_rendered_field`, or, where it cannot follow
    the template, searched for just after the span's start. Qwen3 renders an earlier assistant
    turn differently once it is no longer the last one, which is why the end is not taken from
    a prefix rendering of ``messages[:i+1]``. The span ends after the first end-of-turn marker
    that follows the turn's content, found with the probe in ``_probe_end_of_turn``. Text a
    template inserts between header and content (Qwen3's empty ``<think></think>`` block on the
    last turns) is inside the span: the model generates it, as it generates the tool calls a
    template writes after the content. A turn in `cut` (cut short at generation, see
    `_cut_turns`) ends with its content, or, cut while still thinking (no content), with its
    reasoning: the end of turn the template writes after it (or a close of its thinking) is not
    what the target would have written next.
    """
    spans = []
    cursor = 0
    turn = -1
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        turn += 1
        before = chat.render(messages[:i], tools=tools).removesuffix(chat.trailer)
        if not text.startswith(before) or len(before) < cursor:
            raise _TemplateMismatch(
                f"the chat template renders turn {i}'s prompt differently from the whole chat, so "
                f"the assistant span cannot be located; use pre-tokenized rows for this template")
        prompt = chat.render(messages[:i], add_generation_prompt=True, tools=tools)
        a = max(len(os.path.commonprefix([prompt, text])), len(before))
        start, after = _rendered_field(chat, messages, i, "content", text, tools)
        if start is not None:
            a = max(len(before), min(a, start))
        if after is None:
            # Look for the content just after the header, leaving room for what a template may put
            # first (a think block, the message's reasoning), but not as far as a later turn.
            body = m["content"].strip()
            room = 256 + sum(len(v) for k, v in m.items() if isinstance(v, str) and k != "content")
            found = text.find(body, a, a + room + len(body)) if body else -1
            after = found + len(body) if found >= 0 else a
        if turn in cut:
            if not m["content"].strip():  # cut while thinking, or before it wrote anything
                thought = m.get("reasoning_content") and _rendered_field(
                    chat, messages, i, "reasoning_content", text, tools)[1]
                after = thought or a
            b = after
        else:
            b = _end_of_turn(chat, text, after)
        spans.append((a, b))
        cursor = b
    return spans


def _end_of_turn(chat: _ChatRenderer, text: str, after: int) -> int:
    """Where a turn whose content ends at `after` ends: past the first end-of-turn marker after it
    (the last turn's, or an earlier turn's where the template has one of its own), else `after`."""
    found = [(e, e + len(m)) for m in (chat.end_of_turn, chat.end_of_earlier_turn) if m
             and (e := text.find(m, after)) >= 0]
    return min(found)[1] if found else after


def _rendered_field(chat: _ChatRenderer, messages: list[dict], i: int, key: str, text: str,
                    tools: list[dict] | None) -> tuple[int | None, int | None]:
    """Where ``messages[i][key]`` starts and ends in ``text``, the whole chat rendered.

    The chat is rendered again with that field replaced by a sentinel: where that agrees with
    ``text`` up to the sentinel, the field starts there; where it agrees after it, the field ends
    that far from the end. This finds the field as the template rendered it (trimmed, or without
    an inline think block), with no search that could stop at the same words elsewhere (in the
    turn's reasoning). Either is None where the template writes what surrounds the field
    differently for the sentinel: a think block it takes out of the content, or the newline
    Qwen3 writes between content and tool call only when there is content.
    """
    probe = chat.render(messages[:i] + [{**messages[i], key: _SENTINEL}] + messages[i + 1:], tools=tools)
    s = probe.find(_SENTINEL)
    if s < 0:
        return None, None
    tail = probe[s + len(_SENTINEL):]
    start = s if text.startswith(probe[:s]) else None
    end = len(text) - len(tail) if text.endswith(tail) else None
    if start is not None and end is not None and end < start:
        end = None
    return start, end
