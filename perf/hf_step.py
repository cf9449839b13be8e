"""Training-step time of a transformers Llama model on SDPA's default backend choice against
the same model on cute_flash through the SDPA registration (GPU script; needs transformers).

Same weights, same batch, bf16; one step = forward, backward, AdamW. The two run in
interleaved rounds (median of the rounds' per-step means), so drift hits both alike.

    python perf/hf_step.py [--layers 8] [--seqlen 4096] [--batch 2] [--head-dim 128]
"""

import argparse
import copy
import statistics

import torch
import transformers

from cute_flash import sdpa


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, restore_flash_attention_impl, sdpa_kernel

    heads = args.hidden // args.head_dim
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=args.head_dim, max_position_embeddings=args.seqlen, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16,
                                                      attn_implementation="sdpa").cuda().train()
    models = {"sdpa_default": base, "cute_flash": copy.deepcopy(base)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    ids = torch.randint(0, 32000, (args.batch, args.seqlen), device="cuda")

    def steps(name):
        model, optimizer = models[name], optimizers[name]
        for _ in range(args.steps):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def timed(name):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if name == "cute_flash":
            sdpa.activate()
            backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
            backend.__enter__()
        start.record()
        steps(name)
        end.record()
        end.synchronize()
        if name == "cute_flash":
            assert sdpa.last_decision == "ours", sdpa.last_decision
            backend.__exit__(None, None, None)
            restore_flash_attention_impl()
        return start.elapsed_time(end) / args.steps

    for name in models:  # warm-up (compiles, allocator)
        timed(name)
    samples = {name: [] for name in models}
    for _ in range(args.rounds):
        for name in models:
            samples[name].append(timed(name))
    medians = {name: statistics.median(s) for name, s in samples.items()}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}: "
          f"Llama {args.layers} layers, hidden {args.hidden}, head dim {args.head_dim}, batch {args.batch} x "
          f"{args.seqlen} tokens, bf16, AdamW; ms per training step, median of {args.rounds} rounds x "
          f"{args.steps} steps")
    print("| SDPA default backends | cute_flash via SDPA | ratio |\n|---:|---:|---:|")
    print(f"| {medians['sdpa_default']:.2f} | {medians['cute_flash']:.2f} | "
          f"{medians['sdpa_default'] / medians['cute_flash']:.3f}x |")


if __name__ == "__main__":
    main()
