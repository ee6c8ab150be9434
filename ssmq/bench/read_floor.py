"""The read floor of a decode GEMV: one kernel that only reads a weight's bytes, timed like the GEMV.

A decode GEMV at one row must read its weight once; a kernel that reads the same bytes and does nothing else
(16-byte loads, every load of a program issued before the first use, one wave of ``programs_per_sm`` programs an
SM, one word written a program) is the least time any separate kernel can take for them. Its time against the
GEMV's says how much of the GEMV is the bytes and a kernel's launch, ramp and tail, and how much the GEMV's own
work. ``python -m ssmq.bench.gemv --floor`` times it beside each op.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import sm_count

BLOCK = 1024  # int32 words a program loads a step: 8 a thread at 4 warps, two 16-byte loads


@triton.jit
def _read(src, out, n_words, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (ITERS * BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):  # unrolled: a program's loads are all in flight together
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))


def grid(n_words: int, programs_per_sm: int, sms: int) -> tuple[int, int]:
    """(programs, ITERS): about ``programs_per_sm`` programs an SM, each reading ITERS steps of BLOCK words."""
    iters = max(1, math.ceil(n_words / (BLOCK * programs_per_sm * sms)))
    return math.ceil(n_words / (BLOCK * iters)), iters


def read_words(words: torch.Tensor, programs_per_sm: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """words: (n_words,) int32 -> (programs,) int32, each program's wrapping sum of the words it read."""
    programs, iters = grid(words.numel(), programs_per_sm, sm_count(words.device))
    if out is None:
        out = torch.empty(programs, dtype=torch.int32, device=words.device)
    _read[(programs,)](words, out, words.numel(), ITERS=iters, BLOCK=BLOCK, num_warps=4)
    return out


def read_op(nbytes: int, programs_per_sm: int):
    """(weights factory, op(x, weights)) in ``bench.gemv.make_op``'s form: the weights are ``nbytes`` (rounded up to
    whole words) of random int32 words, the op reads them all and ignores x."""
    n_words = -(-nbytes // 4)

    def make():
        return (torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, device="cuda"),
                torch.empty(0, device="cuda"))

    out = {}

    def op(x, w):  # one output buffer a weight copy: the capture holds its address
        key = w[0].data_ptr()
        out[key] = read_words(w[0], programs_per_sm, out.get(key))
        return out[key]

    return make, op
