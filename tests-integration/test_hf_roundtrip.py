"""Hugging Face round trip at a parallel layout: import, fine-tune, export, reload in transformers.

A tiny random-weight transformers model (Llama, and Mixtral for MoE; norms and router gates
randomised away from their defaults, nothing downloaded) is saved by transformers, imported by
``shardwork.models.hf.from_pretrained`` on 2 gloo ranks (Llama: TP=2; Mixtral: TP=2 with EP=2,
ETP=1), fine-tuned 3 steps with a plain ``torch.optim.AdamW`` loop on each rank's local shards,
exported by ``save_pretrained`` and reloaded by ``transformers.AutoModelForCausalLM``: its logits
equal the fine-tuned shardwork model's (fp32, rtol/atol 1e-4) and differ from the imported
model's (the fine-tune really changed the exported weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from shardwork.parallel_state.testing import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multirank

VOCAB = 250
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama": dict(intermediate_size=96),
    "mixtral": dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6
    ),
}
LAYOUTS = {"llama": {"tp": 2}, "mixtral": {"tp": 2, "ep": 2, "etp": 1}}


def _hf_model(model_type: str):
    """Tiny random-weight transformers model (deterministic; eager attention)."""
    cfg = transformers.AutoConfig.for_model(model_type, **(COMMON | CONFIGS[model_type]))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
            elif ".gate.weight" in name:
                t.copy_(0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
    return model


def _batch(seed: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def _hf_logits(folder, ids) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model.eval()(ids).logits


def _roundtrip(model_type: str, folder_in: str, folder_out: str, layout: dict):
    from shardwork.models.hf import from_pretrained, save_pretrained
    from shardwork.models.logits import gather_logits
    from shardwork.parallel_state import ParallelConfig, init_process_groups

    groups = init_process_groups(ParallelConfig(**layout))
    if dist.get_rank() == 0:
        _hf_model(model_type).save_pretrained(folder_in)
    dist.barrier()
    model = from_pretrained(folder_in, groups)
    probe = _batch(99)[:, :-1]

    def logits_of(m):
        with torch.no_grad():
            return gather_logits(m(probe), tp_group=groups.tp, vocab_size=VOCAB)

    imported = logits_of(model.eval())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    tokens = _batch(0)  # one batch, fitted: its loss must fall
    for _ in range(3):
        loss_sum, count = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss = loss_sum / count
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    tuned = logits_of(model.eval())
    save_pretrained(model, folder_out)
    dist.barrier()
    exported = _hf_logits(folder_out, probe)
    return imported, tuned, exported, losses


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_finetuned_export_reloads_in_transformers(tmp_path, model_type):
    args = (model_type, str(tmp_path / "in"), str(tmp_path / "out"), LAYOUTS[model_type])
    results = run_on_ranks(_roundtrip, 2, args=args, timeout=600)
    imported, tuned, exported, losses = results[0]
    # the import itself matches transformers before training
    torch.testing.assert_close(imported, _hf_logits(tmp_path / "in", _batch(99)[:, :-1]))
    assert losses[-1] < losses[0]  # the fine-tune trained
    assert (tuned - imported).abs().max() > 1e-2  # and moved the logits
    torch.testing.assert_close(exported, tuned, rtol=1e-4, atol=1e-4)
    for other in results[1:]:  # every TP rank gathered the same full logits
        torch.testing.assert_close(other[1], tuned, rtol=1e-5, atol=1e-5)
