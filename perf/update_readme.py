"""Put a suite run's headline table into README.md (between the headline markers).

    python perf/update_readme.py perf/results/<date>-h100

The table is DIR/headline.md as perf/suite.py wrote it (the seed cases of
test_cases/test.txt, every implementation, same run), so the README's numbers are never
typed by hand. The text between `<!-- headline:begin -->` and `<!-- headline:end -->` is
replaced; a README without both markers is an error (nothing is written).
"""

import sys
from pathlib import Path

BEGIN = "<!-- headline:begin -->"
END = "<!-- headline:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"


def replace_headline(readme: str, table: str, source: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README has no '{BEGIN}' ... '{END}' block")
    block = f"{BEGIN}\n<!-- generated from {source}/headline.md by perf/update_readme.py -->\n\n{table.strip()}\n\n"
    return readme[:start] + block + readme[end:]


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(argv[0])
    table = (directory / "headline.md").read_text()
    if not table.strip():
        print(f"{directory}/headline.md is empty (the run measured no seed case)", file=sys.stderr)
        return 1
    README.write_text(replace_headline(README.read_text(), table, directory.as_posix()))
    print(f"README.md headline <- {directory / 'headline.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
