"""`python -m attnc ...` is the `attnc` command."""
import sys

from attnc.compiler.cli import main

sys.exit(main())
