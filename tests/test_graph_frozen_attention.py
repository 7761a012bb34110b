"""A Hugging Face BERT fine-tuned with its embeddings and first layer frozen, on the graph path.

Tried as a user would (it is in no conformance table), ``remat.auto`` at the least budget it
named ran 1,044 B over it (294,576 B named, 295,620 B measured). Two causes, each in the graph
capture:

* **Nodes that ran by turns.** The value projection of the first trainable layer reads the
  frozen hidden states, so its backward saves a constant and no node's tensor; the capture
  merged it into the product with the probabilities across the query-key node's calls. The
  simulator runs a node's backward at once, but the engine ran the two by turns: the value's
  gradient, made by the product's backward before the softmax's and freed by the projection's
  after it, was live through the softmax's backward (3,968 B above the prediction there). A
  node whose backward saves a constant is no longer merged across another node's calls
  (``_merge_unsaved``).
* **A layer norm recomputed without grad** peaks with its statistics, which its one ATen op
  makes with its output and frees on return; the capture took the grad-mode peak less the saved
  bytes (512 B low). The forward without grad is now walked on its own (``_WithoutGrad``).
"""

from __future__ import annotations

import pytest
from graph_steps import measured_and_predicted

from remat.bench import conformance
from remat.capture.graph import trace_graph
from remat.core.plan import Plan


def _frozen_bert() -> conformance.Loop:
    built = conformance._seq_cls(
        "BertForSequenceClassification", "BertConfig", **conformance.BERT_LIKE
    )()
    built.model.bert.embeddings.requires_grad_(False)
    built.model.bert.encoder.layer[0].requires_grad_(False)
    return conformance.Loop(built, "loss_fn")


@pytest.mark.slow
def test_every_one_node_plan_of_a_frozen_bert_is_predicted_to_the_byte() -> None:
    loop = _frozen_bert()
    trace = trace_graph(loop.module, loop.batch, loop.loss_fn)
    graph = trace.graph
    for plan in [Plan.none(), *(Plan.from_segments([[v]]) for v in range(graph.n))]:
        measured, predicted, _ = measured_and_predicted(
            loop.module, loop.batch, loop.loss_fn, trace, plan, loop.data
        )
        assert measured <= predicted <= measured + 64, (plan.describe(graph), measured, predicted)


@pytest.mark.slow
def test_auto_at_the_least_it_names_for_a_frozen_bert_stays_within_it() -> None:
    conformance.MODELS["frozen-bert"] = conformance.ModelEntry(
        "frozen-bert", "fine-tuning (frozen layers)", lambda: _frozen_bert().built
    )
    try:
        record = conformance.run_case("frozen-bert", "loss_fn", 0.0)  # the budget: the least
    finally:
        del conformance.MODELS["frozen-bert"]
    assert record.status == "pass", (record.budget_bytes, record.peak_bytes, record.violations)
    assert record.path.startswith("graph"), record.path
    assert record.peak_bytes == record.predicted_peak_bytes == record.budget_bytes
