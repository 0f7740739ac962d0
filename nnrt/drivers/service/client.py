"""The client proxy of a driver service: a :class:`~nnrt.hal.Device`
whose calls go over the service's Unix socket.

Theory of operation
-------------------
A :class:`ServiceDevice` owns one connection. Calls are sent from the
caller's thread under a lock (so frames never interleave and the pool cache
decisions below are made in the order the service sees them); a reader
thread receives every reply and hands it to the caller waiting on that call
id — an asyncio future (via ``call_soon_threadsafe``), a trio task (via its
token's ``run_sync_soon``) or a blocked thread (``threading.Event``). Many
calls may be in flight at once; replies come in completion order.

Why a reader thread rather than a task on the app's loop: the HAL's query
methods and ``execute_synchronously`` are synchronous, the app may run
asyncio or trio, and a dead service must be noticed even when nobody is
awaiting it. The reader thread blocks in ``recvmsg``; when the service dies
(EOF, ECONNRESET, a reply that does not decode) it fails every pending call
with DEAD_OBJECT at once — executions get an ``ExecutionResult`` with that
status, other calls raise ``NnrtError(DEAD_OBJECT)`` — and every later call
fails the same way without touching the socket.

Cancelling the task awaiting ``execute`` sends CANCEL for that call and
waits (shielded, bounded) for the call's own reply: the service sends it once
its driver has let go of the request's pools, so the caller may reuse them
when the cancellation reaches it, as with the in-process device.

Device queries answer the same for a device's whole life, so ``connect``
asks them once and the proxy answers from that copy.

Pools. A request pool that is an :class:`nnrt.memory.Memory` travels by fd
the first time a prepared model sees it and by id after that (the service
keeps it mapped); ids whose Memory was closed or collected are released in
the next execution. Any other pool (numpy arrays, bytes) is staged: copied
into a shared-memory *arena* (reused across executions, itself cached on the
service by id), and output regions are copied back after the reply.

Fenced executions send their wait_for fences' fds with the call, and the
result fence too: the client creates it and returns it without waiting for
any reply, so the next stage can wait on it at once (no round trip per
stage). The reply, when the execution has settled, is the callback's info.
Staging is impossible there (the service uses the pools after the call), so
every pool must be a Memory. If the reply is an error and the fence is
still ACTIVE (the call was refused before the service could take the
fence), or the service dies first, the reader thread writes the error into
the result fence (anyone holding an eventfd may), so its waiters wake.
"""
from __future__ import annotations

import array
import collections
import itertools
import os
import socket
import threading
import weakref

import anyio

from ...errors import ErrorStatus, NnrtError, bad_state, invalid
from ...fence.outcome import FenceState
from ...fence.sync_fence import SyncFence
from ...memory import Memory
from ...model.graph import HalModel
from ...hal.types import Priority
from ...vlog import vlog
from ...burst.controller import BurstController, BurstLink
from ...handoff import Waiter
from ...hal import (NO_TIMING, Capabilities, Device, ExecutionPreference, ExecutionResult,
                   PreparedModel, Request, Scheduling, Timing)
from . import protocol as p

_RECV_SIZE = 1 << 16
_ALIGN = 64
_MAX_FREE_ARENAS = 8
# How long a cancelled execution waits for the service to let go of its
# pools (it stops at the next operation boundary; a live service answers
# in one operation's time, a dead one at once with DEAD_OBJECT).
_CANCEL_GRACE = 10.0
# The service caches at most protocol.MAX_CACHED_POOLS pools per prepared
# model; the client evicts its oldest ids well before that.
_CLIENT_CACHE_LIMIT = p.MAX_CACHED_POOLS - 32


def _dead(message: str) -> NnrtError:
    return NnrtError(ErrorStatus.DEAD_OBJECT, message)


class _Waiter(Waiter):
    """Where the reply to one call goes: delivered from the reader thread."""

    __slots__ = ("call_id",)

    @property
    def reply(self) -> p.Reply | None:
        return self.value if self.delivered else None


class _Channel:
    """One connection: sending under a lock, a reader thread for replies."""

    def __init__(self, sock: socket.socket, label: str):
        self.sock = sock
        self.label = label
        self.proto = p.Connection("client")
        self._send_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: dict[int, tuple[_Waiter, p.Method]] = {}
        self._call_ids = itertools.count(1)
        self._pool_ids = itertools.count(1)
        self.dead: NnrtError | None = None
        # Burst controllers by burst id: they answer the service's
        # GET_MEMORIES calls and are told when the connection dies.
        self.bursts: dict[int, object] = {}
        self._reader = threading.Thread(target=self._read_loop, name=f"nnrt-client-{label}",
                                        daemon=True)
        self._reader.start()

    def next_pool_id(self) -> int:
        return next(self._pool_ids)

    # calls

    def _start(self, build, blocking: bool, waiter: _Waiter | None = None) -> _Waiter:
        """Register a waiter (a new one unless given) and send the message
        ``build(call_id)`` returns."""
        if self.dead is not None:
            raise self.dead
        waiter = _Waiter(blocking) if waiter is None else waiter
        with self._send_lock:
            if self.dead is not None:
                raise self.dead
            call_id = waiter.call_id = next(self._call_ids)
            message = build(call_id)
            data, fds = self.proto.send(message)
            with self._pending_lock:
                self._pending[call_id] = (waiter, message.method)
            try:
                self._send(data, fds)
            except OSError as e:
                self._die(f"sending to the service failed: {e}")
        return waiter

    def _send(self, data: bytes, fds: list[int]) -> None:
        view = memoryview(data)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while view:
            sent = self.sock.sendmsg([view], anc, socket.MSG_NOSIGNAL)
            anc = []  # the fds ride with the first bytes only
            view = view[sent:]

    async def call(self, build, on_cancel=None) -> p.Reply:
        """Send ``build(call_id)`` and await its reply. With ``on_cancel``,
        cancelling the awaiting task also cancels the call in the service
        (CANCEL) and waits, shielded and at most ``_CANCEL_GRACE`` seconds,
        for the call's own reply, which the service sends once the driver
        has let go of the request's pools; ``on_cancel(reply)`` then runs
        with that reply (None if it did not come) before the cancellation
        propagates."""
        waiter = self._start(build, blocking=False)
        try:
            return await waiter.wait()
        except BaseException:
            if on_cancel is not None and not waiter.delivered:
                self.send_only(lambda cid: p.Cancel(cid, waiter.call_id))
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(_CANCEL_GRACE):
                        await waiter.wait()
                on_cancel(waiter.reply)
            raise
        finally:
            self._forget(waiter)

    def call_blocking(self, build) -> p.Reply:
        waiter = self._start(build, blocking=True)
        try:
            return waiter.wait_blocking()
        finally:
            self._forget(waiter)

    def send_only(self, build) -> None:
        """Send a call whose reply nobody waits for."""
        if self.dead is not None:
            return
        with self._send_lock:
            if self.dead is not None:
                return
            data, fds = self.proto.send(build(next(self._call_ids)))
            try:
                self._send(data, fds)
            except OSError as e:
                self._die(f"sending to the service failed: {e}")

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.reply is None:  # cancelled: drop the entry, ignore the reply
            with self._pending_lock:
                for k, (w, _m) in list(self._pending.items()):
                    if w is waiter:
                        del self._pending[k]

    # the reader thread

    def _read_loop(self) -> None:
        reason = "the service closed the connection"
        try:
            while True:
                try:
                    data, ancdata, _flags, _ = self.sock.recvmsg(
                        _RECV_SIZE, socket.CMSG_SPACE(p.MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
                except InterruptedError:
                    continue
                except OSError as e:
                    reason = f"the connection to the service failed: {e}"
                    return
                fds = []  # a fenced execution's sync fence comes with its reply
                for level, kind, fd_data in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array.array("i", fd_data[:len(fd_data) - len(fd_data) % 4]))
                if not data:
                    for fd in fds:
                        os.close(fd)
                    return
                self.proto.receive_data(data, fds)
                while True:
                    event = self.proto.next_event()
                    if event is None:
                        break
                    if isinstance(event, p.Malformed):
                        for fd in event.fds:
                            os.close(fd)
                        raise event.error
                    if isinstance(event, (p.GetMemories, p.BurstEnded)):  # from the service
                        self._answer_service_call(event)
                        continue
                    with self._pending_lock:
                        entry = self._pending.pop(event.call_id, None)
                    if entry is not None:
                        entry[0].deliver(event)
        except p.ProtocolError as e:
            reason = f"the service sent a message that does not decode: {e.message}"
        finally:
            for fd in self.proto.take_fds():
                os.close(fd)
            self._die(reason)

    def _die(self, reason: str) -> None:
        with self._pending_lock:
            if self.dead is None:
                self.dead = _dead(f"{self.label}: {reason}")
                vlog("driver", "%s", self.dead.message)
            pending, self._pending = self._pending, {}
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for call_id, (waiter, method) in pending.items():
            waiter.deliver(_dead_reply(call_id, method, self.dead.message))
        with self._pending_lock:
            bursts, self.bursts = self.bursts, {}
        for controller in bursts.values():
            controller.on_channel_dead(self.dead.message)

    # bursts (nnrt.burst.controller)

    def register_burst(self, burst_id: int, controller) -> None:
        """Route GET_MEMORIES for ``burst_id`` to ``controller``; a dead
        channel tells it at once (now, if it is dead already)."""
        with self._pending_lock:
            if self.dead is None:
                self.bursts[burst_id] = controller
                return
        controller.on_channel_dead(self.dead.message)

    def unregister_burst(self, burst_id: int) -> None:
        with self._pending_lock:
            self.bursts.pop(burst_id, None)

    def _answer_service_call(self, call) -> None:
        """Answer from the reader thread: the app's loop may be busy, and the
        burst server waits on GET_MEMORIES to run an execution the app awaits."""
        controller = self.bursts.get(call.burst_id)
        fds = []
        if isinstance(call, p.BurstEnded):
            if controller is not None:
                self.unregister_burst(call.burst_id)
                controller.on_burst_ended(call.reason)
            reply = p.Reply(call.call_id, call.method)
        elif controller is None:
            reply = p.Reply(call.call_id, call.method, ErrorStatus.INVALID_ARGUMENT,
                            f"burst {call.burst_id} is not open on this client")
        else:
            try:
                grants = controller.grant_memories(call.slots)
            except NnrtError as e:
                reply = p.Reply(call.call_id, call.method, e.status, e.message)
            else:
                fds = [g.fd for g in grants]
                reply = p.Reply(call.call_id, call.method, value=tuple(
                    p.WirePool(g.slot, g.fd, g.writable, g.offset, g.size, 0, g.size)
                    for g in grants))
        try:
            with self._send_lock:
                data, send_fds = self.proto.send(reply)
                self._send(data, send_fds)
        except OSError as e:
            self._die(f"sending to the service failed: {e}")
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        self._die("the connection was closed by this client")
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self.sock.close()


def _dead_reply(call_id: int, method: p.Method, message: str) -> p.Reply:
    value = None
    if method == p.Method.EXECUTE:
        value = ExecutionResult(ErrorStatus.DEAD_OBJECT, message=message)
    elif method == p.Method.EXECUTE_FENCED:
        value = p.FencedInfo(ExecutionResult(ErrorStatus.DEAD_OBJECT, message=message),
                             NO_TIMING, NO_TIMING)
    return p.Reply(call_id, method, ErrorStatus.DEAD_OBJECT, message, value)


def _value(reply: p.Reply, what: str):
    if reply.status != ErrorStatus.NONE:
        raise NnrtError(reply.status, reply.message or f"{what} failed")
    return reply.value


class ServiceDevice(Device):
    """A driver service seen through the HAL. Make one with :meth:`connect`."""

    def __init__(self, channel: _Channel, info: p.DeviceInfo, capabilities: Capabilities,
                 extensions: list[str], cache_files: tuple[int, int], socket_path: str):
        self._channel = channel
        self.name = info.name
        self.type = info.type
        self.version_string = info.version_string
        self.feature_level = info.feature_level
        self.socket_path = socket_path
        self._capabilities = capabilities
        self._extensions = list(extensions)
        self._cache_files = tuple(cache_files)

    @classmethod
    async def connect(cls, socket_path: str) -> "ServiceDevice":
        """Connect to the service at ``socket_path`` and learn its answers to
        the device queries. DEVICE_UNAVAILABLE when nobody serves there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path)
        except OSError as e:
            sock.close()
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"no driver service at {socket_path}: {e}") from None
        channel = _Channel(sock, f"driver service at {socket_path}")
        try:
            info = _value(await channel.call(lambda cid: p.Hello(cid)), "HELLO")
            answers = {}
            for method in (p.Method.CAPABILITIES, p.Method.SUPPORTED_EXTENSIONS,
                           p.Method.NUMBER_OF_CACHE_FILES):
                answers[method] = _value(
                    await channel.call(lambda cid, m=method: p.Query(cid, m)), method.name)
        except BaseException:
            channel.close()
            raise
        vlog("driver", "connected to %s (%s) at %s", info.name, info.version_string, socket_path)
        return cls(channel, info, answers[p.Method.CAPABILITIES],
                   answers[p.Method.SUPPORTED_EXTENSIONS],
                   answers[p.Method.NUMBER_OF_CACHE_FILES], socket_path)

    @property
    def alive(self) -> bool:
        """False once the service has died or the proxy was closed."""
        return self._channel.dead is None

    def close(self) -> None:
        """Close the connection; the service releases everything it made for us."""
        self._channel.close()

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def supported_extensions(self) -> list[str]:
        return list(self._extensions)

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        return self._cache_files

    def scheduling(self) -> Scheduling:
        # The service runs its own scheduler in front of its driver.
        return Scheduling(fronted=True)

    async def statistics(self):
        return (await self._statistics()).statistics

    async def finished_jobs(self) -> tuple:
        return (await self._statistics()).jobs

    async def _statistics(self) -> p.StatisticsValue:
        return _value(await self._channel.call(lambda cid: p.Query(cid, p.Method.STATISTICS)),
                      "statistics")

    async def supported_operations(self, model: HalModel) -> list[bool]:
        """Asks the service."""
        wire, staged = _stage_model(model)
        try:
            reply = await self._channel.call(lambda cid: p.SupportedOperations(cid, wire))
        finally:
            for m in staged:
                m.close()
        flags = _value(reply, "supported_operations")
        if len(flags) != len(model.main.operations):
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"{self.name} answered {len(flags)} flags for "
                            f"{len(model.main.operations)} operations")
        return flags

    async def prepare_model(self, model: HalModel,
                            preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache=None, *, app=None) -> "ServicePreparedModel":
        """Prepare ``model`` in the service. ``app`` is not sent: the service
        knows the caller from its socket's peer credentials, not from a claim."""
        try:
            preference = ExecutionPreference(preference)
            priority = Priority(priority)
        except ValueError as e:
            raise invalid(str(e)) from None
        wire, staged = _stage_model(model)
        try:
            reply = await self._channel.call(
                lambda cid: p.PrepareModel(cid, wire, preference, priority, deadline))
        finally:
            for m in staged:
                m.close()
        return ServicePreparedModel(self, _value(reply, "prepare_model"))

    def for_test_prepared_model(self, model_id: int) -> "ServicePreparedModel":
        """A proxy naming prepared model ``model_id`` of the service, made by
        any connection — for tests that check the service refuses it."""
        return ServicePreparedModel(self, model_id)

    def __repr__(self) -> str:
        return f"<ServiceDevice {self.name} at {self.socket_path}{'' if self.alive else ' (dead)'}>"


def _stage_model(model: HalModel) -> tuple[HalModel, list[Memory]]:
    """The model with its constant pools as WirePools: a Memory by its fd,
    anything else copied into a new memfd (closed by the caller after the call)."""
    staged, wire = [], []
    try:
        for pool in model.pools:
            if isinstance(pool, Memory):
                wire.append(p.WirePool(0, pool.fileno(), False, pool.fd_offset, pool.size, 0,
                                       pool.size))
                continue
            raw = memoryview(pool).cast("B")
            if raw.nbytes == 0:
                wire.append(p.WirePool(0, None, False, 0, 0, 0, 0))
                continue
            mem = Memory.create(raw.nbytes, "nnrt-model-pool")
            staged.append(mem)
            mem.view()[:] = raw
            wire.append(p.WirePool(0, mem.fileno(), False, 0, raw.nbytes, 0, raw.nbytes))
    except BaseException:
        for m in staged:
            m.close()
        raise
    return HalModel(model.main, model.referenced, model.operand_values, tuple(wire),
                 model.relax_computation_float32_to_float16, model.extension_prefixes), staged


class _BurstLink(BurstLink):
    """The control messages of a burst, for its controller."""

    def __init__(self, channel: "_Channel", model_id: int):
        self._channel = channel
        self._model_id = model_id

    async def configure(self, fds: list[int]) -> int:
        reply = await self._channel.call(lambda cid: p.ConfigureBurst(cid, self._model_id, fds))
        return _value(reply, "configure_burst")

    def register(self, burst_id: int, controller: BurstController) -> None:
        self._channel.register_burst(burst_id, controller)

    def free_slots(self, burst_id: int, slots: tuple[int, ...]) -> None:
        for start in range(0, len(slots), p.MAX_BURST_SLOTS):
            chunk = slots[start:start + p.MAX_BURST_SLOTS]
            self._channel.send_only(lambda cid, c=chunk: p.FreeBurstSlots(cid, burst_id, c))

    def release(self, burst_id: int) -> None:
        self._channel.unregister_burst(burst_id)
        self._channel.send_only(lambda cid: p.ReleaseBurst(cid, burst_id))


class ServicePreparedModel(PreparedModel):
    """A model prepared in a driver service. ``execute`` is awaitable and
    many may be in flight; ``execute_synchronously`` blocks the calling
    thread (not the service), so call it from a thread, not from a coroutine."""

    def __init__(self, device: ServiceDevice, model_id: int):
        self.device = device
        self.model_id = model_id
        self._channel = device._channel
        # pool id -> weak reference to the Memory the service holds mapped
        # for this prepared model, oldest first. Touched only under the
        # channel's send lock, in the order the service sees the frames.
        self._sent: collections.OrderedDict[int, weakref.ref] = collections.OrderedDict()
        self._ids: weakref.WeakKeyDictionary[Memory, int] = weakref.WeakKeyDictionary()
        self._free_arenas: list[Memory] = []
        self._arena_lock = threading.Lock()
        self._released = False
        # Pool ids sent with fenced calls that failed (appended by the reader
        # thread, applied to _sent under the send lock by _message).
        self._forget_later: list[set[int]] = []

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        plan = self._plan(request)
        if isinstance(plan, ExecutionResult):
            return plan
        def cancelled(reply: p.Reply | None) -> None:
            if reply is not None:       # the service let go of the arena: reuse it
                self._finish(plan, None)

        try:
            reply = await self._channel.call(
                lambda cid: self._message(cid, request, plan, measure, deadline, loop_timeout),
                on_cancel=cancelled)
        except NnrtError as e:
            self._finish(plan, None)
            return ExecutionResult(e.status, message=e.message)
        return self._finish(plan, reply)

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        """A blocking round trip. ``checkpoint`` is not taken: the service's
        own scheduler decides where the execution stops."""
        if checkpoint is not None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="a service execution takes no outside checkpoint")
        plan = self._plan(request)
        if isinstance(plan, ExecutionResult):
            return plan
        try:
            reply = self._channel.call_blocking(
                lambda cid: self._message(cid, request, plan, measure, deadline, loop_timeout))
        except NnrtError as e:
            self._finish(plan, None)
            return ExecutionResult(e.status, message=e.message)
        return self._finish(plan, reply)

    async def execute_fenced(self, task_group, request: Request, wait_for=(),
                             measure: bool = False, deadline: float | None = None,
                             loop_timeout: float | None = None,
                             timeout_after_fence: float | None = None):
        """HAL ``executeFenced`` in the service: the ``wait_for`` fences and a
        result fence made here travel as SCM_RIGHTS; the service waits for the
        inputs, runs the request through its driver and signals the result
        fence. Returns ``(fence, callback)`` as soon as the call is sent, with
        no round trip: the fence may be the ``wait_for`` of the next call at
        once, so a pipeline costs no wait per stage.

        Every pool must be an :class:`nnrt.memory.Memory`: the service reads
        and writes them after this returns, so nothing can be staged through
        a copy. ``task_group`` is not used: the execution lives in the service
        (in the task group of our connection there). A refused call, or the
        service dying first, signals the fence with the error (from this
        client), so nobody waits on it forever."""
        fences = []
        for i, f in enumerate(wait_for):
            if not isinstance(f, SyncFence) or f.closed:
                raise invalid(f"wait_for[{i}] is not an open SyncFence")
            if not f.is_empty:  # an empty fence is already signaled: nothing to send
                fences.append(f)
        if timeout_after_fence is not None and not (
                isinstance(timeout_after_fence, (int, float))
                and not isinstance(timeout_after_fence, bool) and timeout_after_fence >= 0):
            raise invalid(f"timeout_after_fence {timeout_after_fence!r} is not None or "
                          f"a number of seconds >= 0")
        for k, pool in enumerate(request.pools):
            if not isinstance(pool, Memory):
                raise invalid(f"request pool {k} is a {type(pool).__name__}: a fenced execution "
                              f"on a driver service needs nnrt.memory.Memory pools")
        plan = self._plan(request)
        if isinstance(plan, ExecutionResult):
            raise NnrtError(plan.status, plan.message)
        fence = SyncFence.create()
        try:
            # Handles for the caller (who may pass the fence on but not signal
            # it: the service does) and for the callback; the waiter's own
            # (signalable) handle is closed by the reader thread on delivery.
            caller_fence = fence._dup(can_signal=False)
            callback = ServiceFencedCallback(_InfoWaiter(fence.dup(), self, plan),
                                             fence._dup(can_signal=False))

            def build(call_id: int) -> p.ExecuteFenced:
                m = self._message(call_id, request, plan, measure, deadline, loop_timeout)
                return p.ExecuteFenced(m.call_id, m.model_id, m.inputs, m.outputs, m.pools,
                                       m.release, m.measure, m.deadline, m.loop_timeout,
                                       tuple(f.fileno() for f in fences), timeout_after_fence,
                                       fence.fileno())

            self._channel._start(build, blocking=False, waiter=callback._waiter)
        except BaseException:
            self._finish(plan, None)
            raise
        finally:
            fence.close()  # sent (or not): our copies above live on
        return caller_fence, callback

    async def configure_burst(self):
        """A burst session over two shared-memory rings (nnrt.burst.controller):
        after this one round trip, each execution is a ring hand-off."""
        if self._released:
            raise invalid("the prepared model was released")
        return await BurstController.open(self, _BurstLink(self._channel, self.model_id))

    def release(self) -> None:
        """Tell the service to drop this prepared model (and its pools)."""
        if self._released:
            return
        self._released = True
        for burst in list(self._channel.bursts.values()):  # its bursts end with it
            if burst.prepared is self:
                burst.close()
        self._channel.send_only(lambda cid: p.ReleaseModel(cid, self.model_id))
        with self._arena_lock:
            arenas, self._free_arenas = self._free_arenas, []
        for a in arenas:
            a.close()

    # -- pools --------------------------------------------------------------

    def _plan(self, request: Request):
        """Which pools are Memory (by fd or id) and which are staged into an
        arena at which offset; an ExecutionResult when the request cannot go."""
        if self._released:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the prepared model was released")
        if self._channel.dead is not None:
            return ExecutionResult(ErrorStatus.DEAD_OBJECT, message=self._channel.dead.message)
        output_pools = {a.location.pool_index for a in request.outputs
                        if a.location is not None and not a.has_no_value}
        input_pools = {a.location.pool_index for a in request.inputs
                       if a.location is not None and not a.has_no_value}
        staged, total = {}, 0
        for k, pool in enumerate(request.pools):
            if isinstance(pool, Memory):
                if pool.closed:
                    return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                           message=f"request pool {k} is a closed Memory")
                continue
            try:
                raw = memoryview(pool).cast("B")
            except (TypeError, ValueError) as e:
                return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                       message=f"request pool {k} is not a contiguous buffer: {e}")
            if k in output_pools and raw.readonly:
                return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                       message=f"request pool {k} holds an output but is read-only")
            staged[k] = (raw, total)
            total += -(-raw.nbytes // _ALIGN) * _ALIGN
        arena = self._take_arena(total) if total else None
        if arena is not None:
            view = arena.view()
            for k, (raw, base) in staged.items():
                if k in input_pools and raw.nbytes:
                    view[base:base + raw.nbytes] = raw
        return _Plan(staged, arena, output_pools)

    def _message(self, call_id: int, request: Request, plan: "_Plan", measure, deadline,
                 loop_timeout) -> p.Execute:
        # Runs under the channel's send lock: cache decisions happen in
        # the order the service will apply them.
        while self._forget_later:
            for pool_id in self._forget_later.pop():
                self._sent.pop(pool_id, None)
        in_use = {id(x) for x in request.pools if isinstance(x, Memory)}
        if plan.arena is not None:
            in_use.add(id(plan.arena))
        release = []
        for pool_id, ref in list(self._sent.items()):
            mem = ref()
            if mem is None or mem.closed:
                del self._sent[pool_id]
                release.append(pool_id)
        while len(self._sent) >= _CLIENT_CACHE_LIMIT:
            pool_id, ref = next((i, r) for i, r in self._sent.items() if id(r()) not in in_use)
            del self._sent[pool_id]
            mem = ref()
            if mem is not None:
                self._ids.pop(mem, None)
            release.append(pool_id)
        pools = []
        for k, pool in enumerate(request.pools):
            if isinstance(pool, Memory):
                pools.append(self._wire(pool, 0, pool.size, plan))
            else:
                raw, base = plan.staged[k]
                if raw.nbytes == 0:
                    pools.append(p.WirePool(0, None, True, 0, 0, 0, 0))
                else:
                    pools.append(self._wire(plan.arena, base, raw.nbytes, plan))
        return p.Execute(call_id, self.model_id, tuple(request.inputs), tuple(request.outputs),
                         tuple(pools), tuple(release), bool(measure), deadline, loop_timeout)

    def _wire(self, mem: Memory, offset: int, length: int, plan: "_Plan") -> p.WirePool:
        pool_id = self._ids.get(mem)
        if pool_id is None:
            pool_id = self._channel.next_pool_id()
            self._ids[mem] = pool_id
        fd = None
        if pool_id in self._sent:
            self._sent.move_to_end(pool_id)
        elif pool_id not in plan.new_ids:
            self._sent[pool_id] = weakref.ref(mem)
            plan.new_ids.add(pool_id)
            fd = mem.fileno()
        return p.WirePool(pool_id, fd, mem.writable, mem.fd_offset, mem.size, offset, length)

    def _finish(self, plan: "_Plan", reply: p.Reply | None) -> ExecutionResult:
        if reply is None:
            result = None
        elif reply.method == p.Method.EXECUTE:
            result = reply.value
        else:  # the service could not read the call at all
            result = ExecutionResult(reply.status, message=reply.message)
        if result is None or result.status not in (ErrorStatus.NONE,
                                                   ErrorStatus.OUTPUT_INSUFFICIENT_SIZE):
            # The service may not have mapped what we sent with this call:
            # send those fds again next time rather than trust the cache.
            with self._channel._send_lock:
                for pool_id in plan.new_ids:
                    self._sent.pop(pool_id, None)
        if result is not None and result.status == ErrorStatus.NONE and plan.arena is not None:
            view = plan.arena.view()
            for k in plan.output_pools:
                staged = plan.staged.get(k)
                if staged is not None and staged[0].nbytes:
                    raw, base = staged
                    raw[:] = view[base:base + raw.nbytes]
        if plan.arena is not None:
            self._give_back_arena(plan.arena)
        return result

    def _take_arena(self, size: int) -> Memory:
        with self._arena_lock:
            for i, a in enumerate(self._free_arenas):
                if a.size >= size:
                    return self._free_arenas.pop(i)
        return Memory.create(max(4096, 1 << (size - 1).bit_length()), "nnrt-request-arena")

    def _give_back_arena(self, arena: Memory) -> None:
        with self._arena_lock:
            if not self._released and len(self._free_arenas) < _MAX_FREE_ARENAS:
                self._free_arenas.append(arena)
                return
        arena.close()  # its id is released with the next execution


class _InfoWaiter(_Waiter):
    """The EXECUTE_FENCED reply of one fenced execution. Also a thread event,
    so the synchronous ``get_execution_info`` can wait the moment between
    the fence being signaled and the reply arriving; and the owner of a
    signalable handle on the fence, written with the reply's error (from
    the reader thread: an eventfd write) when the service could not."""

    __slots__ = ("arrived", "fence", "prepared", "plan")

    def __init__(self, fence: SyncFence, prepared: "ServicePreparedModel", plan: "_Plan"):
        super().__init__(blocking=False)
        self.arrived = threading.Event()
        self.fence = fence
        self.prepared = prepared
        self.plan = plan

    def deliver(self, reply: p.Reply) -> None:
        failed = reply.status not in (ErrorStatus.NONE, ErrorStatus.OUTPUT_INSUFFICIENT_SIZE)
        if failed:
            # The service may not have mapped what came with the call: send
            # those fds again next time (applied under the send lock).
            self.prepared._forget_later.append(self.plan.new_ids)
        fence, self.fence = self.fence, None
        if fence is not None:
            try:
                # The service signals before replying; an error reply to a fence
                # still ACTIVE means it never took the fence (refused call,
                # malformed frame, dead service).
                if reply.status != ErrorStatus.NONE and fence.poll() is FenceState.ACTIVE:
                    fence.signal_error(reply.status)
            except NnrtError:
                pass  # settled meanwhile: the service got there first
            finally:
                fence.close()
        super().deliver(reply)
        self.arrived.set()


class ServiceFencedCallback:
    """HAL ``IFencedExecutionCallback`` of an execution in a driver service.
    Nothing is available before the fence is signaled (BAD_STATE)."""

    # How long get_execution_info waits for the info reply once the fence is
    # signaled: the service sends it right after signaling, so this only
    # bounds a service that is alive but stuck.
    _INFO_GRACE = 10.0

    def __init__(self, waiter: _InfoWaiter, fence: SyncFence):
        self._waiter = waiter
        self._fence = fence  # our own handle: the waiter's is closed by the reader thread

    @property
    def done(self) -> bool:
        return self._waiter.reply is not None

    def _info(self) -> p.FencedInfo:
        w = self._waiter
        if w.reply is None:
            if self._fence.poll() is FenceState.ACTIVE:
                raise bad_state("the fenced execution's fence is not signaled yet")
            if not w.arrived.wait(self._INFO_GRACE):
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                "the driver service signaled the fence but sent no execution info")
        reply = w.reply
        if not isinstance(reply.value, p.FencedInfo):  # an ERROR reply: the call did not decode
            return p.FencedInfo(ExecutionResult(reply.status, message=reply.message),
                                NO_TIMING, NO_TIMING)
        return reply.value

    def get_execution_info(self) -> tuple[ErrorStatus, Timing, Timing]:
        """``(status, timing_launched, timing_fenced)`` in HAL form (UINT64_MAX
        = not measured); BAD_STATE before the fence is signaled."""
        info = self._info()
        return info.result.status, info.timing_launched, info.timing_fenced

    def get_result(self) -> ExecutionResult:
        """The execution's ``ExecutionResult`` (status, output shapes, its own
        timing, message); BAD_STATE before the fence is signaled."""
        return self._info().result

    async def wait_execution_info(self) -> tuple[ErrorStatus, Timing, Timing]:
        await self._waiter.wait()
        return self.get_execution_info()


class _Plan:
    __slots__ = ("staged", "arena", "output_pools", "new_ids")

    def __init__(self, staged, arena, output_pools):
        self.staged = staged          # pool index -> (user buffer, offset in the arena)
        self.arena = arena
        self.output_pools = output_pools
        self.new_ids: set[int] = set()  # ids whose fd went with this call
