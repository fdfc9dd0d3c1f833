"""A checkpoint stored quantized behind both servers (one BackgroundServer, gRPC and HTTP, over
loopback): the W8A8 compressed-tensors fixture (int8 weights, int8 activations per token) served
as stored, each transport's greedy tokens those of HF transformers on the same checkpoint, and
its /v1/models card; a float-only option against it refused at start-up by name."""

import numpy as np
import openai
import pytest
from serving_support import assert_pages_free, client_of
from testpaths import FIXTURES

from jaxinfer.llm import LLM
from jaxinfer.quant.out_first_int8 import OutFirstInt8
from serving.server import BackgroundServer, ServerOptions

W8A8 = FIXTURES / "quant" / "w8a8"
GOLDEN = np.load(W8A8 / "golden.npz")
TINY = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), num_pages=40)


def test_both_transports_serve_the_stored_checkpoint():
    llm = LLM(str(W8A8), "float32", **TINY)
    # the CPU step holds per-channel int8 out-first (quant/out_first_int8.py), its activations kept
    w = llm.engine.worker.state.params.layers[0].w_down
    assert isinstance(w, OutFirstInt8) and w.method == "int8" and w.activations == ("int8", "token")
    prompt, want = GOLDEN["prompt"].tolist(), GOLDEN["greedy"][:12].tolist()
    with BackgroundServer(llm.engine, ServerOptions(port=0, http_port=0, grace_period_s=2.0)) as server:
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="-", max_retries=0)
        done = http.completions.create(
            model="w8a8", prompt=prompt, max_tokens=12, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
        )
        assert [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens] == want
        assert [m.id for m in http.models.list().data] == ["w8a8"]
        with client_of(server) as client:
            got = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=60)
            assert got.token_ids == want
    assert_pages_free(llm.engine)


def test_requantizing_a_stored_checkpoint_is_refused_by_name():
    with pytest.raises(ValueError, match=r"stored quantized \(compressed-tensors: W8A8 per-channel.*'int4'"):
        LLM(str(W8A8), "float32", quantization="int4", **TINY)
