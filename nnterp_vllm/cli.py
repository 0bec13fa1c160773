"""``nnterp-vllm``: the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _support(args: argparse.Namespace) -> int:
    from .engines.transformers import StandardizedTransformer

    model = StandardizedTransformer(args.model)
    print(json.dumps({"family": model.family.__name__.rsplit(".", 1)[-1], **model.support()}, indent=2))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from .checkpoints import smollm2

    print(smollm2())
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    root = argparse.ArgumentParser(prog="nnterp-vllm", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    support = commands.add_parser("support", help="print which standardized values a model has, and why not")
    support.add_argument("model", help="a checkpoint directory or hub id")
    support.set_defaults(run=_support)
    prepare = commands.add_parser(
        "prepare", help="prepare the embedded default model (SmolLM2-135M) and print its path"
    )
    prepare.set_defaults(run=_prepare)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` by default)."""
    from .errors import UnsupportedFamily

    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (OSError, UnsupportedFamily, ValueError) as error:
        print(f"nnterp-vllm {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
