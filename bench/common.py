"""Shared benchmark plumbing: machine facts, workloads, targets, result files and plots."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Random prompt ids are drawn above the special/byte tokens so every system sees plain text tokens.
FIRST_PLAIN_TOKEN = 1000
# Every figure in a table is the median of at least this many timed runs, shown with its
# [min–max]; a target passes only if its worst run passes.
RUNS = 3
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma", "f16c")


@dataclass(frozen=True, slots=True)
class Work:
    """One benchmark request: prompt token ids and exactly how many tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Target:
    """A pass/miss line; margin is signed in the value's units, positive means passed."""

    name: str
    value: float
    threshold: float
    higher_is_better: bool = True

    @property
    def passed(self) -> bool:
        return self.margin >= 0

    @property
    def margin(self) -> float:
        d = self.value - self.threshold
        return (d if self.higher_is_better else -d) + 0.0  # + 0.0 turns -0.0 into 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "margin": self.margin}


@dataclass(frozen=True, slots=True)
class Spread:
    """The timed runs of one figure: shown as median [min–max], judged on the worst run."""

    runs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("a figure needs at least one timed run")

    @property
    def median(self) -> float:
        return float(statistics.median(self.runs))

    @property
    def min(self) -> float:
        return min(self.runs)

    @property
    def max(self) -> float:
        return max(self.runs)

    def worst(self, higher_is_better: bool = True) -> float:
        return self.min if higher_is_better else self.max

    def scaled(self, factor: float) -> Spread:
        return Spread(tuple(v * factor for v in self.runs))

    def __str__(self) -> str:
        return fmt_spread(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "runs": list(self.runs)}


def spread(values: Iterable[float]) -> Spread:
    return Spread(tuple(float(v) for v in values))


def spreads(runs: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, Spread]:
    """{key: Spread of that key over ``runs``} for the numeric keys of per-run dicts."""
    return {k: spread(r[k] for r in runs) for k in keys}


def worst_target(
    name: str, runs: Spread, threshold: float, higher_is_better: bool = True
) -> Target:
    """A target judged on the worst of the runs (it passes only if every run passes)."""
    return Target(
        f"{name} (worst of {len(runs.runs)} runs)",
        runs.worst(higher_is_better),
        threshold,
        higher_is_better,
    )


def fmt_spread(s: Mapping[str, float]) -> str:
    """``median [min–max]`` of a Spread or of its JSON form."""
    return f"{_num(s['median'])} [{_num(s['min'])}–{_num(s['max'])}]"


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def bench_threads() -> int:
    """Every core this process may use; all systems run with this many threads.
    KVFENCE_BENCH_THREADS overrides it (for smoke runs on a busy machine)."""
    override = os.environ.get("KVFENCE_BENCH_THREADS")
    return int(override) if override else len(os.sched_getaffinity(0))


def set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def split_cores() -> tuple[set[int], set[int]]:
    """(server cores, load-generator cores): the first half of this process's cores and the
    rest, so no load generator takes CPU from the server it measures. The online suites that
    compare fronts need it: the clients differ in CPU per token (GuideLLM and the ``openai``
    SDK spend several times the gRPC client's), and on shared cores that difference would be
    charged to the front being driven."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended
            os.sched_setaffinity(int(tid), cpus)


def default_model_file() -> Path:
    """The default GGUF, located the way service.model.default does it."""
    try:
        from service.model.default import default_model_path

        return Path(default_model_path())
    except ImportError:
        home = os.environ.get("KVFENCE_HOME")
        if home:
            return Path(home) / "models" / MODEL_FILE
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(cache) / "kvfence" / "models" / MODEL_FILE


def gguf_vocab_size(path: Path) -> int:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return len(field.data)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model and flags, core count, library versions and the thread count used."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    torch_threads = None
    try:
        import torch

        torch_threads = torch.get_num_threads()
    except ImportError:
        pass
    llama_info = None
    try:
        import llama_cpp

        llama_info = llama_cpp.llama_print_system_info().decode().strip()
    except (ImportError, OSError):
        pass
    return {
        "cpu_model": model,
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "threads": threads,
        "torch_threads": torch_threads,
        "python": platform.python_version(),
        "versions": {
            d: _version(d)
            for d in ("kvfence", "torch", "transformers", "llama_cpp_python", "grpcio")
        },
        "llama_cpp_system_info": llama_info,
        "platform": platform.platform(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The checkout's commit, ``-dirty`` when tracked files differ from it (docs/benchmarks.md
    names the code each result ran on); None outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty.strip() else "")


def random_work(
    seed: int, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int
) -> list[Work]:
    """n requests with uniform prompt/output lengths (inclusive ranges) and random plain ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        plen = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        olen = int(rng.integers(output_range[0], output_range[1] + 1))
        ids = rng.integers(FIRST_PLAIN_TOKEN, vocab, size=plen)
        out.append(Work(tuple(int(i) for i in ids), olen))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return _num(v) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_table(targets: Sequence[Target]) -> str:
    rows = [
        (
            t.name,
            f"{t.value:.3f}",
            ("≥ " if t.higher_is_better else "≤ ") + f"{t.threshold:g}",
            "pass" if t.passed else "MISS",
            f"{t.margin:+.3f}",
        )
        for t in targets
    ]
    return md_table(("target", "measured", "goal", "result", "margin"), rows)


def results_dir(quick: bool) -> Path:
    """Full runs write bench/results/; --quick smoke runs write bench/results/quick/ so they
    never overwrite the real numbers."""
    return RESULTS_DIR / "quick" if quick else RESULTS_DIR


def write_suite(out: Path, suite: str, data: Mapping[str, Any], markdown: str) -> Path:
    """Write <out>/<suite>.json and <out>/<suite>.md; returns the JSON path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{suite}.json"
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    (out / f"{suite}.md").write_text(markdown.rstrip() + "\n")
    return path


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Target | Spread):
        return obj.as_dict()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def bar_plot(
    out: Path, name: str, labels: Sequence[str], values: Sequence[float], title: str, ylabel: str
) -> str:
    """Save <out>/<name>.png; returns the file name for markdown links."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = ax.bar(range(len(values)), values, color="#4c72b0")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return _save(fig, out, name)


def line_plot(
    out: Path,
    name: str,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    title: str,
    xlabel: str,
    ylabel: str,
) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out, name)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    _pyplot().close(fig)
    return f"{name}.png"


@dataclass(frozen=True, slots=True)
class Throughput:
    """One timed offline run. Output tokens count only what each request asked for."""

    system: str
    wall_s: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    notes: str = ""

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


def throughput(system: str, work: Sequence[Work], wall_s: float, notes: str = "") -> Throughput:
    return Throughput(
        system,
        wall_s,
        len(work),
        sum(len(w.prompt_ids) for w in work),
        sum(w.max_tokens for w in work),
        notes,
    )
