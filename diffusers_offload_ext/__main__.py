"""`python -m diffusers_offload_ext`: the `diffusers-offload` command (plan, demo, doctor)."""

import sys

from .cli import main

sys.exit(main())
