"""The KV decode kernel's PRMT codebook lookups (inline PTX in ``ssmq.kernels.kv_decode``: ``_LUT4`` / ``_LUT3`` /
``_LUT2``) give codebook[code] for every code, checked on CPU by an emulation of the few PTX instructions they use
(the interpreter cannot run PTX; the GPU tests check them end to end)."""

import random
import re

import numpy as np
import pytest

M32 = 0xFFFFFFFF


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result = byte (sel nibble i & 7) of {b, a}; nibble bit 3 replicates
    that byte's sign bit."""
    src = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
    out = 0
    for i in range(4):
        n = (sel >> 4 * i) & 15
        x = src[n & 7]
        if n & 8:
            x = 255 if x & 128 else 0
        out |= x << 8 * i
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(((lut >> ((((a >> k) & 1) << 2) | (((b >> k) & 1) << 1) | ((c >> k) & 1))) & 1) << k for k in range(32))


def run(asm: str, regs: dict) -> dict:
    """Execute the lookups' PTX subset on ``regs`` (operand names to ints)."""
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":  # {lo, hi}, r: split into 16-bit halves
            lo, hi, r = re.match(r"\{(\S+), (\S+)\}, (\S+)", rest).groups()
            regs[lo], regs[hi] = regs[r] & 0xFFFF, regs[r] >> 16
            continue
        d, *args = [x.strip() for x in rest.split(",")]
        v = [regs[x] if x in regs else int(x, 0) for x in args]
        regs[d] = {"and.b32": lambda: v[0] & v[1], "shr.u32": lambda: v[0] >> v[1],
                   "shl.b32": lambda: (v[0] << v[1]) & M32, "lop3.b32": lambda: lop3(*v),
                   "prmt.b32": lambda: prmt(*v), "mad.lo.u32": lambda: (v[0] * v[1] + v[2]) & M32}[op]()
    return regs


def fp16_bits(x: float) -> int:
    return int(np.array(x, np.float16).view(np.uint16))


def byte_tables(e: list[int]) -> list[int]:
    """``_lut_words``' tables for 3 and 4 bits: low bytes of entries 4k..4k+3, then their high bytes."""
    n = len(e) // 4
    lo = [sum((e[4 * k + i] & 255) << 8 * i for i in range(4)) for k in range(n)]
    return lo + [sum((e[4 * k + i] >> 8) << 8 * i for i in range(4)) for k in range(n)]


@pytest.fixture(scope="module")
def kd():
    pytest.importorskip("triton")
    from ssmq.kernels import kv_decode

    return kv_decode


def asm(kd, name: str) -> str:
    x = getattr(kd, name)
    return getattr(x, "value", x)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_prmt_lookups_return_the_codebook_entry_of_every_code(kd, bits):
    rng = random.Random(bits)
    for _ in range(100):
        e = [fp16_bits(v) for v in sorted(rng.uniform(-1, 1) for _ in range(2 ** bits))]
        if bits == 4:  # pack=4: 4 bytes in $4 → low nibbles' values ($0, $1), high nibbles' ($2, $3)
            w = rng.getrandbits(32)
            regs = run(asm(kd, "_LUT4"), {"$4": w, **{f"${5 + 4 * k}": t for k, t in enumerate(byte_tables(e))}})
            got = [regs[f"${r}"] >> s & 0xFFFF for r in range(4) for s in (0, 16)]
            byte = [(w >> 8 * k) & 255 for k in range(4)]
            assert got == [e[b & 15] for b in byte] + [e[b >> 4] for b in byte]
        elif bits == 3:  # pack=1: one 24-bit group of 8 codes in $8 → 8 float16 values ($0 .. $7)
            w = rng.getrandbits(24)
            t = byte_tables(e)
            regs = run(asm(kd, "_LUT3"), {"$8": w, "$9": t[0], "$10": t[1], "$11": t[2], "$12": t[3]})
            assert [regs[f"${i}"] for i in range(8)] == [e[(w >> 3 * i) & 7] for i in range(8)]
        else:  # pack=4: 4 bytes in $8 → bits 2i..2i+1 of each byte's value ($2i, $2i+1)
            w = rng.getrandbits(32)
            regs = run(asm(kd, "_LUT2"), {"$8": w, "$9": e[0] | e[1] << 16, "$13": e[2] | e[3] << 16})
            for i in range(4):
                got = [regs[f"${2 * i + r}"] >> s & 0xFFFF for r in range(2) for s in (0, 16)]
                assert got == [e[((w >> 8 * k) >> 2 * i) & 3] for k in range(4)]
