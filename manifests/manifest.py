"""The run manifest: an immutable plan written once at the run prefix.

It pins everything that determines the run's output (model, layers, codec, max length, dataset
fingerprint, ...) so that a rerun either resumes the very same run or is refused with the list of
differences, and it fixes each shard's sample range so that any worker on any node computes the
same shard from the same samples.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from layertap.manifests import layout
from layertap.manifests.layout import MANIFEST
from layertap.manifests.train_output import LATEST, METRICS
from layertap.storage.codec_names import CODEC_NAMES
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.identity import RunConfig, RunIdentity, header_disagreement
from layertap.storage.store import ObjectNotFound, ObjectStore, StoreError
from layertap.storage.units import listing

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "layertap-manifest"
MANIFEST_VERSION = 1
DEFAULT_SHARD_BYTES = 1_000_000_000
# the `dataset` key of the settings a run's chats were rendered with (--chat-template-kwargs)
TEMPLATE_KWARGS = "chat_template_kwargs"


class ManifestError(UserError):
    """The manifest or a run record is missing, corrupt, or from an incompatible version."""


class UnsupportedVersion(ManifestError):
    """A manifest or record written by a newer layertap: intact, so never withdrawn as corrupt."""


class NoRun(ManifestError):
    """There is no manifest at the prefix."""


class ConfigMismatch(ManifestError):
    """A rerun's configuration differs from the run already on the store."""


def header_mismatch(uri: str, shard: int, key: str, header: RunIdentity,
                    config: Mapping[str, Any]) -> ManifestError | None:
    """The refusal of a committed shard whose HEAD says other states than its run's manifest records
    (`header_disagreement`), worded once for the loader and `verify`: the shard is sound and the
    manifest is not its own, so nothing is skipped or withdrawn. None where they agree."""
    differs = header_disagreement(header, config)
    return None if differs is None else ManifestError(
        f"{uri.rstrip('/')}/{MANIFEST} disagrees with committed shard {shard}'s header ({key}): {differs}; "
        f"the manifest was edited or replaced. Nothing was withdrawn; restore the run's own {MANIFEST}")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    id: int
    start: int  # first sample index (into the dataset's order)
    end: int  # one past the last
    est_tokens: int
    skips: int = 0  # of its rows, those the planner found yield no sample (token count 0)

    @property
    def num_samples(self) -> int:
        """Its rows: what its commit covers, samples stored and skipped together."""
        return self.end - self.start

    @property
    def planned_records(self) -> int:
        """The most samples its commit stores: its rows less `skips`. Exact for an extraction (the
        planner tokenizes as its workers do); an import counts every row. Its commit may hold no
        more (`Claim.commit`, and a follow trainer reading it): a follow trainer sizes its epoch by
        it. A run planned before plans kept skips counts every row."""
        return self.num_samples - self.skips


def plan_shards(token_counts: Sequence[int], bytes_per_token: float, shard_bytes: int) -> list[ShardPlan]:
    """Cut consecutive samples into shards of about `shard_bytes` stored bytes each.

    Sizing by estimated bytes rather than sample count keeps shard objects even when sample
    lengths vary by 100x, which keeps uploads, retries and loader prefetch predictable.
    """
    if bytes_per_token <= 0 or shard_bytes <= 0:
        raise ConfigError("bytes_per_token and shard_bytes must be positive")
    shards: list[ShardPlan] = []
    start, tokens, acc, skips = 0, 0, 0.0, 0
    for i, n in enumerate(token_counts):
        tokens += n
        skips += n == 0  # a row the extraction skips (no answer, ...): it stores no sample
        acc += n * bytes_per_token
        if acc >= shard_bytes:
            shards.append(ShardPlan(len(shards), start, i + 1, tokens, skips))
            start, tokens, acc, skips = i + 1, 0, 0.0, 0
    if start < len(token_counts):
        if tokens == 0 and shards:  # skipped rows alone: a shard of them would store nothing
            last = shards[-1]
            shards[-1] = replace(last, end=len(token_counts), skips=last.skips + skips)
        else:
            shards.append(ShardPlan(len(shards), start, len(token_counts), tokens, skips))
    return shards


@dataclass(kw_only=True)
class Manifest:
    run_id: str
    created_at: str
    config: dict[str, Any]  # what determines the output, as stored (compared on resume); typed: `identity`
    dataset: dict[str, Any]  # at least "fingerprint" and "num_samples"
    shard_bytes: int
    bytes_per_token: float
    shards: list[ShardPlan] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return self.shards[-1].end if self.shards else 0

    @property
    def est_tokens(self) -> int:
        return sum(s.est_tokens for s in self.shards)

    @property
    def planned_records(self) -> int:
        """The samples the run stores once complete: its rows less those the plan knows it skips."""
        return sum(s.planned_records for s in self.shards)

    @property
    def largest_shard_bytes(self) -> int:
        """The planned stored bytes of the run's largest shard: `shard_bytes` where the run fills
        its shards, less for a run smaller than one (a window sized by it is sized by what is stored)."""
        return max(1, round(max((s.est_tokens for s in self.shards), default=0) * self.bytes_per_token))

    @cached_property
    def identity(self) -> RunConfig:
        """`config`, typed: what the run's states are, for readers. ManifestError if it lacks a fact
        (model, layers, codec) or holds a bad one; `UnsupportedVersion` for a codec this layertap
        does not know. `config` stays the stored JSON, so that a rerun is compared key by key."""
        codec = self.config.get("codec")
        if isinstance(codec, str) and codec not in CODEC_NAMES:
            raise UnsupportedVersion(f"run {self.run_id}'s manifest names codec {codec!r}, which this layertap "
                                     f"does not know (it reads {', '.join(CODEC_NAMES)}); upgrade layertap")
        try:
            return RunConfig.from_json(self.config)
        except (TypeError, ValueError) as e:
            raise ManifestError(f"run {self.run_id}'s manifest has an unreadable config ({e}); restore it "
                                "or start a new run under another prefix") from None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "run_id": self.run_id,
            "created_at": self.created_at,
            "config": self.config,
            "dataset": self.dataset,
            "shard_bytes": self.shard_bytes,
            "bytes_per_token": self.bytes_per_token,
            "shards": [[s.start, s.end, s.est_tokens] for s in self.shards],  # compact: 35k shards
            # per shard, beside `shards` (whose 3-item entries older readers unpack): read as 0s where absent
            "planned_skips": [s.skips for s in self.shards],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> Manifest:
        if not isinstance(obj, Mapping) or obj.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{where} is not a layertap manifest")
        version = obj.get("format_version")
        if version != MANIFEST_VERSION:
            raise UnsupportedVersion(f"{where} has manifest version {version}; this layertap reads version "
                                f"{MANIFEST_VERSION}: use a matching layertap release")
        try:
            shards = _shard_plans(obj["shards"], obj.get("planned_skips"))
            return cls(run_id=str(obj["run_id"]), created_at=str(obj["created_at"]), config=dict(obj["config"]),
                       dataset=dict(obj["dataset"]), shard_bytes=int(obj["shard_bytes"]),
                       bytes_per_token=float(obj["bytes_per_token"]), shards=shards)
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where} is corrupt ({type(e).__name__}: {e}); "
                                "restore it or start a new run under another prefix") from None

    def differences(self, config: Mapping[str, Any], dataset_fingerprint: str | None,
                    dataset: Mapping[str, Any] | None = None) -> list[str]:
        """Human-readable differences between this run and a rerun's configuration, and the
        chat-template settings of the rerun's `dataset` (`template_differences`)."""
        diffs = [f"{k}: run has {self.config.get(k)!r}, now {config.get(k)!r}"
                 for k in sorted(set(self.config) | set(config)) if self.config.get(k) != config.get(k)]
        diffs += self.template_differences(dataset or {})
        if (differs := self.fingerprint_difference(dataset_fingerprint)) is not None:
            diffs.append(differs)
        return diffs

    def fingerprint_difference(self, fingerprint: str | None) -> str | None:
        """How a rerun's dataset `fingerprint` differs from the run's (None: it does not, or is unknown)."""
        if fingerprint is None or fingerprint == self.dataset.get("fingerprint"):
            return None
        # the fingerprint covers the rows read, --limit included: say what the run read
        made = f"; the run read {self.dataset['path']}" if self.dataset.get("path") else ""
        if "limit" in self.dataset:
            limit = self.dataset["limit"]
            made += f" with --limit {limit}" if limit is not None else " without --limit"
        return (f"dataset fingerprint: run has {self.dataset.get('fingerprint')!r}, now {fingerprint!r} "
                f"(the rows read differ: another or an edited file, or another --limit{made})")

    def template_differences(self, dataset: Mapping[str, Any]) -> list[str]:
        """The difference between the chat-template settings this run's chats were rendered with and
        those of a rerun's `dataset` (other settings render other text under the same plan), if it
        names them (`TEMPLATE_KWARGS`; a run that renders no chats does not). Compared as canonical
        JSON: to a template's `enable_thinking is false`, 0 is not false."""
        if TEMPLATE_KWARGS not in dataset:
            return []
        made, now = (json.dumps(kwargs or {}, sort_keys=True)
                     for kwargs in (self.dataset.get(TEMPLATE_KWARGS), dataset[TEMPLATE_KWARGS]))
        return [] if made == now else [f"chat template settings (--chat-template-kwargs): run has {made}, now {now}"]


def _shard_plans(entries: Sequence, skips: Sequence | None) -> list[ShardPlan]:
    """The plan from a manifest's `shards` and `planned_skips` (None: a run planned before plans
    kept skips); ValueError where they do not fit each other."""
    if skips is None:
        return [ShardPlan(i, int(a), int(b), int(t)) for i, (a, b, t) in enumerate(entries)]
    if not isinstance(skips, list) or len(skips) != len(entries):
        raise ValueError(f"planned_skips is not a list of one count per shard ({len(entries)})")
    if not all(type(k) is int for k in skips):  # 1.9 or true read as a count of rows: the plan is damaged
        raise ValueError(f"planned_skips holds {next(k for k in skips if type(k) is not int)!r}, not a count of rows")
    shards = [ShardPlan(i, int(a), int(b), int(t), k) for i, ((a, b, t), k) in enumerate(zip(entries, skips))]
    bad = next((p for p in shards if not 0 <= p.skips <= p.num_samples), None)
    if bad is not None:
        raise ValueError(f"shard {bad.id} plans {bad.skips} skipped rows of its {bad.num_samples}")
    return shards


def load_manifest(store: ObjectStore) -> Manifest:
    where = f"{store.uri.rstrip('/')}/{MANIFEST}"
    try:
        raw = store.get(MANIFEST)
    except ObjectNotFound:
        raise NoRun(f"no run at {store.uri}: {MANIFEST} is missing (run `layertap extract` to start one)") from None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where} is corrupt (not JSON: {e}); restore it or start a new run under another prefix") from None
    return Manifest.from_json(obj, where)


# the records of a run's work under its prefix (manifests/layout.py); not the settings in
# consumed/ (window.json, trainer.json), which a new extraction or trainer of the prefix replaces or names
RUN_RECORDS = (layout.COMMITS, layout.SHARDS, layout.TALLY, layout.FEED, layout.LEASES, layout.FAILURES,
               layout.GIVEN_UP, layout.REDO, layout.WAITING, layout.CONSUMED_RANKS, layout.CONSUMED_SHARDS,
               layout.COMMIT_INDEX)


def refuse_leftovers(store: ObjectStore) -> None:
    """Raise `ConfigError` where a prefix without a manifest holds a run's records: what
    `layertap delete` leaves when a worker or trainer of the run still writes while it runs (or a
    run copied without its manifest). A new run planned there took those commits for its own:
    counted done, then refused by training as another run's. Records of a run a concurrent
    creator made meanwhile are not leftovers: its manifest is there by now."""
    folders = set(store.folders())
    left = [p for p in RUN_RECORDS if p.split("/")[0] in folders and next(iter(store.list(p)), None) is not None]
    if left and not store.exists(MANIFEST):
        raise ConfigError(f"{store.uri} holds no run ({MANIFEST} is missing) but a run's records under "
                          f"{', '.join(left)}: left by a process that wrote there while `layertap delete` ran, or by "
                          "a run copied without its manifest. A new run here would take them for its own. Stop what "
                          f"still writes there, then `layertap delete --force {store.uri}`; or write the new run to "
                          "another prefix")


def refuse_nested(store: ObjectStore) -> None:
    """Raise `ConfigError` where the folders right under the prefix hold a run or an output of
    their own: a run planned over them holds them under its prefix, and `layertap delete` of it
    would take them (it refuses, naming them, but the layout stays a trap). A few requests
    (`outputs_under`: a delimiter listing and HEADs of the first folders' markers); deeper
    nesting is `layertap delete`'s to find, from its full listing."""
    from layertap.manifests.cli import deeper_text, outputs_under

    others: list[str] = []
    found = outputs_under(store, others)
    if found:
        root = store.uri.rstrip("/")
        named = listing((f"{root}/{name} ({kind})" for name, kind in found), 5) + deeper_text(others)
        raise ConfigError(f"{store.uri} holds no run but other runs or outputs below it: {named}. A run here would "
                          "hold them under its prefix, and deleting it would delete them: give the run a prefix "
                          f"of its own beside them (a new folder under {root}/)")


def refuse_foreign(store: ObjectStore, most: int = 5) -> None:
    """Raise `ConfigError` where the prefix of a new run holds objects that are not a run's (a
    dataset, a model, files of one's own): the run would be made among them, and `layertap delete`
    of it would take them. Reads the listing only until `most` such objects are found."""
    found = []
    for o in store.list():
        if not layout.is_run_key(o.key):
            found.append(o.key)
            if len(found) == most:
                break
    if found:
        root = store.uri.rstrip("/")
        raise ConfigError(f"{store.uri} is not empty: it holds objects that are not a layertap run ("
                          + ", ".join(f"{root}/{k}" for k in found) + (" ..." if len(found) == most else "")
                          + "). A run made there would be mixed with them, and `layertap delete` of it would delete "
                          "them too: write the run to an empty prefix (a new folder)")


ENCLOSING_LEVELS = 8  # folders above a prefix looked in for a run or output it lies inside


def layertap_kind(store: ObjectStore) -> str | None:
    """What `store`'s prefix is by layertap's marker objects, read, not only found (a folder may
    hold another tool's manifest.json or checkpoints/latest.json): "run", "training output",
    "regeneration output", or None. A GET a marker, of those present."""
    from layertap.manifests.regeneration import FORMAT as REGENERATED, RECIPE

    def read(key: str) -> Any:
        try:
            return json.loads(store.get(key))
        except (ObjectNotFound, ValueError):
            return None

    if isinstance(m := read(MANIFEST), dict) and m.get("format") == MANIFEST_FORMAT:
        return "run"
    if isinstance(c := read(LATEST), dict) and isinstance(c.get("step"), int) \
            and str(c.get("prefix", "")).startswith("checkpoints/"):
        return "training output"
    if isinstance(r := read(RECIPE), dict) and r.get("format") == REGENERATED:
        return "regeneration output"
    return None


def enclosing(store: ObjectStore, levels: int = ENCLOSING_LEVELS) -> tuple[str, str] | None:
    """(prefix, kind) of the nearest run or output above `store`'s prefix, up to its bucket's or
    file system's root or `levels` folders up; None where there is none, and where a folder above
    cannot be read (a bucket shared by prefix: credentials that reach only below it)."""
    up = store.parent()
    for _ in range(levels):
        if up is None:
            return None
        try:
            kind = layertap_kind(up)
        except StoreError:  # access denied there, or the store failing: can't tell
            return None
        if kind is not None:
            return up.uri, kind
        up = up.parent()
    return None


def refuse_inside_another(store: ObjectStore) -> None:
    """Raise `ConfigError` where a prefix above `store`'s is a run or an output (`enclosing`), or
    where its prefix is an object's key: a run in a folder of another run is under that one's
    prefix (whose `delete` then refuses, and whose folder holds another's records), and `--out
    s3://b/run1/manifest.json` made a key both an object and a folder."""
    name, up = store.uri.rstrip("/").rpartition("/")[2], store.parent()
    try:
        is_object = up is not None and bool(name) and up.exists(name)
    except StoreError:  # a folder above these credentials may not read
        is_object = False
    if is_object:
        raise ConfigError(f"{store.uri} is an object, not a prefix: give the run a prefix (a folder) of its own")
    if (found := enclosing(store)) is not None:
        raise ConfigError(f"{found[0]} is a {found[1]}: a run at {store.uri} would be inside it (deleting the one "
                          "would mean deleting the other): give the run a prefix of its own beside it, not under it")


def refuse_new_run_here(store: ObjectStore) -> None:
    """Raise `ConfigError` where a new run may not be planned at `store`'s prefix: inside another
    run or output, or holding a training output, a deleted run's leftovers, runs or outputs below
    it, or objects of others. A few requests; run by the planner, by the extractor before it loads
    the model, and by `submit extract` before it queues an array whose every task would refuse the
    prefix."""
    refuse_inside_another(store)
    if any(store.exists(key) for key in (LATEST, METRICS)):
        raise ConfigError(f"{store.uri} holds a training output (`layertap train --out`), not a run: `layertap "
                          "delete` of the one would delete the other; give the run a prefix of its own")
    refuse_leftovers(store)
    refuse_nested(store)
    refuse_foreign(store)


def create_or_resume(store: ObjectStore, *, config: RunConfig | Mapping[str, Any], dataset: Mapping[str, Any],
                     token_counts: Sequence[int] | None, bytes_per_token: float,
                     shard_bytes: int = DEFAULT_SHARD_BYTES, existing: Manifest | None = None) -> tuple[Manifest, bool]:
    """The run's manifest and whether this call created it.

    An existing run is resumed only if its configuration and dataset match; otherwise
    `ConfigMismatch` names every difference. Concurrent creators race on create-if-absent and all
    but one adopt the winner's plan. A prefix whose manifest is gone but not the run's records
    (`RUN_RECORDS`) is refused, and so is one that holds another run or output below it
    (`refuse_nested`). `existing`: the run's manifest, already read by the caller: not read again
    (at 150,000 shards it is megabytes, and every one of 1,000 workers starting reads it).
    """
    if isinstance(config, RunConfig):
        config = config.to_json()
    fingerprint = dataset.get("fingerprint")
    if existing is None:
        try:
            existing = load_manifest(store)
        except NoRun:
            pass
    if existing is None:
        if token_counts is None:
            raise NoRun(f"no run at {store.uri} yet, and no token counts were given to plan one")
        refuse_new_run_here(store)
        manifest = Manifest(
            run_id=uuid.uuid4().hex[:12],
            created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            config=dict(config),
            dataset=dict({k: v for k, v in dataset.items() if k != TEMPLATE_KWARGS or v},  # none: not written
                         num_samples=len(token_counts), num_tokens=int(sum(token_counts))),
            shard_bytes=shard_bytes,
            bytes_per_token=bytes_per_token,
            shards=plan_shards(token_counts, bytes_per_token, shard_bytes),
        )
        # compact: every worker of the run GETs it at its start (indented, it was 36 bytes more per shard)
        if store.put_if_absent(MANIFEST, json.dumps(manifest.to_json(), separators=(",", ":")).encode()):
            return manifest, True
        existing = load_manifest(store)
    made, now = existing.dataset.get("format"), (dataset or {}).get("format")  # an import's source format
    if made != now:  # an extraction and an import, or imports of two formats: their settings' diff said "resume it"
        raise ConfigMismatch(f"the run at {store.uri} was "
                             + (f"imported from {made} files" if made else "extracted (`layertap extract`)")
                             + "; this is " + (f"an import of {now} files" if now else "an extraction")
                             + ", which cannot resume it: write the new run to another prefix")
    diffs = existing.differences(config, fingerprint, dataset)
    if diffs:
        raise ConfigMismatch(
            f"the run at {store.uri} was made with a different configuration:\n  " + "\n  ".join(diffs)
            + "\nuse the run's settings to resume it, or write the new run to another prefix"
        )
    # The plan is fixed at creation: say so rather than ignore a --shard-bytes given. Not the default's
    # (every rerun without the flag was told of a 1 GB it never asked for); an explicit 1GB is not told.
    if shard_bytes != existing.shard_bytes and shard_bytes != DEFAULT_SHARD_BYTES:
        log.warning("the run at %s keeps its plan of %d shards cut at %s bytes; a shard size of %s bytes "
                    "applies only to a new run", store.uri, len(existing.shards), f"{existing.shard_bytes:,}",
                    f"{shard_bytes:,}")
    return existing, False
