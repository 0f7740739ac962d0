"""The remote HAL's pure parts (nnrt/service/remote/wire.py, the generated
modules, the policy's ``remote`` key): deadlines cross as time left and
land on the receiver's clock; a layout out of bounds or bytes that do not
fit it are INVALID_ARGUMENT; a request's regions cross and come back (a
driver buffer's token alone); the checked-in generated code is what the .proto generates."""
from pathlib import Path

import numpy as np
import pytest

from nnrt.errors import ErrorStatus, NnrtError
from nnrt.hal import ExecutionResult, Request, RequestArgument, Timing
from nnrt.hal.types import OutputShape
from nnrt.memory import DeviceToken
from nnrt.model.graph import DataLocation
from nnrt.qos import SchedulerLoad
from nnrt.qos.policy import Policy, identify
from nnrt.service.remote import nnrt_remote_v1_pb2 as pb
from nnrt.service.remote import wire
from nnrt.service.remote.client import parse_target

ROOT = Path(__file__).resolve().parents[2]
REMOTE = ROOT / "nnrt" / "service" / "remote"


def test_a_deadline_crosses_as_time_left_and_lands_on_the_receivers_clock():
    sent = pb.ExecuteRequest(deadline=wire.remaining(100.25, now=100.0))
    assert sent.deadline.remaining_ns == 250_000_000
    # The receiver's clock reads 7.0 when the message arrives.
    assert wire.deadline_of(pb.ExecuteRequest.FromString(sent.SerializeToString()),
                            now=7.0) == pytest.approx(7.25)
    assert wire.deadline_of(pb.ExecuteRequest(), now=7.0) is None
    passed = pb.ComputeRequest(deadline=wire.remaining(99.0, now=100.0))
    assert wire.deadline_of(passed, now=0.0) == pytest.approx(-1.0)


def test_a_request_crosses_as_its_regions_and_the_outputs_come_back():
    pool = np.zeros(16, np.uint8)
    pool[:4] = [1, 2, 3, 4]
    out_pool = bytearray(8)
    request = Request((RequestArgument(False, DataLocation(0, 0, 4), (1, 4)),
                       RequestArgument(has_no_value=True)),
                      (RequestArgument(False, DataLocation(1, 4, 4)),), (pool, out_pool))
    message = pb.ExecuteRequest(inputs=wire.arguments(request, request.inputs),
                                outputs=wire.arguments(request, request.outputs),
                                input_data=wire.input_data(request))
    inputs, outputs, pools = wire.layout(message.inputs, message.outputs)
    wire.fill_inputs(inputs, pools, message.input_data)
    assert bytes(pools[0]) == b"\x01\x02\x03\x04" and inputs[0].dimensions == (1, 4)
    assert inputs[1].has_no_value and outputs[0].location == DataLocation(1, 0, 4)
    pools[1][:] = b"abcd"
    reply = wire.reply_of(ExecutionResult(ErrorStatus.NONE, (OutputShape((4,)),), Timing(3, 5)),
                          wire.outputs_of(outputs, pools), load=SchedulerLoad(3, 1, 2, 0.004))
    sent = pb.ExecutionReply.FromString(reply.SerializeToString())
    result = wire.result_of(sent)
    assert result == ExecutionResult(ErrorStatus.NONE, (OutputShape((4,)),), Timing(3, 5))
    # The serving device's load rides along (what a pool of hosts picks by).
    assert wire.load_of(sent) == SchedulerLoad(3, 1, 2, 0.004)
    assert wire.load_of(pb.ExecutionReply()) is None
    from nnrt.service.remote.client import _finished
    _finished(request, reply)
    assert bytes(out_pool) == b"\x00" * 4 + b"abcd"


@pytest.mark.parametrize("inputs, data, why", [
    ([pb.Argument(length=4)], [b"abc"], "3 bytes for a region of 4"),
    ([pb.Argument(length=4)], [], "0 input byte strings for 1 inputs"),
    ([pb.Argument(has_no_value=True, length=4)], [b""], "has no value but 4 bytes"),
    ([pb.Argument(length=wire.MAX_MESSAGE + 1)], [b""], "more than"),
    ([pb.Argument(length=1, dimensions=[1] * 65)], [b"x"], "65 dimensions"),
    ([pb.Argument(token=3, length=4)], [b"abcd"], "is driver buffer 3 but has 4 bytes"),
])
def test_a_layout_out_of_bounds_or_bytes_that_do_not_fit_are_invalid(inputs, data, why):
    with pytest.raises(NnrtError) as e:
        layout = wire.layout(inputs, [])
        wire.fill_inputs(layout[0], layout[2], data)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT and why in e.value.message


def test_a_driver_buffer_crosses_as_its_token_and_no_bytes():
    """Memory domains: an argument in a DeviceToken pool is the token
    alone both ways; the server's layout names it by a DeviceToken pool
    that holds no bytes of its own."""
    x = np.arange(4, dtype=np.float32)
    request = Request((RequestArgument(False, DataLocation(0, 0, 0), (4,)),
                       RequestArgument(False, DataLocation(1, 0, 16))),
                      (RequestArgument(False, DataLocation(0, 0, 0)),),
                      (DeviceToken(7), x))
    ins, outs = wire.arguments(request, request.inputs), wire.arguments(request, request.outputs)
    assert [(a.token, a.length) for a in ins] == [(7, 0), (0, 16)] and outs[0].token == 7
    assert wire.input_data(request) == [b"", x.tobytes()]
    inputs, outputs, pools = wire.layout(ins, outs)
    wire.fill_inputs(inputs, pools, wire.input_data(request))
    assert pools[0] == DeviceToken(7) and inputs[0].location == DataLocation(0, 0, 0)
    assert inputs[0].dimensions == (4,) and bytes(pools[1]) == x.tobytes()
    assert outputs[0].location == DataLocation(2, 0, 0) and pools[2] == DeviceToken(7)
    assert wire.outputs_of(outputs, pools) == [b""]
    assert wire.pool_bytes(pools) == 16
    wire.copy_outputs(request, [b""])        # nothing to write for the buffer
    # A buffer is used whole.
    partial = Request(request.inputs, (RequestArgument(False, DataLocation(0, 4, 0)),),
                      request.pools)
    with pytest.raises(NnrtError) as e:
        wire.check_request(partial)
    assert "used whole" in e.value.message


def test_an_unknown_status_from_the_far_end_is_a_general_failure():
    assert wire.result_of(pb.ExecutionReply(status=77)).status == ErrorStatus.GENERAL_FAILURE


def test_targets():
    assert parse_target("grpc://127.0.0.2:5000") == ("127.0.0.2:5000", False)
    assert parse_target("grpcs://h:1") == ("h:1", True)
    assert parse_target("h:1") == ("h:1", True)
    for bad in ("grpc://h", "h:port", ":1"):
        with pytest.raises(NnrtError):
            parse_target(bad)


def test_a_policy_rule_matches_a_remote_app_by_its_verified_name_only():
    policy = Policy.from_toml('[[app]]\nname = "cams"\nremote = "camera"\nweight = 3\n')
    assert policy.settings_for(identify(("remote", "camera"))).weight == 3
    assert policy.settings_for(identify(("remote", "batch"))).name is None
    assert policy.settings_for(identify(("pid", 1))).name is None
    assert identify(("remote", "camera")).describe() == "remote camera"


def test_the_checked_in_modules_are_what_the_proto_generates(tmp_path):
    from grpc_tools import protoc   # in process: protoc is a library call
    assert protoc.main(["protoc", f"-I{ROOT}", f"--python_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}",
                        str(REMOTE / "nnrt_remote_v1.proto")]) == 0
    for name in ("nnrt_remote_v1_pb2.py", "nnrt_remote_v1_pb2_grpc.py"):
        generated = tmp_path / "nnrt" / "service" / "remote" / name
        assert generated.read_text() == (REMOTE / name).read_text(), \
            f"{name} is stale: run scripts/generate-remote-proto"


@pytest.mark.parametrize("location, why", [
    (DataLocation(1, 0, 4), "input 0 is in pool 1 of 1"),
    (DataLocation(0, 14, 4), "bytes [14, 18) of pool 0, which has 16"),
])
def test_a_region_outside_the_pools_is_invalid_before_anything_is_sent(location, why):
    request = Request((RequestArgument(False, location),), (), (bytearray(16),))
    for check in (wire.check_request, wire.input_data):
        with pytest.raises(NnrtError) as e:
            check(request)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT and why in e.value.message


def test_a_deadline_that_is_no_time_is_invalid():
    with pytest.raises(NnrtError) as e:
        wire.remaining(float("nan"))
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert wire.remaining(float("inf")) is None


async def test_in_flight_places_go_in_order_and_a_cancelled_waiter_keeps_none():
    import anyio
    from nnrt.service.remote.client import RemoteStatistics, _Places
    places = _Places(1)
    await places.take()
    order = []

    async def one(k):
        await places.take()
        order.append(k)
        places.give()

    cancelled = anyio.CancelScope()

    async def gives_up():
        with cancelled:
            await places.take()
            order.append("never")

    async with anyio.create_task_group() as tg:
        for task in (lambda: one(1), gives_up, lambda: one(3)):
            tg.start_soon(task)
            await anyio.wait_all_tasks_blocked()
        assert places.statistics() == RemoteStatistics(1, 3, 1)
        cancelled.cancel()
        await anyio.wait_all_tasks_blocked()
        assert places.statistics() == RemoteStatistics(1, 2, 1)
        places.give()
    assert order == [1, 3] and places.statistics() == RemoteStatistics(0, 0, 1)
