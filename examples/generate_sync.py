"""Stream a completion with the blocking client.

KVFENCE_TARGET=127.0.0.1:50051 KVFENCE_API_KEY=sk-... python examples/generate_sync.py "Hi"
"""

from __future__ import annotations

import argparse
import os
import sys

from clients import Chunk, Client, Finished, KvfenceError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Write a haiku about caches.")
    parser.add_argument("--target", default=os.environ.get("KVFENCE_TARGET", "127.0.0.1:50051"))
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    # The API key comes from $KVFENCE_API_KEY (or pass api_key=...).
    with Client(args.target, timeout=60.0) as client:
        try:
            for event in client.generate(args.prompt, max_tokens=args.max_tokens, temperature=0.0):
                if isinstance(event, Chunk):
                    print(event.text, end="", flush=True)
                elif isinstance(event, Finished):
                    print(f"\n[{event.reason}, {event.usage.completion_tokens} tokens]")
        except KvfenceError as e:  # e.code, e.message, e.details (RetryInfo, BadRequest, ...)
            sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
