"""The multi-device checks of ``test_multi_device.py``, run in a process of their own.

``python -m parity_tests.multi_device_checks [--host-devices N] IMPL CASE...`` prints one JSON
line per case: the gradient error against single-device dense autodiff (over the float32
tolerance) and the collectives of the compiled SEBP and dense programs. ``--host-devices 4``
runs on 4 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``, which must be set
before JAX initialises: hence a process of its own, the rest of the suite keeping one device);
without it, on the devices there are (``pallas`` on a machine with 2 GPUs or more).
"""

from __future__ import annotations

import json
import os
import re
import sys

if sys.argv[1:2] == ["--host-devices"]:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={sys.argv[2]}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  del sys.argv[1:3]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard  # noqa: E402

from benchmarks.collective_bytes import COLLECTIVES, collective_bytes  # noqa: E402
from parity_tests.tolerances import tolerance  # noqa: E402
from sebp_jax import row_plan, sebp_matmul, sebp_matmuls, sharded_rows  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# (batch, tokens, in, hidden): two layers, K != N, half of each sequence padding.
B, T, K, H = 8, 6, 16, 24
REAL = 3


def collectives(compiled_text: str, impl: str) -> dict[str, int]:
  """How many of each collective the compiled HLO runs (async ``-start`` halves counted once) and
  the bytes of their results (:func:`benchmarks.collective_bytes.collective_bytes`), and for
  ``xla`` its while loops: XLA partitions a row-sharded ``cumsum`` into serial loops (the Pallas
  interpreter runs its kernels as loops, so not for ``interpret``)."""
  kinds = COLLECTIVES + (("while",) if impl == "xla" else ())
  counts = {kind: len(re.findall(rf" {kind}(?:-start)?\(", compiled_text)) for kind in kinds}
  # And the bytes they move, so that a program with the same collectives on bigger arrays (a
  # weight gathered where dense moves activations) does not pass for dense's.
  return counts | {f"{kind} bytes": size for kind, size in collective_bytes(compiled_text).items()}


def _inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (B, T, K)).at[:, REAL:].set(0.0)
  params = (jax.random.normal(keys[1], (K, H)) / K ** 0.5,
            jax.random.normal(keys[2], (H, K)) / H ** 0.5)
  return params, x


def _loss(matmul, gather=lambda w: w, matmuls=None):
  """Sum of squares of a 2-layer MLP on the real tokens only (padding rows get zero dY). With
  ``matmuls`` (``(x, kernels, biases) -> outputs``), the first layer runs as two siblings, each
  half of its columns, with the bias ``params[2]``."""
  real = (jnp.arange(T) < REAL)[None, :, None]

  def loss(params, x):
    w1, w2, *bias = (gather(w) for w in params)
    if matmuls is None:
      h = matmul(x, w1)
    else:
      halves = (slice(None, H // 2), slice(H // 2, None))
      h = jnp.concatenate(matmuls(x, tuple(w1[:, half] for half in halves),
                                  tuple(bias[0][half] for half in halves)), axis=-1)
    return jnp.sum(jnp.where(real, matmul(jnp.tanh(h), w2), 0.0) ** 2)

  return loss


def _scanned_loss(matmul):
  """Sum of squares, on the real tokens, of two residual blocks ``h + tanh(h w1) w2`` run as one
  ``lax.scan`` over stacked weights, as a scanned transformer runs its layers."""
  real = (jnp.arange(T) < REAL)[None, :, None]

  def loss(params, x):
    def block(h, weights):
      w1, w2 = weights
      return h + matmul(jnp.tanh(matmul(h, w1)), w2), None

    h, _ = jax.lax.scan(block, x, params)
    return jnp.sum(jnp.where(real, h, 0.0) ** 2)

  return loss


def _error_over_tolerance(grads, reference) -> float:
  """The largest ``|error| / (atol + rtol |reference|)`` over the gradient trees: <= 1 is
  within the float32 tolerance."""
  tol = tolerance(jnp.float32)
  return max(float(np.max(np.abs(np.asarray(g) - np.asarray(r))
                          / (tol.atol + tol.rtol * np.abs(np.asarray(r)))))
             for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)))


def _check(name, impl, sebp_loss, dense_loss, params, x, reference, **jit_kwargs):
  results = {}
  for variant, loss in (("sebp", sebp_loss), ("dense", dense_loss)):
    step = jax.jit(jax.grad(loss), **jit_kwargs)
    results[variant] = collectives(step.lower(params, x).compile().as_text(), impl)
    if variant == "sebp":
      grads = step(params, x)
  print(json.dumps({"case": name, "impl": impl,
                    "error_over_tolerance": _error_over_tolerance(grads, reference), **results}),
        flush=True)


def _planned_matmul(impl: str):
  """``sebp_matmul`` under a row plan of the real tokens (a prefix of each sequence), made in the
  traced function as a training step makes it from its attention mask; checking: every layer
  verifies that no row outside the plan has a non-zero gradient."""
  def matmul(a, w):
    mask = jnp.broadcast_to(jnp.arange(T) < REAL, (B, T))
    return sebp_matmul(a, w, impl=impl, rows=row_plan(mask, check=True))
  return matmul


def main(impl: str, cases: list[str]) -> None:
  params, x = _inputs()
  dense_mm = lambda a, w: a @ w  # noqa: E731
  scoring_mm = lambda a, w: sebp_matmul(a, w, impl=impl)  # noqa: E731
  planned_mm = _planned_matmul(impl)
  reference = jax.grad(_loss(dense_mm))(params, x)  # one device, dense autodiff

  n = jax.device_count()
  print(json.dumps({"case": "devices", "count": n}), flush=True)
  if n < 2:
    return
  two_d = (2, n // 2) if n >= 4 else (1, n)  # (data, fsdp)
  auto = dict(
    data_parallel=((n,), ("data",), P("data"), P(), "data"),
    fsdp=((n,), ("fsdp",), P("fsdp"), P("fsdp"), "fsdp"),
    data_fsdp=(two_d, ("data", "fsdp"), P(("data", "fsdp")), P("fsdp"), ("data", "fsdp")),
  )
  for case in cases:
    # "<case>_siblings": the first layer as two sibling products under one backward
    # (sebp_matmuls); "<case>_planned": with a row plan, which each device re-plans for its rows;
    # "<case>_scanned": two residual blocks as one lax.scan over stacked weights.
    scanned = case.endswith("_scanned")
    siblings = case.endswith("_siblings")
    layout = case.removesuffix("_scanned").removesuffix("_siblings")
    planned = layout.endswith("_planned")
    sebp_mm = planned_mm if planned else scoring_mm
    layout = layout.removesuffix("_planned")
    sebp_loss_of, dense_loss_of = _loss, _loss
    case_dense_mm, case_params, case_reference = dense_mm, params, reference
    if siblings:  # with a bias, whose gradient the shared gather sums
      plan_rows = row_plan(jnp.broadcast_to(jnp.arange(T) < REAL, (B, T)), check=True)
      sebp_mms = lambda a, ws, bs: sebp_matmuls(  # noqa: E731
        a, ws, bs, impl=impl, rows=plan_rows if planned else None)
      dense_mms = lambda a, ws, bs: tuple(a @ w + b for w, b in zip(ws, bs))  # noqa: E731
      sebp_loss_of = lambda mm, gather=lambda w: w: _loss(mm, gather, sebp_mms)  # noqa: E731
      dense_loss_of = lambda mm, gather=lambda w: w: _loss(mm, gather, dense_mms)  # noqa: E731
      case_params = params + (jnp.linspace(-1.0, 1.0, H),)
      case_reference = jax.grad(dense_loss_of(dense_mm))(case_params, x)
    if scanned:
      sebp_loss_of = dense_loss_of = lambda mm, gather=lambda w: w: _scanned_loss(mm)  # noqa: E731
      case_params = tuple(jnp.stack([w, w[::-1] * 0.5]) for w in params)  # two distinct layers
      case_reference = jax.grad(_scanned_loss(dense_mm))(case_params, x)
    if layout.endswith("_nk"):
      # "<case>_nk": the weights stored (out, in), as a tied embedding is (`transpose_kernel`),
      # sharded on their first dim under FSDP; their gradients come back in that layout.
      layout = layout.removesuffix("_nk")
      sebp_mm = lambda a, w: sebp_matmul(a, w, impl=impl, transpose_kernel=True)  # noqa: E731
      case_dense_mm = lambda a, w: a @ w.T  # noqa: E731
      case_params = tuple(w.T for w in params)
      case_reference = tuple(g.T for g in reference)
    if layout in auto:
      shape, names, x_spec, w_spec, axes = auto[layout]
      if scanned:  # stacked weights: each layer's sharded as an unstacked one
        w_spec = P(None, *w_spec)
      mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
      w_sharding = NamedSharding(mesh, w_spec)

      def sebp_loss(params, x, axes=axes, sebp_loss_of=sebp_loss_of):
        with sharded_rows(axes):
          return sebp_loss_of(sebp_mm)(params, x)

      # Weights as w_spec; a bias (siblings) replicated.
      shardings = (w_sharding,) * 2 + (NamedSharding(mesh, P()),) * (len(case_params) - 2)
      with jax.set_mesh(mesh):
        _check(case, impl, sebp_loss, dense_loss_of(case_dense_mm), case_params, x,
               case_reference, in_shardings=(shardings, NamedSharding(mesh, x_spec)),
               out_shardings=shardings)
    elif layout == "explicit":
      # Batch over both axes, weights stored FSDP-sharded and gathered before use.
      mesh = jax.make_mesh(two_d, ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
      with jax.set_mesh(mesh):
        xs = reshard(x, P(("data", "fsdp")))
        ws = tuple(reshard(w, P("fsdp")) for w in case_params)
        gather = lambda w: reshard(w, P())  # noqa: E731
        _check(case, impl, sebp_loss_of(sebp_mm, gather), dense_loss_of(case_dense_mm, gather),
               ws, xs, case_reference)
    elif case in ("shard_map", "shard_map_unchecked"):
      mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
      check_vma = case == "shard_map"

      def per_device(matmul):
        def loss(params, x):
          value = _loss(matmul)(params, x)
          # Unchecked, the replicated weights' gradients are not summed by autodiff: the loss
          # is, and each device's gradient is then its own rows' share, summed outside.
          return jax.lax.psum(value, "data") if check_vma else value[None]
        return jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("data")),
                             out_specs=P() if check_vma else P("data"), check_vma=check_vma)

      def summed(matmul):
        if check_vma:
          return per_device(matmul)
        return lambda params, x: jnp.sum(per_device(matmul)(params, x))

      with jax.set_mesh(mesh):
        _check(case, impl, summed(sebp_mm), summed(dense_mm), params, reshard(x, P("data")),
               reference)
    elif case == "pallas_traces_in_shard_map":
      # The GPU kernels inside shard_map(check_vma=True): traced only (CPU cannot lower them).
      mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
      pallas_mm = lambda a, w: sebp_matmul(a, w, impl="pallas")  # noqa: E731
      loss = jax.shard_map(lambda p, x: jax.lax.psum(_loss(pallas_mm)(p, x), "data"), mesh=mesh,
                           in_specs=(P(), P("data")), out_specs=P(), check_vma=True)
      with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params, reshard(x, P("data")))
      print(json.dumps({"case": case, "pallas_calls": str(jaxpr).count("pallas_call")}))
    elif case == "plan_once_per_step":
      _plan_scans(planned_mm, x, n)
    elif case.startswith("value_and_grad_"):
      _value_and_grad(case, impl, auto[case.removeprefix("value_and_grad_")], params, x)
    elif case == "finetune":
      _finetune_losses()
    elif case == "errors":
      messages = {}
      mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
      with jax.set_mesh(mesh):  # an automatic mesh, no sharded_rows: the rows cannot be seen
        try:
          jax.jit(jax.grad(_loss(sebp_mm)))(params, x)
        except ValueError as e:
          messages["auto_without_rows"] = str(e)
      mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
      with jax.set_mesh(mesh), sharded_rows("data"):  # a plan that misses real rows, checked
        short = jnp.broadcast_to(jnp.arange(T) < REAL - 1, (B, T))
        missing = lambda a, w: sebp_matmul(a, w, impl=impl,  # noqa: E731
                                           rows=row_plan(short, check=True), name="layer")
        try:
          jax.block_until_ready(jax.jit(jax.grad(_loss(missing)))(params, x))
        except Exception as e:  # the check's callback fails the program at run time
          messages["plan_misses_rows"] = str(e)
      mesh = jax.make_mesh((n,), ("model",), axis_types=(AxisType.Explicit,))
      with jax.set_mesh(mesh):  # output features split over "model": tensor parallel
        w = reshard(params[0], P(None, "model"))
        try:
          jax.grad(lambda w: jnp.sum(sebp_matmul(x, w, impl=impl) ** 2))(w)
        except ValueError as e:
          messages["tensor_parallel"] = str(e)
      print(json.dumps({"case": case, "impl": impl, "messages": messages}))
    else:
      raise SystemExit(f"unknown case {case!r}")


def _plan_scans(planned_mm, x, n: int) -> None:
  """The prefix sums (``reduce-window``) of data-parallel programs of 2 and of 5 planned layers:
  each layer re-plans its device's rows from the same mask, and XLA computes that plan once."""
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
  scans = {}
  for depth in (2, 5):
    weights = tuple(jnp.eye(K) * (1.0 + 0.1 * i) for i in range(depth))

    def loss(weights, x):
      with sharded_rows("data"):
        for w in weights:
          x = jnp.tanh(planned_mm(x, w))
      return jnp.sum(x[:, :REAL] ** 2)

    with jax.set_mesh(mesh):
      text = jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P()),
                                                   NamedSharding(mesh, P("data")))
                     ).lower(weights, x).compile().as_text()
    scans[depth] = len(re.findall(r" reduce-window\(", text))
  print(json.dumps({"case": "plan_once_per_step", "scans": scans}), flush=True)


def _value_and_grad(case, impl, layout, params, x) -> None:
  """:func:`sebp_jax.sebp_value_and_grad` of a flax MLP (its sparse branch taken) under a
  sharded jit, against single-device dense autodiff."""
  import flax.linen as nn

  from sebp_jax import sebp_value_and_grad

  shape, names, x_spec, w_spec, axes = layout
  model = nn.Sequential([nn.Dense(H), nn.tanh, nn.Dense(K)])
  variables = model.init(jax.random.key(1), x)
  real = (jnp.arange(T) < REAL)[None, :, None]
  loss = lambda v, x: jnp.sum(jnp.where(real, model.apply(v, x), 0.0) ** 2)  # noqa: E731
  fraction = lambda v, x: jnp.float32(REAL / T)  # noqa: E731
  _, reference = jax.value_and_grad(loss)(variables, x)
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))

  def sebp(v, x):
    with sharded_rows(axes):
      return sebp_value_and_grad(loss, fraction, crossover=0.9, impl=impl)(v, x)

  place = lambda v: jax.tree.map(  # noqa: E731
    lambda leaf: NamedSharding(mesh, w_spec if leaf.ndim == 2 else P()), v)
  with jax.set_mesh(mesh):
    _, grads = jax.jit(sebp, in_shardings=(place(variables), NamedSharding(mesh, x_spec)))(
      variables, x)
  print(json.dumps({"case": case, "impl": impl,
                    "error_over_tolerance": _error_over_tolerance(grads, reference)}), flush=True)


def _finetune_losses() -> None:
  """``sebp finetune``'s SEBP training losses (tiny BERT) on 1 device and on 4, data parallel and
  FSDP, and the mesh each report names."""
  import tempfile

  from parity_tests import test_cli
  from sebp_jax import finetune

  finetune.MODELS["tiny-bert"] = test_cli.TINY_BERT
  runs = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, devices, fsdp in (("one", 1, False), ("data_parallel", 4, False),
                                ("fsdp", 4, True)):
      config = test_cli._tiny_config(devices=devices, fsdp=fsdp, compare=False,
                                     analysis_batches=0, timing_batches=1)
      summary = finetune.finetune(config, f"{tmp}/{name}", log=lambda _: None)
      report = open(summary["report"]).read()
      losses = [json.loads(line)["loss"] for line in open(f"{tmp}/{name}/metrics.jsonl")
                if '"loss"' in line]
      runs[name] = {"losses": losses, "mesh": summary["mesh"],
                    "report_names_mesh": summary["mesh"] in report
                    and summary["mesh"] in summary["summary_text"]}
  print(json.dumps({"case": "finetune", "runs": runs}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
