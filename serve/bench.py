"""Serving benchmarks. `concurrency`: output tokens/s against the number of concurrent requests for
plain decoding, fixed verification lengths and the load-aware schedulers (the paper's Fig. 7, 8).
`reproduce`: the paper's findings on the bundled models, written to BENCHMARKS.md (serve/reproduce.py;
`python -m serve.bench reproduce --help`).

    python -m serve.bench concurrency [--target DIR --drafter DIR] [--prompts FILE ...] --out DIR
        [--levels 1,2,4,8,16,32] [--temperatures 0,1] [--schedulers plain,fixed1,fixed,greedy,async]
        [--max-new-tokens 128] [--requests-per-slot 8] [--min-requests 32] [--repeats 3]
        [--ignore-eos] [--max-len 0]
        [--prefill-buckets ...] [--sts FILE|none] [--limit N] [--seed 0] [--no-compile-cache]

Without --target and --drafter: the bundled pair (tiny, tiny-dspark) and its held-out prompts of the
three domains (--limit N: the first N of each file).

Schedulers: plain (the target alone), fixed1 = fixed(1), fixed = fixed(γ), greedy, async. For each
concurrency c (the engine's slot count R) and scheduler one engine is built and warmed up (every
program compiles; greedy and async load their SPS profile from the user's cache directory, or
measure and cache it), one untimed pass decodes c requests of 8 tokens, then for each temperature a
timed run decodes c x --requests-per-slot requests whose prompts cycle through the prompt files
taken in turn (one of each file, then the next of each: every level sees the domains mixed alike),
and at least --min-requests of them (a run of 1 slot x 4 requests lasts under a second here: the
warm-up of the load-aware schedulers and the machine's jitter would be most of it); a finished
request's slot is refilled from the queue at once, so all slots stay full until it
drains. Requests stop at the tokenizer's stop tokens (--ignore-eos: every request runs to
--max-new-tokens, as serving benchmarks' flag of that name). The engines of one level are built
first and their timed runs interleaved, --repeats times, the median kept: this machine's speed
drifts between runs more than the differences measured, so every other repeat runs them in reverse
order. async's ratios are paired by repeat: each repeat's async over the best baseline (the one
with the highest median) in that repeat, then the median over the repeats. Throughput is measured at full load: the
output tokens read back until the last request was admitted over the time until then (every slot
busy, prefills included, the drain excluded; the whole run's figure is in the JSON as well).
Tokens/s per user is a request's tokens after its first over its time since admission. At T = 0 the
first timed run's outputs of every scheduler are compared with plain decoding's, token for token
(`same_as_plain` in the JSON).

Writes into --out: concurrency.json (command, device, models, every row), concurrency.md (the tables
printed at the end), throughput.png (tokens/s and mean budget per request against c), pareto.png
(tokens/s against tokens/s per user, one panel per temperature).
"""

import argparse
import dataclasses
import gc
import hashlib
import itertools
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from dspark_jax.errors import DSparkError
from serve import cli, reproduce

# name -> SchedulerConfig(kind, verify_len) arguments; None: the target alone.
SCHEDULERS = {"plain": None, "fixed1": ("fixed", 1), "fixed": ("fixed", 0),
              "greedy": ("greedy", 0), "async": ("async", 0)}
BASELINES = ("plain", "fixed1", "fixed")
WARM_TOKENS = 8
PROMPT_ORDER = "round-robin over the prompt files"
RECORDED = ("full_load_tokens_per_s", "output_tokens_per_s", "tokens_per_s_per_request", "tau",
            "acceptance_rate",
            "mean_verified", "mean_budget", "full_load_mean_budget", "buckets", "rounds", "elapsed_s", "output_tokens",
            "compilations_after_warmup")
LINE_STYLES = ("-", "--", ":", "-.")


def _numbers(text: str, kind, ok) -> list | None:
    """Comma-separated values without repeats; None when one is malformed or fails `ok`."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        return None
    return list(dict.fromkeys(values)) if values and all(map(ok, values)) else None


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m serve.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="benchmark", required=True)
    c = sub.add_parser("concurrency", help="throughput against the number of concurrent requests",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_flags(c)
    for action in c._actions:  # the slot counts come from --levels
        if action.dest == "slots":
            action.help = argparse.SUPPRESS
    c.set_defaults(slots=None)
    cli.add_drafter_flag(c)
    c.add_argument("--prompts", nargs="+", default=["math", "code", "chat"],
                   help="JSONL prompt file(s) or bundled prompt sets (default: math code chat)")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--levels", default="1,2,4,8,16,32", help="concurrencies (slot counts)")
    c.add_argument("--temperatures", default="0,1")
    c.add_argument("--schedulers", default=",".join(SCHEDULERS), help=", ".join(SCHEDULERS))
    c.add_argument("--max-new-tokens", type=int, default=128, help="every request's budget")
    c.add_argument("--requests-per-slot", type=int, default=8,
                   help="timed requests = c x this (>= 2: the queue must outlast the first wave)")
    c.add_argument("--min-requests", type=int, default=32,
                   help="timed requests at least (low concurrencies: runs long enough to measure)")
    c.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median kept)")
    c.add_argument("--ignore-eos", action="store_true", help="decode every request to its budget")
    c.add_argument("--sts", default="", help="calibration temperatures (sts.json); default: the "
                   "drafter directory's sts.json when present; 'none': raw confidences")
    c.add_argument("--limit", type=int, default=0, help="at most this many prompts per file")
    reproduce.add_parser(sub)
    args = ap.parse_args(argv)
    if args.benchmark == "reproduce":
        return args
    problems = []
    if args.limit < 0:
        problems.append(f"--limit {args.limit}: must be >= 0")
    if args.slots is not None:
        problems.append("--slots: the slot counts are given by --levels")
    levels = _numbers(args.levels, int, lambda v: v >= 1)
    temperatures = _numbers(args.temperatures, float, lambda v: 0 <= v < float("inf"))
    if levels is None:
        problems.append(f"--levels {args.levels!r}: expected positive integers, e.g. 1,2,4,8")
    if temperatures is None:
        problems.append(f"--temperatures {args.temperatures!r}: expected numbers >= 0, e.g. 0,1")
    args.levels, args.temperatures = sorted(levels or [1]), temperatures
    args.schedulers = list(dict.fromkeys(s.strip() for s in args.schedulers.split(",") if s.strip()))
    unknown = [s for s in args.schedulers if s not in SCHEDULERS]
    if unknown or not args.schedulers:
        problems.append(f"--schedulers: unknown {', '.join(unknown) or '(none given)'}; "
                        f"expected some of {', '.join(SCHEDULERS)}")
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.repeats < 1:
        problems.append(f"--repeats {args.repeats}: must be >= 1")
    if args.requests_per_slot < 2:
        problems.append(f"--requests-per-slot {args.requests_per_slot}: must be >= 2")
    if args.min_requests < 0:
        problems.append(f"--min-requests {args.min_requests}: must be >= 0")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        problems.append(f"--out {args.out}: is a file; expected a directory")
    args.slots = max(args.levels)
    problems += cli.engine_flag_problems(args)  # fills in the bundled drafter when none is given
    if args.drafter.lower() == "none" and set(args.schedulers) - {"plain"}:
        problems.append("--drafter none: without a drafter only --schedulers plain can run")
    if args.data_parallel >= 1 and any(level % args.data_parallel for level in args.levels):
        problems.append(f"--levels: each must be a multiple of --data-parallel {args.data_parallel}")
    if problems:
        c.error("; ".join(problems))
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.benchmark == "reproduce":
        return reproduce.main(args, argv)
    command = shlex.join(["python", "-m", "serve.bench", *argv])
    try:
        report = concurrency(args, command)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(report), end="")
    print(f"command: {command}")
    return 0


def concurrency(args, command: str) -> dict:
    import jax

    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.formats.tokenizer import load_tokenizer

    for path in args.prompts:
        if not Path(path).is_file():
            raise DSparkError(f"{path}: prompt file not found")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DSparkError(f"--out {out}: cannot create the directory ({e.strerror or e})") from None
    tokenizer = load_tokenizer(args.target)
    cli.setup_jax(args)
    mesh = cli.make_mesh(args)
    tcfg, tparams, dcfg, dparams, sts, sts_from = cli.load_models(args, mesh)
    max_len = args.max_len or min(2048, tcfg.max_position_embeddings)

    def engine_for(name: str, slots: int) -> Engine:
        shape = {"slots": slots, "max_len": max_len, "prefill_buckets": args.prefill_buckets,
                 "seed": args.seed, "mesh": mesh}
        if SCHEDULERS[name] is None:
            return Engine(tcfg, tparams, **shape)
        return Engine(tcfg, tparams, dcfg, dparams, scheduler=SchedulerConfig(*SCHEDULERS[name]),
                      sts=sts, **shape)

    probe = engine_for("plain", args.levels[0])  # its request checks hold for every engine
    per_file, bad = [], 0
    for path in args.prompts:
        requests, _, errors = cli.read_requests(Path(path), tokenizer, probe.check_request,
                                                max_new_tokens=1, limit=args.limit)
        per_file.append(requests)
        bad += len(errors)
    del probe
    # Round-robin over the files, so that every level's requests mix the domains alike (in file
    # order the small levels would see only the first file's prompts).
    prompts = [r for group in itertools.zip_longest(*per_file) for r in group if r is not None]
    if not prompts:
        raise DSparkError(f"no usable prompt in {', '.join(args.prompts)}")
    if any(len(p.prompt_ids) + args.max_new_tokens > max_len for p in prompts):
        print(f"note: some prompts stop at the end of the context ({max_len}) before "
              "--max-new-tokens", file=sys.stderr)

    def batch(n: int, temperature: float, new_tokens: int, tag: str) -> list:
        # The same ids (random streams) for every scheduler at one (level, temperature).
        stops = () if args.ignore_eos else tuple(tokenizer.stop_token_ids)
        return [dataclasses.replace(prompts[i % len(prompts)], id=f"{tag}-{i}", temperature=temperature,
                                    max_new_tokens=new_tokens, stop_ids=stops) for i in range(n)]

    device = jax.devices()[0]
    report = {"command": command, "jax_version": jax.__version__,
              "device": {"platform": device.platform, "kind": device.device_kind,
                         "count": jax.device_count()},
              "target": str(Path(args.target).resolve()), "calibration": sts_from or None,
              "drafter": str(Path(args.drafter).resolve()) if dcfg else "none",
              "block_size": dcfg.proposal_length if dcfg else None, "max_len": max_len,
              "max_new_tokens": args.max_new_tokens, "requests_per_slot": args.requests_per_slot,
              "min_requests": args.min_requests,
              "repeats": args.repeats, "ignore_eos": args.ignore_eos,
              "prompt_files": args.prompts, "prompt_order": PROMPT_ORDER, "prompts": len(prompts),
              "bad_records": bad, "levels": args.levels,
              "temperatures": args.temperatures, "schedulers": args.schedulers,
              "fingerprint": fingerprint(args), "rows": []}
    for c in args.levels:
        engines = warm_level(c, args.schedulers, engine_for, batch, args.temperatures[0])
        time_level(c, engines, batch, args, report)
        del engines
        gc.collect()
        jax.clear_caches()  # the level's executables: a long sweep must not keep every level's
        report["ratios"] = ratios(report["rows"])
        write(report, out)  # after every level, so a long run keeps what it measured
    return report


def fingerprint(args) -> dict:
    """What the figures were measured with beyond the settings: the decoding code's digest (the
    one SPS profiles are cached under) and a digest of every file of the target and drafter
    directories and of --sts, so that `reproduce` reuses a sweep only for the very same models and
    code (a refitted sts.json or a retrained drafter changes what each scheduler does)."""
    from dspark_jax.decoding.profile import code_fingerprint

    digest = hashlib.sha256()
    paths = [Path(args.target)] + ([Path(args.drafter)] if args.drafter.lower() != "none" else [])
    if args.sts and args.sts.lower() != "none":
        paths.append(Path(args.sts))
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"code": code_fingerprint(), "models": digest.hexdigest()[:16],
            "sts": args.sts or "the drafter directory's"}


def warm_level(c: int, names, engine_for, batch, temperature: float) -> dict:
    """The level's engine per scheduler: `engine_for(name, c)`, warmed up (every program compiled,
    the SPS profile loaded or measured), then one untimed pass of c short requests."""
    engines = {}
    for name in names:
        engines[name] = engine = engine_for(name, c)
        warm_s = engine.warmup()
        engine.generate(batch(c, temperature, WARM_TOKENS, "warm"))
        print(f"c={c} {name}: {engine.compilations} programs in {warm_s:.1f} s"
              + (f"; SPS profile: {engine.profile_source}" if engine.profile else ""),
              file=sys.stderr, flush=True)
    return engines


def time_level(c: int, engines: dict, batch, args, report: dict) -> None:
    """The timed runs of one level: per temperature, max(c x requests per slot, min requests)
    requests (`batch(n, temperature, new_tokens, tag)`) through every engine in turn, --repeats
    times; appends one row per scheduler (its median run) to report["rows"]."""
    for temp in args.temperatures:
        runs = {name: [] for name in engines}
        requests = batch(max(c * args.requests_per_slot, args.min_requests), temp,
                         args.max_new_tokens, f"c{c}-t{temp:g}")
        outputs = {name: {} for name in engines}  # first run's tokens, compared at T = 0
        for repeat in range(args.repeats):
            # Every other repeat in reverse order: the machine's speed drifts within a repeat
            # too, and a scheduler always run last would always meet the same part of the drift.
            order = list(engines.items())
            for name, engine in (order if repeat % 2 == 0 else order[::-1]):
                keep = (lambda r, o=outputs[name]: o.__setitem__(r.id, r.token_ids)) \
                    if repeat == 0 and temp == 0 else (lambda r: None)
                runs[name].append(engine.generate(requests, keep))
        for name, engine in engines.items():
            m = sorted(runs[name], key=lambda m: m["full_load_tokens_per_s"])[len(runs[name]) // 2]
            report["rows"].append({
                "level": c, "temperature": temp, "scheduler": name, "describe": m["scheduler"],
                "requests": len(requests), "sps_profile": engine.profile_source or None,
                "tokens_per_s_runs": [r["full_load_tokens_per_s"] for r in runs[name]],
                # greedy output must equal the target's own, token for token
                "same_as_plain": (outputs[name] == outputs["plain"]
                                  if temp == 0 and "plain" in outputs and name != "plain"
                                  else None),
                **{k: m[k] for k in RECORDED}})
            print(f"c={c} T={temp:g} {name}: {m['full_load_tokens_per_s']:,.1f} tok/s, "
                  f"{m['tokens_per_s_per_request']:,.1f} tok/s per user, tau {m['tau']:.2f}, "
                  f"budget {m['mean_budget']:.2f} ({budget(m):.2f} at full load)", file=sys.stderr,
                  flush=True)


def ratios(rows: list[dict]) -> list[dict]:
    """Per (level, temperature): async / the best of plain, fixed1, fixed, and async / fixed.

    The best baseline is the one with the highest median (`best`); async is compared with that
    one scheduler in every repeat. Taking each repeat's fastest baseline instead would compare
    async with the luckiest of three noisy figures, biased upwards where the baselines tie (at
    low load plain and fixed(1) do, within this machine's noise).

    Paired by repeat: the schedulers of one repeat run back to back, so each repeat gives one
    ratio (async's tokens/s over the best baseline's in that repeat) and the median of those is
    kept. This machine's speed moves by a fifth between runs of identical work, on a time scale
    longer than one scheduler's run, so that the ratio of the per-scheduler medians mixes
    different repeats' speeds; it is kept as `async_over_best_of_medians` (and
    `async_over_fixed_of_medians`), and a row without per-run figures falls back to it.
    """
    by = {(r["level"], r["temperature"], r["scheduler"]): r for r in rows}
    out = []
    for c, temp in dict.fromkeys((r["level"], r["temperature"]) for r in rows):
        a = by.get((c, temp, "async"))
        base = [by[c, temp, s] for s in BASELINES if (c, temp, s) in by]
        base = [max(base, key=lambda r: r["full_load_tokens_per_s"])] if base else []
        fixed = by.get((c, temp, "fixed"))
        q = {"level": c, "temperature": temp, "best": base[0]["scheduler"] if base else None}
        for key, against in (("async_over_best", base), ("async_over_fixed", [fixed] if fixed else [])):
            medians = (a["full_load_tokens_per_s"] / max(r["full_load_tokens_per_s"] for r in against)
                       if a and against else None)
            runs = [r.get("tokens_per_s_runs") for r in [a, *against]] if a and against else None
            if runs and all(runs) and len({len(v) for v in runs}) == 1:
                paired = sorted(x / y for x, y in zip(*runs))
                q[key] = float(np.median(paired))
                q[key + "_runs"] = paired
            else:
                q[key] = medians
            q[key + "_of_medians"] = medians
        out.append(q)
    return out


def markdown(report: dict) -> str:
    """The command, then tokens/s and tokens/s per user, one row per (level, temperature)."""
    scheds = report["schedulers"]
    rows = {(r["level"], r["temperature"], r["scheduler"]): r for r in report["rows"]}
    fmt = lambda v, spec=",.1f": "–" if v is None else format(v, spec)
    extra = [("async budget", lambda q, a: fmt(budget(a), ".2f")),
             ("async / best", lambda q, a: ratio_cell(q, "async_over_best")),
             ("async / fixed", lambda q, a: ratio_cell(q, "async_over_fixed"))] if "async" in scheds else []
    setup = (f"{report['device']['kind']} x{report['device']['count']}, at most "
             f"{report['max_new_tokens']} new tokens per request "
             f"({'stop tokens ignored' if report['ignore_eos'] else 'ending at stop tokens'}), "
             f"{report['requests_per_slot']} requests per slot (at least "
             f"{report.get('min_requests', 0)}), median of {report['repeats']} runs; async's ratios: "
             "median over the repeats of each repeat's ratio to the baseline with the highest "
             "median (the schedulers of a repeat run back to back, every other repeat in reverse "
             "order), the lowest and highest repeat's in brackets: how far this machine's noise "
             "moves one comparison; async budget: drafts verified per request and round beyond the "
             + ("anchor at full load (the drain excluded, as in the tokens/s)"
                if all(r.get("full_load_mean_budget") is not None for r in report["rows"])
                else "anchor over every round, the drain included (measured before the full-load "
                     "figure was recorded)"))
    lines = [f"`{report['command']}`", "", setup, ""]
    for title, key, cols in (("Output tokens/s at full load", "full_load_tokens_per_s", extra),
                             ("Tokens/s per user", "tokens_per_s_per_request", [])):
        head = ["c", "T", *scheds, *(name for name, _ in cols)]
        lines += [title, "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for q in report["ratios"]:
            c, t = q["level"], q["temperature"]
            cells = [str(c), f"{t:g}", *(fmt(rows.get((c, t, s), {}).get(key)) for s in scheds),
                     *(get(q, rows.get((c, t, "async"), {})) for _, get in cols)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def budget(row: dict) -> float | None:
    """A row's mean budget per request at full load (the drain excluded, as its tokens/s), or over
    every round for a row measured before that was recorded."""
    full = row.get("full_load_mean_budget")
    return row.get("mean_budget") if full is None else full


def ratio_cell(q: dict, key: str) -> str:
    """A paired ratio as the median over the repeats with the lowest and highest in brackets
    ("0.97 (0.91-1.04)"); the median alone from one repeat, "–" when there is none."""
    if q.get(key) is None:
        return "–"
    runs = q.get(key + "_runs") or []
    spread = f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
    return f"{q[key]:.2f}{spread}"


def write(report: dict, out: Path) -> None:
    (out / "concurrency.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "concurrency.md").write_text(markdown(report))
    plot_throughput(report, out / "throughput.png")
    plot_pareto(report, out / "pareto.png")


def _series(report: dict, scheduler: str, temperature: float) -> list[dict]:
    return sorted((r for r in report["rows"] if r["scheduler"] == scheduler
                   and r["temperature"] == temperature), key=lambda r: r["level"])


def _figure(panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * panels, 4.2))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, panels, squeeze=False)[0]


def plot_throughput(report: dict, path: Path) -> None:
    """Fig. 7: tokens/s and mean budget per request against concurrency (log2)."""
    fig, axes = _figure(2)
    for i, name in enumerate(report["schedulers"]):
        for j, temp in enumerate(report["temperatures"]):
            pts = _series(report, name, temp)
            for ax, value in zip(axes, (lambda r: r["full_load_tokens_per_s"], budget)):
                ax.plot([r["level"] for r in pts], [value(r) for r in pts], color=f"C{i}", marker="o",
                        linestyle=LINE_STYLES[j % 4], label=f"{name}, T={temp:g}")
    levels = sorted({r["level"] for r in report["rows"]})
    for ax, label in zip(axes, ("output tokens / s", "mean budget per request at full load (padding incl.)")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrent requests", ylabel=label)
        ax.set_xticks(levels, [str(v) for v in levels])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"throughput against concurrency ({report['device']['kind']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_pareto(report: dict, path: Path) -> None:
    """Fig. 8: tokens/s against tokens/s per user, joined across levels, labelled by level."""
    fig, axes = _figure(len(report["temperatures"]))
    for ax, temp in zip(axes, report["temperatures"]):
        for i, name in enumerate(report["schedulers"]):
            pts = _series(report, name, temp)
            xy = [(r["tokens_per_s_per_request"], r["full_load_tokens_per_s"]) for r in pts]
            ax.plot(*zip(*xy), color=f"C{i}", marker="o", label=name)
            for r, point in zip(pts, xy):
                ax.annotate(str(r["level"]), point, textcoords="offset points", xytext=(4, 4),
                            fontsize="x-small", color=f"C{i}")
        ax.set(title=f"T = {temp:g} (labels: concurrency)", xlabel="tokens / s per user",
               ylabel="output tokens / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
