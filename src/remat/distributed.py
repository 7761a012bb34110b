"""remat under data parallelism: one plan for all ranks, per-rank budgets, DDP and FSDP2.

The order that works (``docs/distributed.md``):

1. build the bare model on every rank (same seed);
2. plan on rank 0 and broadcast the plan: :func:`auto_distributed` (capture + plan on rank 0,
   :func:`broadcast_plan`, :func:`remat.apply` on every rank), or make a plan yourself and
   call :func:`broadcast_plan` then :func:`remat.apply`;
3. wrap the :class:`~remat.execute.chain.PlannedModule`: ``DistributedDataParallel(planned)``, or
   for FSDP2 :func:`fully_shard_planned` (``fully_shard`` on each block stage, then the root);
4. build the optimizer on the wrapped model's parameters.

Why this order: remat cuts the model into stages by recognising its structure (a
``DistributedDataParallel`` or an FSDP2-sharded model is not a structure it knows, and sharded
parameters cannot be profiled locally); DDP's gradient hooks and FSDP2's unshard/reshard hooks
live on parameters and modules, so they fire inside remat's checkpoints, and recomputation
re-runs them correctly (non-reentrant checkpoint: no "marked ready twice"). :func:`check_not_wrapped`
names the order when a wrapped model reaches remat.

Every rank must run the same plan: :func:`broadcast_plan` sends rank 0's plan as its JSON text
(never a pickled object) and validates it on receipt; :func:`check_same_plan` compares plan
fingerprints across ranks. Budgets are per rank: :func:`rank_memory` counts what one rank holds
(under FSDP2 the local shards of parameters, gradients and optimizer state, plus the unsharded
working set of the all-gathered blocks), the fixed part that :func:`remat.auto` subtracts.

Known limitations: tested on CPU with the gloo backend only (``docs/distributed.md``); the
FSDP2 working-set term is an estimate (root parameters + two all-gathered blocks + one block's
unsharded gradients); replanning on a new batch shape is not collective, so
:func:`auto_distributed` plans for one shape and raises on another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from remat.auto import AutoSummary, step_costs
from remat.capture.chain import _model_arguments, capture
from remat.capture.stages import split_stages
from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.plan import Plan, PlanError
from remat.core.units import format_bytes
from remat.execute.chain import PlannedModule, apply
from remat.guards import ORDER_HELP, WrapOrderError, check_not_wrapped
from remat.measure.profile import default_loss_fn, optimizer_costs
from remat.planning import plan_for_step, step_peak_of

if TYPE_CHECKING:
    from remat.auto import AutoSummary
    from remat.capture.stages import Stages
    from remat.execute.chain import PlannedModule

__all__ = [
    "WrapOrderError",
    "PlanMismatchError",
    "ORDER_HELP",
    "check_not_wrapped",
    "broadcast_plan",
    "plan_fingerprint",
    "check_same_plan",
    "RankMemory",
    "rank_memory",
    "fixed_bytes_per_rank",
    "shard_units",
    "fully_shard_planned",
    "auto_distributed",
]


class PlanMismatchError(PlanError):
    """Ranks hold different plans, or cut the model into different stages."""


# ---------------------------------------------------------------------- one plan for all ranks
def broadcast_plan(
    plan: Plan | None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    *,
    stage_names: Sequence[str] | None = None,
) -> Plan:
    """Rank ``src``'s plan on every rank of ``group``; a collective (all ranks must call it).

    The plan travels as its JSON text (:meth:`Plan.to_json`), not as a pickled object, and is
    read back with :meth:`Plan.from_json` on every rank (``src`` included), so all ranks hold
    equal plans. Other ranks pass ``plan=None`` (anything they pass is ignored).

    ``stage_names``: this rank's stage names (``planned.stages.names``); when given, every rank
    checks that the plan covers its number of stages and that its stages are named as on
    ``src``, and raises :class:`PlanMismatchError` otherwise.
    """
    _require_initialized("broadcast_plan")
    rank = dist.get_rank()
    payload: list[Any] = [None, None]
    if rank == src:
        if not isinstance(plan, Plan):
            raise TypeError(f"broadcast_plan: rank {src} must pass a remat.Plan, got {plan!r}")
        payload = [plan.to_json(), None if stage_names is None else list(stage_names)]
    dist.broadcast_object_list(payload, src=src, group=group, weights_only=True)
    text, src_names = payload
    if not isinstance(text, str):
        raise PlanMismatchError(f"rank {rank} received {type(text).__name__}, not a plan's JSON")
    received = Plan.from_json(text)
    if stage_names is not None:
        names = list(stage_names)
        if src_names is not None and names != src_names:
            raise PlanMismatchError(
                f"rank {rank} cut the model into stages {names} but rank {src} into {src_names}: "
                "every rank must build the same model and apply remat to it the same way"
            )
        received.for_chain(len(names))  # PlanError if the plan does not cover these stages
    return received


def plan_fingerprint(plan: Plan) -> str:
    """A short hash of everything in the plan's JSON (segments, method, predictions)."""
    canonical = json.dumps(json.loads(plan.to_json()), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def check_same_plan(plan: Plan | nn.Module, group: dist.ProcessGroup | None = None) -> str:
    """Check that every rank of ``group`` holds the same plan; returns its fingerprint.

    ``plan`` is a :class:`Plan` or a planned model (anything with a ``.plan``, e.g. a
    ``PlannedModule``, also inside DDP as ``.module``). A collective; raises
    :class:`PlanMismatchError` on every rank, naming the ranks and their plans, if they differ.
    """
    _require_initialized("check_same_plan")
    local = _plan_of(plan)
    mine = (plan_fingerprint(local), local.describe())
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if len({fp for fp, _ in everyone}) > 1:
        lines = [f"  rank {r}: {fp} {text}" for r, (fp, text) in enumerate(everyone)]
        raise PlanMismatchError(
            "ranks hold different remat plans; make the plan on one rank and send it with "
            "remat.distributed.broadcast_plan (auto_distributed does):\n" + "\n".join(lines)
        )
    return mine[0]


def _plan_of(obj: Plan | nn.Module) -> Plan:
    if isinstance(obj, Plan):
        return obj
    for candidate in (obj, getattr(obj, "module", None)):
        plan = getattr(candidate, "plan", None) if candidate is not None else None
        if isinstance(plan, Plan):
            return plan
    raise TypeError(f"expected a remat.Plan or a planned model, got {type(obj).__name__}")


# ---------------------------------------------------------------------- per-rank memory
@dataclass(frozen=True)
class RankMemory:
    """What one rank holds besides activations: the part of the budget no plan changes."""

    parameter_bytes: int
    """Parameters on this rank (FSDP2: the local shards, padding included)."""
    gradient_bytes: int
    """Their gradients (existing ones, or one per trainable parameter; FSDP2: local shards)."""
    buffer_bytes: int
    """Buffers (batch-norm statistics, ...): never sharded."""
    optimizer_bytes: int
    """Optimizer state now held, or what a fresh optimizer's first step will allocate."""
    ddp_bucket_bytes: int = 0
    """DDP's gradient buckets (a second copy of the gradients unless gradient_as_bucket_view)."""
    fsdp_unsharded_bytes: int = 0
    """FSDP2 working set (estimate): root parameters kept unsharded through the step, two
    all-gathered blocks (current + prefetched) and one block's unsharded gradients."""

    @property
    def total_bytes(self) -> int:
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.buffer_bytes
            + self.optimizer_bytes
            + self.ddp_bucket_bytes
            + self.fsdp_unsharded_bytes
        )

    def __str__(self) -> str:
        parts = [
            f"parameters {format_bytes(self.parameter_bytes)}",
            f"gradients {format_bytes(self.gradient_bytes)}",
            f"buffers {format_bytes(self.buffer_bytes)}",
            f"optimizer {format_bytes(self.optimizer_bytes)}",
        ]
        if self.ddp_bucket_bytes:
            parts.append(f"DDP buckets {format_bytes(self.ddp_bucket_bytes)}")
        if self.fsdp_unsharded_bytes:
            parts.append(f"FSDP2 unsharded {format_bytes(self.fsdp_unsharded_bytes)}")
        return f"per rank {format_bytes(self.total_bytes)}: " + ", ".join(parts)


def rank_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shard_world_size: int | None = None,
    units: Sequence[nn.Module] | None = None,
) -> RankMemory:
    """Bytes this rank holds for ``model`` and ``optimizer``, activations excluded.

    ``model`` may be bare, a ``PlannedModule``, a ``DistributedDataParallel`` or an
    FSDP2-sharded model (parameters are ``DTensor``: the local shard is counted). To budget
    *before* sharding, pass ``shard_world_size``: every parameter is counted as the shard
    ``fully_shard`` will give this rank (``ceil(rows / world_size)`` rows, as FSDP2 pads), and
    ``units`` (default: :func:`shard_units` of a planned model) are the blocks that will be
    sharded on their own; everything else belongs to the root.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    ws = shard_world_size

    def local_bytes(t: torch.Tensor, padded: bool) -> int:
        if isinstance(t, DTensor):
            local = t.to_local()
            return local.untyped_storage().nbytes() if padded else _nbytes(local)
        if ws and ws > 1 and t.dim() > 0:
            rows = math.ceil(t.shape[0] / ws)
            return rows * math.prod(t.shape[1:]) * t.element_size()
        return _nbytes(t)

    params = _unique(inner.parameters())
    parameter_bytes = sum(local_bytes(p, padded=True) for p in params)
    gradient_bytes = 0
    for p in params:
        if p.grad is not None:
            gradient_bytes += local_bytes(p.grad, padded=False)
        elif p.requires_grad:
            gradient_bytes += local_bytes(p, padded=False)
    buffer_bytes = sum(_nbytes(b) for b in _unique(inner.buffers()))
    optimizer_bytes = 0
    if optimizer is not None:
        if optimizer.state:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        optimizer_bytes += local_bytes(value, padded=False)
        else:
            copies = _optimizer_state_copies(optimizer)
            optimizer_bytes = copies * sum(
                local_bytes(p, padded=False) for g in optimizer.param_groups for p in g["params"]
            )
    ddp_bucket_bytes = 0
    if isinstance(model, DistributedDataParallel) and not model.gradient_as_bucket_view:
        ddp_bucket_bytes = sum(_nbytes(p) for p in params if p.requires_grad)

    fsdp_unsharded_bytes = 0
    sharded = [m for m in inner.modules() if isinstance(m, FSDPModule)]
    if sharded:
        block_sizes = [_full_bytes(_own_parameters(m)) for m in sharded if m is not inner]
        root_bytes = _full_bytes(_own_parameters(inner)) if isinstance(inner, FSDPModule) else 0
        fsdp_unsharded_bytes = _working_set(root_bytes, block_sizes)
    elif ws and ws > 1:
        if units is None:
            units = shard_units(inner) if hasattr(inner, "stages") else []
        in_units = {id(p) for u in units for p in u.parameters()}
        block_sizes = [_full_bytes(_unique(u.parameters())) for u in units]
        root_bytes = sum(_nbytes(p) for p in params if id(p) not in in_units)
        fsdp_unsharded_bytes = _working_set(root_bytes, block_sizes)
    return RankMemory(
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_bytes,
        buffer_bytes=buffer_bytes,
        optimizer_bytes=optimizer_bytes,
        ddp_bucket_bytes=ddp_bucket_bytes,
        fsdp_unsharded_bytes=fsdp_unsharded_bytes,
    )


def fixed_bytes_per_rank(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shard_world_size: int | None = None,
) -> int:
    """``rank_memory(...).total_bytes``: what :func:`remat.auto`'s budget loses per rank."""
    return rank_memory(model, optimizer, shard_world_size=shard_world_size).total_bytes


def _working_set(root_bytes: int, block_sizes: Sequence[int]) -> int:
    largest = max(block_sizes, default=0)
    # root parameters stay unsharded from forward to backward (reshard_after_forward=False for
    # the root); a block is all-gathered while the next is prefetched; a block's unsharded
    # gradients live until their reduce-scatter.
    return root_bytes + 2 * largest + largest


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _full_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)  # DTensor.numel() is global


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _own_parameters(module: nn.Module) -> list[torch.Tensor]:
    """Parameters of ``module`` not inside a nested FSDP2 unit (what its own unit all-gathers)."""
    from torch.distributed.fsdp import FSDPModule

    nested = {
        id(p)
        for m in module.modules()
        if m is not module and isinstance(m, FSDPModule)
        for p in m.parameters()
    }
    return [p for p in _unique(module.parameters()) if id(p) not in nested]


def _optimizer_state_copies(optimizer: torch.optim.Optimizer) -> int:
    """Per-parameter state tensors a fresh optimizer allocates at its first step."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return 2 + int(any(g.get("amsgrad") for g in optimizer.param_groups))
    if isinstance(optimizer, torch.optim.SGD):
        return int(any(g.get("momentum", 0) for g in optimizer.param_groups))
    if isinstance(optimizer, torch.optim.RMSprop | torch.optim.Adagrad):
        return 1
    return 0


# ---------------------------------------------------------------------- FSDP2
def shard_units(planned: nn.Module) -> list[nn.Module]:
    """The modules of a planned model to ``fully_shard`` one by one (the rest goes to the root).

    One unit per stage whose parameters belong to it alone: the stage module itself when it is
    a module of the model (a ResNet block), or the model modules the stage calls (GPT-2's
    ``transformer.h.i`` inside remat's block stage; the ``ln_1`` and ``attn`` of its attention
    half when the block is two stages: the block's own forward does not run then, so its hooks
    would not gather the parameters; a stem's convolution and batch norm). Stages that share
    parameters with another stage (tied embeddings) are left to the root: FSDP2 must see each
    parameter in exactly one unit, reached through the model's own module tree.
    """
    return _shard_units(planned.stages, planned.model)


def _shard_units(stages: Stages, model: nn.Module) -> list[nn.Module]:
    in_model = {id(m) for m in model.modules()}
    owner: dict[int, int] = {}
    for i, module in enumerate(stages.modules):
        for p in module.parameters():
            owner[id(p)] = i if owner.get(id(p), i) == i else -1
    units: list[nn.Module] = []
    for i, module in enumerate(stages.modules):
        params = _unique(module.parameters())
        if not params or any(owner[id(p)] != i for p in params):
            continue
        if id(module) in in_model:
            candidates = [module]
        else:
            children = [c for c in module.children() if id(c) in in_model]
            candidates = [c for c in children if _unique(c.parameters())]
            if sum(len(_unique(c.parameters())) for c in candidates) != len(params):
                candidates = []  # parameters outside the model's modules it calls: the root's
        units.extend(c for c in candidates if c is not model)
    return units


def fully_shard_planned(planned: PlannedModule, **fsdp_kwargs: Any) -> PlannedModule:
    """FSDP2 for a planned model: ``fully_shard`` each :func:`shard_units` block, then the root.

    Call it after :func:`remat.apply` (or :func:`auto_distributed`) and before building the
    optimizer. ``fsdp_kwargs`` go to every ``fully_shard`` call (``mesh``,
    ``reshard_after_forward``, ``mp_policy``, ...). Returns ``planned`` (now an FSDP module).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(planned, PlannedModule):
        check_not_wrapped(planned, "fully_shard_planned")
        raise TypeError(
            f"fully_shard_planned expects the PlannedModule made by remat.apply, got "
            f"{type(planned).__name__}. {ORDER_HELP}"
        )
    if isinstance(planned, FSDPModule):
        raise WrapOrderError("this planned model is already sharded (fully_shard was applied)")
    check_not_wrapped(planned.model, "fully_shard_planned")
    for unit in shard_units(planned):
        fully_shard(unit, **fsdp_kwargs)
    fully_shard(planned, **fsdp_kwargs)
    return planned


# ---------------------------------------------------------------------- plan on rank 0
def auto_distributed(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    budget: int | str | None = None,
    method: str = "optimal-time",
    optimizer: torch.optim.Optimizer | None = None,
    stages: list[str] | None = None,
    *,
    fsdp: bool = False,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> tuple[PlannedModule, AutoSummary]:
    """:func:`remat.auto` for data parallelism: plan on rank ``src``, apply the same plan everywhere.

    A collective: every rank calls it with its bare model (same architecture and seed) and its
    local batch (``batch`` is what one rank's model sees per step). Rank ``src`` captures the
    model and plans; every rank applies the broadcast plan. ``budget`` is **per rank**: the
    fixed part subtracted from it is :func:`rank_memory` (the largest over ranks), with
    FSDP2's shards and working set when ``fsdp=True`` (then shard the result with
    :func:`fully_shard_planned`); with DDP wrap it in ``DistributedDataParallel`` (whose
    gradient buckets are counted unless you pass ``gradient_as_bucket_view=True`` and
    account for it yourself).

    Returns ``(planned, summary)`` with the same plan and summary on every rank. The plan is
    for this batch shape: another shape raises
    :class:`~remat.execute.chain.SignatureMismatchError` (replanning inside a wrapped forward would
    not be a collective); call :func:`auto_distributed` again on the bare ``planned.model``.
    """
    _require_initialized("auto_distributed")
    check_not_wrapped(model, "auto_distributed")

    rank, ws = dist.get_rank(), dist.get_world_size(group)

    # Every rank counts what it will hold; the plan must fit the fullest rank.
    cut = split_stages(model, stages)
    memory = rank_memory(
        model,
        optimizer,
        shard_world_size=ws if fsdp else None,
        units=_shard_units(cut, model) if fsdp else None,
    )
    fixed_local = memory.total_bytes
    if not fsdp:
        fixed_local += memory.gradient_bytes  # DDP's buckets (gradient_as_bucket_view=False)
    fixed = torch.tensor([fixed_local], dtype=torch.int64)
    dist.all_reduce(fixed, op=dist.ReduceOp.MAX, group=group)
    fixed_bytes = int(fixed.item())

    payload: list[Any] = [None]
    if rank == src:
        try:
            captured = capture(model, batch, loss_fn=loss_fn, stages=stages)
            chain = captured.chain
            # DDP: every rank steps the whole optimizer, so its temporaries are one step's;
            # FSDP2's sharded step is not modelled (docs/distributed.md)
            step_bytes = 0 if fsdp else optimizer_costs(model, optimizer)[1]
            # the one whole-step model (remat.auto.step_costs), read as the fullest rank: its
            # fixed bytes, every gradient in them from the start (none made by the backward)
            costs = dataclasses.replace(
                step_costs(captured, model, optimizer, loss_fn=loss_fn, batch=batch),
                persistent_bytes=fixed_bytes,
                grad_bytes=(0,) * chain.n,
                grad_rise_bytes=(),
                optimizer_step_bytes=step_bytes,
            )
            chosen = plan_for_step(chain, costs, budget, method)
            payload = [
                {
                    "plan": chosen.to_json(),
                    "chain": chain.to_json(),
                    "names": list(captured.stages.names),
                    "predicted_peak_bytes": step_peak_of(chain, chosen, costs),
                    "unplanned_peak_bytes": step_peak_of(chain, Plan.none(chain), costs),
                }
            ]
        except Exception as err:  # every rank must learn why, or the others would hang
            payload = [{"error": f"{type(err).__name__} on rank {src}: {err}"}]
            dist.broadcast_object_list(payload, src=src, group=group, weights_only=True)
            raise
    dist.broadcast_object_list(payload, src=src, group=group, weights_only=True)
    message = payload[0]
    if "error" in message:
        raise PlanError(f"auto_distributed: planning failed: {message['error']}")
    chosen = Plan.from_json(message["plan"])
    chain = Chain.from_json(message["chain"])
    if list(cut.names) != message["names"] or chain.n != cut.n:
        raise PlanMismatchError(
            f"rank {rank} cut the model into stages {list(cut.names)} but rank {src} into "
            f"{message['names']}: every rank must build the same model"
        )
    # the plan is for this rank's batch: record its model arguments (a first call of another
    # shape must not adopt the plan)
    example = _model_arguments(model, loss_fn or default_loss_fn, batch)
    planned = apply(model, chosen, stages=cut, example=example)
    check_same_plan(planned, group=group)
    none = simulate(chain, Plan.none(chain))
    sim = simulate(chain, chosen)
    predicted = int(message["predicted_peak_bytes"])
    unplanned = int(message["unplanned_peak_bytes"])
    summary = AutoSummary.of(
        method, chosen, chain, budget, fixed_bytes, sim, none, predicted, unplanned
    )
    return planned, summary


def _require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} is a collective: call torch.distributed.init_process_group first (torchrun "
            "sets the environment; see docs/distributed.md)"
        )
