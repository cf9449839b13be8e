"""The bench command with flash-attn-4 timed beside cute_flash and SDPA (GPU script).

    python perf/compare.py [bench options, e.g. --causal both --out DIR]

Same checks, timing, table and CSV as `python -m cute_flash bench`; flash-attn-4's CuTe
kernel (`flash_attn.cute.flash_attn_func`, when importable) is added as a peer and timed on
(B, S, N, D)-contiguous copies of the inputs, its native layout. It lives here, outside the
package, because cute_flash never imports flash_attn.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cute_flash import __main__ as cli  # noqa: E402


def flash_attn_4_peers(causal):
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - comparison only
        print(f"flash-attn-4 not importable ({type(exc).__name__}): not timed", file=sys.stderr)
        return {}

    def make(q, k, v):
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return lambda: flash_attn_func(qt, kt, vt, causal=causal)

    return {"flash_attn_4": make}


if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]], extra_peers=flash_attn_4_peers))
