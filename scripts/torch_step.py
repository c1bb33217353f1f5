"""PyTorch reference for `scripts/bench-vs-torch.sh`: the training step tunestudio's
`bench` times, in transformers — a Llama built from a config.json (random init), AdamW,
`accumulation` micro-batches of random tokens per step (gradients accumulate in `.grad`, as
the Hugging Face Trainer does). Prints one JSON line.

    torch_step.py CONFIG SEQ BATCH STEPS THREADS [ACCUMULATION=1] [--lora-r R] [--bf16]

`--lora-r R` wraps the model with PEFT (LoRA r R, alpha 2R, dropout 0, all seven linear
layers, as `tunestudio bench --lora-r R`); `--bf16` runs forward and loss under CPU autocast
to bfloat16 with fp32 weights and optimizer (transformers' `bf16=True` on a CPU), which
`tunestudio bench --precision bf16-mixed` is compared with. Attention is transformers'
default (SDPA)."""
import argparse
import json
import resource
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("seq_len", type=int)
    p.add_argument("batch", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("threads", type=int)
    p.add_argument("accumulation", type=int, nargs="?", default=1)
    p.add_argument("--lora-r", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    return p.parse_args()


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(a.config)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if a.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.0, target_modules=TARGETS,
            task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    times = []
    for step in range(a.steps + 1):  # the first step is a warm-up
        t0 = time.perf_counter()
        for _ in range(a.accumulation):
            ids = torch.randint(0, config.vocab_size, (a.batch, a.seq_len))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                loss = model(input_ids=ids, labels=ids).loss / a.accumulation
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0:
            times.append(time.perf_counter() - t0)
    step_secs = statistics.median(times)
    print(json.dumps({
        "step_secs": step_secs,
        "tokens_per_sec": a.batch * a.seq_len * a.accumulation / step_secs,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": float(loss),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
