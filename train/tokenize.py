"""Tokenize training conversations once into a cache that training runs read (train.data_file=DIR).

    python -m train.tokenize --tokenizer DIR --data FILE [FILE ...] --out DIR [--workers N] \
        (--config PRESET [section.key=value ...] | --max-length N --min-length N) \
        [--system-prompt TEXT] [--enable-thinking true|false] [--shard-lines N]

The settings must be the run's, or the trainer refuses the cache as stale: `--config` takes them
from a training preset and overrides (train.max_length, drafter block size + 1, train.system_prompt,
train.enable_thinking, and the tokenizer from train.tokenizer_dir or train.target_dir when
--tokenizer is not given); the flags set or override them one by one.

Rerunning the same command after an interruption finishes the cache, skipping the shards already
written; an output directory holding a cache of other inputs or settings is refused. The cache's
bytes do not depend on --workers.
"""

import argparse
import sys
import time

import yaml

from dspark_jax.errors import ConfigError, DSparkError


def _optional_bool(text: str) -> bool:
    value = yaml.safe_load(text)
    if not isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def settings_from(args) -> tuple[str, dict]:
    """(tokenizer dir, the cache settings) from --config and the flags."""
    settings = {"max_length": None, "min_length": None, "system_prompt": None, "enable_thinking": None}
    tokenizer = args.tokenizer
    if args.config:
        from dspark_jax.config import load_config, preset_path

        cfg = load_config(preset_path(args.config), args.overrides)
        settings = {"max_length": cfg.train.max_length, "min_length": cfg.drafter.proposal_length + 1,
                    "system_prompt": cfg.train.system_prompt, "enable_thinking": cfg.train.enable_thinking}
        tokenizer = tokenizer or cfg.train.tokenizer_dir or cfg.train.target_dir
    elif args.overrides:
        raise ConfigError(f"overrides {args.overrides} need --config")
    for key in settings:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    missing = [f"--{k.replace('_', '-')}" for k in ("max_length", "min_length") if settings[k] is None]
    if missing:
        raise ConfigError(f"tokenize: give --config or {' and '.join(missing)}")
    if not tokenizer:
        raise ConfigError("tokenize: give --tokenizer (or a --config with train.tokenizer_dir or train.target_dir)")
    return tokenizer, settings


def main(argv=None) -> int:
    from dspark_jax.training.token_cache import DEFAULT_SHARD_LINES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="directory with tokenizer.json and the chat template")
    ap.add_argument("--data", nargs="+", required=True, help="JSONL conversation files, in order")
    ap.add_argument("--out", required=True, help="cache directory to write (or finish)")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    ap.add_argument("--shard-lines", type=int, default=DEFAULT_SHARD_LINES,
                    help=f"input lines per shard (default {DEFAULT_SHARD_LINES})")
    ap.add_argument("--config", help="training preset the settings are taken from (a path or a name)")
    ap.add_argument("--max-length", type=int)
    ap.add_argument("--min-length", type=int, help="shortest record kept: the drafter's block size + 1")
    ap.add_argument("--system-prompt", help="system prompt put before conversations without one")
    ap.add_argument("--enable-thinking", type=_optional_bool, help="handed to the chat template")
    ap.add_argument("overrides", nargs="*", help="section.key=value for --config")
    args = ap.parse_args(argv)

    from dspark_jax.training.token_cache import tokenize_corpus

    try:
        tokenizer, settings = settings_from(args)
        print(f"settings: {settings}; tokenizer {tokenizer}", flush=True)
        t0 = time.perf_counter()
        manifest = tokenize_corpus(tokenizer, args.data, args.out, workers=args.workers,
                                   shard_lines=args.shard_lines, log=lambda s: print(s, flush=True),
                                   **settings)
        seconds = time.perf_counter() - t0
        read = manifest["stats"]["records_read"]
        print(f"{args.out}: {manifest['num_records']} records kept of {read} read "
              f"({manifest['stats']}); {seconds:.1f} s, {read / max(seconds, 1e-9):,.0f} records/s "
              f"with {args.workers} worker(s)", flush=True)
        return 0
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
