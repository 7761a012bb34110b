"""Never silently wrong, never a crash: the executors on inputs and models off the main path.

* batch norm inside a checkpointed segment with a second backward (``retain_graph=True``) or a
  double backward (``create_graph=True``): every backward that needs the segment recomputes it
  again, gradients equal eager's, running statistics updated once per forward;
* Hugging Face models with ``attn_implementation="eager"`` (their masks are built under
  ``torch.vmap``) on the graph path;
* batches holding floats, ints and bools; a ``loss_fn`` that calls the model twice; a block that
  writes into its input at a stage boundary.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import remat
from remat import ChainSegment, Plan
from remat.capture.graph import trace_graph
from remat.execute.chain import InPlaceInputError
from remat.execute.graph import apply_graph
from remat.measure.events import step_peak_bytes


def assert_grads_equal(ref: nn.Module, got: nn.Module, rtol: float = 1e-5, atol: float = 1e-6):
    pairs = list(zip(ref.named_parameters(), got.named_parameters(), strict=True))
    assert any(p.grad is not None for (_, p), _ in pairs)
    for (name, p0), (_, p1) in pairs:
        if p0.grad is None:
            assert p1.grad is None, name
        else:
            torch.testing.assert_close(p1.grad, p0.grad, rtol=rtol, atol=atol, msg=name)


def assert_buffers_equal(ref: nn.Module, got: nn.Module) -> None:
    for (name, b0), (_, b1) in zip(ref.named_buffers(), got.named_buffers(), strict=True):
        torch.testing.assert_close(b1, b0, rtol=1e-6, atol=1e-7, msg=name)


# ---------------------------------------------------------------------- 1. batch norm, backward x2
def conv_bn_chain() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for c_in in (3, 4, 4, 4):
        layers += [nn.Conv2d(c_in, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
    return nn.Sequential(*layers)


class ResidualBN(nn.Module):
    """Not a chain (a skip connection): planned on the graph path."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.b2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c3, self.b3 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)) + h)
        return torch.relu(self.b3(self.c3(h)) + h)


CHAIN_PLANS = {
    "every-stage": Plan.every_stage(),
    # nested: the outer segment's recomputation re-runs the inner checkpoints' forwards
    "nested": Plan.from_chain_segments(
        (
            ChainSegment(
                1, 9, True, (ChainSegment(1, 3, True), ChainSegment(4, 6), ChainSegment(7, 9, True))
            ),
            ChainSegment(10, 12, True),
        )
    ),
}


def _twice(model: nn.Module, x: torch.Tensor, mode: str) -> None:
    """One forward, then two backwards: ``retain`` (the same loss twice, gradients accumulate)
    or ``create_graph`` (a gradient penalty on the input: a double backward)."""
    loss = model(x).square().mean()
    if mode == "retain":
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + grad_x.square().sum()).backward()


@pytest.mark.parametrize("mode", ["retain", "create_graph"])
@pytest.mark.parametrize("plan_name", sorted(CHAIN_PLANS))
def test_chain_batchnorm_segment_backward_twice(plan_name: str, mode: str) -> None:
    """Failed with "'_GeneratorContextManager' object has no attribute 'args'": the second
    recomputation re-entered a one-shot @contextmanager."""
    model = conv_bn_chain()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    _twice(reference, x_ref, mode)
    planned = remat.apply(model, CHAIN_PLANS[plan_name])
    _twice(planned, x, mode)
    assert_grads_equal(reference, model, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
    assert_buffers_equal(reference, model)
    assert [int(m.num_batches_tracked) for m in model if isinstance(m, nn.BatchNorm2d)] == [1] * 4


@pytest.mark.parametrize("mode", ["retain", "create_graph"])
def test_graph_batchnorm_segment_backward_twice(mode: str) -> None:
    torch.manual_seed(0)
    initial = ResidualBN()
    x0 = torch.randn(2, 3, 8, 8)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    reference = copy.deepcopy(initial)
    x_ref = x0.clone().requires_grad_(True)
    _twice(reference, x_ref, mode)
    graph = trace_graph(initial, x0, loss_fn, level="module", fake=True).graph
    inside = [v for v, node in enumerate(graph.nodes) if not node.name.startswith("<loss>")]
    half = len(inside) // 2
    plans = [
        Plan.from_segments([[v] for v in inside]),
        Plan.from_segments([inside[:half], inside[half:]]),
    ]
    for plan in plans:
        model = copy.deepcopy(initial)
        x = x0.clone().requires_grad_(True)
        _twice(apply_graph(model, plan, graph, x0, loss_fn), x, mode)
        assert_grads_equal(reference, model, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
        assert_buffers_equal(reference, model)
        assert [int(m.num_batches_tracked) for m in (model.b1, model.b2, model.b3)] == [1] * 3


# ---------------------------------------------------------------------- 2. HF eager attention
def _tiny_qwen2() -> nn.Module:
    # not cut into stages (Mistral, which this test used, now is: remat.capture.stages.families.hf)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
    )
    return Qwen2ForCausalLM._from_config(config, attn_implementation="eager")


def _tiny_gpt2_subclass() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    class MyGPT2(GPT2LMHeadModel):
        def forward(self, *args, **kwargs):  # a custom forward: not cut into stages
            return super().forward(*args, **kwargs)

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128)
    return MyGPT2._from_config(config, attn_implementation="eager")


@pytest.fixture
def without_generic_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models the generic blocks family (remat.capture.stages.families.blocks) cuts into a chain take
    the module-graph path without it: the graph path is tested on them too."""
    import remat.capture.stages
    from remat.capture.stages.families import blocks

    families = tuple(f for f in remat.capture.stages.FAMILIES if f is not blocks.split)
    monkeypatch.setattr(remat.capture.stages, "FAMILIES", families)


@pytest.mark.parametrize("path", ["graph", "chain"])
@pytest.mark.parametrize("make", [_tiny_qwen2, _tiny_gpt2_subclass], ids=["qwen2", "gpt2"])
def test_hf_eager_attention_on_the_graph_path(make, path: str, request) -> None:
    """Failed with "Cannot access storage of BatchedTensorImpl": HF builds the eager mask under
    torch.vmap, whose wrapped tensors have no storage. (The generic blocks family now cuts both
    into chains: the chain path is checked too.)"""
    if path == "graph":
        request.getfixturevalue("without_generic_blocks")
    torch.manual_seed(0)
    model = make()
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, 128, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    reference(**batch).loss.backward()

    def step(m: nn.Module):
        def run() -> None:
            torch.manual_seed(1)
            m(**batch).loss.backward()
            m.zero_grad(set_to_none=True)

        return run

    unplanned = step_peak_bytes(step(model), model, None, batch)
    budget = int(0.85 * unplanned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned, summary = remat.auto(model, batch, budget=budget)
    expected = "GraphPlannedModule" if path == "graph" else "PlannedModule"
    assert type(planned).__name__ == expected
    assert summary.predicted_activation_peak_bytes < summary.unplanned_activation_peak_bytes
    torch.manual_seed(1)
    planned(**batch).loss.backward()
    assert_grads_equal(reference, model, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    measured = step_peak_bytes(step(planned), planned, None, batch)
    assert measured <= budget, (measured, budget)


@pytest.mark.filterwarnings("ignore:global module forward hook")
def test_vmap_on_tensors_requiring_grad_is_refused_by_the_graph_capture() -> None:
    """Calls inside torch.vmap are skipped by the recorder only when nothing in them needs a
    gradient (masks); a differentiable vmap would hide its memory, so it is refused."""

    class Vmapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.vmap(lambda row: torch.tanh(self.lin(row)))(x) + x

    with pytest.raises(ValueError, match="torch.func transform"):
        trace_graph(Vmapped(), torch.randn(4, 8), fake=True)


# ---------------------------------------------------------------------- 3. scalars, twice, in place
def mlp_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])


class ScalarArgs(nn.Module):
    """A custom forward (graph path) taking a float, a bool and an int besides the tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp_chain()
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, scale: float = 1.0, flag: bool = False, n: int = 1):
        h = self.body(x) * scale
        for _ in range(n):
            h = self.head(h) + h if flag else self.head(h)
        return h


def _auto_and_check(model: nn.Module, batch, loss_fn, fraction: float = 0.85):
    """remat.auto under a budget below the unplanned step: gradients equal eager's, the
    measured peak within the budget."""
    reference = copy.deepcopy(model)
    loss_fn(reference, batch).backward()

    def step(m: nn.Module):
        def run() -> None:
            loss_fn(m, batch).backward()
            m.zero_grad(set_to_none=True)

        return run

    unplanned = step_peak_bytes(step(model), model, None, batch)
    budget = int(fraction * unplanned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned, summary = remat.auto(model, batch, loss_fn, budget=budget)
    assert summary.predicted_activation_peak_bytes < summary.unplanned_activation_peak_bytes
    loss_fn(planned, batch).backward()
    assert_grads_equal(reference, model, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    assert step_peak_bytes(step(planned), planned, None, batch) <= budget
    return planned


def test_batch_with_scalars_on_the_chain_path() -> None:
    x = torch.randn(256, 64)
    batch = {"x": x, "temperature": 0.7, "use_cache": False, "steps": 3}

    def loss_fn(m: nn.Module, b: dict) -> torch.Tensor:
        return (m(b["x"]) / b["temperature"]).square().mean() * b["steps"]

    planned = _auto_and_check(mlp_chain(), batch, loss_fn)
    assert type(planned).__name__ == "PlannedModule"
    assert remat.profile(planned, batch, loss_fn).peak_bytes > 0  # floats in a profiled batch


def test_batch_with_scalars_for_a_hugging_face_chain() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128))
    ids = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False, "return_dict": True}
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    reference(**batch).loss.backward()
    planned, summary = remat.auto(model, batch)
    assert type(planned).__name__ == "PlannedModule"
    torch.manual_seed(1)
    planned(**batch).loss.backward()
    assert_grads_equal(reference, model, rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("without_generic_blocks")
@pytest.mark.parametrize("as_dict", [False, True], ids=["args", "kwargs"])
def test_batch_with_scalars_on_the_graph_path(as_dict: bool) -> None:
    """Failed with "Object of type <class 'float'> is not supported for tracking" (the graph
    capture handed the whole batch to MemTracker)."""
    x = torch.randn(256, 64)
    if as_dict:
        batch = {"x": x, "scale": 0.5, "flag": True, "n": 3}

        def loss_fn(m: nn.Module, b) -> torch.Tensor:
            return m(**b).square().mean()
    else:
        batch = (x, 0.5, True, 3)

        def loss_fn(m: nn.Module, b) -> torch.Tensor:
            return m(*b).square().mean()

    planned = _auto_and_check(ScalarArgs(), batch, loss_fn)
    assert type(planned).__name__ == "GraphPlannedModule"


def test_loss_fn_calling_the_model_twice_is_refused_on_both_paths() -> None:
    """The chain capture measured the second call as the first (a silently wrong chain; then a
    MemTracker crash): both paths now say what to do."""
    x = torch.randn(64, 64)

    def twice(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum() + m(b * 2).sum()

    for model in (mlp_chain(), ScalarArgs()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match="exactly once per step.*Call the model once"):
                remat.auto(model, x, twice, budget=None)
    with pytest.raises(ValueError, match="exactly once per step"):
        remat.capture_chain(mlp_chain(), x, twice, fake=True)


class AddOne(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)


class MulTwoTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return torch.tanh(x)


def writer_chain(block: type[nn.Module], first: bool = False) -> nn.Sequential:
    """Linear, then alternately ``block`` (writes into the Linear's output) and Tanh."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [block()] if first else []
    for i in range(6):
        layers += [nn.Linear(64, 64), nn.Tanh() if i % 2 else block()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("first", [False, True], ids=["after-linear", "on-the-batch"])
@pytest.mark.parametrize("block", [AddOne, MulTwoTanh])
def test_block_writing_into_its_input_on_the_chain_path(block, first: bool) -> None:
    """A checkpointed segment that starts at such a block cannot be recomputed (torch raised
    "modified by an inplace operation" at the backward; the capture crashed on "a leaf
    Variable that requires grad is being used in an in-place operation"): refused, naming
    the stage; stored, or joined with the stage before, it trains like eager."""
    x = torch.randn(64, 64)
    model = writer_chain(block, first)
    stage = 1 if first else 2
    # remat.auto: the chain capture refuses it, the module graph is planned instead
    eager = copy.deepcopy(model)
    eager(x.clone()).sum().backward()
    graph_model = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=f"not a chain of stages \\(stage {stage} .*writes into"):
        planned, _ = remat.auto(graph_model, x.clone(), budget=None)
    planned(x.clone()).sum().backward()
    assert_grads_equal(eager, graph_model)
    with pytest.raises(InPlaceInputError, match=f"stage {stage} "):
        remat.capture_chain(model, x.clone(), fake=True)
    for plan in (Plan.every_stage(), Plan.from_checkpoints(len(model), [stage - 1 or 1, 5])):
        with pytest.raises(InPlaceInputError, match=f"stage {stage} "):
            remat.apply(copy.deepcopy(model), plan)(x.clone()).sum().backward()

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b.clone()).square().mean()

    reference = copy.deepcopy(model)
    loss_fn(reference, x).backward()
    stored = copy.deepcopy(model)
    loss_fn(remat.apply(stored, Plan.none()), x).backward()
    assert_grads_equal(reference, stored)
    if not first:  # joined with the Linear before it, the write stays inside a stage
        names = [f"{2 * i}+{2 * i + 1}" for i in range(6)]
        planned, summary = remat.auto(model, x, loss_fn, budget=None, stages=names)
        assert any(True for _ in summary.plan.walk())
        loss_fn(planned, x).backward()
        assert_grads_equal(reference, model)


class WriterGraph(nn.Module):
    """Not a chain: each block writes into a Linear's output, which a skip also reads."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.blocks = nn.ModuleList(block() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, block in zip(self.lins, self.blocks, strict=True):
            x = block(lin(x)) + 0.5 * torch.tanh(x)
        return x


@pytest.mark.parametrize("block", [AddOne, MulTwoTanh])
def test_block_writing_into_its_input_on_the_graph_path(block) -> None:
    torch.manual_seed(0)
    model = WriterGraph(block)
    x = torch.randn(256, 64)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    planned = _auto_and_check(model, x, loss_fn, fraction=0.9)
    assert type(planned).__name__ == "GraphPlannedModule"
    graph = trace_graph(model, x, loss_fn, level="op", fake=True).graph
    reference = copy.deepcopy(model)
    loss_fn(reference, x).backward()
    every = copy.deepcopy(model)
    loss_fn(
        apply_graph(every, Plan.from_segments([[v] for v in range(graph.n)]), graph, x, loss_fn),
        x,
    ).backward()
    assert_grads_equal(reference, every)
