"""The warp KV decode kernel (``ssmq.kernels.kv_decode_warp``, Gluon): its index algebra and its sm_90 build on CPU;
on the GPU it equals ``quant_kv_decode_ref`` (contiguous and paged caches, sinks, splits, GQA groups, ragged rows)
and the dispatch sends it the formats it serves. Gluon kernels do not run in Triton's interpreter: the numerics are
GPU tests only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon (3.5+)")


@pytest.fixture(scope="module")
def w():
    from ssmq.kernels import kv_decode_warp

    return kv_decode_warp


def _channels(tokens: int, nbytes: int, bits: int) -> torch.Tensor:
    """The channel of each entry of a looked-up tile (bytes ``nbytes`` a token) as ``_lookup`` lays it out:
    4 bits, ``gl.join(lo, hi)`` + reshape, 2 byte + nibble; 2 and 3 bits, the nested joins of the 4 codes a byte of
    the 2-bit plane, 4 byte + code."""
    per = 2 if bits == 4 else 4
    byte = torch.arange(nbytes)[None, :, None].expand(tokens, nbytes, per)
    return (per * byte + torch.arange(per)).reshape(tokens, per * nbytes)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_key_relabelling_matches_the_slot_channels(w, bits):
    """``_key_operand``'s reshape / permute of the looked-up (token, channel) tile, done on channel numbers, puts
    channel ``key_channel(k)`` at slot k (the host tables and the query use that map), a bijection; lane q's slots
    (k // 2 % 4 == q in the m16n8k16 fragment) are the 16 channels of its own bytes, and each fragment register
    (slots 2m, 2m + 1) is one lookup's float16 pair: the same nibble (4 bits) or code (2, 3 bits) of the first two
    or the last two bytes of a lane's 32-bit word."""
    hp = 64
    if bits == 4:
        x = _channels(16, hp // 2, bits).reshape(16, 4, hp // 32, 2, 2, 2).permute(0, 2, 5, 3, 1, 4)
    else:
        x = _channels(16, hp // 4, bits).reshape(16, 4, 2, 2, 4).permute(0, 4, 2, 1, 3)
    k = torch.arange(hp)
    ch = w.key_channel.fn(k, bits)
    assert torch.equal(x.reshape(16, hp)[0], ch)
    assert sorted(ch.tolist()) == list(range(hp))
    assert torch.equal(ch // 16, (k // 2) % 4)
    per = 2 if bits == 4 else 4  # codes a byte
    first, second = ch[0::2], ch[1::2]
    assert torch.equal(second - first, torch.full_like(first, per))  # the same code of adjacent bytes
    byte_in_word = (first % 16) // per % 4
    assert set(byte_in_word.tolist()) == {0, 2}


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_value_relabelling_matches_the_row_channels(w, bits):
    """``_value_operand``'s relabelling puts channel ``value_channel(m)`` at row m (a bijection), and lane g8's rows
    (m % 8 == g8 in the fragment) are the 16 channels of its own bytes (8 g8 .. 8 g8 + 7 at 4 bits, 4 g8 .. 4 g8 + 3
    of the 2-bit plane at 2 and 3): the same map at every width, since the lookups hand it channel-ordered tiles."""
    e = 128
    x = _channels(16, e // 2 if bits == 4 else e // 4, bits)
    x = x.reshape(16, 8, e // 16, 2).permute(0, 2, 3, 1).reshape(16, e).T  # (rows, tokens)
    m = torch.arange(e)
    assert torch.equal(x[:, 0], w.value_channel.fn(m))
    assert sorted(w.value_channel.fn(m).tolist()) == list(range(e))
    assert torch.equal(w.value_channel.fn(m) // 16, m % 8)


@pytest.mark.parametrize("bits", [4, 3])
def test_host_tables_are_in_slot_order(w, bits):
    """The within-tile rotation table, the tiles' angles and the key scales, column k = channel key_channel(k) of
    the keys' width."""
    from ssmq.ops.kv_quant import KVSideView

    r, theta = 128, 10000.0
    inv = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ch = w.key_channel.fn(torch.arange(r // 2), bits)
    rope = w.rope_table(r, theta, bits, torch.device("cpu"))
    torch.testing.assert_close(rope[1, 5].double(), torch.sin(5 * inv[ch]), rtol=1e-3, atol=1e-3)
    ang = w.tile_angles(100, r, theta, bits, torch.device("cpu"))
    assert ang.shape == (7, r)  # ceil(100 / 16) tiles
    torch.testing.assert_close(ang[3, : r // 2].double(), torch.cos(48 * inv[ch]), rtol=1e-3, atol=1e-3)
    mid, half = torch.randn(2, 128), torch.rand(2, 128)
    side = KVSideView(torch.zeros(1, 16, 2, 64, dtype=torch.uint8), torch.zeros(2 ** bits), mid, half, False,
                      torch.zeros(1, 16, 0, dtype=torch.int16), torch.zeros(1, 16, 0), torch.zeros(1, 1, 2, 128), bits)
    t = w.key_scale_table(side)
    assert t.shape == (2, 4, 64) and t.dtype == torch.float16
    torch.testing.assert_close(t[1, 3].float(), half[1, 64 + ch].half().float())
    assert w.key_scale_table(side) is t  # cached on the side's scales


def test_eligible_formats(w):
    from ssmq.ops.kv_quant import KVSideView

    def view(bits=4, per_token=False, e=128, slots=0, sink=1, levels=None):
        return KVSideView(torch.zeros(1, 32, 2, -(-e * bits // 8), dtype=torch.uint8), torch.zeros(levels or 2 ** bits),
                          torch.zeros(1, 32, 2) if per_token else torch.zeros(2, e),
                          torch.zeros(1, 32, 2) if per_token else torch.zeros(2, e), per_token,
                          torch.zeros(1, 32, slots, dtype=torch.int16), torch.zeros(1, 32, slots),
                          torch.zeros(1, sink, 2, e), bits)

    K, V = view(), view(per_token=True)
    assert w.eligible(K, V, 128, 4)
    assert not w.eligible(K, V, 64, 4)  # partial RoPE
    assert w.eligible(view(bits=3), view(bits=3, per_token=True), 128, 4)  # nuq3
    assert w.eligible(view(bits=2), view(bits=4, per_token=True), 128, 4)  # widths may differ a side
    assert not w.eligible(view(bits=3, levels=7), V, 128, 4)  # int3 (symmetric): 7 levels
    assert not w.eligible(view(bits=8), V, 128, 4)
    assert not w.eligible(view(per_token=True), V, 128, 4)  # per-token keys (engine formats)
    assert w.eligible(view(slots=20), view(per_token=True, slots=10), 128, 4)  # 1% outliers
    assert not w.eligible(view(e=64), view(e=64, per_token=True), 64, 4)
    assert not w.eligible(K, V, 128, 16)  # more than 8 query heads a kv head
    assert not w.eligible(K, V, 128, 4, paged_block=8)
    assert w.eligible(K, V, 128, 4, paged_block=32)
    assert not w.eligible(view(levels=15), V, 128, 4)  # the kernel reads 16 codebook entries


@pytest.mark.parametrize("sink, paged, one, slots, bits", [(1, 0, False, False, (4, 4)), (0, 0, True, False, (4, 4)),
                                                           (3, 64, False, False, (3, 3)), (1, 0, False, True, (3, 3)),
                                                           (1, 32, False, True, (2, 2)), (1, 0, False, False, (2, 4))])
def test_warp_decode_compiles_for_sm90_with_operands_in_registers(w, sink, paged, one, slots, bits):
    """sm_90 build as launched: the tiles' codes arrive by cp.async (LDGSTS) into the STAGES-deep rings and are read
    once (LDS); no operand passes through shared memory (no STS in the loop), the loop's barriers are the one warp's
    own (at most 2); 16 tensor-core products a 16-token tile (keys: two halves x 4 k-steps; values: 8 row tiles), no
    spills; with the outliers' score buffer too."""
    from ssmq.kernels.build import compile_sm90, main_loop, registers

    pointers, strides = w.compile_signature()
    const = dict(GROUP=4, E=128, S=sink, BS=paged, ONE_SPLIT=one, KSLOTS=slots, VSLOTS=slots, w_h=1, KBITS=bits[0],
                 VBITS=bits[1], STAGES=w.STAGES)
    try:
        c = compile_sm90(w._decode_kernel, pointers, const, floats=("scale",), num_warps=1,
                         aligned=(*pointers, *strides))
    except (FileNotFoundError, RuntimeError) as ex:
        if "ptxas" in str(ex):
            pytest.skip(f"no ptxas: {ex}")
        raise
    regs, stack = registers(c)
    assert stack == 0 and regs <= 255
    loop = main_loop(c)
    assert loop["HMMA"] == 16
    assert loop["LDGSTS"] >= 2 and loop["STS"] == 0 and loop["BAR"] <= 2
    assert loop["LDS"] <= 16  # each lane's bytes of a tile, once
    assert c.metadata.shared <= 8 * 1024  # the rings: 8 programs an SM take at most 64 KB


# ---- GPU -------------------------------------------------------------------------------------------------------

WARP_CASES = [  # b, hq, hkv, L, sink: e = 128, full RoPE, per-channel keys, per-token values (4 bits unless a
    # test gives the widths)
    (2, 32, 8, 300, 1),     # Llama-3.1-8B's heads (GQA 4), one sink token
    (3, 8, 2, 1000, 0),     # no sink, ragged rows (one of length 1)
    (1, 12, 3, 5000, 3),    # a long row, 3 sink tokens
    (3, 16, 2, 200, 2),     # GQA 8 (a whole n8 column block), a row shorter than the sink
    (2, 2, 2, 100, 1),      # no GQA
]


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (Gluon kernels do not run in Triton's interpreter)")


def _case(case, gen, block=0, slots=(0, 0), levels=(16, 16)):
    from test_kvquant_kernels import side

    b, hq, hkv, L, sink = case
    s = b + 2
    cap = -(-L // block) * block if block else L
    K = side(s, cap, hkv, 128, False, slots[0], sink, gen, levels[0])
    V = side(s, cap, hkv, 128, True, slots[1], sink, gen, levels[1])
    q = torch.randn(b, hq, 128, generator=gen).cuda()
    slots = torch.randperm(s, generator=gen)[:b].cuda()
    lens = torch.randint(max(L // 2, 1), L + 1, (b,), generator=gen).cuda()
    lens[0] = L
    if b > 2:
        lens[-1] = 1
    return K, V, q, slots, lens


@pytest.mark.gpu
@pytest.mark.parametrize("case", WARP_CASES)
@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("outliers", [(0, 0), (20, 10), (3, 0), (0, 2)])  # none, 1% of 8 x 128, keys / values only
def test_warp_kernel_equals_reference(w, case, splits, outliers):
    """Within 3e-3 of the float32 reference (float16 operands and rotations: the module's accuracy note)."""
    _gpu()
    from test_kvquant_kernels import _cpu
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    K, V, q, slots, lens = _case(case, torch.Generator().manual_seed(1), slots=outliers)
    got = w.quant_kv_decode(q, slots, lens, K, V, 128, 10000.0, splits=splits)
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), _cpu(K), _cpu(V), 128, 10000.0)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("case", WARP_CASES)
@pytest.mark.parametrize("splits", [None, 7])
@pytest.mark.parametrize("outliers", [(0, 0), (20, 10)])
@pytest.mark.parametrize("levels", [(8, 8), (4, 4), (16, 4), (4, 8)])  # nuq3, nuq2 and mixed widths
def test_warp_kernel_equals_reference_at_3_and_2_bits(w, case, splits, outliers, levels):
    _gpu()
    from test_kvquant_kernels import _cpu
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    K, V, q, slots, lens = _case(case, torch.Generator().manual_seed(4), slots=outliers, levels=levels)
    assert (K.bits, V.bits) == tuple({16: 4, 8: 3, 4: 2}[x] for x in levels)
    got = w.quant_kv_decode(q, slots, lens, K, V, 128, 10000.0, splits=splits)
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), _cpu(K), _cpu(V), 128, 10000.0)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("outliers", [(0, 0), (20, 10)])
@pytest.mark.parametrize("levels", [(16, 16), (8, 8)])
def test_warp_kernel_reads_a_paged_cache_in_place(w, block_size, splits, outliers, levels):
    _gpu()
    from test_kvquant_kernels import _cpu
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    gen = torch.Generator().manual_seed(2)
    K, V, q, slots, lens = _case((3, 32, 8, 300, 1), gen, block_size, outliers, levels)
    s, m = K.codes.shape[0], K.codes.shape[1] // block_size
    table = (1 + torch.randperm(s * m, generator=gen)).view(s, m).cuda()
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), _cpu(K), _cpu(V), 128, 10000.0)
    got = w.quant_kv_decode(q, slots, lens, K.paged(table, block_size), V.paged(table, block_size), 128, 10000.0,
                            splits=splits, block_table=table)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)


@pytest.mark.gpu
def test_dispatch_sends_served_formats_to_the_warp_kernel(w, monkeypatch):
    """The dispatch takes the warp kernel for a format it serves (and not with SSMQ_KV_WARP=0's switch off); it
    refuses the others with a clear error."""
    _gpu()
    from ssmq.errors import SSMQError
    from ssmq.kernels import dispatch

    K, V, q, slots, lens = _case((2, 32, 8, 300, 1), torch.Generator().manual_seed(3))
    calls = []
    real = w.quant_kv_decode
    monkeypatch.setattr(w, "quant_kv_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dispatch.quant_kv_decode(q, slots, lens, K, V, 128, 10000.0)
    assert calls == [1]
    monkeypatch.setattr(dispatch, "_KV_WARP", False)
    dispatch.quant_kv_decode(q, slots, lens, K, V, 128, 10000.0)
    assert calls == [1]
    with pytest.raises(SSMQError, match="warp KV decode kernel serves"):
        real(q, slots, lens, K, V, 64, 10000.0)
