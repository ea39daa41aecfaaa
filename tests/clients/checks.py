"""What the client check scripts share: run named checks, report each one, and end with the
'N passed, M failed' line the Rust tests look for (exit status 1 on any failure)."""

import sys
import traceback

_results = []


def check(name, fn):
    """Runs fn(); a raised exception is a failure, reported with its traceback, and the next
    check still runs."""
    try:
        fn()
        _results.append(True)
        print(f"ok   {name}")
    except Exception:  # noqa: BLE001 - report every failure and keep going
        _results.append(False)
        print(f"FAIL {name}")
        traceback.print_exc()


def finish():
    """Prints the closing line and exits: 0 when every check passed (and at least one ran)."""
    failed = _results.count(False)
    print(f"{_results.count(True)} passed, {failed} failed")
    sys.exit(1 if failed or not _results else 0)
