"""A finished regeneration (`layertap regenerate`'s output, manifests/regeneration.py has its
layout) read back as extraction input: `layertap extract --dataset PREFIX` takes a local folder or
an S3 prefix (`is_regenerated`, `load_regenerated`), in source-row order. `s3`, where a function
takes it: the "s3" settings of the command's --config, for an S3 prefix."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from layertap.manifests.manifest import TEMPLATE_KWARGS
from layertap.manifests.regeneration import RECIPE, Recipe, done_parts, read_recipe
from layertap.storage.errors import ConfigError, InputError, MissingInput
from layertap.storage.store import ObjectStore, open_configured_store

if TYPE_CHECKING:
    from layertap.extract.config import ExtractConfig
    from layertap.manifests.manifest import Manifest


def is_regenerated(path: str) -> bool:
    """Whether `path` (a local folder or s3:// prefix) holds a regenerated dataset."""
    if path.startswith("s3://"):  # a prefix, not data files (`dataset_download`): load_regenerated says if not
        from layertap.extract.dataset_download import is_s3_data

        return not is_s3_data(path)
    import os

    return os.path.isfile(os.path.join(path, RECIPE))


def _complete(path: str, s3: Mapping[str, Any] | None) -> tuple[ObjectStore, Recipe, list[Any]]:
    """The store, recipe and committed parts of a finished regeneration at `path`, else a clear error."""
    store = open_configured_store(path, s3)
    recipe = read_recipe(store)
    if recipe is None:
        raise MissingInput(f"dataset {path!r}: no {RECIPE} there; an S3 dataset is the output of "
                           f"`layertap regenerate`, or .jsonl/.json/.parquet objects (s3://bucket/data/*.parquet)")
    parts = done_parts(store)
    missing = [p for p in range(recipe.parts) if p not in parts]
    if missing:
        raise InputError(f"dataset {path!r} is an unfinished regeneration: {recipe.parts - len(missing)} of "
                         f"{recipe.parts} parts done (first missing: part {missing[0]}); rerun the same "
                         f"`layertap regenerate` command to finish it, then extract")
    return store, recipe, [parts[p] for p in range(recipe.parts)]


def template_kwargs(path: str | None, given: dict[str, Any] | None = None,
                    s3: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The chat-template settings extraction renders chats with (None: none): `given`
    (--chat-template-kwargs; {} for none), else a finished regeneration's, whose prompts the server
    rendered so (its recipe's --chat-template-kwargs, part of the dataset's fingerprint): extraction
    must render the text the target answered, so `given` may not differ from them (as JSON: to a
    template's `enable_thinking is false`, 0 is not false)."""
    recorded = None
    if path and is_regenerated(path):
        _, recipe, _ = _complete(path, s3)
        recorded = recipe.sampling.get("chat_template_kwargs") or None
        if given is not None and json.dumps(given, sort_keys=True) != json.dumps(recorded or {}, sort_keys=True):
            raise ConfigError(f"--chat-template-kwargs {json.dumps(given)}: the regenerated dataset {path!r} had its "
                              f"prompts rendered with {json.dumps(recorded or {})} (its `layertap regenerate "
                              f"--chat-template-kwargs`), and extraction must render the text the target answered: "
                              f"leave --chat-template-kwargs out to use the dataset's")
    return recorded if given is None else (given or None)


def pinned_template(cfg: ExtractConfig, run: Manifest | None) -> dict[str, Any]:
    """The manifest `dataset` entry of the chat-template settings the run renders its chats with
    (resolved by `dataset_rows`): recorded by a new run (its drafter's eval renders prompts alike),
    compared on a resume. Not for a run from a regenerated dataset that recorded none: its
    fingerprint pins the recipe's settings, and runs made before layertap recorded them rendered
    its chats with these already."""
    if run is not None and TEMPLATE_KWARGS not in run.dataset and cfg.dataset and is_regenerated(cfg.dataset):
        return {}
    return {TEMPLATE_KWARGS: cfg.chat_template_kwargs}


def regenerated_fingerprint(path: str, limit: int | None = None, s3: Mapping[str, Any] | None = None) -> str:
    """A hex id of a finished regeneration's rows: its recipe and every part's size and version."""
    _, recipe, parts = _complete(path, s3)
    return _fingerprint(recipe, parts, limit)


def _fingerprint(recipe: Recipe, parts: list[Any], limit: int | None) -> str:
    listing = "|".join(f"{o.key}:{o.size}:{o.version}" for o in parts)
    content = json.dumps(recipe.to_json(), sort_keys=True) + listing
    return xxhash.xxh3_128(f"v2|regenerated|{content}|limit={limit}".encode()).hexdigest()  # v2: tools


def iter_rows(path: str, keys: list[str] | None = None,
              s3: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every regenerated row of a finished regeneration, in source-row order (of the parts `keys`,
    when the caller has listed them)."""
    if keys is None:
        store, _, parts = _complete(path, s3)
        keys = [o.key for o in parts]
    else:
        store = open_configured_store(path, s3)
    for key in keys:
        # "\n" only: str.splitlines() also splits at U+2028, U+0085 ..., which real chats hold and
        # json.dumps(ensure_ascii=False) leaves unescaped inside strings.
        for line in store.get(key).decode().split("\n"):
            if line:
                yield json.loads(line)


def load_regenerated(path: str, limit: int | None = None, s3: Mapping[str, Any] | None = None):
    """A finished regeneration as a ``datasets.Dataset`` of OpenAI-style chats (``messages``), and
    its `regenerated_fingerprint`: exactly the parts that were checked complete and fingerprinted
    (one listing, one recipe read). `limit` is checked by the caller, `inputs.load_rows`."""
    import datasets

    _, recipe, parts = _complete(path, s3)
    gen_kwargs = {"path": path, "keys": [o.key for o in parts], "fingerprint": _fingerprint(recipe, parts, None),
                  "s3": dict(s3 or {})}
    ds = datasets.Dataset.from_generator(_rows, features=_features(), gen_kwargs=gen_kwargs)
    if len(ds) == 0:
        raise InputError(f"dataset {path!r} has no rows: every row of the regeneration was refused "
                         f"(see its stats/ for the reasons)")
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    return ds, _fingerprint(recipe, parts, limit)


def _rows(path: str, keys: list[str], fingerprint: str, s3: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`datasets`' generator; `fingerprint` keys its cache to this exact output."""
    for row in iter_rows(path, keys, s3):
        yield {"id": row["id"], "messages": [{k: m.get(k) for k in MESSAGE_KEYS} for m in row["messages"]],
               "tools": row.get("tools") or "", "regenerated": row["regenerated"]}


MESSAGE_KEYS = ("role", "content", "reasoning_content")


def _features():
    import datasets

    text = datasets.Value("string")
    return datasets.Features({
        "id": text,
        "messages": [{k: text for k in MESSAGE_KEYS}],
        "tools": text,  # the row's tool definitions as JSON ("" for none), as `inputs.tools_of` reads them
        "regenerated": {"row": datasets.Value("int64"), "completion_tokens": datasets.Value("int64"),
                        "finish_reasons": [text]},
    })
