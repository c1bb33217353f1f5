"""TRL's GRPOTrainer + PEFT on the prompts tunestudio trains, for scripts/bench-grpo-vs-trl.sh.

  trl_grpo_step.py prepare MODEL_DIR ROWS OUT_JSON
      Writes a random-init model of MODEL_DIR's config.json (seed 0) as model.safetensors in
      MODEL_DIR, so both trainers start from the same weights, and ROWS arithmetic prompts
      (two-digit operands, so every prompt has the same token count) in TRL's conversational
      format: `prompt` (a list of messages) and `answer`. OUT_JSON gets the rows; stdout a JSON
      line with the rows and the prompt's token count after the chat template.
  trl_grpo_step.py train MODEL_DIR ROWS_JSON STEPS G MAX_PROMPT MAX_COMPLETION LORA_R THREADS CKPT
      STEPS optimizer steps of GRPO (loss dapo, beta 0, temperature 1), one prompt a step with
      its G completions sampled by transformers' `generate` (no vLLM), LoRA r LORA_R on all
      linear layers, fp32, gradient checkpointing when CKPT is 1 (TRL's default). The reward is the last number of the completion (or its last
      `\\boxed{}`) against `answer`, compared as numbers: tunestudio's `accuracy` rule. Prints one
      JSON line: the seconds of steps 2..N (step 1 is the warm-up) and the part of them in
      `generate`, their prompts, each step's mean completion length and the peak RSS.
"""

import json
import re
import resource
import sys
import time

NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def rows(n):
    """n prompts "What is a + b?" with two-digit a and b (a fixed LCG, no RNG state)."""
    out, x = [], 12345
    for i in range(n):
        x = (1103515245 * x + 12345) % 2**31
        a = 10 + x % 90
        x = (1103515245 * x + 12345) % 2**31
        b = 10 + x % 90
        out.append({
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}],
            "answer": str(a + b),
        })
    return out


def last_boxed(text):
    at = text.rfind("\\boxed{")
    while at >= 0:
        depth, start = 1, at + len("\\boxed{")
        for i, c in enumerate(text[start:]):
            depth += c == "{"
            depth -= c == "}"
            if depth == 0:
                return text[start:start + i]
        at = text.rfind("\\boxed{", 0, at)
    return None


def last_number(text):
    found = list(NUMBER.finditer(text))
    if not found:
        return None
    m = found[-1]
    s = m.group(0)
    if s.startswith("-") and m.start() > 0 and text[m.start() - 1].isalnum():
        s = s[1:]
    return s


def as_number(text):
    t = text.strip()
    t = t[:-1] if t.endswith(".") else t
    t = t.lstrip("$+") if t[:1] in "$+" else t
    if not re.fullmatch(NUMBER.pattern, t):
        return None
    return float(t.replace(",", ""))


def accuracy(completions, answer, **kwargs):
    """tunestudio's `accuracy` reward: the final answer against the `answer` column."""
    scores = []
    for completion, ref in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        got = last_boxed(text)
        got = got if got is not None else last_number(text)
        if got is None:
            scores.append(0.0)
            continue
        a, b = as_number(got), as_number(ref)
        same = a == b if a is not None and b is not None else " ".join(got.split()) == " ".join(ref.split())
        scores.append(1.0 if same else 0.0)
    return scores


def prompt_tokens(tok, row):
    return len(tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"])


def prepare(model_dir, n, out_json):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import os

    # A real model folder (MODEL_DIR) keeps its weights; otherwise random ones, seed 0.
    if not any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(model_dir, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    picked = rows(n)
    lengths = sorted({prompt_tokens(tok, r) for r in picked})
    json.dump(picked, open(out_json, "w"))
    print(json.dumps({"rows": len(picked), "prompt_tokens": lengths}))


def train(model_dir, rows_json, steps, g, max_prompt, max_completion, lora_r, threads, ckpt):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stamps, lengths, generating, rewards = [], [], [], []

    class Trainer(GRPOTrainer):
        # The seconds in transformers' `generate` (and TRL's EOS masking after it), per step.
        def _generate_single_turn(self, *a, **kw):
            started = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            generating.append(time.perf_counter() - started)
            return out

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])
            if logs and "reward" in logs:
                rewards.append(round(logs["reward"], 3))

    args = GRPOConfig(
        output_dir="/tmp/trl-grpo-bench",
        # One prompt a step: its G completions are the step's batch, sampled in one generation.
        per_device_train_batch_size=g,
        gradient_accumulation_steps=1,
        num_generations=g,
        generation_batch_size=g,
        max_steps=steps,
        max_completion_length=max_completion,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        use_vllm=False,
        learning_rate=5e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        gradient_checkpointing=bool(ckpt),
        logging_steps=1,
        log_completions=False,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        **PROMPT_LENGTH_ARG(max_prompt),
    )
    peft = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = Trainer(
        model=model,
        reward_funcs=[accuracy],
        args=args,
        train_dataset=Dataset.from_list(json.load(open(rows_json))),
        processing_class=tok,
        peft_config=peft,
        callbacks=[Stamp()],
    )
    trainer.train()
    timed = len(stamps) - 1
    secs = stamps[-1] - stamps[0]
    print(json.dumps({
        "steps": len(stamps),
        "prompts": timed,
        "secs": secs,
        "generate_secs": sum(generating[1:]) if len(generating) == len(stamps) else None,
        "prompts_per_sec": timed / secs,
        "completion_mean_length": lengths,
        "reward_by_step": rewards,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


def PROMPT_LENGTH_ARG(max_prompt):
    """`max_prompt_length` where this TRL's GRPOConfig still has it (later 1.x dropped it)."""
    from trl import GRPOConfig

    fields = getattr(GRPOConfig, "__dataclass_fields__", {})
    return {"max_prompt_length": max_prompt} if "max_prompt_length" in fields else {}


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:11]))
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
