"""The NNAPI CTS vectors of ../shared/cts through the public API and the
reference CPU driver: every run passes, none is skipped.

Each case runs in every suite it belongs to (GeneratedTests,
DynamicOutputShapeTest, QuantizationCouplingTest, GeneratedValidationTests)
plus nnrt's SignedIdentity check: for every single-operation quant8 case
(all operations with both variants except CAST, HASHTABLE_LOOKUP,
LSH_PROJECTION, PAD_V2 and QUANTIZED_16BIT_LSTM, as the CTS harness selects
them), the TENSOR_QUANT8_ASYMM_SIGNED results equal the unsigned ones minus
128 exactly."""

from collections import Counter

import pytest

from nnrt.testing import cts
from tests.conftest import SHARED

CTS = SHARED / "cts"
VERSIONS = ["V1_0", "V1_1", "V1_2"]
# Each version's spec files in shards of about equal size (V1_2, the
# largest, in more of them, a few seconds each), so pytest's workers share
# the whole run evenly and none is left with a long shard at the end; each
# shard runs on one process (jobs=1) as the workers already take every core.
SHARDS = {"V1_0": 2, "V1_1": 2, "V1_2": 8}
VERSION_SHARDS = pytest.mark.parametrize(
    "version,shard", [(v, k) for v in VERSIONS for k in range(SHARDS[v])],
    ids=[f"{v}-{k + 1}of{SHARDS[v]}" for v in VERSIONS for k in range(SHARDS[v])])


def spec_files(version: str, shard: int) -> list[str]:
    folder = CTS / version
    if not folder.exists():
        pytest.skip(f"{folder} is not beside the checkout")
    files = sorted((f for f in folder.iterdir()
                    if f.name.endswith((".json", ".json.gz")) and f.name != "INDEX.json"),
                   key=lambda f: (-f.stat().st_size, f.name))
    return [str(f) for f in files[shard::SHARDS[version]]]


@pytest.mark.slow
@VERSION_SHARDS
def test_cts_version_passes(version, shard):
    """Every run the CTS harness makes of each case (its suites, SCHEMA §5.4)
    happened, and passed."""
    files = spec_files(version, shard)
    outcomes = cts.run(files, jobs=1)
    failed = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status == "failed"]
    skipped = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status == "skipped"]
    assert outcomes, "no vectors found"
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:50])
    assert not skipped, f"{len(skipped)} skipped:\n" + "\n".join(skipped[:50])
    expected = Counter((case["name"], suite) for _stem, case in cts.load_cases(files)
                       for suite in cts.suites_of(case))
    assert Counter((o.name, o.suite) for o in outcomes) == expected


@pytest.mark.parametrize("kind", ["reference", "sample-float-fast", "sample-quant"])
def test_cts_v1_0_on_an_out_of_process_service(kind):
    """V1_0 through a driver service process: every vector the device supports
    passes; the reference service supports them all."""
    folder = CTS / "V1_0"
    if not folder.exists():
        pytest.skip(f"{folder} is not beside the checkout")
    outcomes = cts.run([str(folder)], device=kind, spawn=[kind], jobs=1)
    failed = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status == "failed"]
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:50])
    passed = [o for o in outcomes if o.status == "passed"]
    skipped = [o for o in outcomes if o.status == "skipped"]
    assert passed
    if kind == "reference":
        assert not skipped
    else:
        assert all("device reports unsupported" in o.detail for o in skipped)


def test_own_control_flow_vectors_pass_in_every_harness_mode():
    """nnrt's IF/WHILE vectors (nested subgraphs, unknown ranks, validation
    cases) in every mode; the committed file is what the generator makes."""
    import json

    from nnrt.testing import control_flow_vectors
    from nnrt.testing.conformance import OWN_VECTORS

    path = OWN_VECTORS / "V1_3" / "nnrt_control_flow.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(control_flow_vectors.document()))
    outcomes = cts.run([str(path)], modes=cts.MODES, jobs=1)
    failed = [f"{o.name} [{o.suite}/{o.mode}]: {o.detail}" for o in outcomes
              if o.status != "passed"]
    assert not failed, "\n".join(failed)
    validation = {o.name for o in outcomes if o.suite == "GeneratedValidationTests"}
    assert {"if_condition_unknown_size", "while_body_carried_shape_mismatch",
            "if_condition_float32", "while_body_too_many_outputs", "if_condition_no_value",
            "if_condition_no_value_in_branch"} <= validation
    assert {o.mode for o in outcomes} == set(cts.MODES) - {"dynamic"}


def _own_vectors_pass(level: str, generator, validation: set[str], claimed: set[str],
                      skipped: set[str]) -> None:
    """nnrt's vectors of feature level ``level``: the committed file is what
    ``generator`` makes; every run passes in every mode on the runtime's
    choice of devices and on the reference device alone, the ``validation``
    cases among them; on litert every run it claims passes, it claims the
    ``claimed`` cases (a lowering that claims nothing would skip them all)
    and skips exactly ``skipped``."""
    import json

    from nnrt.testing.conformance import OWN_VECTORS

    path = OWN_VECTORS / level / f"nnrt_{level.lower()}.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(generator.document()))
    for device in (None, "nnrt-reference"):
        outcomes = cts.run([str(path)], modes=cts.MODES, jobs=1, device=device)
        failed = [f"{o.name} [{o.suite}/{o.mode}]: {o.detail}" for o in outcomes
                  if o.status != "passed"]
        assert not failed, "\n".join(failed)
        assert {o.mode for o in outcomes} == set(cts.MODES)
    assert validation <= {o.name for o in outcomes if o.suite == "GeneratedValidationTests"}
    assert {"QuantizationCouplingTest", "SignedIdentity"} <= {o.suite for o in outcomes}

    pytest.importorskip("ai_edge_litert")
    outcomes = cts.run([str(path)], modes=cts.MODES, jobs=1, device="litert")
    failed = [f"{o.name} [{o.suite}/{o.mode}]: {o.detail}" for o in outcomes
              if o.status == "failed"]
    assert not failed, "\n".join(failed)
    assert claimed <= {o.name for o in outcomes if o.status == "passed"
                       and o.suite == "GeneratedTests" and o.devices == "litert"}
    assert {o.name for o in outcomes if o.status == "skipped"} == skipped


def test_own_fl7_vectors_pass_in_every_harness_mode_and_on_litert():
    """MIRROR_PAD and REVERSE (feature level 7). On litert, paddings and axis
    given at execution are skipped: the TFLite model is built with constants."""
    from nnrt.testing import fl7_vectors
    _own_vectors_pass(
        "FL7", fl7_vectors,
        validation={"mirror_pad_reflect_paddings_too_large",
                    "mirror_pad_symmetric_paddings_too_large", "mirror_pad_mode_2",
                    "mirror_pad_quant8_output_scale_mismatch", "reverse_negative_axis",
                    "reverse_axis_out_of_range"},
        claimed={"mirror_pad_reflect_float32_dim4", "mirror_pad_symmetric_quant8_asymm_dim2",
                 "mirror_pad_reflect_maximal_paddings_quant8_asymm",
                 "mirror_pad_symmetric_maximal_paddings_float32", "reverse_float32_dim3_axis1",
                 "reverse_quant8_asymm_dim2_axis0", "reverse_quant8_asymm_signed_dim2_axis1"},
        skipped={"mirror_pad_symmetric_paddings_as_input", "reverse_axis_as_input"})


def test_own_fl6_vectors_pass_in_every_harness_mode_and_on_litert():
    """BATCH_MATMUL and PACK (feature level 6). On litert: TFLite's
    BATCH_MATMUL has no int32 kernel, and XNNPACK takes an int8 one with a
    symmetric rhs and rescales in float32 (see the litert table): skipped."""
    from nnrt.testing import fl6_vectors
    _own_vectors_pass(
        "FL6", fl6_vectors,
        validation={"batch_matmul_quant8_asymm_refused", "batch_matmul_broadcast_ranks_refused",
                    "batch_matmul_broadcast_batch_refused", "batch_matmul_rank5_refused",
                    "pack_negative_axis_refused", "pack_input_quant_mismatch_refused",
                    "pack_shape_mismatch_refused"},
        claimed={"batch_matmul_float32_rank2", "batch_matmul_float32_rank4",
                 "batch_matmul_float32_adj_x_adj_y", "batch_matmul_float16",
                 "batch_matmul_quant8_signed", "batch_matmul_quant8_signed_adj_x_rank4",
                 "pack_float32_axis0", "pack_float32_axis_last", "pack_int32_axis0",
                 "pack_quant8_asymm_axis1", "pack_quant8_signed_axis_last"},
        skipped={"batch_matmul_int32", "batch_matmul_int32_adj_x",
                 "batch_matmul_quant8_signed_symmetric_rhs"})


def test_a_harness_mode_catches_what_it_is_for(monkeypatch):
    """The dynamic mode fails a device that fills a too-small output instead
    of answering OUTPUT_INSUFFICIENT_SIZE; the burst mode fails one whose
    second execution differs from the first."""
    import numpy as np

    from nnrt.drivers.reference import ReferenceDevice

    from .doubles import WrongStatusDevice

    folder = CTS / "V1_0"
    if not folder.exists():
        pytest.skip(f"{folder} is not beside the checkout")
    outcomes = cts.run([str(folder / "add.json")], modes=("dynamic",), device="planted-status",
                       devices=[WrongStatusDevice(), ReferenceDevice()])
    assert outcomes and all(o.status == "failed" and "GENERAL_FAILURE" in o.detail
                            for o in outcomes)

    calls = []

    class Drifting:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            pass

        async def execute(self, inputs):
            calls.append(1)
            r = await self.compiled.execute(inputs)
            if len(calls) % 2 == 0:
                r.outputs[0].reshape(-1)[0] += np.asarray(1, r.outputs[0].dtype)
            return r

    async def burst_of(compiled, case):
        b = Drifting()
        b.compiled = compiled
        monkeypatch.setattr(compiled, "burst", lambda: b)
        return await original_burst(compiled, case)

    original_burst = cts._COMPUTE["burst"]
    monkeypatch.setitem(cts._COMPUTE, "burst", burst_of)
    outcomes = cts.run([str(folder / "add.json")], modes=("burst",), jobs=1)
    assert outcomes and all(o.status == "failed" and "differs from the first" in o.detail
                            for o in outcomes), [o.detail for o in outcomes]


@pytest.mark.parametrize("mode", cts.MODES)
def test_fallback_runs_what_the_device_does_not_support_in_every_mode(mode):
    """Issue 41: with fallback, a case whose operation litert does not run
    (AXIS_ALIGNED_BBOX_TRANSFORM) passes on the reference driver in every
    harness mode (sync mode once sent it to litert alone); without, every run
    is skipped naming the operation."""
    pytest.importorskip("ai_edge_litert")
    path = CTS / "V1_2" / "axis_aligned_bbox_transform.json"
    if not path.exists():
        pytest.skip(f"{path} is not beside the checkout")
    outcomes = cts.run([str(path)], device="litert", modes=[mode], fallback=True, jobs=1)
    assert outcomes and all(o.status == "passed" for o in outcomes), \
        [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status != "passed"]
    generated = [o for o in outcomes if o.suite != "GeneratedValidationTests"]
    assert generated and all("nnrt-reference" in o.devices.split("+") for o in generated)
    outcomes = cts.run([str(path)], device="litert", modes=[mode], fallback=False, jobs=1)
    assert outcomes and all(o.status == "skipped" and o.detail == "device reports "
                            "unsupported: AXIS_ALIGNED_BBOX_TRANSFORM" for o in outcomes), \
        {(o.status, o.detail) for o in outcomes}


@pytest.mark.slow
@VERSION_SHARDS
def test_the_memory_domain_mode_passes_on_the_reference_driver(version, shard):
    """Every tensor input and output of every vector through a device memory
    made from its role: each run the execute mode runs as GeneratedTests
    passes, and the memories were the reference driver's own buffers."""
    from nnrt.drivers.reference import ReferenceDevice

    files = spec_files(version, shard)
    device = ReferenceDevice()
    outcomes = cts.run(files, modes=("domain",), device=device.name, devices=[device])
    failed = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status != "passed"]
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:50])
    generated = [o for o in outcomes if o.suite == "GeneratedTests"]
    cases = {case["name"] for _stem, case in cts.load_cases(files)
             if not case["expectFailure"]}
    assert {o.name for o in generated} == cases
    stats = device.buffers.statistics()
    assert stats.allocated >= len(generated) and stats.executions >= len(generated)
    assert stats.live == 0   # every memory released when its run ended
