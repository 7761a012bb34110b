"""Data-parallel training with remat: one plan made on rank 0, DDP or FSDP2, a per-rank budget.

Run it with torchrun (CPU: gloo; with GPUs: NCCL, one GPU per rank)::

    torchrun --nproc-per-node 2 examples/distributed_train.py                    # DDP
    torchrun --nproc-per-node 2 examples/distributed_train.py --fsdp             # FSDP2
    torchrun --nproc-per-node 2 examples/distributed_train.py --budget 4MiB --steps 20

The order that works: plan and apply remat on the bare model (``auto_distributed``: capture
and plan on rank 0, broadcast the plan, apply it on every rank), then wrap the planned model
(``DistributedDataParallel(planned)`` or ``fully_shard_planned(planned)``), then build the
optimizer on the wrapped model. ``--budget`` is per rank. ``--check`` verifies that all
ranks hold the same plan and (DDP) the same parameters after training. See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import remat
from remat.distributed import auto_distributed, check_same_plan, fully_shard_planned, rank_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--budget", default=None, help="per-rank budget, e.g. 4MiB (default: "
                        "least memory within one extra forward)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--method", default="optimal-time", help="planner")
    parser.add_argument("--check", action="store_true", help="verify plan and parameters agree")
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK).
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    # 1. the same bare model on every rank (seeded); each rank gets its own batch (a real
    #    job reads its shard of the data set, e.g. with a DistributedSampler)
    entry = remat.zoo.get(
        "gpt2", batch_size=args.batch_size, seed=0, n_layer=2, n_embd=64, n_head=2,
        vocab_size=96, seq_len=32, n_positions=32,
    )  # fmt: skip
    model = entry.model.to(device)
    ids = torch.randint(0, 96, (args.batch_size, 32), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}

    # 2. capture + plan on rank 0 under the per-rank budget, broadcast, apply on every rank.
    #    The optimizer is passed only to count its state (FSDP2 needs the real one built after
    #    sharding); a fresh one allocates nothing.
    accounting = torch.optim.AdamW(model.parameters(), lr=1e-3)
    planned, summary = auto_distributed(
        model, batch, entry.loss_fn, budget=args.budget, method=args.method,
        optimizer=accounting, fsdp=args.fsdp,
    )  # fmt: skip
    if rank == 0:
        print(summary, flush=True)

    # 3. wrap the planned model, then build the optimizer on the wrapped parameters
    wrapped = fully_shard_planned(planned) if args.fsdp else DistributedDataParallel(planned)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)

    for step in range(args.steps):
        loss = entry.loss_fn(wrapped, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {mean.item() / world:.4f}", flush=True)

    print(f"rank {rank}: {rank_memory(wrapped, optimizer)}", flush=True)
    if args.check:
        fingerprint = check_same_plan(planned)
        if not args.fsdp:  # DDP: every rank holds the full, identical parameters
            flat = torch.cat([p.detach().flatten() for p in wrapped.parameters()])
            everyone = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(everyone, flat)
            assert all(torch.equal(everyone[0], other) for other in everyone), "ranks differ"
        if rank == 0:
            print(f"all ranks hold plan {fingerprint}: {planned.plan.describe()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
