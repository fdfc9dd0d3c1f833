"""How much of a run the device spent idle, from a `jax.profiler` trace; and where the host's
time goes, from cProfile (`traced` and `host_profile` wrap a run for bench_engine.py).

    with jax.profiler.trace(dir, create_perfetto_trace=True):
        ...  # the steps to look at
    report = device_idle(dir)   # {'busy_s', 'window_s', 'idle_fraction', 'kernels', 'top'}

The trace's `perfetto_trace.json.gz` lists every device kernel as a complete event ("ph": "X")
under a process named like "/device:GPU:0". Busy time is the union of those intervals (kernels
on several streams overlap); the window runs from the first kernel's start to the last one's end;
`top` names the kernels that took most of the busy time. Copies (events named Memcpy...) are
counted by direction; `idle_after_d2h_s` sums the device's idle time right after each
device-to-host copy (a conditional's predicate read by the host drains the queue: the device
then waits for the next launch).

On the CPU (`device_prefix=CPU_DEVICE`, what `device_of("cpu")` gives) the device's work is
XLA:CPU's operations (thunks) on its intra-op threads, named "tf_XLAEigen/...". They appear in
the trace only when XLA_FLAGS has CPU_TRACE_FLAG before JAX starts (bench_engine.py --profile
sets it). Their events are taken without the executor's wrappers and grouped by kind
("ynn_fusion.125" counts as "ynn_fusion"); a loop's own event spans its body's, so `top` counts
a loop's body twice (busy time, a union, does not). Idle time there is when no XLA thread runs an
operation: the host's share of the step, on the same cores.
"""

from __future__ import annotations

import collections
import cProfile
import gzip
import io
import json
import pstats
import re
import tempfile
from pathlib import Path

CPU_DEVICE = "tf_XLAEigen"  # the thread-name prefix of XLA:CPU's intra-op threads
CPU_TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"
_CPU_WRAPPERS = ("ThunkExecutor::", "SlinkyThreadPool::", "end: ")


def device_of(backend: str) -> str:
    """The `device_prefix` of device_idle for a JAX backend name."""
    return CPU_DEVICE if backend == "cpu" else f"/device:{backend.upper()}"


def _load(trace_dir: str | Path) -> dict:
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def _device_spans(events: list[dict], device_prefix: str) -> list[tuple[float, float, str]]:
    """(start, end, name) of each device event, in start order: the events of the processes
    named `device_prefix`..., or for CPU_DEVICE the operations on XLA:CPU's threads."""
    if device_prefix == CPU_DEVICE:
        threads = {
            (e["pid"], e["tid"])
            for e in events
            if e.get("ph") == "M"
            and e.get("name") == "thread_name"
            and str(e.get("args", {}).get("name", "")).startswith(CPU_DEVICE)
        }
        chosen = [
            e
            for e in events
            if e.get("ph") == "X"
            and (e.get("pid"), e.get("tid")) in threads
            and not e.get("name", "").startswith(_CPU_WRAPPERS)
        ]
        name = lambda e: re.sub(r"\.\d+$", "", e.get("name", ""))  # noqa: E731
    else:
        pids = {
            e["pid"]
            for e in events
            if e.get("ph") == "M"
            and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith(device_prefix)
        }
        chosen = [e for e in events if e.get("ph") == "X" and e.get("pid") in pids]
        name = lambda e: e.get("name", "")  # noqa: E731
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), name(e)) for e in chosen)


def device_idle(trace_dir: str | Path, device_prefix: str = "/device:GPU") -> dict | None:
    """Busy and idle time of the device processes; None if the trace has no device events."""
    events = _load(trace_dir)
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = _device_spans(events, device_prefix)
    if not spans:
        return None
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    by_name: dict[str, float] = collections.defaultdict(float)
    copies: dict[str, int] = collections.Counter()
    idle_after_d2h, ends_with_d2h = 0.0, False  # whether the busy stretch so far ends with a D2H copy
    for start, end, name in spans:
        by_name[name] += end - start
        direction = copy_direction(name)
        if direction is not None:
            copies[direction] += 1
        if start > cur_end:  # a gap
            idle_after_d2h += (start - cur_end) if ends_with_d2h else 0.0
            busy += cur_end - cur_start
            cur_start, cur_end, ends_with_d2h = start, end, direction == "d2h"
        elif end > cur_end:
            cur_end, ends_with_d2h = end, direction == "d2h"
    busy += cur_end - cur_start
    window = max(end for _, end, _ in spans) - spans[0][0]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {
        "busy_s": busy * 1e-6,
        "window_s": window * 1e-6,
        "idle_fraction": 1.0 - busy / window if window > 0 else 0.0,
        "kernels": len(spans) - sum(copies.values()),
        "copies": dict(copies),
        "idle_after_d2h_s": idle_after_d2h * 1e-6,
        "top": [(name, t * 1e-6) for name, t in top],
    }


def copy_direction(name: str) -> str | None:
    """'d2h', 'h2d', 'd2d' or 'other' for a copy event's name (MemcpyD2H, Memcpy DtoH, ...), None
    for a kernel."""
    key = name.lower().replace(" ", "")
    if "memcpy" not in key:
        return None
    for direction, words in (("d2h", ("d2h", "dtoh")), ("h2d", ("h2d", "htod")), ("d2d", ("d2d", "dtod"))):
        if any(w in key for w in words):
            return direction
    return "other"


def traced(run, device_prefix: str = "/device:GPU") -> tuple[object, dict | None]:
    """(run(), device_idle report) of `run` under jax.profiler."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            result = run()
        return result, device_idle(trace_dir, device_prefix)


def host_profile(run) -> tuple[object, str]:
    """(run(), its cProfile top functions by own time and by cumulative time, as text)."""
    profiler = cProfile.Profile()
    profiler.enable()
    result = run()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumulative").print_stats(22)
    return result, out.getvalue()
