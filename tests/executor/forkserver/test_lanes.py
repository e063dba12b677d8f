"""Cleaning a lane's working dir: whatever a run leaves, removal neither raises nor follows links."""
import os

from toolrl.executor.forkserver.lanes import remove_tree


def test_remove_tree_survives_depth_and_long_paths_and_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    root = tmp_path / "work"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    try:  # 3000 levels of 20-character names: 63 000 characters of path, far past PATH_MAX
        for i in range(3000):
            name = f"d{i:019d}"
            os.mkdir(name, dir_fd=fd)
            if i % 500 == 0:
                os.symlink(outside, "link", dir_fd=fd)
                with open(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd), "w") as f:
                    f.write("x")
            nxt = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    (root / "top-level-file").write_text("y")
    os.symlink(outside, root / "top-link")
    assert remove_tree(str(root)) is True
    assert not root.exists()
    assert (outside / "keep").read_text() == "precious"  # links were removed, not followed
    assert remove_tree(str(root)) is True  # already gone: nothing to do, no error
