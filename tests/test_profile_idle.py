"""benchmarks/profile_idle.py on a hand-made trace: overlapping kernels, gaps, other processes."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_idle import CPU_DEVICE, device_idle, device_of  # noqa: E402


def _write(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_busy_is_the_union_of_kernel_intervals(tmp_path):
    meta = [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
    ]
    kernels = [  # [0, 10) and [5, 12) overlap: busy 12; gap to 20; [20, 30): busy 10 -> 22 of 30
        {"ph": "X", "pid": 7, "tid": 1, "ts": 0, "dur": 10, "name": "fusion"},
        {"ph": "X", "pid": 7, "tid": 2, "ts": 5, "dur": 7, "name": "triton_attn"},
        {"ph": "X", "pid": 7, "tid": 1, "ts": 20, "dur": 10, "name": "fusion"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 1000, "name": "host work"},
    ]
    _write(tmp_path, meta + kernels)
    report = device_idle(tmp_path)
    assert report["busy_s"] == pytest.approx(22e-6)
    assert report["window_s"] == pytest.approx(30e-6)
    assert report["idle_fraction"] == pytest.approx(8 / 30)
    assert report["kernels"] == 3 and report["top"][0] == ("fusion", pytest.approx(20e-6))


def test_no_device_events(tmp_path):
    _write(tmp_path, [{"ph": "X", "pid": 1, "ts": 0, "dur": 5, "name": "host"}])
    assert device_idle(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        device_idle(tmp_path / "nothing")


def test_copies_by_direction_and_the_idle_after_device_to_host(tmp_path):
    """A device-to-host copy that ends a busy stretch charges the gap after it (the host read a
    predicate and launched again); a copy overlapped by a kernel, or another direction, does not."""
    meta = [{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}}]
    events = [
        {"ts": 0, "dur": 10, "name": "fusion"},
        {"ts": 10, "dur": 2, "name": "MemcpyD2H"},  # ends the stretch: gap 12 -> 20 (8)
        {"ts": 20, "dur": 5, "name": "gemm"},
        {"ts": 25, "dur": 1, "name": "Memcpy DtoH (Device -> Pinned)"},
        {"ts": 25, "dur": 6, "name": "gemm"},  # outlasts the copy: gap 31 -> 40 not charged
        {"ts": 40, "dur": 3, "name": "MemcpyH2D"},  # other direction: gap 43 -> 50 not charged
        {"ts": 50, "dur": 4, "name": "fusion"},
    ]
    _write(tmp_path, meta + [{"ph": "X", "pid": 3, "tid": 1, **e} for e in events])
    report = device_idle(tmp_path)
    assert report["copies"] == {"d2h": 2, "h2d": 1}
    assert report["kernels"] == 4
    assert report["idle_after_d2h_s"] == pytest.approx(8e-6)
    assert report["busy_s"] == pytest.approx((12 + 11 + 3 + 4) * 1e-6)


def test_bench_engines_profile_row_shows_kernels_and_copies_per_step(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}}]
    events = [
        {"ts": 0, "dur": 10, "name": "gemm_fusion_dot_1"},
        {"ts": 10, "dur": 2, "name": "MemcpyD2H"},
        {"ts": 30, "dur": 10, "name": "gemm_fusion_dot_1"},
        {"ts": 40, "dur": 2, "name": "MemcpyD2H"},
    ]
    _write(tmp_path, meta + [{"ph": "X", "pid": 3, "tid": 1, **e} for e in events])
    import bench_engine

    row = bench_engine.profile_row(4, 0.05, device_idle(tmp_path), steps=2)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # 24 us busy over 2 steps; 18 us idle of 42; one kernel and one D2H copy a step, 18 us after it
    assert cells[:6] == ["batch 4", "50.00", "0.01", "42.9%", "1", "1.0 (0.009)"], cells
    assert cells[6] == "gemm_fusion_dot_1 0.010, MemcpyD2H 0.002"
    assert "no device events" in bench_engine.profile_row(4, 0.05, None, steps=2)


def test_the_cpu_device_is_xla_cpus_operation_threads(tmp_path):
    """On the CPU the device's events are the operations on XLA:CPU's threads, without the
    executor's wrapper events, grouped by kind; the host thread's events and the other threads'
    do not count."""
    meta = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 11, "args": {"name": "tf_XLAEigen/1234"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 12, "args": {"name": "tf_XLAEigen/5678"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
    ]
    events = [
        {"tid": 11, "ts": 0, "dur": 40, "name": "ThunkExecutor::Execute"},  # a wrapper: not an operation
        {"tid": 11, "ts": 0, "dur": 10, "name": "ynn_fusion.125"},
        {"tid": 12, "ts": 5, "dur": 10, "name": "ynn_fusion.7"},  # overlaps: busy [0, 15)
        {"tid": 12, "ts": 15, "dur": 1, "name": "SlinkyThreadPool::Await"},
        {"tid": 11, "ts": 30, "dur": 10, "name": "dot.3"},  # gap [15, 30): the host's
        {"tid": 11, "ts": 40, "dur": 1, "name": "end: dot.3"},
        {"tid": 1, "ts": 0, "dur": 100, "name": "PjitFunction(step)"},
    ]
    _write(tmp_path, meta + [{"ph": "X", "pid": 1, **e} for e in events])
    assert device_of("cpu") == CPU_DEVICE and device_of("gpu") == "/device:GPU"
    assert device_idle(tmp_path) is None  # no GPU process in this trace
    report = device_idle(tmp_path, CPU_DEVICE)
    assert report["kernels"] == 3
    assert report["busy_s"] == pytest.approx(25e-6)
    assert report["idle_fraction"] == pytest.approx(15 / 40)
    assert report["top"] == [("ynn_fusion", pytest.approx(20e-6)), ("dot", pytest.approx(10e-6))]
