"""The analytic communication forecast (planning/communication.py) from plans alone: the counts
and bytes each strategy's rules give, on the tiny llama (2 layers, hidden 64, 4 heads, 2 kv)."""
import pytest

from AutoXLA import cli
from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.planning.communication import communication

BATCH, SEQ = 8, 16


def _plan(checkpoints, strategy):
    return plan_from_config(checkpoints["llama"], strategy, 8)


def _weights(plan):
    return sum(t.nbytes for t in plan.parameters if not t.tied_to)


def _by(report, kind, phase=None):
    ops = [o for o in report.ops if o.kind == kind and (phase is None or o.phase == phase)]
    return sum(o.count for o in ops), sum(o.payload_bytes for o in ops)


def test_fsdp_moves_about_three_times_the_weights(checkpoints):
    plan = _plan(checkpoints, "fsdp")
    r = communication(plan, batch=BATCH, seq=SEQ)
    weights = _weights(plan)
    embed = plan["model.embed_tokens.weight"].nbytes
    # Every weight but the embedding (looked up in place) gathered forward and backward; every
    # gradient reduce-scattered: 3x the weights, less 2x the embedding.
    assert _by(r, "all-gather", "forward")[1] == weights - embed + 128 * 4   # + the token ids
    assert _by(r, "all-gather", "backward")[1] == weights - embed
    assert _by(r, "reduce-scatter")[1] == weights
    # The lookup's all-reduce of [all 128 tokens, hidden] and the loss's mean.
    assert _by(r, "all-reduce") == (2, BATCH * SEQ * 64 * 4 + 4)
    decode = communication(plan, batch=BATCH, train=False)
    assert _by(decode, "all-gather")[1] == weights - embed + BATCH * 4
    assert _by(decode, "reduce-scatter") == (0, 0)


def test_dp_all_reduces_each_gradient_once(checkpoints):
    plan = _plan(checkpoints, "dp")
    r = communication(plan, batch=BATCH, seq=SEQ)
    assert _by(r, "all-reduce") == (len(plan.parameters) + 1, _weights(plan) + 4)
    assert communication(plan, batch=BATCH, train=False).ops == []   # decoding talks not at all


def test_tensor_parallel_activation_all_reduces_per_layer(checkpoints):
    # 2d: model = 2 divides the 4 heads and 2 kv heads, so attention and MLP are both split.
    r = communication(_plan(checkpoints, "2d"), batch=BATCH, seq=SEQ)
    for layer in (0, 1):
        act = [o for o in r.per_layer()[layer] if o.what.startswith(("activation", "input"))]
        # Forward: after o_proj and down_proj. Backward: the input gradient of q, k, v, gate, up.
        assert sorted(o.phase for o in act) == ["backward"] * 5 + ["forward"] * 2
        # Tokens per device: the batch split over fsdp = 4; the hidden size whole.
        assert all(o.shape == (BATCH // 4 * SEQ, 64) and o.axes == ("model",) for o in act)


def test_3d_reduces_gradients_over_data_and_fsdp(checkpoints):
    r = communication(_plan(checkpoints, "3d"), batch=BATCH, seq=SEQ)
    up = [o for o in r.ops if o.what == "gradient model.layers.0.mlp.up_proj.weight"]
    # (model, fsdp) on 2x2x2: 128 rows over model, 64 columns gathered back over fsdp.
    assert [(o.kind, o.shape, o.group_size) for o in up] == [("reduce-scatter", (64, 64), 4)]
    # Ring factors: (n-1)/n for a reduce-scatter, 2(n-1)/n for an all-reduce.
    assert up[0].wire_bytes == up[0].payload_bytes * 3 / 4
    ar = next(o for o in r.ops if o.kind == "all-reduce" and o.group_size == 2)
    assert ar.wire_bytes == ar.payload_bytes


def test_describe_and_errors(checkpoints):
    text = communication(_plan(checkpoints, "fsdp"), batch=BATCH, seq=SEQ).describe()
    assert "layer 1" in text and "total" in text and "reduce-scatter" in text
    r = communication(_plan(checkpoints, "fsdp"), batch=3, seq=SEQ)
    assert any("does not divide" in n for n in r.notes)
    with pytest.raises(ValueError, match="positive"):
        communication(_plan(checkpoints, "fsdp"), batch=0, seq=SEQ)


def test_cli_comm(checkpoints, capsys):
    assert cli.main(["plan", str(checkpoints["llama"]), "--strategy", "2d", "--comm",
                     "--batch", "8", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "communication per training step" in out and "layer 0" in out
    assert cli.main(["plan", str(checkpoints["llama"]), "--comm", "--batch", "8",
                     "--max-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "KV cache" in out or "kv" in out.lower()
    assert "communication per decode step" in out
    assert cli.main(["plan", str(checkpoints["llama"]), "--comm"]) == 2
    assert "--comm needs --batch" in capsys.readouterr().err
