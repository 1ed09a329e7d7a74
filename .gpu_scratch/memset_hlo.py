"""Which buffers of one SEBP layer's backward does XLA memset? Optimized HLO of a BERT FFN-up
layer's gradient (with and without bias), written to $OUT, with the broadcast/memset lines printed."""
import os, re, jax, jax.numpy as jnp
from sebp_jax import sebp_matmul, RowPolicy
out = os.environ["OUT"]
x = jnp.ones((16384, 768), jnp.bfloat16); w = jnp.ones((768, 3072), jnp.bfloat16)
b = jnp.ones((3072,), jnp.bfloat16); g = jnp.ones((16384, 3072), jnp.bfloat16)
for name, bias in (("nobias", None), ("bias", b)):
  def grads(x, w, b, g):
    y, vjp = jax.vjp(lambda x, w, b: sebp_matmul(x, w, b, impl="pallas", crossover=1.0), x, w, b)
    return vjp(g)
  bb = bias if bias is not None else None
  f = jax.jit(lambda x, w, g: grads(x, w, bb, g)) if bias is None else jax.jit(grads)
  args = (x, w, g) if bias is None else (x, w, b, g)
  text = f.lower(*args).compile().as_text()
  open(f"{out}/hlo_{name}.txt", "w").write(text)
  print("==", name, len(text.splitlines()), "lines")
  for line in text.splitlines():
    if re.search(r"broadcast|memset|custom-call|ROOT|copy\(|pad\(", line) and len(line) < 400:
      print("  ", line.strip()[:300])
