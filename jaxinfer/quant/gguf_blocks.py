"""GGUF quantized blocks -> one integer per weight plus per-group float scales (and offsets).

Each block type is decoded on the host into the values gguf's own dequantizer multiplies, so
that `q * scale (+ offset)` in float32 is the float it computes, bit for bit:

    type   block  integers q            group  scale (dtype)          added
    Q8_0   32     int8                  32     d (f16)                -
    Q4_0   32     0..15 (4 bits)        32     d (f16)                zero point 8: (q - 8) * d
    Q4_1   32     0..15 (4 bits)        32     d (f16)                + m (f16)
    Q5_0   32     -16..15 (int8)        32     d (f16)                -
    Q5_1   32     0..31 (int8)          32     d (f16)                + m (f16)
    Q4_K   256    0..15 (4 bits)        32     d * sc (f32)           - dmin * m (f32)
    Q5_K   256    0..31 (int8)          32     d * sc (f32)           - dmin * m (f32)
    Q6_K   256    -32..31 (int8)        16     d * sc (f32)           -

The K-quants' two levels (a float16 per 256-weight super-block times a 6- or 8-bit integer per
sub-block) are folded into one float32 per sub-block, computed as gguf computes it; the products
q * scale are exact in float32 (at most 24 significant bits), so an XLA-fused multiply-add
rounds as gguf's separate multiply and add do.

Arrays keep the tensor's own row-major shape ([.., n] with n the contiguous, blocked axis):
`integers` [.., n], `scales` / `zeros` / `offsets` [.., n / group].
"""

from __future__ import annotations

import dataclasses

import numpy as np

QK = 32  # weights per block of the legacy types
QK_K = 256  # weights per super-block of the K-quants
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
SUPPORTED = tuple(BLOCK_BYTES)


@dataclasses.dataclass(frozen=True)
class Blocks:
    integers: np.ndarray  # int8 or uint8 [.., n]
    scales: np.ndarray  # float16 or float32 [.., n / group]
    zeros: np.ndarray | None  # integer zero points (subtracted before scaling) or None
    offsets: np.ndarray | None  # added after scaling, or None
    group: int
    bits: int  # 4: integers in 0..15 (packed two per byte once repacked); 8: stored as int8


def _f16(column: np.ndarray) -> np.ndarray:
    """Two bytes per block -> the float16 they hold, [nb, 1]."""
    return np.ascontiguousarray(column).view(np.float16)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes [nb, m] whose low nibbles hold `run` weights and high nibbles the next `run`, for each
    `run` bytes -> [nb, 2m] in weight order."""
    nb = qs.shape[0]
    runs = qs.reshape(nb, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(nb, -1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: four bytes, bit j (little-endian) is weight j's fifth bit -> [nb, 32]."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The twelve bytes of 6-bit sub-block scales and mins of Q4_K / Q5_K -> ([nb, 8], [nb, 8]):
    bytes 0-3 / 4-7 hold scales / mins 0-3 in their low six bits and the top two bits of
    scales / mins 4-7; bytes 8-11 hold the low four bits of scales 4-7 (low nibble) and mins
    4-7 (high nibble)."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _legacy(kind: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, int]:
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 blocks [nb, bytes] -> (q, d, zeros, m, bits)."""
    d = _f16(b[:, 0:2])
    if kind == "Q8_0":
        return np.ascontiguousarray(b[:, 2:]).view(np.int8), d, None, None, 8
    if kind == "Q4_0":
        return _nibbles(b[:, 2:], 16), d, np.full_like(d, 8), None, 4
    if kind == "Q4_1":
        return _nibbles(b[:, 4:], 16), d, None, _f16(b[:, 2:4]), 4
    if kind == "Q5_0":
        q = _nibbles(b[:, 6:], 16) | (_high_bits32(b[:, 2:6]) << 4)
        return (q.astype(np.int8) - np.int8(16)), d, None, None, 8
    q = _nibbles(b[:, 8:], 16) | (_high_bits32(b[:, 4:8]) << 4)  # Q5_1
    return q.astype(np.int8), d, None, _f16(b[:, 2:4]), 8


def _k_quant(kind: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """Q4_K, Q5_K, Q6_K super-blocks [nb, bytes] -> (q, scales, offsets, group, bits)."""
    nb = b.shape[0]
    if kind == "Q6_K":
        low = _nibbles(b[:, :128], 64).reshape(nb, 8, 32)
        high: np.ndarray = (
            b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        q = (low | (high.reshape(nb, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
        scales = _f16(b[:, 208:210]).astype(np.float32) * sc
        return q.reshape(nb, QK_K), scales, None, 16, 8
    d, dmin = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    sc, mn = _k_scale_min(b[:, 4:16])
    scales, offsets = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    if kind == "Q4_K":
        return _nibbles(b[:, 16:], 32), scales, offsets, 32, 4
    bits = np.unpackbits(np.ascontiguousarray(b[:, 16:48]), axis=-1, bitorder="little")  # Q5_K
    high = bits.reshape(nb, 32, 8).transpose(0, 2, 1).reshape(nb, QK_K)  # bit i of byte k: [i, k]
    return (_nibbles(b[:, 48:], 32) | (high << 4)).astype(np.int8), scales, offsets, 32, 8


def decode(kind: str, data: np.ndarray, shape: tuple[int, ...]) -> Blocks:
    """A tensor of GGUF type `kind` (one of SUPPORTED): its raw bytes -> Blocks in `shape`."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} is not one of {list(SUPPORTED)}")
    blocks = np.asarray(data, np.uint8).reshape(-1, BLOCK_BYTES[kind])
    if kind.endswith("_K"):
        q, scales, offsets, group, bits = _k_quant(kind, blocks)
        zeros: np.ndarray | None = None
    else:
        q, scales, zeros, offsets, bits = _legacy(kind, blocks)
        group = QK
    n = shape[-1]
    if q.size != int(np.prod(shape)) or n % group:
        raise ValueError(f"{kind} blocks of {q.size} weights do not fill the shape {tuple(shape)}")
    grouped = tuple(shape[:-1]) + (n // group,)
    reshape = lambda a: None if a is None else a.reshape(grouped)  # noqa: E731
    return Blocks(q.reshape(shape), scales.reshape(grouped), reshape(zeros), reshape(offsets), group, bits)
