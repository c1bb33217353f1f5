"""PyTorch's side of `scripts/gpu-check.sh`'s throughput step: the training step tunestudio's
`devices --check` throughput step times (a Llama-shaped model from a config.json with random
weights, loss sum / tokens, backward, AdamW, one batch of random tokens), with eager attention
(softmax(QKᵀ)V written out) or SDPA (torch's fused scaled_dot_product_attention). Uses
transformers when it is installed (`attn_implementation`), else a compact Llama in plain
PyTorch. Prints one JSON line.

    gpu_check_torch.py --config CONFIG --device cuda --dtype bf16 --batch 8 --seq 512 --steps 10 --attn sdpa
"""
import argparse
import json
import math
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("--device", default="cuda")
p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
a = p.parse_args()
dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
cfg = json.load(open(a.config))
torch.manual_seed(0)
F = torch.nn.functional


def loss_of(logits, ids):
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")


try:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.config), attn_implementation=a.attn)
    model = model.to(a.device, dtype)
    impl = f"transformers {a.attn}"

    def forward(ids):
        return model(input_ids=ids).logits
except Exception as e:  # no transformers: a compact Llama in plain PyTorch
    impl = f"plain torch {a.attn} ({type(e).__name__})"
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    V = cfg["vocab_size"]
    theta = cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))

    def lin(i, o):
        return torch.nn.Linear(i, o, bias=False)

    def attention(q, k, v):
        if a.attn == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        t = q.shape[2]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

    class Layer(torch.nn.Module):
        def __init__(s):
            super().__init__()
            s.q, s.k, s.v, s.o = lin(H, nh * hd), lin(H, nkv * hd), lin(H, nkv * hd), lin(nh * hd, H)
            s.g, s.u, s.d = lin(H, I), lin(H, I), lin(I, H)
            s.n1 = torch.nn.RMSNorm(H, eps=cfg["rms_norm_eps"])
            s.n2 = torch.nn.RMSNorm(H, eps=cfg["rms_norm_eps"])

        def forward(s, x, cos, sin):
            b, t, _ = x.shape
            h = s.n1(x)
            q = s.q(h).view(b, t, nh, hd).transpose(1, 2)
            k = s.k(h).view(b, t, nkv, hd).transpose(1, 2)
            v = s.v(h).view(b, t, nkv, hd).transpose(1, 2)

            def rot(z):
                return torch.cat((-z[..., hd // 2:], z[..., : hd // 2]), -1)

            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            x = x + s.o(attention(q, k, v).transpose(1, 2).reshape(b, t, nh * hd))
            h = s.n2(x)
            return x + s.d(F.silu(s.g(h)) * s.u(h))

    class Model(torch.nn.Module):
        def __init__(s):
            super().__init__()
            s.e = torch.nn.Embedding(V, H)
            s.layers = torch.nn.ModuleList(Layer() for _ in range(L))
            s.n = torch.nn.RMSNorm(H, eps=cfg["rms_norm_eps"])

        def forward(s, ids):
            t = ids.shape[1]
            inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=ids.device).float() / hd)
            f = torch.outer(torch.arange(t, device=ids.device).float(), inv)
            emb = torch.cat((f, f), -1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            x = s.e(ids)
            for layer in s.layers:
                x = layer(x, cos, sin)
            return s.n(x) @ s.e.weight.T

    model = Model().to(a.device, dtype)

    def forward(ids):
        return model(ids)

opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ids = torch.randint(0, cfg["vocab_size"], (a.batch, a.seq), device=a.device)


def sync():
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()


def step():
    loss = loss_of(forward(ids), ids) / ids[:, 1:].numel()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


first = step()
sync()
times, last = [], first
for _ in range(a.steps):
    t0 = time.perf_counter()
    last = step()
    sync()
    times.append(time.perf_counter() - t0)
times.sort()
med = times[len(times) // 2]
peak = torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else None
print(json.dumps({"impl": impl, "attn": a.attn, "torch": torch.__version__, "tokens_per_sec": a.batch * a.seq / med,
                  "median_step_secs": med, "first_loss": first, "last_loss": last, "max_memory_allocated": peak}))
