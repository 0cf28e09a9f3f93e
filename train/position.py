"""`Position`: how far an epoch of a `ShardStream` has come, the one place its resume state lives.

A stream's consumers (the stream itself when iterated in-process, or each DataLoader worker)
yield their share of the epoch in an order computed from indices alone (`train.order`), so the
position is the epoch, the number of samples each consumer has yielded, and whose batch the
DataLoader's round-robin takes next. The stream counts what it yields in-process; with worker
processes the `StreamLoader` counts, in the trainer's process, the batches it actually received
(a worker's own copy of the stream never reports back). A finished epoch counts as the start of
the next.
"""

from __future__ import annotations

from typing import Any

from layertap.storage.errors import ConfigError, InputError
from layertap.train.order import follow_share, follow_target, worker_span


class Position:
    """The epoch, samples yielded per consumer, and the consumer whose batch is due next.

    Follow mode (`follow`: the planned records per shard, `ShardPlan.planned_records`, and the world size) makes epoch 0 the
    follow epoch: every consumer yields `follow_target` samples, and the position also holds
    each consumer's list of shards taken, in the order it found them (`taken`), with each
    shard's record count (`taken_records`, None where a state saved before them lacks it): what
    `ShardStream.consumed_shards` computes the consumers' shares from at every checkpoint, so
    that no rank has to read the commit records for it."""

    def __init__(self, per_rank: int, epoch: int = 0, follow: tuple[list[int], int] | None = None, rank: int = 0):
        self.per_rank = per_rank  # samples the rank yields per epoch: each consumer's share follows
        self.follow = follow
        self.rank = rank  # the follow epoch's consumers of this rank are rank * workers + worker
        self._targets: dict[int, int] = {}
        self._shares: dict[tuple[int, int], frozenset[int]] = {}  # shares_of's answers
        self._epoch = epoch
        self._consumed: list[int] | None = None  # per consumer, this epoch; None until a pass starts
        self._taken: list[list[int]] | None = None  # per consumer, in the follow epoch
        self._records: list[list[int | None]] | None = None  # the record counts of `_taken`'s shards
        # after it: the shards every consumer with a planned share of took in the follow epoch (so trained
        # on), and those this rank has no share of (`shares_of`): what `ShardStream.consumed_shards` names
        self.follow_trained: list[int] | None = None
        # the follow epoch's lists once it rolled on, until a pass starts: see `taken_since_reported`
        self._follow_last: tuple[list[list[int]], list[list[int | None]]] | None = None
        self._reported: list[int] = []  # per consumer: how much of `_taken` the loader has been told
        self._next = 0
        self._moves = 0  # counts jumps (another epoch, a loaded state), so a pass knows it was overtaken

    @property
    def in_follow_epoch(self) -> bool:
        """Whether the current epoch (a finished one counts as the start of the next) is the follow epoch."""
        self._roll()
        return self._follow_epoch()

    def _follow_epoch(self) -> bool:
        return self.follow is not None and self._epoch == 0

    def counts(self, workers: int) -> list[int]:
        """Samples each of `workers` consumers yields per epoch."""
        return self._counts(workers, self._follow_epoch())

    def _counts(self, workers: int, follow_epoch: bool) -> list[int]:
        if follow_epoch:
            if workers not in self._targets:
                planned, world = self.follow
                self._targets[workers] = follow_target(planned, world * workers)
            return [self._targets[workers]] * workers
        return [worker_span(self.per_rank, workers, w)[1] for w in range(workers)]

    def consumed_given(self, done: list[set[int]]) -> list[int]:
        """The planned shards no consumer with a planned share of them (`shares_of`) lacks in `done`
        (per consumer of this rank: the shards it has entirely yielded). One this rank has no share
        of counts: the ranks that have one decide (`delete_consumed` deletes only what every rank
        names, and only committed shards). [] without consumers."""
        if not done:
            return []
        missing = set().union(*(self.shares_of(w, len(done)) - d for w, d in enumerate(done)))
        return [s for s in range(len(self.follow[0])) if s not in missing]

    def shares_of(self, worker: int, workers: int) -> set[int]:
        """The shards consumer `worker` (of `workers` on this rank) has a planned share of in the
        follow epoch, and so must take and yield before they count as consumed; a commit's share
        is never larger (it covers the planned samples, and records never outnumber them). A
        shard planned with no samples is no one's share: nothing of it needs training."""
        key = (worker, workers)
        if key not in self._shares:
            planned, world = self.follow
            consumers, me = world * workers, self.rank * workers + worker
            self._shares[key] = frozenset(s for s, n in enumerate(planned)
                                          if n and follow_share(n, s, consumers, me)[1] > 0)
        return self._shares[key]

    def taken(self, worker: int) -> list[int]:
        """Shards consumer `worker` has taken in the follow epoch, in order."""
        return self._taken[worker] if self._taken is not None else []

    def taken_records(self, worker: int) -> list[int | None]:
        """The record counts of `taken(worker)`'s shards when taken (None: a state saved before
        counts were kept): a resumed consumer replays them, so they must not have changed."""
        return self._records[worker] if self._records is not None else []

    def take(self, worker: int, shard: int, records: int) -> None:
        self._taken[worker].append(shard)
        self._records[worker].append(records)

    def taken_since_reported(self, worker: int) -> tuple[int, list[int], list[int | None]] | None:
        """(offset, shards taken since the last call, their record counts): what a DataLoader
        worker sends with a batch; None outside the follow epoch. The batch that ends the follow
        epoch still reports: a lone worker's copy of the position has rolled on to the next epoch
        by the time that batch is collated (its one consumer is done), and the shards it took
        while making it would otherwise never reach the trainer (never counted as consumed)."""
        self._roll()
        taken, records = (self._taken, self._records) if self._follow_epoch() else self._follow_last or (None, None)
        if taken is None:
            return None
        done = self._reported[worker]
        new, counts = taken[worker][done:], records[worker][done:]
        self._reported[worker] = done + len(new)
        return done, new, counts

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads."""
        self._roll()
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """The current epoch continues where it is; another epoch starts from its beginning."""
        if epoch != self.epoch:
            self._jump(epoch, None, 0)

    def start(self, workers: int) -> int:
        """Begin or continue a pass over the current epoch with `workers` consumers; returns the
        token `finish` takes. A position saved with another number of consumers is refused: their
        shares, and so the order, would differ."""
        self._roll()
        if self._consumed is None:
            self._consumed = [0] * workers
            self._taken = [[] for _ in range(workers)] if self._follow_epoch() else None
            self._records = [[] for _ in range(workers)] if self._follow_epoch() else None
        elif len(self._consumed) != workers:
            saved = len(self._consumed)
            raise ConfigError(f"the stream's position was saved with {saved} DataLoader worker(s) and this pass runs "
                             f"{workers}: resume with num_workers={saved if saved > 1 else 0} (or start the epoch over)")
        if self._follow_epoch() and self._taken is None:
            self._taken, self._records = [[] for _ in range(workers)], [[] for _ in range(workers)]
        self._reported = [len(t) for t in self._taken] if self._taken is not None else []
        self._follow_last = None
        return self._moves

    def consumed(self, worker: int) -> int:
        """Samples consumer `worker` has yielded in the current epoch."""
        return self._consumed[worker] if self._consumed is not None else 0

    def advance(self, worker: int, n: int = 1) -> None:
        """Consumer `worker` yielded `n` more samples."""
        self._consumed[worker] += n

    def batch_received(self, worker: int, n: int,
                       taken: tuple[int, list[int], list[int | None]] | None = None) -> None:
        """The trainer received a batch of `n` samples from worker `worker` (the DataLoader's
        round-robin skips exhausted workers, so the next batch is due from the one after it);
        `taken`: the worker's `taken_since_reported` in the follow epoch."""
        self.advance(worker, n)
        if taken is not None and taken[1] and self._taken is not None:
            offset, new, records = taken
            del self._taken[worker][offset:], self._records[worker][offset:]
            self._taken[worker].extend(new)
            self._records[worker].extend(records)
        self._next = (worker + 1) % len(self._consumed)

    def consumer(self, worker_id: int, workers: int) -> int:
        """The share DataLoader worker `worker_id` serves: a resumed loader's first worker takes
        the share whose batch was due next, so the round-robin continues where it stopped."""
        return (worker_id + self._next) % workers

    def only_short_left(self, batch_size: int) -> bool:
        """Whether every consumer has fewer than `batch_size` samples left this epoch: with
        `drop_last`, the batch just received was the epoch's last."""
        c = self._consumed
        return c is not None and all(n - p < batch_size for p, n in zip(c, self.counts(len(c))))

    def finish(self, token: int) -> None:
        """A pass that `start` began read to its end: its epoch is complete (samples a
        `drop_last` DataLoader left out count as consumed), unless the position moved since."""
        if token == self._moves and self._consumed is not None:
            self._consumed = self.counts(len(self._consumed))
            self._roll()

    def state_dict(self) -> dict[str, Any]:
        self._roll()
        consumed = self._consumed
        state = {"epoch": self._epoch, "num_workers": len(consumed) if consumed else None,
                 "consumed": list(consumed or []), "next_worker": self._next}
        if self._follow_epoch():
            if consumed:  # what the follow epoch was sized at: another layertap may size it otherwise
                state["follow_target"] = self._counts(len(consumed), True)[0]
            state["taken"] = [list(t) for t in self._taken or []]
            state["taken_records"] = [list(r) for r in self._records or []]
        elif self.follow_trained is not None:
            state["follow_trained"] = list(self.follow_trained)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_follow_target(state)
        consumed = self._checked_counts(state)
        next_worker = state.get("next_worker", 0)
        if type(next_worker) is not int or not 0 <= next_worker < max(1, len(consumed)):
            raise InputError(f"corrupt ShardStream state: next_worker {next_worker} with {len(consumed)} workers")
        taken = state.get("taken")
        if taken is not None and (len(taken) != len(consumed) or self.follow is None):
            raise InputError("corrupt ShardStream state: 'taken' needs follow mode and one list per worker")
        self._jump(int(state["epoch"]), consumed or None, next_worker)
        trained = state.get("follow_trained")
        self.follow_trained = [int(s) for s in trained] if trained is not None and not self._follow_epoch() else None
        if self._follow_epoch() and consumed:
            self._taken = [[int(s) for s in t] for t in taken or [[] for _ in consumed]]
            records = state.get("taken_records")
            if records is None or [len(r) for r in records] != [len(t) for t in self._taken]:
                records = [[None] * len(t) for t in self._taken]  # saved before the counts were
            self._records = [[None if n is None else int(n) for n in r] for r in records]
        self._roll()

    def _check_follow_target(self, state: dict[str, Any]) -> None:
        """Refuse a follow epoch's state saved where it was sized at another count per consumer (a
        layertap that counted the plan's skipped rows as samples): resumed, its step count and lr
        schedule would change mid-run, or its counts read as damaged."""
        saved, consumed = state.get("follow_target"), state.get("consumed")
        if saved is None or self.follow is None or state.get("epoch") != 0 or not isinstance(consumed, list) \
                or not consumed:
            return
        ours = self._counts(len(consumed), True)[0]
        if saved != ours:
            raise InputError(f"this state's follow epoch gives each consumer {saved!r} samples, where this layertap "
                             f"sizes it at {ours} from the run's plan (a release that counts the plan's skipped rows "
                             "otherwise saved it): resume with the layertap release that saved it")

    def _checked_counts(self, state: dict[str, Any]) -> list[int]:
        """The state's samples consumed per worker, each an int within its share of the epoch. Taken
        as they came, a negative count waited forever for a sample before the epoch's first, one past
        the share began the next epoch, and 2.7 became 2."""
        epoch, consumed, workers = state.get("epoch"), state.get("consumed") or [], state.get("num_workers")
        fix = "the state was altered or damaged: resume from another one (an earlier checkpoint), or start over"
        if not _is_int(epoch) or epoch < 0:
            raise InputError(f"corrupt ShardStream state: epoch {epoch!r} is not a count of epochs; {fix}")
        if not isinstance(consumed, list) or not all(_is_int(n) for n in consumed):
            raise InputError(f"corrupt ShardStream state: consumed {consumed!r} is not a list of sample counts "
                             f"(ints), one per DataLoader worker; {fix}")
        if workers is not None and workers != len(consumed):
            raise InputError(f"corrupt ShardStream state: num_workers {workers!r} with {len(consumed)} worker "
                             f"count(s) in consumed {consumed}; {fix}")
        if consumed:
            counts = self._counts(len(consumed), self.follow is not None and epoch == 0)
            for w, (n, most) in enumerate(zip(consumed, counts)):
                if not 0 <= n <= most:
                    sized = (" (or a layertap that sized the follow epoch otherwise saved it: one from before "
                             "plans counted their skipped rows, whose release resumes it)"
                             if self.follow is not None and epoch == 0 and "follow_target" not in state else "")
                    raise InputError(f"corrupt ShardStream state: worker {w} consumed {n} samples of epoch {epoch}, "
                                     f"whose share gives it {most} (consumed {consumed}); {fix}{sized}")
        return list(consumed)

    def _roll(self) -> None:
        """A finished epoch becomes the start of the next."""
        c = self._consumed
        if c is not None and all(p >= n for p, n in zip(c, self.counts(len(c)))):
            last = (self._taken, self._records) if self._follow_epoch() and self._taken is not None else None
            if last is not None:  # its shards were drained to the end by every consumer that took them
                # consumed here: each shard every consumer with a share of took (and so yielded), and those
                # this rank has no share of (a consumer done with its count takes no more shards, so one
                # committed after it never came to this rank at all)
                self.follow_trained = self.consumed_given([set(t) for t in last[0]])
            self._jump(self._epoch + 1, None, 0)
            self._follow_last = last

    def _jump(self, epoch: int, consumed: list[int] | None, next_worker: int) -> None:
        self._epoch, self._consumed, self._next = epoch, consumed, next_worker
        self._taken = self._records = None
        self._follow_last = None
        self._moves += 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
