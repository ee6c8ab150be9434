"""The plain state update's SASS as launched on Mamba2-2.7B's layer, built for sm_90 on this machine (no GPU):
registers, spills and the
instructions a thread issues a state value (the tile loop's of ``_step``, else the one-tile kernel's static count,
over the values a thread owns in a tile), for the fp16 state, the int8 state with row
scales on fp16 inputs, and the int8 state with a 16-group table on int8 inputs (Quamba2).

    python tests/sass_state_update.py
"""

from __future__ import annotations

import collections
import re

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from ssmq.kernels import state_update as su
from ssmq.kernels.build import _cuobjdump, main_loop, registers
from ssmq.ops.quant_ssm import RowScales

B_, H, P, N = 128, 80, 64, 128
SHOWN = ("LDG", "STG", "FFMA", "FMUL", "FADD", "FMNMX", "PRMT", "MUFU", "HADD2", "F2FP", "IMAD", "SHFL", "LOP3",
         "IADD3")


def capture(call):
    """(kernel, grid, args, kwargs) of the launch ``call`` makes (any jit kernel of the module)."""
    got = {}

    class Capture:
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            return lambda *args, **kwargs: got.update(kernel=self.k, grid=grid, args=args, kwargs=kwargs)

    names = [n for n, v in vars(su).items() if isinstance(v, triton.runtime.jit.JITFunction) and n.endswith("_update")
             or n in ("_step",)]
    real = {n: getattr(su, n) for n in names}
    for n in names:
        setattr(su, n, Capture(real[n]))
    try:
        call()
    finally:
        for n, k in real.items():
            setattr(su, n, k)
    return got["kernel"], got["grid"], got["args"], got["kwargs"]


def build(kernel, args, kwargs):
    kwargs = dict(kwargs)
    for k in ("FAST_RCP", "PTX_CODES"):
        if k in kernel.arg_names:
            kwargs[k] = su.CFG.get(k.lower(), True)
    options = {k: kwargs.pop(k) for k in ("num_warps", "maxnreg", "num_stages") if k in kwargs}
    values = {**dict(zip(kernel.arg_names, args)), **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        v = values[param.name] if param.name in values else param.default
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", v
            continue
        ty, attr = native_specialize_impl(BaseBackend, v, False, True, True)
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), options


_OP = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def ops(compiled):
    return collections.Counter(m.group(1) for line in _cuobjdump(compiled, "-sass").splitlines()
                               if (m := _OP.match(line)))


def inputs(mode):
    x, Bv, Cv = torch.randn(B_, H, P), torch.randn(B_, 1, N), torch.randn(B_, 1, N)
    dt = torch.randn(B_, H).half()[:, :, None].expand(B_, H, P)  # per head (stride 0), as the model
    A = (-torch.rand(H))[:, None, None].expand(H, P, N)
    per_head = torch.randn(H)[:, None].expand(H, P)
    kw = dict(D=per_head, dt_bias=per_head, dt_softplus=True, state_batch_indices=torch.arange(B_, dtype=torch.int32))
    if mode == "fp16":
        st = torch.zeros(B_, H, P, N, dtype=torch.float16)
        return lambda: su.quant_state_update(st, None, None, x.half(), None, dt, A, Bv.half(), None, Cv.half(),
                                             None, **kw)
    st = torch.zeros(B_, H, P, N, dtype=torch.int8)
    if mode == "int8rows":
        return lambda: su.quant_state_update(st, RowScales(torch.rand(B_, H, P)), None, x.half(), None, dt, A,
                                             Bv.half(), None, Cv.half(), None, **kw)
    table, index = torch.rand(16, N), torch.randint(0, 16, (H * P,))
    return lambda: su.quant_state_update(st, table, index, x.to(torch.int8), torch.rand(H, P), dt, A,
                                         Bv.to(torch.int8), torch.rand(1, N), Cv.to(torch.int8), torch.rand(1, N),
                                         out_dtype=torch.float16, **kw)


def values_per_thread(kernel, kwargs, options) -> float:
    """State values one thread owns in one tile (BP x BN)."""
    return kwargs["BP"] * kwargs["BN"] / (32 * options.get("num_warps", 4))


def main():
    print(f"{'state':10s} {'kernel':14s} {'regs':>4s} {'stack':>5s} {'instr':>6s} {'/value':>6s}  "
          + " ".join(f"{o:>5s}" for o in SHOWN))
    for mode in ("fp16", "int8rows", "int8table"):
        kernel, grid, args, kwargs = capture(inputs(mode))
        compiled, options = build(kernel, args, kwargs)
        regs, stack = registers(compiled)
        try:  # the tile loop of ``_step`` (a tile an iteration), else the whole one-tile kernel
            c = main_loop(compiled)
        except AssertionError:
            c = ops(compiled)
        total = sum(v for k, v in c.items() if k not in ("NOP", "BRA", "EXIT"))
        vpt = values_per_thread(kernel, kwargs, options)
        print(f"{mode:10s} {kernel.fn.__name__:14s} {regs:4d} {stack:5d} {total:6d} {total / vpt:6.2f}  "
              + " ".join(f"{c.get(o, 0):5d}" for o in SHOWN), flush=True)


if __name__ == "__main__":
    main()
