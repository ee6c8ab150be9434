"""SSM recipes (Quamba, Quamba2): a small declarative description, dataclass <-> JSON, and a registry.

    {"name": "quamba2-w4a8", "supported_archs": ["mamba1", "mamba2"],
     "transforms": [{"name": "sort_cluster", "params": {"m": 4, "n": 4}}, {"name": "hadamard"}],
     "taps":    [{"taps": ["act_x"], "layout": "cluster", "observer": "percentile", "percentile": 99.999}, ...],
     "linears": [<ssmq.quant.recipe Rule>, ...],          # QuantLinear per module path (the core's rules)
     "embedding": {"dtype": "int8"},                       # per-token (= per-row) embedding output, or null
     "state_bits": 16,                                     # 8: int8 SSM state cache
     "mixed": null}                                        # or the W4AX evolutionary search (see mixed.py)

Transforms, applied in order to the float model (each preserves its function):
    sort_cluster  {m, n}: Quamba2's channel reordering + m×n groups for x (``cluster.py``)
    hadamard_y    Quamba: online Hadamard on the out_proj input (y), its inverse fused into out_proj
    hadamard      Quamba2: residual stream rotated on both sides (W_out <- H W_out H'ᵀ online, W_in <- W_in Hᵀ),
                  the core's ``rotate_model_`` (norms folded first)
    gamma_migration  SSDi8: each Mamba layer's RMSNorm γ folded into its in_proj
    ssdi8         {reformulate, int8_state, int8_passing}: the Mamba-2 scans become int8 SSDs (``ssdi8.py``)
    mean_correction  {eta}: per-channel bias at out_proj's output, fitted after the linears are quantized
Taps: which mixer taps become ``ActQuantizer``s, their layout (per_tensor | state_group | cluster),
observer (absmax | percentile at ``percentile``) and the architectures the rule applies to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ssmq.errors import SSMQError
from ssmq.quant.recipe import Rule
from ssmq.quant.spec import WeightSpec

FORMAT = 1
SSM_ARCHS = ("mamba1", "mamba2")
TAPS = ("act_x", "act_B", "act_C", "act_dt", "act_z", "act_y")
TRANSFORMS = {"sort_cluster": {"m": 4, "n": 4}, "hadamard_y": {}, "hadamard": {}, "gamma_migration": {},
              "ssdi8": {"reformulate": True, "int8_state": True, "int8_passing": True},
              "mean_correction": {"eta": 0.15}}
RECIPE_ARCHS = (*SSM_ARCHS, "hybrid")  # hybrids: the recipe touches the Mamba layers only
MIXED_DEFAULTS = {"a8": "quamba2-w4a8", "a16": "quamba2-w4a16", "population": 40, "generations": 5,
                  "mutations": 10, "crossovers": 10, "a8_to_a16": [3, 1], "heldout_windows": 16,
                  "heldout_seqlen": 512, "seed": 0}


def _check_keys(d: dict, known, what: str) -> None:
    unknown = set(d) - set(known)
    if unknown:
        raise SSMQError(f"unknown {what} field(s) {sorted(unknown)}; known: {sorted(known)}")


@dataclass
class TapRule:
    taps: list[str]
    layout: str = "per_tensor"
    observer: str = "absmax"
    percentile: float = 99.999
    state_groups: int = 1
    bits: int = 8
    archs: list[str] = field(default_factory=lambda: list(SSM_ARCHS))

    def validate(self) -> "TapRule":
        from ssmq.quant.ssm.quantizer import SUPPORTED_BITS

        bad = sorted(set(self.taps) - set(TAPS))
        if bad:
            raise SSMQError(f"unknown tap(s) {bad}; known: {', '.join(TAPS)}")
        if self.layout not in ("per_tensor", "state_group", "cluster"):
            raise SSMQError(f"unknown tap layout {self.layout!r}; known: per_tensor, state_group, cluster")
        if self.observer not in ("absmax", "percentile"):
            raise SSMQError(f"tap observer must be absmax or percentile, not {self.observer!r}")
        if not 0.0 < self.percentile <= 100.0:
            raise SSMQError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.bits not in SUPPORTED_BITS:
            raise SSMQError(f"SSM activations quantize to {SUPPORTED_BITS} bits (or stay 16-bit), not {self.bits}")
        if self.state_groups < 1:
            raise SSMQError(f"state_groups must be >= 1, got {self.state_groups}")
        return self

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "TapRule":
        _check_keys(d, cls.__dataclass_fields__, "tap rule")
        return cls(**d).validate()


@dataclass
class SSMRecipe:
    name: str
    linears: list[Rule]
    taps: list[TapRule] = field(default_factory=list)
    transforms: list[dict] = field(default_factory=list)
    embedding: WeightSpec | None = None
    state_bits: int = 16
    mixed: dict | None = None
    supported_archs: list[str] = field(default_factory=lambda: list(SSM_ARCHS))
    description: str = ""

    def validate(self) -> "SSMRecipe":
        bad = sorted(set(self.supported_archs) - set(RECIPE_ARCHS))
        if bad:
            raise SSMQError(f"SSM recipe {self.name!r}: unsupported architecture(s) {bad}; "
                            f"SSM recipes support {', '.join(RECIPE_ARCHS)}")
        for t in self.transforms:
            if t.get("name") not in TRANSFORMS:
                raise SSMQError(f"unknown SSM transform {t.get('name')!r}; known: {', '.join(TRANSFORMS)}")
            _check_keys(t.get("params", {}), TRANSFORMS[t["name"]], f"{t['name']} parameter")
        for r in self.taps:
            r.validate()
        if self.state_bits not in (8, 16):
            raise SSMQError(f"state cache bits must be 8 or 16, not {self.state_bits}")
        if self.embedding is not None:
            self.embedding.validate()
        if self.mixed is not None:
            _check_keys(self.mixed, MIXED_DEFAULTS, "mixed")
        elif not self.linears:
            raise SSMQError(f"SSM recipe {self.name!r} has no linear rules")
        return self

    def param(self, transform: str, key: str):
        for t in self.transforms:
            if t["name"] == transform:
                return t.get("params", {}).get(key, TRANSFORMS[transform][key])
        return None

    def has(self, transform: str) -> bool:
        return any(t["name"] == transform for t in self.transforms)

    def mixed_param(self, key: str):
        return (self.mixed or {}).get(key, MIXED_DEFAULTS[key])

    def with_changes(self, **kw) -> "SSMRecipe":
        return replace(self, **kw).validate()

    def to_dict(self) -> dict:
        return {"format": FORMAT, "kind": "ssm", "name": self.name, "description": self.description,
                "supported_archs": list(self.supported_archs), "transforms": [dict(t) for t in self.transforms],
                "taps": [t.to_dict() for t in self.taps], "linears": [r.to_dict() for r in self.linears],
                "embedding": None if self.embedding is None else self.embedding.to_dict(),
                "state_bits": self.state_bits, "mixed": self.mixed}

    @classmethod
    def from_dict(cls, d: dict) -> "SSMRecipe":
        _check_keys(d, ("format", "kind", "name", "description", "supported_archs", "transforms", "taps",
                        "linears", "embedding", "state_bits", "mixed"), "SSM recipe")
        if d.get("format", FORMAT) != FORMAT:
            raise SSMQError(f"SSM recipe format {d.get('format')} is not supported (this ssmq reads {FORMAT})")
        transforms = [{"name": t} if isinstance(t, str) else dict(t) for t in d.get("transforms", [])]
        return cls(name=d.get("name", "custom"), description=d.get("description", ""),
                   linears=[Rule.from_dict(r) for r in d.get("linears", [])],
                   taps=[TapRule.from_dict(t) for t in d.get("taps", [])], transforms=transforms,
                   embedding=None if d.get("embedding") is None else WeightSpec.from_dict(d["embedding"]),
                   state_bits=d.get("state_bits", 16), mixed=d.get("mixed"),
                   supported_archs=list(d.get("supported_archs", SSM_ARCHS))).validate()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def register_ssm_recipe(recipe: SSMRecipe) -> SSMRecipe:
    """SSM recipes live in the one registry of ``ssmq.quant.recipe`` beside the core ones."""
    from ssmq.quant.recipe import register_recipe

    return register_recipe(recipe)


def ssm_recipes() -> dict[str, SSMRecipe]:
    from ssmq.quant.recipe import RECIPES

    return {n: r for n, r in RECIPES.items() if isinstance(r, SSMRecipe)}


def get_ssm_recipe(name_or_path) -> SSMRecipe:
    """A registered name, a JSON file (with "kind": "ssm"), or an SSMRecipe."""
    from ssmq.quant.recipe import get_recipe

    recipe = get_recipe(name_or_path)
    if not isinstance(recipe, SSMRecipe):
        raise SSMQError(f"recipe {recipe.name!r} is not an SSM recipe; SSM recipes: {', '.join(sorted(ssm_recipes()))}")
    return recipe
