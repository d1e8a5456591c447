"""Switch-offs of the fair-share rules: compute, memory and the eviction channel."""

from tools.mutants.mutant import edit, mutant

SCHEDULER = "service/engine/scheduler.py"
STEP_BUDGET = "service/engine/step_budget.py"
COST_MODEL = "service/engine/cost_model.py"
FAIRNESS = "service/engine/fairness.py"
T_FAIR = "tests/engine/test_fair_compute.py"
T_SHARE = "tests/engine/test_fairness.py"
T_PROMPT = "tests/engine/test_prompt_before_streams.py"
T_COST = "tests/engine/test_cost_model.py"
T_PROPS = "tests/engine/test_scheduler_properties.py"
T_LAG = f"{T_PROPS}::test_a_backlogged_tenant_never_lags_its_fair_share_by_more_than_two_steps"
T_GAP = f"{T_PROPS}::test_a_tenants_gap_stays_within_the_stated_bound_of_its_own_rows_cost"

MUTANTS = (
    mutant(
        "preempt-most-over-share",
        "when an overcommitted pool runs out, a sequence of the tenant most over its share is preempted",
        edit(SCHEDULER,
             "rivals = self._running_of(most_over_share(self._cache, self.running, self.fair))",
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
        edit("service/admission/kv_shares.py", "shares[name] = math.floor(left * weight / total_weight)",
             "shares[name] = left"),
        tests="tests/service/test_kv_shares.py",
    ),
    mutant(
        "share-evicts-others",
        "a tenant at its share evicts its own cached pages, never another tenant's",
        edit("kvcache/page_store.py",
             "        for _ in range(quota_evictions):\n            page_id = self.evictable.oldest(tenant)",
             "        for _ in range(quota_evictions):\n            page_id = self.evictable.oldest()"),
        tests="tests/kvcache/test_quota.py",
    ),
    mutant(
        "decode-stretch-off",
        "while decodes run, a prefill chunk keeps the step within decode_stretch decode-only steps",
        edit(STEP_BUDGET,
             "stretch_s = max(0.0, guard_s - cost.decode_seconds(len(decodes), keys))",
             "stretch_s = math.inf"),
        tests=(f"{T_FAIR}::test_a_prefill_chunk_beside_decodes_keeps_the_step_within_twice_a_decode_step",
               T_GAP),
    ),
    mutant(
        "batch-size-priced-by-line",
        "a decode batch size that was seen is priced at its own time, not the fitted line",
        edit(COST_MODEL, "            if seen == padded:", "            if seen == -padded:"),
        tests=f"{T_COST}::test_a_batch_size_seen_is_priced_at_its_own_time_not_the_line",
    ),
    mutant(
        "chunk-cost-ignores-context",
        "a prefill chunk is sized by the keys it reads, so late chunks of a long prompt stay in time",
        edit(COST_MODEL, "b = self.per_token_s + self.per_key_s * (context + 0.5)",
             "b = self.per_token_s + self.per_key_s * 0.5"),
        tests=T_COST,
    ),
    mutant(
        "token-counter-unweighted",
        "prefill and decode tokens are shared by weight (virtual token counter)",
        edit(FAIRNESS,
             "self._count[tenant] = self[tenant] + tokens / self._weight(tenant)",
             "self._count[tenant] = self[tenant] + tokens"),
        edit(FAIRNESS, "self._spent.get(tenant, 0) / self._weight(tenant)",
             "self._spent.get(tenant, 0)"),
        tests=(f"{T_FAIR}::test_prefill_tokens_are_shared_by_weight", T_LAG),
    ),
    mutant(
        "refusals-unpaced",
        "refused calls from one peer host are paced past a burst",
        edit("service/grpc/interceptor.py",
             "wait = self._pace.reserve(peer) if self._pace is not None else 0.0",
             "wait = 0.0"),
        tests="tests/service/test_refusal_pace.py",
    ),
    mutant(
        "input-uncharged",
        "admission charges the input by its size before tokenizing (both fronts)",
        edit("service/admission/gate.py",
             "cost = fields.input.cost + fields.stopping.max_tokens",
             "cost = 0"),
        tests="tests/http/test_errors.py::test_input_is_charged_before_the_tokenizer_runs",
    ),
    mutant(
        "prefill-floor-for-all",
        "beside another tenant's decodes, only the least-served tenant's chunk gets the prefill floor",
        edit(STEP_BUDGET, "full = owed or remaining <= self.tuning.min_prefill_tokens",
             "full = True"),
        tests=f"{T_FAIR}::test_beside_anothers_decodes_only_the_least_served_tenant_gets_the_prefill_floor",
    ),
    mutant(
        "step-timer-one-tenant",
        "a tenant alone is held to the token budget only: the time bound guards tenants from each other",
        edit(STEP_BUDGET, "if not self.tuning.timed or not any(t != tenant for t in present):",
             "if not self.tuning.timed:"),
        tests=f"{T_FAIR}::test_the_step_time_bound_applies_while_another_tenant_has_work",
    ),
    mutant(
        "step-timer-off",
        "other tenants' chunks add at most max_step_ms to a step a tenant with work is in",
        edit(STEP_BUDGET, "left = self.bound_s - self.others_s(terms)\n", "left = math.inf\n"),
        tests=(f"{T_FAIR}::test_the_step_time_bound_applies_while_another_tenant_has_work", T_GAP),
    ),
    mutant(
        "own-chunks-against-own-bound",
        "a level tenant's own chunks count only against the other tenants' max_step_ms bound",
        edit(STEP_BUDGET, "        if not terms.level:\n            return self.chunks_s",
             "        if True:\n            return self.chunks_s"),
        tests=f"{T_FAIR}::test_a_tenants_own_chunks_count_only_against_the_others_bound",
    ),
    mutant(
        "others-bound-skips-chunkless",
        "a present tenant with no chunk in the step sees every chunk as another's",
        edit(STEP_BUDGET, "for t in self.present if t != terms.tenant",
             "for t in self.own_s if t != terms.tenant"),
        tests=(f"{T_FAIR}::test_a_tenants_own_chunks_count_only_against_the_others_bound", T_GAP),
    ),
    mutant(
        "level-for-all",
        "a tenant more than a step's tokens ahead has every chunk in the step count against it",
        edit(STEP_BUDGET, "level = fair.level(tenant, present, self.tuning.max_num_batched_tokens)",
             "level = True"),
        tests=(f"{T_FAIR}::test_a_tenants_own_chunks_count_only_against_the_others_bound", T_LAG),
    ),
    mutant(
        "idle-grace-off",
        "a tenant between two requests still counts as present for idle_grace_s",
        edit(FAIRNESS, "if now - at > self._grace_s]", "if True]"),
        tests=(f"{T_SHARE}::test_a_tenant_between_requests_counts_as_present_for_the_grace_period",
               f"{T_FAIR}::test_the_step_time_bound_applies_while_another_tenant_has_work"),
    ),
    mutant(
        "admission-ignores-counts",
        "the next request comes from the eligible tenant with the fewest weighted processed tokens",
        edit(FAIRNESS, "if eligible(tenant) and (best is None or rank(tenant) < rank(best)):",
             "if eligible(tenant) and best is None:"),
        tests=(f"{T_SHARE}::test_admission_offers_the_least_served_eligible_tenant_first", T_LAG),
    ),
    mutant(
        "chunks-ignore-counts",
        "prefill chunks go to the tenant with the fewest weighted processed tokens first",
        edit(FAIRNESS, "return self.served(tenant), admit_order", "return 0.0, admit_order"),
        tests=(T_LAG, f"{T_FAIR}::test_prefill_tokens_are_shared_by_weight"),
    ),
    mutant(
        "regime-jump-ignored",
        "a chunk stays on the packed weights unless the time bound pays for the jump past them",
        edit(COST_MODEL, "return leave if leave > packed - step_tokens else stay",
             "return self._line_tokens(seconds, context)"),
        tests=(f"{T_COST}::test_a_chunk_stays_on_the_packed_weights_unless_the_time_pays_for_the_jump",
               T_GAP),
    ),
    mutant(
        "graph-sizes-ignored",
        "a decode step costs what the CUDA-graph batch it replays costs",
        edit(COST_MODEL, "return next((s for s in sorted(self.graph_sizes) if s >= rows), rows)",
             "return rows"),
        tests=f"{T_COST}::test_a_decode_step_costs_what_its_cuda_graph_batch_costs",
    ),
    mutant(
        "owed-held-to-stretch",
        "a chunk of a tenant owed service is held only to max_step_ms, not to the decode stretch",
        edit(STEP_BUDGET, "stretched=not owed", "stretched=True"),
        tests=f"{T_FAIR}::test_a_tenant_owed_service_is_held_only_to_max_step_ms",
    ),
    mutant(
        "stretch-spares-the-ahead",
        "a chunk of a tenant ahead of a decoding tenant is held to the decode stretch",
        edit(STEP_BUDGET, "stretched=not owed", "stretched=False"),
        tests=(f"{T_FAIR}::test_a_prefill_chunk_beside_decodes_keeps_the_step_within_twice_a_decode_step",
               T_GAP),
    ),
    mutant(
        "decode-guard-off",
        "beside a less-served tenant's streams, other tenants' decode rows fit within its guard",
        edit(STEP_BUDGET,
             "if cost.decode_seconds(len(rows) + 1, more) + sampling + seq.sample_s <= limit:",
             "if True:"),
        tests=(f"{T_FAIR}::test_a_heavy_tenants_streams_take_turns_beside_a_light_tenants_stream",
               T_GAP),
    ),
    mutant(
        "prompt-floor-off",
        "a tenant ahead with a prompt running keeps its prompt's prefill floor out of its rows' room",
        edit(STEP_BUDGET, "limit = guard - kept.get(seq.tenant, 0.0)", "limit = guard"),
        tests=f"{T_PROMPT}::test_a_tenant_ahead_keeps_its_prompts_floor_out_of_its_streams_room",
    ),
    mutant(
        "warm-up-tenant-stays-present",
        "the warm-up tenant stops counting as present when warm-up ends",
        edit("service/engine/warmup.py", "    core.retire(WARMUP_TENANT)\n", ""),
        tests="tests/engine/test_engine_async.py::test_the_warm_up_tenant_does_not_stay_present_after_warm_up",
    ),
    mutant(
        "guarded-rows-no-turns",
        "a tenant's decode rows held back by the guard take turns (round robin)",
        edit(FAIRNESS, "key=lambda r: (r.admit_order <= cursor, r.admit_order))",
             "key=lambda r: r.admit_order)"),
        tests=(f"{T_FAIR}::test_a_heavy_tenants_streams_take_turns_beside_a_light_tenants_stream",
               f"{T_SHARE}::test_decode_rows_least_served_first_and_the_others_take_turns"),
    ),
    mutant(
        "lift-only-to-active",
        "a tenant returning while nobody else is active starts level with the most served tenant",
        edit(FAIRNESS,
             "floor = min(others) if others else max(self._count.values(), default=0.0)",
             "floor = min(others) if others else 0.0"),
        tests="tests/engine/test_fairness.py::test_a_returning_tenant_gets_no_credit_for_idle_time",
    ),
    mutant(
        "failed-rows-uncharged",
        "a request whose rows ran and failed is charged the tokens they processed",
        edit("service/engine/core.py",
             "            self._scheduler.charge([e for e in plan.entries if id(e.seq) in failed])",
             "            self._scheduler.charge([])"),
        tests="tests/engine/test_blast_radius.py::test_a_row_whose_logits_are_not_finite_fails_alone",
    ),
)
