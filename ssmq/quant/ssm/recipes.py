"""The named SSM recipes: Quamba (W8A8) and Quamba2 (W8A8, W4A8, W4A16, mixed), plus the naive baseline
the papers start from. Choices the papers leave open are stated here:
    - 4-bit weights: GPTQ, symmetric, groups of 128 along k, block 128, damp 0.01 (in_proj, out_proj, lm_head);
      x_proj (Mamba-1) stays 8-bit per-channel; dt_proj (Mamba-1) stays float (the core's rule, rank r x d)
    - Quamba2 8-bit weights: per output channel; Quamba: per tensor (as the paper: "static per-tensor")
    - head-to-toe: embedding rows 8-bit (per token = per row), lm_head per-group 128 at the weight bits
    - x of Quamba2: m = 4 head groups x n = 4 channel groups, percentile 99.999 inside each group
    - B, C of Quamba2: one scale per B/C group (state_groups = 1); z: per tensor; Δ: per tensor (Mamba-1
      only, Mamba-2's Δ stays float as in Quamba2)
"""

from __future__ import annotations

from ssmq.quant.recipe import Rule
from ssmq.quant.spec import ActSpec, WeightSpec
from ssmq.quant.ssm.recipe import SSMRecipe, TapRule, register_ssm_recipe

PROJ = ["layers.*.mixer.in_proj", "layers.*.mixer.out_proj"]
ALL_PROJ = ["layers.*.mixer.*_proj"]
NO_DT = ["*.dt_proj"]
STATIC_A8 = ActSpec.from_dict({"dtype": "int8", "granularity": "per_tensor", "static": True, "observer": "absmax"})


def _w(dtype: str, gran: str, method: str = "rtn") -> WeightSpec:
    return WeightSpec.from_dict({"dtype": dtype, "granularity": gran, "method": method})


def _taps(x_layout: str, x_observer: str, bc_layout: str) -> list[TapRule]:
    return [TapRule(["act_x"], x_layout, x_observer),
            TapRule(["act_B", "act_C"], bc_layout),
            TapRule(["act_z"]),
            TapRule(["act_dt"], archs=["mamba1"])]


def naive_w8a8() -> SSMRecipe:
    """Static per-tensor absmax everywhere, no transform: the collapse the papers start from."""
    return SSMRecipe("naive-w8a8", [Rule(ALL_PROJ, _w("int8", "per_tensor"), STATIC_A8, NO_DT)],
                     _taps("per_tensor", "absmax", "per_tensor"),
                     description="naive static W8A8: per-tensor int8 linears and SSM inputs (absmax)")


def quamba_w8a8(percentile: float = 99.999) -> SSMRecipe:
    taps = _taps("per_tensor", "percentile", "per_tensor")
    taps[0].percentile = percentile
    return SSMRecipe("quamba-w8a8", [Rule(ALL_PROJ, _w("int8", "per_tensor"), STATIC_A8, NO_DT)], taps,
                     [{"name": "hadamard_y"}],
                     description="Quamba: static per-tensor W8A8, Hadamard on y fused into out_proj, "
                                 f"percentile ({percentile}) clipping of the SSM input x")


def quamba2(wbits: int, abits: int) -> SSMRecipe:
    w_proj = _w("int4", "per_group:128", "gptq") if wbits == 4 else _w("int8", "per_channel")
    act = STATIC_A8 if abits == 8 else None
    linears = [Rule(PROJ, w_proj, act),
               Rule(ALL_PROJ, _w("int8", "per_channel"), act, NO_DT),  # Mamba-1 x_proj
               Rule(["lm_head"], _w(f"int{wbits}", "per_group:128", "gptq" if wbits == 4 else "rtn"), act)]
    return SSMRecipe(f"quamba2-w{wbits}a{abits}", linears,
                     _taps("cluster", "percentile", "state_group") if abits == 8 else [],
                     [{"name": "sort_cluster", "params": {"m": 4, "n": 4}}, {"name": "hadamard"}],
                     embedding=_w("int8", "per_channel"),
                     description=f"Quamba2 W{wbits}A{abits}: sort-and-cluster x (4x4 scales), per-state-group "
                                 "B/C, both-sides Hadamard, " + ("GPTQ int4 g128" if wbits == 4 else "int8") +
                                 " weights, head-to-toe")


def quamba2_mixed() -> SSMRecipe:
    return SSMRecipe("quamba2-mixed", [], mixed={"a8": "quamba2-w4a8", "a16": "quamba2-w4a16"},
                     description="Quamba2 W4AX: per-layer A8/A16 (3:1) by evolutionary search on held-out "
                                 "calibration perplexity")


def ssdi8(wbits: int, eta: float = 0.15) -> SSMRecipe:
    """SSDi8 W8A8 / W4A8: in_proj and out_proj only ("SSD-only": attention, MLP, embedding and lm_head of the model
    stay 16-bit), static per-tensor int8 activations, γ migration + both-sides Hadamard, int8 SSD with persistent
    int8 state (the state cache too, at the scan's scales), mean correction η at out_proj's output."""
    w = _w("int4", "per_group:128", "gptq") if wbits == 4 else _w("int8", "per_channel")
    return SSMRecipe(f"ssdi8-w{wbits}a8", [Rule(PROJ, w, STATIC_A8)], [],
                     [{"name": "gamma_migration"}, {"name": "hadamard"}, {"name": "ssdi8"},
                      {"name": "mean_correction", "params": {"eta": eta}}],
                     state_bits=8, supported_archs=["mamba2", "hybrid"],
                     description=f"SSDi8 W{wbits}A8: int8 SSD inside (early B/C quantization, reformulated chunk "
                                 "state, persistent int8 state, fixed-point state passing), γ migration, both-sides "
                                 f"Hadamard, {'GPTQ int4 g128' if wbits == 4 else 'int8 per-channel'} in/out_proj, "
                                 f"mean correction η = {eta}; Mamba-2 layers only")


for _r in (quamba_w8a8(), quamba2(8, 8), quamba2(4, 8), quamba2(4, 16), quamba2_mixed(), ssdi8(8), ssdi8(4)):
    register_ssm_recipe(_r)
