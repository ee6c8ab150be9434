"""The persistent in_proj -> out_proj chain (``ssmq.prototype.persistent_gemv``) against the same chain as
``packed_gemv`` launches: Mamba2-2.7B's W4 g128 shapes, one row, 8 layers' weights (170 MB, past the L2), CUDA
graphs, the copy bandwidth measured in the same run.

    python benchmarks/persistent_chain.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from ssmq.bench.output import provenance
from ssmq.bench.timing import copy_bandwidth, graph_us
from ssmq.kernels import policy
from ssmq.kernels._common import sm_count
from ssmq.kernels.packed_gemv import packed_gemv
from ssmq.ops.quant_linear import pack_words
from ssmq.prototype.persistent_gemv import Chain, resident_programs

L, D, D_IN, N_IN = 8, 2560, 5120, 10576  # layers; Mamba2-2.7B: d_model, d_inner, in_proj's outputs
VARIANTS = ((1, 4), (4, 4), (4, 8), (8, 8))  # (tiles a request, warps a program)


def _layers(dev, n, k):
    """L layers' words and scales: codes in [-7, 7] (zero mean: 8 chained layers neither grow nor vanish)."""
    words = torch.stack([pack_words(torch.randint(-7, 8, (n, k), device=dev, dtype=torch.int8), 4) for _ in range(L)])
    return words, torch.full((L, n, k // 128), 1 / (4.3 * k ** 0.5), device=dev)


def _us_a_layer(fn) -> float:
    """GPU time of ``fn`` (one chain of L layers) from a CUDA graph, µs a layer: the median of 7 timings of 50
    replays (``bench.timing.graph_us``)."""
    return graph_us([fn], reps=50, timings=7) / L


def main(out: str) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w1, s1 = _layers(dev, N_IN, D)
    w2, s2 = _layers(dev, D, D_IN)
    x0 = torch.randn(1, D, device=dev, dtype=torch.float16)
    mb = (w1[0].numel() + w2[0].numel() + s1[0].numel() + s2[0].numel()) * 4 / 1e6
    gbps = copy_bandwidth(dev) / 1e9

    def launches(x):
        for layer in range(L):
            x = packed_gemv(packed_gemv(x, w1[layer], s1[layer], 4)[:, :D_IN], w2[layer], s2[layer], 4)
        return x

    ref = launches(x0.clone())[0].float()
    xb = x0.clone()
    rows = [["packed_gemv launches, PDL", "-", "-", "-", f"{_us_a_layer(lambda: launches(xb)):.2f}", "-", "-"]]
    with policy.using(policy.active().with_changes(pdl=False)):
        rows.append(["packed_gemv launches, no PDL", "-", "-", "-", f"{_us_a_layer(lambda: launches(xb)):.2f}",
                     "-", "-"])

    def save(rows):
        doc = {
            "title": "A persistent W4 GEMV chain (in_proj -> out_proj, grid barriers) against separate GEMV launches",
            "capability": "kernels",
            "command": "python benchmarks/persistent_chain.py OUT.json",
            **provenance(dev),
            "setup": f"Mamba2-2.7B's in_proj (10576 x 2560) then out_proj (2560 x 5120, reading the first 5120 of "
                     f"in_proj's outputs), int4 codes in groups of 128 in packed_gemv's layout, one row, {L} layers' "
                     f"weights ({mb:.1f} MB a layer, {L * mb:.0f} MB in all: past the L2) in one CUDA graph. Bytes' "
                     f"time a layer at the copy bandwidth measured in the same run ({gbps:.0f} GB/s): "
                     f"{mb / gbps * 1e3:.2f} us. The persistent kernel (ssmq.prototype.persistent_gemv) runs all {L} "
                     f"layers in one launch, two grid barriers a layer, 1 to 3 programs an SM (as many as fit); "
                     f"'1 tile a request': the next tile in flight while one is computed (packed_gemv's loop); 4 or "
                     f"8: an item's whole K run (at most that many tiles) requested at once, the next GEMV's before "
                     f"the barrier; 'no barrier' drops the barriers (a wrong result: the "
                     f"weight streams alone); barrier us = the difference over the two. rel. error: against the "
                     f"launches' result (float16 rounding between layers). A row's time is the median of 7 timings of "
                     f"50 replays.",
            "columns": ["chain", "programs", "K split in / out", "barrier us", "us a layer", "no barrier us a layer",
                        "rel. error"],
            "rows": rows,
        }
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        return doc

    sms = sm_count(dev)
    for tiles, warps in VARIANTS:
        probe = Chain(w1, s1, w2, s2, 1, tiles, warps)
        compiled = probe(x0[0].clone())
        getattr(compiled, "_init_handles", lambda: None)()
        cap = min(resident_programs(compiled, dev, warps), 3 * sms)
        for P in range(sms, cap + 1, sms):
            c = Chain(w1, s1, w2, s2, P, tiles, warps)
            xc = x0[0].clone()
            c(xc)
            err = ((xc.float() - ref).norm() / ref.norm()).item()
            us = _us_a_layer(lambda: c(xc))
            bare = _us_a_layer(lambda: c(xc, sync=False))
            rows.append([f"persistent, {tiles} tile{'s' if tiles > 1 else ''} a request, {warps} warps", str(P),
                         f"{c.sp1} / {c.sp2}", f"{(us - bare) / 2:.2f}", f"{us:.2f}", f"{bare:.2f}", f"{err:.1e}"])
            print(rows[-1], flush=True)
            save(rows)  # a row at a time: a hung launch leaves the rows before it
    print(json.dumps(save(rows), indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
