"""The ``ql3`` command's entry point. ``pip install ql3`` alone is the SQLite edge shim,
whose operations commands run with ``--sqlite`` (D58); ``ql3.cli`` imports no driver, and
each PostgreSQL path names the extra it lacks. The fallback below stays as a safety net:
should ``ql3.cli`` ever fail to import for want of a server-side package, the command says
which extra to install instead of ending in an ImportError traceback."""

from __future__ import annotations

import sys

_SERVER_MODULES = frozenset({"psycopg", "psycopg_pool", "redis", "prometheus_client"})


def main() -> int:
    try:
        from ql3 import cli
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _SERVER_MODULES:
            raise
        print(
            f"error: the ql3 command needs {exc.name}, which this install lacks: "
            "pip install 'ql3[postgres]' for the commands, 'ql3[all]' for the daemons "
            "(pip install ql3 alone is the SQLite edge shim, ql3.edge)",
            file=sys.stderr,
        )
        return 2
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
