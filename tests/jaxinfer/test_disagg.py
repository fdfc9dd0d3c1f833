"""Disaggregated prefill/decode between two engines in one process (two transfer servers and side
channels on loopback): the decode engine's greedy outputs are a single engine's, from pulled pages
(its steps compute only each prompt's last token and the outputs); every failure -- the offer
expired, its server gone, another prompt, a malformed ticket -- ends in the prompt computed
there; the pages on both sides are all free at the end."""

import json
import subprocess
import sys
import time

import pytest
from engine_runs import run_requests
from testpaths import FIXTURES
from xla_env import child_env

from jaxinfer.config import EngineConfig
from jaxinfer.core.requests import RequestError
from jaxinfer.engine import Engine
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

CONFIG = dict(
    max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), page_size=4, num_pages=96
)
PROMPTS = [list(range(3, 8)), list(range(10, 27)), [(7 * i) % 200 + 1 for i in range(41)]]
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None}


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)


_OPENED: list[Engine] = []


def _engine(model, **options):
    engine = Engine(model, EngineConfig(**CONFIG, penalties=False, **options), warm_up=False)
    _OPENED.append(engine)
    return engine


@pytest.fixture(scope="module", autouse=True)
def _close_connectors():
    """The module's offers stop expiring (and warning) once it is done, not in a later test."""
    yield
    for engine in _OPENED:
        engine.disagg.close()


@pytest.fixture(scope="module")
def engines(model):
    return _engine(model, kv_role="prefill"), _engine(model, kv_role="decode", kv_transfer_timeout=1.5)


def _run(engine, requests):
    """[(prompt, params, kv_transfer_params)] queued at once: the final outputs, in order."""
    return run_requests(engine, [(p, params, {"kv_transfer_params": kv}) for p, params, kv in requests])


def _all_free(engine):
    return engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages


def _wait(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _prefill(engine, prompts, n=1):
    params = SamplingParams(temperature=0, max_tokens=1, n=n)
    outs = _run(engine, [(p, params, dict(PREFILL)) for p in prompts])
    return [out.kv_transfer_params for out in outs]


def test_decode_from_pulled_pages_is_a_single_engines_output(model, engines):
    prefill, decode = engines
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _engine(model)  # one engine doing both
    want = [o.outputs[0].token_ids for o in _run(plain, [(p, greedy, None) for p in PROMPTS])]
    tickets = _prefill(prefill, PROMPTS)
    assert all(t["do_remote_prefill"] and t["num_tokens"] == len(p) for t, p in zip(tickets, PROMPTS))
    assert [sum(t.count("1") for t in ticket["tables"]) for ticket in tickets] == [2, 5, 11]
    before = decode.num_scheduled_tokens
    got = _run(decode, [(p, greedy, t) for p, t in zip(PROMPTS, tickets)])
    assert [o.outputs[0].token_ids for o in got] == want
    # the prompts came as pages: the steps computed each prompt's last token, the outputs (and a
    # step of overrun each at most), not the 60 other prompt tokens the plain engine computed
    assert plain.num_scheduled_tokens >= 63 + 24
    assert 24 <= decode.num_scheduled_tokens - before <= 3 * (8 + 2)
    stats = decode.stats()
    assert stats["kv_transfer_pulls"] == 3 and stats["kv_transfer_pages_pulled"] == 18
    assert stats["kv_transfer_recomputed"] == 0
    assert _wait(lambda: prefill.stats()["kv_transfer_offers_held"] == 0)  # released as pulled
    assert _all_free(prefill) and _all_free(decode)


def test_n_samples_share_the_pulled_prompt(model, engines):
    prefill, decode = engines
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, n=3, ignore_eos=True)
    (ticket,) = _prefill(prefill, [prompt], n=3)
    (got,) = _run(decode, [(prompt, params, ticket)])
    (want,) = _run(_engine(model), [(prompt, params, None)])
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert _all_free(decode) and _wait(lambda: _all_free(prefill))


def test_what_cannot_be_pulled_is_computed_here(model, engines):
    prefill, decode = engines
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = _run(_engine(model), [(PROMPTS[2], greedy, None)])[0].outputs[0].token_ids
    (ticket,) = _prefill(prefill, [PROMPTS[2]])
    recomputed = decode.stats()["kv_transfer_recomputed"]
    # another prompt than the prefill computed: refused by its hash, computed here
    other = _run(decode, [(PROMPTS[2][:-1] + [9], greedy, ticket)])[0]
    assert decode.stats()["kv_transfer_recomputed"] == recomputed + 1 and other.finished
    # the offer itself, released by nobody: expired (a short TTL), then asked for
    short = _engine(model, kv_role="prefill", kv_transfer_ttl=0.2)
    (expired,) = _prefill(short, [PROMPTS[2]])
    assert _wait(lambda: short.stats()["kv_transfer_offers_expired"] == 1)
    got = _run(decode, [(PROMPTS[2], greedy, expired)])[0].outputs[0].token_ids
    assert got == want and decode.stats()["kv_transfer_recomputed"] == recomputed + 2
    # its server gone: nobody answers the claim (a port nothing listens on) in the timeout
    gone = dict(ticket, remote_port=1)
    start = time.monotonic()
    assert _run(decode, [(PROMPTS[2], greedy, gone)])[0].outputs[0].token_ids == want
    assert time.monotonic() - start < 10 and decode.stats()["kv_transfer_recomputed"] == recomputed + 3
    assert _all_free(decode)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"do_remote_prefill": True}, r"kv_transfer_params.remote_host=None: a decode request needs it"),
        ("yes", r"kv_transfer_params='yes': expected a JSON object"),
        ({"do_remote_decode": "yes"}, r"kv_transfer_params.do_remote_decode='yes': expected true or false"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "either prefilled here .* or decoded here"),
    ],
)
def test_malformed_params_are_refused_by_name(engines, params, match):
    with pytest.raises(RequestError, match=match):
        engines[1].check_request([1, 2, 3], SamplingParams(), kv_transfer_params=params)


def test_a_role_takes_its_own_side_only(engines):
    prefill, decode = engines
    with pytest.raises(RequestError, match="kv_role is decode, not prefill"):
        decode.check_request([1, 2, 3], SamplingParams(max_tokens=1), kv_transfer_params=dict(PREFILL))
    ticket = _prefill(prefill, [PROMPTS[0]])[0]
    with pytest.raises(RequestError, match="kv_role is prefill, not decode"):
        prefill.check_request(PROMPTS[0], SamplingParams(), kv_transfer_params=ticket)
    bad = dict(ticket, widths=[3])
    with pytest.raises(RequestError, match=r"kv_transfer_params.widths=\[3\]: each width must be a power of two"):
        decode.check_request(PROMPTS[0], SamplingParams(), kv_transfer_params=bad)


RESHARD = """
import json
import sys
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

model = load_model(sys.argv[1], dtype="float32", with_tokenizer=False)
config = json.loads(sys.argv[2])
prefill = Engine(model, EngineConfig(**config, mesh="tensor=2", kv_role="prefill"), warm_up=False)
decode = Engine(model, EngineConfig(**config, kv_role="decode"), warm_up=False)
prompt = [(5 * i) % 300 + 2 for i in range(23)]
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

def run(engine, params, kv):
    engine.add_request(prompt, params, request_id="a", kv_transfer_params=kv)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if final is None else (final.merge(out) or final)
    return final

ticket = run(prefill, SamplingParams(temperature=0, max_tokens=1), {"do_remote_decode": True}).kv_transfer_params
got = run(decode, greedy, ticket).outputs[0].token_ids
want = run(Engine(model, EngineConfig(**config), warm_up=False), greedy, None).outputs[0].token_ids
stats = decode.stats()
shards = len(prefill.worker.state.mesh.devices.flat)
print(got == want, stats["kv_transfer_pulls"], stats["kv_transfer_recomputed"], shards)
"""


def test_pages_are_resharded_on_arrival():
    """A prefill engine whose cache is split over tensor=2 (its KV heads on two devices) and a
    decode engine on one device: the pages cross, the outputs are a single engine's."""
    done = subprocess.run(
        [sys.executable, "-c", RESHARD, str(FIXTURES / "hf" / "llama3"), json.dumps({**CONFIG, "penalties": False})],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(devices=2),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "1", "0", "2"], done.stdout + done.stderr[-2000:]


def test_the_python_api_carries_the_params(model):
    """LLM.generate takes kv_transfer_params per prompt as vLLM's requests carry them."""
    prefill = LLM(model, warm_up=False, kv_role="prefill", **CONFIG, penalties=False)
    decode = LLM(model, warm_up=False, kv_role="decode", **CONFIG, penalties=False)
    _OPENED.extend([prefill.engine, decode.engine])
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = prefill.generate(
        PROMPTS[:2], SamplingParams(max_tokens=1), kv_transfer_params=dict(PREFILL), use_tqdm=False
    )
    tickets = [out.kv_transfer_params for out in first]
    got = decode.generate(PROMPTS[:2], greedy, kv_transfer_params=tickets, use_tqdm=False)
    want = decode.generate(PROMPTS[:2], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert decode.engine.stats()["kv_transfer_pulls"] == 2
    with pytest.raises(ValueError, match="1 kv_transfer_params for 2 prompts"):
        decode.generate(PROMPTS[:2], greedy, kv_transfer_params=tickets[:1], use_tqdm=False)


def test_a_model_with_sliding_window_layers_moves_every_groups_pages():
    """Gemma 3's layers read pages through several tables (full attention, sliding windows that
    give back what falls out of them): each table's pages cross, the windows' gaps as gaps."""
    gemma = load_model(FIXTURES / "hf" / "gemma3", dtype="float32", with_tokenizer=False)
    prefill, decode, plain = (_engine(gemma, **role) for role in ({"kv_role": "prefill"}, {"kv_role": "decode"}, {}))
    prompt = [(11 * i) % 200 + 3 for i in range(37)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (ticket,) = _prefill(prefill, [prompt])
    assert len(ticket["tables"]) > 1 and "0" in "".join(ticket["tables"])  # groups, and windows' gaps
    (got,) = _run(decode, [(prompt, greedy, ticket)])
    (want,) = _run(plain, [(prompt, greedy, None)])
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert decode.stats()["kv_transfer_pulls"] == 1 and _all_free(decode)


def test_copies_held_for_pulls_stay_under_half_the_pool(model):
    """Offers nobody pulls (a flood of prefills) are given up oldest first past half the pool's
    pages, not held for their whole TTL."""
    prefill = _engine(model, kv_role="prefill")
    cap = prefill.kv_cache.num_usable_pages // 2
    prompts = [[(3 * i + j) % 400 + 1 for j in range(41)] for i in range(6)]  # 11 pages each
    assert all(sum(t.count("1") for t in x["tables"]) == 11 for x in _prefill(prefill, prompts))
    assert 6 * 11 > cap and _wait(lambda: prefill.stats()["kv_transfer_offers_held"] == cap // 11)
    assert prefill.stats()["kv_transfer_offers_expired"] == 6 - cap // 11
