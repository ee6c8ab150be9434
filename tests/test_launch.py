"""The signature-keyed launch path (``ssmq.kernels.launch``): its key refines Triton's specialization, and a kernel
launched through it computes what Triton's own launch computes, across the specializations it keys on."""

import itertools

import pytest
import torch

from test_kernels import INTERPRET  # before Triton's import: it selects Triton's interpreter when asked

triton = pytest.importorskip("triton")

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from ssmq.kernels.launch import arg_key  # noqa: E402


def _values():
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, 2 ** 40, 2 ** 63 - 16, 2 ** 63,
            -2 ** 31, -2 ** 31 - 1]
    base = torch.zeros(64, dtype=torch.float16)
    tensors = [base, base[1:], base[8:], base[16:], torch.zeros(8), torch.zeros(8)[3:],
               torch.zeros(8, dtype=torch.int8), torch.zeros(32, dtype=torch.int8)[16:]]
    return ints + [True, False, 0.5, 1.0, None] + tensors


def test_equal_keys_mean_equal_specializations():
    vals = _values()
    for a, b in itertools.combinations(vals, 2):
        if type(a) is type(b) and arg_key(a) == arg_key(b):
            sa = native_specialize_impl(BaseBackend, a, False, True, True)
            sb = native_specialize_impl(BaseBackend, b, False, True, True)
            assert sa[0] == sb[0] and (sa[0] == "constexpr" or sa[1] == sb[1]), (a, b, sa, sb)


def test_keys_tell_apart_what_triton_tells_apart():
    # the ones Triton makes constexpr, aligned and not, 32 and 64 bits
    assert arg_key(1) != arg_key(2) and arg_key(16) != arg_key(17) and arg_key(2 ** 31) != arg_key(2 ** 31 - 16)
    t = torch.zeros(16, dtype=torch.float16)
    assert arg_key(t) != arg_key(t[1:]) and arg_key(t) != arg_key(t.float())


def test_constexprs_are_keyed_by_value_positional_or_not():
    import triton.language as tl

    from ssmq.kernels.launch import FastKernel, fast_launch

    @triton.jit
    def kernel(p, n, B: tl.constexpr, C: tl.constexpr = 2):
        pass

    if INTERPRET:  # the interpreter's functions are launched as they are
        assert fast_launch(kernel) is kernel
        return
    sig = FastKernel(kernel).signature
    t = torch.zeros(16)
    assert sig((t, 16, 64), {}) != sig((t, 16, 128), {})  # both % 16: a runtime int's key, not a constexpr's
    assert sig((t, 16), {"B": 64}) != sig((t, 16), {"B": 128})
    assert sig((t, 16), {"B": 64}) == sig((t, 32), {"B": 64})
    assert sig((t, 16, 64, 2), {}) != sig((t, 16, 64, 4), {})


@pytest.mark.gpu
def test_fast_launch_equals_triton_launch():
    if not torch.cuda.is_available():
        pytest.skip("the launcher path needs CUDA (the interpreter runs Triton's own)")
    import triton.language as tl

    from ssmq.kernels.launch import FastKernel

    @triton.jit
    def scaled_copy(src, dst, n, k, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(dst + o, tl.load(src + o, mask=o < n) * k, mask=o < n)

    fast = FastKernel(scaled_copy)
    src = torch.randn(1000, device="cuda")
    for n, k, off in [(1000, 3, 0), (1000, 3, 0), (999, 1, 0), (999, 1, 0), (37, 16, 1), (37, 16, 1), (500, 2, 3)]:
        dst = torch.zeros(1100, device="cuda")
        s = src[off:]
        fast[(triton.cdiv(n, 128),)](s, dst[off:], n, k, B=128)
        ref = torch.zeros(1100, device="cuda")
        ref[off:off + n] = s[:n] * k
        torch.testing.assert_close(dst, ref, rtol=0, atol=0)
    assert len(fast._cache) == 4  # (1000, 3), (999, 1) with k the constexpr 1, (37, 16) and (500, 2) misaligned
