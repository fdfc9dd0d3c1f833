"""The pure functions the compiled step jits: one step, a decode window, and the step split in two.

    step          = forward_part + sample_part in one call (the usual variant)
    decode_window = `num_steps` steps of a decode-only batch in one call (lax.scan)
    forward_part  -> the hidden state of each sequence's last token [S, E] and the updated caches
    prompt rows   -> (inputs with `prompt`: prompt logprobs) every row's hidden state also scored
                     against the prompt token after it (sampling/prompt_logprobs.py), returned
                     as the SamplerOutput's `prompt`
    sample_part   -> LM head + in-jit sampling over those rows
    verify_part   -> (inputs with drafts: speculative decoding) LM head over each sequence's
                     last known token and its drafts, sampling at every position and the
                     accepted count (sampling/rejection.py); the tokens handed on are each
                     row's last emitted one

The split pair serves structured output: the forward of step N+1 is dispatched before step N's
tokens reach the host, and the sampling call follows once the host has advanced each grammar
past them and filled the allowed-token bits (EngineConfig.structured_output_overlap).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.models.registry import KVCaches, ModelFamily, ModelParams
from jaxinfer.quant.lora_bind import bind, bind_head
from jaxinfer.sampling.arrays import SamplingArrays
from jaxinfer.sampling.params import MAX_LOGPROBS
from jaxinfer.sampling.prompt_logprobs import prompt_logprobs
from jaxinfer.sampling.rejection import SpecInputs, VerifyOutput, last_tokens, verify
from jaxinfer.sampling.sampler import SamplerOutput, sample
from jaxinfer.worker.step_inputs import StepInputs

StepOutput = SamplerOutput | VerifyOutput  # a verify step's (inputs with drafts) is a VerifyOutput


def step(
    family: ModelFamily,
    config: ModelConfig,
    attn_impl: str,
    max_seqs: int,
    params: ModelParams,
    kv_caches: KVCaches,
    inputs: StepInputs[jax.Array],
    prev_tokens: jax.Array,
    page_table: jax.Array,
) -> tuple[StepOutput, KVCaches, jax.Array]:
    """prev_tokens i32[max_seqs]: what the previous step sampled, for its placeholders here;
    page_table i32[G, rows, pages_per_seq]: the sequences' block tables of each layer group
    (page_table.py). A verify step (inputs with drafts) returns a VerifyOutput."""
    every_row, kv_caches = _forward(family, config, attn_impl, params, kv_caches, inputs, prev_tokens, page_table)
    out, sampled = _outputs(family, max_seqs, params, every_row, inputs)
    return out, kv_caches, sampled


def tick(
    family: ModelFamily,
    config: ModelConfig,
    attn_impl: str,
    max_seqs: int,
    params: ModelParams,
    kv_caches: KVCaches,
    inputs: StepInputs[jax.Array],
    prev_tokens: jax.Array,
    page_table: jax.Array,
    inflight: jax.Array,
) -> tuple[StepOutput, KVCaches, jax.Array, jax.Array]:
    """One tick of a pipeline with a batch on every stage (worker/pipelined.py, models/ticks.py):
    `inputs.token_ids` and `prev_rows` [T] are the entering batch's; `positions` [S, T], the `meta`
    leaves [S, ...] and `page_slots` [S, rows] hold row s for the batch on stage s; the logits
    rows, sampling arrays and prompt rows are the exiting batch's, whose tokens are sampled.
    `inflight` [S, T_max, E]: the activations handed from each stage to the next."""
    if family.tick is None:
        raise ValueError(f"the {family.name} family's forward has no pipeline tick")
    from_prev = prev_tokens[jnp.maximum(inputs.prev_rows, 0)]
    token_ids = jnp.where(inputs.prev_rows >= 0, from_prev, inputs.token_ids)
    pages = jnp.moveaxis(page_table[:, inputs.page_slots], 1, 0)  # [S, G, rows, pages_per_seq]
    meta = dataclasses.replace(inputs.meta, page_indices=pages)
    every_row, kv_caches, inflight = family.tick(
        params, config, token_ids, inputs.positions, kv_caches, meta, inflight, attn_impl=attn_impl
    )
    out, sampled = _outputs(family, max_seqs, params, every_row, inputs)
    return out, kv_caches, sampled, inflight


def _outputs(
    family: ModelFamily, max_seqs: int, params: ModelParams, every_row: jax.Array, inputs: StepInputs[jax.Array]
) -> tuple[StepOutput, jax.Array]:
    """The sampled (or verified) tokens of the rows `inputs` name in the forward's `every_row`
    [T, E], with prompt logprobs where asked; and the tokens padded to [max_seqs]."""
    hidden = every_row[inputs.logits_indices]
    row_slots = None if inputs.lora_slots is None else inputs.lora_slots[inputs.logits_indices]
    if inputs.spec is not None:
        verified, sampled = verify_part(family, max_seqs, params, hidden, inputs.sampled(), inputs.spec, row_slots)
        return verified, sampled
    out, sampled = sample_part(family, max_seqs, params, hidden, inputs.sampled(), row_slots)
    if inputs.prompt is not None:
        # Every row is scored, through a head of its own: the CPU's product-and-sum LM head
        # (quant/out_first.py) over as many rows as the sampler's would share the weight's
        # broadcast with it, and XLA then writes that [V, rows, E] broadcast out in full.
        every_head = jax.lax.optimization_barrier(bind_head(params, inputs.lora_slots))
        out = dataclasses.replace(
            out,
            prompt=prompt_logprobs(
                functools.partial(family.compute_logits, every_head), every_row, inputs.prompt, MAX_LOGPROBS
            ),
        )
    return out, sampled


def window_outputs(out: SamplerOutput, num_steps: int) -> Iterator[SamplerOutput]:
    """A step's fetched outputs, or each step's of a decode window's ([num_steps, ...]) in order."""
    for i in range(num_steps):
        yield out if num_steps == 1 else jax.tree.map(lambda a: a[i], out)  # noqa: B023


def forward_part(
    family: ModelFamily,
    config: ModelConfig,
    attn_impl: str,
    params: ModelParams,
    kv_caches: KVCaches,
    inputs: StepInputs[jax.Array],
    prev_tokens: jax.Array,
    page_table: jax.Array,
) -> tuple[jax.Array, KVCaches]:
    """The forward over the ragged batch (K/V written into the pages); returns the hidden rows
    of each sequence's last token [S, E]. `inputs.sampling` is not read."""
    hidden, kv_caches = _forward(family, config, attn_impl, params, kv_caches, inputs, prev_tokens, page_table)
    return hidden[inputs.logits_indices], kv_caches


def _forward(
    family: ModelFamily,
    config: ModelConfig,
    attn_impl: str,
    params: ModelParams,
    kv_caches: KVCaches,
    inputs: StepInputs[jax.Array],
    prev_tokens: jax.Array,
    page_table: jax.Array,
) -> tuple[jax.Array, KVCaches]:
    """The forward's hidden state of every row of the batch [T, E] and the updated caches."""
    from_prev = prev_tokens[jnp.maximum(inputs.prev_rows, 0)]  # [T]
    token_ids = jnp.where(inputs.prev_rows >= 0, from_prev, inputs.token_ids)
    meta = dataclasses.replace(inputs.meta, page_indices=page_table[:, inputs.page_slots])  # [G, S, pages_per_seq]
    params = bind(params, inputs.lora_slots)  # LoRA: each token's adapter slot (quant/lora.py)
    return family.forward(params, config, token_ids, inputs.positions, kv_caches, meta, attn_impl=attn_impl)


def sample_part(
    family: ModelFamily,
    max_seqs: int,
    params: ModelParams,
    hidden: jax.Array,
    sampling: SamplingArrays[jax.Array],
    row_slots: jax.Array | None = None,
) -> tuple[SamplerOutput, jax.Array]:
    """Logits of the rows [S, E] and one token each; the tokens also padded to [max_seqs] for
    the next step's placeholders. row_slots i32[S]: the rows' LoRA slots (None: LoRA off)."""
    logits = family.compute_logits(bind_head(params, row_slots), hidden)  # [S, V]
    out = sample(logits, sampling, num_top_logprobs=MAX_LOGPROBS)
    sampled = jnp.zeros((max_seqs,), jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)
    return out, sampled


def verify_part(
    family: ModelFamily,
    max_seqs: int,
    params: ModelParams,
    hidden: jax.Array,
    sampling: SamplingArrays[jax.Array],
    spec: SpecInputs[jax.Array],
    row_slots: jax.Array | None = None,
) -> tuple[VerifyOutput, jax.Array]:
    """hidden [S*(K+1), E]: each sequence's last known token and drafts -> VerifyOutput [S, K+1]."""
    logits = family.compute_logits(bind_head(params, row_slots), hidden)  # [S*(K+1), V]
    out = verify(logits, sampling, spec, num_top_logprobs=MAX_LOGPROBS)
    last = last_tokens(out)  # [S]
    return out, jnp.zeros((max_seqs,), jnp.int32).at[: last.shape[0]].set(last)


def decode_window(
    family: ModelFamily,
    config: ModelConfig,
    attn_impl: str,
    max_seqs: int,
    num_steps: int,
    params: ModelParams,
    kv_caches: KVCaches,
    inputs: StepInputs[jax.Array],
    prev_tokens: jax.Array,
    page_table: jax.Array,
) -> tuple[StepOutput, KVCaches, jax.Array]:
    """`num_steps` decode steps of a decode-only batch (token t is sequence t) in one call.

    Step i feeds each sequence the token it sampled at step i - 1 (step 0: the inputs' own ids and
    placeholders), one position further, with one more key in the cache and one more draw of its
    random stream. Outputs are stacked: [num_steps, S, ...]; the sampled tokens handed on are
    the last step's."""
    meta, sampling = inputs.meta, inputs.sampled()
    t = jnp.arange(inputs.token_ids.shape[0], dtype=jnp.int32)
    real = t < meta.num_seqs[0]
    own_row = jnp.where(real, t, -1)

    def body(carry: tuple[KVCaches, jax.Array], i: jax.Array) -> tuple[tuple[KVCaches, jax.Array], StepOutput]:
        caches, prev = carry
        # Tied to the step index, the weights are read as stored inside each step: left
        # loop-invariant, XLA hoists their conversions (int8 -> float, int4 unpacking, a bfloat16
        # embedding) out of the loop into float copies of every weight, made on every call.
        step_params, i = jax.lax.optimization_barrier((params, i))
        step_inputs = dataclasses.replace(
            inputs,
            positions=jnp.where(real, inputs.positions + i, inputs.positions),
            meta=dataclasses.replace(meta, kv_lens=jnp.where(meta.kv_lens > 0, meta.kv_lens + i, 0)),
            sampling=dataclasses.replace(sampling, num_generated=sampling.num_generated + i),
            prev_rows=jnp.where(i == 0, inputs.prev_rows, own_row),
        )
        out, caches, sampled = step(
            family, config, attn_impl, max_seqs, step_params, caches, step_inputs, prev, page_table
        )
        return (caches, sampled), out

    (kv_caches, sampled), outs = jax.lax.scan(body, (kv_caches, prev_tokens), jnp.arange(num_steps, dtype=jnp.int32))
    return outs, kv_caches, sampled
