"""Writing models to disk: ``save_pretrained`` (pretrained.py) for a model as a transformers
checkpoint, the journaled atomic writer it and ``autoxla quantize`` share (journal.py), and
training checkpoints (training.py: sharded model and optimizer state per step)."""
from .journal import (CONFIG, GENERATION_CONFIG, SaveInProgressError, interrupted_save,
                      parse_size, shard_groups, write_checkpoint)
from .pretrained import (attach, config_json, generation_json, save_pretrained, saved_tensors,
                         unwrap)
from .training import TrainingCheckpointError, TrainingCheckpoints

__all__ = ["CONFIG", "GENERATION_CONFIG", "SaveInProgressError", "TrainingCheckpointError",
           "TrainingCheckpoints", "attach", "config_json", "generation_json", "interrupted_save",
           "parse_size", "save_pretrained", "saved_tensors", "shard_groups", "unwrap",
           "write_checkpoint"]
