"""The driver-service control protocol, without I/O: messages, codecs and
connection state in three modules (as h11 keeps its state machine, readers
and writers apart); this package gives them under one name.

Theory of operation
-------------------
A connection carries *frames* both ways over a Unix stream socket::

    frame  = u32 body_length | u8 fd_count | body
    body   = u8 kind (CALL=1, REPLY=2) | u8 method | u64 call_id | payload

Little-endian throughout. ``body_length`` is at most :data:`MAX_FRAME` and
``fd_count`` at most :data:`MAX_FDS`; a frame breaking either cannot be
skipped safely (the byte stream has lost its framing), so the connection is
closed. The fds of a frame travel beside its bytes as SCM_RIGHTS ancillary
data; the kernel delivers them no later than the frame's first byte, so the
receiver queues fds as they arrive and each frame takes ``fd_count`` of them
from the front of the queue.

A frame whose framing is sound but whose body does not decode (unknown kind
or method, truncated payload, an enum value out of range, trailing bytes)
becomes a :class:`Malformed` event: the service answers INVALID_ARGUMENT for
that call id and keeps the connection. Decoding any bytes either returns a
message or raises :class:`ProtocolError` (an ``NnrtError`` with
INVALID_ARGUMENT) — never anything else; every count and length is bounded
by what is left of the frame and by fixed caps (the reader is
:class:`nnrt.wirecodec.Reader`, shared with the burst wire format).

Codecs. Each method has one :class:`Codec` in :data:`CODECS`, the one table
that says how its call and its reply's value cross the wire, which fds its
call carries, and what value an error reply still carries. Encoding and
decoding look the codec up by ``Method``; a new method is one entry here and
one handler in the service.

The client calls, the service replies; a reply names the call id it answers,
and many calls may be in flight at once (replies come in completion order).
The first call is HELLO; the call stream's states and their transitions are
the table :data:`TRANSITIONS`. The one exception to "the client calls" is
:data:`SERVICE_CALLS` (a burst server asking for memories, or telling that a
burst ended): the service numbers those calls itself and the client replies.

State. Everything that decides what goes on the wire lives in the connection
objects, not in the transports: :class:`ClientConnection` numbers calls,
keeps the pending ones (with the caller's opaque token), builds CANCEL for
them, keeps the pool-id cache of each prepared model and the burst registry,
and fails everything pending when the connection dies;
:class:`ServerConnection` keeps the cancel targets of running executions,
its own calls to the client (GET_MEMORIES) and the pools cached for each
prepared model. Neither does I/O or takes a lock: a transport that touches
one from several threads serializes its calls.

Memory pools (the HAL model's constant pools and a request's pools) are
:class:`WirePool` entries. The client numbers each shared memory it sends by
``pool_id`` (0 = not cached) and sends its fd the first time; later
executions of the same prepared model name the id only, and ``release``
lists ids the client has forgotten. Both sides thereby agree on the cache
without the service ever asking: the client's :class:`ClientConnection`
decides, in the order the frames go out, and the service follows.
"""
from .messages import *  # noqa: F401,F403
from .codecs import *  # noqa: F401,F403
from .connection import *  # noqa: F401,F403
