"""One ``GenerateRequest`` -> one validated engine ``Request``: the single validator both
fronts use (gRPC directly; HTTP after translating the OpenAI body into a ``GenerateRequest``).

Everything is checked before any KV page is allocated: model permission, field ranges
(``service.validation``), input sizes before tokenizing, the tokenized length and context,
and last the response format (compiled with the tenant's own grammar cache).
"""

from __future__ import annotations

from protos.kvfence.v1 import inference_pb2
from service.engine.grammar import GrammarCompiler
from service.engine.types import Request
from service.errors import permission_denied
from service.prompt import PromptBuilder
from service.structured import compile_response_format
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


async def prepare_request(
    prompts: PromptBuilder,
    grammars: GrammarCompiler | None,
    tenant: Tenant,
    request: inference_pb2.GenerateRequest,
    request_id: str,
    deadline: float | None,
) -> Request:
    """Validate, tokenize and compile the response format. Raises ServiceError."""
    model = prompts.model
    if not tenant.may_use_model(model.name):
        raise permission_denied(f"tenant may not use model {model.name!r}", "MODEL")
    limit = prompt_token_limit(model, tenant.quotas.max_prompt_tokens)
    which = request.WhichOneof("input")
    out: Violations = []
    check_request_fields(request, model, out)
    sampling = parse_sampling(request.sampling, out)
    stopping = parse_stopping(request.stopping, model.vocab_size, out)
    prompts.check_input(which, request, limit, out)
    raise_if(out)
    assert which is not None
    prompt = await prompts.prompt_ids(which, request, limit)
    check_context(len(prompt), stopping.max_tokens, model, out)
    raise_if(out)
    grammar = await compile_response_format(grammars, tenant.name, request)
    return Request(
        request_id=request_id,
        tenant=tenant.name,
        prompt_ids=tuple(prompt),
        sampling=sampling,
        stopping=stopping,
        logprobs=request.logprobs,
        deadline=deadline,
        bypass_prefix_cache=request.bypass_prefix_cache,
        grammar=grammar,
    )
