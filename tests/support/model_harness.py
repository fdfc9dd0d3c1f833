"""Runs a model over one sequence through the paged cache, as the engine would (for tests)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.models.layers import AttentionMetadata
from jaxinfer.worker.worker import Worker
from pallas_kernels import kv_cache_shape


def small_cpu_worker(model, **engine) -> Worker:
    """A runner of 8 sequences over 16 pages, 64 tokens each, on the default (CPU) device: the
    worker puts the model's weights in the layout its step computes with."""
    config = EngineConfig(
        max_num_batched_tokens=8,
        max_num_seqs=8,
        token_buckets=(1, 8),
        compilation_cache_dir=None,
        num_pages=16,
        max_model_len=64,
        **engine,
    )
    return Worker(model, config, 64)


class SingleSequence:
    """One sequence on pages 1..n (page 0 is the null page), fed chunk by chunk."""

    def __init__(self, family, config, params, max_len: int, page_size: int = 16, dtype=None):
        self.family, self.config, self.params = family, config, params
        pages = -(-max_len // page_size)
        dtype = dtype or params.embed.dtype
        shape = kv_cache_shape(pages + 1, page_size, config.num_kv_heads, config.head_dim)
        self.kv = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        self.page_table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
        self.length = 0
        self._step = jax.jit(functools.partial(self._forward, family, config), donate_argnums=(1,))

    @staticmethod
    def _forward(family, config, params, kv, tokens, start, page_table):
        n = tokens.shape[0]
        meta = AttentionMetadata(
            kv_lens=(start + n).reshape(1),
            page_indices=page_table,
            cu_q_lens=jnp.array([0, n], jnp.int32),
            num_seqs=jnp.ones((1,), jnp.int32),
        )
        positions = start + jnp.arange(n, dtype=jnp.int32)
        hidden, kv = family.forward(params, config, tokens, positions, kv, meta)
        return family.compute_logits(params, hidden), kv

    def feed(self, tokens) -> np.ndarray:
        """Appends tokens; returns their logits f32[n, V]."""
        tokens = jnp.asarray(np.asarray(tokens, np.int32))
        logits, self.kv = self._step(self.params, self.kv, tokens, jnp.int32(self.length), self.page_table)
        self.length += tokens.shape[0]
        return np.asarray(logits)

    def greedy(self, prompt, num_new: int) -> tuple[np.ndarray, list[int]]:
        """Prompt logits and `num_new` greedy tokens."""
        logits = self.feed(prompt)
        out = [int(np.argmax(logits[-1]))]
        while len(out) < num_new:
            out.append(int(np.argmax(self.feed([out[-1]])[-1])))
        return logits, out
