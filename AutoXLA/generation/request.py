"""One generate call's settings: transformers' keywords merged with the model's generation_config
exactly as transformers merges them, then checked once. Anything that would change the output and
that the fixed-shape loop does not implement is an error naming it, never silently dropped."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# GenerationConfig fields, with the value at which they change nothing (None, unset, and False
# do not either). Any other value is refused (beam search, penalties, constraints, ...). Fields not listed here and not read below
# (token ids, cache_implementation, output flags that are False) do not change the tokens.
_NEUTRAL = {
    "num_beams": 1, "min_length": 0,
    "encoder_repetition_penalty": 1.0, "length_penalty": 1.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
    "typical_p": 1.0, "min_p": 0.0, "top_h": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None,
    "renormalize_logits": None, "remove_invalid_values": False, "guidance_scale": None,
    "exponential_decay_length_penalty": None, "watermarking_config": None,
    "penalty_alpha": None, "dola_layers": None, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "constraints": None, "force_words_ids": None, "max_time": None, "token_healing": None,
    "prompt_lookup_num_tokens": None, "return_dict_in_generate": False, "output_scores": False,
    "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "prefill_chunk_size": None, "use_mtp": None,
}
# generate() arguments outside GenerationConfig that we cannot honour.
_UNSUPPORTED_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                          "assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask",
                          "custom_generate", "synced_gpus", "inputs_embeds", "cache",
                          "past_key_values", "position_ids")


@dataclass(frozen=True)
class Request:
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None          # None: no top-k filter
    top_p: float               # 1.0: no nucleus filter
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None   # the config's pad, else its first EOS, else None (transformers')
    seed: int
    min_new_tokens: int = 0    # EOS suppressed before this many new tokens
    repetition_penalty: float = 1.0
    num_return_sequences: int = 1
    stop_strings: tuple[str, ...] = ()

    @property
    def fill_token_id(self) -> int:
        """What fills padding columns and the steps after a row's EOS: the pad token; without
        one nothing real is ever filled (no EOS, so no row finishes early), and 0 will do."""
        return 0 if self.pad_token_id is None else self.pad_token_id

    @property
    def sampling_key(self) -> tuple:
        """What the compiled programs depend on (the values of temperature, top_p, the seed,
        the minimum length and the penalty are device data and do not)."""
        processors = (self.min_new_tokens > 0, self.repetition_penalty != 1.0)
        return ((self.do_sample, self.top_k, self.top_p < 1.0) if self.do_sample
                else (False,)) + processors


# Image inputs of an image-text-to-text model (Mistral 3, LLaVA): the loop feeds tokens only.
_IMAGE_ARGUMENTS = ("pixel_values", "image_sizes", "pixel_attention_mask", "image_grid_thw")


def build_request(model, prompt_length: int, generation_config=None, seed=None,
                  tokenizer=None, **kwargs) -> Request:
    """Merge ``kwargs`` into the model's generation config (transformers' own rules), validate.
    ``tokenizer``: needed only for ``stop_strings``, as in transformers."""
    images = [name for name in _IMAGE_ARGUMENTS if kwargs.get(name) is not None]
    if images:
        raise ValueError(f"generate({', '.join(images)}=...): AutoXLA's fixed-shape generation is "
                         "text-only and cannot condition on images. Generate from text "
                         "(input_ids only), or run the model's forward with the image "
                         "(model(input_ids=..., pixel_values=...)) for its logits")
    for name in _UNSUPPORTED_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise ValueError(f"generate({name}=...) is not supported by AutoXLA's fixed-shape "
                             "generation; drop it (or call transformers' own loop: "
                             "type(model).generate(model, ...), which recompiles every step)")
        kwargs.pop(name, None)
    if kwargs.pop("use_cache", True) is False:
        raise ValueError("generate(use_cache=False) is not supported: AutoXLA's generation always "
                         "uses its static KV cache; drop use_cache")
    config, unused = model._prepare_generation_config(generation_config, **kwargs)
    if unused:
        raise TypeError(f"generate() got unexpected keyword argument(s) {sorted(unused)}: they "
                        "are not generation settings AutoXLA's generation takes")
    for name, neutral in _NEUTRAL.items():
        value = getattr(config, name, neutral)
        if not (value is None or value is False or value == neutral):
            raise ValueError(
                f"generate: {name}={value!r} is not supported by AutoXLA's fixed-shape generation "
                f"(it would change the output); pass {name}={neutral!r}, or use transformers' own "
                "loop: type(model).generate(model, ...)")
    max_new = config.max_new_tokens
    if max_new is None:
        max_new = config.max_length - prompt_length
        if max_new < 1:
            raise ValueError(f"max_length={config.max_length} leaves no room for new tokens after a "
                             f"prompt of {prompt_length}: pass max_new_tokens=N")
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new!r}")
    eos = config.eos_token_id
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = config.pad_token_id
    if pad is None and eos:
        pad = eos[0]                 # as transformers: pad with EOS
    do_sample = bool(config.do_sample)
    temperature = float(config.temperature)
    top_k = config.top_k
    top_p = float(config.top_p)
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}; for "
                             "greedy decoding pass do_sample=False")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
        top_k = top_k or None           # 0 means no top-k filter, as in transformers
    if seed is None:
        # transformers samples from torch's global generator: torch.manual_seed(s) before
        # generate makes a run repeatable here too.
        seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))
    if not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    return Request(max_new, do_sample, temperature, top_k if do_sample else None,
                   top_p if do_sample else 1.0, eos, None if pad is None else int(pad), seed,
                   *_processors(config, do_sample, tokenizer))


def _processors(config, do_sample: bool, tokenizer) -> tuple:
    """(min_new_tokens, repetition_penalty, num_return_sequences, stop_strings), checked as
    transformers checks them."""
    min_new = config.min_new_tokens or 0
    if isinstance(min_new, bool) or not isinstance(min_new, int) or min_new < 0:
        raise ValueError(f"min_new_tokens must be a non-negative int, got {min_new!r}")
    penalty = 1.0 if config.repetition_penalty is None else config.repetition_penalty
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
        raise ValueError(f"repetition_penalty must be a number > 0, got {penalty!r} "
                         "(1.0: no penalty)")
    n = config.num_return_sequences or 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_return_sequences must be a positive int, got {n!r}")
    if n > 1 and not do_sample:
        raise ValueError(f"num_return_sequences={n} needs do_sample=True: greedy decoding would "
                         "return the same sequence n times (transformers refuses it too)")
    stops = config.stop_strings
    stops = () if stops is None else ((stops,) if isinstance(stops, str) else tuple(stops))
    if stops and (not all(isinstance(s, str) and s for s in stops)):
        raise ValueError(f"stop_strings must be non-empty strings, got {config.stop_strings!r}")
    if stops and tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass "
                         "generate(..., stop_strings=[...], tokenizer=tokenizer), as in "
                         "transformers")
    return min_new, float(penalty), n, stops
