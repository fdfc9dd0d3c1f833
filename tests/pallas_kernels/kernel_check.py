"""How the kernel tests run a kernel and judge it: each kernel's runner, the XLA reference (at
full float32 precision), and `check`, which compares the output and the written cache."""

import functools

import jax
import jax.numpy as jnp
import kernel_mode
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import gpu, tpu
from pallas_kernels.reference import ragged_paged_attention_reference

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 3e-2}
# Compiled float32: full-precision dots, but the device's exp and reciprocal are approximate.
COMPILED_TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2}


def run_gpu(case, config=None, **opts):
    return gpu.ragged_paged_attention_gpu(
        *case.args(), **case.scales(), **opts, config=config, interpret=not kernel_mode.compiled("gpu")
    )


def run_tpu(case, config=None, interpret=None, **opts):
    if interpret is not None or kernel_mode.compiled("tpu"):
        return tpu.ragged_paged_attention_tpu(
            *case.args(), **case.scales(), **opts, config=config, interpret=interpret or False
        )
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):  # as a user would
        return tpu.ragged_paged_attention_tpu(*case.args(), **case.scales(), **opts, config=config)


KERNELS = {"gpu": run_gpu, "tpu": run_tpu}


@functools.cache
def _reference(sm_scale, sliding_window, soft_cap):
    return jax.jit(
        functools.partial(
            ragged_paged_attention_reference, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    )


def reference(case, sm_scale=0.125, sliding_window=None, soft_cap=None):
    with jax.default_matmul_precision("highest"):  # no TF32 in the oracle of a compiled kernel
        return _reference(sm_scale, sliding_window, soft_cap)(*case.args(), **case.scales())


def check(kernel, case, *, config=None, sm_scale=0.125, sliding_window=None, soft_cap=None):
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    compiled = kernel_mode.compiled(kernel)
    want_out, want_cache = reference(case, **opts)
    out, cache = KERNELS[kernel](case, config=config, **opts)
    out = np.asarray(jnp.asarray(out, jnp.float32))
    want_out = np.asarray(jnp.asarray(want_out, jnp.float32))
    assert out.shape == case.q.shape and not np.isnan(out).any()
    tol = (COMPILED_TOL if compiled else TOL)[jnp.dtype(case.q.dtype)]
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    num_real = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert not out[num_real:].any(), "padding tokens must get zeros"
    np.testing.assert_array_equal(
        np.asarray(jnp.asarray(cache).astype(jnp.float32)), np.asarray(jnp.asarray(want_cache).astype(jnp.float32))
    )
    return out
