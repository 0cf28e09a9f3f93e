"""A regenerated dataset's records on the store (`layertap regenerate` writes them): the recipe,
the parts and their stats, and what `layertap status` says of them. Read-only here; the writer is
extract/regenerate.py and the reader that turns a finished output into extraction input is
extract/regenerated.py.

Under the output prefix:

- `regenerate.json`: the recipe (input dataset and its fingerprint, served model, sampling
  settings, rows per part), written once; a rerun with another recipe is refused;
- `parts/{p:06d}.jsonl`: the regenerated rows of source rows ``[p*K, (p+1)*K)``, in row order,
  one OpenAI-style chat per line (``id``, ``messages``, ``regenerated``). A part is written once
  all of its rows are answered or refused: it is the record that those rows are done, so a
  rerun redoes only missing parts and no row is ever written twice;
- `stats/{p:06d}.json`: the part's counts (tokens, truncated answers) and its refused rows with
  their reasons, written before the part and again after it by the process that wrote it (a
  crash in between leaves stats the rerun writes again); a process that finds the part kept by
  another, or loses the race to write it, writes them from the kept part;
- `tasks/{I:05d}-of-{N:05d}/lease/`: the lease of the `--task I/N` process at work
  (`output_lease`, `task_role`): a second process of the same task waits for it to go stale or is
  refused, one of another split is refused while any task runs (their parts overlap), and
  `submit regenerate` leaves running tasks out, so parts are not answered twice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layertap.manifests.liveness import gone_from_here
from layertap.manifests.output_lease import PREFIX, Held, Role, held_by, holder_text, latest_in
from layertap.storage.errors import InputError
from layertap.storage.store import ObjectInfo, ObjectNotFound, ObjectStore

FORMAT = "layertap-regenerated/1"
RECIPE = "regenerate.json"
PARTS = "parts/"
STATS = "stats/"
TASKS = "tasks/"
_TASK = re.compile(r"^tasks/(\d+)-of-(\d+)/")


def part_key(part: int) -> str:
    return f"{PARTS}{part:06d}.jsonl"


def stats_key(part: int) -> str:
    return f"{STATS}{part:06d}.json"


def task_role(index: int, count: int) -> Role:
    """The lease of the `layertap regenerate --task index/count` process at work on an output."""
    return Role(name=f"regenerate task {index}/{count}", command=f"`layertap regenerate --task {index}/{count}`",
                clash="its parts would be answered twice. Stop that one first, or wait for it to end",
                prefix=f"{TASKS}{index:05d}-of-{count:05d}/{PREFIX}")


def live_tasks(store: ObjectStore, which: Callable[[tuple[int, int]], bool] = lambda task: True,
               ) -> dict[tuple[int, int], Held]:
    """The `--task I/N` processes (among those `which` takes) at work on the output now, by (I,
    N): one listing of `tasks/` (a few keys a task), then a GET of each live lease (1,000 tasks
    starting together listed each task's leases: a million listings). A holder gone from this
    machine (killed here) is not at work."""
    listed: dict[tuple[int, int], list[ObjectInfo]] = {}
    for o in store.list(TASKS):
        if (m := _TASK.match(o.key)) and which(task := (int(m[1]), int(m[2]))):
            listed.setdefault(task, []).append(o)
    found = {t: held_by(store, latest_in(entries)) for t, entries in sorted(listed.items())}
    return {t: held for t, held in found.items() if held is not None and not gone_from_here(held.holder)}


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
    endpoint: str = ""  # where it was first made (no credentials), for the record only

    @property
    def parts(self) -> int:
        return -(-self.dataset["rows"] // self.rows_per_part)

    def rows_of(self, part: int) -> range:
        """The source rows part `part` holds."""
        start = part * self.rows_per_part
        return range(start, min(self.dataset["rows"], start + self.rows_per_part))

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "dataset": self.dataset, "model": self.model, "sampling": self.sampling,
                "rows_per_part": self.rows_per_part, "parts": self.parts, "endpoint": self.endpoint}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Recipe:
        """The recipe in `raw`, read from `where`; a file cut or edited by hand is an InputError naming
        what is wrong, not a KeyError from `layertap status`."""
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise InputError(f"{where}: not a layertap regenerated dataset (format {found!r}, expected {FORMAT!r})")
        missing = [k for k in ("dataset", "model", "sampling", "rows_per_part") if k not in raw]
        if missing:
            raise InputError(f"{where} lacks {', '.join(missing)}: it was cut or edited. Delete it and rerun the "
                             f"exact `layertap regenerate` command that made the output: it records the recipe "
                             f"again and keeps the parts done")
        dataset, rows_per_part = raw["dataset"], raw["rows_per_part"]
        bad = [f"{name} {value!r}" for name, value, good in (
            ("dataset", dataset, isinstance(dataset, dict) and type(dataset.get("rows")) is int
             and dataset["rows"] >= 0),
            ("rows_per_part", rows_per_part, type(rows_per_part) is int and rows_per_part >= 1),
            ("model", raw["model"], isinstance(raw["model"], str)),
            ("sampling", raw["sampling"], isinstance(raw["sampling"], dict))) if not good]
        if bad:
            raise InputError(f"{where} holds {', '.join(bad)}: it was cut or edited (dataset is an object with a "
                             "count of rows, rows_per_part a whole number >= 1). Delete it and rerun the exact "
                             "`layertap regenerate` command that made the output: it records the recipe again and "
                             "keeps the parts done")
        return cls(dataset=dataset, model=raw["model"], sampling=raw["sampling"],
                   rows_per_part=rows_per_part, endpoint=raw.get("endpoint", ""))

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
    parts = {}
    for o in store.list(PARTS):
        name = o.key.rsplit("/", 1)[-1]
        if name.endswith(".jsonl"):
            if not name.removesuffix(".jsonl").isdigit():  # no part of ours: a part's number is its name
                raise InputError(f"{store.uri}: {o.key} is not a part layertap wrote (parts are named 000012.jsonl): "
                                 "move it out of the regeneration's folder")
            parts[part_of_key(o.key)] = o
    return parts


def read_stats(store: ObjectStore, parts: list[int]) -> list[dict[str, Any]]:
    """The stats of those of `parts` that have them (every committed part, unless deleted since), in
    part order: one GET each, not a HEAD and a GET, 16 in flight (3,500 parts of a 900K-row run)."""
    from concurrent.futures import ThreadPoolExecutor

    def read(p: int) -> dict[str, Any] | None:
        try:
            return json.loads(store.get(stats_key(p)))
        except ObjectNotFound:
            return None

    with ThreadPoolExecutor(max_workers=16) as pool:
        return [st for st in pool.map(read, parts) if st is not None]


def regeneration_status(store: ObjectStore) -> dict[str, Any] | None:
    """A JSON-ready summary of the regeneration at `store`, or None when there is none."""
    recipe = read_recipe(store)
    if recipe is None:
        return None
    done = {p: o for p, o in done_parts(store).items() if p < recipe.parts}  # a stray past the end is no part
    stats = read_stats(store, sorted(done))
    refused: dict[str, int] = {}
    for s in stats:
        for r in s["refused"]:
            refused[r.get("kind", "other")] = refused.get(r.get("kind", "other"), 0) + 1
    rows_done = sum(len(recipe.rows_of(p)) for p in done)
    return {
        "kind": "regeneration", "prefix": store.uri, "model": recipe.model, "sampling": recipe.sampling,
        "dataset": recipe.dataset, "parts_total": recipe.parts, "parts_done": len(done),
        "rows_total": recipe.dataset.get("rows"), "rows_done": rows_done,
        "rows_regenerated": sum(s["regenerated"] for s in stats), "rows_refused": refused,
        "completion_tokens": sum(s["completion_tokens"] for s in stats),
        "truncated_turns": sum(s["truncated_turns"] for s in stats),
        "complete": len(done) == recipe.parts,  # every part below recipe.parts
        # the `--task I/N` processes at work on it now: a rerun beside them is refused, so status names them
        "tasks_running": [] if len(done) == recipe.parts else
        [{"task": f"{i}/{n}", "holder": holder_text(h.holder)} for (i, n), h in live_tasks(store).items()],
    }
