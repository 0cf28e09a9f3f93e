"""Hidden-state codecs: bit-exact lossless round trips, fp8 error bounds, ratios, corrupt input."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zstandard
from safetensors.torch import load, save

from layertap.extract.estimate import DEFAULT_RATIOS
from layertap.storage.codecs import CODEC_NAMES, DEFAULT_CODEC, get_codec

LOSSLESS = ("bf16", "bf16-zstd")


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    """Encode, store with safetensors (as a shard would), load, decode."""
    codec = get_codec(name)
    tensors, meta = codec.encode(x)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    loaded = load(save(tensors, metadata=meta))
    return codec.decode(loaded, meta)


def synthetic(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    if x.numel():
        x.view(-1)[0] = 25_000.0  # a token-0-like outlier
    return x.bfloat16()


# 300x3x1001 spans several of the codecs' 256K-element decode chunks, the last one partial.
SHAPES = [(0, 5, 576), (1, 1, 1), (3, 2, 7), (17, 5, 576), (300, 3, 1001), (5,), (4, 0)]


@pytest.fixture(scope="module")
def real():
    from activations import smollm2_activations

    return smollm2_activations(n_samples=16, max_tokens=256)


def test_registry():
    assert set(CODEC_NAMES) == {"bf16", "bf16-zstd", "fp8"}
    assert DEFAULT_CODEC == "bf16-zstd" and get_codec(DEFAULT_CODEC).lossless
    for name in CODEC_NAMES:
        assert get_codec(name).name == name
    assert not get_codec("fp8").lossless
    # each codec's planning ratio, declared once on its class, is what the planner and estimator assume
    assert {n: get_codec(n).ratio for n in CODEC_NAMES} == DEFAULT_RATIOS == {"bf16": 1.0, "bf16-zstd": 1.45, "fp8": 2.3}


def test_unknown_codec_names_valid_ones():
    with pytest.raises(ValueError, match=r"'zstd9'.*bf16, bf16-zstd, fp8"):
        get_codec("zstd9")


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16])
def test_rejects_non_bf16(name, dtype):
    with pytest.raises(ValueError, match="bfloat16"):
        get_codec(name).encode(torch.zeros(4, 2, 3, dtype=dtype))


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_lossless_synthetic_bit_exact(name, shape):
    x = synthetic(*shape)
    y = roundtrip(name, x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(bits(y), bits(x))


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_every_bit_pattern(name):
    """All 65,536 bf16 patterns, NaNs with payloads, +-inf and -0 included, survive bit-exactly."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(256, 2, 128)
    assert torch.isnan(x).any() and torch.isinf(x).any()
    assert torch.equal(bits(roundtrip(name, x)), bits(x))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_contiguous_input(name):
    x = synthetic(6, 5, 32).transpose(0, 1)  # [5, 6, 32], strided
    y = roundtrip(name, x)
    assert y.shape == x.shape
    if get_codec(name).lossless:
        assert torch.equal(bits(y), bits(x.contiguous()))
    else:
        assert torch.allclose(y.float(), x.float(), rtol=0.07, atol=1.0)


def test_raw_does_not_alias_input():
    x = synthetic(3, 2, 8)
    tensors, _ = get_codec("bf16").encode(x)
    before = tensors["raw"].clone()
    x.zero_()
    assert torch.equal(bits(tensors["raw"]), bits(before))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_synthetic(shape):
    x = synthetic(*shape)
    tensors, meta = get_codec("fp8").encode(x)
    assert tensors["scale"].dtype == torch.float32 and tensors["scale"].shape == x.shape[:-1]
    y = get_codec("fp8").decode(load(save(tensors)), meta)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    if x.numel():
        # e4m3 keeps 3 mantissa bits (relative error <= 2^-4, plus bf16 rounding); below its
        # smallest normal (2^-6 x scale) the absolute step is 2^-9 x the row's scale.
        bound = x.float().abs() * 0.07 + tensors["scale"].unsqueeze(-1) * 2**-9
        assert torch.all((y.float() - x.float()).abs() <= bound)


def test_fp8_per_token_scale_keeps_small_tokens():
    """An outlier token must not flush the other tokens of the same layer to zero."""
    x = torch.ones(2, 1, 8)
    x[0] = 25_000.0
    x[1] *= 0.01
    y = roundtrip("fp8", x.bfloat16()).float()
    assert torch.allclose(y, x, rtol=0.07)


def test_fp8_decode_every_code():
    """Decoding is bf16(float32(e4m3 value) * scale) for all 254 finite codes, tiny to huge scales."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes.repeat(3, 1)
    scale = torch.tensor([1.0, 3.7e-3, 5.5e30])
    frame = zstandard.ZstdCompressor().compress(q.numpy().tobytes())
    tensors = {"fp8.zst": torch.frombuffer(bytearray(frame), dtype=torch.uint8), "scale": scale}
    y = get_codec("fp8").decode(tensors, {"shape": "3,254"})
    expected = (q.view(torch.float8_e4m3fn).float() * scale[:, None]).to(torch.bfloat16)
    assert torch.equal(bits(y), bits(expected))


def test_fp8_rejects_non_finite():
    x = synthetic(3, 2, 8)
    x[1, 1, 3] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        get_codec("fp8").encode(x)


def test_fp8_all_zero_rows():
    x = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    tensors, meta = get_codec("fp8").encode(x)
    assert torch.equal(tensors["scale"], torch.ones(3, 2))
    assert float(meta["sq_err"]) == 0.0 and float(meta["sq_norm"]) == 0.0
    assert torch.equal(get_codec("fp8").decode(tensors, meta), x)


# --- corrupt or mismatched data -------------------------------------------------------------


def _encoded(name: str):
    return get_codec(name).encode(synthetic(4, 3, 16))


def _corruptions(name):
    """(description, tensors, meta) triples that decode must reject."""
    tensors, meta = _encoded(name)
    out = [
        ("shape too big", tensors, {**meta, "shape": "5,3,16"}),
        ("shape garbage", tensors, {**meta, "shape": "4,x,16"}),
        ("shape missing", tensors, {k: v for k, v in meta.items() if k != "shape"}),
    ]
    for key, t in tensors.items():
        out.append((f"{key} missing", {k: v for k, v in tensors.items() if k != key}, meta))
        out.append((f"{key} truncated", {**tensors, key: t.reshape(-1)[:-3]}, meta))
    if name == "bf16":
        out.append(("raw wrong dtype", {"raw": tensors["raw"].view(torch.int16)}, meta))
    else:
        zkey = "hi.zst" if name == "bf16-zstd" else "fp8.zst"
        out.append(("not zstd", {**tensors, zkey: torch.arange(40, dtype=torch.uint8)}, meta))
        out.append(("zstd of wrong size", {**tensors, zkey: get_codec(name).encode(
            synthetic(2, 3, 16))[0][zkey]}, meta))
    if name == "fp8":
        out.append(("scale wrong dtype", {**tensors, "scale": tensors["scale"].double()}, meta))
    return out


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_corrupt_data_raises_value_error(name):
    for what, tensors, meta in _corruptions(name):
        with pytest.raises(ValueError):
            get_codec(name).decode(tensors, meta)
            pytest.fail(f"{name}: decode accepted {what}")


def test_zstd_failing_to_allocate_is_a_memory_error_not_corruption():
    """libzstd reports a failed allocation as one more ZstdError; taken for corrupt data, it had
    `verify` delete an intact shard. A child process decodes a frame with an 8 MiB window (any
    valid frame decodes), which zstd must buffer, with room for the decoder's output but not for
    zstd's buffers; then, unlimited, the same record decodes. (A fixed mmap threshold keeps glibc
    from serving zstd out of freed heap, which the limit would not see.)"""
    code = textwrap.dedent("""
        import resource, torch, zstandard
        from layertap.storage.codecs import get_codec
        fp8 = get_codec("fp8")
        tensors, meta = fp8.encode(torch.randn(2048, 4, 1024).bfloat16())  # 8 MiB of codes
        want = fp8.decode(tensors, meta)  # this thread's decoder, used on a frame as the writer makes them
        codes = zstandard.ZstdDecompressor().decompress(tensors["fp8.zst"].numpy())
        wide = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(window_log=23))
        tensors["fp8.zst"] = torch.frombuffer(bytearray(wide.compress(codes)), dtype=torch.uint8)
        vm = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (20 << 20), resource.RLIM_INFINITY))  # 16 MiB output + 4
        try:
            fp8.decode(tensors, meta)
            print("decoded")
        except Exception as e:
            print(type(e).__name__, e)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(torch.equal(fp8.decode(tensors, meta).view(torch.int16), want.view(torch.int16)))
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072"))
    assert child.returncode == 0, child.stderr
    limited, unlimited = child.stdout.splitlines()
    assert limited.startswith("MemoryError") and "'fp8.zst'" in limited and "Allocation error" in limited
    assert unlimited == "True"


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_thread_pool_matches_serial(name):
    """Codecs keep per-thread zstd contexts: concurrent use must give the serial results."""
    xs = [synthetic(64, 5, 96, seed=i) for i in range(16)]
    codec = get_codec(name)
    serial = [codec.decode(*codec.encode(x)) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda x: codec.decode(*codec.encode(x)), xs))
    for a, b in zip(serial, parallel):
        assert torch.equal(bits(a), bits(b))


# --- real SmolLM2 activations ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_real_bit_exact(real, name):
    for x in real:
        assert torch.equal(bits(roundtrip(name, x)), bits(x))


@pytest.mark.slow
@pytest.mark.parametrize("name, min_ratio", [("bf16-zstd", 1.40), ("fp8", 2.2)])
def test_ratio_real(real, name, min_ratio):
    raw = sum(x.numel() * 2 for x in real)
    encoded = sum(nbytes(get_codec(name).encode(x)[0]) for x in real)
    assert raw / encoded >= min_ratio


@pytest.mark.slow
def test_fp8_error_real(real):
    codec = get_codec("fp8")
    sq_err = sq_norm = meta_err = meta_norm = 0.0
    for x in real:
        tensors, meta = codec.encode(x)
        y = codec.decode(load(save(tensors)), meta)
        d = y.double() - x.double()
        e, n = d.square().sum().item(), x.double().square().sum().item()
        assert float(meta["sq_err"]) == pytest.approx(e, rel=1e-4)
        assert float(meta["sq_norm"]) == pytest.approx(n, rel=1e-4)
        sq_err, sq_norm = sq_err + e, sq_norm + n
        meta_err, meta_norm = meta_err + float(meta["sq_err"]), meta_norm + float(meta["sq_norm"])
    assert math.sqrt(sq_err / sq_norm) <= 0.01
    assert math.sqrt(meta_err / meta_norm) == pytest.approx(math.sqrt(sq_err / sq_norm), rel=1e-4)
