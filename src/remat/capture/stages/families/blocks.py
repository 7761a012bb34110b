"""Any model whose forward runs a list of blocks one after another: a generic chain.

Most models are code around a loop over an ``nn.ModuleList`` (or ``nn.Sequential``) of
blocks: ``for layer in self.layers: h = layer(h, mask, positions)``. This family cuts such a
model without an adapter per family:

* **the blocks**: the model's ``ModuleList`` / ``Sequential`` (the model itself included) whose
  children cover the most parameters (then the most children), with children that are plain
  ``nn.Sequential`` flattened into theirs (stages of stages: torchvision's ConvNeXt, Swin,
  RegNet, EfficientNet ``features``); a child with ``inplace=True`` joins the block before it;
* **the prefix stage** runs the model's own ``forward`` up to the first block's call and returns
  that call's arguments: the hidden state (the first positional argument, or the keyword
  ``hidden_states``) and the rest (attention masks, position embeddings, encoder states), which
  travel with the hidden state through every block stage, as in the model;
* **block stage ``k``** calls block ``k`` with the hidden state and the rest; its output (a
  tensor, or a tuple whose first item is the hidden state and whose other items hold no tensor)
  gives the next hidden state;
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
  chain); that no value computed before the blocks reaches the code after them other than
  through the blocks (it would be the re-run's, without grad and, for a random op, with other
  values); and that no block's output but the last is used outside the next block (a skip
  connection, or ``output_hidden_states=True``);
* the first call (on real tensors) compares the stages' output with the model's
  (``_CompositionCheck``), which also catches control flow that depends on the blocks' values.

Known limitations: the code before the blocks runs twice (once more without grad in the
suffix): cheap for embeddings and stems. The parameters outside the blocks are attributed to
the suffix stage (their gradients counted at its backward), as the splitter cannot know without
running the model which of them the prefix uses. A model with several lists of blocks run one
after the other (an encoder and a decoder) gets a chain over one of them only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from remat.capture.stages.base import (
    StageMismatchError,
    Stages,
    _CompositionCheck,
    items,
    same_forward,
)

KIND = "blocks"
_DROPPED = object()  # a tensor of a block's output other than its hidden state
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
    for g in groups:
        modules.append(_Block(spec, [m for _, m in g]))
        names.append("+".join(n for n, _ in g))
    modules.append(_Suffix(spec, outside, prefix))
    names.append("(after the blocks)")

    no_cache = _takes_use_cache(model)

    def prepare(*args: Any, **kwargs: Any) -> tuple:
        return (args, _without_cache(model, kwargs) if no_cache else kwargs)

    holder: list[Stages] = []
    compare = _CompositionCheck(model, holder, what=f"the stages around the blocks {path!r}")

    def check(*args: Any, **kwargs: Any) -> None:
        compare(*prepare(*args, **kwargs)[0], **prepare(*args, **kwargs)[1])

    stages = Stages(tuple(modules), tuple(names), prepare, _finish, kind=KIND, check=check)
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
    best: tuple[tuple[int, int, int], str, list[tuple[str, nn.Module]]] | None = None
    for depth_name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        leaves = _leaves(module, depth_name)
        if len(leaves) < 2:
            continue
        params = {id(p): p.numel() for _, m in leaves for p in m.parameters()}
        score = (sum(params.values()), len(leaves), -depth_name.count("."))
        if best is None or score > best[0]:
            best = (score, depth_name, leaves)
    if best is None:
        return None
    return best[1], best[2]


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
    out_template: Any = None
    """A block's output with its hidden state replaced by None (set by the block stages)."""
    out_kind: str = "tensor"
    norms: list[nn.Module] = field(default_factory=list)


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

    def __init__(self, spec: _Spec, blocks: Sequence[nn.Module]) -> None:
        super().__init__(spec)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, a: tuple) -> tuple:
        hidden, rest, inputs = a
        for block in self.blocks:
            out = _call_block(block, hidden, rest)
            hidden = self._hidden_of(block, out)
        return hidden, rest, inputs

    def _hidden_of(self, block: nn.Module, out: Any) -> torch.Tensor:
        spec = self.spec
        if isinstance(out, torch.Tensor):
            spec.out_template, spec.out_kind = None, "tensor"
            return out
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            # other tensors (attention weights) are dropped: the suffix's re-run answers them
            # with values it refuses to see used (_Rerun)
            others = [_DROPPED if isinstance(t, torch.Tensor) else t for t in out[1:]]
            if any(isinstance(t, torch.Tensor) for t in tree_flatten(others)[0]):
                raise StageMismatchError(
                    f"block {type(block).__name__} returns tensors nested in its output "
                    "besides its hidden state: not a chain remat can cut"
                )
            spec.out_template, spec.out_kind = (type(out), others), "sequence"
            return out[0]
        raise StageMismatchError(
            f"block {type(block).__name__} returns a {type(out).__name__}; remat's generic "
            "stages need a tensor or a tuple whose first item is the hidden state"
        )


# ---------------------------------------------------------------------- the suffix's re-run
class _Rerun:
    """Patches the blocks to answer with the last block's output while the model's forward
    re-runs; guards that this is the model's computation (module docstring)."""

    def __init__(self, spec: _Spec, hidden: torch.Tensor) -> None:
        self.spec = spec
        self.hidden = hidden
        self.calls = 0
        self.first_rest: list[Any] | None = None
        self.last_out: torch.Tensor | None = None
        self.stale: list[torch.Tensor] = []
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
            # the code before the blocks is done: back to the RNG state and statistics the
            # prefix left, with grad, for the code after the blocks
            if self.rng is not None:
                torch.set_rng_state(self.rng)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda[1], self.cuda[0])
            self._restore()
            if self.guard is not None:
                self.guard.phase = "after"
        else:
            if hidden is not self.last_out:
                raise StageMismatchError(
                    f"{name}'s block {k + 1} is not called with block {k}'s output: its "
                    "blocks are not a chain (code runs between them)"
                )
            if not _same(flat, self.first_rest or []):
                raise StageMismatchError(
                    f"{name}'s block {k + 1} is called with other arguments than the first "
                    "block (besides the hidden state): its blocks are not a chain"
                )
        self.calls += 1
        last = self.calls == len(spec.leaves)
        out = self.hidden if last else self._stale()
        self.last_out = out
        if spec.out_kind == "tensor":
            return out
        cls, others = spec.out_template
        seq = [out, *(self._stale() if t is _DROPPED else t for t in others)]
        return tuple(seq) if cls is tuple else cls(seq)

    def _stale(self) -> torch.Tensor:
        """A tensor standing for a block output the chain did not keep: using it is refused."""
        with torch._C.DisableTorchFunction():
            out = self.hidden.detach()
        self.stale.append(out)
        if self.guard is not None:
            self.guard.stale[out] = True
        return out

    def finished(self, out: Any) -> None:
        name = type(self.spec.model).__name__
        if self.calls != len(self.spec.leaves):
            raise StageMismatchError(
                f"{name}'s forward called {self.calls} of its {len(self.spec.leaves)} blocks: "
                "its blocks are not a chain"
            )
        stale = {id(t) for t in self.stale}
        if any(id(t) in stale for t in tree_flatten(out)[0]):
            raise StageMismatchError(
                f"{name} returns the output of a block other than the last "
                "(output_hidden_states=True?): remat's stages cannot return it"
            )


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
