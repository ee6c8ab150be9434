"""Hadamard matrices of order 2^p * m and the fast normalised transform (the fusion into linears and the
online ``RotatedLinear``: ``ssmq.quant.hadamard``).

Construction (all by formula; every base matrix is checked H @ H.T == n I exactly when built):
    Sylvester   H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]                 orders 2^p
    Paley I     prime q = 3 (mod 4):  order q + 1     (12, 20, 24, 32, 44, 48, 60, 68, 72, 80, 84, ...)
    Paley II    prime q = 1 (mod 4):  order 2 (q + 1)  (12, 28, 36, 60, 76, 84, 108, ...)
Order n = 2^s * b uses the smallest base b (= 2^j * m, m odd, from Paley) and H_n = H_{2^s} (x) H_b
(Kronecker). Examples: 768 = 64 * 12, 1536 = 128 * 12, 2560 = 128 * 20, 5120 = 256 * 20,
3584 = 128 * 28, 8192 = 2^13. Orders whose odd part needs another construction (e.g. m = 23,
order 92, Williamson) are refused with an error.

Convention: ``hadamard_transform(x)`` computes y = x @ H_n.T / sqrt(n) along the last dim, i.e.
y = Q x per vector with Q = H_n / sqrt(n) orthogonal (Q^-1 = Q.T); ``inverse=True`` computes Q.T x
(x @ H_n / sqrt(n)): the same transform where H_n is symmetric (Sylvester, 2^s), the base factor
transposed otherwise (a Paley I base is not symmetric). Cost: O(n log n) for the 2^s part
(butterflies) plus O(n b) for the base part.
"""

from __future__ import annotations

import functools
import math

import torch

from ssmq.errors import SSMQError
from ssmq.ops.quant_linear import quantize_act_ref


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """(q, q) Q[i, j] = chi(j - i) over GF(q), q prime; chi = quadratic character."""
    squares = {(a * a) % q for a in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.int64)
    idx = torch.arange(q)
    return chi[(idx.unsqueeze(0) - idx.unsqueeze(1)) % q]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 for prime q = 3 mod 4: H = I + S, S skew with the Jacobsthal core."""
    Q = _jacobsthal(q)
    S = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    return S + torch.eye(q + 1, dtype=torch.int64)


def _paley2(q: int) -> torch.Tensor:
    """Order 2 (q + 1) for prime q = 1 mod 4: symmetric conference matrix C, entries expanded to 2x2."""
    Q = _jacobsthal(q)
    C = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    C[0, 1:] = 1
    C[1:, 0] = 1
    C[1:, 1:] = Q
    zero_block = torch.tensor([[1, -1], [-1, -1]])
    one_block = torch.tensor([[1, 1], [1, -1]])
    return torch.kron(C, one_block) + torch.kron((C == 0).long(), zero_block)


def _sylvester(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.int64)
    while H.shape[0] < n:
        H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
    return H


def _check(H: torch.Tensor) -> torch.Tensor:
    n = H.shape[0]
    Hd = H.float()  # exact: entries +-1, integer sums below 2^24; float GEMM is fast, int64 is not
    if not torch.equal(Hd @ Hd.T, n * torch.eye(n)):
        raise AssertionError(f"construction of order {n} is not Hadamard")  # a bug, not user error
    return H


@functools.lru_cache(maxsize=None)
def base_matrix(b: int) -> torch.Tensor | None:
    """A Hadamard matrix of order b from Paley I/II (int64), or None if neither applies."""
    if b % 4 == 0 and _is_prime(b - 1) and (b - 1) % 4 == 3:
        return _check(_paley1(b - 1))
    if b % 4 == 0 and _is_prime(b // 2 - 1) and (b // 2 - 1) % 4 == 1:
        return _check(_paley2(b // 2 - 1))
    return None


def split_order(n: int) -> tuple[int, int]:
    """n -> (2^s, b) with n = 2^s * b and b the smallest constructible base (1 for powers of two)."""
    if n < 1:
        raise SSMQError(f"Hadamard order must be positive, got {n}")
    m, two = n, 1
    while m % 2 == 0:
        m, two = m // 2, two * 2
    if m == 1:
        return n, 1
    b = 4 * m  # a Hadamard order > 2 is a multiple of 4
    while b <= n:
        if base_matrix(b) is not None:
            return n // b, b
        b *= 2
    raise SSMQError(
        f"no Hadamard matrix of order {n} = 2^{int(math.log2(two))} * {m}: needs a base of order "
        f"2^j * {m} (j >= 2) from Paley I/II, and none fits; pad the width or use a power of two")


def has_hadamard(n: int) -> bool:
    try:
        split_order(n)
        return True
    except SSMQError:
        return False


@functools.lru_cache(maxsize=16)
def hadamard_matrix(n: int) -> torch.Tensor:
    """(n, n) int64 unnormalised Hadamard matrix, H_{2^s} (x) H_b; H @ H.T == n I."""
    two, b = split_order(n)
    H = _sylvester(two) if b == 1 else torch.kron(_sylvester(two), base_matrix(b))
    return H  # the bases are checked; a Kronecker product of Hadamard matrices is Hadamard


@functools.lru_cache(maxsize=32)
def kron_factors(two: int, b: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """H_n = H_t1 (x) (H_t2 (x) H_b) with t1 * t2 = 2^s, t1 = min(2^s, 64): two small ±1 factors (5120: 64 and 80,
    8192: 64 and 128) instead of one n x n matrix (256 MB at 8192). t1 = 64 was the fastest split on the H100
    (n = 5120, in a CUDA graph: 16 / 13 / 20 µs at batch 1 / 32 / 128 in float32 vs
    39 / 18 / 31 with t1 = 16, whose 16-row GEMM ran on 3 thread blocks)."""
    t1 = min(two, 64)
    right = _sylvester(two // t1)
    if b > 1:
        right = torch.kron(right, base_matrix(b))
    # 1/sqrt(n) folded into the right factor: one launch fewer a call than scaling the product
    return (_sylvester(t1).to(device=device, dtype=dtype),
            (right.to(dtype) / math.sqrt(t1 * right.shape[0])).to(device=device))


def hadamard_transform_gemm(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``hadamard_transform`` (``inverse``: Q.T x) as two GEMMs with the Kronecker factors (what CUDA runs; any device).

    float16 x is transformed in float16 on tensor cores (float32 accumulation; ±1 factors exact, 1/sqrt(n) rounded
    to float16 in the right one): 4.8 / 5.3 / 6.3 µs at batch 1 / 32 / 128 on the H100, max error vs float64 1.8e-3
    against 1.0e-3 for the float32 GEMMs, whose result is rounded to float16 all the same.
    bfloat16 and float32 go through float32 (bfloat16's 8-bit mantissa would scale every output by up to 0.4%).
    """
    two, b = split_order(x.shape[-1])
    work = {torch.float64: torch.float64, torch.float16: torch.float16}.get(x.dtype, torch.float32)
    left, right = kron_factors(two, b, x.device, work)  # left: Sylvester, symmetric; right.T of a Paley base is not
    y = torch.matmul(left, x.to(work).reshape(-1, left.shape[0], right.shape[0])) @ (right if inverse else right.T)
    return y.reshape(x.shape).to(x.dtype)


def hadamard_transform(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x (..., n) -> x @ H_n.T / sqrt(n) (``inverse``: x @ H_n / sqrt(n), which undoes it), same shape and dtype
    (computed in float32 or float64).

    On CPU: butterflies (the reference). On CUDA: two GEMMs with the Kronecker factors, y = H_t1 X M^T for X = x
    as (t1, n / t1): the butterflies are ~3 launches a level (add, sub, stack), 25+ a call at n = 5120, which made a
    Quamba2 decode step launch-bound (6.9 ms a token vs FP16's 2.9 on an H100). Same transform; the sums are
    only associated differently (float32: relative differences ~1e-7).
    """
    if x.is_cuda:
        return hadamard_transform_gemm(x, inverse)
    n = x.shape[-1]
    two, b = split_order(n)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work).reshape(*x.shape[:-1], two, b)  # (..., 2^s, b): row-major, so H_2^s (x) H_b
    if b > 1:  # the butterflies below are their own transpose; only the base factor knows the direction
        base = base_matrix(b).to(device=x.device, dtype=work)
        y = y @ (base if inverse else base.T)
    lead = y.shape[:-2]
    h = 1
    while h < two:  # butterflies over the 2^s axis: pairs (i, i + h) inside blocks of 2h
        y = y.reshape(*lead, two // (2 * h), 2, h, b)
        y = torch.stack((y[..., 0, :, :] + y[..., 1, :, :], y[..., 0, :, :] - y[..., 1, :, :]), dim=-3)
        h *= 2
    return (y.reshape(x.shape) / math.sqrt(n)).to(x.dtype)


def hadamard_quant_ref(x: torch.Tensor, x_scale: torch.Tensor | None = None, per_token: bool = True,
                       with_y: bool = False):
    """The online Hadamard of an A8 linear's input and its quantization: ``quantize_act_ref(hadamard_transform(x),
    x_scale, per_token)`` -> (codes (..., n) int8, scale () or (...)), and with ``with_y`` the rotated x too. The
    rotated input is rounded to x's dtype before it is quantized, as the unfused pair does (the Triton twin too:
    its transform is the two-GEMM form that CUDA runs unfused)."""
    y = hadamard_transform(x)
    q, scale = quantize_act_ref(y, x_scale, per_token)
    return (q, scale, y) if with_y else (q, scale)
