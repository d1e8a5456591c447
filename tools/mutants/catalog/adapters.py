"""Switch-offs of what per-tenant LoRA adapters guarantee: visibility, KV separation, and
the deltas the native decoder stack adds."""

from tools.mutants.mutant import edit, mutant

T_SERVE = "tests/service/test_lora_serving.py"
T_STACK = "tests/model/test_lora_stack.py"
T_BLAST = "tests/service/test_adapter_blast_radius.py"
T_TIERS = "tests/service/test_lora_tiers.py"
T_ROWS = "tests/engine/test_blast_radius.py"

MUTANTS = (
    mutant(
        "adapter-visible-to-other-tenants",
        "a tenant naming another tenant's adapter gets exactly what an unknown name gets",
        edit("service/admission/tenant_adapters.py",
             "        entry = self._tenants.get(tenant.name)\n"
             "        if entry is None or model not in entry.declared:\n",
             "        entry = next((e for e in self._tenants.values() if model in e.declared), None)\n"
             "        if entry is None or model not in entry.declared:\n"),
        tests=f"{T_SERVE}::test_another_tenants_adapter_is_refused_exactly_like_a_name_that_exists_nowhere",
    ),
    mutant(
        "prefix-key-without-adapter",
        "the prefix-cache namespace includes the adapter: no KV is shared across adapters or the base",
        edit("kvcache/page_table.py",
             "            self.tenant, adapter=self.adapter, salt=self.salt, shared=self.shared_chain",
             "            self.tenant, salt=self.salt, shared=self.shared_chain"),
        tests=f"{T_SERVE}::test_adapters_and_the_base_never_share_cached_prefix_pages",
    ),
    mutant(
        "stack-skips-gate-up-delta",
        "an adapter row's decode step in the native stack adds every projection's delta",
        edit("service/model/native/mlp.h",
             "lora_for(&job, lgu, NULL, v, rows, hidden, 2 * inter, halves, h, u, span)) != 0)",
             "NULL) != 0)"),
        tests=f"{T_STACK}::test_a_mixed_adapter_step_runs_in_the_stack_as_the_layer_loop_computes_it",
    ),
    mutant(
        "stack-lora-wrong-module-slice",
        "the stack reads each module's own rank slice of a block-diagonal B",
        edit("service/model/native/lora.h",
             "        *lo += m * slice;",
             "        *lo += (job->parts - 1 - m) * slice;"),
        tests=f"{T_STACK}::test_a_mixed_adapter_step_runs_in_the_stack_as_the_layer_loop_computes_it",
    ),
    mutant(
        "adapter-held-half-when-inexact",
        "an adapter is held in a half type only when every value is one",
        edit("service/model/lora.py",
             "        if all(t.dtype == half or torch.equal(t.to(half).to(t.dtype), t) for t in tensors.values()):",
             "        if all(t.dtype == half or torch.equal(t.to(half).to(t.dtype), t) for t in tensors.values()) or True:"),
        tests=f"{T_STACK}::test_a_half_precision_adapter_is_held_so_and_computes_exactly_its_float32_copy",
    ),
    mutant(
        "stack-lora-bfloat16-widened-wrong",
        "the stack widens bfloat16-held adapter weights exactly to float32 (the bits moved up 16)",
        edit("service/model/native/lora_loops.h",
             "    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));",
             "    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 15));"),
        tests=f"{T_STACK}::test_a_half_precision_adapter_is_held_so_and_computes_exactly_its_float32_copy",
    ),
    mutant(
        "stack-lora-float16-widened-as-bfloat16",
        "the stack widens float16-held adapter weights as float16",
        edit("service/model/native/lora_loops.h",
             "    if (held == HELD_F16) return _mm256_cvtph_ps(h);",
             "    if (held == HELD_F16 && 0) return _mm256_cvtph_ps(h);"),
        tests=f"{T_STACK}::test_a_half_precision_adapter_is_held_so_and_computes_exactly_its_float32_copy",
    ),
    mutant(
        "stack-lora-group-shares-first-rows-input",
        "rows that share a pass over an adapter's weights each dot their own input",
        edit("service/model/native/lora_loops.h",
             "                s0[p][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + j), w0, s0[p][q]);\n"
             "                s1[p][q]",
             "                s0[p][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + j), w0, s0[p][q]);\n"
             "                s1[p][q]"),
        tests=f"{T_STACK}::test_a_mixed_adapter_step_runs_in_the_stack_as_the_layer_loop_computes_it",
    ),
    mutant(
        "lora-masked-product-over-every-row",
        "an adapter's values never enter another row's arithmetic (segments, not a masked product)",
        edit("service/model/lora_batch.py",
             "        if plan.rows is None:\n            g = plan.parts[0][0]",
             "        if plan.stack is not None and plan.mask is not None:\n"
             "            a, b = _weights(plan.stack, layer, x.dtype)\n"
             "            out.addmm_((x @ a.T).mul_(plan.mask.to(x.dtype)), b)\n"
             "            return\n"
             "        if plan.rows is None:\n            g = plan.parts[0][0]"),
        tests=f"{T_BLAST}::test_an_overflowing_adapter_fails_its_own_request_and_no_other_row",
    ),
    mutant(
        "non-finite-adapter-weights-served",
        "an adapter with a NaN or infinite weight is refused by name at start and on reload",
        edit("service/model/lora.py", "                if not bool(torch.isfinite(t).all()):",
             "                if False:"),
        tests=T_BLAST,
    ),
    mutant(
        "stack-checks-absent-projections",
        "an adapter on some projections only (PEFT's q_proj/v_proj) runs in the native stack",
        edit("service/model/native/stack.h",
             "        if (g[L_RANKS] == 0) continue; /* no delta on this projection: the rest is unread */\n",
             ""),
        tests=T_TIERS,
    ),
    mutant(
        "failed-forward-fails-every-row",
        "a forward that raises fails only the rows that fail alone",
        edit("service/engine/core.py",
             "            log.warning(\"step_failed_isolating\", rows=len(entries), error=type(err).__name__)",
             "            raise"),
        tests=f"{T_ROWS}::test_a_row_whose_forward_raises_fails_alone",
    ),
    mutant(
        "non-finite-logits-sampled",
        "a row whose logits are not finite fails with that reason; the others keep their tokens",
        edit("service/engine/core.py", "            if not all(finite):", "            if False:"),
        tests=f"{T_ROWS}::test_a_row_whose_logits_are_not_finite_fails_alone",
    ),
    mutant(
        "sampling-replay-keeps-advanced-generators",
        "a sampling run again row by row restores each seeded generator first",
        edit("service/engine/core.py",
             "                e.seq.generator.set_state(state)  # as before the batch's draw",
             "                pass"),
        tests=f"{T_ROWS}::test_a_row_whose_sampling_raises_fails_alone",
    ),
)
