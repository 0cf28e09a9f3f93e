"""`--dataset` as a folder of data files (a Hugging Face Hub download) or a glob of them: which
files a run reads, in which order, what pins them, and what is refused with the glob to give."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.cli import main as cli
from layertap.extract.fingerprint import dataset_fingerprint
from layertap.extract.inputs import load_rows
from layertap.storage.errors import InputError, MissingInput
from layertap.storage.store import open_store


def _chats(start: int, n: int) -> pa.Table:
    return pa.Table.from_pylist([{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}?"},
                                                             {"role": "assistant", "content": f"answer {i} " * 3}]}
                                 for i in range(start, start + n)])


def hub_download(root: Path) -> Path:
    """A dataset as `hf download --repo-type dataset ... --local-dir` leaves it: two splits in the
    Hub's shard names, a README, .gitattributes and hf's .cache/ of download metadata (with a stray
    parquet file that is no part of the dataset)."""
    (root / "data").mkdir(parents=True)
    pq.write_table(_chats(0, 6), root / "data" / "train_sft-00000-of-00002.parquet")
    pq.write_table(_chats(6, 5), root / "data" / "train_sft-00001-of-00002.parquet")
    pq.write_table(_chats(100, 4), root / "data" / "test_sft-00000-of-00001.parquet")
    (root / "README.md").write_text("# chats\n")
    (root / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    meta = root / ".cache" / "huggingface" / "download" / "data"
    meta.mkdir(parents=True)
    (meta / "train_sft-00000-of-00002.parquet.metadata").write_text("abc\n")
    pq.write_table(_chats(200, 1), meta.parent / "stray.parquet")
    return root


def test_a_hub_download_with_several_splits_is_refused_naming_the_glob_of_its_train_split(tmp_path):
    root = hub_download(tmp_path / "ultrachat")
    with pytest.raises(InputError) as e:
        load_rows(str(root))
    glob = f"{root}/data/train_sft-*.parquet"
    assert "holds the splits test_sft, train_sft" in str(e.value) and f"--dataset '{glob}'" in str(e.value)
    rows = load_rows(glob)  # the glob it names: that split's two files, in name order, nothing else
    assert rows["id"] == [f"c{i}" for i in range(11)]
    assert len(load_rows(glob, 4)) == 4


def test_a_folder_of_one_split_is_read_whole_in_name_order(tmp_path):
    root = tmp_path / "chats"
    (root / "part").mkdir(parents=True)
    pq.write_table(_chats(5, 3), root / "part" / "b.parquet")
    pq.write_table(_chats(0, 5), root / "part" / "a.parquet")
    (root / ".cache").mkdir()
    pq.write_table(_chats(99, 1), root / ".cache" / "c.parquet")  # a hidden folder's file: not data
    assert load_rows(str(root))["id"] == [f"c{i}" for i in range(8)]
    with open(root / "extra.jsonl", "w") as f:  # a file of another kind beside them: refused, not left out
        f.write(json.dumps({"messages": []}) + "\n")
    with pytest.raises(InputError, match=r"holds parquet files and also 1 other data file.*extra\.jsonl.*give a glob"):
        load_rows(str(root))
    with pytest.raises(InputError, match=r"mixes \.jsonl and \.parquet files: give a glob of one kind, e\.g\. "
                                         rf"--dataset '{root}/\*\*/\*\.parquet'"):
        load_rows(str(root / "**" / "*.*"))
    with pytest.raises(InputError, match=rf"e\.g\. --dataset '{root}/\*\*/\*\.parquet'"):  # not '**.parquet'
        load_rows(str(root / "**"))


def test_a_folder_declaring_several_configs_is_refused_naming_them(tmp_path):
    root = tmp_path / "multi"
    for config in ("sft", "dpo"):
        (root / config).mkdir(parents=True)
        pq.write_table(_chats(0, 2), root / config / "train-00000-of-00001.parquet")
    (root / "README.md").write_text("---\nconfigs:\n- config_name: sft\n  data_files:\n  - split: train\n    path: "
                                    "sft/train-*\n- config_name: dpo\n  data_files:\n  - split: train\n    path: "
                                    "dpo/train-*\n---\n")
    with pytest.raises(InputError, match=r"declares 2 configs in its README.md \(sft, dpo\).*"
                                         rf"--dataset '{root}/sft/train-\*\.parquet'"):
        load_rows(str(root))


def test_what_a_dataset_path_does_not_name_is_said(tmp_path):
    with pytest.raises(MissingInput, match=r"glob that matches no file; quote it"):
        load_rows(str(tmp_path / "nothing-*.jsonl"))
    with pytest.raises(MissingInput, match=r"does not exist; layertap reads local data: .*hf download --repo-type "
                                           r"dataset HuggingFaceH4/ultrachat_200k --local-dir DIR"):
        load_rows("HuggingFaceH4/ultrachat_200k")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello\n")
    with pytest.raises(InputError, match=r"folder of \.txt files: layertap reads \.jsonl, \.json and \.parquet"):
        load_rows(str(tmp_path / "notes"))
    (tmp_path / "rows.csv").write_text("a\n1\n")
    with pytest.raises(InputError, match=r"rows\.\*': unsupported file type '\.csv'"):
        load_rows(str(tmp_path / "rows.*"))


def test_a_review_s_paths_a_typo_in_a_folder_and_a_folder_named_like_a_glob(tmp_path, monkeypatch):
    """A missing 'a/part9.jsonl' (the folder a/ here) was called a Hugging Face Hub dataset to
    download; a folder 'only[1]' was read from only1/ (the Hub reader takes its path for a pattern)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    with pytest.raises(MissingInput) as e:
        load_rows("a/part9.jsonl")
    assert str(e.value) == "dataset 'a/part9.jsonl' does not exist"
    for name in ("only[1]", "only1"):
        (tmp_path / name).mkdir()
        pq.write_table(_chats(0 if name == "only1" else 10, 2), tmp_path / name / "part.parquet")
    with pytest.raises(InputError, match=r"dataset folder 'only\[1\]' has glob characters .* --dataset "
                                         r"'only\[\[\]1\]/\*\*/\*\.parquet'"):
        load_rows("only[1]")
    assert load_rows("only[[]1]/**/*.parquet")["id"] == ["c10", "c11"]  # the glob it names: that folder's


def test_a_bad_line_in_one_of_several_files_names_the_file_and_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(good) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(InputError, match=rf"could not be read as json files: {tmp_path}/b\.jsonl: line 2 is not JSON"):
        load_rows(str(tmp_path / "*.jsonl"))


def test_the_fingerprint_pins_every_files_bytes_and_their_order_not_their_place(tmp_path):
    root = hub_download(tmp_path / "a")
    glob = str(root / "data" / "train_sft-*.parquet")
    before = dataset_fingerprint(glob)
    copy = shutil.copytree(root, tmp_path / "b")
    assert dataset_fingerprint(str(copy / "data" / "train_sft-*.parquet")) == before  # moved: the same data
    assert dataset_fingerprint(glob, 5) != before
    one = root / "data" / "train_sft-00000-of-00002.parquet"
    assert dataset_fingerprint(str(root / "data" / "train_sft-00000-*")) == dataset_fingerprint(str(one))
    (root / "data" / "train_sft-00001-of-00002.parquet").rename(root / "data" / "train_sft-0000.parquet")
    assert dataset_fingerprint(glob) != before  # the same files in another order: other rows at each index
    pq.write_table(_chats(0, 6).slice(1), one)
    assert dataset_fingerprint(str(copy / "data" / "train_sft-*.parquet")) == before


def test_extract_reads_a_glob_of_a_hub_downloads_split_and_a_resume_refuses_changed_files(tmp_path):
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path / "models", "qwen3")
    root = hub_download(tmp_path / "ultrachat")
    out = tmp_path / "run"
    args = ["extract", "--model", model, "--dataset", f"{root}/data/train_sft-*.parquet", "--out", str(out),
            "--layers", "1,3", "--max-length", "64", "--log-dir", str(tmp_path / "logs")]
    assert cli(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"]["path"] == f"{root}/data/train_sft-*.parquet"
    ids = [s for c in sorted((out / "commits").glob("*.json")) for s in json.loads(c.read_text())["sample_ids"]]
    assert sorted(ids, key=lambda i: int(i.split("-")[0])) == [f"{i}-c{i}" for i in range(11)]
    assert cli(args) == 0  # nothing left to do
    pq.write_table(_chats(0, 6).slice(1), root / "data" / "train_sft-00000-of-00002.parquet")
    assert cli(args) == 2  # the same glob, other rows: the run's fingerprint is not theirs


def _upload(root: Path, bucket: str, prefix: str) -> None:
    store = open_store(f"s3://{bucket}/{prefix}")
    for f in sorted(root.rglob("*")):
        if f.is_file() and ".cache" not in f.parts:
            store.put(str(f.relative_to(root)), f.read_bytes())


def test_data_files_on_s3_are_read_as_the_same_files_on_disk_and_fetched_once(tmp_path, s3_bucket, monkeypatch):
    """`--dataset 's3://bucket/ultrachat/data/train_sft-*.parquet'`: an S3 dataset had to be a
    `layertap regenerate` output. Its objects are fetched once into the local cache, read in key
    order, pinned by the same fingerprint as the same files on a disk, and fetched again once
    written again."""
    monkeypatch.setenv("LAYERTAP_DATA_CACHE", str(tmp_path / "cache"))
    root = hub_download(tmp_path / "ultrachat")
    _upload(root, s3_bucket, "ultrachat")
    remote = f"s3://{s3_bucket}/ultrachat/data/train_sft-*.parquet"
    assert load_rows(remote)["id"] == [f"c{i}" for i in range(11)]
    assert dataset_fingerprint(remote) == dataset_fingerprint(f"{root}/data/train_sft-*.parquet")
    cached = sorted((tmp_path / "cache").rglob("*.parquet"), key=lambda p: p.name)
    assert [p.name for p in cached] == ["train_sft-00000-of-00002.parquet", "train_sft-00001-of-00002.parquet"]
    stamps = [p.stat().st_mtime_ns for p in cached]
    assert len(load_rows(remote)) == 11 and [p.stat().st_mtime_ns for p in cached] == stamps  # not fetched again
    assert len(load_rows(f"s3://{s3_bucket}/ultrachat/**/*.parquet")) == 15  # both splits, ** across folders
    open_store(f"s3://{s3_bucket}/ultrachat").put("data/train_sft-00001-of-00002.parquet",
                                                   (root / "data" / "test_sft-00000-of-00001.parquet").read_bytes())
    assert load_rows(remote)["id"] == [f"c{i}" for i in range(6)] + [f"c{i}" for i in range(100, 104)]
    # written again in as many bytes: its ETag names another copy
    bucket = open_store(f"s3://{s3_bucket}")
    for text in ('{"id": "a", "messages": []}\n', '{"id": "b", "messages": []}\n'):
        bucket.put("same/size.jsonl", text.encode())
        assert load_rows(f"s3://{s3_bucket}/same/size.jsonl")["id"] == [text[8]]
    # a character class, a range among them (re.escape took "[0-2]" for the characters 0, - and 2)
    for i in range(4):
        bucket.put(f"parts/train-0000{i}.jsonl", f'{{"id": "p{i}", "messages": []}}\n'.encode())
    assert load_rows(f"s3://{s3_bucket}/parts/train-0000[0-2].jsonl")["id"] == ["p0", "p1", "p2"]
    assert load_rows(f"s3://{s3_bucket}/parts/train-0000[!0-2].jsonl")["id"] == ["p3"]
    with pytest.raises(MissingInput, match="names no object on S3 \\(a glob that matches none\\)"):
        load_rows(f"s3://{s3_bucket}/ultrachat/data/validation-*.parquet")
    with pytest.raises(InputError, match=r"matches files of unsupported types \('\(none\)', '\.md'\)"):
        load_rows(f"s3://{s3_bucket}/ultrachat/*")


def test_a_glob_under_home_reads_the_file_it_names(tmp_path, monkeypatch):
    """'~/a[1].jsonl' was taken for a glob (its ~ not expanded to find the file) and read ~/a1.jsonl."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, row in (("a[1].jsonl", "x"), ("a1.jsonl", "y")):
        (tmp_path / name).write_text(json.dumps({"id": row, "messages": []}) + "\n")
    assert load_rows("~/a[1].jsonl")["id"] == ["x"]


def test_extract_reads_a_jsonl_object_on_s3(tmp_path, s3_bucket, monkeypatch):
    from test_extract import write_chats
    from tiny_models import tiny_model_dir

    monkeypatch.setenv("LAYERTAP_DATA_CACHE", str(tmp_path / "cache"))
    chats = write_chats(tmp_path / "chats.jsonl", 6)
    open_store(f"s3://{s3_bucket}/data").put("chats.jsonl", Path(chats).read_bytes())
    out = tmp_path / "run"
    assert cli(["extract", "--model", tiny_model_dir(tmp_path / "models", "qwen3"), "--dataset",
                f"s3://{s3_bucket}/data/chats.jsonl", "--out", str(out), "--layers", "1,3", "--max-length", "64",
                "--log-dir", str(tmp_path / "logs")]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"]["path"] == f"s3://{s3_bucket}/data/chats.jsonl"
    assert manifest["dataset"]["fingerprint"] == dataset_fingerprint(chats)
    # The "s3" settings of --config are the command's, its dataset's store's too: a server given there alone
    # (the environment's endpoint answers nothing) was never asked for the dataset
    settings = tmp_path / "layertap.json"
    settings.write_text(json.dumps({"s3": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}}))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("LAYERTAP_S3_UNREACHABLE_ATTEMPTS", "1")
    monkeypatch.setenv("LAYERTAP_DATA_CACHE", str(tmp_path / "cache2"))
    assert cli(["extract", "--model", tiny_model_dir(tmp_path / "models", "qwen3"), "--dataset",
                f"s3://{s3_bucket}/data/chats.jsonl", "--out", str(tmp_path / "run2"), "--layers", "1,3",
                "--max-length", "64", "--config", str(settings), "--log-dir", str(tmp_path / "logs")]) == 0
    assert json.loads((tmp_path / "run2" / "manifest.json").read_text())["dataset"] == manifest["dataset"]
