"""A writer of every file the gateway rewrites, for the kill -9 test: it loops until killed.

Usage: fileio_writer.py DIRECTORY

Each round replaces the key file with one more key version, appends audit
events and saves two sink cursors in the spool, and persists the in-process
limiter's quota usage, so a SIGKILL lands at any point of any of those writes.
It prints "ready" once every file exists.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from audit_support import make_event

from inferflux.policy.audit.spool import Cursor, Spool, SpoolSettings
from inferflux.policy.ratelimit import EffectiveLimits, FixedLimits, Limits, MemoryBackend, RateLimiter
from inferflux.policy.rbac import Principal
from inferflux.policy.store.crypto import KeyFile, create_key_file, new_key, replace_key_file

KEY_FILE = "store.key"
SPOOL = "spool"
QUOTA_DIR = "ratelimit"
SINKS = ("siem", "store")


async def main(directory: Path) -> None:
    key_file = directory / KEY_FILE
    content = KeyFile(active=1, keys={1: new_key()})
    create_key_file(key_file, content)
    spool = Spool.open(SpoolSettings(directory / SPOOL, chain_id="gw-kill", segment_bytes=16 * 1024))
    backend = MemoryBackend(directory / QUOTA_DIR, persist_interval=3600)
    limiter = RateLimiter(backend, FixedLimits(EffectiveLimits(tenant=Limits(tokens_per_month=10**12))))
    who = Principal(
        tenant_id="ten_kill", tenant_name="kill", subject="key:kill", kind="api_key", roles=frozenset({"member"}),
        key_id="key_kill",
    )
    announced = False
    version = 1
    while True:
        version += 1
        # Key files stay small: the newest few versions, as a rotation with --prune leaves them.
        content = content.with_key(version, new_key()).only(range(version - 3, version + 1))
        replace_key_file(key_file, content)
        for _ in range(5):
            spool.append(make_event())
        with spool._state:
            written = spool._written  # somewhere real for the cursors to point at
        for sink in SINKS:
            spool.save_cursor(sink, Cursor(written.segment, written.offset))
        admission = await limiter.check_and_reserve(who, prompt_tokens=10, max_tokens=0)
        await limiter.settle(admission.handle, prompt_tokens=10, completion_tokens=version)  # type: ignore[union-attr]
        backend.persist()
        if not announced:
            print("ready", flush=True)
            announced = True


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
