"""`harts`: the tools around a plan. Each subcommand is a module with `main(argv) -> int`."""
from __future__ import annotations

import importlib
import sys

from harts.console import run_command

SUBCOMMANDS = {
    "demo": ("harts.tools.demo", "generate, compile, check and run a small step on a tiny model, end to end"),
    "stats": ("harts.tools.stats", "summarise a plan (--json for one JSON object)"),
    "check": ("harts.tools.check", "verify every plan invariant (--trees to check tokens too)"),
    "run": ("harts.executor.cli", "run a plan on a Hugging Face model: log-probabilities, loss, gradients"),
    "init-model": ("harts.executor.models.init_model",
                   "write a random model (or a critic from a policy) as a Hugging Face directory"),
    "gen": ("harts.tools.gen", "generate a synthetic agentic workload (stepwise or treestep)"),
    "diff": ("harts.tools.diff", "what changed between two plans (--json for one JSON object)"),
    "viz": ("harts.tools.viz", "write a self-contained HTML page of plots of a plan"),
    "calibrate": ("harts.tools.calibrate", "time a model to fit L2's cost model (hartsc --pairs-per-token)"),
}


def usage() -> str:
    lines = ["usage: harts SUBCOMMAND [ARGS...]", "", "subcommands:"]
    width = max(len(name) for name in SUBCOMMANDS)
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "Run `harts SUBCOMMAND --help` for its flags. The compiler is `hartsc`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"harts: unknown subcommand '{name}'; fix: use one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    return run_command(f"harts {name}", lambda rest: importlib.import_module(SUBCOMMANDS[name][0]).main(rest), rest)


if __name__ == "__main__":
    sys.exit(main())
