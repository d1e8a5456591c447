"""``load_model``: a .gguf file or a Hugging Face directory -> a ready-to-run model.

``open_model`` reads only what precedes the weights (header, metadata, tokenizer, tensor
index), so ``kvfence serve`` can size its KV pool from the model's shape and refuse a bad
configuration before the slow part; ``load_model`` then reads the weights of that opened file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from kvcache import native_build
from service.model.chat_template import ChatTemplate, ChatTemplateError
from service.model.decoder import DecoderModel
from service.model.families.base import refuse_unused
from service.model.gguf_loader import GGUFCheckpoint, read_gguf
from service.model.hf_loader import HFCheckpoint, read_hf_dir
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig
from service.model.native import kernels
from service.model.packed import resolve_weights
from service.model.progress import Progress
from service.model.threads import on_fresh_thread
from service.model.tokenizer import Tokenizer
from service.model.weights import build_weights, tensor_names

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: DecoderModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    name: str
    path: Path
    dtype: torch.dtype
    weights: str = "bf16"  # resolved --weights mode: bf16 (dense only), file, int4 or int8
    dense_dtype: torch.dtype | None = None  # the dense projections' dtype where not ``dtype``
    batch_invariant: bool = False  # resolved --batch-invariant (DecoderModel.batch_invariant)

    @property
    def dense_weights_dtype(self) -> torch.dtype:
        """The dtype prefill and large batches compute the projections in."""
        return self.dense_dtype or self.dtype


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has native bf16 matmul (AVX512-BF16 or AMX)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def tier_has_bf16() -> bool:
    """Whether this process computes in bf16 where the CPU has it: not under a forced lower
    kernel tier (``KVFENCE_KERNEL_ISA=avx2`` or ``portable``), which stands for a CPU without
    AVX-512, where the dense weights are float32 as they would be on that CPU."""
    try:
        forced = native_build.march() != "native"
    except native_build.KernelBuildError:
        forced = False  # the kernels refuse the value and say so; the CPU decides here
    return not forced and cpu_has_bf16()


def resolve_precision(
    dtype: str, device: str, weights: str = "auto"
) -> tuple[torch.dtype, torch.dtype]:
    """``(compute, dense)``: the dtype a step computes in (activations, KV cache) and the
    dtype of the dense projection weights (prefill, large batches). They differ only for
    ``--dtype auto`` on a bf16-capable CPU with 4-bit decode weights (``--weights auto`` or
    ``int4``) where kvfence's float32 GEMV builds: float32 compute, so decode reads the
    4-bit blocks through that kernel (with the norm, RoPE, attention and MLP of every layer
    in one native call), and bf16 dense weights, which the batches of more than a few rows
    run through (cast in and out of bf16) at AMX/AVX512-BF16 speed.
    ``auto`` is otherwise bf16 on CUDA or a bf16-capable CPU, else float32.

    NOTE: measured on a 2-core Xeon with AMX-BF16 (SmolLM2-135M Q4_1, one stream, in
    process, interleaved): float32 + the native GEMV decoded 124-133 tok/s, bf16 + torch's
    int4 kernel 102-109 (its compiled step 101-127), llama.cpp 122-129. 30 layers'
    projections took 5.2 / 10.0 / 16.5 / 28.8 / 53.4 ms at 1 / 4 / 8 / 16 / 32 rows through
    the GEMV and 13.4 / 13.3 / 13.7 / 14.9 / 17.3 ms dense bf16 (cast included), so float32
    compute with float32 dense weights made a 32-token prefill take 60 ms instead of 30."""
    if dtype in _DTYPES:
        return _DTYPES[dtype], _DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    if device.startswith("cuda"):
        return torch.bfloat16, torch.bfloat16
    if not tier_has_bf16():
        return torch.float32, torch.float32
    if weights in ("auto", "int4") and kernels.kernel() is not None:
        return torch.float32, torch.bfloat16
    return torch.bfloat16, torch.bfloat16


def resolve_dtype(dtype: str, device: str, weights: str = "auto") -> torch.dtype:
    """The compute dtype (see :func:`resolve_precision`)."""
    return resolve_precision(dtype, device, weights)[0]


def resolve_kv_dtype(dtype: str, device: str, weights: str = "auto") -> torch.dtype:
    """What the KV cache is stored in: the dense weights' dtype (see
    :func:`resolve_precision`), bf16 under float32 compute on a bf16 CPU."""
    return resolve_precision(dtype, device, weights)[1]


@dataclass(frozen=True, slots=True)
class ModelFile:
    """A model opened but not loaded: its config and tokenizer are read, its weights are not."""

    path: Path
    checkpoint: GGUFCheckpoint | HFCheckpoint

    @property
    def config(self) -> ModelConfig:
        return self.checkpoint.config


def open_model(path: str | Path) -> ModelFile:
    """Read a model's header, metadata and tokenizer, not its weights. Raises
    :class:`ModelLoadError` with one readable line."""
    p = Path(path).expanduser()
    try:
        return ModelFile(p, _read(p))
    except ModelLoadError as e:
        raise ModelLoadError(f"{p}: {e}") from None


def load_model(
    path: str | Path | ModelFile,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    progress: bool = True,
    weights: str = "auto",
    chat_template: str | None = None,
    batch_invariant: str = "auto",
) -> LoadedModel:
    """Load a .gguf file or an HF directory. Raises :class:`ModelLoadError` with one readable line.

    ``chat_template`` is the template of a file that carries none (a pullable model's own,
    :mod:`service.model.catalog`); the file's template wins where it has one.

    ``weights`` (``auto|bf16|int4|int8``, see :mod:`service.model.packed`) adds packed integer
    copies of the projections for decode-sized batches. ``batch_invariant``
    (``auto|on|off``; ``off``, as ``kvfence serve``'s default) makes every step compute
    each token the same way whatever the batch: ``auto`` where kvfence's 4-bit GEMV
    serves every projection (the default model on CPU), ``on`` refuses a model or flags
    that cannot, ``off`` keeps the faster batch-variant paths (docs/batch-invariance.md).
    ``path`` may be a file already opened by :func:`open_model`."""
    p = path.path if isinstance(path, ModelFile) else Path(path).expanduser()
    try:
        torch_dtype, dense_dtype = resolve_precision(dtype, device, weights)
        mode = resolve_weights(weights, torch_dtype, device)
        invariant = _wants_invariance(batch_invariant, torch_dtype, device, mode)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    started = time.monotonic()
    try:
        checkpoint = path.checkpoint if isinstance(path, ModelFile) else _read(p)
        bar = Progress(f"loading {p.name}", len(tensor_names(checkpoint.config)), enabled=progress)
        try:
            # On a thread that exits when done: see service.model.threads.
            built = on_fresh_thread(
                lambda: build_weights(
                    checkpoint.config,
                    checkpoint.get,
                    torch_dtype,
                    device,
                    bar,
                    weights=mode,
                    codes=checkpoint.file_blocks,
                    dense_dtype=dense_dtype,
                )
            )
        finally:
            bar.close()
        template = None
        if text := checkpoint.chat_template or chat_template:
            template = ChatTemplate(text, checkpoint.special_tokens)
    except ModelLoadError as e:
        raise ModelLoadError(f"{p}: {e}") from None
    except ChatTemplateError as e:
        raise ModelLoadError(f"{p}: {e}") from None
    factors = checkpoint.rope_freq_factors if isinstance(checkpoint, GGUFCheckpoint) else None

    def build(invariant: bool) -> DecoderModel:
        return DecoderModel(
            checkpoint.config, built, rope_freq_factors=factors, batch_invariant=invariant
        ).eval()

    try:
        model = on_fresh_thread(lambda: build(invariant))
    except ValueError as e:
        if batch_invariant == "on":
            raise ModelLoadError(f"{p}: --batch-invariant on: {e}") from None
        invariant = False  # auto: this checkpoint's weights are not all on the GEMV
        model = on_fresh_thread(lambda: build(False))
    name = p.name if p.is_file() else p.resolve().name
    log.info(
        "model_loaded",
        name=name,
        arch=checkpoint.config.arch,
        dtype=str(torch_dtype),
        dense_dtype=str(dense_dtype),
        weights=mode,
        batch_invariant=invariant,
        packed_mb=round((built.packed.nbytes if built.packed else 0) / 2**20, 1),
        device=device,
        seconds=round(time.monotonic() - started, 2),
    )
    return LoadedModel(
        model=model,
        tokenizer=checkpoint.tokenizer,
        chat_template=template,
        name=name,
        path=p,
        dtype=torch_dtype,
        weights=mode,
        dense_dtype=None if dense_dtype == torch_dtype else dense_dtype,
        batch_invariant=invariant,
    )


BATCH_INVARIANT_MODES = ("auto", "on", "off")


def _wants_invariance(flag: str, dtype: torch.dtype, device: str, mode: str) -> bool:
    """Whether to build the model batch-invariant (``load_model``'s ``batch_invariant``):
    only kvfence's float32 4-bit GEMV and C decode attention give every row one
    arithmetic at every batch size; ``on`` without them is refused in one line."""
    if flag not in BATCH_INVARIANT_MODES:
        raise ValueError(f"unknown --batch-invariant {flag!r}; use auto, on or off")
    if flag == "off":
        return False
    able = (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and mode in ("file", "int4")
        and kernels.kernel() is not None
    )
    if flag == "on" and not able:
        raise ValueError(
            "--batch-invariant on runs on CPU through kvfence's 4-bit GEMV only (--dtype auto "
            "or float32, --weights auto or int4, a C compiler); use --batch-invariant off"
        )
    return able


def _read(p: Path) -> GGUFCheckpoint | HFCheckpoint:
    checkpoint = _read_file(p)
    needed = {checkpoint.file_name(n) for n in tensor_names(checkpoint.config)}
    refuse_unused(checkpoint.family.name, checkpoint.file_tensors, needed, "the checkpoint")
    return checkpoint


def _read_file(p: Path) -> GGUFCheckpoint | HFCheckpoint:
    if p.is_dir():
        return read_hf_dir(p)
    if not p.exists():
        raise ModelLoadError("no such file or directory")
    with p.open("rb") as f:
        magic = f.read(4)
    if magic == _GGUF_MAGIC:
        return read_gguf(p)
    if p.suffix == ".gguf":
        raise ModelLoadError("not a valid GGUF file (bad magic)")
    raise ModelLoadError(
        "unsupported model format (expected a .gguf file or a Hugging Face directory)"
    )
