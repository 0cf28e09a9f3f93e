"""The extraction job's settings: one keyword-only dataclass, filled from a JSON config file and
command-line flags (flags win), validated before any work starts. Each field is its own flag
(`storage.flags`): its help and default are written once, here."""

from __future__ import annotations

import logging
import math
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from layertap.manifests.manifest import DEFAULT_SHARD_BYTES
from layertap.storage.codec_names import CODEC_NAMES, DEFAULT_CODEC
from layertap.storage.errors import ConfigError
from layertap.storage.flags import build, parse_json_object, setting, settings
from layertap.storage.store import s3_options
from layertap.storage.units import parse_size

# --config of the commands whose settings hold "s3" (extract and those taking its options, train)
CONFIG_HELP = ("JSON file with any of these settings, named as the flags with _ for - (flags override it), and an "
               "\"s3\" object of S3 connection and upload settings, e.g. {\"s3\": {\"addressing_style\": \"path\"}} "
               "(README.md, \"S3-compatible stores\")")
MAX_LEASE_TTL_S = 86_400  # a day: the longest a dead worker's shard may wait for its lease to go stale

QUICKSTART_LIMIT = 300  # conversations taken from the embedded ShareGPT when no dataset is given
DTYPES = ("auto", "bfloat16", "float32")

log = logging.getLogger(__name__)


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


def parse_ids(text: str) -> list[int]:
    """'1,16,31' or '0-9,12' -> a list of ints, in the order named. A reversed range ('3-2') is
    refused rather than read as empty: it would drop ids in silence. Repeats are kept, for the
    caller to refuse (capture layers) or fold (`parse_shard_ids`)."""
    return [i for part in (p.strip() for p in text.split(",")) if part for i in _id_range(part, text)]


def parse_shard_ids(text: str) -> list[int]:
    """`parse_ids`, each shard once (overlapping ranges, '0,0'): a shard named twice is one shard's work."""
    return list(dict.fromkeys(parse_ids(text)))


def _id_range(part: str, text: str) -> range:
    """One item of an id list: 'a-b' (inclusive) or 'a'."""
    try:
        a, b = part.split("-", 1) if "-" in part[1:] else (part, part)
        first, last = int(a), int(b)
    except ValueError:
        raise ConfigError(f"invalid id list {text!r}: use comma-separated integers or ranges, e.g. 1,16,31 or "
                          "0-9") from None
    if first > last:
        raise ConfigError(f"invalid id list {text!r}: range {part!r} is reversed; write it low to high, e.g. "
                          f"'{last}-{first}'")
    return range(first, last + 1)


@dataclass(kw_only=True)
class ExtractConfig:
    out: str = setting(help="run prefix: s3://bucket/prefix or a local folder (required)")
    model: str | None = setting(None, help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    gguf_file: str | None = setting(None, help="GGUF file inside --model to load")
    dataset: str | None = setting(None, help=".jsonl/.json/.parquet file, a folder of them (a Hub download: "
                                             "its train split), a quoted glob of them (also s3://bucket/data/*.parquet)"
                                             ", or a saved dataset folder (default: the embedded ShareGPT "
                                             "conversations)")
    layers: list[int] | None = setting(None, parse=parse_ids, help="capture layers, e.g. 1,16,31,46,61 (default: "
                                       "DFlash's spacing); layer k = output of decoder layer k")
    codec: str = setting(DEFAULT_CODEC, choices=CODEC_NAMES, help="hidden-state codec")
    max_length: int = setting(4096, help="truncate samples to N tokens")
    limit: int | None = setting(None, help=f"take the first N rows of the dataset (default: all; {QUICKSTART_LIMIT} "
                                           "for the embedded data); rows that yield no sample (no answer within "
                                           "--max-length) count among them")
    chat_template_kwargs: dict[str, Any] | None = setting(
        None, parse=parse_json_object, metavar="JSON",
        help="settings for the target's chat template where it renders chat rows, e.g. '{\"enable_thinking\": "
             "false}' (Qwen3.6); recorded with the run, and its drafter's eval renders prompts alike (default: a "
             "regenerated dataset's own, else none)")
    final_state: Literal["none", "prenorm", "postnorm"] = setting("none", help="also store the last layer's state")
    dtype: Literal["auto", "bfloat16", "float32"] = setting(
        "auto", help="forward dtype (default {default}: bfloat16 on CUDA and on CPUs with native bf16, float32 on "
                     "other CPUs, where it is faster); states are stored as bf16 either way")
    attn_implementation: str = setting("auto", help="attention implementation: auto (sdpa where the model supports "
                                                    "it, else eager), sdpa, eager, flash_attention_2 ...")
    batch_tokens: int = setting(16384, help="padded tokens per forward batch")
    shard_bytes: int = setting(DEFAULT_SHARD_BYTES, parse=parse_size,
                               help="target stored bytes per shard, e.g. 64MB, 1GB")
    encode_threads: int | None = setting(None, help="threads compressing records (default: this process's share "
                                                    "of its CPUs, 2 to 8)")
    lease_ttl_s: float = setting(60.0, flag="--lease-ttl", help="seconds before a dead worker's lease expires "
                                                                "(1 to 86400: a live worker renews it every quarter "
                                                                "of it)")
    stall_timeout_s: float = setting(1800.0, flag="--stall-timeout", help=(
        "seconds a worker holding a shard may go without progress (no record written, no object completed) "
        "before it is taken for hung (a GPU fault, a kernel that never returns): it dumps every thread's stack to "
        "its log and exits 6, and its shards go to other workers; 0: never (default {default}, above the 10 "
        "min a worker rides out a store outage)"))
    retries: int = setting(1, help="retries of a failed shard in one run: a shard failed more often is left to "
                                   "a rerun")
    shards: list[int] | None = setting(None, parse=parse_shard_ids, help="static assignment: only these shard ids, e.g. "
                                                                   "0-99 (default: any free shard)")
    window: int | None = setting(None, parse=parse_size, metavar="BYTES", help=(
        "storage window for training while extracting, e.g. 200GB: no new shard is claimed while this much "
        "committed data waits for training to consume it (consumed shards' data is deleted); each worker may "
        "finish one shard past it. Default: no window, keep everything"))
    overlap_shards: Literal["auto", "on", "off"] = setting("auto", help=(
        "run the next shard's forwards while the last one finishes (its last encodes, upload and commit) "
        "(default {default}: on a GPU, off on CPU, where the two would share the cores; always off with --window)"))
    log_dir: str = setting("layertap-logs", help="per-rank log files")
    s3: dict[str, Any] = setting(default_factory=dict, config_only=True, help="storage.s3.S3Options fields")

    def __post_init__(self) -> None:
        if self.codec not in CODEC_NAMES:
            raise ConfigError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODEC_NAMES)}")
        if self.final_state not in ("none", "prenorm", "postnorm"):
            raise ConfigError(f"--final-state must be none, prenorm or postnorm, not {self.final_state!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.layers is not None and not self.layers:
            raise ConfigError("no capture layers given: name at least one with --layers (e.g. 1,16,31), or leave "
                              "it out for DFlash's spacing")
        if self.shards is not None and not self.shards:
            raise ConfigError("--shards names no shard: give ids such as 0-99, or leave it out to take any free "
                              "shard")
        if self.max_length < 2:
            raise ConfigError(f"--max-length must be at least 2, got {self.max_length}")
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"--limit must be positive, got {self.limit}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ConfigError(f"chat_template_kwargs must be a JSON object, e.g. {{\"enable_thinking\": false}}, not "
                              f"{self.chat_template_kwargs!r:.80}")
        if self.batch_tokens < 1:
            raise ConfigError(f"--batch-tokens must be positive, got {self.batch_tokens}")
        if self.batch_tokens < self.max_length:
            raise ConfigError(f"--batch-tokens ({self.batch_tokens}) must be at least --max-length "
                              f"({self.max_length})")
        # Renewed every ttl/4: below a second, workers would do little else; past a day, a dead
        # worker's shard would wait that long (and the key's number must read back: no 1e+06, inf).
        if not 1 <= self.lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ConfigError(f"--lease-ttl must be between 1 and {MAX_LEASE_TTL_S} seconds (a worker renews its "
                              f"lease every quarter of it; a dead worker's shard waits that long; the default is "
                              f"60), got {self.lease_ttl_s:g}")
        if not 0 <= self.stall_timeout_s < math.inf:
            raise ConfigError(f"--stall-timeout must be 0 (never) or a number of seconds, got {self.stall_timeout_s:g}")
        if self.retries < 0:
            raise ConfigError(f"--retries must be 0 (a failed shard is left to a rerun) or more, got {self.retries}")
        try:
            self.shard_bytes = parse_size(self.shard_bytes)
        except ValueError as e:
            raise ConfigError(f"--shard-bytes: {e}") from None
        if self.window is not None:
            try:
                self.window = parse_size(self.window)
            except ValueError as e:
                raise ConfigError(f"--window: {e}") from None
        if self.overlap_shards not in ("auto", "on", "off"):
            raise ConfigError(f"--overlap-shards must be auto, on or off, not {self.overlap_shards!r}")
        if self.overlap_shards == "on" and self.window is not None:
            raise ConfigError("--overlap-shards on cannot be used with --window: the window's bound counts on "
                              "each worker finishing a shard before it claims the next (leave it at auto)")
        if self.encode_threads is None:
            self.encode_threads = default_encode_threads()
        if self.encode_threads < 1:
            raise ConfigError(f"--encode-threads must be at least 1, got {self.encode_threads}")
        if self.dataset is None and self.limit is None:
            self.limit = QUICKSTART_LIMIT
        part_size = s3_options(self.s3).part_size  # a misspelt setting is named now, even if every store is local
        if self.out and self.out.startswith("s3://"):
            _check_shard_fits_an_upload(self.shard_bytes, part_size)

    def identity(self, model_info: dict[str, Any], layers: list[int]) -> RunConfig:
        """What determines the stored output: a rerun must match it (`as_run_recorded`) to resume
        the run. `model` is a local folder's real path; `dtype` the one asked for: "auto" lets each
        worker choose for its device, and its shards' HEADs say which (`extra.forward_dtype`). Names
        do not pin contents, so the revision a hub id resolved to and hashes of the config.json,
        tokenizer and chat template (`load_target`'s info) are recorded too."""
        from layertap.storage.identity import RunConfig

        return RunConfig(model=model_info["model"], gguf_file=self.gguf_file, model_revision=model_info.get("revision"),
                         model_type=model_info.get("model_type"), tokenizer=model_info.get("tokenizer"),
                         layers=layers, final_state=self.final_state, hidden_size=model_info["hidden_size"],
                         codec=self.codec, dtype=self.dtype, max_length=self.max_length,
                         model_config_sha256=model_info.get("model_config_sha256"),
                         tokenizer_sha256=model_info.get("tokenizer_sha256"),
                         chat_template_sha256=model_info.get("chat_template_sha256"))


def _check_shard_fits_an_upload(shard_bytes: int, part_size: int) -> None:
    """Refuse shards an S3 multipart upload (10,000 parts at most) may not hold: the writer would fail
    at part 10,001, a shard's 156 GiB (at 16 MiB parts) already uploaded. A shard stores up to about
    twice its planned bytes (a codec that compresses worse than its default ratio, the last sample)."""
    from layertap.storage.s3 import MAX_PARTS, MiB
    from layertap.storage.units import size

    if 2 * shard_bytes > MAX_PARTS * part_size:
        need = -(-2 * shard_bytes // MAX_PARTS // MiB)
        raise ConfigError(f"--shard-bytes {size(shard_bytes)}: a shard may store up to twice that, and an S3 upload "
                          f"holds at most {MAX_PARTS:,} parts of part_size {size(part_size)} "
                          f"({size(MAX_PARTS * part_size)}): give --shard-bytes at most "
                          f"{size(MAX_PARTS * part_size // 2)} (shards of 256MB to a few GB read and resume best), or "
                          f'a part_size of at least {need}MiB in the "s3" settings of --config')


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products in hardware: AVX512-BF16 or AMX on x86
    (Sapphire Rapids, Zen 4 and later), the BF16 extension on Arm (Graviton 3, Grace).

    Without it, torch converts every bf16 operand to float32 and back, and a bf16 forward runs
    several times slower than a float32 one. torch's own CPU probes answer on x86 (the ones its
    oneDNN kernels dispatch on); /proc/cpuinfo's flags answer on Linux elsewhere.
    """
    import torch

    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(probe() for probe in probes if probe is not None):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.lower().startswith(("flags", "features")) for w in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(dtype: str, device: Any) -> tuple[str, str]:
    """The forward dtype for `--dtype` on `device`, and why: "auto" is bfloat16 on CUDA and on CPUs
    that compute bf16 natively (`cpu_has_native_bf16`), float32 on other CPUs, where it is the
    faster of the two. States are stored as bf16 either way."""
    if dtype != "auto":
        return dtype, "--dtype"
    if str(device).startswith("cuda"):
        return "bfloat16", "auto: CUDA"
    if cpu_has_native_bf16():
        return "bfloat16", "auto: this CPU computes bf16 natively (AVX512-BF16, AMX or Arm BF16)"
    return "float32", "auto: this CPU has no native bf16 (AVX512-BF16, AMX or Arm BF16), where float32 is faster"


def as_run_recorded(run_config: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` with each value that names what the run recorded, in another form, put in the
    run's form, so that comparing the two finds only real differences:

    - a local model folder (and its tokenizer's) named another way: relative or absolute, through
      a symlink, from another working directory (a Slurm job's);
    - the embedded model's tokenizer, whose recorded path is where its package was installed;
    - `dtype` "auto" in a rerun of a run that pinned bfloat16 or float32 (its workers keep it),
      and any dtype in a rerun of an "auto" run (each worker chooses for its device);
    - a fact the run did not record (`IF_RECORDED`: a revision it did not know, a content hash
      newer than the run): there is nothing to compare it with.
    """
    from layertap.storage.identity import IF_RECORDED

    out = dict(settings)
    for key in IF_RECORDED:
        if key in out and run_config.get(key) is None:
            out[key] = None
    for key in ("model", "tokenizer"):
        if _same_folder(run_config.get(key), out.get(key)):
            out[key] = run_config[key]
    model = run_config.get("model")
    if isinstance(model, str) and model.startswith("embedded:") and out.get("model") == model and "tokenizer" in out:
        out["tokenizer"] = run_config.get("tokenizer")
    if "dtype" in out and (out["dtype"] == "auto" or run_config.get("dtype") == "auto"):
        out["dtype"] = run_config.get("dtype")
    return out


def _same_folder(a: Any, b: Any) -> bool:
    if not (isinstance(a, str) and isinstance(b, str)) or a == b:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist here (a hub id, another machine's path)
        return False


def load_config(args: Any, **given: Any) -> ExtractConfig:
    """The settings of a parsed command line: its --config file, then its flags, then `given`."""
    values = {**settings(ExtractConfig, args), **given}
    if "out" not in values:
        raise ConfigError("no output prefix: give --out s3://bucket/prefix or a local folder")
    return build(ExtractConfig, values, args)


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal wrapper's `text_config` (Qwen3.5/3.6 ship one),
    else `config` itself; of a parsed config.json (a dict) or a transformers config object."""
    if isinstance(config, Mapping):
        inner = config.get("text_config")
        return inner if isinstance(inner, Mapping) and inner else config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_layers(layers: list[int], num_layers: int) -> list[int]:
    """`layers` as ints, each a decoder layer of a model of `num_layers` (ids 0..num_layers-1), none
    repeated. Torch-free: `layertap submit extract` checks them against the model's config.json."""
    if not layers:
        raise ConfigError("no capture layers given")
    out = []
    for k in layers:
        try:
            if isinstance(k, bool):
                raise TypeError
            k = operator.index(k)  # ints, numpy and torch integers; not floats or strings
        except TypeError:
            raise ConfigError(f"capture layer {k!r} is not an integer") from None
        if not 0 <= k < num_layers:
            raise ConfigError(f"capture layer {k} is out of range: the model has {num_layers} decoder "
                             f"layers, ids 0..{num_layers - 1} (layer k = output of decoder layer k)")
        out.append(int(k))
    if len(set(out)) != len(out):
        raise ConfigError(f"capture layers repeat: {layers}")
    return out
