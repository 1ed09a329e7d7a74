"""Print the JAX-vs-PyTorch parity report: each comparison, its worst relative error, tolerance.

Usage::

  JAX_PLATFORMS=cpu python -m parity_tests.report            # layer, model and training levels
  python -m parity_tests.report --levels layer model         # a subset
  python -m parity_tests.report --gpu                        # adds the Pallas and Triton backends

Runs the comparisons of :mod:`parity_tests.comparisons` (the ones the parity tests assert) and
prints a markdown table with one row per setting and quantity: how many values were compared,
the worst error relative to the reference's scale (``max |jax - torch| / max |torch|``, or the
parameter's scale for gradients), the tolerance, and whether every comparison passed. Exits with
status 1 if any failed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Iterable, Iterator

from parity_tests import comparisons
from parity_tests.comparisons import Comparison

__all__ = ["LEVELS", "run", "markdown_table", "main"]

LEVELS = ("layer", "model", "training")


def _layer(gpu: bool) -> Iterator[Comparison]:
  jax_impls = (*comparisons.JAX_IMPLS, *(["pallas"] if gpu else []))
  torch_impls = (*comparisons.TORCH_IMPLS, *(["triton"] if gpu else []))
  for dtype, policy, jax_impl, torch_impl in itertools.product(
      ("float32", "bfloat16"), comparisons.POLICIES, jax_impls, torch_impls):
    if comparisons.supports(jax_impl, policy) and comparisons.supports(torch_impl, policy):
      yield from comparisons.layer_comparisons(dtype, policy, jax_impl, torch_impl)


def _impl_pairs(gpu: bool) -> list[tuple[str, str]]:
  return [("xla", "torch"), *([("pallas", "triton")] if gpu else [])]


def _model(gpu: bool) -> Iterator[Comparison]:
  for arch, policy, impls in itertools.product(
      comparisons.MODEL_ARCHS, comparisons.MODEL_POLICIES, _impl_pairs(gpu)):
    yield from comparisons.model_comparisons(arch, policy, *impls)


def _training(gpu: bool) -> Iterator[Comparison]:
  for arch, impls in itertools.product(("bert", "llama"), _impl_pairs(gpu)):
    yield from comparisons.training_comparisons(arch, "exact", *impls)


_RUNNERS = {"layer": _layer, "model": _model, "training": _training}


def run(levels: Iterable[str] = LEVELS, *, gpu: bool = False) -> list[Comparison]:
  """Every comparison of the given levels (``"layer"``, ``"model"``, ``"training"``)."""
  levels = list(levels)
  unknown = set(levels) - set(LEVELS)
  if unknown:
    raise ValueError(f"`levels` must be among {LEVELS}, got {sorted(unknown)}.")
  return [c for level in levels for c in _RUNNERS[level](gpu)]


def markdown_table(results: list[Comparison]) -> str:
  """One row per (group, quantity): count, worst error (and where), tolerance, pass/fail."""
  rows = {}
  for c in results:
    rows.setdefault((c.group, c.quantity), []).append(c)
  lines = ["| setting | quantity | compared | worst rel. error | where | tolerance | result |",
           "|---|---|---:|---:|---|---|---|"]
  for (group, quantity), group_results in rows.items():
    worst = max(group_results, key=lambda c: c.error)
    failed = sum(not c.passed for c in group_results)
    result = "pass" if not failed else f"**FAIL** ({failed})"
    lines.append(f"| {group} | {quantity} | {len(group_results)} | {worst.error:.2e} | "
                 f"{worst.detail} | {worst.tolerance_text} | {result} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m parity_tests.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
  parser.add_argument("--gpu", action="store_true",
                      help="also compare the GPU backends (jax pallas, torch triton)")
  args = parser.parse_args(argv)
  results = run(args.levels, gpu=args.gpu)
  print(markdown_table(results))
  failed = sum(not c.passed for c in results)
  print(f"\n{len(results)} comparisons, {failed} failed.")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
