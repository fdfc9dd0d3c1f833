"""Random ragged batches over a poisoned paged KV cache, and a dense numpy oracle.

A case owns pages 1.. at random; page 0 is the engine's null page, owned by nobody. Every slot
that no sequence may read holds poison (NaN where the dtype has one, else the int8 minimum):
unowned pages, and the slots of owned pages at or past kv_len. The slots of this step's new
tokens are poisoned too, so a write that misses, or a read before the write, shows up. Page-table
entries past a sequence's pages, and the rows of padding sequences, hold an out-of-range page id.
Padding tokens (past cu_q_lens[num_seqs]) carry real-looking q/k/v whose writes must be dropped.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_write import quantize_kv


@dataclasses.dataclass
class Case:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kv_cache: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None

    def args(self):
        return tuple(
            jnp.asarray(a)
            for a in (
                self.q,
                self.k,
                self.v,
                self.kv_cache,
                self.kv_lens,
                self.page_indices,
                self.cu_q_lens,
                self.num_seqs,
            )
        )

    def scales(self):
        if self.k_scale is None:
            return {}
        return dict(k_scale=jnp.asarray(self.k_scale), v_scale=jnp.asarray(self.v_scale))


def poison_value(dtype):
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).min
    return np.nan


def make_case(
    q_lens,
    kv_lens,
    *,
    num_kv_heads=2,
    group=2,
    head_dim=64,
    page_size=16,
    dtype=jnp.float32,
    cache_dtype=None,
    num_seqs_max=None,
    pad_tokens=3,
    pages_per_seq=None,
    spare_pages=4,
    seed=0,
) -> Case:
    rng = np.random.default_rng(seed)
    cache_dtype = jnp.dtype(cache_dtype or dtype)
    num_seqs = len(q_lens)
    num_seqs_max = num_seqs_max or num_seqs + 2
    assert all(0 <= ql <= kl for ql, kl in zip(q_lens, kv_lens))
    pages_needed = [-(-kl // page_size) for kl in kv_lens]
    pages_per_seq = pages_per_seq or max(pages_needed + [1]) + 1
    num_pages = 1 + sum(pages_needed) + spare_pages
    owned = rng.permutation(np.arange(1, num_pages))

    # Table entries past a sequence's pages (and padding sequences' rows) name no page at all:
    # the TPU interpreter raises on the out-of-bounds DMA if a kernel follows one.
    page_indices = np.full((num_seqs_max, pages_per_seq), num_pages + 1000, np.int32)
    cache = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    k_scale = v_scale = None
    quantized = cache_dtype.itemsize == 1
    if quantized:
        k_scale = rng.uniform(0.02, 0.05, num_kv_heads).astype(np.float32)
        v_scale = rng.uniform(0.02, 0.05, num_kv_heads).astype(np.float32)
    used = 0
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        pages = owned[used : used + pages_needed[s]]
        used += pages_needed[s]
        page_indices[s, : len(pages)] = pages
        ctx = np.arange(kl - ql)  # context already in the cache
        kc, vc = rng.standard_normal((2, len(ctx), num_kv_heads, head_dim)).astype(np.float32)
        if quantized:  # store what write_kv would: x / scale, rounded and clipped
            kc = np.asarray(quantize_kv(jnp.asarray(kc), jnp.asarray(k_scale), cache_dtype), np.float32)
            vc = np.asarray(quantize_kv(jnp.asarray(vc), jnp.asarray(v_scale), cache_dtype), np.float32)
        kv = np.stack([kc, vc], axis=2).reshape(len(ctx), 2 * num_kv_heads, head_dim)
        cache[pages[ctx // page_size], ctx % page_size] = kv
    cache = _to_cache_dtype(cache, cache_dtype)

    num_tokens = sum(q_lens) + pad_tokens
    cu_q_lens = np.full(num_seqs_max + 1, sum(q_lens), np.int32)
    cu_q_lens[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens_arr = np.full(num_seqs_max, 5, np.int32)  # garbage for padding sequences
    kv_lens_arr[:num_seqs] = kv_lens
    num_q_heads = num_kv_heads * group
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    to = lambda x: np.asarray(jnp.asarray(x).astype(dtype))  # noqa: E731
    return Case(
        to(q),
        to(k),
        to(v),
        cache,
        kv_lens_arr,
        page_indices,
        cu_q_lens,
        np.array([num_seqs], np.int32),
        k_scale,
        v_scale,
    )


def _to_cache_dtype(cache_f32, cache_dtype):
    """Cast values that are already representable; NaN slots get the dtype's poison."""
    poison = poison_value(cache_dtype)
    nan = np.isnan(cache_f32)
    if np.isnan(poison):
        return np.asarray(jnp.asarray(cache_f32).astype(cache_dtype))
    return np.asarray(jnp.asarray(np.where(nan, poison, cache_f32)).astype(cache_dtype))


def dense_oracle(case: Case, kv_cache_after, *, sm_scale, sliding_window=None, soft_cap=None):
    """float64 per-token loop over the written cache: out [T, Hq, D] (zeros for padding)."""
    q = np.asarray(case.q, np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    cache = np.asarray(jnp.asarray(kv_cache_after).astype(jnp.float32), np.float64)
    num_kv_heads = cache.shape[2] // 2
    group = num_q_heads // num_kv_heads
    if case.k_scale is not None:
        sc = np.stack([case.k_scale, case.v_scale], 1).reshape(-1)
        cache = cache * sc[None, None, :, None]
    out = np.zeros_like(q)
    for s in range(int(case.num_seqs[0])):
        q0, q1, kv_len = case.cu_q_lens[s], case.cu_q_lens[s + 1], case.kv_lens[s]
        pages = case.page_indices[s, : -(-kv_len // cache.shape[1])]
        kv = cache[pages].reshape(-1, 2 * num_kv_heads, head_dim)[:kv_len]
        for t in range(q0, q1):
            pos = kv_len - (q1 - q0) + (t - q0)
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_q_heads):
                kh, vh = kv[lo : pos + 1, 2 * (h // group)], kv[lo : pos + 1, 2 * (h // group) + 1]
                logits = kh @ q[t, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                p = np.exp(logits - logits.max())
                out[t, h] = p @ vh / p.sum()
    return out


def operand_structs(
    *,
    tokens=64,
    q_heads=8,
    kv_heads=2,
    head_dim=128,
    pages=64,
    page_size=16,
    seqs=8,
    pages_per_seq=16,
    dtype=jnp.bfloat16,
    cache_dtype=None,
    sharding=None,
):
    """A kernel call's operands as shape structs, to lower or compile it without data: (q, k, v,
    kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs), and the K/V scales a one-byte cache
    takes ({} for a float one). `sharding` places each (compiling for a mesh's devices)."""
    import jax

    def sd(shape, of):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(of), sharding=sharding)

    cache_dtype = jnp.dtype(cache_dtype or dtype)
    args = (
        sd((tokens, q_heads, head_dim), dtype),
        sd((tokens, kv_heads, head_dim), dtype),
        sd((tokens, kv_heads, head_dim), dtype),
        sd((pages, page_size, 2 * kv_heads, head_dim), cache_dtype),
        sd((seqs,), jnp.int32),
        sd((seqs, pages_per_seq), jnp.int32),
        sd((seqs + 1,), jnp.int32),
        sd((1,), jnp.int32),
    )
    scales = {}
    if cache_dtype.itemsize == 1:
        scales = dict(k_scale=sd((kv_heads,), jnp.float32), v_scale=sd((kv_heads,), jnp.float32))
    return args, scales
