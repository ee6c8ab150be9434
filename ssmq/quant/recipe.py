"""Recipes: which transforms run and which quantized module replaces which module, as data (JSON).

A recipe (see ``RECIPES`` for the built-in ones; users write the same JSON):

    {"name": "gptq-w4a16-g128", "supported_archs": ["mamba1", "mamba2", "hybrid"],
     "transforms": [{"name": "hadamard", "params": {"online": true}}],      # in order, optional
     "rules": [{"modules": ["layers.*"], "exclude": ["*.dt_proj"],
                "weight": {"dtype": "int4", "granularity": "per_group:128", "method": "gptq"},
                "act": null}]}                                            # null = 16-bit activations

A rule applies to the nn.Linear modules whose path matches one of ``modules`` (fnmatch; ``*``
crosses dots) and no ``exclude``; the first matching rule wins. Transforms: "smoothquant"
(params: alpha) and "hadamard" (QuaRot-style, params: online). ``check_recipe`` refuses a recipe
that does not apply to a model before any work is done.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.quant.spec import ActSpec, WeightSpec, validate_pair

FORMAT = 1
ARCHS = ("mamba1", "mamba2", "hybrid")
TRANSFORM_PARAMS = {"smoothquant": {"alpha": 0.5}, "hadamard": {"online": True}}


@dataclass
class Transform:
    name: str
    params: dict = field(default_factory=dict)

    def validate(self) -> "Transform":
        if self.name not in TRANSFORM_PARAMS:
            raise SSMQError(f"unknown transform {self.name!r}; known: {', '.join(TRANSFORM_PARAMS)}")
        unknown = set(self.params) - set(TRANSFORM_PARAMS[self.name])
        if unknown:
            raise SSMQError(f"unknown parameter(s) {sorted(unknown)} of transform {self.name}; "
                            f"known: {sorted(TRANSFORM_PARAMS[self.name])}")
        if self.name == "smoothquant":
            alpha = self.get("alpha")
            if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
                raise SSMQError(f"smoothquant alpha must be in [0, 1], got {alpha!r}")
        return self

    def get(self, key: str):
        return self.params.get(key, TRANSFORM_PARAMS[self.name][key])


@dataclass
class Rule:
    modules: list[str]
    weight: WeightSpec
    act: ActSpec | None = None
    exclude: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"modules": list(self.modules), "exclude": list(self.exclude), "weight": self.weight.to_dict(),
                "act": None if self.act is None else self.act.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Rule":
        unknown = set(d) - {"modules", "exclude", "weight", "act"}
        if unknown:
            raise SSMQError(f"unknown rule field(s) {sorted(unknown)}")
        if "modules" not in d or "weight" not in d:
            raise SSMQError("a rule needs 'modules' (patterns) and 'weight'")
        mods = [d["modules"]] if isinstance(d["modules"], str) else list(d["modules"])
        act = None if d.get("act") is None else ActSpec.from_dict(d["act"])
        rule = cls(mods, WeightSpec.from_dict(d["weight"]), act, list(d.get("exclude", [])))
        validate_pair(rule.weight, rule.act)
        return rule


@dataclass
class Recipe:
    name: str
    rules: list[Rule]
    transforms: list[Transform] = field(default_factory=list)
    supported_archs: list[str] = field(default_factory=lambda: list(ARCHS))
    description: str = ""

    def validate(self) -> "Recipe":
        if not self.rules:
            raise SSMQError(f"recipe {self.name!r} has no rules")
        bad = sorted(set(self.supported_archs) - set(ARCHS))
        if bad:
            raise SSMQError(f"recipe {self.name!r}: unknown architecture(s) {bad}; known: {', '.join(ARCHS)}")
        for t in self.transforms:
            t.validate()
        for r in self.rules:
            validate_pair(r.weight, r.act)
        return self

    def needs_calibration(self) -> bool:
        return any(t.name == "smoothquant" for t in self.transforms) or any(
            r.weight.method == "gptq" or (r.act is not None and r.act.static) for r in self.rules)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "description": self.description,
                "supported_archs": list(self.supported_archs),
                "transforms": [{"name": t.name, "params": dict(t.params)} for t in self.transforms],
                "rules": [r.to_dict() for r in self.rules]}

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        if not isinstance(d, dict):
            raise SSMQError("a recipe is a JSON object")
        if d.get("format", FORMAT) != FORMAT:
            raise SSMQError(f"recipe format {d.get('format')} is not supported (this ssmq reads format {FORMAT})")
        unknown = set(d) - {"format", "name", "description", "supported_archs", "transforms", "rules"}
        if unknown:
            raise SSMQError(f"unknown recipe field(s) {sorted(unknown)}")
        transforms = []
        for t in d.get("transforms", []):
            t = {"name": t} if isinstance(t, str) else t
            transforms.append(Transform(t["name"], dict(t.get("params", {}))))
        return cls(name=d.get("name", "custom"), rules=[Rule.from_dict(r) for r in d.get("rules", [])],
                   transforms=transforms, supported_archs=list(d.get("supported_archs", ARCHS)),
                   description=d.get("description", "")).validate()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Recipe":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise SSMQError(f"recipe is not valid JSON: {e}") from None
        except (KeyError, TypeError) as e:
            raise SSMQError(f"malformed recipe: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------
RECIPES: dict = {}  # name -> Recipe, or SSMRecipe (ssmq.quant.ssm: Quamba, Quamba2)


def register_recipe(recipe):
    """Add a recipe of either kind to the one registry (validated first)."""
    RECIPES[recipe.name] = recipe.validate()
    return recipe


def get_recipe(name_or_path):
    """A registered name, a path to a JSON file, or a recipe object (returned validated).

    JSON files with ``"kind": "ssm"`` are SSM recipes (``ssmq.quant.ssm.SSMRecipe``), others core ``Recipe``s.
    """
    if hasattr(name_or_path, "validate") and hasattr(name_or_path, "name"):
        return name_or_path.validate()
    key = str(name_or_path)
    if key in RECIPES:
        return RECIPES[key]
    p = Path(key).expanduser()
    if p.is_file():
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise SSMQError(f"{p}: not valid JSON: {e}") from None
        try:
            if isinstance(d, dict) and d.get("kind") == "ssm":
                from ssmq.quant.ssm.recipe import SSMRecipe

                return SSMRecipe.from_dict(d).validate()
            return Recipe.from_dict(d)
        except (SSMQError, KeyError, TypeError) as e:
            raise SSMQError(f"{p}: {e}") from None
    raise SSMQError(f"unknown recipe {key!r}: not a file, and not one of {', '.join(sorted(RECIPES))}")


def _lin(weight: dict, act: dict | None = None, exclude=("*.dt_proj",)) -> Rule:
    # every linear of every block except Mamba-1's dt_proj: 0.1% of the weights, and its in_features
    # (dt_rank = d_model / 16) is rarely a multiple of a group size
    return Rule(["layers.*"], WeightSpec.from_dict(weight), None if act is None else ActSpec.from_dict(act),
                list(exclude))


_STATIC = {"dtype": "int8", "granularity": "per_tensor", "static": True, "observer": "absmax"}
_DYNAMIC = {"dtype": "int8", "granularity": "per_token", "static": False}
for _r in [
    Recipe("rtn-w8a16", [_lin({"dtype": "int8"})], description="int8 per-channel weights, round to nearest"),
    Recipe("rtn-w4a16-g128", [_lin({"dtype": "int4", "granularity": "per_group:128"})],
           description="int4 weights, groups of 128, round to nearest"),
    Recipe("static-w8a8", [_lin({"dtype": "int8", "granularity": "per_tensor"}, _STATIC)],
           description="naive W8A8: per-tensor int8 weights, static per-tensor absmax activation scales"),
    Recipe("dynamic-w8a8", [_lin({"dtype": "int8"}, _DYNAMIC)],
           description="int8 per-channel weights, dynamic per-token int8 activations"),
    Recipe("smoothquant-w8a8", [_lin({"dtype": "int8"}, _STATIC)], [Transform("smoothquant", {"alpha": 0.5})],
           description="SmoothQuant (alpha 0.5) + per-channel weights + static per-tensor activations"),
    Recipe("hadamard-w8a8", [_lin({"dtype": "int8"}, _DYNAMIC)], [Transform("hadamard", {"online": True})],
           description="QuaRot-style: Hadamard-rotated residual stream and online Hadamard on out_proj/"
                       "o_proj/down_proj inputs; per-channel weights, dynamic per-token activations"),
    Recipe("fp8-w8a8", [_lin({"dtype": "fp8"}, {"dtype": "fp8", "granularity": "per_token", "static": False})],
           description="FP8 e4m3 per-channel weights, dynamic per-token e4m3 activations (in_proj / out_proj "
                       "etc.; conv1d and the SSM stay 16-bit)"),
    Recipe("gptq-w4a16-g128", [_lin({"dtype": "int4", "granularity": "per_group:128", "method": "gptq"})],
           description="GPTQ int4 weights, groups of 128, block 128, damp 0.01"),
]:
    register_recipe(_r)


# ---------------------------------------------------------------------------------------------
# applicability
# ---------------------------------------------------------------------------------------------
def plan(recipe: Recipe, model: nn.Module) -> dict[str, Rule]:
    """{linear path: rule} — the first matching rule of each nn.Linear."""
    from ssmq.quant.calibration import match_modules

    out: dict[str, Rule] = {}
    for rule in recipe.rules:
        for p in match_modules(model, rule.modules, rule.exclude, kinds=(nn.Linear,)):
            out.setdefault(p, rule)
    return out


def check_recipe(recipe: Recipe, model: nn.Module) -> dict[str, Rule]:
    """Refuse (SSMQError) a recipe that does not apply to ``model``; return its plan otherwise."""

    from ssmq.quant.hadamard import has_hadamard
    from ssmq.quant.primitives import PerGroup

    recipe.validate()
    arch = model.config.arch
    if arch not in recipe.supported_archs:
        raise SSMQError(f"recipe {recipe.name!r} supports {', '.join(recipe.supported_archs)}, not {arch}")
    targets = plan(recipe, model)
    if not targets:
        raise SSMQError(f"recipe {recipe.name!r} matches no linear module of this {arch} model")
    from ssmq.quant.calibration import match_modules

    for rule in recipe.rules:
        if not match_modules(model, rule.modules, rule.exclude, kinds=(nn.Linear,)):
            raise SSMQError(f"recipe {recipe.name!r}: rule {rule.modules} matches no linear module of this {arch} model")
    for path, rule in targets.items():
        k = model.get_submodule(path).in_features
        g = rule.weight.granularity
        if isinstance(g, PerGroup) and k % g.group_size:
            raise SSMQError(f"recipe {recipe.name!r}: group size {g.group_size} does not divide "
                            f"in_features {k} of {path}")
        if rule.weight.dtype == "int4" and k % 2:
            raise SSMQError(f"recipe {recipe.name!r}: int4 needs an even in_features, {path} has {k}")
    for t in recipe.transforms:
        if t.name == "hadamard":
            from ssmq.quant.rotation import rotation_sizes

            for what, n in rotation_sizes(model, t.get("online")).items():
                if not has_hadamard(n):
                    raise SSMQError(f"recipe {recipe.name!r}: no Hadamard matrix of order {n} ({what})")
    return targets
