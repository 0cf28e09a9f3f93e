"""`StreamLoader`: a DataLoader over a `ShardStream` whose state is exact with worker processes.

Each DataLoader worker iterates its own copy of the stream, so the copy in the trainer's process
never sees how far the workers got, and batches a worker has prepared but the trainer has not
taken must not count as consumed. The loader therefore wraps the collate function to tag every
batch, inside the worker that made it, with the worker's share, its sample count and the
worker's counters; the trainer's side adds up what it actually received, and remembers whose
batch is due next in the DataLoader's round-robin (which skips exhausted workers). A resumed
loader rotates the shares so its first worker is that one: the batch order continues exactly.
The state is exact at any batch boundary, whatever the DataLoader prefetched.

`Prefetcher` takes batches from a `StreamLoader` on a thread, ahead of the trainer, and moves
their states to the GPU there; its `state_dict()` is the loader's state as of the last batch the
trainer took, so batches prefetched but never taken are read again after a resume.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, get_worker_info

from layertap.storage.errors import ConfigError, UserError
from layertap.train.batch import collate
from layertap.train.fetch import merge_snapshots
from layertap.train.stream import ShardStream


class _Tagged:
    """Runs in the worker: (the share it serves, samples, worker counters, shards it took since
    its last batch (follow epoch), batch)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, samples):
        info = get_worker_info()
        if info is None:
            return 0, len(samples), None, None, self.fn(samples)
        stream = info.dataset
        share = stream.position.consumer(info.id, info.num_workers)
        taken = stream.position.taken_since_reported(share)
        return share, len(samples), stream.metrics(), taken, self.fn(samples)


class StreamLoader:
    """Batches from `stream`, with `state_dict()` / `load_state_dict()` / `set_epoch()` / `metrics()`.

    Extra keyword arguments go to `torch.utils.data.DataLoader` (pin_memory, prefetch_factor,
    multiprocessing_context, ...); `persistent_workers` is refused because workers that outlive an
    epoch would keep the old epoch and position.
    """

    def __init__(self, stream: ShardStream, *, batch_size: int, num_workers: int = 0,
                 collate_fn: Callable = collate, drop_last: bool = False, **dataloader_kwargs: Any):
        if dataloader_kwargs.get("persistent_workers"):
            raise ConfigError("persistent_workers=True is not supported: a new epoch or a resumed position "
                             "must reach the workers, which only happens when they start")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
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
        if type(saved) is int and saved >= 1 and saved != workers:  # a damaged count: the stream's check names it
            raise ConfigError(f"the state was saved with {saved} DataLoader worker(s), this loader has {workers}: "
                             f"resume with num_workers={saved if saved > 1 else 0} (or start the epoch over)")
        self.stream.load_state_dict(state)

    def metrics(self) -> dict:
        """The stream's counters, summed over workers (`peak_buffered_bytes`: the sum of their peaks,
        the bound on what they hold at once; elapsed and wait time: the maximum)."""
        if self.num_workers == 0:
            return self.stream.metrics()
        return merge_snapshots(list(self._snapshots.values()))

    def __iter__(self) -> Iterator[Any]:
        position = self.stream.position
        if not position.in_follow_epoch:
            self.stream._settle()  # follow mode's later epochs: workers inherit the complete shard list
        started = position.start(max(1, self.num_workers))
        loader = DataLoader(self.stream, batch_size=self.batch_size, num_workers=self.num_workers,
                            collate_fn=_Tagged(self.collate_fn), drop_last=self.drop_last, **self.dataloader_kwargs)
        self._snapshots = {}
        for worker, n, snapshot, taken, batch in loader:
            if self.num_workers > 0:  # in-process, the stream counts its own samples
                position.batch_received(worker, n, taken)
                self._snapshots[worker] = snapshot
            if self.drop_last and position.only_short_left(self.batch_size):
                # The epoch's last batch: what drop_last leaves out counts as consumed before the
                # batch is handed over, so the state taken with it is the next epoch's start (else
                # a resume from it met an epoch of no batch, and `ends_epoch` came a batch late).
                position.finish(started)
                yield batch
                return
            yield batch
        # A whole pass: unless a state_dict() call already moved on to the next epoch, this one is
        # complete (samples of a partial last batch that drop_last discarded count as consumed).
        position.finish(started)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Batches of `loader` across epochs, prepared `depth` ahead on a thread of their own.

    The thread runs the loader (with num_workers=0 that includes decoding handoffs and collate),
    pins the states unless collate already wrote them pinned, and copies the `device_keys` to
    `device` on a side stream, so the training thread neither collates nor waits for a host to
    device copy: it takes a batch whose states are already on the GPU. `wait` adds up the time
    the training thread spent blocked in `wait_for_batch()`: the real data wait. At most `depth` batches
    are ahead of the one being trained on. Each batch carries `ends_epoch`: whether it is its epoch's
    last, so that a trainer accumulating gradients ends its step there. `end_epoch`: the epoch the
    thread does not begin (the trainer's last ends before it): past the last step it would start
    DataLoader workers and read `depth` batches for nothing, from shards that --delete-consumed
    is deleting; asked for one, `wait_for_batch()` raises instead.
    """

    def __init__(self, loader: StreamLoader, device: torch.device | str = "cpu", depth: int = 2,
                 device_keys: tuple[str, ...] = ("hidden_states", "final_state"), end_epoch: int | None = None):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.loader, self.device, self.device_keys = loader, torch.device(device), device_keys
        self.end_epoch = end_epoch
        self._state = loader.state_dict()  # as of the last batch taken: none yet
        self.wait = 0.0
        self._next: deque[Any] = deque()  # items `ready()` took off the queue, for the next wait_for_batch() calls
        self._waits_for_data = False  # the thread is inside the loader's next() in a follow epoch
        self._ready: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
        cuda = self.device.type == "cuda"
        self._consumer_stream = torch.cuda.current_stream(self.device) if cuda else None
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._thread = threading.Thread(target=self._run, name="layertap-prefetch", daemon=True)
        self._thread.start()

    def state_dict(self) -> dict[str, Any]:
        """The loader's state after the last batch `wait_for_batch()` returned (exact for a resume)."""
        return self._state

    @property
    def epoch(self) -> int:
        return int(self._state["epoch"])

    def ready(self, timeout: float, count: int = 1) -> bool:
        """Whether the next `count` batches are there (fewer when one of them ends its epoch, or
        the thread failed), waiting up to `timeout` seconds for them (the time goes into `wait`):
        lets a trainer do something else while it waits. `count` must not exceed the depth."""
        t = time.perf_counter()
        deadline = t + timeout
        try:
            while not self._enough(count):
                try:
                    self._next.append(self._ready.get(timeout=max(0.0, deadline - time.perf_counter())))
                except queue.Empty:
                    return False
            return True
        finally:
            self.wait += time.perf_counter() - t

    def _enough(self, count: int) -> bool:
        """Whether the items taken off the queue make up a step of `count` batches."""
        if len(self._next) >= count:
            return True
        return any(isinstance(item, _Failed) or item[0]["ends_epoch"] for item in self._next)

    def wait_for_batch(self) -> dict[str, Any]:
        """The next batch, blocking until the thread has it ready (the time goes into `wait`)."""
        if self._next:
            item = self._next.popleft()
        else:
            t = time.perf_counter()
            item = self._ready.get()
            self.wait += time.perf_counter() - t
        if isinstance(item, _Failed):
            self._next.appendleft(item)  # every later call fails the same way
            raise item.error
        batch, self._state = item
        self._slots.release()
        return batch

    def pop_wait_s(self) -> float:
        """Seconds spent blocked in `wait_for_batch` since the last call (non-blocking)."""
        w, self.wait = self.wait, 0.0
        return w

    def close(self) -> None:
        """Stop the thread. One blocked inside the loader (a follow stream waiting for commits)
        cannot be interrupted: it is given a second, then left to end with the process (a daemon),
        so a trainer stopped while it waits for data exits at once."""
        self._stop.set()
        self._slots.release()  # a thread waiting for a slot sees the stop
        # a second first, then looked at: a thread past its stop check that had not yet said it entered
        # the loader was given 30 s when it went on to wait for commits
        self._thread.join(timeout=1)
        if self._thread.is_alive() and not self._waits_for_data:
            self._thread.join(timeout=29)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self) -> None:
        epoch = int(self._state["epoch"])
        try:
            while not self._stop.is_set():
                if self.end_epoch is not None and epoch >= self.end_epoch:
                    raise RuntimeError(f"a batch was asked for past the last epoch the prefetcher was given "
                                       f"(epoch {epoch}; it ends before epoch {self.end_epoch})")
                batches, n = iter(self.loader), 0  # a finished epoch moves on to the next by itself
                try:
                    while True:
                        self._slots.acquire()
                        if self._stop.is_set():
                            return
                        # read here, in this thread: the position is this thread's to move
                        self._waits_for_data = self.loader.stream.position.in_follow_epoch
                        batch = next(batches, None)
                        self._waits_for_data = False
                        if batch is None:
                            self._slots.release()
                            if n == 0:
                                raise RuntimeError("the loader yielded no batch in a whole epoch")
                            break
                        n += 1
                        state = self.loader.state_dict()  # counts this batch and those before it
                        batch["ends_epoch"] = int(state["epoch"]) != epoch  # the position rolled on
                        epoch = int(state["epoch"])
                        self._ready.put((self._to_device(batch), state))
                finally:
                    batches.close()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there
            self._ready.put(_Failed(worker_error(e)))

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self._copy_stream is None:
            return batch
        with torch.cuda.stream(self._copy_stream):
            for key in self.device_keys:
                t = batch.get(key)
                if isinstance(t, torch.Tensor):
                    t = (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True)
                    t.record_stream(self._consumer_stream)  # freed after the training stream's use
                    batch[key] = t
        self._copy_stream.synchronize()  # this thread waits for the copy; the training thread never does
        return batch


def worker_error(e: BaseException) -> BaseException:
    """A user error raised in a DataLoader worker, as the worker raised it. torch raises it here as
    `type(e)("Caught X in DataLoader worker process N. Original Traceback ... module.X: text")`,
    which the command line printed whole, traceback and all, after "error:"."""
    if not isinstance(e, UserError) or not str(e).startswith("Caught "):
        return e
    text = str(e).rsplit(f"{type(e).__module__}.{type(e).__qualname__}: ", 1)[-1].strip()
    try:
        return type(e)(text)
    except Exception:  # an error type that takes other arguments: as torch gave it
        return e
