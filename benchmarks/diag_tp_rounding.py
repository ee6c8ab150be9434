"""Why a quantized model's TP=4 logits differ from one GPU's (tiny Mamba-2, quamba2-w8a8, int8 state).

    python benchmarks/diag_tp_rounding.py codes     # out_proj's int8 input codes, call by call: where they differ,
                                                    # how far the TP value / scale lies from the rounding boundary
    python benchmarks/diag_tp_rounding.py bisect    # each group of ops forced to its torch reference in both runs

Both runs go through ``tests/_tp_harness.run_ranks``: on a GPU machine every rank on GPU 0 ("cuda:shared", gloo),
the kernels at a 4-way shard's shapes; on CPU the references (where nothing differs).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tp import SHARDED_NORM_KERNELS  # noqa: E402

GROUPS = {  # ssmq.kernels entry points by stage
    "none": [],
    "gemm": ["quant_linear", "quant_linear_act", "quantize_act", "linear", "linear_into", "hadamard_quant"],
    "norm": ["rms_norm", "rms_norm_quant", "rmsnorm_gated", "rmsnorm_gated_partial", "rmsnorm_gated_quant",
             "rmsnorm_gated_reduced", "rstd_scale"],
    "fakeq": ["fake_quantize"],
    "state": ["read_state", "write_state"],
    "scan": ["ssd_chunk_scan", "selective_scan", "quant_ssd", "ssd_int8", "causal_conv1d", "conv1d_silu_quant"],
    "decode": ["causal_conv1d_update", "conv1d_update_silu_quant", "mamba2_decode_step", "quant_state_update",
               "selective_state_update"],
}


def force_references(names) -> None:
    """The ``ssmq.kernels`` entry points ``names`` run their torch references from now on (this process)."""
    import ssmq.kernels as K
    from ssmq.kernels import dispatch
    from ssmq.ops import norm as ref_norm

    for n in names:
        if n in SHARDED_NORM_KERNELS:
            setattr(K, n, getattr(ref_norm, f"{n}_ref"))
            continue

        def on_reference(*a, _f=getattr(K, n), **k):
            use = dispatch._use_triton
            dispatch._use_triton = lambda t: False
            try:
                return _f(*a, **k)
            finally:
                dispatch._use_triton = use
        setattr(K, n, on_reference)


def run(comm, src, references=(), log_codes=False) -> dict:
    """run_model's logits of the (sharded, when comm spans ranks) model; with ``log_codes`` out_proj's input of every
    call as (layer, codes, value / scale) (the value rotated as a TP rank sees it)."""
    from _tp_cases import build, on_cpu, run_model

    from ssmq.quant.hadamard import hadamard_transform
    from ssmq.runtime.tp import apply_tp

    force_references(references)
    model = build(src).to("cuda" if torch.cuda.is_available() else "cpu")
    if comm.world > 1:
        apply_tp(model, comm)
    log = []
    for i, layer in enumerate(model.layers if log_codes else ()):
        lin = getattr(layer.mixer.out_proj, "inner", layer.mixer.out_proj)

        def hook(mod, args, i=i, lin=lin):
            x = args[0]
            if lin.rotate_input and comm.world == 1:  # a TP rank's out_proj gets its slice of the rotated input
                x = hadamard_transform(x)
            v = (x.float() / lin.act_scale.float()).cpu()
            log.append((i, torch.round(v).clamp(-128, 127), v))
        lin.register_forward_pre_hook(hook)
    out = on_cpu({k: v for k, v in run_model(model, ssm_dtype=torch.int8).items() if k != "generated"})
    return {**out, "log": log}


def main():
    from _tp_cases import quantized_checkpoint
    from _tp_harness import run_ranks

    what = sys.argv[1] if len(sys.argv) > 1 else "codes"
    src = ("path", quantized_checkpoint("mamba2", "quamba2-w8a8", Path(tempfile.mkdtemp()) / "q", state_bits=8))
    dev = "cuda:shared" if torch.cuda.is_available() else "cpu"
    if what == "bisect":
        for group, names in GROUPS.items():
            one = run_ranks(run, 1, src, names, device=dev)[0]
            four = run_ranks(run, 4, src, names, device=dev)[0]
            errs = {k: f"{((four[k] - one[k]).abs().max() / one[k].abs().max()).item():.2e}"
                    for k in ("full", "prefill", "decode")}
            print(f"TP=4 with {group:7s} on references: {errs}", flush=True)
        return
    one = run_ranks(run, 1, src, (), True, device=dev)[0]["log"]
    four = [r["log"] for r in run_ranks(run, 4, src, (), True, device=dev)]
    shown = 0
    for c, (layer, q1, _) in enumerate(one):
        q4 = torch.cat([r[c][1] for r in four], dim=-1)
        v4 = torch.cat([r[c][2] for r in four], dim=-1)
        diff = q4 != q1
        if diff.any() and shown < 4:
            edge = (v4[diff] - torch.floor(v4[diff]) - 0.5).abs()
            print(f"call {c} (layer {layer}): {int(diff.sum())} of {q1.numel()} codes differ; |frac - 0.5|: "
                  f"{[f'{e:.1e}' for e in edge[:6].tolist()]}; values {[f'{x:.5f}' for x in v4[diff][:4].tolist()]}")
            shown += 1
    print(f"{len(one)} out_proj calls compared" + ("" if shown else ": no code differs"))


if __name__ == "__main__":
    main()
