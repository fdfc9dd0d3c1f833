"""impl selection: auto by backend, one warning per fallback cause, ValueError when explicit."""

import logging

import jax
import numpy as np
import pytest
from rpa_cases import make_case

import pallas_kernels
from pallas_kernels import dispatch
from pallas_kernels.reference import ragged_paged_attention_reference


@pytest.fixture(autouse=True)
def _fresh_warnings():
    dispatch._warned.clear()
    yield
    dispatch._warned.clear()


def _call(case, **kw):
    return pallas_kernels.ragged_paged_attention(*case.args(), **case.scales(), sm_scale=0.1, **kw)


def test_auto_resolves_by_backend():
    assert dispatch.resolve_impl("auto", "tpu") == "pallas_tpu"
    assert dispatch.resolve_impl("auto", "gpu") == "pallas_gpu"
    assert dispatch.resolve_impl("auto", "cpu") == "reference"
    assert dispatch.resolve_impl("pallas_gpu", "cpu") == "pallas_gpu"
    with pytest.raises(ValueError, match="pallas_cuda"):
        dispatch.resolve_impl("pallas_cuda")


def test_auto_on_cpu_is_the_reference():
    case = make_case(q_lens=[2, 1], kv_lens=[9, 4])
    out, cache = _call(case)
    want, want_cache = ragged_paged_attention_reference(*case.args(), sm_scale=0.1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_explicit_kernel_off_platform_runs_interpreted(impl, caplog):
    case = make_case(q_lens=[2, 1], kv_lens=[9, 4], page_size=8)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.dispatch"):
        out, _ = _call(case, impl=impl)
    want, _ = ragged_paged_attention_reference(*case.args(), sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert any("interpret mode" in r.message for r in caplog.records)


# Head dims each kernel cannot take: the GPU kernel wants multiples of 8, the TPU kernel 64/128/256.
UNSUPPORTED_HEAD_DIMS = {"pallas_gpu": (36, 12), "pallas_tpu": (80, 48)}


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_explicit_kernel_on_unsupported_shape_raises(impl):
    head_dim = UNSUPPORTED_HEAD_DIMS[impl][0]
    case = make_case(q_lens=[2], kv_lens=[5], head_dim=head_dim)
    with pytest.raises(ValueError, match=f"head_dim={head_dim}"):
        _call(case, impl=impl)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_falls_back_with_one_warning_per_cause(backend, monkeypatch, caplog):
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
    first, second = UNSUPPORTED_HEAD_DIMS[f"pallas_{backend}"]
    case_a = make_case(q_lens=[2], kv_lens=[5], head_dim=first)
    case_b = make_case(q_lens=[2], kv_lens=[5], head_dim=second)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.dispatch"):
        for case in (case_a, case_a, case_b, case_b):
            out, _ = _call(case)
            want, _ = ragged_paged_attention_reference(*case.args(), sm_scale=0.1)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    messages = [r.message for r in caplog.records if r.name == "pallas_kernels.dispatch"]
    assert len(messages) == 2, messages
    assert f"head_dim={first}" in messages[0] and f"head_dim={second}" in messages[1]


def test_bad_arguments_are_value_errors():
    case = make_case(q_lens=[2], kv_lens=[5], cache_dtype="int8")
    with pytest.raises(ValueError, match="k_scale"):
        pallas_kernels.ragged_paged_attention(*case.args(), sm_scale=0.1)
    case = make_case(q_lens=[2], kv_lens=[5])
    with pytest.raises(ValueError, match="sliding_window"):
        _call(case, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        _call(case, soft_cap=0.0)


def test_inside_jit_with_traced_metadata():
    case = make_case(q_lens=[3, 1], kv_lens=[12, 7])
    f = jax.jit(lambda *a: pallas_kernels.ragged_paged_attention(*a, sm_scale=0.1, impl="pallas_gpu"))
    out, _ = f(*case.args())
    want, _ = ragged_paged_attention_reference(*case.args(), sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
