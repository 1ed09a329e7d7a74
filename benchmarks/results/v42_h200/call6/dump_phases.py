"""profile_step with each variant's GPU kernel sequence and its instructions' phases dumped."""
import json, os, pathlib, sys
import benchmarks.profile_step as p
from benchmarks import device_trace as d

orig = p.phase_times

def dump(events, phases, calls):
  out = pathlib.Path(os.environ["OUT"])
  by = {k.replace(".", "_"): v for k, v in phases.items()}
  rows = [[e["name"], e["tid"], e["ts"], e["dur"], d._own_phase(e, phases, by),
           (e.get("args") or {}).get("hlo_op", "")] for e in sorted(events, key=lambda e: (e["tid"], e["ts"]))]
  (out / "events.json").write_text(json.dumps(rows))
  (out / "phases.json").write_text(json.dumps(phases))
  return orig(events, phases, calls)

p.phase_times = dump
p._main(sys.argv[1:])
