"""The LoRA calls of jaxinfer.v1.InferenceService, and a Generate call's adapter.

    ListLoraAdapters   the adapters the engine knows (name, id, path, rank, modules)
    LoadLoraAdapter    reads and checks an adapter on a worker thread (INVALID_ARGUMENT naming
                       the problem), then registers it on the engine thread between two steps
    UnloadLoraAdapter  NOT_FOUND for an unknown name, FAILED_PRECONDITION while requests use it
Loading and unloading answer FAILED_PRECONDITION unless the server was started with
--allow-runtime-lora-updating (and every call does without --enable-lora). A Generate call names
its adapter in `lora_adapter`; an unknown name is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from jaxinfer.core.requests import CheckedRequest
from jaxinfer.lora.manager import LoraManager
from jaxinfer.lora.peft import AdapterError
from jaxinfer.lora.registry import AdapterEntry
from jaxinfer.lora.request import LoRARequest
from serving.engine_loop import EngineLoop
from serving.errors import RequestError
from serving.grpc.proto import jaxinfer_pb2 as pb


class LoraCalls:
    """Mixed into InferenceServicer: its engine loop, worker pool and `lora_updates` switch."""

    _engine_loop: EngineLoop
    _in_worker: Callable[..., Awaitable[Any]]  # the servicer's: fn(*args) on its worker pool
    lora_updates: bool = False
    served_model_name: str | None = None  # the base model's name on the HTTP API: no adapter takes it

    def _lora_manager(self) -> LoraManager | None:
        return self._engine_loop.engine.lora

    def with_lora(self, name: str, checked: CheckedRequest) -> CheckedRequest:
        """The request under the adapter `name` ("": as it is); RequestError for an unknown one."""
        if not name:
            return checked
        manager = self._lora_manager()
        if manager is None:
            raise RequestError(f"lora_adapter {name!r}: LoRA adapters are not enabled on this server (--enable-lora)")
        entry = next((e for e in manager.adapters if e.name == name), None)
        if entry is None:
            known = sorted(e.name for e in manager.adapters)
            raise RequestError(f"lora_adapter {name!r}: no such adapter (loaded: {known})")
        return dataclasses.replace(checked, lora=LoRARequest(entry.name, entry.int_id))

    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoraAdaptersResponse:
        manager = self._lora_manager()
        if manager is None:
            return pb.ListLoraAdaptersResponse()
        entries = await asyncio.wrap_future(self._engine_loop.call(lambda e: [_card(a) for a in manager.adapters]))
        return pb.ListLoraAdaptersResponse(
            adapters=entries, max_loras=manager.config.max_loras, max_lora_rank=manager.config.max_lora_rank
        )

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapter:
        manager = await self._check_updates(context)
        if not request.lora_name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path must both be set")
        if request.lora_name == self.served_model_name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"lora_name {request.lora_name!r} is the base model's name"
            )
        try:
            adapter = await self._in_worker(manager.registry.read, request.lora_path)
            return await asyncio.wrap_future(
                self._engine_loop.call(lambda e: _card(manager.load(request.lora_name, request.lora_path, adapter)))
            )
        except AdapterError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # never reached: abort raises

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        manager = await self._check_updates(context)
        if request.lora_name not in manager.registry:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"lora_name {request.lora_name!r}: no such adapter")
        try:
            await asyncio.wrap_future(self._engine_loop.call(lambda e: manager.unload(request.lora_name)))
        except AdapterError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.UnloadLoraAdapterResponse()

    async def _check_updates(self, context: grpc.aio.ServicerContext) -> LoraManager:
        """The engine's adapters, where this server may load and unload them (else the call ends)."""
        manager = self._lora_manager()
        if manager is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "LoRA adapters are not enabled on this server (--enable-lora)"
            )
            raise AssertionError("unreachable: abort raises")
        if not self.lora_updates:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "loading and unloading LoRA adapters needs a server started with --allow-runtime-lora-updating",
            )
        return manager


def _card(entry: AdapterEntry) -> pb.LoraAdapter:
    """An adapter as ListLoraAdapters describes it."""
    return pb.LoraAdapter(
        name=entry.name, int_id=entry.int_id, path=entry.path, rank=entry.rank, target_modules=entry.target_modules
    )
