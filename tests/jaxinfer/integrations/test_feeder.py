"""EngineFeeder (what every Ray replica runs): requests from many threads share the engine's steps
and come back as LLM.generate gives them; a request the engine refuses fails alone; closing aborts
and fails what is still in flight."""

import concurrent.futures

import pytest
from testpaths import FIXTURES

from jaxinfer.integrations.feeder import EngineFeeder
from jaxinfer.llm import LLM
from jaxinfer.sampling.params import SamplingParams

ENGINE = dict(
    dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), num_pages=32
)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * k) % 250 + 1 for k in range(3 + i % 5)] for i in range(10)]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(FIXTURES / "hf" / "llama3"), penalties=False, **ENGINE)


def test_requests_from_many_threads_share_the_steps(llm):
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    feeder = EngineFeeder(llm.engine)
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = list(pool.map(lambda p: feeder.submit(p, GREEDY), PROMPTS))
        outs = [f.result(timeout=60) for f in futures]
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    finally:
        feeder.close()


def test_a_refused_request_fails_alone_and_close_fails_the_rest(llm):
    feeder = EngineFeeder(llm.engine)
    too_long = feeder.submit(list(range(1, 80)), GREEDY)  # past max_model_len
    fine = feeder.submit(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="64"):
        too_long.result(timeout=60)
    assert fine.result(timeout=60).outputs[0].token_ids == llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    endless = feeder.submit(PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    feeder.close()
    with pytest.raises(RuntimeError, match="the engine feeder was closed"):
        endless.result(timeout=60)
    assert feeder.num_in_flight == 0 and not llm.engine.has_unfinished()  # aborted in the engine too
