"""A quantized model's decode step on the int8 path (the taps' codes into the conv / state-update ops, the state
read and written as stored: the mixers' ``int8`` executor) equals the earlier path (fake-quantized taps, a float step
on a dequantized work copy: the mixers' ``float`` executor): bit for bit on CPU through the references, and within float
tolerance with the Triton kernels (``gpu`` test: CUDA, or SSMQ_TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from ssmq import kernels
from ssmq.quant import quantize
from ssmq.quant.recipe import Cache, Calibration, get_recipe
from ssmq.quant.ssm.state_cache import allocate_cache
from tiny_ssm import synthetic_calibration, tiny_model

CALIB = synthetic_calibration(64, 8, 32)
IDS = synthetic_calibration(64, 2, 20, seed=5).input_ids
SLOTS = torch.tensor([3, 1])
# (arch, recipe, state): codes + int8 state, codes + float state, int8 state with float taps (W4A16), codes + int8
# state with dynamic row scales ("rows"); state 8 / "rows" / 16: int8 with the x-group table / with row scales / float
CASES = [("mamba2", "quamba2-w8a8", 8), ("mamba2", "quamba-w8a8", 16), ("mamba2", "quamba2-w4a16", 8),
         ("mamba1", "quamba2-w8a8", 8), ("mamba1", "quamba-w8a8", 16), ("mamba1", "quamba2-w4a16", 8),
         ("mamba2", "quamba2-w8a8", "rows"), ("mamba1", "quamba2-w8a8", "rows")]
_models = {}


def quantized(arch, name, bits):
    key = (arch, name, bits)
    if key not in _models:
        cache = Cache(state_bits=8, state_scales="dynamic") if bits == "rows" else Cache(state_bits=bits)
        recipe = get_recipe(name).with_changes(calibration=Calibration(state_chunk=8), cache=cache)
        _models[key] = quantize(tiny_model(arch), recipe, CALIB, progress=False)
    return _models[key]


@torch.no_grad()
def decode(model, bits, new_path: bool, monkeypatch, steps: int = 6):
    """Prefill 12 tokens into slots 3 and 1 of a 4-slot cache, then greedy decode: (logits (b, steps, vocab),
    tokens (b, steps), the SSM states)."""
    cache = allocate_cache(model, 4, 32, ssm_dtype=torch.int8 if bits != 16 else None)
    if not new_path:  # the float executor, asked for explicitly
        for layer, st in zip(model.layers, cache.states):
            st.plan = layer.mixer.plan(st, "float")
    logits = [model(IDS[:, :12], cache, SLOTS)[:, -1]]
    tokens = [logits[-1].argmax(-1)]
    for _ in range(steps - 1):
        logits.append(model.step(tokens[-1], cache, SLOTS))
        tokens.append(logits[-1].argmax(-1))
    rows = [st.row_scale.clone() for st in cache.states if getattr(st, "row_scale", None) is not None]
    return (torch.stack(logits, 1), torch.stack(tokens, 1), [s.clone() for s in cache.ssm_states if s is not None],
            rows)


@pytest.mark.parametrize("arch,name,bits", CASES)
def test_int8_decode_path_equals_the_fake_quant_path_on_cpu(arch, name, bits, monkeypatch):
    model = quantized(arch, name, bits)
    old = decode(model, bits, False, monkeypatch)
    new = decode(model, bits, True, monkeypatch)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert all(torch.equal(a, b) for a, b in zip(new[2], old[2]))
    assert all(s.dtype == (torch.int8 if bits != 16 else torch.float32) for s in new[2])
    assert len(new[3]) == (model.config.n_layer if bits == "rows" else 0)
    assert all(torch.equal(a, b) for a, b in zip(new[3], old[3]))


def test_the_int8_path_is_taken(monkeypatch):
    """The new path runs the int8 ops (not the fake-quant taps + float update) for a quantized model."""
    calls = []
    for name in ("conv1d_update_silu_quant", "quant_state_update"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _n=name, **kw: (calls.append(_n), _fn(*a, **kw))[1])
    monkeypatch.setattr(kernels, "selective_state_update", None)  # the float update must not be called
    decode(quantized("mamba2", "quamba2-w8a8", 8), 8, True, monkeypatch, steps=2)
    layers = quantized("mamba2", "quamba2-w8a8", 8).config.n_layer
    assert calls.count("conv1d_update_silu_quant") == layers and calls.count("quant_state_update") == layers


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
@pytest.mark.parametrize("state", [8, "rows"])
def test_int8_decode_on_the_kernels_equals_the_fake_quant_path(arch, state, monkeypatch):
    """Same, with the conv and state-update kernels in place of the references (the rest of the model as it is)."""
    from test_kernels import DEV, INTERPRET, _patch_interpreter_scalars, rel

    pytest.importorskip("triton")
    if INTERPRET:
        _patch_interpreter_scalars()
    from ssmq.kernels import conv1d, quant_gemm, state_update

    model = copy.deepcopy(quantized(arch, "quamba2-w8a8", state)).to(DEV)
    ids = IDS.to(DEV)
    monkeypatch.setattr("test_int8_decode.IDS", ids)
    monkeypatch.setattr("test_int8_decode.SLOTS", SLOTS.to(DEV))
    old = decode(model, state, False, monkeypatch)
    if state != "rows":
        # (with row scales the conv kernel's codes are left to their reference: on this tiny model one x code lands
        # on a rounding boundary at step 4 and the flip moves the logits by 1%, a test artifact, not the state's)
        monkeypatch.setattr(kernels, "conv1d_update_silu_quant", conv1d.conv1d_update_silu_quant)
    monkeypatch.setattr(kernels, "quant_state_update", state_update.quant_state_update)
    monkeypatch.setattr(kernels, "quantize_act", quant_gemm.quantize_act)  # Mamba-1's per-tensor B, C codes
    new = decode(model, state, True, monkeypatch)
    assert rel(new[0], old[0]) < 1e-4
    assert torch.equal(new[1], old[1])  # greedy tokens
    for a, b in zip(new[2], old[2]):
        diff = (a.int() - b.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    for a, b in zip(new[3], old[3]):
        assert rel(a, b) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
@pytest.mark.parametrize("state", [8, "rows"])
def test_int8_decode_under_cuda_graphs_equals_eager(arch, state, tmp_path):
    """A saved Quamba2 + int8-state model, loaded in fp16 on CUDA: graph-replayed decode on the int8 kernels (no host
    syncs, no stray allocations) gives eager decode's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    import ssmq
    from ssmq.quant import save_quantized
    from ssmq.runtime.cuda_graph import CudaGraphDecoder
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    save_quantized(copy.deepcopy(quantized(arch, "quamba2-w8a8", state)), tmp_path / "q")
    model = ssmq.load_model(tmp_path / "q", dtype=torch.float16, device="cuda")
    prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60]]
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    eager = generate(model, prompts, params, cache=model.allocate_cache(4, 64, ssm_dtype=torch.int8))
    dec = CudaGraphDecoder(model, max_batch=4, max_seqlen=64, ssm_dtype=torch.int8)
    assert all(s.dtype == torch.int8 for s in dec.cache.ssm_states if s is not None)
    assert generate(model, prompts, params, cache=dec.cache, decode_fn=dec) == eager


def test_generate_decodes_an_int8_state_model_on_its_int8_state(monkeypatch):
    """``generate`` (and ``ssmq generate``) allocate the state format the model was calibrated for, as the engine."""
    from ssmq.models.state import MambaState
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    seen = []
    step = MambaState.step_ssm
    monkeypatch.setattr(MambaState, "step_ssm",
                        lambda self, *a, **kw: (seen.append(self.ssm.dtype), step(self, *a, **kw))[1])
    generate(quantized("mamba2", "quamba2-w8a8", 8), [[1, 2, 3]], SamplingParams(max_new_tokens=3, stop_at_eos=False))
    assert seen and set(seen) == {torch.int8}


def test_int8_state_note():
    # decoding on an int8 state written every step drifts (README: 8-bit SSM state cache): the CLI and the engine say
    # so in one line, unless the state is checkpointed; float-state models get no note
    from ssmq.models.cache import int8_state_note

    model = quantized("mamba2", "quamba2-w8a8", 8)
    assert "--state-checkpoint" in int8_state_note(model, None)
    assert int8_state_note(model, 16) is None
    assert int8_state_note(quantized("mamba2", "quamba2-w8a8", 16), None) is None


def test_per_channel_state_scales_round_trip(tmp_path):
    # cache.state_scales "per_channel": a (d, n) scale table (every channel its own group), saved and loaded back,
    # decoding on the int8 state as the x-group one does
    from ssmq.quant import save_quantized
    import ssmq
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    model = tiny_model("mamba2")
    recipe = get_recipe("quamba2-w8a8").with_changes(calibration=Calibration(state_chunk=8),
                                                      cache=Cache(state_bits=8, state_scales="per_channel"))
    model = quantize(model, recipe, synthetic_calibration(model.config.vocab_size, n=4, seqlen=16), progress=False)
    mixer = model.layers[0].mixer
    d, n = model.config.d_inner, model.config.d_state
    assert mixer.state_scale.shape == (d, n) and torch.equal(mixer.state_index.cpu(), torch.arange(d))
    save_quantized(model, tmp_path / "q")
    back = ssmq.load_model(tmp_path / "q")
    assert torch.equal(back.layers[0].mixer.state_scale, mixer.state_scale)
    from ssmq.models.cache import int8_state_note

    assert int8_state_note(back, None) is None  # per-channel scales: no drift note
    params = SamplingParams(max_new_tokens=4, stop_at_eos=False)
    assert generate(back, [[1, 2, 3]], params) == generate(model, [[1, 2, 3]], params)
    with pytest.raises(Exception, match="state_scales"):
        Cache(state_bits=8, state_scales="per_head").validate()


def test_dynamic_row_state_scales(tmp_path):
    # cache.state_scales "dynamic": nothing calibrated (no scale buffers in the model), every cache slot keeps one
    # float32 scale per channel row, rewritten with its codes; saved and loaded back, decoding as before
    import ssmq
    from ssmq.models.cache import int8_state_note
    from ssmq.ops.quant_ssm import dequantize_state_rows_ref, quantize_state_rows_ref
    from ssmq.quant import save_quantized
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    x = torch.randn(3, 4, 5, 16) * torch.logspace(-3, 1, 5)[:, None]
    x[0, 0, 0] = 0
    q, scale = quantize_state_rows_ref(x)
    assert scale.shape == x.shape[:-1] and scale[0, 0, 0] == 0 and not q[0, 0, 0].any()
    assert q.abs().amax(-1)[scale > 0].eq(127).all()  # each row spans the codes
    assert ((dequantize_state_rows_ref(q, scale) - x).abs() <= scale[..., None] / 2 + 1e-12).all()

    model = quantized("mamba2", "quamba2-w8a8", "rows")
    mixer = model.layers[0].mixer
    assert mixer.state_rows and not hasattr(mixer, "state_scale")
    cache = allocate_cache(model, 4, 32, ssm_dtype=torch.int8)
    st = cache.states[0]
    h, p, n = mixer.state_shape()
    assert st.row_scale.shape == (4, h, p) and st.ssm_nbytes() == 4 * h * p * (n + 4)
    assert "--state-checkpoint" in int8_state_note(model, None)  # row scales drift too (less than the x groups)
    assert int8_state_note(model, 16) is None
    save_quantized(model, tmp_path / "q")
    back = ssmq.load_model(tmp_path / "q")
    assert back.layers[0].mixer.state_rows
    params = SamplingParams(max_new_tokens=4, stop_at_eos=False)
    assert generate(back, [[1, 2, 3]], params) == generate(model, [[1, 2, 3]], params)


def test_int8_state_composes_with_weight_and_kv_recipes():
    # "A+int8-state": any recipe with the int8 state (row scales) on its Mamba layers; with a KV preset too
    from ssmq.errors import SSMQError
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    r = get_recipe("rtn-w8a16+int8-state")
    assert (r.cache.state_bits, r.cache.state_scales) == (8, "dynamic") and "llama" not in r.supported_archs
    assert get_recipe("rtn-w8a16+int8-state+kvquant-nuq4").cache.kv is not None
    with pytest.raises(SSMQError, match="already has an int8 SSM state"):
        get_recipe("ssdi8-w8a8+int8-state")
    with pytest.raises(SSMQError, match="cache-only"):
        get_recipe("int8-state+rtn-w8a16")
    params = SamplingParams(max_new_tokens=3, stop_at_eos=False)
    for arch, name in [("mamba2", "rtn-w8a16+int8-state"), ("hybrid", "rtn-w8a16+int8-state+kvquant-nuq4")]:
        model = quantize(tiny_model(arch), name, CALIB, progress=False)
        cache = allocate_cache(model, 2, 32, ssm_dtype=torch.int8)
        assert any(getattr(st, "row_scale", None) is not None for st in cache.states)
        assert len(generate(model, [[1, 2, 3]], params)[0]) == 3
