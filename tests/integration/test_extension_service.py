"""The mediapipe extension driver as a driver service (`nnrt driver serve
... --driver mediapipe`): extension definitions and types over the socket,
the service's own allowlist check of the peer's executable, and
selfie_segmentation end to end through the importer."""
import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, NnrtError
from nnrt.drivers.litert import available as litert_available
from nnrt.drivers.mediapipe import MediapipeDevice
from nnrt.drivers.reference import ReferenceDevice
from nnrt.service.client import ServiceDevice
from nnrt.extensions import mediapipe as mp
from tests.conftest import start_service, stop
from tests.unit.test_extension_mediapipe import mediapipe_model, transpose_conv_bias_f64
from tests.conftest import MODELS, ROOT
from tests.unit.test_extensions import example_model

MODELS = MODELS / "mediapipe"
SELFIE = MODELS / "selfie_segmentation"


def serve_mediapipe(socket_path, config_home):
    """A mediapipe service whose allowlist is ``config_home``/nnrt/extensions-allowlist."""
    return start_service(socket_path, "mediapipe", "mp",
                         env=dict(os.environ, XDG_CONFIG_HOME=str(config_home)))


def small_model():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((2, 2, 2, 3)).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    x = rng.standard_normal((1, 3, 3, 3)).astype(np.float32)
    model = mediapipe_model(list(x.shape), w, b, mp.PARAMS_FORMAT.pack(1, 2, 2))
    return model, x, transpose_conv_bias_f64(x, w, b, 1, 2, 2)


def write_allowlist(folder: Path, text: str) -> Path:
    (folder / "nnrt").mkdir(exist_ok=True)
    (folder / "nnrt" / "extensions-allowlist").write_text(text)
    return folder


async def test_extension_runs_in_a_service_for_an_allowed_app(tmp_path, allow_this_app):
    config = tmp_path / "svc-config"
    config.mkdir()
    write_allowlist(config, os.path.realpath(sys.executable) + "\n")
    proc = serve_mediapipe(tmp_path / "mp.sock", config)
    try:
        dev = await ServiceDevice.connect(str(tmp_path / "mp.sock"))
        try:
            assert dev.supported_extensions() == [mp.EXTENSION]
            model, x, want = small_model()
            assert await dev.supported_operations(model.hal_model) == [True]
            async with nnrt.Runtime(devices=[ReferenceDevice(), dev]) as rt:
                compiled = await rt.compile(model)
                assert [d.name for d in compiled.devices] == ["mp"]
                got = (await compiled.execute([x])).outputs[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        finally:
            dev.close()
    finally:
        stop(proc)


EXAMPLE_SERVICE = """
import sys
from functools import partial
import anyio
sys.path.insert(0, {root!r})
from tests.unit.test_extensions import ExampleDevice
from nnrt.service.server import serve
async def main():
    async with anyio.create_task_group() as tg:
        await tg.start(partial(serve, ExampleDevice(), {path!r}))
        print("listening", flush=True)
anyio.run(main)
"""


def serve_example(socket_path, config_home) -> subprocess.Popen:
    """A service of a third-party vendor's extensions (com.example.scale and
    .offset) whose allowlist is ``config_home``/nnrt/extensions-allowlist."""
    proc = subprocess.Popen([sys.executable, "-c", EXAMPLE_SERVICE.format(
        root=str(ROOT), path=str(socket_path))], stdout=subprocess.PIPE,
        env=dict(os.environ, XDG_CONFIG_HOME=str(config_home)))
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready or b"listening" not in proc.stdout.readline():
        proc.kill()
        proc.wait()
        raise RuntimeError("the example extension service did not start")
    return proc


async def test_the_service_refuses_an_app_not_on_its_allowlist(tmp_path, monkeypatch):
    # The app calls itself "camera-app" and the service's list has that name,
    # but a service believes only the kernel: the peer's executable is the
    # Python interpreter, which is not listed.
    config = tmp_path / "svc-config"
    config.mkdir()
    write_allowlist(config, "camera-app\n/usr/bin/some-other-app\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.setenv("NNRT_APP_NAME", "camera-app")   # enough for the in-process check
    proc = serve_example(tmp_path / "ex.sock", config)
    try:
        dev = await ServiceDevice.connect(str(tmp_path / "ex.sock"))
        try:
            model = example_model()
            with pytest.raises(NnrtError, match="not allowed to use vendor extensions") as e:
                await dev.prepare_model(model.hal_model)
            assert e.value.status == ErrorStatus.INVALID_ARGUMENT
            assert f"pid {os.getpid()}" in e.value.message
            async with nnrt.Runtime(devices=[ReferenceDevice(), dev]) as rt:
                with pytest.raises(NnrtError, match="not allowed"):
                    await rt.compile(model)
            # The same connection still serves what needs no extension.
            plain = nnrt.Model()
            a = plain.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [2])
            b = plain.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [2])
            plain.add_operation(nnrt.OperationType.RELU, [a], [b])
            plain.identify_inputs_and_outputs([a], [b])
            assert await dev.supported_operations(plain.finish().hal_model) == [False]
        finally:
            dev.close()
    finally:
        stop(proc)


async def test_nnrts_own_extension_needs_no_allowlist_entry(tmp_path, allow_nobody):
    """com.nnrt.mediapipe ships with nnrt: an app on no allowlist uses it in
    process and on a service whose allowlist does not name it either."""
    model, x, want = small_model()
    async with nnrt.Runtime(devices=[MediapipeDevice("mp"), ReferenceDevice()]) as rt:
        compiled = await rt.compile(model)
        np.testing.assert_allclose((await compiled.execute([x])).outputs[0], want,
                                   rtol=1e-5, atol=1e-5)
    proc = serve_mediapipe(tmp_path / "mp.sock", allow_nobody)
    try:
        dev = await ServiceDevice.connect(str(tmp_path / "mp.sock"))
        try:
            prepared = await dev.prepare_model(model.hal_model)
            prepared.release()
        finally:
            dev.close()
    finally:
        stop(proc)


async def test_a_model_needing_an_extension_no_device_offers_says_how_to_get_one():
    model, _, _ = small_model()
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        with pytest.raises(NnrtError) as e:
            await rt.compile(model)
    assert "which no device offers" in e.value.message
    assert "no allowlist entry needed" in e.value.message
    assert "'nnrt run --spawn mediapipe'" in e.value.message
    assert "Runtime(spawn=['mediapipe'])" in e.value.message


def test_nnrt_run_of_selfie_segmentation_with_its_one_step(tmp_path):
    """The one step the CLI guide documents: --spawn mediapipe, no allowlist;
    with LiteRT installed the litert driver runs the custom op itself, so the
    whole model is its one step (issue 43)."""
    done = subprocess.run([sys.executable, "-m", "nnrt", "run", f"{SELFIE}.tflite", "--random",
                           "--spawn", "mediapipe", "--no-discover"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, XDG_CONFIG_HOME=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    expected = "litert (1 step(s))" if litert_available() else "mediapipe"
    assert expected in done.stdout.splitlines()[0]


async def _run_selfie(spawn: bool, litert: bool = False):
    model = nnrt.tflite.load(f"{SELFIE}.tflite")
    x = np.load(f"{SELFIE}.in0.npy")
    runtime = nnrt.Runtime(spawn=[("mp", "mediapipe")], discover=False, litert=litert) \
        if spawn else nnrt.Runtime(devices=[MediapipeDevice("mp"), ReferenceDevice()])
    async with runtime as rt:
        compiled = await rt.compile(model)
        names = [d.name for d in compiled.devices]
        result = await compiled.execute([x])
    return names, result.outputs[0]


async def test_selfie_segmentation_end_to_end_in_process_and_as_a_service(allow_this_app):
    names, in_process = await _run_selfie(spawn=False)
    assert names == ["nnrt-reference", "mp", "nnrt-reference"]
    names, served = await _run_selfie(spawn=True)
    assert names == ["nnrt-reference", "mp", "nnrt-reference"]
    # The same kernels on both sides of the socket: the same bits.
    np.testing.assert_array_equal(in_process, served)
    assert in_process.shape == (1, 256, 256, 1)


def _selfie_at_the_custom_op():
    """selfie's flatbuffer as an object tree (to edit), its main graph, the
    custom op's index and the custom op's input tensor."""
    pytest.importorskip("ai_edge_litert.interpreter")
    from ai_edge_litert import schema_py_generated as schema
    data = Path(f"{SELFIE}.tflite").read_bytes()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(data, 0))
    graph = model.subgraphs[0]
    (k,) = [k for k, op in enumerate(graph.operators)
            if model.operatorCodes[op.opcodeIndex].customCode == b"Convolution2DTransposeBias"]
    return model, graph, k, int(graph.operators[k].inputs[0])


def _invoke_on_the_stored_input(model, resolver=None):
    """LiteRT (1 thread, ``resolver``'s kernels) run on selfie's stored input:
    the interpreter after the run."""
    import flatbuffers
    from ai_edge_litert.interpreter import Interpreter, OpResolverType
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    interp = Interpreter(model_content=bytes(builder.Output()), num_threads=1,
                         experimental_op_resolver_type=resolver or OpResolverType.AUTO)
    interp.allocate_tensors()
    interp.set_tensor(interp.get_input_details()[0]["index"], np.load(f"{SELFIE}.in0.npy"))
    interp.invoke()
    return interp


def _prefix_of_the_custom_op(resolver):
    """The operators before selfie's custom op, run by LiteRT with ``resolver``
    on the stored input: (their indices, the custom op's input tensor, its
    value). TFLite's reference kernels (BUILTIN_REF) cannot run the custom
    op, so the graph is cut just before it."""
    model, graph, k, tensor = _selfie_at_the_custom_op()
    needed, prefix = {tensor}, []
    for j in range(k - 1, -1, -1):           # the custom op's input and all it is made of
        if {int(t) for t in graph.operators[j].outputs} & needed:
            prefix.insert(0, j)
            needed |= {int(t) for t in graph.operators[j].inputs if t >= 0}
    graph.operators = [graph.operators[j] for j in prefix]
    graph.outputs = np.array([tensor], np.int32)
    interp = _invoke_on_the_stored_input(model, resolver)
    return prefix, tensor, interp.get_tensor(interp.get_output_details()[0]["index"]).copy()


async def test_selfie_before_the_custom_op_is_as_close_to_tflites_reference_kernels_as_xnnpack():
    """The operations around the custom op run on the reference driver. Its
    float32 sums come in another order than XNNPACK's and than TFLite's
    reference kernels', so the three differ in their last bits, by amounts
    that depend on the machine's BLAS. The bound is therefore not a constant
    but XNNPACK's own distance from TFLite's reference kernels on the same
    operators and input: the reference driver must be within twice that
    (here it is a third of it: 6.5e-5 against 2.0e-4, on values up to 101;
    another BLAS sums in another order, hence the factor). (The custom op and what follows it are checked from
    XNNPACK's own input by the test of the extension part below.)"""
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    from nnrt.tflite import load_operators
    from nnrt.tflite.reader import read
    prefix, tensor, kernels = _prefix_of_the_custom_op(litert.OpResolverType.BUILTIN_REF)
    _, _, xnnpack = _prefix_of_the_custom_op(litert.OpResolverType.AUTO)
    file = read(Path(f"{SELFIE}.tflite").read_bytes(), "selfie")
    model = load_operators(file, 0, prefix)     # every tensor its operators write is an output
    written = [t for j in prefix for t in file.graphs[0].operators[j].outputs]
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(model)
        ours = (await compiled.execute([np.load(f"{SELFIE}.in0.npy")])).outputs[written.index(tensor)]
    xnnpack_distance = np.max(np.abs(xnnpack - kernels))
    assert 0 < xnnpack_distance < 1e-5 * np.max(np.abs(kernels))   # float noise, not a wrong kernel
    assert np.max(np.abs(ours - kernels)) <= 2 * xnnpack_distance


async def test_selfie_segmentation_runs_on_litert_alone_bit_for_bit_as_xnnpack():
    """The litert driver offers com.nnrt.mediapipe: Convolution2DTransposeBias
    becomes TFLite's TRANSPOSE_CONV with its bias, which XNNPACK runs with the
    kernel it runs the custom op with in LiteRT, so the whole model is one
    litert step and gives the stored XNNPACK output exactly (issue 43: the
    face pipeline's segmentation stage needs no extension service)."""
    pytest.importorskip("ai_edge_litert.interpreter")
    from nnrt.drivers.litert import LiteRTDevice
    model = nnrt.tflite.load(f"{SELFIE}.tflite")
    async with nnrt.Runtime(devices=[LiteRTDevice(), ReferenceDevice()]) as rt:
        compiled = await rt.compile(model)
        assert [d.name for d in compiled.devices] == ["litert"]
        got = (await compiled.execute([np.load(f"{SELFIE}.in0.npy")])).outputs[0]
    np.testing.assert_array_equal(got, np.load(f"{SELFIE}.out0.npy"))


def _xnnpack_input_of_the_custom_op():
    """LiteRT's XNNPACK value of the custom op's input on the stored input
    image: the model with that tensor made an extra output."""
    model, graph, k, tensor = _selfie_at_the_custom_op()
    graph.outputs = np.array([tensor, *graph.outputs], np.int32)
    return k, _invoke_on_the_stored_input(model).get_tensor(tensor)


async def test_the_extension_part_of_selfie_matches_xnnpack(allow_this_app):
    """From XNNPACK's own input to the custom op, the extension driver's
    custom op and the final LOGISTIC give LiteRT's output within 1e-4 of its
    largest magnitude: what remains of the end-to-end difference comes from
    the operations before it (see the test above)."""
    from nnrt.tflite import load_operators
    from nnrt.tflite.reader import read
    k, x = _xnnpack_input_of_the_custom_op()
    file = read(Path(f"{SELFIE}.tflite").read_bytes(), "selfie")
    graph = file.graphs[0]
    custom = graph.operators[k]
    producers = [j for j, op in enumerate(graph.operators)
                 if set(op.outputs) & set(custom.inputs[1:])]
    (logistic,) = [j for j, op in enumerate(graph.operators) if custom.outputs[0] in op.inputs]
    model = load_operators(file, 0, producers + [k, logistic])
    async with nnrt.Runtime(devices=[MediapipeDevice("mp"), ReferenceDevice()]) as rt:
        compiled = await rt.compile(model)
        assert "mp" in [d.name for d in compiled.devices]
        got = (await compiled.execute([x])).outputs[-1]
    expected = np.load(f"{SELFIE}.out0.npy")
    assert np.max(np.abs(got - expected)) <= 1e-4 * np.max(np.abs(expected))


# --- face_landmark_with_attention: the landmark operations --------------------------------

FACE = ROOT / "tests" / "data" / "mediapipe" / "face_landmark_with_attention"


async def _run_face(spawn: bool = False, litert: bool = False):
    """The model on its stored input: the devices it ran on and its outputs;
    the builtin operations on the reference device (or litert), the custom
    ones on the mediapipe driver (in process, or a service with ``spawn``)."""
    model = nnrt.tflite.load(f"{FACE}.tflite")
    if spawn:
        runtime = nnrt.Runtime(spawn=[("mp", "mediapipe")], discover=False, litert=litert)
    else:
        from nnrt.drivers.litert import LiteRTDevice
        runtime = nnrt.Runtime(devices=[MediapipeDevice("mp"), *(
            [LiteRTDevice()] if litert else []), ReferenceDevice()])
    async with runtime as rt:
        compiled = await rt.compile(model)
        result = await compiled.execute([np.load(f"{FACE}.in0.npy")])
    return [d.name for d in compiled.devices], result.outputs


def _mediapipes_spread(recorded) -> list[float]:
    """Per output, how far mediapipe's two runs of the model (TFLite's builtin
    kernels, XNNPACK) are apart: float noise of two right implementations of
    the builtin operations around the same custom kernels."""
    spread = []
    for i in range(7):
        plain, xnnpack = recorded[f"out{i}"], recorded[f"xnnpack_out{i}"]
        spread.append(float(np.max(np.abs(plain - xnnpack))))
        assert 0 < spread[-1] < 1e-5 * np.max(np.abs(plain))   # noise, not a wrong kernel
    return spread


def _check_refinements(outputs) -> None:
    """The attention heads refine the mesh in crops around the lips and the
    eyes: each refined point lies where the mesh has that point, within 8
    pixels of the 192-pixel input (two pixels of the 16 x 16 crop), and each
    iris centre inside its eye. A wrong crop matrix puts them tens of pixels
    away."""
    from flatbuffers import flexbuffers
    from nnrt.tflite.reader import read
    file = read(Path(f"{FACE}.tflite").read_bytes(), "face")
    subsets = [flexbuffers.Loads(op.custom_options)["subset_idxs"] for op in file.graphs[0].operators
               if op.name == "CUSTOM:Landmarks2TransformMatrix"]     # lips, left eye, right eye
    mesh = outputs[0].reshape(468, 3)[:, :2]
    for refined, subset in zip(outputs[1:4], subsets):
        points = refined.reshape(-1, 2)
        assert np.max(np.linalg.norm(points - mesh[subset[:len(points)]], axis=1)) < 8
    for iris, subset in zip(outputs[4:6], subsets[1:]):
        centre, eye = iris.reshape(5, 2)[0], mesh[subset]
        assert np.all(eye.min(0) < centre) and np.all(centre < eye.max(0))


async def test_face_landmark_with_attention_matches_mediapipes_own_kernels():
    """The issue's done-when: the model runs, its custom ops on the mediapipe
    driver, and gives what mediapipe computes (its InferenceCalculator with
    its own resolver, recorded by scripts/record_face_landmark_attention.py).
    The builtin operations run on the reference device, whose float32 sums
    come in another order than TFLite's kernels': each output must be within
    twice the distance between mediapipe's own two runs (TFLite's kernels,
    XNNPACK) of its run with TFLite's kernels (here at most 1.05 times it:
    8.8e-5 on values up to 156)."""
    recorded = np.load(f"{FACE}.mediapipe.npz")
    names, outputs = await _run_face()
    assert names == ["nnrt-reference", "mp", "nnrt-reference", "mp", "nnrt-reference"]
    for i, (got, spread) in enumerate(zip(outputs, _mediapipes_spread(recorded))):
        assert got.shape == recorded[f"out{i}"].shape
        assert np.max(np.abs(got - recorded[f"out{i}"])) <= 2 * spread, f"output {i}"
    _check_refinements(outputs)


async def test_face_landmark_with_attention_on_litert_matches_mediapipe_on_xnnpack():
    """With the builtin operations on the litert driver (XNNPACK, as
    mediapipe's XNNPACK run) the same bound holds against that run (here the
    outputs are the same bits)."""
    pytest.importorskip("ai_edge_litert.interpreter")
    recorded = np.load(f"{FACE}.mediapipe.npz")
    names, outputs = await _run_face(litert=True)
    assert "mp" in names and set(names) <= {"mp", "litert"}
    for i, (got, spread) in enumerate(zip(outputs, _mediapipes_spread(recorded))):
        assert np.max(np.abs(got - recorded[f"xnnpack_out{i}"])) <= 2 * spread, f"output {i}"


async def test_face_landmark_with_attention_on_a_mediapipe_service():
    """The custom ops on a mediapipe driver service, no allowlist entry: the
    same kernels on both sides of the socket give the same bits."""
    _, in_process = await _run_face()
    names, served = await _run_face(spawn=True)
    assert names == ["nnrt-reference", "mp", "nnrt-reference", "mp", "nnrt-reference"]
    for got, want in zip(served, in_process):
        np.testing.assert_array_equal(got, want)


async def test_nnrts_tflite_extension_runs_in_a_reference_service_for_any_app(tmp_path,
                                                                            allow_nobody):
    """com.nnrt.tflite over the socket: a reference service offers it, an app
    no allowlist names compiles for it (the service checks too), and RANGE's
    dynamic output shape comes back with the length of the run."""
    data = ROOT / "tests" / "data" / "tflite"
    model = nnrt.tflite.load(data / "range_dynamic.tflite")
    inputs = [np.load(data / f"range_dynamic.case0.in{i}.npy") for i in range(3)]
    expected = [np.load(data / f"range_dynamic.case0.out{i}.npy") for i in range(3)]
    proc = start_service(tmp_path / "ref.sock", "reference", "ref",
                         env=dict(os.environ, XDG_CONFIG_HOME=str(allow_nobody)))
    try:
        dev = await ServiceDevice.connect(str(tmp_path / "ref.sock"))
        try:
            assert [e.name for e in dev.supported_extensions()] == ["com.nnrt.tflite"]
            async with nnrt.Runtime(devices=[dev]) as rt:
                compiled = await rt.compile(model)
                result = await compiled.execute(inputs)
            assert [tuple(s) for s in result.output_shapes] == [e.shape for e in expected]
            for got, want in zip(result.outputs, expected):
                np.testing.assert_array_equal(got, want)
        finally:
            dev.close()
    finally:
        stop(proc)
