"""Greedy generation with a paged KV cache: a tiny Llama-style model (random weights, bf16)
generates the same tokens through cute_flash.flash_attn_with_kvcache on a paged cache as
through SDPA on an unpaged one, and the per-token latency of both.

    python perf/generate.py --out DIR [--steps 64] [--batch 4]

The model: token embedding, LAYERS decoder layers (RMSNorm, rotary q/k, grouped-query
attention with HEADS query and KV_HEADS key/value heads, SwiGLU MLP), a final norm and an
untied head; weights drawn from a fixed seed. Two caches:
* "sdpa": per layer a contiguous (B, max_len, Nkv, D) cache; new rows are copied in and
  torch.nn.functional.scaled_dot_product_attention (enable_gqa) reads the filled slots;
* "sdpa_flash": the same through SDPA's flash backend;
* "cute_flash_paged": per layer a paged cache (num_pages, PAGE_SIZE, Nkv, D) shared by the batch, a
  Python free list of pages (shuffled: a sequence's pages lie anywhere), a block table
  (B, max_pages) int32 that gets a page when a sequence crosses into a new one, and
  flash_attn_with_kvcache appending the step's rows and attending in one call.
The prompt (PROMPT tokens per sequence) is one prefill step, then `steps` greedy decode steps in
lockstep: every cache is fed SDPA's token, so the logits compare step by step. bf16 attention
from two implementations differs in its last bits, and a random model has near-ties among its
logits: a token may differ only where SDPA's top-two gap is within twice the largest logit
distance between the two (reported; any other difference is a failure). Writes
DIR/generate.md (tokens equal, distances, ms per token of each).
"""

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 1024, 512, 4, 8, 2, 64, 1408
PROMPT, PAGE_SIZE = 16, 16


class TinyLlama:
    """The model's weights and its forward over one step's tokens; attention is the cache's."""

    def __init__(self, seed=0, device="cuda", dtype=torch.bfloat16):
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape):
            return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(device, dtype)

        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen).to(device, dtype)
        self.layers = [dict(wq=weight(HEADS * HEAD_DIM, HIDDEN), wk=weight(KV_HEADS * HEAD_DIM, HIDDEN),
                            wv=weight(KV_HEADS * HEAD_DIM, HIDDEN), wo=weight(HIDDEN, HEADS * HEAD_DIM),
                            gate=weight(FFN, HIDDEN), up=weight(FFN, HIDDEN), down=weight(HIDDEN, FFN))
                       for _ in range(LAYERS)]
        self.head = weight(VOCAB, HIDDEN)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.inv_freq = inv_freq.to(device)

    def rotary(self, x, positions):
        """x (B, T, H, D) rotated by its tokens' positions (B, T) (the halves convention)."""
        angles = positions[..., None].float() * self.inv_freq  # (B, T, D/2)
        cos, sin = (f(angles).repeat(1, 1, 2)[:, :, None, :] for f in (torch.cos, torch.sin))
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def logits(self, tokens, positions, cache):
        """Logits (B, T, VOCAB) of one step's tokens (B, T) at positions (B, T); the cache
        appends the step's keys and values and attends (cache.attend)."""
        x = self.embed[tokens]
        batch, steps, _ = x.shape
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (HIDDEN,))
            q = self.rotary((h @ layer["wq"].T).view(batch, steps, HEADS, HEAD_DIM), positions)
            k = self.rotary((h @ layer["wk"].T).view(batch, steps, KV_HEADS, HEAD_DIM), positions)
            v = (h @ layer["wv"].T).view(batch, steps, KV_HEADS, HEAD_DIM)
            attn = cache.attend(index, q, k, v)  # (B, T, HEADS, HEAD_DIM)
            x = x + attn.reshape(batch, steps, -1) @ layer["wo"].T
            h = F.rms_norm(x, (HIDDEN,))
            x = x + (F.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T
        return F.rms_norm(x, (HIDDEN,)) @ self.head.T


class SdpaCache:
    """Contiguous per-layer caches read by SDPA (the reference)."""

    def __init__(self, batch, max_len, device="cuda", dtype=torch.bfloat16):
        shape = (batch, max_len, KV_HEADS, HEAD_DIM)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(LAYERS)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(LAYERS)]
        self.length = 0

    def attend(self, layer, q, k, v):
        steps = q.shape[1]
        end = self.length + steps
        self.k[layer][:, self.length:end] = k
        self.v[layer][:, self.length:end] = v
        keys, values = (c[:, :end].transpose(1, 2) for c in (self.k[layer], self.v[layer]))
        # The step's queries are the last `steps` positions: causal within the step (a prefill
        # from an empty cache), one query seeing every key in a decode step.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=steps > 1, enable_gqa=True)
        return out.transpose(1, 2)

    def reserve(self, steps):
        pass

    def advance(self, steps):
        self.length += steps


class SdpaFlashCache(SdpaCache):
    """SdpaCache through SDPA's flash backend only (its default on the H100 is cuDNN, which
    builds an execution plan for every new key length: every decode step)."""

    def attend(self, layer, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return super().attend(layer, q, k, v)


class PagedCache:
    """Per-layer paged caches with a free list and one block table for the batch (cute_flash)."""

    def __init__(self, batch, max_len, device="cuda", dtype=torch.bfloat16, seed=0):
        self.max_pages = -(-max_len // PAGE_SIZE)
        num_pages = batch * self.max_pages + 7  # a few spare pages
        shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(LAYERS)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(LAYERS)]
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages = [[] for _ in range(batch)]  # each sequence's pages, in order
        self.table = torch.zeros((batch, self.max_pages), dtype=torch.int32, device=device)
        self.lengths = [0] * batch
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)

    def reserve(self, steps):
        """Pages for `steps` more tokens per sequence, taken from the free list; the block table
        is updated on the device only when a sequence gets a page."""
        grew = False
        for b, pages in enumerate(self.pages):
            while len(pages) * PAGE_SIZE < self.lengths[b] + steps:
                pages.append(self.free.pop())
                grew = True
        if grew:
            rows = [pages + [0] * (self.max_pages - len(pages)) for pages in self.pages]
            self.table.copy_(torch.tensor(rows, dtype=torch.int32))

    def attend(self, layer, q, k, v):
        return cute_flash.flash_attn_with_kvcache(q, self.k[layer], self.v[layer], k=k, v=v,
                                                  cache_seqlens=self.seqlens, block_table=self.table, causal=True)

    def advance(self, steps):
        self.lengths = [n + steps for n in self.lengths]
        self.seqlens += steps


CACHES = {"sdpa": SdpaCache, "sdpa_flash": SdpaFlashCache, "cute_flash_paged": PagedCache}


def generate(model, caches, prompt, steps):
    """Greedy decoding in lockstep over several caches: each step's token is the argmax of the
    first cache's logits (the reference), fed to every cache, so that the logits compare step
    by step. Returns per cache the argmax tokens (B, steps), the logits' largest distance to
    the reference's, and the seconds of each decode step; and the reference's top-2 gap per
    (sequence, step)."""
    batch = prompt.shape[0]
    positions = torch.arange(PROMPT, device=prompt.device).expand(batch, PROMPT)
    tokens = [[] for _ in caches]
    times = [[] for _ in caches]
    distance = [0.0 for _ in caches]
    gaps = []
    with torch.no_grad():
        step_tokens, step_positions = prompt, positions
        for step in range(steps + 1):
            logits = []
            for i, cache in enumerate(caches):
                torch.cuda.synchronize()
                start = time.perf_counter()
                cache.reserve(step_tokens.shape[1])
                logits.append(model.logits(step_tokens, step_positions, cache)[:, -1].float())
                cache.advance(step_tokens.shape[1])
                torch.cuda.synchronize()
                if step:
                    times[i].append(time.perf_counter() - start)
            top2 = logits[0].topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
            for i, got in enumerate(logits):
                tokens[i].append(got.argmax(-1))
                distance[i] = max(distance[i], (got - logits[0]).abs().max().item())
            step_tokens = tokens[0][-1][:, None]
            step_positions = torch.full((batch, 1), PROMPT + step, device=prompt.device)
    tokens = [torch.stack(t[:steps], dim=1) for t in tokens]
    return tokens, distance, times, torch.stack(gaps[:steps], dim=1)


def run(steps=64, batch=4, seed=0):
    """Lockstep greedy decoding (generate) over the caches of CACHES: name -> (tokens (B,
    steps), largest logit distance to SDPA's, seconds per decode step), and SDPA's top-2 gaps."""
    model = TinyLlama(seed)
    prompt = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(seed + 1)).cuda()
    max_len = PROMPT + steps + 1
    caches = [make(batch, max_len) for make in CACHES.values()]
    tokens, distance, times, gaps = generate(model, caches, prompt, steps)
    return {name: (t, d, s) for name, t, d, s in zip(CACHES, tokens, distance, times)}, gaps


def mismatches(results, gaps, name):
    """Steps where `name`'s argmax differs from SDPA's although SDPA's top-2 gap is wider than
    twice the largest logit distance between them (a near-tie may flip either way; a wider gap
    may not)."""
    tokens, distance, _ = results[name]
    differ = tokens != results["sdpa"][0]
    return (differ & (gaps > 2 * distance)).nonzero().tolist()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    run(4, args.batch)  # warm-up: compiles and plans
    results, gaps = run(args.steps, args.batch)
    median = lambda t: sorted(t)[len(t) // 2] * 1e3  # noqa: E731
    lines = [f"Greedy generation in lockstep, tiny Llama ({LAYERS} layers, {HEADS}/{KV_HEADS} heads, D = {HEAD_DIM}, "
             f"vocab {VOCAB}, bf16, random weights), batch {args.batch}, prompt {PROMPT}, {args.steps} steps; "
             f"cute_flash on pages of {PAGE_SIZE} from a shuffled free list", "",
             "| cache | ms per token (median) | tokens equal to SDPA's | largest logit distance | flips beyond a near-tie |",
             "|---|---:|---:|---:|---:|"]
    failures = 0
    for name, (tokens, distance, times) in results.items():
        equal = (tokens == results["sdpa"][0]).sum().item()
        bad = mismatches(results, gaps, name)
        failures += len(bad)
        lines.append(f"| {name} | {median(times):.3f} | {equal} / {tokens.numel()} | {distance:.4f} | {len(bad)} |")
    (out_dir / "generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
