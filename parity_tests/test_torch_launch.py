"""``sebp_torch_ref.launch.CachedLaunch``: a launch it serves from its kept kernel is the launch
``kernel[grid]`` would make (same compiled kernel, same arguments in signature order), and a
launch whose specialisation differs goes back through ``kernel[grid]``.

CPU: against a recording stand-in for a Triton kernel, and the key against Triton's own
specialisation of the reference's kernels. GPU: the reference's GEMM launch, cached and not, bit
for bit, aligned and misaligned operands.
"""

from __future__ import annotations

import dataclasses
import inspect
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")
from parity_tests.triton_interpreter import INTERPRET  # noqa: E402
from sebp_torch_ref import launch  # noqa: E402


@dataclasses.dataclass
class _Param:
  name: str
  default: object = inspect.Parameter.empty


class _Compiled:
  function, packed_metadata = "function", "metadata"

  def __init__(self, runs: list) -> None:
    self.runs = runs

  def run(self, *args) -> None:
    self.runs.append(args)


class _Kernel:
  """Records ``kernel[grid](...)`` calls; each returns one compiled stand-in."""

  __name__ = "toy_kernel"
  params = [_Param("x_ptr"), _Param("n"), _Param("scale"), _Param("BLOCK"), _Param("EVEN", True)]

  def __init__(self) -> None:
    self.launches, self.runs = [], []
    self.compiled = _Compiled(self.runs)

  def __getitem__(self, grid):
    def run(*args, **kwargs):
      self.launches.append((grid, args, kwargs))
      return self.compiled
    return run


@pytest.fixture
def kernel(monkeypatch):
  monkeypatch.setattr(launch, "_device_and_stream", lambda: (0, 77))
  monkeypatch.setattr(launch, "_triton_version", lambda: launch.SUPPORTED_TRITON[0])
  return _Kernel()


def test_a_kept_kernel_gets_every_parameter_in_signature_order(kernel):
  x = torch.zeros(64)
  cached = launch.CachedLaunch(kernel)
  cached[(3,)](x, 10, 0.5, BLOCK=32)
  assert kernel.launches == [((3,), (x, 10, 0.5), {"BLOCK": 32})] and not kernel.runs
  cached[(4, 2)](x, 10, 0.5, BLOCK=32)
  assert len(kernel.launches) == 1
  # Tensors as their addresses, which the launcher takes as they are.
  assert kernel.runs == [(4, 2, 1, 77, "function", "metadata", None, None, None, x.data_ptr(), 10, 0.5, 32,
                          True)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int", "float", "constexpr"])
def test_another_specialisation_goes_through_the_kernel(kernel, change):
  x = torch.zeros(64)
  args, kwargs = [x, 10, 0.5], {"BLOCK": 32}
  cached = launch.CachedLaunch(kernel)
  cached[(1,)](*args, **kwargs)
  if change == "misaligned":
    args[0] = x[1:]  # 4 bytes past a 16-byte boundary: Triton compiles it without the alignment
  elif change == "dtype":
    args[0] = x.double()
  elif change == "int":
    args[1] = 16  # divisible by 16, which Triton specialises on
  elif change == "float":
    args[2] = 0.25
  else:
    kwargs["BLOCK"] = 64
  cached[(1,)](*args, **kwargs)
  assert len(kernel.launches) == 2 and not kernel.runs
  cached[(1,)](*args, **kwargs)
  assert len(kernel.launches) == 2 and len(kernel.runs) == 1


def test_a_missing_parameter_is_named(kernel):
  with pytest.raises(TypeError, match=r"\['BLOCK'\] of toy_kernel"):
    launch.CachedLaunch(kernel)[(1,)](torch.zeros(4), 1, 0.5)


def test_a_launch_hook_or_an_unread_triton_takes_kernel_grid(kernel, monkeypatch):
  x = torch.zeros(64)
  cached = launch.CachedLaunch(kernel)
  hook = lambda *_: None  # noqa: E731
  runtime = launch.triton.knobs.runtime
  chained = hasattr(runtime.launch_exit_hook, "add")  # a HookChain (Triton >= 3.5), else None
  with mock.patch.object(runtime, "launch_enter_hook", hook):
    for _ in range(2):
      cached[(1,)](x, 10, 0.5, BLOCK=32)
  if chained:
    runtime.launch_exit_hook.add(hook)
    try:
      cached[(1,)](x, 10, 0.5, BLOCK=32)
    finally:
      runtime.launch_exit_hook.remove(hook)
  assert len(kernel.launches) == 2 + chained and not kernel.runs
  monkeypatch.setattr(launch, "_triton_version", lambda: launch.SUPPORTED_TRITON[1])
  with pytest.warns(RuntimeWarning, match="toy_kernel launches through kernel\\[grid\\]"):
    unread = launch.CachedLaunch(kernel)
  for _ in range(2):
    unread[(1,)](x, 10, 0.5, BLOCK=32)
  assert len(kernel.launches) == 4 + chained and not kernel.runs


def test_the_kept_kernels_are_bounded(kernel, monkeypatch):
  monkeypatch.setattr(launch, "_MAX_KEPT", 3)
  cached = launch.CachedLaunch(kernel)
  for scale in range(5):
    cached[(1,)](torch.zeros(4), 1, float(scale), BLOCK=8)
  assert len(cached._kept) == 2  # cleared at the fourth


@pytest.mark.skipif(INTERPRET, reason="the interpreter's kernels are not specialised")
@pytest.mark.parametrize("name", ["_select_kernel", "_rank_key_kernel", "_compact_kernel", "_grads_kernel"])
def test_the_key_determines_tritons_specialisation(name):
  """Launches with one :func:`launch.specialization_key` get one specialisation from Triton's own
  binder (for an sm_90 target, on CPU). Each argument in turn takes every candidate while the
  others stay put: pointers, tensors of four dtypes at every residue of their address modulo 16
  (many share a key); integers around Triton's 1, 16-divisibility and 32-bit classes. A Triton
  that also specialised on, say, 32-byte alignment would give one key two specialisations."""
  from triton.backends.compiler import GPUTarget
  from triton.compiler.compiler import make_backend
  from triton.runtime.jit import create_function_from_signature

  from sebp_torch_ref import kernels

  kernel = getattr(kernels, name)
  binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
  positional = [p for p in kernel.params if not p.is_constexpr]
  constexprs = {p.name: 1 for p in kernel.params if p.is_constexpr}
  buffers = [torch.zeros(64, dtype=dtype) for dtype in (torch.bfloat16, torch.float32, torch.int32, torch.int8)]
  candidates = {
    "pointer": [buffer[offset:] for buffer in buffers for offset in range(33)],
    "integer": [1, 2, 15, 16, 17, 48, 2**31 - 1, 2**31, 2**40],
  }
  kinds = ["pointer" if p.name.endswith("_ptr") else "integer" for p in positional]
  base = [candidates[kind][0] if kind == "pointer" else 16 for kind in kinds]
  seen, launches = {}, 0
  for i, kind in enumerate(kinds):
    for value in candidates[kind]:
      args = base[:i] + [value] + base[i + 1:]
      key, _ = launch.specialization_key(tuple(args), constexprs)
      _, specialization, _ = binder(*args, **constexprs)
      assert seen.setdefault(key, specialization) == specialization, (positional[i].name, value)
      launches += 1
  assert len(seen) < launches / 4  # keys were shared, so the check above compared something


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_cached_gemm_launch_is_bitwise_kernel_grid(offset):
  """The reference's GEMM launch (dX, dW and db in one), cached against ``kernel[grid]``;
  ``offset`` 1 misaligns ``x`` (a view one element in), which Triton compiles apart."""
  from sebp_torch_ref import kernels

  gen = torch.Generator(device="cuda").manual_seed(offset)
  M, N, K = 300, 256, 192
  dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
  dy[::3] = 0
  x = torch.randn(M * K + offset, device="cuda", dtype=torch.bfloat16, generator=gen)[offset:].view(M, K)
  w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen)
  perm, count = kernels.select_rows(dy, kernels.RowPolicy())

  def grads(cached: bool):
    with mock.patch.object(kernels, "_CACHED_LAUNCH", cached):
      return kernels.sebp_gemms(dy, w, x, perm, count, torch.bfloat16, compacted=False,
                                bias_dtype=torch.float32)

  reference = grads(False)
  launcher = kernels._cached_launch(kernels._grads_kernel)
  for _ in range(3):  # the first compiles or finds its kernel; the rest run the kept one
    for got, want in zip(grads(True), reference):
      assert torch.equal(got, want)
  keys = [key for key in launcher._kept if key[1][0][2] == (torch.bfloat16, offset == 0)]
  assert keys, "the launch with x's alignment was not kept"
