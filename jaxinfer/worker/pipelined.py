"""PipelinedStep: the compiled step with a batch in flight on every pipeline stage.

With `stage=S` in the mesh one batch taken through the stages in turn keeps one stage busy while
the others wait. Here every jitted call is one tick of the pipeline (step.tick, models/ticks.py):

    tick k   the batch entering now (the plan handed to `enter`) runs stage 0; the batch that
             entered at tick k - s runs stage s; the one that entered at k - S + 1 leaves the last
             stage and is sampled: its tokens are this call's outputs, and what the next call's
             placeholders stand for (the engine's async scheduling, unchanged)
    host     a ring of the S - 1 batches in flight (their inputs as prepared, plans, replica);
             each tick's inputs stack every stage's row (positions, attention metadata, page
             slots) over a leading [S] axis, all padded to the largest bucket among them
    device   the activations handed between stages, [S, T_max, E] split over `stage`, carried
             from call to call as the KV cache is (donated, replaced)

The engine keeps S virtual replicas (core/replica.py) that share one KV cache manager; a
replica's next batch enters only once its last one has left (core/turns.py), so each
sequence is in at most one batch in flight. Not carried here (the engine takes batches through
the stages one at a time instead: `pipeline_stages` below): decode windows, the split step,
the greedy twin, speculative decoding, data replicas, background compilation. On several hosts
process 0 keeps the ring and sends each tick's stacked inputs; the others run them as they come.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.models.registry import ModelFamily
from jaxinfer.quant.lora_vocab import vocab_rows
from jaxinfer.sampling.arrays import HostOrDevice
from jaxinfer.worker.compiled_step import CompiledStep
from jaxinfer.worker.device_state import DeviceState
from jaxinfer.worker.page_table import NULL_ROW
from jaxinfer.worker.step import StepOutput, tick
from jaxinfer.worker.step_inputs import StepInputs
from jaxinfer.worker.step_variants import input_shardings
from sharding.mesh import STAGE
from sharding.multihost import put_inputs
from sharding.stages import num_stages

logger = logging.getLogger(__name__)
Exiting = tuple[list[SchedulerPlan], list[int]]  # a batch's plans and the replicas they came from


def pipeline_stages(state: DeviceState, engine: EngineConfig) -> int:
    """Batches in flight at once: the mesh's stage count where the pipeline carries this engine
    (module docstring), else 1 (one batch through the stages at a time; the reason is logged)."""
    n = num_stages(state.mesh)
    if n == 1 or not engine.parallel.pipeline_batches:
        return 1
    without = {
        f"the {state.family.name} family's forward has no pipeline tick": state.family.tick is None,
        "data replicas": state.num_replicas > 1,
        "speculative decoding": engine.speculative_config is not None,
        "disaggregated prefill/decode (kv_role)": engine.kv_transfer.kv_role is not None,
    }
    reasons = [what for what, present in without.items() if present]
    if reasons:
        logger.info("stage=%d: one batch through the stages at a time with %s", n, ", ".join(reasons))
        return 1
    return n


class PipelinedStep(CompiledStep):
    def __init__(self, state: DeviceState, num_stages: int) -> None:
        super().__init__(state, in_flight=num_stages)
        if state.mesh is None:
            raise ValueError("pipeline stages need a mesh with a stage axis")
        self.num_stages, self.stage_mesh = num_stages, state.mesh
        # One call per tick; the variants the pipeline does not carry are not compiled.
        self.num_decode_steps, self.window_buckets, self.split_buckets, self.greedy_buckets = 1, (), (), ()
        home, formats = state.home, jax.tree.map(lambda c: c.format, state.kv_caches)
        max_seqs = self.engine.seq_bucket(self.buckets[-1])
        self._tick = tick_jit(
            state.family, self.config, self.engine.compile.attn_impl, max_seqs, (home, formats, home), self.stage_mesh
        )
        self._jits = {"tick": self._tick}
        inflight = inflight_struct(state.params, self.config, self.stage_mesh, num_stages, self.buckets[-1])
        self.inflight = jax.device_put(jnp.zeros(inflight.shape, inflight.dtype), inflight.sharding)
        self.ticks = self.stage_batches = 0  # ticks run, and stages that had a batch summed over them
        # Stages 1 .. S-1's batches, the newest first: their inputs and (plans, replicas); None: no batch.
        self._ring: collections.deque[tuple[StepInputs[np.ndarray], Exiting] | None] = collections.deque(
            [None] * (num_stages - 1)
        )

    @property
    def busy(self) -> bool:
        """Whether a batch is in flight (ticks must run until it leaves)."""
        return any(entry is not None for entry in self._ring)

    def enter(
        self, plan: SchedulerPlan | None, replica: int, previous: list[SchedulerPlan] | None
    ) -> tuple[StepInputs[np.ndarray], Exiting]:
        """This tick's inputs with `plan` entering (None: none enters), from `replica`; `previous`:
        the plans the last tick sampled (the placeholders' source). Returns the inputs and the
        batch that leaves the last stage this tick (no plans: none); the ring moves on."""
        entering = None
        if plan is not None and plan.seqs:
            entering = (self.inputs.prepare(plan, previous), ([plan], [replica]))
        rows = [entering, *self._ring]
        tokens = max((row[0].token_ids.shape[-1] for row in rows if row is not None), default=self.buckets[0])
        padded = [_pad(row[0], tokens, self.engine.seq_bucket) if row is not None else None for row in rows]
        exiting = rows[-1][1] if rows[-1] is not None else ([], [])
        self.ticks += 1
        self.stage_batches += sum(row is not None for row in rows)
        self._ring.appendleft(entering)
        self._ring.pop()
        inputs = stack_rows([p if p is not None else self.inputs.padding_inputs(tokens, False) for p in padded])
        return inputs, exiting

    def stats(self) -> dict[str, float]:
        """Ticks run and the share of stages that had a batch over them (1: the pipeline always full)."""
        full = self.stage_batches / (self.ticks * self.num_stages) if self.ticks else 0.0
        return {"pipeline_ticks": self.ticks, "pipeline_occupancy": full}

    def padding_inputs(
        self, t_bucket: int, with_history: bool, spec: bool = False, prompt: bool = False, table_width: int = 0
    ) -> StepInputs[np.ndarray]:
        """A tick's all-padding inputs (each stage's row padding) of one bucket and variant."""
        one = self.inputs.padding_inputs(t_bucket, with_history, spec, prompt, table_width)
        return stack_rows([one] * self.num_stages)

    def _variant(self, num_steps: int) -> str:
        if num_steps != 1:
            raise ValueError(f"num_steps={num_steps}: pipeline ticks run one step per call")
        return "tick"

    def _placed(self, inputs: StepInputs[np.ndarray]) -> StepInputs[HostOrDevice]:
        """As CompiledStep's, the per-stage positions split like token ids along their second axis."""
        placed = put_inputs(inputs, tick_shardings(self.stage_mesh, inputs))
        return dataclasses.replace(placed, sampling=self._defaults.fill(placed.sampling))

    def _args(self, inputs: StepInputs[HostOrDevice], abstract: Any = None) -> tuple[Any, ...]:
        return (*super()._args(inputs, abstract), self.inflight)

    def _launch(self, name: str, inputs: StepInputs[HostOrDevice]) -> StepOutput:
        state = self.state
        with state.mesh_context():
            args = self._args(self._set_table(inputs))
            out, state.kv_caches, self._prev_tokens, self.inflight = self.programs.call(name, self._jits[name], args)
        return out

    def warm_up(self, background: bool = False) -> float:
        """Every tick variant now (background compilation is not carried: module docstring)."""
        return super().warm_up(False)

    def num_compiled(self) -> int:
        return super().num_compiled() + self._tick._cache_size()  # type: ignore[attr-defined]  # not in jax's stubs


def stack_rows(rows: list[StepInputs[np.ndarray]]) -> StepInputs[np.ndarray]:
    """One tick's inputs from each stage's row, stage 0 first (module docstring): the entering
    batch's ids and page-table entries, every row's positions, metadata and page slots stacked,
    the exiting (last) batch's logits rows, sampling and prompt rows."""
    first, last = rows[0], rows[-1]
    return dataclasses.replace(
        last,
        token_ids=first.token_ids,
        prev_rows=first.prev_rows,
        positions=np.stack([r.positions for r in rows]),
        meta=jax.tree.map(lambda *a: np.stack(a), *[r.meta for r in rows]),
        page_slots=np.stack([r.page_slots for r in rows]),
        table=first.table,
    )


def tick_shardings(mesh: Mesh, inputs: StepInputs[Any]) -> StepInputs[NamedSharding]:
    """Where a tick takes its inputs: as a step's (step_variants.input_shardings), the per-stage
    positions [S, T] split like token ids along their second axis."""
    shardings = input_shardings(mesh, inputs, False)
    return dataclasses.replace(shardings, positions=NamedSharding(mesh, P(None, *shardings.token_ids.spec)))


def tick_jit(
    family: ModelFamily,
    config: ModelConfig,
    attn_impl: str,
    max_seqs: int,
    out_shardings: tuple[Any, Any, Any],
    mesh: Mesh,
) -> jax.stages.Wrapped:
    """step.tick jitted: fn(params, caches, inputs, prev_tokens, page_table, inflight), the caches
    and the activations in flight donated; `out_shardings`: the step's three outputs'."""
    return jax.jit(
        functools.partial(tick, family, config, attn_impl, max_seqs),
        donate_argnums=(1, 5),
        out_shardings=(*out_shardings, NamedSharding(mesh, P(STAGE))),
    )


def inflight_struct(params: Any, config: ModelConfig, mesh: Mesh, num_stages: int, max_tokens: int) -> Any:
    """The activations handed between stages, [S, T_max, E] in the embedding's output dtype,
    split over `stage` (a jax.ShapeDtypeStruct)."""
    embed = jax.eval_shape(lambda p: vocab_rows(p.embed, jnp.zeros(1, jnp.int32)), params)
    shape = (num_stages, max_tokens, config.hidden_size)
    return jax.ShapeDtypeStruct(shape, embed.dtype, sharding=NamedSharding(mesh, P(STAGE)))


def _pad(inputs: StepInputs[np.ndarray], tokens: int, seq_bucket: Any) -> StepInputs[np.ndarray]:
    """A batch's inputs padded from their bucket to `tokens` (and its sequence bucket): padding
    tokens at position 0 and no sequence, padding sequences with no tokens on the null row, the
    sampling rows repeated from the first (never read)."""
    t0, s0, s = inputs.token_ids.shape[-1], inputs.page_slots.shape[-1], seq_bucket(tokens)
    if t0 == tokens:
        return inputs

    def pad(a: np.ndarray, n: int, value: Any = 0) -> np.ndarray:
        widths = [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1)
        return np.pad(a, widths, mode="edge") if value is None else np.pad(a, widths, constant_values=value)

    meta = inputs.meta
    prompt = inputs.prompt
    return dataclasses.replace(
        inputs,
        token_ids=pad(inputs.token_ids, tokens),
        positions=pad(inputs.positions, tokens),
        prev_rows=pad(inputs.prev_rows, tokens, -1),
        meta=dataclasses.replace(
            meta, kv_lens=pad(meta.kv_lens, s), cu_q_lens=pad(meta.cu_q_lens, s + 1, None), num_seqs=meta.num_seqs
        ),
        logits_indices=pad(inputs.logits_indices, s * inputs.logits_indices.shape[0] // s0),
        page_slots=pad(inputs.page_slots, s, NULL_ROW),
        sampling=jax.tree.map(lambda a: pad(a, s, None), inputs.sampled()),
        prompt=None if prompt is None else dataclasses.replace(prompt, targets=pad(prompt.targets, tokens, -1)),
    )
