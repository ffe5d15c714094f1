"""The HLO text parser (planning/hlo.py) on small literal modules."""
from AutoXLA.planning.hlo import buffer_stats, collectives, count_by_kind

MODULE = """
HloModule step, entry_computation_layout={(f32[8,64]{1,0})->f32[64,64]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

ENTRY %main (param.1: f32[8,64]) -> f32[64,64] {
  %param.1 = f32[8,64]{1,0} parameter(0)
  %all-gather = f32[64,64]{1,0} all-gather(%param.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %dot = f32[64,64]{1,0} dot(%all-gather, %all-gather), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %all-reduce = f32[64,64]{1,0} all-reduce(%dot), channel_id=2, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  %reduce-scatter = bf16[16,64]{1,0} reduce-scatter(%convert.1), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
  %convert.1 = bf16[64,64]{1,0} convert(%all-reduce)
  %ags = (f32[8,64]{1,0}, f32[32,64]{1,0}) all-gather-start(%param.1), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[32,64]{1,0} all-gather-done(%ags)
  %cp = u32[16]{0} collective-permute(%x.2), source_target_pairs={{0,1},{1,0}}
  ROOT %out = f32[64,64]{1,0} add(%all-reduce, %all-reduce)
}
"""


def test_collectives_kinds_shapes_groups_and_bytes():
    ops = {o.name: o for o in collectives(MODULE)}
    assert set(ops) == {"all-gather", "all-reduce", "reduce-scatter", "ags", "cp"}   # -done skipped
    ag = ops["all-gather"]
    # Payload: the gathered result (the larger side), per device.
    assert (ag.kind, ag.shape, ag.group_size, ag.payload_bytes) == ("all-gather", (64, 64), 8, 64 * 64 * 4)
    assert ops["all-reduce"].group_size == 2            # iota groups [4,2]: 4 groups of 2
    assert ops["all-reduce"].payload_bytes == 64 * 64 * 4
    rs = ops["reduce-scatter"]
    # Its operand is defined after it in the text (order is free in HLO): still found by name.
    # The unreduced operand is the payload, as bf16 (2 bytes).
    assert (rs.dtype, rs.shape, rs.group_size, rs.payload_bytes) == ("bf16", (64, 64), 4, 64 * 64 * 2)
    start = ops["ags"]
    assert (start.kind, start.shape, start.group_size) == ("all-gather", (32, 64), 4)
    assert ops["cp"].kind == "collective-permute" and ops["cp"].payload_bytes == 16 * 4


def test_count_by_kind():
    assert count_by_kind(collectives(MODULE)) == {
        "all-gather": (2, 64 * 64 * 4 + 32 * 64 * 4), "reduce-scatter": (1, 64 * 64 * 2),
        "all-reduce": (1, 64 * 64 * 4), "collective-permute": (1, 64)}


def test_buffer_stats():
    text = """BufferAssignment:
allocation 0: size 4096, parameter 0, shape |f32[8,128]| at ShapeIndex {}:
 value: <1 param.1 @0> (size=4096,offset=0): f32[8,128]{1,0}
allocation 1: size 16384, maybe-live-out:
 value: <2 all-gather @0> (size=16384,offset=0): f32[64,64]{1,0}
allocation 2: size 256, constant:
 value: <3 constant.1 @0> (size=256,offset=0): f32[64]{0}
allocation 3: size 4, thread-local:
 value: <4 x @0> (size=4,offset=0): f32[]
allocation 4: size 1000, preallocated-temp:
 value: <5 dot @0> (size=1000,offset=0): f32[250]{0}

Total bytes used: 21660 (21.2KiB)
"""
    s = buffer_stats(text)
    assert (s.argument, s.output, s.temp, s.total) == (4096, 16384, 1000, 21660)
