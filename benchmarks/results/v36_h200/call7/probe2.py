"""bf16-output dot against float32-output-then-cast: time (GPU) for the dense backward's GEMMs."""
import time, numpy as np, jax, jax.numpy as jnp
from jax import lax
DX, DW = (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ()))
def timed(fn, *a, reps=30):
  for _ in range(3): fn(*a).block_until_ready()
  ts = []
  for _ in range(reps):
    t = time.perf_counter(); fn(*a).block_until_ready(); ts.append(time.perf_counter() - t)
  return 1e3 * float(np.median(ts))
cases = {  # name: (lhs shape, rhs shape, dims)
  "bert_up dX 16384x3072 @ (768x3072)T": ((16384, 3072), (768, 3072), DX),
  "bert_up dW (16384x768)T @ 16384x3072": ((16384, 768), (16384, 3072), DW),
  "bert_down dX 16384x768 @ (3072x768)T": ((16384, 768), (3072, 768), DX),
  "llama_up_b4 dW (16384x3072)T @ 16384x8192": ((16384, 3072), (16384, 8192), DW),
  "llama_head_b1 dX 4096x128256 @ (3072x128256)T": ((4096, 128256), (3072, 128256), DX),
}
key = jax.random.key(0)
for name, (a, b, dims) in cases.items():
  x = jax.random.normal(key, a, jnp.bfloat16); y = jax.random.normal(key, b, jnp.bfloat16)
  f16 = jax.jit(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.bfloat16))
  f32 = jax.jit(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  ref = lax.dot_general(x.astype(jnp.float32), y.astype(jnp.float32), dims, precision=lax.Precision.HIGHEST)
  e16 = float(jnp.max(jnp.abs(f16(x, y).astype(jnp.float32) - ref)))
  e32 = float(jnp.max(jnp.abs(f32(x, y).astype(jnp.float32) - ref)))
  print(f"{name:48s} bf16-out {timed(f16, x, y):.3f} ms (max err {e16:.3g})  f32-out+cast {timed(f32, x, y):.3f} ms (max err {e32:.3g})")
