"""What every benchmark records about the machine it ran on (results differ between CPUs)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _first_cpu_fields() -> dict[str, str]:
    """``/proc/cpuinfo``'s fields of the first CPU (``"model name"``, ``"cpu family"``, ...);
    empty where there is no ``/proc``."""
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return {}
    fields = {}
    for line in first_cpu.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        fields[key] = value
    return fields


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, or what ``platform`` knows elsewhere."""
    return _first_cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_identity() -> dict:
    """Family, model and stepping, clock and the widest vector instructions, from
    ``/proc/cpuinfo``: cloud machines that all call themselves "AMD EPYC" differ in these (a
    Zen 4 with AVX-512 against a Zen 2 with AVX2 moves every product's time), so a result is
    only comparable with one from the same identity. Empty where there is no ``/proc``."""
    fields = _first_cpu_fields()
    if not fields:
        return {}
    flags = set(fields.get("flags", "").split())
    widest = next((isa for isa in ("avx512f", "avx2", "avx", "sse4_2") if isa in flags), "")
    return {
        "family": fields.get("cpu family", ""),
        "model": fields.get("model", ""),
        "stepping": fields.get("stepping", ""),
        "mhz": fields.get("cpu MHz", ""),
        "widest_simd": widest,
    }


def machine_record() -> dict:
    """The ``machine`` entry of a benchmark's JSON: CPU model, identity (``cpu_identity``) and
    count, Python, load average (1, 5, 15 min) when it is called (a loaded shared machine slows
    every timing)."""
    return {
        "cpu": cpu_model(),
        "cpu_identity": cpu_identity(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
    }
