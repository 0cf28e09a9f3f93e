"""Checkpoints stream into the store: valid safetensors, bounded host memory, committed last."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from layertap.storage.store import open_store
from layertap.train.checkpoint import (
    LATEST,
    Snapshot,
    export_drafter,
    load_drafter_files,
    load_latest,
    load_safetensors,
    restore,
    save_checkpoint,
    write_safetensors,
)
from layertap.storage.errors import InputError, MissingInput
from layertap.train.drafter import DFlashDrafter, default_config
from layertap.train.target_head import TargetHead


def drafter() -> DFlashDrafter:
    g = torch.Generator().manual_seed(1)
    head = TargetHead(torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g), False,
                      {"num_layers": 24, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 64})
    torch.manual_seed(0)
    return DFlashDrafter(default_config(head, [1, 2], mask_token_id=49, block_size=4), head)


def trained(steps: int = 2) -> tuple[DFlashDrafter, torch.optim.AdamW]:
    model = drafter()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = sum((p.float() ** 2).sum() for p in model.trainable_state().values())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_streamed_file_reads_back_with_the_safetensors_library(store, tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(7, 5, generator=g),
        "half": torch.randn(3, 4, generator=g).bfloat16(),
        "ids": torch.arange(11, dtype=torch.int64),
        "bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }
    write_safetensors(store, "a/x.safetensors", tensors, {"format": "test"})
    blob = store.get("a/x.safetensors")
    back = st_load(blob)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "test"}

    write_safetensors(store, "a/f.safetensors", {"half": tensors["half"]}, dtype=torch.float32)
    assert torch.equal(st_load(store.get("a/f.safetensors"))["half"], tensors["half"].float())


def test_streaming_holds_about_one_writer_buffer_not_the_whole_file(tmp_path, s3_bucket):
    """64 MiB of tensors: saving them must never hold a serialized copy of the file in memory."""
    tensors = {f"t{i}": torch.full((2 << 20,), float(i)) for i in range(8)}  # 8 x 8 MiB
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for store in (open_store(str(tmp_path / "out")),
                  open_store(f"s3://{s3_bucket}/out", part_size=5 << 20, max_parts_in_memory=2)):
        tracemalloc.start()
        try:
            write_safetensors(store, "big.safetensors", tensors)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < total / 4, (store.uri, peak, total)
        back = st_load(store.get("big.safetensors"))
        assert all(torch.equal(back[k], t) for k, t in tensors.items())
        store.close()


def test_reading_a_checkpoint_file_never_holds_its_bytes_beside_the_tensors(tmp_path, s3_bucket):
    """64 MiB of tensors read back: one ranged read into each tensor, no serialized copy in memory;
    every dtype a checkpoint holds (bf16 weights, fp32 moments, int64 RNG state, scalar steps)."""
    tensors = {f"t{i}": torch.full((2 << 20,), float(i)) for i in range(8)}  # 8 x 8 MiB
    tensors.update(bf16=torch.randn(3, 5).bfloat16(), step=torch.tensor(7.0), rng=torch.get_rng_state(),
                   empty=torch.zeros(0, 4), flags=torch.tensor([True, False]))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for store in (open_store(str(tmp_path / "out")), open_store(f"s3://{s3_bucket}/out")):
        write_safetensors(store, "big.safetensors", tensors, {"format": "x"})
        tracemalloc.start()
        try:
            back = load_safetensors(store, "big.safetensors")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < total / 16, (store.uri, peak, total)
        assert back.keys() == tensors.keys()
        assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in tensors.items())
        # A cut file is an error naming it, not tensors of garbage.
        whole = store.get("big.safetensors")
        store.put("cut.safetensors", whole[: len(whole) // 2])
        with pytest.raises(Exception, match="cut short"):
            load_safetensors(store, "cut.safetensors")
        store.put("junk.safetensors", b"not a safetensors file at all")
        with pytest.raises(Exception, match="not a safetensors file"):
            load_safetensors(store, "junk.safetensors")
        store.close()


def test_a_checkpoint_saves_and_restores_every_tensor(store):
    model, opt = trained()
    state = {"config": {"seed": 0}, "world_size": 1, "loader": [{"epoch": 0}]}
    prefix = save_checkpoint(store, Snapshot(2, model, opt, state), keep=2)
    assert prefix == "checkpoints/step-00000002"
    assert json.loads(store.get(LATEST)) == {"step": 2, "prefix": prefix}

    weights = st_load(store.get(f"{prefix}/drafter.safetensors"))
    assert weights.keys() == model.trainable_state().keys()
    assert all(torch.equal(weights[k], p.detach()) for k, p in model.trainable_state().items())
    moments = st_load(store.get(f"{prefix}/optimizer.safetensors"))
    names = {id(p): n for n, p in model.trainable_state().items()}
    for p, s in opt.state.items():
        for field, value in s.items():
            assert torch.equal(moments[f"{names[id(p)]}.{field}"], value), (names[id(p)], field)
    assert torch.equal(moments["rng.torch"], torch.get_rng_state())

    ckpt = load_latest(store)
    assert ckpt.step == 2 and ckpt.state["loader"] == [{"epoch": 0}]
    fresh, fresh_opt = trained(steps=0)
    restore(ckpt, fresh, fresh_opt)
    assert all(torch.equal(p, fresh.trainable_state()[k]) for k, p in model.trainable_state().items())
    fresh_names = {id(p): n for n, p in fresh.trainable_state().items()}
    restored = {fresh_names[id(p)]: s for p, s in fresh_opt.state.items()}
    for p, s in opt.state.items():
        assert all(torch.equal(v, restored[names[id(p)]][k]) for k, v in s.items())

    export_drafter(store, model)
    config, exported = load_drafter_files(store)
    assert config == model.config
    assert all(torch.equal(exported[k], p.detach().float()) for k, p in model.trainable_state().items())


def test_a_restore_keeps_the_optimizers_own_implementation(store):
    """A checkpoint of a CPU run (AdamW foreach) resumed where AdamW is built fused (the trainer's
    choice on CUDA) steps fused: the saved hyperparameters come back, not how the saver stepped."""
    model, opt = trained()
    prefix = save_checkpoint(store, Snapshot(2, model, opt, {"world_size": 1}), keep=2)
    assert prefix and opt.param_groups[0]["fused"] in (None, False)
    fresh = drafter()
    fused = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=5e-3, fused=True)
    restore(load_latest(store), fresh, fused)
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["lr"] == 1e-2  # the saved lr
    loss = sum((p.float() ** 2).sum() for p in fresh.trainable_state().values())
    loss.backward()
    fused.step()  # the fused kernel takes the restored moments and step
    assert all(torch.isfinite(p).all() for p in fresh.trainable_state().values())


def test_a_save_cut_short_leaves_the_previous_checkpoint_latest(tmp_path):
    store = open_store(str(tmp_path / "out"))
    model, opt = trained()
    save_checkpoint(store, Snapshot(1, model, opt, {}), keep=2)
    real = store.open_writer

    def failing_writer(key):
        w = real(key)
        if key.endswith("optimizer.safetensors"):
            def write(data, _write=w.write):
                if w.bytes_written:  # the header went out; the first tensor fails
                    raise OSError("disk gone")
                return _write(data)
            w.write = write
        return w

    store.open_writer = failing_writer
    with pytest.raises(OSError):
        save_checkpoint(store, Snapshot(2, model, opt, {}), keep=2)
    assert not store.exists("checkpoints/step-00000002/optimizer.safetensors")
    assert store.list_pending_uploads() == []
    assert load_latest(store).step == 1


def test_pruning_keeps_what_latest_names_and_drops_saves_cut_short(store):
    """A save killed mid-upload (Slurm's SIGKILL after the stop signal) leaves a folder without
    state.json, at a step above the checkpoint latest.json names, or below a later one: pruning
    counts complete checkpoints up to the latest only, so a resume always finds its checkpoint."""
    model, opt = trained()

    def cut_short(step: int) -> None:
        write_safetensors(store, f"checkpoints/step-{step:08d}/drafter.safetensors", model.trainable_state())

    def folders() -> list[int]:
        return sorted({int(o.key.split("/")[1].removeprefix("step-")) for o in store.list("checkpoints/step-")})

    save_checkpoint(store, Snapshot(1000, model, opt, {}), keep=1)
    cut_short(1234)  # the stop signal's save, killed: latest.json still names step 1000
    save_checkpoint(store, Snapshot(1100, model, opt, {}), keep=1)  # resumed from 1000, stopped again
    assert load_latest(store).step == 1100 and folders() == [1100]
    cut_short(1150)
    save_checkpoint(store, Snapshot(1200, model, opt, {}), keep=2)
    assert load_latest(store).step == 1200 and folders() == [1100, 1200]  # two complete ones, not 1150
    root = getattr(store, "root", None)
    if root is not None:  # a local --out keeps no empty folder of a pruned checkpoint (eval --step lists what is kept)
        assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == ["latest.json", "step-00001100", "step-00001200"]


def test_a_rank_reads_only_its_own_loader_position(tmp_path):
    """A position file that is no position (`null`), or another rank's (copied over it: in the
    follow epoch each rank's shards taken are its own), is refused naming the file."""
    from layertap.train.checkpoint import Checkpoint, load_loader_state, loader_key, save_loader_state

    store = open_store(str(tmp_path / "out"))
    ckpt = Checkpoint(4, {"loader_states": "loader/00000000abcd"}, {}, {})
    for rank in (0, 1):
        save_loader_state(store, 4, "loader/00000000abcd", rank, {"rank": rank, "epoch": 0})
    assert load_loader_state(store, ckpt, 1) == {"rank": 1, "epoch": 0}
    store.put(loader_key(4, "loader/00000000abcd", 1), store.get(loader_key(4, "loader/00000000abcd", 0)))
    with pytest.raises(InputError, match="rank-00001.json is corrupt .it holds rank 0's loader position, not rank 1's"):
        load_loader_state(store, ckpt, 1)
    store.put(loader_key(4, "loader/00000000abcd", 1), b"null")
    with pytest.raises(InputError, match="rank-00001.json is corrupt .it is not a loader position"):
        load_loader_state(store, ckpt, 1)
    with pytest.raises(InputError, match="lacks rank 2's loader position"):
        load_loader_state(store, ckpt, 2)


def test_a_folder_among_the_checkpoints_that_is_none_is_left_alone(store, caplog):
    """A copy kept by hand (`cp -r step-00000100 step-00000100.bak`) crashed every later save's
    pruning and `eval --step` with int()'s ValueError, naming nothing."""
    model, opt = trained()
    save_checkpoint(store, Snapshot(100, model, opt, {}), keep=1)
    store.put("checkpoints/step-00000100.bak/state.json", store.get("checkpoints/step-00000100/state.json"))
    save_checkpoint(store, Snapshot(200, model, opt, {}), keep=1)  # prunes step 100, keeps the copy
    keys = {o.key.split("/")[1] for o in store.list("checkpoints/step-")}
    assert keys == {"step-00000200", "step-00000100.bak"}
    assert "holds folder(s) that are no checkpoint of it, left alone: step-00000100.bak" in caplog.text
    with pytest.raises(MissingInput, match=r"no checkpoint of step 100 .*kept: \[200\]"):
        load_drafter_files(store, 100)


def test_a_damaged_checkpoint_record_is_an_error_naming_it(store):
    """latest.json without its "prefix", or a state.json that is not JSON, raised a bare KeyError
    or JSONDecodeError (a traceback naming no file)."""
    model, opt = trained()
    save_checkpoint(store, Snapshot(7, model, opt, {}), keep=2)
    state = store.get("checkpoints/step-00000007/state.json")
    store.put(LATEST, b'{"step": 7}')
    with pytest.raises(InputError, match=r"checkpoints/latest.json names no checkpoint .*kept: steps 7.*or delete "
                                         r"it to resume from the newest complete one"):
        load_latest(store)
    store.put(LATEST, b'{"step": 7, "prefix": "checkpoints/step-00000007"}')
    store.put("checkpoints/step-00000007/state.json", state[:20])
    for read in (lambda: load_latest(store), lambda: load_drafter_files(store, 7)):
        with pytest.raises(InputError, match=r"checkpoints/step-00000007/state.json is corrupt"):
            read()


@pytest.mark.parametrize("name", ["drafter.safetensors", "optimizer.safetensors"])
def test_a_flipped_bit_in_a_checkpoint_file_is_refused_not_resumed_from(store, name):
    """A checkpoint's tensors come back by ranged reads, which carry no checksum of the store's:
    a flipped bit in the weights or the moments resumed silently wrong. state.json records each
    file's xxh3, and a load checks it (also `eval --step`'s); a rank that receives the tensors
    from rank 0 (no data) reads none."""
    model, opt = trained()
    prefix = save_checkpoint(store, Snapshot(3, model, opt, {}), keep=2)
    assert load_latest(store).step == 3
    key = f"{prefix}/{name}"
    blob = bytearray(store.get(key))
    blob[-5] ^= 0x10  # inside the last tensor: the header still reads
    store.put(key, bytes(blob))
    with pytest.raises(InputError, match=rf"{key} is corrupt: its bytes hash to xxh3 .* recorded when it was saved; "
                                         r"point checkpoints/latest.json at an earlier checkpoint"):
        load_latest(store)
    assert load_latest(store, tensors=False).step == 3
    if name == "drafter.safetensors":
        with pytest.raises(InputError, match=r"is corrupt: .*; evaluate another step \(--step\)"):
            load_drafter_files(store, 3)
    # cut short (a copy that stopped): "is not a safetensors file (header length 1184, file 500 B)", no fix
    store.put(key, bytes(blob[:500]))
    with pytest.raises(InputError, match=rf"{key} is not a safetensors file \(header length \d+, file 500 B\); "
                                         r"point checkpoints/latest.json at an earlier checkpoint"):
        load_latest(store)


def test_a_missing_latest_json_is_the_newest_complete_checkpoint_not_none(store, caplog):
    """latest.json gone (a first save stopped before it named its checkpoint, or the file deleted, as
    the message on its damage advised) read as "no checkpoint": training started over at step 0
    and its first save's pruning deleted every checkpoint there."""
    model, opt = trained()
    for step in (8, 10):
        save_checkpoint(store, Snapshot(step, model, opt, {}), keep=2)
    write_safetensors(store, "checkpoints/step-00000012/drafter.safetensors", model.trainable_state())  # cut short
    store.delete(LATEST)
    assert load_latest(store).step == 10
    assert "has no checkpoints/latest.json but holds complete checkpoints: taking the newest, step 10" in caplog.text
    store.put(LATEST, b'{"step": 10, "pre')
    with pytest.raises(InputError, match=r"latest.json is corrupt .*kept: steps 8, 10\), or delete it to resume from "
                                         r"the newest complete one"):
        load_latest(store)


@pytest.mark.parametrize("field,value", [("step", [10]), ("step", None), ("drafter", [1]), ("drafter", None),
                                         ("param_groups", {"a": 1}), ("files", [1]),
                                         ("files", {"drafter.safetensors": "abc"}), ("config", [1]),
                                         ("world_size", "1"), ("deep", None)])
def test_a_state_json_of_wrong_fields_is_an_error_naming_it(store, field, value):
    """Each crashed a resume with a KeyError, TypeError or AttributeError (or RecursionError), and a
    `files` entry of another shape switched the checkpoint's xxh3 check off without a word."""
    model, opt = trained()
    for step in (5, 6):
        prefix = save_checkpoint(store, Snapshot(step, model, opt, {"config": {}, "world_size": 1}), keep=2)
    key = f"{prefix}/state.json"
    state = json.loads(store.get(key))
    if field == "deep":
        raw = "[" * 100_000 + "]" * 100_000
    else:
        if value is None:
            del state[field]
        else:
            state[field] = value
        raw = json.dumps(state)
    store.put(key, raw.encode())
    with pytest.raises(InputError, match=r"step-00000006/state.json is corrupt .*point checkpoints/latest.json at an "
                                         r"earlier checkpoint .*earlier ones kept: steps 5\)"):
        load_latest(store)


def test_a_prune_cut_short_leaves_no_checkpoint_that_looks_complete(store):
    """state.json went last (it sorts last): a prune killed part way left a folder with a state.json
    and without its weights, listed as kept and offered for a resume."""
    from layertap.train.checkpoint import complete_checkpoints

    model, opt = trained()
    save_checkpoint(store, Snapshot(2, model, opt, {}), keep=1)
    real = store.delete_many

    def killed_after_one(keys):
        real(keys[:1])
        raise KeyboardInterrupt

    store.delete_many = killed_after_one
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(store, Snapshot(4, model, opt, {}), keep=1)
    store.delete_many = real
    assert complete_checkpoints(store) == [4]  # step 2's state.json went first


def test_a_flipped_byte_in_the_exported_drafter_is_refused(store):
    """The export's weights were read with no checksum: `export-drafter` and `eval` went on with a
    flipped byte (a norm weight off by 0.016)."""
    model, _ = trained()
    export_drafter(store, model)
    config, weights = load_drafter_files(store)
    assert all(torch.equal(weights[k], p.detach().float()) for k, p in model.trainable_state().items())
    blob = bytearray(store.get("drafter/model.safetensors"))
    blob[-5] ^= 0x10
    store.put("drafter/model.safetensors", bytes(blob))
    with pytest.raises(InputError, match=r"drafter/model.safetensors is corrupt: its bytes hash to xxh3 .* delete the "
                                         r"export \(drafter/\) and run the same `layertap train` with --resume"):
        load_drafter_files(store)


def test_a_sound_resume_lists_no_checkpoints(store):
    """The advice a damaged checkpoint's error gives lists the checkpoints kept: worded up front, it
    listed checkpoints/ (every loader position of every rank) three times on each rank's healthy resume."""
    from layertap.train.checkpoint import Checkpoint, load_loader_state, save_loader_state

    model, opt = trained()
    save_loader_state(store, 3, "loader/0000000000ab", 0, {"rank": 0, "epoch": 0})
    save_checkpoint(store, Snapshot(3, model, opt, {"loader_states": "loader/0000000000ab"}), keep=2)
    listed: list[str] = []
    real = store.list

    def counted(prefix="", *args, **kwargs):
        listed.append(prefix)
        return real(prefix, *args, **kwargs)

    store.list = counted
    ckpt = load_latest(store)
    assert load_loader_state(store, Checkpoint(ckpt.step, ckpt.state, {}, {}), 0)["rank"] == 0
    assert not [p for p in listed if p.startswith("checkpoints/step-")], listed


def test_status_of_an_output_without_latest_json_names_the_checkpoint_a_resume_takes(store):
    """`train --resume` takes the newest complete checkpoint where latest.json is missing; `status`
    said the output had none."""
    from layertap.manifests.train_output import training_status

    model, opt = trained()
    for step in (8, 10):
        save_checkpoint(store, Snapshot(step, model, opt, {"config": {"steps": 20}}), keep=2)
    write_safetensors(store, "checkpoints/step-00000012/drafter.safetensors", model.trainable_state())  # cut short
    before = training_status(store)
    store.delete(LATEST)
    after = training_status(store)
    assert after["checkpoint_step"] == 10 == before["checkpoint_step"]
    assert after["checkpoint"] == before["checkpoint"] and after["checkpoint"].endswith("checkpoints/step-00000010")
    assert after["steps_total"] == 20 and after["checkpoint_age_s"] is not None


def test_status_of_an_output_whose_delete_was_cut_short_says_its_checkpoint_is_incomplete(store):
    """`delete` removes latest.json last: cut short, status named the checkpoint and said `--resume`
    continues from it, which then failed ("is incomplete: no object at .../state.json")."""
    from layertap.manifests.cli import format_training
    from layertap.manifests.train_output import training_status

    model, opt = trained()
    prefix = save_checkpoint(store, Snapshot(6, model, opt, {"config": {"steps": 20}}), keep=2)
    assert training_status(store)["checkpoint_incomplete"] is False
    for obj in list(store.list(prefix + "/")):
        store.delete(obj.key)
    t = training_status(store)
    assert t["checkpoint_step"] == 6 and t["checkpoint_incomplete"] is True
    text = format_training(t)
    assert "CHECKPOINT INCOMPLETE: its state.json is gone or unreadable (a `layertap delete` of this output" in text
    assert "--resume continues" not in text
