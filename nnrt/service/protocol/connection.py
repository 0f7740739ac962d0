"""The control protocol's connections, without I/O: framing (a frame's fds
taken from the queue as its bytes come), the call stream's state, and what
each side keeps -- the client's call ids, pending calls, pool-id caches and
bursts; the service's cancel targets, its own calls to the client and its
pool cache."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import ErrorStatus
from ...memory import DeviceToken
from ...memory.staging import SlotCache
from .messages import (CLIENT_CACHED_POOLS, MAX_CACHED_POOLS, MAX_FDS, MAX_FRAME,
                       SERVICE_CALLS, Cancel, Compute, CreateExecution, Event, Execute,
                       ExecuteFenced, Hello, Malformed, Method, ProtocolError, ReleaseExecution,
                       ReleaseModel, Reply, State, WirePool, WireToken, _FRAME, transition)
from .codecs import _peek_ids, decode_body, encode, error_reply

@dataclass(frozen=True, slots=True)
class WireStatistics:
    """What one side of a connection framed: whole frames (headers
    included) and the fds beside them. Tensor data never travels in a
    frame (it lives in shared memory or in the driver), which tests assert
    on these counts."""

    frames_sent: int
    bytes_sent: int
    fds_sent: int
    frames_received: int
    bytes_received: int


class Connection:
    """One side of a connection, framing and the call stream only: feed it
    bytes and fds, pull events; ask it to encode what you send. ``role`` is
    "client" or "server". :class:`ClientConnection` and
    :class:`ServerConnection` add the state of calls in flight."""

    def __init__(self, role: str, max_fds: int | None = None, max_frame: int = MAX_FRAME):
        if role not in ("client", "server"):
            raise ValueError(role)
        self.role = role
        self.state = State.IDLE
        self._buffer = bytearray()
        self._fds: list[int] = []
        self._counts = [0, 0, 0, 0, 0]   # WireStatistics, in its field order
        # What the peer may make us hold: fds no frame has claimed yet, and
        # the bytes of a frame (at most MAX_FRAME, the protocol's own cap).
        self.max_fds = max_fds
        self.max_frame = min(max_frame, MAX_FRAME)

    @property
    def held(self) -> tuple[int, int]:
        """``(fds, bytes)`` received and not yet handed out with a message:
        the unclaimed fds and the bytes of an unfinished frame."""
        return len(self._fds), len(self._buffer)

    # receiving

    def receive_data(self, data: bytes, fds=()) -> None:
        """Bytes (and the fds that came with them) from the peer; b"" = EOF."""
        if not data and not fds:
            self.state = transition(self.state, Event.CLOSE)
            return
        self._buffer += data
        self._fds.extend(fds)

    def next_event(self):
        """The next complete message (a Call on the server, a Reply on the
        client), a :class:`Malformed` frame, or None when more bytes are
        needed. Raises :class:`ProtocolError` when the framing is broken;
        the connection is then CLOSED (its queued fds are returned by
        :meth:`take_fds`)."""
        if self.state is State.CLOSED and not self._buffer:
            return None
        if len(self._buffer) < _FRAME.size:
            self._check_fds()
            return None
        length, nfds = _FRAME.unpack_from(self._buffer)
        if length > MAX_FRAME or nfds > MAX_FDS:
            self.state = State.CLOSED
            raise ProtocolError(f"frame of {length} bytes with {nfds} fds exceeds the limits "
                                f"({MAX_FRAME} bytes, {MAX_FDS} fds)")
        if length > self.max_frame:
            self.state = State.CLOSED
            raise ProtocolError(f"frame of {length} bytes exceeds this connection's limit of "
                                f"{self.max_frame} bytes", ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT)
        if len(self._buffer) < _FRAME.size + length:
            self._check_fds()
            return None
        if nfds > len(self._fds):
            self.state = State.CLOSED
            raise ProtocolError(f"frame announces {nfds} fds, {len(self._fds)} arrived")
        body = bytes(self._buffer[_FRAME.size:_FRAME.size + length])
        del self._buffer[:_FRAME.size + length]
        self._counts[3] += 1
        self._counts[4] += _FRAME.size + length
        fds, self._fds = self._fds[:nfds], self._fds[nfds:]
        try:
            message = decode_body(body, fds)
        except ProtocolError as e:
            call_id, method = _peek_ids(body)
            return Malformed(call_id, method, e, tuple(fds))
        if self.role == "server":
            if isinstance(message, Reply) and message.method in SERVICE_CALLS:
                return message    # the client answering a call of ours
            if isinstance(message, Reply):
                return Malformed(message.call_id, message.method,
                                 ProtocolError("a service does not take replies"), tuple(fds))
            event = Event.HELLO if isinstance(message, Hello) else Event.CALL
            try:
                self.state = transition(self.state, event)
            except ProtocolError as e:
                return Malformed(message.call_id, message.method, e, tuple(fds))
        elif not isinstance(message, Reply) and message.method not in SERVICE_CALLS:
            return Malformed(message.call_id, message.method,
                             ProtocolError("a client does not take calls"), tuple(fds))
        return message

    def _check_fds(self) -> None:
        # Checked when no complete frame is left: a well-behaved peer's fds
        # arrive with its frames' first bytes, so only fds sent beyond what
        # its frames claim (or ahead of a frame that never comes) pile up.
        if self.max_fds is not None and len(self._fds) > self.max_fds:
            self.state = State.CLOSED
            raise ProtocolError(f"{len(self._fds)} fds received that no frame claims, more "
                                f"than this connection's limit of {self.max_fds}",
                                ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT)

    def drop_buffer(self) -> int:
        """Forget the bytes of an unfinished frame (the connection is
        closing); how many there were."""
        held, self._buffer = len(self._buffer), bytearray()
        return held

    def take_fds(self) -> list[int]:
        """Fds received but not handed out with a message (close them)."""
        fds, self._fds = self._fds, []
        return fds

    # sending

    def send(self, message) -> tuple[bytes, list[int]]:
        """The frame for ``message`` and the fds to send beside it."""
        if self.role == "client":
            if isinstance(message, Reply):
                if message.method not in SERVICE_CALLS:
                    raise ProtocolError("a client sends replies only to the service's calls")
            else:
                event = Event.HELLO if isinstance(message, Hello) else Event.CALL
                self.state = transition(self.state, event)
        elif not isinstance(message, Reply) and message.method not in SERVICE_CALLS:
            raise ProtocolError("a service sends only replies and service calls")
        data, fds = encode(message)
        self._counts[0] += 1
        self._counts[1] += len(data)
        self._counts[2] += len(fds)
        return data, fds

    def statistics(self) -> WireStatistics:
        """Frames, bytes and fds this side sent and received so far."""
        return WireStatistics(*self._counts)

    def close(self) -> None:
        self.state = transition(self.state, Event.CLOSE)


@dataclass(frozen=True, slots=True)
class Answer:
    """A reply to one of our own calls, with the token its caller left when
    it made the call (None: nobody waits for it any more)."""

    token: Any
    reply: Reply


@dataclass(slots=True)
class _Pending:
    token: Any
    method: Method
    model_id: int = 0
    new_pools: tuple[int, ...] = ()   # pool ids whose fd went with this call


class _ModelPools:
    """The client's pool cache of one prepared model: the ids of the
    Memories it sent, and which of them the service holds mapped."""

    __slots__ = ("slots", "held")

    def __init__(self):
        self.slots = SlotCache()
        self.held: set[int] = set()


_KEEPS_POOLS = (ErrorStatus.NONE, ErrorStatus.OUTPUT_INSUFFICIENT_SIZE)


class ClientConnection(Connection):
    """The client's side: calls are numbered here and wait here (with the
    caller's token) until their reply; pool ids are decided here, in the
    order the frames go out, so both sides agree on the service's cache."""

    def __init__(self):
        super().__init__("client")
        self._call_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._pools: dict[int, _ModelPools] = {}
        self.bursts: dict[int, Any] = {}   # burst id -> the controller answering for it
        self.dead: str | None = None       # why the connection ended
        # What the service said when it closed the connection on us (an
        # ERROR reply to call id 0: a broken frame, a limit, a refusal).
        self.farewell: str | None = None

    def call(self, build: Callable[[int], Any], token) -> tuple[int, bytes, list[int]]:
        """Number the call ``build(call_id)`` makes and keep ``token`` until
        its reply: ``(call_id, frame, fds)``."""
        call_id = next(self._call_ids)
        message = build(call_id)
        data, fds = self.send(message)
        self._pending[call_id] = _Pending(token, message.method)
        return call_id, data, fds

    def notify(self, build: Callable[[int], Any]) -> tuple[bytes, list[int]]:
        """A call whose reply nobody waits for."""
        return self.send(build(next(self._call_ids)))

    def cancel(self, call_id: int) -> tuple[bytes, list[int]] | None:
        """CANCEL of call ``call_id``, None if it is answered already."""
        if call_id not in self._pending:
            return None
        return self.notify(lambda cid: Cancel(cid, call_id))

    def abandon(self, call_id: int) -> None:
        """The caller stopped waiting for ``call_id``: its reply will be dropped."""
        entry = self._pending.pop(call_id, None)
        if entry is not None:
            self._forget_new_pools(entry)

    def execute(self, token, model_id: int, inputs, outputs, places, measure: bool,
                deadline, loop_timeout, fenced: dict | None = None
                ) -> tuple[int, bytes, list[int]]:
        """EXECUTE (or, with ``fenced`` = the extra fields, EXECUTE_FENCED)
        of the request whose pools lie at ``places`` (``Place``s; None for an
        empty pool). Pools pass by fd the first time this prepared model
        sees them and by id afterwards; closed, collected and evicted ones
        are released with this call."""
        cache = self._pools.setdefault(model_id, _ModelPools())
        release = cache.slots.take_freed()
        in_use = {cache.slots.slot(place.memory) for place in places
                  if place is not None and not isinstance(place, DeviceToken)}
        release += cache.slots.evict(CLIENT_CACHED_POOLS, in_use)
        release = [s for s in release if s in cache.held]
        cache.held.difference_update(release)
        pools, new = [], []
        for place in places:
            if place is None:
                pools.append(WirePool(0, None, True, 0, 0, 0, 0))
                continue
            if isinstance(place, DeviceToken):   # a driver buffer: only its token travels
                pools.append(WireToken(place.token))
                continue
            mem = place.memory
            pool_id = cache.slots.slot(mem)
            fd = None
            if pool_id not in cache.held:
                cache.held.add(pool_id)
                new.append(pool_id)
                fd = mem.fileno()
            pools.append(WirePool(pool_id, fd, mem.writable, mem.fd_offset, mem.size,
                                  place.offset, place.length))
        call_id = next(self._call_ids)
        fields = (call_id, model_id, tuple(inputs), tuple(outputs), tuple(pools),
                  tuple(release), bool(measure), deadline, loop_timeout)
        message = Execute(*fields) if fenced is None else ExecuteFenced(*fields, **fenced)
        try:
            data, fds = self.send(message)
        except BaseException:
            cache.held.difference_update(new)
            raise
        self._pending[call_id] = _Pending(token, message.method, model_id, tuple(new))
        return call_id, data, fds

    def create_execution(self, token, model_id: int, inputs, outputs, places, measure: bool,
                         loop_timeout) -> tuple[int, bytes, list[int]]:
        """CREATE_EXECUTION of the request whose pools lie at ``places``
        (``Place``s of Memories, None for an empty pool): each pool's fd goes
        with it, for the execution alone (pool id 0, not the prepared
        model's cache)."""
        pools = tuple(WirePool(0, None, True, 0, 0, 0, 0) if place is None else
                      WirePool(0, place.memory.fileno(), place.memory.writable,
                               place.memory.fd_offset, place.memory.size, place.offset,
                               place.length)
                      for place in places)
        return self.call(lambda cid: CreateExecution(cid, model_id, tuple(inputs),
                                                     tuple(outputs), pools, (), bool(measure),
                                                     None, loop_timeout), token)

    def compute(self, token, execution_id: int, deadline) -> tuple[int, bytes, list[int]]:
        return self.call(lambda cid: Compute(cid, execution_id, deadline), token)

    def release_execution(self, execution_id: int) -> tuple[bytes, list[int]]:
        return self.notify(lambda cid: ReleaseExecution(cid, execution_id))

    def release_model(self, model_id: int) -> tuple[bytes, list[int]]:
        """RELEASE_MODEL; the model's pool cache goes with it."""
        self._pools.pop(model_id, None)
        return self.notify(lambda cid: ReleaseModel(cid, model_id))

    def _forget_new_pools(self, entry: _Pending) -> None:
        # The service may not have mapped what came with a call that failed
        # (or that nobody waits for): send those fds again next time.
        cache = self._pools.get(entry.model_id)
        if cache is not None:
            cache.held.difference_update(entry.new_pools)

    def next_event(self):
        """As :meth:`Connection.next_event`, a reply to a call of ours as an
        :class:`Answer`."""
        event = super().next_event()
        if isinstance(event, Reply):
            entry = self._pending.pop(event.call_id, None)
            if entry is None:
                if event.call_id == 0 and event.method is Method.ERROR:
                    self.farewell = event.message
                return Answer(None, event)
            if entry.new_pools and event.status not in _KEEPS_POOLS:
                self._forget_new_pools(entry)
            return Answer(entry.token, event)
        return event

    def fail(self, message: str) -> list[Answer]:
        """The connection died: every pending call's DEAD_OBJECT reply, with
        its token. Later calls must not be made (``dead`` says why)."""
        if self.dead is None:
            self.dead = message
        pending, self._pending = self._pending, {}
        return [Answer(e.token, error_reply(call_id, e.method, ErrorStatus.DEAD_OBJECT,
                                            self.dead))
                for call_id, e in pending.items()]


_CANCELLABLE = (Method.EXECUTE, Method.COMPUTE)   # (not fenced: its fence settles it)


class ServerConnection(Connection):
    """The service's side: the cancel targets of running executions, its
    own calls to the client (GET_MEMORIES, BURST_ENDED) awaiting a reply,
    the request pools cached for each prepared model, and the bursts open
    on this connection. ``max_fds`` and ``max_frame`` bound what the client
    can make the service hold (see :meth:`Connection.next_event`).

    Cancel targets. An EXECUTE (or COMPUTE) is a cancel target from the moment it is
    decoded, before any handler runs: its handler registers its cancel
    handle later (:meth:`running`), and a CANCEL that arrives in between is
    recorded and applied then, never lost. Invariant: ``_running`` holds
    exactly the EXECUTEs and COMPUTEs decoded and not yet :meth:`finished` (the
    transport calls ``finished`` for every call it took, refused or not),
    and ``_cancelled`` is a subset of its keys; so both are bounded by the
    calls in flight (``test_protocol.py::test_cancel_before_registration``).
    """

    def __init__(self, max_fds: int | None = None, max_frame: int = MAX_FRAME):
        super().__init__("server", max_fds, max_frame)
        self.bursts: dict[int, Any] = {}        # burst id -> the task serving it
        self._running: dict[int, Any] = {}      # EXECUTE call id -> its cancel handle or None
        self._cancelled: set[int] = set()       # cancelled before their handle was registered
        self._call_ids = itertools.count(1)     # ids of our calls to the client
        self._pending: dict[int, Any] = {}      # our call id -> the caller's token
        self._pools: dict[int, dict[int, Any]] = {}   # model id -> pool id -> mapped pool

    # cancel targets

    def running(self, call_id: int, handle) -> bool:
        """EXECUTE ``call_id`` runs; ``handle`` is what CANCEL cancels. True
        when a CANCEL came first: the caller cancels ``handle`` at once."""
        self._running[call_id] = handle
        cancelled = call_id in self._cancelled
        self._cancelled.discard(call_id)
        return cancelled

    def finished(self, call_id: int) -> None:
        """Call ``call_id`` is answered (any method; a no-op unless EXECUTE or COMPUTE)."""
        self._running.pop(call_id, None)
        self._cancelled.discard(call_id)
        assert self._cancelled <= self._running.keys()

    def cancel_target(self, cancel: Cancel):
        """The handle CANCEL names, or None: not registered yet (the CANCEL
        is kept for :meth:`running`), or unknown or finished (ignored)."""
        if cancel.target not in self._running:
            return None
        handle = self._running[cancel.target]
        if handle is None:
            self._cancelled.add(cancel.target)
        return handle

    # our calls to the client

    def call(self, build: Callable[[int], Any], token) -> tuple[int, bytes, list[int]]:
        call_id = next(self._call_ids)
        data, fds = self.send(build(call_id))
        self._pending[call_id] = token
        return call_id, data, fds

    def notify(self, build: Callable[[int], Any]) -> tuple[bytes, list[int]]:
        return self.send(build(next(self._call_ids)))

    def abandon(self, call_id: int) -> None:
        self._pending.pop(call_id, None)

    def next_event(self):
        event = super().next_event()
        if isinstance(event, Reply):
            return Answer(self._pending.pop(event.call_id, None), event)
        if isinstance(event, (Execute, Compute)) and event.method in _CANCELLABLE:
            self._running.setdefault(event.call_id, None)
        return event

    def reply(self, reply: Reply) -> tuple[bytes, list[int]]:
        """The frame of ``reply``; one too big for a frame becomes an ERROR."""
        try:
            return self.send(reply)
        except ProtocolError as e:
            return self.send(Reply(reply.call_id, Method.ERROR, ErrorStatus.GENERAL_FAILURE,
                                   e.message))

    # the pool cache

    def cached_pool(self, model_id: int, pool_id: int):
        return self._pools.get(model_id, {}).get(pool_id)

    def cache_pool(self, model_id: int, pool_id: int, pool) -> list:
        """Keep ``pool`` as ``pool_id`` of ``model_id``; the pools it
        replaces (the caller closes them). ProtocolError beyond
        :data:`MAX_CACHED_POOLS`."""
        pools = self._pools.setdefault(model_id, {})
        old = pools.pop(pool_id, None)
        if len(pools) >= MAX_CACHED_POOLS:
            raise ProtocolError(f"more than {MAX_CACHED_POOLS} pools cached for one "
                                f"prepared model; release some")
        pools[pool_id] = pool
        return [] if old is None else [old]

    def release_pools(self, model_id: int, pool_ids) -> list:
        """Forget ``pool_ids`` of ``model_id``; the pools (the caller closes them)."""
        pools = self._pools.get(model_id, {})
        return [m for m in (pools.pop(i, None) for i in pool_ids) if m is not None]

    def drop_model(self, model_id: int) -> list:
        """Forget every pool of ``model_id``; the pools (the caller closes them)."""
        return list(self._pools.pop(model_id, {}).values())


__all__ = ["Answer", "ClientConnection", "Connection", "ServerConnection", "WireStatistics"]
