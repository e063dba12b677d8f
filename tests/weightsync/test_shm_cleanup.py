"""RAM-backed leftovers in /dev/shm are swept: a killed worker's weights (DeepSpeed's buffers: tests/learner).

Before this, a dozen killed runs had left 9 GB in /dev/shm, and the kernel OOM-killed the learner."""
import subprocess
import sys

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
