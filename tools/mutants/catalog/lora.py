"""Switch-offs of what per-tenant LoRA adapters guarantee: visibility, KV separation, and
the deltas the native decoder stack adds."""

from tools.mutants.mutant import edit, mutant

T_SERVE = "tests/service/test_lora_serving.py"
T_STACK = "tests/model/test_lora_stack.py"

MUTANTS = (
    mutant(
        "adapter-visible-to-other-tenants",
        "a tenant naming another tenant's adapter gets exactly what an unknown name gets",
        edit("service/adapters.py",
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
             "        return Namespace(self.tenant, adapter=self.adapter, salt=self.salt)",
             "        return Namespace(self.tenant, salt=self.salt)"),
        tests=f"{T_SERVE}::test_adapters_and_the_base_never_share_cached_prefix_pages",
    ),
    mutant(
        "stack-skips-gate-up-delta",
        "an adapter row's decode step in the native stack adds every projection's delta",
        edit("service/model/q4_gemv.c",
             "             lora_for(&job, lgu, NULL, v, rows, hidden, 2 * inter, halves, h, u, span)) != 0 ||",
             "             NULL) != 0 ||"),
        tests=f"{T_STACK}::test_a_mixed_adapter_step_runs_in_the_stack_as_the_layer_loop_computes_it",
    ),
    mutant(
        "stack-lora-wrong-module-slice",
        "the stack reads each module's own rank slice of a block-diagonal B",
        edit("service/model/q4_gemv.c",
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
        edit("service/model/q4_gemv.c",
             "    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));",
             "    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 15));"),
        tests=f"{T_STACK}::test_a_half_precision_adapter_is_held_so_and_computes_exactly_its_float32_copy",
    ),
    mutant(
        "stack-lora-float16-widened-as-bfloat16",
        "the stack widens float16-held adapter weights as float16",
        edit("service/model/q4_gemv.c",
             "    if (held == HELD_F16) return _mm256_cvtph_ps(h);",
             "    if (held == HELD_F16 && 0) return _mm256_cvtph_ps(h);"),
        tests=f"{T_STACK}::test_a_half_precision_adapter_is_held_so_and_computes_exactly_its_float32_copy",
    ),
    mutant(
        "stack-lora-group-shares-first-rows-input",
        "rows that share a pass over an adapter's weights each dot their own input",
        edit("service/model/q4_gemv.c",
             "                s0[p][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + j), w0, s0[p][q]);\n"
             "                s1[p][q]",
             "                s0[p][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + j), w0, s0[p][q]);\n"
             "                s1[p][q]"),
        tests=f"{T_STACK}::test_a_mixed_adapter_step_runs_in_the_stack_as_the_layer_loop_computes_it",
    ),
)
