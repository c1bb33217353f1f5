"""PyTorch reference for `scripts/bench-vs-torch.sh`: the training step tunestudio's
`bench` times, in transformers — a Llama built from a config.json (random init), fp32,
AdamW, `accumulation` micro-batches of random tokens per step (gradients accumulate in
`.grad`, as the Hugging Face Trainer does). Prints one JSON line.

    torch_step.py CONFIG SEQ BATCH STEPS THREADS [ACCUMULATION=1]"""
import json
import resource
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    config_path, seq_len, batch, steps, threads = (
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    accumulation = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_path)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    times = []
    for step in range(steps + 1):  # the first step is a warm-up
        t0 = time.perf_counter()
        for _ in range(accumulation):
            ids = torch.randint(0, config.vocab_size, (batch, seq_len))
            loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0:
            times.append(time.perf_counter() - t0)
    step_secs = statistics.median(times)
    print(json.dumps({
        "step_secs": step_secs,
        "tokens_per_sec": batch * seq_len * accumulation / step_secs,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": float(loss),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
