"""The CPU tools that read what one program of a kernel holds (``benchmarks.ptx_resources``) and
which Pallas kernels one layer's backward launches (``benchmarks.launch_resources``)."""

from __future__ import annotations

import pytest

from parity_tests.triton_interpreter import INTERPRET

pytestmark = [
  pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the kernels that Triton compiles"),
]
pytest.importorskip("triton")


@pytest.mark.parametrize("registers, shared_kb, warps, fit", [
  (128, 72, 8, 2),  # 128 x 32 x 8 x 2 = 65,536: exactly two
  (129, 72, 8, 1),  # 4,128 per warp: 34,816 per program after rounding
  (170, 8, 4, 2),  # 5,440 per warp rounds to 5,632: two, not the three 5,440 would give
  (96, 120, 8, 1),  # 2 x (120 + 1) KB > 228 KB
  (255, 96, 4, 2),  # 4 warps: 65,536 // (8,192 x 4) = 2
  (32, 8, 4, 16),  # warps bound: 64 // 4
])
def test_programs_per_sm_is_the_tightest_of_registers_shared_memory_and_warps(registers, shared_kb, warps, fit):
  from benchmarks.ptx_resources import Resources

  assert Resources(registers, 0, shared_kb * 1024, warps).programs_per_sm == fit


def test_pallas_backward_kernels_are_read_from_the_cuda_export():
  from benchmarks.launch_resources import layer_launches

  launches, config = layer_launches(256, 128, 256)
  assert [launch.kernel for launch in launches] == ["sebp_partition", "sebp_gather", "sebp_dx", "sebp_dw"]
  for launch in launches:
    assert 0 < launch.resources.registers <= 255 and launch.grid >= 1 and launch.resources.programs_per_sm >= 1
  assert launches[-1].resources.num_warps == config.dw_warps
