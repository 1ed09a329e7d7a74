"""``benchmarks/torch_graph.py``: a training step replayed from graphs on static input buffers
computes the eager step's loss and gradients of the batch loaded last, row plan included."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from benchmarks import bert, torch_graph, workloads  # noqa: E402
from benchmarks.torch_graph import GraphedStep  # noqa: E402
from sebp_torch_ref import RowPolicy, apply_sebp, row_plan  # noqa: E402
from parity_tests.tolerances import assert_close  # noqa: E402

SEQ = 24


def _tiny_bert(device: str):
    config = transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    return transformers.BertForSequenceClassification(config).to(device)


def _batch(lengths: list[int], seed: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(2, 97, (len(lengths), SEQ), generator=gen) * mask
    labels = torch.randint(0, 2, (len(lengths),), generator=gen)
    return {k: v.to(device) for k, v in
            dict(input_ids=ids, attention_mask=mask, labels=labels).items()}


# The captured example has shorter rows than the batch loaded later: a plan still reading the
# example's mask would drop real rows of the later batch and change its gradients.
EXAMPLE_LENGTHS, LOADED_LENGTHS = [3, 9, 1], [20, 5, 14]


def _planned(inputs: dict) -> contextlib.AbstractContextManager:
    return row_plan(inputs["attention_mask"])


class _Recorded:
    def __init__(self, fn):
        self.replay = fn


class _EagerGraphs:
    """Stands in for :class:`benchmarks.torch_graph.CudaGraphs` on CPU: a "recording" keeps the
    callable and each replay runs it again, reading the static buffers as a CUDA graph would."""

    side_stream = staticmethod(contextlib.nullcontext)

    def record(self, fn):
        return _Recorded(fn)


def _eager_grads(model, batch: dict, context) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with context:
        loss = model(**batch).loss
    return loss.detach(), list(torch.autograd.grad(loss, list(model.parameters())))


def _replayed(step: GraphedStep, model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    step.load(batch)
    step.forward.replay()
    step.backward.replay()
    return step.loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


def test_replay_reads_the_loaded_batch_and_plans_its_mask():
    torch.manual_seed(0)
    dense = _tiny_bert("cpu")
    model = copy.deepcopy(dense)
    apply_sebp(model, impl="torch")
    # lr 0: the warm-up steps leave the parameters as the dense reference has them.
    step = GraphedStep(model, torch.optim.SGD(model.parameters(), lr=0.0),
                       _batch(EXAMPLE_LENGTHS, 0, "cpu"), _planned, graphs=_EagerGraphs())
    loaded = _batch(LOADED_LENGTHS, 1, "cpu")
    loss, grads = _replayed(step, model, loaded)
    assert step.inputs["attention_mask"].data_ptr() != loaded["attention_mask"].data_ptr()
    want_loss, want_grads = _eager_grads(dense, loaded, contextlib.nullcontext())
    assert_close(loss, want_loss, dtype="float32")
    for got, want in zip(grads, want_grads, strict=True):
        assert_close(got, want, dtype="float32")


def test_load_refuses_other_inputs():
    model = _tiny_bert("cpu")
    step = GraphedStep(model, torch.optim.SGD(model.parameters(), lr=0.0),
                       _batch(EXAMPLE_LENGTHS, 0, "cpu"), _planned, graphs=_EagerGraphs())
    batch = _batch(EXAMPLE_LENGTHS, 0, "cpu")
    with pytest.raises(ValueError, match="labels"):
        step.load({k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="'input_ids' is \\(3, 23\\)"):
        step.load(dict(batch, input_ids=batch["input_ids"][:, 1:]))
    with pytest.raises(ValueError, match="warmup_steps"):
        GraphedStep(model, None, batch, _planned, graphs=_EagerGraphs(), warmup_steps=0)


@pytest.mark.parametrize("name", ["torch-sebp-plan-graphed", "torch-sebp-plan-compiled-graphed"])
def test_benchmark_captures_a_step_per_crossover_choice_and_replays_each_batch(monkeypatch, name):
    """The runner's glue: one GraphedStep per crossover choice, each batch replayed on the step
    of its own choice after being loaded (the eager stand-in for the graphs on CPU); compiled, the
    step the graphs record is the torch.compile'd model's."""
    monkeypatch.setattr(torch_graph, "CudaGraphs", lambda torch: _EagerGraphs())
    spec = bert.build(True)
    variant = {v.name: v for v in workloads.VARIANTS}[name]
    torch.manual_seed(0)
    model = workloads.torch_variant_model(spec, variant, "cpu")
    batches, _ = workloads.workload_batches(spec, spec.workloads[0], 4, workloads.Settings(0, 3),
                                            dynamic=False)
    batches = [{k: torch.from_numpy(v).long() for k, v in b.items()} for b in batches]
    dense_steps = [False, True, False]
    steps = {}
    workloads._capture_steps(steps, model, torch.optim.SGD(model.parameters(), lr=0.0), variant,
                             batches[0], dense_steps)
    assert set(steps) == {False, True}
    clock = workloads._TorchClock(torch, "cpu")
    for batch, dense in zip(batches, dense_steps):
        marks = workloads._graphed_marks(steps, clock, [batch], [dense])
        assert len(marks) == 1 and sorted(marks[0]) == list(marks[0])
        with torch.no_grad():
            assert_close(steps[dense].loss, model(**batch).loss, dtype="bfloat16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_graphed_variants_are_refused_without_cuda():
    spec = bert.build(True)
    by_name = {v.name: v for v in workloads.VARIANTS}
    for name in ("torch-dense-graphed", "torch-sebp-plan-graphed", "torch-bound-graphed",
                 "torch-dense-compiled-graphed", "torch-sebp-plan-compiled-graphed",
                 "torch-bound-compiled-graphed"):
        runner = workloads.run_torch(spec, by_name[name], workloads.Settings(0, 1))
        assert next(runner)["platform"] == "cpu"
        with pytest.raises(ValueError, match=f"{name}: CUDA graphs need a CUDA device"):
            next(runner)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graphed_sebp_plan_step_matches_the_eager_step(compiled):
    """Triton kernels under the row plan, captured in CUDA graphs (``compiled``: the
    torch.compile'd model's step, as the ``*-compiled-graphed`` benchmark rows run it): two
    loaded batches in turn give the eager planned step's loss and gradients."""
    torch.manual_seed(0)
    model = _tiny_bert("cuda")
    apply_sebp(model, impl="triton")
    loaded = [_batch(LOADED_LENGTHS, 1, "cuda"), _batch([2, 24, 7], 2, "cuda")]
    wanted = [_eager_grads(model, b, row_plan(b["attention_mask"])) for b in loaded]
    # The benchmark's optimizer, with lr 0: the parameters stay the eager reference's.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, capturable=True)
    step = GraphedStep(torch.compile(model) if compiled else model, optimizer,
                       _batch(EXAMPLE_LENGTHS, 0, "cuda"), _planned)
    for batch, (want_loss, want_grads) in zip(loaded, wanted):
        loss, grads = _replayed(step, model, batch)
        assert_close(loss, want_loss, dtype="float32")
        for got, want in zip(grads, want_grads, strict=True):
            assert_close(got, want, dtype="float32")


@pytest.mark.gpu
def test_cuda_graphed_top_n_step_matches_the_eager_step():
    """The paper's fixed Top-N (fewer kept rows than the batch's real ones, so the ranking
    matters) captured in CUDA graphs: its selection never waits for the host, and two loaded
    batches in turn give the eager step's loss and gradients."""
    torch.manual_seed(0)
    model = _tiny_bert("cuda")
    apply_sebp(model, RowPolicy(max_rows=16), impl="triton")
    loaded = [_batch(LOADED_LENGTHS, 1, "cuda"), _batch([2, 24, 7], 2, "cuda")]
    wanted = [_eager_grads(model, b, contextlib.nullcontext()) for b in loaded]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, capturable=True)
    step = GraphedStep(model, optimizer, _batch(EXAMPLE_LENGTHS, 0, "cuda"),
                       lambda inputs: contextlib.nullcontext())
    for batch, (want_loss, want_grads) in zip(loaded, wanted):
        loss, grads = _replayed(step, model, batch)
        assert_close(loss, want_loss, dtype="float32")
        for got, want in zip(grads, want_grads, strict=True):
            assert_close(got, want, dtype="float32")
