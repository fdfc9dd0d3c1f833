"""A decoder's forward as one tick of a pipeline with a batch in flight on every stage.

`layers.decoder_stack` takes one batch through every stage in turn (sharding/stages.py
`run_stages`). `decoder_tick` instead advances S batches by one stage each (sharding/pipeline.py
`pipeline_tick`): the entering batch's tokens are embedded for stage 0, stage s runs what stage
s - 1 produced one tick earlier, each on its own batch's positions and attention metadata (rows
s of `positions` [S, T] and of every `meta` leaf [S, ...]), and the last stage's output, the
batch that entered S - 1 ticks ago, leaves through the final norm. The activations handed on are
kept in `inflight` [S, T_max, E] between ticks: a tick of token bucket T reads and writes its
first T rows (every batch in flight is padded to the tick's bucket; rows past a batch's own
tokens are padding, read by no sequence).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import (
    AttentionMetadata,
    KVCache,
    LayerFn,
    group_meta,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    traced_once,
)
from jaxinfer.quant.lora_vocab import vocab_rows
from sharding.pipeline import pipeline_tick


def decoder_tick(
    layer_fn: LayerFn,
    params: Any,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv_caches: tuple[KVCache, ...],
    meta: AttentionMetadata[jax.Array],
    inflight: jax.Array,
    *,
    attn_impl: str = "auto",
) -> tuple[jax.Array, tuple[KVCache, ...], jax.Array]:
    """tokens i32[T] (the entering batch's); positions i32[S, T] and `meta` leaves [S, ...] (row s:
    the batch on stage s); `params.layers` the stage-stacked slots. Returns (the exiting batch's
    hidden [T, E] after the final norm, the caches, the next tick's `inflight`)."""
    num_tokens = tokens.shape[0]
    x = vocab_rows(params.embed, tokens)  # [T, E]
    cos, sin = jax.vmap(lambda p: rope_cos_sin(p, rope_inv_freq(config)))(positions)  # [S, T, D] each
    layer_call = traced_once(layer_fn)

    def slot(j: int, x: jax.Array, layer: Any, cache: KVCache, extras: tuple) -> tuple[jax.Array, KVCache]:
        cos, sin, meta = extras  # this stage's batch's
        return layer_call(x, layer, cache, cos, sin, group_meta(meta, 0), config, attn_impl)

    done, handed, caches = pipeline_tick(slot, inflight[:, :num_tokens], x, params.layers, kv_caches, (cos, sin, meta))
    inflight = inflight.at[:, :num_tokens].set(handed)  # in the embedding's dtype (pipelined.inflight_struct)
    return rms_norm(done, params.final_norm, config.rms_norm_eps), caches, inflight
