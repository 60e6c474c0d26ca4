"""The GPUs ``CUDA_VISIBLE_DEVICES`` makes visible, in every form CUDA accepts.

Referee: CUDA's documented rules for the variable (indices, ``GPU-`` UUIDs or unique
prefixes of them, ``MIG-`` instance UUIDs; the list ends at the first entry naming no
device), applied to a fake NVML holding three GPUs and one MIG instance.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from ampflow.devices import probe_devices, visible_devices

UUIDS = ["GPU-1a2b3c4d-0000-1111-2222-333344445555", "GPU-1a2b9999-0000-1111-2222-333344445555", "GPU-77778888-aaaa-bbbb-cccc-ddddeeeeffff"]
MIG = "MIG-0f0e0d0c-1111-2222-3333-444455556666"
GB = 1 << 30


class FakeNVML:
    class NVMLError(Exception):
        pass

    def __init__(self):
        self.gpus = [SimpleNamespace(uuid=u, name=f"GPU {i}", total=(40 + 40 * i) * GB) for i, u in enumerate(UUIDS)]
        self.mig = SimpleNamespace(uuid=MIG, name="GPU 2 MIG 1g.10gb", total=10 * GB)

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, u):
        for d in [*self.gpus, self.mig]:
            if d.uuid == u:
                return d
        raise self.NVMLError("not found")

    def nvmlDeviceGetUUID(self, h):
        return h.uuid.encode()  # older bindings return bytes

    def nvmlDeviceGetName(self, h):
        return h.name

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h.total, free=h.total // 2)


@pytest.mark.parametrize(
    "visible, names",
    [
        (None, ["GPU 0", "GPU 1", "GPU 2"]),
        ("2,0", ["GPU 2", "GPU 0"]),
        ("0,7,1", ["GPU 0"]),  # an unknown index ends the list
        (f"{UUIDS[2]},{UUIDS[0]}", ["GPU 2", "GPU 0"]),
        ("GPU-7777,1", ["GPU 2", "GPU 1"]),  # a unique prefix names its GPU
        ("GPU-1a2b,2", []),  # a prefix of two GPUs names none, and ends the list
        (f"{MIG}", ["GPU 2 MIG 1g.10gb"]),
        ("MIG-ffff,0", []),
        ("0,GPU-1a2b3c4d", ["GPU 0"]),  # the same GPU twice ends the list
        (" 1 , 2 ", ["GPU 1", "GPU 2"]),
        ("", []),
        ("none", []),
    ],
)
def test_visible_devices_follow_cuda(visible, names):
    assert [h.name for _, h in visible_devices(FakeNVML(), visible)] == names


def test_probe_reports_uuid_and_mig_allocations(monkeypatch):
    """A SLURM site that hands out UUIDs gets its GPUs, numbered as CUDA numbers them,
    with their memory (before, every entry but digits was dropped: no devices)."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUIDS[1]},{MIG}")
    devices = probe_devices()["devices"]
    assert [(d["index"], d["visible_as"], d["name"], d["memory_total"]) for d in devices] == [
        (0, UUIDS[1], "GPU 1", 80 * GB), (1, MIG, "GPU 2 MIG 1g.10gb", 10 * GB),
    ]  # fmt: skip


@pytest.mark.parametrize("order, warned", [(None, True), ("FASTEST_FIRST", True), ("PCI_BUS_ID", False)])
def test_probe_warns_when_cuda_may_number_the_gpus_otherwise(monkeypatch, caplog, order, warned):
    """NVML numbers GPUs by PCI bus; CUDA does so only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    (by default it puts the fastest first), so with two or more GPUs any other setting
    may make the plan's device i another card than torch's cuda:i."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if order is None:
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    with caplog.at_level("WARNING", logger="ampflow.devices"):
        info = probe_devices()
    assert info["cuda_device_order"] == order
    assert any("CUDA_DEVICE_ORDER" in r.getMessage() for r in caplog.records) == warned
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # one GPU: nothing to mix up
    caplog.clear()
    with caplog.at_level("WARNING", logger="ampflow.devices"):
        probe_devices()
    assert not caplog.records


@pytest.mark.parametrize("given, kept", [(None, "PCI_BUS_ID"), ("FASTEST_FIRST", "FASTEST_FIRST")])
def test_the_entry_point_numbers_gpus_by_pci_bus_unless_the_user_chose(monkeypatch, given, kept):
    """Set before any command touches CUDA, so that torch and torchrun's processes number
    the GPUs as NVML (the plan) does; a user's own setting stands."""
    from ampflow.cli import main

    monkeypatch.setenv("CUDA_DEVICE_ORDER", "restored at teardown")
    if given is None:
        monkeypatch.delenv("CUDA_DEVICE_ORDER")
    else:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", given)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["CUDA_DEVICE_ORDER"] == kept
