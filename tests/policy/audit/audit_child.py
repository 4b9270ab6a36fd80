"""A gateway stand-in for the kill -9 test: appends events from several threads and prints each id once durable.

Usage: audit_child.py SPOOL_DIR COUNT (http URL | syslog-tcp PORT)

Its sink's receiver is down while it runs, so nothing is delivered before the
parent kills it; the parent then restarts the spool and the receiver.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from audit_support import make_event, sink_from_args

from inferflux.policy.audit.delivery import Backoff, Delivery
from inferflux.policy.audit.spool import Spool, SpoolSettings

THREADS = 8  # concurrent "requests", so batches hold several events, as in a busy gateway


def main() -> None:
    directory, count, sink_args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    spool = Spool.open(SpoolSettings(directory, chain_id="gw-kill", segment_bytes=64 * 1024))
    Delivery(spool, sink_from_args(sink_args), backoff=Backoff(initial=0.01, maximum=0.2)).start()
    out = threading.Lock()

    def requests(worker: int) -> None:
        for i in range(worker, count, THREADS):
            event = make_event(request_id=f"req-{i}")
            spool.append(event).wait()
            with out:  # an id is printed only once its event is durable: the acknowledgement
                sys.stdout.write(event.id + "\n")
                sys.stdout.flush()

    workers = [threading.Thread(target=requests, args=(w,)) for w in range(THREADS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    time.sleep(600)  # the parent kills it long before


if __name__ == "__main__":
    main()
