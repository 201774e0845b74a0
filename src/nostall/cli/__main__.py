"""``python -m nostall.cli``: the ``nostall`` command."""

from nostall.cli import main

main()
