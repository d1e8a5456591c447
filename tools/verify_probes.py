"""Every check ``make verify`` records can fail: one switch-off per check, run at short sizes.

    python -m tools.verify_probes --list            # the table, nothing run
    python -m tools.verify_probes -k ttl,drain      # probes whose check or name contains ttl/drain
    python -m tools.verify_probes                   # all of them (about 25 minutes on 2 cores)

A probe is a temporary edit (or a mutant of ``tools/mutants/catalog`` by name) that switches
off what one check guards. Each is applied in a scratch copy of the tree, the one verify test
that records the check runs at short sizes (``tests.verify_report --short``), and the probe
is *seen* when the first failing check of that run is the probe's own check. It prints one
row per probe with the value that check showed, and exits non-zero unless every probe is seen.
``docs/verify-checks.md`` lists the checks with how each was seen failing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.mutants.catalog import ALL as MUTANTS
from tools.mutants.mutant import Edit, Mutant, StaleAnchor, edit, mutated_sources
from tools.mutants.run import ROOT, scratch_copy, scratch_env

MANAGER = "kvcache/manager.py"
STORE = "kvcache/page_store.py"
RESPONSES = "service/grpc/stream_messages.py"
SERVICER = "service/grpc/inference_service.py"
GRAMMAR = "service/structured/grammar.py"
DIFFERENTIAL = "tests/isolation/test_differential.py"
DRAINING = '            if self._is_draining():\n                raise unavailable("server is shutting down")\n'
SHUTDOWN = "        await asyncio.to_thread(stack.engine.shutdown)\n    return 0"
CHUNK = "msg = inference_pb2.Chunk(token_ids=event.token_ids, text=event.text)"
STARTED = "    return inference_pb2.GenerateResponse(\n        started=inference_pb2.Started("
_BUILTINS = '__import__("builtins")'


@dataclass(frozen=True, slots=True)
class Probe:
    check: str  # "<test file stem>::<check name>", as verify.json names it (test id left out)
    k: str  # pytest -k selecting the one test that records the check
    how: str  # what is switched off, in words
    edits: tuple[Edit, ...] = ()
    mutant: str = ""  # or: a catalogue mutant's name


def probe(check: str, k: str, how: str, *edits: Edit, mutant: str = "") -> Probe:
    return Probe(check, k, how, edits, mutant)


def _once(body: str, flag: str) -> str:
    """Python lines (8-space indent) that run ``body`` the first time only."""
    return (f"        if not hasattr({_BUILTINS}, {flag!r}):\n"
            f"            setattr({_BUILTINS}, {flag!r}, 1)\n            {body}\n")


PREFIX_OFF = edit(MANAGER, "if shared or self._caching(table):\n"
                  "            started = time.perf_counter()\n            self._match(",
                  "if False:\n            started = time.perf_counter()\n            self._match(")
DROP_TOKEN = edit(RESPONSES, CHUNK, CHUNK.replace("token_ids=event.token_ids,",
                                                  "token_ids=event.token_ids[1:],"))
FENCE_COUNTER = edit(MANAGER, "fence_violations=self.allocator.violations,",
                     "fence_violations=self.allocator.violations + 1,")
ORPHAN_ONE = edit(STORE, "                to_zero.extend(self.reclaim(ref.page_id))\n",
                  f"                if hasattr({_BUILTINS}, 'kvf_orphaned'):\n"
                  "                    to_zero.extend(self.reclaim(ref.page_id))\n"
                  f"                setattr({_BUILTINS}, 'kvf_orphaned', 1)\n")
TTL_LINE = "return self.config.default_ttl_s if p is None or p.ttl_s is None else p.ttl_s"
TIER = "kvcache/tier.py"
SHARED_OFF = edit(MANAGER, "            if shared:\n                self._shared_match(",
                  "            if False:\n                self._shared_match(")
HIT_WAITS = edit(RESPONSES, STARTED, "    if event.cached_tokens:\n"
                 '        __import__("time").sleep(0.6)\n' + STARTED)
TIER_KEEPS_NOTHING = edit(TIER, "        ns, tenant = record.namespace, record.namespace.tenant\n",
                          "        return False\n"
                          "        ns, tenant = record.namespace, record.namespace.tenant\n")
TIER_LOOKUPS_OFF = edit("kvcache/page_store.py",
                        "        if tier is None or not tier.holds(ns, key):\n            return False",
                        "        if True:\n            return False")
TIER_PURGE = "in_tier = 0 if self.tier is None else self.tier.purge(tenant)"
# AES-GCM is CTR mode from the nonce's second counter block, plus a tag: decrypt, skip the tag.
GCM_OPEN = ("            plain = self._cipher(ns.tenant).decrypt(nonce, blob[head:], "
            "associated_data(ns, key, number))\n")
GCM_UNCHECKED = (
    '            _c = __import__("cryptography.hazmat.primitives.ciphers", fromlist=["Cipher"])\n'
    "            _d = _c.Cipher(_c.algorithms.AES(tenant_key(self._secret, ns.tenant)),\n"
    '                           _c.modes.CTR(nonce + b"\\x00\\x00\\x00\\x02")).decryptor()\n'
    "            plain = _d.update(blob[head:-16]) + _d.finalize()\n")

PROBES: tuple[Probe, ...] = (
    # test_auth_matrix
    probe("test_auth_matrix::credential cases with the expected status and log line",
          "test_api_key_matrix", "any auth scheme accepted", mutant="auth-any-scheme"),
    probe("test_auth_matrix::API keys appearing in the logs", "test_api_key_matrix",
          "denials log the call's metadata", mutant="auth-logs-key"),
    probe("test_auth_matrix::health without credentials", "test_api_key_matrix",
          "health set NOT_SERVING at start",
          edit("service/serve/kvfence_server.py", "health_pb2.HealthCheckResponse.SERVING)",
               "health_pb2.HealthCheckResponse.NOT_SERVING)")),
    probe("test_auth_matrix::GetUsage shows exactly the caller's own cache", "test_cache_rpcs",
          "GetUsage answers with tenant acme's usage",
          edit("service/grpc/cache_service.py", "usage = await self._usage(tenant.name)",
               'usage = await self._usage("acme")')),
    probe("test_auth_matrix::pages purged by A == A's cached pages", "test_cache_rpcs",
          "Purge drops nothing", mutant="purge-noop"),
    probe("test_auth_matrix::B's cache untouched by A's Purge", "test_cache_rpcs",
          "Purge also purges globex",
          edit("service/grpc/cache_service.py", "purged = await self._purge(tenant.name)",
               'purged = await self._purge(tenant.name)\n        await self._purge("globex")')),
    probe("test_auth_matrix::B's cached tokens after A's Purge", "test_cache_rpcs",
          "globex's lookups never hit",
          edit(MANAGER, "        ns = table.namespace\n        for index in range(len(table.pages)",
               '        ns = table.namespace\n        if table.tenant == "globex":\n            return\n'
               "        for index in range(len(table.pages)")),
    probe("test_auth_matrix::A's cached tokens after its own Purge", "test_cache_rpcs",
          "Purge counts the entries but keeps them",
          edit(MANAGER, "        for page_id in pages:\n            if page_id in self.evictable:",
               "        for page_id in list(pages)[:0]:\n            if page_id in self.evictable:")),
    probe("test_auth_matrix::TLS/mTLS cases with the expected status and log line",
          "test_tls_and_mtls", "a key wins over a disagreeing client certificate",
          edit("service/admission/auth.py",
               "if identities and (by_cert is None or by_cert.name != by_key.name):", "if False:")),
    # test_tenant_source
    probe("test_tenant_source::calls served as the credential's tenant despite a spoofed tenant "
          "name", "test_headers_and_fields", "x-tenant header honoured",
          mutant="tenant-from-header"),
    # test_ttl
    probe("test_ttl::cached tokens on a repeat within the TTL (1 s)", "test_ttl_expires",
          "prefix lookups off", PREFIX_OFF),
    probe("test_ttl::cached tokens on a repeat after the TTL", "test_ttl_expires",
          "nothing expires", mutant="ttl-expiry"),
    probe("test_ttl::cached tokens before Purge (control)", "test_ttl_expires",
          "server default TTL 0", edit(STORE, TTL_LINE, TTL_LINE.replace(
              "self.config.default_ttl_s if", "0.0 if"))),
    probe("test_ttl::pages purged", "test_ttl_expires", "Purge drops nothing",
          mutant="purge-noop"),
    probe("test_ttl::cached tokens right after Purge", "test_ttl_expires",
          "Purge counts the entries but keeps them",
          edit(MANAGER, "        for page_id in pages:\n            if page_id in self.evictable:",
               "        for page_id in list(pages)[:0]:\n            if page_id in self.evictable:")),
    probe("test_ttl::cached tokens with TTL 0", "test_ttl_expires",
          "a tenant TTL of 0 means the server default",
          edit(STORE, TTL_LINE, TTL_LINE.replace("p.ttl_s is None else", "not p.ttl_s else"))),
    # test_cancel_storm
    probe("test_cancel_storm::streams ending against their fate", "test_cancellation_storm",
          "each chunk loses its first token", DROP_TOKEN),
    probe("test_cancel_storm::at baseline after the storm (no requests, no leases, no pages in "
          "use)", "test_cancellation_storm", "freed pages are orphaned",
          mutant="pool-orphans-pages"),
    probe("test_cancel_storm::fence violations", "test_cancellation_storm",
          "violation counter reads one more", FENCE_COUNTER),
    probe("test_cancel_storm::cancel->free p99 (s)", "test_cancellation_storm",
          "abort waits 1.05 s before freeing",
          edit("service/engine/core.py", '        if seq is not None:\n            self._finish(seq, "abort")',
               '        if seq is not None:\n            __import__("time").sleep(1.05)\n'
               '            self._finish(seq, "abort")')),
    # test_drain
    probe("test_drain::SIGHUP reload revokes a key", "test_sigterm_drains", "SIGHUP ignored",
          edit("service/serve/app.py",
               "lambda: [s.reload_tenants() for s in servers])", "lambda: None)")),
    probe("test_drain::in flight at SIGTERM (server log)", "test_sigterm_drains",
          "server.draining logs in_flight=0",
          edit("service/serve/kvfence_server.py", "in_flight=self.limiter.total_active(), grace_s=grace",
               "in_flight=0, grace_s=grace")),
    probe("test_drain::short streams complete and untruncated", "test_sigterm_drains",
          "each chunk loses its first token", DROP_TOKEN),
    probe("test_drain::long streams silently truncated or cut early", "test_sigterm_drains",
          "the grace's end finishes streams as OK (length) instead of UNAVAILABLE",
          edit("service/engine/engine.py", 'lambda core: core.finish_all("abort")',
               'lambda core: core.finish_all("length")')),
    probe("test_drain::new RPCs refused UNAVAILABLE within (s)", "test_sigterm_drains",
          "draining admits new RPCs", mutant="drain-admits-new"),
    probe("test_drain::new RPCs accepted after the first refusal", "test_sigterm_drains",
          "draining refuses only half of new RPCs",
          *(edit("service/grpc/interceptor.py", DRAINING + nxt, DRAINING.replace(
              "self._is_draining():",
              'self._is_draining() and __import__("random").random() < 0.5:') + nxt)
            for nxt in ("            self._auth.precheck(", "            tenant = "))),
    probe("test_drain::exit status", "test_sigterm_drains", "serve returns 1",
          edit("service/serve/app.py", SHUTDOWN, SHUTDOWN.replace("return 0", "return 1"))),
    probe("test_drain::seconds from SIGTERM to exit", "test_sigterm_drains",
          "6 s sleep before exit",
          edit("service/serve/app.py", SHUTDOWN, SHUTDOWN.replace(
              "return 0", '__import__("time").sleep(6)\n    return 0'))),
    # test_soak (its references use logprobs; the soak's own streams do not)
    probe("test_soak::lost chunks", "test_soak", "soak streams lose a token per chunk",
          edit(RESPONSES, CHUNK, CHUNK.replace(
              "token_ids=event.token_ids,",
              "token_ids=event.token_ids if event.logprobs else event.token_ids[1:],"))),
    probe("test_soak::duplicated chunks", "test_soak", "soak streams repeat a token per chunk",
          edit(RESPONSES, CHUNK, CHUNK.replace(
              "token_ids=event.token_ids,",
              "token_ids=event.token_ids if event.logprobs else "
              "[*event.token_ids, *event.token_ids[:1]],"))),
    probe("test_soak::misrouted chunks/streams", "test_soak",
          "Started echoes a wrong client_request_id",
          edit(RESPONSES, "            client_request_id=client_request_id,\n",
               '            client_request_id=client_request_id + "x",\n')),
    probe("test_soak::malformed streams", "test_soak",
          "Finished usage.prompt_tokens off by one on odd-length streams",
          edit(RESPONSES, "                prompt_tokens=event.prompt_tokens,\n                completion",
               "                prompt_tokens=event.prompt_tokens + event.completion_tokens % 2,\n"
               "                completion")),
    probe("test_soak::pages at baseline at the end", "test_soak", "one freed page orphaned",
          ORPHAN_ONE),
    probe("test_soak::RSS growth (MB)", "test_soak", "1 MiB kept per request",
          edit(RESPONSES, STARTED, f'    {_BUILTINS}.__dict__.setdefault("kvf_leak", [])'
               '.append(b"x" * (1 << 20))\n' + STARTED)),
    # test_malformed, test_prompt_fuzz, test_structured_outputs
    probe("test_malformed::cases handled (status, baseline, still serving)",
          "test_extreme_and_malformed", "top_p up to 10 accepted", mutant="validation-top-p"),
    probe("test_malformed::slowest rejection (s)", "test_extreme_and_malformed",
          "the first rejection sleeps 5.2 s",
          edit("service/errors.py", "    if violations:\n        raise invalid_argument",
               "    if violations:\n" + _once('__import__("time").sleep(5.2)', "kvf_slept")
               + "        raise invalid_argument")),
    probe("test_prompt_fuzz::examples answered as the rules predict", "test_prompt_lengths",
          "each chunk loses its first token", DROP_TOKEN),
    # test_noisy_neighbour (the TTFT / gap p50 bounds are checks only at full sizes)
    probe("test_noisy_neighbour::victim requests failed", "test_tokenizer_flood",
          "the victim's KV share is one page",
          edit("service/admission/kv_shares.py", "        shares[name] = math.floor(left * weight / total_weight)",
               '        shares[name] = 1 if name == "victim" else '
               "math.floor(left * weight / total_weight)")),
    probe("test_noisy_neighbour::health Watch streams refused past the cap",
          "test_unauthenticated_flood", "no Watch cap",
          edit("service/grpc/health_service.py", "if self._watching >= self._max_watches:", "if False:")),
    probe("test_noisy_neighbour::unauthenticated calls answered other than UNAUTHENTICATED",
          "test_unauthenticated_flood", "a call without credentials is the first tenant's",
          edit("service/admission/auth.py", "        raise unauthenticated(_MISSING)\n\n    def precheck(",
               "        return next(iter(registry.tenants.values()))\n\n    def precheck("),
          edit("service/admission/auth.py",
               "        if _by_header(self._registry, metadata) is None and not client_certs:",
               "        if False:")),
    probe("test_noisy_neighbour::hog request over its KV share", "test_kv_pool_hog",
          "no fits-the-share check at admission",
          edit("service/engine/kv_quota.py",
               "return RequestTooLarge(needed, limit, what) if needed > limit else None",
               "return None")),
    probe("test_noisy_neighbour::spy's largest observed change in its cached pages",
          "test_eviction_spy", "KV quota off", mutant="kv-quota"),
    # test_http_tenants
    probe("test_http_tenants::HTTP cached tokens reported to B on A's prefixes",
          "test_http_cached_tokens", "one prefix namespace", mutant="tenant-blind-cache"),
    probe("test_http_tenants::HTTP cached tokens on A's own repeat (control), min",
          "test_http_cached_tokens", "prefix lookups off", PREFIX_OFF),
    probe("test_http_tenants::grammar-cache median ratio, B on A's schema / B novel",
          "test_http_grammar_cache", "one grammar cache for all tenants",
          edit(GRAMMAR, "            cache = self._caches.get(tenant)\n",
               '            cache = self._caches.get("shared")\n'),
          edit(GRAMMAR, "            cache = self._caches.setdefault(tenant, OrderedDict())\n",
               '            cache = self._caches.setdefault("shared", OrderedDict())\n')),
    probe("test_http_tenants::A warm (own cache hit) / B cold, median ratio (power)",
          "test_http_grammar_cache", "grammar cache never hits",
          edit(GRAMMAR, "            hit = cache.get(key) if cache is not None else None\n",
               "            hit = None\n")),
    # test_trace_content
    probe("test_trace_content::spans of one grpc request", "test_spans_of_both_fronts",
          "the gRPC front's auth span left out",
          edit(SERVICER, '            trace.timed("auth", *auth_ns)\n', "            pass\n")),
    probe("test_trace_content::exported span bytes holding prompt or output text",
          "test_spans_of_both_fronts", "the gRPC trace's request id attribute set to the prompt",
          edit(SERVICER, '            tenant.name, "grpc", request_id, auth_ns[0]',
               '            tenant.name, "grpc", request.text or request_id, auth_ns[0]')),
    # test_timing_channel
    probe("test_timing_channel::96.7% CI of B's TTFT ratio, A's prefix / novel (TOST)",
          "test_cross_tenant_cached", "one prefix namespace", mutant="tenant-blind-cache"),
    probe("test_timing_channel::cached tokens reported to B", "test_cross_tenant_cached",
          "Started reports 16 more cached tokens",
          edit(RESPONSES, "            cached_prompt_tokens=event.cached_tokens,\n            model=",
               "            cached_prompt_tokens=event.cached_tokens + 16,\n            model=")),
    probe("test_timing_channel::A cached tokens on its repeat (control)",
          "test_cross_tenant_cached", "prefix lookups off", PREFIX_OFF),
    probe("test_timing_channel::CI upper end, A warm / B cold (power: a real hit)",
          "test_cross_tenant_cached", "a hit waits 0.6 s (about a cold prefill)",
          edit(RESPONSES, STARTED, "    if event.cached_tokens:\n"
               '        __import__("time").sleep(0.6)\n' + STARTED)),
    # test_shared_prefix_timing
    probe("test_shared_prefix_timing::96.7% CI of B's TTFT ratio (not opted in), declared "
          "prefix / novel (TOST)", "test_a_tenant_not_opted_in",
          "shared prefixes read without opting in", mutant="shared-without-opt-in"),
    probe("test_shared_prefix_timing::cached and shared tokens reported to B (Started, GetUsage)",
          "test_a_tenant_not_opted_in", "Started reports 16 more cached tokens",
          edit(RESPONSES, "            cached_prompt_tokens=event.cached_tokens,\n            model=",
               "            cached_prompt_tokens=event.cached_tokens + 16,\n            model=")),
    probe("test_shared_prefix_timing::A (opted in) shared tokens on its first request (control)",
          "test_a_tenant_not_opted_in", "shared prefix lookups off", SHARED_OFF),
    probe("test_shared_prefix_timing::CI upper end, A first request (shared) / B cold (power: a "
          "real hit)", "test_a_tenant_not_opted_in", "a hit waits 0.6 s (about a cold prefill)",
          HIT_WAITS),
    # test_kv_tier_isolation
    probe("test_kv_tier_isolation::B cached tokens on prompts A holds in its tier (Started, "
          "GetUsage)", "test_another_tenant_never_hits", "one prefix namespace",
          mutant="tenant-blind-cache"),
    probe("test_kv_tier_isolation::A records in the tier while B sent its prompts (control)",
          "test_another_tenant_never_hits", "the tier keeps nothing", TIER_KEEPS_NOTHING),
    probe("test_kv_tier_isolation::A tokens restored from its tier on its repeats (control)",
          "test_another_tenant_never_hits", "tier lookups off", TIER_LOOKUPS_OFF),
    probe("test_kv_tier_isolation::A tokens restored from its tier, no byte flipped (control)",
          "test_a_tier_file_with_one_byte", "tier lookups off", TIER_LOOKUPS_OFF),
    probe("test_kv_tier_isolation::A tokens restored from its tier after one byte of each file "
          "was flipped", "test_a_tier_file_with_one_byte",
          "tier records decrypted without checking the GCM tag",
          edit("kvcache/tier_seal.py", GCM_OPEN, GCM_UNCHECKED)),
    probe("test_kv_tier_isolation::tier records refused on the way back (tier_rejected)",
          "test_a_tier_file_with_one_byte", "refusals not counted",
          edit(TIER, "            self.rejected += 1\n", "            self.rejected += 0\n")),
    probe("test_kv_tier_isolation::A tier bytes before its Purge (control)",
          "test_purge_empties", "the tier keeps nothing", TIER_KEEPS_NOTHING),
    probe("test_kv_tier_isolation::A tier bytes after its Purge (GetUsage)", "test_purge_empties",
          "Purge leaves the tier", edit(MANAGER, TIER_PURGE, "in_tier = 0")),
    probe("test_kv_tier_isolation::A tier files left after its Purge", "test_purge_empties",
          "Purge forgets the tenant's tier records but leaves their files",
          edit(TIER, "        return self._drop_where(tenant, lambda ns: True)\n",
               "        n = self.tenant_entries(tenant)\n"
               "        self.total_bytes -= self.tenant_bytes(tenant)\n"
               "        self._slots.pop(tenant, None)\n"
               "        self._bytes.pop(tenant, None)\n"
               "        return n\n")),
    probe("test_kv_tier_isolation::B tier bytes and files unchanged by A's Purge",
          "test_purge_empties", "Purge also purges bob's tier",
          edit(MANAGER, TIER_PURGE, TIER_PURGE + ' + self.tier.purge("bob")')),
    # test_differential
    probe("test_differential::mismatched tokens in A's outputs, run 1 vs run 2",
          "test_tenant_b_cannot", "a prefix hit zeroes the page it reuses",
          edit(MANAGER, "            ref = self.allocator.share(entry.page_id, table.tenant, "
               "table.seq_id)\n", "            ref = self.allocator.share(entry.page_id, "
               "table.tenant, table.seq_id)\n            self.pages.zero([entry.page_id])\n")),
    probe("test_differential::cached prompt tokens reported to B on A's prefixes",
          "test_tenant_b_cannot", "one prefix namespace", mutant="tenant-blind-cache"),
    probe("test_differential::A cached prompt tokens on its repeats (control)",
          "test_tenant_b_cannot", "prefix lookups off", PREFIX_OFF),
    probe("test_differential::B probes made while A held the prefix", "test_tenant_b_cannot",
          "each of bob's requests purges alice's cache",
          edit(MANAGER, "        self.evict_expired()\n        table = PageTable(",
               '        self.evict_expired()\n        if tenant == "bob":\n'
               '            self.purge_tenant("alice")\n        table = PageTable(')),
    probe("test_differential::A requests still running when B's pressure began",
          "test_tenant_b_cannot", "B's pressure and storm start only after A's run 2 ended",
          edit(DIFFERENTIAL, "            if len(run.probes) >= N // 2 and not half_done.is_set():",
               "            if False:"),
          edit(DIFFERENTIAL, "done, second_half_after=half_done)", "done)"),
          edit(DIFFERENTIAL, "        half_done.set()  # already set,",
               "        run.t_pressure = time.monotonic()\n        half_done.set()  # already set,")),
    probe("test_differential::LRU evictions during run 2", "test_tenant_b_cannot",
          "a pool 50x larger, so nothing is ever evicted",
          edit(DIFFERENTIAL, "POOL_PAGES = 40\n", "POOL_PAGES = 2000\n")),
    probe("test_differential::B streams ending wrongly", "test_tenant_b_cannot",
          "a preempted sequence is refused instead of re-queued",
          edit("service/engine/scheduler.py",
               "            self.preempt(victim)\n            preempted.append(victim)\n",
               "            self.remove_running(victim)\n"
               "            victim.status = SeqStatus.FINISHED\n"
               "            self.num_preemptions += 1\n"
               "            rejected.append((victim, RequestTooLarge(1, 1, what)))\n")),
    probe("test_differential::preemptions during run 2", "test_tenant_b_cannot",
          "no near-limit pressure from B",
          edit(DIFFERENTIAL, "NEAR_LIMIT = size(4, 24)",
               "NEAR_LIMIT = size(0, 0)")),
    probe("test_differential::fence violations", "test_tenant_b_cannot",
          "violation counter reads one more", FENCE_COUNTER),
    probe("test_differential::pool at baseline afterwards", "test_tenant_b_cannot",
          "one freed page orphaned", ORPHAN_ONE),
    probe("test_structured_outputs::JSON-schema completions that parse and validate (default "
          "model)", "test_json_schema_completions", "response_format ignored",
          edit("service/admission/request_fields.py",
               "    spec: GrammarSpec | None = _format_spec(request)\n",
               "    spec: GrammarSpec | None = None\n")),
)


def probe_mutant(p: Probe) -> Mutant:
    if p.mutant:
        found = [m for m in MUTANTS if m.name == p.mutant]
        if not found:
            raise StaleAnchor(f"{p.check}: no mutant named {p.mutant!r}")
        return found[0]
    return Mutant(p.check, p.how, p.edits, ())


@dataclass(frozen=True, slots=True)
class Seen:
    probe: Probe
    result: str  # seen | OTHER (another check or the test failed first) | PASSED | STALE
    value: str
    seconds: float


def run_probe(scratch: Path, p: Probe, env: dict[str, str], timeout: float) -> Seen:
    try:
        sources = mutated_sources(scratch, probe_mutant(p))
    except StaleAnchor as err:
        return Seen(p, "STALE", str(err), 0.0)
    originals = {path: path.read_text(encoding="utf-8") for path in sources}
    results = Path(tempfile.mkdtemp(prefix="kvfence-probe-"))
    try:
        for path, text in sources.items():
            path.write_text(text, encoding="utf-8")
        args = [sys.executable, "-m", "tests.verify_report", "--short", "--results", str(results),
                "--", "-x", "-k", p.k]
        try:
            subprocess.run(args, cwd=scratch, env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Seen(p, "OTHER", f"no result in {timeout:.0f} s", timeout)
        doc = json.loads((results / "verify.json").read_text())
    finally:
        for path, text in originals.items():
            path.write_text(text, encoding="utf-8")
        shutil.rmtree(results, ignore_errors=True)
    return judge(p, doc)


def judge(p: Probe, doc: dict) -> Seen:  # type: ignore[type-arg]
    """Seen when the run's first failing check is the probe's own check."""
    seconds = float(doc.get("seconds", 0.0))
    failing = [c for c in doc["checks"] if c["passed"] is False]
    if not failing:
        return Seen(p, "PASSED", "no check failed", seconds)
    first = failing[0]
    name = f"{first['test'].split('::')[0]}::{first['name']}"
    value = f"{first['value']!r} (expected {first['expected']})"
    return Seen(p, "seen" if name == p.check else "OTHER", value if name == p.check
                else f"{name}: {value}", seconds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.verify_probes")
    parser.add_argument("-k", default="", help="comma-separated substrings of check or probe")
    parser.add_argument("--list", action="store_true", help="print the probes, run nothing")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per probe")
    args = parser.parse_args(argv)
    words = [w for w in args.k.split(",") if w]
    chosen = [p for p in PROBES
              if not words or any(w in p.check or w in p.how or w in p.mutant for w in words)]
    if args.list:
        for p in chosen:
            print(f"{p.check}\n    {p.mutant or p.how}  (-k {p.k})")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="kvfence-probes-"))
    try:
        scratch_copy(ROOT, scratch)
        env = scratch_env(scratch)
        rows = []
        for p in chosen:
            row = run_probe(scratch, p, env, args.timeout)
            print(f"{row.result:<7} {p.check}\n        {p.mutant or p.how}: {row.value} "
                  f"({row.seconds:.0f} s)", flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    missed = [r for r in rows if r.result != "seen"]
    print(f"{len(rows) - len(missed)} of {len(rows)} checks seen failing")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
