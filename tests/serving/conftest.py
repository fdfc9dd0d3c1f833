"""Servers over a real loopback socket (127.0.0.1, any free port) around one tiny engine.

`tiny_llm` is an LLM over the random-weight Llama fixture (token-id prompts only, warm-up of a
few seconds); `serve(**options)` starts a BackgroundServer around its engine and stops it after
the test, then checks that every KV page is free again. One engine serves the whole package,
one server at a time: a stopped server's engine loop has let go of the engine.
"""

import sys
from pathlib import Path

import pytest
from testpaths import FIXTURES

sys.path.insert(0, str(Path(__file__).parent))

from serving_support import assert_pages_free  # noqa: E402

from jaxinfer.llm import LLM  # noqa: E402
from serving.server import BackgroundServer, ServerOptions  # noqa: E402

TINY = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 32), num_pages=48)


@pytest.fixture(scope="package")
def tiny_llm():
    return LLM(str(FIXTURES / "hf" / "llama3"), "float32", **TINY)


@pytest.fixture
def serve(tiny_llm):
    servers = []

    def start(engine=None, **options):
        options = {"port": 0, "grace_period_s": 2.0, **options}
        server = BackgroundServer(engine or tiny_llm.engine, ServerOptions(**options)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    for server in servers:
        assert_pages_free(server.server.engine_loop.engine)
