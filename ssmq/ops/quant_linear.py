"""The quantized linear op: exact CPU references of every low-bit GEMM / GEMV ssmq runs.

One op for every quantized linear layer; the weight format is read off the tensors:

    w_q      int8 (n, k)            int8 codes (W8*)
             uint8 (n, k // 2)      int4 codes, two per byte (``pack_int4``: low nibble = even column)
             float8_e4m3fn (n, k)   fp8 codes
    w_scale  float32 () per-tensor, (n,) per-channel, (n, k // g) per-group (g = k // w_scale.shape[1])
    w_zero   int32, w_scale's shape, or None (symmetric); codes dequantize as (q - zero) * scale

and the activation format off x:

    x float (m, k)          weight-only (W8A16, W4A16, FP8 weight-only): y = x @ dequant(W).T in x's dtype
    x int8 (m, k)           W8A8 / W4A8: exact int32 accumulation, float32 epilogue (``int_matmul_ref``);
                            x_scale float32 () per-tensor or (m,) per-token
    x float8_e4m3fn (m, k)  FP8 W8A8: float32 GEMM of the dequantized operands; x_scale () or (m,)

``quantize_act_ref`` makes (x_q, x_scale) from a float activation: a static per-tensor scale, or
dynamic absmax per token / per tensor; it equals ``ssmq.quant.primitives.quantize`` with the
parameters of ``choose_qparams`` bit for bit.

Glossary: m rows of x (tokens), k in_features, n out_features, g group size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmq.errors import SSMQError

EPS = 1e-8  # smallest scale (as ssmq.quant.primitives.EPS): an all-zero row quantizes to zeros
FP8_MAX = 448.0


def absmax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The symmetric scale amax / qmax (float32, >= EPS) of any shape, as every quantizer computes it.

    The divisor is a tensor: CUDA torch turns division by a Python number into a multiplication by its reciprocal,
    which differs from IEEE division in the last bit (the kernels divide exactly); ``full_like``, not
    ``new_tensor``, so that no host-to-device copy breaks a CUDA graph's capture (dynamic scales under TP).
    """
    amax = amax.float()
    return (amax / torch.full_like(amax, qmax)).clamp(min=EPS)


def given_act_scale(x_scale: torch.Tensor, lead: torch.Size, per_token: bool) -> tuple[torch.Tensor, bool]:
    """A given activation scale as float32 and whether it is one a row: () per tensor, or with ``per_token`` the
    rows' shape ``lead`` (a dynamic scale computed elsewhere, e.g. the max over tensor-parallel ranks)."""
    if per_token and x_scale.dim() and x_scale.shape == lead:
        return x_scale.float(), True
    if x_scale.numel() != 1:
        raise SSMQError(f"a given activation scale is per-tensor () or, per token, {tuple(lead)}; "
                        f"got shape {tuple(x_scale.shape)}")
    return x_scale.float().reshape(()), False


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 codes (..., k) int8 in [-8, 7], k even -> uint8 (..., k // 2).

    Layout: byte j holds element 2j in its LOW nibble and element 2j+1 in its HIGH
    nibble, each as 4-bit two's complement (e.g. [-1, 2] -> 0x2F).
    """
    if q.shape[-1] % 2:
        raise SSMQError(f"int4 packing needs an even last dim, got {q.shape[-1]}")
    u = q.to(torch.int16) & 0xF  # two's complement nibble
    return (u[..., 0::2] | (u[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 (..., k // 2) -> int8 (..., k) in [-8, 7]."""
    b = p.to(torch.int16)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # (..., k): low, high, low, ...
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


BLOCK_WORDS = 16  # int32 words of one interleave block of a row in ``pack_words`` (128 int4 or 64 int8 codes)


def pack_words(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (n, k) int8 (int4 codes in [-8, 7]) -> int32 (n, k * bits // 32): the decode GEMV's layout.

    Row by row, k is cut in blocks of 16 words (16 * 32 // bits codes). Code c of a block sits in word c % 16 of it,
    in slot c // 16 (bits [slot * bits, +bits) of the word), as offset binary (q + 2^(bits - 1), 0 .. 2^bits - 1).
    So one 16-byte load of 4 words holds, in each slot, 4 consecutive codes whose x is one 8-byte run, and a code
    becomes a float by masking its slot under a float's exponent (no sign fix-up). k must be a whole number of
    blocks. The stored checkpoint layout (``pack_int4`` / int8 rows) is untouched: this is a copy made at decode
    set-up (``unpack_words`` inverts it exactly).
    """
    if bits not in (4, 8) or q.dim() != 2:
        raise SSMQError(f"pack_words takes (n, k) int4 or int8 codes, got {bits} bits, shape {tuple(q.shape)}")
    n, k = q.shape
    wpw = 32 // bits
    block = BLOCK_WORDS * wpw
    if k % block:
        raise SSMQError(f"pack_words needs k a multiple of {block} for {bits}-bit codes, got {k}")
    u = (q.to(torch.int64) + (1 << (bits - 1))).reshape(n, k // block, wpw, BLOCK_WORDS)  # [row, block, slot, word]
    shifts = (torch.arange(wpw, device=q.device) * bits).reshape(1, 1, wpw, 1)
    words = (u << shifts).sum(2)  # disjoint bit fields: the sum is their OR, < 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).reshape(n, -1)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_words``: int32 (n, k * bits // 32) -> int8 codes (n, k)."""
    n, kw = words.shape
    wpw = 32 // bits
    w = (words.to(torch.int64) & 0xFFFFFFFF).reshape(n, kw // BLOCK_WORDS, 1, BLOCK_WORDS)
    shifts = (torch.arange(wpw, device=words.device) * bits).reshape(1, 1, wpw, 1)
    u = (w >> shifts) & ((1 << bits) - 1)  # [row, block, slot, word]
    return (u - (1 << (bits - 1))).to(torch.int8).reshape(n, kw * wpw)


def words_linear_ref(x: torch.Tensor, words: torch.Tensor, bits: int, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``quant_linear_ref`` of float x (..., k) on symmetric codes in ``pack_words``' layout (n, k * bits // 32):
    the function of the stored weight the words were packed from, the same values."""
    q = unpack_words(words, bits)
    return quant_linear_ref(x, pack_int4(q) if bits == 4 else q, w_scale, None, None, bias, out_dtype)


def int_matmul_ref(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact integer GEMM: the result every W8A8 / W4A8 GPU kernel must reproduce bit for bit.

    a_q: (m, k) int8 activation codes (symmetric); a_scale: () per-tensor or (m,) per-token.
    w_q: (n, k) int8 codes (int8 or unpacked int4, symmetric); w_scale: () per-tensor,
    (n,) per-channel, or (n, k // group_size) per-group.
    bias: (n,) or None. Returns (m, n) float32.

    Semantics (the bit-exact contract):
      1. acc = sum_j a_q[i, j] * w_q[o, j], exact (as in int32: |acc| < 2^31 for k < 2^17);
         per group when ``group_size`` is set: acc_t over columns [t*g, (t+1)*g).
      2. epilogue in float32, in this order: s = a_scale[i] * w_scale[o] (or w_scale[o, t]);
         out = float32(acc) * s, and per-group: out = 0; out += float32(acc_t) * s_t for t = 0, 1, ...
         (each product rounded before the sum: kernels must not contract it into an FMA)
      3. out += bias (float32), if any.
    """
    if a_q.dtype != torch.int8 or w_q.dtype != torch.int8:
        raise SSMQError(f"int_matmul_ref takes int8 codes, got {a_q.dtype} and {w_q.dtype}")
    m, k = a_q.shape
    n = w_q.shape[0]
    if group_size is not None and k % group_size:
        raise SSMQError(f"group size {group_size} does not divide k = {k}")
    # Float GEMMs give the exact integers: every product and partial sum is an integer of magnitude at most
    # 128 * 128 * (columns summed), which float32 holds exactly up to 2^24 (<= 1024 columns a sum: a group, or all
    # of k) and float64 up to 2^53, whatever the order or FMA contraction of the sums. (An int32 GEMM, CPU-only in
    # torch, gives the same values with no BLAS behind it: 20-30x slower on the CPU.) float32 only where its GEMM is
    # IEEE float32: on the CPU at the "highest" matmul precision (CUDA may run float32 GEMMs in TF32)
    small = (group_size or k) * 128 * 128 <= 1 << 24
    ieee32 = not a_q.is_cuda and torch.get_float32_matmul_precision() == "highest"
    acc_dtype = torch.float32 if small and ieee32 else torch.float64
    w32 = w_q.to(acc_dtype)
    a_s = a_scale.float().reshape(-1, 1) if a_scale.numel() > 1 else a_scale.float().reshape(1, 1)  # (m|1, 1)
    if group_size is None:  # (1, n|1)
        w_s = w_scale.float().reshape(1, -1) if w_scale.numel() > 1 else w_scale.float().reshape(1, 1)
    else:  # (groups, 1, n)
        w_s = w_scale.float().T.reshape(k // group_size, 1, n)
    out = torch.empty(m, n, dtype=torch.float32, device=a_q.device)
    # rows a block: the epilogue's (rows, n) temporaries stay ~256 MB each (an lm_head of 50K columns over 32K
    # tokens would hold four of 6.6 GB); every element's arithmetic is the same, so the blocks change no bit
    rows = max(1, (1 << 26) // max(n, 1))
    for r in range(0, m, rows):
        a32 = a_q[r:r + rows].to(acc_dtype)
        s_a = a_s[r:r + rows] if a_s.shape[0] > 1 else a_s
        if group_size is None:
            out[r:r + rows] = (a32 @ w32.T).float() * (s_a * w_s)
        else:
            block = out[r:r + rows].zero_()
            for t in range(k // group_size):
                cols = slice(t * group_size, (t + 1) * group_size)
                acc = a32[:, cols] @ w32[:, cols].T  # (rows, n) integers
                block += acc.float() * (s_a * w_s[t])
    if bias is not None:
        out += bias.float()
    return out


def weight_format(w_q: torch.Tensor, w_scale: torch.Tensor, w_zero: torch.Tensor | None = None) -> dict:
    """{"bits": 4 | 8, "fp8": bool, "n", "k", "group_size": g or None}; one-line errors on bad shapes."""
    if w_q.dim() != 2:
        raise SSMQError(f"quantized weight must be 2-D (n, k), got shape {tuple(w_q.shape)}")
    if w_q.dtype == torch.uint8:
        bits, fp8, n, k = 4, False, w_q.shape[0], 2 * w_q.shape[1]
    elif w_q.dtype in (torch.int8, torch.float8_e4m3fn):
        bits, fp8, (n, k) = 8, w_q.dtype == torch.float8_e4m3fn, w_q.shape
    else:
        raise SSMQError(f"quantized weight codes must be int8, uint8 (packed int4) or float8_e4m3fn, got {w_q.dtype}")
    if w_scale.dtype != torch.float32:
        raise SSMQError(f"weight scales must be float32, got {w_scale.dtype}")
    group = None
    if w_scale.dim() == 2:
        if w_scale.shape[0] != n or w_scale.shape[1] == 0 or k % w_scale.shape[1]:
            raise SSMQError(f"per-group weight scales {tuple(w_scale.shape)} do not fit a ({n}, {k}) weight")
        group = k // w_scale.shape[1]
    elif w_scale.shape not in ((), (n,)):
        raise SSMQError(f"weight scales {tuple(w_scale.shape)} fit neither per-tensor (), per-channel ({n},) "
                        f"nor per-group ({n}, k // g)")
    if w_zero is not None and (w_zero.shape != w_scale.shape or w_zero.dtype != torch.int32):
        raise SSMQError(f"weight zero points must be int32 shaped like the scales {tuple(w_scale.shape)}, "
                        f"got {w_zero.dtype} {tuple(w_zero.shape)}")
    if w_zero is not None and fp8:
        raise SSMQError("fp8 weights are symmetric: no zero points")
    return {"bits": bits, "fp8": fp8, "n": n, "k": k, "group_size": group}


def code_type(f: dict) -> str:
    """A ``weight_format``'s code type as the kernels' tables name it: "int4", "int8" or "fp8"."""
    return "fp8" if f["fp8"] else f"int{f['bits']}"


def weight_codes(w_q: torch.Tensor) -> torch.Tensor:
    """(n, k) codes: int8 for int8 and int4 (unpacked), float8_e4m3fn for fp8."""
    return unpack_int4(w_q) if w_q.dtype == torch.uint8 else w_q


def dequantize_weight(w_q: torch.Tensor, w_scale: torch.Tensor, w_zero: torch.Tensor | None = None) -> torch.Tensor:
    """(n, k) float32: (q - zero) * scale, per-tensor / per-channel / per-group as the scale's shape says."""
    f = weight_format(w_q, w_scale, w_zero)
    y = weight_codes(w_q).float()

    def expand(p):
        if p.dim() == 2:
            return p.repeat_interleave(f["group_size"], dim=1)
        return p.reshape(-1, 1) if p.dim() == 1 else p.reshape(())

    if w_zero is not None:
        y = y - expand(w_zero).float()
    return y * expand(w_scale)


def quant_linear_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    words: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T + bias for a quantized W (format: module docstring).

    x: (..., k) float, int8 or float8_e4m3fn; x_scale: () or x.shape[:-1] float32 for int8 / fp8 x.
    bias: (n,) or None. Returns (..., n) in ``out_dtype`` (default: x's dtype for float x, float32 else).
    words: the same codes repacked for the decode GEMV (``pack_words``) or None; the reference reads ``w_q``.
    """
    f = weight_format(w_q, w_scale, w_zero)
    k, n = f["k"], f["n"]
    if x.shape[-1] != k:
        raise SSMQError(f"x has {x.shape[-1]} features, the quantized weight has {k}")
    if bias is not None and bias.shape != (n,):
        raise SSMQError(f"bias must be ({n},), got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x.dtype in (torch.int8, torch.float8_e4m3fn):
        if x_scale is None:
            raise SSMQError(f"{x.dtype} activations need their x_scale")
        if x_scale.numel() != 1 and x_scale.shape != lead:
            raise SSMQError(f"x_scale must be () or {tuple(lead)}, got {tuple(x_scale.shape)}")
        xs = x_scale.reshape(()) if x_scale.numel() == 1 and x_scale.dim() == 0 else x_scale.reshape(-1)
        if x.dtype == torch.int8:
            if f["fp8"] or w_zero is not None:
                raise SSMQError("int8 activations need symmetric int8 / int4 weights")
            out = int_matmul_ref(x2, xs, weight_codes(w_q), w_scale, f["group_size"], bias)
        else:
            if not f["fp8"]:
                raise SSMQError("fp8 activations need fp8 weights")
            xf = x2.float() * (xs.reshape(-1, 1) if xs.dim() else xs)
            out = F.linear(xf, dequantize_weight(w_q, w_scale), None if bias is None else bias.float())
        out_dtype = out_dtype or torch.float32
    else:
        if not x.is_floating_point():
            raise SSMQError(f"activations must be float, int8 or float8_e4m3fn, got {x.dtype}")
        w = dequantize_weight(w_q, w_scale, w_zero).to(x.dtype)
        out = F.linear(x2, w, None if bias is None else bias.to(x.dtype))
        out_dtype = out_dtype or x.dtype
    return out.to(out_dtype).reshape(*lead, n)


def quantize_act_ref(
    x: torch.Tensor, x_scale: torch.Tensor | None = None, per_token: bool = True, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric activation quantization: x (..., k) float -> (codes (..., k) ``dtype``, scale float32).

    x_scale given: a per-tensor scale (), or with ``per_token`` one a row (x.shape[:-1]: a dynamic scale computed
    elsewhere, e.g. the max over tensor-parallel ranks), returned as is (float32). Else dynamic: scale = absmax /
    qmax (at least EPS) per token (shape x.shape[:-1]) or per tensor (()). int8: round half to even of the IEEE
    float32 quotient, clamped to [-128, 127]; float8_e4m3fn: the quotient clamped to ±448, cast.
    """
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        raise SSMQError(f"activation codes are int8 or float8_e4m3fn, not {dtype}")
    qmax = 127.0 if dtype == torch.int8 else FP8_MAX
    xf = x.float()
    if x_scale is None:
        x_scale = absmax_scale(xf.abs().amax(-1) if per_token else xf.abs().amax(), qmax)
        s = x_scale.unsqueeze(-1) if per_token else x_scale
    else:
        x_scale, rows = given_act_scale(x_scale, x.shape[:-1], per_token)
        s = x_scale.unsqueeze(-1) if rows else x_scale
    y = xf / s
    if dtype == torch.int8:
        return torch.round(y).clamp(-128, 127).to(torch.int8), x_scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), x_scale


def quantize_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any) float, scale broadcastable against x -> int8 codes (the primitives' rounding: IEEE division, half to even)."""
    return torch.round(x / scale.float()).clamp(-128, 127).to(torch.int8)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


def fake_quantize_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., d) float, scale () or (d,) -> dequantize(quantize(x)) in x's dtype (an ``ActQuantizer``'s output)."""
    return dequantize_ref(quantize_ref(x.float(), scale), scale).to(x.dtype)


def quant_linear_act_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    per_token: bool = True,
    act_dtype: torch.dtype = torch.int8,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A W8A8 / W4A8 / FP8 linear on a float activation: ``quantize_act_ref`` then ``quant_linear_ref``.

    x: (..., k) float; x_scale: a static () scale, or None for dynamic (per token or per tensor); act_dtype:
    int8 or float8_e4m3fn codes. Returns (..., n) in ``out_dtype`` (default x's dtype). One op, so that a
    kernel can quantize x inside the GEMM instead of in a kernel of its own.
    """
    x_q, xs = quantize_act_ref(x, x_scale, per_token, act_dtype)
    return quant_linear_ref(x_q, w_q, w_scale, None, xs, bias, out_dtype or x.dtype)

