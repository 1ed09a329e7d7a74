"""Which path of a bf16 sebp_matmul backward misses the f64 dW by more than bf16's tolerance?"""
import sys, numpy as np, jax, jax.numpy as jnp
from sebp_jax import sebp_matmul
rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
import os
IMPL = os.environ.get("PROBE_IMPL", "pallas")
M, K, N = 251, 1, 6
def paths():
  f = lambda impl, c=None: jax.jit(lambda x, k, dy: jax.vjp(lambda x, k: sebp_matmul(x, k, impl=impl, crossover=c), x, k)[1](dy)[1])
  return {"pallas_default": f(IMPL), "pallas_sparse": f(IMPL, 1.0), "dense": f("dense"), "xla": f("xla"),
          "dot_bf16": jax.jit(lambda x, k, dy: jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)),
          "dot_f32": jax.jit(lambda x, k, dy: jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16))}
P = paths(); worst = {k: 0.0 for k in P}; fails = {k: 0 for k in P}
for trial in range(int(sys.argv[2]) if len(sys.argv) > 2 else 300):
  x = rng.standard_normal((M, K)).astype(np.float32); k = rng.standard_normal((K, N)).astype(np.float32)
  keep = rng.random(M) < rng.uniform(0.05, 0.95)
  dy = (rng.standard_normal((M, N)) * keep[:, None]).astype(np.float32)
  xb, kb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, k, dy))
  want = np.asarray(xb, np.float64).T @ np.asarray(dyb, np.float64)
  for name, fn in P.items():
    got = np.asarray(fn(xb, kb, dyb), np.float64)
    excess = np.abs(got - want) / (0.016 + 0.016 * np.abs(want))
    worst[name] = max(worst[name], float(excess.max())); fails[name] += int((excess > 1).any())
for name in P:
  print(f"{name:16s} worst err/tol {worst[name]:.3f}  cases over tol {fails[name]}/300")
