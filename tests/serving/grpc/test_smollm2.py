"""The server on the embedded SmolLM2-135M-Instruct: text, chat, stop strings, n samples and
logprobs stream exactly what LLM.generate returns; Tokenize / Detokenize / GetModelInfo."""

import asyncio

import grpc
import pytest
from serving_support import client_of
from testpaths import SMOLLM2_SMALL

from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams
from serving.grpc.client import Accumulator, AsyncClient
from serving.server import BackgroundServer, ServerOptions

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TEXTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]
CASES = {  # name -> (prompt kind, SamplingParams fields)
    "greedy": ("text", dict(temperature=0, max_tokens=16)),
    "seeded": ("text", dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)),
    "top_k_logprobs": ("text", dict(temperature=1.0, top_k=20, seed=7, max_tokens=12, logprobs=2)),
    "n2": ("text", dict(n=2, temperature=0.9, seed=99, max_tokens=10)),
    "chat": ("chat", dict(temperature=0, max_tokens=32)),
    "chat_stop": ("chat", dict(temperature=0, max_tokens=32, stop=["is P", "capital"])),
    "chat_special": ("chat", dict(temperature=0, max_tokens=12, ignore_eos=True, skip_special_tokens=False)),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMOLLM2_SMALL, penalties=False)  # the engine of openai/test_api.py's server


def cases():
    """(name, prompt kwargs for the client, SamplingParams fields) for every request."""
    for name, (kind, fields) in CASES.items():
        if kind == "chat":
            yield name, dict(messages=QUESTION), fields
        else:
            for text in TEXTS:
                yield name, dict(prompt=text), fields


@pytest.fixture(scope="module")
def expected(llm):
    """LLM.generate's outputs, all in one batch, computed before the server takes the engine."""
    prompts = [llm.render_chat(p["messages"]) if "messages" in p else p["prompt"] for _, p, _ in cases()]
    return llm.generate(prompts, [SamplingParams(**f) for _, _, f in cases()], use_tqdm=False)


@pytest.fixture(scope="module")
def server(llm, expected):
    with BackgroundServer(llm.engine, ServerOptions(port=0)) as server:
        yield server


def test_concurrent_streams_equal_llm_generate(server, expected):
    async def stream_all():
        async with AsyncClient(server.address) as client:

            async def one(prompt, fields):
                acc, pieces = Accumulator(), {}
                async for msg in client.stream(timeout=300, **prompt, **fields):
                    acc.add(msg)
                    for d in msg.outputs:
                        pieces.setdefault(d.index, []).append(d.text)
                return acc.result(), pieces

            return await asyncio.gather(*(one(p, f) for _, p, f in cases()))

    by_name = {name: want for (name, _, _), want in zip(cases(), expected)}
    assert by_name["chat"].outputs[0].text == "The capital of France is Paris."
    assert by_name["chat_stop"].outputs[0].text == "The "
    assert "<|im_end|>" in by_name["chat_special"].outputs[0].text
    for (name, _, _), want, (result, pieces) in zip(cases(), expected, asyncio.run(stream_all())):
        assert len(result.outputs) == len(want.outputs)
        for got, ref in zip(result.outputs, want.outputs):
            assert got.text == ref.text, name
            assert got.token_ids == ref.token_ids, name
            assert got.finish_reason == ref.finish_reason and got.stop_reason == ref.stop_reason
            assert "".join(pieces[got.index]) == ref.text  # streamed text never runs past a stop
            if ref.logprobs is not None:
                assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in ref.logprobs]
                assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                    [lp.logprob for lp in ref.logprobs], abs=1e-4
                )
        assert result.usage.prompt_tokens == want.usage.prompt_tokens


def test_tokenize_detokenize_and_model_info(server, llm):
    tok = llm.tokenizer
    with client_of(server) as client:
        text = "Hello, world! <|im_end|>"
        assert client.tokenize(text) == tok.encode(text)
        assert client.tokenize(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
        assert client.tokenize(messages=QUESTION) == llm.render_chat(QUESTION)
        ids = tok.encode(text)
        assert client.detokenize(ids) == tok.decode(ids)
        assert client.detokenize(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
        with pytest.raises(grpc.RpcError) as info:
            client.detokenize([49152])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = client.model_info()
        assert info.has_tokenizer and info.has_chat_template and info.vocab_size == 49152
        assert info.tool_call_format == ""  # SmolLM2's template writes no tool calls
        assert info.model.endswith(".gguf") and info.max_model_len == 512 and not info.penalties_enabled
        assert list(info.eos_token_ids) == list(tok.eos_token_ids)


def test_penalties_refused_when_compiled_out(server):
    with client_of(server) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("Hi", repetition_penalty=1.2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "penalties are off" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.generate("")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("text")
        long_text = "word " * 2000
        with pytest.raises(grpc.RpcError) as info:
            client.generate(long_text)
        assert (
            info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "does not fit the context of 512 tokens" in info.value.details()
        )
        assert client.generate("Hi", max_tokens=2, timeout=120).usage.completion_tokens == 2
