"""Speed of the issue-21 variants beside the peers that run them, in the same run:
grouped-query attention (training shapes and decode steps), a sliding window, softcap, a
value head dim of its own (DeepSeek's (192, 128), issue 20) beside the square D = 192 tile,
and real models' layers with all their variants at once (Gemma 2, gpt-oss, Mistral).

    python perf/variants.py --out DIR [--rounds 3] [--only SUBSTRING]

Each case times cute_flash and each peer that runs it (flash-attn-4 `flash_attn.cute`
when importable, cuDNN / flash through SDPA where they take the case) with CUDA events, L2
flushed before each sample, in interleaved rounds; the median of the rounds' medians is
reported. Writes DIR/variants.csv, DIR/variants.md and DIR/variants.png. Decode cases (one
query row, grouped heads) run forward only, with cute_flash also unpacked (one row per CTA),
and report the K/V bytes read per second.
"""

import argparse
import csv
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import attention_flops  # noqa: E402
from bar_plot import save_png  # noqa: E402
from peers import in_grad_mode, interleaved_medians, runnable_steps  # noqa: E402

BF16 = torch.bfloat16


def fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # not installed, or no GPU build
        print(f"flash-attn-4 not importable ({type(exc).__name__}): not timed", file=sys.stderr)
        return None
    return flash_attn_func


def sdpa(backend, **kwargs):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return run


def cases():
    """(name, shape (B, N, Nkv, S, D) or (B, N, Nkv, Sq, Sk, D), cute_flash kwargs, flash-attn-4
    kwargs, SDPA kwargs or None). D may be a pair (D, Dv): v's head dim of its own."""
    for causal in (False, True):
        yield (f"gqa 32/8 {'causal' if causal else 'full'}", (4, 32, 8, 8192, 128), dict(causal=causal),
               dict(causal=causal), dict(is_causal=causal, enable_gqa=True))
    yield ("causal (window baseline)", (1, 16, 16, 32768, 128), dict(causal=True), dict(causal=True),
           dict(is_causal=True))
    yield ("window 4096 causal", (1, 16, 16, 32768, 128), dict(causal=True, window_size=(4096, 0)),
           dict(causal=True, window_size=(4096, 0)), None)
    for causal in (True, False):
        mask = "causal" if causal else "full"
        yield (f"{mask} (softcap baseline)", (4, 32, 32, 8192, 128), dict(causal=causal), dict(causal=causal),
               dict(is_causal=causal))
        # 30 and Gemma 2's 50: both without a running maximum in bf16 (kernels/softmax.py).
        for cap in (30.0, 50.0):
            yield (f"softcap {cap:g} {mask}", (4, 32, 32, 8192, 128), dict(causal=causal, softcap=cap),
                   dict(causal=causal, softcap=cap), None)
    for causal in (False, True):
        yield (f"Dv 192/128 {'causal' if causal else 'full'}", (4, 32, 32, 8192, (192, 128)), dict(causal=causal),
               dict(causal=causal), dict(is_causal=causal))
    # Issue 20's wide head dims (192: also the square tile the pair's backward runs on).
    for d in (96, 192, 256):
        for causal in (False, True):
            yield (f"D {d} {'causal' if causal else 'full'}", (4, 32, 32, 8192, d), dict(causal=causal),
                   dict(causal=causal), dict(is_causal=causal))
    # Real models' attention layers, every variant of the layer at once (sink=True: a learnable
    # sink per query head, flash-attn-4's learnable_sink).
    models = [
        ("gemma2-27b sliding", (2, 32, 16, 8192, 128), dict(window_size=(4095, 0), softcap=50.0)),
        ("gemma2-27b global", (2, 32, 16, 8192, 128), dict(softcap=50.0)),
        ("gemma2-9b sliding", (2, 16, 8, 8192, 256), dict(window_size=(4095, 0), softcap=50.0)),
        ("gpt-oss sliding", (2, 64, 8, 8192, 64), dict(window_size=(127, 0), sink=True)),
        ("gpt-oss global", (2, 64, 8, 8192, 64), dict(sink=True)),
        ("mistral sliding", (2, 32, 8, 16384, 128), dict(window_size=(4095, 0))),
    ]
    for name, shape, kwargs in models:
        theirs = {("learnable_sink" if key == "sink" else key): value for key, value in kwargs.items()}
        yield (f"model {name}", shape, dict(causal=True, **kwargs), dict(causal=True, **theirs), None)
    for batch in (1, 8, 64):
        for cache in (4096, 32768):
            yield (f"decode gqa 32/8 B={batch} Sk={cache}", (batch, 32, 8, 1, cache, 128),
                   dict(causal=True, alignment="bottom_right"), dict(causal=True),
                   dict(is_causal=False, enable_gqa=True))
    # A few positions per step (speculative decoding) on a dense batch: the group as rows.
    for batch in (8, 64):
        for cache in (4096, 32768):
            yield (f"verify gqa 32/8 Sq=4 B={batch} Sk={cache}", (batch, 32, 8, 4, cache, 128),
                   dict(causal=True, alignment="bottom_right"), dict(causal=True), None)


def implementations(shape, ours, theirs, sdpa_kwargs):
    from torch.nn.attention import SDPBackend

    b, n, nkv, sq, sk, (d, dv) = dims(shape)
    if ours.get("sink"):
        # One (N,) float32 tensor of sink logits, learnable, shared by both sides.
        sink = torch.randn(n, device="cuda", dtype=torch.float32, requires_grad=True)
        ours, theirs = dict(ours, sink=sink), dict(theirs, learnable_sink=sink)
    q = torch.randn(b, n, sq, d, device="cuda", dtype=BF16, requires_grad=True)
    k = torch.randn(b, nkv, sk, d, device="cuda", dtype=BF16, requires_grad=True)
    v = torch.randn(b, nkv, sk, dv, device="cuda", dtype=BF16, requires_grad=True)
    impls = {"cute_flash": lambda: cute_flash.flash_attention(q, k, v, **ours)}
    if sq <= 16 and nkv < n:
        # The same call with the query heads unpacked (each query head's rows a CTA of its own),
        # for what packing the group into a tile's rows gains.
        from cute_flash import api

        def unpacked():
            packs, groups = api._packs_query_heads, api._groups_query_rows
            api._packs_query_heads = api._groups_query_rows = lambda *args: False
            try:
                return cute_flash.flash_attention(q, k, v, **ours)
            finally:
                api._packs_query_heads, api._groups_query_rows = packs, groups
        impls["cute_flash_unpacked"] = unpacked
    flash = fa4()
    if flash is not None:
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        impls["flash_attn_4"] = lambda: _first(flash(qt, kt, vt, **theirs))
    if sdpa_kwargs is not None:
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            impls[name] = (lambda run: lambda: run(q, k, v))(sdpa(backend, **sdpa_kwargs))
    return impls, (q, k, v)


def dims(shape):
    """(B, N, Nkv, Sq, Sk, (D, Dv)) of a case's shape."""
    b, n, nkv, sq, sk, d = shape if len(shape) == 6 else (*shape[:3], shape[3], *shape[3:])
    return b, n, nkv, sq, sk, d if isinstance(d, tuple) else (d, d)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def measure(fn, direction):
    if direction == "fwd":
        with torch.no_grad():
            fn()
        return lambda: fn()
    out = fn()
    grad = torch.randn_like(out)

    def step():
        fn().backward(grad)
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="run the cases whose name contains this (or, comma-separated, "
                                                   "any of these)")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, shape, ours, theirs, sdpa_kwargs in cases():
        if not any(part in name for part in args.only.split(",")):
            continue
        impls, _ = implementations(shape, ours, theirs, sdpa_kwargs)
        for direction in ("fwd",) if len(shape) == 6 else ("fwd", "fwd+bwd"):
            steps = {}
            for impl, fn in impls.items():
                try:
                    steps[impl] = in_grad_mode(measure(fn, direction), direction != "fwd")
                except Exception as exc:  # a peer that does not take this case
                    print(f"{name} {direction} {impl}: skipped ({type(exc).__name__}: {str(exc)[:80]})",
                          file=sys.stderr)
            medians = interleaved_medians(runnable_steps(steps, f"{name} {direction}"), args.rounds, 5)
            b, n, nkv, sq, sk, (d, dv) = dims(shape)
            causal = ours.get("causal", False) and sq == sk
            # Q K^T over D and P V over Dv: the FLOPs of head dim (D + Dv) / 2.
            flops = attention_flops(b, n, sq, sk, (d + dv) / 2, causal) * (1 if direction == "fwd" else 3.5)
            kv_bytes = b * nkv * sk * (d + dv) * 2  # K and V once
            label = "x".join(str(x) if not isinstance(x, tuple) else "/".join(map(str, x)) for x in shape)
            for impl, ms in medians.items():
                rows.append(dict(case=name, shape=label, direction=direction, impl=impl,
                                 ms=round(ms, 4), tflops_nominal=round(flops / ms / 1e9, 1),
                                 kv_gb_per_s=round(kv_bytes / ms / 1e6, 1)))
                print(f"{name:28s} {direction:8s} {impl:20s} {ms:9.4f} ms", flush=True)
    with open(out_dir / "variants.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| case | direction | impl | ms | K/V GB/s | ours / best peer |", "|---|---|---|---|---|---|"]
    for row in rows:
        peers = [r["ms"] for r in rows if r["case"] == row["case"] and r["direction"] == row["direction"]
                 and not r["impl"].startswith("cute_flash")]
        ratio = f"{min(peers) / row['ms']:.2f}x" if row["impl"] == "cute_flash" and peers else ""
        lines.append(f"| {row['case']} | {row['direction']} | {row['impl']} | {row['ms']} | {row['kv_gb_per_s']} "
                     f"| {ratio} |")
    (out_dir / "variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = sorted({(r["case"], r["direction"]) for r in rows}, key=lambda x: (x[0], x[1]))
        impls = sorted({r["impl"] for r in rows})
        fig, ax = plt.subplots(figsize=(12, 5))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            values = [next((r["ms"] for r in rows if (r["case"], r["direction"]) == lab and r["impl"] == impl), 0)
                      for lab in labels]
            ax.bar([j + i * width for j in range(len(labels))], values, width, label=impl)
        ax.set_xticks([j + 0.4 for j in range(len(labels))], [f"{c}\n{d}" for c, d in labels], fontsize=6,
                      rotation=35, ha="right")
        ax.set_ylabel("ms (lower is better)")
        ax.legend()
        fig.tight_layout()
        save_png(fig, out_dir / "variants.png")
    except Exception as exc:
        print(f"no plot ({type(exc).__name__})", file=sys.stderr)


if __name__ == "__main__":
    main()
