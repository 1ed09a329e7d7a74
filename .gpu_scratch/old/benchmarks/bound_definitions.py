"""How much the definition of the bound moves it, and what separates SEBP from it.

The bound of the model benchmarks is the model with every linear layer's backward made free. Three
ways to make it free, on one model, workload and batch size:

* ``jax-bound`` (:func:`benchmarks.workloads.free_linear_backward`, the benchmarks' bound): zero
  ``dx`` and ``dkernel`` that depend on ``dy`` at run time. Everything between the linear layers
  (attention, activations, norms) keeps its backward, as it must under SEBP, whose ``dx`` is not
  zero.
* ``zeros, dy unread``: the same zeros as constants, and nothing reads ``dy``. Where a bias
  gradient reads it (BERT) that only drops ``jax-bound``'s one read of ``dy`` per layer, a read
  SEBP makes too (its row scores); where none does (LLaMA), XLA deletes everything that only feeds
  ``dy``: the backward between linear layers. The first version of ``jax-bound`` was this one.
* ``no gradient``: ``stop_gradient`` on both operands of every linear layer. JAX's autodiff never
  builds the backward of anything whose gradient only flows into a linear layer.

And two backwards that do a linear layer's work, towards SEBP:

* ``compacted rows, cuBLAS``: the ceiling of SEBP on this card. Each layer gathers the batch's
  real rows into a buffer of a static size that holds every timed batch's real tokens (known on
  the host, so no runtime count), runs both products on them in XLA (cuBLAS) and scatters ``dx``
  into zeros; the real rows come from the attention mask once per step, as a row plan's do. What
  it adds to ``jax-bound`` is what every SEBP backward pays: the gather, the products of the real
  rows and the write of all of ``dx`` (``jax-bound``'s zeros fuse into the ops that read them).
* ``SEBP, row plan``: the product, as ``sebp finetune`` runs it (``swap_dense`` with the attention
  mask as :func:`sebp_jax.row_plan`, ``crossover=1.0``; ``--impl``, default ``pallas``).

For each, the forward and the loss-and-gradients program are timed on the device
(:func:`benchmarks.timing.device_time_ms`), the backward is their difference, and the compiled
program's instructions are counted. The looser definitions are not bounds of SEBP: they skip work
SEBP has to do. They show what a bound measured that way would claim.
``--definitions`` picks some (dense is always measured first: the speedups are over it).

Usage (writes ``bound_definitions_bert_b32_glue_sst2.json`` and ``.md`` under ``--out-dir``)::

    python -m benchmarks.bound_definitions --model bert --batch 32 --workload glue_sst2 \\
        --out-dir benchmarks/results
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from typing import Any, Callable, Sequence

from benchmarks.workloads import (
  Settings, free_linear_backward, weight_kernel, prepared_workload, single_workload_parser,
  versions_text, xla_flags_text,
)

__all__ = ["Known", "DEFINITIONS", "static_capacity", "hlo_instructions", "measure",
           "markdown_table"]


@dataclasses.dataclass(frozen=True)
class Known:
  """What a definition's linear layers may know of the batch.

  Attributes:
    mask: the batch's ``(batch, seq_len)`` attention mask (traced): its non-zero entries are the
      real tokens, the rows of every linear layer that a padded batch's gradient can reach.
    capacity: static, at least every timed batch's count of real tokens
      (:func:`static_capacity`): the size of ``compacted rows, cuBLAS``'s gathered buffers.
    impl: the SEBP backend of ``SEBP, row plan``.
  """

  mask: Any
  capacity: int
  impl: str = "pallas"


def _unread_dy_backward(residuals, dy):
  import jax.numpy as jnp

  x, kernel = residuals
  del dy  # nothing reads it: the zeros are compile-time constants
  return jnp.zeros(x.shape, x.dtype), jnp.zeros(kernel.shape, kernel.dtype)


def _no_gradient_dot_general(lhs, rhs, dimension_numbers, precision=None,
                             preferred_element_type=None):
  from jax import lax

  return lax.dot_general(lax.stop_gradient(lhs), lax.stop_gradient(rhs), dimension_numbers,
                         precision=precision, preferred_element_type=preferred_element_type)


def _no_gradient() -> contextlib.AbstractContextManager:
  from sebp_jax.linen import swap_dot_general

  return swap_dot_general(_no_gradient_dot_general)


def _compacted_matmul_fwd(x, kernel, rows):
  from jax import lax

  return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))), (x, kernel, rows)


def _compacted_matmul_bwd(residuals, dy):
  import jax.numpy as jnp

  x, kernel, rows = residuals
  x2d, dy2d = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
  exact = dict(mode="promise_in_bounds", unique_indices=True)
  dy_rows = dy2d.at[rows].get(**exact)
  dx = jnp.zeros_like(x2d).at[rows].set(dy_rows @ kernel.T, **exact)
  return dx.reshape(x.shape), x2d.at[rows].get(**exact).T @ dy_rows, None


@functools.cache
def _compacted_matmul():
  import jax

  matmul = jax.custom_vjp(lambda x, kernel, rows: _compacted_matmul_fwd(x, kernel, rows)[0])
  matmul.defvjp(_compacted_matmul_fwd, _compacted_matmul_bwd)
  return matmul


def _compacted_rows(known: Known) -> contextlib.AbstractContextManager:
  """Every linear layer whose rows are the mask's: its backward on ``known.capacity`` gathered
  rows, the real ones first (the rest are padding rows, whose ``dy`` is zero)."""
  from jax import lax

  from sebp_jax.linen import swap_dot_general
  from sebp_jax.policy import active_first_permutation

  perm, _ = active_first_permutation((known.mask != 0).reshape(-1))
  rows = perm[:known.capacity]

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    kernel = weight_kernel(lhs, rhs, dimension_numbers, preferred_element_type)
    if lhs.shape[:-1] == known.mask.shape and kernel is not None:
      return _compacted_matmul()(lhs, kernel, rows)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)

  return swap_dot_general(dot_general)


def _sebp_row_plan(known: Known) -> contextlib.AbstractContextManager:
  from sebp_jax import RowPolicy, row_plan, swap_dense

  return swap_dense(RowPolicy(), impl=known.impl, crossover=1.0, rows=row_plan(known.mask))


# name -> the context the loss is traced in, given what the layers may know of the batch; "dense"
# is the reference every speedup is over.
DEFINITIONS: dict[str, Callable[[Known], contextlib.AbstractContextManager]] = {
  "dense": lambda known: contextlib.nullcontext(),
  "jax-bound": lambda known: free_linear_backward(),
  "zeros, dy unread": lambda known: free_linear_backward(_unread_dy_backward),
  "no gradient": lambda known: _no_gradient(),
  "compacted rows, cuBLAS": _compacted_rows,
  "SEBP, row plan": _sebp_row_plan,
}


def static_capacity(batches: Sequence[dict], multiple: int = 8) -> int:
  """The most real tokens of any of ``batches``, rounded up to ``multiple`` (at most the padded
  token count): a static row count that holds every batch's real rows."""
  import numpy as np

  masks = [np.asarray(batch["attention_mask"]) for batch in batches]
  most = max(int(np.count_nonzero(mask)) for mask in masks)
  return min(-(-most // multiple) * multiple, masks[0].size)

# One instruction per line of XLA's HLO text: "  [ROOT ]name = type op(...)".
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ", re.MULTILINE)


def hlo_instructions(hlo_text: str) -> int:
  """Instructions in an HLO module's text (every computation's, fusions' bodies included)."""
  return len(_INSTRUCTION.findall(hlo_text))


def measure(loss: Callable[[Any, dict], Any], params: Any, batches: Sequence[dict],
            definition: str, *, impl: str = "pallas") -> dict:
  """Forward, loss-and-gradients and backward device time (ms) of ``loss`` traced under one of
  :data:`DEFINITIONS`, and the loss-and-gradients program's instruction count.

  ``loss(params, batch)`` is the model's loss; ``batches`` (>= 2, the same shapes, each with an
  ``attention_mask``) are the distinct inputs the timing alternates over; ``impl`` is the SEBP
  backend of ``SEBP, row plan``.
  """
  import jax

  from benchmarks.timing import device_time_ms

  context, capacity = DEFINITIONS[definition], static_capacity(batches)

  def traced_loss(params, batch):
    with context(Known(batch["attention_mask"], capacity, impl)):
      return loss(params, batch)

  value_and_grad = jax.value_and_grad(traced_loss)
  inputs = [(params, batch) for batch in batches]
  fwd = device_time_ms(traced_loss, inputs)
  grad = device_time_ms(value_and_grad, inputs)
  hlo = jax.jit(value_and_grad).lower(params, batches[0]).compile().as_text()
  return {"definition": definition, "fwd_ms": fwd, "grad_ms": grad, "bwd_ms": grad - fwd,
          "hlo_instructions": hlo_instructions(hlo)}


def markdown_table(result: dict) -> str:
  """Each definition's times, its backward speedup over dense and its program size."""
  dense_bwd = next(r["bwd_ms"] for r in result["rows"] if r["definition"] == "dense")
  lines = [
    f"# Bound definitions, {result['benchmark']}: {result['gpu']}, {result['dtype']}, batch "
    f"{result['batch']} × {result['seq_len']}, {result['workload']} "
    f"({100 * result['active_fraction']:.1f} % real tokens)",
    "",
    f"Device time per call (median slope over {result['reps']} distinct batches), "
    "backward = loss-and-gradients − "
    f"forward; instructions of the compiled loss-and-gradients program. Versions: "
    f"{versions_text(result['versions'])}.{xla_flags_text(result)}",
    "",
    "| definition | fwd ms | fwd+bwd ms | bwd ms | bwd × dense | HLO instructions |",
    "|---|---|---|---|---|---|",
  ]
  for row in result["rows"]:
    speedup = dense_bwd / row["bwd_ms"] if row["bwd_ms"] > 0 else float("inf")
    lines.append(f"| {row['definition']} | {row['fwd_ms']:.2f} | {row['grad_ms']:.2f} | "
                 f"{row['bwd_ms']:.2f} | {speedup:.2f}× | {row['hlo_instructions']} |")
  return "\n".join(lines) + "\n"


def _main(argv: Sequence[str] | None = None) -> None:
  parser = single_workload_parser("python -m benchmarks.bound_definitions")
  # Each timed program holds `reps` copies of the model: compiling six copies of BERT-base for six
  # definitions took longer than a 170 s device call (benchmarks/NOTES.md, "v11").
  parser.add_argument("--reps", type=int, default=2,
                      help="distinct batches timed, copies of the model per timed program (>= 2)")
  parser.add_argument("--definitions", nargs="+", choices=list(DEFINITIONS)[1:],
                      default=list(DEFINITIONS)[1:], metavar="NAME",
                      help=f"besides dense (default: all): {', '.join(list(DEFINITIONS)[1:])}")
  parser.add_argument("--impl", default="pallas", choices=["pallas", "interpret", "xla"],
                      help="the SEBP backend of 'SEBP, row plan' (default pallas)")
  args = parser.parse_args(argv)
  if args.reps < 2:
    parser.error("--reps must be >= 2")
  spec, module, params, batches, header, stem = prepared_workload(
    parser, args, Settings(warmup=0, steps=args.reps))

  def loss(params, batch):
    return spec.jax_loss(module, params, batch)

  result = {**header, "reps": args.reps, "rows": []}
  stem = f"bound_definitions_{stem}"
  args.out_dir.mkdir(parents=True, exist_ok=True)
  for definition in ["dense", *args.definitions]:
    row = measure(loss, params, batches, definition, impl=args.impl)
    result["rows"].append(row)
    print(f"{definition}: fwd {row['fwd_ms']:.2f} ms, bwd {row['bwd_ms']:.2f} ms, "
          f"{row['hlo_instructions']} instructions", flush=True)
    # Rewritten after every definition: a run cut short keeps what it measured.
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(markdown_table(result))


if __name__ == "__main__":
  _main()
