"""What every benchmark records about the machine it ran on (results differ between CPUs)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, or what ``platform`` knows elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_record() -> dict:
    """The ``machine`` entry of a benchmark's JSON: CPU model and count, Python, load average
    (1, 5, 15 min) when it is called (a loaded shared machine slows every timing)."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
    }
