"""Structured output behind a reasoning model's thinking (structured/reasoning_gate.py): the
gate's states over a vocabulary where <think> and </think> are single tokens (as in Qwen3's and
DeepSeek-R1's) and over one where they are several, its rows beside plain ones in one bitmask,
and the engine with a reasoning parser set."""

import shutil

import numpy as np
import pytest
import tokenizers
from testpaths import FIXTURES

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.config.load import REASONING_PARSERS
from jaxinfer.sampling.params import StructuredOutput
from jaxinfer.structured import GrammarBackend, fill_bitmask
from jaxinfer.structured.reasoning_gate import ReasoningGate
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.tokenizer.reasoning import PARSERS, reasoning_parser

CHOICE = StructuredOutput(choice=["yes", "no"])


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer with <think> and </think> added as single (non-special) tokens."""
    directory = tmp_path_factory.mktemp("think_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "smollm2" / name, directory / name)
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_tokens(
        [tokenizers.AddedToken("<think>", normalized=False), tokenizers.AddedToken("</think>", normalized=False)]
    )
    backend.save(str(directory / "tokenizer.json"))
    return load_tokenizer(directory)


def _allowed(matcher, vocab_size) -> set[int]:
    row = np.zeros(-(-vocab_size // 32), np.int32)
    matcher.fill(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:vocab_size]).tolist())


def _feed(gate, tokenizer, text):
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert gate.consume(token), (text, token)


def test_qwen3_thinking_then_a_constrained_answer(think_tokenizer):
    tok = think_tokenizer
    vocab = tok.vocab_size
    think, end = (tok.encode(m, add_special_tokens=False) for m in ("<think>", "</think>"))
    assert len(think) == len(end) == 1
    backend = GrammarBackend(tok, vocab, reasoning=reasoning_parser("qwen3"))
    gate = backend.compile(CHOICE).matcher()
    assert isinstance(gate, ReasoningGate) and gate.state == "start"
    plain = _allowed(backend.compile(CHOICE).row_matcher(), vocab)
    assert _allowed(gate, vocab) == plain | set(think)  # the answer's first token, or <think>
    gate.consume(think[0])
    assert gate.state == "reasoning" and len(_allowed(gate, vocab)) == vocab
    _feed(gate, tok, "Hmm, {not json} and not a choice either.")  # the grammar would refuse these
    gate.consume(end[0])
    assert gate.state == "after"
    blank = tok.encode("\n\n", add_special_tokens=False)
    assert _allowed(gate, vocab) > plain and set(blank) <= _allowed(gate, vocab)
    _feed(gate, tok, "\n\n")  # the blank line before the answer is let through
    assert gate.state == "after" and not gate.is_finished
    _feed(gate, tok, "yes")
    assert gate.state == "answer" and gate.is_finished and gate.error is None


def test_qwen3_answer_without_thinking_is_the_grammar_from_its_first_token(think_tokenizer):
    tok = think_tokenizer
    gate = GrammarBackend(tok, tok.vocab_size, reasoning=reasoning_parser("qwen3")).compile(CHOICE).matcher()
    _feed(gate, tok, "no")
    assert gate.state == "answer" and gate.is_finished
    # a refused token reaches the grammar (and is reported), as without a gate
    gate = GrammarBackend(tok, tok.vocab_size, reasoning=reasoning_parser("qwen3")).compile(CHOICE).matcher()
    assert not gate.consume(tok.encode("maybe", add_special_tokens=False)[0]) and gate.error


def test_deepseek_r1_starts_inside_the_reasoning(think_tokenizer):
    tok = think_tokenizer
    gate = GrammarBackend(tok, tok.vocab_size, reasoning=reasoning_parser("deepseek_r1")).compile(CHOICE).matcher()
    assert gate.state == "reasoning" and len(_allowed(gate, tok.vocab_size)) == tok.vocab_size
    _feed(gate, tok, "Let me think. </think>no")
    assert gate.state == "answer" and gate.is_finished


def test_markers_of_several_tokens():
    """SmolLM2's own vocabulary writes </think> as several tokens: found in the decoded text; its
    <think> is not one token, so qwen3's first token is the grammar's alone."""
    tok = load_tokenizer(FIXTURES / "smollm2")
    assert len(tok.encode("</think>", add_special_tokens=False)) > 1
    backend = GrammarBackend(tok, tok.vocab_size, reasoning=reasoning_parser("qwen3"))
    gate = backend.compile(CHOICE).matcher()
    assert _allowed(gate, tok.vocab_size) == _allowed(backend.compile(CHOICE).row_matcher(), tok.vocab_size)
    gate = GrammarBackend(tok, tok.vocab_size, reasoning=reasoning_parser("deepseek_r1")).compile(CHOICE).matcher()
    _feed(gate, tok, "Thinking </think")
    assert gate.state == "reasoning"  # not the whole marker yet
    _feed(gate, tok, ">\nyes")
    assert gate.state == "answer" and gate.is_finished


def test_gated_rows_beside_plain_ones_in_one_bitmask(think_tokenizer):
    tok = think_tokenizer
    gated = GrammarBackend(tok, tok.vocab_size, reasoning=reasoning_parser("deepseek_r1"))
    plain = GrammarBackend(tok, tok.vocab_size)
    rows = [gated.compile(CHOICE).matcher(), plain.compile(CHOICE).matcher(), gated.compile(CHOICE).matcher()]
    _feed(rows[2], tok, "</think>")
    allowed = np.zeros((3, -(-tok.vocab_size // 32)), np.int32)
    for device_busy in (False, True):
        fill_bitmask(list(zip(rows, range(3))), allowed, device_busy)
        for i, matcher in enumerate(rows):
            one = np.zeros_like(allowed[i])
            matcher.fill(one)
            np.testing.assert_array_equal(allowed[i], one)
    assert (allowed[0] == -1).all() and not (allowed[1] == -1).all()


def test_unknown_parser_is_named():
    assert sorted(PARSERS) == sorted(REASONING_PARSERS)  # the config's names are the formats'
    with pytest.raises(ValueError, match="reasoning_parser='o1'"):
        EngineConfig(reasoning_parser="o1")


def test_engine_lets_the_reasoning_through():
    """With deepseek_r1 the output starts in the reasoning, so a constrained request's first
    tokens are free (SmolLM2 never writes </think> here: its whole output is unconstrained);
    with qwen3 a model that does not open with <think> is constrained from its first token."""
    llm = LLM(
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=[16],
        num_pages=32,
        penalties=False,
        num_decode_steps=1,
        reasoning_parser="deepseek_r1",
    )  # one variant to compile
    params = SamplingParams(max_tokens=6, temperature=0.0, structured_output=CHOICE)
    free = llm.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[
        0
    ].outputs[0]
    gated = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert gated.token_ids == free.token_ids and gated.finish_reason == "length"
    llm.engine.grammars = GrammarBackend(
        llm.engine.tokenizer, llm.engine.model.config.vocab_size, reasoning_parser("qwen3")
    )
    answer = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert answer.text in CHOICE.choice and answer.finish_reason == "stop"


def test_command_line_flag_is_checked_before_loading_and_reaches_the_engine(monkeypatch, capsys):
    from jaxinfer.cli import args as cli_args
    from jaxinfer.cli import build_parser, main

    seen = {}
    monkeypatch.setattr("jaxinfer.llm.LLM.__init__", lambda self, *a, **kw: seen.update(kw) or exit(0))
    for command in (["generate", "hi"], ["batch", "--input", "in.jsonl"]):
        with pytest.raises(SystemExit):
            cli_args.make_llm(build_parser().parse_args([*command, "--reasoning-parser", "deepseek_r1"]))
        assert seen.pop("reasoning_parser") == "deepseek_r1"
        seen.clear()
    assert main(["generate", "hi", "--reasoning-parser", "o1"]) == 2  # before any model loads
    assert seen == {} and "--reasoning-parser o1: unknown" in capsys.readouterr().err
