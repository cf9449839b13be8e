"""Spill and GEMM-shape summary of the newest cubin in a directory (halves-backward WIP):
    python perf/experiments/halves_sass_check.py DIR"""
import sys, re
from pathlib import Path
from cute_flash.sass import disassemble
c = sorted(Path(sys.argv[1]).glob('*.cubin'), key=lambda p: p.stat().st_mtime)[-1]
s = disassemble(c)
print('  HGMMA', sorted(set(re.findall(r'HGMMA\.(\S+)', s))), 'LDL', len(re.findall(r'\bLDL', s)), 'STL', len(re.findall(r'\bSTL', s)))
