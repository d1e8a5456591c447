"""Correctness against the reference implementation (Hugging Face transformers).

Runs the same checks as tests/model/test_parity_default.py on the default model and prints
exactly one line:

    parity: max_abs_logit_diff=<x> greedy_match=<k>/<n> tokenizer_match=<k>/<n>

Exits non-zero when any check fails (logits beyond 1e-3, a greedy or tokenizer mismatch, or a
chat template rendering that differs). Run as ``.venv/bin/python bench/parity.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.fixtures


def stage(text: str, started: float) -> None:
    """A progress line on stderr (stdout carries only the result line)."""
    print(f"parity: [{time.monotonic() - started:5.1f}s] {text}", file=sys.stderr, flush=True)


def main() -> int:
    started = time.monotonic()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF dequantization bar
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    from service.model import load_model
    from service.model.default import ensure_default_model
    from tests.fixtures.parity import load_hf_oracle, run_parity

    path = ensure_default_model()
    stage(f"loading {path.name} with kvfence (fp32)", started)
    loaded = load_model(path, dtype="float32", progress=False)
    stage("loading the same GGUF with transformers (the oracle)", started)
    hf_model, hf_tok = load_hf_oracle(path)
    stage("comparing logits, greedy tokens, tokenizer and chat template (a few minutes)",
          started)
    report = run_parity(loaded, hf_model, hf_tok)
    stage("done", started)
    print(report.line())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
