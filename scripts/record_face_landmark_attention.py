"""Record what mediapipe's own kernels compute for face_landmark_with_attention:
the expected values tests/unit/test_mediapipe_landmark_ops.py and
tests/integration/test_extension_service.py compare nnrt with.

LiteRT cannot run the model (its three custom ops are not in LiteRT's
resolver), and mediapipe's Python package does not hand its op resolver to
LiteRT. It does run calculator graphs, so this script runs the model the way
mediapipe's face mesh does, in mediapipe's InferenceCalculator with the
resolver of mediapipe's TfLiteCustomOpResolverCalculator (mediapipe's CPU
kernels of Landmarks2TransformMatrix, TransformTensorBilinear and
TransformLandmarks, version 2), fed through TensorConverterCalculator so the
interpreter sees exactly the float input written here (checked).

It runs in an environment of its own, as mediapipe 0.10.21 pins numpy < 2:

    python3.11 -m venv /tmp/mp && /tmp/mp/bin/pip install mediapipe==0.10.21 ai-edge-litert
    /tmp/mp/bin/python scripts/record_face_landmark_attention.py

It writes into tests/data/mediapipe/:

* face_landmark_with_attention.tflite: the model, unchanged from the
  mediapipe 0.10.21 wheel (mediapipe/modules/face_landmark/);
* face_landmark_with_attention.in0.npy: the input, uniform[0, 1) float32
  [1, 192, 192, 3] from numpy's default_rng seeded with the crc32 of the
  model's name (the convention of the shared models' README);
* face_landmark_with_attention.mediapipe.npz: ``out<i>``, the model's outputs
  with TFLite's builtin kernels (the InferenceCalculator's ``tflite``
  delegate: none), ``xnnpack_out<i>`` the same with the XNNPACK delegate, and
  ``tensor<t>`` every input and output tensor ``t`` of the custom ops, from
  the first run (the model is run with those tensors made extra outputs,
  which changes nothing they compute).
"""
import shutil
import zlib
from pathlib import Path

import mediapipe
import numpy as np
from ai_edge_litert import schema_py_generated as schema
import flatbuffers
from mediapipe.python import packet_creator, packet_getter
from mediapipe.python._framework_bindings import calculator_graph, timestamp

NAME = "face_landmark_with_attention"
DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "mediapipe"
CUSTOM = {b"Landmarks2TransformMatrix", b"TransformTensorBilinear", b"TransformLandmarks"}


def with_custom_tensors_as_outputs(data: bytes) -> tuple[bytes, list[int], list[tuple]]:
    """The model with every custom op's tensors appended to its outputs: the
    new file, those tensor indices, and the shapes of all outputs."""
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(data, 0))
    graph = model.subgraphs[0]
    extra = []
    for op in graph.operators:
        if model.operatorCodes[op.opcodeIndex].customCode in CUSTOM:
            extra += [int(t) for t in (*op.inputs, *op.outputs) if int(t) not in extra]
    graph.outputs = np.array([*graph.outputs, *extra], np.int32)
    shapes = [tuple(int(d) for d in graph.tensors[t].shape) for t in graph.outputs]
    builder = flatbuffers.Builder(len(data) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output()), extra, shapes


def run(model_path: Path, x: np.ndarray, count: int, delegate: str) -> list[np.ndarray]:
    """The ``count`` output tensors (flat float32) of mediapipe's
    InferenceCalculator on input ``x`` [1, 192, 192, 3]."""
    config = f"""
input_stream: "matrix"
node {{ calculator: "TfLiteCustomOpResolverCalculator" output_side_packet: "OP_RESOLVER:op_resolver"
  options {{ [mediapipe.TfLiteCustomOpResolverCalculatorOptions.ext] {{ use_gpu: false }} }} }}
node {{ calculator: "TensorConverterCalculator" input_stream: "MATRIX:matrix"
  output_stream: "TENSORS:input_tensors"
  options {{ [mediapipe.TensorConverterCalculatorOptions.ext] {{ zero_center: false row_major_matrix: true }} }} }}
node {{ calculator: "InferenceCalculator" input_stream: "TENSORS:input_tensors"
  input_side_packet: "OP_RESOLVER:op_resolver" output_stream: "TENSORS:output_tensors"
  options {{ [mediapipe.InferenceCalculatorOptions.ext] {{ model_path: "{model_path}"
    delegate {{ {delegate} {{}} }} }} }} }}
node {{ calculator: "SplitTensorVectorCalculator" input_stream: "output_tensors"
  {" ".join(f'output_stream: "t{i}"' for i in range(count))}
  options {{ [mediapipe.SplitVectorCalculatorOptions.ext] {{
    {" ".join(f"ranges: {{ begin: {i} end: {i + 1} }}" for i in range(count))} }} }} }}
node {{ calculator: "TensorsToFloatsCalculator" input_stream: "TENSORS:input_tensors"
  output_stream: "FLOATS:seen" }}
output_stream: "seen"
"""
    for i in range(count):
        config += (f'node {{ calculator: "TensorsToFloatsCalculator" input_stream: "TENSORS:t{i}" '
                   f'output_stream: "FLOATS:f{i}" }}\noutput_stream: "f{i}"\n')
    graph = calculator_graph.CalculatorGraph(graph_config=config)
    got = {}
    for name in ["seen", *(f"f{i}" for i in range(count))]:
        graph.observe_output_stream(name, lambda _, packet, name=name: got.__setitem__(
            name, np.array(packet_getter.get_float_list(packet), np.float32)))
    graph.start_run()
    graph.add_packet_to_input_stream("matrix", packet_creator.create_matrix(
        x.reshape(x.shape[1], -1)).at(timestamp.Timestamp(0)))
    graph.close()
    if not np.array_equal(got["seen"], x.reshape(-1)):
        raise SystemExit("mediapipe's interpreter was given another input than the one written")
    return [got[f"f{i}"] for i in range(count)]


def main() -> None:
    assert mediapipe.__version__ == "0.10.21", mediapipe.__version__
    source = Path(mediapipe.__file__).parent / "modules" / "face_landmark" / f"{NAME}.tflite"
    DATA.mkdir(parents=True, exist_ok=True)
    model = DATA / f"{NAME}.tflite"
    shutil.copyfile(source, model)
    x = np.random.default_rng(zlib.crc32(NAME.encode())).uniform(
        0, 1, (1, 192, 192, 3)).astype(np.float32)
    np.save(DATA / f"{NAME}.in0.npy", x)
    extended, extra, shapes = with_custom_tensors_as_outputs(model.read_bytes())
    outputs = len(shapes) - len(extra)
    scratch = DATA / f"{NAME}.extended.tflite"
    scratch.write_bytes(extended)
    try:
        plain = run(scratch, x, len(shapes), "tflite")
        xnnpack = run(scratch, x, len(shapes), "xnnpack")
    finally:
        scratch.unlink()
    arrays = {}
    for i in range(outputs):
        arrays[f"out{i}"] = plain[i].reshape(shapes[i])
        arrays[f"xnnpack_out{i}"] = xnnpack[i].reshape(shapes[i])
    for j, t in enumerate(extra):
        arrays[f"tensor{t}"] = plain[outputs + j].reshape(shapes[outputs + j])
    np.savez(DATA / f"{NAME}.mediapipe.npz", **arrays)
    for key, value in arrays.items():
        print(key, value.shape)


if __name__ == "__main__":
    main()
