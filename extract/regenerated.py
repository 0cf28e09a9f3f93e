"""The layout of a regenerated dataset on a store, and reading it back as extraction input.

`layertap regenerate` writes, under its output prefix (a local folder or an S3 prefix):

- `regenerate.json`: the recipe (input dataset and its fingerprint, served model, sampling
  settings, rows per part), written once; a rerun with another recipe is refused;
- `parts/{p:06d}.jsonl`: the regenerated rows of source rows ``[p*K, (p+1)*K)``, in row order,
  one OpenAI-style chat per line (``id``, ``messages``, ``regenerated``). A part is written once
  all of its rows are answered or refused: it is the record that those rows are done, so a
  rerun redoes only missing parts and no row is ever written twice;
- `stats/{p:06d}.json`: the part's counts (tokens, truncated answers) and its refused rows with
  their reasons, written just before the part.

`layertap extract --dataset PREFIX` reads a complete output directly (`is_regenerated`,
`load_regenerated`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import xxhash

from layertap.storage.errors import ConfigError, InputError, MissingInput
from layertap.storage.store import ObjectStore, open_store

FORMAT = "layertap-regenerated/1"
RECIPE = "regenerate.json"
PARTS = "parts/"
STATS = "stats/"


def part_key(part: int) -> str:
    return f"{PARTS}{part:06d}.jsonl"


def stats_key(part: int) -> str:
    return f"{STATS}{part:06d}.json"


def part_of_key(key: str) -> int:
    """`parts/000012.jsonl` -> 12."""
    return int(key.rsplit("/", 1)[-1].split(".", 1)[0])


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What a regenerated dataset was made from and how: a rerun must match it to continue."""

    dataset: dict[str, Any]  # path, fingerprint, rows (after --limit), limit
    model: str  # the served model name the requests named
    sampling: dict[str, Any]  # temperature, top_p, max_tokens, seed, chat_template_kwargs
    rows_per_part: int
    parts: int
    endpoint: str = ""  # where it was first made (no credentials), for the record only

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "dataset": self.dataset, "model": self.model, "sampling": self.sampling,
                "rows_per_part": self.rows_per_part, "parts": self.parts, "endpoint": self.endpoint}

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> Recipe:
        if raw.get("format") != FORMAT:
            raise InputError(f"{where}: not a layertap regenerated dataset (format {raw.get('format')!r}, "
                             f"expected {FORMAT!r})")
        return cls(dataset=raw["dataset"], model=raw["model"], sampling=raw["sampling"],
                   rows_per_part=int(raw["rows_per_part"]), parts=int(raw["parts"]),
                   endpoint=raw.get("endpoint", ""))

    def differences(self, other: Recipe) -> list[str]:
        """What `other` (this command line's recipe) changes: each difference named, run's value first."""
        diffs = []
        for name in ("model", "rows_per_part"):
            if getattr(self, name) != getattr(other, name):
                diffs.append(f"{name}: output has {getattr(self, name)!r}, now {getattr(other, name)!r}")
        for name in ("fingerprint", "rows", "limit"):
            if self.dataset.get(name) != other.dataset.get(name):
                diffs.append(f"dataset {name}: output has {self.dataset.get(name)!r}, now {other.dataset.get(name)!r}")
        for name in sorted(set(self.sampling) | set(other.sampling)):
            if self.sampling.get(name) != other.sampling.get(name):
                diffs.append(f"{name}: output has {self.sampling.get(name)!r}, now {other.sampling.get(name)!r}")
        return diffs


def read_recipe(store: ObjectStore) -> Recipe | None:
    """The recipe at the store's root, or None where nothing was regenerated yet."""
    if not store.exists(RECIPE):
        return None
    try:
        raw = json.loads(store.get(RECIPE))
    except json.JSONDecodeError as e:
        raise InputError(f"{store.uri}/{RECIPE} is not valid JSON: {e}") from None
    return Recipe.from_json(raw, f"{store.uri}/{RECIPE}")


def done_parts(store: ObjectStore) -> dict[int, Any]:
    """The committed parts: part number -> its listing entry (size, version)."""
    return {part_of_key(o.key): o for o in store.list(PARTS) if o.key.endswith(".jsonl")}


def read_stats(store: ObjectStore, parts: list[int]) -> list[dict[str, Any]]:
    return [json.loads(store.get(stats_key(p))) for p in parts if store.exists(stats_key(p))]


def is_regenerated(path: str) -> bool:
    """Whether `path` (a local folder or s3:// prefix) holds a regenerated dataset."""
    if path.startswith("s3://"):
        return True  # extraction reads datasets from S3 only in this form; load_regenerated says if not
    import os

    return os.path.isfile(os.path.join(path, RECIPE))


def _complete(path: str) -> tuple[ObjectStore, Recipe, list[Any]]:
    """The store, recipe and committed parts of a finished regeneration at `path`, else a clear error."""
    store = open_store(path)
    recipe = read_recipe(store)
    if recipe is None:
        raise MissingInput(f"dataset {path!r}: no {RECIPE} there; an S3 dataset must be the output of "
                           f"`layertap regenerate` (local datasets: a .jsonl/.json/.parquet file or a saved folder)")
    parts = done_parts(store)
    missing = [p for p in range(recipe.parts) if p not in parts]
    if missing:
        raise InputError(f"dataset {path!r} is an unfinished regeneration: {recipe.parts - len(missing)} of "
                         f"{recipe.parts} parts done (first missing: part {missing[0]}); rerun the same "
                         f"`layertap regenerate` command to finish it, then extract")
    return store, recipe, [parts[p] for p in range(recipe.parts)]


def regenerated_fingerprint(path: str, limit: int | None = None) -> str:
    """A hex id of a finished regeneration's rows: its recipe and every part's size and version."""
    store, recipe, parts = _complete(path)
    listing = "|".join(f"{o.key}:{o.size}:{o.version}" for o in parts)
    content = json.dumps(recipe.to_json(), sort_keys=True) + listing
    return xxhash.xxh3_128(f"v1|regenerated|{content}|limit={limit}".encode()).hexdigest()


def iter_rows(path: str) -> Iterator[dict[str, Any]]:
    """Every regenerated row of a finished regeneration, in source-row order."""
    store, _, parts = _complete(path)
    for o in parts:
        for line in store.get(o.key).decode().splitlines():
            if line:
                yield json.loads(line)


def load_regenerated(path: str, limit: int | None = None):
    """A finished regeneration as a ``datasets.Dataset`` of OpenAI-style chats (``messages``)."""
    import datasets

    if limit is not None and limit <= 0:
        raise ConfigError(f"limit must be a positive number of rows, got {limit}")
    fingerprint = regenerated_fingerprint(path)
    ds = datasets.Dataset.from_generator(_rows, features=_features(), gen_kwargs={"path": path, "fingerprint": fingerprint})
    if len(ds) == 0:
        raise InputError(f"dataset {path!r} has no rows: every row of the regeneration was refused "
                         f"(see its stats/ for the reasons)")
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    return ds


def _rows(path: str, fingerprint: str) -> Iterator[dict[str, Any]]:
    """`datasets`' generator; `fingerprint` keys its cache to this exact output."""
    for row in iter_rows(path):
        yield {"id": row["id"], "messages": [{k: m.get(k) for k in MESSAGE_KEYS} for m in row["messages"]],
               "regenerated": row["regenerated"]}


MESSAGE_KEYS = ("role", "content", "reasoning_content")


def _features():
    import datasets

    text = datasets.Value("string")
    return datasets.Features({
        "id": text,
        "messages": [{k: text for k in MESSAGE_KEYS}],
        "regenerated": {"row": datasets.Value("int64"), "completion_tokens": datasets.Value("int64"),
                        "finish_reasons": [text]},
    })
