"""The NVML handle of a torch CUDA device, for the energy and clock readings of `bench_kernels.py --energy` and
`scripts/step_clocks.py`. Found by the device's PCI bus id: NVML numbers every GPU of the machine, torch only the
visible ones (`CUDA_VISIBLE_DEVICES`), so torch's index read as NVML's would measure another card."""

from __future__ import annotations

from typing import Any


def pci_bus_id(device: Any) -> str:
    """`device`'s PCI bus id as NVML spells it (`00000000:1A:00.0`)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def nvml_handle(device: Any) -> Any:
    """NVML's handle of torch's `device` (NVML initialised here); a RuntimeError naming the bus id where NVML has
    no GPU there."""
    import pynvml

    pynvml.nvmlInit()
    bus = pci_bus_id(device)
    try:
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
    except pynvml.NVMLError as exc:
        raise RuntimeError(
            f"NVML finds no GPU at PCI bus id {bus} (torch's {device}): run on the machine whose GPU is measured, "
            "with the driver's NVML (nvidia-ml-py) matching it"
        ) from exc
