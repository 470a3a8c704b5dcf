"""Progress lines, stamped with the seconds since the harness started."""

import sys
import time

_START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", file=sys.stdout, flush=True)
