"""``compile=True``: the planned model's training forward as one ``torch.compile`` graph in which
remat's plan decides what is recomputed (runtime.py, NOTE [ Compiled plans ]).

Gradients are compared with the eager, unplanned model at ``rtol=1e-4, atol=1e-5`` (CPU fp32:
inductor's fused kernels sum in another order). Peaks are the allocator's
(:func:`remat.measure.step_peak_bytes`, which sees inside compiled code). Inductor's C++
compile takes seconds per graph on a CPU, so one test compiles with inductor; the others use
``aot_eager_decomp_partition`` (dynamo, AOTAutograd and the same min-cut partitioner, run
eagerly): what is saved and recomputed is decided as under inductor.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import remat
from remat.errors import UnsupportedModelError
from remat.measure import step_peak_bytes
from remat.plans import Segment

TOL = {"rtol": 1e-4, "atol": 1e-5}
PARTITIONER = {"backend": "aot_eager_decomp_partition"}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def mlp(width: int = 64, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, name, 0.0)  # compiled dropout draws other masks than eager's
    model = GPT2LMHeadModel(config)
    # (without it, transformers' loss_function logs a warning_once on each call, a graph break
    # in the loss that remat warns about: the stages still compile as one graph)
    model.loss_type = "ForCausalLM"
    return model


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def assert_equal_grads(model: nn.Module, reference: nn.Module) -> None:
    got, want = grads_of(model), grads_of(reference)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def step_of(module: nn.Module, loss: Any, batch: Any) -> Any:
    def step() -> None:
        loss(module, batch).backward()
        for p in module.parameters():
            p.grad = None

    return step


def graphs_and_breaks() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_mlp_compiled_with_inductor_one_graph_equal_gradients_within_budget() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(256, 64)

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    planned, summary = remat.auto(
        model, x, loss_fn=loss, budget="70%", compile=True, loop="loss-only"
    )
    assert any(seg.checkpoint for seg in planned.plan.walk())
    loss(planned, x).backward()
    assert graphs_and_breaks() == (1, 0)  # the whole planned forward: one graph, no break
    loss(reference, x).backward()
    assert_equal_grads(model, reference)
    measured = step_peak_bytes(step_of(planned, loss, x), model, None, x)
    assert measured <= summary.budget_bytes, (measured, summary.budget_bytes)


@pytest.mark.parametrize("checkpoints", [[3, 6, 9], "nested"])
def test_compiled_plan_recomputes_its_segments(checkpoints: Any) -> None:
    # the partitioner saves a checkpointed segment's input only: fewer saved bytes than the
    # compiled unplanned model, and the gradients of eager; nested segments too
    model = mlp(depth=6)
    reference = copy.deepcopy(model)
    x = torch.randn(128, 64)
    if checkpoints == "nested":
        inner = (Segment(3, 5), Segment(6, 8, True))
        plan = remat.Plan((Segment(1, 2), Segment(3, 8, True, inner), Segment(9, 12, True)))
    else:
        plan = remat.Plan.from_checkpoints(12, checkpoints)

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum()

    planned = remat.apply(model, plan, compile=PARTITIONER)
    loss(planned, x).backward()
    assert graphs_and_breaks()[1] == 0
    loss(reference, x).backward()
    assert_equal_grads(model, reference)
    plain = torch.compile(reference, **PARTITIONER)
    planned_peak = step_peak_bytes(step_of(planned, loss, x), model, None, x)
    plain_peak = step_peak_bytes(step_of(plain, loss, x), reference, None, x)
    assert planned_peak < plain_peak, (planned_peak, plain_peak)


def test_gpt2_compiled_within_budget_and_replanned_for_a_new_batch_size() -> None:
    model = gpt2()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (4, 32))
    batch = {"input_ids": ids, "labels": ids}

    def loss(m: nn.Module, b: dict) -> torch.Tensor:
        return m(**b).loss

    planned, summary = remat.auto(model, batch, budget="80%", compile=PARTITIONER, loop="loss-only")
    assert any(seg.checkpoint for seg in planned.plan.walk())
    loss(planned, batch).backward()
    assert graphs_and_breaks() == (1, 0)
    loss(reference, batch).backward()
    assert_equal_grads(model, reference)
    measured = step_peak_bytes(step_of(planned, loss, batch), model, None, batch)
    assert measured <= summary.budget_bytes, (measured, summary.budget_bytes)

    # another batch size: re-planned under the same budget and compiled for it (its own graph)
    ids2 = torch.randint(0, 128, (2, 32))
    batch2 = {"input_ids": ids2, "labels": ids2}
    first_plan = planned.plan
    loss(planned, batch2).backward()
    assert planned.signature != () and planned.plan is not first_plan
    assert graphs_and_breaks() == (2, 0)
    loss(reference, batch2).backward()
    assert_equal_grads(model, reference)
    measured2 = step_peak_bytes(step_of(planned, loss, batch2), model, None, batch2)
    assert measured2 <= summary.budget_bytes, (measured2, summary.budget_bytes)
    loss(planned, batch).backward()  # back to the first shape: its graph, no new compile
    assert graphs_and_breaks() == (2, 0)
    model.zero_grad(set_to_none=True)


class Branchy(nn.Module):
    """Not a chain: two branches meet in a product (planned as a module graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(32, 64), nn.Tanh())
        self.a = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.a(h) * self.b(h))


def test_graph_path_refuses_compile_and_torch_compile_runs_it_eagerly() -> None:
    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    with pytest.raises(UnsupportedModelError, match="compile=True needs a model that splits"):
        remat.auto(model, x, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not a chain"
        planned, _ = remat.auto(model, x)
    assert planned.plan.segments  # something is recomputed
    # was GraphExecutionError "torch call 10 of the forward is mul.Tensor but the trace has mul"
    torch.compile(planned, backend="aot_eager")(x).sum().backward()
    reference(x).sum().backward()
    assert_equal_grads(model, reference)


def test_compile_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="compile must be True, False or a mapping"):
        remat.apply(mlp(depth=1), remat.Plan.none(), compile="yes")  # type: ignore[arg-type]
