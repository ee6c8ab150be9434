"""The persistent in_proj -> out_proj chain (``ssmq.prototype.persistent_gemv``) equals the chain of references:
one program under the interpreter (a barrier of one program never waits), a full grid on a GPU."""

from __future__ import annotations

import pytest
import torch

from ssmq.ops.quant_linear import pack_words, words_linear_ref
from test_kernels import DEV, INTERPRET, kernel_module, rel

pytestmark = pytest.mark.gpu


def _layers(L, n, k):
    words = torch.stack([pack_words(torch.randint(-7, 8, (n, k), device=DEV, dtype=torch.int8), 4) for _ in range(L)])
    scales = torch.rand(L, n, k // 128, device=DEV) * (2 / (4.3 * k ** 0.5))
    return words, scales


@pytest.mark.parametrize("tiles,warps", [(1, 4), (4, 8)])
@pytest.mark.parametrize("programs", [1] if INTERPRET else [1, 7, 264])  # on a GPU at most what fits at once
def test_chain_equals_the_references(programs, tiles, warps):
    P = kernel_module("ssmq.prototype.persistent_gemv")
    torch.manual_seed(0)
    L, d, d_in, n1 = (2, 256, 256, 384) if INTERPRET else (2, 2560, 5120, 10576)
    w1, s1 = _layers(L, n1, d)
    w2, s2 = _layers(L, d, d_in)
    x0 = torch.randn(d, device=DEV, dtype=torch.float16)
    ref = x0[None]
    for layer in range(L):  # float64 sums: the exact function of the codes
        mid = words_linear_ref(ref.double(), w1[layer], 4, s1[layer]).half()
        ref = words_linear_ref(mid[:, :d_in].double(), w2[layer], 4, s2[layer]).half()
    if programs > 1:  # a barrier waits for every program: all must be resident (probed with one, which never waits)
        probe = P.Chain(w1, s1, w2, s2, 1, tiles, warps)(x0.clone())
        getattr(probe, "_init_handles", lambda: None)()
        programs = min(programs, P.resident_programs(probe, x0.device, warps))
    chain = P.Chain(w1, s1, w2, s2, programs, tiles, warps)
    x = x0.clone()
    chain(x)
    assert torch.isfinite(x).all() and rel(x.float(), ref[0].float()) < 3e-3
    x2 = x0.clone()
    chain(x2)  # the barrier and the split counters reset themselves: a second launch is the same
    assert torch.equal(x, x2)
