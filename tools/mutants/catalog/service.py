"""Switch-offs of the guarantees the server states outside ``kvcache/``."""

from tools.mutants.mutant import edit, mutant

SERVICER = "service/grpc/inference_service.py"
VALIDATION = "service/admission/request_fields.py"
T_LOGGING = "tests/service/test_logging.py"
T_INVALID = "tests/service/test_invalid_argument.py"
T_DEFAULTS = "tests/service/test_default_config.py"

MUTANTS = (
    mutant(
        "scrub-default-cli",
        "`kvfence serve` scrubs pages between tenants by default (--scrub-policy reassign)",
        edit("service/serve/commands.py", '_add(p, "--scrub-policy", "reassign",',
             '_add(p, "--scrub-policy", "off",'),
        tests=T_DEFAULTS,
    ),
    mutant(
        "scrub-default-sizing",
        "an engine built with EngineSizing defaults scrubs pages between tenants",
        edit("service/serve/settings.py", 'scrub_policy: Literal["reassign", "always", "off"] = "reassign"',
             'scrub_policy: Literal["reassign", "always", "off"] = "off"'),
        tests=T_DEFAULTS,
    ),
    mutant(
        "log-output-text",
        "generated text is never logged without --log-content",
        edit(SERVICER, "if self._opts.log_content:\n                        output.append(event.text)",
             "if True:\n                        output.append(event.text)"),
        edit(SERVICER, "error=type(event.error).__name__ if event.error else None,\n        )",
             "error=type(event.error).__name__ if event.error else None,\n"
             "            output=output,\n        )"),
        tests=T_LOGGING,
    ),
    mutant(
        "log-prompt-text",
        "prompt text is never logged without --log-content",
        edit(SERVICER, "                input=fields.input.which,\n",
             "                input=fields.input.which,\n"
             "                prompt=self._prompt_text(request),\n"),
        tests=T_LOGGING,
    ),
    mutant(
        "error-echoes-chat",
        "INVALID_ARGUMENT text never carries prompt content (chat message)",
        edit(VALIDATION, 'f"must be one of {sorted(CHAT_ROLES)}"',
             'f"must be one of {sorted(CHAT_ROLES)} (message: {msg.content!r})"'),
        tests=T_INVALID,
    ),
    mutant(
        "error-echoes-stop",
        "INVALID_ARGUMENT text never carries request content (stop string)",
        edit(VALIDATION, 'f"must be 1 to {MAX_STOP_BYTES} bytes"',
             'f"{stop[:40]!r} must be 1 to {MAX_STOP_BYTES} bytes"'),
        tests=T_INVALID,
    ),
    mutant(
        "tenant-from-header",
        "the tenant comes from the credential only, never from a request header",
        edit("service/admission/auth.py",
             "        registry = self._registry  # one snapshot for the whole decision\n",
             "        registry = self._registry  # one snapshot for the whole decision\n"
             "        for k, v in metadata or ():\n"
             '            if k.lower() == "x-tenant" and str(v) in registry.tenants:\n'
             "                return registry.tenants[str(v)]\n"),
        tests="tests/isolation/test_tenant_source.py",
    ),
    mutant(
        "kv-quota",
        "a tenant never holds more KV pages than its max_kv_pages",
        edit("kvcache/page_store.py",
             "if policy is not None and policy.max_pages is not None:\n            owned",
             "if False:\n            owned"),
        tests="tests/kvcache/test_quota.py",
    ),
    mutant(
        "stream-quota",
        "a tenant never holds more Generate streams than max_concurrent_streams",
        edit("service/admission/limiter.py", "if state.active >= limit:", "if False:"),
        tests="tests/service/test_limits.py",
    ),
    mutant(
        "rate-quota",
        "a tenant never spends more than tokens_per_minute",
        edit("service/admission/limiter.py", "if wait > 0:", "if False:"),
        tests="tests/service/test_limits.py",
    ),
    mutant(
        "ttl-expiry",
        "a cached prefix expires after its TTL",
        edit("kvcache/page_store.py", "expired = self.evictable.pop_expired(now)",
             "expired = self.evictable.pop_expired(float('-inf'))"),
        tests="tests/isolation/test_ttl.py",
    ),
    mutant(
        "tenant-ttl",
        "a tenant's own prefix_cache_ttl_seconds overrides the server default",
        edit("kvcache/page_store.py",
             "return self.config.default_ttl_s if p is None or p.ttl_s is None else p.ttl_s",
             "return self.config.default_ttl_s"),
        tests="tests/isolation/test_ttl.py",
    ),
    mutant(
        "pool-orphans-pages",
        "a freed page that is not cached returns to the free list",
        edit("kvcache/page_store.py", "                to_zero.extend(self.reclaim(ref.page_id))\n",
             "                pass\n"),
        tests="tests/reliability/test_cancel_storm.py",
    ),
    mutant(
        "pool-orphans-pages-engine",
        "the same switch-off, seen by the engine tests' baseline check",
        edit("kvcache/page_store.py", "                to_zero.extend(self.reclaim(ref.page_id))\n",
             "                pass\n"),
        tests="tests/engine/test_scheduler.py",
    ),
    mutant(
        "purge-noop",
        "Cache.Purge drops the caller's cached prefixes at once",
        edit("kvcache/manager.py", "        pages = self.prefix.pages_of(tenant)\n",
             "        pages: list[int] = []\n"),
        tests="tests/isolation/test_ttl.py",
    ),
    mutant(
        "tenant-blind-cache",
        "a cached prefix is reused only by its own tenant (all in-cache checks pass: a real leak)",
        edit("kvcache/manager.py",
             "table = PageTable(seq_id, tenant, self.page_size, use_prefix_cache, salt, adapter)",
             'table = PageTable(seq_id, "shared", self.page_size, use_prefix_cache, salt, adapter)'),
        tests="tests/isolation/test_timing_channel.py",
    ),
    mutant(
        "auth-any-scheme",
        "only 'Bearer <key>' authenticates",
        edit("service/admission/auth.py", 'if scheme.lower() != "bearer" or not key.strip():',
             "if not key.strip():"),
        tests="tests/isolation/test_auth_matrix.py::test_api_key_matrix",
    ),
    mutant(
        "auth-logs-key",
        "an API key never reaches the log",
        edit("service/grpc/interceptor.py", "code=err.code.name, reason=reason\n",
             "code=err.code.name, reason=reason,\n"
             "                metadata=str(context.invocation_metadata()),\n"),
        tests="tests/isolation/test_auth_matrix.py::test_api_key_matrix",
    ),
    mutant(
        "drain-admits-new",
        "a draining server refuses new RPCs with UNAVAILABLE",
        # Both checks: the header-only one before the body is parsed, and the handler's.
        edit("service/grpc/interceptor.py",
             "            if self._is_draining():\n                raise unavailable(\"server is shutting down\")\n"
             "            self._auth.precheck(",
             "            if False:\n                raise unavailable(\"server is shutting down\")\n"
             "            self._auth.precheck("),
        edit("service/grpc/interceptor.py",
             "            if self._is_draining():\n                raise unavailable(\"server is shutting down\")\n"
             "            tenant = ",
             "            if False:\n                raise unavailable(\"server is shutting down\")\n"
             "            tenant = "),
        tests="tests/reliability/test_drain.py",
    ),
    mutant(
        "validation-top-p",
        "sampling.top_p outside (0, 1] is INVALID_ARGUMENT",
        # NOTE: the engine's assertion too, so the request is served rather than failing it.
        edit(VALIDATION, '"sampling.top_p", 0.0, 1.0,', '"sampling.top_p", 0.0, 10.0,'),
        edit("service/engine/invariants.py", "assert 0 < s.top_p <= 1 and", "assert 0 < s.top_p <= 10 and"),
        tests="tests/reliability/test_malformed.py",
    ),
    mutant(
        "torch-work-on-caller",
        "model loading, KV pool allocation and the warm-up leave no OpenMP pool on the caller",
        edit("service/model/threads.py",
             "    thread.start()\n    thread.join()\n",
             "    run()\n"),
        edit("service/engine/engine.py",
             "        ready: concurrent.futures.Future[None] = concurrent.futures.Future()\n"
             "        self._thread = threading.Thread(",
             "        if self.config.warmup:\n            run_warmup(self._core, progress)\n"
             "        ready: concurrent.futures.Future[None] = concurrent.futures.Future()\n"
             "        self._thread = threading.Thread("),
        tests="tests/engine/test_threads.py",
    ),
    mutant(
        "q4-tiny-block-step",
        "a block of tiny inputs keeps its sign and size in the 4-bit GEMV",
        edit("service/model/native/common.h", "            if (top > 0.0f && top < TINY_TOP) {", "            if (0) {"),
        tests="tests/model/test_native_gemv_numerics.py::test_tiny_blocks_keep_their_sign_and_size",
    ),
    mutant(
        "stack-family-qkv-bias",
        "a family's qkv bias is added in the native decoder stack (Qwen2 decodes as its layer loop)",
        edit("service/model/native/stack.h",
             "        if (qkv_bias != NULL) add_bias(qkv, rows, n_qkv, qkv_bias);",
             "        (void)qkv_bias;"),
        tests="tests/model/test_family_stack.py",
    ),
    mutant(
        "stack-family-post-norms",
        "Gemma's output norms run in the native decoder stack before each residual add",
        edit("service/model/native/mlp.h",
             "    if (post_mlp != NULL) add_normed(x, a, rows, hidden, post_mlp, eps);",
             "    if (post_mlp != NULL) add_bias(x, rows, hidden, a);"),
        tests="tests/model/test_family_stack.py",
    ),
    mutant(
        "stack-family-geglu",
        "a GeGLU family's gate is gelu_tanh in the native decoder stack, not SiLU",
        edit("service/model/native/common.h",
             "    if (gated == GATE_GELU_TANH) {\n        gelu_gate(x, k, v);",
             "    if (gated == GATE_GELU_TANH) {\n        silu_gate(x, k, v);"),
        tests="tests/model/test_family_stack.py",
    ),
    mutant(
        "stack-moe-top-k-not-renormalised",
        "the native decoder stack renormalises a Mixtral row's top-k routing weights to sum to one",
        edit("service/model/native/moe.h",
             "    for (int k = 0; normalize && k < top_k; ++k) weight[rank[k]] /= kept;",
             "    for (int k = 0; 0 && normalize && k < top_k; ++k) weight[rank[k]] /= kept;"),
        tests="tests/model/test_family_stack.py",
    ),
    mutant(
        "stack-moe-expert-unweighted",
        "the native decoder stack weighs each picked expert's output by its routing weight",
        edit("service/model/native/moe.h",
             "            for (int j = 0; j < hidden; ++j) m[j] += w * a[j];",
             "            for (int j = 0; j < hidden; ++j) m[j] += a[j] + 0.0f * w;"),
        tests="tests/model/test_family_stack.py",
    ),
    mutant(
        "gguf-expert-blocks-first-expert",
        "a GGUF expert is packed from its own entry of the stacked expert tensor",
        edit("service/model/gguf_loader.py",
             "unpack(raw.data if src.expert < 0 else raw.data[src.expert], rows)",
             "unpack(raw.data if src.expert < 0 else raw.data[0], rows)"),
        tests="tests/model/test_gguf_moe_stack.py::test_each_expert_is_packed_from_its_own_blocks",
    ),
    mutant(
        "k-quant-one-scale-a-block",
        "a Q6_K block's codes 16-31 take their own sub-block's scale in the GEMV",
        edit("service/model/native/q8_rows.h",
             "            if (wide) scales8(dh + 4 * (size_t)padded, xs, groups, step[4 + i], 1);",
             "            if (wide) scales8(dh, xs, groups, step[4 + i], 1);"),
        tests="tests/model/test_native_gemv.py::test_kernel_reproduces_the_files_k_quant_weights",
    ),
    mutant(
        "q4-gamma-copy-alive",
        "a strided norm weight's contiguous copy outlives the 4-bit GEMV call",
        edit("service/model/native/kernels.py",
             "        gamma = None if gamma is None else gamma.contiguous()\n        norm = 0 if gamma is None else gamma.data_ptr()",
             "        norm = 0 if gamma is None else gamma.contiguous().data_ptr()"),
        tests="tests/model/test_native_gemv_numerics.py::test_a_strided_norm_weight_is_read_as_its_values",
    ),
    mutant(
        "batch-invariant-packs-ignored",
        "a batch-invariant model runs every projection on the GEMV with the tile unit off",
        edit("service/model/decoder.py",
             "self.packed = invariant_packs(weights.packed) if batch_invariant else weights.packed",
             "self.packed = weights.packed"),
        tests="tests/model/test_native_gemv.py::test_the_invariant_model_turns_the_tile_unit_off_for_weights_left_out_of_panels",
    ),
    mutant(
        "batch-invariant-panel-unfused-combine",
        "the panel GEMV's few-row loop rounds each block's step like its tile-unit batches (one FMA)",
        edit("service/model/native/panels.h",
             "            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), step, acc[r]);",
             # the product rounded on its own (a mul then an add would be contracted back
             # into one FMA by the compiler)
             "            acc[r] = _mm512_add_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(s), step, "
             "_mm512_setzero_ps()), acc[r]);"),
        tests="tests/model/test_native_gemv_panels.py",
    ),
    mutant(
        "batch-invariant-tile-chunk-first-panel-scales",
        "each panel of a chunk on the tile unit takes its own scales, not the chunk's first panel's",
        edit("service/model/native/panels_amx.h",
             "panel_amx_tile(p, xb, plane, r0, live, k, groups, dm + (size_t)(q - c0) * 32 * groups,",
             "panel_amx_tile(p, xb, plane, r0, live, k, groups, dm,"),
        tests="tests/model/test_native_gemv_panels.py",
        needs="amx",
    ),
    mutant(
        "batch-invariant-tile-odd-blocks-from-even-tiles",
        "an odd block's sums leave the tile unit from the tiles its products went to",
        edit("service/model/native/panels_amx.h",
             "        if (h & 1) {\n            _tile_stored(5, sums[0], 64);",
             "        if (!(h & 1)) {\n            _tile_stored(5, sums[0], 64);"),
        tests="tests/model/test_native_gemv_panels.py",
        needs="amx",
    ),
    mutant(
        "batch-invariant-prefill-through-sdpa",
        "a batch-invariant step's prefill tokens attend as decode-kernel rows, never through SDPA",
        edit("kvcache/backends/torch_backend.py",
             "per_token = self._token_rows(None if every_chunk else _NATIVE_CHUNK_KEYS)",
             "per_token = self._token_rows(_NATIVE_CHUNK_KEYS)"),
        tests="tests/kvcache/test_attention.py",
    ),
    mutant(
        "attention-run-reads-past-a-tokens-keys",
        "a chunk's token in a shared attention job scores only its own prefix's keys",
        edit("kvcache/backends/cpu_decode.c",
             "const int own = ns[t] - start < page_size ? ns[t] - start : page_size;",
             "const int own = count;"),
        tests="tests/kvcache/test_cpu_decode.py::test_a_chunks_tokens_together_get_the_bits_each_gets_alone",
    ),
    mutant(
        "attention-run-sums-past-a-tokens-values",
        "a chunk's token in a shared attention job sums only its own prefix's values",
        edit("kvcache/backends/cpu_decode.c",
             "                    for (int o = 0; o < nt; ++o) {",
             "                    for (int o = 0; o < nb; ++o) {"),
        tests="tests/kvcache/test_cpu_decode.py::test_a_chunks_tokens_together_get_the_bits_each_gets_alone",
    ),
    mutant(
        "http-max-tokens-default-16",
        "an HTTP request without max_tokens runs to the end of the context, not 16 tokens",
        edit("service/http/front.py",
             "sequences=opts.n, to_context_end=True,",
             "sequences=opts.n, to_context_end=False,"),
        tests="tests/http/test_openai_defaults.py::test_chat_without_max_tokens_runs_to_the_end_of_the_context",
    ),
    mutant(
        "open-max-tokens-ignores-tokens-per-minute",
        "an open-ended max_tokens stays within what the tenant's tokens_per_minute allows",
        edit("service/admission/prep.py",
             "            cap = max(1, min(cap, tpm // max(1, sequences) - fields.input.cost))",
             "            cap = cap"),
        tests="tests/service/test_request_prep.py::test_an_unset_max_tokens_runs_to_the_context_end_only_when_asked",
    ),
    mutant(
        "served-model-alias-unresolved",
        "a --served-model-name alias selects the base model on both fronts",
        edit("service/admission/request_fields.py",
             "return self.name if requested in self.aliases else requested",
             "return requested"),
        tests="tests/http/test_openai_defaults.py::test_served_model_names_are_listed_and_answer_on_both_fronts",
    ),
    mutant(
        "metrics-on-http-unpaced",
        "/metrics on the HTTP port is paced per peer like /health",
        edit("service/http/pacing.py",
             'PEER_PACED = frozenset({"/health", "/metrics"})',
             'PEER_PACED = frozenset({"/health"})'),
        tests="tests/http/test_guard.py::test_floods_of_cheap_answers_are_paced",
    ),
)
