"""Property-based fuzzing of what users send: SamplingParams, engine requests and batch lines.
Every case ends in a result or a ValueError that names the bad value; nothing crashes, and
every KV page is free afterwards."""

import io
import json
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from testpaths import FIXTURES

from jaxinfer.cli.batch import run_batch
from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams

FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

small_ints = st.integers(-3, 6)
anything = st.one_of(
    st.none(),
    st.booleans(),
    small_ints,
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, -1e-300, 0.5, 1.0, 2.0]),
    st.text(max_size=4),
    st.lists(st.one_of(st.text(max_size=3), small_ints), max_size=3),
    st.dictionaries(st.text(max_size=2), small_ints, max_size=2),
)
# Mostly plausible values, so that many requests really run; now and then anything at all.
plausible = {
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 5),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(-1, 50),
    "top_p": st.floats(0.01, 1),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**64),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=2),
    "logprobs": st.integers(0, 20),
    "ignore_eos": st.booleans(),
}
sampling_kwargs = st.fixed_dictionaries(
    {}, optional={name: (st.one_of(plausible[name], anything) if name in plausible else anything) for name in FIELDS}
)
plausible_kwargs = st.fixed_dictionaries({}, optional=plausible)
valid_prompts = st.lists(st.integers(1, 255), min_size=1, max_size=40)
prompts = st.one_of(
    st.lists(st.integers(1, 255), min_size=1, max_size=40),
    st.lists(st.one_of(st.integers(-5, 600), st.booleans(), st.text(max_size=2)), max_size=5),
    st.text(max_size=5),
    st.just([]),
    st.lists(st.integers(1, 5), min_size=300, max_size=300),
)


@pytest.fixture(scope="module")
def llm():
    return LLM(
        str(FIXTURES / "hf" / "llama3"),
        "float32",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        token_buckets=(8, 32),
        num_pages=48,
        max_n=4,
    )


def assert_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "KV pages leaked"


def build(kwargs):
    """SamplingParams, or None after checking that the ValueError names a field it was given."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        field = str(e).split("=", 1)[0].removeprefix("SamplingParams.")
        assert str(e).startswith("SamplingParams.") and field in kwargs, str(e)
        return None


@SETTINGS
@given(kwargs=sampling_kwargs)
def test_sampling_params_build_or_name_the_field(kwargs):
    params = build(kwargs)
    if params is not None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            assert math.isfinite(getattr(params, name))


@SETTINGS
@given(
    kwargs=st.one_of(plausible_kwargs, plausible_kwargs, sampling_kwargs),
    prompt=st.one_of(valid_prompts, valid_prompts, prompts),
)
def test_engine_requests_finish_or_are_refused_by_name(llm, kwargs, prompt):
    params = build(kwargs)
    if params is None:
        return
    try:
        outs = llm.generate(prompt, params, use_tqdm=False)
    except ValueError as e:
        assert str(e), "an error must say what is wrong"
        event("refused")
    else:
        event("served")
        assert len(outs) == (0 if prompt == [] else 1)  # [] is an empty list of prompts
        if not outs:
            return
        out = outs[0]
        assert out.finished and len(out.outputs) == params.n
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
        assert all(len(c.token_ids) <= params.max_tokens for c in out.outputs)
    assert_idle(llm)


line_values = st.one_of(
    anything,
    prompts,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", 3]), "content": st.one_of(st.text(max_size=3), small_ints)}
        ),
        max_size=2,
    ),
)
batch_lines = st.lists(
    st.one_of(
        st.text(max_size=20).map(lambda t: t.replace("\n", " ")),
        st.dictionaries(
            st.sampled_from(["id", "prompt", "prompt_token_ids", "messages", *FIELDS, "bogus"]), line_values, max_size=4
        ).map(json.dumps),
        st.builds(
            lambda ids, n: json.dumps({"prompt_token_ids": ids, "max_tokens": n}),
            st.lists(st.integers(1, 255), min_size=1, max_size=10),
            st.integers(1, 4),
        ),
    ),
    max_size=6,
)


@SETTINGS
@given(lines=batch_lines)
def test_batch_lines_each_get_a_result_or_their_own_error(llm, lines):
    out = io.StringIO()
    stats = run_batch(llm, io.StringIO("\n".join(lines)), out, SamplingParams(max_tokens=3))
    served, failed = stats.served, stats.failed
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    nonblank = [i for i, line in enumerate(lines, start=1) if line.strip()]
    assert len(records) == len(nonblank) == served + failed
    for record, lineno in zip(records, nonblank):
        assert "outputs" in record or record["error"].startswith(f"line {lineno}: "), record
    assert_idle(llm)
