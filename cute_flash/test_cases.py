"""The benchmark case file (test_cases/test.txt): one case per line, "B N S D".

'#' starts a comment (whole line or trailing); blank lines are ignored. Every other line
must be exactly four positive integers; anything else is an error naming the file and line.
"""

from dataclasses import dataclass
from pathlib import Path


def _default_cases() -> Path:
    """The packaged case file (cute_flash/cases/test.txt of an installed wheel, built from the
    repository's test_cases/test.txt), else the source checkout's test_cases/test.txt."""
    package = Path(__file__).resolve().parent
    packaged = package / "cases" / "test.txt"
    return packaged if packaged.is_file() else package.parent / "test_cases" / "test.txt"


DEFAULT_CASES = _default_cases()


class CaseFileError(ValueError):
    """A malformed case file; the message names the file and the line."""


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seqlen: int
    head_dim: int

    @property
    def shape(self):
        return (self.batch, self.heads, self.seqlen, self.head_dim)

    def __str__(self):
        return "x".join(map(str, self.shape))


def parse_cases(text: str, source: str = "<text>") -> list:
    cases = []
    for number, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        fields = content.split()
        if len(fields) != 4:
            raise CaseFileError(
                f"{source}:{number}: expected 4 integers 'B N S D', got {len(fields)} field(s): {content!r}"
            )
        try:
            values = [int(f) for f in fields]
        except ValueError:
            raise CaseFileError(f"{source}:{number}: expected integers 'B N S D', got {content!r}") from None
        if min(values) < 1:
            raise CaseFileError(f"{source}:{number}: sizes must be positive, got {content!r}")
        cases.append(Case(*values))
    return cases


def load_cases(path=None) -> list:
    path = Path(path) if path is not None else DEFAULT_CASES
    try:
        text = path.read_text()
    except OSError as exc:
        raise CaseFileError(f"{path}: cannot read case file ({exc.strerror})") from exc
    cases = parse_cases(text, str(path))
    if not cases:
        raise CaseFileError(f"{path}: no cases (expected lines 'B N S D')")
    return cases
