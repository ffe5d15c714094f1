"""What one generate call may ask, checked on the host before anything is allocated.

The ids and mask must mean what transformers would make of them (integer ids inside the
vocabulary, a mask of 0 and 1, at least one real token per row); the request must fit the model's
positions (or the ceiling ``GenerationOptions.max_positions``) and its KV cache the devices'
free memory. Each failure is a ``ValueError`` naming the limit and the fix (docs/generation.md,
"Request limits").
"""
from __future__ import annotations

import torch

from ..sharding.configs import decoder_config

# The KV cache may take at most this share of the free memory per device: the step's activations
# and XLA's scratch buffers need the rest.
KV_MEMORY_SHARE = 0.9


def check_ids(ids, vocab_size: int | None) -> torch.Tensor:
    """``ids`` as a CPU int64 [batch, length] tensor of token ids, or a ValueError saying why not
    (transformers raises an IndexError deep inside the embedding, or reads past the table)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("generate needs input_ids, a [batch, length] tensor of token ids "
                         f"(got {_describe(ids)}); tokenize with return_tensors='pt'")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}: a float id "
                         "has no token (pass the tokenizer's ids, e.g. ids.long() if they are "
                         "whole numbers)")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}: an empty prompt has nothing to "
                         "continue from; pass at least one token per row (a BOS token for "
                         "unconditional text)")
    ids = ids.detach().to("cpu", torch.int64)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        where = tuple(int(i) for i in (ids == bad).nonzero()[0])
        raise ValueError(f"input_ids holds token id {bad} at {where}, outside the model's "
                         f"vocabulary 0..{vocab_size - 1 if vocab_size else '?'}: tokenize with "
                         "this model's own tokenizer")
    return ids


def check_mask(mask, ids: torch.Tensor) -> torch.Tensor:
    """The attention mask as CPU int64 0/1, one real token per row at least."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a tensor, got {_describe(mask)}")
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids "
                         f"{tuple(ids.shape)}: they must match")
    mask = mask.detach().cpu()
    if not bool(((mask == 0) | (mask == 1)).all()):
        odd = mask[(mask != 0) & (mask != 1)][0].item()
        raise ValueError(f"attention_mask holds {odd!r}: it marks real tokens 1 and padding 0 and "
                         "nothing else (a float mask is not a weight); pass the tokenizer's mask")
    mask = mask.to(torch.int64)
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row(s) {empty[:8]} of attention_mask mask every token: such a row has "
                         "no prompt to continue; drop it from the batch")
    return mask


def check_length(config, options, prompt_length: int, max_new_tokens: int) -> None:
    """Prompt + new tokens against the model's positions, or the configured ceiling."""
    limit = options.max_positions
    source = f"GenerationOptions(max_positions={limit})"
    if limit is None:
        limit = getattr(decoder_config(config), "max_position_embeddings", None)
        source = f"the model's max_position_embeddings ({limit})"
    if limit is None or prompt_length + max_new_tokens <= limit:
        return
    raise ValueError(f"a prompt of {prompt_length} tokens plus max_new_tokens={max_new_tokens} is "
                     f"{prompt_length + max_new_tokens} positions, more than {source}: shorten "
                     "the prompt or ask for fewer new tokens (a model may read past its trained "
                     "positions only if you say so: GenerationOptions(max_positions=N))")


def check_memory(kv, mesh, free: int | None) -> None:
    """The KV cache generation is about to allocate against ``free``, the bytes free on one device
    (None: the runtime cannot say)."""
    need = kv.bytes_per_device(mesh)
    if free is None or need <= KV_MEMORY_SHARE * free:
        return
    raise ValueError(f"this request's KV cache (batch bucket {kv.batch}, cache length {kv.length}) "
                     f"needs {need / 2**20:,.1f} MiB per device, more than "
                     f"{KV_MEMORY_SHARE:.0%} of the {free / 2**20:,.1f} MiB free: ask for fewer new "
                     "tokens or a smaller batch, or use smaller buckets (GenerationOptions)")


def vocab_size(model) -> int | None:
    """Rows of the input embedding table: the ids the model can look up."""
    table = model.get_input_embeddings()
    rows = getattr(table, "num_embeddings", None)
    return int(rows) if rows else None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
