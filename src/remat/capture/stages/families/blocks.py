"""Any model whose forward runs a list of blocks one after another: a generic chain.

Most models are code around a loop over an ``nn.ModuleList`` (or ``nn.Sequential``) of
blocks: ``for layer in self.layers: h = layer(h, mask, positions)``. This family cuts such a
model without an adapter per family:

* **the blocks**: the model's ``ModuleList`` / ``Sequential`` (the model itself included) whose
  children cover the most parameters (then the most children), with children that are plain
  ``nn.Sequential`` flattened into theirs (stages of stages: torchvision's ConvNeXt, Swin,
  RegNet, EfficientNet ``features``); a child with ``inplace=True`` joins the block before it.
  A run of sibling submodules that a forward calls as attributes is a candidate too (two or
  more plain ``Sequential`` children in a row, flattened: timm's ResNet ``layer1..layer4``; or
  two or more children of one class in a row: ``block1``, ``block2``);
* **the prefix stage** runs the model's own ``forward`` up to the first block's call and returns
  that call's arguments: the hidden state (the first positional argument, or the keyword
  ``hidden_states``) and the rest (attention masks, position embeddings, encoder states), which
  travel with the hidden state through every block stage, as in the model;
* **block stage ``k``** calls block ``k`` with the hidden state and the rest; its output (a
  tensor, or a tuple whose first item is the hidden state and whose other items hold no tensor
  nested in a container) gives the next hidden state. Where block ``k`` takes other non-tensor
  arguments than the first block (Hugging Face Swin's stages each take their ``(H, W)``,
  computed from the stage before's output), they are recorded on the model's own run (the
  first call's check, again on the first call with each new input shape) per block and shape
  of its input, and block stage ``k`` calls it with them;
* **the suffix stage** runs the model's ``forward`` again, the code before the blocks without
  grad (and with the RNG state and batch-norm statistics put back afterwards), every block
  call answered with the last block's output without running it, and the code after the blocks
  as usual: what the model returns (with its loss, when it computes one).

The model's arguments travel in the activation tuple too (the suffix needs them). That this is
the model's computation is checked on every run where it can be, and refused
(:class:`~remat.capture.stages.StageMismatchError`; :func:`remat.auto` then takes the module-graph
path) otherwise:

* each run of the suffix checks that the blocks are called in order, exactly once each, each
  with the previous block's output and with the same other arguments as the first block (a
  chain; block ``k``'s non-tensor arguments, as the model computes them from the block
  outputs the re-run answers with, must be those block stage ``k`` used); that no value
  computed before the blocks reaches the code after them other than
  through the blocks (it would be the re-run's, without grad and, for a random op, with other
  values); and that no block's output but the last is used outside the next block (a skip
  connection, or ``output_hidden_states=True``);
* the first call (on real tensors) compares the stages' output with the model's
  (``_CompositionCheck``), which also catches control flow that depends on the blocks' values.

Known limitations: the code before the blocks runs twice (once more without grad in the
suffix): cheap for embeddings and stems. The parameters outside the blocks are attributed to
the suffix stage (their gradients counted at its backward), as the splitter cannot know without
running the model which of them the prefix uses. A model with several lists of blocks run one
after the other (an encoder and a decoder) gets a chain over one of them only. Blocks that take
a tensor the block before returns besides the hidden state (T5's position bias) are refused.
Planning on fake tensors records no arguments (the check compares values): blocks whose
arguments differ are refused there, and take the module-graph path.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from remat.capture.stages.base import (
    StageMismatchError,
    Stages,
    _CompositionCheck,
    items,
    same_forward,
)
from remat.guards import input_signature

KIND = "blocks"
_TENSOR = object()  # in a recorded call: the tensor the first block takes at this place


@dataclass(frozen=True)
class _Dropped:
    """A tensor of a block's output other than its hidden state (its shape)."""

    shape: tuple[int, ...]


_METADATA = {
    "__get__",
    "size",
    "dim",
    "numel",
    "nelement",
    "element_size",
    "stride",
    "storage_offset",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "untyped_storage",
    "data_ptr",
    "__len__",
    "get_device",
    "__hash__",
}  # tensor functions that read no value (profilers' hooks call them on every output)
_RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "normal")


def split(model: nn.Module) -> Stages | None:
    """The model as prefix + one stage per block + suffix, when it has a list of blocks."""
    found = _find_blocks(model)
    if found is None:
        return None
    path, leaves = found
    spec = _Spec(model=model, leaves=tuple(m for _, m in leaves))
    inside = {id(m) for _, m in leaves for m in m.modules()}
    outside = _outside(model, inside)
    prefix = _Prefix(spec, outside)
    groups: list[list[tuple[str, nn.Module]]] = []
    for name, leaf in leaves:
        if groups and getattr(leaf, "inplace", False) is True:
            groups[-1].append((name, leaf))
        else:
            groups.append([(name, leaf)])
    modules: list[nn.Module] = [prefix]
    names = ["(before the blocks)"]
    index = 0
    for g in groups:
        modules.append(_Block(spec, [m for _, m in g], range(index, index + len(g))))
        index += len(g)
        names.append("+".join(n for n, _ in g))
    suffix = _Suffix(spec, outside, prefix)
    modules.append(suffix)
    object.__setattr__(prefix, "around", _Around(spec, suffix))
    names.append("(after the blocks)")

    no_cache = _takes_use_cache(model)

    def prepare(*args: Any, **kwargs: Any) -> tuple:
        return (args, _without_cache(model, kwargs) if no_cache else kwargs)

    holder: list[Stages] = []
    what = f"the stages around the blocks {path!r}"
    checks: dict[tuple, _CompositionCheck] = {}

    def check(*args: Any, **kwargs: Any) -> None:
        # once; and once more for each new input shape when the blocks take arguments that
        # differ block to block (recorded for each shape: _Recording)
        key = input_signature(*args, **kwargs)
        if key not in checks and (not checks or spec.recorded):
            checks[key] = _CompositionCheck(model, holder, what, around=lambda: _Recording(spec))
        if key in checks:
            checks[key](*prepare(*args, **kwargs)[0], **prepare(*args, **kwargs)[1])

    faked: set[tuple] = set()

    def fake_check(*args: Any, **kwargs: Any) -> None:
        # a fake capture: the calls' arguments recorded on the model's own run, on fake tensors
        key = input_signature(*args, **kwargs)
        if key in faked:
            return
        a, kw = prepare(*args, **kwargs)
        try:
            with torch.no_grad(), _Recording(spec):
                model(*a, **kw)
        except Exception as err:  # noqa: BLE001 - any failure: refused, the graph path plans
            raise StageMismatchError(
                f"{what} cannot be recorded on fake tensors: {type(err).__name__}: {err}"
            ) from err
        faked.add(key)

    stages = Stages(
        tuple(modules),
        tuple(names),
        prepare,
        _finish,
        kind=KIND,
        check=check,
        fake_check=fake_check,
    )
    holder.append(stages)
    return stages


def _takes_use_cache(model: nn.Module) -> bool:
    """The forward takes ``use_cache`` (a Hugging Face model, or a wrapper such as PEFT's that
    passes its keyword arguments on to one)."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        return True
    on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return on and getattr(getattr(model, "config", None), "use_cache", None) is not None


def _without_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Training without a KV cache: ``use_cache=False`` unless the caller asked for one."""
    if kwargs.get("use_cache"):
        raise StageMismatchError(
            f"{type(model).__name__} called with use_cache=True: remat's stages train without "
            "a KV cache (the blocks do not return one); call it with use_cache=False"
        )
    return {**kwargs, "use_cache": False}


# ---------------------------------------------------------------------- finding the blocks
def _find_blocks(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """The candidate list of blocks covering the most parameters (then the most blocks, then
    the shallowest): a ``ModuleList`` / ``Sequential``, or a run of sibling submodules a
    forward calls as attributes (:func:`_runs`)."""
    best: tuple[tuple[int, int, int], str, list[tuple[str, nn.Module]]] | None = None
    for depth_name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            found = [(depth_name, _leaves(module, depth_name), depth_name.count("."))]
        else:
            found = _runs(module, depth_name)
        for path, leaves, depth in found:
            if len(leaves) < 2:
                continue
            params = {id(p): p.numel() for _, m in leaves for p in m.parameters()}
            score = (sum(params.values()), len(leaves), -depth)
            if best is None or score > best[0]:
                best = (score, path, leaves)
    if best is None:
        return None
    return best[1], best[2]


def _is_container(module: nn.Module) -> bool:
    return type(module) is nn.ModuleList or same_forward(module, nn.Sequential, "forward")


def _runs(module: nn.Module, prefix: str) -> list[tuple[str, list[tuple[str, nn.Module]], int]]:
    """Runs of consecutive submodules of ``module`` (not itself a list of blocks) that a
    forward may call one after another as attributes (``x = self.layer1(x); x =
    self.layer2(x)``, timm's ResNet): two or more plain ``Sequential`` / ``ModuleList``
    children in a row (flattened into their blocks), or two or more children of one class in
    a row (``self.block1``, ``self.block2``; not ``torch.nn``'s own layers). Whether the
    forward does call them as a chain
    is checked on every run, as for a ``ModuleList``."""
    here = prefix + "." if prefix else ""
    children = items(module)
    out: list[tuple[str, list[tuple[str, nn.Module]], int]] = []
    depth = here.count(".")
    i = 0
    while i < len(children):
        j = i + 1
        if _is_container(children[i][1]):
            while j < len(children) and _is_container(children[j][1]):
                j += 1
        elif not type(children[i][1]).__module__.startswith("torch.nn"):
            # blocks of a class of the model's own (two nn.Linear in a row are a layer and
            # its projection more often than a chain of blocks)
            cls = type(children[i][1])
            while j < len(children) and type(children[j][1]) is cls:
                j += 1
        if j - i >= 2:
            run = children[i:j]
            leaves: list[tuple[str, nn.Module]] = []
            for name, child in run:
                if _is_container(child):
                    leaves.extend(_leaves(child, here + name))
                else:
                    leaves.append((here + name, child))
            out.append((f"{here}{run[0][0]}..{run[-1][0]}", leaves, depth))
        i = j
    return out


def _leaves(container: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    here = prefix + "." if prefix else ""
    for name, child in items(container):
        if same_forward(child, nn.Sequential, "forward") and len(child) > 0:
            out.extend(_leaves(child, here + name))
        else:
            out.append((here + name, child))
    return out


def _outside(model: nn.Module, inside: set[int]) -> nn.Module:
    """The model's submodules outside the blocks (the largest ones), and its parameters held
    directly by a module on the way to the blocks (a ViT's ``cls_token``)."""
    holder = nn.Module()
    mods: list[nn.Module] = []
    loose: list[nn.Parameter] = []

    def visit(module: nn.Module) -> None:
        loose.extend(p for p in module._parameters.values() if p is not None)
        for child in module.children():
            if id(child) in inside:
                continue
            if any(id(m) in inside for m in child.modules()):
                visit(child)
            else:
                mods.append(child)

    visit(model)
    holder.mods = nn.ModuleList(mods)
    holder.loose = nn.ParameterList(loose)
    return holder


# ---------------------------------------------------------------------- the stage program
# a[0] = (model_args, model_kwargs)
# a[k] = (hidden, rest, inputs): rest = (slot, other_args, other_kwargs), inputs = a[0]
def _finish(a: Any, *args: Any, **kwargs: Any) -> Any:
    return a


@dataclass(eq=False)
class _Spec:
    """What the stages share: the model, its blocks, and the structure of a block's output."""

    model: nn.Module
    leaves: tuple[nn.Module, ...]
    outs: dict[int, Any] = field(default_factory=dict)
    """Block ``k``'s output in this step: its hidden state's shape, and the rest of a tuple
    output (tensors as :class:`_Dropped`); set by the block stages, answered by the re-run."""
    recorded: dict[tuple[int, tuple[int, ...]], list[Any]] = field(default_factory=dict)
    """The other arguments of block ``k`` (k > 0) where they differ from the first block's
    (non-tensor values only, e.g. Swin's stage dimensions), flattened, recorded on the
    model's own run by the check, per block and shape of the block's input."""
    used: dict[int, list[Any] | None] = field(default_factory=dict)
    """The recorded arguments each block stage used in this step (None: the first block's)."""

    def rest_for(self, k: int, hidden: torch.Tensor, rest: tuple) -> tuple:
        """Block ``k``'s other arguments: the first block's, or those recorded for it."""
        rec = self.recorded.get((k, tuple(hidden.shape))) if k > 0 else None
        self.used[k] = rec
        if rec is None:
            return rest
        flat, tree = tree_flatten(rest)
        if len(flat) != len(rec):
            raise StageMismatchError(
                f"{type(self.model).__name__}'s first block took other arguments than when "
                f"block {k + 1}'s were recorded: its blocks are not a chain"
            )
        return tree_unflatten(
            [f if r is _TENSOR else r for f, r in zip(flat, rec, strict=True)], tree
        )


class _Recording:
    """While the check runs the model itself: the other arguments of every block call that
    differ from the first block's in non-tensor values only (tensors must be the first
    block's own), into :attr:`_Spec.recorded`."""

    def __init__(self, spec: _Spec) -> None:
        self.spec = spec
        self.calls = 0
        self.first: tuple[list[Any], Any] | None = None

    def __enter__(self) -> _Recording:
        leaves = self.spec.leaves
        self.handles = [
            leaf.register_forward_pre_hook(self._hook, with_kwargs=True)
            for leaf in dict.fromkeys(leaves)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        spec, k = self.spec, self.calls
        self.calls += 1
        if k >= len(spec.leaves) or spec.leaves[k] is not module:
            return  # not a chain: the stages' own checks refuse it
        try:
            hidden, rest = _split_call(spec, args, kwargs)
        except StageMismatchError:
            return
        flat, tree = tree_flatten(rest)
        if k == 0:
            self.first = (flat, tree)
            return
        if self.first is None or tree != self.first[1]:
            return
        rec: list[Any] = []
        for x, x0 in zip(flat, self.first[0], strict=True):
            if isinstance(x, torch.Tensor) or isinstance(x0, torch.Tensor):
                if x is not x0:
                    return  # another tensor: not recorded (the re-run refuses it)
                rec.append(_TENSOR)
            else:
                rec.append(x)
        if not _same(flat, self.first[0]):
            spec.recorded[(k, tuple(hidden.shape))] = rec


class _Reached(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args_kwargs = (args, kwargs)


class _Holder(nn.Module):
    """A stage module holding the spec (not a submodule) and the modules outside the blocks."""

    def __init__(self, spec: _Spec, outside: nn.Module | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "spec", spec)
        if outside is not None:
            self.outside = outside


class _Prefix(_Holder):
    """The model's forward up to the first block's call: that call's arguments."""

    traceable = False
    """Hooks raised out of the model's forward: torch.compile cannot trace it into one graph
    (remat.capture.stages.base.traceable)."""

    def __init__(self, spec: _Spec, outside: nn.Module) -> None:
        super().__init__(spec, outside)
        self.used: set[int] = set()
        """ids of the modules outside the blocks that the last run called"""

    def grad_parameters(self) -> list[nn.Parameter]:
        """The parameters of the modules outside the blocks that the prefix calls (known
        after its first run; the others' gradients are the suffix's)."""
        return [p for m in self.outside.mods if id(m) in self.used for p in m.parameters()]

    def forward(self, a: tuple) -> tuple:
        args, kwargs = a
        spec = self.spec
        first = spec.leaves[0]

        def hook(module: nn.Module, bargs: tuple, bkwargs: dict) -> None:
            if module is first:
                raise _Reached(bargs, bkwargs)
            raise StageMismatchError(
                f"{type(spec.model).__name__}'s forward calls a block other than the first "
                f"({type(module).__name__}) before the first: its blocks are not a chain"
            )

        used: set[int] = set()

        def seen(module: nn.Module, _args: tuple) -> None:
            used.add(id(module))

        handles = [
            leaf.register_forward_pre_hook(hook, with_kwargs=True) for leaf in set(spec.leaves)
        ]
        handles += [m.register_forward_pre_hook(seen) for m in self.outside.mods]
        try:
            spec.model.forward(*args, **kwargs)
        except _Reached as reached:
            bargs, bkwargs = reached.args_kwargs
        else:
            raise StageMismatchError(
                f"{type(spec.model).__name__}'s forward returned without calling its blocks"
            )
        finally:
            for h in handles:
                h.remove()
        self.used = used
        return _split_call(spec, bargs, bkwargs) + (a,)


class _Suffix(_Holder):
    """The model's forward after its blocks (see the module docstring)."""

    traceable = False
    """The model's forward re-run with patched blocks and stand-in tensors: torch.compile cannot
    trace it into one graph (remat.capture.stages.base.traceable)."""

    def __init__(self, spec: _Spec, outside: nn.Module, prefix: _Prefix) -> None:
        super().__init__(spec, outside)
        object.__setattr__(self, "prefix", prefix)

    def grad_parameters(self) -> list[nn.Parameter]:
        """The parameters outside the blocks that the prefix does not call (all of them
        before its first run: their gradients counted early, never late)."""
        used = self.prefix.used
        mods = [m for m in self.outside.mods if id(m) not in used]
        return [p for m in mods for p in m.parameters()] + list(self.outside.loose)

    def forward(self, a: tuple) -> Any:
        hidden, _rest, (args, kwargs) = a
        spec = self.spec
        run = _Rerun(spec, hidden)
        with run:
            out = spec.model.forward(*args, **kwargs)
        run.finished(out)
        return out


def _split_call(spec: _Spec, args: tuple, kwargs: dict) -> tuple:
    if args and isinstance(args[0], torch.Tensor):
        return args[0], (0, args[1:], kwargs)
    if not args and isinstance(kwargs.get("hidden_states"), torch.Tensor):
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return kwargs["hidden_states"], ("hidden_states", (), rest)
    raise StageMismatchError(
        f"{type(spec.model).__name__}'s first block is not called with a tensor as its first "
        "argument (or as hidden_states=): remat cannot tell which argument the blocks pass on"
    )


def _call_block(block: nn.Module, hidden: torch.Tensor, rest: tuple) -> Any:
    slot, args, kwargs = rest
    if slot == 0:
        return block(hidden, *args, **kwargs)
    return block(*args, **{slot: hidden}, **kwargs)


class _Block(_Holder):
    """One block (or a block and the in-place modules after it) on the hidden state."""

    def __init__(self, spec: _Spec, blocks: Sequence[nn.Module], index: range) -> None:
        super().__init__(spec)
        self.blocks = nn.ModuleList(blocks)
        self.index = tuple(index)

    def forward(self, a: tuple) -> tuple:
        hidden, rest, inputs = a
        for k, block in zip(self.index, self.blocks, strict=True):
            out = _call_block(block, hidden, self.spec.rest_for(k, hidden, rest))
            hidden = self._hidden_of(k, block, out)
        return hidden, rest, inputs

    def _hidden_of(self, k: int, block: nn.Module, out: Any) -> torch.Tensor:
        spec = self.spec
        if isinstance(out, torch.Tensor):
            spec.outs[k] = (tuple(out.shape), None)
            return out
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            # other tensors (attention weights) are dropped: the suffix's re-run answers them
            # with values it refuses to see used (_Rerun)
            others = [
                _Dropped(tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in out[1:]
            ]
            if any(isinstance(t, torch.Tensor) for t in tree_flatten(others)[0]):
                raise StageMismatchError(
                    f"block {type(block).__name__} returns tensors nested in its output "
                    "besides its hidden state: not a chain remat can cut"
                )
            spec.outs[k] = (tuple(out[0].shape), (type(out), others))
            return out[0]
        raise StageMismatchError(
            f"block {type(block).__name__} returns a {type(out).__name__}; remat's generic "
            "stages need a tensor or a tuple whose first item is the hidden state"
        )


# ---------------------------------------------------------------------- answering the blocks
class _Answers:
    """What the suffix's re-run and the forward around the blocks share: the checks that the
    model's forward calls its blocks as a chain, and the answer to each call (the last block's
    output for the last, a stand-in for the others: the chain keeps no other)."""

    def __init__(self, spec: _Spec) -> None:
        self.spec = spec
        self.calls = 0
        self.first_rest: list[Any] | None = None
        self.last_out: torch.Tensor | None = None
        self.stale: list[torch.Tensor] = []

    def _called(
        self, leaf: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[int, torch.Tensor, tuple]:
        """``(k, hidden, rest)`` of the model's ``k``-th block call, checked to be the chain's."""
        spec = self.spec
        k = self.calls
        name = type(spec.model).__name__
        if k >= len(spec.leaves) or spec.leaves[k] is not leaf:
            raise StageMismatchError(
                f"{name}'s forward calls its blocks out of order or more than once (call "
                f"{k + 1} is a {type(leaf).__name__}): its blocks are not a chain"
            )
        hidden, rest = _split_call(spec, args, kwargs)
        flat = tree_flatten(rest)[0]
        if k == 0:
            self.first_rest = flat
        else:
            if hidden is not self.last_out:
                raise StageMismatchError(
                    f"{name}'s block {k + 1} is not called with block {k}'s output: its "
                    "blocks are not a chain (code runs between them)"
                )
            first = self.first_rest or []
            rec = spec.used.get(k)  # what block stage k was called with in this step
            if rec is not None and len(rec) == len(first):
                first = [f if r is _TENSOR else r for f, r in zip(first, rec, strict=True)]
            if not _same(flat, first):
                raise StageMismatchError(
                    f"{name}'s block {k + 1} is called with other arguments than the first "
                    "block (besides the hidden state): its blocks are not a chain"
                )
        self.calls += 1
        return k, hidden, rest

    def _reply(self, k: int, last: torch.Tensor) -> Any:
        """The answer to block ``k``'s call, ``last`` the last block's output."""
        spec = self.spec
        if k not in spec.outs:
            raise StageMismatchError(
                f"{type(spec.model).__name__}'s block {k + 1} did not run before the suffix"
            )
        shape, template = spec.outs[k]
        out = last if k == len(spec.leaves) - 1 else self._stand_in(last, shape)
        self.last_out = out
        if template is None:
            return out
        cls, others = template
        seq = [
            out,
            *(self._stand_in(last, t.shape) if isinstance(t, _Dropped) else t for t in others),
        ]
        return tuple(seq) if cls is tuple else cls(seq)

    def _stand_in(self, last: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def finished(self, out: Any) -> None:
        name = type(self.spec.model).__name__
        if self.calls != len(self.spec.leaves):
            raise StageMismatchError(
                f"{name}'s forward called {self.calls} of its {len(self.spec.leaves)} blocks: "
                "its blocks are not a chain"
            )
        if any(t is s for t in tree_flatten(out)[0] for s in self.stale):
            raise StageMismatchError(
                f"{name} returns the output of a block other than the last "
                "(output_hidden_states=True?): remat's stages cannot return it"
            )


class _Rerun(_Answers):
    """Patches the blocks to answer with the last block's output while the model's forward
    re-runs; guards that this is the model's computation (module docstring)."""

    def __init__(self, spec: _Spec, hidden: torch.Tensor) -> None:
        super().__init__(spec)
        self.hidden = hidden
        self.guard: _Guard | None = None

    def __enter__(self) -> None:
        spec = self.spec
        self.grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        fake = _is_fake(self.hidden)
        self.rng = None if fake else torch.get_rng_state()
        self.cuda = (
            (self.hidden.device, torch.cuda.get_rng_state(self.hidden.device))
            if not fake and self.hidden.device.type == "cuda"
            else None
        )
        self.frozen = _freeze_norms(_norms_outside(spec))
        self.patched = []
        for leaf in dict.fromkeys(spec.leaves):
            leaf.forward = self._stub(leaf)  # type: ignore[method-assign]
            self.patched.append(leaf)
        if not torch.compiler.is_compiling():
            self.guard = _Guard(spec)
            self.guard.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.guard is not None:
            self.guard.__exit__(*exc)
        for leaf in self.patched:
            del leaf.forward
        self._restore()

    def _restore(self) -> None:
        if self.frozen is not None:
            self.frozen()
            self.frozen = None
        torch.set_grad_enabled(self.grad)

    def _stub(self, leaf: nn.Module) -> Callable[..., Any]:
        def stub(*args: Any, **kwargs: Any) -> Any:
            return self._answer(leaf, args, kwargs)

        return stub

    def _answer(self, leaf: nn.Module, args: tuple, kwargs: dict) -> Any:
        k, _hidden, _rest = self._called(leaf, args, kwargs)
        if k == 0:
            # the code before the blocks is done: back to the RNG state and statistics the
            # prefix left, with grad, for the code after the blocks
            if self.rng is not None:
                torch.set_rng_state(self.rng)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda[1], self.cuda[0])
            self._restore()
            if self.guard is not None:
                self.guard.phase = "after"
        return self._reply(k, self.hidden)

    def _stand_in(self, last: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor standing for a block output the chain did not keep, of its shape (a view of
        the last block's output, no memory of its own): using its values is refused."""
        if torch.compiler.is_compiling():
            # (no guard's torch function to step around; dynamo breaks the graph at
            # DisableTorchFunction, and compiled the rest as a frame of its own, once per
            # length of ``stale``: past the recompile limit it ran eagerly)
            out = _expanded(last, shape)
        else:
            with torch._C.DisableTorchFunction():
                out = _expanded(last, shape)
        self.stale.append(out)
        if self.guard is not None:
            self.guard.stale[out] = True
        return out


def _expanded(last: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``last`` detached, as a view of ``shape`` with no memory of its own where it has another."""
    out = last.detach()
    if tuple(out.shape) != shape:
        out = out.as_strided(shape, (0,) * len(shape), out.storage_offset())
    return out


# NOTE [ The model's forward around the blocks ]: in a one-graph step (remat.execute.chain,
# NOTE [ One compiled graph ]) whose plan stores the first and the last stage, the stages
# need not run apart: the step runs the model's own forward once, traced into the one graph,
# with each block's ``forward`` patched (outside the graph) to answer as the suffix's re-run
# does, except that the first block's call runs the plan's middle (every block stage, as the
# plan checkpoints them) on its arguments. So the code before the blocks runs once, with
# grad (no re-run, no RNG or batch-norm statistics put back), and the code after them on
# the last block's output. The chain's checks on the calls run while traced; the composition
# check on each new input shape runs the stages eagerly, guard included, before. Other block
# outputs are answered with a stand-in of no memory (a zero expanded to their shape). A
# step with an end checkpointed runs the ends apart (NOTE [ Stages outside the graph ]).
# BERT tiny on the CPU (inductor), step over eager's: 0.635 against 1.162 with the ends apart
# and torch.compile's 0.575 (docs/results/compile/blocks-ends).
class _Around(_Answers):
    """Runs the model's forward around the blocks (NOTE [ The model's forward around the
    blocks ]): :func:`remat.capture.stages.base.around` hands it to the executor."""

    def __init__(self, spec: _Spec, last: nn.Module) -> None:
        super().__init__(spec)
        self.last = last
        """The stage module the forward runs up to (the suffix)."""
        self.stubs = [(leaf, _AroundStub(self, leaf)) for leaf in dict.fromkeys(spec.leaves)]
        self.middle: Callable[[Any], Any] | None = None
        self.inside = False
        self.inputs: Any = None
        self.output: torch.Tensor | None = None

    @contextlib.contextmanager
    def patched(self, middle: Callable[[Any], Any]) -> Iterator[None]:
        """The blocks answer the model's forward, ``middle`` running the stages between."""
        self.middle, self.inside = middle, False
        for leaf, stub in self.stubs:
            leaf.forward = stub  # type: ignore[method-assign]
        try:
            yield
        finally:
            for leaf, _ in self.stubs:
                del leaf.forward
            self.middle, self.inputs, self.output = None, None, None

    def run(self, a0: tuple) -> Any:
        """The model's output on ``a0`` (the first stage's input: its arguments)."""
        self.calls, self.stale, self.inputs = 0, [], a0
        args, kwargs = a0
        out = self.spec.model.forward(*args, **kwargs)
        self.finished(out)
        self.inputs, self.output, self.last_out, self.stale = None, None, None, []
        return out

    def answer(self, leaf: nn.Module, args: tuple, kwargs: dict) -> Any:
        k, hidden, rest = self._called(leaf, args, kwargs)
        if k == 0:
            assert self.middle is not None
            self.inside = True
            self.output = self.middle((hidden, rest, self.inputs))[0]
            self.inside = False
        assert self.output is not None
        return self._reply(k, self.output)

    def _stand_in(self, last: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        out = last.new_zeros(()).expand(shape)
        self.stale.append(out)
        return out


class _AroundStub:
    """A block's ``forward`` while :class:`_Around` runs the model (an object, not a closure:
    a copy of the planned module gets its own)."""

    def __init__(self, around: _Around, leaf: nn.Module) -> None:
        self.around = around
        self.leaf = leaf

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.around.inside:  # the middle's block stages call the block itself
            return type(self.leaf).forward(self.leaf, *args, **kwargs)
        return self.around.answer(self.leaf, args, kwargs)


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return False
        try:
            if not bool(x == y):
                return False
        except Exception:  # noqa: BLE001 - an object without equality: not the same
            return False
    return True


class _Guard(TorchFunctionMode):
    """During the suffix's re-run: marks the values the code before the blocks computes from
    parameters, gradients or the RNG (the re-run's differ from the prefix's in grad or value),
    and refuses any use of them, or of a block's output other than the last, after the blocks
    started."""

    def __init__(self, spec: _Spec) -> None:
        super().__init__()
        self.spec = spec
        self.phase = "before"
        self.marked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.stale: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self.phase == "before":
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if any(t.requires_grad or t in self.marked for t in tensors) or any(
                r in name for r in _RANDOM
            ):
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.marked[t] = True
            return out
        if getattr(func, "__name__", "") in _METADATA:  # no use of the values
            return func(*args, **kwargs)
        for t in tensors:
            if t in self.stale:
                raise StageMismatchError(
                    f"{type(self.spec.model).__name__}'s forward uses a block's output other "
                    f"than the last outside the next block ({getattr(func, '__name__', func)}: "
                    "a skip connection?): its blocks are not a chain"
                )
            if t in self.marked:
                raise StageMismatchError(
                    f"{type(self.spec.model).__name__}'s code after its blocks uses a value "
                    "computed before them, other than through the blocks "
                    f"({getattr(func, '__name__', func)}): remat's generic stages cannot "
                    "give it its gradient"
                )
        return func(*args, **kwargs)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _norms_outside(spec: _Spec) -> list[nn.Module]:
    inside = {id(m) for leaf in spec.leaves for m in leaf.modules()}
    return [
        m
        for m in spec.model.modules()
        if id(m) not in inside
        and isinstance(m, nn.modules.batchnorm._NormBase)
        and m.track_running_stats
        and m.running_mean is not None
        and m.training
    ]


def _freeze_norms(norms: list[nn.Module]) -> Callable[[], None] | None:
    """The re-run's batch norms update throw-away copies of their running statistics."""
    if not norms:
        return None
    saved = [(m, m.running_mean, m.running_var, m.num_batches_tracked) for m in norms]
    for m in norms:
        m.running_mean = m.running_mean.clone()
        m.running_var = m.running_var.clone()
        if m.num_batches_tracked is not None:
            m.num_batches_tracked = m.num_batches_tracked.clone()

    def restore() -> None:
        for m, mean, var, count in saved:
            m.running_mean, m.running_var, m.num_batches_tracked = mean, var, count

    return restore
