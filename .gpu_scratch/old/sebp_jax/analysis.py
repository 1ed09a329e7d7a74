"""Row sparsity of every linear layer's output gradient, and the paper's threshold calibration.

The paper (§3.1) backs SEBP with two measurements, both reproduced here for any flax model:

* **Row sparsity per layer** (its Tables 1–2, Figure 2): the fraction of rows of ``dY`` (one row
  per token) whose entries are all ``<= eps`` in magnitude, for every linear layer, summarised per
  layer type (``intermediate/dense``, ``mlp/up_proj``, ...).
* **Noise threshold** (its Figure 3): the knee of the smoothed CDF of the gradient magnitudes on a
  log scale, where the steep rise of near-zero noise bends into the plateau before the real
  gradients. The CDF here is that of the *row scores* ``max_j |dY_ij|``, the quantity
  :class:`sebp_jax.RowPolicy` compares with ``threshold``: a noise row is dropped only if its
  largest entry is below ``eps``, so a knee of the element distribution (whose upper noise tail
  every noise row reaches) would keep most noise rows. The element histogram is still collected
  for the paper's figure.

Output gradients are captured without touching the model: inside :func:`linear_output_gradients`
a flax method interceptor adds a zero "probe" to the output of every ``nn.Dense`` (and of
``nn.Embed.attend``, the tied output projection), and the gradient with respect to the probes is
``dY``. Statistics are reduced inside ``jit`` so that a large model's gradients never sit in memory.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sebp_jax.policy import row_scores

__all__ = [
  "LOG10_EDGES",
  "GradientStats",
  "linear_output_gradients",
  "gradient_statistics",
  "log10_histogram",
  "calibrate_threshold",
  "layer_type",
  "row_sparsity",
  "sparsity_table",
  "format_sparsity_table",
  "plot_row_sparsity_heatmap",
  "plot_gradient_histogram",
]

# Histogram bins of log10 magnitudes: 20 bins a decade from 1e-30 to 1e5 (bfloat16 and float32
# gradients of any model fall inside; values outside are clipped into the end bins).
_BINS_PER_DECADE = 20
LOG10_EDGES: np.ndarray = np.linspace(-30.0, 5.0, 35 * _BINS_PER_DECADE + 1)

# A path component naming a repeated block: BERT's "layer_3", LLaMA's "layers_3".
_BLOCK = re.compile(r"^layers?_\d+$")


def _linear_name(context: Any) -> str | None:
  """The name of a linear layer's matmul call seen by a flax interceptor, else ``None``."""
  module, method = context.module, context.method_name
  if isinstance(module, nn.Dense) and method == "__call__":
    return "/".join(module.path)
  if isinstance(module, nn.Embed) and method == "attend":
    return "/".join((*module.path, "attend"))
  return None


def linear_output_gradients(
  loss_fn: Callable[..., jax.Array], *args: Any
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss and the output gradient ``dY`` of every linear layer that ``loss_fn`` calls.

  Args:
    loss_fn: returns a scalar loss; it applies flax modules (``module.apply(...)``) inside.
    *args: its arguments (parameters, batch, ...). Nothing is differentiated but the probes.

  Returns:
    ``(loss, grads)``: ``grads`` maps the layer's module path (``"encoder/layer_0/attention/self/
    query"``; ``".../attend"`` for ``nn.Embed.attend``) to ``dY``, shaped like the layer's output
    ``(..., features)``. A layer called twice gets ``"#1"``, ``"#2"`` ... on its later calls.
    Traceable: call it under ``jit``.
  """
  names: list[str] = []
  shapes: list[jax.ShapeDtypeStruct] = []

  def record(next_fun, call_args, call_kwargs, context):
    out = next_fun(*call_args, **call_kwargs)
    name = _linear_name(context)
    if name is not None:
      calls = sum(1 for n in names if n == name or n.startswith(name + "#"))
      names.append(name if calls == 0 else f"{name}#{calls}")
      shapes.append(jax.ShapeDtypeStruct(out.shape, out.dtype))
    return out

  with nn.intercept_methods(record):
    jax.eval_shape(loss_fn, *args)

  def probed(probes: list[jax.Array]) -> jax.Array:
    pending = iter(probes)

    def add_probe(next_fun, call_args, call_kwargs, context):
      out = next_fun(*call_args, **call_kwargs)
      return out if _linear_name(context) is None else out + next(pending)

    with nn.intercept_methods(add_probe):
      return loss_fn(*args)

  zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
  loss, grads = jax.value_and_grad(probed)(zeros)
  return loss, dict(zip(names, grads))


def log10_histogram(magnitudes: Any) -> tuple[np.ndarray, int]:
  """Counts of ``log10(|x|)`` over :data:`LOG10_EDGES`, and the number of exact zeros.

  Args:
    magnitudes: an array of any shape (numpy or JAX; traceable with JAX input).

  Returns:
    ``(counts, zeros)``: ``counts`` is ``(len(LOG10_EDGES) - 1,)``; values beyond the edges are
    counted in the end bins; non-finite values are left out.
  """
  xp = jnp if isinstance(magnitudes, jax.Array) else np
  x = xp.abs(xp.ravel(magnitudes)).astype(xp.float32)
  nonzero = (x > 0) & xp.isfinite(x)
  num_bins = len(LOG10_EDGES) - 1
  position = (xp.log10(xp.where(nonzero, x, 1.0)) - LOG10_EDGES[0]) * _BINS_PER_DECADE
  index = xp.clip(xp.floor(position).astype(xp.int32), 0, num_bins - 1)
  # Zeros and non-finite values go to an extra bin that is then cut off.
  index = xp.where(nonzero, index, num_bins)
  counts = xp.bincount(index, length=num_bins + 1) if xp is jnp else np.bincount(
    index, minlength=num_bins + 1)
  return counts[:num_bins], xp.sum(x == 0)


def _smooth(values: np.ndarray, sigma_bins: float) -> np.ndarray:
  """Gaussian smoothing along a 1-D array, zero beyond its ends."""
  radius = int(np.ceil(4 * sigma_bins))
  taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma_bins) ** 2)
  return np.convolve(values, taps / taps.sum(), mode="same")


def calibrate_threshold(
  counts: np.ndarray,
  *,
  smoothing_decades: float = 0.1,
  valley_ratio: float = 0.5,
  min_mode_fraction: float = 0.05,
) -> float:
  """The paper's noise threshold: the knee of the smoothed CDF of log-magnitudes.

  The CDF comes from a histogram over :data:`LOG10_EDGES` (:func:`log10_histogram`) and is
  smoothed with a Gaussian of ``smoothing_decades``. Its slope (the smoothed density) must show a
  *noise mode*: a first peak, then a valley deeper than ``valley_ratio`` times the lower of that
  peak and the next one, with at least ``min_mode_fraction`` of the values on each side of the
  valley (a ripple in a tail is no mode). The knee is where the CDF's slope falls fastest between the noise peak
  and the valley, i.e. the largest slope change, where the noise ends. Without a noise mode
  (every non-zero gradient is real, as in float32 models whose padded rows are exactly zero) the
  answer is ``0.0``: the exact policy.

  Args:
    counts: ``(len(LOG10_EDGES) - 1,)`` histogram counts.
    smoothing_decades: standard deviation of the smoothing, in decades.
    valley_ratio: how deep the valley between noise and signal must be to count as one.
    min_mode_fraction: the least fraction of the values each of the two modes must hold.

  Returns:
    ``eps`` (a bin edge ``10**k``; ``0.0`` when no noise mode is found).
  """
  counts = np.asarray(counts, np.float64)
  if counts.shape != (len(LOG10_EDGES) - 1,):
    raise ValueError(
      f"`counts` must have shape ({len(LOG10_EDGES) - 1},) (bins of LOG10_EDGES), "
      f"got {counts.shape}.")
  for name, value in (("valley_ratio", valley_ratio), ("min_mode_fraction", min_mode_fraction)):
    if not 0.0 < value < 1.0:
      raise ValueError(f"`{name}` must be in (0, 1), got {value}.")
  if counts.sum() == 0:
    return 0.0
  # Smoothing the CDF and differentiating equals smoothing the density.
  slope = _smooth(counts / counts.sum(), smoothing_decades * _BINS_PER_DECADE)
  cdf = np.cumsum(slope)
  floor = 1e-3 * slope.max()  # ignore ripples of the far tails
  interior = slope[1:-1]
  is_peak = (interior > slope[:-2]) & (interior >= slope[2:]) & (interior > floor)
  peaks = np.flatnonzero(is_peak) + 1
  if peaks.size == 0:
    return 0.0
  first = peaks[0]  # the top of the lowest mode so far
  for second in peaks[1:]:
    valley = first + int(np.argmin(slope[first:second + 1]))
    deep = slope[valley] <= valley_ratio * min(slope[first], slope[second])
    if deep and min_mode_fraction <= cdf[valley] <= 1.0 - min_mode_fraction:
      # Slope change between bins i and i+1; the knee is the edge between them.
      change = np.diff(slope[first:valley + 1])
      knee_edge = first + int(np.argmin(change)) + 1
      return float(10.0 ** LOG10_EDGES[knee_edge])
    if slope[second] > slope[first]:
      first = second  # a shallow dip: the same mode, which peaks higher up
  return 0.0


def layer_type(name: str) -> str:
  """The layer's path inside its repeated block: ``"encoder/layer_3/intermediate/dense"`` ->
  ``"intermediate/dense"``; a layer outside any block keeps its full path."""
  parts = name.split("/")
  for i, part in enumerate(parts):
    if _BLOCK.match(part):
      return "/".join(parts[i + 1:])
  return name


def row_sparsity(scores: Any, eps: float = 0.0) -> float:
  """Fraction of rows whose score (``max_j |dY_ij|``) is ``<= eps``: the rows SEBP skips.

  Non-finite scores count as active (SEBP never drops them).
  """
  scores = np.asarray(scores, np.float32)
  if scores.size == 0:
    raise ValueError("`scores` is empty.")
  return float(np.mean(np.isfinite(scores) & (scores <= eps)))


@dataclasses.dataclass
class GradientStats:
  """Output-gradient statistics of every linear layer over a few batches.

  Attributes:
    row_scores: layer name -> ``(batches, M)`` float32 ``max_j |dY_ij|`` per row (``M`` = rows of
      one batch, ``batch * length``), layers in call order.
    row_counts: histogram of ``log10`` row scores over :data:`LOG10_EDGES` (all layers).
    element_counts: histogram of ``log10 |dY_ij|`` over :data:`LOG10_EDGES` (all layers).
    element_zeros: number of exactly-zero gradient entries.
    example_layer: the layer of ``example``.
    example: ``|dY|`` of ``example_layer`` on the first batch, ``(rows, features)`` float32,
      cropped to at most 512 x 512 for plotting.
    losses: the loss of each batch.
  """

  row_scores: dict[str, np.ndarray]
  row_counts: np.ndarray
  element_counts: np.ndarray
  element_zeros: int
  example_layer: str
  example: np.ndarray
  losses: list[float]

  def suggested_threshold(self) -> float:
    """:func:`calibrate_threshold` of the row scores."""
    return calibrate_threshold(self.row_counts)


def _example_layer(names: Sequence[str]) -> str:
  """The first MLP up-projection (the paper's Figure 2 layer), else the first layer."""
  for name in names:
    if layer_type(name) in ("intermediate/dense", "mlp/up_proj"):
      return name
  return names[0]


def gradient_statistics(
  loss_fn: Callable[..., jax.Array],
  batches: Iterable[tuple[Any, ...]],
  *,
  example_layer: str | None = None,
  max_example: int = 512,
) -> GradientStats:
  """Collects :class:`GradientStats` of ``loss_fn(*args)`` for each ``args`` in ``batches``.

  Args:
    loss_fn: returns a scalar loss; it applies flax modules inside (see
      :func:`linear_output_gradients`). Jitted here, once for all batches of one shape.
    batches: argument tuples, e.g. ``(params, batch)``.
    example_layer: the layer whose ``|dY|`` is kept for the heatmap; ``None``: the first MLP
      up-projection.
    max_example: crop of the kept ``|dY|`` (rows and columns).
  """
  @jax.jit
  def reduce(*args):
    loss, grads = linear_output_gradients(loss_fn, *args)
    scores = {name: row_scores(g.reshape(-1, g.shape[-1])) for name, g in grads.items()}
    element_counts, zeros = zip(*(log10_histogram(g) for g in grads.values()))
    return loss, scores, sum(element_counts), sum(zeros), grads

  scores: dict[str, list[np.ndarray]] = {}
  element_counts = np.zeros(len(LOG10_EDGES) - 1, np.int64)
  element_zeros = 0
  losses = []
  example = None
  for args in batches:
    loss, batch_scores, counts, zeros, grads = reduce(*args)
    if example is None:
      example_layer = example_layer or _example_layer(list(grads))
      if example_layer not in grads:
        raise ValueError(f"`example_layer` {example_layer!r} is not one of {list(grads)}.")
      dy = grads[example_layer]
      example = np.abs(np.asarray(dy.reshape(-1, dy.shape[-1])[:max_example, :max_example],
                                  np.float32))
    del grads
    for name, s in batch_scores.items():
      scores.setdefault(name, []).append(np.asarray(s))
    element_counts += np.asarray(counts, np.int64)
    element_zeros += int(zeros)
    losses.append(float(loss))
  if example is None:
    raise ValueError("`batches` is empty.")
  stacked = {name: np.stack(s) for name, s in scores.items()}
  row_counts = log10_histogram(np.concatenate([s.ravel() for s in stacked.values()]))[0]
  return GradientStats(row_scores=stacked, row_counts=np.asarray(row_counts, np.int64),
                       element_counts=element_counts, element_zeros=element_zeros,
                       example_layer=example_layer, example=example, losses=losses)


def sparsity_table(stats: GradientStats, eps: float = 0.0) -> list[dict[str, Any]]:
  """Row sparsity per layer type at ``eps``: the paper's Tables 1–2.

  Returns:
    One dict per layer type, in call order: ``type``, ``layers`` (how many), and ``avg``,
    ``min``, ``max`` over those layers of each layer's row sparsity (pooled over the batches).
  """
  by_type: dict[str, list[float]] = {}
  for name, scores in stats.row_scores.items():
    by_type.setdefault(layer_type(name.split("#")[0]), []).append(row_sparsity(scores, eps))
  return [{"type": t, "layers": len(v), "avg": float(np.mean(v)), "min": float(np.min(v)),
           "max": float(np.max(v))} for t, v in by_type.items()]


def format_sparsity_table(rows: list[dict[str, Any]]) -> str:
  """A markdown table of :func:`sparsity_table`'s rows."""
  width = max(len("layer type"), *(len(r["type"]) for r in rows))
  lines = [f"| {'layer type':<{width}} | layers |  avg  |  min  |  max  |",
           f"|{'-' * (width + 2)}|-------:|------:|------:|------:|"]
  lines += [f"| {r['type']:<{width}} | {r['layers']:>6} | {r['avg']:.3f} | {r['min']:.3f} "
            f"| {r['max']:.3f} |" for r in rows]
  return "\n".join(lines)


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt

  return plt


def plot_row_sparsity_heatmap(stats: GradientStats, path: str | Path, *,
                              sequence_length: int | None = None) -> Path:
  """The paper's Figure 2 for this model: ``|dY|`` of one layer (rows = tokens), and the row
  scores of every layer on the first batch (a row is skipped where it is zero).

  Args:
    stats: from :func:`gradient_statistics`.
    path: the PNG to write.
    sequence_length: draws sequence boundaries every this many rows.
  """
  plt = _pyplot()
  log = lambda a: np.log10(np.maximum(a, 1e-30))  # noqa: E731  (zeros -> the colour floor)
  example = log(stats.example)
  # Token-level layers only: a head on the pooled [CLS] state has one row per sequence.
  rows = max(s.shape[1] for s in stats.row_scores.values())
  scores = log(np.stack([s[0] for s in stats.row_scores.values() if s.shape[1] == rows]))
  finite = np.concatenate([example[example > -30], scores[scores > -30]])
  vmin, vmax = (np.percentile(finite, 1), finite.max()) if finite.size else (-30, 0)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 1.6]},
                           layout="constrained")
  image = axes[0].imshow(example, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax,
                         interpolation="nearest")
  short_name = "/".join(stats.example_layer.split("/")[-3:])
  axes[0].set(title=f"|dY| of {short_name}", xlabel="output feature",
              ylabel="row (token) of batch 0")
  axes[1].imshow(scores, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax,
                 interpolation="nearest")
  axes[1].set(title="max |dY| of each row, every layer (dark: zero row, skipped)",
              xlabel="row (token) of batch 0", ylabel="linear layer (call order)")
  if sequence_length:
    for ax, horizontal in ((axes[0], True), (axes[1], False)):
      limit = example.shape[0] if horizontal else scores.shape[1]
      for edge in range(sequence_length, limit, sequence_length):
        (ax.axhline if horizontal else ax.axvline)(edge - 0.5, color="w", lw=0.4, alpha=0.6)
  fig.colorbar(image, ax=axes, label="log10 |dY|")
  path = Path(path)
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def plot_gradient_histogram(stats: GradientStats, eps: float, path: str | Path) -> Path:
  """The paper's Figure 3: histograms of ``log10 |dY|`` (entries and row scores), with ``eps``."""
  plt = _pyplot()
  centers = (LOG10_EDGES[:-1] + LOG10_EDGES[1:]) / 2
  fig, ax = plt.subplots(figsize=(7, 4))
  histograms = ((stats.element_counts, "entries |dY_ij|"),
                (stats.row_counts, "row scores max_j |dY_ij|"))
  # Show the central 99.98 % of either histogram: float32 underflow leaves a few entries
  # decades below the rest.
  low, high = len(centers), 0
  for counts, _ in histograms:
    if counts.sum():
      cdf = np.cumsum(counts) / counts.sum()
      low = min(low, int(np.searchsorted(cdf, 1e-4)))
      high = max(high, int(np.searchsorted(cdf, 1 - 1e-4)))
  span = slice(max(low - _BINS_PER_DECADE, 0), high + _BINS_PER_DECADE)
  for counts, label in histograms:
    if counts.sum():
      ax.plot(centers[span], counts[span] / counts.sum(), label=label)
  if eps > 0:
    ax.axvline(np.log10(eps), color="r", ls="--", label=f"calibrated eps = {eps:.3g}")
  else:
    ax.plot([], [], " ", label="calibrated eps = 0 (no noise mode: exact policy)")
  total = stats.element_counts.sum() + stats.element_zeros
  ax.set(xlabel="log10 magnitude", ylabel="fraction of non-zero values",
         title=f"Output-gradient magnitudes ({stats.element_zeros / max(total, 1):.0%} of entries "
               "exactly zero)")
  ax.legend(fontsize=8)
  path = Path(path)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path
