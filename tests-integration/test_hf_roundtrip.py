"""Hugging Face round trip through the trainer at a parallel layout: import, fine-tune, export,
reload in transformers.

A tiny random-weight transformers model (Llama, and Mixtral for MoE; norms and router gates
randomised away from their defaults, nothing downloaded) is saved by transformers and
fine-tuned by ``shardwork.trainer.train`` on 2 gloo ranks (Llama: TP=2; Mixtral: TP=2 with
EP=2, ETP=1) for 3 steps on the built-in corpus with ``checkpoint.hf_init`` (import through
``shardwork.models.hf`` at the run's layout) and ``checkpoint.hf_export`` (export at the end).

- The import is right at the layout: step 0's logged loss equals transformers' mean cross
  entropy of the original model on that step's global batch (fp32, rtol 1e-4).
- The fine-tune trained (the loss falls) and every rank logged the same losses.
- The export is right: the folder reloaded by ``transformers.AutoModelForCausalLM`` gives the
  logits of the fine-tuned model rebuilt on one process from the run's shardwork checkpoint
  (``shardwork-generate``'s loader; rtol/atol 1e-4), which differ from the original model's.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("shardwork.trainer")

from shardwork.parallel_state.testing import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.multirank

VOCAB = 272  # the byte tokenizer's 257 ids fit
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


def _config(run_dir, folder_in, folder_out, layout):
    from shardwork.trainer.testing import tiny_config

    return tiny_config(
        run_dir,
        world_size=2,
        parallel=layout,
        schedule={"train_steps": 3, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        checkpoint={"hf_init": folder_in, "hf_export": folder_out, "save_at_end": True},
    )


def _finetune(model_type: str, folder_in: str, folder_out: str, run_dir: str, cache: str, layout):
    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train

    if dist.get_rank() == 0:
        _hf_model(model_type).save_pretrained(folder_in)
    dist.barrier()
    config = _config(run_dir, folder_in, folder_out, layout)  # validated before training
    result = train(config, stream=io.StringIO())
    return result.train_losses, result.checkpoint, result.hf_export


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_finetuned_export_reloads_in_transformers(tmp_path, monkeypatch, model_type):
    from shardwork.trainer.inference import load_for_inference
    from shardwork.trainer.testing import first_global_batch

    cache = str(tmp_path / "corpus")
    monkeypatch.setenv("SHARDWORK_CACHE", cache)
    folder_in, folder_out = str(tmp_path / "in"), str(tmp_path / "out")
    _hf_model(model_type).save_pretrained(folder_in)  # for the parent's config and batch
    config = _config(str(tmp_path / "run"), folder_in, folder_out, LAYOUTS[model_type])
    # step 0's global batch (dp = 1 at these layouts); also builds the corpus once, before the
    # ranks read it
    rows = torch.cat(first_global_batch(config))
    shutil.rmtree(folder_in)  # the ranks write it again, as a user would have it

    args = (model_type, folder_in, folder_out, str(tmp_path / "run"), cache, LAYOUTS[model_type])
    results = run_on_ranks(_finetune, 2, args=args, timeout=600)
    losses, checkpoint, exported_to = results[0]
    assert [r[0] for r in results[1:]] == [losses]  # every rank logged the same global losses
    assert exported_to == folder_out

    # the import at TP=2 (EP=2) is transformers' model: step 0's loss on its batch
    logits = _hf_logits(folder_in, rows[:, :-1])
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
    assert losses[0] == pytest.approx(float(want), rel=1e-4)
    assert losses[2] < losses[0]  # the fine-tune trained

    probe = _batch(99)[:, :-1]
    tuned_model, _, _ = load_for_inference(checkpoint)  # the trained weights, resharded to 1
    with torch.no_grad():
        tuned = tuned_model(input_ids=probe).transpose(0, 1)[..., :VOCAB]  # [s, b, V] -> [b, s, V]
    exported = _hf_logits(folder_out, probe)
    torch.testing.assert_close(exported, tuned, rtol=1e-4, atol=1e-4)
    assert (tuned - _hf_logits(folder_in, probe)).abs().max() > 1e-2  # training moved the logits
