"""Where ``nnrt driver serve --metrics`` may listen (nnrt/service/metrics.py):
plain HTTP on loopback only, as ``--listen --insecure``; anywhere with TLS.
What it serves is checked against a real service in
tests/integration/test_remote_pool.py."""
import pytest

from nnrt.errors import NnrtError
from nnrt.service.metrics import check_metrics_address


@pytest.mark.parametrize("address", ["127.0.0.1:9464", "127.0.0.3:0", "[::1]:9464",
                                     "localhost:9464"])
def test_plain_http_is_served_on_loopback(address):
    check_metrics_address(address, tls=False)


@pytest.mark.parametrize("address", ["0.0.0.0:9464", "10.0.0.5:9464", "[::]:9464",
                                     "metrics.example:9464"])
def test_plain_http_off_loopback_is_refused_and_https_is_not(address):
    with pytest.raises(NnrtError, match="loopback addresses only"):
        check_metrics_address(address, tls=False)
    check_metrics_address(address, tls=True)


def test_an_address_that_is_not_host_port_is_refused():
    with pytest.raises(NnrtError, match="is not HOST:PORT"):
        check_metrics_address("9464", tls=True)
