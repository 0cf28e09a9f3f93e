"""Planning's tokenization in worker processes (`extract.measure.token_statistics`): the very result
of a single pass, on real ShareGPT rows read from a file as the planner reads them, and its errors."""

from __future__ import annotations

import json

import datasets
import pytest

from layertap.extract import measure
from layertap.extract.embedded import sharegpt_conversations
from layertap.extract.inputs import load_rows
from layertap.extract.measure import PLAN_WORKERS_ENV, plan_workers, token_statistics
from layertap.storage.errors import ConfigError, InputError
from tiny_models import QWEN35_TEMPLATE, tiny_tokenizer


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_two_workers_give_the_serial_counts_stats_and_picks(tmp_path):
    """2,000 rows (some skipped, many truncated at 512 tokens) with a template that renders each
    assistant turn several times; picks are the same rows' samples, with the same ids and tokens."""
    rows = load_rows(_jsonl(tmp_path / "chats.jsonl", sharegpt_conversations(2000)))  # memory-mapped, as planned
    tok = tiny_tokenizer(QWEN35_TEMPLATE)
    serial, parallel = (token_statistics(rows, tok, 512, picks=16, pick_tokens=10**9, workers=w) for w in (1, 2))
    assert parallel.counts == serial.counts and len(serial.counts) == 2000
    for key in ("rows_read", "samples_read", "tokens_read", "supervised_read", "truncated", "skipped"):
        assert getattr(parallel, key) == getattr(serial, key), key
    assert serial.truncated and set(serial.skipped) >= {"empty", "no_supervised_pair"}
    assert [p.sample_id for p in parallel.picks] == [p.sample_id for p in serial.picks] and serial.picks
    for a, b in zip(parallel.picks, serial.picks):
        assert a.input_ids.equal(b.input_ids) and a.loss_mask.equal(b.loss_mask) and a.truncated == b.truncated
        assert len(a) == parallel.counts[int(a.sample_id.split("-")[0])]  # the row the workers counted


def test_a_row_error_in_a_worker_is_the_serial_error(tmp_path):
    """The first bad row is reported, as by a single pass, though a later chunk may fail first."""
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]} for _ in range(2000)]
    rows[1200]["input_ids"] = rows[1900]["input_ids"] = [1, 2, 999]
    data = load_rows(_jsonl(tmp_path / "tokens.jsonl", rows))
    errors = []
    for workers in (1, 2):
        with pytest.raises(InputError) as e:
            token_statistics(data, tiny_tokenizer(), 64, vocab_size=100, workers=workers)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and errors[0].startswith("row 1200 (1200): token id 999")


def test_small_datasets_stay_in_this_process(monkeypatch):
    def no_processes(*_):
        raise AssertionError("worker processes started for a small dataset")

    monkeypatch.setattr(measure, "_tally_in_processes", no_processes)
    rows = datasets.Dataset.from_list(list(sharegpt_conversations(20)))
    stats = token_statistics(rows, tiny_tokenizer(), 64, workers=8)
    assert len(stats.counts) == 20


def test_plan_workers_setting(monkeypatch):
    monkeypatch.delenv(PLAN_WORKERS_ENV, raising=False)
    assert 1 <= plan_workers() <= measure.MAX_PLAN_WORKERS
    monkeypatch.setenv(PLAN_WORKERS_ENV, "3")
    assert plan_workers() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv(PLAN_WORKERS_ENV, bad)
        with pytest.raises(ConfigError, match=PLAN_WORKERS_ENV):
            plan_workers()
