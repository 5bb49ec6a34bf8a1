"""Megatron-Core checkpoint import against checkpoints and logits megatron-core 0.19.2 wrote.

The fixtures in ``data/megatron/`` come from ``tools/megatron_checkpoint_fixture.py`` (run in a
scratch venv with megatron-core; see its docstring): tiny Llama-style models saved in the
torch_dist format at world 1 (TE-spec and local-spec norm names), TP=2 x PP=2 and EP=2 (MoE),
plus the logits Megatron's own forward computed on fixed tokens.

Tolerance: fp32, 2-4 layers. Measured max |shardwork - Megatron| at world 1 is 4.2e-7 to
5.4e-7 with max |logits| 1.4-1.8, i.e. <= 2.8 fp32 epsilons (1.19e-7) of the logits' scale;
the tests allow 16 epsilons of that scale (other CPUs pick other BLAS kernels).
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardwork.dist_checkpoint import load
from shardwork.dist_checkpoint.cli import main as ckpt_main
from shardwork.dist_checkpoint.decode import decode_metadata
from shardwork.models import GPTModel, gather_logits
from shardwork.models.megatron import (
    NotAMegatronCheckpointError,
    check_megatron_checkpoint,
    export_megatron,
    import_megatron,
    load_megatron_weights,
    megatron_state_dict,
    read_megatron_tensors,
)
from shardwork.models.megatron.cli import config_with_changes
from shardwork.models.pipeline import build_stage, pipeline_logits
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.golden

DATA = Path(__file__).parent / "data" / "megatron"
CASES = ("llama_w1_te", "llama_w1_local", "llama_tp2pp2", "moe_ep2", "moe_qb_w1")


def _fixture(name: str) -> dict:
    return torch.load(DATA / "logits.pt")["cases"][name]


def _changes(name: str) -> tuple[str, dict]:
    """The preset and changes that describe fixture ``name``'s architecture."""
    hyper = _fixture(name)["config"]
    changes = {
        "num_layers": hyper["num_layers"],
        "vocab_size": hyper["vocab_size"],
        "ffn_hidden_size": hyper["ffn_hidden_size"],
        "rope_theta": float(hyper["rotary_base"]),
    }
    if "experts" in hyper:
        changes |= {"moe.router.num_experts": hyper["experts"]}
        if hyper.get("quantile_balancing"):
            changes |= {"moe.router.load_balancing_type": "quantile_balancing"}
        return "tiny-mixtral-8x7b", changes
    return "tiny-llama3-8b", changes


def _config(name: str, **overrides):
    preset_name, changes = _changes(name)
    return config_with_changes(preset_name, changes).replace(**overrides)


def _assert_logits(got: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 16 * torch.finfo(torch.float32).eps * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=tol)


@pytest.mark.parametrize("name", CASES)
def test_world1_logits_equal_megatron(name):
    fx = _fixture(name)
    model = load_megatron_weights(GPTModel(_config(name)), DATA / name).eval()
    with torch.no_grad():
        logits = gather_logits(
            model(fx["tokens"]), tp_group=None, vocab_size=fx["logits"].shape[-1]
        )
    _assert_logits(logits, fx["logits"])


def test_the_imported_quantile_balancing_offset_decides_the_routing():
    """``qb_beta`` (drawn at random by the fixture, a trained offset) moves expert choices: with
    it zeroed the logits leave Megatron's by far more than the tolerance, so the logits test
    above proves it was imported, not defaulted."""
    fx = _fixture("moe_qb_w1")
    model = load_megatron_weights(GPTModel(_config("moe_qb_w1")), DATA / "moe_qb_w1").eval()
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.router")]
    assert len(routers) == 2 and all(r.inner.qb_beta.abs().max() > 0.1 for r in routers)
    with torch.no_grad():
        for router in routers:
            router.inner.qb_beta.zero_()
        logits = gather_logits(
            model(fx["tokens"]), tp_group=None, vocab_size=fx["logits"].shape[-1]
        )
    tol = 16 * torch.finfo(torch.float32).eps * fx["logits"].abs().max().item()
    assert (logits - fx["logits"]).abs().max() > 100 * tol


@pytest.mark.parametrize(
    ("checkpoint", "config", "what"),
    [
        ("moe_qb_w1", "moe_ep2", "the checkpoint has tensors this config does not"),
        ("moe_ep2", "moe_qb_w1", "missing keys for this config"),
    ],
)
def test_a_routing_mismatch_names_the_router_option(checkpoint, config, what):
    with pytest.raises(ValueError, match=what) as err:
        megatron_state_dict(DATA / checkpoint, _config(config))
    assert "router.qb_beta" in str(err.value)
    assert "quantile-balancing routers: moe.router.load_balancing_type" in str(err.value)


def test_te_and_local_names_give_the_same_keys():
    te = megatron_state_dict(DATA / "llama_w1_te", _config("llama_w1_te"))
    local = megatron_state_dict(DATA / "llama_w1_local", _config("llama_w1_local"))
    assert sorted(te) == sorted(local)
    assert te.keys() == GPTModel(_config("llama_w1_te"), device="meta").sharded_state_dict().keys()


def _layout_logits(name, parallel):
    sp = parallel.pop("sequence_parallel", False)  # a model option, not a group
    groups = init_process_groups(ParallelConfig(**parallel))
    model = build_stage(_config(name, sequence_parallel=sp), groups)
    load_megatron_weights(model, DATA / name).eval()
    return pipeline_logits(model, groups, _fixture(name)["tokens"])


@pytest.mark.multirank
@pytest.mark.parametrize(
    "name,parallel",
    [
        ("llama_tp2pp2", {"tp": 2}),
        ("llama_tp2pp2", {"tp": 2, "sequence_parallel": True}),
        ("llama_tp2pp2", {"pp": 2}),
        ("moe_ep2", {"ep": 2}),
    ],
    ids=["tp2", "tp2-sp", "pp2", "ep2"],
)
def test_layouts_give_megatron_logits(name, parallel):
    results = run_on_ranks(_layout_logits, 2, args=(name, parallel))
    last = [r for r in results if r is not None]
    assert last, "no rank returned logits"
    for logits in last:
        _assert_logits(logits, _fixture(name)["logits"])


def test_cli_import_writes_a_checkpoint_that_loads(tmp_path, capsys):
    dst = tmp_path / "imported"
    preset_name, changes = _changes("moe_ep2")
    sets = [f"--set={k}={v}" for k, v in changes.items()]
    argv = ["import-megatron", str(DATA / "moe_ep2"), str(dst), "--preset", preset_name, *sets]
    assert ckpt_main(argv) == 0
    assert "imported" in capsys.readouterr().out
    model = GPTModel(_config("moe_ep2"))
    load(model.sharded_state_dict(), dst)
    fx = _fixture("moe_ep2")
    with torch.no_grad():
        logits = gather_logits(
            model.eval()(fx["tokens"]), tp_group=None, vocab_size=fx["logits"].shape[-1]
        )
    _assert_logits(logits, fx["logits"])


def test_cli_errors_are_one_line(tmp_path, capsys):
    argv = ["import-megatron", str(tmp_path), str(tmp_path / "out"), "--preset", "tiny-llama3-8b"]
    assert ckpt_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwork-ckpt: ") and "not a Megatron-Core checkpoint" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    argv = ["import-megatron", str(DATA / "llama_w1_te"), str(tmp_path / "o"), "--preset", "x"]
    assert ckpt_main(argv) == 2
    assert "unknown preset 'x'" in capsys.readouterr().err
    argv[-1:] = ["tiny-llama3-8b", "--set", "hidden_sise=3"]
    assert ckpt_main(argv) == 2
    assert "no field 'hidden_sise'" in capsys.readouterr().err


def _cli_error(argv: list[str], capsys) -> str:
    """``shardwork-ckpt import-megatron ARGV``'s one error line (exit status 2 asserted)."""
    code = ckpt_main(["import-megatron", *argv, "--preset", "tiny-llama3-8b"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("shardwork-ckpt: ") and err.count("\n") == 1, err
    return err


def test_cli_refuses_a_destination_that_is_a_file(tmp_path, capsys):
    """B8: DST an existing file (or a path under one) was a NotADirectoryError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    err = _cli_error([str(DATA / "llama_w1_te"), str(afile)], capsys)
    assert re.search(rf"destination '{re.escape(str(afile))}' exists and is not a directory "
                     r"\(give a new folder path or an empty directory\)", err)  # fmt: skip
    err = _cli_error([str(DATA / "llama_w1_te"), str(afile / "sub")], capsys)
    assert re.search(rf"'{re.escape(str(afile / 'sub'))}' cannot be created: "
                     rf"'{re.escape(str(afile))}' is a file, not a directory", err)  # fmt: skip
    assert afile.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [afile]


def _fake_megatron(folder: Path, index: bytes) -> Path:
    folder.mkdir()
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (folder / ".metadata").write_bytes(index)
    return folder


@pytest.mark.parametrize(
    "index",
    [
        b"garbage\n",
        b"",
        (DATA / "llama_w1_te" / ".metadata").read_bytes()[:200],
        pickle.dumps({"state_dict_metadata": {}}),
    ],
    ids=["garbage", "empty", "truncated", "a-dict"],
)
def test_cli_names_an_unreadable_metadata_index(tmp_path, capsys, index):
    """B9: a garbage ``.metadata`` escaped as the unpickler's own error (``invalid literal for
    int()``, EOFError, AttributeError) without naming the file."""
    src = _fake_megatron(tmp_path / "fakemeg", index)
    err = _cli_error([str(src), str(tmp_path / "out")], capsys)
    assert re.search(rf"'{re.escape(str(src / '.metadata'))}' is not a readable torch_dist "
                     r"metadata file \(.+\); expected the pickled torch\.distributed\."
                     r"checkpoint Metadata", err)  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"sharded_backend": torch_dist}', r"is not valid JSON \(Expecting value: line 1 column 21\)"),
        ('["torch_dist"]', r"holds a JSON list, not an object"),
    ],
    ids=["bad-json", "a-list"],
)  # fmt: skip
def test_cli_says_metadata_json_is_not_json(tmp_path, capsys, text, why):
    """D10: a metadata.json that is not a JSON object was reported as sharded_backend=None."""
    src = _fake_megatron(tmp_path / "src", b"")
    (src / "metadata.json").write_text(text)
    err = _cli_error([str(src), str(tmp_path / "out")], capsys)
    assert re.search(rf"'{re.escape(str(src))}' is not a Megatron-Core checkpoint: its "
                     rf"metadata\.json {why}.*\{{\"sharded_backend\": \"torch_dist\"\}}", err)  # fmt: skip
    assert "sharded_backend=None" not in err and not (tmp_path / "out").exists()


def test_shardwork_checkpoint_and_random_folder_are_not_megatron(tmp_path):
    ours = tmp_path / "ours"
    import_megatron(DATA / "llama_w1_te", ours, _config("llama_w1_te"))
    with pytest.raises(NotAMegatronCheckpointError, match=r"no metadata\.json"):
        megatron_state_dict(ours, _config("llama_w1_te"))
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(NotAMegatronCheckpointError, match="sharded_backend='zarr'"):
        megatron_state_dict(tmp_path / "random", _config("llama_w1_te"))


def test_wrong_hidden_size_names_key_and_both_shapes():
    config = _config("llama_w1_te", hidden_size=128)
    with pytest.raises(ValueError) as err:
        megatron_state_dict(DATA / "llama_w1_te", config)
    msg = str(err.value)
    assert "'decoder.layers.0.self_attention.linear_qkv.weight' has shape (128, 64)" in msg
    assert "the config gives (256, 128)" in msg


def test_wrong_vocab_names_key_and_both_shapes():
    with pytest.raises(ValueError) as err:
        megatron_state_dict(DATA / "llama_w1_local", _config("llama_w1_local", vocab_size=160))
    msg = str(err.value)
    assert "'embedding.word_embeddings.weight' has shape (128, 64)" in msg
    assert "the config gives (160, 64)" in msg


def test_missing_layers_are_named():
    with pytest.raises(ValueError, match=r"tensors this config does not.*decoder\.layers\.1\."):
        megatron_state_dict(DATA / "llama_w1_te", _config("llama_w1_te", num_layers=1))


def test_megatron_lm_args_are_checked(tmp_path):
    src = tmp_path / "with_args"
    shutil.copytree(DATA / "llama_w1_te", src)
    args = argparse.Namespace(
        num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, ffn_hidden_size=80, norm_epsilon=1e-5, kv_channels=None,
    )  # fmt: skip
    torch.save({"args": args}, src / "common.pt")
    with pytest.raises(ValueError, match="ffn_hidden_size: checkpoint args 80, config 64"):
        megatron_state_dict(src, _config("llama_w1_te"))
    args.ffn_hidden_size = 64
    torch.save({"args": args}, src / "common.pt")
    # embedding, final norm, head + per layer: 2 norms, q, k, v, proj, gate, up, fc2
    assert len(megatron_state_dict(src, _config("llama_w1_te"))) == 3 + 2 * 9


def test_megatron_vocab_padding_rows_are_dropped():
    """A checkpoint of 128 rows read for a 100-token vocabulary (Megatron pads to 128s): the
    logits are Megatron's first 100 columns. 260 rows (not a multiple of 128) are no padding."""
    fx = _fixture("llama_w1_local")
    model = GPTModel(_config("llama_w1_local", vocab_size=100))
    load_megatron_weights(model, DATA / "llama_w1_local").eval()
    tokens = fx["tokens"].clamp(max=99)  # other inputs: compare with a model of all 128 rows
    full = load_megatron_weights(GPTModel(_config("llama_w1_local")), DATA / "llama_w1_local")
    with torch.no_grad():
        got = gather_logits(model(tokens), tp_group=None, vocab_size=100)
        want = gather_logits(full.eval()(tokens), tp_group=None, vocab_size=128)[..., :100]
    _assert_logits(got, want)  # a matmul of other width may sum in another order
    with pytest.raises(ValueError, match=r"has shape \(260, 64\).*gives \(200, 64\)"):
        megatron_state_dict(DATA / "llama_w1_te", _config("llama_w1_te", vocab_size=200))


def test_index_only_check_finds_the_same_mistakes():
    for name in CASES:
        check_megatron_checkpoint(DATA / name, _config(name))
    with pytest.raises(ValueError, match=r"linear_qkv\.weight' has shape \(128, 64\)"):
        check_megatron_checkpoint(DATA / "llama_w1_te", _config("llama_w1_te", hidden_size=128))
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\."):
        check_megatron_checkpoint(DATA / "moe_ep2", _config("moe_ep2", num_layers=1))


def _rewrite_per_layer(src: Path, dst: Path) -> None:
    """``src`` re-saved with per-layer keys (``non_homogeneous_layers``) and TE's grouped-GEMM
    expert names (``mlp.experts.linear_fc1.weight<e>``), as Megatron writes for those specs."""
    renamed = {}
    for key, tensor in read_megatron_tensors(src).items():
        key = re.sub(
            r"mlp\.experts\.experts\.(\d+)\.linear_(fc[12])\.weight",
            r"mlp.experts.linear_\2.weight\1",
            key,
        )
        renamed[key] = tensor.clone()
    dcp.save(renamed, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    (dst / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))


@pytest.mark.parametrize("name", ["llama_w1_te", "moe_ep2"])
def test_per_layer_and_grouped_gemm_names_import_alike(tmp_path, name):
    _rewrite_per_layer(DATA / name, tmp_path / "per_layer")
    index = dcp.FileSystemReader(str(tmp_path / "per_layer")).read_metadata().state_dict_metadata
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in index
    assert ("decoder.layers.1.mlp.experts.linear_fc1.weight3" in index) == (name == "moe_ep2")
    fx = _fixture(name)
    model = load_megatron_weights(GPTModel(_config(name)), tmp_path / "per_layer").eval()
    with torch.no_grad():
        logits = gather_logits(
            model(fx["tokens"]), tp_group=None, vocab_size=fx["logits"].shape[-1]
        )
    _assert_logits(logits, fx["logits"])


@pytest.mark.parametrize("name", CASES)
def test_export_gives_back_the_tensors_megatron_wrote(tmp_path, name):
    """Import then export: every tensor equals the one megatron-core wrote, bit for bit, under
    its name and stacked layout. (Megatron itself loads these exports at the fixtures' layouts
    with its fixture logits: tools/megatron_checkpoint_fixture.py check-export.)"""
    config = _config(name)
    export_megatron(
        megatron_state_dict(DATA / name, config), config, tmp_path / "out",
        te_names=name != "llama_w1_local",
    )  # fmt: skip
    ours = dcp.FileSystemReader(str(tmp_path / "out")).read_metadata().state_dict_metadata
    # megatron's index through the allow-list decoder: torch before 2.15 cannot read the
    # indexes megatron wrote under 2.15 (TensorProperties gained a field)
    raw = (DATA / name / ".metadata").read_bytes()
    theirs = decode_metadata(raw, name=name).state_dict_metadata
    tensor_keys = {k for k, v in theirs.items() if hasattr(v, "size")}
    assert {k for k, v in ours.items() if hasattr(v, "size")} == tensor_keys
    want = read_megatron_tensors(DATA / name)
    got = read_megatron_tensors(tmp_path / "out")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_megatron(got, config, tmp_path / "out")


def test_args_in_the_in_checkpoint_common_state_are_checked(tmp_path):
    """Megatron-Core 0.15+ keeps the common state (Megatron-LM's ``args``) in the folder."""
    args = argparse.Namespace(num_layers=3, hidden_size=64, num_attention_heads=4)
    common = io.BytesIO()
    torch.save([{"args": args}], common)
    state = {k: v.clone() for k, v in read_megatron_tensors(DATA / "llama_w1_te").items()}
    dcp.save(
        state | {"common_state/shard_0_1": common},
        storage_writer=dcp.FileSystemWriter(str(tmp_path / "c")),
        no_dist=True,
    )
    (tmp_path / "c" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(ValueError, match="num_layers: checkpoint args 3, config 2"):
        megatron_state_dict(tmp_path / "c", _config("llama_w1_te"))


def test_console_script_finds_the_subcommand(tmp_path):
    """``shardwork-ckpt`` as installed: the entry point registers import-megatron, and a
    folder that is no checkpoint is one line on stderr, exit 2."""
    script = Path(sys.executable).parent / "shardwork-ckpt"
    out = tmp_path / "o"
    argv = [str(script), "import-megatron", str(tmp_path), str(out), "--preset", "tiny-llama3-8b"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"shardwork-ckpt: {str(tmp_path)!r} is not a Megatron-Core checkpoint: it has no "
        "metadata.json (expected the folder megatron.core.dist_checkpointing.save wrote in the "
        'torch_dist format, {"sharded_backend": "torch_dist"} in metadata.json, e.g. '
        "iter_0001000/ of a Megatron-LM run)\n"
    )
    assert not out.exists()
