"""Which bf16 dot shapes does XLA:GPU get wrong with a bf16 output, and what does it compile them to?
And what does a float32 output then a cast cost at model shapes (with a consumer to fuse into)?"""
import os, re, sys, numpy as np, jax, jax.numpy as jnp
from jax import lax
from benchmarks.timing import device_time_ms
DW = (((0,), (0,)), ((), ()))
DX = (((1,), (1,)), ((), ()))
def dot(out):
  if out == "bf16":
    return jax.jit(lambda a, b, d: lax.dot_general(a, b, d, preferred_element_type=jnp.bfloat16), static_argnums=2)
  return jax.jit(lambda a, b, d: lax.dot_general(a, b, d, preferred_element_type=jnp.float32).astype(jnp.bfloat16), static_argnums=2)
F = {"bf16": dot("bf16"), "f32": dot("f32")}
def kinds(fn, a, b, d):
  txt = fn.lower(a, b, d).compile().as_text()
  out = set(re.findall(r'custom_call_target="([^"]+)"', txt))
  out |= {"reduce" for l in txt.splitlines() if " reduce(" in l}
  out |= set(re.findall(r'"kind":"(__triton[a-z_]*)"', txt))
  out |= {"split_k" for l in txt.splitlines() if "split_k" in l and '"split_k":"1"' not in l}
  return ",".join(sorted(out)) or "?"
rng = np.random.default_rng(0)
print("flags:", os.environ.get("XLA_FLAGS", ""))
print(f"{'kind':3s} {'M':>5s} {'K':>4s} {'N':>4s} | bf16: worst fails | f32: worst fails | bf16 compiles to")
for kind, dims in (("dW", DW), ("dX", DX)):
  for M in (251, 4000):
    for K in (1, 2, 8, 37, 256):
      for N in ((1, 6, 37, 256) if kind == "dW" else (251, 4000)):
        worst = {"bf16": 0.0, "f32": 0.0}; fails = {"bf16": 0, "f32": 0}
        trials = 40 if M * K * N < 4e6 else 6
        for _ in range(trials):
          keep = rng.random(M) < rng.uniform(0.05, 0.95)
          if kind == "dW":
            a = rng.standard_normal((M, K)); b = rng.standard_normal((M, N)) * keep[:, None]
          else:  # dY (M', N=contraction) x W (K, contraction): contraction = N here
            a = rng.standard_normal((M if M < 1000 else 64, N)); b = rng.standard_normal((K, N))
          ab, bb = (jnp.asarray(v, jnp.bfloat16) for v in (a, b))
          a64, b64 = (np.asarray(v, np.float64) for v in (ab, bb))
          want = a64.T @ b64 if kind == "dW" else a64 @ b64.T
          for name, fn in F.items():
            got = np.asarray(fn(ab, bb, dims), np.float64)
            excess = np.abs(got - want) / (0.016 + 0.016 * np.abs(want))
            worst[name] = max(worst[name], float(excess.max())); fails[name] += int((excess > 1).any())
        print(f"{kind:3s} {M:5d} {K:4d} {N:4d} | {worst['bf16']:6.2f} {fails['bf16']:3d}/{trials:<3d} | {worst['f32']:6.2f} {fails['f32']:3d}/{trials:<3d} | {kinds(F['bf16'], ab, bb, dims)}", flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "time":
  # Model dW shapes: bf16 output, f32 output + cast, each alone and feeding an SGD-like update.
  cases = {"bert_up dW": (16384, 768, 3072), "bert_attn dW": (16384, 768, 768),
           "llama_up_b1 dW": (4096, 3072, 8192), "llama_up_b4 dW": (16384, 3072, 8192)}
  key = jax.random.key(0)
  for name, (M, K, N) in cases.items():
    sets = []
    for i in range(4):
      k1, k2, k3 = jax.random.split(jax.random.fold_in(key, i), 3)
      sets.append((jax.random.normal(k1, (M, K), jnp.bfloat16), jax.random.normal(k2, (M, N), jnp.bfloat16),
                   jax.random.normal(k3, (K, N), jnp.bfloat16)))
    res = {}
    for out in ("bf16", "f32"):
      t = jnp.bfloat16 if out == "bf16" else jnp.float32
      g = lambda x, dy, w, t=t: lax.dot_general(x, dy, DW, preferred_element_type=t).astype(jnp.bfloat16)
      res[out] = device_time_ms(g, sets)
      res[out + "+upd"] = device_time_ms(lambda x, dy, w, g=g: (w - 0.01 * g(x, dy, w)).astype(jnp.bfloat16), sets)
    print(name, "  ".join(f"{k} {v:.4f} ms" for k, v in res.items()), flush=True)
