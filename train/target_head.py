"""The two frozen tensors a DFlash drafter borrows from its target: `embed_tokens` and `lm_head`.

Loading a 27B target to train a 1B drafter would cost the whole checkpoint's memory and read
time, so only these tensors are read: from a safetensors checkpoint folder through its index
(only the files that hold them are opened, and only those tensors are read from them), or
from a GGUF file (dequantized). Tied embeddings (no separate head) are handled: the head is the
embedding matrix; but a config that says the head is untied while no head tensor is found is
refused, not read as tied. The model's shape facts (hidden size, heads, rope) come along, to size
the drafter's defaults.

Distillation (`--objective kl` on a prenorm final state) also needs the target's final norm:
`load_final_norm` reads its weight alone the same way, and applies it with the model's own norm
code (built on the meta device from the config), so norms that scale by (1 + weight), as
Qwen3.5/3.6, Qwen3-Next and Gemma do, are computed as the target computes them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from layertap.extract.config import text_config
from layertap.extract.embedded import checkpoint
from layertap.storage.errors import ConfigError, InputError, MissingInput

log = logging.getLogger(__name__)

_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight",
               "transformer.wte.weight")
_HEAD_KEYS = ("lm_head.weight",)
_NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")


@dataclass
class TargetHead:
    """`embed` [V, H] and `lm_head` [V, H] (the same tensor when tied), plus the target's shape."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    tied: bool
    facts: dict[str, Any] = field(default_factory=dict)  # hidden_size, num_layers, heads, rope, ...

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])


def load_target_head(path: str, gguf_file: str | None = None) -> TargetHead:
    """`embed_tokens` and `lm_head` of the target at `path` (a folder; `gguf_file` inside it)."""
    from layertap.extract.model import refuse_gguf_as_folder

    refuse_gguf_as_folder(path)
    if not os.path.isdir(path):
        raise MissingInput(f"target model folder {path!r} does not exist; give the folder the "
                                "extraction used (--model), with --gguf-file for a GGUF checkpoint")
    if gguf_file:
        file = os.path.join(path, gguf_file)
        if not os.path.isfile(file):
            raise MissingInput(f"GGUF file {gguf_file!r} not found in {path!r}")
        path, gguf_file = checkpoint(path, gguf_file)  # the embedded SmolLM2: its converted folder
    return _from_gguf(os.path.join(path, gguf_file)) if gguf_file else _from_safetensors(path)


def _from_safetensors(folder: str) -> TargetHead:
    config = _read_json(os.path.join(folder, "config.json"), "the target's config.json")
    text = text_config(config)
    weight_map = _weight_map(folder)
    embed_key = next((k for k in _EMBED_KEYS if k in weight_map), None)
    if embed_key is None:
        raise InputError(f"no embedding tensor in {folder!r} (looked for {', '.join(_EMBED_KEYS)})")
    head_key = next((k for k in _HEAD_KEYS if k in weight_map), None)
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    if head_key is None and tie is False:
        # The config promises a head of its own; standing the embedding in for it would train the
        # drafter against the wrong output matrix without a word. A head under a name not in
        # _HEAD_KEYS (a wrapper's prefix) must be refused, not guessed.
        source = "model.safetensors.index.json" if os.path.isfile(
            os.path.join(folder, "model.safetensors.index.json")) else "model.safetensors"
        raise InputError(f"{folder!r}: config.json says tie_word_embeddings is false, but {source} has no "
                         f"head tensor (looked for {', '.join(_HEAD_KEYS)})")
    tied = bool(tie) or head_key is None  # no head key and no tie setting: tied, as transformers defaults
    wanted = {"embed": embed_key} if tied else {"embed": embed_key, "head": head_key}
    tensors = _read_tensors(folder, weight_map, wanted)
    log.info("read %s from %s (%s)", ", ".join(wanted.values()), folder, "tied" if tied else "untied")
    embed = tensors["embed"]
    return TargetHead(embed, embed if tied else tensors["head"], tied, _facts_from_config(text, embed))


def _weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> the safetensors file in `folder` that holds it."""
    from safetensors import safe_open

    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        return _read_json(index_path, "the checkpoint index")["weight_map"]
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise MissingInput(f"{folder!r} has neither model.safetensors nor model.safetensors.index.json; "
                       "layertap reads the target's embeddings from safetensors or GGUF checkpoints")


def _read_tensors(folder: str, weight_map: dict[str, str], wanted: dict[str, str]) -> dict[str, torch.Tensor]:
    """{name: tensor} for `wanted` {name: checkpoint key}, opening only the files that hold them."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({weight_map[k] for k in wanted.values()}):
        with safe_open(os.path.join(folder, file), "pt") as f:
            for name, key in wanted.items():
                if weight_map[key] == file:
                    tensors[name] = f.get_tensor(key)
    return tensors


def load_final_norm(path: str, gguf_file: str | None = None) -> nn.Module:
    """The target's final norm (after its last decoder layer, before its head), frozen, in fp32:
    what turns a prenorm final state into what the head reads."""
    if not os.path.isdir(path):
        raise MissingInput(f"target model folder {path!r} does not exist")
    path, gguf_file = checkpoint(path, gguf_file)  # the embedded SmolLM2: its converted folder
    norm = _norm_from_gguf(os.path.join(path, gguf_file)) if gguf_file else _norm_from_safetensors(path)
    return norm.float().requires_grad_(False).eval()


@dataclass(frozen=True)
class LogitTransform:
    """What the target's causal-LM forward does to its head's output before the softmax: a
    scale (Granite divides by `logits_scaling`, Cohere multiplies by `logit_scale`) or a soft cap
    (Gemma 2: cap * tanh(logits / cap)). A distillation teacher without it is another
    distribution than the target's (Granite's at logits_scaling 8: the target's at temperature 1/8)."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __str__(self) -> str:
        return "none" if self.identity else (f"scale {self.scale:g}" if self.softcap is None
                                             else f"soft cap {self.softcap:g}")


def head_transform(path: str, gguf_file: str | None = None) -> LogitTransform:
    """The transform the target's own forward applies to its head's output, found by running
    that forward (its class, built on the meta device from the config) with the decoder stubbed to
    hand back known states and the head a known matrix: what comes out is compared with the plain
    product. An attribute list would not do: the same config name means opposite things across
    families (Granite divides by `logits_scaling`, HyperCLOVA X multiplies by it). A transform
    that is neither a scale nor the config's soft cap is refused, naming the model."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    from layertap.extract.model import decoder_of

    model = _meta_model(path, gguf_file)
    g = torch.Generator().manual_seed(0)
    states, weight = torch.randn(1, 6, 8, generator=g), torch.randn(8, 16, generator=g) * 3
    raw = states @ weight  # what a plain head makes of the decoder's states
    decoder, head = decoder_of(model), model.get_output_embeddings()
    what = path + (f" ({gguf_file})" if gguf_file else "")
    refuse = (f"--objective kl and ce+kl need the target's own next-token distribution, and how {what}'s "
              f"{type(model).__name__} turns its head's output into logits is not one layertap reproduces")
    if head is None:
        raise ConfigError(f"{refuse} (it has no output embeddings); train with --objective ce")
    if getattr(head, "bias", None) is not None:  # Phi: logits + bias, which the borrowed head (a matrix) lacks
        raise ConfigError(f"{refuse} (its head adds a bias); train with --objective ce")
    # the MoE output type: a plain decoder's fields and router_logits, which MoE forwards read
    decoder.forward = lambda *args, **kwargs: MoeModelOutputWithPast(last_hidden_state=states)
    # linear in its input, as the real head: a forward that scales the states before the head
    # (MiniCPM3 divides them by logits_scaling) shows as a scale of the logits
    head.forward = lambda hidden: hidden.float() @ weight
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros(1, 6, dtype=torch.long)).logits
    except Exception as e:  # a forward that needs more than the decoder's states and the head
        raise ConfigError(f"{refuse} ({type(e).__name__}: {e}); train with --objective ce") from None
    if out is None or out.device.type == "meta" or out.shape != raw.shape:
        raise ConfigError(f"{refuse}; train with --objective ce")
    out = out.float()
    if torch.allclose(out, raw, rtol=1e-5, atol=1e-5):
        return LogitTransform()
    scale = float((out * raw).sum() / (raw * raw).sum())
    if torch.allclose(out, raw * scale, rtol=1e-4, atol=1e-5):
        return LogitTransform(scale=scale)
    config = text_config(model.config)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap and torch.allclose(out, cap * torch.tanh(raw / cap), rtol=1e-4, atol=1e-5):
        return LogitTransform(softcap=float(cap))
    raise ConfigError(f"{refuse}; train with --objective ce")


def _meta_model(path: str, gguf_file: str | None = None) -> nn.Module:
    """The target's causal LM built from its config on the meta device, in fp32: its classes'
    code without its weights. Eager attention: nothing attends here, and some families (Gemma 2)
    refuse to be built for sdpa."""
    from layertap.extract.model import load_target

    return load_target(path, gguf_file, dtype=torch.float32, attn_implementation="eager", weights=False).model


def _norm_from_safetensors(folder: str) -> nn.Module:
    """The model's own final-norm module (its class decides the formula) with the checkpoint's
    weights: every tensor under the norm's prefix (a weight; a LayerNorm's bias too)."""
    from layertap.extract.model import decoder_of

    weight_map = _weight_map(folder)
    key = next((k for k in _NORM_KEYS if k in weight_map), None)
    if key is None:
        raise InputError(f"no final norm in {folder!r} (looked for {', '.join(_NORM_KEYS)})")
    prefix = key.removesuffix("weight")
    state = _read_tensors(folder, weight_map, {k[len(prefix):]: k for k in weight_map if k.startswith(prefix)})
    norm = getattr(decoder_of(_meta_model(folder)), "norm", None)
    if not isinstance(norm, nn.Module):
        raise InputError(f"the model in {folder!r} has no final norm module (decoder.norm)")
    norm.to_empty(device="cpu")
    norm.load_state_dict(state)
    log.info("read %s from %s (%s)", key, folder, type(norm).__name__)
    return norm


def _norm_from_gguf(file: str) -> nn.Module:
    """llama.cpp's final norm: a plain RMSNorm whose weight already holds any offset (its
    converter adds the 1 of Gemma's and Qwen3-Next's (1 + weight) norms into the stored weight)."""
    from gguf import GGUFReader

    reader = GGUFReader(file)
    arch = _field(reader, "general.architecture")
    t = next((t for t in reader.tensors if t.name == "output_norm.weight"), None)
    if t is None:
        raise InputError(f"{file!r} has no output_norm.weight tensor")
    eps = _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", None)
    if eps is None or any(t.name == "output_norm.bias" for t in reader.tensors):
        # a LayerNorm (gpt2, falcon, bloom, starcoder2...): mean-centred, with a bias; an RMSNorm teacher
        # would be a wrong distribution to distill from, with no error
        raise InputError(f"{file!r} ({arch}) ends in a LayerNorm, not an RMSNorm (output_norm.bias, or no "
                         f"{arch}.attention.layer_norm_rms_epsilon): --objective kl and ce+kl read the final norm of "
                         "RMSNorm targets only; train with --objective ce, or from the model's safetensors folder")
    weight = _gguf_tensor(t)
    norm = nn.RMSNorm(weight.shape[0], eps=float(eps))
    with torch.no_grad():
        norm.weight.copy_(weight)
    log.info("read output_norm from %s", file)
    return norm


def _facts_from_config(c: dict[str, Any], embed: torch.Tensor) -> dict[str, Any]:
    hidden = int(c.get("hidden_size", embed.shape[1]))
    heads = int(c.get("num_attention_heads", max(1, hidden // 64)))
    return {
        "model_type": c.get("model_type"),
        "hidden_size": hidden,
        "num_layers": int(c.get("num_hidden_layers", 0)),
        "num_heads": heads,
        "num_kv_heads": int(c.get("num_key_value_heads") or heads),
        "head_dim": int(c.get("head_dim") or hidden // heads),
        "intermediate_size": int(c.get("intermediate_size", 4 * hidden)),
        "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
    }


def _from_gguf(file: str) -> TargetHead:
    from gguf import GGUFReader

    reader = GGUFReader(file)
    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors if t.name in ("token_embd.weight", "output.weight")}
    if "token_embd.weight" not in tensors:
        raise InputError(f"{file!r} has no token_embd.weight tensor")

    embed = _gguf_tensor(tensors["token_embd.weight"])
    tied = "output.weight" not in tensors
    head = embed if tied else _gguf_tensor(tensors["output.weight"])
    hidden = int(_field(reader, f"{arch}.embedding_length", embed.shape[1]))
    heads = int(_field(reader, f"{arch}.attention.head_count", max(1, hidden // 64)))
    facts = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_layers": int(_field(reader, f"{arch}.block_count", 0)),
        "num_heads": heads,
        "num_kv_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length", 4 * hidden)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
    }
    log.info("read token_embd%s from %s", "" if tied else " and output", file)
    return TargetHead(embed, head, tied, facts)


def _gguf_tensor(t) -> torch.Tensor:
    """A GGUF tensor, dequantized to float32."""
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32", copy=False).copy())


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise MissingInput(f"{what} is missing: {path!r}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {path!r} is not valid JSON: {e}") from None


def recorded_target(recorded: dict[str, Any], what: str, source: str) -> tuple[str, str | None]:
    """The target (folder, GGUF file) a run's manifest or a drafter's config records, if it is on
    this machine; `what` starts the error that says it is not (e.g. "the run at s3://... was
    extracted from"), `source` names the record in the log (e.g. "the run's manifest")."""
    model, gguf = recorded.get("model"), recorded.get("gguf_file")
    if isinstance(model, str) and model.startswith("embedded:"):  # the Quickstart's packaged SmolLM2
        from layertap.extract.embedded import smollm2_gguf

        model, gguf = smollm2_gguf()
    if not model or not os.path.isdir(model) or (gguf and not os.path.isfile(os.path.join(model, gguf))):
        raise InputError(f"{what} {model!r}" + (f" ({gguf})" if gguf else "") +
                         ", which is not on this machine: pass --model (and --gguf-file) with the same target")
    log.info("target model from %s: %s%s", source, model, f" ({gguf})" if gguf else "")
    return model, gguf
