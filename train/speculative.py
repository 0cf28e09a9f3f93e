"""`layertap eval`: greedy speculative decoding with the target and a DFlash drafter.

One round: the drafter reads the target's states at every position before the anchor (the last
token the target produced) and drafts ``block_size - 1`` tokens in one pass; the target
verifies anchor + draft in one forward, the longest prefix of the draft that equals the
target's own greedy choices is accepted, and the target's next choice is appended as the bonus
token. tau, the mean acceptance length, is the tokens produced per verification step (bonus
included): 1.0 for a drafter that never hits, ``block_size`` at best. The output must equal
plain greedy decoding token for token; that is checked on every prompt.

The target's states are captured with hooks (layer k = output of decoder layer k, as stored)
and rounded to bf16 like the stored ones, so the drafter sees what it was trained on.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

import torch

from layertap.extract.inputs import (Skipped, TokenizeStats, check_template_kwargs, normalize_chat, tools_of,
                                     unread_template_kwargs)
from layertap.extract.model import decoder_of, load_target
from layertap.storage.errors import InputError
from layertap.storage.store import open_store
from layertap.storage.units import counted
from layertap.train.checkpoint import load_drafter_files
from layertap.train.drafter import DFlashDrafter
from layertap.train.target_head import TargetHead, recorded_target

log = logging.getLogger(__name__)


class TargetRunner:
    """The target with a KV cache: `step(ids)` -> greedy choices and capture-layer states, and
    `verify(ids)` + `keep(n)` to check a drafted block and keep its first `n` tokens.

    Attention layers roll back by cropping their KV cache. Linear-attention layers (the gated
    deltanets of `qwen3_5_text` and `qwen3_next`) hold a recurrent state and a conv window that
    every forward overwrites in place, so they cannot be cropped: `verify` snapshots them first,
    and when part of the block is rejected `keep` restores the snapshot, crops the attention
    layers and runs the accepted tokens again, leaving exactly the states of the accepted tokens.
    Layers that keep no cache (the mlp and moe layers of `nemotron_h`) have nothing to roll back.
    `seconds` adds up the time that rollback costs (snapshot, restore, re-forward).
    """

    def __init__(self, model: torch.nn.Module, layers: list[int]):
        from transformers import DynamicCache

        self.model, self.layers = model, layers
        decoder = decoder_of(model)
        n = int(decoder.config.num_hidden_layers)
        bad = [k for k in layers if not 0 <= k < n]
        if bad:
            raise InputError(f"the drafter reads target layers {bad}, but the target has layers 0..{n - 1}: "
                             "is --model the target the drafter was trained for?")
        kinds = set(getattr(decoder.config, "layer_types", None) or [])
        # Attention-only targets keep today's plain cache (every layer croppable); others get the
        # cache their config describes, whose linear-attention layers are rolled back by snapshot.
        self.hybrid = bool(kinds - {"full_attention", "sliding_attention"})
        self._new_cache = (lambda: DynamicCache(config=model.config)) if self.hybrid else DynamicCache
        self._captured: dict[int, torch.Tensor] = {}
        for k in layers:
            decoder.layers[k].register_forward_hook(self._hook(k))
        _check_multi_token(decoder.config)
        if self.hybrid:
            _check_rollback(model.config, kinds)
        self.reset()
        self._decoder = decoder
        self._device = model.get_input_embeddings().weight.device
        self._verified: tuple[int, list[int], list | None] | None = None
        self.seconds = dict.fromkeys(("snapshot", "restore", "reforward"), 0.0)
        # transformers renamed `past_key_values` to `cache` (5.2x); take whichever this one has
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._decoder_cache_arg = ("cache" if "cache" in inspect.signature(decoder.forward).parameters
                                   else "past_key_values")
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _hook(self, k: int):
        def hook(module, args, output):
            self._captured[k] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def reset(self) -> None:
        self.cache, self.length, self._prefilled = self._new_cache(), 0, None

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`step(prompt)` from an empty cache. The same prompt again (the greedy check, the
        untrained baseline) rolls the cache back to it instead: the prompt's cache entries never
        change, and its forward is most of a short decode's cost."""
        if self._prefilled is not None and self._prefilled[0] == prompt and self.length >= len(prompt):
            if self._prefilled[2] is not None:
                _restore(self._prefilled[2])
            self.crop(len(prompt))
            return self._prefilled[1]
        self.reset()
        try:
            result = self.step(prompt, last_only=True)
        except ValueError as e:
            if type(self.cache).__name__ not in str(e):
                raise
            raise self._own_cache_refusal(e) from e
        self._prefilled = (list(prompt), result, _snapshot(self.cache) if self.hybrid else None)
        return result

    def _own_cache_refusal(self, e: ValueError) -> InputError:
        """The error for a model whose forward refuses the cache it was given, wanting a class of its
        own (MiniMax): `keep` rolls back only a DynamicCache's layers. Its first forward is where
        transformers says so, naming the cache's class."""
        model_type = self._decoder.config.model_type
        return InputError(f"`layertap eval` cannot decode the target (model_type {model_type!r}) with a "
                          f"{type(self.cache).__name__}, the cache whose layers it rolls back past rejected drafts: "
                          f"the model takes only a cache class of its own ({e})")

    @torch.inference_mode()
    def step(self, ids: list[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `ids` at the next positions: greedy next-token choices [n] (on the host; with
        `last_only`, the last position's alone [1]) and states [n, L, H] (bf16-rounded, fp32, on
        the model's device, where the drafter reads them)."""
        x = torch.tensor([ids], dtype=torch.long, device=self._device)
        # a prompt's logits but its last are never used: [1024, 248k] of them in fp32 is ~1 GB
        keep = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        out = self.model(input_ids=x, use_cache=True, **{self._cache_arg: self.cache}, **keep)
        self.length += len(ids)
        states = torch.stack([self._captured[k][0] for k in self.layers], dim=1)
        return out.logits[0].argmax(-1).cpu(), states.to(torch.bfloat16).float()

    def verify(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`step(ids)` that `keep` can take back to any prefix of `ids`."""
        snapshot = None
        if self.hybrid:
            with self._timed("snapshot"):
                snapshot = _snapshot(self.cache)
        self._verified = (self.length, list(ids), snapshot)
        return self.step(ids)

    @torch.inference_mode()
    def keep(self, n: int) -> None:
        """Keep the first `n` tokens of the last `verify` in the cache, as if only they had been run."""
        assert self._verified is not None, "keep() follows verify()"
        base, ids, snapshot = self._verified
        self._verified = None
        if n == len(ids):
            return
        if snapshot is None:
            self.crop(base + n)
            return
        with self._timed("restore"):
            _restore(snapshot)
            self.crop(base)
        with self._timed("reforward"):  # no head: only the cache matters, the choices are known
            x = torch.tensor([ids[:n]], dtype=torch.long, device=self._device)
            self._decoder(input_ids=x, use_cache=True, **{self._decoder_cache_arg: self.cache})
            self.length += n

    def crop(self, length: int) -> None:
        """Drop the attention layers' entries past `length` (linear-attention layers are restored
        from a snapshot instead). A negative count removes from the end in every transformers
        version (a positive one meant "keep" before 5.2x and is refused after)."""
        if length < self.length:
            if self.hybrid:
                from transformers.cache_utils import DynamicLayer

                for layer in self.cache.layers:
                    if isinstance(layer, DynamicLayer):
                        DynamicLayer.crop(layer, length - self.length)
            else:
                self.cache.crop(length - self.length)
            self.length = length

    @contextmanager
    def _timed(self, what: str):
        t0 = time.perf_counter()
        yield
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.seconds[what] += time.perf_counter() - t0


# Targets whose forward of several tokens ignores the recurrent state already cached (transformers'
# Mamba-1: "WRONG if the cache is not empty"): every verify would be computed from an empty state.
_INEXACT_MULTI_TOKEN = {"mamba", "falcon_mamba"}


def _check_multi_token(config) -> None:
    """Refuse a target whose forward of several tokens after a cached prefix is inexact."""
    if config.model_type in _INEXACT_MULTI_TOKEN:
        raise InputError(f"`layertap eval` cannot verify drafts on a {config.model_type!r} target: transformers' "
                         "forward of several tokens ignores the state cached before them, so every verified block "
                         "would be wrong (its own decoding runs one token at a time)")


def _check_rollback(config, kinds: set[str]) -> None:
    """Refuse a target whose cache has a layer kind `keep` cannot roll back (sliding windows that
    drop old entries, compressed or indexed attention, ...), naming the kinds."""
    from transformers import DynamicCache

    try:
        names = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    except (KeyError, ValueError, TypeError) as e:  # a layer kind transformers' cache does not know
        names = {f"unknown ({e})"}
    odd = sorted(names - {c.__name__ for c in _rollable_layers()})
    if odd or not names:
        raise InputError(f"the target's layers ({sorted(kinds)}) use cache layers {odd or 'none'} that `layertap "
                         "eval` cannot roll back past rejected drafts: it supports full and sliding attention, "
                         "and full attention mixed with linear attention (qwen3_5_text, qwen3_next) and with "
                         "layers that keep no cache (nemotron_h's mlp and moe layers)")


def _rollable_layers() -> list[type]:
    """The cache layer classes `keep` rolls back: attention (cropped), linear attention (restored
    from a snapshot), and `DummyLayer`, which holds nothing (the mlp and moe layers of hybrids such
    as nemotron_h; transformers before 5.2x has no such class)."""
    import transformers
    from transformers import cache_utils

    linear = ("LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer", "LinearAttentionCacheLayerMixin")
    if missing := [name for name in linear if not hasattr(cache_utils, name)]:  # transformers 5.0 had none
        raise InputError(f"`layertap eval` of a hybrid target needs transformers' linear-attention cache layers "
                         f"({', '.join(missing)}), which transformers {transformers.__version__} lacks: upgrade "
                         "it (pip install -U transformers)")
    rollable = [cache_utils.DynamicLayer, cache_utils.LinearAttentionLayer,
                cache_utils.LinearAttentionAndFullAttentionLayer]
    return rollable + ([cache_utils.DummyLayer] if hasattr(cache_utils, "DummyLayer") else [])


# A linear-attention layer's token count (transformers >= 5.25): the cache's length, hence the next
# forward's positions, comes from it where layer 0 is linear (qwen3_5_text), so it rolls back too.
_COUNTERS = ("cumulative_length_linear",)


def _snapshot(cache) -> list[tuple[Any, dict, dict, dict, dict]]:
    """Copies of every linear-attention layer's conv and recurrent states and token count."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [(layer, {i: s.clone() for i, s in layer.conv_states.items() if s is not None},
             {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None},
             dict(layer.has_previous_state),
             {name: getattr(layer, name).clone() for name in _COUNTERS if isinstance(getattr(layer, name, None),
                                                                                    torch.Tensor)})
            for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _restore(snapshot: list[tuple[Any, dict, dict, dict, dict]]) -> None:
    """Put a `_snapshot` back, in place: the layers' tensors keep their identity (and address)."""
    for layer, conv, recurrent, previous, counters in snapshot:
        for i, s in conv.items():
            layer.conv_states[i].copy_(s)
        for i, s in recurrent.items():
            layer.recurrent_states[i].copy_(s)
        layer.has_previous_state.update(previous)
        for name, s in counters.items():
            getattr(layer, name).copy_(s)


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # tokens produced per verification step
    # per step: the drafts it accepted that reached the output, and whether its verdict on every
    # draft position is known (False: cut short by EOS or max_new before its first rejection)
    drafts: list[int] = field(default_factory=list)
    complete: list[bool] = field(default_factory=list)


def greedy_decode(target: TargetRunner, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    choice, _ = target.prefill(prompt)
    out = [int(choice[-1])]
    while len(out) < max_new and out[-1] not in eos:
        choice, _ = target.step([out[-1]])
        out.append(int(choice[-1]))
    return out


@torch.inference_mode()
def speculative_decode(target: TargetRunner, drafter: DFlashDrafter, prompt: list[int], max_new: int,
                       eos: set[int]) -> Decoded:
    choice, context = target.prefill(prompt)
    result = Decoded([int(choice[-1])])
    while len(result.tokens) < max_new and result.tokens[-1] not in eos:
        anchor = result.tokens[-1]
        a = context.shape[0]  # the anchor's position: every earlier position has target states
        hidden = drafter(context[None], torch.tensor([[a]], device=context.device),
                         torch.tensor([[anchor]], device=context.device))
        draft = drafter.logits(hidden[0, 0, 1:]).argmax(-1).tolist()
        choice, states = target.verify([anchor, *draft])
        m = 0
        while m < len(draft) and draft[m] == int(choice[m]):
            m += 1
        full = [*draft[:m], int(choice[m])]
        target.keep(m + 1)  # anchor and accepted drafts stay; the rejected tail leaves the cache
        context = torch.cat((context, states[: m + 1]))
        # An accepted draft may be EOS, or the step may pass max_new: the output, and the step's
        # count, end there (tau counts the tokens a step adds to the answer, nothing after it).
        end = next((i + 1 for i, t in enumerate(full) if t in eos), len(full))
        new = full[: min(end, max_new - len(result.tokens))]
        result.tokens.extend(new)
        result.accepted.append(len(new))
        result.drafts.append(min(m, len(new)))
        # Its verdict past the drafts it accepted is known unless the answer ended before the first
        # draft it rejected: max_new cutting the bonus token alone leaves that rejection known (an EOS
        # among the accepted drafts does not: what the target would choose after it is no answer's).
        result.complete.append(len(new) == m + 1 or (len(new) == m and end == len(full)))
    return result


def load_prompts(path: str, tokenizer, limit: int | None, max_prompt_tokens: int,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 vocab_size: int | None = None) -> tuple[list[list[int]], int]:
    """Token ids of each prompt (chats rendered with the chat template, given `chat_template_kwargs`
    and the row's tools, as extraction renders them), and how many were skipped for length. A row
    that is neither a chat nor a prompt is an error naming its line, and so is one with a token
    the model cannot embed (beyond `vocab_size`: a device-side assert on CUDA, after the load)."""
    check_template_kwargs(tokenizer, chat_template_kwargs)  # before the first row: a typo is no row's fault
    if path == EMBEDDED_PROMPTS and not tokenizer.chat_template:  # its rows are chats: each would be passed over
        raise InputError("--prompts embedded holds chats, and the target's tokenizer has no chat template to render "
                         "them with: give --prompts a file of {\"prompt\": text} rows")
    prompts, skipped = [], 0
    for where, row in (_embedded_prompts() if path == EMBEDDED_PROMPTS else _prompt_rows(path)):
        if limit is not None and len(prompts) >= limit:
            break
        try:
            ids = _prompt_ids(row, tokenizer, where, chat_template_kwargs)
        except InputError:
            if path != EMBEDDED_PROMPTS:
                raise
            continue  # ShareGPT's own odd rows (no human turn: a bot's greeting alone) are no prompt of ours
        if not ids:  # nothing to prefill: the first forward would fail obscurely
            raise InputError(f"{where}: the prompt is empty (it tokenizes to no tokens)")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise InputError(f"{where} tokenizes to id {max(ids)}, beyond the model's vocabulary of {vocab_size} (the "
                             f"tokenizer has {len(tokenizer)} tokens): use the tokenizer the model was trained with, "
                             "or resize its embeddings")
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(ids)
    if not prompts:
        raise InputError(f"{path} has no usable prompts (all {skipped} over {max_prompt_tokens} tokens: raise "
                         "--max-prompt-tokens)" if skipped else f"{path} holds no prompt (no non-empty line)")
    return prompts, skipped


EMBEDDED_PROMPTS = "embedded"  # --prompts embedded: held-out chats of the Quickstart's packaged ShareGPT
EMBEDDED_HELD_OUT_FROM = 10_000  # its rows from here on: past any Quickstart extraction's (300 by default)


def _prompt_rows(path: str) -> Iterator[tuple[str, Any]]:
    """(where, row) of each non-empty line of a JSON-lines file."""
    with open(path, "rb") as f:
        for line_no, line in _lines(f, path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if line_no == 1 and line.lstrip().startswith("["):
                    raise _json_array(path) from None
                raise InputError(f"{path}:{line_no} is not JSON: {e}") from None
            if line_no == 1 and isinstance(row, list):  # an array on one line
                raise _json_array(path)
            yield f"{path}:{line_no}", row


def _json_array(path: str) -> InputError:
    return InputError(f"{path} is one JSON array (a dataset file, as `extract --dataset` reads): --prompts reads "
                      "JSON lines, a chat or {\"prompt\": text} a line; write the held-out rows one a line (or pass "
                      "--prompts embedded for the Quickstart's data)")


def _embedded_prompts() -> Iterator[tuple[str, Any]]:
    """(where, row) of the packaged ShareGPT's chats held out from the Quickstart's extraction."""
    from layertap.extract.embedded import sharegpt_conversations

    for i, row in enumerate(sharegpt_conversations()):
        if i >= EMBEDDED_HELD_OUT_FROM:
            yield f"the embedded ShareGPT's row {i}", row


def _past_context(prompts: list[list[int]], max_new_tokens: int, config: Any) -> int:
    """How many prompts, with the tokens decoded after them, run past the target's
    max_position_embeddings; a warning names them. Not refused, as extraction does not refuse
    --max-length past it (some targets serve longer, RoPE scaling), but a tau measured there is
    measured where the target was not trained."""
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int):
        return 0
    past = sum(len(ids) + max_new_tokens > context for ids in prompts)
    if past:
        log.warning("%d of %d prompts run past the target's max_position_embeddings %d with --max-new-tokens %d: "
                    "their tau is measured where the target was not trained; --max-prompt-tokens %d keeps them out",
                    past, len(prompts), context, max_new_tokens, max(1, context - max_new_tokens))
    return past


def _lines(f, path: str):
    """(line number, text) of each line of a UTF-8 file opened in binary; another encoding is an
    error naming the line (decoded by line, not by the chunk a text file reads)."""
    for line_no, raw in enumerate(f, 1):
        try:
            yield line_no, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{line_no} is not UTF-8 text ({e.reason} at column {e.start + 1}): write the "
                             "prompts as UTF-8 JSON lines") from None


def _prompt_ids(row: Any, tokenizer, where: str, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return tokenizer(row["prompt"])["input_ids"]
    raw = row.get("conversations", row.get("messages")) if isinstance(row, dict) else None
    if raw is None:
        raise InputError(f"{where}: expected {{\"prompt\": text}}, ShareGPT \"conversations\" or OpenAI \"messages\"")
    messages = normalize_chat(raw, where, TokenizeStats(), require_assistant=False)
    if isinstance(messages, Skipped):
        raise InputError(f"{where}: {messages.detail}")
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise InputError(f"{where}: the chat has no user turn to answer")
    if not tokenizer.chat_template:
        raise InputError(f"{where} is a chat, and the target's tokenizer has no chat template to render it with: "
                         "give the prompts as {\"prompt\": text} rows (tokenized as they are)")
    tools = tools_of(row, where)
    if isinstance(tools, Skipped):
        raise InputError(f"{where}: {tools.detail}")
    kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _recorded_template_kwargs(target: dict[str, Any], tokenizer, drafter_uri: str) -> dict[str, Any] | None:
    """The chat-template settings the drafter records, less those the tokenizer's template never
    reads (another --model, its template another's): not the user's typo to refuse, so dropped
    with a warning that says where they came from."""
    recorded = target.get("chat_template_kwargs") or None
    if unread := unread_template_kwargs(tokenizer, recorded):
        log.warning("the drafter at %s records chat-template settings %s (its training chats were rendered with "
                    "them), which this target's chat template never reads: its prompts are rendered without %s",
                    drafter_uri, json.dumps(recorded), ", ".join(unread))
        recorded = {k: v for k, v in recorded.items() if k not in unread} or None
    return recorded


def _eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    eos = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def _tau(runs: list[Decoded], block_size: int) -> tuple[float, list[float]]:
    """tau (tokens a verification step adds, mean) and, per draft position k, the share of steps
    that accepted at least k drafts. A step cut short (EOS or max_new) before its first rejection
    says nothing of the positions past its cut: it counts only where it reached, else each
    answer's last step would read as a rejection at every later position."""
    steps = [m for r in runs for m in r.accepted]
    if not steps:
        return float("nan"), []
    verdicts = [(d, c) for r in runs for d, c in zip(r.drafts, r.complete, strict=True)]
    per_position = []
    for k in range(1, block_size):
        known = [d >= k for d, complete in verdicts if complete or d >= k]
        per_position.append(sum(known) / len(known) if known else float("nan"))
    return sum(steps) / len(steps), per_position


def evaluate(drafter_uri: str, model: str | None, prompts_path: str, *, gguf_file: str | None = None, limit: int | None = None,
             max_new_tokens: int = 64, dtype: str = "float32", baseline: bool = True,
             max_prompt_tokens: int = 1024, device: str | None = None, step: int | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """tau of the drafter (and of an untrained one) on held-out prompts, and the greedy check.
    `model` None: the target the drafter records. `device`: where both models run; None takes
    the GPU when there is one. `chat_template_kwargs` None: those the drafter records (its
    training chats were rendered with them)."""
    t0 = time.time()
    if prompts_path != EMBEDDED_PROMPTS and not os.path.isfile(prompts_path):  # a typo should not cost the models' load
        raise InputError(f"the prompts file {prompts_path!r} does not exist (or is not a file)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config, weights = load_drafter_files(open_store(drafter_uri), step)
    if model is None:
        model, gguf_file = recorded_target(config.target, f"the drafter at {drafter_uri} was trained for",
                                           "the drafter's config")
    # the target's identity and the prompts first, from its config and tokenizer alone (the model on
    # the meta device, in a second): neither a wrong --model nor a bad row should cost the weights'
    # load, minutes at a 27B target
    planned = load_target(model, gguf_file, weights=False)
    check_drafter_target(config.target, planned.info, drafter_uri)
    if chat_template_kwargs is None:
        chat_template_kwargs = _recorded_template_kwargs(config.target, planned.tokenizer, drafter_uri)
    if chat_template_kwargs:
        log.info("chat template settings for the prompts: %s", json.dumps(chat_template_kwargs))
    prompts, skipped = load_prompts(prompts_path, planned.tokenizer, limit, max_prompt_tokens,
                                    chat_template_kwargs, planned.info["vocab_size"])
    past_context = _past_context(prompts, max_new_tokens, decoder_of(planned.model).config)
    if dtype == "float32" and device.startswith("cuda"):
        # The greedy check compares a block's verification (a hybrid's chunked Triton kernels) with
        # one-token steps (its recurrent kernel): Triton's float32 dots default to TF32 on GPUs that
        # have it, enough to flip a near-tied argmax. IEEE float32, unless the user chose (read at
        # each kernel's compile: set before the target's first forward).
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    torch_dtype = getattr(torch, dtype)
    target = load_target(model, gguf_file, dtype=torch_dtype, device=device)
    embed, head_w = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    # The drafter runs in the target's dtype and borrows its embed and head as they are: float32
    # copies of a bf16 27B target's took 2 x 4.7 GiB of the GPU, a float32 drafter 7.3 GiB more
    # (the untrained baseline's as much again), and under bf16 training ran its matmuls in bf16 too.
    head = TargetHead(embed.detach(), head_w.detach(), embed.data_ptr() == head_w.data_ptr())
    drafter = DFlashDrafter(config, head, device, torch_dtype)
    drafter.load_trainable(weights, drafter_uri)
    drafter.to(device=device, dtype=torch_dtype).eval()
    runner = TargetRunner(target.model, config.capture_layers)
    eos = _eos_ids(target.model, target.tokenizer)

    from tqdm import tqdm

    if baseline:
        torch.manual_seed(0)  # the same initial weights `layertap train` starts from
        fresh = DFlashDrafter(config, head, device, torch_dtype).to(device=device, dtype=torch_dtype).eval()

    trained, mismatches, untrained = [], [], []
    spec_s, rollback_s = 0.0, dict.fromkeys(runner.seconds, 0.0)  # the trained drafter's decoding only
    # Each prompt is decoded two or three times (speculative, plain greedy, the untrained baseline);
    # on a GPU the warm-up compiles the kernels (fla's Triton ones for hybrid targets): a minute
    # with nothing else to show.
    log.info("eval: %d prompts x %d new tokens on %s, each decoded speculatively, greedily%s; after an "
             "untimed warm-up%s", len(prompts), max_new_tokens, device,
             " and with an untrained drafter" if baseline else "",
             " (and kernel compilation)" if device.startswith("cuda") else "")
    if prompts:  # untimed: speculative_s (and the rollback's share of it) is the decoding's, not the warm-up's
        speculative_decode(runner, drafter, min(prompts, key=len), min(max_new_tokens, 2 * config.block_size), eos)
    bar = tqdm(prompts, desc="eval", unit="prompt", disable=None)
    for i, p in enumerate(bar):
        t, before = time.perf_counter(), dict(runner.seconds)
        spec = speculative_decode(runner, drafter, p, max_new_tokens, eos)
        spec_s += time.perf_counter() - t
        for k in rollback_s:
            rollback_s[k] += runner.seconds[k] - before[k]
        if spec.tokens != greedy_decode(runner, p, max_new_tokens, eos):
            mismatches.append(i)
        trained.append(spec)
        if baseline:
            untrained.append(speculative_decode(runner, fresh, p, max_new_tokens, eos))
        tau = _shown(_tau(trained, config.block_size)[0])  # NaN until a verification step: none yet
        bar.set_postfix(tau=tau, tok_s=f"{sum(len(r.tokens) for r in trained) / spec_s:.1f}")
        log.info("prompt %d/%d: tau so far %s%s", i + 1, len(prompts), tau,
                 f" (untrained {_shown(_tau(untrained, config.block_size)[0])})" if baseline else "")
    tau, per_position = _tau(trained, config.block_size)
    report: dict[str, Any] = {
        "tau": _known(tau), "acceptance_per_position": [_known(x) for x in per_position],
        "matches_greedy": not mismatches,
        "mismatched_prompts": mismatches, "prompts": len(prompts), "prompts_skipped_too_long": skipped,
        "prompts_past_context": past_context,
        "max_prompt_tokens": max_prompt_tokens, "chat_template_kwargs": chat_template_kwargs or None,
        "tokens_generated": sum(len(r.tokens) for r in trained),
        "verify_steps": sum(len(r.accepted) for r in trained), "block_size": config.block_size,
        "max_new_tokens": max_new_tokens, "speculative_s": round(spec_s, 3),
        "rollback_s": {k: round(v, 3) for k, v in rollback_s.items()} if runner.hybrid else None,
        "checkpoint_step": step, "drafter": drafter_uri,
        "target": model + (f" ({gguf_file})" if gguf_file else ""), "target_hybrid": runner.hybrid,
        "device": device, "dtype": dtype,
    }
    if baseline:
        report["tau_untrained"] = _known(_tau(untrained, config.block_size)[0])
    report["wall_s"] = round(time.time() - t0, 1)
    return report


def check_drafter_target(recorded: dict[str, Any], info: dict[str, Any], drafter_uri: str) -> None:
    """Refuse a target other than the one the drafter was trained for: one of the same vocabulary and
    width decoded to a tau without a word. Compared as training compares --model with the run's
    (`trainer.target_differences`); a drafter saved before its config recorded those facts is
    compared by model type alone, and only warned of (a copy of a model may live anywhere)."""
    from layertap.train.trainer import TARGET_FACTS, target_differences, warn_of_model_type

    given = info["model"] + (f" ({info['gguf_file']})" if info["gguf_file"] else "")
    was = str(recorded.get("model")) + (f" ({recorded['gguf_file']})" if recorded.get("gguf_file") else "")
    if any(recorded.get(k) is not None for k in TARGET_FACTS):
        warn_of_model_type(recorded, info, "the drafter's", given)
        diffs = target_differences(recorded, info, "the drafter's")
        if diffs and all(d.startswith("revision:") for d in diffs):
            # the hub's newer snapshot of the same model (a README commit), or a GGUF repo's own
            # revision: the config and tokenizer, where known, agree
            log.warning("the target %s is another revision than the drafter at %s was trained for (%s): its "
                        "config and tokenizer match", given, drafter_uri, diffs[0])
        elif diffs:
            raise InputError(f"the target {given} is not the one the drafter at {drafter_uri} was trained for "
                             f"({was}): {'; '.join(diffs)}. The drafter drafts from that model's states with its "
                             "embeddings and head: pass --model (and --gguf-file) with the model it was trained for")
    elif recorded.get("model_type") not in (None, info["model_type"]):
        log.warning("the target %s is a %r, but the drafter at %s was trained for a %r (%s): is --model the target "
                    "it was trained for? (its config, written before layertap recorded a target's hashes, names "
                    "only the model type)", given, info["model_type"], drafter_uri, recorded["model_type"], was)
    if recorded.get("chat_template_sha256") and info.get("chat_template_sha256") not in (
            None, recorded["chat_template_sha256"]):  # the weights are the same: not refused, but tau is of other text
        log.warning("the chat template of %s is not the one the drafter at %s was trained on chats rendered with "
                    "(sha256 %s, the drafter's %s): the prompts are rendered with this one, a text the drafter may "
                    "not have seen", given, drafter_uri, info["chat_template_sha256"][:12],
                    recorded["chat_template_sha256"][:12])


def _shown(tau: float) -> str:
    """A running tau for the progress line and log: "none yet" before any verification step."""
    return "none yet" if math.isnan(tau) else f"{tau:.3f}"


def _known(x: float) -> float | None:
    """`x`, or None where it is NaN (nothing measured it): JSON has no NaN, and strict parsers refuse it."""
    return None if math.isnan(x) else x


def format_report(r: dict[str, Any]) -> str:
    step = r.get("checkpoint_step")
    which = "exported" if step is None else f"its checkpoint at step {step}"
    hybrid = " (a hybrid: its recurrent state rolled back after each rejected draft)" if r.get("target_hybrid") else ""
    head = [f"drafter {r['drafter']} ({which}) on target {r['target']}{hybrid}, {r['device']} {r['dtype']}, up to "
            f"{counted(r['max_new_tokens'], 'new token')} a prompt"] if "drafter" in r else []
    if r["tau"] is None:  # the prefill gives the first new token; verification steps give the rest
        why = (f"--max-new-tokens {r['max_new_tokens']}: the prefill gives the first token, drafting starts after it"
               if r["max_new_tokens"] == 1 else "every answer ended at its first token, an end-of-sequence token")
        lines = [f"tau (mean acceptance length): none, no verification step in {counted(r['prompts'], 'prompt')} "
                 f"({why})"]
    else:
        lines = [f"tau (mean acceptance length): {r['tau']:.3f} over {r['verify_steps']} verification steps, "
                 f"{counted(r['prompts'], 'prompt')}, block {r['block_size']}"]
    if "tau_untrained" in r:
        untrained = r["tau_untrained"]
        lines.append(f"tau of an untrained drafter:  {'none' if untrained is None else f'{untrained:.3f}'}")
    rates = " ".join("n/a" if x is None else f"{x:.2f}" for x in r["acceptance_per_position"])
    lines.append(f"acceptance by draft position:  {rates or 'none (no draft was checked)'}")
    lines.append("output equals plain greedy decoding: " + ("yes" if r["matches_greedy"] else
                                                           f"NO (prompts {r['mismatched_prompts']})"))
    if r.get("rollback_s"):
        rb = r["rollback_s"]
        lines.append(f"hybrid target rollback: {sum(rb.values()):.1f} s of {r['speculative_s']:.1f} s of speculative "
                     f"decoding (snapshot {rb['snapshot']:.1f}, restore {rb['restore']:.1f}, "
                     f"re-forward {rb['reforward']:.1f})")
    if r.get("prompts_past_context"):
        lines.append(f"{r['prompts_past_context']} prompt(s) ran past the target's context with --max-new-tokens "
                     f"{r['max_new_tokens']} (see the warning)")
    if r["prompts_skipped_too_long"]:
        lines.append(f"skipped {r['prompts_skipped_too_long']} prompt(s) over {r['max_prompt_tokens']} tokens "
                     "(--max-prompt-tokens)")
    return "\n".join(head + lines)
