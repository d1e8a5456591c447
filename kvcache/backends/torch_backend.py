"""Paged attention in pure torch (CPU and GPU).

A step is planned once (on the first layer) and the plan is reused by every layer: per chunk
of sequences, one gather index into the layer's pool and, where lengths differ, one mask.
Each chunk fetches its K and V with a *single* ``index_select``, naming only the sequences'
own pages; shorter sequences in a decode chunk are padded with their own first page (or
slot) and the padding is masked out, so no sequence ever reads a page outside its table.

- bf16/fp16 decode rows (one query token each) gather rows of ``D`` values into
  ``[2, B, Hkv, N, D]``, so each (sequence, kv head) block is contiguous, and run two batched
  matmuls with GQA folded into the query (``[B, Hkv, group, D]``, no ``repeat_interleave``)
  and the softmax in float32.
- float32 decode and all prefill chunks gather whole pages and run SDPA (``enable_gqa``) on
  a strided view; prefill uses a causal mask aligned to the chunk's start position.
- a layer with a logit softcap (Gemma 2) cannot use SDPA, which has no hook between the
  scores and the softmax: its SDPA chunks run the same gathered K/V through an explicit
  scores -> ``cap * tanh(s / cap)`` -> mask -> float32 softmax -> V product instead; the
  matmul decode rows and the C kernel cap their scores in place.
- on CPU, bf16 and float32 decode rows skip the gather: where the C kernel of
  :mod:`kvcache.backends.cpu_decode` could be built, it reads each row's own pages in place
  (one call for each run of consecutive decode rows). NOTE: measured on a 2-core AVX2 EPYC,
  float32, SmolLM2-135M at B=1: the gather, SDPA and their views took ~2.5 ms of a ~20 ms
  decode step.

Softmax scale ``head_dim ** -0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvcache.attention import NativeAttend
from kvcache.backends import cpu_decode
from kvcache.metadata import AttentionMetadata

# NOTE: on CPU, decode attention is memory bound. Gathering a few sequences at a time keeps
# the gathered K/V in cache while the matmuls read it back. On GPUs one big batch is better
# (fewer kernel launches).
_CPU_GATHER_BYTES = 4 * 1024 * 1024
_GPU_GATHER_BYTES = 1024 * 1024 * 1024
# NOTE: torch's CPU SDPA is fast in float32 but several times slower than two batched
# matmuls in bf16/fp16 for one query token, so half-precision decode uses the matmuls.
_MATMUL_DECODE = (torch.bfloat16, torch.float16)
# NOTE: on CPU a bf16/fp16 batched matmul (oneDNN) has a fixed cost of ~20-30 us per call,
# which dominates short decode chunks (B=1 at a few hundred keys: ~2 ms of a ~10 ms step for
# a 30-layer model). Up to this many keys per chunk (sequences x longest length), upcasting
# the gathered K/V to float32 and running both matmuls there is 1.5-3x faster (measured on
# a 2-core AVX512 CPU; beyond ~512 keys the upcast copy costs more than it saves).
_CPU_UPCAST_DECODE_KEYS = 512
# Steps with prefill chunks go to native model code (every token a decode-kernel row) while
# their chunks' tokens read at most this many keys between them: 64 tokens at 1,024.
_NATIVE_CHUNK_KEYS = 64 * 1024
# Native model code computes float32; the pool holds float32, or bf16 where KV is stored in
# the dense weights' dtype (--dtype auto on bf16 CPUs).
_NATIVE_POOLS = (torch.float32, torch.bfloat16)
_WIDE_Q_NARROW_POOL = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Query rows ``[start, end)`` of q, from ``batch`` sequences attending to their pages."""

    start: int
    end: int
    batch: int  # sequences in the chunk; each has (end - start) // batch query rows
    index: torch.Tensor  # what to gather from the layer; see TorchStep._run
    by_rows: bool  # index rows of D values (else whole pages)
    kv_len: int  # keys per sequence (decode: the longest sequence; shorter ones padded)
    mask: torch.Tensor | None  # True = attend; decode [B, 1, 1, N], prefill [Tq, N]
    padding: torch.Tensor | None  # decode only: ~mask, for masked_fill on the scores
    causal: bool  # plain top-left causal mask (prefill from position 0)
    decode: bool
    upcast: bool = False  # by-rows decode whose matmuls run in float32 (see above)
    # The C kernel's page metadata (indptr, indices, lens: int32), or None for the torch path
    paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    window: int = 0  # the layer's sliding window (0: every key), in the mask or the C call


class TorchStep:
    """A prepared step; see :class:`~kvcache.backends.base.StepKernel`."""

    def __init__(self, metadata: AttentionMetadata) -> None:
        self._device = metadata.slot_mapping.device
        self._meta = metadata
        self._chunks: list[_Chunk] = []  # the plan of layers without a window
        self._windowed: dict[int, list[_Chunk]] = {}  # plans by window, made on first use
        self._budget = _CPU_GATHER_BYTES if self._device.type == "cpu" else _GPU_GATHER_BYTES
        self._offsets = [0]
        for n in metadata.qo_lens:
            self._offsets.append(self._offsets[-1] + n)
        self._num_kv_heads = 0  # set on first call, when the pool layout is known
        self._bytes_per_key = 0  # set on first call
        self._matmul_decode = False  # set on first call, from the query dtype
        self._kernel: cpu_decode.DecodeKernel | None = None  # set on first call
        # write_attend's checked call for this step, or False where it has none; first call
        self._writer: cpu_decode.LayerWriter | Literal[False] | None = None
        self._built = False

    def _build(self, dtype: torch.dtype, q_heads: int, kv_layer: torch.Tensor) -> None:
        self._num_kv_heads = kv_layer.shape[-2]
        self._matmul_decode = dtype in _MATMUL_DECODE
        if dtype in (torch.bfloat16, torch.float32) and self._device.type == "cpu":
            kernel = cpu_decode.kernel()
            if kernel is not None and kernel.supports(q_heads, kv_layer):
                self._kernel = kernel
        self._bytes_per_key = 2 * kv_layer.shape[-2] * kv_layer.shape[-1] * kv_layer.element_size()
        self._chunks = self._plan(0)
        self._built = True

    def _plan(self, window: int) -> list[_Chunk]:
        meta = self._meta
        chunks: list[_Chunk] = []
        pending: list[int] = []  # consecutive decode sequences not yet chunked
        for i, n in enumerate(meta.qo_lens):
            if n == 1:
                longest = max([meta.kv_lens[i], *(meta.kv_lens[j] for j in pending)])
                gathered = (len(pending) + 1) * longest * self._bytes_per_key
                if pending and self._kernel is None and gathered > self._budget:
                    chunks.append(self._decode_chunk(pending, window))
                    pending = []
                pending.append(i)
                continue
            if pending:
                chunks.append(self._decode_chunk(pending, window))
                pending = []
            chunks.append(self._prefill_chunk(i, window))
        if pending:
            chunks.append(self._decode_chunk(pending, window))
        return chunks

    def _index(self, seqs: list[int], length: int, by_rows: bool) -> torch.Tensor:
        """What to gather from the layer for ``seqs``, each padded to ``length`` keys with
        its own first slot (or page). See :meth:`_run` for the two layouts."""
        meta, hkv = self._meta, self._num_kv_heads
        ps = meta.page_size
        if not by_rows:  # pages of the [2 * num_pages, ps * Hkv * D] view: [2, B, P]
            pages_each = -(-length // ps)
            pages = torch.tensor(
                [
                    meta.page_ids[i] + (meta.page_ids[i][0],) * (pages_each - len(meta.page_ids[i]))
                    for i in seqs
                ],
                dtype=torch.long,
            )
            index = torch.stack((2 * pages, 2 * pages + 1))
            return index.reshape(-1).to(self._device)
        slots = torch.stack([self._slots(i, length) for i in seqs])  # [B, N]
        # Rows of the [-1, D] view, laid out [page, k|v, offset, head]: [2, B, Hkv, N].
        base = (slots + torch.div(slots, ps, rounding_mode="floor") * ps) * hkv
        kv = torch.tensor([0, ps * hkv], dtype=torch.long).view(2, 1, 1, 1)
        heads = torch.arange(hkv, dtype=torch.long).view(1, 1, hkv, 1)
        return (base[None, :, None, :] + kv + heads).reshape(-1).to(self._device)

    def _slots(self, i: int, length: int) -> torch.Tensor:
        """Sequence ``i``'s first ``kv_lens[i]`` slots, padded to ``length`` with its first."""
        meta = self._meta
        ps, n = meta.page_size, meta.kv_lens[i]
        pages = torch.tensor(meta.page_ids[i], dtype=torch.long)
        slots = (pages[:, None] * ps + torch.arange(ps, dtype=torch.long)).reshape(-1)[:n]
        if length > n:
            slots = torch.cat((slots, slots[:1].expand(length - n)))
        return slots

    def _decode_chunk(self, seqs: list[int], window: int) -> _Chunk:
        meta, device = self._meta, self._device
        start = self._offsets[seqs[0]]
        if self._kernel is not None:  # the rows' own pages, read in place
            # The step's own CSR metadata, sliced: a decode chunk's sequences are consecutive.
            first, last = seqs[0], seqs[-1] + 1
            indptr = meta.kv_indptr[first : last + 1]
            paged = (
                (indptr - indptr[0]).contiguous(),
                meta.kv_indices[int(indptr[0]) : int(indptr[-1])].contiguous(),
                torch.tensor(meta.kv_lens[first:last], dtype=torch.int32),
            )
            return _Chunk(
                start=start,
                end=start + len(seqs),
                batch=len(seqs),
                index=torch.empty(0, dtype=torch.long),
                by_rows=True,
                kv_len=0,
                mask=None,
                padding=None,
                causal=False,
                decode=True,
                paged=paged,
                window=window,
            )
        lens = [meta.kv_lens[i] for i in seqs]
        kv_len = max(lens)
        mask = padding = None
        if min(lens) != kv_len or 0 < window < kv_len:
            keys, ends = torch.arange(kv_len)[None, :], torch.tensor(lens)[:, None]
            valid = keys < ends
            if window > 0:
                valid &= keys >= ends - window
            mask = valid[:, None, None].to(device)
            padding = mask.logical_not()
        upcast = (
            self._matmul_decode
            and device.type == "cpu"
            and len(seqs) * kv_len <= _CPU_UPCAST_DECODE_KEYS
        )
        return _Chunk(
            start=start,
            end=start + len(seqs),
            batch=len(seqs),
            index=self._index(seqs, kv_len, self._matmul_decode),
            by_rows=self._matmul_decode,
            kv_len=kv_len,
            mask=mask,
            padding=padding,
            causal=False,
            decode=True,
            upcast=upcast,
        )

    def _prefill_chunk(self, i: int, window: int) -> _Chunk:
        meta, device = self._meta, self._device
        n, q_start, kv_len = meta.qo_lens[i], meta.q_starts[i], meta.kv_lens[i]
        mask = None
        if q_start != 0 or 0 < window < kv_len:
            q_pos = torch.arange(q_start, q_start + n, device=device)[:, None]
            keys = torch.arange(kv_len, device=device)[None, :]
            mask = keys <= q_pos
            if window > 0:
                mask &= keys > q_pos - window
        return _Chunk(
            start=self._offsets[i],
            end=self._offsets[i + 1],
            batch=1,
            index=self._index([i], kv_len, False),
            by_rows=False,
            kv_len=kv_len,
            mask=mask,
            padding=None,
            causal=mask is None and n > 1,
            decode=False,
        )

    def __call__(
        self, q: torch.Tensor, kv_layer: torch.Tensor, window: int = 0, softcap: float = 0.0
    ) -> torch.Tensor:
        if not self._built:
            self._build(q.dtype, q.shape[1], kv_layer)
        chunks = self._chunks if window == 0 else self._window_plan(window)
        if len(chunks) == 1:
            return self._run(q, kv_layer, chunks[0], softcap)
        out = torch.empty_like(q)
        for c in chunks:
            out[c.start : c.end] = self._run(q[c.start : c.end], kv_layer, c, softcap)
        return out

    def _window_plan(self, window: int) -> list[_Chunk]:
        plan = self._windowed.get(window)
        if plan is None:
            plan = self._windowed[window] = self._plan(window)
        return plan

    def write_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        rows: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor | None:
        """Where the whole step is one run of decode rows on the C kernel, store ``k``/``v``
        at ``rows`` (:func:`kvcache.metadata.kv_rows`) and attend in one C call
        (``DecodeKernel.layer_writer``); else None, and nothing was written. ``rows`` is the
        same tensor at every layer of the step.
        NOTE: measured on a 2-core AVX2 EPYC, float32, SmolLM2-135M at B=1: the Python
        write (two index_copy_ and dtype casts) and the kernel's checked call took ~35 us a
        layer, the one checked-once call ~15."""
        if self._writer is None:
            self._writer = self._layer_writer(q, k, v, kv_layer, rows)
        if self._writer is False:
            return None
        return self._writer(q, k, v, kv_layer, window, softcap)

    def native_attend(
        self, q_heads: int, kv: torch.Tensor, rows: torch.Tensor, every_chunk: bool = False
    ) -> NativeAttend | None:
        """Where the step runs on the C kernel over a float32 pool ``kv`` (all layers), the
        step's attention for native model code (``DecodeKernel.step_context``), one kernel
        row per token: all-decode steps, and steps whose prefill chunks are short enough
        (:meth:`_token_rows`), or with ``every_chunk`` any steps; else None. ``rows`` as
        :meth:`write_attend`'s. Each token is then one kernel job per KV head over its own
        prefix, keys in page order, with no split across threads: its arithmetic does not
        depend on the batch, the chunking or the token's place in the step.
        NOTE: measured on a 2-core Xeon (AMX), SmolLM2-135M, 13 sequences decoding at ~150
        keys: a step that also carried a 6-token chunk took 8.5 ms more than the decode step
        through the per-layer Python path and 2.7 ms more this way (a 30-token chunk 17
        against 10 ms more)."""
        meta = self._meta
        if kv.dtype not in _NATIVE_POOLS or kv.dim() != 6 or self._device.type != "cpu":
            return None
        kernel = cpu_decode.kernel()
        if kernel is None or not kernel.supports(q_heads, kv[0]):
            return None
        # None where no layer has a window: nothing to build per step
        windows = torch.tensor(meta.windows, dtype=torch.int32) if meta.windows else None
        caps = torch.tensor(meta.softcaps, dtype=torch.float32) if meta.softcaps else None
        if all(n == 1 for n in meta.qo_lens):
            # The step's own CSR metadata (what _build's one decode chunk slices out of it)
            lens = torch.tensor(meta.kv_lens, dtype=torch.int32)
            return kernel.step_context(
                q_heads, kv, rows, meta.kv_indptr, meta.kv_indices, lens, windows, caps
            )
        per_token = self._token_rows(None if every_chunk else _NATIVE_CHUNK_KEYS)
        if per_token is None:
            return None
        return kernel.step_context(q_heads, kv, rows, *per_token, windows, caps)

    def _token_rows(
        self, max_keys: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The step's metadata with every token a row of its own, for the decode kernel: a
        prefill chunk's token at position p attends over its sequence's first p + 1 keys
        (causal), through that sequence's own pages. None where the chunks' tokens would
        read more than ``max_keys`` keys between them (each token reads its whole prefix:
        cheap beside short contexts, not beside long ones); None for no limit."""
        meta = self._meta
        pages = meta.kv_indptr.tolist()
        indptr, lens, spans = [0], [], []
        keys = 0
        for i, (n, total) in enumerate(zip(meta.qo_lens, meta.kv_lens, strict=True)):
            first, last = pages[i], pages[i + 1]
            if n > 1:
                keys += n * total
                if max_keys is not None and keys > max_keys:
                    return None
            for j in range(n):
                lens.append(total - n + j + 1)
                spans.append((first, last))
                indptr.append(indptr[-1] + last - first)
        index = torch.cat([meta.kv_indices[a:b] for a, b in spans])
        return (
            torch.tensor(indptr, dtype=torch.int32),
            index.to(torch.int32).contiguous(),
            torch.tensor(lens, dtype=torch.int32),
        )

    def _layer_writer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        rows: torch.Tensor,
    ) -> cpu_decode.LayerWriter | Literal[False]:
        if not self._built:
            self._build(q.dtype, q.shape[1], kv_layer)
        if len(self._chunks) != 1 or self._kernel is None:
            return False
        paged = self._chunks[0].paged
        if paged is None or not q.dtype == k.dtype == v.dtype:
            return False
        if q.dtype != kv_layer.dtype and (q.dtype, kv_layer.dtype) != _WIDE_Q_NARROW_POOL:
            return False
        return self._kernel.layer_writer(q, k, v, kv_layer, rows, *paged)

    def _run(
        self, q: torch.Tensor, kv_layer: torch.Tensor, c: _Chunk, softcap: float = 0.0
    ) -> torch.Tensor:
        if c.paged is not None and self._kernel is not None:
            return self._kernel.run(q, kv_layer, *c.paged, c.window, softcap)
        _, hq, d = q.shape
        hkv = kv_layer.shape[-2]
        n = c.kv_len
        if c.by_rows:  # [2, B, Hkv, N, D]: each (sequence, head) block contiguous
            kv = kv_layer.view(-1, d).index_select(0, c.index).view(2, c.batch, hkv, n, d)
        else:  # whole pages, [2, B, P * ps, Hkv, D] -> strided [2, B, Hkv, N, D] view
            kv = kv_layer.view(2 * kv_layer.shape[0], -1).index_select(0, c.index)
            kv = kv.view(2, c.batch, -1, hkv, d)[:, :, :n].transpose(2, 3)
        if c.upcast:  # one conversion for K and V together, and the query's in float32
            kv, qf = kv.float(), q.float()
        else:
            kv, qf = kv.to(q.dtype), q
        k, v = kv[0], kv[1]
        if c.decode and c.by_rows:
            # GQA without copies: q head h*group + g reads kv head h.
            qg = qf.reshape(c.batch, hkv, hq // hkv, d) * (d**-0.5)
            scores = torch.matmul(qg, k.transpose(-1, -2))
            if softcap > 0:
                scores = torch.tanh(scores / softcap) * softcap
            if c.padding is not None:
                scores.masked_fill_(c.padding, float("-inf"))
            # float32 softmax without a separate upcast op: same values, one kernel fewer.
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(k.dtype)
            return torch.matmul(probs, v).view(c.batch, hq, d).to(q.dtype)
        if c.decode:
            qd = q.reshape(c.batch, hq, 1, d)
            if softcap > 0:
                out = softcapped_attention(qd, k, v, c.mask, False, softcap)
            else:
                out = F.scaled_dot_product_attention(qd, k, v, attn_mask=c.mask, enable_gqa=True)
            return out.view(c.batch, hq, d)
        qb = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Tq, D]
        if softcap > 0:
            out = softcapped_attention(qb, k, v, c.mask, c.causal, softcap)
        else:
            out = F.scaled_dot_product_attention(
                qb, k, v, attn_mask=c.mask, is_causal=c.causal, enable_gqa=True
            )
        return out[0].transpose(0, 1)


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float,
) -> torch.Tensor:
    """SDPA's contract (``q`` ``[B, Hq, Tq, D]``, ``k``/``v`` ``[B, Hkv, N, D]``, boolean
    ``mask`` True = attend broadcast to ``[B, Hq, Tq, N]``, ``causal`` top-left, GQA) with
    each scaled score ``s`` taken as ``softcap * tanh(s / softcap)`` before the mask and a
    float32 softmax, as Gemma 2's reference attention computes it. Returns ``q``'s dtype."""
    b, hq, tq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    # GQA without copies: q head h*group + g reads kv head h.
    qg = q.float().reshape(b, hkv, hq // hkv * tq, d) * (d**-0.5)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).view(b, hq, tq, n)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(tq, n, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, hq // hkv * tq, n)
    out = torch.matmul(probs, v.float()).view(b, hq, tq, d)
    return out.to(q.dtype)


class TorchBackend:
    """The default backend: works on any device torch supports."""

    def prepare(self, metadata: AttentionMetadata) -> TorchStep:
        return TorchStep(metadata)
