"""A one-line Triton kernel around the int8 codes helpers of ``ssmq.kernels._common``, for their tests (a module of
its own: a jitted function resolves its globals here, and collection must not need triton)."""

import triton
import triton.language as tl

from ssmq.kernels._common import quantize_rne, rne_int8


@triton.jit
def codes_of(v_ptr, s_ptr, out_ptr, out2_ptr, n, BLOCK: tl.constexpr):
    # out = rne_int8(v), out2 = quantize_rne(v, s), elementwise
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, rne_int8(v), mask=m)
    tl.store(out2_ptr + offs, quantize_rne(v, tl.load(s_ptr + offs, mask=m, other=1.0)), mask=m)
