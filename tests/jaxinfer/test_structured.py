"""Structured output: specs, grammars over both tokenizer kinds, the in-jit bitmask, and the engine
producing JSON that the schema validates, regex and choice matches, with nothing compiled after
warm-up and unconstrained rows of the same batch untouched."""

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from testpaths import SMOLLM2_SMALL, sentencepiece_model_path

from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams, StructuredOutput
from jaxinfer.sampling.sampler import apply_allowed
from jaxinfer.structured import GrammarBackend, fill_bitmask
from jaxinfer.tokenizer import load_tokenizer

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}
NESTED = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "streets", "location"],
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "streets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "location": {
            "type": "object",
            "additionalProperties": False,
            "required": ["x", "y"],
            "properties": {
                "x": {"type": "integer", "minimum": -90, "maximum": 90},
                "y": {"type": "integer", "minimum": -180, "maximum": 180},
            },
        },
    },
}
ENUM = {
    "type": "object",
    "additionalProperties": False,
    "required": ["color", "sizes"],
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"enum": ["S", "M", "L"]}, "maxItems": 3},
    },
}


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput()
    for text in ("{nope", "[" * 100_000):  # the second nested deeper than the parser goes
        with pytest.raises(ValueError, match="StructuredOutput.json: not valid JSON"):
            StructuredOutput(json=text)
    with pytest.raises(ValueError, match="StructuredOutput.choice"):
        StructuredOutput(choice=["a", ""])
    assert StructuredOutput(json=json.dumps(PERSON)).json == PERSON
    assert StructuredOutput(choice=["a", "b"]) == StructuredOutput(choice=("a", "b"))
    assert hash(StructuredOutput(json=PERSON)) == hash(StructuredOutput(json=dict(PERSON)))


def test_apply_allowed_masks_only_rows_with_bits():
    vocab = 70
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, vocab)), jnp.float32)
    allowed = np.full((3, 3), -1, np.int32)
    allowed[1] = 0
    allowed[1, 65 // 32] = np.int32(1 << (65 % 32))  # row 1: only token 65
    out = np.asarray(apply_allowed(logits, jnp.asarray(allowed)))
    np.testing.assert_array_equal(out[[0, 2]], np.asarray(logits)[[0, 2]])
    assert out[1].argmax() == 65 and np.isinf(np.delete(out[1], 65)).all()
    narrow = np.zeros((3, 1), np.int32)  # too narrow for the vocabulary: never applied
    np.testing.assert_array_equal(np.asarray(apply_allowed(logits, jnp.asarray(narrow))), np.asarray(logits))


def test_bad_grammars_are_named():
    backend = GrammarBackend(load_tokenizer(sentencepiece_model_path()), 32000)
    with pytest.raises(ValueError, match="StructuredOutput.regex"):
        backend.compile(StructuredOutput(regex="[0-9"))
    with pytest.raises(ValueError, match="StructuredOutput.grammar"):
        backend.compile(StructuredOutput(grammar="start: undefined_rule"))
    with pytest.raises(ValueError, match="StructuredOutput.json"):
        backend.compile(StructuredOutput(json={"type": "no-such-type"}))


def test_sentencepiece_vocabulary_masks_follow_the_text():
    """A sentencepiece tokenizer's pieces reach llguidance as bytes ("\u2581" as a space, byte
    pieces as their byte): every token of a matching text is allowed in turn, and "\u2581Hello"
    (a space, then Hello: what the dummy prefix would give) is not where the text has none."""
    from jaxinfer.structured.backend import _PieceVocabulary

    tok = load_tokenizer(sentencepiece_model_path())
    backend = GrammarBackend(tok, tok.vocab_size)
    matcher = backend.compile(StructuredOutput(regex=r"Hello, world!\n[0-9]+")).matcher()
    allowed = np.full((1, -(-tok.vocab_size // 32)), -1, np.int32)
    spaced = tok.encode("Hello", add_special_tokens=False)[0]
    tokens = _PieceVocabulary(tok, tok.vocab_size)("Hello, world!\n42")
    assert tok.id_to_token(spaced) == "\u2581Hello" and tok.id_to_token(tokens[0]) == "Hello"
    assert tok.decode(tokens, skip_special_tokens=False) == "Hello, world!\n42"
    for i, token in enumerate(tokens):
        fill_bitmask([(matcher, 0)], allowed)
        bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")
        assert bits[token], (i, tok.id_to_token(token))
        if i == 0:
            assert not bits[spaced]
        assert matcher.consume(token), matcher.error
    fill_bitmask([(matcher, 0)], allowed)
    bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")
    assert all(bits[e] for e in tok.eos_token_ids)  # complete: end of sequence is allowed


@pytest.mark.parametrize("device_busy", [False, True])
def test_parallel_masks_equal_one_row_at_a_time(device_busy):
    """Several rows are filled by llguidance's pool (all cores while the device is idle, its
    default while a forward runs beside it): bit for bit what each row alone gives."""
    tok = load_tokenizer(sentencepiece_model_path())
    backend = GrammarBackend(tok, tok.vocab_size)
    specs = [
        StructuredOutput(regex="[a-z ]{12}"),
        StructuredOutput(json=PERSON),
        StructuredOutput(choice=["yes", "no"]),
    ]
    matchers = [backend.compile(spec).matcher() for spec in specs]
    words = -(-tok.vocab_size // 32)
    together = np.zeros((len(specs) + 1, words), np.int32)  # the last row untouched
    together[-1] = -1
    fill_bitmask([(m, i) for i, m in enumerate(matchers)], together, device_busy)
    for i, m in enumerate(matchers):
        alone = np.zeros((1, words), np.int32)
        fill_bitmask([(m, 0)], alone)
        np.testing.assert_array_equal(together[i], alone[0])
    assert (together[-1] == -1).all() and not (together[:-1] == -1).all()


ENGINE = SMOLLM2_SMALL  # test_llm's engine: its variants are in the run's compilation cache


@pytest.fixture(scope="module")
def llm():  # on the CPU masks are filled before the step is dispatched
    return LLM(**ENGINE)


def _chat(llm, content, params):
    return llm.chat([[{"role": "user", "content": content}]] * len(params), params, use_tqdm=False)


@pytest.mark.parametrize("schema", [PERSON, NESTED, ENUM], ids=["person", "nested", "enum"])
def test_json_schema_outputs_validate(llm, schema):
    compiled = llm.engine.worker.num_compiled()
    params = [
        SamplingParams(max_tokens=120, temperature=t, seed=s, structured_output=StructuredOutput(json=schema))
        for t, s in ((0.0, None), (0.9, 1), (0.9, 2))
    ]
    for out in _chat(llm, "Describe something as JSON.", params):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.worker.num_compiled() == compiled, "a constrained batch compiled a new step"


def test_json_object_regex_and_choice(llm):
    kinds = [
        StructuredOutput(json_object=True),
        StructuredOutput(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        StructuredOutput(choice=["yes, of course", "no (never)", "maybe"]),
    ]
    params = [SamplingParams(max_tokens=80, temperature=0.8, seed=7, n=2, structured_output=k) for k in kinds]
    objects, regexes, choices = _chat(llm, "Answer me.", params)
    for sample in objects.outputs:  # a small model may nest objects until max_tokens
        assert sample.text.startswith("{"), sample.text
        if sample.finish_reason == "stop":
            assert isinstance(json.loads(sample.text), dict), sample.text
    for sample in regexes.outputs:
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", sample.text), sample.text
    for sample in choices.outputs:
        assert sample.text in kinds[2].choice


def test_unconstrained_rows_are_untouched_and_pages_return(llm):
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = _chat(llm, "Name a colour.", [free])[0].outputs[0].text
    mixed = _chat(
        llm,
        "Name a colour.",
        [
            free,
            SamplingParams(max_tokens=24, temperature=0.0, structured_output=StructuredOutput(choice=["red", "blue"])),
        ],
    )
    assert mixed[0].outputs[0].text == alone
    assert mixed[1].outputs[0].text in ("red", "blue")
    assert llm.engine.kv_cache.num_free_pages == llm.engine.kv_cache.num_usable_pages


def test_bad_spec_is_refused_at_add_request(llm):
    with pytest.raises(ValueError, match="StructuredOutput.regex"):
        llm.generate("hi", SamplingParams(structured_output=StructuredOutput(regex="(unclosed")), use_tqdm=False)
    out = llm.generate(
        "hi", SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="[a-z]+")), use_tqdm=False
    )[0]  # nothing of the refused request lingers
    assert re.fullmatch("[a-z]+", out.outputs[0].text)
    assert llm.engine.kv_cache.num_free_pages == llm.engine.kv_cache.num_usable_pages


def test_command_line_flags_and_batch_lines(tmp_path):
    from jaxinfer.cli import build_parser
    from jaxinfer.cli.args import sampling_params
    from jaxinfer.rows import parse_line

    def spec(*flags):
        return sampling_params(build_parser().parse_args(["generate", "hi", *flags])).structured_output

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(PERSON))
    assert spec() is None
    assert spec("--regex", "[a-z]+") == StructuredOutput(regex="[a-z]+")
    assert spec("--json-schema", str(schema_file)).json == PERSON
    assert spec("--json-schema", json.dumps(ENUM)).json == ENUM
    assert spec("--choice", "a", "--choice", "b").choice == ("a", "b")
    assert spec("--json-object") == StructuredOutput(json_object=True)
    with pytest.raises(ValueError, match="--json-schema .*does not exist"):
        spec("--json-schema", str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit):  # one kind at a time
        spec("--regex", "a", "--json-object")
    _, _, params, _ = parse_line(
        '{"prompt": "hi", "structured_output": {"choice": ["x", "y"]}}', 1, SamplingParams(), llm=None
    )
    assert params.structured_output == StructuredOutput(choice=("x", "y"))
    with pytest.raises(ValueError, match="line 3: StructuredOutput.regex"):
        parse_line('{"prompt": "hi", "structured_output": {"regex": 5}}', 3, SamplingParams(), llm=None)


def test_masks_filled_while_the_forward_runs_give_the_same_tokens(llm):
    """The split step (forward dispatched, then the step before lands, then the masks and the
    sampling call) yields the tokens of the engine that fills masks before dispatching; both
    halves launched from the launcher's thread, as on a GPU."""
    overlapped = LLM(**ENGINE, structured_output_overlap=True, dispatch_thread=True)
    runner = overlapped.engine.worker
    assert (
        runner.step.split_buckets == (16,) and not llm.engine.worker.step.split_buckets and runner.step.launcher.enabled
    )
    compiled, split_calls = runner.num_compiled(), []
    sample = runner.step.dispatch_sample
    runner.step.dispatch_sample = lambda hidden, inputs: split_calls.append(1) or sample(hidden, inputs)
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput(json=PERSON)),
        SamplingParams(max_tokens=60, temperature=0.9, seed=3, structured_output=StructuredOutput(json=ENUM)),
        SamplingParams(
            max_tokens=20,
            temperature=0.8,
            seed=5,
            n=2,
            structured_output=StructuredOutput(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        ),
        SamplingParams(max_tokens=20, temperature=0.0, structured_output=StructuredOutput(choice=["red", "blue"])),
        SamplingParams(max_tokens=30, temperature=0.7, seed=9),
    ]  # unconstrained beside them
    want = _chat(llm, "Describe a person as JSON.", params)
    got = _chat(overlapped, "Describe a person as JSON.", params)
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs], g.outputs[0].text
    jsonschema.validate(json.loads(got[0].outputs[0].text), PERSON)
    assert len(split_calls) >= 5, "the split step was not taken"
    assert runner.num_compiled() == compiled, "the split step compiled after warm-up"
    assert overlapped.engine.kv_cache.num_free_pages == overlapped.engine.kv_cache.num_usable_pages
