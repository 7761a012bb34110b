"""The chain executor at the cost of torch's own checkpoint (issue #19).

* With torch's early stop on (``remat.apply(..., early_stop=True)``) the executor recomputes
  less than :func:`remat.simulate` counts, so the simulated peak stays an upper bound of the
  measured one, and the gradients are the unplanned model's.
* Under ``torch.compile`` the executor traces into one graph per step (a checkpointed
  segment used to be a graph break: ``del`` of a closure cell, and the in-place input check).

Timings (remat vs torch's checkpoint at the same plan) are in
``benchmarks/executor_overhead.py`` and docs/results/executor-overhead, not here.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

from remat import Chain, ChainSegment, Plan, simulate
from remat.execute.chain import apply
from remat.measure.events import step_peak_bytes


def _plans(n: int) -> dict[str, Plan]:
    half = n // 2
    return {
        "every-stage": Plan.every_stage(),
        "blocks": Plan.from_chain_segments(
            tuple(ChainSegment(i, i, 1 < i < n) for i in range(1, n + 1))
        ),
        "flat": Plan.from_checkpoints(n, [n // 3, 2 * n // 3]),
        # the parent's recomputation stops at its last child's input (early stop rule 1)
        "trailing-child": Plan.from_chain_segments(
            (
                ChainSegment(
                    1, n, True, (ChainSegment(1, half, True), ChainSegment(half + 1, n, True))
                ),
            )
        ),
        "mixed": Plan.from_chain_segments(
            (
                ChainSegment(1, 1),
                ChainSegment(2, n, True, (ChainSegment(2, half), ChainSegment(half + 1, n, True))),
            )
        ),
    }


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("plan_name", list(_plans(12)))
def test_early_stop_peak_within_simulation_and_gradients_equal(plan_name: str) -> None:
    torch.manual_seed(0)
    n, batch, width = 12, 2048, 64
    act = batch * width * 4
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])
    x = torch.randn(batch, width)
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    # a Linear saves only its input: saved_bytes == out_bytes, no overheads
    chain = Chain(
        fwd_time=[1.0] * n,
        bwd_time=[1.0] * n,
        out_bytes=[act] * n,
        saved_bytes=[act] * n,
        input_bytes=act,
    )
    plan = _plans(n)[plan_name].for_chain(n)
    persistent = step_peak_bytes(lambda: None, model, None, x, warmup=0)

    def peak(early_stop: bool) -> int:
        planned = apply(model, plan, early_stop=early_stop)

        def train_step() -> None:
            out = planned(x)
            out.backward(torch.ones_like(out))  # δ[n], as simulate's loss

        return step_peak_bytes(train_step, model, None, x) - persistent + act  # + input

    exact, measured = peak(False), peak(True)
    simulated = simulate(chain, plan).peak_bytes
    # not in the chain: parameter-gradient temporaries (< 0.5 activation here) and the CPU
    # random number generator state each checkpoint keeps until its backward
    checkpoints = sum(1 for _ in plan.walk())
    extra = act // 2 + checkpoints * torch.get_rng_state().numel()
    assert measured <= exact, (plan.describe(), measured / act, exact / act)
    assert measured <= simulated + extra, (plan.describe(), measured / act, simulated / act)
    planned = apply(model, plan, early_stop=True)
    model.zero_grad(set_to_none=True)
    planned(x).sum().backward()
    for got, ref in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


class _Pair(nn.Module):
    """A stage whose activation is a tuple (tensor, tensor): the executor's flattening path."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)

    def forward(self, a: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, skip = a
        return torch.relu(self.f(x)) + skip, skip


@pytest.mark.parametrize("kind", ["tensor", "tuple"])
def test_compiled_planned_module_has_no_graph_break(kind: str) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    if kind == "tensor":
        model: nn.Module = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    else:
        model = nn.Sequential(*[_Pair(16) for _ in range(6)])
    x = torch.randn(4, 16, requires_grad=True)
    inputs = x if kind == "tensor" else (x, torch.randn(4, 16))
    reference = copy.deepcopy(model)
    out = reference(inputs)
    (out if kind == "tensor" else out[0]).sum().backward()
    plan = Plan.from_chain_segments(
        (
            ChainSegment(
                1, 6, True, (ChainSegment(1, 3, True), ChainSegment(4, 5), ChainSegment(6, 6, True))
            ),
        )
    )
    planned = apply(model, plan)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(planned, backend="eager", fullgraph=False)
        out = compiled(inputs)
        (out if kind == "tensor" else out[0]).sum().backward()
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
    for got, ref in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.xfail(
    strict=True,
    reason="torch.compile's partitioner keeps every activation of a nested checkpoint: the "
    "nested plan's compiled peak equals no checkpointing (docs/results/compile/README.md)",
)
def test_nested_plan_keeps_its_savings_under_torch_compile() -> None:
    torch.manual_seed(0)
    n, batch, width = 12, 2048, 64
    act = batch * width * 4
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])
    x = torch.randn(batch, width)
    plan = Plan.from_chain_segments(
        (ChainSegment(1, n, True, (ChainSegment(1, 6, True), ChainSegment(7, n, True))),)
    )
    base = step_peak_bytes(lambda: None, model, None, x, warmup=0)
    peaks = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        planned = apply(model, plan)
        run = (
            planned
            if mode == "eager"
            else torch.compile(planned, backend="aot_eager_decomp_partition")
        )

        def train_step(run: nn.Module = run) -> None:
            out = run(x)
            out.backward(torch.ones_like(out))

        peaks[mode] = step_peak_bytes(train_step, model, None, x) - base
    torch._dynamo.reset()
    # eager: 9.4 activations; compiled: 14.4, as with no checkpoint at all
    assert peaks["compiled"] <= peaks["eager"] + act // 2, (
        peaks["compiled"] / act,
        peaks["eager"] / act,
    )


def test_executor_checkpoints_what_a_hand_loop_does() -> None:
    """NOTE [ The executor's program ]: a checkpointed segment of one stage hands torch's
    checkpoint the stage module itself, as ``checkpoint(module, a)`` in a hand loop does; a
    longer one a function over its stages; a nested one its program. Every one runs with the
    same options, made once per executor, and the gradients are the unplanned model's."""
    import remat.execute.chain as chain

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    reference(x).sum().backward()
    plan = Plan.from_chain_segments(
        (
            ChainSegment(1, 1, True),
            ChainSegment(2, 3, True),
            ChainSegment(4, 6, True, (ChainSegment(4, 4, True), ChainSegment(5, 6))),
        )
    )
    planned = apply(model, plan)
    seen: list[tuple[object, dict]] = []
    real = chain.checkpoint

    def recording(fn, *args, **kwargs):
        seen.append((fn, kwargs))
        return real(fn, *args, **kwargs)

    chain.checkpoint = recording
    try:
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            seen.clear()
            planned(x).sum().backward()
    finally:
        chain.checkpoint = real
    fns = [fn for fn, _ in seen]
    # forward: stage 1, stages 2-3, stages 4-6 (in it stage 4); recomputation: 4-6 and 4
    assert fns[0] is model[0]
    assert not isinstance(fns[1], nn.Module) and not isinstance(fns[2], nn.Module)
    assert fns[3] is model[3]
    assert len(fns) == 5 and fns[4] is model[3]
    assert all(kw == {"use_reentrant": False, "preserve_rng_state": True} for _, kw in seen)
    for got, ref in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_step_state_walks_every_parameter() -> None:
    """:func:`step_state`, read on every training step, walks the module tree's own dicts:
    it sees a module registered as None, a tied weight, a frozen parameter, a parameter
    unfrozen later, a LoRA-like adapter added deep inside after planning, a gradient live at
    the forward's start, and the autocast regions the call is made in."""
    from remat.execute.chain import step_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 10))
    tied = nn.Linear(8, 10, bias=False)
    tied.weight = model[2].weight  # one parameter held by two modules
    model.append(tied)
    model.register_module("unused", None)
    model[0].weight.requires_grad_(False)
    live, trains, autocast = step_state(model)
    assert not live and autocast == ()
    every = [p.requires_grad for _, p in model.named_parameters(remove_duplicate=False)]
    assert sorted(trains) == sorted(every)  # the tied weight twice, as torch lists it so
    assert step_state(model) == (live, trains, autocast)  # the same on every call
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert step_state(model)[2] == (("cpu", torch.bfloat16),)
    model[0].weight.requires_grad_(True)
    assert step_state(model)[1] != trains
    model[0].weight.requires_grad_(False)
    model[1][0].add_module("adapter", nn.Linear(8, 2))  # deep inside a stage module
    assert len(step_state(model)[1]) == len(trains) + 2
    model[2].bias.grad = torch.zeros(10)
    assert step_state(model)[0]
    model[2].bias.requires_grad_(False)  # a gradient on a frozen parameter is not live
    assert not step_state(model)[0]


def _saved_and_loaded(module: nn.Module) -> nn.Module:
    saved = io.BytesIO()
    torch.save(module, saved)
    saved.seek(0)
    return torch.load(saved, weights_only=False)


@pytest.mark.parametrize("copied", [copy.deepcopy, _saved_and_loaded])
def test_a_copy_runs_its_own_modules(copied: Callable[[nn.Module], nn.Module]) -> None:
    """The executor's program holds objects, or closures made anew when copied: a
    ``copy.deepcopy`` of a planned module, or one saved and loaded (every kind of segment,
    batch norm's buffer guard), trains its own parameters and buffers, equal to an unplanned
    copy, and leaves the original untouched."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(8, 8), nn.BatchNorm1d(8)]
    model = nn.Sequential(*layers)
    plan = Plan.from_chain_segments(
        (
            ChainSegment(1, 1, True),
            ChainSegment(2, 3, True),
            ChainSegment(4, 6, True, (ChainSegment(4, 4, True), ChainSegment(5, 6))),
        )
    )
    planned = apply(model, plan)
    before = copy.deepcopy(model.state_dict())
    twin = copied(planned)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    twin(x).sum().backward()
    reference(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    for got, ref in zip(_grads(twin.model), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    for (key, got), ref in zip(
        twin.model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7, msg=key)


def test_input_signature_of_plain_arguments_is_the_flattened_one() -> None:
    """:func:`input_signature` skips the pytree flatten for plain tensors, scalars and None
    (read on every training step) and gives what the flatten gives, for every call shape, the
    first time and from its cache of structures."""
    import numpy as np

    from remat.guards import _flattened_signature, input_signature

    x = torch.randn(2, 3)
    ids = torch.zeros(2, 4, dtype=torch.long)
    calls: list[tuple[tuple, dict]] = [
        ((x,), {}),
        ((x, None, 3, 2.5, "mean", True), {}),
        ((), {"input_ids": ids, "labels": ids, "attention_mask": None}),
        ((ids,), {"labels": ids, "return_dict": False}),
        ((x,), {"b": x, "a": None}),
        ((x,), {"a": None, "b": x}),
        ((nn.Parameter(x),), {}),
        ((x, [x, x]), {}),  # containers: the flatten
        (({"a": x, "b": (x, 1)},), {}),
        ((x, np.float64(1.0)), {}),  # a float subclass
        ((x, torch.float16), {}),  # another object
    ]
    for args, kwargs in calls:
        want = _flattened_signature(args, kwargs)
        assert input_signature(*args, **kwargs) == want, (args, kwargs)
        assert input_signature(*args, **kwargs) == want, (args, kwargs)
    assert input_signature(x) != input_signature(x.T)
    assert input_signature(x) != input_signature(x.double())
    assert input_signature(x, 1) != input_signature(x, 2)
    assert input_signature(x, a=x) != input_signature(x, b=x)
