"""Follow mode (issue 20): a ShardStream that starts before or during extraction, against real
extraction worker processes (tests/fake_worker.py) on a local folder and the moto S3 server.

Also runnable as a rank: python tests/test_follow.py consume URI RANK WORLD WORKERS OUT.JSON
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def env() -> dict[str, str]:
    """The test's environment (S3 endpoint, credentials); children import this checkout's layertap."""
    return dict(os.environ, PYTHONPATH=str(HERE.parent))

import fake_worker  # noqa: E402
from layertap.storage.errors import InputError  # noqa: E402
from layertap.train import ShardStream, StreamConfig, StreamLoader  # noqa: E402
from layertap.train.order import StreamingShuffle, buffer_shuffle, follow_share, follow_target  # noqa: E402

SAMPLES = 40  # fake_worker.plan: 40 samples in 7 shards
ALL = {f"s{i:05d}" for i in range(SAMPLES)}
CFG = dict(follow=True, follow_poll_s=0.5, shuffle_buffer=4, seed=3)


def start_workers(uri: str, n: int = 2, slow: float = 0.02) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, str(HERE / "fake_worker.py"), uri, "--rank", str(r), "--world", str(n),
                              "--slow", str(slow)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
            for r in range(n)]


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.wait(timeout=300) == 0


# -- pure parts ----------------------------------------------------------------------------------

def test_each_shard_splits_into_contiguous_parts_whose_extras_rotate():
    for consumers in (1, 2, 3, 4, 7):
        for n in range(0, 20):
            for shard in range(9):
                parts = [follow_share(n, shard, consumers, c) for c in range(consumers)]
                assert [o for o, _ in parts] == [sum(k for _, k in parts[:c]) for c in range(consumers)]
                assert sum(k for _, k in parts) == n and max(k for _, k in parts) - min(k for _, k in parts) <= 1
        counts = [5, 7, 3, 9, 1, 0, 4, 6]
        totals = [sum(follow_share(n, s, consumers, c)[1] for s, n in enumerate(counts)) for c in range(consumers)]
        assert follow_target(counts, consumers) == max(totals)
        unrotated = [sum(follow_share(n, 0, consumers, c)[1] for n in counts) for c in range(consumers)]
        assert max(totals) - min(totals) <= max(unrotated) - min(unrotated)  # rotating spreads the extras


@pytest.mark.parametrize("k", [1, 2, 4, 64])
def test_streaming_shuffle_emits_what_buffer_shuffle_computes(k):
    for n in (0, 1, 2, 5, 64, 300):
        shuffle, out, fed = StreamingShuffle(k, (1, 2, 3)), [], 0
        while True:
            if shuffle.ready():
                out.append(shuffle.emit())
            elif shuffle.wants_input() and fed < n:
                shuffle.add(fed)
                fed += 1
            elif shuffle.ended:
                break
            else:
                shuffle.end()
        assert out == buffer_shuffle(n, k, (1, 2, 3)).tolist()


@pytest.mark.parametrize("k", [1, 3, 16])
def test_the_shuffles_look_ahead_is_what_it_then_emits(k):
    """`upcoming` (what the decode threads work on) names exactly the next emits, as far as the
    known inputs fix them, while inputs arrive in bursts and after the end; it changes nothing."""
    import random

    rng = random.Random(k)
    n = 200
    shuffle, out, fed, known = StreamingShuffle(k, (4, 5)), [], 0, 0
    looks: list[tuple[int, list[int]]] = []  # (emits so far, the look)
    while True:
        if rng.random() < 0.3:  # some inputs become known (a shard committed)
            known = min(n, known + rng.randint(1, 7))
        looks.append((len(out), shuffle.upcoming(rng.randint(1, 9), fed, known)))
        if shuffle.ready():
            out.append(shuffle.emit())
        elif shuffle.wants_input() and fed < known:
            shuffle.add(fed)
            fed += 1
        elif shuffle.ended:
            break
        elif known == n:
            shuffle.end()
    assert out == buffer_shuffle(n, k, (4, 5)).tolist()  # looking ahead changed nothing
    assert all(look == out[at:at + len(look)] for at, look in looks)
    assert sum(len(look) for _, look in looks) > n  # and it did see ahead


def test_delete_consumed_needs_follow_and_one_epoch():
    from layertap.storage.errors import ConfigError
    from layertap.train.config import TrainConfig

    for kw, needs in ((dict(delete_consumed=True), "--follow:"), (dict(delete_consumed=True, epochs=3),
                                                                  r"--follow and --epochs 1 \(got 3\)"),
                      (dict(delete_consumed=True, follow=True, epochs=2), r"--epochs 1 \(got 2\):")):
        with pytest.raises(ConfigError, match=f"--delete-consumed needs {needs}"):
            TrainConfig(data="d", out="o", **kw)
    assert TrainConfig(data="d", out="o", follow=True, delete_consumed=True).identity()["follow"] is True
    assert "follow" not in TrainConfig(data="d", out="o").identity()  # older checkpoints still compare equal


def test_delete_consumed_trains_the_whole_follow_epoch(tmp_path, capsys):
    """Stopping before the follow epoch's end leaves the rest of the run unconsumed: an extraction
    under --window would wait for a trainer that has left. Refused, like steps past the epoch."""
    from layertap.cli import main as cli
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri = str(tmp_path / "run")
    fake_worker.work(uri, shards=[0])
    base = ["train", "--data", uri, "--model", target, "--out", str(tmp_path / "out"), "--follow", "--delete-consumed",
            "--batch-size", "4"]
    for steps, why in (("3", "stopping before its end"), ("11", "later steps would need the deleted data")):
        assert cli([*base, "--steps", steps]) == 2
        err = capsys.readouterr().err
        assert "the follow epoch has 10 steps" in err and why in err


def test_a_second_delete_consumed_trainer_of_a_run_is_refused_and_another_trainer_warned(tmp_path, capsys, caplog):
    """Watermarks are per rank, not per trainer: a second --delete-consumed trainer of the same
    run (another drafter on the same extraction) overwrote the first's, and each deleted shards
    the other had yet to read."""
    from layertap.cli import main as cli
    from layertap.manifests import layout
    from layertap.manifests.consumption import claim_consumer
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, first = str(tmp_path / "run"), str(tmp_path / "first")
    m = fake_worker.plan(_store(uri))
    fake_worker.work(uri, shards=list(range(len(m.shards))))
    store = _store(uri)
    claim_consumer(store, _store(first).uri)  # the first trainer started
    claim_consumer(store, _store(first).uri)  # and restarted (every rank claims alike)
    before = sorted(o.key for o in store.list())
    second = ["train", "--data", uri, "--model", target, "--out", str(tmp_path / "second"), "--batch-size", "4",
              "--block-size", "4", "--max-anchors", "8"]
    assert cli([*second, "--follow", "--delete-consumed"]) == 2
    err = capsys.readouterr().err
    assert f"writing to {_store(first).uri}" in err and layout.CONSUMER in err
    assert sorted(o.key for o in store.list()) == before  # nothing consumed, nothing deleted
    with caplog.at_level("WARNING"):
        assert cli([*second, "--steps", "2"]) == 0
    assert any("consumed by the --delete-consumed trainer" in r.getMessage() for r in caplog.records)


def test_a_follow_trainer_of_a_run_consumed_to_the_end_is_refused(tmp_path, capsys):
    """It ran its steps on padding, reported a NaN loss and exported an untrained drafter, exit 0."""
    from layertap.cli import main as cli
    from layertap.manifests import layout
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri = str(tmp_path / "run")
    m = fake_worker.plan(_store(uri))
    fake_worker.work(uri, shards=list(range(len(m.shards))))
    store = _store(uri)
    for shard in range(len(m.shards)):
        store.put(layout.consumed_marker_key(shard), b"")
    assert cli(["train", "--data", uri, "--model", target, "--out", str(tmp_path / "out"), "--follow"]) == 2
    assert "nothing is left to train on" in capsys.readouterr().err


@pytest.mark.parametrize("hidden_size", [False, True])
def test_a_follow_trainer_of_a_run_consumed_but_for_a_given_up_shard_is_refused(tmp_path, capsys, monkeypatch,
                                                                                   hidden_size):
    """Every committed shard consumed and deleted, the one left given up: the trainer ran its steps
    on padding and exported an untrained drafter, exit 0 (with hidden_size in the manifest), or
    failed on a shard "deleted while this stream read the run" (without), not the cause."""
    from layertap.cli import main as cli
    from layertap.manifests import layout
    from tiny_models import tiny_model_dir

    if hidden_size:  # as a real extraction records it
        monkeypatch.setitem(fake_worker.CONFIG, "hidden_size", fake_worker.HIDDEN)
    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri = str(tmp_path / "run")
    m = fake_worker.plan(_store(uri))
    fake_worker.work(uri, shards=[s for s in range(len(m.shards)) if s != 3])
    give_up(uri, 3)
    store = _store(uri)
    for shard in range(len(m.shards)):
        if shard != 3:
            store.put(layout.consumed_marker_key(shard), b"")
    store.delete_many([o.key for o in store.list(layout.SHARDS)])
    assert cli(["train", "--data", uri, "--model", target, "--out", str(tmp_path / "out"), "--follow",
                "--follow-poll-s", "0.5", "--batch-size", "2", "--block-size", "4", "--max-anchors", "8"]) == 2
    err = capsys.readouterr().err
    assert "nothing is left to train on" in err and "gave up shard(s) 3" in err


def test_a_resumed_delete_consumed_trainer_records_what_its_checkpoint_consumed(tmp_path, monkeypatch):
    """The watermark is written after a checkpoint, so a trainer resumed from one (here taken
    without --delete-consumed) recorded nothing until its next: with the window full, extraction
    waited for training and training for data, for good. Now it records at once, before a step."""
    from layertap.cli import main as cli
    from layertap.manifests.consumption import consumed_shards, watermarks
    from layertap.train import trainer
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    fake_worker.work(uri)
    base = ["train", "--data", uri, "--model", target, "--out", out, "--follow", "--follow-poll-s", "0.5",
            "--batch-size", "2", "--shuffle-buffer", "2", "--block-size", "4", "--max-anchors", "8"]
    assert cli([*base, "--steps", "8"]) == 0
    store, seen = _store(uri), []
    await_data = trainer._await_data

    def first_wait(run, step, saved, *rest):
        seen.append((step, consumed_shards(store), watermarks(store)))
        return await_data(run, step, saved, *rest)

    monkeypatch.setattr(trainer, "_await_data", first_wait)
    assert cli([*base, "--delete-consumed", "--resume"]) == 0
    step, consumed, marks = seen[0]
    assert step == 8 and consumed and marks[0]["step"] == 8  # recorded and deleted before step 9


def train_with_shard_6_given_up(tmp_path, *extra: str):
    """`layertap train --follow` of a run whose shard 6 was given up: (the plan, metrics.jsonl's records)."""
    from layertap.cli import main as cli
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    m = fake_worker.plan(_store(uri))
    fake_worker.work(uri, shards=[s for s in range(len(m.shards)) if s != 6])
    give_up(uri, 6)
    assert cli(["train", "--data", uri, "--model", target, "--out", out, "--follow", "--follow-poll-s", "0.5",
                *extra, "--batch-size", "4", "--block-size", "4", "--max-anchors", "8"]) == 0
    return m, [json.loads(x, parse_constant=_not_json) for x in _store(out).get("metrics.jsonl").decode().splitlines()]


def _not_json(constant: str):
    raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON (jq and JavaScript refuse it)")


def test_steps_of_padding_alone_count_no_tokens_and_the_final_loss_is_the_last_learned(tmp_path, capsys, caplog):
    """A follow epoch is padded to the plan; where extraction left samples out (here a given-up
    shard) its last steps hold padding alone: they showed as "final loss nan" with the pads'
    tokens counted in tokens/s, and their log lines as "loss nan"."""
    caplog.set_level(logging.INFO, logger="layertap")
    _, lines = train_with_shard_6_given_up(tmp_path)
    assert f"step {lines[-1]['step']}/{lines[-1]['step']}  loss none (padding only)  acc@1" in caplog.text
    pads = [r for r in lines if r["loss"] is None]  # null in metrics.jsonl: strict JSON
    assert pads and lines[-1] in pads  # the plan's last samples never came
    assert all(r["tokens"] == 0 and r["tokens_per_s"] == 0 for r in pads)
    learned = [r for r in lines if r["loss"] is not None]
    assert all(r["tokens"] > 0 for r in learned)
    printed = capsys.readouterr().out
    assert (f"final loss {learned[-1]['loss']:.4f} (step {learned[-1]['step']}; after it, "
            f"{len(lines) - len(learned)} step(s) had nothing to learn (zero loss weight: padding, e.g. for samples "
            "the extraction skipped))") in printed


def commit_without_samples(uri: str) -> None:
    """Extract every shard of fake_worker's plan with each of its samples skipped (as `layertap
    extract` skips rows longer than --max-length): commits of no records."""
    from layertap.manifests.records import Producer
    from layertap.manifests.work import WorkQueue
    from layertap.storage.format import ShardMeta
    from layertap.storage.writer import ShardWriter

    store = _store(uri)
    m = fake_worker.plan(store)
    for claim in WorkQueue(store, m, Producer.current(0)):
        with claim:
            meta = ShardMeta(run_id=m.run_id, shard_id=claim.shard, model="synthetic", layers=fake_worker.LAYERS,
                             hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
            with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                info = w.close()
            ids = [f"s{i:05d}" for i in range(claim.plan.start, claim.plan.end)]
            assert claim.commit(info, skipped=[{"sample_id": i, "reason": "too long"} for i in ids])


def test_a_follow_epoch_with_no_committed_samples_trains_to_its_end(tmp_path, capsys, monkeypatch):
    """Extraction skipped every sample, so every commit holds none and the follow epoch is padding
    alone. Its last batch settles the stream for the epochs after it (`ShardStream._settle`), whose
    reading of the commits failed there, at the last step: "no committed shards with samples",
    exit 2, no drafter. It ends as any follow epoch does: its steps (none an update), the drafter
    exported, and the closing line saying no step had anything to learn."""
    from layertap.cli import main as cli
    from tiny_models import tiny_model_dir

    monkeypatch.setitem(fake_worker.CONFIG, "hidden_size", fake_worker.HIDDEN)  # as a real extraction records it
    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    commit_without_samples(uri)
    assert cli(["train", "--data", uri, "--model", target, "--out", out, "--follow", "--follow-poll-s", "0.5",
                "--batch-size", "4", "--block-size", "4", "--max-anchors", "8"]) == 0
    lines = [json.loads(x) for x in _store(out).get("metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 11))  # the plan's 40 samples, 4 a step
    assert all(r["loss"] is None and r["tokens"] == 0 for r in lines)
    printed = capsys.readouterr().out
    assert "trained 10 steps; final loss none (no step had a finite loss: 10 step(s) had nothing to learn" in printed
    assert f"drafter at {_store(out).uri}/drafter/" in printed
    # a second epoch has nothing to read: said as such, not as shards a --delete-consumed trainer deleted
    assert cli(["train", "--data", uri, "--model", target, "--out", str(tmp_path / "out2"), "--follow",
                "--follow-poll-s", "0.5", "--batch-size", "4", "--block-size", "4", "--max-anchors", "8",
                "--epochs", "2"]) == 2
    err = capsys.readouterr().err
    assert "holds a sample (its extraction skipped them all" in err and "--delete-consumed" not in err


def extract_with_planned_skips(uri: str, *, keep_all: bool = False):
    """fake_worker's 40 rows with every 4th (from row 1) planned as one extraction skips, extracted
    as planned, or (`keep_all`) by a worker that ignores the plan's skips (an older layertap's):
    the manifest and the counts planned."""
    from dataclasses import replace

    from layertap.manifests.manifest import create_or_resume
    from layertap.manifests.records import Producer
    from layertap.manifests.work import WorkQueue
    from layertap.storage.format import ShardMeta
    from layertap.storage.writer import ShardWriter

    store = _store(uri)
    counts = [0 if i % 4 == 1 else n for i, n in enumerate(fake_worker.token_counts(SAMPLES))]
    m = create_or_resume(store, config=fake_worker.CONFIG, dataset=fake_worker.DATASET, token_counts=counts,
                         bytes_per_token=len(fake_worker.LAYERS) * fake_worker.HIDDEN * 2 / 1.3, shard_bytes=3000)[0]
    seen = replace(m, shards=[replace(p, skips=0) for p in m.shards]) if keep_all else m
    for claim in WorkQueue(store, seen, Producer.current(0)):
        with claim:
            meta = ShardMeta(run_id=m.run_id, shard_id=claim.shard, model="synthetic", layers=fake_worker.LAYERS,
                             hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
            rows = range(claim.plan.start, claim.plan.end)
            with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                for i in rows:
                    if counts[i] or keep_all:
                        w.write_sample(fake_worker.make_sample(i))
                info = w.close()
            assert claim.commit(info, skipped=[{"sample_id": f"s{i:05d}", "reason": "no_supervised_pair"}
                                               for i in rows if not (counts[i] or keep_all)])
    return m, counts


def test_the_follow_epoch_is_sized_by_the_samples_the_plan_stores_not_by_its_rows(tmp_path):
    """The planner knows which rows yield no sample (token count 0); the follow epoch counted them
    anyway: at --max-length 256, 83 of 300 ShareGPT rows, so 41 of 150 steps were padding alone
    and the lr schedule was stretched over them. Now each rank pads only to the plan's largest
    share of the samples it stores."""
    uri, world = str(tmp_path / "run"), 2
    m, counts = extract_with_planned_skips(uri)
    kept = {f"s{i:05d}" for i, n in enumerate(counts) if n}
    assert m.planned_records == len(kept) == 30 and len(m.shards) > 3
    got = [list(ShardStream(uri, config=StreamConfig(**CFG), rank=r, world_size=world)) for r in range(world)]
    target = follow_target([p.planned_records for p in m.shards], world)
    assert [len(g) for g in got] == [target] * world
    assert target < follow_target([p.num_samples for p in m.shards], world)  # what it was sized by
    assert sorted(x["sample_id"] for g in got for x in g if not x["padding"]) == sorted(kept)
    assert sum(x["padding"] for g in got for x in g) == world * target - len(kept) < len(m.shards)


def test_a_follow_epoch_refuses_commits_holding_more_samples_than_the_plan_counts(tmp_path):
    """Rows the plan counts as skipped, stored by a worker that ignores the plan's skips (an older
    layertap's): a consumer yielded past the count every rank pads to (17 of 16 each), and 6 of the
    40 samples were never trained. Refused with what to do; a plain epoch reads the run as it is."""
    from layertap.manifests.manifest import ManifestError

    uri = str(tmp_path / "run")
    m, _ = extract_with_planned_skips(uri, keep_all=True)
    with pytest.raises(ManifestError) as e:
        list(ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=2))
    assert f"{len(m.shards)} commit(s) under {uri}/commits/ hold more samples than the run's plan" in str(e.value)
    assert "train once extraction is done, without --follow" in str(e.value)
    plain = ShardStream(uri, config=StreamConfig(**dict(CFG, follow=False)), rank=0, world_size=1)
    assert sorted(x["sample_id"] for x in plain) == sorted(ALL)


def test_a_follow_state_sized_at_another_count_is_refused_as_such(tmp_path):
    """A follow trainer of a release that sized the epoch by rows, resumed by one that sizes it by
    the plan's samples: its schedule changed mid-run without a word, or (more consumed than the new
    count) it was called damaged. The state records the count it was sized at."""
    uri = str(tmp_path / "run")
    extract_with_planned_skips(uri)
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    it = iter(stream)
    for _ in range(5):
        next(it)
    state = stream.state_dict()
    it.close()
    assert state["follow_target"] == 30 and state["consumed"] == [5]

    def resumed(state):
        ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1).load_state_dict(state)

    resumed(state)  # its own: taken
    with pytest.raises(InputError, match="this state's follow epoch gives each consumer 40 samples, where this "
                                         "layertap sizes it at 30 from the run's plan"):
        resumed(dict(state, follow_target=40))
    old = {k: v for k, v in state.items() if k != "follow_target"}  # saved before states recorded it
    resumed(old)
    with pytest.raises(InputError, match="consumed 35 samples of epoch 0, whose share gives it 30 .* one from "
                                         "before plans counted their skipped rows"):
        resumed(dict(old, consumed=[35]))


def test_a_trainer_waiting_where_no_run_is_coming_is_told_of_the_runs_beside(tmp_path):
    """`--data s3://acts/run-1` for a run at `run1`: "waiting for extraction: no run ... yet" every
    30 s, forever, with no word of the run next to it."""
    from layertap.train.follow import _runs_beside

    fake_worker.plan(_store(str(tmp_path / "run1")))
    fake_worker.plan(_store(str(tmp_path / "other")))
    (tmp_path / "logs").mkdir()
    hint = _runs_beside(_store(str(tmp_path / "run-1")))
    assert hint == "; runs beside it: run1, other (is --data one of them?)"
    assert _runs_beside(_store(str(tmp_path / "logs" / "x"))) == ""  # nothing beside it is a run


def test_a_stream_waiting_beside_runs_warns_so_a_caller_without_logging_sees_it(tmp_path):
    """The wait was said at INFO: a Python caller who configured no logging saw ShardStream(follow=True)
    block without a word at a typo of the run's prefix. Beside runs, the wait is a warning (printed by
    Python's last-resort handler); a prefix with nothing beside it waits at INFO, extraction's start ahead."""
    code = ("import sys, threading, os; from layertap.train import ShardStream, StreamConfig; "
            "threading.Timer(2.0, lambda: os._exit(0)).start(); "
            "ShardStream(sys.argv[1], config=StreamConfig(follow=True, follow_poll_s=0.2))")
    fake_worker.plan(_store(str(tmp_path / "runs" / "run1")))
    (tmp_path / "empty").mkdir()
    for where, said in ((tmp_path / "runs" / "run-1", "runs beside it: run1 (is --data one of them?)"),
                        (tmp_path / "empty" / "run-1", None)):
        err = subprocess.run([sys.executable, "-c", code, str(where)], env=env(), capture_output=True, text=True,
                             timeout=120).stderr
        assert (said in err and "waiting for extraction: no run at" in err) if said else err == ""


def test_ranks_but_the_first_wait_for_the_manifest_quietly_and_seldom(tmp_path, monkeypatch, caplog):
    """Every rank of a follow trainer listed the runs beside the prefix (a LIST and up to 50 HEADs) to
    warn of them, and looked as often as rank 0 (--follow-poll-s): a thousand ranks, a thousand times
    rank 0's cost. The other ranks say nothing, back off to 30 s at least, and still find the run."""
    import logging

    from layertap.train import follow

    store = _store(str(tmp_path / "run-1"))
    fake_worker.plan(_store(str(tmp_path / "run1")))  # beside it: rank 0 names it
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 8:
            fake_worker.plan(store)  # extraction starts

    monkeypatch.setattr(follow.time, "sleep", sleep)
    monkeypatch.setattr(follow, "_runs_beside", lambda _: pytest.fail("a quiet rank listed the runs beside it"))
    with caplog.at_level(logging.INFO, logger="layertap"):
        manifest = follow.wait_for_manifest(store, poll_s=2.0, quiet=True)
    assert len(manifest.shards) > 0 and len(sleeps) == 8 and not caplog.records
    assert max(sleeps) > 10  # backing off towards 30 s, not capped at --follow-poll-s (2 s here)


def test_follow_with_several_epochs_ends_with_the_last_one(tmp_path):
    """--follow --epochs 2 counts its steps as two follow epochs, padded to the plan; the second
    holds only the committed samples (a shard was given up), so it ends sooner: training ends
    there, not with a few steps of a third epoch."""
    m, lines = train_with_shard_6_given_up(tmp_path, "--epochs", "2")
    committed = SAMPLES - m.shards[6].num_samples
    assert [x["epoch"] for x in lines] == [0] * (SAMPLES // 4) + [1] * -(-committed // 4)
    # The same job started again (a requeue) is done: it withdrew the export, counting the plan's
    # steps past the last epoch's end, waited for data, then exported the same weights again
    from layertap.cli import main as cli
    from tiny_models import tiny_model_dir

    out = tmp_path / "out"
    exported = (out / "drafter" / "config.json").stat().st_mtime_ns
    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    assert cli(["train", "--data", str(tmp_path / "run"), "--model", target, "--out", str(out), "--follow",
                "--follow-poll-s", "0.5", "--epochs", "2", "--batch-size", "4", "--block-size", "4", "--max-anchors",
                "8", "--resume"]) == 0
    assert (out / "drafter" / "config.json").stat().st_mtime_ns == exported
    assert len(_store(str(out)).get("metrics.jsonl").decode().splitlines()) == len(lines)


# -- one consumer, in-process --------------------------------------------------------------------

def test_follow_starts_before_the_manifest_and_resumes_exactly(tmp_path, caplog):
    """A stream opened before extraction starts waits for the manifest, yields every sample once;
    a stream stopped mid-epoch and resumed from its state yields exactly the rest, in the order
    an uninterrupted stream with the same discovery order yields."""
    uri = str(tmp_path / "run")
    caplog.set_level("INFO", logger="layertap.train.follow")
    procs = []
    import threading
    threading.Timer(1.0, lambda: procs.extend(start_workers(uri, n=1, slow=0.03))).start()
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    assert "waiting for extraction: no run at" in caplog.text
    it = iter(stream)
    first = [next(it) for _ in range(9)]
    state = json.loads(json.dumps(stream.state_dict()))  # JSON round trip, as a checkpoint keeps it
    assert state["epoch"] == 0 and state["consumed"] == [9] and state["taken"][0]
    it.close()
    assert stream.consumed_shards(state) == sorted(stream.consumed_shards(state))

    resumed = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    resumed.load_state_dict(state)
    rest, taken = [], None
    for x in resumed:
        rest.append(x)
        taken = list(resumed.position.taken(0))  # the full discovery order, before the epoch rolls over
    finish(procs)
    ids = [x["sample_id"] for x in first + rest if not x["padding"]]
    assert Counter(ids) == Counter(ALL) and len(first + rest) == SAMPLES  # one consumer: no padding
    assert taken[:len(state["taken"][0])] == state["taken"][0]
    assert resumed.epoch == 1

    replay = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    replay.load_state_dict(dict(state, consumed=[0], taken=[taken]))
    assert [x["sample_id"] for x in replay] == [x["sample_id"] for x in first + rest]
    # every shard is consumed once the epoch is over
    assert replay.consumed_shards() == list(range(7))
    # the follow epoch's state is its rank's own (the shards it found, in its order): another rank's is refused
    other = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    with pytest.raises(InputError, match="saved by rank 1 in the follow epoch.*rank 0 must resume from its own"):
        other.load_state_dict(dict(state, rank=1))


@pytest.mark.parametrize("threads", [1, 3])
def test_follow_decode_threads_yield_what_the_consumers_thread_decodes(tmp_path, threads):
    """Decode threads in the follow epoch, while workers are still committing (so the look ahead
    meets inputs not known yet): the same samples, in the same order, with the same tensors as
    decoding on the consumer's thread over the same discovery order."""
    import torch

    uri = str(tmp_path / "run")
    procs = start_workers(uri, n=2, slow=0.03)
    stream = ShardStream(uri, config=StreamConfig(**CFG, decode_threads=threads), rank=0, world_size=1)
    got, taken = [], None
    for x in stream:
        got.append(x)
        taken = list(stream.position.taken(0))
    finish(procs)
    replay = ShardStream(uri, config=StreamConfig(**CFG, decode_threads=0), rank=0, world_size=1)
    replay.load_state_dict(dict(stream.state_dict(), epoch=0, consumed=[0], taken=[taken]))
    again = list(replay)
    assert len(got) == SAMPLES and [x["sample_id"] for x in got] == [x["sample_id"] for x in again]
    assert all(torch.equal(a["hidden_states"], b["hidden_states"]) for a, b in zip(got, again))


def test_consumed_shards_are_those_every_sample_of_which_was_yielded(tmp_path):
    uri = str(tmp_path / "run")
    finish(start_workers(uri, n=1, slow=0))
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    seen: set[str] = set()
    ids_of = {}
    for shard in stream._manifest.shards:
        ids_of[shard.id] = {f"s{i:05d}" for i in range(shard.start, shard.end)}
    it = iter(stream)
    for n in range(1, SAMPLES):
        seen.add(next(it)["sample_id"])
        done = stream.consumed_shards()
        assert done == sorted(s for s, ids in ids_of.items() if ids <= seen)
    it.close()


def test_a_skipped_sample_of_the_follow_epoch_counts_as_padding(tmp_path):
    """on_corrupt="skip" in the follow epoch yields a zero-weighted repeat for each sample of a failed
    shard, as a plain epoch does; it was counted in skipped_samples but not in padding_samples."""
    from layertap.manifests import layout
    from layertap.manifests.records import decode_commit
    from layertap.storage.store import open_store

    uri = str(tmp_path / "run")
    finish(start_workers(uri, n=1, slow=0))
    store = open_store(uri)
    commit = decode_commit(store.get(layout.commit_key(2)), "commit")
    data = bytearray(store.get(commit.data_key))
    data[-10] ^= 0xFF  # in its footer: none of its records can be found
    store.put(commit.data_key, bytes(data))
    stream = ShardStream(uri, config=StreamConfig(**CFG, on_corrupt="skip"), rank=0, world_size=1)
    got = list(stream)
    m = stream.metrics()
    assert m["skipped_samples"] == len(commit.sample_ids) and m["corrupt_shards"] == 1
    assert m["padding_samples"] == sum(s["padding"] for s in got) >= m["skipped_samples"]
    assert {s["sample_id"] for s in got if not s["padding"]} == ALL - set(commit.sample_ids)


def test_consumed_shards_come_from_the_checkpointed_state_without_reading_the_commits(tmp_path, monkeypatch):
    """Every rank of a `--delete-consumed` trainer computes its consumed shards at every
    checkpoint, in the trainer's process, which never saw the commits its DataLoader workers
    found: it read the run's commits each time (a listing, and a GET per commit the index lacks:
    at 1,000 ranks late in a run, millions of GETs per checkpoint). The position now carries each
    taken shard's record count, so the state alone answers; a state saved before the counts
    still gets its answer from the commits."""
    from layertap.train import stream as stream_module

    uri = str(tmp_path / "run")
    finish(start_workers(uri, n=1, slow=0))
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    ids_of = {p.id: {f"s{i:05d}" for i in range(p.start, p.end)} for p in stream._manifest.shards}
    loader = StreamLoader(stream, batch_size=3, num_workers=2)
    read = stream_module.read_commits
    reads: list[str] = []
    monkeypatch.setattr(stream_module, "read_commits",
                        lambda store, *a, **kw: reads.append(store.uri) or read(store, *a, **kw))
    seen: set[str] = set()
    checked = 0
    for batch in loader:
        seen.update(i for i, pad in zip(batch["sample_id"], batch["padding"]) if not pad)
        state = loader.state_dict()
        if not state["consumed"] or state["epoch"] > 0:
            continue
        assert stream.consumed_shards(state) == sorted(s for s, ids in ids_of.items() if ids <= seen)
        assert reads == []  # the state named every taken shard's count
        old = dict(state, taken_records=None)  # a checkpoint of a layertap before the counts
        stream._records.clear()
        assert stream.consumed_shards(old) == sorted(s for s, ids in ids_of.items() if ids <= seen)
        assert len(reads) == 1
        reads.clear()
        stream._records.clear()
        checked += 1
    assert checked >= 3 and seen == ALL


def give_up(uri: str, shard: int, failures: int = 1) -> None:
    """A worker fails `shard` `failures` times and, its --retries 0 used up, gives it up."""
    from layertap.manifests.records import Producer
    from layertap.manifests.work import Claim, WorkQueue

    store = _store(uri)
    m = fake_worker.plan(store)
    q = WorkQueue(store, m, Producer.current(9), retries=failures - 1, shards=[shard])
    for gen in range(1, failures + 1):
        Claim(q, m.shards[shard], generation=gen, attempt=f"x{gen}").fail(RuntimeError("bad input"))
    assert list(q) == [] and q.given_up == {shard}


def test_the_follow_epoch_ends_on_a_given_up_shard_not_on_a_failure_a_retry_may_mend(tmp_path):
    """A preempted shard, or one that failed with retries left (its worker waiting behind
    --window holds no lease), will still come: ending the epoch there trains it without them, and
    a window run's extraction then waits on a trainer that has left. Only a worker's verdict
    (it used up its --retries) ends it."""
    from layertap.manifests.records import Producer
    from layertap.manifests.work import Claim, WorkQueue
    from layertap.train.follow import CommitWatcher

    uri = str(tmp_path / "run")
    store = _store(uri)
    m = fake_worker.plan(store)
    fake_worker.work(uri, shards=[s for s in range(len(m.shards)) if s != 2])
    watcher = CommitWatcher(store, m, poll_s=0.1)
    watcher.poll()
    q = WorkQueue(store, m, Producer.current(5), retries=1, shards=[2])
    Claim(q, m.shards[2], generation=1, attempt="x1").fail(KeyboardInterrupt(), preempted=True)
    assert [watcher._extraction_over() for _ in range(3)] == [False] * 3  # preempted: it will be redone
    Claim(q, m.shards[2], generation=2, attempt="x2").fail(RuntimeError("bad input"))
    assert [watcher._extraction_over() for _ in range(3)] == [False] * 3  # one failure of 2 allowed
    Claim(q, m.shards[2], generation=3, attempt="x3").fail(RuntimeError("bad input"))
    assert list(q) == [] and q.given_up == {2}  # --retries 1 used up: the worker says so
    assert [watcher._extraction_over() for _ in range(2)] == [False, True]
    watcher._given_up_once = False  # a resubmitted worker fails it once more: retrying again
    time.sleep(0.01)
    Claim(WorkQueue(store, m, Producer.current(6), shards=[2]), m.shards[2], generation=4,
          attempt="x4").fail(RuntimeError("bad input"))
    assert [watcher._extraction_over() for _ in range(2)] == [False, False]


def test_later_looks_list_the_feed_not_every_commit_and_still_find_what_it_missed(tmp_path, monkeypatch):
    """Each of thousands of consumers looks for new commits every few seconds while it waits:
    listing `commits/` (a page per 1,000 shards) each time would cost O(run) per look. After the
    first look a consumer lists only the feed keys written since its previous look; commits/ is
    listed every FULL_LOOK_S and before extraction counts as over, which finds a commit whose feed
    key is missing (its worker killed in between). A run whose workers wrote no feed is followed
    by listing commits/ at every look."""
    from layertap.manifests import layout
    from layertap.train import follow
    from layertap.train.follow import CommitWatcher

    uri = str(tmp_path / "run")
    store = _store(uri)
    m = fake_worker.plan(store)
    fake_worker.work(uri, shards=[0, 1])
    watcher = CommitWatcher(store, m, poll_s=0.1)
    assert [r.shard for r in watcher.poll()] == [0, 1]
    listed: list[str] = []
    plain_list = store.list
    monkeypatch.setattr(store, "list", lambda prefix="", start_after="": listed.append(prefix)
                        or plain_list(prefix, start_after))

    fake_worker.work(uri, shards=[2, 3])
    assert [r.shard for r in watcher.poll()] == [2, 3] and listed == [layout.FEED]
    fake_worker.work(uri, shards=[4])
    store.delete(next(o.key for o in plain_list(layout.FEED) if layout.parse_feed(o.key)[1] == 4))
    assert watcher.poll() == [] and layout.COMMITS not in listed  # the feed does not show it
    assert watcher._missed_commits()  # what runs before extraction counts as over: commits/ shows it
    assert [r.shard for r in watcher.poll()] == [4] and listed[-1] == layout.COMMITS
    fake_worker.work(uri, shards=[5])
    store.delete(next(o.key for o in plain_list(layout.FEED) if layout.parse_feed(o.key)[1] == 5))
    listed.clear()
    assert watcher.poll() == [] and listed == [layout.FEED]
    monkeypatch.setattr(follow, "FULL_LOOK_S", 0.0)  # the periodic listing of commits/ finds it too
    assert [r.shard for r in watcher.poll()] == [5] and listed[-1] == layout.COMMITS

    store.delete_many([o.key for o in plain_list(layout.FEED)])  # a run extracted before the feed
    monkeypatch.setattr(follow, "FULL_LOOK_S", 300.0)
    old = CommitWatcher(store, m, poll_s=0.1)
    assert [r.shard for r in old.poll()] == [0, 1, 2, 3, 4, 5]
    fake_worker.work(uri, shards=[6])
    store.delete_many([o.key for o in plain_list(layout.FEED)])
    assert [r.shard for r in old.poll()] == [6] and old.complete


def test_a_consumer_reads_only_the_commit_records_of_shards_it_has_a_share_of(tmp_path):
    """At 1,000 ranks x 4 loader workers and a few dozen samples per shard, most consumers have no
    share of most shards; each GET of every new commit record by every consumer would cost as
    many requests as the data. A feed key carries the shard's counts, so a consumer reads only the
    records of shards it has a share of, and still knows every commit (its epoch ends when
    extraction does) and yields its share: every sample once across the consumers."""
    import threading

    from layertap.manifests import layout

    uri, world = str(tmp_path / "run"), 8
    m = fake_worker.plan(_store(uri))  # 40 samples in 7 shards: each consumer has no share of some
    got: dict[int, list] = {}
    records_read: dict[int, list[int]] = {r: [] for r in range(world)}
    waiting = [threading.Event() for _ in range(world)]  # set by a consumer's first look at the feed

    def consume(rank: int) -> None:
        store = _store(uri)
        plain_get = store.get

        def get(key: str, *a, **kw):
            if (shard := layout.shard_of(key, layout.COMMITS)) is not None and key == layout.commit_key(shard):
                records_read[rank].append(shard)
            return plain_get(key, *a, **kw)

        plain_list = store.list

        def listing(prefix: str = "", start_after: str = ""):
            if prefix == layout.FEED:
                waiting[rank].set()
            return plain_list(prefix, start_after)

        store.get, store.list = get, listing
        stream = ShardStream(store, config=StreamConfig(**dict(CFG, follow_poll_s=0.2)), rank=rank, world_size=world)
        samples = iter(stream)
        got[rank] = list(samples)

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for w in waiting:  # every consumer's first look found nothing: every commit comes by the feed
        assert w.wait(timeout=120)
    fake_worker.work(uri)
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive()
    real = [s["sample_id"] for r in range(world) for s in got[r] if not s["padding"]]
    assert Counter(real) == Counter(ALL)
    for rank in range(world):
        shares = {p.id: follow_share(p.num_samples, p.id, world, rank)[1] for p in m.shards}
        assert {s for s, k in shares.items() if k == 0}, "the test needs shards a consumer has no share of"
        assert sorted(records_read[rank]) == sorted(s for s, k in shares.items() if k)
        assert len(got[rank]) == follow_target([p.num_samples for p in m.shards], world)


def test_a_consumer_started_late_reads_only_the_records_it_has_a_share_of(tmp_path):
    """A follow trainer (re)started late in an extraction: the commit index is not refreshed while
    it runs, so each consumer's first look GETs every commit the index lacks (thousands, on each of
    thousands of consumers). The tally markers' names give every committed shard's counts in one
    listing: the first look reads only the records of shards the consumer has a share of. A shard
    with two tally markers (redone after `verify`) is read all the same."""
    from layertap.manifests import layout
    from layertap.manifests.records import CommitRecord, FeedCommit
    from layertap.train.follow import CommitWatcher

    uri, consumers, me = str(tmp_path / "run"), 8, 3
    store = _store(uri)
    m = fake_worker.plan(store)
    fake_worker.work(uri)
    shares = {p.id: follow_share(p.num_samples, p.id, consumers, me)[1] for p in m.shards}
    without = sorted(s for s, k in shares.items() if not k)
    assert without and len(without) < len(m.shards)
    key = next(o.key for o in store.list(layout.TALLY) if layout.parse_tally(o.key)[0] == without[0])
    store.put(key.replace(".r", ".r1", 1), b"")  # a second marker, with other counts
    read: list[int] = []
    plain_get = store.get
    store.get = lambda key, *a, **kw: (read.append(layout.shard_of(key, layout.COMMITS))
                                       if key.startswith(layout.COMMITS) else None) or plain_get(key, *a, **kw)
    watcher = CommitWatcher(store, m, poll_s=0.1, wants=lambda shard, n: follow_share(n, shard, consumers, me)[1] > 0)
    found = {c.shard: c for c in watcher.poll()}
    assert sorted(found) == list(range(len(m.shards))) and watcher.complete
    assert sorted(read) == sorted([s for s, k in shares.items() if k] + [without[0]])
    assert all(isinstance(found[s], FeedCommit) for s in without[1:]) and isinstance(found[without[0]], CommitRecord)
    assert all(found[s].num_records == m.shards[s].num_samples for s in found)


def test_a_feed_key_without_counts_still_has_its_record_read(tmp_path):
    """Workers before the counts were in the feed key wrote `feed/{ms}.{shard}`: a consumer cannot
    tell its share from such a key, so it reads the record, whatever `wants` says."""
    from layertap.manifests import layout
    from layertap.manifests.records import CommitRecord, FeedCommit
    from layertap.train.follow import CommitWatcher

    uri = str(tmp_path / "run")
    store = _store(uri)
    m = fake_worker.plan(store)
    fake_worker.work(uri, shards=[0])
    watcher = CommitWatcher(store, m, poll_s=0.1, wants=lambda shard, records: False)
    assert [type(r) for r in watcher.poll()] == [FeedCommit]  # the first look: counts from the tally marker
    fake_worker.work(uri, shards=[1, 2])
    key = next(o.key for o in store.list(layout.FEED) if layout.parse_feed(o.key)[1] == 2)
    store.delete(key)
    store.put(key[: key.index(".r")], b"")
    assert layout.parse_feed(key[: key.index(".r")])[2] is None
    assert [(type(r), r.shard) for r in watcher.poll()] == [(FeedCommit, 1), (CommitRecord, 2)]
    assert watcher.known[1].num_records == m.shards[1].num_samples


def test_a_waiting_consumer_asks_whether_extraction_is_over_only_after_empty_looks(tmp_path, monkeypatch):
    """Whether extraction is over (leases, failures, given-up shards: three listings) matters only
    once commits stop coming; a consumer kept fed by commits lists the feed alone. Asked after
    three empty looks in a row, or when the waiting line is due (every 30 s)."""
    from layertap.manifests import layout
    from layertap.train.follow import CommitWatcher

    uri = str(tmp_path / "run")
    store = _store(uri)
    m = fake_worker.plan(store)
    fake_worker.work(uri, shards=[0])
    watcher = CommitWatcher(store, m, poll_s=30.0)
    watcher.poll()
    watcher._logged = time.monotonic()  # the waiting line was just written
    listed: list[str] = []
    plain_list = store.list
    monkeypatch.setattr(store, "list", lambda prefix="", start_after="": listed.append(prefix)
                        or plain_list(prefix, start_after))
    pauses: list[float] = []

    def commit_in_pause(n: int):  # the backoff's pauses, the n-th of which a commit lands in
        def pause(s: float) -> None:
            pauses.append(s)
            if len(pauses) == n:
                fake_worker.work(uri, shards=[len(watcher.known)])
        return pause

    watcher._backoff._sleep = commit_in_pause(2)
    assert [r.shard for r in watcher.wait()] == [1] and set(listed) == {layout.FEED} and len(listed) == 3
    listed.clear()
    pauses.clear()
    watcher._backoff._sleep = commit_in_pause(3)
    assert [r.shard for r in watcher.wait()] == [2]
    assert listed.count(layout.FEED) == 4 and listed.count(layout.LEASES) == 1  # asked once, after the third
    assert listed.index(layout.LEASES) > [i for i, p in enumerate(listed) if p == layout.FEED][2]


def test_after_the_follow_epoch_only_the_shards_it_took_count_as_consumed(tmp_path):
    """A shard committed after the follow epoch ended (given up, then redone) was never trained
    on: `--delete-consumed` must not delete it with the rest."""
    uri = str(tmp_path / "run")
    store = _store(uri)
    m = fake_worker.plan(store)
    fake_worker.work(uri, shards=[s for s in range(len(m.shards)) if s != 6])
    give_up(uri, 6)
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    got = list(stream)
    assert sum(not x["padding"] for x in got) == SAMPLES - m.shards[6].num_samples
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["epoch"] == 1
    fake_worker.work(uri, shards=[6])  # resubmitted, it commits now
    assert stream.consumed_shards(state) == [0, 1, 2, 3, 4, 5]
    assert ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1).consumed_shards(state) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("batch_size", [64, 16])
def test_the_shards_a_lone_workers_last_batch_took_count_as_consumed(tmp_path, batch_size):
    """With one DataLoader worker, the worker's copy of the position rolls on to the next epoch
    as soon as its one consumer is done, before the batch that ends the follow epoch is collated:
    the shards it took while making that batch never reached the trainer, so `--delete-consumed`
    left them at rest (all of them, with a batch as large as the epoch)."""
    uri = str(tmp_path / "run")
    m = fake_worker.plan(_store(uri))
    fake_worker.work(uri, shards=list(range(len(m.shards))))
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    loader = StreamLoader(stream, batch_size=batch_size, num_workers=1)
    assert sorted(sid for b in loader for sid in b["sample_id"]) == sorted(ALL)
    state = stream.state_dict()
    assert state["epoch"] == 1
    assert state["follow_trained"] == list(range(len(m.shards)))
    assert stream.consumed_shards(state) == list(range(len(m.shards)))


def test_the_stall_checkpoint_is_taken_whichever_rank_lacks_its_batch(tmp_path, monkeypatch):
    """Two ranks' shares of a follow run differ by a few samples, so at a stall rank 0 may hold its
    next batch while rank 1 waits: the trainer must still checkpoint (freeing the window), not
    wait for good. Rank 0's `_await_data`, with rank 1's part of each reduce played here."""
    import types

    import torch

    import layertap.train.trainer as trainer
    from layertap.manifests.consumption import WindowGate

    uri = str(tmp_path / "run")
    fake_worker.work(uri, shards=[0, 1, 2])
    WindowGate(_store(uri), 10_000).record()  # its 3 shards fill the window: extraction is held
    saves: list[int] = []
    monkeypatch.setattr(trainer, "_save", lambda run, step: saves.append(step))

    def reduce(flags, reduction):  # rank 1: no batch until the checkpoint frees the window; no stop
        rank1 = {2: [0.0 if saves else 1.0, 0.0], 1: [0.0]}[len(flags)]
        return flags + torch.tensor(rank1, dtype=flags.dtype)

    acc = types.SimpleNamespace(num_processes=2, is_main_process=True, device=torch.device("cpu"), reduce=reduce)
    run = types.SimpleNamespace(acc=acc, batches=types.SimpleNamespace(ready=lambda timeout, count: True),
                                data=_store(uri),
                                stop=types.SimpleNamespace(requested=None),
                                cfg=types.SimpleNamespace(delete_consumed=True, grad_accum=1))
    assert trainer._await_data(run, step=2, saved=0) == (False, 2)
    assert saves == [2]


def test_a_restart_in_the_padding_needs_no_deleted_data(tmp_path, monkeypatch):
    """A rank restarted at the end of the follow epoch, after every shard was consumed and
    deleted (a window run), still yields its zero-weighted padding: one token of zeros in the
    run's shapes, not a fetched sample (whose data is gone), and the same padding as the epoch
    run through: it repeated its last sample, so a resumed run's samples differed (zero-weighted:
    the same training, another samples_digest)."""
    from layertap.manifests.consumption import delete_consumed, record_consumed
    from layertap.storage.store import open_store

    monkeypatch.setattr(fake_worker, "CONFIG", dict(fake_worker.CONFIG, hidden_size=fake_worker.HIDDEN))
    uri, world = str(tmp_path / "run"), 3  # 40 samples over 3 ranks: padding on some
    fake_worker.work(uri)
    cfg = StreamConfig(**CFG)
    states, padded, wholes = [], [], []
    for r in range(world):
        whole = list(ShardStream(uri, config=cfg, rank=r, world_size=world))
        wholes.append(whole)
        real = sum(not x["padding"] for x in whole)
        assert all(x["padding"] for x in whole[real:])
        stream = ShardStream(uri, config=cfg, rank=r, world_size=world)
        it = iter(stream)
        for _ in range(real):
            next(it)
        states.append(json.loads(json.dumps(stream.state_dict())))
        it.close()
        if len(whole) > real:
            padded.append((r, len(whole) - real))
        record_consumed(open_store(uri), rank=r, world_size=world, shards=stream.consumed_shards(states[r]), step=1)
    assert padded, "no rank pads: the test needs one that does"
    assert sorted(delete_consumed(open_store(uri))) == list(range(7))
    assert list(open_store(uri).list("shards/")) == []
    for r, pads in padded:
        resumed = ShardStream(uri, config=cfg, rank=r, world_size=world)
        resumed.load_state_dict(states[r])
        rest = list(resumed)
        assert len(rest) == pads and all(x["padding"] and not x["loss_mask"].any() for x in rest)
        assert rest[0]["hidden_states"].shape == (1, len(fake_worker.LAYERS), fake_worker.HIDDEN)
        whole = wholes[r][-pads:]
        assert [x["sample_id"] for x in rest] == [x["sample_id"] for x in whole] == ["padding"] * pads
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(rest, whole))


def test_a_run_through_pads_without_reading_what_was_consumed_meanwhile(tmp_path):
    """A manifest without hidden_size (a synthetic run) gives the padding no shapes of its own: the
    stand-in takes those of the first sample the consumer yielded, not of a sample fetched at the
    epoch's end, when a --delete-consumed run has deleted its shards (that raised ShardError)."""
    from layertap.manifests.consumption import delete_consumed, record_consumed
    from layertap.storage.store import open_store

    uri, world = str(tmp_path / "run"), 3
    fake_worker.work(uri)  # no hidden_size in its manifest
    cfg = StreamConfig(**CFG)
    reals = [sum(not x["padding"] for x in ShardStream(uri, config=cfg, rank=r, world_size=world)) for r in range(world)]
    streams = [ShardStream(uri, config=cfg, rank=r, world_size=world) for r in range(world)]
    its = [iter(s) for s in streams]
    for r in range(world):
        for _ in range(reals[r]):
            next(its[r])
        record_consumed(open_store(uri), rank=r, world_size=world, shards=streams[r].consumed_shards(), step=1)
    assert sorted(delete_consumed(open_store(uri))) == list(range(7))
    rests = [list(it) for it in its]
    assert any(rests), "no rank pads: the test needs one that does"
    for rest in rests:
        assert all(x["sample_id"] == "padding" and x["padding"] and x["input_ids"].shape == (1,) for x in rest)
        assert all(x["hidden_states"].shape == (1, len(fake_worker.LAYERS), fake_worker.HIDDEN) for x in rest)


def test_a_consumer_resumed_in_its_padding_takes_its_shapes_from_a_shard_not_yet_deleted(tmp_path):
    """A manifest without hidden_size, a rank restarted at the end of its follow epoch while another
    rank is still mid-epoch: the shards every rank has consumed are deleted, the rest are not. The
    padding's shapes come from the first readable sample of its own shards that are still there; the
    first of them, deleted, failed the restart."""
    from layertap.manifests.consumption import delete_consumed, record_consumed
    from layertap.storage.store import open_store

    uri, world = str(tmp_path / "run"), 3
    fake_worker.work(uri)  # no hidden_size in its manifest
    cfg = StreamConfig(**CFG)
    wholes = [list(ShardStream(uri, config=cfg, rank=r, world_size=world)) for r in range(world)]
    reals = [sum(not x["padding"] for x in whole) for whole in wholes]
    pads = [r for r in range(world) if len(wholes[r]) > reals[r]]
    assert pads, "no rank pads: the test needs one that does"
    padded, behind = pads[0], next(r for r in range(world) if r != pads[0])
    states = {}
    for r in range(world):
        stream = ShardStream(uri, config=cfg, rank=r, world_size=world)
        it = iter(stream)
        for _ in range(reals[r] if r != behind else reals[r] // 2):
            next(it)
        states[r] = json.loads(json.dumps(stream.state_dict()))
        it.close()
        record_consumed(open_store(uri), rank=r, world_size=world, shards=stream.consumed_shards(states[r]), step=1)
    deleted = sorted(delete_consumed(open_store(uri)))
    assert deleted and deleted[0] == 0 and len(deleted) < 7, deleted  # its first shard gone, not all of them
    resumed = ShardStream(uri, config=cfg, rank=padded, world_size=world)
    resumed.load_state_dict(states[padded])
    rest = list(resumed)
    assert len(rest) == len(wholes[padded]) - reals[padded]
    assert all(x["sample_id"] == "padding" and x["padding"] and not x["loss_mask"].any() for x in rest)
    assert all(x["hidden_states"].shape == (1, len(fake_worker.LAYERS), fake_worker.HIDDEN) for x in rest)


# -- ranks x workers, real processes -------------------------------------------------------------

def consume(uri: str, rank: int, world: int, workers: int, out: str) -> None:
    """One rank: the follow epoch, then the next, through a StreamLoader with worker processes."""
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=rank, world_size=world)
    loader = StreamLoader(stream, batch_size=3, num_workers=workers)
    epochs = []
    for _ in range(2):
        epochs.append([[list(b["sample_id"]), [bool(p) for p in b["padding"]]] for b in loader])
    Path(out).write_text(json.dumps(epochs))


@pytest.mark.slow
def test_two_ranks_x_two_workers_follow_extraction_on_s3(s3_bucket, tmp_path):
    uri = f"s3://{s3_bucket}/runs/follow"
    ranks = [subprocess.Popen([sys.executable, __file__, "consume", uri, str(r), "2", "2", str(tmp_path / f"{r}.json")],
                              env=env())
             for r in range(2)]
    time.sleep(2)  # the ranks start before the run exists
    finish(start_workers(uri, n=2, slow=0.05))
    for p in ranks:
        assert p.wait(timeout=600) == 0
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    follow = [[(i, p) for ids, pads in epochs[0] for i, p in zip(ids, pads)] for epochs in got]
    real = [i for rank in follow for i, p in rank if not p]
    assert Counter(real) == Counter(ALL)  # every sample exactly once across 2 ranks x 2 workers
    assert len(got[0][0]) == len(got[1][0]) and len(follow[0]) == len(follow[1])  # equal batches per rank
    target = follow_target([p.num_samples for p in fake_worker.plan(_store(uri)).shards], 4)
    assert len(follow[0]) == 2 * target  # every consumer pads to the same count

    # the second epoch is today's order over the complete run
    for r in range(2):
        plain = ShardStream(uri, config=StreamConfig(**dict(CFG, follow=False)), rank=r, world_size=2)
        plain.set_epoch(1)
        expected = [list(b["sample_id"]) for b in StreamLoader(plain, batch_size=3, num_workers=2)]
        assert [ids for ids, _ in got[r][1]] == expected


@pytest.mark.slow
def test_train_follow_reaches_its_steps_while_workers_extract(s3_bucket, tmp_path):
    """`layertap train --follow --delete-consumed` started before the run exists: it waits, trains
    on shards as they land, runs the steps the manifest's plan gives, and deletes consumed data."""
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = f"s3://{s3_bucket}/runs/train", str(tmp_path / "out")
    train = subprocess.Popen(
        [sys.executable, "-m", "layertap", "train", "--data", uri, "--model", target, "--out", out, "--follow",
         "--follow-poll-s", "0.5", "--delete-consumed", "--batch-size", "4", "--block-size", "4", "--max-anchors", "8",
         "--save-every", "4"], env=dict(env(), OMP_NUM_THREADS="1"), cwd=HERE.parent, stdout=subprocess.DEVNULL,
        stderr=(log := open(tmp_path / "train.err", "w")))
    log.close()
    deadline = time.time() + 180  # the workers start once it waits (a fixed head start was too short on a busy machine)
    while "waiting for extraction" not in (tmp_path / "train.err").read_text() and train.poll() is None \
            and time.time() < deadline:
        time.sleep(0.1)
    finish(start_workers(uri, n=2, slow=0.05))
    train.wait(timeout=600)
    stderr = (tmp_path / "train.err").read_text()
    assert train.returncode == 0, stderr[-3000:]
    assert "waiting for extraction" in stderr
    lines = _store(out).get("metrics.jsonl").decode().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, SAMPLES // 4 + 1))  # from the plan: 40 samples
    assert not list(_store(uri).list("shards/"))  # every shard was consumed by the last checkpoint



@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_trainer_waiting_on_a_full_window_checkpoints_so_extraction_goes_on(ranks, s3_bucket, tmp_path):
    """A window that checkpoints every --save-every steps could never free: 3-4 shards' worth, while
    the trainer checkpoints only at its last step. Training waits for data and extraction for the
    window, until the trainer, seeing the stall, checkpoints where it is (with 2 ranks: together):
    its shards are deleted, extraction goes on, and the run trains to its end. The data at rest
    stays under the bound."""
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = f"s3://{s3_bucket}/runs/stall{ranks}", str(tmp_path / "out")
    store = _store(uri)
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    train = subprocess.Popen(
        [sys.executable, *launch, "-m", "layertap", "train", "--data", uri, "--model", target, "--out", out, "--follow",
         "--follow-poll-s", "0.5", "--delete-consumed", "--batch-size", "2", "--shuffle-buffer", "2",
         "--block-size", "4", "--max-anchors", "8", "--save-every", "1000", "--keep-checkpoints", "0"],
        env=dict(env(), OMP_NUM_THREADS="1"), cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    time.sleep(3)
    window, workers = 8_000 * (2 + ranks), 1  # fake_worker's shards are 7.0-8.1 kB: 3-4 of its 7
    extract = subprocess.Popen([sys.executable, str(HERE / "fake_worker.py"), uri, "--window", str(window)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
    peak = largest = 0
    deadline = time.time() + 240
    while (extract.poll() is None or train.poll() is None) and time.time() < deadline:
        sizes = [o.size for o in store.list("shards/")]
        peak, largest = max(peak, sum(sizes)), max([largest, *sizes])
        time.sleep(0.05)
    for p in (extract, train):
        if p.poll() is None:
            p.kill()
    assert time.time() < deadline, f"stalled for good: {train.communicate()[1][-3000:]}"
    stdout, stderr = train.communicate(timeout=60)
    assert train.returncode == 0, stderr[-3000:]
    assert extract.wait() == 0, extract.stderr.read()[-3000:]
    waits = stderr.count("the data at rest fills extraction's storage window while training waits for data")
    assert waits >= 1, stderr[-3000:]
    saved = sorted(int(o.key.split("/")[1].split("-")[1]) for o in _store(out).list("checkpoints/step-")
                   if o.key.endswith("state.json"))
    steps = SAMPLES // (2 * ranks)  # batches of 2 per rank
    assert len(saved) == waits + 1 and saved[-1] == steps  # the stall checkpoints, then the last step
    assert [json.loads(x)["step"] for x in _store(out).get("metrics.jsonl").decode().splitlines()] == \
        list(range(1, steps + 1))
    assert peak < window + workers * largest
    assert not list(store.list("shards/"))  # every shard consumed by the last checkpoint
    assert "STALLED" not in stderr



@pytest.mark.slow
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_sigterm_while_training_waits_for_data_checkpoints_and_resumes(tmp_path, grad_accum):
    """A follow trainer that has trained what is committed and waits for more gets SIGTERM (a
    Slurm preemption): it checkpoints where it is and exits 143 at once, not when data comes. Its
    --resume, once extraction finishes, trains the rest: the follow epoch's every step, once.
    With --grad-accum 2 it took a step's first batch and waited for its second inside the step,
    where neither SIGTERM nor the stall check was looked at: it ran on until killed. It waits for
    the step's every batch at the step boundary now."""
    import signal

    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    fake_worker.work(uri, shards=[0, 1, 2])  # 3 of 7 committed; the rest pending
    args = [sys.executable, "-m", "layertap", "train", "--data", uri, "--model", target, "--out", out, "--follow",
            "--follow-poll-s", "0.5", "--batch-size", "2", "--grad-accum", str(grad_accum), "--shuffle-buffer",
            str(2 * grad_accum), "--block-size", "4", "--max-anchors", "8", "--save-every", "1000"]
    err = tmp_path / "train.err"
    with err.open("w") as f:
        train = subprocess.Popen(args, env=dict(env(), OMP_NUM_THREADS="1"), cwd=HERE.parent,
                                 stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.time() + 120
    while time.time() < deadline and "waiting for extraction: 3 of 7" not in err.read_text():
        time.sleep(0.2)
    time.sleep(4)  # the trainer trains what is in flight, then waits too
    sent = time.time()
    train.send_signal(signal.SIGTERM)
    try:
        rc = train.wait(timeout=30)
    finally:
        train.kill()
    assert rc == 143, err.read_text()[-3000:]
    assert time.time() - sent < 20  # within a few of the trainer's 5 s looks, not when data comes
    metrics = Path(out) / "metrics.jsonl"
    trained = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    latest = json.loads((Path(out) / "checkpoints" / "latest.json").read_text())
    steps = SAMPLES // (2 * grad_accum)
    assert trained and latest["step"] == trained[-1] < steps

    fake_worker.work(uri)  # extraction finishes; the trainer resumes where it stopped
    rc = subprocess.run(args + ["--resume"], env=dict(env(), OMP_NUM_THREADS="1"), cwd=HERE.parent,
                        capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr[-3000:]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, steps + 1))


@pytest.mark.parametrize("taken_over", [False, True])
def test_a_delete_consumed_trainer_stopped_before_its_first_step_withdraws_its_claim(tmp_path, taken_over):
    """SIGTERM to a --delete-consumed trainer waiting for its first step's data (a Slurm preemption,
    Ctrl-C): it saved nothing, deleted nothing and released its output, but kept its claim on the
    run, so `status` and the extraction took it for a trainer still running, and a trainer into
    another --out was refused. It withdraws the claim, and says the same command starts again.
    Unless another trainer took its output over meanwhile (it stalled past the lease's ttl): the
    claim, the output's, is then that one's to keep."""
    import signal

    from layertap.manifests import layout
    from layertap.manifests.consumption import consumer_of, consumer_state
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    fake_worker.plan(_store(uri))  # planned, nothing committed yet
    err = tmp_path / "train.err"
    with err.open("w") as f:
        train = subprocess.Popen(
            [sys.executable, "-m", "layertap", "train", "--data", uri, "--model", target, "--out", out, "--follow",
             "--follow-poll-s", "0.5", "--delete-consumed", "--batch-size", "2", "--shuffle-buffer", "2",
             "--block-size", "4", "--max-anchors", "8"],
            env=dict(env(), OMP_NUM_THREADS="1"), cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "waiting for extraction: 0 of 7" not in err.read_text():
            assert train.poll() is None, err.read_text()[-3000:]
            time.sleep(0.2)
        store = _store(uri)
        assert consumer_of(store) == _store(out).uri and consumer_state(consumer_of(store)) == "running"
        if taken_over:  # a newer generation of the output's lease, another trainer's
            from layertap.manifests.output_lease import latest

            generation, _, ttl = latest(_store(out))
            _store(out).put(f"lease/{generation + 1:06d}.ttl{ttl:g}",
                            json.dumps({"host": "elsewhere", "pid": 1, "token": "another"}).encode())
        train.send_signal(signal.SIGTERM)
        assert train.wait(timeout=60) == 143, err.read_text()[-3000:]
    finally:
        train.kill()
    said = err.read_text()
    assert "stopped by a signal before the first step: nothing to checkpoint; the same `layertap train` command " \
        "starts again" in said, said[-3000:]
    if taken_over:
        assert "withdrew this trainer's claim" not in said and consumer_of(store) == _store(out).uri
        return
    assert f"withdrew this trainer's claim on {store.uri}" in said
    assert not store.exists(layout.CONSUMER) and consumer_of(store) is None


def test_a_delete_consumed_trainer_resumed_before_its_deletions_is_refused_on_every_rank(tmp_path, capsys):
    """Its latest checkpoint corrupt, latest.json pointed back at an earlier one (as the error offers):
    the ranks had yet to read shards deleted after a later checkpoint; one left them out with a
    warning, another failed mid-step on them. Refused before any step, naming them."""
    from layertap.cli import main as cli
    from layertap.manifests.consumption import consumed_shards, delete_consumed, record_consumed
    from layertap.train.checkpoint import step_prefix
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), tmp_path / "out"
    fake_worker.work(uri)
    record_consumed(_store(uri), rank=0, world_size=1, shards=[0], step=1)  # by a trainer before this one
    assert delete_consumed(_store(uri)) == [0]
    args = ["train", "--data", uri, "--model", target, "--out", str(out), "--follow", "--delete-consumed",
            "--batch-size", "2", "--shuffle-buffer", "2", "--block-size", "4", "--max-anchors", "8", "--save-every",
            "4", "--keep-checkpoints", "0"]
    assert cli(args) == 0
    gone = consumed_shards(_store(uri))
    assert gone and not list(_store(uri).list("shards/"))  # every shard trained on and deleted
    latest = out / "checkpoints" / "latest.json"
    (out / "drafter").rename(tmp_path / "exported")  # as if it had not finished
    assert cli([*args, "--resume"]) == 0  # from its latest: shard 0, deleted before it started, is no resume's
    latest.write_text(json.dumps({"step": 4, "prefix": step_prefix(4)}))
    capsys.readouterr()
    assert cli([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume {_store(str(out)).uri} from step 4: rank(s) 0 have yet to train on data this trainer " \
        "deleted after a later checkpoint (rank 0's: shard(s) " in err, err[-2000:]
    named = err.split("rank 0's: shard(s) ", 1)[1].split(")", 1)[0]
    assert not named.startswith("0,") and not named.startswith("0-")  # not the shard deleted before it began
    # a trainer that fails holding checkpoints (latest.json gone: the newest complete one resumes) keeps its claim
    from layertap.manifests.consumption import consumer_of

    latest.unlink()
    assert cli(args) == 2 and "already holds checkpoints" in capsys.readouterr().err
    assert consumer_of(_store(uri)) == _store(str(out)).uri


@pytest.mark.slow
def test_a_delete_consumed_trainer_resumed_before_its_deletions_is_refused_on_both_of_two_ranks(tmp_path):
    """The resume check across ranks: rank 0 lists what this trainer deleted after the checkpoint,
    every rank counts what of it it has yet to read, and both refuse before any step (one rank
    failing mid-step left the other in a collective until the watchdog)."""
    from layertap.train.checkpoint import step_prefix
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), tmp_path / "out"
    fake_worker.work(uri)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "layertap"]
    args = ["train", "--data", uri, "--model", target, "--out", str(out), "--follow", "--delete-consumed",
            "--batch-size", "2", "--shuffle-buffer", "2", "--block-size", "4", "--max-anchors", "8", "--save-every",
            "4", "--keep-checkpoints", "0"]
    run = dict(env=dict(env(), OMP_NUM_THREADS="1"), cwd=HERE.parent, capture_output=True, text=True, timeout=600)
    done = subprocess.run(launch + args, **run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(_store(uri).list("shards/"))  # every shard trained on and deleted
    (out / "drafter").rename(tmp_path / "exported")  # as if it had not finished
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"step": 4, "prefix": step_prefix(4)}))
    metrics = (out / "metrics.jsonl").read_text()
    refused = subprocess.run(launch + args + ["--resume"], **run)
    assert refused.returncode != 0
    err = refused.stderr
    assert f"cannot resume {_store(str(out)).uri} from step 4: rank(s) 0, 1 have yet to train on data this trainer " \
        "deleted after a later checkpoint" in err, err[-3000:]
    for rank in (0, 1):
        assert f"(rank {rank}'s: shard(s) " in err, err[-3000:]
    assert (out / "metrics.jsonl").read_text() == metrics and not (out / "drafter").exists()  # no step taken


def _store(uri):
    from layertap.storage.store import open_store

    return open_store(uri)


if __name__ == "__main__" and sys.argv[1] == "consume":
    consume(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])


def _real_ids(batches) -> list[str]:
    return [i for b in batches for i, p in zip(b["sample_id"], b["padding"]) if not p]


def _settled_ranks(uri: str) -> list[ShardStream]:
    """Two ranks of a follow trainer past their follow epoch, settled over rank 0's reading of the
    run (`agree`: the trainer's broadcast, here handed over in-process)."""
    streams = [ShardStream(uri, config=StreamConfig(**CFG), rank=r, world_size=2) for r in range(2)]
    rank_0_read = []
    streams[0].agree = lambda mine: rank_0_read.append(mine) or mine
    streams[1].agree = lambda mine: rank_0_read[-1]
    for loader in [StreamLoader(s, batch_size=2) for s in streams]:
        assert _real_ids(loader)  # the follow epoch
    for stream in streams:
        stream._settle()
    return streams


@pytest.mark.parametrize("rank_0_reads", ["first", "last"])
def test_the_epochs_after_the_follow_epoch_stream_rank_0s_shards_on_every_rank(tmp_path, rank_0_reads):
    """The follow epoch ends on a given-up shard; each rank read the committed shards again on its
    own when its epoch 1 began, and the shard redone between two ranks' reads gave them epochs of
    different sizes (9 and 10 batches: the last reduce hangs) and samples trained twice. With
    `agree` (the trainer's broadcast; here rank 0's list handed over in-process) both stream rank
    0's list, read before the redo or after it, and every sample once. Rank 1 reads no commit:
    each rank read them all, 20 M GETs at 1,000 ranks of 20,000 shards."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri, shards=[0, 1, 2, 3, 4, 5])
    give_up(uri, 6)
    streams = [ShardStream(uri, config=StreamConfig(**CFG), rank=r, world_size=2) for r in range(2)]
    loaders = [StreamLoader(s, batch_size=2) for s in streams]
    for loader in loaders:
        assert _real_ids(loader)  # the follow epoch
    rank_0_read = []
    streams[0].agree = lambda mine: rank_0_read.append(mine) or mine

    def from_rank_0(mine):
        assert mine is None  # rank 1 read nothing to offer
        if rank_0_reads == "last":  # rank 0 reads after the redo
            assert fake_worker.work(uri, shards=[6]) == [6]
            streams[0]._settle()
        return rank_0_read[-1]

    streams[1].agree = from_rank_0
    streams[1]._readable_shards = lambda: pytest.fail("rank 1 read the run's commits")
    if rank_0_reads == "first":
        ids = {0: _real_ids(loaders[0])}
        assert fake_worker.work(uri, shards=[6]) == [6]  # extraction restarted: the given-up shard committed
        ids[1] = _real_ids(loaders[1])
    else:
        ids = {1: _real_ids(loaders[1]), 0: _real_ids(loaders[0])}
    assert streams[0].shard_records == streams[1].shard_records
    assert len(loaders[0]) == len(loaders[1])
    want = SAMPLES - (0 if rank_0_reads == "last" else fake_worker.plan(_store(uri)).shards[6].num_samples)
    assert sorted(ids[0] + ids[1]) == sorted(set(ids[0] + ids[1])) and len(ids[0] + ids[1]) == want


def test_rank_0_stores_the_commit_index_a_follow_run_lacked_when_the_later_epochs_read_the_run(tmp_path):
    """A follow trainer's later epochs (and every resume into them) read each commit with a GET of
    its own: the run's commit index was never written, as a follow run's start writes none."""
    from layertap.manifests.commit_index import read_commits

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    assert read_commits(_store(uri)).new_index is not None  # the extraction wrote no index
    _settled_ranks(uri)
    assert read_commits(_store(uri)).new_index is None  # stored: a resume lists commits/ and GETs the index


def test_the_commit_index_is_stored_also_where_some_shards_were_consumed_and_a_deleting_trainer_reads_none(tmp_path):
    """Skipping the commits of consumed shards (a deleting trainer's end) kept rank 0 of any other
    follow trainer from storing the index where a shard was consumed (a review found it): every
    resume then read every commit again. A --delete-consumed trainer's settle reads no commit of a
    consumed shard; another's reads them all, and stores the index."""
    from layertap.manifests import layout
    from layertap.manifests.commit_index import read_commits
    from layertap.manifests.consumption import delete_consumed, record_consumed

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    shards = [p.id for p in fake_worker.plan(_store(uri)).shards]
    record_consumed(_store(uri), rank=0, world_size=1, shards=shards[:3], step=9)
    assert delete_consumed(_store(uri)) == shards[:3]
    deleting = ShardStream(uri, config=StreamConfig(**CFG, deletes_consumed=True), rank=0, world_size=1)
    for _ in StreamLoader(deleting, batch_size=2):
        pass
    got, get = [], deleting._store().get
    deleting._store().get = lambda key: got.append(key) or get(key)
    deleting._settle()
    assert [s.shard for s in deleting.shards] == shards[3:]
    assert {layout.commit_key(s) for s in shards[3:]} <= set(got)  # read through the patched store
    assert not {layout.commit_key(s) for s in shards[:3]} & set(got)
    assert read_commits(_store(uri)).new_index is not None  # it stores none: it read only some
    streams = _settled_ranks(uri)
    assert [s.shard for s in streams[1].shards] == shards[3:] and streams[1]._left_out == shards[:3]
    assert read_commits(_store(uri)).new_index is None  # stored


def test_a_delete_consumed_trainers_ranks_need_not_agree_on_a_later_epoch_its_deletions_race(tmp_path):
    """3 ranks of a --delete-consumed trainer: rank 0 read the run's shards for the epochs after the
    follow epoch before the checkpoint at the others' wait deleted shard 3, they after it, and they
    failed: "rank 1 cannot find committed shard(s) 3 that rank 0 streams ... start the training
    again". Such a trainer trains the follow epoch alone: no later epoch to agree on."""
    from layertap.manifests.consumption import delete_consumed, record_consumed

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    cfg = StreamConfig(**CFG, deletes_consumed=True)
    streams = [ShardStream(uri, config=cfg, rank=r, world_size=2) for r in range(2)]
    for loader in [StreamLoader(s, batch_size=2) for s in streams]:
        assert _real_ids(loader)  # the follow epoch
    streams[0].agree = lambda mine: mine  # the trainer's broadcast: rank 0's list, on every rank
    streams[1].agree = lambda mine: pytest.fail("a --delete-consumed trainer's ranks agree on no later epoch")
    streams[0]._settle()
    record_consumed(_store(uri), rank=0, world_size=1, shards=[3], step=9)
    assert delete_consumed(_store(uri)) == [3]
    streams[1]._settle()  # raised InputError
    assert 3 not in [s.shard for s in streams[1].shards]
    plain = ShardStream(uri, config=StreamConfig(**CFG), rank=1, world_size=2)  # a trainer that reads later epochs
    for _ in StreamLoader(plain, batch_size=2):
        pass
    plain.agree = lambda mine: {"shards": streams[0].shard_records, "left_out": []}
    plain._settle()  # its ranks stream one list: rank 0's (whose shard 3 is gone, as a read of it will say)
    assert plain.shard_records == streams[0].shard_records


def test_the_epochs_after_the_follow_epoch_leave_out_what_a_delete_consumed_trainer_deleted(tmp_path, caplog):
    """A second follow trainer of a run whose shard 0 the --delete-consumed trainer had deleted:
    its follow epoch left shard 0 out, and its epoch 1 put it back and failed on the missing data
    ("deleted while this stream read the run"; with on_corrupt="skip", padding in its place)."""
    from layertap.manifests.consumption import delete_consumed, record_consumed

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    record_consumed(_store(uri), rank=0, world_size=1, shards=[0], step=1)
    assert delete_consumed(_store(uri)) == [0]
    caplog.set_level("INFO", logger="layertap.train.stream")
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    loader = StreamLoader(stream, batch_size=4)
    want = SAMPLES - fake_worker.plan(_store(uri)).shards[0].num_samples
    for epoch in (0, 1):
        assert len(_real_ids(loader)) == want, epoch
    assert [s.shard for s in stream.shards] == [1, 2, 3, 4, 5, 6]
    assert "1 committed shard(s) were consumed and deleted by a --delete-consumed trainer" in caplog.text


def test_every_rank_says_why_a_later_epoch_has_nothing_when_every_shard_was_consumed(tmp_path):
    """Rank 0 alone reads the run for the epochs after the follow epoch: the others said "no
    committed shard holds a sample", not that a --delete-consumed trainer consumed them all (a review
    found it): rank 0's count of consumed shards comes with its list."""
    from layertap.manifests.consumption import delete_consumed, record_consumed

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    streams = [ShardStream(uri, config=StreamConfig(**CFG), rank=r, world_size=2) for r in range(2)]
    loaders = [StreamLoader(s, batch_size=2) for s in streams]
    for loader in loaders:
        assert _real_ids(loader)  # the follow epoch
    shards = [p.id for p in fake_worker.plan(_store(uri)).shards]
    record_consumed(_store(uri), rank=0, world_size=1, shards=shards, step=9)
    assert delete_consumed(_store(uri)) == shards
    rank_0_read = []
    streams[0].agree = lambda mine: rank_0_read.append(mine) or mine
    streams[1].agree = lambda mine: rank_0_read[-1]
    for loader in loaders:
        with pytest.raises(InputError, match="every committed shard of .* was consumed and deleted by a "
                                             "--delete-consumed trainer: epoch"):
            _real_ids(loader)


def test_a_consumed_shard_is_warned_of_only_by_the_consumers_with_a_share_of_it(tmp_path, caplog):
    """Each follow consumer reads its own part of a shard: one with no part of a consumed shard
    (more consumers than its records) warned on a clean --resume that it "cannot be trained on again"."""
    from layertap.manifests.consumption import delete_consumed, record_consumed
    from layertap.train.order import follow_share

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    ranks, n = 16, fake_worker.plan(_store(uri)).shards[0].num_samples
    record_consumed(_store(uri), rank=0, world_size=1, shards=[0], step=1)
    assert delete_consumed(_store(uri)) == [0]
    sharers = [r for r in range(ranks) if follow_share(n, 0, ranks, r)[1]]
    assert 0 < len(sharers) < ranks
    for rank in (sharers[0], next(r for r in range(ranks) if r not in sharers)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="layertap.train.stream"):
            list(ShardStream(uri, config=StreamConfig(**CFG), rank=rank, world_size=ranks))
        assert ("cannot be trained on again" in caplog.text) == (rank in sharers), (rank, caplog.text)


def test_a_follow_stream_iterated_directly_streams_its_later_epochs(tmp_path):
    """`for sample in stream` past the follow epoch: the position began epoch 1 before the stream
    counted its samples (0), took it for done, and jumped to epoch 2 with a TypeError."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    for epoch in (0, 1, 2):
        assert stream.epoch == epoch
        assert sorted(s["sample_id"] for s in stream if not s["padding"]) == sorted(ALL)


@pytest.mark.slow
def test_two_ranks_train_a_later_epoch_over_rank_0s_shards(tmp_path):
    """2 ranks, --follow --epochs 2, shard 6 given up: the second epoch's shard list comes from
    rank 0 through the trainer's gloo group, in the prefetch threads, while training steps on;
    both ranks step the same epoch to its end (a difference would hang the last reduce)."""
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    m = fake_worker.plan(_store(uri))
    fake_worker.work(uri, shards=[s for s in range(len(m.shards)) if s != 6])
    give_up(uri, 6)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "layertap",
         "train", "--data", uri, "--model", target, "--out", out, "--follow", "--follow-poll-s", "0.5", "--epochs",
         "2", "--batch-size", "2", "--block-size", "4", "--max-anchors", "8"],
        env=dict(env(), OMP_NUM_THREADS="1"), cwd=HERE.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in _store(out).get("metrics.jsonl").decode().splitlines()]
    committed = SAMPLES - m.shards[6].num_samples
    assert [x["epoch"] for x in lines] == [0] * (SAMPLES // 4) + [1] * -(-committed // 4)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_committed_after_a_consumer_without_a_share_of_it_finished_counts_as_consumed(tmp_path, workers):
    """shuffle_buffer=1: a consumer yields its last sample before extraction is over. A shard it has no
    share of, committed after that, was taken with no batch left to report it (with one consumer the
    position had rolled over: a TypeError), so it never counted as consumed and --delete-consumed left
    its data at rest for good. 8 consumers over shards of 5-6 samples: consumer 5 has none of shard 6."""
    import threading

    uri = str(tmp_path / "run")
    m = fake_worker.plan(_store(uri))
    fake_worker.work(uri, shards=list(range(6)))
    world, rank = (8, 5) if workers == 0 else (4, 2)  # consumer 5: rank 5's only one, or rank 2's second
    stream = ShardStream(uri, config=StreamConfig(**dict(CFG, shuffle_buffer=1)), rank=rank, world_size=world)
    if workers == 0:
        it = iter(stream)
        got = [next(it) for _ in range(stream.num_samples)]  # its whole count: shard 6 is not committed yet
        assert stream.state_dict()["epoch"] == 1
        fake_worker.work(uri, shards=[6])
        assert list(it) == []
        assert len(got) == 6
    else:
        timer = threading.Timer(3.0, fake_worker.work, (uri,), {"shards": [6]})
        timer.start()
        assert len(list(StreamLoader(stream, batch_size=1, num_workers=workers))) == 12
        timer.join()
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["epoch"] == 1 and stream.consumed_shards(state) == list(range(len(m.shards)))


def test_consumed_shards_of_a_state_that_names_no_taken_shards_names_none_with_a_share(tmp_path):
    """`consumed_shards` stands in front of deletion: a state without its `taken` lists (hand-made, or
    cut) must name no shard this rank has a share of. It named every planned shard (a zip with the
    missing lists blocked nothing)."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    stream = ShardStream(uri, config=StreamConfig(**CFG), rank=0, world_size=1)
    it = iter(stream)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(stream.state_dict()))
    it.close()
    assert state["epoch"] == 0 and state["taken"]
    assert stream.consumed_shards({k: v for k, v in state.items() if k != "taken"}) == []


def test_a_step_that_waited_for_extraction_counts_the_wait_in_its_time(tmp_path):
    """A follow trainer waits for its step's batches before the step's clock starts: the wait went
    into data_wait_fraction (clipped to 1.0) but not into step_s, so a step that waited seconds for
    extraction showed a few milliseconds and tokens/s as if it had not waited."""
    import threading

    from layertap.cli import main as cli
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), tmp_path / "out"
    fake_worker.work(uri, shards=[0, 1])
    late = threading.Timer(3.0, lambda: fake_worker.work(uri))  # the rest, committed while the trainer waits
    late.start()
    try:
        assert cli(["train", "--data", uri, "--model", target, "--out", str(out), "--follow", "--follow-poll-s", "0.2",
                    "--batch-size", "4", "--block-size", "4", "--max-anchors", "8"]) == 0
    finally:
        late.join()
    lines = [json.loads(x) for x in _store(str(out)).get("metrics.jsonl").decode().splitlines()]
    waited = max(lines, key=lambda r: r["step_s"])
    assert waited["step_s"] > 1.0 and 0.5 < waited["data_wait_fraction"] < 1.0  # most of it the wait, not all
    assert abs(waited["tokens_per_s"] * waited["step_s"] - waited["tokens"]) < 1e-6 * max(1, waited["tokens"])


def test_a_waiting_trainer_rides_out_a_store_outage(store_uri, monkeypatch, caplog):
    """A follow trainer's looks for commits had only the store's own retries (~10-20 s): a throttle
    spell past them ended the trainer, its steps since the last checkpoint lost. A look while it
    waits is tried again (`work.patiently`); a look ahead, with data in hand, is skipped."""
    from layertap.manifests import layout
    from layertap.manifests.manifest import load_manifest
    from layertap.storage.store import TransientStoreError, open_store
    from layertap.train import follow

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1])
    watcher = follow.CommitWatcher(store, load_manifest(store), poll_s=0.1)
    assert [r.shard for r in watcher.poll()] == [0, 1]
    fake_worker.work(store_uri, shards=[2])
    real_list, failed = store.list, []

    def throttled(prefix="", *args, **kwargs):
        if prefix.startswith(layout.FEED) and len(failed) < 3:
            failed.append(prefix)
            raise TransientStoreError("SlowDown: please reduce your request rate (retries used up)")
        return real_list(prefix, *args, **kwargs)

    monkeypatch.setattr(store, "list", throttled)
    monkeypatch.setattr(follow, "_outage_pause", lambda: 0.01)
    watcher._last_look = 0.0
    caplog.set_level("WARNING")
    assert watcher.poll_if_due(low=True) == [] and len(failed) == 1  # with data in hand: skipped
    assert "training goes on with the data in hand" in caplog.text
    assert [r.shard for r in watcher.wait()] == [2] and len(failed) == 3
    assert "the store is failing" in caplog.text


def test_the_trainers_stall_look_takes_an_outage_for_no_stall(store_uri, monkeypatch, caplog):
    """Rank 0's look at the window while a rank waits for data (`_await_data`) raised the store's
    error: the trainer ended on a throttle spell. Taken for no stall; the next look asks again."""
    from layertap.manifests import consumption
    from layertap.manifests.consumption import WindowGate
    from layertap.storage.store import TransientStoreError, open_store
    from layertap.train.trainer import _stalled

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])
    WindowGate(store, 10_000).record()
    assert _stalled(store) is True

    def failing(store):
        raise TransientStoreError("SlowDown (retries used up)")

    monkeypatch.setattr(consumption, "stalled", failing)
    caplog.set_level("WARNING")
    assert _stalled(store) is False and "could not look whether extraction waits" in caplog.text


def test_a_look_whose_reads_failed_lists_the_feed_from_the_same_point_again(store_uri, monkeypatch):
    """The feed's next look moved on before the commits it found were read: when the reads failed
    (skipped by a look ahead), those commits were missed until the next full listing (5 min)."""
    from layertap.manifests import layout
    from layertap.manifests.manifest import load_manifest
    from layertap.storage.store import TransientStoreError, open_store
    from layertap.train import follow

    monkeypatch.setattr(layout, "FEED_MARGIN_S", 0.0)  # as if the reads' retries outlasted the margin
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1])
    watcher = follow.CommitWatcher(store, load_manifest(store), poll_s=0.1)
    assert [r.shard for r in watcher.poll()] == [0, 1]
    fake_worker.work(store_uri, shards=[2])
    time.sleep(1.1)  # the next look starts after shard 2's feed key (a store's clock has whole seconds on S3)
    real_get = follow._get_commits

    def failing_once(store, keys):
        monkeypatch.setattr(follow, "_get_commits", real_get)
        raise TransientStoreError("SlowDown (retries used up)")

    monkeypatch.setattr(follow, "_get_commits", failing_once)
    watcher._last_look = 0.0
    assert watcher.poll_if_due(low=True) == []
    assert [r.shard for r in watcher.poll()] == [2]


@pytest.mark.parametrize("decode_threads", [0, 2])
def test_a_follow_consumer_blocked_on_extraction_counts_it_in_wait_s(tmp_path, decode_threads):
    """`metrics()`'s wait_s is the time the consumer blocked on data: a follow epoch that waited ~3 s
    for shards still extracting said 0.00 of 3.6 s elapsed (only a fetch's wait counted, not the
    watcher's, nor a decode thread's)."""
    import threading

    uri = str(tmp_path / "run")
    fake_worker.work(uri, shards=[0, 1])
    stream = ShardStream(uri, config=StreamConfig(**dict(CFG, decode_threads=decode_threads)), rank=0, world_size=1)
    late = threading.Timer(3.0, lambda: fake_worker.work(uri))
    late.start()
    try:
        assert len(list(stream)) == SAMPLES
    finally:
        late.join()
    m = stream.metrics()
    assert 2.5 < m["wait_s"] <= m["elapsed_s"]
