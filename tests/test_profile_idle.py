"""benchmarks/profile_idle.py on a hand-made trace: overlapping kernels, gaps, other processes."""
import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_idle import device_idle  # noqa: E402


def _write(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_busy_is_the_union_of_kernel_intervals(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
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
