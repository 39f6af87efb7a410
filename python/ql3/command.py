"""The ``ql3`` command's entry point. ``pip install ql3`` alone is the SQLite edge shim;
every command of ``ql3`` talks to PostgreSQL, so without the driver it says which extra
to install instead of ending in an ImportError traceback."""

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
