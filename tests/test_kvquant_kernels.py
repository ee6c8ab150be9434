"""The Triton decode kernels over a quantized KV cache equal ``quant_kv_decode_ref`` (GPU, or
SSMQ_TRITON_INTERPRET=1 on CPU): LUT K with on-the-fly RoPE, LUT V, sparse outliers, sink, GQA, ragged rows."""

import pytest
import torch

from test_kernels import DEV, INTERPRET, kernel_module

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def k():
    return kernel_module("kv_decode")


@pytest.fixture(scope="module")
def kf():
    return kernel_module("kv_decode_fast")


def side(s, L, hkv, e, per_token, slots_k, sink, gen, levels=8):
    """A random quantized side: codes < levels packed as the cache packs them (2 / 3 / 4 bits for <= 4 / 8 / 16
    levels), sorted codebook, scales, some outliers (distinct channels within a token, as quantization picks them;
    -1 = empty; ordered and the codes under them as quantization leaves them: ``order_slots``, ``outlier_codes``),
    sink."""
    from ssmq.ops.kv_quant import KVSideView, code_bits, order_slots, outlier_codes, pack_codes

    bits = code_bits(levels)
    codes = torch.randint(0, levels, (s, L, hkv, e), generator=gen, dtype=torch.uint8)
    book = torch.sort(torch.rand(levels, generator=gen) * 2 - 1).values
    if per_token:
        mid = (torch.randn(s, L, hkv, generator=gen) * 0.1).half()
        half = (torch.rand(s, L, hkv, generator=gen) + 0.5).half()
    else:
        mid, half = torch.randn(hkv, e, generator=gen) * 0.1, torch.rand(hkv, e, generator=gen) + 0.5
    idx = torch.rand(s, L, hkv * e, generator=gen).argsort(-1)[..., :slots_k]  # distinct within a token
    idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.2, -1, idx).to(torch.int16)
    val = (torch.randn(s, L, slots_k, generator=gen) * 5).half()
    idx, val = order_slots(idx, val)
    codes = pack_codes(outlier_codes(codes, idx, val, mid.float()[..., None] if per_token else mid, levels), bits)
    sinks = torch.randn(s, sink, hkv, e, generator=gen)
    to = lambda t: t.to(DEV)  # noqa: E731
    return KVSideView(to(codes), to(book), to(mid), to(half), per_token, to(idx), to(val), to(sinks), bits)


CASES = [  # b, hq, hkv, e, L, rotary dim, key outlier slots, sink, levels (keys, values)
    (2, 6, 2, 64, 100, 32, 2, 1, 8),   # the hybrid's heads: partial RoPE, nuq3-1% (3-bit codes)
    (1, 4, 4, 32, 70, 32, 0, 0, 16),   # full RoPE, no outliers, no sink, 4 bits
    (3, 2, 1, 16, 40, 0, 1, 2, 4),     # no RoPE, 2 bits
    (2, 4, 2, 32, 60, 16, 2, 1, (7, 3)),   # int3 keys (7 levels: 3 bits), int2 values (3 levels: 2 bits)
    (2, 4, 2, 16, 50, 16, 1, 0, (4, 16)),  # 2-bit keys, 4-bit values
]
if not INTERPRET:
    CASES.append((2, 9, 3, 64, 5000, 64, 4, 1, 8))  # SmolLM2's heads, a long ragged context


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k_per_token", [False, True])
def test_decode_kernels_equal_reference(k, case, k_per_token):
    _check(k, case, k_per_token)


SPLIT_CASES = [  # GQA groups 4 (partial RoPE, 3 sinks), 20 (more than 16 heads a kv head), 2 (rows shorter than
    (2, 8, 2, 32, 150, 32, 3, 3, 16),  # the sink: lengths 1 to 3)
    (2, 20, 1, 16, 50, 16, 1, 1, 8),
    (3, 4, 2, 16, 3, 0, 2, 2, 4),
]


@pytest.mark.parametrize("case", SPLIT_CASES)
@pytest.mark.parametrize("splits", [1, 3, 8])  # 8: more splits than the short rows have tiles (empty splits)
def test_decode_splits_equal_reference(k, case, splits):
    _check(k, case, False, splits)


FAST_CASES = [  # b, hq, hkv, e, L, rotary dim, (no key outliers), sink, levels: what kv_decode_fast serves
    (2, 8, 2, 64, 100, 64, 0, 1, 16),        # SmolLM2-style heads (e 64, full RoPE: 32-channel halves), 4 bits
    (1, 6, 2, 128, 300, 128, 0, 0, 8),       # Llama / Bamba-9B-style heads (e 128, full RoPE), 3 bits
    (2, 4, 2, 128, 120, 64, 0, 2, (4, 16)),  # partial RoPE with 32-channel halves, 2-bit keys, 4-bit values
    (3, 4, 4, 64, 80, 0, 0, 0, 4),           # no RoPE, 2 bits
    (2, 6, 2, 64, 100, 32, 0, 1, 8),         # the hybrid's heads: partial RoPE with 16-channel halves, 3 bits
    (1, 4, 4, 32, 70, 32, 0, 0, 16),         # full RoPE with 16-channel halves, 4 bits
    (2, 4, 2, 32, 60, 16, 0, 1, (4, 16)),    # 8-channel halves (the gathered lookup there), 2-bit keys
]


@pytest.mark.parametrize("case", FAST_CASES)
@pytest.mark.parametrize("k_per_token", [False, True])
@pytest.mark.parametrize("splits", [None, 1])
def test_fast_kernel_equals_reference(kf, case, k_per_token, splits):
    """kv_decode_fast's fp16 tensor-core products: within 3e-3 (its docstring's accuracy note)."""
    _check(kf, case, k_per_token, splits, v_outliers=0, tol=3e-3)


@pytest.mark.parametrize("case", FAST_CASES)
@pytest.mark.parametrize("fold", [True, False])
def test_fast_kernel_per_channel_values(kf, case, fold, monkeypatch):
    """Per-channel value scales (and key scales), applied in float16 (FOLD) or float32."""
    monkeypatch.setitem(kf.CFG, "FOLD", fold)
    _check(kf, case, False, None, v_outliers=0, tol=3e-3, v_per_token=False)


OUTLIER_CASES = [c for c in CASES + SPLIT_CASES if c[3] % 32 == 0]  # head dims the fast kernel serves


@pytest.mark.parametrize("case", OUTLIER_CASES)
@pytest.mark.parametrize("k_per_token", [False, True])
def test_fast_kernel_with_outliers_equals_reference(kf, case, k_per_token):
    """Key and value sparse outliers (1 value slot), sinks, ragged rows, 16-channel rotary halves."""
    _check(kf, case, k_per_token, None, v_outliers=1, tol=3e-3)


@pytest.mark.parametrize("case", OUTLIER_CASES[:2])
@pytest.mark.parametrize("splits", [None, 1, 8])  # 1: taken as 2 (the value pass adds into the splits' outputs)
def test_fast_kernel_with_several_value_outliers_a_head(kf, case, splits):
    """Five value slots a token over 1-2 kv heads: several of a head's outliers in one token; in the splits'
    frames, empty splits (8) included."""
    _check(kf, case, False, splits, v_outliers=5, tol=3e-3)


@pytest.mark.parametrize("case", OUTLIER_CASES[:1] + SPLIT_CASES[:1])
def test_outlier_passes_loop_over_their_row_s_blocks(kf, case, monkeypatch):
    """The outlier passes run a few programs a row (``SPARSE_PROGRAMS`` an SM over the rows), each looping over the
    row's iterations (``SPARSE_SLOTS`` slot positions, whole tokens) below its length: with one program an SM and 8
    positions an iteration (2 tokens of 3 value slots, the last 2 positions idle), every program takes several."""
    monkeypatch.setitem(kf.CFG, "SPARSE_PROGRAMS", 1)
    monkeypatch.setitem(kf.CFG, "SPARSE_SLOTS", 8)
    _check(kf, case, False, None, v_outliers=3, tol=3e-3)


def test_fast_kernel_takes_slots_in_any_order(kf):
    """Quantization stores a token's slots in index order (``order_slots``) for the key pass's speed; the kernel's
    result does not depend on it: the slots reversed give the reference's output too."""
    from dataclasses import replace

    from ssmq.ops.kv_quant import quant_kv_decode_ref

    gen = torch.Generator().manual_seed(3)
    K, V = side(3, 40, 2, 32, False, 4, 1, gen, 16), side(3, 40, 2, 32, True, 3, 1, gen, 16)
    K, V = (replace(x, out_idx=x.out_idx.flip(-1).contiguous(), out_val=x.out_val.flip(-1).contiguous())
            for x in (K, V))
    q = torch.randn(2, 4, 32, generator=gen).to(DEV)
    slots, lens = torch.tensor([2, 0]).to(DEV), torch.tensor([40, 23]).to(DEV)
    got = kf.quant_kv_decode(q, slots, lens, K, V, 32, 10000.0)
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), _cpu(K), _cpu(V), 32, 10000.0)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)


def test_fast_kernel_refuses_what_it_does_not_serve(kf):
    gen = torch.Generator().manual_seed(0)
    K, V = side(3, 20, 2, 64, False, 1, 0, gen), side(3, 20, 2, 64, True, 0, 0, gen)
    K16 = side(3, 20, 2, 16, False, 0, 0, gen)
    q, slots, lens = torch.randn(1, 4, 16).to(DEV), torch.tensor([0]).to(DEV), torch.tensor([20]).to(DEV)
    assert kf.eligible(K, V, 64) and kf.eligible(V, V, 32) and not kf.eligible(V, V, 24)
    assert not kf.eligible(K16, K16, 16)  # head dim 16: 16-wide tensor-core products
    from dataclasses import replace

    K3 = side(3, 20, 2, 64, False, 0, 0, gen, levels=8)
    odd = torch.empty(K3.codes.numel() + 1, dtype=torch.uint8, device=K3.codes.device)[1:].view(K3.codes.shape)
    assert kf.eligible(K3, K3, 64) and kf.eligible(replace(K3, codes=odd), K3, 64)  # bytes: no alignment asked
    from ssmq.errors import SSMQError

    with pytest.raises(SSMQError, match="fast KV decode kernel serves"):
        kf.quant_kv_decode(q, slots, lens, K16, K16, 16)


def _check(k, case, k_per_token, splits=None, v_outliers=1, tol=1e-4, v_per_token=True):
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    b, hq, hkv, e, L, r, ko, sink, levels = case
    gen = torch.Generator().manual_seed(0)
    s = b + 2
    k_levels, v_levels = levels if isinstance(levels, tuple) else (levels, levels)
    K = side(s, L, hkv, e, k_per_token, ko, sink, gen, k_levels)
    V = side(s, L, hkv, e, v_per_token, v_outliers, sink, gen, v_levels)
    q = torch.randn(b, hq, e, generator=gen).to(DEV)
    slots = torch.randperm(s, generator=gen)[:b].to(DEV)
    lens = torch.randint(max(L // 2, 1), L + 1, (b,), generator=gen).to(DEV)
    lens[0] = L
    if b > 2:
        lens[-1] = 1  # a new row: shorter than the sink when there are several sink tokens
    got = k.quant_kv_decode(q, slots, lens, K, V, r, 10000.0, splits=splits)
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), *(_cpu(x) for x in (K, V)), r, 10000.0)
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_float_kv_decode_equals_attention_reference(k, splits, dtype):
    """The kernel over a float cache (fp16: the FP16 baseline of bench_kvquant and the models' decode; bf16 / fp32:
    loaded to float32 as well) is ``attention_ref`` on its rows."""
    from ssmq.ops.attention import attention_ref

    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("the interpreter computes through numpy, which has no bfloat16")
    gen = torch.Generator().manual_seed(2)
    s, L, hkv, e, b, hq = 5, 90, 2, 32, 3, 6
    kc, vc = (torch.randn(s, L, hkv, e, generator=gen).to(dtype).to(DEV) for _ in range(2))
    q = torch.randn(b, hq, e, generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(s, generator=gen)[:b].to(DEV)
    lens = torch.tensor([L, 1, 37], device=DEV)
    got = k.float_kv_decode(q, slots, lens, kc, vc, splits=splits)
    want = attention_ref(q.float()[:, None], kc[slots].float(), vc[slots].float(), lens)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [4, 32, 64])
def test_float_kv_decode_reads_a_paged_cache_in_place(k, block_size):
    """Over block pools and a block table (the serve cache, ``ssmq.models.paged_kv``): the kernel reads token t of
    slot s at block table[s, t // B], offset t % B (blocks shuffled, unassigned entries at the null block 0), equal
    to ``attention_ref`` over the rows' blocks laid end to end, and to the dispatch's CPU reference."""
    from ssmq.kernels import dispatch
    from ssmq.ops.attention import attention_ref

    gen = torch.Generator().manual_seed(3)
    s, L, hkv, e, hq = 4, 130, 2, 32, 6
    m = -(-L // block_size)
    kp, vp = (torch.randn(1 + s * m, block_size, hkv, e, generator=gen).half().to(DEV) for _ in range(2))
    table = (1 + torch.randperm(s * m, generator=gen)).view(s, m)
    table[2, 2:] = 0  # slot 2 holds fewer blocks: the rest are the null block (past its length)
    table = table.to(DEV)
    slots = torch.tensor([3, 2, 0], device=DEV)
    lens = torch.tensor([L, 2 * block_size - 1, 37], device=DEV)
    q = torch.randn(3, hq, e, generator=gen).half().to(DEV)
    got = k.float_kv_decode(q, slots, lens, kp, vp, splits=3, block_table=table)
    rows = table[slots]  # (b, M): each row's blocks in order
    want = attention_ref(q.float()[:, None], kp[rows].flatten(1, 2).float(), vp[rows].flatten(1, 2).float(),
                         lens)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ref = dispatch.float_kv_decode(q.cpu(), slots.cpu(), lens.cpu(), kp.cpu(), vp.cpu(), block_table=table.cpu())
    torch.testing.assert_close(ref, want.cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
def test_fast_float_kv_decode_equals_attention_reference(kf, dtype, paged):
    """``kv_decode_fast.float_kv_decode``: the fast kernel over a float16 / bfloat16 cache (products in its dtype),
    dense and paged, ragged rows (1 token to the whole capacity), several splits; float32 caches refused."""
    from ssmq.ops.attention import attention_ref

    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("the interpreter computes through numpy, which has no bfloat16")
    gen = torch.Generator().manual_seed(4)
    s, L, hkv, e, b, hq, bs = 5, 96, 2, 64, 3, 8, 32
    # a cache of s slots, or a pool of 1 + s·L/bs blocks (block 0 the null block) and each slot's blocks, shuffled
    table = (1 + torch.randperm(s * (L // bs), generator=gen)).view(s, L // bs) if paged else None
    shape = (1 + s * (L // bs), bs, hkv, e) if paged else (s, L, hkv, e)
    kc, vc = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(b, hq, e, generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(s, generator=gen)[:b]
    lens = torch.tensor([L, 1, 37])
    rows = (lambda c: c[table[slots]].flatten(1, 2)) if paged else (lambda c: c[slots])  # noqa: E731
    want = attention_ref(q.float().cpu()[:, None], rows(kc).float(), rows(vc).float(), lens)[:, 0]
    got = kf.float_kv_decode(q, slots.to(DEV), lens.to(DEV), kc.to(DEV), vc.to(DEV), splits=3,
                             block_table=None if table is None else table.to(DEV))
    tol = 3e-3 if dtype == torch.float16 else 2e-2  # q and p rounded to the cache's dtype (8 bits of bfloat16)
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    from ssmq.errors import SSMQError

    with pytest.raises(SSMQError, match="float16 / bfloat16 caches"):
        kf.float_kv_decode(q, slots.to(DEV), lens.to(DEV), kc.float().to(DEV), vc.float().to(DEV))


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("splits", [None, 1])
def test_fast_kernel_reads_a_paged_cache_in_place(kf, block_size, splits):
    """Paged quantized KV (the serve cache): block pools read through the block table (tiles of 32 tokens across
    16-token blocks, or two a block), key and value outliers (their own passes), per-channel keys and per-token
    values, sinks, ragged rows: equal to the reference over the rows' blocks, and the dispatch's CPU reference over
    the pools equal to the one over the contiguous rows."""
    from ssmq.kernels import dispatch
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    gen = torch.Generator().manual_seed(5)
    s, L, hkv, e, hq, r = 4, 150, 2, 64, 6, 32
    m = -(-L // block_size)
    K, V = side(s, m * block_size, hkv, e, False, 2, 1, gen, 8), side(s, m * block_size, hkv, e, True, 2, 1, gen, 16)
    table = (1 + torch.randperm(s * m, generator=gen)).view(s, m).to(DEV)  # each row's blocks, shuffled
    KP, VP = K.paged(table, block_size), V.paged(table, block_size)
    q = torch.randn(3, hq, e, generator=gen).to(DEV)
    slots, lens = torch.tensor([3, 1, 0], device=DEV), torch.tensor([L, 2 * block_size - 1, 37], device=DEV)
    want = quant_kv_decode_ref(q.cpu(), slots.cpu(), lens.cpu(), _cpu(K), _cpu(V), r, 10000.0)
    got = kf.quant_kv_decode(q, slots, lens, KP, VP, r, 10000.0, splits=splits, block_table=table)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)
    ref = dispatch.quant_kv_decode(q.cpu(), slots.cpu(), lens.cpu(), _cpu(KP), _cpu(VP), r, 10000.0,
                                   block_table=table.cpu())
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)


def _cpu(view):
    from dataclasses import fields, replace

    return replace(view, **{f.name: getattr(view, f.name).cpu() for f in fields(view)
                            if isinstance(getattr(view, f.name), torch.Tensor)})


def test_model_decode_through_kernels_equals_reference_decode(k, monkeypatch):
    """A tiny hybrid with kvquant-nuq3-1%: decode steps through the kernels equal decode steps through
    ``quant_kv_decode_ref`` (the caches hold the same codes: teacher-forced tokens, and attention is the last layer;
    on CPU the interpreter runs the kernels in place of the dispatch's reference)."""
    import ssmq.kernels
    from _quant_tiny import tiny_calib, tiny_model
    from ssmq.ops.kv_quant import quant_kv_decode_ref
    from ssmq.quant import quantize

    m = tiny_model("hybrid")
    quantize(m, "kvquant-nuq3-1%", tiny_calib(4, 32), progress=False)
    m = m.to(DEV)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEV)
    runs, calls = [], []
    for impl in (k.quant_kv_decode, quant_kv_decode_ref):
        monkeypatch.setattr(ssmq.kernels, "quant_kv_decode",  # a contiguous cache: no block table
                            lambda *a, f=impl, block_table=None: calls.append(f) or f(*a))
        with torch.no_grad():
            cache = m.allocate_cache(2, 16)
            m(ids[:, :7], cache=cache)
            runs.append(torch.stack([m.step(ids[:, t], cache) for t in range(7, 12)], 1))
    assert calls == [k.quant_kv_decode] * 5 + [quant_kv_decode_ref] * 5  # one call per decode step
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["hybrid", "llama"])
@pytest.mark.parametrize("paged", [False, True])
def test_model_chunked_prefill_through_kernels_equals_reference(arch, paged, monkeypatch):
    """A tiny KVQuant model (nuq3-1%; one attention layer) in float16 prefills two prompts in three chunks over its
    quantized cache (dense, or blocks handed out in reverse order): each chunk's attention through ``kv_read`` +
    ``attention_prefill`` gives the logits of ``quant_kv_read_ref`` + ``attention_ref`` (the caches hold the same codes:
    the same writes), and the full forward without a cache through the prefill kernel those of the reference (on CPU the
    interpreter runs the kernels in place of the dispatch's references)."""
    import ssmq.kernels
    from ssmq.ops import attention_ref
    from ssmq.ops.kv_quant import quant_kv_read_ref
    from ssmq.quant import quantize
    from tiny_ssm import synthetic_calibration, tiny_model

    ap, kr = kernel_module("attention_prefill"), kernel_module("kv_read")

    def read_ref(side, slots, end, rotary_dim=0, theta=1e4, dtype=torch.float32, block_table=None, kv_lens=None):
        if block_table is not None:
            side, slots = side.gathered(block_table, slots), torch.arange(len(slots), device=slots.device)
        return quant_kv_read_ref(side, slots, end, rotary_dim, theta, dtype)

    # one attention layer: a later one's codes would depend on the earlier one's float16 rounding (code flips)
    m = tiny_model(arch, seed=4, **({"n_layer": 1} if arch == "llama" else {}))
    quantize(m, "kvquant-nuq3-1%", synthetic_calibration(m.config.vocab_size, 4, 32), progress=False)
    m = m.half().to(DEV)
    ids = torch.randint(0, m.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3)).to(DEV)
    runs, calls = {}, []
    for name, attn, read in (("kernels", ap.prefill_attention, kr.quant_kv_read),
                             ("reference", attention_ref, read_ref)):
        monkeypatch.setattr(ssmq.kernels, "prefill_attention", lambda *a, f=attn, **kw: calls.append(f) or f(*a, **kw))
        monkeypatch.setattr(ssmq.kernels, "quant_kv_read", read)
        kw = {"kv_blocks": 8, "kv_block_size": 16} if paged else {}
        cache = m.allocate_cache(2, 48, **kw)
        if paged:  # rows' blocks from the top of the pool down
            cache.block_table.assign(0, 0, [7, 6, 5])
            cache.block_table.assign(1, 0, [4, 3, 2])
        with torch.no_grad():
            chunks = [m(ids[:, a:b], cache=cache) for a, b in ((0, 13), (13, 29), (29, 40))]
            runs[name] = torch.cat(chunks, 1), m(ids)
    n_attn = sum(hasattr(layer.mixer, "kv_quant") for layer in m.layers)
    assert calls == [ap.prefill_attention] * 4 * n_attn + [attention_ref] * 4 * n_attn
    for got, want in zip(*runs.values()):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


READ_CASES = [  # hkv, e, rotary dim, outlier slots, sink, levels, per-token scales
    (2, 64, 32, 2, 1, 8, False),   # the hybrid's partial RoPE, nuq3-1%, per-channel keys
    (3, 64, 64, 4, 1, 16, False),  # SmolLM2's kv heads, full RoPE, 4 bits
    (2, 32, 0, 1, 2, 4, True),     # values: per-token scales, no RoPE, 2 bits, two sinks
    (1, 128, 128, 0, 0, 8, True),  # Llama heads, no outliers, no sink
    (2, 32, 32, 24, 1, 8, False),  # dense slots: many rotary pairs with both channels outliers
    (2, 32, 16, 12, 0, 4, True),   # per-token keys, partial RoPE, outliers on both sides of the rotary dim
]


@pytest.fixture(scope="module")
def kr():
    return kernel_module("kv_read")


@pytest.mark.parametrize("case", READ_CASES)
@pytest.mark.parametrize("block_size", [None, 16, 32])
def test_kv_read_kernel_equals_reference(kr, case, block_size):
    """The prefill's read of a quantized side (``kernels.kv_read``): codes, codebook, scales, outliers, sinks and
    the rotation of the first r channels by position equal ``quant_kv_read_ref`` (float32, then float16), from a
    contiguous cache and from block pools read in place (shuffled blocks), rows ragged and in any slot order."""
    from ssmq.ops.kv_quant import quant_kv_read_ref

    hkv, e, r, slots_k, sink, levels, per_token = case
    gen = torch.Generator().manual_seed(11)
    s, L = 3, 96
    side_ = side(s, L, hkv, e, per_token, slots_k, sink, gen, levels)
    slots, end = torch.tensor([2, 0], device=DEV), 77
    want = quant_kv_read_ref(_cpu(side_), slots.cpu(), end, r, 10000.0)
    table = None
    if block_size:
        m = -(-L // block_size)
        table = (1 + torch.randperm(s * m, generator=gen)).view(s, m).to(DEV)
        side_ = side_.paged(table, block_size)
    got = kr.quant_kv_read(side_, slots, end, r, 10000.0, torch.float16, table)
    assert got.shape == (2, end, hkv, e) and got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-3, atol=2e-3)
    # with the rows' lengths: their tokens up to there (the rest is left as allocated)
    lens = torch.tensor([end, 40], device=DEV)
    part = kr.quant_kv_read(side_, slots, end, r, 10000.0, torch.float16, table, kv_lens=lens)
    torch.testing.assert_close(part[0].float().cpu(), want[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(part[1, :40].float().cpu(), want[1, :40], rtol=2e-3, atol=2e-3)


PREFILL_CASES = [  # b, lq, lk, hq, hkv, e: a prompt, a chunk over a prefix, ragged rows, GQA 1 / 3 / 4 / 8
    (1, 37, 37, 4, 2, 32),
    (2, 16, 150, 6, 2, 64),
    (3, 70, 90, 9, 3, 64),
    (1, 5, 200, 8, 1, 128),
    (2, 24, 40, 4, 4, 80),  # a head dim that is not a power of two
]


@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_attention_kernel_equals_reference(case, dtype):
    """Causal GQA attention of a chunk of queries over a prefix (``kernels.attention_prefill``) equals
    ``attention_ref`` on every query that sees a key: rows of different lengths, the chunk at the end of each; a
    row shorter than the chunk leaves its first queries with no key (0 here, NaN in the reference)."""
    from ssmq.ops.attention import attention_ref

    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("the interpreter computes through numpy, which has no bfloat16")
    ap = kernel_module("attention_prefill")
    b, lq, lk, hq, hkv, e = case
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(b, lq, hq, e, generator=gen).to(dtype).to(DEV)
    kk, vv = (torch.randn(b, lk, hkv, e, generator=gen).to(dtype).to(DEV) for _ in range(2))
    lens = torch.tensor([lk, lk - 7, lq - 3][:b], device=DEV).clamp(min=1)
    for kv_lens in (None, lens):
        got = ap.prefill_attention(q, kk, vv, kv_lens).float().cpu()
        want = attention_ref(q.float().cpu(), kk.float().cpu(), vv.float().cpu(),
                             None if kv_lens is None else kv_lens.cpu())
        seen = ~want.isnan().any(-1)  # (b, lq, hq): queries that see at least one key
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        torch.testing.assert_close(got[seen], want[seen], rtol=tol, atol=tol)
        assert (got[~seen] == 0).all()
        if kv_lens is not None and b == 3:
            assert (~seen).any()  # the short row's first queries


@pytest.mark.parametrize("block_size", [None, 16, 64])
def test_prefill_attention_kernel_reads_a_cache_in_place(block_size):
    """The prefill kernel over a cache (s, L, hkv, e) whose slots hold the rows, or over block pools through a block
    table (shuffled blocks, unassigned entries at the null block, rows shorter than the table): each row's keys up to
    its length, equal to ``attention_ref`` over the rows copied out."""
    from ssmq.kernels import dispatch
    from ssmq.ops.attention import attention_ref

    ap = kernel_module("attention_prefill")
    gen = torch.Generator().manual_seed(13)
    s, L, hkv, e, hq, lq = 4, 128, 2, 64, 6, 20
    q = torch.randn(2, lq, hq, e, generator=gen).half().to(DEV)
    slots, lens = torch.tensor([3, 1], device=DEV), torch.tensor([L - 5, 33], device=DEV)
    if block_size is None:
        kc, vc = (torch.randn(s, L, hkv, e, generator=gen).half().to(DEV) for _ in range(2))
        table, rows = None, lambda c: c[slots]  # noqa: E731
    else:
        m = L // block_size
        kc, vc = (torch.randn(1 + s * m, block_size, hkv, e, generator=gen).half().to(DEV) for _ in range(2))
        table = (1 + torch.randperm(s * m, generator=gen)).view(s, m)
        table[1, 64 // block_size:] = 0  # row 1 holds fewer blocks: the rest are the null block (past its length)
        table = table.to(DEV)
        rows = lambda c: c[table[slots]].flatten(1, 2)  # noqa: E731
    got = ap.prefill_attention(q, kc, vc, lens, slots=slots, block_table=table)
    want = attention_ref(q.float(), rows(kc).float(), rows(vc).float(), lens)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    ref = dispatch.prefill_attention(q.cpu().float(), kc.cpu().float(), vc.cpu().float(), lens.cpu(),
                                     slots=slots.cpu(), block_table=None if table is None else table.cpu())
    torch.testing.assert_close(ref, want.cpu(), rtol=1e-5, atol=1e-5)
