"""Quantized weights on meshes of forced CPU devices: scales split with their weight's output (or
grouped input) axis, and greedy tokens equal to the single-device quantized run; a mixture's
quantized experts split over `expert` and `tensor` alike."""

import json
import subprocess
import sys

from testpaths import FIXTURES
from xla_env import child_env

# argv: cases "model:method:group:mesh;...". Prints {case: {"equal", "devices", arrays' specs}}.
SCRIPT = r"""
import json, sys
import jax
from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams
root, out = sys.argv[1], {}
prompts = [[1, 17, 301, 45, 9], [250, 77, 3, 128, 64, 5, 499, 12, 8], [33] * 20]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
spec = lambda a: [str(x) if x is not None else None for x in a.sharding.spec]
for case in sys.argv[2].split(";"):
    name, method, group, mesh = case.split(":")
    runs = {}
    for m in (None, mesh):
        llm = LLM(f"{root}/{name}", "float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                  token_buckets=[8, 32], num_pages=32, warm_up=False, mesh=m, quantization=method,
                  quantization_group_size=int(group) if group else None)
        runs[m] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    layer = next(l for l in llm.engine.worker.state.params.layers if getattr(l, "router", None) is not None) \
        if name != "llama3" else llm.engine.worker.state.params.layers[0]
    arrays = {"down": layer.w_down, "qkv": layer.w_qkv} if name == "llama3" else \
        {"gate_up": layer.experts_gate_up, "down": layer.experts_down}
    out[case] = {"equal": runs[None] == runs[mesh], "devices": len(jax.devices()),
                 **{f"{k}_{part}": spec(getattr(w, part)) for k, w in arrays.items() for part in ("values", "scales")}}
print(json.dumps(out))
"""


def _run(cases: list[str]) -> dict:
    env = child_env(8, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(FIXTURES / "hf"), ";".join(cases)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in cases:
        assert r[case]["devices"] == 8 and r[case]["equal"], (case, r[case])
    return r


def test_quantized_tensor_parallel_matches_single_device():
    int8, int4 = "llama3:int8::tensor=2", "llama3:int4:16:tensor=2"
    r = _run([int8, int4])
    for case in (int8, int4):
        # Fused q|k|v [E, K, G+2, D]: values and scales both split by KV head.
        assert r[case]["qkv_values"][:2] == r[case]["qkv_scales"][:2] == [None, "tensor"]
    # w_down [F, E]: an int8 scale per output column is replicated (its size-1 F axis); int4's
    # [F/g, E] groups split over tensor with the rows they scale.
    assert "tensor" not in r[int8]["down_scales"]
    assert r[int4]["down_scales"][:1] == ["tensor"]


def test_quantized_experts_split_over_expert_and_tensor():
    # int4 groups of 4: Mixtral's expert width 40 / 4 = 10 groups split over tensor=2.
    int8, int4 = "qwen3_moe:int8::expert=4,tensor=2", "mixtral:int4:4:expert=4,tensor=2"
    r = _run([int8, int4])
    for case in (int8, int4):
        # Stacked gate|up [X, E, 2, F]: whole experts per expert shard, F over tensor, scales alike.
        assert r[case]["gate_up_values"] == r[case]["gate_up_scales"] == ["expert", None, None, "tensor"]
        assert r[case]["down_values"] == ["expert", "tensor", None]
    # Down [X, F, E]: int8's per-column scales [X, 1, E] keep F whole; int4's [X, F/g, E] split it.
    assert r[int8]["down_scales"] == ["expert", None, None]
    assert r[int4]["down_scales"] == ["expert", "tensor", None]
