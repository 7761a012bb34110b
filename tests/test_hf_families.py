"""The shared decoder-only adapter (remat.capture.stages.families.hf) on a family it was extended to:
Mistral (Llama's layout, with a sliding-window causal mask when configured)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import remat
from remat.capture.stages import run_stages, split_stages
from remat.capture.stages.families import FAMILIES, hf
from remat.core.plan import Plan
from remat.execute.chain import apply

transformers = pytest.importorskip("transformers")


def mistral(sliding_window: int | None, impl: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        sliding_window=sliding_window,
        attention_dropout=0.1,  # on in training: masks must match in recomputation
        attn_implementation=impl,
    )
    return transformers.MistralForCausalLM(config).train()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def test_the_families_are_one_list_and_the_decoders_one_adapter() -> None:
    assert FAMILIES[-2] is hf.split  # the last is the generic one (families.blocks)
    assert [d.kind for d in hf.DECODERS] == ["gpt2", "llama", "mistral"]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("window", [None, 6])
def test_mistral_stages_compute_the_model(window: int | None, impl: str) -> None:
    # a window of 6 tokens over 16: the sliding mask differs from the causal one, so stages
    # that made the plain causal mask would give other logits
    model = mistral(window, impl)
    ids = torch.randint(0, 128, (2, 16))
    stages = split_stages(model)
    assert stages.kind == "mistral" and stages.n == 2 + 2 * 3
    assert stages.names == (
        "model.embed_tokens+rotary_emb",
        *(
            f"model.layers.{i}.{half}"
            for i in range(3)
            for half in ("input_layernorm+self_attn", "post_attention_layernorm+mlp")
        ),
        "model.norm+lm_head",
    )
    for kwargs in ({"labels": ids}, {"attention_mask": torch.ones(2, 16, dtype=torch.long)}):
        torch.manual_seed(1)
        expected = model(ids, **kwargs)
        torch.manual_seed(1)
        got = run_stages(stages, ids, **kwargs)
        assert torch.equal(expected.logits, got.logits)
        if "labels" in kwargs:
            assert torch.equal(expected.loss, got.loss)
    out = run_stages(stages, ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple) and out[0].ndim == 0


def test_mistral_sliding_window_matters_here() -> None:
    """The window test above can fail: with a window of 6 the model's logits differ from the
    same weights with no window."""
    ids = torch.randint(0, 128, (2, 16))
    windowed, full = mistral(6).eval(), mistral(None).eval()
    full.load_state_dict(windowed.state_dict())
    assert not torch.allclose(windowed(ids).logits, full(ids).logits)


@pytest.mark.parametrize("window", [None, 6])
def test_mistral_planned_loss_and_gradients_equal_eager(window: int | None) -> None:
    original = mistral(window)
    ids = torch.randint(0, 128, (2, 16))
    reference = copy.deepcopy(original)
    torch.manual_seed(1)
    ref_loss = reference(ids, labels=ids).loss
    ref_loss.backward()
    for plan in (Plan.every_stage(), Plan.from_checkpoints(8, [2, 5])):  # 2: a half block
        model = copy.deepcopy(original)
        planned = apply(model, plan, example=((ids,), {"labels": ids}))
        torch.manual_seed(1)
        loss = planned(ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        for name, grad in _grads(model).items():
            torch.testing.assert_close(grad, _grads(reference)[name], msg=name)


def test_mistral_auto_takes_the_chain_path() -> None:
    model = mistral(6)
    ids = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    reference(**batch).loss.backward()
    _, free = remat.auto(copy.deepcopy(model), batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the graph path warns "not a chain"
        planned, summary = remat.auto(model, batch, budget=free.unplanned_peak_bytes - 1)
    assert isinstance(summary.chain, remat.Chain) and isinstance(summary.plan, Plan)
    assert type(planned).__name__ != "GraphPlannedModule"
    assert any(s.checkpoint for s in summary.plan.chain_segments(summary.chain))
    torch.manual_seed(1)
    planned(**batch).loss.backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], msg=name)


# ---------------------------------------------------------------- half blocks (issue #19)
def test_a_block_splits_into_its_attention_and_mlp_halves_unless_it_is_not_stock() -> None:
    # NOTE [ Half blocks ]: each half owns its submodules (its parameters' gradients are made
    # by its own backward); a block with a forward hook of its own, or whose class overrides
    # the forward, stays one stage (its hook would not run, its forward is not known)
    model = mistral(None)
    stages = split_stages(model)
    attention, mlp = stages.modules[1], stages.modules[2]
    layer = model.model.layers[0]
    assert {n for n, _ in attention.named_children()} == {"input_layernorm", "self_attn"}
    assert {n for n, _ in mlp.named_children()} == {"post_attention_layernorm", "mlp"}
    assert attention.self_attn is layer.self_attn and mlp.mlp is layer.mlp
    calls = []
    handle = layer.register_forward_hook(lambda *_: calls.append(1))
    try:
        hooked = split_stages(model)
        assert hooked.n == stages.n - 1 and hooked.names[1] == "model.layers.0"
        ids = torch.randint(0, 128, (2, 16))
        run_stages(hooked, ids)
        assert calls  # the user's hook ran
    finally:
        handle.remove()

    class Custom(type(layer)):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return super().forward(*args, **kwargs)

    layer.__class__ = Custom
    assert split_stages(model).names[1] == "model.layers.0"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_half_blocks_plan_below_what_checkpointing_every_block_reaches(name: str) -> None:
    # checkpointing every block holds a whole block's saved tensors while one is recomputed;
    # with half blocks remat's least plan holds half of one: GPT-2 618,664 B against every
    # block's 680,172 B, Llama 468,704 B against 514,400 B (the conformance models; 4 stages:
    # both at every block's)
    from remat.bench import conformance

    every_block, _ = conformance.every_block_peak(name, "loss_fn")
    record = conformance.run_case(name, "loss_fn", 0.0)
    assert record.status == "pass", (record.violations, record.error)
    assert record.path == f"chain of {2 + 2 * 2} stages"
    assert record.peak_bytes is not None and record.peak_bytes < 0.95 * every_block, (
        record.peak_bytes,
        every_block,
    )
