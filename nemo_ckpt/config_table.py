"""The table of ``CheckpointConfig`` fields on docs/CONFIG.md, made from the model itself.

``python -m nemo_ckpt.config_table`` prints the table; ``--write docs/CONFIG.md`` replaces
the table between that page's markers. tests/house/test_readme.py fails when the two differ, so
a field's description is written once, in ``nemo_ckpt/config.py``.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo

from nemo_ckpt.config import CheckpointConfig

__all__ = ["BEGIN_MARKER", "CONFIG_PAGE", "END_MARKER", "config_table", "replace_table", "main"]

# The page that holds the table, relative to the repository's root (the README links it).
CONFIG_PAGE = "docs/CONFIG.md"

BEGIN_MARKER = ("<!-- CheckpointConfig table: made by `python -m nemo_ckpt.config_table`, "
                "do not edit -->")
END_MARKER = "<!-- end of the CheckpointConfig table -->"

_MIB = 1 << 20


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) is Annotated:
        return _type_name(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        names = [_type_name(arg) for arg in get_args(annotation)]
        # None last, as one writes it.
        return " \\| ".join(sorted(names, key=lambda name: name == "None"))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(name: str, value: Any) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return f"`{value!r}`"
    if isinstance(value, int):
        text = f"`{value:_}`"
        if name.endswith("_bytes") and value % _MIB == 0:
            size = value // _MIB
            text += f" ({size // 1024} GiB)" if size % 1024 == 0 else f" ({size} MiB)"
        return text
    return f"`{value!r}`"


def _rule(field: FieldInfo) -> str:
    rules = []
    for constraint in field.metadata:
        if isinstance(constraint, annotated_types.Gt):
            rules.append(f"> {constraint.gt}")
        elif isinstance(constraint, annotated_types.Ge):
            rules.append(f">= {constraint.ge}")
        elif isinstance(constraint, annotated_types.MinLen):
            rules.append("not empty" if constraint.min_length == 1
                         else f"at least {constraint.min_length} characters")
        elif getattr(constraint, "allow_inf_nan", True) is False:
            rules.append("finite")
    return ", ".join(rules)


def config_table() -> str:
    """The Markdown table of every ``CheckpointConfig`` field, in the model's order."""
    rows = ["| field | type | default | must be | what it does |",
            "|---|---|---|---|---|"]
    for name, field in CheckpointConfig.model_fields.items():
        # Markdown would take "<checkpoint_root>" for an HTML tag and "|" for a cell's end.
        description = " ".join((field.description or "").split())
        description = description.replace("|", "\\|").replace("<", "\\<")
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | "
                    f"{_default(name, field.default)} | {_rule(field)} | {description} |")
    return "\n".join(rows) + "\n"


def replace_table(text: str) -> str | None:
    """``text`` with the table between its markers made anew; None without the markers."""
    begin = text.find(BEGIN_MARKER)
    end = text.find(END_MARKER, begin + 1)
    if begin == -1 or end == -1:
        return None
    return f"{text[:begin]}{BEGIN_MARKER}\n{config_table()}{text[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_ckpt.config_table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, metavar="PAGE",
                        help=f"replace the table between the markers in this file "
                             f"({CONFIG_PAGE})")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(config_table())
        return 0
    new = replace_table(args.write.read_text())
    if new is None:
        print(f"{args.write}: no table markers ({BEGIN_MARKER!r} ... {END_MARKER!r})",
              file=sys.stderr)
        return 1
    args.write.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
