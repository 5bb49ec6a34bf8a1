"""MTP and MoE aux losses (per type) are logged separately from the main LM loss.

The logged step-0 values of a tiny DeepSeek-V3 twin (MoE + one MTP depth) are compared with an
independent recomputation: the same model (same seed) built outside the trainer, a plain
forward over the step-0 micro-batches, and the MTP depth evaluated by hand from its parameters
(RMSNorm formula, ``eh_proj`` as a matmul, rolled ids/labels, ``F.cross_entropy``).
"""

import io
import math

import pytest
import torch
import torch.nn.functional as F

from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import first_global_batch, tiny_config

STEPS = 3


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _plain_losses(model, batches):
    """(main loss, [MTP loss per depth], MoE tracker summary): token means over ``batches``
    (``[b, s+1]`` rows), by a plain forward and a hand-written MTP depth."""
    cfg = model.config
    eps = cfg.norm_epsilon
    head = model.output_layer.linear.weight
    if head is None:
        head = model.embedding.weight
    head = head[: cfg.vocab_size]  # softmax over the real vocabulary only
    captured = {}
    hook = model.decoder.register_forward_hook(
        lambda mod, args, out: captured.__setitem__("h", out)
    )
    # 1. the model's own forward over every micro-batch (routers record aux losses only with
    #    autograd on, as in training); its tracker gives the aux-loss summary
    model.aux_loss_tracker.reset()
    hiddens = []
    with torch.set_grad_enabled(model.training):
        for rows in batches:
            model(input_ids=rows[:, :-1], labels=rows[:, 1:])
            hiddens.append(captured["h"].detach())  # [s, b, h], after the final norm
    hook.remove()
    summary = model.aux_loss_tracker.summary(num_micro_batches=len(batches))
    # 2. the losses by hand from the captured hidden states and the parameters
    main = [0.0, 0]
    mtp = [[0.0, 0] for _ in range(cfg.mtp.num_layers)]
    with torch.no_grad():
        for rows, hidden in zip(batches, hiddens):
            ids, labels = rows[:, :-1], rows[:, 1:]
            logits = hidden @ head.T  # [s, b, V]
            main[0] += float(
                F.cross_entropy(logits.flatten(0, 1), labels.T.flatten(), reduction="sum")
            )
            main[1] += labels.numel()
            seq = ids.shape[1]
            inputs = model._attention_inputs(seq, None, ids.device)
            for k, depth in enumerate(model.mtp.layers, start=1):
                ids_k = torch.zeros_like(ids)
                ids_k[:, : seq - k] = ids[:, k:]
                lab_k = torch.full_like(labels, -100)
                lab_k[:, : seq - k] = labels[:, k:]
                emb = F.embedding(ids_k.T, model.embedding.weight)
                x = torch.cat(
                    (_rms(emb, depth.enorm.weight, eps), _rms(hidden, depth.hnorm.weight, eps)), -1
                )
                hidden = x @ depth.eh_proj.weight.T
                hidden = depth.transformer_layer(hidden, inputs)
                out = _rms(hidden, depth.final_layernorm.weight, eps) @ head.T
                loss = F.cross_entropy(
                    out.flatten(0, 1), lab_k.T.flatten(), ignore_index=-100, reduction="sum"
                )
                mtp[k - 1][0] += float(loss)
                mtp[k - 1][1] += int((lab_k != -100).sum())
    return main[0] / main[1], [t / n for t, n in mtp], summary


def _step0_reference(config):
    """Step 0 of ``config`` recomputed outside the trainer: same seed, same micro-batches."""
    from shardwork.parallel_state import ProcessGroups
    from shardwork.trainer.model_factory import build_model_chunks, gpt_config

    (model,) = build_model_chunks(
        gpt_config(config), ProcessGroups.single(), device=torch.device("cpu")
    )
    model.train()  # routers record statistics in training mode; the twins have no dropout
    batches = first_global_batch(config)
    return _plain_losses(model, batches)


def _valid_reference(checkpoint, config):
    """The validation losses of the saved final model, recomputed on the evaluated samples."""
    from shardwork.trainer.data.builder import build_eval_set, micro_batch, split_components
    from shardwork.trainer.inference import load_for_inference

    model, _, _ = load_for_inference(checkpoint)
    model.eval()
    mbs, gbs = config.schedule.micro_batch_size, config.schedule.global_batch_size
    samples = config.eval.steps * gbs  # eval.steps counts global batches
    valid = build_eval_set(
        split_components(config.data)["valid"],
        seq_length=config.data.seq_length,
        num_samples=samples,
    )
    batches = [
        micro_batch(valid, consumed=0, index=i, micro_batch_size=mbs, dp_rank=0, dp_size=1)
        for i in range(samples // mbs)
    ]
    return _plain_losses(model, batches)


def test_mtp_and_aux_losses_logged_separately_and_exactly(tmp_path):
    config = tiny_config(
        tmp_path,
        # aux and z losses on (changes to the preset's router config)
        model={
            "preset": "tiny-deepseek-v3",
            "moe": {"router": {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}},
        },
        schedule={"train_steps": STEPS, "warmup_steps": 1},
        eval={"interval": STEPS, "steps": 1},
        logging={"interval": 1, "progress": "lines", "plot": True},
        checkpoint={"save_at_end": True},
    )
    stream = io.StringIO()
    result = train(config, stream=stream)
    records = read_metrics(tmp_path / "metrics.jsonl")
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == list(range(1, STEPS + 1))
    for r in train_records:  # every step: the depth's own metric, next to the main loss
        assert math.isfinite(r["mtp_loss_1"]) and "mtp_loss_2" not in r
        assert r["load_balancing_loss"] > 0 and r["z_loss"] > 0
        assert r["mtp_loss_1"] == result.train_mtp_losses[r["step"] - 1][0]
        assert "load_imbalance" in r and "expert_load" in r

    main, mtp, summary = _step0_reference(config)
    first = train_records[0]
    assert first["mtp_loss_1"] == pytest.approx(mtp[0], rel=1e-5)
    # the logged "loss" is the main LM loss alone, not loss + coeff * mtp
    assert first["loss"] == pytest.approx(main, rel=1e-5)
    assert abs(first["loss"] - (main + 0.3 * mtp[0])) > 0.1
    # one metric per aux-loss type, as the routers' trackers report them after reduction
    assert {"load_balancing_loss", "z_loss", "load_imbalance"} <= set(summary)
    for key, value in summary.items():
        assert first[key] == pytest.approx(value, rel=1e-5), key

    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [STEPS]
    valid_main, valid_mtp, _ = _valid_reference(result.checkpoint, config)
    assert valid[0]["loss"] == pytest.approx(valid_main, rel=1e-5)
    assert valid[0]["mtp_loss_1"] == pytest.approx(valid_mtp[0], rel=1e-5)
    # the progress line shows the depth's loss; the loss plot draws it
    assert f"mtp1 {first['mtp_loss_1']:.4f}" in stream.getvalue()
    assert (tmp_path / "plots" / "loss.png").is_file()


def test_models_without_mtp_log_no_mtp_metric(tmp_path):
    config = tiny_config(
        tmp_path,
        schedule={"train_steps": 2, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        logging={"interval": 1},
    )
    result = train(config)
    assert result.train_mtp_losses == {}
    for r in read_metrics(tmp_path / "metrics.jsonl"):
        assert not any(k.startswith("mtp_loss") for k in r)
