"""A torch training step captured in CUDA graphs and replayed per batch on static input buffers.

How PyTorch users take the host out of a step whose kernels are shorter than their launches (the
torch docs' "whole-network capture"): warm up on a side stream, capture once, then per step copy
the batch into the static buffers and replay. :func:`benchmarks.workloads.run_torch` runs the
``*-graphed`` variants this way; on BERT-base b32 the eager step waits on the host (issue 19).

The step is three graphs, forward, backward and optimizer step, captured in that order into one
memory pool and replayed in that order (as ``torch.cuda.make_graphed_callables`` does with its
forward and backward graphs): the benchmark's CUDA events between the replays then time the same
three phases as in the eager variants. Everything the forward records for its backward, the row
plan of ``with row_plan(static mask)`` included, lives in the graphs' pool and is rewritten by
each forward replay; the row plan's permutation is made inside the backward graph, from the static
mask, so each replay keeps the rows of the batch just loaded.

Gradients are set to ``None`` before the capture: the backward's capture then allocates them in
the graphs' pool, and every replay writes them afresh (no zeroing step, as in the docs' example).
The optimizer must be capturable (``AdamW(..., capturable=True)``: its step count on the device).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping

__all__ = ["CudaGraphs", "GraphedStep"]


class CudaGraphs:
  """Records callables as CUDA graphs sharing one memory pool (the graphs must replay in the
  order they were recorded) and runs warm-up work on a side stream, as capture requires."""

  def __init__(self, torch) -> None:
    if not torch.cuda.is_available():
      raise ValueError("CudaGraphs: CUDA graphs need a CUDA device, and torch sees none.")
    self._torch = torch
    self._pool = torch.cuda.graph_pool_handle()

  @contextlib.contextmanager
  def side_stream(self):
    """Work inside runs on a fresh stream ordered after the current one's, and before its later
    work: warm-up iterations must not run on the stream that capture uses."""
    cuda = self._torch.cuda
    stream = cuda.Stream()
    stream.wait_stream(cuda.current_stream())
    with cuda.stream(stream):
      yield
    cuda.current_stream().wait_stream(stream)

  def record(self, fn: Callable[[], None]):
    """``fn``'s kernels as a ``torch.cuda.CUDAGraph`` (``.replay()`` reruns them)."""
    graph = self._torch.cuda.CUDAGraph()
    with self._torch.cuda.graph(graph, pool=self._pool):
      fn()
    return graph


class GraphedStep:
  """One training step ``model(**batch).loss``, ``backward()``, ``optimizer.step()`` as three
  recorded graphs over static copies of ``batch``'s tensors.

  >>> step = GraphedStep(model, optimizer, batch, forward_context)  # doctest: +SKIP
  >>> step.load(next_batch); step.forward.replay(); step.backward.replay(); step.step.replay()  # doctest: +SKIP

  Args:
    model: a module whose ``forward(**batch)`` returns an object with ``.loss``.
    optimizer: the model's optimizer; capturable where the graphs are CUDA graphs.
    batch: example tensors, one per model input; their shapes and dtypes are the static buffers'.
    forward_context: ``(inputs) -> context manager`` the forward runs under, given the static
      buffers (e.g. a row plan of ``inputs["attention_mask"]``).
    graphs: what records and warms up: :class:`CudaGraphs` by default; tests pass a stand-in.
    warmup_steps: eager steps on the side stream before the capture (Triton compiles, cuBLAS
      picks its kernels, the optimizer allocates its state).

  Attributes:
    inputs: the static buffers, by input name.
    forward, backward, step: the recorded graphs (``.replay()``).
    loss: the loss tensor the forward graph writes.
  """

  def __init__(self, model, optimizer, batch: Mapping[str, Any],
               forward_context: Callable[[dict], ContextManager], *, graphs=None,
               warmup_steps: int = 3) -> None:
    if warmup_steps < 1:
      raise ValueError(f"GraphedStep: `warmup_steps` must be >= 1, got {warmup_steps}.")
    if graphs is None:
      import torch

      graphs = CudaGraphs(torch)
    self.inputs = {name: tensor.clone() for name, tensor in batch.items()}
    self.loss = None

    def forward() -> None:
      with forward_context(self.inputs):
        self.loss = model(**self.inputs).loss

    def backward() -> None:
      self.loss.backward()

    with graphs.side_stream():
      for _ in range(warmup_steps):
        forward()
        backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    self.forward = graphs.record(forward)
    self.backward = graphs.record(backward)
    self.step = graphs.record(optimizer.step)
    # The graphs write and read these addresses: keep them alive even once another step's
    # capture has set the parameters' .grad to None again.
    self._grads = [p.grad for p in model.parameters()]

  def load(self, batch: Mapping[str, Any]) -> None:
    """Copies ``batch`` into the static buffers (same names, shapes and dtypes as the example)."""
    if set(batch) != set(self.inputs):
      raise ValueError(f"GraphedStep.load: `batch` has inputs {sorted(batch)}, the graphs were "
                       f"captured with {sorted(self.inputs)}.")
    for name, tensor in batch.items():
      static = self.inputs[name]
      if tensor.shape != static.shape or tensor.dtype != static.dtype:
        raise ValueError(f"GraphedStep.load: input {name!r} is {tuple(tensor.shape)} "
                         f"{tensor.dtype}; the graphs were captured with {tuple(static.shape)} "
                         f"{static.dtype}.")
      static.copy_(tensor)
