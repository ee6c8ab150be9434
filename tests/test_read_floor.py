"""The GEMV read floor's kernel (``ssmq.bench.read_floor``) reads every word once: each program's sum equals the sum
of its share of the words, for sizes that do and do not fill the last program. ``gpu`` (``SSMQ_TRITON_INTERPRET=1``
runs it on CPU); the grid arithmetic runs anywhere."""

from __future__ import annotations

import pytest
import torch

from test_kernels import DEV, kernel_module


def test_grid_covers_the_words_in_about_one_wave():
    from ssmq.bench.read_floor import BLOCK, grid

    for n_words, p, sms in [(3_595_840, 4, 132), (1_740_800, 2, 132), (5, 4, 132), (BLOCK * 528, 4, 132)]:
        programs, iters = grid(n_words, p, sms)
        assert programs * iters * BLOCK >= n_words > (programs - 1) * iters * BLOCK
        assert programs <= p * sms


@pytest.mark.gpu
@pytest.mark.parametrize("n_words,p", [(4 * 1024 * 3, 1), (4 * 1024 * 3 + 517, 1), (9000, 2)])
def test_read_words_sums_each_programs_words(n_words, p):
    mod = kernel_module("ssmq.bench.read_floor")
    torch.manual_seed(n_words)
    words = torch.randint(-1000, 1000, (n_words,), dtype=torch.int32, device=DEV)
    out = mod.read_words(words, p)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if DEV == "cuda" else 4
    programs, iters = mod.grid(n_words, p, sms)
    share = iters * mod.BLOCK
    want = torch.stack([words[i * share:(i + 1) * share].sum() for i in range(programs)]).to(torch.int32)
    assert out.shape == (programs,) and torch.equal(out.cpu(), want.cpu())
