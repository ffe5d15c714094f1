"""Bad arguments to the CLI verbs exit 2 with one line naming the problem (issue 27), before any
runtime starts; a simulated host is loud."""
import json

import pytest

from AutoXLA.cli import main
from AutoXLA.sharding.hosts import SIMULATE_ENV


@pytest.mark.parametrize("argv, message", [
    (["doctor", "--timeout", "0"], "--timeout 0.0: pass a positive number"),
    (["doctor", "--timeout", "-1"], "--timeout -1.0: pass a positive number"),
    (["generate", "/no/such/dir", "--prompt", "hi"], "/no/such/dir does not exist"),
    (["plan", "/no/such/dir"], "/no/such/dir does not exist"),
    (["plan", "./no-such-checkpoint"], "./no-such-checkpoint does not exist"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoxla: error: ") and message in err, err
    assert "internal error" not in err and "Repo id" not in err


@pytest.mark.parametrize("flag", ["--window", "--max-tokens"])
@pytest.mark.parametrize("value", ["0", "1"])
def test_eval_quant_refuses_a_window_under_2(flag, value, checkpoints, capsys):
    assert main(["eval-quant", str(checkpoints["llama"]), flag, value]) == 2
    assert f"{flag} {value}: perplexity needs windows of at least 2 tokens" in \
        capsys.readouterr().err


def test_generate_refuses_a_simulated_host_and_a_zero_token_request(checkpoints, capsys,
                                                                     monkeypatch):
    path = str(checkpoints["llama"])
    assert main(["generate", path, "--prompt", "hi", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens 0: ask for at least 1" in capsys.readouterr().err
    monkeypatch.setenv(SIMULATE_ENV, "0/2")
    assert main(["generate", path, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{SIMULATE_ENV}=0/2 is set" in err and "generate garbage" in err


def test_a_simulated_host_shows_in_the_plan_and_warns(checkpoints, xla_devices, monkeypatch):
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    monkeypatch.setenv(SIMULATE_ENV, "1/2")
    with pytest.warns(RuntimeWarning, match=r"AUTOXLA_SIMULATE_HOST=1/2: this process loads the "
                      r"shards of simulated host 1 of 2 only"):
        model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"],
                                                        sharding_strategy="fsdp")
    assert "SIMULATED host 1/2 (AUTOXLA_SIMULATE_HOST)" in model.autoxla_plan.summary()


@pytest.mark.parametrize("content", ["[]", '"works"', "{", '{"key": 1}'])
def test_a_compile_cache_verdict_of_the_wrong_shape_is_redone(content, tmp_path, monkeypatch):
    """Valid JSON that is not a verdict (or not JSON) is not trusted: the self-test runs again
    and writes a verdict over it (the child processes stubbed: their counters are the input)."""
    from AutoXLA.generation import compile_cache

    (tmp_path / "autoxla-selftest.json").write_text(content)
    probes = []
    monkeypatch.setattr(compile_cache, "_probe",
                        lambda scratch: probes.append(scratch) or {"Hit": 1})
    works, detail = compile_cache.self_test(str(tmp_path))
    assert works and "read 1 program(s) back" in detail and len(probes) == 2
    saved = json.loads((tmp_path / "autoxla-selftest.json").read_text())
    assert saved["works"] is True
    probes.clear()
    assert compile_cache.self_test(str(tmp_path)) == (works, detail) and not probes   # remembered
