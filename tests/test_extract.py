"""The extractor end to end: real (tiny, random-init) HF models, real datasets files, real stores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from layertap.cli import main as cli
from layertap.extract.config import ExtractConfig
from layertap.extract.inputs import TokenizedSample, load_rows, tokenize_rows
from layertap.extract.pipeline import make_batches, pad_batch
from layertap.extract.run import Progress, extract
from layertap.manifests import layout
from layertap.manifests.records import decode_commit, decode_failure
from layertap.manifests.cli import format_status
from layertap.manifests.status import run_status, verify_run
from layertap.storage.reader import ShardReader, verify_shard
from layertap.storage.store import StoreError, open_store
import test_worker
from tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
worker_capture = test_worker.capture  # a fixture: the tiny model of the shard loop's tests
WORDS = "the quick brown fox jumps over the lazy dog speculative decoding drafts tokens".split()


def write_chats(path: Path, n: int, seed: int = 0) -> str:
    """OpenAI-style chats of varied lengths, plus one row with no assistant turn (to be skipped)."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            k = int(torch.randint(3, 40, (1,), generator=g))
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g)]
            msgs = [{"role": "user", "content": f"question {i}?"},
                    {"role": "assistant", "content": " ".join(words)}]
            f.write(json.dumps({"id": f"chat-{i}", "messages": msgs}) + "\n")
        f.write(json.dumps({"id": "no-answer", "messages": [{"role": "user", "content": "hello?"}]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {t: tiny_model_dir(root, t) for t in ("llama", "qwen3", "qwen3_5_text")}


def committed(store) -> list:
    out = []
    for o in store.list(layout.COMMITS):
        c = decode_commit(store.get(o.key), o.key)
        assert verify_shard(store, c.data_key, c.xxh3_128, decode=True).ok
        out.append(c)
    return out


def stored_samples(store) -> dict:
    samples = {}
    for c in committed(store):
        for s in ShardReader(store, c.data_key):
            assert s.sample_id not in samples
            samples[s.sample_id] = s
    return samples


@pytest.mark.parametrize("model_type, overlap", [("llama", "auto"), ("llama", "on"), ("qwen3", "auto"),
                                                 ("qwen3_5_text", "auto")])
def test_stored_states_equal_a_plain_hf_forward(models, model_type, overlap, tmp_path, caplog):
    """Bit-exact under the lossless codec: the same padded batches through the full, uncut model
    with output_hidden_states=True give exactly the stored states; with shards overlapped too
    (`on`: each shard finishing behind the next one's forwards, as on a GPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_chats(tmp_path / "chats.jsonl", 14)
    layers = [0, 2, 4]
    cfg = ExtractConfig(out=str(tmp_path / "run"), model=models[model_type], dataset=data, layers=layers,
                        max_length=48, batch_tokens=160, shard_bytes="40KB", log_dir=str(tmp_path / "logs"),
                        final_state="postnorm", dtype="bfloat16",  # the reference below runs in bf16
                        overlap_shards=overlap)
    with caplog.at_level("WARNING", logger="layertap.extract"):
        assert extract(cfg) == 0
    # the first sample skipped for a reason is shown with its detail (the log had its count alone)
    assert "sample 14-no-answer skipped (no_supervised_pair): no assistant turn. Later samples" in caplog.text
    store = open_store(cfg.out)
    got = stored_samples(store)
    status = run_status(store)
    assert status["complete"] and status["samples_done"] == 14 and status["samples_skipped"] == 1
    # the planner found the row without an answer: a finished run reads 14 of 14, not 14 of 15 rows
    assert status["samples_planned"] == 14 and status["samples_total"] == 15
    assert "samples  14/14 stored (of 15 rows: the plan found 1 yield no sample), 1 skipped" in format_status(status)
    assert status["shards_total"] >= 3
    # why, from the commit records: `status` said only "nothing to train on, e.g. ..."
    [(reason, n)] = status["skipped_by_reason"]["counts"].items()
    assert (reason, n) == ("no_supervised_pair", 1) and f"1 skipped: {reason} 1" in format_status(status)
    # and how many were cut at max_length (commits recorded it; status did not add it up)
    cut = sum(c.truncated for c in committed(store))
    assert 0 < cut <= sum(s.num_tokens == 48 for s in got.values()) and status["samples_truncated"] == cut
    assert f", {cut} cut at max_length 48" in format_status(status)

    tok = AutoTokenizer.from_pretrained(models[model_type])
    model = AutoModelForCausalLM.from_pretrained(models[model_type], dtype=torch.bfloat16).eval()
    rows = load_rows(data)
    samples = [s for s in tokenize_rows(rows, tok, cfg.max_length) if isinstance(s, TokenizedSample)]
    manifest_shards = json.loads(store.get("manifest.json"))["shards"]
    for start, end, _ in manifest_shards:  # batches are formed per shard, as the extractor does
        shard_samples = [s for s in samples if start <= int(s.sample_id.split("-")[0]) < end]
        for batch in make_batches(shard_samples, cfg.batch_tokens):
            ids, mask = pad_batch(batch, tok.pad_token_id)
            with torch.inference_mode():
                out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            for i, s in enumerate(batch):
                n, mine = len(s), got[s.sample_id]
                assert torch.equal(mine.input_ids, s.input_ids)
                assert torch.equal(mine.loss_mask.bool(), s.loss_mask.bool())
                for j, k in enumerate(layers):
                    want = out.hidden_states[k + 1][i, :n]
                    assert torch.equal(mine.hidden_states[:, j].view(torch.int16), want.view(torch.int16)), (s.sample_id, k)
                assert torch.equal(mine.final_state.view(torch.int16), out.hidden_states[-1][i, :n].view(torch.int16))


def test_rerun_resumes_and_a_changed_config_is_refused(models, tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 10)
    args = ["extract", "--model", models["llama"], "--dataset", data, "--out", str(tmp_path / "run"),
            "--layers", "1,3", "--max-length", "32", "--shard-bytes", "20KB", "--log-dir", str(tmp_path / "logs")]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "COMPLETE" in out and "layertap train --data" in out
    store = open_store(str(tmp_path / "run"))
    before = {o.key for o in store.list()}
    assert cli(args) == 0  # nothing left to do
    assert {o.key for o in store.list()} == before
    # a --delete-consumed trainer claimed the run (nothing deleted yet): not "train a drafter on it", which
    # started a second trainer on data the first deletes as it trains
    from layertap.manifests.consumption import claim_consumer

    claim_consumer(store, str(tmp_path / "drafter"))
    capsys.readouterr()
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert f"a --delete-consumed trainer writing to {tmp_path / 'drafter'} trains on this run" in out
    assert "layertap train --data" not in out
    store.delete(layout.CONSUMER)
    before = {o.key for o in store.list()}

    changed = [a if a != "1,3" else "1,2" for a in args] + ["--codec", "fp8"]
    assert cli(changed) == 2
    err = capsys.readouterr().err
    assert "layers: run has [1, 3], now [1, 2]" in err and "codec: run has 'bf16-zstd', now 'fp8'" in err


def test_a_regenerated_dataset_is_rendered_with_the_template_settings_its_prompts_were(models, tmp_path, capsys):
    """`layertap regenerate --chat-template-kwargs` had the server render prompts with those settings
    (e.g. enable_thinking=false); extraction must render the same text, or the stored states are
    of another prompt than the one the target answered."""
    from layertap.manifests.regeneration import Recipe, part_key

    model = _thinking_model(models, tmp_path)
    out = tmp_path / "regenerated"
    rows = [json.loads(line) for line in open(write_chats(tmp_path / "chats.jsonl", 4)) if "assistant" in line]
    recipe = Recipe(dataset={"path": "chats.jsonl", "fingerprint": "f", "rows": len(rows), "limit": None},
                    model="tiny", sampling={"temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}},
                    rows_per_part=len(rows))
    (out / "parts").mkdir(parents=True)
    (out / "regenerate.json").write_text(json.dumps(recipe.to_json()))
    (out / part_key(0)).write_text("".join(json.dumps({**row, "regenerated": {
        "row": i, "completion_tokens": 5, "finish_reasons": ["stop"]}}) + "\n" for i, row in enumerate(rows)))
    extract = ["extract", "--model", str(model), "--dataset", str(out), "--out", str(tmp_path / "run"),
               "--layers", "1,3", "--max-length", "128", "--log-dir", str(tmp_path / "logs")]
    capsys.readouterr()  # other settings than the prompts were rendered with: refused, before the model loads
    assert cli(extract + ["--chat-template-kwargs", "{}"]) == 2
    assert "leave --chat-template-kwargs out to use the dataset's" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert cli(extract) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok.decode(s.input_ids) for s in stored_samples(open_store(str(tmp_path / "run"))).values()]
    assert len(texts) == len(rows) and all(t.startswith("NOTHINK") for t in texts)

    # ... and so must `eval`'s prompts be (it rendered them without: a text the drafter never saw). The run
    # records the settings, the drafter trained on it too, and eval takes them unless told otherwise.
    manifest = json.loads(open_store(str(tmp_path / "run")).get("manifest.json"))
    assert manifest["dataset"]["chat_template_kwargs"] == {"enable_thinking": False}
    drafter = str(tmp_path / "drafter")
    assert cli(["train", "--data", str(tmp_path / "run"), "--model", str(model), "--out", drafter, "--steps", "2",
                "--batch-size", "4", "--block-size", "4", "--max-anchors", "8", "--log-dir", str(tmp_path / "logs")]) == 0
    assert json.loads(open_store(drafter).get("drafter/config.json"))["target"]["chat_template_kwargs"] == \
        {"enable_thinking": False}
    evaluate = ["eval", "--drafter", drafter, "--prompts", write_chats(tmp_path / "prompts.jsonl", 2), "--no-baseline",
                "--max-new-tokens", "3", "--json"]
    for extra, used in (([], {"enable_thinking": False}), (["--chat-template-kwargs", "{}"], None)):
        capsys.readouterr()
        assert cli(evaluate + extra) in (0, 1)
        assert json.loads(capsys.readouterr().out)["chat_template_kwargs"] == used

    # A run made before runs recorded the settings (its fingerprint pins the recipe's, which it was rendered
    # with): resumed, not refused for "run has {}"
    run = tmp_path / "run" / "manifest.json"
    made = json.loads(run.read_text())
    del made["dataset"]["chat_template_kwargs"]
    run.write_text(json.dumps(made))
    assert cli(extract) == 0


def _thinking_model(models, tmp_path):
    """The tiny qwen3 with a chat template that reads `enable_thinking` for every turn."""
    from tiny_models import CHATML_TEMPLATE

    model = tmp_path / "model"
    shutil.copytree(models["qwen3"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}" \
        + CHATML_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


def test_extract_renders_chats_with_the_chat_template_settings_given_and_a_resume_must_match(models, tmp_path,
                                                                                              capsys):
    """--chat-template-kwargs on a plain dataset (Qwen3.6 with thinking off): the chats are rendered
    so, the run records the settings (its drafter's eval renders prompts alike), a resume with other
    settings is refused (it would store another text under the same plan), and a setting the
    template never reads (a typo) is refused before anything is written."""
    model = _thinking_model(models, tmp_path)
    data, out = write_chats(tmp_path / "chats.jsonl", 4), tmp_path / "run"
    base = ["extract", "--model", str(model), "--dataset", data, "--out", str(out), "--layers", "1,3",
            "--max-length", "128", "--log-dir", str(tmp_path / "logs")]
    assert cli(base + ["--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok.decode(s.input_ids) for s in stored_samples(open_store(str(out))).values()]
    assert len(texts) == 4 and all(t.startswith("NOTHINK") for t in texts)
    manifest = json.loads(open_store(str(out)).get("manifest.json"))
    assert manifest["dataset"]["chat_template_kwargs"] == {"enable_thinking": False}

    capsys.readouterr()
    assert cli(base) == 2
    assert 'chat template settings (--chat-template-kwargs): run has {"enable_thinking": false}, now {}' in \
        capsys.readouterr().err
    assert cli(base + ["--chat-template-kwargs", '{"enable_thinking": false}']) == 0  # the same: resumed, done
    assert cli(base + ["--chat-template-kwargs", '{"enable_thinking": 0}']) == 2  # not false to `is false`
    assert 'run has {"enable_thinking": false}, now {"enable_thinking": 0}' in capsys.readouterr().err

    fresh = tmp_path / "typo"
    typo = [a if a != str(out) else str(fresh) for a in base] + ["--chat-template-kwargs", '{"enable_thinkng": false}']
    capsys.readouterr()
    assert cli(typo) == 2
    err = capsys.readouterr().err
    assert "'enable_thinkng'" in err and "never reads (the settings it reads: enable_thinking)" in err
    assert not fresh.exists() or not any(fresh.iterdir())
    assert cli(typo[:-1] + ['{"add_generation_prompt": true}']) == 2  # one layertap sets itself
    assert "'add_generation_prompt', which layertap passes the chat template itself" in capsys.readouterr().err


def test_bad_arguments_fail_before_any_work(models, tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 4)
    out = tmp_path / "run"
    base = ["extract", "--model", models["llama"], "--dataset", data, "--out", str(out), "--log-dir", str(tmp_path)]
    assert cli(base + ["--layers", "1,99"]) == 2
    assert "capture layer 99 is out of range" in capsys.readouterr().err
    assert cli(base + ["--layers", ""]) == 2  # not the default layers in silence
    assert "no capture layers given: name at least one with --layers" in capsys.readouterr().err
    assert cli(base + ["--shards", " "]) == 2
    assert "--shards names no shard" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli(base + ["--layers", "-1,3"])  # argparse takes "-1,3" for an option
    assert exit_.value.code == 2
    assert "argument --layers: expected one argument (a value that starts with '-' must be attached with '=': " \
           "--layers=VALUE)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the value is missing: no word of '='
        cli(base + ["--layers"])
    assert capsys.readouterr().err.rstrip().endswith("argument --layers: expected one argument")
    with pytest.raises(SystemExit):  # no abbreviations: `--lay` is no option
        cli(base + ["--lay", "1"])
    assert "unrecognized arguments: --lay (did you mean --layers?)" in capsys.readouterr().err
    assert cli(base + ["--layers=-1,3"]) == 2
    assert "capture layer -1 is out of range" in capsys.readouterr().err
    assert cli(["extract", "--model", str(tmp_path / "nope"), "--dataset", data, "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli(base[:4] + [str(tmp_path / "missing.jsonl")] + base[5:]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert cli(base + ["--shard-bytes", "lots"]) == 2
    assert "invalid size 'lots'" in capsys.readouterr().err
    assert not out.exists() or not (out / "manifest.json").exists()


class TallyListingFails:
    """A store whose listings of tally/ hang a while and then fail, after the first one: a store
    that lost its server for good, as rank 0's progress sees it mid-run."""

    def __init__(self, inner, hang_s: float):
        self.inner, self.hang_s, self.listers = inner, hang_s, []

    def list(self, prefix: str = "", *args, **kwargs):
        if prefix.startswith((layout.COMMITS, layout.FEED)):
            self.listers.append(threading.current_thread().name)
            if len(self.listers) > 1:
                time.sleep(self.hang_s)
                raise StoreError("injected: listing tally/ failed after its retries")
        return self.inner.list(prefix, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_rank_0s_progress_listing_neither_fails_nor_stalls_a_shard(store_uri, worker_capture, monkeypatch, caplog):
    """With several ranks, rank 0's progress lists the commits every SYNC_S for everyone's
    count. That listing runs on a thread of its own, never on a shard's writer thread (which
    reports records to the progress), and a store error there is a warning, said once."""
    monkeypatch.setattr(Progress, "SYNC_S", 0.01)
    run = test_worker.Run(store_uri, worker_capture)
    store = TallyListingFails(run.store, hang_s=0.05)
    with Progress(0, 2, store, run.manifest) as progress:
        start = run.start
        run.start = lambda claim, counted: start(claim, lambda rec: (counted(rec), progress.record(claim.plan.id, rec)))
        loop = run.loop(overlap=True)
        assert loop.run(run.queue(loop)) == len(run.manifest.shards)
    assert run_status(run.store)["complete"] and not list(run.store.list(layout.FAILURES))
    assert len(store.listers) > 2 and set(store.listers) == {threading.current_thread().name, "progress-sync"}
    warned = [r for r in caplog.records if "could not list the committed shards" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"]  # once, not every SYNC_S


def test_progress_counts_the_samples_other_processes_commit_with_one_rank_too(tmp_path, monkeypatch):
    """A one-process array task (a CPU or one-GPU node) takes the run's free shards beside the
    other tasks: its bar's total is the run's, but it counted its own samples alone (a task could
    end at 30%, its ETA N times too long). Now it counts every commit, from the feed keys written
    since its last look; a task of static --shards (its own samples make the total) does not look."""
    import fake_worker

    monkeypatch.setattr(Progress, "SYNC_S", 0.05)
    uri = str(tmp_path / "run")
    store = open_store(uri)
    manifest = fake_worker.plan(store)
    fake_worker.work(uri, shards=[0])  # before the bar: from the listing of the commits
    planned = {p.id: p.num_samples for p in manifest.shards}
    with Progress(0, 1, store, manifest) as progress:
        assert progress.bar.n == planned[0]
        fake_worker.work(uri, shards=[1, 2])  # another process, while this one works
        deadline = time.monotonic() + 10
        while progress.bar.n < planned[0] + planned[1] + planned[2] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert progress.bar.n == planned[0] + planned[1] + planned[2]
        assert progress._feed_from is not None  # the later looks listed the feed, not every commit
    for t in threading.enumerate():
        if t.name == "progress-sync":
            t.join(timeout=5)  # the closed bar's thread ends at its next wake-up
    with Progress(0, 1, store, manifest, shards=[3, 4]) as static:
        assert static.bar.total == planned[3] + planned[4] and static.bar.n == 0
        assert "progress-sync" not in {t.name for t in threading.enumerate()}


def test_a_shard_rank_0_commits_is_counted_once_whoever_sees_its_commit_first(tmp_path, monkeypatch):
    """Rank 0 counted its records as they were written and the listings' commits: a look between
    a shard's commit keys and the worker's own report counted it twice, and the bar kept the
    larger count (46 of 40 samples at the end of a one-process run: 115%, the ETA wrong)."""
    import fake_worker

    monkeypatch.setattr(Progress, "SYNC_S", 0.02)
    uri = str(tmp_path / "run")
    store = open_store(uri)
    manifest = fake_worker.plan(store)
    planned = {p.id: p.num_samples for p in manifest.shards}
    rec = SimpleNamespace(num_tokens=10, size=100, raw_bytes=200)
    with Progress(0, 1, store, manifest) as progress:
        for shard in sorted(planned):
            for _ in range(planned[shard]):
                progress.record(shard, rec)
            fake_worker.work(uri, shards=[shard])  # its commit and feed key land ...
            deadline = time.monotonic() + 10
            while shard not in progress._counted and time.monotonic() < deadline:
                time.sleep(0.02)  # ... and a look sees them before the worker reports the commit
            assert progress.bar.n == sum(planned[s] for s in planned if s <= shard)
            progress.committed(shard, planned[shard], 0)
            assert progress.bar.n == sum(planned[s] for s in planned if s <= shard)
        progress.record(99, rec)  # a shard abandoned after a record: its record is taken back
        progress.abandoned(99)
        assert progress.bar.n == sum(planned.values()) == progress.bar.total


def test_commits_whose_feed_or_tally_keys_never_landed_are_counted(tmp_path, monkeypatch):
    """A worker killed between its commit and its tally and feed keys (or those PUTs failing past
    their retries) left a committed shard the progress never counted: a rerun's bar stopped at
    34 of 40 with an ETA while `status` said COMPLETE. The commits are listed at the first look
    and every COMMITS_LOOK_S."""
    import fake_worker

    uri = str(tmp_path / "run")
    store = open_store(uri)
    manifest = fake_worker.plan(store)
    planned = {p.id: p.num_samples for p in manifest.shards}
    fake_worker.work(uri, shards=[0])
    store.delete_many([o.key for o in [*store.list(layout.TALLY), *store.list(layout.FEED)]])
    assert run_status(store)["samples_done"] == planned[0]
    monkeypatch.setattr(Progress, "SYNC_S", 0.02)
    monkeypatch.setattr(Progress, "COMMITS_LOOK_S", 0.2)
    with Progress(0, 1, store, manifest) as progress:
        assert progress.bar.n == planned[0]
        # another process's commit whose feed key goes where no listing of the feed looks
        monkeypatch.setattr(layout, "feed_key", lambda millis, shard, *_: f"lost/{shard}")
        fake_worker.work(uri, shards=[1])
        deadline = time.monotonic() + 10
        while progress.bar.n < planned[0] + planned[1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert progress.bar.n == planned[0] + planned[1]


@pytest.mark.slow
def test_two_ranks_store_every_sample_exactly_once(models, store_uri, tmp_path):
    """Two processes over gloo through `accelerate launch`, as on a multi-GPU node; with -v."""
    data = write_chats(tmp_path / "chats.jsonl", 24)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "layertap", "-v", "extract", "--model", models["qwen3"], "--dataset", data, "--out", store_uri,
           "--layers", "1,4", "--max-length", "40", "--shard-bytes", "10KB", "--log-dir", str(tmp_path / "logs")]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    store = open_store(store_uri)
    commits = committed(store)
    ids = Counter(i for c in commits for i in c.sample_ids)
    assert sorted(ids) == sorted(f"{i}-chat-{i}" for i in range(24)) and set(ids.values()) == {1}
    assert sorted((tmp_path / "logs").iterdir()) == [tmp_path / "logs" / "extract-rank0.log",
                                                     tmp_path / "logs" / "extract-rank1.log"]
    # Both ranks joined the same run (which rank commits what depends on timing).
    run_id = json.loads(store.get("manifest.json"))["run_id"]
    logs = [(tmp_path / "logs" / f"extract-rank{r}.log").read_text() for r in (0, 1)]
    for r in (0, 1):
        assert f"rank {r}/2: run {run_id}" in logs[r]
    # -v: layertap's DEBUG records reach the rank logs; botocore's, which carry credentials, never do.
    assert "DEBUG layertap.manifests.work: shard" in "".join(logs)
    assert "DEBUG botocore" not in "".join(logs) and "DEBUG urllib3" not in "".join(logs)


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_a_rerun_completes(models, store_uri, tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", 60)
    # one forward per sample, ~15 samples per shard: a shard is open long enough to be stopped
    args = [sys.executable, "-m", "layertap", "extract", "--model", models["llama"], "--dataset", data,
            "--out", store_uri, "--layers", "1,3", "--max-length", "48", "--batch-tokens", "48",
            "--shard-bytes", "150KB", "--log-dir", str(tmp_path / "logs")]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    store = open_store(store_uri)
    deadline = time.time() + 300
    # shard 0 committed and shard 1 claimed: the signal lands inside a claim
    while not (store.exists(layout.commit_key(0)) and any(store.list(layout.lease_prefix(1)))) \
            and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]

    status = run_status(store)
    assert 0 < status["shards_done"] < status["shards_total"]
    assert status["shards_running"] == 0  # the lease was released, not left to expire
    assert not list(store.list(layout.LEASES))
    assert store.list_pending_uploads() == []  # the open shard's upload was aborted
    for o in store.list(layout.FAILURES):
        assert decode_failure(store.get(o.key), o.key).preempted
    assert len(list(store.list(layout.SHARDS))) == status["shards_done"]  # no half-written data

    assert subprocess.run(args, capture_output=True, env=env, timeout=600).returncode == 0
    ids = Counter(i for c in committed(store) for i in c.sample_ids)
    assert len(ids) == 60 and set(ids.values()) == {1}
    assert verify_run(store).bad == []


@pytest.mark.slow
def test_smollm2_extraction_equals_hf_forward(tmp_path):
    """The real SmolLM2-135M-Instruct (`--model` and `--gguf-file` of the embedded GGUF, read
    through its converted folder) on real ShareGPT conversations, bit-exact."""
    from activations import smollm2_folder
    from layertap.extract.embedded import sharegpt_conversations, smollm2_gguf
    from layertap.extract.model import default_layers, load_target

    rows = list(sharegpt_conversations(6))
    data = tmp_path / "sharegpt.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder, name = smollm2_gguf()
    cfg = ExtractConfig(out=str(tmp_path / "run"), model=folder, gguf_file=name, dataset=str(data),
                        max_length=96, batch_tokens=400, dtype="float32", log_dir=str(tmp_path / "logs"))
    assert extract(cfg) == 0
    store = open_store(cfg.out)
    got = stored_samples(store)
    assert len(got) >= 5
    layers = json.loads(store.get("manifest.json"))["config"]["layers"]
    assert layers == default_layers(30)  # DFlash's spacing for SmolLM2's 30 layers

    target = load_target(smollm2_folder(), dtype=torch.float32)
    samples = [s for s in tokenize_rows(load_rows(str(data)), target.tokenizer, cfg.max_length)
               if isinstance(s, TokenizedSample)]
    for batch in make_batches(samples, cfg.batch_tokens):
        ids, mask = pad_batch(batch, target.tokenizer.pad_token_id or 0)
        with torch.inference_mode():
            out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        for i, s in enumerate(batch):
            want = torch.stack([out.hidden_states[k + 1][i, : len(s)] for k in layers], dim=1).to(torch.bfloat16)
            assert torch.equal(got[s.sample_id].hidden_states.view(torch.int16), want.view(torch.int16))


def test_ranks_waiting_for_the_plan_poll_less_and_less_often(monkeypatch):
    """While rank 0 tokenizes (minutes on a big dataset), the other ranks look for its manifest
    with a growing pause up to 10 s, not every 0.5 s (1,000 ranks: ~2,000 GETs a second)."""
    from layertap.extract import run
    from layertap.manifests.manifest import NoRun

    looks, pauses = [], []
    monkeypatch.setattr(run.time, "sleep", pauses.append)

    def resume_run(*args):
        looks.append(1)
        if len(looks) < 10:
            raise NoRun("not yet")
        return "plan"

    monkeypatch.setattr(run, "resume_run", resume_run)
    assert run._wait_for_plan(None, None, None, "f") == "plan"
    assert len(pauses) == 9
    assert pauses[0] <= 0.625 and all(7.5 <= p <= 12.5 for p in pauses[-3:])
    assert all(b > a for a, b in zip(pauses[:4], pauses[1:5]))  # doubling 0.5 -> 8 s (jitter +-25%)


def test_a_pad_token_the_model_cannot_embed_pads_with_an_id_it_can(tmp_path):
    """`add_special_tokens({"pad_token": ...})` saved without resizing the embeddings: the pad id
    is the model's vocab_size, and every batch with rows of different lengths failed its shard
    with "IndexError: index out of range in self", naming nothing, then "run the same command
    again". Padded positions are masked and never stored: an id the model embeds pads them now."""
    from transformers import AutoTokenizer

    folder = tiny_model_dir(tmp_path / "models", "llama", num_layers=4)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"pad_token": "<|pad|>"})
    tok.save_pretrained(folder)
    assert tok.pad_token_id == json.loads(Path(folder, "config.json").read_text())["vocab_size"]
    out = str(tmp_path / "run")
    argv = ["extract", "--model", folder, "--dataset", write_chats(tmp_path / "chats.jsonl", 6), "--out", out,
            "--layers", "1", "--max-length", "128", "--batch-tokens", "1024", "--retries", "0", "--dtype", "float32",
            "--log-dir", str(tmp_path)]
    assert cli(argv) == 0
    assert run_status(open_store(out))["complete"] and verify_run(open_store(out)).ok >= 1


def test_a_sample_whose_encode_fails_fails_its_shard_and_no_commit_lacks_a_sample(models, tmp_path, monkeypatch):
    """A record lost between the forward and the object (its encode raised) must fail the shard,
    not commit it without that sample: the run stays incomplete until a rerun redoes the shard.
    The shard's last sample: no later one of that shard meets the writer's error first."""
    from layertap.extract import pipeline
    from layertap.manifests.manifest import load_manifest

    args = dict(model=models["llama"], dataset=write_chats(tmp_path / "c.jsonl", 14), layers=[0, 2], max_length=48,
                batch_tokens=160, shard_bytes="40KB", log_dir=str(tmp_path / "logs"))
    assert extract(ExtractConfig(out=str(tmp_path / "clean"), **args)) == 0
    clean = open_store(str(tmp_path / "clean"))
    lost = next(c for c in committed(clean) if c.shard == 0).sample_ids[-1]
    real = pipeline._encode

    def failing(sample, *rest):
        if sample.sample_id == lost:
            raise RuntimeError("injected: this sample's encode failed")
        return real(sample, *rest)

    monkeypatch.setattr(pipeline, "_encode", failing)
    cfg = ExtractConfig(out=str(tmp_path / "run"), **args)
    assert extract(cfg) != 0
    store = open_store(cfg.out)
    manifest = load_manifest(store)
    assert committed(store) and all(c.covered == manifest.shards[c.shard].num_samples for c in committed(store))
    assert lost not in stored_samples(store) and not run_status(store)["complete"]
    monkeypatch.setattr(pipeline, "_encode", real)
    assert extract(cfg) == 0
    status = run_status(store)
    assert status["complete"] and status["samples_done"] + status["samples_skipped"] == manifest.num_samples
    assert lost in stored_samples(store)
