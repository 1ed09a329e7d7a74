"""The ``sebp`` command: ``sebp finetune`` and ``sebp analyze``.

Argument parsing and error presentation only; the work is :mod:`sebp_jax.finetune`. Input the
user can fix (unknown names, a missing data package, truncation, a batch that does not fit, an
unreadable checkpoint) ends with one line ``sebp: error: ...`` that says what to do, and exit
status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import NoReturn, Sequence

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose errors are one line (no usage block), exit status 2."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
  return value


def _policy(text: str) -> str:
  from sebp_jax.finetune import UsageError, parse_policy

  try:
    parse_policy(text)
  except UsageError as e:
    raise argparse.ArgumentTypeError(str(e).removeprefix("--policy ")) from None
  return text


def _default(config_cls, name: str) -> str:
  """The default of a config field, for help texts (argparse's own defaults stay ``None`` so
  that options given on the command line can be told apart)."""
  return next(f.default for f in dataclasses.fields(config_cls) if f.name == name)


def _add_data_options(parser: argparse.ArgumentParser, config_cls) -> None:
  from sebp_jax.finetune import DTYPES, MODELS, TASKS

  default = functools.partial(_default, config_cls)
  parser.add_argument("--model", choices=list(MODELS), help="model to fine-tune")
  parser.add_argument("--task", choices=list(TASKS), help="offline dataset")
  parser.add_argument("--model-path", metavar="DIR",
                      help="checkpoint folder (config.json + safetensors) or .gguf file instead "
                           "of the bundled weights (minilm, smollm2) or random weights "
                           "(bert-base, llama-3.2-3b)")
  parser.add_argument("--max-length", type=_positive, metavar="N",
                      help=f"pad/truncate every sequence to N tokens "
                           f"(default {default('max_length')})")
  parser.add_argument("--batch-size", type=_positive, metavar="N",
                      help=f"sequences per batch (default {default('batch_size')})")
  parser.add_argument("--dtype", choices=list(DTYPES),
                      help=f"parameter and compute dtype (default {default('dtype')})")
  parser.add_argument("--seed", type=int,
                      help=f"data order, new heads, dropout (default {default('seed')})")


def build_parser() -> argparse.ArgumentParser:
  """The ``sebp`` argument parser."""
  from sebp_jax.finetune import AnalyzeConfig, FinetuneConfig

  parser = _Parser(prog="sebp", description="SEBP for JAX: fine-tune with the sparse backward.")
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                   parser_class=_Parser)

  finetune = commands.add_parser(
    "finetune", help="fine-tune dense vs SEBP and write a report",
    description="Fine-tune a model with the SEBP backward (optax AdamW); with --compare also "
                "the dense baseline from the same initialisation and data order. Writes "
                "metrics.jsonl, report.md, figures and orbax checkpoints to the run folder.")
  _add_data_options(finetune, FinetuneConfig)
  default = functools.partial(_default, FinetuneConfig)
  finetune.add_argument("--steps", type=_positive, metavar="N",
                        help=f"optimizer steps per variant (default {default('steps')})")
  finetune.add_argument("--policy", type=_policy, metavar="exact|threshold=EPS|max-rows=K",
                        help=f"SEBP row policy (default {default('policy')})")
  finetune.add_argument("--impl", choices=["auto", "xla", "pallas", "interpret"],
                        help="SEBP backend (default auto: Pallas on GPU, XLA elsewhere)")
  finetune.add_argument("--learning-rate", type=float, metavar="LR",
                        help=f"AdamW peak learning rate (default {default('learning_rate')})")
  finetune.add_argument("--eval-examples", type=_positive, metavar="N",
                        help=f"size of the fixed held-out subset "
                             f"(default {default('eval_examples')})")
  finetune.add_argument("--devices", type=_positive, metavar="N",
                        help="local devices to train on, data parallel (default: all)")
  finetune.add_argument("--fsdp", action="store_true", default=None,
                        help="also shard parameters and optimizer state over the devices")
  finetune.add_argument("--compare", action="store_true", default=None,
                        help="also train the dense baseline")
  finetune.add_argument("--out", type=Path, metavar="DIR",
                        help="run folder (default runs/<model>-<task>-<time>)")
  finetune.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its checkpoints, up to --steps; "
                             "its other options come from the run")

  analyze = commands.add_parser(
    "analyze", help="per-layer gradient row sparsity and a suggested eps",
    description="Measure the row sparsity of every linear layer's output gradient over a few "
                "batches (per layer type: average/min/max) and calibrate the noise threshold "
                "eps (knee of the smoothed CDF of |dY|).")
  _add_data_options(analyze, AnalyzeConfig)
  analyze.add_argument("--batches", type=_positive, metavar="N",
                       help=f"training batches to analyse (default "
                            f"{_default(AnalyzeConfig, 'batches')})")
  analyze.add_argument("--out", type=Path, metavar="DIR",
                       help="also write the heatmap and histogram figures there")
  return parser


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace, config_cls):
  """``config_cls`` from the options given; the others keep the config's defaults."""
  given = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)
           if getattr(args, f.name, None) is not None}
  for name in ("model", "task"):
    if name not in given:
      parser.error(f"the following argument is required: --{name}")
  return config_cls(**given)


def _finetune(parser, args) -> None:
  from sebp_jax.finetune import FinetuneConfig, finetune, load_run_config

  if args.resume:
    if args.out is None:
      parser.error("--resume needs --out, the run folder to continue")
    extra = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(FinetuneConfig)
             if f.name != "steps" and getattr(args, f.name, None) is not None]
    if extra:
      parser.error(f"--resume continues the run as configured in {args.out}; only --steps may "
                   f"be given, not {' '.join(extra)}")
    config = load_run_config(args.out)
    if args.steps is not None:
      config = dataclasses.replace(config, steps=args.steps)
  else:
    config = _config(parser, args, FinetuneConfig)
  summary = finetune(config, args.out, resume=args.resume, log=_log)
  print(summary["summary_text"])
  print(f"Report: {summary['report']}")


def _analyze(parser, args) -> None:
  from sebp_jax.finetune import AnalyzeConfig, analyze

  config = _config(parser, args, AnalyzeConfig)
  result = analyze(config, args.out, log=_log)
  stats = result["length_stats"]
  print(f"Row sparsity of the output gradients (rows with every |dY| = 0), {config.batches} "
        f"batches of {config.batch_size} x {config.max_length} tokens "
        f"({stats['real_token_fraction']:.0%} real tokens):")
  print(result["table_text"])
  eps = result["suggested_eps"]
  print(f"Suggested eps: {eps:.3g}" + ("  (no noise mode in |dY|: use --policy exact)"
                                       if eps == 0 else f"  (use --policy threshold={eps:.3g})"))
  for path in result["figures"].values():
    print(f"Figure: {path}")


_START = time.perf_counter()


def _log(message: str) -> None:
  print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``sebp`` console script; returns the exit status."""
  parser = build_parser()
  args = parser.parse_args(argv)
  from sebp_jax.finetune import UsageError

  try:
    {"finetune": _finetune, "analyze": _analyze}[args.command](parser, args)
  except (UsageError, ModuleNotFoundError, FileNotFoundError) as e:
    # The data loaders' ModuleNotFoundError names the pip line that installs the package.
    message = " ".join(str(e).split())
    print(f"sebp: error: {message}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
