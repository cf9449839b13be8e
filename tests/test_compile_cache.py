"""compile_cache.load_or_compile without a GPU: a disk-cache hit or a compile, each logged at
INFO on the `cute_flash` logger with its time (silent by default)."""

import logging

from cute_flash import compile_cache, disk_cache


class Exported:
    """Stands in for a compiled kernel: export_to_c writes an object file."""

    def export_to_c(self, object_file_path, function_name):
        with open(object_file_path, "wb") as f:
            f.write(b"not really an object file")


def test_compile_then_load_are_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(disk_cache, "link_shared_library", lambda path: None)
    monkeypatch.setattr(disk_cache, "_load_object_file", lambda path: "loaded kernel")
    key = ("fwd", "float16", 64, True, "config", "sm_90a")
    with caplog.at_level(logging.INFO, logger="cute_flash"):
        fn, compiled = compile_cache.load_or_compile(key, Exported)
        assert compiled and isinstance(fn, Exported)
        fn, compiled = compile_cache.load_or_compile(key, lambda: 1 / 0)
        assert not compiled and fn == "loaded kernel"
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("cute_flash")]
    assert len(messages) == 2
    assert messages[0].startswith("compiled ('fwd', 'float16', 64") and " s" in messages[0]
    assert messages[1].startswith("loaded ('fwd', 'float16', 64") and "from the disk cache" in messages[1]


def test_nothing_is_printed_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUTE_FLASH_DISK_CACHE", "0")
    compile_cache.load_or_compile(("fwd", "x"), Exported)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
