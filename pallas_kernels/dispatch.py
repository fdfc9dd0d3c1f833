"""Chooses an implementation of ragged paged attention for the current backend.

"auto" takes the Pallas kernel of the backend ("pallas_tpu" on TPU, "pallas_gpu" on GPU) and the
reference elsewhere. A shape the chosen kernel cannot take falls back to the reference with one
logged warning per cause; an explicitly requested kernel raises a ValueError instead. A kernel
requested explicitly off its platform runs in interpret mode (slow; meant for tests), with one
warning.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

import jax

from pallas_kernels import common
from pallas_kernels.reference import ragged_paged_attention_reference

if TYPE_CHECKING:
    from jax.experimental.pallas.tpu import InterpretParams

IMPLS = ("auto", "reference", "pallas_gpu", "pallas_tpu")
# impl -> (its module, imported when a step first uses it: the CPU's reference never pays for
# Pallas' GPU and TPU lowerings, a third of a second of imports; the platform it compiles for).
_KERNELS = {"pallas_gpu": ("pallas_kernels.gpu", "gpu"), "pallas_tpu": ("pallas_kernels.tpu", "tpu")}
_AUTO = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def target_backend() -> str:
    """The platform the step is built for: the current mesh's devices' where they are another
    platform's (a step traced here for TPU chips of a deviceless topology, ahead of time), else
    JAX's default backend."""
    device = common.mesh_device()
    return device.platform if device is not None else jax.default_backend()


def resolve_impl(impl: str, backend: str | None = None) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    return _AUTO.get(backend or target_backend(), "reference")


def _interpret_flag(impl: str, backend: str) -> bool | InterpretParams:
    """False on the kernel's own platform; interpret-mode settings elsewhere."""
    _, platform = _KERNELS[impl]
    if backend == platform or (platform == "gpu" and backend in ("cuda", "rocm")):
        return False
    _warn_once(f"attention impl {impl!r} on backend {backend!r}: running in interpret mode")
    if impl == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return True


def ragged_paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [P, page, 2*Hkv, D] -> (out [T, Hq, D], kv_cache)."""
    backend = target_backend()
    chosen = resolve_impl(impl, backend)
    args = (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    common.check_contract(*args, k_scale, v_scale)
    common.check_options(sliding_window, soft_cap)
    kwargs: dict[str, Any] = dict(
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale
    )
    if chosen == "reference":
        return ragged_paged_attention_reference(*args, **kwargs)
    module = importlib.import_module(_KERNELS[chosen][0])
    reason = module.unsupported_reason(q, kv_cache, page_indices)
    if reason is not None:
        if impl != "auto":
            raise ValueError(f"attention impl {impl!r} cannot take {reason}")
        _warn_once(f"attention impl {chosen!r} cannot take {reason}; using the reference")
        return ragged_paged_attention_reference(*args, **kwargs)
    kernel = module.ragged_paged_attention_gpu if chosen == "pallas_gpu" else module.ragged_paged_attention_tpu
    return kernel(*args, **kwargs, interpret=_interpret_flag(chosen, backend))
