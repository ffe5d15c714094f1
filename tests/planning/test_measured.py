"""The forecast against a compiled training step: the collectives XLA's SPMD partitioner put in
the program (8 CPU devices, read from its optimized-HLO dump) match the plan's, and a sharding
mistake shows up as collectives the plan did not predict. Each compile runs in a child process
(XLA reads its dump flags once per process)."""
import pytest

from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.planning.communication import communication
from AutoXLA.evaluation.measure import measure_step
from AutoXLA.planning.hlo import compare

BATCH, SEQ = 8, 16
# Bytes per step measured vs forecast: the goal. Measured 1124.0 against 1156.3 KiB
# under fsdp (0.97): norm weights gathered once and kept for the backward, lm_head's gradient
# built from its gathered input (docs/planning.md).
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def fsdp_forecast(checkpoints):
    return communication(plan_from_config(checkpoints["llama"], "fsdp", 8), batch=BATCH,
                         seq=SEQ)


def test_fsdp_training_step_matches_the_forecast(checkpoints, xla_devices, fsdp_forecast,
                                                 tmp_path):
    m = measure_step(checkpoints["llama"], "fsdp", batch=BATCH, seq=SEQ, train=True,
                     dump_dir=tmp_path)
    measured = sum(o.payload_bytes for o in m.collectives)
    forecast = sum(o.payload_bytes for o in fsdp_forecast.ops)
    assert abs(measured - forecast) <= TOLERANCE * forecast, (measured, forecast)
    c = compare(fsdp_forecast, m.collectives)
    # With gradients annotated like their parameters, XLA builds lm_head's gradient from its
    # input gathered over fsdp (f32[128,64], the 128 tokens x hidden) rather than reduce-
    # scattering a whole f32[256,64] one, and gathers the token ids (s64[128,1]) for the
    # embedding's gradient: those two, once each, and nothing else.
    unexpected = sorted((o.kind, o.shape) for o in c.unexpected)
    assert unexpected == [("all-gather", (BATCH * SEQ, 1)), ("all-gather", (BATCH * SEQ, 64))], \
        c.describe()
    # Missing: the 5 norm weights gathered once and kept for the backward, and lm_head's
    # reduce-scatter replaced as above.
    assert sum(n for _, n in c.missing) <= 6, c.describe()
    assert m.buffers.argument > 0 and m.buffers.temp > 0
    # The step's outputs hold the gradients at their parameters' shard size (modeling/wrap.py
    # annotates them), not whole on every device: without that they were 770.8 KiB, 14.8x the
    # 52.2 KiB of sharded gradients. What else is live at the end (the loss, OUTPUT_REST) is
    # under one more gradients' worth.
    grads = _gradient_bytes(checkpoints["llama"])
    assert grads <= m.buffers.output <= 2 * grads, (m.buffers.output, grads)


def _gradient_bytes(path):
    from AutoXLA.modeling.empty import load_config
    from AutoXLA.planning.memory import TrainingSetup, training_forecast

    plan = plan_from_config(path, "fsdp", 8, scan_layers=False)
    f = training_forecast(plan, load_config(path), TrainingSetup(BATCH, SEQ, "sgd"))
    return {x.name: x.bytes_per_device for x in f.lines}["gradients"]


def test_a_replicated_activation_is_reported(checkpoints, xla_devices, fsdp_forecast, tmp_path):
    # The mistake: every decoder layer's output forced replicated, against the plan's batch split.
    m = measure_step(checkpoints["llama"], "fsdp", batch=BATCH, seq=SEQ, train=True,
                     dump_dir=tmp_path, replicate_activations=True)
    c = compare(fsdp_forecast, m.collectives)
    gathered = [o for o in c.unexpected if o.kind == "all-gather"]
    assert any(o.shape == (BATCH, SEQ, 64) for o in gathered), c.describe()
    assert "f32[8,16,64]" in c.describe()


def test_the_kv_cache_generation_passes_is_the_plans(checkpoints, xla_devices, tmp_path):
    # generate as users run it (scanned stack, static cache), 2d: the cache is split over fsdp
    # (batch) and model (kv heads). Among the decode step's entry parameters, the stacked K and
    # V are the plan's shard shape, and together exactly plan.kv_cache's bytes per device.
    from AutoXLA.evaluation.measure import measure_generation

    g = measure_generation(checkpoints["llama"], "2d", batch=BATCH, prompt=SEQ,
                           dump_dir=tmp_path)
    plan = plan_from_config(checkpoints["llama"], "2d", 8)
    kv = plan.kv_cache(g.batch, g.length)
    want = f"f32[{','.join(map(str, (kv.layers, *kv.shard_shape(plan.mesh))))}]"   # stacked
    decode = [(params, stats) for _, params, stats in g.programs
              if any(shape == want for shape, _ in params)]
    assert decode, [p for _, p, _ in g.programs]
    params, stats = decode[-1]
    cache = [n for shape, n in params if shape == want]
    assert len(cache) == 2 and sum(cache) == kv.bytes_per_device(plan.mesh), (cache, want)
    # The rest of the step's arguments: the weights as planned, and the loop's host-made inputs,
    # replicated: the token buffer and the attention mask ([batch, length] int64 each) and a
    # few scalars and [batch] vectors (under 1 KiB).
    rest = stats.argument - sum(cache) - plan.bytes_per_device()
    assert 2 * g.batch * g.length * 8 <= rest <= 2 * g.batch * g.length * 8 + 1024, rest
