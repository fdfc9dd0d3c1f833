"""Static per-head scales for an int8 / fp8 KV cache, measured once when the engine starts.

    tokens = calibration_tokens(tokenizer, vocab_size)   # a chat + a fixed text (or fixed random ids)
    absmax = kv_absmax(family, config, params, tokens, ...)  # f32[L, 2K]: |K|, |V| max per head
    caches = quantized_caches(pages, absmax, dtype)      # a QuantizedKVCache per layer
    caches = calibrated_caches(pages, model, params, ...)   # the three in one (the device state's call)

Why static per-head scales: the kernel contract takes one float32 scale per KV head for K and one
for V (`k_scale`, `v_scale`), which every kernel applies inside its inner loop; per-token scales
would need a second array in the cache's layout and a change to every kernel. A scale fixed at
start-up also means a page reads back with the scale it was written with, whenever that was, and
that nothing extra is written per token.

How they are chosen, with no calibration file: the model runs one float forward over a built-in
text (the model dtype's cache, the engine's own attention kernel), and each layer's K and V
maxima per head become the scales, with headroom for inputs that reach further than the text
(values past it are clipped). fp8 e4m3 keeps 3 mantissa bits at every magnitude, so a wide
headroom costs it nothing; int8 spreads 255 levels evenly, so its headroom is small and the rare
larger value is clipped. The headrooms were picked by perplexity on SmolLM2 (benchmarks/
bench_quality.py; see benchmarks/RESULTS.md). A model without a tokenizer is calibrated on fixed
random token ids.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jaxinfer.config import ModelConfig
from jaxinfer.loader import LoadedModel
from jaxinfer.models.layers import AttentionMetadata
from jaxinfer.models.registry import KVCaches, ModelFamily, ModelParams
from jaxinfer.quant.kv_cache import QuantizedKVCache, scales_array, scales_from_absmax
from jaxinfer.tokenizer import Tokenizer
from pallas_kernels import kv_cache_shape
from sharding import put_sharded
from sharding.multihost import fetch
from sharding.rules import unsplit_rows
from sharding.stages import num_stages, plan_stages

CALIBRATION_TOKENS = 512  # the forward's token count (the text is cut or padded to it)
CALIBRATION_PAGE_SIZE = 16
# Multiples of each head's calibration maximum that map to the dtype's largest value.
HEADROOM = {"int8": 1.0, "float8_e4m3fn": 16.0}

CALIBRATION_TEXT = """\
The harbour was quiet before dawn. Fishing boats lay against the stone wall, their ropes creaking
as the tide turned, and a single lamp burned in the window of the customs house. At half past
four the baker opened his shutters; by five the first carts were rolling down from the hills with
cabbages, eggs and sacks of flour, 37 sacks in all, which the miller counted twice.

"Will the ferry run today?" asked the girl at the ticket office. "The wind is from the north-east,
force six and rising." The captain shrugged, folded his newspaper and said that he had crossed in
worse, in the winter of 1962, when the ice reached halfway to the island.

Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight.
Q: Translate "good morning" into German. A: Guten Morgen.

def mean(values):
    total = 0.0
    for v in values:
        total += v
    return total / len(values)

Table 3 lists the results: precision 0.914, recall 0.872, F1 0.893 on 12,480 test items; the
baseline scored 0.801. All runs used a learning rate of 3e-4 and a batch of 256 sequences.

She wrote to her brother that evening: the roof needs mending, the apple trees have blossomed
early, and the old dog sleeps all day by the stove. Come in May if you can; bring the maps, the
brass compass and the book of poems you promised. The road past the mill is flooded again, so
take the upper path through the beech wood, where the ground is dry and the view of the valley,
with its river, its church tower and its scattered farms, is the finest in the county.
"""


CALIBRATION_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Give me three tips for keeping basil alive indoors."},
    {
        "role": "assistant",
        "content": "1. Put it in a sunny window. 2. Water when the top soil is "
        "dry. 3. Pinch off flower buds so it keeps growing leaves.",
    },
]


def calibration_tokens(
    tokenizer: Tokenizer | None, vocab_size: int, max_tokens: int = CALIBRATION_TOKENS
) -> np.ndarray:
    """i32[n <= max_tokens]: a short chat in the model's template (when it has one, so its
    special tokens are seen too), then the calibration text; fixed random ids when there is no
    tokenizer."""
    if tokenizer is None:
        return np.random.default_rng(0).integers(0, vocab_size, max_tokens).astype(np.int32)
    ids: list[int] = []
    if tokenizer.chat_template:
        try:
            chat = tokenizer.apply_chat_template(CALIBRATION_CHAT, add_generation_prompt=False)
            ids = tokenizer.encode(chat, add_special_tokens=False)
        except Exception:  # a template that rejects this chat: calibrate on the text alone
            ids = []
    ids += tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=not ids)
    return np.asarray([i for i in ids if 0 <= i < vocab_size][:max_tokens], np.int32)


def _absmax(
    family: ModelFamily,
    config: ModelConfig,
    num_tokens: int,
    cache_kv_heads: int,
    dtype: DTypeLike,
    attn_impl: str,
    stages: int,
    params: ModelParams,
    tokens: jax.Array,
) -> jax.Array:
    """f32[C, S, 2K]: max |x| of each cache's entries on each of `stages` pipeline stages (its rows
    of every page; sharding/stages.py) after a forward over one sequence of `num_tokens` real
    tokens (tokens i32[T], padded); C: the layers, or with stages the slots."""
    pages = -(-tokens.shape[0] // CALIBRATION_PAGE_SIZE)
    shape = kv_cache_shape(pages + 1, CALIBRATION_PAGE_SIZE * stages, cache_kv_heads, config.head_dim)
    num_caches = config.num_layers if stages == 1 else plan_stages(config.num_layers, stages).num_slots
    caches: KVCaches = tuple(jnp.zeros(shape, dtype) for _ in range(num_caches))
    meta = AttentionMetadata(
        kv_lens=jnp.full((1,), num_tokens, jnp.int32),
        page_indices=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
        cu_q_lens=jnp.array([0, num_tokens], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
    )
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, written = family.forward(params, config, tokens, positions, caches, meta, attn_impl=attn_impl)
    floats = [c for c in written if isinstance(c, jax.Array)]  # float caches in, float caches out
    # Unwritten slots (page 0, the tail of the last page) hold zeros and change no maximum.
    by_stage = [c.reshape(c.shape[0], stages, -1, *c.shape[2:]) for c in floats]  # [P, S, page, 2K, D]
    return jnp.stack([jnp.max(jnp.abs(c.astype(jnp.float32)), axis=(0, 2, 4)) for c in by_stage])


def kv_absmax(
    family: ModelFamily,
    config: ModelConfig,
    params: ModelParams,
    tokens: np.ndarray,
    *,
    cache_kv_heads: int,
    dtype: DTypeLike,
    attn_impl: str = "auto",
    mesh: Mesh | None = None,
) -> np.ndarray:
    """f32[L, 2K] (K of head h at 2h, V at 2h + 1): each head's largest |K| and |V| over a float
    forward of `tokens` (the cache's own head layout: repeated KV heads on a mesh included). On a
    mesh the forward is sharded as the step is, and every process gets the same result. With
    pipeline stages in the mesh: f32[slots, S, 2K], each slot's layer on each stage (a padding
    slot's zeros)."""
    padded = np.zeros((CALIBRATION_TOKENS,), np.int32)
    padded[: len(tokens)] = tokens
    stages = num_stages(mesh)
    fn = jax.jit(
        functools.partial(_absmax, family, config, len(tokens), cache_kv_heads, jnp.dtype(dtype), attn_impl, stages),
        out_shardings=None if mesh is None else NamedSharding(mesh, P()),
    )
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        absmax = np.asarray(fetch(fn(params, jnp.asarray(padded))), np.float32)
    return absmax[:, 0] if stages == 1 else absmax


def quantized_caches(
    pages: tuple[jax.Array, ...], absmax: np.ndarray, dtype: DTypeLike, headroom: float | None = None
) -> tuple[QuantizedKVCache, ...]:
    """Each layer's zeroed int8/fp8 pages (their sharding kept) with scales from `absmax`
    [L, 2K] (pipeline stages: [slots, S, 2K], each stage's scales in its own row, [1, S, 2K, 1]);
    a leading [data] axis of the pages is repeated on the scales."""
    headroom = HEADROOM[jnp.dtype(dtype).name] if headroom is None else headroom
    scales = scales_from_absmax(absmax, dtype, headroom)
    caches = []
    for layer_pages, layer_scales in zip(pages, scales):
        s = np.concatenate([scales_array(row) for row in layer_scales.reshape(-1, layer_scales.shape[-1])], axis=1)
        s = np.broadcast_to(s, (*layer_pages.shape[:-4], *s.shape))
        where = layer_pages.sharding
        if isinstance(where, NamedSharding):  # page rows split over sequence: the scales' rows whole there
            where = NamedSharding(where.mesh, unsplit_rows(where.spec))
        caches.append(QuantizedKVCache(layer_pages, put_sharded(np.ascontiguousarray(s), where)))
    return tuple(caches)


def calibrated_caches(
    pages: tuple[jax.Array, ...],
    model: LoadedModel,
    params: ModelParams,
    cache_kv_heads: int,
    attn_impl: str,
    mesh: Mesh | None,
    layer_caches: tuple[int, ...] | None = None,
) -> tuple[QuantizedKVCache, ...]:
    """The device state's zeroed int8/fp8 pages with scales calibrated on `model` (its placed `params`,
    the float forward in the model's dtype). `layer_caches`: the cache of each layer where layers
    share caches (config/kv_layout.py): a cache's scales cover the largest |K| and |V| of its layers."""
    tokens = calibration_tokens(model.tokenizer, model.config.vocab_size)
    absmax = kv_absmax(
        model.family,
        model.config,
        params,
        tokens,
        cache_kv_heads=cache_kv_heads,
        dtype=params.embed.dtype,
        attn_impl=attn_impl,
        mesh=mesh,
    )
    if layer_caches is not None:
        owner = np.asarray(layer_caches)
        absmax = np.stack([absmax[owner == c].max(axis=0) for c in range(len(pages))])
    return quantized_caches(pages, absmax, pages[0].dtype)
