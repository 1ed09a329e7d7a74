import collections, gzip, json, os, pathlib, shutil, tempfile
import jax, jax.numpy as jnp
from benchmarks import device_trace

def loss(w1, w2, x):
  return jnp.sum(jnp.tanh(x @ w1) @ w2)
k = jax.random.PRNGKey(0)
w1 = jax.random.normal(k, (1024, 2048), jnp.bfloat16); w2 = jax.random.normal(k, (2048, 512), jnp.bfloat16)
x = jax.random.normal(k, (4096, 1024), jnp.bfloat16)
g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
jax.block_until_ready(g(w1, w2, x))
out = pathlib.Path(os.environ["OUT"])
hlo = g.lower(w1, w2, x).compile().as_text()
(out / "hlo.txt").write_text(hlo)
with tempfile.TemporaryDirectory() as d:
  with jax.profiler.trace(d, create_perfetto_trace=True):
    jax.block_until_ready(g(w1, w2, x))
  for f in pathlib.Path(d).rglob("*"):
    if f.is_file():
      print(f.relative_to(d), f.stat().st_size)
      shutil.copy(f, out / f.name)
  ev = device_trace._trace_events(pathlib.Path(d))
procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
print("processes", procs); print("threads", threads)
keys = collections.Counter()
for e in ev:
  if e.get("ph") == "X":
    keys[(procs.get(e["pid"]), threads.get((e["pid"], e["tid"])), tuple(sorted((e.get("args") or {}).keys())))] += 1
for k_, n in keys.most_common(): print(n, k_)
gk = device_trace.gpu_kernel_events(ev)
for e in gk[:8]: print("GPU", json.dumps(e)[:600])
host = [e for e in ev if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
for e in host[:8]: print("HLO", json.dumps(e)[:600])
print(device_trace.phase_times(gk, device_trace.instruction_phases(hlo), 1))
