"""Where do the SEBP BERT step's 144 memsets come from? Compile the per-batch program and list the
fusions XLA turns into memsets (a fused computation that only broadcasts a constant) and who uses
their results."""
import os, re, sys, collections, jax
from benchmarks.workloads import VARIANTS, Settings, jax_loss_and_grad, prepared_workload, single_workload_parser
out = os.environ["OUT"]
parser = single_workload_parser("memsets")
args = parser.parse_args(["--model", "bert", "--batch", "32", "--workload", "glue_sst2", "--out-dir", out])
spec, module, params, batches, header, stem = prepared_workload(parser, args, Settings(warmup=1, steps=1))
by_name = {v.name: v for v in VARIANTS}
for name in ("jax-sebp-pallas-per-batch", "jax-dense"):
  _, vg = jax_loss_and_grad(spec, by_name[name], module)
  text = jax.jit(vg).lower(params, batches[0]).compile().as_text()
  open(f"{out}/hlo_{name}.txt", "w").write(text)
  comps, cur = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:%)?([\w.\-]+) .*\{$", line) or re.match(r"^%?([\w.\-]+) \(", line)
    if line and not line.startswith(" ") and "{" in line:
      cur = line.split()[0].lstrip("%"); comps[cur] = []
    elif cur and line.strip() and line.strip() != "}":
      comps[cur].append(line.strip())
  memset_like = {c for c, body in comps.items()
                 if len(body) <= 3 and any("broadcast(" in l for l in body)
                 and all(("constant" in l or "broadcast" in l) for l in body)}
  users = collections.Counter()
  examples = []
  for c, body in comps.items():
    for l in body:
      m = re.search(r"calls=%?([\w.\-]+)", l)
      if m and m.group(1) in memset_like:
        shape = l.split("=")[1].split(" fusion")[0].strip()
        users[shape] += 1
        if len(examples) < 12: examples.append(l[:260])
  print("==", name, "memset-like fusions:", sum(users.values()), dict(users))
  for e in examples: print("   ", e)
  # Which instructions consume them (first 12)
  names = set()
  for c, body in comps.items():
    for l in body:
      m = re.search(r"calls=%?([\w.\-]+)", l)
      if m and m.group(1) in memset_like: names.add(l.split("=")[0].strip().lstrip("%"))
  n = 0
  for c, body in comps.items():
    for l in body:
      if any(re.search(r"%" + re.escape(x) + r"[,)]", l) for x in list(names)[:50]) and "calls=" not in l[:0]:
        if n < 15: print("    used by:", l[:260]); n += 1
