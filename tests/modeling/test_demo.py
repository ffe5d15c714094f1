"""The README's main job (`./run demo`) runs end to end and passes its own checks."""


def test_demo_passes(tmp_path, xla_devices, capsys):
    from AutoXLA.demo import run_demo

    assert run_demo(tmp_path, strategy="2d")
    out = capsys.readouterr().out
    assert "OK: sharded generation equals plain transformers" in out
    assert "OK: splash_attention (portable blockwise path) generates eager's tokens" in out
    assert "OK: int8 logits SQNR" in out
