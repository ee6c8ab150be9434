"""The prefill's int8 state I/O kernels (``ssmq.kernels.state_io``) equal ``read_state_ref`` / ``write_state_ref``
bit for bit (GPU, or SSMQ_TRITON_INTERPRET=1 on CPU): codes, row scales and dequantized rows, for dynamic row scales
and static tables (one group, x groups with an index, per channel), Mamba-1 (s, d, n) and Mamba-2 (s, h, p, n)."""

from __future__ import annotations

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.ops.quant_ssm import RowScales, read_state_ref, write_state_ref
from test_kernels import DEV, kernel_module

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def IO():
    return kernel_module("state_io")


def _scales(fmt, s, lead, n, g):
    d = int(torch.tensor(lead).prod())
    if fmt == "rows":
        return RowScales(torch.rand(s, *lead, generator=g) * 0.05), None
    G = {"one_group": 1, "x_groups": 4, "per_channel": d}[fmt]
    table = torch.rand(G, n, generator=g) * 0.05 + 0.01
    return table, torch.randint(0, G, (d,), generator=g) if fmt == "x_groups" else None


def _dev(scale):
    return RowScales(scale.scale.clone().to(DEV)) if isinstance(scale, RowScales) else scale.to(DEV)


@pytest.mark.parametrize("fmt", ["rows", "one_group", "x_groups", "per_channel"])
@pytest.mark.parametrize("lead", [(4, 8), (24,)])  # Mamba-2 (h, p) | Mamba-1 (d,)
@pytest.mark.parametrize("all_slots", [False, True])
def test_write_and_read_equal_the_references(IO, fmt, lead, all_slots):
    g = torch.Generator().manual_seed(0)
    s, n = 5, 16
    state = torch.randint(-128, 128, (s, *lead, n), dtype=torch.int8, generator=g)
    scale, index = _scales(fmt, s, lead, n, g)
    idx = slice(None) if all_slots else torch.tensor([3, 0])
    b = s if all_slots else 2
    values = torch.randn(b, *lead, n, generator=g) * torch.logspace(-2, 1, n)
    values[0, 0] = 0  # a zero row: scale 0, codes 0
    ref_state, ref_scale = state.clone(), RowScales(scale.scale.clone()) if fmt == "rows" else scale
    write_state_ref(ref_state, ref_scale, index, idx, values)
    dev_state, dev_scale, dev_index = state.to(DEV), _dev(scale), None if index is None else index.to(DEV)
    dev_idx = idx if all_slots else idx.to(DEV)
    IO.write_state(dev_state, dev_scale, dev_index, dev_idx, values.to(DEV))
    assert torch.equal(dev_state.cpu(), ref_state)
    if fmt == "rows":
        assert torch.equal(dev_scale.scale.cpu(), ref_scale.scale)
    assert torch.equal(IO.read_state(dev_state, dev_scale, dev_index, dev_idx).cpu(),
                       read_state_ref(ref_state, ref_scale, index, idx))


def test_bad_state_is_refused(IO):
    state = torch.zeros(2, 4, 16, dtype=torch.int8, device=DEV)
    with pytest.raises(SSMQError, match="row scales must be float32"):
        IO.read_state(state, RowScales(torch.zeros(2, 3, device=DEV)), None, slice(None))
    with pytest.raises(SSMQError, match="int8 states"):
        IO.read_state(state.float(), None, None, slice(None))
