"""`autoxla plan --plot FILE`: the picture shows the forecast's own numbers, is written whole or
not at all, and bad paths are refused before any model is built."""
import os
import re
import subprocess
import sys

import pytest

from AutoXLA.cli import main

from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.planning import plot
from AutoXLA.planning.memory import TrainingSetup, training_forecast
from AutoXLA.planning.topology import topology
from AutoXLA.testing.tiny import tiny_config
from tests.helpers import REFUSE_TORCH_XLA

GiB = 2**30


def _bars():
    config = tiny_config("llama")
    setup = TrainingSetup(8, 64, "adamw")
    return [plot.bar(s, training_forecast(plan_from_config(config, s, 8), config, setup), 0)
            for s in ("fsdp", "2d", "dp")]


def test_segments_are_the_forecast_lines_stacked_and_the_chip_lines_are_drawn():
    bars = _bars()
    hbm = topology("v5e-8").hbm_bytes
    fig = plot.render(bars, "tiny", hbm_bytes=hbm, capacity_bytes=int(hbm * 0.9))
    ax = fig.axes[0]
    # One bar container per category (bottom first, in first-seen order: dp has no gathered
    # weights), one rectangle per strategy in each.
    categories = [c.get_label() for c in ax.containers]
    assert set(categories) == {x.name for b in bars for x in b.lines}
    assert categories[:3] == ["parameters", "gradients", "optimizer (adamw)"]
    for i, b in enumerate(bars):
        bottom = 0.0
        for container in ax.containers:
            rect = container.patches[i]
            want = sum(x.bytes_per_device for x in b.lines if x.name == container.get_label())
            # The picture is the table: each segment's height and base equal the forecast's
            # bytes in GiB (float arithmetic only: 1e-12 relative).
            assert rect.get_height() == pytest.approx(want / GiB, rel=1e-12, abs=1e-15)
            assert rect.get_y() == pytest.approx(bottom, rel=1e-12, abs=1e-15)
            bottom += want / GiB
        assert bottom == pytest.approx(training_total(b) / GiB, rel=1e-12)
    levels = sorted(line.get_ydata()[0] for line in ax.lines)
    assert levels == pytest.approx([hbm * 0.9 / GiB, hbm / GiB])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fsdp", "2d", "dp"]


def training_total(b):
    return sum(x.bytes_per_device for x in b.lines)


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "memory.png"
    target.write_bytes(b"the user's earlier picture")
    fig = plot.render(_bars()[:1], "tiny")

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(fig, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plot.save(fig, str(target))
    assert target.read_bytes() == b"the user's earlier picture"
    assert os.listdir(tmp_path) == ["memory.png"]


@pytest.mark.parametrize("name, message", [
    ("memory.jpg", r"extension says its format; use one of \.png, \.svg, \.pdf"),
    ("no/such/folder/memory.png", r"folder .*no/such/folder does not exist; create it first"),
    (".", r"is a directory: give a file name such as"),
])
def test_bad_plot_paths_are_one_error_line_before_planning(checkpoints, tmp_path, capsys,
                                                           monkeypatch, name, message):
    monkeypatch.chdir(tmp_path)
    rc = main(["plan", os.fspath(checkpoints["llama"]), "--train", "--batch", "8", "--seq",
               "64", "--plot", name])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("autoxla: error: --plot"), err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert os.listdir(tmp_path) == []


# A fresh interpreter that refuses torch_xla: the picture of every ranked mesh of a shipped
# config on a slice, as a user would ask for it.
_NO_XLA = REFUSE_TORCH_XLA + r"""
from AutoXLA.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_recommend_plot_of_a_shipped_config_offline(tmp_path):
    from PIL import Image

    out = tmp_path / "llama8b.png"
    r = subprocess.run([sys.executable, "-c", _NO_XLA, "plan", "meta-llama/Llama-3.1-8B",
                        "--topology", "v5e-8", "--train", "--batch", "8", "--seq", "2048",
                        "--recommend", "--plot", str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"wrote the memory plot to {out}" in r.stderr
    assert "recommendation for v5e-8" in r.stdout
    with Image.open(out) as im:
        assert im.format == "PNG" and im.width >= 600 and im.height >= 500
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    # Several categories drawn, not a blank canvas: many distinct colours.
    assert colours is not None and len(colours) > 20
    assert os.listdir(tmp_path) == ["llama8b.png"]      # no temporary left behind
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask   # as a plain open() would create it
