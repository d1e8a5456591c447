"""Switch-offs of the hardening on tenant-controlled work: grammar depth and stack, sampling
costs, tokenizer budget, the HTTP connection guard and pacing, cluster lease renewal, and the
bounds both fronts put on a request before it is parsed."""

from tools.mutants.mutant import edit, mutant

GRAMMAR = "service/structured/grammar.py"
GUARD = "service/http/guard.py"
T_GUARD = "tests/http/test_guard.py"

MUTANTS = (
    mutant(
        "grammar-depth-unchecked",
        "a Lark grammar whose rule references chain past the limit is refused before llguidance",
        edit(GRAMMAR, "            if depth > limits.max_depth:\n                return GrammarError(",
             "            if False:\n                return GrammarError("),
        tests="tests/engine/test_grammar_depth.py",
    ),
    mutant(
        "compile-on-default-stack",
        "grammars compile on large-stack threads, so a chain the limit misses cannot crash",
        edit("service/structured/compile_executor.py",
             "previous = threading.stack_size(stack_bytes)",
             "previous = threading.stack_size(0)"),
        tests="tests/engine/test_compile_executor.py",
    ),
    mutant(
        "sampling-cost-outside-the-step",
        "a row's measured sampling cost counts in the decode guard",
        edit("service/engine/step_budget.py",
             "if cost.decode_seconds(len(rows) + 1, more) + sampling + seq.sample_s <= limit:",
             "if cost.decode_seconds(len(rows) + 1, more) <= limit:"),
        tests="tests/engine/test_sampling_cost.py",
    ),
    mutant(
        "tokenizer-budget-off",
        "a tenant's tokenizer time is held to its share of a core",
        edit("service/admission/tokenizer_pool.py",
             "await asyncio.sleep(self._debt_wait(tenant))", "await asyncio.sleep(0)"),
        tests="tests/service/test_tokenize_limits.py",
    ),
    mutant(
        "http-per-peer-cap-off",
        "one peer holds at most max_per_peer HTTP connections",
        edit(GUARD, "(self.peers.by_peer[peer] >= self.guard.max_per_peer, peer)", "(False, peer)"),
        tests=f"{T_GUARD}::test_slowloris_connections_are_capped_and_timed_out_while_others_are_served",
    ),
    mutant(
        "http-pacing-off",
        "floods of cheap HTTP answers are held to the paced rate",
        edit("service/http/pacing.py", "wait = pace.hold(key)", "wait = 0.0"),
        tests=f"{T_GUARD}::test_floods_of_cheap_answers_are_paced",
    ),
    mutant(
        "lease-renewal-xx",
        "a lease renewal re-adds leases a restarted Redis lost",
        edit("service/admission/redis_scripts.py",
             "redis.call('ZADD', key, expires, ARGV[i + 1])",
             "redis.call('ZADD', key, 'XX', expires, ARGV[i + 1])"),
        tests="tests/cluster/test_redis_limits.py",
    ),
    mutant(
        "http-body-bound-is-the-front-cap",
        "an HTTP body is judged against its tenant's prompt limit before it is parsed",
        edit("service/http/deps.py",
             "    limit = request_limit(tokens, JSON_BYTES_PER_TOKEN, MAX_BODY_BYTES)",
             "    limit = MAX_BODY_BYTES"),
        tests="tests/http/test_front_bounds.py::test_a_body_past_the_tenants_limit_is_413_from_its_declared_length",
    ),
    mutant(
        "grpc-message-decoded-past-tenant-limit",
        "a gRPC message larger than its tenant's prompt limit allows is refused undecoded",
        edit("service/grpc/interceptor.py", "            if len(raw) > limit:", "            if False:"),
        tests="tests/service/test_request_size.py::test_a_message_past_the_tenants_limit_is_refused_from_its_size",
    ),
    mutant(
        "http-wrong-key-reaches-the-app",
        "a wrong key is answered from the request's headers; nothing pipelined behind it is read",
        edit(GUARD, "        refusal = self._gated()\n", "        refusal = None\n"),
        tests="tests/http/test_front_bounds.py::test_a_wrong_key_is_401_from_the_headers_and_nothing_behind_it_is_read",
    ),
    mutant(
        "grpc-refusals-unpaced",
        "a tenant's refused gRPC calls are held per tenant, as HTTP's 4xx are",
        edit("service/grpc/interceptor.py",
             "        if code in PACED_CODES:\n            await self._hold(tenant)",
             "        if False:\n            await self._hold(tenant)"),
        tests="tests/service/test_refusal_pace.py::test_a_tenants_invalid_calls_are_paced_and_another_tenants_are_not",
    ),
    mutant(
        "chat-size-counts-content-only",
        "every chat field that reaches the tokenizer counts toward the chat's byte limit",
        edit("service/structured/tools.py",
             '            yield f"{where}.tool_calls[{j}].arguments", call.arguments\n',
             ""),
        tests="tests/service/test_tool_calls.py",
    ),
)
