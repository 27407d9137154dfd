"""The kv-cache dtype registry, with vLLM's semantics (docs/DESIGN.md, "kv-cache dtypes").

No torch import at module level: ``kvdiag --help`` must stay instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.errors import UserError

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
INT8_MAX = 127.0
SCALE_FLOOR = 1e-6


@dataclass(frozen=True)
class KVDType:
    name: str
    storage: str  # "model" or a torch dtype name
    quant: str  # "none" | "per_tensor" | "per_token_head"
    qmax: float | None = None  # the largest code magnitude (448, 57344, 127)
    same_as: str | None = None  # another name of the same dtype
    scale_rule: str = "-"
    aliases: tuple[str, ...] = field(default=())
    drift: str = ""  # its drift limits (checks/sweep/drift.py: FAMILY_LIMITS) when not bit-identical to the model dtype

    @property
    def quantized(self) -> bool:
        return self.quant != "none"

    @property
    def bytes_per_element(self) -> int | None:
        return None if self.storage == "model" else _BYTES[self.storage]

    def torch_dtype(self, model_dtype=None):
        import torch

        if self.storage == "model":
            if model_dtype is None:
                raise ValueError("'auto' stores in the model dtype; pass model_dtype")
            return model_dtype
        return getattr(torch, self.storage)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "storage": self.storage,
            "quant": self.quant,
            "scale_rule": self.scale_rule,
            "bytes_per_element": self.bytes_per_element,
            "same_as": self.same_as,
            "aliases": list(self.aliases),
        }


_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}

_PER_TENSOR = "per-tensor k/v scale (checkpoint, else 1.0); x/scale saturated to ±{qmax:g}"
_PER_TOKEN_HEAD = "float32 per (token, kv head) = max(absmax/{qmax:g}, 1e-6)"

BUILTIN_DTYPES: dict[str, KVDType] = {
    d.name: d
    for d in [
        KVDType("auto", "model", "none", scale_rule="- (model dtype)", drift="identical"),
        KVDType("bfloat16", "bfloat16", "none", aliases=("bf16",), drift="unquantized"),
        KVDType("float16", "float16", "none", aliases=("fp16", "half"), drift="unquantized"),
        KVDType("fp8", "float8_e4m3fn", "per_tensor", FP8_E4M3_MAX,
                scale_rule=_PER_TENSOR.format(qmax=FP8_E4M3_MAX), drift="fp8_e4m3"),
        KVDType("fp8_e4m3", "float8_e4m3fn", "per_tensor", FP8_E4M3_MAX, same_as="fp8",
                scale_rule=_PER_TENSOR.format(qmax=FP8_E4M3_MAX), aliases=("e4m3",), drift="fp8_e4m3"),
        KVDType("fp8_e5m2", "float8_e5m2", "per_tensor", FP8_E5M2_MAX,
                scale_rule=_PER_TENSOR.format(qmax=FP8_E5M2_MAX), aliases=("e5m2",), drift="fp8_e5m2"),
        KVDType("int8_per_token_head", "int8", "per_token_head", INT8_MAX,
                scale_rule=_PER_TOKEN_HEAD.format(qmax=INT8_MAX) + "; round half away; clamp [-128,127]",
                aliases=("int8", "int8pth", "int8_pth"), drift="int8_per_token_head"),
        KVDType("fp8_per_token_head", "float8_e4m3fn", "per_token_head", FP8_E4M3_MAX,
                scale_rule=_PER_TOKEN_HEAD.format(qmax=FP8_E4M3_MAX), aliases=("fp8pth", "fp8_pth"),
                drift="fp8_per_token_head"),
    ]
}


# Kv dtype names of other engines that the builtin engine does not have (vLLM's CacheDType beyond the names above,
# torch's names for unquantized dtypes), each with the family of its drift limits: the quantized ones, whose error
# kvdiag has not calibrated, the loosest. Which names an engine accepts is still the engine's own word (vLLM's are
# read from CacheDType); tests/unit/test_drift_limits.py fails when the installed vLLM has a name missing here.
OTHER_ENGINE_DTYPES: dict[str, str] = {
    **dict.fromkeys(("float32", "float", "half", "bf16", "fp16"), "unquantized"),
    **dict.fromkeys(("fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4", "nvfp4_4over6", "int4_per_token_head",
                     "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                     "ultraquant_4bit"), "quantized"),
}


def drift_family(name: str) -> str | None:
    """The family of a kv dtype's drift limits (its ``drift``, else ``OTHER_ENGINE_DTYPES``); None for a name the
    registry does not know."""
    d = get(name)
    return d.drift if d is not None else OTHER_ENGINE_DTYPES.get(name)


def _alias_table(names) -> dict[str, str]:
    table = {}
    for name in names:
        d = BUILTIN_DTYPES.get(name)
        for alias in d.aliases if d else ():
            table.setdefault(alias, name)
    return table


def resolve(user: str, valid: list[str] | tuple[str, ...], engine: str = "builtin") -> str:
    """Map what a user typed (a name or a short alias, any case) to one of ``valid``.

    Raises UserError naming the valid choices for the engine.
    """
    key = user.strip().lower().replace("-", "_")
    if key in valid:
        return key
    alias = _alias_table(valid).get(key)
    if alias is not None:
        return alias
    hint = closest_name(key, {**{n: n for n in valid}, **_alias_table(valid)})
    hint = f" (did you mean '{hint}'?)" if hint else ""
    raise UserError(f"unknown kv-cache dtype '{user}' for engine '{engine}'{hint}; valid: {', '.join(valid)}")


def closest_name(key: str, names: dict[str, str]) -> str | None:
    """The name whose spelling (its own or an alias: ``names`` maps each to its name) is nearest ``key`` (difflib),
    None when none is near: ``fp88`` -> ``fp8``, ``bf61`` -> ``bfloat16``. Only among spellings with the same digits:
    a bit width is no typo (``int4`` is not ``int8``, ``e5m3`` not ``e5m2``)."""
    import difflib

    digits = set(filter(str.isdigit, key))
    near = difflib.get_close_matches(key, [n for n in names if set(filter(str.isdigit, n)) == digits], n=1)
    return names[near[0]] if near else None


def sweep_names(valid) -> list[str]:
    """The dtypes a sweep runs by default: every name, less the ones that are another's synonym."""
    return [n for n in valid if not (n in BUILTIN_DTYPES and BUILTIN_DTYPES[n].same_as in valid)]


def get(name: str) -> KVDType | None:
    return BUILTIN_DTYPES.get(name)


QUANTIZED_WORDS = ("fp8", "fp4", "int8", "int4", "int2", "mxfp", "nf4", "e4m3", "e5m2", "turboquant")


def named_quantized(name: str) -> bool:
    """Whether a kv dtype's name says it stores quantized values: the registry's word where it knows the name,
    else the name itself (an engine's own dtypes: fp8_inc, nvfp4, turboquant_k8v4, ...)."""
    d = get(name)
    return d.quantized if d is not None else any(w in name.lower() for w in QUANTIZED_WORDS)


def element_bytes(torch_dtype: str | None) -> int | None:
    """Bytes per element of a torch dtype named without ``torch.`` (``bfloat16``: 2); None when unknown."""
    return _BYTES.get(str(torch_dtype).removeprefix("torch."))
