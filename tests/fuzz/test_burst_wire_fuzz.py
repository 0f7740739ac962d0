"""Fuzzing the burst decoders: any byte string either parses into a valid
message or raises BurstProtocolError -- never another exception."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnrt.burst.wire import (MAX_LAYOUTS, MAX_RANK, BurstArgument, BurstOutputShape,
                             BurstProtocolError, BurstRequest, BurstResult, BurstRun, decode,
                             decode_frame, decode_request, decode_result, encode_request,
                             encode_result, encode_run)
from nnrt.errors import ErrorStatus

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
dims = st.lists(u32, max_size=MAX_RANK).map(tuple)
seconds = st.none() | st.floats(0, 1e12, allow_nan=False, allow_infinity=False)


@st.composite
def requests(draw):
    slots = tuple(draw(st.lists(u32, max_size=6)))

    def argument():
        if not slots or draw(st.booleans()):
            return BurstArgument(has_no_value=True)
        return BurstArgument(False, draw(st.integers(0, len(slots) - 1)), draw(u64), draw(u64),
                             draw(dims))
    inputs = tuple(argument() for _ in range(draw(st.integers(0, 5))))
    outputs = tuple(argument() for _ in range(draw(st.integers(0, 5))))
    return BurstRequest(draw(u64), inputs, outputs, slots, draw(st.booleans()), draw(seconds),
                        draw(seconds), draw(st.integers(0, MAX_LAYOUTS)))


runs = st.builds(BurstRun, u64, st.integers(1, MAX_LAYOUTS), seconds)


results = st.builds(BurstResult, u64, st.sampled_from(list(ErrorStatus)),
                    st.lists(st.builds(BurstOutputShape, dims, st.booleans()), max_size=5)
                    .map(tuple), u64, u64, st.text(max_size=40))
messages = requests() | runs | results


def encode(message):
    if isinstance(message, BurstRequest):
        return encode_request(message)
    return encode_run(message) if isinstance(message, BurstRun) else encode_result(message)


def parses_or_refuses(data):
    """The contract: a valid message, or BurstProtocolError."""
    for fn in (decode, decode_frame, decode_request, decode_result):
        try:
            message = fn(data)
        except BurstProtocolError:
            continue
        assert isinstance(message, (BurstRequest, BurstRun, BurstResult))
        assert encode(message) == bytes(data)   # what parses is canonical


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_round_trip(message):
    data = encode(message)
    assert decode(data) == message


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes(data):
    parses_or_refuses(data)


@settings(max_examples=200)
@given(st.sampled_from([b"NBRQ\x01\x00", b"NBRS\x01\x00"]), st.binary(max_size=300))
def test_random_bytes_behind_a_valid_magic(prefix, tail):
    parses_or_refuses(prefix + tail)


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_every_truncation_is_refused(message):
    data = encode(message)
    for cut in range(len(data)):
        try:
            decode(data[:cut])
        except BurstProtocolError:
            continue
        raise AssertionError(f"a {cut}-byte prefix of a {len(data)}-byte message parsed")


@settings(max_examples=100)
@given(messages, st.binary(min_size=1, max_size=40))
def test_trailing_garbage_is_refused(message, garbage):
    try:
        decode(encode(message) + garbage)
    except BurstProtocolError:
        return
    raise AssertionError("trailing garbage was accepted")


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.data())
def test_mutated_messages(message, data):
    parses_or_refuses(encode(message))       # cached as it is, then mutated
    raw = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    parses_or_refuses(bytes(raw))

