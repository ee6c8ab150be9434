"""One-line Triton kernels around the int8 codes helpers of ``ssmq.kernels._common``, for their tests (a module of
its own: a jitted function resolves its globals here, and collection must not need triton)."""

import triton
import triton.language as tl

from ssmq.kernels._common import int8_to_float, quantize_rne, rne_int8, rne_int8_of_product, rne_int8_sat


@triton.jit
def codes_of(v_ptr, s_ptr, out_ptr, out2_ptr, n, BLOCK: tl.constexpr):
    # out = rne_int8(v), out2 = quantize_rne(v, s), elementwise
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, rne_int8(v), mask=m)
    tl.store(out2_ptr + offs, quantize_rne(v, tl.load(s_ptr + offs, mask=m, other=1.0)), mask=m)


@triton.jit
def codes_of_product(v_ptr, r_ptr, q_ptr, out_ptr, sat_ptr, back_ptr, n, PTX: tl.constexpr, BLOCK: tl.constexpr):
    # out = rne_int8_of_product(v, r), sat = rne_int8_sat(v * r), back = int8_to_float(q), elementwise (n a multiple
    # of BLOCK: unmasked, as the state-update kernel's even tiles, so that the packed PTX path is the one compiled)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v, r = tl.load(v_ptr + offs), tl.load(r_ptr + offs)
    tl.store(out_ptr + offs, rne_int8_of_product(v, r, PTX))
    tl.store(sat_ptr + offs, rne_int8_sat(v * r, PTX))
    tl.store(back_ptr + offs, int8_to_float(tl.load(q_ptr + offs), PTX))
