"""One result file from several runs of a model benchmark that were split to fit a time limit.

A 3B-parameter model compiles for 20-40 s per variant, so its runs are split by variant and batch
size (``--variants``, ``--batches``, ``--tag``), each writing a result file of its own. Speedups
and figures need every variant of a workload in one file: this module concatenates the rows of
such files. It refuses files whose measurements are not comparable (another GPU, dtype, context,
step counts, library versions or JAX forward program), rows measured twice, and files of another
benchmark, naming the field; the merged header lists the files it came from under ``merged_from``.

Usage (writes ``llama_b1.json``, ``llama_b1.md`` and figures under ``--out-dir``)::

    python -m benchmarks.merge --stem llama_b1 --batches 1 --out-dir benchmarks/results \\
        benchmarks/results/raw/llama_b1_jax.json benchmarks/results/raw/llama_torch.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Sequence

from benchmarks.workloads import JAX_FORWARD, write_results

__all__ = ["merge_results"]

# Header fields that must agree for rows of different runs to be compared. (Not ``platform``: a
# torch-only run names it ``cuda`` where a JAX run names it ``gpu``; ``gpu`` names the card.)
_SAME = ("benchmark", "gpu", "dtype", "seq_len", "warmup", "steps", "versions", "jax_forward")
# What a header without the field measured.
_UNNAMED = {"jax_forward": JAX_FORWARD}


def merge_results(results: Sequence[dict], names: Sequence[str],
                  batches: Sequence[int] | None = None) -> dict:
  """The rows of ``results`` (result dicts of :mod:`benchmarks.workloads`) in one result dict.

  ``names`` (one per result) are recorded under ``merged_from``; ``batches``, if given, keeps only
  rows of those batch sizes. Raises ``ValueError`` naming the header field two results disagree
  on, or the ``(workload, batch, variant)`` that two results both measured.
  """
  if len(results) < 2:
    raise ValueError(f"`results`: need at least two result files to merge, got {len(results)}")
  if len(names) != len(results):
    raise ValueError(f"`names`: one name per result, got {len(names)} for {len(results)}")
  first = results[0]
  for name, result in zip(names[1:], results[1:]):
    for field in _SAME:
      theirs, ours = (r.get(field, _UNNAMED.get(field)) for r in (result, first))
      if theirs != ours:
        raise ValueError(f"{name}: field {field!r} is {theirs!r}, but {names[0]} has {ours!r}")
  rows, seen = [], {}
  for name, result in zip(names, results):
    for row in result["rows"]:
      if batches is not None and row["batch"] not in batches:
        continue
      key = (row["workload"], row["batch"], row["variant"])
      if key in seen:
        raise ValueError(f"{name}: {key} was measured in {seen[key]} too")
      seen[key] = name
      rows.append(row)
  if not rows:
    raise ValueError(f"`batches`: no row of batch size {list(batches or [])} in the results")
  merged = {field: first[field] for field in first if field != "rows"}
  merged["batch_sizes"] = sorted({row["batch"] for row in rows})
  merged["merged_from"] = list(names)
  merged["rows"] = rows
  return merged


def _main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.merge")
  parser.add_argument("results", type=pathlib.Path, nargs="+", help="result JSON files")
  parser.add_argument("--stem", required=True, help="name of the merged files")
  parser.add_argument("--out-dir", type=pathlib.Path,
                      help="where to write them (default: the first file's folder)")
  parser.add_argument("--batches", type=int, nargs="+", metavar="B",
                      help="keep only rows of these batch sizes")
  args = parser.parse_args(argv)
  merged = merge_results([json.loads(p.read_text()) for p in args.results],
                         [p.name for p in args.results], args.batches)
  for path in write_results(args.out_dir or args.results[0].parent, args.stem, merged):
    print(path)


if __name__ == "__main__":
  _main()
