"""A training step's gradient is the weighted mean over every supervised slot of the step.

However the step's samples fall into micro-batches (`--grad-accum`) and ranks, each supervised
slot counts alike: a step over micro-batches A and B moves the weights as one batch A+B would,
and a micro-batch of zero-weighted pads (the end of a follow epoch) does not dilute the rest.
The mean per micro-batch, averaged over them, failed both. Run as a script under
torch.distributed.run, this module is one of two ranks stepping over gloo (the last test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from layertap.train.config import TrainConfig
from layertap.train.drafter import DFlashDrafter, default_config
from layertap.train.trainer import prepare, train_step

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, LENGTH = 300, 32, 24


def head():
    from layertap.train.target_head import TargetHead

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    return TargetHead(embed, embed, True, {"num_layers": 8, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                                           "intermediate_size": 64, "rms_norm_eps": 1e-5})


def batch(seed: int, lengths: list[int], names: str) -> dict:
    """Samples padded to LENGTH; lengths far apart, so the micro-batches' weights are too."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = (torch.arange(LENGTH) < torch.tensor(lengths)[:, None]).to(torch.uint8)
    return {"input_ids": torch.randint(0, VOCAB, (n, LENGTH), generator=g), "loss_mask": mask,
            "lengths": torch.tensor(lengths), "hidden_states": torch.randn(n, LENGTH, 2, HIDDEN, generator=g) * 3,
            "sample_id": list(names)}


def joined(*batches: dict) -> dict:
    return {k: (sum((b[k] for b in batches), []) if k == "sample_id" else torch.cat([b[k] for b in batches]))
            for k in batches[0]}


def padding_of(b: dict) -> dict:
    return dict(b, loss_mask=torch.zeros_like(b["loss_mask"]), sample_id=["pad"] * len(b["sample_id"]))


A, B = batch(1, [24, 22], "ab"), batch(2, [5, 4], "cd")


def step_on(micro_batches: list[dict], acc=None) -> list[torch.Tensor]:
    """The trainable weights after one step of plain SGD (lr 1: the update is the gradient)."""
    from accelerate import Accelerator

    acc = acc or Accelerator(cpu=True)
    torch.manual_seed(0)
    # anchors at every position (max_anchors >= LENGTH): none drawn at random, whatever the micro-batch
    d = DFlashDrafter(default_config(head(), [1, 2], mask_token_id=VOCAB, block_size=4, max_anchors=LENGTH), head())
    params = [p for p in d.parameters() if p.requires_grad]
    ddp_model, optimizer = prepare(acc, d, torch.optim.SGD(params, lr=1.0))
    queue = list(micro_batches)
    run = SimpleNamespace(cfg=TrainConfig(data="unused", out="unused", grad_accum=len(queue), max_grad_norm=1e9),
                          acc=acc, ddp_model=ddp_model, model=d, params=params, optimizer=optimizer,
                          batches=SimpleNamespace(wait_for_batch=lambda: queue.pop(0)),
                          stop=SimpleNamespace(requested=None), total=10)
    train_step(run, 0)
    assert not queue
    return [p.detach().clone() for p in params]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b, strict=True))


def test_micro_batches_step_as_one_batch_of_them_all():
    assert_same(step_on([A, B]), step_on([joined(A, B)]))
    assert_same(step_on([B, A]), step_on([joined(A, B)]))
    # the step moved: a weights-unchanged answer would pass the comparisons above
    torch.manual_seed(0)
    fresh = DFlashDrafter(default_config(head(), [1, 2], mask_token_id=VOCAB, block_size=4, max_anchors=LENGTH), head())
    assert not all(torch.equal(p, q) for p, q in zip(step_on([A]), (p for p in fresh.parameters() if p.requires_grad)))


def test_a_micro_batch_of_pads_does_not_dilute_the_step():
    assert_same(step_on([padding_of(B), A]), step_on([A]))
    assert_same(step_on([A, padding_of(B)]), step_on([A]))


def test_two_ranks_step_as_one_rank_over_both_batches(tmp_path):
    """Rank 0 steps on A, rank 1 on B (two supervised slots' worth apart), then rank 0 on A and
    rank 1 on pads only: DDP averages the gradients, so the scale must count the other rank's
    weight, not one micro-batch mean per rank."""
    out = tmp_path / "weights"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    from safetensors.torch import load_file

    for case, single in (("ab", step_on([joined(A, B)])), ("a_pad", step_on([A]))):
        for rank in (0, 1):  # both replicas hold the same weights after the step
            got = load_file(str(out) + f".{case}.{rank}.safetensors")
            assert_same([got[str(i)] for i in range(len(got))], single)


if __name__ == "__main__":  # one rank of the test above
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    from safetensors.torch import save_file

    rank = acc.process_index
    for case, mine in (("ab", [A, B][rank]), ("a_pad", [A, padding_of(B)][rank])):
        weights = step_on([mine], acc)
        save_file({str(i): w.contiguous() for i, w in enumerate(weights)}, f"{sys.argv[1]}.{case}.{rank}.safetensors")
    acc.end_training()
    # Out without interpreter finalization. The last reduce returns once gloo's worker thread marks it
    # done; that thread drops the work (its tensor has a Python object) a moment later. When the main
    # thread is already finalizing by then, the GIL it takes ends the thread by pthread_exit through
    # noexcept C++: std::terminate, SIGABRT ("terminate called without an active exception", twice in
    # CI under a busy suite, with end_training before exit too: the C++ group outlives it). The trainer
    # checkpoints and meets at a barrier after its last reduce; this script exits milliseconds after.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

