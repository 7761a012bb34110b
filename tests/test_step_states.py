"""Checkpoint state (the RNG state each checkpointed segment keeps) in the whole-step model:
live from the segment's forward to its backward, not for every segment all step. The chain
executor (torch's checkpoint) keeps one per checkpointed segment; the graph executor one per
random call (dropout) inside a checkpointed segment, and one more while it replays one."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from remat.auto import auto, checkpoint_state_bytes, predicted_step_peak_bytes
from remat.capture.chain import capture
from remat.core.graph import Graph, Node
from remat.core.plan import ChainSegment, Plan
from remat.core.simulate import checkpoint_spans, graph_step_peak, simulate_graph
from remat.core.step import StepCosts, StepEvent, event_step_bytes, segment_state_bytes
from remat.execute.chain import apply
from remat.measure.events import step_peak_bytes
from remat.planners import BudgetTooSmallError

#: Stages 0-2 forward, stage 2's backward, stage 1 recomputed (no new checkpoint, the RNG
#: forked aside), then the backwards of 1 and 0.
_TIMELINE = [
    StepEvent(False, 0, 0, 0),
    StepEvent(False, 1, 0, 0),
    StepEvent(False, 2, 0, 0),
    StepEvent(True, 2, 0, 0),
    StepEvent(False, 1, 0, 0),
    StepEvent(True, 1, 0, 0),
    StepEvent(True, 0, 0, 0),
]


def test_segment_states_live_from_forward_to_backward() -> None:
    timeline = _TIMELINE
    # segments starting at stages 0 and 1; the one at 1 holds a nested checkpoint (2 states);
    # torch's checkpoint keeps the current RNG state aside while it recomputes (fork_rng)
    assert segment_state_bytes(timeline, [(0, 1), (1, 2)], 10) == [10, 30, 30, 30, 40, 30, 10]
    # the graph executor's replays are counted by graph_step_peak
    no_forks = segment_state_bytes(timeline, [(0, 1), (1, 2)], 10, forks=False)
    assert no_forks == [10, 30, 30, 30, 30, 30, 10]


def test_written_buffer_copies_live_with_their_segment_and_again_while_it_recomputes() -> None:
    # a third number per segment: the bytes of the written buffers its checkpoints copy, held
    # from its forward to its backward, and once more while that segment recomputes
    timeline = _TIMELINE  # the segment at 1 recomputes stage 1: its copies once more
    spans = [(0, 1, 100), (1, 2, 50)]
    assert segment_state_bytes(timeline, spans, 10) == [110, 180, 180, 180, 240, 180, 110]
    costs = StepCosts(0, (0, 0, 0), checkpoint_state_bytes=0, buffer_copy_bytes=(100, 0, 50))
    assert max(event_step_bytes(timeline, costs, spans)) == 200  # without states: 150 + 50


def test_the_predicted_step_counts_only_the_states_still_held() -> None:
    # wide layers, a small batch: the gradients make the peak, at the end of the backward,
    # where one segment's RNG state is left, not all eight (they were counted all step)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    x = torch.randn(2, 128)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    captured = capture(model, x, loss_fn=loss_fn)
    plan = Plan.every_stage(captured.chain)
    planned = apply(model, plan, stages=captured.stages)

    def step() -> None:
        loss_fn(planned, x).backward()
        planned.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, None, x)
    predicted = predicted_step_peak_bytes(model, captured, plan)
    # exact: the loss and the gradient its backward is seeded with are held through the whole
    # backward (StepCosts.loss_bytes; 4 B under before, measured 1063880 B, predicted 1063876
    # B); one state too many counted would put the prediction 5 KiB above the measurement
    assert measured == predicted, (measured, predicted)
    assert predicted <= measured + checkpoint_state_bytes() // 2, (measured, predicted)


def _random_path(random_calls: tuple[int, ...]) -> Graph:
    nodes = [
        Node(f"n{v}", (v - 1,) if v else (), 1.0, 1.0, 10, 10, random_calls=r)
        for v, r in enumerate(random_calls)
    ]
    return Graph(tuple(nodes), input_bytes=10)


def test_the_graph_executor_keeps_a_state_per_random_call_and_one_per_replay() -> None:
    # 4 nodes of 10 B, dropout twice in node 1 and once in node 3, segments [0-1] and [2-3]
    graph = _random_path((0, 2, 0, 1))
    plan = Plan.from_segments([[0, 1], [2, 3]])
    assert checkpoint_spans(plan) == ((0, 1), (2, 1))  # torch's checkpoint: one per segment
    assert checkpoint_spans(plan, None, [0, 2, 0, 1]) == ((0, 2), (2, 1))
    # node 0's backward makes 500 B of gradients: the step's peak; there, [0-1]'s two states
    # are left (200 B with 100 B a state); segment [2-3]'s one is gone
    per_segment = StepCosts(persistent_bytes=0, grad_bytes=(500, 0, 0, 0), input_bytes=10)
    per_segment = dataclasses.replace(per_segment, checkpoint_state_bytes=100)
    per_call = dataclasses.replace(per_segment, checkpoint_states="per-random-call")
    stateless = dataclasses.replace(per_segment, checkpoint_state_bytes=0)
    assert graph_step_peak(graph, plan, stateless) == 530
    assert graph_step_peak(graph, plan, per_segment) == 630
    assert graph_step_peak(graph, plan, per_call) == 730
    # early in the backward (no gradient yet): 3 states from the forwards, and during the
    # replay of [2-3] the one fork_rng holds: the peak with a large state
    big = dataclasses.replace(per_call, grad_bytes=(0, 0, 0, 0), checkpoint_state_bytes=1000)
    timeline = simulate_graph(graph, plan).timeline
    replay = max(e.peak_bytes for e in timeline if e.recompute and e.node in (2, 3))
    assert graph_step_peak(graph, plan, big) == replay + 4000
    # no random call, no state; a chain's executor refuses the graph executor's count
    quiet = _random_path((0, 0, 0, 0))
    assert graph_step_peak(quiet, plan, per_call) == graph_step_peak(quiet, plan, stateless)
    with pytest.raises(ValueError, match="checkpoint_states"):
        StepCosts(persistent_bytes=0, grad_bytes=(), checkpoint_states="per-call")


def test_random_calls_round_trip_and_leave_the_fingerprint() -> None:
    def diamond(random_calls: int) -> Graph:
        edges = [(), (0,), (0,), (1, 2)]
        return Graph(
            tuple(
                Node(f"n{v}", e, 1.0, 1.0, 10, 10, random_calls=random_calls * (v == 1))
                for v, e in enumerate(edges)
            )
        )

    graph, quiet = diamond(2), diamond(0)
    assert Graph.from_json(graph.to_json()) == graph
    assert graph.nodes[1].random_calls == 2
    assert "random_calls" not in quiet.to_json()  # graphs written before it read the same
    assert graph.fingerprint == quiet.fingerprint  # a plan made before applies


class _Dropouts(nn.Module):
    """Residual blocks with two dropouts each and a skip from the stem to the head: not a
    chain, so auto plans its module graph for the graph executor."""

    def __init__(self, width: int = 128, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "a": nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)),
                    "b": nn.Sequential(nn.Linear(width, width), nn.Dropout(0.1)),
                }
            )
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = s = self.stem(x)
        for block in self.blocks:
            h = h + block["a"](h) + block["b"](h)
        return self.head(h + s)


def test_auto_graph_counts_the_rng_states_of_its_dropouts() -> None:
    # at the least whole-step budget auto names, the planned step checkpoints dropouts; the
    # graph executor's RNG states (5,056 B each on CPU) were left out of the prediction, which
    # the measured step then exceeded by several states
    torch.manual_seed(0)
    model = _Dropouts()
    x = torch.randn(256, 16)
    with pytest.warns(UserWarning, match="not a chain"):
        with pytest.raises(BudgetTooSmallError) as info:
            auto(model, x, budget=1, loop="loss-only")
    budget = info.value.minimum_bytes
    with pytest.warns(UserWarning, match="not a chain"):
        planned, summary = auto(model, x, budget=budget, loop="loss-only")
    assert summary.plan.segments  # checkpointed, with dropouts inside

    def step() -> None:
        planned(x).sum().backward()
        planned.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, None, x)
    assert measured <= summary.predicted_peak_bytes <= budget
    # exact: the allocator-only scalars are counted where they live, not 1 KiB all step
    # (predicted 1884520 B, measured 1884520 B on the dev machine)
    assert summary.predicted_peak_bytes - 64 <= measured, (
        measured,
        summary.predicted_peak_bytes,
    )


def test_a_recomputation_holds_the_rng_state_torch_checkpoint_forks_aside() -> None:
    # Hugging Face DistilBERT (the conformance suite's), its first layer checkpointed: the
    # step peaks while the layer is recomputed in the backward, where torch's checkpoint keeps
    # the current CPU RNG state aside (torch.random.fork_rng, 5,056 B). Without it the step was
    # predicted 968 B below its measured peak (auto at a 407,032 B budget measured 407,612 B)
    from remat.bench import conformance

    loop = conformance.Loop(conformance.build("hf-distilbert"), "loss_fn")
    model = loop.module
    captured = capture(model, loop.batch, loss_fn=loop.loss_fn)
    plan = Plan.from_chain_segments(
        (ChainSegment(1, 1, False), ChainSegment(2, 2, True), ChainSegment(3, 4, False))
    )
    planned = apply(model, plan, stages=captured.stages)

    def step() -> None:
        torch.manual_seed(0)
        loop.loss_fn(planned, loop.batch).backward()
        planned.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, None, loop.data)
    predicted = predicted_step_peak_bytes(model, captured, plan)
    assert measured <= predicted <= measured + 64, (measured, predicted)


class _OwnForwardBatchNorm(nn.BatchNorm2d):
    """A batch norm with its own forward: remat cannot pause its update, so it copies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, _OwnForwardBatchNorm])
def test_a_recomputation_keeps_only_the_batch_norm_copies_it_makes(norm: type) -> None:
    # torchvision ResNet-10's stem checkpointed. Torch's own batch norm is recomputed on its
    # real running statistics with their update paused (momentum None, no batch count): the
    # recomputed backward saves the buffers themselves and nothing is copied. A batch norm
    # with its own forward is recomputed on throw-away copies, which the recomputed backward
    # saves: 512 B of bn1's were live at the stem's backward, where the step peaked 512 B above
    # its prediction before they were counted (67,703,968 B predicted, 67,704,480 B measured)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), norm(64), nn.ReLU()),
        nn.Sequential(nn.Conv2d(64, 8, 3, padding=1), norm(8), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(8 * 16 * 16, 10)),
    )
    x = torch.randn(4, 3, 16, 16)
    captured = capture(model, x)
    copies = norm is _OwnForwardBatchNorm
    assert captured.recompute_kept_bytes == ((2 * 64 * 4 + 8, 2 * 8 * 4 + 8, 0) if copies else ())
    plan = Plan.from_chain_segments((ChainSegment(1, 1, True), ChainSegment(2, 3, False)))
    planned = apply(model, plan, stages=captured.stages)

    def step() -> None:
        planned(x).sum().backward()
        planned.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, None, x)
    predicted = predicted_step_peak_bytes(model, captured, plan)
    assert measured <= predicted <= measured + 64, (measured, predicted)
    # the statistics are updated once a step either way, and the momentum is given back
    reference = copy.deepcopy(model)
    step()
    reference(x).sum().backward()
    for (k, b_ref), (_, b) in zip(reference.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(b, b_ref), k
    assert model[0][1].momentum == 0.1
    # the copies of every stage a recomputation runs are made at its start, each live until
    # the stage's backward
    timeline = [
        StepEvent(False, 0, 0, 0),
        StepEvent(False, 1, 0, 0),
        StepEvent(True, 1, 0, 0),
        StepEvent(False, 0, 0, 0),  # the recomputation
        StepEvent(True, 0, 0, 0),
    ]
    costs = StepCosts(0, (0, 0), recompute_kept_bytes=(7, 100))
    assert event_step_bytes(timeline, costs) == [0, 0, 0, 7, 7]
