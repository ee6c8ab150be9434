"""State checkpointing (ReplaySSM, ``ssmq.ops.replay_ssm`` through ``MambaState``): a checkpointed state decodes as
the plain write-every-step state does (float32: equal within 1e-5 over 3·K steps, slots served out of order, some
idle, a reset, a prefill's write), its int8 checkpoint drifts less than the write-every-step int8 state, and the
big state buffer is written only when a slot's ring is full.

Glossary: s slots, b rows served, h heads, p headdim, g ngroups, n d_state, d d_inner, K checkpoint interval.
"""

from __future__ import annotations

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.models.state import Int8StateScales, MambaState

K = 4
LAYOUTS = {"mamba2": dict(h=4, p=8, g=2, n=16), "mamba1": dict(h=None, p=12, g=1, n=8)}


def _params(layout, seed=0):
    """A (h, p, n) | (d, n), D, dt_bias of a layer, per head for Mamba-2 (expanded over p: stride 0)."""
    c = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    h, p, n = c["h"], c["p"], c["n"]
    if h:
        A = -(torch.rand(h, generator=gen) + 0.1)[:, None, None].expand(h, p, n)
        per_head = lambda: torch.randn(h, generator=gen)[:, None].expand(h, p)  # noqa: E731
        return A, per_head(), per_head()
    return -(torch.rand(p, n, generator=gen) + 0.1), torch.randn(p, generator=gen), torch.randn(p, generator=gen)


def _inputs(layout, b, gen):
    """x, dt, B, C, z of one step for b rows (Mamba-2 dt one value per head)."""
    c = LAYOUTS[layout]
    h, p, g, n = c["h"], c["p"], c["g"], c["n"]
    lead, bc = ((h, p), (b, g, n)) if h else ((p,), (b, n))
    dt = torch.randn(b, h, generator=gen)[:, :, None].expand(b, h, p) if h else torch.randn(b, p, generator=gen)
    return (torch.randn(b, *lead, generator=gen), dt, torch.randn(*bc, generator=gen), torch.randn(*bc, generator=gen),
            torch.randn(b, *lead, generator=gen))


def _states(layout, s, ssm_dtype=torch.float32, scales=None):
    c = LAYOUTS[layout]
    shape = (c["h"], c["p"], c["n"]) if c["h"] else (c["p"], c["n"])
    mk = lambda every: MambaState.allocate(s, 8, 4, shape, torch.float32, "cpu", ssm_dtype, scales,  # noqa: E731
                                           checkpoint_every=every, bc_groups=c["g"])
    return mk(None), mk(K)


def _step(state, slots, inputs, params):
    x, dt, B, C, z = inputs
    A, D, dt_bias = params
    return state.step_ssm(slots, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)


# rows served at each step (a pattern of slots repeated over the steps): out of order, slot 2 idle at times,
# slot 5 never served
SCHEDULE = [[3, 0, 1], [1, 2], [4, 3, 0, 2, 1], [0], [2, 4]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replay_decode_equals_plain_decode(layout):
    s, gen = 6, torch.Generator().manual_seed(1)
    params = _params(layout)
    plain, replay = _states(layout, s)
    writes = 0
    for t in range(3 * K * len(SCHEDULE) // 2):
        slots = torch.tensor(SCHEDULE[t % len(SCHEDULE)])
        if t == 9:  # a slot is reset (a new sequence) ...
            plain.reset(torch.tensor([1]))
            replay.reset(torch.tensor([1]))
        if t == 13:  # ... and a prefill writes its final state: the checkpoint, the ring emptied
            rows, final = torch.tensor([0, 4]), torch.randn(2, *plain.ssm.shape[1:], generator=gen)
            plain.write_ssm(rows, final)
            replay.write_ssm(rows, final)
            assert replay.ring.count[rows].tolist() == [0, 0]
        inputs = _inputs(layout, len(slots), gen)
        before = replay.ssm.clone()
        y_plain, y_replay = _step(plain, slots, inputs, params), _step(replay, slots, inputs, params)
        torch.testing.assert_close(y_replay, y_plain, rtol=1e-5, atol=1e-5)
        changed = (replay.ssm != before).flatten(1).any(1)
        writes += int(changed.sum())
        # the big buffer changes only in the rows whose ring just emptied
        assert not (changed & (replay.ring.count != 0)).any()
        torch.testing.assert_close(replay.read_ssm(None, params[0]), plain.read_ssm(None).float(), rtol=1e-5, atol=1e-5)
    assert writes > 0
    assert replay.ring.count[5] == 0 and not replay.ssm[5].any()  # the idle slot was never touched


def test_replay_ring_nbytes_and_errors():
    plain, replay = _states("mamba2", 3)
    c = LAYOUTS["mamba2"]
    R, h, p, g, n = K - 1, c["h"], c["p"], c["g"], c["n"]
    ring = 3 * (R * h * p * 4 + R * h * 4 + R * g * n * 4 + 2 * 4)  # x, per-head Δ, B in float32; count, tally
    assert replay.ssm_nbytes() - plain.ssm_nbytes() == ring
    assert replay.checkpoint_every == K and plain.checkpoint_every is None
    with pytest.raises(SSMQError, match="replays its ring"):
        replay.read_ssm(torch.tensor([0]))
    with pytest.raises(SSMQError, match=">= 2"):
        MambaState.allocate(2, 8, 4, (4, 8, 16), torch.float32, "cpu", checkpoint_every=1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rows", [False, True])
def test_replay_int8_state_drifts_less_than_write_every_step(layout, rows):
    """An int8 checkpoint is rounded once every K steps; the plain int8 state once a step. Against the float32
    state: replay's error <= (checkpoints written) · scale / 2 (the decay |exp(Δ·A)| <= 1 never grows a rounding
    error, and Δ·B·x is exact), while plain int8 accumulates one rounding a step and ends further off. ``rows``:
    dynamic row scales (each write its own scale, so the per-step bound is checked for the static table only)."""
    s, gen = 3, torch.Generator().manual_seed(2)
    params = _params(layout)
    n = LAYOUTS[layout]["n"]
    scales = Int8StateScales(None, rows=True) if rows else Int8StateScales(torch.full((1, n), 0.05))
    ref, _ = _states(layout, s)
    plain, replay = _states(layout, s, torch.int8, scales)
    slots = torch.tensor([2, 0, 1])
    steps = 6 * K
    err_plain, err_replay = [], []
    for t in range(steps):
        inputs = _inputs(layout, s, gen)
        inputs = (inputs[0] * 0.3, *inputs[1:])  # states within the int8 range of scale 0.05
        y_ref = _step(ref, slots, inputs, params)
        y_plain, y_replay = _step(plain, slots, inputs, params), _step(replay, slots, inputs, params)
        err_plain.append((y_plain - y_ref).abs().max().item())
        err_replay.append((y_replay - y_ref).abs().max().item())
        st_err = (replay.read_ssm(None, params[0]) - ref.read_ssm(None)).abs().max().item()
        assert rows or st_err <= ((t + 1) // K) * 0.05 / 2 + 1e-5
    assert replay.ssm.dtype == torch.int8
    # row scales: each write's rounding error is a fraction of the row's own range, independent across writes, so
    # K times fewer writes cut the accumulated error by about sqrt(K) (0.52x measured here), not K
    assert sum(err_replay) < (0.75 if rows else 0.5) * sum(err_plain)
    assert err_replay[K - 2] < 1e-5  # before the first checkpoint write the replay is the float state


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "hybrid"])
def test_model_decode_with_state_checkpoint_equals_plain(arch):
    """``model.allocate_cache(..., state_checkpoint=K)``: prefill, 3·K decode steps of rows served out of order, a
    second prefill continuing a slot mid-ring (its initial state replayed), more steps: the plain cache's logits."""
    from tiny_ssm import tiny_model

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        caches = [model.allocate_cache(4, 64, state_checkpoint=k) for k in (None, K)]
        prompt = torch.randint(0, 64, (2, 5), generator=g)
        outs = [model(prompt, c, torch.tensor([2, 0])) for c in caches]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        for t in range(3 * K + 2):
            slots = torch.tensor([[0, 2], [2, 0, 3], [3]][t % 3])
            tokens = torch.randint(0, 64, (len(slots),), generator=g)
            if t == K + 1:  # a chunk of prompt for slot 2 in the middle of its ring
                chunk = torch.randint(0, 64, (1, 3), generator=g)
                outs = [model(chunk, c, torch.tensor([2])) for c in caches]
                torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
            outs = [model.step(tokens, c, slots) for c in caches]
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    rings = [st.ring for st in caches[1].states if isinstance(st, MambaState)]
    assert rings and all(r is not None and r.every == K for r in rings)
    assert all(int(r.count.sum()) > 0 for r in rings)  # the decode steps went through the rings
    assert caches[1].nbytes() > caches[0].nbytes()


def test_update_ssm_on_a_checkpointed_state_writes_the_checkpoint_every_step():
    """``update_ssm`` (a float step function, no ring inputs): the replayed state stepped and written back as the
    checkpoint, the ring emptied; the y and state of plain decode."""
    from ssmq.ops.state_update import selective_state_update_ref

    gen = torch.Generator().manual_seed(4)
    params = _params("mamba2")
    plain, replay = _states("mamba2", 3)
    slots = torch.tensor([2, 0])
    for _ in range(K - 1):  # fill the rings
        inputs = _inputs("mamba2", 2, gen)
        _step(plain, slots, inputs, params)
        _step(replay, slots, inputs, params)
    assert replay.ring.count[slots].tolist() == [K - 1, K - 1]
    x, dt, B, C, z = _inputs("mamba2", 2, gen)
    A, D, dt_bias = params
    step = lambda st, idx: selective_state_update_ref(st, x, dt, A, B, C, D, z, dt_bias, True, idx)  # noqa: E731
    torch.testing.assert_close(replay.update_ssm(slots, step, A), plain.update_ssm(slots, step), rtol=1e-5, atol=1e-5)
    assert replay.ring.count[slots].tolist() == [0, 0]
    torch.testing.assert_close(replay.ssm[slots], plain.ssm[slots], rtol=1e-5, atol=1e-5)
