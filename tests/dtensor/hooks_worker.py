"""One process (a world of one): a generate call takes the executor's hooks off the modules whose
tensors stay as they are for the call and puts them back, in their order, after it; a user's own
hook stays on throughout; tokens, and a training forward and backward afterwards, equal
transformers'. Writes hooks.json for tests/dtensor/test_generate_hooks.py."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.runtimes.dtensor.execute import _HOOK_DICTS

checkpoint, out = sys.argv[1], sys.argv[2]
ours = AutoXLAModelForCausalLM.from_pretrained(checkpoint, runtime="dtensor",
                                               sharding_strategy="fsdp", dtype=torch.float32)
plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hooks():
    return [[list(getattr(m, d)) for d in _HOOK_DICTS] for m in ours.modules()]


before = hooks()
layer = ours.model.layers[0]
during = []
user = layer.register_forward_pre_hook(lambda m, args: during.append(len(m._forward_pre_hooks)))
with_user = hooks()
ids = torch.arange(5, 17).reshape(2, 6)
args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
tokens = ours.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **args)
expected = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **args)
after_generate = hooks()
user.remove()
ours.train()
plain.train()
loss = ours(input_ids=ids, labels=ids).loss
loss.backward()
reference = plain(input_ids=ids, labels=ids).loss
reference.backward()
grads = {n: p.grad for n, p in plain.named_parameters()}
# the parameters' gradients: local pieces of DTensors in a world of one, the whole tensor
worst = max(float((p.grad.full_tensor() - grads[n]).abs().max())
            for n, p in ours.named_parameters() if p.grad is not None)
json.dump(dict(during=during, restored=after_generate == with_user,
               removed_then=before == hooks(), tokens_equal=torch.equal(tokens, expected),
               loss=float(loss), reference=float(reference), worst_grad=worst,
               with_grads=sum(p.grad is not None for p in ours.parameters()),
               parameters=sum(1 for _ in ours.parameters())), open(f"{out}/hooks.json", "w"))
