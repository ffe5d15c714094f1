"""`autoxla eval-quant`: the format registry, llama.cpp's reference path on a tiny checkpoint
(no XLA), and the command's errors (one `autoxla: error:` line each, before any model loads)."""
import json

import numpy as np
import pytest
import torch

from AutoXLA.cli import main
from AutoXLA.evaluation import FORMATS, SETS, parse_formats
from AutoXLA.evaluation.formats import AUTOXLA, LLAMA_CPP


def test_every_format_builds_and_sets_name_known_formats():
    from AutoXLA.evaluation.llama_cpp import gguf_type

    for f in FORMATS.values():
        if f.kind == AUTOXLA:
            f.quantization_config()          # valid QuantizationConfig keywords
        elif f.kind == LLAMA_CPP:
            gguf_type(f.gguf_type)           # a gguf.quants type that can quantize
    for names in SETS.values():
        assert all(n in FORMATS for n in names)
    got = [f.name for f in parse_formats("int8, Q8_0,8,int8")]   # case, spaces, sets, repeats
    assert got == ["int8", "q8_0", "w8a8"]


def test_llama_cpp_reference_is_gguf_dequantized_and_cleaned_up(checkpoints):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    from AutoXLA.evaluation.llama_cpp import reference_checkpoint
    from AutoXLA.modeling.causal import auto_class_for
    from AutoXLA.modeling.empty import load_config

    path = checkpoints["llama"]
    original = {}
    for f in path.glob("*.safetensors"):
        original.update(load_file(f))
    auto = auto_class_for(load_config(str(path)))
    with reference_checkpoint(path, FORMATS["q4_1"], auto) as ref:
        tmp = ref.directory
        got = {}
        for f in tmp.glob("*.safetensors"):
            got.update(load_file(f))
        assert json.loads((tmp / "config.json").read_text()) == json.loads(
            (path / "config.json").read_text())
    assert not tmp.exists()                  # the temporary checkpoint is always removed
    assert got.keys() == original.keys()
    quantized = [k for k in got if k.endswith("proj.weight")]
    assert quantized and "lm_head.weight" not in quantized
    t = GGMLQuantizationType.Q4_1
    for k, v in original.items():
        if k in quantized:   # exactly gguf's round trip: the same code llama.cpp's converter uses
            expected = dequantize(quantize(v.float().numpy(), t), t)
            np.testing.assert_array_equal(got[k].numpy(), expected)
        else:                # embeddings, norms, the head: untouched
            assert torch.equal(got[k], v), k
    elements = sum(original[k].numel() for k in quantized)
    assert ref.weights == elements and ref.bytes_per_weight == 20 / 32   # Q4_1: 20 bytes per 32


@pytest.fixture()
def resnet_config(tmp_path):
    d = tmp_path / "resnet"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    return d


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autoxla: error: "), err
    return err[0]


def test_errors_name_the_problem_and_the_fix(tmp_path, resnet_config, capsys):
    msg = _error(["eval-quant", str(tmp_path), "--formats", "int8,int9"], capsys)
    assert "unknown format 'int9'" in msg and "q8_0" in msg
    assert "--bits 8 and/or --bits 4" in _error(["eval-quant", str(tmp_path), "--bits", "3"],
                                                capsys)
    msg = _error(["eval-quant", str(tmp_path / "nowhere")], capsys)
    assert "nowhere does not exist" in msg and "local checkpoint" in msg
    assert "has no config.json" in _error(["eval-quant", str(tmp_path)], capsys)
    msg = _error(["eval-quant", str(resnet_config), "--text", str(tmp_path / "no.txt")], capsys)
    assert "no.txt does not exist" in msg and "--text FILE" in msg
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert "is empty" in _error(["eval-quant", str(resnet_config), "--text", str(empty)], capsys)
    msg = _error(["eval-quant", str(resnet_config), "--formats", "int8"], capsys)
    assert "ResNetConfig" in msg and "neither a causal LM nor" in msg
    assert "needs a checkpoint" in _error(["eval-quant"], capsys)


def test_list_names_every_format(capsys):
    assert main(["eval-quant", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in FORMATS)


def test_the_default_text_ships_with_the_package():
    from AutoXLA.evaluation.perplexity import DEFAULT_TEXT, read_text

    assert len(read_text().split()) > 1000 and DEFAULT_TEXT.parent.name == "data"
