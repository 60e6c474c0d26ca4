"""``python -m ampflow.cli``: what torchrun runs in every process of a launched plan."""

import sys

from . import main

sys.exit(main())
