"""Where a kernel's warp-stall samples go, from Nsight Compute's per-instruction source page:
split by how often each instruction ran (the hottest loop, once-per-tile code, the rest) and,
inside the loop, per 1000 iterations, so two kernels of different lengths (causal against
full, ours against a peer's) compare instruction by instruction.

    ncu --section SourceCounters -o REPORT ...           # one kernel per report
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > KERNEL.csv
    python perf/experiments/ncu_source_split.py KERNEL.csv [OTHER.csv ...]

An instruction run at most as often as the kernel's first one (once by every warp of every
CTA) counts as per-tile code (prologue, epilogue, one tile per CTA); the hottest loop is the
most-executed instructions.
(Thirtieth session: ours causal against full at (4, 32, 8192) (192, 128), perf/NOTES.md.)
"""

import argparse
import collections
import csv


def load(path):
    """[(offset, sass, samples, executed, {stall reason: samples})] of one kernel's source page."""
    rows = list(csv.reader(open(path, newline="")))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[header_at]
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [(name[len("stall_"):], i) for name, i in col.items()
                  if name.startswith("stall_") and "Not Issued" not in name]
    out = []
    for r in rows[header_at + 1:]:
        if len(r) < len(header):
            continue
        try:
            address = int(r[col["Address"]], 16)
        except ValueError:
            continue
        out.append((address, r[col["Source"]].strip(), int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
                    int(r[col["Instructions Executed"]] or 0),
                    {name: int(r[i] or 0) for name, i in stall_cols if r[i] not in ("", "0")}))
    base = out[0][0]
    return [(a - base, *rest) for a, *rest in out]


def report(path):
    ins = load(path)
    total = sum(i[2] for i in ins)
    loop_count = max(i[3] for i in ins)
    per_tile_limit = ins[0][3]  # the entry instruction: every warp of every CTA, once
    classes = collections.Counter()
    for _, _, samples, executed, _ in ins:
        cls = "loop" if executed == loop_count else ("per-tile" if executed <= per_tile_limit else "other")
        classes[cls] += samples
    print(f"== {path}: {len(ins)} instructions, {total} samples, loop executed {loop_count} times, "
          f"per-tile <= {per_tile_limit}")
    print("   " + ", ".join(f"{k} {v} ({100 * v / total:.1f} %)" for k, v in classes.most_common()))
    body = [i for i in ins if i[3] == loop_count]
    print(f"   loop: {len(body)} instructions, {1000 * sum(i[2] for i in body) / loop_count:.1f} samples per 1000 "
          "iterations; the instructions above 1 per 1000:")
    for offset, sass, samples, _, stalls in body:
        if 1000 * samples / loop_count > 1.0:
            top = ", ".join(f"{k} {v}" for k, v in collections.Counter(stalls).most_common(2))
            print(f"   {offset:6x} {1000 * samples / loop_count:7.2f}  {sass[:64]:64s} {top}")
    print("   outside the loop, hottest:")
    for offset, sass, samples, executed, _ in sorted((i for i in ins if i[3] != loop_count), key=lambda i: -i[2])[:10]:
        print(f"   {offset:6x} {samples:7d} x{executed:9d}  {sass[:64]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", nargs="+")
    args = parser.parse_args()
    for path in args.csv:
        report(path)


if __name__ == "__main__":
    main()
