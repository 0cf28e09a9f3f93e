"""`layertap eval`'s inputs: what cannot be decoded is refused up front, naming the row or flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layertap.cli import main as cli
from layertap.storage.errors import ConfigError, InputError
from layertap.train.speculative import load_prompts
from tiny_models import tiny_tokenizer


class _NoIds:
    """A tokenizer that gives no ids for blank text (as some do), one id a word otherwise."""

    def __call__(self, text: str, **_) -> dict[str, list[int]]:
        return {"input_ids": [7] * len(text.split())}


@pytest.mark.parametrize("row, tokenizer", [('{"prompt": ""}', tiny_tokenizer), ('{"prompt": " "}', _NoIds)])
def test_an_empty_prompt_is_an_error_naming_its_line(tmp_path, row, tokenizer):
    """An empty prompt has nothing to prefill: without the check the first forward fails obscurely."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there"}\n' + row + "\n")
    with pytest.raises(InputError, match=rf"{path}:2: the prompt is empty"):
        load_prompts(str(path), tokenizer(), None, 1024)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_new_tokens_below_one_is_refused(tmp_path, capsys, value):
    """Decoding emits one token before it checks the limit, so 0 would silently generate one."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    assert cli(["eval", "--drafter", str(tmp_path / "none"), "--prompts", str(prompts),
                "--max-new-tokens", value]) == 2
    assert f"--max-new-tokens must be at least 1, got {value}" in capsys.readouterr().err


def test_a_missing_prompts_file_is_refused_before_any_model_loads(tmp_path, capsys):
    """It was a FileNotFoundError traceback after the target had loaded (minutes for a large one)."""
    missing = tmp_path / "nope.jsonl"
    assert cli(["eval", "--drafter", str(tmp_path / "no-drafter"), "--prompts", str(missing)]) == 2
    assert f"the prompts file '{missing}' does not exist" in capsys.readouterr().err


def test_the_prompt_length_limit_is_a_flag_and_named_where_it_skips(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there, how are you today"}\n')
    with pytest.raises(InputError, match="all 1 over 3 tokens: raise --max-prompt-tokens"):
        load_prompts(str(prompts), tiny_tokenizer(), None, 3)
    (tmp_path / "empty.jsonl").write_text("\n")  # not "skipped 0 over 3 tokens"
    with pytest.raises(InputError, match="empty.jsonl holds no prompt"):
        load_prompts(str(tmp_path / "empty.jsonl"), tiny_tokenizer(), None, 3)
    assert cli(["eval", "--drafter", str(tmp_path / "none"), "--prompts", str(prompts),
                "--max-prompt-tokens", "0"]) == 2
    assert "--max-prompt-tokens must be at least 1, got 0" in capsys.readouterr().err


def test_a_bad_prompt_row_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """Rows were read after the target's weights had loaded: minutes at a 27B target, then the error."""
    from types import SimpleNamespace

    from layertap.train import speculative
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path, "llama", num_layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n[1, 2]\n')
    loads: list[bool] = []
    real = speculative.load_target

    def load_target(*args, weights=True, **kwargs):
        loads.append(weights)
        return real(*args, weights=weights, **kwargs)

    monkeypatch.setattr(speculative, "load_drafter_files", lambda store, step: (SimpleNamespace(target={}), {}))
    monkeypatch.setattr(speculative, "load_target", load_target)
    with pytest.raises(InputError, match=f"{prompts}:2"):
        speculative.evaluate(str(tmp_path / "drafter"), model, str(prompts))
    assert loads == [False]  # the tokenizer alone (the model on the meta device), never the weights


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_limit_below_one_is_refused_naming_the_flag(tmp_path, capsys, value):
    """--limit 0 read no prompt and then said the prompts file "has no usable prompts"."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    assert cli(["eval", "--drafter", str(tmp_path / "none"), "--prompts", str(prompts), "--limit", value]) == 2
    assert f"--limit must be at least 1 prompt, got {value}" in capsys.readouterr().err


def test_no_verification_step_gives_a_null_tau_in_strict_json_and_says_why(tmp_path, capsys, caplog):
    """--max-new-tokens 1: the prefill gives the one token, no step verifies a draft, and tau was
    printed as NaN, which strict JSON parsers refuse."""
    import json

    from layertap.storage.store import open_store
    from layertap.train.checkpoint import export_drafter
    from layertap.train.drafter import DFlashDrafter, default_config
    from layertap.train.target_head import load_target_head
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path, "llama", num_layers=2)
    head = load_target_head(model)
    drafter = DFlashDrafter(default_config(head, [0, 1], mask_token_id=3, block_size=4), head)
    out = str(tmp_path / "drafter")
    export_drafter(open_store(out), drafter)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    args = ["eval", "--drafter", out, "--model", model, "--prompts", str(prompts), "--max-new-tokens", "1"]
    assert cli([*args, "--json"]) == 0

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    report = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert report["tau"] is None and report["tau_untrained"] is None and report["verify_steps"] == 0
    with caplog.at_level("INFO"):
        assert cli([*args, "--no-baseline"]) == 0
    assert "prompt 1/1: tau so far none yet" in caplog.text  # it logged nan
    out = capsys.readouterr().out
    assert ("tau (mean acceptance length): none, no verification step in 1 prompt (--max-new-tokens 1: the "
            "prefill gives the first token, drafting starts after it)") in out
    assert "acceptance by draft position:  none (no draft was checked)" in out  # it printed nothing after it


def test_a_bf16_eval_runs_the_drafter_in_bf16_on_the_targets_own_embed_and_head(tmp_path, monkeypatch):
    """No float32 copies of a bf16 target's embed and head (2 x 4.7 GiB at a 27B target's
    vocabulary) and no float32 drafter beside it: the drafter runs in the target's dtype and
    borrows its tensors as they are."""
    from layertap.storage.store import open_store
    from layertap.train import speculative
    from layertap.train.checkpoint import export_drafter
    from layertap.train.drafter import DFlashDrafter, default_config
    from layertap.train.target_head import load_target_head
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path, "llama", num_layers=2)
    head = load_target_head(model)
    out = str(tmp_path / "drafter")
    export_drafter(open_store(out), DFlashDrafter(default_config(head, [0, 1], mask_token_id=3, block_size=4), head))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    built: list[DFlashDrafter] = []

    class Recorded(DFlashDrafter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    targets = []
    real = speculative.load_target
    monkeypatch.setattr(speculative, "DFlashDrafter", Recorded)
    monkeypatch.setattr(speculative, "load_target", lambda *a, **k: targets.append(real(*a, **k)) or targets[-1])
    report = speculative.evaluate(out, model, str(prompts), max_new_tokens=6, dtype="bfloat16", device="cpu")
    assert report["verify_steps"] > 0 and len(built) == 2  # the trained drafter and the untrained baseline
    target_embed = targets[-1].model.get_input_embeddings().weight
    for d in built:
        assert all(p.dtype == torch.bfloat16 for p in d.parameters())
        assert d.embed.data_ptr() == target_embed.data_ptr()  # borrowed, not copied


def test_an_eval_whose_every_answer_ends_at_once_measures_nothing_and_says_so(tmp_path, capsys):
    """An instruct target given {"prompt": ...} rows (plain text, no chat template) may end every
    answer at its first token: eval printed "tau: none" and exited 0, a result to go on with."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layertap.storage.store import open_store
    from layertap.train.checkpoint import export_drafter
    from layertap.train.drafter import DFlashDrafter, default_config
    from layertap.train.target_head import load_target_head
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path, "llama", num_layers=2)
    target, tok = AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    with torch.no_grad():  # the token greedy decoding answers with first becomes the end-of-sequence token
        first = int(target(torch.tensor([tok("hello there")["input_ids"]])).logits[0, -1].argmax())
    config = json.loads((Path(model) / "config.json").read_text())
    (Path(model) / "config.json").write_text(json.dumps({**config, "eos_token_id": first}))
    (Path(model) / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    head = load_target_head(model)
    out = str(tmp_path / "drafter")
    export_drafter(open_store(out), DFlashDrafter(default_config(head, [0, 1], mask_token_id=3, block_size=4), head))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    assert cli(["eval", "--drafter", out, "--model", model, "--prompts", str(prompts), "--no-baseline"]) == 1
    captured = capsys.readouterr()
    assert "every answer ended at its first token, an end-of-sequence token" in captured.out
    assert "tau was not measured" in captured.err and "without the chat template" in captured.err


def test_a_chat_for_a_tokenizer_without_a_template_and_a_file_not_in_utf8_are_errors_naming_the_line(tmp_path):
    """Both were tracebacks (transformers' ValueError; a UnicodeDecodeError from the default encoding)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(InputError, match=rf"{path}:2 is a chat, and the target's tokenizer has no chat template"):
        load_prompts(str(path), tokenizer, None, 1024)
    assert load_prompts(str(path), tokenizer, 1, 1024)[0]  # plain prompts need no template
    path.write_bytes('{"prompt": "hello"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(InputError, match=rf"{path}:2 is not UTF-8 text \(invalid continuation byte at column 16\)"):
        load_prompts(str(path), tiny_tokenizer(), None, 1024)


def test_prompts_are_rendered_as_training_chats_were_with_its_template_settings_and_tools(tmp_path):
    """Extraction renders a regeneration's chats with its --chat-template-kwargs (Qwen3.6's
    enable_thinking false: an empty think block before the answer) and a row's tools; eval rendered
    every prompt without either, a text the drafter never saw (tau measured on another
    distribution, the greedy check none the wiser)."""
    from tiny_models import QWEN35_TEMPLATE

    tools_template = "{%- if tools -%}{{- 'TOOLS ' + tools[0]['name'] + '\n' -}}{%- endif -%}" + QWEN35_TEMPLATE
    tokenizer = tiny_tokenizer(tools_template)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there"}],
                                "tools": json.dumps([{"name": "search"}])}) + "\n")
    text = lambda ids: tokenizer.decode(ids[0])  # noqa: E731
    default = text(load_prompts(str(path), tokenizer, None, 1024)[0])
    assert default.startswith("TOOLS search\n") and default.endswith("<|im_start|>assistant\n<think>\n")
    no_thinking = text(load_prompts(str(path), tokenizer, None, 1024, {"enable_thinking": False})[0])
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # a setting the template never reads (a typo): refused, naming it and those the template reads
    with pytest.raises(ConfigError, match=r"sets 'enable_thinkng', which the chat template .* never reads \(the "
                                          r"settings it reads: enable_thinking, tools\)"):
        load_prompts(str(path), tokenizer, None, 1024, {"enable_thinkng": False})
    # ... but settings the drafter records, under a --model whose template reads none of them, are not the user's
    # typo: dropped, with a warning naming where they came from
    from layertap.train.speculative import _recorded_template_kwargs

    recorded = {"chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True}}
    assert _recorded_template_kwargs(recorded, tokenizer, "d") == {"enable_thinking": False}
    assert _recorded_template_kwargs(recorded, tiny_tokenizer(), "d") is None


def test_a_prompt_token_the_model_cannot_embed_is_refused_naming_the_line(tmp_path):
    """A tokenizer with added tokens the model has no rows for: an IndexError on CPU, a device-side
    assert on CUDA, after the weights loaded. Refused as extraction refuses such rows."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<|tool_call|>"])
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": "call <|tool_call|>"}\n')
    vocab = len(tokenizer) - 1
    with pytest.raises(InputError, match=rf"{path}:2 tokenizes to id {vocab}, beyond the model's vocabulary of {vocab}"):
        load_prompts(str(path), tokenizer, None, 1024, vocab_size=vocab)


def test_prompts_that_run_past_the_targets_context_are_counted_and_warned_of(tmp_path, capsys, caplog):
    """A prompt plus its new tokens past max_position_embeddings was decoded and counted into tau
    in silence (extraction warns of --max-length past it)."""
    from layertap.storage.store import open_store
    from layertap.train.checkpoint import export_drafter
    from layertap.train.drafter import DFlashDrafter, default_config
    from layertap.train.target_head import load_target_head
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path, "llama", num_layers=2, max_position_embeddings=32)
    head = load_target_head(model)
    drafter = DFlashDrafter(default_config(head, [0, 1], mask_token_id=3, block_size=4), head)
    out = str(tmp_path / "drafter")
    export_drafter(open_store(out), drafter)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n' + json.dumps({"prompt": "word " * 30}) + "\n")
    args = ["eval", "--drafter", out, "--model", model, "--prompts", str(prompts), "--max-new-tokens", "8",
            "--no-baseline"]
    with caplog.at_level("WARNING"):
        assert cli([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompts_past_context"] == 1
    assert ("1 of 2 prompts run past the target's max_position_embeddings 32 with --max-new-tokens 8: their tau is "
            "measured where the target was not trained; --max-prompt-tokens 24 keeps them out") in caplog.text
    assert cli([*args, "--max-prompt-tokens", "24"]) == 0
    assert "past the target's context" not in capsys.readouterr().out


@pytest.mark.parametrize("device, said", [("foo", "is not a device torch knows"),
                                          ("cuda:99", "CUDA GPU")])
def test_a_device_that_is_not_here_is_refused_before_anything_loads(tmp_path, capsys, device, said):
    """A typo in --device, or a GPU the machine lacks, was a traceback from inside the target's
    load, after the drafter and the prompts had been read."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    assert cli(["eval", "--drafter", str(tmp_path / "none"), "--prompts", str(prompts), "--device", device]) == 2
    assert f"--device {device!r}" in (err := capsys.readouterr().err) and said in err


def test_a_dataset_file_given_as_prompts_is_named_a_json_array(tmp_path):
    """The Quickstart's own kind of file (one JSON array, as `extract --dataset` reads) was refused with
    a bare "prompts.json:1 is not JSON: Expecting value: line 2 column 1"."""
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}], indent=1))
    for indent in (1, None):  # on many lines, or on one
        path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}], indent=indent))
        with pytest.raises(InputError, match=r"chats.json is one JSON array \(a dataset file, as `extract --dataset` "
                                             r"reads\): --prompts reads JSON lines"):
            load_prompts(str(path), tiny_tokenizer(), None, 1024)


def test_embedded_prompts_are_the_packaged_sharegpts_chats_held_out_from_the_quickstart(caplog):
    """The Quickstart (the packaged SmolLM2 over its ShareGPT's first 300 chats) left a new user no
    held-out prompts for `eval`: `--prompts embedded` takes that file's chats from row 10,000 on."""
    from layertap.extract.embedded import sharegpt_conversations
    from layertap.train.speculative import EMBEDDED_HELD_OUT_FROM

    tokenizer = tiny_tokenizer()
    prompts, _ = load_prompts("embedded", tokenizer, 3, 4096)
    assert len(prompts) == 3
    rows = [r for i, r in enumerate(sharegpt_conversations(EMBEDDED_HELD_OUT_FROM + 50)) if i >= EMBEDDED_HELD_OUT_FROM]
    firsts = [next(t["value"] for t in r["conversations"] if t["from"] == "human") for r in rows]
    assert all(any(f[:20] in tokenizer.decode(p) for f in firsts) for p in prompts)  # held-out rows' chats
    tokenizer.chat_template = None  # each row would be passed over, and "embedded holds no prompt" said
    with pytest.raises(InputError, match="--prompts embedded holds chats, and the target's tokenizer has no chat "
                                         "template"):
        load_prompts("embedded", tokenizer, 3, 4096)


def test_trainings_closing_hint_names_embedded_prompts_for_a_run_of_the_packaged_data(tmp_path):
    import fake_worker
    from layertap.manifests import layout
    from layertap.manifests.manifest import load_manifest
    from layertap.storage.store import open_store
    from layertap.train.trainer import _on_embedded_data

    store = open_store(str(tmp_path / "run"))
    fake_worker.plan(store)
    assert not _on_embedded_data(load_manifest(store))
    manifest = json.loads(store.get(layout.MANIFEST))
    for limit, held_out in ((300, True), (None, False), (20_000, False)):  # the Quickstart's, or its rows >= 10,000
        dataset = {**manifest["dataset"], "path": "embedded", "limit": limit}
        store.put(layout.MANIFEST, json.dumps({**manifest, "dataset": dataset}).encode())
        assert _on_embedded_data(load_manifest(store)) is held_out, limit
