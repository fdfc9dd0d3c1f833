"""LoRA adapters behind the server, over loopback (one BackgroundServer, gRPC and HTTP, on one
tiny Llama engine with two adapter slots and `all` known from start-up): each adapter's greedy
output is its PEFT golden on both transports (the base model's beside it), /v1/models and
ListLoraAdapters list them, adapters load and unload while a stream runs (three in use across
requests for two slots; an adapter in use refuses to unload and its request completes), every
bad adapter is refused naming its problem while serving goes on, the routes and calls of live
updates are off without lora_updates (and the calls without LoRA), the Prometheus gauges per
adapter and the request log's lora_adapter, nothing compiles after the warm-up, and every KV
page is free at the end."""

import json
import shutil
import threading
import types
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from lora_adapters import write_random_adapter
from openai_support import metric, raw_request
from safetensors.numpy import load_file, save_file
from serving_support import assert_pages_free, client_of, slow_steps, wait_for
from testpaths import FIXTURES

from jaxinfer.llm import LLM
from jaxinfer.lora.peft import MODULES, module_shapes
from serving.server import BackgroundServer, ServerOptions

ADAPTERS = FIXTURES / "lora"
DIRS = {"all": ADAPTERS / "llama3_all_r8", "qv": ADAPTERS / "llama3_qv_r4", "rslora": ADAPTERS / "llama3_all_r8_rslora"}
GOLDEN = {name: dict(np.load(path / "golden.npz")) for name, path in DIRS.items()}
BASE = "llama3"  # the served model's name: the fixture directory's
TINY = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 32), num_pages=48)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt(name: str) -> list[int]:
    return GOLDEN[name]["prompt"].tolist()


def greedy(name: str, n: int = 16, base: bool = False) -> list[int]:
    return GOLDEN[name]["base_greedy" if base else "greedy"][:n].tolist()


@pytest.fixture(scope="module")
def lora_llm():
    return LLM(
        str(FIXTURES / "hf" / "llama3"),
        "float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[f"all={DIRS['all']}"],
        **TINY,
    )


@pytest.fixture(scope="module")
def server(lora_llm, tmp_path_factory):
    """The module's server (gRPC and HTTP, live updates on, a request log); the last test stops it."""
    log = tmp_path_factory.mktemp("lora") / "requests.jsonl"
    compiled = lora_llm.engine.worker.num_compiled()  # after the warm-up
    options = ServerOptions(port=0, http_port=0, grace_period_s=2.0, lora_updates=True, request_log=str(log))
    srv = BackgroundServer(lora_llm.engine, options).start()
    srv.request_log_path, srv.compiled_at_start = log, compiled
    yield srv
    srv.stop()


def http_of(server) -> types.SimpleNamespace:
    """What openai_support's raw_request and metric read of a server."""
    return types.SimpleNamespace(host="127.0.0.1", port=server.http_port, http=f"http://127.0.0.1:{server.http_port}")


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> tuple[int, str]:
    status, _, data = raw_request(http_of(server), "POST", path, body)
    return status, data.decode()


def error_message(text: str) -> str:
    return json.loads(text)["error"]["message"]


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]  # the fixture has no tokenizer


def complete(server, model: str, prompt_ids: list[int], max_tokens: int = 16) -> tuple[list[int], str]:
    """(token ids, the model the response names) of a greedy HTTP completion."""
    done = openai_client(server).completions.create(
        model=model,
        prompt=prompt_ids,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert done.choices[0].finish_reason == "length"
    return ids(done.choices[0].logprobs.tokens), done.model


def stream_in_thread(server, model: str, prompt_ids: list[int], max_tokens: int):
    """A streamed greedy HTTP completion on a thread: (thread, first chunk event, chunks)."""
    chunks: list = []
    first = threading.Event()

    def run():
        for chunk in openai_client(server).completions.create(
            model=model,
            prompt=prompt_ids,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            chunks.append(chunk)
            first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, first, chunks


def streamed_ids(chunks) -> list[int]:
    return ids([t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens])


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


def adapter_names(server) -> list[str]:
    with client_of(server) as client:
        return [a.name for a in client.list_lora_adapters(timeout=30).adapters]


# --- HTTP ---------------------------------------------------------------------------------------
def test_http_goldens_models_and_unknown_model(server):
    assert complete(server, "all", prompt("all")) == (greedy("all"), "all")
    assert complete(server, BASE, prompt("all")) == (greedy("all", base=True), BASE)
    status, _, body = raw_request(http_of(server), "GET", "/v1/models")
    cards = json.loads(body)["data"]
    assert status == 200 and [c["id"] for c in cards] == [BASE, "all"]
    assert cards[1]["parent"] == BASE and cards[1]["root"] == str(DIRS["all"].resolve())
    status, _, body = raw_request(http_of(server), "GET", "/v1/models/all")
    assert status == 200 and json.loads(body) == cards[1]
    with pytest.raises(openai.NotFoundError) as info:
        complete(server, "nope", [1, 2, 3])
    message = info.value.body["message"]
    assert "`nope`" in message and f"`{BASE}`" in message and "`all`" in message
    schema = json.loads(raw_request(http_of(server), "GET", "/openapi.json")[2])
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(schema["paths"])


def test_live_load_and_unload_while_a_stream_runs(server, lora_llm):
    # Steps of 0.1 s (of up to 8 tokens: decode windows): the 190-token stream takes some 30 of
    # them, what runs beside it some 15.
    with slow_steps(lora_llm.engine, 0.1):
        stream, started, chunks = stream_in_thread(server, "all", prompt("all"), 190)
        assert started.wait(60)
        wait_for(lambda: metric(http_of(server), "jaxinfer_lora_requests_running", 'adapter="all"') >= 1)
        text = raw_request(http_of(server), "GET", "/metrics")[2].decode()  # vLLM's name for routers
        assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="all",waiting_lora_adapters=""}' in text
        for name in ("qv", "rslora"):
            status, text = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(DIRS[name])})
            assert (status, text) == (200, f"Success: LoRA adapter '{name}' added successfully.")
        # Both at once beside the stream: three adapters in use for two slots (one waits for a slot).
        results: dict = {}
        pair = [
            threading.Thread(target=lambda n=n: results.update({n: complete(server, n, prompt(n))}))
            for n in ("qv", "rslora")
        ]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(60)
        assert results == {"qv": (greedy("qv"), "qv"), "rslora": (greedy("rslora"), "rslora")}
        assert stream.is_alive()  # the stream ran beside them all along
        # Unloading an adapter a request still runs under is refused; the request completes.
        held, held_started, held_chunks = stream_in_thread(server, "qv", prompt("qv"), 64)
        assert held_started.wait(60)
        status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "qv"})
        assert status == 400 and "'qv' is in use" in error_message(text)
        held.join(60)
        assert streamed_ids(held_chunks)[:32] == greedy("qv", 32) and len(streamed_ids(held_chunks)) == 64
    stream.join(60)
    assert not stream.is_alive() and len(streamed_ids(chunks)) == 190
    assert streamed_ids(chunks)[:32] == greedy("all", 32) and chunks[-1].choices[0].finish_reason == "length"
    status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert (status, text) == (200, "Success: LoRA adapter 'qv' removed successfully.")
    with pytest.raises(openai.NotFoundError) as info:
        complete(server, "qv", prompt("qv"))
    assert "`qv`" in info.value.body["message"] and "`rslora`" in info.value.body["message"]
    status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert status == 404 and "'qv'" in error_message(text)
    assert complete(server, "rslora", prompt("rslora")) == (greedy("rslora"), "rslora")
    assert adapter_names(server) == ["all", "rslora"]


def test_the_schema_documents_the_lora_routes_where_served():
    import concurrent.futures

    from serving.model_limits import ModelLimits
    from serving.openai.app import build_app
    from serving.openai.handlers import ApiContext
    from serving.openai.schema import openapi_schema

    limits = ModelLimits(vocab_size=512, max_model_len=256, penalties_enabled=False)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        app = build_app(ApiContext(None, None, limits, "m", pool, lora_updates=True))
    not_documented = {"/openapi.json", "/docs", "/docs/{asset}", "/ui"}
    served = {
        (route.path.replace("{model:path}", "{model}"), method.lower())
        for route in app.routes
        for method in route.methods
        if method != "HEAD" and route.path not in not_documented
    }
    schema = openapi_schema("m", lora_updates=True)
    assert {(path, method) for path, ops in schema["paths"].items() for method in ops} == served
    load = schema["paths"]["/v1/load_lora_adapter"]["post"]
    body = load["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert schema["components"]["schemas"][body]["required"] == ["lora_name", "lora_path"]
    assert set(load["responses"]["200"]["content"]) == {"text/plain"} and "400" in load["responses"]
    assert "404" in schema["paths"]["/v1/unload_lora_adapter"]["post"]["responses"]
    assert {"root", "parent"} <= set(schema["components"]["schemas"]["ModelCard"]["properties"])


# --- bad adapters -------------------------------------------------------------------------------
def _dims(hidden: int = 64) -> dict[str, tuple[int, int]]:
    config = types.SimpleNamespace(
        hidden_size=hidden, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=512
    )
    return module_shapes(config)


def _missing(tmp: Path) -> Path:
    return tmp / "nowhere"


def _no_config(tmp: Path) -> Path:
    (tmp / "a").mkdir()
    shutil.copy(DIRS["qv"] / "adapter_model.safetensors", tmp / "a")
    return tmp / "a"


def _truncated(tmp: Path) -> Path:
    out = Path(shutil.copytree(DIRS["qv"], tmp / "a"))
    data = (out / "adapter_model.safetensors").read_bytes()
    (out / "adapter_model.safetensors").write_bytes(data[: len(data) - 1000])
    return out


def _random(hidden: int = 64, r: int = 8):
    def write(tmp: Path) -> Path:
        modules = list(MODULES)
        return write_random_adapter(
            tmp / "a",
            num_layers=2,
            dims=_dims(hidden),
            target_modules=modules,
            r=r,
            lora_alpha=16,
            use_rslora=False,
            seed=1,
        )

    return write


def _lm_head(tmp: Path) -> Path:
    out = Path(shutil.copytree(DIRS["qv"], tmp / "a"))
    tensors = load_file(out / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 64), np.float32)
    tensors["base_model.model.lm_head.lora_B.weight"] = np.zeros((512, 4), np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


BAD = {  # how to make it -> what the message says
    "missing path": (_missing, "not a directory"),
    "no adapter_config.json": (_no_config, "no adapter_config.json"),
    "truncated safetensors": (_truncated, "truncated"),
    "rank above max_lora_rank": (_random(r=16), "rank 16 is above max_lora_rank=8"),
    "another model's shapes": (_random(hidden=96), "do not match the base model"),
    "lm_head without its slots": (_lm_head, "adapts lm_head (base_model.model.lm_head.lora_A.weight), which the"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_refused_naming_the_problem(server, tmp_path, case):
    make, problem = BAD[case]
    path = str(make(tmp_path))
    known = adapter_names(server)
    status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
    assert status == 400 and problem in error_message(text), text
    assert json.loads(text)["error"]["param"] == "lora_path"
    with client_of(server) as client:
        err = rpc_error(client.load_lora_adapter, "bad", path, timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in err.details(), err.details()
    assert adapter_names(server) == known  # nothing else changed, and serving goes on
    assert complete(server, "all", prompt("all"), 4) == (greedy("all", 4), "all")


# --- gRPC ---------------------------------------------------------------------------------------
def test_grpc_generate_under_an_adapter(server):
    with client_of(server) as client:
        assert client.generate(prompt("all"), lora_adapter="all", max_tokens=16, timeout=60, **GREEDY).token_ids == (
            greedy("all")
        )
        assert client.generate(prompt("all"), max_tokens=16, timeout=60, **GREEDY).token_ids == greedy("all", base=True)
        err = rpc_error(client.generate, [1, 2, 3], lora_adapter="nope", max_tokens=2, timeout=30)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'nope'" in err.details() and "'all'" in err.details()
        listed = client.list_lora_adapters(timeout=30)
    assert (listed.max_loras, listed.max_lora_rank) == (2, 8)
    card = next(a for a in listed.adapters if a.name == "all")
    assert card.rank == 8 and card.path == str(DIRS["all"].resolve()) and list(card.target_modules) == list(MODULES)


def test_client_command_runs_under_an_adapter(server, capsys):
    from jaxinfer.cli import build_parser
    from serving.grpc.client_cli import cmd_client

    def run(*flags: str) -> tuple[int, str, str]:
        ids = ",".join(map(str, prompt("all")))
        args = ["client", "--server", server.address, "generate", "--token-ids", ids, "--max-tokens", "16"]
        code = cmd_client(build_parser().parse_args([*args, "--temperature", "0", "--ignore-eos", *flags]))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run("--lora", "all")
    assert code == 0 and list(map(int, out.split())) == greedy("all")
    code, out, _ = run()
    assert code == 0 and list(map(int, out.split())) == greedy("all", base=True)
    code, _, err = run("--lora", "nope")
    assert code == 1 and err.startswith("error: INVALID_ARGUMENT: ") and "'nope'" in err


def test_grpc_load_and_unload(server, lora_llm, tmp_path):
    with client_of(server) as client:
        card = client.load_lora_adapter("qv-grpc", str(DIRS["qv"]), timeout=30)
        assert (card.name, card.rank, list(card.target_modules)) == ("qv-grpc", 4, ["q_proj", "v_proj"])
        assert card.path == str(DIRS["qv"].resolve()) and "qv-grpc" in adapter_names(server)
        got = client.generate(prompt("qv"), lora_adapter="qv-grpc", max_tokens=16, timeout=60, **GREEDY)
        assert got.token_ids == greedy("qv")
        for args, code, says in (
            (("", str(DIRS["qv"])), grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path"),
            (("qv-grpc", str(DIRS["rslora"])), grpc.StatusCode.INVALID_ARGUMENT, "already loaded"),
            (("x", str(tmp_path)), grpc.StatusCode.INVALID_ARGUMENT, "no adapter_config.json"),
        ):
            err = rpc_error(client.load_lora_adapter, *args, timeout=30)
            assert err.code() == code and says in err.details(), err.details()
        err = rpc_error(client.unload_lora_adapter, "nope", timeout=30)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.details()
        with slow_steps(lora_llm.engine, 0.1):  # the stream runs some 8 steps past its first token
            stream = client.stream(prompt("qv"), lora_adapter="qv-grpc", max_tokens=64, timeout=60, **GREEDY)
            tokens = list(next(stream).outputs[0].token_ids)
            err = rpc_error(client.unload_lora_adapter, "qv-grpc", timeout=30)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "in use" in err.details()
            tokens += [t for msg in stream for t in msg.outputs[0].token_ids]
        assert tokens[:32] == greedy("qv", 32) and len(tokens) == 64
        client.unload_lora_adapter("qv-grpc", timeout=30)
        assert "qv-grpc" not in adapter_names(server)
        err = rpc_error(client.generate, prompt("qv"), lora_adapter="qv-grpc", max_tokens=2, timeout=30)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "'qv-grpc'" in err.details()


def test_an_adapter_loaded_on_one_transport_serves_on_the_other(server):
    with client_of(server) as client:
        client.load_lora_adapter("qv-both", str(DIRS["qv"]), timeout=30)
        assert complete(server, "qv-both", prompt("qv")) == (greedy("qv"), "qv-both")
        status, _, body = raw_request(http_of(server), "GET", "/v1/models")
        assert "qv-both" in [c["id"] for c in json.loads(body)["data"]]
        status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "qv-both"})
        assert status == 200, text
        err = rpc_error(client.generate, prompt("qv"), lora_adapter="qv-both", max_tokens=2, timeout=30)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "qv-both", "lora_path": str(DIRS["qv"])})
        assert status == 200, text
        got = client.generate(prompt("qv"), lora_adapter="qv-both", max_tokens=16, timeout=60, **GREEDY)
        assert got.token_ids == greedy("qv")
        client.unload_lora_adapter("qv-both", timeout=30)
    with pytest.raises(openai.NotFoundError):
        complete(server, "qv-both", prompt("qv"))


# --- metrics, request log, and the end ----------------------------------------------------------
def test_metrics_and_request_log(server):
    assert complete(server, "all", prompt("all"), 4)[0] == greedy("all", 4)
    assert complete(server, BASE, prompt("all"), 4)[0] == greedy("all", 4, base=True)
    with client_of(server) as client:
        assert client.generate(prompt("all"), lora_adapter="all", max_tokens=4, timeout=60, **GREEDY).token_ids == (
            greedy("all", 4)
        )
    http = http_of(server)
    assert wait_for(lambda: metric(http, "jaxinfer_lora_adapter_loads_total") > 0)
    text = raw_request(http, "GET", "/metrics")[2].decode()
    for line in ('jaxinfer_lora_requests_running{adapter="all"} ', 'jaxinfer_lora_requests_waiting{adapter="all"} '):
        assert line in text
    assert metric(http, "jaxinfer_lora_adapters") == len(adapter_names(server))
    assert 1 <= metric(http, "jaxinfer_lora_adapters_on_device") <= 2
    records = [json.loads(line) for line in server.request_log_path.read_text().splitlines()]
    adapters = {(r["transport"], r.get("lora_adapter")) for r in records}
    assert {("http", "all"), ("grpc", "all"), ("http", None)} <= adapters


def test_the_end_no_compiles_pages_free_and_updates_off(server, lora_llm, tiny_llm):
    engine, known = lora_llm.engine, adapter_names(server)
    server.stop()
    assert_pages_free(engine)
    assert engine.worker.num_compiled() == server.compiled_at_start  # loads, uses, unloads: no compile
    # Without lora_updates: the routes are unknown (404) and the calls refused; the adapters serve.
    with BackgroundServer(engine, ServerOptions(port=0, http_port=0, grace_period_s=2.0)) as plain:
        for path, body in (
            ("/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(DIRS["qv"])}),
            ("/v1/unload_lora_adapter", {"lora_name": "all"}),
        ):
            status, text = post(plain, path, body)
            assert status == 404 and json.loads(text)["error"]["code"] == "not_found"
        schema = json.loads(raw_request(http_of(plain), "GET", "/openapi.json")[2])
        assert "/v1/load_lora_adapter" not in schema["paths"]
        with client_of(plain) as client:
            for call, args in (
                (client.load_lora_adapter, ("qv", str(DIRS["qv"]))),
                (client.unload_lora_adapter, ("all",)),
            ):
                err = rpc_error(call, *args, timeout=30)
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "--allow-runtime-lora-updating" in err.details()
            assert [a.name for a in client.list_lora_adapters(timeout=30).adapters] == known
        assert complete(plain, "all", prompt("all"), 4) == (greedy("all", 4), "all")
    assert_pages_free(engine)
    # An engine without LoRA: loading is refused over both transports, naming --enable-lora.
    with BackgroundServer(tiny_llm.engine, ServerOptions(port=0, http_port=0, lora_updates=True)) as off:
        status, text = post(off, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(DIRS["qv"])})
        assert status == 400 and "--enable-lora" in error_message(text)
        with client_of(off) as client:
            err = rpc_error(client.load_lora_adapter, "qv", str(DIRS["qv"]), timeout=30)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" in err.details()
            assert not client.list_lora_adapters(timeout=30).adapters
            err = rpc_error(client.generate, [1, 2], lora_adapter="all", max_tokens=2, timeout=30)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--enable-lora" in err.details()
        with pytest.raises(openai.NotFoundError):
            complete(off, "all", [1, 2])
    assert_pages_free(tiny_llm.engine)
