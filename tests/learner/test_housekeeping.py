"""DeepSpeed's CPU all-reduce buffers (67 MB each, in /dev/shm, never unlinked by DeepSpeed) are
swept when no live process maps them: a dozen killed runs had left 9 GB and the kernel OOM-killed
the learner."""
import mmap

from toolrl.learner.housekeeping import clear_stale_shm_buffers


def test_only_unmapped_deepspeed_buffers_are_removed(tmp_path):
    stale, in_use = (tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_{port}_0" for port in (1, 2))
    for f in (stale, in_use):
        f.write_bytes(b"\0" * 4096)
    with open(in_use, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        assert clear_stale_shm_buffers(tmp_path) == [stale]
        assert in_use.exists() and not stale.exists()
