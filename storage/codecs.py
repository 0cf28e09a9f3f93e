"""Hidden-state codecs: how one record's bf16 activations become bytes in a shard.

A codec turns a bf16 tensor ``[S, ...]`` (S tokens first, e.g. ``[S, layers, hidden]``) into a
few plain tensors (safetensors can store them; compressed bytes are ``uint8``) plus string
metadata, and back. No pickle anywhere.

Why byte planes (``bf16-zstd``): of a bf16 value's two bytes, the high one holds the sign and 7
of the 8 exponent bits, the low one the last exponent bit and the 7 mantissa bits. Hidden states
have a narrow exponent range, so the high byte is very compressible (~2.5x), while the low byte
is close to uniform noise (7.87 of 8 bits of entropy on SmolLM2). zstd on the interleaved bytes
mixes the two and gets ~1.25x; split into planes, zstd on the high plane alone gets ~1.42-1.45x
(near the lossless limit) and we skip the incompressible low plane entirely, which is also what
makes it fast. Higher zstd levels compress these planes *worse* (measured); a level-1 variant
with a tiny hash table is both faster and no worse (see ``_ZSTD_PARAMS``).

``fp8`` is lossy: e4m3 with a per-(token, layer) fp32 scale (token 0 has activations ~500x the
typical ones, so one scale per tensor would wipe out everything else), then zstd. Its
metadata carries the exact squared error so a shard can report its relative error.
"""

from __future__ import annotations

import abc
import contextlib
import math
import threading
from typing import Callable, Iterator, Mapping

import numpy as np
import torch
import zstandard

from layertap.storage.codec_names import CODEC_NAMES, DEFAULT_CODEC

__all__ = ["CODEC_NAMES", "DEFAULT_CODEC", "Codec", "get_codec"]


FP8_MAX = 448.0  # largest finite float8_e4m3fn
_CHUNK_ELEMS = 1 << 18  # work in blocks of ~256K elements: temporaries stay in cache

# zstd level 1's strategy and window, but a 256-entry hash table: the high-byte plane and fp8
# bytes are mostly entropy-coded (LZ matches are rare), and level 1's 16K-entry table costs cache
# misses for nothing. On SmolLM2 activations: ~2x faster than level 1 compressing, faster
# decompressing, same ratio (fp8 bytes: same too).
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=8, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST)

# python-zstandard raises every libzstd failure as ZstdError; only the message, which carries
# libzstd's error name, tells its allocation failures from corrupt input.
_ZSTD_NO_MEMORY = "Allocation error"

# zstandard contexts are not thread-safe; records are encoded in a thread pool (zstd releases
# the GIL), so every thread gets its own.
_tls = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    if not hasattr(_tls, "cctx"):
        _tls.cctx = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS)
    return _tls.cctx


def _dctx() -> zstandard.ZstdDecompressor:
    if not hasattr(_tls, "dctx"):
        _tls.dctx = zstandard.ZstdDecompressor()
    return _tls.dctx


def _zstd(data: np.ndarray) -> torch.Tensor:
    # Via bytearray: torch warns on read-only bytes; the copy is of the (small) compressed output.
    return torch.from_numpy(np.frombuffer(bytearray(_cctx().compress(data)), dtype=np.uint8))


def _unzstd_chunks(t: torch.Tensor, n: int, what: str, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """Decompress ``t``, which must hold exactly ``n`` bytes, ``chunk`` bytes at a time.

    Yields (offset, bytes) in one reused, cache-sized buffer that the caller consumes while it is
    hot: the decompressed plane is never allocated whole, so decoding needs the output and no
    more. Corrupt data -> ValueError.
    """
    chunk = max(chunk, 1)
    buf = memoryview(np.empty(min(chunk, n), dtype=np.uint8))
    with _frame_reader(t, n, what) as read_into:
        for offset in range(0, n, chunk):
            want = min(chunk, n - offset)
            read_into(buf[:want], offset)
            yield offset, np.frombuffer(buf[:want], dtype=np.uint8)


@contextlib.contextmanager
def _frame_reader(t: torch.Tensor | np.ndarray, n: int, what: str) -> Iterator[Callable[[memoryview, int], None]]:
    """A zstd frame that must hold exactly ``n`` bytes, as ``read_into(view, offset)``, which fills
    ``view`` with the frame's bytes from ``offset`` on (offsets only name them in errors).

    The header's size is checked before anything is decompressed, and the frame must end at ``n``:
    corrupt data, a short frame or a long one -> ValueError naming ``what``; zstd failing to
    allocate -> MemoryError.
    """
    data = _u8(t, what)
    try:
        _check_frame_size(data, n, what)
        with _dctx().stream_reader(data) as reader:

            def read_into(view: memoryview, offset: int) -> None:
                got = 0
                while got < len(view):
                    k = reader.readinto(view[got:])
                    if not k:
                        raise ValueError(f"corrupt {what!r}: ends after {offset + got} of {n} bytes")
                    got += k

            yield read_into
            if reader.read(1):
                raise ValueError(f"corrupt {what!r}: holds more than the {n} bytes its header says")
    except zstandard.ZstdError as e:
        if _ZSTD_NO_MEMORY in str(e):  # out of memory, not corrupt: a caller must not discard the data
            raise MemoryError(f"decompressing {what!r}: {e}") from None
        raise ValueError(f"corrupt {what!r}: {e}") from None


def _check_frame_size(data: np.ndarray, n: int, what: str) -> None:
    """ValueError unless the zstd frame's header says it holds ``n`` bytes: checked before the
    output is allocated, so a frame of a few bytes cannot have gigabytes reserved for it."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupt {what!r}: {e}") from None
    if size != n:
        raise ValueError(f"corrupt {what!r}: the frame holds {size} bytes, the shape needs {n}")


def _u8(t: torch.Tensor | np.ndarray, what: str) -> np.ndarray:
    if isinstance(t, np.ndarray):  # a read-only view into a record (see Codec.decode)
        if t.dtype != np.uint8:
            raise ValueError(f"{what!r} must be uint8, got {t.dtype}")
        return t.reshape(-1)
    if t.dtype != torch.uint8:
        raise ValueError(f"{what!r} must be uint8, got {t.dtype}")
    return t.contiguous().view(-1).numpy()


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise ValueError(f"codecs take bfloat16 tensors, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1:
        raise ValueError("codecs take tensors whose first dim is tokens; got a 0-d tensor")


def _shape_str(shape: torch.Size) -> str:
    return ",".join(str(d) for d in shape)


def _parse_shape(meta: Mapping[str, str]) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in meta["shape"].split(","))
    except (KeyError, ValueError, AttributeError):
        raise ValueError(f"bad or missing 'shape' metadata: {meta.get('shape')!r}") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"bad 'shape' metadata: {meta['shape']!r}")
    return shape


def _get(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"missing tensor {key!r} (have {sorted(tensors)})")
    return tensors[key]


class Codec(abc.ABC):
    """Encodes a bf16 tensor into safetensors-storable tensors + str metadata, and back."""

    name: str  # in HEAD `codec` and every record's metadata
    lossless: bool
    # raw bf16 bytes / stored bytes, measured on SmolLM2: what the planner sizes shards with and
    # `layertap estimate` assumes unless it measures
    ratio: float

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``x``: bf16 ``[S, ...]``. Returns (tensors keyed by short suffix, metadata)."""

    @abc.abstractmethod
    def decode(self, tensors: Mapping[str, torch.Tensor | np.ndarray], meta: Mapping[str, str]) -> torch.Tensor:
        """Inverse of ``encode``: a bf16 tensor of the original shape; ValueError if corrupt.

        uint8 tensors may be given as numpy arrays, e.g. read-only views into a record's bytes:
        decoding reads them in place and never writes to them or returns memory they share.
        """


class Bf16(Codec):
    """Raw bf16: no CPU cost; for fast local disks or data already compressed elsewhere."""

    name = "bf16"
    lossless = True
    ratio = 1.0

    def encode(self, x):
        _check_input(x)
        # A copy, not a view: the caller may reuse x's buffer, and safetensors refuses tensors
        # that share storage (several records sliced from one batch).
        return {"raw": x.clone(memory_format=torch.contiguous_format)}, {"shape": _shape_str(x.shape)}

    def decode(self, tensors, meta):
        shape = _parse_shape(meta)
        raw = _get(tensors, "raw")
        if raw.dtype != torch.bfloat16 or tuple(raw.shape) != shape:
            raise ValueError(f"'raw' is {raw.dtype} {tuple(raw.shape)}, metadata says bf16 {shape}")
        return raw


class Bf16Zstd(Codec):
    """Lossless byte planes: zstd on the high (sign/exponent) bytes, low bytes stored raw.

    The high plane is stored layer-major (``[L, S, H]`` for an ``[S, L, H]`` input): each capture
    layer has its own range of magnitudes, so grouping a layer's bytes lets zstd's entropy
    tables fit them (measured on SmolLM2: 1.461x vs 1.424x token-major, and faster both ways).
    """

    name = "bf16-zstd"
    lossless = True
    ratio = 1.45

    def encode(self, x):
        _check_input(x)
        u16 = x.contiguous().view(torch.int16).numpy().view(np.uint16)
        hi = np.empty(_layer_major_shape(u16.shape), dtype=np.uint8)
        np.right_shift(_layer_major(u16), 8, out=hi, casting="unsafe")  # no 16-bit temporary
        lo = torch.from_numpy(u16.reshape(-1).astype(np.uint8))  # truncating cast: the low byte
        return {"hi.zst": _zstd(hi.reshape(-1)), "lo": lo}, {"shape": _shape_str(x.shape)}

    def decode(self, tensors, meta):
        shape = _parse_shape(meta)
        n = math.prod(shape)
        lo = _u8(_get(tensors, "lo"), "lo")
        if lo.size != n:
            raise ValueError(f"corrupt 'lo': {lo.size} bytes, the shape {shape} needs {n}")
        hi = _unzstd(_get(tensors, "hi.zst"), n, "hi.zst").reshape(_layer_major_shape(shape))
        out = np.empty(shape, dtype=np.uint16)
        np.left_shift(_layer_major(hi), 8, out=out, dtype=np.uint16)  # (hi << 8) | lo, back to [S, L, ...]
        np.bitwise_or(out, lo.reshape(shape), out=out)
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def _layer_major(a: np.ndarray) -> np.ndarray:
    """A view with the first two axes swapped ([S, L, ...] -> [L, S, ...]); 1-D/2-D unchanged."""
    return a.swapaxes(0, 1) if a.ndim >= 3 else a


def _layer_major_shape(shape) -> tuple[int, ...]:
    shape = tuple(shape)
    return (shape[1], shape[0], *shape[2:]) if len(shape) >= 3 else shape


def _unzstd(t: torch.Tensor, n: int, what: str) -> np.ndarray:
    """Decompress ``t``, which must hold exactly ``n`` bytes, into a new array; corrupt data -> ValueError.

    Read into a numpy array, not returned as ``bytes`` by ``decompress``: numpy backs large arrays
    with huge pages, while a large ``bytes`` is page-faulted in 4 KiB at a time. For a 183 MB
    sample (the size of a 4K-token one of a 27B target) that took bf16-zstd decoding from ~1.0 to
    ~1.1-1.3 GB/s; small samples decode as fast as before.
    """
    out = np.empty(n, dtype=np.uint8)
    with _frame_reader(t, n, what) as read_into:
        read_into(memoryview(out), 0)
    return out


def _dequant(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3 codes [R, H] (uint8) x fp32 scales [R, 1] -> ``out`` (bf16): one float32 multiply, RNE.

    Shared by decode and the encoder's error stats. torch's fp8 -> float cast is slow on CPU
    (~400 MB/s), so the codes go through float16 by moving bits: the code's 7 magnitude bits
    shifted left by 7 are a float16 worth exactly value / 256, normals and subnormals alike.
    ``v16 * (scale * 256)`` is then the same float32 product (scale * 256 cannot overflow:
    scale <= bf16 max / 448), rounded once into bf16 by the multiply's output cast.
    """
    v = q.view(torch.int8).to(torch.int16)  # sign-extended: s s s s s s s s | s e e e e m m m
    v <<= 7  # s s e e e e m m m 0 ...: float16 layout, with a sign copy on the exponent's top bit
    v &= ~0x4000  # which we clear
    return torch.mul(v.view(torch.float16), scale * 256, out=out)


class Fp8(Codec):
    """Lossy: e4m3 with one fp32 scale per (token, layer) row, then zstd (~2.3x, <1% error)."""

    name = "fp8"
    lossless = False
    ratio = 2.3

    def encode(self, x):
        _check_input(x)
        shape = x.shape
        h = shape[-1]
        rows = x.contiguous().view(math.prod(shape[:-1]), h)
        q = torch.empty(rows.shape, dtype=torch.uint8)
        scale = torch.ones((rows.shape[0], 1), dtype=torch.float32)
        sq_err = sq_norm = 0.0
        step = max(1, _CHUNK_ELEMS // max(h, 1))
        for i in range(0, rows.shape[0] if h else 0, step):
            xb = rows[i : i + step]
            xf = xb.float()
            amax = xf.abs().amax(dim=1, keepdim=True)
            if not torch.isfinite(amax).all():
                raise ValueError("fp8 codec needs finite values (got inf/nan); use a lossless codec")
            s = torch.where(amax > 0, amax / FP8_MAX, 1.0)
            # |xf / s| <= 448 up to a rounding; the clamp keeps torch versions whose fp8 cast
            # does not saturate from turning 448.0001 into NaN.
            y = torch.div(xf, s).clamp_(-FP8_MAX, FP8_MAX)
            qc = q[i : i + step]
            qc.copy_(y.to(torch.float8_e4m3fn).view(torch.uint8))
            scale[i : i + step] = s
            err = torch.sub(_dequant(qc, s, torch.empty_like(xb)), xf, out=y)
            # Row sums in float32 (exact enough for 576..5120 values), the total in float64; rows
            # whose squares leave float32's range (a sum of H squares overflows past |x| ~
            # sqrt(3.4e38 / H): 2.6e17 at 5,120; below ~1e-18 it underflows to 0: NaN, or a false
            # relative error of 0.0 in the footer) are summed in float64.
            if bool(((amax > math.sqrt(3.0e38 / max(1, xf.shape[-1]))) | ((amax > 0) & (amax < 1e-18))).any()):
                err, xf = err.double(), xf.double()
            sq_err += torch.linalg.vecdot(err, err).sum(dtype=torch.float64).item()
            sq_norm += torch.linalg.vecdot(xf, xf).sum(dtype=torch.float64).item()
        tensors = {"fp8.zst": _zstd(q.view(-1).numpy()), "scale": scale.view(shape[:-1])}
        meta = {"shape": _shape_str(shape), "sq_err": repr(sq_err), "sq_norm": repr(sq_norm)}
        return tensors, meta

    def decode(self, tensors, meta):
        shape = _parse_shape(meta)
        scale = _get(tensors, "scale")
        if scale.dtype != torch.float32 or tuple(scale.shape) != shape[:-1]:
            raise ValueError(f"'scale' is {scale.dtype} {tuple(scale.shape)}, metadata needs "
                             f"float32 {shape[:-1]}")
        n, h = math.prod(shape), shape[-1]
        _check_frame_size(_u8(_get(tensors, "fp8.zst"), "fp8.zst"), n, "fp8.zst")  # before the output is allocated
        out = torch.empty(shape, dtype=torch.bfloat16)
        rows, scale = out.view(-1, max(h, 1)), scale.reshape(-1, 1)
        step = max(1, _CHUNK_ELEMS // max(h, 1))
        for i, qc in _unzstd_chunks(_get(tensors, "fp8.zst"), n, "fp8.zst", step * h):
            r = i // h
            q = torch.from_numpy(qc).view(-1, h)
            _dequant(q, scale[r : r + q.shape[0]], rows[r : r + q.shape[0]])
        return out


_CODECS: dict[str, Codec] = {c.name: c for c in (Bf16(), Bf16Zstd(), Fp8())}
assert tuple(_CODECS) == CODEC_NAMES, "storage.codec_names lists every codec, in this order"


def get_codec(name: str) -> Codec:
    """The codec called ``name``; ValueError listing the valid names otherwise."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODEC_NAMES)}") from None
