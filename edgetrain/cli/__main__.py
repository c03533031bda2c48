"""``python -m edgetrain.cli``: the same as the ``edgetrain`` command."""

from edgetrain.cli import main

main()
