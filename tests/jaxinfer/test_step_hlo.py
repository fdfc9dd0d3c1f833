"""What the compiled step does, read from XLA's optimized HLO (reference attention, CPU)."""
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.loader import LoadedModel
from jaxinfer.models.registry import get_family
from jaxinfer.runner import ModelRunner

CONFIG = ModelConfig(model_type="llama", family="llama", vocab_size=256, hidden_size=64,
                     intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def model():
    family = get_family("llama")
    params = family.init_params(CONFIG, jax.random.key(0))
    return LoadedModel(CONFIG, params, None, family, Path("random"))


def compiled_step(model, bucket: int, **engine) -> tuple[str, ModelRunner]:
    config = EngineConfig(page_size=16, max_num_batched_tokens=8, max_num_seqs=8, token_buckets=(1, 8),
                          penalties=False, compilation_cache_dir=None, **engine)
    runner = ModelRunner(model, config, config.max_model_len)
    inputs = runner.padding_inputs(bucket, False)
    return runner._step.lower(runner.params, runner.kv_caches, inputs).compile().as_text(), runner


def cache_copies(hlo: str, cache_shape: tuple[int, ...]) -> list[str]:
    """Copies (or copy-starts) in the entry computation of an array as large as a layer's cache."""
    size = int(np.prod(cache_shape))
    entry = hlo[hlo.index("\nENTRY"):]
    found = []
    for line in entry.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\S* (copy|copy-start)\(", line)
        if m and m.group(1) and int(np.prod([int(d) for d in m.group(1).split(",")])) == size:
            found.append(line.strip()[:120])
    return found


@pytest.mark.parametrize("max_model_len", [512, 8192])
@pytest.mark.parametrize("bucket", [1, 8])
def test_the_step_never_copies_a_layers_cache(model, max_model_len, bucket):
    """The cache is donated and updated in place: a decode step's cost follows the batch's
    contexts, not the pool (a one-token write used to copy every layer's cache each step)."""
    hlo, runner = compiled_step(model, bucket, max_model_len=max_model_len, num_pages=300)
    assert not cache_copies(hlo, runner.kv_caches[0].shape)
