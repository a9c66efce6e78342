"""What the sidecar process uses, for the gauges dashboards built for Triton read
(``nv_cpu_utilization``, ``nv_cpu_memory_used_bytes``): CPU time over the wall time since the
last scrape, as a fraction of the cores this process may run on, and resident memory."""

from __future__ import annotations

import os
import threading
import time

from cuvil_sidecar.heap import resident_mib


class CpuUtilization:
    """Each ``read`` gives the process's CPU use since the previous one, in [0, 1]."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = (time.monotonic(), time.process_time())
        self.cores = max(1, len(os.sched_getaffinity(0)))

    def read(self) -> float:
        with self._lock:
            wall, cpu = time.monotonic(), time.process_time()
            last_wall, last_cpu = self._last
            self._last = (wall, cpu)
        elapsed = wall - last_wall
        if elapsed <= 0:
            return 0.0
        return min(1.0, max(0.0, (cpu - last_cpu) / elapsed / self.cores))


def resident_bytes() -> float:
    return resident_mib() * 2**20
