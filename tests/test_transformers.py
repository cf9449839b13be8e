"""A Hugging Face transformers Llama model on cute_flash through SDPA's flash backend
(cute_flash.sdpa), against the same model on SDPA's stock backends: logits and a 30-step
training run from identical weights. Needs a Hopper GPU and transformers (skipped with the
reason otherwise).

The models use as many key/value heads as query heads: cute_flash has no grouped-query
attention yet, and a GQA model would run PyTorch's kernel behind the registration (the
test_gqa_model_is_not_served test shows that it says so)."""

import copy

import pytest
import torch

from cute_flash import sdpa

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not sdpa.registry_available(), reason="torch has no SDPA flash registry")]

VOCAB = 1000


def make_model(head_dim, kv_heads=None, seed=0):
    heads = 1024 // head_dim
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, head_dim=head_dim,
        max_position_embeddings=2048, attention_dropout=0.0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.cuda()


class OnCuteFlash:
    """SDPA's flash backend with cute_flash's kernels, for the duration of the block."""

    def __enter__(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa.activate()
        self.backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        self.backend.__enter__()
        sdpa.last_decision = None
        return self

    def __exit__(self, *exc):
        import torch.nn.attention as attention

        self.backend.__exit__(*exc)
        attention.restore_flash_attention_impl()


def batch(seed, size=(4, 512)):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, size, generator=generator).cuda()


@pytest.mark.parametrize("head_dim", [128, 64])
def test_logits_match_sdpa_s_stock_backends(head_dim):
    model = make_model(head_dim).eval()
    ids = batch(1)
    with torch.no_grad():
        stock = model(ids, use_cache=False).logits.float()
        with OnCuteFlash():
            ours = model(ids, use_cache=False).logits.float()
            assert sdpa.last_decision == "ours"
    err = ((ours - stock).norm() / stock.norm()).item()
    assert err < 1e-2, f"relative logit difference {err:.2e}"
    assert (ours.argmax(-1) == stock.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("head_dim", [128, 64])
def test_training_losses_track_sdpa_s(head_dim):
    stock_model = make_model(head_dim).train()
    our_model = copy.deepcopy(stock_model)
    losses = {}
    for name, model in (("stock", stock_model), ("ours", our_model)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        losses[name] = []
        context = OnCuteFlash() if name == "ours" else torch.enable_grad()
        with context:
            for step in range(30):
                ids = batch(100 + step % 4)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[name].append(loss.item())
            if name == "ours":
                assert sdpa.last_decision == "ours"
    assert losses["stock"][-1] < 0.8 * losses["stock"][0], losses["stock"]  # it learns: the check can fail
    for step, (a, b) in enumerate(zip(losses["stock"], losses["ours"])):
        assert abs(a - b) <= 0.02 * a, f"step {step}: stock {a:.4f} vs cute_flash {b:.4f}"


def test_gqa_model_is_served_and_agrees_with_stock():
    """A grouped-query model (8 query heads, 2 key/value heads): SDPA's enable_gqa calls run
    cute_flash's grouped kernels (no expanded k/v), with the stock model's logits."""
    model = make_model(128, kv_heads=2).eval()
    ids = batch(2)
    with torch.no_grad():
        stock = model(ids, use_cache=False).logits.float()
        with OnCuteFlash():
            sdpa.last_decision = None
            ours = model(ids, use_cache=False).logits.float()
    assert sdpa.last_decision == "ours"
    assert (ours - stock).norm() <= 2e-2 * stock.norm()
