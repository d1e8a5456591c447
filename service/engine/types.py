"""Engine requests, events, configs and errors: everything the service sees of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from service.model.lora import LoraAdapter
    from service.structured.grammar import CompiledGrammar

from kvcache.stats import CacheStats
from service.engine.tuning import SchedulerTuning

FinishReason = Literal["stop", "length", "abort", "deadline", "error"]

#: Why a request finished with reason "error": its pages failed the KV fence, it can never
#: fit the pool or its tenant's page quota, or the step it was in failed unexpectedly.
ErrorKind = Literal["kv_fence", "too_large", "internal"]

#: Tenant names starting with this prefix are reserved for the engine itself (warm-up).
RESERVED_TENANT_PREFIX = "__kvfence"
WARMUP_TENANT = "__kvfence_warmup__"


class EngineError(Exception):
    """Base class of the engine's typed errors."""


class QueueFull(EngineError):
    """The tenant's waiting queue is full; raised by ``submit`` at once."""

    def __init__(self, tenant: str, max_waiting: int) -> None:
        super().__init__(f"tenant waiting queue is full ({max_waiting} requests)")
        self.tenant = tenant
        self.max_waiting = max_waiting


class RequestTooLarge(EngineError):
    """The request can never fit the KV pool or the tenant's page quota."""

    def __init__(self, needed_pages: int, limit_pages: int, what: str) -> None:
        super().__init__(
            f"request needs {needed_pages} KV pages but the {what} allows {limit_pages}"
        )
        self.needed_pages = needed_pages
        self.limit_pages = limit_pages
        self.what = what


class InvalidRequest(EngineError):
    """The request is malformed (empty prompt, out-of-range parameter, reserved tenant...)."""


class EngineStopped(EngineError):
    """The engine is not running (not started yet, or shut down)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is drawn. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)


@dataclass(frozen=True, slots=True)
class StoppingParams:
    """When generation ends. Stop strings are trimmed from the streamed text."""

    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request, already authenticated and validated by the service."""

    request_id: str
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stopping: StoppingParams = StoppingParams()
    logprobs: int = 0  # number of top alternatives to return per token
    deadline: float | None = None  # engine clock (monotonic seconds)
    bypass_prefix_cache: bool = False
    grammar: CompiledGrammar | None = None  # structured output; compiled by the service
    cache_salt: str = ""  # prefix-cache sub-namespace inside the tenant's ("" = none)
    adapter: LoraAdapter | None = None  # the tenant's LoRA adapter; None = the base model

    @property
    def adapter_identity(self) -> str:
        """The prefix-cache namespace's adapter component ("" = the base model)."""
        return "" if self.adapter is None else self.adapter.identity


@dataclass(frozen=True, slots=True)
class TenantSchedPolicy:
    """Per-tenant scheduling: fair-share weight (a tenant of weight 2 is owed twice the
    processed tokens of one of weight 1), concurrency cap, waiting-queue bound."""

    weight: float = 1.0
    max_running: int = 64
    max_waiting: int = 256


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine limits. ``tuning`` holds every scheduling constant (the token budget, the step
    time bound and decode stretch, the prefill chunk and floor; service/engine/tuning.py and
    docs/scheduling.md), with the same defaults ``kvfence serve`` has.
    ``compile`` (``--compile``): ``on`` runs small decode batches through a ``torch.compile``
    forward built at start (service/engine/compiled.py) and fails the start where it cannot,
    ``auto`` does so where it can, ``off`` never.
    """

    max_num_seqs: int = 64
    max_model_len: int = 2048
    tuning: SchedulerTuning = field(default_factory=SchedulerTuning)
    warmup: bool = True
    compile: str = "off"  # auto | on | off
    warmup_decode_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    evict_interval_s: float = 1.0
    idle_wait_s: float = 0.05

    @property
    def max_num_batched_tokens(self) -> int:
        return self.tuning.max_num_batched_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Logprob of the chosen token and of the top-n alternatives (see ``sampler.py``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request got a running slot and its KV pages."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    queue_s: float


@dataclass(frozen=True, slots=True)
class Delta:
    """New tokens and the text they completed (never a partial UTF-8 character)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of every request."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_s: float
    ttft_s: float | None
    total_s: float
    error: FinishError | None = None  # set when reason == "error"


@dataclass(frozen=True, slots=True)
class FinishError:
    """The typed cause of an "error" finish. ``message`` names no prompt or output text;
    ``what``/``limit_pages`` are set for ``too_large`` (which limit, and its size)."""

    kind: ErrorKind
    message: str
    what: str = ""
    limit_pages: int | None = None
    # For "internal": the engine's own words for the client (which row failed and how, with
    # an exception's type but never its text); empty where nothing more is said.
    cause: str = ""

    @staticmethod
    def too_large(err: RequestTooLarge) -> FinishError:
        return FinishError("too_large", str(err), err.what, err.limit_pages)


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Request counts the engine thread publishes after every step (read without waiting)."""

    num_waiting: int = 0
    num_running: int = 0
    num_requests: int = 0  # added and not finished yet
    num_preemptions: int = 0
    num_steps: int = 0
    num_deadlines: int = 0  # entries in the deadline heap (finished requests leave it)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A consistent snapshot taken on the engine thread: counters plus the KV cache's."""

    counters: EngineCounters
    cache: CacheStats


EngineEvent = Admitted | Delta | Finished
