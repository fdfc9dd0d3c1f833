"""Quantized HF checkpoints served as stored: a config.json's `quantization_config` read into the
scheme each linear module's weight is stored in.

compressed-tensors (what llm-compressor writes; `quant_method: compressed-tensors`) lists config
groups, each a scheme and the modules it `targets` ("Linear", a module name, or "re:" and a
regular expression matched from the name's start), minus the `ignore` list (same forms):

    format            weights                                    tensors of a module NAME
    pack-quantized    int 4 / 8 bits, packed 32 / bits per int32  NAME.weight_packed, NAME.weight_scale,
                                                                  NAME.weight_shape (NAME.weight_zero_point)
    int-quantized     int8                                       NAME.weight (int8), NAME.weight_scale
    float-quantized   float8 e4m3                                NAME.weight (F8_E4M3), NAME.weight_scale
    naive-quantized   either, unpacked

with one scale per output channel (`channel`), per group of inputs (`group`, `group_size`) or
per tensor, zero points where `symmetric` is false, and input activations quantized per token
or per tensor on the fly (`dynamic`: W8A8's int8, FP8_DYNAMIC's float8). What is not served is
refused here, by name, before anything is read: another quant_method, a static activation scale,
act-order (`actorder`), block scales, sparsity, a KV cache scheme, targets other than linear
layers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

METHODS = ("compressed-tensors", "gptq", "awq")
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
GPTQ_FORMATS = ("gptq", "gptq_v2")  # zero points stored minus one (v1), or as they are
STRATEGIES = ("tensor", "channel", "group")


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one module's weight is stored, and what its input activations go through."""

    kind: str  # "int" or "float"
    bits: int  # int: 4 or 8; float: 8 (e4m3)
    strategy: str  # "tensor", "channel" or "group"
    group: int  # inputs per scale with strategy "group", else 0
    symmetric: bool
    format: str
    activations: str | None = None  # "int8" / "fp8" quantized on the fly per token (or per tensor)
    activations_per: str = "token"

    def name(self) -> str:
        """E.g. "W4A16 g128", "W8A8 int8 per-channel", "FP8 per-channel, dynamic fp8 activations"."""
        weights = f"W{self.bits}" if self.kind == "int" else "FP8"
        acts = {"int8": "A8", "fp8": "A8"}.get(self.activations or "", "A16")
        parts = [
            weights + (acts if self.kind == "int" else ""),
            f"g{self.group}" if self.group else f"per-{self.strategy}",
        ]
        if not self.symmetric:
            parts.append("asymmetric")
        if self.activations:
            parts.append(f"{self.activations} activations per {self.activations_per}")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class StoredQuantization:
    """A checkpoint's quantization_config: (targets, scheme) per group and what is ignored."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of a linear module (its HF name, e.g. "model.layers.0.mlp.up_proj"), or None
        where it is stored float (ignored, or in no group's targets)."""
        if any(_matches(module, pattern) for pattern in self.ignore):
            return None
        return next((scheme for targets, scheme in self.groups if any(_matches(module, t) for t in targets)), None)

    @property
    def activations(self) -> str | None:
        """The activation quantization its schemes share (checked to be one in `parse`)."""
        return self.groups[0][1].activations if self.groups else None

    def describe(self) -> str:
        return f"{self.method}: " + "; ".join(scheme.name() for _, scheme in self.groups)


def _matches(module: str, target: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target


def parse(config: Mapping[str, Any] | None, where: str) -> StoredQuantization | None:
    """config.json's `quantization_config` (None: a float checkpoint) -> its StoredQuantization,
    or a ValueError naming what is not served."""
    if not config:
        return None
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: quantization_config must be an object, not {config!r:.80}")
    method = config.get("quant_method")
    if method not in METHODS:
        raise ValueError(
            f"{where}: quantization_config.quant_method={method!r} is not served; "
            f"quantized checkpoints load from {', '.join(METHODS)}, GGUF, or jaxinfer's own orbax"
        )
    if method == "gptq":
        return _gptq(config, f"{where}: quantization_config")
    if method == "awq":
        return _awq(config, f"{where}: quantization_config")
    _refuse_extras(config, where)
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}: quantization_config.config_groups must name at least one group, not {groups!r:.80}")
    parsed = []
    for name, group in groups.items():
        at = f"{where}: quantization_config.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise ValueError(f"{at} must be an object, not {group!r:.80}")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"{at}.targets must be a list of module names or patterns, not {targets!r:.80}")
        for target in targets:
            if target != "Linear" and not target.startswith("re:") and target[:1].isupper():
                raise ValueError(
                    f"{at}.targets: {target!r} is not a linear layer; only linear layers are served quantized"
                )
        scheme = _scheme(group, config.get("format"), at)
        parsed.append((tuple(targets), scheme))
    if len({(s.activations, s.activations_per) for _, s in parsed}) > 1:
        raise ValueError(f"{where}: config groups quantize activations differently; one activation scheme is served")
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ValueError(f"{where}: quantization_config.ignore must be a list of module names, not {ignore!r:.80}")
    return StoredQuantization(method, tuple(parsed), tuple(ignore))


def _refuse_extras(config: Mapping[str, Any], where: str) -> None:
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(
            f"{where}: quantization_config.quantization_status={status!r}: only compressed checkpoints "
            "(saved with save_compressed=True) are served"
        )
    if config.get("sparsity_config"):
        raise ValueError(f"{where}: quantization_config.sparsity_config: sparse checkpoints are not served")
    if config.get("kv_cache_scheme"):
        raise ValueError(
            f"{where}: quantization_config.kv_cache_scheme: a quantized KV cache with stored scales is not "
            "served (the engine's own --kv-cache-dtype quantizes the cache)"
        )
    if config.get("transform_config"):
        raise ValueError(f"{where}: quantization_config.transform_config: rotated (transformed) weights are not served")


def _scheme(group: Mapping[str, Any], default_format: Any, at: str) -> WeightScheme:
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise ValueError(f"{at}.weights: activation-only quantization is not served (weights must be quantized)")
    if group.get("output_activations"):
        raise ValueError(f"{at}.output_activations: quantized outputs are not served")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        raise ValueError(f"{at}.weights: type={kind!r} num_bits={bits!r} is not served (int 4 / 8 bits, float 8 bits)")
    if strategy not in STRATEGIES:
        raise ValueError(f"{at}.weights.strategy={strategy!r} is not served; one of {list(STRATEGIES)}")
    if weights.get("dynamic"):
        raise ValueError(f"{at}.weights.dynamic=true: weights quantized on the fly are not served")
    if weights.get("actorder") not in (None, False, "static"):
        raise ValueError(f"{at}.weights.actorder={weights.get('actorder')!r}: act-order (g_idx) weights are not served")
    group_size = weights.get("group_size") if strategy == "group" else 0
    if strategy == "group" and (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2):
        raise ValueError(f"{at}.weights.group_size={group_size!r}: a group strategy needs an integer group size >= 2")
    fmt = group.get("format") or default_format
    if fmt not in FORMATS:
        raise ValueError(f"{at}: format {fmt!r} is not served; one of {list(FORMATS)}")
    if (fmt == "pack-quantized" and kind != "int") or (fmt == "int-quantized" and (kind, bits) != ("int", 8)):
        raise ValueError(f"{at}: format {fmt!r} cannot hold {kind} {bits}-bit weights")
    if fmt == "float-quantized" and kind != "float":
        raise ValueError(f"{at}: format {fmt!r} cannot hold {kind} weights")
    symmetric = weights.get("symmetric", True)
    if kind == "float" and not symmetric:
        raise ValueError(f"{at}.weights: asymmetric float8 weights are not served")
    activations, per = _activations(group.get("input_activations"), at)
    return WeightScheme(
        str(kind), int(bits or 0), str(strategy), int(group_size or 0), bool(symmetric), fmt, activations, per
    )


def _activations(acts: Any, at: str) -> tuple[str | None, str]:
    if not acts:
        return None, "token"
    if not isinstance(acts, Mapping):
        raise ValueError(f"{at}.input_activations must be an object, not {acts!r:.80}")
    kind, bits, strategy = acts.get("type"), acts.get("num_bits"), acts.get("strategy")
    if (kind, bits) not in (("int", 8), ("float", 8)):
        raise ValueError(f"{at}.input_activations: type={kind!r} num_bits={bits!r} is not served (int8 or float8)")
    if not acts.get("dynamic"):
        raise ValueError(
            f"{at}.input_activations.dynamic=false: static activation scales are not served; "
            "dynamic (per token) activation quantization is"
        )
    if strategy not in ("token", "tensor"):
        raise ValueError(f"{at}.input_activations.strategy={strategy!r} is not served; token or tensor")
    if not acts.get("symmetric", True):
        raise ValueError(f"{at}.input_activations: asymmetric activation quantization is not served")
    return ("int8" if kind == "int" else "fp8"), strategy


def _packed_4_8(config: Mapping[str, Any], at: str, bits_allowed: tuple[int, ...]) -> tuple[int, int]:
    """(bits, group: 0 for one scale per output channel) of a GPTQ / AWQ config, checked."""
    bits, group = config.get("bits"), config.get("group_size", -1)
    if bits not in bits_allowed:
        raise ValueError(f"{at}.bits={bits!r} is not served; one of {list(bits_allowed)}")
    if group == -1:
        return bits, 0
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2:
        raise ValueError(f"{at}.group_size={group!r}: expected -1 (per channel) or an even integer >= 2")
    return bits, group


def _gptq(config: Mapping[str, Any], at: str) -> StoredQuantization:
    """GPTQ (AutoGPTQ / GPTQModel): 4- or 8-bit packed weights, act-order (`desc_act`) allowed."""
    bits, group = _packed_4_8(config, at, (4, 8))
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"{at}.checkpoint_format={fmt!r} is not served; one of {list(GPTQ_FORMATS)}")
    if config.get("lm_head"):
        raise ValueError(f"{at}.lm_head=true: a quantized LM head is not served")
    targets: tuple[str, ...] = ("Linear",)
    blocks = config.get("modules_in_block_to_quantize")
    if blocks:
        names = [n for block in blocks for n in (block if isinstance(block, list) else [block])]
        targets = tuple(f"re:.*\\.{re.escape(str(n))}$" for n in names)
    sym = bool(config.get("sym", True))
    scheme = WeightScheme("int", bits, "group" if group else "channel", group, sym, fmt)
    return StoredQuantization("gptq", ((targets, scheme),), ("lm_head",))


def _awq(config: Mapping[str, Any], at: str) -> StoredQuantization:
    """AutoAWQ GEMM: 4-bit weights packed along the outputs, with zero points."""
    bits, group = _packed_4_8(config, at, (4,))
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{at}.version={config.get('version')!r} is not served; AutoAWQ's gemm layout is")
    if not config.get("zero_point", True):
        raise ValueError(f"{at}.zero_point=false: AWQ without zero points is not served")
    skipped = config.get("modules_to_not_convert") or []
    ignore = ("lm_head", *(f"re:.*{re.escape(str(name))}.*" for name in skipped))
    scheme = WeightScheme("int", bits, "group" if group else "channel", group, False, "awq")
    return StoredQuantization("awq", ((("Linear",), scheme),), ignore)
