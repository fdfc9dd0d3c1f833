"""Sliding-window layers keep only their window (golden file of tools/make_window_reference.py):
on the tiny random Gemma 3 (sliding and full layers mixed), Gemma 2 (alternating) and Mistral
(every layer slides) checkpoints, prompts and continuations many windows long give HF's greedy
tokens, twice (the second pass served from the prefix cache), while each sliding-window group
holds at most the pages its window and the step's chunk reach; every page free at the end."""

import json

import pytest
from engine_runs import run_requests
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

GOLDEN = json.loads((FIXTURES / "sliding_window.json").read_text())
PAGE, CHUNK = 4, 16
SMALL = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=CHUNK, token_buckets=(8, CHUNK), page_size=PAGE)


def _run(engine, prompts, max_tokens, watch=None):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in run_requests(engine, [(p, params) for p in prompts], watch)]


LAYOUTS = {  # (group windows, caches): gemma3's layers S S F S, gemma2's S F S, mistral's S S
    "gemma3": ((None, 8, 8, 8), 1),
    "gemma2": ((None, 8, 8), 1),
    "mistral": ((16,), 2),
}


@pytest.mark.parametrize("name", sorted(GOLDEN["models"]))
def test_window_many_times_over_gives_hf_tokens(name):
    case = GOLDEN["models"][name]
    model = load_model(FIXTURES / "hf" / name, dtype="float32", with_tokenizer=False)
    engine = Engine(model, EngineConfig(**SMALL, num_pages=400, penalties=False))  # no cached page evicted
    windows, num_caches = LAYOUTS[name]
    assert (engine.worker.kv_layout.windows, len(engine.worker.state.kv_caches)) == (windows, num_caches)
    kv = engine.kv_cache
    held = {w: 0 for w in windows}

    def watch(engine):
        for seq in engine.scheduler.running:
            for w, table in zip(windows, seq.page_tables()):
                pages = sum(p != 0 for p in table)
                held[w] = max(held[w], pages)
                if w is not None:  # positions s - w + 1 .. s + chunk - 1, one page more mid-page
                    assert pages <= -(-(w - 1 + CHUNK) // PAGE) + 1, (seq, table)
                else:
                    assert pages == len(table), (seq, table)  # a full-attention group gives nothing back

    for attempt in range(2):
        hits = kv.prefix_cache_hits
        got = _run(engine, case["prompts"], GOLDEN["new_tokens"], watch)
        assert got == case["outputs"]
        if attempt:  # every prompt's full pages (but its last token's) came from the cache
            assert kv.prefix_cache_hits - hits == sum((len(p) - 1) // PAGE * PAGE for p in case["prompts"])
    longest = max(len(p) for p in case["prompts"]) + GOLDEN["new_tokens"]
    for w in windows:  # a sliding group held a window's worth, the full group all its context
        assert held[w] == (-(-longest // PAGE) if w is None else -(-(w - 1 + CHUNK) // PAGE) + 1), held
    assert kv.num_free_pages == kv.num_usable_pages
