"""bench/moe_peer_step.py, the MoE peer of issue 41, on the CPU: its grouped-GEMM experts compute what the
per-expert loop computes (forward and every parameter's gradient, fp32, an expert left empty), a tiny model's loss
falls over a few steps, its FLOPs per token read off the parameters equal the closed form the depth search uses, and
the entry point writes peer_step's row format and refuses an unknown config with one line (exit 2)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import moe_peer_step as peer  # noqa: E402

SHAPES = dict(num_experts=5, experts_per_token=2, expert_dim=24, num_shared=1)


def build(experts: str, score_func: str = "sigmoid", dim: int = 36, heads: int = 3) -> peer.MoELM:
    """A 2-layer MoELM of awkward widths (by default dim 36, 3 heads of 12, 5 experts of 24), fp32 on the CPU."""
    with torch.device("meta"):
        model = peer.MoELM(97, dim, 2, heads, 11, route_scale=1.5, score_func=score_func, experts=experts,
                           **SHAPES)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_grouped_equals_loop(score_func):
    grouped, loop = build("grouped", score_func), build("loop", score_func)
    loop.load_state_dict(grouped.state_dict())
    for model in (grouped, loop):  # expert 3 of layer 0 gets no rows: an empty group
        model.blocks[0].moe.expert_bias[3] = -1e3
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (grouped, loop):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    assert int(grouped.blocks[0].moe.tokens_per_expert[3]) == 0
    assert grouped.blocks[0].moe.tokens_per_expert.sum() == 2 * 11 * SHAPES["experts_per_token"]
    torch.testing.assert_close(grouped.blocks[0].moe.tokens_per_expert, loop.blocks[0].moe.tokens_per_expert)
    torch.testing.assert_close(losses[0], losses[1])
    grads = dict(loop.named_parameters())
    for name, p in grouped.named_parameters():
        assert p.grad is not None and grads[name].grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad, msg=lambda m: f"{name}: {m}")
    assert grouped.blocks[0].moe.w1.grad[3].abs().max() == 0  # the empty expert's weights get no gradient
    assert grouped.blocks[0].moe.w1.grad.abs().sum() > 0


def test_loss_falls():
    model = build("grouped", dim=40, heads=4)  # bf16 grouped GEMMs need rows of a multiple of 16 bytes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the benchmark's precision: the bf16 grouped GEMMs
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peer.update_expert_bias(model, 1e-3)
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert float(model.blocks[0].moe.tokens_per_expert.abs().sum()) == 0  # the counts restart after each update
    assert float(model.blocks[0].moe.expert_bias.abs().sum()) > 0


def test_flops_closed_form():
    model = build("grouped")
    for seq_len in (11, 2048):
        assert model.flops_per_token(seq_len) == peer.moe_peer_flops(97, 36, 2, seq_len, **SHAPES)


def test_main_row(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rows.jsonl"
    monkeypatch.setattr(sys, "argv", ["moe_peer_step.py", "--match", "v41_tiny", "--layers", "1", "--batch-size", "1",
                                      "--seq-len", "16", "--steps", "1", "--warmup", "0", "--no-compile",
                                      "--device", "cpu", "--json", str(out)])
    peer.main()
    row = json.loads(out.read_text())
    assert row["model"] == "MoE peer of v41_tiny" and row["experts"] == "grouped" and row["layers"] == 1
    assert (row["num_experts"], row["experts_per_token"], row["ffn"], row["dim"]) == (8, 2, 96, 128)
    assert row["flops_per_token"] == peer.moe_peer_flops(4096, 128, 1, 16, 8, 2, 96, 1)
    assert row["step_ms"] > 0 and row["mfu_measured"] > 0 and row["match_flops_per_token"] > 0
    assert "GFLOP/token (v41_tiny: " in capsys.readouterr().out


def test_unknown_match(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["moe_peer_step.py", "--match", "no_such_model", "--device", "cpu"])
    with pytest.raises(SystemExit) as exc:
        peer.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no_such_model" in err
