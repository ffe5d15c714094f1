"""Plans from a config alone: roles, specs, reasons, ties, totals, the CLI."""
import json
import subprocess
import sys

import pytest

from AutoXLA.cli import main

from AutoXLA.modeling.from_config import plan_from_config


def test_roles_and_specs_follow_the_megatron_convention(checkpoints):
    plan = plan_from_config(checkpoints["llama"], "2d", 8)
    roles = {t.name.split(".")[-2]: (t.role, t.spec) for t in plan.parameters}
    assert roles["q_proj"] == ("column_linear", ("model", "fsdp"))
    assert roles["gate_proj"] == ("column_linear", ("model", "fsdp"))
    assert roles["o_proj"] == ("row_linear", ("fsdp", "model"))
    assert roles["down_proj"] == ("row_linear", ("fsdp", "model"))
    assert roles["embed_tokens"] == ("vocab_embedding", ("fsdp", "model"))
    assert roles["lm_head"] == ("lm_head", ("model", "fsdp"))
    assert plan["model.norm.weight"].role == "norm"
    assert plan["model.rotary_emb.inv_freq"].role == "buffer"
    assert not plan["model.rotary_emb.inv_freq"].persistent


def test_shard_shapes_and_bytes(checkpoints):
    plan = plan_from_config(checkpoints["llama"], "2d", 8, "bf16")
    q = plan["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (64, 64) and q.shard_shape == (32, 16)      # model=2 on out, fsdp=4 on in
    assert q.bytes_per_device == 32 * 16 * 2 and q.dtype == "bfloat16"
    assert plan["model.rotary_emb.inv_freq"].dtype == "float32"   # buffers keep their dtype
    assert plan.bytes_per_device() < plan.total_bytes() / 4


def test_gqa_heads_decide_the_split(checkpoints):
    # Gemma2 fixture: 6 query heads, 3 kv heads. On 2d (model=2) q splits, k/v do not.
    plan = plan_from_config(checkpoints["gemma2"], "2d", 8)
    assert plan["model.layers.0.self_attn.q_proj.weight"].spec == ("model", "fsdp")
    k = plan["model.layers.0.self_attn.k_proj.weight"]
    assert k.spec == (None, "fsdp")
    assert k.reason == "replicated on model: 3 heads do not divide model=2"


def test_dims_that_do_not_divide_are_replicated_with_reason(checkpoints):
    # Qwen3 fixture: vocab 250 and intermediate 77 divide nothing on 8 devices.
    plan = plan_from_config(checkpoints["qwen3"], "fsdp", 8)
    emb = plan["model.embed_tokens.weight"]
    assert emb.spec == (None, None) and "dim 0 (250) does not divide fsdp=8" in emb.reason
    assert emb.name in {t.name for t in plan.replicated_for_divisibility}
    up = plan_from_config(checkpoints["qwen3"], "2d", 8)["model.layers.0.mlp.up_proj.weight"]
    assert up.spec == (None, "fsdp")   # out dim 77 stays whole on model=2, in dim 64 splits
    assert up.reason == "replicated on model: dim 0 (77) does not divide model=2"


def test_tied_weights_share_the_source_spec(checkpoints):
    plan = plan_from_config(checkpoints["gemma2"], "2d", 8)
    head, emb = plan["lm_head.weight"], plan["model.embed_tokens.weight"]
    assert head.tied_to == emb.name and head.spec == emb.spec
    # A tied tensor is stored once: totals count it once.
    untied = plan_from_config(checkpoints["llama"], "2d", 8)
    assert not any(t.tied_to for t in untied)
    assert plan.total_bytes() == sum(_full_bytes(t) for t in plan
                                     if not t.tied_to)


def _full_bytes(t):
    import math

    return math.prod(t.shape) * {"float32": 4, "bfloat16": 2, "float16": 2}[t.dtype]


def test_dp_replicates_everything(checkpoints):
    plan = plan_from_config(checkpoints["mistral"], "dp", 8)
    assert all(all(a is None for a in t.spec) for t in plan)
    assert plan.bytes_per_device() == plan.total_bytes()


def test_plan_prints_a_table_with_totals(checkpoints):
    text = str(plan_from_config(checkpoints["llama"], "mp", 8))
    assert text.startswith("AutoXLA plan: LlamaForCausalLM, strategy mp, mesh data=1xfsdp=1xmodel=8")
    assert "2 heads do not divide model=8" in text
    assert "per device" in text.splitlines()[-1] and "replicated for divisibility" in text


def test_plan_json_round_trips(checkpoints):
    plan = plan_from_config(checkpoints["llama"], "3d", 8)
    data = json.loads(plan.to_json())
    assert data["mesh"] == {"data": 2, "fsdp": 2, "model": 2}
    assert len(data["tensors"]) == len(plan)


def test_cli_plan_from_config_without_devices(checkpoints, tmp_path):
    # Only config.json, no weights, in a fresh interpreter that must not start torch_xla.
    (tmp_path / "config.json").write_text((checkpoints["qwen3"] / "config.json").read_text())
    code = ("import sys; from AutoXLA.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch_xla' not in sys.modules, 'plan must not import torch_xla'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "plan", str(tmp_path / "config.json"),
                          "--strategy", "2d", "--devices", "16", "--dtype", "bf16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Qwen3ForCausalLM, strategy 2d, mesh data=1xfsdp=4xmodel=4 (16 devices), dtype bfloat16" in out.stdout


def test_cli_reports_bad_input(capsys, checkpoints):
    assert main(["plan", str(checkpoints["llama"]), "--strategy", "4d"]) == 2
    assert "unknown sharding_strategy '4d'" in capsys.readouterr().err


def test_plan_says_whether_the_decoder_stack_is_scanned(tmp_path):
    # From the config alone: a stack whose layers repeat is scanned (Gemma 2 by pairs of its
    # alternating sliding/global layers), one that does not is unrolled with the reason, and
    # --no-scan (scan_layers=False) says so.
    from AutoXLA.testing.tiny import tiny_config

    llama = plan_from_config(tiny_config("llama", num_hidden_layers=6), "fsdp", 8)
    assert (llama.stack.path, llama.stack.layers, llama.stack.group, llama.stack.scanned) == (
        "model.layers", 6, 1, True)
    assert "6 layers scanned as one loop of 6 steps" in str(llama)
    gemma = plan_from_config(tiny_config("gemma2", num_hidden_layers=6), "fsdp", 8)
    assert (gemma.stack.group, gemma.stack.steps) == (2, 3)
    odd = plan_from_config(tiny_config("gemma2", num_hidden_layers=3), "fsdp", 8)
    assert not odd.stack.scanned and "layer_type" in odd.stack.reason
    off = plan_from_config(tiny_config("llama"), "fsdp", 8, scan_layers=False)
    assert not off.stack.scanned and off.stack.reason == "scan_layers=False"
    assert plan_from_config(tiny_config("llama"), "fsdp", 8).to_dict()["stack"]["scanned"]


def test_plan_gives_each_attention_module_its_kernel_and_scans_only_if_they_still_repeat(checkpoints):
    # Decided on the empty model, before anything is patched: the loader applies this plan, and
    # `autoxla plan` previews the same one (the stack included).
    from AutoXLA.testing.tiny import tiny_config

    config = tiny_config("llama", num_hidden_layers=4)
    everywhere = plan_from_config(config, "fsdp", 8, attn_implementation="splash_attention")
    assert set(everywhere.layer_attention.modules.values()) == {"splash_attention"}
    assert len(everywhere.layer_attention.modules) == 4 and everywhere.stack.scanned
    assert "attention: splash_attention in all 4 attention modules" in str(everywhere)

    some = plan_from_config(config, "fsdp", 8, attn_implementation="splash_attention",
                            attention_config={"layers": [0, 1]})
    assert [some.layer_attention.modules[f"model.layers.{i}.self_attn"] for i in range(4)] == [
        "splash_attention", "splash_attention", "eager", "eager"]
    # Layers 0-1 and 2-3 differ once patched: one compiled step cannot run them all.
    assert not some.stack.scanned and "self_attn.autoxla_attention" in some.stack.reason
    assert ("splash_attention in 2 of 4 attention modules; the model's eager attention in "
            "model.layers.2.self_attn, model.layers.3.self_attn (attention_config['layers'] = "
            "[0, 1])") in str(some)
    assert json.loads(some.to_json())["layer_attention"]["modules"] == some.layer_attention.modules
    # An eager plan is the plan as before: no key for what it does not patch.
    assert "layer_attention" not in json.loads(plan_from_config(config, "fsdp", 8).to_json())
    with pytest.raises(ValueError, match=r"names layer 7, but the model has 4 layers"):
        plan_from_config(config, "fsdp", 8, attn_implementation="splash_attention",
                         attention_config={"layers": [7]})


def test_plan_decides_how_the_kernels_split_grouped_query_heads():
    # Issue 43: the kernels cut q, k and v by whole heads over the model axis, so the plan
    # decides per mesh (sharding/attention_heads.py) and says why; the kernel applies it. Real
    # head counts, every other size shrunk: Qwen2.5-7B (28 / 4) and Llama-3-70B (64 / 8).
    import transformers

    from AutoXLA.sharding.attention_heads import KernelHeads

    small = dict(hidden_size=56, intermediate_size=32, num_hidden_layers=2, vocab_size=128)
    qwen = transformers.Qwen2Config(num_attention_heads=28, num_key_value_heads=4, **small)
    plan = plan_from_config(qwen, "mp", 8, attn_implementation="splash_attention")
    heads = plan.layer_attention.heads
    assert (heads.heads, heads.kv_heads, heads.axes, heads.kv_repeat) == (28, 4, (), 1)
    assert ("attention heads in the kernels: 28 query / 4 kv heads kept whole (28 query heads "
            "do not divide model=8: every device along it attends with all heads of its rows)"
            ) in str(plan)
    # q_proj is replicated on model for the same reason: the heads the kernel keeps whole.
    assert "28 heads do not divide model=8" in plan["model.layers.0.self_attn.q_proj.weight"].reason
    assert json.loads(plan.to_json())["layer_attention"]["heads"] == {
        "heads": 28, "kv_heads": 4, "axes": [], "kv_repeat": 1, "reason": heads.reason}

    llama = transformers.LlamaConfig(num_attention_heads=64, num_key_value_heads=8,
                                     **dict(small, hidden_size=128))
    plan = plan_from_config(llama, "mp", 16, attn_implementation="splash_attention")
    assert plan.layer_attention.heads == KernelHeads(64, 8, ("model",), 2,
                                                     plan.layer_attention.heads.reason)
    assert "64 query / 8 kv heads split over model=16, each kv head repeated 2x (to 16)" in str(plan)
    # The k/v projections are replicated on model: the repeat and the cut are local.
    assert plan["model.layers.0.self_attn.k_proj.weight"].spec == (None, None)
    flash = plan_from_config(llama, "mp", 16, attn_implementation="xla_flash_attention")
    assert flash.layer_attention.heads.kv_repeat == 8     # flash has no grouped-query attention
    with pytest.raises(ValueError, match="28 query heads do not divide it"):
        plan_from_config(qwen, "mp", 8, attn_implementation="splash_attention",
                         attention_config={"qkv_partition_spec": (("data", "fsdp"), "model",
                                                                  None, None)})


def test_cli_plan_shows_the_attention_of_each_layer(capsys, checkpoints):
    assert main(["plan", str(checkpoints["llama"]), "--attention", "xla_flash_attention",
                 "--attention-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "xla_flash_attention in 1 of 2 attention modules" in out
    # The project's 6 / 3-head Gemma 2 under 2d: kv heads repeated for the model axis.
    assert main(["plan", str(checkpoints["gemma2"]), "--strategy", "2d", "--attention",
                 "splash_attention"]) == 0
    assert ("attention heads in the kernels: 6 query / 3 kv heads split over model=2, each kv "
            "head repeated 2x (to 6) (3 kv heads do not divide model=2; 6 do, and each device "
            "gets the kv heads its 3 query heads read)") in capsys.readouterr().out
    assert main(["plan", str(checkpoints["llama"]), "--attention", "flash"]) == 2
    assert "--attention 'flash' is not one of eager, xla_flash_attention" in capsys.readouterr().err
    assert main(["plan", str(checkpoints["llama"]), "--attention-layers", "0"]) == 2
    assert "add --attention splash_attention" in capsys.readouterr().err
