"""benchmarks/_nvml.py: the NVML handle of a torch device is looked up by its PCI bus id, never by torch's index (which
`CUDA_VISIBLE_DEVICES` renumbers), and a bus id NVML does not know is a clear error (a fake NVML: the real one needs
a GPU)."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch
from _bench_helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import _nvml  # noqa: E402


class _FakeNvml(types.ModuleType):
    class NVMLError(Exception):
        pass

    def __init__(self, known: set[str]):
        super().__init__("pynvml")
        self.known, self.asked = known, []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus: bytes):
        self.asked.append(bus.decode())
        if bus.decode() not in self.known:
            raise self.NVMLError("not found")
        return ("handle", bus.decode())

    def nvmlDeviceGetHandleByIndex(self, index):  # pragma: no cover - must not be called
        raise AssertionError("looked up by index")


def _props(domain: int, bus: int, dev: int):
    return types.SimpleNamespace(pci_domain_id=domain, pci_bus_id=bus, pci_device_id=dev, name="GPU")


def test_the_handle_is_the_card_at_the_device_s_pci_bus_id(monkeypatch):
    domain, bus, dev = random.randrange(4), random.randrange(256), random.randrange(32)
    want = f"{domain:08X}:{bus:02X}:{dev:02X}.0"
    fake = _FakeNvml({want})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _props(domain, bus, dev))
    assert _nvml.nvml_handle(random.randrange(8)) == ("handle", want)
    assert fake.asked == [want]


def test_a_bus_id_nvml_does_not_know_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(set()))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _props(0, 0x1A, 0))
    with pytest.raises(RuntimeError, match="00000000:1A:00.0"):
        _nvml.nvml_handle(0)
