"""Correctness against the reference implementation (Hugging Face transformers).

Runs the checks of tests/model/test_parity_default.py on the default model, in five rows:

    fp32 --weights bf16  dense fp32 vs transformers fp32: prefill logits <= 1e-3, greedy identical,
                         tokenizer and chat template identical
    fp32 --weights int4  the file's own blocks (Q4_1 as 4-bit, Q8_0 as int8) through kvfence's
                         float32 GEMV (what auto runs on CPUs without AVX512-BF16), vs
                         transformers fp32 on the same dequantized weights: greedy identical
                         but for exact ties (the oracle scoring both tokens within 1e-3,
                         tools/parity/checks.TIE_TOL), decode logits <= 0.05 (the GEMV rounds
                         activations to int16 per block of 32; see PACKED_LOGITS_TOL)
    auto --weights auto  the served configuration (--dtype auto; on a CPU with AVX512-BF16 or
                         AMX float32 decode through the GEMV and bf16 dense weights for the
                         prefill) vs transformers fp32: >= 98% teacher-forced top-1 agreement
                         (SERVED_MIN_AGREEMENT), and as the fp32 int4 row where it computes in
                         one dtype
    bf16 --weights bf16  dense bf16 vs transformers bf16 (same weights, rounded alike)
    bf16 --weights auto  --dtype bfloat16 --weights auto vs transformers bf16

A sixth row covers the second pullable model, Gemma 3 270M Q4_K_M (``kvfence models pull
gemma-3-270m``, pulled here if absent; see tools/parity/second.py): dense fp32 against
transformers fp32 on the same GGUF: tokenizer identical, greedy identical on the four
prompts, and chat through its own template rendered and continued identically.

The bf16 rows compare two bf16 implementations whose sums round differently, so near-ties
may flip; they pass at >= 97% teacher-forced top-1 agreement (the oracle's next-token pick on
our history equals our token) and print greedy-identical prompts and the logit difference.
Exits non-zero when any row fails. Run as ``make parity`` (``.venv/bin/python -m tools.parity``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

BF16_MIN_AGREEMENT = 0.97


def _quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF dequantization bar
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def stage(text: str, started: float) -> None:
    """One progress line on stderr, so a run of several minutes is never silent."""
    print(f"parity [{time.monotonic() - started:5.0f}s] {text}", file=sys.stderr, flush=True)


def main() -> int:
    started = time.monotonic()
    _quiet()
    import torch

    from service.model import load_model
    from service.model.default import ensure_default_model
    from tools.parity.checks import (
        PACKED_LOGITS_TOL,
        SERVED_MIN_AGREEMENT,
        decode_parity,
        load_hf_oracle,
        run_parity,
    )
    from tools.parity.corpus import PROMPTS

    path = ensure_default_model()
    prompts = PROMPTS[:4]
    ok = True
    stage("loading the same GGUF with transformers (the fp32 oracle)", started)
    hf_model, hf_tok = load_hf_oracle(path)
    stage(f"kvfence fp32 dense vs the oracle: logits, greedy, tokenizer, template ({path.name})",
          started)
    dense = load_model(path, dtype="float32", weights="bf16", progress=False)
    report = run_parity(dense, hf_model, hf_tok)
    print("fp32 --weights bf16: " + report.line().removeprefix("parity: "), flush=True)
    ok &= report.ok
    del dense
    stage("kvfence fp32 int4 packs vs the oracle", started)
    packed = load_model(path, dtype="float32", weights="int4", progress=False)
    row = decode_parity(packed, hf_model, prompts)
    print(row.line("fp32 --weights int4"), flush=True)
    ok &= row.greedy_ok and row.max_abs_logit_diff <= PACKED_LOGITS_TOL
    del packed
    stage("kvfence --dtype auto --weights auto (as served) vs the oracle", started)
    served = load_model(path, progress=False)
    row = decode_parity(served, hf_model, prompts)
    names = [str(d).removeprefix("torch.") for d in (served.dtype, served.dense_weights_dtype)]
    print(row.line(f"auto --weights auto ({names[0]}, dense {names[1]})"), flush=True)
    ok &= row.agree >= SERVED_MIN_AGREEMENT * row.positions
    if served.dense_dtype is None:  # one dtype: as the rows above
        ok &= row.greedy_ok and (
            served.dtype != torch.float32 or row.max_abs_logit_diff <= PACKED_LOGITS_TOL
        )
    del served, hf_model
    stage("loading the bf16 oracle", started)
    hf_bf16, _ = load_hf_oracle(path, torch.bfloat16)
    for weights in ("bf16", "auto"):
        stage(f"kvfence bf16 --weights {weights} vs the bf16 oracle", started)
        loaded = load_model(path, dtype="bfloat16", weights=weights, progress=False)
        row = decode_parity(loaded, hf_bf16, prompts)
        print(row.line(f"bf16 --weights {weights} ({loaded.weights})"), flush=True)
        ok &= row.agree >= BF16_MIN_AGREEMENT * row.positions
    del hf_bf16
    ok &= _second_model(started)
    print(f"parity: {'pass' if ok else 'FAIL'}")
    return 0 if ok else 1


def _second_model(started: float) -> bool:
    from service.model.catalog import GEMMA3_270M, ensure_model
    from tools.parity.checks import load_hf_oracle
    from tools.parity.second import load_second, second_model_parity

    path = ensure_model(GEMMA3_270M.name)
    stage(f"loading {path.name} with transformers (the second model's fp32 oracle)", started)
    hf_model, hf_tok = load_hf_oracle(path)
    stage(f"kvfence fp32 dense {GEMMA3_270M.name} vs the oracle", started)
    loaded = load_second(path, GEMMA3_270M.chat_template)
    row = second_model_parity(loaded, hf_model, hf_tok)
    print(row.line(f"{GEMMA3_270M.name} fp32 --weights bf16"), flush=True)
    return row.ok


if __name__ == "__main__":
    sys.exit(main())
