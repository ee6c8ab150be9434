"""How the decode kernels divide a row's tokens among splits (host side, no GPU): ``kv_decode.default_splits`` and
``whole_rounds``, the split count that fills whole rounds of resident programs for the latency-bound quantized
decode."""

import pytest

pytest.importorskip("triton")


def _idle(pairs, p, slots):
    """Fraction of the last round's resident programs left idle."""
    rounds = -(-pairs * p // slots)
    return (rounds * slots - pairs * p) / (rounds * slots)


def test_whole_rounds_fills_the_last_round():
    from ssmq.kernels.kv_decode import whole_rounds

    # 8 rows x 8 kv heads on 132 SMs x 2 programs: the WAVES rule's 9 splits make 576 programs (2.18 rounds, run as
    # 3); 8 make 512 (1.94 rounds, run as 2)
    assert whole_rounds(9, 64, 264) == 8
    # one row of 8 kv heads: 66 splits already fill two rounds exactly; kept
    assert whole_rounds(66, 8, 264) == 66
    for fill, pairs, slots in [(9, 64, 264), (2, 440, 264), (3, 120, 396), (17, 33, 264), (1, 1000, 264)]:
        p = whole_rounds(fill, pairs, slots)
        assert max(1, fill // 2) <= p <= 2 * fill
        assert _idle(pairs, p, slots) <= _idle(pairs, fill, slots) + 1e-12


def test_default_splits_moves_only_quantized_launches(monkeypatch):
    import torch

    from ssmq.kernels import kv_decode

    monkeypatch.setattr(kv_decode, "_sm_count", lambda device: 132)
    cfg = dict(WAVES=4, MIN_TILES=2)
    dev = torch.device("cpu")
    assert kv_decode.default_splits(8, 8, 32768, dev, 32, cfg) == 9  # float caches: WAVES alone
    assert kv_decode.default_splits(8, 8, 32768, dev, 32, cfg, resident=2) == 8
    assert kv_decode.default_splits(8, 8, 128, dev, 32, cfg, resident=2) == 2  # capped by the capacity's tiles
