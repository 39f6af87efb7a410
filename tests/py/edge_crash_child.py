"""Child process of the crash-window tests: run one procedure on an SQLite file and SIGKILL
ourselves at a named statement boundary.

    python tests/py/edge_crash_child.py PATH JOURNAL_MODE PROCEDURE POINT COMMAND_JSON_FILE

PROCEDURE is admission, completion or resolution; POINT a crash point name as
``EdgeStore._crash_point`` receives it (``admission:after_step_update``,
``completion:after_commit``...). Exit status 3 means the point was never reached.

``--serve`` runs many windows from one process, which imports ql3 once: it reads one JSON
array of those five arguments per line on stdin, forks a child for each (this process is
single-threaded, so fork is safe), lets the child run the window to its SIGKILL, and
writes the child's wait status as one JSON line ``{"signal": n}`` or ``{"exit": n}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from ql3.edge import EdgeStore

METHODS = {
    "admission": "admit_invocation",
    "completion": "complete_invocation",
    "resolution": "resolve_invocation",
}


def run_window(argv: list[str]) -> int:
    path, journal_mode, procedure, point, command_file = argv
    command = json.loads(Path(command_file).read_text(encoding="utf-8"))

    def crash_point(name: str) -> None:
        if name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    store = EdgeStore(path, journal_mode, migrate=False, _crash_point=crash_point)  # type: ignore[arg-type]
    getattr(store, METHODS[procedure])(command)
    return 3


def serve() -> int:
    for line in sys.stdin:
        argv = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                code = run_window(argv)
            except BaseException as exc:  # reported as exit 4 with the error on stderr
                print(f"window {argv[3]} failed: {exc!r}", file=sys.stderr, flush=True)
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            result = {"signal": os.WTERMSIG(status)}
        else:
            result = {"exit": os.WEXITSTATUS(status)}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else run_window(sys.argv[1:]))
