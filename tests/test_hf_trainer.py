"""Hugging Face's Trainer, the loop most fine-tuning of its models runs through, on a planned
model: it reads the forward's signature (which batch columns to keep, whether to pass the loss's
token count) and saves the model's state_dict. Before, the planned model's ``(*args, **kwargs)``
made it drop every input column ("The batch received was empty"), and its checkpoint's keys
carried the wrapper's "model." prefix, which from_pretrained skipped with a warning."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import remat

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _llama_lora() -> torch.nn.Module:
    """LoRA on the attention's query and value projections (the base frozen), with dropout:
    its forward takes ``(*args, **kwargs)``, so the Trainer reads the base model's."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1
    )
    return peft.get_peft_model(_llama(), config)


def _rows(kind: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (16, 32), generator=g)
    mask = torch.ones_like(ids)
    mask[:4, 24:] = 0  # some padding
    labels = torch.randint(0, 3, (16,), generator=g) if kind == "bert" else ids.clone()
    if kind != "bert":
        labels[mask == 0] = -100
    return [
        {"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(16)
    ]


def _train(model: torch.nn.Module, rows: list, out: str) -> tuple[list[float], object]:
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        seed=7,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer


@pytest.mark.parametrize("kind", ["bert", "llama", "llama-lora"])
def test_trainer_trains_a_planned_model_as_the_plain_one_and_saves_its_keys(
    kind: str, tmp_path
) -> None:
    make = {"bert": _bert, "llama": _llama, "llama-lora": _llama_lora}[kind]
    rows = _rows(kind)
    plain = make()
    model = copy.deepcopy(plain)
    batch = {k: torch.stack([r[k] for r in rows[:4]]) for k in rows[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned, summary = remat.auto(model, batch, budget="70%")
    assert summary.predicted_peak_bytes < summary.unplanned_peak_bytes  # a plan that recomputes
    inner = model.get_base_model() if kind == "llama-lora" else model
    assert inspect.signature(planned.forward) == inspect.signature(inner.forward)

    want, _ = _train(plain, rows, str(tmp_path / "plain"))
    got, trainer = _train(planned, rows, str(tmp_path / "planned"))
    assert len(got) == 4
    assert got == pytest.approx(want, rel=1e-5)
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)

    trainer.save_model(str(tmp_path / "saved"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    fresh = make()
    missing, unexpected = fresh.load_state_dict(saved, strict=False)
    assert unexpected == []
    assert all(k.endswith("lm_head.weight") for k in missing)  # (tied: saved once)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
