"""Scratch A/B (not committed): compiled plan with dX in the plan's order (v24) vs in place
(v23b), same process, same card; plus BERT's compiled dense and unplanned rows."""
import dataclasses, glob, importlib, inspect, json, os, sys, tarfile, time
import torch
from benchmarks.workloads import VARIANTS, Settings, run_torch, Row
import sebp_torch_ref.compiled as compiled

out = sys.argv[1]
slots_code = compiled._backward.__code__
src = inspect.getsource(compiled._backward)
assert 'dx_slots = impl == "triton" and keep is not None' in src
ns = dict(compiled.__dict__)
exec(src.replace('dx_slots = impl == "triton" and keep is not None', 'dx_slots = False'), ns)
in_place_code = ns["_backward"].__code__
by_name = {v.name: v for v in VARIANTS}
log = open(os.path.join(out, "ab.jsonl"), "a")

def run(model, workloads, variant, tag, slots):
    compiled._backward.__code__ = slots_code if slots else in_place_code
    torch._dynamo.reset()
    spec = importlib.import_module(f"benchmarks.{model}").build(False)
    spec = dataclasses.replace(spec, workloads=tuple(w for w in spec.workloads if w.name in workloads),
                               batch_sizes=(spec.batch_sizes[0],))
    t = time.time()
    for item in run_torch(spec, by_name[variant], Settings(warmup=2, steps=6)):
        if isinstance(item, Row):
            r = dataclasses.asdict(item); r["tag"] = tag; r["slots"] = slots
            print(tag, item.workload, "fwd %.2f bwd %.2f step %.2f spread %s peak %.3f GB compile %s err %s" % (
                item.fwd_ms or -1, item.bwd_ms or -1, item.step_ms or -1, item.bwd_spread,
                (item.peak_mem_bytes or 0) / 1e9, item.compile_s, item.error), flush=True)
            log.write(json.dumps(r) + "\n"); log.flush()
    print(tag, "wall %.0f s" % (time.time() - t), flush=True)
    if model == "bert" and "plan" in tag:
        with tarfile.open(os.path.join(out, tag + "_code.tgz"), "w:gz") as tar:
            for f in glob.glob("/tmp/torchinductor_*/**/*.py", recursive=True):
                if os.path.getmtime(f) > t and "_grads_kernel" in open(f, errors="ignore").read():
                    tar.add(f, arcname=os.path.basename(f))
    torch.cuda.empty_cache()

bert = ["rotten_tomatoes", "glue_sst2"]
if len(sys.argv) > 2:
    run("llama", ["piqa"], "torch-sebp-plan-compiled", "llama-plan-inplace", False); sys.exit()
run("bert", bert, "torch-sebp-plan-compiled", "bert-plan-slots", True)
run("bert", bert, "torch-sebp-plan-compiled", "bert-plan-inplace", False)
run("llama", ["piqa"], "torch-sebp-plan-compiled", "llama-plan-slots", True)
run("llama", ["piqa"], "torch-sebp-plan-compiled", "llama-plan-inplace", False)
run("bert", bert, "torch-dense-compiled", "bert-dense", True)
run("bert", bert, "torch-sebp-compiled", "bert-unplanned", True)
