"""The offline suite's llama.cpp peers: ``llama-server`` swept and timed, ``llama-batched-bench``.

llama-server gets the suite's work the way kvfence's HTTP row does: every request at once
through bench/http_client.py (the ``openai`` SDK, streaming ``/v1/completions`` with token-id
prompts, greedy, ``ignore_eos``), after an untimed warm-up on the same server. Its slot count
and physical batch are swept on the first quarter of the work (bench.llama_server.sweep) and
the fastest setting is timed in full. llama-batched-bench measures llama.cpp's raw batched
prefill and decode at the work's mean prompt and output lengths, without a server or a
scheduler: a ceiling for what any llama.cpp front can reach on this machine.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Throughput, Work, throughput
from bench.http_client import run_http
from bench.kvfence_runner import check_complete
from bench.llama_server import API_KEY, BATCHED_BENCH, REQUEST_EXTRA, ServerConfig, binary, started
from bench.traces import RequestTrace

TENANT = "llama"
BATCHED_PARALLEL = (1, 2, 4, 8, 16, 32)
QUICK_PARALLEL = (1, 4)


async def _load(base_url: str, work: Sequence[Work]) -> tuple[float, list[RequestTrace]]:
    return await run_http(base_url, {TENANT: API_KEY}, work, (TENANT,), model=TENANT,
                          extra_body=REQUEST_EXTRA)


def run_server(
    config: ServerConfig, gguf: Path, work: Sequence[Work], warm: Sequence[Work], log: Path
) -> Throughput:
    """One timed run of ``work`` on a fresh server with ``config`` (start-up and warm-up
    untimed)."""
    with started(config, gguf, log) as base_url:
        asyncio.run(_load(base_url, warm))
        wall, traces = asyncio.run(_load(base_url, work))
    check_complete(work, traces)
    return throughput(
        config.label, work, wall,
        f"llama-server, {config.slots} slots, continuous batching, -ub {config.ubatch}, "
        f"{config.threads} threads; openai SDK over /v1/completions, all requests at once",
    )


@dataclass(frozen=True, slots=True)
class BatchedRow:
    """One llama-batched-bench point: ``parallel`` sequences of ``prompt`` then ``output``
    tokens each, prefill of all prompts first, then every sequence decoding together."""

    parallel: int
    prompt: int
    output: int
    prefill_s: float
    decode_s: float
    decode_tok_s: float  # llama-batched-bench's S_TG

    @property
    def output_tok_s(self) -> float:
        """Output tokens over prefill + decode time: the offline rows' measure."""
        return self.parallel * self.output / (self.prefill_s + self.decode_s)

    def as_dict(self) -> dict[str, Any]:
        return {"parallel": self.parallel, "prompt": self.prompt, "output": self.output,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_tok_s": self.decode_tok_s, "output_tok_s": self.output_tok_s}


def parse_batched(jsonl: str) -> list[BatchedRow]:
    """llama-batched-bench's ``--output-format jsonl`` lines (other lines are skipped)."""
    rows = []
    for line in jsonl.splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        rows.append(BatchedRow(int(d["pl"]), int(d["pp"]), int(d["tg"]), float(d["t_pp"]),
                               float(d["t_tg"]), float(d["speed_tg"])))
    return rows


def run_batched(
    gguf: Path, work: Sequence[Work], threads: int, parallel: Sequence[int]
) -> list[BatchedRow]:
    """llama-batched-bench at the work's mean prompt and output lengths, per parallel count."""
    prompt = round(sum(len(w.prompt_ids) for w in work) / len(work))
    output = round(sum(w.max_tokens for w in work) / len(work))
    args = [str(binary(BATCHED_BENCH)), "-m", str(gguf), "-c", str(max(parallel) * (prompt + output)),
            "-b", "2048", "-ub", "512", "-t", str(threads), "-tb", str(threads),
            "-npp", str(prompt), "-ntg", str(output), "-npl", ",".join(map(str, parallel)),
            "--output-format", "jsonl"]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"{BATCHED_BENCH} exited with {done.returncode}: {tail}")
    rows = parse_batched(done.stdout + "\n" + done.stderr)  # its log goes to either
    if not rows:
        raise RuntimeError(f"{BATCHED_BENCH} printed no jsonl rows")
    return rows
