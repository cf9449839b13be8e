"""The benchmark case file and its parser."""

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
