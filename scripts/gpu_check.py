"""The JSON side of `scripts/gpu-check.sh` (standard library only: it runs on the GPU machine's
Python and on CI's). Each subcommand reads what a step produced — `metrics.jsonl` of
`tunestudio train` runs, `tunestudio devices --check --json`, `tunestudio plan --json`, the
PyTorch step's JSON — and writes the step's verdict (status, reason, figures) to the file
named by $GPU_CHECK_VERDICT; `report` gathers the verdicts into the one JSON report.

    gpu_check.py verdict STATUS REASON [FIGURES_JSON]
    gpu_check.py record NAME SECS BUDGET STEPS_JSONL
    gpu_check.py compare --tol T [--after N] [--steps N] [--ranks R] [--stages S]
                         [--resumed-from N] LABEL=RUN_METRICS:REFERENCE_METRICS ...
    gpu_check.py devcheck CHECK_JSON STEP
    gpu_check.py oom METRICS PLAN_JSON MODE
    gpu_check.py mem-case CASES_JSONL NAME PLAN_JSON POLLED_PEAK METRICS DEVICE
    gpu_check.py mem-verdict CASES_JSONL TOLERANCE MODE
    gpu_check.py throughput CHECK_JSON TORCH_DIR TORCH_REASON
    gpu_check.py report OUT_JSON MODE BUDGET ELAPSED STEPS_JSONL ENV_JSON
"""
import json
import math
import os
import sys


def write_verdict(status, reason, figures=None):
    path = os.environ.get("GPU_CHECK_VERDICT")
    record = {"status": status, "reason": reason, "figures": figures or {}}
    if path:
        with open(path, "w") as f:
            json.dump(record, f)
    print(f"  -> {status}: {reason}")


def events(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    return out


def step_losses(evs, after=0):
    """The last recorded loss of every step (a resumed run appends; its steps win)."""
    losses = {}
    for e in evs:
        if e.get("event") == "step" and e["step"] > after:
            losses[e["step"]] = e["loss"]
    return losses


def last_started(evs):
    started = [e for e in evs if e.get("event") == "started"]
    return started[-1] if started else None


def cmd_verdict(args):
    figures = json.loads(args[2]) if len(args) > 2 and args[2] else {}
    write_verdict(args[0], args[1], figures)


def cmd_record(args):
    name, secs, budget, steps_jsonl = args[0], float(args[1]), float(args[2]), args[3]
    path = os.environ.get("GPU_CHECK_VERDICT", "")
    if path and os.path.exists(path):
        with open(path) as f:
            v = json.load(f)
    else:
        v = {"status": "failed", "reason": "the step ended without a verdict (timed out or crashed)", "figures": {}}
    step = {"name": name, "status": v["status"], "secs": round(secs, 2), "budget_secs": budget,
            "reason": v["reason"], "figures": v.get("figures", {})}
    with open(steps_jsonl, "a") as f:
        f.write(json.dumps(step) + "\n")


def cmd_compare(args):
    tol, after, want_steps, ranks, stages, resumed_from = None, 0, None, None, None, None
    pairs = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--tol":
            tol = float(args[i + 1]); i += 2
        elif a == "--after":
            after = int(args[i + 1]); i += 2
        elif a == "--steps":
            want_steps = int(args[i + 1]); i += 2
        elif a == "--ranks":
            ranks = int(args[i + 1]); i += 2
        elif a == "--stages":
            stages = int(args[i + 1]); i += 2
        elif a == "--resumed-from":
            resumed_from = int(args[i + 1]); i += 2
        else:
            pairs.append(a); i += 1
    figures, problems = {"tolerance_abs": tol}, []
    for pair in pairs:
        label, files = pair.split("=", 1)
        got_path, ref_path = files.split(":", 1)
        got_evs, ref_evs = events(got_path), events(ref_path)
        got, ref = step_losses(got_evs, after), step_losses(ref_evs, after)
        f = {"steps": sorted(got), "reference_steps": sorted(ref)}
        if not ref:
            problems.append(f"{label}: the reference recorded no steps ({ref_path})")
        elif sorted(got) != sorted(ref):
            problems.append(f"{label}: steps {sorted(got)} vs the reference's {sorted(ref)}")
        else:
            worst = max(abs(got[s] - ref[s]) for s in ref)
            f["worst_abs_loss_diff"] = worst
            f["losses"] = [got[s] for s in sorted(got)]
            f["reference_losses"] = [ref[s] for s in sorted(ref)]
            if not all(math.isfinite(v) for v in got.values()) or not worst <= tol:
                problems.append(f"{label}: worst |loss - reference| {worst:.2e} > {tol:.0e}")
        if want_steps is not None and len(got) != want_steps:
            problems.append(f"{label}: {len(got)} steps recorded, expected {want_steps}")
        started = last_started(got_evs)
        if started is None:
            problems.append(f"{label}: no started event")
        else:
            f["ranks"] = started.get("ranks")
            f["placement"] = [f"{d['device']}: layers {d['start_layer']}..{d['end_layer']}"
                              for d in started.get("placement", [])]
            if ranks is not None and started.get("ranks") != ranks:
                problems.append(f"{label}: {started.get('ranks')} data-parallel ranks, expected {ranks}")
            if stages is not None and len(started.get("placement", [])) != stages:
                problems.append(f"{label}: {len(started.get('placement', []))} layer ranges, expected {stages}")
            if resumed_from is not None:
                f["resumed_from"] = started.get("resumed_from")
                f["start_step"] = started.get("start_step")
                if not started.get("resumed_from") or started.get("start_step") != resumed_from:
                    problems.append(f"{label}: did not resume from step {resumed_from} "
                                    f"(start_step {started.get('start_step')}, from {started.get('resumed_from')})")
        warnings = [e["message"] for e in got_evs if e.get("event") == "warning"
                    and ("reducer" in e["message"] or "NCCL" in e["message"])]
        if warnings:
            f["reducer_notes"] = warnings
        figures[label] = f
    if problems:
        write_verdict("failed", "; ".join(problems), figures)
    else:
        worst = max((figures[p.split("=", 1)[0]].get("worst_abs_loss_diff", 0.0) for p in pairs), default=0.0)
        n = len(figures[pairs[0].split("=", 1)[0]]["steps"]) if pairs else 0
        write_verdict("passed", f"{n} steps, worst |loss - reference| {worst:.2e} <= {tol:.0e}", figures)
    sys.exit(1 if problems else 0)


def cmd_devcheck(args):
    path, name = args
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        err = ""
        try:
            with open(path[: -len(".json")] + ".err") as f:
                err = " ".join(f.read().strip().splitlines()[-3:])[:400]
        except OSError:
            pass
        write_verdict("failed", f"no report from tunestudio devices --check ({e}){': ' + err if err else ''}")
        sys.exit(1)
    step = next((s for s in report.get("steps", []) if s["name"] == name), None)
    if step is None:
        write_verdict("failed", f"tunestudio devices --check has no step {name}")
        sys.exit(1)
    status = {"passed": "passed", "skipped": "skipped"}.get(step["status"], "failed")
    figures = dict(step.get("metrics", {}))
    figures["check_step"] = name
    figures["check_secs"] = step.get("secs")
    write_verdict(status, step.get("detail", ""), figures)
    sys.exit(0 if status != "failed" else 1)


def cmd_oom(args):
    metrics, plan_path, mode = args
    evs = events(metrics)
    ooms = [e for e in evs if e.get("event") == "out_of_memory"]
    figures, problems = {}, []
    try:
        with open(plan_path) as f:
            d = json.load(f)["plan"]["per_device"][0]
        cap = d["device"].get("capacity_bytes")
        figures["planned_peak_bytes"] = d["peak_bytes"]
        figures["capacity_bytes"] = cap
        figures["plan_first_oom_phase"] = d.get("first_oom_phase")
        if mode == "gpu" and cap and d["peak_bytes"] <= cap:
            problems.append(f"the plan puts the run under the card ({d['peak_bytes'] / 2**30:.1f} of {cap / 2**30:.1f} GiB)")
    except (OSError, KeyError, IndexError, json.JSONDecodeError) as e:
        figures["plan_error"] = str(e)
    if not ooms:
        errors = [e.get("message", "") for e in evs if e.get("event") == "error"]
        write_verdict("failed", "no out_of_memory event" + (f" (error: {errors[-1]})" if errors else ""), figures)
        sys.exit(1)
    o = ooms[-1]
    figures.update({k: o.get(k) for k in ("step", "phase", "device", "planned_bytes", "observed_bytes",
                                          "failure", "checkpoint", "refit", "refit_error")})
    ckpt = o.get("checkpoint")
    if not ckpt or not os.path.isdir(ckpt):
        problems.append(f"no checkpoint of the last good step ({ckpt})")
    if not o.get("refit"):
        problems.append(f"no refit plan ({o.get('refit_error')})")
    failure = o.get("failure") or {}
    if mode == "gpu" and failure.get("api") in (None, "injected"):
        problems.append(f"the failure was not a real allocation failure ({failure})")
    if problems:
        write_verdict("failed", "; ".join(problems), figures)
        sys.exit(1)
    write_verdict("passed", f"{o['device']} ran out at step {o['step']} ({o['phase']}, {failure.get('api')} "
                  f"{failure.get('code')}); checkpoint {os.path.basename(ckpt)}; refit: {'; '.join(o['refit'])}",
                  figures)


def cmd_mem_case(args):
    cases, name, plan_path, polled, metrics, device = args
    case = {"name": name}
    try:
        with open(plan_path) as f:
            d = json.load(f)["plan"]["per_device"][0]
        case["predicted_bytes"] = d["peak_bytes"]
        case["training_tensors_bytes"] = d.get("training_tensors_bytes")
        case["planned_overhead_bytes"] = d.get("overhead_bytes")
    except (OSError, KeyError, IndexError, json.JSONDecodeError) as e:
        case["error"] = f"no plan: {e}"
    evs = events(metrics)
    sampled = [e for e in evs if e.get("event") == "memory" and e.get("device") == device]
    case["polled_peak_bytes"] = int(polled)
    case["sampled_peak_bytes"] = max((e["peak_bytes"] for e in sampled), default=0)
    case["sample_scope"] = sampled[-1].get("scope") if sampled else None
    case["steps"] = len(step_losses(evs))
    measured = max(case["polled_peak_bytes"], case["sampled_peak_bytes"])
    case["measured_bytes"] = measured
    if "predicted_bytes" in case and measured:
        case["error_pct"] = 100.0 * (case["predicted_bytes"] - measured) / measured
    elif "error" not in case:
        case["error"] = "nothing measured (the run failed?)"
    with open(cases, "a") as f:
        f.write(json.dumps(case) + "\n")
    err = case.get("error_pct")
    print(f"  {name:<22} predicted {case.get('predicted_bytes', 0) / 2**20:9.1f} MiB, measured "
          f"{measured / 2**20:9.1f} MiB" + (f" ({err:+.1f} %)" if err is not None else f" ({case.get('error')})"))


def cmd_mem_verdict(args):
    cases_path, tol, mode = args[0], float(args[1]), args[2]
    cases = events(cases_path)
    bad = [c for c in cases if c.get("error_pct") is None or abs(c["error_pct"]) > tol or c.get("steps", 0) == 0]
    figures = {"tolerance_pct": tol, "shapes": cases}
    worst = max((abs(c["error_pct"]) for c in cases if c.get("error_pct") is not None), default=float("nan"))
    summary = f"{len(cases)} shapes, worst |predicted - measured| {worst:.1f} % (tolerance {tol:g} %)"
    if not cases or bad:
        names = ", ".join(f"{c['name']} ({c.get('error_pct', float('nan')):+.1f} %{', ' + c['error'] if c.get('error') else ''})" for c in bad)
        write_verdict("failed", f"{summary}; off: {names}" if cases else "no shape ran", figures)
        sys.exit(1)
    write_verdict("passed", summary, figures)


def cmd_throughput(args):
    check_json, torch_dir, torch_reason = args
    try:
        with open(check_json) as f:
            step = next(s for s in json.load(f)["steps"] if s["name"] == "throughput")
    except (OSError, StopIteration, KeyError, json.JSONDecodeError) as e:
        write_verdict("failed", f"no throughput from tunestudio devices --check ({e})")
        sys.exit(1)
    ours = step.get("metrics", {}).get("tokens_per_sec")
    figures = {"tunestudio_tokens_per_sec": ours, "tunestudio": step.get("detail")}
    if step["status"] != "passed":
        write_verdict("failed", f"tunestudio's step: {step.get('detail')}", figures)
        sys.exit(1)
    if torch_reason:
        write_verdict("skipped", f"{torch_reason}; tunestudio alone: {ours:.0f} tokens/s", figures)
        return
    parts, problems = [f"tunestudio {ours:.0f} tokens/s"], []
    for attn in ("eager", "sdpa"):
        path = os.path.join(torch_dir, f"torch-{attn}.json")
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"PyTorch {attn} did not report ({e}; see {torch_dir}/torch-{attn}.log)")
            continue
        figures[f"pytorch_{attn}"] = r
        ratio = ours / r["tokens_per_sec"]
        figures[f"ratio_vs_{attn}"] = ratio
        parts.append(f"PyTorch {attn} {r['tokens_per_sec']:.0f} tokens/s ({r['impl']}; ratio {ratio:.2f})")
    if problems:
        write_verdict("failed", "; ".join(parts + problems), figures)
        sys.exit(1)
    write_verdict("passed", "; ".join(parts), figures)


def cmd_report(args):
    out, mode, budget, elapsed, steps_jsonl, env_json = args
    steps = events(steps_jsonl)
    try:
        with open(env_json) as f:
            env = json.load(f)
    except (OSError, json.JSONDecodeError):
        env = {}
    counts = {}
    for s in steps:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    report = {
        "mode": mode,
        "passed": all(s["status"] != "failed" for s in steps),
        "counts": counts,
        "total_secs": float(elapsed),
        "budget_secs": float(budget),
        "within_budget": float(elapsed) <= float(budget),
        "environment": env,
        "steps": steps,
    }
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print()
    for s in steps:
        print(f"[{s['status'].upper():7}] {s['name']:<21} {s['secs']:7.1f} s (of {s['budget_secs']:.0f})  {s['reason'][:160]}")
    print(f"total {float(elapsed):.0f} s of {float(budget):.0f} s; {counts}; report: {out}")


COMMANDS = {
    "verdict": cmd_verdict, "record": cmd_record, "compare": cmd_compare, "devcheck": cmd_devcheck,
    "oom": cmd_oom, "mem-case": cmd_mem_case, "mem-verdict": cmd_mem_verdict,
    "throughput": cmd_throughput, "report": cmd_report,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](sys.argv[2:])
