"""`python -m xtrain.cli`: the `xtrain` command."""
import sys

from xtrain.cli import main

sys.exit(main())
