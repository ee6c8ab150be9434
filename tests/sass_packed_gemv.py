"""packed_gemv's SASS as launched on Mamba2-2.7B's in_proj (10576 x 2560), built for sm_90 on this machine (no GPU):
registers, spills, and the main loop's instructions a code, per row count and code type.

    python tests/sass_packed_gemv.py
"""

from __future__ import annotations

import sys

from ssmq.kernels import packed_gemv as pg
from ssmq.kernels.build import compile_sm90, main_loop, registers

SHOWN = ("LDG", "FFMA", "FADD", "FMUL", "LOP3", "HADD2", "F2FP", "IMAD", "IADD3", "SHF", "PRMT", "SHFL")


def build(rows, bits, group, n=10576, k=2560, cfg=None):
    cfg = {**pg.CFG, **(cfg or {})}
    c = pg._plan(rows, n, k, bits, group, 132, cfg)
    const = dict(BITS=bits, WS_MODE=2 if group else 1, GB=c["GB"], HAS_BIAS=False, SPLIT=c["split"] > 1,
                 SPLIT_IN=cfg["SPLIT_IN_KERNEL"], NSP=pg.pow2(c["split"]), BLOCK_M=c["BLOCK_M"],
                 BLOCK_N=c["BLOCK_N"], NB=c["NB"], USE_GDC=True)
    ptrs = dict(x_ptr="fp16", w_ptr="i32", ws_ptr="fp32", b_ptr="fp32", out_ptr="fp16", part_ptr="fp32",
                cnt_ptr="i32")
    comp = compile_sm90(pg._packed_gemv, ptrs, const, num_warps=c["num_warps"], num_stages=1,
                        aligned=("x_ptr", "w_ptr", "ws_ptr", "s_xm", "s_wn", "out_ptr", "part_ptr", "b_ptr"))
    return comp, c


def main(argv=None):
    print(f"{'case':18s} {'regs':>4s} {'stack':>5s} {'instr':>5s} {'/code':>6s}  " + " ".join(f"{o:>5s}" for o in SHOWN))
    for rows, bits, group in [(1, 4, 128), (2, 4, 128), (4, 4, 128), (1, 8, None), (4, 8, None)]:
        comp, c = build(rows, bits, group)
        regs, stack = registers(comp)
        loop = main_loop(comp)
        total = sum(v for kk, v in loop.items() if kk not in ("NOP", "BRA", "EXIT"))
        codes = c["BLOCK_N"] * c["NB"] * 16 * (32 // bits) / (32 * c["num_warps"])
        print(f"{rows} rows int{bits} g{group or '-':<4} {regs:4d} {stack:5d} {total:5d} {total / codes:6.2f}  "
              + " ".join(f"{loop.get(o, 0):5d}" for o in SHOWN), flush=True)
        if "-v" in (argv or sys.argv[1:]) and rows == 1 and bits == 4:
            from ssmq.kernels.build import loop_instructions
            print("\n".join(loop_instructions(comp)))


if __name__ == "__main__":
    main()
