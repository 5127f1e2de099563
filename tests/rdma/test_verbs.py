"""The verbs (pyverbs RDMA) transport with real RC queue pairs: run inside the soft-RoCE VM
(.ci/run_rdma_tests.sh), skipped where no RDMA port is ACTIVE.

Two ranks are two plain processes joined by a SocketExchanger (no MPI inside the VM); they run the
same scenarios as the TCP test (tests/cpu/test_proxy_scenarios.py), once per notify mode.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_proxy_tcp import run_socket_ranks  # noqa: E402

os.environ.setdefault("MK_TEST_SMALL", "1")  # inherited by the rank processes

from mkernel.errors import CommError  # noqa: E402
from mkernel.proxy.transport import Exchanger, HostWindow, select_transport  # noqa: E402
from mkernel.proxy.transport import verbs  # noqa: E402

pytestmark = [pytest.mark.rdma,
              pytest.mark.skipif(not verbs.available(), reason="no pyverbs or no ACTIVE RDMA port")]

SCENARIOS = ["shutdown", "many", "large", "backpressure", "flag_batching", "ordering", "barrier"]


class SoloEx(Exchanger):
    rank, size = 0, 1

    def allgather(self, obj):
        return [obj]


def test_auto_selection_picks_verbs(monkeypatch):
    monkeypatch.delenv("MKERNEL_TRANSPORT", raising=False)
    assert select_transport().name == "verbs"
    monkeypatch.setenv("MKERNEL_TRANSPORT", "tcp")
    assert select_transport().name == "tcp"


@pytest.mark.parametrize("notify", ["write", "send"])
def test_verbs_two_ranks(notify):
    rcs, outs = run_socket_ranks(2, SCENARIOS, transport="verbs", timeout=400, extra=["--opt", f"notify={notify}"])
    text = "\n".join(outs)
    print(text)
    assert rcs == [0, 0], text[-6000:]
    for sc in SCENARIOS:
        assert text.count(f"OK {sc} ") == 2, text[-6000:]


def test_verbs_dead_peer():
    rcs, outs = run_socket_ranks(2, ["dead_peer"], transport="verbs", timeout=120, extra=["--opt", "qp_timeout=10"])
    print("\n".join(outs))
    assert rcs[0] == 0 and "dead peer detected" in outs[0], "\n".join(outs)[-4000:]


def test_verbs_peer_fault_mid_stream_is_a_comm_error_naming_the_peer():
    """Rank 1 breaks its side mid-stream (its QP to rank 0 into IBV_QPS_ERR; then, on fresh QPs, its
    data window's MR deregistered): rank 0's proxy fails with a CommError naming rank 1 within the
    timeout + slack, and both ranks close promptly (checks in test_proxy_scenarios._verbs_fault)."""
    scenarios = ["verbs_peer_qp_error", "verbs_peer_mr_gone"]
    rcs, outs = run_socket_ranks(2, scenarios, transport="verbs", timeout=180)
    text = "\n".join(outs)
    print(text)
    assert rcs == [0, 0], text[-6000:]
    for sc in scenarios:
        assert text.count(f"OK {sc} ") == 2, text[-6000:]


def test_missing_device_is_a_clear_error():
    t = verbs.VerbsTransport(SoloEx(), [HostWindow(4096)], device="mlx5_nope")
    with pytest.raises(CommError, match="mlx5_nope.*not found"):
        t.connect()


def test_missing_device_from_env(monkeypatch):
    monkeypatch.setenv("MKERNEL_IB_DEVICE", "nonesuch0")
    with pytest.raises(CommError, match="nonesuch0"):
        verbs.choose_device(0)


@pytest.mark.parametrize("gid_index", [100000, 7])
def test_bad_gid_index_is_a_clear_error(gid_index):
    t = verbs.VerbsTransport(SoloEx(), [HostWindow(4096)], gid_index=gid_index)
    with pytest.raises(CommError, match="GID index"):
        t.connect()


def test_gid_choice_prefers_roce_v2_ipv4():
    name, port = verbs.choose_device(0)
    i = verbs.choose_gid_index(name, port)
    gid = open(f"/sys/class/infiniband/{name}/ports/{port}/gids/{i}").read()
    assert gid.startswith("0000:0000:0000:0000:0000:ffff:"), gid
