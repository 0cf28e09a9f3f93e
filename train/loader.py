"""`StreamLoader`: a DataLoader over a `ShardStream` whose state is exact with worker processes.

Each DataLoader worker iterates its own copy of the stream, so the copy in the trainer's process
never sees how far the workers got, and batches a worker has prepared but the trainer has not
taken must not count as consumed. The loader therefore wraps the collate function to tag every
batch, inside the worker that made it, with the worker's share, its sample count and the
worker's counters; the trainer's side adds up what it actually received, and remembers whose
batch is due next in the DataLoader's round-robin (which skips exhausted workers). A resumed
loader rotates the shares so its first worker is that one: the batch order continues exactly.
The state is exact at any batch boundary, whatever the DataLoader prefetched.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, get_worker_info

from train.batch import collate
from train.fetch import merge_snapshots
from train.stream import ShardStream


class _Tagged:
    """Runs in the worker: (worker id, samples, worker counters, batch)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, samples):
        info = get_worker_info()
        if info is None:
            return 0, len(samples), None, self.fn(samples)
        return info.dataset._logical_worker(info), len(samples), info.dataset.metrics(), self.fn(samples)


class StreamLoader:
    """Batches from `stream`, with `state_dict()` / `load_state_dict()` / `set_epoch()` / `metrics()`.

    Extra keyword arguments go to `torch.utils.data.DataLoader` (pin_memory, prefetch_factor,
    multiprocessing_context, ...); `persistent_workers` is refused because workers that outlive an
    epoch would keep the old epoch and position.
    """

    def __init__(self, stream: ShardStream, *, batch_size: int, num_workers: int = 0,
                 collate_fn: Callable = collate, drop_last: bool = False, **dataloader_kwargs: Any):
        if dataloader_kwargs.get("persistent_workers"):
            raise ValueError("persistent_workers=True is not supported: a new epoch or a resumed position "
                             "must reach the workers, which only happens when they start")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.stream, self.batch_size, self.num_workers = stream, batch_size, num_workers
        self.collate_fn, self.drop_last, self.dataloader_kwargs = collate_fn, drop_last, dataloader_kwargs
        self._snapshots: dict[int, dict] = {}

    def __len__(self) -> int:
        return self.stream.num_batches(self.batch_size, self.num_workers, self.drop_last)

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("num_workers") if isinstance(state, dict) else None
        workers = max(1, self.num_workers)
        if saved not in (None, workers):
            raise ValueError(f"the state was saved with {saved} DataLoader worker(s), this loader has {workers}: "
                             f"resume with num_workers={saved if saved > 1 else 0} (or start the epoch over)")
        self.stream.load_state_dict(state)

    def metrics(self) -> dict:
        """The stream's counters, summed over workers (peaks and elapsed time: the maximum)."""
        if self.num_workers == 0:
            return self.stream.metrics()
        return merge_snapshots(list(self._snapshots.values()))

    def __iter__(self) -> Iterator[Any]:
        stream, workers = self.stream, max(1, self.num_workers)
        stream._normalize()
        if stream._position is None:
            stream._position = [0] * workers
        elif len(stream._position) != workers:
            raise ValueError(f"the stream's position is for {len(stream._position)} worker(s), this loader has "
                             f"{workers}: resume with the same num_workers (or start the epoch over)")
        epoch, position = stream._epoch, stream._position
        loader = DataLoader(stream, batch_size=self.batch_size, num_workers=self.num_workers,
                            collate_fn=_Tagged(self.collate_fn), drop_last=self.drop_last, **self.dataloader_kwargs)
        self._snapshots = {}
        for worker, n, snapshot, batch in loader:
            if self.num_workers > 0:  # in-process, the stream counts its own samples
                position[worker] += n
                stream._next_worker = (worker + 1) % workers
                self._snapshots[worker] = snapshot
            yield batch
        # A whole pass. Unless a state_dict() call already moved on to the next epoch, mark this
        # one complete: samples of a partial last batch that drop_last discarded count as consumed.
        if stream._epoch == epoch and stream._position is position:
            stream._position = stream._counts(workers)
            stream._normalize()
