"""Suite: shared prefixes and the KV tier: KV paid once, and pages brought back from disk.

Over gRPC on the default model, each run on fresh servers:

- **Shared prefix.** The tenants file declares a ~2,000-token text; TENANTS tenants opt in
  to it and as many do not (unshared). Each tenant sends one request, the declared text's
  tokens and a fresh 16-token suffix, unshared and opted-in tenants taking turns: each
  tenant's first request. Then the KV pages each side holds for those prompts (GetUsage for
  the tenants' own, the cache's stats for the operator's one copy), and a tenant that did not
  opt in (outsider) sends, in PAIRS alternating pairs after purging its own cache, the
  declared prefix with a fresh suffix and a novel prompt of the same length: its cached
  tokens and its TTFT ratio.
- **KV tier.** A pool of a quarter of one tenant's working set (WORKING prompts of a
  ~500-token random prefix and a 16-token suffix), the tier on (a temporary directory and a
  secret file). The owner runs its working set twice, novel then with fresh suffixes (every
  repeat's prefix pages come back from the tier); another tenant then sends the owner's
  prompts; one byte is flipped in every tier file and the owner repeats its first prompt.

TTFT is measured at the client. Figures are the median [min–max] of the runs (at least
RUNS); each run's ratio is of medians within that run, and targets use the worst run.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    FIRST_PLAIN_TOKEN,
    RUNS,
    Spread,
    Target,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    results_dir,
    set_torch_threads,
    spread,
    targets_table,
    worst_target,
    write_suite,
)

SUITE = "shared_prefix"
SUFFIX = 16
MARGIN = 1.25  # the verify suite's timing bound (tests/isolation/test_timing_channel.py)
WORDS = (
    "the", "customer", "account", "invoice", "order", "refund", "policy", "support", "team",
    "answer", "question", "please", "always", "never", "short", "polite", "product", "shipping",
    "delivery", "payment", "card", "address", "change", "request", "ticket", "priority",
    "escalate", "manager", "hours", "weekday", "weekend", "holiday", "store", "online",
    "return", "window", "days", "receipt", "warranty", "repair", "replace", "damaged",
    "missing", "item", "package", "tracking", "number", "email", "phone", "chat", "agent",
    "language", "tone", "summary",
)


def declared_text(tokenizer: Any, tokens: int) -> str:
    """Sentences of common words, ending in a newline, whose tokens (a text prompt's) number
    at least ``tokens``."""
    rng = np.random.default_rng(3)
    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences) + "\n", True)) < tokens:
        words = [str(w) for w in rng.choice(WORDS, size=12)]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences) + "\n"


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _page_bytes(loaded: Any) -> int:
    from kvcache.pool import page_bytes

    cfg = loaded.model.config
    return page_bytes(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, loaded.model.kv_dtype)


async def shared_run(
    loaded: Any, tenants: int, prefix_tokens: int, pairs: int, seed: int
) -> dict[str, Any]:
    """One run of the shared-prefix scenario on a fresh server."""
    from bench.kvfence_runner import Sizing, grpc_server, ttft_and_cached
    from clients.aio import AsyncClient

    text = declared_text(loaded.tokenizer, prefix_tokens)
    declared = list(loaded.tokenizer.encode(text, True))
    rng = np.random.default_rng(seed)
    vocab = loaded.model.config.vocab_size

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(FIRST_PLAIN_TOKEN, vocab, size=n)]

    opted = [f"opted-{i:02d}" for i in range(tenants)]
    unshared = [f"unshared-{i:02d}" for i in range(tenants)]
    names = [*opted, *unshared, "outsider"]
    # Every prompt stays cached: an unshared tenant's whole prompt, an opted-in tenant's own
    # pages after the prefix, the outsider's pair, the shared budget (twice the prefix's
    # pages), a tenth more. Each tenant's share holds one whole prompt and its output.
    pages_each = (len(declared) + SUFFIX) // 16 + 4
    pool = int(1.1 * ((tenants + 2) * pages_each + tenants * 4 + 2 * len(declared) // 16))
    sizing = Sizing(max_model_len=len(declared) + 256, kv_bytes=pool * _page_bytes(loaded))
    out: dict[str, Any] = {"prefix_tokens": len(declared)}
    async with grpc_server(
        loaded, names, sizing, shared_prefixes={"system": text}, readers=opted,
        max_kv_pages=pages_each,
    ) as (target, keys, engine):
        clients = {t: AsyncClient(target, api_key=keys[t], retries=0) for t in names}
        try:
            for t in ("outsider", opted[0], unshared[0]):  # first-call effects go here
                await ttft_and_cached(clients[t], ids(64))
            for t in (opted[0], unshared[0]):
                await clients[t].purge()
            first: dict[str, list[tuple[float, int]]] = {"opted": [], "unshared": []}
            for i in range(tenants):
                order = [("unshared", unshared[i]), ("opted", opted[i])]
                for kind, t in order if i % 2 == 0 else reversed(order):
                    first[kind].append(await ttft_and_cached(clients[t], declared + ids(SUFFIX)))
            own = {}
            for t in (*opted, *unshared):
                usage = await clients[t].usage()
                own[t] = usage.pages_cached + usage.pages_in_use
            cache = (await engine.stats()).cache
            outsider: dict[str, list[tuple[float, int]]] = {"prefix": [], "novel": []}
            for k in range(pairs):
                await clients["outsider"].purge()
                pair = [("prefix", declared + ids(SUFFIX)), ("novel", ids(len(declared) + SUFFIX))]
                for kind, prompt in pair if k % 2 == 0 else reversed(pair):
                    outsider[kind].append(await ttft_and_cached(clients["outsider"], prompt))
            usage = await clients["outsider"].usage()
        finally:
            for c in clients.values():
                await c.close()
    shared_pages = cache.shared_prefixes.get("system", 0)
    opted_own = sum(own[t] for t in opted)
    unshared_own = sum(own[t] for t in unshared)
    out.update(
        shared_tokens=shared_pages * 16,
        first_ttft_opted=[t for t, _ in first["opted"]],
        first_ttft_unshared=[t for t, _ in first["unshared"]],
        first_cached_opted=[c for _, c in first["opted"]],
        first_cached_unshared=[c for _, c in first["unshared"]],
        prefix_pages=shared_pages,
        operator_pages=cache.shared_pages,
        opted_own_pages=opted_own,
        unshared_pages=unshared_own,
        outsider_ttft_prefix=[t for t, _ in outsider["prefix"]],
        outsider_ttft_novel=[t for t, _ in outsider["novel"]],
        outsider_cached=[c for _, c in outsider["prefix"] + outsider["novel"]],
        outsider_shared_hit_tokens=usage.shared_prefix_hit_tokens,
    )
    return out


def _flip_one_byte_each(directory: Path) -> int:
    count = 0
    for path in sorted(directory.iterdir()):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        count += 1
    return count


async def tier_run(loaded: Any, working: int, prefix_tokens: int, seed: int) -> dict[str, Any]:
    """One run of the KV-tier scenario on a fresh server whose pool holds a quarter of the
    owner's working set."""
    from bench.kvfence_runner import Sizing, grpc_server, ttft_and_cached
    from clients.aio import AsyncClient

    cfg = loaded.model.config
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(FIRST_PLAIN_TOKEN, cfg.vocab_size, size=n)]

    prefixes = [ids(prefix_tokens) for _ in range(working)]
    working_pages = working * (prefix_tokens + SUFFIX) // 16
    pool = working_pages // 4
    one = _page_bytes(loaded)
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-tier-") as scratch:
        tier, secret = Path(scratch) / "tier", Path(scratch) / "secret"
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)
        sizing = Sizing(
            kv_bytes=pool * one, max_model_len=prefix_tokens + 256, max_num_seqs=8,
            kv_tier_dir=str(tier), kv_tier_bytes="2GiB", kv_tier_secret_file=str(secret),
        )
        async with grpc_server(loaded, ("owner", "other"), sizing, max_kv_pages=pool) as (
            target, keys, engine
        ):
            owner, other = (AsyncClient(target, api_key=keys[t], retries=0)
                            for t in ("owner", "other"))
            try:
                await ttft_and_cached(other, ids(64))  # first-call effects go here
                await other.purge()
                novel = [await ttft_and_cached(owner, p + ids(SUFFIX)) for p in prefixes]
                repeat = [await ttft_and_cached(owner, p + ids(SUFFIX)) for p in prefixes]
                owner_usage = await owner.usage()
                others = [await ttft_and_cached(other, p + ids(SUFFIX)) for p in prefixes]
                other_usage = await other.usage()
                before = (await engine.stats()).cache.tier_rejected
                flipped = _flip_one_byte_each(tier)
                hits = (await owner.usage()).tier_hit_tokens
                _, tampered_cached = await ttft_and_cached(owner, prefixes[0] + ids(SUFFIX))
                tampered_tier = (await owner.usage()).tier_hit_tokens - hits
                rejected = (await engine.stats()).cache.tier_rejected - before
            finally:
                await owner.close()
                await other.close()
    return {
        "pool_pages": pool,
        "working_set_pages": working_pages,
        "prefix_tokens": prefix_tokens,
        "ttft_novel": [t for t, _ in novel],
        "ttft_repeat": [t for t, _ in repeat],
        "novel_cached": [c for _, c in novel],
        "repeat_cached": [c for _, c in repeat],
        "owner_tier_hit_tokens": owner_usage.tier_hit_tokens,
        "other_cached": [c for _, c in others],
        "other_hit_tokens": other_usage.prefix_hit_tokens + other_usage.tier_hit_tokens,
        "files_flipped": flipped,
        "tampered_cached": tampered_cached,
        "tampered_tier_tokens": tampered_tier,
        "tier_rejected": rejected,
    }


def figures(runs: list[dict[str, Any]], tier: list[dict[str, Any]]) -> dict[str, Spread]:
    """Per-run figures (ratios of medians within a run) as spreads over the runs."""
    def per_run(f: Any, rs: list[dict[str, Any]]) -> Spread:
        return spread(f(r) for r in rs)

    return {
        "first_ttft_opted_ms": per_run(lambda r: 1000 * _median(r["first_ttft_opted"]), runs),
        "first_ttft_unshared_ms": per_run(lambda r: 1000 * _median(r["first_ttft_unshared"]), runs),
        "first_ttft_ratio": per_run(
            lambda r: _median(r["first_ttft_opted"]) / _median(r["first_ttft_unshared"]), runs),
        "first_cached_opted_min": per_run(lambda r: min(r["first_cached_opted"]), runs),
        "pages_shared_side": per_run(lambda r: r["operator_pages"] + r["opted_own_pages"], runs),
        "pages_unshared_side": per_run(lambda r: r["unshared_pages"], runs),
        "prefix_pages": per_run(lambda r: r["prefix_pages"], runs),
        "prefix_copies_unshared": per_run(
            lambda r: (r["unshared_pages"] - r["opted_own_pages"]) / r["prefix_pages"], runs),
        "prefix_copies_shared": per_run(lambda r: r["operator_pages"] / r["prefix_pages"], runs),
        "outsider_ttft_ratio": per_run(
            lambda r: _median(r["outsider_ttft_prefix"]) / _median(r["outsider_ttft_novel"]), runs),
        "outsider_cached_max": per_run(
            lambda r: max(r["outsider_cached"]) + r["outsider_shared_hit_tokens"], runs),
        "tier_ttft_novel_ms": per_run(lambda r: 1000 * _median(r["ttft_novel"]), tier),
        "tier_ttft_repeat_ms": per_run(lambda r: 1000 * _median(r["ttft_repeat"]), tier),
        "tier_ttft_ratio": per_run(
            lambda r: _median(r["ttft_repeat"]) / _median(r["ttft_novel"]), tier),
        "tier_repeat_cached_fraction_min": per_run(
            lambda r: min(r["repeat_cached"]) / r["prefix_tokens"], tier),
        "tier_other_hits_max": per_run(
            lambda r: max(r["other_cached"]) + r["other_hit_tokens"], tier),
        "tier_tampered_tier_tokens": per_run(lambda r: r["tampered_tier_tokens"], tier),
        "tier_rejected": per_run(lambda r: r["tier_rejected"], tier),
    }


def judge(f: dict[str, Spread]) -> list[Target]:
    return [
        worst_target("first-request TTFT, opted in / unshared tenant", f["first_ttft_ratio"],
                     0.3, higher_is_better=False),
        worst_target("copies of the prefix's KV pages held for the opted-in tenants",
                     f["prefix_copies_shared"], 1.0, higher_is_better=False),
        worst_target("cached tokens of a tenant not opted in", f["outsider_cached_max"], 0.0,
                     higher_is_better=False),
        worst_target("not opted in: TTFT declared prefix / novel, at least",
                     f["outsider_ttft_ratio"], 1 / MARGIN),
        worst_target("not opted in: TTFT declared prefix / novel, at most",
                     f["outsider_ttft_ratio"], MARGIN, higher_is_better=False),
        worst_target("tier: repeat cached tokens / prefix (least of a run)",
                     f["tier_repeat_cached_fraction_min"], 0.9),
        worst_target("tier: TTFT repeat / novel", f["tier_ttft_ratio"], 0.5,
                     higher_is_better=False),
        worst_target("tier: another tenant's cached tokens on the owner's prompts",
                     f["tier_other_hits_max"], 0.0, higher_is_better=False),
        worst_target("tier: tokens restored after one byte of each file was flipped",
                     f["tier_tampered_tier_tokens"], 0.0, higher_is_better=False),
        worst_target("tier: records refused after the flip", f["tier_rejected"], 1.0),
    ]


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import load_kvfence

    threads = bench_threads()
    out = results_dir(quick)
    set_torch_threads(threads)
    load_before = os.getloadavg()
    loaded = load_kvfence(default_model_file())
    if quick:
        tenants, prefix_tokens, pairs, working, tier_prefix, runs = 4, 512, 2, 8, 240, 1
    else:
        tenants, prefix_tokens, pairs, working, tier_prefix, runs = 16, 2000, 4, 8, 496, RUNS
    shared_runs, tier_runs = [], []
    wall, cpu = time.perf_counter(), _cpu_seconds()
    for i in range(runs):  # the two scenarios take turns, each on fresh servers
        shared_runs.append(asyncio.run(shared_run(loaded, tenants, prefix_tokens, pairs, i)))
        _release()
        tier_runs.append(asyncio.run(tier_run(loaded, working, tier_prefix, 100 + i)))
        _release()
    # How much of its cores this process got while it measured: well below 1 means another
    # process ran on them too.
    cpu_share = (_cpu_seconds() - cpu) / (time.perf_counter() - wall) / threads
    f = figures(shared_runs, tier_runs)
    targets = judge(f)
    load_after = os.getloadavg()
    declared = shared_runs[0]["prefix_tokens"]
    md = "\n\n".join([
        f"# Shared prefixes and the KV tier{' (quick)' if quick else ''}",
        f"{tenants} tenants opted in to a declared {declared}-token prefix and {tenants} not; "
        f"each tenant's first request is the prefix and a {SUFFIX}-token suffix, max_tokens 2. "
        f"KV tier: a pool of {tier_runs[0]['pool_pages']} pages, a quarter of the owner's "
        f"working set ({working} prompts of a {tier_prefix}-token prefix and a {SUFFIX}-token "
        f"suffix, {tier_runs[0]['working_set_pages']} pages), run twice. {runs} runs, "
        f"{threads} threads; median [min–max] of the runs, ratios of medians within a run. "
        f"Load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after (this "
        f"suite's own threads included); the suite's process used {cpu_share:.0%} of its "
        f"{threads} cores while it ran.",
        shared_table(f), tier_table(f), targets_table(targets),
    ])
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "process_cpu_share": cpu_share,
        "tenants": tenants,
        "prefix_tokens": declared,
        "outsider_pairs": pairs,
        "working_set": working,
        "tier_prefix_tokens": tier_prefix,
        "runs": {"shared": shared_runs, "tier": tier_runs},
        "figures": f,
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data


def _release() -> None:
    """Free the last server's KV pool before the next starts: ``grpc_server`` freezes the
    collector's objects (as ``kvfence serve`` does), which would keep each pool's cycles."""
    gc.unfreeze()
    gc.collect()


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _rows(f: dict[str, Any], names: dict[str, str]) -> list[tuple[str, str]]:
    from bench.common import fmt_spread

    return [(label, fmt_spread(f[k] if isinstance(f[k], dict) else f[k].as_dict()))
            for k, label in names.items()]


SHARED_ROWS = {
    "first_ttft_opted_ms": "first-request TTFT, opted in (ms)",
    "first_ttft_unshared_ms": "first-request TTFT, unshared (ms)",
    "first_ttft_ratio": "opted in / unshared",
    "first_cached_opted_min": "cached tokens of an opted-in first request (least)",
    "prefix_pages": "KV pages of the declared prefix (one copy)",
    "pages_shared_side": "KV pages held for the opted-in tenants' prompts (operator + own)",
    "pages_unshared_side": "KV pages held for the unshared tenants' prompts",
    "prefix_copies_shared": "copies of the prefix's pages, opted in",
    "prefix_copies_unshared": "copies of the prefix's pages, unshared",
    "outsider_cached_max": "cached tokens of a tenant not opted in (most)",
    "outsider_ttft_ratio": "not opted in: TTFT declared prefix / novel",
}
TIER_ROWS = {
    "tier_ttft_novel_ms": "TTFT, novel (ms)",
    "tier_ttft_repeat_ms": "TTFT, repeat from the tier (ms)",
    "tier_ttft_ratio": "repeat / novel",
    "tier_repeat_cached_fraction_min": "repeat cached tokens / prefix (least)",
    "tier_other_hits_max": "another tenant's cached tokens on them (most)",
    "tier_tampered_tier_tokens": "tokens restored after a byte flip in each file",
    "tier_rejected": "records refused after the flip",
}


def shared_table(f: dict[str, Any]) -> str:
    return md_table(("shared prefix", "median [min–max]"), _rows(f, SHARED_ROWS))


def tier_table(f: dict[str, Any]) -> str:
    return md_table(("KV tier", "median [min–max]"), _rows(f, TIER_ROWS))
