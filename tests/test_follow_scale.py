"""Follow mode's requests at scale (docs/LOADER.md, "Follow mode"): what a consumer asks of the
store per look must not grow with the run's commits, or thousands of consumers of a run of tens
of thousands of shards ask S3 for more than a prefix serves. Requests are counted by a wrapper
store whose listings count a page per PAGE keys (S3's 1,000, scaled down so that small runs
span pages) as a lazy S3 listing fetches them."""

from __future__ import annotations

import math
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fake_worker  # noqa: E402
from layertap.manifests import commit_index, layout  # noqa: E402
from layertap.manifests.commit_index import read_commits, write_index  # noqa: E402
from layertap.manifests.records import CommitRecord, FeedCommit  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from layertap.train import follow  # noqa: E402
from layertap.train.follow import CommitWatcher  # noqa: E402

PAGE = 10  # keys per listing page (S3: 1,000)
SMALL, LARGE = 40, 300  # samples of fake_worker's runs: 7 and 54 shards


class Counting:
    """The store, with its requests counted by (kind, top folder): a listing counts a page when
    its first key is taken, as S3 fetches one only when the reader goes on."""

    def __init__(self, store):
        self.store = store
        self.requests: Counter[tuple[str, str]] = Counter()

    def list(self, prefix: str = "", start_after: str = ""):
        self.requests["LIST", prefix] += 1
        for n, o in enumerate(self.store.list(prefix, start_after)):
            if n and n % PAGE == 0:
                self.requests["LIST", prefix] += 1
            yield o

    def get(self, key: str):
        self.requests["GET", key.split("/")[0] + "/"] += 1
        return self.store.get(key)

    def exists(self, key: str) -> bool:
        self.requests["HEAD", key.split("/")[0] + "/"] += 1
        return self.store.exists(key)

    def __getattr__(self, name):
        return getattr(self.store, name)

    def take(self) -> Counter[tuple[str, str]]:
        """The requests since the last take."""
        out, self.requests = self.requests, Counter()
        return out


class Clock:
    """The monotonic clock `follow` reads, moved by hand: a test counts looks over minutes of
    its time without waiting for them."""

    def __init__(self):
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def run(tmp_path: Path, samples: int, name: str, leave: int = 0):
    """A run of `samples` samples (fake_worker's shards of ~6), committed but for its last `leave`
    shards; (uri, manifest)."""
    uri = str(tmp_path / name)
    m = fake_worker.plan(open_store(uri), samples)
    fake_worker.work(uri, samples=samples, shards=[p.id for p in m.shards][: len(m.shards) - leave])
    return uri, m


def age_feed(store, seconds: float) -> None:
    """Rename every feed key as if written `seconds` earlier: the run's commits landed a while ago."""
    for o in list(store.list(layout.FEED)):
        millis, shard, counts = layout.parse_feed(o.key)
        store.delete(o.key)
        store.put(layout.feed_key(millis - int(seconds * 1000), shard, *counts), b"")


def test_a_consumer_restarted_in_a_quiet_spell_lists_the_feed_not_every_commit(tmp_path):
    """A consumer (re)started while no commit lands (extraction between Slurm jobs, held by a full
    --window) finds no feed key in its look's recent window: it must still know the run has a
    feed, and not list all of commits/ at every look (a page per 1,000 shards, every 0.5 s)."""
    later: dict[int, Counter] = {}
    for samples in (SMALL, LARGE):
        uri, m = run(tmp_path, samples, f"run{samples}", leave=1)
        store = Counting(open_store(uri))
        age_feed(store.store, 120.0)
        watcher = CommitWatcher(store, m, poll_s=30.0)
        assert len(watcher.poll()) == len(m.shards) - 1
        store.take()
        for _ in range(3):
            assert watcher.poll() == []
        later[samples] = store.take()
        assert later[samples] == Counter({("LIST", layout.FEED): 3}), later[samples]
        fake_worker.work(uri, samples=samples, shards=[m.shards[-1].id])  # the feed shows the next commit
        assert [r.shard for r in watcher.poll()] == [m.shards[-1].id] and watcher.complete
    assert later[SMALL] == later[LARGE]


def test_a_run_without_a_feed_is_still_listed_whole_at_every_look(tmp_path):
    """A run extracted before the feed existed: each look lists commits/, or a commit is never found."""
    uri, m = run(tmp_path, SMALL, "run", leave=1)
    store = Counting(open_store(uri))
    store.store.delete_many([o.key for o in store.store.list(layout.FEED)])
    watcher = CommitWatcher(store, m, poll_s=30.0)
    watcher.poll()
    fake_worker.work(uri, shards=[m.shards[-1].id])
    store.store.delete_many([o.key for o in store.store.list(layout.FEED)])
    store.take()
    assert [r.shard for r in watcher.poll()] == [m.shards[-1].id]
    assert store.take()["LIST", layout.COMMITS] == 1


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    """The shards whose records `read_commits` decodes."""
    seen: list[int] = []
    plain = commit_index.decode_commit

    def counted(raw, where):
        record = plain(raw, where)
        seen.append(record.shard)
        return record

    monkeypatch.setattr(commit_index, "decode_commit", counted)
    return seen


def test_a_consumers_first_look_decodes_and_gets_only_the_records_it_needs(tmp_path, decodes):
    """A follow consumer among thousands needs a few of a run's records (those it has a share of):
    its first look neither reads nor decodes the whole commit index (~160 MB and 1.7 s per
    consumer process at 50,000 shards) but GETs those few; its requests and decodes do not grow
    with the run's commits beyond the listing of commits/ and tally/."""
    wanted = {0, 3}
    per_run: dict[int, tuple[Counter, list[int]]] = {}
    for samples in (SMALL, LARGE):
        uri, m = run(tmp_path, samples, f"run{samples}")
        plain = open_store(uri)
        write_index(plain, read_commits(plain).new_index)  # what a plain trainer's rank 0 stores
        truth = {r.shard: r for r in read_commits(plain).records}
        decodes.clear()
        store = Counting(plain)
        watcher = CommitWatcher(store, m, poll_s=30.0, wants=lambda shard, n: shard in wanted)
        found = {c.shard: c for c in watcher.poll()}
        assert sorted(found) == sorted(truth) and watcher.complete
        assert {s: found[s] for s in wanted} == {s: truth[s] for s in wanted}
        assert all(isinstance(c, FeedCommit) and c.num_records == truth[s].num_records
                   for s, c in found.items() if s not in wanted)
        requests = store.take()
        listed = {p: math.ceil(len(list(plain.list(p))) / PAGE) for p in (layout.COMMITS, layout.TALLY)}
        assert requests == Counter({("GET", layout.COMMITS): len(wanted), ("LIST", layout.FEED): 1,
                                    ("LIST", layout.COMMITS): listed[layout.COMMITS],
                                    ("LIST", layout.TALLY): listed[layout.TALLY]})
        per_run[samples] = Counter(k for k in requests.elements() if k[0] == "GET"), sorted(decodes)
    assert per_run[SMALL] == per_run[LARGE] == (Counter({("GET", layout.COMMITS): len(wanted)}), sorted(wanted))


def test_a_consumer_needing_many_records_reads_the_index_and_decodes_only_those(tmp_path, decodes, monkeypatch):
    """Past INDEX_FROM records to read, one GET of the index beats a GET each; of it, only the
    entries the consumer needs are decoded."""
    monkeypatch.setattr(commit_index, "INDEX_FROM", 3, raising=False)
    uri, m = run(tmp_path, LARGE, "run")
    plain = open_store(uri)
    write_index(plain, read_commits(plain).new_index)
    truth = {r.shard: r for r in read_commits(plain).records}
    wanted = {1, 7, 20, 41}
    decodes.clear()
    store = Counting(plain)
    watcher = CommitWatcher(store, m, poll_s=30.0, wants=lambda shard, n: shard in wanted)
    found = {c.shard: c for c in watcher.poll()}
    assert {s: found[s] for s in wanted} == {s: truth[s] for s in wanted}
    assert sorted(s for s, c in found.items() if isinstance(c, CommitRecord)) == sorted(wanted)
    gets = Counter(k for k in store.take().elements() if k[0] == "GET")
    assert gets == Counter({("GET", "index/"): 1}) and sorted(decodes) == sorted(wanted)


def test_a_plain_reader_still_takes_every_record_from_the_index(tmp_path, decodes):
    """Opening a complete run (ShardStream, `load_index`) needs every record: one GET of the index,
    none per commit, whatever INDEX_FROM says."""
    uri, m = run(tmp_path, SMALL, "run")
    plain = open_store(uri)
    write_index(plain, read_commits(plain).new_index)
    store = Counting(plain)
    decodes.clear()
    commits = read_commits(store)
    assert [r.shard for r in commits.records] == [p.id for p in m.shards] and commits.new_index is None
    assert Counter(k for k in store.take().elements() if k[0] == "GET") == Counter({("GET", "index/"): 1})
    assert sorted(decodes) == [p.id for p in m.shards]


def test_consumers_started_together_list_all_commits_at_spread_times(tmp_path, monkeypatch):
    """Every consumer of a trainer starts together; listing all of commits/ every FULL_LOOK_S from
    then on, they all listed it within a second of each other (a burst of pages per 1,000 shards
    times thousands of consumers). Each one's first full listing comes after its own part of
    FULL_LOOK_S, and the next a FULL_LOOK_S later: they stay spread."""
    clock = Clock()
    monkeypatch.setattr(follow, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    uri, m = run(tmp_path, SMALL, "run", leave=1)
    stores = [Counting(open_store(uri)) for _ in range(40)]
    watchers = [CommitWatcher(s, m, poll_s=30.0, who=f"rank {i}") for i, s in enumerate(stores)]
    for w in watchers:
        w.poll()
    for s in stores:
        s.take()
    full: list[list[float]] = [[] for _ in watchers]  # when each consumer listed commits/ (its clock)
    start, step = clock.t, 5.0
    while clock.t < start + 2 * follow.FULL_LOOK_S:
        clock.t += step
        for w, s, times in zip(watchers, stores, full):
            w.poll()
            if s.take()["LIST", layout.COMMITS]:
                times.append(clock.t - start)
    assert all(len(t) >= 1 for t in full)
    firsts = sorted(t[0] for t in full)
    assert firsts[-1] <= follow.FULL_LOOK_S  # none later than before
    assert firsts[-1] - firsts[0] >= follow.FULL_LOOK_S / 4, firsts
    assert max(Counter(firsts).values()) <= len(watchers) // 4, firsts
    assert all(t[1] - t[0] == pytest.approx(follow.FULL_LOOK_S, abs=step) for t in full if len(t) > 1)


def test_a_consumer_low_on_work_looks_less_often_while_looks_find_nothing(tmp_path, monkeypatch):
    """A caught-up consumer (its known work low) looked every 0.5 s, commits or not: through a
    quiet spell it backs off to LOW_POLL_MAX_S, and looks every 0.5 s again once a look finds a
    commit. A feed key listed again within the margin costs no GET."""
    clock = Clock()
    monkeypatch.setattr(follow, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(follow, "LOW_POLL_MAX_S", 4.0, raising=False)
    uri, m = run(tmp_path, SMALL, "run", leave=2)
    store = Counting(open_store(uri))
    watcher = CommitWatcher(store, m, poll_s=30.0)
    watcher.poll()
    store.take()
    quiet_s, step = 60.0, 0.1
    for _ in range(int(quiet_s / step)):
        clock.t += step
        assert watcher.poll_if_due(low=True) == []
    looks = store.take()["LIST", layout.FEED]
    assert looks <= quiet_s / 4.0 + 5, looks  # 0.5, 1, 2, then every 4 s: 17; every 0.5 s: 120
    first, second = m.shards[-2].id, m.shards[-1].id
    fake_worker.work(uri, shards=[first])
    found = []
    for _ in range(int(4.0 / step) + 1):
        clock.t += step
        found += watcher.poll_if_due(low=True)
        if found:
            break
    assert [r.shard for r in found] == [first]
    store.take()
    fake_worker.work(uri, shards=[second])
    clock.t += follow.FIRST_DELAY_S  # a look that found something: the next is 0.5 s later
    assert [r.shard for r in watcher.poll_if_due(low=True)] == [second]
    for _ in range(10):  # looks within the margin list both feed keys again, and GET neither
        clock.t += follow.FIRST_DELAY_S
        watcher.poll_if_due(low=True)
    assert store.take()["GET", layout.COMMITS] == 1


def _looks_while_commits_land(tmp_path, monkeypatch, every_s: float, **watcher) -> tuple[int, list[int], list[int]]:
    """A consumer low on work looking ahead every 0.1 s (its clock's) while the run's last 20
    shards commit one every `every_s`: (looks, shards committed, shards it found)."""
    clock = Clock()
    monkeypatch.setattr(follow, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    uri, m = run(tmp_path, LARGE, "run", leave=20)
    watcher = CommitWatcher(open_store(uri), m, poll_s=30.0, **watcher)
    watcher.poll()
    looks, poll = [], watcher.poll
    watcher.poll = lambda: looks.append(clock.t) or poll()
    left, found, step = [p.id for p in m.shards[-20:]], [], 0.1
    for n in range(int(20 * every_s / step) + int(10 / step)):  # the commits, then 10 s more
        if n % round(every_s / step) == 0 and left:
            fake_worker.work(uri, samples=LARGE, shards=[left.pop(0)])
        clock.t += step
        found += [r.shard for r in watcher.poll_if_due(low=True)]
    return len(looks), [p.id for p in m.shards[-20:]], found


def test_a_consumer_low_on_work_backs_off_while_commits_bring_it_none(tmp_path, monkeypatch):
    """Others' shares reset a consumer's look-ahead to 0.5 s as its own did: at 1,000 consumers
    one has a share of ~1 shard in 20, so it was low on work and looked every 0.5 s for good. It
    backs off while looks bring it nothing (0.5, 1, 2, then every 4 s), and still takes every
    commit, as a FeedCommit."""
    looks, committed, found = _looks_while_commits_land(tmp_path, monkeypatch, 2.0, wants=lambda shard, n: False)
    assert found == committed
    assert looks <= 50 / follow.LOW_POLL_MAX_S + 4, looks  # was 30: 3 looks (0.5 + 1 + 2 s) per commit


def test_a_consumer_of_many_looks_no_more_often_than_their_number_allows(tmp_path, monkeypatch):
    """A consumer of 4,000 (1,000 ranks x 4 workers) whose every look finds work of its own looked
    every 0.5 s: 8,000 listings a second for the trainer, past what an S3 prefix serves. It looks
    every 4,000 / RUN_LOOKS_PER_S = 4 s (+-20%), each look taking every commit since the last."""
    looks, committed, found = _looks_while_commits_land(tmp_path, monkeypatch, 1.0, consumers=4000)
    assert sorted(found) == committed
    assert looks <= 30 / (0.8 * 4000 / follow.RUN_LOOKS_PER_S) + 1, looks  # was 60: one every 0.5 s


def test_the_consumed_shards_commits_are_not_read_when_a_stream_settles(tmp_path):
    """A window run's trainer (--delete-consumed) consumes every shard: when its state at the follow
    epoch's end settled, each of its ranks still read every commit, a GET apiece (no index: a
    follow run writes none), to leave them all out. Only the commits of shards with data are read."""
    from layertap.manifests.consumption import consumed_shards, delete_consumed, record_consumed
    from layertap.train.stream import load_index

    uri, m = run(tmp_path, LARGE, "run")
    ids = [p.id for p in m.shards]
    record_consumed(open_store(uri), rank=0, world_size=1, shards=ids[:-2], step=9)
    assert delete_consumed(open_store(uri)) == ids[:-2]
    store = Counting(open_store(uri))
    _, shards, _ = load_index(store, consumed="keep", skip=frozenset(consumed_shards(open_store(uri))))
    assert [s.shard for s in shards] == ids[-2:]
    assert store.take()["GET", layout.COMMITS] == 2  # was one for each of the 54


def test_consumers_seeded_alike_still_spread_their_full_listings(tmp_path):
    """DataLoader workers seed Python's `random` alike on every rank: a phase drawn from it gave
    worker w the same one on all ranks, and the herd came back (review finding)."""
    import random

    uri, m = run(tmp_path, SMALL, "run", leave=1)
    phases = []
    for rank in range(8):
        random.seed(0)  # what each rank's worker 0 starts from
        w = CommitWatcher(open_store(uri), m, poll_s=30.0, who=f"rank {rank}")
        w.poll()
        phases.append(w._full_at - follow.time.monotonic())
    assert len({round(p, 3) for p in phases}) == len(phases)


def test_a_commit_the_feed_missed_at_a_runs_end_is_seen_at_the_next_wait(tmp_path):
    """A worker killed between its commit and its feed key, as the run's last shard (the follow
    SIGKILL trial, seed 1, in a full suite): nothing left to commit, so no look of the feed showed
    it, and the consumers waited for the full listing (75-300 s) with "16 of 17 committed, 1
    pending". A shard nothing works on is HEADed while a waiting consumer asks whether extraction
    is over; found committed, the next look lists commits/."""
    uri, m = run(tmp_path, SMALL, "run", leave=1)
    store = Counting(open_store(uri))
    watcher = CommitWatcher(store, m, poll_s=30.0)
    assert len(watcher.poll()) == len(m.shards) - 1
    last = m.shards[-1].id
    fake_worker.work(uri, samples=SMALL, shards=[last])
    for o in list(store.store.list(layout.FEED)):  # its worker was killed before the feed key
        if layout.parse_feed(o.key)[1] == last:
            store.store.delete(o.key)
    assert watcher.poll() == []
    store.take()
    assert watcher._extraction_over() is False
    assert store.take()[("HEAD", layout.COMMITS)] == 1
    assert [r.shard for r in watcher.poll()] == [last] and watcher.complete
