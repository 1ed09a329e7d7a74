"""The bytes every SEBP backward must move that the bound does not, and the floor they set.

``jax-bound`` (:func:`benchmarks.workloads.free_linear_backward`) makes every linear layer's
backward free. Any SEBP backward, however fast its kernels, still has to

* read each weight once (dX = dY Wᵀ),
* write each weight's gradient once (dW),
* write each layer's whole dX, zero rows included (the layers below read a dense dX), one per
  group of sibling projections that share one backward (q/k/v, gate/up: ``dense_siblings``);
  under a row plan since v20 (``--planned-dx``) only the kept rows, except where the dX is read
  whole by an op that cannot fuse a gather (the attention backward, before the output
  projection: ``dx_read_whole``),

while the kept rows themselves are a few MB. In the other direction the bound reads every
layer's whole ``dy`` once (its zero gradients depend on it, so that XLA keeps the backward
between the linear layers), which SEBP under a row plan does not, except where a bias gradient
reads it anyway (BERT). So, at a bandwidth B::

    floor = bound − (dy bytes, where no bias reads them) / B + (SEBP bytes) / B

and dense's backward over that is the most SEBP can reach on that card (``benchmarks/NOTES.md``,
"v17": LLaMA-3.2-3B b1 on an H100, 3.68–3.80×). The times come from a model benchmark run
(``--dense-ms``, ``--bound-ms``); this module only counts bytes::

    python -m benchmarks.byte_floor --model llama --batch 1 --dense-ms 84.70 --bound-ms 19.63
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

from sebp_jax.models.bert import BertConfig
from sebp_jax.models.llama import LlamaConfig

__all__ = ["Projection", "llama_projections", "bert_projections", "floor_bytes", "markdown"]

# HBM bandwidths to quote the floor at: the H100 SXM's peak and what a device-to-device copy
# reached on the lent H100s (/work/.library/device/KINDS.md: ~3.0 TB/s).
_BANDWIDTHS_TB_S = (3.35, 3.0)


@dataclasses.dataclass(frozen=True)
class Projection:
  """One linear layer of the backward: ``(rows, in_features) x (in_features, out_features)``.

  ``group``: projections of one input that share one dX (siblings); ``None``: a dX of its own.
  ``rows``: ``"tokens"`` (every position of the batch) or ``"sequences"`` (one row per
  sequence: BERT's pooler and classifier). ``dx_read_whole``: its dX goes to an op that reads it
  whole (the attention backward), so even under a row plan it is written whole.
  """

  name: str
  in_features: int
  out_features: int
  count: int = 1
  group: str | None = None
  rows: str = "tokens"
  bias: bool = False
  dx_read_whole: bool = False


def llama_projections(config: LlamaConfig) -> list[Projection]:
  """LLaMA's linear layers as ``sebp_finetune`` swaps them (the tied head included)."""
  hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
  head_dim = config.head_dim or hidden // config.num_attention_heads
  kv = (config.num_key_value_heads or config.num_attention_heads) * head_dim
  bias = config.attention_bias
  return [
    Projection("q", hidden, config.num_attention_heads * head_dim, layers, "qkv", bias=bias),
    Projection("k", hidden, kv, layers, "qkv", bias=bias),
    Projection("v", hidden, kv, layers, "qkv", bias=bias),
    Projection("o", config.num_attention_heads * head_dim, hidden, layers, bias=bias,
               dx_read_whole=True),
    Projection("gate", hidden, inner, layers, "gate_up", bias=config.mlp_bias),
    Projection("up", hidden, inner, layers, "gate_up", bias=config.mlp_bias),
    Projection("down", inner, hidden, layers, bias=config.mlp_bias),
    Projection("lm_head", hidden, config.vocab_size),
  ]


def bert_projections(config: BertConfig) -> list[Projection]:
  """BERT-base's linear layers for sequence classification (pooler and classifier included)."""
  hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
  return [
    Projection("query", hidden, hidden, layers, "qkv", bias=True),
    Projection("key", hidden, hidden, layers, "qkv", bias=True),
    Projection("value", hidden, hidden, layers, "qkv", bias=True),
    Projection("attention_output", hidden, hidden, layers, bias=True, dx_read_whole=True),
    Projection("intermediate", hidden, inner, layers, bias=True),
    Projection("output", inner, hidden, layers, bias=True),
    Projection("pooler", hidden, hidden, rows="sequences", bias=True),
    Projection("classifier", hidden, config.num_labels, rows="sequences", bias=True),
  ]


def floor_bytes(projections: Sequence[Projection], *, batch: int, seq_len: int,
                itemsize: int = 2, planned_dx: bool = False, kept: float = 0.0
                ) -> dict[str, int]:
  """Bytes per backward: ``weights`` (read by dX), ``dw`` (written), ``dx`` (written, one per
  sibling group), ``sebp`` (their sum), and ``bound_dy``: the bound's reads of ``dy`` that SEBP
  under a row plan does not make (none for a layer with a bias: its gradient reads ``dy``).
  With ``planned_dx`` a group's dX is written whole only where ``dx_read_whole``, elsewhere its
  ``kept`` share of rows (per-sequence layers, not planned, stay whole)."""
  weights = dx = bound_dy = 0
  for p in projections:
    weights += p.count * p.in_features * p.out_features * itemsize
    if not p.bias:
      bound_dy += p.count * _rows(p, batch, seq_len) * p.out_features * itemsize
  for members in _groups(projections).values():
    p = members[0]
    share = 1.0
    if planned_dx and p.rows == "tokens" and not any(m.dx_read_whole for m in members):
      share = kept
    dx += round(share * p.count * _rows(p, batch, seq_len) * p.in_features * itemsize)
  return {"weights": weights, "dw": weights, "dx": dx, "sebp": 2 * weights + dx,
          "bound_dy": bound_dy}


def _rows(p: Projection, batch: int, seq_len: int) -> int:
  return batch * seq_len if p.rows == "tokens" else batch


def _groups(projections: Sequence[Projection]) -> dict[str, list[Projection]]:
  """Projections by the dX they write: a sibling group's one, or each layer's own."""
  groups: dict[str, list[Projection]] = {}
  for p in projections:
    groups.setdefault(p.group or p.name, []).append(p)
  return groups


def markdown(name: str, counted: dict[str, int], *, dense_ms: float | None = None,
             bound_ms: float | None = None, bandwidths_tb_s: Sequence[float] = _BANDWIDTHS_TB_S
             ) -> str:
  """The counts in GB and, at each bandwidth, the floor in ms (and the speedup over dense it
  allows, given a run's dense and bound backward)."""
  gb = {key: value / 1e9 for key, value in counted.items()}
  lines = [f"# The SEBP byte floor: {name}", "",
           f"Weights read {gb['weights']:.2f} GB, dW written {gb['dw']:.2f} GB, dX written "
           f"{gb['dx']:.2f} GB: **{gb['sebp']:.2f} GB** beyond the bound; the bound's reads of "
           f"`dy` that a row plan does not make: {gb['bound_dy']:.2f} GB.", "",
           "| bandwidth | SEBP bytes, ms | bound's extra dy reads, ms | floor backward, ms "
           "| dense ÷ floor |", "|---|---|---|---|---|"]
  for bandwidth in bandwidths_tb_s:
    sebp_ms, dy_ms = (counted[key] / (bandwidth * 1e12) * 1e3 for key in ("sebp", "bound_dy"))
    floor = None if bound_ms is None else bound_ms - dy_ms + sebp_ms
    ratio = None if floor is None or dense_ms is None else dense_ms / floor
    lines.append(f"| {bandwidth:.2f} TB/s | {sebp_ms:.2f} | {dy_ms:.2f} | "
                 f"{'–' if floor is None else f'{floor:.2f}'} | "
                 f"{'–' if ratio is None else f'{ratio:.2f}×'} |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("llama", "bert"), required=True)
  parser.add_argument("--batch", type=int, required=True)
  parser.add_argument("--seq-len", type=int, help="default: 4096 (LLaMA), 512 (BERT)")
  parser.add_argument("--dense-ms", type=float, help="a run's dense backward")
  parser.add_argument("--bound-ms", type=float, help="the same run's jax-bound backward")
  parser.add_argument("--bandwidth", type=float, nargs="+", default=_BANDWIDTHS_TB_S,
                      help="TB/s")
  parser.add_argument("--planned-dx", action="store_true",
                      help="count dX as v20 writes it under a row plan: whole only before the "
                           "attention backward, the --kept share of rows elsewhere")
  parser.add_argument("--kept", type=float, default=0.0,
                      help="the kept share of rows, with --planned-dx (e.g. 0.021 for piqa)")
  args = parser.parse_args(argv)
  if not 0.0 <= args.kept <= 1.0:
    parser.error(f"--kept must be between 0 and 1, got {args.kept}")
  if args.model == "llama":
    projections, seq_len, name = llama_projections(LlamaConfig.llama_3_2_3b()), 4096, "LLaMA-3.2-3B"
  else:
    projections, seq_len, name = bert_projections(BertConfig()), 512, "BERT-base"
  seq_len = args.seq_len or seq_len
  text = markdown(f"{name}, batch {args.batch} × {seq_len}, bf16",
                  floor_bytes(projections, batch=args.batch, seq_len=seq_len,
                              planned_dx=args.planned_dx, kept=args.kept),
                  dense_ms=args.dense_ms, bound_ms=args.bound_ms, bandwidths_tb_s=args.bandwidth)
  print(text)
  return text


if __name__ == "__main__":
  main()
