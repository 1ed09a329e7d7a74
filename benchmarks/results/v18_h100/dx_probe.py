"""dX alone at few kept rows: tile/launch configs vs cuBLAS on compacted rows (one-off probe)."""
import dataclasses, json, sys, re
import jax, jax.numpy as jnp, numpy as np
from benchmarks import profile_step
from sebp_jax.backends import pallas as P

M = 4096
SHAPES = {"up": (3072, 8192), "down": (8192, 3072), "qo": (3072, 3072)}
ROWS = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [85, 860]

def parse(name):
  if name == "table":
    return {}
  o = {}
  for tok in name.split("_"):
    m = re.fullmatch(r"(m|k|n|s|w|split|p)(\d+)", tok)
    key = {"m": "dx_m", "k": "dx_k", "n": "dx_n", "s": "dx_stages", "w": "dx_warps",
           "split": "dx_split", "p": "dx_programs"}[m.group(1)]
    o[key] = int(m.group(2))
  return o

CONFIGS = ["table", "m64_k64_n128_s4", "m64_k64_n256_s3", "m32_k64_n128_s4", "m32_k32_n128_s4",
           "m128_k64_n128_s3_w8", "m128_k64_n64_s4_w8", "m128_k32_n128_s3_w4",
           "m128_k64_n128_s3_w8_split4", "m128_k64_n128_s3_w8_split8",
           "m128_k64_n64_s4_w4_split8", "m64_k64_n128_s4_split4", "m64_k128_n128_s4_split4",
           "m128_k128_n64_s4_w8_split8"]

import os
if os.environ.get("PROBE_CONFIGS"):
  CONFIGS = os.environ["PROBE_CONFIGS"].split()
if os.environ.get("PROBE_SHAPES"):
  SHAPES = {k: SHAPES[k] for k in os.environ["PROBE_SHAPES"].split()}

def config_for(K, N, name):
  base = P.block_config(M, K, N, jnp.bfloat16)
  o = parse(name)
  if not o:
    return base
  cfg = dataclasses.replace(base, **o)
  if "dx_programs" not in o:
    cfg = P.with_dx_programs(dataclasses.replace(cfg, dx_programs=0), jnp.bfloat16)
  return cfg

def times(fn, sets):
  jitted = jax.jit(fn)
  out = jax.block_until_ready(jitted(*sets[0]))
  k = profile_step.traced_kernel_times(
    lambda: [jax.block_until_ready(jitted(*a)) for a in sets], len(sets))
  return out, {n: round(t * 1000, 2) for n, (t, _) in k.items()}

results = []
for shape, (K, N) in SHAPES.items():
  W = (0.02 * jax.random.normal(jax.random.key(0), (K, N), jnp.float32)).astype(jnp.bfloat16)
  for rows in ROWS:
    sets = []
    for s in range(4):
      dy = jax.random.normal(jax.random.key(s + 1), (M, N), jnp.float32).astype(jnp.bfloat16)
      dyc = jnp.where(jnp.arange(M)[:, None] < rows, dy, 0)
      sets.append((dyc,))
    perm = jnp.arange(M, dtype=jnp.int32)
    count = jnp.array([rows], jnp.int32)
    ref, t_ideal = times(lambda d: jnp.dot(d[:rows], W.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16), sets)
    _, t_read = times(lambda d: jnp.sum(W.astype(jnp.float32) + d[0, 0], axis=1), sets)
    row = {"shape": shape, "K": K, "N": N, "rows": rows,
           "cublas_us": round(sum(t_ideal.values()), 2), "w_read_us": round(sum(t_read.values()), 2)}
    print(shape, rows, "cublas", t_ideal, "W read (XLA reduce)", t_read, flush=True)
    for name in CONFIGS:
      cfg = config_for(K, N, name)
      try:
        out, t = times(lambda d, cfg=cfg: P.dx_pallas(d, W, perm, count, config=cfg), sets)
        err = float(jnp.max(jnp.abs(out[:rows].astype(jnp.float32) - ref.astype(jnp.float32))))
        zero_ok = bool(jnp.all(out[rows:] == 0))
        row[name] = round(sum(t.values()), 2)
        print(f"  {name:32s} {sum(t.values()):8.2f} us  err {err:.3g} zeros {zero_ok}  {t}  programs={cfg.dx_programs}", flush=True)
      except Exception as e:  # noqa
        row[name] = None
        print(f"  {name:32s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    results.append(row)
json.dump(results, open(sys.argv[2] if len(sys.argv) > 2 else "dx_probe.json", "w"), indent=1)
