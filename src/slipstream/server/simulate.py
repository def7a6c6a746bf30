"""``slipstream simulate``: what-if runs of the autoscaler in virtual time, and the batching example.

Given arrivals (a rate schedule or a trace file), a cost-model profile and an autoscaling spec,
it plays the arrivals against simulated replicas (the engine's scheduler and KV cache, steps
timed by the cost model, pods ready ``--startup-delay`` seconds after they are asked for) with
the operator's own policy deciding the replica count every ``--tick`` seconds and the gateway's
own router (``--routing``) picking a replica per request; it prints replicas, queue depth, KV
utilization and TTFT p50/p99 over time, TTFT p50/p90/p99 and the prefix-cache hit ratio of the
run, and plots them to a PNG. ``--workload prefix-groups`` gives prompts real token content
(shared system prompts, multi-turn sessions) so the prefix-aware policies have something to find;
``--routing all`` (or a comma-separated list) plays the same arrivals once per policy and prints
them side by side. Nothing sleeps: an hour of traffic takes seconds. ``--example head-of-line``
prints static vs continuous batching on the textbook case instead.

``--trace`` also reads the Azure LLM inference trace's CSV; ``--time-scale`` stretches it;
requests longer than the model's context are capped to it (the count is printed).
``--ttft-p90-objective`` sets the capacity policy's objective and the attainment reported;
``--json`` writes the run's numbers; ``--compare`` plays the same arrivals under the capacity
policy, the queue policy, the Kubernetes HPA algorithm on queue length, fixed counts up to the
first that meets the objective and the clairvoyant per-minute bound, prints one row each (per
``--routing`` policy) and plots the capacity policy beside the cheapest fixed count.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from slipstream.api_types.routing import POLICIES
from slipstream.api_types.autoscaling import CRD_KEYS, POLICIES as SCALING_POLICIES, AutoscalingSpec
from slipstream.api_types.tenancy import DEFAULT_SCHEDULING_POLICY, SCHEDULING_POLICIES

from .cli import HelpFormatter
from .cli_types import non_negative_int, parsed_by, positive_int, tenant_weights
from .gateway.routing.weights import add_weight_flags, weights_from_args
from .sim.cluster import Cluster, ReplicaConfig, SimResult
from .sim.compare import best_fixed, compare_results, compare_rows, compare_table, ms, numbers, tenant_numbers
from .sim.cost_model import PROFILES, get_profile
from .sim.head_of_line import report as head_of_line_report
from .sim.plots import compare_plot, plot
from .sim.scalers import PolicyScaler, Scaler, profile_prior
from .sim.trace import (Arrival, assign_tenants, cap_lengths, parse_length, parse_rate_schedule, parse_tenant_shares,
                        poisson_arrivals, read_trace, scale_times)
from .sim.workloads import PrefixGroups

DEFAULT_RATE = "10rps for 60s, 40rps for 120s, 5rps for 600s"
# AutoscalingSpec field -> (type, help); flags drop "_seconds" (the CRD's names are in --autoscaling files).
# Types, bounds and defaults are the CRD's: AutoscalingSpec.from_dict checks them.
_SPEC_FLAGS = {
    "min_replicas": (int, "fewest replicas (minReplicas, default 1)"),
    "max_replicas": (int, "most replicas (maxReplicas, default 8 here)"),
    "target_queue_depth": (float, "waiting requests per ready pod (targetQueueDepth, default 5)"),
    "target_kv_cache_utilization": (float, "KV-cache use per ready pod, in (0, 1] (default 0.8)"),
    "stable_window_seconds": (int, "whole seconds the load is averaged over (stableWindowSeconds, default 60)"),
    "panic_window_seconds": (int, "whole seconds of the window that reads a step up (panicWindowSeconds; "
                                  "default 8 for the capacity policy, 6 for queue)"),
    "panic_threshold": (float, "capacity: the panic window's rate is the demand while ≥ this × the stable "
                               "window's; queue: panic when the panic window needs this × the pods (default 2)"),
    "scale_down_delay_seconds": (int, "whole seconds lower needs must last before a scale-down "
                                      "(scaleDownDelaySeconds; default 5 measured starts for capacity, "
                                      "300 for queue)"),
    "tolerance": (float, "dead band around the count, in [0, 1) (tolerance; default 0.1 for queue, 0 for capacity)"),
}


def parse_routing(text: str) -> list[str]:
    """``"kv-events"``, ``"round-robin,prefix"`` or ``"all"`` → policy names. Raises
    argparse.ArgumentTypeError naming the known ones."""
    names = list(POLICIES) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"routing policies are {', '.join(POLICIES)} (or all, or a "
                                         f"comma-separated list), got {text!r}")
    return list(dict.fromkeys(names))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream simulate",
        description="Replay arrivals against simulated replicas behind the gateway's router, with the "
                    "operator's autoscaling policy, in virtual time; print and plot replicas, queue depth, "
                    "KV use, TTFT and the prefix-cache hit ratio.",
        formatter_class=HelpFormatter)
    p.add_argument("--example", choices=["head-of-line"],
                   help="print a textbook example instead (head-of-line: static vs continuous batching)")
    p.add_argument("--list-profiles", action="store_true", help="list the cost-model profiles and exit")
    load = p.add_argument_group("load")
    load.add_argument("--rate", default=None, help=f"rate schedule, e.g. '{DEFAULT_RATE}' (the default)")
    load.add_argument("--trace", type=Path, help="trace file: one 'TIME [PROMPT_TOKENS [OUTPUT_TOKENS]]' per line, "
                                                 "or the Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    load.add_argument("--time-scale", type=float, default=1.0,
                      help="multiply arrival times by this (0.5: the same requests at twice the rate)")
    load.add_argument("--max-output-tokens", type=positive_int, default=None,
                      help="cut every output to at most N tokens (default: as the trace says)")
    load.add_argument("--no-cap", action="store_true",
                      help="stop on a request longer than the model's max_model_len instead of capping it")
    load.add_argument("--prompt-tokens", type=parsed_by(parse_length), default="512", help="prompt length, N or A-B (uniform)")
    load.add_argument("--output-tokens", type=parsed_by(parse_length), default="256", help="output length, N or A-B (uniform)")
    load.add_argument("--seed", type=int, default=0, help="seed of arrivals and lengths")
    load.add_argument("--tenants", type=parsed_by(parse_tenant_shares), default=None, metavar="NAME=SHARE,...",
                      help="tenants and their shares of the arrivals, e.g. 'batch=9,chat=1' (each arrival's tenant "
                           "drawn with --seed); the summary gives each tenant's TTFT")
    load.add_argument("--workload", choices=["distinct", "prefix-groups"], default="distinct",
                      help="distinct: prompts share nothing; prefix-groups: each prompt starts with one of "
                           "--groups system prompts and sessions of --turns turns extend their previous turn "
                           "(--output-tokens must be one N; --prompt-tokens is not used)")
    groups = PrefixGroups()
    load.add_argument("--groups", type=int, default=groups.groups, help="prefix-groups: system prompts")
    load.add_argument("--prefix-tokens", type=int, default=groups.prefix_tokens,
                      help="prefix-groups: tokens of each system prompt")
    load.add_argument("--turn-tokens", type=int, default=groups.turn_tokens,
                      help="prefix-groups: tokens of each user message")
    load.add_argument("--turns", type=int, default=groups.turns, help="prefix-groups: turns per session")
    load.add_argument("--think-time", type=float, default=groups.think_time,
                      help="prefix-groups: mean seconds between a session's turns (exponential)")
    pod = p.add_argument_group("replicas")
    pod.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PROFILES), help="cost-model profile")
    pod.add_argument("--max-num-seqs", type=positive_int, help="per replica (default: the profile's)")
    pod.add_argument("--max-num-batched-tokens", type=positive_int, help="per replica (default: the profile's)")
    pod.add_argument("--long-prefill-token-threshold", type=non_negative_int, metavar="N",
                     help="per replica: most prompt tokens one request computes in a step it shares with others "
                          "(slipstream serve's; default 0, no cap)")
    pod.add_argument("--kv-cache-memory-bytes", type=int, help="per replica (default: the profile's memory "
                                                                 "× 0.9 − weights)")
    pod.add_argument("--startup-delay", type=float, default=60.0,
                     help="seconds from scale-up to a new replica taking requests")
    pod.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=DEFAULT_SCHEDULING_POLICY,
                     help="each replica's engine policy (slipstream serve's)")
    pod.add_argument("--tenant-weights", type=tenant_weights, default=None, metavar="NAME=W,...",
                     help="tenants' weights under --scheduling-policy fair (slipstream serve's)")
    pod.add_argument("--no-prefix-caching", action="store_true", help="replicas share no KV blocks between requests")
    pod.add_argument("--routing", type=parse_routing, default="round-robin", metavar="POLICY[,POLICY...]|all",
                     help=f"the gateway's policy ({', '.join(POLICIES)}); round-robin is what a ClusterIP "
                          "Service does; several (or all): one run each on the same arrivals, side by side")
    add_weight_flags(pod)
    auto = p.add_argument_group("autoscaling (defaults: the CRD's, with maxReplicas 8)")
    auto.add_argument("--autoscaling", type=Path,
                      help="YAML: an InferenceService or its spec.autoscaling (camelCase keys); flags override it")
    auto.add_argument("--no-autoscaling", action="store_true", help="keep --initial-replicas throughout")
    auto.add_argument("--policy", choices=SCALING_POLICIES, default=None,
                      help="the autoscaling policy (spec.autoscaling.policy; default capacity)")
    auto.add_argument("--ttft-p90-objective", type=float, default=None, metavar="SECONDS",
                      help="TTFT p90 objective (objectives.ttftP90Seconds, default 2): the capacity policy "
                           "sizes for it; attainment = share of requests whose TTFT met it")
    auto.add_argument("--initial-replicas", type=int, help="replicas ready at time 0 (default: minReplicas)")
    for name, (kind, text) in _SPEC_FLAGS.items():
        flag = "--" + name.replace("_", "-").replace("-seconds", "")
        auto.add_argument(flag, dest=name, type=kind, default=None, metavar=kind.__name__.upper(), help=text)
    auto.add_argument("--tick", type=float, default=2.0, help="seconds between autoscaler decisions")
    out = p.add_argument_group("output")
    out.add_argument("--report-every", type=float, default=10.0, help="seconds per printed row")
    out.add_argument("--plot", type=Path, default=None,
                     help="PNG to write (default: simulate.png, when matplotlib is installed)")
    out.add_argument("--no-plot", action="store_true", help="write no PNG")
    out.add_argument("--json", type=Path, help="write the run's numbers (with --compare: every row's) as JSON")
    out.add_argument("--compare", action="store_true",
                     help="play the arrivals under the capacity policy, the queue policy, the Kubernetes HPA "
                          "algorithm on queue length, fixed counts up to the first that meets the objective "
                          "(at most --max-replicas) and the clairvoyant per-minute bound; one row each, one "
                          "table per --routing policy; --plot draws capacity beside the cheapest fixed count")
    return p


def autoscaling_spec(args: argparse.Namespace) -> AutoscalingSpec:
    """The policy's spec: the file's ``autoscaling`` (or the file itself), then the flags, parsed
    by the operator's own parser (:meth:`AutoscalingSpec.from_dict`: same keys, defaults, checks).
    Raises ValueError for a bad value, an unknown key (named) or a bad file."""
    values: dict[str, Any] = {"maxReplicas": 8}
    if args.autoscaling is not None:
        try:
            data = yaml.safe_load(args.autoscaling.read_text()) or {}
        except UnicodeDecodeError as exc:
            raise ValueError(f"{args.autoscaling}: not UTF-8 text (byte {exc.start})") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{args.autoscaling}: not YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{args.autoscaling}: expected a mapping")
        if "spec" in data:  # an InferenceService: its spec.autoscaling (none: the defaults)
            if not isinstance(data["spec"] or {}, dict):
                raise ValueError(f"{args.autoscaling}: spec must be an object, got {data['spec']!r}")
            data = (data["spec"] or {}).get("autoscaling")
        else:
            data = data.get("autoscaling", data)
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"{args.autoscaling}: spec.autoscaling must be an object, got {data!r}")
        values.update(data or {})
    values["enabled"] = not args.no_autoscaling
    values.update({key: getattr(args, name) for key, name in CRD_KEYS.items()
                   if name in _SPEC_FLAGS and getattr(args, name) is not None})
    if getattr(args, "policy", None) is not None:
        values["policy"] = args.policy
    objectives = values.get("objectives")
    if getattr(args, "ttft_p90_objective", None) is not None and (objectives is None or isinstance(objectives, dict)):
        values["objectives"] = {**(objectives or {}), "ttftP90Seconds": args.ttft_p90_objective}
    return AutoscalingSpec.from_dict(values)


def arrivals(args: argparse.Namespace) -> tuple[list[Arrival], float | None]:
    """The arrivals ``args`` ask for and the run's duration (None: the trace's last arrival).
    Raises ValueError for a bad schedule, file or workload."""
    if args.trace is not None:
        if args.workload != "distinct":
            raise ValueError(f"--workload {args.workload} makes its own arrivals from --rate; drop --trace")
        played = read_trace(args.trace, args.prompt_tokens, args.output_tokens, args.seed)
        return scale_times(played, getattr(args, "time_scale", 1.0)), None
    if getattr(args, "time_scale", 1.0) != 1.0:
        raise ValueError("--time-scale stretches a --trace; a --rate schedule takes its rates and durations")
    phases = parse_rate_schedule(args.rate or DEFAULT_RATE)
    duration = sum(p.duration for p in phases)
    if args.workload == "prefix-groups":
        low, high = args.output_tokens
        if low != high:
            raise ValueError(f"--workload prefix-groups needs one --output-tokens N, got {low}-{high}")
        workload = PrefixGroups(args.groups, args.prefix_tokens, args.turn_tokens, args.turns, low, args.think_time)
        return workload.arrivals(phases, args.seed), duration
    return poisson_arrivals(phases, args.prompt_tokens, args.output_tokens, args.seed), duration


def capped_arrivals(args: argparse.Namespace) -> tuple[list[Arrival], float | None, int]:
    """:func:`arrivals` (with their ``--tenants``) fitted to the profile's ``max_model_len`` (and
    ``--max-output-tokens``) unless ``--no-cap``: (arrivals, duration, how many requests were cut)."""
    played, duration = arrivals(args)
    if getattr(args, "tenants", None):
        played = assign_tenants(played, args.tenants, args.seed)
    if getattr(args, "no_cap", False):
        return played, duration, 0
    played, changed = cap_lengths(played, get_profile(args.profile).model.max_model_len,
                                  getattr(args, "max_output_tokens", None))
    return played, duration, changed


def replica_config(args: argparse.Namespace) -> ReplicaConfig:
    profile = get_profile(args.profile)
    config = ReplicaConfig.for_profile(profile, max_num_seqs=args.max_num_seqs,
                                       max_num_batched_tokens=args.max_num_batched_tokens,
                                       kv_cache_bytes=args.kv_cache_memory_bytes,
                                       scheduling_policy=getattr(args, "scheduling_policy", None),
                                       tenant_weights=getattr(args, "tenant_weights", None),
                                       long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", None))
    return replace(config, prefix_caching=False) if args.no_prefix_caching else config


def cluster(args: argparse.Namespace, spec: AutoscalingSpec, *, routing: str | None = None,
            scaler: Scaler | None = None, initial: int | None = None) -> Cluster:
    """A cluster of ``args``' profile and settings deciding with ``scaler`` (default: the
    operator's policy for ``spec``, with the profile's capacity prior)."""
    profile, config = get_profile(args.profile), replica_config(args)
    if scaler is None:
        scaler = PolicyScaler(spec, profile_prior(profile, config.max_num_seqs, config.max_num_batched_tokens))
    policies = parse_routing(args.routing) if isinstance(args.routing, str) else args.routing
    return Cluster(profile, config, spec, startup_delay=args.startup_delay, tick=args.tick,
                   initial=initial if initial is not None else args.initial_replicas,
                   routing=routing or policies[0], weights=weights_from_args(args), scaler=scaler)


def run(args: argparse.Namespace, routing: str | None = None) -> SimResult:
    """Build the arrivals and the cluster from ``args`` and play them, routed by ``routing``
    (default: the first of ``--routing``)."""
    played, duration, _ = capped_arrivals(args)
    return cluster(args, autoscaling_spec(args), routing=routing).run(played, duration)


def table(result: SimResult, every: float) -> str:
    """One row per ``every`` seconds: the last tick's counts, arrival rate and TTFT over the row."""
    lines = [f"{'time_s':>7} {'rps':>6} {'desired':>7} {'ready':>5} {'start':>5} {'queue':>6} {'running':>7} "
             f"{'kv%':>5} {'ttft_p50_ms':>11} {'ttft_p99_ms':>11}"]
    start, arrivals = 0.0, 0
    for tick in result.ticks:
        arrivals += tick.arrivals
        if tick.time + 1e-9 < start + every and tick is not result.ticks[-1]:
            continue
        p50, p99 = result.ttft_percentiles(start, tick.time)
        lines.append(f"{tick.time:7.0f} {arrivals / max(tick.time - start, 1e-9):6.1f} {tick.desired:7d} "
                     f"{tick.ready:5d} {tick.starting:5d} {tick.queue_depth:6d} {tick.running:7d} "
                     f"{100 * tick.kv_cache_utilization:5.1f} {ms(p50):>11} {ms(p99):>11}")
        start, arrivals = tick.time, 0
    return "\n".join(lines)


def summary(result: SimResult) -> str:
    done = [r for r in result.requests if r.finished is not None]
    p50, p90, p99 = result.ttft_percentiles(quantiles=(0.5, 0.9, 0.99))
    lines = [f"{len(result.requests)} requests, {len(done)} finished by t={result.end_time:.0f}s; "
             f"TTFT p50 {ms(p50)} ms, p90 {ms(p90)} ms, p99 {ms(p99)} ms; "
             f"prefix cache hit {100 * result.prefix_hit_ratio:.1f}% of prompt tokens; "
             f"{result.replica_seconds / 3600:.2f} replica-hours",
             "scaling:"]
    lines += [f"  t={t:7.1f}s {d.current_replicas} -> {d.desired_replicas}: {d.reason}" for t, d in result.scalings]
    if not result.scalings:
        lines.append("  none")
    tenants = tenant_numbers(result)
    if len(tenants) > 1:
        lines.append("tenants:")
        lines += [f"  {name:12} {row['requests']:6d} requests, TTFT p50 {ms(row['ttft_p50_s'])} ms, "
                  f"p90 {ms(row['ttft_p90_s'])} ms; {row['tokens_served']} tokens served"
                  for name, row in tenants.items()]
    return "\n".join(lines)


def compare_runs(args: argparse.Namespace, routing: str | None = None) -> dict[str, dict[str, Any]]:
    """``--compare``'s rows by name for ``args``, routed by ``routing`` (default: the first of
    ``--routing``; see :func:`~.sim.compare.compare_results`)."""
    return compare_rows(*compare(args, routing))


def compare(args: argparse.Namespace, routing: str | None = None) -> tuple[dict[str, SimResult], list[int], float]:
    """:func:`~.sim.compare.compare_results` of ``args``' arrivals (with ``--tenants``), spec and
    replicas, routed by ``routing`` (default: the first of ``--routing``)."""
    played, duration, _ = capped_arrivals(args)
    return compare_results(played, duration, autoscaling_spec(args),
                           lambda spec, scaler, initial: cluster(args, spec, routing=routing, scaler=scaler,
                                                                 initial=initial),
                           args.startup_delay)


def comparison(results: dict[str, SimResult]) -> str:
    """One row per routing policy: requests, TTFT p50/p90/p99, prefix-cache hit ratio, replica-hours."""
    lines = [f"{'routing':<13} {'requests':>8} {'finished':>8} {'ttft_p50_ms':>11} {'ttft_p90_ms':>11} "
             f"{'ttft_p99_ms':>11} {'prefix_hit%':>11} {'replica_h':>9}"]
    for policy, result in results.items():
        p50, p90, p99 = result.ttft_percentiles(quantiles=(0.5, 0.9, 0.99))
        done = sum(r.finished is not None for r in result.requests)
        lines.append(f"{policy:<13} {len(result.requests):8d} {done:8d} {ms(p50):>11} {ms(p90):>11} "
                     f"{ms(p99):>11} {100 * result.prefix_hit_ratio:11.1f} {result.replica_seconds / 3600:9.2f}")
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> None:
    """Flag combinations that cannot mean anything. Raises ValueError saying what to change.
    Settles ``args.plot``: the default plot is skipped, with a note, without matplotlib."""
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401  (only the test extra installs it)
        except ImportError:
            if args.plot is not None:
                raise ValueError(f"--plot {args.plot} needs matplotlib (pip install matplotlib)") from None
            print("slipstream simulate: no plot: matplotlib is not installed (pip install matplotlib)",
                  file=sys.stderr)
            args.no_plot = True
        args.plot = args.plot or Path("simulate.png")
    for flag, path in (("--json", args.json), ("--plot", None if args.no_plot else args.plot)):
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            raise ValueError(f"{flag} {path}: " + ("a directory; name a file" if path.is_dir()
                                                  else f"no directory {path.parent} to write it in"))
    if not (math.isfinite(args.tick) and args.tick > 0):
        raise ValueError(f"--tick must be a finite number of seconds > 0, got {args.tick:g}")
    if not (math.isfinite(args.startup_delay) and args.startup_delay >= 0):
        raise ValueError(f"--startup-delay must be a finite number of seconds ≥ 0, got {args.startup_delay:g}")
    if args.compare and args.no_autoscaling:
        raise ValueError("--compare plays the autoscaling policies beside fixed counts; --no-autoscaling "
                         "(one fixed count) contradicts it: drop one of them")
    spec = autoscaling_spec(args)
    if args.initial_replicas == 0 and not spec.enabled:
        raise ValueError("--initial-replicas 0 with --no-autoscaling is a fixed count of no replicas, which "
                         "serves nothing: give at least 1")
    if args.initial_replicas is not None and spec.enabled and not spec.min_replicas <= args.initial_replicas \
            <= spec.max_replicas:
        raise ValueError(f"--initial-replicas {args.initial_replicas} is outside --min-replicas "
                         f"{spec.min_replicas} .. --max-replicas {spec.max_replicas}: change one of them "
                         f"(or add --no-autoscaling for a fixed count)")


def main_compare(args: argparse.Namespace) -> int:
    """``--compare``: the table (one per ``--routing`` policy), ``--json`` (rows by name, or by
    routing policy then name when several) and ``--plot`` (the capacity policy beside the
    cheapest fixed count that met the objective and the clairvoyant schedule; one file per
    routing policy when several, named ``STEM-POLICY.png``)."""
    played, _, capped = capped_arrivals(args)
    if not played:
        raise ValueError("--compare needs arrivals, and this workload has none (a longer --rate, or a "
                         "trace with rows)")
    if capped:
        print(f"{capped} requests capped to max_model_len")
    every: dict[str, dict[str, dict[str, Any]]] = {}
    for routing in args.routing:
        results, counts, objective = compare(args, routing)
        rows = every[routing] = compare_rows(results, counts, objective)
        if len(args.routing) > 1:
            print(f"routing {routing}:")
        print(compare_table(rows))
        if not args.no_plot:
            path = args.plot if len(args.routing) == 1 else args.plot.with_name(
                f"{args.plot.stem}-{routing}{args.plot.suffix}")
            fixed = best_fixed(rows)
            names = ["capacity"] + ([fixed] if fixed else []) + ["clairvoyant"]
            compare_plot(results, names, path, f"{args.profile}: {args.rate or (args.trace or DEFAULT_RATE)}, "
                         f"{routing} routing", objective)
            print(f"plot: {path}")
    if args.json is not None:
        data = every[args.routing[0]] if len(args.routing) == 1 else every
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.list_profiles:
        for profile in PROFILES.values():
            print(f"{profile.name:16} {profile.description}")
        return 0
    if args.example == "head-of-line":
        print(head_of_line_report())
        return 0
    try:
        check_args(args)
        if args.compare:
            return main_compare(args)
        if len(args.routing) > 1:
            print(comparison({policy: run(args, policy) for policy in args.routing}))
            return 0
        _, _, capped = capped_arrivals(args)
        result = run(args)
        return report(args, result, capped, autoscaling_spec(args).objectives.ttft_p90_seconds)
    except (ValueError, OSError) as exc:  # a bad flag or input, or a file not written
        print(f"slipstream simulate: {exc}", file=sys.stderr)
        return 2


def report(args: argparse.Namespace, result: SimResult, capped: int, objective: float) -> int:
    """One run's table, summary, ``--json`` and ``--plot``. Raises OSError for a file not written."""
    print(table(result, args.report_every))
    print()
    print(summary(result))
    if capped:
        print(f"{capped} requests capped to max_model_len {get_profile(args.profile).model.max_model_len}"
              + (f" and --max-output-tokens {args.max_output_tokens}" if args.max_output_tokens else ""))
    if args.json is not None:
        args.json.write_text(json.dumps({**numbers(result, objective), "capped_requests": capped,
                                         "tenants": tenant_numbers(result)}, indent=2) + "\n")
    if not args.no_plot:
        plot(result, args.plot, f"{args.profile}: {args.rate or (args.trace or DEFAULT_RATE)}")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
