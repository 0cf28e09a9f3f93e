"""One sample as a RECD payload: a safetensors blob of codec-encoded tensors (docs/FORMAT.md §4).

The blob is written and parsed here by hand, not by the safetensors library, because the library
copies: `serialize`/`save` return one new `bytes` holding every tensor, and `deserialize`/`load`
take only `bytes` (a copy of the fetched range), copy every tensor out again and drop the
metadata; `safe_open` reads only files. On 48 MB records that costs up to 2x the CPU of decoding
and 3x of encoding (`python bench/record_codec.py --record-mb 48`). Written this way a record
goes out as the tensors' own buffers and is read as views into the fetched range.
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from layertap.storage.codecs import get_codec
from layertap.storage.format import ShardError, ShardMeta


@dataclass(slots=True)
class Sample:
    """One sample's tokens and activations, unpadded."""

    sample_id: str
    input_ids: torch.Tensor  # int [S]
    loss_mask: torch.Tensor  # 0/1 [S]
    hidden_states: torch.Tensor  # bf16 [S, len(layers), hidden]
    final_state: torch.Tensor | None = None  # bf16 [S, hidden]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """A sample turned into its RECD payload, ready to append (encoding runs in worker threads).

    The payload is kept as the list of buffers that make it up (safetensors header, then each
    tensor's bytes), hashed where it was built: appending it copies nothing and hashes nothing.
    """

    sample_id: str
    num_tokens: int
    parts: tuple[bytes | memoryview, ...]
    size: int
    xxh3_64: int
    raw_bytes: int  # activation bytes before the codec
    sq_err: float = 0.0  # codec reconstruction error, summed (lossy codecs)
    sq_norm: float = 0.0

    @property
    def payload(self) -> bytes:
        return b"".join(self.parts)


def encode_record(sample: Sample, meta: ShardMeta) -> EncodedRecord:
    """Validate a sample against the shard's metadata and encode it with the shard's codec."""
    sid = sample.sample_id
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"sample_id must be a non-empty string, got {sid!r}")
    s = sample.input_ids.shape[0] if sample.input_ids.dim() == 1 else -1
    if s < 0:
        raise ValueError(f"sample {sid}: input_ids must be 1-D, got shape {tuple(sample.input_ids.shape)}")
    if tuple(sample.loss_mask.shape) != (s,):
        raise ValueError(f"sample {sid}: loss_mask shape {tuple(sample.loss_mask.shape)} != ({s},)")
    want = (s, len(meta.layers), meta.hidden_size)
    if tuple(sample.hidden_states.shape) != want:
        raise ValueError(f"sample {sid}: hidden_states shape {tuple(sample.hidden_states.shape)} != {want}")
    has_final = sample.final_state is not None
    if has_final != (meta.final_state != "none"):
        raise ValueError(f"sample {sid}: final_state is {'present' if has_final else 'missing'} "
                         f"but the shard says final_state={meta.final_state!r}")
    if has_final and tuple(sample.final_state.shape) != (s, meta.hidden_size):
        raise ValueError(f"sample {sid}: final_state shape {tuple(sample.final_state.shape)} != {(s, meta.hidden_size)}")
    ids = sample.input_ids
    if s and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
        raise ValueError(f"sample {sid}: token ids must lie in [0, 2^31)")
    mask = sample.loss_mask
    if s and not bool(((mask == 0) | (mask == 1)).all()):  # the reader refuses any other (a weight, not a flag)
        raise ValueError(f"sample {sid}: loss_mask values must be 0 or 1")

    codec = get_codec(meta.codec)
    tensors: dict[str, torch.Tensor] = {
        "input_ids": ids.to(torch.int32).contiguous(),
        "loss_mask": sample.loss_mask.to(torch.uint8).contiguous(),
    }
    md = {"sample_id": sid, "num_tokens": str(s), "codec": meta.codec}
    raw, sq_err, sq_norm = 0, 0.0, 0.0
    for name in ("hidden_states", "final_state"):
        x = getattr(sample, name)
        if x is None:
            continue
        try:
            enc, enc_meta = codec.encode(x.contiguous())
        except ValueError as e:  # e.g. fp8 refuses NaN/inf: which sample, which tensor
            raise ValueError(f"sample {sid}: {name}: {e}") from None
        raw += x.numel() * x.element_size()
        tensors.update({f"{name}.{k}": v for k, v in enc.items()})
        md.update({f"{name}.{k}": v for k, v in enc_meta.items()})
        sq_err += float(enc_meta.get("sq_err", 0.0))
        sq_norm += float(enc_meta.get("sq_norm", 0.0))
    parts = safetensors_parts(tensors, md)
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return EncodedRecord(sid, s, tuple(parts), sum(len(p) for p in parts), h.intdigest(), raw, sq_err, sq_norm)


def decode_record(payload: bytes | memoryview, meta: ShardMeta) -> Sample:
    """The inverse of `encode_record` (payload hash already checked by the caller).

    Reads the payload in place: the codecs decompress and reassemble straight from it into the
    output tensors, which share no memory with it (the payload can be freed once this returns).
    ShardError only for a malformed record: anything else (MemoryError above all) is raised as it
    is, because `verify` withdraws and deletes a shard it finds corrupt.
    """
    md: dict[str, str] = {}
    try:
        md, tensors = read_safetensors(payload)
        if md.get("codec", meta.codec) != meta.codec:
            raise ShardError(f"record {md.get('sample_id')!r} is encoded {md['codec']!r}, its shard's HEAD says "
                             f"{meta.codec!r}")
        codec = get_codec(meta.codec)
        ids, mask = tensors.get("input_ids"), tensors.get("loss_mask")
        want = _state_shapes(ids, meta)
        decoded = {}
        for name in ("hidden_states", "final_state"):
            parts = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
            if parts:
                sub_meta = {k[len(name) + 1 :]: v for k, v in md.items() if k.startswith(name + ".")}
                if want is not None and sub_meta.get("shape") != ",".join(map(str, want.get(name, ()))):
                    # before decoding: the codec allocates the shape the record declares
                    raise ShardError(f"record {md.get('sample_id')!r} does not fit its shard's HEAD "
                                     f"({len(meta.layers)} layers, hidden {meta.hidden_size}, final_state "
                                     f"{meta.final_state!r}, {want['hidden_states'][0]} tokens): it declares "
                                     f"{name} [{sub_meta.get('shape')}]")
                decoded[name] = codec.decode(parts, sub_meta)
        if isinstance(mask, np.ndarray):  # a view into the payload: the sample gets its own copy
            mask = torch.from_numpy(mask.copy())
        if isinstance(ids, np.ndarray):
            ids = torch.from_numpy(ids.copy())
    except ValueError as e:  # how the blob parser and the codecs report malformed data
        raise ShardError(f"record does not decode: {type(e).__name__}: {e}") from None
    if "hidden_states" not in decoded or ids is None or mask is None or "sample_id" not in md:
        raise ShardError(f"record {md.get('sample_id')!r} lacks sample_id, input_ids, loss_mask or hidden_states")
    _check_shapes(md["sample_id"], ids, mask, decoded, meta)
    return Sample(
        sample_id=md["sample_id"],
        input_ids=ids.to(torch.int64),
        loss_mask=mask,
        hidden_states=decoded["hidden_states"],
        final_state=decoded.get("final_state"),
    )


def _state_shapes(ids: torch.Tensor | np.ndarray | None, meta: ShardMeta) -> dict[str, tuple[int, ...]] | None:
    """The shapes a record's states must have, from its token count and its shard's HEAD; None
    where its ids are missing or not one-dimensional (`_check_shapes` then refuses it)."""
    if ids is None or len(ids.shape) != 1:
        return None
    n = ids.shape[0]
    want = {"hidden_states": (n, len(meta.layers), meta.hidden_size)}
    if meta.final_state != "none":
        want["final_state"] = (n, meta.hidden_size)
    return want


def _check_shapes(sid: str, ids: torch.Tensor, mask: torch.Tensor, decoded: dict[str, torch.Tensor],
                  meta: ShardMeta) -> None:
    """A record's tensors agree with each other and with its shard's HEAD: S tokens of ids and
    mask, states [S, layers, hidden], a final state [S, hidden] exactly when the HEAD has one.
    Hashes prove the bytes are the writer's, not that its writer was right (FORMAT.md is written
    for other writers too): a misaligned record would train on the wrong positions."""
    n = ids.shape[0] if ids.dim() == 1 else -1
    want = {"input_ids": (n,), "loss_mask": (n,), **(_state_shapes(ids, meta) or {})}
    got = {"input_ids": tuple(ids.shape), "loss_mask": tuple(mask.shape),
           **{k: tuple(v.shape) for k, v in decoded.items()}}
    if n < 0 or got.keys() != want.keys() or any(got[k] != want[k] for k in want):
        raise ShardError(f"record {sid!r} does not fit its shard's HEAD ({len(meta.layers)} layers, hidden "
                         f"{meta.hidden_size}, final_state {meta.final_state!r}): it holds "
                         + ", ".join(f"{k} {list(v)}" for k, v in got.items()))
    # FORMAT.md's dtypes: other ones decoded all the same (bf16 ids rounded to other tokens), and a mask of 7
    # weighed its token 7 times in the loss
    if ids.dtype != torch.int32 or mask.dtype != torch.uint8:
        raise ShardError(f"record {sid!r} holds input_ids of {ids.dtype} and loss_mask of {mask.dtype}: its format "
                         "says int32 and uint8 (FORMAT.md section 4)")
    if n and int(ids.min()) < 0:  # the writer refuses them (FORMAT.md: ids in [0, 2^31)); an embedding would fail on it
        raise ShardError(f"record {sid!r} holds a negative token id ({int(ids.min())})")
    if n and int(mask.max()) > 1:
        raise ShardError(f"record {sid!r} holds a loss_mask value of {int(mask.max())}: its format says 0 or 1")


def record_metadata(payload: bytes | memoryview) -> dict[str, str]:
    """The string metadata of a record (sample id, tokens, codec parameters), without its tensors.

    By hand: the safetensors library reads a header alone only from a file (`safe_open`). A
    header that is not a JSON object is a `ShardError` (verify then reports the shard bad
    instead of stopping on a struct or attribute error)."""
    try:
        (n,) = struct.unpack_from("<Q", payload, 0)
        header = json.loads(bytes(payload[8 : 8 + n]))
    except (struct.error, ValueError, RecursionError) as e:
        raise ShardError(f"record header does not parse: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise ShardError("record header is not a safetensors header (a JSON object)")
    return header.get("__metadata__", {})


# -- the safetensors blob -----------------------------------------------------------------------

MAX_DIMS, MAX_DIM = 16, 2**40  # beyond any real tensor's: a header that names more is corrupt
_ST_DTYPES = {torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.bfloat16: "BF16",
              torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
_ST_TORCH = {code: dtype for dtype, code in _ST_DTYPES.items()}
_ST_ITEMSIZE = {"U8": 1, "I32": 4, "I64": 8, "BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> list[bytes | memoryview]:
    """A safetensors blob as [header, tensor bytes...], without copying the tensors.

    Byte-compatible with `safetensors.torch.save` readers: a u64 header length, the JSON header
    (offsets of contiguous tensors, no holes) padded with spaces to 8 bytes, then the data. Not
    `safetensors.serialize`: it copies every tensor into one new `bytes` (module docstring).
    """
    layout, parts = {}, []
    for name, t in tensors.items():
        t = t.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
        layout[name] = (_ST_DTYPES[t.dtype], list(t.shape), len(data))
        parts.append(data)
    return [safetensors_header(layout, metadata), *parts]


def safetensors_header(layout: Mapping[str, tuple[str, list[int], int]], metadata: Mapping[str, str] | None) -> bytes:
    """The start of a safetensors file: a u64 length, then the JSON header padded with spaces to 8
    bytes. `layout`: name -> (dtype code, shape, bytes), in the order the data follows, no holes;
    `metadata`: `__metadata__`, left out when None. Shared by the shard records and the trainer's
    streamed checkpoints, which write the data themselves."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    offset = 0
    for name, (code, shape, nbytes) in layout.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def read_safetensors(payload: bytes | memoryview) -> tuple[dict[str, str], dict[str, np.ndarray | torch.Tensor]]:
    """(metadata, tensors) of a safetensors blob, checked as strictly as the library checks it.

    Nothing large is copied: U8 tensors (the codecs' byte planes and zstd frames) come back as
    read-only numpy views into `payload`. The others (small ones, or raw bf16 that the caller would
    copy anyway) are copied into torch tensors: in a shard they are unaligned. ValueError if the
    blob is malformed. Not `safetensors.deserialize`: it takes only `bytes` and copies every tensor
    out (module docstring).
    """
    buf = memoryview(payload)
    if len(buf) < 8:
        raise ValueError(f"a safetensors blob needs at least 8 bytes, got {len(buf)}")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > len(buf) - 8:
        raise ValueError(f"header length {n} exceeds the {len(buf)}-byte blob")
    data = buf[8 + n :]
    md, layout = safetensors_layout(bytes(buf[8 : 8 + n]), len(data), _ST_ITEMSIZE)
    tensors: dict[str, np.ndarray | torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in layout.items():
        view = data[begin:end]
        if dtype == "U8":
            tensors[name] = np.frombuffer(view, dtype=np.uint8).reshape(shape)
        elif begin == end:
            tensors[name] = torch.empty(shape, dtype=_ST_TORCH[dtype])
        else:
            tensors[name] = torch.frombuffer(bytearray(view), dtype=_ST_TORCH[dtype]).reshape(shape)
    return md, tensors


def safetensors_layout(header: bytes, data_len: int, itemsize: Mapping[str, int]
                       ) -> tuple[dict[str, str], dict[str, tuple[str, list[int], int, int]]]:
    """A safetensors header checked as strictly as the library checks it: (metadata, name -> (dtype
    code, shape, begin, end) within the `data_len` bytes after it), the tensors covering the data
    with no overlap and no hole, each dtype one of `itemsize`'s. ValueError if it is malformed.
    Shared by the shard records (a blob in memory) and the trainer's checkpoints (read tensor by
    tensor from the store), each with its own dtype table."""
    try:
        header = json.loads(header)
    except RecursionError:
        raise ValueError("the safetensors header is JSON nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    md = header.pop("__metadata__", None) or {}
    if not isinstance(md, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise ValueError("__metadata__ must map strings to strings")
    layout: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"tensor {name!r}: malformed header entry {info!r}") from None
        if not isinstance(dtype, str) or dtype not in itemsize:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        # bounded: a tensor of no bytes may name any dimensions, and torch cannot make one of 2**63
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d < MAX_DIM
                                                                           for d in shape):
            raise ValueError(f"tensor {name!r}: bad shape {reprlib.repr(shape)}")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= data_len):
            raise ValueError(f"tensor {name!r}: data_offsets {[begin, end]} outside the {data_len}-byte data")
        if end - begin != math.prod(shape) * itemsize[dtype]:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes cannot hold {dtype} {shape}")
        layout[name] = (dtype, shape, begin, end)
    pos = 0
    for _, _, begin, end in sorted(layout.values(), key=lambda e: (e[2], e[3])):
        if begin != pos:
            raise ValueError(f"tensor data overlaps or leaves a hole at byte {pos} of the data section")
        pos = end
    if pos != data_len:
        raise ValueError(f"the tensors cover {pos} of the {data_len} data bytes")
    return md, layout
