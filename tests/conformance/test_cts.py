"""The NNAPI CTS vectors of ../shared/cts through the public API and the
reference CPU driver: every run passes, none is skipped.

Each case runs in every suite it belongs to (GeneratedTests,
DynamicOutputShapeTest, QuantizationCouplingTest, GeneratedValidationTests)
plus nnrt's SignedIdentity check: for every single-operation quant8 case
(all operations with both variants except CAST, HASHTABLE_LOOKUP,
LSH_PROJECTION, PAD_V2 and QUANTIZED_16BIT_LSTM, as the CTS harness selects
them), the TENSOR_QUANT8_ASYMM_SIGNED results equal the unsigned ones minus
128 exactly."""
from pathlib import Path

import pytest

from nnrt.testing import cts

CTS = Path(__file__).resolve().parents[3] / "shared" / "cts"
VERSIONS = ["V1_0", "V1_1", "V1_2"]


@pytest.mark.parametrize("version", VERSIONS)
def test_cts_version_passes(version):
    folder = CTS / version
    if not folder.exists():
        pytest.skip(f"{folder} is not beside the checkout")
    outcomes = cts.run([str(folder)])
    failed = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status == "failed"]
    skipped = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status == "skipped"]
    assert outcomes, "no vectors found"
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:50])
    assert not skipped, f"{len(skipped)} skipped:\n" + "\n".join(skipped[:50])
    suites = {o.suite for o in outcomes}
    assert "GeneratedTests" in suites and "DynamicOutputShapeTest" in suites


@pytest.mark.parametrize("kind", ["reference", "sample-float-fast", "sample-quant"])
def test_cts_v1_0_on_an_out_of_process_service(kind):
    """V1_0 through a driver service process: every vector the device supports
    passes; the reference service supports them all."""
    folder = CTS / "V1_0"
    if not folder.exists():
        pytest.skip(f"{folder} is not beside the checkout")
    outcomes = cts.run([str(folder)], device=kind, spawn=[kind])
    failed = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status == "failed"]
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:50])
    passed = [o for o in outcomes if o.status == "passed"]
    skipped = [o for o in outcomes if o.status == "skipped"]
    assert passed
    if kind == "reference":
        assert not skipped
    else:
        assert all("device reports unsupported" in o.detail for o in skipped)
