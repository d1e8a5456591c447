"""Switch-offs of the isolation checks inside ``kvcache/``."""

from tools.mutants.mutant import edit, mutant

ALLOC = "kvcache/allocator.py"
MANAGER = "kvcache/manager.py"
PREFIX = "kvcache/prefix_cache.py"
T_ALLOC = "tests/kvcache/test_allocator.py"
T_PREFIX = "tests/kvcache/test_prefix_cache.py"
T_SCRUB = "tests/kvcache/test_scrub.py"

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
        edit(MANAGER, 'if self.config.scrub_policy != "off" and data_owner not in (None, tenant):',
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
        edit(MANAGER, "                self.allocator.check(ref, table.tenant, e.seq_id)\n",
             "                pass\n"),
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
        "kernel-flushes-subnormals",
        "loading the CPU decode kernel leaves the process's floating point as it was",
        edit("kvcache/backends/cpu_decode.py", '_FLAGS = ("-O3", ', '_FLAGS = ("-O3", "-ffast-math", '),
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
        edit("kvcache/backends/cpu_decode.c", "if (rows[i] < 0 || rows[i] >= layer_rows) return -1;",
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
)
