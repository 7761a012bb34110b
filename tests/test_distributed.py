"""remat under DDP and FSDP2 with real processes: 2 ranks, gloo on CPU, one plan from rank 0.

What is compared, and why. Every rank trains the *planned* model on its half of a global
batch; the same process also runs the reference: the *unplanned* model in one process, fed the
same halves one after the other with each loss divided by the world size and the gradients
accumulated, which is the gradient DDP/FSDP2 average (the mean of the ranks' mean losses).
Dropout draws from a seed fixed per (step, rank) in both, so masks agree. Batch norm under
data parallelism normalises with each rank's *local* batch, so the reference runs each half
with that rank's own running statistics: under DDP every rank starts a step from rank 0's
statistics (``broadcast_buffers=True`` copies them at each forward), under FSDP2 buffers are
not synchronised and each rank keeps its own. After each step we compare the loss, every
parameter gradient (FSDP2: the full tensor of the sharded gradient) and, at the end, every
parameter and each rank's batch-norm statistics (which also shows they were updated once per
step: ``num_batches_tracked`` equals the step count although stages were recomputed).

The ranks are forked from the test process (torch and transformers are imported once), join
with a time limit, and report failures with the rank's traceback. One fork per test, with
several checks inside, keeps the file well under 90 s on a 2-core machine.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import remat
from remat import BudgetTooSmallError, ChainSegment, Plan, PlanError
from remat.capture.stages import split_stages
from remat.distributed import (
    PlanMismatchError,
    WrapOrderError,
    broadcast_plan,
    check_not_wrapped,
    check_same_plan,
    fully_shard_planned,
    plan_fingerprint,
    rank_memory,
    shard_units,
)

pytest.importorskip("transformers")
# The ranks are forked: a process that has run a backward under fake tensors or
# torch.compile (tests/test_fake_planning.py, tests/test_compile.py on the same xdist worker)
# starts autograd's device threads, and its forks cannot run a backward ("Unable to handle
# autograd's threading in combination with fork-based multiprocessing"). Each test forks from
# an interpreter of its own.
pytestmark = pytest.mark.fresh_process

# imported here, once: the forked ranks inherit it instead of importing it twice in parallel
import transformers.models.gpt2.modeling_gpt2  # noqa: E402, F401

WORLD = 2
LOCAL_BATCH = 4
STEPS = 2
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed_train.py"


# ---------------------------------------------------------------------- process harness
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, fn: Callable[[int], None], port: int, init_group: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    torch.set_num_threads(1)
    if not init_group:  # fn initialises the group itself from the environment, as under torchrun
        fn(rank)
        return
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        fn(rank)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int], None], timeout_s: float = 120.0, init_group: bool = True) -> None:
    """Run ``fn(rank)`` in ``WORLD`` forked processes with a gloo group; fail on any error."""
    context = mp.start_processes(
        _rank_main,
        args=(fn, _free_port(), init_group),
        nprocs=WORLD,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:  # pragma: no cover - only on a hang
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"ranks did not finish within {timeout_s} s")


# ---------------------------------------------------------------------- models
def gpt2() -> tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], list[Any]]:
    """GPT-2 (2 layers, d=64, vocab 96, seq 32, dropout 0.1); one batch per rank."""
    entry = remat.zoo.get(
        "gpt2", batch_size=LOCAL_BATCH * WORLD, n_layer=2, n_embd=64, n_head=2,
        vocab_size=96, seq_len=32, n_positions=32,
    )  # fmt: skip
    ids = entry.batch["input_ids"]
    chunks = [{"input_ids": c, "labels": c.clone()} for c in ids.chunk(WORLD)]
    return entry.model, entry.loss_fn, chunks


def resnet() -> tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], list[Any]]:
    """torchvision ResNet with one BasicBlock per layer (batch norm everywhere), 16x16 input."""
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(LOCAL_BATCH * WORLD, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (LOCAL_BATCH * WORLD,), generator=g)
    chunks = list(zip(x.chunk(WORLD), y.chunk(WORLD), strict=True))
    return model, remat.zoo.classification_loss, chunks


# nested plans (depth 2) with batch norm / dropout inside recomputed segments; GPT-2's six
# stages: the embedding, each block's attention and MLP halves, the head
GPT2_PLAN = Plan.from_chain_segments(
    (ChainSegment(1, 4, True, (ChainSegment(1, 2, True), ChainSegment(3, 4))), ChainSegment(5, 6))
)
RESNET_PLAN = Plan.from_chain_segments(
    (
        ChainSegment(1, 3, True, (ChainSegment(1, 1), ChainSegment(2, 3, True))),
        ChainSegment(4, 6, True, (ChainSegment(4, 5, True), ChainSegment(6, 6))),
    )
)


def _seed(step: int, rank: int) -> int:
    return 1000 * step + rank


# ---------------------------------------------------------------------- reference
def reference(model: nn.Module, loss_fn: Callable, chunks: list[Any], sync_buffers: bool) -> dict:
    """Single-process run reproducing data-parallel training (see the module docstring)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = {k: b.clone() for k, b in model.named_buffers()}
    rank_buffers = [dict(start) for _ in chunks]
    losses, grads = [], []
    for step in range(STEPS):
        step_losses = []
        step_start = list(rank_buffers)
        for r, chunk in enumerate(chunks):
            source = step_start[0] if sync_buffers else step_start[r]
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(source[k])
            torch.manual_seed(_seed(step, r))
            loss = loss_fn(model, chunk)
            (loss / len(chunks)).backward()
            step_losses.append(loss.detach())
            rank_buffers[r] = {k: b.clone() for k, b in model.named_buffers()}
        losses.append(step_losses)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "buffers": rank_buffers}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _strip(name: str) -> str:
    return name.removeprefix("model.")


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def train_and_compare(
    rank: int, build: Callable, plan: Plan, wrap: str, ddp_kwargs: dict | None = None
) -> Any:
    """Plan on rank 0, broadcast, apply, wrap (DDP or FSDP2), train STEPS steps, compare."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, loss_fn, chunks = build()
    ref = reference(model, loss_fn, chunks, sync_buffers=wrap == "ddp")
    names = split_stages(model).names
    plan = broadcast_plan(plan if rank == 0 else None, stage_names=names)
    planned = remat.apply(model, plan)
    fingerprint = check_same_plan(planned)
    assert fingerprint == plan_fingerprint(plan)
    first_stage_calls = _count_calls(planned.stages.modules[0])
    wrapped = DDP(planned, **ddp_kwargs) if ddp_kwargs else _wrap(planned, wrap)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        torch.manual_seed(_seed(step, rank))
        loss = loss_fn(wrapped, chunks[rank])
        loss.backward()
        _close(loss.detach(), ref["losses"][step][rank], f"rank {rank} step {step} loss")
        for name, p in planned.named_parameters():
            got = _full(p.grad)
            _close(got, ref["grads"][step][_strip(name)], f"step {step} grad {_strip(name)}")
        opt.step()
        opt.zero_grad()
    # the first stage runs once in the forward and again in each enclosing recomputation
    runs = 1 + sum(1 for seg in plan.walk() if seg.first == 0)
    assert runs >= 2 and first_stage_calls[0] == runs * STEPS, (first_stage_calls, runs)
    for name, p in planned.named_parameters():
        _close(_full(p.detach()), ref["params"][_strip(name)], f"parameter {_strip(name)}")
    for name, b in planned.named_buffers():
        _close(b, ref["buffers"][rank][_strip(name)], f"rank {rank} buffer {_strip(name)}")
        if name.endswith("num_batches_tracked"):
            assert int(b) == STEPS, f"{name} = {int(b)} after {STEPS} steps"
    return wrapped


def _wrap(planned: nn.Module, how: str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(planned) if how == "ddp" else fully_shard_planned(planned)


def _measured_peak(wrapped: nn.Module, batch: Any, loss_fn: Callable) -> int:
    """Per-rank peak of a forward + backward (MemTracker, remat.profile) in the steady state.

    Two steps run first (DDP allocates its gradient buckets anew in the second forward). The
    tracker counts DDP's buckets too: their storage is seen when the reducer writes gradients
    into them (a single process measures exactly that much less).
    """
    from remat.measure.profile import profile

    for _ in range(2):
        loss_fn(wrapped, batch).backward()
    return profile(wrapped, batch, loss_fn, None).peak_bytes


def budget_check(rank: int, how: str) -> None:
    """auto_distributed under a per-rank budget: planned on rank 0, measured on every rank."""
    fsdp = how == "fsdp"
    model, loss_fn, chunks = gpt2()
    batch = chunks[rank]
    unplanned = _wrap(remat.apply(copy.deepcopy(model), Plan.none()), how)
    unplanned_peak = _measured_peak(unplanned, batch, loss_fn)
    _, first = remat.distributed.auto_distributed(model, batch, loss_fn, fsdp=fsdp)
    budget = first.fixed_bytes + int(0.75 * first.unplanned_activation_peak_bytes)
    planned, summary = remat.distributed.auto_distributed(
        model, batch, loss_fn, budget=budget, fsdp=fsdp
    )
    predicted, predicted_unplanned = summary.predicted_peak_bytes, summary.unplanned_peak_bytes
    assert 0 < predicted <= budget < predicted_unplanned, (predicted, budget, predicted_unplanned)
    assert any(seg.checkpoint for seg in summary.plan.chain_segments()), summary.plan.describe()
    check_same_plan(planned)
    peak = _measured_peak(_wrap(planned, how), batch, loss_fn)
    numbers = (how, rank, peak, predicted, budget, unplanned_peak, predicted_unplanned)
    assert peak <= budget < unplanned_peak, numbers
    # the planner's safe reading (every gradient live from the start, FSDP2's working set an
    # estimate) bounds what runs, and not by much: measured 7% (DDP) and 12% (FSDP2) below the
    # planned prediction, 10% below the unplanned one
    assert peak <= predicted <= 1.2 * peak, numbers
    assert unplanned_peak <= predicted_unplanned <= 1.2 * unplanned_peak, numbers


# ---------------------------------------------------------------------- DDP
def _ddp_checks(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    budget_check(rank, "ddp")
    # with DDP every rank steps the whole optimizer: a budget that holds the state but not the
    # step's own temporaries (foreach Adam: one copy of every parameter) is refused, on every rank
    model, loss_fn, chunks = gpt2()
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    _, first = remat.distributed.auto_distributed(model, chunks[rank], loss_fn, optimizer=opt)
    refused = BudgetTooSmallError if rank == 0 else PlanError  # the planning rank's own error
    with pytest.raises(refused, match="optimizer step alone"):
        remat.distributed.auto_distributed(
            model, chunks[rank], loss_fn, budget=first.fixed_bytes + 4096, optimizer=opt
        )
    # defaults: find_unused_parameters=False, static_graph=False
    ddp = train_and_compare(rank, gpt2, GPT2_PLAN, "ddp")
    train_and_compare(rank, resnet, RESNET_PLAN, "ddp")
    train_and_compare(rank, gpt2, GPT2_PLAN, "ddp", {"find_unused_parameters": True})
    train_and_compare(rank, gpt2, GPT2_PLAN, "ddp", {"static_graph": True})

    # wrong order: remat given a DDP-wrapped model names the order to use
    with pytest.raises(WrapOrderError, match="Apply remat to the bare model first"):
        check_not_wrapped(ddp)
    with pytest.raises(WrapOrderError, match="DistributedDataParallel"):
        remat.distributed.auto_distributed(ddp, None)
    with pytest.raises(WrapOrderError):
        check_not_wrapped(DDP(nn.Linear(2, 2)))

    # different plans on the ranks are caught, on every rank
    mine = Plan.from_checkpoints(4, [1 + rank])
    with pytest.raises(PlanMismatchError, match="ranks hold different remat plans"):
        check_same_plan(mine)
    # a rank whose stages differ from rank 0's, or a plan for another stage count
    names = ["a", "b", "c", "d", "e", "f"] if rank == 0 else ["a", "b", "x", "d", "e", "f"]
    if rank == 0:
        broadcast_plan(GPT2_PLAN, stage_names=names)
    else:
        with pytest.raises(PlanMismatchError, match="rank 1 cut the model into stages"):
            broadcast_plan(None, stage_names=names)
    with pytest.raises(PlanError, match="stages"):
        broadcast_plan(GPT2_PLAN if rank == 0 else None, stage_names=["a", "b", "c"])


def test_ddp_gradients_batchnorm_plan_agreement_and_order() -> None:
    run_ranks(_ddp_checks)


# ---------------------------------------------------------------------- FSDP2
def _fsdp_checks(rank: int) -> None:
    # the per-rank memory predicted before sharding equals what the ranks hold after it
    model, _, _ = gpt2()
    planned = remat.apply(model, GPT2_PLAN)
    units = shard_units(planned)
    # each block is two stages (its attention and MLP halves): the modules they call
    assert [type(u).__name__ for u in units] == [
        "LayerNorm",
        "GPT2Attention",
        "LayerNorm",
        "GPT2MLP",
    ] * 2
    predicted = rank_memory(planned, shard_world_size=WORLD)
    fully_shard_planned(planned)
    assert rank_memory(planned) == predicted
    with pytest.raises(WrapOrderError, match="fully_shard"):
        check_not_wrapped(planned.model)
    with pytest.raises(WrapOrderError, match="already sharded"):
        fully_shard_planned(planned)

    budget_check(rank, "fsdp")
    train_and_compare(rank, gpt2, GPT2_PLAN, "fsdp")
    train_and_compare(rank, resnet, RESNET_PLAN, "fsdp")


def test_fsdp2_gradients_parameters_and_recomputation() -> None:
    run_ranks(_fsdp_checks)


# ---------------------------------------------------------------------- the torchrun example
def _run_example(out_dir: Path, argv: list[str]) -> Callable[[int], None]:
    def run(rank: int) -> None:
        import contextlib
        import importlib.util

        spec = importlib.util.spec_from_file_location("distributed_train", EXAMPLE)
        assert spec is not None and spec.loader is not None
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        sys.argv = [str(EXAMPLE), *argv]
        with open(out_dir / f"rank{rank}.txt", "w") as out, contextlib.redirect_stdout(out):
            example.main()

    return run


@pytest.mark.parametrize("argv", [["--check"], ["--check", "--fsdp"]], ids=["ddp", "fsdp"])
def test_example_as_torchrun_runs_it(tmp_path: Path, argv: list[str]) -> None:
    """examples/distributed_train.py's main() in 2 ranks with torchrun's environment."""
    run_ranks(_run_example(tmp_path, ["--steps", "2", *argv]), init_group=False)
    out = (tmp_path / "rank0.txt").read_text()
    assert "step 1: loss" in out and "all ranks hold plan" in out, out
    assert "per rank" in (tmp_path / "rank1.txt").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("REMAT_TORCHRUN_TEST"), reason="set REMAT_TORCHRUN_TEST=1")
def test_torchrun_example() -> None:
    """The real launcher (about a minute on a busy 2-core machine: two fresh interpreters)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        str(EXAMPLE), "--steps", "2", "--check",
    ]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all ranks hold plan" in result.stdout
