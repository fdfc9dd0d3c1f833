"""The MoE family's model code: Mixtral and Qwen3-MoE (one decoder), on Llama's attention.

Data flow of `forward`: token ids -> embedding -> for each layer [Llama's attention block (RMSNorm,
fused q|k|v, Qwen3-MoE's QK-norm, RoPE, ragged paged attention, output projection, residual) ->
RMSNorm -> the layer's MLP -> residual] -> final RMSNorm -> hidden states. A sparse layer's MLP
routes each token (float32 softmax over the X router logits, top k, renormalised for Mixtral and
for Qwen3-MoE with norm_topk_prob) to k of its X experts and sums their gated MLPs weighted by
the router (experts.moe_mlp); a dense layer (Qwen3-MoE's mlp_only_layers, decoder_sparse_step)
runs Llama's gated MLP. `compute_logits` is Llama's.

Expert weights are stacked: `experts_gate_up` [X, E, 2, F] (gate | up fused as in Llama's dense
MLP) and `experts_down` [X, F, E]. An HF checkpoint holds one tensor per expert; each is loaded
and placed under its own field ("expert_gate.3" for expert 3) and `assemble` stacks them once (a
GGUF's come stacked per projection: experts_gate, experts_up). The
logical axis "experts" maps to the mesh axis `expert` (each device holds whole experts) and F to
`tensor` like a dense MLP's columns; sharding/experts.py runs each device's part and sums them
with one all-reduce after the MLP.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator, Mapping

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.typing import DTypeLike

from jaxinfer.config import ModelConfig
from jaxinfer.models import layers as L
from jaxinfer.models.experts import Experts, moe_mlp
from jaxinfer.models.linear_layout import linear_layout
from jaxinfer.models.llama import model as llama
from jaxinfer.models.ticks import decoder_tick
from jaxinfer.quant import stack, unstack

compute_logits = llama.compute_logits
_DENSE_MLP = ("w_gate", "w_up", "w_down")
_PER_EXPERT = ("expert_gate", "expert_up", "expert_down")


@flax.struct.dataclass
class MoeLayer:
    attn_norm: jax.Array  # [E]
    w_qkv: jax.Array  # [E, K, G+2, D] as in LlamaLayer
    wo: jax.Array  # [H, D, E]
    mlp_norm: jax.Array  # [E]
    router: jax.Array | None = None  # [E, X]: sparse layers only
    experts_gate_up: Experts | None = None  # [X, E, 2, F], or X arrays [E, 2, F] (compute_layout)
    experts_down: Experts | None = None  # [X, F, E], or X arrays [F, E]
    w_gate_up: jax.Array | None = None  # [E, 2, F]: dense layers only
    w_down: jax.Array | None = None  # [F, E]
    b_qkv: jax.Array | None = None  # [K, G+2, D]
    bo: jax.Array | None = None  # [E]
    q_norm: jax.Array | None = None  # [D]
    k_norm: jax.Array | None = None  # [D]


@flax.struct.dataclass
class MoeParams:
    embed: jax.Array  # [V, E]
    layers: tuple[MoeLayer, ...]
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None = None  # [E, V]; None when tied to `embed`


def _base_field(field: str) -> str:
    """ "expert_gate.3" -> "expert_gate"; any other field name as it is."""
    return re.sub(r"\.\d+$", "", field)


_AXES = {
    **llama.PARAM_AXES,
    "router": ("embed", "experts"),
    "experts_gate_up": ("experts", "embed", "gate_up", "mlp"),
    "experts_down": ("experts", "mlp", "embed"),
    "experts_gate": ("experts", "embed", "mlp"),
    "experts_up": ("experts", "embed", "mlp"),
    "expert_gate": ("embed", "mlp"),
    "expert_up": ("embed", "mlp"),
    "expert_down": ("mlp", "embed"),
}


class _ByKind(Mapping):
    """A table by field name in which a per-expert field ("expert_up.7") has its kind's entry."""

    def __init__(self, table: dict[str, tuple]):
        self._table = table

    def __getitem__(self, field: str) -> tuple:
        return self._table[_base_field(field)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


PARAM_AXES = _ByKind(_AXES)
# Weight-only quantization's input axes (llama.LINEAR_INPUTS): Llama's, and each expert's E for
# gate and up, F for down (HF: one [in, out] per expert; GGUF: stacked [X, in, out]).
LINEAR_INPUTS = _ByKind(
    {
        **llama.LINEAR_INPUTS,
        "expert_gate": (0,),
        "expert_up": (0,),
        "expert_down": (0,),
        "experts_gate": (1,),
        "experts_up": (1,),
        "experts_down": (1,),
    }
)


def field_shape(config: ModelConfig, field: str) -> tuple[int, ...]:
    e, f, x = config.hidden_size, config.moe_intermediate_size, config.num_experts
    shapes = {
        "router": (e, x),
        "expert_gate": (e, f),
        "expert_up": (e, f),
        "expert_down": (f, e),
        "experts_gate_up": (x, e, 2, f),
        "experts_down": (x, f, e),
        "experts_gate": (x, e, f),
        "experts_up": (x, e, f),
    }
    base = _base_field(field)
    return shapes[base] if base in shapes else llama.param_shapes(config)[base]


def layer_fields(config: ModelConfig, i: int) -> list[str]:
    """Layer i's tensors in a checkpoint, by our field names (before `assemble` fuses them)."""
    fields = [f for f in llama.layer_fields(config) if f not in _DENSE_MLP]
    if not config.is_moe_layer(i):
        return fields + list(_DENSE_MLP)
    return fields + ["router"] + [f"{kind}.{j}" for j in range(config.num_experts) for kind in _PER_EXPERT]


top_fields = llama.top_fields


def assemble(config: ModelConfig, top: L.Fields, per_layer: list[L.Fields]) -> MoeParams:
    """The parameter tree from arrays keyed by field name: q|k|v fused, dense gate|up fused, each
    sparse layer's per-expert tensors stacked (popped from the layer's dict as they are used)."""
    return MoeParams(
        embed=top["embed"],
        final_norm=top["final_norm"],
        lm_head=top.get("lm_head"),
        layers=tuple(MoeLayer(**_fuse(config, fields)) for fields in per_layer),
    )


def _fuse(config: ModelConfig, fields: L.Fields) -> L.Fields:
    llama.fuse_qkv(fields)
    if "w_gate" in fields:
        return llama.fuse_gate_up(fields)
    if "experts_gate" in fields:  # a GGUF's experts come stacked
        fields["experts_gate_up"] = stack([fields.pop("experts_gate"), fields.pop("experts_up")], axis=2)
        return fields
    pop = lambda kind: [fields.pop(f"{kind}.{j}") for j in range(config.num_experts)]  # noqa: E731
    gate, up = stack(pop("expert_gate")), stack(pop("expert_up"))  # [X, E, F] each
    fields["experts_gate_up"] = stack([gate, up], axis=2)  # [X, E, 2, F]
    fields["experts_down"] = stack(pop("expert_down"))  # [X, F, E]
    return fields


def init_params(config: ModelConfig, key: jax.Array, dtype: DTypeLike = jnp.float32, scale: float = 0.02) -> MoeParams:
    """Random parameters (for tests and benchmarks): normal(0, scale), norms at 1; the router
    normal(0, 1) so expert choices are decisive."""

    def make(name: str, k: jax.Array) -> jax.Array:
        shape = field_shape(config, name)
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        std = 1.0 if name == "router" else scale
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    fields = [layer_fields(config, i) for i in range(config.num_layers)]
    keys = iter(jax.random.split(key, 3 + sum(map(len, fields))))
    top = {name: make(name, next(keys)) for name in top_fields(config)}
    per_layer = [{name: make(name, next(keys)) for name in names} for names in fields]
    return assemble(config, top, per_layer)


def compute_layout(params: MoeParams, mesh: Mesh | None) -> MoeParams:
    """The experts in the layout the step computes with (experts.py): per expert on one CPU
    device without a mesh, where only the chosen experts are read; stacked on a mesh (split over
    `expert` and `tensor`) and on accelerators (grouped matmuls). Either layout converts to the other.
    The dense linear weights follow models/linear_layout.py."""
    device = next(iter(jax.tree.leaves(params)[0].devices()))
    per_expert = mesh is None and device.platform == "cpu"

    def relayout(layer: MoeLayer) -> MoeLayer:  # both expert weights are in one layout, or None
        gate_up, down = layer.experts_gate_up, layer.experts_down
        if per_expert and gate_up is not None and down is not None:
            if not isinstance(gate_up, tuple) and not isinstance(down, tuple):
                return dataclasses.replace(layer, experts_gate_up=unstack(gate_up), experts_down=unstack(down))
        elif isinstance(gate_up, tuple) and isinstance(down, tuple):
            return dataclasses.replace(layer, experts_gate_up=stack(gate_up), experts_down=stack(down))
        return layer

    return linear_layout(dataclasses.replace(params, layers=tuple(relayout(layer) for layer in params.layers)), mesh)


def _layer(
    x: jax.Array,
    p: MoeLayer,
    kv_cache: L.KVCache,
    cos: jax.Array,
    sin: jax.Array,
    meta: L.AttentionMetadata[jax.Array],
    config: ModelConfig,
    attn_impl: str,
) -> tuple[jax.Array, L.KVCache]:
    x, kv_cache = llama.attention_block(x, p, kv_cache, cos, sin, meta, config, attn_impl)
    h = L.rms_norm(x, p.mlp_norm, config.rms_norm_eps)  # [T, E]
    if p.router is None or p.experts_gate_up is None or p.experts_down is None:
        if p.w_gate_up is None or p.w_down is None:
            raise ValueError("a MoE layer with neither a router and experts nor a dense MLP")
        return x + L.gated_mlp(h, p.w_gate_up, p.w_down), kv_cache
    out = moe_mlp(
        h,
        p.router,
        p.experts_gate_up,
        p.experts_down,
        top_k=config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
    )
    return x + out, kv_cache


def forward(
    params: MoeParams,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv_caches: tuple[L.KVCache, ...],
    meta: L.AttentionMetadata[jax.Array],
    *,
    attn_impl: str = "auto",
) -> tuple[jax.Array, tuple[L.KVCache, ...]]:
    """tokens, positions i32[T]; kv_caches: one [P, page, 2K, D] array per layer.

    Returns (hidden [T, E] after the final norm, new kv_caches tuple)."""
    return L.decoder_stack(_layer, params, config, tokens, positions, kv_caches, meta, attn_impl)


# One pipeline tick with a batch on every stage (models/ticks.py).
tick = functools.partial(decoder_tick, _layer)
