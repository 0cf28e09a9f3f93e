"""The public trainers' per-sample layouts, read and written on any store: what they share.

speculators, SpecForge and ModelOpt each keep one file per sample and record no layer ids, so
every reader and writer here moves one `Sample` (records.py) at a time and the layer ids are the
caller's business (`layer_offset`: a format's id of layertap's layer k is k + offset). Each
format lives in its own module (`foreign_speculators`, `foreign_specforge`, `foreign_modelopt`);
`reader` and `writer` pick one by name.

Foreign `torch.save` files are pickles: they are read only through `torch.load(...,
weights_only=True)`, which unpickles tensors and plain containers and refuses anything else.
Writing them (SpecForge's and ModelOpt's own format) uses `torch.save`.
"""

from __future__ import annotations

import io
import re
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from layertap.storage.errors import InputError
from layertap.storage.units import possessive
from layertap.storage.records import Sample
from layertap.storage.store import ObjectStore

FORMATS = ("speculators", "specforge", "modelopt")
# A format's id for layertap's layer k (the output of decoder layer k) is k + offset:
# speculators counts HF `hidden_states` indices (0 is the embedding output); SpecForge's DFlash
# files (z-lab's ids) and ModelOpt count decoder layers from 0, as layertap does.
LAYER_OFFSET = {"speculators": 1, "specforge": 0, "modelopt": 0}


def foreign_layers(fmt: str, layers: list[int]) -> list[int]:
    """layertap's layer ids in `fmt`'s convention."""
    return [k + LAYER_OFFSET[fmt] for k in layers]


def layer_order(fmt: str, layers: list[int]) -> list[int]:
    """Which stored layer goes where in `fmt`'s files (and in a drafter served from them):
    ascending, for every format: vLLM and SGLang gather aux states in layer order (speculators'
    files; SpecForge's offline capture through SGLang), and ModelOpt's dumpers sort the aux layer
    ids. A run stored as 3,1 written as 3,1 gave a drafter whose fc columns the server feeds in the
    other order."""
    return sorted(range(len(layers)), key=layers.__getitem__)


def unservable_layer(layers: list[int], num_layers: int, remedy: str | None = None) -> str | None:
    """Why a drafter trained on `layers` of a `num_layers`-layer target cannot be served, or None.
    vLLM and SGLang gather a drafter's target states at the input of each decoder layer (HF
    `hidden_states` indices 0..num_layers - 1), so the last decoder layer's output (layertap's
    num_layers - 1, HF index num_layers) is never among them."""
    last = num_layers - 1
    if last not in layers:
        return None
    remedy = remedy or (f"choose capture layers below {last} (its final-layer state is --final-state's, stored "
                        "apart for the training objective)")
    return (f"capture layer {last} is the output of the target's last decoder layer (HF hidden_states index "
            f"{num_layers}): vLLM and SGLang gather a drafter's target states at the inputs of the decoder layers "
            f"(HF indices 0..{last}), never after the last one, so a DFlash or EAGLE-3 drafter trained on it cannot be "
            f"served by them; {remedy}")


# The final state each format carries beside the capture layers ("none": it carries none).
# files an import tries, in order, for one that reads: the arguments are checked, and the layout's kind
# told, by the first that does (a first file cut short refused the whole import)
PROBE_FILES = 8
FINAL_STATE = {"speculators": "prenorm", "specforge": "none", "modelopt": "postnorm"}


@dataclass(frozen=True, slots=True)
class ForeignFile:
    """One sample's file in a foreign layout: where it is, and its length when the layout says
    it without opening the file (speculators' Arrow column), else None."""

    sample_id: str
    key: str
    size: int
    num_tokens: int | None = None


class ForeignReader(Protocol):
    final_state: str
    renamed: int  # samples read so far whose id is their file's, not the one inside the file (ModelOpt's)

    def files(self) -> list[ForeignFile]: ...

    def capture_values(self, f: ForeignFile) -> tuple[int, int | None]:
        """Values per token of `f`'s capture layers, and how many layers those are where the
        layout says it (speculators' [T, k+1, H]), else None (the others concatenate them): what
        `import` checks --layers against before it writes anything."""
        ...

    def read(self, f: ForeignFile) -> Sample: ...


class ForeignWriter(Protocol):
    def write(self, index: int, sample: Sample) -> None: ...

    def close(self) -> list[str]: ...

    def written(self) -> list[str]:
        """Every key this writer has put, or begun to put: what a failed export removes."""
        ...


def reader(fmt: str, store: ObjectStore, num_layers: int, final_state: str | None = None) -> ForeignReader:
    """The reader of `fmt` over `store`, for files holding `num_layers` capture layers.
    `final_state`: what ModelOpt files that do not say hold in `hidden_states` (its vLLM dumper's
    pre-norm state, its HF dumper's post-norm one)."""
    if final_state is not None and fmt != "modelopt":
        raise InputError(f"--final-state is for --from modelopt (whose files may not say which state they hold); "
                         f"{possessive(fmt)} final state is {FINAL_STATE[fmt]!r}")
    if fmt == "modelopt":
        from layertap.storage.foreign_modelopt import ModelOptReader

        return ModelOptReader(store, num_layers, unflagged=final_state or "postnorm", asked=final_state is not None)
    if fmt == "speculators":
        from layertap.storage.foreign_speculators import SpeculatorsReader as cls
    elif fmt == "specforge":
        from layertap.storage.foreign_specforge import SpecForgeReader as cls
    else:
        raise InputError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    return cls(store, num_layers)


def writer(fmt: str, store: ObjectStore, rows_only: bool = False) -> ForeignWriter:
    """The writer of `fmt` into `store`; `rows_only`: speculators' Arrow dataset without the states."""
    if rows_only and fmt != "speculators":
        raise InputError(f"--rows-only is for speculators' layout (its Arrow dataset), not {possessive(fmt)}")
    if fmt == "speculators":
        from layertap.storage.foreign_speculators import SpeculatorsWriter

        return SpeculatorsWriter(store, states=not rows_only)
    if fmt == "specforge":
        from layertap.storage.foreign_specforge import SpecForgeWriter as cls
    elif fmt == "modelopt":
        from layertap.storage.foreign_modelopt import ModelOptWriter as cls
    else:
        raise InputError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    return cls(store)


def load_torch(data: bytes | memoryview, where: str) -> dict[str, Any]:
    """A foreign `torch.save` dict (gzip-compressed if it starts so), unpickled with
    `weights_only=True`: tensors and plain containers only, no code (from torch 2.6: before it, a
    crafted file could run code all the same, CVE-2025-32434, and is not read)."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        raise InputError(f"{where}: reading torch.save files needs torch 2.6 or later (this is {torch.__version__}, "
                         "whose weights_only loading a crafted file can get around): upgrade torch to import them")
    raw = bytes(data)
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(raw, where)
    if raw[:4] == b"PK\x03\x04":  # torch.save's zip, whose reader checks no CRC: a flipped byte went through
        try:
            entries = zipfile.ZipFile(io.BytesIO(raw))
            # torch.serialization.set_crc32_options(False) writes 0 for every CRC: none recorded to check
            bad = entries.testzip() if any(i.CRC for i in entries.infolist()) else None
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise InputError(f"{where}: not a readable torch.save file, or cut short ({type(e).__name__}: {e})") from None
        if bad is not None:
            raise InputError(f"{where}: its entry {bad} fails its CRC: the file is corrupt")
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad or unsafe file
        raise InputError(f"{where}: not a torch.save file of tensors (gzip-compressed or not), or cut short "
                         f"({type(e).__name__}: {str(e)[:300]})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: holds a {type(obj).__name__}, not a dict of tensors")
    return obj


# What a gzip-compressed sample file may grow to: 4 GiB (a 27B target's 32k tokens of 6 states in fp32),
# or 128x its size where more. Not a ratio alone: a short sample zero-padded to max_length compresses
# past 170x; a bomb (a 1 MB file of a GiB of zeros held 2 GB before its refusal) stops at the bound.
GUNZIP_FLOOR, GUNZIP_RATIO = 4 << 30, 128


def _gunzip(raw: bytes, where: str) -> bytes:
    """`raw` decompressed, refused past `GUNZIP_FLOOR` bytes or `GUNZIP_RATIO` times its size,
    whichever is more; gzip checks its own CRC."""
    limit = max(GUNZIP_FLOOR, GUNZIP_RATIO * len(raw))
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(raw, limit)
        if d.unconsumed_tail:
            raise InputError(f"{where}: decompresses to more than {limit:,} bytes from {len(raw):,}: not a sample file "
                             "(a decompression bomb?)")
        if not d.eof:
            raise InputError(f"{where}: the gzip stream is cut short")
        if d.unused_data:
            raise InputError(f"{where}: holds bytes after its gzip stream (another member?): not one compressed file")
    except zlib.error as e:
        raise InputError(f"{where}: not a readable gzip file ({e})") from None
    return out


def tensor_of(d: dict[str, Any], key: str, where: str, dims: tuple[int, ...], kind: str | None = None) -> torch.Tensor:
    """`d[key]` when it is a tensor of one of `dims` dimensions, its values held in the file, of the
    dtypes a `kind` takes ("ids": integers; "states": floats). `weights_only=True` also unpickles
    lists, numbers and strings, and sparse, meta, quantized tensors and views that repeat one row
    (stride 0: a 3 KB file declared 50M tokens, and import asked for 12.8 GB), which the readers
    would fail on (a whole shard failed on every retry for one bad file), or turn silently into
    other values (ids 355.9 as 355, int8 states as values): a bad value is the file's fault, an
    `InputError` naming the file and key, so import skips that file with its reason."""
    x = d[key]
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{where}: {key} is a {type(x).__name__}, not a tensor")
    if x.layout != torch.strided or x.is_meta or x.is_quantized:
        what = "meta" if x.is_meta else "quantized" if x.is_quantized else str(x.layout).removeprefix("torch.")
        raise InputError(f"{where}: {key} is a {what} tensor, not a dense one")
    if x.untyped_storage().nbytes() < x.numel() * x.element_size():
        raise InputError(f"{where}: {key} declares {tuple(x.shape)} ({x.numel():,} values) over "
                         f"{x.untyped_storage().nbytes():,} stored bytes: a view repeating its data, not values")
    if kind == "ids" and (x.dtype == torch.bool or x.is_complex() or (x.is_floating_point() and not bool(
            (x == x.round()).all()))):
        raise InputError(f"{where}: {key} is {str(x.dtype).removeprefix('torch.')}, not token ids (integers)")
    if kind == "states" and not x.is_floating_point():
        raise InputError(f"{where}: {key} is {str(x.dtype).removeprefix('torch.')}, not states (floating point)")
    if x.dim() not in dims:
        raise InputError(f"{where}: {key} has shape {tuple(x.shape)}, not one of "
                         f"{' or '.join(str(n) for n in dims)} dimension(s)")
    return x


def tokens_of(d: dict[str, Any], key: str, where: str, kind: str | None = None) -> torch.Tensor:
    """A per-token tensor (`input_ids`, `loss_mask`): [T], or [1, T] as a batch of one saves it."""
    x = tensor_of(d, key, where, (1, 2), kind)
    if x.dim() == 2 and x.shape[0] != 1:
        raise InputError(f"{where}: {key} has shape {tuple(x.shape)}, not [tokens] or [1, tokens]")
    return x.reshape(-1)


def save_torch(obj: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def printable(text: str) -> str:
    """A file name with its bytes that are not UTF-8 (surrogate escapes) and its control characters
    (a newline, an escape) written as \\xNN: sample ids and messages go into JSON, log files and a
    stdout that take only UTF-8 (printed as it was, a status line would fail on it), and a newline
    in a name split a log line in two."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m[0]):02x}", text)


def natural_key(text: str) -> list[Any]:
    """Sort key that orders embedded numbers by value: data_2 before data_10."""
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", text))]  # odd: the digit runs


def one_state(x: torch.Tensor, where: str, name: str) -> torch.Tensor:
    """A per-token state [T, H], or [1, T, H] as a batch of one saves it; a batch of several is
    refused (its first sample was taken, the rest dropped without a word)."""
    if x.dim() == 3 and x.shape[0] != 1:
        raise InputError(f"{where}: {name} has shape {tuple(x.shape)}, a batch of {x.shape[0]}: one sample a file, "
                         "[tokens, hidden] or [1, tokens, hidden], is expected")
    return x[0] if x.dim() == 3 else x


def split_layers(x: torch.Tensor, num_layers: int, where: str, name: str) -> torch.Tensor:
    """[T, L*H] (or [1, T, L*H]) concatenated capture layers -> [T, L, H]."""
    x = one_state(x, where, name)
    if x.dim() != 2 or x.shape[1] % num_layers:
        raise InputError(f"{where}: {name} has shape {tuple(x.shape)}, not [tokens, {num_layers} x hidden] "
                         f"for the {num_layers} layer(s) given by --layers")
    return x.reshape(x.shape[0], num_layers, x.shape[1] // num_layers)


def check_lengths(sample: Sample, where: str) -> Sample:
    """Every tensor of a sample read from a foreign file covers the same tokens."""
    t = sample.input_ids.shape[0]
    shapes = {"loss_mask": sample.loss_mask.shape[0], "hidden states": sample.hidden_states.shape[0]}
    if sample.final_state is not None:
        shapes["final state"] = sample.final_state.shape[0]
    bad = {k: v for k, v in shapes.items() if v != t}
    if bad:
        raise InputError(f"{where}: {t} token ids but " + ", ".join(f"{k} for {v}" for k, v in bad.items()))
    return sample


def as_mask(x: torch.Tensor) -> torch.Tensor:
    """A foreign loss mask as layertap stores it (uint8), when it holds only 0 and 1; otherwise as
    it came, so that import's check names the value (a cast first would turn 256 or 0.5 into 0, a
    token silently dropped from training)."""
    x = x.reshape(-1)
    if x.dtype == torch.bool or bool(((x == 0) | (x == 1)).all()):
        return x.to(torch.uint8)
    return x


def as_bf16(x: torch.Tensor) -> torch.Tensor:
    """layertap stores states as bf16 (what every public extractor produces)."""
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
