"""``--compile``: small decode batches through a ``torch.compile`` forward (inductor, CPU).

At one stream a CPU decode step is ~800 small ops: the int4 GEMVs read the weights, and the
rest (RMSNorm, RoPE, residual adds, SiLU, the views and copies around them) is dispatch
overhead more than arithmetic. Inductor fuses those into a few generated C++ loops per layer
and calls the GEMVs and the attention directly.
NOTE: measured on a 2-core Xeon (AVX512-BF16, AMX), SmolLM2-135M Q4_1 ``--weights auto``,
one stream at ~130 tokens of context: engine step 11.8 ms eager, 10.3 ms compiled. On a
2-core Xeon with AMX-INT8 and AVX512-FP16, ~50 tokens of context: 8.8 ms eager, 7.3 ms
compiled with the KV write as two index_copy_ calls a layer, 6.8 ms with the write inside
the attention's C call. Inductor's C++ wrapper (``cpp_wrapper``) took another 0.2 ms off
(6.6 ms) but more than doubled the first start's compile (~150 s against ~55 s for three
buckets), so it is not used.

How it is wired (the same static-buffer design as CUDA graphs, service/engine/cuda_graphs.py):

- one compiled forward per decode bucket (1, 2, 4 sequences: the batches the packed GEMVs
  serve; larger decode batches and every prefill run eagerly), built at start while no page
  is handed out, on the engine thread;
- the step's token ids, positions, KV rows and page lists are copied into static buffers
  from the fenced ``StepAttention`` before each call (``GraphDecodeAttention.update``), and
  the KV write plus the paged attention are one opaque op (kvcache/backends/cpu_graph.py);
- ``emulate_precision_casts``: inductor rounds every intermediate to bf16 where eager torch
  does, so the compiled step computes what the eager one does (without it, fused bf16 ops
  kept float32 intermediates and greedy outputs drifted from the eager engine's);
- replays call the compiled graph directly, without dynamo (see :func:`compile_recorder`).

``auto`` compiles where it can: CPU, bf16 compute, a C++ compiler (``$CXX``, else ``g++``
or ``c++``) and the CPU decode kernel. ``on`` raises :class:`CompileUnavailable` with the
reason where it cannot. Inductor caches what it builds (``$TORCHINDUCTOR_CACHE_DIR``, set
to ``$KVFENCE_HOME/inductor`` or ``~/.cache/kvfence/inductor`` when unset), so later starts
skip most of the work. That directory holds code this process loads, so it is kept as the
kernel cache is: owner-only, and replaced by a private one where another user could write it
(:func:`inductor_cache_dir`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import structlog
import torch

from kvcache import native_build
from kvcache.backends import cpu_graph
from kvcache.graph_step import FusedDecodeAttention
from kvcache.pool import PagePool
from service.engine.core import EngineCore
from service.engine.cuda_graphs import DecodeGraphs, Forward
from service.model.decoder import DecoderModel

log = structlog.get_logger(__name__)

COMPILE_MODES = ("auto", "on", "off")


class CompileUnavailable(RuntimeError):
    """``--compile on`` where the compiled path cannot run; the message says why."""


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use, or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def unavailable_reason(model: DecoderModel, pool: PagePool) -> str | None:
    """Why the compiled decode path cannot run for this model, or None if it can."""
    if model.device.type != "cpu":
        return f"it runs on CPU (device is {model.device})"
    if model.dtype != torch.bfloat16:
        dtype = str(model.dtype).removeprefix("torch.")
        return f"it needs bf16 compute (dtype is {dtype}: pass --dtype bfloat16)"
    if model.max_packed_rows == 0:
        return "it serves the packed decode weights (--weights auto, int4 or int8), and there are none"
    if pool.windows:
        return "a layer attends within a sliding window, which its decode kernel does not take"
    if pool.softcaps:
        return "a layer softcaps its attention logits, which its decode kernel does not take"
    if cxx_compiler() is None:
        return "no C++ compiler found (install g++ or set CXX)"
    if not cpu_graph.available(model.config.num_heads, pool.layer(0)):
        return "the CPU paged decode kernel is not available (needs a C compiler)"
    return None


def decode_buckets(model: DecoderModel, max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes that get a compiled forward: 1, 2, 4 up to the largest batch
    the packed GEMVs serve and ``max_num_seqs``."""
    top = min(model.max_packed_rows, max_num_seqs)
    return tuple(b for b in (1, 2, 4) if b <= top) or (1,)


def inductor_cache_dir() -> Path:
    """Where inductor keeps what it builds (it loads that code into this process):
    ``$TORCHINDUCTOR_CACHE_DIR``, else ``$KVFENCE_HOME/inductor`` or
    ``~/.cache/kvfence/inductor``, made 0700; where that directory (or one above it) could
    have been written by another user, a fresh private directory instead
    (:func:`kvcache.native_build.private_dir`)."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return native_build.private_dir("inductor", Path(configured) if configured else None)


def compile_recorder(forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
    """``DecodeGraphs``' recorder for a compiled forward.

    The first call traces ``forward`` (dynamo) and compiles it (inductor). Replays then call
    inductor's compiled graph directly on the inputs the trace found, skipping dynamo's
    per-call work (gathering ~300 weight and buffer tensors and checking guards: 0.4-0.6 ms
    a step here). That is sound because of the static-buffer design: every input of the
    graph is a weight or a static buffer that ``GraphDecodeAttention.update`` and the
    runner refill in place, so the same tensors are the inputs of every call."""
    from torch._dynamo import reset_code  # type: ignore[attr-defined]
    from torch._inductor.compile_fx import compile_fx

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    graphs: list[tuple[Callable[..., Any], list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled_graph = cast(Callable[..., Any], compile_fx(gm, example_inputs))
        graphs.append((compiled_graph, list(example_inputs)))
        return compiled_graph

    traced = torch.compile(forward, backend=backend, fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        out = traced().clone()
    # Replays never go through dynamo again, so its cache entry for ``forward``'s code is
    # dropped: every bucket of every engine shares that code object, and kept entries would
    # pile up (dynamo refuses a 9th) and hold each old engine's buffers alive.
    reset_code(forward.__code__)
    if len(graphs) != 1 or not all(isinstance(x, torch.Tensor) for x in graphs[0][1]):
        raise RuntimeError("the decode forward did not compile to one graph of tensor inputs")
    run, inputs = graphs[0]

    def call() -> torch.Tensor:
        result = run(*inputs)
        return cast(torch.Tensor, result[0] if isinstance(result, (list, tuple)) else result)

    def replay() -> None:
        out.copy_(call())

    if not torch.equal(call(), out):  # the direct call computes what the traced one did
        raise RuntimeError("the compiled decode graph called directly disagrees with its trace")
    return replay, out


def attach(core: EngineCore, model: DecoderModel, mode: str) -> DecodeGraphs | None:
    """Give ``core`` compiled decode forwards per ``mode`` (auto | on | off); returns them,
    or None when ``mode`` is off or (``auto``) the path cannot run here. Call before any
    request: the compiles write dummy K/V to page 0 and zero it again."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; use {', '.join(COMPILE_MODES)}")
    if mode == "off":
        return None
    pool = core.pool
    reason = unavailable_reason(model, pool)
    if reason is not None:
        if mode == "on":
            raise CompileUnavailable(f"--compile on: the compiled decode path cannot run: {reason}")
        log.info("decode_compile_skipped", reason=reason)
        return None
    if core.has_work() or core.num_free_pages() != pool.num_pages:
        raise RuntimeError("compile decode forwards before any request holds a page")
    buckets = decode_buckets(model, core.config.max_num_seqs)
    max_pages = -(-core.config.max_model_len // pool.page_size)
    started = time.perf_counter()
    graphs = DecodeGraphs(
        model,
        pool,
        lambda size: cpu_graph.CpuGraphDecode(size, max_pages, pool.device),
        buckets,
        compile_recorder,
        attention=FusedDecodeAttention,
    )
    core.use_graphs(graphs)
    log.info("decode_compiled", buckets=list(buckets), seconds=round(time.perf_counter() - started, 1))
    return graphs
