"""The ReplaySSM decode kernel (``ssmq.kernels.state_update.replay_state_update``) equals its reference
``ssmq.ops.replay_ssm.replay_state_update_ref`` (GPU, or SSMQ_TRITON_INTERPRET=1 on CPU): y, the checkpoints
(written only where a ring is full), the appended ring entries and the counts, for Mamba-1 / Mamba-2, float / int8
state and float / int8-code inputs, one step from rings of every fill, then K steps in a row.

Glossary: s slots, b rows served, h heads, p headdim, g ngroups, n d_state, K checkpoint interval, R = K - 1.
"""

from __future__ import annotations

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.ops.replay_ssm import StateRing, replay_state_update_ref
from test_int8_ssm_kernels import LAYOUTS, _assert_state_close, _case, _dev
from test_int8_ssm_kernels import _clone as _clone_args
from test_kernels import DEV, kernel_module, rel

pytestmark = pytest.mark.gpu
K = 4


@pytest.fixture(scope="module")
def SU():
    return kernel_module("state_update")


def _case_tied(layout, state_fmt, input_fmt):
    """``_case`` with Mamba-2's A per head as a stride-0 view (the mixer's layout; a ring keeps one Δ per head)."""
    args = _case(layout, state_fmt, input_fmt)
    if layout == "mamba2":
        args[6] = args[6][:, :1, :1].expand(args[6].shape)
    return args


def _ring(layout, served, seed=5):
    """A ring of random entries; the counts of the ``served`` rows cycle R, 0, 1, … (a full ring, an empty one,
    partly filled ones), the other slots' are R (unserved: must stay so)."""
    s, _, h, p, g_, n = LAYOUTS[layout]
    h, g_ = (h, g_) if h else (1, 1)
    ring = StateRing.allocate(s, K, h, p, g_, n, per_head_dt=layout == "mamba2", device="cpu")
    gen = torch.Generator().manual_seed(seed)
    ring.x.copy_(torch.randn(ring.x.shape, generator=gen))
    ring.dt.copy_(torch.rand(ring.dt.shape, generator=gen) * 0.5)
    ring.B.copy_(torch.randn(ring.B.shape, generator=gen))
    ring.count.fill_(K - 1)
    ring.count[served.long()] = ((torch.arange(len(served)) + K - 1) % K).to(torch.int32)
    return ring


def _on(ring, dev):
    return StateRing(*(t.to(dev) for t in ring.tensors()))


def _clone(ring):
    return StateRing(*(t.clone() for t in ring.tensors()))


def _assert_ring_equal(got, want):
    """Counts exact; x, B dequantized by one multiply as the reference; Δ through the kernel's softplus (~1 ulp)."""
    assert torch.equal(got.count.cpu(), want.count)
    assert not got.done.any()  # the kernel's tally is back to zero for the next launch
    assert rel(got.x, want.x) < 1e-6 and rel(got.B, want.B) < 1e-6 and rel(got.dt, want.dt) < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("state_fmt", ["int8_index", "int8_rows", "float"])
@pytest.mark.parametrize("input_fmt", ["codes_per_channel", "float"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_replay_state_update_equals_reference(SU, layout, state_fmt, input_fmt, chunk, monkeypatch):
    """``chunk``: the checkpoint read in column chunks of 8 (n = 16 on CPU: two, the pipelined loop's path)."""
    if chunk:
        monkeypatch.setitem(SU.CFG["replay"], "BNC", chunk)
    args = _case_tied(layout, state_fmt, input_fmt)
    ring = _ring(layout, args[-1])
    ref_args = _clone_args(args)
    ref_ring, counts, state0 = _clone(ring), ring.count.clone(), args[0].clone()
    y_ref = replay_state_update_ref(ref_args[0], *ref_args[1:3], ref_ring, *ref_args[3:])
    dev_args, dev_ring = _dev(args), _on(ring, DEV)
    y = SU.replay_state_update(dev_args[0], *dev_args[1:3], dev_ring, *dev_args[3:])
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert rel(y, y_ref) < 1e-5
    _assert_state_close(dev_args[0], ref_args[0], state_fmt)
    _assert_ring_equal(dev_ring, ref_ring)
    served, s = args[-1].long(), args[0].shape[0]
    full = torch.zeros(s, dtype=torch.bool)
    full[served] = counts[served] == K - 1
    assert full.any() and (~full).any()  # both branches ran
    assert torch.equal(dev_args[0].cpu()[~full], state0[~full])  # only full rings wrote their checkpoint
    assert not torch.equal(dev_args[0].cpu()[full], state0[full])
    if state_fmt == "int8_rows":  # row scales rewritten where the checkpoint was, as the reference's
        assert rel(dev_args[1].scale.cpu(), ref_args[1].scale) < 1e-5
        assert torch.equal(dev_args[1].scale.cpu()[~full], args[1].scale[~full])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("state_fmt,rcp_table", [("int8_index", False), ("int8_index", True), ("int8_rows", False)])
def test_replay_kernel_over_k_steps(SU, layout, state_fmt, rcp_table, monkeypatch):
    """2·K + 1 steps in a row on an int8 checkpoint with int8 inputs: every ring empties twice. y within 1e-4: a
    checkpoint code one step from the reference's (a float32 state within an ulp of a rounding boundary, rare) is
    carried by the steps after it. ``rcp_table``: the checkpoints re-quantized with the reciprocals' table;
    int8_rows: with dynamic row scales."""
    monkeypatch.setitem(SU.CFG, "rcp_table", rcp_table)
    args = _case_tied(layout, state_fmt, "codes_per_channel")
    ring = _ring(layout, args[-1])
    ref_args = _clone_args(args)
    ref_ring, dev_args, dev_ring = _clone(ring), _dev(args), _on(ring, DEV)
    for _ in range(2 * K + 1):
        y_ref = replay_state_update_ref(ref_args[0], *ref_args[1:3], ref_ring, *ref_args[3:])
        y = SU.replay_state_update(dev_args[0], *dev_args[1:3], dev_ring, *dev_args[3:])
        assert rel(y, y_ref) < 1e-4
    _assert_state_close(dev_args[0], ref_args[0], "int8")
    _assert_ring_equal(dev_ring, ref_ring)


def test_replay_ring_shape_mismatch_is_refused(SU):
    args = _case_tied("mamba2", "float", "float")
    ring = _ring("mamba1", torch.tensor([0]))  # a Mamba-1 ring for a Mamba-2 state
    with pytest.raises(SSMQError, match="does not match the state"):
        SU.replay_state_update(args[0], *args[1:3], ring, *args[3:])


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_model_decode_on_kernels_with_state_checkpoint(arch):
    """A tiny float32 model on CUDA: eager decode and CUDA-graph decode with ``state_checkpoint=4`` (the kernel)
    give the logits of plain eager decode over 3·K steps, after a prefill."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: on CPU the model runs the references (tests/test_replay_ssm.py)")
    from ssmq.runtime.cuda_graph import CudaGraphDecoder
    from tiny_ssm import tiny_model

    model = tiny_model(arch).cuda()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (3, 6), generator=g).cuda()
    slots = torch.tensor([2, 0, 1], device="cuda")
    with torch.no_grad():
        plain, eager = (model.allocate_cache(4, 64, state_checkpoint=k) for k in (None, K))
        graphs = CudaGraphDecoder(model, max_batch=3, max_seqlen=64, buckets=(3,), state_checkpoint=K)
        for cache in (plain, eager, graphs.cache):
            model(prompt, cache, slots)
        for _ in range(3 * K):
            tokens = torch.randint(0, 64, (3,), generator=g).cuda()
            want = model.step(tokens, plain, slots)
            assert rel(model.step(tokens, eager, slots), want) < 1e-4
            assert rel(graphs(tokens, slots), want) < 1e-4


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_model_decode_through_the_dispatched_kernels(SU, arch, monkeypatch):
    """The decode step of a checkpointed cache reaches the kernel through ``kernels.replay_state_update`` (dispatch →
    ``MambaState.step_ssm``): on CPU every op is sent to its Triton kernel (the interpreter) and 2·K + 1 steps give
    the logits of plain decode; without CUDA the other model tests only see the references."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA run is test_model_decode_on_kernels_with_state_checkpoint")
    from ssmq.kernels import dispatch
    from tiny_ssm import tiny_model

    model = tiny_model(arch, n_layer=1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (2, 3), generator=g)
    slots = torch.tensor([1, 0])
    calls = []
    real = SU.replay_state_update
    monkeypatch.setattr(SU, "replay_state_update", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        plain, replay = (model.allocate_cache(3, 32, state_checkpoint=k) for k in (None, K))
        for cache in (plain, replay):
            model(prompt, cache, slots)
        monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)
        for _ in range(2 * K + 1):
            tokens = torch.randint(0, 64, (2,), generator=g)
            assert rel(model.step(tokens, replay, slots), model.step(tokens, plain, slots)) < 1e-4
    assert len(calls) == 2 * K + 1
