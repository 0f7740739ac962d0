"""The client proxy of a driver service: a :class:`~nnrt.hal.Device`
whose calls go over the service's Unix socket.

Theory of operation
-------------------
This module is the transport only: a socket, SCM_RIGHTS fds and threads.
What goes on the wire and why — call ids, the calls waiting for a reply,
CANCEL, the pool-id cache of each prepared model, the burst registry — is
the sans-I/O :class:`~.protocol.ClientConnection`; the transport feeds it
bytes and sends the frames it makes.

A :class:`ServiceDevice` owns one connection, a :class:`_Channel`. The
connection object is used from the caller's threads and from a reader
thread, so every use of it is under the channel's one lock, which also
fixes the order of the frames (the order in which the pool cache decided).
A caller leaves a *token* with its call — a :class:`~nnrt.handoff.Waiter`
(an asyncio or trio task, or a blocked thread) or a fenced execution's
callback — and the reader thread delivers the reply to it.

Sending never blocks the caller's loop: under the lock a frame is written
with ``MSG_DONTWAIT``; what does not fit in the socket buffer (a large
model, a staged pool) waits in a backlog that a worker thread
(:func:`nnrt.handoff.run_soon`) writes out, blocking there, not here, and
frames behind it queue after it, so the order holds. A backlogged frame
keeps its own duplicates of its fds until sent, since a caller may close
its fds once the call is made.

Why a reader thread rather than a task on the app's loop: the HAL's
``execute_synchronously`` is synchronous, the app may run asyncio or trio,
and a dead service must be noticed even when nobody is awaiting it. The
reader thread sleeps in ``poll`` on the socket; when the service dies (EOF,
ECONNRESET, a reply that does not decode) it fails every pending call with
DEAD_OBJECT at once — executions get an ``ExecutionResult`` with that
status, other calls raise ``NnrtError(DEAD_OBJECT)`` — and every later call
fails the same way without touching the socket. ``close`` fails the calls
and shuts the socket down without waiting for the reader: the last of the
reader and the backlog writer to finish closes the socket.

The reader thread also answers the service's own calls (GET_MEMORIES of a
burst, BURST_ENDED) from the table :data:`_SERVICE_CALL_HANDLERS`: the app's
loop may be parked in the burst's ``execute`` at that moment.

Cancelling the task awaiting ``execute`` sends CANCEL for that call and
waits (shielded, bounded) for the call's own reply: the service sends it once
its driver has let go of the request's pools, so the caller may reuse them
when the cancellation reaches it, as with the in-process device.

Device queries answer the same for a device's whole life, so ``connect``
asks them once and the proxy answers from that copy.

Pools. A request pool that is an :class:`nnrt.memory.Memory` travels by fd
the first time a prepared model sees it and by id after that; any other
pool is staged through an arena (:mod:`nnrt.memory.staging`, shared with the
burst controller), itself a Memory cached by id on the service.

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

import collections
import os
import select
import socket
import threading
import time
import weakref

import anyio

from .. import trace
from ..burst.controller import BurstController, BurstLink
from ..errors import ErrorStatus, NnrtError, bad_state, invalid
from ..fence.outcome import FenceState
from ..fence.sync_fence import SyncFence
from ..handoff import Waiter, run_soon
from ..hal import (Buffer, BufferDesc, Capabilities, Device, Execution, ExecutionPreference,
                    ExecutionResult, FencedCallback, PreparedModel, Request, RequestExecution,
                    Scheduling, Timing)
from ..hal.cache import CacheFiles, CacheRejected
from ..hal.validate import checked_flags
from ..hal.types import AppDeclaration, Priority
from ..memory import DeviceToken, Memory
from ..memory.staging import ArenaPool, Staging, bind, stage
from ..model.graph import HalModel
from ..vlog import vlog
from . import protocol as p
from .mirror import HEADER as MIRROR_HEADER, read_mirror
from .scm import received_fds, rights

_RECV_SIZE = 1 << 16
# Seconds for HELLO and the device queries after connecting (discovery passes
# NNRT_CONNECT_TIMEOUT's value).
CONNECT_TIMEOUT = 5.0
# Seconds any later control call (preparing a model, the queries, allocating
# or copying a driver buffer, configuring a burst) waits for its answer
# (discovery passes NNRT_CALL_TIMEOUT's value; a prepare with a later
# deadline waits until then). A service that stays silent that long is
# taken for dead: every call pending on the connection fails with
# DEAD_OBJECT, and the runtime moves on (the recovery rules), where an
# unbounded wait would hold the app for ever. Executions are bounded by
# their own deadlines, and cancelled by their caller.
CALL_TIMEOUT = 60.0
_MAX_FREE_ARENAS = 8
# How long a cancelled execution waits for the service to let go of its
# pools (it stops at the next operation boundary; a live service answers
# in one operation's time, a dead one at once with DEAD_OBJECT).
_CANCEL_GRACE = 10.0


def _dead(message: str) -> NnrtError:
    return NnrtError(ErrorStatus.DEAD_OBJECT, message)


class _Waiter(Waiter):
    """Where the reply to one call goes: delivered from the reader thread."""

    __slots__ = ()

    @property
    def reply(self) -> p.Reply | None:
        return self.value if self.delivered else None


class _Channel:
    """One connection: its protocol state under one lock, a reader thread,
    and a backlog of frames the socket could not take at once."""

    def __init__(self, sock: socket.socket, label: str, call_timeout: float = CALL_TIMEOUT):
        self.sock = sock
        self.label = label
        self.call_timeout = call_timeout
        self.proto = p.ClientConnection()
        self._lock = threading.Lock()
        self._backlog: collections.deque[tuple[memoryview, list[int]]] = collections.deque()
        self._draining = False
        self._reader_done = False
        self.dead: NnrtError | None = None
        run_soon(self._read_loop)   # a worker of the one thread cache, for the connection's life

    # sending (always under self._lock, so frames go out in the core's order)

    def _send_locked(self, data: bytes, fds) -> None:
        if self._draining:
            self._backlog.append((memoryview(data), [os.dup(fd) for fd in fds]))
            return
        try:
            sent = self.sock.sendmsg([data], rights(fds), socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            # The fds ride with the first bytes: sent already unless nothing was.
            self._backlog.append((memoryview(data)[sent:],
                                  [os.dup(fd) for fd in fds] if sent == 0 else []))
            self._draining = True
            run_soon(self._drain)

    def _drain(self) -> None:
        """On a worker thread: write the backlog out, blocking here."""
        while True:
            with self._lock:
                if not self._backlog or self.dead is not None:
                    dropped, self._backlog = self._backlog, collections.deque()
                    self._draining = False
                    close_socket = self._reader_done
                    break
                view, fds = self._backlog[0]
            try:
                sent = self.sock.sendmsg([view], rights(fds), socket.MSG_NOSIGNAL)
            except InterruptedError:
                continue
            except OSError as e:
                self._die(f"sending to the service failed: {e}")
                continue
            with self._lock:
                for fd in fds:
                    os.close(fd)
                if sent < len(view):
                    self._backlog[0] = (view[sent:], [])
                else:
                    self._backlog.popleft()
        for _view, fds in dropped:
            for fd in fds:
                os.close(fd)
        if close_socket:
            self.sock.close()

    def _start(self, make):
        """``make(proto)`` under the lock (it numbers, encodes and registers
        a call: ``(call_id, frame, fds)``), then send the frame; the call id."""
        failed = None
        with self._lock:
            if self.dead is not None:
                raise self.dead
            call_id, data, fds = make(self.proto)
            trace.instant("client: send")
            try:
                self._send_locked(data, fds)
            except OSError as e:
                failed = e
        if failed is not None:
            self._die(f"sending to the service failed: {failed}")
        return call_id

    def send_only(self, make) -> None:
        """Send the frame ``make(proto)`` returns ``(frame, fds)``; no reply
        awaited. Nothing happens on a dead channel."""
        failed = None
        with self._lock:
            if self.dead is not None:
                return
            made = make(self.proto)
            if made is None:
                return
            try:
                self._send_locked(*made)
            except OSError as e:
                failed = e
        if failed is not None:
            self._die(f"sending to the service failed: {failed}")

    # calls

    async def call(self, build, deadline: float | None = None) -> p.Reply:
        """Send the control call ``build(call_id)`` and await its reply, at
        most ``call_timeout`` seconds (or until ``deadline``, a monotonic
        time, when later): past that the service is taken for dead."""
        bound = self.call_timeout
        if isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
            bound = max(bound, deadline - time.monotonic())   # (the service judges the value)
        with anyio.move_on_after(bound):
            return await self.await_call(lambda proto, token: proto.call(build, token))
        self._die(f"no answer to a control call within {bound:g} s")
        raise self.dead

    async def await_call(self, make, on_cancel=None) -> p.Reply:
        """Send the call ``make(proto, token)`` registers and await its
        reply. With ``on_cancel``, cancelling the awaiting task also cancels
        the call in the service (CANCEL) and waits, shielded and at most
        ``_CANCEL_GRACE`` seconds, for the call's own reply, which the
        service sends once the driver has let go of the request's pools;
        ``on_cancel(reply)`` then runs with that reply (None if it did not
        come) before the cancellation propagates."""
        waiter = _Waiter(blocking=False)
        call_id = self._start(lambda proto: make(proto, waiter))
        try:
            return await waiter.wait()
        except BaseException:
            if on_cancel is not None and not waiter.delivered:
                self.send_only(lambda proto: proto.cancel(call_id))
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(_CANCEL_GRACE):
                        await waiter.wait()
                on_cancel(waiter.reply)
            raise
        finally:
            if not waiter.delivered:
                with self._lock:
                    self.proto.abandon(call_id)

    def call_blocking(self, make) -> p.Reply:
        """The reply to the call ``make(proto, token)`` registers, waiting in
        this thread."""
        waiter = _Waiter(blocking=True)
        self._start(lambda proto: make(proto, waiter))
        return waiter.wait_blocking()

    # the reader thread

    def _read_loop(self) -> None:
        reason = "the service closed the connection"
        # The reader sleeps in poll(POLLIN), not in a blocking recvmsg: a
        # thread asleep in recvmsg is woken also each time the service reads
        # one of our requests (the send buffer's space coming back), for
        # nothing -- a context switch per request that, on a busy machine,
        # preempts whatever ran on that CPU.
        waiter = select.poll()
        waiter.register(self.sock.fileno(), select.POLLIN)
        try:
            while True:
                try:
                    data, ancdata, _flags, _ = self.sock.recvmsg(
                        _RECV_SIZE, socket.CMSG_SPACE(p.MAX_FDS * 4),
                        socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    waiter.poll()     # readable, hung up or shut down: recvmsg says which
                    continue
                except OSError as e:
                    reason = f"the connection to the service failed: {e}"
                    return
                fds = received_fds(ancdata)
                trace.instant("client: received")
                if not data:
                    for fd in fds:
                        os.close(fd)
                    return
                events, error = [], None
                with self._lock:
                    self.proto.receive_data(data, fds)
                    try:
                        while (event := self.proto.next_event()) is not None:
                            events.append(event)
                    except p.ProtocolError as e:
                        error = e
                for event in events:
                    self._dispatch(event)
                if error is not None:
                    raise error
        except p.ProtocolError as e:
            reason = f"the service sent a message that does not decode: {e.message}"
        finally:
            with self._lock:
                leftover = self.proto.take_fds()
                if self.proto.farewell is not None:
                    reason = f"the service closed the connection: {self.proto.farewell}"
            for fd in leftover:
                os.close(fd)
            self._die(reason)
            with self._lock:
                self._reader_done = True
                close_socket = not self._draining
            if close_socket:
                self.sock.close()

    def _dispatch(self, event) -> None:
        if isinstance(event, p.Answer):
            if event.token is not None:
                event.token.deliver(event.reply)
            else:   # nobody waits (abandoned): drop the fds that came with it
                for fd in p.reply_fds_of(event.reply):
                    os.close(fd)
        elif isinstance(event, p.Malformed):
            for fd in event.fds:
                os.close(fd)
            raise event.error
        else:   # a call of the service's (GET_MEMORIES, BURST_ENDED)
            reply, fds = _SERVICE_CALL_HANDLERS[event.method](self, event)
            try:
                self.send_only(lambda proto: proto.send(reply))
            finally:
                for fd in fds:
                    os.close(fd)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = _dead(f"{self.label}: {reason}")
                vlog("driver", "%s", self.dead.message)
            answers = self.proto.fail(self.dead.message)
            bursts, self.proto.bursts = self.proto.bursts, {}
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for answer in answers:
            answer.token.deliver(answer.reply)
        for controller in bursts.values():
            controller.on_channel_dead(self.dead.message)

    # bursts (nnrt.burst.controller)

    def register_burst(self, burst_id: int, controller) -> None:
        """Route GET_MEMORIES for ``burst_id`` to ``controller``; a dead
        channel tells it at once (now, if it is dead already)."""
        with self._lock:
            if self.dead is None:
                self.proto.bursts[burst_id] = controller
                return
        controller.on_channel_dead(self.dead.message)

    def unregister_burst(self, burst_id: int):
        with self._lock:
            return self.proto.bursts.pop(burst_id, None)

    def bursts(self) -> list:
        with self._lock:
            return list(self.proto.bursts.values())

    def close(self) -> None:
        """Fail what is pending and shut the socket down; the reader thread
        closes it (no join: this may run on the app's loop)."""
        self._die("the connection was closed by this client")


def _get_memories(channel: _Channel, call: p.GetMemories) -> tuple[p.Reply, list[int]]:
    """The memories of a burst's slots, from its controller (duplicate fds,
    closed once the reply is sent)."""
    with channel._lock:
        controller = channel.proto.bursts.get(call.burst_id)
    if controller is None:
        return p.error_reply(call.call_id, call.method, ErrorStatus.INVALID_ARGUMENT,
                             f"burst {call.burst_id} is not open on this client"), []
    try:
        grants = controller.grant_memories(call.slots)
    except NnrtError as e:
        return p.error_reply(call.call_id, call.method, e.status, e.message), []
    return p.Reply(call.call_id, call.method, value=tuple(
        p.WirePool(g.slot, g.fd, g.writable, g.offset, g.size, 0, g.size)
        for g in grants)), [g.fd for g in grants]


def _burst_ended(channel: _Channel, call: p.BurstEnded) -> tuple[p.Reply, list[int]]:
    controller = channel.unregister_burst(call.burst_id)
    if controller is not None:
        controller.on_burst_ended(call.reason)
    return p.Reply(call.call_id, call.method), []


_SERVICE_CALL_HANDLERS = {
    p.Method.GET_MEMORIES: _get_memories,
    p.Method.BURST_ENDED: _burst_ended,
}
assert set(_SERVICE_CALL_HANDLERS) == p.SERVICE_CALLS


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _value(reply: p.Reply, what: str):
    if reply.status != ErrorStatus.NONE:
        raise NnrtError(reply.status, reply.message or f"{what} failed")
    return reply.value


class ServiceDevice(Device):
    """A driver service seen through the HAL. Make one with :meth:`connect`."""

    def __init__(self, channel: _Channel, info: p.DeviceInfo, capabilities: Capabilities,
                 extensions: list, cache_files: tuple[int, int], socket_path: str):
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
    async def connect(cls, socket_path: str, *, timeout: float = CONNECT_TIMEOUT,
                      call_timeout: float = CALL_TIMEOUT,
                      app: AppDeclaration | None = None) -> "ServiceDevice":
        """Connect to the service at ``socket_path`` as ``app`` (what this
        process declares: its name and script; default
        ``AppDeclaration.for_process()``) and learn its answers to the device
        queries. DEVICE_UNAVAILABLE when nobody serves there, or
        when whatever listens there does not answer HELLO and the queries
        within ``timeout`` seconds (a socket that accepts and stays silent
        would otherwise hold the caller forever). Every later control call
        waits at most ``call_timeout`` seconds (see :data:`CALL_TIMEOUT`)."""
        for name, value in (("timeout", timeout), ("call_timeout", call_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not value > 0:
                raise invalid(f"{name} {value!r} is not a positive number of seconds")
        app = AppDeclaration.for_process() if app is None else app
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path)
        except OSError as e:
            sock.close()
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"no driver service at {socket_path}: {e}") from None
        channel = _Channel(sock, f"driver service at {socket_path}", call_timeout)
        try:
            answers = {}
            with anyio.move_on_after(timeout) as scope:
                info = _value(await channel.call(lambda cid: p.Hello(cid, app=app)), "HELLO")
                for method in (p.Method.CAPABILITIES, p.Method.SUPPORTED_EXTENSIONS,
                               p.Method.NUMBER_OF_CACHE_FILES):
                    answers[method] = _value(
                        await channel.call(lambda cid, m=method: p.Query(cid, m)), method.name)
            if scope.cancelled_caught:
                raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                                f"the driver service at {socket_path} did not answer within "
                                f"{timeout:g} s")
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

    def supported_extensions(self) -> list:
        return list(self._extensions)

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        return self._cache_files

    def scheduling(self) -> Scheduling:
        # The service runs its own scheduler in front of its driver.
        return Scheduling(fronted=True)

    async def statistics(self):
        return (await self._statistics())[0]

    async def finished_jobs(self) -> tuple:
        return (await self._statistics())[1]

    async def _statistics(self):
        reply = await self._channel.call(lambda cid: p.Query(cid, p.Method.STATISTICS))
        value = _value(reply, "statistics")   # the scheduler's own records (their model: None)
        return value.statistics, value.jobs

    async def supported_operations(self, model: HalModel) -> list[bool]:
        """Asks the service."""
        wire, staged = _stage_model(model)
        try:
            reply = await self._channel.call(lambda cid: p.SupportedOperations(cid, wire))
        finally:
            for m in staged:
                m.close()
        return checked_flags(_value(reply, "supported_operations"), model, self.name)

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
            if cache is None:
                reply = await self._channel.call(
                    lambda cid: p.PrepareModel(cid, wire, preference, priority, deadline),
                    deadline)
            else:   # the cache fds travel beside the call (SCM_RIGHTS)
                reply = await self._channel.call(
                    lambda cid: p.PrepareModelCaching(cid, wire, preference, priority, deadline,
                                                      cache.model, cache.data, cache.token),
                    deadline)
        finally:
            for m in staged:
                m.close()
        return ServicePreparedModel(self, _value(reply, "prepare_model"))

    async def prepare_model_from_cache(self, cache: CacheFiles,
                                       priority: Priority = Priority.MEDIUM,
                                       deadline: float | None = None, *,
                                       app=None) -> "ServicePreparedModel":
        """The service's driver prepares from the cache fds sent with the
        call; its refusal comes back as CacheRejected with its reason."""
        try:
            priority = Priority(priority)
        except ValueError as e:
            raise invalid(str(e)) from None
        reply = await self._channel.call(
            lambda cid: p.PrepareModelFromCache(cid, priority, deadline, cache.model,
                                                cache.data, cache.token), deadline)
        value = reply.value
        if reply.status != ErrorStatus.NONE and value is not None and value.reason is not None:
            raise CacheRejected(value.reason, reply.message.removeprefix(
                f"cache {value.reason.value}: "))
        return ServicePreparedModel(self, _value(reply, "prepare_model_from_cache").model_id)

    async def allocate(self, desc: BufferDesc, prepared_models, input_roles, output_roles, *,
                       app=None) -> tuple["ServiceBuffer", int]:
        """A buffer kept in the service (ALLOCATE); only its token comes
        back. ``app`` is not sent: the service knows the caller."""
        ids = []
        for k, prepared in enumerate(prepared_models):
            if not isinstance(prepared, ServicePreparedModel) or prepared.device is not self \
                    or prepared._released:
                raise invalid(f"allocate: prepared model {k} is not a live model of {self.name}")
            ids.append(prepared.model_id)
        reply = await self._channel.call(lambda cid: p.Allocate(
            cid, tuple(desc.dimensions), tuple(ids), tuple(input_roles), tuple(output_roles)))
        allocated = _value(reply, "allocate")
        return ServiceBuffer(self._channel, allocated.token, allocated.mirror_fd,
                             allocated.mirror_size), allocated.token

    def wire_statistics(self) -> p.WireStatistics:
        """What this connection framed so far (frames, bytes, fds)."""
        with self._channel._lock:
            return self._channel.proto.statistics()

    def for_test_buffer(self, token: int) -> "ServiceBuffer":
        """A proxy naming buffer ``token`` of the service, made by any
        connection — for tests that check the service refuses it."""
        return ServiceBuffer(self._channel, token)

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
    return p.with_pools(model, wire), staged


class ServiceBuffer(Buffer):
    """A driver buffer kept in a service, named by its token. A copy sends
    the fd of a shared memory; the service copies into or out of it. A
    buffer of known size comes with its mirror's fd (see mirror.py), read
    only by :meth:`recover` once the connection is dead."""

    def __init__(self, channel: "_Channel", token: int, mirror_fd: int | None = None,
                 mirror_size: int = 0):
        self._channel = channel
        self.token = token
        self._released = False
        self._mirror_fd = mirror_fd
        self._mirror_nbytes = (mirror_size - MIRROR_HEADER) // 2
        self._finalizer = weakref.finalize(self, _close_fd, mirror_fd)

    def recover(self) -> bytes | None:
        # Only a dead connection's: the service tore the buffer down (or
        # died), so nobody writes the mirror any more.
        if self._mirror_fd is None or self._channel.dead is None \
                or self._finalizer.alive is False or self._mirror_nbytes <= 0:
            return None
        return read_mirror(self._mirror_fd, self._mirror_nbytes)

    async def copy_to(self, memory) -> None:
        await self._copy(p.Method.COPY_TO, memory, ())

    async def copy_from(self, memory, dimensions=()) -> None:
        await self._copy(p.Method.COPY_FROM, memory, tuple(dimensions))

    async def _copy(self, method: p.Method, memory, dimensions) -> None:
        if self._released:
            raise invalid(f"buffer {self.token} was released")
        staged = None
        if isinstance(memory, Memory):
            mem, length = memory, memory.size
        else:   # any other buffer goes through a memfd of its own
            raw = memoryview(memory).cast("B")
            length = raw.nbytes
            staged = mem = Memory.create(max(length, 1), "nnrt-buffer-copy")
            if method == p.Method.COPY_FROM:
                mem.view()[:length] = raw
        try:
            wire = p.WirePool(0, mem.fileno(), mem.writable, mem.fd_offset, mem.size, 0, length)
            _value(await self._channel.call(
                lambda cid: p.CopyBuffer(cid, method, self.token, wire, dimensions)), method.name)
            if staged is not None and method == p.Method.COPY_TO:
                raw[:] = mem.view()[:length]
        finally:
            if staged is not None:
                staged.close()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._finalizer()
        self._channel.send_only(
            lambda proto: proto.notify(lambda cid: p.ReleaseBuffer(cid, self.token)))

    def __repr__(self) -> str:
        return f"<ServiceBuffer {self.token}>"


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
            self._channel.send_only(
                lambda proto, c=chunk: proto.notify(lambda cid: p.FreeBurstSlots(cid, burst_id, c)))

    def release(self, burst_id: int) -> None:
        self._channel.unregister_burst(burst_id)
        self._channel.send_only(
            lambda proto: proto.notify(lambda cid: p.ReleaseBurst(cid, burst_id)))


class ServicePreparedModel(PreparedModel):
    """A model prepared in a driver service. ``execute`` is awaitable and
    many may be in flight; ``execute_synchronously`` blocks the calling
    thread (not the service), so call it from a thread, not from a coroutine."""

    def __init__(self, device: ServiceDevice, model_id: int):
        self.device = device
        self.model_id = model_id
        self._channel = device._channel
        self._arenas = ArenaPool("nnrt-request-arena", _MAX_FREE_ARENAS)
        self._released = False

    def _stage(self, request: Request) -> Staging | ExecutionResult:
        """The request's pools placed in shared memory; an ExecutionResult
        when the request cannot go."""
        if self._released:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the prepared model was released")
        if self._channel.dead is not None:
            return ExecutionResult(ErrorStatus.DEAD_OBJECT, message=self._channel.dead.message)
        try:
            return stage(request.pools, request.inputs, request.outputs, self._arenas)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)

    def _make_execute(self, request: Request, staging: Staging, measure, deadline,
                      loop_timeout, fenced=None):
        return lambda proto, token: proto.execute(
            token, self.model_id, request.inputs, request.outputs, staging.places, measure,
            deadline, loop_timeout, fenced)

    def _finish(self, staging: Staging, reply: p.Reply) -> ExecutionResult:
        if reply.method == p.Method.EXECUTE:
            result = reply.value
        else:  # the service could not read the call at all
            result = ExecutionResult(reply.status, message=reply.message)
        if result.status == ErrorStatus.NONE:
            staging.copy_out()
        staging.finish()
        return result

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        staging = self._stage(request)
        if isinstance(staging, ExecutionResult):
            return staging

        def cancelled(reply: p.Reply | None) -> None:
            # With the reply the service has let go of the arena: reuse it.
            staging.finish(reuse=reply is not None)

        try:
            reply = await self._channel.await_call(
                self._make_execute(request, staging, measure, deadline, loop_timeout),
                on_cancel=cancelled)
        except NnrtError as e:
            staging.finish()
            return ExecutionResult(e.status, message=e.message)
        return self._finish(staging, reply)

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        """A blocking round trip. ``checkpoint`` is not taken: the service's
        own scheduler decides where the execution stops."""
        if checkpoint is not None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="a service execution takes no outside checkpoint")
        staging = self._stage(request)
        if isinstance(staging, ExecutionResult):
            return staging
        try:
            reply = self._channel.call_blocking(
                self._make_execute(request, staging, measure, deadline, loop_timeout))
        except NnrtError as e:
            staging.finish()
            return ExecutionResult(e.status, message=e.message)
        return self._finish(staging, reply)

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
            if not isinstance(pool, (Memory, DeviceToken)):
                raise invalid(f"request pool {k} is a {type(pool).__name__}: a fenced execution "
                              f"on a driver service needs nnrt.memory.Memory pools")
        staging = self._stage(request)
        if isinstance(staging, ExecutionResult):
            raise NnrtError(staging.status, staging.message)
        fence = SyncFence.create()
        try:
            # Handles for the caller (who may pass the fence on but not signal
            # it: the service does) and for the callback, which also keeps a
            # signalable one until the reply (closed by the reader thread).
            caller_fence = fence._dup(can_signal=False)
            callback = ServiceFencedCallback(fence.dup(), fence._dup(can_signal=False))
            fenced = dict(wait_for=tuple(f.fileno() for f in fences),
                          timeout_after_fence=timeout_after_fence, fence=fence.fileno())
            try:
                self._channel._start(lambda proto: self._make_execute(
                    request, staging, measure, deadline, loop_timeout, fenced)(proto, callback))
            except BaseException:
                caller_fence.close()
                callback.close()
                raise
        finally:
            fence.close()  # sent (or not): our copies above live on
        return caller_fence, callback

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None):
        """A reusable execution bound in the service (:class:`ServiceExecution`);
        a request naming driver buffers runs as an EXECUTE each time."""
        if self._released:
            raise invalid("the prepared model was released")
        if any(isinstance(pool, DeviceToken) for pool in request.pools):
            return RequestExecution(self, request, measure, loop_timeout)
        return ServiceExecution(self, request, measure, loop_timeout)

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
        for burst in self._channel.bursts():  # its bursts end with it
            if burst.prepared is self:
                burst.close()
        self._channel.send_only(lambda proto: proto.release_model(self.model_id))
        self._arenas.close()


class ServiceExecution(Execution):
    """A reusable execution of a service's prepared model: the request's
    pools placed once (the numpy ones in an arena of its own, a Memory as
    it is: :func:`nnrt.memory.staging.bind`), created in the service with
    its first computation (CREATE_EXECUTION, every pool's fd with it: the
    service maps them for it alone and binds the request to its driver),
    then computed by id: each COMPUTE carries the id and the deadline, and
    only the pools' bytes move (copied into the arena, and out after a good
    result). An error creating it is its first computation's result (and
    the next one tries again)."""

    def __init__(self, prepared: ServicePreparedModel, request: Request, measure: bool,
                 loop_timeout: float | None):
        self.prepared = prepared
        self.request = request
        self.measure = bool(measure)
        self.loop_timeout = loop_timeout
        self._channel = prepared._channel
        self._pools = bind(request.pools, request.inputs, request.outputs, "nnrt-execution")
        self._id: int | None = None

    def _create(self, proto, token):
        return proto.create_execution(token, self.prepared.model_id, self.request.inputs,
                                      self.request.outputs, self._pools.places, self.measure,
                                      self.loop_timeout)

    def _unusable(self) -> ExecutionResult | None:
        if self._pools is None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the execution was released")
        if self.prepared._released:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the prepared model was released")
        if self._channel.dead is not None:
            return ExecutionResult(ErrorStatus.DEAD_OBJECT, message=self._channel.dead.message)
        return None

    def _created(self, reply: p.Reply) -> ExecutionResult | None:
        if reply.status != ErrorStatus.NONE:
            return ExecutionResult(reply.status, message=reply.message)
        self._id = reply.value
        return None

    def _computed(self, reply: p.Reply) -> ExecutionResult:
        if reply.method == p.Method.COMPUTE:
            result = reply.value
        else:  # the service could not read the call at all
            result = ExecutionResult(reply.status, message=reply.message)
        if result.status == ErrorStatus.NONE:
            self._pools.copy_out()
        return result

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        problem = self._unusable()
        if problem is not None:
            return problem
        try:
            if self._id is None:
                failed = self._created(await self._channel.await_call(self._create))
                if failed is not None:
                    return failed
            self._pools.copy_in()
            execution_id = self._id
            reply = await self._channel.await_call(
                lambda proto, token: proto.compute(token, execution_id, deadline),
                on_cancel=lambda reply: None)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        return self._computed(reply)

    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        """A blocking round trip (from a thread, not a coroutine).
        ``checkpoint`` is not taken: the service's own scheduler decides."""
        if checkpoint is not None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="a service execution takes no outside checkpoint")
        problem = self._unusable()
        if problem is not None:
            return problem
        try:
            if self._id is None:
                failed = self._created(self._channel.call_blocking(self._create))
                if failed is not None:
                    return failed
            self._pools.copy_in()
            execution_id = self._id
            reply = self._channel.call_blocking(
                lambda proto, token: proto.compute(token, execution_id, deadline))
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        return self._computed(reply)

    def release(self) -> None:
        """Release it in the service and close the arena (the service maps
        its own). Idempotent."""
        pools, self._pools = self._pools, None
        if pools is None:
            return
        if self._id is not None:
            execution_id = self._id
            self._channel.send_only(lambda proto: proto.release_execution(execution_id))
        pools.close()

    def __repr__(self) -> str:
        return f"<ServiceExecution {self._id} of model {self.prepared.model_id}>"


class ServiceFencedCallback(FencedCallback):
    """HAL ``IFencedExecutionCallback`` of an execution in a driver service,
    and the token its EXECUTE_FENCED call waits with: the reader thread
    delivers the reply here. Nothing is available before the fence is
    signaled (BAD_STATE).

    It owns a signalable handle on the fence until the reply: an error reply
    to a fence still ACTIVE means the service never took the fence
    (refused call, malformed frame, dead service), so the error is written
    into it here (an eventfd write, from the reader thread) and its waiters
    wake."""

    # How long get_execution_info waits for the info reply once the fence is
    # signaled: the service sends it right after signaling, so this only
    # bounds a service that is alive but stuck.
    _INFO_GRACE = 10.0

    def __init__(self, signalable: SyncFence, fence: SyncFence):
        self._signalable: SyncFence | None = signalable
        self._fence = fence  # our own handle, for polling
        self._waiter = _Waiter(blocking=False)
        self._arrived = threading.Event()   # for the synchronous get_execution_info

    def deliver(self, reply: p.Reply) -> None:
        fence, self._signalable = self._signalable, None
        if fence is not None:
            try:
                if reply.status != ErrorStatus.NONE and fence.poll() is FenceState.ACTIVE:
                    fence.signal_error(reply.status)
            except NnrtError:
                pass  # settled meanwhile: the service got there first
            finally:
                fence.close()
        self._waiter.deliver(reply)
        self._arrived.set()

    def close(self) -> None:
        """Let go of the fence handles (the call never went out)."""
        for fence in (self._signalable, self._fence):
            if fence is not None:
                fence.close()
        self._signalable = None

    @property
    def done(self) -> bool:
        return self._waiter.reply is not None

    def _info(self) -> p.FencedInfo:
        if self._waiter.reply is None:
            if self._fence.poll() is FenceState.ACTIVE:
                raise bad_state("the fenced execution's fence is not signaled yet")
            if not self._arrived.wait(self._INFO_GRACE):
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                "the driver service signaled the fence but sent no execution info")
        reply = self._waiter.reply
        if not isinstance(reply.value, p.FencedInfo):  # an ERROR reply: the call did not decode
            return p.error_reply(reply.call_id, p.Method.EXECUTE_FENCED, reply.status,
                                 reply.message).value
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
