"""Hugging Face checkpoints in and out (trainer/checkpoint/hf.py, trainer/checkpoint/hf_io.py, trainer.cli.export_hf / import_hf):
the official names and shapes on the flagship (REFERENCE A11), the config both ways, a bit-exact round trip in
pieces smaller than a tensor, bad directories refused by name, and a run started from an exported directory
(checkpoint.init_from=<HF dir>) with the weights of the run it was exported from."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

import model as model_pkg
from tests.fork_server import run_module
from trainer.checkpoint import hf
from tests.helpers import ROOT, build_tiny, load_config
from tests.trainer.harness import env, losses, micro_overrides, run_cli, run_ranks
from trainer.checkpoint import Checkpointer, model_config_differences
from trainer.config import CheckpointConfig
from trainer.checkpoint.hf_io import INDEX, export, import_
from trainer.checkpoint.hf_io import hf_model_config
from trainer.cli import export_hf, import_hf


def test_flagship_names_and_shapes_are_the_reference_ones():
    cfg = load_config("v41_flash")
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    got = {t.name: t.shape for k, v in m.state_dict().items() if not k.startswith("vision.")  # (not exported yet)
           for t in hf.hf_tensors(k, tuple(v.shape))}
    assert got["model.embed.weight"] == (129280, 5120) and got["lm_head.weight"] == (129280, 5120)
    assert got["model.norm.weight"] == (5120,)
    for i in (0, 20, 39):
        p = f"model.layers.{i}."
        assert got[p + "hc_attn_fn"] == got[p + "hc_ffn_fn"] == (24, 20480)
        assert got[p + "hc_attn_base"] == (24,) and got[p + "hc_ffn_scale"] == (3,)
        assert got[p + "attn.wq_a.weight"] == (1280, 5120) and got[p + "attn.wq_b.weight"] == (32768, 1280)
        assert got[p + "attn.wkv.weight"] == (512, 5120) and got[p + "attn.kv_norm.weight"] == (512,)
        assert got[p + "attn.wo_a.weight"] == (8192, 4096) and got[p + "attn.wo_b.weight"] == (5120, 8192)
        assert got[p + "attn.attn_sink"] == (64,)
        assert got[p + "ffn.gate.weight"] == (384, 5120) and got[p + "ffn.gate.bias_vl"] == (384,)
        assert got[p + "ffn.experts.383.w1.weight"] == got[p + "ffn.experts.0.w3.weight"] == (2304, 5120)
        assert got[p + "ffn.experts.7.w2.weight"] == (5120, 2304)
        assert got[p + "ffn.shared_experts.w2.weight"] == (5120, 2304)
        assert p + "ffn.experts.384.w1.weight" not in got
    wgate = sorted(int(n.split(".")[2]) for n in got if n.endswith("compressor.wgate.weight"))
    wk = sorted(int(n.split(".")[2]) for n in got if n.endswith("indexer.wk.weight"))
    wq = sorted(int(n.split(".")[2]) for n in got if n.endswith("indexer.wq_b.weight"))
    assert wgate == [2, 8, 14] and wk == [2, 8, 14, 20] and wq == [2, 8, 14, 20, 24, 28, 32, 36]
    assert got["model.layers.1.engram.embed.weight"] == (384006168, 256)
    assert got["model.layers.14.engram.embed.weight"] == (384016682, 256)
    assert got["model.layers.14.engram.wkv.weight"] == (25600, 6144)
    assert got["model.layers.1.engram.q_weight"] == (4, 5120)
    # every name maps back to its Cedar tensor; what Cedar does not model is dropped, not misread
    for name in got:
        assert hf.cedar_name(name) is not None
    assert hf.cedar_name("mtp.0.attn.wq_a.weight") is None and hf.dropped_reason("vision.blocks.0.w") is not None
    assert hf.keeps_fp32("layers.3.hc_ffn.base") and hf.keeps_fp32("layers.0.ffn.gate.bias_image")
    assert not hf.keeps_fp32("layers.0.attn.q_norm.weight")

    c = hf.hf_config(cfg)
    assert c["compress_ratios"] == [0, 0] + [2] * 18 + [1] * 20 and c["kv_source_layer_ids"] == [2, 8, 14, 20]
    assert c["index_source_layer_ids"] == [2, 8, 14, 20, 24, 28, 32, 36] and c["candidate_source_layer_id"] == 20
    assert c["engram_num_embeddings"] == [384006168, 384016682] and c["engram_layer_ids"] == [1, 14]
    assert (c["hidden_size"], c["num_hidden_layers"], c["n_routed_experts"], c["moe_intermediate_size"]) == \
        (5120, 40, 384, 2304)
    assert c["rms_norm_eps"] == 1e-20 and c["rope_scaling"]["factor"] == 16.0 and c["routed_scaling_factor"] == 1.5


@pytest.mark.parametrize("name", ["v41_flash", "v41_tiny"])
def test_config_both_ways(name):
    cfg = load_config(name)
    # config.json carries no vision section yet (the tower's HF names are not known here, issue 20): text model
    cfg = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, num_layers=0))
    back = hf.model_config(hf.hf_config(cfg))
    # the tables' storage dtype is the files' (trainer/cli/import_hf.py), not config.json's
    back = dataclasses.replace(back, engram=dataclasses.replace(back.engram, table_dtype=cfg.engram.table_dtype))
    assert model_config_differences(dataclasses.asdict(cfg), dataclasses.asdict(back)) == []
    # a composite config (text_config) with the released draft-layer entries of compress_ratios reads the same
    text = {**hf.hf_config(cfg), "num_nextn_predict_layers": 3}
    text["compress_ratios"] = text["compress_ratios"] + [0, 0, 0]
    assert hf.model_config({"text_config": text, "model_type": "deepseek_v41"}) == hf.model_config(hf.hf_config(cfg))
    with pytest.raises(ValueError, match="scoring_func='softmax'; Cedar models scoring_func='sqrtsoftplus'"):
        hf.model_config({**hf.hf_config(cfg), "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        hf.model_config({**hf.hf_config(cfg), "engram_num_embeddings": [1, 2][:len(cfg.engram.layers)]})


def _random_checkpoint(tmp: Path):
    """v41_tiny with random weights and balancing biases, saved as a Cedar checkpoint: (checkpoint, config, state)."""
    cfg = load_config("v41_tiny")
    m = build_tiny(seed=3)
    with torch.no_grad():
        for b in m.buffers():
            if b.is_floating_point():
                b.normal_()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    info = {"model": dataclasses.asdict(cfg)}
    ckpt = Checkpointer(tmp / "run" / "checkpoints", CheckpointConfig(), 0, info=info).save(2, {"train": {"model": state}})
    return ckpt, cfg, state


def _load(ckpt: Path, cfg) -> dict:
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    st = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in m.state_dict().items()}
    dcp.load({"train": {"model": st}}, checkpoint_id=str(ckpt))
    return st


def test_round_trip_is_exact_in_pieces(tmp_path):
    """Pieces of 64 KiB (smaller than most tensors: row and expert ranges) and files of 2 MB. float32 export ->
    import is the original bit for bit; a bf16 export holds each tensor rounded to bf16 (the fp32-kept ones as they
    are), and exporting its import again gives the same files byte for byte (HF -> Cedar -> HF is exact)."""
    ckpt, cfg, state = _random_checkpoint(tmp_path)
    small = dict(max_shard_bytes=2 * 2**20, chunk_bytes=64 * 1024)
    index = export(ckpt, tmp_path / "f32", cfg, dtype=torch.float32, **small)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 5 and len(index["weight_map"]) == sum(
        len(hf.hf_tensors(k, tuple(v.shape))) for k, v in state.items())
    data = sum((tmp_path / "f32" / f).stat().st_size for f in files)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in state.values()) <= data
    assert data - index["metadata"]["total_size"] < 8 * 2**10 * len(files)  # the headers only: nothing grows
    back = _load(import_(tmp_path / "f32", tmp_path / "imp32", cfg, chunk_bytes=64 * 1024), cfg)
    assert all(torch.equal(back[k], v) for k, v in state.items())

    index = export(ckpt, tmp_path / "bf16", cfg, dtype=torch.bfloat16, **small)
    for k, v in state.items():
        for t in hf.hf_tensors(k, tuple(v.shape)):
            with safe_open(str(tmp_path / "bf16" / index["weight_map"][t.name]), framework="pt") as f:
                got = f.get_tensor(t.name)
            want = v if t.expert is None else v[t.expert]
            assert torch.equal(got, want.to(torch.float32 if hf.keeps_fp32(k) else torch.bfloat16)), t.name
    imported = import_(tmp_path / "bf16", tmp_path / "imp16", cfg, chunk_bytes=64 * 1024)
    again = export(imported, tmp_path / "bf16_again", cfg, dtype=torch.bfloat16, **small)
    assert again["weight_map"] == index["weight_map"]
    for f in set(index["weight_map"].values()):
        assert (tmp_path / "bf16" / f).read_bytes() == (tmp_path / "bf16_again" / f).read_bytes()
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41_text"
    # the model of the directory: config.json's, with the tables' dtype of the files
    assert model_config_differences(dataclasses.asdict(hf_model_config(tmp_path / "bf16")), dataclasses.asdict(cfg)) \
        == [("engram.table_dtype", "bfloat16", "float32")]
    assert model_config_differences(dataclasses.asdict(hf_model_config(tmp_path / "f32")), dataclasses.asdict(cfg)) == []


def test_import_refuses_by_name_and_drops_what_it_does_not_model(tmp_path, caplog):
    ckpt, cfg, state = _random_checkpoint(tmp_path)
    src = tmp_path / "hf"
    index = export(ckpt, src, cfg, dtype=torch.float32)
    first = sorted(set(index["weight_map"].values()))[0]
    save_file({"mtp.0.attn.wq_a.weight": torch.zeros(2, 2), "vision.patch.weight": torch.zeros(2)},
              str(src / "extra.safetensors"))
    index["weight_map"].update({"mtp.0.attn.wq_a.weight": "extra.safetensors", "vision.patch.weight": "extra.safetensors"})
    (src / INDEX).write_text(json.dumps(index))
    with caplog.at_level("WARNING"):
        back = _load(import_(src, tmp_path / "imp", cfg), cfg)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert "dropped 1 tensor(s): the DSpark / MTP draft layers" in caplog.text and "vision tower" in caplog.text

    name = next(iter(index["weight_map"]))  # a tensor of the wrong shape
    with safe_open(str(src / first), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensors[name][:1]
    save_file(tensors, str(src / first))
    with pytest.raises(ValueError, match=f"{name} has shape"):
        import_(src, tmp_path / "imp2", cfg)
    del index["weight_map"][name]
    (src / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"no tensor '{name}'"):
        import_(src, tmp_path / "imp3", cfg)


def test_a_truncated_or_corrupt_file_is_one_line_naming_it(tmp_path, capsys):
    """import_hf of a directory with a truncated safetensors shard, a corrupt index or config.json: one line naming
    the file, exit status 2 (safetensors' own error names no file and comes with a traceback)."""
    ckpt, cfg, _ = _random_checkpoint(tmp_path)
    good = tmp_path / "hf"
    index = export(ckpt, good, cfg, dtype=torch.float32)
    first = sorted(set(index["weight_map"].values()))[0]

    def import_error(damage: str, cut: int) -> str:
        src = tmp_path / f"hf_{len(list(tmp_path.glob('hf_*')))}"
        shutil.copytree(good, src)
        (src / damage).write_bytes((src / damage).read_bytes()[:cut])
        with pytest.raises(SystemExit) as e:
            import_hf.main([f"src={src}", f"out={tmp_path / 'out'}"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(src / damage) in err[0] and "truncated or corrupt" in err[0], err
        return err[0]

    assert "not a readable safetensors file" in import_error(first, 100)  # inside the header
    assert "not a readable safetensors file" in import_error(first, (good / first).stat().st_size // 2)  # the data
    assert "not valid JSON" in import_error(INDEX, 50)
    assert "not valid JSON" in import_error("config.json", 20)
    assert not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_written_is_one_line_before_any_file(tmp_path, capsys):
    """From a fresh clone (issue 44): import_hf into a directory it cannot create ended in a traceback (the
    checkpointer's CheckpointSaveError); export_hf with a missing tokenizer= wrote every weight file first, then said
    "No such file or directory". Both: one line, exit status 2; the export writes nothing."""
    ckpt, cfg, _ = _random_checkpoint(tmp_path)
    hf = tmp_path / "hf"
    export(ckpt, hf, cfg, dtype=torch.float32)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        import_hf.main([f"src={hf}", f"out={blocker / 'out'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(blocker) in err[0], err
    with pytest.raises(SystemExit) as e:
        export_hf.main([f"ckpt={ckpt}", f"out={tmp_path / 'x'}", f"tokenizer={tmp_path / 'none.json'}"])
    assert e.value.code == 2
    missing = tmp_path / "none.json"
    assert capsys.readouterr().err.strip().splitlines() == [f"error: tokenizer='{missing}' does not exist"]
    assert not (tmp_path / "x").exists()


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return run_module(module, list(args), cwd=ROOT, env=env(), timeout=300)


@pytest.mark.slow
def test_a_run_starts_from_an_exported_directory(tmp_path, small_data):
    """Pretrain 2 steps; export its checkpoint (float32, and bf16 with the CLI); a run with checkpoint.init_from=
    <the float32 HF directory> takes the same first step as one started from the checkpoint itself."""
    pre = tmp_path / "pre"
    r = run_cli(micro_overrides(pre, small_data, "trainer.max_steps=2", "checkpoint.interval=2"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _cli("trainer.cli.export_hf", f"ckpt={pre}", f"out={tmp_path / 'hf32'}", "dtype=float32")
    assert r.returncode == 0 and "exported" in r.stdout, r.stderr[-2000:]
    assert (tmp_path / "hf32" / "tokenizer.json").is_file()  # the run's, beside the weights
    r = _cli("trainer.cli.export_hf", f"ckpt={pre}", f"out={tmp_path / 'hf16'}")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _cli("trainer.cli.import_hf", f"src={tmp_path / 'hf16'}", f"out={tmp_path / 'imp'}")
    assert r.returncode == 0 and "checkpoint.init_from=" in r.stdout, r.stderr[-2000:]

    runs = {}
    for name, init in (("ckpt", pre), ("hf", tmp_path / "hf32")):
        runs[name] = tmp_path / name
        r = run_cli(micro_overrides(runs[name], small_data, "trainer.max_steps=1", f"checkpoint.init_from={init}"))
        assert r.returncode == 0, r.stderr[-2000:]
    assert losses(runs["hf"]) == losses(runs["ckpt"])
    assert (runs["hf"] / "hf_init" / "checkpoints" / "step_00000000" / "COMPLETE").is_file()
    # what import_hf tells the user to do: its bf16 tables are cast to the run's float32 ones, with one info line
    r = run_cli(micro_overrides(tmp_path / "from_imp", small_data, "trainer.max_steps=1",
                                f"checkpoint.init_from={tmp_path / 'imp'}"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stores the Engram tables in bfloat16; cast to this run's model.engram.table_dtype=float32" in (
        r.stderr + (tmp_path / "from_imp" / "main.log").read_text())
    assert abs(losses(tmp_path / "from_imp")[1] - losses(runs["ckpt"])[1]) < 0.05  # the weights, rounded to bf16

    r = run_cli(micro_overrides(tmp_path / "bad", small_data, "trainer.max_steps=1", "model.dim=64",
                                f"checkpoint.init_from={tmp_path / 'hf32'}"))
    assert r.returncode == 2 and "its config.json gives another model: model.dim=32 there, 64 here" in r.stderr
    r = _cli("trainer.cli.export_hf", f"ckpt={tmp_path / 'nowhere'}", "out=x")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = _cli("trainer.cli.import_hf", f"src={pre}", "out=x")
    assert r.returncode == 2 and "is not a Hugging Face checkpoint directory" in r.stderr
    r = _cli("trainer.cli.import_hf", "nosuch=1")
    assert r.returncode == 2 and "unknown key nosuch" in r.stderr and "Traceback" not in r.stderr
    r = _cli("trainer.cli.export_hf", "--help")
    assert r.returncode == 0 and "max_shard_gb" in r.stdout


def test_large_tensors_are_stored_in_pieces(tmp_path):
    """Checkpointer's save plan (PieceSavePlanner) stores a tensor above checkpoint.piece_mb as row ranges of at most
    that size, and loads it back whole, bit for bit; a partial read (the export's) then reads only pieces."""
    from trainer.checkpoint import PieceSavePlanner

    state = {"big": torch.randn(100, 37), "small": torch.randn(3, 2), "scalar": torch.tensor(2.5),
             "long": torch.arange(1000)}
    dcp.save({"train": {"model": state}}, checkpoint_id=str(tmp_path), planner=PieceSavePlanner(piece_bytes=1024))
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    chunks = {k.rsplit(".", 1)[-1]: v.chunks for k, v in md.items()}
    assert [c.sizes[0] for c in chunks["big"]] == [6] * 16 + [4]  # 6 rows x 37 x 4 bytes <= 1 KiB
    assert len(chunks["small"]) == len(chunks["scalar"]) == 1 and len(chunks["long"]) == 8
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load({"train": {"model": back}}, checkpoint_id=str(tmp_path))
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.distributed
def test_two_ranks_export_and_import_the_same_files(tmp_path):
    """Under torchrun each rank writes its share (export: files 0, 2, ... and 1, 3, ...; import: every other
    tensor): the same files as one process, byte for byte, and a checkpoint that loads the same weights."""
    ckpt, cfg, state = _random_checkpoint(tmp_path)
    one = export(ckpt, tmp_path / "one", cfg, max_shard_bytes=2 * 2**20)
    run = lambda module, *args: run_ranks(2, list(args), module=module)  # noqa: E731 (torchrun's two ranks, forked)
    r = run("trainer.cli.export_hf", f"ckpt={ckpt}", f"out={tmp_path / 'two'}", "max_shard_gb=0.002097152")
    assert r.returncode == 0, r.stderr[-3000:]
    files = set(one["weight_map"].values())
    assert len(files) > 2 and json.loads((tmp_path / "two" / INDEX).read_text())["weight_map"] == one["weight_map"]
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    r = run("trainer.cli.import_hf", f"src={tmp_path / 'two'}", f"out={tmp_path / 'imp'}", "table_dtype=float32")
    assert r.returncode == 0, r.stderr[-3000:]
    back = _load(tmp_path / "imp" / "checkpoints" / "step_00000000", cfg)
    assert all(torch.equal(back[k], v if hf.keeps_fp32(k) else v.to(torch.bfloat16).float()) for k, v in state.items())


def _fp8_blocks(w: torch.Tensor, bo: int, bi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (fp8 e4m3 values, fp32 scales [ceil(R / bo), ceil(C / bi)]): each block's amax maps to 448."""
    R, C = w.shape
    nb = (-(-R // bo), -(-C // bi))
    padded = torch.zeros(nb[0] * bo, nb[1] * bi)
    padded[:R, :C] = w
    amax = padded.view(nb[0], bo, nb[1], bi).abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / 448.0
    q = (w / scale.repeat_interleave(bo, 0)[:R].repeat_interleave(bi, 1)[:, :C]).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_scaled_matrices_are_dequantised(tmp_path):
    """A directory with some matrices in FP8 and their block scales (`<name>_scale_inv`, config.json's
    quantization_config.weight_block_size: here [3, 8], so blocks straddle the import's 16-row pieces and the last is
    partial): each imports as q x its block's scale, exactly, whatever the pieces; a missing scale is refused."""
    ckpt, cfg, state = _random_checkpoint(tmp_path)
    src = tmp_path / "hf"
    index = export(ckpt, src, cfg, dtype=torch.float32)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [3, 8]}
    (src / "config.json").write_text(json.dumps(config))
    chosen = ["model.layers.0.attn.wq_a.weight", "model.layers.2.attn.compressor.wkv.weight",
              "model.layers.1.ffn.experts.3.w1.weight", "model.layers.1.ffn.shared_experts.w2.weight"]
    want = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(src / file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for name in [n for n in chosen if n in tensors]:
            q, scale = _fp8_blocks(tensors[name], 3, 8)
            rows, cols = tensors[name].shape
            want[name] = q.float() * scale.repeat_interleave(3, 0)[:rows].repeat_interleave(8, 1)[:, :cols]
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            index["weight_map"][name + "_scale_inv"] = file
        save_file(tensors, str(src / file))
    (src / INDEX).write_text(json.dumps(index))
    back = _load(import_(src, tmp_path / "imp", cfg, chunk_bytes=8192), cfg)  # 16-row pieces of wq_a
    assert back["layers.0.attn.wq_a.weight"].shape[0] % 3  # a partial last block
    assert torch.equal(back["layers.0.attn.wq_a.weight"], want[chosen[0]])
    assert torch.equal(back["layers.2.attn.compressor.wkv.weight"], want[chosen[1]])
    assert torch.equal(back["layers.1.ffn.experts.w1"][3], want[chosen[2]])
    assert torch.equal(back["layers.1.ffn.shared_experts.w2.weight"], want[chosen[3]])
    # fp8 with per-block scales stays within e4m3's rounding (2^-4 relative) of the original
    w = state["layers.0.attn.wq_a.weight"]
    assert (back["layers.0.attn.wq_a.weight"] - w).abs().max() <= w.abs().max() / 16
    others = [k for k in state if k not in ("layers.0.attn.wq_a.weight", "layers.2.attn.compressor.wkv.weight",
                                            "layers.1.ffn.experts.w1", "layers.1.ffn.shared_experts.w2.weight")]
    assert all(torch.equal(back[k], state[k]) for k in others)
    del index["weight_map"][chosen[0] + "_scale_inv"]
    (src / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="is fp8 but its scales"):
        import_(src, tmp_path / "imp2", cfg)


def _decode_fp4(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes two a byte (element 2i in the low nibble) -> float32, written from the format alone."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = torch.tensor(grid + [-g for g in grid])
    b = packed.view(torch.uint8).long()
    return torch.stack([table[b % 16], table[b // 16]], dim=-1).flatten(-2)


def test_released_quantised_formats_both_ways(tmp_path):
    """quant=released writes the released kinds (FP4-packed routed experts with a ue8m0 scale per 32 channels of a
    row, FP8 128 x 128 blocks for the linear layers' other matrices, FP8 Engram rows; the embedding, head, router,
    gates and norms in bf16, the fp32-kept tensors in fp32), config.json's quantization_config says so, and the
    import reads them back: each weight is its code times its scale (decoded here from the format), within the
    format's rounding of the original, and the dequantised weights are a fixed point of export + import."""
    ckpt, cfg, state = _random_checkpoint(tmp_path)
    small = dict(max_shard_bytes=2 * 2**20, chunk_bytes=64 * 1024)
    index = export(ckpt, tmp_path / "q", cfg, quant="released", **small)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                                             "expert_dtype": "fp4"}
    tensors = {}
    for file in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "q" / file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(tensors) == set(index["weight_map"])
    dtypes = {n: t.dtype for n, t in tensors.items()}
    p = "model.layers.1."
    assert dtypes[p + "ffn.experts.3.w1.weight"] == torch.int8 and tensors[p + "ffn.experts.3.w1.weight"].shape == \
        (96, 64) and tensors[p + "ffn.experts.3.w1.scale"].shape == (96, 4)
    assert dtypes[p + "ffn.experts.3.w1.scale"] == torch.float8_e8m0fnu
    assert dtypes[p + "attn.wq_b.weight"] == torch.float8_e4m3fn and tensors[p + "attn.wq_b.scale"].shape == (2, 1)
    assert dtypes[p + "engram.embed.weight"] == torch.float8_e4m3fn and tensors[p + "engram.embed.scale"].shape == \
        (state["layers.1.engram.table"].shape[0], 1)
    for name in ("model.embed.weight", "lm_head.weight", p + "ffn.gate.weight", p + "attn.q_norm.weight",
                 "model.layers.2.attn.compressor.wgate.weight", "model.layers.2.attn.indexer.weights_proj.weight"):
        assert dtypes[name] == torch.bfloat16, name
    assert dtypes[p + "hc_attn_fn"] == dtypes[p + "attn.attn_sink"] == dtypes[p + "ffn.gate.bias"] == torch.float32
    # the data: sizes are the codes and scales, nothing more
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    imported = import_(tmp_path / "q", tmp_path / "imp", cfg, chunk_bytes=64 * 1024)
    back = _load(imported, cfg)
    # an FP4 expert: code x 2^(e - 127), error at most a scale step
    codes, e8 = tensors[p + "ffn.experts.3.w1.weight"], tensors[p + "ffn.experts.3.w1.scale"]
    scale = torch.exp2(e8.view(torch.uint8).float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(back["layers.1.ffn.experts.w1"][3], _decode_fp4(codes) * scale)
    assert ((back["layers.1.ffn.experts.w1"][3] - state["layers.1.ffn.experts.w1"][3]).abs() <= scale).all()
    # an FP8 block matrix (256 x 64: two row blocks) and an FP8 Engram table
    for name, hf_name, rows, cols in (("layers.1.attn.wq_b.weight", p + "attn.wq_b", 128, 128),
                                      ("layers.1.engram.table", p + "engram.embed", 1, 32)):
        codes, e8 = tensors[hf_name + ".weight"], tensors[hf_name + ".scale"]
        scale = torch.exp2(e8.view(torch.uint8).float() - 127).repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        scale = scale[:codes.shape[0], :codes.shape[1]]
        assert torch.equal(back[name], codes.float() * scale), name
        assert ((back[name] - state[name]).abs() <= state[name].abs() / 16 + scale * 2**-9).all(), name
    for k in ("embed.weight", "layers.1.ffn.gate.weight", "layers.2.attn.compressor.wgate.weight"):
        assert torch.equal(back[k], state[k].to(torch.bfloat16).float()), k
    assert torch.equal(back["layers.1.hc_attn.fn"], state["layers.1.hc_attn.fn"])

    # the dequantised weights export and import to themselves
    export(imported, tmp_path / "q2", cfg, quant="released", **small)
    again = _load(import_(tmp_path / "q2", tmp_path / "imp2", cfg), cfg)
    assert all(torch.equal(again[k], back[k]) for k in back)


def test_v3_scale_names_and_fp32_scales_are_read(tmp_path):
    """DeepSeek-V3's convention (`<m>.weight_scale_inv`, fp32 scales) and uint8 exponent bytes read like V4's."""
    ckpt, cfg, state = _random_checkpoint(tmp_path)
    src = tmp_path / "q"
    index = export(ckpt, src, cfg, quant="released")
    name = "model.layers.0.ffn.experts.5.w2"
    for file in set(index["weight_map"].values()):
        with safe_open(str(src / file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if name + ".scale" in tensors:
            want = _decode_fp4(tensors[name + ".weight"]) * tensors[name + ".scale"].float().repeat_interleave(32, 1)
            tensors[name + ".weight_scale_inv"] = tensors.pop(name + ".scale").float()
            index["weight_map"][name + ".weight_scale_inv"] = index["weight_map"].pop(name + ".scale")
            engram = "model.layers.1.engram.embed.scale"
            if engram in tensors:
                tensors[engram] = tensors[engram].view(torch.uint8)  # exponent bytes
            save_file(tensors, str(src / file))
    (src / INDEX).write_text(json.dumps(index))
    back = _load(import_(src, tmp_path / "imp", cfg), cfg)
    assert torch.equal(back["layers.0.ffn.experts.w2"][5], want)
    assert (back["layers.1.engram.table"] - state["layers.1.engram.table"]).abs().max() > 0  # dequantised, not raw
