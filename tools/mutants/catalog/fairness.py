"""Switch-offs of the fair-share rules: compute, memory and the eviction channel."""

from tools.mutants.mutant import edit, mutant

SCHEDULER = "service/engine/scheduler.py"
STEP_BUDGET = "service/engine/step_budget.py"
T_FAIR = "tests/engine/test_fair_compute.py"

MUTANTS = (
    mutant(
        "preempt-most-over-share",
        "when an overcommitted pool runs out, a sequence of the tenant most over its share is preempted",
        edit(SCHEDULER, "rivals = self._running_of(self._most_over_share())",
             "rivals = list(self.running)"),
        tests=f"{T_FAIR}::test_out_of_pages_preempts_the_tenant_most_over_its_share",
    ),
    mutant(
        "admission-stops-at-blocked",
        "admission skips a tenant whose next request does not fit instead of stopping for all",
        edit(SCHEDULER, "            blocked.add(seq.tenant)\n            return None",
             "            blocked.update(self.waiting.tenants())\n            return None"),
        tests=f"{T_FAIR}::test_a_tenant_whose_request_does_not_fit_does_not_block_others",
    ),
    mutant(
        "kv-share-not-derived",
        "a tenant with no max_kv_pages gets a share of the pool derived from the tenants' weights",
        edit("service/kv_shares.py", "shares[name] = math.floor(left * weight / total_weight)",
             "shares[name] = left"),
        tests="tests/service/test_kv_shares.py",
    ),
    mutant(
        "share-evicts-others",
        "a tenant at its share evicts its own cached pages, never another tenant's",
        edit("kvcache/manager.py",
             "        for _ in range(quota_evictions):\n            page_id = self.evictable.oldest(tenant)",
             "        for _ in range(quota_evictions):\n            page_id = self.evictable.oldest()"),
        tests="tests/kvcache/test_quota.py",
    ),
    mutant(
        "decode-stretch-off",
        "while decodes run, a prefill chunk keeps the step within decode_stretch decode-only steps",
        edit(SCHEDULER,
             "stretch_s = max(0.0, guard_s - cost.decode_seconds(len(decodes), keys))",
             "stretch_s = math.inf"),
        tests=f"{T_FAIR}::test_a_prefill_chunk_beside_decodes_keeps_the_step_within_twice_a_decode_step",
    ),
    mutant(
        "chunk-cost-ignores-context",
        "a prefill chunk is sized by the keys it reads, so late chunks of a long prompt stay in time",
        edit(STEP_BUDGET, "b = self.per_token_s + self.per_key_s * (context + 0.5)",
             "b = self.per_token_s + self.per_key_s * 0.5"),
        tests="tests/engine/test_step_budget.py",
    ),
    mutant(
        "token-counter-unweighted",
        "prefill and decode tokens are shared by weight (virtual token counter)",
        edit("service/engine/fairness.py",
             "self._count[tenant] = self[tenant] + tokens / self._weight(tenant)",
             "self._count[tenant] = self[tenant] + tokens"),
        edit(SCHEDULER, "self._spent.get(tenant, 0) / self._policy(tenant).weight",
             "self._spent.get(tenant, 0)"),
        tests=f"{T_FAIR}::test_prefill_tokens_are_shared_by_weight",
    ),
    mutant(
        "refusals-unpaced",
        "refused calls from one peer host are paced past a burst",
        edit("service/interceptor.py",
             "wait = self._pace.reserve(peer) if self._pace is not None else 0.0",
             "wait = 0.0"),
        tests="tests/service/test_refusal_pace.py",
    ),
    mutant(
        "http-input-uncharged",
        "the HTTP front charges the input by its size before tokenizing",
        edit("service/http/front.py",
             "cost = checked.input_cost + checked.stopping.max_tokens",
             "cost = 0"),
        tests="tests/http/test_errors.py::test_input_is_charged_before_the_tokenizer_runs",
    ),
    mutant(
        "prefill-floor-for-all",
        "beside another tenant's decodes, only the least-served tenant's chunk gets the prefill floor",
        edit(SCHEDULER,
             "room.full_floor = owed or seq.num_tokens - seq.num_computed <= _MIN_PREFILL_TOKENS",
             "room.full_floor = True"),
        tests=f"{T_FAIR}::test_beside_anothers_decodes_only_the_least_served_tenant_gets_the_prefill_floor",
    ),
    mutant(
        "step-timer-one-tenant",
        "the step time target applies only while two or more tenants have work",
        edit(SCHEDULER, "return self._config.max_step_ms > 0 and self._several_tenants()",
             "return self._config.max_step_ms > 0"),
        tests=f"{T_FAIR}::test_the_step_time_target_applies_only_while_two_tenants_have_work",
    ),
    mutant(
        "owed-held-to-stretch",
        "a chunk of a tenant owed service is held only to max_step_ms, not to the decode stretch",
        edit(SCHEDULER, "room.stretched = not owed", "room.stretched = True"),
        tests=f"{T_FAIR}::test_a_tenant_owed_service_is_held_only_to_max_step_ms",
    ),
    mutant(
        "stretch-spares-the-ahead",
        "a chunk of a tenant ahead of a decoding tenant is held to the decode stretch",
        edit(SCHEDULER, "room.stretched = not owed", "room.stretched = False"),
        tests=f"{T_FAIR}::test_a_prefill_chunk_beside_decodes_keeps_the_step_within_twice_a_decode_step",
    ),
    mutant(
        "decode-guard-off",
        "beside a less-served tenant's streams, other tenants' decode rows fit within its guard",
        edit(SCHEDULER,
             "if cost.decode_seconds(len(rows) + 1, more) + sampling + seq.sample_s <= guard:",
             "if True:"),
        tests=f"{T_FAIR}::test_a_heavy_tenants_streams_take_turns_beside_a_light_tenants_stream",
    ),
    mutant(
        "guarded-rows-no-turns",
        "a tenant's decode rows held back by the guard take turns (round robin)",
        edit(SCHEDULER, "key=lambda s: (s.admit_order <= cursor, s.admit_order),",
             "key=lambda s: s.admit_order,"),
        tests=f"{T_FAIR}::test_a_heavy_tenants_streams_take_turns_beside_a_light_tenants_stream",
    ),
    mutant(
        "lift-only-to-active",
        "a tenant returning while nobody else is active starts level with the most served tenant",
        edit("service/engine/fairness.py",
             "floor = min(others) if others else max(self._count.values(), default=0.0)",
             "floor = min(others) if others else 0.0"),
        tests="tests/engine/test_fairness.py::test_a_returning_tenant_gets_no_credit_for_idle_time",
    ),
)
