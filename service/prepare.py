"""One ``GenerateRequest`` -> one validated engine ``Request``: the single validator both
fronts use (gRPC directly; HTTP after translating the OpenAI body into a ``GenerateRequest``).

``check_request`` needs no tokenizer, so both fronts charge the input by its size between it
and ``finish_request``. Everything is checked before any KV page is allocated: model permission, field ranges
(``service.validation``), input sizes before tokenizing, the tokenized length and context,
and last the response format (compiled with the tenant's own grammar cache).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from protos.kvfence.v1 import inference_pb2
from service import tools
from service.engine.grammar import GrammarCompiler
from service.engine.types import Request, SamplingParams, StoppingParams
from service.errors import permission_denied
from service.prompt import PromptBuilder
from service.structured import compile_response_format, compile_spec
from service.tenants import Tenant
from service.validation import (
    Violations,
    check_context,
    check_request_fields,
    parse_sampling,
    parse_stopping,
    prompt_token_limit,
    raise_if,
)


@dataclass(frozen=True, slots=True)
class Checked:
    """A request whose fields and input sizes passed, before tokenizing."""

    which: str
    limit: int
    sampling: SamplingParams
    stopping: StoppingParams
    input_cost: int  # tokens the input is charged by its size, before it is tokenized
    tool_plan: tools.ToolPlan | None  # how the output is read for tool calls


def check_request(
    prompts: PromptBuilder, tenant: Tenant, request: inference_pb2.GenerateRequest
) -> Checked:
    """Every check that needs no tokenizer (model permission, fields, input sizes)."""
    model = prompts.model
    if not tenant.may_use_model(model.name):
        raise permission_denied(f"tenant may not use model {model.name!r}", "MODEL")
    limit = prompt_token_limit(model, tenant.quotas.max_prompt_tokens)
    which = request.WhichOneof("input")
    out: Violations = []
    check_request_fields(request, model, out)
    sampling = parse_sampling(request.sampling, model.vocab_size, out)
    stopping = parse_stopping(request.stopping, model.vocab_size, out)
    prompts.check_input(which, request, limit, out)
    raise_if(out)
    assert which is not None
    plan = prompts.tool_plan(request)
    if plan is not None and request.HasField("response_format"):
        raise_if([("response_format", "cannot be combined with tools (unless tool_choice is none)")])
    cost = prompts.input_cost(which, request)
    return Checked(which, limit, sampling, stopping, cost, plan)


async def finish_request(
    prompts: PromptBuilder,
    grammars: GrammarCompiler | None,
    tenant: Tenant,
    request: inference_pb2.GenerateRequest,
    checked: Checked,
    request_id: str,
    deadline: float | None,
) -> Request:
    """Tokenize (on the tenant's share of the pool), check the context, compile the format."""
    prompt = await prompts.prompt_ids(tenant.name, checked.which, request, checked.limit)
    out: Violations = []
    check_context(len(prompt), checked.stopping.max_tokens, prompts.model, out)
    raise_if(out)
    stopping = checked.stopping
    if checked.tool_plan is not None and checked.tool_plan.constrained:
        spec = tools.grammar(request.chat, checked.tool_plan)
        grammar = await compile_spec(grammars, tenant.name, spec, "chat.tool_choice")
    else:
        grammar = await compile_response_format(grammars, tenant.name, request)
    if checked.tool_plan is not None:
        stopping = replace(stopping, stop=stopping.stop + checked.tool_plan.stop_strings())
    return Request(
        request_id=request_id,
        tenant=tenant.name,
        prompt_ids=tuple(prompt),
        sampling=checked.sampling,
        stopping=stopping,
        logprobs=request.logprobs,
        deadline=deadline,
        bypass_prefix_cache=request.bypass_prefix_cache,
        grammar=grammar,
        cache_salt=request.cache_salt,
    )
