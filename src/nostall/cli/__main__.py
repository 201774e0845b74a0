"""``python -m nostall.cli``: the ``nostall`` command."""

from nostall.cli import main

if __name__ == "__main__":  # (not when a spawned process imports it as __mp_main__)
    main()
