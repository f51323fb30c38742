"""``python -m longpack.cli``: the ``longpack`` command (torchrun runs it so)."""

from . import main

main()
