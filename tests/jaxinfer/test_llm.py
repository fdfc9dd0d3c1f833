"""The offline API and CLI on the embedded default model (SmolLM2-135M-Instruct GGUF)."""

import io
import json

import numpy as np
import pytest
from testpaths import FIXTURES, SMOLLM2_SMALL, SMOLLM2_SMALL_ARGS

from jaxinfer import cli
from jaxinfer.cli.batch import run_batch
from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams

GOLDEN = np.load(FIXTURES / "smollm2" / "golden.npz")
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# SMOLLM2_SMALL_ARGS: the same engine from the command line; its step programs are the module
# engine's, which the compilation cache then holds.


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMOLLM2_SMALL)


def greedy(**kw):
    return SamplingParams(temperature=0, **{"max_tokens": 32, **kw})


def test_default_model_chat_matches_transformers(llm):
    assert llm.render_chat(QUESTION) == GOLDEN["input_ids"].tolist()
    out = llm.chat(QUESTION, greedy(), use_tqdm=False)[0]
    stop = int(GOLDEN["greedy_stops_at"])  # transformers' greedy path reaches <|im_end|> here
    completion = out.outputs[0]
    assert completion.token_ids == GOLDEN["greedy"][: stop + 1].tolist()
    assert completion.text == "The capital of France is Paris."
    assert completion.finish_reason == "stop" and out.finished
    assert out.usage.prompt_tokens == len(GOLDEN["input_ids"])
    m = out.metrics
    assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
    assert len(m.inter_token_latencies) == len(completion.token_ids) - 1


def test_ignore_eos_follows_the_argmax_chain(llm):
    out = llm.chat(QUESTION, greedy(ignore_eos=True, skip_special_tokens=False), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == GOLDEN["greedy"].tolist()
    assert out.outputs[0].text.startswith("The capital of France is Paris.<|im_end|>")


@pytest.mark.parametrize(
    "stops,include,text,reason",
    [
        (["France"], False, "The capital of ", "France"),
        (["France"], True, "The capital of France", "France"),
        (["is P", "capital"], False, "The ", "capital"),  # the earliest match wins
        ([" Paris."], False, "The capital of France is", " Paris."),
    ],
)
def test_stop_strings_cut_exactly(llm, stops, include, text, reason):
    params = greedy(stop=stops, include_stop_str_in_output=include)
    prompt = llm.render_chat(QUESTION)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", reason)
    streamed = [d.outputs[0].text for d in llm.stream(prompt, params)]
    assert "".join(streamed) == text  # no part of a stop string is ever streamed


def test_generate_keeps_input_order_and_stream_matches(llm):
    prompts = ["Once upon a time", "The quick brown fox", "def fibonacci(n):", "1, 2, 3,"]
    params = greedy(max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for prompt, out in list(zip(prompts, outs))[::2]:  # batched output equals the prompt alone
        alone = llm.generate(prompt, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    streamed = list(llm.stream(prompts[1], params))
    assert "".join(d.outputs[0].text for d in streamed) == outs[1].outputs[0].text
    assert streamed[-1].finished and streamed[-1].outputs[0].finish_reason == "length"
    assert llm.engine.kv_cache.num_free_pages == llm.engine.kv_cache.num_usable_pages


def test_stopping_a_stream_early_frees_its_pages(llm):
    stream = llm.stream("Tell me a long story", greedy(max_tokens=64, ignore_eos=True))
    next(stream)
    next(stream)
    stream.close()
    assert not llm.engine.scheduler.has_unfinished()
    assert llm.engine.kv_cache.num_free_pages == llm.engine.kv_cache.num_usable_pages


def test_a_stream_left_open_while_generate_runs_gets_all_its_tokens(llm):
    params = greedy(max_tokens=10, ignore_eos=True)
    expected = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
    stream = llm.stream("The quick brown fox", params)
    first = next(stream)
    other = llm.generate(
        ["def fibonacci(n):", "1, 2, 3,"], greedy(max_tokens=16, ignore_eos=True), use_tqdm=False
    )  # steps the engine past the stream's last token
    assert all(o.finished and len(o.outputs[0].token_ids) == 16 for o in other)
    rest = list(stream)
    assert rest and rest[-1].finished
    assert first.outputs[0].token_ids + [t for d in rest for t in d.outputs[0].token_ids] == expected.token_ids
    assert "".join(d.outputs[0].text for d in [first, *rest]) == expected.text
    assert llm.engine.kv_cache.num_free_pages == llm.engine.kv_cache.num_usable_pages


def test_two_zipped_streams_each_get_exactly_their_own_tokens(llm):
    short, long = greedy(max_tokens=4, ignore_eos=True), greedy(max_tokens=9, ignore_eos=True)
    want = [
        llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in (("Once upon a time", short), ("1, 2, 3,", long))
    ]
    a, b = llm.stream("Once upon a time", short), llm.stream("1, 2, 3,", long)
    got = [[], []]
    for da, db in zip(a, b):  # zip stops with the shorter stream: read the rest of the other
        got[0] += da.outputs[0].token_ids
        got[1] += db.outputs[0].token_ids
    got[1] += [t for d in b for t in d.outputs[0].token_ids]
    assert got == want
    assert llm.engine.kv_cache.num_free_pages == llm.engine.kv_cache.num_usable_pages


@pytest.mark.parametrize("prompt,match", [("", "empty"), ("word " * 600, "does not fit the context of 512")])
def test_bad_prompts_fail_the_call_only(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], greedy(max_tokens=4), use_tqdm=False)
    assert not llm.engine.scheduler.has_unfinished()
    assert llm.generate("still serving", greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_batch_job_reports_broken_lines_and_serves_the_rest(llm):
    lines = "\n".join(
        [
            json.dumps({"id": "a", "messages": QUESTION, "max_tokens": 32}),
            "{not json",
            json.dumps({"id": "c", "prompt": "Hello", "temperature": -1}),
            json.dumps({"id": "d", "prompt": ""}),
            json.dumps({"id": "e", "prompt_token_ids": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}),
            json.dumps({"id": "f", "prompt": "x", "bogus": 1}),
            json.dumps({"id": "m8", "messages": [{"role": "user", "content": 42}]}),
            json.dumps({"id": "g", "messages": "hello"}),
            json.dumps({"id": "h", "prompt": "Hi", "stop": 5}),
            "[" * 100_000,
        ]
    )
    out = io.StringIO()
    stats = run_batch(llm, io.StringIO(lines), out, greedy())
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert stats.failed >= 7 and stats.served + stats.failed == len(records) == 10
    assert records[0]["id"] == "a" and records[0]["outputs"][0]["text"] == "The capital of France is Paris."
    assert "line 2: not valid JSON" in records[1]["error"]
    assert "line 3" in records[2]["error"] and "temperature" in records[2]["error"]
    assert "line 4" in records[3]["error"] and "empty" in records[3]["error"]
    assert len(records[4]["outputs"][0]["token_ids"]) == 3
    assert "unknown fields ['bogus']" in records[5]["error"]
    for record, lineno in zip(records[6:], (7, 8, 9)):  # served, or refused with its line named
        assert "outputs" in record or f"line {lineno}" in record["error"]
    assert "line 8" in records[7]["error"] and "stop=5" in records[8]["error"]
    assert records[9]["error"].startswith("line 10: not valid JSON (nested too deeply)")
    assert llm.engine.kv_cache.num_free_pages == llm.engine.kv_cache.num_usable_pages


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALLED = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
]


def test_chat_renders_tools_with_a_template_that_takes_them(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", (FIXTURES / "templates" / "hermes_tools.jinja").read_text())
    text = llm.tokenizer.decode(llm.render_chat(CALLED, tools=[WEATHER]), skip_special_tokens=False)
    assert json.dumps(WEATHER["function"]) in text and "<tool_response>\n18C\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    out = llm.chat(CALLED, greedy(max_tokens=4), tools=[WEATHER], use_tqdm=False)[0]
    assert out.usage.prompt_tokens == len(llm.render_chat(CALLED, tools=[WEATHER]))
    lines = [
        json.dumps({"id": "t", "messages": CALLED, "tools": [WEATHER], "max_tokens": 4}),
        json.dumps({"id": "u", "prompt": "Hi", "tools": [WEATHER]}),
    ]
    out = io.StringIO()
    run_batch(llm, io.StringIO("\n".join(lines)), out, greedy())
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert records[0]["usage"]["prompt_tokens"] == len(llm.render_chat(CALLED, tools=[WEATHER]))
    assert "line 2: tools: only with messages" in records[1]["error"]
    for bad, match in (
        ([{"role": "assistant", "content": None}], r"messages\[0\].content=None: must be a string"),
        ([{"role": "assistant", "tool_calls": "f()"}], r"messages\[0\].tool_calls='f\(\)'"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.render_chat(bad)
    with pytest.raises(ValueError, match="tools='get_weather': must be a list"):
        llm.render_chat(QUESTION, tools="get_weather")


def test_chat_template_kwargs_reach_the_template(llm, monkeypatch):
    monkeypatch.setattr(
        llm.tokenizer,
        "chat_template",
        "{% if enable_thinking is false %}/no_think {% endif %}{{ messages[0].content }}",
    )
    ids = llm.render_chat(QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert llm.tokenizer.decode(ids) == "/no_think " + QUESTION[0]["content"]
    with pytest.raises(ValueError, match=r"chat_template_kwargs\['add_generation_prompt'\]"):
        llm.chat(QUESTION, chat_template_kwargs={"add_generation_prompt": False})
    out = io.StringIO()
    line = {"id": "k", "messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2}
    run_batch(llm, io.StringIO(json.dumps(line)), out, greedy())
    assert json.loads(out.getvalue())["usage"]["prompt_tokens"] == len(ids)


def test_cli_batch_checks_paths_first_and_never_empties_old_results(capsys, tmp_path):
    old = tmp_path / "results.jsonl"
    old.write_text('{"id": "kept"}\n')
    for argv, match in (
        (["--input", str(tmp_path / "missing.jsonl"), "--output", str(old)], "does not exist"),
        (["--input", str(old), "--output", str(tmp_path)], "is a directory"),
        (["--input", str(tmp_path), "--output", str(old)], "is a directory"),
    ):
        assert cli.main(["batch", *argv, "--model", "/no/such/model"]) == 2  # before any loading
        err = capsys.readouterr().err
        assert err.startswith("error: ") and match in err and "/no/such/model" not in err
    assert old.read_text() == '{"id": "kept"}\n'


def test_cli_generate_prints_only_the_text(capsys, llm):
    argv = ["generate", "--chat", QUESTION[0]["content"], "--max-tokens", "32", *SMOLLM2_SMALL_ARGS]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"
    # --chat-template renders the prompt instead of the checkpoint's template
    template = "<|im_start|>user\n{{ messages[0].content }}<|im_end|>\n<|im_start|>assistant\n"
    assert cli.main([*argv[:4], "1", "--output-format", "jsonl", "--chat-template", template, *SMOLLM2_SMALL_ARGS]) == 0
    ids = llm.tokenizer.encode(
        f"<|im_start|>user\n{QUESTION[0]['content']}<|im_end|>\n<|im_start|>assistant", add_special_tokens=False
    )  # jinja drops a template's last newline, as HF's does
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == len(ids) < len(llm.render_chat(QUESTION))


@pytest.mark.parametrize(
    "argv,match",
    [
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--max-tokens", "-1"], "max_tokens"),
        (["generate", "hi", "--model", "/no/such/model"], "/no/such/model"),
        (["generate"], "no prompt given"),
        (["generate", "hi", "--token-buckets", "8,x"], "--token-buckets"),
        (["generate", "", "--model", "/no/such/model"], "prompt 1 is empty"),
        (["generate", "--prompts-file", "/", "--model", "/no/such/model"], "--prompts-file /: is a directory"),
        (
            ["generate", "hi", "--chat-template", "/no/such.jinja", "--model", "/no/such/model"],
            "chat_template='/no/such.jinja': no such file",
        ),
        (["generate", "hi", "--chat-template", "{% if %}", "--model", "/no/such/model"], "does not compile"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err


def test_cli_info_reports_kv_capacity(capsys):
    assert cli.main(["info", "--num-pages", "100", "--max-model-len", "1024"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"]["num_layers"] == 30 and info["model"]["num_kv_heads"] == 3
    assert info["kv_cache"]["pages"] == 99 and info["kv_cache"]["tokens"] == 99 * 16
    # 30 layers x (K + V) x 3 kv heads x 64 dims x 4 bytes (float32 on the CPU)
    assert info["kv_cache"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert info["kv_cache"]["device_bytes"] == info["kv_cache"]["bytes"] == 100 * 16 * 30 * 2 * 3 * 64 * 4
    # every option of the engine the flags describe, by config group (generated from the fields)
    config = info["engine_config"]
    assert config["cache"]["num_pages"] == 100 and config["scheduler"]["max_model_len"] == 1024
    assert config["scheduler"]["max_num_seqs"] == 64 and config["speculative_config"] is None
    names = [n for group in config.values() if isinstance(group, dict) for n in group] + ["speculative_config"]
    assert sorted(names) == sorted(d.name for _, d in EngineConfig.declared())


def test_cli_info_names_the_family_and_its_features(capsys):
    model = str(FIXTURES / "hf" / "qwen3_tied")
    assert cli.main(["info", "--model", model, "--dtype", "float32", "--num-pages", "8"]) == 0
    info = json.loads(capsys.readouterr().out)["model"]
    assert info["model_type"] == "qwen3" and info["family"] == "llama"
    assert info["qk_norm"] and info["tie_word_embeddings"] and not info["qkv_bias"]
    assert (info["num_heads"], info["num_kv_heads"], info["head_dim"], info["hidden_size"]) == (4, 1, 32, 48)
    assert info["tool_call_format"] is None  # no chat template
    template = str(FIXTURES / "templates" / "hermes_tools.jinja")
    assert (
        cli.main(["info", "--model", model, "--dtype", "float32", "--num-pages", "8", "--chat-template", template]) == 0
    )
    assert json.loads(capsys.readouterr().out)["model"]["tool_call_format"] == "hermes"


def test_cli_info_shows_a_mixture_of_experts(capsys):
    model = str(FIXTURES / "hf" / "qwen3_moe")
    assert cli.main(["info", "--model", model, "--dtype", "float32", "--num-pages", "8"]) == 0
    info = json.loads(capsys.readouterr().out)["model"]
    assert info["model_type"] == "qwen3_moe" and info["family"] == "moe" and info["qk_norm"]
    assert (info["num_experts"], info["num_experts_per_tok"], info["moe_intermediate_size"]) == (8, 2, 24)
    assert info["mlp_only_layers"] == [1] and not info["norm_topk_prob"]


def test_cli_chat_streams_replies_and_exits(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(QUESTION[0]["content"] + "\n/exit\n"))
    argv = ["chat", "--max-tokens", "32", *SMOLLM2_SMALL_ARGS]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_cli_refuses_a_too_long_prompt_before_compiling(capsys, monkeypatch):
    from jaxinfer.engine import Engine

    def no_compiling(self):
        raise AssertionError("compiled before the prompts were checked")

    monkeypatch.setattr(Engine, "warm_up", no_compiling)
    assert (
        cli.main(
            [
                "generate",
                "ok",
                "word " * 100,
                "--max-model-len",
                "64",
                "--max-tokens",
                "8",
                "--token-buckets",
                "16,64",
                "--max-num-batched-tokens",
                "64",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: prompt 2: prompt of") and "does not fit the context of 64 tokens" in err


def test_cli_generate_and_batch_write_logprobs(capsys, llm):
    """--prompt-logprobs compiles the scoring steps for this job and writes each prompt token's
    logprob into the JSON line; batch lines carry the logprobs they ask for, and a line asking
    for prompt logprobs of an engine started without them is refused by name."""
    prompt = "The capital of France is"
    argv = [
        "generate",
        prompt,
        "--max-tokens",
        "2",
        "--logprobs",
        "1",
        "--prompt-logprobs",
        "2",
        "--output-format",
        "jsonl",
        "--max-model-len",
        "64",
        "--max-num-batched-tokens",
        "16",
        "--token-buckets",
        "16",
        "--max-num-seqs",
        "2",
    ]
    assert cli.main(argv) == 0
    line = json.loads(capsys.readouterr().out)
    plp = line["prompt_logprobs"]
    assert len(plp) == line["prompt_tokens"] == len(llm.tokenizer.encode(prompt)) and plp[0] is None
    ids = llm.tokenizer.encode(prompt)
    assert [e["token_id"] for e in plp[1:]] == ids[1:]
    for e in plp[1:]:
        assert len(e["top_logprobs"]) == 2 and e["rank"] >= 1 and e["logprob"] <= 0
        assert (e["rank"] == 1) == (e["logprob"] >= max(e["top_logprobs"].values()) - 1e-5)
    assert len(line["logprobs"]) == line["completion_tokens"] == 2
    out = io.StringIO()
    run_batch(
        llm,
        io.StringIO(
            "\n".join(
                [
                    json.dumps({"id": "l", "prompt": prompt, "logprobs": 1, "max_tokens": 2}),
                    json.dumps({"id": "p", "prompt": prompt, "prompt_logprobs": 1}),
                ]
            )
        ),
        out,
        greedy(),
    )
    logged, refused = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [e["token_id"] for e in logged["outputs"][0]["logprobs"]] == logged["outputs"][0]["token_ids"]
    assert "prompt_logprobs" not in logged
    assert "line 2" in refused["error"] and "--enable-prompt-logprobs" in refused["error"]


@pytest.mark.parametrize("argv", [["generate", "hi", "--prompt-logprobs", "1"], ["chat", "--logprobs", "2"]])
def test_cli_refuses_logprobs_it_would_not_print_before_loading(capsys, monkeypatch, argv):
    """Text output has no place for logprobs: refused by flag, before the model loads."""

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded the model before the flags were checked")

    monkeypatch.setattr("jaxinfer.cli.generate.make_llm", no_loading)
    assert cli.main(argv) == 2
    flag, value = argv[-2:]
    assert capsys.readouterr().err.startswith(f"error: {flag} {value}: ")
