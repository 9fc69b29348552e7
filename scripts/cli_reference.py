"""Generate the README's CLI reference from the CLI's own --help (so it cannot drift).

    python scripts/cli_reference.py          # print it
    python scripts/cli_reference.py --write  # replace the block between <!-- cli:start --> and <!-- cli:end -->
"""

from __future__ import annotations

import argparse
import os
import sys

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
START, END = "<!-- cli:start -->", "<!-- cli:end -->"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def reference() -> str:
    """Markdown: one fenced --help block per command and prep step."""
    os.environ["COLUMNS"] = "110"
    from vat.cli import build_parser

    parser = build_parser()
    blocks = [("vat", parser)]
    for name, sub in _subparsers(parser).items():
        blocks.append((f"vat {name}", sub))
        for step, subsub in _subparsers(sub).items():
            blocks.append((f"vat {name} {step}", subsub))
    out = []
    for title, p in blocks:
        out += [f"### `{title}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def main() -> None:
    text = reference()
    if "--write" not in sys.argv:
        print(text)
        return
    with open(README) as f:
        readme = f.read()
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(README, "w") as f:
        f.write(f"{head}{START}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    main()
