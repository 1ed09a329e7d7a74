"""Figures of a model benchmark's result file (:mod:`benchmarks.workloads`): PNGs beside the JSON.

* ``<stem>_speedup.png``: backward (and, where the run traced it, the backward's GPU time) and
  train-step speedup of every variant over ``jax-dense``, per workload and batch size.
* ``<stem>_breakdown.png``: forward, backward and optimizer time of every variant, stacked, one
  panel per workload and batch size.
* ``<stem>_memory.png``: peak device memory of every variant per workload and batch size.

Importing this module needs matplotlib. To render the figures of a result file made where
matplotlib was missing: ``python -m benchmarks.figures benchmarks/results/bert.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.workloads import BASELINE, EINSUM_BASELINE, VARIANTS, speedups  # noqa: E402

__all__ = ["render"]

_PARTS = (("fwd_ms", "forward"), ("bwd_ms", "backward"), ("opt_ms", "AdamW"))


def _cases(rows: Sequence[dict]) -> list[tuple[str, int]]:
  """``(workload, batch)`` pairs in the order the rows first name them."""
  return list(dict.fromkeys((r["workload"], r["batch"]) for r in rows))


def _variants(rows: Sequence[dict]) -> list[str]:
  present = {r["variant"] for r in rows}
  return [v.name for v in VARIANTS if v.name in present]


@dataclasses.dataclass(frozen=True)
class _Table:
  """A model benchmark's rows, arranged for plotting."""

  cases: list[tuple[str, int]]  # (workload, batch), in the rows' order
  variants: list[str]  # in VARIANTS order
  several_batches: bool
  rows: dict[tuple[str, int, str], dict]  # (workload, batch, variant) -> row

  @classmethod
  def of(cls, result: dict) -> "_Table":
    rows = result["rows"]
    return cls(_cases(rows), _variants(rows), len(result["batch_sizes"]) > 1,
               {(r["workload"], r["batch"], r["variant"]): r for r in rows})

  def value(self, case: tuple[str, int], variant: str, key: str):
    """The row's ``key``, or ``None`` where the row or the value is missing."""
    return (self.rows.get((*case, variant)) or {}).get(key)


def _save(fig, path: pathlib.Path) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _label(case: tuple[str, int], several_batches: bool) -> str:
  return f"{case[0]} b{case[1]}" if several_batches else case[0]


def _grouped_bars(ax, cases, variants, value, several_batches: bool) -> None:
  """One group of bars per case, one bar per variant; ``value(case, variant)`` may be None."""
  width = 0.8 / max(len(variants), 1)
  x = np.arange(len(cases))
  for i, variant in enumerate(variants):
    heights = [value(case, variant) for case in cases]
    ax.bar(x + (i - (len(variants) - 1) / 2) * width,
           [np.nan if h is None else h for h in heights], width, label=variant)
  ax.set_xticks(x, [_label(c, several_batches) for c in cases], rotation=45, ha="right")


def _speedup_panels(rows: Sequence[dict]) -> list[tuple[str, str]]:
  """``(row key, title)`` of the speedup figure's panels: the backward, its GPU time where the run
  traced it (:mod:`benchmarks.device_trace`, JAX on a GPU), the train step."""
  traced = any(r.get("gpu_bwd_ms") for r in rows)
  return [("bwd_ms", "backward"), *([("gpu_bwd_ms", "backward, GPU time")] if traced else []),
          ("step_ms", "train step")]


def _speedup_figure(result: dict, path: pathlib.Path) -> None:
  table = _Table.of(result)
  cases, several = table.cases, table.several_batches
  variants = [v for v in table.variants if v not in (BASELINE, EINSUM_BASELINE)]
  panels = _speedup_panels(result["rows"])
  ratios = speedups(result["rows"], [key for key, _ in panels])
  fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.9 * len(cases) + 3), 4 * len(panels)),
                           sharex=True, squeeze=False)
  for index, (ax, (_, title)) in enumerate(zip(axes[:, 0], panels)):
    _grouped_bars(ax, cases, variants,
                  lambda case, v: ratios.get((*case, v), (None,) * len(panels))[index], several)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel(f"{title} speedup over {BASELINE}"
                  + (f" ({EINSUM_BASELINE} for -einsum)" if EINSUM_BASELINE in table.variants
                     else ""))
  if variants:  # above the bars, not over them
    axes[0, 0].legend(ncol=3, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.08))
  axes[0, 0].set_title(f"{result['benchmark']}: {result['gpu']}, {result['dtype']}, "
                       f"context {result['seq_len']}")
  _save(fig, path)


def _breakdown_figure(result: dict, path: pathlib.Path) -> None:
  table = _Table.of(result)
  cases, variants = table.cases, table.variants
  cols = min(4, len(cases))
  grid_rows = math.ceil(len(cases) / cols)
  fig, axes = plt.subplots(grid_rows, cols, figsize=(4 * cols, 3.6 * grid_rows), squeeze=False)
  for ax, case in zip(axes.flat, cases):
    bottom = np.zeros(len(variants))
    for key, part in _PARTS:
      heights = np.array([table.value(case, v, key) or 0.0 for v in variants])
      ax.bar(np.arange(len(variants)), heights, bottom=bottom, label=part)
      bottom += heights
    ax.set_xticks(np.arange(len(variants)), variants, rotation=60, ha="right", fontsize=7)
    ax.set_title(_label(case, table.several_batches), fontsize=9)
    ax.set_ylabel("ms")
  for ax in list(axes.flat)[len(cases):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  fig.suptitle(f"{result['benchmark']}: time per training step ({result['gpu']})")
  _save(fig, path)


def _memory_figure(result: dict, path: pathlib.Path) -> None:
  table = _Table.of(result)

  def gigabytes(case, variant):
    peak = table.value(case, variant, "peak_mem_bytes")
    return None if peak is None else peak / 1e9

  fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(table.cases) + 3), 4.5))
  _grouped_bars(ax, table.cases, table.variants, gigabytes, table.several_batches)
  ax.set_ylabel("peak device memory (GB)")
  ax.set_title(f"{result['benchmark']}: peak memory of a training step ({result['gpu']})")
  ax.legend(ncol=3, fontsize=8)
  _save(fig, path)


def _layer_speedup_figure(result: dict, path: pathlib.Path) -> None:
  """Layer benchmark: backward speedup over dense vs active fraction, one panel per shape."""
  rows = result["rows"]
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "dense"]
  columns = min(len(shapes), 3)
  fig, axes = plt.subplots(-(-len(shapes) // columns), columns, squeeze=False,
                           figsize=(4.2 * columns, 3.4 * -(-len(shapes) // columns)))
  for ax, shape in zip(axes.flat, shapes):
    for impl in impls:
      points = sorted((r["active_fraction"], r["speedup_vs_dense"]) for r in rows
                      if r["shape"] == shape and r["impl"] == impl)
      style = dict(color="black", linestyle="--") if impl == "ideal" else {}
      ax.plot(*zip(*points), marker="o", label=impl, **style)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(shape)
    ax.set_xlabel("active rows")
    ax.set_ylabel("backward speedup over dense")
  for ax in list(axes.flat)[len(shapes):]:
    ax.axis("off")
  axes.flat[0].legend()
  fig.suptitle(f"SEBP backward of one layer, {result['dtype']}, {result.get('gpu') or result['device']}")
  _save(fig, path)


def render(result: dict, out_dir: pathlib.Path, stem: str) -> list[pathlib.Path]:
  """Writes the figures of ``result`` (a result file's content); returns their paths.

  A layer benchmark (rows with a ``shape``) gets one speedup figure; a model benchmark three.
  """
  if result["rows"] and "shape" in result["rows"][0]:
    path = out_dir / f"{stem}_speedup.png"
    _layer_speedup_figure(result, path)
    return [path]
  paths = []
  for suffix, draw in (("speedup", _speedup_figure), ("breakdown", _breakdown_figure),
                       ("memory", _memory_figure)):
    path = out_dir / f"{stem}_{suffix}.png"
    draw(result, path)
    paths.append(path)
  return paths


def _main() -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.figures")
  parser.add_argument("results", type=pathlib.Path, nargs="+", help="result JSON files")
  for path in parser.parse_args().results:
    for written in render(json.loads(path.read_text()), path.parent, path.stem):
      print(written)


if __name__ == "__main__":
  _main()
