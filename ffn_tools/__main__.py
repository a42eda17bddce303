"""``python -m ffn_tools``: the same command line as ``ffn-tools``."""

from .cli import main

main()
