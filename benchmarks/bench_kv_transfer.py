"""What pulling KV pages from another process costs (jax.experimental.transfer over loopback,
the mechanism of jaxinfer/worker/kv_transfer.py) beside a plain host copy of the same bytes.

    python benchmarks/bench_kv_transfer.py                    # SmolLM2-135M's pages, 64 and 256 of them
    python benchmarks/bench_kv_transfer.py --pages 64 256 1024 --rounds 7

A source process holds one array per layer shaped as a KV cache's pages ([pages, page, 2K, D],
SmolLM2-135M: 30 layers of [n, 16, 6, 64] bfloat16 by default) and offers them once per round;
this process pulls them (one pull of every layer's array, as a transfer of one sequence's pages
moves them) and times it until the arrays are ready. Beside it, per round: the same bytes copied
host to host (numpy), and put on this process's device from host memory (jax.device_put). Each
figure: the median over --rounds (after one untimed round), and MiB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer

SOURCE = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.experimental import transfer
layers, shape, rounds = json.loads(sys.argv[1])
server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
arrays = [jnp.full(shape, i + 1, jnp.bfloat16) for i in range(layers)]
for r in range(rounds):
    server.await_pull(r, arrays)
print(server.address(), flush=True)
sys.stdin.readline()  # until the puller is done
"""


def measure(layers: int, shape: tuple[int, ...], rounds: int) -> dict[str, float]:
    source = subprocess.Popen(
        [sys.executable, "-c", SOURCE, json.dumps([layers, list(shape), rounds + 1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = source.stdout.readline().strip()
        device = jax.devices()[0]
        server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
        connection = server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(device)
        specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding) for _ in range(layers)]
        host = [np.ones(shape, jnp.bfloat16) for _ in range(layers)]
        out = [np.empty_like(h) for h in host]
        times: dict[str, list[float]] = {"pull": [], "host copy": [], "device_put": []}
        for r in range(rounds + 1):
            start = time.perf_counter()
            pulled = connection.pull(r, specs)
            jax.block_until_ready(pulled)
            pull = time.perf_counter() - start
            assert float(pulled[-1][0, 0, 0, 0]) == layers  # the source's bytes
            start = time.perf_counter()
            for h, o in zip(host, out):
                np.copyto(o, h)
            copy = time.perf_counter() - start
            start = time.perf_counter()
            jax.block_until_ready([jax.device_put(h, device) for h in host])
            put = time.perf_counter() - start
            if r:
                times["pull"].append(pull)
                times["host copy"].append(copy)
                times["device_put"].append(put)
        source.stdin.write("\n")
        source.stdin.flush()
    finally:
        source.wait(30)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, nargs="+", default=[64, 256])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--page-shape", type=int, nargs=3, default=[16, 6, 64], metavar=("PAGE", "2K", "D"))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    print(f"{args.layers} layers of [pages, {', '.join(map(str, args.page_shape))}] bfloat16, median of {args.rounds}")
    print("| pages | MiB | pull ms (MiB/s) | host copy ms (MiB/s) | device_put ms (MiB/s) | pull / host copy |")
    print("|---|---|---|---|---|---|")
    for pages in args.pages:
        shape = (pages, *args.page_shape)
        mib = args.layers * int(np.prod(shape)) * 2 / 2**20
        t = measure(args.layers, shape, args.rounds)
        cells = " | ".join(f"{t[k] * 1e3:.2f} ({mib / t[k]:.0f})" for k in ("pull", "host copy", "device_put"))
        print(f"| {pages} | {mib:.1f} | {cells} | {t['pull'] / t['host copy']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
