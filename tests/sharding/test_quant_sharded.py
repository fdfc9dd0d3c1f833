"""Quantized weights on a tensor=2 mesh of forced CPU devices: scales split with their weight's
output (or grouped input) axis, and greedy tokens equal to the single-device quantized run."""
import json
import os
import subprocess
import sys

from testpaths import FIXTURES

SCRIPT = r"""
import json, sys
import jax
from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams
path, out = sys.argv[1], {}
prompts = [[1, 17, 301, 45, 9], [250, 77, 3, 128, 64, 5, 499, 12, 8], [33] * 20]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
for method, group in (("int8", None), ("int4", 16)):
    runs = {}
    for mesh in (None, "tensor=2"):
        llm = LLM(path, "float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                  token_buckets=[8, 32], mesh=mesh, quantization=method, quantization_group_size=group,
                  compilation_cache_dir=None)
        runs[mesh] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        layer = llm.engine.runner.params.layers[0]
    out[method] = {"equal": runs[None] == runs["tensor=2"], "devices": len(jax.devices()),
                   "down_scales": list(layer.w_down.scales.sharding.spec),
                   "qkv_scales": list(layer.w_qkv.scales.sharding.spec),
                   "qkv_values": list(layer.w_qkv.values.sharding.spec)}
print(json.dumps(out))
"""


def test_quantized_tensor_parallel_matches_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(FIXTURES / "hf" / "llama3")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for method in ("int8", "int4"):
        assert r[method]["devices"] == 8 and r[method]["equal"], r
        # Fused q|k|v [E, K, G+2, D]: values and scales both split by KV head.
        assert r[method]["qkv_values"][:2] == r[method]["qkv_scales"][:2] == [None, "tensor"]
    # w_down [F, E]: an int8 scale per output column is replicated (its size-1 F axis); int4's
    # [F/g, E] groups split over tensor with the rows they scale.
    assert "tensor" not in r["int8"]["down_scales"]
    assert r["int4"]["down_scales"][:1] == ["tensor"]
