"""Recipes: one declarative description (dataclass <-> JSON) of everything a quantization does, and the registry.

    {"format": 2, "name": "quamba2-w4a8", "supported_archs": ["mamba1", "mamba2"],
     "transforms": [{"name": "sort_cluster", "params": {"m": 4, "n": 4}}, {"name": "hadamard"}],   # in order
     "linears":    [{"modules": ["layers.*.mixer.in_proj"], "exclude": [],                        # first match wins
                     "weight": {"dtype": "int4", "granularity": "per_group:128", "method": "gptq"},
                     "act": {"dtype": "int8", "granularity": "per_tensor", "static": true}}],   # null = 16-bit
     "taps":       [{"taps": ["act_x"], "layout": "cluster", "observer": "percentile"}],        # SSM inputs
     "embedding":  {"dtype": "int8"},                            # head-to-toe: embedding rows, or null
     "cache":      {"state_bits": 16, "kv": null,                # SSM state (8: int8, scales per x group
                    "state_scales": "x_groups"},                 # and state index, per_channel or dynamic); KV
                                                                 # format: a KVSpec object or a preset's name
     "calibration": {"state_windows": 64, "state_chunk": 128},   # what the int8 state scales observe
     "search":     null,                                         # or per-layer A8/A16 search (W4AX)
     "conv":       "per_tensor"}                                 # int8 conv1d weights (per_tensor | per_channel),
                                                                 # input codes and bias; absent/null = 16-bit

Linear rules: the nn.Linear modules whose path matches one of ``modules`` (fnmatch; ``*`` crosses dots) and no
``exclude`` become ``QuantLinear(weight, act)``. Taps: which mixer activation taps (``act_x``, ``act_B`` ...)
become ``ActQuantizer``s, their scale layout (per_tensor | state_group | cluster) and observer. Transforms:
``TRANSFORMS`` below names each and its parameters; ``ssmq.quant.api`` runs them (the maths: one file each,
listed in ``docs/architecture.md``). Search: the model is quantized twice (the recipe, and the recipe with
16-bit activations) and each layer takes one of the two by evolutionary search (``ssmq/quant/ssm/mixed.py``).

KV cache: ``cache.kv`` is a ``ssmq.models.kv_format.KVSpec`` (JSON object), or the name of a KV preset
(``ssmq.models.kv_format.KV_PRESETS``, each also registered as a KV-only recipe). ``get_recipe("A+B")`` combines a recipe
A with a cache-only recipe B (a KV preset, ``int8-state``): A's rules, B's KV format on the attention layers and its
SSM state format on the Mamba layers, one recipe.

A new family is data: new fields of a spec, a transform name here and its function in ``api.TRANSFORMS``.
Format 1 (the two kinds of ssmq 0.1: ``{"rules": ...}`` and ``{"kind": "ssm", "linears": ..., "state_bits":
..., "mixed": ...}``) is still read, so checkpoints and recipe files written by ssmq 0.1 keep working.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ssmq.errors import SSMQError
from ssmq.errors import from_json_object as _from
from ssmq.models.config import ARCHS as MODEL_ARCHS
from ssmq.models.config import ATTENTION_ARCHS
from ssmq.models.kv_format import KV_PRESETS, KVSpec
from ssmq.quant.spec import ActSpec, WeightSpec, validate_pair

FORMAT = 2
ARCHS = MODEL_ARCHS  # every architecture: linear-only recipes apply to all (llama included)
SSM_ARCHS = ("mamba1", "mamba2")
TAPS = ("act_x", "act_B", "act_C", "act_dt", "act_z", "act_y")
TAP_LAYOUTS = ("per_tensor", "state_group", "cluster")
# transform name -> its parameters with their defaults (the functions: ssmq.quant.api.TRANSFORMS)
# hadamard: "online" rotates the inputs of out_proj / o_proj / down_proj at run time; "online_ends" keeps an lm_head
# tied to the embedding (and neither quantized) one matrix: the residual stream is rotated after the embedding
# lookup and turned back before the final norm, at run time, instead of folded into both (``ssmq.quant.rotation``)
TRANSFORMS = {"smoothquant": {"alpha": 0.5}, "hadamard": {"online": True, "online_ends": True}, "hadamard_y": {},
              "sort_cluster": {"m": 4, "n": 4}, "gamma_migration": {},
              "ssdi8": {"reformulate": True, "int8_state": True, "int8_passing": True},
              "mean_correction": {"eta": 0.15}}
CONV_GRANULARITIES = ("per_tensor", "per_channel")  # of the int8 conv1d weights (``Recipe.conv``)
SSD_TRANSFORMS = ("gamma_migration", "ssdi8", "mean_correction")  # SSDi8's: the int8 state is the scan's own



@dataclass
class Transform:
    name: str
    params: dict = field(default_factory=dict)

    def validate(self) -> "Transform":
        if self.name not in TRANSFORMS:
            raise SSMQError(f"unknown transform {self.name!r}; known: {', '.join(TRANSFORMS)}")
        if not isinstance(self.params, dict):
            raise SSMQError(f"transform {self.name} field 'params' must be an object, got {self.params!r}")
        unknown = set(self.params) - set(TRANSFORMS[self.name])
        if unknown:
            raise SSMQError(f"unknown parameter(s) {sorted(unknown)} of transform {self.name}; "
                            f"known: {sorted(TRANSFORMS[self.name])}")
        for key, value in self.params.items():  # each parameter has the JSON type of its default
            default = TRANSFORMS[self.name][key]
            ok = isinstance(value, bool) if isinstance(default, bool) else (
                isinstance(value, (int, float) if isinstance(default, float) else type(default))
                and not isinstance(value, bool))
            if not ok:
                kind = {bool: "true or false", int: "an integer", float: "a number"}[type(default)]
                raise SSMQError(f"transform {self.name} parameter {key!r} must be {kind}, got {value!r}")
        alpha = self.get("alpha") if self.name == "smoothquant" else 0.5
        if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
            raise SSMQError(f"smoothquant alpha must be in [0, 1], got {alpha!r}")
        if self.name == "sort_cluster" and min(self.get("m"), self.get("n")) < 1:
            raise SSMQError("sort_cluster needs m, n >= 1")
        return self

    def get(self, key: str):
        return self.params.get(key, TRANSFORMS[self.name][key])


@dataclass
class Rule:
    """Linear layers: ``modules`` minus ``exclude`` (fnmatch patterns) -> QuantLinear(weight, act)."""
    modules: list[str]
    weight: WeightSpec
    act: ActSpec | None = None
    exclude: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"modules": list(self.modules), "exclude": list(self.exclude), "weight": self.weight.to_dict(),
                "act": None if self.act is None else self.act.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Rule":
        if isinstance(d, dict) and ("modules" not in d or "weight" not in d):
            raise SSMQError("a rule needs 'modules' (patterns) and 'weight'")
        if isinstance(d, dict) and isinstance(d["modules"], str):  # one pattern
            d = {**d, "modules": [d["modules"]]}
        r = _from(cls, d, "rule")
        r.modules = list(r.modules)
        r.weight = WeightSpec.from_dict(r.weight)
        r.act = None if r.act is None else ActSpec.from_dict(r.act)
        validate_pair(r.weight, r.act)
        return r


@dataclass
class TapRule:
    """SSM activation taps: ``taps`` of the mixers of ``archs`` -> int ``bits`` with scales by ``layout``."""
    taps: list[str]
    layout: str = "per_tensor"
    observer: str = "absmax"
    percentile: float = 99.999
    state_groups: int = 1
    bits: int = 8
    archs: list[str] = field(default_factory=lambda: list(SSM_ARCHS))

    def validate(self) -> "TapRule":
        bad = sorted(set(self.taps) - set(TAPS))
        if bad:
            raise SSMQError(f"unknown tap(s) {bad}; known: {', '.join(TAPS)}")
        if self.layout not in TAP_LAYOUTS:
            raise SSMQError(f"unknown tap layout {self.layout!r}; known: {', '.join(TAP_LAYOUTS)}")
        if self.observer not in ("absmax", "percentile"):
            raise SSMQError(f"tap observer must be absmax or percentile, not {self.observer!r}")
        if not 0.0 < self.percentile <= 100.0:
            raise SSMQError(f"percentile must be in (0, 100], got {self.percentile}")
        from ssmq.quant.ssm.quantizer import SUPPORTED_BITS

        if self.bits not in SUPPORTED_BITS:
            raise SSMQError(f"SSM activations quantize to {SUPPORTED_BITS} bits (or stay 16-bit), not {self.bits}")
        if self.state_groups < 1:
            raise SSMQError(f"state_groups must be >= 1, got {self.state_groups}")
        return self


# int8 SSM state scales: static (G, n) tables calibrated per x group (Quamba2) or per channel, or one scale per row
# computed at every write ("dynamic": nothing calibrated, nothing clipped)
STATE_SCALES = ("x_groups", "per_channel", "dynamic")


@dataclass
class Cache:
    """Cache formats: SSM state bits (8: int8) and its scales, per (x scale group, state index) ("x_groups",
    Quamba2's), per (channel, state index) ("per_channel": the int8 state re-quantized at every decode step drifts
    far less, see README "8-bit SSM state cache") or per (sequence, channel) row, computed at every write
    ("dynamic"); KV format (None: float), given as a KVSpec, its JSON object or a
    KV preset's name (kept as the KVSpec it names)."""
    state_bits: int = 16
    kv: KVSpec | None = None
    state_scales: str = "x_groups"

    def __post_init__(self):
        if isinstance(self.kv, str):
            if self.kv not in KV_PRESETS:
                raise SSMQError(f"unknown KV format {self.kv!r}; known presets: {', '.join(KV_PRESETS)} "
                                "(or a KV spec object)")
            self.kv = KV_PRESETS[self.kv][0]
        elif isinstance(self.kv, dict):
            self.kv = KVSpec.from_dict(self.kv)

    def validate(self) -> "Cache":
        if self.state_bits not in (8, 16):
            raise SSMQError(f"state cache bits must be 8 or 16, not {self.state_bits}")
        if self.state_scales not in STATE_SCALES:
            raise SSMQError(f"cache.state_scales is one of {', '.join(STATE_SCALES)}, not {self.state_scales!r}")
        if self.kv is not None and not isinstance(self.kv, KVSpec):
            raise SSMQError(f"cache.kv is a KV spec object or a KV preset name, not {type(self.kv).__name__}")
        if self.kv is not None:
            self.kv.validate()
        return self

    def to_dict(self) -> dict:
        return {"state_bits": self.state_bits, "kv": None if self.kv is None else self.kv.to_dict(),
                "state_scales": self.state_scales}


@dataclass
class Calibration:
    """Windows (of the calibration set) the int8 state scales observe, every ``state_chunk`` tokens, and the
    windows a KV format is calibrated on (Fisher-weighted k-means, outlier thresholds)."""
    state_windows: int = 64
    state_chunk: int = 128
    kv_windows: int = 16  # windows whose keys, values and gradients calibrate a KV format

    def validate(self) -> "Calibration":
        for name in ("state_windows", "state_chunk", "kv_windows"):
            if getattr(self, name) < 1:
                raise SSMQError(f"calibration field {name!r} must be >= 1, got {getattr(self, name)}")
        return self


@dataclass
class Search:
    """Per-layer A8 / A16 (``a8_to_a16`` ratio) by evolutionary search on held-out calibration perplexity."""
    a8_to_a16: list[int] = field(default_factory=lambda: [3, 1])
    population: int = 40
    generations: int = 5
    mutations: int = 10
    crossovers: int = 10
    heldout_windows: int = 16
    heldout_seqlen: int = 512
    seed: int = 0

    def validate(self) -> "Search":
        r = list(self.a8_to_a16)
        if len(r) != 2 or min(r) < 0 or sum(r) == 0:
            raise SSMQError(f"a8_to_a16 must be two non-negative counts, got {r}")
        for name in ("population", "generations", "heldout_windows", "heldout_seqlen"):
            if getattr(self, name) < 1:
                raise SSMQError(f"search field {name!r} must be >= 1, got {getattr(self, name)}")
        for name in ("mutations", "crossovers", "seed"):
            if getattr(self, name) < 0:
                raise SSMQError(f"search field {name!r} must be >= 0, got {getattr(self, name)}")
        return self


@dataclass
class Recipe:
    name: str
    linears: list[Rule] = field(default_factory=list)
    transforms: list[Transform] = field(default_factory=list)
    taps: list[TapRule] = field(default_factory=list)
    embedding: WeightSpec | None = None
    cache: Cache = field(default_factory=Cache)
    calibration: Calibration = field(default_factory=Calibration)
    search: Search | None = None
    supported_archs: list[str] = field(default_factory=lambda: list(ARCHS))
    description: str = ""
    # every SSM layer's depthwise conv1d in int8 (``ssmq.quant.conv.QuantConv1d``): weight codes at this
    # granularity, input codes at a static per-tensor scale, bias codes per tensor; None keeps it 16-bit
    conv: str | None = None

    def validate(self) -> "Recipe":
        if not (self.linears or self.taps or self.cache.state_bits != 16 or self.cache.kv):  # e.g. KV-only
            raise SSMQError(f"recipe {self.name!r} has no rules for linear layers")
        bad = sorted(set(self.supported_archs) - set(ARCHS))
        if bad:
            raise SSMQError(f"recipe {self.name!r}: unknown architecture(s) {bad}; known: {', '.join(ARCHS)}")
        # SSDi8 recipes touch only the Mamba-2 layers, so they apply to hybrids too ("SSD-only"), as does an int8
        # state with dynamic row scales (nothing calibrated); the other SSM parts (taps, sort_cluster, hadamard_y,
        # the search, the calibrated Quamba2 int8 state) are for pure SSM models
        other = sorted(set(self.supported_archs) - set(SSM_ARCHS))
        ssm_parts = self.taps or self.has("sort_cluster") or self.has("hadamard_y") or self.search or (
            self.cache.state_bits != 16 and self.cache.state_scales != "dynamic"
            and not any(self.has(t) for t in SSD_TRANSFORMS))
        if self.conv is not None and self.conv not in CONV_GRANULARITIES:
            raise SSMQError(f"recipe {self.name!r}: conv is one of {', '.join(CONV_GRANULARITIES)} (int8 conv1d "
                            f"weights) or null, not {self.conv!r}")
        ssm_parts = ssm_parts or self.conv is not None
        if ssm_parts and other:
            raise SSMQError(f"recipe {self.name!r}: SSM taps, transforms and caches are for "
                            f"{', '.join(SSM_ARCHS)}, not {', '.join(other)}")
        for part in (*self.transforms, *self.taps, self.cache, self.calibration,
                     *([self.search] if self.search else [])):
            part.validate()
        for r in self.linears:
            validate_pair(r.weight, r.act)
        if self.embedding is not None and self.embedding.validate().method != "rtn":
            raise SSMQError(f"recipe {self.name!r}: the embedding is quantized by round to nearest only")
        return self

    def has(self, transform: str) -> bool:
        return any(t.name == transform for t in self.transforms)

    def param(self, transform: str, key: str):
        """The first ``transform``'s ``key`` (its default when unset); None without that transform."""
        return next((t.get(key) for t in self.transforms if t.name == transform), None)

    def needs_calibration(self) -> bool:
        state_calibrated = self.cache.state_bits != 16 and self.cache.state_scales != "dynamic"
        return bool(self.taps or self.search or state_calibrated or self.cache.kv or self.conv) or any(
            t.name in ("smoothquant", "sort_cluster", "ssdi8", "mean_correction") for t in self.transforms) or any(
            r.weight.method == "gptq" or (r.act is not None and r.act.static) for r in self.linears)

    def at_16bit_activations(self) -> "Recipe":
        """The same recipe with float activations (the search's A16 variant)."""
        return replace(self, name=f"{self.name}/a16", taps=[], search=None,
                       linears=[replace(r, act=None) for r in self.linears])

    def with_changes(self, **kw) -> "Recipe":
        return replace(self, **kw).validate()

    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "description": self.description,
                "supported_archs": list(self.supported_archs),
                "transforms": [{"name": t.name, "params": dict(t.params)} for t in self.transforms],
                "linears": [r.to_dict() for r in self.linears], "taps": [dict(t.__dict__) for t in self.taps],
                "embedding": None if self.embedding is None else self.embedding.to_dict(),
                "cache": self.cache.to_dict(), "calibration": dict(self.calibration.__dict__),
                "search": None if self.search is None else dict(self.search.__dict__)} | (
                    {} if self.conv is None else {"conv": self.conv})  # absent when 16-bit: older files unchanged

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        if not isinstance(d, dict):
            raise SSMQError("a recipe is a JSON object")
        d = dict(d)
        if d.get("format", 1 if "rules" in d or "kind" in d else FORMAT) == 1:
            d = _from_format1(d)
        elif d.get("format", FORMAT) != FORMAT:
            raise SSMQError(f"recipe format {d['format']} is not supported (this ssmq reads formats 1 and {FORMAT})")
        d.pop("format", None)
        d.setdefault("name", "custom")
        d.update({k: d.get(k) or {} for k in ("cache", "calibration")})
        r = _from(cls, d, "recipe")
        r.transforms = [Transform(t) if isinstance(t, str) else _from(Transform, t, "transform") for t in r.transforms]
        r.linears = [Rule.from_dict(x) for x in r.linears]
        r.taps = [_from(TapRule, t, "tap rule") for t in r.taps]
        r.embedding = None if r.embedding is None else WeightSpec.from_dict(r.embedding)
        r.cache, r.calibration = _from(Cache, r.cache, "cache"), _from(Calibration, r.calibration, "calibration")
        r.search = None if r.search is None else _from(Search, r.search, "search")
        r.supported_archs = list(r.supported_archs)
        return r.validate()

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


def _from_format1(d: dict) -> dict:
    """ssmq 0.1's two recipe kinds -> format 2 (same meaning)."""
    d["format"] = FORMAT
    if d.pop("kind", None) != "ssm":
        d["linears"] = d.pop("rules", [])
        return d
    d.setdefault("supported_archs", list(SSM_ARCHS))
    d["cache"] = {"state_bits": d.pop("state_bits", 16)}
    mixed = d.pop("mixed", None)
    if mixed is not None:  # {"a8": NAME, "a16": NAME, search params}: the A8 recipe plus a search
        mixed = dict(mixed)
        a8, a16 = get_recipe(mixed.pop("a8", "quamba2-w4a8")), get_recipe(mixed.pop("a16", "quamba2-w4a16"))
        if a16.to_dict() | {"name": "", "description": "", "search": None} != \
                a8.at_16bit_activations().to_dict() | {"name": "", "description": ""}:
            raise SSMQError(f"recipe {d.get('name')!r}: a mixed pair of {a8.name} and {a16.name} that differ in more than "
                            "activation bits has no format-2 form; write the A8 recipe with a 'search' field")
        base = a8.to_dict()
        d.update({k: base[k] for k in ("transforms", "linears", "taps", "embedding", "cache", "calibration")})
        d["search"] = mixed
    return d


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------
RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    RECIPES[recipe.name] = recipe.validate()
    return recipe


def get_recipe(name_or_path) -> Recipe:
    """A registered name, a path to a JSON file (format 1 or 2), ``A+B`` (``with_cache``: B a KV preset or
    ``int8-state``), or a Recipe (validated)."""
    if isinstance(name_or_path, Recipe):
        return name_or_path.validate()
    key = str(name_or_path)
    if key in RECIPES:
        return RECIPES[key]
    p = Path(key).expanduser()
    if p.is_file():
        try:
            return Recipe.from_json(p.read_text())
        except SSMQError as e:
            raise SSMQError(f"{p}: {e}") from None
    if "+" in key:
        base, *extras = key.split("+")
        recipe = get_recipe(base)
        for extra in extras:
            recipe = with_cache(recipe, get_recipe(extra))
        return recipe
    raise SSMQError(f"unknown recipe {key!r}: not a file, and not one of {', '.join(sorted(RECIPES))}")


def is_cache_only(recipe: Recipe) -> bool:
    """A recipe that only sets cache formats (a KV preset, ``int8-state``): what may follow '+' in ``A+B``."""
    return (recipe.cache.kv is not None or recipe.cache.state_bits != 16) and not (
        recipe.linears or recipe.transforms or recipe.taps or recipe.embedding or recipe.search)


def with_cache(recipe: Recipe, extra: Recipe) -> Recipe:
    """``recipe`` with the cache formats of the cache-only recipe ``extra`` (named ``recipe.name+extra.name``): its KV
    format on the attention layers, its int8 SSM state on the Mamba layers."""
    name = f"{recipe.name}+{extra.name}"
    if not is_cache_only(extra):
        raise SSMQError(f"{name}: the part after '+' must be a cache-only recipe (a KV preset such as "
                        "kvquant-nuq3-1%, or int8-state)")
    cache = recipe.cache
    if extra.cache.kv is not None:
        if cache.kv is not None:
            raise SSMQError(f"{name}: {recipe.name} already has a KV format")
        cache = replace(cache, kv=extra.cache.kv)
    if extra.cache.state_bits != 16:
        if cache.state_bits != 16:
            raise SSMQError(f"{name}: {recipe.name} already has an int8 SSM state")
        cache = replace(cache, state_bits=extra.cache.state_bits, state_scales=extra.cache.state_scales)
    archs = [a for a in recipe.supported_archs if a in extra.supported_archs]
    if not archs:
        what = "a KV format for models with attention" if extra.cache.kv is not None else "an SSM state format"
        raise SSMQError(f"{name}: {recipe.name} is for {', '.join(recipe.supported_archs)}, {extra.name} is {what} "
                        f"({', '.join(extra.supported_archs)})")
    return replace(recipe, name=name, cache=cache, supported_archs=archs,
                   description=f"{recipe.description}; cache: {extra.description}").validate()


# ---------------------------------------------------------------------------------------------
# the built-in recipes. Choices the papers leave open, stated once:
#   - every linear of every block except Mamba-1's dt_proj (0.1% of the weights; its in_features,
#     dt_rank = d_model / 16, is rarely a multiple of a group size), unless said otherwise
#   - 4-bit weights: GPTQ, symmetric, groups of 128 along k, block 128, damp 0.01
#   - Quamba: per-tensor weights (the paper's "static per-tensor"); Quamba2 8-bit weights: per output channel
#   - Quamba2: x_proj (Mamba-1) stays 8-bit per-channel; head-to-toe = embedding rows 8-bit (per row),
#     lm_head per-group 128 at the weight bits; x: m = 4 head groups x n = 4 channel groups, percentile
#     99.999 inside each group; B, C: one scale per B/C group; z, Δ (Mamba-1 only): per tensor
# ---------------------------------------------------------------------------------------------
def _w(dtype: str, gran: str = "per_channel", method: str = "rtn") -> WeightSpec:
    return WeightSpec.from_dict({"dtype": dtype, "granularity": gran, "method": method})


NO_DT = ["*.dt_proj"]
STATIC_A8 = ActSpec.from_dict({"dtype": "int8", "granularity": "per_tensor", "static": True, "observer": "absmax"})
DYNAMIC_A8 = ActSpec.from_dict({"dtype": "int8", "granularity": "per_token", "static": False})
HADAMARD = Transform("hadamard", {"online": True})


def _all(weight: WeightSpec, act: ActSpec | None = None) -> list[Rule]:
    return [Rule(["layers.*"], weight, act, list(NO_DT))]


def _taps(x_layout: str, x_observer: str, bc_layout: str) -> list[TapRule]:
    return [TapRule(["act_x"], x_layout, x_observer), TapRule(["act_B", "act_C"], bc_layout),
            TapRule(["act_z"]), TapRule(["act_dt"], archs=["mamba1"])]


def _quamba2(wbits: int, abits: int, integer: bool = False) -> Recipe:
    """Quamba2 W{wbits}A{abits}; ``integer``: the "-int" twin, with int8 dt_proj (per-channel, static input) and
    int8 conv1d."""
    w_proj = _w("int4", "per_group:128", "gptq") if wbits == 4 else _w("int8")
    act = STATIC_A8 if abits == 8 else None
    linears = [Rule(["layers.*.mixer.in_proj", "layers.*.mixer.out_proj"], w_proj, act),
               Rule(["layers.*.mixer.*_proj"], _w("int8"), act, [] if integer else list(NO_DT)),  # x_proj, dt_proj
               Rule(["lm_head"], _w(f"int{wbits}", "per_group:128", "gptq" if wbits == 4 else "rtn"), act)]
    if integer:
        return replace(_quamba2(wbits, abits), name=f"quamba2-w{wbits}a{abits}-int", linears=linears,
                       conv="per_tensor",
                       description=f"Quamba2 W{wbits}A{abits}, integer path: quamba2-w{wbits}a{abits} plus int8 "
                                   "conv1d (per-tensor weight, input and bias codes) and, on Mamba-1, int8 dt_proj "
                                   "(per-channel weights, static per-tensor input)")
    return Recipe(f"quamba2-w{wbits}a{abits}", linears,
                  [Transform("sort_cluster", {"m": 4, "n": 4}), Transform("hadamard")],
                  _taps("cluster", "percentile", "state_group") if abits == 8 else [], _w("int8"),
                  supported_archs=list(SSM_ARCHS),
                  description=f"Quamba2 W{wbits}A{abits}: sort-and-cluster x (4x4 scales), per-state-group "
                              "B/C, both-sides Hadamard, " + ("GPTQ int4 g128" if wbits == 4 else "int8") +
                              " weights, head-to-toe")


for _r in [
    Recipe("rtn-w8a16", _all(_w("int8")), description="int8 per-channel weights, round to nearest"),
    Recipe("rtn-w4a16-g128", _all(_w("int4", "per_group:128")), description="int4 weights, groups of 128, round to nearest"),
    Recipe("static-w8a8", _all(_w("int8", "per_tensor"), STATIC_A8),
           description="naive W8A8: per-tensor int8 weights, static per-tensor absmax activation scales"),
    Recipe("dynamic-w8a8", _all(_w("int8"), DYNAMIC_A8),
           description="int8 per-channel weights, dynamic per-token int8 activations"),
    Recipe("smoothquant-w8a8", _all(_w("int8"), STATIC_A8), [Transform("smoothquant", {"alpha": 0.5})],
           description="SmoothQuant (alpha 0.5) + per-channel weights + static per-tensor activations"),
    Recipe("hadamard-w8a8", _all(_w("int8"), DYNAMIC_A8), [HADAMARD],
           description="QuaRot-style: Hadamard-rotated residual stream and online Hadamard on out_proj/"
                       "o_proj/down_proj inputs; per-channel weights, dynamic per-token activations"),
    Recipe("fp8-w8a8", _all(WeightSpec.from_dict({"dtype": "fp8"}),
                            ActSpec.from_dict({"dtype": "fp8", "granularity": "per_token", "static": False})),
           description="FP8 e4m3 per-channel weights, dynamic per-token e4m3 activations (in_proj / out_proj "
                       "etc.; conv1d and the SSM stay 16-bit)"),
    Recipe("gptq-w4a16-g128", _all(_w("int4", "per_group:128", "gptq")),
           description="GPTQ int4 weights, groups of 128, block 128, damp 0.01"),
    Recipe("quamba-w8a8", [Rule(["layers.*.mixer.*_proj"], _w("int8", "per_tensor"), STATIC_A8, list(NO_DT))],
           [Transform("hadamard_y")], _taps("per_tensor", "percentile", "per_tensor"), supported_archs=list(SSM_ARCHS),
           description="Quamba: static per-tensor W8A8, Hadamard on y fused into out_proj, percentile (99.999) "
                       "clipping of the SSM input x"),
    _quamba2(8, 8), _quamba2(4, 8), _quamba2(4, 16),
    # the papers' integer path, whole: conv1d and Mamba-1's dt_proj (F_Δ) int8 too, as named twins so that
    # quamba-w8a8 / quamba2-w*a8 keep their meaning (and their checkpoints and accuracy figures); dt_proj's bias
    # stays float32 inside the scan (Quamba's delta_bias)
    Recipe("quamba-w8a8-int", [Rule(["layers.*.mixer.*_proj"], _w("int8", "per_tensor"), STATIC_A8)],
           [Transform("hadamard_y")], _taps("per_tensor", "percentile", "per_tensor"), supported_archs=list(SSM_ARCHS),
           conv="per_tensor",
           description="Quamba W8A8, integer path: quamba-w8a8 plus int8 conv1d (per-tensor weight, input and "
                       "bias codes) and, on Mamba-1, int8 dt_proj (per-tensor weights, static per-tensor input)"),
    _quamba2(8, 8, integer=True), _quamba2(4, 8, integer=True),
]:
    register_recipe(_r)


def _ssdi8(wbits: int, eta: float = 0.15) -> Recipe:
    """SSDi8 W8A8 / W4A8: in_proj and out_proj only ("SSD-only": attention, MLP, embedding and lm_head of the model
    stay 16-bit), static per-tensor int8 activations, γ migration + both-sides Hadamard, int8 SSD with persistent
    int8 state (the state cache too, at the scan's scales), mean correction η at out_proj's output."""
    w = _w("int4", "per_group:128", "gptq") if wbits == 4 else _w("int8")
    return Recipe(f"ssdi8-w{wbits}a8", [Rule(["layers.*.mixer.in_proj", "layers.*.mixer.out_proj"], w, STATIC_A8)],
                  [Transform("gamma_migration"), HADAMARD, Transform("ssdi8"),
                   Transform("mean_correction", {"eta": eta})],
                  cache=Cache(state_bits=8), supported_archs=["mamba2", "hybrid"],
                  description=f"SSDi8 W{wbits}A8: int8 SSD inside (early B/C quantization, reformulated chunk "
                              "state, persistent int8 state, fixed-point state passing), γ migration, both-sides "
                              f"Hadamard, {'GPTQ int4 g128' if wbits == 4 else 'int8 per-channel'} in/out_proj, "
                              f"mean correction η = {eta}; Mamba-2 layers only")


register_recipe(_ssdi8(8))
register_recipe(_ssdi8(4))
# the SSM state cache alone in int8 (weights and activations 16-bit): the state's bytes are what a large decode batch
# moves, so this is the speed and capacity half of Quamba2's 8-bit cache, with dynamic row scales (nothing to
# calibrate; on the decode path they drift less than the x-group table, README "8-bit SSM state cache")
register_recipe(Recipe("int8-state", cache=Cache(state_bits=8, state_scales="dynamic"),
                       supported_archs=["mamba1", "mamba2", "hybrid"],
                       description="int8 SSM state cache with a dynamic scale per (sequence, channel) row; weights "
                                   "and activations stay 16-bit"))
register_recipe(RECIPES["quamba2-w4a8"].with_changes(
    name="quamba2-mixed", search=Search(),
    description="Quamba2 W4AX: per-layer A8/A16 (3:1) by evolutionary search on held-out calibration perplexity"))

for _name, (_spec, _what) in KV_PRESETS.items():  # for the architectures with attention layers (a KV cache)
    register_recipe(Recipe(_name, cache=Cache(kv=_spec), supported_archs=list(ATTENTION_ARCHS),
                           description=f"{_what} (KV cache only)"))
