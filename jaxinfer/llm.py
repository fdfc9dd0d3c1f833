"""LLM: the offline Python API, shaped like vLLM's.

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text

`generate` queues every prompt, steps the engine until all are done (with a progress bar) and
returns one accumulated RequestOutput per prompt, in input order. `stream` yields the deltas of
one prompt as they are produced; `chat` renders messages with the model's chat template first.

Every step's deltas go to their request's inbox, so several streams and `generate` calls
interleaved in one thread each get exactly their own, whichever of them stepped the engine.

    llm = LLM(model, mesh="data=2,tensor=4")      # 8 devices: 2 replicas x 4-way tensor parallel

On several hosts every process runs the same script (with coordinator_address, num_processes and
process_id, or the JAXINFER_* environment variables). Process 0 schedules and returns the
results; on the others `generate` and `stream` run process 0's steps and return nothing.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from jaxinfer.config import EngineConfig
from jaxinfer.core.requests import CheckedRequest
from jaxinfer.engine import Engine
from jaxinfer.loader import LoadedModel, load_model
from jaxinfer.lora import LoRARequest
from jaxinfer.outputs import BeamSearchOutput, RequestOutput
from jaxinfer.quant import QuantConfig
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.beam import BeamSearchParams
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.chat_template import check_messages, check_template_kwargs, load_chat_template
from jaxinfer.worker.programs import prefetch_programs, weights_path
from sharding import head_layout, initialize, is_multiprocess, make_mesh, make_placer

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

Prompt = str | list[int] | CheckedRequest  # a CheckedRequest (Engine.check_request) carries its params
Message = dict[str, str]


def _loaded(model: LoadedModel | None, config: EngineConfig) -> LoadedModel:
    """The model `config` names, read and placed over its mesh (quantized as it says), or a
    LoadedModel as it is, on one device: its dtype and quantization were settled when it was
    loaded."""
    load, mesh = config.load, config.parallel.mesh
    quant = QuantConfig.parse(load.quantization, load.quantization_group_size, load.quantize_embedding)
    if model is not None:
        if mesh is not None or (quant is not None and quant.method != "auto") or load.dtype != "auto":
            raise ValueError(
                f"LLM(<loaded {model.path}>): a loaded model is served on one device as it was "
                "loaded; for another dtype, a quantization or a mesh, give LLM its path"
            )
        return model
    place_for, device_mesh = None, make_mesh(mesh) if mesh is not None else None
    if device_mesh is not None:
        place_for = lambda cfg, family: make_placer(  # noqa: E731
            device_mesh, family.param_axes, head_layout(device_mesh, cfg.num_heads, cfg.num_kv_heads), cfg.num_layers
        )
    return load_model(
        load.model, load.dtype, place_for=place_for, quantization=quant, prepared_dir=weights_path(config)
    )


class LLM:
    def __init__(
        self, model: str | LoadedModel | None = None, dtype: str = "auto", *, warm_up: bool = True, **options: Any
    ):
        """Loads `model` (a model directory or a .gguf file; None = the embedded default), or
        serves a LoadedModel (`jaxinfer.loader.load_model`) as it is: several engines over one
        copy of the weights, e.g. to compare settings, without loading them again.

        `options`: any EngineConfig option, by its flat name (the signature lists them all, and
        each `jaxinfer` flag is one of them): e.g. max_num_seqs=32, mesh="data=2,tensor=4",
        quantization="int8", speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        enable_prompt_logprobs=True. `warm_up=False` leaves compiling to `llm.engine.warm_up()` (or
        to the first step needing each variant); on several hosts all compile together at start."""
        loaded = model if isinstance(model, LoadedModel) else None
        config = EngineConfig(model=None if loaded else model, dtype=dtype, **options)
        parallel = config.parallel
        initialize(parallel.coordinator_address, parallel.num_processes, parallel.process_id)  # before any device
        prefetch_programs(config)  # the step's stored executables read while the weights load
        template = None if config.load.chat_template is None else load_chat_template(config.load.chat_template)
        self.engine = Engine(_loaded(loaded, config), config, warm_up=warm_up or is_multiprocess())
        self.tokenizer = _with_template(self.engine.tokenizer, template)
        self._inboxes: dict[str, collections.deque[RequestOutput]] = {}  # request id -> deltas

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        kv_transfer_params: dict | Sequence[dict | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given ([] on processes other
        than 0 of a multi-host engine, which run process 0's steps instead). `lora_request`: the
        LoRA adapter of every prompt, or a list with one per prompt (None: the base model);
        `kv_transfer_params` the same way (disaggregated prefill/decode, vLLM's params)."""
        if not self.engine.is_leader:
            self.engine.follow()
            return []
        batch = [prompts] if isinstance(prompts, (str, CheckedRequest)) or _is_token_ids(prompts) else list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            sampling_params = [sampling_params or SamplingParams()] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")
        priority = priority or [0] * len(batch)
        loras, kvs = _per_prompt(lora_request, len(batch)), _per_prompt(kv_transfer_params, len(batch), dict)
        ids = []
        try:
            for prompt, params, prio, lora, kv in zip(batch, sampling_params, priority, loras, kvs):
                ids.append(self._add(prompt, params, prio, lora, kv))
        except Exception:
            for rid in ids:  # a bad prompt rejects the call; nothing of it stays queued
                self.engine.abort(rid)
                self._inboxes.pop(rid, None)
            self.engine.release_followers()
            raise
        results = self.collect(ids, use_tqdm)
        return [results[rid] for rid in ids]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt its `params.beam_width` finished beams, best first
        (HF transformers' search, jaxinfer/core/beam.py). ValueError for bad params."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        batch = [prompts] if isinstance(prompts, (str, CheckedRequest)) or _is_token_ids(prompts) else list(prompts)
        outs = self.generate(batch, [params] * len(batch), use_tqdm=use_tqdm, lora_request=lora_request)  # type: ignore[list-item]
        return [BeamSearchOutput.of(out, params.length_penalty) for out in outs]

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template, then generates (`lora_request` as
        in `generate`). `tools` (OpenAI's
        [{"type": "function", "function": {...}}]) go to the template; read the calls out of the
        text with `jaxinfer.tokenizer.tool_calls` (`parser_for_template(llm.tokenizer.chat_template)`).
        `chat_template_kwargs`: more template variables, e.g. {"enable_thinking": False} (Qwen3)."""
        conversations = [messages] if _is_conversation(messages) else list(messages)
        prompts = [self.render_chat(c, add_generation_prompt, tools, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Chat template -> token ids (the template itself writes BOS and role markers)."""
        check_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools={tools!r:.80}: must be a list of tool objects")
        extra = check_template_kwargs(chat_template_kwargs)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send prompt token ids, not messages")
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, *, lora_request: LoRARequest | None = None
    ) -> Iterator[RequestOutput]:
        """Yields the deltas of one request as the engine produces them."""
        if not self.engine.is_leader:
            self.engine.follow()
            return
        rid = self._add(prompt, sampling_params, lora=lora_request)
        try:
            finished = False
            while not finished:
                out = self._next_delta(rid)
                finished = out.finished
                yield out
        finally:
            self.engine.abort(rid)  # a no-op once finished; frees the pages if the caller stopped early
            self._inboxes.pop(rid, None)
            self.engine.release_followers()

    def _add(
        self, prompt: Prompt, params: SamplingParams | None, prio: int = 0, lora: Any = None, kv: dict | None = None
    ) -> str:
        rid = self.engine.add_request(prompt, params, priority=prio, lora_request=lora, kv_transfer_params=kv)
        self._inboxes[rid] = collections.deque()
        return rid

    def _next_delta(self, rid: str) -> RequestOutput:
        """The request's next delta, stepping the engine (for everyone) until there is one."""
        inbox = self._inboxes[rid]
        while not inbox:
            for out in self.engine.step():
                box = self._inboxes.get(out.request_id)
                if box is not None:  # requests added to the engine directly are not ours
                    box.append(out)
        return inbox.popleft()

    def collect(self, ids: list[str], use_tqdm: bool = False) -> dict[str, RequestOutput]:
        """Steps until every request in `ids` (added to this LLM or straight to its engine, with
        no step in between) has finished; their accumulated outputs by id."""
        for rid in ids:
            self._inboxes.setdefault(rid, collections.deque())
        try:
            return self._collect(ids, use_tqdm)
        finally:
            self.engine.release_followers()

    def _collect(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
                for rid in ids:  # each request's deltas wait in its inbox while others are read
                    while rid not in results or not results[rid].finished:
                        delta = self._next_delta(rid)
                        if rid in results:
                            results[rid].merge(delta)
                        else:
                            results[rid] = delta
                    bar.update(1)
        finally:
            for rid in ids:
                self._inboxes.pop(rid, None)
        return results


def _per_prompt(value: Any, n: int, kind: type = LoRARequest) -> list:
    """One value per prompt: a single one (or None) for all, or a list of n."""
    if value is None or isinstance(value, kind):
        return [value] * n
    what = "lora requests" if kind is LoRARequest else "kv_transfer_params"
    if len(values := list(value)) != n:
        raise ValueError(f"{len(values)} {what} for {n} prompts")
    return values


def _with_template(tokenizer: Tokenizer | None, template: str | None) -> Tokenizer | None:
    """The tokenizer, rendering chats with `template` when one is given."""
    if template is not None:
        if tokenizer is None:
            raise ValueError("chat_template: this model has no tokenizer to use it with")
        tokenizer.chat_template = template
    return tokenizer


def _is_token_ids(prompts: object) -> TypeIs[list[int]]:
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)


def _is_conversation(messages: object) -> TypeIs[list[Message]]:
    """One conversation (its first message a dict), not a sequence of them."""
    return isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)


def _signature() -> inspect.Signature:
    """LLM(model, dtype, *, warm_up, <every EngineConfig option with its default>): generated, so
    help(LLM) and editors list the options EngineConfig declares."""
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter(
            "model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation="str | LoadedModel | None"
        ),
        inspect.Parameter("dtype", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="auto", annotation="str"),
        inspect.Parameter("warm_up", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool"),
    ]
    params += [
        inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=d.default, annotation=d.annotation)
        for _, d in EngineConfig.declared()
        if d.name not in ("model", "dtype")
    ]
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
