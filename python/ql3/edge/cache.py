"""``EdgeRevisionCache``: a worker revision cache over an ``EdgeStore`` (SPEC section 8).

``ql3.cache.RevisionCache`` is bound to a PostgreSQL pool and a Redis subscription, so it
cannot run over the SQLite shim; this is the same contract, cut down to one process:

- **Messages are hints ordered by pointer_version.** The ``EdgeRelay`` subscription
  delivers each outbox event; one newer than the cached pointer_version drops the entry
  and reloads it from the store (and fires ``on_change``); older or equal ones are ignored.
  The entry is dropped *before* the reload: a reload that fails (a busy file is
  ``QL3_UNAVAILABLE``) is logged and leaves no entry, so the next lookup reloads and fails
  closed rather than serve what the hint said is gone (the relay does not send it again).
- **Fallback.** An entry older than its family's max staleness is re-verified against the
  active pointer before use (one ``active_pointers`` call for every stale entry); one
  whose pointer moved, or names another revision at the same pointer_version, is reloaded.
- **Degraded without a relay.** With no subscription (none given, or after ``close``)
  nothing announces a change, so every lookup verifies its entry first: one single-key
  ``active_pointers`` read of the local file (a reload would also hash the body).
- **One snapshot per load.** The pointer and the revision it names are read in one read
  transaction (``EdgeStore.active_revisions``), as ``ql3.cache`` reads them in one
  statement: never "none active" paired with the pointer_version of an activation.
- **Fail closed.** No active revision raises ``NotFound``; a body whose hash does not
  match ``body_hash`` is refused (``BodyHashMismatch``).
- **Monotonic.** Loads run one at a time under the cache's lock and read the store as it
  is now, so an entry is never replaced by one with a lower pointer_version.

Several processes may share one file, each with its relay and caches: a relay's local
subscribers follow the outbox with a cursor of their own, so each hears every change
whichever process wrote it or marked it delivered (D39).

``get_effective`` and ``verify_all`` are coroutines, as ``RevisionCache``'s are, so the
model gateway (``PolicySource``) and the provider adapter (``TopologySource``) take this
cache unchanged; ``lookup`` and ``verify`` are their blocking forms (local SQLite reads).
Once the cache has been used from an event loop, relay messages (which arrive on the
relay's thread) are handled on that loop, so ``on_change`` callbacks run where the
gateway and the provider live, as they do with ``RevisionCache``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ql3 import arguments, canonical, errors
from ql3.logs import describe_error
from ql3.revisions import BodyHashMismatch, EffectiveRevision

if TYPE_CHECKING:
    from ql3.edge.relay import EdgeRelay
    from ql3.edge.store import EdgeStore

log = logging.getLogger("ql3.edge.cache")

Key = tuple[str, str, str]
ChangeCallback = Callable[["EffectiveRevision"], Any]

BODY_DOMAIN = canonical.BODY_DOMAIN
_PENDING: set[asyncio.Task[None]] = set()
DEFAULT_STALENESS = 30.0


@dataclass
class _Entry:
    revision: EffectiveRevision | None
    pointer_version: int
    verified_mono: float


class EdgeRevisionCache:
    """Active contract revisions of one process, invalidated by an ``EdgeRelay``."""

    def __init__(
        self,
        store: EdgeStore,
        relay: EdgeRelay | None = None,
        *,
        projects: Iterable[str] | None = None,
        max_staleness: dict[str, float] | None = None,
    ) -> None:
        self.store = store
        self._entries: dict[Key, _Entry] = {}
        self._callbacks: dict[tuple[str, str], list[ChangeCallback]] = {}
        self._lock = threading.RLock()
        self._staleness = store.contract_families()
        self._staleness.update(arguments.check_staleness(max_staleness))
        self.messages = 0
        self.reloads = 0
        self.verifications = 0
        self.last_message_at: datetime | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = None
        if relay is not None:
            self._unsubscribe = relay.subscribe(self._on_message, projects)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def on_change(self, contract_family: str, contract_id: str, fn: ChangeCallback) -> None:
        """Call ``fn(revision)`` whenever a different revision of that contract is loaded."""
        self._callbacks.setdefault((contract_family, contract_id), []).append(fn)

    def staleness(self, contract_family: str) -> float:
        return self._staleness.get(contract_family, DEFAULT_STALENESS)

    @property
    def degraded(self) -> bool:
        """No relay subscription: no change is announced, so every use is verified."""
        return self._unsubscribe is None

    async def get_effective(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> EffectiveRevision:
        """The active revision of a contract (``lookup`` for coroutine callers)."""
        self._loop = asyncio.get_running_loop()
        return self.lookup(project_id, contract_family, contract_id)

    async def verify_all(self) -> None:
        """Re-verify every entry now and reload the ones that moved."""
        self._loop = asyncio.get_running_loop()
        self.verify()

    def lookup(self, project_id: str, contract_family: str, contract_id: str) -> EffectiveRevision:
        """The active revision of a contract.

        Its entry is verified first when the cache is degraded or the entry is older than
        its family budget. Raises ``NotFound`` when no revision is active,
        ``BodyHashMismatch`` for a body that does not match its hash and ``Unavailable``
        when the store cannot be read.
        """
        key = (project_id, contract_family, contract_id)
        with self._lock:
            try:
                entry = self._entries.get(key)
            except TypeError:  # unhashable: not a key at all, as check_contract_key says
                entry = None
            if entry is None:
                # A cached key was checked when it was first loaded: hits skip the check.
                arguments.check_contract_key(*key)
            elif self.degraded or time.monotonic() - entry.verified_mono > self.staleness(
                contract_family
            ):
                self.verify([key])
                entry = self._entries.get(key)
            if entry is None:
                entry = self._load(key)
            if entry.revision is None:
                raise errors.NotFound(f"QL3_NOT_FOUND: no active revision for {'/'.join(key)}")
            return entry.revision

    def verify(self, keys: Iterable[Key] | None = None) -> list[Key]:
        """Check entries against their active pointers in one call; reload the moved ones."""
        with self._lock:
            wanted = (
                list(self._entries) if keys is None else [k for k in keys if k in self._entries]
            )
            if not wanted:
                return []
            moved: list[Key] = []
            now = time.monotonic()
            for row in self.store.active_pointers(wanted):
                key = (row["project_id"], row["contract_family"], row["contract_id"])
                entry = self._entries[key]
                current = None if entry.revision is None else entry.revision.revision_id
                if (
                    row["pointer_version"] == entry.pointer_version
                    and row["revision_id"] == current
                ):
                    entry.verified_mono = now
                elif row["pointer_version"] >= entry.pointer_version:
                    moved.append(key)  # newer, or another revision at the same version
            self.verifications += 1
            # Dropped first: should a reload fail, the next lookup reloads (fail closed).
            replaced = {key: self._entries.pop(key) for key in moved}
            for key in moved:
                self._load(key, replaced[key])
            return moved

    def _on_message(self, channel: str, message: dict[str, Any]) -> None:
        """A relay event: handled on the cache's event loop when it has one."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                loop.call_soon_threadsafe(self._hint, message)
                return
        self._hint(message)

    def _hint(self, message: dict[str, Any]) -> None:
        """A hint, acted on only when newer than what is cached."""
        self.messages += 1
        self.last_message_at = datetime.now(UTC)
        key = (message["project_id"], message["contract_family"], message["contract_id"])
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or int(message["pointer_version"]) <= entry.pointer_version:
                return
            # Dropped before the reload: the hint is not delivered again, so if the reload
            # fails the next lookup must reload (and fail closed), not serve this entry.
            del self._entries[key]
            try:
                self._load(key, entry)
            except Exception as exc:  # on the loop or the relay's thread: nobody to raise to
                log.warning(
                    "edge cache: reload of %s after a hint failed, it reloads on next use: %s",
                    "/".join(key),
                    describe_error(exc),
                    exc_info=not isinstance(exc, errors.Ql3Error),
                )

    def _load(self, key: Key, replaced: _Entry | None = None) -> _Entry:
        """Read the key's pointer and active revision in one snapshot and install them.

        Callers hold the lock and have no entry for ``key`` (``replaced`` is the one they
        dropped, for ``on_change``).
        """
        row = self.store.active_revisions([key])[0]
        now_wall = datetime.now(UTC)
        if row["revision_id"] is None:
            loaded = _Entry(None, int(row["pointer_version"]), time.monotonic())
        else:
            if canonical.digest(BODY_DOMAIN, row["body"]) != row["body_hash"]:
                raise BodyHashMismatch(
                    f"QL3_CONFLICT: body of revision {row['revision_id']} does not match its hash"
                )
            revision = EffectiveRevision(
                project_id=key[0],
                contract_family=key[1],
                contract_id=key[2],
                revision_id=row["revision_id"],
                revision_no=int(row["revision_no"]),
                body=row["body"],
                body_hash=row["body_hash"],
                pointer_version=int(row["pointer_version"]),
                cached_at=now_wall,
                verified_at=now_wall,
            )
            loaded = _Entry(revision, revision.pointer_version, time.monotonic())
        self.reloads += 1
        self._entries[key] = loaded
        changed = replaced is None or (
            (replaced.revision and replaced.revision.revision_id)
            != (loaded.revision and loaded.revision.revision_id)
        )
        if changed and loaded.revision is not None:
            for fn in self._callbacks.get((key[1], key[2]), []):
                self._fire(fn, loaded.revision)
        return loaded

    @staticmethod
    def _fire(fn: ChangeCallback, revision: EffectiveRevision) -> None:
        try:
            result = fn(revision)
        except Exception:
            log.exception("on_change callback failed")
            return
        if inspect.isawaitable(result):
            try:
                task = asyncio.get_running_loop().create_task(_await(result))
                _PENDING.add(task)
                task.add_done_callback(_PENDING.discard)
            except RuntimeError:  # no loop in this thread (the relay's): nothing can await it
                if inspect.iscoroutine(result):
                    result.close()
                log.warning("a coroutine on_change callback fired outside an event loop")

    def health(self) -> dict[str, Any]:
        """Counters and mode: ``normal`` while subscribed to a relay, else ``degraded``
        (every lookup verified against the active pointer first)."""
        return {
            "mode": "degraded" if self.degraded else "normal",
            "entries": len(self._entries),
            "messages": self.messages,
            "reloads": self.reloads,
            "verifications": self.verifications,
            "last_message_at": self.last_message_at,
        }


async def _await(result: Any) -> None:
    try:
        await result
    except Exception:
        log.exception("on_change callback failed")
