"""The benchmark case file and its parser."""

from pathlib import Path

import pytest

from cute_flash.test_cases import DEFAULT_CASES, Case, CaseFileError, load_cases, parse_cases


def test_shipped_cases_are_the_three_reference_shapes():
    assert [c.shape for c in load_cases()] == [(1, 64, 1024, 128), (2, 64, 4096, 128), (4, 64, 8192, 128)]
    assert DEFAULT_CASES.name == "test.txt"


def test_comments_blank_lines_and_spacing():
    text = "# header\n\n  2 8 17 64   # trailing comment\n\t1\t1\t1\t128\n"
    assert parse_cases(text) == [Case(2, 8, 17, 64), Case(1, 1, 1, 128)]
    assert str(Case(2, 8, 17, 64)) == "2x8x17x64"


@pytest.mark.parametrize("line, words", [
    ("1 2 3", [":1:", "expected 4 integers", "3 field(s)"]),
    ("1 2 3 4 5", [":1:", "5 field(s)"]),
    ("1 2 x 4", [":1:", "expected integers", "'1 2 x 4'"]),
    ("1 2 3.5 4", [":1:", "expected integers"]),
    ("1 0 3 4", [":1:", "must be positive"]),
    ("1 -2 3 4", [":1:", "must be positive"]),
])
def test_bad_lines_name_the_line(line, words):
    with pytest.raises(CaseFileError) as info:
        parse_cases(line, "cases.txt")
    assert str(info.value).startswith("cases.txt:1:")
    for word in words:
        assert word in str(info.value)


def test_error_points_at_the_right_line():
    with pytest.raises(CaseFileError, match=r"f\.txt:3:"):
        parse_cases("1 1 1 64\n# ok\n1 1 1\n", "f.txt")


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n")
    with pytest.raises(CaseFileError, match="no cases"):
        load_cases(empty)
    with pytest.raises(CaseFileError, match="cannot read case file"):
        load_cases(tmp_path / "absent.txt")


def test_default_case_file_lookup_order(tmp_path, monkeypatch):
    """The package's cases/test.txt (a wheel install), else the checkout's test_cases/test.txt
    beside the package (editable install or PYTHONPATH)."""
    from cute_flash import test_cases

    site = tmp_path.resolve() / "site"
    (site / "cute_flash").mkdir(parents=True)
    monkeypatch.setattr(test_cases, "__file__", str(site / "cute_flash" / "test_cases.py"))
    assert test_cases._default_cases() == site / "test_cases" / "test.txt"
    (site / "cute_flash" / "cases").mkdir()
    (site / "cute_flash" / "cases" / "test.txt").write_text("1 1 1 64\n")
    assert test_cases._default_cases() == site / "cute_flash" / "cases" / "test.txt"


def test_checkout_uses_its_top_level_case_file():
    import cute_flash

    repo = Path(__file__).resolve().parent.parent
    assert not (repo / "cute_flash" / "cases").exists()
    if Path(cute_flash.__file__).resolve().parent == repo / "cute_flash":  # imported from this checkout
        assert DEFAULT_CASES == repo / "test_cases" / "test.txt"
