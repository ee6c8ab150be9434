"""KVQuant on CPU: the format's references (codebooks, outliers, rotation), Fisher-weighted k-means, the quantized KV
state against its fake-quant reference, the recipe / checkpoint plumbing and its errors."""

import contextlib
import copy
import json

import pytest
import torch

from _quant_tiny import tiny_calib, tiny_model
from ssmq.errors import SSMQError
from ssmq.models.kv_format import KV_PRESETS, KVSideSpec, KVSpec
from ssmq.models.quant_kv import QuantKVState
from ssmq.models.state import KVState
from ssmq.ops import kv_quant as kq
from ssmq.quant import load_model, quantize, save_quantized
from ssmq.quant.api import check
from ssmq.quant.kvquant.kmeans import weighted_error, weighted_kmeans
from ssmq.quant.recipe import RECIPES, Recipe, get_recipe


# ------------------------------------------------------------------------------------------------- references
def test_weighted_kmeans_lowers_fisher_weighted_error_vs_uniform():
    g = torch.Generator().manual_seed(0)
    u = (torch.randn(20000, generator=g) * 0.3).clamp(-1, 1)  # bell-shaped, as normalized activations are
    w = torch.rand(20000, generator=g) * (1 + 10 * (u > 0.5))  # the loss is most sensitive to the upper tail
    for bits in (2, 3, 4):
        uniform = kq.uniform_codebook(bits)
        nuq = weighted_kmeans(u, w, uniform)
        assert weighted_error(u, w, nuq) < 0.8 * weighted_error(u, w, uniform)
        # the weights matter: k-means without them is worse on the weighted error
        assert weighted_error(u, w, nuq) < weighted_error(u, w, weighted_kmeans(u, torch.ones_like(w), uniform))


def test_pinned_kmeans_keeps_the_ends_and_serves_min_max_vectors_better():
    # per-token min-max normalization puts every vector's min and max at exactly -1 and 1
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4000, 64, generator=g)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    u = ((x - (hi + lo) / 2) / ((hi - lo) / 2)).flatten()
    w = torch.ones_like(u)
    w[(u.abs() == 1)] = 50.0  # the extremes are the entries the loss is most sensitive to
    for bits in (2, 3, 4):
        init = kq.uniform_codebook(bits)
        free, pinned = weighted_kmeans(u, w, init), weighted_kmeans(u, w, init, pin_ends=True)
        assert pinned[0] == -1 and pinned[-1] == 1 and (pinned.diff() > 0).all()
        assert free[0] > -1 and free[-1] < 1  # Lloyd alone pulls the end levels inward
        assert weighted_error(u, w, pinned) <= weighted_error(u, w, init)  # still a descent from the grid
        ends = u.abs() == 1
        assert weighted_error(u[ends], w[ends], pinned) == 0 < weighted_error(u[ends], w[ends], free)


def test_rotated_nuq_side_weights_tokens_by_their_mean_fisher():
    """A rotated side's k-means weights are each (token, head)'s mean Fisher (the rotated Fisher's diagonal in
    expectation over the signs): tokens with no Fisher leave the codebook as fitted on the others alone."""
    from ssmq.models.kv_quantizer import KVQuantizer
    from ssmq.quant.kvquant.calibrate import fit_side

    g = torch.Generator().manual_seed(3)
    spec = KVSpec(KVSideSpec(4, "int", "per_token"), KVSideSpec(3, "nuq", "per_token", rotate=True), sink=0)
    weighted = torch.randn(3000, 2, 16, generator=g)
    ignored = torch.randn(3000, 2, 16, generator=g).sign() * 0.5  # two-valued: another codebook entirely
    fisher = torch.rand(3000, 2, 16, generator=g)
    both, alone = KVQuantizer(spec, 2, 16), KVQuantizer(spec, 2, 16)
    fit_side(both, "values", torch.cat([weighted, ignored]), torch.cat([fisher, torch.zeros_like(fisher)]))
    fit_side(alone, "values", weighted, fisher)
    torch.testing.assert_close(both.v_codebook, alone.v_codebook, atol=1e-4, rtol=0)
    flat = KVQuantizer(spec, 2, 16)
    fit_side(flat, "values", torch.cat([weighted, ignored]), torch.ones(6000, 2, 16))
    assert (flat.v_codebook - alone.v_codebook).abs().max() > 0.05


def test_sparse_outliers_round_trip_exactly():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 2, 16, generator=g).half().float()
    x[3, 1, 5], x[7, 0, 0] = 40.0, -33.0
    p = kq.KVParams(kq.uniform_codebook(2), "per_token", k=2)
    q = kq.quantize_kv_ref(x, p)
    got = kq.dequantize_kv_ref(q, p)
    flat_idx = q.out_idx.long()
    assert (flat_idx >= 0).all() and q.out_idx.shape == (50, 2)
    assert torch.equal(got.reshape(50, -1).gather(1, flat_idx), x.reshape(50, -1).gather(1, flat_idx))
    assert got[3, 1, 5] == 40.0 and got[7, 0, 0] == -33.0  # the largest |x| of their tokens
    # offline per-channel thresholds: entries beyond them are sparse and exact, the rest clipped to the range
    lo, hi = -torch.ones(2, 16), torch.ones(2, 16)
    p = kq.KVParams(kq.uniform_codebook(3), "per_channel", lo=lo, hi=hi, k=4)
    q = kq.quantize_kv_ref(x, p)
    beyond = (x.abs() > 1).reshape(50, -1).sum(1)
    assert torch.equal((q.out_idx >= 0).sum(1), beyond.clamp(max=4))
    got = kq.dequantize_kv_ref(q, p)
    kept = q.out_idx >= 0
    assert torch.equal(got.reshape(50, -1).gather(1, q.out_idx.long().clamp(min=0))[kept], q.out_val.float()[kept])
    assert torch.equal(q.out_val.float()[kept], x.reshape(50, -1).gather(1, q.out_idx.long().clamp(min=0))[kept])
    # a token's slots in increasing index order, the empty ones last (the fast kernel's key pass relies on it)
    key = torch.where(kept, q.out_idx.long(), 10**6)
    assert (key.diff(dim=1) > 0).all()
    idx, val = kq.order_slots(torch.tensor([[5, -1, 2, 9]], dtype=torch.int16), torch.tensor([[1.0, 0.0, 2.0, 3.0]]))
    assert idx.tolist() == [[2, 5, 9, -1]] and val.tolist() == [[2.0, 1.0, 3.0, 0.0]] and idx.dtype == torch.int16
    # empty slots (-1) write nothing, even where slot 0 points at index 0
    y = kq.scatter_outliers(torch.zeros(1, 1, 4), torch.tensor([[0, -1]], dtype=torch.int16),
                            torch.tensor([[5.0, 9.0]]).half())
    assert torch.equal(y, torch.tensor([[[5.0, 0, 0, 0]]]))


def test_codes_under_outliers_are_the_codebook_end_on_their_side():
    """The decode kernels take x̂ under a slot from its value's side of mid (``outlier_codes``), not from a gather of
    the code: quantization must leave that code there, and on real-looking data it is the nearest code anyway."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 3, 64, generator=g) * (torch.rand(1, 3, 64, generator=g) * 3)
    x += torch.distributions.StudentT(2.0).sample((400, 3, 64)) * 0.3  # heavy tails: outliers in every token
    lo, hi = x.reshape(-1, 192).quantile(0.005, 0).reshape(3, 64), x.reshape(-1, 192).quantile(0.995, 0).reshape(3, 64)
    nuq = torch.sort(torch.rand(8, generator=g) * 1.8 - 0.9).values  # ends inside (-1, 1), as Lloyd leaves them
    for p in (kq.KVParams(kq.uniform_codebook(3), "per_channel", lo=lo, hi=hi, k=4),
              kq.KVParams(nuq, "per_channel", lo=lo, hi=hi, k=4),
              kq.KVParams(kq.uniform_codebook(2), "per_token", k=5)):
        q = kq.quantize_kv_ref(x, p)
        mid, half = kq.scales_of(q, p, x.device)
        kept = q.out_idx >= 0
        at = q.out_idx.long().clamp(min=0)
        under = q.codes.reshape(400, -1).gather(1, at)[kept].long()
        side = q.out_val.float() >= mid.expand(x.shape).reshape(400, -1).gather(1, at)
        assert kept.sum() > 500 and torch.equal(under, torch.where(side[kept], len(p.codebook) - 1, 0))
        assert torch.equal(q.codes, kq.nearest_code(((x - mid) / half).clamp(-1, 1), p.codebook))  # nothing moved
    # a degenerate range (a token of zeros: its outliers sit at mid) moves the code; the slot still overwrites it
    x[7] = 0
    p = kq.KVParams(kq.uniform_codebook(3), "per_token", k=5)
    q = kq.quantize_kv_ref(x, p)
    mid, half = kq.scales_of(q, p, x.device)
    plain = copy.copy(q)
    plain.codes = kq.nearest_code(((x - mid) / half).clamp(-1, 1), p.codebook)
    assert not torch.equal(q.codes[7], plain.codes[7])
    assert torch.equal(kq.dequantize_kv_ref(q, p), kq.dequantize_kv_ref(plain, p))


@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, False), (4, True), (8, True)])
def test_uniform_codebook_error_is_half_a_step(bits, symmetric):
    x = torch.linspace(-3, 3, 2 * 64).reshape(1, 2, 64)
    p = kq.KVParams(kq.uniform_codebook(bits, symmetric), "per_token", symmetric)
    q = kq.quantize_kv_ref(x, p)
    half_step = q.half.float().max() / (2 ** (bits - (1 if symmetric else 0)) - 1)
    assert (kq.dequantize_kv_ref(q, p) - x).abs().max() <= half_step * 1.01


def test_fp8_codebook_matches_the_cast():
    x = torch.randn(64, 1, 32) * 100
    p = kq.KVParams(kq.fp8_codebook(), "per_tensor", True, torch.tensor(-448.0), torch.tensor(448.0))
    got = kq.fake_quant_kv_ref(x, p)
    cast = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert ((got - cast).abs() <= 1e-5 * cast.abs()).float().mean() > 0.99  # ties aside


def test_rotation_is_orthogonal_and_inverted():
    x = torch.randn(5, 2, 64)
    s = torch.randint(0, 2, (64,)).float() * 2 - 1
    r = kq.rotate_heads(x, s)
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(kq.rotate_heads(r, s, inverse=True), x)


def test_pre_rope_with_rope_on_the_fly_equals_post_rope_in_float():
    """Keys cached before RoPE and rotated at read, or the query rotated by -t as the kernel does, equal the post-RoPE
    cache in float (RoPE is an orthogonal rotation per position)."""
    from ssmq.ops.attention import apply_rotary_ref, attention_ref, rotary_cos_sin

    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 1, 4, 32, generator=g), torch.randn(1, 20, 2, 32, generator=g), torch.randn(1, 20, 2, 32)
    pos = torch.arange(20)[None]
    cos, sin = rotary_cos_sin(pos, 16)
    post = attention_ref(q, apply_rotary_ref(k, cos, sin), v)
    scores_post = torch.einsum("he,the->ht", q[0, 0], apply_rotary_ref(k, cos, sin)[0].repeat_interleave(2, 1))
    qt = apply_rotary_ref(q.expand(1, 20, 4, 32), *rotary_cos_sin(-pos, 16))  # R_{-t} q
    scores_pre = torch.einsum("the,the->ht", qt[0], k[0].repeat_interleave(2, 1))
    torch.testing.assert_close(scores_pre, scores_post, rtol=1e-5, atol=1e-5)
    # through the model: a float cache of pre-RoPE keys equals the post-RoPE one
    m = tiny_model("hybrid")
    ids = torch.randint(0, 256, (2, 9))
    outs = []
    for before in (False, True):
        cache = m.allocate_cache(2, 12, kv_keys_before_rope=before)
        with torch.no_grad():
            outs.append(torch.cat([m(ids[:, :5], cache=cache)] + [m.step(ids[:, t], cache)[:, None]
                                                                  for t in range(5, 9)], 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert post.shape == (1, 1, 4, 32)


# ------------------------------------------------------------------------------------------------- the state
def _quantized(preset, seed=0):
    m = tiny_model("hybrid", seed)
    quantize(m, preset, tiny_calib(4, 32), progress=False)
    return m


@pytest.mark.parametrize("preset", ["kvquant-nuq3-1%", "kvquant-int2", "kvquant-nuq2-1%", "kv-fp8-e4m3",
                                    "kv-int8-pth", "kv-turbo3"])
def test_quantized_kv_decode_equals_fake_quant_reference(preset):
    """Prefill + decode through the quantized cache equals the no-cache forward over quantize-dequantized K / V,
    and differs from the float model (the format really quantizes)."""
    m = _quantized(preset)
    ids = torch.randint(0, 256, (3, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = m(ids)
        cache = m.allocate_cache(4, 16)
        assert isinstance(cache.states[1], QuantKVState)
        steps = [m(ids[:, :6], cache=cache, slots=[3, 0, 1])]
        steps += [m.step(ids[:, t], cache, slots=[3, 0, 1])[:, None] for t in range(6, 14)]
        m.layers[1].mixer.kv_quant = None
        float_kv = m(ids)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=2e-5)
    assert (float_kv - full).abs().max() > 1e-4


def test_llama_decode_with_a_quantized_cache_equals_fake_quant():
    """The degenerate hybrid (every layer attention, full RoPE): every layer gets a calibrated quantizer."""
    from ssmq.models import SSMLM, ModelConfig

    torch.manual_seed(0)
    m = SSMLM(ModelConfig(arch="llama", d_model=64, n_layer=3, vocab_size=256, attn_heads=4, attn_kv_heads=2,
                          attn_head_dim=16, rotary_dim=16, mlp_hidden=96)).eval()
    quantize(m, "kvquant-nuq3-1%", tiny_calib(4, 32), progress=False)
    assert all(layer.mixer.kv_quant is not None for layer in m.layers)
    m = m.double()  # see test_quantized_kv_decode_equals_fake_quant_reference
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        full = m(ids)
        cache = m.allocate_cache(2, 12)
        steps = [m(ids[:, :4], cache=cache)] + [m.step(ids[:, t], cache)[:, None] for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=2e-5)
    assert cache.states[0].k.codes.shape == (2, 12, 2, 6)  # 3-bit codes: 16 channels in 6 bytes a head


def test_state_decode_equals_read_then_attention_and_bytes():
    from ssmq.ops.attention import attention_ref

    m = _quantized("kvquant-nuq4-1%")
    cache = m.allocate_cache(2, 40)
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        m(ids, cache=cache)
    st = cache.states[1]
    q = torch.randn(2, 4, 16)
    lens = torch.tensor([33, 20])
    keys, values = st.read(torch.arange(2), lens)
    want = attention_ref(q[:, None], keys, values, lens)[:, 0]
    torch.testing.assert_close(st.decode(q, torch.arange(2), lens), want, rtol=1e-5, atol=1e-5)
    float_bytes = KVState.allocate(2, 40, 2, 16, torch.float16, "cpu").nbytes()
    # per token: 2 x 16 bytes of nibbles, 2 fp16 scales per head (values), 2 + 1 outlier slots of 4 bytes
    assert st.nbytes() == 2 * 40 * (32 + 8 + 12) + 2 * 2 * 32 * 4  # + the sink token's float32 K and V
    assert st.nbytes() < 0.5 * float_bytes
    cache.reset([0])
    assert (st.k.codes[0] == 0).all() and (st.k.out_idx[0] == -1).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("e", [1, 5, 8, 12, 16, 19, 64])
def test_pack_codes_round_trip(bits, e):
    codes = torch.randint(0, 2 ** bits, (3, 2, e), generator=torch.Generator().manual_seed(e), dtype=torch.uint8)
    packed = kq.pack_codes(codes, bits)
    assert packed.shape == (3, 2, kq.packed_bytes(e, bits)) and packed.dtype == torch.uint8
    # rows padded to whole bytes (3 bits: each of its two planes)
    assert kq.packed_bytes(e, bits) == (-(-e // 4) - (-e // 8) if bits == 3 else -(-e * bits // 8))
    assert torch.equal(kq.unpack_codes(packed, bits, e), codes)


def test_pack_codes_layout():
    """Nibbles (even channel low), four 2-bit codes a byte (channel 4j + i at bits 2i of byte j), 3-bit codes as a
    2-bit plane of their low bits, then a 1-bit plane of their bit 2 (channel 8j + i at bit i)."""
    c = torch.tensor([1, 2, 3, 15], dtype=torch.uint8)
    assert kq.pack_codes(c, 4).tolist() == [1 | 2 << 4, 3 | 15 << 4]
    assert kq.pack_codes(torch.tensor([0, 1, 2, 3, 3], dtype=torch.uint8), 2).tolist() == [0b11100100, 3]
    low = [sum((c & 3) << 2 * i for i, c in enumerate(range(4 * j, 4 * j + 4))) for j in range(2)]
    assert kq.pack_codes(torch.arange(8, dtype=torch.uint8), 3).tolist() == low + [0b11110000]
    assert kq.pack_codes(torch.tensor([7, 0, 5], dtype=torch.uint8), 3).tolist() == [0b010011, 0b101]  # 1 + 1 bytes
    assert [kq.code_bits(n) for n in (3, 4, 7, 8, 15, 16, 17, 253)] == [2, 2, 3, 3, 4, 4, 8, 8]


@pytest.mark.parametrize("e", [16, 64, 12])
def test_packed_cache_bytes_of_3_and_2_bit_codes(e):
    """The cache's code bytes for nuq3 / nuq2 are 3/4 and 1/2 of nuq4's (e a multiple of 8; e = 12 pads each head's
    row to whole bytes: 6, 5, 3 bytes)."""
    from ssmq.models.kv_quantizer import KVQuantizer

    def code_bytes(preset):
        st = QuantKVState(KVQuantizer(KV_PRESETS[preset][0], 2, e, 0), 2, 10, torch.float16, "cpu")
        return st.k.codes.numel() + st.v.codes.numel()

    four, three, two = (code_bytes(f"kvquant-nuq{b}") for b in (4, 3, 2))
    if e % 8 == 0:
        assert three * 4 == four * 3 and two * 2 == four
    else:
        assert (four, three, two) == tuple(2 * 2 * 10 * 2 * n for n in (6, 5, 3))


def test_cache_view_derives_offline_scales_once():
    """A decode step builds each layer's view: the per-channel (offline) key scales are the same tensors from call to
    call, equal to the reference's, and derived again when the quantizer's range buffers change in place (a
    calibration loaded after the cache was made)."""
    from ssmq.models.kv_quantizer import KVQuantizer

    q = KVQuantizer(KV_PRESETS["kvquant-nuq4"][0], 2, 16, 0)
    st = QuantKVState(q, 2, 10, torch.float16, "cpu")
    a, b = st.k.view(), st.k.view()
    assert not a.per_token and a.mid is b.mid and a.half is b.half
    mid, half = kq.scales_of(None, q.params("keys"), None)
    torch.testing.assert_close(a.half, half.expand(2, 16).float())
    with torch.no_grad():
        q.k_hi.mul_(3.0)
    c = st.k.view()
    assert c.mid is not a.mid
    torch.testing.assert_close(c.half, kq.scales_of(None, q.params("keys"), None)[1].expand(2, 16).float())
    torch.testing.assert_close(c.mid, kq.scales_of(None, q.params("keys"), None)[0].expand(2, 16).float())


def test_packing_leaves_the_quantized_values_unchanged(monkeypatch):
    """3-bit packing changes the storage only: a nuq3-1% cache read back (and the logits through it) equals the
    same cache stored as nibbles (the layout before 3-bit packing), on 3/4 of the code bytes."""
    import ssmq.models.quant_kv as qkv

    m = _quantized("kvquant-nuq3-1%")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    runs = []
    for nibbles in (False, True):
        if nibbles:
            monkeypatch.setattr(qkv, "code_bits", lambda levels: 4 if levels <= 16 else 8)
        with torch.no_grad():
            cache = m.allocate_cache(2, 16)
            out = [m(ids[:, :7], cache=cache)] + [m.step(ids[:, t], cache)[:, None] for t in range(7, 12)]
        st = cache.states[1]
        runs.append((torch.cat(out, 1), *st.read(torch.arange(2), torch.tensor([12, 12])), st.k.codes.numel()))
    assert runs[0][3] * 4 == runs[1][3] * 3
    for packed, nibble in zip(runs[0][:3], runs[1][:3]):
        assert torch.equal(packed, nibble)


def test_the_engine_pages_a_quantized_kv_cache():
    """The serving engine keeps a quantized KV cache in blocks, as a float one: block pools of the packed codes,
    scales and outlier slots, admission by free blocks (the sink stays per slot)."""
    from ssmq.runtime.engine import Engine, EngineConfig

    m = _quantized("kvquant-nuq4-1%")
    engine = Engine(m, EngineConfig(max_batch=2, max_model_len=32, kv_block_size=4, kv_blocks=3))
    st = engine.runner.cache.states[1]
    assert engine.blocks is not None and st.table is engine.runner.cache.block_table
    assert st.k.codes.shape[:2] == (4, 4) and st.v.out_idx.shape[:2] == (4, 4) and st.k.sink.shape[0] == 2
    assert engine.unfit(12) is None and "KV blocks" in engine.unfit(13)
    assert engine.stats()["kv_blocks_total"] == 3


# ------------------------------------------------------------------------------------------------- recipes
def test_kv_recipes_json_round_trip(tmp_path):
    for name in [*KV_PRESETS, "ssdi8-w8a8+kvquant-nuq3-1%"]:
        r = get_recipe(name)
        assert Recipe.from_json(r.to_json()).to_dict() == r.to_dict()
    combo = get_recipe("ssdi8-w8a8+kvquant-nuq3-1%")
    assert combo.supported_archs == ["hybrid"] and combo.cache.state_bits == 8
    assert combo.cache.kv == KV_PRESETS["kvquant-nuq3-1%"][0] and combo.linears == RECIPES["ssdi8-w8a8"].linears
    d = RECIPES["rtn-w8a16"].to_dict() | {"name": "mine", "supported_archs": ["hybrid"]}
    for kv in ("kvquant-nuq3-1%", KV_PRESETS["kvquant-nuq3-1%"][0].to_dict()):  # a preset name or an object
        f = tmp_path / "mine.json"
        f.write_text(json.dumps(d | {"cache": {"state_bits": 16, "kv": kv}}))
        assert get_recipe(str(f)).cache.kv == KV_PRESETS["kvquant-nuq3-1%"][0]


def _kv(**sides):
    spec = KVSpec().to_dict()
    for k, v in sides.items():
        spec[k] = spec[k] | v if isinstance(v, dict) else v
    return spec


@pytest.mark.parametrize("kv,msg", [
    ("kvquant-nuq5", "unknown KV format 'kvquant-nuq5'"),
    (_kv(keys={"dtype": "nf4"}), "unknown dtype 'nf4'"),
    (_kv(keys={"bits": 1}), "bits must be an integer in 2..8"),
    (_kv(values={"dtype": "nuq", "bits": 6}), "at most 4 bits"),
    (_kv(keys={"granularity": "per_group"}), "unknown granularity"),
    (_kv(keys={"outliers": 0.7}), "outliers is a fraction"),
    (_kv(values={"pre_rope": True}), "pre_rope is a property of keys"),
    (_kv(keys={"rotate": True, "outliers": 0.01}), "without rotation"),
    (_kv(keys={"dtype": "fp8", "bits": 8}), "fp8 (e4m3) is 8 bits and symmetric"),
    (_kv(sink=-1), "sink is a number of tokens"),
    (_kv(keys={"bitz": 3}), "unknown KV spec keys field(s) ['bitz']"),
    (_kv() | {"dense": True}, "unknown KV spec field(s) ['dense']"),
    (3, "a KV spec object or a KV preset name"),
])
def test_bad_kv_spec_is_a_clear_error(kv, msg):
    d = {"name": "c", "cache": {"kv": kv}, "supported_archs": ["hybrid"]}
    with pytest.raises(SSMQError) as e:
        Recipe.from_dict(d)
    assert msg in str(e.value)


def test_kv_recipe_errors():
    with pytest.raises(SSMQError, match="must be a cache-only recipe"):
        get_recipe("kvquant-nuq3+rtn-w8a16")
    with pytest.raises(SSMQError, match="already has a KV format"):
        get_recipe("kvquant-nuq3+kvquant-nuq4")
    with pytest.raises(SSMQError, match="models with attention"):
        get_recipe("quamba2-w8a8+kvquant-nuq3-1%")
    with pytest.raises(SSMQError, match="supports hybrid, llama, not mamba2"):
        check("kvquant-nuq3-1%", tiny_model("mamba2"))
    bad = Recipe("kv-on-mamba", cache=get_recipe("kvquant-nuq3").cache, supported_archs=["mamba2", "hybrid"])
    with pytest.raises(SSMQError, match="has no attention layer"):
        check(bad, tiny_model("mamba2"))


# ------------------------------------------------------------------------------------------------- calibration
def test_calibration_fisher_and_codebooks():
    from ssmq.quant.kvquant.calibrate import capture_kv

    m = tiny_model("hybrid")
    data = capture_kv(m, tiny_calib(4, 32).input_ids)[1]
    assert data["k"].shape == data["gk"].shape == (4, 32, 2, 16) and data["gk"].abs().sum() > 0
    assert all(p.requires_grad for p in m.parameters())  # restored
    quantize(m, "kvquant-nuq3", tiny_calib(4, 32), progress=False)
    kvq = m.layers[1].mixer.kv_quant
    assert not torch.equal(kvq.k_codebook, kq.uniform_codebook(3))  # k-means moved the levels
    assert not torch.equal(kvq.v_codebook, kq.uniform_codebook(3))
    assert kvq.v_codebook[0] == -1 and kvq.v_codebook[-1] == 1  # per-token values: levels kept at the extremes
    assert (kvq.k_lo < kvq.k_hi).all()
    # per-channel range = min / max of the calibration keys (no outliers), the sink token (position 0) left out
    torch.testing.assert_close(kvq.k_hi, data["k"][:, 1:].flatten(0, 1).amax(0))
    from ssmq.quant.kvquant import calibrate_kv_

    calibrate_kv_(m, kvq.kv.with_changes(sink=0), None, captured={1: data})
    torch.testing.assert_close(m.layers[1].mixer.kv_quant.k_hi, data["k"].flatten(0, 1).amax(0))
    # a model whose cache is already quantized is captured with float KV (its quantizers set aside, then back): a
    # format calibrated after another (the tables' calibration draws) once saw the other's rounding, whose zero
    # gradient emptied the Fisher
    installed = m.layers[1].mixer.kv_quant
    again = capture_kv(m, tiny_calib(4, 32).input_ids)[1]
    assert all(torch.equal(again[t], data[t]) for t in ("k", "v", "gk", "gv"))
    assert m.layers[1].mixer.kv_quant is installed


def test_checkpoint_round_trip_with_kv(tmp_path):
    m = _quantized("kvquant-nuq3-1%")
    save_quantized(m, tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert manifest["modules"]["layers.1.mixer.kv_quant"]["kind"] == "KVQuantizer"
    assert manifest["recipe"]["cache"]["kv"]["keys"]["dtype"] == "nuq"
    m2 = load_model(tmp_path / "q")
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(m2(ids), m(ids), rtol=0, atol=0)
    assert isinstance(m2.allocate_cache(1, 8).states[1], QuantKVState)
    assert KVSideSpec().validate("keys")  # the default side is valid


def test_ssm_recipe_plus_kv_preset_in_one_checkpoint(tmp_path):
    """ssdi8-w8a8+kvquant-nuq3-1%: the SSM recipe on the Mamba layer, KVQuant on attention, one folder, reloaded."""
    m = tiny_model("hybrid")
    quantize(m, "ssdi8-w8a8+kvquant-nuq3-1%", tiny_calib(4, 32), progress=False)
    save_quantized(m, tmp_path / "q")
    m2 = load_model(tmp_path / "q")
    assert m2.quantization["recipe"]["name"] == "ssdi8-w8a8+kvquant-nuq3-1%"
    assert m2.layers[1].mixer.kv_quant is not None and m2.layers[0].mixer.state_groups  # int8 SSM state too
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(m2(ids), m(ids), rtol=0, atol=0)
        cache = m2.allocate_cache(2, 12, ssm_dtype=torch.int8)
        m2(ids[:, :6], cache=cache)
        assert torch.isfinite(m2.step(ids[:, 6], cache)).all()
    assert isinstance(cache.states[1], QuantKVState) and cache.states[0].ssm.dtype == torch.int8


# ------------------------------------------------------------------------------------------------- CUDA graphs
HOST_READS = ("item", "tolist", "numpy", "nonzero", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def _as_if_captured(monkeypatch):
    """A CUDA-graph capture emulated on CPU: the caches see ``capturing()`` True (static shapes, no host checks),
    and every read of a tensor's value on the host — what would sync on a GPU, and what a capture refuses — fails:
    item / tolist / int / float / bool / index, nonzero, and indexing with a boolean mask (a nonzero inside)."""
    import ssmq.ops.attention

    def refuse(name):
        def read(self, *a, **kw):
            raise AssertionError(f"host read of a tensor's value: Tensor.{name}")
        return read

    def no_masks(fn):
        def index(self, key, *a):
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
                raise AssertionError("boolean-mask indexing (a host read of the mask's count)")
            return fn(self, key, *a)
        return index

    with monkeypatch.context() as mp:
        mp.setattr(ssmq.ops.attention, "capturing", lambda t: True)  # what check_fits / read_extent ask
        for name in HOST_READS:
            mp.setattr(torch.Tensor, name, refuse(name))
        mp.setattr(torch.Tensor, "__getitem__", no_masks(torch.Tensor.__getitem__))
        mp.setattr(torch.Tensor, "__setitem__", no_masks(torch.Tensor.__setitem__))
        yield


def _llama():
    from ssmq.models import SSMLM, ModelConfig

    torch.manual_seed(0)
    m = SSMLM(ModelConfig(arch="llama", d_model=64, n_layer=2, vocab_size=256, attn_heads=4, attn_kv_heads=2,
                          attn_head_dim=16, rotary_dim=16, mlp_hidden=96)).eval()
    return quantize(m, "kvquant-nuq4-1%", tiny_calib(4, 32), progress=False)


def _ragged_cache(m, device="cpu"):
    """Slots 3, 0, 1 of a 5-slot cache prefilled to 9, 6, 6 tokens (slot 4: a CUDA graph's scratch), and the next
    tokens of a decode step of a bucket of 5 rows (two padding rows on the scratch slot, as the graph decoder)."""
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(4)).to(device)
    cache = m.allocate_cache(5, 16, device=device)
    with torch.no_grad():
        m(ids[:, :6], cache=cache, slots=[3, 0, 1])
        m(ids[:1, 6:9], cache=cache, slots=[3])
    slots = torch.tensor([3, 0, 1, 4, 4], device=device)
    tokens = torch.cat([ids[:, 9], ids[:2, 0]])
    return cache, slots, tokens


def _check_step_reads_nothing_on_the_host(m, monkeypatch, device="cpu"):
    """The decode step under an emulated capture (static shapes, no host read) equals the eager step: logits of the
    live rows, and every buffer of their slots."""
    cache, slots, tokens = _ragged_cache(m, device)
    eager_cache = copy.deepcopy(cache)
    with torch.no_grad():
        want = m.step(tokens, eager_cache, slots)[:3]
        with _as_if_captured(monkeypatch):
            got = m.step(tokens, cache, slots)[:3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    live = torch.tensor([3, 0, 1], device=device)
    for st, ref in zip(cache.states, eager_cache.states):
        if isinstance(st, QuantKVState):
            for a, b in zip(st.k.buffers() + st.v.buffers(), ref.k.buffers() + ref.v.buffers()):
                assert torch.equal(a[live], b[live])
    assert torch.equal(cache.seqlens[live], torch.tensor([10, 7, 7], device=device))
    return want


@pytest.mark.parametrize("preset", ["kvquant-nuq4-1%", "kvquant-nuq3-1%", "kv-int8-pth", "kv-turbo3"])
def test_quantized_kv_decode_step_reads_nothing_on_the_host(preset, monkeypatch):
    """What a CUDA graph needs of the step (``CudaGraphDecoder``): append, the decode path (``QuantKVState.decode``;
    ``read`` for the formats without a decode kernel: 8-bit codes, rotation), RoPE positions and the sink, with no
    host read of a device value; and the same numbers as the eager step."""
    m = _quantized(preset)
    _check_step_reads_nothing_on_the_host(m, monkeypatch)
    with _as_if_captured(monkeypatch), torch.no_grad(), pytest.raises(AssertionError, match="host read"):
        m.layers[1].mixer.kv_quant.k_codebook.max().item()  # the trap works


def test_llama_quantized_kv_decode_step_reads_nothing_on_the_host(monkeypatch):
    _check_step_reads_nothing_on_the_host(_llama(), monkeypatch)


@pytest.mark.parametrize("which", ["hybrid", "llama"])
def test_quantized_kv_prefill_piece_reads_nothing_on_the_host(which, monkeypatch):
    """A prefill continuing a sequence (what ``CudaGraphPrefill`` captures: append, then ``read`` over the capacity)
    reads nothing on the host under the emulated capture, and equals the eager prefill."""
    m = _quantized("kvquant-nuq4-1%") if which == "hybrid" else _llama()
    cache, _, _ = _ragged_cache(m)
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(5))
    eager_cache = copy.deepcopy(cache)
    with torch.no_grad():
        want = m(ids, eager_cache, slots=[0])
        with _as_if_captured(monkeypatch):
            got = m(ids, cache, slots=[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["hybrid", "llama"])
def test_quantized_kv_decode_equals_the_read_path(which, monkeypatch):
    """The eager decode step through ``QuantKVState.decode`` (the kernels' reference on CPU) equals the reference
    path: the whole cache dequantized by ``read``, then ``attention_ref``."""
    m = _quantized("kvquant-nuq4-1%") if which == "hybrid" else _llama()
    cache, slots, tokens = _ragged_cache(m)
    ref_cache = copy.deepcopy(cache)
    calls = []
    decode = QuantKVState.decode
    monkeypatch.setattr(QuantKVState, "decode", lambda self, *a: (calls.append(1), decode(self, *a))[1])
    with torch.no_grad():
        got = m.step(tokens, cache, slots)[:3]
        assert calls  # the decode path was taken
        monkeypatch.setattr(QuantKVState, "decode", lambda self, *a: None)  # the read path
        want = m.step(tokens, ref_cache, slots)[:3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_quantized_kv_decode_step_on_the_kernels_reads_nothing_on_the_host(monkeypatch):
    """Same with the Triton decode kernel in place of its reference (CUDA, or its interpreter on CPU)."""
    from test_kernels import DEV, kernel_module

    from ssmq import kernels

    kv_decode, calls = kernel_module("kv_decode"), []
    monkeypatch.setattr(kernels, "quant_kv_decode",
                        lambda *a, block_table=None: (calls.append(1), kv_decode.quant_kv_decode(*a))[1])
    m = _quantized("kvquant-nuq4-1%").to(DEV)
    _check_step_reads_nothing_on_the_host(m, monkeypatch, DEV)
    assert len(calls) == 2  # the eager step and the emulated capture, each through the kernel


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["hybrid", "llama"])
def test_quantized_kv_decode_under_cuda_graphs_equals_eager(which):
    """A quantized KV cache (kvquant-nuq4-1%) decodes from CUDA graphs: greedy tokens of graph replays (3 rows in a
    bucket of 4: a padding row on the scratch slot) equal eager decode's, on the LUT decode kernels."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    from ssmq.runtime.cuda_graph import CudaGraphDecoder
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    m = (_quantized("kvquant-nuq4-1%") if which == "hybrid" else _llama()).to("cuda")
    prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60]]
    params = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    eager = generate(m, prompts, params)
    dec = CudaGraphDecoder(m, max_batch=4, max_seqlen=64)
    assert any(isinstance(st, QuantKVState) for st in dec.cache.states)
    assert generate(m, prompts, params, cache=dec.cache, decode_fn=dec) == eager
    assert int(dec.cache.seqlens[dec.scratch]) <= 1  # the padding row's slot stays at the start


@pytest.mark.gpu
def test_quantized_kv_graph_prefill_then_graph_decode():
    """Prefill from ``CudaGraphPrefill`` pieces (16 + 8 + 1 tokens) and decode from the decoder's graphs over one
    quantized cache: the logits of the eager prefill and steps (a relative error: a key that lands on the other
    side of a code boundary in one of the two moves the logits by a quantization step, not a float rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    from ssmq.runtime.cuda_graph import CudaGraphDecoder, CudaGraphPrefill

    m = _quantized("kvquant-nuq4-1%").to("cuda")
    ids = torch.randint(0, 256, (1, 29), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    slot = torch.tensor([1], device="cuda")
    with torch.inference_mode():
        cache = m.allocate_cache(3, 64)
        want = [m(ids[:, :25], cache, slots=slot)[:, -1]]
        want += [m.step(ids[:, t], cache, slot) for t in range(25, 29)]
        dec = CudaGraphDecoder(m, max_batch=2, max_seqlen=64)
        pre = CudaGraphPrefill(m, dec.cache, max_len=32, pool=dec.pool)
        got = [pre(ids[:, :25], slots=1).clone()]
        got += [dec(ids[:, t], slot).clone() for t in range(25, 29)]
    got, want = torch.cat(got), torch.cat(want)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert int(dec.cache.seqlens[1]) == 29


@pytest.mark.gpu
@pytest.mark.parametrize("arch, kv_heads, rotary", [("llama", 3, 64), ("hybrid", 2, 32)])
@pytest.mark.parametrize("preset", ["kvquant-nuq4", "kvquant-nuq3-1%"])
def test_head_dim_64_decode_step_takes_the_warp_kernel(arch, kv_heads, rotary, preset, monkeypatch):
    """SmolLM2's attention shape (9 query / 3 kv heads x 64, full RoPE) and the trained hybrid's (6 / 2 x 64, RoPE
    on 32 channels) decode through ``kv_decode_warp`` on CUDA, from the model's own quantized cache; the step's
    logits equal the read path's (the cache dequantized, then ``attention_ref``) within the kernel's float16
    operands."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (Gluon kernels do not run in Triton's interpreter)")
    pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon (3.5+)")
    from ssmq.kernels import kv_decode_warp
    from ssmq.models import SSMLM, ModelConfig

    torch.manual_seed(0)
    extra = dict(attn_layer_idx=(1,), d_state=16, headdim=16, chunk_size=16) if arch == "hybrid" else {}
    m = SSMLM(ModelConfig(arch=arch, d_model=64, n_layer=2, vocab_size=256, attn_heads=3 * kv_heads,
                          attn_kv_heads=kv_heads, attn_head_dim=64, rotary_dim=rotary, mlp_hidden=96, **extra)).eval()
    quantize(m, preset, tiny_calib(4, 32), progress=False)
    m = m.cuda()
    cache, slots, tokens = _ragged_cache(m, "cuda")
    ref_cache = copy.deepcopy(cache)
    calls, real = [], kv_decode_warp.quant_kv_decode
    monkeypatch.setattr(kv_decode_warp, "quant_kv_decode", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    with torch.no_grad():
        got = m.step(tokens, cache, slots)[:3]
        assert calls  # every attention layer's decode took the warp kernel
        monkeypatch.setattr(QuantKVState, "decode", lambda self, *a: None)  # the read path
        want = m.step(tokens, ref_cache, slots)[:3]
    assert ((got - want).norm() / want.norm()).item() < 1e-2
