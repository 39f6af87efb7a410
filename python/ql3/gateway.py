"""The model gateway (SPEC section 9; seed ADR-0168, decision 3): every provider call sits
between a durable admission and a durable completion.

Why it is built this way:

- **Admission is never raced.** The store call runs where the caller's cancellation and
  deadline cannot stop it. With an asyncio store (``ql3.store_async.AsyncPgStore``) the
  whole of ``invoke`` runs as a task of its own, which the caller's cancellation reaches
  only while nothing is written or the provider is being called (``_in_own_task``); a
  stream's store calls run as tasks of their own. A blocking store's calls
  (``PgStore``, the SQLite ``EdgeStore``) run in one of the gateway's store threads
  (``store_threads``, 8 by default: PgStore's default pool size, so that 8 concurrent
  calls do not queue for a thread). The caller awaits a future of its own that the end
  completes and, when it is cancelled, keeps waiting for the database's own answer, writes the
  completion that answer calls for, and only then lets the cancellation through. An
  admission is bounded by the store's timeouts (``statement_timeout``, ``lock_timeout``,
  connect timeout: ``ql3.db.Timeouts``), never by a race in Python, so a call that
  returned can never leave a ``running`` step behind that nobody will settle.
- **Only ``created`` leads to provider I/O.** Any admission failure is
  ``MODEL_AUDIT_UNAVAILABLE``; ``existing`` (a replay, or the durable recheck after a lost
  COMMIT response) is ``MODEL_INVOCATION_REPLAY_BLOCKED``; a deadline that passed while the
  admission waited writes ``timed_out``. In all three the provider sees nothing.
- **Outcomes say what is known.** Success is ``succeeded`` with usage; a definite
  provider error ``failed``; the deadline ``timed_out``; a caller abort, a stream consumer
  that stops, a connection lost after sending, or anything unexpected ``lost`` with
  ``outcome_unknown``, which only a human resolution moves on (never a retry here).
- **No result without its receipt.** If the completion cannot be written the provider's
  answer is withheld (``MODEL_AUDIT_UNAVAILABLE``); recovery later settles the start as
  lost. Bodies are never stored: the request is digested and counted at admission, the
  response at completion.
- **The policy is a contract revision.** ``policy_routing/<policy_id>`` of the caller's
  project comes from the revision cache and its revision is bound at admission, where the
  database fences it against the active pointer; ``QL3_STALE_REVISION`` makes the gateway
  re-verify the cache and admit once more under the policy that is active now.

Policy body (``policy_routing``): ``{"routes": [{"model": "qwen2.5:7b", "weight": 3,
"endpoint": "gpu-a"}, ...]}``; ``weight`` (default 1) and ``endpoint`` (default: the first
topology endpoint serving the model) are optional, other fields are ignored. A call that
names a model must name one of the routes; otherwise the route is drawn by weight from a
hash of the invocation_id, so a replay of the same call builds the same command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import hashlib
import inspect
import logging
import sys
import threading
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal, Protocol, TypeVar

from ql3 import arguments, canonical, errors
from ql3.errors import Ql3Error
from ql3.invocations import (
    OUTCOME_UNKNOWN,
    Outcome,
    PolicyBinding,
    Usage,
    admission_command,
    completion_command,
    format_timestamp,
    request_digest,
)
from ql3.provider_types import (
    ProviderError,
    ProviderProtocolError,
    ProviderResponse,
    ProviderUnreachable,
    Route,
    StreamDelta,
    StreamEvent,
)

POLICY_FAMILY: Final = "policy_routing"

# Result codes the gateway writes (a lost outcome always carries outcome_unknown).
RESULT_OK: Final = "ok"
RESULT_DEADLINE: Final = "deadline_exceeded"
RESULT_DEADLINE_BEFORE_CALL: Final = "deadline_exceeded_before_call"
RESULT_CANCELLED_BEFORE_CALL: Final = "cancelled_before_call"
RESULT_PROVIDER_UNREACHABLE: Final = "provider_unreachable"
RESULT_PROVIDER_ERROR_EVENT: Final = "provider_error_event"

_MAX_CACHED_POLICIES: Final = 1024
"""Policy revisions whose parsed routes a gateway keeps (cleared all at once when full)."""

log = logging.getLogger("ql3.gateway")

# MODEL_AUDIT_UNAVAILABLE answers by phase, on prometheus_client's default registry, which
# the application's own /metrics serves (D57). Registered only once the application has
# loaded prometheus_client (it serves /metrics with it): the gateway never loads it, so an
# edge device or an application without metrics loads no metrics library (D57).
_audit_unavailable: Any = None
_audit_lock = threading.Lock()


def _audit_counter() -> Any:
    """The counter, registered the first time it is asked for while prometheus_client is
    loaded; None while it is not."""
    global _audit_unavailable
    if _audit_unavailable is None and "prometheus_client" in sys.modules:
        with _audit_lock:
            if _audit_unavailable is None:
                import prometheus_client

                counter = prometheus_client.Counter(
                    "ql3_gateway_audit_unavailable",
                    "Model calls answered MODEL_AUDIT_UNAVAILABLE, by phase "
                    "(admission, completion).",
                    ["phase"],
                )
                for phase in ("admission", "completion"):
                    counter.labels(phase=phase)
                _audit_unavailable = counter
    return _audit_unavailable


_audit_counter()


def _log(level: int, event: str, **fields: Any) -> None:
    log.log(level, event, extra={"ql3": fields})


# -- errors ---------------------------------------------------------------------------------


class GatewayError(Ql3Error):
    """A model call did not produce a result; ``code`` is one of the stable gateway names.

    ``invocation_id`` names the call; ``completion`` is the completion receipt written for
    it, when one was (None when nothing was admitted or the write failed).
    """

    code = "MODEL_GATEWAY_ERROR"

    def __init__(
        self,
        message: str = "",
        *,
        invocation_id: str | None = None,
        completion: Mapping[str, Any] | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message, detail=detail)
        self.invocation_id = invocation_id
        self.completion = completion


class ModelAuditUnavailable(GatewayError):
    """The admission or the completion could not be written; nothing is handed out.

    ``phase`` says which. ``cause_code`` is the ``.code`` of the underlying error
    (``QL3_UNAVAILABLE``, ``QL3_CONFLICT``...). ``command`` is the command that failed: after
    a lost COMMIT response, replaying the admission command (``store.admit_invocation``)
    tells durably whether it was written (``existing``) or not (``created`` now).

    ``cause_outcome`` (D49) is ``"not_sent"`` when the write never reached the database
    (nothing was written: calling again with the same invocation_id is safe),
    ``"unknown"`` when it was sent and no answer came (it may have committed),
    ``"committed"`` when an admission whose answer was lost turned out, on the gateway's
    replay, to have been written (the provider was not called; recovery settles the start
    as lost), ``"rolled_back"`` for a transient refusal, and None for any other cause.
    """

    code = "MODEL_AUDIT_UNAVAILABLE"

    def __init__(
        self,
        message: str,
        *,
        phase: Literal["admission", "completion"],
        command: Mapping[str, Any],
        cause_code: str | None,
        invocation_id: str | None = None,
        cause_outcome: str | None = None,
    ) -> None:
        super().__init__(message, invocation_id=invocation_id)
        self.phase = phase
        self.command = dict(command)
        self.cause_code = cause_code
        self.cause_outcome = cause_outcome
        # Counted here: the gateway creates one only to raise it at once.
        counter = _audit_counter()
        if counter is not None:
            counter.labels(phase=phase).inc()


class ModelInvocationReplayBlocked(GatewayError):
    """The invocation was admitted before (``existing``): the provider is not called again.

    ``start`` is the stored Start receipt.
    """

    code = "MODEL_INVOCATION_REPLAY_BLOCKED"

    def __init__(self, message: str, *, invocation_id: str, start: Mapping[str, Any]) -> None:
        super().__init__(message, invocation_id=invocation_id)
        self.start = dict(start)


class ModelDeadlineExceeded(GatewayError):
    """The deadline passed (before admission, during it, or during the provider call)."""

    code = "MODEL_DEADLINE_EXCEEDED"


class ModelOutcomeUnknown(GatewayError):
    """The provider may or may not have run the request: recorded as lost/outcome_unknown."""

    code = "MODEL_OUTCOME_UNKNOWN"


class ModelProviderFailed(GatewayError):
    """The provider answered with a definite error (or could not be reached at all).

    ``status`` is the HTTP status (None when the connection could not be opened).
    """

    code = "MODEL_PROVIDER_FAILED"

    def __init__(
        self,
        message: str,
        *,
        invocation_id: str,
        status: int | None,
        completion: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, invocation_id=invocation_id, completion=completion)
        self.status = status


GATEWAY_ERRORS: Final[tuple[type[GatewayError], ...]] = (
    ModelAuditUnavailable,
    ModelInvocationReplayBlocked,
    ModelDeadlineExceeded,
    ModelOutcomeUnknown,
    ModelProviderFailed,
)


# -- what the gateway depends on --------------------------------------------------------------


class InvocationStore(Protocol):
    """The two store methods the gateway calls (blocking; run in a worker thread).

    ``ql3.store.PgStore`` and the SQLite ``ql3.edge.EdgeStore`` satisfy it. They must be
    bounded by their own timeouts: the gateway waits for them to end.
    """

    def admit_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def complete_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]: ...


class AsyncInvocationStore(Protocol):
    """The same two methods as coroutines (``ql3.store_async.AsyncPgStore``), awaited on
    the gateway's loop where the caller's cancellation does not reach them (``invoke``:
    in the call's own task; a stream: as tasks of their own), bounded by the store's own
    timeouts."""

    async def admit_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]: ...

    async def complete_invocation(self, command: Mapping[str, Any]) -> Mapping[str, Any]: ...


class PolicyRevision(Protocol):
    """An active contract revision, as ``ql3.cache.EffectiveRevision`` is."""

    @property
    def contract_family(self) -> str: ...
    @property
    def contract_id(self) -> str: ...
    @property
    def revision_id(self) -> str: ...
    @property
    def revision_no(self) -> int: ...
    @property
    def body(self) -> dict[str, Any]: ...


class PolicySource(Protocol):
    """Where policies come from: ``ql3.cache.RevisionCache`` satisfies it."""

    async def get_effective(
        self, project_id: str, contract_family: str, contract_id: str
    ) -> PolicyRevision: ...

    async def verify_all(self) -> None:
        """Re-verify every cached entry against the database now."""


class ChatProvider(Protocol):
    """A provider adapter: ``ql3.providers.OpenAICompatibleProvider`` satisfies it (the
    ``gateway`` extra: httpx). Its types are ``ql3.provider_types``, which needs no httpx."""

    async def route(self, model: str, endpoint: str | None = None) -> Route: ...

    def encode_request(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool,
        options: Mapping[str, Any] | None = None,
    ) -> bytes: ...

    async def complete(self, route: Route, body: bytes) -> ProviderResponse: ...

    def stream(self, route: Route, body: bytes) -> AsyncIterator[StreamEvent]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class GatewayHooks:
    """Fault-injection points for tests, awaited in the task that runs the call (the
    caller's, or the call's own: see ``_in_own_task``).

    ``before_completion(command)`` runs after the provider outcome is known and before the
    completion is written (e.g. to kill the store's connection there).
    """

    before_completion: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None


# -- calls and results --------------------------------------------------------------------------


def deadline_in(seconds: float) -> datetime:
    """An absolute deadline ``seconds`` from now (UTC, microsecond precision)."""
    return datetime.now(UTC) + timedelta(seconds=seconds)


def _new_id() -> str:
    return str(uuid.uuid4())


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelCall:
    """One model call on one ``model`` step.

    The same ``ModelCall`` (same ``invocation_id``, ``deadline_at``, messages...) builds the
    same admission command, so calling it again is an exact replay and is blocked.
    ``expected_step_run_version`` is the step's version when it was ``ready`` (1 for a new
    step). ``policy_id`` is the contract id of the ``policy_routing`` contract in
    ``project_id``. ``model`` picks one of the policy's routes (default: drawn by weight).
    ``options`` are further request parameters (``temperature``, ``max_tokens``...).
    """

    project_id: str
    run_id: str
    step_run_id: str
    trace_id: str
    policy_id: str
    messages: Sequence[Mapping[str, Any]]
    deadline_at: datetime
    expected_step_run_version: int = 1
    invocation_id: str = field(default_factory=_new_id)
    request_id: str | None = None
    model: str | None = None
    options: Mapping[str, Any] | None = None
    new_run: bool = False
    """The run and its model step do not exist yet: the admission creates them in its own
    transaction (``admit_in_new_run``, D59). ``in_new_run`` builds such a call."""

    @classmethod
    def in_new_run(
        cls,
        *,
        project_id: str,
        trace_id: str,
        policy_id: str,
        messages: Sequence[Mapping[str, Any]],
        deadline_at: datetime,
        **rest: Any,
    ) -> ModelCall:
        """A call that starts its own run: new ``run_id`` and ``step_run_id`` (the caller
        reads them off the call), created with the Start receipt in one transaction.
        Invoking the same call again is an exact replay, as for any ``ModelCall``."""
        return cls(
            project_id=project_id,
            run_id=str(uuid.uuid4()),
            step_run_id=str(uuid.uuid4()),
            trace_id=trace_id,
            policy_id=policy_id,
            messages=messages,
            deadline_at=deadline_at,
            new_run=True,
            **rest,
        )


@dataclass(frozen=True, kw_only=True)
class InvocationResult:
    """A successful call, returned only once its completion receipt is durable."""

    invocation_id: str
    text: str
    finish_reason: str | None
    provider: str
    model: str
    usage: Usage | None
    policy_revision_id: str
    output_bytes: int
    output_digest: str
    start_digest: str
    completion_digest: str
    start: Mapping[str, Any]
    completion: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class PolicyRoute:
    """One route of a ``policy_routing`` body."""

    model: str
    weight: int
    endpoint: str | None


def policy_routes(policy: PolicyRevision) -> tuple[PolicyRoute, ...]:
    """The routes of a policy revision; ``InvalidArgument`` when the body has none."""
    where = f"policy {policy.contract_family}/{policy.contract_id} revision {policy.revision_no}"
    items = policy.body.get("routes") if isinstance(policy.body, Mapping) else None
    if not isinstance(items, list) or not items:
        raise errors.InvalidArgument(f"QL3_INVALID_ARGUMENT: {where} has no routes")
    routes: list[PolicyRoute] = []
    for i, item in enumerate(items):
        model = item.get("model") if isinstance(item, Mapping) else None
        weight = item.get("weight", 1) if isinstance(item, Mapping) else None
        endpoint = item.get("endpoint") if isinstance(item, Mapping) else None
        if (
            not isinstance(model, str)
            or not model
            or not isinstance(weight, int)
            or isinstance(weight, bool)
            or weight < 1
            or (endpoint is not None and not isinstance(endpoint, str))
        ):
            raise errors.InvalidArgument(
                f"QL3_INVALID_ARGUMENT: {where}: routes[{i}] needs a model, a weight >= 1 "
                "and at most an endpoint name"
            )
        routes.append(PolicyRoute(model=model, weight=weight, endpoint=endpoint))
    return tuple(routes)


def choose_route(
    routes: Sequence[PolicyRoute], invocation_id: str, model: str | None
) -> PolicyRoute:
    """The route of a call: the one of ``model``, or drawn by weight from the invocation_id."""
    if model is not None:
        for route in routes:
            if route.model == model:
                return route
        allowed = ", ".join(sorted({r.model for r in routes}))
        raise errors.InvalidArgument(
            f"QL3_INVALID_ARGUMENT: model {model!r} is not allowed by the policy ({allowed})"
        )
    if len(routes) == 1:
        return routes[0]  # what the draw below gives, without hashing
    total = sum(r.weight for r in routes)
    point = int.from_bytes(hashlib.sha256(invocation_id.encode()).digest()[:8], "big") % total
    for route in routes:
        point -= route.weight
        if point < 0:
            return route
    return routes[-1]


# Internal records of one call: plain slotted dataclasses, built on every call (a frozen
# one costs about twice as much to build).
@dataclass(kw_only=True, slots=True)
class _Plan:
    route: Route
    body: bytes
    command: dict[str, Any]
    policy_revision_id: str


@dataclass(kw_only=True, slots=True)
class _Admission:
    call: ModelCall
    plan: _Plan
    start: Mapping[str, Any]
    start_digest: str
    deadline: float  # event loop time

    @property
    def invocation_id(self) -> str:
        return self.call.invocation_id


@dataclass(frozen=True)
class _Finished:
    """A durable store call that ran to its end: its value or error, and whether the
    caller was cancelled meanwhile."""

    value: Mapping[str, Any] | None
    error: BaseException | None
    cancelled: bool


async def _run_to_end(job: concurrent.futures.Future[Mapping[str, Any]]) -> _Finished:
    """Wait for a store call running in a thread to end, whatever happens to the caller;
    a cancellation that arrives meanwhile is reported, never acted on here.

    The caller awaits a future of its own that the thread's end completes (one loop
    callback, as ``asyncio.to_thread`` takes): a cancellation cancels only that future,
    never the call, and the wait starts over on a new one.
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake() -> None:  # on the loop
        if not waiter.done():
            waiter.set_result(None)

    def ended(_: object) -> None:  # in the store thread (or here, if it has ended)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(wake)

    job.add_done_callback(ended)
    cancelled = False
    while not job.done():
        try:
            await waiter
        except asyncio.CancelledError:
            cancelled = True  # only the waiter was cancelled: the thread runs on
            waiter = loop.create_future()
    error = job.exception()
    return _Finished(None if error is not None else job.result(), error, cancelled)


@dataclass(kw_only=True, slots=True)
class _Guard:
    """What the caller's cancellation may do to a call in progress.

    ``own_task``: the call runs in a task of its own (``_in_own_task``), so its store calls
    are awaited directly and nothing reaches them; otherwise it runs in the caller's task
    and each store call is protected on its own. ``interruptible``: the own task may be
    cancelled now (while the policy is looked up, nothing written yet, and while the
    provider is called). ``cancelled``: the caller was cancelled.
    """

    own_task: bool
    interruptible: bool = True
    cancelled: bool = False


_T = TypeVar("_T")


async def _own_task_ended(
    body: Callable[[_Guard], Coroutine[Any, Any, _T]], guard: _Guard
) -> asyncio.Task[_T]:
    """Run ``body`` as a task of its own and wait for its end; the task, done.

    A cancellation of the caller cancels the task only while ``guard.interruptible``;
    otherwise it is only noted in ``guard.cancelled``, for ``body`` to act on, and the
    wait starts over on a new future. The task's last step completes that future (one loop
    pass fewer than a done callback or ``shield``). A task cancelled before its first step
    (loop shutdown) never runs ``body``, whose coroutine is then closed unstarted.
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    async def run() -> _T:
        try:
            return await coro
        finally:
            wake()  # the task is done by the time the caller resumes

    coro = body(guard)
    task = loop.create_task(run())
    task.add_done_callback(wake)  # a task cancelled before its first step never runs run()
    while not task.done():
        try:
            await waiter
        except asyncio.CancelledError:
            guard.cancelled = True
            if guard.interruptible:
                task.cancel()
            waiter = loop.create_future()
    if task.cancelled():
        coro.close()  # a no-op unless it never started
    return task


async def _in_own_task(body: Callable[[_Guard], Coroutine[Any, Any, _T]]) -> _T:
    """Run a whole call as a task of its own (``_own_task_ended``); its result or error.

    The caller's cancellation interrupts the call only where ``body`` marks itself
    interruptible; elsewhere (a store call and what follows from its answer) ``body`` sees
    it noted in the guard, and it is raised here once the call has ended. One task per
    call, not one per store call: on a loop shared by many calls, every hop through the
    loop's queue waits behind the work of every other call (D43).
    """
    guard = _Guard(own_task=True)
    task = await _own_task_ended(body, guard)
    if task.cancelled():
        raise asyncio.CancelledError
    error = task.exception()  # retrieved either way: a cancellation wins
    if guard.cancelled:
        raise asyncio.CancelledError
    if error is not None:
        raise error
    return task.result()


async def _task_to_end(call: Awaitable[Mapping[str, Any]]) -> _Finished:
    """``_run_to_end`` for a store coroutine, run as a task of its own on this loop (a
    stream's store calls). A cancellation of the caller never reaches the call; a call
    cancelled from outside (loop shutdown) has an unknown outcome."""
    guard = _Guard(own_task=True, interruptible=False)
    task = await _own_task_ended(lambda own: _awaited_to_end(call, own), guard)
    if task.cancelled():  # not by us (loop shutdown): the outcome is unknown here
        if inspect.iscoroutine(call):
            call.close()  # never started if the task was cancelled before its first step
        error = errors.OutcomeUnknown("QL3_UNAVAILABLE: the store call was cancelled")
        return _Finished(None, error, True)
    done = task.result()
    return _Finished(done.value, done.error, guard.cancelled)


async def _awaited_to_end(call: Awaitable[Mapping[str, Any]], guard: _Guard) -> _Finished:
    """A store coroutine awaited in a call's own task, where the caller's cancellation
    does not reach it (the guard says whether the caller was cancelled meanwhile)."""
    try:
        value = await call
    except Exception as exc:
        return _Finished(None, exc, guard.cancelled)
    return _Finished(value, None, guard.cancelled)


def _settled_fields(admission: _Admission, command: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "invocation_id": admission.invocation_id,
        "outcome": command.get("outcome"),
        "result_code": command.get("result_code"),
    }


def _code(exc: BaseException) -> str:
    return exc.code if isinstance(exc, Ql3Error) else type(exc).__name__


def _outcome(exc: BaseException) -> str | None:
    """Whether an unavailable store's write took effect (``errors.Unavailable.outcome``)."""
    return exc.outcome if isinstance(exc, errors.Unavailable) else None


class ModelGateway:
    """``await gateway.invoke(call)`` and ``gateway.stream(call)`` over a store, a policy
    source (the revision cache) and a provider adapter.

    >>> provider = OpenAICompatibleProvider(cache)          # doctest: +SKIP
    >>> gateway = ModelGateway(PgStore(dsn), cache, provider)
    """

    def __init__(
        self,
        store: InvocationStore | AsyncInvocationStore,
        policies: PolicySource,
        provider: ChatProvider,
        *,
        hooks: GatewayHooks | None = None,
        store_threads: int = 8,
    ) -> None:
        arguments.check_count("store_threads", store_threads, 1)
        self._store = store
        # A coroutine store runs its calls as tasks; a blocking one in the store threads.
        self._async_store = inspect.iscoroutinefunction(store.admit_invocation)
        self._policies = policies
        self._provider = provider
        self._hooks = hooks or GatewayHooks()
        self._store_threads = store_threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._routes: dict[str, tuple[PolicyRoute, ...]] = {}
        _audit_counter()  # its series exist from the start when the application has metrics

    async def aclose(self) -> None:
        """Close the provider's connections and let the store threads end once their calls
        have (the store and the cache belong to the caller). The gateway can be used again."""
        try:
            await self._provider.aclose()
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=False)

    def _store_call(
        self, fn: Callable[[Mapping[str, Any]], Any], command: Mapping[str, Any], guard: _Guard
    ) -> Awaitable[_Finished]:
        """Start a store call, in the caller's context, and wait for its end: a coroutine
        awaited directly in a call's own task (``_in_own_task``) or as a task of its own
        (``_task_to_end``), a blocking call in one of the gateway's threads (as
        ``asyncio.to_thread``; ``_run_to_end``)."""
        if guard.own_task:
            guard.interruptible = False
            return _awaited_to_end(fn(command), guard)
        if self._async_store:
            return _task_to_end(fn(command))
        executor = self._executor
        if executor is None:
            executor = self._executor = concurrent.futures.ThreadPoolExecutor(
                self._store_threads, thread_name_prefix="ql3-gateway-store"
            )
        return _run_to_end(executor.submit(contextvars.copy_context().run, fn, command))

    async def __aenter__(self) -> ModelGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the two entry points ---------------------------------------------------------------

    async def invoke(self, call: ModelCall) -> InvocationResult:
        """Admit, call the provider, write the completion, return the answer.

        Raises one of ``GATEWAY_ERRORS``, or ``asyncio.CancelledError`` once the outcome of
        a cancelled call is written. Errors of the call itself (an unknown or revoked
        policy, a model the policy does not allow, malformed messages) are ``ql3.errors``
        raised before anything is admitted.
        """
        if self._async_store:
            return await _in_own_task(lambda guard: self._invoke(call, guard))
        return await self._invoke(call, _Guard(own_task=False))

    async def _invoke(self, call: ModelCall, guard: _Guard) -> InvocationResult:
        admission = await self._admit(call, stream=False, guard=guard)
        timer = asyncio.timeout_at(admission.deadline)
        try:
            guard.interruptible = True
            try:
                async with timer:
                    route, body = admission.plan.route, admission.plan.body
                    response = await self._provider.complete(route, body)
            finally:
                guard.interruptible = False
        except asyncio.CancelledError:
            lost = self._command(admission, Outcome.LOST)
            await self._settle_quietly(admission, lost, "caller_cancelled", guard)
            raise
        except Exception as exc:
            command, error = self._failure(admission, exc, timer.expired())
            error.completion, _ = await self._settle(admission, command, guard)
            raise error from exc
        return await self._succeed(admission, response, guard)

    def stream(self, call: ModelCall) -> ModelStream:
        """The answer as an async iterator of text pieces.

        Use ``async with gateway.stream(call) as chunks: async for piece in chunks: ...``.
        Admission happens at the first iteration. Stopping early (``aclose``, leaving the
        ``async with``) or being cancelled settles the call as lost/outcome_unknown. The
        iterator ends only once the completion is durable; when it cannot be written the
        iteration raises ``ModelAuditUnavailable`` instead of ending, and the pieces
        received must be discarded. ``ModelStream.result`` holds the receipts afterwards.
        """
        return ModelStream(self, call)

    # -- admission --------------------------------------------------------------------------

    async def _plan(self, call: ModelCall, *, stream: bool, refresh: bool) -> _Plan:
        """Policy, route, request body and admission command; nothing durable happens here."""
        for name in ("project_id", "trace_id", "policy_id", "invocation_id"):
            canonical.check_identifier(name, getattr(call, name))
        request_id = call.invocation_id if call.request_id is None else call.request_id
        canonical.check_identifier("request_id", request_id)
        if refresh:
            await self._policies.verify_all()
        policy = await self._policies.get_effective(call.project_id, POLICY_FAMILY, call.policy_id)
        chosen = choose_route(self._policy_routes(policy), call.invocation_id, call.model)
        route = await self._provider.route(chosen.model, chosen.endpoint)
        body = self._provider.encode_request(
            chosen.model, call.messages, stream=stream, options=call.options
        )
        command = admission_command(
            invocation_id=call.invocation_id,
            request_id=request_id,
            project_id=call.project_id,
            run_id=call.run_id,
            step_run_id=call.step_run_id,
            trace_id=call.trace_id,
            expected_step_run_version=call.expected_step_run_version,
            provider=route.provider,
            model=route.model,
            policy=PolicyBinding.of(policy),
            request_digest=request_digest(body),
            input_bytes=len(body),
            deadline_at=call.deadline_at,
        )
        return _Plan(
            route=route, body=body, command=command, policy_revision_id=str(policy.revision_id)
        )

    def _admission_of(self, call: ModelCall) -> Callable[[Mapping[str, Any]], Any]:
        """The store method that admits ``call``: ``admit_in_new_run`` when the call starts
        its run (one transaction creates the run, the step and the Start receipt, D59),
        else ``admit_invocation``."""
        if not call.new_run:
            return self._store.admit_invocation
        admit: Callable[[Mapping[str, Any]], Any] | None = getattr(
            self._store, "admit_in_new_run", None
        )
        if admit is None:
            raise errors.InvalidArgument(
                "QL3_INVALID_ARGUMENT: this store cannot start a run in the admission "
                "(no admit_in_new_run); create the run and step first"
            )
        return admit

    def _policy_routes(self, policy: PolicyRevision) -> tuple[PolicyRoute, ...]:
        """``policy_routes`` of a revision, parsed once per revision (revisions are
        immutable; an invalid body is not kept and raises on every call)."""
        revision_id = str(policy.revision_id)
        routes = self._routes.get(revision_id)
        if routes is None:
            routes = policy_routes(policy)
            if len(self._routes) >= _MAX_CACHED_POLICIES:
                self._routes.clear()
            self._routes[revision_id] = routes
        return routes

    async def _admit(self, call: ModelCall, *, stream: bool, guard: _Guard) -> _Admission:
        """A ``created`` admission whose deadline has not passed, or an error.

        The policy lookup is bounded by the deadline (nothing is written yet); the admission
        itself is not, and runs to the database's answer whatever happens to the caller.
        """
        loop = asyncio.get_running_loop()
        try:
            remaining = (call.deadline_at - datetime.now(UTC)).total_seconds()
        except TypeError:  # a naive deadline, or not a datetime: the call's own error
            format_timestamp(call.deadline_at)  # raises InvalidArgument, which says why
            raise
        deadline = loop.time() + remaining
        for attempt in (1, 2):
            guard.interruptible = True  # nothing is written before the admission
            timer = asyncio.timeout_at(deadline)
            try:
                async with timer:
                    plan = await self._plan(call, stream=stream, refresh=attempt > 1)
            except TimeoutError as exc:
                if not timer.expired():
                    raise
                raise _late_before_admission(call) from exc
            if loop.time() >= deadline:
                raise _late_before_admission(call)
            done = await self._store_call(self._admission_of(call), plan.command, guard)
            if isinstance(done.error, errors.OutcomeUnknown) and not done.cancelled:
                done = await self._recheck_admission(call, plan, done, guard)
            if done.error is not None:
                if isinstance(done.error, errors.StaleRevision) and attempt == 1:
                    if done.cancelled:
                        raise asyncio.CancelledError
                    _log(
                        logging.INFO,
                        "gateway_stale_policy",
                        invocation_id=call.invocation_id,
                        stale_revision_id=plan.policy_revision_id,
                        active_revision_id=done.error.detail,
                    )
                    continue
                _log(
                    logging.WARNING,
                    "gateway_admission_failed",
                    invocation_id=call.invocation_id,
                    error=str(done.error),
                )
                if done.cancelled:
                    raise asyncio.CancelledError
                raise ModelAuditUnavailable(
                    f"MODEL_AUDIT_UNAVAILABLE: the admission was not written: {done.error}",
                    phase="admission",
                    command=plan.command,
                    cause_code=_code(done.error),
                    invocation_id=call.invocation_id,
                    cause_outcome=_outcome(done.error),
                ) from done.error
            assert done.value is not None
            return await self._admitted(call, plan, done, deadline, guard)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _recheck_admission(
        self, call: ModelCall, plan: _Plan, lost: _Finished, guard: _Guard
    ) -> _Finished:
        """After an admission whose outcome is unknown (a lost COMMIT reply, a call given
        up), the same command once more, which the database answers durably (D49):
        ``created`` means the first never committed, and the call goes on with this one;
        ``existing`` means it did, and the provider, never called, is not called now (the
        start is settled by recovery). When the replay fails too the outcome stays unknown.
        """
        _log(
            logging.WARNING,
            "gateway_admission_outcome_unknown",
            invocation_id=call.invocation_id,
            error=str(lost.error),
        )
        again = await self._store_call(self._admission_of(call), plan.command, guard)
        if again.error is not None or again.value is None:
            return _Finished(None, lost.error, again.cancelled)
        if again.value.get("status") != "existing":
            return again
        if again.cancelled:
            raise asyncio.CancelledError
        raise ModelAuditUnavailable(
            "MODEL_AUDIT_UNAVAILABLE: the admission's answer was lost, and its replay found it "
            "written; the provider was not called and recovery will settle the call as lost",
            phase="admission",
            command=plan.command,
            cause_code=_code(lost.error) if lost.error is not None else None,
            invocation_id=call.invocation_id,
            cause_outcome="committed",
        ) from lost.error

    async def _admitted(
        self, call: ModelCall, plan: _Plan, done: _Finished, deadline: float, guard: _Guard
    ) -> _Admission:
        assert done.value is not None
        status, start = done.value.get("status"), done.value.get("start")
        if status == "existing" and isinstance(start, Mapping):
            if done.cancelled:
                raise asyncio.CancelledError
            raise ModelInvocationReplayBlocked(
                f"MODEL_INVOCATION_REPLAY_BLOCKED: invocation {call.invocation_id} was already "
                "admitted; the provider is not called again",
                invocation_id=call.invocation_id,
                start=start,
            )
        if status != "created" or not isinstance(start, Mapping):
            raise ModelAuditUnavailable(
                f"MODEL_AUDIT_UNAVAILABLE: the admission answered {status!r}",
                phase="admission",
                command=plan.command,
                cause_code=None,
                invocation_id=call.invocation_id,
            )
        admission = _Admission(
            call=call,
            plan=plan,
            start=start,
            start_digest=str(done.value["start_digest"]),
            deadline=deadline,
        )
        # The database clock (admitted_at) and ours both count: either one past the
        # deadline means the call would start late. Same fixed format: text order is time order.
        late = asyncio.get_running_loop().time() >= deadline or (
            str(start.get("admitted_at", "")) >= str(plan.command["deadline_at"])
        )
        if done.cancelled:
            outcome = Outcome.TIMED_OUT if late else Outcome.FAILED
            code = RESULT_DEADLINE_BEFORE_CALL if late else RESULT_CANCELLED_BEFORE_CALL
            command = self._command(admission, outcome, code)
            await self._settle_quietly(
                admission, command, "caller_cancelled_during_admission", guard
            )
            raise asyncio.CancelledError
        if late:
            command = self._command(admission, Outcome.TIMED_OUT, RESULT_DEADLINE_BEFORE_CALL)
            completion, _ = await self._settle(admission, command, guard)
            raise ModelDeadlineExceeded(
                "MODEL_DEADLINE_EXCEEDED: the deadline passed while the admission waited for "
                "the database; the provider was not called",
                invocation_id=call.invocation_id,
                completion=completion,
            )
        return admission

    # -- completion -------------------------------------------------------------------------

    @staticmethod
    def _command(
        admission: _Admission,
        outcome: Outcome,
        result_code: str | None = None,
        *,
        output_bytes: int | None = None,
        output_digest: str | None = None,
        usage: Usage | None = None,
    ) -> dict[str, Any]:
        return completion_command(
            invocation_id=admission.invocation_id,
            start_digest=admission.start_digest,
            outcome=outcome,
            result_code=result_code,
            output_bytes=output_bytes,
            output_digest=output_digest,
            usage=usage,
        )

    def _failure(
        self, admission: _Admission, exc: Exception, deadline_expired: bool
    ) -> tuple[dict[str, Any], GatewayError]:
        """The completion command and the caller's error for a provider call that raised."""
        invocation_id = admission.invocation_id
        if isinstance(exc, TimeoutError) and deadline_expired:
            return self._command(admission, Outcome.TIMED_OUT, RESULT_DEADLINE), (
                ModelDeadlineExceeded(
                    "MODEL_DEADLINE_EXCEEDED: the provider did not answer before the deadline",
                    invocation_id=invocation_id,
                )
            )
        if isinstance(exc, ProviderError):
            code = (
                RESULT_PROVIDER_ERROR_EVENT if exc.status < 400 else f"provider_http_{exc.status}"
            )
            command = self._command(
                admission,
                Outcome.FAILED,
                code,
                output_bytes=exc.output_bytes,
                output_digest=exc.output_digest,
            )
            return command, ModelProviderFailed(
                f"MODEL_PROVIDER_FAILED: {exc}", invocation_id=invocation_id, status=exc.status
            )
        if isinstance(exc, ProviderUnreachable):
            return self._command(admission, Outcome.FAILED, RESULT_PROVIDER_UNREACHABLE), (
                ModelProviderFailed(
                    f"MODEL_PROVIDER_FAILED: the provider could not be reached: {exc}",
                    invocation_id=invocation_id,
                    status=None,
                )
            )
        return self._command(admission, Outcome.LOST), ModelOutcomeUnknown(
            f"MODEL_OUTCOME_UNKNOWN: {type(exc).__name__}: {exc}; recorded as "
            f"lost/{OUTCOME_UNKNOWN} for a human to resolve",
            invocation_id=invocation_id,
        )

    async def _settle(
        self, admission: _Admission, command: Mapping[str, Any], guard: _Guard
    ) -> tuple[Mapping[str, Any], str]:
        """Write the completion to its end (whatever happens to the caller meanwhile): the
        completion receipt and its digest, or ``ModelAuditUnavailable``. A cancellation
        that arrived meanwhile is raised after the write."""
        cancelled = False
        hook = self._hooks.before_completion
        if hook is not None:
            try:
                await hook(command)
            except asyncio.CancelledError:
                cancelled = True
        done = await self._store_call(self._store.complete_invocation, command, guard)
        cancelled = cancelled or done.cancelled
        if done.error is not None:
            _log(
                logging.ERROR,
                "gateway_completion_failed",
                error=str(done.error),
                **_settled_fields(admission, command),
            )
            if cancelled:
                raise asyncio.CancelledError
            raise ModelAuditUnavailable(
                f"MODEL_AUDIT_UNAVAILABLE: the completion was not written ({done.error}); the "
                "provider result is withheld and recovery will settle the call as lost",
                phase="completion",
                command=command,
                cause_code=_code(done.error),
                invocation_id=admission.invocation_id,
                cause_outcome=_outcome(done.error),
            ) from done.error
        if log.isEnabledFor(logging.INFO):
            _log(logging.INFO, "gateway_invocation_settled", **_settled_fields(admission, command))
        if cancelled:
            raise asyncio.CancelledError
        assert done.value is not None
        completion = done.value.get("completion")
        if not isinstance(completion, Mapping):
            raise ModelAuditUnavailable(
                f"MODEL_AUDIT_UNAVAILABLE: the completion answered {done.value!r:.200}",
                phase="completion",
                command=command,
                cause_code=None,
                invocation_id=admission.invocation_id,
            )
        return completion, str(done.value.get("completion_digest"))

    async def _settle_quietly(
        self, admission: _Admission, command: Mapping[str, Any], why: str, guard: _Guard
    ) -> None:
        """Settle on a path that raises something else anyway (a cancellation, an early
        stop): a failed write is logged and left to recovery."""
        _log(
            logging.INFO,
            "gateway_invocation_abandoned",
            invocation_id=admission.invocation_id,
            why=why,
        )
        # A failed write is logged by _settle; recovery settles the start after its deadline.
        with contextlib.suppress(GatewayError):
            await self._settle(admission, command, guard)

    async def _succeed(
        self, admission: _Admission, response: ProviderResponse, guard: _Guard
    ) -> InvocationResult:
        command = self._command(
            admission,
            Outcome.SUCCEEDED,
            RESULT_OK,
            output_bytes=response.output_bytes,
            output_digest=response.output_digest,
            usage=response.usage,
        )
        completion, completion_digest = await self._settle(admission, command, guard)
        return InvocationResult(
            invocation_id=admission.invocation_id,
            text=response.text,
            finish_reason=response.finish_reason,
            provider=admission.plan.route.provider,
            model=admission.plan.route.model,
            usage=response.usage,
            policy_revision_id=admission.plan.policy_revision_id,
            output_bytes=response.output_bytes,
            output_digest=response.output_digest,
            start_digest=admission.start_digest,
            completion_digest=completion_digest,
            start=admission.start,
            completion=completion,
        )

    # -- streaming --------------------------------------------------------------------------

    async def _stream(self, call: ModelCall, sink: ModelStream) -> AsyncGenerator[str, None]:
        guard = _Guard(own_task=False)  # the consumer's task runs the stream
        admission = await self._admit(call, stream=True, guard=guard)
        events = self._provider.stream(admission.plan.route, admission.plan.body)
        final: ProviderResponse | None = None
        try:
            try:
                while final is None:
                    timer = asyncio.timeout_at(admission.deadline)
                    async with timer:
                        event = await anext(events, None)
                    if event is None:
                        raise ProviderProtocolError("the provider stream ended without an answer")
                    if isinstance(event, StreamDelta):
                        yield event.text
                    else:
                        final = event
            finally:
                await _close_quietly(events)
        except GeneratorExit:
            lost = self._command(admission, Outcome.LOST)
            await self._settle_quietly(admission, lost, "stream_consumer_stopped", guard)
            raise
        except asyncio.CancelledError:
            lost = self._command(admission, Outcome.LOST)
            await self._settle_quietly(admission, lost, "stream_consumer_cancelled", guard)
            raise
        except Exception as exc:
            command, error = self._failure(admission, exc, timer.expired())
            error.completion, _ = await self._settle(admission, command, guard)
            raise error from exc
        sink.result = await self._succeed(admission, final, guard)


def _late_before_admission(call: ModelCall) -> ModelDeadlineExceeded:
    return ModelDeadlineExceeded(
        "MODEL_DEADLINE_EXCEEDED: the deadline passed before admission; nothing was admitted",
        invocation_id=call.invocation_id,
    )


async def _close_quietly(events: AsyncIterator[StreamEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception as exc:  # closing a broken stream: its error is already being handled
        _log(logging.DEBUG, "gateway_stream_close_failed", error=repr(exc))


class ModelStream:
    """The text pieces of one streamed call (see ``ModelGateway.stream``)."""

    def __init__(self, gateway: ModelGateway, call: ModelCall) -> None:
        self.call = call
        self.result: InvocationResult | None = None
        """The receipts and the whole answer, once the iteration has ended."""
        self._pieces = gateway._stream(call, self)

    def __aiter__(self) -> ModelStream:
        return self

    async def __anext__(self) -> str:
        return await self._pieces.__anext__()

    async def aclose(self) -> None:
        """Stop early: closes the provider stream and settles the call as lost (a no-op
        once the iteration has ended, or before it started: then nothing was admitted)."""
        await self._pieces.aclose()

    async def __aenter__(self) -> ModelStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = [
    "GATEWAY_ERRORS",
    "POLICY_FAMILY",
    "AsyncInvocationStore",
    "ChatProvider",
    "GatewayError",
    "GatewayHooks",
    "InvocationResult",
    "InvocationStore",
    "ModelAuditUnavailable",
    "ModelCall",
    "ModelDeadlineExceeded",
    "ModelGateway",
    "ModelInvocationReplayBlocked",
    "ModelOutcomeUnknown",
    "ModelProviderFailed",
    "ModelStream",
    "PolicyRevision",
    "PolicyRoute",
    "PolicySource",
    "choose_route",
    "deadline_in",
    "policy_routes",
]
