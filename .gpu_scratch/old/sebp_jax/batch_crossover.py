"""``sebp_value_and_grad``: the dense-or-sparse decision made once per call, not once per layer.

Every SEBP layer decides on its own whether its kept rows are few enough for the sparse backward
(``crossover``), with one ``lax.cond`` per layer. On GPU each of those makes XLA copy the predicate
to the host and wait for it: measured on an H200, 2.2–2.9 ms of a 22–24 ms BERT-base training
step (74 layers; ``benchmarks/NOTES.md``, "The backward decomposition"). With padding sparsity
the fraction of real tokens is known from the batch before the forward, and every layer would
decide the same way: :func:`sebp_value_and_grad` decides once, from the batch, and compiles the
per-layer conditionals out.

Under ``jit`` that one decision is still a ``lax.cond``, and XLA:GPU runs a conditional's body
outside its CUDA graphs: measured on an H100 (bf16, jax 0.11.2), a BERT-base step with a row
plan took 1.1–1.2 ms less (of 22) on two of three workloads with ``crossover=1.0`` (no
conditional) than with the per-step one (``benchmarks/NOTES.md``, "v10"). A training loop that
holds its batches on the host can decide there instead, with :func:`above_crossover`, between a
step jitted with ``crossover=1.0`` and a dense one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from sebp_jax.linen import ModulePath, swap_dense
from sebp_jax.matmul import _check_crossover, resolve_impl
from sebp_jax.plan import row_plan
from sebp_jax.policy import RowPolicy

__all__ = ["sebp_value_and_grad", "above_crossover"]


def _measured_crossover() -> float:
  """The Pallas backward's default crossover (measured: ``benchmarks/NOTES.md``)."""
  from sebp_jax.backends.pallas import BlockConfig  # lazily, as sebp_matmul imports Pallas

  return BlockConfig().crossover


def above_crossover(active_fraction: float, crossover: float | None = None) -> bool:
  """Whether a batch whose rows are real in ``active_fraction`` of cases is past the crossover,
  where the dense backward is the faster one: the same rule as :func:`sebp_value_and_grad`,
  decided on the host.

  Use it to pick between two jitted steps, one built with ``crossover=1.0`` (no conditional in
  the program) and one dense:

  >>> import numpy as np
  >>> mask = np.zeros((4, 512), np.int32); mask[:, :40] = 1   # 40 real tokens of 512
  >>> above_crossover(mask.mean())                           # 7.8 %: run the SEBP step
  False
  >>> above_crossover(0.9)
  True

  Args:
    active_fraction: the real-token fraction of the batch, a host number (e.g. the mean of its
      NumPy attention mask; a device array here would wait for the device).
    crossover: as in :func:`sebp_value_and_grad`; ``None``: the Pallas backward's measured
      default.
  """
  _check_crossover(crossover)
  fraction = float(active_fraction)
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"above_crossover: `active_fraction` must be in [0, 1], got {fraction}.")
  return fraction > (_measured_crossover() if crossover is None else crossover)


def sebp_value_and_grad(
  fun: Callable[..., Any],
  active_fraction: Callable[..., jax.Array] | None = None,
  *,
  rows: Callable[..., jax.Array] | None = None,
  check_rows: bool = False,
  crossover: float | None = None,
  where: Callable[[ModulePath], bool] | None = None,
  impl: str = "auto",
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad(fun)`` with the SEBP backward on ``fun``'s ``nn.Dense`` layers, or the
  dense backward, chosen once per call from ``active_fraction``.

  The exact policy only (``RowPolicy()``: drop the all-zero gradient rows): there the dense
  backward computes the same gradients, so the choice changes the speed and never the result.
  A policy that also drops nonzero rows must decide per layer (:func:`sebp_jax.swap_dense`).
  ``fun`` is traced once per branch, so compiling takes about twice as long as for
  ``jax.value_and_grad``; the branches share their buffers (measured on an H200: a BERT-base
  training step's peak memory equals the dense step's, and the step is as fast as with
  ``crossover=1.0``, 1.14–1.22× over dense; ``benchmarks/NOTES.md``).

  Args:
    fun: the function to differentiate, e.g. a loss of ``(params, batch)``. It must trace its
      Flax model when called (not be a function jitted elsewhere: see :func:`swap_dense`).
    active_fraction: called with ``fun``'s arguments, returns a scalar: the fraction of rows
      that carry real tokens, e.g. ``lambda params, batch: batch["attention_mask"].mean()``.
      Only the speed depends on it. Optional with ``rows``: the mask's mean.
    rows: called with ``fun``'s arguments, returns the mask of real tokens over the layers'
      leading dims, e.g. ``lambda params, batch: batch["attention_mask"]``: a row plan
      (:func:`sebp_jax.row_plan`) made once per step and shared by every layer of that shape, so
      no layer reads ``dy`` to find its rows. Exact when every row outside the mask has a zero
      output gradient (padding that attention and the loss ignore).
    check_rows: with ``rows``, verify in every layer that no row outside the mask has a non-zero
      gradient, raising an error that names the layer (for tests and first runs).
    crossover: above this fraction the dense backward runs; at or below it, every selected Dense
      runs the SEBP backward with no per-layer conditional. ``None``: the Pallas backward's
      measured default (0.4); ``>= 1``: always SEBP, no conditional at all.
    where: which Dense layers get SEBP, as in :func:`sebp_jax.swap_dense`.
    impl: the SEBP backend, as in :func:`sebp_jax.sebp_matmul`.
    argnums, has_aux: as in :func:`jax.value_and_grad`.

  Returns:
    A function of ``fun``'s arguments returning what ``jax.value_and_grad(fun, argnums,
    has_aux)`` returns.

  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> model = nn.Dense(4)
  >>> x = jnp.zeros((6, 3)).at[:2].set(1.0)              # 2 real rows of 6
  >>> params = model.init(jax.random.key(0), x)
  >>> loss = lambda params, x: (model.apply(params, x) * (x[:, :1] != 0)).sum()
  >>> real = lambda params, x: jnp.mean(x[:, 0] != 0)
  >>> value, grads = jax.jit(sebp_value_and_grad(loss, real))(params, x)
  >>> grads["params"]["kernel"].shape
  (3, 4)
  """
  if not callable(fun):
    raise TypeError(f"sebp_value_and_grad: `fun` must be callable, got {type(fun).__name__}.")
  if rows is not None and not callable(rows):
    raise TypeError(f"sebp_value_and_grad: `rows` must be callable (the arguments of `fun` -> a "
                    f"mask over the layers' leading dims), got {type(rows).__name__}.")
  if active_fraction is None and rows is not None:
    active_fraction = lambda *args, **kwargs: jnp.mean(jnp.asarray(rows(*args, **kwargs)) != 0)
  if not callable(active_fraction):
    raise TypeError(f"sebp_value_and_grad: `active_fraction` must be callable (the arguments of "
                    f"`fun` -> a scalar), got {type(active_fraction).__name__}.")
  _check_crossover(crossover)
  resolve_impl(impl)  # an unknown impl is named now, not when the first call traces
  if crossover is None:
    crossover = _measured_crossover()
  dense = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

  def sparse(*args, **kwargs):
    plan = None if rows is None else row_plan(rows(*args, **kwargs), check=check_rows)
    with swap_dense(RowPolicy(), where=where, impl=impl, crossover=1.0, rows=plan):
      return dense(*args, **kwargs)

  if crossover >= 1.0:
    return sparse

  def value_and_grad(*args, **kwargs):
    fraction = jnp.asarray(active_fraction(*args, **kwargs))
    if fraction.shape != () or not (jnp.issubdtype(fraction.dtype, jnp.floating)
                                    or jnp.issubdtype(fraction.dtype, jnp.integer)):
      raise ValueError(f"sebp_value_and_grad: `active_fraction` must return a real scalar, got "
                       f"shape {fraction.shape} and dtype {fraction.dtype}.")
    return lax.cond(fraction > crossover, lambda: dense(*args, **kwargs),
                    lambda: sparse(*args, **kwargs))

  return value_and_grad
