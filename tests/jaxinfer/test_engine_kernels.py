"""The engine with each Pallas kernel (interpret mode) in its step, against HF and the reference.

The kernel tests check one call; these check many: every step's fused KV write is read back by
later steps (decode after chunked prefill, requests admitted after others were preempted), so a
slot written wrongly or not at all shows up as a different token.
"""

import dataclasses
import json

import jax
import pytest
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.models.llama.model import init_params
from jaxinfer.sampling import SamplingParams

GOLDEN = json.loads((FIXTURES / "hf" / "llama3" / "generate.json").read_text())


def run(engine, prompts, params) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    tokens = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "pages leaked"
    return [tokens[str(i)] for i in range(len(prompts))]


def engine_for(model, impl, **overrides):
    cfg = dict(
        num_pages=24,
        page_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=256,
        token_buckets=(8, 32),
        attn_impl=impl,
    )
    cfg.update(overrides)
    return Engine(model, EngineConfig(**cfg))


def test_gpu_kernel_engine_matches_hf():
    """llama3 fixture (head_dim 16, GQA 4): 16 prompts, chunked prefill, preemptions."""
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32")
    engine = engine_for(model, "pallas_gpu")
    greedy = SamplingParams(temperature=0, max_tokens=GOLDEN["max_new_tokens"], ignore_eos=True)
    assert run(engine, GOLDEN["prompts"], greedy) == GOLDEN["outputs"]
    assert engine.num_preemptions > 0


@pytest.mark.slow
def test_tpu_kernel_engine_matches_reference():
    """The TPU kernel needs head_dim >= 64: a random 2-layer model, the reference as the oracle."""
    fixture = load_model(FIXTURES / "hf" / "llama3", dtype="float32")
    config = dataclasses.replace(fixture.config, head_dim=64)
    model = dataclasses.replace(fixture, config=config, params=init_params(config, jax.random.key(0), scale=0.3))
    prompts = GOLDEN["prompts"][8:13]  # 31..63 tokens: five do not fit in 9 pages at once
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # One token bucket: its step and decode window are the interpreted kernel's only compiles (a
    # second bucket doubled the warm-up to ~55 s), and it still chunks the prompts.
    overrides = dict(num_pages=10, max_num_seqs=4, token_buckets=(32,))
    want = run(engine_for(model, "reference", **overrides), prompts, greedy)
    engine = engine_for(model, "pallas_tpu", **overrides)
    assert run(engine, prompts, greedy) == want
    assert engine.num_preemptions > 0
