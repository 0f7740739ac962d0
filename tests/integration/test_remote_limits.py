"""Remote apps under the service's limits (issue 42): one ``nnrt driver
serve`` process with ``--socket`` and ``--listen`` counts a remote app's
sessions, prepared models, bursts and kept request bytes against the same
``--limit`` values, per app and service-wide, as its local apps'; and a
remote client that never reads its burst stream stalls that stream alone
(gRPC flow control), the server's memory bounded, other apps served."""
import queue

import grpc
import numpy as np
import pytest

import nnrt
from nnrt.errors import ErrorStatus, NnrtError
from nnrt.service.client import ServiceDevice
from nnrt.service.protocol import encode_model
from nnrt.service.remote import nnrt_remote_v1_pb2 as pb
from nnrt.service.remote import nnrt_remote_v1_pb2_grpc as pb_grpc

from ..conftest import start_remote_service, stop

HOST = "127.0.0.2"   # "another host": loopback, never a routable address
BOUND = 10           # seconds: a guard against a hang, not a timing assertion
TOKENS = {"camera": "0123456789abcdef0123", "batch": "fedcba9876543210fedc"}


def add_model(n: int) -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, n])
    b = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, n])
    act = m.add_operand(nnrt.OperandType.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, n])
    m.add_operation(nnrt.OperationType.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    m.finish()
    return m


class _App:
    """A remote app on a raw channel: its token, its calls, its sessions."""

    def __init__(self, target: str, name: str):
        self.channel = grpc.insecure_channel(target.removeprefix("grpc://"))
        self.stub = pb_grpc.RemoteStub(self.channel)
        self.metadata = (("authorization", f"Bearer {TOKENS[name]}"),)
        self.streams = []

    def session(self) -> int:
        call = self.stub.Session(pb.SessionRequest(), metadata=self.metadata)
        self.streams.append(call)
        return next(call).session

    def prepare(self, session: int, model: nnrt.Model) -> int:
        return self.stub.PrepareModel(pb.PrepareModelRequest(
            session=session, model=encode_model(model.hal_model), priority=100),
            metadata=self.metadata, timeout=BOUND).model_id

    def burst(self, frames):
        call = self.stub.Burst(frames, metadata=self.metadata)
        self.streams.append(call)
        return call

    def close(self) -> None:
        for call in self.streams:
            call.cancel()
        self.channel.close()


def _refused(call) -> str:
    """The details of ``call()``'s RESOURCE_EXHAUSTED (it must be refused so)."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    return e.value.details()


def _frame(session, model_id, serial, n, layout=False, data=b""):
    frame = pb.BurstFrame(session=session, model_id=model_id, serial=serial, layout_id=1)
    arg = pb.Argument(dimensions=[1, n], length=4 * n)
    if layout:
        frame.layout.CopyFrom(pb.Layout(inputs=[arg, arg], outputs=[arg]))
    if data:
        frame.changed.extend([pb.ChangedInput(index=0, data=data),
                              pb.ChangedInput(index=1, data=data)])
    return frame


async def test_remote_apps_count_against_the_per_app_and_service_limits(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    tokens.chmod(0o600)
    sock = tmp_path / "far.sock"
    proc, target = start_remote_service(
        f"{HOST}:0", "reference", "far", "--insecure", "--token-file", str(tokens),
        "--socket", str(sock), "--limit", "connections_per_app=2", "--limit",
        "models_per_app=1", "--limit", "models=3", "--limit", "bursts_per_app=1",
        "--limit", "mapped_bytes_per_app=64")
    camera, batch = _App(target, "camera"), _App(target, "batch")
    local, frames = None, queue.Queue()
    try:
        # Sessions are connections: camera's third is refused, batch is served.
        first, second = camera.session(), camera.session()
        assert "app remote camera holds 2 connections, its limit (connections_per_app=2)" \
            in _refused(camera.session)
        other = batch.session()

        # Models: per app, and service-wide with the local socket's apps.
        model = add_model(4)
        model_id = camera.prepare(first, model)
        assert "app remote camera holds 1 models, its limit (models_per_app=1)" \
            in _refused(lambda: camera.prepare(second, model))
        batch.prepare(other, model)
        local = await ServiceDevice.connect(str(sock))
        await local.prepare_model(model.hal_model)        # the service's third model
        with pytest.raises(NnrtError) as e:
            await local.prepare_model(model.hal_model)
        assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
        assert "the service holds 3 models, its limit (models=3)" in e.value.message

        # Bytes kept between calls: a reusable execution of ADD [1, 4] keeps
        # 48 bytes; a second would be 96 > mapped_bytes_per_app=64.
        arg = pb.Argument(dimensions=[1, 4], length=16)
        create = pb.CreateExecutionRequest(session=first, model_id=model_id,
                                           inputs=[arg, arg], outputs=[arg])
        execution = camera.stub.CreateExecution(create, metadata=camera.metadata,
                                                timeout=BOUND).execution_id
        assert "app remote camera holds 48 mapped_bytes, its limit (mapped_bytes_per_app=64)" \
            in _refused(lambda: camera.stub.CreateExecution(create, metadata=camera.metadata,
                                                            timeout=BOUND))
        camera.stub.ReleaseExecution(pb.ExecutionRef(session=first, execution_id=execution),
                                     metadata=camera.metadata, timeout=BOUND)

        # Bursts: camera's second stream is refused; its first runs on.
        x = np.arange(4, dtype=np.float32).tobytes()
        frames.put(_frame(first, model_id, 1, 4, True, x))
        burst = camera.burst(iter(frames.get, None))   # open until the test ends
        result = next(burst).result
        assert result.status == 0
        assert np.frombuffer(result.output_data[0], np.float32).tolist() == [0, 2, 4, 6]
        assert "app remote camera holds 1 bursts, its limit (bursts_per_app=1)" \
            in _refused(lambda: next(camera.burst(iter([_frame(first, model_id, 1, 4)]))))
    finally:
        frames.put(None)
        camera.close()
        batch.close()
        if local is not None:
            local.close()
        stop(proc)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


async def test_a_client_that_never_reads_its_burst_stalls_its_own_stream_only(tmp_path):
    """A burst of frames each sending 2 MiB of inputs and getting 1 MiB of
    outputs back, never read: the server runs a frame, waits to write its
    result (the client's receive window is full) and reads no further
    frame, so the client's sending stops too. Were the server to run on
    and keep the results, it would hold FRAMES MiB; another app is served
    meanwhile."""
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    tokens.chmod(0o600)
    proc, target = start_remote_service(f"{HOST}:0", "reference", "far", "--insecure",
                                        "--token-file", str(tokens))
    camera, batch = _App(target, "camera"), _App(target, "batch")
    try:
        n, frames = 1 << 18, 100        # 1 MiB a tensor
        session = camera.session()
        model_id = camera.prepare(session, add_model(n))
        before = _rss_bytes(proc.pid)
        sent = []

        def stream():
            for serial in range(frames):
                sent.append(serial)
                yield _frame(session, model_id, serial, n, serial == 0,
                             np.full(n, serial, np.float32).tobytes())
        camera.burst(stream())            # and never read

        # Another app is served meanwhile, as many times as the stream has frames.
        other = batch.session()
        small = batch.prepare(other, add_model(4))
        arg = pb.Argument(dimensions=[1, 4], length=16)
        x = np.arange(4, dtype=np.float32).tobytes()
        for _ in range(frames):
            reply = batch.stub.Execute(pb.ExecuteRequest(
                session=other, model_id=small, inputs=[arg, arg], outputs=[arg],
                input_data=[x, x]), metadata=batch.metadata, timeout=BOUND)
            assert reply.status == 0
            assert np.frombuffer(reply.output_data[0], np.float32).tolist() == [0, 2, 4, 6]
        # The stalled stream took a few frames (what the windows hold), not all.
        assert len(sent) < frames // 2, len(sent)
        grown = _rss_bytes(proc.pid) - before
        assert grown < 64 << 20, f"the server grew by {grown >> 20} MiB"
        # The server is not wedged: the stalled burst's own session still answers.
        assert camera.stub.GetInfo(pb.GetInfoRequest(), metadata=camera.metadata,
                                   timeout=BOUND).name == "far"
    finally:
        camera.close()
        batch.close()
        stop(proc)
