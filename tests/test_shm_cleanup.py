"""RAM-backed leftovers in /dev/shm are swept: a killed worker's weights, DeepSpeed's buffers.

Before this, a dozen killed runs had left 9 GB in /dev/shm, and the kernel OOM-killed the learner."""
import mmap
import subprocess
import sys

from toolrl.learner.housekeeping import clear_stale_shm_buffers
from toolrl.weightsync.receiver import WeightAssembler, remove_stale_weight_dirs


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_weight_dirs_of_dead_workers_are_removed_live_ones_kept(tmp_path):
    dead = tmp_path / f"toolrl-weights-worker-0-{dead_pid()}"
    live = tmp_path / f"toolrl-weights-w-a-{__import__('os').getpid()}"
    other = tmp_path / "something-else-1"
    for d in (dead, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 100)
    assert remove_stale_weight_dirs(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir() and other.is_dir()


def test_assembler_close_removes_its_directory(tmp_path):
    a = WeightAssembler(tmp_path / "toolrl-weights-w-1")
    (a.out_dir / "v1-0").mkdir()
    (a.out_dir / "v1-0" / "bucket-00000.safetensors").write_bytes(b"weights")
    a.close()
    assert not (tmp_path / "toolrl-weights-w-1").exists()


def test_only_unmapped_deepspeed_buffers_are_removed(tmp_path):
    stale, in_use = (tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_{port}_0" for port in (1, 2))
    for f in (stale, in_use):
        f.write_bytes(b"\0" * 4096)
    with open(in_use, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        assert clear_stale_shm_buffers(tmp_path) == [stale]
        assert in_use.exists() and not stale.exists()
