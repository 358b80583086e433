"""Summary of an evaluation: scores per config and task (QSpec Table 3's layout), the relative change vs
the baseline (modes: the first of bf16 / the first mode; recipes: their own verify mode), acceptance per
recipe and task, the item-by-item check that a recipe's greedy answers equal its verify mode's, and a
bar chart (accuracy per config, decode throughput as a line, QSpec Figure 6's layout)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from selfspec.eval.runner import EvalConfig
from selfspec.eval.tasks import ppl as ppl_task

Results = dict[str, dict[str, list[dict]]]


def task_metrics(task: str, records: list[dict]) -> dict:
    if not records:
        return {"n": 0}
    if task == "ppl":
        return {"n": len(records), "score": ppl_task.perplexity(records)}
    stats = [r["stats"] for r in records]
    decode_s = sum(s["total_s"] - s["prefill_s"] for s in stats)
    proposed, accepted, rounds = (sum(s[k] for s in stats) for k in ("draft_proposed", "draft_accepted", "rounds"))
    # draft_rejected: absent from records cached before GenerationStats counted it (then no per-token figure).
    rejected = sum(s["draft_rejected"] for s in stats) if all("draft_rejected" in s for s in stats) else None
    # A failed item counts as wrong: the score is over every item asked.
    return {"n": len(records), "score": 100 * sum(r["correct"] for r in records) / len(records),
            "errors": sum(bool(r.get("error")) for r in records),
            "new_tokens": sum(s["new_tokens"] for s in stats),
            "tokens_per_s": sum(s["new_tokens"] for s in stats) / decode_s if decode_s > 0 else 0.0,
            "acceptance_rate": accepted / proposed if proposed else None,
            "per_token_acceptance": (accepted / (accepted + rejected) if rejected is not None and accepted + rejected
                                     else None),
            "mean_acceptance_length": 1 + accepted / rounds if rounds and proposed else None}


def compare(records: list[dict], reference: list[dict]) -> dict:
    """Item-by-item: does the speculative text (and extracted answer) equal the verify mode's AR text?
    Items that failed on either side are not compared (the report lists them as failures), nor items whose two
    sides were made by different code (`other_code`: a kernel's bits may have changed in between)."""
    ref = {r["id"]: r for r in reference if not r.get("error")}
    both = [(r, ref[r["id"]]) for r in records if r["id"] in ref and not r.get("error")]
    pairs = [(r, v) for r, v in both if _code(r) == _code(v)]
    diffs = []
    for r, v in pairs:
        if r["text"] != v["text"]:
            at = next((i for i, (a, b) in enumerate(zip(r["text"], v["text"])) if a != b),
                      min(len(r["text"]), len(v["text"])))
            diffs.append({"id": r["id"], "answer": r["answer"], "verify_answer": v["answer"],
                          "same_answer": r["answer"] == v["answer"], "first_difference_at_char": at,
                          "speculative": r["text"][at : at + 60], "verify": v["text"][at : at + 60]})
    return {"compared": len(pairs), "identical": len(pairs) - len(diffs), "differences": diffs,
            "other_code": len(both) - len(pairs)}


def _code(record: dict) -> str | None:
    return (record.get("settings") or {}).get("code")


def summarize(configs: list[EvalConfig], results: Results, tasks: list[str]) -> dict:
    metrics = {c.label: {t: task_metrics(t, results[c.label].get(t, [])) for t in tasks} for c in configs}
    modes = [c.label for c in configs if c.recipe == "ar"]
    baseline = "bf16" if "bf16" in modes else (modes[0] if modes else None)
    checks = {c.label: {t: compare(results[c.label][t], results[c.reference][t]) for t in tasks if t != "ppl"}
              for c in configs if c.reference}
    failures = [{"config": c.label, "id": r["id"], "error": r["error"]}
                for c in configs for t in tasks for r in results[c.label].get(t, []) if r.get("error")]
    return {"baseline": baseline, "configs": [asdict(c) for c in configs], "metrics": metrics, "equality": checks,
            "failures": failures}


def _relative(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "n/a"
    return f"{100 * (value - base) / base:+.1f}%"


def markdown(summary: dict, tasks: list[str], title: str = "") -> str:
    m, base = summary["metrics"], summary["baseline"]
    configs = [EvalConfig(**c) for c in summary["configs"]]
    lines = [f"### {title}" if title else ""]
    head = [f"{t} ({'ppl, lower is better' if t == 'ppl' else 'acc %'})" for t in tasks]
    lines += ["", "| config | " + " | ".join(head) + " | tok/s |", "|---" * (len(tasks) + 2) + "|"]
    for c in configs:
        ref = c.reference or base
        cells = []
        for t in tasks:
            cur = m[c.label][t]
            if cur["n"] == 0:
                cells.append("= verify" if t == "ppl" and c.reference else "-")
                continue
            rel = "" if ref in (None, c.label) else f" ({_relative(cur['score'], m[ref][t].get('score'))})"
            failed = f", {cur['errors']} failed" if cur.get("errors") else ""
            cells.append(f"{cur['score']:.2f}{rel} [n={cur['n']}{failed}]")
        modes = f"{c.draft} -> {c.verify}" if c.draft else c.verify
        name = f"{c.label} ({c.storage})" if c.label == c.verify else f"{c.label} ({modes}, {c.storage})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_throughput(m[c.label]):.1f} |")
    lines += ["", f"Relative change in parentheses: modes vs {base}, recipes vs their own verify mode."]
    if summary["equality"]:
        lines += ["", "| recipe | task | acceptance | mean acc. length | identical to verify (greedy) |",
                  "|---|---|---|---|---|"]
        for label, per_task in summary["equality"].items():
            for t, chk in per_task.items():
                cur = m[label][t]
                acc = "-" if cur.get("acceptance_rate") is None else f"{100 * cur['acceptance_rate']:.1f}%"
                mal = "-" if cur.get("mean_acceptance_length") is None else f"{cur['mean_acceptance_length']:.2f}"
                other = f" ({chk['other_code']} by other code: not compared)" if chk.get("other_code") else ""
                lines.append(f"| {label} | {t} | {acc} | {mal} | {chk['identical']}/{chk['compared']}{other} |")
        diffs = [(label, d) for label, per_task in summary["equality"].items()
                 for chk in per_task.values() for d in chk["differences"]]
        lines += ["", "Differences from the verify mode: " + ("none." if not diffs else "")]
        for label, d in diffs:
            lines.append(f"- {label} {d['id']}: answer {d['answer']!r} vs verify {d['verify_answer']!r}, texts differ "
                         f"at char {d['first_difference_at_char']}: {d['speculative']!r} vs {d['verify']!r}")
    if summary["failures"]:
        lines += ["", "Failed items (scored wrong; a rerun generates them again):"]
        lines += [f"- {f['config']} {f['id']}: {f['error']}" for f in summary["failures"]]
    return "\n".join(lines).strip() + "\n"


def _throughput(per_task: dict) -> float:
    """Decode tokens/s over all generation tasks together."""
    rows = [v for t, v in per_task.items() if t != "ppl" and v.get("n")]
    tokens = sum(v["new_tokens"] for v in rows)
    seconds = sum(v["new_tokens"] / v["tokens_per_s"] for v in rows if v["tokens_per_s"])
    return tokens / seconds if seconds else 0.0


def chart(summary: dict, tasks: list[str], path: Path, title: str = "") -> None:
    """Grouped accuracy bars per config (one colour per task) and decode tok/s as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = summary["metrics"]
    labels = [c["label"] for c in summary["configs"]]
    gen_tasks = [t for t in tasks if t != "ppl"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels)), 4))
    width = 0.8 / max(len(gen_tasks), 1)
    top = 0.0
    for k, t in enumerate(gen_tasks):
        xs = [i + (k - (len(gen_tasks) - 1) / 2) * width for i in range(len(labels))]
        scores = [m[c][t].get("score", 0.0) for c in labels]
        top = max([top, *scores])
        ax.bar(xs, scores, width, label=t)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylim(0, max(10.0, 1.15 * top))  # all-zero accuracies still get a readable axis
    ax.set_ylabel("accuracy (%)")
    ax2 = ax.twinx()
    ax2.plot(range(len(labels)), [_throughput(m[c]) for c in labels], "k-o", label="decode tok/s")
    ax2.set_ylabel("decode tokens/s")
    ax2.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, gen_tasks + ["decode tok/s"], loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out_dir: Path, configs: list[EvalConfig], results: Results, tasks: list[str],
                 title: str = "") -> dict:
    """Write summary.json and summary.md (and chart.png when matplotlib is installed); return the summary."""
    summary = summarize(configs, results, tasks)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "summary.md").write_text(markdown(summary, tasks, title))
    try:
        import matplotlib  # noqa: F401  (the `eval` extra; optional)
    except ImportError:
        return summary
    chart(summary, tasks, out_dir / "chart.png", title)
    return summary
