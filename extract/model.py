"""The target model, cut down to the layers a drafter needs, with hooks that capture them.

Layer convention (``decoder_output``, storage/identity.py's LAYER_CONVENTION, recorded in every
shard and manifest): layer ``k`` is the OUTPUT of decoder layer ``k``,
which is HF ``outputs.hidden_states[k + 1]`` (index 0 is the embedding output), with one
exception: HF's last entry ``hidden_states[N]`` is taken AFTER the final norm, while our layer
``N - 1`` is the decoder layer's own output (pre-norm); ask for ``final_state="postnorm"`` to get
HF's. vLLM and SGLang count "before layer i", so their ids are ours + 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layertap.extract.config import check_layers
from layertap.extract.embedded import checkpoint
from layertap.extract.fused_norms import fuse_norms
from layertap.extract.fused_projections import fuse_projections
from layertap.extract.split_conv import split_conv
from layertap.extract.inputs import check_template_kwargs
from layertap.extract.kernels import keep_cpu_on_reference, log_kernel_paths, use_fla_short_conv
from layertap.storage.errors import ConfigError, InputError, MissingInput
from layertap.storage.identity import FINAL_STATES, FinalState

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_layers(num_layers: int, n: int = 5) -> list[int]:
    """DFlash's default capture layers (``build_target_layer_ids``): ``n`` ids spread from 1 to N-3.

    Python's ``round`` (half to even) on purpose: it is what DFlash trains with, and an id off by
    one would give the drafter features it was not trained on.
    """
    if n < 1:
        raise ConfigError(f"need at least one capture layer, got n={n}")
    if num_layers < 4:
        raise InputError(f"DFlash's layer spacing needs at least 4 layers, the model has {num_layers}")
    if n == 1:
        return [num_layers // 2]
    first, last = 1, num_layers - 3
    ids = [int(round(first + i * (last - first) / (n - 1))) for i in range(n)]
    return sorted(set(ids))  # shallow models have fewer distinct layers than n


@dataclass(slots=True)
class Target:
    """A loaded target: the model, its tokenizer, and what a shard header records about them."""

    model: nn.Module
    tokenizer: Any
    info: dict[str, Any]


def padding_id(target: Target) -> int:
    """The id that fills a batch's padded positions: the tokenizer's pad token where the model
    can embed it, else 0. Padded positions are masked and never stored, so any id the model
    embeds will do; a pad token added to the tokenizer without resizing the embeddings (a common
    `add_special_tokens({"pad_token": ...})`) failed every shard with an IndexError naming
    nothing (on CUDA a device-side assert that takes the worker down)."""
    pad = target.tokenizer.pad_token_id
    return pad if pad is not None and 0 <= pad < int(target.info["vocab_size"]) else 0


def refuse_gguf_as_folder(path: str) -> None:
    """`MissingInput` naming --model DIR --gguf-file NAME for a --model that is a GGUF file itself
    (each command said the folder was missing, or had no config.json)."""
    if path.endswith(".gguf") and os.path.isfile(path):
        folder, name = os.path.split(os.path.abspath(path))
        raise MissingInput(f"--model {path!r} is a GGUF file: pass the folder that holds it as --model and the file's "
                           f"name as --gguf-file (--model {folder} --gguf-file {name})")


def load_target(path: str, gguf_file: str | None = None, dtype: torch.dtype = torch.bfloat16,
                attn_implementation: str = "auto", device: str | torch.device = "cpu",
                weights: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None) -> Target:
    """Load a causal LM and its tokenizer from a local folder (optionally a GGUF file in it).

    A ``org/name`` hub id is accepted too and resolved by ``transformers`` (its cache, or the
    hub unless ``HF_HUB_OFFLINE=1``). ``weights=False`` builds the model on the meta device from
    its config alone: enough to plan a run (same ``info``, same layer checks) in a second, where
    a 27B checkpoint would take minutes and 54 GB of memory to load; ``chat_template_kwargs`` are
    checked against the chat template before the weights load. ``attn_implementation``
    "auto": transformers' choice, sdpa where the model's class supports it, else eager (Gemma 2
    refuses sdpa).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    refuse_gguf_as_folder(path)
    local = os.path.exists(path)
    if not local and not _HUB_ID.match(path):
        raise MissingInput(f"target model {path!r} does not exist; give a model folder or an org/name hub id")
    if gguf_file is not None and local and not os.path.isfile(os.path.join(path, gguf_file)):
        raise MissingInput(f"GGUF file {gguf_file!r} not found in {path!r}")
    if gguf_file is None and local and not os.path.isfile(os.path.join(path, "config.json")):
        # transformers fails deep in the tokenizer's backend (a ValueError traceback) on such a folder
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf")) if os.path.isdir(path) else []
        raise MissingInput(f"the target {path!r} has no config.json: give a model folder (config.json, tokenizer, "
                           "safetensors weights)" + (f"; it holds {', '.join(ggufs)}: pass --gguf-file {ggufs[0]}"
                                                     if ggufs else ""))
    source, given_gguf = path, gguf_file
    path, gguf_file = checkpoint(path, gguf_file)  # the embedded SmolLM2: its converted folder
    kw = gguf_kwargs(gguf_file) if gguf_file else {}
    attn = None if attn_implementation == "auto" else attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
        check_template_kwargs(tokenizer, chat_template_kwargs)  # a misspelt setting: before minutes of loading
        if weights:
            # use_kernels=False: layertap picks the kernels itself (below) and names them. transformers >= 5.25
            # otherwise asks the `kernels` package for Hub kernels at every load, and refuses to load at all
            # where that package is missing or at a version it does not accept (another package's pin)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn,
                                                         use_kernels=False, **kw)
        else:
            config = AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    except ConfigError:  # the settings given, not the model
        raise
    except (OSError, ValueError, ImportError) as e:  # ValueError: a tokenizer transformers cannot build from the folder
        # "FlashAttention2 has been toggled on, but ..." (its package missing), "`attn_implementation="x"` is
        # not supported", "... does not support an attention implementation through ... sdpa"
        if attn is not None and ("attention" in str(e).lower() or "attn_implementation" in str(e)):
            raise InputError(f"the target {source!r} cannot run attention implementation {attn!r} (--attn-implementation"
                             f"): {str(e).split('. ')[0]}. Pass --attn-implementation auto (the default: sdpa where "
                             "the model supports it, else eager) or eager") from e
        raise InputError(f"could not load target model {source!r}: {e}") from e
    model.to(device if weights else "meta").eval()
    model.requires_grad_(False)
    if weights:
        keep_cpu_on_reference(model)
        if str(device).startswith("cuda"):
            use_fla_short_conv(model)
            if os.environ.get("LAYERTAP_FUSED_NORMS", "1") != "0":
                fuse_norms(decoder_of(model), list(decoder_of(model).layers))
        if os.environ.get("LAYERTAP_FUSED_PROJECTIONS", "0") == "1":  # opt-in until an H200 run shows it wins
            fuse_projections(list(decoder_of(model).layers))
        if os.environ.get("LAYERTAP_SPLIT_CONV", "0") == "1":  # the same
            split_conv(list(decoder_of(model).layers))
        log_kernel_paths(model, str(device))
    config = decoder_of(model).config
    # the checkpoint's folder: a local one, or the hub cache's snapshot that a hub id resolved to
    folder = source if local else _hub_snapshot(source, given_gguf or "config.json")
    config_file = os.path.join(folder, "config.json") if folder is not None and given_gguf is None else None
    info = {
        "model": source,
        "gguf_file": given_gguf,
        "revision": _revision(folder) if folder is not None else None,
        "model_config_sha256": _file_sha256(config_file) if config_file is not None else None,  # a GGUF holds its own
        "model_type": config.model_type,
        "hidden_size": int(config.hidden_size),
        "num_layers": int(config.num_hidden_layers),
        "vocab_size": int(config.vocab_size),
        "tokenizer": tokenizer.name_or_path if path == source else source,
        "tokenizer_vocab_size": len(tokenizer),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": chat_template_sha256(tokenizer),
        "dtype": str(dtype).removeprefix("torch."),
    }
    return Target(model, tokenizer, info)


def gguf_kwargs(gguf_file: str) -> dict[str, Any]:
    """`from_pretrained` arguments for the weights of a GGUF checkpoint: transformers >= 5.2x may
    keep GGUF blocks packed and compute in float32 where a kernel exists; unpack instead, so the
    states are the same dense model's everywhere (older versions always unpack)."""
    kw: dict[str, Any] = {"gguf_file": gguf_file}
    try:
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    return kw


def short_sha256(data: bytes) -> str:
    """The first 16 hex digits of `data`'s SHA-256: enough to tell two versions of a file apart."""
    return hashlib.sha256(data).hexdigest()[:16]


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return short_sha256(f.read())


def tokenizer_sha256(tokenizer: Any) -> str:
    """What decides the token ids besides the chat template: the vocabulary (added tokens and
    their ids included) and the special tokens a template writes (``bos_token`` ...). Hashed as
    content, not files or the library's serialization, so that one tokenizer hashes the same from
    a folder, the hub or a GGUF, under any transformers version; merges and normalizer are not
    covered (a tokenizer that changes them keeps its vocabulary only in contrived cases)."""
    return short_sha256(json.dumps([tokenizer.get_vocab(), tokenizer.special_tokens_map], sort_keys=True).encode())


def chat_template_sha256(tokenizer: Any) -> str | None:
    """The tokenizer's chat template (a string, or a dict of named ones), which renders chat rows
    into the text that is tokenized; None if it has none (only pre-tokenized rows can be read)."""
    template = tokenizer.chat_template
    if not template:
        return None
    return short_sha256((template if isinstance(template, str) else json.dumps(template, sort_keys=True)).encode())


def _hub_snapshot(repo_id: str, filename: str) -> str | None:
    """The hub cache's snapshot folder, named by its commit, that `repo_id` resolves to: the one
    its `main` ref names, which `from_pretrained` has just followed (and, online, updated)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return found[: -len(filename)] if isinstance(found, str) else None


def _revision(folder: str) -> str | None:
    """The commit a checkpoint folder holds: a hub snapshot folder is named by it, a git checkout has HEAD."""
    real = os.path.realpath(folder)
    name = os.path.basename(real.rstrip(os.sep))
    if re.fullmatch(r"[0-9a-f]{40}", name) and os.path.basename(os.path.dirname(real)) == "snapshots":
        return name
    head = os.path.join(real, ".git", "HEAD")
    try:
        with open(head) as f:
            ref = f.read().strip()
        if ref.startswith("ref: "):
            with open(os.path.join(real, ".git", ref[5:])) as f:
                ref = f.read().strip()
        return ref if re.fullmatch(r"[0-9a-f]{40}", ref) else None
    except OSError:
        return None


def decoder_of(model: nn.Module) -> nn.Module:
    """The base transformer (embeddings, ``layers``, ``norm``) under a ``*ForCausalLM`` head."""
    for candidate in (getattr(model, "model", None), model.get_decoder() if hasattr(model, "get_decoder") else None):
        if candidate is not None and isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    raise InputError(f"{type(model).__name__} has no decoder with a 'layers' list; this architecture "
                     f"is not supported")


class Capture:
    """Runs the base model on a batch and returns the chosen layers' outputs at every position.

    The model is cut IN PLACE, once: decoder layers after the last one needed are deleted, and
    so is the LM head (a 27B model's head is 5120 x 151k: its logits for a 4k-token batch would
    dwarf the states we keep). The final norm is kept only for ``final_state="postnorm"``.
    Keep the uncut model elsewhere if you still need it.
    """

    def __init__(self, model: nn.Module, layers: list[int], final_state: FinalState = "none"):
        if getattr(model, "_layertap_cut", False):
            raise ValueError("this model was already cut by a Capture; load it again")
        decoder = decoder_of(model)
        config = decoder.config
        num_layers = int(config.num_hidden_layers)
        self.layers = check_layers(layers, num_layers)
        if final_state not in FINAL_STATES:
            raise ConfigError(f"final_state must be one of {FINAL_STATES}, got {final_state!r}")
        self.final_state = final_state
        self.num_layers = num_layers
        self.hidden_size = int(config.hidden_size)
        keep = num_layers if final_state != "none" else max(self.layers) + 1
        self._cut(model, decoder, keep, final_state)
        self.model, self.decoder, self.kept_layers = model, decoder, keep
        self._buffer: torch.Tensor | None = None
        self._final: torch.Tensor | None = None
        for j, k in enumerate(self.layers):
            decoder.layers[k].register_forward_hook(self._store(j))
        if final_state == "prenorm":
            decoder.layers[num_layers - 1].register_forward_hook(self._store_final)

    @staticmethod
    def _cut(model: nn.Module, decoder: nn.Module, keep: int, final_state: str) -> None:
        config = decoder.config
        decoder.layers = nn.ModuleList(list(decoder.layers)[:keep])
        # The decoder loops over layers[:num_hidden_layers] and picks each layer's attention mask
        # by layer_types[i] (full vs linear attention in qwen3_5_text): both must match the cut.
        config.num_hidden_layers = keep
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:keep]
        if final_state != "postnorm" and isinstance(getattr(decoder, "norm", None), nn.Module):
            decoder.norm = nn.Identity()
        if isinstance(getattr(model, "lm_head", None), nn.Module):
            model.lm_head = None
        model._layertap_cut = True

    def _store(self, j: int):
        def hook(module, args, output):
            h = output[0] if isinstance(output, (tuple, list)) else output
            self._buffer[:, :, j].copy_(h)  # one copy into the batch's output; robust to later in-place ops
        return hook

    def _store_final(self, module, args, output):
        h = output[0] if isinstance(output, (tuple, list)) else output
        self._final = h.clone()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden [B, T, L, H]`` in the model's dtype, and ``final [B, T, H]`` or None.

        Pad on the RIGHT: positions are counted from each row's start, so a sample's real tokens
        are computed as if it were alone; rows at padded positions hold garbage to be sliced off.
        """
        weight = self.decoder.get_input_embeddings().weight
        device = weight.device
        if attention_mask is not None:
            # checked where it was made (the host, usually): a check on the GPU would wait there
            # for the previous batch's forward to finish
            if bool((attention_mask[:, :-1] < attention_mask[:, 1:]).any()):
                raise ValueError("attention_mask has padding before real tokens; pad on the right")
            attention_mask = attention_mask.to(device, non_blocking=True)
        input_ids = input_ids.to(device, non_blocking=True)
        b, t = input_ids.shape
        self._buffer = torch.empty(b, t, len(self.layers), self.hidden_size, dtype=weight.dtype,
                                   device=device)
        self._final = None
        try:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden = self._buffer
            final = {"none": None, "prenorm": self._final, "postnorm": out.last_hidden_state}[self.final_state]
        finally:
            self._buffer, self._final = None, None
        return hidden, final

    __call__ = forward


