"""What DeepSpeed leaves behind on a CPU, cleaned up: stale build locks, shared-memory buffers,
and the CPU communication op compiled once at install time instead of inside a run."""
from __future__ import annotations

import os
import time
from pathlib import Path


def clear_stale_op_locks(max_age_s: float = 900.0) -> list[Path]:
    """Remove torch-extension build locks left by a process killed mid-compile.

    torch waits forever on such a lock (no timeout, no owner check), so one learner killed while
    DeepSpeed compiled its CPU ops would hang every later one. A compile takes minutes; a lock
    older than `max_age_s` has no live owner."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    removed = []
    for lock in root.glob("*/*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                removed.append(lock)
        except OSError:
            pass
    return removed


def clear_stale_shm_buffers(shm: str | Path = "/dev/shm") -> list[Path]:
    """Remove DeepSpeed CPU all-reduce buffers (`deepspeed_allreduce_buffer_*`, 67 MB each, in RAM)
    that no live process maps. DeepSpeed never unlinks them, so every learner run leaves one."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines()
                          if "deepspeed_allreduce_buffer" in line)
        except OSError:
            pass
    removed = []
    for f in Path(shm).glob("deepspeed_allreduce_buffer_*"):
        if str(f) not in mapped:
            try:
                f.unlink()
                removed.append(f)
            except OSError:
                pass
    return removed


def build_cpu_ops() -> None:
    """Compile DeepSpeed's CPU communication op now (`make install`), so no run or test pays minutes for it."""
    from deepspeed.accelerator import get_accelerator  # lazy: the cleanups above run without DeepSpeed

    for lock in clear_stale_op_locks(max_age_s=0):
        print(f"removed a stale build lock: {lock}")
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")  # torch AdamW: no fused_adam
    if builder is not None:
        t0 = time.time()
        builder.load()
        print(f"DeepSpeed op {builder.NAME} ready ({time.time() - t0:.0f}s)")
