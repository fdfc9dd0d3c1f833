"""The headline figures as pictures: reads benchmarks/headline.json (copied from the entries of
benchmarks/RESULTS.md it names) and writes the PNGs that docs/design/benchmarks.md shows.

    python benchmarks/plot_headline.py [--out docs/assets]

    decode.png            decode tokens/s beside the floor (weights + KV over the copy rate), H100
    decode_h200.png       the same on an H200 (an earlier lease: before the greedy twin)
    attention_decode.png  the decode attention kernel beside jax's own paged attention
    cpu_peers.png         the engine beside HF transformers and llama.cpp on the CPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / "headline.json"
OUT = HERE.parent / "docs" / "assets"


def _label(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _bars(ax, labels: list[str], series: dict[str, list[float | None]]) -> None:
    """Grouped bars, one group per label, one bar per series (None: not measured, left out)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt=_label, fontsize=7)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels)
    ax.legend(fontsize=8)


def _caption(fig, group: dict) -> None:
    fig.text(0.01, 0.01, f"{group['device']}, {group['date']} (benchmarks/RESULTS.md)", fontsize=7, color="gray")


def decode(group: dict, path: Path) -> Path:
    rows = group["rows"]
    labels = [f"{r['shape']}\nbatch {r['batch']}" for r in rows]
    measured = [r["batch"] * 1000 / r["ms_per_step"] for r in rows]
    floor = [r["batch"] * 1000 / r["floor_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(ax, labels, {"measured": measured, "floor (bytes over the copy rate)": floor})
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode throughput beside its floor, {group['device']}")
    _caption(fig, group)
    return _save(fig, path)


def attention_decode(group: dict, path: Path) -> Path:
    rows = group["rows"]
    labels = [f"batch {r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(
        ax,
        labels,
        {"jaxinfer pallas_gpu": [r["ours_ms"] for r in rows], "jax paged_attention": [r["jax_ms"] for r in rows]},
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (lower is better)")
    ax.set_title(f"Decode attention at {group['context']} tokens of context")
    _caption(fig, group)
    return _save(fig, path)


def cpu_peers(group: dict, path: Path) -> Path:
    rows = group["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    series = {"jaxinfer": [r["jaxinfer"] for r in rows], "HF transformers": [r["hf"] for r in rows]}
    series["llama.cpp"] = [r["llamacpp"] for r in rows]
    _bars(ax, [r["run"] for r in rows], series)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{group['model']} on the CPU")
    _caption(fig, group)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: the same data, the same file
    plt.close(fig)
    return path


# headline.json's group -> how it is drawn; the picture is docs/assets/<group>.png.
PLOTS = {"decode": decode, "decode_h200": decode, "attention_decode": attention_decode, "cpu_peers": cpu_peers}


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    data = json.loads(args.data.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    return [plot(data[name], args.out / f"{name}.png") for name, plot in PLOTS.items()]


if __name__ == "__main__":
    for path in main():
        print(path)
