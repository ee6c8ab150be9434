"""Per-layer cache states (ssmq.models.state): decode touches only the served rows, keys cached before RoPE equal
the post-RoPE cache, int8 states round-trip through the quantization references, formats and errors."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ssmq.errors import SSMQError
from ssmq.models.state import KVState, MambaState, StateFormat
from ssmq.ops.quant_ssm import dequantize_state_ref, quantize_state_ref
from ssmq.quant.ssm.state_cache import to_int8_state
from tiny_ssm import tiny_model

SLOTS, SERVED = 64, torch.tensor([5, 40])


class Materialized(TorchDispatchMode):
    """Records the shape of every tensor an op produces (a copy, a gather, a new buffer)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or func.is_view:  # in place (index_put_) or a view (slice): nothing new
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape), t.numel() * t.element_size()))
        return out


def int8_state_model(arch):
    model = tiny_model(arch)
    for i in model.config.ssm_layers():
        mixer = to_int8_state(model.layers[i].mixer, model.config, None, 1)
        mixer.state_scale.fill_(0.02)
        model.layers[i].mixer = mixer
    return model


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_int8_state_decode_step_touches_only_the_served_rows(arch):
    model = int8_state_model(arch)
    cache = model.allocate_cache(SLOTS, 32, ssm_dtype=torch.int8)
    g = torch.Generator().manual_seed(0)
    for st in cache.states:  # every slot holds a state, served or not
        st.ssm.copy_(torch.randint(-127, 128, st.ssm.shape, generator=g, dtype=torch.int8))
    before = [st.ssm.clone() for st in cache.states]
    row_shape = tuple(cache.states[0].ssm.shape[1:])
    tokens = torch.tensor([3, 9])
    with torch.no_grad(), Materialized() as seen:
        model.step(tokens, cache, SERVED)
    state_like = [(f, s, nb) for f, s, nb in seen.shapes if s[1:] == row_shape]
    assert state_like, "the step made no state-shaped tensor: the probe sees nothing"
    # the old path made a float32 copy of the whole layer (SLOTS rows) on every call
    assert all(s[0] <= len(SERVED) for _, s, _ in state_like), [s for s in state_like if s[1][0] > len(SERVED)]
    row_bytes = torch.Size(row_shape).numel() * 4
    per_layer = sum(nb for _, _, nb in state_like) / len(cache.states)
    assert per_layer <= 16 * len(SERVED) * row_bytes < SLOTS * row_bytes
    others = [i for i in range(SLOTS) if i not in SERVED.tolist()]
    for st, old in zip(cache.states, before):
        assert torch.equal(st.ssm[others], old[others])  # unserved rows untouched
        assert not torch.equal(st.ssm[SERVED], old[SERVED])  # served rows advanced


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_int8_state_step_equals_the_quantized_reference(arch):
    """The state object's int8 decode = dequantize the rows, step in float, re-quantize (quant_state_update_ref)."""
    model = int8_state_model(arch)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.allocate_cache(4, 16, ssm_dtype=torch.int8)
        model(ids[:, :8], cache, SERVED % 4)
        float_cache = model.allocate_cache(4, 16, ssm_dtype=torch.float32)
        for q, f in zip(cache.states, float_cache.states):  # the same (dequantized) starting point in float
            f.conv.copy_(q.conv)
            f.ssm.copy_(dequantize_state_ref(q.ssm, q.scales.scale, q.scales.index))
        float_cache.seqlens.copy_(cache.seqlens)
        out_q = model.step(ids[:, 8], cache, SERVED % 4)
        out_f = model.step(ids[:, 8], float_cache, SERVED % 4)
    assert torch.allclose(out_q, out_f, atol=1e-5)  # int8 read is exact dequantization
    for q, f in zip(cache.states, float_cache.states):
        assert torch.equal(q.ssm, quantize_state_ref(f.ssm, q.scales.scale, q.scales.index))


def test_attention_decode_reads_only_the_served_rows_and_filled_positions():
    model = tiny_model("hybrid")
    cache = model.allocate_cache(SLOTS, 256)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, cache, SERVED)
        with Materialized() as seen:
            model.step(ids[:, -1], cache, SERVED)
    kv = cache.states[1]
    kv_like = [s for _, s, _ in seen.shapes if len(s) == 4 and s[2:] == tuple(kv.k.shape[2:])]
    assert kv_like and max(s[0] for s in kv_like) <= len(SERVED)
    assert max(s[1] for s in kv_like) <= 11  # 11 filled positions, not the 256 of the buffer


def test_keys_before_rope_equal_the_post_rope_cache():
    model = tiny_model("hybrid")
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(3))
    outs = {}
    with torch.no_grad():
        for pre in (False, True):
            cache = model.allocate_cache(3, 32, kv_keys_before_rope=pre)
            assert cache.states[1].keys_before_rope is pre
            logits = [model(ids[:, :9], cache, [0, 2])[:, -1]]
            logits += [model.step(ids[:, t], cache, torch.tensor([0, 2])) for t in range(9, 14)]
            outs[pre] = torch.stack(logits, 1)
            if pre:  # the stored keys are the raw projections: rotating them gives the post-RoPE keys
                k_post, _ = cache.states[1].read(torch.tensor([0, 2]), torch.tensor([14, 14]))
                assert not torch.equal(cache.states[1].k[[0, 2], :14], k_post)
    assert torch.equal(outs[True], outs[False])
    full = model(ids)[:, 8:]
    assert torch.allclose(outs[True], full, atol=1e-4)


def test_state_formats_and_bytes():
    model = int8_state_model("mamba2")
    f = model.allocate_cache(2, 8, ssm_dtype=torch.float32)  # a float state, asked for explicitly
    q = model.allocate_cache(2, 8)  # the model's own format: int8
    assert {st.format for st in f.states} == {StateFormat.FLOAT}
    assert {st.format for st in q.states} == {StateFormat.INT8}
    assert sum(st.ssm_nbytes() for st in f.states) == 4 * sum(st.ssm_nbytes() for st in q.states)
    assert f.nbytes() == sum(t.numel() * t.element_size() for t in (*f.conv_states, *f.ssm_states))
    h = tiny_model("hybrid").allocate_cache(2, 8)
    assert isinstance(h.states[1], KVState) and h.ssm_states[1] is None and h.key_cache[0] is None
    assert h.key_cache[1].shape == (2, 8, 2, 32) and isinstance(h.states[0], MambaState)


def test_int8_state_without_scales_is_refused():
    with pytest.raises(SSMQError, match="int8 SSM state needs calibrated scales"):
        tiny_model("mamba2").allocate_cache(2, 8, ssm_dtype=torch.int8)


def test_reset_clears_only_the_given_slots():
    model = tiny_model("hybrid")
    cache = model.allocate_cache(3, 8)
    for st in cache.states:
        for t in (st.k, st.v) if isinstance(st, KVState) else (st.conv, st.ssm):
            t.fill_(1.0)
    cache.seqlens.fill_(4)
    cache.reset([1])
    assert cache.seqlens.tolist() == [4, 0, 4]
    for buf in (*cache.conv_states, *cache.ssm_states, *cache.key_cache):
        if buf is not None:
            assert buf[1].abs().sum() == 0 and bool((buf[[0, 2]] == 1).all())


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_int8_state_keeps_the_mixer_class_and_old_checkpoints_load(arch, tmp_path):
    """One mixer per family: the int8 state is a spec of the same class; checkpoints whose manifest names the
    pre-SSMMixer kind ``SSMInt8StateMixer`` load to the same model."""
    import json

    from ssmq.models.lm import MIXERS
    from ssmq.quant.checkpoint import MANIFEST, load_quantized, save_quantized

    model = int8_state_model(arch)
    assert all(type(model.layers[i].mixer) is MIXERS[model.config.layer_kind(i)] for i in range(model.config.n_layer))
    model.quantization = {"recipe": {"name": "int8-state-only", "cache": {"state_bits": 8},
                                     "supported_archs": ["mamba1", "mamba2"]}, "calibration": {"source": "none"}}
    save_quantized(model, tmp_path / "new")
    manifest = json.loads((tmp_path / "new" / MANIFEST).read_text())
    assert {s["kind"] for s in manifest["modules"].values()} == {"SSMMixer"}
    for spec in manifest["modules"].values():  # rewrite as the code before SSMMixer wrote it
        spec["kind"], spec["state_groups"] = "SSMInt8StateMixer", spec.pop("state")["groups"]
    (tmp_path / "new" / MANIFEST).write_text(json.dumps(manifest))
    old = load_quantized(tmp_path / "new")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        outs = []
        for m in (model, old):
            cache = m.allocate_cache(2, 16, ssm_dtype=torch.int8)
            outs.append(torch.stack([m(ids[:, :8], cache)[:, -1]] + [m.step(ids[:, t], cache) for t in range(8, 12)]))
    assert torch.equal(outs[0], outs[1])
    assert type(old.layers[0].mixer) is type(model.layers[0].mixer)


def test_float_state_mixers_are_not_recorded_in_checkpoints(tmp_path):
    import json

    from ssmq.quant.checkpoint import MANIFEST, save_quantized

    model = tiny_model("mamba2")
    model.quantization = {"recipe": {"name": "none"}, "calibration": {"source": "none"}}
    save_quantized(model, tmp_path / "f")
    assert json.loads((tmp_path / "f" / MANIFEST).read_text())["modules"] == {}


@pytest.mark.parametrize("int8_state", [False, True])
def test_mamba2_prefill_continues_its_cache_rows(int8_state, monkeypatch):
    """A Mamba-2 prefill into cache slots: a float state is handed to the scan as its cache rows (``state_rows``, read
    and written in place), an int8 state goes through read_ssm / write_ssm; either way two prefills continue each
    other as one forward does, and unserved rows keep their states."""
    import ssmq.kernels as kernels

    model = int8_state_model("mamba2") if int8_state else tiny_model("mamba2")
    calls = []
    scan = kernels.ssd_chunk_scan

    def spy(*args, **kw):
        calls.append("state_rows" if "state_rows" in kw else "initial_states" if "initial_states" in kw else "none")
        return scan(*args, **kw)

    monkeypatch.setattr(kernels, "ssd_chunk_scan", spy)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(5))
    cache = model.allocate_cache(SLOTS, 32, **({"ssm_dtype": torch.int8} if int8_state else {}))
    g = torch.Generator().manual_seed(6)
    for st in cache.states:
        st.ssm.copy_(torch.randint(-127, 128, st.ssm.shape, generator=g, dtype=torch.int8) if int8_state
                     else torch.randn(st.ssm.shape, generator=g).to(st.ssm.dtype))
    others = [i for i in range(SLOTS) if i not in SERVED.tolist()]
    before = [st.ssm[others].clone() for st in cache.states]
    with torch.no_grad():
        whole = model(ids)[:, -1]
        cache.reset(SERVED.tolist())
        calls.clear()
        model(ids[:, :6], cache, SERVED)
        split = model(ids[:, 6:], cache, SERVED)[:, -1]
    want = "initial_states" if int8_state else "state_rows"
    assert calls and set(calls) == {want}, calls
    if not int8_state:  # an int8 state rounds between the two prefills
        torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-4)
    for st, old in zip(cache.states, before):
        assert torch.equal(st.ssm[others], old)
