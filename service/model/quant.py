"""Packed integer weights for torch's CPU GEMV kernels, built from GGUF blocks or dense tensors.

Two kernels exist on CPU:

- ``aten._weight_int4pack_mm_for_cpu``: 4-bit codes ``q`` in groups of 32 along K, one
  (scale, zero) pair per group and output row; it computes ``w = scale * (q - 8) + zero``.
- ``aten._weight_int8pack_mm``: int8 codes with one scale per output row, ``w = scale * q``.

GGUF's 4-bit blocks map onto the first exactly: Q4_1 stores ``w = d * q + m`` (scale ``d``,
zero ``m + 8d``) and Q4_0 ``w = d * (q - 8)`` (scale ``d``, zero 0). Q8_0 (``w = d * q``, q an
int8, blocks of 32) has no per-block int8 kernel, so it is split into two 4-bit halves of
``u = q + 128 = 16 * hi + lo``: ``w = 16d * (hi - 8) + [d * (lo - 8) + 8d]``, packed side by
side along K and applied to the input repeated twice. Q5_0 (``w = d * (q - 16)``, q five
bits) is such an int8 block too, ``q - 16`` in [-16, 15], and takes the same split. All four are
exact: the codes are the
file's, and only the scales and zeros take the compute dtype's rounding (none in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
_Q4_0_BYTES = 18  # fp16 d, 16 bytes of nibbles
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BYTES = 34  # fp16 d, 32 int8
_Q5_0_BYTES = 22  # fp16 d, 4 bytes of high bits, 16 bytes of low nibbles


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """Unpacked 4-bit weights: ``w[n, k] = scale[n, g] * (codes[n, k] - 8) + zero[n, g]``,
    ``g = k // 32``. ``repeat`` > 1 means the codes span ``repeat`` copies of the input."""

    codes: torch.Tensor  # [N, K * repeat] int32 in [0, 15]
    scale: torch.Tensor  # [N, K * repeat / 32] float32
    zero: torch.Tensor  # [N, K * repeat / 32] float32
    repeat: int = 1

    def rows(self, order: torch.Tensor) -> Int4Codes:
        """The same weights with output rows taken in ``order``."""
        return Int4Codes(self.codes[order], self.scale[order], self.zero[order], self.repeat)

    def dequantize(self) -> torch.Tensor:
        """The dense ``[N, K]`` float32 weight these codes stand for (used by tests)."""
        n, kr = self.codes.shape
        grouped = (self.codes.float() - 8).view(n, -1, GROUP) * self.scale[..., None]
        w = (grouped + self.zero[..., None]).view(n, kr)
        return w.view(n, self.repeat, kr // self.repeat).sum(dim=1)


def concat_rows(parts: list[Int4Codes]) -> Int4Codes:
    """Stack several weights' output rows (all with the same K and repeat)."""
    if len({p.repeat for p in parts}) != 1:
        raise ValueError("cannot concatenate int4 weights with different input repeats")
    return Int4Codes(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
        parts[0].repeat,
    )


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)


def _f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(
        blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    )


def _nibbles(qs: np.ndarray, rows: int) -> torch.Tensor:
    # ggml stores element j of a block in the low nibble of byte j and element j+16 in the high one.
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)
    return torch.from_numpy(q.reshape(rows, -1))


def from_q4_0(data: np.ndarray, rows: int) -> Int4Codes:
    b = _blocks(data, rows, _Q4_0_BYTES)
    d = _f16(b, 0)
    return Int4Codes(_nibbles(b[..., 2:], rows), d, torch.zeros_like(d))


def from_q4_1(data: np.ndarray, rows: int) -> Int4Codes:
    b = _blocks(data, rows, _Q4_1_BYTES)
    d, m = _f16(b, 0), _f16(b, 2)
    return Int4Codes(_nibbles(b[..., 4:], rows), d, m + 8 * d)


def _int8_codes(q: torch.Tensor, d: torch.Tensor, rows: int) -> Int4Codes:
    """``w = d * q`` for int8 ``q`` ``[N, G, 32]`` (int32) and scales ``d`` ``[N, G]``: the
    two 4-bit halves of ``u = q + 128``, side by side along K (``repeat`` 2)."""
    u = q + 128
    hi, lo = (u >> 4).reshape(rows, -1), (u & 15).reshape(rows, -1)
    scale = torch.cat([16 * d, d], dim=1)
    zero = torch.cat([torch.zeros_like(d), 8 * d], dim=1)
    return Int4Codes(torch.cat([hi, lo], dim=1), scale, zero, repeat=2)


def from_q8_0(data: np.ndarray, rows: int) -> Int4Codes:
    b = _blocks(data, rows, _Q8_0_BYTES)
    q = torch.from_numpy(b[..., 2:].copy().view(np.int8).astype(np.int32))  # [N, G, 32]
    return _int8_codes(q, _f16(b, 0), rows)


def from_q5_0(data: np.ndarray, rows: int) -> Int4Codes:
    """Q5_0 as the int8 blocks ``q - 16``: element j's low four bits are byte j's low nibble
    (j < 16) or byte j - 16's high one, its fifth bit is bit j of the little-endian ``qh``."""
    b = _blocks(data, rows, _Q5_0_BYTES)
    qh = b[..., 2:6].copy().view("<u4").astype(np.int64)  # [N, G, 1]
    low = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1).astype(np.int64)
    high = (qh >> np.arange(32)) & 1
    q = torch.from_numpy((low | (high << 4)) - 16)
    return _int8_codes(q.to(torch.int32), _f16(b, 0), rows)


_QK_K = 256  # elements of a K-quant super-block
_Q4_K_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128 of nibbles
_Q6_K_BYTES = 210  # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d


@dataclass(frozen=True, slots=True)
class KBlocks:
    """A GGUF K-quant tensor's own codes with float32 sub-block scales. Each sub-block's
    scale (and minimum) is the super-block's fp16 scale times its 6-bit (Q4_K) or int8 (Q6_K)
    integer, a float32 product without rounding (11 + 8 significant bits), so the codes and
    scales are the file's, exactly:

    - 4-bit (Q4_K): ``w = scale[n, g] * q + minimum[n, g]``, q in [0, 15], g = k // 32;
    - 8-bit (Q6_K): ``w = scale[n, h] * q``, q in [-32, 31], h = k // 16, minimum None.
    """

    codes: torch.Tensor  # [N, K] int32
    scale: torch.Tensor  # [N, K / 32] (4-bit) or [N, K / 16] (8-bit) float32
    minimum: torch.Tensor | None  # [N, K / 32] float32 (4-bit), None (8-bit)

    @property
    def eight_bit(self) -> bool:
        return self.minimum is None

    @property
    def sub(self) -> int:
        """Elements per scale."""
        return 16 if self.eight_bit else GROUP

    def rows(self, order: torch.Tensor) -> KBlocks:
        """The same weights with output rows taken in ``order``."""
        minimum = None if self.minimum is None else self.minimum[order]
        return KBlocks(self.codes[order], self.scale[order], minimum)

    def exact(self) -> torch.Tensor:
        """The dense ``[N, K]`` weights in float64, each exactly ``scale * q + minimum``."""
        n, k = self.codes.shape
        w = self.codes.double().view(n, -1, self.sub) * self.scale.double()[..., None]
        if self.minimum is not None:
            w = w + self.minimum.double()[..., None]
        return w.view(n, k)


def concat_k(parts: list[KBlocks]) -> KBlocks | None:
    """Several K-quant weights' output rows stacked, or None where their kinds differ."""
    if len({p.eight_bit for p in parts}) != 1 or len({p.codes.shape[1] for p in parts}) != 1:
        return None
    minima = [p.minimum for p in parts if p.minimum is not None]
    return KBlocks(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat(minima) if minima else None,
    )


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)  # [B, 1]


def from_q4_k(data: np.ndarray, rows: int) -> KBlocks:
    """Q4_K: per super-block of 256, 8 sub-blocks of 32 with a 6-bit scale and minimum
    (packed 12 bytes: the first four of each in the low six bits of bytes 0-3 and 4-7, the
    last four in bytes 8-11's nibbles with their top two bits in those bytes' top bits);
    chunk c's 32 bytes hold sub-block 2c in their low nibbles and 2c + 1 in their high."""
    b = np.ascontiguousarray(data).reshape(-1, _Q4_K_BYTES)
    d, dmin = _halves(b, 0), _halves(b, 2)
    sc_bytes = b[:, 4:16].reshape(-1, 3, 4)
    lo, mid, top = sc_bytes[:, 0], sc_bytes[:, 1], sc_bytes[:, 2]
    sc = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, -1).astype(np.int32)
    scale = (d * sc.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin * mn.astype(np.float32)).reshape(rows, -1)
    return KBlocks(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(minimum))


def from_q6_k(data: np.ndarray, rows: int) -> KBlocks:
    """Q6_K: per super-block of 256, 16 sub-blocks of 16 with an int8 scale; a value's low
    four bits in ``ql`` (each 128-element half: 64 bytes, low nibbles then high), its top two
    in ``qh`` (32 bytes a half, four 2-bit fields a byte), q - 32."""
    b = np.ascontiguousarray(data).reshape(-1, _Q6_K_BYTES)
    low = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 1, 4, 1
    )
    ql, qh = (low & 0x0F).reshape(-1, 8, 32), (high & 0x03).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).astype(np.int32) - 32
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    scale = _halves(b, 208) * sc
    return KBlocks(
        torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(scale.reshape(rows, -1)), None
    )


def quantize_int4(w: torch.Tensor) -> Int4Codes:
    """Asymmetric 4-bit, groups of 32 (min/max per group): lossy, for weights stored wider."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return Int4Codes(codes.reshape(n, k), scale, lo + 8 * scale)


@dataclass(frozen=True, slots=True)
class Int4Linear:
    """``x @ w.T`` through the packed int4 GEMV; ``x`` is ``[M, K]`` in the compute dtype."""

    packed: torch.Tensor  # [N, K * repeat / 2] uint8, the kernel's own layout
    scales_zeros: torch.Tensor  # [K * repeat / 32, N, 2]
    repeat: int

    @classmethod
    def pack(cls, w: Int4Codes, dtype: torch.dtype) -> Int4Linear:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.contiguous(), 1)
        sz = torch.stack([w.scale, w.zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(packed, sz, w.repeat)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.repeat > 1:
            x = x.repeat(1, self.repeat)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scales_zeros
        )
        return out

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """``x @ w.T`` through the int8 GEMV: symmetric, one scale per output row (lossy)."""

    weight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] compute dtype

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype) -> Int8Linear:
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.to(dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes
