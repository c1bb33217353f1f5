"""TRL's DPOTrainer + PEFT on the rows tunestudio trains, for scripts/bench-dpo-vs-trl.sh.

  trl_dpo_step.py prepare MODEL_DIR PAIRS_JSON ROWS MAX_SEQ OUT_JSON
      Writes a random-init model of MODEL_DIR's config.json (seed 0) as model.safetensors in
      MODEL_DIR, so both trainers start from the same weights, and picks the first ROWS pairs of
      PAIRS_JSON (LLaMA-Factory's sharegpt ranking format) whose prompt + answer fit MAX_SEQ
      tokens after the chat template on both sides (no truncation on either side: TRL 1.x
      truncates the whole sequence, tunestudio the prompt and the completion apart).
      OUT_JSON gets those rows as they were; stdout a JSON line with the rows' token counts.
  trl_dpo_step.py train MODEL_DIR ROWS_JSON LORA_R THREADS REFERENCE
      One epoch of DPO (sigmoid, beta 0.1) with LoRA r LORA_R on all linear layers, micro-batch
      one pair, fp32. REFERENCE is `adapter-disabled` (TRL's default with PEFT) or
      `precomputed` (`precompute_ref_log_probs=True`). Prints one JSON line: the seconds of
      steps 2..N (step 1 is the warm-up), their pairs and tokens, and the process's peak RSS.
"""

import json
import resource
import sys
import time


def sharegpt_to_trl(row):
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    prompt = [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": row["chosen"]["value"]}],
        "rejected": [{"role": "assistant", "content": row["rejected"]["value"]}],
    }


def lengths(tok, pair):
    def ids(messages, **kw):
        return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]

    prompt = ids(pair["prompt"], add_generation_prompt=True)
    return len(prompt), [len(ids(pair["prompt"] + pair[side])) for side in ("chosen", "rejected")]


def prepare(model_dir, pairs_json, rows, max_seq, out_json):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    picked, tokens = [], 0
    for row in json.load(open(pairs_json)):
        pair = sharegpt_to_trl(row)
        _, (chosen, rejected) = lengths(tok, pair)
        if max(chosen, rejected) <= max_seq:
            picked.append(row)
            tokens += chosen + rejected
        if len(picked) == rows:
            break
    json.dump(picked, open(out_json, "w"), ensure_ascii=False)
    print(json.dumps({"rows": len(picked), "tokens": tokens}))


def train(model_dir, rows_json, lora_r, threads, reference):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [sharegpt_to_trl(r) for r in json.load(open(rows_json))]
    pair_tokens = [sum(lengths(tok, p)[1]) for p in rows]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stamps = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = DPOConfig(
        output_dir="/tmp/trl-dpo-bench",
        per_device_train_batch_size=1,
        num_train_epochs=1,
        learning_rate=5e-5,
        lr_scheduler_type="constant",
        beta=0.1,
        loss_type=["sigmoid"],
        max_length=None,
        precompute_ref_log_probs=reference == "precomputed",
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    peft = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules="all-linear")
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=peft,
        callbacks=[Stamp()],
    )
    trainer.train()
    # The sampler shuffles: the timed steps are all but the first, whose row is unknown here,
    # so their tokens are the mean pair's times the step count.
    timed = len(stamps) - 1
    secs = stamps[-1] - stamps[0]
    tokens = sum(pair_tokens) / len(pair_tokens) * timed
    print(json.dumps({
        "pairs": timed,
        "secs": secs,
        "tokens": tokens,
        "tokens_per_sec": tokens / secs,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
