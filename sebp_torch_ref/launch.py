"""Eager launches of a Triton kernel without :meth:`triton.JITFunction.run`'s per-call work.

Why: under a row plan a layer's SEBP backward is one GEMM launch, and eagerly BERT-base's step
waits on host time, not on the GPU (``benchmarks/NOTES_torch.md``, v22 and v33). Each
``kernel[grid](...)`` binds and specialises every argument, builds the cache key from them and
the launch options, checks the kernel's globals and asks for launch metadata before the driver's
call. :class:`CachedLaunch` does that work once per specialisation and then calls the compiled
kernel the way Inductor's generated launchers do.

``CachedLaunch(kernel)[grid](*args, **kwargs)`` launches exactly as ``kernel[grid](*args, **kwargs)``
does. The first launch of a specialisation goes through ``kernel[grid]`` (compiling if Triton
has not) and keeps the compiled kernel it returns; later ones call that kernel directly. The
specialisation key is a superset of what Triton specialises on, so a kept kernel is never called
with an argument its compilation did not assume: each tensor's dtype and whether its address is
16-byte aligned, the value of every other argument and keyword, and the current device. Kept
launches pass each tensor as its address, which Triton's launcher takes without a ``data_ptr()``
call or a driver query per pointer, so the driver no longer refuses a host tensor there: the
reference checks every tensor's device at its API (:func:`~sebp_torch_ref.kernels.check_device`).
What ``kernel[grid]`` reads from Triton's knobs at each launch (``debug``, the instrumentation
mode) is read at a specialisation's first launch, and the kernel's globals are checked then; the
reference changes neither between launches.

The direct call uses Triton's internal launcher signature (``CompiledKernel.run(grid_0, grid_1,
grid_2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``), the
same in the Triton releases :data:`SUPPORTED_TRITON` names. Under any other release every launch
goes through ``kernel[grid]``, with a ``RuntimeWarning`` when the launcher is made; while a launch
hook is set (a profiler such as Proton reads each launch's metadata), so do the launches.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch
import triton

__all__ = ["CachedLaunch", "SUPPORTED_TRITON", "specialization_key"]

# Triton releases [3.6, 3.10): the launcher signature was read in 3.6 and 3.9 (the same), and the
# cached launches run against ``kernel[grid]`` on a GPU with 3.6 (parity_tests/test_torch_launch.py).
SUPPORTED_TRITON = ((3, 6), (3, 10))

# Distinct specialisations kept per kernel; past it the cache starts again (a float argument that
# changes every launch must not grow it without bound).
_MAX_KEPT = 256


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def specialization_key(args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """``(key, arguments)``: what a launch's compiled kernel depends on (each tensor as its dtype
    and whether its address is 16-byte aligned, Triton's pointer specialisation; anything else by
    value), and the positional arguments with each tensor as its address, which the launcher
    takes as it is (a tensor it would ask for ``data_ptr()`` and the driver for the pointer's
    attributes, once per launch)."""
    key, arguments = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            address = a.data_ptr()
            key.append((a.dtype, address % 16 == 0))
            arguments.append(address)
        else:
            key.append(a)
            arguments.append(a)
    return (tuple(key), tuple(kwargs.items())), arguments


def _device_and_stream() -> tuple[int, int]:
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    return device, driver.get_current_stream(device)


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set: a function, or a non-empty ``HookChain`` (Triton's default
    is an empty chain, which ``kernel[grid]`` calls for nothing)."""
    runtime = triton.knobs.runtime
    return any(hook is not None and getattr(hook, "calls", True) != []
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


class CachedLaunch:
    """``kernel[grid](...)``, with the compiled kernel kept per specialisation (module docstring).

    >>> launch = CachedLaunch(my_kernel)  # doctest: +SKIP
    >>> launch[(blocks,)](x, y, n, BLOCK=128)  # doctest: +SKIP
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.enabled = SUPPORTED_TRITON[0] <= _triton_version() < SUPPORTED_TRITON[1]
        if not self.enabled:  # said, not silent: eager steps pay kernel[grid]'s host time
            low, high = SUPPORTED_TRITON
            warnings.warn(
                f"CachedLaunch: Triton {triton.__version__} is outside the releases whose launcher "
                f"signature it was written against ({low[0]}.{low[1]} to before {high[0]}.{high[1]}); "
                f"{getattr(kernel, '__name__', kernel)} launches through kernel[grid], with more host "
                f"time per launch.", RuntimeWarning, stacklevel=2)
        self._kept: dict[tuple, tuple[Any, tuple]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if not self.enabled or _launch_hooks_set():
            self.kernel[grid](*args, **kwargs)
            return
        device, stream = _device_and_stream()
        specialization, arguments = specialization_key(args, kwargs)
        key = (device, specialization)
        kept = self._kept.get(key)
        if kept is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if len(self._kept) >= _MAX_KEPT:
                self._kept.clear()
            self._kept[key] = (compiled, self._trailing_arguments(args, kwargs))
            return
        compiled, trailing = kept
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None,
                     None, *arguments, *trailing)

    def _trailing_arguments(self, args: tuple, kwargs: dict) -> tuple:
        """The kernel's parameters after the positional ``args``, in signature order, as
        ``kernel[grid]`` binds them: given by keyword, else their defaults (the launcher takes
        every parameter, constexprs included, and skips the constexprs itself)."""
        params = self.kernel.params[len(args):]
        missing = [p.name for p in params if p.name not in kwargs and p.default is inspect.Parameter.empty]
        if missing:
            raise TypeError(f"CachedLaunch: `kwargs` lacks parameters {missing} of {self.kernel.__name__}.")
        return tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params)
