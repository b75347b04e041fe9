"""The C graph callback's build: compiled once into the cache, refused in one line without a compiler."""

import pytest

from stages import capture


def test_the_helper_is_built_once_into_the_cache_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = capture.library_path()
    assert built.parent == tmp_path / "specpipe" and built.suffix == ".so"
    stamp = built.stat().st_mtime_ns
    monkeypatch.setenv("CC", "/nonexistent/cc")  # a second use compiles nothing
    assert capture.library_path() == built and built.stat().st_mtime_ns == stamp
    assert not list(built.parent.glob("*.partial"))


def test_without_a_compiler_the_error_is_one_line_and_nothing_half_built_is_left(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(capture.CaptureError, match=r"could not build capture.c with the C compiler") as raised:
        capture.library_path()
    assert "\n" not in str(raised.value)
    assert list((tmp_path / "specpipe").iterdir()) == []
