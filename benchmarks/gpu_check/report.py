"""Markdown tables of a gpu-check run's summary (``summary.json``), for benchmarks/README.md."""
from __future__ import annotations


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(x, spec=".0f"):
    return "" if x is None else format(x, spec)


def markdown(summary: dict) -> str:
    """The run's tables: stages, kernel tests, oracle, roofline, throughput, syncs, KV sizing."""
    st = summary["stages"]
    res = lambda name: (st.get(name) or {}).get("result") or {}  # noqa: E731
    out = [f"GPU check, {summary['started_utc']} UTC, device: {summary.get('device') or 'none (CPU rehearsal)'}", ""]
    imp = res("import-check")
    if imp:
        out.append(f"python {imp.get('python')}, torch {imp.get('torch')}, triton {imp.get('triton')}, "
                   f"transformers {imp.get('transformers')}" + (f"; missing: {imp['missing']}" if imp.get("missing") else ""))
        out.append("")
    out += [_table(["stage", "status", "seconds"], [[n, r["status"], _fmt(r.get("seconds"))] for n, r in st.items()]), ""]
    kt = res("kernel-tests")
    if kt:
        out += [f"Kernel tests: {kt.get('passed')} passed, {kt.get('failures')} failed, {kt.get('errors')} errors, "
                f"{kt.get('skipped')} skipped" + (f" ({', '.join(kt['failed'])})" if kt.get("failed") else ""), ""]
    rows = []
    for key, r in res("oracle").items():
        if not isinstance(r, dict):
            continue
        for mode in ("alone", "batched", "chunked", "preempted", "prefix", "graphs"):
            m = r.get(mode)
            if m:
                note = ", ".join(f"{k} {m[k]}" for k in ("preemptions", "prefix_cache_hits_tokens", "vs", "error") if k in m)
                rows.append([key, mode, "yes" if m["equal"] else "no", f"{m['prompts_equal']}/{m['prompts']}",
                             m["median_first_divergence"], note])
    if rows:
        out += ["Oracle (greedy tokens vs transformers; fp32 must be equal, bf16 reports the first divergence):", "",
                _table(["model/dtype", "mode", "equal", "prompts equal", "median first divergence", "notes"], rows), ""]
    rf = res("roofline")
    if rf.get("rows"):
        out += [rf.get("header_line", ""), "",
                _table(["batch", "context", "KV+Q+O MiB", "Triton µs", "Triton TB/s", "of roofline", "torch µs", "speedup"],
                       [[r.get(k) for k in ("batch", "context", "mib", "us", "tbps", "fraction", "ref_us", "speedup")]
                        for r in rf["rows"]]), "", rf.get("target_line", ""), ""]
    tp = {n.removeprefix("throughput-"): res(n) for n in st if n.startswith("throughput-") and res(n).get("output_tok_s")}
    if tp:
        hf = tp.get("hf-cb", {}).get("output_tok_s")
        out += [_table(["system", "output tok/s", "wall s", "output tokens", "vs hf-cb"],
                       [[n, _fmt(r["output_tok_s"]), _fmt(r["wall_s"], ".1f"), r["output_tokens"],
                         _fmt(r["output_tok_s"] / hf, ".2f") + "x" if hf else ""] for n, r in tp.items()]), ""]
    sy = res("syncs")
    if sy.get("eager") or sy.get("graphs"):
        out += [_table(["engine", "host syncs per decode step (target 1)", "sites"],
                       [[n, _fmt(sy[n]["syncs_per_step"], ".1f"), "; ".join(f"{c}× {s}" for s, c in sy[n]["sites"].items())]
                        for n in ("eager", "graphs") if n in sy]), ""]
    par = res("parallel")
    if par:
        out += [f"Tensor parallel {par.get('tensor')} ({par.get('device')}, {par.get('dtype')}): " +
                (f"skipped, {par['skipped']}" if par.get("skipped") else
                 f"{par.get('equal')}/{par.get('prompts')} prompts token-equal to one process (first divergences "
                 f"{par.get('first_divergence')}), ranks started in {par.get('start_s')} s"), ""]
    kv = res("kv-sizing")
    if kv:
        out += [f"KV sizing (defaults): {kv.get('kv_log_line')}; {kv.get('num_blocks')} blocks, "
                f"{_fmt((kv.get('kv_cache_bytes') or 0) / 2**30, '.1f')} GiB; device memory used after start-up: "
                f"{(kv.get('device_memory_after') or {}).get('used_fraction')}", ""]
    return "\n".join(out)
