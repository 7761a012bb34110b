"""The generic part of the stage splitter: the :class:`Stages` type, the plain sequential run,
and the helpers the family adapters (:mod:`remat.capture.stages.families`) and the ``nn.Sequential``
splitter share. See :mod:`remat.capture.stages` for what a stage program is.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.core.errors import UnsupportedModelError
from remat.guards import BatchCopy, BufferSnapshot

SUPPORTED_HELP = (
    "remat can cut these models into stages automatically: any nn.Sequential (forward not "
    "overridden), torchvision ResNet / VGG / AlexNet / MobileNetV2 / MobileNetV3, Hugging Face "
    "GPT2LMHeadModel, LlamaForCausalLM and MistralForCausalLM, and any model whose forward "
    "runs a ModuleList or Sequential of blocks one after another, or sibling stages called as "
    "attributes (self.layer1(x), self.layer2(x), ...) (the code before and after them as two "
    "more stages; checked on the first call). For another model, name the stage "
    "boundaries: split_stages(model, stages=['layer1', 'layer2', ...]) (or "
    "remat.apply(..., stages=[...])) with the fully-qualified names (model.named_modules()) of "
    "submodules that, applied in "
    "order to the model's single input, compute exactly model(x); join several submodules into "
    "one stage with '+', e.g. 'conv1+bn1+relu'. The composition is checked against the model "
    "on the first call."
)


class StageMismatchError(UnsupportedModelError):
    """User-named stages whose composition does not compute what the model computes."""


@dataclass(frozen=True)
class Stages:
    """A model as a sequential program (see the module docstring)."""

    modules: tuple[nn.Module, ...]
    """Stage ``i`` (1-based) is ``modules[i-1]``: ``a[i] = modules[i-1](a[i-1])``."""
    names: tuple[str, ...]
    """Module FQNs (``"a+b"`` for groups) or descriptive names, for reports."""
    prepare: Callable[..., Any]
    """``prepare(*args, **kwargs) -> a[0]`` from what ``model(...)`` is called with."""
    finish: Callable[..., Any]
    """``finish(a[n], *args, **kwargs)`` -> what ``model(*args, **kwargs)`` returns."""
    kind: str = "custom"
    """Which structure was recognised: ``"sequential"``, ``"resnet"``, ``"gpt2"``, ``"named"``..."""
    check: Callable[..., None] | None = field(default=None, compare=False, repr=False)
    """Called with the model's arguments before a run; verifies user-named stages once."""
    fake_check: Callable[..., None] | None = field(default=None, compare=False, repr=False)
    """Called instead of ``check`` with the model's arguments as fake tensors (a fake capture:
    no values to compare); the generic blocks record their calls' arguments with it."""
    split_again: Callable[[], Stages] | None = field(default=None, compare=False, repr=False)
    """Cuts the model again the same way (automatic or by the same names), after one of its
    submodules was replaced; None for hand-made stages."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "names", tuple(self.names))
        if len(self.modules) != len(self.names):
            raise ValueError(f"{len(self.modules)} stage modules but {len(self.names)} names")
        if not self.modules:
            raise UnsupportedModelError("a model needs at least one stage")

    @property
    def n(self) -> int:
        """Number of stages."""
        return len(self.modules)

    def describe(self) -> str:
        return f"{self.kind}: {self.n} stages: " + ", ".join(self.names)

    @property
    def fingerprint(self) -> str:
        """A short hash of the stages' structure: their count and, per stage, the types of its
        modules and the shapes of its parameters (not values, dtypes or devices). Plans made
        from a captured chain record it, and :func:`remat.apply` refuses a plan made for other
        stages."""
        parts = []
        for module in self.modules:
            mods = [type(m).__qualname__ for m in module.modules()]
            shapes = [tuple(p.shape) for p in module.parameters()]
            parts.append(f"{mods}{shapes}")
        text = f"{self.n}|" + "|".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def traceable(module: Any) -> bool:
    """Whether torch.compile can trace stage ``module`` into one graph: false where its class
    says ``traceable = False`` (the blocks family's first and last stages run the model's own
    forward with hooks and patched blocks); a one-graph step runs such a stage outside its
    graph (NOTE [ Stages outside the graph ] in remat.execute.chain)."""
    return getattr(module, "traceable", True)


def around(first: Any, last: Any) -> Any:
    """What runs the model's own forward once around the stages between stage modules
    ``first`` and ``last``, where ``first`` offers one for ``last`` (the blocks family's first
    stage, for its last: NOTE [ The model's forward around the blocks ] in
    remat.capture.stages.families.blocks); else None. It has ``patched(middle)``, a context
    entered outside the compiled graph, and ``run(a0)``, traced: the model's output, with
    ``middle(a1)`` (``a1``: the first stage's output) in place of the stages between."""
    found = getattr(first, "around", None)
    return found if found is not None and found.last is last else None


def run_stages(stages: Stages, *args: Any, **kwargs: Any) -> Any:
    """Run the stages plainly in order: equals ``model(*args, **kwargs)``."""
    if stages.check is not None:
        stages.check(*args, **kwargs)
    return _run_plain(stages, args, kwargs)


def _run_plain(stages: Stages, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = stages.prepare(*args, **kwargs)
    for module in stages.modules:
        a = module(a)
    return stages.finish(a, *args, **kwargs)


# ---------------------------------------------------------------------- helpers
def grad_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients a stage's backward makes: ``module.parameters()``, or
    what the stage module says (``module.grad_parameters()``: a generic stage that holds more
    modules than its backward reaches, :mod:`remat.capture.stages.families.blocks`)."""
    own = getattr(module, "grad_parameters", None)
    return list(own() if callable(own) else module.parameters())


def items(sequence: nn.Module) -> list[tuple[str, nn.Module]]:
    """A ``Sequential``'s (or ``ModuleList``'s) children in the order its ``forward`` runs
    them, one entry per occurrence: ``named_children()`` lists a module object that appears
    twice only once."""
    return [(name, m) for name, m in sequence._modules.items() if m is not None]


def identity_prepare(*args: Any, **kwargs: Any) -> Any:
    if len(args) != 1 or kwargs:
        raise TypeError(
            "this model's stages take exactly one positional input (called as model(x)); got "
            f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
        )
    return args[0]


def identity_finish(a: Any, *args: Any, **kwargs: Any) -> Any:
    return a


def same_forward(model: nn.Module, cls: type, *methods: str) -> bool:
    """``model`` is a ``cls`` whose listed methods are not overridden by a subclass."""
    if not isinstance(model, cls):
        return False
    return all(getattr(type(model), m) is getattr(cls, m) for m in methods)


def _is_inplace(module: nn.Module) -> bool:
    return getattr(module, "inplace", False) is True


def group(modules: Sequence[nn.Module]) -> nn.Module:
    """One stage made of several modules applied in order (shares them, copies nothing)."""
    return modules[0] if len(modules) == 1 else nn.Sequential(*modules)


def children_stages(
    children: Sequence[tuple[str, nn.Module]],
) -> tuple[list[nn.Module], list[str]]:
    """Children as stages; in-place children join the stage before them."""
    groups: list[list[tuple[str, nn.Module]]] = []
    for name, child in children:
        if groups and _is_inplace(child):
            groups[-1].append((name, child))
        else:
            groups.append([(name, child)])
    modules = [group([m for _, m in g]) for g in groups]
    names = ["+".join(n for n, _ in g) for g in groups]
    return modules, names


# ---------------------------------------------------------------------- nn.Sequential
def split_sequential(model: nn.Module) -> Stages | None:
    if not same_forward(model, nn.Sequential, "forward"):
        return None
    if len(model) == 0:
        raise UnsupportedModelError("an empty nn.Sequential has no stages")
    modules, names = children_stages(items(model))
    return Stages(
        tuple(modules), tuple(names), identity_prepare, identity_finish, kind="sequential"
    )


# ---------------------------------------------------------------------- the first-call check
class _CompositionCheck:
    """Verifies once, on the first inputs, that stages (user-named ones, or the generic ones
    of :mod:`remat.capture.stages.families.blocks`) compute ``model(x)``.

    Runs both without grad, from the same RNG state and the same input values (a model may
    write into its input), and restores the RNG state, every buffer (batch-norm statistics)
    and the input values afterwards, so the check has no side effects.
    """

    def __init__(
        self,
        model: nn.Module,
        holder: list[Stages],
        what: str | None = None,
        around: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.model = model
        self.holder = holder
        self.what = what  # how the errors name the stages (default: the named stages)
        self.around = around  # a context around the model's own run (it records the calls)
        self.done = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.done:
            return
        inputs = BatchCopy((args, kwargs), snapshot=True)
        stages = self.holder[0]
        what = self.what or f"the named stages {list(stages.names)}"
        model = self.model
        buffers = BufferSnapshot(model)
        devices = sorted({b.device for b in model.parameters() if b.device.type == "cuda"}, key=str)
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                state = torch.get_rng_state()
                cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
                with self.around() if self.around is not None else contextlib.nullcontext():
                    expected = model(*args, **kwargs)
                buffers.restore()
                torch.set_rng_state(state)
                for d, s in zip(devices, cuda_states, strict=True):
                    torch.cuda.set_rng_state(s, d)
                inputs.restore()
                try:
                    got = _run_plain(stages, args, kwargs)
                except Exception as err:
                    raise StageMismatchError(
                        f"{what} cannot be run in order on the "
                        f"model's input: {type(err).__name__}: {err}. " + SUPPORTED_HELP
                    ) from err
        finally:
            buffers.restore()
            inputs.restore()
        problem = _compare_outputs(expected, got)
        if problem is not None:
            raise StageMismatchError(
                f"{what} do not compute what the model computes "
                f"({problem}): the model's forward does more than call these submodules in "
                "order (functional ops such as torch.flatten, residual additions, or several "
                "inputs). Name other boundaries (a parent module covering that code), or see: "
                + SUPPORTED_HELP
            )
        self.done = True


def _compare_outputs(expected: Any, got: Any, path: str = "output") -> str | None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if expected.shape != got.shape or expected.dtype != got.dtype:
            return (
                f"{path}: expected {tuple(expected.shape)} {expected.dtype}, got "
                f"{tuple(got.shape)} {got.dtype}"
            )
        if expected.is_floating_point() or expected.is_complex():
            ok = torch.allclose(expected, got, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            ok = torch.equal(expected, got)
        return None if ok else f"{path}: values differ"
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return f"{path}: different keys"
        for k in expected:
            problem = _compare_outputs(expected[k], got[k], f"{path}[{k!r}]")
            if problem:
                return problem
        return None
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(expected) != len(got):
            return f"{path}: different structure"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = _compare_outputs(e, g, f"{path}[{i}]")
            if problem:
                return problem
        return None
    with contextlib.suppress(Exception):
        if expected == got:
            return None
    return f"{path}: {expected!r} != {got!r}"
