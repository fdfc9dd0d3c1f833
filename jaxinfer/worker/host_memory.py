"""Host heap reuse for a step that runs on the CPU (EngineConfig.cpu_heap_reuse).

XLA:CPU allocates each call's temporaries afresh: at batch 32 they include the logits and the
sampler's vocabulary-wide buffers, tens of MiB in all. glibc serves every block over 32 MiB
with its own mmap and unmaps it on free, so each step touches fresh pages and takes a page
fault per 4 KiB written: ~15 ms of a ~120 ms batch-32 SmolLM2 step on a 2-core CPU, and the
same again per prefill chunk. Serving large blocks from the heap (M_MMAP_MAX = 0) and keeping
the freed top of the heap up to HEAP_KEEP_BYTES (M_TRIM_THRESHOLD) lets the next step reuse the
same pages: tcmalloc and jemalloc, which CPU inference stacks preload for this reason, keep
freed memory likewise.

The settings are the process's (glibc has no per-library allocator). They are applied once the
model's weights and the KV pool are placed, so loading's transient buffers are still given back.
A process that chose its own allocator (MALLOC_* variables, or an allocator in LD_PRELOAD) is
left alone, as is any C library other than glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
HEAP_KEEP_BYTES = 1 << 30
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_applied = False


def reuse_freed_heap() -> bool:
    """Asks glibc to keep freed large blocks for reuse; True once it applies (also when an
    earlier call applied it), False where the process's allocator is not glibc's or was chosen
    by the user."""
    global _applied
    if _applied:
        return True
    reason = _left_alone()
    if reason:
        logger.debug("host heap reuse not applied: %s", reason)
        return False
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, HEAP_KEEP_BYTES)):
        logger.warning("host heap reuse: glibc's mallopt refused the settings")
        return False
    _applied = True
    return True


def _left_alone() -> str | None:
    """Why the allocator is not to be touched, or None."""
    chosen = [name for name in _USER_SETTINGS if name in os.environ]
    if chosen:
        return f"the environment sets {', '.join(chosen)}"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        return f"LD_PRELOAD={os.environ['LD_PRELOAD']!r} brings its own allocator"
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return "the C library is not glibc"
    return None
