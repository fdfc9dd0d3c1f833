"""LoRA through the engine on one device: a mixed batch (three adapters and the base model, prompts
of 5 to 63 tokens, chunked prefill, decode windows, two device slots for three adapters) gives
every request the tokens HF transformers + PEFT give it alone; the same prompts under different
adapters share no prefix page; nothing compiles after warm-up as adapters come and go; n-gram
speculation, the Python API and the batch job take adapters too."""

import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_runs import greedy_runs
from testpaths import FIXTURES

from jaxinfer.cli.batch import run_batch
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.lora import LoRARequest
from jaxinfer.lora.manager import lora_entry
from jaxinfer.quant import QuantConfig, einsum, quantize_field
from jaxinfer.quant.lora import LoraWeight
from jaxinfer.quant.lora_bind import bind
from jaxinfer.sampling import SamplingParams
from jaxinfer.worker.step_variants import without_adapters
from jaxinfer.worker.warm_up import step_variants

LORA = FIXTURES / "lora"
MIXED = json.loads((LORA / "mixed.json").read_text())
SMALL = dict(
    max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 32), num_pages=64, penalties=False
)


def _requests():
    out, want = [], []
    for name, path in MIXED["adapters"].items():
        for prompt, tokens in zip(MIXED["prompts"], MIXED["outputs"][name]):
            out.append(
                (prompt, None if path is None else name, None if path is None else str(FIXTURES.parent.parent / path))
            )
            want.append(tokens)
    return out, want


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, EngineConfig(**SMALL, enable_lora=True, max_loras=2, max_lora_rank=8))


def test_mixed_batch_matches_peft_per_request(engine):
    requests, want = _requests()
    compiled = engine.worker.num_compiled()
    got = greedy_runs(engine, requests, MIXED["max_new_tokens"])
    assert got == want
    assert engine.worker.num_compiled() == compiled  # adapters loaded into slots: no compile
    assert engine.lora.num_loads >= 3  # three adapters through two slots
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages
    stats = engine.stats()
    assert stats["lora_adapters"] == 3 and stats["lora_running"] == dict.fromkeys(
        MIXED["adapters"].keys() - {"none"}, 0
    )


def test_prefix_pages_are_kept_apart_per_adapter(engine):
    """The same long prompt under two adapters, one after the other: the second request must not
    take the first one's cached pages (its K/V were computed under another adapter)."""
    requests, want = _requests()
    hits = engine.kv_cache.prefix_cache_hits
    for k in (3, 7):  # the 63-token prompt under llama3_all_r8, then under llama3_all_r8_rslora
        assert greedy_runs(engine, [requests[k]], MIXED["max_new_tokens"]) == [want[k]]
    again = greedy_runs(engine, [requests[3]], MIXED["max_new_tokens"])  # the first adapter again
    assert again == [want[3]] and engine.kv_cache.prefix_cache_hits > hits


def test_unload_and_errors(engine, tmp_path):
    requests, _ = _requests()
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank=4|not a directory"):
        engine.add_request(
            [1, 2, 3], SamplingParams(max_tokens=1), lora_request=LoRARequest("x", 9, str(tmp_path / "none"))
        )
    engine.add_request(
        requests[0][0], SamplingParams(max_tokens=2), request_id="busy", lora_request=LoRARequest("llama3_qv_r4", 1)
    )
    with pytest.raises(ValueError, match="in use by 1 unfinished requests"):
        engine.lora.unload("llama3_qv_r4")
    while engine.has_unfinished():
        engine.step()
    engine.lora.unload("llama3_qv_r4")
    with pytest.raises(ValueError, match="not loaded and no path"):
        engine.add_request([1, 2], SamplingParams(max_tokens=1), lora_request=LoRARequest("llama3_qv_r4", 1))
    with pytest.raises(ValueError, match="'x' asked for, but LoRA is off"):
        lora_entry(None, "r", LoRARequest("x", 1, "/p"))


def test_ngram_speculation_and_the_python_api(model):
    requests, want = _requests()
    llm = LLM(
        model,
        **SMALL,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        lora_modules=[f"{n}={p}" for _, n, p in requests if n is not None][::4],
    )
    prompts = [p for p, _, _ in requests]
    loras = [None if n is None else LoRARequest(n, 1) for _, n, _ in requests]
    params = SamplingParams(temperature=0, max_tokens=MIXED["max_new_tokens"], ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    streamed = [t for d in llm.stream(prompts[5], params, lora_request=loras[5]) for t in d.outputs[0].token_ids]
    assert streamed == want[5]
    lines = [json.dumps({"id": str(i), "prompt_token_ids": p, "lora": n}) for i, (p, n, _) in enumerate(requests[:8])]
    lines.append(json.dumps({"id": "bad", "prompt_token_ids": [1], "lora": "nope"}))
    out = io.StringIO()
    run_batch(llm, lines, out, params)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["outputs"][0]["token_ids"] for r in records[:8]] == want[:8]
    assert "'nope' is not loaded" in records[8]["error"]


def test_quantized_base_weight_with_float_adapters():
    """einsum of a LoraWeight over an int8 weight = the int8 product + the slot's adapter share."""
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    w = jax.random.normal(key[0], (64, 2, 96), jnp.float32)
    host = quantize_field(np.asarray(w), "w_gate_up", (0,), QuantConfig.parse("int8"), np.float32)
    q = jax.tree.map(jnp.asarray, host)
    a = jax.random.normal(key[1], (64, 3, 8), jnp.float32)  # [in, slots, rank]
    b = jax.random.normal(key[2], (3, 8, 2, 96), jnp.float32)
    x = jax.random.normal(key[3], (5, 64), jnp.float32)
    slots = jnp.array([0, 1, 2, 3, 1], jnp.int32)
    bound = bind(LoraWeight(q, a, b, "w_gate_up"), slots)
    got = einsum("te,ecf->tcf", x, bound)
    base = einsum("te,ecf->tcf", x, q)
    for t, s in enumerate(slots.tolist()):
        delta = 0 if s == 0 else jnp.einsum("e,er,rcf->cf", x[t], a[:, s - 1], b[s - 1])
        np.testing.assert_allclose(got[t], base[t] + delta, rtol=1e-4, atol=1e-4)


def test_steps_without_adapters_run_the_base_model_alone(engine, model):
    """Each step variant is compiled with the adapters' shares and without them; a step none of
    whose tokens has an adapter takes the second. Without the specialization one variant serves
    both, and gives the same tokens."""
    step = engine.worker.step
    inputs = step.padding_inputs(8, False)
    assert without_adapters(inputs, engine.config.lora).lora_slots is None
    with_slot = dataclasses.replace(inputs, lora_slots=np.eye(1, 8, 3, dtype=np.int32)[0] * 2)
    assert without_adapters(with_slot, engine.config.lora) is with_slot
    base_only = step.lower(inputs).as_text()
    assert "lora" not in base_only and base_only.count("dot_general") < step.lower(with_slot).as_text().count(
        "dot_general"
    )
    plain = Engine(model, EngineConfig(**SMALL, enable_lora=True, max_loras=2, max_lora_rank=8, specialize_lora=False))
    assert len(step_variants(engine.worker.step)) == 2 * len(step_variants(plain.worker.step))
    assert without_adapters(inputs, plain.config.lora) is inputs
    requests, want = _requests()
    compiled = plain.worker.num_compiled()
    assert greedy_runs(plain, requests, MIXED["max_new_tokens"]) == want
    assert plain.worker.num_compiled() == compiled


def test_bfloat16_slots_over_a_float32_model(model):
    """lora_dtype=bfloat16: the slots hold bfloat16 stacks, their products summed in float32 (the
    share within bfloat16's rounding of the float32 one), and the mixed batch keeps PEFT's greedy
    tokens but for near ties; a dtype outside the choices is refused by name."""
    key = jax.random.split(jax.random.PRNGKey(1), 3)
    w = jax.random.normal(key[0], (64, 2, 96), jnp.float32)
    a = jax.random.normal(key[1], (64, 3, 8), jnp.float32)
    b = jax.random.normal(key[2], (3, 8, 2, 96), jnp.float32)
    x = jax.random.normal(key[0], (5, 64), jnp.float32)
    slots = jnp.array([0, 1, 2, 3, 1], jnp.int32)
    want = einsum("te,ecf->tcf", x, bind(LoraWeight(w, a, b, "w_gate_up"), slots))
    narrow = LoraWeight(w, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), "w_gate_up")
    got = einsum("te,ecf->tcf", x, bind(narrow, slots))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.3)
    assert not np.allclose(got, einsum("te,ecf->tcf", x, w), atol=1.0)  # the share is there
    engine = Engine(model, EngineConfig(**SMALL, enable_lora=True, max_loras=2, max_lora_rank=8, lora_dtype="bfloat16"))
    stacks = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(engine.worker.state.params) if "lora_" in str(path)
    ]
    assert stacks and {s.dtype for s in stacks} == {jnp.dtype(jnp.bfloat16)}
    requests, want_tokens = _requests()
    got_tokens = greedy_runs(engine, requests, MIXED["max_new_tokens"])
    same = sum(g == w for got_row, want_row in zip(got_tokens, want_tokens) for g, w in zip(got_row, want_row))
    assert same >= 0.9 * sum(len(w) for w in want_tokens)
    with pytest.raises(ValueError, match="lora_dtype.*int8"):
        EngineConfig(enable_lora=True, lora_dtype="int8")


@pytest.mark.parametrize(
    "spec, a_shape, b_shape, parts, part_axis",
    [
        ("te,ekjd->tkjd", (16, 4, 24), (4, 8, 2, 5, 3), 3, 1),  # q|k|v: 2 KV heads of 3 queries
        ("thd,hde->te", (3, 4, 4, 8), (4, 8, 16), 1, 0),  # the output projection's [H, D] inputs
        ("te,ecf->tcf", (16, 4, 16), (4, 8, 2, 12), 2, 0),  # gate|up
    ],
)
def test_fewer_tokens_than_slots_read_their_own_slots(spec, a_shape, b_shape, parts, part_axis):
    """With fewer tokens than slots each token's slot is gathered (lora_delta's small-batch form):
    the same share as every slot masked, which a batch of as many tokens as slots computes."""
    from jaxinfer.quant.lora import lora_delta, one_hot_slots

    key = jax.random.split(jax.random.PRNGKey(2), 3)
    a = jax.random.normal(key[0], a_shape, jnp.float32)
    b = jax.random.normal(key[1], b_shape, jnp.float32)
    x = jax.random.normal(key[2], (4, *a_shape[:-2]), jnp.float32)
    w = LoraWeight(None, a, b, "field", parts=parts, part_axis=part_axis)
    slots = jnp.array([3, 0, 4, 1], jnp.int32)
    every = lora_delta(spec, x, w.bound(one_hot_slots(slots, 4, jnp.float32)))  # 4 tokens, 4 slots: masked
    few = lora_delta(spec, x[:2], w.bound(one_hot_slots(slots[:2], 4, jnp.float32)))  # 2 tokens: gathered
    np.testing.assert_allclose(few, every[:2], rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(few[0]).max()) > 0 and float(jnp.abs(few[1]).max()) == 0  # slot 0: no share
