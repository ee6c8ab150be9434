"""Host side of an eager prefill without a GPU: the Python that a CUDA forward runs, with every Triton launch and
cuBLAS call stubbed (counted, not run), per recipe. What it shows is the launches a layer and the host's Python time
around them, the part of an eager ``model(ids)`` that ``benchmarks/eager_prefill.py`` finds sets the time at 1024
tokens; the driver's own launch cost is not in it.

    python benchmarks/eager_host_proxy.py --recipes float,rtn-w4a16-g128,fp8-w8a8,quamba2-w4a8 --out FILE

A narrow Mamba-2 (d_model 256, 8 layers, float16 weights) on 1024 tokens (the rows select the kernels), quantized on
the CPU (round to nearest in place of GPTQ), then run with CUDA's dispatch: ``kernels.dispatch`` takes the Triton
paths, the online Hadamard its two-GEMM form, and F.linear, torch._scaled_mm, torch._int_mm and torch.matmul return
empty outputs of their shape (so does a tensor's @). The outputs are garbage; only the host's work is measured: the
fastest of 30 forwards, a layer (the one least disturbed by other work on the machine). Process-wide patches: run it
alone.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from ssmq.bench.models import build
from ssmq.models.published import mamba2

LAYERS, TOKENS, VOCAB = 8, 1024, 512


def stub_the_gpu(launches: list) -> None:
    """CUDA's code path on CPU tensors, every launch counted in ``launches`` and none run."""
    import triton.runtime.jit as jit

    import ssmq.ops.hadamard as hadamard
    import ssmq.ops.norm as norm
    import ssmq.quant.hadamard as quant_hadamard
    import ssmq.quant.linear as quant_linear
    from ssmq.kernels import dispatch

    def launch(self, *args, grid=None, warmup=False, **kwargs):
        launches[0] += 1

    jit.JITFunction.run = launch
    F.linear = lambda x, w, b=None: x.new_empty(*x.shape[:-1], w.shape[0])
    torch._scaled_mm = lambda a, b, scale_a=None, scale_b=None, out_dtype=None, **kw: a.new_empty(
        a.shape[0], b.shape[1], dtype=out_dtype)
    torch._int_mm = lambda a, b: a.new_empty(a.shape[0], b.shape[1], dtype=torch.int32)
    torch.matmul = lambda a, b: a.new_empty(*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2],
                                            b.shape[-1])
    torch.Tensor.__matmul__ = lambda a, b: torch.matmul(a, b)  # the online Hadamard's second product is an @
    dispatch._use_triton = lambda t: True
    for module in (hadamard, norm, quant_hadamard, quant_linear):
        module.hadamard_transform = hadamard.hadamard_transform_gemm  # what CUDA tensors run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="float,rtn-w4a16-g128,fp8-w8a8,quamba2-w4a8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    cfg = mamba2(256, LAYERS, vocab_size=VOCAB)
    # quantized before the stubs: calibration runs for real
    models = {r: build(cfg, r, torch.device("cpu"), torch.float16, gptq_as_rtn=True, calib_samples=2,
                       calib_seqlen=TOKENS)[0] for r in args.recipes.split(",")}
    launches = [0]
    stub_the_gpu(launches)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    rows = []
    for recipe, model in models.items():
        with torch.inference_mode():
            for _ in range(3):
                model(ids)
            launches[0] = 0
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                model(ids)
                times.append(time.perf_counter() - t)
        rows.append({"recipe": recipe, "host_us_a_layer": min(times) * 1e6 / LAYERS,
                     "launches_a_layer": launches[0] / args.reps / LAYERS})
        print(f"{recipe:>16}: {rows[-1]['host_us_a_layer']:6.0f} us a layer, "
              f"{rows[-1]['launches_a_layer']:.1f} Triton launches a layer", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
