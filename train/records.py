"""Show training records as the drafter will train on them.

    python -m train.records --target DIR --data FILE [--jsonl OUT] [--max-length N] [--limit N]
        [--min-length N] [--enable-thinking true|false] [--color auto|always|never]

Each record of FILE is rendered with DIR's chat template and tokenized as training does it
(DESIGN §9, dspark_jax/formats/records.py), cut to --max-length; printed with its token and
supervised counts and its supervised text marked (green on a terminal, ⟦ ⟧ otherwise). Records
that cannot be trained on are listed with file:line and the reason, and the walk goes on.
--jsonl OUT writes {"id", "input_ids", "loss_mask"} per kept record.
"""

import argparse
import sys

from dspark_jax.errors import DSparkError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="directory with tokenizer.json (and its chat template)")
    ap.add_argument("--data", required=True, help="JSONL training records")
    ap.add_argument("--jsonl", default="", help="write the kept records' ids and loss masks here")
    ap.add_argument("--max-length", type=int, default=4096, help="tokens kept per record (as train.max_length)")
    ap.add_argument("--min-length", type=int, default=2, help="shorter records are skipped (training: block + 1)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N records (0 = all)")
    ap.add_argument("--enable-thinking", choices=("true", "false"), default=None,
                    help="hand enable_thinking to the template (default: not passed, as train.enable_thinking)")
    ap.add_argument("--system-prompt", default=None,
                    help="prepended to conversations without their own system message (default: the "
                         "template family's, as train.system_prompt; '' for none)")
    ap.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    args = ap.parse_args(argv)
    if args.max_length < 2 or args.min_length < 2 or args.limit < 0:
        ap.error("--max-length and --min-length must be >= 2 and --limit >= 0")

    from dspark_jax.formats.tokenizer import load_tokenizer
    from dspark_jax.training.record_view import (
        check_output,
        format_view,
        summarize,
        view_records,
        write_training_jsonl,
    )

    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    thinking = None if args.enable_thinking is None else args.enable_thinking == "true"
    try:
        if args.jsonl:
            check_output(args.jsonl, args.data)
        tokenizer = load_tokenizer(args.target)
        views = []
        for view in view_records(args.data, tokenizer, max_length=args.max_length, min_length=args.min_length,
                                 enable_thinking=thinking, system_prompt=args.system_prompt,
                                 limit=args.limit):
            views.append(view)
            print(format_view(tokenizer, view, color=color) + "\n", flush=True)
        written = write_training_jsonl(views, args.jsonl, source=args.data) if args.jsonl else None
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = summarize(views)
    print(f"{s['records']} records: {s['kept']} kept ({s['tokens']} tokens, {s['supervised']} supervised, "
          f"{s['truncated']} cut to {args.max_length}); skipped {s['errors']} bad, {s['no_assistant']} without "
          f"an assistant turn, {s['too_short']} too short")
    if written is not None:
        print(f"wrote {written} records to {args.jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
