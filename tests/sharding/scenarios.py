"""Sharded runs for tests/sharding, each in a fresh process with forced CPU devices.

    python tests/sharding/scenarios.py NAME ARGS...   -> one JSON line on stdout (the last line)

The tests start this in a subprocess because the device count is fixed when jax is first
imported, and other test modules of the same pytest run may have imported it with one device.
XLA_FLAGS comes from the caller's environment (JAXINFER_TEST_DEVICES, default 8).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count="
    + os.environ.get("JAXINFER_TEST_DEVICES", "8")
)

import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from testpaths import FIXTURES  # noqa: E402

from jaxinfer.config import EngineConfig  # noqa: E402
from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.loader import load_model  # noqa: E402
from jaxinfer.models.layers import AttentionMetadata  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402
from pallas_kernels import kv_cache_shape  # noqa: E402
from sharding import (
    head_layout,
    kv_cache_spec,
    make_mesh,
    make_placer,
    param_specs,  # noqa: E402
    per_device_bytes,
    tokens_spec,
)
from sharding.multihost import put_inputs  # noqa: E402
from sharding.pipeline import pipeline_tick  # noqa: E402
from sharding.stages import run_stages  # noqa: E402

GENERATE = json.loads((FIXTURES / "hf" / "llama3" / "generate.json").read_text())
ENGINE = dict(
    num_pages=24,
    page_size=16,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    max_model_len=256,
    token_buckets=(8, 32),
    penalties=False,
)  # compilation_cache_dir: the suite's shared persistent cache (tests/support/xla_env.py)


def prompts_and_expected(name: str):
    """llama3: the 16 HF-generate prompts (chunked prefill, preemption); others: the golden one."""
    if name == "llama3":
        return GENERATE["prompts"], GENERATE["outputs"], GENERATE["max_new_tokens"]
    golden = np.load(FIXTURES / "hf" / name / "golden.npz")
    return [golden["input_ids"].tolist()], [golden["greedy"].tolist()], len(golden["greedy"])


def run_engine(engine: Engine, prompts, max_tokens: int) -> tuple[dict[str, list[int]], list[int]]:
    """Greedy outputs by request id, and the replica each request was given to."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    replicas = []
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
        replicas.append(engine._requests[str(i)].replica)
    results: dict[str, list[int]] = collections.defaultdict(list)
    while engine.has_unfinished():
        for delta in engine.step():
            results[delta.request_id] += delta.outputs[0].token_ids
    return results, replicas


def scenario_engine(name: str, mesh: str, offload_gb: str = "0") -> dict:
    """Greedy outputs through the engine on `mesh`, against HF's (= the single-device run's);
    `offload_gb`: the prefix cache's host tier (kv_offload_gb)."""
    model = load_model(FIXTURES / "hf" / name, dtype="float32", with_tokenizer=False)
    engine = Engine(
        model, EngineConfig(**ENGINE, mesh=None if mesh == "none" else mesh, kv_offload_gb=float(offload_gb))
    )
    compiled = engine.worker.num_compiled()
    prompts, expected, max_tokens = prompts_and_expected(name)
    results, replicas = run_engine(engine, prompts, max_tokens)
    pools_empty = all(r.kv_cache.num_free_pages == r.kv_cache.num_usable_pages for r in engine.replicas)
    return {
        "mismatched": [i for i, want in enumerate(expected) if results[str(i)] != want],
        "num_prompts": len(prompts),
        "preemptions": engine.num_preemptions,
        "recompiled": engine.worker.num_compiled() - compiled,
        "pools_empty": pools_empty,
        "requests_per_replica": np.bincount(replicas, minlength=len(engine.replicas)).tolist(),
        "cache_shape": list(engine.worker.state.kv_caches[0].shape),
        "cache_shard_shape": list(engine.worker.state.kv_caches[0].addressable_shards[0].data.shape),
        "host_hits": engine.stats().get("prefix_cache_host_hits", 0),
        "in_flight": engine.worker.pipeline_stages,
    }


class ShardedSequence:
    """One sequence through the model's forward on a mesh (params placed by the loader hook)."""

    def __init__(self, name: str, mesh_spec: str, max_len: int = 128, page_size: int = 16):
        self.mesh = make_mesh(mesh_spec) if mesh_spec != "none" else None
        place_for = None
        if self.mesh is not None:
            place_for = lambda cfg, fam: make_placer(  # noqa: E731
                self.mesh, fam.param_axes, head_layout(self.mesh, cfg.num_heads, cfg.num_kv_heads)
            )
        model = load_model(FIXTURES / "hf" / name, dtype="float32", with_tokenizer=False, place_for=place_for)
        self.family, self.config, self.params = model.family, model.config, model.params
        layout = head_layout(self.mesh, self.config.num_heads, self.config.num_kv_heads)
        pages = -(-max_len // page_size)
        shape = kv_cache_shape(pages + 1, page_size, layout.cache_kv_heads, self.config.head_dim)
        cache_sharding = (
            None if self.mesh is None else NamedSharding(self.mesh, kv_cache_spec(self.mesh, replicas=False))
        )
        zeros = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=cache_sharding)
        self.kv = tuple(zeros() for _ in range(self.config.num_layers))
        self.page_table = np.arange(1, pages + 1, dtype=np.int32)[None]
        self.length = 0
        self._step = jax.jit(self._forward, donate_argnums=(1,))

    def _forward(self, params, kv, tokens, positions, meta):
        hidden, kv = self.family.forward(params, self.config, tokens, positions, kv, meta)
        return self.family.compute_logits(params, hidden), kv

    def feed(self, tokens) -> np.ndarray:
        n = len(tokens)
        tokens = np.asarray(tokens, np.int32)
        positions = np.arange(self.length, self.length + n, dtype=np.int32)
        meta = AttentionMetadata(
            np.array([self.length + n], np.int32), self.page_table, np.array([0, n], np.int32), np.ones(1, np.int32)
        )
        if self.mesh is None:
            logits, self.kv = self._step(self.params, self.kv, tokens, positions, meta)
        else:
            seq = NamedSharding(self.mesh, tokens_spec(self.mesh, replicas=False))
            tokens, positions = put_inputs((tokens, positions), (seq, seq))
            with jax.set_mesh(self.mesh):
                logits, self.kv = self._step(self.params, self.kv, tokens, positions, meta)
        self.length += n
        return np.asarray(logits)


def scenario_logits(cases: str) -> dict:
    """cases "llama3:tensor=8;mistral:tensor=4": prompt logits in two chunks (40 + 24 tokens) on
    the mesh, against one device and against HF's golden logits."""
    out = {}
    for case in cases.split(";"):
        name, mesh = case.split(":")
        golden = np.load(FIXTURES / "hf" / name / "golden.npz")
        prompt = golden["input_ids"]
        single = ShardedSequence(name, "none").feed(prompt)
        sharded = ShardedSequence(name, mesh)
        logits = np.concatenate([sharded.feed(prompt[:40]), sharded.feed(prompt[40:])])
        out[case] = {
            "max_diff_single": float(np.abs(logits - single).max()),
            "max_diff_hf": float(np.abs(logits - golden["logits"]).max()),
            "argmax_equal": bool((logits.argmax(-1) == golden["logits"].argmax(-1)).all()),
        }
    return out


_COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(?:-start)?\("
)


def scenario_hlo(name: str, mesh: str) -> dict:
    """Collectives in the compiled decode step (token bucket 8), and parameter bytes per device."""
    model = load_model(FIXTURES / "hf" / name, dtype="float32", with_tokenizer=False)
    engine = Engine(model, EngineConfig(**ENGINE, mesh=mesh), warm_up=False)
    runner = engine.worker
    text = runner.step.lower(runner.step.padding_inputs(8, False)).compile().as_text()
    collectives = [(kind, shape.split("{")[0]) for shape, kind in _COLLECTIVE.findall(text)]
    specs = jax.tree.leaves(
        param_specs(runner.state.params, model.family.param_axes, runner.state.mesh),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    leaves = jax.tree.leaves(runner.state.params)
    weight_shapes = sorted(
        {str(list(x.shape)) for x in leaves} | {str(list(x.addressable_shards[0].data.shape)) for x in leaves}
    )
    per_device = per_device_bytes(runner.state.params)
    return {
        "collectives": collectives,
        "weight_shapes": weight_shapes,
        "num_layers": model.config.num_layers,
        "hidden": model.config.hidden_size,
        "vocab": model.config.vocab_size,
        "total_bytes": int(sum(x.nbytes for x in leaves)),
        "replicated_bytes": int(sum(x.nbytes for x, s in zip(leaves, specs) if all(a is None for a in s))),
        "per_device_bytes": sorted(int(b) for b in per_device.values()),
        "num_devices": len(per_device),
    }


def scenario_orbax(root: str, cases: str) -> dict:
    """Fixtures converted to orbax checkpoints under `root` while split over tensor=2, then each
    case ("llama3:tensor=8;...") restored onto its mesh: every parameter, its sharding and its
    shards against the loader's placement of the safetensors (errors reported, not raised)."""
    from jaxinfer.convert import convert

    out = {}
    for case in cases.split(";"):
        name, spec = case.split(":")
        ckpt = Path(root) / name
        if not ckpt.exists():
            convert(FIXTURES / "hf" / name, ckpt, dtype="float32", mesh="tensor=2", progress=False)
        try:
            mesh = make_mesh(spec)
            place_for = lambda cfg, fam: make_placer(  # noqa: E731
                mesh, fam.param_axes, head_layout(mesh, cfg.num_heads, cfg.num_kv_heads)
            )
            got = load_model(ckpt, "float32", with_tokenizer=False, place_for=place_for).params
        except ValueError as e:
            out[case] = {"error": str(e)}
            continue
        want = load_model(FIXTURES / "hf" / name, "float32", with_tokenizer=False, place_for=place_for).params
        pairs = list(zip(jax.tree.leaves(want), jax.tree.leaves(got)))
        out[case] = {
            "leaves": len(pairs),
            "equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
            "same_sharding": all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in pairs),
        }
    return out


def scenario_multihost(process_id: str, port: str, mesh: str, model: str = "", offload_gb: str = "0") -> dict:
    """One of two processes on loopback running the LLM API on `mesh` over both (the llama3
    fixture, or `model`: e.g. its orbax checkpoint, which each process restores its shards of);
    `offload_gb`: the KV host tier, each process keeping its own shards of the pages."""
    from jaxinfer.llm import LLM

    llm = LLM(
        model or str(FIXTURES / "hf" / "llama3"),
        "float32",
        mesh=mesh,
        kv_offload_gb=float(offload_gb),
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
        **{k: v for k, v in ENGINE.items() if k not in ("max_num_batched_tokens", "num_pages")},
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        num_pages=12 if float(offload_gb) else ENGINE["num_pages"],  # evictions go to the host tier
        enable_prompt_logprobs=True,
    )
    chosen = slice(8, 12) if float(offload_gb) else slice(0, 8)  # long ones, overflowing 12 pages
    prompts, outputs = GENERATE["prompts"][chosen], GENERATE["outputs"][chosen]
    params = SamplingParams(temperature=0, max_tokens=GENERATE["max_new_tokens"], ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts[:2], params, use_tqdm=False)  # a second call: followers rejoin
    # Steps that score prompt rows: their variant is named in each step's header to the followers.
    golden = np.load(FIXTURES / "hf" / "llama3" / "golden.npz")["input_ids"].tolist()
    scored = llm.generate([golden], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    return {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "outputs": [o.outputs[0].token_ids for o in first + second],
        "expected": outputs + outputs[:2],
        "prompt_logprobs": [lp.logprob for o in scored for lp in o.prompt_logprobs[1:]],
        "host_hits": llm.engine.stats().get("prefix_cache_host_hits", 0),
        "pools_empty": all(r.kv_cache.num_free_pages == r.kv_cache.num_usable_pages for r in llm.engine.replicas),
        "in_flight": llm.engine.worker.pipeline_stages,  # batches in flight (pipeline stages)
    }


def scenario_context(lengths: str) -> dict:
    from sharding.context_parallel import context_parallel_attention, dense_causal_attention

    mesh = make_mesh("sequence=4")
    out = {}
    for length in map(int, lengths.split(",")):
        ks = jax.random.split(jax.random.key(length), 3)
        q = jax.random.normal(ks[0], (length, 6, 16))
        k, v = (jax.random.normal(key, (length, 2, 16)) for key in ks[1:])
        want = dense_causal_attention(q, k, v)
        out[length] = {
            m: float(jnp.abs(context_parallel_attention(q, k, v, mesh, m) - want).max()) for m in ("allgather", "ring")
        }
    return out


def scenario_experts(meshes: str, quant: str = "") -> dict:
    """moe_mlp's dense, ragged and capacity forms on each mesh ("expert=4,tensor=2;expert=8") against one
    device, with the stacked expert weights placed by the rule table; and each device's share.
    quant "int8" / "int4:8" (method:group): the experts quantized, each of their arrays placed
    by the weight's rule (against one device on the same quantized weights)."""
    from jaxinfer.models import experts
    from jaxinfer.models.moe.model import PARAM_AXES
    from jaxinfer.quant import QuantConfig, quantize_field
    from sharding import logical_to_spec

    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (38, 48))  # even: split over sequence=2
    router = jax.random.normal(ks[1], (48, 8))
    w_gate_up = 0.1 * jax.random.normal(ks[2], (8, 48, 2, 32))
    w_down = 0.1 * jax.random.normal(ks[3], (8, 32, 48))
    if quant:
        method, _, group = quant.partition(":")
        config = QuantConfig(method, int(group) if group else None)
        w_gate_up, w_down = (
            quantize_field(np.asarray(w), name, (1,), config, np.float32)
            for w, name in ((w_gate_up, "experts_gate_up"), (w_down, "experts_down"))
        )
    run = lambda impl: jax.jit(lambda *a: experts.moe_mlp(*a, top_k=3, renormalize=False, impl=impl))  # noqa: E731
    want = np.asarray(run("dense")(x, router, w_gate_up, w_down))
    out = {}
    for spec in meshes.split(";"):
        mesh = make_mesh(spec)
        place = lambda w, name: jax.tree.map(
            lambda a: jax.device_put(
                a,
                NamedSharding(  # noqa: E731
                    mesh, logical_to_spec(PARAM_AXES[name], a.shape, mesh)
                ),
            ),
            w,
        )
        w1, w2 = place(w_gate_up, "experts_gate_up"), place(w_down, "experts_down")
        with jax.set_mesh(mesh):
            got = {impl: np.asarray(run(impl)(x, router, w1, w2)) for impl in ("dense", "ragged", "capacity")}
        out[spec] = {
            "max_diff": {k: float(np.abs(v - want).max()) for k, v in got.items()},
            "gate_up_shard": list(jax.tree.leaves(w1)[0].addressable_shards[0].data.shape),
            "down_shard": list(jax.tree.leaves(w2)[0].addressable_shards[0].data.shape),
        }
    return out


def scenario_lora(*meshes: str) -> dict:
    """Requests under three adapters and none, mixed in one batch on each mesh, against each
    request run alone on one device (tests/support/lora_runs.py's model, heads split 3 ways)."""
    import tempfile

    from lora_runs import greedy_runs, write_triple_adapters, write_triple_checkpoint

    root = Path(tempfile.mkdtemp())
    model_dir = write_triple_checkpoint(root / "model")
    adapters = write_triple_adapters(root / "adapters", model_dir)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 512, n).tolist() for n in (3, 19, 41)]
    requests = [(p, name, path) for p in prompts for name, path in [*adapters.items(), (None, None)]]
    options = dict(ENGINE, num_pages=64, enable_lora=True, max_loras=2, max_lora_rank=8, lora_target_modules=["all"])
    single = Engine(load_model(model_dir, dtype="float32", with_tokenizer=False), EngineConfig(**options))
    alone = [greedy_runs(single, [r], 8)[0] for r in requests]
    out = {"distinct": len({tuple(a) for a in alone}), "num_requests": len(requests)}
    for mesh in meshes:
        model = load_model(model_dir, dtype="float32", with_tokenizer=False)
        engine = Engine(model, EngineConfig(**options, mesh=mesh))
        compiled = engine.worker.num_compiled()
        mixed = greedy_runs(engine, requests, 8)
        out[mesh] = {
            "mismatched": [i for i, (a, m) in enumerate(zip(alone, mixed)) if a != m],
            "recompiled": engine.worker.num_compiled() - compiled,
            "loads": engine.lora.num_loads,
            "b_shard": list(engine.worker.state.params.layers[0].w_qkv.b.addressable_shards[0].data.shape),
            "head_b_shard": list(engine.worker.state.params.embed.head_b.addressable_shards[0].data.shape),
            "embed_a_shard": list(engine.worker.state.params.embed.embed_a.addressable_shards[0].data.shape),
        }
    return out


def _placement(loaded, staged, plan) -> dict:
    """Whether every device's shard of every stacked slot leaf is its own stage's layer (the
    loaded model's array at that index) or, in a padding slot, zeros; and each device's bytes
    of layer weights."""
    wrong, per_device = [], collections.Counter()
    for j, slot in enumerate(staged.layers):
        for (path, leaf), ref_leaves in zip(
            jax.tree_util.tree_leaves_with_path(slot),
            zip(*(jax.tree.leaves(layer) for layer in loaded.layers)),
        ):
            rows = leaf.shape[0] // plan.num_stages
            for shard in leaf.addressable_shards:
                stage = shard.index[0].start // rows if shard.index[0].start is not None else 0
                local = (
                    slice((shard.index[0].start or 0) - stage * rows, (shard.index[0].stop or rows) - stage * rows),
                )
                layer = plan.layer(stage, j)
                want = (
                    np.zeros(shard.data.shape)
                    if layer is None
                    else np.asarray(ref_leaves[layer])[local + shard.index[1:]]
                )
                per_device[shard.device.id] += shard.data.nbytes
                if not np.array_equal(np.asarray(shard.data), want):
                    wrong.append(f"slot {j}{jax.tree_util.keystr(path)} on {shard.device} (stage {stage})")
    return {"wrong": wrong[:5], "layer_bytes_per_device": sorted(set(per_device.values()))}


def scenario_stages(name: str, *meshes: str) -> dict:
    """Pipeline stages: greedy outputs of the `name` fixture ("smollm2": the embedded GGUF) on each
    mesh against the single-device engine's, every layer's arrays on its own stage's devices only,
    and the caches' page rows split by stage."""
    from sharding.stages import plan_stages

    def loaded():
        where = None if name == "smollm2" else FIXTURES / "hf" / name
        return load_model(where, dtype="float32", with_tokenizer=False)

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 500, n).tolist() for n in (5, 21, 40)]
    single = Engine(loaded(), EngineConfig(**ENGINE))
    want, _ = run_engine(single, prompts, 12)
    out = {"num_layers": single.worker.state.config.num_layers}
    for mesh in meshes:
        engine = Engine(loaded(), EngineConfig(**ENGINE, mesh=mesh))
        state = engine.worker.state
        compiled = engine.worker.num_compiled()
        got, _ = run_engine(engine, prompts, 12)
        plan = plan_stages(state.config.num_layers, state.mesh.shape["stage"])
        cache = state.kv_caches[0]
        out[mesh] = {
            "mismatched": [i for i in range(len(prompts)) if got[str(i)] != want[str(i)]],
            "in_flight": engine.worker.pipeline_stages,
            "recompiled": engine.worker.num_compiled() - compiled,
            "pools_empty": all(r.kv_cache.num_free_pages == r.kv_cache.num_usable_pages for r in engine.replicas),
            "counts": list(plan.counts),
            "num_caches": len(state.kv_caches),
            "cache_rows": [cache.shape[-3], cache.addressable_shards[0].data.shape[-3]],
            **_placement(loaded().params, state.params, plan),
            "single_layer_bytes": sum(x.nbytes for x in jax.tree.leaves(single.worker.state.params.layers[0])),
        }
    return out


def scenario_kvsplit(mesh: str, context: str) -> dict:
    """One long prompt (`context` tokens) through the llama3 fixture on one device with the whole
    pool, and on `mesh` whose `sequence` shards each hold their rows of every page: greedy tokens,
    each device's cache bytes and the tokens they hold."""
    options = dict(
        ENGINE, num_pages=20, max_model_len=256, max_num_batched_tokens=64, token_buckets=(8, 64), max_num_seqs=4
    )
    prompt = np.random.default_rng(5).integers(1, 500, int(context)).tolist()
    out = {}
    for name in ("none", mesh):
        model = load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)
        engine = Engine(model, EngineConfig(**options, mesh=None if name == "none" else name))
        compiled = engine.worker.num_compiled()
        results, _ = run_engine(engine, [prompt], 8)
        cache = engine.worker.state.kv_caches[0]
        shard = cache.addressable_shards[0].data
        out[name] = {
            "tokens": results["0"],
            "recompiled": engine.worker.num_compiled() - compiled,
            "pools_empty": all(r.kv_cache.num_free_pages == r.kv_cache.num_usable_pages for r in engine.replicas),
            "num_pages": int(cache.shape[0]),
            "page_size": int(cache.shape[1]),
            "rows_per_device": int(shard.shape[1]),
            "cache_bytes_per_device": sum(c.addressable_shards[0].data.nbytes for c in engine.worker.state.kv_caches),
        }
    return out


def scenario_stage_features() -> dict:
    """Pipeline stages with int8 weights (stage=2,tensor=2), ngram and draft-model speculation
    (stage=2) and an int8 KV cache (stage=2,sequence=2): greedy tokens against the same options
    on one device."""
    from jaxinfer.llm import LLM

    prompts = [np.random.default_rng(i).integers(1, 500, n).tolist() for i, n in enumerate((7, 30, 50))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    options = dict(ENGINE, num_pages=40, executable_cache_dir="none")
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    draft = {"method": "draft_model", "model": str(FIXTURES / "hf" / "llama3"), "num_speculative_tokens": 2}
    out = {}
    for feature, extra, mesh in (
        ("int8", dict(quantization="int8"), "stage=2,tensor=2"),
        ("ngram", dict(speculative_config=ngram), "stage=2"),
        ("draft", dict(speculative_config=draft), "stage=2"),  # the draft on one device, the target staged
        ("int8-kv", dict(kv_cache_dtype="int8"), "stage=2,sequence=2"),  # scales per stage, rows split
    ):
        runs = []
        for m in (None, mesh):
            llm = LLM(str(FIXTURES / "hf" / "llama3"), "float32", **options, **extra, mesh=m)
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            del llm
        out[feature] = {"equal": runs[0] == runs[1], "tokens": sum(map(len, runs[1]))}
    return out


def scenario_pipeline(mesh_spec: str, batches: str = "6") -> dict:
    """Batches through pipeline ticks (S in flight) against each batch through `run_stages`
    alone: the same outputs, in order, and the same caches. A toy residual layer per slot (its
    weight stacked over stages) writes row `extras["row"]` of its stage's cache columns; ticks
    with no batch on a stage (filling, draining) write the null row."""
    mesh = make_mesh(mesh_spec)
    n, m, t, e, num_slots = dict(mesh.shape)["stage"], int(batches), 4, 8, 2
    keys = jax.random.split(jax.random.key(0), num_slots + 1)
    slots = tuple({"w": jax.random.normal(k, (n * e, e)) / e**0.5} for k in keys[:num_slots])
    xs = jax.random.normal(keys[-1], (m, t, e))
    null = m  # the last cache row

    def slot(j, x, layer, cache, extras):
        y = x + jnp.tanh(x @ layer["w"])
        return y, cache.at[extras["row"]].set(y[0] + j)

    def fresh():
        return tuple(jnp.zeros((m + 1, n * e)) for _ in range(num_slots))

    with jax.set_mesh(mesh):
        whole = jax.jit(lambda x, c, row: run_stages(slot, x, slots, c, {"row": row}))
        caches, alone = fresh(), []
        for b in range(m):
            y, caches = whole(xs[b], caches, jnp.int32(b))
            alone.append(y)
        tick = jax.jit(lambda f, x, c, rows: pipeline_tick(slot, f, x, slots, c, {"row": rows}))
        piped, inflight, ticked = [], jnp.zeros((n, t, e)), fresh()
        for k in range(m + n - 1):
            rows = jnp.array([k - s if 0 <= k - s < m else null for s in range(n)], jnp.int32)
            entering = xs[k] if k < m else jnp.zeros((t, e))
            done, inflight, ticked = tick(inflight, entering, ticked, rows)
            if k >= n - 1:
                piped.append(done)
        text = tick.lower(inflight, xs[0], ticked, rows).as_text()
        one = whole.lower(xs[0], caches, jnp.int32(0)).as_text()
    return {
        "stages": n,
        "outputs": float(max(jnp.abs(a - b).max() for a, b in zip(alone, piped, strict=True))),
        "caches": float(max(jnp.abs(a[:null] - b[:null]).max() for a, b in zip(caches, ticked, strict=True))),
        "written": bool(all(jnp.all(a[:null] != 0) for a in ticked)),
        "conditionals": text.count("stablehlo.case") + text.count("stablehlo.if"),
        "conditionals_one_at_a_time": one.count("stablehlo.case") + one.count("stablehlo.if"),
    }


def scenario_pipelined(mesh: str) -> dict:
    """A batch in flight on every pipeline stage (worker/pipelined.py) against one device, llama3
    fixture, with the prefix cache's host tier: the 16 HF-generate prompts in a pool that forces
    preemption, a request of two samples sharing its prompt's pages (copy-on-write), one with
    prompt logprobs, one with a repetition penalty (its step lands before the next is planned),
    one added once another's prompt is computed (prefix hits), and one aborted while its next
    batch is in flight (its tokens so far must be a prefix of the whole run's); then the stages
    taking one batch at a time."""
    prompts, _, max_tokens = prompts_and_expected("llama3")
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    extra = {
        "fork": (prompts[0][:20] + [7] * 10, SamplingParams(temperature=0, n=2, max_tokens=6, ignore_eos=True)),
        "plp": (prompts[1][:40], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2)),
        "abort": (prompts[2], greedy),
        "penalty": (prompts[5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)),
    }

    def run(engine: Engine, abort_after: int | None) -> dict:
        compiled = engine.worker.num_compiled()
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, greedy, request_id=str(i))
        for request_id, (prompt, params) in extra.items():
            engine.add_request(prompt, params, request_id=request_id)
        tokens: dict[str, list[int]] = collections.defaultdict(list)
        prompt_logprobs, added = None, set()
        while engine.has_unfinished():
            for delta in engine.step():
                for o in delta.outputs:
                    tokens[f"{delta.request_id}/{o.index}"] += o.token_ids
                if delta.prompt_logprobs is not None:
                    prompt_logprobs = [None if lp is None else (lp.token_id, lp.rank) for lp in delta.prompt_logprobs]
            if tokens["12/0"] and "late" not in added:  # prompt 12 (63 tokens) computed: prefix hits
                late = SamplingParams(temperature=0, max_tokens=4)
                engine.add_request(prompts[12] + [9] * 5, late, request_id="late")
                added.add("late")
            if abort_after is not None and len(tokens["abort/0"]) >= abort_after:  # its next batch is in flight
                engine.abort("abort")
                abort_after = None
        stats = engine.stats()
        return {
            "tokens": tokens,
            "prompt_logprobs": prompt_logprobs,
            "recompiled": engine.worker.num_compiled() - compiled,
            "pools_empty": stats["kv_pages_free"] == stats["kv_pages_total"],
            "preemptions": engine.num_preemptions,
            "prefix_hit_rate": stats["prefix_cache_hit_rate"],
            "host_hits": stats.get("prefix_cache_host_hits", 0),
            "in_flight": engine.worker.pipeline_stages,
            "occupancy": stats.get("pipeline_occupancy"),
        }

    model = lambda: load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)  # noqa: E731
    options = dict(ENGINE, enable_prompt_logprobs=True, penalties=True, kv_offload_gb=0.01)
    single = run(Engine(model(), EngineConfig(**options)), None)
    piped = run(Engine(model(), EngineConfig(**options, mesh=mesh)), 3)
    one_at_a_time = run(Engine(model(), EngineConfig(**options, mesh=mesh, pipeline_batches=False)), None)
    whole, cut = single["tokens"].pop("abort/0"), piped["tokens"].pop("abort/0")
    one_at_a_time["tokens"].pop("abort/0")
    return {
        "single": single,
        "piped": piped,
        "one_at_a_time": one_at_a_time,
        "abort": [len(whole), len(cut), whole[: len(cut)] == cut],
    }


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    result = globals()[f"scenario_{name}"](*args)
    print(json.dumps(result), flush=True)
