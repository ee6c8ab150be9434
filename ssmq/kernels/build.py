"""Building a Triton kernel for a GPU this machine does not have: the sm_90 (H100 / H200) cubin from Triton's NVIDIA
backend and its bundled ptxas, and the SASS of it from the bundled cuobjdump. The compile tests check what only the
compiler refuses before a GPU run is spent; ``tests/sass_kv_decode.py`` counts a kernel's loop
instructions. No GPU and no CUDA driver needed."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton


def compile_sm90(kernel, pointers: dict, const: dict, floats=(), num_warps: int = 4, num_stages: int = 3,
                 aligned=(), maxnreg: int | None = None, fp_fusion: bool = True):
    """Compile one ``@triton.jit`` kernel for sm_90 (returned; ``.asm`` holds ttgir / ptx / cubin, ``.metadata``
    the shared memory): pointers {arg: "fp16" | "i8" | ...}, const {arg: value}, the other arguments i32 (those named
    in ``floats`` fp32; ``const`` may also fix a run-time argument, as the launcher specializes one equal to 1);
    ``aligned``: arguments given as multiples of 16 (addresses in bytes), as the launcher's
    specialization marks them at run time (vector loads and atomics depend on it); ``maxnreg``: a register cap;
    ``fp_fusion``: the launch's ``enable_fp_fusion``.
    Raises what Triton raises (no ptxas: FileNotFoundError or a RuntimeError naming it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = (set(pointers) | set(const) | set(floats) | set(aligned)) - set(kernel.arg_names)
    assert not missing, f"kernel arguments renamed: {missing}"
    signature = {a: "constexpr" if a in const else "*" + pointers[a] if a in pointers else "fp32" if a in floats
                 else "i32" for a in kernel.arg_names}
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel (explicit layouts): its own front end
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(kernel, signature, constexprs={(kernel.arg_names.index(a),): v for a, v in const.items()},
                 attrs={(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion,
               **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(compiled, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def registers(compiled) -> tuple[int, int]:
    """(registers a thread, bytes of stack a thread: spills) of a compiled kernel, from its resource usage."""
    usage = _cuobjdump(compiled, "-res-usage")
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_BRANCH = re.compile(r"BRA\s.*?0x([0-9a-f]+)")
_LINE_OP = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_BRANCH_TARGET = re.compile(r"BRA\s.*$")


def loop_instructions(compiled) -> list[str]:
    """The SASS instructions of a kernel's main loop (the body of its widest backward branch), in order, without
    their addresses, encodings or branch targets (so two builds' loops compare as code)."""
    lines = [(int(m.group(1), 16), m.group(2), line) for line in _cuobjdump(compiled, "-sass").splitlines()
             if (m := _LINE.match(line))]
    widest = None
    for i, (addr, _, line) in enumerate(lines):
        b = _BRANCH.search(line)
        if b and int(b.group(1), 16) < addr and (widest is None or addr - int(b.group(1), 16) > widest[0]):
            widest = (addr - int(b.group(1), 16), int(b.group(1), 16), i)
    assert widest, "no loop in this kernel"
    start = next(i for i, (addr, _, _) in enumerate(lines) if addr >= widest[1])
    code = [re.sub(r"/\*[0-9a-f]+\*/|;.*", "", line).strip() for _, _, line in lines[start:widest[2] + 1]]
    return [_BRANCH_TARGET.sub("BRA", c) for c in code]


def main_loop(compiled) -> collections.Counter:
    """The SASS opcodes of a kernel's main loop (``loop_instructions``), counted: a thread's instructions an
    iteration, by opcode (HMMA, PRMT, BAR, ...)."""
    return collections.Counter(_LINE_OP.match(line).group(1) for line in loop_instructions(compiled))
