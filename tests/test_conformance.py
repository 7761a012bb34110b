"""Conformance: any model, planned before it runs (remat.bench.conformance).

Every registry model (tiny transformers / timm / torchvision configurations, LoRA, frozen layers,
segmentation, detection) is trained through ``remat.auto`` with each of the three loop shapes at
one budget between the least total peak auto plans for and the eager step's measured peak (the
budget rotated over the models, so that each runs on every family): its gradients must
equal eager's, its buffers be updated as eager's, and its measured whole-step peak (allocator
events) stay within the budget. The full matrix (three budgets per loop shape, time ratios,
the every-block baseline) is ``benchmarks/conformance.py``; its table is in
docs/results/conformance/.

Cases that fail today because of a known remat bug are ``xfail(strict=True)`` naming the bug
(docs/results/conformance/FINDINGS.md): they turn into failures (XPASS) once it is fixed; remove the mark then.
"""

from __future__ import annotations

import pytest
import torch

from remat.bench import conformance as conf
from remat.bench.conformance import LOOPS, MODELS, run_case

# Every loop shape at one budget per model, the budget rotated over the registry (10 %, 50 %,
# 90 % of the way from the least plannable peak to the eager one) ...
FRACTIONS = conf.FRACTIONS
FRACTION_OF = {name: FRACTIONS[i % len(FRACTIONS)] for i, name in enumerate(MODELS)}
# ... except where the rotation misses a failure the full matrix (docs/results/conformance)
# shows on that model: the output held through the step, chain path and graph path (auto picks
# plan 'none', whose held step then peaks above the budget). hf-opt's loss_fn at 10 % is left
# to the benchmark: the MILP's plan follows measured timings, and one of its plans is
# under-predicted by 8 KiB (docs/results/conformance/FINDINGS.md): a test there would pass or fail by the plan drawn
FRACTION_OF |= {"hf-gpt2": 0.9, "hf-opt": 0.9}
# Loop shapes left to the benchmark: WithLoss around MobileNetV3 is not a chain, a 116-node
# graph whose MILP takes a minute on 2 cores
SLOW = {("tv-mobilenet_v3_small", "inside")}
# Refused by design, with remat's own error: a dict output and no loss_fn (segmentation's
# {"out": ...}; detection's loss dict, also in loop (b))
REFUSED = {
    ("tv-lraspp_mobilenet_v3", "held"),
    ("tv-fasterrcnn_mobilenet_v3_fpn", "held"),
    ("tv-fasterrcnn_mobilenet_v3_fpn", "inside"),
}

# Faster R-CNN's loss_fn case was a non-strict xfail: on a fresh model the graph capture's timed
# step made 978 torch calls and its recorded step 994 (MultiScaleRoIAlign infers its scales on
# its first call only), RuntimeError "the model's forward is not deterministic in its calls";
# the capture records a later step then (tests/test_graph_capture.py)
XFAIL: dict[tuple[str, str], str | tuple[str, bool]] = {}
# RegNet takes the chain path now (remat.capture.stages.families.blocks: its trunk's stages of
# blocks). Its graph path under-predicted it by 128 KiB (predicted 4130224 B, measured 4261240
# B at a 4201652 B budget): the projection's batch norm was merged into the residual sum across
# the other branch (tests/test_graph_branch_merge.py); now predicted 4158384 B, measured
# 4157304 B. LoRA's frozen prefix (predicted 499856 B, measured 523464 B at 511631 B, output
# held) was the constants' bug (tests/test_graph_constants.py)


def _known_bug(reason: str | tuple[str, bool]) -> pytest.MarkDecorator:
    """A strict xfail, or with ``(reason, False)`` one that only sometimes fails."""
    text, strict = (reason, True) if isinstance(reason, str) else reason
    return pytest.mark.xfail(strict=strict, reason=text)


def _cases() -> list[object]:
    cases = []
    for name, fraction in FRACTION_OF.items():
        for loop in LOOPS:
            if (name, loop) in SLOW:
                continue
            marks = [pytest.mark.slow]
            if (name, loop) in XFAIL:
                marks.append(_known_bug(XFAIL[(name, loop)]))
            cases.append(
                pytest.param(name, loop, fraction, marks=marks, id=f"{name}-{loop}-{fraction}")
            )
    return cases


@pytest.mark.parametrize("name,loop,fraction", _cases())
def test_auto_trains_the_model_within_the_budget_with_eager_gradients(
    name: str, loop: str, fraction: float
) -> None:
    record = run_case(name, loop, fraction)
    if (name, loop) in REFUSED:
        assert record.status == "refused", record
        assert "pass loss_fn(model, batch)" in record.error
        return
    assert record.status == "pass", (
        f"{name} / {loop} at budget {record.budget_bytes} (least {record.least_bytes}, eager "
        f"{record.eager_peak_bytes}): {record.path} measured {record.peak_bytes}; "
        f"{'; '.join(record.violations)} {record.error}"
    )
    assert record.peak_bytes is not None and record.peak_bytes < record.eager_peak_bytes


# Below the generic blocks chain's least peak, auto plans the module graph (it reaches lower:
# Qwen2 at 10% of eager, 0.650 on the graph path, 0.774 as a chain). LoRA-Llama at the least
# peak auto names (its graph path's, 320200 B, below the chain's 326472 B; measured 312008 B;
# the rotary temporaries the program holds, counted through the attention node's first call,
# once put it at 326472 B on the chain).
# Its frozen prefix (embeddings, the frozen projections the adapters' sums read, the causal
# mask) makes tensors without gradient that the capture once left out unless a backward saved
# them: measured 337352 B at a 311138 B budget, predicted 310164 B; they are Graph.constants
# now (tests/test_graph_constants.py)
BELOW_THE_CHAIN = ("peft-lora-llama",)


@pytest.mark.slow
@pytest.mark.parametrize("name", BELOW_THE_CHAIN)
def test_auto_below_the_chain_minimum_stays_within_the_budget(name: str) -> None:
    record = run_case(name, "loss_fn", 0.0)
    assert record.path.startswith("graph"), record.path
    assert record.status == "pass", f"{name}: {'; '.join(record.violations)} {record.error}"
    assert record.predicted_peak_bytes is not None and record.peak_bytes is not None
    assert record.peak_bytes <= record.predicted_peak_bytes  # never under-predicted


# one model per family and path: what checkpointing every block reaches, remat must reach
EVERY_BLOCK = {
    # chain path, HF gradient checkpointing. auto named 680656 / 514900 B against 679660 /
    # 513888 B measured (a 1 KiB slack counted all step); the wrapped scalars autograd saves
    # (GPT-2's GELU), the loss and its gradient seed are counted where they live now: the named
    # minimum is the measured peak, 679660 / 513888 B (tests/test_step_scalars.py)
    "hf-gpt2": None,
    "hf-llama": None,  # chain path
    "hf-bert": None,  # graph path
    # graph path (its chain's least is one activation above): auto named 759844 B against
    # 759652 B measured (a 1 KiB slack counted all step); the terms it stood for are counted
    # per node now (tests/test_step_scalars.py): least 758836 B, measured 754596 B; with the
    # parameter gradients counted as each node's backward makes them
    # (tests/test_graph_grad_rise.py) its plan at 759652 B: predicted 754612 B, measured 754596 B
    "hf-vit": None,
    "timm-vit": None,
    "tv-resnet10": None,  # chain path, checkpoint per BasicBlock
    "tv-convnext": None,  # graph path
    # graph path (54 nodes): refused at 1803992 B (remat's least 1855376 B: its plan measured
    # 65,536 B below it). That was the loss_fn's target, a 2 x 64 x 64 int64 mask the capture
    # counts all step and the measurement did not; measured with it (Loop.data), every block
    # reaches 1869528 B, and remat's least is 1854360 B, predicted and measured
    # (tests/test_graph_pass_through.py)
    "tv-lraspp_mobilenet_v3": None,
    # auto refused 421976 B (what every block checkpointed measures) naming 424960 B on the
    # graph path; the chain path's least is now that measured peak, 421976 B, and auto plans
    # the chain there (predicted 421976 B, measured 421976 B); below it, the graph path
    # (least 409472 B, measured 407960 B)
    "hf-opt": None,
    # chain path, frozen stem and first stage: refused 3,096 B above what every block
    # checkpointed measures (60,552,160 B), the copies of batch norm's running statistics the
    # recomputed backward kept; torch's batch norm is recomputed with its update paused now
    # (tests/test_step_states.py): predicted and measured 60,552,160 B
    "tv-resnet10-frozen": None,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[_known_bug(r)] if r else []) for n, r in EVERY_BLOCK.items()],
)
def test_auto_reaches_what_checkpointing_every_block_reaches(name: str) -> None:
    reached, how = conf.every_block_peak(name, "loss_fn")
    record = run_case(name, "loss_fn", None, budget=reached)
    assert record.status == "pass", (
        f"{name}: {how} measures {reached} B; remat.auto at that budget: "
        f"{'; '.join(record.violations)} {record.error}"
    )


# Compiled (``remat.auto(..., compile=)``), the loss_fn loop: aot_eager_decomp_partition
# partitions as inductor does without generating code (tests/test_compile.py). Dropout stays on
# in compiled cases: below a budget of 1 torch's partitioner would draw other masks than eager's
# (pytorch/pytorch#190758; MobileNetV3's gradients moved by 0.033 under torch.compile@0.5 alone),
# and remat keeps them saved (remat.execute.chain._SaveRandomOps). MobileNetV3: batch norm and
# dropout (0.2, in the classifier); LoRA-Llama: a frozen prefix (NOTE [ A frozen prefix in the planners ]);
# T5: no chain, refused with what to do. The full matrix: benchmarks/conformance.py --compile
# hf-bloom: a custom autograd.Function (its training GeLU) and dropout, compiled
COMPILED = {
    "tv-mobilenet_v3_small": "pass",
    "peft-lora-llama": "pass",
    "hf-t5": "refused",
    "hf-bloom": "pass",
}
# The compiled cases' budgets, as fractions of the eager step's measured peak: where the matrix's
# 50 % budgets fell (docs/results/conformance/compiled: MobileNetV3 24,376,068 B of 27,109,744 B,
# LoRA-Llama 389,916 B of 474,312 B, RegNet 4,396,282 B of 5,055,672 B), each below what storing
# every stage compiled holds, so the plan that runs recomputes. Set from the eager peak, not from
# the least that a 1-byte budget's refusal names: finding that least compiles and measures every
# one-graph plan (MobileNetV3: 11 graphs, 100 s of the case's 126 s). The compiled least is
# accepted in tests/test_compile.py (LoRA, an MLP) and by the benchmark (--fractions 0).
EAGER_FRACTION = {
    "tv-mobilenet_v3_small": 0.9,
    "peft-lora-llama": 0.82,
    "tv-regnet": 0.87,
    "hf-bloom": 0.8,  # 749,481 B of 936,852 B (its compiled least: 664,968 B)
}


def _compiled_case(name: str) -> conf.Record:
    """``name``'s loss_fn loop through ``remat.auto`` compiled (aot_eager_decomp_partition) at
    :data:`EAGER_FRACTION` of its eager peak (T5, refused before any budget: 0.5)."""
    eager = conf.eager_peak(name, "loss_fn")
    budget = int(EAGER_FRACTION.get(name, 0.5) * eager)
    return run_case(
        name,
        "loss_fn",
        None,
        budget=budget,
        eager=eager,
        compile={"backend": "aot_eager_decomp_partition"},
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMPILED))
def test_auto_compiled_trains_the_model_within_the_budget_with_eager_gradients(name: str) -> None:
    record = _compiled_case(name)
    if COMPILED[name] == "refused":
        assert record.status == "refused", record
        assert "use compile=False, or name stages=" in record.error, record.error
        return
    assert record.status == "pass", (
        f"{name} compiled at budget {record.budget_bytes}: "
        f"{record.path} measured {record.peak_bytes}; {'; '.join(record.violations)} "
        f"{record.error}"
    )
    assert record.buffers_equal and record.max_grad_abs_diff is not None


@pytest.mark.slow
def test_auto_compiled_regnet_updates_batch_norm_once() -> None:
    record = _compiled_case("tv-regnet")
    assert record.status == "pass", f"{'; '.join(record.violations)} {record.error}"
    assert record.buffers_equal


def test_compiled_buffers_agree_within_compiles_tolerance_and_counts_exactly() -> None:
    stats = torch.tensor([0.5, -1.25])
    last_bit = stats + 1.2e-7  # torch.compile's own batch-norm statistics against eager's
    twice = 0.9 * stats + 0.1 * torch.tensor([2.0, 1.0])  # a second update's momentum step
    assert conf._buffers_agree(last_bit, stats, compiled=True)
    assert not conf._buffers_agree(last_bit, stats, compiled=False)
    assert not conf._buffers_agree(twice, stats, compiled=True)
    assert not conf._buffers_agree(torch.tensor(2), torch.tensor(1), compiled=True)


def test_compiled_gradients_agree_with_eager_or_within_torch_compiles_own_difference() -> None:
    # inductor's convolutions and batch norm on the CPU: torch.compile alone moved ResNet-10's
    # gradients 2.8e-4 from eager's, and remat compiled was 8.9e-7 from torch.compile's
    eager = torch.tensor([1.0, -2.0, 3.0])
    compiled = eager + torch.tensor([2.8e-4, 0.0, -2.8e-4])
    assert conf.compiled_grads_agree(eager + 5e-6, eager, None)  # within the tolerance
    assert conf.compiled_grads_agree(compiled + 9e-7, eager, compiled)  # compile's own
    assert not conf.compiled_grads_agree(compiled, eager, None)  # no reference: eager's only
    # further from eager's than torch.compile's own, or away from it: wrong
    assert not conf.compiled_grads_agree(eager + 2 * (compiled - eager), eager, compiled)
    assert not conf.compiled_grads_agree(eager - (compiled - eager), eager, compiled)


def test_the_registry_holds_every_family_and_is_deterministic() -> None:
    assert len(MODELS) >= 25
    families = {entry.family for entry in MODELS.values()}
    for family in (
        "decoder LM",
        "encoder",
        "encoder-decoder",
        "vision transformer",
        "CNN",
        "swin",
        "segmentation",
        "detection",
    ):
        assert family in families
    assert any("LoRA" in f for f in families) and any("frozen" in f for f in families)
    a, b = conf.build("tv-convnext"), conf.build("tv-convnext")
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.target, b.target)
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------- the harness can fail
def test_the_harness_reports_wrong_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    real = conf._auto

    def doubled(loop, budget, opt, compile=None):
        planned, summary = real(loop, budget, opt, compile=compile)

        class Doubled(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = planned

            def forward(self, *args, **kwargs):
                return self.inner(*args, **kwargs) * 2

        return Doubled(), summary

    monkeypatch.setattr(conf, "_auto", doubled)
    record = run_case("tv-convnext", "loss_fn", 0.5)
    assert record.status == "fail"
    assert any("gradient differs" in v for v in record.violations)


def test_the_harness_reports_a_peak_above_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    real = conf._auto

    def unplanned(loop, budget, opt, compile=None):
        _, summary = real(loop, budget, opt, compile=compile)
        return loop.module, summary  # the eager model: its peak is above a budget below it

    monkeypatch.setattr(conf, "_auto", unplanned)
    record = run_case("tv-convnext", "loss_fn", 0.5)
    assert record.status == "fail"
    assert any("> budget" in v for v in record.violations)
