"""What the agent reports about its machine: the GPU via torch.cuda, or the CPU."""

from __future__ import annotations

import os
import platform

from workers.contract import Hardware


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def detect_hardware(device: str = "auto") -> Hardware:
    """GPU name and per-device memory when CUDA is in use, else the CPU's."""
    cpu_count = os.cpu_count() or 1
    if device in ("auto", "cuda"):
        try:
            import torch  # only where a GPU may be in use, and optional (ImportError below)

            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                return Hardware(
                    device="cuda",
                    name=str(props.name),
                    num_devices=int(torch.cuda.device_count()),
                    memory_bytes=int(props.total_memory),
                    cpu_count=cpu_count,
                )
        except ImportError:
            pass
    return Hardware(
        device="cpu", name=_cpu_name(), num_devices=1, memory_bytes=_host_memory_bytes(), cpu_count=cpu_count
    )
