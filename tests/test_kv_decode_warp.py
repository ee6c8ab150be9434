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


@pytest.mark.parametrize("e, r", [(128, 128), (64, 64), (64, 32), (128, 64), (128, 32), (128, 0), (64, 0)])
@pytest.mark.parametrize("bits", [4, 3, 2])
def test_slots_pair_rotary_partners_within_a_head(w, e, r, bits):
    """Half a's slot k and half b's slot k hold one head's channels c and c + r / 2 (RoPE's pairs, c < r / 2) or two
    channels RoPE leaves (≥ r); across the slots and halves every channel of the E = 128 (128 / e heads) once; slot
    k's channel is in the 16-channel chunk of the lane whose fragment holds slot k (lane q = (k % 8) // 2), the
    chunk the load layout gives lane q in that half."""
    head, ch = w.slot_channels(e, r, bits)
    pair = 16 << w.rotary_bit(e, r)
    partner = ch + pair
    rotated = ch < r // 2
    assert torch.equal(partner[rotated], ch[rotated] + r // 2)
    assert bool((ch[~rotated] >= r).all()) and bool((partner < e).all())
    flat = torch.cat([head * e + ch, head * e + partner])
    assert sorted(flat.tolist()) == list(range(128))
    k = torch.arange(64)
    lane = (k % 8) // 2
    hbit = w.rotary_bit(e, r)
    for half, c in ((0, head * e + ch), (1, head * e + partner)):
        want = ((lane >> hbit) << (hbit + 1)) | (half << hbit) | (lane & ((1 << hbit) - 1))  # bit inserted at hbit
        assert torch.equal(c // 16, want)


@pytest.mark.parametrize("hbit", [0, 1, 2])
@pytest.mark.parametrize("cb", [8, 4, 2])  # bytes a chunk: 4 bits, the 2-bit plane, the 1-bit plane
def test_key_plane_layout_hands_each_lane_its_chunks(w, hbit, cb):
    """The load layout of a key plane, (T, 8 cb) bytes: lane (g8, q) holds tokens g8 and g8 + 8 of chunk
    ``ring_channel``'s chunk for q in half 0 and in half 1 (the register bit that ``_halves`` splits off), each
    chunk's cb bytes in order: the bytes ``slot_channels`` assigns the lane's slots."""
    L = w.key_plane_layout(cb, hbit)

    def where(lane, reg):  # (token, byte) of a lane's register: XOR of the bases of its set bits
        t = b = 0
        for bases, x in ((L.lane_bases, lane), (L.reg_bases, reg)):
            for i, (dt, db) in enumerate(bases):
                if x >> i & 1:
                    t, b = t ^ dt, b ^ db
        return t, b

    nbytes = cb.bit_length() - 1  # register bits of a chunk's bytes; then the token bit, then the half bit
    for lane in range(32):
        q, g8 = lane % 4, lane // 4
        for half in (0, 1):
            chunk = w.ring_channel.fn(torch.tensor(16 * q), half, hbit).item() // 16
            for byte in range(cb):
                for tok in (0, 1):
                    reg = byte | tok << nbytes | half << (nbytes + 1)
                    assert where(lane, reg) == (g8 + 8 * tok, chunk * cb + byte)


@pytest.mark.parametrize("e, r", [(128, 128), (64, 64), (64, 32)])
@pytest.mark.parametrize("bits", [4, 3])
def test_host_tables_are_in_slot_order(w, e, r, bits):
    """The within-tile rotation table, the tiles' angles and the key scales, column k = the channels
    ``slot_channels`` gives slot k: inverse frequency θ^(-2c / r) where RoPE turns c, else 0; a program's heads side
    by side, a missing last head's scales zero."""
    from ssmq.ops.kv_quant import KVSideView

    theta, hkv = 10000.0, 3
    head, ch = w.slot_channels(e, r, bits)
    inv = torch.where(ch < r // 2, 1.0 / theta ** (2 * ch.double() / r), 0.0)
    rope = w.rope_table(e, r, theta, bits, torch.device("cpu"))
    torch.testing.assert_close(rope[1, 5].double(), torch.sin(5 * inv), rtol=1e-3, atol=1e-3)
    ang = w.tile_angles(100, e, r, theta, bits, torch.device("cpu"))
    assert ang.shape == (7, 128)  # ceil(100 / 16) tiles
    torch.testing.assert_close(ang[3, :64].double(), torch.cos(48 * inv), rtol=1e-3, atol=1e-3)
    mid, half = torch.randn(hkv, e), torch.rand(hkv, e)
    side = KVSideView(torch.zeros(1, 16, hkv, e // 2, dtype=torch.uint8), torch.zeros(2 ** bits), mid, half, False,
                      torch.zeros(1, 16, 0, dtype=torch.int16), torch.zeros(1, 16, 0), torch.zeros(1, 1, hkv, e), bits)
    t = w.key_scale_table(side, r)
    heads = 128 // e
    assert t.shape == (-(-hkv // heads), 4, 64) and t.dtype == torch.float16
    kv = heads * (t.shape[0] - 1) + head  # the last program's heads
    live = kv < hkv
    pb = ch + (16 << w.rotary_bit(e, r))
    torch.testing.assert_close(t[-1, 3][live].float(), half[kv[live], pb[live]].half().float())
    assert bool((t[-1, :, ~live] == 0).all())
    assert w.key_scale_table(side, r) is t  # cached on the side's scales


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
    assert w.eligible(K, V, 64, 4) and w.eligible(K, V, 32, 4) and w.eligible(K, V, 0, 4)  # partial RoPE, none
    assert not w.eligible(K, V, 96, 4) and not w.eligible(K, V, 16, 4)  # rotary halves not whole chunk pairs
    assert w.eligible(view(bits=3), view(bits=3, per_token=True), 128, 4)  # nuq3
    assert w.eligible(view(bits=2), view(bits=4, per_token=True), 128, 4)  # widths may differ a side
    assert not w.eligible(view(bits=3, levels=7), V, 128, 4)  # int3 (symmetric): 7 levels
    assert not w.eligible(view(bits=8), V, 128, 4)
    assert not w.eligible(view(per_token=True), V, 128, 4)  # per-token keys (engine formats)
    assert w.eligible(view(slots=20), view(per_token=True, slots=10), 128, 4)  # 1% outliers
    K64, V64 = view(e=64), view(e=64, per_token=True)
    assert w.eligible(K64, V64, 64, 4) and w.eligible(K64, V64, 32, 3)  # SmolLM2, the hybrid
    assert not w.eligible(K64, V64, 128, 4)  # a rotary dim past the head
    assert not w.eligible(K64, V64, 64, 5)  # two heads' groups fill at most the 8 columns
    assert not w.eligible(view(e=32), view(e=32, per_token=True), 32, 2)
    assert not w.eligible(K, V, 128, 16)  # more than 8 query heads a kv head
    assert not w.eligible(K, V, 128, 4, paged_block=8)
    assert w.eligible(K, V, 128, 4, paged_block=32)
    assert not w.eligible(view(levels=15), V, 128, 4)  # the kernel reads 16 codebook entries


def _build_sm90(w, const: dict, head_dim: int = 128):
    """``_decode_kernel`` built for sm_90 as a launch specializes it (``compile_signature``), or the test skipped
    where Triton has no ptxas."""
    from ssmq.kernels.build import compile_sm90

    pointers, strides, _ = w.compile_signature(head_dim)
    try:
        return compile_sm90(w._decode_kernel, pointers, dict(const, w_h=1), floats=("scale",), num_warps=1,
                            aligned=(*pointers, *strides))
    except (FileNotFoundError, RuntimeError) as ex:
        if "ptxas" in str(ex):
            pytest.skip(f"no ptxas: {ex}")
        raise


@pytest.mark.parametrize("sink, paged, one, slots, bits, e, r",
                         [(1, 0, False, False, (4, 4), 128, 128), (0, 0, True, False, (4, 4), 128, 128),
                          (3, 64, False, False, (3, 3), 128, 128), (1, 0, False, True, (3, 3), 128, 128),
                          (1, 32, False, True, (2, 2), 128, 128), (1, 0, False, False, (2, 4), 128, 128),
                          (1, 0, False, True, (3, 3), 64, 64), (1, 32, False, False, (4, 2), 64, 32),
                          (1, 0, False, False, (4, 4), 128, 0)])
def test_warp_decode_compiles_for_sm90_with_operands_in_registers(w, sink, paged, one, slots, bits, e, r):
    """sm_90 build as launched: the tiles' codes arrive by cp.async (LDGSTS) into the STAGES-deep rings and are read
    once (LDS); no operand passes through shared memory (no STS in the loop), the loop's barriers are the one warp's
    own (at most 2); 16 tensor-core products a 16-token tile (keys: two halves x 4 k-steps; values: 8 row tiles), no
    spills; with the outliers' score buffer too."""
    from ssmq.kernels.build import main_loop, registers

    unit = w.compile_signature(e)[2]
    c = _build_sm90(w, w.constexprs(4 * e // 128, e, r, sink, paged, one, slots, slots, *bits, unit), e)
    regs, stack = registers(c)
    assert stack == 0 and regs <= 255
    loop = main_loop(c)
    assert loop["HMMA"] == 16
    assert loop["LDGSTS"] >= 2 and loop["STS"] == 0 and loop["BAR"] <= 2
    # each lane's bytes of a tile, once (at head dim 64 and 3 bits a lane's chunks of a half are apart: more pieces)
    assert loop["LDS"] <= (16 if e == 128 else 20)
    assert c.metadata.shared <= 8 * 1024  # the rings: 8 programs an SM take at most 64 KB


@pytest.mark.parametrize("bits", [4, 2])
def test_int64_lengths_build_the_int32_loop(w, bits):
    """The launch for int64 lengths (LW = 2, the models' dtype) builds the loop of the int32 build, opcode for opcode:
    a kernel built for an int64 pointer had the same instructions in another order and ran 15% slower (session 37)."""
    from ssmq.kernels.build import loop_instructions

    unit = w.compile_signature()[2]
    loops = [loop_instructions(_build_sm90(w, w.constexprs(4, 128, 128, 1, 0, False, False, False, bits, bits, unit,
                                                           words)))
             for words in (1, 2)]
    assert len(loops[0]) > 500 and loops[0] == loops[1]


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


def _case(case, gen, block=0, slots=(0, 0), levels=(16, 16), e=128):
    from test_kvquant_kernels import side

    b, hq, hkv, L, sink = case
    s = b + 2
    cap = -(-L // block) * block if block else L
    K = side(s, cap, hkv, e, False, slots[0], sink, gen, levels[0])
    V = side(s, cap, hkv, e, True, slots[1], sink, gen, levels[1])
    q = torch.randn(b, hq, e, generator=gen).cuda()
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
@pytest.mark.parametrize("bits", [4, 2])
def test_warp_kernel_takes_lengths_of_any_integer_dtype(w, bits):
    """int64 lengths (the models'), int32 ones and a strided int64 view give the same bits: the kernel reads a
    length a word at stride LW."""
    _gpu()
    K, V, q, slots, lens = _case((5, 32, 8, 300, 1), torch.Generator().manual_seed(6), levels=(2**bits, 2**bits))
    want = w.quant_kv_decode(q, slots, lens.int(), K, V, 128, 10000.0)
    strided = torch.stack([lens, lens], 1)[:, 0]
    for given in (lens.long(), strided):
        assert torch.equal(w.quant_kv_decode(q, slots, given, K, V, 128, 10000.0), want)


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


HEAD64_CASES = [  # b, hq, hkv, L, sink, e, r: two kv heads a program at head dim 64; partial or no RoPE
    (2, 9, 3, 300, 1, 64, 64),      # SmolLM2-135M's heads: an odd kv head count (the last program's second absent)
    (3, 6, 2, 1000, 1, 64, 32),     # the hybrid's: partial RoPE (half the channels), ragged rows
    (1, 16, 4, 2000, 2, 64, 64),    # GQA 4: the two heads' groups fill the 8 columns
    (2, 4, 1, 200, 0, 64, 0),       # one kv head, no RoPE, no sink
    (2, 32, 8, 300, 1, 128, 64),    # head dim 128, RoPE on half (partial_rotary_factor 0.5, as Bamba's)
    (1, 8, 2, 700, 3, 128, 32),     # a quarter
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HEAD64_CASES)
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("outliers", [(0, 0), (6, 3)])
@pytest.mark.parametrize("levels", [(16, 16), (8, 8), (4, 4), (16, 8)])
def test_warp_kernel_at_head_dim_64_and_partial_rope(w, case, splits, outliers, levels):
    _gpu()
    from test_kvquant_kernels import _cpu
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    *head, e, r = case
    K, V, q, slots, lens = _case(tuple(head), torch.Generator().manual_seed(5), slots=outliers, levels=levels, e=e)
    assert w.eligible(K, V, r, q.shape[1] // K.codes.shape[2])
    got = w.quant_kv_decode(q, slots, lens, K, V, r, 10000.0, splits=splits)
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), _cpu(K), _cpu(V), r, 10000.0)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("levels", [(16, 16), (8, 8)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_warp_kernel_reads_a_paged_head_dim_64_cache(w, levels, block_size):
    """SmolLM2's heads, paged: 3-bit heads of 24 bytes (the 8-byte stride units)."""
    _gpu()
    from test_kvquant_kernels import _cpu
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    gen = torch.Generator().manual_seed(6)
    K, V, q, slots, lens = _case((3, 9, 3, 300, 1), gen, block_size, (6, 3), levels, e=64)
    s, m = K.codes.shape[0], K.codes.shape[1] // block_size
    table = (1 + torch.randperm(s * m, generator=gen)).view(s, m).cuda()
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), _cpu(K), _cpu(V), 64, 10000.0)
    got = w.quant_kv_decode(q, slots, lens, K.paged(table, block_size), V.paged(table, block_size), 64, 10000.0,
                            block_table=table)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)


@pytest.mark.gpu
def test_dispatch_sends_served_formats_to_the_warp_kernel(w, monkeypatch):
    """The dispatch takes the warp kernel for a format it serves (and not under a policy that leaves it out); it
    refuses the others with a clear error."""
    _gpu()
    from ssmq.errors import SSMQError
    from ssmq.kernels import dispatch, policy

    K, V, q, slots, lens = _case((2, 32, 8, 300, 1), torch.Generator().manual_seed(3))
    calls = []
    real = w.quant_kv_decode
    monkeypatch.setattr(w, "quant_kv_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dispatch.quant_kv_decode(q, slots, lens, K, V, 128, 10000.0)
    assert calls == [1]
    monkeypatch.setattr(policy, "_ACTIVE", [policy.KernelPolicy(kv_decode=("kv_decode_fast", "kv_decode"))])
    dispatch.quant_kv_decode(q, slots, lens, K, V, 128, 10000.0)
    assert calls == [1]
    with pytest.raises(SSMQError, match="warp KV decode kernel serves"):
        real(q, slots, lens, K, V, 96, 10000.0)
