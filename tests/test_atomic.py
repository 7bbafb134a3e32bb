import os
import stat

import pytest

from dlrm.data.atomic import write_atomically, write_text_atomically


def test_replaces_the_whole_file_with_shared_permissions(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    write_text_atomically(path, "old")
    old_umask = os.umask(0o022)
    try:
        write_text_atomically(path, "new")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(path.parent) == ["f.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    write_text_atomically(path, "old")

    def half_then_fail(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically(path, half_then_fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]
