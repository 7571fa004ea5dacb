import pytest

from memtree.io import atomic_dir, atomic_path, atomic_write_text


def test_atomic_write_keeps_old_version_on_failure(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        tmp.write_text("half-written")
        raise RuntimeError("crash")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["f.txt"]


def test_atomic_dir_publishes_whole_or_nothing(tmp_path):
    d = tmp_path / "stage"
    with pytest.raises(RuntimeError), atomic_dir(d) as tmp:
        (tmp / "a").write_text("1")
        raise RuntimeError("crash")
    assert not d.exists()
    with atomic_dir(d) as tmp:
        (tmp / "a").write_text("2")
    assert (d / "a").read_text() == "2"
