"""``quantize_ssm(model, recipe, calib)``: apply a Quamba / Quamba2 recipe to a float SSMLM, in place.

Order: refuse what does not apply (``check_ssm_recipe``), before any work -> transforms in recipe
order (sort_cluster calibrates its own channel ranges) -> SSM taps calibrated and swapped for
``ActQuantizer``s -> the linears by the core's ``quantize`` (static scales and GPTQ Hessians are
observed with the taps already quantized, as the layers will see them) -> head-to-toe embedding ->
int8 state cache (scales from states of the quantized model). ``mixed`` recipes go to ``mixed.py``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.quant.calibration import CalibrationData
from ssmq.quant.linear import QuantEmbedding
from ssmq.quant.recipe import Recipe, check_recipe
from ssmq.quant.ssm import ssdi8
from ssmq.quant.ssm.recipe import SSMRecipe, get_ssm_recipe
from ssmq.quant.ssm.transforms import hadamard_both_, hadamard_y_, sort_and_cluster_, ssm_layers


def linear_recipe(recipe: SSMRecipe) -> Recipe:
    """The core recipe of an SSM recipe's linear rules (no transforms: those are done here)."""
    return Recipe(f"{recipe.name}/linears", list(recipe.linears), description=recipe.description)


def _check_ssdi8(recipe: SSMRecipe, cfg) -> None:
    names = [t["name"] for t in recipe.transforms if t["name"] != "mean_correction"]
    if recipe.has("mean_correction") and not recipe.has("ssdi8"):
        raise SSMQError(f"recipe {recipe.name!r}: mean_correction is fitted against the float model that the "
                        "ssdi8 transform keeps; add ssdi8")
    if not recipe.has("ssdi8"):
        return
    if cfg.arch == "mamba1":
        raise SSMQError(f"recipe {recipe.name!r}: ssdi8 quantizes the Mamba-2 SSD; this model is Mamba-1")
    if names[-1] != "ssdi8":
        raise SSMQError(f"recipe {recipe.name!r}: ssdi8 must come after every other transform (they change the "
                        "float model its scales and the mean correction are calibrated on)")
    state, passing = recipe.param("ssdi8", "int8_state"), recipe.param("ssdi8", "int8_passing")
    if passing and not state:
        raise SSMQError(f"recipe {recipe.name!r}: ssdi8 int8_passing needs int8_state")
    if recipe.state_bits == 8 and not state:
        raise SSMQError(f"recipe {recipe.name!r}: an 8-bit state cache with ssdi8 needs int8_state")


def check_ssm_recipe(recipe: SSMRecipe, model: nn.Module) -> None:
    """Raise SSMQError when ``recipe`` does not apply to ``model``; does no work on the model."""
    from ssmq.quant.hadamard import has_hadamard
    from ssmq.quant.rotation import rotation_sizes
    from ssmq.quant.ssm.permute import permutable_block

    recipe.validate()
    cfg = model.config
    if cfg.arch not in recipe.supported_archs:
        raise SSMQError(f"recipe {recipe.name!r} supports {', '.join(recipe.supported_archs)}, not {cfg.arch}")
    if recipe.mixed is not None:
        ratio = recipe.mixed_param("a8_to_a16")
        if len(ratio) != 2 or min(ratio) < 0 or sum(ratio) == 0:
            raise SSMQError(f"recipe {recipe.name!r}: a8_to_a16 must be two non-negative counts, got {ratio}")
        for key in ("a8", "a16"):
            check_ssm_recipe(get_ssm_recipe(recipe.mixed_param(key)), model)
        return
    for rule in recipe.taps:
        if cfg.arch not in rule.archs:
            continue
        if rule.layout == "cluster" and not recipe.has("sort_cluster"):
            raise SSMQError(f"recipe {recipe.name!r}: the cluster layout of {rule.taps} needs the sort_cluster transform")
        if rule.layout == "cluster" and rule.taps != ["act_x"]:
            raise SSMQError(f"recipe {recipe.name!r}: only act_x has cluster scales, not {rule.taps}")
        if rule.layout == "state_group" and (set(rule.taps) - {"act_B", "act_C"} or cfg.d_state % rule.state_groups):
            raise SSMQError(f"recipe {recipe.name!r}: state_group scales are for act_B/act_C with state_groups "
                            f"dividing d_state {cfg.d_state}")
    _check_ssdi8(recipe, cfg)
    if recipe.has("hadamard_y") and not has_hadamard(cfg.d_inner):
        raise SSMQError(f"recipe {recipe.name!r}: no Hadamard matrix of order d_inner {cfg.d_inner}")
    if recipe.has("hadamard"):
        for what, n in rotation_sizes(model, True).items():
            if not has_hadamard(n):
                raise SSMQError(f"recipe {recipe.name!r}: no Hadamard matrix of order {n} ({what})")
    if recipe.has("sort_cluster"):
        if min(recipe.param("sort_cluster", "m"), recipe.param("sort_cluster", "n")) < 1:
            raise SSMQError(f"recipe {recipe.name!r}: sort_cluster needs m, n >= 1")
        if cfg.arch == "mamba2":
            permutable_block(cfg)
    check_recipe(linear_recipe(recipe), model)
    if recipe.embedding is not None and recipe.embedding.method != "rtn":
        raise SSMQError(f"recipe {recipe.name!r}: the embedding is quantized by round to nearest only")


@torch.no_grad()
def quantize_ssm(model: nn.Module, recipe, calib: CalibrationData, *, batch_size: int = 8, progress: bool = True,
                 heldout: CalibrationData | None = None, state_windows: int = 64, state_chunk: int = 128) -> nn.Module:
    """Quantize ``model`` in place by an SSM recipe (name, JSON path or SSMRecipe); returns it.

    heldout: windows for the mixed-precision search's fitness (default: drawn with seed + 1).
    state_windows, state_chunk: calibration windows for the int8 state scales, observed every state_chunk tokens.
    """
    from ssmq.quant.api import quantize as quantize_linears

    recipe = get_ssm_recipe(recipe)
    check_ssm_recipe(recipe, model)
    if calib is None:
        raise SSMQError(f"recipe {recipe.name!r} needs calibration data")
    if getattr(model, "quantization", None) is not None:
        raise SSMQError("this model is already quantized; start from the float model")
    if recipe.mixed is not None:
        from ssmq.quant.ssm.mixed import quantize_mixed

        return quantize_mixed(model, recipe, calib, heldout=heldout, batch_size=batch_size, progress=progress)
    kw = {"batch_size": batch_size, "progress": progress}

    clusters: dict[int, torch.Tensor] = {}
    reference = None
    for t in recipe.transforms:
        if t["name"] == "sort_cluster":
            clusters = sort_and_cluster_(model, calib, recipe.param("sort_cluster", "m"),
                                         recipe.param("sort_cluster", "n"), **kw)
        elif t["name"] == "hadamard_y":
            hadamard_y_(model)
        elif t["name"] == "hadamard":
            hadamard_both_(model)
        elif t["name"] == "gamma_migration":
            ssdi8.gamma_migration_(model)
        elif t["name"] == "ssdi8":
            if recipe.has("mean_correction"):
                reference = copy.deepcopy(model)  # the float model in the same (transformed) basis
            ssdi8.install_ssdi8_(model, calib, ssdi8.SSDi8Options(**{k: recipe.param("ssdi8", k) for k in
                                                                      ("reformulate", "int8_state", "int8_passing")}), **kw)

    from ssmq.quant.ssm.taps import install_tap_quantizers

    install_tap_quantizers(model, recipe.taps, clusters, calib, **kw)
    quantize_linears(model, linear_recipe(recipe), calib, batch_size=batch_size, progress=progress)
    if recipe.embedding is not None:
        model.embedding = QuantEmbedding.from_float(model.embedding, recipe.embedding)
    if recipe.has("mean_correction"):
        ssdi8.mean_correction_(model, reference,
                               calib, float(recipe.param("mean_correction", "eta")), batch_size, progress)
        del reference
    if recipe.state_bits == 8 and recipe.has("ssdi8"):
        ssdi8.enable_ssdi8_state(model)
    elif recipe.state_bits == 8:
        from ssmq.quant.ssm.state_cache import enable_int8_state

        enable_int8_state(model, clusters, calib.input_ids[:state_windows], state_chunk, batch_size, progress)
    model.quantization = {"recipe": recipe.to_dict(), "calibration": calib.record(),
                          "ssm": {"clusters": {i: int(c.max()) + 1 for i, c in clusters.items()},
                                  "ssm_layers": ssm_layers(model)}}
    return model
