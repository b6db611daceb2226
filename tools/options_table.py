"""Print the README's options table, made from the options table of `enable_model_cpu_offload`
(`diffusers_offload_ext/runtime/options.py`), or with `--write` put it in README.md between its markers.

    PYTHONPATH=. .venv/bin/python tools/options_table.py --write

`tests/test_structure.py` checks that README.md holds exactly this table.
"""

import pathlib
import sys

from diffusers_offload_ext.runtime.options import markdown_table

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- options table: made from diffusers_offload_ext/runtime/options.py by tools/options_table.py -->"
END = "<!-- end of the options table -->"


def readme_with_table(text: str) -> str:
    """`text` (README.md) with the table between the markers made afresh."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


def main(argv) -> int:
    if argv[1:] == ["--write"]:
        README.write_text(readme_with_table(README.read_text()))
        return 0
    print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
