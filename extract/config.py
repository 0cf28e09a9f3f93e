"""The extraction job's settings: one keyword-only dataclass, filled from a JSON config file and
command-line flags (flags win), validated before any work starts."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from manifests.manifest import DEFAULT_SHARD_BYTES, ManifestError, parse_size
from storage.codecs import CODEC_NAMES, DEFAULT_CODEC
from storage.shard import ShardError
from storage.store import StoreError

# Failures that are the user's to fix (bad flags, missing files, store or run problems): the
# commands print them as one `error:` line and exit with 2, without a traceback.
USER_ERRORS = (ValueError, OSError, StoreError, ManifestError, ShardError)

QUICKSTART_LIMIT = 300  # conversations taken from the embedded ShareGPT when no dataset is given


def default_encode_threads() -> int:
    """Encoder threads for one extraction process: its share of the CPUs it may run on, 2 to 8.

    An H200 forward of a 27B target produces ~0.5 GB/s of states and one thread encodes
    bf16-zstd at ~0.5 GB/s, so 2 keep up in steady state and 8 absorb bursts (a batch arrives at
    once); more only compete with the writer and the S3 client. The CPUs are those of this
    process's affinity mask (Slurm's cgroup), split between the ranks started on this node.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(2, min(8, cpus // local_ranks - 1))


@dataclass(kw_only=True)
class ExtractConfig:
    out: str
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    gguf_file: str | None = None
    dataset: str | None = None  # None: the embedded ShareGPT conversations
    layers: list[int] | None = None  # None: DFlash's spacing for the model's depth
    codec: str = DEFAULT_CODEC
    max_length: int = 4096
    limit: int | None = None
    final_state: Literal["none", "prenorm", "postnorm"] = "none"
    # The forward's dtype; states are always stored as bf16. float32 is for CPUs without native
    # bf16 (most x86 without AVX512-BF16/AMX), where a bf16 forward is several times slower.
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    attn_implementation: str = "sdpa"
    batch_tokens: int = 16384  # padded tokens per forward batch
    shard_bytes: int = DEFAULT_SHARD_BYTES
    encode_threads: int | None = None  # None: sized to this process's CPUs (default_encode_threads)
    lease_ttl_s: float = 60.0
    retries: int = 1
    shards: list[int] | None = None  # a static assignment; None takes any free shard
    log_dir: str = "layertap-logs"
    s3: dict[str, Any] = field(default_factory=dict)  # storage.s3.S3Options fields

    def __post_init__(self) -> None:
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODEC_NAMES)}")
        if self.final_state not in ("none", "prenorm", "postnorm"):
            raise ValueError(f"--final-state must be none, prenorm or postnorm, not {self.final_state!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"--dtype must be bfloat16 or float32, not {self.dtype!r}")
        if self.max_length < 2:
            raise ValueError(f"--max-length must be at least 2, got {self.max_length}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"--limit must be positive, got {self.limit}")
        if self.batch_tokens < self.max_length:
            raise ValueError(f"--batch-tokens ({self.batch_tokens}) must be at least --max-length ({self.max_length})")
        self.shard_bytes = parse_size(self.shard_bytes)
        if self.encode_threads is None:
            self.encode_threads = default_encode_threads()
        if self.encode_threads < 1:
            raise ValueError("--encode-threads must be at least 1")
        if self.dataset is None and self.limit is None:
            self.limit = QUICKSTART_LIMIT

    def identity(self, model_info: dict[str, Any], layers: list[int]) -> dict[str, Any]:
        """What determines the stored output: a rerun must match it to resume the run."""
        return {
            "model": model_info["model"],
            "gguf_file": self.gguf_file,
            "model_revision": model_info.get("revision"),
            "model_type": model_info.get("model_type"),
            "tokenizer": model_info.get("tokenizer"),
            "layers": layers,
            "layer_convention": "decoder_output",
            "final_state": self.final_state,
            "hidden_size": model_info["hidden_size"],
            "codec": self.codec,
            "dtype": self.dtype,
            "max_length": self.max_length,
        }


def load_config(path: str | None, overrides: dict[str, Any]) -> ExtractConfig:
    """Settings from a JSON file, then the given command-line values on top."""
    values = read_config_file(path, ExtractConfig)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "out" not in values:
        raise ValueError("no output prefix: give --out s3://bucket/prefix or a local folder")
    return ExtractConfig(**values)


def read_config_file(path: str | None, cls: type) -> dict[str, Any]:
    """The settings in a JSON config file, refused if it names a field `cls` does not have."""
    if not path:
        return {}
    try:
        with open(path) as f:
            values = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r} must hold a JSON object of settings")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config file {path!r} has unknown settings {unknown}; known: {sorted(known)}")
    return values


def parse_ids(text: str) -> list[int]:
    """'1,16,31' or '0-9,12' -> a list of ints."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise ValueError(f"invalid id list {text!r}: use comma-separated integers or ranges, e.g. 1,16,31 or 0-9") from None
    return out
