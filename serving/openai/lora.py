"""LoRA adapters over HTTP, as vLLM serves them.

    GET  /v1/models                      the base model, then one card per adapter ("parent": the base)
    POST /v1/completions {"model": NAME} a request naming an adapter runs under it
    POST /v1/load_lora_adapter   {"lora_name": NAME, "lora_path": DIR}     (only with
    POST /v1/unload_lora_adapter {"lora_name": NAME}                        runtime updating on)

A load reads and checks the adapter on a worker thread (jaxinfer.lora.peft: a bad one is a 400
naming the problem, and nothing else changes), then registers it on the engine thread between
two steps; it reaches a device slot with its first request. Unloading an adapter that requests
still use is refused (400); an unknown one is a 404. The adapters are the engine's own list
(ApiContext.adapters), so those loaded or unloaded over gRPC are served here too, and back.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jaxinfer.lora.peft import AdapterError
from serving.openai.errors import APIError, bad_request
from serving.openai.handlers import ApiContext, parse
from serving.openai.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest


def adapter_cards(ctx: ApiContext) -> list[dict]:
    """/v1/models cards of the adapters the server knows, after the base model's."""
    return [
        {
            "id": name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "jaxinfer",
            "root": entry.path,
            "parent": ctx.model_name,
            "max_model_len": ctx.limits.max_model_len,
        }
        for name, entry in sorted(ctx.adapters().items())
    ]


class LoraEndpoints:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    async def load(self, request: Request) -> Response:
        req = await parse(request, LoadLoraAdapterRequest)
        engine = self.ctx.engine_loop.engine
        if (manager := engine.lora) is None:
            raise bad_request(None, "LoRA adapters are not enabled on this server (--enable-lora)")
        if req.lora_name == self.ctx.model_name:
            raise bad_request("lora_name", f"lora_name {req.lora_name!r} is the base model's name")
        try:
            adapter = await self.ctx.in_worker(manager.registry.read, req.lora_path)
            entry = await asyncio.wrap_future(
                self.ctx.engine_loop.call(lambda e: manager.load(req.lora_name, req.lora_path, adapter))
            )
        except AdapterError as e:
            raise bad_request("lora_path", str(e)) from None
        return PlainTextResponse(f"Success: LoRA adapter '{entry.name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        req = await parse(request, UnloadLoraAdapterRequest)
        if (manager := self.ctx.engine_loop.engine.lora) is None:
            raise bad_request(None, "LoRA adapters are not enabled on this server (--enable-lora)")
        if req.lora_name not in self.ctx.adapters():
            raise APIError(404, f"The LoRA adapter {req.lora_name!r} cannot be found.", param="lora_name")
        try:
            await asyncio.wrap_future(self.ctx.engine_loop.call(lambda e: manager.unload(req.lora_name)))
        except AdapterError as e:
            raise bad_request("lora_name", str(e)) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
