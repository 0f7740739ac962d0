"""Remote driver services (issue 42): ``nnrt driver serve --listen`` as a
real process on a loopback address (127.0.0.2 stands for another host),
reached through ``RemoteDevice`` and ``Runtime(remote=...)``: models run
there as in process, TLS and tokens decide who may call and which app a
caller is, and a killed or stopped server ends every pending call with
DEAD_OBJECT (the runtime then reruns on the CPU)."""
import datetime
import ipaddress
import os
import signal
import subprocess
import sys

import anyio
import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

import nnrt
from nnrt.service.client import ServiceDevice
from nnrt.service.remote import nnrt_remote_v1_pb2 as pb
from nnrt.service.remote import nnrt_remote_v1_pb2_grpc as pb_grpc
from nnrt.service.remote import wire
from nnrt.service.remote.client import (ClientTls, RemoteDevice, RemoteRefused,
                                        RemoteStatistics)

from ..conftest import MODELS, start_remote_service, stop
from .test_qos_inprocess import DIMS, chain_model

HOST = "127.0.0.2"   # "another host": loopback, never a routable address
BOUND = 10           # seconds: a guard against a hang, not a timing assertion


@pytest.fixture
def remote_service():
    """A factory: ``remote_service(*flags, kind=..., env=...)`` starts ``nnrt driver
    serve --listen 127.0.0.2:0`` and gives ``(process, target)``; stopped at
    the end of the test."""
    started = []

    def start(*extra, kind="reference", name="far", listen=f"{HOST}:0", env=None):
        proc, target = start_remote_service(listen, kind, name, *extra, env=env)
        started.append(proc)
        return proc, target
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        stop(proc)


def add_model() -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(nnrt.OperandType.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
    m.add_operation(nnrt.OperationType.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    m.finish()
    return m


# -- certificates made here ----------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class _CA:
    def __init__(self, cn: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = self._sign(_name(cn), self.key.public_key(), ca=True)
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def _sign(self, subject, public_key, ca=False, ip=None):
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(subject if ca else self.cert.subject)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ip is not None:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                critical=False)
        return builder.sign(self.key, hashes.SHA256())

    def issue(self, cn: str, ip=None) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for ``cn`` (and an IP address SAN)."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign(_name(cn), key.public_key(), ip=ip)
        return cert.public_bytes(serialization.Encoding.PEM), _pem(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the server's certificate for 127.0.0.2, client certificates
    "camera" and "batch", and one "intruder" signed by another CA; as files."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other = _CA("nnrt test CA"), _CA("someone else's CA")
    files = {"ca": ca.pem}
    files["server"], files["server.key"] = ca.issue("far", ip=HOST)
    for cn in ("camera", "batch"):
        files[cn], files[f"{cn}.key"] = ca.issue(cn)
    files["intruder"], files["intruder.key"] = other.issue("camera")
    paths = {}
    for name, data in files.items():
        paths[name] = folder / f"{name}.pem"
        paths[name].write_bytes(data)
    return paths


def _tls(pki, who=None) -> ClientTls:
    if who is None:
        return ClientTls(pki["ca"].read_bytes())
    return ClientTls(pki["ca"].read_bytes(), pki[who].read_bytes(),
                     pki[f"{who}.key"].read_bytes())


# -- running models ------------------------------------------------------------------

async def test_models_run_on_a_remote_device_as_in_process(remote_service):
    _, target = remote_service("--insecure")
    device = await RemoteDevice.connect(target)
    try:
        assert device.name == "far" and device.alive
        async with nnrt.Runtime(devices=[device], strict=True) as rt:
            compiled = await rt.compile(add_model())
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            result = await compiled.execute([x, x + 1])
            np.testing.assert_array_equal(result.outputs[0], 2 * x + 1)
            # A reusable execution: bound once there, inputs sent per compute.
            frame = np.zeros((1, 4), np.float32)
            execution = compiled.create_execution([frame, x], reusable=True)
            for k in range(3):
                frame[:] = k
                np.testing.assert_array_equal((await execution.compute()).outputs[0], x + k)
            # The remote burst: frames on one stream, only changed inputs sent.
            async with compiled.burst() as burst:
                for k in range(3):
                    result = await burst.execute([x + k, x])
                    np.testing.assert_array_equal(result.outputs[0], 2 * x + k)
                frame[:] = 7
                computed = await burst.compute(execution)
                np.testing.assert_array_equal(computed.outputs[0], x + 7)

            path = MODELS / "generated/mobilenet_v1_0.25_128_float32.tflite"
            model = nnrt.tflite.load(path)
            image = np.random.default_rng(1).random((1, 128, 128, 3), dtype=np.float32)
            far = await (await rt.compile(model)).execute([image])
        async with nnrt.Runtime(discover=False, litert=False) as local:
            near = await (await local.compile(model)).execute([image])
        # The same reference driver on both ends: the same bytes.
        np.testing.assert_array_equal(far.outputs[0], near.outputs[0])
    finally:
        device.close()


async def test_health_reflection_and_messages_that_are_refused(remote_service):
    _, target = remote_service("--insecure")
    with grpc.insecure_channel(target.removeprefix("grpc://")) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "nnrt.remote.v1.Remote"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=BOUND)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert "nnrt.remote.v1.Remote" in ProtoReflectionDescriptorDatabase(channel).get_services()

        remote = pb_grpc.RemoteStub(channel)
        session_call = remote.Session(pb.SessionRequest())
        session = next(session_call).session
        # Model bytes that do not decode, a model id never made, a message
        # over the size bound: each refused, the server serves on.
        with pytest.raises(grpc.RpcError) as e:
            remote.PrepareModel(pb.PrepareModelRequest(session=session, model=b"\x07" * 40,
                                                       priority=100), timeout=BOUND)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not decode" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            remote.Execute(pb.ExecuteRequest(session=session, model_id=12345), timeout=BOUND)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            remote.SupportedOperations(pb.ModelBytes(session=session,
                                                     model=bytes(wire.MAX_MESSAGE + (2 << 20))),
                                       timeout=BOUND)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            remote.ReleaseModel(pb.ModelRef(session=session + 1000, model_id=1), timeout=BOUND)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert remote.GetInfo(pb.GetInfoRequest(), timeout=BOUND).name == "far"
        session_call.cancel()


async def test_a_configured_remote_device_is_listed_the_cpu_reruns_when_it_dies_and_it_returns(
        remote_service, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    # A remote LiteRT device, and a model with work enough to be worth its
    # round trip (60 ADDs of 512x512: partitioning weighs the trip).
    proc, target = remote_service("--insecure", kind="litert")
    monkeypatch.setenv("NNRT_DRIVERS", f"/nowhere/a.sock,{target}")
    async with nnrt.Runtime(litert=False) as rt:
        unreachable, up = rt.services
        assert unreachable.state == "unreachable" and str(up) == f"{target}: up (far)"
        compiled = await rt.compile(chain_model(60))
        assert [d.name for d in compiled.devices] == ["far"], compiled.placement
        x = np.random.default_rng(0).random(DIMS, dtype=np.float32)
        expected = (await compiled.execute([x])).outputs[0]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with anyio.fail_after(BOUND):
            rerun = await compiled.execute([x])
        np.testing.assert_array_equal(rerun.outputs[0], expected)
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]
        assert rt.services[1].state == "unreachable"
        # The host comes back on its address: the model moves back to it.
        remote_service("--insecure", kind="litert", listen=target.removeprefix("grpc://"))
        for _ in range(50):
            await anyio.sleep(0.2)
            np.testing.assert_array_equal((await compiled.execute([x])).outputs[0], expected)
            if [d.name for d in compiled.devices] == ["far"]:
                break
        assert [d.name for d in compiled.devices] == ["far"]
        assert rt.services[1].state == "up"


# -- failures ------------------------------------------------------------------------

async def _pending_call_outcomes(device, proc, then):
    """Stop the server (SIGSTOP), start an execution and a burst frame (they
    can only be pending), then ``then()``: their statuses."""
    async with nnrt.Runtime(devices=[device], strict=True) as rt:
        compiled = await rt.compile(add_model())
        x = np.ones((1, 4), np.float32)
        await compiled.execute([x, x])
        async with compiled.burst() as burst:
            await burst.execute([x, x])
            proc.send_signal(signal.SIGSTOP)
            outcomes = []

            async def run(execute):
                try:
                    outcomes.append((await execute([x, x])).status)
                except nnrt.NnrtError as e:
                    outcomes.append(e.status)

            with anyio.fail_after(BOUND):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run, compiled.execute)
                    tg.start_soon(run, burst.execute)
                    await anyio.sleep(0.2)
                    then()
        return outcomes


async def test_a_killed_server_ends_a_pending_call_with_dead_object(remote_service):
    proc, target = remote_service("--insecure")
    # The keepalive bound is far longer than the wait below: the death
    # comes from the reset connection.
    device = await RemoteDevice.connect(target, keepalive=30)
    try:
        outcomes = await _pending_call_outcomes(
            device, proc, lambda: proc.send_signal(signal.SIGKILL))
        assert outcomes == [nnrt.ErrorStatus.DEAD_OBJECT] * 2
        assert not device.alive
    finally:
        device.close()


async def test_a_hung_server_is_found_dead_by_keepalive(remote_service):
    proc, target = remote_service("--insecure")
    device = await RemoteDevice.connect(target, keepalive=0.5)
    try:
        # SIGSTOP: the connection stays open and nothing answers, not even
        # pings; the pending call ends when keepalive gives up.
        outcomes = await _pending_call_outcomes(device, proc, lambda: None)
        assert outcomes == [nnrt.ErrorStatus.DEAD_OBJECT] * 2
        assert not device.alive
    finally:
        device.close()


async def test_calls_over_the_in_flight_cap_wait_on_the_client(remote_service):
    proc, target = remote_service("--insecure")
    device = await RemoteDevice.connect(target, max_in_flight=2, keepalive=30)
    try:
        async with nnrt.Runtime(devices=[device], strict=True) as rt:
            compiled = await rt.compile(add_model())
            x = np.ones((1, 4), np.float32)
            await compiled.execute([x, x])
            results = []

            async def run(k):
                y = np.full((1, 4), k, np.float32)
                results.append((k, (await compiled.execute([y, y])).outputs[0]))

            proc.send_signal(signal.SIGSTOP)    # nothing finishes meanwhile
            with anyio.fail_after(BOUND):
                async with anyio.create_task_group() as tg:
                    for k in range(5):
                        tg.start_soon(run, k)
                    await anyio.sleep(0.2)
                    assert device.remote_statistics() == RemoteStatistics(2, 3, 2)
                    proc.send_signal(signal.SIGCONT)
            assert sorted(k for k, _ in results) == list(range(5))
            for k, out in results:
                np.testing.assert_array_equal(out, np.full((1, 4), 2 * k, np.float32))
            assert device.remote_statistics() == RemoteStatistics(0, 0, 2)
    finally:
        device.close()


# -- who may call --------------------------------------------------------------------

async def test_mutual_tls_names_the_app_by_its_certificate(remote_service, pki, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('[[app]]\nname = "cameras"\nremote = "camera"\nweight = 3\n')
    socket = tmp_path / "far.sock"
    _, target = remote_service("--socket", str(socket), "--policy", str(policy),
                               "--tls-cert", str(pki["server"]),
                               "--tls-key", str(pki["server.key"]),
                               "--client-ca", str(pki["ca"]))
    assert target.startswith("grpcs://")
    device = await RemoteDevice.connect(target, tls=_tls(pki, "camera"))
    local = await ServiceDevice.connect(str(socket))
    try:
        async with nnrt.Runtime(devices=[device], strict=True) as rt:
            compiled = await rt.compile(add_model())
            x = np.ones((1, 4), np.float32)
            np.testing.assert_array_equal((await compiled.execute([x, x])).outputs[0], 2 * x)
            # The server's own accounting: the app is the certificate's name,
            # matched by the policy's rule.
            apps = {a.who: a for a in (await local.statistics()).apps}
            assert apps["remote camera"].app == ("remote", "camera")
            assert apps["remote camera"].rule == "cameras"
            assert apps["remote camera"].weight == 3
        # A certificate of another CA, or none: refused; the server serves on.
        for tls in (_tls(pki, "intruder"), _tls(pki)):
            with pytest.raises(nnrt.NnrtError) as e:
                await RemoteDevice.connect(target, tls=tls, timeout=BOUND)
            assert e.value.status == nnrt.ErrorStatus.DEVICE_UNAVAILABLE
        x = np.full((1, 4), 2, np.float32)
        async with nnrt.Runtime(devices=[device], strict=True) as rt:
            compiled = await rt.compile(add_model())
            np.testing.assert_array_equal((await compiled.execute([x, x])).outputs[0], 2 * x)
    finally:
        device.close()
        local.close()


async def test_a_wrong_token_is_refused_and_a_right_one_is_served(remote_service, pki,
                                                                   tmp_path, monkeypatch):
    tokens = tmp_path / "tokens"
    tokens.write_text("camera 0123456789abcdef0123\nbatch fedcba9876543210fedc\n")
    tokens.chmod(0o600)
    _, target = remote_service("--token-file", str(tokens), "--tls-cert", str(pki["server"]),
                               "--tls-key", str(pki["server.key"]))
    with pytest.raises(RemoteRefused):
        await RemoteDevice.connect(target, tls=_tls(pki), token="0123456789abcdef0124")
    with pytest.raises(RemoteRefused):
        await RemoteDevice.connect(target, tls=_tls(pki))
    # What an app configures: the CA and its token, in files the environment names.
    token = tmp_path / "token"
    token.write_text("fedcba9876543210fedc\n")
    monkeypatch.setenv("NNRT_REMOTE_CA", str(pki["ca"]))
    monkeypatch.setenv("NNRT_REMOTE_TOKEN_FILE", str(token))
    async with nnrt.Runtime(remote=[target], discover=False, litert=False, strict=True) as rt:
        assert [s.state for s in rt.services] == ["up"]
        compiled = await rt.compile(add_model(), devices=["far"])
        assert [d.name for d in compiled.devices] == ["far"]
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal((await compiled.execute([x, x])).outputs[0], 2 * x)
    token.write_text("fedcba9876543210fedd\n")
    async with nnrt.Runtime(remote=[target], discover=False, litert=False) as rt:
        assert [s.state for s in rt.services] == ["refused"]


def test_plaintext_is_refused_off_loopback_and_a_readable_token_file(tmp_path):
    def serve(*flags):
        return subprocess.run([sys.executable, "-m", "nnrt", "driver", "serve", "far",
                               "--driver", "reference", *flags],
                              capture_output=True, text=True, timeout=60)

    done = serve("--listen", "0.0.0.0:0", "--insecure")
    assert done.returncode == 1 and "loopback" in done.stderr
    tokens = tmp_path / "tokens"
    tokens.write_text("camera 0123456789abcdef0123\n")
    tokens.chmod(0o644)
    done = serve("--listen", f"{HOST}:0", "--insecure", "--token-file", str(tokens))
    assert done.returncode == 1 and "chmod 600" in done.stderr
    done = serve("--listen", f"{HOST}:0")
    assert done.returncode == 1 and "--tls-cert" in done.stderr


def test_the_conformance_kit_passes_on_a_remote_device(remote_service, monkeypatch, tmp_path):
    from nnrt.testing import conformance
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    _, target = remote_service("--insecure")
    monkeypatch.setenv("NNRT_DRIVERS", target)
    report = conformance.run_conformance("far", suites=("vts", "random"), count=20)
    counts = report.counts()
    assert not report.failed, [(r.name, r.detail) for r in report.failed]
    assert counts["random"]["passed"] == 20 and counts["vts"]["passed"] >= 15
    # Its bursts are gRPC streams, not the request ring that check feeds.
    assert [r.name for r in report.results if r.status == "skipped"] == \
        ["burst.malformed_packets"]
