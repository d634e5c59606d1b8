"""Where a benchmark's CPU went: the machine's busy time over a window, and its share by
process kind (the workers, Postgres, Redis, the rest), read from /proc.

A throughput benchmark whose every side is CPU-bound on the same cores is bounded by
the CPU one unit of work costs the whole machine: that cost, not the seconds, is the
floor a ratio between two systems can be explained by.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """The machine's CPU time spent not idle since boot, over every core."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


def _kind(pid: str) -> str:
    cmdline = (
        Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    )
    if cmdline.startswith("postgres"):
        return "postgres"
    if "redis-server" in cmdline:
        return "redis"
    if " worker " in f"{cmdline} " and ("celery" in cmdline or "fleet" in cmdline):
        return "workers"
    return "other"


def _by_kind() -> Counter[str]:
    """CPU seconds each process alive now has used, keyed ``kind:pid``."""
    seconds: Counter[str] = Counter()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            kind = _kind(pid)
        except OSError:
            continue  # it ended meanwhile
        after_name = stat.rsplit(")", 1)[1].split()
        utime, stime = int(after_name[11]), int(after_name[12])
        seconds[f"{kind}:{pid}"] = (utime + stime) / TICK
    return seconds


@dataclass
class CpuMeter:
    """CPU spent between ``start`` and ``stop``: the machine's, and each kind's (a
    process counts only while it lives through both readings, so its kind's share is a
    lower bound; the machine's is exact)."""

    busy: float = 0.0
    kinds: dict[str, float] = field(default_factory=dict)
    _busy0: float = 0.0
    _kinds0: Counter[str] = field(default_factory=Counter)

    def start(self) -> CpuMeter:
        self._busy0, self._kinds0 = _busy_seconds(), _by_kind()
        return self

    def stop(self) -> CpuMeter:
        busy, kinds = _busy_seconds(), _by_kind()
        self.busy = busy - self._busy0
        per_kind: Counter[str] = Counter()
        for key, used in kinds.items():  # each process's use since the first reading
            per_kind[key.partition(":")[0]] += used - self._kinds0.get(key, 0.0)
        self.kinds = dict(per_kind)
        return self

    def per_unit_ms(self, units: int) -> dict[str, float]:
        """Milliseconds of CPU per unit of work: the machine's and each kind's."""
        out = {"machine": self.busy * 1000 / units}
        out.update({k: v * 1000 / units for k, v in sorted(self.kinds.items())})
        return out
