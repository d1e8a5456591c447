"""Request preparation, step 1: every field of a ``GenerateRequest`` read and checked once,
with no tokenizer, before the input is charged and any tokenizing work is done.

Every problem is one BadRequest field violation; all of a request's problems are reported
together as INVALID_ARGUMENT. The model step (``resolve_model``) comes first: it is the one
place where the requested model name is resolved against what this server serves.

Text is bounded by bytes before it is tokenized, so the tokenizer's work per call is bounded
whatever a client sends: ``TEXT_BYTES_PER_TOKEN`` bytes per allowed prompt token. Real text
averages 3 to 5 bytes a token (English, code, CJK alike); only a prompt that is mostly long
runs of one character averages more, and it is refused only near the token limit. At the
default model's context that is 64 KiB, about 0.1 s of tokenizer time on one core.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

from protos.kvfence.v1 import inference_pb2
from service.admission.limiter import byte_tokens
from service.admission.tenants import Tenant
from service.engine.invariants import MAX_LOGPROBS
from service.engine.types import SamplingParams, StoppingParams
from service.errors import Violations, permission_denied, raise_if
from service.model.chat_template import ToolFormat
from service.structured import tools
from service.structured.grammar import GrammarSpec

TEXT_BYTES_PER_TOKEN = 8
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHAT_MESSAGES = 512
MAX_LOGIT_BIAS = 1024
MAX_CACHE_SALT_BYTES = 256
MAX_CLIENT_REQUEST_ID = 128
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# NOTE: below these the sampler divides logits by ~0 (temperature) or scales them by ~0 or
# ~inf (repetition penalty): 1e-45 gave NaN logprobs and empty text. Greedy is temperature 0.
# The wire carries float32: the bounds are float32 too, so a client sending 0.01 gets 0.01.
MIN_TEMPERATURE = struct.unpack("f", struct.pack("f", 0.01))[0]
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = MIN_TEMPERATURE
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the served model allows."""

    name: str
    vocab_size: int
    max_model_len: int
    aliases: tuple[str, ...] = ()  # other names clients may use for it (--served-model-name)

    def resolve(self, requested: str) -> str:
        """``requested`` with an alias of the model replaced by its name (adapter names and
        unknown names are left for ``service.admission.tenant_adapters.Adapters.select`` to resolve)."""
        return self.name if requested in self.aliases else requested


def prompt_token_limit(model: ModelLimits, tenant_max_prompt_tokens: int) -> int:
    """Most prompt tokens a tenant may send (one position is kept for the first output)."""
    limit = model.max_model_len - 1
    return min(limit, tenant_max_prompt_tokens) if tenant_max_prompt_tokens > 0 else limit


def check_text(text: str, field: str, token_limit: int, out: Violations) -> None:
    """Bound the text's size before tokenizing (``len`` first: chars <= bytes)."""
    max_bytes = token_limit * TEXT_BYTES_PER_TOKEN
    if not text:
        out.append((field, "must not be empty"))
    elif len(text) > max_bytes or len(text.encode("utf-8")) > max_bytes:
        out.append((field, f"text is longer than {max_bytes} bytes"))


def check_chat(
    chat: inference_pb2.ChatMessages, field: str, token_limit: int, out: Violations
) -> None:
    messages = chat.messages
    max_bytes = token_limit * TEXT_BYTES_PER_TOKEN
    if not messages:
        out.append((f"{field}.messages", "must not be empty"))
        return
    if len(messages) > MAX_CHAT_MESSAGES:
        out.append((f"{field}.messages", f"at most {MAX_CHAT_MESSAGES} messages"))
        return
    for i, msg in enumerate(messages):
        if msg.role not in CHAT_ROLES:
            out.append((f"{field}.messages[{i}].role", f"must be one of {sorted(CHAT_ROLES)}"))
    tools.check_size(chat, field, max_bytes, out)  # content, tool calls, tool results, tools


def check_prompt_ids(
    ids: Sequence[int], field: str, token_limit: int, vocab_size: int, out: Violations
) -> None:
    """Length first (O(1)), so an enormous id list is refused without scanning it."""
    if not ids:
        out.append((field, "must not be empty"))
    elif len(ids) > token_limit:
        out.append((field, f"prompt has {len(ids)} tokens; the limit is {token_limit}"))
    else:
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            out.append((f"{field}[{bad}]", f"token id {ids[bad]} is outside [0, {vocab_size})"))


def _number(
    value: float, field: str, lo: float, hi: float, out: Violations, *, open_lo: bool = False
) -> None:
    ok = math.isfinite(value) and (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if open_lo else "["
        out.append((field, f"must be a finite number in {bracket}{lo:g}, {hi:g}]"))


def parse_sampling(
    msg: inference_pb2.SamplingParams, vocab_size: int, out: Violations
) -> SamplingParams:
    d = SamplingParams()
    # Counted before the entries are read: sorting 700k of them took 0.2 s.
    many_biases = len(msg.logit_bias) > MAX_LOGIT_BIAS
    s = SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else d.temperature,
        top_k=msg.top_k if msg.HasField("top_k") else d.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else d.top_p,
        min_p=msg.min_p if msg.HasField("min_p") else d.min_p,
        repetition_penalty=(
            msg.repetition_penalty if msg.HasField("repetition_penalty") else d.repetition_penalty
        ),
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
        logit_bias=() if many_biases else tuple(sorted(msg.logit_bias.items())),
    )
    if s.temperature != 0.0:
        _number(s.temperature, "sampling.temperature", MIN_TEMPERATURE, MAX_TEMPERATURE, out)
    if s.top_k < 0:
        out.append(("sampling.top_k", "must be >= 0"))
    _number(s.top_p, "sampling.top_p", 0.0, 1.0, out, open_lo=True)
    _number(s.min_p, "sampling.min_p", 0.0, 1.0, out)
    _number(
        s.repetition_penalty,
        "sampling.repetition_penalty",
        MIN_REPETITION_PENALTY,
        MAX_REPETITION_PENALTY,
        out,
    )
    _number(s.presence_penalty, "sampling.presence_penalty", -2.0, 2.0, out)
    _number(s.frequency_penalty, "sampling.frequency_penalty", -2.0, 2.0, out)
    if many_biases:
        out.append(("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries"))
    _logit_bias(s.logit_bias, vocab_size, out)
    return s


def _logit_bias(
    bias: Sequence[tuple[int, float]], vocab_size: int, out: Violations
) -> None:
    for token_id, value in bias:
        if not 0 <= token_id < vocab_size:
            out.append(("sampling.logit_bias", f"token id {token_id} is outside [0, {vocab_size})"))
            return
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            out.append(("sampling.logit_bias", f"bias of token {token_id} must be in [-100, 100]"))
            return


def parse_stopping(
    msg: inference_pb2.StoppingParams, vocab_size: int, out: Violations
) -> StoppingParams:
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else StoppingParams().max_tokens
    if max_tokens <= 0:
        out.append(("stopping.max_tokens", "must be >= 1"))
    if not 0 <= msg.min_tokens <= max(max_tokens, 0):
        out.append(("stopping.min_tokens", "must be in [0, max_tokens]"))
    if len(msg.stop) > MAX_STOP_STRINGS:
        out.append(("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
    else:
        for i, stop in enumerate(msg.stop):
            if not stop or len(stop.encode("utf-8")) > MAX_STOP_BYTES:
                out.append((f"stopping.stop[{i}]", f"must be 1 to {MAX_STOP_BYTES} bytes"))
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        out.append(("stopping.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids"))
    else:
        for i, t in enumerate(msg.stop_token_ids):
            if not 0 <= t < vocab_size:
                out.append((f"stopping.stop_token_ids[{i}]", f"must be in [0, {vocab_size})"))
    return StoppingParams(
        max_tokens=max_tokens,
        min_tokens=msg.min_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def check_request_fields(req: inference_pb2.GenerateRequest, out: Violations) -> None:
    """The request's own fields. Its ``model`` names the base or one of the caller's
    adapters, resolved by ``service.admission.tenant_adapters.Adapters.select``."""
    if not 0 <= req.logprobs <= MAX_LOGPROBS:
        out.append(("logprobs", f"must be in [0, {MAX_LOGPROBS}]"))
    if len(req.client_request_id) > MAX_CLIENT_REQUEST_ID:
        out.append(("client_request_id", f"at most {MAX_CLIENT_REQUEST_ID} characters"))
    if len(req.cache_salt.encode("utf-8")) > MAX_CACHE_SALT_BYTES:
        out.append(("cache_salt", f"at most {MAX_CACHE_SALT_BYTES} bytes"))


def resolve_model(tenant: Tenant, model: ModelLimits) -> None:
    """The model step: PERMISSION_DENIED when the tenant may not use the served model. The
    requested name (the base, or one of the caller's adapters) is resolved right after this
    step by ``service.admission.tenant_adapters.Adapters.select``, which holds the adapter while it runs."""
    if not tenant.may_use_model(model.name):
        raise permission_denied(f"tenant may not use model {model.name!r}", "MODEL")


def check_input(
    which: str | None,
    req: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest,
    token_limit: int,
    model: ModelLimits,
    tool_format: ToolFormat | None,
    out: Violations,
) -> None:
    """Size checks of the ``input`` oneof (``which``) that need no tokenizer; ``tool_format``
    is None when the model has no chat template."""
    if which is None:
        out.append(("input", "one of text, token_ids or chat is required"))
    elif which == "text":
        check_text(req.text, "text", token_limit, out)
    elif which == "token_ids":
        assert isinstance(req, inference_pb2.GenerateRequest)
        check_prompt_ids(req.token_ids.ids, "token_ids.ids", token_limit, model.vocab_size, out)
    elif which == "chat":
        before = len(out)
        check_chat(req.chat, "chat", token_limit, out)
        if len(out) == before:  # the tools' JSON is read only once its size passed
            tools.check_tools(req.chat, "chat", out)
        if tool_format is None:
            out.append(("chat", "the model has no chat template; send text or token_ids"))


def input_cost(
    which: str, req: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest
) -> int:
    """Tokens an input that passed ``check_input`` is charged before it is tokenized."""
    if which == "token_ids":
        assert isinstance(req, inference_pb2.GenerateRequest)
        return len(req.token_ids.ids)
    if which == "text":
        return byte_tokens(len(req.text.encode("utf-8")))
    return byte_tokens(tools.chat_bytes(req.chat))


@dataclass(frozen=True, slots=True)
class Input:
    """A request's input that passed ``check_input``."""

    which: str  # the input oneof: text, token_ids or chat
    limit: int  # most prompt tokens allowed
    cost: int  # tokens the input is charged by its size, before it is tokenized


@dataclass(frozen=True, slots=True)
class Fields:
    """A ``GenerateRequest`` whose every field passed, ready for the later steps."""

    input: Input
    sampling: SamplingParams
    stopping: StoppingParams  # with the tool plan's stop strings
    tool_plan: tools.ToolPlan | None  # how the output is read for tool calls
    grammar: GrammarSpec | None  # what the output is constrained to (compiled in step 4)
    grammar_field: str  # the field a compile failure is reported on
    # max_tokens was left unset by an HTTP caller: ``stopping.max_tokens`` is an upper bound,
    # lowered to what the context leaves once the prompt is tokenized (``RequestPrep.build``).
    to_context_end: bool = False


def read_fields(
    tenant: Tenant,
    request: inference_pb2.GenerateRequest,
    model: ModelLimits,
    tool_format: ToolFormat | None,
) -> Fields:
    """Every check that needs no tokenizer; raises PERMISSION_DENIED or INVALID_ARGUMENT."""
    resolve_model(tenant, model)
    out: Violations = []
    limit = prompt_token_limit(model, tenant.quotas.max_prompt_tokens)
    which = request.WhichOneof("input")
    check_request_fields(request, out)
    sampling = parse_sampling(request.sampling, model.vocab_size, out)
    stopping = parse_stopping(request.stopping, model.vocab_size, out)
    check_input(which, request, limit, model, tool_format, out)
    raise_if(out)
    assert which is not None
    plan = None
    if which == "chat" and tool_format is not None:
        plan = tools.plan(request.chat, tool_format)
    if plan is not None and request.HasField("response_format"):
        raise_if([("response_format", "cannot be combined with tools (unless tool_choice is none)")])
    spec: GrammarSpec | None = _format_spec(request)
    field = "response_format"
    if plan is not None and plan.constrained:
        spec, field = tools.grammar(request.chat, plan), "chat.tool_choice"
    if plan is not None:
        stopping = replace(stopping, stop=stopping.stop + plan.stop_strings())
    inp = Input(which, limit, input_cost(which, request))
    return Fields(inp, sampling, stopping, plan, spec, field)


def _format_spec(request: inference_pb2.GenerateRequest) -> GrammarSpec | None:
    if not request.HasField("response_format"):
        return None
    msg = request.response_format
    which = msg.WhichOneof("format")
    if which == "json_schema":
        return GrammarSpec("json_schema", msg.json_schema)
    if which == "json_object":
        return GrammarSpec("json_object") if msg.json_object else None
    if which == "regex":
        return GrammarSpec("regex", msg.regex)
    if which == "lark_grammar":
        return GrammarSpec("lark", msg.lark_grammar)
    return None
