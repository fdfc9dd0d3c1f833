"""An int8 KV cache on meshes of forced CPU devices: the per-head scales split over `tensor` with
the cache's heads (repeated with them when there are fewer KV heads than shards, and given the
leading [data] axis of replicas), and greedy tokens equal to the single-device int8 run."""

import json
import subprocess
import sys

import numpy as np
import pytest
from testpaths import FIXTURES
from xla_env import child_env

SCRIPT = r"""
import json, sys
import jax
import numpy as np
from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams
path, out = sys.argv[1], {}
prompts = [[1, 17, 301, 45, 9], [250, 77, 3, 128, 64, 5, 499, 12, 8], [33] * 20]
greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
for mesh in (None, "tensor=4", "data=2,tensor=2"):
    llm = LLM(path, "float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=[8, 32], num_decode_steps=1, num_pages=32, mesh=mesh, kv_cache_dtype="int8",
              compilation_cache_dir=None, warm_up=False)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    cache = llm.engine.worker.state.kv_caches[0]  # the step donates the caches: read them afterwards
    out[str(mesh)] = {
        "tokens": tokens,
        "scales": np.asarray(cache.scales).reshape(-1).tolist(),
        "scales_spec": [str(a) for a in cache.scales.sharding.spec] if mesh else None,
        "pages_dtype": str(cache.pages.dtype), "devices": len(jax.devices())}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_int8_kv_on_meshes_matches_single_device():
    env = child_env(8, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(FIXTURES / "hf" / "llama3")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    single = r["None"]
    assert single["pages_dtype"] == "int8" and len(single["scales"]) == 4  # (K, V) x 2 kv heads
    for mesh in ("tensor=4", "data=2,tensor=2"):
        assert r[mesh]["devices"] == 8 and r[mesh]["tokens"] == single["tokens"], (mesh, r)
        assert "tensor" in r[mesh]["scales_spec"], r[mesh]
    # The sharded calibration forward sums in another order: equal scales up to float rounding.
    close = lambda a, b: np.allclose(a, b, rtol=1e-5, atol=0)  # noqa: E731
    # tensor=4 over 2 kv heads: each head (its K and V scale) stored on the two shards that need it.
    k0v0, k1v1 = single["scales"][:2], single["scales"][2:]
    assert close(r["tensor=4"]["scales"], k0v0 + k0v0 + k1v1 + k1v1)
    # data=2: a copy of the scales per replica.
    assert close(r["data=2,tensor=2"]["scales"], single["scales"] * 2)
    assert r["data=2,tensor=2"]["scales_spec"][0] == "data"
