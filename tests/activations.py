"""The real SmolLM2-135M-Instruct for tests and benchmarks, and its hidden states on ShareGPT.

The model is the folder layertap converts its GGUF into once (layertap's cache, see
extract/embedded.py); hidden states are cached as safetensors files (never pickle), keyed by the
arguments, under ``$LAYERTAP_TEST_CACHE`` (default ``~/.cache/layertap-tests``).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or from bench/
from layertap.extract.embedded import sharegpt_conversations  # noqa: E402

HIDDEN = 576
_ROLES = {"human": "user", "user": "user", "system": "system"}  # everything else: assistant
_CACHE_VERSION = 1  # bump when the rendering or the capture changes


def _cache_dir() -> Path:
    return Path(os.environ.get("LAYERTAP_TEST_CACHE", Path.home() / ".cache" / "layertap-tests"))


@functools.lru_cache(maxsize=None)
def smollm2_folder() -> str:
    """SmolLM2-135M-Instruct as a plain HF folder (fp32 safetensors, tokenizer, chat template):
    the one layertap converts the embedded GGUF into once (extract/embedded.py), loaded in ~1 s.
    Tests of the GGUF path itself set LAYERTAP_CACHE_DIR=off."""
    from layertap.extract.embedded import smollm2_folder as converted

    folder = converted()
    assert folder is not None, "layertap's cache is off (LAYERTAP_CACHE_DIR); the tests need the converted SmolLM2"
    return folder


def _compute(n_samples: int, max_tokens: int, layers: tuple[int, ...]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    out = []
    for record in sharegpt_conversations(None):
        messages = [{"role": _ROLES.get(m["from"], "assistant"), "content": m["value"]}
                    for m in record["conversations"] if m.get("value")]
        if not messages:
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_tokens,
                        return_tensors="pt").input_ids
        with torch.inference_mode():
            # The base model only: the 49k-vocab LM head is not needed for hidden states.
            hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        out.append(torch.stack([hs[k + 1][0] for k in layers], dim=1).contiguous())  # [S, L, H]
        if len(out) == n_samples:
            break
    return out


def smollm2_activations(n_samples: int = 16, max_tokens: int = 256,
                        layers: tuple[int, ...] = (1, 8, 15, 22, 27)) -> list[torch.Tensor]:
    """Per conversation, a bf16 ``[S, len(layers), 576]`` of decoder-layer outputs (HF index k+1).

    The first ``n_samples`` non-empty ShareGPT conversations, rendered with the chat template
    and truncated to ``max_tokens`` tokens.
    """
    layers = tuple(int(k) for k in layers)
    key = f"smollm2-v{_CACHE_VERSION}-n{n_samples}-t{max_tokens}-l{'_'.join(map(str, layers))}"
    path = _cache_dir() / f"{key}.safetensors"
    if path.exists():
        data = load_file(path)
        return [data[str(i)] for i in range(len(data))]
    samples = _compute(n_samples, max_tokens, layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file({str(i): t for i, t in enumerate(samples)}, str(tmp))
    os.replace(tmp, path)  # atomic: concurrent test processes never read a half-written cache
    return samples


def smollm2_activations_cat(n_samples: int = 16, max_tokens: int = 256,
                            layers: tuple[int, ...] = (1, 8, 15, 22, 27)) -> torch.Tensor:
    """All samples concatenated along tokens: one bf16 ``[sum S, len(layers), 576]``, for benches."""
    return torch.cat(smollm2_activations(n_samples, max_tokens, layers), dim=0)
