"""`harts check PLAN [--trees TREES] [--read-workers N]`: verify every plan invariant
(`harts.schema.plan_invariants`)."""
from __future__ import annotations

import argparse
import sys

from harts.compiler.read_workers import add_read_workers_argument, read_workers
from harts.schema.errors import HartsError, VerificationError
from harts.schema.plan import read_plan
from harts.schema.plan_invariants import check_plan, check_step_counts, check_step_matches
from harts.text import plural

# The per-token and per-trajectory RL fields a plan's step copies from the input file.
STEP_FIELDS = ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "has_old_logprobs", "has_ref_logprobs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts check", description="Verify every invariant of a HARTS plan.")
    parser.add_argument("plan", help="plan file written by hartsc")
    parser.add_argument("--trees", help="the trees.jsonl[.zst] the plan was compiled from: also check every token, "
                                        "the ids, trees and RL fields (masks, advantages, log-probabilities)")
    add_read_workers_argument(parser, "harts check", "what is checked is the same")
    args = parser.parse_args(argv)
    try:
        # A bad --read-workers is refused before the plan (seconds at scale) is read, with or without --trees
        # (without it, auto has no file to size: an unreadable path gives 1).
        workers = read_workers(args.read_workers, args.trees or "")
        if args.read_workers != "auto" and not args.trees:
            print("harts check: warning: --read-workers has no effect without --trees", file=sys.stderr)
        plan = read_plan(args.plan)
        batch = None
        if args.trees:
            from harts.compiler.read_trees import read_trees
            batch = read_trees(args.trees, workers=workers)
        check_plan(plan, *((batch.tokens, batch.token_offsets) if batch else ()))
        check_step_counts(plan)
        if batch:
            check_step_matches(plan.step, batch.ids, {name: getattr(batch, name) for name in STEP_FIELDS},
                               trees=batch.trees)
    except VerificationError as err:   # the plan read, but breaks an invariant: say which plan
        fix = (f"pass the trees file {args.plan} was compiled from, or recompile it from this one"
               if err.invariant == "plan matches --trees" else
               "recompile the plan with hartsc (a plan hartsc writes passes; if it wrote this one, report it)")
        print(f"harts check: {args.plan}: {err}; fix: {fix}", file=sys.stderr)
        return err.exit_code
    except HartsError as err:          # these name their file already
        print(f"harts check: {err}", file=sys.stderr)
        return err.exit_code
    producers = f"{plural(len(plan.producers), 'producer')}, " if plan.producers is not None else ""
    print(f"harts check: {args.plan}: ok ({plural(len(plan.microbatches), 'microbatch')}, {producers}"
          f"{plural(plan.step['num_trajectories'], 'trajectory')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
