"""The step's compiled variants: which the compiled step builds, and how they take their inputs.

step_jits             the step, the decode window, the split step's two halves (jitted)
window_compiler_options  the window's XLA options (CUDA graphs on NVIDIA GPUs)
decode_steps          steps per decode window (EngineConfig.num_decode_steps)
decode_sized_buckets  the token buckets a decode-only plan uses (windows, the split step)
split_step_enabled    whether the split step is compiled (structured output's overlap)
greedy_variant_enabled  whether the decode step has a greedy twin (no conditionals)
as_greedy             inputs marked for that twin, where it is compiled and they qualify
without_adapters      inputs of a step with no LoRA adapter, for the variant without their shares
with_adapters         padding inputs marked for the variant with them (its warm-up)
plain_padding         padding inputs that qualify for it (its warm-up)
input_shardings       where each input array goes on a mesh
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import LoraConfig, ModelConfig
from jaxinfer.models.registry import ModelFamily
from jaxinfer.sampling.arrays import fill_defaults, is_plain, unsent_defaults
from jaxinfer.sampling.prompt_logprobs import PromptInputs
from jaxinfer.worker.inputs import InputBuilder
from jaxinfer.worker.step import decode_window, forward_part, sample_part, step
from jaxinfer.worker.step_inputs import StepInputs
from sharding import DATA, is_multiprocess, replicated_spec, tokens_spec
from sharding.stages import num_stages, over_replicas

DEFAULT_DECODE_STEPS = 8
COMMAND_BUFFER_FLAG = "xla_gpu_enable_command_buffer"
COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE"
logger = logging.getLogger(__name__)


def step_jits(
    family: ModelFamily,
    config: ModelConfig,
    attn_impl: str,
    max_seqs: int,
    num_replicas: int,
    num_decode_steps: int,
    out_shardings: tuple[Any, Any, Any],
    window_options: dict[str, str] | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped, jax.stages.Wrapped, jax.stages.Wrapped]:
    """The compiled step's jitted functions: the step and the decode window, fn(params, caches, inputs,
    prev_tokens, page_table), vmapped over data replicas (`spmd_axis_name="data"`; with pipeline
    stages mapped by a shard_map over `data`, sharding/stages.py); the split step's forward and
    sampling halves. The caches are donated and come back as `out_shardings[1]` says. The window
    compiles with `window_options` (XLA options; window_compiler_options)."""
    parts = (family, config, attn_impl, max_seqs)

    def replicated(fn: Any) -> Any:
        if num_replicas == 1:
            return fn
        if mesh is not None and num_stages(mesh) > 1:
            return over_replicas(fn, mesh)
        return jax.vmap(fn, in_axes=(None, 0, 0, 0, 0), spmd_axis_name=DATA)

    jit_step = lambda fn, options=None: jax.jit(  # noqa: E731
        replicated(fn),
        donate_argnums=(1,),
        out_shardings=out_shardings,
        compiler_options=options,
    )
    return (
        jit_step(functools.partial(step, *parts)),
        jit_step(functools.partial(decode_window, *parts, num_decode_steps), window_options),
        jax.jit(functools.partial(forward_part, *parts[:3]), donate_argnums=(1,), out_shardings=out_shardings[:2]),
        jax.jit(functools.partial(sample_part, family, max_seqs), out_shardings=(out_shardings[0], out_shardings[2])),
    )


def window_compiler_options() -> dict | None:
    """XLA options the decode window compiles with: on NVIDIA GPUs, CUDA graphs over the whole
    window, its loop and conditionals included (COMMAND_BUFFER_TYPES). H100, Llama-3.2-1B shape,
    windows of 8 (benchmarks/RESULTS.md, 2026-11-23): 12-15% less time per step at batch 64 and
    256, the same at batch 1; single steps, whose inputs are fresh buffers every step, were slower
    with them, so they keep XLA's defaults. None elsewhere, where XLA_FLAGS already sets
    --xla_gpu_enable_command_buffer (the user's choice wins), or where this XLA refuses the option."""
    if jax.default_backend() != "gpu" or COMMAND_BUFFER_FLAG in os.environ.get("XLA_FLAGS", ""):
        return None
    options = {COMMAND_BUFFER_FLAG: COMMAND_BUFFER_TYPES}
    try:  # a repeated option set from a string needs a recent XLA
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.zeros(1, np.float32)).compile()
    except jax.errors.JaxRuntimeError as e:
        logger.warning("decode windows compile without CUDA graphs: %s", e)
        return None
    return options


def decode_sized_buckets(inputs: InputBuilder, buckets: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The token buckets a decode-only plan can use (one token per sequence): where the decode
    window and the split step are compiled."""
    return tuple(b for b in buckets if b <= inputs.bucket_for(min(max_num_seqs, buckets[-1])))


def input_shardings(mesh: Mesh, inputs: StepInputs[np.ndarray], replicas: bool) -> StepInputs[NamedSharding]:
    """How the step takes its inputs on `mesh`: tokens split over the sequence axis, the rest
    replicated (per data replica with `replicas`); a tree like `inputs`."""
    tokens = NamedSharding(mesh, tokens_spec(mesh, replicas=replicas))
    other = NamedSharding(mesh, replicated_spec(replicas=replicas))
    return StepInputs(
        token_ids=tokens,
        positions=tokens,
        prev_rows=tokens,
        meta=jax.tree.map(lambda _: other, inputs.meta),
        page_slots=other,
        logits_indices=other,
        sampling=jax.tree.map(lambda _: other, inputs.sampling),
        spec=jax.tree.map(lambda _: other, inputs.spec),
        table=jax.tree.map(lambda _: other, inputs.table),
        prompt=None if inputs.prompt is None else PromptInputs(targets=tokens, num_top=other),
        lora_slots=None if inputs.lora_slots is None else tokens,
    )


def split_step_enabled(setting: bool | None, num_replicas: int = 1) -> bool:
    """Whether the split step is compiled (EngineConfig.structured_output_overlap): the setting,
    by default on accelerators only (on the CPU the host and the step share the same cores, so
    the overlap has nothing to gain); never with data replicas or several hosts."""
    if num_replicas > 1 or is_multiprocess():
        return False
    return jax.default_backend() != "cpu" if setting is None else setting


def greedy_variant_enabled(setting: bool | None, num_replicas: int = 1) -> bool:
    """Whether the decode step (the window, or the single step without windows) of each
    decode-sized bucket is compiled twice: once as is, once for plain sampling arrays (every row
    greedy, nothing else asked; sampler.py), which runs no conditional. The setting
    (EngineConfig.greedy_variant), by default on GPUs only: there each conditional holds the
    host until the device reaches it; XLA:CPU and XLA:TPU run conditionals without the host, so
    the twin would only add compiles. Never with data replicas or several hosts."""
    if num_replicas > 1 or is_multiprocess():
        return False
    return jax.default_backend() == "gpu" if setting is None else setting


def as_greedy(
    inputs: StepInputs[np.ndarray], num_steps: int, buckets: tuple[int, ...], twin_steps: int
) -> StepInputs[np.ndarray]:
    """`inputs` marked plain (SamplingArrays.plain) when their bucket has the greedy twin of
    `twin_steps` steps, this call runs that many, and every row qualifies (no prompt logprobs,
    no drafts, sampling.arrays.is_plain); otherwise as they are."""
    sampling = inputs.sampling
    if (
        num_steps != twin_steps
        or inputs.token_ids.shape[-1] not in buckets
        or sampling is None
        or inputs.prompt is not None
        or inputs.spec is not None
        or not is_plain(sampling)
    ):
        return inputs
    return dataclasses.replace(inputs, sampling=dataclasses.replace(sampling, plain=True))


def without_adapters(inputs: StepInputs[np.ndarray], lora: LoraConfig) -> StepInputs[np.ndarray]:
    """`inputs` as the variant without the LoRA adapters' shares takes them (no slots: the base
    model alone) where no token has an adapter and the variants are specialized
    (LoraConfig.specialize_lora); otherwise as they are, for the variant with them."""
    slots = inputs.lora_slots
    if slots is None or not lora.specialize_lora or slots.any():
        return inputs
    return dataclasses.replace(inputs, lora_slots=None)


def with_adapters(inputs: StepInputs[np.ndarray]) -> StepInputs[np.ndarray]:
    """Padding inputs that take the variant with the adapters' shares: every row in slot 1 (a
    padding row writes nothing and its outputs are never read)."""
    assert inputs.lora_slots is not None
    return dataclasses.replace(inputs, lora_slots=np.ones_like(inputs.lora_slots))


def plain_padding(inputs: StepInputs[np.ndarray]) -> StepInputs[np.ndarray]:
    """Padding inputs (InputBuilder.padding_inputs) that qualify for the greedy twin: every row
    greedy, the allowed bits and the bias pair unsent, as a plain batch's come from `prepare`."""
    sampling = dataclasses.replace(inputs.sampled(), temperature=np.zeros_like(inputs.sampled().temperature))
    return dataclasses.replace(inputs, sampling=unsent_defaults(sampling, grammar=False))


def decode_steps(setting: int | None, num_replicas: int = 1) -> int:
    """Steps per decode window: the setting, by default 8. Llama-3.2-1B shape on an H100 (bf16,
    128-token prompts), tokens/s at batch 1 / 16 / 64 / 256: single steps 247 / 5,005 / 9,130 /
    17,446; windows of 4: 378 / 9,623 / 14,843 / 30,580; of 8: 484 / 9,743 / 20,231 / 40,664.
    SmolLM2 float32 on a 2-core CPU: 8 steps 1.21x single steps at batch 1, 1.08x at batch 8.
    One step with data replicas or several hosts, whose plans and step channel carry single steps."""
    if num_replicas > 1 or is_multiprocess():
        return 1
    return DEFAULT_DECODE_STEPS if setting is None else setting


def for_followers(
    inputs: StepInputs[np.ndarray], vocab_size: int
) -> tuple[StepInputs[np.ndarray], int, bool, bool, int]:
    """What StepChannel.send sends the other processes: the inputs with every sampling default
    filled (their template has them), then the header: token bucket, penalty history, prompt
    rows, page-table entries."""
    sampling = fill_defaults(inputs.sampled(), vocab_size)
    inputs = dataclasses.replace(inputs, sampling=sampling)
    return (
        inputs,
        inputs.token_ids.shape[-1],
        sampling.history is not None,
        inputs.prompt is not None,
        0 if inputs.table is None else inputs.table.slots.shape[-1],
    )
