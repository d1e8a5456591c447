"""Switch-offs of the isolation checks inside ``kvcache/``."""

from tools.mutants.mutant import edit, mutant

ALLOC = "kvcache/allocator.py"
MANAGER = "kvcache/manager.py"
STORE = "kvcache/page_store.py"
PREFIX = "kvcache/prefix_cache.py"
T_ALLOC = "tests/kvcache/test_allocator.py"
T_PREFIX = "tests/kvcache/test_prefix_cache.py"
T_SCRUB = "tests/kvcache/test_scrub.py"
T_SHARED = "tests/kvcache/test_shared_prefix.py"
T_TIER = "tests/kvcache/test_kv_tier.py"
T_BOUNDARY = "tests/kvcache/test_cpu_decode_boundary.py"
DECODE_C = "kvcache/backends/cpu_decode.c"

MUTANTS = (
    mutant(
        "share-owner-check",
        "a prefix hit shares only a page its own tenant owns",
        edit(ALLOC, "        if s.owner != tenant:\n            raise self._violation(page_id, "
             '"prefix hit on', "        if False:\n            raise self._violation(page_id, "
             '"prefix hit on'),
        tests=f"{T_PREFIX}::test_owner_check_backs_up_the_key_spaces",
    ),
    mutant(
        "scrub-on-reassign",
        "a page is zeroed before it passes to another tenant",
        edit(STORE, 'if self.config.scrub_policy != "off" and data_owner not in (None, tenant):',
             "if False:"),
        tests=T_SCRUB,
    ),
    mutant(
        "mark-written",
        "a page records whose KV it holds once written",
        edit(ALLOC, "self._pages[page_id].data_owner = tenant", "del page_id, tenant"),
        tests=T_SCRUB,
    ),
    mutant(
        "key-hit-token-compare",
        "a key hit is used only if the stored token ids equal the request's",
        edit(PREFIX, "and entry.token_ids == tuple(token_ids):", "and True:"),
        tests=T_PREFIX,
    ),
    mutant(
        "key-hit-namespace-compare",
        "a key hit is used only inside the request's own namespace (tenant, adapter, salt)",
        edit(PREFIX, "same_namespace = entry.namespace == ns", "same_namespace = True"),
        tests=f"{T_PREFIX}::test_a_forced_key_collision_across_salts_is_refused",
    ),
    mutant(
        "key-hit-parent-compare",
        "a key hit is used only under the exact parent entry",
        edit(PREFIX, "if entry.parent_serial == pos.serial and", "if True and"),
        tests=T_PREFIX,
    ),
    mutant(
        "begin-step-fence",
        "begin_step checks every page's owner and generation before a step",
        edit(MANAGER, "                    self.allocator.check(ref, table.tenant, e.seq_id, write=write)\n",
             "                    pass\n"),
        tests=T_ALLOC,
    ),
    mutant(
        "generation-check",
        "a stale PageRef (older generation) is refused",
        edit(ALLOC, "if s.generation != ref.generation:", "if False:"),
        tests=T_ALLOC,
    ),
    mutant(
        "key-framing",
        "every prefix-key field is length-framed",
        edit(PREFIX, 'return b"".join(len(f).to_bytes(8, "big") + f for f in fields)',
             'return b"".join(fields)'),
        tests=T_PREFIX,
    ),
    mutant(
        "tenant-key-space",
        "each tenant has its own prefix-key space",
        edit(PREFIX, "holding ``token_ids``, if any.\"\"\"\n",
             "holding ``token_ids``, if any.\"\"\"\n        ns = Namespace(\"shared\", ns.adapter, ns.salt)\n"),
        edit(PREFIX, "None (nothing inserted) on a collision.\"\"\"\n",
             "None (nothing inserted) on a collision.\"\"\"\n        ns = Namespace(\"shared\", ns.adapter, ns.salt)\n"),
        tests=f"{T_PREFIX}::test_cross_tenant_prefix_never_hits",
    ),
    mutant(
        "salt-blind-cache",
        "two cache salts of one tenant share no cached pages",
        edit(PREFIX, "holding ``token_ids``, if any.\"\"\"\n",
             "holding ``token_ids``, if any.\"\"\"\n        ns = Namespace(ns.tenant, ns.adapter)\n"),
        edit(PREFIX, "None (nothing inserted) on a collision.\"\"\"\n",
             "None (nothing inserted) on a collision.\"\"\"\n        ns = Namespace(ns.tenant, ns.adapter)\n"),
        tests=f"{T_PREFIX}::test_two_salts_of_one_tenant_share_no_pages",
    ),
    mutant(
        "shared-page-writable",
        "no step writes a sealed shared-prefix page",
        edit(ALLOC, "        if write and s.read_only:", "        if False:"),
        tests=f"{T_SHARED}::test_the_fence_refuses_a_write_to_a_shared_page",
    ),
    mutant(
        "shared-without-opt-in",
        "a tenant reads only the shared prefixes it opted in to",
        edit(MANAGER, "        return policy.shared_prefixes", "        return frozenset(self.shared.declared)"),
        tests=f"{T_SHARED}::test_a_tenant_that_did_not_opt_in_never_hits",
    ),
    mutant(
        "shared-across-adapters",
        "adapter and salted sequences never read a shared prefix",
        edit(MANAGER, "if policy is None or not table.use_prefix_cache or table.adapter or table.salt:",
             "if policy is None or not table.use_prefix_cache:"),
        tests=f"{T_SHARED}::test_adapters_salts_and_the_bypass_flag_never_hit",
    ),
    mutant(
        "shared-page-freed-while-declared",
        "a declared shared page outlives its readers and is never evicted",
        edit("kvcache/page_store.py", "                if not (shared.declared and shared.live):",
             "                if True:"),
        tests=f"{T_SHARED}::test_shared_pages_are_never_evicted_under_pressure",
    ),
    mutant(
        "tier-one-key",
        "each tenant's KV tier records are sealed under its own key",
        edit("kvcache/tier_seal.py", '    return _hkdf(secret, frame(b"tenant", tenant.encode()))',
             '    return _hkdf(secret, frame(b"tenant"))'),
        tests=f"{T_TIER}::test_records_are_aes_gcm_under_the_tenants_own_key_and_bound_to_their_place",
    ),
    mutant(
        "tier-token-compare",
        "a KV tier record comes back only if its token ids equal the request's",
        edit("kvcache/tier.py", "            and opened[0].token_ids == tuple(token_ids)", ""),
        tests=f"{T_TIER}::test_a_tier_record_is_reused_only_after_its_tokens_are_compared",
    ),
    mutant(
        "kernel-flushes-subnormals",
        "loading the CPU decode kernel leaves the process's floating point as it was",
        edit("kvcache/native_build.py", 'FLAGS = ("-O3", ', 'FLAGS = ("-O3", "-ffast-math", '),
        tests="tests/kvcache/test_cpu_decode.py::test_loading_the_kernel_keeps_subnormal_numbers",
    ),
    mutant(
        "kernel-reads-past-length",
        "the CPU decode kernel reads only each sequence's own keys, on its own pages",
        edit("kvcache/backends/cpu_decode.c", "const int n = lens[b];", "const int n = lens[b] + 1;"),
        tests="tests/kvcache/test_cpu_decode.py::test_kernel_builds_and_matches_float32_attention",
    ),
    mutant(
        "fused-write-unchecked",
        "the C KV write (compiled and eager all-decode steps) stores only rows inside the layer it was given",
        edit(DECODE_C, "if (rows[i] < 0 || rows[i] >= layer_rows) return -1;",
             "if (rows[i] < 0) return -1;"),
        tests="tests/kvcache/test_cpu_decode.py::test_fused_write_and_attend_equals_the_write_then_the_kernel",
    ),
    mutant(
        "native-attend-any-layer",
        "native model code reaches KV memory only through kvcache's call, which takes only the pool's own layers",
        edit("kvcache/backends/cpu_decode.c", "if (layer < 0 || layer >= c->layers) return -1;",
             "if (layer < 0) return -1;"),
        tests="tests/kvcache/test_cpu_decode.py::test_step_context_attends_each_layer_as_write_run",
    ),
    mutant(
        "kernel-page-index-range",
        "the CPU decode kernel reads only pages inside the layer it was given",
        edit(DECODE_C, "if (indices[p] < 0 || (int64_t)indices[p] >= num_pages) return KVF_BAD_PAGE;",
             "if (indices[p] < 0) return KVF_BAD_PAGE;"),
        tests=(
            f"{T_BOUNDARY}::test_a_page_index_outside_the_pool_is_refused",
            "tests/engine/test_kernel_refusal.py",
        ),
    ),
    mutant(
        "kernel-spans-inside-page-list",
        "the CPU decode kernel reads page indices only inside the plan's page list",
        edit(DECODE_C, "if ((int64_t)indptr[batch] > n_indices) return KVF_BAD_SPANS;", ""),
        tests=f"{T_BOUNDARY}::test_the_c_entry_point_checks_the_plan_itself",
    ),
    mutant(
        "kernel-length-inside-pages",
        "the CPU decode kernel reads a sequence's keys only on its own pages",
        edit(DECODE_C, "if (lens[b] < 0 || (int64_t)lens[b] > pages * page_size) return KVF_BAD_LENGTH;",
             "if (lens[b] < 0) return KVF_BAD_LENGTH;"),
        tests=f"{T_BOUNDARY}::test_the_c_entry_point_checks_the_plan_itself",
    ),
    mutant(
        "kernel-writes-own-pages",
        "the C KV write stores a sequence's K/V only on a page the step plan gave that sequence",
        edit(DECODE_C, "        if (!own) return KVF_ROW_NOT_OWN;\n", ""),
        tests=f"{T_BOUNDARY}::test_the_writer_stores_only_on_its_own_sequences_pages",
    ),
    mutant(
        "step-context-contiguous-pool",
        "native model code gets a step context only over a contiguous pool",
        edit("kvcache/backends/cpu_decode.py", "            or not kv.is_contiguous()  # the C code", "            or False  # the C code"),
        tests=f"{T_BOUNDARY}::test_step_context_refuses_a_pool_whose_layers_are_not_contiguous",
    ),
    mutant(
        "kernel-cache-foreign-owner",
        "a kernel library another user owns or could write is never loaded",
        edit("kvcache/native_build.py",
             "if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:",
             "if not stat.S_ISREG(st.st_mode):"),
        tests="tests/kvcache/test_native_build.py::test_a_planted_library_is_never_loaded",
    ),
    mutant(
        "kernel-cache-digest",
        "a kernel library whose bytes differ from the digest written at its build is never loaded",
        edit("kvcache/native_build.py",
             'if digest is None or data[:4] != b"\\x7fELF" or sidecar(data) != digest:',
             'if digest is None or data[:4] != b"\\x7fELF":'),
        tests="tests/kvcache/test_native_build.py::test_an_entry_whose_bytes_do_not_match_its_digest_is_never_loaded",
    ),
    mutant(
        "decode-exp-drops-nan",
        "a NaN in q, K or V reaches the CPU decode kernel's output",
        edit(DECODE_C, "x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);", "x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));"),
        edit(DECODE_C, "x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);", "x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));"),
        tests="tests/kvcache/test_cpu_decode.py::test_a_nan_in_q_k_or_v_reaches_the_output_as_in_torch",
    ),
)
