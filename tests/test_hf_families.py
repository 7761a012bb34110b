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
    assert stages.kind == "mistral" and stages.n == 5
    assert stages.names == (
        "model.embed_tokens+rotary_emb",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
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
    for plan in (Plan.every_stage(), Plan.from_checkpoints(5, [2, 4])):
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
    assert any(s.checkpoint for s in summary.plan.for_chain(summary.chain).segments)
    torch.manual_seed(1)
    planned(**batch).loss.backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], msg=name)
