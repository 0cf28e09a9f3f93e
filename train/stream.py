"""`ShardStream`: the committed shards of a run, streamed from the store into training samples.

    stream = ShardStream("s3://acts/qwen27b/run1", config=StreamConfig(seed=0, shuffle_buffer=64))
    for sample in stream: ...          # dicts of tensors; or batches through `StreamLoader`

Reading the run costs one listing of `commits/` and one GET of the commit index (a GET per
commit it lacks: `manifests.commit_index`; `refresh_index()` then stores the fuller index, on
one rank); only shards a commit names are read, and each is checked against its commit (run,
shard id, sample ids, and for whole-object reads the object hash). The order of an epoch is
computed from indices alone (`train.order`), records arrive through `train.fetch` (ranged GETs
into RAM under a byte budget, every record's hashes checked) and are decoded a few samples ahead
of the consumer.

Resume: the stream's `position` (`train.position`) is the number of samples each consumer has
yielded. `state_dict()` is exact when the stream is iterated in this process (directly or by a
DataLoader with num_workers=0); with DataLoader workers use `StreamLoader`, which counts what
each worker has delivered to the trainer. On `load_state_dict`, every consumer recomputes its
order and skips what was consumed without fetching it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from bisect import bisect_right
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np
import torch
import xxhash
from torch.utils.data import IterableDataset, get_worker_info

from layertap.manifests import layout
from layertap.manifests.commit_index import read_commits, write_index
from layertap.manifests.consumption import consumed_shards
from layertap.manifests.manifest import Manifest, load_manifest
from layertap.manifests.records import CommitRecord, FeedCommit
from layertap.manifests.state import fits_plan, replaced_manifest_error
from layertap.storage.errors import ConfigError, InputError
from layertap.storage.format import ShardError
from layertap.storage.reader import check_sample
from layertap.storage.records import Sample, decode_record
from layertap.storage.store import ObjectStore, open_configured_store
from layertap.storage.units import id_ranges, id_runs, listing, parse_size, size
from layertap.train.buffers import BufferPool
from layertap.train.fetch import CommittedShard, Fetcher, Metrics, Record, ids_digest
from layertap.train.follow import CommitWatcher, wait_for_manifest
from layertap.train.order import StreamingShuffle, buffer_shuffle, follow_share, plan_consumer, rank_count
from layertap.train.position import Position

log = logging.getLogger(__name__)

STATE_FORMAT = "layertap-stream-state"
STATE_VERSION = 1
FOLLOW_MARGIN_SHARDS = 2  # follow mode looks ahead promptly once its unfed shards are down to prefetch_shards + this
MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamConfig:
    """What determines the order (seed, shuffle, shuffle_buffer, uneven) and how data is fetched."""

    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 64  # samples; a DFlash sample at 4K tokens is ~100 MB raw
    uneven: Literal["pad", "drop"] = "pad"
    memory_budget: int | str = 4 * GiB  # per rank, split evenly between DataLoader workers; "4GiB" works too
    range_bytes: int | str = 64 * MiB
    prefetch_shards: int = 2  # shards whose footers are read ahead of their records
    fetch_threads: int = 8  # ranged GETs in flight: S3 serves one connection at ~85-90 MB/s (docs/LOADER.md)
    decode_threads: int | None = None  # 0: on the consumer's thread; None: by codec and cores (auto_decode_threads)
    on_corrupt: Literal["raise", "skip"] = "raise"
    follow: bool = False  # epoch 0 follows a run being extracted (docs/LOADER.md, "Follow mode")
    follow_poll_s: float = 30.0  # longest wait between looks for new commits (backoff from 0.5 s)
    # this stream's trainer deletes what it consumes (`layertap train --delete-consumed`): a full
    # --window is its own to open, where another trainer's is that trainer's to open
    deletes_consumed: bool = False

    def __post_init__(self) -> None:
        for name in ("memory_budget", "range_bytes"):  # sizes as text ("4GiB") become bytes
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.shuffle_buffer < 1:
            raise ConfigError(f"shuffle_buffer must be >= 1 sample, got {self.shuffle_buffer}")
        if self.uneven not in ("pad", "drop"):
            raise ConfigError(f"uneven must be 'pad' (repeat a few, zero-weighted) or 'drop', not {self.uneven!r}")
        if self.on_corrupt not in ("raise", "skip"):
            raise ConfigError(f"on_corrupt must be 'raise' or 'skip', not {self.on_corrupt!r}")
        for name in ("memory_budget", "range_bytes", "prefetch_shards", "fetch_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.follow_poll_s < float("inf"):  # NaN too: it compares false with everything
            raise ConfigError(f"follow_poll_s must be > 0 seconds, got {self.follow_poll_s}")
        if self.follow and self.uneven != "pad":
            raise ConfigError("follow mode pads every consumer to the same count: it needs uneven='pad'")
        if self.decode_threads is not None and self.decode_threads < 0:
            raise ConfigError(f"decode_threads must be >= 0 (or None: by codec and cores), got {self.decode_threads}")


SHARD_SET = ("shards", "num_shards", "num_samples", "settled", "order")  # the identity keys naming its shard set


class ShardsChanged(InputError):
    """A state saved mid-epoch over another set of committed shards (`ShardStream.load_state_dict`).
    `saved`: that set, in words."""

    def __init__(self, message: str, saved: str):
        super().__init__(message)
        self.saved = saved


def _shard_set(identity: dict[str, Any]) -> str:
    return f"{identity.get('num_shards')} shards, {identity.get('num_samples')} samples"


def _in_ranges(shard: int, runs: Sequence[Sequence[int]]) -> bool:
    i = bisect_right(runs, [shard, math.inf]) - 1
    return i >= 0 and runs[i][0] <= shard <= runs[i][1]


ORDER_BY_DIGESTS = "v2:"  # begins an order digest made of each shard's ids digest (`_order_digest`)


def _order_digest(shards: Sequence[CommittedShard]) -> str:
    """What an epoch's order depends on: the shards' ids and their samples, not their bytes (a
    shard redone after `verify` withdrew it holds the same samples in another object)."""
    text = "\n".join(f"{s.shard}:{s.records}:{s.ids}" for s in shards)
    return ORDER_BY_DIGESTS + xxhash.xxh3_64_hexdigest(text.encode())


def _order_by_ids(shards: Sequence[CommittedShard], commits: Sequence[CommitRecord]) -> str:
    """The order digest of a state saved before `ORDER_BY_DIGESTS`: the sample ids themselves hashed,
    as their commits list them (a shard whose commit is gone hashed as holding none)."""
    ids = {c.shard: c.sample_ids for c in commits}
    h = xxhash.xxh3_64()
    for s in shards:
        h.update(f"{s.shard}:{len(ids.get(s.shard, ()))}:".encode())
        h.update("\0".join(ids.get(s.shard, ())).encode())
    return h.hexdigest()


def buffer_footprint(shuffle_buffer: int, sample_bytes: float, range_bytes: int) -> float:
    """Bytes of fetched ranges a shuffle buffer of `shuffle_buffer` samples keeps in memory: a
    range stays until its last sample leaves the buffer, and a sample lingers there ~K ln K draws
    (the last of K to be drawn at random), so the ranges of the last K (1 + ln K) samples read
    stay, each holding range_bytes / sample_bytes samples, plus the range being read, and never
    more ranges than samples in the buffer. With a budget this large the peak stayed within budget
    + one range in each of 24 measured settings (K 4-64, 1-32 samples a range; docs/LOADER.md)."""
    k = shuffle_buffer
    per_range = max(1, int(range_bytes // max(1.0, sample_bytes)))
    ranges = min(k, math.ceil(k * (1 + math.log(k)) / per_range) + 1)  # + the range being read
    return ranges * per_range * sample_bytes


def auto_decode_threads(codec: str | None, consumers: int = 1) -> int:
    """Decode threads by codec and cores. Raw bf16 decodes by a copy under the GIL: threads only
    add hand-offs (12% slower, measured), so it decodes on the consumer's thread. zstd and the
    byte-plane merge release the GIL, so compressed codecs decode ahead on threads: 2 on a small
    machine (the best on 2 cores), one per 4 cores this consumer may use on a larger one, at most
    8. `consumers`: this process's DataLoader workers, which share its cores. Measurements in
    docs/LOADER.md."""
    if codec == "bf16":
        return 0
    return max(2, min(8, _cores() // (4 * max(1, consumers))))


def _cores() -> int:
    """CPUs this process may run on, shared with the other ranks on the node unless the launcher
    bound each rank to its own (then the affinity mask already holds only that rank's)."""
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return mine // local_ranks if mine == os.cpu_count() and local_ranks > 1 else mine


def load_index(store: ObjectStore, threads: int = 16, *, consumed: Literal["leave out", "keep"] = "leave out",
               unfinished_warning: bool = True, skip: frozenset[int] = frozenset()
               ) -> tuple[Manifest, list[CommittedShard], bytes | None]:
    """(the run's manifest, its committed shards sorted by id, the commit index to store when the
    stored one lacked some: `manifests.commit_index.Commits.new_index`): one listing of
    `commits/` and the commit index, plus a GET per commit the index lacks, and one listing of
    `consumed/shards/`.

    A shard a training run consumed and deleted (`layertap train --follow --delete-consumed`:
    `manifests.consumption`) keeps its commit but has no data: it is left out, with one warning
    saying how many shards and samples that is; a run whose every committed shard was consumed is
    an InputError, as is a run with no committed samples. `consumed="keep"` lists them anyway and
    raises neither, for a caller that leaves them out itself (`ShardStream._settle`, which must not
    fail where nothing is left: it may never be read, and a follow epoch whose every committed
    shard holds no samples, all skipped by extraction, ends there).
    A run whose extraction is unfinished is streamed as far as it goes, with a warning
    (`unfinished_warning`: one rank of many says it). The commits of shards in `skip` are not
    read, nor returned (the consumed shards, which a caller leaves out: a window run's are all of
    them, a GET each on every rank of its trainer)."""
    manifest = load_manifest(store)
    read = read_commits(store, threads, instead=(lambda shard: FeedCommit(shard, 0, 0) if shard in skip else None)
                        if skip else None)
    commits = [c for c in read.records if isinstance(c, CommitRecord)]
    root = store.uri.rstrip("/")
    foreign = sorted(c.shard for c in commits if not fits_plan(c, manifest))
    if foreign:
        raise replaced_manifest_error(store.uri, foreign)
    if unfinished_warning and consumed == "leave out" and len(commits) < len(manifest.shards):
        log.warning("%s: %d of %d planned shards are committed; streaming those. Its extraction is not finished: "
                    "finish it (`layertap status` tells what is left), or train with --follow to take the rest as "
                    "it comes", store.uri, len(commits), len(manifest.shards))
    gone = consumed_shards(store) if consumed == "leave out" else set()
    shards, left_out = [], []
    for c in commits:
        if len(c.sample_ids) != c.num_records:
            raise ShardError(f"{root}/{layout.commit_key(c.shard)} is inconsistent ({len(c.sample_ids)} sample ids "
                             f"for {c.num_records} records); run `layertap verify {store.uri}`")
        if c.shard in gone:
            left_out.append(c)
        elif c.num_records:
            shards.append(_committed(c))
    if left_out:
        samples = sum(c.num_records for c in left_out)
        what = (f"{len(left_out)} committed shard(s) ({samples} samples) of {store.uri} were consumed and deleted "
                "by a training run that read it while it was extracted (`layertap train --delete-consumed`, "
                "extraction's --window)")
        if not shards:
            raise InputError(f"every committed shard with samples is gone: {what}; they cannot be trained on "
                             "again: extract the run again (to a new --out) to train on it once more")
        log.warning("%s: leaving them out; they cannot be trained on again (streaming the other %d shard(s))",
                    what, len(shards))
    if not shards and consumed == "leave out":
        raise InputError(f"no committed shards with samples at {store.uri} yet: run `layertap extract` "
                         "(see `layertap status`)")
    return manifest, sorted(shards, key=lambda s: s.shard), read.new_index


def _committed(c: CommitRecord) -> CommittedShard:
    return CommittedShard(c.shard, c.data_key, c.bytes, c.xxh3_128, c.num_records, ids_digest(c.sample_ids))


def _record_of(s: CommittedShard) -> list:
    """[id, object key, bytes, object hash, records, sample ids' digest]: a shard as the ranks
    exchange it (JSON)."""
    return [s.shard, s.key, s.bytes, s.xxh3_128, s.records, s.ids]


def _of_records(records: Sequence[Sequence]) -> list[CommittedShard]:
    return [CommittedShard(int(s), key, int(size), digest, int(n), ids) for s, key, size, digest, n, ids in records]


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is None or world is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        else:
            r, w = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank, world = (r if rank is None else rank), (w if world is None else world)
    if not (world >= 1 and 0 <= rank < world):
        raise ConfigError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world}")
    return rank, world


class ShardStream(IterableDataset):
    """Samples of a run's committed shards, once each per epoch across all ranks and workers.

    Yields dicts: `sample_id` (str), `input_ids` (int64 [S]), `loss_mask` (uint8 [S]),
    `hidden_states` (bf16 [S, L, H]), `final_state` (bf16 [S, H], only if the run stored it) and
    `padding` (bool: a zero-weighted repeat; its loss_mask is all zeros).

    `prefix`: the run (a URI, or an open store); `config`: order and fetching; `rank` and
    `world_size`: from torch.distributed or RANK / WORLD_SIZE when not given; `store_options`:
    S3 settings, as the "s3" object of a --config file (`open_configured_store`: a local run
    ignores them); `committed`: the shards to stream, as rank 0's `shard_records`: this rank then
    reads no commit (at 90,000 shards each of 1,000 ranks listed commits/ and parsed the index,
    ~90 LIST pages, 10 MB and ~600 MB of memory apiece), and ranks that read the commits of a run
    still being extracted at different times would find different shards, and so epochs of
    different sizes and orders. Opening reads the run and writes nothing.

    `agree` (follow mode, several ranks): when the epochs after the follow epoch read the run's
    committed shards, rank 0 reads them and calls it with {"shards": its `shard_records`,
    "left_out": the shards consumed and deleted}, the others with None; it returns rank 0's on
    every rank (a broadcast: `layertap train` sets it), and the stream streams those. Without it each rank reads them on its own: a commit landing between
    two ranks' reads (a given-up shard redone) gave them different epochs, and at 1,000 ranks of
    a 20,000-shard run the reads were 20 M GETs of commits, at the follow epoch's end and again at
    every resume after it.
    """

    def __init__(self, prefix: str | ObjectStore, *, config: StreamConfig | None = None, rank: int | None = None,
                 world_size: int | None = None, store_options: dict[str, Any] | None = None,
                 committed: Sequence[Sequence] | None = None):
        super().__init__()
        self.config = c = config or StreamConfig()
        self.rank, self.world_size = _rank_world(rank, world_size)
        self._shard_facts: tuple[list, list, str, str] | None = None  # `_facts`
        if isinstance(prefix, ObjectStore):
            self._given: ObjectStore | None = prefix
            self._given_pid = os.getpid()
            self.uri = prefix.uri
        else:
            self._given, self.uri = None, prefix
        self._store_options = dict(store_options or {})
        if self.uri.startswith("s3://"):
            # botocore's connection pool: load_index reads commits the index lacks on 16 threads
            self._store_options.setdefault("threads", max(16, c.fetch_threads + c.prefetch_shards))
        self._store_cache: tuple[int, ObjectStore] | None = None
        self._pool_cache: tuple[int, BufferPool] | None = None  # GET buffers, kept from epoch to epoch
        self._metrics: Metrics | None = None
        self._records: dict[int, int] = {}  # records per committed shard, for consumed_shards
        self.shards_changed: str | None = None  # the saved set, when `load_state_dict` took a state over another
        self.agree: Callable[[list[list]], list[list]] | None = None
        self._left_out: list[int] = []  # follow mode's later epochs: shards consumed and deleted
        if c.follow and committed is not None:
            raise ConfigError("committed= needs a stream that is not in follow mode: the follow epoch takes shards "
                              "as they are committed")
        if c.follow:  # the run may not exist yet; its shards are found while iterating
            manifest = wait_for_manifest(self._store(), c.follow_poll_s, quiet=self.rank > 0)
            self.shards, self._new_index, self._settled = [], None, False
            follow = ([p.planned_records for p in manifest.shards], self.world_size)
        else:
            if committed is None:
                manifest, self.shards, self._new_index = load_index(self._store(), unfinished_warning=self.rank == 0)
            else:
                manifest, self._new_index = load_manifest(self._store()), None
                self.shards = _of_records(committed)
            self._settled, follow = True, None
        self._manifest = manifest
        self.run_id, self.planned_shards = manifest.run_id, len(manifest.shards)
        self.codec, self._run = manifest.identity.codec, manifest.identity
        self.total_samples = sum(s.records for s in self.shards)
        self.position = Position(rank_count(self.total_samples, self.world_size, c.uneven), follow=follow,
                                 rank=self.rank)

    @property
    def manifest(self) -> Manifest:
        """The run's manifest, as this stream read it when it started."""
        return self._manifest

    @property
    def shard_records(self) -> list[list]:
        """Every shard streamed as [id, object key, bytes, object hash, records, sample ids'
        digest]: JSON-ready, what `committed=` takes."""
        return [_record_of(s) for s in self.shards]

    def refresh_index(self) -> bool:
        """Store the run's commit index if this stream had to read commits it lacked, so that
        later starts (the other ranks', the next restart's) read one listing and one GET. For one
        rank: `layertap train` calls it on rank 0 before the other ranks open the run. Best
        effort: without write access later starts are only slower. True if written."""
        if self._new_index is None:
            return False
        written = write_index(self._store(), self._new_index)
        self._new_index = None
        return written

    # -- facts -----------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch (padding included); the same on every rank. In the
        follow epoch: with one consumer (the count per consumer depends on the workers)."""
        if self.position.in_follow_epoch:
            return self.position.counts(1)[0]
        self._settle()
        return self.position.per_rank

    def num_batches(self, batch_size: int, num_workers: int = 0, drop_last: bool = False) -> int:
        """Batches a DataLoader over this stream yields per epoch (each worker batches its own share)."""
        if not (self.position.in_follow_epoch):
            self._settle()
        counts = self.position.counts(max(1, num_workers))
        return sum(c // batch_size if drop_last else -(-c // batch_size) for c in counts)

    @property
    def fingerprint(self) -> str:
        """Identifies the set of committed shards (ids and object hashes)."""
        return self._facts()[3]

    def _facts(self) -> tuple[list, list, str, str]:
        """(the shards, their id runs, their order's digest, `fingerprint`), once per set of shards
        (`self.shards` is replaced, never changed in place): the state is saved with every batch,
        and hashing 90,000 shards each time took ~36 ms of the prefetch thread's."""
        if self._shard_facts is None or self._shard_facts[0] is not self.shards:
            text = "\n".join(f"{s.shard}:{s.xxh3_128}" for s in self.shards)
            self._shard_facts = (self.shards, id_runs([s.shard for s in self.shards]), _order_digest(self.shards),
                                 xxhash.xxh3_64_hexdigest(text.encode()))
        return self._shard_facts

    def metrics(self) -> dict:
        """Counters of the current (or last) iteration in this process: bytes fetched, records
        verified and decoded, samples, samples/s, decoded MB/s, peak buffered bytes, wait time."""
        return (self._metrics or Metrics()).snapshot()

    # -- epochs and resume -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs: a finished epoch counts as the start of the next."""
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order. The current epoch continues where it is; another epoch starts
        from its beginning. Optional: a finished epoch moves on to the next by itself."""
        self.position.set_epoch(epoch)

    def _settle(self, force: bool = False) -> None:
        """Follow mode after the follow epoch: read the committed shards once more (the run is
        complete by then, or as complete as its extraction got), so later epochs are today's order
        over all of them; with `agree`, over rank 0's list. Shards a `--delete-consumed` trainer
        consumed are left out: their data is gone (that trainer itself trains one epoch, and
        reads no later one). Not an error here when none is left: the state at the follow epoch's
        end settles too, and a trainer may never read a later epoch (`__iter__` says it)."""
        if self._settled or (not force and (self.position.in_follow_epoch)):
            return
        # A --delete-consumed trainer trains the follow epoch alone (--epochs 1): no later epoch for its
        # ranks to agree on, and its own deletions (a checkpoint at a wait) raced their reads of the run
        if self.agree is not None and not self.config.deletes_consumed:
            mine = {"shards": self._readable_shards_records(), "left_out": self._left_out} if self.rank == 0 else None
            got = self.agree(mine)
            self.shards, self._left_out = _of_records(got["shards"]), [int(s) for s in got["left_out"]]
        else:
            self.shards = self._readable_shards()
        self.total_samples = sum(s.records for s in self.shards)
        self.position.per_rank = rank_count(self.total_samples, self.world_size, self.config.uneven)
        self._settled = True
        if self._left_out:  # info: the --delete-consumed trainer's own state at its end settles too
            log.info("%s: %d committed shard(s) were consumed and deleted by a --delete-consumed trainer; the "
                     "epochs after the follow epoch, if any, stream the other %d", self.uri, len(self._left_out),
                     len(self.shards))

    def _readable_shards(self) -> list[CommittedShard]:
        """The committed shards with data (`load_index` without its error when none is left). Rank
        0 stores the commit index where it lacked commits (a follow run's never had them all): a
        resume then reads one listing and one GET, not a GET per commit."""
        gone = frozenset(consumed_shards(self._store()))
        # A --delete-consumed trainer (its ranks each read here) reads no commit of a consumed shard: a window
        # run's are all consumed by its end. Another reads them all, so that rank 0 stores a whole index.
        skip = gone if self.config.deletes_consumed else frozenset()
        _, shards, new_index = load_index(self._store(), consumed="keep", skip=skip)
        if new_index is not None and self.rank == 0:
            write_index(self._store(), new_index)
        self._left_out = sorted(gone) if skip else sorted(s.shard for s in shards if s.shard in gone)
        return [s for s in shards if s.shard not in gone]

    def _readable_shards_records(self) -> list[list]:
        """`_readable_shards` as `shard_records` (what `agree` hands over, with `_left_out`)."""
        return [_record_of(s) for s in self._readable_shards()]

    def _identity(self, follow_epoch: bool = False) -> dict[str, Any]:
        c = self.config
        ident = {"run_id": self.run_id, "seed": c.seed, "shuffle": c.shuffle, "shuffle_buffer": c.shuffle_buffer,
                 "uneven": c.uneven, "world_size": self.world_size}
        if c.follow:
            ident["follow"] = True
        if not follow_epoch:  # the follow epoch's shards are in the state itself ("taken")
            _, runs, order, fingerprint = self._facts()
            ident.update(shards=fingerprint, num_shards=len(self.shards), num_samples=self.total_samples)
            if c.follow:  # the set settled after the follow epoch, pinned again on resume (`_pin_settled`)
                ident["settled"] = runs
            # A shard withdrawn by `verify` and redone holds the same samples in other bytes: the
            # fingerprint differs, the order does not, and the epoch resumes (`load_state_dict`).
            ident["order"] = order
        return ident

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready position in the epoch. Ranks run in lockstep and every rank's workers get
        the same counts, so at a step boundary the state is the same on every rank (except in the
        follow epoch: each rank records the shards it found, in its own order)."""
        pos = self.position.state_dict()
        follow_epoch = self.position.in_follow_epoch
        if not follow_epoch:
            self._settle()
        return {"format": STATE_FORMAT, "version": STATE_VERSION, **self._identity(follow_epoch), "rank": self.rank,
                **pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` left off; refuse a state that would give another order."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise InputError("not a ShardStream state (missing format 'layertap-stream-state')")
        if state.get("version") != STATE_VERSION:
            raise InputError(f"ShardStream state version {state.get('version')} is not supported by this "
                             f"layertap (it reads version {STATE_VERSION}); use the release that saved it")
        follow_epoch = self.config.follow and int(state.get("epoch", 0)) == 0
        if follow_epoch and state.get("rank", self.rank) != self.rank:  # the shards each rank found differ
            raise InputError(f"this ShardStream state was saved by rank {state['rank']} in the follow epoch, where each "
                             f"rank records the shards it found in its own order: rank {self.rank} must resume "
                             "from its own state (save one per rank, as `layertap train` does)")
        if self.config.follow and not follow_epoch:
            self._settle(force=True)
            self._pin_settled(state)
        mine = self._identity(follow_epoch)
        mine.setdefault("follow", False)
        if "order" not in state:  # saved before a plain stream recorded its order: judged by the rest, as then
            mine.pop("order", None)
        elif "order" in mine and not str(state["order"]).startswith(ORDER_BY_DIGESTS):  # by the release before:
            commits = read_commits(self._store()).records  # its ids, read this once (the ranks hold digests)
            mine["order"] = _order_by_ids(self.shards, [c for c in commits if isinstance(c, CommitRecord)])
        saved = dict(state, follow=bool(state.get("follow")))
        differ = [k for k, v in mine.items() if saved.get(k) != v]
        if "order" in saved and "order" not in differ and "settled" not in differ:
            differ = [k for k in differ if k != "shards"]  # redone shards, the same samples: the same order
        self.shards_changed = None
        if differ and set(differ) <= set(SHARD_SET):
            # more shards committed (or some withdrawn) since: an epoch not begun takes today's set; one
            # begun would continue in another order, repeating and skipping samples
            consumed = state.get("consumed") or []
            if not isinstance(consumed, list) or any(n != 0 for n in consumed):
                raise ShardsChanged(
                    f"cannot resume this ShardStream mid-epoch: the committed shards of {self.uri} changed since "
                    f"the state was saved in epoch {state.get('epoch')} ({_shard_set(saved)} then, "
                    f"{_shard_set(mine)} now), and an epoch's order depends on them. Resume from a state at an "
                    "epoch's end, or start the epoch over without load_state_dict", _shard_set(saved))
            self.shards_changed = _shard_set(saved)
            log.info("%s: the committed shards changed since the state was saved (%s then, %s now); the saved "
                     "position is at the start of epoch %s, which streams them all", self.uri, self.shards_changed,
                     _shard_set(mine), state.get("epoch"))
            differ = []
        diffs = [f"{k}: state has {saved.get(k)!r}, this stream has {mine[k]!r}" for k in differ]
        if diffs:
            raise InputError(
                "cannot resume this ShardStream from the saved state, the order would differ:\n  "
                + "\n  ".join(diffs)
                + "\nconstruct the stream with the saved settings (same run, seed, world size, shuffle settings), "
                  "or start the epoch over without load_state_dict")
        self.position.load_state_dict(state)

    def _pin_settled(self, state: dict[str, Any]) -> None:
        """Follow mode past the follow epoch: stream the set the state settled on, as the run that
        saved it would have, though shards were committed since (a given-up shard redone by
        another `layertap extract`) or redone (withdrawn by `verify`). Their count and samples
        decide the order, so a resume mid-epoch goes on over them; the rest wait for a training
        over the whole run. A saved shard that is gone leaves today's set (the identity check
        then refuses a resume mid-epoch)."""
        runs = state.get("settled")
        if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 2 for r in runs):
            return  # a state saved before the settled set was recorded
        pinned = [s for s in self.shards if _in_ranges(s.shard, runs)]
        if id_runs([s.shard for s in pinned]) != runs or len(pinned) == len(self.shards):
            return
        log.info("%s: %d shard(s) committed since the saved state settled on %d are left out of this training "
                 "(its epochs stream the set they started with)", self.uri, len(self.shards) - len(pinned),
                 len(pinned))
        self.shards = pinned
        self.total_samples = sum(s.records for s in self.shards)
        self.position.per_rank = rank_count(self.total_samples, self.world_size, self.config.uneven)

    # -- iteration -------------------------------------------------------------------------------

    def _store(self) -> ObjectStore:
        """A store for this process: boto3 clients and thread pools do not survive a fork (a
        store the stream was given is reopened in a DataLoader worker, `ObjectStore.reopen`)."""
        pid = os.getpid()
        if self._given is not None and self._given_pid == pid:
            return self._given
        if self._store_cache is None or self._store_cache[0] != pid:
            store = (self._given.reopen() if self._given is not None
                     else open_configured_store(self.uri, self._store_options))
            self._store_cache = (pid, store)
        return self._store_cache[1]

    def _buffers(self) -> BufferPool:
        """This process's pool of GET buffers (a forked worker gets its own, not copy-on-write pages)."""
        pid = os.getpid()
        if self._pool_cache is None or self._pool_cache[0] != pid:
            self._pool_cache = (pid, BufferPool())
        return self._pool_cache[1]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_store_cache"] = None
        state["_pool_cache"] = None
        state["_metrics"] = None
        state["_new_index"] = None  # one writer, in the process that opened the stream
        state["agree"] = None  # a collective of the trainer's process; a worker's copy is settled already
        return state

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        worker = self.position.consumer(info.id, workers) if info is not None else 0
        # before `start`: a later epoch of a follow stream counts its samples from the settled shards
        # (unsettled, none: the position took the epoch for done and jumped past it)
        self._settle()
        self.position.start(workers)
        c = self.config
        if self.position.in_follow_epoch:
            self._metrics = Metrics()
            return self._follow(worker, workers, max(1, c.memory_budget // workers))
        if not self.shards and self._left_out:  # follow mode: a --delete-consumed trainer consumed every shard
            raise InputError(f"every committed shard of {self.uri} was consumed and deleted by a --delete-consumed "
                             f"trainer: epoch {self.position.epoch} (counted from 0) has nothing to read (the follow "
                             "epoch trained on what this trainer took); train one epoch fewer, or extract the run again")
        if not self.shards:  # follow mode over a run whose extraction skipped every sample
            raise InputError(f"no committed shard of {self.uri} holds a sample (its extraction skipped them all: "
                             f"`layertap status` counts the reasons): epoch {self.position.epoch} (counted from 0) has "
                             "nothing to read after the follow epoch; train one epoch")
        plan = plan_consumer([s.records for s in self.shards], seed=c.seed, epoch=self.position.epoch,
                             shuffle=c.shuffle, shuffle_buffer=c.shuffle_buffer, rank=self.rank,
                             world=self.world_size, worker=worker, workers=workers, uneven=c.uneven)
        self._metrics = Metrics()
        avg = sum(s.bytes for s in self.shards) / max(1, self.total_samples)
        budget = max(1, c.memory_budget // workers)
        rng = min(c.range_bytes, max(s.bytes for s in self.shards))  # no range is larger than its shard
        if worker == 0 and rng > budget:  # the budget holds whole ranges: one is the least in RAM
            log.warning("a fetched range (%s) exceeds the memory budget%s (%s): each fetch holds a whole range, so "
                        "buffered bytes will exceed the budget; raise the budget (--memory-budget)%s, or lower "
                        "range_bytes (StreamConfig)", size(rng),
                        f" per DataLoader worker ({size(c.memory_budget)} over {workers})" if workers > 1 else "",
                        size(budget), ", use fewer --num-workers" if workers > 1 else "")
        elif worker == 0 and c.shuffle and (held := buffer_footprint(c.shuffle_buffer, avg, rng)) > budget:
            log.warning("the shuffle buffer's %d samples (~%s each) keep ~%s of fetched ranges in memory (a range "
                        "stays until its last sample is used), over the memory budget per worker (%s): buffered "
                        "bytes will exceed the budget; raise --memory-budget, or lower --shuffle-buffer (or range_bytes: "
                        "StreamConfig)",
                        c.shuffle_buffer, size(avg), size(held), size(budget))
        threads = c.decode_threads if c.decode_threads is not None else auto_decode_threads(self.codec, workers)
        return self._generate(plan, worker, budget, threads)

    def _generate(self, plan, worker: int, budget: int, threads: int) -> Iterator[dict[str, Any]]:
        c, metrics, position = self.config, self._metrics, self.position
        start, m = position.consumed(worker), len(plan)
        metrics.started = time.perf_counter()
        if start >= m:
            return
        order = plan.order
        needed = np.sort(order[start:])
        fetcher = Fetcher(
            self._store(), self.shards, self.run_id,
            positions=list(zip(needed.tolist(), plan.shard[needed].tolist(), plan.record[needed].tolist())),
            budget=budget, range_bytes=c.range_bytes, prefetch_shards=c.prefetch_shards, threads=c.fetch_threads,
            on_corrupt=c.on_corrupt, metrics=metrics, pool=self._buffers(), config=self._manifest.config)
        decoder = ThreadPoolExecutor(threads, thread_name_prefix="layertap-decode") if threads else None
        ahead = 2 * threads
        pending: dict[int, tuple[Record, Future]] = {}
        last_good: dict[str, Any] | None = None

        def good_ahead(t: int) -> dict[str, Any]:
            """A sample to stand in for a skipped one when none has been yielded yet. Records it
            decodes are taken from the fetcher (so a failing shard cannot release their buffers
            while they are read) and kept in `pending`, decoded, for their turn."""
            for u in range(t + 1, m):
                if u not in pending:
                    item, fut = fetcher.wait_for(int(order[u])), None
                    if isinstance(item, Record):
                        fut = Future()
                        try:
                            fut.set_result(_decode(item, metrics))
                        except ShardError as e:
                            fut.set_exception(e)
                    pending[u] = (item, fut)
                item, fut = pending[u]
                got = self._resolve(fetcher, item, fut) if isinstance(item, Record) else None
                if got is not None:
                    return got
            # Nothing readable left to copy: one token of zeros in the run's shapes, as follow mode pads
            # with, so this consumer still yields its count (a rank that raised here hung the others in DDP)
            if self._run.hidden_size is not None:
                return self._stand_in(self.shards)
            raise ShardError(f"every sample left to worker {worker} of rank {self.rank} is in a failed shard, and "
                             f"the manifest of {self.uri} records no hidden_size to pad with zeros instead")

        try:
            for t in range(start, m):
                if decoder is not None:
                    for u in range(t + 1, min(m, t + 1 + ahead)):
                        if u not in pending:
                            rec = fetcher.take_if_ready(int(order[u]))
                            if rec is not None:
                                pending[u] = (rec, decoder.submit(_decode, rec, metrics))
                pos = int(order[t])
                rec, fut = pending.pop(t) if t in pending else (fetcher.wait_for(pos), None)
                sample = self._sample(fetcher, rec, fut)
                pad = bool(plan.padding[pos])
                if sample is None:  # it or its shard failed, on_corrupt="skip": a zero-weighted stand-in
                    metrics.add(skipped_samples=1)
                    last_good = last_good if last_good is not None else good_ahead(t)  # looked for once
                    sample, pad = self._stand_in(self.shards, like=last_good), True
                else:
                    last_good = sample
                if pad:
                    sample = self._pad(sample)
                    metrics.add(padding_samples=1)
                position.advance(worker)
                metrics.add(samples=1)
                yield sample
        finally:
            metrics.finished = time.perf_counter()
            if decoder is not None:
                decoder.shutdown(wait=True, cancel_futures=True)
            for rec, _ in pending.values():
                if isinstance(rec, Record):
                    fetcher.release(rec)
            fetcher.close()


    # -- follow mode -----------------------------------------------------------------------------

    def _follow(self, worker: int, workers: int, budget: int) -> Iterator[dict[str, Any]]:
        """The follow epoch of consumer `worker`: its part of every committed shard, in the order
        it finds them, recorded in the position (`taken`). A resumed consumer first replays the
        recorded order, without fetching what it had yielded, then goes on looking."""
        c, position, metrics = self.config, self.position, self._metrics
        consumers, me = self.world_size * workers, self.rank * workers + worker
        target = position.counts(workers)[worker]
        who = f"rank {self.rank}" + (f" worker {worker}" if workers > 1 else "")
        watcher = CommitWatcher(self._store(), self._manifest, c.follow_poll_s, who, deletes_consumed=c.deletes_consumed,
                                wants=lambda shard, n: follow_share(n, shard, consumers, me)[1] > 0, consumers=consumers)
        mine: list[CommittedShard] = []  # shards taken, in order: the fetcher's shard indices
        inputs: list[tuple[int, int]] = []  # this consumer's input sequence: (index into mine, record)
        ends: list[int] = []  # where each taken shard's inputs end in `inputs`, for shards with some
        shuffle = StreamingShuffle(c.shuffle_buffer if c.shuffle else 1,
                                   (c.seed, 0, self.rank, self.world_size, worker, workers))

        def take(commit: CommitRecord | FeedCommit) -> list[tuple[int, int, int]]:
            offset, k = follow_share(commit.num_records, commit.shard, consumers, me)
            if not k:  # no share of it (a FeedCommit: the watcher read no record)
                return []
            mine.append(_committed(commit))
            first = len(inputs)
            inputs.extend((len(mine) - 1, offset + j) for j in range(k))
            ends.append(len(inputs))
            return [(first + j, len(mine) - 1, offset + j) for j in range(k)]

        recorded, yielded = list(position.taken(worker)), position.consumed(worker)
        found = watcher.poll()
        self._check_replayable(recorded, position.taken_records(worker), watcher.known)
        for shard in recorded:
            take(watcher.known[shard])
        fed = 0
        while shuffle.emitted < yielded:  # the shuffle as it stood at the saved position
            if shuffle.ready():
                shuffle.emit()
            elif shuffle.wants_input() and fed < len(inputs):
                shuffle.add(fed)
                fed += 1
            elif not shuffle.ended:
                shuffle.end()  # the saved consumer was draining: extraction was over
            else:
                break
        todo = sorted(shuffle.held()) + list(range(fed, len(inputs)))
        fetcher = Fetcher(self._store(), mine, self.run_id, positions=[(i, *inputs[i]) for i in todo], budget=budget,
                          range_bytes=c.range_bytes, prefetch_shards=c.prefetch_shards, threads=c.fetch_threads,
                          on_corrupt=c.on_corrupt, metrics=metrics, pool=self._buffers(), open_ended=not shuffle.ended,
                          config=self._manifest.config)
        taken = set(recorded)
        # consumed and deleted by another training run (or by this one's lost checkpoint's): left out, as
        # `load_index` leaves them out of a plain stream, not fetched and then called corrupt
        gone = consumed_shards(self._store()) - taken

        def ours(shard: int) -> bool:  # a shard of which this consumer has no share is not lost to it
            known = watcher.known.get(shard)
            return known is None or follow_share(known.num_records, shard, consumers, me)[1] > 0

        if lost := {s for s in gone if ours(s)}:
            log.warning("%s: %d committed shard(s) of %s (%s) were consumed and deleted by a training run that read "
                        "it while it was extracted (`layertap train --delete-consumed`): leaving them out of the "
                        "follow epoch; they cannot be trained on again", who, len(lost), self.uri,
                        listing(sorted(lost)))

        def discover(new) -> None:
            for commit in new:
                if commit.shard not in taken and commit.shard not in gone and not shuffle.ended:
                    taken.add(commit.shard)
                    fetcher.extend(take(commit))
                    position.take(worker, commit.shard, commit.num_records)

        # decode threads work on the samples the shuffle emits next, as far as the inputs known fix them
        threads = c.decode_threads if c.decode_threads is not None else auto_decode_threads(self.codec, workers)
        decoder = ThreadPoolExecutor(threads, thread_name_prefix="layertap-decode") if threads else None
        pending: dict[int, tuple[Record, Future]] = {}

        def low() -> bool:
            """Whether the shards known but not all fed to the shuffle are down to what the fetcher
            reads ahead plus a margin: time to look for more promptly, not at the look-ahead backoff."""
            return len(ends) - bisect_right(ends, fed) <= c.prefetch_shards + FOLLOW_MARGIN_SHARDS

        def next_sample() -> dict[str, Any] | None:
            """The shuffle's next sample, decoded; None if its shard failed (skip policy)."""
            if decoder is not None:
                for u in shuffle.upcoming(2 * threads + 1, fed, len(inputs)):
                    if u not in pending and (rec := fetcher.take_if_ready(u)) is not None:
                        pending[u] = (rec, decoder.submit(_decode, rec, metrics))
            pos = shuffle.emit()
            return self._sample(fetcher, *(pending.pop(pos) if pos in pending else (fetcher.wait_for(pos),)))

        metrics.started = time.perf_counter()
        filler: dict[str, Any] | None = None  # the stand-in, in the shapes of the first sample yielded

        def pad() -> dict[str, Any]:
            """The follow epoch's padding: the stand-in, never the last sample yielded, which a
            consumer resumed in its padding has not got (the same samples either way)."""
            nonlocal filler
            filler = filler or self._pad(self._stand_in(mine))
            return dict(filler)

        try:
            discover(found)
            while True:
                if shuffle.ready():
                    discover(watcher.poll_if_due(low()))  # look ahead, so the fetcher has work
                    sample = next_sample()
                    if sample is None:  # it or its shard failed, on_corrupt="skip": padding, as in `_generate`
                        metrics.add(skipped_samples=1, padding_samples=1)
                        sample = pad()
                    elif filler is None:  # its shapes, for a manifest without hidden_size: no fetch at the end
                        filler = self._pad(self._stand_in(mine, like=sample))
                    position.advance(worker)
                    yielded += 1
                    metrics.add(samples=1)
                    yield sample
                elif shuffle.wants_input() and fed < len(inputs):
                    shuffle.add(fed)
                    fed += 1
                elif shuffle.ended:
                    break
                elif yielded >= target:
                    # Its count is reached, so every input it has was yielded (no real count exceeds the
                    # target), and no shard committed from now on has a share for it (its planned share
                    # would have kept its count below the target): it is done and takes no more. Taken
                    # now, a shard came after the batch that carries what it took, never reaching the
                    # trainer's position (with one consumer, that position had already rolled over).
                    break
                elif not watcher.complete:  # blocked on extraction: data wait, as a fetch is
                    t0 = time.perf_counter()
                    found = watcher.wait()
                    metrics.add(wait_s=time.perf_counter() - t0)
                    discover(found)
                else:  # extraction is over and every input is in the buffer: drain it
                    shuffle.end()
                    fetcher.seal()
            while yielded < target:  # zero-weighted up to the count every consumer reaches
                position.advance(worker)
                yielded += 1
                metrics.add(samples=1, padding_samples=1)
                yield pad()
        finally:
            metrics.finished = time.perf_counter()
            if decoder is not None:
                decoder.shutdown(wait=True, cancel_futures=True)
            for rec, _ in pending.values():
                fetcher.release(rec)
            fetcher.close()

    def _check_replayable(self, taken: list[int], records: list[int | None],
                          known: dict[int, CommitRecord | FeedCommit]) -> None:
        """Refuse to resume a follow epoch whose saved order no longer holds: a shard it took was
        withdrawn since (`layertap verify`), or redone with another record count, which moves every
        consumer's share of it and every sample's place after it (replayed, samples came twice or
        never, silently). `records`: the counts when taken (None where a state lacks them)."""
        missing = [s for s in taken if s not in known]
        if missing:
            from layertap.manifests.consumption import recorded_window

            window = recorded_window(self._store())
            raise InputError(f"{self.uri}: shard(s) {id_ranges(missing, 10)} that the saved position took in the follow epoch "
                             "are no longer committed (withdrawn by `layertap verify`?): run `layertap extract` "
                             "(the run's command, unchanged) to redo them, then resume"
                             + ("" if window is None else
                                f". Its extraction runs under --window {window}: workers waiting for a full window "
                                "redo withdrawn shards all the same, so if they still run, wait for the redo "
                                "(`layertap status` shows the shards done again; if it does not come, run "
                                "`layertap verify`, which restores a redo marker a killed verify left out, or "
                                "restart the extraction), then resume"))
        for shard, had in zip(taken, records):
            if had is not None and (now := known[shard].num_records) != had:
                raise InputError(f"{self.uri}: shard {shard} was redone with {now} records since the checkpoint (it "
                                 f"had {had}): this follow epoch cannot be resumed exactly, as every sample's place "
                                 "after it moved. Start the follow epoch over (`layertap train` without --resume, to "
                                 "another --out; shards a --delete-consumed trainer deleted are left out)")

    @staticmethod
    def _pad(sample: dict[str, Any]) -> dict[str, Any]:
        return dict(sample, loss_mask=torch.zeros_like(sample["loss_mask"]), padding=True)

    def _sample(self, fetcher: Fetcher, rec: Record | object, decoded: Future | None = None) -> dict[str, Any] | None:
        """`rec` (a fetched record, or SKIP) decoded; None if it or its shard failed (skip policy).
        The record goes back to the fetcher."""
        if not isinstance(rec, Record):
            return None
        try:
            return self._resolve(fetcher, rec, decoded)
        finally:
            fetcher.release(rec)

    def _resolve(self, fetcher: Fetcher, rec: Record, decoded: Future | None = None) -> dict[str, Any] | None:
        """`rec` decoded, by `decoded` when a decode thread has it; None if it does not decode and
        the policy skips it (else the fetcher's error is raised). The record stays taken."""
        try:
            if decoded is None:
                return _decode(rec, self._metrics)
            if not decoded.done():  # a decode thread still at it: the consumer waits on data
                t0 = time.perf_counter()
                wait([decoded])
                self._metrics.add(wait_s=time.perf_counter() - t0)
            return decoded.result()
        except ShardError as e:
            err = fetcher.record_failed(rec.shard, e)
            if err is not None:
                raise err from None
            return None

    def _stand_in(self, mine: list[CommittedShard], like: dict[str, Any] | None = None) -> dict[str, Any]:
        """The sample a follow epoch pads with, zero-weighted (its end; on_corrupt="skip"), and a
        plain one stands in for a skipped sample with: one token of zeros in the run's shapes, the
        same whichever samples a consumer resumed mid-epoch has seen (it repeated the last one
        before: a resumed run's samples differed). Not a fetched sample: after a restart at the
        end of the follow epoch the shards may be consumed and deleted (a window run). A manifest
        without hidden_size (synthetic runs) takes the shapes of `like`, else of the first
        readable committed sample: of its own shards, or of the run's when it took none with
        samples (no share of any)."""
        run = self._run
        if run.hidden_size is not None:
            states = torch.zeros(1, len(run.layers), run.hidden_size, dtype=torch.bfloat16)
            final = torch.zeros(1, run.hidden_size, dtype=torch.bfloat16) if run.final_state != "none" else None
        else:
            like = like if like is not None else self._first_readable(mine)
            states = torch.zeros(1, *like["hidden_states"].shape[1:], dtype=like["hidden_states"].dtype)
            final = like.get("final_state")
            final = None if final is None else torch.zeros(1, *final.shape[1:], dtype=final.dtype)
        pad = {"sample_id": "padding", "input_ids": torch.zeros(1, dtype=torch.int64),
               "loss_mask": torch.zeros(1, dtype=torch.uint8), "hidden_states": states, "padding": False}
        if final is not None:
            pad["final_state"] = final
        return pad

    def _first_readable(self, mine: list[CommittedShard]) -> dict[str, Any]:
        """The first readable committed sample of `mine`, or of the run's when it is empty."""
        c = self.config
        gone = consumed_shards(self._store())  # a resumed consumer's shards may be among them too
        mine = [s for s in mine if s.shard not in gone]
        if not mine:  # it holds only shards it has a share of, so samples; else the run's
            mine = [_committed(r) for r in read_commits(self._store()).records if r.shard not in gone]
        for i, shard in enumerate(mine):
            if not shard.records:
                continue
            fetcher = Fetcher(self._store(), mine, self.run_id, positions=[(0, i, 0)], budget=c.memory_budget,
                              range_bytes=c.range_bytes, prefetch_shards=1, threads=1, on_corrupt=c.on_corrupt,
                              metrics=self._metrics, pool=self._buffers(), config=self._manifest.config)
            try:
                sample = self._sample(fetcher, fetcher.wait_for(0))
            finally:
                fetcher.close()
            if sample is not None:
                return sample
        raise ShardError(f"{self.uri}: no readable committed sample to take the padding's shapes from")

    def consumed_shards(self, state: dict[str, Any] | None = None) -> list[int]:
        """Ids of the planned shards that no consumer of this rank with a planned share of them has
        yet to yield entirely in the follow epoch, according to `state` (default: the current
        position): those it has entirely yielded, and those it has no share of, committed or not
        (the ranks with a share decide: `delete_consumed` deletes only what every rank names, and
        only committed shards). After the follow epoch, the same as it ended (`follow_trained`: a
        shard given up and redone after it, never trained on, stays out); [] when not following.
        What `layertap train --delete-consumed` records once a checkpoint holds `state`."""
        c = self.config
        if not c.follow:
            return []
        state = self.state_dict() if state is None else state
        if int(state["epoch"]) > 0:
            if state.get("follow_trained") is not None:
                return sorted(int(s) for s in state["follow_trained"])
            self._settle(force=True)  # a state saved by a layertap that did not record them
            return [s.shard for s in self.shards]
        taken, consumed = state.get("taken") or [], state.get("consumed") or []
        counts = state.get("taken_records") or []
        if [len(r) for r in counts] == [len(t) for t in taken]:  # the state names them: no reads
            self._records.update((s, n) for t, r in zip(taken, counts) for s, n in zip(t, r) if n is not None)
        if any(s not in self._records for t in taken for s in t):
            self._records.update((r.shard, r.num_records) for r in read_commits(self._store()).records)
        workers = len(consumed)
        whole: list[set[int]] = []  # per consumer, the shards it has entirely yielded
        for w, t in enumerate(consumed):
            shards = taken[w] if w < len(taken) else []  # a state without them: nothing taken, nothing yielded
            me = self.rank * workers + w
            spans = []
            for shard in shards:
                if shard not in self._records:  # withdrawn since: this and later offsets are unknown
                    break
                spans.append((shard, follow_share(self._records[shard], shard, self.world_size * workers, me)[1]))
            n = sum(k for _, k in spans)
            done = np.zeros(n, dtype=bool)
            words = (c.seed, 0, self.rank, self.world_size, w, workers)
            done[buffer_shuffle(n, c.shuffle_buffer if c.shuffle else 1, words)[:min(t, n)]] = True
            mine, start = set(), 0
            for shard, k in spans:
                if done[start:start + k].all():
                    mine.add(shard)
                start += k
            whole.append(mine)
        return self.position.consumed_given(whole)


def _decode(rec: Record, metrics: Metrics) -> dict[str, Any]:
    s = check_sample(decode_record(rec.payload, rec.meta), rec.sample_id, rec.num_tokens, "record")
    metrics.add(records_decoded=1, decoded_bytes=_activation_bytes(s))
    return _as_dict(s)


def _activation_bytes(s: Sample) -> int:
    n = s.hidden_states.numel() * s.hidden_states.element_size()
    if s.final_state is not None:
        n += s.final_state.numel() * s.final_state.element_size()
    return n


def _as_dict(s: Sample) -> dict[str, Any]:
    d = {"sample_id": s.sample_id, "input_ids": s.input_ids, "loss_mask": s.loss_mask,
         "hidden_states": s.hidden_states, "padding": False}
    if s.final_state is not None:
        d["final_state"] = s.final_state
    return d
