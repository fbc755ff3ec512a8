"""``python -m node_probe.sim``: run one simulated engine (see :func:`node_probe.sim.main`)."""

import sys

from node_probe.sim.cli import main

sys.exit(main())
