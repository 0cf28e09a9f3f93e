"""Foreign sample files that lie or are damaged (a helper's review of the import readers): a 3 KB
torch.save declaring 50M tokens through a view that repeats one row, sparse tensors, a gzip bomb,
a flipped byte in a torch.save zip (whose reader checks no CRC), token ids as fractions and states
as integers, a name not in UTF-8, an empty first file, a loss mask longer than its ids, a
speculators dataset with a null row or string ids, an export note of the wrong shape. Each is
refused or skipped naming the file, in bounded memory; none fails a whole shard on every retry,
is imported as other values, or ends in a traceback."""

from __future__ import annotations

import gzip
import io
import json
import os
import zipfile
from pathlib import Path

import datasets
import pytest
import torch

from layertap.cli import main as cli
from layertap.extract.interop import EXPORT_NOTE
from layertap.storage.foreign import natural_key, save_torch
from test_interop_import_checks import LAYERS, imported, sample, write_files
from tiny_models import tiny_model_dir

T_BIG = 50_000_000  # tokens a view of one row declares: 12.8 GB of states once made whole


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


def _import(src: str, fmt: str, out: str, target: str, *more: str) -> int:
    return cli(["import", src, "--from", fmt, "--out", out, "--layers", LAYERS[fmt], "--model", target, *more])


def _one_skipped(out: str, reason: str, detail: str) -> None:
    stored, skipped = imported(out)
    assert len(stored) == 2 and len(skipped) == 1, skipped
    assert skipped[0]["reason"] == reason and detail in skipped[0]["detail"], skipped[0]


def _flip_in_zip(raw: bytes, member_suffix: str) -> bytes:
    """One bit of a member's data flipped, its local header and CRC left as they were."""
    info = next(i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith(member_suffix))
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    at = info.header_offset + 30 + name_len + extra_len + 5
    return raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1:]


@pytest.mark.parametrize("damage", ["repeated view", "sparse", "fractional ids", "integer states", "flipped byte"])
def test_a_lying_or_damaged_modelopt_file_is_skipped_naming_it(qwen3, tmp_path, capsys, damage):
    src = write_files(tmp_path / "src", "modelopt", [sample(i) for i in range(3)])
    path = Path(src) / "s1.pt"
    d = torch.load(path, weights_only=True)
    if damage == "repeated view":  # 3 KB on disk
        d = {"input_ids": torch.zeros(1, dtype=torch.int64).expand(T_BIG),
             "aux_hidden_states": torch.zeros(1, 128).expand(T_BIG, 128),
             "hidden_states": torch.zeros(1, 64).expand(T_BIG, 64),
             "loss_mask": torch.ones(1, dtype=torch.int64).expand(T_BIG)}
        want = "a view repeating its data"
    elif damage == "sparse":
        d["aux_hidden_states"] = d["aux_hidden_states"].float().to_sparse()
        want = "aux_hidden_states is a sparse_coo tensor, not a dense one"
    elif damage == "fractional ids":
        d["input_ids"] = d["input_ids"].double() + 0.9
        want = "input_ids is float64, not token ids (integers)"
    elif damage == "integer states":
        d["aux_hidden_states"] = d["aux_hidden_states"].to(torch.int16)
        want = "aux_hidden_states is int16, not states (floating point)"
    if damage == "flipped byte":
        raw = _flip_in_zip(path.read_bytes(), "data/2")
        want = "fails its CRC: the file is corrupt"
    else:
        raw = save_torch(d)
    path.write_bytes(raw)
    out = str(tmp_path / "out")
    assert _import(src, "modelopt", out, qwen3) == 0, capsys.readouterr().err[-3000:]
    _one_skipped(out, "unreadable", want)
    assert "s1.pt" in imported(out)[1][0]["detail"]


def test_a_gzip_bomb_is_refused_before_it_is_decompressed_and_zero_padding_is_not(qwen3, tmp_path, monkeypatch):
    """A 64 KB file of 64 MiB of zeros (1,000x): decompressed whole, a 1 MB one held 2 GB. The bound
    (4 GiB, or 128x where more) is taken down to 16 MiB here; a short sample zero-padded to 4,096
    tokens grows ~400x, and is read (a bound of 128x alone refused it)."""
    from layertap.storage import foreign

    monkeypatch.setattr(foreign, "GUNZIP_FLOOR", 16 << 20)
    src = write_files(tmp_path / "src", "specforge", [sample(i) for i in range(4)])
    folder = Path(src) / "rows_0-2000"
    (folder / "data_1.ckpt").unlink()
    (folder / "data_1.ckpt.gz").write_bytes(gzip.compress(b"\0" * (64 << 20)))
    padded = torch.load(folder / "data_2.ckpt", weights_only=True)
    states = padded["hidden_states"]
    padded["hidden_states"] = torch.cat([states, states.new_zeros(1, 4096 - states.shape[1], states.shape[2])], 1)
    (folder / "data_2.ckpt").unlink()
    compressed = gzip.compress(save_torch(padded))
    assert len(save_torch(padded)) > 128 * len(compressed)
    (folder / "data_2.ckpt.gz").write_bytes(compressed)
    out = str(tmp_path / "out")
    assert _import(src, "specforge", out, qwen3) == 0
    stored, skipped = imported(out)
    assert len(stored) == 3 and len(skipped) == 1 and "rows_0-2000/data_2" in {s.sample_id for s in stored}
    assert skipped[0]["reason"] == "unreadable" and "decompresses to more than 16,777,216 bytes" in skipped[0]["detail"]


def test_a_torch_save_written_without_crcs_is_read(qwen3, tmp_path):
    """torch.serialization.set_crc32_options(False), which writers of large dumps use, records CRC 0
    for every entry: the CRC check refused each such file as corrupt."""
    src = write_files(tmp_path / "src", "modelopt", [sample(i) for i in range(3)])
    path = Path(src) / "s1.pt"
    d = torch.load(path, weights_only=True)
    torch.serialization.set_crc32_options(False)
    try:
        path.write_bytes(save_torch(d))
    finally:
        torch.serialization.set_crc32_options(True)
    assert not any(i.CRC for i in zipfile.ZipFile(path).infolist())
    out = str(tmp_path / "out")
    assert _import(src, "modelopt", out, qwen3) == 0
    assert len(imported(out)[0]) == 3


def test_a_loss_mask_longer_than_its_ids_past_zero_padding_is_skipped(qwen3, tmp_path):
    """Cut to the ids' length without a look: ten supervised tokens of nothing went away silently."""
    src = write_files(tmp_path / "src", "specforge", [sample(i) for i in range(3)])
    path = Path(src) / "rows_0-2000" / "data_1.ckpt"
    d = torch.load(path, weights_only=True)
    d["loss_mask"] = torch.cat([d["loss_mask"], torch.ones(10, dtype=d["loss_mask"].dtype)])
    path.write_bytes(save_torch(d))
    out = str(tmp_path / "out")
    assert _import(src, "specforge", out, qwen3) == 0
    _one_skipped(out, "unreadable", "loss_mask covers 34 tokens, input_ids 24, and its values past them are not zero")


def test_a_file_name_not_in_utf8_is_imported(qwen3, tmp_path):
    src = write_files(tmp_path / "src", "modelopt", [sample(i) for i in range(3)])
    os.rename(os.fsencode(os.path.join(src, "s1.pt")), os.fsencode(src) + b"/s\xff1.pt")
    out = str(tmp_path / "out")
    assert _import(src, "modelopt", out, qwen3) == 0
    stored = imported(out)[0]
    assert len(stored) == 3 and "s\\xff1" in {s.sample_id for s in stored}  # its bytes written out: printable
    assert natural_key("s1\u00b22.pt") == ["s", 1, "\u00b2", 2, ".pt"]  # a superscript two is no decimal digit


def test_an_empty_first_file_does_not_plan_the_import_as_one_shard(qwen3, tmp_path):
    """The first file's tokens per byte sized the others: 0 made every file one token, and 40 files
    of 200 tokens one shard 13x the size asked."""
    src = tmp_path / "src" / "rows_0-2000"
    src.mkdir(parents=True)
    for i in range(40):
        s, t = sample(i, tokens=200), 0 if i == 0 else 200
        (src / f"data_{i}.ckpt").write_bytes(save_torch({"input_ids": s.input_ids[:t], "loss_mask": s.loss_mask[:t],
                                                         "hidden_states": s.hidden_states[:t].reshape(1, t, 128)}))
    out = tmp_path / "out"
    assert _import(str(tmp_path / "src"), "specforge", str(out), qwen3, "--shard-bytes", "100KB") == 0
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) > 5


@pytest.mark.parametrize("damage", ["null row", "string ids", "seq_len 0", "a row less"])
def test_a_malformed_speculators_dataset_names_its_row_or_column(qwen3, tmp_path, capsys, caplog, damage):
    """"seq_len 0": the column the plan counted tokens by, beside token ids the import reads: planned as
    a row the import skips, its record made the commit hold more than the plan, refused on every retry;
    a wrong seq_len everywhere planned all rows into one shard. The plan counts the ids, and says so.
    "a row less": a hidden-state file no row names was left out without a word."""
    src = write_files(tmp_path / "src", "speculators", [sample(i) for i in range(3)])
    rows = datasets.load_from_disk(src)
    rows = rows.to_list()
    if damage == "null row":
        rows[1]["input_ids"] = None
    elif damage == "seq_len 0":
        assert rows[1]["seq_len"] > 0
        rows[1]["seq_len"] = 0
    elif damage == "a row less":
        rows = rows[:2]
    else:
        for r in rows:
            r["input_ids"] = [str(i) for i in r["input_ids"]]
    for name in os.listdir(src):
        if name != "hidden_states":
            os.remove(os.path.join(src, name))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in os.listdir(tmp_path / "saved"):
        os.rename(tmp_path / "saved" / name, os.path.join(src, name))
    out = str(tmp_path / "out")
    code = _import(src, "speculators", out, qwen3)
    if damage == "null row":  # that row alone: skipped, named
        assert code == 0, capsys.readouterr().err[-3000:]
        _one_skipped(out, "unreadable", "row 1 of the speculators dataset")
    elif damage == "seq_len 0":  # the import reads the ids: every row imported
        assert code == 0, capsys.readouterr().err[-3000:]
        assert len(imported(out)[0]) == 3
        assert "1 row(s) hold another number of input_ids than their seq_len (row 1: " in caplog.text
    elif damage == "a row less":
        assert code == 0 and len(imported(out)[0]) == 2
        assert "holds 1 file(s) beside the hidden states of the dataset's 2 rows: no row names them" in caplog.text
    else:  # every row: the import is refused before anything is written
        assert code == 2 and "its column input_ids is List(Value('string'))" in capsys.readouterr().err
        assert not os.path.exists(out)


def test_an_export_note_of_the_wrong_shape_is_named(qwen3, tmp_path, capsys):
    src = write_files(tmp_path / "src", "specforge", [sample(i) for i in range(3)])
    note = Path(src) / EXPORT_NOTE
    note.write_text(json.dumps({"format": "specforge", "specforge_layer_ids": 5, "hidden_size": 64}))
    assert _import(src, "specforge", str(tmp_path / "out"), qwen3) == 2
    assert f"{src}/{EXPORT_NOTE} is corrupt: its specforge_layer_ids is 5" in capsys.readouterr().err
    note.write_text("[" * 100_000 + "]" * 100_000)  # unreadable: taken for absent, as a cut-short one is
    assert _import(src, "specforge", str(tmp_path / "out2"), qwen3) == 0
