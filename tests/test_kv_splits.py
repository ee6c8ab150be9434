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
        wide = whole_rounds(fill, pairs, slots, most=max(2 * fill, 8))  # a wider search never idles more
        assert _idle(pairs, wide, slots) <= _idle(pairs, p, slots) + 1e-12


def test_warp_kernel_splits_fill_the_last_round_at_large_batch(monkeypatch):
    """``kv_decode_warp.default_splits`` may go up to WIDEST splits where a round of 8 x 132 resident programs is
    not a multiple of the (row, kv head) pairs: 113 rows of 8 kv heads take 7 splits (5.99 rounds), not 2 (1.71
    rounds run as 2); the whole-round cases keep their counts and a short cache still caps them."""
    import torch

    pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon (3.5+)")
    from ssmq.kernels import kv_decode_warp as w

    monkeypatch.setattr(w, "_sm_count", lambda device: 132)
    dev = torch.device("cpu")
    assert w.default_splits(113, 8, 32768, dev) == 7
    assert _idle(113 * 8, 7, 8 * 132) < 0.01
    assert w.default_splits(1, 8, 131072, dev) == 132  # one row: one round exactly
    assert w.default_splits(8, 8, 32768, dev) == 33  # two rounds exactly
    assert w.default_splits(113, 8, 64, dev) == 2  # 4 tiles: at most one split per MIN_TILES
    monkeypatch.setattr(w, "MAXNREG", 168)  # a register cap: 12 programs an SM (``resident_programs``), one round
    assert w.default_splits(1, 8, 131072, dev) == 12 * 132 // 8


def test_default_splits_moves_only_quantized_launches(monkeypatch):
    import torch

    from ssmq.kernels import kv_decode

    monkeypatch.setattr(kv_decode, "_sm_count", lambda device: 132)
    cfg = dict(WAVES=4, MIN_TILES=2)
    dev = torch.device("cpu")
    assert kv_decode.default_splits(8, 8, 32768, dev, 32, cfg) == 9  # float caches: WAVES alone
    assert kv_decode.default_splits(8, 8, 32768, dev, 32, cfg, resident=2) == 8
    assert kv_decode.default_splits(8, 8, 128, dev, 32, cfg, resident=2) == 2  # capped by the capacity's tiles


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the grid and the launch options."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


def test_register_cap_sets_the_programs_an_sm_and_the_splits(monkeypatch):
    """The fast kernel's quantized launches take its register cap (MAXNREG, MAXNREG_OUTLIERS), and the split count
    fills whole rounds of the programs an SM holds under that cap; float caches keep their own registers, per-token
    keys launch uncapped (``launch_cfg``: the caps were measured on the folded per-channel loop)."""
    import torch

    from ssmq.kernels import kv_decode
    from ssmq.kernels import kv_decode_fast as kf

    assert [kv_decode.resident_programs(r, 4) for r in (128, 168, 188, 236)] == [4, 3, 2, 2]
    monkeypatch.setattr(kv_decode, "_sm_count", lambda device: 132)
    monkeypatch.setattr(kv_decode, "_combine_kernel", _Recorder())
    b, hkv, e, L = 8, 8, 128, 32768
    q, slots, lens = torch.zeros(b, 4 * hkv, e), torch.arange(b), torch.full((b,), L)
    cache = torch.zeros(b, L, hkv, e, dtype=torch.float16)
    kt, ks, vt, vs, sinks, flags = kv_decode.float_args(cache, cache)
    cfg = dict(kf.CFG, MAXNREG=128, MAXNREG_OUTLIERS=168, RESIDENT=2)
    monkeypatch.setattr(kf, "CFG", cfg)
    splits = []
    for quantized, slots_k, keys_per_token, regs in ((False, 0, False, None), (True, 0, False, 128),
                                                     (True, 2, False, 168), (True, 0, True, None)):
        decode = _Recorder()
        launch_flags = dict(flags, FLOAT=not quantized, KSLOTS=slots_k, K_PER_TOKEN=keys_per_token)
        kv_decode._launch(q, slots, lens, kt, ks, vt, vs, sinks, launch_flags, 0, 1e4, None, None, kernel=decode,
                          cfg=kf.launch_cfg(keys_per_token), const=kf.constexprs, extra=(q, 0, 0))
        (grid, options), = decode.launches
        assert options.get("maxnreg") == regs and grid[:2] == (b, hkv)
        splits.append(grid[2])
    # 64 (row, kv head) pairs: WAVES alone 9 splits (576 programs); 4 programs an SM (528 slots): 8 splits, one
    # round of 512; 3 (396 slots): 6 splits, one round of 384; per-token keys uncapped, RESIDENT 2 (264 slots): 8
    # splits, two rounds of 256
    assert splits == [9, 8, 6, 8]


def test_combine_tiling_widens_the_grid_of_few_heads(monkeypatch):
    """One row of few heads (SmolLM2's 9 at head dim 64, 528 splits) takes 4-channel blocks (48 programs, not 12)
    and 128 splits a loop step; a grid already of two programs an SM keeps 16 channels; a step's tile is 2048
    elements, never more splits than the launch has."""
    import torch

    from ssmq.kernels import kv_decode

    monkeypatch.setattr(kv_decode, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert kv_decode.combine_tiling(1, 9, 64, 528, cpu) == (4, 4, 128)
    assert kv_decode.combine_tiling(1, 32, 128, 132, cpu) == (4, 4, 128)
    assert kv_decode.combine_tiling(8, 32, 128, 33, cpu) == (4, 16, 32)
    assert kv_decode.combine_tiling(1, 2, 64, 3, cpu) == (2, 4, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("b, hq, e, splits", [(1, 9, 64, 37), (2, 6, 32, 5), (1, 3, 16, 130)])
@pytest.mark.parametrize("tiling", [None, (4, 16, 32), (2, 4, 8)])
def test_combine_equals_the_softmax_merge(b, hq, e, splits, tiling):
    """The combine (any tiling) merges the splits' (acc, m, l) as the log2-softmax algebra says: Σ 2^m acc / Σ 2^m l
    (empty splits, m = -inf, weigh nothing)."""
    import torch
    from test_kernels import DEV, kernel_module

    kd = kernel_module("kv_decode")
    if tiling and (tiling[0] > hq or tiling[1] > e):
        pytest.skip("tiling wider than the shape")
    gen = torch.Generator().manual_seed(0)
    out, ws = kd.split_outputs(b, hq, e, splits, DEV)
    acc = torch.randn(b, hq, splits, e, generator=gen)
    m = torch.randn(b, hq, splits, generator=gen) * 4
    m[:, :, 1] = float("-inf")  # an empty split
    l = torch.rand(b, hq, splits, generator=gen) + 0.5
    ws[..., :e] = acc.to(DEV)
    ws[..., e] = m.to(DEV)
    ws[..., e + 1] = l.to(DEV)
    w = torch.exp2(m - m.max(-1, keepdim=True).values)
    want = (w[..., None] * acc).sum(2) / (w * l).sum(2)[..., None]
    torch.testing.assert_close(kd.combine_splits(out, ws, splits, tiling).cpu(), want, rtol=1e-5, atol=1e-5)
