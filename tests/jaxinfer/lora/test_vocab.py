"""Adapters of the embedding and the LM head through the engine: in one batch with an adapter of
the decoder layers only and with the base model, every request gets the tokens HF transformers +
PEFT give it alone, and the prompt's logprobs under the adapter are PEFT's (the LM head scores
every prompt row with the request's adapter), through the whole step and through the step split
in two (structured output's: the LM head's rows get their slots in the sampling half); their
slots exist only where the engine is told to hold them (lora_target_modules, or an adapter named
at start-up that adapts them)."""

import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.lora import LoRARequest
from jaxinfer.quant.lora import LoraWeight
from jaxinfer.quant.lora_vocab import VocabLora
from jaxinfer.sampling import SamplingParams

LORA = FIXTURES / "lora"
SMALL = dict(
    max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), num_pages=64, penalties=False
)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def engine():
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)
    modules = [f"vocab={LORA / 'llama3_vocab_r8'}", f"qv={LORA / 'llama3_qv_r4'}"]
    config = EngineConfig(
        **SMALL,
        lora_modules=modules,
        max_loras=2,
        max_lora_rank=8,
        enable_prompt_logprobs=True,
        structured_output_overlap=True,  # the split step compiled for decode-sized buckets
        num_decode_steps=1,
    )
    return Engine(model, config)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_embedding_and_lm_head_adapters_in_a_mixed_batch(engine, split, monkeypatch):
    assert isinstance(engine.worker.state.params.embed, VocabLora)  # inferred from the start-up adapters
    step, split_calls = engine.worker.step, []
    if split:  # decode steps through the split pair, as a step with grammar rows runs
        whole = step.dispatch

        def dispatch(inputs, num_steps=1, greedy=True):
            if inputs.token_ids.shape[0] not in step.split_buckets:
                return whole(inputs, num_steps, greedy)
            split_calls.append(1)
            return step.dispatch_sample(step.dispatch_forward(inputs), inputs)

        monkeypatch.setattr(step, "dispatch", dispatch)
    vocab, qv = (np.load(LORA / n / "golden.npz") for n in ("llama3_vocab_r8", "llama3_qv_r4"))
    runs = [("vocab", vocab, "greedy"), (None, vocab, "base_greedy"), ("qv", qv, "greedy")]
    compiled = engine.worker.num_compiled()
    for i, (name, golden, _) in enumerate(runs):
        params = SamplingParams(
            temperature=0, max_tokens=len(golden["greedy"]), ignore_eos=True, prompt_logprobs=0 if i == 0 else None
        )
        lora = LoRARequest(name, i + 1) if name else None
        engine.add_request(golden["prompt"].tolist(), params, request_id=str(i), lora_request=lora)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(runs))}
    prompt_logprobs = None
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.outputs[0].token_ids
            if delta.request_id == "0" and delta.prompt_logprobs is not None:
                prompt_logprobs = (prompt_logprobs or []) + delta.prompt_logprobs
    for i, (_, golden, key) in enumerate(runs):
        assert tokens[str(i)] == golden[key].tolist(), runs[i][0]
    assert engine.worker.num_compiled() == compiled
    assert len(split_calls) > 20 if split else not split_calls
    prompt = vocab["prompt"]
    want = _log_softmax(vocab["logits"].astype(np.float64))[np.arange(len(prompt) - 1), prompt[1:]]
    got = [entry.logprob for entry in prompt_logprobs[1:]]
    np.testing.assert_allclose(got, want, atol=2e-3)


def test_targets_named_hold_only_those_modules():
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)
    config = EngineConfig(**SMALL, enable_lora=True, max_loras=1, max_lora_rank=8, lora_target_modules=["lm_head"])
    engine = Engine(model, config)
    embed = engine.worker.state.params.embed
    assert isinstance(embed, VocabLora) and embed.embed_a is None and embed.head_a.shape == (1, 64, 8)
    layers = engine.worker.state.params.layers
    assert not any(isinstance(w, LoraWeight) for layer in layers for w in vars(layer).values())
    with pytest.raises(ValueError, match="adapts q_proj .*slots do not hold \\(they hold lm_head"):
        engine.add_request(
            [1, 2], SamplingParams(max_tokens=1), lora_request=LoRARequest("qv", 1, str(LORA / "llama3_qv_r4"))
        )
