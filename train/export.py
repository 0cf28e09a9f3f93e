"""`layertap export-drafter`: a trained drafter in speculators' DFlash checkpoint format.

speculators' `DFlashDraftModel` (the format vLLM serves) is the same network as layertap's
`DFlashDrafter`, module for module: only the weight names differ, and the borrowed
`embed_tokens` / `lm_head` are not shipped (the server takes them from the verifier). What does
not carry over is a *learned* mask embedding: speculators embeds the mask token through the
verifier's own embedding, so the mask id must lie inside the vocabulary. A drafter trained with
an id outside it (layertap's default when the tokenizer fills the embedding) is refused with
the fix: train with `--mask-token-id` set to a reserved, unused id.

The checkpoint is `model.safetensors` + `config.json` under DEST (a folder or an S3 prefix):
config keys as speculators 0.9 writes them, `rope_parameters` stated explicitly (vLLM's
default differs) and `aux_hidden_state_layer_ids` in HF `hidden_states` indices (layertap's
layer k is index k + 1), ascending, as vLLM gathers them: a drafter trained on layers given out
of order (`--layers 3,1`) has its `fc` input columns reordered to match.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch

from layertap.extract.config import text_config
from layertap.storage.errors import ConfigError, InputError, MissingInput
from layertap.storage.foreign import foreign_layers, layer_order, unservable_layer
from layertap.storage.store import ObjectStore
from layertap.storage.units import listing
from layertap.train.checkpoint import load_drafter_files, load_latest, write_safetensors
from layertap.train.drafter import DrafterConfig

log = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.9.0"  # the release whose DFlash config and names this writes (tests load it there)
WEIGHTS, CONFIG = "model.safetensors", "config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# layertap's name inside `layers.i.` -> speculators' (Qwen3 decoder layer names); fc,
# hidden_norm and norm keep theirs.
_LAYER_RENAMES = {
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    **{f"{p}_proj": f"self_attn.{p}_proj" for p in "qkvo"},
    **{f"{p}_norm": f"self_attn.{p}_norm" for p in "qk"},
    **{f"{p}_proj": f"mlp.{p}_proj" for p in ("gate", "up", "down")},
}
_TOP_LEVEL = ("fc.weight", "hidden_norm.weight", "norm.weight")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.([a-z_]+)\.weight$")


def speculators_name(name: str) -> str:
    """A layertap drafter weight's name in speculators' `DFlashDraftModel`."""
    if name in _TOP_LEVEL:
        return name
    m = _LAYER_KEY.match(name)
    if m is None or m.group(2) not in _LAYER_RENAMES:
        raise InputError(f"drafter weight {name!r} has no counterpart in speculators' DFlashDraftModel")
    return f"layers.{m.group(1)}.{_LAYER_RENAMES[m.group(2)]}.weight"


def speculators_weights(config: DrafterConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's trainable weights under speculators' names, or `ConfigError` for a drafter
    whose mask token has a learned embedding (no speculators form)."""
    if config.learned_mask or "mask_embedding" in weights:
        raise ConfigError(
            f"this drafter's mask token id {config.mask_token_id} lies outside the target's vocabulary "
            f"({config.vocab_size} ids), so it learned a mask embedding of its own, which speculators' DFlash "
            "format (and vLLM) cannot hold: they embed the mask token with the target's embedding. Train again with "
            "`layertap train --mask-token-id ID`, ID a reserved or unused token id below the vocabulary size "
            "(e.g. an unused special token: `layertap train` named one in its warning at the start)")
    renamed = {speculators_name(k): v for k, v in sorted(weights.items())}
    order = layer_order("speculators", config.capture_layers)
    if order != sorted(order):  # fc's input columns follow the stored layer order; served, they come ascending
        fc, h = renamed["fc.weight"], config.hidden_size
        renamed["fc.weight"] = fc.reshape(fc.shape[0], len(order), h)[:, order].reshape(fc.shape[0], -1).contiguous()
    return renamed


def speculators_config(config: DrafterConfig, verifier: str, verifier_config: dict[str, Any] | None) -> dict[str, Any]:
    """speculators' config.json for the drafter. `verifier_config` is the target's config.json
    when it is at hand (its architectures and max_position_embeddings), else None."""
    target = verifier_config or {}
    text = text_config(target)
    layer = {
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(text.get("max_position_embeddings") or 32768),
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.vocab_size,
        "block_size": config.block_size,
        # HF indices, ascending: vLLM gathers aux states in layer order (and `speculators_weights` orders fc so)
        "aux_hidden_state_layer_ids": foreign_layers("speculators", sorted(config.capture_layers)),
        "mask_token_id": config.mask_token_id,
        "target_hidden_size": config.hidden_size,
        "sample_from_anchor": False,
        # The drafter attends both ways inside a block, in every layer (none has a sliding window). Some
        # vLLM releases read this key as `dflash_config.causal = not value` for ALL layers: false served
        # the drafter causal inside its blocks, below the acceptance it was trained for. speculators reads it
        # for sliding-window layers only, so true changes nothing there.
        "sliding_window_non_causal": True,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(target.get("architectures") or [])},
        },
    }


def trained_drafter(store: ObjectStore) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The drafter a `layertap train` output holds: its export (`drafter/`), else its latest
    checkpoint (a run still training, or stopped before its end)."""
    try:
        return load_drafter_files(store)
    except MissingInput:
        ckpt = load_latest(store, tensors=False)  # its step: not the optimizer's moments (2x the weights, fp32)
        if ckpt is None:
            raise MissingInput(f"no trained drafter at {store.uri}: neither drafter/ (written when `layertap train` "
                               "finishes) nor checkpoints/latest.json") from None
        log.info("no exported drafter at %s: exporting its latest checkpoint, step %d", store.uri, ckpt.step)
        return load_drafter_files(store, ckpt.step)


def _is_path(name: str) -> bool:
    """Whether a --verifier is a file system path, not a hub id: absolute, relative to a folder
    (./, ../, ~), or something there."""
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(name)


def _verifier(config: DrafterConfig, verifier: str | None) -> tuple[str, dict[str, Any] | None]:
    """The verifier's name for the config (given, else the target the drafter records) and its
    config.json when that is a local folder. A recorded GGUF target is named by what speculators
    and vLLM can load: the embedded SmolLM2 (`embedded:` or its GGUF) by its converted safetensors
    folder; any other GGUF only with a warning that --verifier is needed."""
    if verifier is not None:
        name = os.path.expanduser(verifier) if verifier.startswith("~") else verifier  # --verifier=~/m: no shell's
        if _is_path(name) and not os.path.isfile(os.path.join(name, "config.json")):
            # not a hub id ("org/name") either: the config would name a model speculators cannot load
            raise InputError(f"--verifier {name!r} is not a model folder on this machine ("
                             + ("no config.json in it" if os.path.isdir(name) else "no such folder")
                             + "): pass the target's local safetensors folder, or its hub id (org/name)")
        if _is_path(name):  # a server started in another folder finds it (`extract` records its --model so too)
            name = os.path.abspath(name)
    else:
        name, gguf = config.target.get("model"), config.target.get("gguf_file")
        if not name:
            raise ConfigError("the drafter records no target model: pass --verifier NAME_OR_PATH (the model vLLM "
                              "serves)")
        from layertap.extract.embedded import checkpoint, smollm2_gguf

        if name.startswith("embedded:"):  # the Quickstart's target: the packaged SmolLM2 GGUF
            name, gguf = smollm2_gguf()
        recorded_gguf = gguf
        name, gguf = checkpoint(name, gguf)
        if recorded_gguf is not None and gguf is None:  # the embedded SmolLM2's, converted
            log.warning("the verifier named is the embedded SmolLM2's safetensors conversion in this machine's cache "
                        "(%s), not a hub id: its weights are the packaged quantized checkpoint's, dequantized, which "
                        "the hub's SmolLM2-135M-Instruct does not match. To serve the drafter on another machine, "
                        "copy that folder there and pass --verifier with its path", name)
        if gguf is not None:
            log.warning("the drafter's target is a GGUF file (%s in %s), which speculators and vLLM do not load as "
                        "a verifier: pass --verifier with the model's safetensors folder or hub id", gguf, name)
    path = os.path.join(name, "config.json")
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                verifier_config = json.load(f)
        except (OSError, ValueError) as e:
            raise InputError(f"the verifier's {path} cannot be read as a model config ({type(e).__name__}: {e}); pass "
                             "--verifier with the model's own folder") from None
        if not isinstance(verifier_config, dict):
            raise InputError(f"the verifier's {path} is not a model config (a JSON object); pass --verifier with the "
                             "model's own folder")
        return name, verifier_config
    log.warning("the verifier %r is not a local folder with a config.json: the config states no verifier "
                "architectures and max_position_embeddings 32768, and whether vLLM can serve the capture layers "
                "is not checked; pass --verifier with the model's local folder", name)
    return name, None


UNDER_WAY = "layertap-export-under-way"  # config.json's model type while an export writes the weights
_UNDER_WAY = {"speculators_model_type": UNDER_WAY,
              "note": "written by `layertap export-drafter` before the weights, replaced once they are written: "
                      "an export cut short left this; rerun it"}


def _check_dest(dest: ObjectStore) -> None:
    """Refuse a DEST that holds anything but an earlier export of this command (whose files a new
    one replaces): the target's own folder given as DEST by mistake would lose its model.safetensors
    and config.json."""
    keys = [o.key for o in dest.list()]
    others = [k for k in keys if k not in (WEIGHTS, CONFIG)]
    if others:
        raise ConfigError(f"{dest.uri} holds other files ({listing(others, 5)}):"
                          f" export-drafter writes {WEIGHTS} and {CONFIG} there; choose an empty folder or prefix")
    if CONFIG not in keys:
        if WEIGHTS in keys:
            raise ConfigError(f"{dest.uri} holds a {WEIGHTS} without a {CONFIG} (an export cut halfway, or another "
                              f"model's weights): delete it or choose an empty folder or prefix")
        return
    try:
        earlier = json.loads(dest.get(CONFIG))
    except ValueError:
        earlier = None
    if not isinstance(earlier, dict) or earlier.get("speculators_model_type") not in ("dflash", UNDER_WAY):
        raise ConfigError(f"{dest.uri} holds a {CONFIG} that is not a speculators DFlash drafter's (a model's "
                          f"folder?): export-drafter would replace it; choose an empty folder or prefix")


def export_speculators(source: ObjectStore, dest: ObjectStore, *, verifier: str | None = None,
                       dtype: str = "float32") -> dict[str, Any]:
    """Write the drafter of the training output `source` to `dest` in speculators' DFlash format;
    returns the config written."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    _check_dest(dest)
    config, weights = trained_drafter(source)
    renamed = speculators_weights(config, weights)
    name, verifier_config = _verifier(config, verifier)
    text = text_config(verifier_config or {})
    if bad := [key for key in ("hidden_size", "vocab_size", "num_hidden_layers")
               if text.get(key) is not None and (isinstance(text[key], bool) or not isinstance(text[key], int))]:
        raise InputError(f"the verifier {name}'s config.json gives {', '.join(f'{k} {text[k]!r}' for k in bad)}, not "
                         "whole numbers; pass --verifier with the model's own folder")
    if diffs := [f"{key} {text[key]} (the drafter's target: {ours})"
                 for key, ours in (("hidden_size", config.hidden_size), ("vocab_size", config.vocab_size))
                 if text.get(key) is not None and int(text[key]) != ours]:
        raise ConfigError(f"the verifier {name} is not the model the drafter was trained for: {', '.join(diffs)}; "
                          "vLLM would fail to load the pair, or serve a drafter none of whose drafts is accepted. "
                          "Pass --verifier with that model (or a quantized copy of it)")
    layers = int(text.get("num_hidden_layers") or 0)
    if layers and (beyond := [k for k in config.capture_layers if k >= layers]):
        raise ConfigError(f"the verifier {name} has {layers} decoder layers, but the drafter was trained on the "
                          f"states of layers {config.capture_layers} (layertap's ids; {beyond} do not exist in it): "
                          "it is not the model the drafter was trained for, and vLLM would gather states it does not "
                          "have. Pass --verifier with that model (or a quantized copy of it)")
    remedy = f"a servable drafter needs a run captured at layers below {layers - 1} (`layertap extract --layers`)"
    if layers and (why := unservable_layer(config.capture_layers, layers, remedy)) is not None:
        log.warning("%s. The checkpoint is written all the same.", why)
    spec = speculators_config(config, name, verifier_config)
    # first: an export cut halfway leaves this config, which no loader takes (never a mismatched pair)
    # and a rerun replaces (it deleted the config before, and the rerun refused the weights left alone)
    dest.put(CONFIG, (json.dumps(_UNDER_WAY, indent=2) + "\n").encode())
    write_safetensors(dest, WEIGHTS, renamed, {"format": "pt"}, dtype=DTYPES[dtype])  # "pt": what transformers expects
    dest.put(CONFIG, (json.dumps(spec, indent=2) + "\n").encode())
    log.info("wrote %s and %s to %s (%d tensors, %s)", WEIGHTS, CONFIG, dest.uri, len(renamed), dtype)
    return spec
