#!/usr/bin/env python3
"""QLoRA check (issue #22, deliverable 4): an adapter trained by tunestudio on a QUANTIZED base
(`[model] quantize = "q8_0" | "q4_k"`), loaded by PEFT on the UNQUANTIZED base, behaves as QLoRA
adapters do (the standard practice: train on the 4/8-bit base, apply or merge on the 16/32-bit one).

For each quantization (and an unquantized LoRA run as the reference) it
  1. trains a LoRA adapter (r 8, all seven linears, fp32) with the real CLI:
     `tunestudio train --config <workdir>/run-<q>.toml` (skipped with --skip-train if present);
  2. loads the fixture base with transformers (fp32) + the adapter with `PeftModel.from_pretrained`;
  3. greedy-decodes a few alpaca prompts (the chat template, as training formats them) in PEFT and
     with `tunestudio generate --chat --temperature 0` on the unquantized base, and again with
     `--quantize <q>` (the base the adapter was trained on): token agreement up to the first
     divergence, and whole-output exact matches;
  4. with --logits (default on): teacher-forced logits of prompt + PEFT's greedy continuation, PEFT
     vs tunestudio's inference engine (a 30-line dumper built against the crate's library under
     <workdir>/logits-dump; the CLI prints no logits): max |Δlogit| and argmax agreement;
  5. the adapter's effect in PEFT on the unquantized base: the token-mean loss on the run's exact
     training / validation rows (ids and label mask from `tunestudio preview --json`), with the
     adapter disabled (base only) and enabled.

Usage (from the repository root; ~4 min on 2 busy cores, ~1 min of it the dumper's build):
    export PKG_CONFIG=false TUNESTUDIO_SHARED=/work/shared
    cargo build --release --bin tunestudio
    target/torch-venv/bin/python scripts/qlora_peft_check.py
Options: --steps N, --quants q8_0,q4_k, --no-reference, --skip-train, --no-logits, --prompts N,
--max-new-tokens N, --workdir DIR (default target/qlora-check), --bin PATH.
On the tiny-llama fixture (input widths 64 and 160, not multiples of 256) `q4_k` stores every
linear in its Q5_0 fallback, so the "q4_k" row measures Q5_0 there.
Exit status 1 when an adapter does not lower the base's loss or the unquantized greedy outputs differ.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("TUNESTUDIO_SHARED", "/work/shared"))

RUN_TOML = """\
# QLoRA check (#22): LoRA r 8 on all linears of the tiny-llama fixture, base quantize = {q}
output_dir = "runs/{q}"

[model]
source = "{model}"
quantize = "{q}"

[data]
path = "{data}"
format = "alpaca"
max_length = 128
validation_ratio = 0.05

[training]
precision = "fp32"
micro_batch = 4
gradient_accumulation = 1
max_steps = {steps}
learning_rate = {lr}
schedule = "cosine"
warmup_steps = 10
weight_decay = 0.0
max_grad_norm = 1.0
seed = 42

[lora]
enabled = true
r = 8
alpha = 16
dropout = 0.0
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

[eval]
eval_every = 50

[checkpoint]
save_every = {steps}
keep_last = 1

[devices]
devices = ["cpu"]
strategy = "single"
"""

DUMPER_MAIN = r"""
//! tunestudio's logits for token-id prompts (one JSON array of ids a line on stdin; the
//! [t, vocab] logits of each as little-endian f32 on stdout). usage: dump MODEL ADAPTER|- QUANT
use std::io::{BufRead, Write};
use tunestudio::infer::{Generator, ModelSpec};

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let mut spec = ModelSpec::new(a[1].clone());
    if a[2] != "-" {
        spec.adapter = Some(a[2].clone().into());
    }
    spec.quantize = a[3].parse()?;
    let g = Generator::load(&spec)?;
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let ids: Vec<u32> = serde_json::from_str(&line?)?;
        let mut cache = g.model().new_cache(ids.len());
        let logits = g.model().forward_all(&ids, &mut cache)?.flatten_all()?.to_vec1::<f32>()?;
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.write_all(&bytes)?;
        out.flush()?;
    }
    Ok(())
}
"""

DUMPER_TOML = """\
[package]
name = "qlora-logits-dump"
version = "0.1.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
tunestudio = {{ path = "{root}" }}
serde_json = "1"
anyhow = "1"

[profile.release]
debug = "line-tables-only"
"""


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def train(args, q, workdir):
    cfg = workdir / f"run-{q}.toml"
    cfg.write_text(RUN_TOML.format(q=q, model=args.model, data=args.data, steps=args.steps, lr=args.lr))
    adapter = workdir / "runs" / q / f"checkpoint-{args.steps}" / "adapter"
    if not (args.skip_train and (adapter / "adapter_model.safetensors").exists()):
        shutil.rmtree(workdir / "runs" / q, ignore_errors=True)  # a fresh run (train refuses a used folder)
        print(f"$ {args.bin} train --config {cfg}", flush=True)
        r = subprocess.run([args.bin, "train", "--config", str(cfg)], text=True, capture_output=True)
        if r.returncode != 0:
            sys.exit(f"tunestudio train failed ({q}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    assert (adapter / "adapter_model.safetensors").exists(), f"no adapter at {adapter}"
    assert (adapter / "adapter_config.json").exists(), f"no adapter_config.json at {adapter}"
    evals = [json.loads(l) for l in (workdir / "runs" / q / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("event") == "eval"]
    return cfg, adapter, (evals[-1]["loss"] if evals else float("nan"))


def preview_rows(args, cfg):
    """The run's rows as tunestudio trains them: ids, labels (-100 = masked), split."""
    out = sh([args.bin, "preview", "--config", str(cfg), "--rows", "100000", "--json", "--quick", "--no-color"]).stdout
    rows = []
    for r in json.loads(out)["rows"]:
        if r.get("dropped"):
            continue
        ids = [t["id"] for t in r["tokens"]]
        labels = [t["label"] for t in r["tokens"]]
        rows.append({"index": r["index"], "split": r["split"], "ids": ids, "labels": labels})
    return rows


def alpaca_prompts(args, rows, n):
    """n training rows with an empty `input`: (instruction, the prompt ids tunestudio trains on)."""
    data = json.loads(Path(args.data).read_text())
    out = []
    for r in rows:
        row = data[r["index"]]
        if r["split"] != "train" or row.get("input") or "\n" in row["instruction"]:
            continue
        k = next(i for i, l in enumerate(r["labels"]) if l != -100)
        out.append((row["instruction"], r["ids"][:k]))
        if len(out) == n:
            break
    return out


@torch.no_grad()
def mean_loss(model, rows, split, batch=16):
    """Token mean over the trained tokens; batches of right-padded rows (causal: the padding
    after a row cannot change its logits)."""
    tot, n = 0.0, 0
    sel = sorted((r for r in rows if r["split"] == split), key=lambda r: len(r["ids"]))
    for b in range(0, len(sel), batch):
        chunk = sel[b:b + batch]
        t = max(len(r["ids"]) for r in chunk)
        ids = torch.tensor([r["ids"] + [0] * (t - len(r["ids"])) for r in chunk])
        labels = torch.tensor([r["labels"] + [-100] * (t - len(r["labels"])) for r in chunk])
        logits = model(input_ids=ids).logits[:, :-1].float()
        tgt = labels[:, 1:]
        keep = tgt != -100
        tot += torch.nn.functional.cross_entropy(logits[keep], tgt[keep], reduction="sum").item()
        n += int(keep.sum())
    return tot / n


@torch.no_grad()
def peft_greedy(model, prompt_ids, max_new):
    ids = list(prompt_ids)
    out = []
    for _ in range(max_new):  # plain greedy loop (no generate() heuristics), full forward each step
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == EOS:
            break
        ids.append(nxt)
        out.append(nxt)
    return out


def ts_generate(args, adapter, instruction, quant, max_new):
    cmd = [args.bin, "generate", "--model", args.model, "--adapter", str(adapter), "--chat",
           "--prompt", instruction, "--temperature", "0", "--top-k", "0", "--top-p", "1",
           "--max-new-tokens", str(max_new), "--quantize", quant]
    r = sh(cmd)
    n_prompt = int(re.search(r"prompt: (\d+) tokens", r.stderr).group(1))
    n_gen = int(re.search(r"(\d+) tokens in ", r.stderr).group(1))
    text = r.stdout[:-1] if r.stdout.endswith("\n") else r.stdout
    return text, n_prompt, n_gen


def agreement(tok, peft_ids, ts_text, ts_len):
    """Tokens of PEFT's greedy output whose cumulative decode is a prefix of tunestudio's text
    (agreement up to the first divergence), over max(len) of the two outputs."""
    agree = 0
    for i in range(len(peft_ids)):
        if ts_text.startswith(tok.decode(peft_ids[: i + 1], skip_special_tokens=True)):
            agree = i + 1
        else:
            break
    full = tok.decode(peft_ids, skip_special_tokens=True) == ts_text and len(peft_ids) == ts_len
    return agree, max(len(peft_ids), ts_len, 1), full


def build_dumper(workdir):
    d = workdir / "logits-dump"
    (d / "src").mkdir(parents=True, exist_ok=True)
    (d / "Cargo.toml").write_text(DUMPER_TOML.format(root=ROOT))
    (d / "src" / "main.rs").write_text(textwrap.dedent(DUMPER_MAIN))
    lock = ROOT / "Cargo.lock"
    if lock.exists() and not (d / "Cargo.lock").exists():
        (d / "Cargo.lock").write_text(lock.read_text())
    print(f"$ cargo build --release --manifest-path {d / 'Cargo.toml'}  (CARGO_TARGET_DIR={ROOT / 'target'})", flush=True)
    env = dict(os.environ, CARGO_TARGET_DIR=str(ROOT / "target"), PKG_CONFIG="false")
    r = subprocess.run(["cargo", "build", "--release", "--offline", "--manifest-path", str(d / "Cargo.toml")],
                       env=env, text=True, capture_output=True)
    if r.returncode != 0:
        sys.exit(f"building the logits dumper failed:\n{r.stderr[-3000:]}")
    return ROOT / "target" / "release" / "qlora-logits-dump"


def ts_logits(dumper, model, adapter, quant, seqs, vocab):
    inp = "".join(json.dumps(s) + "\n" for s in seqs)
    r = subprocess.run([str(dumper), model, str(adapter), quant], input=inp.encode(), capture_output=True)
    if r.returncode != 0:
        sys.exit(f"logits dumper failed: {r.stderr.decode()[-2000:]}")
    flat = torch.frombuffer(bytearray(r.stdout), dtype=torch.float32)
    out, at = [], 0
    for s in seqs:
        n = len(s) * vocab
        out.append(flat[at:at + n].view(len(s), vocab))
        at += n
    assert at == flat.numel(), "logits dumper wrote an unexpected number of values"
    return out


EOS = 2


def main():
    global EOS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=str(ROOT / "target" / "release" / "tunestudio"))
    p.add_argument("--model", default=str(SHARED / "fixtures" / "tiny-llama"))
    p.add_argument("--data", default=str(SHARED / "datasets" / "alpaca_en_demo.json"))
    p.add_argument("--workdir", default=str(ROOT / "target" / "qlora-check"))
    p.add_argument("--quants", default="q8_0,q4_k")
    p.add_argument("--no-reference", action="store_true", help="skip the unquantized LoRA run")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--skip-train", action="store_true", help="reuse adapters already trained")
    p.add_argument("--no-logits", action="store_true", help="skip the teacher-forced logits comparison")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the fixture is tiny: one thread beats two contended ones
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    quants = args.quants.split(",") + ([] if args.no_reference else ["none"])

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    EOS = json.loads((Path(args.model) / "generation_config.json").read_text()).get("eos_token_id", EOS)
    dumper = None if args.no_logits else build_dumper(workdir)

    results, ok = [], True
    rows = prompts = None
    for q in quants:
        cfg, adapter, ts_eval = train(args, q, workdir)
        if rows is None:
            rows = preview_rows(args, cfg)
            prompts = alpaca_prompts(args, rows, args.prompts)
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        model = PeftModel.from_pretrained(base, str(adapter)).eval()

        # (b) the adapter's effect on the unquantized base, on the run's own rows
        with model.disable_adapter():
            base_train, base_val = mean_loss(model, rows, "train"), mean_loss(model, rows, "validation")
        ad_train, ad_val = mean_loss(model, rows, "train"), mean_loss(model, rows, "validation")

        # (a) greedy outputs and logits, PEFT vs tunestudio
        greedy = {"none": [0, 0, 0], q: [0, 0, 0]}  # agreeing tokens, compared tokens, exact outputs
        seqs = []
        for instruction, prompt_ids in prompts:
            peft_ids = peft_greedy(model, prompt_ids, args.max_new_tokens)
            seqs.append(list(prompt_ids) + peft_ids)
            for gq in dict.fromkeys(["none", q]):
                text, n_prompt, n_gen = ts_generate(args, adapter, instruction, gq, args.max_new_tokens)
                assert n_prompt == len(prompt_ids), (
                    f"generate --chat encoded {n_prompt} prompt tokens, training {len(prompt_ids)}")
                a, n, full = agreement(tok, peft_ids, text, n_gen)
                greedy[gq][0] += a
                greedy[gq][1] += n
                greedy[gq][2] += int(full)
        res = {"q": q, "ts_eval": ts_eval, "base_train": base_train, "ad_train": ad_train,
               "base_val": base_val, "ad_val": ad_val, "greedy": greedy}
        if dumper:
            with torch.no_grad():
                peft_logits = [model(input_ids=torch.tensor([s])).logits[0].float() for s in seqs]
            for lq in dict.fromkeys(["none", q]):
                tl = ts_logits(dumper, args.model, adapter, lq, seqs, peft_logits[0].shape[-1])
                dmax = max(float((a - b).abs().max()) for a, b in zip(peft_logits, tl))
                am = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(peft_logits, tl))
                tot = sum(a.shape[0] for a in peft_logits)
                res[f"dlogit_{lq}"] = dmax
                res[f"argmax_{lq}"] = am / tot
            scale = max(float(a.abs().max()) for a in peft_logits)
            res["logit_scale"] = scale
        results.append(res)
        if not (ad_train < base_train and ad_val < base_val):
            ok = False
        if greedy["none"][2] != len(prompts):
            ok = False

    n = len(prompts)
    print(f"\nbase {args.model} (fp32, unquantized in PEFT); {n} chat prompts, greedy, "
          f"≤{args.max_new_tokens} new tokens; loss = token mean over the run's trained tokens")
    hdr = (f"{'adapter trained on':<18} | {'greedy agree: ts unq':>20} | {'ts on quant base':>16} | "
           f"{'max|Δlogit| unq':>15} | {'… quant base':>12} | {'loss train base→+adapter':>24} | "
           f"{'loss val base→+adapter':>22} | {'ts eval (quant)':>15}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        g0, gq = r["greedy"]["none"], r["greedy"][r["q"]]
        def pct(g):
            return f"{100 * g[0] / g[1]:.1f}% ({g[2]}/{n} exact)"
        dl0 = f"{r['dlogit_none']:.2e}" if "dlogit_none" in r else "-"
        dlq = f"{r['dlogit_' + r['q']]:.2e}" if r["q"] != "none" and f"dlogit_{r['q']}" in r else "-"
        print(f"{r['q'] + ' base':<18} | {pct(g0):>20} | {(pct(gq) if r['q'] != 'none' else '-'):>16} | "
              f"{dl0:>15} | {dlq:>12} | {r['base_train']:.4f} → {r['ad_train']:.4f} ({r['ad_train'] - r['base_train']:+.4f}) | "
              f"{r['base_val']:.4f} → {r['ad_val']:.4f} ({r['ad_val'] - r['base_val']:+.4f}) | {r['ts_eval']:>15.4f}")
    if dumper:
        print("teacher-forced argmax agreement (prompt + PEFT's greedy tokens, every position): " + ", ".join(
            f"{r['q']}: unq {100 * r['argmax_none']:.1f}%"
            + (f", quant {100 * r['argmax_' + r['q']]:.1f}%" if r["q"] != "none" else "") for r in results)
              + f"; |logit| up to {max(r['logit_scale'] for r in results):.2f}")
    print("PASS" if ok else "FAIL: an adapter did not lower the loss, or unquantized greedy outputs differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
