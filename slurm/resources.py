"""The CPUs and memory a job asks for, sized from what its workers run, unless given.

Per worker process (one per GPU, or one on CPU):
- extraction: its encode threads (`--encode-threads`, default 8) + 2 (the forward's
  thread, the writer and S3 client); 16 GiB (the CUDA context, pinned staging, the encode queue,
  upload parts), plus for a GGUF target 8x the file (dequantized in host memory, fp32 on the
  way), and once per node the safetensors weights (read through the page cache, which Slurm's
  memory limit counts);
- training: 4 + 4 per DataLoader worker (the step, the prefetcher, decode threads; GETs wait on
  the network); 24 GiB (the shuffle buffer of decoded samples, the CUDA context, the target's
  head) + the loader's `--memory-budget` (per rank, split between its DataLoader workers) + 2 GiB
  per DataLoader worker (a process of its own: torch, its decoded samples);
- regeneration: the client (asyncio, JSON, uploads) 2 CPUs and 4 GiB; with `--serve`, the server
  next to it 8 CPUs and 32 GiB per GPU (an inference server's tokenizer and scheduler processes,
  and the weights read through the page cache on load).

Then clipped to what one node of the partition has (of each, for a list), when `sinfo` can tell.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

GiB = 1 << 30
EXTRACT_BASE_THREADS, EXTRACT_MAX_ENCODE = 2, 8
EXTRACT_GIB_PER_WORKER, GGUF_EXPANSION = 16, 8
TRAIN_BASE_THREADS, TRAIN_THREADS_PER_LOADER = 4, 4
TRAIN_GIB_PER_WORKER, TRAIN_GIB_PER_LOADER = 24, 2
REGEN_CLIENT_CPUS, REGEN_CLIENT_GIB = 2, 4
SERVER_CPUS_PER_GPU, SERVER_GIB_PER_GPU = 8, 32


@dataclass(frozen=True)
class Resources:
    cpus_per_task: int
    mem_gib: int

    @property
    def mem(self) -> str:
        return f"{self.mem_gib}G"  # Slurm's G is 2^30 bytes


@dataclass(frozen=True)
class NodeShape:
    """The smallest node of a partition, as `sinfo` reports it, its largest GPU count and its nodes."""

    partition: str
    cpus: int
    mem_mb: int  # Slurm's MB: 2^20 bytes
    gpus: int
    gres: str
    nodes: int | None = None  # in every state: a job asking more waits in the queue for good


def weight_bytes(model: str | None, gguf_file: str | None) -> tuple[int, bool]:
    """Bytes of the target's weight files when it is a folder on this (shared) filesystem, and
    whether they are GGUF; (0, False) for a hub id or the embedded model."""
    if not model or not os.path.isdir(model):
        return 0, False
    if gguf_file:
        path = os.path.join(model, gguf_file)
        return (os.path.getsize(path), True) if os.path.isfile(path) else (0, True)
    names = os.listdir(model)
    sizes = {ext: sum(os.path.getsize(os.path.join(model, n)) for n in names if n.endswith(ext))
             for ext in (".safetensors", ".bin")}
    # transformers loads the safetensors where a folder has both (many hub repos ship both formats)
    return sizes[".safetensors"] or sizes[".bin"], False


def extract_resources(procs: int, encode_threads: int | None, model: str | None, gguf_file: str | None) -> Resources:
    threads = encode_threads or EXTRACT_MAX_ENCODE
    weights, gguf = weight_bytes(model, gguf_file)
    mem = procs * (EXTRACT_GIB_PER_WORKER * GiB + (GGUF_EXPANSION * weights if gguf else 0)) \
        + (0 if gguf else weights)
    return Resources(procs * (threads + EXTRACT_BASE_THREADS), math.ceil(mem / GiB))


def train_resources(procs: int, num_workers: int | None, memory_budget: int) -> Resources:
    """`memory_budget`: the loader's, in bytes per rank (a larger one was asked for with 4 GiB, and
    Slurm's limit killed the job once the loader filled it)."""
    loaders = max(1, num_workers or 0)
    return Resources(procs * (TRAIN_BASE_THREADS + TRAIN_THREADS_PER_LOADER * loaders),
                     procs * (TRAIN_GIB_PER_WORKER + math.ceil(memory_budget / GiB)
                              + TRAIN_GIB_PER_LOADER * (num_workers or 0)))


def regenerate_resources(gpus: int, serving: bool) -> Resources:
    if not serving:
        return Resources(REGEN_CLIENT_CPUS, REGEN_CLIENT_GIB)
    n = max(gpus, 1)
    return Resources(REGEN_CLIENT_CPUS + SERVER_CPUS_PER_GPU * n, REGEN_CLIENT_GIB + SERVER_GIB_PER_GPU * n)


def fit(res: Resources, nodes: list[NodeShape]) -> tuple[Resources, list[str]]:
    """`res` clipped to one node of each partition of `nodes` (a job given `--partition a,b` runs
    on whichever starts it first, so it must fit them all); notes on what was clipped, each naming
    the partition whose node sets the limit."""
    notes = []
    cpus, mem = res.cpus_per_task, res.mem_gib
    fewest_cpus = min((n for n in nodes if n.cpus), key=lambda n: n.cpus, default=None)
    if fewest_cpus and cpus > fewest_cpus.cpus:
        notes.append(f"--cpus-per-task {cpus} is more than a node of partition {fewest_cpus.partition} has: "
                     f"asking {fewest_cpus.cpus}")
        cpus = fewest_cpus.cpus
    least_mem = min((n for n in nodes if n.mem_mb >= 1024), key=lambda n: n.mem_mb, default=None)
    if least_mem and mem > least_mem.mem_mb // 1024:
        notes.append(f"--mem {mem}G is more than a node of partition {least_mem.partition} has: "
                     f"asking {least_mem.mem_mb // 1024}G")
        mem = least_mem.mem_mb // 1024
    return Resources(cpus, mem), notes
