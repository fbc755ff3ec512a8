"""What a process started as ``python -m xds_server.testing._child_facts CODE [RAISE]`` sees of
its start, printed as one JSON line (tests compare a zygote-forked child with an exec'd one):
``sys.argv``, ``__name__``, the working directory, ``FACTS_MARK`` from the environment, whether it
leads its own session, what stdin reads and its open file descriptors; then a line on stderr. At
exit a non-daemon thread's line and an atexit line follow (the interpreter's own exit ran); the
exit status is CODE, or 1 with a traceback when RAISE is given."""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time


def _late_line() -> None:
    time.sleep(0.2)
    print("thread joined", flush=True)


def main() -> None:
    facts = {"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "mark": os.environ.get("FACTS_MARK"),
             "session_leader": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
             "open_fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}
    print(json.dumps(facts, sort_keys=True), flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    atexit.register(print, "atexit ran", flush=True)
    threading.Thread(target=_late_line).start()
    if len(sys.argv) > 2:
        raise RuntimeError("asked to raise")
    sys.exit(int(sys.argv[1]))


if __name__ == "__main__":
    main()
