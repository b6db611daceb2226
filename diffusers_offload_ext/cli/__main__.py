"""`python -m diffusers_offload_ext.cli`: the `diffusers-offload` command."""

import sys

from . import main

sys.exit(main())
