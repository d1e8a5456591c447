"""The 4-bit GEMV for float32 activations (``kvf.c`` and its parts), compiled on first use.

torch's ``_weight_int4pack_mm_for_cpu`` is fast only with bf16/fp16 activations; CPUs
without AVX512-BF16 compute in float32, where that kernel is slower than the dense matmul,
so ``--weights auto`` used to fall back to dense float32 there and read ~6x the bytes a
token. This kernel reads the 4-bit blocks (GGUF Q4_1 layout: fp16 scale and minimum, 16
bytes of nibbles) with float32 math (AVX2 + FMA where the CPU has them, plain C elsewhere).
NOTE: measured on a 2-core AMD EPYC (AVX2, no AVX-512), one thread, M=1: SmolLM2-135M's
576x49152 output projection took 64 ms through torch's int4 kernel in float32 and 10 ms
dense; see the README's "Where the time goes" for this kernel's figures.

It is built like the decode-attention kernel (:mod:`kvcache.native_build`: system compiler,
a private owner-only cache under ``$KVFENCE_HOME/kernels``, OpenMP on torch's libgomp) and is
off with ``KVFENCE_CPU_KERNEL=off``, without a compiler, or beside another OpenMP runtime;
:func:`kernel` then answers None and the packs stay on torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvcache.attention import NativeAttend
from kvcache.errors import KernelRefused
from kvcache.native_build import load_once
from service.model.quant import GROUP, Int4Codes, KBlocks

SOURCE = Path(__file__).with_name("kvf.c")  # the kernel's translation unit (includes its parts)
PANEL = 16  # output rows per panel of the panel layout (PANEL in panels.h)
_lock = threading.Lock()
_loaded: dict[str, Q4Kernel | None] = {}


@dataclass(frozen=True, slots=True)
class Rope:
    """RoPE for the first ``heads`` heads of ``dim`` columns of each output row (a fused qkv
    projection's q and k heads), from a ``table`` ``[M, 2, dim]`` float32 given with each
    call: each row's cos, and its sin with the first half negated (``DecoderModel.rope`` at
    the rows' positions)."""

    heads: int
    dim: int

    def takes(self, table: torch.Tensor | None, m: int, n: int) -> bool:
        return (
            table is not None
            and table.dtype == torch.float32
            and table.is_cpu
            and table.shape == (m, 2, self.dim)
            and table.is_contiguous()
            and self.heads >= 1
            and self.dim >= 2
            and self.dim % 2 == 0
            and self.heads * self.dim <= n
        )


class Q4Kernel:
    """The loaded kernel. :meth:`matmul` checks what the C code trusts."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.kvf_gemv
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self.mlp = lib.kvf_mlp
        self.mlp.restype = ctypes.c_int
        self.mlp.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        self.stack = lib.kvf_decoder_stack
        self.stack.restype = ctypes.c_int
        self.stack.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self.stack_columns = int(lib.kvf_stack_columns())
        self.stack_block_columns = int(lib.kvf_stack_block_columns())
        self.stack_lora_columns = int(lib.kvf_stack_lora_columns())
        self.stack_max_experts = int(lib.kvf_stack_max_experts())
        self.max_rows = int(lib.kvf_q4_max_rows())
        self.max_k = int(lib.kvf_q4_max_k())
        self.simd = bool(lib.kvf_q4_simd())
        # Weights packed with ``tiles`` run batches of amx_min_rows or more rows on the tile
        # unit (AMX-BF16 CPUs): x and the weights are rounded to bf16 there, float32 sums.
        self.amx = bool(lib.kvf_amx())
        self.amx_min_rows = int(lib.kvf_amx_min_rows())
        # Weights in the panel layout (:func:`to_panels`) run on
        # AVX512-VNNI here; elsewhere on plain C loops (the same bits, far slower).
        self.panel_simd = bool(lib.kvf_panel_simd())
        self.scratch_threads = lib.kvf_q4_scratch_threads  # threads holding scratch (tests)
        self.scratch_threads.restype = ctypes.c_int64

    def matmul(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        q8: bool = False,
        *,
        tiles: bool = False,
        panels: bool = False,
        wide: bool = False,
        gated: bool = False,
        gamma: torch.Tensor | None = None,
        eps: float = 0.0,
        into: torch.Tensor | None = None,
        rope: Rope | None = None,
        table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``v @ w.T`` for ``blocks`` ``[N, K / 32 * 20]`` uint8 (:func:`to_blocks`), or
        ``[N, K / 32 * 34]`` with ``q8`` (:func:`q8_blocks`). ``v`` is ``x`` ``[M, K]``
        float32 (M <= :attr:`max_rows`), or with ``gated`` ``silu(x[:, :K]) * x[:, K:]`` for
        ``x`` ``[M, 2K]``; with ``gamma`` ``[K]`` it is then ``F.rms_norm(v, (K,), gamma,
        eps)``. The activation and the norm run inside the call, on the way to the GEMV.
        With ``into`` ``[M, N]`` float32 the product is added to it (a residual add) and
        ``into`` returned; with ``rope`` the first heads of each output row are rotated
        by ``table`` (:class:`Rope`). With ``tiles`` a batch of :attr:`amx_min_rows` or more
        rows may run on the tile unit (:attr:`amx`), in the dense bf16 matmul's arithmetic.
        With ``panels`` ``blocks`` are in the panel layout
        (:func:`to_panels`, N a multiple of 16); with ``wide`` in a wide layout
        (:func:`wide_blocks`)."""
        m, width = x.shape
        k = width // 2 if gated else width
        n, row_bytes_ = blocks.shape
        if (
            x.dtype != torch.float32
            or not _on_cpu(x, blocks, gamma, into, table)
            or blocks.dtype != torch.uint8
            or not blocks.is_contiguous()
            or not 0 <= m <= self.max_rows
            or (gated and width % 2 != 0)
            or not GROUP <= k <= self.max_k
            or k % GROUP != 0
            or row_bytes_ != (panel_row_bytes(k, q8) if panels else row_bytes(k, q8, wide))
            or (panels and (n % PANEL != 0 or wide))
            or (gamma is not None and (gamma.dtype != torch.float32 or gamma.shape != (k,)))
            or (
                into is not None
                and (into.dtype != torch.float32 or into.shape != (m, n) or not into.is_contiguous())
            )
            or (rope is not None and (into is not None or not rope.takes(table, m, n)))
        ):
            raise ValueError("shape or dtype the 4-bit GEMV kernel does not take")
        out = torch.empty(m, n, dtype=torch.float32) if into is None else into
        if m == 0:  # a step that needs no logits
            return out
        x = x.contiguous()
        # a contiguous copy of a strided gamma must outlive the call: hold it here
        gamma = None if gamma is None else gamma.contiguous()
        norm = 0 if gamma is None else gamma.data_ptr()
        heads, dim = (0, 0) if rope is None else (rope.heads, rope.dim)
        status = self.fn(
            x.data_ptr(),
            m,
            k,
            blocks.data_ptr(),
            n,
            out.data_ptr(),
            flags(q8, tiles, panels, wide),
            int(gated),
            norm,
            eps,
            int(into is not None),
            _pointer(table if rope else None),
            heads,
            dim,
        )
        if status != 0:
            raise ValueError("the 4-bit GEMV kernel refused its shapes")
        return out


class MlpBlock:
    """A decoder layer's work after its attention, as one kernel call (``kvf_mlp``):
    ``x += o(attn)``, then ``x += down(silu(gate) * up)`` of ``gate_up(rms_norm(x))``, the
    same arithmetic as :meth:`Q4Linear.into`, :meth:`Q4Linear.normed_by` and
    :meth:`Q4Linear.gated_into` one after the other.
    NOTE: measured on a 2-core AVX2 EPYC: each kernel call from Python costs ~4-5 us (ctypes,
    the checks, an output tensor). In six paired rounds of SmolLM2-135M's B=1 decode steps,
    one call instead of three took 8.1-10.0 ms a step against 8.8-10.5 (0.45 ms less on
    average)."""

    __slots__ = ("_args", "_fn", "_gamma", "_hidden", "_inter", "_max_rows", "_q_size", "_weights")

    def __init__(
        self, o: Q4Linear, gamma: torch.Tensor, eps: float, gate_up: Q4Linear, down: Q4Linear
    ) -> None:
        hidden, q_size = o.blocks.shape[0], o.k
        inter = down.k
        if not (
            o.fuses
            and gate_up.fuses
            and down.fuses
            and gate_up.k == hidden
            and gate_up.blocks.shape[0] == 2 * inter
            and down.blocks.shape[0] == hidden
            and o.kernel is gate_up.kernel is down.kernel
        ):
            raise ValueError("projections the fused MLP call does not take")
        gate_up._check_norm(gamma)
        self._fn = o.kernel.mlp
        self._max_rows = o.kernel.max_rows
        self._hidden, self._q_size, self._inter = hidden, q_size, inter
        self._gamma = gamma  # kept alive for the pointer
        self._weights = (o.blocks, gate_up.blocks, down.blocks)
        self._args = (
            o.blocks.data_ptr(), o.flags, gamma.data_ptr(), eps,
            gate_up.blocks.data_ptr(), gate_up.flags, down.blocks.data_ptr(), down.flags,
        )

    def __call__(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, hidden]`` float32, updated in place and returned; ``attn``
        ``[M, q_size]`` float32."""
        m = x.shape[0]
        if not (
            x.dtype == torch.float32
            and attn.dtype == torch.float32
            and x.shape == (m, self._hidden)
            and attn.shape == (m, self._q_size)
            and 0 < m <= self._max_rows
            and x.is_contiguous()
            and attn.is_contiguous()
            and x.is_cpu
            and attn.is_cpu
        ):
            raise ValueError("shape or dtype the 4-bit GEMV kernel does not take")
        h = torch.empty(m, 2 * self._inter)
        o, o_q8, gamma, eps, gate_up, gate_up_q8, down, down_q8 = self._args
        if self._fn(
            x.data_ptr(), attn.data_ptr(), h.data_ptr(), m, self._hidden, self._q_size,
            self._inter, o, o_q8, gamma, eps, gate_up, gate_up_q8, down, down_q8,
        ):
            raise ValueError("the 4-bit GEMV kernel refused its shapes")
        return x


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _weight(lin: Q4Linear | None) -> tuple[int, int]:
    """A weight's (blocks pointer, flags) in the stack's table; (0, 0) for none."""
    return (0, 0) if lin is None else (lin.blocks.data_ptr(), lin.flags)


def _check_mlp(layer: StackLayer, eps: float) -> None:
    """Raises ValueError where ``layer``'s MLP is not one the native decoder stack takes:
    :class:`MlpBlock`'s projections, or experts (:class:`StackExperts`, checked as built)
    with no dense MLP and no MLP biases beside them."""
    if layer.experts is None:
        if layer.gate_up is None or layer.down is None:
            raise ValueError("a layer without an MLP")
        MlpBlock(layer.o, layer.mlp_norm, eps, layer.gate_up, layer.down)  # its checks
        return
    if not (
        layer.gate_up is None
        and layer.down is None
        and layer.gate_up_bias is None
        and layer.down_bias is None
        and layer.o.fuses
        and layer.experts.gate_up[0].kernel is layer.o.kernel
        and layer.experts.gate_up[0].k == layer.o.blocks.shape[0]
    ):
        raise ValueError("experts beside a dense MLP or its biases")
    layer.experts.gate_up[0]._check_norm(layer.mlp_norm)


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.is_cpu for t in tensors)


def kernel() -> Q4Kernel | None:
    """The compiled kernel, built once per process (and cached on disk); None where it
    cannot be built or is switched off."""
    return load_once(_loaded, _lock, SOURCE, "kvf", Q4Kernel)


def _rows(*parts: torch.Tensor) -> torch.Tensor:
    """Each part ``[N, ...]`` flattened to bytes per row, side by side: ``[N, row bytes]``."""
    n = parts[0].shape[0]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts], 1)


def _padded(scales: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` fp16 scales padded with zeros to a multiple of 8 columns (the kernel
    converts them 8 at a time)."""
    pad = -scales.shape[1] % 8
    return torch.nn.functional.pad(scales, (0, pad)) if pad else scales


def flags(q8: bool, tiles: bool, panels: bool = False, wide: bool = False) -> int:
    """A weight's q8 argument to the kernel: bit 0 for 8-bit blocks, bit 1 (KVF_TILES in
    common.h) to let batches run on the tile unit, bit 2 (KVF_PANELS) for 4-bit blocks in
    the panel layout, bit 3 (KVF_WIDE) for a wide layout (:func:`wide_blocks`)."""
    return int(q8) | (2 if tiles else 0) | (4 if panels else 0) | (8 if wide else 0)


def row_bytes(k: int, q8: bool, wide: bool = False) -> int:
    """Bytes of one output row of the kernel's layout for an input of ``k``."""
    groups = k // GROUP
    padded = groups + (-groups % 8)
    if wide:  # float32 scales: two a block (8-bit) or a scale and a minimum (4-bit)
        return groups * (32 if q8 else 16) + 8 * padded
    return groups * 32 + 2 * padded if q8 else groups * 16 + 4 * padded


def panel_row_bytes(k: int, q8: bool) -> int:
    """Bytes per output row of the panel layout (:func:`to_panels`)."""
    return k // GROUP * (36 if q8 else 20)


def to_blocks(w: Int4Codes) -> torch.Tensor:
    """``w``'s codes in the kernel's 4-bit row layout, ``[N, K / 32 * 20]`` bytes: the blocks'
    nibbles, then their fp16 scales ``d`` (= scale), then their fp16 minimums ``m`` (= zero -
    8 * scale), for ``w = d * q + m``. Codes from a GGUF's Q4_0, Q4_1 or Q8_0 blocks
    round-trip exactly (their scales and minimums are fp16 already); codes quantized from a
    wider tensor take fp16 scales, as GGUF's own Q4_1 does."""
    n, kr = w.codes.shape
    groups = kr // GROUP
    codes = w.codes.to(torch.uint8).view(n, groups, GROUP)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # ggml: j low, j + 16 high
    scale = w.scale.double()
    minimum = w.zero.double() - 8 * scale
    return _rows(nibbles, _padded(scale.to(torch.float16)), _padded(minimum.to(torch.float16)))


def q8_blocks(w: Int4Codes) -> torch.Tensor | None:
    """The kernel's 8-bit row layout (``[N, K / 32 * 34]``: the blocks' int8 codes, then their
    fp16 scales) for codes that :func:`service.model.quant.from_q8_0` split into two 4-bit
    halves, or None for any other codes. Reading the int8 directly does half the work."""
    if w.repeat != 2:
        return None
    kr = w.codes.shape[1]
    k, groups = kr // 2, kr // 2 // GROUP
    hi_scale, d = w.scale[:, :groups], w.scale[:, groups:]
    hi_zero, lo_zero = w.zero[:, :groups], w.zero[:, groups:]
    if not (
        torch.equal(hi_scale, 16 * d) and not hi_zero.any() and torch.equal(lo_zero, 8 * d)
    ):
        return None
    d16 = d.to(torch.float16)
    if not torch.equal(d16.float(), d):
        return None
    q = 16 * w.codes[:, :k] + w.codes[:, k:] - 128  # u = q + 128 = 16 * hi + lo
    return _rows(q.to(torch.int8), _padded(d16))


def _padded32(values: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` float32 values padded to a multiple of 8 with zeros, as bytes."""
    padded = torch.nn.functional.pad(values.float(), (0, -values.shape[1] % 8))
    return padded.contiguous().view(torch.uint8)


def wide_blocks(w: KBlocks) -> torch.Tensor:
    """``w`` in the kernel's wide row layout (:func:`row_bytes` with ``wide``): 4-bit (Q4_K)
    the blocks' nibbles (j low, j + 16 high), their float32 scales, then their float32
    minimums; 8-bit (Q6_K) the blocks' int8 codes, the float32 scales of codes 0-15 of each
    block, then of codes 16-31. The file's codes and scales, exactly."""
    n, k = w.codes.shape
    groups = k // GROUP
    if w.minimum is None:
        halves = w.scale.view(n, groups, 2)
        return _rows(w.codes.to(torch.int8), _padded32(halves[..., 0]), _padded32(halves[..., 1]))
    codes = w.codes.to(torch.uint8).view(n, groups, GROUP)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return _rows(nibbles, _padded32(w.scale), _padded32(w.minimum))


def to_panels(blocks: torch.Tensor, k: int, q8: bool = False) -> torch.Tensor:
    """``blocks`` (:func:`service.model.native.kernels.to_blocks`, or with ``q8``
    :func:`~service.model.native.kernels.q8_blocks`; ``[N, row bytes]``, N a multiple of 16) in
    the kernel's panel layout (:func:`~service.model.native.kernels.panel_row_bytes` a row): per
    panel of 16 output rows and block g, the 16 rows' codes (byte ``[i][n][j]`` is byte
    ``4i + j`` of row n's block), then their 16 fp16 scales, then their 16 fp16 minimums
    (zeros for 8-bit blocks)."""
    n = blocks.shape[0]
    groups = k // GROUP
    padded = groups + (-groups % 8)
    panels = n // PANEL
    width = 32 if q8 else 16  # code bytes of a block
    codes = blocks[:, : groups * width].reshape(panels, PANEL, groups, width // 4, 4)
    codes = codes.permute(0, 2, 3, 1, 4).reshape(panels, groups, 16 * width)
    halves = blocks[:, groups * width :].reshape(panels, PANEL, -1, padded, 2)[:, :, :, :groups]
    halves = halves.permute(0, 3, 2, 1, 4).reshape(panels, groups, -1)
    if q8:  # minimums 0
        halves = torch.cat([halves, torch.zeros_like(halves)], 2)
    return torch.cat([codes, halves], 2).reshape(n, -1).contiguous()


@dataclass(frozen=True, slots=True)
class Q4Linear:
    """``x @ w.T`` for float32 ``x`` of at most ``kernel.max_rows`` rows, from 4-bit blocks
    (or the file's Q8_0 blocks, which :mod:`service.model.quant` hands over as two halves)."""

    blocks: torch.Tensor  # [N, row_bytes(k, q8)] uint8
    repeat: int
    kernel: Q4Kernel
    q8: bool = False
    k: int = 0  # the kernel's input width (K * repeat, or K for q8)
    # Batches of kernel.amx_min_rows or more may run on the tile unit (bf16 arithmetic):
    # set where the model's larger batches run dense bf16 weights anyway.
    tiles: bool = False
    # blocks in the panel layout (to_panels, :meth:`in_panels`)
    panels: bool = False
    # blocks in a wide layout (wide_blocks: GGUF K-quants, float32 scales)
    wide: bool = False
    # (C function, blocks pointer, k, flags) for the per-call fast path, set in __post_init__
    _fast: tuple[Any, int, int, int] = field(init=False, repr=False, compare=False)

    @classmethod
    def pack(cls, w: Int4Codes, kernel: Q4Kernel, tiles: bool = False) -> Q4Linear:
        q8 = q8_blocks(w)
        if q8 is not None:
            return cls(q8, 1, kernel, q8=True, k=w.codes.shape[1] // 2, tiles=tiles)
        return cls(to_blocks(w), w.repeat, kernel, k=w.codes.shape[1], tiles=tiles)

    @classmethod
    def pack_k(cls, w: KBlocks, kernel: Q4Kernel) -> Q4Linear:
        """A K-quant weight in its wide layout (never on the tile unit or in panels)."""
        return cls(wide_blocks(w), 1, kernel, q8=w.eight_bit, k=w.codes.shape[1], wide=True)

    def in_panels(self) -> Q4Linear:
        """This weight in the panel layout where the kernel runs it on SIMD and its rows
        fill panels of 16 (one exact integer a block and one float chain per output in
        block order, the same bits at any row count); else this weight unchanged."""
        if (
            not self.kernel.panel_simd
            or self.panels
            or self.wide
            or self.repeat != 1
            or self.blocks.shape[0] % PANEL != 0
        ):
            return self
        return replace(
            self, blocks=to_panels(self.blocks, self.k, self.q8), tiles=False, panels=True
        )

    def __post_init__(self) -> None:
        # The blocks are checked once here, so a call checks only its input (below).
        self.kernel.matmul(
            torch.zeros(1, self.k), self.blocks, self.q8, panels=self.panels, wide=self.wide
        )
        fast = (self.kernel.fn, self.blocks.data_ptr(), self.k, self.flags)
        object.__setattr__(self, "_fast", fast)

    @property
    def flags(self) -> int:
        """This weight's q8 argument to the kernel (:func:`flags`)."""
        return flags(self.q8, self.tiles, self.panels, self.wide)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.repeat > 1:
            x = x.repeat(1, self.repeat)
        return self._run(x, False, None, 0, 0.0)

    def _run(
        self,
        x: torch.Tensor,
        gated: bool,
        gamma: torch.Tensor | None,
        norm: int,
        eps: float,
        into: torch.Tensor | None = None,
        rope: Rope | None = None,
        table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One kernel call; ``norm`` is ``gamma``'s data pointer (0 without), checked by the
        caller once. NOTE: ~120 calls a decode step: the common case skips matmul's checks."""
        fn, blocks, k, flag = self._fast
        m, n = x.shape[0], self.blocks.shape[0]
        if (
            x.dtype == torch.float32
            and x.is_cpu
            and x.dim() == 2
            and x.shape[1] == (2 * k if gated else k)
            and 0 < m <= self.kernel.max_rows
            and x.is_contiguous()
            and (
                into is None
                or (
                    into.dtype == torch.float32
                    and into.shape == (m, n)
                    and into.is_contiguous()
                    and into.is_cpu
                )
            )
            and (rope is None or (into is None and rope.takes(table, m, n)))
        ):
            out = torch.empty(m, n) if into is None else into
            heads, dim = (0, 0) if rope is None else (rope.heads, rope.dim)
            if fn(
                x.data_ptr(),
                m,
                k,
                blocks,
                n,
                out.data_ptr(),
                flag,
                gated,
                norm,
                eps,
                into is not None,
                _pointer(table if rope else None),
                heads,
                dim,
            ):
                raise ValueError("the 4-bit GEMV kernel refused its shapes")
            return out
        return self.kernel.matmul(
            x,
            self.blocks,
            self.q8,
            tiles=self.tiles,
            panels=self.panels,
            wide=self.wide,
            gated=gated,
            gamma=gamma,
            eps=eps,
            into=into,
            rope=rope,
            table=table,
        )

    @property
    def fuses(self) -> bool:
        """Whether :meth:`normed_by` and :meth:`gated` run in the kernel (one input copy)."""
        return self.repeat == 1

    def normed_by(self, gamma: torch.Tensor, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self(F.rms_norm(x, (K,), gamma, eps))``, each call one kernel call."""
        self._check_norm(gamma)
        return functools.partial(
            self._run, gated=False, gamma=gamma, norm=gamma.data_ptr(), eps=eps
        )

    def _check_norm(self, gamma: torch.Tensor) -> None:
        if not (
            self.fuses
            and gamma.dtype == torch.float32
            and gamma.shape == (self.k,)
            and gamma.is_contiguous()
            and gamma.is_cpu
        ):
            raise ValueError("a norm weight the 4-bit GEMV does not take (float32 [K] only)")

    def normed(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(F.rms_norm(x, (K,), gamma, eps))`` in one kernel call."""
        return self.normed_by(gamma, eps)(x)

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """``self(F.silu(gate) * up)`` for ``x = [gate | up]`` in one kernel call."""
        if not self.fuses:
            raise ValueError("the 4-bit GEMV fuses the gate only without repeated halves")
        return self._run(x, True, None, 0, 0.0)

    def gated_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += self.gated(x)`` in one kernel call; answers ``residual``."""
        if not self.fuses:
            raise ValueError("the 4-bit GEMV fuses the gate only without repeated halves")
        return self._run(x, True, None, 0, 0.0, into=residual)

    def into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += self(x)`` in one kernel call; answers ``residual``."""
        if self.repeat > 1:
            x = x.repeat(1, self.repeat)
        return self._run(x, False, None, 0, 0.0, into=residual)

    def roped_by(
        self, gamma: torch.Tensor, eps: float, rope: Rope
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``(x, table) -> self(F.rms_norm(x, (K,), gamma, eps))`` with RoPE (``rope`` by
        ``table``) on the first heads of each output row, each call one kernel call."""
        self._check_norm(gamma)
        norm, run = gamma.data_ptr(), self._run

        def call(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            return run(x, False, gamma, norm, eps, None, rope, table)

        return call

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


# The fused projections a step's LoRA deltas attach to, in the C table's order.
LORA_GROUPS = ("qkv", "o", "gate_up", "down")
MAX_LORA_RANKS = 65536  # LORA_MAX_RANKS in lora.h
# How a LoRA delta's A and B may be held, and the C table's flag for each (HELD_* in lora_loops.h).
HELD = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True, slots=True)
class StackDelta:
    """One fused projection's LoRA delta in every layer of a :class:`DecoderStack` step:
    ``out += ((v @ a[l].T) * mask) @ b[l]``, with ``v`` the projection's input (the normed
    x for qkv and gate_up, the attention output for o, ``silu(gate) * up`` for down).
    ``a`` ``[layers, R, k]`` and ``b`` ``[layers, R, n]`` (rank-major) are the step's
    adapters' weights stacked along the rank axis, both float32, both bfloat16 or both
    float16 (the halves widened exactly where read); ``mask`` ``[rows, R]`` float32 keeps
    each row's own adapter's ranks (its adapter's scale; 0 elsewhere, and everywhere on a
    base row). With ``parts`` > 1
    (3 for qkv's q|k|v, 2 for gate_up's gate|up) ``b`` is block-diagonal by module, as
    :mod:`service.model.lora` builds it: within each adapter's rank block, module ``j``'s
    outputs are nonzero only in the ``j``-th of ``parts`` equal rank slices, and the
    kernel reads only that slice for them."""

    a: torch.Tensor
    b: torch.Tensor
    mask: torch.Tensor
    parts: int = 1


# The MLP gate's activations the native decoder stack computes, by ModelConfig.activation,
# and the C code's value for each (GATE_SILU, GATE_GELU_TANH in common.h).
STACK_GATES = {"silu": 1, "gelu_tanh": 2}


@dataclass(frozen=True, slots=True)
class StackExperts:
    """A layer's mixture-of-experts MLP for :class:`DecoderStack`, in place of its dense one:
    each row's float32 router logits (``router`` ``[experts, hidden]``), their softmax, the
    ``top_k`` largest (ties to the lower expert), renormalised to sum to one with
    ``normalize`` (:func:`service.model.moe.route`), then each picked expert's gated MLP
    (``gate_up[e]`` ``[2 inter, hidden]``, ``down[e]`` ``[hidden, inter]``) weighted and
    summed in expert order before the residual add. Each row is routed and computed on its
    own, so its arithmetic does not depend on the rows beside it."""

    router: torch.Tensor  # [experts, hidden] float32
    gate_up: tuple[Q4Linear, ...]
    down: tuple[Q4Linear, ...]
    top_k: int
    normalize: bool
    # [experts, 4] int64: each expert's gate_up and down pointers and flags (E_* in
    # attend.h), set in __post_init__
    table: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        count = len(self.gate_up)
        first = self.gate_up[0] if count else None
        if not (
            first is not None
            and len(self.down) == count
            and 0 < self.top_k <= count <= first.kernel.stack_max_experts
            and self.router.dtype == torch.float32
            and self.router.shape == (count, first.k)
            and self.router.is_contiguous()
            and self.router.is_cpu
            and all(
                g.fuses
                and d.fuses
                and g.kernel is d.kernel is first.kernel
                and g.k == first.k
                and g.blocks.shape[0] == 2 * d.k == 2 * self.down[0].k
                and d.blocks.shape[0] == first.k
                for g, d in zip(self.gate_up, self.down, strict=True)
            )
        ):
            raise ValueError("experts the native decoder stack does not take")
        rows = [
            [g.blocks.data_ptr(), g.flags, d.blocks.data_ptr(), d.flags]
            for g, d in zip(self.gate_up, self.down, strict=True)
        ]
        object.__setattr__(self, "table", torch.tensor(rows, dtype=torch.int64))

    @property
    def inter(self) -> int:
        """Each expert's intermediate width."""
        return self.down[0].k

    def columns(self) -> list[int]:
        """The C block table's expert columns (B_ROUTER to B_NORM_TOP_K in attend.h)."""
        return [
            self.router.data_ptr(), self.table.data_ptr(), len(self.gate_up), self.top_k,
            int(self.normalize),
        ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer's packed projections and norm weights for :class:`DecoderStack`,
    with the pieces a family's layer has beyond the plain Llama layer (None: it has none;
    every tensor float32): the qkv, o, gate_up and down biases, the q/k head norms
    (``[q heads + kv heads, head_dim]``, after the qkv bias, before RoPE), the norms of the
    attention and MLP outputs before their residual adds (Gemma's sandwich norms), which
    of the step's RoPE tables turns its q and k heads, and ``experts`` where its MLP is a
    mixture of experts (then ``gate_up`` and ``down`` are None)."""

    attn_norm: torch.Tensor  # [hidden] float32
    qkv: Q4Linear  # [q + 2 kv, hidden]
    o: Q4Linear  # [hidden, q]
    mlp_norm: torch.Tensor  # [hidden] float32
    gate_up: Q4Linear | None  # [2 inter, hidden]; None with experts
    down: Q4Linear | None  # [hidden, inter]; None with experts
    qkv_bias: torch.Tensor | None = None  # [q + 2 kv]
    qk_norm: torch.Tensor | None = None  # [q heads + kv heads, head_dim]
    rope_table: int = 0
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2 inter]
    down_bias: torch.Tensor | None = None  # [hidden]
    post_attn_norm: torch.Tensor | None = None  # [hidden]
    post_mlp_norm: torch.Tensor | None = None  # [hidden]
    experts: StackExperts | None = None

    @property
    def inter(self) -> int:
        """The MLP's intermediate width (each expert's, with experts)."""
        if self.experts is not None:
            return self.experts.inter
        assert self.down is not None
        return self.down.k

    def extras(self) -> tuple[torch.Tensor | None, ...]:
        """The optional tensors in the C block table's order (B_* in attend.h, B_ROPE
        aside)."""
        return (
            self.qkv_bias, self.qk_norm, self.o_bias, self.gate_up_bias, self.down_bias,
            self.post_attn_norm, self.post_mlp_norm,
        )  # fmt: skip


class DecoderStack:
    """Every decoder layer of an all-decode step in one native call (``kvf_decoder_stack``):
    per layer the fused qkv call (norm, projection, RoPE; the bias and q/k head norms
    between the projection and RoPE where the family has them), kvcache's K/V write and
    attention through its :class:`~kvcache.attention.NativeAttend` (the layer's window and
    softcap are kvcache's), and :class:`MlpBlock`'s call (with the family's biases,
    post-norms and gate activation). The same arithmetic as the layer-by-layer calls,
    without Python between them.
    NOTE: measured on a 2-core AVX2 EPYC, SmolLM2-135M at B=1, float32: the Python layer loop
    (views, q/k/v copies, per-call checks) took ~2 ms of a ~7 ms step."""

    def __init__(
        self,
        layers: Sequence[StackLayer],
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        activation: str = "silu",
        query_scale: float = 1.0,
    ) -> None:
        first = layers[0]
        kernel = first.qkv.kernel
        hidden, q_size = first.qkv.k, q_heads * head_dim
        inter = first.inter
        n_qkv = q_size + 2 * kv_heads * head_dim
        if activation not in STACK_GATES:
            raise ValueError(f"the native decoder stack has no {activation!r} gate")
        tables = 1 + max(layer.rope_table for layer in layers)
        for layer in layers:
            _check_mlp(layer, eps)
            layer.qkv._check_norm(layer.attn_norm)
            shapes = (
                (n_qkv,), (q_heads + kv_heads, head_dim), (hidden,), (2 * inter,), (hidden,),
                (hidden,), (hidden,),
            )  # fmt: skip
            if not (
                layer.qkv.kernel is layer.o.kernel is kernel
                and layer.qkv.k == hidden
                and layer.qkv.blocks.shape[0] == n_qkv
                and layer.o.k == q_size
                and layer.o.blocks.shape[0] == hidden
                and layer.inter == inter
                and layer.rope_table >= 0
                and all(
                    t is None
                    or (
                        t.dtype == torch.float32
                        and t.shape == shape
                        and t.is_contiguous()
                        and t.is_cpu
                    )
                    for t, shape in zip(layer.extras(), shapes, strict=True)
                )
            ):
                raise ValueError("layers the native decoder stack does not take")
        self._fn = kernel.stack
        self._lora_columns = kernel.stack_lora_columns
        self._max_rows = kernel.max_rows
        self._shape = (len(layers), hidden, q_heads, kv_heads, head_dim, inter)
        self._eps = eps
        self._gate = STACK_GATES[activation]
        self._query_scale = query_scale
        self._rope_tables = tables
        # Per layer, the block table (B_* in attend.h); None where every layer is the plain
        # Llama layer (no column set), which the C code then runs without one.
        plain = (
            all(t is None for layer in layers for t in layer.extras())
            and tables == 1
            and all(layer.experts is None for layer in layers)
        )
        self._blocks = None if plain else torch.tensor(
            [
                [
                    _pointer(layer.qkv_bias), _pointer(layer.qk_norm), layer.rope_table,
                    _pointer(layer.o_bias), _pointer(layer.gate_up_bias),
                    _pointer(layer.down_bias), _pointer(layer.post_attn_norm),
                    _pointer(layer.post_mlp_norm),
                    *(layer.experts.columns() if layer.experts else [0] * 5),
                ]
                for layer in layers
            ],
            dtype=torch.int64,
        )  # fmt: skip
        if self._blocks is not None and self._blocks.shape[1] != kernel.stack_block_columns:
            raise ValueError("the native decoder stack's block table does not match its kernel")
        self._keep = tuple(layers)  # the weights the table points into
        # the last LoRA table with the deltas it points into: a kept step plan's next steps
        # pass the same deltas (service/model/lora_stack.py)
        self._last_lora: tuple[Mapping[str, StackDelta], int, torch.Tensor] | None = None
        self._table = torch.tensor(
            [
                [
                    layer.qkv.blocks.data_ptr(), layer.qkv.flags, layer.attn_norm.data_ptr(),
                    layer.o.blocks.data_ptr(), layer.o.flags, layer.mlp_norm.data_ptr(),
                    *_weight(layer.gate_up), *_weight(layer.down),
                ]
                for layer in layers
            ],
            dtype=torch.int64,
        )
        if self._table.shape[1] != kernel.stack_columns:
            raise ValueError("the native decoder stack's table does not match its kernel")

    def __call__(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        attend: NativeAttend,
        lora: Mapping[str, StackDelta] | None = None,
    ) -> torch.Tensor:
        """``x`` ``[M, hidden]`` float32 (the embeddings), run through every layer in place
        and returned; ``rope`` ``[M, 2, head_dim]`` float32 (cos, signed sin) at each row's
        position, or ``[tables, M, 2, head_dim]`` where layers turn by several RoPE bases
        (:attr:`rope_tables`); ``attend`` this step's, for ``M`` sequences of one token each.
        ``lora``: the step's adapter deltas by fused projection (:data:`LORA_GROUPS`); a
        projection absent from it gets none."""
        layers, hidden, hq, hkv, dim, inter = self._shape
        m = x.shape[0]
        tables = self._rope_tables
        if not (
            x.dtype == torch.float32
            and x.shape == (m, hidden)
            and x.is_contiguous()
            and 0 < m <= self._max_rows
            and rope.dtype == torch.float32
            and rope.shape == ((m, 2, dim) if tables == 1 else (tables, m, 2, dim))
            and rope.is_contiguous()
            and x.is_cpu
            and rope.is_cpu
            and (attend.batch, attend.q_heads, attend.kv_heads, attend.head_dim)
            == (m, hq, hkv, dim)
            and attend.num_layers == layers
        ):
            raise ValueError("shape or dtype the native decoder stack does not take")
        table = None
        if lora is None:
            self._last_lora = None  # a base-only step lets go of the last adapters' deltas
        else:
            last = self._last_lora
            if last is not None and last[0] is lora and last[1] == m:
                table = last[2]
            else:
                table = self._lora_table(lora, m)
                self._last_lora = (lora, m, table)
        status = self._fn(
            x.data_ptr(),
            m,
            hidden,
            layers,
            self._table.data_ptr(),
            _pointer(self._blocks),
            hq,
            hkv,
            dim,
            inter,
            self._eps,
            self._gate,
            self._query_scale,
            rope.data_ptr(),
            tables,
            attend.fn,
            attend.ctx,
            _pointer(table),
        )
        if status == -2:
            raise KernelRefused(
                "kvcache's attention refused the step's plan or rows; nothing was written for it"
            )
        if status != 0:
            raise ValueError("the native decoder stack refused its shapes")
        return x

    @property
    def layers(self) -> tuple[StackLayer, ...]:
        """The layers this stack runs, in order."""
        return self._keep

    @property
    def rope_tables(self) -> int:
        """How many RoPE tables a call's ``rope`` holds (one per base the layers turn by)."""
        return self._rope_tables

    def _lora_table(self, lora: Mapping[str, StackDelta], m: int) -> torch.Tensor:
        """The C call's LoRA table ``[layers, 4, 6]`` int64 (per layer and projection: a, b,
        mask, R, parts, and how a and b are held (:data:`HELD`); R = 0 for none) after
        checking every delta's shapes against this stack's. The table points into
        ``lora``'s tensors: the caller holds them for the call."""
        layers, hidden, hq, hkv, dim, inter = self._shape
        n_qkv = (hq + 2 * hkv) * dim
        sizes = {
            "qkv": (hidden, n_qkv), "o": (hq * dim, hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden),
        }  # fmt: skip
        if not set(lora) <= set(LORA_GROUPS) or (
            any(layer.experts is not None for layer in self._keep)
            and not set(lora) <= {"qkv", "o"}
        ):
            raise ValueError("LoRA deltas for projections the native decoder stack does not have")
        most = {"qkv": 3, "gate_up": 2}
        table = torch.zeros(layers, len(LORA_GROUPS), 6, dtype=torch.int64)
        at = torch.arange(layers, dtype=torch.int64)
        for g, name in enumerate(LORA_GROUPS):
            d = lora.get(name)
            if d is None:
                continue
            k, n = sizes[name]
            r = d.a.shape[1] if d.a.dim() == 3 else -1
            if not (
                0 < r <= MAX_LORA_RANKS
                and d.a.dtype in HELD
                and d.b.dtype == d.a.dtype
                and d.mask.dtype == torch.float32
                and all(t.is_cpu and t.is_contiguous() for t in (d.a, d.b, d.mask))
                and d.a.shape == (layers, r, k)
                and d.b.shape == (layers, r, n)
                and d.mask.shape == (m, r)
                and d.parts in (1, most.get(name, 1))
            ):
                raise ValueError("a LoRA delta the native decoder stack does not take")
            size = d.a.element_size()
            table[:, g, 0] = d.a.data_ptr() + at * (r * k * size)
            table[:, g, 1] = d.b.data_ptr() + at * (n * r * size)
            table[:, g, 2] = d.mask.data_ptr()
            table[:, g, 3] = r
            table[:, g, 4] = d.parts
            table[:, g, 5] = HELD[d.a.dtype]
        if table.shape[1] * table.shape[2] != self._lora_columns:
            raise ValueError("the native decoder stack's LoRA table does not match its kernel")
        return table
