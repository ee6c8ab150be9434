"""A Triton launch path keyed by the call's signature.

``JITFunction.run`` does per call: the binder (each argument's specialization), the compiled-kernel cache key,
launch metadata for hooks, the global-values check, then the compiled launcher. An eager prefill of a thousand
tokens makes ~500 launches whose kernels are shorter than that host work, so the host sets its time.
``FastKernel`` keys a call on what Triton specializes on (each tensor's dtype and 16-byte alignment, each int's
== 1, % 16 and 32 / 64-bit range; the constexprs and launch options by value): the first call of a key goes
through Triton and keeps the compiled kernel, later ones call its launcher directly. Anything it cannot key (a
callable grid, an unhashable constexpr, a launch hook installed, a kwarg it does not know) goes through Triton.
"""

from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

_I32, _I64 = 2 ** 31, 2 ** 63
# the current CUDA device, as Triton reads it; absent from CPU builds of torch (then every call goes through Triton)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


class _Unkeyed(Exception):
    pass


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (a profiler's): Triton 3.6 keeps a chain of them, earlier ones one or None."""
    return bool(getattr(hook, "calls", hook))


def arg_key(v):
    """What Triton's specialization of a runtime argument depends on (finer where it costs nothing)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return bool
    if isinstance(v, int):
        return v == 1, v % 16 == 0, -_I32 <= v < _I32, -_I64 <= v < _I64
    if isinstance(v, float):
        return float
    if v is None:
        return None
    raise _Unkeyed


class FastKernel:
    """``fn[grid](*args, **kwargs)`` as Triton launches it, through the compiled launcher once a call of the same
    signature was launched. Attributes other than ``[grid]`` are the JIT function's."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        params = fn.params
        self._runtime = {p.name for p in params if not p.is_constexpr}
        self._positional_runtime = [not p.is_constexpr for p in params]
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._cache: dict = {}

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def signature(self, args, kwargs) -> tuple:
        """The key of a call: runtime arguments by ``arg_key``, constexprs (positional or not) and options by value."""
        return (tuple(arg_key(v) if rt else (v,) for v, rt in zip(args, self._positional_runtime)),
                tuple((k, arg_key(v) if k in self._runtime else v) for k, v in kwargs.items()))

    def launch(self, grid, args, kwargs):
        key = None
        if _current_device is not None and not callable(grid) and not _hooked(knobs.runtime.launch_enter_hook) \
                and not _hooked(knobs.runtime.launch_exit_hook):
            try:
                key = (*self.signature(args, kwargs), _current_device())
                hit = self._cache.get(key)
            except (_Unkeyed, TypeError):  # TypeError: an unhashable constexpr
                key = hit = None
            if hit is not None:
                kernel, run, function, meta, tail = hit
                values = [*args, *(kwargs[n] if n in kwargs else self._defaults[n] for n in tail)]
                dev = key[-1]
                run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                    torch._C._cuda_getCurrentRawStream(dev), function, meta, None, None, None, *values)
                return kernel
        kernel = self.fn[grid](*args, **kwargs)
        if key is not None and kernel is not None and not hasattr(kernel, "result"):
            tail = self._names[len(args):]
            if all(n in kwargs or n in self._defaults for n in tail):
                self._cache[key] = (kernel, kernel.run, kernel.function, kernel.packed_metadata, tuple(tail))
        return kernel


def fast_launch(fn):
    """``FastKernel(fn)`` for a JIT function; the interpreter's functions (and anything else) as they are."""
    return FastKernel(fn) if isinstance(fn, JITFunction) else fn
