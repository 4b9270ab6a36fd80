"""One load generator of test_ratelimit_redis's two-process test (run as a script, not collected).

From ``--start`` (epoch seconds) for ``--duration`` seconds it sends
``--rate`` checks per second at one tenant-wide limit shared through Redis,
then prints ``{"sent": n, "accepted": n, "failures": n}`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from inferflux.policy.ratelimit import Admission, EffectiveLimits, FixedLimits, Limits, RateLimiter
from inferflux.policy.ratelimit.redis_backend import RedisBackend
from inferflux.policy.rbac import Principal


async def hammer(args: argparse.Namespace) -> dict[str, int]:
    backend = RedisBackend.from_url(args.url, prefix=args.prefix, timeout=2.0)
    limits = EffectiveLimits(tenant=Limits(requests_per_minute=args.limit))
    limiter = RateLimiter(backend, FixedLimits(limits), window_seconds=args.window)
    me = Principal("ten_shared", "shared", f"key:{args.name}", "api_key", frozenset({"member"}), key_id=args.name)
    sent = accepted = 0
    next_at = args.start
    end = args.start + args.duration
    try:
        while (now := time.time()) < end:
            if now < next_at:
                await asyncio.sleep(min(next_at, end) - now)
                continue
            result = await limiter.check_and_reserve(me, prompt_tokens=1, max_tokens=0)
            sent += 1
            accepted += isinstance(result, Admission)
            next_at += 1 / args.rate
    finally:
        await limiter.close()
    return {"sent": sent, "accepted": accepted, "failures": limiter.backend_failures}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--limit", type=int, required=True)
    parser.add_argument("--window", type=float, required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--start", type=float, required=True)
    parser.add_argument("--duration", type=float, required=True)
    print(json.dumps(asyncio.run(hammer(parser.parse_args()))))


if __name__ == "__main__":
    main()
