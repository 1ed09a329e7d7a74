"""What one program of a Triton kernel holds on an H100 / H200, found on CPU: ``ptxas -v``'s
registers and spills, Triton's shared memory, and how many programs fit on one SM.

A launch sized for two programs per SM (a persistent grid of ``2 × SMs``, a split aiming at two
per SM) runs in twice the waves when only one fits; whether two fit is the compiled kernel's, so
it is read off the compiled kernel rather than assumed. Used by ``launch_resources`` (the Pallas
kernels) and ``launch_resources_torch`` (the torch reference's); needs Triton and its bundled
``ptxas``, no GPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import tempfile

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

TARGET = GPUTarget("cuda", 90, 32)  # an H100 / H200
SMS = 132
# Per SM of compute capability 9.0: registers, shared memory (228 KB, 1 KB of it reserved per
# program), warps. Registers are allocated per warp in units of 256.
_REGISTERS, _SHARED, _RESERVED, _WARPS = 65536, 228 * 1024, 1024, 64


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    spill_bytes: int  # spill stores per thread
    shared_bytes: int  # per program
    num_warps: int

    @property
    def programs_per_sm(self) -> int:
        per_warp = -(-self.registers * 32 // 256) * 256
        return min(_REGISTERS // (per_warp * self.num_warps),
                   _SHARED // (self.shared_bytes + _RESERVED), _WARPS // self.num_warps)


def _ptxas() -> str:
    ptxas = get_ptxas(TARGET.arch) if "arch" in inspect.signature(get_ptxas).parameters else get_ptxas()
    return getattr(ptxas, "path", ptxas)


def resources(compiled, num_warps: int) -> Resources:
    """``compiled``: what ``triton.compile`` returns for :data:`TARGET`."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/kernel.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([_ptxas(), "-v", f"--gpu-name=sm_{TARGET.arch}a", f"{tmp}/kernel.ptx",
                                 "-o", f"{tmp}/kernel.cubin"], capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    return Resources(int(re.search(r"Used (\d+) registers", report).group(1)),
                     int(spills.group(1)) if spills else 0, compiled.metadata.shared, num_warps)


def write_report(path: str, rows: list[dict], caption: str, columns: dict[str, str]) -> None:
    """``rows`` as JSON at ``path`` and as a markdown table beside it (``.md``): ``caption``, then
    one line per row of the ``columns`` (key: header)."""
    lines = [caption, "", "| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[key]) for key in columns) + " |" for row in rows]
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    with open(path.removesuffix(".json") + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
