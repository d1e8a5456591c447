"""``RequestPrep``: the owner of request preparation (the steps are listed in
``service/admission/__init__.py``). Everything is checked before any KV page is
allocated; between ``read`` and ``build`` the front charges the input by its size, so a
tenant pays for its tokenizing before it runs."""

from __future__ import annotations

from dataclasses import replace

from protos.kvfence.v1 import inference_pb2
from service.admission.prompt import PromptBuilder
from service.admission.prompt_limits import check_limits
from service.admission.request_fields import (
    Fields,
    Input,
    ModelLimits,
    check_input,
    input_cost,
    prompt_token_limit,
    read_fields,
    resolve_model,
)
from service.admission.tenants import Tenant
from service.engine.types import Request
from service.errors import Violations, raise_if
from service.structured.grammar import GrammarCompiler
from service.structured.request_grammar import compile_grammar


class RequestPrep:
    """Prepares the requests of one served model: ``prompts`` tokenizes (public: the one
    builder both fronts share), ``grammars`` compiles output constraints (None: the server
    has no grammar support)."""

    def __init__(
        self, model: ModelLimits, prompts: PromptBuilder, grammars: GrammarCompiler | None
    ) -> None:
        self.model = model
        self.prompts = prompts
        self._grammars = grammars
        self._tool_format = prompts.tool_format  # read once: step 1 needs no tokenizer

    def token_text(self, token_id: int) -> str:
        return self.prompts.token_text(token_id)

    def read(
        self,
        tenant: Tenant,
        request: inference_pb2.GenerateRequest,
        to_context_end: bool = False,
        sequences: int = 1,
    ) -> Fields:
        """Step 1: the model and every field, with no tokenizer. ``to_context_end`` (the HTTP
        front, as OpenAI and vLLM do): a request without ``max_tokens`` may run to the end of
        the context, and no further than the tenant's ``tokens_per_minute`` allows its
        ``sequences`` (each is charged before it runs); otherwise the wire's default (16)
        applies."""
        if not to_context_end or request.stopping.HasField("max_tokens"):
            return read_fields(tenant, request, self.model, self._tool_format)
        bounded = inference_pb2.GenerateRequest()
        bounded.CopyFrom(request)
        bounded.stopping.max_tokens = self.model.max_model_len - 1  # one prompt token at least
        fields = read_fields(tenant, bounded, self.model, self._tool_format)
        cap = fields.stopping.max_tokens
        tpm = tenant.quotas.tokens_per_minute
        if tpm > 0:
            cap = max(1, min(cap, tpm // max(1, sequences) - fields.input.cost))
        return replace(
            fields, stopping=replace(fields.stopping, max_tokens=cap), to_context_end=True
        )

    async def build(
        self,
        tenant: Tenant,
        request: inference_pb2.GenerateRequest,
        fields: Fields,
        request_id: str,
        deadline: float | None,
    ) -> Request:
        """Steps 2 to 5 for a request that passed ``read``."""
        inp = fields.input
        ids = await self.prompts.prompt_ids(tenant.name, inp.which, request)
        stopping = fields.stopping
        if fields.to_context_end:
            left = max(1, self.model.max_model_len - len(ids))  # a full prompt is refused below
            stopping = replace(stopping, max_tokens=min(stopping.max_tokens, left))
            if stopping.min_tokens > stopping.max_tokens:
                raise_if([("stopping.min_tokens",
                           f"must be at most the {stopping.max_tokens} tokens the context leaves")])
        check_limits(len(ids), inp.which, inp.limit, stopping.max_tokens, self.model)
        grammar = await compile_grammar(
            self._grammars, tenant.name, fields.grammar, fields.grammar_field
        )
        return Request(
            request_id=request_id,
            tenant=tenant.name,
            prompt_ids=tuple(ids),
            sampling=fields.sampling,
            stopping=stopping,
            logprobs=request.logprobs,
            deadline=deadline,
            bypass_prefix_cache=request.bypass_prefix_cache,
            grammar=grammar,
            cache_salt=request.cache_salt,
        )

    def read_tokenize(self, tenant: Tenant, request: inference_pb2.TokenizeRequest) -> Input:
        """Step 1 for a ``Tokenize`` call: the model and the input."""
        resolve_model(tenant, self.model)
        out: Violations = []
        limit = prompt_token_limit(self.model, tenant.quotas.max_prompt_tokens)
        which = request.WhichOneof("input")
        check_input(which, request, limit, self.model, self._tool_format, out)
        raise_if(out)
        assert which is not None
        return Input(which, limit, input_cost(which, request))

    async def tokenize(
        self, tenant: Tenant, request: inference_pb2.TokenizeRequest, inp: Input
    ) -> list[int]:
        """Steps 2 and 3 for a ``Tokenize`` call that passed ``read_tokenize``."""
        ids = await self.prompts.prompt_ids(tenant.name, inp.which, request, request.add_special_tokens)
        check_limits(len(ids), inp.which, inp.limit, None, self.model)
        return ids
