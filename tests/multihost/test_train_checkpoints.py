"""Training checkpoints: save after 3 steps, resume on the same and on another mesh, the 4th
step's loss equals the uninterrupted run's; export as safetensors; a killed save leaves the
previous step restorable."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.saving.training import TrainingCheckpointError, TrainingCheckpoints


def _batch():
    ids = torch.randint(3, 250, (8, 16), generator=torch.Generator().manual_seed(0))
    return ids


def _load(path, strategy):
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy,
                                                    use_fsdp_wrap=True)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt) -> float:
    ids = _batch().to(backend.device())
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    backend.sync()
    return loss.item()


def test_resume_on_another_mesh_continues_the_run(checkpoints, xla_devices, tmp_path):
    model, opt = _load(checkpoints["llama"], "fsdp")
    first = [_step(model, opt) for _ in range(3)]
    saves = TrainingCheckpoints(tmp_path / "run")
    saves.save(3, model, opt)
    after3 = {n: p.detach().cpu() for n, p in model.named_parameters()}
    fourth = _step(model, opt)
    assert saves.steps() == [3] and first[2] < first[0]

    same, same_opt = _load(checkpoints["llama"], "fsdp")
    assert saves.restore(same, same_opt) == 3
    # The same mesh runs the same programs on the same numbers: bit for bit.
    assert _step(same, same_opt) == fourth
    other, other_opt = _load(checkpoints["llama"], "2d")
    saves.restore(other, other_opt)
    # A 2d mesh sums the same terms in another order across devices: fp32 rounding, ~1 ulp of a
    # loss near 1 (6e-8 measured); 1e-5 leaves margin and still fails any lost state (AdamW's
    # moments or step count wrong moves the loss by > 1e-2).
    resumed = _step(other, other_opt)
    assert abs(resumed - fourth) <= 1e-5, (resumed, fourth)

    out = saves.export_safetensors(tmp_path / "export", step=3)
    exported = load_file(out / "model.safetensors")
    assert (out / "config.json").is_file()
    for name, value in after3.items():
        name = name.replace("_orig_module.", "")
        if ".stacked." in name:     # a scanned stack exports per-layer tensors
            prefix, leaf = name.split(".stacked.")
            leaf = leaf.replace("/", ".")     # held flat: stacked.self_attn/q_proj/weight
            for i in range(value.shape[0]):
                assert torch.equal(exported[f"{prefix}.{i}.{leaf}"], value[i]), (name, i)
        elif name in exported:
            assert torch.equal(exported[name], value), name
        else:                       # a tied weight is saved once, under its source's name
            assert name == "lm_head.weight" and "model.embed_tokens.weight" in exported


def test_restore_refuses_another_model(checkpoints, xla_devices, tmp_path):
    saves = TrainingCheckpoints(tmp_path / "run")
    with pytest.raises(TrainingCheckpointError, match="no committed training checkpoint"):
        saves.restore(torch.nn.Linear(2, 2))
    model = torch.nn.Linear(4, 4)
    saves.save(0, model)
    with pytest.raises(TrainingCheckpointError, match="different model"):
        saves.restore(torch.nn.Linear(4, 5))
    with pytest.raises(TrainingCheckpointError, match="no optimizer state"):
        saves.restore(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TrainingCheckpointError, match="step 7 is not a committed"):
        saves.restore(model, step=7)
    with pytest.raises(TrainingCheckpointError, match="without a transformers config"):
        saves.export_safetensors(tmp_path / "out")
    with pytest.raises(TrainingCheckpointError, match="step=-1"):
        saves.save(-1, model)
    with pytest.raises(TrainingCheckpointError, match="keep=0"):
        TrainingCheckpoints(tmp_path / "other", keep=0)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(TrainingCheckpointError, match="is a file"):
        TrainingCheckpoints(tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "x"           # untouched


# A child that trains a small CPU model, commits step 1, then is killed in the middle of saving
# step 2 (where `pause` says). No torch_xla: the commit logic is the same for any tensors.
_CHILD = textwrap.dedent("""
    import sys, time, torch
    from AutoXLA.saving import training as tc
    import torch.distributed.checkpoint as dcp
    root, pause = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    def step():
        opt.zero_grad(); model(torch.ones(4, 64)).square().mean().backward(); opt.step()
    saves = tc.TrainingCheckpoints(root)
    step(); saves.save(1, model, opt)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, root + "/expected.pt")
    def stop(*args):
        print("PAUSED", flush=True)
        time.sleep(600)
    if pause == "writing":      # after the data files, before DCP's metadata
        original = dcp.FileSystemWriter.finish
        dcp.FileSystemWriter.finish = lambda self, *a, **k: stop()
    else:                       # DCP done, before the manifest and the rename
        tc.TrainingCheckpoints._commit = lambda self, *a: stop()
    step(); saves.save(2, model, opt)
""")


@pytest.mark.parametrize("pause", ["writing", "committing"])
def test_a_killed_save_leaves_the_previous_step(tmp_path, pause):
    root = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), pause],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "PAUSED", line
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert (root / "step-00000002.partial").is_dir()
    saves = TrainingCheckpoints(root)
    assert saves.steps() == [1] and saves.latest() == 1

    torch.manual_seed(1)          # other weights: restore must replace them all
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert saves.restore(model, opt) == 1
    expected = torch.load(root / "expected.pt")
    for name, value in expected["model"].items():
        assert torch.equal(model.state_dict()[name], value), name
    got = opt.state_dict()["state"]
    for index, entry in expected["opt"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(got[index][key], value), (index, key)

    saves.save(2, model, opt)     # the next save clears what the killed one left
    assert saves.steps() == [1, 2]
    assert not (root / "step-00000002.partial").exists()


def test_a_resave_killed_between_its_renames_keeps_the_step(tmp_path):
    saves = TrainingCheckpoints(tmp_path / "run", keep=2)
    model = torch.nn.Linear(4, 4)
    for step in (1, 2, 3):
        saves.save(step, model)
    assert saves.steps() == [2, 3]          # keep=2
    # What a kill leaves after moving step 3 aside and before renaming the new one in:
    os.rename(saves.path(3), tmp_path / "run" / "step-00000003.replaced")
    assert saves.steps() == [2, 3] and saves.path(3).is_dir()


_RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from AutoXLA.saving.training import TrainingCheckpoints
    root, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)               # the same model on both ranks: data parallel
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.zero_grad(); model(torch.ones(2, 32)).square().mean().backward(); opt.step()
    saves = TrainingCheckpoints(root)
    saves.save(1, model, opt)
    assert saves.steps() == [1], saves.steps()     # committed when save returns, on every rank
    if rank == 0:
        torch.save(model.state_dict(), root + "/expected.pt")
    dist.destroy_process_group()
""")


def test_two_processes_commit_one_step(tmp_path):
    """Two processes of a gloo group save together: DCP coordinates the writing, process 0
    commits after a barrier, and both see the step committed when save returns. (Plain CPU
    tensors: XLA:CPU cannot run one SPMD job across processes, docs/multihost.md.)"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tmp_path / "run"
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(root), str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    for p in ranks:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    assert sorted(os.listdir(root)) == [".autoxla-train.lock", "expected.pt", "step-00000001"]
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    TrainingCheckpoints(root).restore(model)
    for name, value in torch.load(root / "expected.pt").items():
        assert torch.equal(model.state_dict()[name], value), name
