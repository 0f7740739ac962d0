"""QoS across hosts (issue 42): two client processes, each presenting its
own TLS client certificate, flood one model on one remote driver service
whose policy gives the two certificate names weights 3 and 1; the serving
host's scheduler gives them 3:1 of the device. The shares are read from the
server's own records (read over its local socket, as an operator would),
over the time both apps had work in it -- never from wall-clock luck."""
import numpy as np  # noqa: F401  (the flooders import it too)

import nnrt
from nnrt.service.client import ServiceDevice

from ..conftest import start_remote_service, stop
from .test_qos_apps import _collect, _flooder, _report
from .test_qos_service import _contended_run_time, _env
from .test_remote import HOST, pki  # noqa: F401  (a fixture)


async def test_two_client_certificates_get_the_policys_shares_of_one_remote_device(pki,  # noqa: F811
                                                                                  tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('[[app]]\nname = "cameras"\nremote = "camera"\nweight = 3\n\n'
                      '[[app]]\nname = "batches"\nremote = "batch"\nweight = 1\n')
    socket = tmp_path / "npu.sock"
    proc, target = start_remote_service(
        f"{HOST}:0", "reference", "npu", "--socket", str(socket), "--statistics", "all",
        "--policy", str(policy), "--tls-cert", str(pki["server"]),
        "--tls-key", str(pki["server.key"]), "--client-ca", str(pki["ca"]))
    try:
        local = await ServiceDevice.connect(str(socket))
        async with nnrt.Runtime(devices=[local]) as rt:
            env = _env(target, tmp_path)      # NNRT_DRIVERS names the grpcs:// target
            apps = [("remote", "camera"), ("remote", "batch")]
            # The weight-3 app keeps fewer executions in flight than the other;
            # both keep enough that each mostly has one queued behind the
            # running one while its client is between round trips.
            procs = [_flooder(dict(env, NNRT_REMOTE_CA=str(pki["ca"]),
                                   NNRT_REMOTE_CERT=str(pki[cn]),
                                   NNRT_REMOTE_KEY=str(pki[f"{cn}.key"])), 2.0, inflight)
                     for (_, cn), inflight in zip(apps, (3, 4))]
            seen, seen_apps = {}, {}
            await _collect(rt, "npu", procs, seen, seen_apps)
            reports = [_report(p) for p in procs]
        local.close()
    finally:
        stop(proc)
    assert all(r["runs"] > 0 for r in reports), reports
    # What the policy gave each certificate's app, as the server saw it.
    rules = {a.app: (a.rule, a.weight) for a in seen_apps.values()}
    assert rules[apps[0]] == ("cameras", 3) and rules[apps[1]] == ("batches", 1), rules
    # Device time from the server's records, over the time both apps had
    # work queued or running there.
    times = _contended_run_time(sorted(seen.values(), key=lambda r: r.finished_at), apps)
    assert min(times) > 0.2, (times, reports)
    share = times[0] / sum(times)
    assert 0.70 <= share <= 0.80, (share, times, reports)
