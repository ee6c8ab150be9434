"""The GEMV read floor's kernel (``ssmq.bench.read_floor``) reads every word once: each program's sum equals the sum
of its share of the words, for sizes that do and do not fill the last program. ``gpu`` (``SSMQ_TRITON_INTERPRET=1``
runs it on CPU); the grid arithmetic runs anywhere."""

from __future__ import annotations

import pytest
import torch

from test_kernels import DEV, kernel_module

from ssmq.kernels._common import sm_count


def test_grid_covers_the_words_in_about_one_wave():
    from ssmq.bench.read_floor import BLOCK, grid

    for n_words, p, sms in [(3_595_840, 4, 132), (1_740_800, 2, 132), (5, 4, 132), (BLOCK * 528, 4, 132)]:
        programs, iters = grid(n_words, p, sms)
        assert programs * iters * BLOCK >= n_words > (programs - 1) * iters * BLOCK
        assert programs <= p * sms


@pytest.mark.gpu
# on 132 SMs (sm_count's figure for the interpreter too): one step a program, three, three with the last one partial
@pytest.mark.parametrize("n_words,p", [(9000, 2), (3 * 1024 * 132, 1), (3 * 1024 * 132 - 517, 1)])
def test_read_words_sums_each_programs_words(n_words, p):
    mod = kernel_module("ssmq.bench.read_floor")
    torch.manual_seed(n_words)
    words = torch.randint(-1000, 1000, (n_words,), dtype=torch.int32, device=DEV)
    out = mod.read_words(words, p)
    programs, iters = mod.grid(n_words, p, sm_count(torch.device(DEV)))
    share = iters * mod.BLOCK
    want = torch.stack([words[i * share:(i + 1) * share].sum() for i in range(programs)]).to(torch.int32)
    assert out.shape == (programs,) and torch.equal(out.cpu(), want.cpu())
