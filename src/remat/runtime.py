"""Apply a chain :class:`~remat.plans.Plan` to a real PyTorch model: :func:`apply`.

The model is cut into stages (:mod:`remat.stages`); the plan's segment tree becomes nested
**non-reentrant** ``torch.utils.checkpoint`` calls:

* a stored segment runs its stages plainly (autograd keeps what their backward needs);
* a checkpointed segment is ``checkpoint(run_children, *input_tensors)`` where
  ``run_children`` runs the segment's sub-plan (its ``children``), which may hold further
  checkpointed segments: nesting depth = plan depth.

This executes exactly what :func:`remat.simulate` assumes (forward counts are tested equal),
because torch's nested checkpoint recomputes a segment by re-running its function, in which the
inner checkpoints are respected again (NOTE [ Nestable Checkpoint ], Rule 3), and because remat
turns torch's *early stop* off by default (``early_stop=False``; see ``docs/executor.md``).

Gradients equal the unplanned model's: random number generator state is restored for every
recomputation (dropout masks are identical), autocast state is re-entered by torch, and
batch-norm running statistics are updated once per step (recomputations update throw-away
copies of the statistics). In eval mode or under ``torch.no_grad()`` the model runs plainly with
no checkpoint machinery at all.

Example:
    >>> import torch, remat
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    >>> planned = remat.apply(model, remat.Plan.from_checkpoints(6, [2, 4]))
    >>> planned(torch.randn(4, 8)).sum().backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as _torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.plans import Plan, PlanError, Segment
from remat.stages import Stages, UnsupportedModelError, _run_plain, split_stages

__all__ = ["apply", "PlannedModule", "SignatureMismatchError", "input_signature"]


class SignatureMismatchError(ValueError):
    """The model was called with inputs of other shapes/dtypes than the plan was made for."""


# The checkpoint function the executor calls (a module attribute so tests can count calls).
checkpoint = _torch_checkpoint.checkpoint


# ---------------------------------------------------------------------- input signatures
def input_signature(*args: Any, **kwargs: Any) -> tuple:
    """What a plan depends on in the inputs: tensor shapes and dtypes, and the structure.

    Non-tensor leaves (flags, ``None``) are part of the signature by type and, for plain
    scalars and strings, by value.
    """
    leaves, spec = tree_flatten((args, kwargs))
    sig: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append(("tensor", tuple(leaf.shape), str(leaf.dtype)))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            sig.append(("value", leaf))
        else:
            sig.append(("object", type(leaf).__qualname__))
    return (str(spec), tuple(sig))


def _describe_signature(sig: tuple) -> str:
    parts = []
    for item in sig[1]:
        if item[0] == "tensor":
            parts.append(f"{list(item[1])} {item[2].replace('torch.', '')}")
        elif item[0] == "value":
            parts.append(repr(item[1]))
        else:
            parts.append(item[1])
    return "(" + ", ".join(parts) + ")"


def _example_args(example: Any) -> tuple[tuple, dict]:
    if (
        isinstance(example, tuple)
        and len(example) == 2
        and isinstance(example[0], tuple)
        and isinstance(example[1], Mapping)
    ):
        return example[0], dict(example[1])
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    raise TypeError(
        "example must be the model's input: a tensor, a tuple of positional arguments, a "
        "dict of keyword arguments, or (args_tuple, kwargs_dict); got "
        f"{type(example).__name__}"
    )


# ---------------------------------------------------------------------- batch norm
def _running_stat_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Norm modules (BatchNorm, InstanceNorm with tracking) that update running statistics."""
    found: dict[int, nn.Module] = {}
    for root in modules:
        for m in root.modules():
            if (
                isinstance(m, nn.modules.batchnorm._NormBase)
                and m.track_running_stats
                and m.running_mean is not None
            ):
                found[id(m)] = m
    return list(found.values())


@contextlib.contextmanager
def _frozen_running_stats(norms: Sequence[nn.Module]) -> Iterator[None]:
    """During a recomputation: batch norm updates throw-away copies of its running statistics.

    The train-mode output uses batch statistics, so it is unchanged; the real ``running_mean``,
    ``running_var`` and ``num_batches_tracked`` are updated only by the first forward. Copies
    (not ``track_running_stats=False``) keep the recomputation's saved tensors identical to the
    forward's: batch norm's backward node saves the running statistics as well.
    """
    saved = []
    for m in norms:
        if m.training:
            saved.append((m, m.running_mean, m.running_var, m.num_batches_tracked))
            m.running_mean = m.running_mean.clone()
            m.running_var = m.running_var.clone()
            if m.num_batches_tracked is not None:
                m.num_batches_tracked = m.num_batches_tracked.clone()
    try:
        yield
    finally:
        for m, mean, var, count in saved:
            m.running_mean, m.running_var, m.num_batches_tracked = mean, var, count


# ---------------------------------------------------------------------- the executor
class _Executor:
    """Runs the stages under a plan's segment tree with nested non-reentrant checkpoints."""

    def __init__(self, stages: Stages, plan: Plan, early_stop: bool) -> None:
        self.stages = stages
        self.plan = plan
        self.early_stop = early_stop
        self._norms: dict[tuple[int, int], list[nn.Module]] = {}
        for seg in plan.walk():
            if seg.checkpoint:
                mods = stages.modules[seg.start - 1 : seg.stop]
                self._norms[(seg.start, seg.stop)] = _running_stat_modules(mods)

    def run(self, a: Any) -> Any:
        return self._run_segments(self.plan.segments, a)

    def _run_segments(self, segments: Sequence[Segment], a: Any) -> Any:
        modules = self.stages.modules
        for seg in segments:
            if seg.checkpoint:
                a = self._checkpointed(seg, a)
            else:
                for i in seg.stages():
                    a = modules[i - 1](a)
        return a

    def _checkpointed(self, seg: Segment, a: Any) -> Any:
        # Tensors go to checkpoint as positional arguments: torch saves only those through
        # saved-tensor hooks (so an enclosing checkpoint recomputes them, Rule 2); tensors
        # nested in a tuple argument would be held by reference instead. For the same reason
        # the function below must not capture any tensor of ``a``: the checkpoint keeps it
        # until its backward, and an inner checkpoint's input would never be freed.
        leaves, spec = tree_flatten(a)
        del a
        positions = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[k] for k in positions]
        template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        del leaves
        children = seg.children

        def run_children(*ts: torch.Tensor) -> Any:
            rebuilt = list(template)
            for k, t in zip(positions, ts, strict=True):
                rebuilt[k] = t
            return self._run_segments(children, tree_unflatten(rebuilt, spec))

        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
        if not self.early_stop:
            options["early_stop"] = False
        norms = self._norms[(seg.start, seg.stop)]
        if norms and not torch.compiler.is_compiling():
            # (under torch.compile, AOTAutograd applies a buffer mutation once: no fix needed)

            def context_fn() -> tuple[Any, Any]:
                return contextlib.nullcontext(), _frozen_running_stats(norms)

            options["context_fn"] = context_fn
        versions = [t._version for t in tensors]
        out = checkpoint(run_children, *tensors, **options)
        if any(t._version != v for t, v in zip(tensors, versions, strict=True)):
            raise UnsupportedModelError(_writes_input(self.stages.names[seg.start - 1]))
        return out


def _writes_input(name: str) -> str:
    return (
        f"stage {name!r} writes into its input in place, and the plan recomputes a segment "
        "that starts at it: the recomputation would read the input already modified (wrong "
        "gradients, or torch's 'modified by an inplace operation'). Make the write out of place "
        "in the model (x = x + 1, inplace=False), or name the stages so that this block joins "
        "the stage before it (stages=[...])"
    )


def _resolve_plan(plan: Plan, stages: Stages) -> Plan:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a remat.Plan, got {type(plan).__name__}")
    n = stages.n
    if plan.rule is None and plan.n != n:
        raise PlanError(
            f"the plan covers {plan.n} stages but the model has {n} stages "
            f"({stages.describe()}); make the plan for this model's chain (same stages), e.g. "
            "with remat.capture_chain on the same model"
        )
    return plan.for_chain(n)


class PlannedModule(nn.Module):
    """A model that trains under a remat plan; made by :func:`apply`.

    It shares the original model's parameters and buffers: the model is its submodule
    ``.model``, so ``state_dict()`` keys are the model's prefixed with ``"model."`` (like any
    wrapper); ``planned.model.state_dict()`` has the original keys. Calling it equals calling
    the model; the plan is used only in training mode with grad enabled.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        stages: Stages,
        signature: tuple | None = None,
        replan: Callable[..., Plan] | None = None,
        early_stop: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        # Stage modules are the model's own modules (or parameter-less wrappers around them):
        # kept out of the module tree so that parameters and state_dict are the model's only.
        object.__setattr__(self, "_stages", stages)
        object.__setattr__(self, "_early_stop", early_stop)
        object.__setattr__(self, "_replan", replan)
        object.__setattr__(self, "_signature", signature)
        object.__setattr__(self, "_plans", {})
        self._set_plan(_resolve_plan(plan, stages), signature)

    # -------------------------------------------------------------- public state
    @property
    def stages(self) -> Stages:
        return self._stages

    @property
    def plan(self) -> Plan:
        """The plan in use (for the last training input signature)."""
        return self._executor.plan

    @property
    def signature(self) -> tuple | None:
        """Input signature the current plan was made for (None: not known yet)."""
        return self._signature

    def _set_plan(self, plan: Plan, signature: tuple | None) -> None:
        object.__setattr__(self, "_executor", _Executor(self._stages, plan, self._early_stop))
        object.__setattr__(self, "_signature", signature)
        if signature is not None:
            self._plans[signature] = self._executor

    def train(self, mode: bool = True) -> PlannedModule:
        super().train(mode)
        for m in self._stages.modules:
            m.train(mode)
        return self

    # -------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stages = self._stages
        if stages.check is not None:
            stages.check(*args, **kwargs)
        if not (self.training and torch.is_grad_enabled()):
            return _run_plain(stages, args, kwargs)
        executor = self._executor_for(args, kwargs)
        a0 = stages.prepare(*args, **kwargs)
        return stages.finish(executor.run(a0), *args, **kwargs)

    def _executor_for(self, args: tuple, kwargs: dict) -> _Executor:
        sig = input_signature(*args, **kwargs)
        if self._signature is None:
            self._set_plan(self._executor.plan, sig)
            return self._executor
        if sig == self._signature:
            return self._executor
        cached = self._plans.get(sig)
        if cached is not None:
            object.__setattr__(self, "_executor", cached)
            object.__setattr__(self, "_signature", sig)
            return cached
        if self._replan is None:
            raise SignatureMismatchError(
                "this plan was made for inputs "
                f"{_describe_signature(self._signature)} but the model was called with "
                f"{_describe_signature(sig)}; memory and time of a plan depend on the batch "
                "shape, so remat does not run it on other sizes. Make a plan for these inputs "
                "and call remat.apply again, or pass replan=callable (called with the new "
                "inputs, returning a Plan) to remat.apply."
            )
        new_plan = self._replan(*args, **kwargs)
        self._set_plan(_resolve_plan(new_plan, self._stages), sig)
        return self._executor

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or name == "model":
                raise
            return getattr(self._modules["model"], name)

    def extra_repr(self) -> str:
        plan = self.plan
        return (
            f"plan={plan.method}: {plan.describe()!r}, stages={self._stages.n} "
            f"({self._stages.kind})"
        )


def apply(
    model: nn.Module,
    plan: Plan,
    stages: Stages | Sequence[str] | None = None,
    example: Any = None,
    *,
    replan: Callable[..., Plan] | None = None,
    early_stop: bool = False,
) -> PlannedModule:
    """Wrap ``model`` so that its training steps run under ``plan``.

    Args:
        model: the model; its parameters and buffers are shared, not copied.
        plan: a :class:`~remat.plans.Plan` for this model's chain (``plan.n`` = number of
            stages) or a rule plan (``Plan.none()``, ``Plan.every_stage()``).
        stages: how the model is cut: ``None`` (automatic, :func:`remat.stages.split_stages`),
            a list of submodule names, or a :class:`~remat.stages.Stages`.
        example: the input the plan was made for (a tensor, a tuple of positional arguments,
            a dict of keyword arguments, or ``(args_tuple, kwargs_dict)``). Its shapes/dtypes are recorded; a training call
            with other ones raises :class:`SignatureMismatchError` unless ``replan`` is given.
            Without it, the first training call's inputs are recorded.
        replan: ``replan(*args, **kwargs) -> Plan``, called for a new input signature; the
            plans are cached per signature.
        early_stop: let torch stop recomputations as soon as the saved tensors they need exist
            (saves some recomputation that :func:`remat.simulate` counts; off by default so
            that the executor runs exactly what the simulator predicts).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, PlannedModule):
        raise TypeError("this model already has a plan; apply it to planned.model instead")
    from remat.distributed import check_not_wrapped

    check_not_wrapped(model, "remat.apply")  # DDP/FSDP go around the planned model, not inside
    if stages is None or not isinstance(stages, Stages):
        stages = split_stages(model, stages)
    signature = None
    if example is not None:
        args, kwargs = _example_args(example)
        signature = input_signature(*args, **kwargs)
    return PlannedModule(model, plan, stages, signature, replan=replan, early_stop=early_stop)
