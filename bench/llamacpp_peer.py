"""Peer: llama.cpp through llama-cpp-python's low-level API, with batched decoding.

`n_seq` slots share one `llama_batch` per step, as llama.cpp's own server does: every step feeds
one token for each decoding slot plus prompt chunks for newly admitted requests (up to n_batch
tokens), and a finished slot is cleared and refilled from the queue at once. Greedy = argmax of
the row's logits; EOS is never checked, so each request produces exactly its max_tokens.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Throughput, Work, throughput

N_BATCH = 512


@dataclass(slots=True)
class _Slot:
    work: Work
    out: list[int]  # the request's generated ids, appended as they are sampled
    fed: int = 0  # prompt tokens already placed in a batch
    generated: int = 0  # tokens sampled so far
    last: int = 0  # last sampled token, fed on the next step
    index: int = 0  # the request's position in the work list


def _drop_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    return None


def _quiet_logs(llama_cpp: Any) -> Any:
    callback = llama_cpp.llama_log_callback(_drop_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback  # the caller keeps a reference so ctypes does not free the callback


class LlamaCppRunner:
    """One model + context with `n_seq` parallel sequences of up to `max_len` tokens each."""

    def __init__(
        self,
        gguf: Path,
        n_seq: int,
        threads: int,
        max_len: int = 512,
        *,
        kv_unified: bool = False,
        flash_attn: bool | None = None,
    ) -> None:
        import llama_cpp

        self._ll = llama_cpp
        self._log_cb = _quiet_logs(llama_cpp)
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_seq * max_len
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        # Separate per-sequence KV is recommended when sequences share no prefix; the unified
        # buffer is llama-server's default. flash_attn None keeps the library's default (auto).
        cparams.kv_unified = kv_unified
        if flash_attn is not None:
            cparams.flash_attn_type = (
                llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
                if flash_attn
                else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))
        self._batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        self.n_seq = n_seq
        self.threads = threads
        self.max_len = max_len
        self.kv_unified = kv_unified
        self.flash_attn = flash_attn

    @property
    def config(self) -> str:
        fa = {None: "auto", True: "on", False: "off"}[self.flash_attn]
        return f"n_seq={self.n_seq} kv_unified={'on' if self.kv_unified else 'off'} fa={fa}"

    def close(self) -> None:
        self._ll.llama_batch_free(self._batch)
        self._ll.llama_free(self._ctx)
        self._ll.llama_model_free(self._model)

    def _add(self, n: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self._batch
        b.token[n] = token
        b.pos[n] = pos
        b.n_seq_id[n] = 1
        b.seq_id[n][0] = seq
        b.logits[n] = 1 if logits else 0

    def _argmax(self, row: int) -> int:
        ptr = self._ll.llama_get_logits_ith(self._ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self._vocab,)).argmax())

    def generate(
        self, work: Sequence[Work], token_times: list[list[float]] | None = None
    ) -> list[list[int]]:
        """Run every request to exactly its max_tokens greedily; returns the generated ids.
        ``token_times`` (one list per request) receives each token's perf_counter time."""
        for w in work:
            if len(w.prompt_ids) + w.max_tokens > self.max_len:
                raise ValueError(f"request of {len(w.prompt_ids)}+{w.max_tokens} > {self.max_len}")
        queue = deque(enumerate(work))
        outputs: list[list[int]] = [[] for _ in work]
        slots: list[_Slot | None] = [None] * self.n_seq
        self._ll.llama_memory_clear(self._mem, True)
        while queue or any(slots):
            for i, s in enumerate(slots):
                if s is None and queue:
                    index, w = queue.popleft()
                    slots[i] = _Slot(w, outputs[index], index=index)
            n, rows = 0, []
            for seq, s in enumerate(slots):  # decodes first, one token each
                if s is not None and s.generated > 0:
                    self._add(n, s.last, len(s.work.prompt_ids) + s.generated - 1, seq, True)
                    rows.append((n, seq))
                    n += 1
            for seq, s in enumerate(slots):  # then prompt chunks within the token budget
                if s is None or s.generated > 0 or n >= N_BATCH:
                    continue
                prompt = s.work.prompt_ids
                take = min(len(prompt) - s.fed, N_BATCH - n)
                for j in range(s.fed, s.fed + take):
                    last = j == len(prompt) - 1
                    self._add(n, prompt[j], j, seq, last)
                    if last:
                        rows.append((n, seq))
                    n += 1
                s.fed += take
            self._batch.n_tokens = n
            rc = self._ll.llama_decode(self._ctx, self._batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for row, seq in rows:
                s = slots[seq]
                assert s is not None
                s.last = self._argmax(row)
                s.out.append(s.last)
                if token_times is not None:
                    token_times[s.index].append(time.perf_counter())
                s.generated += 1
                if s.generated >= s.work.max_tokens:
                    self._ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
                    slots[seq] = None
        return outputs


def run_llamacpp(
    runner: LlamaCppRunner, work: Sequence[Work], outputs: list[list[int]] | None = None
) -> Throughput:
    """Time ``runner`` on ``work``; ``outputs`` (when given) receives each request's ids."""
    start = time.perf_counter()
    got = runner.generate(work)
    wall = time.perf_counter() - start
    if outputs is not None:
        outputs[:] = got
    return throughput(
        f"llama.cpp {runner.config}",
        work,
        wall,
        f"batched llama_decode, {runner.n_seq} slots, n_batch={N_BATCH}, threads={runner.threads}",
    )
