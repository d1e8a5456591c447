"""Run several prompts at once with the asyncio client.

KVFENCE_TARGET=127.0.0.1:50051 KVFENCE_API_KEY=sk-... python examples/generate_async.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from clients import AsyncClient, KvfenceError


async def main(target: str, prompts: list[str], max_tokens: int) -> None:
    # The API key comes from $KVFENCE_API_KEY (or pass api_key=...).
    async with AsyncClient(target, timeout=60.0) as client:
        results = await asyncio.gather(
            *(client.generate_text(p, max_tokens=max_tokens, temperature=0.0) for p in prompts)
        )
        for prompt, result in zip(prompts, results, strict=True):
            print(
                f"{prompt!r} -> {result.text!r} ({result.finish_reason}, "
                f"{result.usage.completion_tokens} tokens)"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompts", nargs="*", default=["The capital of France is", "1, 2, 3,"])
    parser.add_argument("--target", default=os.environ.get("KVFENCE_TARGET", "127.0.0.1:50051"))
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    try:
        asyncio.run(main(args.target, args.prompts, args.max_tokens))
    except KvfenceError as e:
        sys.exit(f"error: {e}")
