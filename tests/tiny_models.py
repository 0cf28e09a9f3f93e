"""Real, tiny parts for the extractor's tests: a trained byte-level BPE tokenizer with chat
templates, random-init HF models of the target architectures, and SmolLM2's GGUF tokenizer.

Everything is built in-process in well under a second (no hub access), except SmolLM2's
tokenizer: it comes from the HF folder converted once from the GGUF (tests/activations.py).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from activations import smollm2_folder  # noqa: E402

# Qwen2.5-style ChatML: every turn rendered the same wherever it sits in the chat.
CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Qwen3-style: assistant turns after the last user turn get a think block and trimmed content,
# so an assistant turn renders differently once a later user turn follows it.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<think>\n' + (m.get('reasoning_content') or '') + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- m['content'] | trim -}}{{- '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Qwen3.5/3.6-style: QWEN3_TEMPLATE's turns, and a generation prompt that opens the think block
# (or writes an empty one with enable_thinking=False), which no earlier turn of the chat holds.
QWEN35_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}"
    "{%- else -%}{{- '<think>\n' -}}{%- endif -%}{%- endif -%}")
assert QWEN35_TEMPLATE != QWEN3_TEMPLATE

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
_CORPUS = [
    "Hello there! How are you today? I am fine, thanks for asking.",
    "The quick brown fox jumps over the lazy dog. def main(): return 42",
    "Speculative decoding drafts tokens that the target model verifies in one step.",
    "user assistant system: you are a helpful assistant.\n\n  1. 2. 3.",
]


@functools.lru_cache(maxsize=None)
def _trained_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return tok.to_str()


def tiny_tokenizer(chat_template: str = CHATML_TEMPLATE):
    """A byte-level BPE tokenizer (a few hundred tokens, ChatML specials) with ``chat_template``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_bpe()),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = chat_template
    return tok


def tiny_model_dir(root: Path, model_type: str, num_layers: int = 6, seed: int = 0, hidden_size: int = 64,
                   **config) -> str:
    """Save a random-init ``model_type`` (qwen3, qwen3_5_text, llama) and its tokenizer to a folder;
    `config` overrides the config's values (e.g. Granite's logits_scaling).

    A wider ``hidden_size`` makes more bytes per token at almost no extra compute (the MLP and
    attention stay narrow): shards of several S3 parts from a few thousand tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    kw = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=num_layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if model_type == "qwen3_5_text":
        # Default pattern: three gated-deltanet layers, then one full-attention layer.
        kw.update(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4)
    config = AutoConfig.for_model(model_type, **{**kw, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    folder = root / (f"{model_type}-{num_layers}L" + (f"-h{hidden_size}" if hidden_size != 64 else ""))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (and chat template), as `load_target` converted it from
    the GGUF into the cached HF folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder())
