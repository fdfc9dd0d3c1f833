"""Ray Data: jaxinfer as a batch processor, in the shape of `ray.data.llm` (`pip install jaxinfer[ray]`).

    config = JaxinferProcessorConfig(model_source="/models/llama", engine_kwargs={"max_num_seqs": 64},
                                     concurrency=4, batch_size=32, resources={"TPU": 4})
    processor = build_processor(config, preprocess=lambda row: {"messages": [...], "sampling_params": {...}},
                                postprocess=lambda row: {"answer": row["generated_text"], **row})
    results = processor(ray.data.read_json("gs://bucket/prompts/"))

Rows carry one of `prompt`, `prompt_token_ids` or `messages` (with `tools`, `chat_template_kwargs`),
optionally `sampling_params` (SamplingParams fields) and `lora` (an adapter's name, or {"name",
"path"}); every other column is carried through. Out come `generated_text`, `generated_tokens`,
`finish_reason`, `num_input_tokens`, `num_generated_tokens`, `num_cached_tokens`, `time_taken_llm`
(seconds from submission to the last token), `ttft_s`, and `error` (None, or what refused the
row: a bad row costs its own output, never the job's).

Each replica is a long-lived actor (`concurrency` of them, or (min, max) autoscaled by Ray Data)
holding one LLM, loaded and compiled once; up to `max_concurrent_batches` batches are in the actor
at once and their rows share the engine's steps (feeder.py), so the batch stays full across
Ray's blocks. Actors that die are restarted by Ray and their batches run again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxinfer.config import EngineConfig
from jaxinfer.integrations.feeder import EngineFeeder
from jaxinfer.rows import parse_row
from jaxinfer.sampling.params import SamplingParams

if TYPE_CHECKING:
    import pyarrow
    import ray.data

    from jaxinfer.outputs import RequestOutput

OUTPUT_COLUMNS = (
    "generated_text",
    "generated_tokens",
    "finish_reason",
    "num_input_tokens",
    "num_generated_tokens",
    "num_cached_tokens",
    "time_taken_llm",
    "ttft_s",
    "error",
)


@dataclasses.dataclass
class JaxinferProcessorConfig:
    model_source: str | None = None  # a model directory or .gguf (as LLM takes it); None: the embedded default
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # LLM's options
    concurrency: int | tuple[int, int] = 1  # replicas, or (min, max) for Ray Data to scale between
    batch_size: int = 32  # rows per batch handed to a replica
    max_concurrent_batches: int = 8  # batches in one replica at once (their rows share its steps)
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica, e.g. 1 for one GPU each
    resources: dict[str, float] = dataclasses.field(default_factory=dict)  # per replica, e.g. {"TPU": 4}
    accelerator_type: str | None = None  # Ray's accelerator_type, e.g. "TPU-V6E" or "H100"
    runtime_env: dict[str, Any] | None = None
    # SamplingParams, or its fields, for what rows leave unset
    sampling_defaults: SamplingParams | dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        try:  # unknown or bad engine options fail here, on the driver, before any actor starts
            EngineConfig(model=self.model_source, **self.engine_kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"engine_kwargs: {e}") from None
        low, high = self.replica_range()
        if not 1 <= low <= high:
            raise ValueError(f"concurrency must be a positive count or (min, max), got {self.concurrency!r}")
        for name in ("batch_size", "max_concurrent_batches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        self.defaults()  # bad sampling defaults name themselves now

    def defaults(self) -> SamplingParams:
        if isinstance(self.sampling_defaults, SamplingParams):
            return self.sampling_defaults
        try:
            return SamplingParams(**self.sampling_defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"sampling_defaults: {e}") from None

    def replica_range(self) -> tuple[int, int]:
        """(fewest, most) replicas."""
        return (self.concurrency, self.concurrency) if isinstance(self.concurrency, int) else self.concurrency

    def replica_resources(self) -> dict[str, float]:
        """What one replica holds, as Ray counts resources."""
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}

    def check_cluster(self) -> None:
        """ValueError naming a resource the connected cluster lacks for the fewest replicas."""
        check_resources(self.replica_resources(), self.replica_range()[0])

    def map_kwargs(self) -> dict[str, Any]:
        """Ray Data's map_batches arguments for the replicas' stage."""
        import ray.data

        low, high = self.replica_range()
        extra = {"accelerator_type": self.accelerator_type} if self.accelerator_type else {}
        return {
            "batch_size": self.batch_size,
            "batch_format": "pyarrow",
            "compute": ray.data.ActorPoolStrategy(
                min_size=low,
                max_size=high,
                max_tasks_in_flight_per_actor=self.max_concurrent_batches,
                max_concurrent_calls_per_actor=self.max_concurrent_batches,
            ),
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": self.resources or None,
            "runtime_env": self.runtime_env,
            **extra,
        }


def check_resources(per_replica: dict[str, float], replicas: int) -> None:
    """ValueError naming a resource the connected Ray cluster lacks for `replicas` replicas (a job
    or deployment that asks for one would wait for it forever)."""
    import ray

    have = ray.cluster_resources()
    for name, need in per_replica.items():
        if need and have.get(name, 0) < need * replicas:
            raise ValueError(
                f"resources: {replicas} replica(s) x {name}={need:g} needs {need * replicas:g}, but the "
                f"Ray cluster has {have.get(name, 0):g} {name} (cluster: {_summary(have)})"
            )


def resources_from_json(flag: str, text: str) -> dict[str, float]:
    """--ray-resources '{"CPU": 4, "TPU": 4}' -> {"CPU": 4.0, "TPU": 4.0}; ValueError naming the flag."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        out = {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag} {text}: {e} (give a JSON object of resource counts)") from None
    bad = [k for k, v in out.items() if v < 0]
    if bad:
        raise ValueError(f"{flag} {text}: {bad[0]} must be >= 0")
    return out


def _summary(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "accelerator_type:"))}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(shown.items())) or "none"


# The row maps around the replicas take no core by default: on a cluster whose cores the replicas
# hold they would otherwise wait for one forever.
LIGHT_MAP = {"num_cpus": 0}


class Processor:
    """processor(dataset) -> dataset: preprocess, the replicas, postprocess (each lazily, as Ray Data runs)."""

    def __init__(
        self,
        config: JaxinferProcessorConfig,
        preprocess: Callable | None,
        postprocess: Callable | None,
        preprocess_map_kwargs: dict[str, Any] | None = None,
        postprocess_map_kwargs: dict[str, Any] | None = None,
    ):
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess
        self.preprocess_map_kwargs = preprocess_map_kwargs or LIGHT_MAP
        self.postprocess_map_kwargs = postprocess_map_kwargs or LIGHT_MAP

    def __call__(self, dataset: ray.data.Dataset) -> ray.data.Dataset:
        self.config.check_cluster()
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess, **self.preprocess_map_kwargs)
        dataset = dataset.map_batches(
            RowReplica,
            fn_constructor_kwargs={
                "model_source": self.config.model_source,
                "engine_kwargs": self.config.engine_kwargs,
                "defaults": self.config.defaults(),
            },
            **self.config.map_kwargs(),
        )
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess, **self.postprocess_map_kwargs)
        return dataset


def build_processor(
    config: JaxinferProcessorConfig,
    preprocess: Callable | None = None,
    postprocess: Callable | None = None,
    preprocess_map_kwargs: dict[str, Any] | None = None,
    postprocess_map_kwargs: dict[str, Any] | None = None,
) -> Processor:
    """A processor over `config`'s replicas; `preprocess` / `postprocess` map each row (dict -> dict),
    with Dataset.map's arguments in `*_map_kwargs` (default: no core of their own, LIGHT_MAP)."""
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


class Replica:
    """A Ray Data actor: one LLM, compiled at construction, fed by every batch the actor holds."""

    def __init__(self, model_source: str | None, engine_kwargs: dict[str, Any], defaults: SamplingParams):
        from jaxinfer.llm import LLM

        self.llm = LLM(model_source, **engine_kwargs)
        self.feeder = EngineFeeder(self.llm.engine)
        self.defaults = defaults

    async def generate(self, prompt: str | list[int], params: SamplingParams, lora: Any) -> RequestOutput:
        return await asyncio.wrap_future(self.feeder.submit(prompt, params, lora))


class RowReplica(Replica):
    async def __call__(self, batch: pyarrow.Table) -> pyarrow.Table:
        import pyarrow

        rows = batch.to_pylist()
        results = await asyncio.gather(*(self._row(row, i) for i, row in enumerate(rows)))
        return pyarrow.Table.from_pylist([{**row, **result} for row, result in zip(rows, results)])

    async def _row(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        start = time.monotonic()
        try:
            _, prompt, params, lora = parse_row(_present(row), f"row {row.get('id', index)}", self.defaults, self.llm)
            out = await self.generate(prompt, params, lora)
        except Exception as e:  # noqa: BLE001 - what refused the row is its error column
            return dict.fromkeys(OUTPUT_COLUMNS) | {"error": str(e) if isinstance(e, ValueError) else repr(e)}
        first, metrics = out.outputs[0], out.metrics
        return {
            "generated_text": first.text,
            "generated_tokens": list(first.token_ids),
            "finish_reason": first.finish_reason,
            "num_input_tokens": out.usage.prompt_tokens,
            "num_generated_tokens": out.usage.completion_tokens,
            "num_cached_tokens": out.usage.cached_prompt_tokens,
            "time_taken_llm": time.monotonic() - start,
            "ttft_s": None if metrics.first_token_time is None else metrics.first_token_time - metrics.arrival_time,
            "error": None,
        }


def _present(row: dict[str, Any]) -> dict[str, Any]:
    """A row as Arrow hands it back, without the nulls its schema adds: a struct column holds every
    key any row has (None where a row lacks it), so sampling_params and messages lose those keys."""
    out = dict(row)
    if isinstance(out.get("sampling_params"), dict):
        out["sampling_params"] = {k: v for k, v in out["sampling_params"].items() if v is not None}
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in out["messages"]
        ]
    return out
