"""TRL's side of `cargo bench -p verl-plugin-native --bench grpo`: GRPOTrainer on the bench's model,
one optimizer step per "step" line on stdin, its phase times as one JSON line on stdout.

argv[1]: JSON settings {model, prompts (token ids), n, new_tokens, lr, threads, vocab}.
The loop is TRL's own (`Trainer.train`); a callback holds each step until the bench asks for it,
so that steps alternate with verl-core's.
"""

import json
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
    logging as hf_logging,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

hf_logging.set_verbosity_error()
settings = json.loads(sys.argv[1])
torch.set_num_threads(settings["threads"])
torch.manual_seed(0)

# A word-level tokenizer mapping "t<i>" to id i, so that the prompts are the bench's token ids.
specials = ["<pad>", "<s>", "</s>"]
vocab = {tok: i for i, tok in enumerate(specials)}
vocab.update({f"t{i}": i for i in range(len(specials), settings["vocab"])})
core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
)
tokenizer.padding_side = "left"

prompts = [" ".join(f"t{t}" for t in p) for p in settings["prompts"]]
for text, ids in zip(prompts, settings["prompts"]):
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids

# Enough rows for every step: each step takes the 8 prompts in order (no shuffling).
steps = 10_000
dataset = Dataset.from_dict({"prompt": prompts * 64})


def reward(completions, completion_ids=None, **_):
    """The bench's rule: the share of even token ids in the response."""
    if completion_ids is None:
        completion_ids = [[int(w[1:]) for w in c.split() if w[1:].isdigit()] for c in completions]
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


n = settings["n"]
config = GRPOConfig(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=len(prompts) * n,
    gradient_accumulation_steps=1,
    num_generations=n,
    num_iterations=1,
    max_completion_length=settings["new_tokens"],
    # EOS ignored as on verl-core's side: exactly `new_tokens` per completion.
    generation_kwargs={"min_new_tokens": settings["new_tokens"]},
    temperature=1.0,
    top_p=1.0,
    learning_rate=settings["lr"],
    lr_scheduler_type="constant",
    weight_decay=0.01,  # verl's optim.weight_decay default
    max_grad_norm=1.0,  # verl's optim.clip_grad default
    beta=0.0,  # no KL, no reference model
    use_vllm=False,
    use_cpu=True,
    bf16=False,
    fp16=False,
    shuffle_dataset=False,
    max_steps=steps,
    logging_steps=steps,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
)
model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=reward,
    args=config,
    train_dataset=dataset,
    processing_class=tokenizer,
)

times = {}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - start

    return wrapper


# Generation (HF generate inside `_generate`) and everything before the loss
# (`_generate_and_score_completions`: generation, rewards, advantages, old log-probs when needed).
trainer._generate = timed("gen", trainer._generate)
trainer._generate_and_score_completions = timed(
    "prepare", trainer._generate_and_score_completions
)


class Stepper(TrainerCallback):
    def __init__(self):
        self.start = None

    def on_step_begin(self, args, state, control, **kwargs):
        line = sys.stdin.readline()
        if not line:
            os._exit(0)
        times.clear()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step = time.perf_counter() - self.start
        gen, prepare = times.get("gen", 0.0), times.get("prepare", 0.0)
        tokens = int(getattr(self, "tokens", 0))
        print(
            json.dumps(
                {
                    "gen": gen,
                    "score": prepare - gen,
                    "update": step - prepare,
                    "step": step,
                    "tokens": tokens,
                }
            ),
            flush=True,
        )


stepper = Stepper()
trainer.add_callback(stepper)

# The number of completion tokens of the last generation, to check like for like.
generate = trainer._generate


def counting(*args, **kwargs):
    out = generate(*args, **kwargs)
    completion_ids = out[1] if isinstance(out, tuple) else out["completion_ids"]
    stepper.tokens = sum(len(c) for c in completion_ids)
    return out


trainer._generate = counting
print("ready", flush=True)
trainer.train()
