"""Logged throughput values and the progress display, through short ``train()`` runs.

- MFU: the logged ``mfu`` equals ``tokens_per_s × FLOPs/token ÷ (peak × 10¹²)`` with
  ``logging.peak_tflops`` set, where FLOPs/token is counted here from the built model's weight
  shapes (2 FLOPs per weight element and token for every matmul, the causal attention
  products, ×3 for forward + backward), not taken from shardwork.models' calculator.
- Progress: ``logging.progress = "auto"`` draws a tqdm bar on a terminal stream (a fake TTY
  here) and writes plain ``step k/N | ...`` lines on any other stream.
"""

import io

import pytest

from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config

PEAK_TFLOPS = 0.25


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _training_flops_per_token(config) -> float:
    """Forward + backward FLOPs per token of the config's dense GPT, from its weight shapes."""
    from shardwork.models import GPTModel
    from shardwork.trainer.model_factory import gpt_config

    model_config = gpt_config(config)
    model = GPTModel(model_config)
    matmul_weights = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2 and name != "embedding.weight"  # the embedding is a lookup
    )
    if model_config.fused_linear_cross_entropy:  # the fused loss skips the head's padding rows
        pad = model_config.padded_vocab_size - model_config.vocab_size
        matmul_weights -= pad * model_config.hidden_size
    heads, width = model_config.num_attention_heads, model_config.hidden_size
    seq = config.data.seq_length
    # per layer and token: q·k over the keys and p·v, 2 FLOPs each, half of them under a
    # causal mask, over all heads of width hidden/heads
    attention = model_config.num_layers * 2 * 2 * seq * (width // heads) * heads / 2
    return 3 * (2 * matmul_weights + attention)


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "not-a-terminal"])
def test_mfu_and_progress_display(tmp_path, terminal):
    config = tiny_config(
        tmp_path,
        schedule={"train_steps": 3, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        logging={"interval": 1, "progress": "auto", "peak_tflops": PEAK_TFLOPS},
    )
    stream = FakeTerminal() if terminal else io.StringIO()
    train(config, stream=stream)

    flops = _training_flops_per_token(config)
    # 2 layers, width 32, 4 heads, ffn 64, seq 32; the head multiplies the 257 real vocabulary
    # rows (of 320 padded: the fused loss skips the padding)
    assert flops == 172224
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["tokens_per_s"] > 0
        achieved = r["tokens_per_s"] * flops / 1e12  # one device
        assert r["tflops_per_device"] == pytest.approx(achieved, rel=1e-12)
        assert r["mfu"] == pytest.approx(achieved / PEAK_TFLOPS, rel=1e-12)

    text = stream.getvalue()
    assert "MFU against 0.25 TFLOP/s per device (logging.peak_tflops)" in text
    plain_lines = [line for line in text.splitlines() if line.startswith("step ")]
    if terminal:  # one bar redrawn in place, with the loss, lr and tokens/s as its postfix
        assert "\r" in text
        assert "3/3" in text and "loss=" in text and "tok/s=" in text
        assert plain_lines == []
    else:  # one plain line per logged step, with MFU
        assert "\r" not in text
        assert [line.split(" | ")[0] for line in plain_lines] == [
            "step 1/3",
            "step 2/3",
            "step 3/3",
        ]
        for line, r in zip(plain_lines, records):
            assert f"loss {r['loss']:.4f}" in line
            assert f"MFU {100 * r['mfu']:.1f}%" in line
