"""Decode over a KV cache: bandwidth of cute_flash.flash_attn_with_kvcache beside the peers
that run the same step, in the same run.

    python perf/kvcache.py --out DIR [--rounds 5] [--graphs]
    python perf/kvcache.py --out DIR --prefill [--rounds 5]
    python perf/kvcache.py --out DIR --report DIR/kvcache.csv [--graphs]

One decode step (Sq = 1), 32 query heads, 8 key/value heads, D = 128, bf16, every sequence
with the whole cache in use, B in {1, 8, 64}, cache lengths {4k, 32k, 128k} (points above
16 GB of K/V skipped). Peers: cute_flash's dense path (flash_attention on the cache as
(B, Nkv, S, D) views; its decode packs a GQA group's query heads), flash-attn-4
(flash_attn_func on the cache), SDPA's cuDNN and efficient backends (enable_gqa),
FlexAttention (torch.compile'd, its decoding kernel), and a device-to-device copy of the same
bytes (the bandwidth bar). GB/s = bytes of K and V read
/ time. CUDA events, L2 flushed before each sample, interleaved rounds, median. Writes
DIR/kvcache.csv, .md and .png.

--prefill times a prefill over a cache instead: 2048 new tokens appended to 30720 cached ones
(S_max 32768), 32/8 heads, D = 128, bf16, causal (bottom-right), B = 1 and 4; beside
flash-attn-4 (flash_attn_func on the cache, which holds the new rows already: it has no append)
and our dense path on the same views; ours timed with and without its append (DIR/prefill.md).

--graphs times every implementation as a CUDA graph replay (captured once per point): the
kernels' time without the host's, as a serving loop that replays graphs sees it.

Paged (vLLM's layout): the same cache bytes seen as pages of PAGE_SIZE rows, each sequence's
pages listed in a random order by its block_table row (scattered reads, as a serving
system's free list leaves them), run by cute_flash and by flash-attn-4's varlen entry point
with its page_table; each implementation compared with the fastest peer of its own layout.
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
from bar_plot import grouped_bars  # noqa: E402
from peers import as_cuda_graph, interleaved_medians, runnable_steps  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE_SIZE = 64
PAGED = "_paged"
LIMIT_BYTES = 16 << 30


def implementations(batch, cache_len):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, **bf16)
    k_cache, v_cache = (torch.randn(batch, cache_len, KV_HEADS, HEAD_DIM, **bf16) for _ in range(2))
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    q_bnsd, k_bnsd, v_bnsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    impls = {
        "cute_flash_kvcache": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
        "cute_flash_kvcache_unsplit": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                                                 cache_seqlens=seqlens, num_splits=1),
        "cute_flash_dense": lambda: cute_flash.flash_attention(q_bnsd, k_bnsd, v_bnsd),
    }
    try:
        from flash_attn.cute import flash_attn_func

        impls["flash_attn_4"] = lambda: flash_attn_func(q, k_cache, v_cache)
    except Exception as exc:
        print(f"flash-attn-4 not importable ({type(exc).__name__}): not timed", file=sys.stderr)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q_bnsd, k_bnsd, v_bnsd, enable_gqa=True)
        return run
    impls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["sdpa_efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
    flex = flex_attention()
    if flex is not None:
        # FlexAttention compiled for this shape; with one query row it runs its decoding kernel.
        impls["flex_attention"] = lambda: flex(q_bnsd, k_bnsd, v_bnsd, enable_gqa=True)
    # Paged: the same bytes as pages, each sequence's listed in a random order.
    num_pages = batch * cache_len // PAGE_SIZE
    k_pages, v_pages = (c.view(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM) for c in (k_cache, v_cache))
    table = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, -1)
    impls["cute_flash" + PAGED] = lambda: cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                                             block_table=table)
    try:
        from flash_attn.cute import flash_attn_varlen_func

        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        impls["flash_attn_4" + PAGED] = lambda: flash_attn_varlen_func(
            q.view(batch, HEADS, HEAD_DIM), k_pages, v_pages, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seqlens,
            page_table=table)
    except Exception as exc:
        print(f"flash-attn-4's varlen entry point not importable ({type(exc).__name__}): not timed", file=sys.stderr)
    copy_out = torch.empty_like(k_cache)
    impls["copy_k_and_v"] = lambda: (copy_out.copy_(k_cache), copy_out.copy_(v_cache))
    return impls


_flex = []


def flex_attention():
    """torch.compile(flex_attention) (one compiled function for the run), or None where it
    cannot be imported."""
    if not _flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention as flex

            _flex.append(torch.compile(flex, dynamic=False))
        except Exception as exc:
            print(f"FlexAttention not available ({type(exc).__name__}): not timed", file=sys.stderr)
            _flex.append(None)
    return _flex[0]


def graphs_of(steps, label):
    """Each step as a CUDA graph replay (peers.as_cuda_graph); a step that cannot be captured
    is named on stderr and left out."""
    graphs = {}
    for name, step in steps.items():
        try:
            graphs[name] = as_cuda_graph(step)
        except Exception as exc:
            print(f"{label} {name}: no CUDA graph ({type(exc).__name__}: {str(exc)[:100]})", file=sys.stderr)
    return graphs


PREFILL_NEW, PREFILL_CACHED = 2048, 30720


def prefill_implementations(batch):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    cache_len = PREFILL_NEW + PREFILL_CACHED
    q = torch.randn(batch, PREFILL_NEW, HEADS, HEAD_DIM, **bf16)
    k_cache, v_cache = (torch.randn(batch, cache_len, KV_HEADS, HEAD_DIM, **bf16) for _ in range(2))
    k, v = (c[:, PREFILL_CACHED:].clone() for c in (k_cache, v_cache))
    cached = torch.full((batch,), PREFILL_CACHED, dtype=torch.int32, device="cuda")
    full = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    q_bnsd, k_bnsd, v_bnsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    impls = {
        "cute_flash_kvcache_append": lambda: cute_flash.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cached, causal=True),
        "cute_flash_kvcache": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full,
                                                                         causal=True),
        "cute_flash_dense": lambda: cute_flash.flash_attention(q_bnsd, k_bnsd, v_bnsd, causal=True,
                                                               alignment="bottom_right"),
    }
    try:
        from flash_attn.cute import flash_attn_func

        impls["flash_attn_4"] = lambda: flash_attn_func(q, k_cache, v_cache, causal=True)
    except Exception as exc:
        print(f"flash-attn-4 not importable ({type(exc).__name__}): not timed", file=sys.stderr)
    return impls


def prefill(args, out_dir):
    lines = [f"Prefill over a KV cache: {PREFILL_NEW} new tokens after {PREFILL_CACHED} cached, {HEADS}/{KV_HEADS} "
             f"heads, D = {HEAD_DIM}, bf16, causal (bottom-right); ms", "",
             "| B | implementation | ms | TFLOP/s | flash_attn_4 / this |", "|---|---|---:|---:|---:|"]
    for batch in (1, 4):
        with torch.no_grad():
            medians = interleaved_medians(runnable_steps(prefill_implementations(batch), f"prefill B={batch}"),
                                          args.rounds, 10)
        # Causal bottom-right: each new token sees the cached keys and the new ones up to itself.
        flops = 4 * batch * HEADS * HEAD_DIM * PREFILL_NEW * (PREFILL_CACHED + (PREFILL_NEW + 1) / 2)
        for name, ms in medians.items():
            ratio = f"{medians['flash_attn_4'] / ms:.2f}x" if "flash_attn_4" in medians else "-"
            lines.append(f"| {batch} | {name} | {ms:.4f} | {flops / ms / 1e9:.0f} | {ratio} |")
    (out_dir / "prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--graphs", action="store_true", help="time CUDA graph replays of every implementation")
    parser.add_argument("--prefill", action="store_true", help="time a prefill over a cache instead of decode steps")
    parser.add_argument("--report", metavar="CSV", help="rebuild DIR's .md and .png from a kvcache.csv")
    parser.add_argument("--batches", default="1,8,64", help="batch sizes to time (comma-separated)")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
        rows = [dict(r, batch=int(r["batch"]), cache_len=int(r["cache_len"]), gb_per_s=float(r["gb_per_s"]))
                for r in csv.DictReader(open(args.report))]
        return report(rows, out_dir, args.graphs)
    if args.prefill:
        return prefill(args, out_dir)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for cache_len in (4096, 32768, 131072):
            kv_bytes = 2 * batch * cache_len * KV_HEADS * HEAD_DIM * 2
            if kv_bytes > LIMIT_BYTES:
                continue
            impls = implementations(batch, cache_len)
            with torch.no_grad():
                runnable = runnable_steps(impls, f"B={batch} S={cache_len}")
                if args.graphs:
                    runnable = graphs_of(runnable, f"B={batch} S={cache_len}")
                medians = interleaved_medians(runnable, args.rounds, 10)
            for name, ms in medians.items():
                # The copy reads K and V and writes as much: its bandwidth counts what it reads.
                rows.append(dict(batch=batch, cache_len=cache_len, impl=name, ms=round(ms, 4),
                                 gb_per_s=round(kv_bytes / ms / 1e6, 1), kv_mb=round(kv_bytes / 1e6, 1)))
                print(f"B={batch:3d} S={cache_len:6d} {name:20s} {ms:8.4f} ms {kv_bytes / ms / 1e6:8.1f} GB/s",
                      flush=True)
            del impls, runnable
            torch.cuda.empty_cache()
    with open(out_dir / "kvcache.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    report(rows, out_dir, args.graphs)


def report(rows, out_dir, graphs):
    """DIR/kvcache.md and .png from the measured rows (--report CSV rebuilds them)."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cases = list(dict.fromkeys((r["batch"], r["cache_len"]) for r in rows))
    lines = [f"Decode step{' (CUDA graph replays)' if graphs else ''}, Sq = 1, {HEADS}/{KV_HEADS} heads, "
             f"D = {HEAD_DIM}, bf16: GB/s of K and V read "
             f"(copy_k_and_v: a device copy of the same bytes, its read bandwidth; {PAGED[1:]}: pages of "
             f"{PAGE_SIZE} rows in a random order)", "",
             "| B | cache | " + " | ".join(impls) + " | ours / fastest peer, contiguous | paged |",
             "|---" * (len(impls) + 4) + "|"]

    def ratio(got, ours, paged):
        # Peers are the other libraries (our dense path and unsplit variant are not).
        peers = [v for k, v in got.items() if k.endswith(PAGED) == paged and k != "copy_k_and_v"
                 and not k.startswith("cute_flash")]
        return f"{got[ours] / max(peers):.2f}x" if peers and ours in got else "-"

    for batch, cache_len in cases:
        got = {r["impl"]: r["gb_per_s"] for r in rows if (r["batch"], r["cache_len"]) == (batch, cache_len)}
        lines.append(f"| {batch} | {cache_len} | " + " | ".join(str(got.get(i, "-")) for i in impls)
                     + f" | {ratio(got, 'cute_flash_kvcache', False)} | {ratio(got, 'cute_flash' + PAGED, True)} |")
    (out_dir / "kvcache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    grouped_bars(out_dir / "kvcache.png", [f"B{b} S{s // 1024}k" for b, s in cases],
                 {i: [next((r["gb_per_s"] for r in rows if (r["batch"], r["cache_len"]) == c and r["impl"] == i), None)
                      for c in cases] for i in impls}, "GB/s of K/V read (higher is better)", width=11)


if __name__ == "__main__":
    main()
