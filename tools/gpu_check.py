"""The whole GPU check in one call: ``make gpu-check`` on a CUDA machine.

1. ``pytest -m cuda`` (FlashInfer == torch backend, fences before plans, scrubbing on GPU,
   graph capture);
2. greedy equality end to end against transformers on tiny random Llama/Qwen2/Qwen3
   checkpoints, for each backend, eager and graphed;
3. decode throughput of a Llama-3.1-8B-shaped random bf16 model against transformers, each
   as a fraction of the HBM roofline;
4. isolation checks on device memory.

Writes gpu.json, gpu.md and gpu.log to ``--out`` (default: ``$OUT`` when set, else
bench/results). ``--dry-run`` runs the same code on CPU with tiny shapes and the torch
backend (graphs replayed eagerly): ``make test`` runs it so the script cannot rot.
Exits non-zero if any requirement is missed.

On the lent H200 (no network, the image's python3 and torch): fetch the wheels here with
``make gpu-wheels``, then run, carrying ``.whl``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site make gpu-check

(``make gpu-check`` installs ``.whl`` itself when present; the explicit line is for an image
without ``make``: then ``python3 tools/gpu_check.py``.) Budget: FlashInfer JIT-compiles its
decode and fa2 prefill kernels on first use, then the four steps run; the plan was sized to
end inside 8 minutes by estimate (it has not yet run on a device).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for bench.*, tests.fixtures

import torch

from bench.common import RESULTS_DIR
from tools.gpu import report
from tools.gpu.checks import greedy_check, isolation_check, pytest_check
from tools.gpu.plan import Plan, dry_run_plan, full_plan
from tools.gpu.throughput import throughput_check

log = logging.getLogger("gpu_check")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def run(plan: Plan, out_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    timings: dict[str, float] = {}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        steps = (
            ("pytest", lambda: pytest_check(plan, Path(tmp) / "junit.xml")),
            ("greedy", lambda: greedy_check(plan, Path(tmp))),
            ("throughput", lambda: throughput_check(plan)),
            ("isolation", lambda: isolation_check(plan)),
        )
        for name, step in steps:
            t0 = time.perf_counter()
            log.info("step %s: start", name)
            result[name] = step()
            timings[name] = time.perf_counter() - t0
            log.info("step %s: %.1f s: %s", name, timings[name], result[name])
    device_name = torch.cuda.get_device_name() if plan.device == "cuda" else "cpu"
    result["meta"] = {
        "dry_run": plan.dry_run,
        "device": plan.device,
        "device_name": device_name,
        "torch": torch.__version__,
        "flashinfer": _version("flashinfer-python"),
        "transformers": _version("transformers"),
        "step_seconds": timings,
        "seconds": time.perf_counter() - started,
    }
    result["targets"] = [t.as_dict() for t in report.targets(result, plan.dry_run)]
    report.write(out_dir, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, no CUDA")
    parser.add_argument("--out", type=Path, default=None, help="where gpu.json/gpu.md/gpu.log go")
    args = parser.parse_args(argv)
    out_env = os.environ.get("OUT")
    out_dir = args.out or (Path(out_env) if out_env else RESULTS_DIR)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); use --dry-run on CPU",
            file=sys.stderr,
        )
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [
        logging.StreamHandler(sys.stdout),
        logging.FileHandler(out_dir / "gpu.log", mode="w"),
    ]
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", handlers=handlers, force=True
    )
    plan = dry_run_plan() if args.dry_run else full_plan()
    result = run(plan, out_dir)
    missed = [t["name"] for t in result["targets"] if not t["passed"]]
    log.info("gpu_check: %s", "all requirements met" if not missed else f"missed: {missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
